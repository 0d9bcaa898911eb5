//! The call lifecycle driven natively: a fake Envoy stream, an in-memory shared store and
//! metrics, and the same callbacks Envoy makes.
//!
//! The tests, by concern, are in the modules below; the harness and the helpers several of
//! them use are here.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;

use serde_json::Value;
use toolgate_model::fleet::{Override, OverrideMode};

use super::*;
use crate::breaker::MemStore;
use crate::stats::MetricKind;

mod aggregate;
mod auth;
mod breakers;
mod cost;
mod credential;
mod held;
mod judging;
mod limits;
mod listings;
mod offline;
mod responses;
mod sessions;

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
    fn dispatch(&self, path: &str, body: &[u8], _authorization: &str) -> Option<u32> {
        let mut dispatched = self.dispatched.borrow_mut();
        dispatched.push((path.to_string(), body.to_vec()));
        Some(dispatched.len() as u32)
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
        self.request_with(service, headers, body, |_| {})
    }

    /// As [`Worker::request`], with the stream set up by `setup` first (its properties).
    fn request_with(
        &mut self,
        service: &str,
        headers: &[(&str, &str)],
        body: &str,
        setup: impl FnOnce(&Stream),
    ) -> Flight {
        self.now += 10;
        let stream = Stream::default();
        setup(&stream);
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

/// A gateway session id as toolgate-xds makes them (long enough to have an owner).
const GATEWAY_SESSION: &str =
    "tgv1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

fn gateway_call(w: &mut Worker) -> Flight {
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"orders__read_order","arguments":{}}}"#;
    w.request_to("/mcp", &[(SESSION_HEADER, GATEWAY_SESSION)], body)
}

/// `orders` speaks only 2025-06-18, as the catalog found.
fn legacy_orders(w: &Worker) {
    let mut config = w.shared.borrow().config.clone();
    config
        .legacy_revisions
        .insert("orders".into(), "2025-06-18".into());
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
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
