//! Call limits: a token bucket per (rule, caller), kept in proxy-wasm shared data so that all
//! of an Envoy's workers draw on the same bucket.
//!
//! Envoy never frees a shared-data key, and callers come from requests: a bucket per key
//! would let a flood of distinct subjects grow Envoy's memory without end. So the buckets
//! live in a fixed table of [`SLOTS`] keys (`tg/l/<slot>`), each holding up to [`WAYS`]
//! buckets; a (rule, caller) hashes to one slot. A caller new to a full slot takes the place
//! of the bucket with the most tokens (the least used: one that has refilled since its last
//! call is as good as new, so evicting it changes nothing). The table is at most
//! `SLOTS × (key + WAYS × 24 bytes)` whatever comes; the price is that while more callers are
//! active at once than a slot holds, a bucket evicted before it refilled starts full again.
//! A depleted bucket, the one a limit is for, has the fewest tokens and is evicted last.
//!
//! A take from shared data is one get and one compare-and-swap set; a refusal writes
//! nothing. A worker takes a bucket's tokens a batch at a time ([`Share::batch`]: a
//! sixty-fourth of the bucket, at most 1,000, at least 1) and spends them from its own
//! memory ([`Local`]) for up to [`LOCAL_MS`], so a bucket far from empty costs most calls no
//! shared-data access at all. Tokens a worker took and did not spend are lost to the bucket:
//! the batching can only admit less, by at most one batch per worker, never more.

use std::hash::{DefaultHasher, Hash, Hasher};

use toolgate_model::limits::LimitRule;

use crate::breaker::store::{CAS_ATTEMPTS, CREATE_CAS};
use crate::breaker::SharedStore;

/// Shared-data keys of the bucket table.
pub const SLOTS: u64 = 4096;
/// Buckets per key.
pub const WAYS: usize = 4;
/// Bytes of one bucket: the caller's hash, its tokens (f64) and the time they were counted.
const WAY_BYTES: usize = 24;

/// A rule's bucket as one Envoy keeps it: its share of the fleet's budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Tokens the bucket holds when full (at least 1).
    pub capacity: f64,
    /// Tokens added per millisecond.
    pub per_ms: f64,
}

impl Share {
    /// `rule`'s bucket on one of `gateways` Envoys that split it evenly.
    pub fn of(rule: &LimitRule, gateways: u32) -> Share {
        let g = f64::from(gateways.max(1));
        Share {
            capacity: (rule.burst() as f64 / g).max(1.0),
            per_ms: rule.calls as f64 / (rule.per_seconds as f64 * 1000.0) / g,
        }
    }

    /// The tokens of a bucket counted at `then` with `tokens`, at `now`.
    fn refilled(self, tokens: f64, then: u64, now: u64) -> f64 {
        let elapsed = now.saturating_sub(then) as f64;
        (tokens + elapsed * self.per_ms).min(self.capacity)
    }

    /// Tokens a worker takes at once: a sixty-fourth of the bucket (small buckets, which a
    /// limit is likely to empty, go one token at a time), at most [`MAX_BATCH`].
    pub fn batch(self) -> u64 {
        ((self.capacity / 64.0).floor() as u64).clamp(1, MAX_BATCH)
    }

    /// Milliseconds until a bucket with `tokens` has one.
    fn wait_ms(self, tokens: f64) -> u64 {
        if self.per_ms <= 0.0 {
            return u64::MAX;
        }
        ((1.0 - tokens).max(0.0) / self.per_ms).ceil() as u64
    }
}

/// The most tokens a worker takes from a bucket at once.
pub const MAX_BATCH: u64 = 1000;
/// How long a worker spends tokens it took before it gives the rest up.
pub const LOCAL_MS: u64 = 1000;
/// Buckets a worker holds tokens of; emptied whole when full (the tokens are given up).
pub const LOCAL_BUCKETS: usize = 1024;

/// The tokens one worker took from shared buckets and has not spent yet.
#[derive(Debug, Default)]
pub struct Local {
    held: std::collections::HashMap<u64, (u64, u64)>,
}

impl Local {
    /// Takes one token of bucket `id`: from this worker's batch, else a new batch from
    /// shared data.
    pub fn take(&mut self, store: &impl SharedStore, id: u64, share: Share, now: u64) -> Take {
        if let Some((tokens, until)) = self.held.get_mut(&id) {
            if *tokens > 0 && now < *until {
                *tokens -= 1;
                return Take::Admitted;
            }
        }
        let batch = share.batch();
        match take_up_to(store, id, share, now, batch) {
            Ok(granted) => {
                if granted > 1 {
                    if self.held.len() >= LOCAL_BUCKETS && !self.held.contains_key(&id) {
                        self.held.clear();
                    }
                    self.held.insert(id, (granted - 1, now + LOCAL_MS));
                } else {
                    self.held.remove(&id);
                }
                Take::Admitted
            }
            Err(retry_after_ms) => {
                self.held.remove(&id);
                Take::Refused { retry_after_ms }
            }
        }
    }

    /// A new configuration: the shares may have changed, so every batch is given up.
    pub fn clear(&mut self) {
        self.held.clear();
    }
}

/// What a take decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    Admitted,
    /// Over the limit: the bucket has a token again in this many milliseconds.
    Refused {
        retry_after_ms: u64,
    },
}

/// The bucket named by `parts`: the rule's place (service, tool, rule) and the caller.
pub fn bucket_id(parts: &[&str]) -> u64 {
    let mut h = DefaultHasher::new();
    for part in parts {
        part.hash(&mut h);
    }
    // 0 marks an empty way.
    h.finish() | 1
}

/// The bucket of `caller` under `rule` of (`service`, `scope`), found without allocating: a
/// rule is its name, or (unnamed) the figures its default name is made of.
pub fn rule_bucket(service: &str, scope: &str, rule: &LimitRule, caller: &str) -> u64 {
    let mut h = DefaultHasher::new();
    service.hash(&mut h);
    scope.hash(&mut h);
    match &rule.name {
        Some(name) => name.hash(&mut h),
        None => (rule.per.as_str(), rule.calls, rule.per_seconds).hash(&mut h),
    }
    caller.hash(&mut h);
    h.finish() | 1
}

/// The shared-data key of the slot `id` hashes to.
pub fn slot_key(id: u64) -> String {
    format!("tg/l/{}", id % SLOTS)
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Way {
    id: u64,
    tokens: f64,
    at_ms: u64,
}

fn decode(bytes: &[u8]) -> [Way; WAYS] {
    let mut ways = [Way::default(); WAYS];
    for (way, chunk) in ways.iter_mut().zip(bytes.chunks_exact(WAY_BYTES)) {
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&chunk[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        let tokens = f64::from_bits(word(1));
        *way = Way {
            id: word(0),
            // A record this code did not write is read as an empty bucket, never as a
            // bucket with endless tokens.
            tokens: if tokens.is_finite() { tokens } else { 0.0 },
            at_ms: word(2),
        };
    }
    ways
}

fn encode(ways: &[Way; WAYS]) -> [u8; WAYS * WAY_BYTES] {
    let mut out = [0u8; WAYS * WAY_BYTES];
    for (way, chunk) in ways.iter().zip(out.chunks_exact_mut(WAY_BYTES)) {
        chunk[0..8].copy_from_slice(&way.id.to_le_bytes());
        chunk[8..16].copy_from_slice(&way.tokens.to_bits().to_le_bytes());
        chunk[16..24].copy_from_slice(&way.at_ms.to_le_bytes());
    }
    out
}

/// Takes one token from bucket `id` (a share `share`) at `now`. A shared-data failure, or a
/// write lost to other workers [`CAS_ATTEMPTS`] times in a row, admits: the limit is a
/// budget, and a host that cannot keep it must not stop every call.
pub fn take(store: &impl SharedStore, id: u64, share: Share, now: u64) -> Take {
    match take_up_to(store, id, share, now, 1) {
        Ok(_) => Take::Admitted,
        Err(retry_after_ms) => Take::Refused { retry_after_ms },
    }
}

/// Takes up to `want` tokens (at least one) from bucket `id`: how many it got, or the
/// milliseconds until it has one.
fn take_up_to(
    store: &impl SharedStore,
    id: u64,
    share: Share,
    now: u64,
    want: u64,
) -> Result<u64, u64> {
    let key = slot_key(id);
    for _ in 0..CAS_ATTEMPTS {
        let (mut ways, cas) = match store.get(&key) {
            Ok(Some((bytes, cas))) => (decode(&bytes), Some(cas)),
            Ok(None) => ([Way::default(); WAYS], None),
            Err(_) => return Ok(1),
        };
        let at = match ways.iter().position(|w| w.id == id) {
            Some(i) => {
                let tokens = share.refilled(ways[i].tokens, ways[i].at_ms, now);
                if tokens < 1.0 {
                    return Err(share.wait_ms(tokens));
                }
                ways[i].tokens = tokens;
                i
            }
            None => {
                // An empty way, else the bucket with the most tokens now (the least used).
                let i = ways
                    .iter()
                    .enumerate()
                    .map(|(i, w)| {
                        let tokens = if w.id == 0 {
                            f64::INFINITY
                        } else {
                            share.refilled(w.tokens, w.at_ms, now)
                        };
                        (i, tokens)
                    })
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .map_or(0, |(i, _)| i);
                ways[i] = Way {
                    id,
                    tokens: share.capacity,
                    at_ms: now,
                };
                i
            }
        };
        let granted = (ways[at].tokens.floor() as u64).clamp(1, want.max(1));
        ways[at].tokens -= granted as f64;
        ways[at].at_ms = now;
        let cas = cas.or(Some(CREATE_CAS));
        if store.set(&key, &encode(&ways), cas).is_ok() {
            return Ok(granted);
        }
    }
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::MemStore;
    use toolgate_model::limits::Per;

    fn rule(calls: u64, per_seconds: u64, burst: Option<u64>) -> LimitRule {
        LimitRule {
            per: Per::Subject,
            calls,
            per_seconds,
            burst,
            name: None,
        }
    }

    #[test]
    fn a_bucket_admits_its_burst_then_refuses_until_it_refills() {
        let store = MemStore::new();
        let share = Share::of(&rule(60, 60, Some(3)), 1);
        let id = bucket_id(&["orders/*/r", "alice"]);
        for _ in 0..3 {
            assert_eq!(take(&store, id, share, 1_000), Take::Admitted);
        }
        assert_eq!(
            take(&store, id, share, 1_000),
            Take::Refused {
                retry_after_ms: 1000
            }
        );
        // One token a second.
        assert_eq!(take(&store, id, share, 2_000), Take::Admitted);
        assert!(matches!(
            take(&store, id, share, 2_000),
            Take::Refused { .. }
        ));
        // Another caller has its own bucket.
        let bob = bucket_id(&["orders/*/r", "bob"]);
        assert_eq!(take(&store, bob, share, 2_000), Take::Admitted);
    }

    #[test]
    fn a_worker_spends_a_batch_locally_and_small_buckets_go_one_by_one() {
        let store = MemStore::new();
        let big = Share::of(&rule(1_000_000, 1, None), 1);
        assert_eq!(big.batch(), MAX_BATCH);
        let mut local = Local::default();
        let id = bucket_id(&["r", "c"]);
        for _ in 0..500 {
            assert_eq!(local.take(&store, id, big, 10), Take::Admitted);
        }
        assert_eq!(store.stats().sets, 1, "one batch from shared data");
        // Past the lease, a new batch.
        assert_eq!(local.take(&store, id, big, 10 + LOCAL_MS), Take::Admitted);
        assert_eq!(store.stats().sets, 2);
        // A bucket of 20: one token at a time, so the limit is exact across workers.
        let small = Share::of(&rule(20, 3600, None), 1);
        assert_eq!(small.batch(), 1);
        let (mut a, mut b) = (Local::default(), Local::default());
        let id = bucket_id(&["r", "small"]);
        let admitted = (0..40)
            .filter(|i| {
                let w = if i % 2 == 0 { &mut a } else { &mut b };
                w.take(&store, id, small, 100) == Take::Admitted
            })
            .count();
        assert_eq!(admitted, 20);
    }

    #[test]
    fn a_fleet_splits_the_rate_and_the_burst() {
        let s = Share::of(&rule(100, 10, Some(40)), 4);
        assert_eq!(s.capacity, 10.0);
        assert!((s.per_ms - 0.0025).abs() < 1e-12);
        // Never less than one token, or nothing would pass.
        assert_eq!(Share::of(&rule(1, 60, None), 8).capacity, 1.0);
    }

    #[test]
    fn the_table_stays_bounded_and_a_depleted_bucket_outlives_fresh_ones() {
        let store = MemStore::new();
        let share = Share::of(&rule(5, 3600, Some(5)), 1);
        let heavy = bucket_id(&["r", "heavy"]);
        for _ in 0..5 {
            assert_eq!(take(&store, heavy, share, 0), Take::Admitted);
        }
        // A flood of distinct callers into the heavy caller's slot and every other.
        for i in 0..200_000u64 {
            let _ = take(
                &store,
                bucket_id(&["r", &format!("s{i}")]),
                share,
                1 + i / 1000,
            );
        }
        assert!(store.len() as u64 <= SLOTS, "{} keys", store.len());
        assert!(
            matches!(take(&store, heavy, share, 300), Take::Refused { .. }),
            "the depleted bucket was evicted by fresh ones"
        );
    }

    #[test]
    fn a_record_of_other_bytes_is_read_as_empty_buckets() {
        let ways = decode(&[0xff; 7]);
        assert!(ways.iter().all(|w| w.id == 0));
        let mut bytes = encode(
            &[Way {
                id: 5,
                tokens: 1.0,
                at_ms: 1,
            }; WAYS],
        );
        bytes[8..16].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        assert_eq!(decode(&bytes)[0].tokens, 0.0);
    }
}
