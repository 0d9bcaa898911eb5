//! Heartbeat loss, read from the leases themselves: etcd's TimeToLive says how long ago a
//! lease was last kept alive (granted TTL minus remaining TTL). A registrar keeps alive every
//! TTL/3, so a lease further behind than that has missed keepalives, whatever the cause
//! (a stalled registrar, a congested link, an overloaded etcd).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use futures::StreamExt;
use toolgate_model::ServiceKey;
use tracing::{debug, warn};

use super::Hub;
use crate::etcd::EtcdConfig;
use crate::metrics::ServiceLabel;
use crate::registry::LeaseCheck;

/// A lease, the instances bound to it, and (granted, remaining) TTL if etcd answered.
type LeaseAnswer = (i64, Vec<ServiceKey>, Option<(i64, i64)>);

/// TimeToLive requests in flight at once.
const CONCURRENCY: usize = 16;

/// Instances looked at per hold of the registry's lock. One pass over 100,000 instances under
/// the write lock held every propagation behind it for tens of milliseconds every check (the
/// churn's p99 at 100,000 instances: 75 ms with it, 40 without); each instance's check stands
/// alone, so the pass lets go between chunks.
const LOCK_CHUNK: usize = 1_000;

/// Keepalives missed by a lease granted `granted` seconds that has `remaining` left. etcd
/// reports whole seconds (rounded down), and a keepalive can be a little late without being
/// lost: a quarter interval plus a second of slack.
pub fn missed_keepalives(granted: i64, remaining: i64) -> u32 {
    if granted <= 0 || remaining < 0 || remaining > granted {
        return 0;
    }
    let interval = granted as f64 / 3.0;
    let elapsed = (granted - remaining) as f64;
    let missed = ((elapsed - 1.0 - interval * 0.25) / interval).floor();
    if missed <= 0.0 {
        0
    } else {
        missed as u32
    }
}

pub async fn check_leases(hub: Hub, etcd: EtcdConfig) {
    let Some(client) = etcd.connect_patiently("heartbeat checks").await else {
        return;
    };
    let mut every = tokio::time::interval(hub.config.lease_check_interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        // Several instances may share a lease (one process, many registrations): ask once.
        let mut leases: HashMap<i64, Vec<ServiceKey>> = HashMap::new();
        let mut after: Option<ServiceKey> = None;
        loop {
            let seen = {
                let reg = hub.registry.read().unwrap_or_else(|p| p.into_inner());
                let mut seen = 0;
                for (key, inst) in reg.instances_after(after.as_ref()).take(LOCK_CHUNK) {
                    seen += 1;
                    after = Some(key.clone());
                    // Lease 0: served from the state dir, not seen in etcd yet.
                    if inst.lease != 0 {
                        leases.entry(inst.lease).or_default().push(key.clone());
                    }
                }
                seen
            };
            if seen < LOCK_CHUNK {
                break;
            }
            tokio::task::yield_now().await;
        }
        if leases.is_empty() {
            hub.metrics.heartbeat_loss_rate.clear();
            continue;
        }
        let timeout = etcd.request_timeout;
        let answers: Vec<LeaseAnswer> = futures::stream::iter(
            leases,
        )
        .map(|(lease, keys)| {
            let mut lc = client.lease_client();
            async move {
                let ttl = match tokio::time::timeout(timeout, lc.time_to_live(lease, None)).await {
                    Ok(Ok(r)) => Some((r.granted_ttl(), r.ttl())),
                    Ok(Err(e)) => {
                        debug!(lease = format!("{lease:x}"), error = %e, "lease TimeToLive failed");
                        None
                    }
                    Err(_) => None,
                };
                (lease, keys, ttl)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
        if answers.iter().all(|(_, _, a)| a.is_none()) {
            // etcd is away: the watcher raises that alarm; keep the last figures.
            continue;
        }
        let now = SystemTime::now();
        let mut per_service: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut checks = answers
            .into_iter()
            // -1: expired; etcd deletes its keys and the watch removes them.
            .filter_map(|(lease, keys, answer)| {
                let (granted, remaining) = answer.filter(|(_, r)| *r >= 0)?;
                Some((lease, keys, granted, remaining))
            })
            .flat_map(|(lease, keys, granted, remaining)| {
                keys.into_iter().map(move |key| Check {
                    key,
                    lease,
                    granted,
                    remaining,
                })
            })
            .peekable();
        while checks.peek().is_some() {
            {
                let mut reg = hub.registry.write().unwrap_or_else(|p| p.into_inner());
                for check in checks.by_ref().take(LOCK_CHUNK) {
                    let behind = record(&hub, &mut reg, now, &check);
                    if let Some(behind) = behind {
                        let entry = per_service.entry(check.key.service).or_default();
                        entry.1 += 1;
                        entry.0 += u64::from(behind);
                    }
                }
            }
            tokio::task::yield_now().await;
        }
        hub.metrics.heartbeat_loss_rate.clear();
        for (service, (behind, checked)) in per_service {
            hub.metrics
                .heartbeat_loss_rate
                .get_or_create(&ServiceLabel { service })
                .set(behind as f64 / checked.max(1) as f64);
        }
    }
}

/// One instance's lease as etcd answered for it.
struct Check {
    key: ServiceKey,
    lease: i64,
    granted: i64,
    remaining: i64,
}

/// Records one instance's lease check, and wakes its probe if the lease is behind its
/// keepalives. Whether it is behind; `None` if the instance is gone or holds another lease.
fn record(
    hub: &Hub,
    reg: &mut crate::registry::Registry,
    now: SystemTime,
    check: &Check,
) -> Option<bool> {
    let Check {
        key,
        lease,
        granted,
        remaining,
    } = check;
    let missed = missed_keepalives(*granted, *remaining);
    let recorded = LeaseCheck {
        at: now,
        granted_ttl_s: *granted,
        remaining_ttl_s: *remaining,
        missed_keepalives: missed,
    };
    let (before, wake) = reg.record_lease_check(key, *lease, recorded)?;
    // Within one gap the estimate only grows; count each lost keepalive once.
    if missed > before {
        hub.metrics
            .heartbeats_missed
            .get_or_create(&ServiceLabel {
                service: key.service.clone(),
            })
            .inc_by(u64::from(missed - before));
    }
    if missed > 0 {
        warn!(service = %key.service, instance = %key.instance,
            lease = format!("{lease:x}"), granted, remaining, missed,
            "lease is behind its keepalives; probing the instance now");
        wake.notify_one();
    }
    Some(missed > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalives_on_time_are_not_missed() {
        // TTL 10 s, a keepalive every 3.3 s: remaining stays above 6 s.
        for remaining in 6..=10 {
            assert_eq!(missed_keepalives(10, remaining), 0, "remaining {remaining}");
        }
    }

    #[test]
    fn a_stalled_registrar_shows_as_missed_keepalives() {
        assert_eq!(missed_keepalives(10, 4), 1);
        assert_eq!(missed_keepalives(10, 1), 2);
        assert_eq!(missed_keepalives(10, 0), 2);
        assert_eq!(missed_keepalives(30, 10), 1);
    }

    #[test]
    fn nonsense_is_not_a_loss() {
        assert_eq!(missed_keepalives(0, 0), 0);
        assert_eq!(missed_keepalives(10, -1), 0);
        assert_eq!(missed_keepalives(10, 11), 0);
    }
}
