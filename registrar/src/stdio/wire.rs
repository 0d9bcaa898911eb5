//! JSON-RPC as the bridge reads and writes it: what a message is, error objects, and the
//! differences between the revisions that the bridge bridges (the 2026-07-28 envelope and
//! result tag).

use serde_json::{json, Map, Value};

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
/// The code of every fault of the stdio server (it exited, hung, wrote garbage): the gateway's
/// filter counts it against the tool, as an upstream failure.
pub const INTERNAL_ERROR: i64 = -32603;
/// 2026-07-28: the request's headers do not match its body.
pub const HEADER_MISMATCH: i64 = -32020;
/// 2026-07-28: the request's protocol version is not served.
pub const UNSUPPORTED_VERSION: i64 = -32022;
/// "Session not found", as the SDKs' servers say it (with HTTP 404).
pub const SESSION_NOT_FOUND: i64 = -32001;

/// The stateless revision: no `initialize`, no session, an envelope in every request.
pub const MODERN: &str = "2026-07-28";
/// The revisions with `initialize` and sessions, newest first.
pub const LEGACY: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

pub const PROTOCOL_VERSION_META: &str = "io.modelcontextprotocol/protocolVersion";
pub const CLIENT_INFO_META: &str = "io.modelcontextprotocol/clientInfo";
pub const CLIENT_CAPABILITIES_META: &str = "io.modelcontextprotocol/clientCapabilities";
pub const SERVER_INFO_META: &str = "io.modelcontextprotocol/serverInfo";

/// Where the bridge's own details go in an error's `data`.
pub const FAULT_DATA_KEY: &str = "io.toolgate/stdio";

/// Every revision the bridge serves over HTTP, newest first.
pub fn served() -> Vec<&'static str> {
    let mut all = vec![MODERN];
    all.extend(LEGACY);
    all
}

/// What one JSON-RPC message is.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Request {
        method: String,
    },
    Notification {
        method: String,
    },
    Response,
    /// Not a JSON-RPC 2.0 message (the reason).
    Invalid(&'static str),
}

/// Reads what `v` is, strictly enough to route it: `jsonrpc: "2.0"`, a string method, an id
/// that is a string or an integer.
pub fn kind(v: &Value) -> Kind {
    let Some(obj) = v.as_object() else {
        return Kind::Invalid("not a JSON object");
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Kind::Invalid("\"jsonrpc\" is not \"2.0\"");
    }
    let id_ok = match obj.get("id") {
        None => None,
        Some(Value::String(_)) => Some(true),
        Some(Value::Number(n)) => Some(n.is_i64() || n.is_u64()),
        Some(Value::Null) => Some(false),
        Some(_) => Some(false),
    };
    match obj.get("method") {
        Some(Value::String(method)) => match id_ok {
            None => Kind::Notification {
                method: method.clone(),
            },
            Some(true) => Kind::Request {
                method: method.clone(),
            },
            Some(false) => Kind::Invalid("\"id\" is not a string or an integer"),
        },
        Some(_) => Kind::Invalid("\"method\" is not a string"),
        None if obj.contains_key("result") || obj.contains_key("error") => Kind::Response,
        None => Kind::Invalid("no \"method\", \"result\" or \"error\""),
    }
}

/// An id as a map key (its JSON text: `1` and `"1"` stay apart).
pub fn key(id: &Value) -> String {
    id.to_string()
}

/// A JSON-RPC error response; `id` is null when the request's could not be read.
pub fn error(id: Option<&Value>, code: i64, message: impl Into<String>) -> Value {
    error_with(id, code, message, None)
}

pub fn error_with(
    id: Option<&Value>,
    code: i64,
    message: impl Into<String>,
    data: Option<Value>,
) -> Value {
    let mut e = Map::new();
    e.insert("code".into(), json!(code));
    e.insert("message".into(), json!(message.into()));
    if let Some(d) = data {
        e.insert("data".into(), d);
    }
    json!({"jsonrpc": "2.0", "id": id.cloned().unwrap_or(Value::Null), "error": e})
}

pub fn result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

pub fn notification(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params})
}

/// The error's code, when `response` is an error response.
pub fn error_code(response: &Value) -> Option<i64> {
    response.get("error")?.get("code")?.as_i64()
}

/// The HTTP status a 2026-07-28 answer carrying this error goes with (the revision maps the
/// errors that blame the request to 4xx, as the official SDKs do).
pub fn modern_status(code: i64) -> u16 {
    match code {
        PARSE_ERROR | INVALID_REQUEST | INVALID_PARAMS | HEADER_MISMATCH | UNSUPPORTED_VERSION => {
            400
        }
        METHOD_NOT_FOUND => 404,
        _ => 200,
    }
}

/// The revision a request's `_meta` names, if any.
pub fn meta_version(params: Option<&Value>) -> Option<&str> {
    params?.get("_meta")?.get(PROTOCOL_VERSION_META)?.as_str()
}

/// Takes the 2026-07-28 envelope out of a request's `_meta`, for a server that speaks an
/// earlier revision (the rest of `_meta`, a progress token, stays).
pub fn strip_envelope(message: &mut Value) {
    let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) else {
        return;
    };
    let empty = match params.get_mut("_meta").and_then(Value::as_object_mut) {
        Some(meta) => {
            meta.remove(PROTOCOL_VERSION_META);
            meta.remove(CLIENT_INFO_META);
            meta.remove(CLIENT_CAPABILITIES_META);
            meta.is_empty()
        }
        None => false,
    };
    if empty {
        params.remove("_meta");
    }
}

/// Makes a result of a server that speaks an earlier revision a 2026-07-28 result: the
/// revision requires `resultType`, and results carry the server's identity in `_meta`.
pub fn complete_result(response: &mut Value, server_info: Option<&Value>) {
    let Some(result) = response.get_mut("result").and_then(Value::as_object_mut) else {
        return;
    };
    result
        .entry("resultType")
        .or_insert_with(|| json!("complete"));
    if let Some(info) = server_info {
        let meta = result.entry("_meta").or_insert_with(|| json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.entry(SERVER_INFO_META).or_insert_with(|| info.clone());
        }
    }
}

/// The envelope the bridge puts on its own 2026-07-28 requests to a server.
pub fn envelope() -> Value {
    json!({
        PROTOCOL_VERSION_META: MODERN,
        CLIENT_INFO_META: client_info(),
        CLIENT_CAPABILITIES_META: {},
    })
}

/// How the bridge names itself to a server.
pub fn client_info() -> Value {
    json!({"name": "toolgate-register", "version": env!("CARGO_PKG_VERSION")})
}

/// At most 200 characters of something a server wrote, on one line.
pub fn snippet(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(800)]);
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let trimmed = one_line.trim();
    if trimmed.chars().count() > 200 || bytes.len() > 800 {
        format!("{}…", trimmed.chars().take(200).collect::<String>())
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_json_rpc() {
        assert_eq!(
            kind(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"})),
            Kind::Request {
                method: "ping".into()
            }
        );
        assert_eq!(
            kind(&json!({"jsonrpc": "2.0", "method": "notifications/progress"})),
            Kind::Notification {
                method: "notifications/progress".into()
            }
        );
        assert_eq!(
            kind(&json!({"jsonrpc": "2.0", "id": "a", "result": {}})),
            Kind::Response
        );
        assert_eq!(
            kind(&json!({"jsonrpc": "2.0", "id": null, "error": {"code": 1}})),
            Kind::Response
        );
        for bad in [
            json!([1]),
            json!({"id": 1, "method": "ping"}),
            json!({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}),
            json!({"jsonrpc": "2.0", "id": null, "method": "ping"}),
            json!({"jsonrpc": "2.0", "method": 3}),
            json!({"jsonrpc": "2.0", "id": 1}),
        ] {
            assert!(matches!(kind(&bad), Kind::Invalid(_)), "{bad}");
        }
    }

    #[test]
    fn the_envelope_goes_and_the_rest_of_meta_stays() {
        let mut m = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "x", "_meta": {
                PROTOCOL_VERSION_META: MODERN, CLIENT_INFO_META: {}, CLIENT_CAPABILITIES_META: {},
                "progressToken": 7}}});
        strip_envelope(&mut m);
        assert_eq!(m["params"]["_meta"], json!({"progressToken": 7}));
        let mut bare = json!({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {
            "_meta": {PROTOCOL_VERSION_META: MODERN}}});
        strip_envelope(&mut bare);
        assert_eq!(bare["params"], json!({}));
    }

    #[test]
    fn an_earlier_revisions_result_gets_the_2026_tag_and_the_servers_name() {
        let mut r = json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": []}});
        complete_result(&mut r, Some(&json!({"name": "memory"})));
        assert_eq!(r["result"]["resultType"], "complete");
        assert_eq!(r["result"]["_meta"][SERVER_INFO_META]["name"], "memory");
        let mut asked =
            json!({"jsonrpc": "2.0", "id": 1, "result": {"resultType": "input_required"}});
        complete_result(&mut asked, None);
        assert_eq!(asked["result"]["resultType"], "input_required");
        let mut failed = json!({"jsonrpc": "2.0", "id": 1, "error": {"code": 1}});
        complete_result(&mut failed, None);
        assert!(failed.get("result").is_none());
    }

    #[test]
    fn errors_that_blame_the_request_are_4xx_in_2026() {
        assert_eq!(modern_status(METHOD_NOT_FOUND), 404);
        assert_eq!(modern_status(INVALID_PARAMS), 400);
        assert_eq!(modern_status(INTERNAL_ERROR), 200);
        assert_eq!(modern_status(-32000), 200);
    }

    #[test]
    fn snippets_are_short_and_on_one_line() {
        assert_eq!(snippet(b"a\nb"), "a b");
        let long = vec![b'x'; 5000];
        let s = snippet(&long);
        assert!(s.ends_with('…') && s.chars().count() == 201, "{s}");
    }
}
