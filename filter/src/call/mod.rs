//! The life of one HTTP request through the filter: read and judge the request, admit or
//! answer it, then read how it went. Plain Rust behind [`CallHost`], so every step is tested
//! natively (see `tests.rs`); `host/` only forwards Envoy's callbacks here.
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

/// MCP's error code for a resource no server has.
const RESOURCE_NOT_FOUND: i64 = -32002;
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

/// What a listing lists, as rules name it.
fn item_listed(listing: Listing) -> Item {
    match listing {
        Listing::Tools => Item::Tool,
        Listing::Resources | Listing::Templates => Item::Resource,
        Listing::Prompts => Item::Prompt,
    }
}

/// The service and its own name (tool, prompt, URI, template) of an item a virtual server
/// lists as `visible`; `None` for one it does not route.
fn routed(routes: &VirtualRoutes, listing: Listing, visible: &str) -> Option<(String, String)> {
    let target = |t: &VirtualTool| (t.service.clone(), t.tool.clone());
    match listing {
        Listing::Tools => routes.tools.get(visible).map(target),
        Listing::Prompts => routes.prompts.get(visible).map(target),
        Listing::Resources => routes.resources.get(visible).map(target),
        Listing::Templates => routes
            .templates
            .iter()
            .find(|t| t.visible == visible)
            .map(|t| {
                let own = match unprefixed_uri(visible) {
                    Some((service, inner)) if service == t.service => inner,
                    _ => visible,
                };
                (t.service.clone(), own.to_string())
            }),
    }
}

/// A JSON-RPC message (a client's answer) with `id` in place of its own; `None` when it is
/// not one object.
fn with_id(body: &[u8], id: serde_json::Value) -> Option<Vec<u8>> {
    let mut message: serde_json::Value = serde_json::from_slice(body).ok()?;
    *message.as_object_mut()?.get_mut("id")? = id;
    serde_json::to_vec(&message).ok()
}

/// The prompts and resources a request is about, as rules name them (none for a request
/// about neither). A `completion/complete` whose `ref` cannot be read is about both, unnamed:
/// where either is guarded, it is refused rather than passed unjudged.
fn surface_items<'r>(request: &'r Request<'_>) -> Vec<(Item, Cow<'r, str>)> {
    let method = request.method.as_ref();
    let name = |n: &'r Option<Cow<'_, str>>| n.as_deref().map_or(Cow::Borrowed(""), Cow::Borrowed);
    if method == PROMPTS_GET {
        return vec![(Item::Prompt, name(&request.params_name))];
    }
    if [RESOURCES_READ, RESOURCES_SUBSCRIBE, RESOURCES_UNSUBSCRIBE].contains(&method) {
        return vec![(Item::Resource, name(&request.params_uri))];
    }
    if method != COMPLETION_COMPLETE {
        return Vec::new();
    }
    match request.params_ref_raw.and_then(completion_ref) {
        Some(CompletionRef::Prompt { name, .. }) => vec![(Item::Prompt, name)],
        Some(CompletionRef::Resource { uri, .. }) => vec![(Item::Resource, uri)],
        None => vec![
            (Item::Prompt, Cow::Borrowed("")),
            (Item::Resource, Cow::Borrowed("")),
        ],
    }
}

#[cfg(test)]
mod tests;

/// A JSON response of an admitted call up to this size is held until it is complete, so that
/// an answer that is not the response can be replaced by an MCP reply before the agent sees
/// it. Larger ones stream through (Envoy's per-stream buffer limit is 1 MiB by default).
pub const HOLD_LIMIT: usize = 256 * 1024;
/// A JSON response body larger than this is passed through unjudged rather than copied.
pub const MAX_JSON_RESPONSE: usize = 4 * 1024 * 1024;

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
    /// [`Call::on_dispatch_response`]. `false`: the question could not be sent.
    fn dispatch(&self, path: &str, body: &[u8], authorization: &str) -> bool;
    /// Lets a request paused for a question go on.
    fn resume_request(&self);
    /// Lets a response paused for a question go on.
    fn resume_response(&self);
    /// A local reply of a server's own answer (status, content type, body as it sent them),
    /// with `headers` besides.
    fn send_raw(&self, status: u32, content_type: &str, body: &[u8], headers: &[(&str, &str)]);
}

pub use toolgate_model::envoy::{CUT_REPLY_PROPERTY, HELD_HEADER};

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
}

/// What every call of one worker VM shares.
pub struct Shared<S, M> {
    pub config: FilterConfig,
    pub breakers: Breakers<S>,
    pub stats: Stats<M>,
    /// Shared by every root context of the VM (see `host::root`): a new configuration's root
    /// takes over the counts the old one had not posted.
    pub feedback: Rc<RefCell<Feedback>>,
    pub unlisted: Unlisted,
    /// Seals `Mcp-Session-Id` when the configuration carries a key.
    pub sealer: Option<Sealer>,
    /// The names the virtual servers of `config` show, by (service, tool).
    pub visible: VisibleNames,
    /// No configuration was ever accepted by this VM (see [`crate::keeper`]): every request
    /// on an MCP path is refused.
    pub unconfigured: bool,
    /// Verified payloads read lately (agents send one token many times).
    callers: auth::CallerCache,
    /// The reply for a held answer cut off upstream, by (tool as the agent sees it, its
    /// fallback, revision): set on every call whose answer is held.
    cut_replies: reply::ById<(String, Option<String>, ProtocolVersion)>,
}

impl<S: SharedStore, M: MetricHost> Shared<S, M> {
    pub fn new(store: S, metrics: M, seed: u64) -> Self {
        Shared {
            config: FilterConfig::default(),
            breakers: Breakers::new(store, seed),
            stats: Stats::new(metrics),
            feedback: Rc::new(RefCell::new(Feedback::new())),
            unlisted: Unlisted::new(),
            sealer: None,
            visible: VisibleNames::default(),
            unconfigured: false,
            callers: auth::CallerCache::default(),
            cut_replies: reply::ById::default(),
        }
    }

    /// Takes a new configuration; `false` if its session key is set but unusable (the filter
    /// then passes session ids as they are, and says so).
    pub fn configure(&mut self, config: FilterConfig) -> bool {
        let key = config.session_key.0.clone();
        self.visible = VisibleNames::new(&config.virtual_servers);
        // The roles claim may have changed, and so may fallbacks.
        self.callers = auth::CallerCache::default();
        self.cut_replies = reply::ById::default();
        self.config = config;
        self.unconfigured = false;
        if key.is_empty() {
            self.sealer = None;
            return true;
        }
        self.sealer = Sealer::new(&key);
        self.sealer.is_some()
    }

    /// Why a call of `tool` of `service` would be refused now, as a service's `tools/list`
    /// shows it: forced open by an operator, or its breaker open, fleet-wide or in this
    /// Envoy. A breaker still carrying a lifted override is not shown: the next configuration
    /// clears it.
    fn availability(&self, service: &str, tool: &str, now_ms: u64) -> Option<Availability> {
        let config = &self.config;
        let why = match fleet::forced_open(&config.overrides, service, tool) {
            Some(reason) => NotNow::ForcedOpen {
                reason: reason.to_string(),
            },
            None => {
                let fleet = config
                    .fleet_open
                    .get(service)
                    .and_then(|t| t.get(tool))
                    .map(|o| o.until_ms);
                let here = self
                    .breakers
                    .snapshot(&breaker_key(service, tool))
                    .filter(|b| b.state() == State::Open && b.force() == Force::None)
                    .map(|b| b.open_until_ms());
                let until_ms = fleet.max(here).filter(|&until| until > now_ms)?;
                NotNow::Open { until_ms }
            }
        };
        // On a service's route the agent sees the tools' own names.
        let fallback = config.policy_for(service, tool).fallback_tool;
        Some(Availability { why, fallback })
    }
}

/// The log line of a breaker transition.
pub fn transition_line(key: &str, t: &Transition) -> String {
    let until = t
        .open_until_ms
        .map(|u| format!(", probing after {} ms", u.saturating_sub(t.at_ms)))
        .unwrap_or_default();
    format!(
        "toolgate breaker {key}: {} -> {} ({}){until}",
        t.from, t.to, t.cause
    )
}

/// The reply's words for why a breaker opened.
fn open_cause(cause: Option<&Cause>) -> OpenCause {
    match cause {
        Some(Cause::FailureRate {
            percent,
            calls,
            window_secs,
        }) => OpenCause::FailureRate {
            percent: *percent,
            calls: *calls,
            window_secs: *window_secs,
        },
        Some(Cause::SlowCallRate {
            percent,
            calls,
            window_secs,
            slow_call_ms,
        }) => OpenCause::SlowCallRate {
            percent: *percent,
            calls: *calls,
            window_secs: *window_secs,
            slow_call_ms: *slow_call_ms,
        },
        Some(Cause::ProbeFailed) => OpenCause::ProbeFailed,
        Some(Cause::ProbeSlow) => OpenCause::ProbeSlow,
        Some(Cause::Fleet) => OpenCause::Fleet,
        _ => OpenCause::Unknown,
    }
}

/// The request this call carries, once judged.
struct Judged {
    id: RawId,
    /// A 2026-07-28 `server/discover`: the SDKs' version probe. Answered 503 when no server
    /// can take it, since the probe reads a JSON-RPC error at 200 as "this server predates
    /// 2026-07-28" (and a client pinned to it then blames the version, not the outage).
    discover: bool,
    /// For an admitted `tools/call`: the tool, and the fallback its policy names.
    tool: Option<(String, Option<String>)>,
    /// A listing whose answer the filter reads: a `tools/list` on a service's route (to
    /// annotate it), or any listing that must be filtered for the caller.
    list: Option<Listing>,
}

/// What the judge decided about one `tools/call`.
enum Judgement {
    /// Upstream without a breaker (a service the catalog does not know, an unlisted tool past
    /// the bound).
    Pass,
    Admit(Admitted),
    Refuse(Refused),
}

/// A call the gateway answers itself, owned so that it outlives the borrow of the shared
/// state it was decided under.
#[derive(Debug, Clone)]
enum Refused {
    Plain(Refusal),
    /// A name the aggregate endpoint `endpoint` does not offer.
    NotOffered {
        endpoint: String,
        tool: String,
    },
    /// `/virtual/<name>` of a virtual server the configuration does not have.
    NoVirtualServer(String),
    /// A call in a batch the caller may not make (issue 20).
    NotPermitted {
        service: String,
        item: Item,
        name: String,
    },
    ForcedOpen {
        tool: String,
        reason: String,
        fallback: Option<String>,
    },
    Breaker {
        tool: String,
        state: State,
        cause: OpenCause,
        retry_after_secs: u64,
        fallback: Option<String>,
    },
}

impl Refused {
    /// The semantic details, for refusals that are a tool's unavailability.
    fn unavailable(&self) -> Option<Unavailable<'_>> {
        match self {
            Refused::ForcedOpen {
                tool,
                reason,
                fallback,
            } => Some(Unavailable {
                kind: UnavailableKind::ForcedOpen { reason },
                tool: Some(tool),
                retry_after_secs: None,
                fallback_tool: fallback.as_deref(),
            }),
            Refused::Breaker {
                tool,
                state,
                cause,
                retry_after_secs,
                fallback,
            } => Some(Unavailable {
                kind: if *state == State::HalfOpen {
                    UnavailableKind::Probing
                } else {
                    UnavailableKind::Open { cause: *cause }
                },
                tool: Some(tool),
                retry_after_secs: Some(*retry_after_secs),
                fallback_tool: fallback.as_deref(),
            }),
            Refused::NotOffered { endpoint, tool } => Some(Unavailable {
                kind: UnavailableKind::NotOffered { endpoint },
                tool: Some(tool),
                retry_after_secs: None,
                fallback_tool: None,
            }),
            Refused::Plain(_) | Refused::NoVirtualServer(_) | Refused::NotPermitted { .. } => None,
        }
    }

    fn reply(&self, version: ProtocolVersion, id: &RawId, framing: Framing) -> Reply {
        if let Some(details) = self.unavailable() {
            return reply::tool_unavailable(version, id, &details, framing);
        }
        match self {
            Refused::NoVirtualServer(name) => {
                reply::unknown_virtual_server(version, id, name, framing)
            }
            Refused::Plain(refusal) => reply::refused(version, Some(id), *refusal, framing),
            _ => reply::refused(version, Some(id), Refusal::NotAMessage, framing),
        }
    }

    /// The refusal as the agent on virtual server `server` must read it: tools by the names
    /// it sees there (`visible` for the one called), a fallback only if offered there.
    fn seen_on(self, server: &str, visible: &str, service: &str, names: &VisibleNames) -> Self {
        let seen = |fallback: Option<String>| {
            fallback.and_then(|f| names.get(server, service, &f).map(str::to_string))
        };
        match self {
            Refused::ForcedOpen {
                reason, fallback, ..
            } => Refused::ForcedOpen {
                tool: visible.to_string(),
                reason,
                fallback: seen(fallback),
            },
            Refused::Breaker {
                state,
                cause,
                retry_after_secs,
                fallback,
                ..
            } => Refused::Breaker {
                tool: visible.to_string(),
                state,
                cause,
                retry_after_secs,
                fallback: seen(fallback),
            },
            other => other,
        }
    }

    /// The JSON-RPC error of a refusal that is not an unavailability (for batches).
    fn error(&self) -> (i64, String) {
        match self {
            Refused::NotOffered { endpoint, tool } => (
                crate::mcp::request::INVALID_PARAMS,
                reply::tool_not_offered_message(endpoint, tool),
            ),
            Refused::Plain(refusal) => (refusal.code(), refusal.to_string()),
            Refused::NotPermitted {
                service,
                item,
                name,
            } => (
                auth::NOT_AUTHORIZED,
                auth::not_permitted_message(*item, name, &format!("the MCP service `{service}`")),
            ),
            _ => (reply::INTERNAL_ERROR, String::new()),
        }
    }
}

/// The words of every refusal made for want of a configuration.
fn unconfigured_message() -> String {
    format!(
        "This MCP gateway cannot serve requests now: {}. Nothing was sent to a server; an \
         operator must look at the gateway.",
        reply::UNCONFIGURED
    )
}

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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not a request the filter reads (another path, another method).
    Ignored,
    /// An MCP GET stream: only an Envoy-made failure is answered, in MCP's terms.
    Stream,
    /// A POST whose body is being held for judging.
    Reading,
    /// The body was judged; the request went upstream (or was answered).
    Judged,
    /// A POST this VM cannot judge (it has no configuration): its body is read only for the
    /// id of the refusal.
    Unconfigured,
}

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
    stage: Stage,
    service: Option<String>,
    version: ProtocolVersion,
    framing: Framing,
    header_method: Option<String>,
    header_name: Option<String>,
    body_len: usize,
    request: Option<Judged>,
    admitted: Option<Admitted>,
    watch: Watch,
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
    /// The request declared its body's length (`content-length`), which a rewrite must keep
    /// true.
    declared_length: bool,
    /// A stateless client's call answered on a session held for it: the answer is held
    /// whole and its results completed for the client's revision
    /// ([`held_session::complete_results`]).
    completing: bool,
    /// An answer routed from a virtual server, edited as it passes (see [`AnswerEdit`]).
    edit: Option<AnswerEdit>,
    /// Who is calling, when the auth configuration is on (issue 20).
    auth: AuthState,
    /// A GET or DELETE whose headers wait until it is clear no body follows.
    no_body: bool,
    /// `Mcp-Session-Id` as the client sent it (before unsealing): what its cancellations
    /// name.
    client_session: Option<String>,
    /// A `resources/read` or `prompts/get` of the aggregate endpoint sent to its service: its
    /// answer counts for or against the instance (health feedback), never for a breaker.
    surface_feedback: bool,
    /// The server's URI and the one the agent read, when the gateway rewrote it.
    surface_uri: Option<(String, String)>,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldPhase {
    /// Asking toolgate-xds for the session; the request waits.
    Opening,
    /// The call went with the session.
    Sent,
    /// The server answered 400: its body is read to see whether it means "session unknown"
    /// (the TypeScript SDK's servers' -32000).
    Checking,
    /// The server no longer knew it: toolgate-xds decides, and replays the call on a new one
    /// if it was lost with its instance.
    Replaying,
}

/// Whose session a held one is.
enum HeldFor {
    /// A client of the aggregate endpoint, by its gateway session id.
    Gateway(String),
    /// A client of a service's route, by the `initialize` parameters sealed in its id: a
    /// replayed answer carries its new id, sealed likewise.
    Route(String),
    /// A 2026-07-28 client of the aggregate endpoint, by the `initialize` parameters made of
    /// the identity its request states (it has no id to carry a new session's).
    Stateless(String),
}

impl HeldFor {
    fn question(&self) -> held_session::Client<'_> {
        match self {
            HeldFor::Gateway(id) => held_session::Client::Gateway(id),
            HeldFor::Route(params) | HeldFor::Stateless(params) => {
                held_session::Client::Params(params)
            }
        }
    }
}

/// A call whose client's session the gateway holds or may re-open: on the aggregate endpoint
/// (a gateway session), or on a service's route (an id sealed with the client's parameters).
struct HeldCall {
    owner: String,
    service: String,
    client: HeldFor,
    slot: String,
    /// The session envelope the call went with.
    envelope: Option<String>,
    /// The call as the service got it, for a replay.
    body: Vec<u8>,
    phase: HeldPhase,
    /// An answer asked for long ago, used should asking again fail.
    fallback: Option<held_session::Held>,
    /// When the session the call went with was opened, if known.
    opened_ms: Option<u64>,
    /// Sent without a session: no toolgate-xds answered and none was held (see
    /// [`CallFilter::go_unsessioned`]).
    unsessioned: bool,
}

impl HeldCall {
    /// The question to toolgate-xds about this session, counted for `caller`.
    fn question<'a>(&'a self, caller: &'a str) -> held_session::Question<'a> {
        held_session::Question {
            owner: &self.owner,
            service: &self.service,
            client: self.client.question(),
            caller,
        }
    }

    /// Remembers for every worker that the client or its live server ended the session: it
    /// is neither used nor opened again. A stateless client has no session to end, only the
    /// one held for its identity: the next call opens another.
    fn ended<S: SharedStore, M>(&self, shared: &Rc<RefCell<Shared<S, M>>>) {
        let value = match self.client {
            HeldFor::Stateless(_) => Vec::new(),
            _ => held_session::encode_ended(&self.owner, &self.service),
        };
        let shared = shared.borrow();
        let store = shared.breakers.store();
        let cas = store.get(&self.slot).ok().flatten().map(|(_, cas)| cas);
        let _ = store.set(&self.slot, &value, cas);
    }

    /// Puts the held session on the request.
    fn use_answer(&mut self, host: &impl CallHost, answer: &held_session::Held) {
        if let Some(envelope) = &answer.envelope {
            host.set_request_header(SESSION_HEADER, Some(envelope));
        }
        if !answer.protocol_version.is_empty() {
            host.set_request_header("mcp-protocol-version", Some(&answer.protocol_version));
        }
        self.envelope = answer.envelope.clone();
        self.opened_ms = answer.opened_ms;
    }

    /// Keeps the answer for every worker of this Envoy.
    fn store<S: SharedStore, M>(
        &self,
        shared: &Rc<RefCell<Shared<S, M>>>,
        answer: &held_session::Held,
        now_ms: u64,
    ) {
        let value = held_session::encode_slot(&self.owner, &self.service, answer, now_ms);
        let shared = shared.borrow();
        let store = shared.breakers.store();
        // Last writer wins: a lost race leaves the other worker's answer, as good as this one.
        let cas = store.get(&self.slot).ok().flatten().map(|(_, cas)| cas);
        let _ = store.set(&self.slot, &value, cas);
    }
}

/// A request on a virtual server's path.
/// What the filter edits in an answer routed from a virtual server to one of its services.
struct AnswerEdit {
    server: String,
    service: String,
    /// A tool's result or a prompt where the virtual server offers resources: resource links
    /// and embedded resources get the URIs that lead back to them there.
    links: bool,
    /// A call's stream on a client session: the server's questions get ids naming it
    /// (`crate::asked`), so two servers' questions never share one.
    questions: bool,
    /// The answer is an SSE stream (edited event by event), else one JSON message.
    sse: bool,
}

struct OnVirtual {
    server: String,
    /// The query of the agent's path (`?` included), kept on the service's path.
    query: String,
    /// A `tools/call` sent to its service's route.
    routed: bool,
    method: HttpMethod,
    /// The body of a POST that goes to toolgate-xds, kept should no toolgate-xds answer
    /// (see [`crate::offline`]).
    body: Option<Vec<u8>>,
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    pub fn new(shared: Rc<RefCell<Shared<S, M>>>) -> Self {
        Call {
            shared,
            stage: Stage::Ignored,
            service: None,
            version: ProtocolVersion::V2025_03_26,
            framing: Framing::Json,
            header_method: None,
            header_name: None,
            body_len: 0,
            request: None,
            admitted: None,
            watch: Watch::None,
            events: Vec::new(),
            sealing: false,
            on_virtual: None,
            held: None,
            init_params: None,
            declared_length: false,
            completing: false,
            edit: None,
            surface_feedback: false,
            surface_uri: None,
            auth: AuthState::default(),
            no_body: false,
            client_session: None,
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

    pub fn on_request_headers(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        // Headers only this filter writes: the shared routes go to the cluster the first one
        // names (from the path it judges), the local-reply mapping reads the second. Removed
        // by name, whatever the value holds: one that is not UTF-8 is invisible to a lookup.
        for owned in [CLUSTER_HEADER, HELD_HEADER] {
            if host.request_header_present(owned) {
                host.set_request_header(owned, None);
            }
        }
        let Some(path) = host.request_header(":path") else {
            return Action::Continue;
        };
        let Some(target) = aggregate::target_of(&path) else {
            return Action::Continue;
        };
        if self.shared.borrow().unconfigured {
            return self.refuse_unconfigured(host, end_of_stream);
        }
        let method = match self.admit_headers(host) {
            Ok(method) => method,
            Err(refused) => return refused,
        };
        if let Target::Service(service) = target {
            route_to(host, service);
        }
        if let Some(refused) = self.authenticate(host, target) {
            return refused;
        }
        // The session as the client names it: what its cancellations are keyed by.
        self.client_session = host.request_header(SESSION_HEADER);
        let service = match target {
            Target::Service(service) => service,
            Target::Virtual { server, query } => {
                self.on_virtual = Some(OnVirtual {
                    server: server.to_string(),
                    query: query.to_string(),
                    routed: false,
                    method,
                    body: None,
                });
                // Whose held sessions toolgate-xds relays on a GET stream: this caller's only
                // (set or removed here, so no client names another user). Only toolgate-xds's
                // GET handler reads it: a call's POST pays no host call for it.
                if method == HttpMethod::Get {
                    host.set_request_header(
                        toolgate_model::session_owner::IDENTITY_HEADER,
                        self.held_identity().as_deref(),
                    );
                }
                // GET streams and DELETE are toolgate-xds's, with its own session ids: passed
                // untouched, never unsealed.
                if method != HttpMethod::Post {
                    return self.without_body(end_of_stream);
                }
                return self.hold_body(host, end_of_stream);
            }
        };
        self.open_session(host, service);
        match method {
            HttpMethod::Post => {}
            HttpMethod::Get => {
                self.service = Some(service.to_string());
                self.version = ProtocolVersion::from_header(
                    host.request_header("mcp-protocol-version").as_deref(),
                );
                self.stage = Stage::Stream;
                return self.without_body(end_of_stream);
            }
            HttpMethod::Delete => return self.without_body(end_of_stream),
        }
        self.service = Some(service.to_string());
        self.hold_body(host, end_of_stream)
    }

    /// What every request on an MCP path must be before anything else is read: one of the
    /// transport's methods, headers the gateway reads in text, no claim header a client wrote,
    /// and no compression the filter could not read in the answer. `Err` is the refusal sent.
    fn admit_headers(&mut self, host: &impl CallHost) -> Result<HttpMethod, Action> {
        let version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        let method = host.request_header(":method").unwrap_or_default();
        let method = if method.eq_ignore_ascii_case("POST") {
            HttpMethod::Post
        } else if method.eq_ignore_ascii_case("GET") {
            HttpMethod::Get
        } else if method.eq_ignore_ascii_case("DELETE") {
            HttpMethod::Delete
        } else {
            self.version = version;
            self.stage = Stage::Judged;
            let reply = reply::refused(version, None, Refusal::MethodNotAllowed, Framing::Json);
            host.send_reply(405, &reply, &[("allow", "GET, POST, DELETE")]);
            return Err(Action::Pause);
        };
        if let Some(name) = READ_HEADERS
            .iter()
            .find(|name| host.request_header(name).is_none() && host.request_header_present(name))
        {
            self.version = version;
            return Err(self.refuse(host, 400, None, Refusal::HeaderNotText(name)));
        }
        // Headers a rule set copies verified claims into: whatever a client wrote there is
        // gone before a server could take it for the gateway's word, auth configuration or
        // not (the one a service asked for is put back from the verified token).
        {
            let shared = self.shared.borrow();
            for name in &shared.config.claim_header_names {
                if host.request_header_present(name) {
                    host.set_request_header(name, None);
                }
            }
        }
        // The filter reads every answer it judges: a compressed one it cannot, and would
        // then have to pass unjudged. Servers answer uncompressed when not asked otherwise.
        if host.request_header_present("accept-encoding") {
            host.set_request_header("accept-encoding", None);
        }
        Ok(method)
    }

    /// A GET or DELETE: its headers go on once it is clear no body follows them (a server
    /// that read a body there like a POST's would run a call nobody judged).
    fn without_body(&mut self, end_of_stream: bool) -> Action {
        if end_of_stream {
            return Action::Continue;
        }
        self.no_body = true;
        Action::Pause
    }

    /// The body of a GET or DELETE: refused if it has a byte; the request goes on once it has
    /// ended empty.
    fn no_body_allowed(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if body_size > 0 {
            self.no_body = false;
            self.version = ProtocolVersion::from_header(
                host.request_header("mcp-protocol-version").as_deref(),
            );
            // The stream is refused, not judged: no breaker outcome, no stream watch.
            self.stage = Stage::Judged;
            return self.refuse(host, 400, None, Refusal::BodyNotAllowed);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.no_body = false;
        Action::Continue
    }

    /// Reads who is calling (issue 20), when an auth configuration is on: the payload Envoy
    /// verified, and whether a token came at all. Neither the token nor the payload goes on
    /// upstream. A resource that requires a token and got no valid one is refused here with
    /// the 401 that starts an MCP client's OAuth flow.
    fn authenticate(&mut self, host: &impl CallHost, target: Target<'_>) -> Option<Action> {
        let path = match target {
            Target::Service(service) => aggregate::service_path(service, ""),
            Target::Virtual { server, .. } => aggregate::endpoint_path(server),
        };
        let (required, verified) = {
            let mut guard = self.shared.borrow_mut();
            let Shared {
                config, callers, ..
            } = &mut *guard;
            let auth = config.auth.as_ref()?;
            let payload = host.request_header(PAYLOAD_HEADER);
            if payload.is_some() {
                host.set_request_header(PAYLOAD_HEADER, None);
            }
            let authorization = host.request_header("authorization");
            if authorization.is_some() {
                // No token passthrough: the client's token is for the gateway alone.
                host.set_request_header("authorization", None);
            }
            // Envoy drops the token of a request it verified: a payload refused here (a token
            // for another resource) is a refused token too.
            let came = payload.is_some();
            let verified = payload
                // An Envoy whose bootstrap does not verify tokens first: the header could be
                // the client's own, so nothing is verified there (fail closed).
                .filter(|_| !auth.untrusted_payload)
                .and_then(|p| callers.get(p, &auth.roles_claim))
                .filter(|v| auth.audience_fits(&v.payload, &path));
            self.auth.refused = verified.is_none()
                && (came || authorization.as_deref().is_some_and(auth::is_bearer));
            let required = match target {
                Target::Service(s) => auth.requires_service(s),
                Target::Virtual { server, .. } => auth.requires_virtual(server),
            };
            (required, verified)
        };
        self.auth.path = path;
        if let Some(v) = &verified {
            if !v.caller.subject.is_empty() {
                self.log_field(host, log_field::SUBJECT, &v.caller.subject);
            }
        }
        self.auth.verified = verified;
        if required && self.auth.verified.is_none() {
            let what = match target {
                Target::Service(s) => format!("the MCP service `{s}`"),
                Target::Virtual { .. } => format!("the MCP endpoint `{}`", self.auth.path),
            };
            let label = self.denial_label(target);
            return Some(self.refuse_unauthenticated(host, &label, &what, None));
        }
        if let Target::Service(service) = target {
            self.forward_claims(host, service);
        }
        None
    }

    /// The `service` label of a denial: a known service, `virtual:<name>`, or the overflow.
    fn denial_label(&self, target: Target<'_>) -> String {
        let shared = self.shared.borrow();
        match target {
            Target::Service(s) if shared.config.catalog.contains_key(s) => s.to_string(),
            Target::Virtual { server, .. }
                if server == toolgate_model::virtual_server::DEFAULT_VIRTUAL
                    || shared.config.virtual_servers.contains_key(server) =>
            {
                format!("virtual:{server}")
            }
            _ => crate::stats::OVERFLOW.to_string(),
        }
    }

    fn count_denial(&mut self, host: &impl CallHost, label: &str, denial: Denial) {
        self.shared
            .borrow_mut()
            .stats
            .count_named(auth::metric_name(label, denial));
        self.log_field(host, log_field::DENIED, denial.as_str());
    }

    /// The gateway's public base URL, for the metadata URL a challenge names.
    fn auth_resource(&self) -> String {
        self.shared
            .borrow()
            .config
            .auth
            .as_ref()
            .map(|a| a.resource.clone())
            .unwrap_or_default()
    }

    /// 401: no valid token for a resource that requires one (`id`: the request's, once read).
    fn refuse_unauthenticated(
        &mut self,
        host: &impl CallHost,
        label: &str,
        what: &str,
        id: Option<&RawId>,
    ) -> Action {
        let denial = if self.auth.refused {
            Denial::InvalidToken
        } else {
            Denial::MissingToken
        };
        self.count_denial(host, label, denial);
        let resource = self.auth_resource();
        let challenge = auth::unauthenticated_challenge(&resource, &self.auth.path, denial);
        let version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        let reply = auth::unauthenticated_reply(version, id, what, denial, Framing::Json);
        self.stage = Stage::Judged;
        host.send_reply(401, &reply, &[("www-authenticate", &challenge)]);
        Action::Pause
    }

    /// Puts the verified claims a service asked for on its request, after removing whatever
    /// the client sent under those names.
    fn forward_claims(&self, host: &impl CallHost, service: &str) {
        let shared = self.shared.borrow();
        let Some(rules) = shared
            .config
            .auth
            .as_ref()
            .and_then(|a| a.services.get(service))
        else {
            return;
        };
        for (claim, header) in &rules.claim_headers {
            let value = self
                .auth
                .verified
                .as_ref()
                .and_then(|v| v.payload.get(claim))
                .and_then(auth::claim_header_value);
            host.set_request_header(header, value.as_deref());
        }
    }

    /// Whether the caller may use `name` (a tool, a prompt, a resource URI) of `service`
    /// (shown as `visible` on virtual server `server`, for a request made there): `Some` is
    /// the answer when not.
    fn authorize(
        &mut self,
        host: &impl CallHost,
        item: Item,
        service: &str,
        name: &str,
        on: Option<(&str, &str)>,
        id: &RawId,
    ) -> Option<Action> {
        let verdict = {
            let shared = self.shared.borrow();
            let auth = shared.config.auth.as_ref()?;
            let caller = self.auth.caller();
            let on_virtual =
                on.map(|(server, visible)| auth.decide_virtual_item(server, item, visible, caller));
            match on_virtual {
                Some(v) if v != AuthVerdict::Allow => v,
                _ => auth.decide_service_item(service, item, name, caller),
            }
        };
        let (label, what, shown) = match on {
            Some((server, visible)) => (
                if self.shared.borrow().config.catalog.contains_key(service) {
                    service.to_string()
                } else {
                    crate::stats::OVERFLOW.to_string()
                },
                format!("the MCP endpoint `{}`", aggregate::endpoint_path(server)),
                visible,
            ),
            None => (
                self.denial_label(Target::Service(service)),
                format!("the MCP service `{service}`"),
                name,
            ),
        };
        match verdict {
            AuthVerdict::Allow => None,
            AuthVerdict::Unauthenticated => {
                Some(self.refuse_unauthenticated(host, &label, &what, Some(id)))
            }
            AuthVerdict::InsufficientScope(scope) => {
                self.count_denial(host, &label, Denial::InsufficientScope);
                let resource = self.auth_resource();
                let challenge =
                    auth::insufficient_scope_challenge(&resource, &self.auth.path, &scope);
                let reply = auth::not_permitted_reply(
                    self.version,
                    id,
                    item,
                    shown,
                    &what,
                    Some(&scope),
                    Framing::Json,
                );
                self.stage = Stage::Judged;
                host.send_reply(403, &reply, &[("www-authenticate", &challenge)]);
                Some(Action::Pause)
            }
            AuthVerdict::Denied => {
                self.count_denial(host, &label, Denial::of(item));
                let reply = auth::not_permitted_reply(
                    self.version,
                    id,
                    item,
                    shown,
                    &what,
                    None,
                    self.framing,
                );
                Some(self.answer(host, 200, &reply))
            }
        }
    }

    /// Whether this request's listing may hide items from its caller (see
    /// [`Self::listing_filtered_for`]).
    fn listing_filtered(&self) -> bool {
        self.request
            .as_ref()
            .and_then(|j| j.list)
            .is_some_and(|listing| self.listing_filtered_for(listing))
    }

    /// Whether a `listing` here may hide items from its caller: the service's rules guard
    /// what it lists, or, on a virtual server, any rules do or a caller without a token may
    /// meet a service that requires one. Only such a listing is read whole (and, unreadable,
    /// not shown).
    fn listing_filtered_for(&self, listing: Listing) -> bool {
        let shared = self.shared.borrow();
        let Some(auth) = &shared.config.auth else {
            return false;
        };
        let item = item_listed(listing);
        match (&self.on_virtual, &self.service) {
            (Some(_), _) => {
                auth.services
                    .values()
                    .chain(auth.virtual_servers.values())
                    .any(|rules| rules.guards(item))
                    || (self.auth.verified.is_none() && !auth.required.is_empty())
            }
            (None, Some(service)) => auth.guards(Some(service), None, item),
            (None, None) => false,
        }
    }

    /// Whether a listing shows `name` (a tool, a prompt, a resource URI or template) of
    /// `service` (as `visible` on `server`) to this caller.
    fn may_list(
        &self,
        auth: &FilterAuth,
        item: Item,
        service: &str,
        name: &str,
        on: Option<(&str, &str)>,
    ) -> bool {
        let caller = self.auth.caller();
        on.is_none_or(|(server, visible)| {
            auth.decide_virtual_item(server, item, visible, caller) == AuthVerdict::Allow
        }) && auth.decide_service_item(service, item, name, caller) == AuthVerdict::Allow
    }

    /// A POST to judge: reads what the headers say, and holds them until the body is complete.
    fn hold_body(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        self.version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        self.framing = Framing::from_accept(host.request_header("accept").as_deref());
        self.header_method = host.request_header("mcp-method");
        self.header_name = host.request_header("mcp-name");
        self.stage = Stage::Reading;
        if host
            .request_header("content-encoding")
            .is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"))
        {
            return self.refuse(host, 415, None, Refusal::Encoded);
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        let declared = host
            .request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        self.declared_length = declared.is_some();
        if declared.is_some_and(|n| n > limit) {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            return self.answer(host, 413, &reply);
        }
        if end_of_stream {
            return self.refuse(host, 400, None, Refusal::Empty);
        }
        // Hold the headers until the body says what is called.
        Action::Pause
    }

    pub fn on_request_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.no_body {
            return self.no_body_allowed(host, body_size, end_of_stream);
        }
        if self.stage == Stage::Unconfigured {
            return self.unconfigured_body(host, body_size, end_of_stream);
        }
        if self.stage != Stage::Reading {
            return Action::Continue;
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        if body_size as u64 > limit {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            return self.answer(host, 413, &reply);
        }
        self.body_len = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.judge(host)
    }

    /// HTTP/2 trailers end the request without an end-of-stream body callback: the body is
    /// complete now, and must be judged before Envoy forwards it.
    pub fn on_request_trailers(&mut self, host: &impl CallHost) -> Action {
        if self.no_body {
            // Trailers end the request: whatever body came was seen by the body callbacks.
            self.no_body = false;
            return Action::Continue;
        }
        if self.stage == Stage::Unconfigured {
            return self.unconfigured_body(host, self.body_len, true);
        }
        if self.stage != Stage::Reading {
            return Action::Continue;
        }
        self.judge(host)
    }

    /// A request on an MCP path while this VM has no configuration it accepted: nothing can
    /// be judged (no overrides, rules, catalog or session key), so nothing goes upstream. A
    /// POST's body is read for its id; anything else is answered at once.
    fn refuse_unconfigured(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        self.version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        self.framing = Framing::from_accept(host.request_header("accept").as_deref());
        if is_post(host) && !end_of_stream {
            self.stage = Stage::Unconfigured;
            return Action::Pause;
        }
        self.stage = Stage::Judged;
        let reply = reply::error(
            self.version,
            None,
            reply::INTERNAL_ERROR,
            &unconfigured_message(),
            None::<()>,
            Framing::Json,
        );
        host.send_reply(503, &reply, &[("retry-after", STREAM_RETRY_AFTER_SECS)]);
        Action::Pause
    }

    /// The body of a POST refused for want of a configuration: answered with its id once
    /// complete (a `tools/call` with a tool result the model can act on).
    fn unconfigured_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.body_len = body_size;
        let limit = self.shared.borrow().config.max_body_bytes;
        if !end_of_stream && body_size as u64 <= limit {
            return Action::Pause;
        }
        self.stage = Stage::Judged;
        let bytes = if body_size as u64 <= limit {
            host.request_body(body_size).unwrap_or_default()
        } else {
            Vec::new()
        };
        let request = match read_body(&bytes) {
            Ok(Body::Request(r)) => Some((r.id.clone(), r.method == TOOLS_CALL)),
            _ => None,
        };
        let reply = match &request {
            Some((id, true)) => {
                let details = Unavailable {
                    kind: UnavailableKind::Unconfigured,
                    tool: None,
                    retry_after_secs: None,
                    fallback_tool: None,
                };
                reply::tool_unavailable(self.version, id, &details, self.framing)
            }
            Some((id, false)) => reply::error(
                self.version,
                Some(id),
                reply::INTERNAL_ERROR,
                &unconfigured_message(),
                None::<()>,
                self.framing,
            ),
            None => reply::error(
                self.version,
                None,
                reply::INTERNAL_ERROR,
                &unconfigured_message(),
                None::<()>,
                Framing::Json,
            ),
        };
        self.answer(host, 200, &reply)
    }

    /// Restores the session id the agent sent from its sealed form (see [`crate::session`]),
    /// before Envoy's session affinity reads it. An id sealed with the client's `initialize`
    /// parameters may have been re-opened on another instance (its own was gone): the
    /// session it goes with now is in shared data (see [`crate::held_session`]).
    fn open_session(&mut self, host: &impl CallHost, service: &str) {
        let opened = {
            let shared = self.shared.borrow();
            let Some(sealer) = &shared.sealer else {
                return;
            };
            self.sealing = true;
            let Some(sent) = host.request_header(SESSION_HEADER) else {
                return;
            };
            match sealer.open(&sent, service) {
                Some(value) => Some((sent, value)),
                None => {
                    host.set_request_header(SESSION_HEADER, Some(&session::unusable(&sent)));
                    None
                }
            }
        };
        let Some((sent, value)) = opened else {
            return;
        };
        let (envelope, params, opened_ms) = held_session::split(&value);
        let identity = self.held_identity();
        let held = params.and_then(|p| {
            let owner = held_session::bound_to(
                held_session::owner_of(held_session::OwnerKind::Route, &sent)?,
                identity.as_deref(),
            );
            let slot = held_session::slot_key(&owner, service);
            Some(HeldCall {
                owner,
                service: service.to_string(),
                client: HeldFor::Route(p.to_string()),
                slot,
                envelope: Some(envelope.to_string()),
                body: Vec::new(),
                phase: HeldPhase::Sent,
                fallback: None,
                opened_ms,
                unsessioned: false,
            })
        });
        let Some(mut held) = held else {
            host.set_request_header(SESSION_HEADER, Some(envelope));
            return;
        };
        let slot = {
            let shared = self.shared.borrow();
            shared
                .breakers
                .store()
                .get(&held.slot)
                .ok()
                .flatten()
                .and_then(|(bytes, _)| held_session::decode_slot(&bytes, &held.owner, service))
        };
        match slot {
            Some(held_session::Slot::Held { held: answer, .. }) if answer.envelope.is_some() => {
                held.use_answer(host, &answer)
            }
            Some(held_session::Slot::Ended) => {
                // Ended by the client or its server: the server says so again (its "session
                // unknown" reaches the client), and nothing is re-opened.
                host.set_request_header(SESSION_HEADER, Some(&session::unusable(&sent)));
                return;
            }
            _ => host.set_request_header(SESSION_HEADER, Some(envelope)),
        }
        self.held = Some(held);
    }

    /// The digest of the verified user a held session is bound to, when the caller presented
    /// a valid token (see [`held_session::identity_tag`]).
    fn held_identity(&self) -> Option<String> {
        let verified = self.auth.verified.as_ref()?;
        let issuer = verified
            .payload
            .get("iss")
            .and_then(|i| i.as_str())
            .unwrap_or_default();
        Some(held_session::identity_tag(issuer, &verified.caller.subject))
    }

    /// Whom toolgate-xds counts this client's held sessions for under its bounds.
    fn held_caller(&self, host: &impl CallHost) -> String {
        let identity = self.held_identity();
        let source = match identity {
            Some(_) => None,
            None => host
                .property(&["source", "address"])
                .and_then(|a| String::from_utf8(a).ok()),
        };
        held_session::caller_key(identity.as_deref(), source.as_deref())
    }

    /// The verified claims this request carries to `service` as headers (its `claim_headers`),
    /// which a replay of it keeps.
    fn held_claims(&self, service: &str) -> Vec<(String, String)> {
        let shared = self.shared.borrow();
        let (Some(rules), Some(verified)) = (
            shared
                .config
                .auth
                .as_ref()
                .and_then(|a| a.services.get(service)),
            &self.auth.verified,
        ) else {
            return Vec::new();
        };
        rules
            .claim_headers
            .iter()
            .filter_map(|(claim, header)| {
                let value = verified
                    .payload
                    .get(claim)
                    .and_then(auth::claim_header_value)?;
                Some((header.clone(), value))
            })
            .collect()
    }

    /// The `initialize` parameters of this client: those of the `initialize` it is sending,
    /// or those sealed in its id.
    fn client_params(&self) -> Option<&str> {
        self.init_params.as_deref().or(match &self.held {
            Some(HeldCall {
                client: HeldFor::Route(p),
                ..
            }) => Some(p.as_str()),
            _ => None,
        })
    }

    /// Seals the session id of a response, which Envoy's session affinity has just wrapped
    /// around the upstream's address, with the client's parameters when known.
    fn seal_session(&mut self, host: &impl CallHost) {
        let Some(value) = host.response_header(SESSION_HEADER) else {
            return;
        };
        // The time a session is opened goes with it (an initialize now, or the one it had).
        let opened_ms = if self.init_params.is_some() {
            Some(host.now_ms())
        } else {
            self.held.as_ref().and_then(|h| h.opened_ms)
        };
        let value = held_session::join(&value, self.client_params(), opened_ms);
        let service = self.service.as_deref().unwrap_or_default();
        let sealed = match &self.shared.borrow().sealer {
            Some(sealer) => sealer.seal(&value, service),
            None => return,
        };
        // A value too long to seal is dropped rather than passed with an address in it.
        host.set_response_header(SESSION_HEADER, sealed.as_deref());
    }

    /// Sends a local reply and stops the request there.
    fn answer(&mut self, host: &impl CallHost, status: u32, reply: &Reply) -> Action {
        self.stage = Stage::Judged;
        host.send_reply(status, reply, &[]);
        Action::Pause
    }

    fn refuse(
        &mut self,
        host: &impl CallHost,
        status: u32,
        id: Option<&RawId>,
        refusal: Refusal,
    ) -> Action {
        let reply = reply::refused(self.version, id, refusal, self.framing);
        self.answer(host, status, &reply)
    }

    /// The body is complete: judge it.
    fn judge(&mut self, host: &impl CallHost) -> Action {
        self.stage = Stage::Judged;
        // A service's route, or (no service yet) the aggregate endpoint.
        let service = self.service.clone();
        if service.is_none() && self.on_virtual.is_none() {
            return Action::Continue;
        }
        let bytes = host.request_body(self.body_len).unwrap_or_default();
        let depth = self.shared.borrow().config.max_json_depth;
        if nests_deeper_than(&bytes, depth) {
            let reply = reply::too_deep(self.version, depth, self.framing);
            return self.answer(host, 400, &reply);
        }
        let body = match read_body(&bytes) {
            Ok(body) => body,
            Err(refusal) => return self.refuse(host, 400, None, refusal),
        };
        let check = check_headers(
            self.header_method.as_deref(),
            self.header_name.as_deref(),
            &body,
        );
        if let HeaderCheck::Mismatch(mismatch) = check {
            let id = match &body {
                Body::Request(r) => Some(&r.id),
                _ => None,
            };
            let reply = reply::header_mismatch(self.version, id, mismatch, self.framing);
            return self.answer(host, 400, &reply);
        }
        // What goes on to toolgate-xds (everything but a call) is kept, should no toolgate-xds
        // answer it.
        if let Some(on) = self.on_virtual.as_mut() {
            if !matches!(&body, Body::Request(r) if r.method == TOOLS_CALL) {
                on.body = Some(bytes.to_vec());
            }
            // toolgate-xds passes these on to the sessions held for this caller only: named
            // here (or a name the client wrote removed), as for a GET stream.
            let per_caller = match &body {
                Body::Notification { method } => method == cancel::METHOD,
                Body::Request(r) => r.method == SET_LEVEL,
                _ => false,
            };
            if per_caller {
                host.set_request_header(
                    toolgate_model::session_owner::IDENTITY_HEADER,
                    self.held_identity().as_deref(),
                );
            }
        }
        if self.sealing && self.on_virtual.is_none() {
            if let Body::Request(r) = &body {
                if r.method == "initialize" {
                    self.init_params = held_session::initialize_params(&bytes);
                }
            }
            // Kept for a replay, should the server no longer know the session.
            if let Some(h) = self.held.as_mut() {
                h.body = bytes.to_vec();
            }
        }
        match (body, service) {
            (Body::Request(request), Some(service)) => self.judge_request(host, &service, request),
            (Body::Request(request), None) => self.judge_virtual(host, request, &bytes),
            (Body::Batch(elements), Some(service)) => self.judge_batch(host, &service, elements),
            (Body::Batch(elements), None) => self.judge_virtual_batch(host, &elements),
            (Body::Notification { method }, _) => {
                self.log_field(host, log_field::METHOD, &method);
                if method == cancel::METHOD {
                    self.note_cancellation(host, &bytes);
                }
                Action::Continue
            }
            (Body::Response, None) => self.route_answer(host, &bytes),
            (Body::Response, Some(_)) => Action::Continue,
        }
    }

    /// A client's answer on the aggregate endpoint to a question a server asked during a call
    /// (`crate::asked`): sent to that service's route on the session held for the client. An
    /// answer to nothing noted goes on to toolgate-xds, which accepts it (202) as a server
    /// would an answer it no longer waits for.
    fn route_answer(&mut self, host: &impl CallHost, bytes: &[u8]) -> Action {
        self.log_field(host, log_field::METHOD, "response");
        let (Some(session), Some(id)) = (&self.client_session, asked::response_id(bytes)) else {
            return Action::Continue;
        };
        let service = {
            let shared = self.shared.borrow();
            asked::asker(shared.breakers.store(), session, &id, host.now_ms())
        };
        let Some(service) = service else {
            host.log(
                Level::Info,
                &format!(
                    "toolgate: an answer with id {} on the aggregate endpoint matches no server's question; dropped",
                    asked::shown(&id)
                ),
            );
            return Action::Continue;
        };
        // As for its questions' calls: no token, no session of that service's.
        if self.lacks_token_for(&service) {
            let what = format!("the MCP endpoint `{}`", self.endpoint_shown());
            return self.refuse_unauthenticated(host, &service, &what, None);
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        // The server gets its answer under the id it gave its question.
        let own = serde_json::from_str::<serde_json::Value>(&id)
            .ok()
            .and_then(|shown| asked::own_id(&shown).map(|(s, own)| (s == service, own)));
        match own {
            Some((true, own)) => match with_id(bytes, own) {
                Some(body) => self.route_call(host, &body, &service, ""),
                None => Action::Continue,
            },
            _ => self.route_call(host, bytes, &service, ""),
        }
    }

    /// Whether `service` requires a token for its tools (and so for everything else it
    /// serves) and this request presents none.
    fn lacks_token_for(&self, service: &str) -> bool {
        self.shared
            .borrow()
            .config
            .auth
            .as_ref()
            .is_some_and(|a| a.requires_service(service))
            && self.auth.caller().is_none()
    }

    /// The aggregate endpoint this request came to, as its client wrote the path.
    fn endpoint_shown(&self) -> String {
        let server = self
            .on_virtual
            .as_ref()
            .map_or(toolgate_model::virtual_server::DEFAULT_VIRTUAL, |v| {
                v.server.as_str()
            });
        aggregate::endpoint_path(server)
    }

    /// A scanner noting the server's questions, for the SSE answer to a request routed from
    /// the aggregate endpoint on a client's session (where an answer needs finding its way
    /// back); `None` for any other.
    fn question_scanner(&self, host: &impl CallHost) -> Option<SseScanner> {
        let routed = self.on_virtual.as_ref().is_some_and(|v| v.routed);
        let sse = host
            .response_header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream"));
        if !routed || !sse || self.client_session.is_none() {
            return None;
        }
        let judged = self.request.as_ref()?;
        Some(SseScanner::new(judged.id.clone()).noting_requests())
    }

    /// Notes which service asked the client of this call the questions `ids` (see
    /// `crate::asked`), so that the client's answers reach it.
    fn note_questions(&self, host: &impl CallHost, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        let (Some(session), Some(service)) = (&self.client_session, &self.service) else {
            return;
        };
        let shared = self.shared.borrow();
        for id in ids {
            let noted = asked::note(
                shared.breakers.store(),
                session,
                &id,
                service,
                host.now_ms(),
            );
            let id = asked::shown(&id);
            match noted {
                asked::Noted::Noted => {}
                asked::Noted::Replaced { earlier } => host.log(
                    Level::Warn,
                    &format!(
                        "toolgate: services {earlier:?} and {service:?} both asked one client session a question with id {id}; its answer goes to {service:?}, and {earlier:?} waits in vain"
                    ),
                ),
                asked::Noted::Failed => host.log(
                    Level::Warn,
                    &format!(
                        "toolgate: could not note that service {service:?} asked a question with id {id}; the client's answer will not reach it"
                    ),
                ),
            }
        }
    }

    /// A client cancelled one of its calls: noted for every worker, so the call's end is
    /// not held against its tool.
    fn note_cancellation(&self, host: &impl CallHost, body: &[u8]) {
        let (Some(session), Some(id)) = (&self.client_session, cancel::request_id(body)) else {
            return;
        };
        let shared = self.shared.borrow();
        cancel::mark(shared.breakers.store(), session, &id, host.now_ms());
    }

    /// A request on the aggregate endpoint. Only `tools/call` is the filter's: the name is
    /// looked up in the virtual server's names, the call judged as one of its (service, tool)
    /// and sent to that service's route with the tool's own name. Anything else goes on to
    /// toolgate-xds as it is.
    fn judge_virtual(
        &mut self,
        host: &impl CallHost,
        request: Request<'_>,
        bytes: &[u8],
    ) -> Action {
        if [
            PROMPTS_GET,
            RESOURCES_READ,
            RESOURCES_SUBSCRIBE,
            RESOURCES_UNSUBSCRIBE,
            COMPLETION_COMPLETE,
        ]
        .contains(&request.method.as_ref())
        {
            self.log_field(host, log_field::METHOD, &request.method);
            self.request = Some(Judged {
                id: request.id.clone(),
                discover: false,
                tool: None,
                list: None,
            });
            return self.route_surface(host, &request, bytes);
        }
        let visible = match self.called_tool(host, &request) {
            Ok(Some(tool)) => tool,
            Ok(None) => return Action::Continue,
            Err(answered) => return answered,
        };
        let Some(server) = self.on_virtual.as_ref().map(|v| v.server.clone()) else {
            return Action::Continue;
        };
        let found = {
            let shared = self.shared.borrow();
            match shared.config.virtual_servers.get(&server) {
                None => Err(Refused::NoVirtualServer(server.clone())),
                Some(routes) => match routes.tools.get(visible) {
                    Some(t) => Ok((t.service.clone(), t.tool.clone())),
                    None => Err(Refused::NotOffered {
                        endpoint: aggregate::endpoint_path(&server),
                        tool: visible.to_string(),
                    }),
                },
            }
        };
        let (service, tool) = match found {
            Ok(found) => found,
            Err(refused) => {
                let reply = refused.reply(self.version, &request.id, self.framing);
                return self.answer(host, 200, &reply);
            }
        };
        // The body the service gets, made before anything is decided: a name that cannot be
        // replaced exactly never reaches a server (nor takes a breaker's trial slot).
        let routed = request
            .params_name_raw
            .and_then(|raw| aggregate::span_in(bytes, raw))
            .and_then(|span| aggregate::with_name(bytes, span, &tool));
        let Some(routed) = routed else {
            return self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent);
        };
        self.log_field(host, log_field::TOOL, &tool);
        if let Some(refused) = self.authorize(
            host,
            Item::Tool,
            &service,
            &tool,
            Some((&server, visible)),
            &request.id,
        ) {
            return refused;
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        self.watch_links(&server, &service);
        match self.verdict_on(host, &service, &tool) {
            Judgement::Refuse(refused) => {
                let refused =
                    refused.seen_on(&server, visible, &service, &self.shared.borrow().visible);
                let reply = refused.reply(self.version, &request.id, self.framing);
                self.answer(host, 200, &reply)
            }
            Judgement::Pass => self.route_call(host, &routed, &service, &tool),
            Judgement::Admit(admitted) => {
                let fallback = admitted.policy.fallback_tool.as_deref().and_then(|f| {
                    let shared = self.shared.borrow();
                    shared.visible.get(&server, &service, f).map(str::to_string)
                });
                if let Some(judged) = &mut self.request {
                    judged.tool = Some((visible.to_string(), fallback));
                }
                self.admitted = Some(admitted);
                self.route_call(host, &routed, &service, &tool)
            }
        }
    }

    /// Has the answer's resource links shown as `server` shows `service`'s resources, when
    /// that virtual server offers any (else no URI of them could lead elsewhere).
    fn watch_links(&mut self, server: &str, service: &str) {
        let offers = self
            .shared
            .borrow()
            .config
            .virtual_servers
            .get(server)
            .is_some_and(|r| !r.resources.is_empty() || !r.templates.is_empty());
        if offers {
            self.edit = Some(AnswerEdit {
                server: server.to_string(),
                service: service.to_string(),
                links: true,
                questions: false,
                sse: false,
            });
        }
    }

    /// A request about one prompt or one resource on the aggregate endpoint (`prompts/get`,
    /// `resources/read`, `resources/subscribe` / `unsubscribe`, and `completion/complete` by
    /// the prompt or resource it completes): the prompt's name (or the URI) looked up in the
    /// virtual server's routes, put back as its server wrote it, and the request sent to that
    /// service's route like a call (the session held for the client, the service's limits),
    /// with no breaker: its answer counts only in the health feedback.
    fn route_surface(
        &mut self,
        host: &impl CallHost,
        request: &Request<'_>,
        bytes: &[u8],
    ) -> Action {
        let Some(server) = self.on_virtual.as_ref().map(|v| v.server.clone()) else {
            return Action::Continue;
        };
        let completed = if request.method == COMPLETION_COMPLETE {
            request.params_ref_raw.and_then(completion_ref)
        } else {
            None
        };
        let (prompt, asked, raw) = match &completed {
            Some(CompletionRef::Prompt { name, raw }) => (true, Some(name.as_ref()), Some(*raw)),
            Some(CompletionRef::Resource { uri, raw }) => (false, Some(uri.as_ref()), Some(*raw)),
            None if request.method == COMPLETION_COMPLETE => (false, None, None),
            None if request.method == PROMPTS_GET => (
                true,
                request.params_name.as_deref(),
                request.params_name_raw,
            ),
            None => (false, request.params_uri.as_deref(), request.params_uri_raw),
        };
        let (Some(asked), Some(raw)) = (asked, raw) else {
            let field = if request.method == COMPLETION_COMPLETE {
                "params.ref must be {\"type\": \"ref/prompt\", \"name\": <string>} or \
                 {\"type\": \"ref/resource\", \"uri\": <string>}"
            } else if prompt {
                "params.name must be a string"
            } else {
                "params.uri must be a string"
            };
            let message = format!("{}: {field}", request.method);
            let reply = reply::error(
                self.version,
                Some(&request.id),
                crate::mcp::request::INVALID_PARAMS,
                &message,
                None::<()>,
                self.framing,
            );
            return self.answer(host, 200, &reply);
        };
        let found = {
            let shared = self.shared.borrow();
            shared
                .config
                .virtual_servers
                .get(&server)
                .and_then(|routes| {
                    if prompt {
                        routes
                            .prompts
                            .get(asked)
                            .map(|t| (t.service.clone(), t.tool.clone()))
                    } else {
                        routes.resource_target(asked)
                    }
                })
        };
        let Some((service, own)) = found else {
            let endpoint = aggregate::endpoint_path(&server);
            let (code, message) = if prompt {
                (
                    crate::mcp::request::INVALID_PARAMS,
                    format!(
                        "Unknown prompt: this endpoint (`{endpoint}`) offers no prompt `{asked}`. \
                         Call prompts/list for the prompts it has."
                    ),
                )
            } else {
                (
                    RESOURCE_NOT_FOUND,
                    format!(
                        "Resource not found: no service of this endpoint (`{endpoint}`) offers \
                         `{asked}`. Call resources/list and resources/templates/list for what it has."
                    ),
                )
            };
            let reply = reply::error(
                self.version,
                Some(&request.id),
                code,
                &message,
                None::<()>,
                self.framing,
            );
            return self.answer(host, 200, &reply);
        };
        let routed =
            aggregate::span_in(bytes, raw).and_then(|span| aggregate::with_name(bytes, span, &own));
        let Some(routed) = routed else {
            return self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent);
        };
        // Judged by the rules of the service and of this virtual server, as on the service's
        // own route: a service that requires a token for its tools requires one here too, and
        // a prompt or resource its rules guard needs a rule granting it.
        let item = if prompt { Item::Prompt } else { Item::Resource };
        if let Some(refused) = self.authorize(
            host,
            item,
            &service,
            &own,
            Some((&server, asked)),
            &request.id,
        ) {
            return refused;
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        self.surface_feedback = true;
        if request.method == PROMPTS_GET {
            self.watch_links(&server, &service);
        }
        if request.method == RESOURCES_READ && own != asked {
            self.surface_uri = Some((own.clone(), asked.to_string()));
        }
        self.route_call(host, &routed, &service, &own)
    }

    /// Sends a call made on the aggregate endpoint to its service's own route, `/mcp/<service>`,
    /// so that Envoy applies that route (cluster, path rewrite, timeouts, retries, bulkhead),
    /// with `body` (the agent's, with the tool's own name).
    fn route_call(
        &mut self,
        host: &impl CallHost,
        body: &[u8],
        service: &str,
        tool: &str,
    ) -> Action {
        let Some(on) = &mut self.on_virtual else {
            return Action::Continue;
        };
        on.routed = true;
        host.set_request_body(self.body_len, body);
        if self.declared_length {
            host.set_request_header("content-length", Some(&body.len().to_string()));
        }
        if self.header_name.is_some() {
            host.set_request_header("mcp-name", Some(tool));
        }
        // The agent's `Mcp-Session-Id` is a gateway session of toolgate-xds, which no server
        // knows: it is exchanged for the session the gateway holds with this service for it
        // (see `crate::held_session`), or dropped (a 2026-07-28 client has none, and gets
        // one held for its stated identity when the server needs one).
        let gateway_session = host
            .request_header(SESSION_HEADER)
            .filter(|id| id.starts_with(held_session::GATEWAY_PREFIX));
        host.set_request_header(SESSION_HEADER, None);
        let query = on.query.clone();
        // Envoy picked a route for the agent's path before this filter ran. Its wasm host drops
        // that choice whenever a plugin sets a request header, so the router picks again, by
        // this path: verified with Envoy 1.40.0 (tests/tests/aggregate_calls.rs passes with a
        // filter build that does nothing more, where `/mcp` has no route of its own). Should
        // a later Envoy stop doing so (envoyproxy/envoy#36671 meant to), that test fails with
        // a 404, and the remedy is its foreign function `clear_route_cache`
        // (`hostcalls::call_foreign_function("clear_route_cache", None)`), one host call.
        host.set_request_header(":path", Some(&aggregate::service_path(service, &query)));
        route_to(host, service);
        let identity = self.held_identity();
        let (owner, client) = match gateway_session {
            Some(id) => match held_session::owner_of(held_session::OwnerKind::Gateway, &id) {
                Some(owner) => (
                    held_session::bound_to(owner, identity.as_deref()),
                    HeldFor::Gateway(id),
                ),
                None => return Action::Continue,
            },
            // A 2026-07-28 client calling a server that needs a session: one held for the
            // identity it states. Any other call without a gateway session goes as it is
            // (one map lookup: the common stateless case pays no more).
            None => {
                let revision = (self.version >= ProtocolVersion::V2026_07_28)
                    .then(|| {
                        self.shared
                            .borrow()
                            .config
                            .legacy_revisions
                            .get(service)
                            .cloned()
                    })
                    .flatten();
                let Some(revision) = revision else {
                    return Action::Continue;
                };
                let params = held_session::stateless_params(body, &revision);
                (
                    held_session::bound_to(
                        held_session::owner_of_identity(&params),
                        identity.as_deref(),
                    ),
                    HeldFor::Stateless(params),
                )
            }
        };
        let slot = held_session::slot_key(&owner, service);
        let cached = {
            let shared = self.shared.borrow();
            shared
                .breakers
                .store()
                .get(&slot)
                .ok()
                .flatten()
                .and_then(|(bytes, _)| held_session::decode_slot(&bytes, &owner, service))
        };
        // An answer asked for long ago is asked for again (toolgate-xds learns the session is
        // in use), and used still should toolgate-xds not answer.
        let (cached, fallback) = match cached {
            Some(held_session::Slot::Held {
                held: answer,
                asked_ms,
            }) if host.now_ms().saturating_sub(asked_ms) < held_session::REFRESH_MS => {
                (Some(answer), None)
            }
            Some(held_session::Slot::Held { held: answer, .. }) => (None, Some(answer)),
            Some(held_session::Slot::Ended) => return self.session_ended_here(host),
            None => (None, None),
        };
        let mut held = HeldCall {
            owner,
            service: service.to_string(),
            client,
            slot,
            envelope: None,
            body: body.to_vec(),
            phase: HeldPhase::Sent,
            fallback,
            opened_ms: None,
            unsessioned: false,
        };
        if let Some(answer) = cached {
            held.use_answer(host, &answer);
            self.held = Some(held);
            return Action::Continue;
        }
        let caller = self.held_caller(host);
        let request = held_session::open_request(&held.question(&caller));
        held.phase = HeldPhase::Opening;
        self.held = Some(held);
        if host.dispatch(
            held_session::OPEN_PATH,
            &request,
            &self.report_authorization(),
        ) {
            return Action::Pause;
        }
        // Not even asked (Envoy knows no control cluster to send to): as if unanswered.
        self.mark_unsessioned();
        Action::Continue
    }

    /// `Bearer <token>` when toolgate-xds requires one of the filters, else empty.
    fn report_authorization(&self) -> String {
        crate::feedback::authorization(&self.shared.borrow().config.report_token)
    }

    /// The session this client's call would go on ended (the client or its live server ended
    /// it, or its gateway session is over): answered here as the server would, "session not
    /// found", so the client initializes again.
    fn session_ended_here(&mut self, host: &impl CallHost) -> Action {
        self.record(host, Outcome::Ignored, None);
        let id = self.request.as_ref().map(|j| j.id.clone());
        let reply = reply::error(
            self.version,
            id.as_ref(),
            crate::mcp::request::INVALID_REQUEST,
            "Session not found: it was ended; initialize a new session",
            None::<()>,
            Framing::Json,
        );
        self.answer(host, 404, &reply)
    }

    /// No session could be had for the call: it is answered here, saying what happened, and
    /// counts for nothing against the tool (the service's instances are judged by their
    /// probes). A replayed call that failed on its server counts as the failure it is.
    fn session_unopened(&mut self, host: &impl CallHost, why: held_session::Unopened) -> Action {
        use held_session::Unopened as U;
        let failure = match why {
            U::NoInstance => UpstreamFailure::NoHealthyUpstream,
            U::AtBound { limit, per_caller } => UpstreamFailure::SessionLimit { limit, per_caller },
            U::Refused(status) => UpstreamFailure::SessionRefused(status),
            U::Timeout | U::CallTimeout => UpstreamFailure::Timeout,
            U::CallReset => UpstreamFailure::Reset,
            U::CallBadResponse => UpstreamFailure::BadResponse,
            U::Unreachable | U::Failed => UpstreamFailure::ConnectFailure,
            U::Overloaded => {
                if self.admitted.is_some() {
                    let reply = self.overloaded(host);
                    return self.answer(host, 200, &reply);
                }
                UpstreamFailure::NoHealthyUpstream
            }
            U::Ended | U::SessionGone => return self.session_ended_here(host),
        };
        match why {
            U::CallTimeout | U::CallReset | U::CallBadResponse => {
                self.record(host, Outcome::Failure, None)
            }
            _ => self.record(host, Outcome::Ignored, None),
        }
        let (Some(judged), Some(service)) = (&self.request, &self.service) else {
            return Action::Continue;
        };
        // An admitted `tools/call` gets the semantic reply, naming its fallback, as it does
        // when Envoy finds no healthy upstream: a client of the aggregate endpoint with a
        // gateway session got a JSON-RPC error instead once its tool's service had left
        // (tests/tests/aggregate_calls.rs).
        if judged.tool.is_some() {
            let reply = self.failure_reply(failure, self.framing);
            return self.answer(host, 200, &reply);
        }
        let reply =
            reply::service_unavailable(self.version, &judged.id, service, failure, self.framing);
        self.answer(host, 200, &reply)
    }

    /// toolgate-xds answered a question this call asked (a session opened, a call replayed).
    pub fn on_dispatch_response(
        &mut self,
        host: &impl CallHost,
        status: Option<u16>,
        body: &[u8],
    ) -> Action {
        let Some(held) = self.held.as_mut() else {
            return Action::Continue;
        };
        match held.phase {
            HeldPhase::Opening => {
                let answer = match status {
                    Some(200) => serde_json::from_slice::<held_session::Held>(body).ok(),
                    _ => None,
                };
                // An answer asked for a while ago is used still when toolgate-xds does not
                // answer, or could not open another; not when it said the session is over or
                // not to be had. Kept as asked now, so that calls do not all ask again.
                let kept = matches!(
                    held_session::unopened(status, body),
                    held_session::Unopened::Failed
                        | held_session::Unopened::Unreachable
                        | held_session::Unopened::Timeout
                        | held_session::Unopened::Refused(_)
                );
                let answer = match (answer, held.fallback.take()) {
                    (Some(a), _) => Some(a),
                    (None, Some(old)) if kept => {
                        held.store(&self.shared, &old, host.now_ms());
                        held.use_answer(host, &old);
                        held.phase = HeldPhase::Sent;
                        host.resume_request();
                        return Action::Continue;
                    }
                    (None, None)
                        if held_session::unopened(status, body)
                            == held_session::Unopened::Failed =>
                    {
                        return self.go_unsessioned(host);
                    }
                    (None, _) => None,
                };
                let Some(answer) = answer else {
                    host.log(
                        Level::Warn,
                        &format!(
                            "toolgate: no session with service {} for a client of the aggregate endpoint: toolgate-xds answered {status:?}: {}",
                            held.service,
                            String::from_utf8_lossy(&body[..body.len().min(300)])
                        ),
                    );
                    // Answered locally: the paused request is not resumed.
                    let why = held_session::unopened(status, body);
                    return self.session_unopened(host, why);
                };
                held.store(&self.shared, &answer, host.now_ms());
                held.use_answer(host, &answer);
                held.phase = HeldPhase::Sent;
                host.resume_request();
                Action::Continue
            }
            HeldPhase::Replaying => {
                let replayed = match status {
                    Some(200) => serde_json::from_slice::<held_session::Replayed>(body).ok(),
                    _ => None,
                };
                held.phase = HeldPhase::Sent;
                let Some(r) = replayed else {
                    return self.replay_refused(host, status, body);
                };
                held.store(&self.shared, &r.held, host.now_ms());
                held.opened_ms = r.held.opened_ms;
                // A client of a service's route gets its new id (those SDKs that take a new id
                // from any response do; the others keep the old one, which now leads here too).
                let resealed = match (&held.client, &r.held.envelope) {
                    (HeldFor::Route(params), Some(envelope)) => {
                        let value = held_session::join(envelope, Some(params), r.held.opened_ms);
                        self.shared
                            .borrow()
                            .sealer
                            .as_ref()
                            .and_then(|s| s.seal(&value, &held.service))
                    }
                    _ => None,
                };
                let stateless = matches!(held.client, HeldFor::Stateless(_));
                if let Some(what) = self.replayed_outcome(host, &r) {
                    // Not an answer the client could use: the failure, in MCP terms.
                    let reply = self.failure_reply(what, self.framing);
                    host.send_reply(200, &reply, &[]);
                    return Action::Continue;
                }
                let headers: Vec<(&str, &str)> = resealed
                    .as_deref()
                    .map(|id| vec![(SESSION_HEADER, id)])
                    .unwrap_or_default();
                let completed = if stateless && (200..300).contains(&r.status) {
                    held_session::complete_results(r.body.as_bytes())
                } else {
                    None
                };
                host.send_raw(
                    u32::from(r.status),
                    &r.content_type,
                    completed.as_deref().unwrap_or(r.body.as_bytes()),
                    &headers,
                );
                Action::Continue
            }
            HeldPhase::Sent | HeldPhase::Checking => Action::Continue,
        }
    }

    /// No toolgate-xds answered and no session with the service is held for this client: the
    /// call goes to the service without one. A server that needs none (stateless, or of a
    /// revision without sessions) answers it; one that needs a session says "session unknown",
    /// and the client gets a tool result saying so ([`CallFilter::unsessioned_refused`]).
    fn go_unsessioned(&mut self, host: &impl CallHost) -> Action {
        self.mark_unsessioned();
        host.resume_request();
        Action::Continue
    }

    fn mark_unsessioned(&mut self) {
        if let Some(held) = self.held.as_mut() {
            held.unsessioned = true;
            held.phase = HeldPhase::Sent;
            held.envelope = None;
        }
        self.shared.borrow_mut().stats.count(UNSESSIONED_CALLS);
    }

    /// A call sent without a session ([`CallFilter::go_unsessioned`]) that the server refused
    /// for want of one: the failure, in MCP terms, in place of the server's answer.
    fn unsessioned_refused(&mut self, host: &impl CallHost) -> Action {
        if let Some(h) = self.held.as_mut() {
            h.phase = HeldPhase::Sent;
            h.unsessioned = false;
        }
        // Not the tool's fault, nor the instance's.
        self.record(host, Outcome::Ignored, None);
        let failure = UpstreamFailure::NoControlPlane;
        let reply = match (&self.request, &self.service) {
            (Some(judged), _) if judged.tool.is_some() => self.failure_reply(failure, self.framing),
            (Some(judged), Some(service)) => {
                reply::service_unavailable(self.version, &judged.id, service, failure, self.framing)
            }
            _ => return Action::Continue,
        };
        host.send_reply(200, &reply, &[]);
        Action::Pause
    }

    /// A call on a held or sealed session that the server answered "session unknown"
    /// (`toolgate_model::session_loss`): toolgate-xds decides whether the session was lost
    /// with its instance (re-opened, and the call replayed there) or ended by the client or
    /// the live server (the server's answer goes on). A 404 says so at once; a 400 says so in
    /// its body, which is held and read first ([`HeldPhase::Checking`]).
    fn replay_lost_session(&mut self, host: &impl CallHost, end_of_stream: bool) -> Option<Action> {
        let held = self.held.as_mut()?;
        let unsessioned = held.unsessioned && held.phase == HeldPhase::Sent;
        if !unsessioned
            && (held.phase != HeldPhase::Sent || held.envelope.is_none() || held.body.is_empty())
        {
            return None;
        }
        let status = host
            .response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())?;
        if toolgate_model::session_loss::session_unknown(status, None) {
            if unsessioned {
                return Some(self.unsessioned_refused(host));
            }
            return self.ask_replay(host);
        }
        if unsessioned && status == 400 && end_of_stream {
            return Some(self.unsessioned_refused(host));
        }
        // A 400 without a body cannot say -32000.
        if status == 400 && !end_of_stream {
            held.phase = HeldPhase::Checking;
            return Some(Action::Pause);
        }
        None
    }

    /// Asks toolgate-xds to replay the call whose session the server no longer knows; `None`
    /// when the question could not be sent (the server's answer goes on).
    fn ask_replay(&mut self, host: &impl CallHost) -> Option<Action> {
        let caller = self.held_caller(host);
        let claims = self.held_claims(self.held.as_ref()?.service.as_str());
        let answered_by = host
            .property(&["upstream", "address"])
            .and_then(|a| String::from_utf8(a).ok());
        let held = self.held.as_mut()?;
        let stale = held.envelope.clone().unwrap_or_default();
        let lost = held_session::LostSession {
            stale: &stale,
            opened_ms: held.opened_ms,
            answered_by: answered_by.as_deref(),
        };
        let request =
            held_session::replay_request(&held.question(&caller), &lost, &held.body, &claims);
        held.phase = HeldPhase::Replaying;
        if host.dispatch(
            held_session::REPLAY_PATH,
            &request,
            &self.report_authorization(),
        ) {
            Some(Action::Pause)
        } else {
            if let Some(h) = self.held.as_mut() {
                h.phase = HeldPhase::Sent;
            }
            None
        }
    }

    /// toolgate-xds replayed nothing. Ended by the client or the live server: the server's
    /// answer goes on (the client initializes again, as the specification says it must), and
    /// the slot remembers. Otherwise the client is told what happened.
    fn replay_refused(&mut self, host: &impl CallHost, status: Option<u16>, body: &[u8]) -> Action {
        let why = held_session::unopened(status, body);
        match why {
            held_session::Unopened::Ended | held_session::Unopened::SessionGone => {
                if let Some(h) = &self.held {
                    h.ended(&self.shared);
                }
                // The request was not the tool's to fail.
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                host.resume_response();
                Action::Continue
            }
            // No answer from toolgate-xds: the server's goes on.
            held_session::Unopened::Failed => {
                self.record(host, Outcome::Ignored, None);
                host.resume_response();
                Action::Continue
            }
            // Told here what happened, when there is a request to answer; a notification's
            // answer is the server's.
            why if self.request.is_some() && self.service.is_some() => {
                self.session_unopened(host, why);
                Action::Continue
            }
            _ => {
                self.record(host, Outcome::Ignored, None);
                host.resume_response();
                Action::Continue
            }
        }
    }

    /// Records what the server answered a replayed call, as any call's answer counts; the
    /// failure to answer in its place when it is not an answer the client can use.
    fn replayed_outcome(
        &mut self,
        host: &impl CallHost,
        r: &held_session::Replayed,
    ) -> Option<UpstreamFailure> {
        // Only an admitted call has an outcome to record.
        self.admitted.as_ref()?;
        let id = self.request.as_ref().map(|j| j.id.clone())?;
        match r.status {
            500..=599 => {
                self.record(host, Outcome::Failure, None);
                Some(UpstreamFailure::Http5xx(r.status))
            }
            200..=299 => {
                let class = if r.content_type.starts_with("text/event-stream") {
                    let mut scanner = SseScanner::new(id);
                    scanner
                        .feed(r.body.as_bytes())
                        .or_else(|| scanner.finish())
                        .unwrap_or(ResponseClass::Other)
                } else {
                    classify_response(r.body.as_bytes(), &id)
                };
                self.classified(host, class)
            }
            _ => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
        }
    }

    /// A 2025-03-26 batch on the aggregate endpoint: one request goes to one place, so a batch
    /// with a `tools/call` is refused whole (each call told to come alone); one without goes
    /// on to toolgate-xds.
    fn judge_virtual_batch(&mut self, host: &impl CallHost, elements: &[Body<'_>]) -> Action {
        if self.version > ProtocolVersion::V2025_03_26 {
            return self.refuse(host, 400, None, Refusal::BatchNotAllowed);
        }
        self.log_field(host, log_field::METHOD, "batch");
        let requests = elements.iter().filter_map(|e| match e {
            Body::Request(r) => Some(r),
            _ => None,
        });
        if !requests.clone().any(|r| r.method == TOOLS_CALL) {
            return Action::Continue;
        }
        let batch: Vec<BatchAnswer<'_>> = requests
            .map(|r| {
                if r.method == TOOLS_CALL {
                    BatchAnswer::Error(
                        &r.id,
                        crate::mcp::request::INVALID_REQUEST,
                        reply::BATCHED_VIRTUAL_CALL,
                    )
                } else {
                    BatchAnswer::NotRun(&r.id)
                }
            })
            .collect();
        let reply = reply::batch_refused(self.version, &batch, self.framing);
        self.answer(host, 200, &reply)
    }

    /// Records the request; for a `tools/call`, the tool it names (`Ok(None)`: another
    /// method). A name that is missing or breaks the rule is answered here (`Err`).
    fn called_tool<'r>(
        &mut self,
        host: &impl CallHost,
        request: &'r Request<'_>,
    ) -> Result<Option<&'r str>, Action> {
        self.log_field(host, log_field::METHOD, &request.method);
        self.request = Some(Judged {
            id: request.id.clone(),
            discover: request.method == SERVER_DISCOVER,
            tool: None,
            list: None,
        });
        if request.method != TOOLS_CALL {
            // A service's tool listing is annotated; any listing is filtered to what the
            // caller may use once rules guard what it lists.
            let listing = Listing::of_method(&request.method).filter(|&listing| {
                (listing == Listing::Tools && self.on_virtual.is_none())
                    || self.listing_filtered_for(listing)
            });
            if let Some(judged) = &mut self.request {
                judged.list = listing;
            }
            return Ok(None);
        }
        match request.tool() {
            Some(ToolName::Valid(tool)) => Ok(Some(tool)),
            Some(ToolName::Invalid(_)) => {
                Err(self.refuse(host, 200, Some(&request.id), Refusal::ToolNameInvalid))
            }
            _ => Err(self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent)),
        }
    }

    fn judge_request(
        &mut self,
        host: &impl CallHost,
        service: &str,
        request: Request<'_>,
    ) -> Action {
        let tool = match self.called_tool(host, &request) {
            Ok(Some(tool)) => tool,
            Ok(None) => {
                for (item, name) in surface_items(&request) {
                    if let Some(refused) =
                        self.authorize(host, item, service, &name, None, &request.id)
                    {
                        return refused;
                    }
                }
                return Action::Continue;
            }
            Err(answered) => return answered,
        };
        self.log_field(host, log_field::TOOL, tool);
        if let Some(refused) = self.authorize(host, Item::Tool, service, tool, None, &request.id) {
            return refused;
        }
        match self.verdict_on(host, service, tool) {
            Judgement::Refuse(refused) => {
                let reply = refused.reply(self.version, &request.id, self.framing);
                self.answer(host, 200, &reply)
            }
            Judgement::Pass => Action::Continue,
            Judgement::Admit(admitted) => {
                if let Some(judged) = &mut self.request {
                    judged.tool =
                        Some((admitted.tool.clone(), admitted.policy.fallback_tool.clone()));
                }
                self.admitted = Some(admitted);
                Action::Continue
            }
        }
    }

    /// Decides one `tools/call`: pass unjudged, refuse, or admit with a breaker.
    fn verdict_on(&mut self, host: &impl CallHost, service: &str, tool: &str) -> Judgement {
        let now = host.now_ms();
        let mut guard = self.shared.borrow_mut();
        let Shared {
            config,
            breakers,
            stats,
            unlisted,
            ..
        } = &mut *guard;
        let key = breaker_key(service, tool);
        if let Some(reason) = fleet::forced_open(&config.overrides, service, tool) {
            let policy = config.policy_for(service, tool);
            let rejected = Admission::Reject {
                retry_after_ms: 0,
                state: State::Open,
                forced: true,
            };
            stats.admitted(&key, service, tool, &rejected, now);
            let refused = Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: reason.to_string(),
                fallback: policy.fallback_tool,
            };
            drop(guard);
            self.log_field(host, log_field::BREAKER, "forced_open");
            return Judgement::Refuse(refused);
        }
        let mut learning = false;
        match catalog::lookup(&config.catalog, service, tool) {
            Known::Listed => {}
            // The server answers for a name the gateway holds no state for: no breaker, no
            // stats of its own (a request cannot create either by naming things).
            Known::NotListed => {
                stats.count(CALLS_UNLISTED);
                return Judgement::Pass;
            }
            Known::UnknownService => return Judgement::Pass,
            Known::Unlisted => {
                if !unlisted.admits(breakers.store(), service, tool, now) {
                    // Watched like an admitted call, without a breaker: if the server answers
                    // it as a tool, the name gets one.
                    learning = true;
                }
            }
        }
        let policy = config.policy_for(service, tool);
        if learning {
            drop(guard);
            return Judgement::Admit(Admitted {
                key,
                tool: tool.to_string(),
                policy,
                admission: Admission::Allow,
                started_ms: now,
                metrics: None,
                endpoint: Endpoint::Unread,
                learning: true,
            });
        }
        let (admission, transition) = breakers.admit(&key, &policy, now);
        let metrics = stats.admitted(&key, service, tool, &admission, now);
        if let Some(t) = &transition {
            stats.transition(&key, t.to, t.at_ms);
        }
        let opened_by = match admission {
            Admission::Reject { forced: false, .. } => {
                breakers.snapshot(&key).and_then(|b| b.opened_by().cloned())
            }
            _ => None,
        };
        drop(guard);
        if let Some(t) = transition {
            host.log(Level::Warn, &transition_line(&key, &t));
        }
        self.log_field(
            host,
            log_field::BREAKER,
            match &admission {
                Admission::Allow => "closed",
                Admission::Probe { .. } => "half_open",
                Admission::Reject { forced: true, .. } => "forced_open",
                Admission::Reject { .. } => "open",
            },
        );
        match admission {
            // A force the breaker still carries after its override was lifted: lifted on
            // the next configuration; until then it is an operator's, with no end to tell.
            Admission::Reject { forced: true, .. } => Judgement::Refuse(Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: String::new(),
                fallback: policy.fallback_tool.clone(),
            }),
            Admission::Reject {
                retry_after_ms,
                state,
                forced: false,
            } => Judgement::Refuse(Refused::Breaker {
                tool: tool.to_string(),
                state,
                cause: open_cause(opened_by.as_ref()),
                retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
                fallback: policy.fallback_tool.clone(),
            }),
            Admission::Allow | Admission::Probe { .. } => Judgement::Admit(Admitted {
                key,
                tool: tool.to_string(),
                policy,
                admission,
                started_ms: now,
                metrics,
                endpoint: Endpoint::Unread,
                learning: false,
            }),
        }
    }

    /// A 2025-03-26 batch: every element is judged; if any call in it would be refused, none
    /// of it runs and every request gets an answer. Calls of an admitted batch go upstream
    /// without a breaker outcome (one response then carries several tools' results), and a
    /// half-open tool takes no batched call (its probes must be judged one by one).
    fn judge_batch(
        &mut self,
        host: &impl CallHost,
        service: &str,
        elements: Vec<Body<'_>>,
    ) -> Action {
        if self.version > ProtocolVersion::V2025_03_26 {
            return self.refuse(host, 400, None, Refusal::BatchNotAllowed);
        }
        self.log_field(host, log_field::METHOD, "batch");
        let now = host.now_ms();
        let mut answers: Vec<(RawId, Option<Refused>)> = Vec::new();
        let mut any_refused = false;
        for element in &elements {
            let Body::Request(request) = element else {
                continue;
            };
            let refused = if request.method == TOOLS_CALL {
                self.peek_call(service, request, now)
            } else {
                self.peek_surface(service, request)
            };
            any_refused |= refused.is_some();
            answers.push((request.id.clone(), refused));
        }
        if !any_refused {
            return Action::Continue;
        }
        let details: Vec<Option<Unavailable<'_>>> = answers
            .iter()
            .map(|(_, r)| r.as_ref().and_then(Refused::unavailable))
            .collect();
        let errors: Vec<Option<(i64, String)>> = answers
            .iter()
            .map(|(_, r)| r.as_ref().map(Refused::error))
            .collect();
        let batch: Vec<BatchAnswer<'_>> = answers
            .iter()
            .zip(details)
            .zip(&errors)
            .map(|(((id, _), details), error)| match (details, error) {
                (Some(details), _) => BatchAnswer::Unavailable(id, details),
                (None, Some((code, message))) => BatchAnswer::Error(id, *code, message),
                (None, None) => BatchAnswer::NotRun(id),
            })
            .collect();
        let reply = reply::batch_refused(self.version, &batch, self.framing);
        self.answer(host, 200, &reply)
    }

    /// Whether a prompt or resource request of a batch would be refused by the rules.
    fn peek_surface(&self, service: &str, request: &Request<'_>) -> Option<Refused> {
        let shared = self.shared.borrow();
        let auth = shared.config.auth.as_ref()?;
        surface_items(request).into_iter().find_map(|(item, name)| {
            (auth.decide_service_item(service, item, &name, self.auth.caller())
                != AuthVerdict::Allow)
                .then(|| Refused::NotPermitted {
                    service: service.to_string(),
                    item,
                    name: name.into_owned(),
                })
        })
    }

    /// Whether one call of a batch would be refused, without taking a probe slot or
    /// creating any state.
    fn peek_call(&self, service: &str, request: &Request<'_>, now: u64) -> Option<Refused> {
        let tool = match request.tool() {
            Some(ToolName::Valid(tool)) => tool,
            Some(ToolName::Invalid(_)) => return Some(Refused::Plain(Refusal::ToolNameInvalid)),
            _ => return Some(Refused::Plain(Refusal::ToolNameAbsent)),
        };
        if let Some(auth) = &self.shared.borrow().config.auth {
            if auth.decide_service(service, tool, self.auth.caller()) != AuthVerdict::Allow {
                return Some(Refused::NotPermitted {
                    service: service.to_string(),
                    item: Item::Tool,
                    name: tool.to_string(),
                });
            }
        }
        let mut guard = self.shared.borrow_mut();
        let Shared {
            config, breakers, ..
        } = &mut *guard;
        let policy = config.policy_for(service, tool);
        if let Some(reason) = fleet::forced_open(&config.overrides, service, tool) {
            return Some(Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: reason.to_string(),
                fallback: policy.fallback_tool,
            });
        }
        match catalog::lookup(&config.catalog, service, tool) {
            Known::NotListed | Known::UnknownService | Known::Unlisted => return None,
            Known::Listed => {}
        }
        let key = breaker_key(service, tool);
        let (retry_after_ms, state) = match breakers.peek(&key, &policy, now) {
            Some(Admission::Allow) => return None,
            Some(Admission::Reject {
                retry_after_ms,
                state,
                ..
            }) => (retry_after_ms, state),
            // A probe is due: probes are judged one by one, not in a batch.
            Some(Admission::Probe { .. }) | None => (1000, State::HalfOpen),
        };
        let cause = breakers.snapshot(&key).and_then(|b| b.opened_by().cloned());
        Some(Refused::Breaker {
            tool: tool.to_string(),
            state,
            cause: open_cause(cause.as_ref()),
            retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
            fallback: policy.fallback_tool,
        })
    }

    pub fn on_response_headers(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        if self.sealing {
            self.seal_session(host);
        }
        if self.on_virtual.as_ref().is_some_and(|v| v.routed) {
            // The agent's session is the gateway's: a server's session id (with the instance's
            // address wrapped around it by the session affinity) must not replace it.
            host.set_response_header(SESSION_HEADER, None);
        }
        if let Some(action) = self.replay_lost_session(host, end_of_stream) {
            return action;
        }
        if self.on_virtual.as_ref().is_some_and(|v| !v.routed) {
            if let Some(action) = self.control_plane_unreachable(host, end_of_stream) {
                return action;
            }
        }
        // The filter asks servers for uncompressed answers; one compressed anyway cannot be
        // read, so it is neither judged nor edited: it passes as its headers say it is.
        let encoded = host
            .response_header("content-encoding")
            .is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"));
        if !encoded
            && self.held.as_ref().is_some_and(|h| {
                h.phase == HeldPhase::Sent && matches!(h.client, HeldFor::Stateless(_))
            })
            && host
                .response_header(":status")
                .is_some_and(|s| s.starts_with('2'))
        {
            self.completing = true;
            // The completed answer is longer.
            host.set_response_header("content-length", None);
        }
        if self.stage == Stage::Stream {
            return self.stream_response(host, end_of_stream);
        }
        self.plan_edit(host, encoded, end_of_stream);
        if self.request.is_none() {
            return Action::Continue;
        }
        let status = host
            .response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        // Each host call costs about a microsecond: only a failure needs Envoy's details.
        let (overloaded, details) = if status < 500 {
            (false, String::new())
        } else {
            (
                host.response_header("x-envoy-overloaded").is_some(),
                self.code_details(host),
            )
        };
        let v = verdict(status, overloaded, &details);
        if Kind::of_verdict(v).is_some() {
            self.read_endpoint(host);
        }
        if std::mem::take(&mut self.surface_feedback) {
            self.surface_outcome(host, Kind::of_verdict(v));
            if let Some((own, visible)) = self.surface_uri.take() {
                if status == 200 && !encoded && !end_of_stream {
                    // The rewritten answer is longer.
                    host.set_response_header("content-length", None);
                    self.watch = Watch::ResourceUri { own, visible };
                    return Action::Pause;
                }
            }
        }
        match v {
            Verdict::Answered if encoded => self.unread_answer(host, end_of_stream),
            Verdict::Answered => {
                if self.admitted.is_none() {
                    let listing = self.request.as_ref().is_some_and(|j| j.list.is_some());
                    if listing && status == 200 && !end_of_stream {
                        return self.watch_listing(host);
                    }
                    if let Some(scanner) = self.question_scanner(host) {
                        self.watch = Watch::Questions(scanner);
                    }
                    return Action::Continue;
                }
                if end_of_stream {
                    // A success status and no body: no response to this request will come.
                    let reply = self.upstream_failed(host, UpstreamFailure::BadResponse);
                    return self.replace_now(host, reply);
                }
                let content_type = host.response_header("content-type").unwrap_or_default();
                if content_type.starts_with("text/event-stream") {
                    if let Some(judged) = &self.request {
                        let scanner = match self.question_scanner(host) {
                            Some(noting) => noting,
                            None => SseScanner::new(judged.id.clone()),
                        };
                        self.watch = Watch::Sse(scanner);
                    }
                    // The stream may end without the response, and then gets one more event:
                    // a declared length would cut it off.
                    host.set_response_header("content-length", None);
                    return Action::Continue;
                }
                let declared = host
                    .response_header("content-length")
                    .and_then(|v| v.trim().parse::<usize>().ok());
                if declared.is_some_and(|n| n > HOLD_LIMIT) {
                    self.watch = Watch::Json(Vec::new());
                    return Action::Continue;
                }
                self.watch = Watch::Hold;
                // Should the upstream reset now, Envoy's own reply must still be MCP.
                let cut = self.cut_reply();
                host.set_property(CUT_REPLY_PROPERTY, &cut);
                host.set_request_header(HELD_HEADER, Some("1"));
                Action::Pause
            }
            Verdict::ClientError => {
                // The request was at fault (an unknown session, a header the server refused).
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                Action::Continue
            }
            Verdict::Overloaded | Verdict::Failed(_) => {
                let what = match v {
                    Verdict::Failed(what) => Some(what),
                    _ => None,
                };
                let reply = match (&self.admitted, what) {
                    (Some(_), Some(what)) => self.upstream_failed(host, what),
                    (Some(_), None) => self.overloaded(host),
                    (None, what) => {
                        let (Some(judged), Some(service)) = (&self.request, &self.service) else {
                            return Action::Continue;
                        };
                        let reply = reply::service_unavailable(
                            self.version,
                            &judged.id,
                            service,
                            what.unwrap_or(UpstreamFailure::NoHealthyUpstream),
                            self.framing,
                        );
                        if judged.discover {
                            return self.unavailable(host, reply, end_of_stream);
                        }
                        reply
                    }
                };
                if end_of_stream {
                    return self.replace_now(host, reply);
                }
                replacing(host, "200", reply.content_type);
                self.watch = Watch::Replace(reply);
                Action::Continue
            }
        }
    }

    /// A successful answer the filter cannot read (compressed): no evidence for or against
    /// the tool, so the call counts for nothing; a listing that must be filtered for this
    /// caller is not shown; anything else passes untouched.
    fn unread_answer(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        self.shared.borrow_mut().stats.count(RESPONSES_UNREAD);
        self.record(host, Outcome::Ignored, Some(Kind::Ok));
        let listing = self.request.as_ref().is_some_and(|j| j.list.is_some());
        if !(listing && self.listing_filtered()) {
            return Action::Continue;
        }
        self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
        let reply = self.unfilterable_reply();
        if end_of_stream {
            return self.replace_now(host, reply);
        }
        replacing(host, "200", reply.content_type);
        self.watch = Watch::Replace(reply);
        Action::Continue
    }

    /// A request of the aggregate endpoint that no toolgate-xds answered (Envoy found none
    /// healthy, or could not connect): answered here, in MCP, from the configuration (see
    /// [`crate::offline`]), never with Envoy's plain-text 503. A toolgate-xds's own error
    /// passes as it is.
    fn control_plane_unreachable(
        &mut self,
        host: &impl CallHost,
        end_of_stream: bool,
    ) -> Option<Action> {
        let status = host
            .response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if status < 500 {
            return None;
        }
        let overloaded = host.response_header("x-envoy-overloaded").is_some();
        let details = self.code_details(host);
        match verdict(status, overloaded, &details) {
            Verdict::Failed(UpstreamFailure::Http5xx(_)) => return None,
            Verdict::Failed(_) | Verdict::Overloaded => {}
            Verdict::Answered | Verdict::ClientError => return None,
        }
        let on = self.on_virtual.as_mut()?;
        let (status, reply, session) = match on.method {
            HttpMethod::Get => {
                let reply = reply::error(
                    self.version,
                    None,
                    reply::INTERNAL_ERROR,
                    "The gateway's control plane is unreachable: the stream of changes to the \
                     tool list cannot be opened now. Tools can still be called.",
                    None::<()>,
                    Framing::Json,
                );
                return Some(self.unavailable(host, reply, end_of_stream));
            }
            // The session ends with the client; toolgate-xds forgets it when idle.
            HttpMethod::Delete => (
                200,
                Reply {
                    body: Vec::new(),
                    content_type: "application/json",
                },
                None,
            ),
            HttpMethod::Post => {
                let raw = on.body.take().unwrap_or_default();
                let server = on.server.clone();
                let body = read_body(&raw).ok()?;
                let shared = self.shared.borrow();
                let mut listing = shared.config.offline_listings.get(&server).cloned();
                // Shown to this caller as toolgate-xds's listing would be: only what it may call.
                if let (Some(tools), Some(auth)) = (listing.as_mut(), shared.config.auth.as_ref()) {
                    if self.listing_filtered_for(Listing::Tools) {
                        let routes = shared.config.virtual_servers.get(&server);
                        tools.retain(|tool| {
                            let name = tool["name"].as_str().unwrap_or_default();
                            routes
                                .and_then(|r| routed(r, Listing::Tools, name))
                                .is_some_and(|(service, own)| {
                                    self.may_list(
                                        auth,
                                        Item::Tool,
                                        &service,
                                        &own,
                                        Some((&server, name)),
                                    )
                                })
                        });
                    }
                }
                let ctx = offline::Context {
                    server: &server,
                    listing: listing.as_deref(),
                    version: self.version,
                    framing: self.framing,
                    now_ms: host.now_ms(),
                };
                let sealer = shared.sealer.as_ref();
                match offline::answer(&ctx, &body, &raw, |plain| {
                    sealer?.seal_as(offline::GATEWAY_PREFIX, offline::GATEWAY_AAD, plain)
                }) {
                    offline::Answer::Reply { reply, session } => (200, reply, session),
                    offline::Answer::Accepted => (
                        202,
                        Reply {
                            body: Vec::new(),
                            content_type: "application/json",
                        },
                        None,
                    ),
                }
            }
        };
        self.shared.borrow_mut().stats.count(OFFLINE_ANSWERS);
        if end_of_stream {
            let headers: Vec<(&str, &str)> = session
                .as_deref()
                .map(|id| vec![(SESSION_HEADER, id)])
                .unwrap_or_default();
            host.send_reply(status, &reply, &headers);
            return Some(Action::Pause);
        }
        replacing(host, &status.to_string(), reply.content_type);
        host.set_response_header(SESSION_HEADER, session.as_deref());
        self.watch = Watch::Replace(reply);
        Some(Action::Continue)
    }

    /// A server's answer to a `tools/list` on its route: held to be annotated, as long as it
    /// is small enough to hold ([`HOLD_LIMIT`], like a call's JSON response).
    fn watch_listing(&mut self, host: &impl CallHost) -> Action {
        let content_type = host.response_header("content-type").unwrap_or_default();
        if content_type.starts_with("text/event-stream") {
            // An annotated event is longer than the server's: a declared length would cut it.
            host.set_response_header("content-length", None);
            self.watch = Watch::Listing { sse: true };
            if self.listing_filtered() {
                // Held with its headers: should the stream prove unreadable, it is replaced
                // whole, as a JSON listing is, rather than shown unfiltered.
                return Action::Pause;
            }
            return Action::Continue;
        }
        let declared = host
            .response_header("content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        if !content_type.starts_with("application/json") || declared.is_some_and(|n| n > HOLD_LIMIT)
        {
            self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
            if self.listing_filtered() {
                // Filtered or not shown: read it whole to replace it.
                self.watch = Watch::Listing { sse: false };
                return Action::Pause;
            }
            return Action::Continue;
        }
        self.watch = Watch::Listing { sse: false };
        // The length is set once the body is read: it changes only if a tool is annotated.
        Action::Pause
    }

    /// The held `tools/list` answer (`body_size` bytes so far): annotated when complete, or
    /// passed on as it is when it is too large or not a listing.
    fn listing_body(
        &mut self,
        host: &impl CallHost,
        sse: bool,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if body_size > HOLD_LIMIT {
            self.watch = Watch::None;
            self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
            if self.listing_filtered() {
                if !end_of_stream {
                    // Held to the end, then replaced: it cannot be filtered.
                    self.watch = Watch::Listing { sse: false };
                    return Action::Pause;
                }
                return self.unfilterable_listing(host, body_size);
            }
            return Action::Continue;
        }
        if !sse && !end_of_stream {
            return Action::Pause;
        }
        let Some(judged) = &self.request else {
            self.watch = Watch::None;
            return Action::Continue;
        };
        let body = host.response_body(body_size).unwrap_or_default();
        let now = host.now_ms();
        let (listed, filtered) = {
            let shared = self.shared.borrow();
            let auth = shared.config.auth.as_ref();
            let server = self.on_virtual.as_ref().map(|v| v.server.as_str());
            let routes = server.and_then(|s| shared.config.virtual_servers.get(s));
            let service = self.service.as_deref();
            let listing = judged.list.unwrap_or(Listing::Tools);
            let item = item_listed(listing);
            // A service's own listing: its tools annotated, and filtered for the caller. A
            // virtual server's (toolgate-xds's, annotated already): filtered, each name looked
            // up in its routes; a name it does not route is not listed.
            let edit = |name: &str| match (server, service) {
                (Some(server), _) => {
                    let Some((service, own)) = routes.and_then(|r| routed(r, listing, name)) else {
                        return Edit::Hide;
                    };
                    match auth {
                        Some(a)
                            if !self.may_list(a, item, &service, &own, Some((server, name))) =>
                        {
                            Edit::Hide
                        }
                        _ => Edit::Keep,
                    }
                }
                (None, Some(service)) => match auth {
                    Some(a) if !self.may_list(a, item, service, name, None) => Edit::Hide,
                    _ if listing == Listing::Tools => shared
                        .availability(service, name, now)
                        .map_or(Edit::Keep, Edit::Annotate),
                    _ => Edit::Keep,
                },
                (None, None) => Edit::Keep,
            };
            let listed = if sse {
                match edit_sse(listing, &body, &judged.id, edit, end_of_stream) {
                    SseListed::Incomplete => return Action::Pause,
                    SseListed::Ended => Listed::NotTheResponse,
                    SseListed::Found(listed) => listed,
                }
            } else {
                edit_message(listing, &body, &judged.id, edit)
            };
            (listed, self.listing_filtered())
        };
        self.watch = Watch::None;
        match listed {
            Listed::Annotated {
                body: annotated,
                annotated: n,
                ..
            } => {
                if !sse {
                    host.set_response_header("content-length", Some(&annotated.len().to_string()));
                }
                host.set_response_body(body_size, &annotated);
                if n > 0 {
                    self.shared.borrow_mut().stats.count(TOOLS_LIST_ANNOTATED);
                }
            }
            Listed::Unchanged => {}
            Listed::Unread | Listed::NotTheResponse => {
                self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
                // A listing that must be filtered for this caller but cannot be read is not
                // shown: names of tools the caller may not use are not disclosed.
                if filtered && !sse {
                    return self.unfilterable_listing(host, body_size);
                }
                if filtered {
                    // The stream's headers were held for this: it is replaced whole.
                    let reply = self.unfilterable_reply();
                    replacing(host, "200", reply.content_type);
                    if end_of_stream {
                        host.set_response_body(body_size, &reply.body);
                        return Action::Continue;
                    }
                    self.watch = Watch::Replace(reply);
                    return Action::Pause;
                }
            }
        }
        Action::Continue
    }

    /// Replaces a listing that could not be filtered with a JSON-RPC error (its headers are
    /// still held).
    fn unfilterable_listing(&mut self, host: &impl CallHost, body_size: usize) -> Action {
        let reply = self.unfilterable_reply();
        host.set_response_header("content-type", Some(reply.content_type));
        host.set_response_header("content-length", Some(&reply.body.len().to_string()));
        host.set_response_header("content-encoding", None);
        host.set_response_body(body_size, &reply.body);
        Action::Continue
    }

    /// The error a listing that could not be filtered for its caller is replaced with.
    fn unfilterable_reply(&self) -> Reply {
        reply::error(
            self.version,
            self.request.as_ref().map(|j| &j.id),
            reply::INTERNAL_ERROR,
            "The gateway could not read this tools/list answer to show only the tools you may call, so it is not shown; ask for the next page, or ask an operator.",
            None::<()>,
            Framing::Json,
        )
    }

    /// A GET stream Envoy could not open (no healthy instance, connect failure, full pool):
    /// 503 with `Retry-After` and a JSON-RPC error naming the service. A server's own answer
    /// passes as it is.
    fn stream_response(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        let status = host
            .response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if status < 500 {
            return Action::Continue;
        }
        let details = self.code_details(host);
        let overloaded = host.response_header("x-envoy-overloaded").is_some();
        let what = match verdict(status, overloaded, &details) {
            Verdict::Overloaded => UpstreamFailure::NoHealthyUpstream,
            Verdict::Failed(UpstreamFailure::Http5xx(_)) => return Action::Continue,
            Verdict::Failed(what) => what,
            _ => return Action::Continue,
        };
        let Some(service) = &self.service else {
            return Action::Continue;
        };
        let reply = reply::stream_unavailable(self.version, service, what);
        self.unavailable(host, reply, end_of_stream)
    }

    /// 503 with `Retry-After` and `reply` (a JSON-RPC error) in place of the response.
    fn unavailable(&mut self, host: &impl CallHost, reply: Reply, end_of_stream: bool) -> Action {
        if end_of_stream {
            host.send_reply(503, &reply, &[("retry-after", STREAM_RETRY_AFTER_SECS)]);
            return Action::Pause;
        }
        replacing(host, "503", reply.content_type);
        host.set_response_header("retry-after", Some(STREAM_RETRY_AFTER_SECS));
        self.watch = Watch::Replace(reply);
        Action::Continue
    }

    /// Replaces a response that has no body to replace: a local reply in its place.
    fn replace_now(&mut self, host: &impl CallHost, reply: Reply) -> Action {
        host.send_reply(200, &reply, &[]);
        Action::Pause
    }

    /// Decides, with the answer's headers, what of it to edit as it passes: resource links
    /// (asked for by the request, see [`Self::watch_links`]) and the server's questions (on
    /// the SSE stream of a call routed on a client's session). Nothing of an answer that
    /// failed, is compressed or has no body.
    fn plan_edit(&mut self, host: &impl CallHost, encoded: bool, end_of_stream: bool) {
        let routed = self.on_virtual.as_ref().filter(|v| v.routed);
        let (Some(on), Some(service)) = (routed, &self.service) else {
            self.edit = None;
            return;
        };
        if self.edit.is_none() && self.client_session.is_none() {
            // No links asked for, and no client to ask questions of.
            return;
        }
        let ok = host
            .response_header(":status")
            .is_some_and(|s| s.starts_with('2'));
        if !ok || encoded || end_of_stream {
            self.edit = None;
            return;
        }
        let sse = host
            .response_header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"));
        let questions = sse && self.client_session.is_some();
        match self.edit.as_mut() {
            Some(edit) => {
                edit.sse = sse;
                edit.questions = questions;
            }
            None if questions => {
                self.edit = Some(AnswerEdit {
                    server: on.server.clone(),
                    service: service.clone(),
                    links: false,
                    questions,
                    sse,
                });
            }
            // Nothing to edit: a JSON answer to a request that asked for no links.
            None => return,
        }
        // An edited answer is longer.
        host.set_response_header("content-length", None);
    }

    /// The answer so far edited (see [`AnswerEdit`]): the body's size after that, or `None`
    /// to wait for more (a JSON answer until it is whole, an SSE stream until an event ends).
    /// An answer too large to hold goes as the server wrote it.
    fn edit_answer(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Option<usize> {
        let Some(edit) = &self.edit else {
            return Some(body_size);
        };
        let body = host.response_body(body_size).unwrap_or_default();
        let whole = end_of_stream || (edit.sse && resource_uri::ends_an_event(&body));
        if !whole {
            if body_size <= HOLD_LIMIT {
                return None;
            }
            host.log(
                Level::Info,
                &format!(
                    "toolgate: an answer of `{}` too large to hold passes with its resource URIs and question ids as the server wrote them",
                    edit.service
                ),
            );
            self.edit = None;
            return Some(body_size);
        }
        let links = edit.links && resource_uri::may_hold_links(&body);
        let questions = edit.questions && memchr::memmem::find(&body, b"\"method\"").is_some();
        let edited = if links || questions {
            let shared = self.shared.borrow();
            let routes = shared.config.virtual_servers.get(&edit.server);
            let shown = |uri: &str| match routes.map(|r| r.shown_uri(&edit.service, uri)) {
                Some(std::borrow::Cow::Owned(shown)) => Some(shown),
                _ => None,
            };
            resource_uri::edit_messages(&body, |message| {
                let mut changed = false;
                if questions {
                    changed |= asked::rename_questions(message, &edit.service);
                }
                if links {
                    changed |= resource_uri::rewrite_links_in(message, &shown);
                }
                changed
            })
        } else {
            None
        };
        if end_of_stream {
            self.edit = None;
        }
        match edited {
            Some(edited) => {
                host.set_response_body(body_size, &edited);
                Some(edited.len())
            }
            None => Some(body_size),
        }
    }

    pub fn on_response_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        // A body callback that continued would release the held headers (the server's 404)
        // before the replayed answer is there.
        match self.held.as_ref().map(|h| h.phase) {
            Some(HeldPhase::Replaying) => return Action::Pause,
            Some(HeldPhase::Checking) => {
                return self.check_lost_session(host, body_size, end_of_stream)
            }
            _ => {}
        }
        let mut body_size = body_size;
        if self.completing {
            if !end_of_stream {
                if body_size <= held_session::MAX_COMPLETED_BYTES {
                    return Action::Pause;
                }
                // Too large to hold: it goes as the server sent it.
                self.completing = false;
            } else {
                self.completing = false;
                let body = host.response_body(body_size).unwrap_or_default();
                if let Some(completed) = held_session::complete_results(&body) {
                    host.set_response_body(body_size, &completed);
                    body_size = completed.len();
                }
            }
        }
        if self.edit.is_some() {
            match self.edit_answer(host, body_size, end_of_stream) {
                Some(size) => body_size = size,
                None => return Action::Pause,
            }
        }
        match &mut self.watch {
            Watch::None => Action::Continue,
            Watch::Listing { sse } => {
                let sse = *sse;
                self.listing_body(host, sse, body_size, end_of_stream)
            }
            Watch::ResourceUri { .. } => {
                if !end_of_stream {
                    if body_size > HOLD_LIMIT {
                        // Too large to hold: it goes as the server wrote it.
                        self.watch = Watch::None;
                        return Action::Continue;
                    }
                    return Action::Pause;
                }
                if let Watch::ResourceUri { own, visible } =
                    std::mem::replace(&mut self.watch, Watch::None)
                {
                    let body = host.response_body(body_size).unwrap_or_default();
                    if let Some(edited) = resource_uri::rewrite(&body, &own, &visible) {
                        host.set_response_body(body_size, &edited);
                    }
                }
                Action::Continue
            }
            Watch::Replace(_) => {
                if !end_of_stream {
                    return Action::Pause;
                }
                if let Watch::Replace(reply) = std::mem::replace(&mut self.watch, Watch::None) {
                    host.set_response_body(body_size, &reply.body);
                }
                Action::Continue
            }
            Watch::Hold => {
                if !end_of_stream {
                    if body_size > HOLD_LIMIT {
                        // Too large to hold: let it stream, judged from a copy.
                        let seen = host.response_body(body_size).unwrap_or_default();
                        self.watch = Watch::Json(seen);
                        return Action::Continue;
                    }
                    return Action::Pause;
                }
                self.watch = Watch::None;
                let body = host.response_body(body_size).unwrap_or_default();
                let Some(judged) = &self.request else {
                    return Action::Continue;
                };
                let class = classify_response(&body, &judged.id);
                if let Some(what) = self.classified(host, class) {
                    let reply = self.failure_reply(what, self.framing);
                    host.set_response_header(":status", Some("200"));
                    host.set_response_header("content-type", Some(reply.content_type));
                    host.set_response_header("content-length", Some(&reply.body.len().to_string()));
                    host.set_response_body(body_size, &reply.body);
                }
                Action::Continue
            }
            Watch::Json(_) => {
                // Passed through as it streams; only this call's copy is kept.
                let chunk = host.response_body(body_size).unwrap_or_default();
                let Watch::Json(seen) = &mut self.watch else {
                    return Action::Continue;
                };
                if seen.len() + chunk.len() > MAX_JSON_RESPONSE {
                    self.watch = Watch::None;
                    self.record(host, Outcome::Ignored, Some(Kind::Ok));
                    return Action::Continue;
                }
                seen.extend_from_slice(&chunk);
                if !end_of_stream {
                    return Action::Continue;
                }
                let body = std::mem::take(seen);
                self.watch = Watch::None;
                if let Some(judged) = &self.request {
                    let class = classify_response(&body, &judged.id);
                    // Too late to replace what already streamed; the failure still counts.
                    let _ = self.classified(host, class);
                }
                Action::Continue
            }
            Watch::Questions(scanner) => {
                let chunk = host.response_body(body_size).unwrap_or_default();
                let answered = scanner.feed(&chunk).is_some();
                let asked = scanner.take_requests();
                if answered || end_of_stream {
                    self.watch = Watch::None;
                }
                self.note_questions(host, asked);
                Action::Continue
            }
            Watch::Sse(scanner) => {
                // Streamed through: only the chunk at hand is read, never the whole stream.
                let chunk = host.response_body(body_size).unwrap_or_default();
                let found = match scanner.feed(&chunk) {
                    Some(class) => Some(class),
                    None if end_of_stream => scanner.finish(),
                    None => None,
                };
                let asked = scanner.take_requests();
                self.note_questions(host, asked);
                let Some(class) = found else {
                    return Action::Continue;
                };
                self.watch = Watch::None;
                let ended_early = end_of_stream && class == ResponseClass::Other;
                let what = if ended_early {
                    self.record(host, Outcome::Failure, Some(Kind::Reset));
                    Some(UpstreamFailure::NoResponse)
                } else {
                    self.classified(host, class)
                };
                if let Some(what) = what {
                    // The stream is the agent's: the reply goes at its end as one more event.
                    // A blank line and an event of a type MCP clients ignore first close
                    // whatever half-sent event the stream ended in.
                    let reply = self.failure_reply(what, Framing::Sse);
                    let mut body = chunk;
                    body.extend_from_slice(b"\nevent: toolgate-discarded\n\n");
                    body.extend_from_slice(&reply.body);
                    if end_of_stream {
                        host.set_response_body(body_size, &body);
                    }
                }
                Action::Continue
            }
        }
    }

    /// A 400 the server answered a call on a held or sealed session: "session unknown" when its
    /// body says -32000 (the TypeScript SDK's servers), else the request's own fault.
    fn check_lost_session(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let small = body_size <= toolgate_model::session_loss::MAX_ERROR_BODY;
        if !end_of_stream && small {
            return Action::Pause;
        }
        let unsessioned = self.held.as_ref().is_some_and(|h| h.unsessioned);
        let code = (end_of_stream && small)
            .then(|| {
                let body = host.response_body(body_size).unwrap_or_default();
                toolgate_model::session_loss::rpc_error_code(&body)
            })
            .flatten();
        let unknown =
            end_of_stream && small && toolgate_model::session_loss::session_unknown(400, code);
        // Sent without a session, a 400 that is not JSON-RPC is the server asking for one (rmcp
        // says "Session ID is required" in plain text): refused in MCP, never passed as text.
        if unsessioned && (unknown || code.is_none()) {
            return self.unsessioned_refused(host);
        }
        if unknown {
            if let Some(action) = self.ask_replay(host) {
                return action;
            }
        }
        if let Some(h) = self.held.as_mut() {
            h.phase = HeldPhase::Sent;
        }
        // The request was at fault (a header the server refused), as any 4xx.
        self.record(host, Outcome::Ignored, Some(Kind::Ok));
        Action::Continue
    }

    /// The stream ended. An admitted call whose outcome is still open ended without its
    /// response: the upstream went away mid-answer, or the client did. Only the first is the
    /// tool's fault.
    pub fn on_log(&mut self, host: &impl CallHost) {
        if self.admitted.is_none() {
            return;
        }
        let details = self.code_details(host);
        if upstream_ended(&details) {
            self.read_endpoint(host);
            self.record(host, Outcome::Failure, Some(Kind::Reset));
        } else {
            // The client cancelled, reset or broke the stream: no evidence about the tool, nor
            // about the instance.
            self.record(host, Outcome::Ignored, None);
        }
    }

    fn code_details(&self, host: &impl CallHost) -> String {
        host.property(&["response", "code_details"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// What the answer of a routed `resources/read` or `prompts/get` says of its instance.
    fn surface_outcome(&mut self, host: &impl CallHost, kind: Option<Kind>) {
        let (Some(kind), Some(service)) = (kind, &self.service) else {
            return;
        };
        let Some(address) = host
            .property(&["upstream", "address"])
            .and_then(|b| String::from_utf8(b).ok())
            .filter(|a| !a.is_empty())
        else {
            return;
        };
        self.shared
            .borrow()
            .feedback
            .borrow_mut()
            .record(service, &address, kind);
    }

    /// Reads the upstream address of the admitted call, if not read yet.
    fn read_endpoint(&mut self, host: &impl CallHost) {
        let Some(a) = &mut self.admitted else { return };
        if !matches!(a.endpoint, Endpoint::Unread) {
            return;
        }
        a.endpoint = match host.property(&["upstream", "address"]) {
            Some(bytes) if !bytes.is_empty() => match String::from_utf8(bytes) {
                Ok(address) => Endpoint::Known(address),
                Err(_) => Endpoint::Unknown,
            },
            _ => Endpoint::Unknown,
        };
    }

    /// Whether this call's client cancelled it (`notifications/cancelled` on its session).
    fn cancelled_by_client(&self, now_ms: u64) -> bool {
        let (Some(session), Some(judged)) = (&self.client_session, &self.request) else {
            return false;
        };
        let shared = self.shared.borrow();
        cancel::cancelled(shared.breakers.store(), session, &judged.id, now_ms)
    }

    /// Records the outcome of the admitted call, once; `report` is what the call feedback
    /// says about its upstream instance, if anything.
    fn record(&mut self, host: &impl CallHost, outcome: Outcome, report: Option<Kind>) {
        let Some(a) = self.admitted.take() else {
            return;
        };
        let now = host.now_ms();
        // Whatever a call the client cancelled ended in is the client's doing.
        let against = matches!(
            outcome,
            Outcome::Failure | Outcome::Slow | Outcome::IsErrorResult
        );
        let (outcome, report) = if against && self.cancelled_by_client(now) {
            (Outcome::Ignored, None)
        } else {
            (outcome, report)
        };
        let transition = {
            let mut shared = self.shared.borrow_mut();
            if let (Some(kind), Endpoint::Known(address), Some(service)) =
                (report, &a.endpoint, &self.service)
            {
                shared.feedback.borrow_mut().record(service, address, kind);
            }
            if a.learning {
                // The server knew the name: an answer (a result, or an error that does not
                // blame the request) from a server that was reached.
                let known = outcome != Outcome::Ignored && report == Some(Kind::Ok);
                if let (true, Some(service)) = (known, &self.service) {
                    let Shared {
                        unlisted, breakers, ..
                    } = &mut *shared;
                    unlisted.learn(breakers.store(), service, &a.tool, now);
                }
                return;
            }
            if let Some(ids) = &a.metrics {
                shared.stats.outcome(ids, outcome, a.policy.count_is_error);
            }
            let t = shared
                .breakers
                .record(&a.key, &a.policy, now, a.admission, outcome);
            if let Some(t) = &t {
                shared.stats.transition(&a.key, t.to, t.at_ms);
            }
            t
        };
        if let Some(t) = transition {
            host.log(Level::Warn, &transition_line(&a.key, &t));
            if let Some(event) = self
                .service
                .as_deref()
                .and_then(|service| fleet::event_of(service, &a.tool, &t))
            {
                self.events.push(event);
            }
        }
    }

    /// Success or slow, by how long the call took; `is_error` is the tool's own `isError`.
    fn answered(&mut self, host: &impl CallHost, is_error: bool) {
        let Some(a) = &self.admitted else { return };
        let outcome = if is_error {
            Outcome::IsErrorResult
        } else if host.now_ms().saturating_sub(a.started_ms) >= a.policy.slow_call_ms {
            Outcome::Slow
        } else {
            Outcome::Success
        };
        self.record(host, outcome, Some(Kind::Ok));
    }

    /// Records what a response says; returns the failure to answer in its place, if it is
    /// not the response the agent needs.
    fn classified(
        &mut self,
        host: &impl CallHost,
        class: ResponseClass,
    ) -> Option<UpstreamFailure> {
        match class {
            ResponseClass::Result { is_error } => {
                self.answered(host, is_error);
                None
            }
            ResponseClass::Error { code } if is_client_fault(code) => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
            // The tool's own failure; the server answered, so the instance is fine.
            ResponseClass::Error { .. } => {
                self.record(host, Outcome::Failure, Some(Kind::Ok));
                None
            }
            ResponseClass::TooLarge => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
            // Not the response to this request: the agent would wait for it in vain.
            ResponseClass::Other | ResponseClass::Unparseable => {
                self.record(host, Outcome::Failure, Some(Kind::Ok));
                Some(UpstreamFailure::BadResponse)
            }
        }
    }

    /// Records an upstream failure of the admitted call and returns the reply for it.
    fn upstream_failed(&mut self, host: &impl CallHost, what: UpstreamFailure) -> Reply {
        self.record(host, Outcome::Failure, Kind::of_failure(what));
        self.failure_reply(what, self.framing)
    }

    /// The service's bulkhead refused the call: not the tool's fault.
    fn overloaded(&mut self, host: &impl CallHost) -> Reply {
        self.record(host, Outcome::Ignored, None);
        self.tool_reply(UnavailableKind::Overloaded, self.framing)
    }

    /// [`failure_reply`](Self::failure_reply) for an upstream reset, in JSON: the reply Envoy
    /// sends should the upstream cut off an answer the filter holds.
    fn cut_reply(&self) -> Vec<u8> {
        let write = || self.failure_reply(UpstreamFailure::Reset, Framing::Json);
        let Some(judged) = &self.request else {
            return write().body;
        };
        let (tool, fallback) = judged.tool.clone().unzip();
        let key = (tool.unwrap_or_default(), fallback.flatten(), self.version);
        self.shared
            .borrow_mut()
            .cut_replies
            .reply(key, &judged.id, write)
    }

    fn failure_reply(&self, what: UpstreamFailure, framing: Framing) -> Reply {
        self.tool_reply(UnavailableKind::UpstreamFailure { what }, framing)
    }

    /// The semantic reply for the admitted call of this request.
    fn tool_reply(&self, kind: UnavailableKind<'_>, framing: Framing) -> Reply {
        let Some(judged) = &self.request else {
            // Only admitted calls (which have a judged request) get here.
            return reply::refused(self.version, None, Refusal::NotAMessage, framing);
        };
        let (tool, fallback) = match &judged.tool {
            Some((tool, fallback)) => (Some(tool.as_str()), fallback.as_deref()),
            None => (None, None),
        };
        let details = Unavailable {
            kind,
            tool,
            retry_after_secs: None,
            fallback_tool: fallback,
        };
        reply::tool_unavailable(self.version, &judged.id, &details, framing)
    }
}
