//! One fleet: several gateways share breaker openings and operator overrides through etcd.
//!
//! toolgate-xds delivers the fleet's state inside this filter's configuration (`fleet_open`,
//! `overrides`), and this gateway reports its own breaker transitions back to it
//! (`POST /v1/breaker-events`). This module decides what applies and renders what is sent;
//! `host.rs` does the host calls.
//!
//! Reporting path: the transition that matters most (CLOSED to OPEN) happens in an HTTP
//! context, on the last failing call, whose stream ends right after: a callout dispatched
//! from there would be cancelled with it, and waiting for the root's next tick costs up to
//! a tick. So the HTTP context enqueues the event on a proxy-wasm shared
//! queue, and the root context registered on it posts it at once (see `host.rs` for how
//! Envoy picks that root).

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toolgate_model::fleet::{
    BreakerEvent, BreakerEvents, ByTool, EventState, FleetOpen, Override, OverrideMode,
};
use toolgate_model::validate_name;

use crate::breaker::{breaker_key, Force, State, Transition};

/// The shared queue that carries events from HTTP contexts to the reporting root context.
pub const QUEUE: &str = "toolgate.breaker_events";
/// toolgate-xds's breaker-event API, on the same cluster as the call feedback.
pub const PATH: &str = "/v1/breaker-events";
/// Another gateway waits on this report to reject: short, never retried (by the time a
/// retry succeeded the opening would be old news or over).
pub const TIMEOUT: Duration = Duration::from_secs(1);
/// Events one root context (and its HTTP contexts) may enqueue per tick. Every root drains
/// the whole queue on its tick, so this bounds the queue (Envoy's is unbounded) at about
/// workers × this; transitions are rare, so reaching it means something is badly wrong.
pub const MAX_EVENTS_PER_TICK: u32 = 256;
/// Events per POST; a drain that finds more sends several.
pub const MAX_EVENTS_PER_POST: usize = 256;
/// Shared-data key listing the breaker keys that carry an operator's force, so that the
/// configuration after the one that lifts an override knows which ones to clear: shared
/// data cannot be listed, and a new configuration comes with a new root context that
/// remembers nothing.
pub const FORCED_KEY: &str = "tg/forced";

/// The operator's reason if `tool` of `service` is forced open. The request path calls it
/// only when there are overrides at all.
pub fn forced_open<'a>(
    overrides: &'a ByTool<Override>,
    service: &str,
    tool: &str,
) -> Option<&'a str> {
    let o = overrides.get(service)?.get(tool)?;
    (o.mode == OverrideMode::ForceOpen).then_some(o.reason.as_str())
}

/// The breaker force an override lays over the state machine. A forced-open breaker rejects
/// until the override is lifted, so its deadline is "never".
pub fn force_of(mode: OverrideMode) -> Force {
    match mode {
        OverrideMode::ForceOpen => Force::Open { until_ms: u64::MAX },
        OverrideMode::ForceClosed => Force::Closed,
    }
}

/// A (service, tool) of the configuration, with its breaker key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<'a> {
    pub service: &'a str,
    pub tool: &'a str,
    pub key: String,
}

fn targets<'a, T>(by_tool: &'a ByTool<T>) -> impl Iterator<Item = (Target<'a>, &'a T)> + 'a {
    by_tool.iter().flat_map(|(service, tools)| {
        tools.iter().filter_map(move |(tool, value)| {
            // A name outside the rule could alias another breaker's key (a `/` in it):
            // toolgate-xds validates them, this only makes sure.
            if validate_name("service", service).is_err() || validate_name("tool", tool).is_err() {
                return None;
            }
            let target = Target {
                service,
                tool,
                key: breaker_key(service, tool),
            };
            Some((target, value))
        })
    })
}

/// What a configuration's overrides ask of the breakers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forces<'a> {
    /// Forces to set.
    pub set: Vec<(Target<'a>, Force)>,
    /// Breaker keys forced by an earlier configuration and no longer: set back to
    /// [`Force::None`].
    pub lift: Vec<String>,
}

/// The forces of `overrides`, given the breaker keys an earlier configuration forced
/// (the [`FORCED_KEY`] record).
pub fn forces<'a>(overrides: &'a ByTool<Override>, previous: &[u8]) -> Forces<'a> {
    let set: Vec<(Target<'a>, Force)> = targets(overrides)
        .map(|(target, o)| (target, force_of(o.mode)))
        .collect();
    let wanted: BTreeSet<&str> = set.iter().map(|(t, _)| t.key.as_str()).collect();
    let lift = decode_forced(previous)
        .into_iter()
        .filter(|key| !wanted.contains(key.as_str()))
        .collect();
    Forces { set, lift }
}

/// The [`FORCED_KEY`] record: breaker keys, one a line. Keys hold validated names, so never
/// a line break.
pub fn encode_forced<'k>(keys: impl IntoIterator<Item = &'k str>) -> Vec<u8> {
    let keys: BTreeSet<&str> = keys.into_iter().collect();
    keys.into_iter().collect::<Vec<_>>().join("\n").into_bytes()
}

pub fn decode_forced(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .filter(|key| crate::breaker::parse_breaker_key(key).is_some())
        .map(str::to_owned)
        .collect()
}

/// A tool that another gateway opened, still open at the time of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening<'a> {
    pub target: Target<'a>,
    pub until_ms: u64,
    pub opened_by: &'a str,
}

/// The fleet openings to apply at `now_ms` (wall clock): those not over yet. The list comes
/// whole with every configuration; applying one again changes nothing (see
/// `Breaker::open_until`).
pub fn openings(fleet_open: &ByTool<FleetOpen>, now_ms: u64) -> Vec<Opening<'_>> {
    targets(fleet_open)
        .filter(|(_, open)| open.until_ms > now_ms)
        .map(|(target, open)| Opening {
            target,
            until_ms: open.until_ms,
            opened_by: &open.opened_by,
        })
        .collect()
}

/// The event to report for a transition this gateway's breaker made on its own evaluation:
/// an opening (from CLOSED or HALF_OPEN) or a closing (from HALF_OPEN). OPEN to HALF_OPEN
/// is local business, and names outside the rule could not be keys in etcd.
pub fn event_of(service: &str, tool: &str, t: &Transition) -> Option<BreakerEvent> {
    let (state, open_ms) = match (t.from, t.to) {
        (State::Closed | State::HalfOpen, State::Open) => (
            EventState::Open,
            t.open_until_ms
                .unwrap_or(t.at_ms)
                .saturating_sub(t.at_ms)
                .max(1),
        ),
        (State::HalfOpen, State::Closed) => (EventState::Closed, 0),
        _ => return None,
    };
    if validate_name("service", service).is_err() || validate_name("tool", tool).is_err() {
        return None;
    }
    Some(BreakerEvent {
        service: service.to_owned(),
        tool: tool.to_owned(),
        state,
        open_ms,
    })
}

/// One event as it travels on the shared queue.
pub fn encode_event(event: &BreakerEvent) -> Option<Vec<u8>> {
    serde_json::to_vec(event).ok()
}

/// An event off the shared queue; `None` for bytes that are not one (another build of the
/// filter during an upgrade, say).
pub fn decode_event(bytes: &[u8]) -> Option<BreakerEvent> {
    serde_json::from_slice(bytes).ok()
}

/// The bodies of `POST /v1/breaker-events` for `events`, in order, at most
/// [`MAX_EVENTS_PER_POST`] each; with the number of events in each.
pub fn bodies(gateway: &str, events: Vec<BreakerEvent>) -> Vec<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let mut events = events.into_iter().peekable();
    while events.peek().is_some() {
        let chunk: Vec<BreakerEvent> = events.by_ref().take(MAX_EVENTS_PER_POST).collect();
        let n = chunk.len();
        let body = BreakerEvents {
            gateway: gateway.to_owned(),
            events: chunk,
        };
        // Strings and integers always serialize; `ok()` only avoids a panic path.
        if let Ok(bytes) = serde_json::to_vec(&body) {
            out.push((bytes, n));
        }
    }
    out
}

/// Shared-data key of the events posted but not yet acknowledged by toolgate-xds. Envoy
/// cancels a root context's callouts when a new configuration replaces that root, and every
/// fleet opening is such a configuration: a post in flight at that moment vanishes without
/// an answer. Every new root posts what is still unacknowledged (toolgate-xds takes
/// duplicates as no-ops), so an event is delivered at least once.
pub const UNACKED_KEY: &str = "tg/unacked";
/// Unacknowledged events kept; the oldest go first.
pub const MAX_UNACKED: usize = 256;
/// A closing stays worth delivering this long.
const CLOSED_RELEVANT_MS: u64 = 10_000;

/// An event posted and not yet acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub id: u64,
    pub at_ms: u64,
    pub event: BreakerEvent,
}

impl Pending {
    /// An opening is worth delivering while it lasts: a late one must not reopen a tool
    /// that has recovered meanwhile.
    pub fn relevant(&self, now_ms: u64) -> bool {
        let lasts = match self.event.state {
            EventState::Open => self.event.open_ms,
            EventState::Closed => CLOSED_RELEVANT_MS,
        };
        now_ms < self.at_ms.saturating_add(lasts)
    }
}

pub fn decode_pending(bytes: Option<&[u8]>) -> Vec<Pending> {
    bytes
        .and_then(|b| serde_json::from_slice(b).ok())
        .unwrap_or_default()
}

pub fn encode_pending(list: &[Pending]) -> Vec<u8> {
    serde_json::to_vec(list).unwrap_or_default()
}

/// `list` with `new` added (by id, once), what is no longer relevant dropped, and at most
/// [`MAX_UNACKED`] kept.
pub fn with_pending(mut list: Vec<Pending>, new: &[Pending], now_ms: u64) -> Vec<Pending> {
    for p in new {
        if !list.iter().any(|q| q.id == p.id) {
            list.push(p.clone());
        }
    }
    list.retain(|p| p.relevant(now_ms));
    if list.len() > MAX_UNACKED {
        let excess = list.len() - MAX_UNACKED;
        list.drain(..excess);
    }
    list
}

/// `list` without the acknowledged `ids`.
pub fn without(mut list: Vec<Pending>, ids: &[u64]) -> Vec<Pending> {
    list.retain(|p| !ids.contains(&p.id));
    list
}

/// One root context's share of the queue, and the events it lost.
#[derive(Debug)]
pub struct Outbox {
    left: u32,
    dropped: u64,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

impl Outbox {
    pub fn new() -> Outbox {
        Outbox {
            left: MAX_EVENTS_PER_TICK,
            dropped: 0,
        }
    }

    /// Takes a place in this tick's share; false when it is used up (drop the event).
    pub fn take(&mut self) -> bool {
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        true
    }

    /// A new tick: a new share.
    pub fn refill(&mut self) {
        self.left = MAX_EVENTS_PER_TICK;
    }

    /// Counts `n` lost events; true for the first loss, the one to log (later ones are only
    /// counted, so a failing control plane does not flood the log).
    pub fn lost(&mut self, n: u64) -> bool {
        let first = self.dropped == 0 && n > 0;
        self.dropped = self.dropped.saturating_add(n);
        first
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod pending_tests {
    use super::*;

    fn ev(state: EventState, open_ms: u64) -> BreakerEvent {
        BreakerEvent {
            service: "s".into(),
            tool: "t".into(),
            state,
            open_ms,
        }
    }

    #[test]
    fn unacknowledged_events_are_kept_once_while_relevant_and_bounded() {
        let open = Pending {
            id: 1,
            at_ms: 1_000,
            event: ev(EventState::Open, 5_000),
        };
        let closed = Pending {
            id: 2,
            at_ms: 1_000,
            event: ev(EventState::Closed, 0),
        };
        let list = with_pending(Vec::new(), &[open.clone(), closed.clone()], 2_000);
        let list = with_pending(list, std::slice::from_ref(&open), 2_000);
        assert_eq!(list, vec![open.clone(), closed.clone()], "once per id");
        assert_eq!(
            with_pending(list.clone(), &[], 6_500),
            vec![closed.clone()],
            "opening over"
        );
        assert!(with_pending(list.clone(), &[], 11_500).is_empty());
        assert_eq!(without(list, &[1]), vec![closed]);
        let many: Vec<Pending> = (0..(MAX_UNACKED as u64 + 10))
            .map(|id| Pending {
                id,
                at_ms: 1_000,
                event: ev(EventState::Open, 60_000),
            })
            .collect();
        let kept = with_pending(Vec::new(), &many, 2_000);
        assert_eq!(kept.len(), MAX_UNACKED);
        assert_eq!(kept[0].id, 10, "the oldest go first");
        let bytes = encode_pending(&kept);
        assert_eq!(decode_pending(Some(&bytes)), kept);
        assert!(decode_pending(Some(b"garbage")).is_empty());
        assert!(decode_pending(None).is_empty());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::{json, Value};

    use super::*;
    use crate::breaker::Cause;

    fn by_tool<T>(entries: Vec<(&str, &str, T)>) -> ByTool<T> {
        let mut out: ByTool<T> = BTreeMap::new();
        for (service, tool, value) in entries {
            out.entry(service.to_owned())
                .or_default()
                .insert(tool.to_owned(), value);
        }
        out
    }

    fn o(mode: OverrideMode, reason: &str) -> Override {
        Override {
            mode,
            reason: reason.to_owned(),
            author: "ops".to_owned(),
            at_ms: 1,
        }
    }

    fn t(from: State, to: State, at_ms: u64, open_until_ms: Option<u64>) -> Transition {
        Transition {
            from,
            to,
            cause: Cause::ProbeFailed,
            at_ms,
            open_until_ms,
            trips: 1,
            generation: 1,
        }
    }

    #[test]
    fn only_force_open_answers_for_the_operator() {
        let overrides = by_tool(vec![
            ("orders", "write", o(OverrideMode::ForceOpen, "maintenance")),
            (
                "orders",
                "read",
                o(OverrideMode::ForceClosed, "flaky probe"),
            ),
        ]);
        assert_eq!(
            forced_open(&overrides, "orders", "write"),
            Some("maintenance")
        );
        assert_eq!(forced_open(&overrides, "orders", "read"), None);
        assert_eq!(forced_open(&overrides, "orders", "other"), None);
        assert_eq!(forced_open(&overrides, "billing", "write"), None);
    }

    #[test]
    fn forces_set_the_overrides_and_lift_what_is_gone() {
        let overrides = by_tool(vec![
            ("orders", "write", o(OverrideMode::ForceOpen, "")),
            ("orders", "read", o(OverrideMode::ForceClosed, "")),
            ("bad/name", "x", o(OverrideMode::ForceOpen, "")),
        ]);
        let previous = encode_forced(["tg/b/orders/write", "tg/b/billing/pay"]);
        assert_eq!(previous, b"tg/b/billing/pay\ntg/b/orders/write");
        let f = forces(&overrides, &previous);
        let set: Vec<(&str, Force)> = f.set.iter().map(|(t, f)| (t.key.as_str(), *f)).collect();
        assert_eq!(
            set,
            vec![
                ("tg/b/orders/read", Force::Closed),
                ("tg/b/orders/write", Force::Open { until_ms: u64::MAX }),
            ]
        );
        assert_eq!(f.lift, vec!["tg/b/billing/pay".to_string()]);

        // No overrides left: everything forced before is lifted.
        let none = BTreeMap::new();
        let f = forces(&none, &previous);
        assert!(f.set.is_empty());
        assert_eq!(f.lift.len(), 2);
        // Nothing recorded (first configuration) or garbage: nothing to lift.
        assert!(forces(&overrides, b"").lift.is_empty());
        let garbage = b"\xff\ngarbage\ntg/b/x";
        assert!(forces(&overrides, garbage).lift.is_empty());
    }

    #[test]
    fn only_openings_not_over_apply() {
        let open = |until_ms| FleetOpen {
            until_ms,
            opened_by: "gw-2".to_owned(),
            opened_at_ms: 0,
        };
        let fleet = by_tool(vec![
            ("orders", "write", open(10_000)),
            ("orders", "read", open(5_000)),
            ("orders", "bad name", open(10_000)),
        ]);
        let o = openings(&fleet, 5_000);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].target.key, "tg/b/orders/write");
        assert_eq!((o[0].until_ms, o[0].opened_by), (10_000, "gw-2"));
        assert!(openings(&fleet, 10_000).is_empty());
    }

    #[test]
    fn openings_and_closings_are_events_nothing_else() {
        let open = event_of(
            "orders",
            "write",
            &t(State::Closed, State::Open, 1_000, Some(11_000)),
        )
        .expect("an event");
        assert_eq!(
            open,
            BreakerEvent {
                service: "orders".into(),
                tool: "write".into(),
                state: EventState::Open,
                open_ms: 10_000
            }
        );
        let reopen = event_of(
            "orders",
            "write",
            &t(State::HalfOpen, State::Open, 1_000, Some(21_000)),
        );
        assert_eq!(reopen.map(|e| e.open_ms), Some(20_000));
        let closed = event_of(
            "orders",
            "write",
            &t(State::HalfOpen, State::Closed, 5, None),
        )
        .expect("an event");
        assert_eq!((closed.state, closed.open_ms), (EventState::Closed, 0));
        assert_eq!(
            event_of("orders", "write", &t(State::Open, State::HalfOpen, 5, None)),
            None
        );
        assert_eq!(
            event_of(
                "or ders",
                "write",
                &t(State::Closed, State::Open, 5, Some(6))
            ),
            None
        );
    }

    #[test]
    fn events_survive_the_queue_and_make_the_body() {
        let e = event_of(
            "orders",
            "write",
            &t(State::Closed, State::Open, 0, Some(10_000)),
        )
        .unwrap();
        let bytes = encode_event(&e).unwrap();
        assert_eq!(decode_event(&bytes), Some(e.clone()));
        assert_eq!(decode_event(b"{\"service\":1}"), None);
        let closed = BreakerEvent {
            state: EventState::Closed,
            open_ms: 0,
            ..e.clone()
        };
        let bodies = bodies("gw-1", vec![e, closed]);
        assert_eq!(bodies.len(), 1);
        assert_eq!(bodies[0].1, 2);
        let v: Value = serde_json::from_slice(&bodies[0].0).unwrap();
        assert_eq!(
            v,
            json!({
                "gateway": "gw-1",
                "events": [
                    {"service": "orders", "tool": "write", "state": "open", "open_ms": 10000},
                    {"service": "orders", "tool": "write", "state": "closed", "open_ms": 0}
                ]
            })
        );
        // The contract type reads it back.
        let back: BreakerEvents = serde_json::from_slice(&bodies[0].0).unwrap();
        assert_eq!(back.events.len(), 2);
    }

    #[test]
    fn many_events_go_in_several_posts() {
        let e = BreakerEvent {
            service: "s".into(),
            tool: "t".into(),
            state: EventState::Closed,
            open_ms: 0,
        };
        let n = MAX_EVENTS_PER_POST * 2 + 1;
        let b = bodies("gw", vec![e; n]);
        let counts: Vec<usize> = b.iter().map(|(_, n)| *n).collect();
        assert_eq!(counts, vec![MAX_EVENTS_PER_POST, MAX_EVENTS_PER_POST, 1]);
        assert!(bodies("gw", Vec::new()).is_empty());
    }

    #[test]
    fn the_outbox_bounds_each_tick_and_reports_the_first_loss_once() {
        let mut out = Outbox::new();
        for _ in 0..MAX_EVENTS_PER_TICK {
            assert!(out.take());
        }
        assert!(!out.take());
        assert!(out.lost(1), "the first loss is logged");
        assert!(!out.lost(3), "later ones are counted");
        assert_eq!(out.dropped(), 4);
        out.refill();
        assert!(out.take());
        assert!(!Outbox::new().lost(0));
    }
}
