//! How toolgate checks that an MCP server instance is alive, at three depths:
//!
//! - [`http`]: `GET health_path` answers 2xx (a health endpoint the server chose to have);
//! - [`mcp`]: the MCP endpoint answers an MCP request, in the newest revision both sides speak
//!   (a wedged MCP handler behind a live HTTP stack fails it);
//! - [`tcp`]: a TCP connect succeeds (the weakest: a frozen process's kernel still accepts).
//!
//! toolgate-xds probes with them; toolgate-register uses them to pick a kind, to wait for a
//! server before registering it, and (through [`mcp::McpClient`]) to list its tools.

pub mod http;
pub mod mcp;
pub mod tcp;

use std::time::Duration;

/// What went wrong on the wire, in words an operator would search for.
pub(crate) fn describe_reqwest(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return format!("no answer within {}ms", timeout.as_millis());
    }
    // The root cause says what happened ("Connection refused"), the wrappers only "error
    // sending request".
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    if e.is_connect() {
        format!("connect failed: {source}")
    } else {
        format!("request failed: {source}")
    }
}
