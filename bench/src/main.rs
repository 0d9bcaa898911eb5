//! `toolgate-bench`: runs the benchmark suites on real processes on loopback, prints one
//! markdown table per suite and writes every figure (and the machine) to a JSON file.

mod aggregate;
mod auth;
mod dataplane;
mod failfast;
mod fleet;
mod machine;
mod plot;
mod probecost;
mod propagation;
mod removal;
mod scale;
mod stats;
mod stdio;

use std::cell::Cell;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use toolgate_tests::paths::{filter_wasm, tool_bin, workspace_root};
use toolgate_tests::TestEnv;

use crate::machine::Machine;
use crate::propagation::Propagation;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Suite {
    /// etcd write -> Envoy applied, with many instances registered.
    Propagation,
    /// tools/call throughput and latency: direct, Envoy, Envoy + toolgate filter, Envoy +
    /// no-op wasm filter, Envoy + Envoy's own MCP filter.
    Dataplane,
    /// Gateway A's breaker opens -> gateway B rejects the tool.
    Fleet,
    /// Revoke -> out of Envoy; server crash, and failing health check, -> out of rotation by
    /// the probes; crash and a wedged MCP handler with `mcp` probes.
    Removal,
    /// A hung tool: the open-circuit reply, and the toolgate filter against Envoy's outlier
    /// detection in the 10 s after it breaks.
    Failfast,
    /// 10,000 instances: memory, cold start, resync, propagation under churn.
    Scale,
    /// toolgate-xds's CPU and memory probing 1,000 instances, `http` against `mcp`.
    ProbeCost,
    /// One endpoint for every tool: `tools/list`, `resources/list` and `prompts/list` on `/mcp`
    /// at 100 services, a call and a resource read through `/mcp` against its service's route,
    /// and how fast the listing follows the fleet.
    Aggregate,
    /// Authentication: the 1 KB JSON `tools/call` with a bearer token verified by `jwt_authn` and
    /// one rule per tool, against the same filter without auth (two Envoys, ABBA pairs).
    Auth,
    /// stdio servers behind the gateway (`toolgate-register --stdio`): server-memory's
    /// `tools/call` over its pipes, through the gateway shared, per session and pooled, and
    /// through mcp-proxy; the session start with a server spawned per session.
    Stdio,
}

#[derive(Parser, Debug)]
#[command(
    name = "toolgate-bench",
    about = "toolgate's speed figures, measured side by side in one run"
)]
struct Args {
    /// Suites to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "propagation,removal,failfast,fleet,scale,probe-cost,aggregate,auth,stdio,dataplane"
    )]
    suites: Vec<Suite>,
    /// Short run (about 2 minutes, a smoke test of every suite): smaller sizes, fewer trials,
    /// two data-plane workloads (1 KB JSON, without and with the 2026-07-28 headers).
    #[arg(long)]
    quick: bool,
    /// Instance counts for the propagation suite [default: 1000,10000; quick: 200].
    #[arg(long, value_delimiter = ',')]
    instances: Option<Vec<usize>>,
    /// Scale suite: instance counts, ten per service, comma-separated [default: 10000,100000;
    /// quick: 1000].
    #[arg(long, value_delimiter = ',')]
    scale_instances: Option<Vec<usize>>,
    /// Single changes measured per instance count [default: 200; quick: 50].
    #[arg(long)]
    changes: Option<usize>,
    /// Data plane, aggregate, auth and stdio: repetitions of each variant [default: data
    /// plane 5, aggregate 8, auth 10, stdio 5; quick: 2, stdio 1].
    #[arg(long)]
    reps: Option<usize>,
    /// Data plane, aggregate, auth and stdio: seconds per run [default: 5; quick: 2].
    #[arg(long)]
    secs: Option<u64>,
    /// Data plane and stdio: connections (calls in flight).
    #[arg(long, default_value_t = 16)]
    connections: u32,
    /// Data plane and the auth breakdown: the do-nothing wasm filter (bench/noop-filter built
    /// for wasm32-wasip1).
    #[arg(long)]
    noop_filter: Option<PathBuf>,
    /// Auth suite: with the auth configuration's `cache_verified_tokens` off (Envoy checks
    /// every token's signature; the default configuration caches verified tokens).
    #[arg(long)]
    auth_no_token_cache: bool,
    /// Data plane: skip the profile of the toolgate filter (the probe filter levels; never run
    /// in quick mode).
    #[arg(long)]
    no_profile: bool,
    /// Data plane: repetitions of each profile variant [default: 3].
    #[arg(long)]
    profile_reps: Option<usize>,
    /// Data plane: the probe levels the profile measures (0-9) [default: all].
    #[arg(long, value_delimiter = ',')]
    profile_levels: Vec<usize>,
    /// Data plane: the workloads the profile measures (JSON answers only) [default: 1k-json].
    #[arg(long, value_delimiter = ',', value_parser = ["1k-json", "1k-json-2026", "8k-json"])]
    profile_workloads: Vec<String>,
    /// Data plane: workloads to run [default: all].
    #[arg(long, value_delimiter = ',', value_parser = ["1k-json", "1k-json-2026", "8k-json", "1k-sse"])]
    workloads: Vec<String>,
    /// Fleet sync trials [default: 50; quick: 10].
    #[arg(long)]
    fleet_trials: Option<usize>,
    /// Probe cost: instances probed [default: 1000; quick: 200].
    #[arg(long)]
    probe_instances: Option<usize>,
    /// Probe cost: seconds each probe kind is measured [default: 60; quick: 10].
    #[arg(long)]
    probe_window: Option<u64>,
    /// Where to write the figures as JSON.
    #[arg(long, default_value = "bench/results.json")]
    json: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine = Machine::detect(&tool_bin("envoy"));
    eprintln!("machine: {}", machine.describe());
    let mut report = serde_json::json!({
        "machine": machine,
        "mode": if args.quick { "quick" } else { "full" },
    });

    if args.suites.contains(&Suite::Propagation) {
        let instances = args.instances.clone().unwrap_or_else(|| {
            if args.quick {
                vec![200]
            } else {
                vec![1000, 10_000]
            }
        });
        let changes = args.changes.unwrap_or(if args.quick { 50 } else { 200 });
        let mut results = Vec::new();
        for &n in &instances {
            eprintln!("propagation with {n} instances ...");
            let env = TestEnv::new(&format!("bench_propagation_{n}"));
            results.push(propagation::run(&env, n, changes).await?);
        }
        println!("{}", propagation_table(&results));
        let mut series = Vec::new();
        for r in &results {
            series.push((
                format!("etcd put->watch, {}", r.instances),
                r.etcd_floor.samples_ms.clone(),
            ));
            series.push((
                format!("add, {} instances", r.instances),
                r.add.samples_ms.clone(),
            ));
            series.push((
                format!("remove, {} instances", r.instances),
                r.remove.samples_ms.clone(),
            ));
        }
        draw("propagation", "etcd write -> Envoy applied", &series);
        report["propagation"] = serde_json::to_value(&results)?;
    }

    if args.suites.contains(&Suite::Removal) {
        let (revokes, crashes, unhealthy) = if args.quick { (5, 2, 2) } else { (50, 10, 10) };
        eprintln!(
            "removal: {revokes} revokes, {crashes} crashes, {unhealthy} failing health checks ..."
        );
        let env = TestEnv::new("bench_removal");
        let r = removal::run(&env, revokes, crashes, unhealthy).await?;
        println!(
            "| suite | revoke -> out of Envoy p50 / p99 / max (n) | crash (SIGKILL, lease alive) -> out of rotation p50 / p99 / max (n) | health failing -> SUSPECT (draining) p50 / p99 / max (n) |\n| --- | ---: | ---: | ---: |\n| removal | {:.1} / {:.1} / {:.1} ms ({}) | {:.0} / {:.0} / {:.0} ms ({}) | {:.0} / {:.0} / {:.0} ms ({}) |\n",
            r.revoke.p50_ms, r.revoke.p99_ms, r.revoke.max_ms, r.revoke.n,
            r.crash.p50_ms, r.crash.p99_ms, r.crash.max_ms, r.crash.n,
            r.unhealthy.p50_ms, r.unhealthy.p99_ms, r.unhealthy.max_ms, r.unhealthy.n,
        );
        println!(
            "revoke -> out of Envoy p99 {:.1} ms: goal <= {REVOKE_GOAL_MS:.0} ms {}\n",
            r.revoke.p99_ms,
            verdict(r.revoke.p99_ms <= REVOKE_GOAL_MS)
        );
        println!(
            "| crash (SIGKILL, lease alive) -> out of rotation | p50 / p99 / max (n) | goal p99 <= {:.0} s |\n| --- | ---: | --- |\n| registrar watching its server (default) | {:.0} / {:.0} / {:.0} ms ({}) | {} |\n| registrar not watching: the prober alone (crash watch, 2 s probes) | {:.0} / {:.0} / {:.0} ms ({}) | {} |\n",
            r.crash_goal_ms / 1e3,
            r.crash.p50_ms, r.crash.p99_ms, r.crash.max_ms, r.crash.n,
            verdict(r.crash_goal_met),
            r.crash_unwatched.p50_ms, r.crash_unwatched.p99_ms, r.crash_unwatched.max_ms, r.crash_unwatched.n,
            verdict(r.crash_unwatched_goal_met),
        );
        println!(
            "restarted in place (same address, {:?} ms after the kill in turn) -> routed again, from listening: p50 {:.0} / p99 {:.0} / max {:.0} ms ({}); probes after a refusal 250 ms, 500 ms, 1 s... apart (a whole interval, 2 s, before)\n",
            r.restart_delays_ms,
            r.restart_in_place.p50_ms, r.restart_in_place.p99_ms, r.restart_in_place.max_ms, r.restart_in_place.n,
        );
        println!("{}", removal_by_probe_table(&r));
        report["removal"] = serde_json::to_value(&r)?;
        draw(
            "removal",
            "out of rotation: revoke, crash and failing health check with probes on",
            &[
                ("revoke".to_string(), r.revoke.samples_ms.clone()),
                ("crash (SIGKILL)".to_string(), r.crash.samples_ms.clone()),
                (
                    "crash, registrar not watching".to_string(),
                    r.crash_unwatched.samples_ms.clone(),
                ),
                ("health failing".to_string(), r.unhealthy.samples_ms.clone()),
                (
                    "crash, mcp probe".to_string(),
                    r.crash_mcp.samples_ms.clone(),
                ),
                (
                    "MCP wedged, mcp probe".to_string(),
                    r.wedged_mcp.samples_ms.clone(),
                ),
            ],
        );
    }

    if args.suites.contains(&Suite::Failfast) {
        let (samples, window) = if args.quick { (200, 4) } else { (2000, 10) };
        eprintln!("fail-fast ...");
        let env = TestEnv::new("bench_failfast");
        let r = failfast::run(&env, samples, Duration::from_secs(window)).await?;
        println!("{}", r.markdown());
        report["failfast"] = serde_json::to_value(&r)?;
        draw(
            "failfast",
            "a hung tool: the open-circuit reply against the route timeout",
            &[
                (
                    "open-circuit reply".to_string(),
                    r.open_reply.samples_ms.clone(),
                ),
                (
                    "without a breaker".to_string(),
                    r.without_breaker.samples_ms.clone(),
                ),
            ],
        );
    }

    if args.suites.contains(&Suite::Scale) {
        let churn_secs = if args.quick { 3 } else { 10 };
        let sizes = args.scale_instances.clone().unwrap_or_else(|| {
            if args.quick {
                vec![1000]
            } else {
                vec![10_000, 100_000]
            }
        });
        let mut results = Vec::new();
        for instances in sizes {
            eprintln!("control plane at scale: {instances} instances ...");
            let env = TestEnv::new(&format!("bench_scale_{instances}"));
            let r = scale::run(&env, instances, churn_secs).await?;
            println!("{}", r.markdown());
            draw(
                &format!("scale-{instances}"),
                &format!("propagation under churn, {} instances", r.instances),
                &[(
                    "etcd write -> Envoy applied".to_string(),
                    r.churn_propagation.samples_ms.clone(),
                )],
            );
            results.push(r);
        }
        report["scale"] = serde_json::to_value(&results)?;
    }

    if args.suites.contains(&Suite::ProbeCost) {
        let instances = args
            .probe_instances
            .unwrap_or(if args.quick { 200 } else { 1000 });
        let window = args
            .probe_window
            .unwrap_or(if args.quick { 10 } else { 60 });
        eprintln!("probe cost: {instances} instances, {window} s per probe kind ...");
        let env = TestEnv::new("bench_probe_cost");
        // Ten lab processes: enough that no one lab is the bottleneck, few enough for a
        // small machine (each carries a tenth of the instances).
        let r = probecost::run(&env, instances, 10, Duration::from_secs(window)).await?;
        println!("{}", r.markdown());
        report["probe_cost"] = serde_json::to_value(&r)?;
    }

    if args.suites.contains(&Suite::Aggregate) {
        let opts = aggregate::Options {
            services: if args.quick { 20 } else { 100 },
            tools_per_service: 10,
            list_requests: if args.quick { 300 } else { 3000 },
            reps: args.reps.unwrap_or(if args.quick { 2 } else { 8 }),
            secs: args.secs.unwrap_or(if args.quick { 2 } else { 5 }),
            trials: if args.quick { 5 } else { 20 },
        };
        eprintln!(
            "aggregate endpoint: {} services x {} tools ...",
            opts.services, opts.tools_per_service
        );
        let env = TestEnv::new("bench_aggregate");
        let r = aggregate::run(&env, &opts).await?;
        println!("{}", aggregate_table(&r));
        report["aggregate"] = serde_json::to_value(&r)?;
    }

    if args.suites.contains(&Suite::Auth) {
        let opts = auth::Options {
            reps: args.reps.unwrap_or(if args.quick { 2 } else { 10 }),
            secs: args.secs.unwrap_or(if args.quick { 2 } else { 5 }),
            warmup_secs: if args.quick { 1 } else { 2 },
            connections: args.connections,
            quiet_wait: Duration::from_secs(if args.quick { 3 } else { 30 }),
            attempts: if args.quick { 2 } else { 3 },
            extra_budget: Duration::from_secs(if args.quick { 10 } else { 180 }),
            token_cache: !args.auth_no_token_cache,
            // Where the difference goes: the same pair with the no-op wasm filter (full mode).
            noop_filter: (!args.quick).then(|| {
                args.noop_filter.clone().unwrap_or_else(|| {
                    workspace_root().join("target/wasm32-wasip1/release/toolgate_noop_filter.wasm")
                })
            }),
        };
        eprintln!(
            "auth: {} runs of each variant, {} s each ...",
            opts.reps, opts.secs
        );
        let env = TestEnv::new("bench_auth");
        let r = auth::run(&env, machine.cores, &opts).await?;
        println!("{}", r.markdown());
        report["auth"] = serde_json::to_value(&r)?;
    }

    if args.suites.contains(&Suite::Stdio) {
        let opts = stdio::Options {
            reps: args.reps.unwrap_or(if args.quick { 1 } else { 5 }),
            secs: args.secs.unwrap_or(if args.quick { 2 } else { 5 }),
            warmup_secs: if args.quick { 1 } else { 2 },
            in_flight: args.connections as usize,
            session_starts: if args.quick { 10 } else { 50 },
        };
        eprintln!(
            "stdio servers: {} runs of each variant, {} s each ...",
            opts.reps, opts.secs
        );
        let env = TestEnv::new("bench_stdio");
        let r = stdio::run(&env, &opts).await?;
        println!("{}", r.markdown());
        report["stdio"] = serde_json::to_value(&r)?;
    }

    if args.suites.contains(&Suite::Fleet) {
        let trials = args
            .fleet_trials
            .unwrap_or(if args.quick { 10 } else { 50 });
        eprintln!("fleet sync, {trials} trials ...");
        let env = TestEnv::new("bench_fleet");
        let r = fleet::run(&env, trials).await?;
        println!(
            "| suite | trials | A open -> B rejects p50 / p99 / max | goal p99 <= {FLEET_SYNC_GOAL_MS:.0} ms |\n| --- | ---: | ---: | --- |\n| fleet sync | {} | {:.1} / {:.1} / {:.1} ms | {} |\n",
            r.a_open_to_b_rejects.n,
            r.a_open_to_b_rejects.p50_ms,
            r.a_open_to_b_rejects.p99_ms,
            r.a_open_to_b_rejects.max_ms,
            verdict(r.a_open_to_b_rejects.p99_ms <= FLEET_SYNC_GOAL_MS),
        );
        println!(
            "| suite | trials | override PUT -> filter has it p50 / p99 / max | of which the PUT (etcd) p50 / p99 | services added meanwhile | goal p99 <= {OVERRIDE_GOAL_MS:.0} ms |\n| --- | ---: | ---: | ---: | ---: | --- |\n| override under churn | {} | {:.1} / {:.1} / {:.1} ms | {:.1} / {:.1} ms | {} | {} |\n",
            r.override_to_filter.n,
            r.override_to_filter.p50_ms,
            r.override_to_filter.p99_ms,
            r.override_to_filter.max_ms,
            r.override_put_answered.p50_ms,
            r.override_put_answered.p99_ms,
            r.services_added,
            verdict(r.override_to_filter.p99_ms <= OVERRIDE_GOAL_MS),
        );
        report["fleet"] = serde_json::to_value(&r)?;
        draw(
            "fleet",
            "gateway A's breaker opens -> gateway B rejects",
            &[
                (
                    "A open -> B rejects".to_string(),
                    r.a_open_to_b_rejects.samples_ms.clone(),
                ),
                (
                    "override PUT -> filter, services added meanwhile".to_string(),
                    r.override_to_filter.samples_ms.clone(),
                ),
            ],
        );
    }

    if args.suites.contains(&Suite::Dataplane) {
        let opts = dataplane::Options {
            reps: args.reps.unwrap_or(if args.quick { 2 } else { 5 }),
            secs: args.secs.unwrap_or(if args.quick { 2 } else { 5 }),
            warmup_secs: if args.quick { 1 } else { 2 },
            connections: args.connections,
            noop_filter: args.noop_filter.clone().unwrap_or_else(|| {
                workspace_root().join("target/wasm32-wasip1/release/toolgate_noop_filter.wasm")
            }),
            toolgate_filter: filter_wasm(),
            probe_filter: (!args.quick && !args.no_profile).then(|| {
                workspace_root().join("target/wasm32-wasip1/release/examples/probe_filter.wasm")
            }),
            profile_reps: args
                .profile_reps
                .unwrap_or_else(|| args.reps.map_or(3, |r| r.min(3))),
            profile_levels: args.profile_levels.clone(),
            profile_workloads: if args.profile_workloads.is_empty() {
                vec!["1k-json".to_string()]
            } else {
                args.profile_workloads.clone()
            },
            quiet_wait: Duration::from_secs(if args.quick { 3 } else { 60 }),
            attempts: if args.quick { 2 } else { 4 },
            extra_budget: Cell::new(Duration::from_secs(if args.quick { 12 } else { 900 })),
            // Quick mode is a smoke test of every suite: the 1 KB JSON call, as clients before
            // and since 2026-07-28 send it, is enough for that.
            workloads: if args.workloads.is_empty() && args.quick {
                vec!["1k-json".to_string(), "1k-json-2026".to_string()]
            } else {
                args.workloads.clone()
            },
        };
        let env = TestEnv::new("bench_dataplane");
        let result = dataplane::run(&env, machine.cores, &opts).await?;
        println!("Machine: {}.\n", machine.describe());
        println!("{}", result.markdown());
        report["dataplane"] = serde_json::to_value(&result)?;
    }

    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)?;
    eprintln!("figures written to {}", args.json.display());
    Ok(())
}

/// Writes `bench/out/<name>.png`; a plot that cannot be drawn is reported, not fatal.
fn draw(name: &str, title: &str, series: &[(String, Vec<f64>)]) {
    let dir = workspace_root().join("bench/out");
    let path = dir.join(format!("{name}.png"));
    let res = std::fs::create_dir_all(&dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| plot::cdf(&path, title, series));
    match res {
        Ok(()) => eprintln!("  plot: {}", path.display()),
        Err(e) => eprintln!("  no plot for {name}: {e:#}"),
    }
}

/// The aggregate endpoint's figures against their goals.
fn aggregate_table(r: &aggregate::AggregateBench) -> String {
    format!(
        "| aggregate endpoint ({} services, {} tools) | measured | goal | |\n| --- | ---: | ---: | --- |\n\
         | tools/list page on /mcp p50 / p99 ({}) | {:.2} / {:.2} ms | p99 <= 2 ms | {} |\n\
         | requests reaching a server during the lists | {} | 0 | {} |\n\
         | tools/call through /mcp / on its route, median of back-to-back pairs (rps {:.0} / {:.0}) | {:.2} | >= 0.95 | {} |\n\
         | Envoy CPU per call, /mcp / its route | {:.1} / {:.1} µs | | |\n\
         | resources/list page on /mcp p50 / p99 ({} requests, {} resources) | {:.2} / {:.2} ms | p99 <= 2 ms | {} |\n\
         | prompts/list page on /mcp p50 / p99 ({} requests, {} prompts) | {:.2} / {:.2} ms | p99 <= 2 ms | {} |\n\
         | requests reaching a server during those lists | {} | 0 | {} |\n\
         | resources/read through /mcp / on its route, median of back-to-back pairs (rps {:.0} / {:.0}) | {:.2} | >= 0.95 | {} |\n\
         | new service -> listed with definitions p50 / p99 ({}) | {:.0} / {:.0} ms | p99 <= 1000 ms | {} |\n\
         | breaker opened -> annotated p50 / p99 ({}) | {:.0} / {:.0} ms | p99 <= 1000 ms | {} |\n",
        r.services,
        r.tools,
        r.list_page.n,
        r.list_page.p50_ms,
        r.list_page.p99_ms,
        verdict(r.list_page.p99_ms <= 2.0),
        r.upstream_requests_during_lists,
        verdict(r.upstream_requests_during_lists == 0),
        r.call_median_mcp,
        r.call_median_route,
        r.call_ratio,
        verdict(r.call_ratio >= 0.95),
        r.envoy_cpu_us_mcp,
        r.envoy_cpu_us_route,
        r.resources_page.n,
        r.resources,
        r.resources_page.p50_ms,
        r.resources_page.p99_ms,
        verdict(r.resources_page.p99_ms <= 2.0),
        r.prompts_page.n,
        r.prompts,
        r.prompts_page.p50_ms,
        r.prompts_page.p99_ms,
        verdict(r.prompts_page.p99_ms <= 2.0),
        r.upstream_requests_during_surface_lists,
        verdict(r.upstream_requests_during_surface_lists == 0),
        r.read_median_mcp,
        r.read_median_route,
        r.read_ratio,
        verdict(r.read_ratio >= 0.95),
        r.new_service_listed.n,
        r.new_service_listed.p50_ms,
        r.new_service_listed.p99_ms,
        verdict(r.new_service_listed.p99_ms <= 1000.0),
        r.breaker_annotated.n,
        r.breaker_annotated.p50_ms,
        r.breaker_annotated.p99_ms,
        verdict(r.breaker_annotated.p99_ms <= 1000.0),
    )
}

/// Crash and a wedged MCP handler -> out of rotation, by probe kind, with its goal.
fn removal_by_probe_table(r: &removal::Removal) -> String {
    let goal = if r.crash_mcp_goal_met {
        "met"
    } else {
        "MISSED"
    };
    let http_wedge = if r.wedged_http_left_rotation {
        format!(
            "left rotation after {:.0} ms (unexpected: /health still answered)",
            r.wedged_http_watched_ms
        )
    } else {
        format!(
            "never leaves rotation (/health still answers; watched {:.0} s)",
            r.wedged_http_watched_ms / 1e3
        )
    };
    format!(
        "| out of rotation, by probe kind | http probe p50 / p99 / max (n) | mcp probe p50 / p99 / max (n) | goal |\n\
         | --- | ---: | ---: | --- |\n\
         | crash (SIGKILL, lease alive) | {:.0} / {:.0} / {:.0} ms ({}) | {:.0} / {:.0} / {:.0} ms ({}) | mcp p99 < {:.0} s: {goal} |\n\
         | MCP handler wedged (/health 200) | {http_wedge} | {:.0} / {:.0} / {:.0} ms ({}) | |\n",
        r.crash.p50_ms,
        r.crash.p99_ms,
        r.crash.max_ms,
        r.crash.n,
        r.crash_mcp.p50_ms,
        r.crash_mcp.p99_ms,
        r.crash_mcp.max_ms,
        r.crash_mcp.n,
        r.crash_mcp_goal_ms / 1e3,
        r.wedged_mcp.p50_ms,
        r.wedged_mcp.p99_ms,
        r.wedged_mcp.max_ms,
        r.wedged_mcp.n,
    )
}

/// Issue 22's control-plane goals (make bench, one run).
const FLEET_SYNC_GOAL_MS: f64 = 50.0;
/// An operator's override (or rule) reaches the filter under delta xDS, while services are
/// being added.
const OVERRIDE_GOAL_MS: f64 = 100.0;
const REVOKE_GOAL_MS: f64 = 10.0;
/// etcd write -> Envoy applied: p99 at 1,000 instances, p50 at 10,000.
const WRITE_APPLIED_P99_AT_1K_MS: f64 = 10.0;
const WRITE_APPLIED_P50_AT_10K_MS: f64 = 5.0;
/// A new service at 10,000 instances -> routed (p99 of single new services).
const NEW_SERVICE_AT_10K_MS: f64 = 50.0;

/// The goals a propagation run at this size is held to, with verdicts; empty for sizes that
/// have none.
fn propagation_goals(r: &Propagation) -> String {
    let worst = |f: fn(&crate::stats::Summary) -> f64| f(&r.add).max(f(&r.remove));
    match r.instances {
        1000 => format!(
            "add/remove p99 <= {WRITE_APPLIED_P99_AT_1K_MS:.0} ms: {}",
            verdict(worst(|s| s.p99_ms) <= WRITE_APPLIED_P99_AT_1K_MS)
        ),
        10_000 => format!(
            "add/remove p50 <= {WRITE_APPLIED_P50_AT_10K_MS:.0} ms: {}; new service p99 <= {NEW_SERVICE_AT_10K_MS:.0} ms: {}",
            verdict(worst(|s| s.p50_ms) <= WRITE_APPLIED_P50_AT_10K_MS),
            verdict(r.new_service.p99_ms <= NEW_SERVICE_AT_10K_MS)
        ),
        _ => String::new(),
    }
}

fn propagation_table(results: &[Propagation]) -> String {
    let mut out = String::from(
        "| suite | instances | etcd put->watch p50 / p99 (floor) | add p50 / p99 / max | remove p50 / p99 / max | new service p50 / p99 | burst of 45 in a new service (etcd's part) | goals |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in results {
        out.push_str(&format!(
            "| propagation | {} | {:.2} / {:.2} ms | {:.2} / {:.2} / {:.2} ms | {:.2} / {:.2} / {:.2} ms | {:.1} / {:.1} ms | {:.1} ms ({:.1} ms) | {} |\n",
            r.instances,
            r.etcd_floor.p50_ms,
            r.etcd_floor.p99_ms,
            r.add.p50_ms,
            r.add.p99_ms,
            r.add.max_ms,
            r.remove.p50_ms,
            r.remove.p99_ms,
            r.remove.max_ms,
            r.new_service.p50_ms,
            r.new_service.p99_ms,
            r.burst_45_ms,
            r.burst_45_etcd_ms,
            propagation_goals(r),
        ));
    }
    out
}

/// How a figure compares with its goal, as every table prints it.
fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}
