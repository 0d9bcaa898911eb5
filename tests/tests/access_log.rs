//! Envoy's access log names what the filter saw: the MCP method, the tool, the breaker's
//! state, the decision on a call and its reason (the audit trail), with the upstream instance
//! and the agent's W3C trace context.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::{wait_for, McpSession, Member, Options, Stack, TestEnv};

/// Envoy writes its file access logs out every 10 s (`--file-flush-interval-msec`'s default)
/// or when its buffer fills: a line shows up to 10 s after its request, so a wait of exactly
/// 10 s races the flush (it lost once, on a loaded CI run). Two and a half flushes.
const FLUSHED_WITHIN: Duration = Duration::from_secs(25);

/// The access log's JSON lines whose `mcp.tool` is `tool`.
fn lines_for(log: &std::path::Path, tool: &str) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["mcp.tool"] == tool)
        .collect()
}

#[tokio::test]
async fn the_access_log_carries_method_tool_breaker_upstream_and_trace_context() {
    let env = TestEnv::new("access_log");
    let log = env.path("access.log");
    let stack = Stack::with(
        &env,
        Options::default().bootstrap_arg(&["--access-log", &log.to_string_lossy()]),
    )
    .await;
    let envoy = &stack.envoy;
    let member = Member::start(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless"],
        10,
    )
    .await;
    stack.routes("orders", &[&member]).await;

    let mut agent = McpSession::connect(&envoy.url("orders")).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let reply = agent
        .request_with_headers(
            "tools/call",
            json!({"name": "read_order", "arguments": {"order": 1}}),
            &[("traceparent", traceparent)],
        )
        .await;
    assert!(
        reply.text().contains("orders-1") || reply.body.contains("orders-1"),
        "{}",
        reply.body
    );
    let (lines, _) = wait_for("the access log has the call", FLUSHED_WITHIN, || async {
        let l = lines_for(&log, "read_order");
        (!l.is_empty()).then_some(l)
    })
    .await;
    let line = &lines[0];
    assert_eq!(line["mcp.method"], "tools/call", "{line}");
    assert_eq!(line["mcp.breaker"], "closed", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["upstream_host"], member.server.endpoint(), "{line}");
    assert_eq!(line["upstream_cluster"], "mcp.orders", "{line}");
    assert_eq!(line["traceparent"], traceparent, "{line}");
    assert_eq!(line["path"], "/mcp/orders", "{line}");
    // The audit trail: the decision, the service and the client on every call.
    assert_eq!(line["mcp.decision"], "allowed", "{line}");
    assert_eq!(line["mcp.service"], "orders", "{line}");
    assert_eq!(line["client"], "127.0.0.1", "{line}");

    // A call over a limit: its line names the decision and the rule.
    let (status, body) = stack
        .admin(
            reqwest::Method::PUT,
            "/v1/limits/orders/write_order",
            Some(&json!({"per": "gateway", "calls": 1, "per_seconds": 3600, "name": "once"})),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    stack
        .wait_filter_config("the limit", |c| !c["limits"].is_null())
        .await;
    for _ in 0..2 {
        agent.call_tool("write_order", json!({"order": 1})).await;
    }
    let (lines, _) = wait_for(
        "the access log has the limited call",
        FLUSHED_WITHIN,
        || async {
            let l: Vec<Value> = lines_for(&log, "write_order")
                .into_iter()
                .filter(|v| v["mcp.decision"] == "limited")
                .collect();
            (!l.is_empty()).then_some(l)
        },
    )
    .await;
    assert_eq!(lines[0]["mcp.limit"], "once", "{}", lines[0]);
    assert_eq!(lines[0]["mcp.reason"], "once", "{}", lines[0]);

    // A request the filter does not judge has its method only.
    agent.list_tools().await;
    let (listed, _) = wait_for("the access log has tools/list", FLUSHED_WITHIN, || async {
        let all: Vec<Value> = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["mcp.method"] == "tools/list")
            .collect();
        (!all.is_empty()).then_some(all)
    })
    .await;
    assert!(
        listed[0]["mcp.tool"]
            .as_str()
            .is_none_or(|t| t.is_empty() || t == "-"),
        "{}",
        listed[0]
    );
}
