//! The breaker across workers: several `Breakers` (one per simulated Envoy worker) over one
//! shared store, interleaved, as Envoy's per-worker VMs would be.

use std::collections::HashMap;

use proptest::prelude::*;
use toolgate_model::BreakerPolicy;

use super::*;

const KEY: &str = "tg/b/weather/forecast";

fn workers(store: &MemStore, n: usize) -> Vec<Breakers<&MemStore>> {
    (0..n).map(|i| Breakers::new(store, i as u64 + 1)).collect()
}

fn no_jitter() -> BreakerPolicy {
    BreakerPolicy {
        open_jitter_percent: 0,
        ..BreakerPolicy::default()
    }
}

/// The number of the failure (1-based) that opened the breaker, calls going round-robin.
fn failures_to_trip(n_workers: usize) -> usize {
    let store = MemStore::new();
    let mut ws = workers(&store, n_workers);
    let policy = BreakerPolicy::default();
    for i in 0..100 {
        let w = &mut ws[i % n_workers];
        let (a, _) = w.admit(KEY, &policy, 1_000 + i as u64);
        assert_eq!(a, Admission::Allow, "failure {} was rejected", i + 1);
        if let Some(t) = w.record(KEY, &policy, 1_000 + i as u64, a, Outcome::Failure) {
            assert_eq!((t.from, t.to), (State::Closed, State::Open));
            // Every worker sees it open at once.
            for w in &mut ws {
                assert!(matches!(
                    w.admit(KEY, &policy, 1_000 + i as u64).0,
                    Admission::Reject {
                        state: State::Open,
                        ..
                    }
                ));
            }
            return i + 1;
        }
    }
    panic!("never opened");
}

#[test]
fn four_workers_trip_after_the_same_number_of_failures_as_one() {
    assert_eq!(failures_to_trip(1), 10);
    assert_eq!(failures_to_trip(4), 10);
}

#[test]
fn successes_merged_at_flush_can_complete_min_calls_and_trip() {
    let store = MemStore::new();
    let mut ws = workers(&store, 4);
    let policy = BreakerPolicy::default();
    // 5 successes on workers 0..3 (only counted locally) and 5 failures on worker 3.
    for i in 0..5 {
        let w = &mut ws[i % 3];
        let (a, _) = w.admit(KEY, &policy, 100);
        assert_eq!(w.record(KEY, &policy, 100, a, Outcome::Success), None);
    }
    for _ in 0..5 {
        let (a, _) = ws[3].admit(KEY, &policy, 100);
        assert_eq!(ws[3].record(KEY, &policy, 100, a, Outcome::Failure), None);
    }
    assert_eq!(ws[3].snapshot(KEY).unwrap().totals(100).calls, 5);
    let mut caused = Vec::new();
    for w in &mut ws {
        caused.extend(w.flush(150).into_iter().map(|(_, t)| t));
    }
    assert_eq!(caused.len(), 1, "{caused:?}");
    assert_eq!(
        caused[0].cause.to_string(),
        "failure rate 50% over 10 calls in 10s"
    );
}

/// Trips the breaker through worker 0 and returns when probing may start.
fn trip(ws: &mut [Breakers<&MemStore>], policy: &BreakerPolicy, now: u64) -> u64 {
    for _ in 0..policy.min_calls {
        let (a, _) = ws[0].admit(KEY, policy, now);
        ws[0].record(KEY, policy, now, a, Outcome::Failure);
    }
    let snap = ws[0].snapshot(KEY).unwrap();
    assert_eq!(snap.state(), State::Open);
    snap.open_until_ms()
}

/// Admits round-robin over the workers; returns the probes with the worker that holds each.
fn admit_round(
    ws: &mut [Breakers<&MemStore>],
    policy: &BreakerPolicy,
    now: u64,
    calls: usize,
) -> (Vec<(usize, Admission)>, Vec<Transition>) {
    let mut probes = Vec::new();
    let mut transitions = Vec::new();
    for i in 0..calls {
        let n = i % ws.len();
        let (a, t) = ws[n].admit(KEY, policy, now);
        transitions.extend(t);
        match a {
            Admission::Probe { .. } => probes.push((n, a)),
            Admission::Reject {
                state: State::HalfOpen,
                ..
            } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    (probes, transitions)
}

#[test]
fn at_most_n_probes_across_workers_and_all_must_succeed_to_close() {
    let store = MemStore::new();
    let mut ws = workers(&store, 4);
    let policy = no_jitter();
    let until = trip(&mut ws, &policy, 0);
    assert!(matches!(
        ws[2].admit(KEY, &policy, until - 1).0,
        Admission::Reject {
            retry_after_ms: 1,
            state: State::Open,
            ..
        }
    ));
    let (probes, transitions) = admit_round(&mut ws, &policy, until, 12);
    assert_eq!(probes.len(), 3);
    assert_eq!(transitions.len(), 1, "one worker reports OPEN -> HALF_OPEN");
    assert_eq!(transitions[0].to, State::HalfOpen);
    // Each probe answers on the worker that admitted it.
    let mut closed = None;
    for (i, (n, a)) in probes.iter().enumerate() {
        let t = ws[*n].record(KEY, &policy, until + 10, *a, Outcome::Success);
        if i < 2 {
            assert_eq!(t, None);
            assert_eq!(ws[0].snapshot(KEY).unwrap().state(), State::HalfOpen);
        } else {
            closed = t;
        }
    }
    let closed = closed.expect("the third success closes");
    assert_eq!((closed.from, closed.to), (State::HalfOpen, State::Closed));
    assert_eq!(closed.cause.to_string(), "all 3 probes succeeded");
    for w in &mut ws {
        assert_eq!(w.admit(KEY, &policy, until + 11).0, Admission::Allow);
    }
}

#[test]
fn any_probe_failure_reopens_for_longer_on_every_worker() {
    let store = MemStore::new();
    let mut ws = workers(&store, 4);
    let policy = no_jitter();
    let until = trip(&mut ws, &policy, 0);
    let (probes, _) = admit_round(&mut ws, &policy, until, 4);
    let (n0, p0) = probes[0];
    let (n1, p1) = probes[1];
    assert_eq!(
        ws[n0].record(KEY, &policy, until + 5, p0, Outcome::Success),
        None
    );
    let t = ws[n1]
        .record(KEY, &policy, until + 5, p1, Outcome::Failure)
        .unwrap();
    assert_eq!((t.from, t.to, t.trips), (State::HalfOpen, State::Open, 2));
    assert_eq!(t.cause.to_string(), "half-open probe failed");
    assert_eq!(t.open_until_ms, Some(until + 5 + 20_000));
    for w in &mut ws {
        assert_eq!(
            w.admit(KEY, &policy, until + 6).0,
            Admission::Reject {
                retry_after_ms: 19_999,
                state: State::Open,
                forced: false
            }
        );
    }
    // The third probe answers late with a success: it cannot close the reopened breaker.
    let (n2, p2) = probes[2];
    assert_eq!(
        ws[n2].record(KEY, &policy, until + 7, p2, Outcome::Success),
        None
    );
    assert_eq!(ws[0].snapshot(KEY).unwrap().state(), State::Open);
}

#[test]
fn an_unanswered_probe_expires_and_lets_a_new_one_in() {
    let store = MemStore::new();
    let mut ws = workers(&store, 4);
    let policy = BreakerPolicy {
        probe_timeout_ms: Some(1_500),
        ..no_jitter()
    };
    let until = trip(&mut ws, &policy, 0);
    let (probes, _) = admit_round(&mut ws, &policy, until, 8);
    assert_eq!(probes.len(), 3);
    // Two answer; the third is never heard of again (say its client went away).
    for (n, a) in &probes[..2] {
        ws[*n].record(KEY, &policy, until + 100, *a, Outcome::Success);
    }
    let (more, _) = admit_round(&mut ws, &policy, until + 1_499, 4);
    assert!(more.is_empty(), "the silent probe still holds its slot");
    let (more, transitions) = admit_round(&mut ws, &policy, until + 1_500, 4);
    assert_eq!(more.len(), 1, "its slot expired and was handed on");
    assert!(transitions.is_empty());
    let (n, a) = more[0];
    let t = ws[n]
        .record(KEY, &policy, until + 1_600, a, Outcome::Success)
        .unwrap();
    assert_eq!(t.to, State::Closed);
}

#[test]
fn is_error_results_count_only_when_the_policy_says_so() {
    for count_is_error in [false, true] {
        let store = MemStore::new();
        let mut ws = workers(&store, 4);
        let policy = BreakerPolicy {
            count_is_error,
            ..BreakerPolicy::default()
        };
        let mut opened = false;
        for i in 0..40 {
            let w = &mut ws[i % 4];
            let (a, _) = w.admit(KEY, &policy, 0);
            if a != Admission::Allow {
                break;
            }
            opened |= w
                .record(KEY, &policy, 0, a, Outcome::IsErrorResult)
                .is_some();
        }
        for w in &mut ws {
            w.flush(100);
        }
        assert_eq!(opened, count_is_error);
        let snap = ws[0].snapshot(KEY).unwrap();
        if count_is_error {
            assert_eq!(snap.state(), State::Open);
        } else {
            assert_eq!(snap.state(), State::Closed);
            assert_eq!(snap.totals(100).calls, 40);
            assert_eq!(snap.totals(100).failures, 0);
        }
    }
}

/// Yields the thread between a read and the write that follows it, so that real threads
/// race where workers would: between get and CAS set.
struct Yielding<'a>(&'a MemStore);

impl SharedStore for Yielding<'_> {
    fn get(&self, key: &str) -> Result<Option<Record>, HostError> {
        let read = self.0.get(key);
        std::thread::yield_now();
        read
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        self.0.set(key, value, cas)
    }
}

#[test]
fn real_threads_lose_no_counts() {
    // Workers as real threads racing on one store. Forced closed so that failures never trip
    // it: every failure is then a CAS write racing the others, and every call must land
    // exactly once, deferred by contention perhaps, never dropped or doubled.
    let store = MemStore::new();
    let policy = BreakerPolicy::default();
    let per_worker = 2_000u64;
    assert!(Breakers::new(&store, 0).force(KEY, &policy, 0, Force::Closed));
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for n in 0..4u64 {
            let store = &store;
            let policy = &policy;
            let start = &start;
            scope.spawn(move || {
                let mut w = Breakers::new(Yielding(store), n);
                start.wait();
                for i in 0..per_worker {
                    let (a, _) = w.admit(KEY, policy, 5_000);
                    assert_eq!(a, Admission::Allow);
                    let outcome = if i % 2 == 0 {
                        Outcome::Failure
                    } else {
                        Outcome::Success
                    };
                    w.record(KEY, policy, 5_000, a, outcome);
                    if i % 50 == 0 {
                        w.flush(5_000);
                    }
                }
                while w.has_pending() {
                    w.flush(5_000);
                }
            });
        }
    });
    let snap = Breaker::decode(&store.get(KEY).unwrap().unwrap().0).unwrap();
    let totals = snap.totals(5_000);
    assert_eq!(u64::from(totals.calls), 4 * per_worker);
    assert_eq!(u64::from(totals.failures), 2 * per_worker);
    assert!(
        store.stats().mismatches > 0,
        "the threads never raced: {:?}",
        store.stats()
    );
}

#[test]
#[ignore = "micro benchmark: cargo test --release -p toolgate-filter -- --ignored --nocapture"]
fn hot_path_cost() {
    let store = MemStore::new();
    let policy = BreakerPolicy::default();
    let mut w = Breakers::new(&store, 1);
    let n = 1_000_000u64;
    let started = std::time::Instant::now();
    for i in 0..n {
        let now = 1_000_000 + i / 10;
        let (a, _) = w.admit(KEY, &policy, now);
        w.record(KEY, &policy, now, a, Outcome::Success);
        if i % 1000 == 0 {
            w.flush(now);
        }
    }
    let per = started.elapsed().as_nanos() as f64 / n as f64;
    let mut bytes = Vec::new();
    w.snapshot(KEY).unwrap().encode(&mut bytes);
    let started = std::time::Instant::now();
    let mut sink = 0u64;
    for _ in 0..n {
        sink += u64::from(
            Breaker::decode(std::hint::black_box(&bytes))
                .unwrap()
                .trips(),
        );
    }
    let decode = started.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "admit+record(success): {per:.0} ns/request incl. the MemStore get; decode of a {} byte record: {decode:.0} ns ({sink}); store: {:?}",
        bytes.len(),
        store.stats()
    );
}

// ---- random interleavings ----

#[derive(Debug, Clone)]
enum Op {
    Admit(usize),
    /// The worker's oldest outstanding call ends with this outcome.
    Finish(usize, Outcome),
    /// The worker's oldest outstanding call never answers.
    Abandon(usize),
    Flush(usize),
    Advance(u64),
    Contend(u32),
    Force(usize, u8),
    /// The fleet opens the tool for this long, through this worker's configuration.
    FleetOpen(usize, u64),
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        3 => Just(Outcome::Success),
        2 => Just(Outcome::Failure),
        1 => Just(Outcome::Slow),
        1 => Just(Outcome::IsErrorResult),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..4usize;
    prop_oneof![
        6 => w.clone().prop_map(Op::Admit),
        5 => (w.clone(), outcome()).prop_map(|(w, o)| Op::Finish(w, o)),
        1 => w.clone().prop_map(Op::Abandon),
        2 => w.clone().prop_map(Op::Flush),
        3 => prop_oneof![0..50u64, 0..5_000u64, 0..40_000u64].prop_map(Op::Advance),
        1 => (0..20u32).prop_map(Op::Contend),
        1 => (w.clone(), 0..6u8).prop_map(|(w, f)| Op::Force(w, f)),
        1 => (w, 0..30_000u64).prop_map(|(w, ms)| Op::FleetOpen(w, ms)),
    ]
}

/// Mostly sensible policies, some of them invalid: the breaker must survive both.
fn policy() -> impl Strategy<Value = BreakerPolicy> {
    (
        (0..12u32, 0..4u32, 0..120u32, 0..120u32, 0..3_000u64),
        (0..8u32, 0..5_000u64, 0..60_000u64, 0..120u32, 0..6u32),
        (proptest::option::of(0..6_000u64), any::<bool>()),
    )
        .prop_map(
            |(
                (window_secs, bucket_secs, failure_rate, slow_rate, slow_call_ms),
                (min_calls, open_ms, max_open_ms, jitter, probes),
                (probe_timeout_ms, count_is_error),
            )| BreakerPolicy {
                window_secs,
                bucket_secs,
                failure_rate_percent: failure_rate,
                slow_call_rate_percent: slow_rate,
                slow_call_ms,
                min_calls,
                open_ms,
                max_open_ms,
                open_jitter_percent: jitter,
                half_open_probes: probes,
                probe_timeout_ms,
                count_is_error,
                ..BreakerPolicy::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_interleavings_never_panic_nor_exceed_the_probe_bound(
        policy in policy(),
        start in prop_oneof![Just(0u64), 0..2_000_000_000_000u64],
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let store = MemStore::new();
        let mut ws = workers(&store, 4);
        let limits = Limits::from(&policy);
        let mut now = start;
        let mut outstanding: Vec<Vec<Admission>> = vec![Vec::new(); 4];
        let mut silent: Vec<Admission> = Vec::new();
        // Probe successes recorded per half-open generation.
        let mut successes: HashMap<u32, usize> = HashMap::new();
        let check_close = |t: &Transition, successes: &HashMap<u32, usize>| {
            if t.to == State::Closed {
                let spell = t.generation.wrapping_sub(1);
                let n = successes.get(&spell).copied().unwrap_or(0);
                prop_assert!(
                    n >= limits.probes,
                    "closed after {n} probe successes, policy needs {}", limits.probes
                );
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Admit(n) => {
                    let (a, t) = ws[n].admit(KEY, &policy, now);
                    if let Some(t) = &t { check_close(t, &successes)?; }
                    if !matches!(a, Admission::Reject { .. }) {
                        outstanding[n].push(a);
                    }
                }
                Op::Finish(n, o) => {
                    if !outstanding[n].is_empty() {
                        let a = outstanding[n].remove(0);
                        let success = o == Outcome::Success
                            || (o == Outcome::IsErrorResult && !policy.count_is_error);
                        if let (Admission::Probe { generation, .. }, true) = (a, success) {
                            *successes.entry(generation).or_default() += 1;
                        }
                        if let Some(t) = ws[n].record(KEY, &policy, now, a, o) {
                            check_close(&t, &successes)?;
                        }
                    }
                }
                Op::Abandon(n) => {
                    if !outstanding[n].is_empty() {
                        silent.push(outstanding[n].remove(0));
                    }
                }
                Op::Flush(n) => {
                    for (_, t) in ws[n].flush(now) {
                        check_close(&t, &successes)?;
                    }
                }
                Op::Advance(ms) => now = now.saturating_add(ms),
                Op::Contend(k) => store.fail_next_sets(k),
                Op::Force(n, f) => {
                    let force = match f {
                        0 => Force::Open { until_ms: now.saturating_add(1_000) },
                        1 => Force::Closed,
                        _ => Force::None,
                    };
                    ws[n].force(KEY, &policy, now, force);
                }
                Op::FleetOpen(n, ms) => {
                    let until = now.saturating_add(ms);
                    if let Ok(Some(t)) = ws[n].open_until(KEY, &policy, now, until) {
                        prop_assert_eq!((t.to, t.open_until_ms), (State::Open, Some(until)));
                    }
                }
            }
            // No more probes of one half-open spell hold unexpired slots than the policy allows.
            let mut held: HashMap<u32, usize> = HashMap::new();
            for a in outstanding.iter().flatten().chain(silent.iter()) {
                if let Admission::Probe { ticket, generation, .. } = a {
                    if *ticket > now {
                        *held.entry(*generation).or_default() += 1;
                    }
                }
            }
            for (generation, n) in held {
                prop_assert!(
                    n <= limits.probes,
                    "{n} probes of generation {generation} in flight, policy allows {}",
                    limits.probes
                );
            }
        }
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Some(b) = Breaker::decode(&bytes) {
            let mut again = Vec::new();
            b.encode(&mut again);
            prop_assert_eq!(Breaker::decode(&again), Some(b));
        }
    }
}

/// The fleet's openings, as toolgate-xds delivers them to every worker's configuration.
mod fleet_openings {
    use super::*;

    #[test]
    fn closed_opens_until_the_fleet_says_on_every_worker() {
        let store = MemStore::new();
        let mut ws = workers(&store, 2);
        let policy = no_jitter();
        let t = ws[0]
            .open_until(KEY, &policy, 1_000, 61_000)
            .expect("written")
            .expect("a transition");
        assert_eq!(
            (t.from, t.to, t.cause),
            (State::Closed, State::Open, Cause::Fleet)
        );
        assert_eq!(t.open_until_ms, Some(61_000));
        assert_eq!(t.trips, 1);
        // The other worker applies the same configuration: nothing left to do.
        assert_eq!(ws[1].open_until(KEY, &policy, 1_001, 61_000), Ok(None));
        assert_eq!(
            ws[1].admit(KEY, &policy, 31_000).0,
            Admission::Reject {
                retry_after_ms: 30_000,
                state: State::Open,
                forced: false
            }
        );
    }

    #[test]
    fn an_earlier_opening_is_extended_and_a_later_one_stands() {
        let store = MemStore::new();
        let mut ws = workers(&store, 1);
        let policy = no_jitter();
        let until = trip(&mut ws, &policy, 0);
        assert_eq!(until, 10_000);
        assert_eq!(ws[0].open_until(KEY, &policy, 5, 25_000), Ok(None));
        let snap = ws[0].snapshot(KEY).unwrap();
        assert_eq!((snap.state(), snap.open_until_ms()), (State::Open, 25_000));
        assert_eq!(ws[0].open_until(KEY, &policy, 6, 20_000), Ok(None));
        assert_eq!(ws[0].snapshot(KEY).unwrap().open_until_ms(), 25_000);
        assert_eq!(ws[0].snapshot(KEY).unwrap().trips(), 1, "no new trip");
    }

    #[test]
    fn half_open_reopens_until_and_its_probes_are_void() {
        let store = MemStore::new();
        let mut ws = workers(&store, 2);
        let policy = no_jitter();
        let until = trip(&mut ws, &policy, 0);
        let (probe, t) = ws[0].admit(KEY, &policy, until);
        assert_eq!(t.map(|t| t.to), Some(State::HalfOpen));
        let t = ws[1]
            .open_until(KEY, &policy, until + 1, until + 30_000)
            .expect("written")
            .expect("a transition");
        assert_eq!((t.from, t.to), (State::HalfOpen, State::Open));
        assert_eq!(t.trips, 2);
        // The probe let through before answers late: it belongs to a spell that is over.
        assert_eq!(
            ws[0].record(KEY, &policy, until + 2, probe, Outcome::Success),
            None
        );
        assert!(matches!(
            ws[0].admit(KEY, &policy, until + 29_999).0,
            Admission::Reject {
                state: State::Open,
                ..
            }
        ));
    }

    #[test]
    fn after_the_fleet_opening_local_probes_decide() {
        let store = MemStore::new();
        let mut ws = workers(&store, 1);
        let policy = no_jitter();
        ws[0].open_until(KEY, &policy, 0, 5_000).unwrap();
        let (p, t) = ws[0].admit(KEY, &policy, 5_000);
        assert_eq!(t.map(|t| t.to), Some(State::HalfOpen));
        // A failed probe reopens with the backoff of a second trip.
        let t = ws[0]
            .record(KEY, &policy, 5_001, p, Outcome::Failure)
            .expect("reopened");
        assert_eq!((t.from, t.to), (State::HalfOpen, State::Open));
        assert_eq!(t.open_until_ms, Some(5_001 + 2 * policy.open_ms));
    }

    #[test]
    fn forced_closed_or_an_expired_opening_changes_nothing() {
        let store = MemStore::new();
        let mut ws = workers(&store, 1);
        let policy = no_jitter();
        assert!(ws[0].force(KEY, &policy, 0, Force::Closed));
        assert_eq!(ws[0].open_until(KEY, &policy, 10, 60_000), Ok(None));
        let snap = ws[0].snapshot(KEY).unwrap();
        assert_eq!(snap.state(), State::Closed);
        assert_eq!(ws[0].admit(KEY, &policy, 20).0, Admission::Allow);
        assert!(ws[0].force(KEY, &policy, 30, Force::None));
        assert_eq!(ws[0].open_until(KEY, &policy, 60_000, 60_000), Ok(None));
        assert_eq!(ws[0].open_until(KEY, &policy, 60_000, 1_000), Ok(None));
        assert_eq!(ws[0].snapshot(KEY).unwrap().state(), State::Closed);
    }

    #[test]
    fn contention_is_reported_not_spun_on() {
        let store = MemStore::new();
        let mut ws = workers(&store, 1);
        store.fail_next_sets(u32::MAX);
        assert_eq!(
            ws[0].open_until(KEY, &no_jitter(), 0, 1_000),
            Err(CasMismatch)
        );
    }
}
