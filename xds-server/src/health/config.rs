//! How health is judged: the thresholds of the state machine ([`super::machine`]) and the
//! pace of the signals that feed it. Its own module, below both the health signals and the
//! registry that keeps each instance's state, so neither imports the other for it.

use std::time::Duration;

/// How health is judged. Defaults are the issue's: probe every 2 s with a 1 s timeout, two
/// misses make SUSPECT, 30 s of misses make DOWN.
#[derive(Debug, Clone)]
pub struct HealthConfig {
    /// Off: the lease is the only liveness signal and instances are UP on registration.
    pub probes: bool,
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    /// Probes in flight at once, so 5,000 instances do not open 5,000 sockets together.
    pub probe_concurrency: usize,
    /// Idle connections held to instances at once, so a crash is known when the kernel closes
    /// them (see [`crash_watch`](super::crash_watch)); 0 turns that off.
    pub probe_watch_limit: usize,
    /// Failed probes in a row before SUSPECT (2; 3 with the GC-pause tolerance).
    pub suspect_after: u32,
    pub down_window: Duration,
    /// Call-failure feedback: the window, the minimum evidence and the threshold.
    pub call_window: Duration,
    pub call_min_calls: u64,
    pub call_min_failures: u64,
    pub call_failure_percent: u32,
    /// An UNHEALTHY instance's share of its configured weight (never 0).
    pub unhealthy_weight_percent: u32,
    pub inspect_interval: Duration,
    pub lease_check_interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            probes: true,
            probe_interval: Duration::from_secs(2),
            probe_timeout: Duration::from_secs(1),
            probe_concurrency: 64,
            probe_watch_limit: 10_000,
            suspect_after: 2,
            down_window: Duration::from_secs(30),
            call_window: Duration::from_secs(10),
            call_min_calls: 10,
            call_min_failures: 3,
            call_failure_percent: 50,
            unhealthy_weight_percent: 10,
            inspect_interval: Duration::from_secs(30),
            lease_check_interval: Duration::from_secs(5),
        }
    }
}
