//! Breaker events: from the HTTP context whose call tripped a breaker to toolgate-xds, which
//! writes them to etcd for the fleet. An HTTP context's stream ends right after the call that
//! trips, and Envoy cancels a stream's callouts with it, so it enqueues the event on a
//! proxy-wasm shared queue and the root context registered on it posts it. Posts toolgate-xds
//! has not acknowledged are kept in shared data and sent again while they matter.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, MetricType, Status};
use toolgate_model::fleet::BreakerEvent;

use super::{log, now_ms};
use crate::feedback::{self, Answer, Delivery};
use crate::fleet::{self, Outbox, Pending};

/// Events taken off the shared queue per drain; the rest wait for the next notification or
/// tick, so one callback never runs long.
const MAX_DRAIN: usize = 4 * fleet::MAX_EVENTS_PER_POST;
/// Breaker-event posts tracked for their answer. Each ends within its timeout, so more than
/// this means Envoy lost callbacks; past it, posts go out untracked.
const MAX_TRACKED_POSTS: usize = 1024;
/// Counter of breaker events this gateway could not report.
const EVENTS_DROPPED: &str = "toolgate.breaker_events_dropped";
/// How often a root sends again the events toolgate-xds has not acknowledged (and how old
/// they must be: younger posts may still be answered).
pub(super) const RESEND_EVERY_MS: u64 = 250;

/// The event queue of this worker VM and what is known about its losses.
pub(super) struct Queue {
    /// The queue, once this VM's root registered it.
    pub(super) id: Option<u32>,
    pub(super) outbox: Outbox,
    dropped_metric: Option<u32>,
}

impl Queue {
    pub(super) fn new() -> Queue {
        Queue {
            id: None,
            outbox: Outbox::new(),
            dropped_metric: None,
        }
    }

    /// Counts `n` breaker events that will not reach toolgate-xds. Other gateways then do not
    /// learn of those transitions, so the first loss is logged and all are counted.
    pub(super) fn lost(&mut self, n: u64, why: &str) {
        if n == 0 {
            return;
        }
        if self.outbox.lost(n) {
            log(
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

/// Hands a breaker event to the root context that reports them. Called from HTTP contexts,
/// with the queue not borrowed.
pub(super) fn enqueue(queue: &RefCell<Queue>, event: &BreakerEvent) {
    let (id, room) = {
        let mut q = queue.borrow_mut();
        (q.id, q.outbox.take())
    };
    let why = match (id, room, fleet::encode_event(event)) {
        (None, _, _) => "the event queue is not registered",
        (_, false, _) => "too many events this tick",
        (_, _, None) => "the event does not serialize",
        (Some(id), true, Some(bytes)) => match hostcalls::enqueue_shared_queue(id, Some(&bytes)) {
            Ok(()) => return,
            Err(_) => "the event queue is gone",
        },
    };
    queue.borrow_mut().lost(1, why);
}

/// Read-modify-write of the unacknowledged events, with shared data's compare-and-swap (the
/// workers share the list). A few attempts; losing them only costs a duplicate or a resend.
fn update_unacked(f: impl Fn(Vec<Pending>) -> Vec<Pending>) {
    for _ in 0..4 {
        let Ok((bytes, cas)) = hostcalls::get_shared_data(fleet::UNACKED_KEY) else {
            return;
        };
        let next = f(fleet::decode_pending(bytes.as_deref()));
        let encoded = fleet::encode_pending(&next);
        // A missing list is created only if still missing (see `breaker::CREATE_CAS`).
        let cas = Some(cas.unwrap_or(crate::breaker::CREATE_CAS));
        match hostcalls::set_shared_data(fleet::UNACKED_KEY, Some(&encoded), cas) {
            Ok(()) => return,
            Err(Status::CasMismatch) => continue,
            Err(_) => return,
        }
    }
}

/// The event queue of this VM. Every worker runs its own VM instance, so this is one queue
/// per worker thread: a name shared by every worker would have a single consumer, the last
/// root to register, which after a configuration update can be the main thread's root (it
/// drops what it is handed). Within one VM every root registers the same name, so the newest
/// root consumes what the HTTP contexts of older roots (still finishing their streams)
/// enqueue.
pub(super) fn vm_queue_name() -> &'static str {
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

/// What a root context keeps about its breaker-event posts.
pub(super) struct Posts {
    /// Posts awaiting an answer, with the ids of the events in each.
    pub(super) awaiting: HashMap<u32, Vec<u64>>,
    /// Ids of this root's events (seeded per root, so roots do not collide).
    next_id: u64,
    pub(super) last_resend_ms: u64,
    delivery: Delivery,
}

impl Posts {
    pub(super) fn new(seed: u64) -> Posts {
        Posts {
            awaiting: HashMap::new(),
            next_id: seed.rotate_left(32),
            last_resend_ms: 0,
            delivery: Delivery::new(),
        }
    }
}

// A root context's breaker-event posts. The root hands in what they need of it (the queue its
// HTTP contexts share, its gateway name, the authorization of its configuration), so this
// module does not import the root context that uses it.
impl Posts {
    /// Takes the queued breaker events (and `events`, from the root's own flush) and posts
    /// them to toolgate-xds, as `gateway`.
    pub(super) fn post_events(
        &mut self,
        queue: &RefCell<Queue>,
        gateway: &str,
        authorization: &impl Fn() -> String,
        mut events: Vec<BreakerEvent>,
    ) {
        let queue_id = queue.borrow().id;
        if let Some(id) = queue_id {
            let mut unreadable = 0;
            for _ in 0..MAX_DRAIN {
                match hostcalls::dequeue_shared_queue(id) {
                    Ok(Some(bytes)) => match fleet::decode_event(&bytes) {
                        Some(event) => events.push(event),
                        None => unreadable += 1,
                    },
                    Ok(None) | Err(_) => break,
                }
            }
            queue
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
                self.next_id = self.next_id.wrapping_add(1);
                Pending {
                    id: self.next_id,
                    at_ms: now,
                    event,
                }
            })
            .collect();
        update_unacked(|list| fleet::with_pending(list, &pending, now));
        self.send_pending(gateway, authorization, pending);
    }

    /// Posts events to toolgate-xds; each post remembers which events it carries, so an
    /// answer acknowledges exactly those.
    fn send_pending(
        &mut self,
        gateway: &str,
        authorization: &impl Fn() -> String,
        pending: Vec<Pending>,
    ) {
        for chunk in pending.chunks(fleet::MAX_EVENTS_PER_POST) {
            let ids: Vec<u64> = chunk.iter().map(|p| p.id).collect();
            let events = chunk.iter().map(|p| p.event.clone()).collect();
            let Some((body, _)) = fleet::bodies(gateway, events).into_iter().next() else {
                continue;
            };
            let auth = authorization();
            let sent = hostcalls::dispatch_http_call(
                feedback::CLUSTER,
                feedback::report_headers(fleet::PATH, &auth),
                Some(&body),
                vec![],
                fleet::TIMEOUT,
            );
            match sent {
                Ok(token) => {
                    self.delivery.dispatched(true);
                    if self.awaiting.len() < MAX_TRACKED_POSTS {
                        self.awaiting.insert(token, ids);
                    }
                }
                Err(status) => {
                    if self.delivery.dispatched(false) {
                        log(
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
    pub(super) fn resend_unacked(
        &mut self,
        gateway: &str,
        authorization: &impl Fn() -> String,
        older_than_ms: u64,
    ) {
        let now = now_ms();
        let Ok((bytes, _)) = hostcalls::get_shared_data(fleet::UNACKED_KEY) else {
            return;
        };
        let due: Vec<Pending> = fleet::decode_pending(bytes.as_deref())
            .into_iter()
            .filter(|p| p.relevant(now) && now.saturating_sub(p.at_ms) >= older_than_ms)
            .collect();
        if !due.is_empty() {
            self.send_pending(gateway, authorization, due);
        }
    }

    /// toolgate-xds answered (or did not) the post `token`; `true` if it was a post of
    /// breaker events.
    pub(super) fn events_answered(&mut self, token: u32, answer: Answer) -> bool {
        let Some(ids) = self.awaiting.remove(&token) else {
            return false;
        };
        if answer == Answer::Accepted {
            update_unacked(|list| fleet::without(list, &ids));
        }
        // Unacknowledged events are sent again while they matter: nothing is lost here.
        let Some(change) = self.delivery.answered(answer) else {
            return true;
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
        log(level, &message);
        true
    }
}
