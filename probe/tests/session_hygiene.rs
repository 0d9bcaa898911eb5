//! The MCP prober against servers that misbehave on sessions: however a server answers, the
//! prober holds at most one session on it. The well-behaved servers (the official
//! everything-server, the Python SDK server) are covered end to end in tests/tests/mcp_probe.rs.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{json, Value};
use toolgate_probe::mcp::McpClient;

/// A legacy server that gives out sessions and, when `refuse_pings`, answers every ping 400 as
/// if it had forgotten the session.
#[derive(Clone, Default)]
struct Legacy {
    live: Arc<Mutex<BTreeSet<String>>>,
    next: Arc<Mutex<u32>>,
    refuse_pings: bool,
}

async fn rpc(State(s): State<Legacy>, headers: HeaderMap, body: String) -> Response {
    let req: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let id = req["id"].clone();
    let session = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    match req["method"].as_str().unwrap_or("") {
        "initialize" => {
            let sid = {
                let mut n = s.next.lock().unwrap();
                *n += 1;
                format!("s{n}")
            };
            s.live.lock().unwrap().insert(sid.clone());
            (
                [("mcp-session-id", sid)],
                axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "serverInfo": {"name": "legacy", "version": "1"}}})),
            )
                .into_response()
        }
        "notifications/initialized" => StatusCode::ACCEPTED.into_response(),
        "ping" => {
            let known = session.is_some_and(|sid| s.live.lock().unwrap().contains(&sid));
            if known && !s.refuse_pings {
                axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": {}})).into_response()
            } else {
                (
                    StatusCode::BAD_REQUEST,
                    axum::Json(json!({"jsonrpc": "2.0", "id": id,
                        "error": {"code": -32000, "message": "No valid session ID provided"}})),
                )
                    .into_response()
            }
        }
        // Everything else, server/discover included, is an unknown method to this revision.
        _ => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": -32000, "message": "Server not initialized"}})),
        )
            .into_response(),
    }
}

async fn delete(State(s): State<Legacy>, headers: HeaderMap) -> StatusCode {
    let sid = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if s.live.lock().unwrap().remove(sid) {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn serve(state: Legacy) -> String {
    let app = axum::Router::new()
        .route("/mcp", post(rpc).delete(delete))
        .with_state(state);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    format!("http://{addr}/mcp")
}

fn client(url: &str) -> McpClient {
    let t = Duration::from_secs(2);
    McpClient::new(toolgate_probe::http::client(t), url, t, "test-prober")
}

#[tokio::test]
async fn a_kept_session_serves_every_probe_and_a_forgotten_one_is_replaced_once() {
    let server = Legacy::default();
    let url = serve(server.clone()).await;
    let mut c = client(&url);
    for _ in 0..20 {
        let ok = c.probe().await.expect("probe");
        assert!(
            ok.contains("session kept") || ok.contains("re-created"),
            "{ok}"
        );
    }
    assert_eq!(server.live.lock().unwrap().len(), 1);
    // The server forgets every session (a restart): one new one, then kept again.
    server.live.lock().unwrap().clear();
    assert!(c
        .probe()
        .await
        .expect("probe")
        .contains("session re-created"));
    for _ in 0..5 {
        assert!(c.probe().await.expect("probe").contains("session kept"));
    }
    assert_eq!(*server.next.lock().unwrap(), 2, "two sessions in all");
    c.close().await.expect("delete");
    assert!(server.live.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_server_refusing_pings_on_live_sessions_is_left_with_none() {
    let server = Legacy {
        refuse_pings: true,
        ..Legacy::default()
    };
    let url = serve(server.clone()).await;
    let mut c = client(&url);
    for _ in 0..10 {
        let e = c.probe().await.expect_err("every ping is refused");
        assert!(e.to_string().contains("HTTP 400"), "{e}");
        assert!(
            server.live.lock().unwrap().len() <= 1,
            "sessions left: {:?}",
            server.live.lock().unwrap()
        );
    }
    assert!(server.live.lock().unwrap().is_empty(), "each was deleted");
}
