//! The ADS server against a real Envoy: Envoy started with the bootstrap `render` prints, fed by
//! hand-made routing snapshots, must converge to each one; traffic through its listener must
//! reach the right instance on the rewritten path; and a snapshot with nothing new must cost
//! no xDS response. Everything on 127.0.0.1, every wait bounded.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use toolgate_xds::bootstrap::{self, BootstrapOptions, Upstream, XdsProtocol};
use toolgate_xds::metrics::{Metrics, TypeLabel};
use toolgate_xds::routing::{
    Bulkhead, EndpointHealth, RouteEndpoint, RoutingSnapshot, ServiceRoute,
};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const CONVERGE: Duration = Duration::from_secs(20);
/// Not Envoy's defaults (1024, 1024, 1024, 3), so they are seen to arrive.
const LIMITS: Bulkhead = Bulkhead {
    max_connections: 64,
    max_pending_requests: 32,
    max_requests: 128,
    max_retries: 1,
};

fn envoy_bin() -> PathBuf {
    let path = std::env::var_os("TOOLGATE_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/toolgate-bin/envoy")
        });
    assert!(
        path.exists(),
        "{} is missing: run `make setup` (scripts/setup.sh)",
        path.display()
    );
    path
}

fn scratch_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{test}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("creating the test's scratch directory");
    dir
}

// Ports for Envoy to listen on come from the harness's allocator (below the ephemeral range,
// never handed out twice): a port from `bind(0)` is ephemeral and could be taken by any
// outgoing connection between this test releasing it and Envoy binding it. The listeners this
// process keeps open itself (the ADS server, the stand-in upstreams) still bind port 0: they
// hold their port from the start, so there is no such window.
use toolgate_tests::free_port;

/// A running Envoy; killed on drop, its log printed if the test is failing.
struct Envoy {
    child: Child,
    log: PathBuf,
    admin: String,
    listen: String,
}

impl Envoy {
    fn start(dir: &std::path::Path, opts: &BootstrapOptions) -> Envoy {
        let config = dir.join("bootstrap.json");
        std::fs::write(&config, bootstrap::render(opts)).expect("writing the bootstrap");
        let log = dir.join("envoy.log");
        let out = std::fs::File::create(&log).expect("creating the Envoy log");
        let err = out.try_clone().expect("cloning the log handle");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config)
            .args([
                "--concurrency",
                "1",
                "--log-level",
                "info",
                "--drain-time-s",
                "1",
            ])
            // Parallel Envoys on one machine need distinct shared-memory ids.
            .args(["--base-id", &rand::random::<u16>().to_string()])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("starting envoy");
        Envoy {
            child,
            log,
            admin: format!("http://{}", opts.admin),
            listen: format!("http://{}", opts.listen),
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("===== envoy log ({}) =====\n{log}", self.log.display());
        }
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client")
}

async fn get_text(client: &reqwest::Client, url: &str) -> Option<String> {
    client.get(url).send().await.ok()?.text().await.ok()
}

/// Polls `check` every 100 ms until it returns `Some`, or fails after `timeout` with `what`
/// and the last observation.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last seen:\n{last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A stand-in MCP server: answers `<name> <METHOD> <path>`, hands out the session id
/// `sess-<name>`, and answers 404 to any other session id (the MCP rule for unknown sessions).
async fn upstream(name: &'static str) -> (u16, JoinHandle<()>) {
    let listener = TcpListener::bind((LOCALHOST, 0))
        .await
        .expect("binding an upstream");
    let port = listener.local_addr().expect("upstream address").port();
    let task = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(serve_one(conn, name));
        }
    });
    (port, task)
}

async fn serve_one(mut conn: TcpStream, name: &str) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or_default().split(' ');
    let method = request_line.next().unwrap_or_default().to_string();
    let path = request_line.next().unwrap_or_default().to_string();
    let header = |want: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(want)
                .then(|| v.trim().to_string())
        })
    };
    let body_len: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + 4 + body_len {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let session = format!("sess-{name}");
    let (status, body) = match header("mcp-session-id") {
        Some(s) if s != session => ("404 Not Found", format!("{name}: unknown session {s}")),
        _ => ("200 OK", format!("{name} {method} {path}")),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nMcp-Session-Id: {session}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

fn instance(id: &str, port: u16, health: EndpointHealth) -> RouteEndpoint {
    RouteEndpoint {
        instance_id: id.to_string(),
        ip: LOCALHOST,
        port,
        weight: 1,
        health,
    }
}

fn snapshot(
    generation: u64,
    services: &[(&str, &str, Vec<RouteEndpoint>)],
) -> Arc<RoutingSnapshot> {
    Arc::new(RoutingSnapshot {
        generation,
        changed_at: Instant::now(),
        traces: Default::default(),
        recent: Arc::from([]),
        services: services
            .iter()
            .map(|(name, mcp_path, endpoints)| {
                (
                    name.to_string(),
                    ServiceRoute {
                        mcp_path: mcp_path.to_string(),
                        limits: LIMITS,
                        timeout_ms: 60_000,
                        credential_header: None,
                        endpoints: endpoints.clone(),
                    },
                )
            })
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
    })
}

/// xDS responses sent so far: `[cds, eds, rds]`.
fn pushes(metrics: &Metrics) -> [u64; 3] {
    ["cds", "eds", "rds"].map(|t| metrics.pushes.get_or_create(&TypeLabel { r#type: t }).get())
}

fn nacks(metrics: &Metrics) -> u64 {
    ["cds", "eds", "rds", "ecds"]
        .map(|t| metrics.nacks.get_or_create(&TypeLabel { r#type: t }).get())
        .iter()
        .sum()
}

/// A reply through Envoy's listener.
struct Reply {
    status: u16,
    body: String,
    session: Option<String>,
}

async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    session: Option<&str>,
) -> Result<Reply, String> {
    let mut req = client.request(method.clone(), url);
    if method == reqwest::Method::POST {
        req = req.body("{}");
    }
    if let Some(s) = session {
        req = req.header("Mcp-Session-Id", s);
    }
    let r = req
        .send()
        .await
        .map_err(|e| format!("{method} {url}: {e}"))?;
    let status = r.status().as_u16();
    let session = r
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = r.text().await.map_err(|e| e.to_string())?;
    Ok(Reply {
        status,
        body,
        session,
    })
}

/// Waits until `method url` answers `status`, and returns the reply.
async fn wait_reply(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    session: Option<&str>,
    status: u16,
) -> Reply {
    wait_for(&format!("{method} {url} → {status}"), CONVERGE, || async {
        let r = call(client, method.clone(), url, session).await?;
        if r.status == status {
            Ok(r)
        } else {
            Err(format!("{}: {}", r.status, r.body))
        }
    })
    .await
}

/// Waits until `/clusters` shows exactly `want` (address → health flags, weight) for
/// `cluster`, and returns the whole `/clusters` text.
async fn wait_hosts(
    client: &reqwest::Client,
    admin: &str,
    cluster: &str,
    want: &[(&str, &str, u32)],
) -> String {
    let want: BTreeMap<String, (String, u32)> = want
        .iter()
        .map(|(a, f, w)| (a.to_string(), (f.to_string(), *w)))
        .collect();
    wait_for(&format!("{cluster} hosts {want:?}"), CONVERGE, || async {
        let text = get_text(client, &format!("{admin}/clusters"))
            .await
            .unwrap_or_default();
        if hosts(&text, cluster) == want {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await
}

/// The hosts of `cluster` in `/clusters`: address → (health flags, weight).
fn hosts(clusters: &str, cluster: &str) -> BTreeMap<String, (String, u32)> {
    let prefix = format!("{cluster}::");
    let mut flags = BTreeMap::new();
    let mut weights = BTreeMap::new();
    for line in clusters.lines().filter_map(|l| l.strip_prefix(&prefix)) {
        let Some((addr, rest)) = line.split_once("::") else {
            continue;
        };
        if let Some(f) = rest.strip_prefix("health_flags::") {
            flags.insert(addr.to_string(), f.to_string());
        } else if let Some(w) = rest.strip_prefix("weight::") {
            weights.insert(addr.to_string(), w.parse().unwrap_or(0));
        }
    }
    flags
        .into_iter()
        .map(|(a, f)| {
            let w = weights.get(&a).copied().unwrap_or(0);
            (a, (f, w))
        })
        .collect()
}

/// The dynamic route configurations in `/config_dump`, as JSON.
async fn route_dump(client: &reqwest::Client, admin: &str) -> Result<Value, String> {
    let text = get_text(
        client,
        &format!("{admin}/config_dump?resource=dynamic_route_configs"),
    )
    .await
    .ok_or("admin not answering")?;
    serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))
}

fn route_summary(dump: &Value) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        let rc = &config["route_config"];
        for vh in rc["virtual_hosts"].as_array().into_iter().flatten() {
            // The services' routes; the virtual servers' (`/mcp`, `/virtual/…`) are checked by
            // tests/tests/virtual_servers.rs.
            for r in vh["routes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["match"]["path_separated_prefix"].is_string())
            {
                out.push((
                    r["match"]["path_separated_prefix"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    r["match"]["headers"][0]["string_match"]["exact"]
                        .as_str()
                        .unwrap_or("*")
                        .to_string(),
                    r["route"]["prefix_rewrite"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    r["route"]["timeout"].as_str().unwrap_or("").to_string(),
                ));
            }
        }
    }
    out
}

/// The server's logs, shown with a failure (RUST_LOG overrides the level).
fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "toolgate_xds=debug".into()),
        )
        .try_init();
}

#[test]
fn rendered_bootstrap_passes_envoy_validation() {
    let dir = scratch_dir("validate");
    let config = dir.join("bootstrap.json");
    let opts = BootstrapOptions {
        xds_protocol: XdsProtocol::Delta,
        node_id: "validate".into(),
        cluster: "toolgate".into(),
        listen: SocketAddr::new(LOCALHOST, free_port()),
        xds: Upstream::Ip(SocketAddr::new(LOCALHOST, free_port())),
        admin: SocketAddr::new(LOCALHOST, free_port()),
        filter: None,
        native_mcp_filter: false,
        route_table: Default::default(),
        xds_tls: None,
        access_log: None,
        services: None,
        edge: Default::default(),
    };
    // Addresses, then names Envoy resolves itself (as in Compose and Kubernetes), with the
    // filter and the access log reading its fields.
    let by_name = BootstrapOptions {
        xds: "toolgate-xds.toolgate.svc.cluster.local:18000"
            .parse()
            .expect("a name"),
        filter: Some(dir.join("toolgate_filter.wasm")),
        access_log: Some(dir.join("access.log")),
        // A shard: its node metadata lists its services.
        services: Some(
            toolgate_xds::xds::shard::ServiceSelector::parse_list("billing-*,search")
                .expect("patterns"),
        ),
        ..opts.clone()
    };
    // Envoy's own MCP filter in the toolgate filter's place (the data-plane bench's reference).
    let native = BootstrapOptions {
        native_mcp_filter: true,
        ..opts.clone()
    };
    let sotw = BootstrapOptions {
        xds_protocol: XdsProtocol::Sotw,
        ..opts.clone()
    };
    for (what, opts) in [
        ("state-of-the-world ADS", sotw),
        ("addresses", opts),
        ("names", by_name),
        ("the native MCP filter", native),
    ] {
        std::fs::write(&config, bootstrap::render(&opts)).expect("writing the bootstrap");
        let out = Command::new(envoy_bin())
            .arg("--mode")
            .arg("validate")
            .arg("-c")
            .arg(&config)
            .args(["--base-id", &rand::random::<u16>().to_string()])
            .output()
            .expect("running envoy --mode validate");
        assert!(
            out.status.success(),
            "envoy rejected the bootstrap with {what}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_snapshots_over_delta_ads_and_nothing_is_sent_when_nothing_changed() {
    follows_snapshots(XdsProtocol::Delta).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_snapshots_over_sotw_ads_and_nothing_is_sent_when_nothing_changed() {
    follows_snapshots(XdsProtocol::Sotw).await;
}

/// Every step holds under both protocols, push counts included: an endpoint change is one EDS
/// response, a changed cluster one CDS and one EDS response, an unchanged snapshot nothing.
async fn follows_snapshots(protocol: XdsProtocol) {
    use reqwest::Method;
    use EndpointHealth::{Draining, Healthy};
    init_logs();

    let (inv_a, _a) = upstream("inv-a").await;
    let (inv_b, _b) = upstream("inv-b").await;
    let (bill_a, _c) = upstream("bill-a").await;
    let addr = |port: u16| format!("127.0.0.1:{port}");

    let xds_listener = TcpListener::bind((LOCALHOST, 0))
        .await
        .expect("binding xDS");
    let xds = xds_listener.local_addr().expect("xDS address");
    let metrics = Arc::new(Metrics::new());
    let (publish, snapshots) = watch::channel(snapshot(
        1,
        &[("inventory", "/rpc", vec![instance("inv-a", inv_a, Healthy)])],
    ));
    let (stop, stopped) = oneshot::channel::<()>();
    let connections = Arc::new(toolgate_xds::xds::Connections::default());
    let server = tokio::spawn(toolgate_xds::xds::serve(
        xds_listener,
        snapshots,
        Arc::clone(&metrics),
        Arc::clone(&connections),
        toolgate_xds::xds::ServeOptions::default(),
        async move {
            let _ = stopped.await;
        },
    ));

    let options = |node_id: &str| BootstrapOptions {
        xds_protocol: protocol,
        node_id: node_id.into(),
        cluster: "toolgate".into(),
        listen: SocketAddr::new(LOCALHOST, free_port()),
        xds: Upstream::Ip(xds),
        admin: SocketAddr::new(LOCALHOST, free_port()),
        filter: None,
        native_mcp_filter: false,
        route_table: Default::default(),
        xds_tls: None,
        access_log: None,
        services: None,
        edge: Default::default(),
    };
    let dir = |name: &str| scratch_dir(&format!("{name}-{protocol:?}"));
    let envoy = Envoy::start(&dir("ads-envoy"), &options("envoy-under-test"));
    // A second Envoy on the same server: every stream gets every change.
    let second = Envoy::start(&dir("ads-envoy-2"), &options("second-envoy"));
    let client = http();
    let admin = envoy.admin.clone();
    let mcp = |path: &str| format!("{}{path}", envoy.listen);

    // 1. The first snapshot: one service with one instance, its cluster and its routes.
    let clusters = wait_hosts(
        &client,
        &admin,
        "mcp.inventory",
        &[(&addr(inv_a), "healthy", 1)],
    )
    .await;
    for limit in [
        "max_connections::64",
        "max_pending_requests::32",
        "max_requests::128",
        "max_retries::1",
    ] {
        assert!(
            clusters.contains(&format!("mcp.inventory::default_priority::{limit}")),
            "bulkhead {limit} in /clusters:\n{clusters}"
        );
    }
    let routes = wait_for("toolgate_routes in /config_dump", CONVERGE, || async {
        let dump = route_dump(&client, &admin).await?;
        let summary = route_summary(&dump);
        if summary.is_empty() {
            Err(dump.to_string())
        } else {
            Ok(summary)
        }
    })
    .await;
    assert_eq!(
        routes,
        [
            (
                "/mcp/inventory".into(),
                "GET".into(),
                "/rpc".into(),
                "0s".into()
            ),
            (
                "/mcp/inventory".into(),
                "*".into(),
                "/rpc".into(),
                "60s".into()
            ),
        ],
        "GET streams first and without timeout, then the rest with 60 s"
    );
    let r = wait_reply(
        &client,
        Method::GET,
        &mcp("/mcp/inventory/x?y=1"),
        None,
        200,
    )
    .await;
    assert_eq!(
        r.body, "inv-a GET /rpc/x?y=1",
        "prefix rewritten to mcp_path"
    );
    let r = call(&client, Method::POST, &mcp("/mcp/inventory"), None)
        .await
        .expect("POST");
    assert_eq!((r.status, r.body.as_str()), (200, "inv-a POST /rpc"));
    // Both Envoys are listed with what they were sent and acknowledged (`/v1/envoys`).
    let listed = wait_for("both Envoys listed with CDS acked", CONVERGE, || async {
        let list = connections.list();
        let mut nodes: Vec<&str> = list
            .iter()
            .filter(|c| {
                c.types
                    .get("cds")
                    .is_some_and(|t| t.acked_version.is_some() && t.acked_version == t.sent_version)
            })
            .map(|c| c.node.as_str())
            .collect();
        nodes.sort();
        if nodes.len() == 2 {
            Ok(nodes.join(","))
        } else {
            Err(format!("{list:?}"))
        }
    })
    .await;
    assert_eq!(listed, "envoy-under-test,second-envoy");
    for unknown in ["/mcp/inventoryX", "/mcp/billing", "/elsewhere"] {
        let r = call(&client, Method::GET, &mcp(unknown), None)
            .await
            .expect("GET");
        assert_eq!(r.status, 404, "{unknown} matches no route: {}", r.body);
    }

    // 2. One instance more, one service more: the new cluster warms, gets its assignment and
    // its route, all without restarting Envoy.
    publish.send_replace(snapshot(
        2,
        &[
            ("billing", "/mcp", vec![instance("bill-a", bill_a, Healthy)]),
            (
                "inventory",
                "/rpc",
                vec![
                    instance("inv-a", inv_a, Healthy),
                    instance("inv-b", inv_b, Healthy),
                ],
            ),
        ],
    ));
    wait_hosts(
        &client,
        &admin,
        "mcp.inventory",
        &[(&addr(inv_a), "healthy", 1), (&addr(inv_b), "healthy", 1)],
    )
    .await;
    wait_hosts(
        &client,
        &admin,
        "mcp.billing",
        &[(&addr(bill_a), "healthy", 1)],
    )
    .await;
    let r = wait_reply(&client, Method::POST, &mcp("/mcp/billing"), None, 200).await;
    assert_eq!(r.body, "bill-a POST /mcp");
    wait_hosts(
        &client,
        &second.admin,
        "mcp.billing",
        &[(&addr(bill_a), "healthy", 1)],
    )
    .await;
    wait_hosts(
        &client,
        &second.admin,
        "mcp.inventory",
        &[(&addr(inv_a), "healthy", 1), (&addr(inv_b), "healthy", 1)],
    )
    .await;
    assert_eq!(metrics.connected_envoys.get(), 2);
    drop(second);

    wait_for("the second Envoy's stream closed", CONVERGE, || async {
        match metrics.connected_envoys.get() {
            1 => Ok(()),
            n => Err(format!("{n} connected")),
        }
    })
    .await;

    // 3. Session affinity: the envelope pins a session to its instance...
    let first = call(&client, Method::POST, &mcp("/mcp/inventory"), None)
        .await
        .expect("initialize");
    let wrapped = first.session.expect("a session id in the response");
    assert!(
        wrapped.contains(";UV:"),
        "Envoy wraps the server's session id with the upstream address: {wrapped}"
    );
    let pinned = first.body.split(' ').next().unwrap_or_default().to_string();
    for _ in 0..6 {
        let r = call(
            &client,
            Method::POST,
            &mcp("/mcp/inventory"),
            Some(&wrapped),
        )
        .await
        .expect("request in the session");
        assert_eq!(
            r.status, 200,
            "the pinned instance knows its session: {}",
            r.body
        );
        assert!(
            r.body.starts_with(&pinned),
            "{} is not from {pinned}",
            r.body
        );
    }
    // ...and when that instance is gone, another one answers 404 for the unknown session.
    let ((gone_id, gone_port), (kept_id, kept_port)) = if pinned == "inv-a" {
        (("inv-a", inv_a), ("inv-b", inv_b))
    } else {
        (("inv-b", inv_b), ("inv-a", inv_a))
    };
    publish.send_replace(snapshot(
        3,
        &[
            ("billing", "/mcp", vec![instance("bill-a", bill_a, Healthy)]),
            (
                "inventory",
                "/rpc",
                vec![instance(kept_id, kept_port, Healthy)],
            ),
        ],
    ));
    let r = wait_reply(
        &client,
        Method::POST,
        &mcp("/mcp/inventory"),
        Some(&wrapped),
        404,
    )
    .await;
    assert!(
        r.body.starts_with(kept_id),
        "404 from the remaining instance: {}",
        r.body
    );

    // 4. Health and weight are EDS-only changes: CDS and RDS are not sent again.
    let before = pushes(&metrics);
    let mut heavy = instance(kept_id, kept_port, Healthy);
    heavy.weight = 7;
    let mut back = instance(gone_id, gone_port, Draining);
    back.weight = 0; // clamped to 1: Envoy rejects 0
    let health = snapshot(
        4,
        &[
            ("billing", "/mcp", vec![instance("bill-a", bill_a, Healthy)]),
            ("inventory", "/rpc", vec![heavy, back]),
        ],
    );
    publish.send_replace(Arc::clone(&health));
    wait_hosts(
        &client,
        &admin,
        "mcp.inventory",
        &[
            (&addr(kept_port), "healthy", 7),
            (&addr(gone_port), "/eds_status_draining", 1),
        ],
    )
    .await;
    let after = pushes(&metrics);
    assert_eq!(
        (after[0], after[2]),
        (before[0], before[2]),
        "no CDS or RDS for an endpoint change"
    );
    assert_eq!(after[1], before[1] + 1, "one EDS response");

    // 5. A changed cluster (new limits, same endpoints) is re-created by Envoy and warms
    // until it has an assignment: it gets one although EDS did not change.
    let before = pushes(&metrics);
    let mut bigger = (*health).clone();
    bigger.generation = 5;
    if let Some(inventory) = bigger.services.get_mut("inventory") {
        Arc::make_mut(inventory).limits.max_connections = 65;
    }
    let bigger = Arc::new(bigger);
    publish.send_replace(Arc::clone(&bigger));
    let warmed = Instant::now();
    wait_for(
        "the changed cluster active with its new limit",
        CONVERGE,
        || async {
            let text = get_text(&client, &format!("{admin}/clusters"))
                .await
                .unwrap_or_default();
            let warming = get_text(
                &client,
                &format!("{admin}/config_dump?resource=dynamic_warming_clusters"),
            )
            .await
            .unwrap_or_default();
            if text.contains("mcp.inventory::default_priority::max_connections::65")
                && !warming.contains("mcp.inventory")
            {
                Ok(())
            } else {
                Err(warming)
            }
        },
    )
    .await;
    assert!(
        warmed.elapsed() < Duration::from_secs(5),
        "warming took {:?} (Envoy's initial_fetch_timeout is 15 s)",
        warmed.elapsed()
    );
    let r = call(&client, Method::POST, &mcp("/mcp/inventory"), None)
        .await
        .expect("POST after the cluster changed");
    assert_eq!(r.status, 200, "{}", r.body);
    let after = pushes(&metrics);
    assert_eq!(after[0], before[0] + 1, "one CDS response");
    assert_eq!(after[1], before[1] + 1, "EDS follows CDS, unchanged or not");
    assert_eq!(after[2], before[2], "no RDS");

    // 6. The same content again, under a new generation: no xDS response at all.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = pushes(&metrics);
    publish.send_replace(Arc::new(RoutingSnapshot {
        generation: 6,
        changed_at: Instant::now(),
        traces: Default::default(),
        recent: Arc::from([]),
        services: bigger.services.clone(),
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
    }));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pushes(&metrics),
        before,
        "an unchanged snapshot sends nothing"
    );
    assert_eq!(nacks(&metrics), 0, "Envoy rejected a response; see its log");
    assert_eq!(metrics.connected_envoys.get(), 1);

    // 7. Shutdown ends the ADS stream, so the server returns although Envoy stays connected.
    let _ = stop.send(());
    let served = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns after shutdown")
        .expect("serve task did not panic");
    served.expect("serve ended cleanly");
    assert_eq!(metrics.connected_envoys.get(), 0);
    drop(envoy);
}

// ---- NACKs: no rejected response may leave Envoy with a stale endpoint set ----------------
//
// The failpoint `arm_nack_instance` builds every endpoint of an instance with weight 0, so Envoy
// rejects each EDS response that carries its assignment, whole (it validates every resource
// before applying any). Pausing Envoy (SIGSTOP) lets two responses go out before it answers the
// first: its NACK then names a response older than the latest, as on a busy Envoy.

/// Hosts that only need to be listed: Envoy never connects to them here (no traffic, no
/// health checks), so the ports are never bound.
fn host(id: &str, port: u16) -> RouteEndpoint {
    instance(id, port, EndpointHealth::Healthy)
}

/// The ADS server in process, fed by hand-made snapshots, with one real Envoy connected.
struct Rig {
    publish: watch::Sender<Arc<RoutingSnapshot>>,
    metrics: Arc<Metrics>,
    connections: Arc<toolgate_xds::xds::Connections>,
    envoy: Envoy,
    client: reqwest::Client,
    generation: u64,
    /// Ends the server when dropped.
    _stop: oneshot::Sender<()>,
}

impl Rig {
    /// Serves `services`, starts Envoy, and waits until it has every cluster's hosts.
    async fn start(
        test: &str,
        protocol: XdsProtocol,
        services: &[(&str, Vec<RouteEndpoint>)],
    ) -> Rig {
        init_logs();
        let xds_listener = TcpListener::bind((LOCALHOST, 0))
            .await
            .expect("binding xDS");
        let xds = xds_listener.local_addr().expect("xDS address");
        let metrics = Arc::new(Metrics::new());
        let (publish, snapshots) = watch::channel(snapshot(1, &routes(services)));
        let (stop, stopped) = oneshot::channel::<()>();
        let connections = Arc::new(toolgate_xds::xds::Connections::default());
        tokio::spawn(toolgate_xds::xds::serve(
            xds_listener,
            snapshots,
            Arc::clone(&metrics),
            Arc::clone(&connections),
            toolgate_xds::xds::ServeOptions::default(),
            async move {
                let _ = stopped.await;
            },
        ));
        let opts = BootstrapOptions {
            xds_protocol: protocol,
            node_id: test.into(),
            cluster: "toolgate".into(),
            listen: SocketAddr::new(LOCALHOST, free_port()),
            xds: Upstream::Ip(xds),
            admin: SocketAddr::new(LOCALHOST, free_port()),
            filter: None,
            native_mcp_filter: false,
            route_table: Default::default(),
            xds_tls: None,
            access_log: None,
            services: None,
            edge: Default::default(),
        };
        let envoy = Envoy::start(&scratch_dir(test), &opts);
        let rig = Rig {
            publish,
            metrics,
            connections,
            envoy,
            client: http(),
            generation: 1,
            _stop: stop,
        };
        for (service, endpoints) in services {
            rig.wait_hosts(service, endpoints).await;
        }
        rig.wait_eds_answered().await;
        rig
    }

    /// Publishes `services` as the next snapshot and waits until the server sent the EDS
    /// response it causes (it goes out whether Envoy reads it or not).
    async fn publish_eds(&mut self, services: &[(&str, Vec<RouteEndpoint>)]) -> String {
        let before = self.eds().sent_version;
        self.publish_with(services, |_| ());
        wait_for("the EDS response sent", CONVERGE, || async {
            match self.eds().sent_version {
                Some(sent) if Some(&sent) != before.as_ref() => Ok(sent),
                _ => Err(format!("{:?}", self.eds())),
            }
        })
        .await
    }

    /// Publishes `services`, changed by `edit`, as the next snapshot.
    fn publish_with(
        &mut self,
        services: &[(&str, Vec<RouteEndpoint>)],
        edit: impl FnOnce(&mut RoutingSnapshot),
    ) {
        self.generation += 1;
        let mut next = (*snapshot(self.generation, &routes(services))).clone();
        edit(&mut next);
        self.publish.send_replace(Arc::new(next));
    }

    /// What the server last sent, and what Envoy acknowledged and refused, for EDS.
    fn eds(&self) -> toolgate_xds::xds::connections::TypeStatus {
        self.connections
            .list()
            .first()
            .and_then(|c| c.types.get("eds").cloned())
            .unwrap_or_default()
    }

    fn eds_nacks(&self) -> u64 {
        self.metrics
            .nacks
            .get_or_create(&TypeLabel { r#type: "eds" })
            .get()
    }

    /// Waits until Envoy acknowledged the last EDS response: nothing is in flight.
    async fn wait_eds_answered(&self) {
        wait_for("Envoy ACKs the last EDS response", CONVERGE, || async {
            let eds = self.eds();
            if eds.sent_version.is_some() && eds.acked_version == eds.sent_version {
                Ok(())
            } else {
                Err(format!("{eds:?}"))
            }
        })
        .await;
    }

    async fn wait_hosts(&self, service: &str, endpoints: &[RouteEndpoint]) {
        let want: Vec<(String, &str, u32)> = endpoints
            .iter()
            .map(|e| (format!("127.0.0.1:{}", e.port), "healthy", e.weight))
            .collect();
        let want: Vec<(&str, &str, u32)> =
            want.iter().map(|(a, f, w)| (a.as_str(), *f, *w)).collect();
        wait_hosts(
            &self.client,
            &self.envoy.admin,
            &format!("mcp.{service}"),
            &want,
        )
        .await;
    }

    /// SIGSTOP: Envoy reads nothing and answers nothing until [`resume`](Self::resume).
    fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.envoy.child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signalling Envoy");
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // A paused Envoy is still killed on drop; this only keeps a failure's log readable.
        self.resume();
    }
}

fn routes<'a>(
    services: &'a [(&'a str, Vec<RouteEndpoint>)],
) -> Vec<(&'a str, &'a str, Vec<RouteEndpoint>)> {
    services
        .iter()
        .map(|(name, endpoints)| (*name, "/mcp", endpoints.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_that_names_an_older_response_is_counted_against_its_version_sotw() {
    a_nack_that_names_an_older_response_is_counted_against_its_version(XdsProtocol::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_that_names_an_older_response_is_counted_against_its_version_delta() {
    a_nack_that_names_an_older_response_is_counted_against_its_version(XdsProtocol::Delta).await;
}

async fn a_nack_that_names_an_older_response_is_counted_against_its_version(protocol: XdsProtocol) {
    // Failpoints are global to the test binary: each run arms an instance of its own.
    let bad_id = format!("stale-x-bad-{protocol:?}");
    toolgate_xds::failpoint::arm_nack_instance(&bad_id);
    let (c1, c2, x1, bad) = (
        host("c1", 41101),
        host("c2", 41102),
        host("x1", 41103),
        host(&bad_id, 41104),
    );
    let mut rig = Rig::start(
        &format!("stale-nack-counted-{protocol:?}"),
        protocol,
        &[("c", vec![c1.clone()]), ("x", vec![x1.clone()])],
    )
    .await;

    // Version N carries x's invalid assignment; N+1 takes it back and changes c. Both go out
    // before Envoy reads either: its NACK of N arrives after N+1 was sent.
    rig.pause();
    let rejected = rig
        .publish_eds(&[
            ("c", vec![c1.clone()]),
            ("x", vec![x1.clone(), bad.clone()]),
        ])
        .await;
    rig.publish_eds(&[("c", vec![c1.clone(), c2.clone()]), ("x", vec![x1.clone()])])
        .await;
    rig.resume();

    rig.wait_hosts("c", &[c1, c2]).await;
    wait_for(
        "the NACK of the older response counted, against its version",
        Duration::from_secs(10),
        || async {
            let eds = rig.eds();
            if rig.eds_nacks() == 1 && eds.nacked_version.as_deref() == Some(rejected.as_str()) {
                Ok(())
            } else {
                Err(format!("{} EDS NACKs; {eds:?}", rig.eds_nacks()))
            }
        },
    )
    .await;
    rig.wait_hosts("x", &[x1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_eds_response_nacked_after_the_next_was_sent_is_not_lost_sotw() {
    a_partial_eds_response_nacked_after_the_next_was_sent_is_not_lost(XdsProtocol::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_eds_response_nacked_after_the_next_was_sent_is_not_lost_delta() {
    a_partial_eds_response_nacked_after_the_next_was_sent_is_not_lost(XdsProtocol::Delta).await;
}

async fn a_partial_eds_response_nacked_after_the_next_was_sent_is_not_lost(protocol: XdsProtocol) {
    // Failpoints are global to the test binary: each run arms an instance of its own.
    let bad_id = format!("partial-x-bad-{protocol:?}");
    toolgate_xds::failpoint::arm_nack_instance(&bad_id);
    let (a1, a2, c1, c2, x1, bad) = (
        host("a1", 41201),
        host("a2", 41202),
        host("c1", 41203),
        host("c2", 41204),
        host("x1", 41205),
        host(&bad_id, 41206),
    );
    let mut rig = Rig::start(
        &format!("partial-eds-nack-{protocol:?}"),
        protocol,
        &[
            ("a", vec![a1.clone()]),
            ("c", vec![c1.clone()]),
            ("x", vec![x1.clone()]),
        ],
    )
    .await;

    // N changes a and carries x's invalid assignment: Envoy rejects all of N. N+1 changes only
    // c, so it carries only c. Both go out before Envoy answers N.
    rig.pause();
    rig.publish_eds(&[
        ("a", vec![a1.clone(), a2.clone()]),
        ("c", vec![c1.clone()]),
        ("x", vec![x1.clone(), bad.clone()]),
    ])
    .await;
    rig.publish_eds(&[
        ("a", vec![a1.clone(), a2.clone()]),
        ("c", vec![c1.clone(), c2.clone()]),
        ("x", vec![x1.clone(), bad.clone()]),
    ])
    .await;
    rig.resume();

    // a's change reaches Envoy although the response that first carried it was rejected; x
    // keeps what Envoy had, the invalid assignment is not resent in a loop.
    rig.wait_hosts("c", &[c1, c2]).await;
    rig.wait_hosts("a", &[a1, a2]).await;
    rig.wait_hosts("x", &[x1]).await;
    // Two NACKs: N (naming an older response than the last), then x's assignment alone.
    wait_for("Envoy's answers to everything sent", CONVERGE, || async {
        let eds = rig.eds();
        if rig.eds_nacks() == 2 && eds.acked_version == eds.sent_version {
            Ok(())
        } else {
            Err(format!("{} EDS NACKs; {eds:?}", rig.eds_nacks()))
        }
    })
    .await;
    let (pushes_then, nacks_then) = (pushes(&rig.metrics)[1], rig.eds_nacks());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        (pushes(&rig.metrics)[1], rig.eds_nacks()),
        (pushes_then, nacks_then),
        "no EDS response or NACK after converging"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_recreated_after_an_eds_nack_gets_its_assignment_sotw() {
    a_cluster_recreated_after_an_eds_nack_gets_its_assignment(XdsProtocol::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_recreated_after_an_eds_nack_gets_its_assignment_delta() {
    a_cluster_recreated_after_an_eds_nack_gets_its_assignment(XdsProtocol::Delta).await;
}

async fn a_cluster_recreated_after_an_eds_nack_gets_its_assignment(protocol: XdsProtocol) {
    // Failpoints are global to the test binary: each run arms an instance of its own.
    let bad_id = format!("recreated-x-bad-{protocol:?}");
    toolgate_xds::failpoint::arm_nack_instance(&bad_id);
    let (a1, x1, bad) = (host("a1", 41301), host("x1", 41302), host(&bad_id, 41303));
    let mut rig = Rig::start(
        &format!("recreated-after-nack-{protocol:?}"),
        protocol,
        &[("a", vec![a1.clone()]), ("x", vec![x1.clone()])],
    )
    .await;

    // Envoy rejects the EDS version that carries x's invalid assignment...
    let services = [("a", vec![a1.clone()]), ("x", vec![x1.clone(), bad])];
    rig.publish_eds(&services).await;
    wait_for("Envoy NACKs x's assignment", CONVERGE, || async {
        match rig.eds_nacks() {
            0 => Err(format!("{:?}", rig.eds())),
            _ => Ok(()),
        }
    })
    .await;

    // ...then a's cluster changes (new limits, same endpoints): Envoy re-creates it, and it
    // warms until it gets an assignment, although the EDS version did not change.
    rig.publish_with(&services, |s| {
        if let Some(a) = s.services.get_mut("a") {
            Arc::make_mut(a).limits.max_connections = 65;
        }
    });
    let admin = rig.envoy.admin.clone();
    wait_for(
        "a's re-created cluster active with its new limit, well before Envoy's 15 s initial_fetch_timeout",
        Duration::from_secs(5),
        || async {
            let text = get_text(&rig.client, &format!("{admin}/clusters"))
                .await
                .unwrap_or_default();
            let warming = get_text(
                &rig.client,
                &format!("{admin}/config_dump?resource=dynamic_warming_clusters"),
            )
            .await
            .unwrap_or_default();
            if text.contains("mcp.a::default_priority::max_connections::65")
                && !warming.contains("mcp.a")
            {
                Ok(())
            } else {
                Err(format!("{:?}\nwarming: {warming}", rig.eds()))
            }
        },
    )
    .await;
    rig.wait_hosts("a", &[a1]).await;
    rig.wait_hosts("x", &[x1]).await;
}
