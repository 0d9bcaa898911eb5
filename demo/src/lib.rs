//! Sample MCP servers for `make demo` and the configurable lab server the tests use.
//!
//! Both binaries share one server skeleton ([`http`]): an axum router with
//! `/mcp` (rmcp's Streamable HTTP transport, built by [`mcp`]) and `/health`, a
//! listener whose connections can be torn down with a TCP reset, and a clean
//! stop on SIGTERM/SIGINT ([`shutdown`]).

pub mod http;
pub mod lab;
pub mod logging;
pub mod mcp;
pub mod services;
pub mod shutdown;
