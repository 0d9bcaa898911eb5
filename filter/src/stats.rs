//! Envoy stats per (service, tool): calls, failures, slow calls, rejections and the breaker's
//! state, as proxy-wasm metrics.
//!
//! Envoy prefixes a wasm metric's name with `wasmcustom.`; the bootstrap's `stats_tags`
//! (toolgate-xds, `bootstrap.rs`) take `service=<name>.` and `tool=<name>.` out of it as tags,
//! so `wasmcustom.toolgate.service=orders.tool=write_order.calls` is the stat `toolgate.calls`
//! tagged `service="orders"`, `tool="write_order"` (Prometheus: `toolgate_calls{...}`). Names
//! may contain dots but never `=`, which keeps the split unambiguous.
//!
//! Defining a metric is a host call that takes a new id each time, so ids are defined once per
//! (service, tool) in this worker's VM and cached: the per-request path is one map lookup
//! (keyed by the breaker key the request path has already built) and a count kept in the VM;
//! the root context's tick ([`Stats::flush`], every 100 ms) adds the counts to Envoy's
//! counters, one host call per counter that moved, instead of one per call. A
//! counter thus lags its calls by up to one tick. The state
//! gauge is written on transitions, and on admission only when this worker's last write
//! differs from what the admission shows, or is older than [`GAUGE_REFRESH_MS`] (another
//! worker may have written since).
//!
//! Envoy never frees a stat, and tool names come from requests: past [`MAX_TOOLS`] pairs per
//! worker, new pairs (and service names that break the naming rule) are counted under
//! [`OVERFLOW`] instead of getting stats of their own.

use std::collections::HashMap;

use crate::breaker::{Admission, Breaker, Force, Outcome, State};

/// First name segment of every metric (after Envoy's `wasmcustom.`).
pub const PREFIX: &str = "toolgate";
/// (service, tool) pairs with stats of their own, per worker.
pub const MAX_TOOLS: usize = 2048;
/// The service and tool tag of calls past [`MAX_TOOLS`]; outside the naming rule, so never a
/// real name.
pub const OVERFLOW: &str = "~other";
/// How long this worker trusts its last write of a state gauge.
pub const GAUGE_REFRESH_MS: u64 = 1000;

/// The counters, then the gauge, as the last name segment.
pub const CALLS: &str = "calls";
pub const FAILURES: &str = "failures";
pub const SLOW: &str = "slow";
pub const REJECTED: &str = "rejected";
pub const STATE: &str = "state";

/// Counters of the gateway (not of a tool): `tools/list` answers on a service's route with
/// tools annotated as unavailable, and answers passed on unannotated because they could not
/// be read (too large to hold, not JSON, not a listing).
pub const TOOLS_LIST_ANNOTATED: &str = "toolgate.tools_list.annotated";
pub const TOOLS_LIST_UNREAD: &str = "toolgate.tools_list.unread";
/// Answers to judged requests the filter could not read (compressed although it asked for
/// none): passed on unjudged, counted for nothing.
pub const RESPONSES_UNREAD: &str = "toolgate.responses.unread";
/// `tools/call`s of names the catalog does not list for their service: passed to the server
/// (which answers for itself) with no breaker, counted here.
pub const CALLS_UNLISTED: &str = "toolgate.calls.unlisted";

/// Requests of the aggregate endpoint the filter answered itself because no toolgate-xds
/// was reachable.
pub const OFFLINE_ANSWERS: &str = "toolgate.aggregate.answered_offline";
/// Calls of the aggregate endpoint sent to their service without a held session because no
/// toolgate-xds answered and none was held.
pub const UNSESSIONED_CALLS: &str = "toolgate.aggregate.calls_without_session";
/// Configurations this filter refused (it judges with the last one it accepted, or refuses
/// calls when it has none).
pub const CONFIG_REJECTED: &str = "toolgate.filter_config_rejected";
/// The gateway's counters defined when a configuration is taken.
const GATEWAY_COUNTERS: [&str; 7] = [
    TOOLS_LIST_ANNOTATED,
    TOOLS_LIST_UNREAD,
    RESPONSES_UNREAD,
    CALLS_UNLISTED,
    CONFIG_REJECTED,
    OFFLINE_ANSWERS,
    UNSESSIONED_CALLS,
];

/// Values of the `state` gauge: what the gateway does with a call now.
pub const STATE_CLOSED: u64 = 0;
pub const STATE_OPEN: u64 = 1;
pub const STATE_HALF_OPEN: u64 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

/// proxy-wasm's metric calls, as the host exposes them to one worker.
pub trait MetricHost {
    fn define(&self, kind: MetricKind, name: &str) -> Option<u32>;
    /// Adds `by` to counter `id`.
    fn increment(&self, id: u32, by: u64);
    fn record(&self, id: u32, value: u64);
}

/// The full metric name (before Envoy's `wasmcustom.`) of one (service, tool) and kind.
pub fn metric_name(service: &str, tool: &str, kind: &str) -> String {
    format!("{PREFIX}.service={service}.tool={tool}.{kind}")
}

/// The gauge value of a breaker state.
pub fn state_value(state: State) -> u64 {
    match state {
        State::Closed => STATE_CLOSED,
        State::Open => STATE_OPEN,
        State::HalfOpen => STATE_HALF_OPEN,
    }
}

/// The gauge value an admission shows: a forced-open breaker rejects, so it reads as open; a
/// forced-closed one admits, so it reads as closed.
pub fn admission_value(admission: &Admission) -> u64 {
    match admission {
        Admission::Allow => STATE_CLOSED,
        Admission::Probe { .. } => STATE_HALF_OPEN,
        Admission::Reject { forced: true, .. } => STATE_OPEN,
        Admission::Reject { state, .. } => state_value(*state),
    }
}

/// The gauge value of a breaker record at `now_ms`, with its operator override laid over it.
pub fn breaker_value(b: &Breaker, now_ms: u64) -> u64 {
    match b.force() {
        Force::Open { until_ms } if now_ms < until_ms => STATE_OPEN,
        Force::Closed => STATE_CLOSED,
        _ => state_value(b.state()),
    }
}

/// The metric ids of one (service, tool) in this VM; carried by an admitted call so that its
/// outcome needs no lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolMetrics {
    pub calls: u32,
    pub failures: u32,
    pub slow: u32,
    pub rejected: u32,
    /// `None` for the overflow pair, whose state would mean nothing.
    pub state: Option<u32>,
}

struct Entry {
    ids: ToolMetrics,
    /// The last value this worker wrote to the state gauge, and when.
    written: Option<(u64, u64)>,
}

impl Entry {
    fn define<H: MetricHost>(host: &H, service: &str, tool: &str, gauge: bool) -> Option<Entry> {
        let counter = |kind| host.define(MetricKind::Counter, &metric_name(service, tool, kind));
        let ids = ToolMetrics {
            calls: counter(CALLS)?,
            failures: counter(FAILURES)?,
            slow: counter(SLOW)?,
            rejected: counter(REJECTED)?,
            state: if gauge {
                Some(host.define(MetricKind::Gauge, &metric_name(service, tool, STATE))?)
            } else {
                None
            },
        };
        Some(Entry { ids, written: None })
    }

    fn admitted<H: MetricHost>(
        &mut self,
        host: &H,
        pending: &mut Pending,
        admission: &Admission,
        now_ms: u64,
    ) -> ToolMetrics {
        match admission {
            Admission::Reject { .. } => pending.add(self.ids.rejected),
            Admission::Allow | Admission::Probe { .. } => pending.add(self.ids.calls),
        }
        let value = admission_value(admission);
        let fresh = matches!(self.written, Some((v, at)) if v == value
            && now_ms.saturating_sub(at) < GAUGE_REFRESH_MS);
        if !fresh {
            self.write_state(host, value, now_ms);
        }
        self.ids
    }

    fn write_state<H: MetricHost>(&mut self, host: &H, value: u64, now_ms: u64) {
        if let Some(id) = self.ids.state {
            host.record(id, value);
            self.written = Some((value, now_ms));
        }
    }
}

/// Counts not yet added to Envoy's counters, by metric id.
#[derive(Default)]
struct Pending(HashMap<u32, u64>);

impl Pending {
    fn add(&mut self, id: u32) {
        *self.0.entry(id).or_default() += 1;
    }
}

/// One worker's metric ids, by breaker key.
pub struct Stats<H> {
    host: H,
    pending: Pending,
    tools: HashMap<String, Entry>,
    overflow: Option<Entry>,
    /// Ids of the gateway's own counters, by name.
    counters: HashMap<&'static str, u32>,
    /// Ids of counters named at run time (denials by service and reason).
    named: HashMap<String, u32>,
}

impl<H: MetricHost> Stats<H> {
    pub fn new(host: H) -> Self {
        Stats {
            host,
            pending: Pending::default(),
            tools: HashMap::new(),
            overflow: None,
            counters: HashMap::new(),
            named: HashMap::new(),
        }
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    /// Counts a `tools/call` the breaker of `key` (of `service` and `tool`) has judged: a call
    /// that goes upstream, or one the gateway answers. Returns the ids its outcome goes to.
    pub fn admitted(
        &mut self,
        key: &str,
        service: &str,
        tool: &str,
        admission: &Admission,
        now_ms: u64,
    ) -> Option<ToolMetrics> {
        let Stats {
            host,
            pending,
            tools,
            overflow,
            ..
        } = self;
        if let Some(entry) = tools.get_mut(key) {
            return Some(entry.admitted(host, pending, admission, now_ms));
        }
        let named = tools.len() < MAX_TOOLS
            && toolgate_model::validate_name("service", service).is_ok()
            && toolgate_model::validate_name("tool", tool).is_ok();
        let entry = if named {
            let entry = Entry::define(host, service, tool, true)?;
            tools.entry(key.to_owned()).or_insert(entry)
        } else {
            if overflow.is_none() {
                *overflow = Some(Entry::define(host, OVERFLOW, OVERFLOW, false)?);
            }
            overflow.as_mut()?
        };
        Some(entry.admitted(host, pending, admission, now_ms))
    }

    /// Adds the counts kept since the last flush to Envoy's counters.
    pub fn flush(&mut self) {
        for (id, n) in self.pending.0.drain() {
            if n > 0 {
                self.host.increment(id, n);
            }
        }
    }

    /// Counts how an admitted call ended; `count_is_error` is the policy's, so `failures`
    /// counts what the breaker counts.
    pub fn outcome(&mut self, ids: &ToolMetrics, outcome: Outcome, count_is_error: bool) {
        match outcome {
            Outcome::Failure => self.pending.add(ids.failures),
            Outcome::IsErrorResult if count_is_error => self.pending.add(ids.failures),
            Outcome::Slow => self.pending.add(ids.slow),
            Outcome::Success | Outcome::IsErrorResult | Outcome::Ignored => {}
        }
    }

    /// The breaker of `key` moved to `to`: writes the gauge whatever this worker wrote last.
    pub fn transition(&mut self, key: &str, to: State, now_ms: u64) {
        if let Some(entry) = self.tools.get_mut(key) {
            entry.write_state(&self.host, state_value(to), now_ms);
        }
    }

    /// Writes every known gauge from `value_of(key)`, e.g. after transitions whose key is not
    /// known; keys it answers `None` for are left alone.
    pub fn refresh(&mut self, now_ms: u64, mut value_of: impl FnMut(&str) -> Option<u64>) {
        for (key, entry) in self.tools.iter_mut() {
            if let Some(value) = value_of(key) {
                entry.write_state(&self.host, value, now_ms);
            }
        }
    }

    /// Counts one of the gateway's own counters (`name`, a constant of this module).
    pub fn count(&mut self, name: &'static str) {
        if let Some(id) = self.counter(name) {
            self.host.increment(id, 1);
        }
    }

    /// Defines the gateway's own counters that alerts watch, so each is a series at 0 from
    /// the start (an alert on its increase then fires on the first event, and no request
    /// makes a new series appear).
    pub fn define_gateway_counters(&mut self) {
        for name in GATEWAY_COUNTERS {
            let _ = self.counter(name);
        }
    }

    fn counter(&mut self, name: &'static str) -> Option<u32> {
        if let Some(&id) = self.counters.get(name) {
            return Some(id);
        }
        let id = self.host.define(MetricKind::Counter, name)?;
        self.counters.insert(name, id);
        Some(id)
    }

    /// Counts a counter named at run time. Bounded like the per-tool stats: past
    /// [`MAX_TOOLS`] names, nothing more is defined (callers label unknown names
    /// [`OVERFLOW`], so the names are few).
    pub fn count_named(&mut self, name: String) {
        let id = match self.named.get(&name) {
            Some(&id) => id,
            None => {
                if self.named.len() >= MAX_TOOLS {
                    return;
                }
                let Some(id) = self.host.define(MetricKind::Counter, &name) else {
                    return;
                };
                self.named.insert(name, id);
                id
            }
        };
        self.host.increment(id, 1);
    }

    /// (service, tool) pairs with stats of their own.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::breaker::breaker_key;

    #[derive(Default)]
    struct FakeHost {
        defined: RefCell<Vec<(MetricKind, String)>>,
        values: RefCell<HashMap<u32, u64>>,
        calls: RefCell<u64>,
    }

    impl FakeHost {
        fn value(&self, service: &str, tool: &str, kind: &str) -> Option<u64> {
            let name = metric_name(service, tool, kind);
            let ids: Vec<u32> = self
                .defined
                .borrow()
                .iter()
                .enumerate()
                .filter(|(_, (_, n))| *n == name)
                .map(|(i, _)| i as u32)
                .collect();
            assert!(ids.len() <= 1, "{name} defined {} times", ids.len());
            Some(*self.values.borrow().get(ids.first()?).unwrap_or(&0))
        }
        fn host_calls(&self) -> u64 {
            *self.calls.borrow()
        }
    }

    impl MetricHost for FakeHost {
        fn define(&self, kind: MetricKind, name: &str) -> Option<u32> {
            *self.calls.borrow_mut() += 1;
            let mut d = self.defined.borrow_mut();
            d.push((kind, name.to_string()));
            Some(d.len() as u32 - 1)
        }
        fn increment(&self, id: u32, by: u64) {
            *self.calls.borrow_mut() += 1;
            *self.values.borrow_mut().entry(id).or_default() += by;
        }
        fn record(&self, id: u32, value: u64) {
            *self.calls.borrow_mut() += 1;
            self.values.borrow_mut().insert(id, value);
        }
    }

    const REJECT_OPEN: Admission = Admission::Reject {
        retry_after_ms: 1000,
        state: State::Open,
        forced: false,
    };

    fn admit(s: &mut Stats<FakeHost>, service: &str, tool: &str, a: Admission, now: u64) {
        let key = breaker_key(service, tool);
        s.admitted(&key, service, tool, &a, now).expect("ids");
    }

    #[test]
    fn names_carry_service_and_tool_for_the_tag_regexes() {
        assert_eq!(
            metric_name("orders", "write.order", CALLS),
            "toolgate.service=orders.tool=write.order.calls"
        );
    }

    #[test]
    fn defines_once_then_counts_in_the_vm_until_the_flush() {
        let mut s = Stats::new(FakeHost::default());
        admit(&mut s, "orders", "write_order", Admission::Allow, 0);
        // 4 counters + 1 gauge defined, 1 gauge write.
        assert_eq!(s.host().host_calls(), 6);
        for i in 1..=100 {
            admit(&mut s, "orders", "write_order", Admission::Allow, i);
        }
        assert_eq!(s.host().host_calls(), 6, "no host call per call");
        assert_eq!(s.host().value("orders", "write_order", CALLS), Some(0));
        s.flush();
        assert_eq!(
            s.host().host_calls(),
            7,
            "one increment per counter that moved"
        );
        s.flush();
        assert_eq!(s.host().host_calls(), 7, "nothing to add");
        let h = s.host();
        assert_eq!(h.value("orders", "write_order", CALLS), Some(101));
        assert_eq!(h.value("orders", "write_order", STATE), Some(STATE_CLOSED));
        assert_eq!(h.value("orders", "write_order", REJECTED), Some(0));
        assert_eq!(h.defined.borrow().len(), 5);
    }

    #[test]
    fn outcomes_count_failures_slow_and_counted_is_error() {
        let mut s = Stats::new(FakeHost::default());
        let ids = s
            .admitted("k", "orders", "t", &Admission::Allow, 0)
            .expect("ids");
        s.outcome(&ids, Outcome::Failure, false);
        s.outcome(&ids, Outcome::Slow, false);
        s.outcome(&ids, Outcome::Success, false);
        s.outcome(&ids, Outcome::IsErrorResult, false);
        s.outcome(&ids, Outcome::IsErrorResult, true);
        s.flush();
        let h = s.host();
        assert_eq!(h.value("orders", "t", FAILURES), Some(2));
        assert_eq!(h.value("orders", "t", SLOW), Some(1));
        assert_eq!(h.value("orders", "t", CALLS), Some(1));
    }

    #[test]
    fn the_state_gauge_follows_admissions_and_transitions() {
        let mut s = Stats::new(FakeHost::default());
        admit(&mut s, "orders", "t", Admission::Allow, 0);
        let key = breaker_key("orders", "t");
        s.transition(&key, State::Open, 10);
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_OPEN));
        let before = s.host().host_calls();
        admit(&mut s, "orders", "t", REJECT_OPEN, 20);
        assert_eq!(s.host().host_calls(), before, "no gauge write: unchanged");
        s.flush();
        assert_eq!(s.host().value("orders", "t", REJECTED), Some(1));
        let probe = Admission::Probe {
            slot: 0,
            ticket: 1,
            generation: 1,
        };
        admit(&mut s, "orders", "t", probe, 30);
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_HALF_OPEN));
        let forced = Admission::Reject {
            retry_after_ms: 1,
            state: State::Closed,
            forced: true,
        };
        admit(&mut s, "orders", "t", forced, 40);
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_OPEN));
        // Another worker may have written the gauge: rewritten once the last write is stale.
        s.host().values.borrow_mut().insert(4, STATE_CLOSED);
        admit(&mut s, "orders", "t", REJECT_OPEN, 41);
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_CLOSED));
        admit(&mut s, "orders", "t", REJECT_OPEN, 40 + GAUGE_REFRESH_MS);
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_OPEN));
        s.refresh(2000, |k| (k == key).then_some(STATE_CLOSED));
        assert_eq!(s.host().value("orders", "t", STATE), Some(STATE_CLOSED));
    }

    #[test]
    fn too_many_tools_and_bad_service_names_share_the_overflow_stats() {
        let mut s = Stats::new(FakeHost::default());
        for i in 0..MAX_TOOLS {
            admit(&mut s, "svc", &format!("t{i}"), Admission::Allow, 0);
        }
        admit(&mut s, "svc", "one_too_many", Admission::Allow, 0);
        admit(&mut s, "svc", "another", REJECT_OPEN, 0);
        assert_eq!(s.len(), MAX_TOOLS);
        s.flush();
        let h = s.host();
        assert_eq!(h.value("svc", "one_too_many", CALLS), None);
        assert_eq!(h.value(OVERFLOW, OVERFLOW, CALLS), Some(1));
        assert_eq!(h.value(OVERFLOW, OVERFLOW, REJECTED), Some(1));
        assert_eq!(h.value(OVERFLOW, OVERFLOW, STATE), None);

        let mut s = Stats::new(FakeHost::default());
        admit(&mut s, "a%20b", "t", Admission::Allow, 0);
        s.flush();
        assert!(s.is_empty());
        assert_eq!(s.host().value(OVERFLOW, OVERFLOW, CALLS), Some(1));
        assert!(toolgate_model::validate_name("tool", OVERFLOW).is_err());
    }
}
