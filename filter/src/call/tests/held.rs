//! Sessions toolgate-xds holds for clients (of `/mcp`, of stateless 2026-07-28 clients, on a
//! service's route): asked for once per Envoy, replayed when a server lost one, and what the
//! client is told when none can be had.

use super::*;

#[test]
fn a_gateway_session_gets_the_session_held_for_it_asked_once_per_envoy() {
    let mut w = aggregate_worker();
    let f = gateway_call(&mut w);
    // The first call waits while toolgate-xds opens the session.
    assert_eq!(f.body_action, Some(Action::Pause));
    let (path, question) = f.stream.dispatched.borrow()[0].clone();
    assert_eq!(path, crate::held_session::OPEN_PATH);
    let question = json_of(&question);
    assert_eq!(question["service"], "orders");
    assert_eq!(question["gateway_session"], GATEWAY_SESSION);
    let mut f = f;
    let answer =
        r#"{"envelope":"MTI3LjAuMC4xOjE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        answer.as_bytes(),
    );
    assert_eq!(f.stream.resumed.get(), 1);
    {
        let h = f.stream.request_headers.borrow();
        assert_eq!(h[SESSION_HEADER], "MTI3LjAuMC4xOjE=;UV:YQ==");
        assert_eq!(h["mcp-protocol-version"], "2025-06-18");
        assert_eq!(h[":path"], "/mcp/orders");
    }
    f.json(RESULT);

    // The next call, on any worker of this Envoy, asks nobody.
    let second = gateway_call(&mut w);
    assert!(second.stream.dispatched.borrow().is_empty());
    assert_eq!(
        second.stream.request_headers.borrow()[SESSION_HEADER],
        "MTI3LjAuMC4xOjE=;UV:YQ=="
    );
}

#[test]
fn a_held_session_the_server_lost_is_replayed_and_the_client_sees_the_answer() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    let answer =
        r#"{"envelope":"ZW52LTE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        answer.as_bytes(),
    );
    // The server restarted: 404 for the session.
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    let action = f.call.on_response_headers(&f.stream, false);
    assert_eq!(action, Action::Pause, "held for the replay");
    let (path, question) = f.stream.dispatched.borrow()[1].clone();
    assert_eq!(path, crate::held_session::REPLAY_PATH);
    let question = json_of(&question);
    assert_eq!(question["stale"], "ZW52LTE=;UV:YQ==");
    let replayed = serde_json::json!({
        "envelope": "ZW52LTI=;UV:Yg==", "protocol_version": "2025-06-18", "instance": "b",
        "status": 200, "content_type": "application/json", "body": RESULT,
    });
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        replayed.to_string().as_bytes(),
    );
    let raw = f.stream.raw_replies.borrow();
    assert_eq!(raw.len(), 1);
    assert_eq!(raw[0].0, 200);
    assert_eq!(raw[0].2, RESULT.as_bytes());
    assert_eq!(
        w.window("read_order").failures,
        0,
        "a lost session is not the tool's fault"
    );
    drop(raw);
    // Later calls go with the new session.
    let next = gateway_call(&mut w);
    assert_eq!(
        next.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTI=;UV:Yg=="
    );
}

#[test]
fn no_healthy_instance_for_a_session_is_a_semantic_reply() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(503),
        br#"{"error":"service \"orders\" has no healthy instance"}"#,
    );
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(reply["id"], 7);
    // The tool's result, as when Envoy finds no healthy upstream, named as the agent sees it
    // (a JSON-RPC error here was the bug: no fallback could be named).
    assert_eq!(reply["result"]["isError"], true, "{reply}");
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["failure"], "no_healthy_upstream", "{reply}");
    assert_eq!(meta["tool"], "orders__read_order", "{reply}");
    assert_eq!(f.stream.resumed.get(), 0, "answered here, not resumed");
}

#[test]
fn a_route_session_whose_instance_is_gone_is_reopened_with_the_clients_parameters() {
    let mut w = Worker::new();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    // initialize: the id the client gets carries its parameters, sealed.
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{"roots":{}},"clientInfo":{"name":"agent","version":"1"}}}"#;
    let mut f = w.request("orders", &[], init);
    f.stream
        .response_headers
        .borrow_mut()
        .insert(SESSION_HEADER.into(), "ZW52LTE=;UV:YQ==".into());
    f.json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
    let sealed = f.stream.response_headers.borrow()[SESSION_HEADER].clone();

    // A call on it; the pinned instance is gone and the survivor answers 404.
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#;
    let mut f = w.request("orders", &[(SESSION_HEADER, &sealed)], call);
    assert!(f.went_upstream());
    assert_eq!(
        f.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTE=;UV:YQ=="
    );
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    let (path, question) = f.stream.dispatched.borrow()[0].clone();
    assert_eq!(path, crate::held_session::REPLAY_PATH);
    let question = json_of(&question);
    assert_eq!(question["params"]["clientInfo"]["name"], "agent");
    assert_eq!(question["params"]["protocolVersion"], "2025-06-18");
    assert_eq!(question["stale"], "ZW52LTE=;UV:YQ==");
    let replayed = serde_json::json!({
        "envelope": "ZW52LTI=;UV:Yg==", "protocol_version": "2025-06-18", "instance": "b",
        "status": 200, "content_type": "application/json", "body": RESULT,
    });
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        replayed.to_string().as_bytes(),
    );
    assert_eq!(f.stream.raw_replies.borrow()[0].2, RESULT.as_bytes());

    // The client keeps sending its old id: it now goes to the new session.
    let f = w.request("orders", &[(SESSION_HEADER, &sealed)], call);
    assert_eq!(
        f.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTI=;UV:Yg=="
    );
}

/// A gateway call whose held session toolgate-xds opened on `envelope`, sent.
fn held_gateway_call(w: &mut Worker, envelope: &str) -> Flight {
    let mut f = gateway_call(w);
    let answer = serde_json::json!({"envelope": envelope, "protocol_version": "2025-06-18",
        "instance": "a", "opened_ms": 1234});
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        answer.to_string().as_bytes(),
    );
    f
}

#[test]
fn the_typescript_sdks_400_means_session_unknown_and_is_replayed() {
    let mut w = aggregate_worker();
    let mut f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    f.stream
        .properties
        .borrow_mut()
        .insert("upstream.address".into(), b"127.0.0.1:9".to_vec());
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "400".into());
        h.insert("content-type".into(), "application/json".into());
    }
    assert_eq!(
        f.call.on_response_headers(&f.stream, false),
        Action::Pause,
        "held to read why"
    );
    let body = r#"{"jsonrpc":"2.0","error":{"code":-32000,"message":"Bad Request: No valid session ID provided"},"id":null}"#;
    *f.stream.response_body.borrow_mut() = body.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, body.len(), true),
        Action::Pause
    );
    let (path, question) = f.stream.dispatched.borrow()[1].clone();
    assert_eq!(path, crate::held_session::REPLAY_PATH);
    let question = json_of(&question);
    assert_eq!(question["stale"], "ZW52LTE=;UV:YQ==");
    assert_eq!(question["opened_ms"], 1234);
    assert_eq!(question["answered_by"], "127.0.0.1:9");
    assert!(question["caller"].is_string(), "{question}");

    // Any other 400 is the request's own: it goes on, and nobody is asked.
    let mut f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    let dispatched = f.stream.dispatched.borrow().len();
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "400".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    let other = r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"bad"}}"#;
    *f.stream.response_body.borrow_mut() = other.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, other.len(), true),
        Action::Continue
    );
    assert_eq!(f.stream.dispatched.borrow().len(), dispatched);
    assert_eq!(w.window("read_order").failures, 0);
}

#[test]
fn a_held_answer_is_used_still_while_toolgate_xds_does_not_answer() {
    let mut w = aggregate_worker();
    let f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    drop(f);
    // Time for a refresh; toolgate-xds is away (Envoy's own 503, no explanation).
    w.now += crate::held_session::REFRESH_MS + 1;
    let mut f = gateway_call(&mut w);
    assert_eq!(f.stream.dispatched.borrow().len(), 1, "asked again");
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(503),
        b"no healthy upstream",
    );
    assert_eq!(f.stream.resumed.get(), 1, "the call goes on");
    assert_eq!(
        f.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTE=;UV:YQ=="
    );
    // Kept as asked now: the next call does not ask again at once.
    let next = gateway_call(&mut w);
    assert!(next.stream.dispatched.borrow().is_empty());
    // A 400 with no body says nothing of a session: it goes on.
    let mut f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "400".into());
    assert_eq!(
        f.call.on_response_headers(&f.stream, true),
        Action::Continue
    );
}

#[test]
fn a_session_the_client_or_its_live_server_ended_stays_ended() {
    let mut w = aggregate_worker();
    let mut f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    // toolgate-xds: the instance is live and unchanged, so the server ended it.
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(410),
        br#"{"error":"ended","failure":"ended"}"#,
    );
    assert_eq!(f.stream.resumed.get(), 2, "the server's 404 goes on");
    assert!(f.stream.raw_replies.borrow().is_empty());
    assert_eq!(w.window("read_order").failures, 0);
    // The next call of that client is answered here: its session is over.
    let next = gateway_call(&mut w);
    assert!(next.stream.dispatched.borrow().is_empty());
    let (status, reply) = next.reply();
    assert_eq!(status, 404);
    assert_eq!(reply["id"], 7);
    assert!(reply["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("Session not found")));
}

#[test]
fn a_replayed_call_that_fails_counts_as_a_failure() {
    let mut w = aggregate_worker();
    let mut f = held_gateway_call(&mut w, "ZW52LTE=;UV:YQ==");
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    let replayed = serde_json::json!({
        "envelope": "ZW52LTI=;UV:Yg==", "protocol_version": "2025-06-18", "instance": "b",
        "opened_ms": 99, "status": 500, "content_type": "text/plain", "body": "boom",
    });
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        replayed.to_string().as_bytes(),
    );
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(
        reply["result"]["_meta"]["io.toolgate/breaker"]["failure"],
        "http_5xx"
    );
    assert_eq!(
        w.window("read_order").failures,
        1,
        "counted against the tool"
    );

    // A replay that timed out on the server counts too; a refused session does not.
    let mut f = held_gateway_call(&mut w, "ZW52LTI=;UV:Yg==");
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    f.call.on_response_headers(&f.stream, false);
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(504),
        br#"{"failure":"timeout","in_call":true}"#,
    );
    assert_eq!(
        f.reply().1["result"]["_meta"]["io.toolgate/breaker"]["failure"],
        "timeout"
    );
    assert_eq!(w.window("read_order").failures, 2);
}

#[test]
fn a_session_refused_or_at_the_bound_says_so() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(502),
        br#"{"error":"initialize: HTTP 503","failure":"refused","status":503}"#,
    );
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    let text = reply["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert!(
        text.contains("refused to open a session") && text.contains("503"),
        "{text}"
    );
    assert!(!text.contains("could not reach"), "{text}");
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["failure"], "session_refused");
    assert_eq!(meta["httpStatus"], 503);

    let mut f = gateway_call(&mut w);
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(429),
        br#"{"failure":"at_bound","bound":"caller","limit":2}"#,
    );
    let text = f.reply().1["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        text.contains("at most 2 sessions") && text.contains("for this caller"),
        "{text}"
    );
    assert_eq!(w.window("read_order").failures, 0, "neither is the tool's");
}

#[test]
fn a_route_session_the_server_ended_is_not_reopened() {
    let mut w = Worker::new();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"agent","version":"1"}}}"#;
    let mut f = w.request("orders", &[], init);
    f.stream
        .response_headers
        .borrow_mut()
        .insert(SESSION_HEADER.into(), "ZW52LTE=;UV:YQ==".into());
    f.json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
    let sealed = f.stream.response_headers.borrow()[SESSION_HEADER].clone();
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#;
    let mut f = w.request("orders", &[(SESSION_HEADER, &sealed)], call);
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    let (_, question) = f.stream.dispatched.borrow()[0].clone();
    let question = json_of(&question);
    assert!(
        question["opened_ms"].is_u64(),
        "the sealed id says when: {question}"
    );
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(410),
        br#"{"failure":"ended"}"#,
    );
    assert_eq!(f.stream.resumed.get(), 1);
    // The same id again: not routed to any session (the server says 404), nobody asked.
    let f = w.request("orders", &[(SESSION_HEADER, &sealed)], call);
    assert!(f.went_upstream());
    assert_ne!(
        f.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTE=;UV:YQ=="
    );
    let mut f = f;
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(
        f.call.on_response_headers(&f.stream, false),
        Action::Continue
    );
    assert!(f.stream.dispatched.borrow().is_empty());
}

/// A 2026-07-28 call on `/mcp`, stating `client` as its `clientInfo` in `_meta`.
fn stateless_call(w: &mut Worker, client: &str) -> Flight {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"orders__read_order","arguments":{{}},"_meta":{{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{{"name":"{client}","version":"1"}},"io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#
    );
    w.request_to("/mcp", &[("mcp-protocol-version", "2026-07-28")], &body)
}

#[test]
fn a_stateless_call_to_a_server_that_speaks_sessions_goes_on_one_held_for_its_identity() {
    let mut w = aggregate_worker();
    // A server that speaks 2026-07-28: the call goes as it is, nobody asked.
    let f = stateless_call(&mut w, "py");
    assert!(f.went_upstream());
    assert!(f.stream.dispatched.borrow().is_empty());
    assert!(!f
        .stream
        .request_headers
        .borrow()
        .contains_key(SESSION_HEADER));

    legacy_orders(&w);
    let mut f = stateless_call(&mut w, "py");
    assert_eq!(f.body_action, Some(Action::Pause), "waits for the session");
    let (path, question) = f.stream.dispatched.borrow()[0].clone();
    assert_eq!(path, crate::held_session::OPEN_PATH);
    let question = json_of(&question);
    assert_eq!(question["service"], "orders");
    assert_eq!(question["params"]["protocolVersion"], "2025-06-18");
    assert_eq!(question["params"]["clientInfo"]["name"], "py");
    assert!(question.get("gateway_session").is_none(), "{question}");
    let owner = question["owner"].as_str().unwrap_or_default().to_string();
    assert!(owner.starts_with('m'), "{owner}");
    let answer =
        r#"{"envelope":"MTI3LjAuMC4xOjE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        answer.as_bytes(),
    );
    assert_eq!(f.stream.resumed.get(), 1);
    {
        let h = f.stream.request_headers.borrow();
        assert_eq!(h[SESSION_HEADER], "MTI3LjAuMC4xOjE=;UV:YQ==");
        assert_eq!(
            h["mcp-protocol-version"], "2025-06-18",
            "the server gets the revision of its session"
        );
        assert_eq!(h[":path"], "/mcp/orders");
    }
    f.json(RESULT);
    let answered = f.body_json();
    assert_eq!(
        answered["result"]["resultType"], "complete",
        "a 2026-07-28 client gets a 2026-07-28 result: {answered}"
    );

    // The same identity again: the session held, nobody asked.
    let again = stateless_call(&mut w, "py");
    assert!(again.stream.dispatched.borrow().is_empty());
    assert_eq!(
        again.stream.request_headers.borrow()[SESSION_HEADER],
        "MTI3LjAuMC4xOjE=;UV:YQ=="
    );
    // Another identity has its own.
    let other = stateless_call(&mut w, "ts");
    let (_, question) = other.stream.dispatched.borrow()[0].clone();
    assert_ne!(json_of(&question)["owner"], owner.as_str());

    // A legacy client without a gateway session is not one: it goes as it is.
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__read_order","arguments":{}}}"#;
    let legacy = w.request_to("/mcp", &[("mcp-protocol-version", "2025-06-18")], body);
    assert!(legacy.went_upstream());
    assert!(legacy.stream.dispatched.borrow().is_empty());
}

#[test]
fn a_stateless_clients_session_the_server_lost_is_replayed() {
    let mut w = aggregate_worker();
    legacy_orders(&w);
    let mut f = stateless_call(&mut w, "py");
    let answer =
        r#"{"envelope":"ZW52LTE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        answer.as_bytes(),
    );
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "404".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    let (path, question) = f.stream.dispatched.borrow()[1].clone();
    assert_eq!(path, crate::held_session::REPLAY_PATH);
    let question = json_of(&question);
    assert_eq!(question["stale"], "ZW52LTE=;UV:YQ==");
    assert_eq!(question["params"]["clientInfo"]["name"], "py");
    let replayed = serde_json::json!({
        "envelope": "ZW52LTI=;UV:Yg==", "protocol_version": "2025-06-18", "instance": "b",
        "status": 200, "content_type": "application/json", "body": RESULT,
    });
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        replayed.to_string().as_bytes(),
    );
    {
        let raw = f.stream.raw_replies.borrow();
        assert_eq!(raw.len(), 1);
        assert_eq!(json_of(&raw[0].2)["result"]["resultType"], "complete");
    }
    let next = stateless_call(&mut w, "py");
    assert_eq!(
        next.stream.request_headers.borrow()[SESSION_HEADER],
        "ZW52LTI=;UV:Yg=="
    );
}
