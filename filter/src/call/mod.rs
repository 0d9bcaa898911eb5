//! The life of one HTTP request through the filter: read and judge the request, admit or
//! answer it, then read how it went. Plain Rust behind [`CallHost`], so every step is tested
//! natively (see `tests/`); `host/` only forwards Envoy's callbacks here.
//!
//! The rules it keeps:
//! - **Judge exactly what the server executes, or refuse.** Every POST to `/mcp/<service>` is
//!   held until its body is complete (end of stream, or trailers) and read by
//!   [`crate::mcp::request`]; a body it cannot judge never reaches a server.
//! - **Blame a tool only for its own faults.** Errors that blame the request, a client that
//!   went away, a full bulkhead: none of them counts for or against a tool.
//! - **Answer in MCP.** An upstream failure, an open breaker or a refused request reaches the
//!   agent as a JSON-RPC message carrying its request's id, in its framing, never as a bare
//!   HTTP error or an empty body.
//!
//! On the aggregate endpoint (`POST /mcp`, `POST /virtual/<name>`, see [`crate::aggregate`])
//! bodies are held and judged by the same rules. A `tools/call` there is looked up in the
//! virtual server's names, sent to its service's own route with the tool's own name, and from
//! then on is a call of that (service, tool) like any other; its semantic replies name tools
//! as the agent sees them there. Everything else there goes on to toolgate-xds as it is.
//!
//! A server's answer to a `tools/list` on its route is held (within [`HOLD_LIMIT`]) and each
//! tool the gateway would refuse now annotated (see [`crate::mcp::listing`]), as the
//! aggregate endpoint's listing is; no other answer is.
//!
//! A request's life is a state machine (`life`: `Ignored`, `AwaitingEmptyBody`, `Stream`,
//! `Passed`, `Reading`, `Unconfigured`, `Judged`, `Answered`), each state holding only what is
//! valid in it and every move made by `Call::enter`; its answer's are [`Watch`]'s.
//!
//! Where each part lives: `life` (the states and their moves), `request` (headers and body
//! in, each body to its judge), `authorization` (tokens, rules, claims), `admission`
//! (breakers, overrides, batches), `virtual_route` (the aggregate endpoint's names and
//! routing), `held` (sessions held for clients, replays), `response` (what to watch in an
//! answer and its body as it passes), `answer_edit` (links and question ids in routed
//! answers), `listing_watch` (listings, GET streams, offline answers), `outcome` (what an
//! answer means for breakers and health), `host` (the host interface) and `shared` (what a
//! VM's calls share). This file keeps the types a request's life is made of.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;

use toolgate_model::availability::{Availability, Unavailable as NotNow};
use toolgate_model::fleet::BreakerEvent;
use toolgate_model::policy::FilterConfig;
use toolgate_model::BreakerPolicy;

use crate::aggregate::{self, Target, VisibleNames};
use crate::asked;
use crate::auth::{self, Denial};
use crate::breaker::{
    breaker_key, Admission, Breakers, Cause, Force, Outcome, SharedStore, State, Transition,
};
use crate::cancel;
use crate::catalog::{self, Known, Unlisted};
use crate::feedback::{Feedback, Kind};
use crate::fleet;
use crate::held_session;
use crate::mcp::headers::{check_headers, HeaderCheck};
use crate::mcp::jsonrpc::RawId;
use crate::mcp::listing::{edit_message, edit_sse, Edit, Listed, Listing, SseListed};
use crate::mcp::reply::{
    self, BatchAnswer, Framing, OpenCause, ProtocolVersion, Reply, Unavailable, UnavailableKind,
    UpstreamFailure,
};
use crate::mcp::request::{
    completion_ref, nests_deeper_than, read_body, Body, CompletionRef, Refusal, Request, ToolName,
    COMPLETION_COMPLETE, PROMPTS_GET, RESOURCES_READ, RESOURCES_SUBSCRIBE, RESOURCES_UNSUBSCRIBE,
    SERVER_DISCOVER, SET_LEVEL, TOOLS_CALL,
};

use crate::mcp::resource_uri;
use crate::mcp::response::{classify_response, is_client_fault, ResponseClass};
use crate::mcp::sse::SseScanner;
use crate::offline;
use crate::session::{self, Sealer};
use crate::stats::{
    MetricHost, Stats, ToolMetrics, CALLS_UNLISTED, OFFLINE_ANSWERS, RESPONSES_UNREAD,
    TOOLS_LIST_ANNOTATED, TOOLS_LIST_UNREAD, UNSESSIONED_CALLS,
};
use crate::upstream::{verdict, Verdict};
use toolgate_model::auth::{Caller, FilterAuth, Item, Verdict as AuthVerdict, PAYLOAD_HEADER};
use toolgate_model::envoy::{service_cluster, CLUSTER_HEADER};
use toolgate_model::virtual_server::{unprefixed_uri, VirtualRoutes, VirtualTool};

mod admission;
mod answer_edit;
mod authorization;
mod credential;
mod held;
mod host;
mod life;
mod limit;
mod listing_watch;
mod outcome;
mod request;
mod response;
mod shared;
#[cfg(test)]
mod tests;
mod virtual_route;

use admission::*;
use answer_edit::*;
pub use credential::CredentialCache;
use credential::CredentialState;
use held::*;
pub use host::{log_field, Action, CallHost, Level, SESSION_HEADER};
use life::*;
use limit::OverLimit;
pub use limit::{limit_metric, LIMITED_CODE, SERVICE_WIDE};
use response::AnswerHead;
pub use shared::{transition_line, Sealing, Shared};
use virtual_route::*;

/// A JSON response of an admitted call up to this size is held until it is complete, so that
/// an answer that is not the response can be replaced by an MCP reply before the agent sees
/// it. Larger ones stream through (Envoy's per-stream buffer limit is 1 MiB by default).
pub const HOLD_LIMIT: usize = 256 * 1024;
/// A JSON response body larger than this is passed through unjudged rather than copied.
pub const MAX_JSON_RESPONSE: usize = 4 * 1024 * 1024;

pub use toolgate_model::envoy::HELD_HEADER;

/// Whether Envoy's details for a stream that ended before its response was complete blame the
/// upstream: a reset or a timeout on the upstream side. Everything else (the client reset,
/// cancelled or broke its stream: `http2.remote_reset`, `downstream_remote_disconnect`, codec
/// errors of the downstream connection) is no evidence against a tool or its instance.
pub fn upstream_ended(details: &str) -> bool {
    details.starts_with("upstream_") || details.starts_with("response_timeout")
}

/// The upstream instance that served an admitted call, as far as the call feedback knows.
enum Endpoint {
    /// Not asked yet: asking costs a host call, made once per call and only when the answer
    /// can be reported.
    Unread,
    Known(String),
    /// Envoy chose no instance, or did not say.
    Unknown,
}

/// A `tools/call` that went upstream, until its outcome is recorded.
struct Admitted {
    key: String,
    tool: String,
    policy: BreakerPolicy,
    admission: Admission,
    started_ms: u64,
    metrics: Option<ToolMetrics>,
    endpoint: Endpoint,
    /// A tool of a service whose registrations list none, without a breaker yet: its
    /// outcome counts for nothing, but an answer as a tool gives the name one.
    learning: bool,
}

/// What the filter is doing with the response.
enum Watch {
    None,
    /// A JSON response held (headers and body) until complete: `seen` bytes so far.
    Hold,
    /// A JSON response too large to hold, streamed; this call's copy if it came in pieces.
    Json(Vec<u8>),
    Sse(SseScanner),
    /// The stream of a call on the aggregate endpoint that nothing else reads: read only for
    /// the server's questions to the client (`crate::asked`).
    Questions(SseScanner),
    /// The upstream failed: the body is replaced by this reply at the end of the stream.
    Replace(Reply),
    /// A server's `tools/list` answer, held to be annotated: a JSON body until complete
    /// (headers held too), an SSE stream until its response event.
    Listing {
        sse: bool,
    },
    /// The answer to a `resources/read` of a rewritten URI, held whole (within
    /// [`HOLD_LIMIT`]) to give its contents the URI the agent asked for.
    ResourceUri {
        own: String,
        visible: String,
    },
}

/// Seconds a client is told to wait before it opens a GET stream again when no server is
/// there: both official SDKs honour an SSE `retry` only on an open stream, so this is advice
/// (`Retry-After`); neither reconnects in a loop on a 503.
pub const STREAM_RETRY_AFTER_SECS: &str = "5";

/// Response headers for a body the filter writes in place of the server's (set before the
/// body comes): its status and type, and no length or encoding of the server's body.
fn replacing(host: &impl CallHost, status: &str, content_type: &str) {
    host.set_response_header(":status", Some(status));
    host.set_response_header("content-type", Some(content_type));
    host.set_response_header("content-length", None);
    host.set_response_header("content-encoding", None);
}

/// Names `service`'s cluster for the shared routes (toolgate-xds's `shared_service_routes`),
/// which every service without routes of its own takes. A name no service can have gets none:
/// Envoy then answers 404, as for a path no route takes.
fn route_to(host: &impl CallHost, service: &str) {
    if toolgate_model::validate_name("service", service).is_ok() {
        host.set_request_header(CLUSTER_HEADER, Some(&service_cluster(service)));
    }
}

/// The HTTP methods of MCP's transport. Methods are case-sensitive, but a server's framework
/// may not be: "post" is judged like "POST" rather than passed on unread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HttpMethod {
    Post,
    Get,
    Delete,
}

/// Request headers the filter reads: each must be text when present, or the filter would not
/// see what a server may.
const READ_HEADERS: [&str; 8] = [
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
    SESSION_HEADER,
    "accept",
    "authorization",
    "content-encoding",
    "content-length",
];

/// Methods are case-sensitive, but a server's framework may not be: "post" is judged like
/// "POST" rather than passed on unread.
fn is_post(host: &impl CallHost) -> bool {
    host.request_header(":method")
        .is_some_and(|m| m.eq_ignore_ascii_case("POST"))
}

/// One HTTP request (a proxy-wasm HTTP context) through the filter.
pub struct Call<S, M> {
    shared: Rc<RefCell<Shared<S, M>>>,
    /// Where the request is in its life, with what is valid there (see [`Life`]).
    life: Life,
    /// What is being done with the answer: the response's own states (see [`Watch`]).
    watch: Watch,
    service: Option<String>,
    version: ProtocolVersion,
    framing: Framing,
    /// Breaker events for the fleet, for the host to hand to the reporting root context.
    events: Vec<BreakerEvent>,
    /// Session ids of this stream are sealed (an MCP path, with a key configured).
    sealing: bool,
    /// A POST to the aggregate endpoint.
    on_virtual: Option<OnVirtual>,
    /// The session the gateway holds for the client with the called service.
    held: Option<HeldCall>,
    /// The parameters of the `initialize` this request sends (sealed into its session id).
    init_params: Option<String>,
    /// Who is calling, when the auth configuration is on.
    auth: AuthState,
    /// `Mcp-Session-Id` as the client sent it (before unsealing): what its cancellations
    /// name.
    client_session: Option<String>,
    /// The credential of a service whose servers take each caller's own (see `credential`).
    credential: CredentialState,
    /// What was asked for it: the service and the caller's token.
    asked_credential: Option<(String, String)>,
}

impl AuthState {
    fn caller(&self) -> Option<&Caller> {
        self.verified.as_ref().map(|v| &v.caller)
    }
}

/// What the filter knows of the caller, read once from the request headers.
#[derive(Debug, Default)]
struct AuthState {
    /// The verified payload and its caller; `None`: no valid token.
    verified: Option<Rc<auth::Verified>>,
    /// A bearer token came and was refused (by Envoy, or for another resource).
    refused: bool,
    /// The path of the resource addressed (`/mcp/orders`, `/mcp`, `/virtual/ops`).
    path: String,
    /// The client's `Authorization` (removed from the request): the token a service's
    /// credential is exchanged for.
    authorization: Option<String>,
    /// The verified payload as Envoy forwarded it (base64url), while some service's
    /// credential is exchanged: the exchanged token must be the verified one.
    payload: Option<String>,
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    pub fn new(shared: Rc<RefCell<Shared<S, M>>>) -> Self {
        Call {
            shared,
            life: Life::Ignored,
            watch: Watch::None,
            service: None,
            version: ProtocolVersion::V2025_03_26,
            framing: Framing::Json,
            events: Vec::new(),
            sealing: false,
            on_virtual: None,
            held: None,
            init_params: None,
            auth: AuthState::default(),
            client_session: None,
            credential: CredentialState::None,
            asked_credential: None,
        }
    }

    /// The breaker events this call produced since the last take.
    pub fn take_events(&mut self) -> Vec<BreakerEvent> {
        std::mem::take(&mut self.events)
    }

    fn log_field(&self, host: &impl CallHost, name: &str, value: &str) {
        // Without an access log these host calls would be for nothing.
        if self.shared.borrow().config.access_log {
            host.set_property(name, value.as_bytes());
        }
    }
}
