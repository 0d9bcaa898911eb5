//! The sliding window a breaker judges its rates over.
//!
//! A ring of buckets, each keyed by its epoch (`now / bucket width`). A bucket is reused only
//! when its epoch has left the window, so old calls fall out one bucket at a time and the
//! window never forgets everything at once (a window that resets lets a burst of failures
//! straddling the reset go unnoticed). The ring has a fixed capacity and a fixed-size byte
//! encoding because it lives in proxy-wasm shared data and is decoded on the request path.

use toolgate_model::BreakerPolicy;

/// Capacity of the ring; the policy's bucket count is validated against the same bound.
pub const MAX_BUCKETS: usize = toolgate_model::MAX_BUCKETS as usize;

/// Calls counted in one bucket, or summed over the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub calls: u32,
    pub failures: u32,
    pub slow: u32,
}

impl Counts {
    pub const SUCCESS: Counts = Counts {
        calls: 1,
        failures: 0,
        slow: 0,
    };
    pub const FAILURE: Counts = Counts {
        calls: 1,
        failures: 1,
        slow: 0,
    };
    pub const SLOW: Counts = Counts {
        calls: 1,
        failures: 0,
        slow: 1,
    };

    pub fn is_zero(&self) -> bool {
        self.calls == 0 && self.failures == 0 && self.slow == 0
    }

    // Saturating: a counter stuck at its ceiling skews one rate a little; wrapping to zero
    // would make a failing tool look healthy.
    fn add(&mut self, other: Counts) {
        self.calls = self.calls.saturating_add(other.calls);
        self.failures = self.failures.saturating_add(other.failures);
        self.slow = self.slow.saturating_add(other.slow);
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bucket {
    epoch: u64,
    counts: Counts,
}

const BUCKET_BYTES: usize = 8 + 4 + 4 + 4;
/// bucket width (u32 ms), bucket count (u8), 3 reserved bytes.
const HEADER_BYTES: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    bucket_ms: u64,
    len: usize,
    buckets: [Bucket; MAX_BUCKETS],
}

impl Window {
    /// A window of `len` buckets of `bucket_ms` each. Out-of-range shapes are clamped rather
    /// than refused: an unvalidated policy must not be able to make the filter panic.
    pub fn new(bucket_ms: u64, len: usize) -> Self {
        Window {
            bucket_ms: bucket_ms.clamp(1, u64::from(u32::MAX)),
            len: len.clamp(1, MAX_BUCKETS),
            buckets: [Bucket::default(); MAX_BUCKETS],
        }
    }

    pub fn for_policy(policy: &BreakerPolicy) -> Self {
        let bucket_ms = u64::from(policy.bucket_secs).saturating_mul(1000);
        Window::new(bucket_ms, policy.buckets() as usize)
    }

    pub fn bucket_ms(&self) -> u64 {
        self.bucket_ms
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether this window was built for the same shape; a policy change that alters the
    /// shape re-cuts the buckets (see `Breaker::conform`).
    pub fn has_shape(&self, bucket_ms: u64, len: usize) -> bool {
        let other = Window::new(bucket_ms, len);
        self.bucket_ms == other.bucket_ms && self.len == other.len
    }

    pub fn span_ms(&self) -> u64 {
        self.bucket_ms.saturating_mul(self.len as u64)
    }

    fn epoch(&self, now_ms: u64) -> u64 {
        now_ms / self.bucket_ms
    }

    /// Counts `counts` in the bucket that holds `now_ms`.
    pub fn add(&mut self, now_ms: u64, counts: Counts) {
        self.add_at(self.epoch(now_ms), counts);
    }

    fn add_at(&mut self, epoch: u64, counts: Counts) {
        if counts.is_zero() {
            return;
        }
        let slot = &mut self.buckets[(epoch % self.len as u64) as usize];
        if slot.epoch == epoch {
            slot.counts.add(counts);
        } else if slot.epoch < epoch {
            // Same slot, older epoch: that bucket is at least one window old, so it falls out.
            *slot = Bucket { epoch, counts };
        }
        // Otherwise the counts are older than the window the ring already holds: drop them.
    }

    /// Sums the buckets still inside the window that ends in the bucket holding `now_ms`.
    /// Buckets from slightly later epochs count too: workers read the clock at different
    /// moments, and a call one worker saw a moment "ahead" is still a recent call.
    pub fn totals(&self, now_ms: u64) -> Counts {
        let oldest = self.epoch(now_ms).saturating_sub(self.len as u64 - 1);
        let mut sum = Counts::default();
        for bucket in &self.buckets[..self.len] {
            if bucket.epoch >= oldest {
                sum.add(bucket.counts);
            }
        }
        sum
    }

    /// Adds another window's buckets, e.g. one worker's unflushed deltas. Buckets are matched
    /// by the time they start, so windows of different shapes merge sensibly too.
    pub fn merge(&mut self, other: &Window) {
        for bucket in &other.buckets[..other.len] {
            if bucket.counts.is_zero() {
                continue;
            }
            let start_ms = bucket.epoch.saturating_mul(other.bucket_ms);
            self.add_at(self.epoch(start_ms), bucket.counts);
        }
    }

    pub fn clear(&mut self) {
        self.buckets = [Bucket::default(); MAX_BUCKETS];
    }

    pub fn is_empty(&self) -> bool {
        self.buckets[..self.len].iter().all(|b| b.counts.is_zero())
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.len * BUCKET_BYTES
    }

    /// Appends the fixed-size little-endian encoding: u32 bucket width in ms, u8 bucket count,
    /// 3 reserved bytes, then per bucket u64 epoch, u32 calls, u32 failures, u32 slow.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let bucket_ms = u32::try_from(self.bucket_ms).unwrap_or(u32::MAX);
        out.extend_from_slice(&bucket_ms.to_le_bytes());
        out.push(self.len as u8);
        out.extend_from_slice(&[0; 3]);
        for bucket in &self.buckets[..self.len] {
            out.extend_from_slice(&bucket.epoch.to_le_bytes());
            out.extend_from_slice(&bucket.counts.calls.to_le_bytes());
            out.extend_from_slice(&bucket.counts.failures.to_le_bytes());
            out.extend_from_slice(&bucket.counts.slow.to_le_bytes());
        }
    }

    /// Decodes a window from the front of `bytes`, returning it and the bytes it used.
    pub fn decode(bytes: &[u8]) -> Option<(Window, usize)> {
        let mut r = Reader(bytes);
        let bucket_ms = u64::from(r.u32()?);
        let len = usize::from(r.u8()?);
        r.take(3)?;
        if bucket_ms == 0 || len == 0 || len > MAX_BUCKETS {
            return None;
        }
        let mut window = Window::new(bucket_ms, len);
        for bucket in &mut window.buckets[..len] {
            bucket.epoch = r.u64()?;
            bucket.counts = Counts {
                calls: r.u32()?,
                failures: r.u32()?,
                slow: r.u32()?,
            };
        }
        Some((window, HEADER_BYTES + len * BUCKET_BYTES))
    }
}

/// A cursor over untrusted bytes: every read is bounds-checked and fails softly.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failures(n: u32) -> Counts {
        Counts {
            calls: n,
            failures: n,
            slow: 0,
        }
    }

    #[test]
    fn old_buckets_fall_out_one_by_one() {
        // 10 s window in 1 s buckets; one failure per second for 10 seconds.
        let mut w = Window::new(1000, 10);
        for s in 0..10 {
            w.add(s * 1000 + 500, failures(1));
        }
        assert_eq!(w.totals(9_999).failures, 10);
        // Each further second drops exactly the oldest bucket: no reset-all.
        for (k, now) in (10_000..20_000).step_by(1000).enumerate() {
            assert_eq!(w.totals(now).failures, 9 - k as u32, "at {now} ms");
        }
        assert_eq!(w.totals(20_000).failures, 0);
    }

    #[test]
    fn a_bucket_is_reused_only_after_it_left_the_window() {
        let mut w = Window::new(1000, 10);
        w.add(3_000, failures(4));
        // 13 s maps to the same slot as 3 s; the 3 s bucket is out of the window by then.
        w.add(13_000, failures(1));
        assert_eq!(w.totals(13_000).failures, 1);
        // A late delta for 3 s cannot overwrite the newer bucket in its slot.
        w.add(3_000, failures(7));
        assert_eq!(w.totals(13_000).failures, 1);
        // Within the window, counts for the same second accumulate.
        w.add(12_000, failures(2));
        w.add(12_999, failures(3));
        assert_eq!(w.totals(13_500).failures, 6);
    }

    #[test]
    fn totals_count_calls_failures_and_slow() {
        let mut w = Window::new(1000, 10);
        w.add(0, Counts::SUCCESS);
        w.add(1, Counts::FAILURE);
        w.add(2_000, Counts::SLOW);
        assert_eq!(
            w.totals(2_000),
            Counts {
                calls: 3,
                failures: 1,
                slow: 1
            }
        );
    }

    #[test]
    fn merging_deltas_adds_them_by_time() {
        let mut shared = Window::new(1000, 10);
        let mut a = Window::new(1000, 10);
        let mut b = Window::new(1000, 10);
        shared.add(5_000, Counts::FAILURE);
        a.add(5_100, Counts::SUCCESS);
        a.add(6_100, Counts::SUCCESS);
        b.add(6_900, Counts::SLOW);
        // b also holds a bucket that is out of the window by the time it is merged.
        b.add(100, Counts::FAILURE);
        shared.add(14_000, Counts::SUCCESS);
        shared.merge(&a);
        shared.merge(&b);
        assert_eq!(
            shared.totals(14_000),
            Counts {
                calls: 5,
                failures: 1,
                slow: 1
            }
        );
        // A window of another shape merges by bucket start time.
        let mut coarse = Window::new(2000, 5);
        coarse.merge(&a);
        assert_eq!(coarse.totals(6_500).calls, 2);
    }

    #[test]
    fn encoding_round_trips_and_has_a_fixed_size() {
        let mut w = Window::new(1000, 10);
        for s in 0..25u64 {
            w.add(s * 700, failures(s as u32));
        }
        let mut bytes = Vec::new();
        w.encode(&mut bytes);
        assert_eq!(bytes.len(), w.encoded_len());
        assert_eq!(bytes.len(), 8 + 10 * 20);
        let (back, used) = Window::decode(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(back, w);
        assert!(Window::decode(&bytes[..bytes.len() - 1]).is_none());
        assert!(Window::decode(&[0; 8]).is_none());
    }

    #[test]
    fn nonsense_shapes_are_clamped_not_fatal() {
        let mut w = Window::new(0, 0);
        w.add(u64::MAX, Counts::FAILURE);
        assert_eq!(w.totals(u64::MAX).failures, 1);
        let w = Window::new(u64::MAX, 1000);
        assert_eq!(w.len(), MAX_BUCKETS);
        assert_eq!(w.totals(0), Counts::default());
    }
}
