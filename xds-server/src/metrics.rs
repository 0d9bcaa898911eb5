//! Prometheus metrics of the control plane, rendered at `/metrics`.

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    /// Short xDS type name: cds, eds, rds, ecds.
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

pub struct Metrics {
    registry: Registry,
    /// 1 while the etcd watch is established, 0 while etcd cannot be reached.
    pub etcd_up: Gauge,
    pub watch_events: Counter,
    pub watch_resumes: Counter,
    pub full_resyncs: Counter,
    pub invalid_values: Family<ReasonLabel, Counter>,
    pub pushes: Family<TypeLabel, Counter>,
    pub push_latency: Family<TypeLabel, Histogram>,
    pub nacks: Family<TypeLabel, Counter>,
    pub connected_envoys: Gauge,
    pub registered_instances: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let etcd_up = Gauge::default();
        registry.register(
            "toolgate_etcd_up",
            "1 while toolgate-xds has a working watch on etcd, 0 while etcd is unreachable",
            etcd_up.clone(),
        );
        let watch_events = Counter::default();
        registry.register(
            "toolgate_etcd_watch_events",
            "etcd watch events applied to the registry",
            watch_events.clone(),
        );
        let watch_resumes = Counter::default();
        registry.register(
            "toolgate_etcd_watch_resumes",
            "Watches re-established from the last applied revision after a break",
            watch_resumes.clone(),
        );
        let full_resyncs = Counter::default();
        registry.register(
            "toolgate_etcd_full_resyncs",
            "Full re-reads of the prefix after the watched revision was compacted",
            full_resyncs.clone(),
        );
        let invalid_values = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "toolgate_registry_invalid_values",
            "etcd values under the services prefix that were ignored, by reason",
            invalid_values.clone(),
        );
        let pushes = Family::<TypeLabel, Counter>::default();
        registry.register(
            "toolgate_xds_pushes",
            "xDS responses sent to Envoys, by resource type",
            pushes.clone(),
        );
        let push_latency = Family::<TypeLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
            ])
        });
        registry.register(
            "toolgate_xds_push_latency_seconds",
            "From the etcd event reaching toolgate-xds to the xDS response being sent",
            push_latency.clone(),
        );
        let nacks = Family::<TypeLabel, Counter>::default();
        registry.register(
            "toolgate_xds_nacks",
            "xDS responses rejected by an Envoy, by resource type",
            nacks.clone(),
        );
        let connected_envoys = Gauge::default();
        registry.register(
            "toolgate_xds_connected_envoys",
            "Envoys with an open ADS stream",
            connected_envoys.clone(),
        );
        let registered_instances = Gauge::default();
        registry.register(
            "toolgate_registry_instances",
            "Valid instances registered in etcd",
            registered_instances.clone(),
        );
        Metrics {
            registry,
            etcd_up,
            watch_events,
            watch_resumes,
            full_resyncs,
            invalid_values,
            pushes,
            push_latency,
            nacks,
            connected_envoys,
            registered_instances,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
