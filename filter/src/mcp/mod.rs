//! MCP on the wire, as the filter needs it: `request` reads a request body exactly or refuses
//! it, `headers` checks the 2026-07-28 request headers against the body, `response` and `sse`
//! read the answer, `listing` annotates a server's `tools/list` answer, `resource_uri`
//! gives a rewritten resource URI back in a read's answer, `reply` writes the
//! messages the gateway sends in the server's place, and `jsonrpc` holds what they share. Plain Rust without proxy-wasm, so all of it is tested
//! natively.

pub mod headers;
pub mod jsonrpc;
pub mod listing;
pub mod reply;
pub mod request;
pub mod resource_uri;
pub mod response;
pub mod sse;
