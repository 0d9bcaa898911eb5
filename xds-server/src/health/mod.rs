//! Instance health beyond the lease: active probes, call-failure feedback from the filters,
//! heartbeat loss read from the leases, and a periodic inspection, folded into one state
//! machine per instance ([`machine`]) whose verdict shapes what Envoy routes to.

pub mod config;
pub mod crash_watch;
pub mod feedback;
pub mod lease;
pub mod machine;
pub mod monitor;
pub mod probe;

use std::sync::{Arc, RwLock};
use std::time::Instant;

use toolgate_model::ServiceKey;
use tracing::{info, warn};

use crate::metrics::{Metrics, TransitionLabel};
use crate::registry::publish::Publisher;
use crate::registry::Registry;
use config::HealthConfig;
use machine::{State, Transition};

/// What every health signal needs: the registry to change, the publisher to tell Envoy, the
/// metrics to count.
#[derive(Clone)]
pub struct Hub {
    pub registry: Arc<RwLock<Registry>>,
    pub publisher: Publisher,
    pub metrics: Arc<Metrics>,
    pub config: Arc<HealthConfig>,
}

impl Hub {
    /// Applies `f` to one instance's health; logs, counts and publishes a transition. Returns
    /// `None` when the instance is gone.
    pub fn update<R>(
        &self,
        key: &ServiceKey,
        f: impl FnOnce(&mut machine::Health, Instant, &HealthConfig) -> (Option<Transition>, R),
    ) -> Option<R> {
        let now = Instant::now();
        let mut reg = self.registry.write().unwrap_or_else(|p| p.into_inner());
        let health = reg.health_mut(key)?;
        let (transition, out) = f(health, now, &self.config);
        if let Some(t) = transition {
            self.record(key, &t);
            // Until the first publish (the cold-start warm-up) the watcher publishes.
            if routes_differently(t.from, t.to) {
                let span = tracing::info_span!(target: crate::trace::TARGET, "health.transition",
                    service = %key.service, instance = %key.instance,
                    from = t.from.as_str(), to = t.to.as_str());
                self.publisher
                    .changed_traced(now, crate::trace::TraceParent::of(&span));
            }
        }
        Some(out)
    }

    /// Logs and counts one transition.
    pub fn record(&self, key: &ServiceKey, t: &Transition) {
        let labels = TransitionLabel {
            from: t.from.as_str(),
            to: t.to.as_str(),
        };
        self.metrics.transitions.get_or_create(&labels).inc();
        if let Some(d) = t.detection {
            if matches!(t.to, State::Suspect | State::Down | State::Unhealthy) {
                self.metrics
                    .transition_latency
                    .get_or_create(&labels)
                    .observe(d.as_secs_f64());
            }
        }
        let detection_ms = t.detection.map(|d| d.as_millis() as u64);
        if matches!(t.to, State::Up) {
            info!(service = %key.service, instance = %key.instance, from = t.from.as_str(),
                to = t.to.as_str(), cause = %t.cause, "instance health changed");
        } else {
            warn!(service = %key.service, instance = %key.instance, from = t.from.as_str(),
                to = t.to.as_str(), cause = %t.cause, detection_ms, "instance health changed");
        }
    }
}

/// Whether Envoy sees a difference between two states.
fn routes_differently(a: State, b: State) -> bool {
    let envoy = |s| match s {
        State::Unknown | State::Down => 0,
        State::Up => 1,
        State::Suspect => 2,
        State::Unhealthy => 3,
    };
    envoy(a) != envoy(b)
}

/// Sets the per-state and zombie gauges from the registry; called at scrape time, so the
/// push path never pays for them.
pub fn export_gauges(reg: &Registry, metrics: &Metrics) {
    use crate::metrics::{ServiceLabel, ServiceStateLabel};
    let (by_state, zombies) = reg.health_counts();
    metrics.instances_by_state.clear();
    for ((service, state), n) in by_state {
        metrics
            .instances_by_state
            .get_or_create(&ServiceStateLabel {
                service,
                state: state.as_str(),
            })
            .set(n);
    }
    metrics.zombie_ratio.clear();
    for (service, (zombie, total)) in zombies {
        let ratio = if total == 0 {
            0.0
        } else {
            zombie as f64 / total as f64
        };
        metrics
            .zombie_ratio
            .get_or_create(&ServiceLabel { service })
            .set(ratio);
    }
}
