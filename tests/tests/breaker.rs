//! The wasm filter in a real Envoy: per-tool breakers shared by all workers, and failures
//! answered as MCP tool results.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, McpSession, Member, Options, Reply, Stack, TestEnv};

const TTL: u32 = 10;

/// The `io.toolgate/breaker` details of a semantic reply, if it is one.
fn breaker_meta(r: &Reply) -> Option<Value> {
    let result = r.result()?;
    if result["isError"] != true {
        return None;
    }
    Some(result["_meta"]["io.toolgate/breaker"].clone())
}

fn assert_semantic(r: &Reply, state: &str) {
    assert_eq!(
        r.status,
        StatusCode::OK,
        "a semantic reply is HTTP 200: {}",
        r.body
    );
    let meta = breaker_meta(r).unwrap_or_else(|| panic!("not a semantic reply: {}", r.body));
    assert_eq!(meta["state"], state, "{}", r.body);
    assert!(
        !r.body.contains("127.0.0.1"),
        "no internal address in the reply: {}",
        r.body
    );
    assert!(
        !r.body.contains("mcp."),
        "no cluster name in the reply: {}",
        r.body
    );
}

async fn trips_after_min_calls(concurrency: u32, name: &str) {
    let env = TestEnv::new(name);
    let gw = Stack::with(&env, Options::default().concurrency(concurrency)).await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;

    // Each call on a connection of its own, so that the kernel spreads them over the workers
    // (one keep-alive connection would be served by one worker alone).
    for i in 0..10 {
        let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
        let r = s.call_tool("write_order", json!({"i": i})).await;
        assert_semantic(&r, "upstream_failure");
    }
    assert_eq!(m.server.calls("write_order").await, 10);
    let workers = gw.envoy.workers_with_connections().await;
    println!("{concurrency} worker(s); connections per worker: {workers:?}");
    if concurrency > 1 {
        assert!(
            workers.iter().filter(|n| **n > 0).count() > 1,
            "calls were served by more than one worker: {workers:?}"
        );
    }
    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    // The 10th failure in the window tripped it: from now on the gateway answers alone.
    for _ in 0..5 {
        let r = s.call_tool("write_order", json!({})).await;
        assert_semantic(&r, "open");
        assert!(r.text().contains("write_order"), "{}", r.text());
        assert!(r.text().to_lowercase().contains("retry"), "{}", r.text());
    }
    assert_eq!(
        m.server.calls("write_order").await,
        10,
        "no call reached the server while open"
    );
    // Per-tool isolation: another tool of the same server keeps working.
    let r = s.call_tool("read_order", json!({})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_ne!(
        r.result().map(|v| v["isError"].clone()),
        Some(Value::Bool(true)),
        "{}",
        r.body
    );
    assert!(gw.envoy.proc.as_ref().is_some_and(|p| p
        .log()
        .contains("toolgate breaker tg/b/orders/write_order: closed -> open")));
}

#[tokio::test]
async fn a_failing_tool_opens_after_the_minimum_calls_and_fails_fast() {
    trips_after_min_calls(
        1,
        "a_failing_tool_opens_after_the_minimum_calls_and_fails_fast",
    )
    .await;
}

#[tokio::test]
async fn four_workers_trip_after_the_same_number_of_failures() {
    trips_after_min_calls(4, "four_workers_trip_after_the_same_number_of_failures").await;
}

#[tokio::test]
async fn half_open_lets_few_probes_through_and_closes_or_reopens() {
    let env = TestEnv::new("half_open_lets_few_probes_through_and_closes_or_reopens");
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    gw.policy(
        "orders/write_order",
        json!({"open_ms": 1000, "min_calls": 5, "open_jitter_percent": 0}),
    )
    .await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;

    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    for _ in 0..5 {
        s.call_tool("write_order", json!({})).await;
    }
    assert_semantic(&s.call_tool("write_order", json!({})).await, "open");

    // First round of probes fails: reopens, for longer.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = m.server.calls("write_order").await;
    let r = s.call_tool("write_order", json!({})).await;
    assert_semantic(&r, "upstream_failure");
    assert_eq!(m.server.calls("write_order").await, before + 1);
    let r = s.call_tool("write_order", json!({})).await;
    assert_semantic(&r, "open");
    let retry = breaker_meta(&r).unwrap()["retryAfterSeconds"]
        .as_u64()
        .unwrap();
    assert!(
        retry >= 2,
        "reopened with a longer open duration: {}",
        r.body
    );

    // The tool recovers, but slowly: 20 concurrent calls when the duration ends, at most 3
    // reach the server; their success closes the breaker.
    m.server
        .set(json!({"fail": {"write_order": "none"}, "latency_ms": 400}))
        .await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let before = m.server.calls("write_order").await;
    let url = gw.envoy.url("orders");
    let mut calls = Vec::new();
    for _ in 0..20 {
        let url = url.clone();
        calls.push(tokio::spawn(async move {
            let mut s = McpSession::connect(&url).await;
            s.call_tool("write_order", json!({})).await
        }));
    }
    let mut rejected = 0;
    for c in calls {
        if breaker_meta(&c.await.unwrap()).is_some() {
            rejected += 1;
        }
    }
    let probes = m.server.calls("write_order").await - before;
    println!("half-open: {probes} of 20 concurrent calls reached the server, {rejected} answered by the gateway");
    assert!(
        (1..=3).contains(&probes),
        "{probes} calls reached the server"
    );
    wait_until("the breaker closes", Duration::from_secs(5), || async {
        let mut s = McpSession::connect(&url).await;
        breaker_meta(&s.call_tool("write_order", json!({})).await).is_none()
    })
    .await;
}

#[tokio::test]
async fn slow_calls_open_the_breaker_by_slow_call_rate() {
    let env = TestEnv::new("slow_calls_open_the_breaker_by_slow_call_rate");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy("orders", json!({"slow_call_ms": 100, "min_calls": 5}))
        .await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--latency-ms", "150"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    for _ in 0..5 {
        let r = s.call_tool("read_order", json!({})).await;
        assert!(
            breaker_meta(&r).is_none(),
            "slow calls still answer: {}",
            r.body
        );
    }
    assert_semantic(&s.call_tool("read_order", json!({})).await, "open");
    assert_eq!(m.server.calls("read_order").await, 5);
}

#[tokio::test]
async fn a_policy_change_keeps_an_open_breaker_open() {
    let env = TestEnv::new("a_policy_change_keeps_an_open_breaker_open");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy("orders", json!({"min_calls": 5, "open_ms": 30000}))
        .await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    for _ in 0..5 {
        s.call_tool("write_order", json!({})).await;
    }
    assert_semantic(&s.call_tool("write_order", json!({})).await, "open");
    // Waits until Envoy's filter applied it (its ECDS configuration says so).
    gw.policy("orders", json!({"min_calls": 5, "open_ms": 30000, "failure_rate_percent": 40, "fallback_tool": "read_order"})).await;
    let r = s.call_tool("write_order", json!({})).await;
    assert_semantic(&r, "open");
    assert!(
        r.text().contains("read_order"),
        "the new policy's fallback is named: {}",
        r.text()
    );
    assert_eq!(
        m.server.calls("write_order").await,
        5,
        "still open after the policy change"
    );
}

#[tokio::test]
async fn upstream_failures_reach_the_agent_as_tool_results() {
    let env = TestEnv::new("upstream_failures_reach_the_agent_as_tool_results");
    // The crash watch off: the killed server below must stay routed until a call meets its
    // refused connection (as one does when the watch cannot see a crash: a host gone without
    // closing its connections), so that the filter's reading of that is what is tested.
    let gw = Stack::with(
        &env,
        Options::default()
            .concurrency(1)
            .xds_arg(&["--probe-watch-limit", "0"]),
    )
    .await;
    gw.policy("hang", json!({"timeout_ms": 300})).await;
    let ep = gw.etcd.endpoint();
    let reset = Member::start(
        &env,
        &ep,
        "reset",
        "reset-1",
        &["--fail", "echo=reset"],
        TTL,
    )
    .await;
    let hang = Member::start(&env, &ep, "hang", "hang-1", &["--fail", "echo=hang"], TTL).await;
    // Its registrar does not watch it: the lease lives on after the kill, so calls meet a
    // refused connection, not an empty service.
    let mut dead = Member::start_unwatched(&env, &ep, "dead", "dead-1", &[], TTL).await;
    let gone = Member::start(&env, &ep, "gone", "gone-1", &[], TTL).await;
    for (svc, m) in [
        ("reset", &reset),
        ("hang", &hang),
        ("dead", &dead),
        ("gone", &gone),
    ] {
        gw.routes(svc, &[m]).await;
    }
    // Sessions first, while every server is alive.
    let mut sessions = Vec::new();
    for svc in ["reset", "hang", "dead", "gone"] {
        sessions.push(McpSession::connect(&gw.envoy.url(svc)).await);
    }
    dead.server.proc.kill(); // connection refused; the lease lives on
    gone.registrar.signal(nix::sys::signal::Signal::SIGTERM); // no instance left
    gw.routes("gone", &[]).await;

    let r = sessions[0].call_tool("echo", json!({})).await;
    assert_semantic(&r, "upstream_failure");
    assert_eq!(breaker_meta(&r).unwrap()["failure"], "reset", "{}", r.body);
    let r = sessions[2].call_tool("echo", json!({})).await;
    assert_semantic(&r, "upstream_failure");
    assert_eq!(
        breaker_meta(&r).unwrap()["failure"],
        "connect_failure",
        "{}",
        r.body
    );
    let r = sessions[3].call_tool("echo", json!({})).await;
    assert_semantic(&r, "upstream_failure");
    assert_eq!(
        breaker_meta(&r).unwrap()["failure"],
        "no_healthy_upstream",
        "{}",
        r.body
    );

    // A hung server: the service's policy timeout (300 ms) ends the wait.
    let t0 = Instant::now();
    let r = sessions[1].call_tool("echo", json!({})).await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    assert_semantic(&r, "upstream_failure");
    assert_eq!(
        breaker_meta(&r).unwrap()["failure"],
        "timeout",
        "{}",
        r.body
    );
}

#[tokio::test]
async fn the_official_python_client_gets_a_tool_result_not_an_exception() {
    let env = TestEnv::new("the_official_python_client_gets_a_tool_result_not_an_exception");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy(
        "orders/write_order",
        json!({"min_calls": 3, "fallback_tool": "read_order"}),
    )
    .await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let python = toolgate_tests::paths::workspace_root().join(".venv/bin/python");
    let script = toolgate_tests::paths::workspace_root().join("tests/python/call_tool.py");
    // First an upstream failure (HTTP 500 rewritten), then, once open, the breaker's reply.
    for expect in [
        "HTTP status 500",
        "HTTP status 500",
        "HTTP status 500",
        "read_order",
    ] {
        let out = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new(&python)
                .arg(&script)
                .arg(gw.envoy.url("orders"))
                .arg("write_order")
                .output(),
        )
        .await
        .expect("python client finished")
        .expect("python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the SDK raised instead of returning a result: {stderr}"
        );
        let result: Value = serde_json::from_str(stdout.trim()).expect("JSON from the script");
        assert_eq!(result["isError"], true, "{stdout}");
        assert!(
            result["text"].as_str().unwrap_or("").contains(expect),
            "{stdout}"
        );
    }
    assert_eq!(
        m.server.calls("write_order").await,
        3,
        "the 4th call was answered by the gateway"
    );
}

#[tokio::test]
async fn a_hung_service_fills_only_its_own_bulkhead() {
    let env = TestEnv::new("a_hung_service_fills_only_its_own_bulkhead");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy(
        "slow",
        json!({"max_connections": 2, "max_requests": 2, "max_pending_requests": 1, "timeout_ms": 10000, "min_calls": 100}),
    )
    .await;
    let ep = gw.etcd.endpoint();
    let slow = Member::start(
        &env,
        &ep,
        "slow",
        "slow-1",
        &["--stateless", "--json-response", "--latency-ms", "3000"],
        TTL,
    )
    .await;
    let fast = Member::start(
        &env,
        &ep,
        "fast",
        "fast-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    gw.routes("slow", &[&slow]).await;
    gw.routes("fast", &[&fast]).await;

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let call = |url: String, i: u64| {
        let http = http.clone();
        async move {
            let t0 = Instant::now();
            let r = http
                .post(&url)
                .header("accept", "application/json, text/event-stream")
                .json(&json!({"jsonrpc":"2.0","id":i,"method":"tools/call","params":{"name":"echo","arguments":{}}}))
                .send()
                .await
                .expect("answered");
            let status = r.status();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            (status, body, t0.elapsed())
        }
    };
    let mut slow_calls = Vec::new();
    for i in 0..10 {
        slow_calls.push(tokio::spawn(call(gw.envoy.url("slow"), i)));
    }
    // The hung service holds what its bulkhead let through (one or two calls: how many get a
    // connection before the rest overflow depends on timing).
    wait_until(
        "the hung service holds a call",
        Duration::from_secs(30),
        || async { slow.server.calls("echo").await >= 1 },
    )
    .await;
    // While the slow service is saturated, the fast one answers at its normal speed.
    for i in 0..20 {
        let (status, body, took) = call(gw.envoy.url("fast"), 100 + i).await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(body["result"]["isError"], true, "{body}");
        assert!(took < Duration::from_millis(500), "fast call took {took:?}");
    }
    let mut busy = 0;
    for c in slow_calls {
        let (status, body, _) = c.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        if body["result"]["_meta"]["io.toolgate/breaker"]["state"] == "overloaded" {
            busy += 1;
            let text = body["result"]["content"][0]["text"].as_str().unwrap_or("");
            assert!(text.contains("busy"), "{text}");
        }
    }
    println!("bulkhead: {busy} of 10 calls to the hung service were told the server is busy");
    assert!(busy >= 5, "only {busy} overflowed");
    assert!(
        slow.server.calls("echo").await <= 3,
        "no more than the bulkhead let through"
    );
}

#[tokio::test]
async fn what_the_agent_receives_validates_against_the_mcp_schema_of_its_version() {
    let env =
        TestEnv::new("what_the_agent_receives_validates_against_the_mcp_schema_of_its_version");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy(
        "orders/write_order",
        json!({"min_calls": 3, "open_ms": 60000}),
    )
    .await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &[
            "--stateless",
            "--json-response",
            "--fail",
            "write_order=http500",
        ],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let http = reqwest::Client::new();
    let post = |version: &'static str, accept: &'static str, id: Value| {
        let http = http.clone();
        let url = gw.envoy.url("orders");
        async move {
            let mut req = http
                .post(url)
                .header("accept", accept)
                .header("mcp-protocol-version", version)
                .json(&json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":{"name":"write_order","arguments":{}}}));
            if version == "2026-07-28" {
                req = req
                    .header("mcp-method", "tools/call")
                    .header("mcp-name", "write_order");
            }
            let r = req.send().await.expect("answered");
            let ct = r
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (r.status(), ct, r.text().await.unwrap_or_default())
        }
    };
    let versions = ["2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"];
    // Upstream failures first (they trip the breaker), then open-breaker replies.
    for (n, version) in versions.iter().chain(versions.iter()).enumerate() {
        for (accept, sse) in [("application/json", false), ("text/event-stream", true)] {
            let id = if n % 2 == 0 {
                json!(n)
            } else {
                json!(format!("req-{n}\"quoted\""))
            };
            let (status, ct, body) = post(version, accept, id.clone()).await;
            assert_eq!(status, StatusCode::OK, "{version} {accept}: {body}");
            let message: Value = if sse {
                assert!(ct.starts_with("text/event-stream"), "{version}: {ct}");
                let data = body
                    .lines()
                    .find_map(|l| l.strip_prefix("data:"))
                    .expect("an SSE data line");
                serde_json::from_str(data.trim()).expect("SSE data is JSON")
            } else {
                assert!(ct.starts_with("application/json"), "{version}: {ct}");
                serde_json::from_str(&body).expect("JSON body")
            };
            assert_eq!(message["id"], id, "the request's own id");
            assert_eq!(message["result"]["isError"], true);
            toolgate_tests::schema::assert_valid(version, "JSONRPCMessage", &message);
            toolgate_tests::schema::assert_valid(version, "CallToolResult", &message["result"]);
        }
    }
    assert_eq!(
        m.server.calls("write_order").await,
        3,
        "later replies came from the open breaker"
    );
}

#[tokio::test]
async fn oversized_batched_and_malformed_bodies_are_answered_and_open_nothing() {
    let env = TestEnv::new("oversized_batched_and_malformed_bodies_are_answered_and_open_nothing");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy("orders", json!({"min_calls": 2})).await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let http = reqwest::Client::new();
    let url = gw.envoy.url("orders");
    let post = |body: Vec<u8>| {
        let http = http.clone();
        let url = url.clone();
        async move {
            let r = http
                .post(url)
                .header("accept", "application/json, text/event-stream")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("answered");
            (r.status(), r.text().await.unwrap_or_default())
        }
    };

    // Over the 1 MiB limit: a clear JSON-RPC error, never buffered, never sent upstream.
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"echo","arguments":{{"pad":"{}"}}}}}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    let (status, body) = post(big.into_bytes()).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    let err: Value = serde_json::from_str(&body).expect("a JSON-RPC error");
    assert_eq!(err["error"]["code"], -32600, "{body}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("larger than"),
        "{body}"
    );

    // Malformed JSON is refused by the gateway (it cannot judge it); a tool name outside the
    // rule is refused as invalid params; a batch (no MCP-Protocol-Version: 2025-03-26, which
    // had batches) of a closed tool is judged and goes on.
    for (body, want_status, want_code) in [
        (&b"{not json"[..], StatusCode::BAD_REQUEST, Some(-32700)),
        (
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"bad name!"}}"#,
            StatusCode::OK,
            Some(-32602),
        ),
    ] {
        let (status, text) = post(body.to_vec()).await;
        assert_eq!(status, want_status, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert_eq!(v["error"]["code"].as_i64(), want_code, "{text}");
    }
    // The batch goes on to the server (this one, rmcp, has no batches and says so).
    let (status, text) = post(
        br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo"}}]"#.to_vec(),
    )
    .await;
    assert!(
        !text.contains("io.toolgate") && !text.contains("gateway"),
        "judged by the gateway: {status} {text}"
    );
    // None of that opened anything: a normal call works.
    let mut s = McpSession::connect(&url).await;
    let r = s.call_tool("echo", json!({})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(breaker_meta(&r).is_none(), "{}", r.body);
    assert_eq!(
        m.server.calls("echo").await,
        2,
        "the batch reached the server, and so did the good call"
    );
}

#[tokio::test]
async fn filter_stats_carry_service_and_tool_labels() {
    let env = TestEnv::new("filter_stats_carry_service_and_tool_labels");
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    let m = Member::start_with_tools(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        "read_order,write_order,v1.orders.calls",
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;

    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    for i in 0..10 {
        let r = s.call_tool("write_order", json!({"i": i})).await;
        assert_semantic(&r, "upstream_failure");
    }
    for _ in 0..5 {
        assert_semantic(&s.call_tool("write_order", json!({})).await, "open");
    }
    let r = s.call_tool("read_order", json!({})).await;
    assert!(breaker_meta(&r).is_none(), "{}", r.body);
    // Tool names may contain dots, even a kind's name: the tags still split them right.
    let dotted = "v1.orders.calls";
    let r = s.call_tool(dotted, json!({})).await;
    assert!(breaker_meta(&r).is_none(), "{}", r.body);

    // The filter adds its counts to Envoy's counters on its tick (every 100 ms): read until
    // the last call shows, at most a few seconds.
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("http client");
    // Each worker ticks on its own: once the last call shows, one more tick of every worker.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut counted = false;
    let prom = loop {
        let resp = http
            .get(format!("{}/stats/prometheus", gw.envoy.admin_url()))
            .send()
            .await
            .expect("GET /stats/prometheus");
        assert_eq!(resp.status(), StatusCode::OK);
        let prom = resp.text().await.expect("prometheus text");
        if counted || Instant::now() > deadline {
            break prom;
        }
        counted = prom.lines().any(|l| {
            l.starts_with("toolgate_calls{")
                && l.contains("tool=\"v1.orders.calls\"")
                && l.ends_with(" 1")
        });
        let pause = if counted { 300 } else { 50 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    };
    let value = |name: &str, tool: &str| -> Option<f64> {
        let tool = format!("tool=\"{tool}\"");
        prom.lines().find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{')?;
            (metric == name && labels.contains("service=\"orders\"") && labels.contains(&tool))
                .then(|| value.parse::<f64>().ok())?
        })
    };
    let ours: Vec<&str> = prom.lines().filter(|l| l.contains("orders")).collect();
    let ours = ours.join("\n");
    for (name, tool, want) in [
        ("toolgate_calls", "write_order", 10.0),
        ("toolgate_failures", "write_order", 10.0),
        ("toolgate_slow", "write_order", 0.0),
        ("toolgate_rejected", "write_order", 5.0),
        ("toolgate_state", "write_order", 1.0),
        ("toolgate_calls", "read_order", 1.0),
        ("toolgate_failures", "read_order", 0.0),
        ("toolgate_rejected", "read_order", 0.0),
        ("toolgate_state", "read_order", 0.0),
        ("toolgate_calls", dotted, 1.0),
        ("toolgate_failures", dotted, 0.0),
    ] {
        assert_eq!(
            value(name, tool),
            Some(want),
            "{name}{{service=\"orders\",tool=\"{tool}\"}} in /stats/prometheus:\n{ours}"
        );
    }
    for (name, kind) in [
        ("toolgate_calls", "counter"),
        ("toolgate_failures", "counter"),
        ("toolgate_slow", "counter"),
        ("toolgate_rejected", "counter"),
        ("toolgate_state", "gauge"),
    ] {
        assert!(
            prom.lines().any(|l| l == format!("# TYPE {name} {kind}")),
            "{name} is a {kind}"
        );
    }
    // Every per-tool stat had its names taken out as tags: none is a metric of its own.
    assert!(
        !prom
            .lines()
            .any(|l| l.contains("toolgate_service") || l.contains("wasmcustom")),
        "untagged per-tool stats:\n{ours}"
    );
}

#[tokio::test]
async fn json_rpc_errors_in_an_sse_stream_count_and_is_error_results_only_by_policy() {
    let env =
        TestEnv::new("json_rpc_errors_in_an_sse_stream_count_and_is_error_results_only_by_policy");
    let gw = Stack::with(&env, Options::default().concurrency(1)).await;
    gw.policy("orders", json!({"min_calls": 4})).await;
    gw.policy("orders/read_order", json!({"count_is_error": true}))
        .await;
    // SSE responses (a stateful lab): the filter finds the event carrying the request's id.
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &[
            "--fail",
            "write_order=jsonrpc_error",
            "--fail",
            "echo=is_error",
            "--fail",
            "read_order=is_error",
        ],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let mut s = McpSession::connect(&gw.envoy.url("orders")).await;
    for tool in ["write_order", "echo", "read_order"] {
        for _ in 0..4 {
            let r = s.call_tool(tool, json!({})).await;
            assert!(
                r.content_type.starts_with("text/event-stream"),
                "{}",
                r.content_type
            );
            assert!(
                breaker_meta(&r).is_none_or(|m| m.is_null()),
                "the server's own answer passes untouched: {}",
                r.body
            );
        }
    }
    // A JSON-RPC error is a failure; an isError result is the tool's own answer unless the
    // policy counts it.
    assert_semantic(&s.call_tool("write_order", json!({})).await, "open");
    let r = s.call_tool("echo", json!({})).await;
    assert!(
        breaker_meta(&r).is_none_or(|m| m.is_null()),
        "isError does not count by default: {}",
        r.body
    );
    assert_semantic(&s.call_tool("read_order", json!({})).await, "open");
}
