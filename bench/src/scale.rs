//! The control plane at scale: 10,000 instances in 1,000 services. toolgate-xds's memory, its
//! cold start (Get and registry) and an Envoy's first full push, a full resync after a
//! compaction, and propagation while 500 registrations and revocations a second churn the
//! registry; Envoy's own memory and CPU with every endpoint. Probes are off: the instances are
//! fake endpoints.
//!
//! Beyond 1,000 services the Envoys are shards (`toolgate-xds bootstrap --services`): one Envoy
//! rebuilds its whole route configuration for each new service and cannot follow 10,000 of
//! them, so the bench's Envoys serve [`SHARD`], about a ninth of the services, as one Envoy of
//! a sharded fleet would. toolgate-xds still holds and watches every instance.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use etcd_client::{Client, PutOptions};
use futures::StreamExt;
use serde::Serialize;
use toolgate_tests::{cpu_ticks, rss_kib, Envoy, Etcd, FaultProxy, McpServer, TestEnv, Xds};

use crate::propagation::{wait_hosts, wait_status};
use crate::stats::{summarize, Summary};

/// The services of the bench's Envoys when there are more than [`SHARD_ABOVE_SERVICES`]: `s1`,
/// `s10`-`s19`, `s100`-`s199`, `s1000`-`s1999` (1,111 of 10,000), the probe and the churn.
const SHARD: &str = "s1*,probe,churn*";
const SHARD_ABOVE_SERVICES: usize = 1_000;

/// Whether a service of this suite is in [`SHARD`] (what toolgate-xds's selector decides).
fn in_shard(service: &str) -> bool {
    service.starts_with("s1") || service == "probe" || service.starts_with("churn")
}

#[derive(Debug, Serialize)]
pub struct Scale {
    pub instances: usize,
    pub services: usize,
    pub xds_rss_mib: f64,
    /// toolgate-xds restarted: process start -> registry read from etcd and served.
    pub cold_start_ms: f64,
    /// The Get + rebuild + publish inside it, as toolgate-xds logs it.
    pub cold_read_ms: f64,
    /// A fresh Envoy: start -> every endpoint applied.
    pub envoy_first_push_ms: f64,
    /// Full re-read after etcd compacted past the watch (as toolgate-xds logs it).
    pub resync_ms: f64,
    pub churn_ops_per_sec: f64,
    pub churn_propagation: Summary,
    pub envoy_rss_mib: f64,
    pub envoy_cpu_percent_during_churn: f64,
    /// The Envoys' services when they are shards (`--services`); `None`: every service.
    pub envoy_services: Option<String>,
    /// The endpoints each Envoy holds (all, or its shard's).
    pub envoy_endpoints: usize,
}

/// Issue 22's goals at one size; `None` where that size has none.
#[derive(Debug, Default)]
struct ScaleGoals {
    rss_mib: Option<f64>,
    cold_start_ms: Option<f64>,
    envoy_first_push_ms: Option<f64>,
    resync_ms: Option<f64>,
    churn_p99_ms: Option<f64>,
}

impl ScaleGoals {
    fn at(instances: usize) -> ScaleGoals {
        match instances {
            10_000 => ScaleGoals {
                rss_mib: Some(64.0),
                cold_start_ms: Some(300.0),
                envoy_first_push_ms: Some(500.0),
                resync_ms: Some(100.0),
                churn_p99_ms: Some(50.0),
            },
            100_000 => ScaleGoals {
                // 500 MB.
                rss_mib: Some(500e6 / (1024.0 * 1024.0)),
                churn_p99_ms: Some(50.0),
                ..ScaleGoals::default()
            },
            _ => ScaleGoals::default(),
        }
    }
}

fn rss_mib(pid: i32) -> f64 {
    rss_kib(pid) as f64 / 1024.0
}

/// A log line without its terminal colour codes (ESC [ ... m).
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

const FULL_READ_LOGGED: &str = "read the registry from etcd";

/// How many full reads of etcd toolgate-xds has logged.
fn full_reads(xds: &Xds) -> usize {
    xds.log()
        .lines()
        .filter(|l| l.contains(FULL_READ_LOGGED))
        .count()
}

/// The `took_ms` of the first full read logged after the first `before`, once it is logged.
/// Waiting for the line itself: the resync counter ticks when the resync starts, and the
/// hosts gauge when the read is applied, both before the line, and the previous read's line
/// (the cold start's) then stood in for the resync's.
async fn read_ms_after(xds: &Xds, before: usize, timeout: Duration) -> anyhow::Result<f64> {
    let started = Instant::now();
    loop {
        let log = xds.log();
        if let Some(line) = log
            .lines()
            .filter(|l| l.contains(FULL_READ_LOGGED))
            .nth(before)
        {
            let line = plain(line);
            return line
                .split("took_ms=")
                .nth(1)
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|ms| ms.parse().ok())
                .with_context(|| format!("no took_ms in {line:?}"));
        }
        if started.elapsed() > timeout {
            bail!("toolgate-xds logged no full read of etcd after the first {before}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The clusters Envoy has warmed and uses (`cluster_manager.active_clusters`).
async fn envoy_active_clusters(http: &reqwest::Client, envoy: &Envoy) -> u64 {
    let Ok(r) = http
        .get(format!(
            "{}/stats?filter=^cluster_manager.active_clusters$",
            envoy.admin_url()
        ))
        .send()
        .await
    else {
        return 0;
    };
    r.text()
        .await
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("cluster_manager.active_clusters: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Endpoints Envoy holds over all toolgate clusters.
async fn envoy_endpoints(http: &reqwest::Client, envoy: &Envoy) -> u64 {
    let Ok(r) = http
        .get(format!(
            "{}/stats?filter=membership_total$",
            envoy.admin_url()
        ))
        .send()
        .await
    else {
        return 0;
    };
    r.text()
        .await
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("cluster.mcp."))
        .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
        .sum()
}

fn fake(i: usize) -> String {
    format!(
        r#"{{"instance_id":"i-{i}","endpoint":"127.{}.{}.{}:{}","tools":["t"]}}"#,
        1 + i / 62500 % 250,
        1 + i / 250 % 250,
        1 + i % 250,
        10000 + i % 50000
    )
}

/// The services the churn registers and revokes in (`churn0` …).
const CHURN_SERVICES: usize = 100;

/// How many registrations back the churn's revocations reach: each churn service holds
/// about `CHURN_LAG / CHURN_SERVICES` instances.
const CHURN_LAG: usize = 300;

/// Registrations per lease: real instances hold one each; etcd's puts slow down as one
/// lease gathers tens of thousands of keys (about 110 puts/s at 40,000).
const KEYS_PER_LEASE: usize = 1_000;

/// `instances` fake registrations in services of ten, `s<i / 10>/i-<i>`, on `leases` in turn
/// ([`KEYS_PER_LEASE`] each).
async fn register(client: &Client, instances: usize, leases: &[i64]) -> anyhow::Result<()> {
    futures::stream::iter(0..instances)
        .map(|i| {
            let mut c = client.clone();
            let opts = PutOptions::new().with_lease(leases[i / KEYS_PER_LEASE % leases.len()]);
            async move {
                c.put(
                    format!("/mcp/services/s{}/i-{i}", i / 10),
                    fake(i),
                    Some(opts),
                )
                .await
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(())
}

pub async fn run(env: &TestEnv, instances: usize, churn_secs: u64) -> anyhow::Result<Scale> {
    let services = instances / 10;
    let etcd = Etcd::start(env).await;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", etcd.port()).parse()?);
    let sharded = services > SHARD_ABOVE_SERVICES;
    let shard_flags: &[&str] = if sharded { &["--services", SHARD] } else { &[] };
    let lab = McpServer::lab(env, "scale-lab", &["--stateless", "--json-response"]).await;
    let mut client = etcd.client().await;
    let mut leases = Vec::new();
    for _ in 0..instances.div_ceil(KEYS_PER_LEASE).max(1) {
        leases.push(client.lease_grant(600, None).await?.id());
    }
    // The probe, the churn and the extra keys use the first.
    let lease = leases[0];
    // Kept alive: at 100,000 instances the suite outlasts the leases' TTL.
    let mut keepers = Vec::new();
    for &l in &leases {
        keepers.push(client.lease_keep_alive(l).await?);
    }
    let keepalive = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(20)).await;
            for (keeper, stream) in &mut keepers {
                if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
                    return;
                }
            }
        }
    });
    let opts = PutOptions::new().with_lease(lease);
    // Up to 1,000 services the instances register with toolgate-xds watching, one new
    // service after another. Beyond, they are in etcd before toolgate-xds starts (its read
    // of them all is then the figures' starting point): each new service costs toolgate-xds
    // work in proportion to the services it has (the route configuration, the filter's
    // catalog, the aggregate listing), so 10,000 services registered one by one take minutes.
    let (mut xds, envoy) = if sharded {
        register(&client, instances, &leases).await?;
        let xds = Xds::start(env, "xds", &proxy.endpoint(), &["--no-probes"]).await;
        let envoy = Envoy::start_with(env, "envoy", &xds, 1, shard_flags).await;
        (xds, envoy)
    } else {
        let xds = Xds::start(env, "xds", &proxy.endpoint(), &["--no-probes"]).await;
        let envoy = Envoy::start_with(env, "envoy", &xds, 1, shard_flags).await;
        register(&client, instances, &leases).await?;
        (xds, envoy)
    };
    // The probe service: the lab's /health through Envoy answers 200 while it is routed.
    let probe_value = format!(
        r#"{{"instance_id":"p","endpoint":"{}","mcp_path":"/health","tools":["t"]}}"#,
        lab.endpoint()
    );
    client
        .put(
            "/mcp/services/probe/p",
            probe_value.clone(),
            Some(opts.clone()),
        )
        .await?;
    let total = instances + 1;
    wait_hosts(&xds, total, Duration::from_secs(120)).await?;
    // What each Envoy holds: every instance and the probe, or its shard's.
    let in_envoy = if sharded {
        (0..instances)
            .filter(|i| in_shard(&format!("s{}", i / 10)))
            .count()
            + 1
    } else {
        total
    };
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;
    let t0 = Instant::now();
    while envoy_endpoints(&http, &envoy).await < in_envoy as u64 {
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("Envoy never got all {in_envoy} endpoints");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let xds_rss_mib = rss_mib(xds.pid());
    let envoy_pid = envoy.proc.as_ref().map_or(0, |p| p.pid());
    let envoy_rss_mib = rss_mib(envoy_pid);
    eprintln!(
        "  {in_envoy} of {total} instances in Envoy{}; toolgate-xds RSS {xds_rss_mib:.0} MiB",
        if sharded { " (a shard)" } else { "" }
    );

    // Cold start.
    let reads = full_reads(&xds);
    xds.kill();
    let t0 = Instant::now();
    xds.restart(env).await;
    wait_hosts(&xds, total, Duration::from_secs(60)).await?;
    let cold_start_ms = t0.elapsed().as_secs_f64() * 1e3;
    let cold_read_ms = read_ms_after(&xds, reads, Duration::from_secs(10)).await?;
    let t0 = Instant::now();
    let fresh = Envoy::start_with(env, "envoy-fresh", &xds, 1, shard_flags).await;
    while envoy_endpoints(&http, &fresh).await < in_envoy as u64 {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("the fresh Envoy never got all {in_envoy} endpoints");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let envoy_first_push_ms = t0.elapsed().as_secs_f64() * 1e3;
    drop(fresh);

    // Resync after a compaction: cut toolgate-xds off, change and compact, let it back.
    let resyncs = xds.metric("toolgate_etcd_full_resyncs_total", "").await;
    let reads = full_reads(&xds);
    proxy.cut();
    for i in 0..10 {
        client
            .put(
                format!("/mcp/services/s0/extra-{i}"),
                fake(instances + i).replace(&format!("i-{}", instances + i), &format!("extra-{i}")),
                Some(opts.clone()),
            )
            .await?;
    }
    etcd.compact().await;
    proxy.restore();
    let t0 = Instant::now();
    while xds.metric("toolgate_etcd_full_resyncs_total", "").await <= resyncs {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("toolgate-xds never resynced after the compaction");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resync_ms = read_ms_after(&xds, reads, Duration::from_secs(60)).await?;

    // Churn: registrations and revocations at 500/s, while a probe change propagates.
    let clusters_before = envoy_active_clusters(&http, &envoy).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (mut c, opts, stop) = (client.clone(), opts.clone(), stop.clone());
        tokio::spawn(async move {
            let mut ops = 0u64;
            let mut every = tokio::time::interval(Duration::from_millis(2));
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                every.tick().await;
                // Pair k registers c<k> and revokes c<k - CHURN_LAG>, so every churn service
                // holds a few instances that come and go (the key of a revocation exists).
                let k = n / 2;
                let key = |k: usize| format!("/mcp/services/churn{}/c{k}", k % CHURN_SERVICES);
                n += 1;
                let r = if n % 2 == 1 {
                    let v = format!(
                        r#"{{"instance_id":"c{k}","endpoint":"127.0.254.{}:9","tools":["t"]}}"#,
                        1 + k % 250
                    );
                    c.put(key(k), v, Some(opts.clone())).await.map(|_| ())
                } else if k >= CHURN_LAG {
                    c.delete(key(k - CHURN_LAG), None).await.map(|_| ())
                } else {
                    continue;
                };
                if r.is_ok() {
                    ops += 1;
                }
            }
            ops
        })
    };
    let url = envoy.url("probe");
    // The churn's first second creates its 100 services (each a new cluster, route and
    // catalog entry); the figure is the steady state after that, where registrations come
    // and go in services that exist. At 100,000 instances Envoy takes longer than that
    // second to warm the 100 clusters: wait until it has them.
    let t_warm = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    while envoy_active_clusters(&http, &envoy).await < clusters_before + CHURN_SERVICES as u64 {
        if t_warm.elapsed() > Duration::from_secs(60) {
            bail!("Envoy never warmed the churn's {CHURN_SERVICES} services");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "  the churn's {CHURN_SERVICES} new services were in Envoy after {} ms",
        t_warm.elapsed().as_millis()
    );
    let cpu0 = cpu_ticks(envoy_pid);
    let t_churn = Instant::now();
    let mut samples = Vec::new();
    // When each change began, to find the slowest in the processes' logs.
    let mut began = Vec::new();
    let mut routed = true;
    while t_churn.elapsed() < Duration::from_secs(churn_secs) {
        let t0 = Instant::now();
        began.push(std::time::SystemTime::now());
        if routed {
            client.delete("/mcp/services/probe/p", None).await?;
            wait_status(&http, &url, 503, Duration::from_secs(10)).await?;
        } else {
            client
                .put(
                    "/mcp/services/probe/p",
                    probe_value.clone(),
                    Some(opts.clone()),
                )
                .await?;
            wait_status(&http, &url, 200, Duration::from_secs(10)).await?;
        }
        samples.push(t0.elapsed());
        routed = !routed;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut worst: Vec<(usize, Duration)> = samples.iter().copied().enumerate().collect();
    worst.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
    eprintln!(
        "  slowest changes under churn (ms, began at): {:?}",
        worst
            .iter()
            .take(3)
            .map(|(i, d)| (
                d.as_millis(),
                humantime::format_rfc3339_millis(began[*i]).to_string()
            ))
            .collect::<Vec<_>>()
    );
    let secs = t_churn.elapsed().as_secs_f64();
    let ops = churn.await?;
    let envoy_cpu_percent_during_churn = (cpu_ticks(envoy_pid) - cpu0) as f64 / secs;
    keepalive.abort();
    for l in leases {
        let _ = client.lease_revoke(l).await;
    }
    Ok(Scale {
        instances,
        services,
        xds_rss_mib,
        cold_start_ms,
        cold_read_ms,
        envoy_first_push_ms,
        resync_ms,
        churn_ops_per_sec: ops as f64 / secs,
        churn_propagation: summarize(&samples),
        envoy_rss_mib,
        envoy_cpu_percent_during_churn,
        envoy_services: sharded.then(|| SHARD.to_string()),
        envoy_endpoints: in_envoy,
    })
}

impl Scale {
    pub fn markdown(&self) -> String {
        let goals = ScaleGoals::at(self.instances);
        let judge = |goal: Option<f64>, figure: f64, unit: &str| match goal {
            Some(g) => format!("<= {g:.0} {unit}: {}", crate::verdict(figure <= g)),
            None => String::new(),
        };
        format!(
            "| control plane at scale ({} instances, {} services) | figure | goal |\n| --- | ---: | --- |\n\
             | toolgate-xds resident memory | {:.0} MiB | {} |\n\
             | cold start: process start -> registry read and served | {:.0} ms (Get + build + publish {:.0} ms) | {} |\n\
             | a fresh Envoy: start -> every endpoint it serves applied | {:.0} ms | {} |\n\
             | full resync after a compaction | {:.0} ms | {} |\n\
             | propagation under churn ({:.0} registrations + revocations/s) p50 / p99 / max | {:.1} / {:.1} / {:.1} ms ({} changes) | {} |\n\
             | Envoy with {}: RSS, CPU during churn | {:.0} MiB, {:.0}% of a core | |\n",
            self.instances,
            self.services,
            self.xds_rss_mib,
            judge(goals.rss_mib, self.xds_rss_mib, "MiB"),
            self.cold_start_ms,
            self.cold_read_ms,
            judge(goals.cold_start_ms, self.cold_start_ms, "ms"),
            self.envoy_first_push_ms,
            judge(goals.envoy_first_push_ms, self.envoy_first_push_ms, "ms"),
            self.resync_ms,
            judge(goals.resync_ms, self.resync_ms, "ms"),
            self.churn_ops_per_sec,
            self.churn_propagation.p50_ms,
            self.churn_propagation.p99_ms,
            self.churn_propagation.max_ms,
            self.churn_propagation.n,
            judge(
                goals.churn_p99_ms,
                self.churn_propagation.p99_ms,
                "ms (p99)"
            ),
            match &self.envoy_services {
                Some(shard) => format!(
                    "its shard's {} endpoints (--services {shard})",
                    self.envoy_endpoints
                ),
                None => "every endpoint".to_string(),
            },
            self.envoy_rss_mib,
            self.envoy_cpu_percent_during_churn,
        )
    }
}
