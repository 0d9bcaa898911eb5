//! The only file that talks to proxy-wasm: Envoy's callbacks in, host calls out. Every
//! decision is made by the plain modules (`mcp`, `breaker`, `upstream`, `feedback`,
//! `fleet`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};
use toolgate_model::fleet::BreakerEvent;
use toolgate_model::policy::FilterConfig;
use toolgate_model::BreakerPolicy;

use crate::breaker::{
    breaker_key, parse_breaker_key, Admission, Breakers, CasMismatch, Force, Outcome, SharedStore,
    State, Transition,
};
use crate::feedback::{self, Answer, Batch, Delivery, Feedback, Kind};
use crate::fleet::Pending;
use crate::fleet::{self, Outbox};
use crate::mcp::jsonrpc::{
    self, classify_response, parse_request, RawId, RequestInfo, ResponseClass, ToolName,
};
use crate::mcp::reply::{self, Framing, ProtocolVersion, Reply, Unavailable, UnavailableKind};
use crate::mcp::sse::SseScanner;
use crate::stats::{MetricHost, MetricKind, Stats, ToolMetrics};
use crate::upstream::{verdict, Verdict};

/// How often pending success counts are merged into shared data.
const TICK: Duration = Duration::from_millis(100);
/// A JSON response body larger than this is passed through unjudged rather than buffered.
const MAX_JSON_RESPONSE: usize = 4 * 1024 * 1024;
/// Events taken off the shared queue per drain; the rest wait for the next notification or
/// tick, so one callback never runs long.
const MAX_DRAIN: usize = 4 * fleet::MAX_EVENTS_PER_POST;
/// Breaker-event posts tracked for their answer. Each ends within its timeout, so more than
/// this means Envoy lost callbacks; past it, posts go out untracked.
const MAX_TRACKED_POSTS: usize = 1024;
/// Counter of breaker events this gateway could not report.
const EVENTS_DROPPED: &str = "toolgate.breaker_events_dropped";

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

fn log_unapplied(key: &str, what: &str) {
    let _ = hostcalls::log(
        LogLevel::Warn,
        &format!(
            "toolgate breaker {key}: the {what} lost every write race; \
             it is applied again with the next configuration"
        ),
    );
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

fn log_fleet_opening(key: &str, opened_by: &str, t: &Transition) {
    log_transition(&format!("{key} (opened by gateway {opened_by:?})"), t);
}

struct Shared {
    config: FilterConfig,
    breakers: Breakers<HostStore>,
    stats: Stats<HostMetrics>,
    feedback: Feedback,
    /// The breaker-event queue, once this root registered it.
    queue: Option<u32>,
    outbox: Outbox,
    dropped_metric: Option<u32>,
}

impl Shared {
    /// Counts `n` breaker events that will not reach toolgate-xds. Other gateways then do not
    /// learn of those transitions, so the first loss is logged and all are counted.
    fn lost(&mut self, n: u64, why: &str) {
        if n == 0 {
            return;
        }
        if self.outbox.lost(n) {
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!(
                    "toolgate: lost {n} breaker event(s) ({why}): the fleet does not learn of \
                     these transitions; further losses are only counted in {EVENTS_DROPPED}"
                ),
            );
        }
        if self.dropped_metric.is_none() {
            self.dropped_metric =
                hostcalls::define_metric(MetricType::Counter, EVENTS_DROPPED).ok();
        }
        if let Some(id) = self.dropped_metric {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}

/// How often a root sends again the events toolgate-xds has not acknowledged (and how old
/// they must be: younger posts may still be answered).
const RESEND_EVERY_MS: u64 = 250;

/// Read-modify-write of the unacknowledged events, with shared data's compare-and-swap (the
/// workers share the list). A few attempts; losing them only costs a duplicate or a resend.
fn update_unacked(f: impl Fn(Vec<Pending>) -> Vec<Pending>) {
    for _ in 0..4 {
        let (bytes, cas) = hostcalls::get_shared_data(fleet::UNACKED_KEY).unwrap_or((None, None));
        let next = f(fleet::decode_pending(bytes.as_deref()));
        let encoded = fleet::encode_pending(&next);
        match hostcalls::set_shared_data(fleet::UNACKED_KEY, Some(&encoded), cas) {
            Ok(()) => return,
            Err(Status::CasMismatch) => continue,
            Err(_) => return,
        }
    }
}

/// Hands a breaker event to the root context that reports them. Called from HTTP contexts,
/// with the shared state not borrowed.
fn enqueue_event(shared: &RefCell<Shared>, event: &BreakerEvent) {
    let (queue, room) = {
        let mut s = shared.borrow_mut();
        (s.queue, s.outbox.take())
    };
    let why = match (queue, room, fleet::encode_event(event)) {
        (None, _, _) => "the event queue is not registered",
        (_, false, _) => "too many events this tick",
        (_, _, None) => "the event does not serialize",
        (Some(queue), true, Some(bytes)) => {
            match hostcalls::enqueue_shared_queue(queue, Some(&bytes)) {
                Ok(()) => return,
                Err(_) => "the event queue is gone",
            }
        }
    };
    shared.borrow_mut().lost(1, why);
}

struct Root {
    shared: Rc<RefCell<Shared>>,
    delivery: Delivery,
    /// This Envoy's node id, read once: the `gateway` of the breaker events.
    gateway: Option<String>,
    /// Breaker-event posts awaiting an answer, with the number of events in each.
    event_posts: HashMap<u32, Vec<u64>>,
    /// Ids of this root's events (seeded per root, so roots do not collide).
    next_event_id: u64,
    last_resend_ms: u64,
    event_delivery: Delivery,
}

/// The event queue of this VM. Every worker runs its own VM instance, so this is one queue
/// per worker thread: a name shared by every worker would have a single consumer, the last
/// root to register, which after a configuration update can be the main thread's root (it
/// drops what it is handed). Within one VM every root registers the same name, so the newest
/// root consumes what the HTTP contexts of older roots (still finishing their streams)
/// enqueue.
fn vm_queue_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let unique = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        format!("{}.{unique:016x}", fleet::QUEUE)
    })
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
                queue: None,
                outbox: Outbox::new(),
                dropped_metric: None,
            })),
            delivery: Delivery::new(),
            gateway: None,
            event_posts: HashMap::new(),
            next_event_id: seed.rotate_left(32),
            last_resend_ms: 0,
            event_delivery: Delivery::new(),
        }
    }

    /// Lays the fleet's state over the shared breakers: operators' overrides first (a
    /// force-closed tool ignores fleet openings), then openings of other gateways. Every
    /// worker applies the same configuration; the second application changes nothing. Fleet
    /// openings are not reported back: a gateway never re-publishes an event it received.
    fn apply_fleet(&mut self) {
        // Wall clock, as the fleet's `until_ms` are.
        let now = now_ms();
        let mut guard = self.shared.borrow_mut();
        let Shared {
            config,
            breakers,
            stats,
            ..
        } = &mut *guard;

        let previous = hostcalls::get_shared_data(fleet::FORCED_KEY)
            .ok()
            .and_then(|(value, _)| value)
            .unwrap_or_default();
        let forces = fleet::forces(&config.overrides, &previous);
        let mut forced: Vec<&str> = Vec::with_capacity(forces.set.len());
        for (target, force) in &forces.set {
            let policy = config.policy_for(target.service, target.tool);
            if !breakers.force(&target.key, &policy, now, *force) {
                log_unapplied(&target.key, "override");
            }
            forced.push(&target.key);
        }
        for key in &forces.lift {
            let policy = parse_breaker_key(key)
                .map(|(service, tool)| config.policy_for(service, tool))
                .unwrap_or_else(|| config.defaults.clone());
            if !breakers.force(key, &policy, now, Force::None) {
                log_unapplied(key, "lifting of an override");
                // Kept on the list, so the next configuration lifts it.
                forced.push(key);
            }
        }
        let record = fleet::encode_forced(forced);
        if record != previous {
            let _ = hostcalls::set_shared_data(fleet::FORCED_KEY, Some(&record), None);
        }

        for opening in fleet::openings(&config.fleet_open, now) {
            let key = &opening.target.key;
            let policy = config.policy_for(opening.target.service, opening.target.tool);
            match breakers.open_until(key, &policy, now, opening.until_ms) {
                Ok(Some(t)) => {
                    log_fleet_opening(key, opening.opened_by, &t);
                    stats.transition(key, t.to, t.at_ms);
                }
                Ok(None) => {}
                Err(CasMismatch) => log_unapplied(key, "fleet opening"),
            }
        }
    }

    /// Takes the queued breaker events (and `events`, from this root's own flush) and posts
    /// them to toolgate-xds.
    fn post_events(&mut self, mut events: Vec<BreakerEvent>) {
        let queue = self.shared.borrow().queue;
        if let Some(queue) = queue {
            let mut unreadable = 0;
            for _ in 0..MAX_DRAIN {
                match hostcalls::dequeue_shared_queue(queue) {
                    Ok(Some(bytes)) => match fleet::decode_event(&bytes) {
                        Some(event) => events.push(event),
                        None => unreadable += 1,
                    },
                    Ok(None) | Err(_) => break,
                }
            }
            self.shared
                .borrow_mut()
                .lost(unreadable, "unreadable entries on the event queue");
        }
        if events.is_empty() {
            return;
        }
        let now = now_ms();
        let pending: Vec<Pending> = events
            .into_iter()
            .map(|event| {
                self.next_event_id = self.next_event_id.wrapping_add(1);
                Pending {
                    id: self.next_event_id,
                    at_ms: now,
                    event,
                }
            })
            .collect();
        update_unacked(|list| fleet::with_pending(list, &pending, now));
        self.send_pending(pending);
    }

    /// `Bearer <token>` when toolgate-xds requires a token on reports, else empty.
    fn report_authorization(&self) -> String {
        let shared = self.shared.borrow();
        let token = &shared.config.report_token;
        if token.is_empty() {
            String::new()
        } else {
            format!("Bearer {}", token.0)
        }
    }

    /// Posts events to toolgate-xds; each post remembers which events it carries, so an
    /// answer acknowledges exactly those.
    fn send_pending(&mut self, pending: Vec<Pending>) {
        let gateway = self.gateway.clone().unwrap_or_default();
        for chunk in pending.chunks(fleet::MAX_EVENTS_PER_POST) {
            let ids: Vec<u64> = chunk.iter().map(|p| p.id).collect();
            let events = chunk.iter().map(|p| p.event.clone()).collect();
            let Some((body, _)) = fleet::bodies(&gateway, events).into_iter().next() else {
                continue;
            };
            let auth = self.report_authorization();
            let sent = self.dispatch_http_call(
                feedback::CLUSTER,
                report_headers(fleet::PATH, &auth),
                Some(&body),
                vec![],
                fleet::TIMEOUT,
            );
            match sent {
                Ok(token) => {
                    self.event_delivery.dispatched(true);
                    if self.event_posts.len() < MAX_TRACKED_POSTS {
                        self.event_posts.insert(token, ids);
                    }
                }
                Err(status) => {
                    if self.event_delivery.dispatched(false) {
                        let _ = hostcalls::log(
                            LogLevel::Warn,
                            &format!(
                                "toolgate: cannot send breaker events to cluster {} ({status:?}); \
                                 they are sent again while they matter",
                                feedback::CLUSTER
                            ),
                        );
                    }
                }
            }
        }
    }

    /// Sends again what toolgate-xds has not acknowledged: posts of a replaced root context
    /// were cancelled with it. `older_than_ms` spares the posts still in flight.
    fn resend_unacked(&mut self, older_than_ms: u64) {
        let now = now_ms();
        let (bytes, _) = hostcalls::get_shared_data(fleet::UNACKED_KEY).unwrap_or((None, None));
        let due: Vec<Pending> = fleet::decode_pending(bytes.as_deref())
            .into_iter()
            .filter(|p| p.relevant(now) && now.saturating_sub(p.at_ms) >= older_than_ms)
            .collect();
        if !due.is_empty() {
            self.send_pending(due);
        }
    }

    /// toolgate-xds answered (or did not) a post of `n` breaker events.
    fn events_answered(&mut self, _n: u64, answer: Answer) {
        // Unacknowledged events are sent again while they matter: nothing is lost here.
        let Some(change) = self.event_delivery.answered(answer) else {
            return;
        };
        let (level, message) = match change {
            Answer::Accepted => (
                LogLevel::Info,
                "toolgate: toolgate-xds accepts breaker events again".to_string(),
            ),
            Answer::Rejected(status) => (
                LogLevel::Warn,
                format!("toolgate: toolgate-xds answered breaker events with HTTP {status}"),
            ),
            Answer::NoAnswer => (
                LogLevel::Warn,
                "toolgate: no answer from toolgate-xds to breaker events (timeout or connection failure)"
                    .to_string(),
            ),
        };
        let _ = hostcalls::log(level, &message);
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
        let auth = self.report_authorization();
        let sent = self.dispatch_http_call(
            feedback::CLUSTER,
            report_headers(feedback::PATH, &auth),
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
        token_id: u32,
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
        if let Some(ids) = self.event_posts.remove(&token_id) {
            let answer = Answer::of_status(status);
            if answer == Answer::Accepted {
                update_unacked(|list| fleet::without(list, &ids));
            }
            self.events_answered(ids.len() as u64, answer);
            return;
        }
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
            // Breaker state lives in shared data: a new configuration never resets it, only
            // lays the fleet's state over it.
            Ok(config) => {
                self.shared.borrow_mut().config = config;
                self.apply_fleet();
            }
            Err(e) => {
                let _ = hostcalls::log(
                    LogLevel::Error,
                    &format!("toolgate: ignoring an invalid filter configuration: {e}"),
                );
            }
        }
        let served_to = self.shared.borrow().config.gateway.clone();
        if !served_to.is_empty() {
            self.gateway = Some(served_to);
        }
        if self.gateway.is_none() {
            self.gateway = match hostcalls::get_property(vec!["node", "id"]) {
                Ok(Some(id)) if !id.is_empty() => String::from_utf8(id).ok(),
                _ => None,
            };
            if self.gateway.is_none() {
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    "toolgate: this Envoy has no node id; breaker events name no gateway",
                );
            }
        }
        // Envoy calls `on_queue_ready` of a queue's last registrant on its thread right after
        // every enqueue (proxy-wasm-cpp-host `SharedQueue::registerQueue` keeps the queue's
        // data and replaces its consumer). The tick drains it too, as a fallback.
        let queue = hostcalls::register_shared_queue(vm_queue_name()).ok();
        self.shared.borrow_mut().queue = queue;
        self.set_tick_period(TICK);
        true
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        self.post_events(Vec::new());
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        let (batch, events) = {
            let mut guard = self.shared.borrow_mut();
            let shared = &mut *guard;
            shared.outbox.refill();
            let transitions = shared.breakers.flush(now);
            let mut events = Vec::new();
            for (key, t) in &transitions {
                log_transition(&format!("{key} (merged counts)"), t);
                shared.stats.transition(key, t.to, t.at_ms);
                if let Some(event) = parse_breaker_key(key)
                    .and_then(|(service, tool)| fleet::event_of(service, tool, t))
                {
                    events.push(event);
                }
            }
            (shared.feedback.flush(now), events)
        };
        // Sent with the shared state released: the host call must not find it borrowed.
        if let Some(batch) = batch {
            self.send_feedback(batch);
        }
        self.post_events(events);
        if now.saturating_sub(self.last_resend_ms) >= RESEND_EVERY_MS {
            self.last_resend_ms = now;
            self.resend_unacked(RESEND_EVERY_MS);
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
        let event = {
            let mut shared = self.shared.borrow_mut();
            if let (Some(kind), Endpoint::Known(address), Some(service)) =
                (report, &a.endpoint, &self.service)
            {
                shared.feedback.record(service, address, kind);
            }
            if let Some(ids) = &a.metrics {
                shared.stats.outcome(ids, outcome, a.policy.count_is_error);
            }
            let t = shared
                .breakers
                .record(&a.key, &a.policy, now_ms(), a.admission, outcome);
            t.and_then(|t| {
                log_transition(&a.key, &t);
                shared.stats.transition(&a.key, t.to, t.at_ms);
                fleet::event_of(self.service.as_deref()?, self.tool.as_deref()?, &t)
            })
        };
        // Not dispatched from here: the stream ends right after this call, and Envoy cancels
        // a stream's callouts with it. The reporting root posts it.
        if let Some(event) = event {
            enqueue_event(&self.shared, &event);
        }
    }

    /// The reply for a tool an operator forced open, if it is: the call never reaches the
    /// breaker nor the upstream. Free when there are no overrides at all.
    fn forced_open(&self, service: &str, tool: &str, id: &RawId) -> Option<Reply> {
        let mut guard = self.shared.borrow_mut();
        let Shared { config, stats, .. } = &mut *guard;
        if config.overrides.is_empty() {
            return None;
        }
        let reason = fleet::forced_open(&config.overrides, service, tool)?;
        let policy = config.policy_for(service, tool);
        let details = Unavailable {
            kind: UnavailableKind::ForcedOpen { reason },
            tool: Some(tool),
            // An override has no end the agent could be told about.
            retry_after_secs: 0,
            fallback_tool: policy.fallback_tool.as_deref(),
        };
        let reply = reply::tool_unavailable(self.version, id, &details, self.framing);
        let admission = Admission::Reject {
            retry_after_ms: 0,
            state: State::Open,
            forced: true,
        };
        stats.admitted(
            &breaker_key(service, tool),
            service,
            tool,
            &admission,
            now_ms(),
        );
        Some(reply)
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
        self.log_field(log_field::METHOD, &request.method);
        if request.method != jsonrpc::TOOLS_CALL {
            return Action::Continue;
        }
        let Some(ToolName::Valid(tool)) = request.tool() else {
            return Action::Continue;
        };
        self.log_field(log_field::TOOL, tool);
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
        if let Some(reply) = self.forced_open(&service, tool, &request.id) {
            self.log_field(log_field::BREAKER, "forced_open");
            self.send_reply(200, &reply);
            return Action::Pause;
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
        self.log_field(
            log_field::BREAKER,
            match &admission {
                Admission::Allow => "closed",
                Admission::Probe { .. } => "half_open",
                Admission::Reject { forced: true, .. } => "forced_open",
                Admission::Reject { .. } => "open",
            },
        );
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
                    // A force has no end the agent could be told about (it lasts until
                    // lifted); this one outlived the configuration that set it.
                    retry_after_secs: if forced {
                        0
                    } else {
                        retry_after_ms.div_ceil(1000).max(1)
                    },
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

    /// A field of Envoy's access log: Envoy keeps a wasm property as the filter state
    /// `wasm.<name>`, which the bootstrap's format reads (`%FILTER_STATE(wasm.mcp_tool:PLAIN)%`).
    fn log_field(&self, name: &str, value: &str) {
        // Without an access log these host calls would be for nothing.
        if !self.shared.borrow().config.access_log {
            return;
        }
        // One host call; a failure only leaves the field empty in the log.
        let _ = hostcalls::set_property(vec![name], Some(value.as_bytes()));
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
        let depth = self.shared.borrow().config.max_json_depth;
        if jsonrpc::nests_deeper_than(&body, depth) {
            let reply = reply::too_deep(self.version, depth, self.framing);
            self.send_reply(400, &reply);
            return Action::Pause;
        }
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

/// The headers of a report to toolgate-xds (`authorization` only when it is not empty).
fn report_headers<'a>(path: &'a str, authorization: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", feedback::AUTHORITY),
        ("content-type", "application/json"),
    ];
    if !authorization.is_empty() {
        headers.push(("authorization", authorization));
    }
    headers
}

/// Names of the access-log fields the filter sets (a contract with the bootstrap's format).
pub mod log_field {
    pub const METHOD: &str = "mcp_method";
    pub const TOOL: &str = "mcp_tool";
    pub const BREAKER: &str = "mcp_breaker";
}
