//! The root context: one per worker VM and configuration. It applies each configuration (the
//! fleet's openings and operators' overrides laid over the shared breakers), merges the
//! workers' pending counts on its tick, posts call feedback, and creates the HTTP contexts.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use toolgate_model::fleet::{BreakerEvent, FilterConfigStatus, FILTER_CONFIG_STATUS_PATH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel, MapType};

use super::events::{vm_queue_name, Posts, Queue, RESEND_EVERY_MS};
use super::stream::Stream;
use super::{log, now_ms, seed, HostMetrics, HostShared, HostStore};
use crate::breaker::{parse_breaker_key, CasMismatch, Force, Transition};
use crate::call::{transition_line, Sealing, Shared};
use crate::feedback::{self, Answer, Batch, Delivery, Feedback};
use crate::fleet;
use crate::keeper::{Keeper, Taken};
use crate::stats::CONFIG_REJECTED;

/// How often pending success counts are merged into shared data.
const TICK: Duration = Duration::from_millis(100);
/// A configuration-status report toolgate-xds did not acknowledge is sent again this often.
const STATUS_RESEND_MS: u64 = 5_000;

thread_local! {
    /// One per VM (a wasm VM runs on one thread): every root context Envoy makes for a new
    /// configuration finds the last one the VM accepted here.
    static KEEPER: RefCell<Keeper> = RefCell::new(Keeper::default());
    /// The call counts not posted yet, one per VM: a configuration change replaces the root
    /// context (and its state) while calls are counted, and those counts must not go with it.
    static FEEDBACK: Rc<RefCell<Feedback>> = Rc::new(RefCell::new(Feedback::new()));
}

fn log_unapplied(key: &str, what: &str) {
    log(
        LogLevel::Warn,
        &format!(
            "toolgate breaker {key}: the {what} lost every write race; \
             it is applied again with the next configuration"
        ),
    );
}

fn log_transition(key: &str, t: &Transition) {
    log(LogLevel::Warn, &transition_line(key, t));
}

/// `Bearer <token>` when toolgate-xds requires a token on reports, else empty.
fn report_authorization(shared: &RefCell<HostShared>) -> String {
    feedback::authorization(&shared.borrow().config.report_token)
}

pub(super) struct Root {
    pub(super) shared: Rc<RefCell<HostShared>>,
    pub(super) queue: Rc<RefCell<Queue>>,
    /// How toolgate-xds answered call feedback lately (for logging changes only).
    delivery: Delivery,
    /// This Envoy's node id, read once: the `gateway` of the breaker events.
    pub(super) gateway: Option<String>,
    pub(super) posts: Posts,
    /// A configuration-status report for toolgate-xds, until it acknowledges it; the token of
    /// the post in flight, and when it was last sent.
    status: Option<FilterConfigStatus>,
    status_token: Option<u32>,
    status_sent_ms: u64,
}

impl Root {
    pub(super) fn new() -> Root {
        let seed = seed();
        let mut shared = Shared::new(HostStore, HostMetrics, seed);
        shared.feedback = FEEDBACK.with(Rc::clone);
        Root {
            shared: Rc::new(RefCell::new(shared)),
            queue: Rc::new(RefCell::new(Queue::new())),
            delivery: Delivery::new(),
            gateway: None,
            posts: Posts::new(seed),
            status: None,
            status_token: None,
            status_sent_ms: 0,
        }
    }

    /// Sends the pending configuration-status report, if one is due.
    fn post_status(&mut self, now: u64) {
        let Some(status) = &self.status else { return };
        if self.status_token.is_some() && now.saturating_sub(self.status_sent_ms) < STATUS_RESEND_MS
        {
            return;
        }
        // Serializing a plain struct cannot fail.
        let body = serde_json::to_vec(status).unwrap_or_default();
        let auth = report_authorization(&self.shared);
        self.status_sent_ms = now;
        self.status_token = self
            .dispatch_http_call(
                feedback::CLUSTER,
                feedback::report_headers(FILTER_CONFIG_STATUS_PATH, &auth),
                Some(&body),
                vec![],
                feedback::TIMEOUT,
            )
            .ok();
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

        // Without the list of forced keys (a host error), lifting would be guesswork: the
        // forces are set, and lifting waits for the next configuration.
        let previous = hostcalls::get_shared_data(fleet::FORCED_KEY)
            .ok()
            .map(|(value, _)| value.unwrap_or_default());
        let forces = fleet::forces(&config.overrides, previous.as_deref().unwrap_or_default());
        let mut forced: Vec<&str> = Vec::with_capacity(forces.set.len());
        for (target, force) in &forces.set {
            let policy = config.policy_for(target.service, target.tool);
            if !breakers.force(&target.key, &policy, now, *force) {
                log_unapplied(&target.key, "override");
            }
            forced.push(&target.key);
        }
        let lift = if previous.is_some() {
            &forces.lift[..]
        } else {
            &[]
        };
        for key in lift {
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
        if previous.as_ref().is_some_and(|p| *p != record) {
            let _ = hostcalls::set_shared_data(fleet::FORCED_KEY, Some(&record), None);
        }

        for opening in fleet::openings(&config.fleet_open, now) {
            let key = &opening.target.key;
            let policy = config.policy_for(opening.target.service, opening.target.tool);
            match breakers.open_until(key, &policy, now, opening.until_ms) {
                Ok(Some(t)) => {
                    log_transition(
                        &format!("{key} (opened by gateway {:?})", opening.opened_by),
                        &t,
                    );
                    stats.transition(key, t.to, t.at_ms);
                }
                Ok(None) => {}
                Err(CasMismatch) => log_unapplied(key, "fleet opening"),
            }
        }
    }

    /// Takes the queued breaker events (and `events`, from this root's own flush) and posts
    /// them to toolgate-xds.
    fn post_events(&mut self, events: Vec<BreakerEvent>) {
        let shared = &self.shared;
        self.posts.post_events(
            &self.queue,
            self.gateway.as_deref().unwrap_or_default(),
            &|| report_authorization(shared),
            events,
        );
    }

    /// Sends again the breaker events toolgate-xds has not acknowledged (see
    /// `Posts::resend_unacked`).
    fn resend_unacked(&mut self, older_than_ms: u64) {
        let shared = &self.shared;
        self.posts.resend_unacked(
            self.gateway.as_deref().unwrap_or_default(),
            &|| report_authorization(shared),
            older_than_ms,
        );
    }

    /// Posts a batch of call feedback; a report that cannot go is dropped, never queued: the
    /// next one carries fresher counts.
    fn send_feedback(&mut self, batch: Batch) {
        if batch.dropped > 0 {
            log(
                LogLevel::Warn,
                &format!(
                    "toolgate: call feedback left out {} calls: this worker already counts {} endpoints",
                    batch.dropped,
                    feedback::MAX_ENDPOINTS
                ),
            );
        }
        let Some(body) = batch.body else { return };
        let auth = report_authorization(&self.shared);
        let sent = self.dispatch_http_call(
            feedback::CLUSTER,
            feedback::report_headers(feedback::PATH, &auth),
            Some(&body),
            vec![],
            feedback::TIMEOUT,
        );
        if let Err(status) = &sent {
            if self.delivery.dispatched(false) {
                log(
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
        let answer = Answer::of_status(status);
        if self.status_token == Some(token_id) {
            self.status_token = None;
            if answer == Answer::Accepted {
                self.status = None;
            }
            return;
        }
        if self.posts.events_answered(token_id, answer) {
            return;
        }
        let Some(change) = self.delivery.answered(answer) else {
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
        log(level, &message);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let taken = KEEPER.with(|k| k.borrow_mut().take(&bytes));
        let config = match &taken {
            Taken::Applied(config) => Some(config.clone()),
            Taken::Kept { config, error } => {
                log(
                    LogLevel::Error,
                    &format!(
                        "toolgate: refused a filter configuration ({error}); still judging \
                         with the last one this VM accepted"
                    ),
                );
                Some(config.clone())
            }
            Taken::Unconfigured { error } => {
                log(
                    LogLevel::Critical,
                    &format!(
                        "toolgate: refused a filter configuration ({error}) and has none to \
                         keep: every request on an MCP path is refused until a valid one arrives"
                    ),
                );
                None
            }
        };
        match config {
            // Breaker state lives in shared data: a new configuration never resets it, only
            // lays the fleet's state over it.
            Some(config) => {
                if self.shared.borrow_mut().configure(config) == Sealing::BadKey {
                    log(
                        LogLevel::Error,
                        "toolgate: the session key is not 32 bytes of base64: session ids are \
                         not sealed, and show the upstream addresses to clients",
                    );
                }
                self.apply_fleet();
            }
            None => self.shared.borrow_mut().unconfigured = true,
        }
        {
            let mut shared = self.shared.borrow_mut();
            shared.stats.define_gateway_counters();
            if !matches!(taken, Taken::Applied(_)) {
                shared.stats.count(CONFIG_REJECTED);
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
                log(
                    LogLevel::Warn,
                    "toolgate: this Envoy has no node id; breaker events name no gateway",
                );
            }
        }
        // Envoy calls `on_queue_ready` of a queue's last registrant on its thread right after
        // every enqueue (proxy-wasm-cpp-host `SharedQueue::registerQueue` keeps the queue's
        // data and replaces its consumer). The tick drains it too, as a fallback.
        let gateway = self.gateway.clone().unwrap_or_default();
        self.status = KEEPER.with(|k| k.borrow_mut().status(&taken, &gateway));
        let queue = hostcalls::register_shared_queue(vm_queue_name()).ok();
        self.queue.borrow_mut().id = queue;
        self.set_tick_period(TICK);
        true
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        self.post_events(Vec::new());
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        let (batch, events) = {
            self.queue.borrow_mut().outbox.refill();
            let mut guard = self.shared.borrow_mut();
            let shared = &mut *guard;
            let transitions = shared.breakers.flush(now);
            shared.stats.flush();
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
            let batch = shared.feedback.borrow_mut().flush(now);
            (batch, events)
        };
        // Sent with the shared state released: the host call must not find it borrowed.
        if let Some(batch) = batch {
            self.send_feedback(batch);
        }
        self.post_events(events);
        self.post_status(now);
        if now.saturating_sub(self.posts.last_resend_ms) >= RESEND_EVERY_MS {
            self.posts.last_resend_ms = now;
            self.resend_unacked(RESEND_EVERY_MS);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(
            self.shared.clone(),
            self.queue.clone(),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
