//! toolgate's Envoy filter. The logic lives in plain Rust modules tested natively:
//! `mcp/` reads JSON-RPC requests and responses and writes MCP replies, `breaker/` keeps the
//! per-(service, tool) circuit breakers, `upstream` names what went wrong upstream, `stats`
//! names and caches the per-(service, tool) Envoy stats, `feedback` counts call outcomes per
//! upstream endpoint for toolgate-xds, `fleet` applies what the other gateways and operators
//! decided and renders this gateway's breaker events.
//! `host.rs` is the only file that calls proxy-wasm.

pub mod breaker;
pub mod feedback;
pub mod fleet;
pub mod mcp;
pub mod stats;
pub mod upstream;

#[cfg(target_arch = "wasm32")]
mod host;
