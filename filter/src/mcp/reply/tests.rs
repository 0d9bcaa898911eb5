use super::*;
use serde_json::Value;

#[test]
fn a_reply_spliced_around_an_id_is_the_reply_written_for_it() {
    let details = Unavailable {
        kind: UnavailableKind::UpstreamFailure {
            what: UpstreamFailure::Reset,
        },
        tool: Some("write_order"),
        retry_after_secs: None,
        fallback_tool: Some("queue_order"),
    };
    let write =
        |id: &RawId| tool_unavailable(ProtocolVersion::V2025_06_18, id, &details, Framing::Json);
    let mut by_id: ById<&str> = ById::default();
    for text in ["1", "\"a-\\\"b\"", "-7", "\"\"", "12345678901234567890"] {
        let id = RawId::from_json(text).expect("id");
        let got = by_id.reply("write_order", &id, || write(&id));
        assert_eq!(got, write(&id).body, "id {text}");
    }
    assert_eq!(by_id.after_id.len(), 1);
    // A reply of another shape is written each time, never spliced.
    let mut sse: ById<&str> = ById::default();
    let id = RawId::from_json("3").expect("id");
    let framed = || tool_unavailable(ProtocolVersion::V2025_06_18, &id, &details, Framing::Sse);
    assert_eq!(sse.reply("k", &id, framed), framed().body);
    assert!(sse.after_id.is_empty());
}

fn id(text: &str) -> RawId {
    RawId::from_json(text).expect("test id")
}

fn json(reply: &Reply) -> Value {
    let text = std::str::from_utf8(&reply.body).expect("utf-8");
    let text = match reply.content_type {
        "text/event-stream" => text
            .strip_prefix("event: message\ndata: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .expect("one SSE event"),
        _ => text,
    };
    serde_json::from_str(text).expect("reply is JSON")
}

const FAILURE_RATE: OpenCause = OpenCause::FailureRate {
    percent: 70,
    calls: 10,
    window_secs: 10,
};

const OPEN: Unavailable<'static> = Unavailable {
    kind: UnavailableKind::Open {
        cause: FAILURE_RATE,
    },
    tool: Some("write_order"),
    retry_after_secs: Some(10),
    fallback_tool: Some("write_order_queue"),
};

#[test]
fn open_breaker_text_says_which_threshold_tripped_and_what_to_do() {
    assert_eq!(
        OPEN.text(),
        "The tool `write_order` is temporarily unavailable: 70% of its 10 calls in the last \
         10 seconds failed. The gateway refuses it for the next 10 seconds: do not retry it \
         before then. Use the tool `write_order_queue` instead."
    );
    let slow = Unavailable {
        kind: UnavailableKind::Open {
            cause: OpenCause::SlowCallRate {
                percent: 60,
                calls: 10,
                window_secs: 10,
                slow_call_ms: 2000,
            },
        },
        fallback_tool: None,
        retry_after_secs: Some(1),
        ..OPEN
    };
    assert_eq!(
        slow.text(),
        "The tool `write_order` is temporarily unavailable: 60% of its 10 calls in the last \
         10 seconds took 2 seconds or longer. The gateway refuses it for the next 1 second: \
         do not retry it before then. Continue without it or try a different approach."
    );
    let v = json(&tool_unavailable(
        ProtocolVersion::V2025_06_18,
        &id("3"),
        &slow,
        Framing::Json,
    ));
    let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["trippedBy"], "slow_call_rate");
    assert_eq!(meta["slowCallRatePercent"], 60);
    assert_eq!(meta["slowCallMs"], 2000);
    assert_eq!(meta["calls"], 10);
    assert!(meta["reason"]
        .as_str()
        .is_some_and(|r| r.contains("took 2 seconds or longer")));
}

#[test]
fn a_wait_is_named_only_where_the_gateway_enforces_it() {
    let forced = Unavailable {
        kind: UnavailableKind::ForcedOpen {
            reason: "  maintenance until 14:00.\n",
        },
        retry_after_secs: None,
        fallback_tool: None,
        ..OPEN
    };
    assert_eq!(
        forced.text(),
        "The tool `write_order` is disabled by an operator: maintenance until 14:00. It \
         stays disabled until the operator lifts this. Continue without it or try a \
         different approach."
    );
    let v = json(&tool_unavailable(
        ProtocolVersion::V2025_11_25,
        &id("1"),
        &forced,
        Framing::Json,
    ));
    let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "forced_open");
    assert_eq!(meta.get("retryAfterSeconds"), None, "{meta}");

    for (what, may_have_run) in [
        (UpstreamFailure::ConnectFailure, false),
        (UpstreamFailure::NoHealthyUpstream, false),
        (UpstreamFailure::Timeout, true),
        (UpstreamFailure::Reset, true),
        (UpstreamFailure::Http5xx(500), true),
        (UpstreamFailure::BadResponse, true),
        (UpstreamFailure::NoResponse, true),
        (UpstreamFailure::SessionRefused(503), false),
        (
            UpstreamFailure::SessionLimit {
                limit: 2,
                per_caller: false,
            },
            false,
        ),
    ] {
        let failed = Unavailable {
            kind: UnavailableKind::UpstreamFailure { what },
            retry_after_secs: None,
            fallback_tool: None,
            ..OPEN
        };
        let text = failed.text();
        assert!(!text.contains("Do not retry"), "{text}");
        assert!(!text.contains("refuses"), "{text}");
        assert_eq!(
            text.contains("may or may not have taken effect"),
            may_have_run
        );
        let v = json(&tool_unavailable(
            ProtocolVersion::V2025_06_18,
            &id("1"),
            &failed,
            Framing::Json,
        ));
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        assert_eq!(meta["state"], "upstream_failure");
        assert_eq!(meta["mayHaveRun"], may_have_run);
        assert_eq!(meta.get("retryAfterSeconds"), None);
    }
}

#[test]
fn tool_unavailable_echoes_the_raw_id_and_carries_details() {
    for raw in ["7", r#""a\"b\u00e9""#, "-3", "12345678901234567890123"] {
        let reply = tool_unavailable(ProtocolVersion::V2025_06_18, &id(raw), &OPEN, Framing::Json);
        let body = std::str::from_utf8(&reply.body).expect("utf-8");
        assert!(
            body.starts_with(&format!("{{\"jsonrpc\":\"2.0\",\"id\":{raw},")),
            "{body}"
        );
        assert_eq!(reply.content_type, "application/json");
    }
    let v = json(&tool_unavailable(
        ProtocolVersion::V2025_06_18,
        &id("7"),
        &OPEN,
        Framing::Json,
    ));
    assert_eq!(v["result"]["isError"], true);
    assert_eq!(v["result"].get("resultType"), None);
    let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "open");
    assert_eq!(meta["tool"], "write_order");
    assert_eq!(meta["retryAfterSeconds"], 10);
    assert_eq!(meta["fallbackTool"], "write_order_queue");
    assert_eq!(meta["trippedBy"], "failure_rate");
    assert_eq!(meta["failureRatePercent"], 70);
    let v = json(&tool_unavailable(
        ProtocolVersion::V2026_07_28,
        &id("1"),
        &OPEN,
        Framing::Json,
    ));
    assert_eq!(v["result"]["resultType"], "complete");
}

#[test]
fn operator_reason_is_escaped_and_bounded() {
    let hostile = format!(
        "\"}}],\"isError\":false,\u{2028}\u{0}\\{}",
        "é".repeat(1000)
    );
    let details = Unavailable {
        kind: UnavailableKind::ForcedOpen { reason: &hostile },
        ..OPEN
    };
    let reply = tool_unavailable(
        ProtocolVersion::V2025_03_26,
        &id("1"),
        &details,
        Framing::Sse,
    );
    let v = json(&reply);
    assert_eq!(v["result"]["isError"], true);
    let reason = v["result"]["_meta"]["io.toolgate/breaker"]["reason"]
        .as_str()
        .expect("reason");
    assert!(reason.len() <= MAX_REASON_BYTES);
    assert!(reason.starts_with("\"}],\"isError\":false,\u{2028} \\"));
    let body = std::str::from_utf8(&reply.body).expect("utf-8");
    assert_eq!(
        body.matches('\n').count(),
        3,
        "one event: two header lines and a blank"
    );
}

#[test]
fn sse_framing_is_one_message_event() {
    let reply = tool_unavailable(ProtocolVersion::V2025_11_25, &id("1"), &OPEN, Framing::Sse);
    assert_eq!(reply.content_type, "text/event-stream");
    let body = std::str::from_utf8(&reply.body).expect("utf-8");
    assert!(body.starts_with("event: message\ndata: {"));
    assert!(body.ends_with("}\n\n"));
    json(&reply);
}

#[test]
fn other_methods_get_an_error_naming_the_service() {
    let v = json(&service_unavailable(
        ProtocolVersion::V2025_11_25,
        &id("\"x\""),
        "orders",
        UpstreamFailure::NoHealthyUpstream,
        Framing::Sse,
    ));
    assert_eq!(v["id"], "x");
    assert_eq!(v["error"]["code"], INTERNAL_ERROR);
    assert_eq!(
        v["error"]["message"],
        "No server of the MCP service `orders` is available right now; try again in a few seconds."
    );
    assert_eq!(
        v["error"]["data"]["io.toolgate/breaker"]["failure"],
        "no_healthy_upstream"
    );
}

#[test]
fn refusals_and_header_mismatches_are_json_rpc_errors() {
    let v = json(&refused(
        ProtocolVersion::V2025_06_18,
        None,
        Refusal::DuplicateKey("params.name"),
        Framing::Json,
    ));
    assert_eq!(v["id"], Value::Null);
    assert_eq!(v["error"]["code"], INVALID_REQUEST);
    assert_eq!(v["error"].get("data"), None);
    let v = json(&refused(
        ProtocolVersion::V2026_07_28,
        Some(&id("4")),
        Refusal::NotJson { line: 1, column: 9 },
        Framing::Json,
    ));
    assert_eq!(v["id"], 4);
    assert_eq!(v["error"]["code"], -32700);
    let v = json(&header_mismatch(
        ProtocolVersion::V2026_07_28,
        Some(&id("1")),
        Mismatch::NameDiffers,
        Framing::Json,
    ));
    assert_eq!(v["error"]["code"], -32020);
}

#[test]
fn too_deep_names_the_limit() {
    let v = json(&too_deep(ProtocolVersion::V2025_06_18, 64, Framing::Json));
    assert_eq!(v.get("id"), Some(&Value::Null));
    assert_eq!(v["error"]["code"], INVALID_REQUEST);
    assert_eq!(v["error"]["data"]["io.toolgate/limits"]["maxJsonDepth"], 64);
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"].get("maxBodyBytes"),
        None
    );
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("64 levels")));
}

#[test]
fn body_too_large_without_id_follows_each_versions_rule() {
    let v = json(&body_too_large(
        ProtocolVersion::V2025_03_26,
        None,
        1024,
        Framing::Json,
    ));
    assert_eq!(v.get("id"), Some(&Value::Null));
    let v = json(&body_too_large(
        ProtocolVersion::V2026_07_28,
        None,
        1024,
        Framing::Json,
    ));
    assert_eq!(v.get("id"), None);
    assert_eq!(v["error"]["code"], INVALID_REQUEST);
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"]["maxBodyBytes"],
        1024
    );
    let v = json(&body_too_large(
        ProtocolVersion::V2025_06_18,
        Some(&id("9")),
        1,
        Framing::Sse,
    ));
    assert_eq!(v["id"], 9);
}

#[test]
fn a_refused_batch_answers_every_request_and_runs_none() {
    let (a, b) = (id("1"), id("\"two\""));
    let reply = batch_refused(
        ProtocolVersion::V2025_03_26,
        &[BatchAnswer::NotRun(&a), BatchAnswer::Unavailable(&b, OPEN)],
        Framing::Json,
    );
    let v = json(&reply);
    let answers = v.as_array().expect("an array");
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0]["id"], 1);
    assert_eq!(answers[0]["error"]["code"], INVALID_REQUEST);
    assert_eq!(answers[1]["id"], "two");
    assert_eq!(answers[1]["result"]["isError"], true);
}

#[test]
fn protocol_version_from_header() {
    assert_eq!(
        ProtocolVersion::from_header(None),
        ProtocolVersion::V2025_03_26
    );
    assert_eq!(
        ProtocolVersion::from_header(Some("2026-07-28")),
        ProtocolVersion::V2026_07_28
    );
    assert_eq!(
        ProtocolVersion::from_header(Some(" 2025-06-18 ")),
        ProtocolVersion::V2025_06_18
    );
    assert_eq!(
        ProtocolVersion::from_header(Some("2099-01-01")),
        ProtocolVersion::V2025_11_25
    );
    assert_eq!(
        ProtocolVersion::from_header(Some("")),
        ProtocolVersion::V2025_11_25
    );
    for v in ProtocolVersion::ALL {
        assert_eq!(ProtocolVersion::parse(v.as_str()), Some(v));
    }
    assert!(ProtocolVersion::V2026_07_28.has_request_headers());
    assert!(!ProtocolVersion::V2025_11_25.has_request_headers());
}

#[test]
fn framing_from_accept() {
    let f = |a| Framing::from_accept(a);
    assert_eq!(f(None), Framing::Json);
    assert_eq!(
        f(Some("application/json, text/event-stream")),
        Framing::Json
    );
    assert_eq!(f(Some("text/event-stream")), Framing::Sse);
    assert_eq!(f(Some("Text/Event-Stream;charset=utf-8")), Framing::Sse);
    assert_eq!(f(Some("text/event-stream, */*")), Framing::Json);
    assert_eq!(
        f(Some("text/event-stream, application/*;q=0.5")),
        Framing::Json
    );
    assert_eq!(
        f(Some("text/event-stream, application/json;q=0")),
        Framing::Sse
    );
    assert_eq!(f(Some("text/event-stream;q=0")), Framing::Json);
    assert_eq!(f(Some("")), Framing::Json);
    assert_eq!(f(Some(",,;;=,")), Framing::Json);
}
