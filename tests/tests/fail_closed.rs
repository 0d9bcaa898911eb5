//! Fail closed: ordinary events (a client that accepts gzip, cancels its calls or sends another
//! HTTP method, headers that are not text, a server that compresses or lists tools oddly, a
//! service guarded by rules alone) never switch the gateway's judgment off. Real etcd,
//! toolgate-xds, Envoy with the filter, and servers on the official Python SDK (whose lenient
//! reading runs whatever gets through) or `toolgate-lab` (which reports what it received).

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{
    wait_until, Issuer, McpServer, McpSession, Member, Registrant, Reply, Stack, TestEnv,
};

const TTL: u32 = 10;

/// Turns the gateway's token checks on against `issuer` (`required`: the services that need a
/// token) and lets `subject` call the `read_*` tools of `orders`; returns once the filter has
/// the rules of `orders`.
async fn rules_on(stack: &Stack, issuer: &Issuer, required: Value, subject: &str) {
    let config = issuer.auth_config(&stack.base_url(), required);
    let (status, body) = stack
        .admin(Method::PUT, "/v1/auth/config", Some(&config))
        .await;
    assert!(status.is_success(), "{status}: {body}");
    let rules = json!({"rules": [{"tools": ["read_*"], "subjects": [subject]}]});
    let (status, body) = stack
        .admin(Method::PUT, "/v1/auth/rules/orders", Some(&rules))
        .await;
    assert!(status.is_success(), "{status}: {body}");
    stack
        .wait_filter_config("the rules of orders", |c| {
            c["auth"]["services"]["orders"].is_object()
        })
        .await;
}

fn error_code(r: &Reply) -> Option<i64> {
    r.message.as_ref()?["error"]["code"].as_i64()
}

/// An HTTP client that sends exactly what it is given (no decompression, no redirects).
fn raw_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .no_proxy()
        .build()
        .expect("http client")
}

/// One request to the gateway with `method`, `headers` (values as bytes) and `body`: status,
/// headers and body text.
async fn send(
    url: &str,
    method: &str,
    headers: &[(&str, &[u8])],
    body: Option<String>,
) -> (StatusCode, HeaderMap, String) {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        map.insert(
            HeaderName::try_from(*k).expect("header name"),
            HeaderValue::from_bytes(v).expect("header value"),
        );
    }
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = raw_client().request(method, url).headers(map);
    if let Some(b) = body {
        req = req.body(b);
    }
    let resp = req.send().await.expect("the gateway answers");
    let status = resp.status();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap_or_default())
}

fn call_body(id: u64, tool: &str, arguments: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": tool, "arguments": arguments}})
    .to_string()
}

/// The first JSON-RPC message of a JSON or SSE body.
fn message_of(body: &str) -> Option<Value> {
    let text = body
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or(body);
    serde_json::from_str(text.trim()).ok()
}

/// Whether the fleet's etcd holds an opening of (service, tool).
async fn opened_in_etcd(stack: &Stack, service: &str, tool: &str) -> bool {
    let mut c = stack.etcd.client().await;
    let key = format!("/mcp/breakers/{service}/{tool}");
    c.get(key, None)
        .await
        .map(|r| !r.kvs().is_empty())
        .unwrap_or(false)
}

#[tokio::test]
async fn a_service_with_rules_needs_a_token_for_every_request() {
    let env = TestEnv::new("a_service_with_rules_needs_a_token_for_every_request");
    let issuer = Issuer::start().await;
    let stack = Stack::start(&env).await;
    let m = Member::python(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&m]).await;
    let url = stack.url("orders");
    // Tokens are required only by `billing`; `orders` has rules and no entry in `required`.
    rules_on(&stack, &issuer, json!(["billing"]), "*").await;

    // Without a token, nothing of `orders` answers: not initialize, not its resources or
    // prompts, not ping, not its GET stream.
    let mut s = McpSession::unconnected(&url);
    let init = s.initialize().await;
    let mut answers = vec![("initialize", init.status, init.body.clone())];
    for (method, params) in [
        ("resources/read", json!({"uri": "secret://report"})),
        ("prompts/get", json!({"name": "greeting"})),
        ("ping", json!({})),
    ] {
        let r = s.request(method, params).await;
        answers.push((method, r.status, r.body));
    }
    let (status, _, body) = send(&url, "GET", &[("accept", b"text/event-stream")], None).await;
    answers.push(("GET stream", status, body));
    for (what, status, body) in &answers {
        assert!(
            !body.contains("TOP-SECRET"),
            "{what}: the resource leaked: {body}"
        );
        assert_eq!(
            *status,
            StatusCode::UNAUTHORIZED,
            "{what}: a service with rules needs a token for every request: {body}"
        );
    }
    assert_eq!(m.server.calls("secret_report").await, 0);
    assert_eq!(m.server.calls("greeting").await, 0);

    // Nor through `/mcp`, which needs no token itself but routes the resource and the prompt
    // to `orders`.
    stack
        .wait_filter_config("the routes of orders' prompt and resource on /mcp", |c| {
            c["virtual_servers"]["default"]["prompts"]["orders__greeting"].is_object()
                && c["virtual_servers"]["default"]["resources"]["secret://report"].is_object()
        })
        .await;
    let aggregate = stack.aggregate_url();
    let mut s = McpSession::unconnected(&aggregate);
    assert_eq!(s.initialize().await.status, StatusCode::OK);
    for (method, params) in [
        ("resources/read", json!({"uri": "secret://report"})),
        ("prompts/get", json!({"name": "orders__greeting"})),
    ] {
        let r = s.request(method, params).await;
        assert!(!r.body.contains("TOP-SECRET"), "/mcp {method}: {}", r.body);
        assert_eq!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "/mcp {method}: {}",
            r.body
        );
    }
    assert_eq!(m.server.calls("secret_report").await, 0);
    assert_eq!(m.server.calls("greeting").await, 0);

    // A caller with a valid token reads it.
    let token = issuer.token().sub("alice").aud(&url).sign();
    wait_until(
        "a caller with a token reads the resource",
        Duration::from_secs(20),
        || async {
            let mut s = McpSession::unconnected(&url);
            s.bearer = Some(token.clone());
            if s.initialize().await.status != StatusCode::OK {
                return false;
            }
            let r = s
                .request("resources/read", json!({"uri": "secret://report"}))
                .await;
            r.body.contains("TOP-SECRET")
        },
    )
    .await;
    // A token for `/mcp` (its audience is the endpoint's URL).
    let mut s = McpSession::unconnected(&aggregate);
    s.bearer = Some(issuer.token().sub("alice").aud(&aggregate).sign());
    assert_eq!(s.initialize().await.status, StatusCode::OK);
    let r = s
        .request("resources/read", json!({"uri": "secret://report"}))
        .await;
    assert!(
        r.body.contains("TOP-SECRET"),
        "/mcp with a token: {}",
        r.body
    );
}

#[tokio::test]
async fn a_client_that_accepts_gzip_never_opens_a_healthy_tool() {
    let env = TestEnv::new("a_client_that_accepts_gzip_never_opens_a_healthy_tool");
    let stack = Stack::start(&env).await;
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response", "--gzip"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    stack
        .policy(
            "orders",
            json!({"min_calls": 5, "failure_rate_percent": 50}),
        )
        .await;
    let url = stack.url("orders");
    let headers: [(&str, &[u8]); 4] = [
        ("accept", b"application/json, text/event-stream"),
        ("content-type", b"application/json"),
        ("mcp-protocol-version", b"2025-06-18"),
        ("accept-encoding", b"gzip"),
    ];
    for i in 0..10 {
        let (status, h, body) = send(
            &url,
            "POST",
            &headers,
            Some(call_body(i, "read_order", json!({}))),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let encoding = h
            .get("content-encoding")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("identity");
        // What reaches the client is what its headers say: here, the server's own answer.
        let message = message_of(&body)
            .unwrap_or_else(|| panic!("call {i}: not JSON under encoding {encoding}: {body:?}"));
        assert_eq!(
            message["result"]["isError"], false,
            "call {i} (encoding {encoding}): {message}"
        );
        assert!(body.contains("order o-1"), "the tool's own answer: {body}");
    }
    assert_eq!(m.server.calls("read_order").await, 10);
    // Nothing opened, here or for the fleet, and another client is served.
    assert!(!opened_in_etcd(&stack, "orders", "read_order").await);
    let mut other = McpSession::unconnected(&url);
    let r = other.call_tool("read_order", json!({})).await;
    assert_eq!(r.breaker_state(), None, "{}", r.body);
    assert_eq!(
        r.result().map(|v| v["isError"].clone()),
        Some(json!(false)),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn a_client_cancelling_its_own_calls_never_opens_a_healthy_tool() {
    let env = TestEnv::new("a_client_cancelling_its_own_calls_never_opens_a_healthy_tool");
    let stack = Stack::start(&env).await;
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--json-response"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    stack
        .policy(
            "orders/slow_order",
            json!({"min_calls": 5, "failure_rate_percent": 50, "slow_call_ms": 60000}),
        )
        .await;
    let url = stack.url("orders");
    let session = McpSession::connect(&url).await;
    let sid = session.session.clone().expect("a session id");
    let headers: Vec<(&str, &[u8])> = vec![
        ("accept", b"application/json, text/event-stream"),
        ("content-type", b"application/json"),
        ("mcp-protocol-version", b"2025-06-18"),
        ("mcp-session-id", sid.as_bytes()),
    ];
    let mut answers = Vec::new();
    for i in 0..12u64 {
        let id = 100 + i;
        let call = {
            let url = url.clone();
            let headers: Vec<(String, Vec<u8>)> = headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_vec()))
                .collect();
            tokio::spawn(async move {
                let h: Vec<(&str, &[u8])> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_slice()))
                    .collect();
                send(
                    &url,
                    "POST",
                    &h,
                    Some(call_body(id, "slow_order", json!({"seconds": 1.5}))),
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": id, "reason": "the user gave up"}});
        let (status, _, body) = send(&url, "POST", &headers, Some(cancel.to_string())).await;
        assert!(
            status.is_success(),
            "the cancellation went through: {status} {body}"
        );
        let (_, _, body) = call.await.expect("the call's task");
        answers.push(body);
    }
    // The server saw every call, and each cancellation.
    assert_eq!(m.server.calls("slow_order").await, 12, "{answers:#?}");
    assert!(
        !opened_in_etcd(&stack, "orders", "slow_order").await,
        "{answers:#?}"
    );
    let mut other = McpSession::connect(&url).await;
    let r = other.call_tool("slow_order", json!({"seconds": 0.1})).await;
    assert_eq!(
        r.breaker_state(),
        None,
        "the tool is still closed: {}\nthe cancelled calls got: {answers:#?}",
        r.body
    );
    assert!(r.text().contains("slept"), "{}", r.body);
}

#[tokio::test]
async fn made_up_names_never_switch_a_services_breakers_off() {
    let env = TestEnv::new("made_up_names_never_switch_a_services_breakers_off");
    let stack = Stack::start(&env).await;
    let server = McpServer::python(&env, "bare-1", &["--stateless", "--json-response"]).await;
    // A registration that lists no tools (written as an older registrar, or another system,
    // would): the gateway must learn the names from the server itself.
    let value = json!({"instance_id": "bare-1", "endpoint": server.endpoint(), "tools": []});
    stack
        .put("/mcp/services/bare/bare-1", &value.to_string())
        .await;
    stack
        .wait_healthy_addresses("bare", &[server.endpoint()], Duration::from_secs(20))
        .await;
    stack
        .policy(
            "bare",
            json!({"count_is_error": true, "min_calls": 10, "failure_rate_percent": 50}),
        )
        .await;
    wait_until(
        "toolgate-xds read the tools bare's server lists",
        Duration::from_secs(20),
        || async { stack.xds.catalog().await.to_string().contains("fail_order") },
    )
    .await;
    // What toolgate-xds read reaches the filters with its next push (milliseconds).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let url = stack.url("bare");
    let mut s = McpSession::unconnected(&url);
    for i in 0..64 {
        let r = s.call_tool(&format!("made_up_{i}"), json!({})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    let mut refused = 0;
    for _ in 0..21 {
        let r = s.call_tool("fail_order", json!({})).await;
        if r.breaker_state().is_some() {
            refused += 1;
        }
    }
    let ran = m_calls(&server, "fail_order").await;
    assert!(
        refused > 0 && ran < 21,
        "the failing tool's breaker opened after made-up names: {ran} of 21 calls ran, \
         {refused} refused"
    );
    // The made-up names got no stats of their own.
    let stats = stack.envoy.prometheus().await;
    assert!(
        !stats.contains("tool=\"made_up_"),
        "made-up names have stats:\n{}",
        stats
            .lines()
            .filter(|l| l.contains("made_up_"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

async fn m_calls(server: &McpServer, tool: &str) -> u64 {
    server.calls(tool).await
}

#[tokio::test]
async fn other_http_methods_never_carry_a_call_past_the_judge() {
    let env = TestEnv::new("other_http_methods_never_carry_a_call_past_the_judge");
    let stack = Stack::start(&env).await;
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response", "--any-method"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    stack
        .force("orders", "write_order", "force_open", "orders are frozen")
        .await;
    let headers: [(&str, &[u8]); 3] = [
        ("accept", b"application/json, text/event-stream"),
        ("content-type", b"application/json"),
        ("mcp-protocol-version", b"2025-06-18"),
    ];
    let mut seen = Vec::new();
    for path in [
        stack.url("orders"),
        stack.url("orders").replace("/mcp/orders", "/mcp"),
    ] {
        for method in ["PUT", "PATCH", "OPTIONS", "DELETE", "GET"] {
            let (status, h, body) = send(
                &path,
                method,
                &headers,
                Some(call_body(1, "write_order", json!({}))),
            )
            .await;
            let expected = if matches!(method, "GET" | "DELETE") {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::METHOD_NOT_ALLOWED
            };
            seen.push(format!("{method} {path}: {status} {body}"));
            assert_eq!(status, expected, "{method} {path}: {body}");
            let message = message_of(&body).expect("a JSON-RPC error");
            assert!(message["error"]["code"].is_i64(), "{message}");
            if status == StatusCode::METHOD_NOT_ALLOWED {
                assert_eq!(
                    h.get("allow").and_then(|v| v.to_str().ok()),
                    Some("GET, POST, DELETE")
                );
            }
        }
    }
    assert_eq!(
        m.server.calls("write_order").await,
        0,
        "the forced-open tool never ran: {seen:#?}"
    );
    // The transport's own uses still reach the server: a DELETE without a body is this
    // stateless server's to answer (it has no sessions to end).
    let (status, _, body) = send(
        &stack.url("orders"),
        "DELETE",
        &[("mcp-session-id", b"no-such-session")],
        None,
    )
    .await;
    assert!(
        !body.contains("the gateway refuses") && status != StatusCode::BAD_REQUEST,
        "a DELETE without a body is not the gateway's to refuse: {status} {body}"
    );
}

#[tokio::test]
async fn claim_headers_a_client_writes_never_reach_a_server() {
    let env = TestEnv::new("claim_headers_a_client_writes_never_reach_a_server");
    let stack = Stack::start(&env).await;
    let m = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&m]).await;
    // A rule set that copies `sub` into `x-caller`, stored while no auth configuration is.
    let rules = json!({"rules": [{"tools": ["*"], "subjects": ["*"]}],
                       "claim_headers": {"sub": "x-caller"}});
    let (status, body) = stack
        .admin(Method::PUT, "/v1/auth/rules/orders", Some(&rules))
        .await;
    assert!(status.is_success(), "{status}: {body}");
    // Given time to reach the filter (a gateway that never delivers the names fails below,
    // on what the server received).
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        stack.wait_filter_config("the claim header names", |c| {
            c["claim_header_names"]
                .as_array()
                .is_some_and(|n| n.iter().any(|h| h == "x-caller"))
        }),
    )
    .await;
    let session = McpSession::connect(&stack.url("orders")).await;
    let sid = session.session.clone().expect("a session id");
    let (status, _, body) = send(
        &stack.url("orders"),
        "POST",
        &[
            ("accept", b"application/json, text/event-stream"),
            ("content-type", b"application/json"),
            ("mcp-protocol-version", b"2025-06-18"),
            ("mcp-session-id", sid.as_bytes()),
            ("x-caller", b"root"),
            ("x_caller", b"root"),
        ],
        Some(call_body(1, "read_order", json!({}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = m.server.control().await;
    let headers = &seen["headers"];
    assert!(
        headers.get("x-caller").is_none() && headers.get("x_caller").is_none(),
        "a claim header the client wrote reached the server: {headers}"
    );
}

#[tokio::test]
async fn a_session_id_opens_only_on_its_own_services_route() {
    let env = TestEnv::new("a_session_id_opens_only_on_its_own_services_route");
    let stack = Stack::start(&env).await;
    // One server behind two services: the same address in both clusters.
    let server = McpServer::python(&env, "shared-1", &["--json-response"]).await;
    let mut registrars = Vec::new();
    for service in ["orders", "billing"] {
        let r = Registrant::new(&stack.etcd.endpoint(), service, &server.endpoint())
            .arg("--instance-id", &format!("{service}-1"))
            .arg("--tools", "read_order,write_order,fail_order,slow_order")
            .arg("--ttl", "10");
        registrars.push(r.spawn(&env, &format!("{service}.registrar")));
        stack
            .wait_healthy_addresses(service, &[server.endpoint()], Duration::from_secs(20))
            .await;
    }
    let mut orders = McpSession::connect(&stack.url("orders")).await;
    assert!(orders
        .call_tool("read_order", json!({}))
        .await
        .text()
        .contains("order"));
    let sealed = orders.session.clone().expect("a session id");
    assert!(sealed.starts_with("tgs1."), "{sealed}");
    // The same id on another service's route: it does not open there.
    let mut billing = McpSession::unconnected(&stack.url("billing"));
    billing.session = Some(sealed);
    let r = billing.call_tool("read_order", json!({})).await;
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "an id sealed for orders is unknown on billing's route: {}",
        r.body
    );
    drop(registrars);
}

#[tokio::test]
async fn headers_that_are_not_text_are_refused() {
    let env = TestEnv::new("headers_that_are_not_text_are_refused");
    let stack = Stack::start(&env).await;
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    let url = stack.url("orders");
    let base: [(&str, &[u8]); 2] = [
        ("accept", b"application/json, text/event-stream"),
        ("content-type", b"application/json"),
    ];
    // Invisible to a reader of text, each would pass unjudged: a token the filter cannot
    // take off, a session id it cannot unseal, a method header it cannot check.
    for (name, value) in [
        ("authorization", b"Bearer \xff\xfe-token".as_slice()),
        ("mcp-session-id", b"\xffMTI3LjAuMC4xOjE=;x".as_slice()),
        ("mcp-method", b"tools/\xffcall".as_slice()),
    ] {
        let mut headers = base.to_vec();
        headers.push((name, value));
        let (status, _, body) = send(
            &url,
            "POST",
            &headers,
            Some(call_body(1, "read_order", json!({}))),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}: {body}");
        let message = message_of(&body).expect("a JSON-RPC error");
        assert!(
            message["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(name)),
            "{name}: the header is named: {message}"
        );
    }
    assert_eq!(
        m.server.calls("read_order").await,
        0,
        "nothing reached the server"
    );
}

#[tokio::test]
async fn an_sse_listing_the_gateway_cannot_filter_is_not_shown() {
    let env = TestEnv::new("an_sse_listing_the_gateway_cannot_filter_is_not_shown");
    let issuer = Issuer::start().await;
    let stack = Stack::start(&env).await;
    let m = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&m]).await;
    let url = stack.url("orders");
    rules_on(&stack, &issuer, json!(["*"]), "alice").await;
    let token = issuer.token().sub("alice").aud(&url).sign();
    let listing = || async {
        let mut s = McpSession::unconnected(&url);
        s.bearer = Some(token.clone());
        s.initialize().await;
        s.list_tools().await
    };
    wait_until(
        "alice lists only what she may call",
        Duration::from_secs(20),
        || async {
            let r = listing().await;
            r.body.contains("read_order") && !r.body.contains("write_order")
        },
    )
    .await;
    // The server answers its listing in a form no strict reader can read.
    m.server.set(json!({"listing_unreadable": true})).await;
    let r = listing().await;
    assert!(
        !r.body.contains("write_order"),
        "a tool alice may not call was shown: {}",
        r.body
    );
    assert_eq!(
        error_code(&r),
        Some(-32603),
        "the listing is replaced by an error: {}",
        r.body
    );
}

#[tokio::test]
async fn a_tool_the_gateway_holds_no_state_for_is_answered_by_its_server() {
    let env = TestEnv::new("a_tool_the_gateway_holds_no_state_for_is_answered_by_its_server");
    let stack = Stack::start(&env).await;
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    let mut s = McpSession::unconnected(&stack.url("orders"));
    let r = s.call_tool("no_such_tool", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.breaker_state(), None, "{}", r.body);
    // The server's own words (the Python SDK answers an unknown tool with an error result).
    assert!(
        r.text().contains("Unknown tool: no_such_tool"),
        "the server answered for itself: {}",
        r.body
    );
    // An operator's override still names it: forced open by the gateway, unrun.
    stack
        .force("orders", "no_such_tool", "force_open", "not now")
        .await;
    let r = s.call_tool("no_such_tool", json!({})).await;
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("forced_open"),
        "{}",
        r.body
    );
}

/// A filter configuration the filter refuses (here: a newer toolgate-xds's value an older
/// filter does not accept, made with toolgate-xds's `TOOLGATE_FAILPOINT_SKEW_FILTER_CONFIG`,
/// since toolgate-xds itself never sends one) never leaves the gateway judging nothing: the
/// filter keeps the last configuration it accepted (the operator's force-open holds), counts
/// and reports the refusal, and a filter that never accepted one refuses every call in MCP.
#[tokio::test]
async fn a_refused_filter_configuration_keeps_the_last_good_one() {
    use toolgate_tests::{Envoy, Etcd, Xds};
    let env = TestEnv::new("a_refused_filter_configuration_keeps_the_last_good_one");
    let skew = env.dir().join("skew.json");
    let etcd = Etcd::start(&env).await;
    let skew_path = skew.display().to_string();
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--admin-token-env", "TOOLGATE_TEST_ADMIN_TOKEN"],
        &[
            ("TOOLGATE_TEST_ADMIN_TOKEN", ADMIN_TOKEN),
            ("TOOLGATE_FAILPOINT_SKEW_FILTER_CONFIG", &skew_path),
        ],
    )
    .await;
    let envoy = Envoy::start_with_filter(&env, "envoy", &xds, 2, &[]).await;
    let stack = Stack { etcd, xds, envoy };
    let m = Member::python(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack.routes("orders", &[&m]).await;
    stack
        .force(
            "orders",
            "write_order",
            "force_open",
            "frozen for the audit",
        )
        .await;
    let forced = |r: &Reply| r.breaker_state().as_deref() == Some("forced_open");
    let mut s = McpSession::unconnected(&stack.url("orders"));
    assert!(forced(&s.call_tool("write_order", json!({})).await));

    // From now on every configuration toolgate-xds sends carries a value this filter refuses.
    std::fs::write(&skew, r#"{"max_body_bytes": 0}"#).expect("write the skew");
    stack
        .put("/mcp/policies/orders", r#"{"min_calls": 7}"#)
        .await;
    stack
        .wait_filter_config("the refused configuration", |c| c["max_body_bytes"] == 0)
        .await;
    wait_until(
        "the filter counted the refusal",
        Duration::from_secs(20),
        || async {
            stack
                .envoy
                .prometheus()
                .await
                .lines()
                .any(|l| l.starts_with("toolgate_filter_config_rejected") && !l.ends_with(" 0"))
        },
    )
    .await;
    for _ in 0..5 {
        let r = s.call_tool("write_order", json!({})).await;
        assert!(forced(&r), "still forced open: {}", r.body);
    }
    assert_eq!(m.server.calls("write_order").await, 0, "the tool never ran");
    // toolgate-xds shows the Envoy as refusing its configuration.
    let envoys = || async {
        reqwest::Client::new()
            .get(format!("{}/v1/envoys", stack.xds.admin_url()))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("/v1/envoys")
            .json::<Value>()
            .await
            .unwrap_or(Value::Null)
    };
    wait_until(
        "/v1/envoys shows the refusal",
        Duration::from_secs(20),
        || async { envoys().await.to_string().contains("rejected") },
    )
    .await;

    // An Envoy that never got a configuration its filter accepts refuses every call, in MCP.
    let fresh = Envoy::start_with_filter(&env, "envoy-fresh", &stack.xds, 1, &[]).await;
    wait_until(
        "the fresh Envoy routes orders",
        Duration::from_secs(20),
        || async { !fresh.addresses("orders").await.is_empty() },
    )
    .await;
    let mut s2 = McpSession::unconnected(&fresh.url("orders"));
    let r = s2.call_tool("read_order", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("unconfigured"),
        "{}",
        r.body
    );
    assert_eq!(
        m.server.calls("read_order").await,
        0,
        "nothing ran unjudged"
    );

    // The skew gone, the next configuration is taken and the Envoy shows healthy again.
    std::fs::remove_file(&skew).expect("remove the skew");
    stack
        .put("/mcp/policies/orders", r#"{"min_calls": 8}"#)
        .await;
    wait_until(
        "a call is judged on the fresh Envoy",
        Duration::from_secs(20),
        || async {
            let r = McpSession::unconnected(&fresh.url("orders"))
                .call_tool("read_order", json!({}))
                .await;
            r.text().contains("order o-1")
        },
    )
    .await;
    wait_until(
        "/v1/envoys shows the Envoys accept their configuration again",
        Duration::from_secs(20),
        || async { !envoys().await.to_string().contains("rejected") },
    )
    .await;
}
