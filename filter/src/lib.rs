//! toolgate's Envoy filter. The logic lives in plain Rust modules tested natively:
//! `mcp/` reads JSON-RPC requests and responses and writes MCP replies, `breaker/` keeps the
//! per-(service, tool) circuit breakers, `upstream` names what went wrong upstream, `stats`
//! names and caches the per-(service, tool) Envoy stats, `feedback` counts call outcomes per
//! upstream endpoint for toolgate-xds, `fleet` applies what the other gateways and operators
//! decided and renders this gateway's breaker events.
//! `keeper` keeps the last configuration the VM accepted, so a refused one never leaves it
//! judging nothing.
//! `catalog` says which services and tools get breakers, `session` seals the upstream address
//! out of `Mcp-Session-Id`, `call` is the life of one request through the filter behind a host
//! trait. `aggregate` recognises the aggregate endpoint's paths and restores a tool's own
//! name in a call made there. `host/` is the only code that calls proxy-wasm.

pub mod aggregate;
pub mod asked;
pub mod auth;
pub mod breaker;
pub mod call;
pub mod cancel;
pub mod catalog;
pub mod feedback;
pub mod fleet;
pub mod header_map;
pub mod held_session;
pub mod keeper;
pub mod limits;
pub mod mcp;
pub mod offline;
pub mod session;
pub mod stats;
pub mod upstream;

#[cfg(target_arch = "wasm32")]
mod host;
