//! Keeps the registry equal to etcd: Get once, Watch from `revision + 1`, resume from the last
//! applied revision after a break, full resync after a compaction, and while etcd is away keep
//! the last state (never an empty table).

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, WatchOptions, WatchResponse};
use futures::FutureExt;
use tokio::sync::Notify;
use toolgate_model::Backoff;
use tracing::{debug, error, info, warn};

use super::{EtcdConfig, EtcdStatus};
use crate::metrics::{Metrics, ReasonLabel};
use crate::registry::persist::PersistedRegistry;
use crate::registry::publish::Publisher;
use crate::registry::{Registry, Rejected, Reset};

pub struct Watcher {
    pub config: EtcdConfig,
    pub registry: Arc<RwLock<Registry>>,
    pub publisher: Publisher,
    pub metrics: Arc<Metrics>,
    pub status: Arc<EtcdStatus>,
    /// Notified by the inspection when the registry differs from etcd.
    pub resync: Arc<Notify>,
    /// Notified after every applied probe: the cold-start warm-up waits on it.
    pub probed: Arc<Notify>,
}

enum Next {
    FullSync,
    /// Watch from the revision after `revision`; `resumed` when a watch broke before.
    Watch {
        revision: i64,
        resumed: bool,
    },
}

enum WatchEnd {
    Compacted { compact_revision: i64 },
    Broken { reason: String },
    ResyncRequested,
}

impl Watcher {
    /// Loads a state-dir snapshot and publishes it, for a start while etcd is unreachable.
    pub async fn serve_persisted(&mut self, state: &PersistedRegistry) {
        let started = Instant::now();
        let read = {
            let mut reg = self.registry.write().unwrap_or_else(|p| p.into_inner());
            reg.reset(
                state.values.iter().map(|(k, v)| {
                    let created = state.created.get(k).copied().unwrap_or(0);
                    (k.as_str(), v.as_bytes(), 0, created, 0)
                }),
                state.revision,
            )
        };
        self.warm_up().await;
        self.publish(started);
        self.count_read(&read);
    }

    fn publish(&self, changed_at: Instant) {
        self.publisher.publish(changed_at);
    }

    /// Whether publishing has begun (a first table went out).
    fn is_ready(&self) -> bool {
        self.publisher.is_started()
    }

    /// Before the first publish, gives every instance one probe (bounded by the probe
    /// timeout): UNKNOWN instances are not routed, and serving a table that is empty only
    /// because nothing was probed yet would cut Envoy off from working servers. Later resyncs
    /// keep their instances' states and do not wait.
    async fn warm_up(&self) {
        if self.is_ready() {
            return;
        }
        let limit = {
            let reg = self.registry.read().unwrap_or_else(|p| p.into_inner());
            if !reg.health_config().probes {
                return;
            }
            reg.health_config().probe_timeout + Duration::from_millis(250)
        };
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let probed = self.probed.notified();
            let unknown = self
                .registry
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .unknown_count();
            if unknown == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, probed).await.is_err() {
                warn!(
                    unknown,
                    "first probes not finished in time; serving without those instances"
                );
                return;
            }
        }
    }

    /// Runs until the process ends. If etcd cannot be read within `startup_wait` and a
    /// state-dir snapshot was found, that snapshot is served until etcd answers.
    pub async fn run(mut self, mut persisted: Option<PersistedRegistry>, startup_wait: Duration) {
        let started = Instant::now();
        // Made on the first full sync: with etcd authentication, connecting logs in, which
        // needs etcd up, and the state-dir snapshot must be served meanwhile.
        let mut client: Option<Client> = None;
        // Logged when it changes: a refused login repeats every retry.
        let mut last_connect_error = String::new();
        // Capped at 2 s: the registry follows etcd again at most ~2 s after it is back, and a
        // retry costs etcd one connection and one watch request per gateway.
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut next = Next::FullSync;
        loop {
            next = match next {
                Next::FullSync => {
                    // Why there is no client yet: a refused login must reach the log and the
                    // status, not only "unreachable".
                    let mut no_client = String::new();
                    if client.is_none() {
                        match self.config.connect().await {
                            Ok(c) => {
                                self.metrics.etcd_clients.inc();
                                client = Some(c);
                            }
                            Err(e) if EtcdConfig::is_malformed(&e) => {
                                error!(error = %e, endpoints = ?self.config.endpoints,
                                    "cannot use the etcd endpoints");
                                return;
                            }
                            Err(e) => {
                                no_client = format!("connecting to etcd failed: {e}");
                                if no_client != last_connect_error {
                                    error!(error = %e, endpoints = ?self.config.endpoints,
                                        "cannot connect to etcd (or log in); retrying");
                                    last_connect_error.clone_from(&no_client);
                                }
                            }
                        }
                    }
                    let synced = match &client {
                        Some(c) => self.full_sync(c).await,
                        None => Err(no_client),
                    };
                    match synced {
                        Ok(revision) => Next::Watch {
                            revision,
                            resumed: false,
                        },
                        Err(reason) => {
                            // A fresh client for the next attempt, as after a broken watch
                            // (see there): a kept one repeats its last connect error.
                            client = None;
                            self.mark_down(&reason);
                            if !self.is_ready() && started.elapsed() >= startup_wait {
                                if let Some(state) = persisted.take() {
                                    warn!(revision = state.revision, instances = state.values.len(),
                                        "etcd unreachable at start; serving the state-dir snapshot until it answers");
                                    self.serve_persisted(&state).await;
                                }
                            }
                            tokio::time::sleep(backoff.next_delay(rand::random())).await;
                            Next::FullSync
                        }
                    }
                }
                Next::Watch { revision, resumed } => {
                    let mut no_client = String::new();
                    if client.is_none() {
                        match self.config.connect().await {
                            Ok(c) => {
                                self.metrics.etcd_clients.inc();
                                client = Some(c);
                            }
                            Err(e) => no_client = format!("connecting to etcd failed: {e}"),
                        }
                    }
                    let end = match &client {
                        Some(c) => self.watch_from(c, revision, resumed, &mut backoff).await,
                        None => WatchEnd::Broken { reason: no_client },
                    };
                    match end {
                        WatchEnd::Compacted { compact_revision } => {
                            self.metrics.full_resyncs.inc();
                            warn!(
                                revision,
                                compact_revision,
                                "etcd compacted past the last applied revision; resyncing in full"
                            );
                            Next::FullSync
                        }
                        WatchEnd::ResyncRequested => {
                            self.metrics.full_resyncs.inc();
                            Next::FullSync
                        }
                        WatchEnd::Broken { reason } => {
                            // A fresh connection for the next attempt: the balanced channel keeps
                            // each endpoint's last connect error and hands it to the next call
                            // that picks the endpoint, even after etcd is back, so a kept client
                            // fails once per endpoint after a partition and every failure costs
                            // a backoff delay (the chaos run measured 9 s to resume).
                            client = None;
                            self.mark_down(&reason);
                            tokio::time::sleep(backoff.next_delay(rand::random())).await;
                            let revision = self
                                .registry
                                .read()
                                .unwrap_or_else(|p| p.into_inner())
                                .revision();
                            Next::Watch {
                                revision,
                                resumed: true,
                            }
                        }
                    }
                }
            };
        }
    }

    /// Get of the whole prefix; replaces the registry and publishes. Returns the revision.
    async fn full_sync(&mut self, client: &Client) -> Result<i64, String> {
        let prefix = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .layout()
            .prefix()
            .to_string();
        let started = Instant::now();
        let (kvs, revision) =
            super::read::get_prefix(client, &prefix, None, self.config.request_timeout).await?;
        let (read, instances) = {
            let mut reg = self.registry.write().unwrap_or_else(|p| p.into_inner());
            let kvs = crate::etcd::kv_tuples(&kvs);
            (reg.reset(kvs, revision), reg.instance_count())
        };
        self.warm_up().await;
        self.publish(started);
        info!(
            revision,
            instances,
            took_ms = started.elapsed().as_millis() as u64,
            "read the registry from etcd"
        );
        self.count_read(&read);
        self.mark_up();
        Ok(revision)
    }

    /// Watches from `revision + 1` until the watch breaks or is compacted away.
    async fn watch_from(
        &mut self,
        client: &Client,
        revision: i64,
        mut resumed: bool,
        backoff: &mut Backoff,
    ) -> WatchEnd {
        let prefix = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .layout()
            .prefix()
            .to_string();
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
            .with_prev_key()
            .with_progress_notify();
        // One revision can delete a great many keys (a lease of many registrations revoked):
        // its events come in one message, far above tonic's 4 MiB default.
        let mut watch_client = client
            .watch_client()
            .max_decoding_message_size(super::read::MAX_WATCH_MESSAGE_BYTES);
        let mut stream = match tokio::time::timeout(
            self.config.request_timeout,
            watch_client.watch(prefix.as_str(), Some(opts)),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return WatchEnd::Broken {
                    reason: format!("creating the watch failed: {e}"),
                }
            }
            Err(_) => {
                return WatchEnd::Broken {
                    reason: "creating the watch timed out".into(),
                }
            }
        };
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = self.resync.notified() => return WatchEnd::ResyncRequested,
            };
            let first = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => {
                    return WatchEnd::Broken {
                        reason: "etcd closed the watch stream".into(),
                    }
                }
                Err(e) => {
                    return WatchEnd::Broken {
                        reason: format!("the watch stream failed: {e}"),
                    }
                }
            };
            let arrived = Instant::now();
            if first.canceled() {
                if first.compact_revision() > 0 {
                    return WatchEnd::Compacted {
                        compact_revision: first.compact_revision(),
                    };
                }
                return WatchEnd::Broken {
                    reason: format!("etcd canceled the watch: {}", first.cancel_reason()),
                };
            }
            if first.created() {
                if resumed {
                    self.metrics.watch_resumes.inc();
                    info!(
                        from_revision = revision + 1,
                        "watch resumed from the last applied revision"
                    );
                    resumed = false;
                }
                self.mark_up();
                backoff.reset();
            }
            // Fold every response that is already waiting into one publish: a burst of
            // registrations becomes one push, a single change goes out at once.
            let mut batch = vec![first];
            let broken = drain_ready(
                &mut batch,
                |r| r.canceled(),
                || stream.message().now_or_never(),
            );
            let mut changed = false;
            let mut rejected = Vec::new();
            {
                let events: usize = batch.iter().map(|r| r.events().len()).sum();
                let span = tracing::info_span!(target: crate::trace::TARGET, "etcd.event",
                    events, revision = tracing::field::Empty);
                let _in_span = span.enter();
                let mut reg = self.registry.write().unwrap_or_else(|p| p.into_inner());
                for resp in &batch {
                    if resp.canceled() {
                        continue;
                    }
                    changed |= apply(&mut reg, resp, &self.metrics, &mut rejected);
                }
                if changed {
                    span.record("revision", reg.revision());
                    self.publisher
                        .publish_traced(arrived, crate::trace::TraceParent::of(&span));
                }
            }
            self.count_rejected(&rejected);
            if let Some(reason) = broken {
                return WatchEnd::Broken { reason };
            }
            if let Some(last) = batch.last().filter(|r| r.canceled()) {
                if last.compact_revision() > 0 {
                    return WatchEnd::Compacted {
                        compact_revision: last.compact_revision(),
                    };
                }
                return WatchEnd::Broken {
                    reason: format!("etcd canceled the watch: {}", last.cancel_reason()),
                };
            }
        }
    }

    fn mark_up(&self) {
        self.metrics.etcd_up.set(1);
        if self.status.set(true) {
            info!("etcd reachable; the registry follows it again");
        }
    }

    /// Logs once per outage, not once per retry.
    fn mark_down(&self, reason: &str) {
        self.metrics.etcd_up.set(0);
        if self.status.set(false) {
            error!(
                reason,
                "etcd unreachable; serving the last known endpoints and retrying with backoff"
            );
        } else {
            debug!(reason, "etcd still unreachable");
        }
    }

    /// Counts and logs what a full read did not take.
    fn count_read(&self, read: &Reset) {
        self.count_rejected(&read.rejected);
        for key in &read.kept {
            warn!(%key, "kept the last good value of a key whose value (or delete) in etcd is refused");
        }
        self.metrics.kept_last_good.inc_by(read.kept.len() as u64);
    }

    fn count_rejected(&self, rejected: &[Rejected]) {
        for r in rejected {
            warn!(key = %r.key, reason = r.reason, detail = %r.detail, "ignored an invalid value from etcd");
            self.metrics
                .invalid_values
                .get_or_create(&ReasonLabel { reason: r.reason })
                .inc();
        }
    }
}

/// Appends to `batch` every response `next` has ready without waiting (`None`: nothing
/// ready), stopping after a cancellation. Returns why the stream broke, if it did: the
/// responses before a failure are good and are applied, and the watch then ends with the
/// failure's own reason (a stream that failed once is not read again).
fn drain_ready<T, E: std::fmt::Display>(
    batch: &mut Vec<T>,
    is_canceled: impl Fn(&T) -> bool,
    mut next: impl FnMut() -> Option<Result<Option<T>, E>>,
) -> Option<String> {
    loop {
        match next() {
            None => return None,
            Some(Ok(Some(more))) => {
                let stop = is_canceled(&more);
                batch.push(more);
                if stop {
                    return None;
                }
            }
            Some(Ok(None)) => return Some("etcd closed the watch stream".into()),
            Some(Err(e)) => return Some(format!("the watch stream failed: {e}")),
        }
    }
}

/// Applies one watch response; returns whether the routing changed. Progress notifications
/// (no events) only move the revision: they are not data.
fn apply(
    reg: &mut Registry,
    resp: &WatchResponse,
    metrics: &Metrics,
    rejected: &mut Vec<Rejected>,
) -> bool {
    let mut changed = false;
    for event in resp.events() {
        let Some(kv) = event.kv() else { continue };
        let key = String::from_utf8_lossy(kv.key());
        metrics.watch_events.inc();
        match event.event_type() {
            EventType::Put => match reg.put(
                &key,
                kv.value(),
                kv.lease(),
                kv.create_revision(),
                kv.mod_revision(),
            ) {
                Ok(c) => changed |= c,
                Err(r) => rejected.push(r),
            },
            EventType::Delete => match reg.delete(&key) {
                Ok(c) => changed |= c,
                Err(r) => rejected.push(r),
            },
        }
    }
    // A catching-up watcher may get its history in chunks whose header revision is already
    // the store's current one: only the events themselves say how far we really are. A
    // progress notification is sent to synced watchers only, so its header is safe to take.
    match resp
        .events()
        .iter()
        .filter_map(|e| e.kv())
        .map(|kv| kv.mod_revision())
        .max()
    {
        Some(rev) => reg.set_revision(rev),
        // The creation response's header is the store's revision, not how far we are.
        None if !resp.created() => {
            if let Some(h) = resp.header() {
                reg.set_revision(h.revision());
            }
        }
        None => {}
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `drain_ready` from a script: `Some(r)` is ready with `r`, `None` is nothing ready.
    fn drain(script: Vec<Option<Result<Option<i32>, &'static str>>>) -> (Vec<i32>, Option<String>) {
        let mut script = script.into_iter();
        let mut batch = vec![0];
        let broken = drain_ready(&mut batch, |r| *r < 0, || script.next().flatten());
        (batch, broken)
    }

    #[test]
    fn a_drain_takes_what_is_ready_and_stops_at_a_cancellation() {
        assert_eq!(
            drain(vec![
                Some(Ok(Some(1))),
                Some(Ok(Some(2))),
                None,
                Some(Ok(Some(3)))
            ]),
            (vec![0, 1, 2], None)
        );
        assert_eq!(
            drain(vec![
                Some(Ok(Some(1))),
                Some(Ok(Some(-1))),
                Some(Ok(Some(3)))
            ]),
            (vec![0, 1, -1], None)
        );
    }

    #[test]
    fn an_error_in_the_middle_of_a_batch_ends_the_watch_with_its_reason() {
        let (batch, broken) = drain(vec![
            Some(Ok(Some(1))),
            Some(Err("connection reset")),
            Some(Ok(Some(3))),
        ]);
        assert_eq!(batch, vec![0, 1], "what came before the error is applied");
        let reason = broken.expect("the error is not dropped");
        assert!(reason.contains("connection reset"), "{reason}");
    }

    #[test]
    fn the_end_of_the_stream_in_the_middle_of_a_batch_ends_the_watch() {
        let (batch, broken) = drain(vec![Some(Ok(Some(1))), Some(Ok(None))]);
        assert_eq!(batch, vec![0, 1]);
        assert!(broken.is_some_and(|r| r.contains("closed")));
    }
}
