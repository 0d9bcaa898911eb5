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
    /// The changes not yet published.
    pending: Mutex<Option<Pending>>,
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
    /// snapshot and its pushes become its children. Call it while still holding the registry's
    /// write lock the change was made under, so the snapshot that first carries the change is
    /// the one in its trace.
    pub fn publish_traced(&self, changed_at: Instant, trace: TraceParent) {
        self.inner.started.store(true, Ordering::Release);
        self.request(changed_at, trace);
    }

    /// Asks for a publish once publishing has begun (before that, the first
    /// [`publish`](Self::publish) will carry the change anyway).
    pub fn changed(&self, changed_at: Instant) {
        self.changed_traced(changed_at, TraceParent::default());
    }

    /// [`changed`](Self::changed) for a change with a trace (a health transition's span),
    /// under the registry's write lock as for [`publish_traced`](Self::publish_traced).
    pub fn changed_traced(&self, changed_at: Instant, trace: TraceParent) {
        if self.is_started() {
            self.request(changed_at, trace);
        }
    }

    fn request(&self, changed_at: Instant, trace: TraceParent) {
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending
                .get_or_insert_with(|| Pending {
                    changed_at,
                    traces: Vec::new(),
                })
                .fold(changed_at, trace);
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

/// The changes that ask for the next snapshot.
struct Pending {
    /// When the oldest arrived: the snapshot's latency is measured from it.
    changed_at: Instant,
    /// Their traces, the oldest's first. Each gets the snapshot's publish and pushes as
    /// children: a health verdict that arrives while an etcd event's snapshot is pending is
    /// still seen reaching Envoy in its own trace.
    traces: Vec<TraceParent>,
}

/// The traces one snapshot keeps. Under churn hundreds of changes fold into one snapshot;
/// beyond this many, the later ones are not traced (each costs a span per Envoy and type).
const TRACES_PER_SNAPSHOT: usize = 16;

impl Pending {
    fn fold(&mut self, changed_at: Instant, trace: TraceParent) {
        let earliest = changed_at < self.changed_at;
        if earliest {
            self.changed_at = changed_at;
        }
        if !trace.is_some() {
            return;
        }
        if earliest {
            self.traces.insert(0, trace);
            self.traces.truncate(TRACES_PER_SNAPSHOT);
        } else if self.traces.len() < TRACES_PER_SNAPSHOT {
            self.traces.push(trace);
        }
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
        let nothing_pending = inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none();
        if nothing_pending {
            continue;
        }
        // Write: the registry keeps the routes it builds for the next publish.
        let mut reg = registry.write().unwrap_or_else(|p| p.into_inner());
        // Taken under the registry's lock, which every traced change still holds when it asks
        // for a publish: the changes this state holds are exactly the ones taken, so a change
        // is never carried by a snapshot that bears another's trace.
        let Some(Pending { changed_at, traces }) = inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            continue;
        };
        let generation = inner.generation.load(Ordering::Acquire) + 1;
        // One publish span in each trace folded in, all open while the snapshot is built.
        let spans: Vec<tracing::Span> = traces
            .iter()
            .map(|trace| {
                let span =
                    tracing::info_span!(target: crate::trace::TARGET, "xds.publish", generation);
                trace.adopt(&span);
                span
            })
            .collect();
        let _in_span = spans.first().map(|span| span.enter());
        let traces: Arc<[TraceParent]> = traces.into();
        let woke_after = changed_at.elapsed();
        let (mut snapshot, instances, revision) = (
            reg.routing(generation, changed_at),
            reg.instance_count(),
            reg.revision(),
        );
        drop(reg);
        metrics.registered_instances.set(instances as i64);
        if recent.len() == RoutingSnapshot::RECENT_KEPT {
            recent.pop_front();
        }
        recent.push_back(Cause {
            generation,
            changed_at: snapshot.changed_at,
            traces: traces.clone(),
        });
        snapshot.recent = recent.iter().cloned().collect();
        snapshot.traces = traces;
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
    fn every_traced_change_folded_into_a_snapshot_keeps_its_trace_the_oldest_first() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // An etcd event, then a health verdict while its snapshot is pending: both traces.
        let mut pending = Pending {
            changed_at: at(10),
            traces: vec![TraceParent::labelled(1)],
        };
        pending.fold(at(12), TraceParent::labelled(2));
        // A change without a trace (no exporter) dates the snapshot but adds none.
        pending.fold(at(5), TraceParent::default());
        assert_eq!(pending.changed_at, at(5));
        let labels = |p: &Pending| p.traces.iter().map(|t| t.label()).collect::<Vec<_>>();
        assert_eq!(labels(&pending), [Some(1), Some(2)]);
        // A change dated earlier than all (a caller's own arrival time) goes first.
        pending.fold(at(1), TraceParent::labelled(3));
        assert_eq!(pending.changed_at, at(1));
        assert_eq!(labels(&pending), [Some(3), Some(1), Some(2)]);
        // Under churn the count is bounded: later ones go untraced, an earlier one still leads.
        for i in 0..100 {
            pending.fold(at(20 + i), TraceParent::labelled(100 + i as u32));
        }
        assert_eq!(pending.traces.len(), TRACES_PER_SNAPSHOT);
        assert_eq!(pending.changed_at, at(1));
        pending.fold(at(0), TraceParent::labelled(4));
        assert_eq!(pending.traces.len(), TRACES_PER_SNAPSHOT);
        assert_eq!(labels(&pending)[..3], [Some(4), Some(3), Some(1)]);
    }

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
