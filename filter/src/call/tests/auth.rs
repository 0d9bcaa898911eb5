//! Issue 20: the caller from Envoy's verified payload, and the per-tool rules.

use super::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use toolgate_model::auth::{AuthConfig, FilterAuth, ToolRules, PAYLOAD_HEADER};

fn with_auth(w: &Worker, required: &[&str], rules: Option<Value>) {
    let config = AuthConfig::parse(
        serde_json::json!({
            "resource": "http://gw",
            "authorization_servers": ["http://idp"],
            "required": required,
            "issuers": [{"issuer": "http://idp", "jwks": {"inline": {"keys": [{}]}}}]
        })
        .to_string()
        .as_bytes(),
    )
    .expect("valid");
    let services = rules
        .map(|r| {
            BTreeMap::from([(
                "orders".to_string(),
                ToolRules::parse(r.to_string().as_bytes()).expect("valid rules"),
            )])
        })
        .unwrap_or_default();
    w.shared.borrow_mut().config.auth = Some(FilterAuth::new(&config, services, BTreeMap::new()));
}

fn payload(claims: Value) -> String {
    URL_SAFE_NO_PAD.encode(claims.to_string())
}

fn reader() -> String {
    payload(
        serde_json::json!({"iss": "http://idp", "aud": "http://gw/mcp/orders", "sub": "alice", "roles": ["reader"], "scope": "orders:read"}),
    )
}

fn call(w: &mut Worker, tool: &str, headers: &[(&str, &str)]) -> Flight {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{tool}","arguments":{{}}}}}}"#
    );
    w.request("orders", headers, &body)
}

fn challenge(f: &Flight) -> String {
    f.stream.reply_headers.borrow()[0]
        .iter()
        .find(|(k, _)| k == "www-authenticate")
        .map(|(_, v)| v.clone())
        .expect("a challenge")
}

#[test]
fn without_a_token_a_protected_service_answers_401_naming_its_metadata() {
    let mut w = Worker::new();
    with_auth(&w, &["*"], None);
    let f = call(&mut w, "read_order", &[]);
    assert_eq!(f.headers_action, Action::Pause);
    assert_eq!(f.body_action, None, "refused before the body is read");
    let (status, body) = f.reply();
    assert_eq!(status, 401);
    assert_eq!(body["error"]["data"]["reason"], "missing_token");
    assert_eq!(
        challenge(&f),
        r#"Bearer resource_metadata="http://gw/.well-known/oauth-protected-resource/mcp/orders""#
    );
    assert_eq!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=missing_token.denied"),
        1
    );
    // A token Envoy did not verify: no payload, but a bearer token came.
    let f = call(&mut w, "read_order", &[("authorization", "Bearer forged")]);
    assert_eq!(f.reply().0, 401);
    assert!(challenge(&f).contains(r#"error="invalid_token""#));
    assert_eq!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=invalid_token.denied"),
        1
    );
}

#[test]
fn two_users_stating_one_identity_hold_two_sessions() {
    let mut w = aggregate_worker();
    with_auth(&w, &["*"], None);
    super::legacy_orders(&w);
    let user = |sub: &str| {
        payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": sub}))
    };
    let owner_of = |w: &mut Worker, sub: &str| {
        let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__read_order","arguments":{},"_meta":{"io.modelcontextprotocol/clientInfo":{"name":"shared-agent","version":"1.0"}}}}"#;
        let p = user(sub);
        let f = w.request_to(
            "/mcp",
            &[("mcp-protocol-version", "2026-07-28"), (PAYLOAD_HEADER, &p)],
            body,
        );
        let (_, question) = f.stream.dispatched.borrow()[0].clone();
        let q = json_of(&question);
        (
            q["owner"].as_str().unwrap_or_default().to_string(),
            q["caller"].as_str().unwrap_or_default().to_string(),
        )
    };
    let (alice, alice_caller) = owner_of(&mut w, "alice");
    let (bob, bob_caller) = owner_of(&mut w, "bob");
    assert_ne!(alice, bob, "one identity stated, two users: two owners");
    assert!(alice.starts_with('m') && alice.contains('~'), "{alice}");
    assert_ne!(alice_caller, bob_caller);
    assert!(alice_caller.starts_with("user:"), "{alice_caller}");
    assert_eq!(
        owner_of(&mut w, "alice").0,
        alice,
        "the same user, the same owner"
    );
}

#[test]
fn a_verified_caller_goes_upstream_without_its_token() {
    let mut w = Worker::new();
    with_auth(&w, &["*"], None);
    let p = reader();
    let f = call(
        &mut w,
        "read_order",
        &[(PAYLOAD_HEADER, &p), ("authorization", "Bearer x")],
    );
    assert!(f.went_upstream());
    let headers = f.stream.request_headers.borrow();
    assert!(
        !headers.contains_key("authorization"),
        "no token passthrough"
    );
    // The payload stays for the filter's later reads; the route configuration removes it
    // as the request goes upstream (checked end to end).
}

#[test]
fn a_token_for_another_resource_is_refused_as_invalid() {
    let mut w = Worker::new();
    with_auth(&w, &["*"], None);
    let other = payload(
        serde_json::json!({"iss": "http://idp", "aud": "http://gw/mcp/payments", "sub": "alice"}),
    );
    let f = call(
        &mut w,
        "read_order",
        &[(PAYLOAD_HEADER, &other), ("authorization", "Bearer x")],
    );
    assert_eq!(f.reply().0, 401);
    assert!(challenge(&f).contains("invalid_token"));
}

#[test]
fn rules_grant_by_role_and_ask_for_a_missing_scope() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [
            {"tools": ["read_order"], "roles": ["reader"]},
            {"tools": ["write_order"], "roles": ["reader"], "scopes": ["orders:write"]}
        ]})),
    );
    let p = reader();
    assert!(call(&mut w, "read_order", &[(PAYLOAD_HEADER, &p)]).went_upstream());
    let f = call(&mut w, "write_order", &[(PAYLOAD_HEADER, &p)]);
    let (status, body) = f.reply();
    assert_eq!(status, 403);
    assert_eq!(body["id"], 7);
    assert_eq!(body["error"]["data"]["scope"], "orders:write");
    assert!(challenge(&f).starts_with(r#"Bearer error="insufficient_scope", scope="orders:write""#));
    let f = call(&mut w, "slow_order", &[(PAYLOAD_HEADER, &p)]);
    let (status, body) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(body["id"], 7);
    assert_eq!(body["error"]["data"]["reason"], "tool_denied");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("slow_order"));
    assert_eq!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=tool_denied.denied"),
        1
    );
    assert_eq!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=insufficient_scope.denied"),
        1
    );
    // A refused call is no outcome of the tool's.
    assert_eq!(w.stat("slow_order", "calls"), 0);
}

#[test]
fn a_listing_shows_only_what_the_caller_may_call() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    let p = reader();
    let mut f = w.request(
        "orders",
        &[(PAYLOAD_HEADER, &p)],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/list"}"#,
    );
    assert!(f.went_upstream());
    f.json(r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"read_order"},{"name":"write_order"}]}}"#);
    let names: Vec<Value> = f.body_json()["result"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| t["name"].clone())
        .collect();
    assert_eq!(names, [Value::from("read_order")]);
}

#[test]
fn resource_and_prompt_rules_judge_reads_gets_completions_batches_and_listings() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [
            {"tools": ["*"], "roles": ["reader"]},
            {"resources": ["orders://public/*"], "roles": ["reader"]},
            {"prompts": ["summary"], "roles": ["reader"]}
        ]})),
    );
    let p = reader();
    let send = |w: &mut Worker, body: &str| w.request("orders", &[(PAYLOAD_HEADER, &p)], body);
    let read = |uri: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"resources/read","params":{{"uri":"{uri}"}}}}"#
        )
    };
    assert!(send(&mut w, &read("orders://public/today")).went_upstream());
    for denied in [
        read("orders://private/ledger"),
        read("orders://public/../private/ledger"),
        r#"{"jsonrpc":"2.0","id":7,"method":"resources/subscribe","params":{"uri":"orders://private/ledger"}}"#.to_string(),
        r#"{"jsonrpc":"2.0","id":7,"method":"prompts/get","params":{"name":"audit"}}"#.to_string(),
        r#"{"jsonrpc":"2.0","id":7,"method":"completion/complete","params":{"ref":{"type":"ref/prompt","name":"audit"},"argument":{"name":"a","value":""}}}"#.to_string(),
        r#"{"jsonrpc":"2.0","id":7,"method":"completion/complete","params":{"ref":{"type":"ref/other"},"argument":{"name":"a","value":""}}}"#.to_string(),
        r#"{"jsonrpc":"2.0","id":7,"method":"resources/read","params":{}}"#.to_string(),
    ] {
        let f = send(&mut w, &denied);
        assert!(!f.went_upstream(), "{denied}");
        let (status, body) = f.reply();
        assert_eq!(status, 200, "{denied}");
        assert_eq!(body["id"], 7, "{denied}");
        assert_eq!(body["error"]["code"], crate::auth::NOT_AUTHORIZED, "{denied}");
    }
    let f = send(&mut w, &read("orders://private/ledger"));
    let body = f.reply().1;
    assert_eq!(body["error"]["data"]["reason"], "resource_denied");
    assert_eq!(body["error"]["data"]["resource"], "orders://private/ledger");
    assert!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=resource_denied.denied")
            >= 1
    );
    assert!(
        w.metrics
            .get("toolgate.auth.service=orders.reason=prompt_denied.denied")
            >= 1
    );
    assert!(send(
        &mut w,
        r#"{"jsonrpc":"2.0","id":7,"method":"prompts/get","params":{"name":"summary"}}"#
    )
    .went_upstream());
    // A 2025-03-26 batch is judged element by element: one denied read refuses it whole.
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"orders://public/a"}},{"jsonrpc":"2.0","id":2,"method":"resources/read","params":{"uri":"orders://private/b"}}]"#;
    let f = w.request(
        "orders",
        &[(PAYLOAD_HEADER, &p), ("mcp-protocol-version", "2025-03-26")],
        batch,
    );
    assert!(!f.went_upstream(), "a batch with a denied read");
    let answers = f.reply().1;
    assert_eq!(
        answers[1]["error"]["code"],
        crate::auth::NOT_AUTHORIZED,
        "{answers}"
    );
    // Listings show only what the caller may read or get.
    let mut f = send(
        &mut w,
        r#"{"jsonrpc":"2.0","id":7,"method":"resources/list"}"#,
    );
    assert!(f.went_upstream());
    f.json(r#"{"jsonrpc":"2.0","id":7,"result":{"resources":[{"uri":"orders://public/a","name":"a"},{"uri":"orders://private/b","name":"b"}]}}"#);
    let listed = f.body_json()["result"]["resources"].clone();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["uri"], "orders://public/a");
    let mut f = send(
        &mut w,
        r#"{"jsonrpc":"2.0","id":7,"method":"prompts/list"}"#,
    );
    f.json(
        r#"{"jsonrpc":"2.0","id":7,"result":{"prompts":[{"name":"audit"},{"name":"summary"}]}}"#,
    );
    let listed = f.body_json()["result"]["prompts"].clone();
    assert_eq!(listed, serde_json::json!([{"name": "summary"}]));
}

#[test]
fn with_no_control_plane_the_listing_still_shows_only_what_the_caller_may_call() {
    let mut w = super::offline_worker();
    let listed = |w: &mut Worker, roles: &[&str]| {
        let p = payload(
            serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "alice", "roles": roles}),
        );
        let list = r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#;
        let mut f = w.request_to(
            "/mcp",
            &[("mcp-protocol-version", "2026-07-28"), (PAYLOAD_HEADER, &p)],
            list,
        );
        assert_eq!(super::no_control_plane(&mut f, true), Action::Pause);
        let (_, m) = f.reply();
        m["result"]["tools"].clone()
    };
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    assert_eq!(listed(&mut w, &["reader"])[0]["name"], "orders__read_order");
    assert_eq!(listed(&mut w, &["writer"]), serde_json::json!([]));
}

#[test]
fn a_get_stream_of_mcp_names_its_verified_caller_and_no_other() {
    use toolgate_model::session_owner::{is_identity_digest, IDENTITY_HEADER};
    let w = super::aggregate_worker();
    with_auth(&w, &[], None);
    let get = |headers: &[(&str, &str)]| {
        let stream = Stream::default();
        stream.now.set(w.now);
        {
            let mut h = stream.request_headers.borrow_mut();
            h.insert(":path".into(), "/mcp".into());
            h.insert(":method".into(), "GET".into());
            for (k, v) in headers {
                h.insert(k.to_string(), v.to_string());
            }
        }
        let mut call = Call::new(w.shared.clone());
        assert_eq!(call.on_request_headers(&stream, true), Action::Continue);
        let named = stream
            .request_headers
            .borrow()
            .get(IDENTITY_HEADER)
            .cloned();
        named
    };
    let p = payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "alice"}));
    let alice = get(&[(PAYLOAD_HEADER, &p)]).expect("the caller's identity");
    assert!(is_identity_digest(&alice), "{alice}");
    let b = payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "bob"}));
    assert_ne!(get(&[(PAYLOAD_HEADER, &b)]), Some(alice.clone()));
    // A client naming someone is not believed: without a verified caller, no one.
    assert_eq!(get(&[(IDENTITY_HEADER, &alice)]), None);
}

#[test]
fn a_cancellation_or_log_level_on_mcp_names_its_verified_caller_and_no_other() {
    use toolgate_model::session_owner::{is_identity_digest, IDENTITY_HEADER};
    let mut w = super::aggregate_worker();
    with_auth(&w, &[], None);
    let session = "tgv1.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let cancel = r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}"#;
    let level =
        r#"{"jsonrpc":"2.0","id":3,"method":"logging/setLevel","params":{"level":"debug"}}"#;
    let list = r#"{"jsonrpc":"2.0","id":4,"method":"tools/list"}"#;
    let named = |w: &mut Worker, body: &str, extra: &[(&str, &str)]| {
        let mut headers = vec![
            ("mcp-protocol-version", "2025-06-18"),
            ("mcp-session-id", session),
        ];
        headers.extend_from_slice(extra);
        let f = w.request_to("/mcp", &headers, body);
        assert_eq!(f.body_action, Some(Action::Continue), "{body}");
        let named = f
            .stream
            .request_headers
            .borrow()
            .get(IDENTITY_HEADER)
            .cloned();
        named
    };
    let p = payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "alice"}));
    let alice = named(&mut w, cancel, &[(PAYLOAD_HEADER, &p)]).expect("alice named");
    assert!(is_identity_digest(&alice), "{alice}");
    assert_eq!(
        named(&mut w, level, &[(PAYLOAD_HEADER, &p)]),
        Some(alice.clone())
    );
    // Without a verified caller, a name the client wrote is taken away.
    assert_eq!(named(&mut w, cancel, &[(IDENTITY_HEADER, &alice)]), None);
    assert_eq!(named(&mut w, level, &[(IDENTITY_HEADER, &alice)]), None);
    // What toolgate-xds does not pass on per caller costs no header.
    assert_eq!(
        named(&mut w, list, &[(IDENTITY_HEADER, "x")]),
        Some("x".to_string())
    );
}

#[test]
fn without_resource_rules_any_admitted_caller_reads() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    let p = reader();
    let f = w.request(
        "orders",
        &[(PAYLOAD_HEADER, &p)],
        r#"{"jsonrpc":"2.0","id":7,"method":"resources/read","params":{"uri":"orders://private/ledger"}}"#,
    );
    assert!(f.went_upstream());
    // And its listing is not held to be filtered.
    let mut f = w.request(
        "orders",
        &[(PAYLOAD_HEADER, &p)],
        r#"{"jsonrpc":"2.0","id":7,"method":"resources/list"}"#,
    );
    let body = r#"{"jsonrpc":"2.0","id":7,"result":{"resources":[{"uri":"orders://private/b","name":"b"}]}}"#;
    f.json(body);
    assert_eq!(
        f.body_json()["result"]["resources"][0]["uri"],
        "orders://private/b"
    );
}

#[test]
fn a_large_listing_passes_unless_rules_must_filter_it() {
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":7,"result":{{"tools":[{{"name":"read_order","description":"{}"}}]}}}}"#,
        "x".repeat(HOLD_LIMIT + 10)
    );
    let list = r#"{"jsonrpc":"2.0","id":7,"method":"tools/list"}"#;
    // Tokens required, no rules: nothing to hide, so nothing is held.
    let mut w = Worker::new();
    with_auth(&w, &["*"], None);
    let p = reader();
    let mut f = w.request("orders", &[(PAYLOAD_HEADER, &p)], list);
    assert_eq!(f.json(&big), Action::Continue);
    assert_eq!(f.stream.response_body.borrow().len(), big.len());
    // With rules, a listing too large to filter is not shown.
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    let mut f = w.request("orders", &[(PAYLOAD_HEADER, &p)], list);
    f.json(&big);
    assert_eq!(
        f.body_json()["error"]["code"],
        crate::mcp::reply::INTERNAL_ERROR
    );
}

#[test]
fn claims_reach_a_service_that_asks_and_a_client_cannot_forge_them() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(
            serde_json::json!({"rules": [{"tools": ["*"], "subjects": ["*"]}],
                                "claim_headers": {"sub": "x-caller"}}),
        ),
    );
    let p = reader();
    let f = call(
        &mut w,
        "read_order",
        &[(PAYLOAD_HEADER, &p), ("x-caller", "root")],
    );
    assert!(f.went_upstream());
    assert_eq!(f.stream.request_headers.borrow()["x-caller"], "alice");
}

#[test]
fn behind_a_bootstrap_that_does_not_verify_tokens_no_payload_is_trusted() {
    let mut w = Worker::new();
    with_auth(&w, &["*"], None);
    if let Some(a) = w.shared.borrow_mut().config.auth.as_mut() {
        a.untrusted_payload = true;
    }
    let forged = reader();
    let f = call(&mut w, "read_order", &[(PAYLOAD_HEADER, &forged)]);
    assert_eq!(
        f.reply().0,
        401,
        "a payload header nobody verified opens nothing"
    );
}

#[test]
fn a_service_with_rules_needs_a_token_for_every_request() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["billing"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"resources/read","params":{"uri":"secret://x"}}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"prompts/get","params":{"name":"p"}}"#,
        r#"{"jsonrpc":"2.0","id":4,"method":"ping"}"#,
    ] {
        let f = w.request("orders", &[], body);
        assert_eq!(f.reply().0, 401, "{body}");
    }
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "GET".into());
    }
    let mut get = Call::new(w.shared.clone());
    assert_eq!(get.on_request_headers(&stream, true), Action::Pause);
    assert_eq!(stream.replies.borrow()[0].0, 401, "the GET stream too");
    // A service with neither rules nor `required` stays open.
    assert!(w
        .request("bare", &[], r#"{"jsonrpc":"2.0","id":4,"method":"ping"}"#)
        .went_upstream());
}

#[test]
fn an_sse_listing_that_cannot_be_filtered_is_not_shown() {
    let mut w = Worker::new();
    with_auth(
        &w,
        &["*"],
        Some(serde_json::json!({"rules": [{"tools": ["read_*"], "roles": ["reader"]}]})),
    );
    let p = reader();
    let list = r#"{"jsonrpc":"2.0","id":7,"method":"tools/list"}"#;
    let mut f = w.request("orders", &[(PAYLOAD_HEADER, &p)], list);
    assert!(f.went_upstream());
    // A stream that ends without the listing (or with one the filter cannot read).
    let action = f.respond(
        200,
        &[("content-type", "text/event-stream")],
        Some("event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/x\"}\n\n"),
    );
    assert_eq!(action, Action::Pause, "its headers wait");
    assert_eq!(
        f.stream.response_headers.borrow()["content-type"],
        "application/json"
    );
    assert_eq!(
        f.body_json()["error"]["code"],
        crate::mcp::reply::INTERNAL_ERROR
    );
}

#[test]
fn an_authorization_that_is_not_text_is_refused() {
    let mut w = Worker::new();
    with_auth(&w, &["payments"], None);
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
    }
    stream
        .binary_request_headers
        .borrow_mut()
        .insert("authorization".into());
    let mut call = Call::new(w.shared.clone());
    assert_eq!(call.on_request_headers(&stream, false), Action::Pause);
    let replies = stream.replies.borrow();
    assert_eq!(replies[0].0, 400);
    assert!(json_of(&replies[0].1.body)["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`authorization`")));
    drop(replies);
    let _ = &mut w;
}

#[test]
fn an_open_service_takes_callers_without_a_token() {
    let mut w = Worker::new();
    with_auth(&w, &["payments"], None);
    assert!(call(&mut w, "read_order", &[]).went_upstream());
}
