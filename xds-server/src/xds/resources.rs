//! What Envoy should hold, built from a [`RoutingSnapshot`]: pure functions, no protocol, no I/O
//! (go-control-plane's `pkg/resource`). `cache.rs` versions what these functions build and
//! `ads.rs` serves it; neither a new field here nor a protocol change there touches the other.
//!
//! The output is deterministic: services come in `BTreeMap` order, endpoints are sorted, and the
//! only protobuf maps set hold a single entry (prost encodes `HashMap`s in iteration order). So
//! unchanged content encodes to identical bytes and the cache can compare bytes to find changes.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers::Thresholds,
    cluster::{ClusterDiscoveryType, CommonLbConfig, DiscoveryType, EdsClusterConfig},
    CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source::ConfigSourceSpecifier, header_value_option::HeaderAppendAction,
    socket_address::PortSpecifier, Address, AggregatedConfigSource, ApiVersion, ConfigSource,
    DataSource, HeaderValue, HeaderValueOption, HealthStatus, Http1ProtocolOptions,
    RoutingPriority, SocketAddress,
};
use envoy_types::pb::envoy::config::core::v3::{data_source, TypedExtensionConfig};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher::HeaderMatchSpecifier,
    retry_policy, route,
    route_action::{ClusterNotFoundResponseCode, ClusterSpecifier, MaxStreamDuration},
    route_match::PathSpecifier,
    DirectResponseAction, HeaderMatcher, RetryPolicy, Route, RouteAction, RouteConfiguration,
    RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::http::credential_injector::v3::CredentialInjector;
use envoy_types::pb::envoy::extensions::filters::http::stateful_session::v3::{
    stateful_session_per_route, StatefulSessionPerRoute,
};
use envoy_types::pb::envoy::extensions::filters::http::upstream_codec::v3::UpstreamCodec;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::http::injected_credentials::generic::v3::Generic;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, GenericSecret, SdsSecretConfig, Secret,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options::{
        explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
    },
    HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    string_matcher::MatchPattern, RegexMatchAndSubstitute, RegexMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value, UInt64Value};
use toolgate_model::envoy::{
    AGGREGATE_PATH, CLUSTER_HEADER, CONTROL_CLUSTER, SERVICE_PATH_PREFIX, VIRTUAL_PATH_PREFIX,
};
use toolgate_model::instance::DEFAULT_MCP_PATH;

use super::any::to_any;
use crate::routing::{
    ControlMembers, EndpointHealth, RouteEndpoint, RoutingSnapshot, ServiceRoute,
};
use crate::upstream_credentials::Injected;

/// The route configuration with two routes per service, for an Envoy without the toolgate
/// filter; the bootstrap's HTTP connection manager asks for it by this name.
pub const ROUTE_CONFIG_NAME: &str = "toolgate_routes";
/// The route configuration of an Envoy with the toolgate filter: routes of their own only for
/// the services whose path or timeout differs from the defaults, and two routes all the other
/// services share (see [`shared_service_routes`]). A new service then changes no route.
pub const SHARED_ROUTE_CONFIG_NAME: &str = "toolgate_shared_routes";
/// Where toolgate-xds's admin listener serves a virtual server: `/v1/aggregate/<name>`.
pub const AGGREGATE_UPSTREAM_PREFIX: &str = "/v1/aggregate/";
/// The virtual server behind [`AGGREGATE_PATH`].
pub const DEFAULT_VIRTUAL: &str = toolgate_model::virtual_server::DEFAULT_VIRTUAL;
/// A call on a virtual server waits at least this long, and as long as the slowest service's
/// timeout: it is one of that service's calls.
const AGGREGATE_MIN_TIMEOUT_MS: u64 = 60_000;
/// The stateful-session filter's name in the bootstrap, for its per-route configuration.
pub const STATEFUL_SESSION_FILTER: &str = "envoy.filters.http.stateful_session";
/// Names of the [`shared_service_routes`].
const SHARED_ROUTE_NAME: &str = "mcp/*";
const SHARED_ROUTE_NAME_GET_STREAM: &str = "mcp/*/get-stream";
/// Name of the only virtual host of [`ROUTE_CONFIG_NAME`].
const VIRTUAL_HOST_NAME: &str = "toolgate";
/// An MCP GET stream (server-to-client SSE) that carries nothing for this long is closed;
/// the client opens it again when it wants it (rmcp servers send a keep-alive comment every
/// 15 s, so theirs stay).
pub const GET_STREAM_IDLE_TIMEOUT_SECS: i64 = 300;
/// Whatever it carries, a GET stream is closed after this, so a slot held by a client that
/// went away without closing comes back; the client reconnects (resuming with
/// `Last-Event-ID` where the server supports it).
pub const GET_STREAM_MAX_DURATION_SECS: i64 = 3600;
/// GET streams take their connections at this priority, calls at `Default`: Envoy keeps
/// separate circuit-breaker counters and connection pools per priority, so streams never sit
/// on the connection slots that calls need (see [`cluster`]).
const GET_STREAM_PRIORITY: RoutingPriority = RoutingPriority::High;
/// Key of the upstream protocol options in `typed_extension_protocol_options`.
const HTTP_PROTOCOL_OPTIONS_KEY: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// An xDS resource type toolgate serves. The declaration order is the push order (derived
/// `Ord`): clusters before their assignments, because a new cluster warms until its assignment
/// arrives, and both before the routes that point at them, so a route never names a cluster
/// Envoy does not have yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceType {
    /// SDS: `envoy.extensions.transport_sockets.tls.v3.Secret`, the credentials toward the
    /// servers. First: a cluster that injects one warms until its secret is there.
    Secret,
    /// CDS: `envoy.config.cluster.v3.Cluster`.
    Cluster,
    /// EDS: `envoy.config.endpoint.v3.ClusterLoadAssignment`.
    Endpoint,
    /// RDS: `envoy.config.route.v3.RouteConfiguration`.
    Route,
    /// ECDS: `envoy.config.core.v3.TypedExtensionConfig` (the wasm filter's configuration).
    ExtensionConfig,
}

impl ResourceType {
    /// Every type, in push order.
    pub const ALL: [ResourceType; 5] = [
        ResourceType::Secret,
        ResourceType::Cluster,
        ResourceType::Endpoint,
        ResourceType::Route,
        ResourceType::ExtensionConfig,
    ];

    pub const fn type_url(self) -> &'static str {
        match self {
            ResourceType::Secret => {
                "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
            }
            ResourceType::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            ResourceType::Endpoint => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
            ResourceType::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            ResourceType::ExtensionConfig => {
                "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
            }
        }
    }

    /// `None` for a type toolgate does not serve (LDS, …).
    pub fn from_type_url(url: &str) -> Option<ResourceType> {
        ResourceType::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// The short name used in logs and as the `type` metrics label.
    pub const fn short_name(self) -> &'static str {
        match self {
            ResourceType::Secret => "sds",
            ResourceType::Cluster => "cds",
            ResourceType::Endpoint => "eds",
            ResourceType::Route => "rds",
            ResourceType::ExtensionConfig => "ecds",
        }
    }

    /// xDS: for LDS and CDS an empty `resource_names` list is a wildcard subscription ("send me
    /// everything"); for the other types it means "nothing".
    pub const fn empty_names_mean_wildcard(self) -> bool {
        matches!(self, ResourceType::Cluster)
    }
}

/// Resources of one type by name, each encoded as `google.protobuf.Any`. Shared (`Arc`), so
/// the next version of a type reuses every resource that did not change without copying it.
pub type NamedResources = BTreeMap<String, Arc<Any>>;

/// Everything toolgate serves for `snapshot`, by type. Each of CDS, EDS and RDS is present even
/// when empty, so "no services" is a state Envoy is told about rather than a missing answer.
/// The cache builds the same thing incrementally (`SnapshotCache::build`); this whole-snapshot
/// form is the reference its tests compare with.
#[cfg(test)]
pub(crate) fn build(snapshot: &RoutingSnapshot) -> BTreeMap<ResourceType, NamedResources> {
    let mut clusters = NamedResources::new();
    let mut assignments = NamedResources::new();
    for (service, route) in snapshot.services.iter() {
        let name = cluster_name(service);
        clusters.insert(
            name.clone(),
            Arc::new(to_any(&cluster(
                service,
                route,
                &ResourceOptions::default(),
            ))),
        );
        assignments.insert(name, Arc::new(to_any(&load_assignment(service, route))));
    }
    assignments.insert(
        CONTROL_CLUSTER.to_string(),
        Arc::new(to_any(&control_load_assignment(&snapshot.control))),
    );
    let mut routes = NamedResources::new();
    routes.insert(
        ROUTE_CONFIG_NAME.to_string(),
        Arc::new(to_any(&route_configuration(snapshot))),
    );
    routes.insert(
        SHARED_ROUTE_CONFIG_NAME.to_string(),
        Arc::new(to_any(&shared_route_configuration(snapshot))),
    );
    let mut secrets = NamedResources::new();
    for (service, injected) in snapshot.credentials.iter() {
        secrets.insert(
            secret_name(service),
            Arc::new(to_any(&secret(service, injected))),
        );
    }
    let mut extension = NamedResources::new();
    extension.insert(
        super::ecds::FILTER_CONFIG_NAME.to_string(),
        Arc::new(super::ecds::extension_config(&snapshot.filter_config)),
    );
    if let Some(jwt) = super::auth::jwt_extension_config(
        snapshot.auth.as_deref(),
        &snapshot.jwks,
        snapshot.keep_caller_tokens,
    ) {
        extension.insert(super::auth::JWT_CONFIG_NAME.to_string(), Arc::new(jwt));
    }
    BTreeMap::from([
        (ResourceType::Secret, secrets),
        (ResourceType::Cluster, clusters),
        (ResourceType::Endpoint, assignments),
        (ResourceType::Route, routes),
        (ResourceType::ExtensionConfig, extension),
    ])
}

/// `mcp.<service>`: the cluster and its load assignment share this name.
pub fn cluster_name(service: &str) -> String {
    toolgate_model::envoy::service_cluster(service)
}

/// The public path prefix of a service, `/mcp/<service>`.
pub fn service_path(service: &str) -> String {
    format!("{SERVICE_PATH_PREFIX}{service}")
}

/// Settings of this process that shape the resources it builds (flags of `toolgate-xds
/// serve`): handed from main.rs through [`serve`](super::serve) and the ADS service to the
/// cache, which builds every cluster with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceOptions {
    /// Adds Envoy's own outlier detection to every service cluster. Off by default: toolgate's
    /// probes and breakers do that job and tell the agent why; on, it is a second line of
    /// defence (and the bench's point of comparison).
    pub envoy_outlier_detection: bool,
}

/// Five 5xx (timeouts and resets count) in a row eject a host for 30 s; any host may go.
fn outlier_detection(options: &ResourceOptions) -> Option<OutlierDetection> {
    options.envoy_outlier_detection.then(|| OutlierDetection {
        consecutive_5xx: u32_value(5),
        interval: Some(duration_secs(1)),
        base_ejection_time: Some(duration_secs(30)),
        max_ejection_percent: u32_value(100),
        ..Default::default()
    })
}

/// `ConfigSource { ads: {}, resource_api_version: V3 }`: "fetch this over the ADS stream".
fn ads_config_source() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn duration_ms(ms: u64) -> Duration {
    Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

fn duration_secs(seconds: i64) -> Duration {
    Duration { seconds, nanos: 0 }
}

fn u32_value(value: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value })
}

/// `toolgate.upstream.<service>`: the SDS secret holding a service's credential.
pub fn secret_name(service: &str) -> String {
    format!("toolgate.upstream.{service}")
}

/// The SDS secret of a service's credential: the header's whole value (`Bearer <token>`).
/// Envoy shows it as `[redacted]` in `config_dump`.
pub fn secret(service: &str, injected: &Injected) -> Secret {
    Secret {
        name: secret_name(service),
        r#type: Some(secret::Type::GenericSecret(GenericSecret {
            secret: Some(DataSource {
                specifier: Some(data_source::Specifier::InlineString(
                    injected.value.expose().to_string(),
                )),
                ..Default::default()
            }),
            ..Default::default()
        })),
    }
}

/// The upstream filters of a service with a credential: Envoy's credential injector, then the
/// codec every upstream filter chain ends with. The injector overwrites whatever the client
/// sent under that header, and refuses a call with a local 401 while the secret is missing
/// (never sends it without).
fn credential_filters(service: &str, header: &str) -> Vec<HttpFilter> {
    let generic = Generic {
        credential: Some(SdsSecretConfig {
            name: secret_name(service),
            sds_config: Some(ads_config_source()),
        }),
        header: header.to_string(),
        ..Default::default()
    };
    let injector = CredentialInjector {
        overwrite: true,
        allow_request_without_credential: false,
        credential: Some(TypedExtensionConfig {
            name: "envoy.http.injected_credentials.generic".to_string(),
            typed_config: Some(to_any(&generic)),
        }),
    };
    vec![
        HttpFilter {
            name: "envoy.filters.http.credential_injector".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(to_any(&injector))),
            ..Default::default()
        },
        HttpFilter {
            name: "envoy.filters.http.upstream_codec".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(to_any(
                &UpstreamCodec::default(),
            ))),
            ..Default::default()
        },
    ]
}

/// The cluster of one service: EDS over ADS, plain HTTP/1.1 to the MCP servers, no panic mode,
/// the service's own connection-pool limits, and its credential toward the servers if it has
/// one.
pub fn cluster(service: &str, route: &ServiceRoute, options: &ResourceOptions) -> Cluster {
    let limits = route.limits;
    // MCP servers speak plain HTTP/1.1; saying so explicitly keeps a future Envoy default from
    // changing the upstream protocol under us.
    let http1 = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::HttpProtocolOptions(
                    Http1ProtocolOptions::default(),
                )),
            },
        )),
        http_filters: route
            .credential_header
            .as_deref()
            .map(|header| credential_filters(service, header))
            .unwrap_or_default(),
        ..Default::default()
    };
    Cluster {
        name: cluster_name(service),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads_config_source()),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration_secs(if crate::failpoint::nack_service(service) {
            -1
        } else {
            1
        })),
        // A single entry: a prost map with one entry encodes deterministically.
        typed_extension_protocol_options: HashMap::from([(
            HTTP_PROTOCOL_OPTIONS_KEY.to_string(),
            to_any(&http1),
        )]),
        common_lb_config: Some(CommonLbConfig {
            // Envoy's default 50% panic threshold spreads traffic over all hosts, dead ones
            // included, once half are unhealthy. toolgate only routes to hosts it believes
            // healthy, so panic mode is off: explicitly 0%, not absent (absent means 50%).
            healthy_panic_threshold: Some(Percent { value: 0.0 }),
            // Envoy merges health/weight updates of a cluster for 1 s by default, which would
            // delay taking a draining instance out of rotation; toolgate already pushes each
            // change at once, so merging is off.
            update_merge_window: Some(duration_secs(0)),
            ..Default::default()
        }),
        outlier_detection: outlier_detection(options),
        // The bulkhead: one slow MCP server fills only its own cluster's connection slots.
        // Twice: calls route at the default priority, MCP's long-lived GET streams at
        // GET_STREAM_PRIORITY, and Envoy counts (and pools) connections per priority. Idle
        // GET streams, each holding an HTTP/1 connection, would otherwise take the slots
        // that calls need; now they fill a bulkhead of the same size of their own.
        circuit_breakers: Some(CircuitBreakers {
            thresholds: [RoutingPriority::Default, GET_STREAM_PRIORITY]
                .into_iter()
                .map(|priority| Thresholds {
                    priority: priority as i32,
                    max_connections: u32_value(limits.max_connections),
                    max_pending_requests: u32_value(limits.max_pending_requests),
                    max_requests: u32_value(limits.max_requests),
                    max_retries: u32_value(limits.max_retries),
                    ..Default::default()
                })
                .collect(),
            per_host_thresholds: Vec::new(),
        }),
        ..Default::default()
    }
}

/// The assignment of one service: one endpoint per instance, all in one locality. A service with
/// no instances gets an assignment with no endpoints (Envoy then answers 503 "no healthy
/// upstream" at once), never a missing one (its cluster would stay warming).
pub fn load_assignment(service: &str, route: &ServiceRoute) -> ClusterLoadAssignment {
    let mut endpoints: Vec<&RouteEndpoint> = route.endpoints.iter().collect();
    // Canonical order, so a registry that lists the same instances differently does not look
    // like a change.
    endpoints.sort_by(|a, b| (&a.instance_id, a.ip, a.port).cmp(&(&b.instance_id, b.ip, b.port)));
    let lb_endpoints: Vec<LbEndpoint> = endpoints.into_iter().map(lb_endpoint).collect();
    ClusterLoadAssignment {
        cluster_name: cluster_name(service),
        endpoints: if lb_endpoints.is_empty() {
            Vec::new()
        } else {
            vec![LocalityLbEndpoints {
                lb_endpoints,
                ..Default::default()
            }]
        },
        ..Default::default()
    }
}

/// The control cluster's assignment ([`CONTROL_CLUSTER`], a static cluster
/// of the bootstrap fed over EDS): this toolgate-xds at priority 0, the fleet's other live
/// toolgate-xds at priority 1. Envoy sends the aggregate endpoint's requests, the filters'
/// reports and their held-session requests to priority 1 only while priority 0 fails its
/// health checks or is ejected; a request that failed on one is retried on the other (see
/// [`virtual_routes`]). Priorities do not skip: without a local address the others are 0.
pub fn control_load_assignment(members: &ControlMembers) -> ClusterLoadAssignment {
    let endpoint = |addr: std::net::SocketAddr| LbEndpoint {
        health_status: HealthStatus::Healthy as i32,
        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
            address: Some(socket_address(addr.ip(), addr.port())),
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut endpoints = Vec::new();
    if let Some(local) = members.local {
        endpoints.push(LocalityLbEndpoints {
            lb_endpoints: vec![endpoint(local)],
            priority: 0,
            ..Default::default()
        });
    }
    if !members.peers.is_empty() {
        endpoints.push(LocalityLbEndpoints {
            lb_endpoints: members.peers.iter().copied().map(endpoint).collect(),
            priority: endpoints.len() as u32,
            ..Default::default()
        });
    }
    ClusterLoadAssignment {
        cluster_name: CONTROL_CLUSTER.to_string(),
        endpoints,
        ..Default::default()
    }
}

/// No endpoint metadata: the filter names an instance by its upstream address, and the
/// instance id is the endpoint's `hostname`. Envoy copies and parses metadata per host; at
/// 10,000 endpoints an instance id under `filter_metadata` cost a fresh Envoy 130 ms of its
/// 200 ms EDS apply (152-219 ms with it, 60-80 ms without, 3 alternating runs).
fn lb_endpoint(endpoint: &RouteEndpoint) -> LbEndpoint {
    LbEndpoint {
        health_status: health_status(endpoint.health) as i32,
        metadata: None,
        // Envoy rejects a weight of 0 (and with it the whole assignment): only a test's
        // failpoint sends one.
        load_balancing_weight: u32_value(
            if crate::failpoint::nack_instance(&endpoint.instance_id) {
                0
            } else {
                endpoint.weight.max(1)
            },
        ),
        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
            address: Some(socket_address(endpoint.ip, endpoint.port)),
            // The instance id, shown in Envoy's /clusters output and config dump next to the
            // address; not used for routing.
            hostname: endpoint.instance_id.clone(),
            ..Default::default()
        })),
    }
}

/// The registry's verdict as Envoy's `HealthStatus`. There is no active health checking in
/// Envoy: EDS health is the only health Envoy knows.
pub fn health_status(health: EndpointHealth) -> HealthStatus {
    match health {
        EndpointHealth::Healthy => HealthStatus::Healthy,
        EndpointHealth::Draining => HealthStatus::Draining,
        EndpointHealth::Unhealthy => HealthStatus::Unhealthy,
    }
}

fn socket_address(ip: IpAddr, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

/// [`ROUTE_CONFIG_NAME`]: one virtual host `*` with two routes per service, both on
/// `/mcp/<service>` (and below it), rewritten to the service's `mcp_path`:
/// - `GET` opens MCP's long-lived server-to-client SSE stream, which a response timeout
///   would cut: no response timeout, an idle limit and a maximum duration of its own, and
///   connections from the cluster's GET-stream bulkhead ([`GET_STREAM_PRIORITY`]);
/// - everything else with the service's response timeout (policy `timeout_ms`), which is
///   also its idle limit: a call silent until then is what the timeout is for.
///
/// Then the virtual servers' routes (see [`virtual_routes`]). Unknown paths match no route
/// and get Envoy's own 404, except under `/virtual/`, which get a JSON-RPC error saying no
/// such virtual server exists.
pub fn route_configuration(snapshot: &RoutingSnapshot) -> RouteConfiguration {
    route_table(snapshot, false)
}

/// [`SHARED_ROUTE_CONFIG_NAME`]: as [`route_configuration`], but only the services with
/// [`has_own_routes`] have routes of their own; the [`shared_service_routes`] come after them.
pub fn shared_route_configuration(snapshot: &RoutingSnapshot) -> RouteConfiguration {
    route_table(snapshot, true)
}

fn route_table(snapshot: &RoutingSnapshot, shared: bool) -> RouteConfiguration {
    let mut host = virtual_host(snapshot);
    host.routes.reserve(snapshot.services.len() * 2 + 3);
    for (service, route) in snapshot.services.iter() {
        if !shared || has_own_routes(route, snapshot.default_timeout_ms) {
            host.routes.extend(service_routes(service, route));
        }
    }
    if shared {
        host.routes
            .extend(shared_service_routes(snapshot.default_timeout_ms));
    }
    host.routes.push(unknown_virtual_route());
    RouteConfiguration {
        name: if shared {
            SHARED_ROUTE_CONFIG_NAME
        } else {
            ROUTE_CONFIG_NAME
        }
        .to_string(),
        virtual_hosts: vec![host],
        ..Default::default()
    }
}

/// Whether a service needs routes of its own where services can share theirs: the shared
/// routes rewrite to the default MCP path and wait the default policy's timeout.
pub fn has_own_routes(route: &ServiceRoute, default_timeout_ms: u64) -> bool {
    route.mcp_path != DEFAULT_MCP_PATH || route.timeout_ms != default_timeout_ms
}

/// The two routes every service without routes of its own shares, on `/mcp/<service>` like
/// [`service_routes`] (the GET stream's first), rewritten to the default MCP path, with the
/// default policy's timeout. The cluster is the one the toolgate filter names in
/// [`CLUSTER_HEADER`] from the path it judges; a request without it (the filter judged no
/// service there) or naming a cluster Envoy does not have gets a 404, as a path no route
/// takes. Only Envoys with the filter ask for these routes (their bootstrap names
/// [`SHARED_ROUTE_CONFIG_NAME`]): without it a client could name any cluster.
pub fn shared_service_routes(default_timeout_ms: u64) -> [Route; 2] {
    [true, false].map(|get_stream| {
        let mut action =
            mcp_route_action(String::new(), String::new(), default_timeout_ms, get_stream);
        action.cluster_specifier =
            Some(ClusterSpecifier::ClusterHeader(CLUSTER_HEADER.to_string()));
        action.cluster_not_found_response_code = ClusterNotFoundResponseCode::NotFound as i32;
        action.regex_rewrite = Some(RegexMatchAndSubstitute {
            // The service segment, up to the next `/` (the query is not part of what Envoy
            // rewrites, and `?` is excluded should that change).
            pattern: Some(RegexMatcher {
                regex: format!("^{SERVICE_PATH_PREFIX}[^/?]+"),
                ..Default::default()
            }),
            substitution: DEFAULT_MCP_PATH.to_string(),
        });
        Route {
            name: if get_stream {
                SHARED_ROUTE_NAME_GET_STREAM
            } else {
                SHARED_ROUTE_NAME
            }
            .to_string(),
            r#match: Some(mcp_match(
                PathSpecifier::Prefix(SERVICE_PATH_PREFIX.to_string()),
                get_stream,
            )),
            action: Some(route::Action::Route(action)),
            ..Default::default()
        }
    })
}

/// The one virtual host, with the routes that come before the services' (auth metadata and
/// virtual servers): [`route_configuration`] appends each service's two routes and then
/// [`unknown_virtual_route`].
pub(crate) fn virtual_host(snapshot: &RoutingSnapshot) -> VirtualHost {
    let mut routes = Vec::new();
    routes.extend(super::auth::metadata_routes(snapshot));
    routes.extend(virtual_routes(snapshot));
    VirtualHost {
        name: VIRTUAL_HOST_NAME.to_string(),
        domains: vec!["*".to_string()],
        routes,
        request_body_buffer_limit: Some(UInt64Value {
            value: request_body_buffer_limit(snapshot.max_body_bytes),
        }),
        // Once for the virtual host rather than on each of its routes: Envoy shares a
        // virtual host's policy among its routes but builds a route's own policy (and its
        // host predicate) per route, on every new route configuration, which is one per new
        // service. The other routes are direct responses, which never retry.
        retry_policy: Some(connect_failure_retry()),
        // The filter's word for Envoy (see [`shared_service_routes`]), and the payload
        // `jwt_authn` verified (the filter reads it before routing), are not for the server.
        // Removed here by the router, not by a host call of the filter on every request.
        request_headers_to_remove: vec![
            CLUSTER_HEADER.to_string(),
            toolgate_model::auth::PAYLOAD_HEADER.to_string(),
        ],
        ..Default::default()
    }
}

/// A service's routes, in the order Envoy must try them: it takes the first that matches, so
/// the GET stream's comes before the general one.
pub(crate) fn service_routes(service: &str, route: &ServiceRoute) -> [Route; 2] {
    [
        service_route(service, route, true),
        service_route(service, route, false),
    ]
}

/// How much the MCP listener reads from a connection at once and buffers per connection (the
/// bootstrap sets it; [`request_body_buffer_limit`] counts on it).
pub const LISTENER_BUFFER_BYTES: u64 = 1024 * 1024;

/// How much of a request body Envoy may buffer. Above it Envoy answers with its own bare 413,
/// in the same step that hands the filter the data crossing the filter's limit (the filter's
/// reply is deferred and loses). One step carries at most what one read from the connection
/// takes, the listener's buffer: with that much room above the filter's limit, and a margin,
/// the filter always answers first.
pub fn request_body_buffer_limit(max_body_bytes: u64) -> u64 {
    max_body_bytes + 2 * LISTENER_BUFFER_BYTES
}

/// The routes of the virtual servers, to toolgate-xds's admin listener
/// ([`CONTROL_CLUSTER`]) at `/v1/aggregate/<name>` (the query kept):
/// `/mcp` for `default`, `/virtual/<name>` for each (`default` included). Exact paths, two
/// routes each like a service's: the GET stream without a response timeout, everything else
/// with the largest service timeout (a `tools/call` there is one service's call).
///
/// Envoy's session affinity is off on them: the session ids there are toolgate-xds's own,
/// and the envelope would write toolgate-xds's address into them, unsealed (the toolgate
/// filter seals only `/mcp/<service>` ids).
pub fn virtual_routes(snapshot: &RoutingSnapshot) -> Vec<Route> {
    let timeout_ms = snapshot
        .services
        .values()
        .map(|r| r.timeout_ms)
        .fold(AGGREGATE_MIN_TIMEOUT_MS, u64::max);
    let mut names: Vec<&str> = snapshot
        .virtual_servers
        .iter()
        .map(String::as_str)
        .collect();
    if !names.contains(&DEFAULT_VIRTUAL) {
        names.push(DEFAULT_VIRTUAL);
        names.sort_unstable();
    }
    let mut paths = vec![(AGGREGATE_PATH.to_string(), DEFAULT_VIRTUAL)];
    paths.extend(
        names
            .into_iter()
            .map(|name| (format!("{VIRTUAL_PATH_PREFIX}{name}"), name)),
    );
    let mut routes = Vec::with_capacity(paths.len() * 2);
    for (path, name) in paths {
        for get_stream in [true, false] {
            routes.push(virtual_route(&path, name, timeout_ms, get_stream));
        }
    }
    routes
}

fn virtual_route(path: &str, name: &str, timeout_ms: u64, get_stream: bool) -> Route {
    Route {
        name: format!("{path}{}", if get_stream { "/get-stream" } else { "" }),
        // The path without its query; `/mcp/…` and `/virtual/x/…` are not this route.
        r#match: Some(mcp_match(PathSpecifier::Path(path.to_string()), get_stream)),
        action: Some(route::Action::Route(RouteAction {
            retry_policy: Some(control_retry()),
            ..mcp_route_action(
                CONTROL_CLUSTER.to_string(),
                format!("{AGGREGATE_UPSTREAM_PREFIX}{name}"),
                timeout_ms,
                get_stream,
            )
        })),
        typed_per_filter_config: no_session_affinity(),
        ..Default::default()
    }
}

/// `/virtual/<anything else>`: a JSON-RPC error naming the problem rather than an empty 404.
pub(crate) fn unknown_virtual_route() -> Route {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {
            "code": -32600,
            "message": "No virtual server of that name: the path is /virtual/<name> of a virtual server defined at <prefix>virtual/<name> in etcd (GET /v1/virtual on toolgate-xds's admin API lists them), or /mcp for every tool."
        }
    });
    Route {
        name: "virtual/unknown".to_string(),
        r#match: Some(RouteMatch {
            path_specifier: Some(PathSpecifier::Prefix(VIRTUAL_PATH_PREFIX.to_string())),
            ..Default::default()
        }),
        action: Some(route::Action::DirectResponse(DirectResponseAction {
            status: 404,
            body: Some(DataSource {
                specifier: Some(
                    envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineString(
                        body.to_string(),
                    ),
                ),
                ..Default::default()
            }),
            ..Default::default()
        })),
        response_headers_to_add: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: "content-type".to_string(),
                value: "application/json".to_string(),
                ..Default::default()
            }),
            // Envoy's direct response says text/plain by itself.
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        typed_per_filter_config: no_session_affinity(),
        ..Default::default()
    }
}

/// Turns the stateful-session filter off on one route. A single entry: a prost map with one
/// entry encodes deterministically.
fn no_session_affinity() -> HashMap<String, Any> {
    HashMap::from([(
        STATEFUL_SESSION_FILTER.to_string(),
        to_any(&StatefulSessionPerRoute {
            r#override: Some(stateful_session_per_route::Override::Disabled(true)),
        }),
    )])
}

/// A route of MCP traffic matches `path`, and its GET stream's route the method too: the GET
/// stream's route comes first, and Envoy takes the first that matches.
fn mcp_match(path: PathSpecifier, get_stream: bool) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(path),
        headers: if get_stream {
            vec![get_method()]
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

fn get_method() -> HeaderMatcher {
    HeaderMatcher {
        name: ":method".to_string(),
        header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(StringMatcher {
            match_pattern: Some(MatchPattern::Exact("GET".to_string())),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Where a route of MCP traffic sends it, and for how long: the same for a service's route and
/// a virtual server's. MCP's GET stream (a long-lived server-to-client channel) has no response
/// timeout, an idle limit, a maximum duration, and its own connection priority, so it never
/// holds the connections calls need; everything else has the route's timeout.
fn mcp_route_action(
    cluster: String,
    prefix_rewrite: String,
    timeout_ms: u64,
    get_stream: bool,
) -> RouteAction {
    let (timeout, idle_timeout, priority, max_stream_duration) = if get_stream {
        (
            // 0s disables Envoy's route timeout (default 15 s).
            duration_secs(0),
            duration_secs(GET_STREAM_IDLE_TIMEOUT_SECS),
            GET_STREAM_PRIORITY,
            Some(MaxStreamDuration {
                max_stream_duration: Some(duration_secs(GET_STREAM_MAX_DURATION_SECS)),
                ..Default::default()
            }),
        )
    } else {
        (
            duration_ms(timeout_ms),
            duration_ms(timeout_ms),
            RoutingPriority::Default,
            None,
        )
    };
    RouteAction {
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster)),
        prefix_rewrite,
        timeout: Some(timeout),
        idle_timeout: Some(idle_timeout),
        max_stream_duration,
        priority: priority as i32,
        ..Default::default()
    }
}

/// Reads the service's name, path and timeout only: toolgate-xds keeps a service's routes
/// encoded until one of those changes (`route_table::routes_differ`).
fn service_route(service: &str, route: &ServiceRoute, get_stream: bool) -> Route {
    Route {
        name: if get_stream {
            format!("{service}/get-stream")
        } else {
            service.to_string()
        },
        // Matches `/mcp/inventory`, `/mcp/inventory/…` and `/mcp/inventory?…` but not
        // `/mcp/inventoryX`, which a plain prefix would.
        r#match: Some(mcp_match(
            PathSpecifier::PathSeparatedPrefix(service_path(service)),
            get_stream,
        )),
        action: Some(route::Action::Route(mcp_route_action(
            cluster_name(service),
            route.mcp_path.clone(),
            route.timeout_ms,
            get_stream,
        ))),
        ..Default::default()
    }
}

/// Retries only what never reached a server (connect failure, refused stream), so even a
/// non-idempotent `tools/call` is safe to retry, and always on another host. This is also what
/// moves an MCP session off an instance that died without deregistering: the retry does not
/// use the session's pinned host, reaches a live instance, and that instance answers 404 for
/// the unknown session, so the client initializes again as the MCP spec asks.
fn connect_failure_retry() -> RetryPolicy {
    RetryPolicy {
        retry_on: "connect-failure,refused-stream".to_string(),
        num_retries: Some(UInt32Value { value: 2 }),
        retry_host_predicate: vec![retry_policy::RetryHostPredicate {
            name: "envoy.retry_host_predicates.previous_hosts".to_string(),
            config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(
                Any {
                    type_url: "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate".to_string(),
                    value: Vec::new(),
                },
            )),
        }],
        host_selection_retry_max_attempts: 3,
        ..Default::default()
    }
}

/// The aggregate endpoint's retries. Its requests go to a toolgate-xds and none of them runs a
/// tool (`tools/call` goes to the tool's service), so one that found its toolgate-xds gone,
/// refused or reset before an answer (killed while it held the request), goes again, to
/// another host and another priority: a dead local toolgate-xds hands it to the fleet's next,
/// without waiting for the health checks to notice.
fn control_retry() -> RetryPolicy {
    use envoy_types::pb::envoy::extensions::retry::priority::previous_priorities::v3::PreviousPrioritiesConfig;
    RetryPolicy {
        retry_on: "connect-failure,refused-stream,reset".to_string(),
        retry_priority: Some(retry_policy::RetryPriority {
            name: "envoy.retry_priorities.previous_priorities".to_string(),
            config_type: Some(retry_policy::retry_priority::ConfigType::TypedConfig(
                to_any(&PreviousPrioritiesConfig {
                    update_frequency: 1,
                }),
            )),
        }),
        ..connect_failure_retry()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Bulkhead;
    use crate::xds::shard::ServiceSelector;
    use prost::{Message, Name};
    use std::time::Instant;

    fn endpoint(id: &str, last_octet: u8, weight: u32, health: EndpointHealth) -> RouteEndpoint {
        RouteEndpoint {
            instance_id: id.to_string(),
            ip: IpAddr::from([10, 0, 0, last_octet]),
            port: 8080,
            weight,
            health,
        }
    }

    /// `inventory` with three instances in three states, `billing` with none.
    fn two_services() -> RoutingSnapshot {
        let limits = Bulkhead {
            max_connections: 11,
            max_pending_requests: 12,
            max_requests: 13,
            max_retries: 2,
        };
        RoutingSnapshot {
            generation: 1,
            changed_at: Instant::now(),
            traces: Default::default(),
            recent: std::sync::Arc::from([]),
            services: [
                (
                    "inventory".to_string(),
                    ServiceRoute {
                        mcp_path: "/rpc".to_string(),
                        limits,
                        timeout_ms: 60_000,
                        credential_header: None,
                        endpoints: vec![
                            endpoint("inv-c", 3, 1, EndpointHealth::Unhealthy),
                            endpoint("inv-a", 1, 10, EndpointHealth::Healthy),
                            endpoint("inv-b", 2, 0, EndpointHealth::Draining),
                        ],
                    },
                ),
                (
                    "billing".to_string(),
                    ServiceRoute {
                        mcp_path: "/mcp".to_string(),
                        limits: Bulkhead::default(),
                        timeout_ms: 60_000,
                        credential_header: None,
                        endpoints: Vec::new(),
                    },
                ),
            ]
            .into_iter()
            .collect(),
            filter_config: Arc::from("{}"),
            filter_urgency: 0,
            virtual_servers: Vec::new(),
            max_body_bytes: 1024 * 1024,
            default_timeout_ms: 60_000,
            auth: None,
            jwks: Default::default(),
            keep_caller_tokens: false,
            credentials: Default::default(),
            control: Default::default(),
        }
    }

    fn decode<M: Message + Name + Default>(any: &Any) -> M {
        assert_eq!(any.type_url, M::type_url());
        M::decode(any.value.as_slice()).expect("decodes")
    }

    #[test]
    fn type_urls_are_the_canonical_ones() {
        assert_eq!(ResourceType::Cluster.type_url(), Cluster::type_url());
        assert_eq!(
            ResourceType::Endpoint.type_url(),
            ClusterLoadAssignment::type_url()
        );
        assert_eq!(
            ResourceType::Route.type_url(),
            RouteConfiguration::type_url()
        );
        assert_eq!(
            ResourceType::ExtensionConfig.type_url(),
            envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig::type_url()
        );
        for t in ResourceType::ALL {
            assert_eq!(ResourceType::from_type_url(t.type_url()), Some(t));
        }
        assert_eq!(
            ResourceType::from_type_url("type.googleapis.com/envoy.config.listener.v3.Listener"),
            None
        );
    }

    #[test]
    fn every_service_gets_a_cluster_and_an_assignment_even_without_instances() {
        let built = build(&two_services());
        let names = |t| built[&t].keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            names(ResourceType::Cluster),
            ["mcp.billing", "mcp.inventory"]
        );
        // And the control cluster's, a static cluster of the bootstrap.
        assert_eq!(
            names(ResourceType::Endpoint),
            ["mcp.billing", "mcp.inventory", CONTROL_CLUSTER]
        );
        assert_eq!(
            names(ResourceType::Route),
            [ROUTE_CONFIG_NAME, SHARED_ROUTE_CONFIG_NAME]
        );

        let billing: ClusterLoadAssignment = decode(&built[&ResourceType::Endpoint]["mcp.billing"]);
        assert_eq!(billing.cluster_name, "mcp.billing");
        assert!(billing.endpoints.is_empty());
    }

    #[test]
    fn the_control_assignment_has_this_toolgate_xds_at_priority_0_and_the_others_at_1() {
        let addr = |s: &str| s.parse::<std::net::SocketAddr>().expect("addr");
        let mut snapshot = two_services();
        snapshot.control = Arc::new(ControlMembers {
            local: Some(addr("10.0.0.1:19000")),
            peers: vec![addr("10.0.0.2:19000"), addr("[fd00::3]:19000")],
        });
        let built = build(&snapshot);
        let cla: ClusterLoadAssignment = decode(&built[&ResourceType::Endpoint][CONTROL_CLUSTER]);
        assert_eq!(cla.cluster_name, CONTROL_CLUSTER);
        let by_priority: Vec<(u32, Vec<String>)> = cla
            .endpoints
            .iter()
            .map(|l| {
                let hosts = l
                    .lb_endpoints
                    .iter()
                    .map(|e| {
                        let Some(HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                            panic!("an endpoint")
                        };
                        assert_eq!(e.health_status, HealthStatus::Healthy as i32);
                        let Some(address::Address::SocketAddress(sa)) =
                            ep.address.as_ref().and_then(|a| a.address.as_ref())
                        else {
                            panic!("a socket address")
                        };
                        let Some(PortSpecifier::PortValue(port)) = sa.port_specifier else {
                            panic!("a port")
                        };
                        format!("{}:{port}", sa.address)
                    })
                    .collect();
                (l.priority, hosts)
            })
            .collect();
        assert_eq!(
            by_priority,
            [
                (0, vec!["10.0.0.1:19000".to_string()]),
                (
                    1,
                    vec!["10.0.0.2:19000".to_string(), "fd00::3:19000".to_string()]
                )
            ]
        );

        // Alone in its fleet: itself only. Not knowing itself (never in a running process):
        // the others take priority 0, as priorities must not skip.
        snapshot.control = Arc::new(ControlMembers {
            local: Some(addr("10.0.0.1:19000")),
            peers: Vec::new(),
        });
        let alone = control_load_assignment(&snapshot.control);
        assert_eq!(alone.endpoints.len(), 1);
        assert_eq!(alone.endpoints[0].priority, 0);
        let others = control_load_assignment(&ControlMembers {
            local: None,
            peers: vec![addr("10.0.0.2:19000")],
        });
        assert_eq!(others.endpoints.len(), 1);
        assert_eq!(others.endpoints[0].priority, 0);
    }

    #[test]
    fn outlier_detection_is_on_only_when_the_options_say_so() {
        let snapshot = two_services();
        let route = &snapshot.services["inventory"];
        let off = cluster("inventory", route, &ResourceOptions::default());
        assert_eq!(off.outlier_detection, None);
        let on = cluster(
            "inventory",
            route,
            &ResourceOptions {
                envoy_outlier_detection: true,
            },
        );
        let od = on
            .outlier_detection
            .expect("outlier detection when asked for");
        assert_eq!(od.consecutive_5xx, u32_value(5));
        assert_eq!(od.base_ejection_time, Some(duration_secs(30)));
    }

    #[test]
    fn cluster_is_eds_over_ads_without_panic_mode_and_with_the_service_bulkhead() {
        let built = build(&two_services());
        let c: Cluster = decode(&built[&ResourceType::Cluster]["mcp.inventory"]);
        assert_eq!(
            c.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
        );
        let eds = c
            .eds_cluster_config
            .expect("eds config")
            .eds_config
            .expect("source");
        assert!(matches!(
            eds.config_source_specifier,
            Some(ConfigSourceSpecifier::Ads(_))
        ));
        assert_eq!(eds.resource_api_version, ApiVersion::V3 as i32);
        assert_eq!(c.connect_timeout, Some(duration_secs(1)));

        let lb = c.common_lb_config.expect("common lb config");
        assert_eq!(lb.healthy_panic_threshold, Some(Percent { value: 0.0 }));

        // The same bulkhead twice: calls at the default priority, GET streams at their own.
        let t = c.circuit_breakers.expect("circuit breakers").thresholds;
        let priorities: Vec<i32> = t.iter().map(|t| t.priority).collect();
        assert_eq!(
            priorities,
            [RoutingPriority::Default as i32, GET_STREAM_PRIORITY as i32]
        );
        for t in &t {
            assert_eq!(t.max_connections, u32_value(11));
            assert_eq!(t.max_pending_requests, u32_value(12));
            assert_eq!(t.max_requests, u32_value(13));
            assert_eq!(t.max_retries, u32_value(2));
        }

        let opts: HttpProtocolOptions =
            decode(&c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY]);
        assert!(matches!(
            opts.upstream_protocol_options,
            Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(ProtocolConfig::HttpProtocolOptions(_))
                }
            ))
        ));
    }

    #[test]
    fn endpoints_carry_health_weight_at_least_one_and_the_instance_id() {
        let built = build(&two_services());
        let cla: ClusterLoadAssignment = decode(&built[&ResourceType::Endpoint]["mcp.inventory"]);
        assert_eq!(cla.endpoints.len(), 1);
        let got: Vec<(String, String, u32, i32, u32)> = cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| {
                let Some(HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                    panic!("endpoint without address")
                };
                let Some(address::Address::SocketAddress(sa)) =
                    ep.address.as_ref().and_then(|a| a.address.clone())
                else {
                    panic!("not a socket address")
                };
                let Some(PortSpecifier::PortValue(port)) = sa.port_specifier else {
                    panic!("no port")
                };
                assert_eq!(e.metadata, None, "per-host metadata costs Envoy per host");
                (
                    ep.hostname.clone(),
                    sa.address,
                    port,
                    e.health_status,
                    e.load_balancing_weight.expect("weight").value,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "inv-a".into(),
                    "10.0.0.1".into(),
                    8080,
                    HealthStatus::Healthy as i32,
                    10
                ),
                (
                    "inv-b".into(),
                    "10.0.0.2".into(),
                    8080,
                    HealthStatus::Draining as i32,
                    1
                ),
                (
                    "inv-c".into(),
                    "10.0.0.3".into(),
                    8080,
                    HealthStatus::Unhealthy as i32,
                    1
                ),
            ]
        );
    }

    #[test]
    fn services_with_the_default_path_and_timeout_share_routes_whose_cluster_the_filter_names() {
        let snap = two_services();
        let built = build(&snap);
        let rc: RouteConfiguration = decode(&built[&ResourceType::Route][SHARED_ROUTE_CONFIG_NAME]);
        assert_eq!(rc.name, SHARED_ROUTE_CONFIG_NAME);
        let vh = &rc.virtual_hosts[0];
        // The filter's header is for Envoy and the verified payload for the filter: both
        // taken off before any request goes upstream.
        assert_eq!(
            vh.request_headers_to_remove,
            [CLUSTER_HEADER, toolgate_model::auth::PAYLOAD_HEADER]
        );
        let names: Vec<&str> = vh
            .routes
            .iter()
            .filter(|r| !is_virtual(r))
            .map(|r| r.name.as_str())
            .collect();
        // inventory (MCP path /rpc) keeps its own routes, before the shared ones; billing
        // (the default path and timeout) has none.
        assert_eq!(
            names,
            [
                "inventory/get-stream",
                "inventory",
                SHARED_ROUTE_NAME_GET_STREAM,
                SHARED_ROUTE_NAME
            ]
        );
        let shared: Vec<&Route> = vh
            .routes
            .iter()
            .filter(|r| r.name.starts_with(SHARED_ROUTE_NAME))
            .collect();
        for (r, get_stream) in shared.into_iter().zip([true, false]) {
            let m = r.r#match.as_ref().expect("match");
            assert_eq!(
                m.path_specifier,
                Some(PathSpecifier::Prefix("/mcp/".into()))
            );
            assert_eq!(m.headers.len(), usize::from(get_stream), "{}", r.name);
            let Some(route::Action::Route(a)) = &r.action else {
                panic!("not a route action")
            };
            assert_eq!(
                a.cluster_specifier,
                Some(ClusterSpecifier::ClusterHeader(CLUSTER_HEADER.into()))
            );
            assert_eq!(
                a.cluster_not_found_response_code,
                ClusterNotFoundResponseCode::NotFound as i32,
                "a path no service has is a 404 as before, not a 503"
            );
            let rewrite = a.regex_rewrite.as_ref().expect("rewritten");
            assert_eq!(
                rewrite.pattern.as_ref().map(|p| p.regex.as_str()),
                Some("^/mcp/[^/?]+")
            );
            assert_eq!(rewrite.substitution, DEFAULT_MCP_PATH);
            assert!(a.prefix_rewrite.is_empty());
            let timeout = a.timeout.expect("timeout");
            assert_eq!(timeout.seconds, if get_stream { 0 } else { 60 });
        }
        // Without the filter every service has its routes, and nothing reads the header.
        let full: RouteConfiguration = decode(&built[&ResourceType::Route][ROUTE_CONFIG_NAME]);
        assert!(full.virtual_hosts[0]
            .routes
            .iter()
            .all(|r| !r.name.starts_with(SHARED_ROUTE_NAME)));
        assert_eq!(
            full.virtual_hosts[0]
                .routes
                .iter()
                .filter(|r| !is_virtual(r))
                .count(),
            4
        );
        // A service whose timeout is not the default's has routes of its own too.
        let mut other_default = two_services();
        other_default.default_timeout_ms = 30_000;
        let rc = shared_route_configuration(&other_default);
        assert_eq!(
            rc.virtual_hosts[0]
                .routes
                .iter()
                .filter(|r| !is_virtual(r) && !r.name.starts_with(SHARED_ROUTE_NAME))
                .count(),
            4
        );
    }

    #[test]
    fn routes_rewrite_to_mcp_path_and_get_streams_have_no_timeout() {
        let built = build(&two_services());
        let rc: RouteConfiguration = decode(&built[&ResourceType::Route][ROUTE_CONFIG_NAME]);
        assert_eq!(rc.name, ROUTE_CONFIG_NAME);
        assert_eq!(rc.virtual_hosts.len(), 1);
        let vh = &rc.virtual_hosts[0];
        assert_eq!(vh.domains, ["*"]);
        // Connect failures retry on another host, for every route through the virtual host's
        // policy; a route's own policy would replace it, not add to it.
        let retry = vh.retry_policy.as_ref().expect("virtual host retry policy");
        assert_eq!(retry.retry_on, "connect-failure,refused-stream");
        assert_eq!(
            retry.retry_host_predicate[0].name,
            "envoy.retry_host_predicates.previous_hosts"
        );
        for r in &vh.routes {
            let Some(route::Action::Route(a)) = &r.action else {
                continue;
            };
            if !is_virtual(r) {
                assert_eq!(
                    a.retry_policy, None,
                    "route {} has its own retry policy",
                    r.name
                );
                continue;
            }
            // The aggregate endpoint's requests run no tool: one its toolgate-xds dropped
            // (reset) goes again, to another priority of the control cluster.
            let own = a
                .retry_policy
                .as_ref()
                .expect("the aggregate's retry policy");
            assert_eq!(
                own.retry_on, "connect-failure,refused-stream,reset",
                "{}",
                r.name
            );
            assert_eq!(
                own.retry_priority.as_ref().map(|p| p.name.as_str()),
                Some("envoy.retry_priorities.previous_priorities")
            );
            assert_eq!(own.retry_host_predicate, retry.retry_host_predicate);
        }
        let summary: Vec<(String, bool, String, String, i64)> = vh
            .routes
            .iter()
            .filter(|r| !is_virtual(r))
            .map(|r| {
                let m = r.r#match.as_ref().expect("match");
                let Some(PathSpecifier::PathSeparatedPrefix(prefix)) = &m.path_specifier else {
                    panic!("not a path_separated_prefix")
                };
                let get_only = match m.headers.as_slice() {
                    [] => false,
                    [h] => {
                        assert_eq!(h.name, ":method");
                        assert_eq!(
                            h.header_match_specifier,
                            Some(HeaderMatchSpecifier::StringMatch(StringMatcher {
                                match_pattern: Some(MatchPattern::Exact("GET".into())),
                                ignore_case: false,
                            }))
                        );
                        true
                    }
                    _ => panic!("unexpected header matchers"),
                };
                let Some(route::Action::Route(a)) = &r.action else {
                    panic!("not a route action")
                };
                let Some(ClusterSpecifier::Cluster(cluster)) = &a.cluster_specifier else {
                    panic!("no cluster")
                };
                assert_eq!(*prefix, format!("/mcp/{}", &cluster["mcp.".len()..]));
                (
                    cluster.clone(),
                    get_only,
                    a.prefix_rewrite.clone(),
                    prefix.clone(),
                    a.timeout.expect("timeout set").seconds,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "mcp.billing".into(),
                    true,
                    "/mcp".into(),
                    "/mcp/billing".into(),
                    0
                ),
                (
                    "mcp.billing".into(),
                    false,
                    "/mcp".into(),
                    "/mcp/billing".into(),
                    60
                ),
                (
                    "mcp.inventory".into(),
                    true,
                    "/rpc".into(),
                    "/mcp/inventory".into(),
                    0
                ),
                (
                    "mcp.inventory".into(),
                    false,
                    "/rpc".into(),
                    "/mcp/inventory".into(),
                    60
                ),
            ]
        );
    }

    #[test]
    fn get_streams_have_their_own_priority_idle_limit_and_duration_and_calls_their_timeout() {
        let rc = route_configuration(&two_services());
        let action = |name: &str| {
            let r = rc.virtual_hosts[0]
                .routes
                .iter()
                .find(|r| r.name == name)
                .unwrap_or_else(|| panic!("no route {name}"));
            let Some(route::Action::Route(a)) = &r.action else {
                panic!("not a route action")
            };
            a.clone()
        };
        let get = action("inventory/get-stream");
        assert_eq!(get.priority, GET_STREAM_PRIORITY as i32);
        assert_ne!(get.priority, RoutingPriority::Default as i32);
        assert_eq!(get.timeout, Some(duration_secs(0)));
        assert_eq!(
            get.idle_timeout,
            Some(duration_secs(GET_STREAM_IDLE_TIMEOUT_SECS))
        );
        assert_eq!(
            get.max_stream_duration.and_then(|m| m.max_stream_duration),
            Some(duration_secs(GET_STREAM_MAX_DURATION_SECS))
        );
        let call = action("inventory");
        assert_eq!(call.priority, RoutingPriority::Default as i32);
        assert_eq!(call.timeout, Some(duration_ms(60_000)));
        assert_eq!(call.idle_timeout, Some(duration_ms(60_000)));
        assert_eq!(call.max_stream_duration, None);
    }

    #[test]
    fn same_content_encodes_to_the_same_bytes() {
        let a = two_services();
        let mut b = two_services();
        // Another generation and another order of the same instances is the same content.
        b.generation = 7;
        if let Some(s) = b.services.get_mut("inventory") {
            Arc::make_mut(s).endpoints.reverse();
        }
        assert_eq!(build(&a), build(&b));
    }

    #[test]
    fn envoy_may_buffer_a_body_beyond_the_filters_limit_plus_one_read() {
        let mut snap = two_services();
        snap.max_body_bytes = 4 * 1024 * 1024;
        let rc = route_configuration(&snap);
        let limit = rc.virtual_hosts[0]
            .request_body_buffer_limit
            .as_ref()
            .expect("a request body buffer limit")
            .value;
        assert!(
            limit >= snap.max_body_bytes + LISTENER_BUFFER_BYTES,
            "{limit}"
        );
    }

    #[test]
    fn no_services_still_yields_an_empty_route_configuration() {
        let built = build(&RoutingSnapshot::empty());
        assert!(built[&ResourceType::Cluster].is_empty());
        assert_eq!(
            built[&ResourceType::Endpoint].keys().collect::<Vec<_>>(),
            [CONTROL_CLUSTER],
            "only the control cluster's assignment"
        );
        let rc: RouteConfiguration = decode(&built[&ResourceType::Route][ROUTE_CONFIG_NAME]);
        assert!(
            rc.virtual_hosts[0].routes.iter().all(is_virtual),
            "only the aggregate endpoint's routes"
        );
    }

    /// A route to the control cluster, or the answer to an unknown virtual server.
    fn is_virtual(r: &Route) -> bool {
        match &r.action {
            Some(route::Action::Route(a)) => {
                a.cluster_specifier == Some(ClusterSpecifier::Cluster(CONTROL_CLUSTER.to_string()))
            }
            Some(route::Action::DirectResponse(_)) => true,
            _ => false,
        }
    }

    #[test]
    fn virtual_servers_are_routed_to_toolgate_xds_on_paths_no_service_can_take() {
        let mut snap = two_services();
        snap.virtual_servers = vec!["default".into(), "ops".into()];
        let rc = route_configuration(&snap);
        let routes = &rc.virtual_hosts[0].routes;
        let summary: Vec<(String, bool, String, i64)> = routes
            .iter()
            .filter_map(|r| {
                let m = r.r#match.as_ref()?;
                let Some(PathSpecifier::Path(path)) = &m.path_specifier else {
                    return None;
                };
                let Some(route::Action::Route(a)) = &r.action else {
                    panic!("not a route action")
                };
                assert_eq!(
                    a.cluster_specifier,
                    Some(ClusterSpecifier::Cluster(CONTROL_CLUSTER.into()))
                );
                let disabled: StatefulSessionPerRoute =
                    decode(&r.typed_per_filter_config[STATEFUL_SESSION_FILTER]);
                assert_eq!(
                    disabled.r#override,
                    Some(stateful_session_per_route::Override::Disabled(true)),
                    "no session affinity on {path}"
                );
                if m.headers.is_empty() {
                    assert_eq!(a.timeout, Some(duration_ms(60_000)), "{path}");
                } else {
                    assert_eq!(a.timeout, Some(duration_secs(0)), "{path}");
                    assert_eq!(
                        a.idle_timeout,
                        Some(duration_secs(GET_STREAM_IDLE_TIMEOUT_SECS))
                    );
                    assert_eq!(
                        a.max_stream_duration.and_then(|m| m.max_stream_duration),
                        Some(duration_secs(GET_STREAM_MAX_DURATION_SECS))
                    );
                    assert_eq!(a.priority, GET_STREAM_PRIORITY as i32);
                }
                Some((
                    path.clone(),
                    !m.headers.is_empty(),
                    a.prefix_rewrite.clone(),
                    a.timeout.map_or(-1, |t| t.seconds),
                ))
            })
            .collect();
        let expect = |path: &str, get: bool, name: &str| {
            (
                path.to_string(),
                get,
                format!("/v1/aggregate/{name}"),
                if get { 0 } else { 60 },
            )
        };
        assert_eq!(
            summary,
            [
                expect("/mcp", true, "default"),
                expect("/mcp", false, "default"),
                expect("/virtual/default", true, "default"),
                expect("/virtual/default", false, "default"),
                expect("/virtual/ops", true, "ops"),
                expect("/virtual/ops", false, "ops"),
            ]
        );
        // Any other name under /virtual/ gets a JSON-RPC error, after the named routes.
        let last = routes.last().expect("routes");
        assert_eq!(
            last.r#match.as_ref().and_then(|m| m.path_specifier.clone()),
            Some(PathSpecifier::Prefix("/virtual/".into()))
        );
        let Some(route::Action::DirectResponse(d)) = &last.action else {
            panic!("not a direct response")
        };
        assert_eq!(d.status, 404);

        // A call through a virtual server may last as long as the slowest service allows.
        Arc::make_mut(snap.services.get_mut("billing").expect("billing")).timeout_ms = 120_000;
        let rc = route_configuration(&snap);
        let mcp = rc.virtual_hosts[0]
            .routes
            .iter()
            .find(|r| r.name == "/mcp")
            .expect("the /mcp route");
        let Some(route::Action::Route(a)) = &mcp.action else {
            panic!("not a route action")
        };
        assert_eq!(a.timeout, Some(duration_ms(120_000)));
    }

    #[test]
    fn a_shards_route_configuration_keeps_its_services_and_everything_not_a_service() {
        let mut snapshot = RoutingSnapshot::empty();
        for name in ["alpha", "beta"] {
            let route = ServiceRoute {
                mcp_path: "/mcp".to_string(),
                limits: Bulkhead::default(),
                timeout_ms: 1_000,
                credential_header: None,
                endpoints: Vec::new(),
            };
            snapshot.services.insert(name.to_string(), route.into());
        }
        // Both tables; the shared one also has the routes every service without its own
        // takes (a shard's Envoy holds only its services' clusters, so they reach no other).
        for full in [
            route_configuration(&snapshot),
            shared_route_configuration(&snapshot),
        ] {
            let any = to_any(&full);
            let only = ServiceSelector::parse_list("alpha").unwrap();
            let cut = RouteConfiguration::decode(
                only.route_configuration(&any).unwrap().value.as_slice(),
            )
            .unwrap();
            let names = |rc: &RouteConfiguration| -> Vec<String> {
                rc.virtual_hosts[0]
                    .routes
                    .iter()
                    .map(|r| r.name.clone())
                    .collect()
            };
            let kept = names(&cut);
            assert!(kept.contains(&"alpha".to_string()));
            assert!(kept.contains(&"alpha/get-stream".to_string()));
            assert!(!kept.iter().any(|n| n.starts_with("beta")));
            // Everything else (the aggregate endpoint, the unknown virtual server, the shared
            // routes) stays.
            let others: Vec<String> = names(&full)
                .into_iter()
                .filter(|n| !n.starts_with("alpha") && !n.starts_with("beta"))
                .collect();
            assert!(!others.is_empty());
            assert!(others.iter().all(|n| kept.contains(n)));
            assert_eq!(
                kept.iter().any(|n| n.starts_with("mcp/*")),
                full.name == SHARED_ROUTE_CONFIG_NAME
            );
        }
    }
}
