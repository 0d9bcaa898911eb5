//! MCP replies the filter sends in the server's place.
//!
//! When a breaker is open or the upstream failed, the agent gets a message its MCP client
//! accepts, for the protocol version it speaks and with its request's own id: for `tools/call` a
//! `CallToolResult` with `isError: true` whose text tells the model what to do next, otherwise a
//! JSON-RPC error. Machine-readable details sit under `io.toolgate/breaker`.
//!
//! The inputs are closed enums, tool names and numbers: no upstream text (addresses, cluster
//! names, response bodies) can reach a reply. The one free-form string, an operator's reason for
//! forcing a breaker open, is escaped and cut to a bounded length.
//!
//! Replies are written by hand into one buffer: the id must be echoed as raw JSON text, and the
//! SSE framing is written around the JSON without a second copy.

use std::borrow::Cow;
use std::fmt::Write as _;

use super::jsonrpc::{Mismatch, RawId, HEADER_MISMATCH};

/// JSON-RPC "Invalid Request": the request is unacceptable as sent (too large to read).
pub const INVALID_REQUEST: i64 = -32600;
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
    fn has_result_type(self) -> bool {
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unavailable<'a> {
    pub kind: UnavailableKind<'a>,
    /// The tool called; `None` for methods other than `tools/call`.
    pub tool: Option<&'a str>,
    /// How long the agent should leave the tool alone; 0 when there is no such advice.
    pub retry_after_secs: u64,
    /// A tool the policy names to use instead.
    pub fallback_tool: Option<&'a str>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnavailableKind<'a> {
    /// The breaker opened on recent failures.
    Open,
    /// An operator forced the breaker open; `reason` is theirs and is shown to the model.
    ForcedOpen { reason: &'a str },
    /// This call's upstream failed.
    UpstreamFailure { what: UpstreamFailure },
    /// Too many calls in flight (half-open probes taken, or a concurrency limit).
    Overloaded,
}

/// How the upstream failed, as Envoy reports it; deliberately without any text from Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamFailure {
    ConnectFailure,
    Reset,
    Timeout,
    Http5xx(u16),
    NoHealthyUpstream,
}

impl UnavailableKind<'_> {
    fn state(&self) -> &'static str {
        match self {
            UnavailableKind::Open => "open",
            UnavailableKind::ForcedOpen { .. } => "forced_open",
            UnavailableKind::UpstreamFailure { .. } => "upstream_failure",
            UnavailableKind::Overloaded => "overloaded",
        }
    }

    /// What happened, as the clause of a sentence whose subject is the tool.
    fn predicate(&self) -> Cow<'static, str> {
        match self {
            UnavailableKind::Open => "is temporarily unavailable (its recent calls failed)".into(),
            UnavailableKind::ForcedOpen { reason } => {
                let reason = clean_reason(reason);
                if reason.is_empty() {
                    "is disabled by an operator".into()
                } else {
                    format!("is disabled by an operator: {reason}").into()
                }
            }
            UnavailableKind::UpstreamFailure { what } => {
                format!("is temporarily unavailable ({})", upstream_phrase(*what)).into()
            }
            UnavailableKind::Overloaded => "is temporarily unavailable (server busy)".into(),
        }
    }

    /// The same cause without the subject, for `_meta`.
    fn reason(&self) -> Cow<'static, str> {
        match self {
            UnavailableKind::Open => "its recent calls failed".into(),
            UnavailableKind::ForcedOpen { reason } => clean_reason(reason).into_owned().into(),
            UnavailableKind::UpstreamFailure { what } => upstream_phrase(*what),
            UnavailableKind::Overloaded => "server busy".into(),
        }
    }
}

fn upstream_phrase(what: UpstreamFailure) -> Cow<'static, str> {
    match what {
        UpstreamFailure::ConnectFailure => "the server behind it could not be reached".into(),
        UpstreamFailure::Reset => "the connection to the server behind it was reset".into(),
        UpstreamFailure::Timeout => "the server behind it did not answer in time".into(),
        UpstreamFailure::Http5xx(status) => {
            format!("the server behind it answered with HTTP status {status}").into()
        }
        UpstreamFailure::NoHealthyUpstream => "no healthy server is available for it".into(),
    }
}

fn failure_code(what: UpstreamFailure) -> &'static str {
    match what {
        UpstreamFailure::ConnectFailure => "connect_failure",
        UpstreamFailure::Reset => "reset",
        UpstreamFailure::Timeout => "timeout",
        UpstreamFailure::Http5xx(_) => "http_5xx",
        UpstreamFailure::NoHealthyUpstream => "no_healthy_upstream",
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

fn plural_seconds(n: u64) -> &'static str {
    if n == 1 {
        "second"
    } else {
        "seconds"
    }
}

impl Unavailable<'_> {
    /// The content text the model reads: what happened, how long to wait, what to do instead.
    pub fn text(&self) -> String {
        let mut text = String::with_capacity(160);
        match self.tool {
            Some(tool) => {
                let _ = write!(text, "The tool `{tool}` {}.", self.kind.predicate());
            }
            None => {
                let _ = write!(text, "The server {}.", self.kind.predicate());
            }
        }
        if self.retry_after_secs > 0 {
            let n = self.retry_after_secs;
            let _ = write!(text, " Do not retry it for {n} {}.", plural_seconds(n));
        }
        match self.fallback_tool {
            Some(fallback) => {
                let _ = write!(text, " Use the tool `{fallback}` instead.");
            }
            None => text.push_str(" Continue without it or try a different approach."),
        }
        text
    }

    /// One sentence for a JSON-RPC error `message`.
    pub fn message(&self) -> String {
        let mut message = String::with_capacity(120);
        match self.tool {
            Some(tool) => {
                let _ = write!(message, "The tool `{tool}` {}", self.kind.predicate());
            }
            None => {
                let _ = write!(message, "The server {}", self.kind.predicate());
            }
        }
        if self.retry_after_secs > 0 {
            let n = self.retry_after_secs;
            let _ = write!(message, "; retry after {n} {}", plural_seconds(n));
        }
        if let Some(fallback) = self.fallback_tool {
            let _ = write!(message, "; use the tool `{fallback}` instead");
        }
        message.push('.');
        message
    }

    /// `{"io.toolgate/breaker":{…}}`, the object used as `_meta` and as an error's `data`.
    fn write_meta(&self, out: &mut String) {
        out.push_str("{\"");
        out.push_str(META_KEY);
        out.push_str("\":{\"state\":\"");
        out.push_str(self.kind.state());
        out.push_str("\",\"tool\":");
        write_opt_str(out, self.tool);
        let _ = write!(out, ",\"retryAfterSeconds\":{}", self.retry_after_secs);
        out.push_str(",\"fallbackTool\":");
        write_opt_str(out, self.fallback_tool);
        out.push_str(",\"reason\":");
        write_str(out, &self.kind.reason());
        if let UnavailableKind::UpstreamFailure { what } = self.kind {
            out.push_str(",\"failure\":\"");
            out.push_str(failure_code(what));
            out.push('"');
            if let UpstreamFailure::Http5xx(status) = what {
                let _ = write!(out, ",\"httpStatus\":{status}");
            }
        }
        out.push_str("}}");
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
    let mut out = begin(framing, text.len() + id.as_json().len() + 320);
    out.push_str("{\"jsonrpc\":\"2.0\",\"id\":");
    out.push_str(id.as_json());
    out.push_str(",\"result\":{\"content\":[{\"type\":\"text\",\"text\":");
    write_str(&mut out, &text);
    out.push_str("}],\"isError\":true,");
    if version.has_result_type() {
        out.push_str("\"resultType\":\"complete\",");
    }
    out.push_str("\"_meta\":");
    details.write_meta(&mut out);
    out.push_str("}}");
    end(out, framing)
}

/// A JSON-RPC error for request `id`; `data` carries the unavailability details when given.
/// `message` must be the gateway's own words: it is sent to the client as is (escaped).
pub fn error_reply(
    version: ProtocolVersion,
    id: &RawId,
    code: i64,
    message: &str,
    data: Option<&Unavailable<'_>>,
    framing: Framing,
) -> Reply {
    let mut out = begin(framing, message.len() + id.as_json().len() + 320);
    write_error(&mut out, version, Some(id), code, message, |out| {
        if let Some(details) = data {
            details.write_meta(out);
            true
        } else {
            false
        }
    });
    end(out, framing)
}

/// The error for a method other than `tools/call` that is not passed on: `Internal error`
/// (see [`INTERNAL_ERROR`]) with the details in `data`.
pub fn unavailable_error(
    version: ProtocolVersion,
    id: &RawId,
    details: &Unavailable<'_>,
    framing: Framing,
) -> Reply {
    error_reply(
        version,
        id,
        INTERNAL_ERROR,
        &details.message(),
        Some(details),
        framing,
    )
}

/// `HeaderMismatch` (-32020) for a 2026-07-28 request whose headers disagree with its body; the
/// id is `None` when the body could not be read.
pub fn header_mismatch(
    version: ProtocolVersion,
    id: Option<&RawId>,
    mismatch: Mismatch,
    framing: Framing,
) -> Reply {
    let mut out = begin(framing, 200);
    write_error(
        &mut out,
        version,
        id,
        HEADER_MISMATCH,
        mismatch.describe(),
        |_| false,
    );
    end(out, framing)
}

/// The error for a request body over the gateway's limit of `limit_bytes`. `id` is `None` when
/// the body was not read; the reply then has no id (2025-11-25 on) or `"id": null` (earlier
/// revisions, whose schemas require an id although JSON-RPC has no other value for an unknown
/// one).
pub fn body_too_large(
    version: ProtocolVersion,
    id: Option<&RawId>,
    limit_bytes: u64,
    framing: Framing,
) -> Reply {
    let message = format!(
        "The request body is larger than this gateway accepts ({limit_bytes} bytes); send a smaller request."
    );
    let mut out = begin(framing, message.len() + 200);
    write_error(&mut out, version, id, INVALID_REQUEST, &message, |out| {
        let _ = write!(
            out,
            "{{\"io.toolgate/limits\":{{\"maxBodyBytes\":{limit_bytes}}}}}"
        );
        true
    });
    end(out, framing)
}

/// The answer to a request body nested deeper than the gateway accepts (`id` null: such a body
/// is not parsed).
pub fn too_deep(version: ProtocolVersion, limit: u64, framing: Framing) -> Reply {
    let message = format!(
        "The request nests arrays and objects deeper than this gateway accepts ({limit} levels); send a flatter request."
    );
    let mut out = begin(framing, message.len() + 200);
    write_error(&mut out, version, None, INVALID_REQUEST, &message, |out| {
        let _ = write!(
            out,
            "{{\"io.toolgate/limits\":{{\"maxJsonDepth\":{limit}}}}}"
        );
        true
    });
    end(out, framing)
}

fn write_error(
    out: &mut String,
    version: ProtocolVersion,
    id: Option<&RawId>,
    code: i64,
    message: &str,
    data: impl FnOnce(&mut String) -> bool,
) {
    out.push_str("{\"jsonrpc\":\"2.0\",");
    match id {
        Some(id) => {
            out.push_str("\"id\":");
            out.push_str(id.as_json());
            out.push(',');
        }
        None if version.may_omit_error_id() => {}
        None => out.push_str("\"id\":null,"),
    }
    let _ = write!(out, "\"error\":{{\"code\":{code},\"message\":");
    write_str(out, message);
    let mark = out.len();
    out.push_str(",\"data\":");
    if !data(out) {
        out.truncate(mark);
    }
    out.push_str("}}");
}

/// The SSE event a server would send: `event: message` and the JSON on one `data` line (the JSON
/// written here never contains a raw line break, since strings escape them).
const SSE_PREFIX: &str = "event: message\ndata: ";
const SSE_SUFFIX: &str = "\n\n";

fn begin(framing: Framing, capacity: usize) -> String {
    match framing {
        Framing::Json => String::with_capacity(capacity),
        Framing::Sse => {
            let mut out = String::with_capacity(capacity + SSE_PREFIX.len() + SSE_SUFFIX.len());
            out.push_str(SSE_PREFIX);
            out
        }
    }
}

fn end(mut out: String, framing: Framing) -> Reply {
    if framing == Framing::Sse {
        out.push_str(SSE_SUFFIX);
    }
    Reply {
        body: out.into_bytes(),
        content_type: framing.content_type(),
    }
}

fn write_opt_str(out: &mut String, value: Option<&str>) {
    match value {
        Some(value) => write_str(out, value),
        None => out.push_str("null"),
    }
}

/// Writes `value` as a JSON string. U+2028/U+2029 are escaped as well: some JavaScript clients
/// still evaluate JSON as script, where they end a line.
fn write_str(out: &mut String, value: &str) {
    out.push('"');
    let mut plain = 0;
    for (i, c) in value.char_indices() {
        let escape: Option<&str> = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            '\u{0}'..='\u{1f}' | '\u{7f}' | '\u{2028}' | '\u{2029}' => None,
            _ => continue,
        };
        out.push_str(&value[plain..i]);
        match escape {
            Some(escape) => out.push_str(escape),
            None => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
        }
        plain = i + c.len_utf8();
    }
    out.push_str(&value[plain..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

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

    const OPEN: Unavailable<'static> = Unavailable {
        kind: UnavailableKind::Open,
        tool: Some("write_order"),
        retry_after_secs: 10,
        fallback_tool: Some("write_order_queue"),
    };

    #[test]
    fn open_breaker_text_tells_the_model_what_to_do() {
        assert_eq!(
            OPEN.text(),
            "The tool `write_order` is temporarily unavailable (its recent calls failed). \
             Do not retry it for 10 seconds. Use the tool `write_order_queue` instead."
        );
        let alone = Unavailable {
            fallback_tool: None,
            retry_after_secs: 1,
            ..OPEN
        };
        assert_eq!(
            alone.text(),
            "The tool `write_order` is temporarily unavailable (its recent calls failed). \
             Do not retry it for 1 second. Continue without it or try a different approach."
        );
    }

    #[test]
    fn each_kind_has_its_own_words() {
        let texts: Vec<String> = [
            UnavailableKind::ForcedOpen {
                reason: "  maintenance until 14:00.\n",
            },
            UnavailableKind::UpstreamFailure {
                what: UpstreamFailure::Http5xx(503),
            },
            UnavailableKind::UpstreamFailure {
                what: UpstreamFailure::Timeout,
            },
            UnavailableKind::Overloaded,
        ]
        .into_iter()
        .map(|kind| {
            Unavailable {
                kind,
                fallback_tool: None,
                retry_after_secs: 0,
                ..OPEN
            }
            .text()
        })
        .collect();
        assert_eq!(texts[0], "The tool `write_order` is disabled by an operator: maintenance until 14:00. Continue without it or try a different approach.");
        assert_eq!(texts[1], "The tool `write_order` is temporarily unavailable (the server behind it answered with HTTP status 503). Continue without it or try a different approach.");
        assert!(texts[2].contains("did not answer in time"));
        assert!(texts[3].contains("(server busy)"));
    }

    #[test]
    fn tool_unavailable_echoes_the_raw_id_and_carries_details() {
        for raw in ["7", r#""a\"b\u00e9""#, "-3", "1.5e3"] {
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
        assert_eq!(meta["reason"], "its recent calls failed");
    }

    #[test]
    fn v2026_results_say_they_are_complete() {
        let v = json(&tool_unavailable(
            ProtocolVersion::V2026_07_28,
            &id("1"),
            &OPEN,
            Framing::Json,
        ));
        assert_eq!(v["result"]["resultType"], "complete");
    }

    #[test]
    fn upstream_failures_are_coded_without_upstream_text() {
        let details = Unavailable {
            kind: UnavailableKind::UpstreamFailure {
                what: UpstreamFailure::Http5xx(502),
            },
            fallback_tool: None,
            ..OPEN
        };
        let v = json(&tool_unavailable(
            ProtocolVersion::V2025_11_25,
            &id("1"),
            &details,
            Framing::Json,
        ));
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        assert_eq!(meta["state"], "upstream_failure");
        assert_eq!(meta["failure"], "http_5xx");
        assert_eq!(meta["httpStatus"], 502);
        assert_eq!(meta["fallbackTool"], Value::Null);
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
    fn unavailable_error_is_an_internal_error_with_details() {
        let details = Unavailable {
            tool: None,
            fallback_tool: None,
            ..OPEN
        };
        let v = json(&unavailable_error(
            ProtocolVersion::V2025_11_25,
            &id("\"x\""),
            &details,
            Framing::Json,
        ));
        assert_eq!(v["id"], "x");
        assert_eq!(v["error"]["code"], INTERNAL_ERROR);
        assert_eq!(
            v["error"]["message"],
            "The server is temporarily unavailable (its recent calls failed); retry after 10 seconds."
        );
        assert_eq!(
            v["error"]["data"]["io.toolgate/breaker"]["tool"],
            Value::Null
        );
    }

    #[test]
    fn error_reply_without_data_has_no_data_member() {
        let v = json(&error_reply(
            ProtocolVersion::V2025_03_26,
            &id("1"),
            -32603,
            "x\ny",
            None,
            Framing::Json,
        ));
        assert_eq!(v["error"]["message"], "x\ny");
        assert_eq!(v["error"].get("data"), None);
    }

    #[test]
    fn too_deep_names_the_limit() {
        let v = json(&too_deep(ProtocolVersion::V2025_06_18, 64, Framing::Json));
        assert_eq!(v.get("id"), Some(&Value::Null));
        assert_eq!(v["error"]["code"], INVALID_REQUEST);
        assert_eq!(v["error"]["data"]["io.toolgate/limits"]["maxJsonDepth"], 64);
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
    fn header_mismatch_uses_code_32020() {
        let v = json(&header_mismatch(
            ProtocolVersion::V2026_07_28,
            Some(&id("1")),
            Mismatch::NameDiffers,
            Framing::Json,
        ));
        assert_eq!(v["error"]["code"], -32020);
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

    #[test]
    fn write_str_matches_serde_json_decoding() {
        for s in [
            "",
            "plain",
            "quote\" back\\ nl\n cr\r tab\t nul\0 del\x7f",
            "\u{2028}\u{2029}é😀",
            "\u{1f}x",
        ] {
            let mut out = String::new();
            write_str(&mut out, s);
            assert_eq!(
                serde_json::from_str::<String>(&out).expect("valid JSON string"),
                s
            );
            assert!(!out.contains('\n'));
        }
    }
}
