//! Reading the response to a judged request: did the tool answer, fail, or was the request
//! at fault?
//!
//! Only `id`, `method`, `result.isError` and `error.code` are read; the result itself is
//! skipped without being built.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::jsonrpc::{first_non_ws, present_raw, RawId, Str};

/// `HeaderMismatch` (2026-07-28): the HTTP headers do not match the request body.
pub const HEADER_MISMATCH: i64 = -32020;

/// Whether a JSON-RPC error code says the request was wrong rather than the tool: parse error
/// (-32700), invalid request (-32600), method not found (-32601), invalid params (-32602: bad
/// arguments, an unknown tool), MCP's header mismatch (-32020) and request cancelled (-32800:
/// the client gave up on its own call). A client can send such requests at will, so counting
/// them would let any client open a healthy tool's breaker for the whole fleet; crediting them
/// as successes would let it hide a failing tool. They count for neither. Every other code
/// (-32603 internal error, server-defined codes) is the tool's.
pub fn is_client_fault(code: i64) -> bool {
    matches!(
        code,
        -32700 | -32600 | -32601 | -32602 | HEADER_MISMATCH | REQUEST_CANCELLED
    )
}

/// The error a server answers a request with once its client cancelled it.
pub const REQUEST_CANCELLED: i64 = -32800;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseClass {
    /// A result; `is_error` is the tool's own `isError` (the tool answered, it may have failed).
    Result { is_error: bool },
    /// A JSON-RPC error; [`is_client_fault`] tells whose.
    Error { code: i64 },
    /// Valid JSON but not the response to this request: another id, a notification, a
    /// server-to-client request, a batch. From [`crate::mcp::sse::SseScanner::finish`]: the
    /// stream ended without the response.
    Other,
    /// Not JSON, or a response of the wrong shape.
    Unparseable,
    /// Too large for the gateway to hold and read (the SSE scanner's event limit): passed on
    /// unjudged, neither a failure nor a success of the tool.
    TooLarge,
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
mod tests {
    use super::*;

    fn id(text: &str) -> RawId {
        RawId::from_json(text).expect("test id")
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
            ResponseClass::Error { code: -32020 }
        );
        assert_eq!(
            c(r#"{"id":7,"result":null,"error":{"code":1,"message":"x"}}"#),
            ResponseClass::Error { code: 1 }
        );
        for other in [
            r#"{"id":8,"result":{"isError":true}}"#,
            r#"{"id":null,"error":{"code":-32700,"message":"x"}}"#,
            r#"{"error":{"code":-32700,"message":"x"}}"#,
            r#"{"id":7,"method":"sampling/createMessage","params":{}}"#,
            r#"[{"id":7,"result":{}}]"#,
        ] {
            assert_eq!(c(other), ResponseClass::Other, "{other}");
        }
        for bad in [
            r#"{"id":7}"#,
            r#"{"id":7,"error":{"code":"bad"}}"#,
            r#"{"id":7,"error":{"code":1.5}}"#,
            r#"{"id":7,"error":[-32603]}"#,
            r#"{"id":7,"result":{"isError":"yes"}}"#,
            r#"{"id":7,"result":{}"#,
            "<html>502 Bad Gateway</html>",
            "",
        ] {
            assert_eq!(c(bad), ResponseClass::Unparseable, "{bad}");
        }
    }

    #[test]
    fn only_codes_that_blame_the_request_are_client_faults() {
        for code in [-32700, -32600, -32601, -32602, -32020] {
            assert!(is_client_fault(code), "{code}");
        }
        for code in [-32603, -32000, -32099, -32002, 0, 1, 500] {
            assert!(!is_client_fault(code), "{code}");
        }
    }

    #[test]
    fn deeply_nested_results_neither_overflow_the_stack_nor_confuse_the_reader() {
        let (open, close) = ("[".repeat(100_000), "]".repeat(100_000));
        let body = format!(r#"{{"id":1,"result":{open}{close}}}"#);
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Result { is_error: false }
        );
        let body = format!(r#"{{"id":1,"error":{{"code":1,"data":{open}{close}}}}}"#);
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Error { code: 1 }
        );
        let body = format!("{open}{close}");
        assert_eq!(
            classify_response(body.as_bytes(), &id("1")),
            ResponseClass::Other
        );
    }
}
