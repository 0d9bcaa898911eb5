//! Admission and outcomes: what a tool's breaker admits and counts, what never counts
//! against a tool (the request's own errors, a client gone, a full bulkhead, a cancellation),
//! slow calls, forced overrides, and tools the catalog does not list.

use super::*;

#[test]
fn a_listed_tool_is_admitted_and_its_success_counted() {
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    assert!(f.went_upstream());
    assert_eq!(f.json(RESULT), Action::Pause, "a small JSON answer is held");
    // Held with the reply Envoy sends in its place if the upstream cuts the answer off.
    let mark = f.stream.request_headers.borrow()[HELD_HEADER].clone();
    assert!(
        !mark.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0),
        "a header value: {mark}"
    );
    let cut = json_of(mark.as_bytes());
    assert_eq!(cut["id"], 7);
    assert_eq!(
        cut["result"]["_meta"]["io.toolgate/breaker"]["failure"],
        "reset"
    );
    assert_eq!(w.stat("write_order", "calls"), 1);
    assert_eq!(w.stat("write_order", "failures"), 0);
    assert_eq!(f.body_json()["result"]["isError"], false, "passed on as is");
}

#[test]
fn a_forced_open_tool_is_refused_with_no_wait_to_honour() {
    let mut w = Worker::new();
    w.force_open("write_order", "bad deploy");
    let f = w.tools_call("write_order");
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "forced_open");
    assert_eq!(meta.get("retryAfterSeconds"), None);
    assert!(reply["result"]["content"][0]["text"]
        .as_str()
        .is_some_and(|t| t.contains("bad deploy") && !t.contains("retry it")));
    assert_eq!(w.stat("write_order", "rejected"), 1);
}

#[test]
fn unknown_tools_and_services_create_no_state() {
    let mut w = Worker::new();
    // A name the catalog does not list goes to the server, which answers for itself: no
    // breaker, no stats of its own, only the gateway's count of such calls.
    for i in 0..50 {
        let mut f = w.tools_call(&format!("fake_{i}"));
        assert!(f.went_upstream(), "fake_{i}");
        f.json(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"Unknown tool"}}"#);
    }
    // A case variant of a listed tool is another name.
    assert!(w.tools_call("WRITE_ORDER").went_upstream());
    let long = "x".repeat(40_000);
    let f = w.request(
        "orders",
        &[],
        &format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{long}"}}}}"#
        ),
    );
    assert_eq!(
        f.reply().1["error"]["code"],
        -32602,
        "no tool has such a name"
    );
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"write_order"}}"#;
    let service = "g".repeat(40_000);
    let f = w.request(&service, &[], body);
    assert!(
        f.went_upstream(),
        "Envoy answers an unknown service (no route)"
    );
    assert_eq!(w.store.stats().sets, 0);
    assert_eq!(
        *w.metrics.names.borrow(),
        vec![crate::stats::CALLS_UNLISTED.to_string()],
        "no stats defined but the count of unlisted calls"
    );
    assert_eq!(w.metrics.get(crate::stats::CALLS_UNLISTED), 51);
}

#[test]
fn unlisted_tools_get_breakers_once_answered_and_up_to_a_bound() {
    let mut w = Worker::new();
    let call = |w: &mut Worker, tool: &str, answer: &str| {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{tool}"}}}}"#
        );
        let mut f = w.request("bare", &[], &body);
        assert!(f.went_upstream());
        f.json(answer);
    };
    let unknown = r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"Unknown tool"}}"#;
    // Made-up names the server refuses as unknown never get a breaker, however many.
    for i in 0..(crate::catalog::MAX_UNLISTED_TOOLS + 20) {
        call(&mut w, &format!("made_up_{i}"), unknown);
        call(&mut w, &format!("made_up_{i}"), unknown);
    }
    assert_eq!(w.metrics.names.borrow().len(), 0);
    assert_eq!(w.store.stats().sets, 0);
    // Names the server answered as tools: the first call teaches the name, the next ones are
    // judged, up to the bound.
    for i in 0..(crate::catalog::MAX_UNLISTED_TOOLS + 20) {
        call(&mut w, &format!("t{i}"), RESULT);
        call(&mut w, &format!("t{i}"), RESULT);
    }
    let defined = w.metrics.names.borrow().len();
    assert_eq!(
        defined,
        crate::catalog::MAX_UNLISTED_TOOLS * 5,
        "five stats per tool, for the first {} tools",
        crate::catalog::MAX_UNLISTED_TOOLS
    );
}

#[test]
fn errors_that_blame_the_request_never_count() {
    let mut w = Worker::new();
    for _ in 0..30 {
        let mut f = w.tools_call("write_order");
        f.json(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"Invalid request parameters"}}"#);
    }
    let mut f = w.tools_call("write_order");
    assert!(f.went_upstream(), "30 client faults opened nothing");
    f.json(RESULT);
    assert_eq!(
        w.window("write_order").calls,
        1,
        "and padded nothing either"
    );
    for _ in 0..10 {
        let mut f = w.tools_call("write_order");
        f.json(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"db down"}}"#);
    }
    let (_, reply) = w.tools_call("write_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "open");
    assert_eq!(meta["trippedBy"], "failure_rate");
    assert_eq!(meta["calls"], 10, "one success and nine failures");
    assert!(meta["retryAfterSeconds"].as_u64().is_some_and(|s| s >= 9));
}

#[test]
fn a_client_that_goes_away_is_no_evidence_against_the_tool() {
    let mut w = Worker::new();
    for details in [
        "http2.remote_reset",
        "downstream_remote_disconnect",
        "codec_error:The_user_callback_function_failed",
        "",
    ] {
        let f = w.tools_call("slow_order");
        f.stream
            .properties
            .borrow_mut()
            .insert("response.code_details".into(), details.as_bytes().to_vec());
        let mut f = f;
        f.call.on_log(&f.stream);
        assert_eq!(w.window("slow_order").calls, 0, "{details}");
    }
    assert!(
        w.shared.borrow().feedback.borrow().is_empty(),
        "no call feedback"
    );
    let f = w.tools_call("slow_order");
    f.stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"upstream_reset_after_response_started{connection_termination}".to_vec(),
    );
    let mut f = f;
    f.call.on_log(&f.stream);
    assert_eq!(w.window("slow_order").failures, 1);
}

#[test]
fn a_full_bulkhead_is_not_the_tools_fault() {
    let mut w = Worker::new();
    for _ in 0..20 {
        let mut f = w.tools_call("write_order");
        f.respond(503, &[("x-envoy-overloaded", "true")], Some("overflow"));
        assert_eq!(
            f.body_json()["result"]["_meta"]["io.toolgate/breaker"]["state"],
            "overloaded"
        );
    }
    assert!(w.tools_call("write_order").went_upstream());
    assert_eq!(w.window("write_order").calls, 0);
}

#[test]
fn slow_calls_open_it_and_the_reply_says_so() {
    let mut w = Worker::new();
    for _ in 0..10 {
        let mut f = w.tools_call("slow_order");
        f.stream.now.set(w.now + 2_500);
        f.json(RESULT);
    }
    let (_, reply) = w.tools_call("slow_order").reply();
    let meta = &reply["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["trippedBy"], "slow_call_rate", "{reply}");
    assert_eq!(meta["slowCallRatePercent"], 100);
    let text = reply["result"]["content"][0]["text"]
        .as_str()
        .expect("text");
    assert!(text.contains("took 2 seconds or longer"), "{text}");
    assert!(!text.contains("failed"), "{text}");
}

#[test]
fn a_call_its_client_cancelled_counts_for_nothing() {
    let mut w = Worker::new();
    w.shared.borrow_mut().config.defaults.min_calls = 2;
    let session = [(SESSION_HEADER, "client-session-1")];
    for i in 0..12 {
        let call = format!(
            r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/call","params":{{"name":"slow_order"}}}}"#
        );
        let mut f = w.request("orders", &session, &call);
        assert!(f.went_upstream());
        let cancel = format!(
            r#"{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{i},"reason":"user"}}}}"#
        );
        assert!(w.request("orders", &session, &cancel).went_upstream());
        // The server answers -32800 (or ends its stream, or fails late): never the tool's.
        match i % 3 {
            0 => f.json(&format!(
                r#"{{"jsonrpc":"2.0","id":{i},"error":{{"code":-32800,"message":"Request cancelled"}}}}"#
            )),
            1 => f.json(&format!(
                r#"{{"jsonrpc":"2.0","id":{i},"error":{{"code":-32603,"message":"interrupted"}}}}"#
            )),
            _ => f.respond(
                200,
                &[("content-type", "text/event-stream")],
                Some("event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n"),
            ),
        };
    }
    let window = w.window("slow_order");
    assert_eq!(window.failures, 0, "{window:?}");
    // Another session's cancellation of the same id changes nothing for this one.
    let mut f = w.request(
        "orders",
        &[(SESSION_HEADER, "client-session-2")],
        r#"{"jsonrpc":"2.0","id":0,"method":"tools/call","params":{"name":"slow_order"}}"#,
    );
    f.json(r#"{"jsonrpc":"2.0","id":0,"error":{"code":-32603,"message":"broken"}}"#);
    assert_eq!(w.window("slow_order").failures, 1);
}
