//! The aggregate endpoint, on real processes: `tools/list`, `resources/list` and
//! `prompts/list` on `/mcp` over many services (latency per page, and no request reaching a
//! server), `tools/call` and `resources/read` through `/mcp` against the same request on its
//! per-service route (alternating wrk runs, same Envoy), and how fast the listing follows the
//! fleet: a new service's tools listed with their definitions, a breaker opening annotated.
//!
//! Every service is an etcd registration of one lab server (stateless, JSON answers) with the
//! same tools, documents and prompt, so 100 services cost one process; toolgate-xds probes and
//! reads each one's definitions as it would distinct servers (the same URIs from every service:
//! all but the oldest service's are listed rewritten, `toolgate+<service>:lab://doc/<i>`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::{json, Value};
use toolgate_tests::{filter_wasm, Envoy, Etcd, McpServer, TestEnv, Xds};

use crate::dataplane::{lua_script, wrk};
use crate::stats::{summarize, Summary};

#[derive(Debug, Clone)]
pub struct Options {
    pub services: usize,
    pub tools_per_service: usize,
    pub list_requests: usize,
    pub reps: usize,
    pub secs: u64,
    pub trials: usize,
}

#[derive(Debug, Serialize)]
pub struct AggregateBench {
    pub services: usize,
    pub tools: usize,
    /// One `tools/list` page (100 tools) on `/mcp`, client to client.
    pub list_page: Summary,
    /// Requests Envoy sent to any service's cluster while the lists ran (goal: none).
    pub upstream_requests_during_lists: u64,
    /// `tools/call` requests per second, per alternating run.
    pub call_rps_route: Vec<f64>,
    pub call_rps_mcp: Vec<f64>,
    pub call_median_route: f64,
    pub call_median_mcp: f64,
    /// Median of the pairs' ratios (through `/mcp` over on the service's route, run back to
    /// back).
    pub call_ratio: f64,
    /// Envoy's CPU time per call (all its threads), median of the runs: what the aggregate
    /// path costs, unlike throughput hardly moved by other load on the machine.
    pub envoy_cpu_us_route: f64,
    pub envoy_cpu_us_mcp: f64,
    /// Resources (`documents` per service) and prompts (one per service) listed on `/mcp`.
    pub resources: usize,
    pub prompts: usize,
    /// One `resources/list` and one `prompts/list` page on `/mcp`, client to client.
    pub resources_page: Summary,
    pub prompts_page: Summary,
    /// Requests Envoy sent to any service's cluster while those lists ran (goal: none).
    pub upstream_requests_during_surface_lists: u64,
    /// `resources/read` requests per second, through `/mcp` and on the service's route.
    pub read_rps_route: Vec<f64>,
    pub read_rps_mcp: Vec<f64>,
    pub read_median_route: f64,
    pub read_median_mcp: f64,
    /// Median of the pairs' ratios, as for `tools/call`.
    pub read_ratio: f64,
    /// etcd put of a new service -> its tools listed with their read definitions.
    pub new_service_listed: Summary,
    /// A fleet breaker opening in etcd -> the tool annotated `open` in the listing.
    pub breaker_annotated: Summary,
}

/// A stateless lab with `tools` registered as `services` services through etcd, one lease.
struct Fleet {
    etcd: Etcd,
    xds: Xds,
    envoy: Envoy,
    lab: McpServer,
    tools: Vec<String>,
    lease: i64,
    http: reqwest::Client,
}

impl Fleet {
    fn mcp_url(&self, path: &str) -> String {
        let service_url = self.envoy.url("x");
        format!("{}{path}", service_url.trim_end_matches("/mcp/x"))
    }

    async fn register(&self, service: &str) -> anyhow::Result<()> {
        let value = json!({
            "instance_id": "i-1",
            "endpoint": self.lab.endpoint(),
            "tools": self.tools,
        });
        let mut c = self.etcd.client().await;
        c.put(
            format!("/mcp/services/{service}/i-1"),
            value.to_string(),
            Some(etcd_client::PutOptions::new().with_lease(self.lease)),
        )
        .await?;
        Ok(())
    }

    /// A stateless-style request (no session): `tools/list` in 2026-07-28 terms.
    async fn list_page(&self, path: &str, cursor: Option<&str>) -> anyhow::Result<Value> {
        self.page_of("tools/list", path, cursor).await
    }

    /// One page of a listing method (`tools/list`, `resources/list`, `prompts/list`), as a
    /// 2026-07-28 client without a session asks for it.
    async fn page_of(
        &self,
        method: &str,
        path: &str,
        cursor: Option<&str>,
    ) -> anyhow::Result<Value> {
        let mut params = json!({"_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {},
        }});
        if let Some(c) = cursor {
            params["cursor"] = json!(c);
        }
        let resp = self
            .http
            .post(self.mcp_url(path))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2026-07-28")
            .header("mcp-method", method)
            .body(
                json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string(),
            )
            .send()
            .await?;
        let status = resp.status();
        let body: Value = resp.json().await.context("listing answer")?;
        if !status.is_success() || body.get("result").is_none() {
            bail!("{method} on {path}: HTTP {status}: {body}");
        }
        Ok(body["result"].clone())
    }

    /// Every item `method` lists on `path` (in the result's `field`), following the cursors.
    async fn all_of(&self, method: &str, field: &str, path: &str) -> anyhow::Result<Vec<Value>> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..1000 {
            let page = self.page_of(method, path, cursor.as_deref()).await?;
            items.extend(page[field].as_array().cloned().unwrap_or_default());
            match page["nextCursor"].as_str() {
                Some(c) => cursor = Some(c.to_string()),
                None => return Ok(items),
            }
        }
        bail!("{method} on {path}: more than 1000 pages")
    }

    /// `n` pages of `method` on `/mcp`, each page in turn: their latencies.
    async fn page_latency(&self, method: &str, n: usize) -> anyhow::Result<Summary> {
        let mut cursors: Vec<Option<String>> = vec![None];
        loop {
            let page = self
                .page_of(method, "/mcp", cursors.last().cloned().flatten().as_deref())
                .await?;
            match page["nextCursor"].as_str() {
                Some(c) => cursors.push(Some(c.to_string())),
                None => break,
            }
        }
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let cursor = cursors[i % cursors.len()].clone();
            let t0 = Instant::now();
            self.page_of(method, "/mcp", cursor.as_deref()).await?;
            samples.push(t0.elapsed());
        }
        Ok(summarize(&samples))
    }

    /// Every tool `path` lists, following the cursors.
    async fn list_all(&self, path: &str) -> anyhow::Result<Vec<Value>> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..1000 {
            let page = self.list_page(path, cursor.as_deref()).await?;
            tools.extend(page["tools"].as_array().cloned().unwrap_or_default());
            match page["nextCursor"].as_str() {
                Some(c) => cursor = Some(c.to_string()),
                None => return Ok(tools),
            }
        }
        bail!("{path}: more than 1000 pages")
    }

    async fn upstream_requests(&self) -> u64 {
        let text = self
            .http
            .get(format!(
                "{}/stats?filter=^cluster\\.mcp\\..*\\.upstream_rq_total$",
                self.envoy.admin_url()
            ))
            .send()
            .await
            .ok();
        let Some(resp) = text else { return 0 };
        let text = resp.text().await.unwrap_or_default();
        text.lines()
            .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
            .sum()
    }
}

fn read(tool: &Value) -> bool {
    !tool["description"]
        .as_str()
        .unwrap_or_default()
        .contains("not available yet")
}

/// Resources each service offers (the lab's `--documents`); one prompt each besides.
const DOCUMENTS: usize = 10;

/// Requests per second on `route_url` and on `mcp_url` (the same request through `/mcp`), in
/// back-to-back pairs, every other pair the other way round (ABBA): a machine that slows down
/// or speeds up during the run weighs on both sides alike. With Envoy's CPU time per request.
struct Paired {
    route_rps: Vec<f64>,
    mcp_rps: Vec<f64>,
    route_cpu_us: Vec<f64>,
    mcp_cpu_us: Vec<f64>,
}

async fn paired_runs(
    envoy_pid: i32,
    (route_script, route_url): (&std::path::Path, &str),
    (mcp_script, mcp_url): (&std::path::Path, &str),
    opts: &Options,
) -> anyhow::Result<Paired> {
    let (mut route_rps, mut mcp_rps) = (Vec::new(), Vec::new());
    let (mut route_cpu, mut mcp_cpu) = (Vec::new(), Vec::new());
    for rep in 0..opts.reps {
        let mut runs = [
            (route_script, route_url, &mut route_rps, &mut route_cpu),
            (mcp_script, mcp_url, &mut mcp_rps, &mut mcp_cpu),
        ];
        if rep % 2 == 1 {
            runs.reverse();
        }
        for (script, url, out, cpu) in runs {
            let cpu0 = crate::machine::cpu_ns(envoy_pid);
            let r = wrk(script, url, opts.secs, 16).await?;
            let used_ns = crate::machine::cpu_ns(envoy_pid).saturating_sub(cpu0);
            if r.status + r.connect + r.read + r.write + r.timeout > 0.0 {
                bail!(
                    "wrk on {url}: errors (status {}, timeout {})",
                    r.status,
                    r.timeout
                );
            }
            cpu.push(used_ns as f64 / 1e3 / r.requests.max(1.0));
            out.push(r.requests / (r.duration_us / 1e6));
        }
    }
    Ok(Paired {
        route_rps,
        mcp_rps,
        route_cpu_us: route_cpu,
        mcp_cpu_us: mcp_cpu,
    })
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median of the pairs' ratios (`/mcp` over the route): a pair shares the machine's
/// state of the moment (this 2-core VM's steal time moves throughput by tens of percent
/// between runs).
fn pair_ratio(p: &Paired) -> f64 {
    let ratios: Vec<f64> = p
        .mcp_rps
        .iter()
        .zip(&p.route_rps)
        .map(|(m, r)| m / r.max(1.0))
        .collect();
    median(&ratios)
}

pub async fn run(env: &TestEnv, opts: &Options) -> anyhow::Result<AggregateBench> {
    let etcd = Etcd::start(env).await;
    let xds = Xds::start(env, "xds", &etcd.endpoint(), &[]).await;
    let wasm = filter_wasm();
    let envoy = Envoy::start_with(
        env,
        "envoy",
        &xds,
        1,
        &["--filter", &wasm.to_string_lossy()],
    )
    .await;
    let tools: Vec<String> = (0..opts.tools_per_service)
        .map(|i| format!("t{i}"))
        .collect();
    let lab = McpServer::lab(
        env,
        "lab",
        &[
            "--stateless",
            "--json-response",
            "--tools",
            &tools.join(","),
            "--documents",
            &DOCUMENTS.to_string(),
        ],
    )
    .await;
    let lease = etcd.client().await.lease_grant(600, None).await?.id();
    let fleet = Fleet {
        etcd,
        xds,
        envoy,
        lab,
        tools,
        lease,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?,
    };
    // The services the convergence trials add, and a view of only them and of the tools whose
    // breakers open, so each poll reads a page or two.
    let fresh: Vec<String> = (0..opts.trials).map(|i| format!("n{i}")).collect();
    let mut c = fleet.etcd.client().await;
    c.put(
        "/mcp/virtual/fresh",
        json!({"services": fresh}).to_string(),
        None,
    )
    .await?;
    c.put(
        "/mcp/virtual/brk",
        json!({"services": ["s0", "s1", "s2"]}).to_string(),
        None,
    )
    .await?;
    for i in 0..opts.services {
        fleet.register(&format!("s{i}")).await?;
    }
    let want = opts.services * opts.tools_per_service;
    let started = Instant::now();
    loop {
        let listed = fleet.list_all("/mcp").await.unwrap_or_default();
        if listed.len() >= want && listed.iter().all(read) {
            break;
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!(
                "/mcp listed {} of {want} tools ({} read) after 120 s",
                listed.len(),
                listed.iter().filter(|t| read(t)).count()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "aggregate: {want} tools of {} services listed in {:.1} s",
        opts.services,
        started.elapsed().as_secs_f64()
    );

    // tools/list pages: every page in turn.
    let mut cursors: Vec<Option<String>> = vec![None];
    loop {
        let page = fleet
            .list_page("/mcp", cursors.last().cloned().flatten().as_deref())
            .await?;
        match page["nextCursor"].as_str() {
            Some(c) => cursors.push(Some(c.to_string())),
            None => break,
        }
    }
    let before = fleet.upstream_requests().await;
    let mut samples = Vec::with_capacity(opts.list_requests);
    for i in 0..opts.list_requests {
        let cursor = cursors[i % cursors.len()].clone();
        let t0 = Instant::now();
        fleet.list_page("/mcp", cursor.as_deref()).await?;
        samples.push(t0.elapsed());
    }
    let upstream = fleet.upstream_requests().await.saturating_sub(before);
    let list_page = summarize(&samples);

    // tools/call: the same call on the service's route and through /mcp, alternating.
    let dir = env.dir().to_path_buf();
    let call = |name: &str| {
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": name, "arguments": {"pad": "x".repeat(900)}}})
        .to_string()
    };
    let route_script = dir.join("route.lua");
    std::fs::write(&route_script, lua_script(&call("t0"), &[]))?;
    let mcp_script = dir.join("mcp.lua");
    std::fs::write(&mcp_script, lua_script(&call("s0__t0"), &[]))?;
    let route_url = fleet.envoy.url("s0");
    let mcp_url = fleet.mcp_url("/mcp");
    let envoy_pid = fleet
        .envoy
        .proc
        .as_ref()
        .map(|p| p.pid())
        .context("Envoy is not running")?;
    let calls = paired_runs(
        envoy_pid,
        (&route_script, &route_url),
        (&mcp_script, &mcp_url),
        opts,
    )
    .await?;
    let call_ratio = pair_ratio(&calls);

    // Resources and prompts on /mcp: served from the listing, no server asked.
    let want_resources = opts.services * DOCUMENTS;
    let started = Instant::now();
    let (resources, prompts) = loop {
        let resources = fleet.all_of("resources/list", "resources", "/mcp").await?;
        let prompts = fleet.all_of("prompts/list", "prompts", "/mcp").await?;
        if resources.len() >= want_resources && prompts.len() >= opts.services {
            break (resources.len(), prompts.len());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "/mcp listed {} of {want_resources} resources and {} of {} prompts after 60 s",
                resources.len(),
                prompts.len(),
                opts.services
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let before = fleet.upstream_requests().await;
    let resources_page = fleet
        .page_latency("resources/list", opts.list_requests)
        .await?;
    let prompts_page = fleet
        .page_latency("prompts/list", opts.list_requests)
        .await?;
    let surface_upstream = fleet.upstream_requests().await.saturating_sub(before);

    // resources/read: the same read on the service's route and through /mcp. `s0` registered
    // first, so it keeps the URI as its server wrote it.
    let read_body = json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read",
        "params": {"uri": "lab://doc/0"}})
    .to_string();
    let read_script = dir.join("read.lua");
    std::fs::write(&read_script, lua_script(&read_body, &[]))?;
    let reads = paired_runs(
        envoy_pid,
        (&read_script, &route_url),
        (&read_script, &mcp_url),
        opts,
    )
    .await?;
    let read_ratio = pair_ratio(&reads);

    // A new service: etcd put -> its tools listed, definitions read.
    let mut listed = Vec::new();
    for name in &fresh {
        let t0 = Instant::now();
        fleet.register(name).await?;
        let want = format!("{name}__t0");
        loop {
            let tools = fleet.list_all("/virtual/fresh").await?;
            let found = tools.iter().any(|t| t["name"] == want.as_str() && read(t));
            if found {
                listed.push(t0.elapsed());
                break;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("{want} not listed with its definition after 10 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    // A fleet breaker opening -> annotated.
    let mut annotated = Vec::new();
    for k in 0..opts.trials.min(3 * opts.tools_per_service) {
        let (service, tool) = (
            format!("s{}", k / opts.tools_per_service),
            format!("t{}", k % opts.tools_per_service),
        );
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as u64;
        let t0 = Instant::now();
        c.put(
            format!("/mcp/breakers/{service}/{tool}"),
            json!({"until_ms": now_ms + 120_000, "opened_by": "bench", "opened_at_ms": now_ms})
                .to_string(),
            None,
        )
        .await?;
        let want = format!("{service}__{tool}");
        loop {
            let tools = fleet.list_all("/virtual/brk").await?;
            let open = tools.iter().any(|t| {
                t["name"] == want.as_str()
                    && t["_meta"]["io.toolgate/availability"]["state"] == "open"
            });
            if open {
                annotated.push(t0.elapsed());
                break;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("{want} not annotated open after 10 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let _ = &fleet.xds;

    Ok(AggregateBench {
        services: opts.services,
        tools: want,
        list_page,
        upstream_requests_during_lists: upstream,
        call_median_route: median(&calls.route_rps),
        call_median_mcp: median(&calls.mcp_rps),
        call_ratio,
        envoy_cpu_us_route: median(&calls.route_cpu_us),
        envoy_cpu_us_mcp: median(&calls.mcp_cpu_us),
        call_rps_route: calls.route_rps,
        call_rps_mcp: calls.mcp_rps,
        resources,
        prompts,
        resources_page,
        prompts_page,
        upstream_requests_during_surface_lists: surface_upstream,
        read_median_route: median(&reads.route_rps),
        read_median_mcp: median(&reads.mcp_rps),
        read_ratio,
        read_rps_route: reads.route_rps,
        read_rps_mcp: reads.mcp_rps,
        new_service_listed: summarize(&listed),
        breaker_annotated: summarize(&annotated),
    })
}
