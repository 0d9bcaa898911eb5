//! The JSON-RPC side of the aggregate endpoint: one message per POST, the revision it speaks,
//! and the response and error objects.

use axum::http::HeaderMap;
use serde_json::{json, Map, Value};

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// 2026-07-28: the request headers do not match the body.
pub const HEADER_MISMATCH: i64 = -32020;
/// 2026-07-28: the requested protocol version is not served.
pub const UNSUPPORTED_VERSION: i64 = -32022;

/// The stateless revision: no `initialize`, no session, `_meta` on every request.
pub const MODERN: &str = "2026-07-28";
/// The revisions served with a gateway session, newest first.
pub const LEGACY: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];
/// The `_meta` key of a 2026-07-28 request's protocol version.
pub const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";

/// Every revision served, newest first.
pub fn supported() -> Vec<&'static str> {
    let mut all = vec![MODERN];
    all.extend(LEGACY);
    all
}

/// One client message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
    },
    /// A response to a request of ours (we send none; accepted and dropped).
    Response,
}

/// A JSON-RPC error to answer with, and the HTTP status it goes with.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    pub status: u16,
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            status: 200,
            code,
            message: message.into(),
            data: None,
        }
    }

    pub fn status(mut self, status: u16) -> RpcError {
        self.status = status;
        self
    }

    pub fn data(mut self, data: Value) -> RpcError {
        self.data = Some(data);
        self
    }

    /// The error response; `id` when the request had a usable one.
    pub fn to_response(&self, id: Option<&Value>) -> Value {
        let mut error = Map::new();
        error.insert("code".into(), json!(self.code));
        error.insert("message".into(), json!(self.message));
        if let Some(d) = &self.data {
            error.insert("data".into(), d.clone());
        }
        let mut m = Map::new();
        m.insert("jsonrpc".into(), json!("2.0"));
        if let Some(id) = id {
            m.insert("id".into(), id.clone());
        }
        m.insert("error".into(), Value::Object(error));
        Value::Object(m)
    }
}

pub fn result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

pub fn notification(method: &str, params: Option<Value>) -> Value {
    match params {
        Some(p) => json!({"jsonrpc": "2.0", "method": method, "params": p}),
        None => json!({"jsonrpc": "2.0", "method": method}),
    }
}

/// Reads one message. A batch, a non-object, a bad id or a missing method is an error.
pub fn parse(body: &[u8]) -> Result<Message, RpcError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        RpcError::new(
            PARSE_ERROR,
            format!("Parse error: the body is not JSON ({e})"),
        )
        .status(400)
    })?;
    let obj =
        match value {
            Value::Object(o) => o,
            Value::Array(_) => return Err(RpcError::new(
                INVALID_REQUEST,
                "Invalid Request: batches are not supported; send one JSON-RPC message per POST",
            )
            .status(400)),
            _ => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "Invalid Request: the body must be one JSON-RPC message (an object)",
                )
                .status(400))
            }
        };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(RpcError::new(
            INVALID_REQUEST,
            "Invalid Request: \"jsonrpc\" must be \"2.0\"",
        )
        .status(400));
    }
    let id = obj.get("id");
    match obj.get("method") {
        Some(Value::String(method)) => match id {
            None => Ok(Message::Notification {
                method: method.clone(),
            }),
            Some(id @ (Value::String(_) | Value::Number(_))) if !is_float(id) => {
                let params = obj.get("params").cloned().unwrap_or(Value::Null);
                if !(params.is_object() || params.is_null()) {
                    return Err(RpcError::new(
                        INVALID_REQUEST,
                        "Invalid Request: \"params\" must be an object",
                    )
                    .status(400));
                }
                Ok(Message::Request {
                    id: id.clone(),
                    method: method.clone(),
                    params,
                })
            }
            Some(_) => Err(RpcError::new(
                INVALID_REQUEST,
                "Invalid Request: \"id\" must be a string or an integer",
            )
            .status(400)),
        },
        Some(_) => Err(RpcError::new(
            INVALID_REQUEST,
            "Invalid Request: \"method\" must be a string",
        )
        .status(400)),
        None if obj.contains_key("result") || obj.contains_key("error") => Ok(Message::Response),
        None => Err(RpcError::new(INVALID_REQUEST, "Invalid Request: no \"method\"").status(400)),
    }
}

fn is_float(id: &Value) -> bool {
    matches!(id, Value::Number(n) if !(n.is_i64() || n.is_u64()))
}

/// Which revision a message speaks: 2026-07-28 when its `MCP-Protocol-Version` header says so
/// (and then `_meta` must agree), else a legacy one (the header, or 2025-03-26 without one).
pub fn revision(headers: &HeaderMap, params: &Value) -> Result<Revision, RpcError> {
    let header = headers
        .get("mcp-protocol-version")
        .map(|v| v.to_str().unwrap_or("").trim().to_string());
    let meta = params
        .get("_meta")
        .and_then(|m| m.get(META_VERSION))
        .and_then(Value::as_str);
    match header.as_deref() {
        None => Ok(Revision::Legacy),
        Some(v) if LEGACY.contains(&v) => Ok(Revision::Legacy),
        Some(MODERN) => match meta {
            Some(MODERN) | None => Ok(Revision::Modern),
            Some(other) => Err(RpcError::new(
                HEADER_MISMATCH,
                format!(
                    "HeaderMismatch: MCP-Protocol-Version says {MODERN}, _meta[\"{META_VERSION}\"] says {other}"
                ),
            )
            .status(400)),
        },
        Some(other) => Err(RpcError::new(
            UNSUPPORTED_VERSION,
            format!("Unsupported protocol version {other:?}"),
        )
        .data(json!({"requested": other, "supported": supported()}))
        .status(400)),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revision {
    /// 2025-03-26 … 2025-11-25: `initialize` and a gateway session.
    Legacy,
    /// 2026-07-28: stateless.
    Modern,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_per_post() {
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#),
            Ok(Message::Request {
                id: json!(1),
                method: "ping".into(),
                params: Value::Null
            })
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Message::Notification {
                method: "notifications/initialized".into()
            })
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":"a","result":{}}"#),
            Ok(Message::Response)
        );
        let batch = parse(br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#).unwrap_err();
        assert_eq!(batch.code, INVALID_REQUEST);
        assert!(batch.message.contains("batches"));
        assert_eq!(parse(b"{nope").unwrap_err().code, PARSE_ERROR);
        for bad in [
            &br#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#[..],
            br#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"ping","params":[1]}"#,
            br#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","id":1}"#,
            b"3",
        ] {
            assert_eq!(parse(bad).unwrap_err().code, INVALID_REQUEST);
        }
    }

    #[test]
    fn the_revision_comes_from_the_header_and_must_match_meta() {
        let mut h = HeaderMap::new();
        assert_eq!(revision(&h, &Value::Null), Ok(Revision::Legacy));
        h.insert("mcp-protocol-version", "2025-06-18".parse().expect("v"));
        assert_eq!(revision(&h, &Value::Null), Ok(Revision::Legacy));
        h.insert("mcp-protocol-version", "2026-07-28".parse().expect("v"));
        let meta = json!({"_meta": {META_VERSION: "2026-07-28"}});
        assert_eq!(revision(&h, &meta), Ok(Revision::Modern));
        let e = revision(&h, &json!({"_meta": {META_VERSION: "2025-06-18"}})).unwrap_err();
        assert_eq!((e.code, e.status), (HEADER_MISMATCH, 400));
        h.insert("mcp-protocol-version", "2099-01-01".parse().expect("v"));
        let e = revision(&h, &meta).unwrap_err();
        assert_eq!((e.code, e.status), (UNSUPPORTED_VERSION, 400));
        assert_eq!(e.data.expect("data")["supported"][0], MODERN);
    }
}
