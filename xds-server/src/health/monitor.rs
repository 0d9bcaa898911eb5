//! The health tasks: one probe loop per instance (started and stopped as registrations come
//! and go), the aging of call failures, and the periodic inspection.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;
use toolgate_model::ServiceKey;
use tracing::{debug, error, info, warn};

use super::crash_watch::{self, Ended};
use super::machine::State;
use super::probe::{self, Credential, ProbeSessions, Prober};
use super::Hub;
use crate::etcd::EtcdConfig;
use crate::metrics::{ResultLabel, WatchEndLabel};
use crate::registry::{ProbeTarget, Rejected};
use crate::upstream_credentials::Credentials;

/// Where and how an instance is probed, and what wakes its probe task early.
type Target = (ProbeTarget, Arc<Notify>);

struct ProbeTask {
    handle: JoinHandle<()>,
    target: ProbeTarget,
    wake: Arc<Notify>,
    id: u64,
    sessions: ProbeSessions,
}

impl Drop for ProbeTask {
    fn drop(&mut self) {
        self.handle.abort();
        // The instance left or moved: the server must not keep the prober's session.
        self.sessions.release(self.id);
    }
}

/// Starts every health task. `probed` is notified after each applied probe (the cold-start
/// warm-up waits on it); `resync` asks the watcher for a full re-read of etcd. The returned
/// sessions are the MCP sessions the probers hold, for closing when toolgate-xds stops. The
/// HTTP and MCP probes carry their service's credential from `credentials`.
pub fn spawn(
    hub: Hub,
    etcd: EtcdConfig,
    probed: Arc<Notify>,
    resync: Arc<Notify>,
    credentials: Credentials,
) -> ProbeSessions {
    let client = probe::client(hub.config.probe_timeout);
    let sessions = ProbeSessions::new(client.clone(), hub.config.probe_timeout);
    tokio::spawn(supervise_probes(
        hub.clone(),
        probed,
        client,
        sessions.clone(),
        credentials,
    ));
    tokio::spawn(age_call_failures(hub.clone()));
    tokio::spawn(inspect(hub.clone(), etcd.clone(), resync));
    tokio::spawn(super::lease::check_leases(hub, etcd));
    sessions
}

/// Keeps exactly one probe task per registered instance, at its current address.
async fn supervise_probes(
    hub: Hub,
    probed: Arc<Notify>,
    client: reqwest::Client,
    sessions: ProbeSessions,
    credentials: Credentials,
) {
    let membership = hub
        .registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .membership();
    let slots = Arc::new(Semaphore::new(hub.config.probe_concurrency.max(1)));
    let watches = if hub.config.probes {
        let files = crash_watch::raise_open_files_limit();
        let budget = crash_watch::budget(hub.config.probe_watch_limit, files);
        if budget == 0 && hub.config.probe_watch_limit > 0 {
            warn!(open_files_limit = files,
                "crash watch off: the open-files limit leaves no room for connections held to instances (raise it beyond 1024); a crash is found by the next probe");
        } else {
            info!(budget, open_files_limit = files, asked = hub.config.probe_watch_limit,
                "crash watch: idle connections held to instances, at most (--probe-watch-limit, and half the open-files limit beyond 1024)");
        }
        budget
    } else {
        0
    };
    let watches = Arc::new(Semaphore::new(watches));
    let mut tasks: HashMap<ServiceKey, ProbeTask> = HashMap::new();
    loop {
        membership.notified().await;
        let changes: Vec<(ServiceKey, Option<Target>)> = {
            let mut reg = hub.registry.write().unwrap_or_else(|p| p.into_inner());
            let dirty = reg.take_dirty();
            dirty
                .into_iter()
                .map(|k| {
                    let target = reg.instance(&k).map(|i| (i.probe_target(), i.wake.clone()));
                    (k, target)
                })
                .collect()
        };
        if !hub.config.probes {
            continue;
        }
        for (key, target) in changes {
            let Some((target, wake)) = target else {
                tasks.remove(&key);
                continue;
            };
            // A key deleted and put again between two looks is a new registration: its task
            // may have ended (the instance was gone when it looked) and its wake is new.
            if tasks.get(&key).is_some_and(|t| {
                t.target == target && Arc::ptr_eq(&t.wake, &wake) && !t.handle.is_finished()
            }) {
                continue;
            }
            // The old task (and its session) goes first, so the server never holds two.
            tasks.remove(&key);
            let id = sessions.task_id();
            let credential = Credential::of(&key.service, &credentials);
            let prober = Prober::new(&target, &client, hub.config.probe_timeout, credential);
            let handle = tokio::spawn(probe_loop(
                hub.clone(),
                key.clone(),
                prober,
                wake.clone(),
                client.clone(),
                (slots.clone(), watches.clone()),
                probed.clone(),
                (id, sessions.clone()),
            ));
            tasks.insert(
                key,
                ProbeTask {
                    handle,
                    target,
                    wake,
                    id,
                    sessions: sessions.clone(),
                },
            );
        }
    }
}

/// The least time between two probes of one instance when failed calls or a closed
/// connection wake its prober.
const WOKEN_PROBE_GAP: Duration = Duration::from_millis(250);

/// The first probe after a refused one comes this soon, the next twice as late, and so on up
/// to the interval (250 ms, 500 ms, 1 s, then 2 s at the default). Nothing listens at the
/// address, so such a probe is one SYN the instance's kernel answers with a reset, and the
/// state machine needs no more of them (one refusal is SUSPECT; DOWN counts time, not
/// probes). What it buys: a server restarted in place (its supervisor, or its container
/// restarted in the same pod) is routed again within a fraction of a second of listening,
/// not up to an interval later; so is a server registered before it listens.
const RECOVERY_FIRST_PROBE: Duration = Duration::from_millis(250);

/// The wait before the next probe, `refused_in_row` probes having been refused in a row
/// (0: the last was not a refusal), before jitter.
fn next_probe_delay(interval: Duration, refused_in_row: u32) -> Duration {
    match refused_in_row {
        0 => interval,
        n => toolgate_model::backoff::ceiling(RECOVERY_FIRST_PROBE, interval, n - 1),
    }
}

/// A held connection to the instance (see [`crash_watch`]), counted in the gauge while it
/// lives.
struct Watch {
    held: std::pin::Pin<Box<dyn std::future::Future<Output = Ended> + Send>>,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Watch {
    fn new(
        held: impl std::future::Future<Output = Ended> + Send + 'static,
        gauge: &prometheus_client::metrics::gauge::Gauge,
    ) -> Watch {
        gauge.inc();
        Watch {
            held: Box::pin(held),
            gauge: gauge.clone(),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// What ended the wait for the next probe.
enum Due {
    Scheduled,
    /// Failed calls reported by the filters.
    Woken,
    /// The held connection closed and nothing serves at the address.
    Gone,
}

/// Probes one instance at once, then every interval (with ±10% jitter so instances
/// registered together do not probe in lockstep), or sooner when woken by failed calls or
/// when the connection held to it closes with nothing serving behind it.
#[allow(clippy::too_many_arguments)]
async fn probe_loop(
    hub: Hub,
    key: ServiceKey,
    mut prober: Prober,
    wake: Arc<Notify>,
    client: reqwest::Client,
    (slots, watches): (Arc<Semaphore>, Arc<Semaphore>),
    probed: Arc<Notify>,
    (id, sessions): (u64, ProbeSessions),
) {
    let cfg = hub.config.clone();
    let mut delay = Duration::ZERO;
    let mut told_unrouted = false;
    let mut last_probe: Option<Instant> = None;
    let mut watch: Option<Watch> = None;
    // A TCP probe cannot see a server stop answering, so it could not see a held connection
    // block a server that serves one connection at a time: TCP-probed instances are not watched.
    let mut watchable = prober.kind() != toolgate_model::ProbeKind::Tcp;
    let mut refused_in_row: u32 = 0;
    // Nothing listened at the address since the last passing probe (a refused probe, or the
    // crash watch found nothing serving): the next one to pass meets a new process.
    let mut vanished = false;
    let mut passed_before = false;
    loop {
        let due = wait_due(&hub, &key, delay, &wake, &mut watch).await;
        // A storm of failing calls must not turn into a storm of probes. A closed connection
        // is not gapped: it comes once per passing probe at most (below).
        if matches!(due, Due::Woken) {
            if let Some(gap) = last_probe.and_then(|l| WOKEN_PROBE_GAP.checked_sub(l.elapsed())) {
                tokio::time::sleep(gap).await;
            }
        }
        last_probe = Some(Instant::now());
        let queued = Instant::now();
        let Ok(permit) = slots.acquire().await else {
            return;
        };
        hub.metrics
            .probe_wait
            .observe(queued.elapsed().as_secs_f64());
        let mut result = prober.probe(&client, cfg.probe_timeout).await;
        drop(permit);
        vanished |= result.refused || matches!(due, Due::Gone);
        if result.ok {
            result.restarted |= std::mem::take(&mut vanished) && passed_before;
            passed_before = true;
        }
        sessions.set(id, prober.session());
        let label = if result.ok { "pass" } else { "fail" };
        hub.metrics
            .probes
            .get_or_create(&ResultLabel { result: label })
            .inc();
        if result.ok {
            debug!(service = %key.service, instance = %key.instance, detail = %result.detail, "probe passed");
        } else {
            debug!(service = %key.service, instance = %key.instance, detail = %result.detail, "probe failed");
        }
        let (ok, detail) = (result.ok, result.detail.clone());
        refused_in_row = if result.refused {
            refused_in_row.saturating_add(1)
        } else {
            0
        };
        // The whole timeout ran out: the server accepted (the kernel does) but answered nothing.
        let unanswered = !ok && result.latency_ms >= cfg.probe_timeout.as_secs_f64() * 1000.0;
        let applied = hub.update(&key, |h, now, cfg| {
            let t = h.on_probe(result, now, cfg);
            (t, h.state())
        });
        probed.notify_waiters();
        let Some(state) = applied else {
            sessions.release(id);
            return;
        };
        // A server that serves one connection at a time (a blocking server loop) would wait
        // on the held connection for a request that never comes, and answer nobody else: a
        // probe left unanswered while a connection is held lets that server go, and the
        // instance is not watched again while its probe task lives. (A frozen or overloaded
        // server loses its watch too, and falls back to its probes.)
        if unanswered && watch.take().is_some() {
            watchable = false;
            info!(service = %key.service, instance = %key.instance, %detail,
                "a probe went unanswered while a connection was held to the instance: no longer holding one (a server that serves one connection at a time would wait on it); a crash is found by the next probe");
        }
        // Only a server seen alive is watched: its connection closing is news. Not after a
        // probe the watch itself asked for, so a server that flaps between closing and
        // accepting costs one early probe per interval at most.
        if ok && watchable && watch.is_none() && !matches!(due, Due::Gone) {
            if let Ok(permit) = watches.clone().try_acquire_owned() {
                watch = Some(Watch::new(
                    crash_watch::hold(prober.addr(), cfg.probe_timeout, permit),
                    &hub.metrics.probe_watches,
                ));
            }
        }
        // An instance that never passed a probe is never routed; the operator must learn why
        // once, in the probe's words, without waiting for DOWN.
        if !ok && state == State::Unknown && !told_unrouted {
            warn!(service = %key.service, instance = %key.instance, probe = %prober.kind(),
                %detail, "instance not routed: its first probe failed; it stays UNKNOWN until one passes");
            told_unrouted = true;
        }
        let jitter = 0.9 + rand::random::<f64>() * 0.2;
        delay = next_probe_delay(cfg.probe_interval, refused_in_row).mul_f64(jitter);
    }
}

/// Waits until the next probe is due: `delay` passed, failed calls woke the prober, or the
/// held connection closed with nothing serving behind it. A connection the server closed
/// while alive is dropped and the wait goes on (another is opened after the next pass).
async fn wait_due(
    hub: &Hub,
    key: &ServiceKey,
    delay: Duration,
    wake: &Notify,
    watch: &mut Option<Watch>,
) -> Due {
    if delay.is_zero() {
        return Due::Scheduled;
    }
    enum Event {
        Elapsed,
        Woken,
        WatchEnded(Ended),
    }
    let deadline = tokio::time::Instant::now() + delay;
    loop {
        let event = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => Event::Elapsed,
            _ = wake.notified() => Event::Woken,
            end = async {
                match watch.as_mut() {
                    Some(w) => w.held.as_mut().await,
                    None => std::future::pending().await,
                }
            } => Event::WatchEnded(end),
        };
        let end = match event {
            Event::Elapsed => return Due::Scheduled,
            Event::Woken => return Due::Woken,
            Event::WatchEnded(end) => end,
        };
        // A finished future is never polled again.
        *watch = None;
        match end {
            Ended::Gone => {
                count_end(hub, end);
                info!(service = %key.service, instance = %key.instance,
                    "the connection held to the instance closed and nothing serves there now: probing at once");
                return Due::Gone;
            }
            Ended::Closed => {
                count_end(hub, end);
                debug!(service = %key.service, instance = %key.instance,
                    "the connection held to the instance ended; the server still accepts");
            }
            Ended::NotOpened => {
                debug!(service = %key.service, instance = %key.instance,
                    "no connection could be held to the instance; its next probe finds a crash");
            }
        }
    }
}

fn count_end(hub: &Hub, end: Ended) {
    hub.metrics
        .probe_watch_ends
        .get_or_create(&WatchEndLabel { end: end.as_str() })
        .inc();
}

/// Lets the failures reported for UNHEALTHY instances age out of the call window: an
/// instance that gets few calls at its reduced weight must still be able to recover.
async fn age_call_failures(hub: Hub) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let now = Instant::now();
        let mut reg = hub.registry.write().unwrap_or_else(|p| p.into_inner());
        let cfg = hub.config.clone();
        let unhealthy: Vec<ServiceKey> = reg
            .instances()
            .filter(|(_, inst)| inst.health.state() == State::Unhealthy)
            .map(|(key, _)| key.clone())
            .collect();
        let mut moved = Vec::new();
        for key in unhealthy {
            if let Some(t) = reg.health_mut(&key).and_then(|h| h.on_tick(now, &cfg)) {
                moved.push((key, t));
            }
        }
        if moved.is_empty() {
            continue;
        }
        for (key, t) in &moved {
            hub.record(key, t);
        }
        // Asked under the registry's lock, as every traced change does: the snapshot that
        // carries these transitions is the one in their trace.
        let span = tracing::info_span!(target: crate::trace::TARGET, "health.timeouts",
            transitions = moved.len());
        hub.publisher
            .changed_traced(now, crate::trace::TraceParent::of(&span));
        drop(reg);
    }
}

/// Every inspect interval: re-probes instances that look UP without a recent successful
/// signal, and compares the registry with etcd read at the very revision the registry
/// reflects (a difference means a missed event: a full resync follows). Idempotent.
async fn inspect(hub: Hub, etcd: EtcdConfig, resync: Arc<Notify>) {
    let Some(client) = etcd.connect_patiently("inspection").await else {
        return;
    };
    let mut every = tokio::time::interval(hub.config.inspect_interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        every.tick().await;
        let started = Instant::now();
        let stale_after = hub.config.probe_interval * 2 + hub.config.probe_timeout;
        let (revision, ours, prefix, scratch, instances, reprobed) = {
            let reg = hub.registry.read().unwrap_or_else(|p| p.into_inner());
            let mut reprobed = 0;
            if hub.config.probes {
                for (_, inst) in reg.instances() {
                    let recent = inst
                        .health
                        .last_ok()
                        .is_some_and(|t| started.duration_since(t) < stale_after);
                    if inst.health.state() == State::Up && !recent {
                        inst.wake.notify_one();
                        reprobed += 1;
                    }
                }
            }
            (
                reg.revision(),
                reg.fingerprint(),
                reg.layout().prefix().to_string(),
                reg.empty_like(),
                reg.instance_count(),
                reprobed,
            )
        };
        let verdict = if revision <= 0 {
            "skipped (no revision from etcd yet)".to_string()
        } else {
            let read = crate::etcd::read::get_prefix(
                &client,
                &prefix,
                Some(revision),
                etcd.request_timeout,
            )
            .await;
            match read {
                // Compacted past our revision, or etcd away: the watcher handles both.
                Err(e) => format!("skipped ({e})"),
                Ok((kvs, _)) => {
                    let mut fresh = scratch;
                    let kvs = crate::etcd::kv_tuples(&kvs);
                    let read = fresh.reset(kvs, revision);
                    let differing = differing_keys(&ours, &fresh.fingerprint(), &read.rejected);
                    if differing.is_empty() {
                        format!("registry matches etcd at revision {revision}")
                    } else {
                        let differing: Vec<&str> =
                            differing.iter().take(5).map(String::as_str).collect();
                        hub.metrics.reconcile_mismatches.inc();
                        error!(
                            revision,
                            ?differing,
                            "the registry differs from etcd; resyncing in full"
                        );
                        resync.notify_one();
                        format!(
                            "registry differed from etcd at revision {revision}; resync requested"
                        )
                    }
                }
            }
        };
        hub.metrics.inspections.inc();
        info!(
            instances,
            reprobed,
            took_ms = started.elapsed().as_millis() as u64,
            "inspection: {verdict}"
        );
    }
}

/// The keys whose value or lease differs between the registry and a fresh read of etcd,
/// sorted. Keys whose value in etcd is not admitted are left out: the registry refused the
/// same value when the watch brought it and kept the key's last good value (or has none),
/// which is no sign of a missed event.
fn differing_keys(
    ours: &[(String, String, i64)],
    theirs: &[(String, String, i64)],
    rejected: &[Rejected],
) -> Vec<String> {
    let refused: HashSet<&str> = rejected.iter().map(|r| r.key.as_str()).collect();
    let admitted = |entries: &'_ [(String, String, i64)]| -> HashSet<(String, String, i64)> {
        entries
            .iter()
            .filter(|(k, _, _)| !refused.contains(k.as_str()))
            .cloned()
            .collect()
    };
    let (a, b) = (admitted(ours), admitted(theirs));
    a.symmetric_difference(&b)
        .map(|(k, _, _)| k.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, value: &str, lease: i64) -> (String, String, i64) {
        (key.to_string(), value.to_string(), lease)
    }

    fn refused(key: &str) -> Rejected {
        Rejected {
            key: key.to_string(),
            reason: "refused_endpoint",
            detail: String::new(),
        }
    }

    #[test]
    fn refused_probes_come_back_sooner_doubling_up_to_the_interval() {
        let ms = Duration::from_millis;
        let interval = Duration::from_secs(2);
        let delays: Vec<Duration> = (0..6).map(|n| next_probe_delay(interval, n)).collect();
        assert_eq!(
            delays,
            [ms(2000), ms(250), ms(500), ms(1000), ms(2000), ms(2000)]
        );
        // Never beyond the interval, never overflowing however long the refusals go on.
        assert_eq!(next_probe_delay(ms(100), 1), ms(100));
        assert_eq!(
            next_probe_delay(Duration::from_secs(30), u32::MAX),
            Duration::from_secs(30)
        );
        assert_eq!(next_probe_delay(Duration::from_secs(30), 7), ms(16_000));
    }

    #[test]
    fn a_refused_value_is_not_a_difference_but_a_missed_event_is() {
        let ours = vec![
            entry("/mcp/services/a/1", "v1", 7),
            entry("/mcp/services/a/2", "v2", 7),
        ];
        // a/2 turned invalid in etcd (the registry kept its last good value); a/3 is refused.
        let theirs = vec![entry("/mcp/services/a/1", "v1", 7)];
        let rejected = [refused("/mcp/services/a/2"), refused("/mcp/services/a/3")];
        assert!(differing_keys(&ours, &theirs, &rejected).is_empty());
        // A changed lease or value, or a key only one side has, is a missed event.
        let theirs = vec![
            entry("/mcp/services/a/1", "v1", 8),
            entry("/mcp/services/b/1", "w", 0),
        ];
        assert_eq!(
            differing_keys(&ours, &theirs, &rejected),
            ["/mcp/services/a/1", "/mcp/services/b/1"]
        );
    }
}
