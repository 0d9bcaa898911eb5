//! stdio servers behind the gateway (`toolgate-register --stdio`), on real processes:
//! `tools/call read_graph` of `@modelcontextprotocol/server-memory` with the same number of
//! calls in flight, by the same client (this driver), in alternating runs:
//!
//! - the server over its own pipes: the driver writes the calls straight to its stdin (the
//!   ceiling of any bridge);
//! - through the gateway (Envoy with the toolgate filter) to the bridge with `--shared` (one
//!   server, every session on it);
//! - through the gateway to the bridge with a server per session;
//! - through the gateway as 2026-07-28 requests, to the bridge's pool;
//! - `mcp-proxy` (PyPI) `--stateless` bridging the same server, called directly (no gateway:
//!   the most favourable setting for it).
//!
//! Each gateway and session variant has one MCP session per connection, opened before the
//! timed window. Then the session start with a server spawned per session: `initialize` sent
//! to its answer, through the gateway, with a spare started ahead (the default) and without.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use toolgate_tests::paths::workspace_root;
use toolgate_tests::{
    children_of, cpu_ticks, free_port, memory_server, Proc, Registrant, Stack, TestEnv,
};

use crate::stats::{spread, summarize, Spread, Summary};

#[derive(Debug, Clone)]
pub struct Options {
    pub reps: usize,
    pub secs: u64,
    pub warmup_secs: u64,
    /// Calls in flight (connections, sessions).
    pub in_flight: usize,
    /// Session starts measured per setting.
    pub session_starts: usize,
}

/// The goals for shared mode through the gateway.
pub const GOAL_OVER_MCP_PROXY: f64 = 10.0;
pub const GOAL_OF_PIPE_RATE: f64 = 0.60;
pub const GOAL_P99_MS: f64 = 10.0;

#[derive(Debug, Serialize)]
pub struct Variant {
    pub name: String,
    /// Calls per second, per run.
    pub rps: Vec<f64>,
    /// Latency percentiles per run, ms.
    pub p50_ms: Vec<f64>,
    pub p99_ms: Vec<f64>,
    pub errors: u64,
    pub rps_median: Spread,
    pub p50_median: f64,
    pub p99_median: f64,
    /// CPU time per call of each process on the path, µs (all runs together).
    pub cpu_us_per_call: Vec<(String, f64)>,
}

#[derive(Debug, Serialize)]
pub struct StdioBench {
    pub in_flight: usize,
    pub secs: u64,
    pub reps: usize,
    pub variants: Vec<Variant>,
    /// Shared mode through the gateway over mcp-proxy, median calls/s.
    pub over_mcp_proxy: f64,
    /// Shared mode through the gateway over the pipes, median calls/s.
    pub of_pipe_rate: f64,
    pub shared_p99_ms: f64,
    /// `initialize` -> its answer through the gateway, a server spawned per session: with a
    /// spare started ahead, and without.
    pub session_start_spare: Summary,
    pub session_start_cold: Summary,
    pub goals_met: bool,
}

/// One run's figures.
struct Load {
    calls: u64,
    errors: u64,
    window: Duration,
    latencies: Vec<Duration>,
    /// CPU time of each process watched, over the run.
    cpu: Vec<(String, Duration)>,
}

/// A process whose CPU time a run counts (with its children: a registrar's servers).
#[derive(Clone)]
struct Watched {
    role: &'static str,
    pid: i32,
    children: bool,
}

/// Clock ticks per second of /proc's CPU figures.
const TICKS: f64 = 100.0;

fn ticks(w: &Watched) -> u64 {
    let mut pids = vec![w.pid];
    if w.children {
        pids.extend(children_of(w.pid));
    }
    pids.iter().map(|p| cpu_ticks(*p)).sum()
}

/// CPU counters of `watched` at the start of a window; `finish` gives the time each used.
struct CpuWindow(Vec<(Watched, u64)>);

impl CpuWindow {
    fn start(watched: &[Watched]) -> CpuWindow {
        CpuWindow(watched.iter().map(|w| (w.clone(), ticks(w))).collect())
    }

    fn finish(self) -> Vec<(String, Duration)> {
        self.0
            .into_iter()
            .map(|(w, at)| {
                let used = ticks(&w).saturating_sub(at);
                (
                    w.role.to_string(),
                    Duration::from_secs_f64(used as f64 / TICKS),
                )
            })
            .collect()
    }
}

fn read_graph_call(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "read_graph", "arguments": {}}})
}

/// How a variant's client speaks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Speech {
    /// A 2025-11-25 session per connection.
    Session,
    /// No session (mcp-proxy's stateless mode), 2025-06-18 requests.
    Stateless,
    /// 2026-07-28 requests.
    Modern,
}

async fn post(
    http: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> anyhow::Result<(reqwest::StatusCode, reqwest::header::HeaderMap, String)> {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status();
    let h = resp.headers().clone();
    let text = resp.text().await?;
    Ok((status, h, text))
}

/// Opens a 2025-11-25 session; its id.
async fn open_session(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "toolgate-bench", "version": "0"}}});
    let (status, headers, body) = post(http, url, &[], &init).await?;
    if !status.is_success() {
        bail!("initialize at {url}: HTTP {status}: {body}");
    }
    let id = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .context("initialize answered without a session id")?
        .to_string();
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    post(
        http,
        url,
        &[
            ("mcp-session-id", &id),
            ("mcp-protocol-version", "2025-11-25"),
        ],
        &note,
    )
    .await?;
    Ok(id)
}

async fn close_session(http: &reqwest::Client, url: &str, id: &str) {
    let _ = http
        .delete(url)
        .header("mcp-session-id", id)
        .header("mcp-protocol-version", "2025-11-25")
        .send()
        .await;
}

/// A good answer to a call: HTTP 200 carrying its result (JSON, or SSE ending with it).
fn answered(status: reqwest::StatusCode, body: &str) -> bool {
    status.is_success() && body.contains("\"result\"") && !body.contains("\"isError\":true")
}

/// `in_flight` connections calling for `secs` after each opened what it needs.
async fn http_load(
    url: &str,
    speech: Speech,
    in_flight: usize,
    secs: u64,
    watched: &[Watched],
) -> anyhow::Result<Load> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(in_flight)
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut sessions = Vec::new();
    for _ in 0..in_flight {
        sessions.push(match speech {
            Speech::Session => Some(open_session(&http, url).await?),
            _ => None,
        });
    }
    let start = Arc::new(tokio::sync::Barrier::new(in_flight));
    let mut tasks = Vec::new();
    for session in sessions.clone() {
        let http = http.clone();
        let url = url.to_string();
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let until = Instant::now() + Duration::from_secs(secs);
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut id = 1u64;
            while Instant::now() < until {
                id += 1;
                let mut body = read_graph_call(id);
                let mut headers: Vec<(&str, String)> = Vec::new();
                match (&session, speech) {
                    (Some(s), _) => {
                        headers.push(("mcp-session-id", s.clone()));
                        headers.push(("mcp-protocol-version", "2025-11-25".into()));
                    }
                    (None, Speech::Modern) => {
                        body["params"]["_meta"] = json!({
                            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                            "io.modelcontextprotocol/clientInfo": {"name": "toolgate-bench", "version": "0"},
                            "io.modelcontextprotocol/clientCapabilities": {},
                        });
                        headers.push(("mcp-protocol-version", "2026-07-28".into()));
                        headers.push(("mcp-method", "tools/call".into()));
                        headers.push(("mcp-name", "read_graph".into()));
                    }
                    (None, _) => headers.push(("mcp-protocol-version", "2025-06-18".into())),
                }
                let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let t0 = Instant::now();
                match post(&http, &url, &h, &body).await {
                    Ok((status, _, text)) if answered(status, &text) => latencies.push(t0.elapsed()),
                    _ => errors += 1,
                }
            }
            (latencies, errors)
        }));
    }
    let cpu = CpuWindow::start(watched);
    let began = Instant::now();
    let mut load = Load {
        calls: 0,
        errors: 0,
        window: Duration::ZERO,
        latencies: Vec::new(),
        cpu: Vec::new(),
    };
    for t in tasks {
        let (lat, errors) = t.await?;
        load.calls += lat.len() as u64;
        load.errors += errors;
        load.latencies.extend(lat);
    }
    load.window = began.elapsed();
    load.cpu = cpu.finish();
    for s in sessions.into_iter().flatten() {
        close_session(&http, url, &s).await;
    }
    Ok(load)
}

/// The server over its own pipes: `in_flight` calls outstanding, each answer followed by the
/// next call.
async fn pipe_load(graph: &str, in_flight: usize, secs: u64) -> anyhow::Result<Load> {
    let mut child = tokio::process::Command::new("node")
        .arg(memory_server())
        .env("MEMORY_FILE_PATH", graph)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("running server-memory")?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "toolgate-bench", "version": "0"}}});
    stdin.write_all(format!("{init}\n").as_bytes()).await?;
    lines
        .next_line()
        .await?
        .context("no answer to initialize")?;
    stdin
        .write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n")
        .await?;
    let mut sent: HashMap<u64, Instant> = HashMap::new();
    let mut next = 1u64;
    let mut send = |stdin_buf: &mut Vec<u8>, sent: &mut HashMap<u64, Instant>| {
        stdin_buf.extend_from_slice(read_graph_call(next).to_string().as_bytes());
        stdin_buf.push(b'\n');
        sent.insert(next, Instant::now());
        next += 1;
    };
    let mut buf = Vec::new();
    for _ in 0..in_flight {
        send(&mut buf, &mut sent);
    }
    let server = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let cpu = CpuWindow::start(&[
        Watched {
            role: "client",
            pid: std::process::id() as i32,
            children: false,
        },
        Watched {
            role: "server",
            pid: server,
            children: false,
        },
    ]);
    let began = Instant::now();
    stdin.write_all(&buf).await?;
    let until = began + Duration::from_secs(secs);
    let mut load = Load {
        calls: 0,
        errors: 0,
        window: Duration::ZERO,
        latencies: Vec::new(),
        cpu: Vec::new(),
    };
    while !sent.is_empty() {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("server-memory stopped answering")??
            .context("server-memory closed its output")?;
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        let Some(t0) = v["id"].as_u64().and_then(|id| sent.remove(&id)) else {
            continue;
        };
        if v.get("result").is_some() {
            load.calls += 1;
            load.latencies.push(t0.elapsed());
        } else {
            load.errors += 1;
        }
        if Instant::now() < until {
            buf.clear();
            send(&mut buf, &mut sent);
            stdin.write_all(&buf).await?;
        }
    }
    load.window = began.elapsed();
    load.cpu = cpu.finish();
    let _ = child.kill().await;
    Ok(load)
}

/// `initialize` to its answer, `n` sessions one after another (each deleted before the next,
/// `pause` apart so a spare can be started again).
async fn session_starts(url: &str, n: usize, pause: Duration) -> anyhow::Result<Summary> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut samples = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let id = open_session(&http, url).await?;
        samples.push(t0.elapsed());
        close_session(&http, url, &id).await;
        tokio::time::sleep(pause).await;
    }
    Ok(summarize(&samples))
}

fn mcp_proxy_bin() -> anyhow::Result<PathBuf> {
    let path = workspace_root().join(".venv/mcp-proxy/bin/mcp-proxy");
    if !path.exists() {
        bail!("{} is missing: run `make setup`", path.display());
    }
    Ok(path)
}

/// Waits until `url` answers a call (stateless, as mcp-proxy's mode takes it).
async fn wait_answers(url: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    let t0 = Instant::now();
    loop {
        let answer = post(
            &http,
            url,
            &[("mcp-protocol-version", "2025-06-18")],
            &read_graph_call(1),
        )
        .await;
        match answer {
            Ok((s, _, b)) if answered(s, &b) => return Ok(()),
            other if t0.elapsed() > Duration::from_secs(30) => {
                bail!("{url} does not answer a call: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A bridged server-memory, registered and routed.
async fn bridged(
    env: &TestEnv,
    stack: &Stack,
    service: &str,
    graph: &str,
    extra: &[&str],
) -> anyhow::Result<Proc> {
    let mut r = Registrant::stdio(&stack.etcd.endpoint(), service).env("MEMORY_FILE_PATH", graph);
    for pair in extra.chunks(2) {
        r = match pair {
            [flag, value] => r.arg(flag, value),
            [flag] => r.flag(flag),
            _ => r,
        };
    }
    let r = r.child(
        std::path::Path::new("node"),
        &[memory_server().display().to_string()],
    );
    let proc = r.spawn(env, &format!("{service}.registrar"));
    let t0 = Instant::now();
    loop {
        let healthy = stack.healthy(service).await;
        if !healthy.is_empty() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{service} was not routed within 60 s: {}", proc.log());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stack
        .wait_filter_config(&format!("the catalog has {service}"), |c| {
            c["catalog"].get(service).is_some()
        })
        .await;
    Ok(proc)
}

fn variant(name: &str, runs: &[Load]) -> Variant {
    let rps: Vec<f64> = runs
        .iter()
        .map(|l| l.calls as f64 / l.window.as_secs_f64().max(1e-9))
        .collect();
    let sums: Vec<Summary> = runs.iter().map(|l| summarize(&l.latencies)).collect();
    let p50: Vec<f64> = sums.iter().map(|s| s.p50_ms).collect();
    let p99: Vec<f64> = sums.iter().map(|s| s.p99_ms).collect();
    let calls: u64 = runs.iter().map(|l| l.calls).sum();
    let mut cpu: Vec<(String, f64)> = Vec::new();
    for l in runs {
        for (role, used) in &l.cpu {
            match cpu.iter_mut().find(|(r, _)| r == role) {
                Some((_, total)) => *total += used.as_secs_f64(),
                None => cpu.push((role.clone(), used.as_secs_f64())),
            }
        }
    }
    for (_, total) in &mut cpu {
        *total = *total * 1e6 / (calls.max(1) as f64);
    }
    Variant {
        cpu_us_per_call: cpu,
        name: name.to_string(),
        rps_median: spread(&rps),
        p50_median: spread(&p50).median,
        p99_median: spread(&p99).median,
        rps,
        p50_ms: p50,
        p99_ms: p99,
        errors: runs.iter().map(|l| l.errors).sum(),
    }
}

pub async fn run(env: &TestEnv, opts: &Options) -> anyhow::Result<StdioBench> {
    let stack = Stack::start(env).await;
    // A small graph, the same in every variant (read each call by the server).
    let graph = env.path("graph.jsonl").display().to_string();
    let mut seed = String::new();
    for (name, kind) in [
        ("alice", "person"),
        ("bob", "person"),
        ("toolgate", "project"),
    ] {
        seed.push_str(
            &json!({"type": "entity", "name": name, "entityType": kind,
                "observations": [format!("{name} is in the bench graph")]})
            .to_string(),
        );
        seed.push('\n');
    }
    std::fs::write(&graph, seed)?;

    let shared = bridged(env, &stack, "memshared", &graph, &["--shared"]).await?;
    let per_session = bridged(
        env,
        &stack,
        "memsession",
        &graph,
        &["--max-sessions", &(opts.in_flight * 2).to_string()],
    )
    .await?;
    let proxy_port = free_port();
    let proxy = env.spawn_with_env(
        "mcp-proxy",
        &mcp_proxy_bin()?,
        &[
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            proxy_port.to_string(),
            "--stateless".into(),
            "--pass-environment".into(),
            "node".into(),
            memory_server().display().to_string(),
        ],
        &[("MEMORY_FILE_PATH".into(), graph.clone())],
    );
    let proxy_url = format!("http://127.0.0.1:{proxy_port}/mcp");
    wait_answers(&proxy_url)
        .await
        .with_context(|| format!("mcp-proxy: {}", proxy.log()))?;

    let shared_url = stack.url("memshared");
    let session_url = stack.url("memsession");
    let envoy = stack.envoy.proc.as_ref().map_or(0, Proc::pid);
    let client = Watched {
        role: "client",
        pid: std::process::id() as i32,
        children: false,
    };
    let gateway = |bridge: &Proc| {
        vec![
            client.clone(),
            Watched {
                role: "envoy",
                pid: envoy,
                children: false,
            },
            Watched {
                role: "bridge",
                pid: bridge.pid(),
                children: false,
            },
            // The registrar's children: the server processes.
            Watched {
                role: "server",
                pid: bridge.pid(),
                children: true,
            },
        ]
    };
    let proxy_cpu = vec![
        client.clone(),
        Watched {
            role: "mcp-proxy and server",
            pid: proxy.pid(),
            children: true,
        },
    ];
    type Target = (&'static str, Option<(String, Speech, Vec<Watched>)>);
    let targets: Vec<Target> = vec![
        ("server-memory over its own pipes", None),
        (
            "gateway -> bridge --shared",
            Some((shared_url.clone(), Speech::Session, gateway(&shared))),
        ),
        (
            "gateway -> bridge, a server per session",
            Some((session_url.clone(), Speech::Session, gateway(&per_session))),
        ),
        (
            "gateway -> bridge pool, 2026-07-28 requests",
            Some((shared_url.clone(), Speech::Modern, gateway(&shared))),
        ),
        (
            "mcp-proxy 0.13.0 --stateless, direct",
            Some((proxy_url.clone(), Speech::Stateless, proxy_cpu)),
        ),
    ];
    // Warm every path (Node's JIT, Envoy's connections, the sessions' servers).
    for (_, t) in &targets {
        match t {
            None => {
                pipe_load(&graph, opts.in_flight, opts.warmup_secs).await?;
            }
            Some((url, speech, _)) => {
                http_load(url, *speech, opts.in_flight, opts.warmup_secs, &[]).await?;
            }
        }
    }
    let mut runs: Vec<Vec<Load>> = targets.iter().map(|_| Vec::new()).collect();
    for rep in 0..opts.reps {
        for (i, (name, t)) in targets.iter().enumerate() {
            eprintln!("  stdio: {name}, run {} of {}", rep + 1, opts.reps);
            let load = match t {
                None => pipe_load(&graph, opts.in_flight, opts.secs).await?,
                Some((url, speech, watched)) => {
                    http_load(url, *speech, opts.in_flight, opts.secs, watched).await?
                }
            };
            runs[i].push(load);
        }
    }
    let variants: Vec<Variant> = targets
        .iter()
        .zip(&runs)
        .map(|((name, _), r)| variant(name, r))
        .collect();

    eprintln!("  stdio: session starts ...");
    let spare = session_starts(
        &session_url,
        opts.session_starts,
        Duration::from_millis(500),
    )
    .await?;
    let _cold = bridged(env, &stack, "memcold", &graph, &["--spares", "0"]).await?;
    let cold = session_starts(
        &stack.url("memcold"),
        opts.session_starts,
        Duration::from_millis(100),
    )
    .await?;

    let rate = |i: usize| variants[i].rps_median.median;
    let over_mcp_proxy = rate(1) / rate(4).max(1e-9);
    let of_pipe_rate = rate(1) / rate(0).max(1e-9);
    let shared_p99_ms = variants[1].p99_median;
    let goals_met = over_mcp_proxy >= GOAL_OVER_MCP_PROXY
        && of_pipe_rate >= GOAL_OF_PIPE_RATE
        && shared_p99_ms < GOAL_P99_MS;
    Ok(StdioBench {
        in_flight: opts.in_flight,
        secs: opts.secs,
        reps: opts.reps,
        variants,
        over_mcp_proxy,
        of_pipe_rate,
        shared_p99_ms,
        session_start_spare: spare,
        session_start_cold: cold,
        goals_met,
    })
}

impl StdioBench {
    pub fn markdown(&self) -> String {
        let verdict = |met: bool| if met { "met" } else { "MISSED" };
        let mut out = format!(
            "stdio servers behind the gateway: `tools/call read_graph` of server-memory, {} in \
             flight, {} × {} s per variant, alternating; median (min–max) of the runs.\n\n\
             | variant | calls/s | p50 / p99 ms | errors | CPU per call, µs |\n| --- | ---: | ---: | ---: | --- |\n",
            self.in_flight, self.reps, self.secs
        );
        for v in &self.variants {
            let cpu: Vec<String> = v
                .cpu_us_per_call
                .iter()
                .map(|(role, us)| format!("{role} {us:.0}"))
                .collect();
            out.push_str(&format!(
                "| {} | {:.0} ({:.0}–{:.0}) | {:.2} / {:.2} | {} | {} |\n",
                v.name,
                v.rps_median.median,
                v.rps_median.min,
                v.rps_median.max,
                v.p50_median,
                v.p99_median,
                v.errors,
                cpu.join(", ")
            ));
        }
        out.push_str(&format!(
            "\n| goal, --shared through the gateway | measured | goal | |\n| --- | ---: | ---: | --- |\n\
             | calls/s over mcp-proxy's | {:.1}× | >= {GOAL_OVER_MCP_PROXY:.0}× | {} |\n\
             | calls/s of the server's own pipe rate | {:.0}% | >= {:.0}% | {} |\n\
             | p99 | {:.2} ms | < {GOAL_P99_MS:.0} ms | {} |\n",
            self.over_mcp_proxy,
            verdict(self.over_mcp_proxy >= GOAL_OVER_MCP_PROXY),
            self.of_pipe_rate * 100.0,
            GOAL_OF_PIPE_RATE * 100.0,
            verdict(self.of_pipe_rate >= GOAL_OF_PIPE_RATE),
            self.shared_p99_ms,
            verdict(self.shared_p99_ms < GOAL_P99_MS),
        ));
        out.push_str(&format!(
            "\n| session start (initialize -> answer, a server per session, through the gateway) | p50 / p99 / max (n) |\n| --- | ---: |\n\
             | a spare server started ahead (--spares 1, the default) | {:.1} / {:.1} / {:.1} ms ({}) |\n\
             | spawned on initialize (--spares 0) | {:.1} / {:.1} / {:.1} ms ({}) |\n",
            self.session_start_spare.p50_ms,
            self.session_start_spare.p99_ms,
            self.session_start_spare.max_ms,
            self.session_start_spare.n,
            self.session_start_cold.p50_ms,
            self.session_start_cold.p99_ms,
            self.session_start_cold.max_ms,
            self.session_start_cold.n,
        ));
        out
    }
}
