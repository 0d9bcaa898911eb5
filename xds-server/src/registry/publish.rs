//! Hands each new state of the registry to its readers: the xDS side (a routing snapshot on a
//! `watch` channel) and the state-dir writer.
//!
//! Building a snapshot costs time in proportion to the services that changed (the route map
//! is persistent: the snapshot shares it), and it is still not done once per change: changes only ask for a
//! publish, and one task builds the latest state each time it gets to it. A single change still goes out at once; under churn (hundreds of changes a
//! second over 10,000 instances) the changes that arrive during one build share the next one,
//! so latency stays at about two builds instead of growing with a backlog.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};
use tracing::{debug, warn};

use super::persist::{self, PersistedRegistry};
use super::Registry;
use crate::metrics::Metrics;
use crate::routing::{Cause, RoutingSnapshot};
use crate::trace::TraceParent;
use toolgate_model::ServiceKey;

/// A handle that asks for a publish; cheap to clone and to call under any lock.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

struct Inner {
    wake: Notify,
    /// When the oldest change not yet published arrived, and its trace.
    pending: Mutex<Option<(Instant, TraceParent)>>,
    /// Publishing has begun (the first full read, or the state-dir snapshot, is in).
    started: AtomicBool,
    generation: AtomicU64,
}

impl Publisher {
    /// Starts the publishing task; returns the handle and the receiver the xDS server reads.
    /// Until the first [`publish`](Self::publish) the snapshot has generation 0: not ready,
    /// nothing is served.
    pub fn new(
        registry: Arc<RwLock<Registry>>,
        metrics: Arc<Metrics>,
        state_dir: Option<PathBuf>,
    ) -> (Publisher, watch::Receiver<Arc<RoutingSnapshot>>) {
        let (routing, rx) = watch::channel(Arc::new(RoutingSnapshot::empty()));
        let inner = Arc::new(Inner {
            wake: Notify::new(),
            pending: Mutex::new(None),
            started: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        });
        let persist = state_dir.map(|dir| {
            let wake = Arc::new(Notify::new());
            tokio::spawn(write_state(dir, registry.clone(), wake.clone()));
            wake
        });
        tokio::spawn(run(inner.clone(), registry, metrics, routing, persist));
        (Publisher { inner }, rx)
    }

    /// Publishes the registry as it is when the task gets to it, and from now on every
    /// [`changed`](Self::changed). `changed_at` is when the first etcd event folded into this
    /// state arrived.
    pub fn publish(&self, changed_at: Instant) {
        self.publish_traced(changed_at, TraceParent::default());
    }

    /// [`publish`](Self::publish) for a change with a trace (an etcd event's span): the
    /// snapshot and its pushes become its children.
    pub fn publish_traced(&self, changed_at: Instant, trace: TraceParent) {
        self.inner.started.store(true, Ordering::Release);
        self.request(changed_at, trace);
    }

    /// Asks for a publish once publishing has begun (before that, the first
    /// [`publish`](Self::publish) will carry the change anyway).
    pub fn changed(&self, changed_at: Instant) {
        self.changed_traced(changed_at, TraceParent::default());
    }

    /// [`changed`](Self::changed) for a change with a trace (a health transition's span).
    pub fn changed_traced(&self, changed_at: Instant, trace: TraceParent) {
        if self.is_started() {
            self.request(changed_at, trace);
        }
    }

    fn request(&self, changed_at: Instant, trace: TraceParent) {
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            // The earliest change, and its trace, speak for the snapshot.
            let keep_old = pending.as_ref().is_some_and(|(at, _)| *at <= changed_at);
            if !keep_old {
                *pending = Some((changed_at, trace));
            }
        }
        self.inner.wake.notify_one();
    }

    /// Whether publishing has begun.
    pub fn is_started(&self) -> bool {
        self.inner.started.load(Ordering::Acquire)
    }

    /// Writes the state snapshot now, for a stop: the periodic writer can be up to 250 ms
    /// behind, and a restart must find the last change. Nothing is written before publishing
    /// began, so a registry not read yet never replaces a good snapshot. Returns whether it
    /// wrote.
    pub fn flush_state(&self, dir: &Path, registry: &RwLock<Registry>) -> std::io::Result<bool> {
        if !self.is_started() {
            return Ok(false);
        }
        save_state(dir, registry).map(|()| true)
    }
}

/// One writer at a time, each reading the registry under the lock: a slower writer holding an
/// older state can never rename it over a newer one.
static WRITING: Mutex<()> = Mutex::new(());

fn save_state(dir: &Path, registry: &RwLock<Registry>) -> std::io::Result<()> {
    let _writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    let mut state = {
        let reg = registry.read().unwrap_or_else(|p| p.into_inner());
        PersistedRegistry {
            revision: reg.revision(),
            values: reg.raw_values_but_instances(),
            created: BTreeMap::new(),
        }
    };
    // The instances in chunks: one copy of 100,000 under the read lock kept the publisher
    // (which takes the write lock) waiting for tens of milliseconds every write. A change
    // between chunks makes the file a mix of a few milliseconds' states, all newer than its
    // revision; it is only served while etcd is unreachable at start, and replaced by a full
    // read as soon as etcd answers.
    let mut after: Option<ServiceKey> = None;
    loop {
        let (chunk, last) = registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .raw_instances(after.as_ref(), STATE_CHUNK);
        let done = chunk.len() < STATE_CHUNK;
        after = last;
        for (key, value, created) in chunk {
            state.created.insert(key.clone(), created);
            state.values.push((key, value));
        }
        if done || after.is_none() {
            break;
        }
    }
    persist::save(dir, &state)
}

/// Instances copied per hold of the registry's read lock when the state is written.
const STATE_CHUNK: usize = 1_000;

async fn run(
    inner: Arc<Inner>,
    registry: Arc<RwLock<Registry>>,
    metrics: Arc<Metrics>,
    routing: watch::Sender<Arc<RoutingSnapshot>>,
    persist: Option<Arc<Notify>>,
) {
    let mut recent = VecDeque::with_capacity(RoutingSnapshot::RECENT_KEPT);
    loop {
        inner.wake.notified().await;
        let Some((changed_at, trace)) = inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            continue;
        };
        let generation = inner.generation.load(Ordering::Acquire) + 1;
        let span = tracing::info_span!(target: crate::trace::TARGET, "xds.publish", generation);
        trace.adopt(&span);
        let _in_span = span.enter();
        let woke_after = changed_at.elapsed();
        let (mut snapshot, instances, revision) = {
            // Write: the registry keeps the routes it builds for the next publish.
            let mut reg = registry.write().unwrap_or_else(|p| p.into_inner());
            (
                reg.routing(generation, changed_at),
                reg.instance_count(),
                reg.revision(),
            )
        };
        metrics.registered_instances.set(instances as i64);
        if recent.len() == RoutingSnapshot::RECENT_KEPT {
            recent.pop_front();
        }
        recent.push_back(Cause {
            generation,
            changed_at: snapshot.changed_at,
            trace: trace.clone(),
        });
        snapshot.recent = recent.iter().cloned().collect();
        snapshot.trace = trace;
        routing.send_replace(Arc::new(snapshot));
        inner.generation.store(generation, Ordering::Release);
        if let Some(p) = &persist {
            p.notify_one();
        }
        // Where a change's time went before it reached the xDS side: waiting for this task,
        // or building the snapshot.
        debug!(
            generation,
            revision,
            woke_after_ms = format_args!("{:.2}", woke_after.as_secs_f64() * 1e3),
            since_change_ms = format_args!("{:.2}", changed_at.elapsed().as_secs_f64() * 1e3),
            "published"
        );
    }
}

/// The pause after a state write, as a multiple of how long it took: a write of 100,000
/// registrations takes about a tenth of a second, and writing it every 250 ms under churn took
/// a sixth of a core (and held the registry's read lock against the publisher).
const WRITE_PAUSE_FACTOR: u32 = 20;

/// Writes the registry at most every 250 ms (longer for a large registry: twenty times as
/// long as the last write took), off the push path: a burst of changes costs one write, and a
/// slow disk never delays Envoy.
async fn write_state(dir: PathBuf, registry: Arc<RwLock<Registry>>, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        let (dir2, registry2) = (dir.clone(), registry.clone());
        let started = Instant::now();
        match tokio::task::spawn_blocking(move || save_state(&dir2, &registry2)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(dir = %dir.display(), error = %e, "writing the state snapshot failed")
            }
            Err(e) => warn!(error = %e, "state writer task failed"),
        }
        let pause = (started.elapsed() * WRITE_PAUSE_FACTOR).max(Duration::from_millis(250));
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::{instance, reg};

    #[test]
    fn the_state_written_in_chunks_is_the_whole_registry() {
        let mut r = reg();
        // Two and a half chunks, in services whose keys interleave with the chunk ends.
        for i in 0..(STATE_CHUNK * 5 / 2) {
            let key = format!("/mcp/services/s{}/i-{i}", i % 7);
            let port = 1000 + (i % 60_000) as u16;
            r.put(
                &key,
                &instance(&format!("i-{i}"), port, &["t"]),
                1,
                i as i64 + 1,
                i as i64 + 1,
            )
            .expect("a valid instance");
        }
        r.put(
            "/mcp/virtual/default",
            br#"{"naming":"bare"}"#,
            0,
            9_999,
            9_999,
        )
        .expect("a valid virtual server");
        let (mut expected, created) = (r.raw_values(), r.create_revisions());
        let dir = std::env::temp_dir().join(format!("toolgate-chunks-{}", std::process::id()));
        save_state(&dir, &RwLock::new(r)).expect("written");
        let mut saved = persist::load(&dir).expect("read back");
        let _ = std::fs::remove_dir_all(&dir);
        expected.sort();
        saved.values.sort();
        assert_eq!(saved.values.len(), STATE_CHUNK * 5 / 2 + 1);
        assert_eq!(saved.values, expected);
        assert_eq!(saved.created, created);
    }
}
