//! Answers on the way back: a 5xx or an answer that is not the response replaced in MCP, SSE
//! streams that end without one, failures of other methods and of GET streams, and
//! compressed answers passed untouched.

use super::*;

#[test]
fn an_empty_5xx_becomes_the_semantic_reply_and_a_failure() {
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    assert!(f.went_upstream());
    // 16.1: a 500 with no body at all; before, the agent got HTTP 200 and nothing.
    assert_eq!(
        f.respond(500, &[("content-length", "0")], None),
        Action::Pause
    );
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(reply["id"], 7);
    assert_eq!(reply["result"]["isError"], true);
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "upstream_failure");
    assert_eq!(meta["httpStatus"], 500);
    assert_eq!(meta.get("retryAfterSeconds"), None);
    assert_eq!(w.window("write_order").failures, 1);
}

#[test]
fn an_html_5xx_is_replaced_in_place() {
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    let action = f.respond(
        502,
        &[("content-type", "text/html"), ("content-length", "24")],
        Some("<html>bad gateway</html>"),
    );
    assert_eq!(action, Action::Continue);
    let h = f.stream.response_headers.borrow().clone();
    assert_eq!(h[":status"], "200");
    assert_eq!(h["content-type"], "application/json");
    assert!(!h.contains_key("content-length"));
    assert_eq!(f.body_json()["result"]["isError"], true);
    assert_eq!(w.window("write_order").failures, 1);
}

#[test]
fn an_answer_that_is_not_the_response_is_replaced_and_counts() {
    let mut w = Worker::new();
    for body in [
        r#"{"jsonrpc":"2.0","id":8,"result":{}}"#,
        r#"{"jsonrpc":"2.0","id":7,"res"#,
        "<html>oops</html>",
    ] {
        let mut f = w.tools_call("write_order");
        f.json(body);
        let v = f.body_json();
        assert_eq!(v["id"], 7, "{body}");
        assert_eq!(
            v["result"]["_meta"]["io.toolgate/breaker"]["failure"],
            "bad_response"
        );
        let len = f.stream.response_headers.borrow()["content-length"].clone();
        assert_eq!(len, f.stream.response_body.borrow().len().to_string());
    }
    assert_eq!(w.window("write_order").failures, 3);
}

#[test]
fn an_sse_stream_that_ends_without_the_response_gets_one() {
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    let progress = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"res";
    f.respond(
        200,
        &[("content-type", "text/event-stream")],
        Some(progress),
    );
    let body = String::from_utf8(f.stream.response_body.borrow().clone()).expect("utf-8");
    assert!(body.starts_with(progress), "what streamed is kept");
    let tail = &body[progress.len()..];
    assert!(
        tail.starts_with("\nevent: toolgate-discarded\n\nevent: message\ndata: {"),
        "{tail}"
    );
    assert_eq!(
        f.body_json()["result"]["_meta"]["io.toolgate/breaker"]["failure"],
        "no_response"
    );
    assert_eq!(w.window("write_order").failures, 1);
}

#[test]
fn an_sse_stream_that_declared_its_length_loses_it() {
    // The reply for a stream that ends without the response is one more event: a declared
    // length would cut it off. A stream without one is left alone (no host call).
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    let event = "data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = event.len().to_string();
    f.respond(
        200,
        &[
            ("content-type", "text/event-stream"),
            ("content-length", &len),
        ],
        Some(event),
    );
    assert!(!f
        .stream
        .response_headers
        .borrow()
        .contains_key("content-length"));
    assert_eq!(w.window("write_order").failures, 0);
}

#[test]
fn other_methods_get_a_json_rpc_error_when_no_server_is_left() {
    let mut w = Worker::new();
    let mut f = w.request(
        "orders",
        &[],
        r#"{"jsonrpc":"2.0","id":"init-1","method":"initialize","params":{}}"#,
    );
    assert!(f.went_upstream());
    f.stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"no_healthy_upstream".to_vec(),
    );
    f.respond(
        503,
        &[("content-type", "text/plain")],
        Some("no healthy upstream"),
    );
    let v = f.body_json();
    assert_eq!(v["id"], "init-1");
    assert_eq!(v["error"]["code"], -32603);
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`orders`")));
}

/// The 2026-07-28 SDKs take a JSON-RPC error at 200 to their `server/discover` probe for "this
/// server predates 2026-07-28"; a 503 makes them report the outage.
#[test]
fn a_version_probe_no_server_can_take_gets_a_503() {
    let mut w = Worker::new();
    let mut f = w.request(
        "orders",
        &[("mcp-protocol-version", "2026-07-28")],
        r#"{"jsonrpc":"2.0","id":1,"method":"server/discover","params":{}}"#,
    );
    assert!(f.went_upstream());
    f.stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"no_healthy_upstream".to_vec(),
    );
    f.respond(
        503,
        &[("content-type", "text/plain")],
        Some("no healthy upstream"),
    );
    let h = f.stream.response_headers.borrow().clone();
    assert_eq!(h[":status"], "503");
    assert_eq!(h["retry-after"], STREAM_RETRY_AFTER_SECS);
    let v = f.body_json();
    assert_eq!(v["id"], 1);
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`orders`")));
}

#[test]
fn a_get_stream_envoy_cannot_open_gets_a_503_with_advice() {
    let w = Worker::new();
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "GET".into());
    }
    let mut call = Call::new(w.shared.clone());
    assert_eq!(call.on_request_headers(&stream, true), Action::Continue);
    stream
        .response_headers
        .borrow_mut()
        .insert(":status".into(), "503".into());
    stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"no_healthy_upstream".to_vec(),
    );
    assert_eq!(call.on_response_headers(&stream, false), Action::Continue);
    let h = stream.response_headers.borrow().clone();
    assert_eq!(h[":status"], "503");
    assert_eq!(h["retry-after"], STREAM_RETRY_AFTER_SECS);
    *stream.response_body.borrow_mut() = b"no healthy upstream".to_vec();
    call.on_response_body(&stream, 19, true);
    let v = json_of(&stream.response_body.borrow());
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`orders`")));
}

#[test]
fn compressed_answers_are_never_judged_nor_edited() {
    let mut w = Worker::new();
    let gzip = [
        ("content-type", "application/json"),
        ("content-encoding", "gzip"),
    ];
    for _ in 0..12 {
        let mut f = w.request(
            "orders",
            &[("accept-encoding", "gzip, br")],
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order"}}"#,
        );
        assert!(f.went_upstream());
        assert!(
            !f.stream
                .request_headers
                .borrow()
                .contains_key("accept-encoding"),
            "the server is asked for what the filter can read"
        );
        // A server that compresses anyway: its answer passes as its headers say it is.
        let compressed = "\u{1f}\u{8b}not json to this filter";
        assert_eq!(f.respond(200, &gzip, Some(compressed)), Action::Continue);
        assert_eq!(
            *f.stream.response_body.borrow(),
            compressed.as_bytes(),
            "untouched"
        );
        assert_eq!(
            f.stream.response_headers.borrow()["content-encoding"],
            "gzip"
        );
    }
    assert_eq!(w.window("read_order").failures, 0, "never a tool failure");
    assert_eq!(w.metrics.get(RESPONSES_UNREAD), 12);
    // A failure whose body the filter replaces loses the server's encoding with it.
    let mut f = w.tools_call("read_order");
    f.respond(503, &gzip, Some("\u{1f}\u{8b}"));
    let headers = f.stream.response_headers.borrow();
    assert!(!headers.contains_key("content-encoding"));
    drop(headers);
    assert_eq!(f.body_json()["result"]["isError"], true);
}
