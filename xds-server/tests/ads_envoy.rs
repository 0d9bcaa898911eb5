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

use toolgate_xds::bootstrap::{self, BootstrapOptions, Upstream};
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
        trace: Default::default(),
        services: services
            .iter()
            .map(|(name, mcp_path, endpoints)| {
                (
                    name.to_string(),
                    ServiceRoute {
                        mcp_path: mcp_path.to_string(),
                        limits: LIMITS,
                        timeout_ms: 60_000,
                        endpoints: endpoints.clone(),
                    }
                    .into(),
                )
            })
            .collect::<BTreeMap<_, _>>(),
        filter_config: String::from("{}"),
        max_body_bytes: 1024 * 1024,
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
            for r in vh["routes"].as_array().into_iter().flatten() {
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

#[test]
fn rendered_bootstrap_passes_envoy_validation() {
    let dir = scratch_dir("validate");
    let config = dir.join("bootstrap.json");
    let opts = BootstrapOptions {
        node_id: "validate".into(),
        cluster: "toolgate".into(),
        listen: SocketAddr::new(LOCALHOST, free_port()),
        xds: Upstream::Ip(SocketAddr::new(LOCALHOST, free_port())),
        admin: SocketAddr::new(LOCALHOST, free_port()),
        control: Upstream::Ip(SocketAddr::new(LOCALHOST, free_port())),
        filter: None,
        xds_tls: None,
        access_log: None,
        edge: Default::default(),
    };
    // Addresses, then names Envoy resolves itself (as in Compose and Kubernetes), with the
    // filter and the access log reading its fields.
    let by_name = BootstrapOptions {
        xds: "toolgate-xds.toolgate.svc.cluster.local:18000"
            .parse()
            .expect("a name"),
        control: "toolgate-xds:19000".parse().expect("a name"),
        filter: Some(dir.join("toolgate_filter.wasm")),
        access_log: Some(dir.join("access.log")),
        ..opts.clone()
    };
    for (what, opts) in [("addresses", opts), ("names", by_name)] {
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
async fn envoy_follows_snapshots_over_ads_and_nothing_is_sent_when_nothing_changed() {
    use reqwest::Method;
    use EndpointHealth::{Draining, Healthy};
    // The server's logs, shown with the failure (RUST_LOG overrides the level).
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "toolgate_xds=debug".into()),
        )
        .try_init();

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
        node_id: node_id.into(),
        cluster: "toolgate".into(),
        listen: SocketAddr::new(LOCALHOST, free_port()),
        xds: Upstream::Ip(xds),
        admin: SocketAddr::new(LOCALHOST, free_port()),
        control: Upstream::Ip(SocketAddr::new(LOCALHOST, free_port())),
        filter: None,
        xds_tls: None,
        access_log: None,
        edge: Default::default(),
    };
    let envoy = Envoy::start(&scratch_dir("ads-envoy"), &options("envoy-under-test"));
    // A second Envoy on the same server: every stream gets every change.
    let second = Envoy::start(&scratch_dir("ads-envoy-2"), &options("second-envoy"));
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
        trace: Default::default(),
        services: bigger.services.clone(),
        filter_config: String::from("{}"),
        max_body_bytes: 1024 * 1024,
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
