//! Reading JSON-RPC requests and responses on Envoy's per-request path.
//!
//! Only the fields the filter needs are read (`method`, `id`, `params.name`, `params.uri`;
//! `result.isError`, `error.code`), borrowed from the body wherever the JSON has no escapes.
//! Everything else, tool arguments and results included, is skipped without being built, because
//! a full `serde_json::Value` of every body would cost an allocation per JSON node on every call.
//!
//! Whatever cannot be read is never an error to the caller: a body the filter does not understand
//! goes to the server unjudged, and the server answers it as it would without the gateway.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// `HeaderMismatch` (2026-07-28): the HTTP headers do not match the request body.
pub const HEADER_MISMATCH: i64 = -32020;

/// Request id exactly as the client sent it: the raw JSON text of a string or a number.
///
/// Kept raw so that a synthesized reply echoes it byte for byte; a client that matches responses
/// by re-serialized id (`1` vs `1.0`, `"é"` vs `"\u00e9"`) would otherwise lose the reply.
/// Equality (`==`, [`RawId::matches`]) is JSON-RPC equality, not byte equality: a server that
/// parsed and re-serialized the id still answers the same request.
#[derive(Clone, Debug)]
pub struct RawId(Box<str>);

#[derive(Clone, Copy, PartialEq, Eq)]
enum IdKind {
    Str,
    Num,
}

fn id_kind(raw: &str) -> Option<IdKind> {
    match raw.as_bytes().first()? {
        b'"' => Some(IdKind::Str),
        b'-' | b'0'..=b'9' => Some(IdKind::Num),
        // MCP forbids null ids, and objects, arrays and booleans are not ids in JSON-RPC.
        _ => None,
    }
}

impl RawId {
    /// Takes `text` as the JSON text of an id; `None` unless it is one JSON string or number.
    pub fn from_json(text: &str) -> Option<RawId> {
        let raw: &RawValue = serde_json::from_str(text).ok()?;
        RawId::from_raw(raw)
    }

    fn from_raw(raw: &RawValue) -> Option<RawId> {
        let text = raw.get();
        id_kind(text)?;
        Some(RawId(text.into()))
    }

    /// The id's JSON text as the client sent it, ready to be written into a reply.
    pub fn as_json(&self) -> &str {
        &self.0
    }

    /// Whether the JSON text `other` (an id from a response) names the same request.
    pub fn matches(&self, other: &str) -> bool {
        // Fast path: servers almost always echo the id unchanged.
        if self.0.as_ref() == other {
            return true;
        }
        let (Some(mine), Some(theirs)) = (id_kind(&self.0), id_kind(other)) else {
            return false;
        };
        match (mine, theirs) {
            (IdKind::Str, IdKind::Str) => {
                let a: Result<Cow<'_, str>, _> = serde_json::from_str(&self.0);
                let b: Result<Cow<'_, str>, _> = serde_json::from_str(other);
                matches!((a, b), (Ok(a), Ok(b)) if a == b)
            }
            (IdKind::Num, IdKind::Num) => numbers_equal(&self.0, other),
            _ => false,
        }
    }
}

impl PartialEq for RawId {
    fn eq(&self, other: &Self) -> bool {
        self.matches(&other.0)
    }
}

impl Eq for RawId {}

impl fmt::Display for RawId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Compares two JSON numbers by value: integers exactly (ids beyond 2^53 exist), others as f64.
fn numbers_equal(a: &str, b: &str) -> bool {
    fn as_int(s: &str) -> Option<i128> {
        if s.bytes().any(|c| matches!(c, b'.' | b'e' | b'E')) {
            return None;
        }
        s.parse().ok()
    }
    if let (Some(x), Some(y)) = (as_int(a), as_int(b)) {
        return x == y;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// What a request body is, as far as the breaker is concerned.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestInfo<'a> {
    /// One JSON-RPC request: it expects exactly one response with its id.
    Single(Request<'a>),
    /// A request without an id: the server answers `202 Accepted`, there is nothing to judge.
    Notification { method: Cow<'a, str> },
    /// A JSON array (2025-03-26 batches): passed through and never judged, because one HTTP
    /// response then carries the outcomes of several tools.
    Batch,
    /// Not JSON, not an object, no string `method`, or an id that is neither string nor number:
    /// passed to the server unjudged, which answers it with its own JSON-RPC error.
    Malformed,
}

/// The fields of a single request the filter acts on.
#[derive(Clone, Debug, PartialEq)]
pub struct Request<'a> {
    pub method: Cow<'a, str>,
    pub id: RawId,
    /// `params.name` when it is a string (tools/call, prompts/get).
    pub params_name: Option<Cow<'a, str>>,
    /// `params.uri` when it is a string (resources/read, resources/subscribe, …).
    pub params_uri: Option<Cow<'a, str>>,
}

/// The tool a `tools/call` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolName<'b> {
    /// Matches the MCP tool-name rule: breakers are keyed by it.
    Valid(&'b str),
    /// Breaks the rule: not counted against any breaker, since a client could otherwise create
    /// breakers (shared-data keys) at will with names that no server has.
    Invalid(&'b str),
    /// No `params.name`, or not a string.
    Absent,
}

pub const TOOLS_CALL: &str = "tools/call";

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

    /// The body value the `Mcp-Name` header must mirror, for the methods that require it.
    fn mcp_name(&self) -> NameRule<'_> {
        match self.method.as_ref() {
            "tools/call" | "prompts/get" => NameRule::Required(self.params_name.as_deref()),
            "resources/read" => NameRule::Required(self.params_uri.as_deref()),
            _ => NameRule::NotApplicable,
        }
    }
}

enum NameRule<'b> {
    Required(Option<&'b str>),
    NotApplicable,
}

fn is_valid_tool_name(name: &str) -> bool {
    // Valid names are ASCII, so a longer byte string is invalid; checking first keeps
    // validate_name from copying a huge hostile name into its error.
    name.len() <= toolgate_model::MAX_NAME_LEN
        && toolgate_model::validate_name("tool", name).is_ok()
}

/// Reads the fields the filter needs from a request body; never fails (see [`RequestInfo`]).
/// Whether arrays and objects in `body` nest deeper than `limit`. One pass over the bytes;
/// brackets inside strings (escapes included) do not count, and it stops at the first level
/// too deep.
pub fn nests_deeper_than(body: &[u8], limit: u64) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0u64, false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
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

pub fn parse_request(body: &[u8]) -> RequestInfo<'_> {
    match first_non_ws(body) {
        Some(b'{') => {}
        Some(b'[') => return RequestInfo::Batch,
        _ => return RequestInfo::Malformed,
    }
    let Ok(envelope) = serde_json::from_slice::<RequestEnvelope<'_>>(body) else {
        return RequestInfo::Malformed;
    };
    let Some(Str(method)) = envelope.method else {
        return RequestInfo::Malformed;
    };
    let Some(raw_id) = envelope.id else {
        return RequestInfo::Notification { method };
    };
    let Some(id) = RawId::from_raw(raw_id) else {
        return RequestInfo::Malformed;
    };
    let params = envelope.params.unwrap_or_default();
    RequestInfo::Single(Request {
        method,
        id,
        params_name: params.name,
        params_uri: params.uri,
    })
}

fn first_non_ws(body: &[u8]) -> Option<u8> {
    body.iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
}

#[derive(Deserialize)]
struct RequestEnvelope<'a> {
    #[serde(borrow, default)]
    method: Option<Str<'a>>,
    // Not `Option<&RawValue>` alone: `"id": null` must stay distinguishable from no id, since
    // a null id makes a malformed request, not a notification.
    #[serde(borrow, default, deserialize_with = "present_raw")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    params: Option<Params<'a>>,
}

fn present_raw<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

/// A string borrowed from the body when it has no escapes. serde's own `Cow<str>` impl always
/// copies, and `#[serde(borrow)]` only borrows a bare `Cow` field.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A string, or anything else skipped without being built: `params.name` of a method the
/// filter does not know may legitimately be of any type.
enum MaybeStr<'a> {
    Str(Cow<'a, str>),
    NotStr,
}

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Owned(v)))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeStr::NotStr)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeStr::NotStr)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'a> MaybeStr<'a> {
    fn into_str(self) -> Option<Cow<'a, str>> {
        match self {
            MaybeStr::Str(s) => Some(s),
            MaybeStr::NotStr => None,
        }
    }
}

/// `params`: only an object is read. serde's derived structs would also accept an array and
/// fill fields by position, which would make `["x"]` look like a call of tool `x`.
#[derive(Default)]
struct Params<'a> {
    name: Option<Cow<'a, str>>,
    uri: Option<Cow<'a, str>>,
}

#[derive(Clone, Copy)]
enum ParamsField {
    Name,
    Uri,
    Other,
}

impl<'de> Deserialize<'de> for ParamsField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ParamsField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(match v {
                    "name" => ParamsField::Name,
                    "uri" => ParamsField::Uri,
                    _ => ParamsField::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Params<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Params<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a params object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut params = Params::default();
                let (mut seen_name, mut seen_uri) = (false, false);
                while let Some(field) = map.next_key::<ParamsField>()? {
                    // A duplicate key is refused (the request becomes Malformed): servers
                    // disagree on which copy wins, so the breaker could judge one tool while
                    // the server runs another.
                    match field {
                        ParamsField::Name if seen_name => {
                            return Err(de::Error::duplicate_field("name"))
                        }
                        ParamsField::Uri if seen_uri => {
                            return Err(de::Error::duplicate_field("uri"))
                        }
                        ParamsField::Name => {
                            seen_name = true;
                            params.name = map.next_value::<MaybeStr<'de>>()?.into_str();
                        }
                        ParamsField::Uri => {
                            seen_uri = true;
                            params.uri = map.next_value::<MaybeStr<'de>>()?.into_str();
                        }
                        ParamsField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(params)
            }
        }
        d.deserialize_map(V)
    }
}

/// Outcome of comparing the 2026-07-28 `Mcp-Method` / `Mcp-Name` headers with the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderCheck {
    /// Headers present and equal to the body's values.
    Match,
    /// Headers and body disagree: answered with `HeaderMismatch`, never counted against a
    /// breaker (the client is at fault, not the tool).
    Mismatch(Mismatch),
    /// Neither header was sent (clients of versions before 2026-07-28).
    NoHeaders,
}

/// Which header rule a request broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// `Mcp-Name` was sent without `Mcp-Method`.
    MethodMissing,
    MethodDiffers,
    /// The method requires `Mcp-Name` (tools/call, prompts/get, resources/read) and it is absent.
    NameMissing,
    NameDiffers,
    /// `Mcp-Name` uses the `=?base64?…?=` form but is not valid Base64 of UTF-8 text.
    NameEncoding,
    /// Headers were sent but the body is not a single request or notification.
    BodyUnreadable,
}

impl Mismatch {
    /// A sentence for the JSON-RPC error: names the header, never echoes a value (header and
    /// body values are the client's and can be arbitrarily long).
    pub fn describe(self) -> &'static str {
        match self {
            Mismatch::MethodMissing => "Header mismatch: the Mcp-Method header is missing.",
            Mismatch::MethodDiffers => {
                "Header mismatch: the Mcp-Method header does not match the request body's method."
            }
            Mismatch::NameMissing => "Header mismatch: the Mcp-Name header is missing.",
            Mismatch::NameDiffers => {
                "Header mismatch: the Mcp-Name header does not match the request body."
            }
            Mismatch::NameEncoding => {
                "Header mismatch: the Mcp-Name header is not valid Base64-encoded UTF-8."
            }
            Mismatch::BodyUnreadable => {
                "Header mismatch: the request body is not a single JSON-RPC request."
            }
        }
    }
}

/// Checks the 2026-07-28 request-metadata headers against the body.
///
/// The breaker is keyed by what the body says (what the server executes); a header that says
/// something else would let a client be routed or counted as one tool while calling another.
pub fn check_headers(
    method_header: Option<&str>,
    name_header: Option<&str>,
    body: &RequestInfo<'_>,
) -> HeaderCheck {
    if method_header.is_none() && name_header.is_none() {
        return HeaderCheck::NoHeaders;
    }
    let (method, name_rule) = match body {
        RequestInfo::Single(request) => (request.method.as_ref(), request.mcp_name()),
        RequestInfo::Notification { method } => (method.as_ref(), NameRule::NotApplicable),
        RequestInfo::Batch | RequestInfo::Malformed => {
            return HeaderCheck::Mismatch(Mismatch::BodyUnreadable)
        }
    };
    match method_header {
        None => return HeaderCheck::Mismatch(Mismatch::MethodMissing),
        Some(header) if header != method => return HeaderCheck::Mismatch(Mismatch::MethodDiffers),
        Some(_) => {}
    }
    // An Mcp-Name on a method that does not mirror one is ignored, as intermediaries ignore
    // headers they have no rule for.
    if let NameRule::Required(expected) = name_rule {
        let sent = match name_header.map(decode_header_value) {
            None => None,
            Some(Some(value)) => Some(value),
            Some(None) => return HeaderCheck::Mismatch(Mismatch::NameEncoding),
        };
        match (sent.as_deref(), expected) {
            (None, None) => {}
            (None, Some(_)) => return HeaderCheck::Mismatch(Mismatch::NameMissing),
            (Some(sent), Some(expected)) if sent == expected => {}
            (Some(_), _) => return HeaderCheck::Mismatch(Mismatch::NameDiffers),
        }
    }
    HeaderCheck::Match
}

const B64_PREFIX: &str = "=?base64?";
const B64_SUFFIX: &str = "?=";

/// Decodes a header value that may use the `=?base64?{value}?=` sentinel form (2026-07-28
/// "Value Encoding"); `None` when the sentinel is there but its content is not Base64 of UTF-8.
pub fn decode_header_value(value: &str) -> Option<Cow<'_, str>> {
    let encoded = value
        .strip_prefix(B64_PREFIX)
        .and_then(|rest| rest.strip_suffix(B64_SUFFIX));
    match encoded {
        None => Some(Cow::Borrowed(value)),
        Some(encoded) => {
            let bytes = decode_base64(encoded.as_bytes())?;
            String::from_utf8(bytes).ok().map(Cow::Owned)
        }
    }
}

/// Standard-alphabet Base64 (RFC 4648 §4), padding optional. Small enough to keep a dependency
/// out of the wasm module.
fn decode_base64(input: &[u8]) -> Option<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let unpadded = match input {
        [rest @ .., b'=', b'='] | [rest @ .., b'='] => {
            if !input.len().is_multiple_of(4) {
                return None;
            }
            rest
        }
        _ => input,
    };
    if unpadded.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(unpadded.len() / 4 * 3 + 2);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in unpadded {
        acc = (acc << 6) | sextet(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// What a response body says about the request it answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseClass {
    /// A result; `is_error` is the tool's own `isError` (the tool answered, it may have failed).
    Result { is_error: bool },
    /// A JSON-RPC error other than `HeaderMismatch`.
    Error { code: i64 },
    /// Error `-32020`: the server judged the request's headers, not the tool.
    HeaderMismatch,
    /// Valid JSON but not the response to this request: another id, a notification, a
    /// server-to-client request, a batch. From [`crate::mcp::sse::SseScanner::finish`]: the
    /// stream ended without the response.
    Other,
    /// Not JSON, or a response of the wrong shape; from the SSE scanner also an event too large
    /// to hold.
    Unparseable,
}

/// Classifies a single JSON response body (`Content-Type: application/json`) for request `id`.
pub fn classify_response(body: &[u8], id: &RawId) -> ResponseClass {
    if first_non_ws(body) != Some(b'{') {
        // Arrays are batch responses and scalars are not responses; either way, not this
        // request's answer, as long as it is JSON at all.
        return match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => ResponseClass::Other,
            Err(_) => ResponseClass::Unparseable,
        };
    }
    let Ok(envelope) = serde_json::from_slice::<ResponseEnvelope<'_>>(body) else {
        return ResponseClass::Unparseable;
    };
    // A server-to-client request (2025 SSE streams) has its own id space and may reuse the
    // client's id: a `method` marks it as not a response whatever its id.
    if envelope.method.is_some() {
        return ResponseClass::Other;
    }
    match envelope.id {
        Some(theirs) if id.matches(theirs.get()) => {}
        _ => return ResponseClass::Other,
    }
    // JSON-RPC 1.0-style servers send `"result": null` next to an error: the error decides.
    match (envelope.error, envelope.result) {
        (
            Some(ErrorFields {
                code: HEADER_MISMATCH,
            }),
            _,
        ) => ResponseClass::HeaderMismatch,
        (Some(ErrorFields { code }), _) => ResponseClass::Error { code },
        (None, Some(ResultFields { is_error })) => ResponseClass::Result { is_error },
        (None, None) => ResponseClass::Unparseable,
    }
}

#[derive(Deserialize)]
struct ResponseEnvelope<'a> {
    #[serde(borrow, default, deserialize_with = "present_raw")]
    id: Option<&'a RawValue>,
    #[serde(default)]
    method: Option<IgnoredAny>,
    // `"result": null` is a (non-MCP) success, so presence is what counts, not non-nullness.
    #[serde(default, deserialize_with = "present_result")]
    result: Option<ResultFields>,
    #[serde(default)]
    error: Option<ErrorFields>,
}

fn present_result<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ResultFields>, D::Error> {
    ResultFields::deserialize(d).map(Some)
}

/// `result.isError`; any other result shape (JSON-RPC allows any value) is a plain success.
struct ResultFields {
    is_error: bool,
}

impl<'de> Deserialize<'de> for ResultFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const PLAIN: ResultFields = ResultFields { is_error: false };
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ResultFields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a result")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut is_error = None;
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    if key.0 == "isError" {
                        if is_error.is_some() {
                            return Err(de::Error::duplicate_field("isError"));
                        }
                        is_error = Some(map.next_value::<Option<bool>>()?.unwrap_or(false));
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(ResultFields {
                    is_error: is_error.unwrap_or(false),
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(PLAIN)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(PLAIN)
            }
        }
        d.deserialize_any(V)
    }
}

/// `error.code`; the error must be an object with an integer code to count as one.
struct ErrorFields {
    code: i64,
}

impl<'de> Deserialize<'de> for ErrorFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ErrorFields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an error object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut code = None;
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    if key.0 == "code" {
                        if code.is_some() {
                            return Err(de::Error::duplicate_field("code"));
                        }
                        code = Some(map.next_value::<i64>()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                let code = code.ok_or_else(|| de::Error::missing_field("code"))?;
                Ok(ErrorFields { code })
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod depth_tests {
    use super::nests_deeper_than;

    #[test]
    fn counts_arrays_and_objects_but_not_brackets_in_strings() {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> RawId {
        RawId::from_json(text).expect("test id")
    }

    fn single(body: &str) -> Request<'_> {
        match parse_request(body.as_bytes()) {
            RequestInfo::Single(r) => r,
            other => panic!("expected a single request, got {other:?}"),
        }
    }

    #[test]
    fn tools_call_yields_method_id_and_tool() {
        let r = single(
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_order","arguments":{"name":"not this","x":[1,2,{"y":null}]}}}"#,
        );
        assert_eq!(r.method, "tools/call");
        assert_eq!(r.id.as_json(), "7");
        assert_eq!(r.tool(), Some(ToolName::Valid("write_order")));
    }

    #[test]
    fn method_and_name_without_escapes_are_borrowed_from_the_body() {
        let r = single(r#"{"id":1,"method":"tools/call","params":{"name":"a"}}"#);
        assert!(matches!(r.method, Cow::Borrowed(_)));
        assert!(matches!(r.params_name, Some(Cow::Borrowed(_))));
    }

    #[test]
    fn escaped_strings_are_unescaped() {
        let r =
            single(r#"{"id":1,"method":"tools\/call","params":{"n\u0061me":"get_\u0077eather"}}"#);
        assert_eq!(r.tool(), Some(ToolName::Valid("get_weather")));
    }

    #[test]
    fn string_id_keeps_its_escapes_byte_for_byte() {
        let r = single(r#"{"id": "a\"b\\c\u00e9\n" ,"method":"ping"}"#);
        assert_eq!(r.id.as_json(), r#""a\"b\\c\u00e9\n""#);
        assert_eq!(r.tool(), None);
    }

    #[test]
    fn number_ids_are_kept_raw() {
        for text in ["0", "-1", "12345678901234567890123", "1.5", "1e3"] {
            let body = format!(r#"{{"id":{text},"method":"ping"}}"#);
            assert_eq!(single(&body).id.as_json(), text);
        }
    }

    #[test]
    fn null_or_structured_id_is_malformed_not_a_notification() {
        for idv in ["null", "true", "[1]", "{}"] {
            let body = format!(r#"{{"id":{idv},"method":"tools/call","params":{{"name":"a"}}}}"#);
            assert_eq!(
                parse_request(body.as_bytes()),
                RequestInfo::Malformed,
                "{idv}"
            );
        }
    }

    #[test]
    fn request_without_id_is_a_notification() {
        assert_eq!(
            parse_request(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            RequestInfo::Notification {
                method: Cow::Borrowed("notifications/initialized")
            }
        );
    }

    #[test]
    fn arrays_are_batches() {
        assert_eq!(
            parse_request(b" \n[{\"id\":1,\"method\":\"x\"}]"),
            RequestInfo::Batch
        );
    }

    #[test]
    fn non_requests_are_malformed() {
        for body in [
            &b""[..],
            b"   ",
            b"null",
            b"42",
            b"\"tools/call\"",
            b"{",
            b"{}",
            b"{\"id\":1}",
            b"{\"id\":1,\"method\":5}",
            b"{\"id\":1,\"method\":\"a\"} trailing",
            b"{\"id\":1,\"method\":\"a\",\"method\":\"b\"}",
            b"{\"id\":1,\"method\":\"tools/call\",\"params\":[\"write_order\"]}",
            b"{\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"a\",\"name\":\"b\"}}",
            b"\xef\xbb\xbf{\"id\":1,\"method\":\"a\"}",
            b"{\"id\":1,\"method\":\"\xff\"}",
        ] {
            assert_eq!(
                parse_request(body),
                RequestInfo::Malformed,
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn invalid_and_absent_tool_names_are_reported_as_such() {
        let long = "a".repeat(129);
        let body = format!(r#"{{"id":1,"method":"tools/call","params":{{"name":"{long}"}}}}"#);
        assert_eq!(single(&body).tool(), Some(ToolName::Invalid(long.as_str())));
        let r = single(r#"{"id":1,"method":"tools/call","params":{"name":"a b"}}"#);
        assert_eq!(r.tool(), Some(ToolName::Invalid("a b")));
        let r = single(r#"{"id":1,"method":"tools/call","params":{"name":""}}"#);
        assert_eq!(r.tool(), Some(ToolName::Invalid("")));
        let r = single(r#"{"id":1,"method":"tools/call","params":{"name":7}}"#);
        assert_eq!(r.tool(), Some(ToolName::Absent));
        let r = single(r#"{"id":1,"method":"tools/call"}"#);
        assert_eq!(r.tool(), Some(ToolName::Absent));
        let r = single(r#"{"id":1,"method":"tools/call","params":null}"#);
        assert_eq!(r.tool(), Some(ToolName::Absent));
        let max = "a".repeat(128);
        let body = format!(r#"{{"id":1,"method":"tools/call","params":{{"name":"{max}"}}}}"#);
        assert_eq!(single(&body).tool(), Some(ToolName::Valid(max.as_str())));
    }

    #[test]
    fn other_methods_may_carry_names_of_any_type() {
        let r = single(r#"{"id":1,"method":"x/custom","params":{"name":{"deep":[1]},"uri":3}}"#);
        assert_eq!(r.params_name, None);
        assert_eq!(r.params_uri, None);
        assert_eq!(r.tool(), None);
    }

    #[test]
    fn ids_compare_as_json_values() {
        assert!(id("1").matches("1"));
        assert!(id("1").matches("1.0"));
        assert!(id("100").matches("1e2"));
        assert!(id("12345678901234567890").matches("12345678901234567890"));
        assert!(!id("9007199254740993").matches("9007199254740992"));
        assert!(id(r#""é""#).matches(r#""\u00e9""#));
        assert!(!id("1").matches(r#""1""#));
        assert!(!id(r#""a""#).matches(r#""b""#));
        assert!(!id("1").matches("null"));
        assert!(!id("1").matches("garbage"));
        assert_eq!(RawId::from_json("null"), None);
        assert_eq!(RawId::from_json("\"unterminated"), None);
        assert_eq!(
            RawId::from_json(" 5 ").map(|i| i.to_string()),
            Some("5".into())
        );
    }

    fn tools_call(name: &str) -> String {
        format!(r#"{{"id":1,"method":"tools/call","params":{{"name":{name}}}}}"#)
    }

    #[test]
    fn headers_equal_to_the_body_match() {
        let body = tools_call(r#""get_weather""#);
        let info = parse_request(body.as_bytes());
        assert_eq!(
            check_headers(Some("tools/call"), Some("get_weather"), &info),
            HeaderCheck::Match
        );
        assert_eq!(check_headers(None, None, &info), HeaderCheck::NoHeaders);
    }

    #[test]
    fn base64_encoded_names_are_decoded_before_comparing() {
        let body = tools_call(r#""Hello, 世界""#);
        let info = parse_request(body.as_bytes());
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?SGVsbG8sIOS4lueVjA==?="),
                &info
            ),
            HeaderCheck::Match
        );
        // Unpadded Base64 decodes to the same text.
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?SGVsbG8sIOS4lueVjA?="),
                &info
            ),
            HeaderCheck::Match
        );
        let body = tools_call(r#""=?base64?literal?=""#);
        let info = parse_request(body.as_bytes());
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?PT9iYXNlNjQ/bGl0ZXJhbD89?="),
                &info
            ),
            HeaderCheck::Match
        );
    }

    #[test]
    fn spec_examples_decode() {
        for (encoded, plain) in [
            ("=?base64?IHBhZGRlZCA=?=", " padded "),
            ("=?base64?bGluZTEKbGluZTI=?=", "line1\nline2"),
            ("=?base64??=", ""),
            ("plain", "plain"),
            ("=?base64?", "=?base64?"),
        ] {
            assert_eq!(
                decode_header_value(encoded).as_deref(),
                Some(plain),
                "{encoded}"
            );
        }
        for bad in [
            "=?base64?!!!!?=",
            "=?base64?A?=",
            "=?base64?QQ=?=",
            "=?base64?/w==?=",
        ] {
            assert_eq!(decode_header_value(bad), None, "{bad}");
        }
    }

    #[test]
    fn headers_that_differ_from_the_body_mismatch() {
        let body = tools_call(r#""write_order""#);
        let info = parse_request(body.as_bytes());
        let check = |m, n| check_headers(m, n, &info);
        assert_eq!(
            check(Some("tools/list"), Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodDiffers)
        );
        assert_eq!(
            check(Some("tools/call"), Some("read_order")),
            HeaderCheck::Mismatch(Mismatch::NameDiffers)
        );
        assert_eq!(
            check(Some("tools/call"), None),
            HeaderCheck::Mismatch(Mismatch::NameMissing)
        );
        assert_eq!(
            check(None, Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodMissing)
        );
        assert_eq!(
            check(Some("tools/call"), Some("=?base64?@@?=")),
            HeaderCheck::Mismatch(Mismatch::NameEncoding)
        );
        // Values are case-sensitive.
        assert_eq!(
            check(Some("Tools/Call"), Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodDiffers)
        );
        assert_eq!(
            check_headers(Some("tools/call"), Some("x"), &RequestInfo::Batch),
            HeaderCheck::Mismatch(Mismatch::BodyUnreadable)
        );
    }

    #[test]
    fn resources_read_mirrors_the_uri_and_other_methods_ignore_mcp_name() {
        let body = r#"{"id":2,"method":"resources/read","params":{"uri":"file:///a.json"}}"#;
        let info = parse_request(body.as_bytes());
        assert_eq!(
            check_headers(Some("resources/read"), Some("file:///a.json"), &info),
            HeaderCheck::Match
        );
        assert_eq!(
            check_headers(Some("resources/read"), Some("file:///b"), &info),
            HeaderCheck::Mismatch(Mismatch::NameDiffers)
        );
        let info = parse_request(br#"{"id":3,"method":"tools/list"}"#);
        assert_eq!(
            check_headers(Some("tools/list"), None, &info),
            HeaderCheck::Match
        );
        assert_eq!(
            check_headers(Some("tools/list"), Some("anything"), &info),
            HeaderCheck::Match
        );
    }

    #[test]
    fn responses_are_classified_for_their_own_id_only() {
        let me = id("7");
        let c = |b: &str| classify_response(b.as_bytes(), &me);
        assert_eq!(
            c(r#"{"jsonrpc":"2.0","id":7,"result":{"content":[],"isError":true}}"#),
            ResponseClass::Result { is_error: true }
        );
        assert_eq!(
            c(r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"isError":true}]}}"#),
            ResponseClass::Result { is_error: false }
        );
        assert_eq!(
            c(r#"{"id":7,"result":{"isError":null}}"#),
            ResponseClass::Result { is_error: false }
        );
        assert_eq!(
            c(r#"{"id":7,"result":null}"#),
            ResponseClass::Result { is_error: false }
        );
        assert_eq!(
            c(r#"{"id":7,"result":[true]}"#),
            ResponseClass::Result { is_error: false }
        );
        assert_eq!(
            c(r#"{"id":7.0,"error":{"code":-32603,"message":"x"}}"#),
            ResponseClass::Error { code: -32603 }
        );
        assert_eq!(
            c(r#"{"id":7,"error":{"code":-32020,"message":"x"}}"#),
            ResponseClass::HeaderMismatch
        );
        assert_eq!(
            c(r#"{"id":7,"result":null,"error":{"code":1,"message":"x"}}"#),
            ResponseClass::Error { code: 1 }
        );
        assert_eq!(
            c(r#"{"id":8,"result":{"isError":true}}"#),
            ResponseClass::Other
        );
        assert_eq!(
            c(r#"{"id":null,"error":{"code":-32700,"message":"x"}}"#),
            ResponseClass::Other
        );
        assert_eq!(
            c(r#"{"error":{"code":-32700,"message":"x"}}"#),
            ResponseClass::Other
        );
        assert_eq!(
            c(r#"{"id":7,"method":"sampling/createMessage","params":{}}"#),
            ResponseClass::Other
        );
        assert_eq!(c(r#"[{"id":7,"result":{}}]"#), ResponseClass::Other);
        assert_eq!(c(r#"{"id":7}"#), ResponseClass::Unparseable);
        assert_eq!(
            c(r#"{"id":7,"error":{"code":"bad"}}"#),
            ResponseClass::Unparseable
        );
        assert_eq!(
            c(r#"{"id":7,"error":{"code":1.5}}"#),
            ResponseClass::Unparseable
        );
        assert_eq!(
            c(r#"{"id":7,"error":[-32603]}"#),
            ResponseClass::Unparseable
        );
        assert_eq!(
            c(r#"{"id":7,"result":{"isError":"yes"}}"#),
            ResponseClass::Unparseable
        );
        assert_eq!(c(r#"{"id":7,"result":{}"#), ResponseClass::Unparseable);
        assert_eq!(
            c("<html>502 Bad Gateway</html>"),
            ResponseClass::Unparseable
        );
        assert_eq!(c(""), ResponseClass::Unparseable);
    }

    #[test]
    fn deeply_nested_input_neither_overflows_the_stack_nor_confuses_the_reader() {
        let (open, close) = ("[".repeat(100_000), "]".repeat(100_000));
        // Skipped values (arguments, results) are walked without recursion: the request stands.
        let body = format!(r#"{{"id":1,"method":"a","params":{{"x":{open}{close}}}}}"#);
        assert!(matches!(
            parse_request(body.as_bytes()),
            RequestInfo::Single(_)
        ));
        let body = format!(r#"{{"id":1,"result":{open}{close}}}"#);
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Result { is_error: false }
        );
        // So are skipped values inside the fields the reader does look at.
        let body = format!(r#"{{"id":1,"error":{{"code":1,"data":{open}{close}}}}}"#);
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Error { code: 1 }
        );
        let body = format!(r#"{{"id":1,"method":"a","params":{{"name":{open}{close}}}}}"#);
        assert!(matches!(
            parse_request(body.as_bytes()),
            RequestInfo::Single(_)
        ));
        let body = format!("{open}{close}");
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Other
        );
    }
}
