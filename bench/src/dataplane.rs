//! Suite 3, data-plane overhead: `tools/call` under load (wrk, fixed connection count) against
//! (a) the lab server directly, (b) Envoy without a wasm filter, (c) Envoy with the toolgate
//! filter, (d) Envoy with a wasm filter that does nothing, (e) Envoy with Envoy's own MCP
//! filter (`envoy.filters.http.mcp`, default configuration: it parses every request's JSON-RPC
//! body), the reference the toolgate filter must beat. The Envoys run side by side and the
//! variants alternate within every repetition (a, b, c, d, e, a, b, c, d, e, ...), so slow
//! drift of the machine hits all of them alike. Ratios are taken per repetition (paired) and
//! reported as median and range.
//!
//! The profile (full mode) adds an Envoy with the probe filter (`bench/noop-filter/examples`),
//! which repeats the toolgate filter's per-request work step by step, selected per request by
//! the `x-probe` header: Envoy's CPU time per request at each level says where the toolgate
//! filter's time goes.
//!
//! On a machine with two or more cores, Envoy (`--concurrency 1`, every thread) runs alone on
//! core 1; the lab servers, wrk, etcd, toolgate-xds and this driver share core 0. Runs during
//! which other processes on the machine (builds, tests) used CPU are measured again.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use toolgate_tests::{Envoy, Etcd, McpServer, TestEnv, Xds};

use crate::machine::{affinity, core_times, cpu_ns, own_tree_cpu_ns, pin, CoreTimes};
use crate::stats::{spread, Spread};

pub struct Options {
    pub reps: usize,
    pub secs: u64,
    pub warmup_secs: u64,
    pub connections: u32,
    pub noop_filter: PathBuf,
    pub toolgate_filter: PathBuf,
    /// The probe filter; `None`: no profile.
    pub probe_filter: Option<PathBuf>,
    pub profile_reps: usize,
    /// Probe levels the profile measures; empty: all.
    pub profile_levels: Vec<usize>,
    /// The workloads the profile measures (JSON answers only: the probe holds and parses the
    /// answer as the toolgate filter does a JSON one).
    pub profile_workloads: Vec<String>,
    /// Workload keys to run (1k-json, 1k-json-2026, 8k-json, 1k-sse); empty: all.
    pub workloads: Vec<String>,
    /// How long to wait for a quiet machine before each run.
    pub quiet_wait: Duration,
    /// Measurements of one run at most, while other processes disturb it.
    pub attempts: usize,
    /// Time the whole suite may spend on waiting for quiet and on measuring again.
    pub extra_budget: Cell<Duration>,
}

impl Options {
    fn spend(&self, d: Duration) {
        self.extra_budget
            .set(self.extra_budget.get().saturating_sub(d));
    }
}

struct Workload {
    key: &'static str,
    name: &'static str,
    body_bytes: usize,
    sse: bool,
    /// Sent as a client of revision 2026-07-28 sends it: the revision, the client and its
    /// capabilities in the body's `_meta`, and the `MCP-Protocol-Version`, `Mcp-Method` and
    /// `Mcp-Name` headers.
    rev_2026: bool,
}

/// The goal on every workload: the toolgate filter at least this much ahead of Envoy's own MCP
/// filter, (c)/(e) by requests per second, the median of the ratios paired per repetition.
/// The peer measured in the same run is the fair reference: absolute (c)/(b) goals asked for
/// less than even Envoy's native filter costs on this machine.
const MIN_C_OVER_E: f64 = 1.05;

const WORKLOADS: [Workload; 4] = [
    Workload {
        key: "1k-json",
        name: "1 KB JSON",
        body_bytes: 1024,
        sse: false,
        rev_2026: false,
    },
    Workload {
        key: "1k-json-2026",
        name: "1 KB JSON, 2026-07-28 headers",
        body_bytes: 1024,
        sse: false,
        rev_2026: true,
    },
    Workload {
        key: "8k-json",
        name: "8 KB JSON",
        body_bytes: 8192,
        sse: false,
        rev_2026: false,
    },
    Workload {
        key: "1k-sse",
        name: "1 KB SSE",
        body_bytes: 1024,
        sse: true,
        rev_2026: false,
    },
];

/// The stateless MCP revision whose requests carry their method and tool name in headers.
const REV_2026: &str = "2026-07-28";

impl Workload {
    /// The `tools/call` of `echo`, exactly `body_bytes` long.
    fn body(&self) -> String {
        if self.rev_2026 {
            request_body_2026(self.body_bytes)
        } else {
            request_body(self.body_bytes)
        }
    }

    /// Request headers besides `Content-Type` and `Accept`.
    fn headers(&self) -> Vec<(&'static str, &'static str)> {
        if self.rev_2026 {
            vec![
                ("MCP-Protocol-Version", REV_2026),
                ("Mcp-Method", "tools/call"),
                ("Mcp-Name", "echo"),
            ]
        } else {
            Vec::new()
        }
    }

    fn goal(&self) -> String {
        format!("(c)/(e) >= {MIN_C_OVER_E:.2}")
    }
}

/// The goal of the suite, as the issue states it.
fn goal_text() -> String {
    format!(
        "on every workload, (c)/(e) >= {MIN_C_OVER_E:.2}: the toolgate filter ahead of Envoy's own \
         MCP filter by requests per second, on the median of the ratios paired per repetition"
    )
}

/// The probe filter's levels (cumulative), see `bench/noop-filter/examples/probe_filter.rs`.
const PROBE_LEVELS: [&str; 10] = [
    "reads x-probe only",
    "+ reads the request header map (one host call)",
    "+ holds the headers until the body is complete",
    "+ copies the body into the VM, scans its depth, parses the JSON-RPC envelope",
    "+ one shared-data get, the clock",
    "+ reads the response header map and upstream.address",
    "+ holds the response body until complete, copies and parses it, the clock",
    "+ holds the response headers",
    "+ marks the request with the cut-off reply (a 400 B request header set while the answer is read)",
    "+ sets a request header while the request headers are read (the shared routes' cluster)",
];

/// The whole suite, as written to results.json.
#[derive(Debug, Serialize)]
pub struct Dataplane {
    pub pinning: String,
    pub connections: u32,
    pub wrk_threads: u32,
    pub reps: usize,
    pub secs_per_run: u64,
    pub warmup_secs: u64,
    pub goal: String,
    pub workloads: Vec<WorkloadResult>,
    /// The profile per workload measured (see [`Options::profile_workloads`]).
    pub profiles: Vec<Profile>,
    /// Runs with errors, or fewer calls at the lab than wrk completed.
    pub anomalies: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct WorkloadResult {
    pub name: String,
    pub request_bytes: usize,
    pub response: &'static str,
    /// Response bytes per request as wrk counted them (headers included), through (b).
    pub response_bytes: f64,
    /// Request headers besides `Content-Type` and `Accept`.
    pub request_headers: Vec<String>,
    pub variants: Vec<VariantResult>,
    /// Requests/s, paired per repetition.
    pub c_over_b: Spread,
    pub d_over_b: Spread,
    pub c_over_d: Spread,
    /// Envoy's own MCP filter against Envoy alone, and the toolgate filter against it.
    pub e_over_b: Spread,
    pub c_over_e: Spread,
    /// This workload's goal, e.g. `(c)/(b) >= 0.78 and > (e)/(b)`.
    pub goal: String,
    /// The goal, on the medians of the paired ratios.
    pub goal_met: bool,
    /// That Envoy's MCP filter in (e) parsed the request bodies.
    pub native_parse: NativeParse,
}

/// What shows that Envoy's MCP filter (variant (e)) parsed this workload's request bodies. In
/// its default (pass-through) mode its counters (`http.toolgate.mcp.*`) count only problems,
/// so the proof is a problem it can find only in the body: the workload's request sent once,
/// before the runs, with an `Mcp-Name` that is not the body's tool name.
#[derive(Debug, Serialize)]
pub struct NativeParse {
    /// `header_mismatch` moved by one on that request: the filter read the tool name out of
    /// the body (sent with the same `Content-Type` and `Accept` as the measured requests).
    pub header_mismatch_on_wrong_name: u64,
    /// The filter's counters, moved during the measured runs: all 0, so no measured request
    /// was invalid JSON, above its body limit (8 KiB) or refused.
    pub counters_moved_during_runs: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub struct VariantResult {
    pub variant: String,
    pub label: String,
    pub rps: Spread,
    pub p50_ms: Spread,
    pub p99_ms: Spread,
    pub p999_ms: Spread,
    /// Envoy's CPU time (all threads) per request, microseconds.
    pub envoy_cpu_us_per_req: Option<Spread>,
    /// The lab server's CPU time per request, microseconds.
    pub lab_cpu_us_per_req: Spread,
    /// Busy percent of each core during the runs.
    pub core_busy_pct: Vec<Spread>,
    /// CPU of processes the bench did not start during the runs, percent of one core.
    pub foreign_load_pct: Spread,
    pub runs: Vec<Run>,
}

/// Where the toolgate filter's time goes: Envoy CPU per request with the probe filter at each
/// level, next to (b), (d) and (c), alternating in one run.
#[derive(Debug, Serialize)]
pub struct Profile {
    pub workload: String,
    pub reps: usize,
    pub rows: Vec<ProfileRow>,
}

#[derive(Debug, Serialize)]
pub struct ProfileRow {
    pub result: VariantResult,
    /// Envoy CPU µs/request minus that of the row before, paired per repetition.
    pub delta_us: Option<Spread>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub rep: usize,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub requests: u64,
    pub errors: u64,
    pub lab_calls: u64,
    pub response_bytes: f64,
    pub envoy_cpu_us_per_req: Option<f64>,
    pub lab_cpu_us_per_req: f64,
    pub core_busy_pct: Vec<f64>,
    /// CPU used by processes the bench did not start, percent of one core.
    pub foreign_load_pct: f64,
    /// Time the hypervisor gave our vCPUs to others, percent of one core.
    pub steal_pct: f64,
    /// Measured again while `foreign_load_pct` was above the limit.
    pub attempts: usize,
    pub quiet_wait_secs: f64,
}

/// What the generated Lua `done()` prints.
#[derive(Debug, Deserialize)]
pub(crate) struct WrkOut {
    pub(crate) requests: f64,
    pub(crate) duration_us: f64,
    bytes: f64,
    pub(crate) connect: f64,
    pub(crate) read: f64,
    pub(crate) write: f64,
    pub(crate) status: f64,
    pub(crate) timeout: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
}

pub(crate) const WRK_THREADS: u32 = 1;
pub(crate) const CLIENT_CORE: &str = "0";
pub(crate) const ENVOY_CORE: &str = "1";

/// One thing wrk is pointed at.
pub(crate) struct Target<'a> {
    pub(crate) key: String,
    pub(crate) label: String,
    pub(crate) url: String,
    pub(crate) script: PathBuf,
    pub(crate) envoy: Option<&'a Envoy>,
}

/// Which processes go on which core, re-applied and checked before measuring.
pub(crate) struct Pinning<'a> {
    pub(crate) on: bool,
    pub(crate) envoys: Vec<&'a Envoy>,
    pub(crate) labs: Vec<&'a McpServer>,
}

impl Pinning<'_> {
    pub(crate) fn apply_and_check(&self) -> anyhow::Result<()> {
        if !self.on {
            return Ok(());
        }
        for e in &self.envoys {
            // Threads Envoy starts later (the wasm VMs' helpers) inherit the core from their
            // parents; pinning again costs nothing and the check below proves it.
            pin(pid_of(e)?, ENVOY_CORE)?;
            let a = affinity(pid_of(e)?);
            if a != [ENVOY_CORE] {
                bail!("{} threads are not all on core {ENVOY_CORE}: {a:?}", e.name);
            }
        }
        for lab in &self.labs {
            let a = affinity(lab.proc.pid());
            if a != [CLIENT_CORE] {
                bail!(
                    "{} threads are not all on core {CLIENT_CORE}: {a:?}",
                    lab.instance_id
                );
            }
        }
        Ok(())
    }
}

pub async fn run(env: &TestEnv, cores: usize, opts: &Options) -> anyhow::Result<Dataplane> {
    for wasm in [
        Some(&opts.noop_filter),
        Some(&opts.toolgate_filter),
        opts.probe_filter.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        if !wasm.exists() {
            bail!(
                "{} is missing: run `make build` and build bench/noop-filter \
                 (cargo build --release -p toolgate-noop-filter --target wasm32-wasip1 --lib --examples)",
                wasm.display()
            );
        }
    }
    let pinned = cores >= 2;
    let own_pid = std::process::id() as i32;
    let own_affinity = affinity(own_pid).join(",");
    if pinned {
        // Everything started from here on (etcd, toolgate-xds, labs, wrk) inherits core 0;
        // the Envoys are moved to core 1 once they run.
        pin(own_pid, CLIENT_CORE)?;
    }
    let result = measure(env, pinned, opts).await;
    if pinned && !own_affinity.is_empty() {
        let _ = pin(own_pid, &own_affinity);
    }
    result
}

async fn measure(env: &TestEnv, pinned: bool, opts: &Options) -> anyhow::Result<Dataplane> {
    let etcd = Etcd::start(env).await;
    let xds = Xds::start(env, "xds", &etcd.endpoint(), &[]).await;
    let lab_json = McpServer::lab(env, "lab-json", &["--stateless", "--json-response"]).await;
    let lab_sse = McpServer::lab(env, "lab-sse", &["--stateless"]).await;
    let mut client = etcd.client().await;
    for (service, lab) in [("bench-json", &lab_json), ("bench-sse", &lab_sse)] {
        let mut value = serde_json::json!({
            "instance_id": lab.instance_id,
            "endpoint": lab.endpoint(),
            "tools": ["read_order", "write_order", "echo"],
        });
        if service == "bench-json" {
            // The revisions the lab speaks (rmcp), newest first: the filter decides from the
            // 2026-07-28 workload's headers only for instances known to speak it.
            value["protocol_versions"] = serde_json::json!([REV_2026, "2025-11-25"]);
        }
        let value = value.to_string();
        client
            .put(
                format!("/mcp/services/{service}/{}", lab.instance_id),
                value,
                None,
            )
            .await?;
    }
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let (toolgate, noop) = (path(&opts.toolgate_filter), path(&opts.noop_filter));
    let plain = Envoy::start_with(env, "envoy-plain", &xds, 1, &[]).await;
    let with_toolgate =
        Envoy::start_with(env, "envoy-toolgate", &xds, 1, &["--filter", &toolgate]).await;
    // A wasm filter other than toolgate's names no cluster for the shared routes: those Envoys
    // route per service, as an Envoy without a filter does. The toolgate filter's figures
    // include its shared routes (the header it sets, Envoy's second route pick).
    let with_noop = Envoy::start_with(
        env,
        "envoy-noop",
        &xds,
        1,
        &["--filter", &noop, "--route-table", "per-service"],
    )
    .await;
    let with_native =
        Envoy::start_with(env, "envoy-native", &xds, 1, &["--native-mcp-filter"]).await;
    let with_probe = match &opts.probe_filter {
        Some(p) => {
            let flags = ["--filter", &path(p), "--route-table", "per-service"];
            Some(Envoy::start_with(env, "envoy-probe", &xds, 1, &flags).await)
        }
        None => None,
    };
    let pinning = Pinning {
        on: pinned,
        envoys: [
            Some(&plain),
            Some(&with_toolgate),
            Some(&with_noop),
            Some(&with_native),
            with_probe.as_ref(),
        ]
        .into_iter()
        .flatten()
        .collect(),
        labs: vec![&lab_json, &lab_sse],
    };
    pinning.apply_and_check()?;

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()?;
    let mut anomalies = Vec::new();
    let mut workloads = Vec::new();
    for w in WORKLOADS
        .iter()
        .filter(|w| opts.workloads.is_empty() || opts.workloads.iter().any(|k| k == w.key))
    {
        let (lab, service) = if w.sse {
            (&lab_sse, "bench-sse")
        } else {
            (&lab_json, "bench-json")
        };
        let body = w.body();
        if body.len() != w.body_bytes {
            bail!(
                "{}: the body is {} bytes, not {}",
                w.name,
                body.len(),
                w.body_bytes
            );
        }
        let headers = w.headers();
        let script = env.path(&format!("wrk-{}.lua", w.key));
        std::fs::write(&script, lua_script(&body, &headers))?;
        let targets: Vec<Target> = [
            ("a", "direct to the lab", None),
            ("b", "Envoy, no filter", Some(&plain)),
            ("c", "Envoy + toolgate filter", Some(&with_toolgate)),
            ("d", "Envoy + no-op wasm filter", Some(&with_noop)),
            ("e", "Envoy + Envoy's MCP filter", Some(&with_native)),
        ]
        .into_iter()
        .map(|(key, label, envoy)| Target {
            key: key.into(),
            label: label.into(),
            url: envoy.map_or_else(|| lab.mcp_url(), |e| e.url(service)),
            script: script.clone(),
            envoy,
        })
        .collect();
        for t in &targets {
            check_call(&http, &t.url, &body, &headers, w.sse)
                .await
                .with_context(|| format!("{}: variant ({}) {}", w.name, t.key, t.label))?;
        }
        let header_mismatch = native_mismatch_proof(&http, &with_native, service, &body)
            .await
            .with_context(|| format!("{}: variant (e), Envoy's MCP filter", w.name))?;
        let before = native_counters(&http, &with_native).await?;
        let runs = alternate(w.name, &targets, opts.reps, opts, lab, &pinning).await?;
        let after = native_counters(&http, &with_native).await?;
        let moved: BTreeMap<String, u64> = after
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.saturating_sub(before.get(k).copied().unwrap_or(0)),
                )
            })
            .collect();
        for (k, v) in moved.iter().filter(|(_, v)| **v > 0) {
            anomalies.push(format!(
                "{} (e): Envoy's MCP filter counted {v} {k} during the runs",
                w.name
            ));
        }
        anomalies.extend(find_anomalies(w.name, &targets, &runs));
        let native_parse = NativeParse {
            header_mismatch_on_wrong_name: header_mismatch,
            counters_moved_during_runs: moved,
        };
        workloads.push(summarize_workload(w, &targets, runs, native_parse));
    }

    let mut profiles = Vec::new();
    for w in WORKLOADS.iter().filter(|w| {
        with_probe.is_some() && !w.sse && opts.profile_workloads.iter().any(|k| k == w.key)
    }) {
        let Some(probe) = &with_probe else { break };
        let profile = {
            let headers = w.headers();
            let body = w.body();
            let plain_script = env.path(&format!("wrk-profile-{}.lua", w.key));
            std::fs::write(&plain_script, lua_script(&body, &headers))?;
            let mut targets: Vec<Target> = [
                ("b", "Envoy, no filter", &plain),
                ("d", "Envoy + no-op wasm filter", &with_noop),
            ]
            .into_iter()
            .map(|(key, label, e)| Target {
                key: key.into(),
                label: label.into(),
                url: e.url("bench-json"),
                script: plain_script.clone(),
                envoy: Some(e),
            })
            .collect();
            for (level, adds) in PROBE_LEVELS.iter().enumerate().filter(|(level, _)| {
                opts.profile_levels.is_empty() || opts.profile_levels.contains(level)
            }) {
                let script = env.path(&format!("wrk-probe-{}-{level}.lua", w.key));
                let level_text = level.to_string();
                let mut with_level: Vec<(&str, &str)> = headers.clone();
                with_level.push(("x-probe", &level_text));
                std::fs::write(&script, lua_script(&body, &with_level))?;
                targets.push(Target {
                    key: format!("p{level}"),
                    label: format!("probe {level}: {adds}"),
                    url: probe.url("bench-json"),
                    script,
                    envoy: Some(probe),
                });
            }
            targets.push(Target {
                key: "c".into(),
                label: "Envoy + toolgate filter".into(),
                url: with_toolgate.url("bench-json"),
                script: plain_script.clone(),
                envoy: Some(&with_toolgate),
            });
            for t in &targets {
                check_call(&http, &t.url, &body, &headers, false)
                    .await
                    .with_context(|| format!("profile: ({}) {}", t.key, t.label))?;
            }
            let name = format!("profile {}", w.name);
            let runs = alternate(
                &name,
                &targets,
                opts.profile_reps,
                opts,
                &lab_json,
                &pinning,
            )
            .await?;
            anomalies.extend(find_anomalies(&name, &targets, &runs));
            let mut rows: Vec<ProfileRow> = Vec::new();
            for (i, (t, r)) in targets.iter().zip(&runs).enumerate() {
                let delta_us = (i > 0).then(|| {
                    let cpu = |runs: &[Run]| -> Vec<f64> {
                        runs.iter()
                            .map(|r| r.envoy_cpu_us_per_req.unwrap_or(f64::NAN))
                            .collect()
                    };
                    let d: Vec<f64> = cpu(r)
                        .iter()
                        .zip(cpu(&runs[i - 1]))
                        .map(|(a, b)| a - b)
                        .collect();
                    spread(&d)
                });
                rows.push(ProfileRow {
                    result: variant_result(t, r.clone()),
                    delta_us,
                });
            }
            Profile {
                workload: w.name.to_string(),
                reps: opts.profile_reps,
                rows,
            }
        };
        profiles.push(profile);
    }

    Ok(Dataplane {
        pinning: if pinned {
            format!(
                "Envoy (--concurrency 1, all threads) on core {ENVOY_CORE} via `taskset -a -p -c {ENVOY_CORE}` after start (verified per thread); \
                 wrk (-t{WRK_THREADS}) via `taskset -c {CLIENT_CORE}`, the lab servers, etcd, toolgate-xds and the bench driver on core {CLIENT_CORE}"
            )
        } else {
            "not pinned: fewer than 2 cores".into()
        },
        connections: opts.connections,
        wrk_threads: WRK_THREADS,
        reps: opts.reps,
        secs_per_run: opts.secs,
        warmup_secs: opts.warmup_secs,
        goal: goal_text(),
        workloads,
        profiles,
        anomalies,
    })
}

/// Warms every target up, then measures them in turn, `reps` times.
async fn alternate(
    name: &str,
    targets: &[Target<'_>],
    reps: usize,
    opts: &Options,
    lab: &McpServer,
    pinning: &Pinning<'_>,
) -> anyhow::Result<Vec<Vec<Run>>> {
    eprintln!("dataplane {name}: warm-up ...");
    for t in targets {
        wrk(&t.script, &t.url, opts.warmup_secs, opts.connections).await?;
    }
    pinning.apply_and_check()?;
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    for rep in 0..reps {
        for (i, t) in targets.iter().enumerate() {
            let envoy_pid = t.envoy.map(pid_of).transpose()?;
            let run = run_once(&t.script, &t.url, opts, lab, envoy_pid, rep).await?;
            eprintln!(
                "dataplane {name} rep {}/{reps} ({}) {:>8.0} req/s  p50 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  Envoy {} µs/req{}",
                rep + 1,
                t.key,
                run.rps,
                run.p50_ms,
                run.p99_ms,
                run.p999_ms,
                run.envoy_cpu_us_per_req
                    .map_or_else(|| "–".to_string(), |c| format!("{c:.1}")),
                if run.errors > 0 {
                    format!("  {} ERRORS", run.errors)
                } else {
                    String::new()
                }
            );
            runs[i].push(run);
        }
    }
    Ok(runs)
}

pub(crate) fn find_anomalies(name: &str, targets: &[Target<'_>], runs: &[Vec<Run>]) -> Vec<String> {
    let mut out = Vec::new();
    for (t, runs) in targets.iter().zip(runs) {
        for r in runs {
            if r.errors > 0 || r.lab_calls < r.requests {
                out.push(format!(
                    "{name} ({}) rep {}: {} errors, {} requests completed, {} calls reached the lab",
                    t.key,
                    r.rep + 1,
                    r.errors,
                    r.requests,
                    r.lab_calls
                ));
            }
            if r.foreign_load_pct > MAX_FOREIGN_PCT {
                out.push(format!(
                    "{name} ({}) rep {}: other processes used {:.0}% of a core after {} attempts",
                    t.key,
                    r.rep + 1,
                    r.foreign_load_pct,
                    r.attempts
                ));
            }
            if r.steal_pct > MAX_STEAL_PCT {
                out.push(format!(
                    "{name} ({}) rep {}: the hypervisor took {:.0}% of a core (steal) after {} attempts",
                    t.key,
                    r.rep + 1,
                    r.steal_pct,
                    r.attempts
                ));
            }
        }
    }
    out
}

pub(crate) fn pid_of(e: &Envoy) -> anyhow::Result<i32> {
    e.proc
        .as_ref()
        .map(|p| p.pid())
        .with_context(|| format!("{} is not running", e.name))
}

/// A run during which processes the bench did not start used more than this share of one core
/// (other builds or tests on the machine) is measured again.
pub(crate) const MAX_FOREIGN_PCT: f64 = 10.0;
/// A run during which the hypervisor gave more than this share of one core to other guests
/// (steal time) is measured again too: on this project's machine kind steal came in bursts of
/// 20-70% that doubled a run's CPU per request.
pub(crate) const MAX_STEAL_PCT: f64 = 10.0;
/// Before a run, wait (up to `Options::quiet_wait`) until foreign load is below this share of
/// a core.
const QUIET_PCT: f64 = 10.0;

/// Load on the machine from processes the bench did not start, in percent of one core.
fn foreign_pct(cores0: &CoreTimes, own0: u64, cores1: &CoreTimes, own1: u64, secs: f64) -> f64 {
    let foreign = cores1
        .task_busy_ns(cores0)
        .saturating_sub(own1.saturating_sub(own0));
    100.0 * foreign as f64 / 1e9 / secs
}

/// Waits up to `max` for other processes to calm down; returns the seconds waited.
async fn wait_quiet(max: Duration) -> f64 {
    let t0 = Instant::now();
    if max.is_zero() {
        return 0.0;
    }
    loop {
        let (c0, o0, s0) = (core_times(), own_tree_cpu_ns(), Instant::now());
        tokio::time::sleep(Duration::from_millis(250)).await;
        let pct = foreign_pct(
            &c0,
            o0,
            &core_times(),
            own_tree_cpu_ns(),
            s0.elapsed().as_secs_f64(),
        );
        if pct < QUIET_PCT || t0.elapsed() >= max {
            return t0.elapsed().as_secs_f64();
        }
    }
}

pub(crate) async fn run_once(
    script: &Path,
    url: &str,
    opts: &Options,
    lab: &McpServer,
    envoy_pid: Option<i32>,
    rep: usize,
) -> anyhow::Result<Run> {
    let mut attempt = 0;
    let mut waited = 0.0;
    loop {
        attempt += 1;
        let max = opts.quiet_wait.min(opts.extra_budget.get());
        let w = wait_quiet(max).await;
        opts.spend(Duration::from_secs_f64(w));
        waited += w;
        let mut run = measure_once(script, url, opts, lab, envoy_pid, rep).await?;
        run.attempts = attempt;
        run.quiet_wait_secs = waited;
        let again = Duration::from_secs(opts.secs);
        let disturbed = run.foreign_load_pct > MAX_FOREIGN_PCT || run.steal_pct > MAX_STEAL_PCT;
        if !disturbed || attempt >= opts.attempts || opts.extra_budget.get() < again {
            return Ok(run);
        }
        opts.spend(again);
        eprintln!(
            "  other processes used {:.0}% of a core, the hypervisor {:.0}%, during the run: measuring again",
            run.foreign_load_pct, run.steal_pct
        );
    }
}

async fn measure_once(
    script: &Path,
    url: &str,
    opts: &Options,
    lab: &McpServer,
    envoy_pid: Option<i32>,
    rep: usize,
) -> anyhow::Result<Run> {
    let calls_before = lab.calls("echo").await;
    let lab_pid = lab.proc.pid();
    let (lab0, envoy0) = (cpu_ns(lab_pid), envoy_pid.map(cpu_ns));
    let (cores0, own0, t0) = (core_times(), own_tree_cpu_ns(), Instant::now());
    let out = wrk(script, url, opts.secs, opts.connections).await?;
    let (cores1, own1, secs) = (core_times(), own_tree_cpu_ns(), t0.elapsed().as_secs_f64());
    let (lab1, envoy1) = (cpu_ns(lab_pid), envoy_pid.map(cpu_ns));
    let lab_calls = lab.calls("echo").await - calls_before;
    let requests = out.requests.max(1.0);
    let errors = (out.connect + out.read + out.write + out.status + out.timeout) as u64;
    Ok(Run {
        rep,
        rps: out.requests / (out.duration_us / 1e6),
        p50_ms: out.p50_us / 1e3,
        p99_ms: out.p99_us / 1e3,
        p999_ms: out.p999_us / 1e3,
        max_ms: out.max_us / 1e3,
        requests: out.requests as u64,
        errors,
        lab_calls,
        response_bytes: out.bytes / requests,
        envoy_cpu_us_per_req: envoy0
            .zip(envoy1)
            .map(|(a, b)| b.saturating_sub(a) as f64 / 1e3 / requests),
        lab_cpu_us_per_req: lab1.saturating_sub(lab0) as f64 / 1e3 / requests,
        core_busy_pct: cores1.busy_percent(&cores0),
        foreign_load_pct: foreign_pct(&cores0, own0, &cores1, own1, secs),
        steal_pct: 100.0 * cores1.steal_ns(&cores0) as f64 / 1e9 / secs,
        attempts: 1,
        quiet_wait_secs: 0.0,
    })
}

pub(crate) fn variant_result(t: &Target<'_>, runs: Vec<Run>) -> VariantResult {
    let col = |f: &dyn Fn(&Run) -> f64| spread(&runs.iter().map(f).collect::<Vec<_>>());
    let n_cores = runs.first().map_or(0, |r| r.core_busy_pct.len());
    VariantResult {
        variant: t.key.clone(),
        label: t.label.clone(),
        rps: col(&|r| r.rps),
        p50_ms: col(&|r| r.p50_ms),
        p99_ms: col(&|r| r.p99_ms),
        p999_ms: col(&|r| r.p999_ms),
        envoy_cpu_us_per_req: t
            .envoy
            .is_some()
            .then(|| col(&|r| r.envoy_cpu_us_per_req.unwrap_or(f64::NAN))),
        lab_cpu_us_per_req: col(&|r| r.lab_cpu_us_per_req),
        core_busy_pct: (0..n_cores)
            .map(|c| col(&|r| r.core_busy_pct.get(c).copied().unwrap_or(f64::NAN)))
            .collect(),
        foreign_load_pct: col(&|r| r.foreign_load_pct),
        runs,
    }
}

fn summarize_workload(
    w: &Workload,
    targets: &[Target<'_>],
    runs: Vec<Vec<Run>>,
    native_parse: NativeParse,
) -> WorkloadResult {
    let rps = |key: &str| -> Vec<f64> {
        targets
            .iter()
            .position(|t| t.key == key)
            .map(|i| runs[i].iter().map(|r| r.rps).collect())
            .unwrap_or_default()
    };
    let paired = |num: &str, den: &str| -> Spread {
        let ratios: Vec<f64> = rps(num).iter().zip(rps(den)).map(|(n, d)| n / d).collect();
        spread(&ratios)
    };
    let (c_over_b, d_over_b, c_over_d) = (paired("c", "b"), paired("d", "b"), paired("c", "d"));
    let (e_over_b, c_over_e) = (paired("e", "b"), paired("c", "e"));
    // NaN (a variant missing) compares false: never met by accident.
    let goal_met = c_over_e.median >= MIN_C_OVER_E;
    let response_bytes = targets
        .iter()
        .position(|t| t.key == "b")
        .map(|i| spread(&runs[i].iter().map(|r| r.response_bytes).collect::<Vec<_>>()).median)
        .unwrap_or(f64::NAN);
    let variants = targets
        .iter()
        .zip(runs)
        .map(|(t, runs)| variant_result(t, runs))
        .collect();
    WorkloadResult {
        name: w.name.to_string(),
        request_bytes: w.body_bytes,
        response: if w.sse {
            "text/event-stream"
        } else {
            "application/json"
        },
        response_bytes,
        request_headers: w
            .headers()
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect(),
        variants,
        c_over_b,
        d_over_b,
        c_over_d,
        e_over_b,
        c_over_e,
        goal: w.goal(),
        goal_met,
        native_parse,
    }
}

/// A `tools/call` of `echo` whose body is exactly `size` bytes.
pub(crate) fn request_body(size: usize) -> String {
    let frame = |pad: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"echo","arguments":{{"pad":"{pad}"}}}}}}"#
        )
    };
    let overhead = frame("").len();
    frame(&"x".repeat(size.saturating_sub(overhead)))
}

/// The same call as a 2026-07-28 client sends it: the revision is stateless, so every request
/// carries the revision, the client and its capabilities in `params._meta` (the revision
/// requires the first and the last; the lab, rmcp, refuses the call without them). `params`
/// is laid out as the TypeScript SDK 2.x writes it (`name`, `arguments`, then `_meta`; rmcp
/// writes `_meta` first); the rest as in [`request_body`], so the two workloads differ only
/// in `_meta` and the headers. Exactly `size` bytes; sent with [`Workload::headers`].
pub(crate) fn request_body_2026(size: usize) -> String {
    let frame = |pad: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"echo","arguments":{{"pad":"{pad}"}},"_meta":{{"io.modelcontextprotocol/protocolVersion":"{REV_2026}","io.modelcontextprotocol/clientInfo":{{"name":"toolgate-bench","version":"{}"}},"io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#,
            env!("CARGO_PKG_VERSION")
        )
    };
    let overhead = frame("").len();
    frame(&"x".repeat(size.saturating_sub(overhead)))
}

/// wrk script: the POST with `headers` besides `Content-Type` and `Accept`, and a `done()`
/// that prints the figures as one JSON line.
pub(crate) fn lua_script(body: &str, headers: &[(&str, &str)]) -> String {
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("wrk.headers[\"{k}\"] = \"{v}\"\n"))
        .collect();
    format!(
        r#"wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json, text/event-stream"
{extra}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {{"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f,"p50_us":%.0f,"p99_us":%.0f,"p999_us":%.0f,"max_us":%.0f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max))
end
"#
    )
}

pub(crate) async fn wrk(
    script: &Path,
    url: &str,
    secs: u64,
    connections: u32,
) -> anyhow::Result<WrkOut> {
    let out = tokio::process::Command::new("taskset")
        .args(["-c", CLIENT_CORE, "wrk"])
        .arg(format!("-t{WRK_THREADS}"))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{secs}s"))
        .args(["--timeout", "5s", "-s"])
        .arg(script)
        .arg(url)
        .output()
        .await
        .context("running wrk (make setup installs it)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("WRKJSON "))
        .with_context(|| {
            format!(
                "wrk printed no figures for {url}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    serde_json::from_str(line).with_context(|| format!("parsing wrk output {line}"))
}

/// One call must come back 200 from the lab with the echo, before any load.
async fn check_call(
    http: &reqwest::Client,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
    sse: bool,
) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    loop {
        let mut req = http
            .post(url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await;
        if let Ok(r) = resp {
            let status = r.status().as_u16();
            let ct = r
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let text = r.text().await.unwrap_or_default();
            let want_ct = if sse {
                "text/event-stream"
            } else {
                "application/json"
            };
            if status == 200 && ct.starts_with(want_ct) && text.contains("\"instance_id\"") {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("{url} answered {status} {ct}: {text:.300}");
            }
        } else if t0.elapsed() > Duration::from_secs(30) {
            bail!("{url} did not answer: {resp:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The counters of Envoy's MCP filter in `envoy` (`http.<stat_prefix>.mcp.*`), which exist
/// from the start once the filter is in the chain.
async fn native_counters(
    http: &reqwest::Client,
    envoy: &Envoy,
) -> anyhow::Result<BTreeMap<String, u64>> {
    // `toolgate` is the bootstrap's `stat_prefix` of the connection manager.
    let prefix = "http.toolgate.mcp.";
    let url = format!(
        "{}/stats?filter=^{}",
        envoy.admin_url(),
        prefix.replace('.', "\\.")
    );
    let text = http
        .get(&url)
        .send()
        .await
        .with_context(|| url.clone())?
        .text()
        .await?;
    let counters: BTreeMap<String, u64> = text
        .lines()
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(": ")?;
            let name = name.strip_prefix(prefix)?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect();
    if counters.is_empty() {
        bail!(
            "{} has no {prefix}* counters: Envoy's MCP filter is not in its chain",
            envoy.name
        );
    }
    Ok(counters)
}

/// Sends `body` through Envoy's MCP filter once with an `Mcp-Name` that is not the tool the
/// body calls; returns how far the filter's `header_mismatch` counter moved (1 when it parsed
/// the body). The request carries the measured requests' `Content-Type` and `Accept`, the
/// two headers on which the filter decides to parse the body; it is not a `tools/call` the lab
/// serves (the lab refuses the mismatch too) and is sent outside the measured runs.
async fn native_mismatch_proof(
    http: &reqwest::Client,
    envoy: &Envoy,
    service: &str,
    body: &str,
) -> anyhow::Result<u64> {
    let mismatches = |c: &BTreeMap<String, u64>| c.get("header_mismatch").copied();
    let before = native_counters(http, envoy).await?;
    let before = mismatches(&before).context("no header_mismatch counter")?;
    http.post(envoy.url(service))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", REV_2026)
        .header("Mcp-Method", "tools/call")
        .header("Mcp-Name", "not-the-tool-in-the-body")
        .body(body.to_string())
        .send()
        .await
        .context("sending the request with a wrong Mcp-Name")?;
    let after = native_counters(http, envoy).await?;
    let moved = mismatches(&after).unwrap_or(before).saturating_sub(before);
    if moved != 1 {
        bail!(
            "Envoy's MCP filter did not find the wrong Mcp-Name (header_mismatch moved by \
             {moved}): it did not parse the body"
        );
    }
    Ok(moved)
}

impl Dataplane {
    /// The markdown table of this suite, with the ratios under it.
    pub fn markdown(&self) -> String {
        let f = |s: &Spread, prec: usize| {
            format!("{:.p$} ({:.p$}–{:.p$})", s.median, s.min, s.max, p = prec)
        };
        let mut out = String::new();
        out.push_str(&format!(
            "Data plane: wrk -t{} -c{}, {} × {} s per variant, alternating a,b,c,d,e; median (min–max). Pinning: {}.\n\n",
            self.wrk_threads, self.connections, self.reps, self.secs_per_run, self.pinning
        ));
        out.push_str("| workload | variant | req/s | p50 ms | p99 ms | p99.9 ms | Envoy CPU µs/req | core 0 / core 1 busy % | other load % |\n");
        out.push_str("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for w in &self.workloads {
            for v in &w.variants {
                let busy = v
                    .core_busy_pct
                    .iter()
                    .take(2)
                    .map(|s| format!("{:.0}", s.median))
                    .collect::<Vec<_>>()
                    .join(" / ");
                out.push_str(&format!(
                    "| {} | ({}) {} | {} | {} | {} | {} | {} | {} | {:.0} |\n",
                    w.name,
                    v.variant,
                    v.label,
                    f(&v.rps, 0),
                    f(&v.p50_ms, 3),
                    f(&v.p99_ms, 3),
                    f(&v.p999_ms, 3),
                    v.envoy_cpu_us_per_req
                        .map(|s| f(&s, 1))
                        .unwrap_or_else(|| "–".into()),
                    busy,
                    v.foreign_load_pct.max
                ));
            }
            out.push_str(&format!(
                "| {} | **ratios** (req/s, paired per rep) | (c)/(b) {} | (e)/(b) {} | (c)/(e) {} | (d)/(b) {} | (c)/(d) {} | goal {}: {} | |\n",
                w.name,
                f(&w.c_over_b, 3),
                f(&w.e_over_b, 3),
                f(&w.c_over_e, 3),
                f(&w.d_over_b, 3),
                f(&w.c_over_d, 3),
                w.goal,
                if w.goal_met { "met" } else { "MISSED" }
            ));
        }
        out.push_str(&format!(
            "\nGoal: {}. Other load: the most CPU (percent of one core) that processes the bench \
             did not start used during one run of the variant; runs above {MAX_FOREIGN_PCT}%, or with \
             more than {MAX_STEAL_PCT}% of a core stolen by the hypervisor, were \
             measured again.\n",
            self.goal
        ));
        out.push_str(
            "\n(e): Envoy's own MCP filter (`envoy.filters.http.mcp`, default configuration, in \
             the toolgate filter's place). It parsed the bodies: ",
        );
        let proofs: Vec<String> = self
            .workloads
            .iter()
            .map(|w| {
                let moved: u64 = w.native_parse.counters_moved_during_runs.values().sum();
                format!(
                    "{}: the request with a wrong `Mcp-Name` counted {} header mismatch, its \
                     counters moved by {moved} during the runs",
                    w.name, w.native_parse.header_mismatch_on_wrong_name
                )
            })
            .collect();
        out.push_str(&proofs.join("; "));
        out.push_str(".\n");
        for p in &self.profiles {
            out.push_str(&p.markdown());
        }
        if !self.anomalies.is_empty() {
            out.push_str("\nAnomalies:\n");
            for a in &self.anomalies {
                out.push_str(&format!("- {a}\n"));
            }
        }
        out
    }
}

impl Profile {
    /// Where the toolgate filter's time goes, as a markdown table.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "\nWhere the filter's time goes ({}, {} × alternating runs; the probe filter repeats the toolgate filter's work level by level; Δ = Envoy CPU µs/req minus the row above, paired per rep):\n\n",
            self.workload, self.reps
        );
        out.push_str("| variant | req/s | p50 ms | Envoy CPU µs/req | Δ µs/req |\n");
        out.push_str("| --- | ---: | ---: | ---: | ---: |\n");
        for row in &self.rows {
            let r = &row.result;
            out.push_str(&format!(
                "| ({}) {} | {:.0} ({:.0}–{:.0}) | {:.3} | {} | {} |\n",
                r.variant,
                r.label,
                r.rps.median,
                r.rps.min,
                r.rps.max,
                r.p50_ms.median,
                r.envoy_cpu_us_per_req.map_or_else(
                    || "–".to_string(),
                    |s| format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max)
                ),
                row.delta_us
                    .map_or_else(|| "–".to_string(), |s| format!("{:+.1}", s.median)),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workload_body_is_its_size_and_a_call_of_echo() {
        for w in &WORKLOADS {
            let body = w.body();
            assert_eq!(body.len(), w.body_bytes, "{}", w.key);
            let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            assert_eq!(v["method"], "tools/call", "{}", w.key);
            assert_eq!(v["params"]["name"], "echo", "{}", w.key);
            let meta = &v["params"]["_meta"];
            if w.rev_2026 {
                // What the revision requires of every request, and what its headers repeat.
                assert_eq!(meta["io.modelcontextprotocol/protocolVersion"], REV_2026);
                assert!(meta["io.modelcontextprotocol/clientCapabilities"].is_object());
                let headers = w.headers();
                assert!(headers.contains(&("MCP-Protocol-Version", REV_2026)));
                assert!(headers.contains(&("Mcp-Method", "tools/call")));
                assert!(headers.contains(&("Mcp-Name", "echo")));
            } else {
                assert!(meta.is_null(), "{}", w.key);
                assert!(w.headers().is_empty(), "{}", w.key);
            }
        }
    }

    #[test]
    fn the_goal_is_the_issues() {
        assert_eq!(MIN_C_OVER_E, 1.05);
        let text = goal_text();
        assert!(text.contains("(c)/(e) >= 1.05"), "{text}");
        assert!(WORKLOADS.iter().all(|w| w.goal() == "(c)/(e) >= 1.05"));
    }

    #[test]
    fn lua_script_sets_every_header() {
        let s = lua_script("{}", &[("Mcp-Name", "echo"), ("x-probe", "3")]);
        assert!(s.contains(r#"wrk.headers["Mcp-Name"] = "echo""#), "{s}");
        assert!(s.contains(r#"wrk.headers["x-probe"] = "3""#), "{s}");
    }
}
