//! Whatever the upstream does, the agent gets an MCP message: checked with the official Python
//! SDK client through a gateway started as a user starts it.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::{sdk, wait_until, McpSession, Member, NodeClient, Sdk, Stack, TestEnv};

const TTL: u32 = 10;

/// The `io.toolgate/breaker` details of a tool result the SDK returned, if it is a semantic one.
fn semantic(step: &Value) -> Option<&Value> {
    let result = step.get("ok")?;
    (result["isError"] == true).then_some(&result["_meta"]["io.toolgate/breaker"])
}

/// 16.1: every failure below JSON-RPC reaches the official Python SDK client as a tool result
/// with the request's id (the SDK checks it), `isError: true` and `upstream_failure`: never a
/// transport error, never an empty body; and each counts against the tool's breaker.
#[tokio::test]
async fn every_upstream_failure_reaches_the_python_sdk_as_a_tool_result() {
    let env = TestEnv::new("every_upstream_failure_reaches_the_python_sdk_as_a_tool_result");
    let stack = Stack::start(&env).await;
    let modes = [
        ("http500_empty", "http_5xx"),
        ("http502_html", "http_5xx"),
        ("http503_jsonrpc", "http_5xx"),
        ("sse_ends_early", "no_response"),
        ("json_reset", "reset"),
    ];
    let mut members = Vec::new();
    for (mode, _) in modes {
        let service = mode.replace('_', "-");
        let m = Member::start(
            &env,
            &stack.etcd.endpoint(),
            &service,
            &format!("{service}-1"),
            &["--fail", &format!("write_order={mode}")],
            TTL,
        )
        .await;
        stack.routes(&service, &[&m]).await;
        // Five in a window of a minute: a cut stream takes its time.
        stack
            .policy(&service, json!({"min_calls": 5, "window_secs": 60}))
            .await;
        members.push((service, m));
    }
    for ((mode, failure), (service, member)) in modes.iter().zip(&members) {
        let steps = sdk::python(
            &stack.url(service),
            &["initialize", "call:write_order:{\"x\":1}"],
        )
        .await;
        let call = steps.last().expect("a step");
        let meta = semantic(call).unwrap_or_else(|| {
            panic!("{mode}: the SDK did not get a semantic tool result: {steps:?}")
        });
        assert_eq!(meta["state"], "upstream_failure", "{mode}: {call}");
        assert_eq!(meta["failure"], *failure, "{mode}: {call}");
        assert_eq!(
            meta.get("retryAfterSeconds"),
            None,
            "{mode}: no wait is enforced"
        );
        assert_eq!(member.server.calls("write_order").await, 1, "{mode}");
    }
    // They count: five in a row (the policy's `min_calls`) open the breaker (before, an answer
    // the filter could not read counted as a success).
    for ((mode, _), (service, member)) in modes.iter().zip(&members) {
        let mut s = McpSession::connect(&stack.url(service)).await;
        for _ in 0..4 {
            let r = s.call_tool("write_order", json!({})).await;
            assert_eq!(
                r.breaker_state().as_deref(),
                Some("upstream_failure"),
                "{mode}: {}",
                r.body
            );
        }
        let r = s.call_tool("write_order", json!({})).await;
        assert_eq!(
            r.breaker_state().as_deref(),
            Some("open"),
            "{mode}: {}",
            r.body
        );
        assert_eq!(member.server.calls("write_order").await, 5, "{mode}");
    }
}

/// 16.1, the rest: an SSE stream cut by a connection reset after it started. What streamed
/// already went to the agent; Envoy then resets the agent's stream, and no proxy can add to a
/// reset stream. The SDK resolves the call itself ("SSE stream ended"); the breaker counts it.
#[tokio::test]
async fn an_sse_stream_reset_midway_counts_against_the_tool() {
    let env = TestEnv::new("an_sse_stream_reset_midway_counts_against_the_tool");
    let stack = Stack::start(&env).await;
    let m = Member::start(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=sse_reset"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    stack
        .policy("orders", json!({"min_calls": 5, "window_secs": 60}))
        .await;
    let steps = sdk::python(&stack.url("orders"), &["initialize", "call:write_order"]).await;
    let call = steps.last().expect("a step");
    println!("the Python SDK after a reset mid-stream: {call}");
    assert!(
        call.get("mcp_error").is_some() || semantic(call).is_some(),
        "the SDK resolved the call, it did not hang or crash: {steps:?}"
    );
    let mut s = McpSession::connect(&stack.url("orders")).await;
    for _ in 0..4 {
        s.call_tool("write_order", json!({})).await;
    }
    let r = s.call_tool("write_order", json!({})).await;
    assert_eq!(r.breaker_state().as_deref(), Some("open"), "{}", r.body);
    assert_eq!(m.server.calls("write_order").await, 5);
}

/// 16.10: with no healthy instance, every request gets a JSON-RPC error with its id, saying
/// which service has no server: initialize, tools/list, ping (the Python SDK raises an MCP
/// error with the gateway's words, not a transport error); the GET stream gets a 503 with a
/// JSON body and Retry-After.
#[tokio::test]
async fn with_no_healthy_instance_every_request_gets_an_mcp_error() {
    let env = TestEnv::new("with_no_healthy_instance_every_request_gets_an_mcp_error");
    let stack = Stack::start(&env).await;
    let m = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&m]).await;
    // The instance leaves (its registrar revokes); the service stays known, with no server.
    let mut m = m;
    m.registrar.stop(Duration::from_secs(5)).await;
    m.server.proc.kill();
    wait_until(
        "envoy drops the instance",
        Duration::from_secs(20),
        || async { stack.envoy.addresses("orders").await.is_empty() },
    )
    .await;
    for steps in [&["initialize"][..], &["list"], &["ping"]] {
        let out = sdk::python(&stack.url("orders"), steps).await;
        let last = out.last().expect("a step");
        let error = last
            .get("mcp_error")
            .unwrap_or_else(|| panic!("{steps:?}: not an MCP error: {out:?}"));
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("`orders`") && message.contains("available"),
            "{steps:?}: {error}"
        );
        assert_eq!(error["code"], -32603, "{steps:?}: {error}");
    }
    // The official TypeScript SDKs: 1.x connects with initialize and raises the gateway's
    // JSON-RPC error (before: Envoy's plain-text 503). 2.x pinned to 2026-07-28 probes with
    // server/discover, which gets 503 with the error: the SDK reports an HTTP 503 and keeps
    // the text (a JSON-RPC error at 200 would make it conclude "the server did not offer
    // 2026-07-28", as it did before). 2.x in its default mode then falls back to initialize.
    for (client, probe) in [
        (NodeClient::new(Sdk::V1), false),
        (
            NodeClient::new(Sdk::V2).protocol_version("2026-07-28"),
            true,
        ),
        (NodeClient::new(Sdk::V2), false),
    ] {
        let run = client.method("tools/list").run(&stack.url("orders")).await;
        let error = run.error("connect");
        println!("{}: {error}", run.sdk());
        let text = if probe {
            assert_eq!(error["data"]["status"], 503, "{}: {error}", run.sdk());
            error["data"]["text"].as_str().unwrap_or_default()
        } else {
            assert_eq!(error["code"], -32603, "{}: {error}", run.sdk());
            error["message"].as_str().unwrap_or_default()
        };
        assert!(
            text.contains("`orders`") && text.contains("available"),
            "{}: {error}",
            run.sdk()
        );
    }
    let get = reqwest::Client::new()
        .get(stack.url("orders"))
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("GET");
    assert_eq!(get.status().as_u16(), 503);
    assert!(
        get.headers().get("retry-after").is_some(),
        "{:?}",
        get.headers()
    );
    let body: Value = get.json().await.expect("a JSON body");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("`orders`")),
        "{body}"
    );
    // The mark the filter sets on a held answer, sent by a client itself, changes none of
    // Envoy's own replies (here: no route).
    let marked = reqwest::Client::new()
        .post(stack.url("nosuch"))
        .header(toolgate_model::envoy::HELD_HEADER, "1")
        .header("content-type", "application/json")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#)
        .send()
        .await
        .expect("POST");
    assert_eq!(marked.status().as_u16(), 404);
}

/// 16.11: a breaker opened by slow calls that all succeeded says so, with the figures.
#[tokio::test]
async fn a_breaker_opened_by_slow_calls_says_so() {
    let env = TestEnv::new("a_breaker_opened_by_slow_calls_says_so");
    let stack = Stack::start(&env).await;
    let m = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&m]).await;
    stack
        .policy(
            "orders/write_order",
            json!({"slow_call_ms": 200, "min_calls": 4}),
        )
        .await;
    m.server
        .set(json!({"tool_latency_ms": {"write_order": 300}}))
        .await;
    let mut s = McpSession::connect(&stack.url("orders")).await;
    for _ in 0..4 {
        let r = s.call_tool("write_order", json!({})).await;
        assert_eq!(r.breaker_state(), None, "slow but fine: {}", r.body);
    }
    let r = s.call_tool("write_order", json!({})).await;
    let meta = r.result().expect("a result")["_meta"]["io.toolgate/breaker"].clone();
    assert_eq!(meta["state"], "open", "{}", r.body);
    assert_eq!(meta["trippedBy"], "slow_call_rate", "{}", r.body);
    assert_eq!(meta["slowCallRatePercent"], 100, "{}", r.body);
    assert_eq!(meta["slowCallMs"], 200, "{}", r.body);
    let text = r.text();
    assert!(text.contains("took 200 ms or longer"), "{text}");
    assert!(!text.contains("failed"), "{text}");
}

/// 16.6: a policy change that reshapes the window keeps the failures counted so far (before,
/// the window started over and the breaker needed another ten calls).
#[tokio::test]
async fn a_policy_change_keeps_the_counts_of_the_window() {
    let env = TestEnv::new("a_policy_change_keeps_the_counts_of_the_window");
    let stack = Stack::start(&env).await;
    let m = Member::start(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    let mut s = McpSession::connect(&stack.url("orders")).await;
    for _ in 0..6 {
        let r = s.call_tool("write_order", json!({})).await;
        assert_eq!(
            r.breaker_state().as_deref(),
            Some("upstream_failure"),
            "{}",
            r.body
        );
    }
    // Two-second buckets over 20 s instead of one over 10 s.
    stack
        .policy("orders", json!({"bucket_secs": 2, "window_secs": 20}))
        .await;
    for _ in 0..4 {
        let r = s.call_tool("write_order", json!({})).await;
        assert_eq!(
            r.breaker_state().as_deref(),
            Some("upstream_failure"),
            "{}",
            r.body
        );
    }
    let r = s.call_tool("write_order", json!({})).await;
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("open"),
        "ten failures in the window, across the change: {}",
        r.body
    );
    assert_eq!(m.server.calls("write_order").await, 10);
}
