//! A hostile agent against a gateway started as a user starts it (etcd, toolgate-xds, Envoy
//! from `toolgate-xds bootstrap` with the filter) in front of an MCP server built with the
//! official Python SDK, whose lenient JSON reading executes whatever gets through. Each test
//! sends what an attacker would, and checks on the server's own call counter that the tool did
//! not run, and that nothing opened. Where a test must see a request as it arrived, the server
//! is `toolgate-lab`, which reports it.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::h2client::{self, Abandon};
use toolgate_tests::{rss_kib, McpSession, Member, Reply, Stack, TestEnv};

const TTL: u32 = 10;

/// A gateway with `orders` served by the Python SDK server (stateless, JSON answers), and
/// `write_order` forced open by an operator.
async fn gateway(env: &TestEnv) -> (Stack, Member) {
    let stack = Stack::start(env).await;
    let member = stack.python_orders(env, TTL).await;
    stack
        .force(
            "orders",
            "write_order",
            "force_open",
            "incident 7: orders are frozen",
        )
        .await;
    (stack, member)
}

fn error_code(r: &Reply) -> Option<i64> {
    r.message.as_ref()?["error"]["code"].as_i64()
}

/// The honest calls work: the counters can tell a call that ran.
async fn honest_calls_behave(stack: &Stack, member: &Member) {
    let mut s = McpSession::unconnected(&stack.url("orders"));
    let r = s.call_tool("read_order", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        r.result().map(|v| v["isError"].clone()),
        Some(json!(false)),
        "{}",
        r.body
    );
    assert_eq!(member.server.calls("read_order").await, 1);
    let r = s.call_tool("write_order", json!({})).await;
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("forced_open"),
        "{}",
        r.body
    );
    // 16.12: no time to wait for, so no retry hint (before: 0, "retry now" to a retrier).
    let meta = &r.result().expect("a result")["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta.get("retryAfterSeconds"), None, "{}", r.body);
}

#[tokio::test]
async fn duplicate_keys_and_non_finite_numbers_never_run_a_forced_open_tool() {
    let env = TestEnv::new("duplicate_keys_and_non_finite_numbers_never_run_a_forced_open_tool");
    let (stack, member) = gateway(&env).await;
    honest_calls_behave(&stack, &member).await;

    let s = McpSession::unconnected(&stack.url("orders"));
    // What, the body, extra headers.
    type Attack<'a> = (&'a str, String, Vec<(&'a str, &'a str)>);
    let attacks: Vec<Attack> = vec![
        (
            "duplicate params.name",
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"read_order","name":"write_order","arguments":{}}}"#.into(),
            vec![],
        ),
        (
            "duplicate params",
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"read_order"},"params":{"name":"write_order"}}"#.into(),
            vec![],
        ),
        (
            "duplicate method",
            r#"{"jsonrpc":"2.0","id":4,"method":"tools/list","method":"tools/call","params":{"name":"write_order"}}"#.into(),
            vec![],
        ),
        (
            "escaped duplicate",
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"read_order","n\u0061me":"write_order"}}"#.into(),
            vec![],
        ),
        (
            "NaN",
            r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"write_order","arguments":{"x":NaN}}}"#.into(),
            vec![],
        ),
        (
            "Infinity, SSE only",
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_order","arguments":{"x":Infinity}}}"#.into(),
            vec![("accept", "text/event-stream")],
        ),
        (
            "-Infinity, 2026-07-28",
            r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"write_order","arguments":{"x":-Infinity},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}}}"#.into(),
            vec![
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/call"),
                ("mcp-name", "write_order"),
            ],
        ),
    ];
    for (what, body, headers) in &attacks {
        let r = s.post_raw(body.clone(), headers).await;
        let code = error_code(&r);
        assert!(
            matches!(code, Some(-32700) | Some(-32600)),
            "{what}: refused with a JSON-RPC parse or invalid-request error, got HTTP {} {}",
            r.status,
            r.body
        );
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{what}: {}", r.body);
        let message = r.message.as_ref().expect("a message")["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            message.contains("twice") || message.contains("not valid JSON"),
            "{what}: the reason is named: {message}"
        );
    }
    assert_eq!(
        member.server.calls("write_order").await,
        0,
        "the forced-open tool never ran"
    );
    assert_eq!(member.server.calls("read_order").await, 1);
}

#[tokio::test]
async fn a_body_ended_by_http2_trailers_is_judged_before_it_goes_on() {
    let env = TestEnv::new("a_body_ended_by_http2_trailers_is_judged_before_it_goes_on");
    let (stack, member) = gateway(&env).await;
    let port = stack.envoy.port;
    let call = br#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"write_order","arguments":{}}}"#;
    let r = h2client::post_with_trailers(port, "/mcp/orders", call).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        v["result"]["_meta"]["io.toolgate/breaker"]["state"], "forced_open",
        "{v}"
    );
    // The depth limit holds on this path too: the server never gets 100 levels.
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{{"name":"read_order","arguments":{{"x":{}{}}}}}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    let r = h2client::post_with_trailers(port, "/mcp/orders", deep.as_bytes()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("deeper"), "{}", r.body);
    assert_eq!(member.server.calls("write_order").await, 0);
    assert_eq!(member.server.calls("read_order").await, 0);
}

#[tokio::test]
async fn batches_and_method_headers_cannot_carry_a_call_past_the_judge() {
    let env = TestEnv::new("batches_and_method_headers_cannot_carry_a_call_past_the_judge");
    let (stack, member) = gateway(&env).await;
    let s = McpSession::unconnected(&stack.url("orders"));
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order"}},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"write_order"}}]"#;
    // Batching was removed in 2025-06-18.
    let r = s.post_raw(batch, &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(error_code(&r), Some(-32600), "{}", r.body);
    // 2025-03-26 had batches: every element is judged, and none of a refused batch runs.
    let r = s
        .post_raw(batch, &[("mcp-protocol-version", "2025-03-26")])
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let answers = r
        .message
        .as_ref()
        .and_then(Value::as_array)
        .expect("an array");
    assert_eq!(answers.len(), 2, "{}", r.body);
    assert_eq!(
        answers[1]["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "forced_open"
    );
    // A header that names another method does not spare the body from being read.
    let call = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"write_order","arguments":{},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}}}"#;
    let r = s
        .post_raw(
            call,
            &[
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/list"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(error_code(&r), Some(-32020), "{}", r.body);
    assert_eq!(member.server.calls("write_order").await, 0);
    assert_eq!(
        member.server.calls("read_order").await,
        0,
        "nothing of the batch ran"
    );
}

/// The shared routes go to the cluster the filter names in a header. A client's copy of that
/// header is not obeyed: on a service's path the path's service wins, and where the path names
/// no service Envoy answers 404 itself, whatever cluster the client named (a service's or
/// toolgate-xds's own).
#[tokio::test]
async fn a_forged_cluster_header_reaches_no_cluster_the_path_does_not_name() {
    let env = TestEnv::new("a_forged_cluster_header_reaches_no_cluster_the_path_does_not_name");
    let (stack, member) = gateway(&env).await;
    honest_calls_behave(&stack, &member).await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#;
    // Envoy's router marks what an upstream answered; its own 404 has no such mark.
    let post = |url: String, forged: &'static str| {
        let http = http.clone();
        async move {
            let r = http
                .post(&url)
                .header("accept", "application/json, text/event-stream")
                .header("content-type", "application/json")
                .header(
                    "mcp-protocol-version",
                    toolgate_tests::mcp::PROTOCOL_VERSION,
                )
                .header(toolgate_model::envoy::CLUSTER_HEADER, forged)
                .body(call)
                .send()
                .await
                .unwrap_or_else(|e| panic!("POST {url}: {e}"));
            let upstream = r.headers().contains_key("x-envoy-upstream-service-time");
            (r.status(), upstream, r.text().await.unwrap_or_default())
        }
    };
    for (path, forged) in [
        (stack.url("ghost"), "mcp.orders"),
        (stack.url("ghost"), "toolgate_control"),
        (stack.url(""), "mcp.orders"),
        (stack.url("bad%20name"), "mcp.orders"),
        (
            format!("{}/elsewhere", stack.url("").trim_end_matches("/mcp/")),
            "mcp.orders",
        ),
    ] {
        let (status, upstream, body) = post(path.clone(), forged).await;
        assert_eq!(
            status,
            StatusCode::NOT_FOUND,
            "{path} with {forged}: {body}"
        );
        assert!(
            !upstream,
            "{path} with {forged} reached an upstream: {body}"
        );
    }
    assert_eq!(
        member.server.calls("read_order").await,
        1,
        "no forged request reached orders (the one call is the honest one)"
    );
    // On the service's own path the forged header changes nothing: the call runs on the path's
    // service (what reaches the server is checked on the lab, in the next test).
    let (status, upstream, body) = post(
        format!("{}?trace=1", stack.url("orders")),
        "toolgate_control",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(upstream, "{body}");
    assert_eq!(member.server.calls("read_order").await, 2);
}

/// What the shared route sends on is what the client asked, minus the service in the path and
/// the cluster header: `toolgate-lab` reports the request line and headers it received.
#[tokio::test]
async fn the_shared_route_keeps_the_query_and_never_passes_the_cluster_header_on() {
    let env =
        TestEnv::new("the_shared_route_keeps_the_query_and_never_passes_the_cluster_header_on");
    let stack = Stack::start(&env).await;
    let member = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&member]).await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": toolgate_tests::mcp::PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "abuse", "version": "1"}}});
    for (query, forged) in [
        ("?x=1&y=a%2Fb%3F", "mcp.orders"),
        ("?mcp/orders=1", "toolgate_control"),
        ("", "mcp.ghost"),
    ] {
        let url = format!("{}{query}", stack.url("orders"));
        let r = http
            .post(&url)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .header(toolgate_model::envoy::CLUSTER_HEADER, forged)
            .body(initialize.to_string())
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        assert_eq!(status, StatusCode::OK, "POST {url} with {forged}: {body}");
        let seen = member.server.control().await;
        assert_eq!(
            seen["last_request"],
            format!("POST /mcp{query}"),
            "POST {url} with {forged}: {seen}"
        );
        assert!(
            seen["headers"]
                .get(toolgate_model::envoy::CLUSTER_HEADER)
                .is_none(),
            "the cluster header reached the server: {seen}"
        );
    }
    assert_eq!(member.server.control().await["initializes"], 3);
}

/// The tool's breaker state as the filter's stats show it (0 closed, 1 open, 2 half-open),
/// and whether the fleet has an opening in etcd.
async fn opened(stack: &Stack, tool: &str) -> (u64, bool) {
    let gauge = stack
        .envoy
        .tool_stat("toolgate_state", "orders", tool)
        .await
        .unwrap_or(0.0) as u64;
    let mut c = stack.etcd.client().await;
    let key = format!("/mcp/breakers/orders/{tool}");
    let in_etcd = c
        .get(key, None)
        .await
        .map(|r| !r.kvs().is_empty())
        .unwrap_or(false);
    (gauge, in_etcd)
}

#[tokio::test]
async fn a_clients_bad_arguments_never_open_a_healthy_tool() {
    let env = TestEnv::new("a_clients_bad_arguments_never_open_a_healthy_tool");
    let (stack, member) = gateway(&env).await;
    let s = McpSession::unconnected(&stack.url("orders"));
    let mut id = 100;
    for params in [
        r#"{"name":"read_order","arguments":5}"#,
        r#"{"name":"read_order","arguments":[1]}"#,
        r#"{"name":"read_order","arguments":"x"}"#,
        r#"{"name":"read_order","_meta":"x"}"#,
        r#"{"name":"read_order","task":5}"#,
    ] {
        for _ in 0..12 {
            id += 1;
            let body =
                format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{params}}}"#);
            let r = s.post_raw(body, &[]).await;
            assert!(
                error_code(&r) == Some(-32602) || r.breaker_state().is_none(),
                "{params}: the server's own answer, not the gateway's: {}",
                r.body
            );
        }
    }
    let (gauge, in_etcd) = opened(&stack, "read_order").await;
    assert_eq!(
        (gauge, in_etcd),
        (0, false),
        "60 bad requests opened nothing"
    );
    let mut honest = McpSession::unconnected(&stack.url("orders"));
    let r = honest.call_tool("read_order", json!({})).await;
    assert_eq!(r.breaker_state(), None, "{}", r.body);
    assert!(member.server.calls("read_order").await >= 1);
    let registry = stack.xds.registry().await;
    let state = &registry["services"]["orders"][0]["state"];
    assert_eq!(state, "UP", "{registry}");
}

#[tokio::test]
async fn a_client_that_abandons_slow_calls_is_no_evidence_against_the_tool() {
    let env = TestEnv::new("a_client_that_abandons_slow_calls_is_no_evidence_against_the_tool");
    let (stack, member) = gateway(&env).await;
    let port = stack.envoy.port;
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_order","arguments":{"seconds":3}}}"#;
    let mut tasks = Vec::new();
    for i in 0..15 {
        let how = match i % 3 {
            0 => Abandon::Cancel,
            1 => Abandon::ProtocolError,
            _ => Abandon::DataAfterEnd,
        };
        tasks.push(tokio::spawn(h2client::post_and_abandon(
            port,
            "/mcp/orders",
            &[],
            body,
            Duration::from_millis(300),
            how,
        )));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    // Every call reached the tool (the cancels came while it ran), and none counts.
    toolgate_tests::wait_until(
        "the server saw the calls",
        Duration::from_secs(10),
        || async { member.server.calls("slow_order").await >= 10 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await; // the calls end on the server side
    let (gauge, in_etcd) = opened(&stack, "slow_order").await;
    assert_eq!((gauge, in_etcd), (0, false), "cancels opened nothing");
    let registry = stack.xds.registry().await;
    let instance = &registry["services"]["orders"][0];
    assert_eq!(instance["state"], "UP", "{registry}");
    let hosts = stack.envoy.hosts().await;
    let weight = hosts
        .get("orders")
        .and_then(|h| h.first())
        .map(|h| h.weight);
    assert_eq!(
        weight,
        Some(100),
        "Envoy's weight for the instance: {hosts:?}"
    );
}

#[tokio::test]
async fn names_nobody_registered_create_no_state_in_envoy() {
    let env = TestEnv::new("names_nobody_registered_create_no_state_in_envoy");
    let (stack, _member) = gateway(&env).await;
    let envoy_pid = stack.envoy.proc.as_ref().expect("envoy").pid();
    let http = reqwest::Client::new();
    let post = |url: String, body: String| {
        let http = http.clone();
        async move {
            http.post(url)
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(599)
        }
    };
    let warm = |n| {
        let url = stack.url("orders");
        futures::future::join_all((0..n).map(move |i| {
            post(
                url.clone(),
                format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/call","params":{{"name":"read_order"}}}}"#),
            )
        }))
    };
    warm(200).await;
    let before = rss_kib(envoy_pid);
    let series = |prom: String| prom.lines().filter(|l| l.starts_with("toolgate_")).count();
    let stats_before = series(stack.envoy.prometheus().await);
    let mut statuses = std::collections::BTreeMap::new();
    for round in 0..20 {
        let mut batch = Vec::new();
        for i in 0..100 {
            let n = round * 100 + i;
            // A 40 KB service name no route knows, and a made-up tool on a real service.
            let service = format!("{}{n}", "s".repeat(40_000));
            batch.push(post(
                format!("http://127.0.0.1:{}/mcp/{service}", stack.envoy.port),
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order"}}"#
                    .into(),
            ));
            batch.push(post(
                stack.url("orders"),
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"fake_{n}"}}}}"#),
            ));
        }
        for status in futures::future::join_all(batch).await {
            *statuses.entry(status).or_insert(0) += 1;
        }
    }
    let after = rss_kib(envoy_pid);
    let grown_mib = after.saturating_sub(before) as f64 / 1024.0;
    println!(
        "envoy RSS {} -> {} KiB (+{grown_mib:.1} MiB) after 4,000 requests naming unknown services and tools; statuses {statuses:?}",
        before, after
    );
    assert!(grown_mib < 64.0, "Envoy grew by {grown_mib:.1} MiB");
    assert_eq!(
        series(stack.envoy.prometheus().await),
        stats_before,
        "no stat defined for names nobody registered"
    );
}

/// 17.11: the session id a client gets carries no upstream address (Envoy's session affinity
/// writes one in; the filter seals it), the sealed id still keeps the session on its instance,
/// and an id a client writes itself picks no instance (the server answers 404).
#[tokio::test]
async fn session_ids_carry_no_upstream_address() {
    use base64::Engine;
    let env = TestEnv::new("session_ids_carry_no_upstream_address");
    let stack = Stack::start(&env).await;
    let member = Member::python(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&member]).await;
    let mut s = McpSession::connect(&stack.url("orders")).await;
    let sealed = s.session.clone().expect("a session id");
    let address = base64::engine::general_purpose::STANDARD.encode(member.server.endpoint());
    println!("session id the client got: {sealed}");
    assert!(sealed.starts_with("tgs1."), "{sealed}");
    assert!(!sealed.contains(&address), "{sealed} carries {address}");
    for _ in 0..3 {
        let r = s.call_tool("read_order", json!({})).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "the sealed id keeps the session: {}",
            r.body
        );
        assert_eq!(r.breaker_state(), None, "{}", r.body);
    }
    assert_eq!(member.server.calls("read_order").await, 3);
    // An envelope the client wrote itself: the address of the instance and the server's id.
    let server_id = "0123456789abcdef0123456789abcdef";
    let mut forged = McpSession::unconnected(&stack.url("orders"));
    forged.session = Some(format!("{address};{server_id}"));
    let r = forged.call_tool("read_order", json!({})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
    let mut tampered = McpSession::unconnected(&stack.url("orders"));
    tampered.session = Some(format!("{sealed}x"));
    let r = tampered.call_tool("read_order", json!({})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
    assert_eq!(member.server.calls("read_order").await, 3);
}
