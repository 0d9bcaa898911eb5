//! Breaker records in proxy-wasm shared data, and the per-worker front end over them.
//!
//! Envoy runs one wasm VM per worker thread, so a breaker's state must live in shared data
//! (bytes per key, with a compare-and-swap token); Rust statics would give each worker a
//! breaker of its own that sees a quarter of the traffic. Shared-data writes are the
//! expensive part, so the common path does not write:
//!
//! - `admit` reads the record (one get) and decodes it only when its CAS token changed
//!   since this worker last decoded it. It writes only to take a half-open probe slot.
//! - A success of an admitted call is counted in this worker's pending deltas; `flush`
//!   merges them into shared data on the host's tick (one get and one set per key with
//!   deltas).
//! - Failures, slow calls, probe results and transitions are written at once (get and set
//!   with CAS), carrying this worker's pending deltas along. On repeated CAS mismatches the
//!   write is given up and its counts kept for the next flush, so contention never spins.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use toolgate_model::BreakerPolicy;

use super::state::{counts_for, Admission, Breaker, Force, Limits, Outcome, Transition};
use super::window::{Counts, Window};

/// The set was refused: the record changed since it was read, or the host failed. Either way
/// the write is retried or deferred, never forced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

/// The host could not read shared data. Not the same as "no record": a worker that took a
/// host error for a missing record would write a fresh one over a live OPEN breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError;

/// A record as read: its bytes and the CAS token of the write that made them.
pub type Record = (Vec<u8>, u32);

/// The CAS token that makes a set create the key only if it does not exist yet. Envoy
/// (proxy-wasm-cpp-host `SharedData::set`) accepts any token for a missing key and refuses a
/// token that differs from an existing key's; tokens count up from 1 per write and skip 0, so
/// an existing record carries this one only after some four billion shared-data writes.
pub const CREATE_CAS: u32 = u32::MAX;

/// proxy-wasm shared data, as the host exposes it to one worker.
pub trait SharedStore {
    /// The record of `key`, `Ok(None)` when the key was never set.
    fn get(&self, key: &str) -> Result<Option<Record>, HostError>;
    /// Sets the value if `cas` still matches (`None` sets unconditionally; see [`CREATE_CAS`]).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch>;
}

impl<T: SharedStore + ?Sized> SharedStore for &T {
    fn get(&self, key: &str) -> Result<Option<Record>, HostError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        (**self).set(key, value, cas)
    }
}

/// The shared-data key of the breaker of one tool.
pub fn breaker_key(service: &str, tool: &str) -> String {
    format!("tg/b/{service}/{tool}")
}

/// The (service, tool) of a breaker key, the inverse of [`breaker_key`]. Unambiguous because
/// neither a service (one path segment) nor a valid tool name contains `/`.
pub fn parse_breaker_key(key: &str) -> Option<(&str, &str)> {
    let (service, tool) = key.strip_prefix("tg/b/")?.split_once('/')?;
    (!service.is_empty() && !tool.is_empty() && !tool.contains('/')).then_some((service, tool))
}

/// Read-modify-write attempts before a write is deferred to the next flush. Each attempt
/// is one get and one set; a bound keeps a hot key from stalling a request.
pub const CAS_ATTEMPTS: usize = 8;
/// Entries of tools that saw no call for this long are dropped from the worker's cache,
/// so tool names that come and go do not grow it without bound.
pub const IDLE_EVICT_MS: u64 = 10 * 60 * 1000;
/// What a caller is told to wait when a probe slot could not be taken for contention.
pub const CONTENDED_RETRY_MS: u64 = 1000;
/// Probe results kept for the next flush when their write kept meeting CAS mismatches.
const MAX_PENDING_PROBES: usize = 2 * super::state::MAX_PROBES;

#[derive(Debug, Clone, Copy)]
struct PendingProbe {
    admission: Admission,
    outcome: Outcome,
    at_ms: u64,
}

struct Entry {
    /// The CAS token of the record `breaker` was decoded from (`Some(None)`: no record yet).
    /// `None` after this worker's own write, whose new token the host does not return.
    seen: Option<Option<u32>>,
    breaker: Breaker,
    limits: Limits,
    /// This worker's counts not yet in shared data.
    pending: Window,
    pending_probes: Vec<PendingProbe>,
    last_used_ms: u64,
}

impl Entry {
    fn new(limits: Limits, now_ms: u64) -> Self {
        Entry {
            seen: None,
            breaker: Breaker::new(&limits, now_ms),
            limits,
            pending: Window::new(limits.bucket_ms, limits.buckets),
            pending_probes: Vec::new(),
            last_used_ms: now_ms,
        }
    }

    fn has_pending(&self) -> bool {
        !self.pending.is_empty() || !self.pending_probes.is_empty()
    }

    /// Brings the cached record up to the one just read.
    fn refresh(&mut self, record: Option<Record>, now_ms: u64) {
        let cas = record.as_ref().map(|(_, cas)| *cas);
        if self.seen != Some(cas) {
            // A record this build cannot read (another format during an upgrade, a torn
            // value) is treated as a fresh breaker rather than trusted.
            self.breaker = record
                .as_ref()
                .and_then(|(bytes, _)| Breaker::decode(bytes))
                .unwrap_or_else(|| Breaker::new(&self.limits, now_ms));
            self.seen = Some(cas);
        }
        self.breaker.conform(&self.limits);
    }
}

/// Read, change, CAS-write; `None` when every attempt met a CAS mismatch or the host failed
/// to read (the caller keeps what it wanted to write for later).
fn update<S: SharedStore + ?Sized, R>(
    store: &S,
    key: &str,
    entry: &mut Entry,
    now_ms: u64,
    scratch: &mut Vec<u8>,
    mut apply: impl FnMut(&mut Breaker) -> R,
) -> Option<R> {
    for _ in 0..CAS_ATTEMPTS {
        let record = store.get(key).ok()?;
        // A missing record is created only if it is still missing: two workers creating it
        // at once must not both succeed, or one's counts are lost.
        let cas = Some(record.as_ref().map_or(CREATE_CAS, |(_, cas)| *cas));
        entry.refresh(record, now_ms);
        let mut next = entry.breaker.clone();
        let result = apply(&mut next);
        if next == entry.breaker {
            return Some(result);
        }
        next.encode(scratch);
        if store.set(key, scratch, cas).is_ok() {
            entry.breaker = next;
            entry.seen = None;
            return Some(result);
        }
    }
    None
}

/// Finds or makes the entry of `key`, allocating the key only the first time.
fn entry_mut<'a>(
    entries: &'a mut HashMap<String, Entry>,
    key: &str,
    limits: Limits,
    now_ms: u64,
) -> Option<&'a mut Entry> {
    if !entries.contains_key(key) {
        entries.insert(key.to_owned(), Entry::new(limits, now_ms));
    }
    let entry = entries.get_mut(key)?;
    entry.limits = limits;
    entry.last_used_ms = entry.last_used_ms.max(now_ms);
    Some(entry)
}

/// SplitMix64: enough randomness for jitter, no dependency, and a seed makes tests exact.
fn next_unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// One worker's view of all breakers: a cache of decoded records and the counts this worker
/// has not yet written. One per VM; every worker's `Breakers` shares the same store.
pub struct Breakers<S> {
    store: S,
    entries: HashMap<String, Entry>,
    rng: u64,
    scratch: Vec<u8>,
}

impl<S: SharedStore> Breakers<S> {
    /// `seed` feeds the open-duration jitter; give each worker and gateway a different one.
    pub fn new(store: S, seed: u64) -> Self {
        Breakers {
            store,
            entries: HashMap::new(),
            rng: seed,
            scratch: Vec::new(),
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// May a call to the tool of `key` go upstream? One shared-data get; a write only when
    /// a half-open probe slot is taken. The transition is OPEN to HALF_OPEN, when this call
    /// is the first after the open duration.
    pub fn admit(
        &mut self,
        key: &str,
        policy: &BreakerPolicy,
        now_ms: u64,
    ) -> (Admission, Option<Transition>) {
        let limits = Limits::from(policy);
        let record = self.store.get(key);
        let Some(entry) = entry_mut(&mut self.entries, key, limits, now_ms) else {
            return (Admission::Allow, None);
        };
        match record {
            Ok(record) => entry.refresh(record, now_ms),
            // The host cannot say: judge by this worker's last reading of the record (a fresh
            // breaker if it never read one), without writing anything.
            Err(HostError) => {
                let admission =
                    entry
                        .breaker
                        .admit_read_only(now_ms)
                        .unwrap_or(Admission::Reject {
                            retry_after_ms: CONTENDED_RETRY_MS,
                            state: entry.breaker.state(),
                            forced: false,
                        });
                return (admission, None);
            }
        }
        if let Some(admission) = entry.breaker.admit_read_only(now_ms) {
            return (admission, None);
        }
        match update(&self.store, key, entry, now_ms, &mut self.scratch, |b| {
            b.admit(&limits, now_ms)
        }) {
            Some(result) => result,
            None => (
                Admission::Reject {
                    retry_after_ms: CONTENDED_RETRY_MS,
                    state: entry.breaker.state(),
                    forced: false,
                },
                None,
            ),
        }
    }

    /// The admission a call would get now, without taking a probe slot or writing anything;
    /// `None` when a probe slot is due (only [`admit`](Self::admit) takes one) or the host
    /// cannot read the record.
    pub fn peek(&mut self, key: &str, policy: &BreakerPolicy, now_ms: u64) -> Option<Admission> {
        let limits = Limits::from(policy);
        let record = self.store.get(key).ok()?;
        let entry = entry_mut(&mut self.entries, key, limits, now_ms)?;
        entry.refresh(record, now_ms);
        entry.breaker.admit_read_only(now_ms)
    }

    /// Records how a call that `admit` let through ended. A success of an ordinary call
    /// only bumps a local counter; everything else is written at once.
    pub fn record(
        &mut self,
        key: &str,
        policy: &BreakerPolicy,
        now_ms: u64,
        admission: Admission,
        outcome: Outcome,
    ) -> Option<Transition> {
        if let Admission::Reject { .. } = admission {
            return None;
        }
        if admission == Admission::Allow && outcome == Outcome::Ignored {
            return None;
        }
        let limits = Limits::from(policy);
        let counts = counts_for(outcome, &limits);
        let entry = entry_mut(&mut self.entries, key, limits, now_ms)?;
        if admission == Admission::Allow && counts == Counts::SUCCESS {
            entry.pending.add(now_ms, counts);
            return None;
        }
        let unit = next_unit(&mut self.rng);
        let pending = entry.pending.clone();
        let written = update(&self.store, key, entry, now_ms, &mut self.scratch, |b| {
            let merged = b.merge(&limits, now_ms, unit, &pending);
            let recorded = b.record(&limits, now_ms, unit, admission, outcome);
            merged.or(recorded)
        });
        match written {
            Some(transition) => {
                entry.pending.clear();
                transition
            }
            None => {
                // Kept, not lost: the next flush writes it (and judges the window then).
                match admission {
                    Admission::Probe { .. } => {
                        if entry.pending_probes.len() >= MAX_PENDING_PROBES {
                            entry.pending_probes.remove(0);
                        }
                        entry.pending_probes.push(PendingProbe {
                            admission,
                            outcome,
                            at_ms: now_ms,
                        });
                    }
                    _ => entry.pending.add(now_ms, counts),
                }
                None
            }
        }
    }

    /// Merges this worker's pending counts into shared data; the host calls it on a short
    /// tick (100-200 ms). Returns the transitions the merged counts caused, with their keys.
    pub fn flush(&mut self, now_ms: u64) -> Vec<(String, Transition)> {
        let Breakers {
            store,
            entries,
            rng,
            scratch,
        } = self;
        entries.retain(|_, e| {
            e.has_pending() || now_ms.saturating_sub(e.last_used_ms) < IDLE_EVICT_MS
        });
        let mut transitions = Vec::new();
        for (key, entry) in entries.iter_mut() {
            if !entry.has_pending() {
                continue;
            }
            // Counts that already left the window would be dropped by the merge: skip the write.
            if entry.pending_probes.is_empty() && entry.pending.totals(now_ms).is_zero() {
                entry.pending.clear();
                continue;
            }
            let limits = entry.limits;
            let unit = next_unit(rng);
            let pending = entry.pending.clone();
            let probes = entry.pending_probes.clone();
            let written = update(&*store, key, entry, now_ms, scratch, |b| {
                let mut caused = Vec::new();
                for p in &probes {
                    caused.extend(b.record(&limits, p.at_ms, unit, p.admission, p.outcome));
                }
                caused.extend(b.merge(&limits, now_ms, unit, &pending));
                caused
            });
            if let Some(caused) = written {
                entry.pending.clear();
                entry.pending_probes.clear();
                transitions.extend(caused.into_iter().map(|t| (key.clone(), t)));
            }
        }
        transitions
    }

    /// Applies an operator override. Returns false if the write kept meeting CAS
    /// mismatches; the caller applies it again with the next configuration push.
    pub fn force(&mut self, key: &str, policy: &BreakerPolicy, now_ms: u64, force: Force) -> bool {
        let limits = Limits::from(policy);
        let Some(entry) = entry_mut(&mut self.entries, key, limits, now_ms) else {
            return false;
        };
        update(&self.store, key, entry, now_ms, &mut self.scratch, |b| {
            b.set_force(force)
        })
        .is_some()
    }

    /// Opens the breaker of `key` until `until_ms` because the fleet says so (see
    /// [`Breaker::open_until`]). `Err` if the write kept meeting CAS mismatches; the caller
    /// applies it again with the next configuration push.
    pub fn open_until(
        &mut self,
        key: &str,
        policy: &BreakerPolicy,
        now_ms: u64,
        until_ms: u64,
    ) -> Result<Option<Transition>, CasMismatch> {
        let limits = Limits::from(policy);
        let entry = entry_mut(&mut self.entries, key, limits, now_ms).ok_or(CasMismatch)?;
        update(&self.store, key, entry, now_ms, &mut self.scratch, |b| {
            b.open_until(now_ms, until_ms)
        })
        .ok_or(CasMismatch)
    }

    /// The record as shared data holds it now, e.g. to report fleet state; `None` if the
    /// key was never written or cannot be read.
    pub fn snapshot(&self, key: &str) -> Option<Breaker> {
        Breaker::decode(&self.store.get(key).ok()??.0)
    }

    /// Whether this worker holds counts not yet written to shared data.
    pub fn has_pending(&self) -> bool {
        self.entries.values().any(Entry::has_pending)
    }
}

/// Counters a [`MemStore`] keeps, to assert what the hot path costs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub gets: u64,
    pub sets: u64,
    pub mismatches: u64,
}

#[derive(Default)]
struct MemInner {
    map: HashMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
    stats: StoreStats,
    fail_sets: u32,
    fail_gets: u32,
}

/// An in-memory [`SharedStore`] with Envoy's semantics: a token per write (never 0), a set
/// with a stale token refused, a set with a token on a missing key accepted. For tests and
/// benchmarks; a `Mutex` so that real threads can share it too.
#[derive(Default)]
pub struct MemStore {
    inner: Mutex<MemInner>,
}

impl MemStore {
    pub fn new() -> Self {
        MemStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn stats(&self) -> StoreStats {
        self.lock().stats
    }

    /// Keys set so far (Envoy never frees one).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refuses the next `n` sets as CAS mismatches, as if other workers kept winning.
    pub fn fail_next_sets(&self, n: u32) {
        self.lock().fail_sets = n;
    }

    /// Fails the next `n` gets with a host error.
    pub fn fail_next_gets(&self, n: u32) {
        self.lock().fail_gets = n;
    }

    /// Sets the token counter, e.g. to make the next write's token [`CREATE_CAS`].
    pub fn set_last_cas(&self, cas: u32) {
        self.lock().last_cas = cas;
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Option<Record>, HostError> {
        let mut inner = self.lock();
        inner.stats.gets += 1;
        if inner.fail_gets > 0 {
            inner.fail_gets -= 1;
            return Err(HostError);
        }
        Ok(inner.map.get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        let mut inner = self.lock();
        inner.stats.sets += 1;
        let stale = match (cas, inner.map.get(key)) {
            (Some(cas), Some((_, current))) => cas != *current,
            _ => false,
        };
        if inner.fail_sets > 0 || stale {
            inner.fail_sets = inner.fail_sets.saturating_sub(1);
            inner.stats.mismatches += 1;
            return Err(CasMismatch);
        }
        // Envoy's tokens count up and skip 0.
        inner.last_cas = inner.last_cas.wrapping_add(1).max(1);
        let token = inner.last_cas;
        inner.map.insert(key.to_owned(), (value.to_vec(), token));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::state::State;

    #[test]
    fn breaker_keys_parse_back() {
        let key = breaker_key("weather", "forecast.daily-v2");
        assert_eq!(
            parse_breaker_key(&key),
            Some(("weather", "forecast.daily-v2"))
        );
        for bad in [
            "tg/b/weather",
            "tg/b//t",
            "tg/b/s/",
            "tg/x/s/t",
            "tg/b/s/t/u",
            "",
        ] {
            assert_eq!(parse_breaker_key(bad), None, "{bad}");
        }
    }

    fn read(s: &MemStore, key: &str) -> Option<Record> {
        s.get(key).expect("no host error")
    }

    #[test]
    fn mem_store_refuses_stale_tokens() {
        let s = MemStore::new();
        assert_eq!(read(&s, "k"), None);
        s.set("k", b"a", None).unwrap();
        let (v, cas) = read(&s, "k").unwrap();
        assert_eq!(v, b"a");
        s.set("k", b"b", Some(cas)).unwrap();
        assert_eq!(s.set("k", b"c", Some(cas)), Err(CasMismatch));
        assert_eq!(read(&s, "k").unwrap().0, b"b");
        s.fail_next_sets(1);
        let (_, cas) = read(&s, "k").unwrap();
        assert_eq!(s.set("k", b"d", Some(cas)), Err(CasMismatch));
        s.set("k", b"d", Some(cas)).unwrap();
        assert_eq!(s.stats().mismatches, 2);
        // Envoy's semantics: any token creates a missing key, CREATE_CAS refuses an existing one.
        s.set("new", b"x", Some(CREATE_CAS)).unwrap();
        assert_eq!(s.set("new", b"y", Some(CREATE_CAS)), Err(CasMismatch));
    }

    /// 16.5: another worker creates the record between this worker's read ("no record") and
    /// its write. Before, the create was an unconditional set that silently replaced the
    /// rival's record, losing its failure.
    #[test]
    fn a_record_created_between_read_and_write_is_not_overwritten() {
        /// A store whose first read is answered from before the rival's write.
        struct Racing<'a> {
            inner: &'a MemStore,
            rival: std::cell::RefCell<Option<Breakers<&'a MemStore>>>,
        }
        impl SharedStore for Racing<'_> {
            fn get(&self, key: &str) -> Result<Option<Record>, HostError> {
                let seen = self.inner.get(key);
                if let Some(mut rival) = self.rival.borrow_mut().take() {
                    let policy = BreakerPolicy::default();
                    rival.record(key, &policy, 1, Admission::Allow, Outcome::Failure);
                }
                seen
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
                self.inner.set(key, value, cas)
            }
        }
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let key = "tg/b/s/t";
        let racing = Racing {
            inner: &store,
            rival: std::cell::RefCell::new(Some(Breakers::new(&store, 2))),
        };
        let mut a = Breakers::new(&racing, 1);
        a.record(key, &policy, 1, Admission::Allow, Outcome::Failure);
        let totals = Breakers::new(&store, 3)
            .snapshot(key)
            .expect("a record")
            .totals(1);
        assert_eq!(totals.failures, 2, "{totals:?}");
    }

    /// 16.5: a host error while reading is not "no record": the update is skipped (kept for
    /// the next flush), never written over a live OPEN breaker.
    #[test]
    fn a_host_error_skips_the_update_instead_of_overwriting_an_open_breaker() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let key = "tg/b/s/t";
        let mut a = Breakers::new(&store, 1);
        let mut b = Breakers::new(&store, 2);
        assert!(a.force(
            key,
            &policy,
            0,
            Force::Open {
                until_ms: 1_000_000
            }
        ));
        assert!(matches!(
            b.admit(key, &policy, 5).0,
            Admission::Reject { .. }
        ));
        store.fail_next_gets(u32::MAX);
        // Unreadable now: judged by what this worker last read, and nothing is written.
        let (admission, _) = b.admit(key, &policy, 10);
        assert!(
            matches!(admission, Admission::Reject { .. }),
            "{admission:?}"
        );
        b.record(key, &policy, 10, Admission::Allow, Outcome::Failure);
        assert!(!b.force(key, &policy, 10, Force::None));
        store.fail_next_gets(0);
        let record = a.snapshot(key).unwrap();
        assert_eq!(
            record.force(),
            Force::Open {
                until_ms: 1_000_000
            }
        );
        assert!(b.has_pending(), "the failure waits for the next flush");
        b.flush(20);
        assert_eq!(a.snapshot(key).unwrap().totals(20).failures, 1);
        assert_eq!(
            a.snapshot(key).unwrap().force(),
            Force::Open {
                until_ms: 1_000_000
            }
        );
    }

    #[test]
    fn closed_and_succeeding_costs_one_get_and_no_set_per_request() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let mut w = Breakers::new(&store, 1);
        let key = breaker_key("weather", "forecast");
        assert_eq!(key, "tg/b/weather/forecast");
        for i in 0..1000 {
            let (a, t) = w.admit(&key, &policy, i);
            assert_eq!((a, t), (Admission::Allow, None));
            assert_eq!(w.record(&key, &policy, i, a, Outcome::Success), None);
        }
        assert_eq!(
            store.stats(),
            StoreStats {
                gets: 1000,
                sets: 0,
                mismatches: 0
            }
        );
        assert!(w.flush(1000).is_empty());
        assert_eq!(store.stats().sets, 1);
        assert_eq!(w.snapshot(&key).unwrap().totals(1000).calls, 1000);
        // Nothing pending: a flush costs nothing.
        let before = store.stats();
        w.flush(1100);
        assert_eq!(store.stats(), before);
    }

    #[test]
    fn a_failure_is_written_at_once_with_the_pending_successes() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let mut w = Breakers::new(&store, 1);
        let key = "tg/b/s/t";
        for _ in 0..3 {
            let (a, _) = w.admit(key, &policy, 10);
            w.record(key, &policy, 10, a, Outcome::Success);
        }
        let (a, _) = w.admit(key, &policy, 20);
        w.record(key, &policy, 20, a, Outcome::Failure);
        let snap = w.snapshot(key).unwrap();
        assert_eq!(
            snap.totals(20),
            Counts {
                calls: 4,
                failures: 1,
                slow: 0
            }
        );
        assert!(!w.has_pending());
    }

    #[test]
    fn contention_defers_counts_to_the_next_flush_instead_of_spinning() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let mut w = Breakers::new(&store, 1);
        let key = "tg/b/s/t";
        store.fail_next_sets(u32::MAX);
        for i in 0..10 {
            let (a, _) = w.admit(key, &policy, i);
            assert_eq!(a, Admission::Allow);
            assert_eq!(w.record(key, &policy, i, a, Outcome::Failure), None);
        }
        assert_eq!(store.stats().sets, 10 * CAS_ATTEMPTS as u64);
        assert!(w.has_pending());
        store.fail_next_sets(0);
        let t = w.flush(100);
        assert_eq!(
            t.len(),
            1,
            "the deferred failures trip the breaker at the flush"
        );
        assert_eq!(t[0].0, key);
        assert_eq!(t[0].1.to, State::Open);
        assert!(!w.has_pending());
        assert!(matches!(
            w.admit(key, &policy, 200).0,
            Admission::Reject { .. }
        ));
    }

    #[test]
    fn an_unreadable_record_is_replaced_not_trusted() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let key = "tg/b/s/t";
        store.set(key, b"\x07garbage", None).unwrap();
        let mut w = Breakers::new(&store, 1);
        assert_eq!(w.admit(key, &policy, 0).0, Admission::Allow);
        w.record(key, &policy, 0, Admission::Allow, Outcome::Failure);
        assert_eq!(w.snapshot(key).unwrap().totals(0).failures, 1);
    }

    #[test]
    fn force_is_shared_by_all_workers() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let key = "tg/b/s/t";
        let mut a = Breakers::new(&store, 1);
        let mut b = Breakers::new(&store, 2);
        assert!(a.force(key, &policy, 0, Force::Open { until_ms: 1_000 }));
        assert_eq!(
            b.admit(key, &policy, 10).0,
            Admission::Reject {
                retry_after_ms: 990,
                state: State::Closed,
                forced: true
            }
        );
        assert!(a.force(key, &policy, 20, Force::None));
        assert_eq!(b.admit(key, &policy, 30).0, Admission::Allow);
    }

    #[test]
    fn idle_entries_are_evicted_at_flush() {
        let store = MemStore::new();
        let policy = BreakerPolicy::default();
        let mut w = Breakers::new(&store, 1);
        for i in 0..100 {
            w.admit(&format!("tg/b/s/t{i}"), &policy, 0);
        }
        assert_eq!(w.entries.len(), 100);
        w.flush(IDLE_EVICT_MS + 1);
        assert!(w.entries.is_empty());
    }

    #[test]
    fn jitter_units_are_in_range_and_seeded() {
        let mut a = 7;
        let mut b = 7;
        for _ in 0..1000 {
            let u = next_unit(&mut a);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u, next_unit(&mut b));
        }
    }
}
