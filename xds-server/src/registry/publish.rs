//! Hands each new state of the registry to its readers: the xDS side (a routing snapshot on a
//! `watch` channel) and the state-dir writer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{debug, warn};

use super::persist::{self, PersistedRegistry};
use super::Registry;
use crate::metrics::Metrics;
use crate::routing::RoutingSnapshot;

pub struct Publisher {
    routing: watch::Sender<Arc<RoutingSnapshot>>,
    persist: watch::Sender<Option<PersistedRegistry>>,
    generation: u64,
    metrics: Arc<Metrics>,
}

impl Publisher {
    /// Returns the publisher and the receiver the xDS server reads. Until the first
    /// [`publish`](Self::publish) the snapshot has generation 0: not ready, nothing is served.
    pub fn new(
        metrics: Arc<Metrics>,
        state_dir: Option<PathBuf>,
    ) -> (Publisher, watch::Receiver<Arc<RoutingSnapshot>>) {
        let (routing, rx) = watch::channel(Arc::new(RoutingSnapshot::empty()));
        let (persist, persist_rx) = watch::channel(None);
        if let Some(dir) = state_dir {
            tokio::spawn(write_state(dir, persist_rx));
        }
        (
            Publisher {
                routing,
                persist,
                generation: 0,
                metrics,
            },
            rx,
        )
    }

    /// Publishes the registry as it is now. `changed_at` is when the first etcd event folded
    /// into this state arrived.
    pub fn publish(&mut self, registry: &Registry, changed_at: Instant) {
        self.generation += 1;
        let snapshot = registry.routing(self.generation, changed_at);
        self.metrics
            .registered_instances
            .set(registry.instance_count() as i64);
        self.routing.send_replace(Arc::new(snapshot));
        self.persist.send_replace(Some(PersistedRegistry {
            revision: registry.revision(),
            values: registry.raw_values(),
        }));
        debug!(
            generation = self.generation,
            revision = registry.revision(),
            "published"
        );
    }

    pub fn is_ready(&self) -> bool {
        self.generation > 0
    }
}

/// Writes the latest state at most every 250 ms, off the push path: a burst of changes costs
/// one write, and a slow disk never delays Envoy.
async fn write_state(dir: PathBuf, mut rx: watch::Receiver<Option<PersistedRegistry>>) {
    while rx.changed().await.is_ok() {
        let state = rx.borrow_and_update().clone();
        if let Some(state) = state {
            let dir2 = dir.clone();
            let res = tokio::task::spawn_blocking(move || persist::save(&dir2, &state)).await;
            match res {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(dir = %dir.display(), error = %e, "writing the state snapshot failed")
                }
                Err(e) => warn!(error = %e, "state writer task failed"),
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
