//! The JSON-RPC envelope of every reply: the details under `io.toolgate/breaker`, the id,
//! the framing, and templates that splice a request's id into a reply written once.

use super::*;

/// `{"io.toolgate/breaker":{…}}`: the object used as `_meta` and as an error's `data`.
pub(super) struct Meta<'r, 'a>(pub(super) &'r Unavailable<'a>);

impl Serialize for Meta<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut outer = s.serialize_map(Some(1))?;
        outer.serialize_entry(META_KEY, &Details(self.0))?;
        outer.end()
    }
}

pub(super) struct Details<'r, 'a>(pub(super) &'r Unavailable<'a>);

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
            UnavailableKind::Limited { limit } => {
                m.serialize_entry(
                    "limit",
                    &serde_json::json!({
                        "rule": limit.rule,
                        "per": limit.per,
                        "calls": limit.calls,
                        "perSeconds": limit.per_seconds,
                        "burst": limit.burst,
                    }),
                )?;
            }
            _ => {}
        }
        m.end()
    }
}

/// The id member of an error: the request's, `null`, or absent.
pub(super) enum ErrorId<'a> {
    Raw(&'a RawValue),
    Null,
    Omitted,
}

pub(super) fn error_id<'a>(version: ProtocolVersion, id: Option<&'a RawId>) -> ErrorId<'a> {
    match id {
        Some(id) => ErrorId::Raw(id.as_raw()),
        None if version.may_omit_error_id() => ErrorId::Omitted,
        None => ErrorId::Null,
    }
}

#[derive(Serialize)]
pub(super) struct ResultMessage<'a, R: Serialize> {
    pub(super) jsonrpc: &'static str,
    pub(super) id: &'a RawValue,
    pub(super) result: R,
}

#[derive(Serialize)]
pub(super) struct ToolResult<'a, 'r, 'u> {
    pub(super) content: [TextContent<'a>; 1],
    #[serde(rename = "isError")]
    pub(super) is_error: bool,
    #[serde(rename = "resultType", skip_serializing_if = "Option::is_none")]
    pub(super) result_type: Option<&'static str>,
    #[serde(rename = "_meta")]
    pub(super) meta: Meta<'r, 'u>,
}

#[derive(Serialize)]
pub(super) struct TextContent<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) text: &'a str,
}

pub(super) struct ErrorMessage<'a, D: Serialize> {
    pub(super) id: ErrorId<'a>,
    pub(super) code: i64,
    pub(super) message: &'a str,
    pub(super) data: Option<D>,
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
pub(super) struct ErrorObject<'a, D: Serialize> {
    pub(super) code: i64,
    pub(super) message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) data: Option<&'a D>,
}

/// The SSE event a server would send: `event: message` and the JSON on one `data` line (the
/// JSON written here never contains a raw line break: serde_json escapes them in strings).
pub(super) const SSE_PREFIX: &[u8] = b"event: message\ndata: ";
pub(super) const SSE_SUFFIX: &[u8] = b"\n\n";

/// Serializes one JSON-RPC message (or a batch of them) in the client's framing.
pub(super) fn framed(message: &impl Serialize, framing: Framing, capacity: usize) -> Reply {
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
pub(super) const BEFORE_ID: &[u8] = br#"{"jsonrpc":"2.0","id":"#;
/// Templates kept per worker, at most: past it, the oldest are dropped all at once.
pub(super) const MAX_TEMPLATES: usize = 1024;

/// JSON replies that differ only in their request's id, each kept as the text after the id:
/// a reply a call may need is written once per (key) and spliced around each call's id,
/// instead of serialized for every call (the reply for an upstream cut off while
/// the filter holds its answer is set on every call whose answer is held).
pub struct ById<K> {
    pub(super) after_id: std::collections::HashMap<K, Vec<u8>>,
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
