//! What a call asks of its host (Envoy through proxy-wasm, or the tests' stand-in): headers,
//! bodies, local replies, properties, logs and callouts, and what it tells the host back.

use super::*;

/// What to tell Envoy after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Hold the headers or buffer the body (Envoy's StopIteration / StopIterationAndBuffer).
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
}

/// What the call lifecycle needs from Envoy.
pub trait CallHost {
    fn now_ms(&self) -> u64;
    fn request_header(&self, name: &str) -> Option<String>;
    /// Whether the request has header `name` at all, even with a value that is not UTF-8
    /// (which [`CallHost::request_header`] cannot return).
    fn request_header_present(&self, name: &str) -> bool;
    fn set_request_header(&self, name: &str, value: Option<&str>);
    /// The buffered request body, `len` bytes from the start.
    fn request_body(&self, len: usize) -> Option<Vec<u8>>;
    /// Replaces the buffered request body (`len` bytes) with `body`.
    fn set_request_body(&self, len: usize, body: &[u8]);
    fn response_header(&self, name: &str) -> Option<String>;
    fn set_response_header(&self, name: &str, value: Option<&str>);
    /// The response body chunk (or buffered body) at hand, `len` bytes.
    fn response_body(&self, len: usize) -> Option<Vec<u8>>;
    fn set_response_body(&self, len: usize, body: &[u8]);
    /// A local reply in place of the upstream's (or before one), with `headers` besides its
    /// content type.
    fn send_reply(&self, status: u32, reply: &Reply, headers: &[(&str, &str)]);
    /// A stream property (`["response", "code_details"]`, `["upstream", "address"]`).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// A property of the stream, which Envoy keeps as the filter state `wasm.<name>` (read by
    /// the access log's format and by the bootstrap's local-reply mapping).
    fn set_property(&self, name: &str, value: &[u8]);
    fn log(&self, level: Level, message: &str);
    /// Asks toolgate-xds (the control cluster) at `path`; its answer comes to
    /// [`Call::on_dispatch_response`] with the token returned. `None`: the question could not
    /// be sent.
    fn dispatch(&self, path: &str, body: &[u8], authorization: &str) -> Option<u32>;
    /// Lets a request paused for a question go on.
    fn resume_request(&self);
    /// Lets a response paused for a question go on.
    fn resume_response(&self);
    /// A local reply of a server's own answer (status, content type, body as it sent them),
    /// with `headers` besides.
    fn send_raw(&self, status: u32, content_type: &str, body: &[u8], headers: &[(&str, &str)]);
}

/// The session header (HTTP header names are case-insensitive; Envoy keeps them lower case).
pub const SESSION_HEADER: &str = "mcp-session-id";

/// Names of the access-log fields the filter sets (a contract with the bootstrap's format).
pub mod log_field {
    pub const METHOD: &str = "mcp_method";
    /// The verified caller's `sub` (issue 20), and why a caller was refused.
    pub const SUBJECT: &str = "mcp_subject";
    pub const DENIED: &str = "mcp_denied";
    pub const TOOL: &str = "mcp_tool";
    pub const BREAKER: &str = "mcp_breaker";
    /// The call limit (its rule's name) that refused a request.
    pub const LIMIT: &str = "mcp_limit";
    /// The service a request was judged for (on `/mcp` too, where the path does not say).
    pub const SERVICE: &str = "mcp_service";
    /// The audit trail's verdict on a `tools/call` (`allowed`, `limited`, `denied`,
    /// `refused`) and its reason (a rule, a denial, a breaker state).
    pub const DECISION: &str = "mcp_decision";
    pub const REASON: &str = "mcp_reason";
}
