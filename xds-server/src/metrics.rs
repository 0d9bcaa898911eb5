//! Prometheus metrics of the control plane, rendered at `/metrics`.

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    /// Short xDS type name: cds, eds, rds, ecds.
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabel {
    pub from: &'static str,
    pub to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabel {
    pub service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceStateLabel {
    pub service: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoutingErrorLabel {
    pub service: String,
    /// connect_failure, reset, timeout, http_5xx.
    pub kind: &'static str,
}

/// A JWKS fetch's outcome: `ok`, `failed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JwksLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// How a watched probe connection ended: `gone` (nothing answers at the address: probed at
/// once) or `closed` (the server closed it and still accepts connections).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchEndLabel {
    pub end: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FleetLabel {
    /// open, close.
    pub action: &'static str,
    /// written, already_open, lost_race, deleted, etcd_error…
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AggregateLabel {
    /// A virtual server that exists (requests to others are not counted).
    pub virtual_server: String,
    /// The MCP method, or `other` (the label set stays bounded).
    pub method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabel {
    /// `get` (legacy GET SSE stream) or `listen` (2026-07-28 subscriptions/listen).
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeldLabel {
    /// Whose sessions: `gateway` (legacy clients of the aggregate endpoint), `route` (clients
    /// of a service's route moved off a lost session), `stateless` (2026-07-28 clients of the
    /// aggregate endpoint, by stated identity).
    pub owner: &'static str,
}

/// Which bound refused a session held for a client: `caller` (per caller and service) or
/// `service` (per service).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BoundLabel {
    pub service: String,
    pub bound: &'static str,
}

/// A token exchange asked for by a filter (`/v1/token-exchange`), by its service (bounded by
/// the registry) and how it ended: `issued`, `cached`, `refused` or `failed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExchangeLabel {
    pub service: String,
    pub result: &'static str,
}

pub type Ratio = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    /// 1 while the etcd watch is established, 0 while etcd cannot be reached.
    pub etcd_up: Gauge,
    pub watch_events: Counter,
    pub watch_resumes: Counter,
    pub full_resyncs: Counter,
    pub etcd_clients: Counter,
    pub invalid_values: Family<ReasonLabel, Counter>,
    pub kept_last_good: Counter,
    pub pushes: Family<TypeLabel, Counter>,
    pub push_latency: Family<TypeLabel, Histogram>,
    pub nacks: Family<TypeLabel, Counter>,
    pub filter_config_invalid: Counter,
    pub filter_config_rejected: Counter,
    pub filter_config_rejecting_envoys: Gauge,
    pub connected_envoys: Gauge,
    pub registered_instances: Gauge,
    pub instances_by_state: Family<ServiceStateLabel, Gauge>,
    pub zombie_ratio: Family<ServiceLabel, Ratio>,
    pub heartbeat_loss_rate: Family<ServiceLabel, Ratio>,
    pub heartbeats_missed: Family<ServiceLabel, Counter>,
    pub transitions: Family<TransitionLabel, Counter>,
    pub transition_latency: Family<TransitionLabel, Histogram>,
    pub routing_errors: Family<RoutingErrorLabel, Counter>,
    pub probes: Family<ResultLabel, Counter>,
    pub probe_wait: Histogram,
    pub probe_watches: Gauge,
    pub probe_watch_ends: Family<WatchEndLabel, Counter>,
    pub feedback_unknown: Counter,
    pub reconcile_mismatches: Counter,
    pub inspections: Counter,
    pub fleet_writes: Family<FleetLabel, Counter>,
    pub aggregate_requests: Family<AggregateLabel, Counter>,
    pub aggregate_sessions: Gauge,
    pub aggregate_streams: Family<StreamLabel, Gauge>,
    pub upstream_sessions: Family<HeldLabel, Gauge>,
    pub upstream_sessions_opened: Family<HeldLabel, Counter>,
    pub upstream_sessions_by_service: Family<ServiceLabel, Gauge>,
    pub upstream_sessions_reopened: Family<ServiceLabel, Counter>,
    pub upstream_sessions_ended: Family<ServiceLabel, Counter>,
    pub upstream_sessions_evicted: Family<ServiceLabel, Counter>,
    pub upstream_sessions_refused: Family<BoundLabel, Counter>,
    pub jwks_fetches: Family<JwksLabel, Counter>,
    pub jwks_failing: Gauge,
    pub token_exchanges: Family<ExchangeLabel, Counter>,
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
            "Full re-reads of the prefix after the watched revision was compacted or an inspection \
             found the registry different from etcd",
            full_resyncs.clone(),
        );
        let etcd_clients = Counter::default();
        registry.register(
            "toolgate_etcd_clients",
            "etcd clients the watcher made: one at start and a fresh one after every failed \
             sync or broken watch (a kept client repeats its last connect error)",
            etcd_clients.clone(),
        );
        let invalid_values = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "toolgate_registry_invalid_values",
            "etcd values under the services prefix that were ignored, by reason",
            invalid_values.clone(),
        );
        let kept_last_good = Counter::default();
        registry.register(
            "toolgate_registry_kept_last_good",
            "Keys whose value was invalid in a full read of etcd and that kept their last good \
             value instead",
            kept_last_good.clone(),
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
        let filter_config_invalid = Counter::default();
        registry.register(
            "toolgate_filter_config_invalid",
            "Filter configurations made for an Envoy that the filter would refuse, so not sent \
             (the Envoy keeps the last good one); per stream and configuration",
            filter_config_invalid.clone(),
        );
        let filter_config_rejected = Counter::default();
        registry.register(
            "toolgate_filter_config_rejected",
            "Reports from filters (one per worker) that they refused a configuration and keep \
             judging with their last good one",
            filter_config_rejected.clone(),
        );
        let filter_config_rejecting_envoys = Gauge::default();
        registry.register(
            "toolgate_filter_config_rejecting_envoys",
            "Connected Envoys whose filter last reported refusing its configuration",
            filter_config_rejecting_envoys.clone(),
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
        let instances_by_state = Family::<ServiceStateLabel, Gauge>::default();
        registry.register(
            "mcp_registry_instances",
            "Registered instances by service and health state",
            instances_by_state.clone(),
        );
        let zombie_ratio = Family::<ServiceLabel, Ratio>::default();
        registry.register(
            "mcp_registry_zombie_instance_ratio",
            "Share of a service's instances whose lease is alive while their probes fail",
            zombie_ratio.clone(),
        );
        let heartbeat_loss_rate = Family::<ServiceLabel, Ratio>::default();
        registry.register(
            "mcp_registry_heartbeat_loss_rate",
            "Share of a service's leases that missed at least one keepalive at the last lease check (etcd TimeToLive)",
            heartbeat_loss_rate.clone(),
        );
        let heartbeats_missed = Family::<ServiceLabel, Counter>::default();
        registry.register(
            "mcp_registry_heartbeats_missed",
            "Keepalives a registrar should have sent but etcd's lease did not see",
            heartbeats_missed.clone(),
        );
        let transitions = Family::<TransitionLabel, Counter>::default();
        registry.register(
            "mcp_registry_state_transitions",
            "Instance health state changes",
            transitions.clone(),
        );
        let transition_latency = Family::<TransitionLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0])
        });
        registry.register(
            "mcp_registry_state_transition_latency_seconds",
            "From the first failed signal to SUSPECT, UNHEALTHY or DOWN",
            transition_latency.clone(),
        );
        let routing_errors = Family::<RoutingErrorLabel, Counter>::default();
        registry.register(
            "mcp_scheduler_routing_error_count",
            "Calls the filters saw routed to an instance that failed them, by failure kind",
            routing_errors.clone(),
        );
        let probes = Family::<ResultLabel, Counter>::default();
        registry.register(
            "toolgate_health_probes",
            "Active health probes, by result (pass, fail)",
            probes.clone(),
        );
        let probe_wait = Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0]);
        registry.register(
            "toolgate_health_probe_wait_seconds",
            "How long a due probe waited for a slot under --probe-concurrency",
            probe_wait.clone(),
        );
        let probe_watches = Gauge::default();
        registry.register(
            "toolgate_health_probe_watches",
            "Idle connections the prober holds to instances, to learn of a crash when the kernel closes them",
            probe_watches.clone(),
        );
        let probe_watch_ends = Family::<WatchEndLabel, Counter>::default();
        registry.register(
            "toolgate_health_probe_watch_ends",
            "Held connections the instance's end closed: gone (nothing answers there; probed at once) or closed (the server still accepts)",
            probe_watch_ends.clone(),
        );
        let feedback_unknown = Counter::default();
        registry.register(
            "toolgate_health_feedback_unknown_endpoints",
            "Call reports from filters for addresses no registered instance has",
            feedback_unknown.clone(),
        );
        let reconcile_mismatches = Counter::default();
        registry.register(
            "toolgate_registry_reconcile_mismatches",
            "Inspections that found the registry different from etcd (a full resync follows)",
            reconcile_mismatches.clone(),
        );
        let inspections = Counter::default();
        registry.register(
            "toolgate_registry_inspections",
            "Completed inspection rounds",
            inspections.clone(),
        );
        let fleet_writes = Family::<FleetLabel, Counter>::default();
        registry.register(
            "toolgate_fleet_breaker_events",
            "Breaker transitions reported by this gateway's filters, by what became of them in etcd",
            fleet_writes.clone(),
        );
        let aggregate_requests = Family::<AggregateLabel, Counter>::default();
        registry.register(
            "toolgate_aggregate_requests",
            "JSON-RPC messages to the aggregate MCP endpoint, by virtual server and method",
            aggregate_requests.clone(),
        );
        let aggregate_sessions = Gauge::default();
        registry.register(
            "toolgate_aggregate_sessions",
            "Gateway sessions of legacy clients this toolgate-xds remembers as live",
            aggregate_sessions.clone(),
        );
        let aggregate_streams = Family::<StreamLabel, Gauge>::default();
        registry.register(
            "toolgate_aggregate_streams",
            "Open notification streams of the aggregate endpoint, by kind (get, listen)",
            aggregate_streams.clone(),
        );
        let upstream_sessions = Family::<HeldLabel, Gauge>::default();
        registry.register(
            "toolgate_upstream_sessions",
            "Sessions held with servers on clients' behalf now, by owner kind",
            upstream_sessions.clone(),
        );
        let upstream_sessions_opened = Family::<HeldLabel, Counter>::default();
        registry.register(
            "toolgate_upstream_sessions_opened",
            "Sessions opened with servers on clients' behalf, by owner kind",
            upstream_sessions_opened.clone(),
        );
        let upstream_sessions_by_service = Family::<ServiceLabel, Gauge>::default();
        registry.register(
            "toolgate_upstream_sessions_held",
            "Sessions held with servers on clients' behalf now, by service",
            upstream_sessions_by_service.clone(),
        );
        let upstream_sessions_reopened = Family::<ServiceLabel, Counter>::default();
        registry.register(
            "toolgate_upstream_sessions_reopened",
            "Sessions held for clients opened again because their instance was gone or restarted (the call is replayed once), by service",
            upstream_sessions_reopened.clone(),
        );
        let upstream_sessions_ended = Family::<ServiceLabel, Counter>::default();
        registry.register(
            "toolgate_upstream_sessions_ended",
            "Sessions a client or its live server ended, which the gateway did not open again (the server's answer reached the client), by service",
            upstream_sessions_ended.clone(),
        );
        let upstream_sessions_evicted = Family::<ServiceLabel, Counter>::default();
        registry.register(
            "toolgate_upstream_sessions_evicted",
            "Idle sessions held for clients deleted to make room under a bound, by service",
            upstream_sessions_evicted.clone(),
        );
        let jwks_fetches = Family::<JwksLabel, Counter>::default();
        registry.register(
            "toolgate_jwks_fetches",
            "Fetches of the issuers' remote JWKS by toolgate-xds, by result (ok, failed)",
            jwks_fetches.clone(),
        );
        let jwks_failing = Gauge::default();
        registry.register(
            "toolgate_jwks_failing",
            "Remote JWKS whose last fetch failed (the keys fetched before, if any, stay in use)",
            jwks_failing.clone(),
        );
        let token_exchanges = Family::<ExchangeLabel, Counter>::default();
        registry.register(
            "toolgate_token_exchanges",
            "Callers' tokens exchanged (RFC 8693) for the filters, by service and result: issued \
             (by the identity provider), cached, refused (an OAuth error) or failed \
             (unreachable, timeout, unusable answer, unreadable client secret)",
            token_exchanges.clone(),
        );
        let upstream_sessions_refused = Family::<BoundLabel, Counter>::default();
        registry.register(
            "toolgate_upstream_sessions_refused",
            "Sessions not opened for a client because a bound was reached and none was idle, by service and bound (caller, service)",
            upstream_sessions_refused.clone(),
        );
        Metrics {
            upstream_sessions,
            upstream_sessions_opened,
            upstream_sessions_by_service,
            upstream_sessions_reopened,
            upstream_sessions_ended,
            upstream_sessions_evicted,
            upstream_sessions_refused,
            jwks_fetches,
            jwks_failing,
            token_exchanges,
            aggregate_requests,
            aggregate_sessions,
            aggregate_streams,
            fleet_writes,
            registry,
            instances_by_state,
            zombie_ratio,
            heartbeat_loss_rate,
            heartbeats_missed,
            transitions,
            transition_latency,
            routing_errors,
            probes,
            probe_wait,
            probe_watches,
            probe_watch_ends,
            feedback_unknown,
            reconcile_mismatches,
            inspections,
            etcd_up,
            watch_events,
            watch_resumes,
            full_resyncs,
            etcd_clients,
            invalid_values,
            kept_last_good,
            pushes,
            push_latency,
            nacks,
            filter_config_invalid,
            filter_config_rejected,
            filter_config_rejecting_envoys,
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
