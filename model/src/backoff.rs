//! Capped exponential backoff with jitter, so that a fleet that lost etcd together does not
//! reconnect in lockstep. The caller supplies the randomness: this crate also runs in wasm,
//! where the filter draws it from the host.

use std::time::Duration;

/// The ceiling of the `attempt`th delay (from 0): `base` doubled `attempt` times, at most
/// `cap`. For callers that jitter on their own terms (the health prober's ±10%).
pub fn ceiling(base: Duration, cap: Duration, attempt: u32) -> Duration {
    base.saturating_mul(1u32 << attempt.min(16)).min(cap)
}

#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// How many delays were handed out since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The next delay: in [ceiling/2, ceiling] at `unit` (0.0..=1.0) of that span, the ceiling
    /// doubling from `base` up to `cap`.
    pub fn next_delay(&mut self, unit: f64) -> Duration {
        let ceiling = ceiling(self.base, self.cap, self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(unit.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        assert_eq!(b.next_delay(0.0), Duration::from_millis(50));
        assert_eq!(b.next_delay(1.0), Duration::from_millis(200));
        for _ in 0..20 {
            assert!(b.next_delay(1.0) <= Duration::from_secs(2));
        }
        assert!(b.next_delay(0.0) >= Duration::from_secs(1));
        b.reset();
        assert!(b.next_delay(1.0) <= Duration::from_millis(100));
    }

    #[test]
    fn the_ceiling_doubles_to_the_cap_without_overflowing() {
        let ms = Duration::from_millis;
        assert_eq!(ceiling(ms(250), ms(2000), 0), ms(250));
        assert_eq!(ceiling(ms(250), ms(2000), 2), ms(1000));
        assert_eq!(ceiling(ms(250), ms(2000), 3), ms(2000));
        assert_eq!(ceiling(ms(250), ms(2000), u32::MAX), ms(2000));
    }
}
