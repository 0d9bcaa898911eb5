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

use toolgate_xds::bootstrap::{self, BootstrapOptions};
use toolgate_xds::metrics::{Metrics, TypeLabel};
use toolgate_xds::routing::{
    Bulkhead, EndpointHealth, RouteEndpoint, RoutingSnapshot, ServiceRoute,
};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const CONVERGE: Duration = Duration::from_secs(20);

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

fn free_port() -> u16 {
    std::net::TcpListener::bind((LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

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
        services: services
            .iter()
            .map(|(name, mcp_path, endpoints)| {
                (
                    name.to_string(),
                    ServiceRoute {
                        mcp_path: mcp_path.to_string(),
                        limits: Bulkhead::default(),
                        endpoints: endpoints.clone(),
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
    })
}

fn count(metrics: &Metrics, family: &str, ty: &'static str) -> u64 {
    let label = TypeLabel { r#type: ty };
    match family {
        "pushes" => metrics.pushes.get_or_create(&label).get(),
        "nacks" => metrics.nacks.get_or_create(&label).get(),
        _ => unreachable!("unknown family {family}"),
    }
}

/// `/clusters` lines of `cluster`'s hosts: `address -> health_flags`.
fn hosts(clusters: &str, cluster: &str) -> BTreeMap<String, String> {
    let prefix = format!("{cluster}::");
    clusters
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|l| {
            let (addr, rest) = l.split_once("::")?;
            let flags = rest.strip_prefix("health_flags::")?;
            Some((addr.to_string(), flags.to_string()))
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
        xds: SocketAddr::new(LOCALHOST, free_port()),
        admin: SocketAddr::new(LOCALHOST, free_port()),
        filter: None,
    };
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
        "envoy rejected the bootstrap:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_snapshots_over_ads_and_nothing_is_sent_when_nothing_changed() {
    let (inv_a, _a) = upstream("inv-a").await;
    let (inv_b, _b) = upstream("inv-b").await;
    let (bill_a, _c) = upstream("bill-a").await;

    let xds_listener = TcpListener::bind((LOCALHOST, 0))
        .await
        .expect("binding xDS");
    let xds = xds_listener.local_addr().expect("xDS address");
    let metrics = Arc::new(Metrics::new());
    let (publish, snapshots) = watch::channel(snapshot(
        1,
        &[(
            "inventory",
            "/rpc",
            vec![instance("inv-a", inv_a, EndpointHealth::Healthy)],
        )],
    ));
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(toolgate_xds::xds::serve(
        xds_listener,
        snapshots,
        Arc::clone(&metrics),
        async move {
            let _ = stopped.await;
        },
    ));

    let dir = scratch_dir("ads-envoy");
    let opts = BootstrapOptions {
        node_id: "envoy-under-test".into(),
        cluster: "toolgate".into(),
        listen: SocketAddr::new(LOCALHOST, free_port()),
        xds,
        admin: SocketAddr::new(LOCALHOST, free_port()),
        filter: None,
    };
    let envoy = Envoy::start(&dir, &opts);
    let client = http();
    let admin = envoy.admin.clone();
    let a_addr = format!("127.0.0.1:{inv_a}");
    let b_addr = format!("127.0.0.1:{inv_b}");
    let bill_addr = format!("127.0.0.1:{bill_a}");

    // 1. The first snapshot: one service, one instance, and its routes.
    wait_for("inventory's endpoint in /clusters", CONVERGE, || async {
        let text = get_text(&client, &format!("{admin}/clusters"))
            .await
            .unwrap_or_default();
        let h = hosts(&text, "mcp.inventory");
        if h.get(&a_addr).is_some_and(|f| f == "healthy") {
            Ok(())
        } else {
            Err(text)
        }
    })
    .await;
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
        ]
    );
    let listen = envoy.listen.clone();
    let body = wait_for("a request through the listener", CONVERGE, || async {
        let r = client
            .get(format!("{listen}/mcp/inventory/x?y=1"))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status();
        let text = r.text().await.map_err(|e| e.to_string())?;
        if status == 200 {
            Ok(text)
        } else {
            Err(format!("{status}: {text}"))
        }
    })
    .await;
    assert_eq!(body, "inv-a GET /rpc/x?y=1", "prefix rewritten to mcp_path");
    let post = client
        .post(format!("{listen}/mcp/inventory"))
        .body("{}")
        .send()
        .await
        .expect("POST through Envoy");
    assert_eq!(post.text().await.ok().as_deref(), Some("inv-a POST /rpc"));
    for unknown in ["/mcp/inventoryX", "/mcp/billing", "/elsewhere"] {
        let r = client
            .get(format!("{listen}{unknown}"))
            .send()
            .await
            .expect("request through Envoy");
        assert_eq!(r.status(), 404, "{unknown} matches no route");
    }

    // 2. One instance more, one service more (with a new cluster that must warm).
    publish.send_replace(snapshot(
        2,
        &[
            (
                "billing",
                "/mcp",
                vec![instance("bill-a", bill_a, EndpointHealth::Healthy)],
            ),
            (
                "inventory",
                "/rpc",
                vec![
                    instance("inv-a", inv_a, EndpointHealth::Healthy),
                    instance("inv-b", inv_b, EndpointHealth::Healthy),
                ],
            ),
        ],
    ));
    wait_for("both services converged in /clusters", CONVERGE, || async {
        let text = get_text(&client, &format!("{admin}/clusters"))
            .await
            .unwrap_or_default();
        let inv = hosts(&text, "mcp.inventory");
        let bill = hosts(&text, "mcp.billing");
        let healthy =
            |h: &BTreeMap<String, String>, a: &str| h.get(a).is_some_and(|f| f == "healthy");
        if healthy(&inv, &a_addr) && healthy(&inv, &b_addr) && healthy(&bill, &bill_addr) {
            Ok(())
        } else {
            Err(text)
        }
    })
    .await;
    let body = wait_for("billing routable", CONVERGE, || async {
        let r = client
            .post(format!("{listen}/mcp/billing"))
            .body("{}")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status();
        let text = r.text().await.map_err(|e| e.to_string())?;
        if status == 200 {
            Ok(text)
        } else {
            Err(format!("{status}: {text}"))
        }
    })
    .await;
    assert_eq!(body, "bill-a POST /mcp");

    // 3. Session affinity: the envelope pins a session to its instance, and when that
    // instance is gone another one answers 404 for the unknown session.
    let first = client
        .post(format!("{listen}/mcp/inventory"))
        .body("{}")
        .send()
        .await
        .expect("initialize through Envoy");
    let wrapped = first
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .expect("a session id in the response");
    let pinned = first.text().await.expect("body");
    assert!(
        wrapped.contains(";UV:"),
        "Envoy wraps the session id with the upstream address: {wrapped}"
    );
    let pinned_id = pinned.split(' ').next().unwrap_or_default().to_string();
    for _ in 0..6 {
        let r = client
            .post(format!("{listen}/mcp/inventory"))
            .header("Mcp-Session-Id", &wrapped)
            .body("{}")
            .send()
            .await
            .expect("request in the session");
        assert_eq!(r.status(), 200, "the pinned instance knows its session");
        let text = r.text().await.expect("body");
        assert!(
            text.starts_with(&pinned_id),
            "{text} is not from {pinned_id}"
        );
    }
    let (other_id, other_port) = if pinned_id == "inv-a" {
        ("inv-b", inv_b)
    } else {
        ("inv-a", inv_a)
    };
    publish.send_replace(snapshot(
        3,
        &[
            (
                "billing",
                "/mcp",
                vec![instance("bill-a", bill_a, EndpointHealth::Healthy)],
            ),
            (
                "inventory",
                "/rpc",
                vec![instance(other_id, other_port, EndpointHealth::Healthy)],
            ),
        ],
    ));
    let gone = wait_for("the session's instance gone → 404", CONVERGE, || async {
        let r = client
            .post(format!("{listen}/mcp/inventory"))
            .header("Mcp-Session-Id", &wrapped)
            .body("{}")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status();
        let text = r.text().await.map_err(|e| e.to_string())?;
        if status == 404 {
            Ok(text)
        } else {
            Err(format!("{status}: {text}"))
        }
    })
    .await;
    assert!(
        gone.starts_with(other_id),
        "404 from the other instance: {gone}"
    );

    // 4. Same content again (new generation): no xDS response at all.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<u64> = ["cds", "eds", "rds"]
        .iter()
        .map(|t| count(&metrics, "pushes", t))
        .collect();
    publish.send_replace(snapshot(
        4,
        &[
            (
                "billing",
                "/mcp",
                vec![instance("bill-a", bill_a, EndpointHealth::Healthy)],
            ),
            (
                "inventory",
                "/rpc",
                vec![instance(other_id, other_port, EndpointHealth::Healthy)],
            ),
        ],
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after: Vec<u64> = ["cds", "eds", "rds"]
        .iter()
        .map(|t| count(&metrics, "pushes", t))
        .collect();
    assert_eq!(before, after, "an unchanged snapshot sends nothing");
    assert!(
        before.iter().all(|n| *n > 0),
        "every type was pushed: {before:?}"
    );
    for t in ["cds", "eds", "rds"] {
        assert_eq!(count(&metrics, "nacks", t), 0, "Envoy rejected {t}");
    }
    assert_eq!(metrics.connected_envoys.get(), 1);

    // 5. Shutdown ends the ADS stream, so the server returns although Envoy stays connected.
    let _ = stop.send(());
    let served = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns after shutdown")
        .expect("serve task did not panic");
    served.expect("serve ended cleanly");
    assert_eq!(metrics.connected_envoys.get(), 0);
    drop(envoy);
}
