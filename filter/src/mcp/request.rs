//! Reading a request body the way the gateway must: exactly, or not at all.
//!
//! The breaker and an operator's `force_open` are worth something only if the gateway judges
//! the very method and tool the server will execute. JSON readers disagree on the corners of
//! JSON (duplicate keys: Python's and JavaScript's take the last copy, others the first;
//! `NaN` and `Infinity`: pydantic accepts them), so a body is either read without any such
//! corner, or refused with a JSON-RPC error that says why. Nothing the gateway cannot judge
//! reaches a server.
//!
//! What is read: the envelope (`jsonrpc`, `id`, `method`, `params`, `result`, `error`, each at
//! most once) and in `params` the fields the gateway acts on (`name`, `uri`, each at most once).
//! Everything else (tool arguments above all) is checked for syntax only and never built: a
//! `serde_json::Value` of every body would cost an allocation per JSON node on every call.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::jsonrpc::{first_non_ws, MaybeStr, RawId, Str};

/// JSON-RPC "Parse error": the body is not JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC "Invalid Request": JSON, but not an acceptable request.
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC "Invalid params".
pub const INVALID_PARAMS: i64 = -32602;

pub const TOOLS_CALL: &str = "tools/call";
pub const TOOLS_LIST: &str = "tools/list";
pub const PROMPTS_GET: &str = "prompts/get";
pub const RESOURCES_READ: &str = "resources/read";
pub const RESOURCES_SUBSCRIBE: &str = "resources/subscribe";
pub const RESOURCES_UNSUBSCRIBE: &str = "resources/unsubscribe";
pub const COMPLETION_COMPLETE: &str = "completion/complete";
pub const SET_LEVEL: &str = "logging/setLevel";
/// The 2026-07-28 revision's stateless discovery, which SDKs send first as their version probe.
pub const SERVER_DISCOVER: &str = "server/discover";

/// A body the gateway can judge.
#[derive(Clone, Debug, PartialEq)]
pub enum Body<'a> {
    /// One request: it expects exactly one response with its id.
    Request(Request<'a>),
    /// A request without an id: the server answers `202 Accepted`.
    Notification { method: Cow<'a, str> },
    /// The client's answer to a request of the server (`result` or `error`, no `method`):
    /// it executes nothing on the server.
    Response,
    /// A JSON-RPC batch (2025-03-26 only); its elements, none of them a batch.
    Batch(Vec<Body<'a>>),
}

/// The fields of a request the gateway acts on.
#[derive(Clone, Debug, PartialEq)]
pub struct Request<'a> {
    pub method: Cow<'a, str>,
    pub id: RawId,
    /// `params.name` when it is a string (tools/call, prompts/get).
    pub params_name: Option<Cow<'a, str>>,
    /// That string as it is written in the body, quotes and escapes included: a slice of the
    /// body, so the aggregate endpoint can replace exactly it.
    pub params_name_raw: Option<&'a str>,
    /// `params.uri` when it is a string (resources/read, resources/subscribe, …).
    pub params_uri: Option<Cow<'a, str>>,
    /// That string as it is written in the body (see `params_name_raw`).
    pub params_uri_raw: Option<&'a str>,
    /// `params.ref` (completion/complete) when it is an object, as written in the body: read
    /// by [`completion_ref`] only for that method, so other requests pay nothing for it.
    pub params_ref_raw: Option<&'a str>,
}

/// What a `completion/complete` completes: a prompt by name or a resource (template) by URI,
/// each as written in the body (a slice of it, quotes included) and as read.
#[derive(Debug, PartialEq)]
pub enum CompletionRef<'a> {
    Prompt { name: Cow<'a, str>, raw: &'a str },
    Resource { uri: Cow<'a, str>, raw: &'a str },
}

/// `params.ref` of a `completion/complete` (`{"type": "ref/prompt", "name": …}` or
/// `{"type": "ref/resource", "uri": …}`); `None` for anything else.
pub fn completion_ref<'a>(raw: &'a str) -> Option<CompletionRef<'a>> {
    #[derive(Deserialize)]
    struct Ref<'a> {
        #[serde(rename = "type", borrow)]
        kind: Cow<'a, str>,
        #[serde(borrow, default)]
        name: Option<&'a RawValue>,
        #[serde(borrow, default)]
        uri: Option<&'a RawValue>,
    }
    let r: Ref<'_> = serde_json::from_str(raw).ok()?;
    let string = |v: Option<&'a RawValue>| -> Option<(Cow<'a, str>, &'a str)> {
        let raw = v?.get();
        let value: Cow<'a, str> = serde_json::from_str(raw).ok()?;
        Some((value, raw))
    };
    match r.kind.as_ref() {
        "ref/prompt" => string(r.name).map(|(name, raw)| CompletionRef::Prompt { name, raw }),
        "ref/resource" => string(r.uri).map(|(uri, raw)| CompletionRef::Resource { uri, raw }),
        _ => None,
    }
}

/// The tool a `tools/call` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolName<'b> {
    /// Matches the MCP tool-name rule: breakers are keyed by it.
    Valid(&'b str),
    /// Breaks the rule: no registered tool has such a name.
    Invalid(&'b str),
    /// No `params.name`, or not a string.
    Absent,
}

impl Request<'_> {
    /// The tool this request calls; `None` unless the method is `tools/call`.
    pub fn tool(&self) -> Option<ToolName<'_>> {
        if self.method != TOOLS_CALL {
            return None;
        }
        Some(match self.params_name.as_deref() {
            None => ToolName::Absent,
            Some(name) if is_valid_tool_name(name) => ToolName::Valid(name),
            Some(name) => ToolName::Invalid(name),
        })
    }
}

pub fn is_valid_tool_name(name: &str) -> bool {
    // Valid names are ASCII, so a longer byte string is invalid; checking first keeps
    // validate_name from copying a huge hostile name into its error.
    name.len() <= toolgate_model::MAX_NAME_LEN
        && toolgate_model::validate_name("tool", name).is_ok()
}

/// Why a body is refused. Closed, so no text of the client's is ever echoed back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not JSON (or JSON with `NaN`, `Infinity`, comments, a BOM, trailing text); 1-based.
    NotJson { line: usize, column: usize },
    /// The body is empty.
    Empty,
    /// A field the gateway reads appears twice (`params.name`: `"params.name"`).
    DuplicateKey(&'static str),
    /// Neither an object nor an array.
    NotAnObject,
    /// `jsonrpc` is missing or not `"2.0"`.
    NotJsonRpc2,
    /// `method` is present but not a string.
    MethodNotString,
    /// `id` is present but neither a string nor an integer (`null`, `1.5`, `true`, …).
    BadId,
    /// `params` is present but neither an object nor `null`.
    ParamsNotObject,
    /// An object that is neither a request, a notification nor a response.
    NotAMessage,
    /// An empty batch, or a batch inside a batch.
    BadBatch,
    /// A batch in a protocol revision without batches (2025-06-18 on).
    BatchNotAllowed,
    /// A notification of a method that is only ever a request (`tools/call`).
    RequestWithoutId,
    /// A `tools/call` without a string `params.name`.
    ToolNameAbsent,
    /// A `tools/call` whose name breaks MCP's tool-name rule.
    ToolNameInvalid,
    /// A request body whose content is compressed (`Content-Encoding`).
    Encoded,
    /// An HTTP method MCP's transport does not use (`PUT`, `PATCH`, `OPTIONS`, ...): a server
    /// that read its body like a POST's would run a call nobody judged.
    MethodNotAllowed,
    /// A `GET` (the server's stream) or `DELETE` (the session's end) with a body.
    BodyNotAllowed,
    /// A header the gateway reads (or owns) whose value is not UTF-8 text: the gateway cannot
    /// read what a server might.
    HeaderNotText(&'static str),
}

impl Refusal {
    /// The JSON-RPC error code of the refusal.
    pub fn code(self) -> i64 {
        match self {
            Refusal::NotJson { .. } | Refusal::Empty | Refusal::Encoded => PARSE_ERROR,
            Refusal::ToolNameAbsent | Refusal::ToolNameInvalid => INVALID_PARAMS,
            _ => INVALID_REQUEST,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotJson { line, column } => write!(
                f,
                "The request body is not valid JSON (line {line}, column {column}). \
                 JSON has no NaN or Infinity, comments, trailing commas or byte-order mark."
            ),
            Refusal::Empty => f.write_str("The request body is empty; send one JSON-RPC message."),
            Refusal::DuplicateKey(key) => write!(
                f,
                "The request has the member `{key}` twice; readers disagree on which one counts, \
                 so the gateway accepts each member once."
            ),
            Refusal::NotAnObject => {
                f.write_str("The request body must be a JSON-RPC message (a JSON object).")
            }
            Refusal::NotJsonRpc2 => f.write_str("The request must carry \"jsonrpc\": \"2.0\"."),
            Refusal::MethodNotString => f.write_str("The request's `method` must be a string."),
            Refusal::BadId => f.write_str("The request's `id` must be a string or an integer."),
            Refusal::ParamsNotObject => f.write_str("The request's `params` must be an object."),
            Refusal::NotAMessage => f.write_str(
                "The body is neither a request, a notification nor a response: it needs a \
                 `method`, or an `id` with a `result` or an `error`.",
            ),
            Refusal::BadBatch => {
                f.write_str("A batch must be a non-empty array of JSON-RPC messages.")
            }
            Refusal::BatchNotAllowed => f.write_str(
                "JSON-RPC batches were removed from MCP in revision 2025-06-18; send one \
                 message per request.",
            ),
            Refusal::RequestWithoutId => {
                f.write_str("`tools/call` is a request and needs an `id`.")
            }
            Refusal::ToolNameAbsent => f.write_str("`tools/call` needs `params.name`, a string."),
            Refusal::ToolNameInvalid => f.write_str(
                "The tool name breaks MCP's tool-name rule (1 to 128 of A-Z, a-z, 0-9, `_`, \
                 `-`, `.`); no tool behind this gateway has such a name.",
            ),
            Refusal::Encoded => f.write_str(
                "The gateway does not accept compressed request bodies (Content-Encoding); \
                 send the JSON as is.",
            ),
            Refusal::MethodNotAllowed => f.write_str(
                "An MCP endpoint takes POST (messages), GET (the server's stream) and DELETE \
                 (ending a session); the gateway refuses other HTTP methods.",
            ),
            Refusal::BodyNotAllowed => f.write_str(
                "A GET or DELETE on an MCP endpoint carries no body; send JSON-RPC messages \
                 with POST.",
            ),
            Refusal::HeaderNotText(name) => write!(
                f,
                "The header `{name}` is not UTF-8 text; the gateway reads it, so it must be."
            ),
        }
    }
}

/// Whether arrays and objects in `body` nest deeper than `limit`. One pass over the bytes;
/// brackets inside strings (escapes included) do not count, and it stops at the first level
/// too deep.
pub fn nests_deeper_than(body: &[u8], limit: u64) -> bool {
    let mut depth = 0u64;
    let mut i = 0;
    while let Some(&b) = body.get(i) {
        i += 1;
        match b {
            b'"' => {
                // A string is skipped to its closing quote in a vectorised search (most of a
                // call's bytes are in its arguments' strings): only `"` and `\` stop it.
                loop {
                    let Some(at) = body
                        .get(i..)
                        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
                    else {
                        // Unterminated: nothing after it nests.
                        return false;
                    };
                    i += at;
                    if body[i] == b'"' {
                        i += 1;
                        break;
                    }
                    // An escape: the next byte is never the string's end.
                    i += 2;
                }
            }
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// Reads a request body; `Err` says why the gateway cannot judge it. Batches are returned as
/// such, whatever the protocol revision: the caller decides whether it accepts them.
pub fn read_body(body: &[u8]) -> Result<Body<'_>, Refusal> {
    match first_non_ws(body) {
        None => Err(Refusal::Empty),
        Some(b'{') => read_message(body),
        Some(b'[') => {
            let elements: Vec<&RawValue> =
                serde_json::from_slice(body).map_err(|e| not_json(&e))?;
            if elements.is_empty() {
                return Err(Refusal::BadBatch);
            }
            let mut out = Vec::with_capacity(elements.len());
            for element in elements {
                let raw = element.get().as_bytes();
                if first_non_ws(raw) != Some(b'{') {
                    return Err(Refusal::BadBatch);
                }
                out.push(read_message(raw)?);
            }
            Ok(Body::Batch(out))
        }
        // Valid JSON that is no message is refused as such; anything else is not JSON.
        Some(_) => match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => Err(Refusal::NotAnObject),
            Err(e) => Err(not_json(&e)),
        },
    }
}

fn not_json(e: &serde_json::Error) -> Refusal {
    Refusal::NotJson {
        line: e.line(),
        column: e.column(),
    }
}

/// One JSON object: a request, a notification or a response.
fn read_message(body: &[u8]) -> Result<Body<'_>, Refusal> {
    let refusal = Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(body);
    let envelope = EnvelopeSeed(&refusal).deserialize(&mut de);
    let envelope = match (envelope, refusal.get()) {
        (_, Some(refusal)) => return Err(refusal),
        (Ok(envelope), None) => envelope,
        (Err(e), None) => return Err(not_json(&e)),
    };
    de.end().map_err(|e| not_json(&e))?;
    if !envelope.jsonrpc_2 {
        return Err(Refusal::NotJsonRpc2);
    }
    let method = match envelope.method {
        None => None,
        Some(MaybeStr::Str(method)) => Some(method),
        Some(MaybeStr::NotStr) => return Err(Refusal::MethodNotString),
    };
    let id = envelope.id.map(request_id);
    match (method, id) {
        (Some(method), Some(id)) => {
            let id = id.ok_or(Refusal::BadId)?;
            let params = envelope.params.unwrap_or_default();
            Ok(Body::Request(Request {
                method,
                id,
                params_name: params.name,
                params_name_raw: params.name_raw,
                params_uri: params.uri,
                params_uri_raw: params.uri_raw,
                params_ref_raw: params.ref_raw,
            }))
        }
        (Some(method), None) => {
            if method == TOOLS_CALL {
                return Err(Refusal::RequestWithoutId);
            }
            Ok(Body::Notification { method })
        }
        // `"id": null` is how a client reports a message of the server it could not parse.
        (None, Some(_)) | (None, None) if envelope.answers => Ok(Body::Response),
        (None, _) => Err(Refusal::NotAMessage),
    }
}

/// The id of a request: a string, or an integer. JSON-RPC allows fractions and both official
/// SDKs do not (the Python SDK reads `"id": 2.0` as no id, hence as a notification), so the
/// gateway refuses what they would read differently.
fn request_id(raw: &RawValue) -> Option<RawId> {
    let text = raw.get();
    let digits = text.strip_prefix('-').unwrap_or(text);
    let integer = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    if text.starts_with('"') || integer {
        RawId::from_raw(raw)
    } else {
        None
    }
}

struct Envelope<'a> {
    jsonrpc_2: bool,
    id: Option<&'a RawValue>,
    method: Option<MaybeStr<'a>>,
    params: Option<Params<'a>>,
    /// A `result` or an `error` member is present (whatever its value).
    answers: bool,
}

/// Deserializes the envelope, leaving the precise reason of a refusal in the cell (serde's own
/// error only carries text).
struct EnvelopeSeed<'c>(&'c Cell<Option<Refusal>>);

impl<'de, 'c> DeserializeSeed<'de> for EnvelopeSeed<'c> {
    type Value = Envelope<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(EnvelopeVisitor(self.0))
    }
}

struct EnvelopeVisitor<'c>(&'c Cell<Option<Refusal>>);

impl<'c> EnvelopeVisitor<'c> {
    fn refuse<E: de::Error>(&self, refusal: Refusal) -> E {
        self.0.set(Some(refusal));
        E::custom(format_args!("{refusal:?}"))
    }
}

impl<'de, 'c> Visitor<'de> for EnvelopeVisitor<'c> {
    type Value = Envelope<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON-RPC message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut jsonrpc: Option<bool> = None;
        let mut id: Option<&'de RawValue> = None;
        let mut method: Option<MaybeStr<'de>> = None;
        let mut params: Option<Option<Params<'de>>> = None;
        let (mut result, mut error) = (false, false);
        while let Some(key) = map.next_key::<Str<'de>>()? {
            match key.0.as_ref() {
                "jsonrpc" => {
                    if jsonrpc.is_some() {
                        return Err(self.refuse(Refusal::DuplicateKey("jsonrpc")));
                    }
                    let v = map.next_value::<MaybeStr<'de>>()?;
                    jsonrpc = Some(matches!(v, MaybeStr::Str(s) if s == "2.0"));
                }
                "id" => {
                    if id.is_some() {
                        return Err(self.refuse(Refusal::DuplicateKey("id")));
                    }
                    id = Some(map.next_value::<&'de RawValue>()?);
                }
                "method" => {
                    if method.is_some() {
                        return Err(self.refuse(Refusal::DuplicateKey("method")));
                    }
                    method = Some(map.next_value::<MaybeStr<'de>>()?);
                }
                "params" => {
                    if params.is_some() {
                        return Err(self.refuse(Refusal::DuplicateKey("params")));
                    }
                    params = Some(map.next_value_seed(ParamsSeed(self.0))?);
                }
                "result" => {
                    if result {
                        return Err(self.refuse(Refusal::DuplicateKey("result")));
                    }
                    result = true;
                    map.next_value::<IgnoredAny>()?;
                }
                "error" => {
                    if error {
                        return Err(self.refuse(Refusal::DuplicateKey("error")));
                    }
                    error = true;
                    map.next_value::<IgnoredAny>()?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Envelope {
            jsonrpc_2: jsonrpc.unwrap_or(false),
            id,
            method,
            params: params.flatten(),
            answers: result || error,
        })
    }
}

/// `params`: an object (or `null`, read as absent). serde's derived structs would also accept
/// an array and fill fields by position, which would make `["x"]` look like a call of tool `x`.
#[derive(Default)]
struct Params<'a> {
    name: Option<Cow<'a, str>>,
    name_raw: Option<&'a str>,
    uri: Option<Cow<'a, str>>,
    uri_raw: Option<&'a str>,
    ref_raw: Option<&'a str>,
}

struct ParamsSeed<'c>(&'c Cell<Option<Refusal>>);

impl<'de, 'c> DeserializeSeed<'de> for ParamsSeed<'c> {
    type Value = Option<Params<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ParamsVisitor(self.0))
    }
}

struct ParamsVisitor<'c>(&'c Cell<Option<Refusal>>);

impl<'c> ParamsVisitor<'c> {
    fn refuse<E: de::Error>(&self, refusal: Refusal) -> E {
        self.0.set(Some(refusal));
        E::custom(format_args!("{refusal:?}"))
    }

    fn not_object<E: de::Error>(&self) -> Result<Option<Params<'static>>, E> {
        Err(self.refuse(Refusal::ParamsNotObject))
    }
}

impl<'de, 'c> Visitor<'de> for ParamsVisitor<'c> {
    type Value = Option<Params<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a params object")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut params = Params::default();
        let (mut seen_name, mut seen_uri, mut seen_ref) = (false, false, false);
        while let Some(key) = map.next_key::<Str<'de>>()? {
            match key.0.as_ref() {
                "name" => {
                    if seen_name {
                        return Err(self.refuse(Refusal::DuplicateKey("params.name")));
                    }
                    seen_name = true;
                    // Taken raw (its place in the body), then read as every other string is.
                    // A value that is no string is skipped without being read again.
                    let raw = map.next_value::<&'de RawValue>()?.get();
                    if raw.starts_with('"') {
                        let value = serde_json::from_str::<MaybeStr<'de>>(raw)
                            .map_err(|e| de::Error::custom(format_args!("params.name: {e}")))?;
                        params.name = value.into_str();
                        params.name_raw = Some(raw);
                    }
                }
                "uri" => {
                    if seen_uri {
                        return Err(self.refuse(Refusal::DuplicateKey("params.uri")));
                    }
                    seen_uri = true;
                    let raw = map.next_value::<&'de RawValue>()?.get();
                    if raw.starts_with('"') {
                        let value = serde_json::from_str::<MaybeStr<'de>>(raw)
                            .map_err(|e| de::Error::custom(format_args!("params.uri: {e}")))?;
                        params.uri = value.into_str();
                        params.uri_raw = Some(raw);
                    }
                }
                "ref" => {
                    if seen_ref {
                        return Err(self.refuse(Refusal::DuplicateKey("params.ref")));
                    }
                    seen_ref = true;
                    let raw = map.next_value::<&'de RawValue>()?.get();
                    params.ref_raw = raw.starts_with('{').then_some(raw);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(params))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.not_object()
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        self.not_object()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        self.not_object()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        self.not_object()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        self.not_object()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        self.not_object()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: &str) -> Request<'_> {
        match read_body(body.as_bytes()) {
            Ok(Body::Request(r)) => r,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    fn refusal(body: &[u8]) -> Refusal {
        match read_body(body) {
            Err(r) => r,
            Ok(b) => panic!("{:?} was read as {b:?}", String::from_utf8_lossy(body)),
        }
    }

    #[test]
    fn a_completion_names_its_prompt_or_resource_exactly_as_written() {
        let body = r#"{"jsonrpc":"2.0","id":3,"method":"completion/complete","params":{"ref":{"type":"ref/prompt","n\u0061me":"gr\u0065et"},"argument":{"name":"x","value":"y"}}}"#;
        let r = request(body);
        let raw = r.params_ref_raw.expect("the ref, raw");
        match completion_ref(raw) {
            Some(CompletionRef::Prompt { name, raw }) => {
                assert_eq!(name, "greet");
                assert_eq!(raw, r#""gr\u0065et""#, "the string as written, to replace");
            }
            other => panic!("{other:?}"),
        }
        let uri = r#"{"type":"ref/resource","uri":"demo://t/{id}"}"#;
        assert!(matches!(
            completion_ref(uri),
            Some(CompletionRef::Resource { uri, .. }) if uri == "demo://t/{id}"
        ));
        // Anything else is no reference: a duplicate member, a name that is no string, an
        // unknown type.
        for bad in [
            r#"{"type":"ref/prompt","name":"a","name":"b"}"#,
            r#"{"type":"ref/prompt","name":7}"#,
            r#"{"type":"ref/tool","name":"a"}"#,
            r#"{"name":"a"}"#,
        ] {
            assert_eq!(completion_ref(bad), None, "{bad}");
        }
        // `ref` twice is refused like any member the gateway reads.
        assert_eq!(
            refusal(br#"{"jsonrpc":"2.0","id":1,"method":"completion/complete","params":{"ref":{},"ref":{}}}"#),
            Refusal::DuplicateKey("params.ref")
        );
    }

    #[test]
    fn tools_call_yields_method_id_and_tool() {
        let r = request(
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_order","arguments":{"name":"not this","x":[1,2,{"y":null}]}}}"#,
        );
        assert_eq!(r.method, "tools/call");
        assert_eq!(r.id.as_json(), "7");
        assert_eq!(r.tool(), Some(ToolName::Valid("write_order")));
    }

    #[test]
    fn method_and_name_without_escapes_are_borrowed_from_the_body() {
        let r = request(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"}}"#);
        assert!(matches!(r.method, Cow::Borrowed(_)));
        assert!(matches!(r.params_name, Some(Cow::Borrowed(_))));
    }

    #[test]
    fn escaped_keys_and_values_are_read_as_every_json_reader_reads_them() {
        let r = request(
            r#"{"js\u006fnrpc":"2.0","id":1,"m\u0065thod":"tools\/call","params":{"n\u0061me":"get_\u0077eather"}}"#,
        );
        assert_eq!(r.tool(), Some(ToolName::Valid("get_weather")));
        // An escaped spelling of a key is the same key: twice is a duplicate.
        assert_eq!(
            refusal(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","n\u0061me":"b"}}"#),
            Refusal::DuplicateKey("params.name")
        );
    }

    #[test]
    fn the_raw_name_is_the_slice_of_the_body_it_was_read_from() {
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{"name":"no"},"name" : "get_\u0077eather"}}"#;
        let r = request(body);
        assert_eq!(r.tool(), Some(ToolName::Valid("get_weather")));
        let raw = r.params_name_raw.expect("a string name");
        assert_eq!(raw, r#""get_\u0077eather""#);
        let at = raw.as_ptr() as usize - body.as_ptr() as usize;
        assert_eq!(&body[at..at + raw.len()], raw);
        let r = request(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":7}}"#);
        assert_eq!((r.params_name, r.params_name_raw), (None, None));
        assert!(matches!(
            read_body(
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a\ud800"}}"#
            ),
            Err(Refusal::NotJson { .. })
        ));
    }

    #[test]
    fn string_id_keeps_its_escapes_byte_for_byte() {
        let r = request(r#"{"jsonrpc":"2.0","id": "a\"b\\c\u00e9\n" ,"method":"ping"}"#);
        assert_eq!(r.id.as_json(), r#""a\"b\\c\u00e9\n""#);
        assert_eq!(r.tool(), None);
    }

    #[test]
    fn integer_ids_are_kept_raw_and_other_ids_are_refused() {
        for text in ["0", "-1", "12345678901234567890123"] {
            let body = format!(r#"{{"jsonrpc":"2.0","id":{text},"method":"ping"}}"#);
            assert_eq!(request(&body).id.as_json(), text);
        }
        // Both official SDKs take only strings and integers; the Python SDK reads `2.0` as no
        // id at all, making the request a notification it never answers.
        for idv in ["null", "true", "[1]", "{}", "1.5", "2.0", "1e3", "-0.0"] {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":{idv},"method":"tools/call","params":{{"name":"a"}}}}"#
            );
            assert_eq!(refusal(body.as_bytes()), Refusal::BadId, "{idv}");
        }
    }

    #[test]
    fn notifications_responses_and_batches_are_told_apart() {
        assert_eq!(
            read_body(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Body::Notification {
                method: Cow::Borrowed("notifications/initialized")
            })
        );
        for response in [
            r#"{"jsonrpc":"2.0","id":5,"result":{"content":[]}}"#,
            r#"{"jsonrpc":"2.0","id":"s-1","error":{"code":-1,"message":"no"}}"#,
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}"#,
        ] {
            assert_eq!(
                read_body(response.as_bytes()),
                Ok(Body::Response),
                "{response}"
            );
        }
        let batch =
            br#" [{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","method":"x"}]"#;
        let Ok(Body::Batch(elements)) = read_body(batch) else {
            panic!("not a batch")
        };
        assert_eq!(elements.len(), 2);
        assert!(matches!(elements[0], Body::Request(_)));
        assert!(matches!(elements[1], Body::Notification { .. }));
        // A method makes a request, whatever else the object carries (as the SDKs read it).
        let r = request(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"},"result":{}}"#,
        );
        assert_eq!(r.tool(), Some(ToolName::Valid("a")));
    }

    #[test]
    fn what_readers_disagree_on_is_refused_with_its_reason() {
        let cases: &[(&[u8], Refusal)] = &[
            (b"", Refusal::Empty),
            (b"  \r\n", Refusal::Empty),
            (b"null", Refusal::NotAnObject),
            (b"42", Refusal::NotAnObject),
            (b"\"tools/call\"", Refusal::NotAnObject),
            (b"{", Refusal::NotJson { line: 1, column: 1 }),
            (b"{}", Refusal::NotJsonRpc2),
            (br#"{"jsonrpc":"1.0","id":1,"method":"a"}"#, Refusal::NotJsonRpc2),
            (br#"{"id":1,"method":"a"}"#, Refusal::NotJsonRpc2),
            (br#"{"jsonrpc":"2.0","id":1}"#, Refusal::NotAMessage),
            (br#"{"jsonrpc":"2.0","id":1,"method":5}"#, Refusal::MethodNotString),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"a"} trailing"#,
                Refusal::NotJson { line: 1, column: 39 },
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call"}"#,
                Refusal::DuplicateKey("method"),
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"id":2,"method":"a"}"#,
                Refusal::DuplicateKey("id"),
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order"},"params":{"name":"write_order"}}"#,
                Refusal::DuplicateKey("params"),
            ),
            (
                br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"read_order","name":"write_order","arguments":{}}}"#,
                Refusal::DuplicateKey("params.name"),
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":["write_order"]}"#,
                Refusal::ParamsNotObject,
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":"write_order"}"#,
                Refusal::ParamsNotObject,
            ),
            (
                br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"write_order"}}"#,
                Refusal::RequestWithoutId,
            ),
            (b"[]", Refusal::BadBatch),
            (b"[[]]", Refusal::BadBatch),
            (br#"[{"jsonrpc":"2.0","id":1,"method":"a"},5]"#, Refusal::BadBatch),
            (
                br#"[{"jsonrpc":"2.0","id":1,"method":"a","method":"b"}]"#,
                Refusal::DuplicateKey("method"),
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(
                refusal(body),
                *expected,
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn non_finite_numbers_anywhere_are_not_json() {
        for number in ["NaN", "Infinity", "-Infinity", "+1", "0x10", ".5", "1."] {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{{"name":"write_order","arguments":{{"x":{number}}}}}}}"#
            );
            assert!(
                matches!(refusal(body.as_bytes()), Refusal::NotJson { .. }),
                "{number}"
            );
        }
        for body in [
            &b"\xef\xbb\xbf{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"}"[..],
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xff\"}",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\\ud800\"}",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\tb\"}",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\",}",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\" /* c */}",
            b"{'jsonrpc':'2.0','id':1,'method':'a'}",
        ] {
            assert!(
                matches!(refusal(body), Refusal::NotJson { .. }),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn invalid_and_absent_tool_names_are_reported_as_such() {
        let long = "a".repeat(129);
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{long}"}}}}"#
        );
        assert_eq!(
            request(&body).tool(),
            Some(ToolName::Invalid(long.as_str()))
        );
        let call =
            |params: &str| format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call"{params}}}"#);
        let r = call(r#","params":{"name":"a b"}"#);
        assert_eq!(request(&r).tool(), Some(ToolName::Invalid("a b")));
        let r = call(r#","params":{"name":""}"#);
        assert_eq!(request(&r).tool(), Some(ToolName::Invalid("")));
        for absent in [r#","params":{"name":7}"#, "", r#","params":null"#] {
            let r = call(absent);
            assert_eq!(request(&r).tool(), Some(ToolName::Absent), "{absent}");
        }
        let max = "a".repeat(128);
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{max}"}}}}"#
        );
        assert_eq!(request(&body).tool(), Some(ToolName::Valid(max.as_str())));
    }

    #[test]
    fn other_methods_may_carry_names_of_any_type() {
        let r = request(
            r#"{"jsonrpc":"2.0","id":1,"method":"x/custom","params":{"name":{"deep":[1]},"uri":3}}"#,
        );
        assert_eq!(r.params_name, None);
        assert_eq!(r.params_uri, None);
        assert_eq!(r.tool(), None);
    }

    #[test]
    fn refusals_have_json_rpc_codes_and_never_echo_the_body() {
        assert_eq!(Refusal::NotJson { line: 1, column: 2 }.code(), PARSE_ERROR);
        assert_eq!(Refusal::DuplicateKey("method").code(), INVALID_REQUEST);
        assert_eq!(Refusal::ToolNameInvalid.code(), INVALID_PARAMS);
        let text = Refusal::DuplicateKey("params.name").to_string();
        assert!(text.contains("`params.name` twice"), "{text}");
    }

    #[test]
    fn deeply_nested_input_neither_overflows_the_stack_nor_confuses_the_reader() {
        let (open, close) = ("[".repeat(100_000), "]".repeat(100_000));
        // Skipped values (arguments) are walked without recursion: the request stands.
        for body in [
            format!(r#"{{"jsonrpc":"2.0","id":1,"method":"a","params":{{"x":{open}{close}}}}}"#),
            format!(r#"{{"jsonrpc":"2.0","id":1,"method":"a","params":{{"name":{open}{close}}}}}"#),
        ] {
            assert!(matches!(read_body(body.as_bytes()), Ok(Body::Request(_))));
        }
        let body = format!("{open}{close}");
        assert!(read_body(body.as_bytes()).is_err());
    }

    #[test]
    fn depth_counts_arrays_and_objects_but_not_brackets_in_strings() {
        let body = br#"{"a":[[{"b":1}]]}"#;
        assert!(nests_deeper_than(body, 3));
        assert!(!nests_deeper_than(body, 4));
        assert!(!nests_deeper_than(br#"{"a":"[[[[[[{{{{"}"#, 1));
        assert!(!nests_deeper_than(br#"{"a":"\"[[[[\\"}"#, 1));
        assert!(
            nests_deeper_than(br#"{"a":"\\",[[1]]}"#, 2),
            "an escaped backslash ends"
        );
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(nests_deeper_than(deep.as_bytes(), 64));
        assert!(!nests_deeper_than(b"", 1));
    }
}
