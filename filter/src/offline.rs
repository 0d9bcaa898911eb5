//! The aggregate endpoint when no toolgate-xds answers.
//!
//! `/mcp` and `/virtual/<name>` are toolgate-xds's to serve (`initialize`, `tools/list`, its
//! gateway sessions); only `tools/call` goes straight to its service. Envoy sends the rest to
//! the control cluster, which holds every toolgate-xds of the fleet. When none of them answers,
//! Envoy's own reply would be a plain-text 503 that no MCP client reads. The filter answers
//! instead, from what its configuration holds: the virtual server's last listing
//! (`FilterConfig::offline_listings`), and the fleet's session key, so that a gateway session
//! it issues opens on any toolgate-xds once one is back (the same `tgv1.` format, the same
//! claims). It says what it is doing: `initialize`'s instructions and every listed tool's
//! description tell the model that the list is the last one known and changes are not
//! followed.

use serde_json::{json, Map, Value};

use crate::mcp::reply::{self, Framing, ProtocolVersion, Reply};
use crate::mcp::request::{Body, Request, SERVER_DISCOVER, TOOLS_LIST};

/// The revisions served with a gateway session, newest first (toolgate-xds's list).
pub const LEGACY: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];
pub const MODERN: &str = "2026-07-28";
/// Prefix of a gateway session id, and the associated data it is sealed with: the domain
/// toolgate-xds opens it in.
pub const GATEWAY_PREFIX: &str = "tgv1.";
pub const GATEWAY_AAD: &[u8] = b"tgv1";
/// The words the model reads about the state of the list.
pub const NOTE: &str = "The gateway's control plane is unreachable: this is the last list of \
                        tools it knew, and changes to it are not followed until it is back.";
/// The client's `capabilities` and `clientInfo` carried in a session id, at most (as JSON),
/// as toolgate-xds accepts them.
const MAX_CLIENT_PARAMS_BYTES: usize = 4096;

/// What the filter answers in toolgate-xds's place.
#[derive(Debug)]
pub enum Answer {
    /// A JSON-RPC message (HTTP 200), with the new gateway session of an `initialize`.
    Reply {
        reply: Reply,
        session: Option<String>,
    },
    /// A notification or a client's response: accepted, nothing to say (HTTP 202).
    Accepted,
}

/// The request's setting.
pub struct Context<'a> {
    /// The virtual server addressed (`default` for `/mcp`).
    pub server: &'a str,
    /// Its last listing, if the configuration has one.
    pub listing: Option<&'a [Value]>,
    pub version: ProtocolVersion,
    pub framing: Framing,
    pub now_ms: u64,
}

/// Answers `body` (its bytes: `raw`) for toolgate-xds. `seal` seals a gateway session's
/// claims (`None`: no key, or no randomness: the `initialize` is then refused).
pub fn answer(
    ctx: &Context<'_>,
    body: &Body<'_>,
    raw: &[u8],
    seal: impl FnOnce(&[u8]) -> Option<String>,
) -> Answer {
    let request = match body {
        Body::Request(r) => r,
        Body::Notification { .. } | Body::Response => return Answer::Accepted,
        Body::Batch(_) => {
            return error_reply(ctx, None, "a batch cannot be served now");
        }
    };
    let finished = |mut result: Map<String, Value>| {
        if ctx.version >= ProtocolVersion::V2026_07_28 {
            result.insert("resultType".into(), json!("complete"));
            let meta = result
                .entry("_meta")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(m) = meta.as_object_mut() {
                m.insert(
                    "io.modelcontextprotocol/serverInfo".into(),
                    server_info(ctx.server),
                );
            }
        }
        Value::Object(result)
    };
    match request.method.as_ref() {
        "initialize" => initialize(ctx, request, raw, seal),
        "ping" => result_reply(ctx, request, &finished(Map::new())),
        SERVER_DISCOVER => {
            let mut r = Map::new();
            let mut versions = vec![MODERN];
            versions.extend(LEGACY);
            r.insert("supportedVersions".into(), json!(versions));
            r.insert("capabilities".into(), capabilities());
            r.insert("instructions".into(), json!(NOTE));
            result_reply(ctx, request, &finished(r))
        }
        TOOLS_LIST => {
            let tools: Vec<Value> = ctx
                .listing
                .unwrap_or_default()
                .iter()
                .map(with_note)
                .collect();
            let mut r = Map::new();
            r.insert("tools".into(), Value::Array(tools));
            result_reply(ctx, request, &finished(r))
        }
        method => error_reply(
            ctx,
            Some(request),
            &format!("`{method}` cannot be served now"),
        ),
    }
}

fn server_info(server: &str) -> Value {
    json!({"name": format!("toolgate/{server}"), "version": env!("CARGO_PKG_VERSION")})
}

fn capabilities() -> Value {
    json!({"tools": {"listChanged": true}})
}

/// A tool as listed, its description ending with [`NOTE`].
fn with_note(tool: &Value) -> Value {
    let mut tool = tool.clone();
    if let Some(t) = tool.as_object_mut() {
        let description = match t.get("description").and_then(Value::as_str) {
            Some(d) if !d.is_empty() => format!("{d}\n\n{NOTE}"),
            _ => NOTE.to_string(),
        };
        t.insert("description".into(), json!(description));
    }
    tool
}

fn result_reply(ctx: &Context<'_>, request: &Request<'_>, result: &Value) -> Answer {
    Answer::Reply {
        reply: reply::result(&request.id, result, ctx.framing),
        session: None,
    }
}

fn error_reply(ctx: &Context<'_>, request: Option<&Request<'_>>, what: &str) -> Answer {
    let message = format!(
        "The gateway's control plane is unreachable: {what}. Tools can still be called; try \
         this again shortly."
    );
    Answer::Reply {
        reply: reply::error(
            ctx.version,
            request.map(|r| &r.id),
            reply::INTERNAL_ERROR,
            &message,
            None::<()>,
            ctx.framing,
        ),
        session: None,
    }
}

/// `initialize` (the revisions with sessions): the result, and a gateway session carrying
/// what toolgate-xds's sessions carry (virtual server, revision, the client's info and
/// capabilities, the time, a random nonce).
fn initialize(
    ctx: &Context<'_>,
    request: &Request<'_>,
    raw: &[u8],
    seal: impl FnOnce(&[u8]) -> Option<String>,
) -> Answer {
    let params = serde_json::from_slice::<Value>(raw)
        .ok()
        .and_then(|v| v.get("params").cloned())
        .unwrap_or(Value::Null);
    let requested = params
        .get("protocolVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let capabilities_of_client = params.get("capabilities").cloned().unwrap_or(json!({}));
    let client_info = params.get("clientInfo").cloned().unwrap_or(json!({}));
    if !capabilities_of_client.is_object()
        || !client_info.is_object()
        || capabilities_of_client.to_string().len() + client_info.to_string().len()
            > MAX_CLIENT_PARAMS_BYTES
    {
        return error_reply(
            ctx,
            Some(request),
            "an initialize with these capabilities and clientInfo cannot be served now",
        );
    }
    let version = LEGACY
        .iter()
        .find(|v| **v == requested)
        .copied()
        .unwrap_or(LEGACY[0]);
    let mut nonce = [0u8; 12];
    let claims = getrandom::fill(&mut nonce).ok().map(|()| {
        json!({
            "vs": ctx.server,
            "pv": version,
            "ci": client_info,
            "cc": capabilities_of_client,
            "iat": ctx.now_ms,
            "n": base64_url(&nonce),
        })
    });
    let session = claims.and_then(|c| seal(c.to_string().as_bytes()));
    let Some(session) = session else {
        return error_reply(ctx, Some(request), "no session can be issued");
    };
    let result = json!({
        "protocolVersion": version,
        "capabilities": capabilities(),
        "serverInfo": server_info(ctx.server),
        "instructions": NOTE,
    });
    Answer::Reply {
        reply: reply::result(&request.id, &result, ctx.framing),
        session: Some(session),
    }
}

fn base64_url(bytes: &[u8]) -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    URL_SAFE_NO_PAD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp::request::read_body;

    fn ctx<'a>(listing: Option<&'a [Value]>, version: ProtocolVersion) -> Context<'a> {
        Context {
            server: "default",
            listing,
            version,
            framing: Framing::Json,
            now_ms: 1_800_000_000_000,
        }
    }

    fn json_of(reply: &Reply) -> Value {
        serde_json::from_slice(&reply.body).expect("JSON")
    }

    fn ask(ctx: &Context<'_>, body: &str) -> (Value, Option<String>, Option<Vec<u8>>) {
        let parsed = read_body(body.as_bytes()).expect("a body");
        let mut sealed = None;
        let answer = answer(ctx, &parsed, body.as_bytes(), |plain| {
            sealed = Some(plain.to_vec());
            Some("tgv1.sealed".to_string())
        });
        match answer {
            Answer::Reply { reply, session } => (json_of(&reply), session, sealed),
            Answer::Accepted => (Value::Null, None, sealed),
        }
    }

    #[test]
    fn initialize_issues_a_gateway_session_toolgate_xds_can_open() {
        let c = ctx(None, ProtocolVersion::V2025_06_18);
        let (m, session, sealed) = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{"roots":{}},"clientInfo":{"name":"py","version":"2"}}}"#,
        );
        assert_eq!(m["result"]["protocolVersion"], "2025-06-18");
        assert_eq!(m["result"]["capabilities"]["tools"]["listChanged"], true);
        assert!(m["result"]["instructions"]
            .as_str()
            .is_some_and(|i| i.contains("unreachable")));
        assert_eq!(session.as_deref(), Some("tgv1.sealed"));
        let claims: Value = serde_json::from_slice(&sealed.expect("sealed")).expect("claims");
        assert_eq!(claims["vs"], "default");
        assert_eq!(claims["pv"], "2025-06-18");
        assert_eq!(claims["ci"]["name"], "py");
        assert_eq!(claims["cc"], json!({"roots": {}}));
        assert_eq!(claims["iat"], 1_800_000_000_000u64);
        assert!(claims["n"].as_str().is_some_and(|n| n.len() == 16));
        // An unknown revision gets the newest with sessions.
        let (m, _, _) = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2024-11-05"}}"#,
        );
        assert_eq!(m["result"]["protocolVersion"], LEGACY[0]);
    }

    #[test]
    fn the_listing_is_the_last_one_known_and_says_so() {
        let tools = vec![
            json!({"name": "inv__get", "description": "Stock.", "inputSchema": {"type": "object"}}),
            json!({"name": "fin__pay", "inputSchema": {"type": "object"}}),
        ];
        let c = ctx(Some(&tools), ProtocolVersion::V2026_07_28);
        let (m, _, _) = ask(&c, r#"{"jsonrpc":"2.0","id":"l","method":"tools/list"}"#);
        assert_eq!(m["id"], "l");
        let listed = m["result"]["tools"].as_array().expect("tools");
        assert_eq!(listed.len(), 2);
        assert!(listed[0]["description"]
            .as_str()
            .is_some_and(|d| d.starts_with("Stock.") && d.contains("not followed")));
        assert_eq!(listed[1]["description"], NOTE);
        assert_eq!(m["result"]["resultType"], "complete");
        // Nothing known: an empty list, still an answer.
        let c = ctx(None, ProtocolVersion::V2025_06_18);
        let (m, _, _) = ask(&c, r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#);
        assert_eq!(m["result"]["tools"], json!([]));
        assert!(m["result"].get("resultType").is_none());
    }

    #[test]
    fn other_methods_get_errors_and_notifications_are_accepted() {
        let c = ctx(None, ProtocolVersion::V2025_06_18);
        let (m, _, _) = ask(&c, r#"{"jsonrpc":"2.0","id":3,"method":"resources/list"}"#);
        assert_eq!(m["error"]["code"], reply::INTERNAL_ERROR);
        assert_eq!(m["id"], 3);
        let (m, _, _) = ask(
            &c,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        );
        assert_eq!(m, Value::Null);
        let (m, _, _) = ask(&c, r#"{"jsonrpc":"2.0","id":4,"method":"ping"}"#);
        assert_eq!(m["result"], json!({}));
        let (m, _, _) = ask(&c, r#"{"jsonrpc":"2.0","id":5,"method":"server/discover"}"#);
        assert_eq!(m["result"]["supportedVersions"][0], MODERN);
    }

    #[test]
    fn without_a_key_an_initialize_is_refused_not_answered_without_a_session() {
        let c = ctx(None, ProtocolVersion::V2025_06_18);
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#;
        let parsed = read_body(body.as_bytes()).expect("a body");
        let Answer::Reply { reply, session } = answer(&c, &parsed, body.as_bytes(), |_| None)
        else {
            panic!("a reply")
        };
        assert_eq!(session, None);
        assert_eq!(json_of(&reply)["error"]["code"], reply::INTERNAL_ERROR);
    }
}
