//! The aggregate endpoint (`/mcp`, `/virtual/<name>`): names looked up and rewritten, calls
//! sent to their service's route, prompts and resources, semantic replies naming tools as
//! the endpoint shows them, and a server's questions under ids naming it.

use super::*;

#[test]
fn only_the_filter_names_the_cluster_and_only_from_the_path_it_judges() {
    let mut w = Worker::new();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let forged = [(CLUSTER_HEADER, "toolgate_control")];
    let cluster = |path: &str, method: &str, w: &mut Worker| {
        let f = w.request_to(path, &[forged[0], (":method", method)], body);
        let h = f.stream.request_headers.borrow();
        h.get(CLUSTER_HEADER).cloned()
    };
    // A service's path, whatever the method: its own cluster, the client's copy replaced.
    for method in ["POST", "GET", "DELETE"] {
        assert_eq!(
            cluster("/mcp/orders/x?y=1", method, &mut w).as_deref(),
            Some("mcp.orders"),
            "{method}"
        );
    }
    // Paths that are no service's: the client's copy is gone and nothing takes its place,
    // so Envoy has no cluster to go to (404).
    for path in [
        "/mcp/",
        "/mcp/bad%20name",
        "/mcp/a%2Fb",
        "/v1/registry",
        "/virtual/ops",
        "/",
    ] {
        assert_eq!(cluster(path, "POST", &mut w), None, "{path}");
    }
}

#[test]
fn a_call_on_mcp_goes_to_its_service_route_with_its_own_name() {
    let mut w = aggregate_worker();
    w.shared.borrow_mut().config.access_log = true;
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__write_order","arguments":{"name":"orders__write_order"}}}"#;
    let mut f = w.request_to(
        "/mcp?trace=1",
        &[
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "orders__write_order"),
            (SESSION_HEADER, "gateway-session"),
        ],
        body,
    );
    assert!(f.went_upstream());
    let sent = sent_body(&f);
    assert_eq!(
        sent,
        body.replacen(
            r#""name":"orders__write_order""#,
            r#""name":"write_order""#,
            1
        ),
        "only params.name changed"
    );
    {
        let h = f.stream.request_headers.borrow();
        assert_eq!(h[":path"], "/mcp/orders?trace=1");
        assert_eq!(
            h[CLUSTER_HEADER], "mcp.orders",
            "the shared routes take it to the service's cluster"
        );
        assert_eq!(h["mcp-name"], "write_order");
        assert_eq!(h["content-length"], sent.len().to_string());
        assert!(
            !h.contains_key(SESSION_HEADER),
            "gateway sessions stay here"
        );
    }
    assert_eq!(
        f.stream.properties.borrow()["wasm.mcp_tool"],
        b"write_order",
        "logs name the real tool"
    );
    f.stream
        .response_headers
        .borrow_mut()
        .insert(SESSION_HEADER.into(), "upstream-session".into());
    f.json(RESULT);
    assert!(!f
        .stream
        .response_headers
        .borrow()
        .contains_key(SESSION_HEADER));
    assert_eq!(w.stat("write_order", "calls"), 1, "stats of the real tool");
}

#[test]
fn an_escaped_name_is_replaced_exactly() {
    let mut w = aggregate_worker();
    let body = "{\"jsonrpc\":\"2.0\",\"id\":\"\\u00e9\",\"method\":\"tools/call\",\"params\":{\"name\" : \"orders\\u005f_read\\u005Forder\",\"arguments\":{\"q\":\"\\\"orders__read_order\\\"\"}}}";
    let f = w.request_to("/virtual/default", &[], body);
    assert!(f.went_upstream());
    assert_eq!(
        sent_body(&f),
        "{\"jsonrpc\":\"2.0\",\"id\":\"\\u00e9\",\"method\":\"tools/call\",\"params\":{\"name\" : \"read_order\",\"arguments\":{\"q\":\"\\\"orders__read_order\\\"\"}}}"
    );
}

#[test]
fn names_an_endpoint_does_not_offer_are_refused_and_reach_nothing() {
    let mut w = aggregate_worker();
    for (path, name, endpoint) in [
        ("/mcp", "orders__nope", "/mcp"),
        ("/mcp", "write_order", "/mcp"),
        // Excluded from `ops`, though `default` offers it.
        ("/virtual/ops", "orders__write_order", "/virtual/ops"),
        ("/virtual/ops", "write_order", "/virtual/ops"),
    ] {
        let f = w.virtual_call(path, name);
        assert!(!f.went_upstream(), "{path} {name}");
        let (status, reply) = f.reply();
        assert_eq!(status, 200);
        // A tool result, as the reference servers answer an unknown tool.
        assert_eq!(reply["result"]["isError"], true, "{reply}");
        assert_eq!(
            reply["result"]["_meta"]["io.toolgate/breaker"]["state"],
            "not_offered"
        );
        let message = reply["result"]["content"][0]["text"]
            .as_str()
            .expect("text");
        assert!(
            message.contains(&format!("`{name}`")) && message.contains(&format!("`{endpoint}`")),
            "{message}"
        );
        assert_eq!(f.stream.request_headers.borrow()[":path"], path);
    }
    let f = w.virtual_call("/virtual/nowhere", "orders__read_order");
    let (_, reply) = f.reply();
    assert_eq!(reply["error"]["code"], -32602);
    assert!(reply["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`nowhere`")));
    assert_eq!(w.stat("write_order", "calls"), 0);
    assert_eq!(w.store.stats().sets, 0, "no state for refused names");
}

#[test]
fn a_breaker_opened_through_mcp_is_the_services_breaker() {
    let mut w = aggregate_worker();
    for _ in 0..10 {
        let mut f = w.virtual_call("/mcp", "orders__write_order");
        assert!(f.went_upstream());
        f.json(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"db down"}}"#);
    }
    // Open on the service's own route too.
    let (_, reply) = w.tools_call("write_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "open");
    assert_eq!(meta["tool"], "write_order");
    assert_eq!(meta["fallbackTool"], "read_order");
    // And through `/mcp`, named as the agent sees it there.
    let (_, reply) = w.virtual_call("/mcp", "orders__write_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "open");
    assert_eq!(meta["tool"], "orders__write_order");
    assert_eq!(meta["fallbackTool"], "orders__read_order");
    let text = reply["result"]["content"][0]["text"]
        .as_str()
        .expect("text");
    assert!(text.contains("`orders__read_order`"), "{text}");
    assert_eq!(w.window("write_order").failures, 10);
}

#[test]
fn prompts_and_resources_on_mcp_go_to_their_service_under_their_own_names() {
    let mut w = aggregate_worker();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"prompts/get","params":{"name":"orders__greeting","arguments":{"name":"Ada"}}}"#;
    let mut f = w.request_to("/mcp", &[], body);
    assert!(f.went_upstream());
    assert_eq!(
        sent_body(&f),
        r#"{"jsonrpc":"2.0","id":1,"method":"prompts/get","params":{"name":"greeting","arguments":{"name":"Ada"}}}"#
    );
    assert_eq!(f.stream.request_headers.borrow()[":path"], "/mcp/orders");
    f.stream
        .properties
        .borrow_mut()
        .insert("upstream.address".into(), b"127.0.0.1:9".to_vec());
    f.respond(
        503,
        &[("content-type", "text/plain")],
        Some("upstream connect error"),
    );
    assert_eq!(w.window("greeting").calls, 0, "no breaker counts a prompt");
    let report = w
        .shared
        .borrow()
        .feedback
        .borrow_mut()
        .flush(w.now)
        .expect("a report");
    let report = json_of(&report.body.expect("a body"));
    assert_eq!(report["reports"][0]["service"], "orders", "{report}");
    assert_eq!(report["reports"][0]["address"], "127.0.0.1:9", "{report}");
    assert_eq!(report["reports"][0]["http_5xx"], 1, "{report}");

    // A rewritten URI goes as the server wrote it, and comes back as the agent read it.
    let body = r#"{"jsonrpc":"2.0","id":2,"method":"resources/read","params":{"uri":"toolgate+orders:dup://x"}}"#;
    let mut f = w.request_to("/mcp", &[], body);
    assert!(f.went_upstream());
    assert_eq!(
        sent_body(&f),
        r#"{"jsonrpc":"2.0","id":2,"method":"resources/read","params":{"uri":"dup://x"}}"#
    );
    f.json(r#"{"jsonrpc":"2.0","id":2,"result":{"contents":[{"uri":"dup://x","text":"t"}]}}"#);
    assert_eq!(
        f.body_json()["result"]["contents"][0]["uri"],
        "toolgate+orders:dup://x"
    );
    // Links in a tool's result and a prompt's messages lead back to their resources too.
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__read_order","arguments":{}}}"#;
    let mut f = w.request_to("/mcp", &[], call);
    assert!(f.went_upstream());
    f.json(
        r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"resource_link","uri":"dup://x","name":"x"},{"type":"resource","resource":{"uri":"secret://report","text":"t"}},{"type":"text","text":"dup://x"}]}}"#,
    );
    let content = f.body_json()["result"]["content"].clone();
    assert_eq!(content[0]["uri"], "toolgate+orders:dup://x", "{content}");
    assert_eq!(
        content[1]["resource"]["uri"], "secret://report",
        "{content}"
    );
    assert_eq!(
        content[2]["text"], "dup://x",
        "text is the tool's own: {content}"
    );
    let get =
        r#"{"jsonrpc":"2.0","id":8,"method":"prompts/get","params":{"name":"orders__greeting"}}"#;
    let mut f = w.request_to("/mcp", &[], get);
    assert!(f.went_upstream());
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "200".into());
        h.insert("content-type".into(), "text/event-stream".into());
    }
    assert_eq!(
        f.call.on_response_headers(&f.stream, false),
        Action::Continue
    );
    // Half an event waits for the rest; a whole one goes, edited.
    let event = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":8,\"result\":{\"messages\":[{\"role\":\"user\",\"content\":{\"type\":\"resource\",\"resource\":{\"uri\":\"dup://x\",\"text\":\"t\"}}}]}}\n\n";
    let half = &event[..40];
    *f.stream.response_body.borrow_mut() = half.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, half.len(), false),
        Action::Pause
    );
    *f.stream.response_body.borrow_mut() = event.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, event.len(), false),
        Action::Continue
    );
    let sent = f.body_json();
    assert_eq!(
        sent["result"]["messages"][0]["content"]["resource"]["uri"], "toolgate+orders:dup://x",
        "{sent}"
    );

    // A URI kept as it is goes unchanged, byte for byte.
    let body =
        r#"{"jsonrpc":"2.0","id":3,"method":"resources/read","params":{"uri":"secret://report"}}"#;
    let f = w.request_to("/mcp", &[], body);
    assert!(f.went_upstream());
    assert_eq!(sent_body(&f), body);

    // What the endpoint does not offer reaches no server.
    for (body, code) in [
        (
            r#"{"jsonrpc":"2.0","id":4,"method":"prompts/get","params":{"name":"greeting"}}"#,
            -32602,
        ),
        (
            r#"{"jsonrpc":"2.0","id":5,"method":"resources/read","params":{"uri":"nothing://here"}}"#,
            -32002,
        ),
        (
            r#"{"jsonrpc":"2.0","id":6,"method":"resources/read","params":{"uri":7}}"#,
            -32602,
        ),
    ] {
        let f = w.request_to("/virtual/ops", &[], body);
        let (status, reply) = f.reply();
        assert_eq!(
            (status, reply["error"]["code"].as_i64()),
            (200, Some(code)),
            "{body}"
        );
    }
}

#[test]
fn semantic_replies_name_tools_as_each_endpoint_shows_them() {
    let mut w = aggregate_worker();
    w.force_open("slow_order", "maintenance");
    let (_, reply) = w.virtual_call("/virtual/ops", "orders__slow_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "forced_open");
    assert_eq!(meta["tool"], "orders__slow_order");
    assert_eq!(meta["fallbackTool"], "read_order", "bare on `ops`");
    // An upstream failure of an admitted call: its reply too.
    let mut f = w.virtual_call("/mcp", "orders__read_order");
    assert!(f.went_upstream());
    f.respond(502, &[("content-type", "text/html")], Some("<html/>"));
    let v = f.body_json();
    let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["tool"], "orders__read_order");
    assert_eq!(w.window("read_order").failures, 1);
}

#[test]
fn a_fallback_the_endpoint_does_not_offer_is_not_named() {
    let mut w = aggregate_worker();
    {
        let mut s = w.shared.borrow_mut();
        let mut config = s.config.clone();
        // `ops` without read_order: the fallback of slow_order has no name there.
        if let Some(ops) = config.virtual_servers.get_mut("ops") {
            ops.tools.remove("read_order");
        }
        s.configure(config);
    }
    w.force_open("slow_order", "");
    let (_, reply) = w.virtual_call("/virtual/ops", "orders__slow_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["fallbackTool"], Value::Null);
    let text = reply["result"]["content"][0]["text"]
        .as_str()
        .expect("text");
    assert!(!text.contains("read_order"), "{text}");
}

#[test]
fn other_requests_on_mcp_go_on_unchanged_and_streams_untouched() {
    let mut w = aggregate_worker();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let mut f = w.request_to("/mcp", &[(SESSION_HEADER, "gw-1")], body);
    assert!(f.went_upstream());
    assert_eq!(sent_body(&f), body);
    {
        let h = f.stream.request_headers.borrow();
        assert_eq!(h[":path"], "/mcp");
        assert_eq!(h[SESSION_HEADER], "gw-1", "never unsealed here");
    }
    f.stream
        .response_headers
        .borrow_mut()
        .insert(SESSION_HEADER.into(), "gw-2".into());
    f.json(r#"{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}"#);
    assert_eq!(
        f.stream.response_headers.borrow()[SESSION_HEADER],
        "gw-2",
        "never sealed here"
    );
    // Still judged: a duplicate key is refused.
    let f = w.request_to(
        "/mcp",
        &[],
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call"}"#,
    );
    assert_eq!(f.reply().0, 400);
    for method in ["GET", "DELETE"] {
        let stream = Stream::default();
        {
            let mut h = stream.request_headers.borrow_mut();
            h.insert(":path".into(), "/mcp".into());
            h.insert(":method".into(), method.into());
            h.insert(SESSION_HEADER.into(), "gw-1".into());
        }
        let mut call = Call::new(w.shared.clone());
        assert_eq!(call.on_request_headers(&stream, true), Action::Continue);
        assert_eq!(stream.request_headers.borrow()[SESSION_HEADER], "gw-1");
        stream
            .response_headers
            .borrow_mut()
            .insert(":status".into(), "503".into());
        assert_eq!(call.on_response_headers(&stream, false), Action::Continue);
        assert_eq!(stream.response_headers.borrow()[":status"], "503");
    }
}

#[test]
fn header_checks_and_batches_on_mcp() {
    let mut w = aggregate_worker();
    let body =
        r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"orders__read_order"}}"#;
    // Mcp-Name must mirror the body as sent (the visible name), not the tool's own.
    let f = w.request_to(
        "/mcp",
        &[("mcp-method", "tools/call"), ("mcp-name", "read_order")],
        body,
    );
    assert_eq!(f.reply().1["error"]["code"], -32020);
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"orders__read_order"}},{"jsonrpc":"2.0","id":2,"method":"ping"}]"#;
    let f = w.request_to("/mcp", &[("mcp-protocol-version", "2025-03-26")], batch);
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    let answers = reply.as_array().expect("an array");
    assert_eq!(answers[0]["error"]["code"], -32600);
    assert!(answers[0]["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("alone")));
    assert_eq!(answers[1]["error"]["code"], -32600, "not run");
    let pings = r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#;
    assert!(w
        .request_to("/mcp", &[("mcp-protocol-version", "2025-03-26")], pings)
        .went_upstream());
}

#[test]
fn a_servers_question_on_mcp_names_the_server_and_its_answer_goes_back_under_its_id() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    let held =
        r#"{"envelope":"MTI3LjAuMC4xOjE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(200),
        held.as_bytes(),
    );
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "200".into());
        h.insert("content-type".into(), "text/event-stream".into());
    }
    assert_eq!(
        f.call.on_response_headers(&f.stream, false),
        Action::Continue
    );
    // Every server numbers its questions from 0: the client sees this one as orders'.
    let asked = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"elicitation/create\",\"params\":{}}\n\n";
    *f.stream.response_body.borrow_mut() = asked.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, asked.len(), false),
        Action::Continue
    );
    let question = f.body_json();
    assert_eq!(question["id"], "toolgate:orders:0", "{question}");
    let answer = r#"{"jsonrpc":"2.0","id":"toolgate:orders:0","result":{"action":"decline"}}"#;
    let f = w.request_to("/mcp", &[(SESSION_HEADER, GATEWAY_SESSION)], answer);
    assert!(f.went_upstream());
    assert_eq!(f.stream.request_headers.borrow()[":path"], "/mcp/orders");
    assert_eq!(
        sent_body(&f),
        r#"{"id":0,"jsonrpc":"2.0","result":{"action":"decline"}}"#
    );
    // An answer to no question the filter passed reaches no server.
    let made_up = r#"{"jsonrpc":"2.0","id":"toolgate:orders:1","result":{}}"#;
    let f = w.request_to("/mcp", &[(SESSION_HEADER, GATEWAY_SESSION)], made_up);
    assert_eq!(f.stream.request_headers.borrow()[":path"], "/mcp");
}
