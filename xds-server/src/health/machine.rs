//! The per-instance health state machine. Pure: every input carries its own `now`, so the
//! rules are tested without clocks, sockets or etcd.
//!
//! | state     | entered when                                              | Envoy            |
//! |-----------|-----------------------------------------------------------|------------------|
//! | UNKNOWN   | registered, not yet probed                                | not routed       |
//! | UP        | a probe passed                                            | HEALTHY          |
//! | SUSPECT   | `suspect_after` probes failed in a row, or one was refused | DRAINING         |
//! | UNHEALTHY | the calls the filters saw failed too often                | reduced weight   |
//! | DOWN      | probes kept failing for the down window (lease still held) | removed          |
//!
//! The lease is the fourth signal: its loss removes the instance from the registry, so it has
//! no state here.

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::config::HealthConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    Unknown,
    Up,
    Suspect,
    Unhealthy,
    Down,
}

impl State {
    pub const ALL: [State; 5] = [
        State::Unknown,
        State::Up,
        State::Suspect,
        State::Unhealthy,
        State::Down,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Unknown => "UNKNOWN",
            State::Up => "UP",
            State::Suspect => "SUSPECT",
            State::Unhealthy => "UNHEALTHY",
            State::Down => "DOWN",
        }
    }
}

/// One finished probe.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    pub ok: bool,
    pub latency_ms: f64,
    /// `200`, `503`, `timeout after 1s`, `connection refused`…
    pub detail: String,
    /// The probe failed and a connect to the instance was refused: nothing listens on its
    /// port, the process is gone. Unlike a timeout or an error status, one such probe is
    /// enough to stop routing to it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub refused: bool,
    /// The probe passed and the instance has restarted since the one before that passed:
    /// nothing listened in between (a refused connect, or the crash watch found nothing
    /// serving), or the server forgot the MCP session the prober keeps. Whatever sessions it
    /// held are gone.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub restarted: bool,
}

/// Call outcomes one filter saw on one instance since its last report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, Serialize)]
#[serde(default)]
pub struct CallCounts {
    pub ok: u64,
    pub connect_failure: u64,
    pub reset: u64,
    pub timeout: u64,
    pub http_5xx: u64,
}

impl CallCounts {
    pub fn failures(&self) -> u64 {
        self.connect_failure
            .saturating_add(self.reset)
            .saturating_add(self.timeout)
            .saturating_add(self.http_5xx)
    }

    fn add(&mut self, o: &CallCounts) {
        self.ok = self.ok.saturating_add(o.ok);
        self.connect_failure = self.connect_failure.saturating_add(o.connect_failure);
        self.reset = self.reset.saturating_add(o.reset);
        self.timeout = self.timeout.saturating_add(o.timeout);
        self.http_5xx = self.http_5xx.saturating_add(o.http_5xx);
    }
}

/// A state change and what caused it.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub from: State,
    pub to: State,
    pub cause: String,
    /// From the first failed signal to this transition (for SUSPECT, UNHEALTHY and DOWN).
    pub detection: Option<Duration>,
}

/// Call outcomes over a sliding window of one-second buckets.
#[derive(Debug, Clone, Default)]
struct CallWindow {
    buckets: VecDeque<(Instant, CallCounts)>,
}

impl CallWindow {
    fn add(&mut self, now: Instant, counts: &CallCounts, window: Duration) {
        self.expire(now, window);
        match self.buckets.back_mut() {
            Some((start, c)) if now.duration_since(*start) < Duration::from_secs(1) => {
                c.add(counts)
            }
            _ => self.buckets.push_back((now, *counts)),
        }
    }

    fn expire(&mut self, now: Instant, window: Duration) {
        while let Some((start, _)) = self.buckets.front() {
            if now.duration_since(*start) > window {
                self.buckets.pop_front();
            } else {
                break;
            }
        }
    }

    fn total(&self) -> CallCounts {
        let mut t = CallCounts::default();
        for (_, c) in &self.buckets {
            t.add(c);
        }
        t
    }
}

/// What toolgate-xds knows about one instance's health.
#[derive(Debug, Clone)]
pub struct Health {
    state: State,
    since_wall: SystemTime,
    cause: String,
    failures_in_row: u32,
    /// When the current run of failed probes began.
    first_failure: Option<Instant>,
    /// When the calls started failing (for UNHEALTHY's detection time).
    first_call_failure: Option<Instant>,
    /// The last probe that passed or call that succeeded.
    last_ok: Option<Instant>,
    probes: VecDeque<ProbeResult>,
    calls: CallWindow,
    /// When the instance's current process began, as far as this toolgate-xds can tell
    /// (milliseconds since the Unix epoch): when it saw the registration appear, or the
    /// instance restart; 0 for an instance it found registered when it started. Sessions
    /// opened before it were lost with the previous process
    /// (`toolgate_model::session_loss`).
    incarnation_ms: u64,
    /// Restarts seen.
    restarts: u32,
}

/// Milliseconds since the Unix epoch.
fn wall_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// How many probe results the registry view keeps per instance.
const PROBE_HISTORY: usize = 5;

impl Health {
    /// A fresh registration: UNKNOWN until probed, or UP at once when probes are off (the
    /// lease is then the only liveness signal).
    pub fn new(probes: bool) -> Health {
        let (state, cause) = if probes {
            (State::Unknown, "registered; waiting for the first probe")
        } else {
            (State::Up, "registered (active probes are off)")
        };
        Health {
            state,
            since_wall: SystemTime::now(),
            cause: cause.to_string(),
            failures_in_row: 0,
            first_failure: None,
            first_call_failure: None,
            last_ok: None,
            probes: VecDeque::new(),
            calls: CallWindow::default(),
            incarnation_ms: 0,
            restarts: 0,
        }
    }

    /// The registration appeared while this toolgate-xds watched: a process that may have
    /// replaced one at the same address (a registration found at start is as old as any
    /// session this toolgate-xds can know of).
    pub fn registered_now(&mut self) {
        self.incarnation_ms = wall_ms(SystemTime::now());
    }

    /// When the instance's current process began (see the field), and how many restarts were
    /// seen.
    pub fn incarnation(&self) -> (u64, u32) {
        (self.incarnation_ms, self.restarts)
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn since_wall(&self) -> SystemTime {
        self.since_wall
    }

    pub fn cause(&self) -> &str {
        &self.cause
    }

    pub fn probes(&self) -> impl Iterator<Item = &ProbeResult> {
        self.probes.iter()
    }

    pub fn last_ok(&self) -> Option<Instant> {
        self.last_ok
    }

    /// The lease is alive (it is registered) but probes have been failing long enough to
    /// leave UP: the instance would receive traffic it cannot serve.
    pub fn is_zombie(&self, cfg: &HealthConfig) -> bool {
        self.failures_in_row >= cfg.suspect_after
    }

    /// Calls and failure rate over the call window, for the registry view.
    pub fn recent_calls(&self, now: Instant, cfg: &HealthConfig) -> (CallCounts, f64) {
        let mut t = CallCounts::default();
        for (start, c) in &self.calls.buckets {
            if now.duration_since(*start) <= cfg.call_window {
                t.add(c);
            }
        }
        let total = t.ok + t.failures();
        let rate = if total == 0 {
            0.0
        } else {
            t.failures() as f64 / total as f64
        };
        (t, rate)
    }

    fn go(
        &mut self,
        to: State,
        cause: String,
        now: Instant,
        since_failure: Option<Instant>,
    ) -> Option<Transition> {
        if to == self.state {
            return None;
        }
        let t = Transition {
            from: self.state,
            to,
            cause: cause.clone(),
            detection: since_failure.map(|f| now.duration_since(f)),
        };
        self.state = to;
        self.since_wall = SystemTime::now();
        self.cause = cause;
        Some(t)
    }

    /// A probe finished.
    pub fn on_probe(
        &mut self,
        result: ProbeResult,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<Transition> {
        let ok = result.ok;
        let refused = result.refused;
        let detail = result.detail.clone();
        if result.restarted {
            self.incarnation_ms = wall_ms(result.at).max(self.incarnation_ms);
            self.restarts = self.restarts.saturating_add(1);
        }
        if self.probes.len() == PROBE_HISTORY {
            self.probes.pop_front();
        }
        self.probes.push_back(result);
        if ok {
            self.failures_in_row = 0;
            self.first_failure = None;
            self.last_ok = Some(now);
            let recovered = self.state == State::Unhealthy && self.calls_recovered(now, cfg);
            return match self.state {
                State::Unknown | State::Suspect | State::Down => {
                    // Back from probe failures, but the calls may still say it is failing.
                    let (to, cause) = if self.calls_failing(now, cfg).is_some() {
                        (
                            State::Unhealthy,
                            "probe passed, but recent calls still fail".to_string(),
                        )
                    } else {
                        (State::Up, format!("probe passed ({detail})"))
                    };
                    self.go(to, cause, now, None)
                }
                State::Unhealthy if recovered => {
                    self.first_call_failure = None;
                    self.go(
                        State::Up,
                        "probe passed and calls no longer fail".into(),
                        now,
                        None,
                    )
                }
                State::Up | State::Unhealthy => None,
            };
        }
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        let first = *self.first_failure.get_or_insert(now);
        let failing_for = now.duration_since(first);
        if self.state == State::Unknown {
            // Never routed: say why in the words the probe gave (a missing /health reads
            // "the server has no health endpoint there"), not "waiting for the first probe".
            self.cause = format!(
                "not routed: no probe has passed yet ({} failed, last: {detail})",
                self.failures_in_row
            );
        }
        match self.state {
            // Nothing listens: no second probe can change that, and every call routed until
            // then fails.
            State::Up | State::Unhealthy if refused => self.go(
                State::Suspect,
                format!("probe failed and the connection was refused (last: {detail})"),
                now,
                Some(first),
            ),
            State::Up | State::Unhealthy if self.failures_in_row >= cfg.suspect_after => self.go(
                State::Suspect,
                format!(
                    "{} probes failed in a row (last: {detail})",
                    self.failures_in_row
                ),
                now,
                Some(first),
            ),
            State::Unknown | State::Suspect if failing_for >= cfg.down_window => self.go(
                State::Down,
                format!(
                    "probes failing for {}s while the lease is alive (last: {detail})",
                    failing_for.as_secs()
                ),
                now,
                Some(first),
            ),
            _ => None,
        }
    }

    /// Call outcomes reported by a filter. Returns the transition, if any.
    pub fn on_calls(
        &mut self,
        counts: &CallCounts,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<Transition> {
        self.calls.add(now, counts, cfg.call_window);
        if counts.ok > 0 {
            self.last_ok = Some(now);
        }
        if counts.failures() > 0 && self.first_call_failure.is_none() {
            self.first_call_failure = Some(now);
        }
        let recovered = self.state == State::Unhealthy && self.calls_recovered(now, cfg);
        match self.state {
            State::Up => match self.calls_failing(now, cfg) {
                Some(cause) => {
                    let since = self.first_call_failure;
                    self.go(State::Unhealthy, cause, now, since)
                }
                None => {
                    if self.calls.total().failures() == 0 {
                        self.first_call_failure = None;
                    }
                    None
                }
            },
            State::Unhealthy if recovered => {
                self.first_call_failure = None;
                self.go(State::Up, "calls no longer fail".into(), now, None)
            }
            _ => None,
        }
    }

    /// Time passing without signals: an UNHEALTHY instance whose failures aged out of the
    /// window recovers even if it gets too few calls to prove it.
    pub fn on_tick(&mut self, now: Instant, cfg: &HealthConfig) -> Option<Transition> {
        self.calls.expire(now, cfg.call_window);
        if self.state == State::Unhealthy && self.calls.total().failures() == 0 {
            self.first_call_failure = None;
            return self.go(
                State::Up,
                format!("no call failures for {}s", cfg.call_window.as_secs()),
                now,
                None,
            );
        }
        None
    }

    /// Why the calls say the instance is failing, if they do. A verdict needs enough calls
    /// and enough failures: one timeout among two calls is noise, not a verdict.
    fn calls_failing(&mut self, now: Instant, cfg: &HealthConfig) -> Option<String> {
        self.calls.expire(now, cfg.call_window);
        let t = self.calls.total();
        let failures = t.failures();
        let total = t.ok + failures;
        if total < cfg.call_min_calls || failures < cfg.call_min_failures {
            return None;
        }
        let percent = failures * 100 / total;
        if percent < u64::from(cfg.call_failure_percent) {
            return None;
        }
        Some(format!(
            "{percent}% of {total} calls failed in {}s (connect {}, reset {}, timeout {}, 5xx {})",
            cfg.call_window.as_secs(),
            t.connect_failure,
            t.reset,
            t.timeout,
            t.http_5xx
        ))
    }

    /// Recovered: enough calls at under half the threshold, or no failures left in the window.
    fn calls_recovered(&mut self, now: Instant, cfg: &HealthConfig) -> bool {
        self.calls.expire(now, cfg.call_window);
        let t = self.calls.total();
        let failures = t.failures();
        let total = t.ok + failures;
        failures == 0
            || (total >= cfg.call_min_calls
                && failures * 200 < u64::from(cfg.call_failure_percent) * total)
    }
}

fn rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*t))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HealthConfig {
        HealthConfig::default()
    }

    fn probe(ok: bool) -> ProbeResult {
        ProbeResult {
            at: SystemTime::now(),
            ok,
            latency_ms: 1.0,
            detail: if ok { "200".into() } else { "503".into() },
            refused: false,
            restarted: false,
        }
    }

    #[test]
    fn a_restart_starts_a_new_incarnation() {
        let cfg = cfg();
        let t0 = Instant::now();
        let mut h = Health::new(true);
        assert_eq!(
            h.incarnation(),
            (0, 0),
            "found at start: as old as anything"
        );
        h.on_probe(probe(true), t0, &cfg);
        assert_eq!(h.incarnation(), (0, 0));
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(5_000);
        let back = ProbeResult {
            restarted: true,
            at,
            ..probe(true)
        };
        h.on_probe(back, secs(t0, 2), &cfg);
        assert_eq!(h.incarnation(), (5_000, 1));
        h.registered_now();
        assert!(h.incarnation().0 > 5_000);
    }

    #[test]
    fn one_refused_probe_makes_an_up_instance_suspect_where_a_failed_one_does_not() {
        let cfg = cfg();
        let t0 = Instant::now();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &cfg);
        assert_eq!(h.state(), State::Up);
        assert!(h.on_probe(probe(false), secs(t0, 2), &cfg).is_none());
        assert_eq!(h.state(), State::Up, "one failed probe is not enough");
        h.on_probe(probe(true), secs(t0, 4), &cfg);
        let refused = ProbeResult {
            refused: true,
            detail: "connect failed: Connection refused".into(),
            ..probe(false)
        };
        let t = h
            .on_probe(refused, secs(t0, 6), &cfg)
            .expect("a transition");
        assert_eq!((t.from, t.to), (State::Up, State::Suspect));
        assert!(t.cause.contains("refused"), "{}", t.cause);
    }

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn unknown_until_the_first_probe_passes() {
        let t0 = Instant::now();
        let mut h = Health::new(true);
        assert_eq!(h.state(), State::Unknown);
        let t = h.on_probe(probe(true), t0, &cfg()).unwrap();
        assert_eq!((t.from, t.to), (State::Unknown, State::Up));
        assert_eq!(Health::new(false).state(), State::Up, "probes off");
    }

    #[test]
    fn two_failures_in_a_row_make_suspect_and_a_pass_brings_it_back() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        assert!(
            h.on_probe(probe(false), secs(t0, 2), &c).is_none(),
            "one miss is not a verdict"
        );
        assert!(h.on_probe(probe(true), secs(t0, 4), &c).is_none());
        assert!(
            h.on_probe(probe(false), secs(t0, 6), &c).is_none(),
            "the run restarted"
        );
        let t = h.on_probe(probe(false), secs(t0, 8), &c).unwrap();
        assert_eq!(t.to, State::Suspect);
        assert_eq!(
            t.detection,
            Some(Duration::from_secs(2)),
            "from the first failed probe"
        );
        assert!(h.is_zombie(&c));
        let t = h.on_probe(probe(true), secs(t0, 10), &c).unwrap();
        assert_eq!(t.to, State::Up);
        assert!(!h.is_zombie(&c));
    }

    #[test]
    fn the_tolerance_option_allows_one_more_miss() {
        let t0 = Instant::now();
        let c = HealthConfig {
            suspect_after: 3,
            ..cfg()
        };
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        assert!(h.on_probe(probe(false), secs(t0, 2), &c).is_none());
        assert!(h.on_probe(probe(false), secs(t0, 4), &c).is_none());
        assert_eq!(
            h.on_probe(probe(false), secs(t0, 6), &c).unwrap().to,
            State::Suspect
        );
    }

    #[test]
    fn failing_past_the_down_window_is_down_and_a_pass_revives_it() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        let mut last = None;
        for s in (2..=40).step_by(2) {
            if let Some(t) = h.on_probe(probe(false), secs(t0, s), &c) {
                last = Some((s, t));
            }
        }
        let (at, t) = last.unwrap();
        assert_eq!(t.to, State::Down);
        assert_eq!(at, 32, "30 s after the first failure at 2 s");
        assert_eq!(t.detection, Some(Duration::from_secs(30)));
        assert_eq!(
            h.on_probe(probe(true), secs(t0, 42), &c).unwrap().to,
            State::Up
        );
    }

    #[test]
    fn a_registration_that_never_answers_goes_down_without_being_routed() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        for s in (0..30).step_by(2) {
            assert!(h.on_probe(probe(false), secs(t0, s), &c).is_none());
        }
        assert_eq!(
            h.on_probe(probe(false), secs(t0, 30), &c).unwrap().to,
            State::Down
        );
    }

    #[test]
    fn failing_calls_make_unhealthy_and_recovery_brings_it_back() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        let bad = CallCounts {
            http_5xx: 6,
            ok: 4,
            ..Default::default()
        };
        let t = h.on_calls(&bad, secs(t0, 1), &c).unwrap();
        assert_eq!(t.to, State::Unhealthy);
        assert!(t.cause.contains("60% of 10 calls"), "{}", t.cause);
        // Probes passing do not clear call failures that are still in the window.
        assert!(h.on_probe(probe(true), secs(t0, 2), &c).is_none());
        let good = CallCounts {
            ok: 40,
            ..Default::default()
        };
        let t = h.on_calls(&good, secs(t0, 3), &c).unwrap();
        assert_eq!(t.to, State::Up, "{}", t.cause);
    }

    #[test]
    fn a_single_timeout_is_not_a_verdict() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        let one = CallCounts {
            timeout: 1,
            ..Default::default()
        };
        assert!(h.on_calls(&one, secs(t0, 1), &c).is_none(), "one call");
        let few = CallCounts {
            timeout: 2,
            ok: 8,
            ..Default::default()
        };
        assert!(
            h.on_calls(&few, secs(t0, 2), &c).is_none(),
            "3 of 11 is under 50%"
        );
    }

    #[test]
    fn unhealthy_ages_out_when_failures_leave_the_window() {
        let t0 = Instant::now();
        let c = cfg();
        let mut h = Health::new(true);
        h.on_probe(probe(true), t0, &c);
        let bad = CallCounts {
            http_5xx: 10,
            ..Default::default()
        };
        h.on_calls(&bad, secs(t0, 1), &c).unwrap();
        assert!(h.on_tick(secs(t0, 5), &c).is_none());
        assert_eq!(h.on_tick(secs(t0, 12), &c).unwrap().to, State::Up);
    }
}
