//! One breaker's state machine: CLOSED, OPEN, HALF_OPEN.
//!
//! Pure logic over a record that the store keeps in shared data: time comes in as `now_ms`
//! and randomness as `unit` (0.0..=1.0), so tests drive both. Every method is total: a
//! record decoded from garbage, a clock that goes backwards or an unvalidated policy give a
//! sensible answer, never a panic, because a panic in a proxy-wasm filter takes the worker's
//! VM down with it.

use std::fmt;

use toolgate_model::BreakerPolicy;

use super::window::{Counts, Reader, Window};

/// Capacity of the probe slots; the policy's probe count is validated against the same bound.
pub const MAX_PROBES: usize = toolgate_model::MAX_HALF_OPEN_PROBES as usize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An operator override (`/mcp/overrides/...`), laid over the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Force {
    None,
    /// Reject every call until `until_ms`, whatever the window says.
    Open {
        until_ms: u64,
    },
    /// Admit every call and never trip; the window still counts, so clearing the override
    /// resumes with current rates.
    Closed,
}

/// How a call ended, as the host saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// Connect failure, reset, timeout, 5xx, no healthy upstream, JSON-RPC error.
    Failure,
    /// Succeeded, but took at least the policy's `slow_call_ms`.
    Slow,
    /// A tool result with `isError: true`: a failure only if the policy counts it.
    IsErrorResult,
    /// The call ended for a reason that is not the tool's: the request was at fault (a
    /// JSON-RPC error that blames the request), the client went away, the service's bulkhead
    /// was full, the answer was too large to judge. Counted neither as a failure nor as a
    /// success (either would let a client steer the breaker); a half-open probe gives its slot
    /// back.
    Ignored,
}

/// The answer to "may this call go upstream?"
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Allow,
    /// A half-open probe holding `slot`. `ticket` and `generation` tell its result apart from
    /// that of a probe whose slot expired and was handed on, or of an earlier half-open spell.
    Probe {
        slot: u8,
        ticket: u64,
        generation: u32,
    },
    Reject {
        retry_after_ms: u64,
        state: State,
        /// The rejection comes from an operator's force-open override.
        forced: bool,
    },
}

/// Why a breaker changed state; `Display` gives the text for logs and breaker events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    FailureRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
    },
    SlowCallRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
        slow_call_ms: u64,
    },
    OpenElapsed {
        open_ms: u64,
    },
    ProbeFailed,
    ProbeSlow,
    ProbesSucceeded {
        probes: u32,
    },
    /// Another gateway of the fleet opened the tool (delivered by toolgate-xds).
    Fleet,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::FailureRate {
                percent,
                calls,
                window_secs,
            } => write!(
                f,
                "failure rate {percent}% over {calls} calls in {window_secs}s"
            ),
            Cause::SlowCallRate {
                percent,
                calls,
                window_secs,
                slow_call_ms,
            } => write!(
                f,
                "slow-call rate {percent}% (calls of {slow_call_ms}ms or more) over {calls} calls in {window_secs}s"
            ),
            Cause::OpenElapsed { open_ms } => {
                write!(f, "open for {open_ms}ms; letting probes through")
            }
            Cause::ProbeFailed => f.write_str("half-open probe failed"),
            Cause::ProbeSlow => f.write_str("half-open probe was slow"),
            Cause::ProbesSucceeded { probes } => write!(f, "all {probes} probes succeeded"),
            Cause::Fleet => f.write_str("opened by another gateway of the fleet"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub from: State,
    pub to: State,
    pub cause: Cause,
    pub at_ms: u64,
    /// Set when `to` is OPEN: when probing may start.
    pub open_until_ms: Option<u64>,
    /// Trips in a row, counting this one; 0 once the breaker closed.
    pub trips: u8,
    /// The record's generation after this transition; probes of a half-open spell carry
    /// the generation that spell began with.
    pub generation: u32,
}

/// The numbers of a policy the state machine needs, clamped to values it can work with.
/// `Copy` and allocation-free, so the per-request path can build one from a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub bucket_ms: u64,
    pub buckets: usize,
    pub failure_rate_percent: u32,
    pub slow_call_ms: u64,
    pub slow_call_rate_percent: u32,
    pub min_calls: u32,
    pub open_ms: u64,
    pub max_open_ms: u64,
    pub open_jitter_percent: u32,
    pub probes: usize,
    pub probe_timeout_ms: u64,
    pub count_is_error: bool,
}

impl From<&BreakerPolicy> for Limits {
    fn from(p: &BreakerPolicy) -> Self {
        let open_ms = p.open_ms.max(1);
        Limits {
            bucket_ms: u64::from(p.bucket_secs.max(1)).saturating_mul(1000),
            buckets: (p.buckets() as usize).clamp(1, super::window::MAX_BUCKETS),
            failure_rate_percent: p.failure_rate_percent.clamp(1, 100),
            slow_call_ms: p.slow_call_ms,
            slow_call_rate_percent: p.slow_call_rate_percent.clamp(1, 100),
            min_calls: p.min_calls.max(1),
            open_ms,
            max_open_ms: p.max_open_ms.max(open_ms),
            open_jitter_percent: p.open_jitter_percent.min(100),
            probes: (p.half_open_probes as usize).clamp(1, MAX_PROBES),
            probe_timeout_ms: p.probe_timeout_ms().max(1),
            count_is_error: p.count_is_error,
        }
    }
}

impl Limits {
    fn window_secs(&self) -> u64 {
        self.bucket_ms.saturating_mul(self.buckets as u64) / 1000
    }

    /// The open duration after `trips` trips in a row: `open_ms` doubling per trip up to
    /// `max_open_ms`, minus up to `open_jitter_percent` of it at `unit`. Jitter only ever
    /// shortens, so the cap holds and jittered fleets do not all land on the cap together.
    pub fn open_duration_ms(&self, trips: u8, unit: f64) -> u64 {
        let doublings = u32::from(trips.max(1) - 1);
        let full = self
            .open_ms
            .saturating_mul(2u64.saturating_pow(doublings))
            .min(self.max_open_ms);
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let off = (full as f64 * f64::from(self.open_jitter_percent) / 100.0 * unit) as u64;
        full.saturating_sub(off).max(1)
    }
}

/// A probe slot as stored: free, held until a deadline (which doubles as the holder's
/// ticket), or done with a success.
const SLOT_FREE: u64 = 0;
const SLOT_SUCCEEDED: u64 = u64::MAX;

/// The data format of the shared-data record; bumped on any change of layout, and a record
/// of an unknown format reads as a fresh breaker instead of as garbage. Format 1 (no opening
/// cause) is still read, so a filter upgrade keeps the breakers it finds.
pub const FORMAT: u8 = 2;
const FORMAT_1: u8 = 1;
const HEADER_BYTES_1: usize = 36;
/// Format 2 adds the opening cause after format 1's header.
const CAUSE_BYTES: usize = 16;
const HEADER_BYTES: usize = HEADER_BYTES_1 + CAUSE_BYTES;

/// What `decide` found: an answer, or the need to take a probe slot (a write).
enum Decision {
    Done(Admission),
    TakeProbe,
}

/// The record of one breaker, as kept in shared data for all workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breaker {
    state: State,
    force: Force,
    trips: u8,
    /// Bumped on every transition, so that late results of probes from an earlier half-open
    /// spell are recognised and ignored.
    generation: u32,
    since_ms: u64,
    open_until_ms: u64,
    /// Why the breaker last opened, so that every worker's reply can say which threshold
    /// tripped; `None` before the first opening (or in a format-1 record).
    opened_by: Option<Cause>,
    probes_len: usize,
    probes: [u64; MAX_PROBES],
    window: Window,
}

impl Breaker {
    pub fn new(limits: &Limits, now_ms: u64) -> Self {
        Breaker {
            state: State::Closed,
            force: Force::None,
            trips: 0,
            generation: 0,
            since_ms: now_ms,
            open_until_ms: 0,
            opened_by: None,
            probes_len: limits.probes,
            probes: [SLOT_FREE; MAX_PROBES],
            window: Window::new(limits.bucket_ms, limits.buckets),
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn force(&self) -> Force {
        self.force
    }

    pub fn trips(&self) -> u8 {
        self.trips
    }

    pub fn generation(&self) -> u32 {
        self.generation
    }

    pub fn since_ms(&self) -> u64 {
        self.since_ms
    }

    /// When an OPEN breaker lets probes through.
    pub fn open_until_ms(&self) -> u64 {
        self.open_until_ms
    }

    /// Why the breaker last opened.
    pub fn opened_by(&self) -> Option<&Cause> {
        self.opened_by.as_ref()
    }

    pub fn totals(&self, now_ms: u64) -> Counts {
        self.window.totals(now_ms)
    }

    /// Adapts a record written under another policy: a new window shape re-cuts the counts
    /// into buckets of the new width by the time each bucket started (so a policy change
    /// never resets a breaker, and workers briefly on old and new policies during a rollout
    /// do not erase each other's counts); a new probe count resizes the slots.
    pub fn conform(&mut self, limits: &Limits) {
        if !self.window.has_shape(limits.bucket_ms, limits.buckets) {
            let mut window = Window::new(limits.bucket_ms, limits.buckets);
            window.merge(&self.window);
            self.window = window;
        }
        if self.probes_len != limits.probes {
            for slot in &mut self.probes[limits.probes.min(self.probes_len)..] {
                *slot = SLOT_FREE;
            }
            self.probes_len = limits.probes;
        }
    }

    pub fn set_force(&mut self, force: Force) {
        self.force = force;
    }

    /// Opens the breaker until `until_ms` because another gateway of the fleet opened the tool:
    /// from then on it is this breaker's own, probed and closed or reopened by the local
    /// policy as if it had tripped here. An opening that lasts longer already stands; an
    /// operator's force-closed wins over the fleet. Returns the transition, if the state moved.
    pub fn open_until(&mut self, now_ms: u64, until_ms: u64) -> Option<Transition> {
        if self.force == Force::Closed || until_ms <= now_ms {
            return None;
        }
        match self.state {
            State::Open => {
                self.open_until_ms = self.open_until_ms.max(until_ms);
                None
            }
            State::Closed | State::HalfOpen => {
                // Counted as a trip, so that a failed probe afterwards backs off as it would
                // after a local opening.
                self.trips = self.trips.saturating_add(1);
                self.open_until_ms = until_ms;
                Some(self.move_to(State::Open, Cause::Fleet, now_ms))
            }
        }
    }

    fn decide(&self, now_ms: u64) -> Decision {
        match self.force {
            Force::Closed => return Decision::Done(Admission::Allow),
            Force::Open { until_ms } if now_ms < until_ms => {
                return Decision::Done(Admission::Reject {
                    retry_after_ms: until_ms - now_ms,
                    state: self.state,
                    forced: true,
                })
            }
            _ => {}
        }
        match self.state {
            State::Closed => Decision::Done(Admission::Allow),
            State::Open if now_ms < self.open_until_ms => Decision::Done(Admission::Reject {
                retry_after_ms: self.open_until_ms - now_ms,
                state: State::Open,
                forced: false,
            }),
            State::Open => Decision::TakeProbe,
            State::HalfOpen => {
                if self.free_slot(now_ms).is_some() {
                    return Decision::TakeProbe;
                }
                // All slots are held: news comes at the latest when the first of them expires.
                let next = self.probes[..self.probes_len]
                    .iter()
                    .filter(|&&s| s != SLOT_FREE && s != SLOT_SUCCEEDED)
                    .min()
                    .map_or(1, |&deadline| deadline.saturating_sub(now_ms).max(1));
                Decision::Done(Admission::Reject {
                    retry_after_ms: next,
                    state: State::HalfOpen,
                    forced: false,
                })
            }
        }
    }

    /// A slot that is free, or whose probe outlived its timeout and so no longer holds it.
    fn free_slot(&self, now_ms: u64) -> Option<usize> {
        self.probes[..self.probes_len]
            .iter()
            .position(|&s| s == SLOT_FREE || (s != SLOT_SUCCEEDED && s <= now_ms))
    }

    /// The admission this record gives without being changed, or `None` if admitting needs a
    /// write (a probe slot to take). This is the per-request path: it never writes.
    pub fn admit_read_only(&self, now_ms: u64) -> Option<Admission> {
        match self.decide(now_ms) {
            Decision::Done(admission) => Some(admission),
            Decision::TakeProbe => None,
        }
    }

    /// Admits a call, taking a probe slot (and moving OPEN to HALF_OPEN) when that is due.
    pub fn admit(&mut self, limits: &Limits, now_ms: u64) -> (Admission, Option<Transition>) {
        if let Decision::Done(admission) = self.decide(now_ms) {
            return (admission, None);
        }
        let mut transition = None;
        if self.state == State::Open {
            let open_ms = now_ms.saturating_sub(self.since_ms);
            transition =
                Some(self.move_to(State::HalfOpen, Cause::OpenElapsed { open_ms }, now_ms));
        }
        let Some(slot) = self.free_slot(now_ms) else {
            // decide() saw a free slot; this is only reachable if the two ever disagree.
            return (
                Admission::Reject {
                    retry_after_ms: limits.probe_timeout_ms,
                    state: self.state,
                    forced: false,
                },
                transition,
            );
        };
        // Deadlines are unique per slot within a generation: a slot is handed on only after
        // its deadline has passed, and the next holder's deadline lies beyond it.
        let ticket = now_ms
            .saturating_add(limits.probe_timeout_ms)
            .clamp(1, SLOT_SUCCEEDED - 1);
        self.probes[slot] = ticket;
        let admission = Admission::Probe {
            slot: slot as u8,
            ticket,
            generation: self.generation,
        };
        (admission, transition)
    }

    /// Records how an admitted call ended.
    pub fn record(
        &mut self,
        limits: &Limits,
        now_ms: u64,
        unit: f64,
        admission: Admission,
        outcome: Outcome,
    ) -> Option<Transition> {
        let outcome = counted(outcome, limits);
        match admission {
            Admission::Reject { .. } => None,
            Admission::Allow if outcome == Outcome::Ignored => None,
            Admission::Allow => {
                self.window.add(now_ms, counts_of(outcome));
                self.evaluate(limits, now_ms, unit)
            }
            Admission::Probe {
                slot,
                ticket,
                generation,
            } => {
                if generation != self.generation || self.state != State::HalfOpen {
                    // The breaker has moved on since this probe was let through.
                    return None;
                }
                match outcome {
                    Outcome::Success => {
                        let slot = usize::from(slot);
                        // A probe whose slot was handed on no longer speaks for that slot.
                        if slot >= self.probes_len || self.probes[slot] != ticket {
                            return None;
                        }
                        self.probes[slot] = SLOT_SUCCEEDED;
                        if self.probes[..self.probes_len]
                            .iter()
                            .all(|&s| s == SLOT_SUCCEEDED)
                        {
                            let probes = self.probes_len as u32;
                            return Some(self.close(now_ms, Cause::ProbesSucceeded { probes }));
                        }
                        None
                    }
                    Outcome::Ignored => {
                        // No evidence either way: the slot goes to the next probe.
                        let slot = usize::from(slot);
                        if slot < self.probes_len && self.probes[slot] == ticket {
                            self.probes[slot] = SLOT_FREE;
                        }
                        None
                    }
                    // Any bad answer reopens, even from a probe whose slot expired: it is
                    // still fresh evidence that the tool is not well.
                    Outcome::Slow => Some(self.trip(limits, now_ms, unit, Cause::ProbeSlow)),
                    Outcome::Failure | Outcome::IsErrorResult => {
                        Some(self.trip(limits, now_ms, unit, Cause::ProbeFailed))
                    }
                }
            }
        }
    }

    /// Adds a worker's unflushed counts and judges the window again: successes alone can
    /// bring the window to `min_calls` with a failure rate already over the threshold.
    pub fn merge(
        &mut self,
        limits: &Limits,
        now_ms: u64,
        unit: f64,
        deltas: &Window,
    ) -> Option<Transition> {
        if deltas.is_empty() {
            return None;
        }
        self.window.merge(deltas);
        self.evaluate(limits, now_ms, unit)
    }

    fn evaluate(&mut self, limits: &Limits, now_ms: u64, unit: f64) -> Option<Transition> {
        if self.state != State::Closed || self.force == Force::Closed {
            return None;
        }
        let t = self.window.totals(now_ms);
        if t.calls < limits.min_calls || t.calls == 0 {
            return None;
        }
        let calls = u64::from(t.calls);
        let percent = |n: u32| (u64::from(n) * 100 / calls) as u32;
        let window_secs = limits.window_secs();
        // Multiplied out rather than divided, so 5 of 10 meets a 50% threshold exactly.
        let cause = if u64::from(t.failures) * 100 >= u64::from(limits.failure_rate_percent) * calls
        {
            Cause::FailureRate {
                percent: percent(t.failures),
                calls: t.calls,
                window_secs,
            }
        } else if u64::from(t.slow) * 100 >= u64::from(limits.slow_call_rate_percent) * calls {
            Cause::SlowCallRate {
                percent: percent(t.slow),
                calls: t.calls,
                window_secs,
                slow_call_ms: limits.slow_call_ms,
            }
        } else {
            return None;
        };
        Some(self.trip(limits, now_ms, unit, cause))
    }

    fn trip(&mut self, limits: &Limits, now_ms: u64, unit: f64, cause: Cause) -> Transition {
        self.trips = self.trips.saturating_add(1);
        self.open_until_ms = now_ms.saturating_add(limits.open_duration_ms(self.trips, unit));
        self.move_to(State::Open, cause, now_ms)
    }

    fn close(&mut self, now_ms: u64, cause: Cause) -> Transition {
        self.trips = 0;
        // The old window holds the failures that opened the breaker; keeping it would trip
        // the breaker again on the first failure after closing.
        self.window.clear();
        self.move_to(State::Closed, cause, now_ms)
    }

    fn move_to(&mut self, to: State, cause: Cause, now_ms: u64) -> Transition {
        let from = self.state;
        if to == State::Open {
            self.opened_by = Some(cause.clone());
        }
        self.state = to;
        self.generation = self.generation.wrapping_add(1);
        self.since_ms = now_ms;
        self.probes = [SLOT_FREE; MAX_PROBES];
        Transition {
            from,
            to,
            cause,
            at_ms: now_ms,
            open_until_ms: (to == State::Open).then_some(self.open_until_ms),
            trips: self.trips,
            generation: self.generation,
        }
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + 8 * self.probes_len + self.window.encoded_len()
    }

    /// The shared-data record, little-endian, fixed size for a given policy:
    ///
    /// | offset | bytes | field |
    /// | --- | --- | --- |
    /// | 0 | 1 | format (1) |
    /// | 1 | 1 | state: 0 closed, 1 open, 2 half-open |
    /// | 2 | 1 | force: 0 none, 1 open, 2 closed |
    /// | 3 | 1 | trips in a row |
    /// | 4 | 4 | generation |
    /// | 8 | 8 | since (ms) |
    /// | 16 | 8 | open until (ms) |
    /// | 24 | 8 | forced open until (ms) |
    /// | 32 | 1 | probe slots P |
    /// | 33 | 3 | reserved |
    /// | 36 | 1 | opened by: 0 unknown, 1 failure rate, 2 slow-call rate, 3 probe failed, 4 probe slow, 5 fleet |
    /// | 37 | 1 | the tripping rate (%) |
    /// | 38 | 2 | reserved |
    /// | 40 | 4 | calls in the window when it tripped |
    /// | 44 | 4 | the window (s) |
    /// | 48 | 4 | the slow-call threshold (ms) |
    /// | 52 | 8·P | probe slots: 0 free, u64::MAX succeeded, else held until (ms) |
    /// | … | 8 + 20·B | the window (see `Window::encode`) |
    ///
    /// Format 1 is the same without bytes 36..52.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.encoded_len());
        out.push(FORMAT);
        out.push(match self.state {
            State::Closed => 0,
            State::Open => 1,
            State::HalfOpen => 2,
        });
        let (force, force_until) = match self.force {
            Force::None => (0, 0),
            Force::Open { until_ms } => (1, until_ms),
            Force::Closed => (2, 0),
        };
        out.push(force);
        out.push(self.trips);
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.since_ms.to_le_bytes());
        out.extend_from_slice(&self.open_until_ms.to_le_bytes());
        out.extend_from_slice(&force_until.to_le_bytes());
        out.push(self.probes_len as u8);
        out.extend_from_slice(&[0; 3]);
        encode_cause(self.opened_by.as_ref(), out);
        for slot in &self.probes[..self.probes_len] {
            out.extend_from_slice(&slot.to_le_bytes());
        }
        self.window.encode(out);
    }

    /// Reads a record; `None` for anything that is not a whole record of this format.
    pub fn decode(bytes: &[u8]) -> Option<Breaker> {
        let mut r = Reader(bytes);
        let format = r.u8()?;
        if format != FORMAT && format != FORMAT_1 {
            return None;
        }
        let state = match r.u8()? {
            0 => State::Closed,
            1 => State::Open,
            2 => State::HalfOpen,
            _ => return None,
        };
        let force_kind = r.u8()?;
        let trips = r.u8()?;
        let generation = r.u32()?;
        let since_ms = r.u64()?;
        let open_until_ms = r.u64()?;
        let force_until = r.u64()?;
        let force = match force_kind {
            0 => Force::None,
            1 => Force::Open {
                until_ms: force_until,
            },
            2 => Force::Closed,
            _ => return None,
        };
        let probes_len = usize::from(r.u8()?);
        if probes_len == 0 || probes_len > MAX_PROBES {
            return None;
        }
        r.take(3)?;
        let opened_by = if format == FORMAT {
            decode_cause(&mut r)?
        } else {
            None
        };
        let mut probes = [SLOT_FREE; MAX_PROBES];
        for slot in &mut probes[..probes_len] {
            *slot = r.u64()?;
        }
        let (window, used) = Window::decode(r.0)?;
        if used != r.0.len() {
            return None;
        }
        Some(Breaker {
            state,
            force,
            trips,
            generation,
            since_ms,
            open_until_ms,
            opened_by,
            probes_len,
            probes,
            window,
        })
    }
}

/// The opening cause as [`CAUSE_BYTES`] bytes (see [`Breaker::encode`]).
fn encode_cause(cause: Option<&Cause>, out: &mut Vec<u8>) {
    let clamp32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let (kind, percent, calls, window_secs, slow_call_ms) = match cause {
        Some(Cause::FailureRate {
            percent,
            calls,
            window_secs,
        }) => (1u8, *percent, *calls, clamp32(*window_secs), 0),
        Some(Cause::SlowCallRate {
            percent,
            calls,
            window_secs,
            slow_call_ms,
        }) => (
            2,
            *percent,
            *calls,
            clamp32(*window_secs),
            clamp32(*slow_call_ms),
        ),
        Some(Cause::ProbeFailed) => (3, 0, 0, 0, 0),
        Some(Cause::ProbeSlow) => (4, 0, 0, 0, 0),
        Some(Cause::Fleet) => (5, 0, 0, 0, 0),
        _ => (0, 0, 0, 0, 0),
    };
    out.push(kind);
    out.push(percent.min(100) as u8);
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(&calls.to_le_bytes());
    out.extend_from_slice(&window_secs.to_le_bytes());
    out.extend_from_slice(&slow_call_ms.to_le_bytes());
}

/// Reads what [`encode_cause`] wrote: `Some(None)` for "unknown", `None` for garbage.
fn decode_cause(r: &mut Reader<'_>) -> Option<Option<Cause>> {
    let kind = r.u8()?;
    let percent = u32::from(r.u8()?);
    r.take(2)?;
    let calls = r.u32()?;
    let window_secs = u64::from(r.u32()?);
    let slow_call_ms = u64::from(r.u32()?);
    Some(match kind {
        0 => None,
        1 => Some(Cause::FailureRate {
            percent,
            calls,
            window_secs,
        }),
        2 => Some(Cause::SlowCallRate {
            percent,
            calls,
            window_secs,
            slow_call_ms,
        }),
        3 => Some(Cause::ProbeFailed),
        4 => Some(Cause::ProbeSlow),
        5 => Some(Cause::Fleet),
        _ => return None,
    })
}

fn counted(outcome: Outcome, limits: &Limits) -> Outcome {
    match outcome {
        Outcome::IsErrorResult if limits.count_is_error => Outcome::Failure,
        Outcome::IsErrorResult => Outcome::Success,
        other => other,
    }
}

fn counts_of(outcome: Outcome) -> Counts {
    match outcome {
        Outcome::Success | Outcome::IsErrorResult => Counts::SUCCESS,
        Outcome::Failure => Counts::FAILURE,
        Outcome::Slow => Counts::SLOW,
        Outcome::Ignored => Counts::default(),
    }
}

/// The window counts of an outcome under a policy (an uncounted `isError` is a success).
pub fn counts_for(outcome: Outcome, limits: &Limits) -> Counts {
    counts_of(counted(outcome, limits))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(edit: impl FnOnce(&mut BreakerPolicy)) -> Limits {
        let mut p = BreakerPolicy::default();
        edit(&mut p);
        Limits::from(&p)
    }

    /// Feeds `n` calls of one outcome through admit and record; returns the transitions.
    fn feed(b: &mut Breaker, l: &Limits, now: u64, n: usize, outcome: Outcome) -> Vec<Transition> {
        let mut out = Vec::new();
        for _ in 0..n {
            let (a, t) = b.admit(l, now);
            out.extend(t);
            out.extend(b.record(l, now, 0.0, a, outcome));
        }
        out
    }

    #[test]
    fn opens_on_failure_rate_only_after_min_calls() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        assert!(feed(&mut b, &l, 100, 9, Outcome::Failure).is_empty());
        assert_eq!(b.state(), State::Closed);
        let t = feed(&mut b, &l, 200, 1, Outcome::Failure);
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].from, t[0].to), (State::Closed, State::Open));
        assert_eq!(
            t[0].cause.to_string(),
            "failure rate 100% over 10 calls in 10s"
        );
        assert_eq!(t[0].open_until_ms, Some(200 + 10_000));
        assert_eq!(
            b.admit_read_only(5_200),
            Some(Admission::Reject {
                retry_after_ms: 5_000,
                state: State::Open,
                forced: false
            })
        );
    }

    #[test]
    fn failure_rate_below_threshold_stays_closed_and_at_threshold_opens() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        feed(&mut b, &l, 0, 6, Outcome::Success);
        assert!(feed(&mut b, &l, 0, 4, Outcome::Failure).is_empty(), "40%");
        // 5 of 11 is 45%: still closed; 6 of 12 is 50%: open.
        assert!(feed(&mut b, &l, 0, 1, Outcome::Failure).is_empty());
        let t = feed(&mut b, &l, 0, 1, Outcome::Failure);
        assert_eq!(
            t[0].cause.to_string(),
            "failure rate 50% over 12 calls in 10s"
        );
    }

    #[test]
    fn old_failures_fall_out_of_the_window() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        feed(&mut b, &l, 0, 9, Outcome::Failure);
        // Ten seconds later those nine are gone: one more failure is 1 call, under min_calls.
        assert!(feed(&mut b, &l, 10_000, 1, Outcome::Failure).is_empty());
        assert_eq!(b.totals(10_000).calls, 1);
    }

    #[test]
    fn opens_on_slow_call_rate() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        feed(&mut b, &l, 0, 4, Outcome::Success);
        assert!(feed(&mut b, &l, 0, 5, Outcome::Slow).is_empty());
        // 6 slow of 10: 60%.
        let t = feed(&mut b, &l, 0, 1, Outcome::Slow);
        assert_eq!(t.len(), 1);
        assert!(matches!(
            t[0].cause,
            Cause::SlowCallRate {
                percent: 60,
                calls: 10,
                ..
            }
        ));
        assert!(t[0].cause.to_string().starts_with("slow-call rate 60%"));
    }

    #[test]
    fn is_error_counts_only_when_the_policy_says_so() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        assert!(feed(&mut b, &l, 0, 20, Outcome::IsErrorResult).is_empty());
        assert_eq!(b.totals(0).failures, 0);

        let l = limits(|p| p.count_is_error = true);
        let mut b = Breaker::new(&l, 0);
        let t = feed(&mut b, &l, 0, 10, Outcome::IsErrorResult);
        assert_eq!(t.len(), 1);
        assert_eq!(b.state(), State::Open);
    }

    #[test]
    fn open_duration_doubles_to_the_cap_within_jitter_bounds() {
        let l = limits(|_| {});
        let expect = [10_000, 20_000, 40_000, 80_000, 160_000, 300_000, 300_000];
        for (i, full) in expect.iter().enumerate() {
            let trips = i as u8 + 1;
            assert_eq!(l.open_duration_ms(trips, 0.0), *full, "trip {trips}");
            // 20% jitter: never longer than the full duration, never shorter than 80% of it.
            assert_eq!(l.open_duration_ms(trips, 1.0), full * 8 / 10);
            for k in 0..=10 {
                let d = l.open_duration_ms(trips, f64::from(k) / 10.0);
                assert!(d <= *full && d >= full * 8 / 10, "trip {trips}: {d}");
            }
        }
        assert_eq!(l.open_duration_ms(u8::MAX, 0.0), 300_000);
        assert_eq!(l.open_duration_ms(0, f64::NAN), 10_000);
        assert_eq!(l.open_duration_ms(1, 7.0), 8_000);
    }

    /// Trips `b` at `now` and returns the open-until time.
    fn trip_now(b: &mut Breaker, l: &Limits, now: u64) -> u64 {
        let t = feed(b, l, now, l.min_calls as usize, Outcome::Failure);
        assert_eq!(b.state(), State::Open, "{t:?}");
        b.open_until_ms()
    }

    #[test]
    fn half_open_needs_all_probes_to_succeed() {
        let l = limits(|p| p.open_jitter_percent = 0);
        let mut b = Breaker::new(&l, 0);
        let until = trip_now(&mut b, &l, 0);
        assert_eq!(until, 10_000);
        let (p1, t) = b.admit(&l, until);
        let t = t.expect("OPEN -> HALF_OPEN");
        assert_eq!((t.from, t.to), (State::Open, State::HalfOpen));
        let (p2, _) = b.admit(&l, until);
        let (p3, _) = b.admit(&l, until);
        assert!(matches!(p3, Admission::Probe { slot: 2, .. }));
        let (p4, _) = b.admit(&l, until);
        assert!(matches!(
            p4,
            Admission::Reject {
                state: State::HalfOpen,
                retry_after_ms: 4_000,
                ..
            }
        ));
        assert!(b.record(&l, until + 5, 0.0, p1, Outcome::Success).is_none());
        assert!(b.record(&l, until + 5, 0.0, p2, Outcome::Success).is_none());
        // A success from a slot already used does not count twice.
        assert!(b.record(&l, until + 5, 0.0, p2, Outcome::Success).is_none());
        let t = b.record(&l, until + 6, 0.0, p3, Outcome::Success).unwrap();
        assert_eq!((t.from, t.to), (State::HalfOpen, State::Closed));
        assert_eq!(t.cause.to_string(), "all 3 probes succeeded");
        assert_eq!(b.trips(), 0);
        // The window that opened the breaker is gone.
        assert_eq!(b.totals(until + 6).calls, 0);
        assert_eq!(b.admit_read_only(until + 7), Some(Admission::Allow));
    }

    #[test]
    fn a_failed_probe_reopens_for_longer_and_late_probes_are_ignored() {
        let l = limits(|p| p.open_jitter_percent = 0);
        let mut b = Breaker::new(&l, 0);
        let until = trip_now(&mut b, &l, 0);
        let (p1, _) = b.admit(&l, until);
        let (p2, _) = b.admit(&l, until);
        let (p3, _) = b.admit(&l, until);
        b.record(&l, until + 1, 0.0, p1, Outcome::Success);
        let t = b.record(&l, until + 2, 0.0, p2, Outcome::Failure).unwrap();
        assert_eq!((t.from, t.to), (State::HalfOpen, State::Open));
        assert_eq!(t.cause, Cause::ProbeFailed);
        assert_eq!(t.trips, 2);
        assert_eq!(t.open_until_ms, Some(until + 2 + 20_000));
        // The third probe of that spell answers late: it changes nothing, failure or not.
        assert!(b.record(&l, until + 3, 0.0, p3, Outcome::Failure).is_none());
        assert!(b.record(&l, until + 3, 0.0, p3, Outcome::Success).is_none());
        assert_eq!(b.open_until_ms(), until + 2 + 20_000);

        // Slow probes reopen too, with yet a longer duration.
        let until = b.open_until_ms();
        let (p, _) = b.admit(&l, until);
        let t = b.record(&l, until, 0.0, p, Outcome::Slow).unwrap();
        assert_eq!(t.cause, Cause::ProbeSlow);
        assert_eq!(t.open_until_ms, Some(until + 40_000));
    }

    #[test]
    fn results_of_an_earlier_half_open_spell_do_not_touch_the_next() {
        let l = limits(|p| p.open_jitter_percent = 0);
        let mut b = Breaker::new(&l, 0);
        let until = trip_now(&mut b, &l, 0);
        let (first, _) = b.admit(&l, until);
        let (late, _) = b.admit(&l, until);
        b.record(&l, until, 0.0, first, Outcome::Failure);
        let until = b.open_until_ms();
        let (_, t) = b.admit(&l, until);
        assert_eq!(t.map(|t| t.to), Some(State::HalfOpen));
        // A failure from the first spell answers now: the second spell carries on.
        assert!(b
            .record(&l, until + 1, 0.0, late, Outcome::Failure)
            .is_none());
        assert_eq!(b.state(), State::HalfOpen);
        assert_eq!(b.trips(), 2);
    }

    #[test]
    fn an_unanswered_probe_expires_and_frees_its_slot() {
        let l = limits(|p| {
            p.open_jitter_percent = 0;
            p.half_open_probes = 1;
        });
        assert_eq!(l.probe_timeout_ms, 4_000);
        let mut b = Breaker::new(&l, 0);
        let until = trip_now(&mut b, &l, 0);
        let (lost, _) = b.admit(&l, until);
        assert!(matches!(lost, Admission::Probe { .. }));
        assert!(matches!(
            b.admit_read_only(until + 3_999),
            Some(Admission::Reject { .. })
        ));
        // After the probe timeout the slot is free again.
        assert_eq!(b.admit_read_only(until + 4_000), None);
        let (fresh, t) = b.admit(&l, until + 4_000);
        assert!(t.is_none(), "still the same half-open spell");
        assert!(matches!(fresh, Admission::Probe { slot: 0, .. }));
        assert_ne!(fresh, lost);
        // The lost probe's late success no longer holds the slot.
        assert!(b
            .record(&l, until + 4_100, 0.0, lost, Outcome::Success)
            .is_none());
        assert_eq!(b.state(), State::HalfOpen);
        let t = b
            .record(&l, until + 4_200, 0.0, fresh, Outcome::Success)
            .unwrap();
        assert_eq!(t.to, State::Closed);
        assert_eq!(t.cause.to_string(), "all 1 probes succeeded");
    }

    #[test]
    fn forced_open_rejects_and_forced_closed_never_opens() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        b.set_force(Force::Open { until_ms: 5_000 });
        assert_eq!(
            b.admit_read_only(1_000),
            Some(Admission::Reject {
                retry_after_ms: 4_000,
                state: State::Closed,
                forced: true
            })
        );
        assert_eq!(b.admit_read_only(5_000), Some(Admission::Allow));

        b.set_force(Force::Closed);
        assert!(feed(&mut b, &l, 6_000, 50, Outcome::Failure).is_empty());
        assert_eq!(b.state(), State::Closed);
        // Clearing the override judges the window as it stands at the next call.
        b.set_force(Force::None);
        assert_eq!(feed(&mut b, &l, 6_000, 1, Outcome::Failure).len(), 1);
        // Forced closed admits even while open.
        b.set_force(Force::Closed);
        assert_eq!(b.admit_read_only(6_001), Some(Admission::Allow));
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 42);
        trip_now(&mut b, &l, 1_000);
        b.admit(&l, b.open_until_ms());
        b.set_force(Force::Open { until_ms: 99 });
        let mut bytes = Vec::new();
        b.encode(&mut bytes);
        assert_eq!(bytes.len(), b.encoded_len());
        assert_eq!(bytes.len(), 52 + 3 * 8 + 8 + 10 * 20);
        assert_eq!(Breaker::decode(&bytes), Some(b.clone()));
        assert!(matches!(
            b.opened_by(),
            Some(Cause::FailureRate { calls: 10, .. })
        ));
        for cut in 0..bytes.len() {
            assert!(Breaker::decode(&bytes[..cut]).is_none());
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Breaker::decode(&longer).is_none());
        let mut other_format = bytes.clone();
        other_format[0] = 3;
        assert!(Breaker::decode(&other_format).is_none());
        let mut bad_cause = bytes.clone();
        bad_cause[36] = 6;
        assert!(Breaker::decode(&bad_cause).is_none());
        let mut bad_state = bytes;
        bad_state[1] = 9;
        assert!(Breaker::decode(&bad_state).is_none());
    }

    /// 16.6: a policy that changes the window's shape re-cuts the counts instead of starting
    /// an empty window (before, `conform` dropped all 5 failures here).
    #[test]
    fn a_record_from_another_policy_keeps_its_counts() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 0);
        feed(&mut b, &l, 1_500, 3, Outcome::Failure);
        feed(&mut b, &l, 7_200, 2, Outcome::Success);
        let fewer = limits(|p| p.half_open_probes = 1);
        b.conform(&fewer);
        assert_eq!(
            b.totals(7_200).calls,
            5,
            "same window shape keeps the counts"
        );
        let wider = limits(|p| p.bucket_secs = 2);
        b.conform(&wider);
        assert_eq!(
            b.totals(7_200),
            Counts {
                calls: 5,
                failures: 3,
                slow: 0
            }
        );
        let mut bytes = Vec::new();
        b.encode(&mut bytes);
        assert_eq!(bytes.len(), 52 + 3 * 8 + 8 + 5 * 20);
        // Back to the old shape (a worker still on the old policy): still nothing lost.
        b.conform(&l);
        assert_eq!(b.totals(7_200).calls, 5);
        // Five more failures trip it under either shape: the window counts ten calls.
        let (a, _) = b.admit(&wider, 8_000);
        let mut t = b.record(&wider, 8_000, 0.0, a, Outcome::Failure);
        for _ in 0..4 {
            let (a, _) = b.admit(&l, 8_100);
            t = t.or(b.record(&l, 8_100, 0.0, a, Outcome::Failure));
        }
        let t = t.expect("ten calls, eight failures: open");
        assert_eq!(t.to, State::Open);
    }

    #[test]
    fn a_format_1_record_is_still_read() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 42);
        trip_now(&mut b, &l, 1_000);
        let mut v2 = Vec::new();
        b.encode(&mut v2);
        let mut v1 = v2[..36].to_vec();
        v1[0] = 1;
        v1.extend_from_slice(&v2[52..]);
        let read = Breaker::decode(&v1).expect("format 1 reads");
        assert_eq!(read.state(), State::Open);
        assert_eq!(read.opened_by(), None);
    }

    #[test]
    fn ignored_outcomes_count_nowhere_and_give_a_probe_slot_back() {
        let l = limits(|p| p.half_open_probes = 1);
        let mut b = Breaker::new(&l, 0);
        for _ in 0..100 {
            let (a, _) = b.admit(&l, 10);
            assert_eq!(b.record(&l, 10, 0.0, a, Outcome::Ignored), None);
        }
        assert_eq!(b.totals(10).calls, 0, "neither failures nor successes");
        let opened = trip_now(&mut b, &l, 1_000);
        let (probe, _) = b.admit(&l, opened);
        assert!(matches!(probe, Admission::Probe { .. }));
        assert!(matches!(b.admit(&l, opened).0, Admission::Reject { .. }));
        assert_eq!(b.record(&l, opened, 0.0, probe, Outcome::Ignored), None);
        assert_eq!(b.state(), State::HalfOpen);
        let (next, _) = b.admit(&l, opened + 1);
        assert!(matches!(next, Admission::Probe { .. }), "{next:?}");
        let t = b.record(&l, opened + 1, 0.0, next, Outcome::Success);
        assert_eq!(t.map(|t| t.to), Some(State::Closed));
    }

    #[test]
    fn a_clock_going_backwards_does_not_panic() {
        let l = limits(|_| {});
        let mut b = Breaker::new(&l, 50_000);
        trip_now(&mut b, &l, 50_000);
        assert!(matches!(
            b.admit(&l, 0).0,
            Admission::Reject {
                state: State::Open,
                ..
            }
        ));
        let (p, _) = b.admit(&l, u64::MAX);
        assert!(matches!(p, Admission::Probe { .. }));
        b.record(&l, 0, 0.5, p, Outcome::Failure);
    }
}
