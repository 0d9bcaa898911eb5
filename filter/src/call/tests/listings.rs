//! A service's `tools/list` as it comes back: each tool the gateway would refuse annotated,
//! a listing with nothing to say passed byte for byte, one it cannot read passed and
//! counted, and no other answer read as a listing.

use super::*;

const LISTING: &str = r#"{"jsonrpc":"2.0","id":5,"result":{"tools":[{"name":"read_order","description":"Reads an order.","inputSchema":{"type":"object"}},{"name":"write_order","description":"Writes an order.","inputSchema":{"type":"object"}}]}}"#;

fn tools_list(w: &mut Worker) -> Flight {
    w.request(
        "orders",
        &[],
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/list","params":{}}"#,
    )
}

fn availability_of(listing: &Value, tool: usize) -> &Value {
    &listing["result"]["tools"][tool]["_meta"]["io.toolgate/availability"]
}

#[test]
fn a_forced_open_tool_is_annotated_in_its_services_listing() {
    let mut w = Worker::new();
    w.force_open("write_order", "incident 42");
    w.shared
        .borrow_mut()
        .config
        .services
        .entry("orders".into())
        .or_default()
        .tools
        .insert(
            "write_order".into(),
            toolgate_model::PolicyOverrides {
                fallback_tool: Some("read_order".into()),
                ..Default::default()
            },
        );
    let mut f = tools_list(&mut w);
    assert!(f.went_upstream());
    assert_eq!(f.json(LISTING), Action::Pause, "the listing is held");
    let v = f.body_json();
    let a = availability_of(&v, 1);
    assert_eq!(a["state"], "forced_open");
    assert_eq!(a["fallback"], "read_order");
    assert!(a["reason"].as_str().unwrap_or("").contains("incident 42"));
    assert!(v["result"]["tools"][1]["description"]
        .as_str()
        .unwrap_or("")
        .ends_with("use read_order instead."));
    assert!(v["result"]["tools"][0].get("_meta").is_none());
    let len = f.stream.response_body.borrow().len().to_string();
    assert_eq!(f.stream.response_headers.borrow()["content-length"], len);
    assert_eq!(w.metrics.get(crate::stats::TOOLS_LIST_ANNOTATED), 1);
}

#[test]
fn a_breaker_open_here_or_in_the_fleet_is_annotated_until_it_closes() {
    let mut w = Worker::new();
    let until = w.now + 60_000;
    w.shared.borrow_mut().config.fleet_open.insert(
        "orders".into(),
        BTreeMap::from([(
            "read_order".into(),
            toolgate_model::fleet::FleetOpen {
                until_ms: until,
                opened_by: "gw-b".into(),
                opened_at_ms: 1,
            },
        )]),
    );
    let mut f = tools_list(&mut w);
    f.json(LISTING);
    let v = f.body_json();
    assert_eq!(availability_of(&v, 0)["state"], "open");
    assert_eq!(
        availability_of(&v, 0)["until"],
        toolgate_model::availability::rfc3339(until)
    );
    // Past its deadline the fleet's word no longer counts.
    w.now = until;
    let mut f = tools_list(&mut w);
    f.json(LISTING);
    assert_eq!(
        f.stream.response_body.borrow().as_slice(),
        LISTING.as_bytes()
    );

    // Opened in this Envoy's shared breaker state.
    let key = breaker_key("orders", "write_order");
    let policy = w.shared.borrow().config.policy_for("orders", "write_order");
    let now = w.now;
    let opened = w
        .shared
        .borrow_mut()
        .breakers
        .open_until(&key, &policy, now, now + 30_000);
    assert!(opened.is_ok());
    let mut f = tools_list(&mut w);
    f.json(LISTING);
    let v = f.body_json();
    assert_eq!(availability_of(&v, 1)["state"], "open");
    assert!(v["result"]["tools"][0].get("_meta").is_none());
}

#[test]
fn a_listing_with_nothing_to_annotate_passes_byte_for_byte() {
    let mut w = Worker::new();
    let mut f = tools_list(&mut w);
    f.json(LISTING);
    assert_eq!(
        f.stream.response_body.borrow().as_slice(),
        LISTING.as_bytes()
    );
    assert_eq!(
        f.stream.response_headers.borrow()["content-length"],
        LISTING.len().to_string()
    );
    assert_eq!(w.metrics.get(crate::stats::TOOLS_LIST_UNREAD), 0);
}

#[test]
fn an_unreadable_or_oversized_listing_passes_and_is_counted() {
    let mut w = Worker::new();
    w.force_open("write_order", "x");
    let mut f = tools_list(&mut w);
    f.json("{not json");
    assert_eq!(f.stream.response_body.borrow().as_slice(), b"{not json");

    // Declared too large: not held at all.
    let big = (HOLD_LIMIT + 1).to_string();
    let mut f2 = tools_list(&mut w);
    {
        let mut h = f2.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "200".into());
        h.insert("content-type".into(), "application/json".into());
        h.insert("content-length".into(), big);
    }
    assert_eq!(
        f2.call.on_response_headers(&f2.stream, false),
        Action::Continue
    );
    // Grown too large while held: let go unchanged.
    let mut f3 = tools_list(&mut w);
    {
        let mut h = f3.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "200".into());
        h.insert("content-type".into(), "application/json".into());
    }
    assert_eq!(
        f3.call.on_response_headers(&f3.stream, false),
        Action::Pause
    );
    *f3.stream.response_body.borrow_mut() = vec![b' '; HOLD_LIMIT + 1];
    assert_eq!(
        f3.call.on_response_body(&f3.stream, HOLD_LIMIT + 1, false),
        Action::Continue
    );
    assert_eq!(
        f3.call.on_response_body(&f3.stream, 10, true),
        Action::Continue
    );
    assert_eq!(f3.stream.response_body.borrow().len(), HOLD_LIMIT + 1);
    assert_eq!(w.metrics.get(crate::stats::TOOLS_LIST_UNREAD), 3);
}

#[test]
fn an_sse_listing_is_annotated_once_its_event_is_complete() {
    let mut w = Worker::new();
    w.force_open("write_order", "incident 42");
    let mut f = tools_list(&mut w);
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "200".into());
        h.insert("content-type".into(), "text/event-stream".into());
        h.insert("content-length".into(), "999".into());
    }
    assert_eq!(
        f.call.on_response_headers(&f.stream, false),
        Action::Continue
    );
    assert!(!f
        .stream
        .response_headers
        .borrow()
        .contains_key("content-length"));
    let stream = format!("event: message\ndata: {LISTING}\n\n");
    let (first, _) = stream.split_at(30);
    *f.stream.response_body.borrow_mut() = first.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, first.len(), false),
        Action::Pause,
        "held until the response event is complete"
    );
    *f.stream.response_body.borrow_mut() = stream.as_bytes().to_vec();
    assert_eq!(
        f.call.on_response_body(&f.stream, stream.len(), false),
        Action::Continue
    );
    let body = String::from_utf8(f.stream.response_body.borrow().clone()).expect("utf-8");
    assert!(body.starts_with("event: message\ndata: {") && body.ends_with("}\n\n"));
    let v = json_of(body.as_bytes());
    assert_eq!(availability_of(&v, 1)["state"], "forced_open");
    // The rest of the stream passes unread.
    assert_eq!(
        f.call.on_response_body(&f.stream, 5, true),
        Action::Continue
    );
}

#[test]
fn a_tools_call_answer_is_not_read_as_a_listing() {
    let mut w = Worker::new();
    w.force_open("read_order", "x");
    let mut f = w.tools_call("write_order");
    f.json(LISTING.replace("\"id\":5", "\"id\":7").as_str());
    assert!(f.body_json()["result"]["tools"][0].get("_meta").is_none());
}
