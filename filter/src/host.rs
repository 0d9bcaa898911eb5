//! The only file that talks to proxy-wasm: Envoy's callbacks in, host calls out. Every
//! decision is made by the plain modules (`mcp`, `breaker`, `upstream`, `feedback`).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};
use toolgate_model::policy::FilterConfig;
use toolgate_model::BreakerPolicy;

use crate::breaker::{
    breaker_key, Admission, Breakers, CasMismatch, Outcome, SharedStore, Transition,
};
use crate::feedback::{self, Answer, Batch, Delivery, Feedback, Kind};
use crate::mcp::jsonrpc::{
    self, classify_response, parse_request, RawId, RequestInfo, ResponseClass, ToolName,
};
use crate::mcp::reply::{self, Framing, ProtocolVersion, Reply, Unavailable, UnavailableKind};
use crate::mcp::sse::SseScanner;
use crate::stats::{self, MetricHost, MetricKind, Stats, ToolMetrics};
use crate::upstream::{verdict, Verdict};

/// How often pending success counts are merged into shared data.
const TICK: Duration = Duration::from_millis(100);
/// A JSON response body larger than this is passed through unjudged rather than buffered.
const MAX_JSON_RESPONSE: usize = 4 * 1024 * 1024;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("toolgate filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new()) });
}}

/// proxy-wasm shared data: one store for every worker VM of this Envoy.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(CasMismatch),
            // Other errors are the host's; treat as a lost race so the write is retried later.
            Err(_) => Err(CasMismatch),
        }
    }
}

/// proxy-wasm metrics; Envoy names them `wasmcustom.<name>`.
struct HostMetrics;

impl MetricHost for HostMetrics {
    fn define(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment(&self, id: u32) {
        let _ = hostcalls::increment_metric(id, 1);
    }

    fn record(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn log_transition(key: &str, t: &Transition) {
    let until = t
        .open_until_ms
        .map(|u| format!(", probing after {} ms", u.saturating_sub(t.at_ms)))
        .unwrap_or_default();
    let _ = hostcalls::log(
        LogLevel::Warn,
        &format!(
            "toolgate breaker {key}: {} -> {} ({}){until}",
            t.from, t.to, t.cause
        ),
    );
}

struct Shared {
    config: FilterConfig,
    breakers: Breakers<HostStore>,
    stats: Stats<HostMetrics>,
    feedback: Feedback,
}

struct Root {
    shared: Rc<RefCell<Shared>>,
    delivery: Delivery,
}

impl Root {
    fn new() -> Root {
        let seed = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Root {
            shared: Rc::new(RefCell::new(Shared {
                config: FilterConfig::default(),
                breakers: Breakers::new(HostStore, seed),
                stats: Stats::new(HostMetrics),
                feedback: Feedback::new(),
            })),
            delivery: Delivery::new(),
        }
    }

    /// Posts a batch of call feedback; a report that cannot go is dropped, never queued: the
    /// next one carries fresher counts.
    fn send_feedback(&mut self, batch: Batch) {
        if batch.dropped > 0 {
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!(
                    "toolgate: call feedback left out {} calls: this worker already counts {} endpoints",
                    batch.dropped,
                    feedback::MAX_ENDPOINTS
                ),
            );
        }
        let Some(body) = batch.body else { return };
        let sent = self.dispatch_http_call(
            feedback::CLUSTER,
            vec![
                (":method", "POST"),
                (":path", feedback::PATH),
                (":authority", feedback::AUTHORITY),
                ("content-type", "application/json"),
            ],
            Some(&body),
            vec![],
            feedback::TIMEOUT,
        );
        if let Err(status) = &sent {
            if self.delivery.dispatched(false) {
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    &format!(
                        "toolgate: cannot send call feedback to cluster {} ({status:?}); \
                         reports are dropped until it can",
                        feedback::CLUSTER
                    ),
                );
            }
        } else {
            self.delivery.dispatched(true);
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        num_headers: usize,
        _body_size: usize,
        _num_trailers: usize,
    ) {
        // Envoy calls back with no headers when the call timed out or the connection failed.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|b| std::str::from_utf8(&b).ok()?.parse::<u16>().ok())
        };
        let Some(change) = self.delivery.answered(Answer::of_status(status)) else {
            return;
        };
        let (level, message) = match change {
            Answer::Accepted => (
                LogLevel::Info,
                "toolgate: toolgate-xds accepts call feedback again".to_string(),
            ),
            Answer::Rejected(status) => (
                LogLevel::Warn,
                format!("toolgate: toolgate-xds answered call feedback with HTTP {status}"),
            ),
            Answer::NoAnswer => (
                LogLevel::Warn,
                "toolgate: no answer from toolgate-xds to call feedback (timeout or connection failure)"
                    .to_string(),
            ),
        };
        let _ = hostcalls::log(level, &message);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match FilterConfig::from_json(&bytes) {
            // Breaker state lives in shared data: a new configuration never resets it.
            Ok(config) => self.shared.borrow_mut().config = config,
            Err(e) => {
                let _ = hostcalls::log(
                    LogLevel::Error,
                    &format!("toolgate: ignoring an invalid filter configuration: {e}"),
                );
            }
        }
        self.set_tick_period(TICK);
        true
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        let batch = {
            let mut shared = self.shared.borrow_mut();
            let transitions = shared.breakers.flush(now);
            for t in &transitions {
                log_transition("(merged counts)", t);
            }
            if !transitions.is_empty() {
                // A flush does not say which breakers moved: read this worker's known ones.
                let Shared {
                    breakers, stats, ..
                } = &mut *shared;
                stats.refresh(now, |key| {
                    breakers
                        .snapshot(key)
                        .map(|b| stats::breaker_value(&b, now))
                });
            }
            shared.feedback.flush(now)
        };
        // Sent with the shared state released: the host call must not find it borrowed.
        if let Some(batch) = batch {
            self.send_feedback(batch);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Call::new(self.shared.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// What the filter is doing with the response of a watched call.
enum Watch {
    None,
    /// The chunks seen so far of a JSON body that came in several (usually it comes in one).
    Json(Vec<u8>),
    Sse(SseScanner),
    /// The upstream failed: the body is replaced by this reply at the end of the stream.
    Replace(Reply),
}

/// The upstream instance that served an admitted call, as far as the call feedback knows.
enum Endpoint {
    /// Not asked yet: asking costs a host call, made once per call and only when the answer
    /// can be reported.
    Unread,
    Known(String),
    /// Envoy chose no instance, or did not say.
    Unknown,
}

/// A `tools/call` that went upstream, until its outcome is recorded.
struct Admitted {
    key: String,
    policy: BreakerPolicy,
    admission: Admission,
    started_ms: u64,
    metrics: Option<ToolMetrics>,
    endpoint: Endpoint,
}

struct Call {
    shared: Rc<RefCell<Shared>>,
    service: Option<String>,
    version: ProtocolVersion,
    framing: Framing,
    header_method: Option<String>,
    header_name: Option<String>,
    id: Option<RawId>,
    tool: Option<String>,
    admitted: Option<Admitted>,
    watch: Watch,
}

impl Call {
    fn new(shared: Rc<RefCell<Shared>>) -> Call {
        Call {
            shared,
            service: None,
            version: ProtocolVersion::V2025_03_26,
            framing: Framing::Json,
            header_method: None,
            header_name: None,
            id: None,
            tool: None,
            admitted: None,
            watch: Watch::None,
        }
    }

    fn send_reply(&self, status: u32, reply: &Reply) {
        self.send_http_response(
            status,
            vec![
                ("content-type", reply.content_type),
                ("cache-control", "no-store"),
            ],
            Some(&reply.body),
        );
    }

    /// Reads the upstream address of the admitted call, if not read yet.
    fn read_endpoint(&mut self) {
        let Some(a) = &mut self.admitted else { return };
        if !matches!(a.endpoint, Endpoint::Unread) {
            return;
        }
        a.endpoint = match hostcalls::get_property(vec!["upstream", "address"]) {
            Ok(Some(bytes)) if !bytes.is_empty() => match String::from_utf8(bytes) {
                Ok(address) => Endpoint::Known(address),
                Err(_) => Endpoint::Unknown,
            },
            _ => Endpoint::Unknown,
        };
    }

    /// Records the outcome of the admitted call, once; `report` is what the call feedback
    /// says about its upstream instance, if anything.
    fn record(&mut self, outcome: Outcome, report: Option<Kind>) {
        let Some(a) = self.admitted.take() else {
            return;
        };
        let mut shared = self.shared.borrow_mut();
        if let (Some(kind), Endpoint::Known(address), Some(service)) =
            (report, &a.endpoint, &self.service)
        {
            shared.feedback.record(service, address, kind);
        }
        if let Some(ids) = &a.metrics {
            shared.stats.outcome(ids, outcome, a.policy.count_is_error);
        }
        if let Some(t) = shared
            .breakers
            .record(&a.key, &a.policy, now_ms(), a.admission, outcome)
        {
            log_transition(&a.key, &t);
            shared.stats.transition(&a.key, t.to, t.at_ms);
        }
    }

    /// Success or slow, by how long the call took.
    fn answered(&mut self, is_error: bool) {
        let Some(a) = &self.admitted else { return };
        let outcome = if is_error {
            Outcome::IsErrorResult
        } else if now_ms().saturating_sub(a.started_ms) >= a.policy.slow_call_ms {
            Outcome::Slow
        } else {
            Outcome::Success
        };
        self.record(outcome, Some(Kind::Ok));
    }

    fn classified(&mut self, class: ResponseClass) {
        match class {
            ResponseClass::Result { is_error } => self.answered(is_error),
            // A failure of the tool, not of the instance: it answered.
            ResponseClass::Error { .. } => self.record(Outcome::Failure, Some(Kind::Ok)),
            // The client lied in a header: never held against the tool. A probe still
            // frees its slot: the server did answer.
            ResponseClass::HeaderMismatch | ResponseClass::Other | ResponseClass::Unparseable => {
                self.answered(false)
            }
        }
    }

    /// The request body is complete: decide.
    fn on_request(&mut self, body: &[u8]) -> Action {
        let Some(service) = self.service.clone() else {
            return Action::Continue;
        };
        let info = parse_request(body);
        // Batches, notifications and malformed bodies pass to the server unjudged.
        let RequestInfo::Single(request) = &info else {
            return Action::Continue;
        };
        if request.method != jsonrpc::TOOLS_CALL {
            return Action::Continue;
        }
        let Some(ToolName::Valid(tool)) = request.tool() else {
            return Action::Continue;
        };
        if self.version.has_request_headers() {
            let check = jsonrpc::check_headers(
                self.header_method.as_deref(),
                self.header_name.as_deref(),
                &info,
            );
            if matches!(check, jsonrpc::HeaderCheck::Mismatch(_)) {
                // The server answers -32020; one client's lie must not open a tool's breaker.
                return Action::Continue;
            }
        }
        let tool = tool.to_string();
        let id = request.id.clone();
        let key = breaker_key(&service, &tool);
        let now = now_ms();
        let (admission, policy, metrics) = {
            let mut shared = self.shared.borrow_mut();
            let policy = shared.config.policy_for(&service, &tool);
            let (admission, transition) = shared.breakers.admit(&key, &policy, now);
            let metrics = shared
                .stats
                .admitted(&key, &service, &tool, &admission, now);
            if let Some(t) = transition {
                log_transition(&key, &t);
                shared.stats.transition(&key, t.to, t.at_ms);
            }
            (admission, policy, metrics)
        };
        match admission {
            Admission::Reject {
                retry_after_ms,
                forced,
                ..
            } => {
                let kind = if forced {
                    UnavailableKind::ForcedOpen { reason: "" }
                } else {
                    UnavailableKind::Open
                };
                let details = Unavailable {
                    kind,
                    tool: Some(&tool),
                    retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
                    fallback_tool: policy.fallback_tool.as_deref(),
                };
                let reply = reply::tool_unavailable(self.version, &id, &details, self.framing);
                self.send_reply(200, &reply);
                Action::Pause
            }
            Admission::Allow | Admission::Probe { .. } => {
                self.admitted = Some(Admitted {
                    key,
                    policy,
                    admission,
                    started_ms: now,
                    metrics,
                    endpoint: Endpoint::Unread,
                });
                self.id = Some(id);
                self.tool = Some(tool);
                Action::Continue
            }
        }
    }

    fn upstream_failed(&mut self, v: Verdict) -> Option<Reply> {
        let (Some(id), Some(tool)) = (self.id.clone(), self.tool.clone()) else {
            return None;
        };
        let (kind, outcome) = match v {
            Verdict::Overloaded => (UnavailableKind::Overloaded, Outcome::Failure),
            Verdict::Failed(what) => (UnavailableKind::UpstreamFailure { what }, Outcome::Failure),
            _ => return None,
        };
        let fallback = self
            .admitted
            .as_ref()
            .and_then(|a| a.policy.fallback_tool.clone());
        let retry = self
            .admitted
            .as_ref()
            .map(|a| a.policy.open_ms.div_ceil(1000))
            .unwrap_or(10);
        self.record(outcome, Kind::of_verdict(v));
        let details = Unavailable {
            kind,
            tool: Some(&tool),
            retry_after_secs: retry.max(1),
            fallback_tool: fallback.as_deref(),
        };
        Some(reply::tool_unavailable(
            self.version,
            &id,
            &details,
            self.framing,
        ))
    }
}

impl Context for Call {}

impl HttpContext for Call {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let Some(rest) = path.strip_prefix("/mcp/") else {
            return Action::Continue;
        };
        let service = rest.split(['/', '?']).next().unwrap_or_default();
        if service.is_empty() || self.get_http_request_header(":method").as_deref() != Some("POST")
        {
            return Action::Continue;
        }
        self.service = Some(service.to_string());
        self.version = ProtocolVersion::from_header(
            self.get_http_request_header("mcp-protocol-version")
                .as_deref(),
        );
        self.framing = Framing::from_accept(self.get_http_request_header("accept").as_deref());
        self.header_method = self.get_http_request_header("mcp-method");
        self.header_name = self.get_http_request_header("mcp-name");
        if let Some(m) = &self.header_method {
            // 2026-07-28 names the method up front: other methods need no body.
            if m != jsonrpc::TOOLS_CALL {
                return Action::Continue;
            }
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        let declared = self
            .get_http_request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit) {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            self.send_reply(413, &reply);
            return Action::Pause;
        }
        if end_of_stream {
            return Action::Continue;
        }
        // Hold the headers until the body says which tool is called.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.service.is_none() {
            return Action::Continue;
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        if body_size as u64 > limit {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            self.send_reply(413, &reply);
            return Action::Pause;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        self.on_request(&body)
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.admitted.is_none() {
            return Action::Continue;
        }
        let status = self
            .get_http_response_header(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        // Each host call costs about a microsecond: only a failure needs Envoy's details.
        let (overloaded, details) = if status < 500 {
            (false, String::new())
        } else {
            (
                self.get_http_response_header("x-envoy-overloaded")
                    .is_some(),
                self.get_property(vec!["response", "code_details"])
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default(),
            )
        };
        let v = verdict(status, overloaded, &details);
        if Kind::of_verdict(v).is_some() {
            self.read_endpoint();
        }
        match v {
            Verdict::Answered => {
                let ct = self
                    .get_http_response_header("content-type")
                    .unwrap_or_default();
                self.watch = if ct.starts_with("text/event-stream") {
                    match &self.id {
                        Some(id) => Watch::Sse(SseScanner::new(id.clone())),
                        None => Watch::None,
                    }
                } else {
                    Watch::Json(Vec::new())
                };
            }
            Verdict::ClientError => self.answered(false),
            v @ (Verdict::Overloaded | Verdict::Failed(_)) => {
                if let Some(reply) = self.upstream_failed(v) {
                    self.set_http_response_header(":status", Some("200"));
                    self.set_http_response_header("content-type", Some(reply.content_type));
                    self.set_http_response_header("content-length", None);
                    self.watch = Watch::Replace(reply);
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match &mut self.watch {
            Watch::None => Action::Continue,
            Watch::Replace(_) => {
                if !end_of_stream {
                    return Action::Pause;
                }
                if let Watch::Replace(reply) = std::mem::replace(&mut self.watch, Watch::None) {
                    self.set_http_response_body(0, body_size, &reply.body);
                }
                Action::Continue
            }
            Watch::Json(_) => {
                // Passed through as it streams (holding it back would cost Envoy a buffering
                // round trip per call); only this call's copy is kept, and only if it is split.
                let chunk = self
                    .get_http_response_body(0, body_size)
                    .unwrap_or_default();
                let Watch::Json(seen) = &mut self.watch else {
                    return Action::Continue;
                };
                if seen.len() + chunk.len() > MAX_JSON_RESPONSE {
                    self.watch = Watch::None;
                    self.answered(false);
                    return Action::Continue;
                }
                if !end_of_stream {
                    seen.extend_from_slice(&chunk);
                    return Action::Continue;
                }
                let body = if seen.is_empty() {
                    chunk
                } else {
                    seen.extend_from_slice(&chunk);
                    std::mem::take(seen)
                };
                self.watch = Watch::None;
                if let Some(id) = self.id.clone() {
                    self.classified(classify_response(&body, &id));
                }
                Action::Continue
            }
            Watch::Sse(_) => {
                // Streamed through: only the chunk at hand is read, never the whole stream.
                let chunk = self
                    .get_http_response_body(0, body_size)
                    .unwrap_or_default();
                let found = match &mut self.watch {
                    Watch::Sse(scanner) => scanner.feed(&chunk),
                    _ => None,
                };
                if let Some(class) = found {
                    self.watch = Watch::None;
                    self.classified(class);
                } else if end_of_stream {
                    self.watch = Watch::None;
                    self.answered(false);
                }
                Action::Continue
            }
        }
    }

    fn on_log(&mut self) {
        // The stream ended before the outcome was known: the upstream went away mid-answer,
        // or the client did. Only the first is the tool's fault.
        if self.admitted.is_some() {
            let details = self
                .get_property(vec!["response", "code_details"])
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            if details.contains("downstream") {
                // Reported as an answer only if response headers came, i.e. the endpoint was
                // read: otherwise the instance's health is unknown.
                self.answered(false);
            } else {
                self.read_endpoint();
                self.record(Outcome::Failure, Some(Kind::Reset));
            }
        }
    }
}
