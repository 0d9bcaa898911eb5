//! Probe cost: what toolgate-xds spends probing many instances, `http` against `mcp` (issue
//! 18), with probes off as the floor. The same instances each time, at the default probe
//! settings (every 2 s, 1 s timeout): a fresh toolgate-xds per kind, so each RSS figure is that
//! kind's own and not the high-water mark of the one before.
//!
//! Thousands of real servers are too many for one machine, and toolgate-xds probes each
//! instance key on its own whatever its address: so a few lab processes carry every instance.
//! Lab `j` is instance `j` of every service (services of `labs` instances each), which keeps
//! each (service, address) pair unique: the registry indexes instances by it (`by_addr`, for
//! the filters' reports), and Envoy would see duplicate hosts in one cluster otherwise.

use std::time::{Duration, Instant};

use anyhow::bail;
use etcd_client::PutOptions;
use futures::StreamExt;
use serde::Serialize;
use toolgate_tests::{cpu_ticks, parse_metric, rss_kib, Etcd, McpServer, TestEnv, Xds};

#[derive(Debug, Serialize)]
pub struct ProbeCost {
    pub instances: usize,
    pub labs: usize,
    pub window_s: f64,
    pub probe_interval_s: f64,
    /// Probes off, then `http`, then `mcp`.
    pub kinds: Vec<KindCost>,
}

#[derive(Debug, Serialize)]
pub struct KindCost {
    /// `off`, `http` or `mcp`.
    pub probe: String,
    /// toolgate-xds user + system CPU over the window, in percent of one core.
    pub xds_cpu_percent: f64,
    pub xds_rss_mib: f64,
    /// Probes toolgate-xds ran per second over the window (0 with probes off).
    pub probes_per_sec: f64,
    pub probes_failed: f64,
    /// The lab servers' CPU over the window, in percent of one core (all labs together).
    pub labs_cpu_percent: f64,
}

/// CPU time of `pid` in ticks; Linux reports /proc/<pid>/stat in USER_HZ, 100 a second, so
/// ticks per second is percent of one core (the scale suite reads it the same way).
fn cpu_percent(ticks: u64, secs: f64) -> f64 {
    ticks as f64 / secs
}

fn registration(i: usize, endpoint: &str, probe: &str) -> String {
    serde_json::json!({
        "instance_id": format!("i{i}"),
        "endpoint": endpoint,
        "tools": ["echo"],
        "probe": probe,
    })
    .to_string()
}

/// Instances whose state toolgate-xds reports as UP.
fn up(registry: &serde_json::Value) -> usize {
    registry["services"]
        .as_object()
        .map(|services| {
            services
                .values()
                .filter_map(|v| v.as_array())
                .flatten()
                .filter(|i| i["state"] == "UP")
                .count()
        })
        .unwrap_or(0)
}

async fn probes(xds: &Xds) -> (f64, f64) {
    let text = xds.metrics_text().await;
    let get = |result: &str| {
        parse_metric(
            &text,
            "toolgate_health_probes_total",
            &format!("result=\"{result}\""),
        )
    };
    (get("pass"), get("fail"))
}

pub async fn run(
    env: &TestEnv,
    instances: usize,
    labs: usize,
    window: Duration,
) -> anyhow::Result<ProbeCost> {
    let etcd = Etcd::start(env).await;
    // Stateless labs: the mcp probe then asks `server/discover` every time, the 2026-07-28
    // probe, and no lab holds a session per instance.
    let mut servers = Vec::with_capacity(labs);
    for j in 0..labs {
        servers.push(
            McpServer::lab(
                env,
                &format!("pc-lab-{j}"),
                &["--stateless", "--json-response"],
            )
            .await,
        );
    }
    let lab_pids: Vec<i32> = servers.iter().map(|s| s.proc.pid()).collect();
    let lab_ticks = || lab_pids.iter().map(|&p| cpu_ticks(p)).sum::<u64>();
    let mut client = etcd.client().await;
    let mut kinds = Vec::new();
    for probe in ["off", "http", "mcp"] {
        eprintln!("  {instances} instances, probes {probe} ...");
        let lease = client.lease_grant(600, None).await?.id();
        let opts = PutOptions::new().with_lease(lease);
        let kind = if probe == "off" { "http" } else { probe };
        futures::stream::iter(0..instances)
            .map(|i| {
                let (mut c, opts) = (client.clone(), opts.clone());
                let value = registration(i, &servers[i % labs].endpoint(), kind);
                async move {
                    c.put(
                        format!("/mcp/services/pc{}/i{i}", i / labs),
                        value,
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
        let extra: &[&str] = if probe == "off" {
            &["--no-probes"]
        } else {
            &[]
        };
        let mut xds = Xds::start(env, &format!("xds-{probe}"), &etcd.endpoint(), extra).await;
        let measured = measure(&xds, probe, instances, window, &lab_ticks).await;
        xds.stop().await;
        // Revoking the lease deletes every key, ready for the next kind.
        let _ = client.lease_revoke(lease).await;
        kinds.push(measured?);
    }
    Ok(ProbeCost {
        instances,
        labs,
        window_s: window.as_secs_f64(),
        probe_interval_s: 2.0,
        kinds,
    })
}

async fn measure(
    xds: &Xds,
    probe: &str,
    instances: usize,
    window: Duration,
    lab_ticks: &impl Fn() -> u64,
) -> anyhow::Result<KindCost> {
    // Ready: every instance read and, with probes on, every one UP (its first probe passed).
    let t0 = Instant::now();
    loop {
        let reg = xds.registry().await;
        let read = reg["instances"].as_u64().unwrap_or(0) as usize;
        if read >= instances && (probe == "off" || up(&reg) >= instances) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!(
                "probes {probe}: {read} of {instances} instances read, {} UP after 120 s",
                up(&reg)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Two intervals more: the first probes all ran at once at start-up, the jitter (±10%)
    // spreads them out after that; the window should see the steady state.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let pid = xds.pid();
    let (pass0, fail0) = probes(xds).await;
    let (cpu0, labs0, t) = (cpu_ticks(pid), lab_ticks(), Instant::now());
    tokio::time::sleep(window).await;
    let (cpu1, labs1, secs) = (cpu_ticks(pid), lab_ticks(), t.elapsed().as_secs_f64());
    let xds_rss_mib = rss_kib(pid) as f64 / 1024.0;
    let (pass1, fail1) = probes(xds).await;
    Ok(KindCost {
        probe: probe.to_string(),
        xds_cpu_percent: cpu_percent(cpu1.saturating_sub(cpu0), secs),
        xds_rss_mib,
        probes_per_sec: (pass1 + fail1 - pass0 - fail0) / secs,
        probes_failed: fail1 - fail0,
        labs_cpu_percent: cpu_percent(labs1.saturating_sub(labs0), secs),
    })
}

impl ProbeCost {
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "| probe cost ({} instances on {} lab servers, every {:.0} s; {:.0} s window) | toolgate-xds CPU | toolgate-xds RSS | probes/s (failed) | lab servers' CPU |\n\
             | --- | ---: | ---: | ---: | ---: |\n",
            self.instances, self.labs, self.probe_interval_s, self.window_s
        );
        for k in &self.kinds {
            out.push_str(&format!(
                "| probes {} | {:.1}% of a core | {:.0} MiB | {:.0} ({:.0}) | {:.1}% of a core |\n",
                k.probe,
                k.xds_cpu_percent,
                k.xds_rss_mib,
                k.probes_per_sec,
                k.probes_failed,
                k.labs_cpu_percent
            ));
        }
        out
    }
}
