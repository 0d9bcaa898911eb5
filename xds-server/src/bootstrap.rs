//! The Envoy bootstrap printed by `toolgate-xds bootstrap`: everything static an Envoy needs to
//! join toolgate. The only static parts are the listener, the HTTP filters and the way to reach
//! toolgate-xds; clusters, endpoints and routes all come over ADS, and so do the control
//! cluster's hosts (the fleet's toolgate-xds admin listeners).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde_json::{json, Value};
use toolgate_model::envoy::CONTROL_CLUSTER;

use crate::xds::resources::{LISTENER_BUFFER_BYTES, ROUTE_CONFIG_NAME, SHARED_ROUTE_CONFIG_NAME};
use crate::xds::{auth, ecds};

/// Name of the static cluster that reaches toolgate-xds.
pub const XDS_CLUSTER: &str = "toolgate_xds";
/// Name of the static listener agents connect to.
pub const LISTENER_NAME: &str = "toolgate_mcp";
/// `stat_prefix` of the HTTP connection manager (`http.toolgate.*` stats).
pub const STAT_PREFIX: &str = "toolgate";
/// MCP's session header (Streamable HTTP, protocol versions up to 2025-11-25).
pub const SESSION_HEADER: &str = "Mcp-Session-Id";
/// Stats tags of the filter's per-tool stats.
pub const SERVICE_TAG: &str = "service";
pub const TOOL_TAG: &str = "tool";
pub const REASON_TAG: &str = "reason";
/// Takes `reason=<reason>.` out of a denial counter's name as the tag `reason`.
pub const REASON_TAG_REGEX: &str =
    r"^wasmcustom\.toolgate\.auth\.service=[^=]+\.(reason=([^=]+)\.)denied$";
/// Takes `service=<name>.` out of the filter's stat names (`wasmcustom.toolgate.service=<name>
/// .tool=<name>.<kind>`, see the filter's `stats.rs`) as the tag `service`. Names may contain
/// dots but never `=`, so `[^=]+` ends exactly at the service's last character.
/// The filter's denial counters (`wasmcustom.toolgate.auth.service=<name>.reason=<reason>
/// .denied`, issue 20) carry it too.
pub const SERVICE_TAG_REGEX: &str =
    r"^wasmcustom\.toolgate\.(?:auth\.)?(service=([^=]+)\.)(?:tool|reason)=";
/// Takes `tool=<name>.` out as the tag `tool`; the kind (`calls`, `state`, ...) is the last
/// segment and has no dot, so a tool name with dots is taken whole.
/// The call-limit counters (`...tool=<name>.rule=<rule>.limited_total`) carry a rule after
/// the tool.
pub const TOOL_TAG_REGEX: &str =
    r"^wasmcustom\.toolgate\.service=[^=]+\.(tool=([^=]+)\.)(?:rule=[^=]+\.)?[a-z_]+$";
pub const RULE_TAG: &str = "rule";
/// Takes `rule=<name>.` out of a call-limit counter's name as the tag `rule` (rule names
/// have no dots).
pub const RULE_TAG_REGEX: &str =
    r"^wasmcustom\.toolgate\.service=[^=]+\.tool=[^=]+\.(rule=([^=.]+)\.)limited_total$";

/// toolgate-xds's liveness path, which Envoy's health checks of the control cluster ask.
pub const CONTROL_HEALTH_PATH: &str = "/healthz";

/// Envoy's own MCP filter (Envoy 1.37 and later), see [`BootstrapOptions::native_mcp_filter`].
pub const NATIVE_MCP_FILTER: &str = "envoy.filters.http.mcp";

/// Which variant of the ADS protocol Envoy speaks to toolgate-xds; toolgate-xds serves both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum XdsProtocol {
    // (Plain comments: doc comments here would turn `--help` into clap's long format.)
    // Incremental xDS (`DELTA_GRPC`): each push carries only the resources that changed and
    // names the ones removed, so a new service costs one cluster, not all of them again.
    #[default]
    Delta,
    // State of the world (`GRPC`): every CDS push carries every cluster.
    Sotw,
}

/// Which route configuration an Envoy with the toolgate filter asks for (without the filter it
/// is always one route per service: nothing would name the shared routes' cluster).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RouteTable {
    // (Plain comments, as for `XdsProtocol`.)
    // Services with the default MCP path and timeout share two routes whose cluster the
    // toolgate filter names: a new service changes no route.
    #[default]
    Shared,
    // Two routes per service, as without the filter: for a wasm filter that does not name
    // clusters (the bench's no-op and probe filters in the toolgate filter's place).
    PerService,
}

impl RouteTable {
    /// The name of the route configuration holding this table.
    pub const fn config_name(self) -> &'static str {
        match self {
            RouteTable::Shared => SHARED_ROUTE_CONFIG_NAME,
            RouteTable::PerService => ROUTE_CONFIG_NAME,
        }
    }
}

impl XdsProtocol {
    /// The bootstrap's `ads_config.api_type`.
    pub const fn api_type(self) -> &'static str {
        match self {
            XdsProtocol::Delta => "DELTA_GRPC",
            XdsProtocol::Sotw => "GRPC",
        }
    }
}

/// What `render` needs to know.
#[derive(Debug, Clone)]
pub struct BootstrapOptions {
    /// The ADS protocol variant Envoy speaks.
    pub xds_protocol: XdsProtocol,
    /// `node.id`: names this Envoy in toolgate-xds's logs.
    pub node_id: String,
    /// `node.cluster`: the Envoy fleet this one belongs to.
    pub cluster: String,
    /// Where agents connect (the MCP listener).
    pub listen: SocketAddr,
    /// Where toolgate-xds serves ADS.
    pub xds: Upstream,
    /// Envoy's admin interface; keep it on loopback, it can change Envoy's state.
    pub admin: SocketAddr,
    /// The toolgate wasm filter; its configuration then comes over ECDS. Without it Envoy
    /// routes, but no breaker protects the tools.
    pub filter: Option<PathBuf>,
    /// Envoy's own MCP filter ([`NATIVE_MCP_FILTER`], its default configuration) where the
    /// toolgate filter would be: a reference for the data-plane bench, not a way to deploy
    /// toolgate (no breaker, no auth). Ignored when `filter` is set; the CLI refuses both.
    pub native_mcp_filter: bool,
    /// The route configuration asked for when `filter` is set.
    pub route_table: RouteTable,
    /// mTLS to toolgate-xds's ADS listener (a toolgate-xds started with `--xds-tls-*`).
    pub xds_tls: Option<XdsClientTls>,
    /// Where Envoy writes its access log, one JSON object per request (see
    /// [`access_log_format`]); `None`: no access log.
    pub access_log: Option<PathBuf>,
    /// A shard's services (node metadata `toolgate.services`); `None`: every service.
    pub services: Option<crate::xds::shard::ServiceSelector>,
    /// What one client may hold at the MCP listener.
    pub edge: EdgeLimits,
}

/// Bounds on what clients can hold at the MCP listener: time to send a request, connections,
/// and Envoy's heap. None of them touches a response once its request is in, so a long
/// `tools/call` or MCP's GET stream is unaffected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeLimits {
    /// The whole request (headers and body) must arrive within this, or Envoy answers 408 and
    /// closes the connection. The stream idle timeout cannot do this job: every byte of a
    /// trickled body resets it.
    pub request_timeout: Duration,
    /// The request headers must arrive within this from their first byte.
    pub request_headers_timeout: Duration,
    /// A client connection with no request in flight is closed after this, so idle
    /// connections do not sit on the connection limit.
    pub idle_timeout: Duration,
    /// Connections to the MCP listener at once; further ones are closed as they are accepted.
    /// Also Envoy's global downstream limit (the admin listener is exempt from it).
    pub max_connections: u32,
    /// The heap Envoy may use before its overload manager sheds load (see
    /// [`overload_manager`]).
    pub max_heap_bytes: u64,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        EdgeLimits {
            request_timeout: Duration::from_secs(30),
            request_headers_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 10_000,
            max_heap_bytes: 1024 * 1024 * 1024,
        }
    }
}

/// The access log's fields. `mcp.method`, `mcp.tool` and `mcp.breaker` (closed, half_open,
/// open, forced_open) come from the toolgate filter (wasm properties, which Envoy keeps as
/// filter state `wasm.<name>`); they are empty for requests the filter does not judge.
/// `traceparent` is W3C trace context as the agent sent it: Envoy passes it to the server
/// untouched (the bootstrap configures no tracer that would rewrite it).
pub fn access_log_format() -> Value {
    json!({
        "start_time": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
        "status": "%RESPONSE_CODE%",
        "response_flags": "%RESPONSE_FLAGS%",
        "duration_ms": "%DURATION%",
        "mcp.method": "%FILTER_STATE(wasm.mcp_method:PLAIN)%",
        "mcp.tool": "%FILTER_STATE(wasm.mcp_tool:PLAIN)%",
        "mcp.breaker": "%FILTER_STATE(wasm.mcp_breaker:PLAIN)%",
        "auth.subject": "%FILTER_STATE(wasm.mcp_subject:PLAIN)%",
        "auth.denied": "%FILTER_STATE(wasm.mcp_denied:PLAIN)%",
        "mcp.limit": "%FILTER_STATE(wasm.mcp_limit:PLAIN)%",
        "mcp.service": "%FILTER_STATE(wasm.mcp_service:PLAIN)%",
        "mcp.decision": "%FILTER_STATE(wasm.mcp_decision:PLAIN)%",
        "mcp.reason": "%FILTER_STATE(wasm.mcp_reason:PLAIN)%",
        "client": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
        "mcp.session": "%REQ(MCP-SESSION-ID)%",
        "upstream_cluster": "%UPSTREAM_CLUSTER%",
        "upstream_host": "%UPSTREAM_HOST%",
        "traceparent": "%REQ(TRACEPARENT)%",
        "request_id": "%REQ(X-REQUEST-ID)%"
    })
}

/// The files Envoy presents and trusts on its ADS connection.
#[derive(Debug, Clone)]
pub struct XdsClientTls {
    /// CA that signed toolgate-xds's certificate.
    pub ca: PathBuf,
    /// Envoy's own certificate and key (toolgate-xds checks them against its client CA).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The name toolgate-xds's certificate carries (SNI and SAN check); `None`: the name or
    /// IP address in `xds`.
    pub server_name: Option<String>,
}

/// Where Envoy reaches a toolgate-xds listener: an IP address, or a DNS name that Envoy
/// resolves itself (a Compose or Kubernetes service name), with a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    Ip(SocketAddr),
    Dns { host: String, port: u16 },
}

impl FromStr for Upstream {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(Upstream::Ip(addr));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?} is not host:port"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{s:?}: the port {port:?} is not a number from 0 to 65535"))?;
        // A DNS name (RFC 1123 labels); anything else would reach Envoy as a name it cannot
        // resolve, found only when the cluster never gets a host.
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
            return Err(format!(
                "{s:?}: {host:?} is neither an IP address nor a DNS name"
            ));
        }
        Ok(Upstream::Dns {
            host: host.to_string(),
            port,
        })
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upstream::Ip(a) => write!(f, "{a}"),
            Upstream::Dns { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl Upstream {
    fn address(&self) -> Value {
        match self {
            Upstream::Ip(a) => socket_address(*a),
            Upstream::Dns { host, port } => {
                json!({ "socket_address": { "address": host, "port_value": port } })
            }
        }
    }

    /// A name is resolved by Envoy, again whenever its DNS answer may have changed (a
    /// restarted toolgate-xds pod gets a new address behind the same service name).
    fn cluster_type(&self) -> &'static str {
        match self {
            Upstream::Ip(_) => "STATIC",
            Upstream::Dns { .. } => "STRICT_DNS",
        }
    }

    /// The cluster fields that say how to reach it.
    fn cluster(&self, name: &str) -> Value {
        let mut c = json!({
            "name": name,
            "type": self.cluster_type(),
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": self.address() } }] }]
            }
        });
        if let Upstream::Dns { .. } = self {
            c["dns_lookup_family"] = json!("V4_PREFERRED");
        }
        c
    }
}

/// A complete Envoy bootstrap (pretty JSON, which Envoy reads as YAML too).
pub fn render(opts: &BootstrapOptions) -> String {
    let value = bootstrap(opts);
    // Serializing a `serde_json::Value` cannot fail.
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

/// The node; its metadata tells toolgate-xds where this Envoy finds the wasm filter, since only
/// the Envoy's own filesystem knows, whether an access log reads the filter's fields, and,
/// for a shard, which services this Envoy serves.
fn node(opts: &BootstrapOptions) -> Value {
    let mut node = json!({ "id": opts.node_id, "cluster": opts.cluster });
    if let Some(path) = &opts.filter {
        // Envoy resolves a relative filename against its own working directory, which need not
        // be ours: make it absolute while we still know what it meant.
        let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
        let mut toolgate = json!({
            ecds::NODE_FILTER_PATH_FIELD: path.to_string_lossy(),
            // This bootstrap strips the verified-payload header from incoming requests and runs
            // `jwt_authn` before the filter: only then may the filter trust that header.
            ecds::NODE_JWT_AUTHN_FIELD: "1",
        });
        if let Some(log) = &opts.access_log {
            toolgate[ecds::NODE_ACCESS_LOG_FIELD] = json!(log.display().to_string());
        }
        node["metadata"] = json!({ ecds::NODE_METADATA_KEY: toolgate });
    }
    if let Some(services) = &opts.services {
        node["metadata"][ecds::NODE_METADATA_KEY][crate::xds::shard::NODE_SERVICES_FIELD] =
            json!(services.patterns());
    }
    node
}

fn socket_address(addr: SocketAddr) -> Value {
    json!({ "socket_address": { "address": addr.ip().to_string(), "port_value": addr.port() } })
}

/// "Fetch this over the ADS stream."
fn ads_source() -> Value {
    json!({ "ads": {}, "resource_api_version": "V3" })
}

fn bootstrap(opts: &BootstrapOptions) -> Value {
    json!({
        "node": node(opts),
        // Envoy's admin stays reachable at the connection limit (it is on loopback).
        "admin": { "address": socket_address(opts.admin), "ignore_global_conn_limit": true },
        "dynamic_resources": {
            "ads_config": {
                "api_type": opts.xds_protocol.api_type(),
                "transport_api_version": "V3",
                // The node is sent once per stream, not in every request.
                "set_node_on_first_message_only": true,
                "grpc_services": [{ "envoy_grpc": { "cluster_name": XDS_CLUSTER } }]
            },
            "cds_config": ads_source()
        },
        "static_resources": {
            "clusters": [xds_cluster(&opts.xds, opts.xds_tls.as_ref()), control_cluster()],
            "listeners": [listener(opts)]
        },
        "stats_config": stats_config(),
        // A cluster's traffic counters (upstream_rq_*, upstream_cx_*, ...) are made at its
        // first request instead of with the cluster: a fresh Envoy creates 1,000 clusters about
        // a third faster and holds ~20 MiB less at 10,000 endpoints (`make bench`, scale).
        "deferred_stat_options": { "enable_deferred_creation_stats": true },
        "overload_manager": overload_manager(&opts.edge),
        "layered_runtime": layered_runtime(&opts.edge)
    })
}

/// A protobuf JSON duration (`"2.5s"`).
fn proto_duration(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// Below this many bytes a stream's buffers are not tracked for `reset_high_memory_stream`
/// (2^18 = 256 KiB, so a body near the default 1 MiB limit is tracked).
const TRACKED_STREAM_BUFFER_POWER_OF_TWO: u32 = 18;

/// Envoy's overload manager, on a fixed heap budget (`max_heap_bytes`), so a flood of clients
/// that each hold a little memory meets a ceiling instead of the OOM killer:
/// - from 85% of the budget, streams holding the most buffered bytes are reset, the largest
///   first, all tracked ones by 95% (Envoy does this for HTTP/2 streams only);
/// - at 90% Envoy returns free memory to the system;
/// - at 95% new requests get 503 and new connections are closed as they are accepted;
/// - at 98% Envoy stops reading HTTP/1 requests (answering or closing them): the HTTP/1
///   counterpart of the stream reset.
///
/// A connection counter is a resource monitor too: with it, Envoy enforces one limit over all
/// listeners (and stops warning at startup that there is none). The admin listener is exempt
/// but counted, so the global limit leaves it [`ADMIN_CONNECTIONS`] above the MCP listener's
/// own limit, which is the one clients meet.
pub fn overload_manager(edge: &EdgeLimits) -> Value {
    let heap = |value: f64| json!([{ "name": FIXED_HEAP, "threshold": { "value": value } }]);
    json!({
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {
                "name": FIXED_HEAP,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": edge.max_heap_bytes
                }
            },
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": u64::from(edge.max_connections) + ADMIN_CONNECTIONS
                }
            }
        ],
        "buffer_factory_config": {
            "minimum_account_to_track_power_of_two": TRACKED_STREAM_BUFFER_POWER_OF_TWO
        },
        "actions": [
            {
                "name": "envoy.overload_actions.reset_high_memory_stream",
                "triggers": [{
                    "name": FIXED_HEAP,
                    "scaled": { "scaling_threshold": 0.85, "saturation_threshold": 0.95 }
                }]
            },
            { "name": "envoy.overload_actions.shrink_heap", "triggers": heap(0.90) },
            { "name": "envoy.overload_actions.stop_accepting_requests", "triggers": heap(0.95) }
        ],
        "loadshed_points": [
            { "name": "envoy.load_shed_points.tcp_listener_accept", "triggers": heap(0.95) },
            { "name": "envoy.load_shed_points.http1_server_abort_dispatch", "triggers": heap(0.98) }
        ]
    })
}

/// The fixed heap resource monitor's name (actions name their trigger by it).
const FIXED_HEAP: &str = "envoy.resource_monitors.fixed_heap";

/// Room for admin connections (probes, stats scrapes, the preStop drain) above the MCP
/// listener's connection limit in Envoy's global one.
pub const ADMIN_CONNECTIONS: u64 = 16;

/// Runtime: the MCP listener's connection limit (Envoy has it as a runtime key only), and the
/// admin layer Envoy has by default, kept so `/runtime_modify` still works.
fn layered_runtime(edge: &EdgeLimits) -> Value {
    json!({
        "layers": [
            {
                "name": "toolgate",
                "static_layer": {
                    format!("envoy.resource_limits.listener.{LISTENER_NAME}.connection_limit"): edge.max_connections
                }
            },
            { "name": "admin", "admin_layer": {} }
        ]
    })
}

/// The filter's per-tool stats carry `service` and `tool` as tags: Prometheus shows
/// `toolgate_calls{service="orders",tool="write_order"}`, not one metric name per tool.
fn stats_config() -> Value {
    json!({
        "stats_tags": [
            { "tag_name": SERVICE_TAG, "regex": SERVICE_TAG_REGEX },
            { "tag_name": TOOL_TAG, "regex": TOOL_TAG_REGEX },
            { "tag_name": REASON_TAG, "regex": REASON_TAG_REGEX },
            { "tag_name": RULE_TAG, "regex": RULE_TAG_REGEX }
        ]
    })
}

/// toolgate-xds's admin listeners: the aggregate endpoint (`/mcp`, `/virtual/<name>`), the
/// filter's call reports and its held-session requests (`dispatch_http_call` needs a
/// cluster). Plain HTTP/1.1. Its hosts come over ADS: the toolgate-xds that configures this
/// Envoy at priority 0, the fleet's other live ones at priority 1 (`<prefix>xds/` in etcd),
/// so any of them answers when the local one is gone. A dead one is skipped within a second:
/// its first connect failure or reset ejects it (outlier detection on local-origin errors),
/// and health checks of `/healthz` every half second find it without traffic too and bring
/// it back once it answers. Nothing but connection failures ejects: a toolgate-xds answering
/// 5xx is alive. No panic mode: with no healthy host Envoy answers at once, and the filter
/// answers for the aggregate endpoint itself. Envoy waits for this assignment (and the first
/// health checks) before it is ready; a toolgate-xds that does not serve it, from before it
/// did, leaves Envoy waiting for the initial fetch timeout (15 s) and the cluster empty.
fn control_cluster() -> Value {
    json!({
        "name": CONTROL_CLUSTER,
        "type": "EDS",
        "eds_cluster_config": { "eds_config": ads_source() },
        "connect_timeout": "0.5s",
        "common_lb_config": {
            "healthy_panic_threshold": { "value": 0 },
            "update_merge_window": "0s"
        },
        "health_checks": [{
            "timeout": "0.5s",
            "interval": "0.5s",
            "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "http_health_check": { "path": CONTROL_HEALTH_PATH }
        }],
        "outlier_detection": {
            "split_external_local_origin_errors": true,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_local_origin_success_rate": 0,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 100
        }
    })
}

/// toolgate-xds itself: gRPC needs HTTP/2. The keepalive PINGs find a dead control plane
/// behind a connection that still looks open, so Envoy reconnects (to a restarted one) instead
/// of waiting on a silent stream.
fn xds_cluster(xds: &Upstream, tls: Option<&XdsClientTls>) -> Value {
    let mut cluster = xds.cluster(XDS_CLUSTER);
    cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": { "interval": "30s", "timeout": "10s" }
                    }
                }
            }
    });
    if let Some(tls) = tls {
        // Envoy checks the server's certificate against the CA and the expected name (DNS
        // SAN) or address (IP SAN), and presents its own for toolgate-xds's client check.
        let dns = |name: &str| {
            (
                name.to_string(),
                json!({"san_type": "DNS", "matcher": {"exact": name}}),
            )
        };
        let (sni, san) = match (&tls.server_name, xds) {
            (Some(name), _) => dns(name),
            (None, Upstream::Dns { host, .. }) => dns(host),
            (None, Upstream::Ip(addr)) => (
                String::new(),
                json!({"san_type": "IP_ADDRESS", "matcher": {"exact": addr.ip().to_string()}}),
            ),
        };
        cluster["transport_socket"] = json!({
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": sni,
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [{
                        "certificate_chain": { "filename": tls.cert.display().to_string() },
                        "private_key": { "filename": tls.key.display().to_string() }
                    }],
                    "validation_context": {
                        "trusted_ca": { "filename": tls.ca.display().to_string() },
                        "match_typed_subject_alt_names": [san]
                    }
                }
            }
        });
    }
    cluster
}

/// Request header limits of the MCP listener.
pub const MAX_REQUEST_HEADERS_KB: u32 = 60;
pub const MAX_REQUEST_HEADERS: u32 = 100;

/// Envoy's own refusals that happen before any filter reads the request, as JSON-RPC errors
/// (`id` null: the request was never read): 431, headers too large or too many (refused in
/// the codec); 408, a request that did not arrive within the request or headers timeout; and
/// the overload manager's refusals. Only those are mapped: the filter's replies are local
/// replies too and must pass unchanged.
fn local_reply_config(edge: &EdgeLimits) -> Value {
    let status_is = |status: u16| {
        json!({
            "status_code_filter": {
                "comparison": {
                    "op": "EQ",
                    "value": {
                        "default_value": status,
                        "runtime_key": format!("toolgate.local_reply.{status}")
                    }
                }
            }
        })
    };
    let reply = |filter: Value, code: i32, message: String, data: Value| {
        json!({
            "filter": filter,
            "body_format_override": {
                "json_format": {
                    "jsonrpc": "2.0",
                    "id": null,
                    "error": { "code": code, "message": message, "data": data }
                },
                "content_type": "application/json"
            }
        })
    };
    let mapper = |status: u16, message: String, limits: Value| {
        reply(
            status_is(status),
            -32600,
            message,
            json!({ "io.toolgate/limits": limits }),
        )
    };
    // A request refused by the overload manager: a 503 whose response code details say
    // `overload`. Matching the details too leaves every other 503 ("no healthy upstream", a
    // full bulkhead, the filter's own) alone; Envoy sets no response flag on this one before
    // the mappers run, so a flag filter cannot tell it apart. The HTTP/1 codec's own abort at
    // the last threshold answers a bare 500 and closes the connection.
    let overloaded = || {
        reply(
            json!({ "and_filter": { "filters": [
                status_is(503),
                { "extension_filter": {
                    "name": "envoy.access_loggers.extension_filters.cel",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                        "expression": "response.code_details == 'overload'"
                    }
                } }
            ] } }),
            -32000,
            "This gateway is overloaded and did not take the request; try again in a few seconds."
                .to_string(),
            json!({ "io.toolgate/overload": { "maxHeapBytes": edge.max_heap_bytes } }),
        )
    };
    // A JSON answer the filter held until complete, cut off by its upstream: Envoy answers by
    // itself, past every filter (the response headers were not sent yet). The filter marked
    // the request with the MCP reply for this case. Only an upstream reset matches: a client
    // sending the header itself changes none of Envoy's other replies (and the filter removes
    // it from every request).
    let cut_off = json!({
        "filter": { "and_filter": { "filters": [
            { "header_filter": { "header": {
                "name": toolgate_model::envoy::HELD_HEADER,
                "present_match": true
            } } },
            { "response_flag_filter": { "flags": ["UR", "UC", "UPE"] } }
        ] } },
        "status_code": 200,
        "body_format_override": {
            "text_format_source": {
                "inline_string": format!("%REQ({})%", toolgate_model::envoy::HELD_HEADER)
            },
            "content_type": "application/json"
        }
    });
    let secs = |d: Duration| d.as_secs_f64();
    json!({
        "mappers": [
            cut_off,
            mapper(
                431,
                format!(
                    "The request headers are larger than this gateway accepts ({MAX_REQUEST_HEADERS_KB} KB, {MAX_REQUEST_HEADERS} headers); send fewer or smaller headers."
                ),
                json!({
                    "maxRequestHeadersKb": MAX_REQUEST_HEADERS_KB,
                    "maxRequestHeaders": MAX_REQUEST_HEADERS
                }),
            ),
            mapper(
                408,
                format!(
                    "The request did not arrive in time: this gateway waits {} s for a whole request and {} s for its headers; send it again, without pauses.",
                    secs(edge.request_timeout),
                    secs(edge.request_headers_timeout)
                ),
                json!({
                    "requestTimeoutMs": edge.request_timeout.as_millis() as u64,
                    "requestHeadersTimeoutMs": edge.request_headers_timeout.as_millis() as u64
                }),
            ),
            overloaded()
        ]
    })
}

fn listener(opts: &BootstrapOptions) -> Value {
    // The toolgate filter comes first: it answers an open breaker before anything else runs,
    // and on the way back it is last, so it sees (and can rewrite) the final response.
    let mut http_filters = Vec::new();
    if opts.filter.is_some() {
        // Token verification (issue 20) runs first so the filter reads its verdict; it
        // refuses nothing itself, and without an auth configuration it does nothing.
        http_filters.push(jwt_authn_filter());
        http_filters.push(toolgate_filter());
    } else if opts.native_mcp_filter {
        http_filters.push(native_mcp_filter());
    }
    http_filters.push(session_affinity_filter());
    http_filters.push(router_filter());
    // With the filter, services share routes whose cluster the filter names, so a new service
    // changes no route; without it every service needs its own (see resources.rs).
    let route_config_name = if opts.filter.is_some() {
        opts.route_table
    } else {
        RouteTable::PerService
    }
    .config_name();
    json!({
        "name": LISTENER_NAME,
        "address": socket_address(opts.listen),
        // Envoy's default, explicit: the routes' request body limit is computed from it.
        "per_connection_buffer_limit_bytes": LISTENER_BUFFER_BYTES,
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": STAT_PREFIX,
                    "codec_type": "AUTO",
                    "rds": { "config_source": ads_source(), "route_config_name": route_config_name },
                    // Envoy's default, explicit. Every route sets its own: a call's is its
                    // timeout, MCP's GET stream has its own idle limit (see resources.rs); this
                    // one holds for requests that match no route.
                    "stream_idle_timeout": "300s",
                    // Every byte of a trickled body resets the stream idle timeout: the request
                    // timeout is what bounds a request that never completes. It ends once the
                    // request is in (or the response begins), so responses are not cut.
                    "request_timeout": proto_duration(opts.edge.request_timeout),
                    "request_headers_timeout": proto_duration(opts.edge.request_headers_timeout),
                    // Agents connect directly: their address is the real client address.
                    "use_remote_address": true,
                    // `/mcp/a/../b` must not reach service b's route by way of service a.
                    "normalize_path": true,
                    "merge_slashes": true,
                    // Envoy refuses oversized headers in its codec, before any filter runs: the
                    // limits are explicit here and the refusal is a JSON-RPC error, not a bare
                    // 431 an agent cannot read.
                    "max_request_headers_kb": MAX_REQUEST_HEADERS_KB,
                    "common_http_protocol_options": {
                        "max_headers_count": MAX_REQUEST_HEADERS,
                        "idle_timeout": proto_duration(opts.edge.idle_timeout),
                        // A server (or framework) that reads `x_caller` as `x-caller` would take
                        // a client's underscore spelling for the claim header the gateway sets
                        // from a verified token. Dropped, not refused: a refusal is a stream
                        // reset under HTTP/2 (no JSON-RPC error could say why), and no MCP
                        // header is spelt with an underscore.
                        "headers_with_underscores_action": "DROP_HEADER"
                    },
                    "local_reply_config": local_reply_config(&opts.edge),
                    "early_header_mutation_extensions": early_header_mutations(),
                    "access_log": access_log(opts),
                    "http_filters": http_filters
                }
            }]
        }]
    })
}

fn access_log(opts: &BootstrapOptions) -> Value {
    match &opts.access_log {
        None => json!([]),
        Some(path) => json!([{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": path.display().to_string(),
                "log_format": { "json_format": access_log_format() }
            }
        }]),
    }
}

/// Session affinity for MCP sessions: Envoy's stateful session filter with the envelope
/// session state. On a response carrying `Mcp-Session-Id`, Envoy wraps the server's value with
/// the upstream address; on a request, it unwraps it, routes to that address and hands the
/// server its own value back. Not strict: when the pinned instance is gone, Envoy load-balances
/// to another instance, which does not know the session and answers 404, so the client
/// re-initializes as the MCP spec requires.
fn session_affinity_filter() -> Value {
    json!({
        "name": "envoy.filters.http.stateful_session",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
            "session_state": {
                "name": "envoy.http.stateful_session.envelope",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.envelope.v3.EnvelopeSessionState",
                    "header": { "name": SESSION_HEADER }
                }
            },
            "strict": false,
            "stat_prefix": "mcp_session"
        }
    })
}

/// The wasm filter, its whole configuration discovered over ADS (ECDS): policy changes reach it
/// live, and the listener waits for the first configuration before it takes traffic.
fn toolgate_filter() -> Value {
    json!({
        "name": ecds::FILTER_CONFIG_NAME,
        "config_discovery": {
            "config_source": ads_source(),
            "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]
        }
    })
}

/// Envoy's own MCP filter with its default configuration: pass-through (traffic that is not
/// MCP is proxied, not refused), and a POST with `Content-Type: application/json` and an
/// `Accept` naming both JSON and SSE is held until its JSON-RPC body is parsed (up to 8 KiB;
/// beyond that the request passes with `mcp_body_too_large`), the method, id and tool name
/// set as dynamic metadata (`envoy.filters.http.mcp`) and checked against `Mcp-Method` and
/// `Mcp-Name`. Its counters are `http.toolgate.mcp.*`; in pass-through mode they count
/// problems only (`invalid_json`, `header_mismatch`, `body_too_large`, ...).
fn native_mcp_filter() -> Value {
    json!({
        "name": NATIVE_MCP_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.mcp.v3.Mcp"
        }
    })
}

/// Envoy's `jwt_authn`, its configuration discovered over ADS (ECDS) from the auth
/// configuration in etcd (see `xds/auth.rs`).
fn jwt_authn_filter() -> Value {
    json!({
        "name": auth::JWT_CONFIG_NAME,
        "config_discovery": {
            "config_source": ads_source(),
            "type_urls": [auth::JWT_TYPE_URL]
        }
    })
}

/// Removes the header `jwt_authn` writes a verified payload to from every request as it
/// arrives, before routing and before any filter: only Envoy's verification can put it there.
fn early_header_mutations() -> Value {
    json!([{
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{ "remove": toolgate_model::auth::PAYLOAD_HEADER }]
        }
    }])
}

fn router_filter() -> Value {
    json!({
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> BootstrapOptions {
        BootstrapOptions {
            xds_protocol: XdsProtocol::default(),
            node_id: "envoy-1".into(),
            cluster: "toolgate".into(),
            listen: "127.0.0.1:10000".parse().expect("addr"),
            xds: "127.0.0.1:18000".parse().expect("addr"),
            admin: "127.0.0.1:9901".parse().expect("addr"),
            filter: None,
            native_mcp_filter: false,
            route_table: RouteTable::default(),
            xds_tls: None,
            access_log: None,
            services: None,
            edge: EdgeLimits::default(),
        }
    }

    fn parsed() -> Value {
        serde_json::from_str(&render(&options())).expect("render prints valid JSON")
    }

    #[test]
    fn a_shard_names_its_services_in_the_node_metadata() {
        let shard = |filter: Option<&str>| {
            let b: Value = serde_json::from_str(&render(&BootstrapOptions {
                filter: filter.map(Into::into),
                services: Some(
                    crate::xds::shard::ServiceSelector::parse_list("billing-*,search")
                        .expect("patterns"),
                ),
                ..options()
            }))
            .expect("JSON");
            b["node"]["metadata"][ecds::NODE_METADATA_KEY].clone()
        };
        for filter in [None, Some("/f.wasm")] {
            let toolgate = shard(filter);
            assert_eq!(
                toolgate[crate::xds::shard::NODE_SERVICES_FIELD],
                json!(["billing-*", "search"])
            );
            assert_eq!(
                toolgate[ecds::NODE_FILTER_PATH_FIELD].as_str(),
                filter,
                "the filter path is there exactly when a filter is"
            );
        }
        assert!(parsed()["node"].get("metadata").is_none());
    }

    #[test]
    fn only_an_envoy_with_the_filter_asks_for_the_shared_routes() {
        let route_config = |filter: Option<&str>, native_mcp_filter, route_table| {
            let b: Value = serde_json::from_str(&render(&BootstrapOptions {
                filter: filter.map(Into::into),
                native_mcp_filter,
                route_table,
                ..options()
            }))
            .expect("JSON");
            b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                ["rds"]["route_config_name"]
                .clone()
        };
        let (shared, per_service) = (RouteTable::Shared, RouteTable::PerService);
        assert_eq!(
            route_config(Some("/f.wasm"), false, shared),
            SHARED_ROUTE_CONFIG_NAME
        );
        // A wasm filter that names no cluster (the bench's no-op filter in toolgate's place).
        assert_eq!(
            route_config(Some("/noop.wasm"), false, per_service),
            ROUTE_CONFIG_NAME
        );
        // Without the filter nothing would set the shared routes' cluster, or keep a client
        // from setting it.
        assert_eq!(route_config(None, false, shared), ROUTE_CONFIG_NAME);
        assert_eq!(route_config(None, true, shared), ROUTE_CONFIG_NAME);
    }

    #[test]
    fn the_node_metadata_tells_the_filter_whether_an_access_log_reads_its_fields() {
        let toolgate = |access_log: Option<&str>| {
            let b: Value = serde_json::from_str(&render(&BootstrapOptions {
                filter: Some("/f.wasm".into()),
                access_log: access_log.map(Into::into),
                ..options()
            }))
            .expect("JSON");
            b["node"]["metadata"][ecds::NODE_METADATA_KEY].clone()
        };
        let with = toolgate(Some("/var/log/access.json"));
        assert_eq!(with[ecds::NODE_ACCESS_LOG_FIELD], "/var/log/access.json");
        assert_eq!(with[ecds::NODE_FILTER_PATH_FIELD], "/f.wasm");
        let without = toolgate(None);
        assert!(
            without.get(ecds::NODE_ACCESS_LOG_FIELD).is_none(),
            "{without}"
        );
    }

    #[test]
    fn cluster_traffic_stats_are_made_at_first_use() {
        assert_eq!(
            parsed()["deferred_stat_options"]["enable_deferred_creation_stats"],
            true
        );
    }

    #[test]
    fn state_of_the_world_is_asked_for_by_name() {
        let b: Value = serde_json::from_str(&render(&BootstrapOptions {
            xds_protocol: XdsProtocol::Sotw,
            ..options()
        }))
        .expect("JSON");
        assert_eq!(b["dynamic_resources"]["ads_config"]["api_type"], "GRPC");
    }

    #[test]
    fn node_admin_and_ads_point_where_asked() {
        let b = parsed();
        assert_eq!(b["node"]["id"], "envoy-1");
        assert_eq!(b["node"]["cluster"], "toolgate");
        assert_eq!(b["admin"]["address"]["socket_address"]["port_value"], 9901);
        let ads = &b["dynamic_resources"]["ads_config"];
        assert_eq!(ads["api_type"], "DELTA_GRPC", "incremental xDS by default");
        assert_eq!(ads["transport_api_version"], "V3");
        assert_eq!(ads["set_node_on_first_message_only"], true);
        assert_eq!(
            ads["grpc_services"][0]["envoy_grpc"]["cluster_name"],
            XDS_CLUSTER
        );
        assert_eq!(b["dynamic_resources"]["cds_config"], ads_source());

        let xds = &b["static_resources"]["clusters"][0];
        assert_eq!(xds["name"], XDS_CLUSTER);
        assert_eq!(xds["type"], "STATIC");
        let ep = &xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"];
        assert_eq!(ep["address"]["socket_address"]["address"], "127.0.0.1");
        assert_eq!(ep["address"]["socket_address"]["port_value"], 18000);
        assert!(xds["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
            ["http2_protocol_options"]
            .is_object());
    }

    #[test]
    fn toolgate_xds_can_be_a_dns_name_that_envoy_resolves() {
        let mut opts = options();
        opts.xds = "toolgate-xds.toolgate.svc:18000".parse().expect("a name");
        opts.xds_tls = Some(XdsClientTls {
            ca: "/ca.pem".into(),
            cert: "/c.pem".into(),
            key: "/k.pem".into(),
            server_name: None,
        });
        let b: Value = serde_json::from_str(&render(&opts)).expect("JSON");
        let xds = &b["static_resources"]["clusters"][0];
        assert_eq!(xds["type"], "STRICT_DNS");
        let ep = &xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"];
        assert_eq!(
            ep["address"]["socket_address"]["address"],
            "toolgate-xds.toolgate.svc"
        );
        assert_eq!(ep["address"]["socket_address"]["port_value"], 18000);
        // Without --xds-tls-server-name the certificate must carry the name Envoy dialed.
        let tls = &xds["transport_socket"]["typed_config"];
        assert_eq!(tls["sni"], "toolgate-xds.toolgate.svc");
        assert_eq!(
            tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"][0]
                ["matcher"]["exact"],
            "toolgate-xds.toolgate.svc"
        );
        // The control cluster's hosts come over ADS, whatever the way to ADS is.
        let control = &b["static_resources"]["clusters"][1];
        assert_eq!(control["type"], "EDS");

        for bad in [
            "xds",
            "xds:port",
            "under_score:1",
            "-x:1",
            ":1",
            "a..b:1",
            "x:70000",
        ] {
            assert!(bad.parse::<Upstream>().is_err(), "{bad} accepted");
        }
        assert_eq!(
            "[::1]:18000".parse::<Upstream>(),
            Ok(Upstream::Ip("[::1]:18000".parse().expect("v6")))
        );
    }

    #[test]
    fn listener_routes_over_rds_with_session_affinity_then_router() {
        let b = parsed();
        let l = &b["static_resources"]["listeners"][0];
        assert_eq!(l["name"], LISTENER_NAME);
        assert_eq!(l["address"]["socket_address"]["port_value"], 10000);
        let hcm = &l["filter_chains"][0]["filters"][0]["typed_config"];
        assert_eq!(hcm["stat_prefix"], STAT_PREFIX);
        assert_eq!(hcm["rds"]["route_config_name"], ROUTE_CONFIG_NAME);
        assert_eq!(hcm["rds"]["config_source"], ads_source());
        let filters = hcm["http_filters"].as_array().expect("filter list");
        let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
        assert_eq!(
            names,
            [
                "envoy.filters.http.stateful_session",
                "envoy.filters.http.router"
            ]
        );
        let session = &filters[0]["typed_config"];
        assert_eq!(session["strict"], false);
        assert_eq!(
            session["session_state"]["name"],
            "envoy.http.stateful_session.envelope"
        );
        assert_eq!(
            session["session_state"]["typed_config"]["header"]["name"],
            SESSION_HEADER
        );
    }

    #[test]
    fn the_native_mcp_filter_takes_the_toolgate_filters_place_only_when_asked() {
        let names = |b: &Value| -> Vec<String> {
            b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                ["http_filters"]
                .as_array()
                .expect("filter list")
                .iter()
                .filter_map(|f| f["name"].as_str().map(String::from))
                .collect()
        };
        // Without the flag the bootstrap does not mention it (deployed bootstraps are
        // compared against this rendering).
        assert!(!render(&options()).contains(NATIVE_MCP_FILTER));

        let native: Value = serde_json::from_str(&render(&BootstrapOptions {
            native_mcp_filter: true,
            ..options()
        }))
        .expect("JSON");
        assert_eq!(
            names(&native),
            [
                NATIVE_MCP_FILTER,
                "envoy.filters.http.stateful_session",
                "envoy.filters.http.router"
            ]
        );
        let hcm = &native["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        // The default configuration: nothing but the type.
        assert_eq!(
            hcm["http_filters"][0]["typed_config"],
            json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.mcp.v3.Mcp"})
        );
        // Its counters are `http.<stat_prefix>.mcp.*`.
        assert_eq!(hcm["stat_prefix"], STAT_PREFIX);
        // No toolgate node metadata: toolgate-xds sends this Envoy no filter configuration.
        assert!(
            native["node"].get("metadata").is_none(),
            "{}",
            native["node"]
        );

        // With the toolgate filter the flag is ignored.
        let both: Value = serde_json::from_str(&render(&BootstrapOptions {
            native_mcp_filter: true,
            filter: Some("/f.wasm".into()),
            ..options()
        }))
        .expect("JSON");
        assert!(!names(&both).iter().any(|n| n == NATIVE_MCP_FILTER));
        assert_eq!(
            names(&both)[1],
            ecds::FILTER_CONFIG_NAME,
            "the toolgate filter stays in its place"
        );
    }

    #[test]
    fn filter_stats_get_service_and_tool_tags() {
        let b = parsed();
        let tags = b["stats_config"]["stats_tags"]
            .as_array()
            .expect("stats_tags");
        let names: Vec<&str> = tags.iter().filter_map(|t| t["tag_name"].as_str()).collect();
        assert_eq!(names, [SERVICE_TAG, TOOL_TAG, REASON_TAG, RULE_TAG]);
        for t in tags {
            let regex = t["regex"].as_str().expect("regex");
            // Anchored on the wasm namespace, so Envoy runs them on the filter's stats only.
            assert!(regex.starts_with(r"^wasmcustom\.toolgate\."), "{regex}");
            // Two capturing groups: the first is cut from the name, the second is the tag's
            // value (`(?:` groups capture nothing).
            assert_eq!(
                regex.matches('(').count() - regex.matches("(?:").count(),
                2,
                "{regex}"
            );
        }
    }

    #[test]
    fn edge_limits_reach_the_connection_manager_the_overload_manager_and_the_runtime() {
        let b: Value = serde_json::from_str(&render(&BootstrapOptions {
            edge: EdgeLimits {
                request_timeout: Duration::from_millis(2500),
                request_headers_timeout: Duration::from_secs(4),
                idle_timeout: Duration::from_secs(90),
                max_connections: 123,
                max_heap_bytes: 256 * 1024 * 1024,
            },
            ..options()
        }))
        .expect("JSON");
        let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        assert_eq!(hcm["request_timeout"], "2.5s");
        assert_eq!(hcm["request_headers_timeout"], "4s");
        assert_eq!(hcm["common_http_protocol_options"]["idle_timeout"], "90s");
        assert_eq!(
            hcm["common_http_protocol_options"]["headers_with_underscores_action"],
            "DROP_HEADER"
        );
        let mappers = hcm["local_reply_config"]["mappers"]
            .as_array()
            .expect("mappers");
        assert_eq!(mappers.len(), 4);
        assert_eq!(
            mappers[2]["body_format_override"]["json_format"]["error"]["data"]
                ["io.toolgate/limits"]["requestTimeoutMs"],
            2500
        );

        let om = &b["overload_manager"];
        let monitors: Vec<&str> = om["resource_monitors"]
            .as_array()
            .expect("monitors")
            .iter()
            .filter_map(|m| m["name"].as_str())
            .collect();
        assert_eq!(
            monitors,
            [
                FIXED_HEAP,
                "envoy.resource_monitors.global_downstream_max_connections"
            ]
        );
        assert_eq!(
            om["resource_monitors"][0]["typed_config"]["max_heap_size_bytes"],
            256 * 1024 * 1024
        );
        assert_eq!(
            om["resource_monitors"][1]["typed_config"]["max_active_downstream_connections"],
            123 + ADMIN_CONNECTIONS
        );
        // Every action and load shed point is triggered by the heap.
        for a in om["actions"]
            .as_array()
            .into_iter()
            .chain(om["loadshed_points"].as_array())
            .flatten()
        {
            assert_eq!(a["triggers"][0]["name"], FIXED_HEAP, "{a}");
        }
        assert_eq!(b["admin"]["ignore_global_conn_limit"], true);
        let runtime = &b["layered_runtime"]["layers"];
        assert_eq!(
            runtime[0]["static_layer"]
                [format!("envoy.resource_limits.listener.{LISTENER_NAME}.connection_limit")],
            123
        );
        assert!(runtime[1]["admin_layer"].is_object());
    }

    #[test]
    fn ipv6_addresses_render_without_brackets() {
        let mut o = options();
        o.listen = "[::1]:10000".parse().expect("addr");
        let b: Value = serde_json::from_str(&render(&o)).expect("valid JSON");
        assert_eq!(
            b["static_resources"]["listeners"][0]["address"]["socket_address"]["address"],
            "::1"
        );
    }
}
