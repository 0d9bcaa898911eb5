//! The routing snapshot: what the registry hands to the xDS side. It is the only type the two
//! share, so the etcd/registry side never sees protobuf and the xDS side never sees etcd.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

/// Every service's route, by name. A persistent map: a snapshot copies it in O(1), and the
/// cache finds what changed between two without visiting what they share.
pub type ServiceRoutes = imbl::OrdMap<String, Arc<ServiceRoute>>;

/// Everything Envoy must know, at one moment. Published through a `tokio::sync::watch`.
#[derive(Debug, Clone)]
pub struct RoutingSnapshot {
    /// Increases with every published snapshot.
    pub generation: u64,
    /// When the oldest etcd event folded into this snapshot arrived (for push latency).
    pub changed_at: Instant,
    /// The traces of the changes folded into this snapshot, the oldest's first: the pushes of
    /// this snapshot are children of each (none without an exporter).
    pub traces: Arc<[crate::trace::TraceParent]>,
    /// The causes of the last few snapshots, this one's last. A reader that skipped some
    /// (a `watch` keeps only the latest) still measures from, and traces to, the earliest
    /// change it had not applied yet.
    pub recent: Arc<[Cause]>,
    /// A service whose route did not change shares its `Arc` (and the map its subtree) with
    /// the previous snapshot, so the xDS side finds what changed without comparing contents.
    pub services: ServiceRoutes,
    /// The wasm filter's plugin configuration (JSON), delivered over ECDS.
    /// Shared with the registry's memo: a publish that leaves it alone copies a pointer.
    pub filter_config: Arc<str>,
    /// A digest of the parts of `filter_config` whose change must reach the filters at once:
    /// everything but the catalog, the virtual servers' names and the legacy revisions, which
    /// change with services (and may wait until Envoy has their clusters and routes).
    pub filter_urgency: u64,
    /// The virtual servers offered (issue 19), sorted: each gets its route,
    /// `/virtual/<name>`, and `default` also `/mcp`. Empty means `default` alone.
    pub virtual_servers: Vec<String>,
    /// The filter's request body limit: the routes let Envoy buffer more than this, so the
    /// filter, not Envoy's bare 413, answers a larger body.
    pub max_body_bytes: u64,
    /// The default policy's response timeout: the services with it (and the default MCP path)
    /// share their routes in the shared route configuration.
    pub default_timeout_ms: u64,
    /// The auth configuration, when `<prefix>auth/config` holds one: Envoy's `jwt_authn`
    /// (over ECDS) and the Protected Resource Metadata routes are made from it.
    pub auth: Option<Arc<toolgate_model::auth::AuthConfig>>,
    /// The remote JWKS toolgate-xds fetched for `auth`'s issuers (see `jwks.rs`), delivered
    /// inline in `jwt_authn`'s configuration.
    pub jwks: Arc<FetchedKeys>,
    /// Envoy keeps a verified token on the request (`forward`), for the filter to exchange
    /// for a service's credential (and then remove): only while some service's credential
    /// is an exchange, so that otherwise Envoy drops it itself.
    pub keep_caller_tokens: bool,
    /// The credentials toward servers, by service, delivered as SDS secrets; a service's
    /// cluster injects its own (see [`ServiceRoute::credential_header`]).
    pub credentials: Arc<crate::upstream_credentials::InjectedByService>,
    /// The toolgate-xds processes Envoy's control cluster holds (the aggregate endpoint, the
    /// filters' reports and held sessions): this one first, the fleet's others after it.
    pub control: Arc<ControlMembers>,
}

/// The issuers' keys as toolgate-xds last fetched them, by JWKS URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchedKeys {
    /// The last good set of each URL (canonical JSON text); absent until a fetch succeeded.
    pub sets: BTreeMap<String, Arc<str>>,
    /// URLs fetched at least once, whether the fetch succeeded or not. While the auth
    /// configuration names one not in here, `jwt_authn`'s configuration is held back: a
    /// toolgate-xds that just started does not replace the keys its Envoys verify with by
    /// an empty set before its first fetch.
    pub tried: BTreeSet<String>,
}

/// Where Envoy reaches the fleet's toolgate-xds admin listeners.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlMembers {
    /// This toolgate-xds, as its own Envoys reach it (priority 0); `None` only before it knows.
    pub local: Option<SocketAddr>,
    /// Every other live toolgate-xds of the fleet, sorted (priority 1).
    pub peers: Vec<SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceRoute {
    /// Path of the MCP endpoint on the instances; `/mcp/<service>` is rewritten to it.
    pub mcp_path: String,
    /// The bulkhead: this service's own connection-pool limits in Envoy.
    pub limits: Bulkhead,
    /// Response timeout of the service's calls (not of MCP's GET stream).
    pub timeout_ms: u64,
    /// May be empty: a known service with no instances gets an empty assignment.
    pub endpoints: Vec<RouteEndpoint>,
    /// The header a credential toward the servers goes in, when the service has one
    /// configured (its value comes as an SDS secret, never here).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_header: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteEndpoint {
    pub instance_id: String,
    pub ip: IpAddr,
    pub port: u16,
    /// 1..=128; never 0 (Envoy rejects it).
    pub weight: u32,
    pub health: EndpointHealth,
}

/// How Envoy should treat an endpoint (`envoy.config.core.v3.HealthStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EndpointHealth {
    Healthy,
    /// No new requests; requests in flight finish.
    Draining,
    Unhealthy,
}

/// Envoy `circuit_breakers.thresholds` for one service's cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bulkhead {
    pub max_connections: u32,
    pub max_pending_requests: u32,
    pub max_requests: u32,
    pub max_retries: u32,
}

impl Default for Bulkhead {
    fn default() -> Self {
        // Envoy's own defaults are 1024 each, 3 retries.
        Bulkhead {
            max_connections: 1024,
            max_pending_requests: 1024,
            max_requests: 1024,
            max_retries: 3,
        }
    }
}

/// What made one snapshot: its generation, when its oldest change arrived, and the traces of
/// the changes folded into it.
#[derive(Debug, Clone)]
pub struct Cause {
    pub generation: u64,
    pub changed_at: Instant,
    pub traces: Arc<[crate::trace::TraceParent]>,
}

impl RoutingSnapshot {
    /// How many snapshots' causes [`recent`](Self::recent) keeps: a reader further behind
    /// falls back to the oldest kept.
    pub const RECENT_KEPT: usize = 16;

    /// The causes of what a reader that last applied generation `applied` now applies: every
    /// kept snapshot after it, oldest first (this one's alone when none is kept).
    pub fn causes_since(&self, applied: u64) -> Vec<Cause> {
        let after: Vec<Cause> = self
            .recent
            .iter()
            .filter(|c| c.generation > applied)
            .cloned()
            .collect();
        if after.is_empty() {
            vec![Cause {
                generation: self.generation,
                changed_at: self.changed_at,
                traces: self.traces.clone(),
            }]
        } else {
            after
        }
    }

    pub fn empty() -> Self {
        RoutingSnapshot {
            generation: 0,
            changed_at: Instant::now(),
            traces: Arc::from([]),
            recent: Arc::from([]),
            services: ServiceRoutes::new(),
            filter_config: Arc::from("{}"),
            filter_urgency: 0,
            virtual_servers: Vec::new(),
            max_body_bytes: toolgate_model::RequestLimits::default().max_body_bytes,
            default_timeout_ms: toolgate_model::BreakerPolicy::default().timeout_ms,
            auth: None,
            jwks: Arc::default(),
            keep_caller_tokens: false,
            credentials: Arc::default(),
            control: Arc::default(),
        }
    }
}
