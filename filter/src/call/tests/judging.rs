//! Requests judged on the way in: bodies readers could disagree on, trailers, MCP method
//! headers, batches, compressed bodies, the transport's HTTP methods, and headers that are
//! not text.

use super::*;

#[test]
fn bodies_readers_disagree_on_are_refused_and_reach_no_server() {
    let mut w = Worker::new();
    for (body, code) in [
        (
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"read_order","name":"write_order","arguments":{}}}"#,
            -32600,
        ),
        (
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/list","method":"tools/call","params":{"name":"write_order"}}"#,
            -32600,
        ),
        (
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"write_order","arguments":{"x":NaN}}}"#,
            -32700,
        ),
        (
            r#"{"jsonrpc":"2.0","id":2.0,"method":"tools/call","params":{"name":"write_order"}}"#,
            -32600,
        ),
        ("", -32700),
    ] {
        let f = w.request("orders", &[], body);
        assert!(!f.went_upstream(), "{body}");
        let (status, reply) = f.reply();
        assert_eq!(status, 400, "{body}");
        assert_eq!(reply["error"]["code"], code, "{body}: {reply}");
    }
    assert_eq!(w.stat("write_order", "calls"), 0);
    assert_eq!(w.store.stats().sets, 0, "no state for refused requests");
}

#[test]
fn a_body_that_ends_with_trailers_is_judged_before_it_goes_on() {
    let w = Worker::new();
    w.force_open("write_order", "incident 42");
    let body = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"write_order"}}"#;
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
    }
    *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
    let mut call = Call::new(w.shared.clone());
    assert_eq!(call.on_request_headers(&stream, false), Action::Pause);
    // HTTP/2: the last DATA frame does not end the stream, a trailers frame does.
    assert_eq!(
        call.on_request_body(&stream, body.len(), false),
        Action::Pause
    );
    assert_eq!(call.on_request_trailers(&stream), Action::Pause);
    let replies = stream.replies.borrow();
    let reply = json_of(&replies[0].1.body);
    assert_eq!(
        reply["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "forced_open"
    );
}

#[test]
fn mcp_method_headers_never_skip_reading_the_body() {
    let mut w = Worker::new();
    w.force_open("write_order", "");
    let body = r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"write_order"}}"#;
    // The header names another method: the body is read anyway, and the lie refused.
    let f = w.request(
        "orders",
        &[
            ("mcp-method", "tools/list"),
            ("mcp-protocol-version", "2026-07-28"),
        ],
        body,
    );
    assert_eq!(f.headers_action, Action::Pause);
    let (status, reply) = f.reply();
    assert_eq!(status, 400);
    assert_eq!(reply["error"]["code"], -32020);
    assert_eq!(reply["id"], 4);
}

#[test]
fn batches_are_refused_from_2025_06_18_and_judged_whole_before() {
    let mut w = Worker::new();
    w.force_open("write_order", "");
    let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order"}},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"write_order"}},{"jsonrpc":"2.0","method":"notifications/x"}]"#;
    let f = w.request("orders", &[("mcp-protocol-version", "2025-06-18")], batch);
    let (status, reply) = f.reply();
    assert_eq!(
        (status, reply["error"]["code"].clone()),
        (400, (-32600).into())
    );
    let f = w.request("orders", &[("mcp-protocol-version", "2025-03-26")], batch);
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    let answers = reply.as_array().expect("an array");
    assert_eq!(
        answers.len(),
        2,
        "one per request, none for the notification"
    );
    assert_eq!(answers[0]["error"]["code"], -32600, "not run");
    assert_eq!(
        answers[1]["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "forced_open"
    );
    let fine = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_order"}}]"#;
    assert!(w
        .request("orders", &[("mcp-protocol-version", "2025-03-26")], fine)
        .went_upstream());
}

#[test]
fn compressed_bodies_are_refused() {
    let mut w = Worker::new();
    let f = w.request("orders", &[("content-encoding", "gzip")], "\u{1f}");
    let (status, reply) = f.reply();
    assert_eq!(status, 415);
    assert_eq!(reply["error"]["code"], -32700);
}

#[test]
fn only_the_transports_methods_pass_and_get_or_delete_carry_no_body() {
    let w = Worker::new();
    w.force_open("write_order", "frozen");
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_order"}}"#;
    for method in [
        "PUT", "PATCH", "OPTIONS", "HEAD", "TRACE", "put", "PROPFIND",
    ] {
        for path in ["/mcp/orders", "/mcp", "/virtual/ops"] {
            let (_, stream, action) = raw_request(&w, method, path, call, false);
            assert_eq!(action, Action::Pause, "{method} {path}");
            let replies = stream.replies.borrow();
            assert_eq!(replies[0].0, 405, "{method} {path}");
            assert_eq!(json_of(&replies[0].1.body)["error"]["code"], -32600);
            assert!(stream.reply_headers.borrow()[0]
                .contains(&("allow".to_string(), "GET, POST, DELETE".to_string())));
        }
    }
    for method in ["GET", "DELETE", "get"] {
        for path in ["/mcp/orders", "/mcp"] {
            // With a body: refused once a byte of it shows.
            let (mut c, stream, action) = raw_request(&w, method, path, call, false);
            assert_eq!(action, Action::Pause, "{method} {path}: held for the body");
            assert_eq!(c.on_request_body(&stream, call.len(), true), Action::Pause);
            assert_eq!(stream.replies.borrow()[0].0, 400, "{method} {path}");
            // Without: it goes on, whether the headers end the request or an empty body does.
            let (_, stream, action) = raw_request(&w, method, path, "", true);
            assert_eq!(action, Action::Continue, "{method} {path}");
            assert!(stream.replies.borrow().is_empty());
            let (mut c, stream, action) = raw_request(&w, method, path, "", false);
            assert_eq!(action, Action::Pause);
            assert_eq!(c.on_request_body(&stream, 0, true), Action::Continue);
            assert!(stream.replies.borrow().is_empty());
        }
    }
}

#[test]
fn headers_that_are_not_text_are_refused_or_taken_off() {
    let w = Worker::new();
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order"}}"#;
    for name in [
        SESSION_HEADER,
        "mcp-method",
        "mcp-protocol-version",
        "content-encoding",
    ] {
        let stream = Stream::default();
        {
            let mut h = stream.request_headers.borrow_mut();
            h.insert(":path".into(), "/mcp/orders".into());
            h.insert(":method".into(), "POST".into());
        }
        stream
            .binary_request_headers
            .borrow_mut()
            .insert(name.into());
        let mut c = Call::new(w.shared.clone());
        assert_eq!(c.on_request_headers(&stream, false), Action::Pause);
        assert_eq!(stream.replies.borrow()[0].0, 400, "{name}");
    }
    // Headers the filter owns go, whatever they hold.
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
    }
    for owned in [CLUSTER_HEADER, HELD_HEADER] {
        stream
            .binary_request_headers
            .borrow_mut()
            .insert(owned.into());
    }
    *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
    let mut c = Call::new(w.shared.clone());
    assert_eq!(c.on_request_headers(&stream, false), Action::Pause);
    assert!(stream.binary_request_headers.borrow().is_empty());
    assert_eq!(
        c.on_request_body(&stream, body.len(), true),
        Action::Continue
    );
    assert_eq!(
        stream.request_headers.borrow()[CLUSTER_HEADER],
        "mcp.orders",
        "the cluster is the filter's word"
    );
}

#[test]
fn claim_headers_are_taken_off_without_an_auth_configuration() {
    let mut w = Worker::new();
    w.shared
        .borrow_mut()
        .config
        .claim_header_names
        .insert("x-caller".into());
    let f = w.request(
        "orders",
        &[("x-caller", "root")],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order"}}"#,
    );
    assert!(f.went_upstream());
    assert!(!f.stream.request_headers.borrow().contains_key("x-caller"));
}
