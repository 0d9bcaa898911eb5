//! Capped exponential backoff with full jitter, so that a fleet of registrars that lost etcd
//! together does not reconnect in lockstep.

use std::time::Duration;

use rand::Rng;

pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }

    /// The next delay: uniformly random in [ceiling/2, ceiling], ceiling doubling up to the cap.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + rand::rng().random_range(Duration::ZERO..=half)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        for _ in 0..20 {
            assert!(b.next_delay() <= Duration::from_secs(2));
        }
        assert!(b.next_delay() >= Duration::from_secs(1));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
