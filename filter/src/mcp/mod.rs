//! MCP on the wire, as the filter needs it: `jsonrpc` reads requests and JSON responses,
//! `sse` finds the response in a streamed one, `reply` writes the messages the filter sends in
//! the server's place. Plain Rust without proxy-wasm, so all of it is tested natively.

pub mod jsonrpc;
pub mod reply;
pub mod sse;
