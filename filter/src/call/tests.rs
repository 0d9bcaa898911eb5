//! The call lifecycle driven natively: a fake Envoy stream, an in-memory shared store and
//! metrics, and the same callbacks Envoy makes.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;

use serde_json::Value;
use toolgate_model::fleet::{Override, OverrideMode};

use super::*;
use crate::breaker::MemStore;
use crate::stats::MetricKind;

/// Metrics by name, as Envoy would show them.
#[derive(Default)]
struct Metrics {
    names: RefCell<Vec<String>>,
    values: RefCell<HashMap<u32, u64>>,
}

impl Metrics {
    fn get(&self, name: &str) -> u64 {
        let names = self.names.borrow();
        names
            .iter()
            .position(|n| n == name)
            .and_then(|i| self.values.borrow().get(&(i as u32)).copied())
            .unwrap_or(0)
    }
}

impl MetricHost for &Metrics {
    fn define(&self, _kind: MetricKind, name: &str) -> Option<u32> {
        let mut names = self.names.borrow_mut();
        if let Some(i) = names.iter().position(|n| n == name) {
            return Some(i as u32);
        }
        names.push(name.to_string());
        Some(names.len() as u32 - 1)
    }
    fn increment(&self, id: u32, by: u64) {
        *self.values.borrow_mut().entry(id).or_default() += by;
    }
    fn record(&self, id: u32, value: u64) {
        self.values.borrow_mut().insert(id, value);
    }
}

/// One stream as Envoy presents it to the filter.
#[derive(Default)]
struct Stream {
    now: Cell<u64>,
    request_headers: RefCell<HashMap<String, String>>,
    request_body: RefCell<Vec<u8>>,
    response_headers: RefCell<HashMap<String, String>>,
    response_body: RefCell<Vec<u8>>,
    replies: RefCell<Vec<(u32, Reply)>>,
    properties: RefCell<HashMap<String, Vec<u8>>>,
    logs: RefCell<Vec<String>>,
    /// Questions to toolgate-xds: path and body.
    dispatched: RefCell<Vec<(String, Vec<u8>)>>,
    resumed: Cell<u32>,
    raw_replies: RefCell<Vec<(u32, String, Vec<u8>)>>,
    /// The extra headers of each local reply.
    reply_headers: RefCell<Vec<Vec<(String, String)>>>,
    /// Request headers whose values are not UTF-8: present, but unreadable as text.
    binary_request_headers: RefCell<BTreeSet<String>>,
}

impl CallHost for Stream {
    fn now_ms(&self) -> u64 {
        self.now.get()
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.request_headers.borrow().get(name).cloned()
    }
    fn request_header_present(&self, name: &str) -> bool {
        self.request_headers.borrow().contains_key(name)
            || self.binary_request_headers.borrow().contains(name)
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        self.binary_request_headers.borrow_mut().remove(name);
        let mut h = self.request_headers.borrow_mut();
        match value {
            Some(v) => h.insert(name.to_string(), v.to_string()),
            None => h.remove(name),
        };
    }
    fn request_body(&self, len: usize) -> Option<Vec<u8>> {
        let body = self.request_body.borrow();
        Some(body[..len.min(body.len())].to_vec())
    }
    fn set_request_body(&self, len: usize, body: &[u8]) {
        let mut held = self.request_body.borrow_mut();
        assert_eq!(len, held.len(), "the whole held body is replaced");
        *held = body.to_vec();
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.response_headers.borrow().get(name).cloned()
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) {
        let mut h = self.response_headers.borrow_mut();
        match value {
            Some(v) => h.insert(name.to_string(), v.to_string()),
            None => h.remove(name),
        };
    }
    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        let body = self.response_body.borrow();
        Some(body[..len.min(body.len())].to_vec())
    }
    fn set_response_body(&self, _len: usize, body: &[u8]) {
        *self.response_body.borrow_mut() = body.to_vec();
    }
    fn send_reply(&self, status: u32, reply: &Reply, headers: &[(&str, &str)]) {
        self.replies.borrow_mut().push((status, reply.clone()));
        self.reply_headers.borrow_mut().push(
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.borrow().get(&path.join(".")).cloned()
    }
    fn set_property(&self, name: &str, value: &[u8]) {
        self.properties
            .borrow_mut()
            .insert(format!("wasm.{name}"), value.to_vec());
    }
    fn log(&self, _level: Level, message: &str) {
        self.logs.borrow_mut().push(message.to_string());
    }
    fn dispatch(&self, path: &str, body: &[u8], _authorization: &str) -> bool {
        self.dispatched
            .borrow_mut()
            .push((path.to_string(), body.to_vec()));
        true
    }
    fn resume_request(&self) {
        self.resumed.set(self.resumed.get() + 1);
    }
    fn resume_response(&self) {
        self.resumed.set(self.resumed.get() + 1);
    }
    fn send_raw(&self, status: u32, content_type: &str, body: &[u8], _headers: &[(&str, &str)]) {
        self.raw_replies
            .borrow_mut()
            .push((status, content_type.to_string(), body.to_vec()));
    }
}

/// A gateway's worker: its shared state, with `orders` listing two tools and `bare` none.
struct Worker {
    store: &'static MemStore,
    metrics: &'static Metrics,
    shared: Rc<RefCell<Shared<&'static MemStore, &'static Metrics>>>,
    now: u64,
}

impl Worker {
    fn new() -> Worker {
        let store: &'static MemStore = Box::leak(Box::new(MemStore::new()));
        let metrics: &'static Metrics = Box::leak(Box::default());
        let shared = Rc::new(RefCell::new(Shared::new(store, metrics, 7)));
        {
            let mut s = shared.borrow_mut();
            s.config.catalog = BTreeMap::from([
                (
                    "orders".to_string(),
                    BTreeSet::from([
                        "read_order".to_string(),
                        "write_order".to_string(),
                        "slow_order".to_string(),
                    ]),
                ),
                ("bare".to_string(), BTreeSet::new()),
            ]);
            s.config.defaults.open_jitter_percent = 0;
        }
        Worker {
            store,
            metrics,
            shared,
            now: 1_000_000,
        }
    }

    fn force_open(&self, tool: &str, reason: &str) {
        let mut s = self.shared.borrow_mut();
        s.config
            .overrides
            .entry("orders".into())
            .or_default()
            .insert(
                tool.to_string(),
                Override {
                    mode: OverrideMode::ForceOpen,
                    reason: reason.to_string(),
                    author: "ops".to_string(),
                    at_ms: 0,
                },
            );
    }

    /// A new request on this worker: headers and body as the client sent them.
    fn request(&mut self, service: &str, headers: &[(&str, &str)], body: &str) -> Flight {
        self.now += 10;
        let stream = Stream::default();
        stream.now.set(self.now);
        {
            let mut h = stream.request_headers.borrow_mut();
            h.insert(":path".into(), format!("/mcp/{service}"));
            h.insert(":method".into(), "POST".into());
            h.insert(
                "accept".into(),
                "application/json, text/event-stream".into(),
            );
            for (k, v) in headers {
                h.insert(k.to_string(), v.to_string());
            }
        }
        *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
        let mut call = Call::new(self.shared.clone());
        let headers_action = call.on_request_headers(&stream, false);
        let body_action = if stream.replies.borrow().is_empty() {
            Some(call.on_request_body(&stream, body.len(), true))
        } else {
            None
        };
        Flight {
            call,
            stream,
            headers_action,
            body_action,
        }
    }

    fn tools_call(&mut self, tool: &str) -> Flight {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{tool}","arguments":{{}}}}}}"#
        );
        self.request("orders", &[], &body)
    }

    fn stat(&self, tool: &str, kind: &str) -> u64 {
        // As Envoy shows them after the root context's next tick.
        self.shared.borrow_mut().stats.flush();
        self.metrics
            .get(&crate::stats::metric_name("orders", tool, kind))
    }

    /// The tool's window as shared data holds it, after this worker's pending counts.
    fn window(&self, tool: &str) -> crate::breaker::Counts {
        self.shared.borrow_mut().breakers.flush(self.now);
        self.shared
            .borrow()
            .breakers
            .snapshot(&breaker_key("orders", tool))
            .map(|b| b.totals(self.now))
            .unwrap_or_default()
    }
}

/// One request in flight.
struct Flight {
    call: Call<&'static MemStore, &'static Metrics>,
    stream: Stream,
    headers_action: Action,
    body_action: Option<Action>,
}

impl Flight {
    /// Admitted: the headers were held for the body, and the body let the request go on.
    fn went_upstream(&self) -> bool {
        self.headers_action == Action::Pause
            && self.body_action == Some(Action::Continue)
            && self.stream.replies.borrow().is_empty()
    }

    /// The one local reply the filter sent: its status and JSON.
    fn reply(&self) -> (u32, Value) {
        let replies = self.stream.replies.borrow();
        assert_eq!(replies.len(), 1, "one reply");
        let (status, reply) = &replies[0];
        (*status, json_of(&reply.body))
    }

    /// The upstream answers with `status`, `headers` and `body` (`None`: no body at all).
    fn respond(&mut self, status: u16, headers: &[(&str, &str)], body: Option<&str>) -> Action {
        {
            let mut h = self.stream.response_headers.borrow_mut();
            h.insert(":status".into(), status.to_string());
            for (k, v) in headers {
                h.insert(k.to_string(), v.to_string());
            }
        }
        let action = self.call.on_response_headers(&self.stream, body.is_none());
        if let Some(body) = body {
            *self.stream.response_body.borrow_mut() = body.as_bytes().to_vec();
            let body_action = self.call.on_response_body(&self.stream, body.len(), true);
            assert_eq!(body_action, Action::Continue);
        }
        self.call.on_log(&self.stream);
        action
    }

    fn json(&mut self, body: &str) -> Action {
        let len = body.len().to_string();
        self.respond(
            200,
            &[
                ("content-type", "application/json"),
                ("content-length", &len),
            ],
            Some(body),
        )
    }

    fn body_json(&self) -> Value {
        json_of(&self.stream.response_body.borrow())
    }
}

fn json_of(bytes: &[u8]) -> Value {
    let text = std::str::from_utf8(bytes).expect("utf-8");
    let text = text
        .rsplit_once("data: ")
        .map(|(_, data)| data.trim_end())
        .unwrap_or(text);
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

const RESULT: &str = r#"{"jsonrpc":"2.0","id":7,"result":{"content":[],"isError":false}}"#;

#[test]
fn a_listed_tool_is_admitted_and_its_success_counted() {
    let mut w = Worker::new();
    let mut f = w.tools_call("write_order");
    assert!(f.went_upstream());
    assert_eq!(f.json(RESULT), Action::Pause, "a small JSON answer is held");
    // Held with the reply Envoy sends in its place if the upstream cuts the answer off.
    assert_eq!(f.stream.request_headers.borrow()[HELD_HEADER], "1");
    let cut = json_of(&f.stream.properties.borrow()["wasm.mcp_cut_reply"]);
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
fn compressed_bodies_are_refused() {
    let mut w = Worker::new();
    let f = w.request("orders", &[("content-encoding", "gzip")], "\u{1f}");
    let (status, reply) = f.reply();
    assert_eq!(status, 415);
    assert_eq!(reply["error"]["code"], -32700);
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
fn session_ids_are_sealed_on_the_way_out_and_opened_on_the_way_in() {
    let w = Worker::new();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    let envelope = "MTI3LjAuMC4xOjQ0MTE3;8c1f3a";
    let out = Stream::default();
    {
        let mut h = out.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
        out.response_headers
            .borrow_mut()
            .insert(SESSION_HEADER.into(), envelope.into());
    }
    *out.request_body.borrow_mut() =
        br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#.to_vec();
    let mut call = Call::new(w.shared.clone());
    call.on_request_headers(&out, false);
    call.on_request_body(&out, 58, true);
    call.on_response_headers(&out, false);
    let sealed = out.response_headers.borrow()[SESSION_HEADER].clone();
    assert!(
        sealed.starts_with("tgs1.") && !sealed.contains("MTI3"),
        "{sealed}"
    );

    let back = Stream::default();
    {
        let mut h = back.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "DELETE".into());
        h.insert(SESSION_HEADER.into(), sealed);
    }
    Call::new(w.shared.clone()).on_request_headers(&back, true);
    assert_eq!(back.request_headers.borrow()[SESSION_HEADER], envelope);

    let forged = Stream::default();
    {
        let mut h = forged.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "GET".into());
        h.insert(SESSION_HEADER.into(), envelope.into());
    }
    Call::new(w.shared.clone()).on_request_headers(&forged, true);
    assert_eq!(
        forged.request_headers.borrow()[SESSION_HEADER],
        format!("!{envelope}"),
        "an address written by the client picks no instance"
    );
}

/// The aggregate endpoint: `default` offers every tool of `orders` prefixed; `ops` offers
/// `read_order` bare and `slow_order` prefixed, and not `write_order`.
fn aggregate_worker() -> Worker {
    use toolgate_model::policy::{PolicyOverrides, ServicePolicy};
    use toolgate_model::virtual_server::{VirtualRoutes, VirtualTool};
    let w = Worker::new();
    let mut config = w.shared.borrow().config.clone();
    let tool = |t: &str| VirtualTool {
        service: "orders".into(),
        tool: t.into(),
    };
    config.virtual_servers = BTreeMap::from([
        (
            "default".to_string(),
            VirtualRoutes {
                tools: ["read_order", "write_order", "slow_order"]
                    .iter()
                    .map(|t| (format!("orders__{t}"), tool(t)))
                    .collect(),
                prompts: BTreeMap::from([("orders__greeting".to_string(), tool("greeting"))]),
                resources: BTreeMap::from([
                    ("secret://report".to_string(), tool("secret://report")),
                    ("toolgate+orders:dup://x".to_string(), tool("dup://x")),
                    (
                        "dup://x".to_string(),
                        VirtualTool {
                            service: "billing".into(),
                            tool: "dup://x".into(),
                        },
                    ),
                ]),
                ..VirtualRoutes::default()
            },
        ),
        (
            "ops".to_string(),
            VirtualRoutes {
                tools: BTreeMap::from([
                    ("read_order".to_string(), tool("read_order")),
                    ("orders__slow_order".to_string(), tool("slow_order")),
                ]),
                ..VirtualRoutes::default()
            },
        ),
    ]);
    // Both tools fall back on `read_order`.
    let fallback = PolicyOverrides {
        fallback_tool: Some("read_order".into()),
        ..PolicyOverrides::default()
    };
    config.services.insert(
        "orders".into(),
        ServicePolicy {
            policy: None,
            tools: BTreeMap::from([
                ("write_order".to_string(), fallback.clone()),
                ("slow_order".to_string(), fallback),
            ]),
        },
    );
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    w
}

impl Worker {
    /// A request to `path` (an aggregate endpoint), with a declared length.
    fn request_to(&mut self, path: &str, headers: &[(&str, &str)], body: &str) -> Flight {
        self.now += 10;
        let stream = Stream::default();
        stream.now.set(self.now);
        {
            let mut h = stream.request_headers.borrow_mut();
            h.insert(":path".into(), path.into());
            h.insert(":method".into(), "POST".into());
            h.insert(
                "accept".into(),
                "application/json, text/event-stream".into(),
            );
            h.insert("content-length".into(), body.len().to_string());
            for (k, v) in headers {
                h.insert(k.to_string(), v.to_string());
            }
        }
        *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
        let mut call = Call::new(self.shared.clone());
        let headers_action = call.on_request_headers(&stream, false);
        let body_action = if stream.replies.borrow().is_empty() {
            Some(call.on_request_body(&stream, body.len(), true))
        } else {
            None
        };
        Flight {
            call,
            stream,
            headers_action,
            body_action,
        }
    }

    fn virtual_call(&mut self, path: &str, name: &str) -> Flight {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{name}","arguments":{{"name":"{name}"}}}}}}"#
        );
        self.request_to(path, &[], &body)
    }
}

fn sent_body(f: &Flight) -> String {
    String::from_utf8(f.stream.request_body.borrow().clone()).expect("utf-8")
}

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

/// A gateway session id as toolgate-xds makes them (long enough to have an owner).
const GATEWAY_SESSION: &str =
    "tgv1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

fn gateway_call(w: &mut Worker) -> Flight {
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__read_order","arguments":{}}}"#;
    w.request_to("/mcp", &[(SESSION_HEADER, GATEWAY_SESSION)], body)
}

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
    f.call
        .on_dispatch_response(&f.stream, Some(200), answer.as_bytes());
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
fn a_servers_question_on_mcp_names_the_server_and_its_answer_goes_back_under_its_id() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    let held =
        r#"{"envelope":"MTI3LjAuMC4xOjE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call
        .on_dispatch_response(&f.stream, Some(200), held.as_bytes());
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

#[test]
fn a_held_session_the_server_lost_is_replayed_and_the_client_sees_the_answer() {
    let mut w = aggregate_worker();
    let mut f = gateway_call(&mut w);
    let answer =
        r#"{"envelope":"ZW52LTE=;UV:YQ==","protocol_version":"2025-06-18","instance":"a"}"#;
    f.call
        .on_dispatch_response(&f.stream, Some(200), answer.as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), replayed.to_string().as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), replayed.to_string().as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), answer.to_string().as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(503), b"no healthy upstream");
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), replayed.to_string().as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(410), br#"{"failure":"ended"}"#);
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

/// A 2026-07-28 call on `/mcp`, stating `client` as its `clientInfo` in `_meta`.
fn stateless_call(w: &mut Worker, client: &str) -> Flight {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"orders__read_order","arguments":{{}},"_meta":{{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{{"name":"{client}","version":"1"}},"io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#
    );
    w.request_to("/mcp", &[("mcp-protocol-version", "2026-07-28")], &body)
}

/// `orders` speaks only 2025-06-18, as the catalog found.
fn legacy_orders(w: &Worker) {
    let mut config = w.shared.borrow().config.clone();
    config
        .legacy_revisions
        .insert("orders".into(), "2025-06-18".into());
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), answer.as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), answer.as_bytes());
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
    f.call
        .on_dispatch_response(&f.stream, Some(200), replayed.to_string().as_bytes());
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

mod auth {
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
        w.shared.borrow_mut().config.auth =
            Some(FilterAuth::new(&config, services, BTreeMap::new()));
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
        assert!(!headers.contains_key(PAYLOAD_HEADER));
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
        assert!(
            challenge(&f).starts_with(r#"Bearer error="insufficient_scope", scope="orders:write""#)
        );
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
        f.json(r#"{"jsonrpc":"2.0","id":7,"result":{"prompts":[{"name":"audit"},{"name":"summary"}]}}"#);
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
        let p =
            payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "alice"}));
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
        let cancel =
            r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}"#;
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
        let p =
            payload(serde_json::json!({"iss": "http://idp", "aud": "http://gw", "sub": "alice"}));
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
}

/// A request with `method` on `path`, its headers and body as the client sent them.
fn raw_request(
    w: &Worker,
    method: &str,
    path: &str,
    body: &str,
    end_of_stream: bool,
) -> (Call<&'static MemStore, &'static Metrics>, Stream, Action) {
    let stream = Stream::default();
    stream.now.set(w.now);
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), path.into());
        h.insert(":method".into(), method.into());
    }
    *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
    let mut call = Call::new(w.shared.clone());
    let action = call.on_request_headers(&stream, end_of_stream);
    (call, stream, action)
}

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

/// A key, and the listing toolgate-xds last sent for `/mcp`.
fn offline_worker() -> Worker {
    let w = aggregate_worker();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    config.offline_listings.insert(
        "default".into(),
        vec![
            serde_json::json!({"name": "orders__read_order", "description": "Reads.",
                                "inputSchema": {"type": "object"}}),
        ],
    );
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    w
}

/// Envoy could not reach any toolgate-xds for this request.
fn no_control_plane(f: &mut Flight, end_of_stream: bool) -> Action {
    f.stream.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"upstream_reset_before_response_started{remote_connection_failure}".to_vec(),
    );
    {
        let mut h = f.stream.response_headers.borrow_mut();
        h.insert(":status".into(), "503".into());
        h.insert("content-type".into(), "text/plain".into());
    }
    f.call.on_response_headers(&f.stream, end_of_stream)
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
    f.call
        .on_dispatch_response(&f.stream, Some(503), b"no healthy upstream");
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
    f.call
        .on_dispatch_response(&f.stream, Some(503), b"no healthy upstream");
    f.json(RESULT);
    assert!(f.stream.replies.borrow().is_empty());
}
