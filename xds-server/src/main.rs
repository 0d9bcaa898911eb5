//! `toolgate-xds`: the control plane (`serve`) and the Envoy bootstrap printer (`bootstrap`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Notify;
use toolgate_model::KeyLayout;
use toolgate_model::{RequestLimits, MAX_BODY_BYTES_LIMIT, MAX_JSON_DEPTH_LIMIT};
use toolgate_xds::admin::auth::{AdminToken, ReportToken};
use toolgate_xds::admin::{self, AdminState};
use toolgate_xds::bootstrap::{self, BootstrapOptions};
use toolgate_xds::etcd::watch::Watcher;
use toolgate_xds::etcd::{EtcdConfig, EtcdStatus};
use toolgate_xds::fleet::FleetWriter;
use toolgate_xds::health::config::HealthConfig;
use toolgate_xds::health::{self, Hub};
use toolgate_xds::metrics::Metrics;
use toolgate_xds::registry::admission::EndpointPolicy;
use toolgate_xds::registry::persist;
use toolgate_xds::registry::publish::Publisher;
use toolgate_xds::registry::Registry;
use toolgate_xds::xds;
use tracing::{info, warn};

#[derive(Parser, Debug)]
#[command(
    name = "toolgate-xds",
    version,
    about = "toolgate's control plane: etcd registrations in, Envoy configuration out."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Watch etcd and serve Envoys over ADS, with an admin API.
    Serve(Box<ServeArgs>),
    /// Print a ready Envoy bootstrap (JSON) that points at a toolgate-xds.
    Bootstrap(Box<BootstrapArgs>),
    /// Print services, instances with their states, open breakers and overrides of a running
    /// toolgate-xds, as tables.
    Status(StatusArgs),
    /// Print the breaker policy every tool gets unless etcd's /mcp/policies/ overrides it
    /// (JSON; each field may be overridden per service or per tool).
    PolicyDefaults,
}

#[derive(Args, Debug)]
struct StatusArgs {
    /// The toolgate-xds admin API.
    #[arg(long, default_value = "http://127.0.0.1:19000")]
    admin: String,
    /// Name of the environment variable holding the admin token, for a toolgate-xds started
    /// with --protect-reads.
    #[arg(long, value_name = "VAR")]
    admin_token_env: Option<String>,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "TOOLGATE_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    #[command(flatten)]
    access: toolgate_etcd_access::EtcdAccessArgs,
    /// Networks registrations may point into, comma-separated CIDRs (default: any address
    /// but the dangerous ones: unspecified, link-local and cloud metadata, multicast,
    /// broadcast, which are always refused).
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    allowed_cidrs: Vec<ipnet::IpNet>,
    /// Key prefix in etcd.
    #[arg(long, env = "TOOLGATE_PREFIX", default_value = toolgate_model::DEFAULT_PREFIX)]
    prefix: String,
    /// mTLS on the ADS listener: toolgate-xds's certificate (PEM); needs --xds-tls-key and
    /// --xds-tls-client-ca. Envoys without a certificate from that CA are refused.
    #[arg(long, value_name = "PEM", requires_all = ["xds_tls_key", "xds_tls_client_ca"])]
    xds_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --xds-tls-cert.
    #[arg(long, value_name = "PEM", requires = "xds_tls_cert")]
    xds_tls_key: Option<PathBuf>,
    /// The CA whose certificates Envoys must present on the ADS connection.
    #[arg(long, value_name = "PEM", requires = "xds_tls_cert")]
    xds_tls_client_ca: Option<PathBuf>,
    /// How often the secrets the credentials toward servers reference
    /// (`<prefix>auth/upstream/<service>`) are read again: a rotated file is in use within it.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    secret_refresh: Duration,
    /// The CAs (PEM) an `https://` identity provider's certificate is checked with when
    /// toolgate-xds fetches its JWKS (a private CA's bundle, for an in-house provider).
    #[arg(long, value_name = "PEM", default_value = toolgate_xds::idp::SYSTEM_CA_FILE)]
    idp_ca_file: PathBuf,
    /// Where Envoys connect for ADS (gRPC).
    #[arg(long, default_value = "127.0.0.1:18000")]
    xds_listen: SocketAddr,
    /// Admin API: /healthz, /metrics, /v1/registry.
    #[arg(long, default_value = "127.0.0.1:19000")]
    admin_listen: SocketAddr,
    /// Where the fleet's Envoys reach this admin listener (IP:port), when --admin-listen is
    /// not an address they can (0.0.0.0, or behind NAT; in Kubernetes the pod's IP).
    /// toolgate-xds registers it in etcd (<prefix>xds/, under a lease) and every toolgate-xds
    /// gives it to its Envoys as the aggregate endpoint's and the reports' next choice after
    /// itself. Default: --admin-listen when it is a specific address; else this toolgate-xds
    /// is not registered (its own Envoys reach it on loopback).
    #[arg(long, value_name = "IP:PORT", value_parser = advertised_address)]
    admin_advertise: Option<SocketAddr>,
    /// Directory for the last good registry, served at start when etcd is unreachable.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// How long one etcd request may take.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    etcd_timeout: Duration,
    /// At start, how long to keep trying etcd before serving the state-dir snapshot.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    startup_wait: Duration,
    /// File holding the bearer token that admin changes (overrides, policies) require.
    #[arg(long, conflicts_with = "admin_token_env")]
    admin_token_file: Option<PathBuf>,
    /// Name of the environment variable holding that token (never the token itself: a
    /// command line shows in `ps`).
    #[arg(long)]
    admin_token_env: Option<String>,
    /// File holding the bearer token the filters must send with their reports
    /// (`POST /v1/feedback`, `/v1/breaker-events`). toolgate-xds puts it into each Envoy's
    /// filter configuration over ADS. Without one, reports are taken from anyone who reaches
    /// the admin listener.
    #[arg(long, conflicts_with = "report_token_env")]
    report_token_file: Option<PathBuf>,
    /// Name of the environment variable holding that token.
    #[arg(long)]
    report_token_env: Option<String>,
    /// File holding the key (32 bytes, base64: `head -c32 /dev/urandom | base64`) the filters
    /// seal Mcp-Session-Id with, so that no client learns an upstream address. Give every
    /// gateway of a fleet the same file, or a session that moves to another gateway must
    /// initialize again. Without it, the key is kept in --state-dir (made once), or lives as
    /// long as the process.
    #[arg(long)]
    session_key_file: Option<PathBuf>,
    /// Export OpenTelemetry spans of the propagation path (etcd event, snapshot, each xDS
    /// push) over OTLP/gRPC to this collector, e.g. http://otel-collector:4317.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Reads of the admin API (`/metrics`, `GET /v1/...`) need the admin token too.
    /// `/healthz` and the console page stay open.
    #[arg(long)]
    protect_reads: bool,
    /// Request bodies above this many bytes get a JSON-RPC error from the filter instead of
    /// being buffered (at most 64 MiB). The routes let Envoy buffer more than this, so the
    /// filter, not Envoy, answers a larger body.
    #[arg(long, default_value_t = RequestLimits::default().max_body_bytes,
          value_parser = clap::value_parser!(u64).range(1..=MAX_BODY_BYTES_LIMIT))]
    max_body_bytes: u64,
    /// Request bodies nested deeper than this (arrays and objects) get a JSON-RPC error from
    /// the filter and never reach a tool server's parser (at most 128).
    #[arg(long, default_value_t = RequestLimits::default().max_json_depth,
          value_parser = clap::value_parser!(u64).range(1..=MAX_JSON_DEPTH_LIMIT))]
    max_json_depth: u64,
    /// Also configure Envoy's own outlier detection on every service cluster (5 consecutive
    /// 5xx eject a host for 30 s). toolgate's probes and breakers already do this job.
    #[arg(long)]
    envoy_outlier_detection: bool,
    #[command(flatten)]
    health: HealthArgs,
    #[command(flatten)]
    held: HeldSessionArgs,
}

/// Sessions the gateway holds with servers for its clients (the aggregate endpoint's, and
/// those re-opened when an instance is lost).
#[derive(Args, Debug)]
struct HeldSessionArgs {
    /// Sessions held with one service for one caller at most: a verified user (issuer and
    /// subject), or without a token the client's address. Beyond, the least recently used
    /// one idle for --held-session-evictable-after is deleted to make room, or the client
    /// is told the bound.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    max_held_sessions_per_caller: u32,
    /// Sessions held with one service at most, for all callers.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_held_sessions_per_service: u32,
    /// A held session unused this long may be deleted to make room under a bound. Filters
    /// ask for the sessions they use every 30 s, so keep it above that.
    #[arg(long, default_value = "2m", value_parser = positive_duration)]
    held_session_evictable_after: Duration,
}

impl HeldSessionArgs {
    fn limits(&self) -> toolgate_xds::upstream::SessionLimits {
        toolgate_xds::upstream::SessionLimits {
            per_caller: self.max_held_sessions_per_caller as usize,
            per_service: self.max_held_sessions_per_service as usize,
            evictable_after: self.held_session_evictable_after,
        }
    }
}

/// Instance health beyond the lease.
#[derive(Args, Debug)]
struct HealthArgs {
    /// Turn active probes off: instances are UP while their lease lives.
    #[arg(long)]
    no_probes: bool,
    /// How often each instance is probed (in its registration's kind: http, mcp or tcp).
    #[arg(long, default_value = "2s", value_parser = positive_duration)]
    probe_interval: Duration,
    /// How long a probe may take.
    #[arg(long, default_value = "1s", value_parser = positive_duration)]
    probe_timeout: Duration,
    /// Probes in flight at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    probe_concurrency: u32,
    /// Instances the prober holds an idle connection to between probes, at most, so that a
    /// crashed server (whose kernel closes it) is probed at once instead of at its next
    /// probe; 0 turns that off. Also bounded by the open-files limit: half of what lies
    /// beyond 1,024.
    #[arg(long, default_value_t = 10_000)]
    probe_watch_limit: usize,
    /// Tolerate one more missed probe before SUSPECT (3 in a row instead of 2), for servers
    /// with GC pauses.
    #[arg(long)]
    probe_tolerance: bool,
    /// Probes failing this long while the lease is alive make an instance DOWN (a zombie).
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    down_window: Duration,
    /// Window over which the filters' call failures are judged.
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    call_window: Duration,
    /// Failure rate of calls (percent) over the window that makes an instance UNHEALTHY.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    call_failure_percent: u32,
    /// Calls needed in the window before their failure rate is a verdict.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    call_min_calls: u64,
    /// An UNHEALTHY instance keeps this percentage of its weight (never 0).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    unhealthy_weight_percent: u32,
    /// How often the inspection re-probes quiet UP instances and compares the registry with etcd.
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    inspect_interval: Duration,
    /// How often leases are asked for their remaining TTL (heartbeat loss); one etcd request
    /// per lease.
    #[arg(long, default_value = "5s", value_parser = positive_duration)]
    lease_check_interval: Duration,
}

impl HealthArgs {
    fn config(&self) -> HealthConfig {
        HealthConfig {
            probes: !self.no_probes,
            probe_interval: self.probe_interval,
            probe_timeout: self.probe_timeout,
            probe_concurrency: self.probe_concurrency as usize,
            probe_watch_limit: self.probe_watch_limit,
            suspect_after: if self.probe_tolerance { 3 } else { 2 },
            down_window: self.down_window,
            call_window: self.call_window,
            call_min_calls: self.call_min_calls,
            call_failure_percent: self.call_failure_percent,
            unhealthy_weight_percent: self.unhealthy_weight_percent,
            inspect_interval: self.inspect_interval,
            lease_check_interval: self.lease_check_interval,
            ..HealthConfig::default()
        }
    }
}

fn advertised_address(s: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = s
        .parse()
        .map_err(|_| format!("{s:?} is not an IP address and port"))?;
    if addr.ip().is_unspecified() || addr.port() == 0 {
        return Err(format!(
            "{s:?}: give the address and port other hosts reach, not 0.0.0.0 or port 0"
        ));
    }
    Ok(addr)
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if d.is_zero() {
        return Err(format!("{s:?}: must be more than zero"));
    }
    Ok(d)
}

#[derive(Args, Debug)]
struct BootstrapArgs {
    /// Envoy node id (unique per Envoy).
    #[arg(long)]
    node_id: String,
    /// Envoy node cluster.
    #[arg(long, default_value = "toolgate")]
    cluster: String,
    /// Where Envoy listens for MCP clients.
    #[arg(long, default_value = "127.0.0.1:10000")]
    listen: SocketAddr,
    /// Address of toolgate-xds's ADS listener: IP:port, or a DNS name and port that Envoy
    /// resolves (a Compose or Kubernetes service).
    #[arg(long, default_value = "127.0.0.1:18000")]
    xds: bootstrap::Upstream,
    /// Envoy's admin listener (keep it on loopback).
    #[arg(long, default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
    // (Not shown in --help.) Where the filter's reports went before toolgate-xds served the
    // control cluster's hosts over ADS; accepted so that older scripts keep working, and
    // ignored with a note on stderr.
    #[arg(long, hide = true)]
    control: Option<bootstrap::Upstream>,
    /// Path of the toolgate wasm filter.
    #[arg(long)]
    filter: Option<PathBuf>,
    /// The ADS protocol Envoy speaks: incremental (`delta`: a change sends only the resources
    /// it touches) or state of the world (`sotw`: every CDS push resends every cluster).
    /// toolgate-xds serves both on the same listener.
    #[arg(long, value_enum, default_value_t = bootstrap::XdsProtocol::default())]
    xds_protocol: bootstrap::XdsProtocol,
    /// Bench and reference aid, not for deployments: put Envoy's own MCP filter
    /// (envoy.filters.http.mcp, default configuration: parses each JSON-RPC request body,
    /// passes traffic through) where the toolgate filter would be, without breakers or auth.
    /// `make bench` compares the toolgate filter against it.
    #[arg(long, conflicts_with = "filter")]
    native_mcp_filter: bool,
    /// With --filter: `shared` (services with the default MCP path and timeout share routes
    /// whose cluster the filter names, so a new service changes no route) or `per-service`
    /// (two routes per service, for a wasm filter other than toolgate's).
    #[arg(long, value_enum, default_value_t = bootstrap::RouteTable::default(), requires = "filter")]
    route_table: bootstrap::RouteTable,
    /// mTLS to toolgate-xds: the CA that signed its certificate (needs --xds-tls-cert and
    /// --xds-tls-key, Envoy's own certificate and key).
    #[arg(long, value_name = "PEM", requires_all = ["xds_tls_cert", "xds_tls_key"])]
    xds_tls_ca: Option<PathBuf>,
    /// Envoy's certificate (PEM) for the ADS connection, signed by the CA toolgate-xds
    /// trusts (its --xds-tls-client-ca).
    #[arg(long, value_name = "PEM", requires = "xds_tls_ca")]
    xds_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --xds-tls-cert.
    #[arg(long, value_name = "PEM", requires = "xds_tls_ca")]
    xds_tls_key: Option<PathBuf>,
    /// The DNS name in toolgate-xds's certificate (default: the name or address in --xds).
    #[arg(long, requires = "xds_tls_ca")]
    xds_tls_server_name: Option<String>,
    /// Write Envoy's access log here (`/dev/stdout` in a container): one JSON object per
    /// request, with the MCP method, tool and breaker state the filter saw, the upstream
    /// instance and the W3C `traceparent`.
    #[arg(long, value_name = "PATH")]
    access_log: Option<PathBuf>,
    /// Shard: this Envoy serves only these services (comma-separated; a name, or a name
    /// prefix ending in `*`, e.g. `billing-*,search`). toolgate-xds sends it their clusters,
    /// assignments, routes and catalog entries only; whatever routes agents to this Envoy
    /// must send it only their `/mcp/<service>` paths. Default: every service.
    #[arg(long, value_name = "PATTERNS", value_parser = parse_services)]
    services: Option<toolgate_xds::xds::shard::ServiceSelector>,
    #[command(flatten)]
    edge: EdgeArgs,
}

fn parse_services(list: &str) -> Result<toolgate_xds::xds::shard::ServiceSelector, String> {
    toolgate_xds::xds::shard::ServiceSelector::parse_list(list).map_err(|e| e.to_string())
}

/// What one client may hold at Envoy's MCP listener. None of these cut a response once its
/// request is in: a long tools/call and MCP's GET stream are unaffected.
#[derive(Args, Debug)]
struct EdgeArgs {
    /// A request (headers and body) must arrive within this, or Envoy answers 408 (a
    /// JSON-RPC error) and closes the connection: a client trickling its body holds memory
    /// for this long at most.
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    request_timeout: Duration,
    /// Request headers must arrive within this from their first byte (408 otherwise).
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    request_headers_timeout: Duration,
    /// A client connection with no request in flight is closed after this.
    #[arg(long, default_value = "60s", value_parser = positive_duration)]
    idle_timeout: Duration,
    /// Client connections to the MCP listener at once; Envoy closes further ones as it
    /// accepts them. Envoy's global limit is this plus 16 for its admin listener (exempt, but
    /// counted). Keep it under half of Envoy's file descriptor limit.
    #[arg(long, default_value_t = bootstrap::EdgeLimits::default().max_connections,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Heap (MiB) Envoy's overload manager counts against: from 85% it resets the HTTP/2
    /// streams holding the most buffered bytes, at 90% it returns free memory to the system,
    /// at 95% it answers new requests 503 and closes new connections, at 98% it stops reading
    /// HTTP/1 requests. Set it below the container's memory limit.
    #[arg(long, default_value_t = bootstrap::EdgeLimits::default().max_heap_bytes / MIB,
          value_parser = clap::value_parser!(u64).range(16..=1024 * 1024))]
    max_heap_mib: u64,
}

const MIB: u64 = 1024 * 1024;

impl EdgeArgs {
    fn limits(&self) -> bootstrap::EdgeLimits {
        bootstrap::EdgeLimits {
            request_timeout: self.request_timeout,
            request_headers_timeout: self.request_headers_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            max_heap_bytes: self.max_heap_mib * MIB,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Bootstrap(args) => {
            if let Some(control) = &args.control {
                eprintln!(
                    "toolgate-xds bootstrap: --control {control} is ignored: Envoy learns the \
                     fleet's toolgate-xds admin listeners over ADS (the toolgate-xds it \
                     connects to first)"
                );
            }
            let opts = BootstrapOptions {
                xds_protocol: args.xds_protocol,
                node_id: args.node_id,
                cluster: args.cluster,
                listen: args.listen,
                xds: args.xds,
                admin: args.admin,
                filter: args.filter,
                native_mcp_filter: args.native_mcp_filter,
                route_table: args.route_table,
                access_log: args.access_log,
                services: args.services,
                edge: args.edge.limits(),
                xds_tls: match (args.xds_tls_ca, args.xds_tls_cert, args.xds_tls_key) {
                    (Some(ca), Some(cert), Some(key)) => Some(bootstrap::XdsClientTls {
                        ca,
                        cert,
                        key,
                        server_name: args.xds_tls_server_name,
                    }),
                    _ => None,
                },
            };
            println!("{}", bootstrap::render(&opts));
            ExitCode::SUCCESS
        }
        Command::PolicyDefaults => {
            match serde_json::to_string_pretty(&toolgate_model::policy::BreakerPolicy::default()) {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("toolgate-xds: encoding the default policy: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Status(args) => {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("toolgate-xds: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let token = match &args.admin_token_env {
                Some(var) => match std::env::var(var) {
                    Ok(t) => Some(t.trim().to_string()),
                    Err(_) => {
                        eprintln!("toolgate-xds status: --admin-token-env {var}: not set");
                        return ExitCode::from(2);
                    }
                },
                None => None,
            };
            match rt.block_on(status(&args.admin, token.as_deref())) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("toolgate-xds status: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Serve(args) => {
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("toolgate-xds: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let served = rt.block_on(async {
                // Inside the runtime: the OTLP exporter's channel lives on it.
                let spans = toolgate_xds::trace::init(args.otlp_endpoint.as_deref())?;
                let served = serve(*args).await;
                if let Some(provider) = spans {
                    // Flushes the spans still batched.
                    if let Err(e) = provider.shutdown() {
                        warn!(error = %e, "flushing the trace spans failed");
                    }
                }
                served
            });
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("toolgate-xds: error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn status(admin: &str, token: Option<&str>) -> anyhow::Result<String> {
    let admin = admin.trim_end_matches('/');
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    let get = |path: &'static str| {
        let client = client.clone();
        let url = format!("{admin}{path}");
        let mut request = client.get(&url);
        if let Some(t) = token {
            request = request.bearer_auth(t);
        }
        async move {
            let resp = request.send().await.with_context(|| format!("GET {url}"))?;
            anyhow::ensure!(resp.status().is_success(), "GET {url}: {}", resp.status());
            resp.json::<serde_json::Value>()
                .await
                .with_context(|| format!("GET {url}: not JSON"))
        }
    };
    let (registry, breakers, overrides) = tokio::try_join!(
        get("/v1/registry"),
        get("/v1/breakers"),
        get("/v1/overrides")
    )?;
    let mut out = toolgate_xds::status::render(admin, &registry, &breakers, &overrides);
    // A toolgate-xds from before issue 20 has no /v1/auth: the rest of the report stands.
    match get("/v1/auth").await {
        Ok(auth) => out.push_str(&toolgate_xds::status::render_auth(&auth)),
        Err(e) => out.push_str(&format!("\nAUTH: unknown ({e:#})\n")),
    }
    match get("/v1/limits").await {
        Ok(limits) => out.push_str(&toolgate_xds::status::render_limits(&limits)),
        Err(e) => out.push_str(&format!("\nLIMITS: unknown ({e:#})\n")),
    }
    Ok(out)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if toolgate_xds::failpoint::COMPILED_IN {
        // Tests look for this line: a failpoint that never fires in a binary built without
        // them would otherwise look like a toolgate bug.
        warn!("failpoints compiled in: a test build (cargo test), not for production");
    }
    let metrics = Arc::new(Metrics::new());
    let health_config = Arc::new(args.health.config());
    if health_config.probe_timeout >= health_config.probe_interval {
        anyhow::bail!(
            "--probe-timeout ({}) must be shorter than --probe-interval ({})",
            humantime::format_duration(health_config.probe_timeout),
            humantime::format_duration(health_config.probe_interval)
        );
    }
    let (session_key, key_source) = toolgate_xds::session_key::load(
        args.session_key_file.as_deref(),
        args.state_dir.as_deref(),
    )?;
    match &key_source {
        toolgate_xds::session_key::Source::Process => warn!(
            "no --session-key-file and no --state-dir: session ids are sealed with a key made \
             for this process; after a restart, or on another gateway, clients must initialize \
             their sessions again"
        ),
        source => info!(?source, "sealing session ids"),
    }
    let registry = Arc::new(RwLock::new(
        Registry::with_health(KeyLayout::new(&args.prefix), health_config.clone())
            .with_endpoint_policy(EndpointPolicy::new(args.allowed_cidrs.clone()))
            .with_request_limits(RequestLimits {
                max_body_bytes: args.max_body_bytes,
                max_json_depth: args.max_json_depth,
            })
            .with_session_key(session_key.clone()),
    ));
    let status = Arc::new(EtcdStatus::default());
    let (publisher, snapshots) =
        Publisher::new(registry.clone(), metrics.clone(), args.state_dir.clone());
    let hub = Hub {
        registry: registry.clone(),
        publisher: publisher.clone(),
        metrics: metrics.clone(),
        config: health_config.clone(),
    };
    let access = args
        .access
        .load()
        .and_then(|a| a.check_endpoints(&args.etcd).map(|()| a))
        .context("etcd access")?;
    let etcd_config = EtcdConfig {
        endpoints: args.etcd.clone(),
        request_timeout: args.etcd_timeout,
        access,
    };
    let (probed, resync) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let token = AdminToken::new(read_secret(
        "admin",
        &args.admin_token_file,
        &args.admin_token_env,
    )?);
    let reports = ReportToken::new(read_secret(
        "report",
        &args.report_token_file,
        &args.report_token_env,
    )?);
    if !token.is_set() {
        anyhow::ensure!(
            !args.protect_reads,
            "--protect-reads needs the admin token: give --admin-token-file or --admin-token-env"
        );
        warn!("no admin token configured: overrides and policies cannot be changed through the admin API");
    }
    let fleet = FleetWriter {
        client: toolgate_xds::etcd::LazyClient::new(etcd_config.clone()),
        registry: registry.clone(),
        metrics: metrics.clone(),
        timeout: args.etcd_timeout,
    };

    let xds_tls = match (
        &args.xds_tls_cert,
        &args.xds_tls_key,
        &args.xds_tls_client_ca,
    ) {
        (Some(cert), Some(key), Some(ca)) => {
            let read = |what: &str, p: &PathBuf| {
                std::fs::read(p).with_context(|| format!("reading the {what} {}", p.display()))
            };
            Some(
                tonic::transport::ServerTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(
                        read("xDS certificate", cert)?,
                        read("xDS key", key)?,
                    ))
                    .client_ca_root(tonic::transport::Certificate::from_pem(read(
                        "xDS client CA",
                        ca,
                    )?)),
            )
        }
        _ => None,
    };
    // Binding beyond loopback is explicit (a flag value), but say what it exposes.
    if !args.xds_listen.ip().is_loopback() && xds_tls.is_none() {
        warn!(xds = %args.xds_listen, "ADS listens beyond loopback without mTLS: any host that reaches it gets every endpoint and policy (use --xds-tls-cert/--xds-tls-key/--xds-tls-client-ca)");
    }
    if !args.admin_listen.ip().is_loopback() && !args.protect_reads {
        warn!(admin = %args.admin_listen, "the admin API listens beyond loopback with open reads (use --protect-reads)");
    }
    if !args.admin_listen.ip().is_loopback() && reports.get().is_none() {
        warn!(admin = %args.admin_listen, "the admin API listens beyond loopback and takes the filters' reports from anyone: a forged report can mark instances down or open breakers fleet-wide (use --report-token-file or --report-token-env)");
    }
    let xds_listener = tokio::net::TcpListener::bind(args.xds_listen)
        .await
        .with_context(|| format!("binding the xDS listener on {}", args.xds_listen))?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding the admin listener on {}", args.admin_listen))?;
    let envoys = Arc::new(xds::Connections::default());
    let membership = join_fleet(
        &args,
        &admin_listener,
        &registry,
        &etcd_config,
        envoys.envoys(),
    )?;
    tokio::spawn(count_envoys(
        envoys.envoys(),
        registry.clone(),
        publisher.clone(),
    ));

    let persisted = match &args.state_dir {
        Some(dir) => match persist::load(dir) {
            Ok(state) => Some(state),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                warn!(error = %e, "ignoring an unreadable state-dir snapshot");
                None
            }
        },
        None => None,
    };
    let watcher = Watcher {
        config: etcd_config.clone(),
        registry: registry.clone(),
        publisher: publisher.clone(),
        metrics: metrics.clone(),
        status: status.clone(),
        resync: resync.clone(),
        probed: probed.clone(),
    };
    let etcd_access = etcd_config.access.describe();
    let credentials = toolgate_xds::upstream_credentials::Credentials::default();
    let probe_sessions = health::monitor::spawn(
        hub.clone(),
        etcd_config,
        probed,
        resync,
        credentials.clone(),
    );
    let catalog = Arc::new(toolgate_xds::catalog::Catalog::default());
    if health_config.probes {
        tokio::spawn(toolgate_xds::catalog::run(
            registry.clone(),
            catalog.clone(),
            snapshots.clone(),
            publisher.clone(),
            toolgate_probe::http::client(health_config.probe_timeout),
            health_config.probe_timeout,
            credentials.clone(),
        ));
    }
    if args.secret_refresh.is_zero() {
        anyhow::bail!("--secret-refresh must be longer than 0 s");
    }
    tokio::spawn(toolgate_xds::upstream_credentials::run(
        registry.clone(),
        snapshots.clone(),
        publisher.clone(),
        credentials.clone(),
        args.secret_refresh,
    ));
    let idp = toolgate_xds::idp::IdpClient::new(&args.idp_ca_file)
        .context("setting up TLS toward identity providers")?;
    // One client, so one CA bundle and one connection pool, toward every identity provider:
    // the JWKS fetches and the token exchanges.
    let exchanger = toolgate_xds::token_exchange::Exchanger::new(
        idp.clone(),
        registry.clone(),
        metrics.clone(),
    );
    tokio::spawn(toolgate_xds::jwks::run(
        registry.clone(),
        snapshots.clone(),
        publisher.clone(),
        idp,
        metrics.clone(),
    ));
    let aggregate = toolgate_xds::aggregate::Aggregate::new(
        registry.clone(),
        catalog.clone(),
        metrics.clone(),
        &session_key,
    );
    let upstream = Arc::new(
        toolgate_xds::upstream::UpstreamSessions::with_limits(
            registry.clone(),
            metrics.clone(),
            args.held.limits(),
        )
        .with_credentials(credentials.clone()),
    );
    aggregate.hold_upstream_in(upstream.clone());
    tokio::spawn(toolgate_xds::aggregate::run(
        aggregate.clone(),
        snapshots.clone(),
    ));
    tokio::spawn(watcher.run(persisted, args.startup_wait));
    tokio::spawn(toolgate_xds::service_ages::run(
        fleet.client.clone(),
        registry.clone(),
        args.etcd_timeout,
    ));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    info!(xds = %args.xds_listen, admin = %args.admin_listen, etcd = ?args.etcd,
        %etcd_access, prefix = %args.prefix,
        probes = health_config.probes, probe_interval = ?health_config.probe_interval,
        probe_timeout = ?health_config.probe_timeout, down_window = ?health_config.down_window,
        "toolgate-xds serving");
    // The table the aggregate endpoint closes sessions in when its gateway sessions end is
    // the one the admin API opens them in and the expiry sweeps (a second table here once
    // left every gateway session's held sessions to the idle expiry).
    tokio::spawn(expire_upstream_sessions(upstream.clone()));
    let xds_task = tokio::spawn(xds::serve(
        xds_listener,
        snapshots,
        metrics.clone(),
        envoys.clone(),
        xds::ServeOptions {
            tls: xds_tls,
            report_token: reports.get().map(Arc::from),
            resources: xds::ResourceOptions {
                envoy_outlier_detection: args.envoy_outlier_detection,
            },
        },
        stopped(stop_rx.clone()),
    ));
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        AdminState {
            metrics,
            registry: registry.clone(),
            etcd: status,
            hub,
            fleet,
            token,
            envoys,
            protect_reads: args.protect_reads,
            reports,
            catalog,
            upstream: upstream.clone(),
            aggregate,
            exchanger,
            limited: Arc::default(),
        },
        stopped(stop_rx),
    ));

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM: stopping"),
        _ = sigint.recv() => info!("SIGINT: stopping"),
    }
    // Out of the fleet first: the other toolgate-xds drop this one from their Envoys' control
    // cluster at once, while it still answers what is in flight.
    if let Some(m) = membership {
        m.leave().await;
    }
    let _ = stop_tx.send(true);
    // A stopped prober must leave no MCP session behind on the servers it probed.
    probe_sessions.close_all().await;
    if let Some(dir) = &args.state_dir {
        match publisher.flush_state(dir, &registry) {
            Ok(true) => info!(dir = %dir.display(), "state snapshot written"),
            Ok(false) => {}
            Err(e) => warn!(dir = %dir.display(), error = %e, "writing the state snapshot failed"),
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = xds_task.await;
        let _ = admin_task.await;
    })
    .await;
    Ok(())
}

/// Where this toolgate-xds's Envoys reach its admin listener, and its registration in the
/// fleet (`<prefix>xds/<id>`) when other hosts can reach it too (see `--admin-advertise`).
fn join_fleet(
    args: &ServeArgs,
    admin: &tokio::net::TcpListener,
    registry: &RwLock<Registry>,
    etcd: &EtcdConfig,
    mut envoys: tokio::sync::watch::Receiver<u32>,
) -> anyhow::Result<Option<toolgate_xds::membership::Membership>> {
    use toolgate_model::control_plane::XdsMember;
    let bound = admin
        .local_addr()
        .context("reading the admin listener's address")?;
    let advertised = args
        .admin_advertise
        .or((!bound.ip().is_unspecified()).then_some(bound));
    let local = advertised.unwrap_or_else(|| {
        let loopback: std::net::IpAddr = if bound.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        SocketAddr::new(loopback, bound.port())
    });
    let own_id = advertised.map(XdsMember::id_for);
    registry
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .set_control_local(own_id.clone(), local);
    let (Some(addr), Some(id)) = (advertised, own_id) else {
        warn!(admin = %bound, local = %local,
            "the admin API listens on every address and no --admin-advertise says which one the fleet reaches: this toolgate-xds is not registered in etcd (<prefix>xds/), so no other gateway's Envoy falls back to it; its own Envoys reach it at the local address");
        return Ok(None);
    };
    let key = KeyLayout::new(&args.prefix).xds_key(&id);
    info!(%key, admin = %addr, "joining the fleet's toolgate-xds");
    // The registration says how many Envoys this process serves, as that changes: the
    // fleet's size, which every toolgate-xds splits call limits by.
    let member = XdsMember::new(addr, env!("CARGO_PKG_VERSION"));
    let (value, values) = tokio::sync::watch::channel(member.to_json());
    tokio::spawn(async move {
        while envoys.changed().await.is_ok() {
            let n = *envoys.borrow_and_update();
            let _ = value.send(
                XdsMember {
                    envoys: n,
                    ..member.clone()
                }
                .to_json(),
            );
        }
    });
    Ok(Some(toolgate_xds::membership::Membership::spawn_changing(
        etcd.clone(),
        key,
        values,
    )))
}

/// Gives the registry the number of Envoys this process serves as it changes, and publishes
/// when what the filters get changes with it (only while some call limit splits by it).
async fn count_envoys(
    mut envoys: tokio::sync::watch::Receiver<u32>,
    registry: Arc<RwLock<Registry>>,
    publisher: Publisher,
) {
    while envoys.changed().await.is_ok() {
        let n = *envoys.borrow_and_update();
        let mut r = registry.write().unwrap_or_else(|p| p.into_inner());
        if r.set_local_envoys(n) {
            info!(
                envoys = n,
                gateways = r.gateways(),
                "the fleet's size changed: call limits are split anew"
            );
            publisher.changed(std::time::Instant::now());
        }
    }
}

/// A secret from `--<what>-token-file` or the variable `--<what>-token-env` names (never a
/// flag value: a command line shows in `ps`).
fn read_secret(
    what: &str,
    file: &Option<PathBuf>,
    var: &Option<String>,
) -> anyhow::Result<Option<String>> {
    Ok(match (file, var) {
        (Some(path), _) => Some(std::fs::read_to_string(path).with_context(|| {
            format!(
                "reading the {what} token from --{what}-token-file {}",
                path.display()
            )
        })?),
        (None, Some(var)) => {
            Some(std::env::var(var).with_context(|| {
                format!("reading the {what} token from --{what}-token-env {var}")
            })?)
        }
        (None, None) => None,
    })
}

/// Deletes the sessions held for clients that nobody used for a while.
async fn expire_upstream_sessions(upstream: Arc<toolgate_xds::upstream::UpstreamSessions>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
    loop {
        tick.tick().await;
        let n = upstream.expire(toolgate_xds::upstream::IDLE_EXPIRY).await;
        if n > 0 {
            info!(sessions = n, "deleted idle sessions held for clients");
        }
    }
}
