//! `toolgate-chaos`: the gateway's worst hour, compressed. A three-member etcd cluster,
//! toolgate-xds (reaching etcd through fault proxies), Envoy with the filter, and a lab
//! service scaled from 5 to 50 pods and back, under steady agent load, while pods are killed,
//! crash, restart and freeze, toolgate-xds is cut off from etcd, etcd is compacted behind its
//! back, toolgate-xds restarts (and later dies to SIGKILL, restarted 3 s on), Envoy
//! hot-restarts, the etcd leader dies, and a server with sessions (the desk) is restarted in
//! place under the sessions the gateway holds for agents of `/mcp`. At the end the
//! invariants are judged from what was recorded, and printed; the exit status says whether all
//! held. `make chaos` runs it for 10 minutes, `make chaos-quick` (CI) for 2.

mod agents;
mod observe;
mod pool;
mod verdict;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use toolgate_tests::{wait_until, Envoy, EtcdCluster, FaultProxy, McpServer, Member, TestEnv, Xds};

use crate::agents::Load;
use crate::observe::Observers;
use crate::pool::{Pool, TTL_SECS};

const SERVICE: &str = "lab";
/// A server with sessions, one instance, restarted in place (same address) during the run:
/// agents of `/mcp` call it on sessions the gateway holds.
const DESK: &str = "desk";
const DESK_ID: &str = "desk-1";
/// The lab's policy `timeout_ms`: calls to a frozen pod end after it with the gateway's
/// reply, not the 60 s default. It also bounds how long the Envoy hot restart's parent must
/// stay up for the calls it is still serving.
const ROUTE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Parser, Debug)]
#[command(about = "Chaos run of the whole gateway on loopback; prints the invariants it checked.")]
struct Args {
    /// How long the load runs, faults and final checks included (at least 60s).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Seed of the fault schedule; random when not given (it is printed, to repeat a run).
    #[arg(long)]
    seed: Option<u64>,
    /// Pods at full scale.
    #[arg(long, default_value_t = 50)]
    instances: usize,
    /// Pods before the scale-up and after the scale-down.
    #[arg(long, default_value_t = 5)]
    base: usize,
    /// Agents calling tools at once on the lab's route.
    #[arg(long, default_value_t = 4)]
    agents: usize,
    /// Agents on the aggregate endpoint `/mcp` besides them (the lab's tools and the desk's).
    #[arg(long, default_value_t = 2)]
    mcp_agents: usize,
    /// Pause between two calls of one agent.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pause: Duration,
    /// Where to write the report as JSON (default: report.json in the run's log directory).
    #[arg(long)]
    report: Option<PathBuf>,
}

enum Action {
    /// SIGCONT to a frozen pod.
    Cont(String),
    /// A replacement pod, as a ReplicaSet starts one.
    Spawn,
    /// The link between toolgate-xds and etcd comes back.
    Restore,
    /// The killed etcd member starts again on its data.
    RestartEtcd(usize),
    /// Compaction while toolgate-xds is cut off.
    Compact,
    /// toolgate-xds starts again after its SIGKILL.
    StartXds,
}

/// The run's one-off faults, as fractions of the run.
const COMPACTION_AT: f64 = 0.25;
const XDS_RESTART_AT: f64 = 0.40;
const ENVOY_HOT_RESTART_AT: f64 = 0.55;
const LEADER_KILL_AT: f64 = 0.65;
const XDS_KILL_AT: f64 = 0.70;
const DESK_RESTARTS_AT: [f64; 2] = [0.30, 0.60];

struct Run {
    env: TestEnv,
    args: Args,
    rng: StdRng,
    t0: Instant,
    cluster: EtcdCluster,
    proxies: Vec<FaultProxy>,
    xds: Xds,
    envoy: Envoy,
    pool: Pool,
    desk: Member,
    /// When no toolgate-xds ran (ms since the start, from..to).
    xds_down: Vec<(f64, f64)>,
    observers: Option<Observers>,
    pending: Vec<(Duration, Action)>,
    partitioned: bool,
    /// No new partition before this: toolgate-xds's backoff (up to 5 s) must get a chance to
    /// reconnect between two, or back-to-back partitions become one long outage.
    partition_quiet_until: Duration,
    faults: BTreeMap<String, u32>,
    /// What happened, in order; shared with tasks that watch for an outcome.
    notes: Arc<Mutex<Vec<String>>>,
}

impl Run {
    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    fn at(&self, fraction: f64) -> Duration {
        self.args.duration.mul_f64(fraction)
    }

    fn note(&self, text: String) {
        note(&self.notes, self.t0, text);
    }

    fn count(&mut self, fault: &str) {
        *self.faults.entry(fault.to_string()).or_default() += 1;
    }

    fn schedule(&mut self, after: Duration, action: Action) {
        let at = self.now() + after;
        self.pending.push((at, action));
    }

    fn pending_spawns(&self) -> usize {
        self.pending
            .iter()
            .filter(|(_, a)| matches!(a, Action::Spawn))
            .count()
    }

    fn cut(&mut self, blackhole: bool) {
        for p in &self.proxies {
            if blackhole {
                p.blackhole();
            } else {
                p.cut();
            }
        }
        self.partitioned = true;
    }

    fn restore(&mut self) {
        for p in &self.proxies {
            p.restore();
        }
        if self.partitioned {
            let quiet = self.now() + Duration::from_secs(8);
            self.partition_quiet_until = self.partition_quiet_until.max(quiet);
        }
        self.partitioned = false;
    }

    async fn run_due(&mut self) {
        let now = self.now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.pending = later;
        for (_, action) in due {
            match action {
                Action::Cont(id) => self.pool.cont(&id),
                Action::Spawn => {
                    self.pool.spawn(&self.env);
                }
                Action::Restore => self.restore(),
                Action::StartXds => {
                    let started = Instant::now();
                    self.xds.restart(&self.env).await;
                    if let Some(o) = &self.observers {
                        o.xds_restarted(self.xds.pid());
                    }
                    self.mark_xds_back();
                    self.note(format!(
                        "toolgate-xds started again after its SIGKILL ({:.2} s to /healthz)",
                        started.elapsed().as_secs_f64()
                    ));
                }
                Action::RestartEtcd(i) => {
                    let started = Instant::now();
                    self.cluster.restart(&self.env, i).await;
                    let name = self.cluster.members[i].name().to_string();
                    self.note(format!(
                        "{name} restarted and rejoined in {:.1} s",
                        started.elapsed().as_secs_f64()
                    ));
                }
                Action::Compact => {
                    let mut c = self.cluster.client().await;
                    let revision = match c.get("/", None).await {
                        Ok(r) => r.header().map_or(0, |h| h.revision()),
                        Err(e) => {
                            self.note(format!("compaction skipped: reading the revision: {e}"));
                            continue;
                        }
                    };
                    let opts = etcd_client::CompactionOptions::new().with_physical();
                    match c.compact(revision, Some(opts)).await {
                        Ok(_) => self.note(format!(
                            "etcd compacted to revision {revision} while toolgate-xds is cut off"
                        )),
                        Err(e) => self.note(format!("compaction at {revision} failed: {e}")),
                    }
                }
            }
        }
    }

    /// One random fault on a random pod, or a partition.
    fn random_fault(&mut self) {
        let running = self.pool.running();
        let faulted = self.pool.stopped().len() + self.pending_spawns();
        // Keep most of the fleet up: the run is about faults the gateway must absorb, not
        // about a service with nothing left to route to.
        if faulted >= self.args.instances / 5 || running.len() <= self.args.base {
            return;
        }
        let id = running[self.rng.random_range(0..running.len())].clone();
        match self.rng.random_range(0..100) {
            0..25 => {
                self.pool.kill(&id);
                self.count("SIGKILL pod (lease left to expire)");
                let after = self.rng.random_range(1000..3000);
                self.schedule(Duration::from_millis(after), Action::Spawn);
            }
            25..45 => {
                self.pool.crash(&id);
                self.count("SIGKILL server (OOM kill; registrar revokes)");
                let after = self.rng.random_range(1000..3000);
                self.schedule(Duration::from_millis(after), Action::Spawn);
            }
            45..70 => {
                self.pool.terminate(&id);
                self.count("graceful restart (SIGTERM)");
                let after = self.rng.random_range(200..1000);
                self.schedule(Duration::from_millis(after), Action::Spawn);
            }
            70..90 => {
                self.pool.stop(&id);
                self.count("SIGSTOP pod for 1-6 s");
                let after = self.rng.random_range(1000..6000);
                self.schedule(Duration::from_millis(after), Action::Cont(id));
            }
            _ if !self.partitioned && self.now() >= self.partition_quiet_until => {
                let blackhole = self.rng.random_bool(0.5);
                self.cut(blackhole);
                self.count(if blackhole {
                    "etcd partition 1-5 s (silent)"
                } else {
                    "etcd partition 1-5 s (reset)"
                });
                let after = self.rng.random_range(1000..5000);
                self.schedule(Duration::from_millis(after), Action::Restore);
            }
            _ => {}
        }
    }

    async fn full_resyncs(&self) -> f64 {
        self.xds
            .metric("toolgate_etcd_full_resyncs_total", "")
            .await
    }

    async fn compaction(&mut self) {
        let before = self.full_resyncs().await;
        self.cut(false);
        // A change toolgate-xds misses while cut off, then the compaction past it: its resume
        // revision is gone, so it must resync in full.
        if let Some(id) = self.pool.running().first().cloned() {
            self.pool.terminate(&id);
            self.schedule(Duration::from_millis(500), Action::Spawn);
        }
        self.schedule(Duration::from_millis(1500), Action::Compact);
        self.schedule(Duration::from_millis(3000), Action::Restore);
        // Nothing else cuts the link until the resync has been seen.
        self.partition_quiet_until = self.now() + Duration::from_secs(15);
        self.count("etcd compaction while cut off");
        self.note("toolgate-xds cut off from etcd for a compaction".into());
        let admin = self.xds.admin_url();
        let t0 = self.t0;
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(20) {
                if let Ok(r) = http.get(format!("{admin}/metrics")).send().await {
                    let text = r.text().await.unwrap_or_default();
                    let now =
                        toolgate_tests::parse_metric(&text, "toolgate_etcd_full_resyncs_total", "");
                    if now > before {
                        println!(
                            "chaos: {:7.1} s  toolgate-xds resynced in full after the compaction",
                            t0.elapsed().as_secs_f64()
                        );
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            println!("chaos: toolgate-xds did not resync in full within 20 s of the compaction");
        });
    }

    /// The start of a time without toolgate-xds.
    fn mark_xds_gone(&mut self) {
        let at = self.now().as_secs_f64() * 1000.0;
        self.xds_down.push((at, f64::INFINITY));
    }

    fn mark_xds_back(&mut self) {
        let at = self.now().as_secs_f64() * 1000.0;
        if let Some(last) = self.xds_down.last_mut() {
            last.1 = at;
        }
    }

    async fn xds_kill(&mut self) {
        self.xds.kill();
        self.mark_xds_gone();
        self.count("toolgate-xds SIGKILL");
        self.note("toolgate-xds SIGKILLed; started again in 3 s".into());
        self.schedule(Duration::from_secs(3), Action::StartXds);
    }

    /// The desk's server dies and a new one starts on its address at once, its registration
    /// untouched: every session the gateway held with it is gone.
    async fn desk_restart(&mut self) {
        let started = Instant::now();
        let port = self.desk.server.port;
        self.desk.server.proc.kill();
        let fresh = McpServer::lab_on(
            &self.env,
            DESK_ID,
            port,
            &["--tools", "read_order,write_order,echo"],
        )
        .await;
        drop(std::mem::replace(&mut self.desk.server, fresh));
        self.count("server restarted in place (sessions lost)");
        self.note(format!(
            "the desk's server restarted in place on port {port} in {:.2} s",
            started.elapsed().as_secs_f64()
        ));
    }

    async fn xds_restart(&mut self) {
        let started = Instant::now();
        self.mark_xds_gone();
        self.xds.restart(&self.env).await;
        self.mark_xds_back();
        if let Some(o) = &self.observers {
            o.xds_restarted(self.xds.pid());
        }
        self.count("toolgate-xds restart");
        self.note(format!(
            "toolgate-xds restarted (SIGTERM, start, /healthz) in {:.2} s",
            started.elapsed().as_secs_f64()
        ));
    }

    async fn envoy_hot_restart(&mut self) {
        let started = Instant::now();
        self.envoy.hot_restart(&self.env, ROUTE_TIMEOUT).await;
        self.count("Envoy hot restart");
        self.note(format!(
            "Envoy hot restart: epoch {} took over; its parent drained and exited after {:.2} s \
             (--parent-shutdown-time-s {})",
            self.envoy.epoch(),
            started.elapsed().as_secs_f64(),
            self.envoy.parent_shutdown().as_secs()
        ));
    }

    async fn kill_leader(&mut self) {
        let leader = self.cluster.wait_leader(Duration::from_secs(10)).await;
        let name = self.cluster.members[leader].name().to_string();
        let started = Instant::now();
        self.cluster.kill(leader);
        self.count("etcd leader SIGKILL");
        let new = self.cluster.wait_leader(Duration::from_secs(20)).await;
        let new_name = self.cluster.members[new].name().to_string();
        self.note(format!(
            "etcd leader {name} killed; {new_name} leads after {:.2} s",
            started.elapsed().as_secs_f64()
        ));
        self.schedule(Duration::from_secs(5), Action::RestartEtcd(leader));
    }

    /// Ends every fault: links restored, frozen pods resumed, etcd members back, pods that
    /// died replaced.
    async fn heal(&mut self) {
        self.restore();
        for id in self.pool.stopped() {
            self.pool.cont(&id);
        }
        self.pending.retain(|(_, a)| !matches!(a, Action::Spawn));
        let mut due: Vec<_> = std::mem::take(&mut self.pending);
        due.retain(|(_, a)| matches!(a, Action::RestartEtcd(_)));
        for (_, a) in due {
            if let Action::RestartEtcd(i) = a {
                self.cluster.restart(&self.env, i).await;
            }
        }
        self.pool.reap();
        while self.pool.pods.len() < self.args.instances {
            self.pool.spawn(&self.env);
        }
        self.note(format!(
            "healed: every fault ended, {} pods running",
            self.pool.pods.len()
        ));
    }

    fn scale_down(&mut self) {
        let ids: Vec<String> = self.pool.pods.keys().cloned().collect();
        let excess = ids.len().saturating_sub(self.args.base);
        for id in ids.iter().take(excess) {
            self.pool.terminate(id);
        }
        self.count("scale down (graceful)");
        self.note(format!(
            "scaled down from {} to {} pods (the last fault)",
            ids.len(),
            self.pool.pods.len()
        ));
    }

    async fn drive(&mut self) {
        let d = self.args.duration;
        let scale_up_at = self.at(0.04);
        let faults_from = self.at(0.10);
        // The end: faults stop, everything heals, the leases of killed pods run out (TTL),
        // then the scale-down is the last change, and Envoy must match etcd within 1 s of it.
        let heal_at = d.saturating_sub(Duration::from_secs(30));
        let scale_down_at = d.saturating_sub(Duration::from_secs(15));
        let mut one_offs = vec![
            (self.at(COMPACTION_AT), "compaction"),
            (self.at(XDS_RESTART_AT), "xds"),
            (self.at(ENVOY_HOT_RESTART_AT), "envoy"),
            (self.at(LEADER_KILL_AT), "leader"),
            (self.at(XDS_KILL_AT), "xds-kill"),
            (self.at(DESK_RESTARTS_AT[0]), "desk"),
            (self.at(DESK_RESTARTS_AT[1]), "desk"),
        ];
        // Faults every ~1 s in a 2-minute run, every ~3 s in a 10-minute one.
        let gap_ms = (d.as_millis() as u64 / 200).clamp(1000, 3000);
        let mut next_fault = faults_from;
        let (mut scaled_up, mut healed, mut scaled_down) = (false, false, false);
        while self.now() < d {
            let now = self.now();
            self.run_due().await;
            for id in self.pool.reap() {
                self.note(format!("pod {id} exited on its own; replacing it"));
                self.schedule(Duration::from_millis(500), Action::Spawn);
            }
            if !scaled_up && now >= scale_up_at {
                scaled_up = true;
                let from = self.pool.pods.len();
                while self.pool.pods.len() < self.args.instances {
                    self.pool.spawn(&self.env);
                }
                self.count("scale up");
                self.note(format!(
                    "scaling up from {from} to {} pods",
                    self.args.instances
                ));
            }
            if now >= faults_from && now < heal_at {
                if let Some(i) = one_offs.iter().position(|(at, _)| now >= *at) {
                    let (_, which) = one_offs[i];
                    // A compaction needs the link to itself.
                    if which != "compaction" || !self.partitioned {
                        one_offs.remove(i);
                        match which {
                            "compaction" => self.compaction().await,
                            "xds" => self.xds_restart().await,
                            "envoy" => self.envoy_hot_restart().await,
                            "xds-kill" => self.xds_kill().await,
                            "desk" => self.desk_restart().await,
                            _ => self.kill_leader().await,
                        }
                    }
                }
                if now >= next_fault {
                    self.random_fault();
                    next_fault = now
                        + Duration::from_millis(self.rng.random_range(gap_ms / 2..gap_ms * 3 / 2));
                }
            }
            if !healed && now >= heal_at {
                healed = true;
                for (_, which) in one_offs.drain(..) {
                    self.note(format!("one-off fault {which} did not fit in the run"));
                }
                self.heal().await;
            }
            if !scaled_down && now >= scale_down_at {
                scaled_down = true;
                self.scale_down();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn setup(args: Args, seed: u64) -> Run {
    let env = TestEnv::new("chaos");
    // Hundreds of pod logs stay in the directory; a failure prints the core processes'.
    env.print_only(&["etcd", "xds", "envoy"]);
    let mut cluster = EtcdCluster::start(&env, "etcd", 3).await;
    let proxies: Vec<FaultProxy> = cluster
        .members
        .iter()
        .map(|m| FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], m.port()))))
        .collect();
    let through_proxies = proxies
        .iter()
        .map(FaultProxy::endpoint)
        .collect::<Vec<_>>()
        .join(",");
    let xds = Xds::start(&env, "xds", &through_proxies, &[]).await;
    let mut etcd = cluster.client().await;
    etcd.put(
        format!("/mcp/policies/{SERVICE}"),
        json!({"timeout_ms": ROUTE_TIMEOUT.as_millis()}).to_string(),
        None,
    )
    .await
    .expect("writing the lab's policy");
    let envoy = Envoy::start_with_filter(&env, "envoy", &xds, 2, &[]).await;
    let mut pool = Pool::new(&cluster.endpoints(), SERVICE);
    for _ in 0..args.base {
        pool.spawn(&env);
    }
    let desk =
        Member::start_unwatched(&env, &cluster.endpoints(), DESK, DESK_ID, &[], TTL_SECS).await;
    let admin = envoy.admin();
    let base = args.base;
    wait_until(
        &format!("Envoy routes to the first {base} pods"),
        Duration::from_secs(30),
        || async {
            admin
                .hosts()
                .await
                .get(SERVICE)
                .is_some_and(|h| h.len() == base)
        },
    )
    .await;
    let mcp = format!("http://127.0.0.1:{}/mcp", envoy.port);
    wait_until(
        "/mcp lists the lab's and the desk's tools",
        Duration::from_secs(30),
        || async {
            let mut s = toolgate_tests::McpSession::unconnected(&mcp);
            s.initialize().await;
            let body = s.list_tools().await.body;
            body.contains("lab__echo") && body.contains("desk__echo")
        },
    )
    .await;
    Run {
        env,
        rng: StdRng::seed_from_u64(seed),
        args,
        t0: Instant::now(),
        cluster,
        proxies,
        xds,
        envoy,
        pool,
        desk,
        xds_down: Vec::new(),
        observers: None,
        pending: Vec::new(),
        partitioned: false,
        partition_quiet_until: Duration::ZERO,
        faults: BTreeMap::new(),
        notes: Arc::default(),
    }
}

fn note(notes: &Mutex<Vec<String>>, t0: Instant, text: String) {
    let line = format!("{:7.1} s  {text}", t0.elapsed().as_secs_f64());
    println!("chaos: {line}");
    notes.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

async fn chaos(args: Args) -> ExitCode {
    let seed = args.seed.unwrap_or_else(rand::random);
    let duration = args.duration;
    println!(
        "chaos: {} s, seed {seed}, {} -> {} -> {} pods, {} agents on the lab's route, {} on /mcp",
        duration.as_secs(),
        args.base,
        args.instances,
        args.base,
        args.agents,
        args.mcp_agents
    );
    let report_path = args.report.clone();
    let mut run = setup(args, seed).await;
    let endpoints: Vec<String> = run.cluster.members.iter().map(|m| m.endpoint()).collect();
    run.t0 = Instant::now();
    run.observers = Some(Observers::start(
        run.t0,
        endpoints,
        format!("/mcp/services/{SERVICE}/"),
        run.envoy.admin(),
        SERVICE.to_string(),
        run.xds.pid(),
    ));
    let load = Load::start(
        &run.envoy.url(SERVICE),
        run.args.agents,
        &format!("http://127.0.0.1:{}/mcp", run.envoy.port),
        run.args.mcp_agents,
        run.args.pause,
        run.t0,
    )
    .await;
    run.note("load started".into());
    run.drive().await;
    let calls = load.finish().await;
    let records = match run.observers.take() {
        Some(o) => o.finish().await,
        None => Default::default(),
    };
    let notes = run.notes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let v = verdict::judge(
        &calls,
        &run.xds_down,
        &records,
        run.args.base,
        10_000.0,
        &run.faults,
        &notes,
    );
    println!("\nchaos: faults injected");
    for (fault, n) in &run.faults {
        println!("  {n:4}  {fault}");
    }
    println!("\nchaos: invariants");
    for c in &v.checks {
        println!(
            "  {}  {}\n        {}",
            if c.passed { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    let mut report = v.json.clone();
    report["seed"] = json!(seed);
    report["duration_s"] = json!(duration.as_secs());
    report["calls_per_second"] = json!(calls.len() as f64 / duration.as_secs_f64());
    let path = report_path.unwrap_or_else(|| run.env.path("report.json"));
    match serde_json::to_string_pretty(&report) {
        Ok(text) => match std::fs::write(&path, text) {
            Ok(()) => println!("\nchaos: report in {}", path.display()),
            Err(e) => eprintln!("chaos: writing {}: {e}", path.display()),
        },
        Err(e) => eprintln!("chaos: encoding the report: {e}"),
    }
    run.pool.shutdown(Duration::from_secs(10)).await;
    if v.passed() {
        println!("chaos: every invariant held (seed {seed})");
        ExitCode::SUCCESS
    } else {
        run.env.print_failure_logs();
        println!(
            "chaos: FAILED (seed {seed}); every process's log is in {}",
            run.env.dir().display()
        );
        ExitCode::FAILURE
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if args.duration < Duration::from_secs(60) {
        eprintln!(
            "toolgate-chaos: --duration must be at least 60s (the final heal and checks take 30 s), got {:?}",
            args.duration
        );
        return ExitCode::from(2);
    }
    if args.base == 0 || args.instances < args.base {
        eprintln!(
            "toolgate-chaos: need 0 < --base <= --instances, got {} and {}",
            args.base, args.instances
        );
        return ExitCode::from(2);
    }
    // Setup and the final report get five minutes on top of the run itself.
    let bound = args.duration + Duration::from_secs(300);
    match tokio::time::timeout(bound, chaos(args)).await {
        Ok(code) => code,
        Err(_) => {
            eprintln!("toolgate-chaos: the run did not finish within {bound:?}; stopping it");
            ExitCode::FAILURE
        }
    }
}

// The pods' TTL decides how long the end waits for killed pods' leases.
const _: () = assert!(TTL_SECS < 15);
