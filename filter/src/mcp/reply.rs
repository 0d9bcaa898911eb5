//! MCP replies the gateway sends in the server's place.
//!
//! When a breaker is open or the upstream failed, the agent gets a message its MCP client
//! accepts, for the protocol version it speaks and with its request's own id: for `tools/call` a
//! `CallToolResult` with `isError: true` whose text tells the model what happened and what to do
//! next, otherwise a JSON-RPC error. Machine-readable details sit under `io.toolgate/breaker`.
//!
//! The inputs are closed enums, validated names and numbers: no upstream text (addresses,
//! cluster names, response bodies) can reach a reply. The one free-form string, an operator's
//! reason for forcing a breaker open, is cleaned and cut to a bounded length.
//!
//! Retry advice is only given where it is true: a wait is named only when the gateway itself
//! refuses the tool until then (an open breaker), and an upstream failure says whether the
//! call may have taken effect rather than inventing a wait nothing enforces.
//!
//! Messages are written with serde_json; the id is a `RawValue`, echoed byte for byte.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::value::RawValue;

use super::headers::Mismatch;
use super::jsonrpc::RawId;
use super::request::{Refusal, INVALID_PARAMS, INVALID_REQUEST};
use super::response::HEADER_MISMATCH;

/// JSON-RPC "Internal error": the receiver cannot fulfil a valid request. The gateway uses it
/// for an unavailable server on methods other than `tools/call`; -32000..-32019 are legacy and
/// -32020..-32099 are reserved for codes the MCP specification defines (2026-07-28 basic,
/// "Error Codes"), so no code of its own is minted there.
pub const INTERNAL_ERROR: i64 = -32603;

/// Key of the gateway's details in `_meta` and in an error's `data` (a `_meta` key prefix must
/// be a reverse-DNS label the gateway owns; `io.modelcontextprotocol/` is reserved).
pub const META_KEY: &str = "io.toolgate/breaker";

/// Longest operator reason copied into a reply, in bytes.
pub const MAX_REASON_BYTES: usize = 512;

/// MCP protocol revisions the filter writes replies for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProtocolVersion {
    V2025_03_26,
    V2025_06_18,
    V2025_11_25,
    V2026_07_28,
}

impl ProtocolVersion {
    pub const ALL: [ProtocolVersion; 4] = [
        ProtocolVersion::V2025_03_26,
        ProtocolVersion::V2025_06_18,
        ProtocolVersion::V2025_11_25,
        ProtocolVersion::V2026_07_28,
    ];

    /// The revision named exactly by `value`, if the filter knows it.
    pub fn parse(value: &str) -> Option<ProtocolVersion> {
        Some(match value {
            "2025-03-26" => ProtocolVersion::V2025_03_26,
            "2025-06-18" => ProtocolVersion::V2025_06_18,
            "2025-11-25" => ProtocolVersion::V2025_11_25,
            "2026-07-28" => ProtocolVersion::V2026_07_28,
            _ => return None,
        })
    }

    /// The revision to answer a request in, from its `MCP-Protocol-Version` header.
    ///
    /// Absent: 2025-03-26, as the transport specification tells servers to assume (that
    /// revision had no such header). Unknown: 2025-11-25, the last revision before results
    /// carry `resultType`; 2026-07-28 clients read a result without it as `complete`, so this
    /// shape is understood by every client.
    pub fn from_header(value: Option<&str>) -> ProtocolVersion {
        match value {
            None => ProtocolVersion::V2025_03_26,
            Some(v) => ProtocolVersion::parse(v.trim()).unwrap_or(ProtocolVersion::V2025_11_25),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProtocolVersion::V2025_03_26 => "2025-03-26",
            ProtocolVersion::V2025_06_18 => "2025-06-18",
            ProtocolVersion::V2025_11_25 => "2025-11-25",
            ProtocolVersion::V2026_07_28 => "2026-07-28",
        }
    }

    /// Whether requests carry `Mcp-Method` / `Mcp-Name` that must match the body.
    pub fn has_request_headers(self) -> bool {
        self >= ProtocolVersion::V2026_07_28
    }

    /// Results carry `resultType` (required from 2026-07-28).
    pub(crate) fn has_result_type(self) -> bool {
        self >= ProtocolVersion::V2026_07_28
    }

    /// An error response may omit its id when it is unknown (2025-11-25 on); earlier schemas
    /// require one, and JSON-RPC's `null` is then the only honest value.
    fn may_omit_error_id(self) -> bool {
        self >= ProtocolVersion::V2025_11_25
    }
}

/// How the reply body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    Json,
    /// One `message` event, for clients that accept only `text/event-stream`.
    Sse,
}

impl Framing {
    /// SSE only when `Accept` lists `text/event-stream` and nothing that covers
    /// `application/json` (`application/json`, `application/*`, `*/*`); JSON otherwise,
    /// including without an `Accept` header. A media range with `q=0` is not accepted.
    pub fn from_accept(accept: Option<&str>) -> Framing {
        let Some(accept) = accept else {
            return Framing::Json;
        };
        let (mut json, mut sse) = (false, false);
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim();
            if parts.any(is_q_zero) {
                continue;
            }
            if media.eq_ignore_ascii_case("application/json")
                || media.eq_ignore_ascii_case("application/*")
                || media == "*/*"
            {
                json = true;
            } else if media.eq_ignore_ascii_case("text/event-stream") {
                sse = true;
            }
        }
        if sse && !json {
            Framing::Sse
        } else {
            Framing::Json
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Framing::Json => "application/json",
            Framing::Sse => "text/event-stream",
        }
    }
}

fn is_q_zero(param: &str) -> bool {
    let Some((name, value)) = param.split_once('=') else {
        return false;
    };
    name.trim().eq_ignore_ascii_case("q")
        && value
            .trim()
            .parse::<f32>()
            .map(|q| q == 0.0)
            .unwrap_or(false)
}

/// A reply ready to send: the body and its `Content-Type`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub body: Vec<u8>,
    pub content_type: &'static str,
}

/// Why a call is not passed to the server, and what the agent should do instead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unavailable<'a> {
    pub kind: UnavailableKind<'a>,
    /// The tool called; `None` for methods other than `tools/call`.
    pub tool: Option<&'a str>,
    /// How long the gateway itself refuses the tool. `None` when nothing is enforced (an
    /// operator's override lasts until lifted; an upstream failure stops nobody retrying):
    /// an automatic retrier reads `0` as "retry now".
    pub retry_after_secs: Option<u64>,
    /// A tool the policy names to use instead.
    pub fallback_tool: Option<&'a str>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnavailableKind<'a> {
    /// The breaker is open; `cause` says which threshold tripped it.
    Open { cause: OpenCause },
    /// The breaker is half-open and its trial calls are all in flight.
    Probing,
    /// An operator forced the breaker open; `reason` is theirs and is shown to the model.
    ForcedOpen { reason: &'a str },
    /// This call's upstream failed.
    UpstreamFailure { what: UpstreamFailure },
    /// The service's connection pool is full (its bulkhead): too many calls in flight.
    Overloaded,
    /// The gateway has no configuration it accepted: it cannot judge the call, so it does not
    /// make it.
    Unconfigured,
    /// The aggregate endpoint `endpoint` (`/mcp`, `/virtual/<name>`) offers no tool of this
    /// name (unknown, or excluded by its selection). A tool result rather than a protocol
    /// error, as the reference servers answer an unknown tool: the model reads it and lists
    /// the tools again, where a client library would raise.
    NotOffered { endpoint: &'a str },
}

/// Why a breaker opened, with the figures that tripped it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenCause {
    FailureRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
    },
    SlowCallRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
        slow_call_ms: u64,
    },
    /// A half-open trial call failed.
    ProbeFailed,
    /// A half-open trial call was slow.
    ProbeSlow,
    /// Another gateway of the fleet opened it.
    Fleet,
    /// A record that does not say (written by an older filter).
    Unknown,
}

/// How the upstream failed, as Envoy reports it; deliberately without any text from Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamFailure {
    ConnectFailure,
    Reset,
    Timeout,
    Http5xx(u16),
    NoHealthyUpstream,
    /// The server answered with something that is not the response to this request.
    BadResponse,
    /// The server's stream ended before it sent the response.
    NoResponse,
    /// The server refused to open a session for the call (this HTTP status; 503: it holds as
    /// many as it allows).
    SessionRefused(u16),
    /// The gateway holds as many sessions with the service as it allows, `limit` for this
    /// caller (`per_caller`) or for all its callers, none idle long enough to end.
    SessionLimit {
        limit: u32,
        per_caller: bool,
    },
    /// The server needs a session, and none could be opened: no toolgate-xds of the fleet is
    /// reachable.
    NoControlPlane,
}

impl UpstreamFailure {
    fn code(self) -> &'static str {
        match self {
            UpstreamFailure::ConnectFailure => "connect_failure",
            UpstreamFailure::Reset => "reset",
            UpstreamFailure::Timeout => "timeout",
            UpstreamFailure::Http5xx(_) => "http_5xx",
            UpstreamFailure::NoHealthyUpstream => "no_healthy_upstream",
            UpstreamFailure::BadResponse => "bad_response",
            UpstreamFailure::NoResponse => "no_response",
            UpstreamFailure::SessionRefused(_) => "session_refused",
            UpstreamFailure::SessionLimit { .. } => "session_limit",
            UpstreamFailure::NoControlPlane => "no_control_plane",
        }
    }

    /// What happened, as the clause after "The call …".
    fn clause(self) -> Cow<'static, str> {
        match self {
            UpstreamFailure::ConnectFailure => "could not reach a server".into(),
            UpstreamFailure::Reset => {
                "was cut off: the connection to the server was reset before it answered".into()
            }
            UpstreamFailure::Timeout => "got no answer from the server in time".into(),
            UpstreamFailure::Http5xx(status) => {
                format!("failed on the server (HTTP status {status})").into()
            }
            UpstreamFailure::NoHealthyUpstream => {
                "was not made: no healthy server is available right now".into()
            }
            UpstreamFailure::BadResponse => {
                "got an answer from the server that is not a valid response".into()
            }
            UpstreamFailure::NoResponse => {
                "was cut off: the server ended its answer before the response".into()
            }
            UpstreamFailure::SessionRefused(status) => format!(
                "was not made: the server refused to open a session for it (HTTP status {status})"
            )
            .into(),
            UpstreamFailure::SessionLimit { limit, per_caller } => format!(
                "was not made: the gateway holds at most {limit} {} with this service {}, and \
                 none has been idle long enough to end",
                plural(u64::from(limit), "session", "sessions"),
                if per_caller {
                    "for this caller"
                } else {
                    "for all its callers"
                }
            )
            .into(),
            UpstreamFailure::NoControlPlane => {
                "was not made: its server needs a session, and the gateway cannot open one \
                 while its control plane is unreachable"
                    .into()
            }
        }
    }

    /// Whether the call may have run on the server: it matters to a model about to repeat a
    /// call that changes something.
    fn may_have_run(self) -> bool {
        !matches!(
            self,
            UpstreamFailure::ConnectFailure
                | UpstreamFailure::NoHealthyUpstream
                | UpstreamFailure::SessionRefused(_)
                | UpstreamFailure::SessionLimit { .. }
                | UpstreamFailure::NoControlPlane
        )
    }
}

impl OpenCause {
    fn code(self) -> Option<&'static str> {
        Some(match self {
            OpenCause::FailureRate { .. } => "failure_rate",
            OpenCause::SlowCallRate { .. } => "slow_call_rate",
            OpenCause::ProbeFailed => "probe_failed",
            OpenCause::ProbeSlow => "probe_slow",
            OpenCause::Fleet => "fleet",
            OpenCause::Unknown => return None,
        })
    }

    fn describe(self) -> Cow<'static, str> {
        match self {
            OpenCause::FailureRate {
                percent,
                calls,
                window_secs,
            } => format!(
                "{percent}% of its {calls} calls in the last {window_secs} {} failed",
                plural(window_secs, "second", "seconds")
            )
            .into(),
            OpenCause::SlowCallRate {
                percent,
                calls,
                window_secs,
                slow_call_ms,
            } => format!(
                "{percent}% of its {calls} calls in the last {window_secs} {} took {} or longer",
                plural(window_secs, "second", "seconds"),
                duration_words(slow_call_ms)
            )
            .into(),
            OpenCause::ProbeFailed => "a trial call after an earlier outage failed".into(),
            OpenCause::ProbeSlow => "a trial call after an earlier outage was too slow".into(),
            OpenCause::Fleet => "another gateway of this fleet found it failing".into(),
            OpenCause::Unknown => "its recent calls failed".into(),
        }
    }
}

/// Why a gateway without an accepted configuration refuses everything.
pub const UNCONFIGURED: &str = "the gateway has no valid configuration";

fn plural(n: u64, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 {
        one
    } else {
        many
    }
}

fn duration_words(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        let s = ms / 1000;
        format!("{s} {}", plural(s, "second", "seconds"))
    } else {
        format!("{ms} ms")
    }
}

/// The operator's reason as it may appear in a sentence: bounded, on one line, without a final
/// period (the sentence adds its own).
fn clean_reason(reason: &str) -> Cow<'_, str> {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let cut = &reason[..end];
    let trimmed = cut.trim().trim_end_matches('.').trim_end();
    if trimmed.chars().any(char::is_control) {
        Cow::Owned(
            trimmed
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(trimmed)
    }
}

impl UnavailableKind<'_> {
    fn state(&self) -> &'static str {
        match self {
            UnavailableKind::Open { .. } => "open",
            UnavailableKind::Probing => "half_open",
            UnavailableKind::ForcedOpen { .. } => "forced_open",
            UnavailableKind::UpstreamFailure { .. } => "upstream_failure",
            UnavailableKind::Overloaded => "overloaded",
            UnavailableKind::Unconfigured => "unconfigured",
            UnavailableKind::NotOffered { .. } => "not_offered",
        }
    }

    /// The cause without a subject, for `_meta.reason`.
    fn reason(&self) -> Cow<'_, str> {
        match self {
            UnavailableKind::Open { cause } => cause.describe(),
            UnavailableKind::Probing => "trial calls after an outage are in flight".into(),
            UnavailableKind::ForcedOpen { reason } => clean_reason(reason),
            UnavailableKind::UpstreamFailure { what } => what.clause(),
            UnavailableKind::Overloaded => "too many calls to its server are in flight".into(),
            UnavailableKind::Unconfigured => UNCONFIGURED.into(),
            UnavailableKind::NotOffered { .. } => {
                "this endpoint offers no tool of this name".into()
            }
        }
    }
}

impl Unavailable<'_> {
    /// The content text the model reads: what happened, whether waiting helps, what to do
    /// instead.
    pub fn text(&self) -> String {
        let mut text = String::with_capacity(200);
        let subject = match self.tool {
            Some(tool) => format!("The tool `{tool}`"),
            None => "The server".to_string(),
        };
        match self.kind {
            UnavailableKind::Open { cause } => {
                let _ = write!(
                    text,
                    "{subject} is temporarily unavailable: {}.",
                    cause.describe()
                );
            }
            UnavailableKind::Probing => {
                let _ = write!(
                    text,
                    "{subject} is being tested after an outage and takes no other calls now."
                );
            }
            UnavailableKind::ForcedOpen { reason } => {
                let reason = clean_reason(reason);
                if reason.is_empty() {
                    let _ = write!(text, "{subject} is disabled by an operator.");
                } else {
                    let _ = write!(text, "{subject} is disabled by an operator: {reason}.");
                }
                text.push_str(" It stays disabled until the operator lifts this.");
            }
            UnavailableKind::UpstreamFailure { what } => {
                let call = match self.tool {
                    Some(tool) => format!("The call to the tool `{tool}`"),
                    None => "The request".to_string(),
                };
                let _ = write!(text, "{call} {}.", what.clause());
                if what.may_have_run() {
                    text.push_str(
                        " It may or may not have taken effect: check before repeating a call \
                         that changes something.",
                    );
                }
                match what {
                    UpstreamFailure::NoHealthyUpstream => {
                        text.push_str(" Another try may succeed once a server is back.")
                    }
                    UpstreamFailure::SessionRefused(_) | UpstreamFailure::SessionLimit { .. } => {
                        text.push_str(" Another try may succeed once a session is free.")
                    }
                    _ => text.push_str(" Another try may reach a healthy server."),
                }
            }
            UnavailableKind::Overloaded => {
                let _ = write!(
                    text,
                    "{subject} is busy: too many calls to its server are in flight. The call \
                     was not made; another try may succeed shortly."
                );
            }
            UnavailableKind::Unconfigured => {
                let _ = write!(
                    text,
                    "{subject} cannot be called: {UNCONFIGURED}, so it judges no call and \
                     makes none. An operator must look at the gateway."
                );
            }
            UnavailableKind::NotOffered { endpoint } => {
                text.push_str(&tool_not_offered_message(
                    endpoint,
                    self.tool.unwrap_or_default(),
                ));
            }
        }
        if let Some(n) = self.retry_after_secs {
            let _ = write!(
                text,
                " The gateway refuses it for the next {n} {}: do not retry it before then.",
                plural(n, "second", "seconds")
            );
        }
        match self.fallback_tool {
            Some(fallback) => {
                let _ = write!(text, " Use the tool `{fallback}` instead.");
            }
            None => text.push_str(" Continue without it or try a different approach."),
        }
        text
    }
}

/// `{"io.toolgate/breaker":{…}}`: the object used as `_meta` and as an error's `data`.
struct Meta<'r, 'a>(&'r Unavailable<'a>);

impl Serialize for Meta<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut outer = s.serialize_map(Some(1))?;
        outer.serialize_entry(META_KEY, &Details(self.0))?;
        outer.end()
    }
}

struct Details<'r, 'a>(&'r Unavailable<'a>);

impl Serialize for Details<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let u = self.0;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("state", u.kind.state())?;
        m.serialize_entry("tool", &u.tool)?;
        if let Some(secs) = u.retry_after_secs {
            m.serialize_entry("retryAfterSeconds", &secs)?;
        }
        m.serialize_entry("fallbackTool", &u.fallback_tool)?;
        m.serialize_entry("reason", &u.kind.reason())?;
        match u.kind {
            UnavailableKind::Open { cause } => {
                if let Some(code) = cause.code() {
                    m.serialize_entry("trippedBy", code)?;
                }
                match cause {
                    OpenCause::FailureRate {
                        percent,
                        calls,
                        window_secs,
                    } => {
                        m.serialize_entry("failureRatePercent", &percent)?;
                        m.serialize_entry("calls", &calls)?;
                        m.serialize_entry("windowSeconds", &window_secs)?;
                    }
                    OpenCause::SlowCallRate {
                        percent,
                        calls,
                        window_secs,
                        slow_call_ms,
                    } => {
                        m.serialize_entry("slowCallRatePercent", &percent)?;
                        m.serialize_entry("calls", &calls)?;
                        m.serialize_entry("windowSeconds", &window_secs)?;
                        m.serialize_entry("slowCallMs", &slow_call_ms)?;
                    }
                    _ => {}
                }
            }
            UnavailableKind::UpstreamFailure { what } => {
                m.serialize_entry("failure", what.code())?;
                match what {
                    UpstreamFailure::Http5xx(status) | UpstreamFailure::SessionRefused(status) => {
                        m.serialize_entry("httpStatus", &status)?;
                    }
                    UpstreamFailure::SessionLimit { limit, .. } => {
                        m.serialize_entry("sessionLimit", &limit)?;
                    }
                    _ => {}
                }
                m.serialize_entry("mayHaveRun", &what.may_have_run())?;
            }
            _ => {}
        }
        m.end()
    }
}

/// The id member of an error: the request's, `null`, or absent.
enum ErrorId<'a> {
    Raw(&'a RawValue),
    Null,
    Omitted,
}

fn error_id<'a>(version: ProtocolVersion, id: Option<&'a RawId>) -> ErrorId<'a> {
    match id {
        Some(id) => ErrorId::Raw(id.as_raw()),
        None if version.may_omit_error_id() => ErrorId::Omitted,
        None => ErrorId::Null,
    }
}

#[derive(Serialize)]
struct ResultMessage<'a, R: Serialize> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    result: R,
}

#[derive(Serialize)]
struct ToolResult<'a, 'r, 'u> {
    content: [TextContent<'a>; 1],
    #[serde(rename = "isError")]
    is_error: bool,
    #[serde(rename = "resultType", skip_serializing_if = "Option::is_none")]
    result_type: Option<&'static str>,
    #[serde(rename = "_meta")]
    meta: Meta<'r, 'u>,
}

#[derive(Serialize)]
struct TextContent<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

struct ErrorMessage<'a, D: Serialize> {
    id: ErrorId<'a>,
    code: i64,
    message: &'a str,
    data: Option<D>,
}

impl<D: Serialize> Serialize for ErrorMessage<'_, D> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("jsonrpc", "2.0")?;
        match self.id {
            ErrorId::Raw(id) => m.serialize_entry("id", id)?,
            ErrorId::Null => m.serialize_entry("id", &())?,
            ErrorId::Omitted => {}
        }
        m.serialize_entry(
            "error",
            &ErrorObject {
                code: self.code,
                message: self.message,
                data: self.data.as_ref(),
            },
        )?;
        m.end()
    }
}

#[derive(Serialize)]
struct ErrorObject<'a, D: Serialize> {
    code: i64,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a D>,
}

/// The SSE event a server would send: `event: message` and the JSON on one `data` line (the
/// JSON written here never contains a raw line break: serde_json escapes them in strings).
const SSE_PREFIX: &[u8] = b"event: message\ndata: ";
const SSE_SUFFIX: &[u8] = b"\n\n";

/// Serializes one JSON-RPC message (or a batch of them) in the client's framing.
fn framed(message: &impl Serialize, framing: Framing, capacity: usize) -> Reply {
    let mut body = Vec::with_capacity(capacity + SSE_PREFIX.len() + SSE_SUFFIX.len());
    if framing == Framing::Sse {
        body.extend_from_slice(SSE_PREFIX);
    }
    // Serializing these types cannot fail: no maps with non-string keys, no I/O errors from
    // a Vec. Should it ever, the reply is an empty JSON object rather than a panic.
    if serde_json::to_writer(&mut body, message).is_err() {
        body.truncate(if framing == Framing::Sse {
            SSE_PREFIX.len()
        } else {
            0
        });
        body.extend_from_slice(b"{}");
    }
    if framing == Framing::Sse {
        body.extend_from_slice(SSE_SUFFIX);
    }
    Reply {
        body,
        content_type: framing.content_type(),
    }
}

/// What every JSON reply of the filter starts with, up to its request's id.
const BEFORE_ID: &[u8] = br#"{"jsonrpc":"2.0","id":"#;
/// Templates kept per worker, at most: past it, the oldest are dropped all at once.
const MAX_TEMPLATES: usize = 1024;

/// JSON replies that differ only in their request's id, each kept as the text after the id:
/// a reply a call may need is written once per (key) and spliced around each call's id,
/// instead of serialized for every call (issue 21: the reply for an upstream cut off while
/// the filter holds its answer is set on every call whose answer is held).
pub struct ById<K> {
    after_id: std::collections::HashMap<K, Vec<u8>>,
}

impl<K> Default for ById<K> {
    fn default() -> Self {
        ById {
            after_id: std::collections::HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq> ById<K> {
    /// The reply `build` writes for `id`, from the template of `key` once there is one.
    /// `build` must give the same reply for every id but the id itself, in JSON framing.
    pub fn reply(&mut self, key: K, id: &RawId, build: impl FnOnce() -> Reply) -> Vec<u8> {
        let id_text = id.as_raw().get().as_bytes();
        if let Some(after) = self.after_id.get(&key) {
            let mut body = Vec::with_capacity(BEFORE_ID.len() + id_text.len() + after.len());
            body.extend_from_slice(BEFORE_ID);
            body.extend_from_slice(id_text);
            body.extend_from_slice(after);
            return body;
        }
        let reply = build();
        // Kept only when the reply has the shape spliced: the id right after "jsonrpc".
        if let Some(after) = reply
            .body
            .strip_prefix(BEFORE_ID)
            .and_then(|rest| rest.strip_prefix(id_text))
        {
            if self.after_id.len() >= MAX_TEMPLATES {
                self.after_id.clear();
            }
            self.after_id.insert(key, after.to_vec());
        }
        reply.body
    }
}

/// The `CallToolResult` for a `tools/call` that is not passed on: `isError: true`, so the model
/// sees the failure and can change course, rather than its client raising a protocol error.
pub fn tool_unavailable(
    version: ProtocolVersion,
    id: &RawId,
    details: &Unavailable<'_>,
    framing: Framing,
) -> Reply {
    let text = details.text();
    let message = ResultMessage {
        jsonrpc: "2.0",
        id: id.as_raw(),
        result: ToolResult {
            content: [TextContent {
                kind: "text",
                text: &text,
            }],
            is_error: true,
            result_type: version.has_result_type().then_some("complete"),
            meta: Meta(details),
        },
    };
    framed(&message, framing, text.len() + 400)
}

/// A JSON-RPC error for request `id` (or an unknown id), in the client's framing. `message`
/// must be the gateway's own words.
pub fn error(
    version: ProtocolVersion,
    id: Option<&RawId>,
    code: i64,
    message: &str,
    data: Option<impl Serialize>,
    framing: Framing,
) -> Reply {
    let message_json = ErrorMessage {
        id: error_id(version, id),
        code,
        message,
        data,
    };
    framed(&message_json, framing, message.len() + 200)
}

/// A JSON-RPC result with the request's id, in the client's framing.
pub fn result(id: &RawId, result: &impl Serialize, framing: Framing) -> Reply {
    framed(
        &ResultMessage {
            jsonrpc: "2.0",
            id: id.as_raw(),
            result,
        },
        framing,
        512,
    )
}

/// The error for a method other than `tools/call` when no server could take it (16.10): says
/// which service and that no server is available, with the details in `data`.
pub fn service_unavailable(
    version: ProtocolVersion,
    id: &RawId,
    service: &str,
    what: UpstreamFailure,
    framing: Framing,
) -> Reply {
    let details = Unavailable {
        kind: UnavailableKind::UpstreamFailure { what },
        tool: None,
        retry_after_secs: None,
        fallback_tool: None,
    };
    let message = match what {
        UpstreamFailure::NoHealthyUpstream | UpstreamFailure::ConnectFailure => format!(
            "No server of the MCP service `{service}` is available right now; try again in a \
             few seconds."
        ),
        UpstreamFailure::Timeout => format!(
            "The MCP service `{service}` did not answer in time; try again in a few seconds."
        ),
        UpstreamFailure::SessionRefused(status) => format!(
            "The MCP service `{service}` refused to open a session (HTTP status {status}); try \
             again later."
        ),
        UpstreamFailure::SessionLimit { limit, per_caller } => format!(
            "The gateway holds at most {limit} sessions with the MCP service `{service}` {}, and \
             none has been idle long enough to end; try again later.",
            if per_caller {
                "for this caller"
            } else {
                "for all its callers"
            }
        ),
        _ => format!(
            "The MCP service `{service}` failed to answer this request; try again in a few \
             seconds."
        ),
    };
    error(
        version,
        Some(id),
        INTERNAL_ERROR,
        &message,
        Some(Meta(&details)),
        framing,
    )
}

/// The answer to a GET stream that could not be opened: no request id exists, so the error
/// has none (`null` before 2025-11-25); always JSON, since the client is not told an event
/// stream opened.
pub fn stream_unavailable(version: ProtocolVersion, service: &str, what: UpstreamFailure) -> Reply {
    let details = Unavailable {
        kind: UnavailableKind::UpstreamFailure { what },
        tool: None,
        retry_after_secs: None,
        fallback_tool: None,
    };
    let message = format!(
        "No server of the MCP service `{service}` is available for this stream right now; open \
         it again in a few seconds."
    );
    error(
        version,
        None,
        INTERNAL_ERROR,
        &message,
        Some(Meta(&details)),
        Framing::Json,
    )
}

/// The answer to a body the gateway cannot judge (see [`Refusal`]).
pub fn refused(
    version: ProtocolVersion,
    id: Option<&RawId>,
    refusal: Refusal,
    framing: Framing,
) -> Reply {
    let message = refusal.to_string();
    error(version, id, refusal.code(), &message, None::<()>, framing)
}

/// What an aggregate endpoint says of a tool it does not offer ([`UnavailableKind::NotOffered`]).
pub fn tool_not_offered_message(endpoint: &str, tool: &str) -> String {
    format!(
        "Unknown tool: this endpoint (`{endpoint}`) offers no tool `{tool}`. Call tools/list \
         for the tools it has."
    )
}

/// The answer to a `tools/call` on `/virtual/<name>` when no virtual server of that name is
/// configured. `name` follows the naming rule (checked on the path).
pub fn unknown_virtual_server(
    version: ProtocolVersion,
    id: &RawId,
    name: &str,
    framing: Framing,
) -> Reply {
    let message = format!(
        "Unknown endpoint: this gateway has no virtual server `{name}`, so it offers no tools \
         here. Use `/mcp` for every tool, or the name of a configured virtual server."
    );
    error(
        version,
        Some(id),
        INVALID_PARAMS,
        &message,
        None::<()>,
        framing,
    )
}

/// The message for a `tools/call` inside a batch on the aggregate endpoint: one request goes
/// to one service, so a call is routed only when it is sent alone.
pub const BATCHED_VIRTUAL_CALL: &str = "On this endpoint each tools/call must be sent alone, \
     not in a batch: the gateway routes every call to the service that owns its tool.";

/// `HeaderMismatch` (-32020) for a request whose headers disagree with its body.
pub fn header_mismatch(
    version: ProtocolVersion,
    id: Option<&RawId>,
    mismatch: Mismatch,
    framing: Framing,
) -> Reply {
    error(
        version,
        id,
        HEADER_MISMATCH,
        mismatch.describe(),
        None::<()>,
        framing,
    )
}

#[derive(Serialize)]
struct Limits {
    #[serde(rename = "io.toolgate/limits")]
    limits: LimitFields,
}

#[derive(Serialize)]
struct LimitFields {
    #[serde(rename = "maxBodyBytes", skip_serializing_if = "Option::is_none")]
    max_body_bytes: Option<u64>,
    #[serde(rename = "maxJsonDepth", skip_serializing_if = "Option::is_none")]
    max_json_depth: Option<u64>,
}

/// The error for a request body over the gateway's limit of `limit_bytes`. `id` is `None` when
/// the body was not read.
pub fn body_too_large(
    version: ProtocolVersion,
    id: Option<&RawId>,
    limit_bytes: u64,
    framing: Framing,
) -> Reply {
    let message = format!(
        "The request body is larger than this gateway accepts ({limit_bytes} bytes); send a smaller request."
    );
    let data = Limits {
        limits: LimitFields {
            max_body_bytes: Some(limit_bytes),
            max_json_depth: None,
        },
    };
    error(version, id, INVALID_REQUEST, &message, Some(data), framing)
}

/// The answer to a request body nested deeper than the gateway accepts (no id: such a body
/// is not parsed).
pub fn too_deep(version: ProtocolVersion, limit: u64, framing: Framing) -> Reply {
    let message = format!(
        "The request nests arrays and objects deeper than this gateway accepts ({limit} levels); send a flatter request."
    );
    let data = Limits {
        limits: LimitFields {
            max_body_bytes: None,
            max_json_depth: Some(limit),
        },
    };
    error(
        version,
        None,
        INVALID_REQUEST,
        &message,
        Some(data),
        framing,
    )
}

/// One element of a refused batch's answer.
pub enum BatchAnswer<'a> {
    /// The tool of this call is unavailable: its semantic tool result.
    Unavailable(&'a RawId, Unavailable<'a>),
    /// Refused as a request (an unknown tool, an invalid name): its JSON-RPC error.
    Error(&'a RawId, i64, &'a str),
    /// Not executed because another element was refused.
    NotRun(&'a RawId),
}

/// The answer to a 2025-03-26 batch of which some call was refused: nothing of it ran. One
/// response per request of the batch (notifications get none), in the client's framing.
pub fn batch_refused(
    version: ProtocolVersion,
    answers: &[BatchAnswer<'_>],
    framing: Framing,
) -> Reply {
    struct Batch<'r, 'a>(&'r [BatchAnswer<'a>], ProtocolVersion);
    impl Serialize for Batch<'_, '_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeSeq;
            let mut seq = s.serialize_seq(Some(self.0.len()))?;
            for answer in self.0 {
                match answer {
                    BatchAnswer::Unavailable(id, details) => {
                        let text = details.text();
                        seq.serialize_element(&ResultMessage {
                            jsonrpc: "2.0",
                            id: id.as_raw(),
                            result: ToolResult {
                                content: [TextContent {
                                    kind: "text",
                                    text: &text,
                                }],
                                is_error: true,
                                result_type: self.1.has_result_type().then_some("complete"),
                                meta: Meta(details),
                            },
                        })?;
                    }
                    BatchAnswer::Error(id, code, message) => {
                        seq.serialize_element(&ErrorMessage {
                            id: ErrorId::Raw(id.as_raw()),
                            code: *code,
                            message,
                            data: None::<()>,
                        })?
                    }
                    BatchAnswer::NotRun(id) => seq.serialize_element(&ErrorMessage {
                        id: ErrorId::Raw(id.as_raw()),
                        code: INVALID_REQUEST,
                        message: "Not run: another call in this batch was refused, so the \
                                  gateway ran none of it. Send the calls one by one.",
                        data: None::<()>,
                    })?,
                }
            }
            seq.end()
        }
    }
    framed(&Batch(answers, version), framing, 400 * answers.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn a_reply_spliced_around_an_id_is_the_reply_written_for_it() {
        let details = Unavailable {
            kind: UnavailableKind::UpstreamFailure {
                what: UpstreamFailure::Reset,
            },
            tool: Some("write_order"),
            retry_after_secs: None,
            fallback_tool: Some("queue_order"),
        };
        let write = |id: &RawId| {
            tool_unavailable(ProtocolVersion::V2025_06_18, id, &details, Framing::Json)
        };
        let mut by_id: ById<&str> = ById::default();
        for text in ["1", "\"a-\\\"b\"", "-7", "\"\"", "12345678901234567890"] {
            let id = RawId::from_json(text).expect("id");
            let got = by_id.reply("write_order", &id, || write(&id));
            assert_eq!(got, write(&id).body, "id {text}");
        }
        assert_eq!(by_id.after_id.len(), 1);
        // A reply of another shape is written each time, never spliced.
        let mut sse: ById<&str> = ById::default();
        let id = RawId::from_json("3").expect("id");
        let framed = || tool_unavailable(ProtocolVersion::V2025_06_18, &id, &details, Framing::Sse);
        assert_eq!(sse.reply("k", &id, framed), framed().body);
        assert!(sse.after_id.is_empty());
    }

    fn id(text: &str) -> RawId {
        RawId::from_json(text).expect("test id")
    }

    fn json(reply: &Reply) -> Value {
        let text = std::str::from_utf8(&reply.body).expect("utf-8");
        let text = match reply.content_type {
            "text/event-stream" => text
                .strip_prefix("event: message\ndata: ")
                .and_then(|t| t.strip_suffix("\n\n"))
                .expect("one SSE event"),
            _ => text,
        };
        serde_json::from_str(text).expect("reply is JSON")
    }

    const FAILURE_RATE: OpenCause = OpenCause::FailureRate {
        percent: 70,
        calls: 10,
        window_secs: 10,
    };

    const OPEN: Unavailable<'static> = Unavailable {
        kind: UnavailableKind::Open {
            cause: FAILURE_RATE,
        },
        tool: Some("write_order"),
        retry_after_secs: Some(10),
        fallback_tool: Some("write_order_queue"),
    };

    #[test]
    fn open_breaker_text_says_which_threshold_tripped_and_what_to_do() {
        assert_eq!(
            OPEN.text(),
            "The tool `write_order` is temporarily unavailable: 70% of its 10 calls in the last \
             10 seconds failed. The gateway refuses it for the next 10 seconds: do not retry it \
             before then. Use the tool `write_order_queue` instead."
        );
        let slow = Unavailable {
            kind: UnavailableKind::Open {
                cause: OpenCause::SlowCallRate {
                    percent: 60,
                    calls: 10,
                    window_secs: 10,
                    slow_call_ms: 2000,
                },
            },
            fallback_tool: None,
            retry_after_secs: Some(1),
            ..OPEN
        };
        assert_eq!(
            slow.text(),
            "The tool `write_order` is temporarily unavailable: 60% of its 10 calls in the last \
             10 seconds took 2 seconds or longer. The gateway refuses it for the next 1 second: \
             do not retry it before then. Continue without it or try a different approach."
        );
        let v = json(&tool_unavailable(
            ProtocolVersion::V2025_06_18,
            &id("3"),
            &slow,
            Framing::Json,
        ));
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        assert_eq!(meta["trippedBy"], "slow_call_rate");
        assert_eq!(meta["slowCallRatePercent"], 60);
        assert_eq!(meta["slowCallMs"], 2000);
        assert_eq!(meta["calls"], 10);
        assert!(meta["reason"]
            .as_str()
            .is_some_and(|r| r.contains("took 2 seconds or longer")));
    }

    #[test]
    fn a_wait_is_named_only_where_the_gateway_enforces_it() {
        let forced = Unavailable {
            kind: UnavailableKind::ForcedOpen {
                reason: "  maintenance until 14:00.\n",
            },
            retry_after_secs: None,
            fallback_tool: None,
            ..OPEN
        };
        assert_eq!(
            forced.text(),
            "The tool `write_order` is disabled by an operator: maintenance until 14:00. It \
             stays disabled until the operator lifts this. Continue without it or try a \
             different approach."
        );
        let v = json(&tool_unavailable(
            ProtocolVersion::V2025_11_25,
            &id("1"),
            &forced,
            Framing::Json,
        ));
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        assert_eq!(meta["state"], "forced_open");
        assert_eq!(meta.get("retryAfterSeconds"), None, "{meta}");

        for (what, may_have_run) in [
            (UpstreamFailure::ConnectFailure, false),
            (UpstreamFailure::NoHealthyUpstream, false),
            (UpstreamFailure::Timeout, true),
            (UpstreamFailure::Reset, true),
            (UpstreamFailure::Http5xx(500), true),
            (UpstreamFailure::BadResponse, true),
            (UpstreamFailure::NoResponse, true),
            (UpstreamFailure::SessionRefused(503), false),
            (
                UpstreamFailure::SessionLimit {
                    limit: 2,
                    per_caller: false,
                },
                false,
            ),
        ] {
            let failed = Unavailable {
                kind: UnavailableKind::UpstreamFailure { what },
                retry_after_secs: None,
                fallback_tool: None,
                ..OPEN
            };
            let text = failed.text();
            assert!(!text.contains("Do not retry"), "{text}");
            assert!(!text.contains("refuses"), "{text}");
            assert_eq!(
                text.contains("may or may not have taken effect"),
                may_have_run
            );
            let v = json(&tool_unavailable(
                ProtocolVersion::V2025_06_18,
                &id("1"),
                &failed,
                Framing::Json,
            ));
            let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
            assert_eq!(meta["state"], "upstream_failure");
            assert_eq!(meta["mayHaveRun"], may_have_run);
            assert_eq!(meta.get("retryAfterSeconds"), None);
        }
    }

    #[test]
    fn tool_unavailable_echoes_the_raw_id_and_carries_details() {
        for raw in ["7", r#""a\"b\u00e9""#, "-3", "12345678901234567890123"] {
            let reply =
                tool_unavailable(ProtocolVersion::V2025_06_18, &id(raw), &OPEN, Framing::Json);
            let body = std::str::from_utf8(&reply.body).expect("utf-8");
            assert!(
                body.starts_with(&format!("{{\"jsonrpc\":\"2.0\",\"id\":{raw},")),
                "{body}"
            );
            assert_eq!(reply.content_type, "application/json");
        }
        let v = json(&tool_unavailable(
            ProtocolVersion::V2025_06_18,
            &id("7"),
            &OPEN,
            Framing::Json,
        ));
        assert_eq!(v["result"]["isError"], true);
        assert_eq!(v["result"].get("resultType"), None);
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        assert_eq!(meta["state"], "open");
        assert_eq!(meta["tool"], "write_order");
        assert_eq!(meta["retryAfterSeconds"], 10);
        assert_eq!(meta["fallbackTool"], "write_order_queue");
        assert_eq!(meta["trippedBy"], "failure_rate");
        assert_eq!(meta["failureRatePercent"], 70);
        let v = json(&tool_unavailable(
            ProtocolVersion::V2026_07_28,
            &id("1"),
            &OPEN,
            Framing::Json,
        ));
        assert_eq!(v["result"]["resultType"], "complete");
    }

    #[test]
    fn operator_reason_is_escaped_and_bounded() {
        let hostile = format!(
            "\"}}],\"isError\":false,\u{2028}\u{0}\\{}",
            "é".repeat(1000)
        );
        let details = Unavailable {
            kind: UnavailableKind::ForcedOpen { reason: &hostile },
            ..OPEN
        };
        let reply = tool_unavailable(
            ProtocolVersion::V2025_03_26,
            &id("1"),
            &details,
            Framing::Sse,
        );
        let v = json(&reply);
        assert_eq!(v["result"]["isError"], true);
        let reason = v["result"]["_meta"]["io.toolgate/breaker"]["reason"]
            .as_str()
            .expect("reason");
        assert!(reason.len() <= MAX_REASON_BYTES);
        assert!(reason.starts_with("\"}],\"isError\":false,\u{2028} \\"));
        let body = std::str::from_utf8(&reply.body).expect("utf-8");
        assert_eq!(
            body.matches('\n').count(),
            3,
            "one event: two header lines and a blank"
        );
    }

    #[test]
    fn sse_framing_is_one_message_event() {
        let reply = tool_unavailable(ProtocolVersion::V2025_11_25, &id("1"), &OPEN, Framing::Sse);
        assert_eq!(reply.content_type, "text/event-stream");
        let body = std::str::from_utf8(&reply.body).expect("utf-8");
        assert!(body.starts_with("event: message\ndata: {"));
        assert!(body.ends_with("}\n\n"));
        json(&reply);
    }

    #[test]
    fn other_methods_get_an_error_naming_the_service() {
        let v = json(&service_unavailable(
            ProtocolVersion::V2025_11_25,
            &id("\"x\""),
            "orders",
            UpstreamFailure::NoHealthyUpstream,
            Framing::Sse,
        ));
        assert_eq!(v["id"], "x");
        assert_eq!(v["error"]["code"], INTERNAL_ERROR);
        assert_eq!(
            v["error"]["message"],
            "No server of the MCP service `orders` is available right now; try again in a few seconds."
        );
        assert_eq!(
            v["error"]["data"]["io.toolgate/breaker"]["failure"],
            "no_healthy_upstream"
        );
    }

    #[test]
    fn refusals_and_header_mismatches_are_json_rpc_errors() {
        let v = json(&refused(
            ProtocolVersion::V2025_06_18,
            None,
            Refusal::DuplicateKey("params.name"),
            Framing::Json,
        ));
        assert_eq!(v["id"], Value::Null);
        assert_eq!(v["error"]["code"], INVALID_REQUEST);
        assert_eq!(v["error"].get("data"), None);
        let v = json(&refused(
            ProtocolVersion::V2026_07_28,
            Some(&id("4")),
            Refusal::NotJson { line: 1, column: 9 },
            Framing::Json,
        ));
        assert_eq!(v["id"], 4);
        assert_eq!(v["error"]["code"], -32700);
        let v = json(&header_mismatch(
            ProtocolVersion::V2026_07_28,
            Some(&id("1")),
            Mismatch::NameDiffers,
            Framing::Json,
        ));
        assert_eq!(v["error"]["code"], -32020);
    }

    #[test]
    fn too_deep_names_the_limit() {
        let v = json(&too_deep(ProtocolVersion::V2025_06_18, 64, Framing::Json));
        assert_eq!(v.get("id"), Some(&Value::Null));
        assert_eq!(v["error"]["code"], INVALID_REQUEST);
        assert_eq!(v["error"]["data"]["io.toolgate/limits"]["maxJsonDepth"], 64);
        assert_eq!(
            v["error"]["data"]["io.toolgate/limits"].get("maxBodyBytes"),
            None
        );
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("64 levels")));
    }

    #[test]
    fn body_too_large_without_id_follows_each_versions_rule() {
        let v = json(&body_too_large(
            ProtocolVersion::V2025_03_26,
            None,
            1024,
            Framing::Json,
        ));
        assert_eq!(v.get("id"), Some(&Value::Null));
        let v = json(&body_too_large(
            ProtocolVersion::V2026_07_28,
            None,
            1024,
            Framing::Json,
        ));
        assert_eq!(v.get("id"), None);
        assert_eq!(v["error"]["code"], INVALID_REQUEST);
        assert_eq!(
            v["error"]["data"]["io.toolgate/limits"]["maxBodyBytes"],
            1024
        );
        let v = json(&body_too_large(
            ProtocolVersion::V2025_06_18,
            Some(&id("9")),
            1,
            Framing::Sse,
        ));
        assert_eq!(v["id"], 9);
    }

    #[test]
    fn a_refused_batch_answers_every_request_and_runs_none() {
        let (a, b) = (id("1"), id("\"two\""));
        let reply = batch_refused(
            ProtocolVersion::V2025_03_26,
            &[BatchAnswer::NotRun(&a), BatchAnswer::Unavailable(&b, OPEN)],
            Framing::Json,
        );
        let v = json(&reply);
        let answers = v.as_array().expect("an array");
        assert_eq!(answers.len(), 2);
        assert_eq!(answers[0]["id"], 1);
        assert_eq!(answers[0]["error"]["code"], INVALID_REQUEST);
        assert_eq!(answers[1]["id"], "two");
        assert_eq!(answers[1]["result"]["isError"], true);
    }

    #[test]
    fn protocol_version_from_header() {
        assert_eq!(
            ProtocolVersion::from_header(None),
            ProtocolVersion::V2025_03_26
        );
        assert_eq!(
            ProtocolVersion::from_header(Some("2026-07-28")),
            ProtocolVersion::V2026_07_28
        );
        assert_eq!(
            ProtocolVersion::from_header(Some(" 2025-06-18 ")),
            ProtocolVersion::V2025_06_18
        );
        assert_eq!(
            ProtocolVersion::from_header(Some("2099-01-01")),
            ProtocolVersion::V2025_11_25
        );
        assert_eq!(
            ProtocolVersion::from_header(Some("")),
            ProtocolVersion::V2025_11_25
        );
        for v in ProtocolVersion::ALL {
            assert_eq!(ProtocolVersion::parse(v.as_str()), Some(v));
        }
        assert!(ProtocolVersion::V2026_07_28.has_request_headers());
        assert!(!ProtocolVersion::V2025_11_25.has_request_headers());
    }

    #[test]
    fn framing_from_accept() {
        let f = |a| Framing::from_accept(a);
        assert_eq!(f(None), Framing::Json);
        assert_eq!(
            f(Some("application/json, text/event-stream")),
            Framing::Json
        );
        assert_eq!(f(Some("text/event-stream")), Framing::Sse);
        assert_eq!(f(Some("Text/Event-Stream;charset=utf-8")), Framing::Sse);
        assert_eq!(f(Some("text/event-stream, */*")), Framing::Json);
        assert_eq!(
            f(Some("text/event-stream, application/*;q=0.5")),
            Framing::Json
        );
        assert_eq!(
            f(Some("text/event-stream, application/json;q=0")),
            Framing::Sse
        );
        assert_eq!(f(Some("text/event-stream;q=0")), Framing::Json);
        assert_eq!(f(Some("")), Framing::Json);
        assert_eq!(f(Some(",,;;=,")), Framing::Json);
    }
}
