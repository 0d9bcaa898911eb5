//! The MCP servers the issue-18 tests register without a `/health` route, checked on their own
//! (no gateway): the reference everything-server (Node, kept on 127.0.0.1 by
//! `tests/node/loopback.mjs`), the official Python SDK server with `--no-health`, and the lab
//! with `--no-health`, whose `/control` counts sessions, `initialize`s and DELETEs and whose
//! `mcp_wedged` knob hangs `/mcp` while `/health` stays up.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::{McpServer, TestEnv};

/// The protocol version these servers all speak with sessions.
const PROTOCOL_VERSION: &str = "2025-11-25";

fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("http client")
}

/// POSTs an `initialize` as any Streamable HTTP client does.
async fn initialize(http: &reqwest::Client, url: &str) -> reqwest::Result<reqwest::Response> {
    http.post(url)
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .body(
            json!({
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": PROTOCOL_VERSION,
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            })
            .to_string(),
        )
        .send()
        .await
}

/// `/health` is a 404 and an `initialize` opens a session; returns the session id.
async fn answers_mcp_without_health(server: &McpServer) -> String {
    let http = client(Duration::from_secs(10));
    let health = http
        .get(format!("{}/health", server.base_url()))
        .send()
        .await
        .expect("GET /health");
    assert_eq!(
        health.status(),
        reqwest::StatusCode::NOT_FOUND,
        "{} serves /health",
        server.instance_id
    );
    let reply = initialize(&http, &server.mcp_url())
        .await
        .expect("POST initialize");
    let status = reply.status();
    let session = reply
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = reply.text().await.unwrap_or_default();
    assert_eq!(
        status,
        reqwest::StatusCode::OK,
        "{} initialize: {body}",
        server.instance_id
    );
    assert!(
        body.contains(r#""protocolVersion""#),
        "{} initialize result: {body}",
        server.instance_id
    );
    session.unwrap_or_else(|| panic!("{} gave no Mcp-Session-Id", server.instance_id))
}

#[tokio::test]
async fn everything_and_python_servers_answer_mcp_without_health() {
    let env = TestEnv::new("everything_and_python_servers_answer_mcp_without_health");
    let everything = McpServer::everything(&env, "everything").await;
    let python = McpServer::python(&env, "python", &["--no-health"]).await;
    for server in [&everything, &python] {
        answers_mcp_without_health(server).await;
    }
    // The preload kept the everything-server, which listens on every interface by itself,
    // on loopback.
    assert!(
        everything.proc.log().contains("binds 127.0.0.1 only"),
        "loopback.mjs did not rewrite the listen:\n{}",
        everything.proc.log()
    );
}

fn count(control: &Value, field: &str) -> u64 {
    control[field]
        .as_u64()
        .unwrap_or_else(|| panic!("/control has no count {field}: {control}"))
}

#[tokio::test]
async fn lab_counts_sessions_and_answers_mcp_without_health() {
    let env = TestEnv::new("lab_counts_sessions_and_answers_mcp_without_health");
    let lab = McpServer::lab(&env, "lab", &["--no-health"]).await;
    let before = lab.control().await;
    assert_eq!(count(&before, "sessions"), 0);
    assert_eq!(count(&before, "initializes"), 0);
    assert_eq!(count(&before, "deletes"), 0);

    let session = answers_mcp_without_health(&lab).await;
    let opened = lab.control().await;
    assert_eq!(count(&opened, "sessions"), 1, "{opened}");
    assert_eq!(count(&opened, "initializes"), 1, "{opened}");
    assert_eq!(count(&opened, "deletes"), 0, "{opened}");

    let deleted = client(Duration::from_secs(10))
        .delete(lab.mcp_url())
        .header("Mcp-Session-Id", &session)
        .header("MCP-Protocol-Version", PROTOCOL_VERSION)
        .send()
        .await
        .expect("DELETE /mcp");
    assert!(
        deleted.status().is_success(),
        "DELETE: {}",
        deleted.status()
    );
    // rmcp drops the session as it answers the DELETE; allow it a moment all the same.
    toolgate_tests::wait_until(
        "the lab has no session left",
        Duration::from_secs(5),
        || async { count(&lab.control().await, "sessions") == 0 },
    )
    .await;
    let closed = lab.control().await;
    assert_eq!(count(&closed, "initializes"), 1, "{closed}");
    assert_eq!(count(&closed, "deletes"), 1, "{closed}");

    let reset = lab.reset_counters().await;
    assert_eq!(count(&reset, "initializes"), 0, "{reset}");
    assert_eq!(count(&reset, "deletes"), 0, "{reset}");
}

#[tokio::test]
async fn wedged_lab_hangs_mcp_while_health_answers() {
    let env = TestEnv::new("wedged_lab_hangs_mcp_while_health_answers");
    let lab = McpServer::lab(&env, "lab", &[]).await;
    let state = lab.set(json!({"mcp_wedged": true})).await;
    assert_eq!(state["knobs"]["mcp_wedged"], true, "{state}");

    let http = client(Duration::from_secs(1));
    let hung = initialize(&http, &lab.mcp_url()).await;
    assert!(
        hung.as_ref().is_err_and(|e| e.is_timeout()),
        "POST /mcp answered while wedged: {hung:?}"
    );
    // Every method hangs, not only POST.
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let hung = http
            .request(method.clone(), lab.mcp_url())
            .header("Accept", "text/event-stream")
            .header("Mcp-Session-Id", "any")
            .send()
            .await;
        assert!(
            hung.as_ref().is_err_and(|e| e.is_timeout()),
            "{method} /mcp answered while wedged: {hung:?}"
        );
    }
    let health = http
        .get(format!("{}/health", lab.base_url()))
        .send()
        .await
        .expect("GET /health while wedged");
    assert_eq!(health.status(), reqwest::StatusCode::OK);
    // The wedged initialize reached the lab: a prober's attempts show up in the counts.
    let counts = lab.control().await;
    assert_eq!(count(&counts, "initializes"), 1, "{counts}");
    assert_eq!(count(&counts, "deletes"), 1, "{counts}");
    assert_eq!(count(&counts, "sessions"), 0, "{counts}");

    lab.set(json!({"mcp_wedged": false})).await;
    let answered = initialize(&http, &lab.mcp_url())
        .await
        .expect("initialize once unwedged");
    assert_eq!(answered.status(), reqwest::StatusCode::OK);
}
