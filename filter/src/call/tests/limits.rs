//! Call limits on the request path: per subject, per client address, per gateway; the tool
//! result and the 429; nothing counted against the tool.

use super::*;
use toolgate_model::limits::{FilterLimits, Limits, ServiceLimits};

fn with_limits(w: &Worker, service_rules: Option<&str>, tool_rules: &[(&str, &str)]) {
    let parse = |v: &str| Limits::parse(v.as_bytes()).expect("valid limits").rules;
    let limits = ServiceLimits {
        rules: service_rules.map(parse).unwrap_or_default(),
        tools: tool_rules
            .iter()
            .map(|(t, v)| (t.to_string(), parse(v)))
            .collect(),
    };
    w.shared.borrow_mut().config.limits = FilterLimits {
        services: BTreeMap::from([("orders".to_string(), limits)]),
        gateways: 1,
    };
}

fn from(w: &mut Worker, address: &str, tool: &str) -> Flight {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{tool}","arguments":{{}}}}}}"#
    );
    w.now += 10;
    // The address is a property of the stream, set before the request is judged.
    let stream_address = address.to_string();
    let f = w.request_with("orders", &[], &body, move |s| {
        s.properties
            .borrow_mut()
            .insert("source.address".into(), stream_address.into_bytes());
    });
    f
}

#[test]
fn a_client_over_its_tool_limit_gets_a_tool_result_and_the_tool_is_not_blamed() {
    let mut w = Worker::new();
    with_limits(
        &w,
        None,
        &[(
            "read_order",
            r#"{"per": "client", "calls": 2, "per_seconds": 60, "name": "reads"}"#,
        )],
    );
    for _ in 0..2 {
        assert!(from(&mut w, "10.0.0.1:5000", "read_order").went_upstream());
    }
    let f = from(&mut w, "10.0.0.1:5001", "read_order");
    let (status, body) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(body["id"], 7);
    assert_eq!(body["result"]["isError"], true, "{body}");
    let meta = &body["result"]["_meta"]["io.toolgate/breaker"];
    assert_eq!(meta["state"], "limited", "{body}");
    assert_eq!(meta["limit"]["rule"], "reads");
    assert_eq!(meta["limit"]["per"], "client");
    // Two calls a minute: the next token in 30 s.
    assert_eq!(meta["retryAfterSeconds"], 30, "{body}");
    let text = body["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        text.contains("limit of 2 calls per 60 seconds (rule `reads`)"),
        "{text}"
    );
    // Another client, and another tool of the same client, are not limited.
    assert!(from(&mut w, "10.0.0.2:5000", "read_order").went_upstream());
    assert!(from(&mut w, "10.0.0.1:5000", "write_order").went_upstream());
    // The refusal is counted for the rule, never against the tool.
    w.shared.borrow_mut().stats.flush();
    assert_eq!(
        w.metrics
            .get(&limit_metric("orders", "read_order", "reads")),
        1
    );
    assert_eq!(w.stat("read_order", crate::stats::REJECTED), 0);
    assert_eq!(w.window("read_order").calls, 0, "no outcome was recorded");
    assert!(
        !f.stream
            .properties
            .borrow()
            .keys()
            .any(|k| k.starts_with("wasm.")),
        "no access log configured: no log field"
    );
}

#[test]
fn a_service_rule_counts_every_request_and_answers_other_methods_429() {
    let mut w = Worker::new();
    with_limits(
        &w,
        Some(r#"{"per": "gateway", "calls": 1, "per_seconds": 10}"#),
        &[],
    );
    let list = r#"{"jsonrpc":"2.0","id":"l","method":"tools/list"}"#;
    assert!(w.request("orders", &[], list).went_upstream());
    let f = w.request("orders", &[], list);
    let (status, body) = f.reply();
    assert_eq!(status, 429);
    assert_eq!(body["id"], "l");
    assert_eq!(body["error"]["code"], LIMITED_CODE);
    assert_eq!(body["error"]["data"]["retryAfterSeconds"], 10);
    assert_eq!(body["error"]["data"]["limit"]["rule"], "gateway-1-per-10s");
    let headers = &f.stream.reply_headers.borrow()[0];
    assert!(
        headers.iter().any(|(k, v)| k == "retry-after" && v == "10"),
        "{headers:?}"
    );
    // A call counts against the service's rule too.
    let (_, body) = w.tools_call("read_order").reply();
    assert_eq!(
        body["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "limited"
    );
    // After the window, one passes again.
    w.now += 10_000;
    assert!(w.tools_call("read_order").went_upstream());
}

#[test]
fn a_tool_forced_open_takes_no_token() {
    let mut w = Worker::new();
    with_limits(
        &w,
        None,
        &[(
            "read_order",
            r#"{"per": "gateway", "calls": 1, "per_seconds": 3600}"#,
        )],
    );
    w.force_open("read_order", "maintenance");
    for _ in 0..3 {
        let (_, body) = w.tools_call("read_order").reply();
        assert_eq!(
            body["result"]["_meta"]["io.toolgate/breaker"]["state"],
            "forced_open"
        );
    }
    w.shared.borrow_mut().config.overrides.clear();
    assert!(w.tools_call("read_order").went_upstream());
}

#[test]
fn a_subject_rule_without_a_verified_subject_counts_the_client() {
    let mut w = Worker::new();
    with_limits(
        &w,
        None,
        &[(
            "read_order",
            r#"{"per": "subject", "calls": 1, "per_seconds": 60}"#,
        )],
    );
    assert!(from(&mut w, "10.0.0.1:1", "read_order").went_upstream());
    assert!(from(&mut w, "10.0.0.2:1", "read_order").went_upstream());
    let (_, body) = from(&mut w, "10.0.0.1:2", "read_order").reply();
    assert_eq!(
        body["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "limited"
    );
}

#[test]
fn the_audit_trail_names_the_decision_and_its_reason() {
    let mut w = Worker::new();
    w.shared.borrow_mut().config.access_log = true;
    with_limits(
        &w,
        None,
        &[(
            "read_order",
            r#"{"per": "gateway", "calls": 1, "per_seconds": 60, "name": "reads"}"#,
        )],
    );
    let field = |f: &Flight, name: &str| {
        f.stream
            .properties
            .borrow()
            .get(&format!("wasm.{name}"))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let allowed = w.tools_call("read_order");
    assert!(allowed.went_upstream());
    assert_eq!(field(&allowed, "mcp_decision").as_deref(), Some("allowed"));
    assert_eq!(field(&allowed, "mcp_service").as_deref(), Some("orders"));
    assert_eq!(field(&allowed, "mcp_tool").as_deref(), Some("read_order"));
    let limited = w.tools_call("read_order");
    assert_eq!(field(&limited, "mcp_decision").as_deref(), Some("limited"));
    assert_eq!(field(&limited, "mcp_reason").as_deref(), Some("reads"));
    assert_eq!(field(&limited, "mcp_limit").as_deref(), Some("reads"));
    w.force_open("write_order", "maintenance");
    let forced = w.tools_call("write_order");
    assert_eq!(field(&forced, "mcp_decision").as_deref(), Some("refused"));
    assert_eq!(field(&forced, "mcp_reason").as_deref(), Some("forced_open"));
}

#[test]
fn the_client_is_the_address_envoy_appended_not_what_the_client_wrote() {
    let mut w = Worker::new();
    with_limits(
        &w,
        None,
        &[(
            "read_order",
            r#"{"per": "client", "calls": 1, "per_seconds": 60}"#,
        )],
    );
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#;
    // Envoy appends the connection's address last; a client can only write before it.
    let first = w.request("orders", &[("x-forwarded-for", "1.1.1.1, 10.0.0.1")], body);
    assert!(first.went_upstream());
    let forged = w.request("orders", &[("x-forwarded-for", "2.2.2.2,10.0.0.1")], body);
    assert_eq!(
        forged.reply().1["result"]["_meta"]["io.toolgate/breaker"]["state"],
        "limited"
    );
    let other = w.request("orders", &[("x-forwarded-for", "1.1.1.1, 10.0.0.2")], body);
    assert!(other.went_upstream());
}
