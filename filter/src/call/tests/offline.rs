//! What the filter answers by itself when it has nothing to ask: a VM with no accepted
//! configuration, and an Envoy that cannot reach toolgate-xds.

use super::*;

#[test]
fn a_vm_without_an_accepted_configuration_refuses_every_mcp_request() {
    let mut w = Worker::new();
    w.shared.borrow_mut().unconfigured = true;
    // A call: a tool result the model can act on, with its id; nothing went upstream.
    let f = w.tools_call("write_order");
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(reply["id"], 7);
    assert_eq!(reply["result"]["isError"], true);
    assert_eq!(
        reply["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "unconfigured"
    );
    // Any other method: a JSON-RPC error with its id.
    let f = w.request(
        "orders",
        &[],
        r#"{"jsonrpc":"2.0","id":"i","method":"initialize"}"#,
    );
    let (status, reply) = f.reply();
    assert_eq!((status, reply["id"].clone()), (200, Value::from("i")));
    assert!(reply["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("no valid configuration")));
    // The aggregate endpoint and a GET stream too.
    let (_, stream, action) = raw_request(&w, "GET", "/mcp", "", true);
    assert_eq!(action, Action::Pause);
    assert_eq!(stream.replies.borrow()[0].0, 503);
    // Another path is not the filter's.
    let (_, stream, action) = raw_request(&w, "GET", "/healthz", "", true);
    assert_eq!(action, Action::Continue);
    assert!(stream.replies.borrow().is_empty());
    // Once a configuration is accepted, calls are judged again.
    let config = w.shared.borrow().config.clone();
    w.shared.borrow_mut().configure(config);
    assert!(w.tools_call("write_order").went_upstream());
}

#[test]
fn with_no_control_plane_the_filter_answers_mcp_itself() {
    let mut w = offline_worker();
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"py","version":"1"}}}"#;
    let mut f = w.request_to("/mcp", &[("mcp-protocol-version", "2025-06-18")], init);
    assert!(f.went_upstream(), "toolgate-xds's to answer first");
    assert_eq!(no_control_plane(&mut f, true), Action::Pause);
    let replies = f.stream.replies.borrow();
    let (status, reply) = &replies[0];
    assert_eq!(*status, 200);
    let m = json_of(&reply.body);
    assert_eq!(m["result"]["protocolVersion"], "2025-06-18");
    let session = f.stream.reply_headers.borrow()[0]
        .iter()
        .find(|(k, _)| k == SESSION_HEADER)
        .map(|(_, v)| v.clone())
        .expect("a gateway session");
    assert!(session.starts_with("tgv1."), "{session}");
    drop(replies);

    // The listing, from the configuration, with a body still to come (replaced whole).
    let list = r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#;
    let mut f = w.request_to("/mcp", &[(SESSION_HEADER, &session)], list);
    assert_eq!(no_control_plane(&mut f, false), Action::Continue);
    *f.stream.response_body.borrow_mut() = b"upstream connect error".to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, 22, true),
        Action::Continue
    );
    assert_eq!(f.stream.response_headers.borrow()[":status"], "200");
    let m = f.body_json();
    assert_eq!(m["result"]["tools"][0]["name"], "orders__read_order");
    assert_eq!(w.metrics.get(OFFLINE_ANSWERS), 2);

    // A toolgate-xds that answered with an error of its own is passed on.
    let mut f = w.request_to("/mcp", &[], list);
    f.stream
        .properties
        .borrow_mut()
        .insert("response.code_details".into(), b"via_upstream".to_vec());
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "503".into());
    }
    assert_eq!(
        f.call.on_response_headers(&f.stream, true),
        Action::Continue
    );
    assert!(f.stream.replies.borrow().is_empty());

    // The GET stream: an MCP error, not Envoy's text.
    let (mut c, stream, action) = raw_request(&w, "GET", "/mcp", "", true);
    assert_eq!(action, Action::Continue);
    stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"no_healthy_upstream".to_vec(),
    );
    stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "503".into());
    assert_eq!(c.on_response_headers(&stream, true), Action::Pause);
    let replies = stream.replies.borrow();
    assert_eq!(replies[0].0, 503);
    assert!(json_of(&replies[0].1.body)["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("control plane")));
}

#[test]
fn with_no_control_plane_a_call_goes_without_a_session_and_a_server_that_needs_one_is_answered_in_mcp(
) {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    assert_eq!(f.stream.dispatched.borrow().len(), 1);
    // Nothing held, and toolgate-xds away (Envoy's own 503): the call goes without a session.
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(503),
        b"no healthy upstream",
    );
    assert_eq!(f.stream.resumed.get(), 1, "the call goes on");
    assert!(!f
        .stream
        .request_headers
        .borrow()
        .contains_key(SESSION_HEADER));
    assert_eq!(w.metrics.get(UNSESSIONED_CALLS), 1);
    // A server that needs a session says so in plain text (rmcp): the client gets a tool
    // result saying why, never the text, and nothing counts against the tool.
    f.stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "400".into());
    assert_eq!(f.call.on_response_headers(&f.stream, false), Action::Pause);
    *f.stream.response_body.borrow_mut() = b"Bad Request: Session ID is required".to_vec();
    assert_eq!(f.call.on_response_body(&f.stream, 35, true), Action::Pause);
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(reply["id"], 7);
    assert_eq!(reply["result"]["isError"], true);
    assert_eq!(
        reply["result"]["_meta"]["io.toolgate/breaker"]["failure"],
        "no_control_plane"
    );
    assert_eq!(w.window("read_order").failures, 0);

    // A server that needs none answers: its answer is the client's.
    let mut f = gateway_call(&mut w);
    f.call.on_dispatch_response(
        &f.stream,
        f.stream.dispatched.borrow().len() as u32,
        Some(503),
        b"no healthy upstream",
    );
    f.json(RESULT);
    assert!(f.stream.replies.borrow().is_empty());
}
