//! The speed goal of the data plane with authentication (Envoy's `jwt_authn` verifying a
//! bearer token, the toolgate filter reading the verified payload and applying one rule per
//! tool) against the same filter without an auth configuration, on the 1 KB JSON `tools/call`
//! workload of the data-plane suite. Goal: throughput with auth / without >= 0.90, as the
//! median of back-to-back pairs.
//!
//! The auth configuration is global to a control plane, so the two variants are two Envoys
//! side by side (as in the data-plane suite), each with the toolgate filter and its own
//! toolgate-xds: both control planes read the same etcd, under two key prefixes holding the
//! same registration of the same lab server; only the auth Envoy's prefix has `auth/config`
//! and `auth/rules/<service>`. The bootstrap and the filter chain are the same for both
//! (`jwt_authn` is always in the chain; without a configuration its ECDS resource does
//! nothing), so what differs is what turning auth on adds. Both are measured before the auth
//! configuration is written (they must serve an unauthenticated call alike), then the
//! configuration and rules are written and the suite waits until the auth Envoy answers a
//! valid token, refuses a call without one (401) and refuses a caller no rule grants.
//!
//! The runs alternate in ABBA pairs (without, with; with, without; ...): a machine drifting
//! during the run weighs on both sides alike, and each pair's ratio is taken from two runs
//! back to back. The agent reuses one RS256 token for every call, as an agent does until it
//! expires; the variant without auth sends no token, as a client of a gateway without auth
//! does. Pinning, the wait for a quiet machine and the measurement of Envoy's CPU per call
//! are the data-plane suite's.
//!
//! The breakdown (full mode) adds the same pair with the do-nothing wasm filter in the
//! toolgate filter's place (the bootstrap puts `jwt_authn` before whichever filter is
//! given): its difference is what `jwt_authn` and the token cost Envoy alone, and the rest
//! of the toolgate pair's difference is the filter's own auth work. The four runs of a
//! repetition go toolgate without, with, no-op without, with, and the next repetition the
//! other way round, so each goal pair is still back to back.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::{json, Value};
use toolgate_tests::{filter_wasm, Envoy, Etcd, Issuer, McpServer, TestEnv, Xds};

use crate::dataplane::{
    self, find_anomalies, lua_script, pid_of, request_body, run_once, variant_result, wrk, Pinning,
    Run, Target, VariantResult, CLIENT_CORE, ENVOY_CORE, MAX_FOREIGN_PCT, WRK_THREADS,
};
use crate::machine::{affinity, pin};
use crate::stats::{spread, Spread};

/// The goal, never to be loosened.
pub const GOAL_RATIO: f64 = 0.90;
const SERVICE: &str = "bench-json";
/// The lab's tools, each granted by a rule of its own.
const TOOLS: [&str; 3] = ["read_order", "write_order", "echo"];
const ROLE: &str = "bench";
/// The key prefix of the control plane whose Envoy requires a token.
const AUTH_PREFIX: &str = "/bench-auth/";
/// The key prefix of the control plane whose Envoy also exchanges each caller's token for
/// the server's credential (RFC 8693).
const EXCHANGE_PREFIX: &str = "/bench-exchange/";
/// `jwt_authn`'s counter of the requests it verified (the listener's stat prefix is
/// `toolgate`).
const JWT_ALLOWED: &str = "http.toolgate.jwt_authn.allowed";
/// The key prefix of the control plane whose Envoy keeps one call limit that never trips.
const LIMITS_PREFIX: &str = "/bench-limits/";
/// The goal of the limit's cost, never to be loosened: with it / without >= 0.97.
pub const LIMITS_GOAL_RATIO: f64 = 0.97;
/// The gateway's client at the issuer's token endpoint.
const EXCHANGE_CLIENT: &str = "bench-gateway";
/// The default key prefix, of the control plane whose Envoy has no auth configuration.
const OPEN_PREFIX: &str = "/mcp/";

pub struct Options {
    /// Runs of each variant (pairs), alternating ABBA.
    pub reps: usize,
    pub secs: u64,
    pub warmup_secs: u64,
    pub connections: u32,
    /// How long to wait for a quiet machine before each run.
    pub quiet_wait: Duration,
    /// Measurements of one run at most, while other processes disturb it.
    pub attempts: usize,
    /// Time the suite may spend on waiting for quiet and on measuring again.
    pub extra_budget: Duration,
    /// The do-nothing wasm filter for the breakdown; `None`: no breakdown.
    pub noop_filter: Option<PathBuf>,
    /// Sets the auth configuration's `cache_verified_tokens` (Envoy skips the signature
    /// check of a token it verified before; on by default, see `model/src/auth.rs`).
    pub token_cache: bool,
}

/// The suite, as written to results.json.
#[derive(Debug, Serialize)]
pub struct AuthBench {
    pub pinning: String,
    /// Whether Envoy's cache of verified tokens was on (`cache_verified_tokens`).
    pub token_cache: bool,
    pub workload: &'static str,
    pub request_bytes: usize,
    pub connections: u32,
    pub wrk_threads: u32,
    /// Runs of each variant; pairs alternate ABBA.
    pub reps: usize,
    pub secs_per_run: u64,
    pub warmup_secs: u64,
    /// The order of each pair (`without,with` or `with,without`).
    pub pair_order: Vec<String>,
    /// Rules in the service's rule set (one per tool; the call's tool is the last).
    pub rules: usize,
    pub token_alg: &'static str,
    pub token_bytes: usize,
    pub without_auth: VariantResult,
    pub with_auth: VariantResult,
    /// Requests/s with auth over without, per back-to-back pair.
    pub ratio: Spread,
    /// Envoy CPU µs per call with auth minus without, per pair.
    pub envoy_cpu_delta_us: Spread,
    pub goal: String,
    pub goal_met: bool,
    /// Where the difference goes (full mode), from the same pair with the no-op wasm filter.
    pub breakdown: Option<Breakdown>,
    /// The same call with the service's credential exchanged per caller, its cache warm.
    pub exchange: Option<ExchangeCost>,
    /// The call without auth, with one call limit that never trips, against `without_auth`.
    pub limits: Option<LimitsCost>,
    /// The auth Envoy's `jwt_authn` counters after the runs (token cache hits and misses,
    /// JWKS fetches, allowed and denied).
    pub jwt_authn_stats: BTreeMap<String, u64>,
    /// Runs with errors, or fewer calls at the lab than wrk completed, or disturbed runs.
    pub anomalies: Vec<String>,
}

/// The same pair with the do-nothing wasm filter, measured in the same repetitions.
#[derive(Debug, Serialize)]
pub struct Breakdown {
    pub noop_without_auth: VariantResult,
    pub noop_with_auth: VariantResult,
    /// Requests/s with auth over without, no-op filter, per pair.
    pub noop_ratio: Spread,
    /// Envoy CPU µs per call of `jwt_authn` and the token (no-op with minus without).
    pub jwt_authn_us: Spread,
    /// Envoy CPU µs per call of the toolgate filter's auth work: the toolgate pair's
    /// difference minus the no-op pair's, per repetition.
    pub filter_auth_us: Spread,
}

/// What one call limit that never trips costs per call (a rule per client: the address read,
/// one bucket taken in shared data), against the same filter without limits (paired).
#[derive(Debug, Serialize)]
pub struct LimitsCost {
    pub variant: VariantResult,
    pub rule: serde_json::Value,
    /// Requests/s with the limit over `without_auth`, per repetition.
    pub ratio_to_without: Spread,
    /// Envoy CPU µs per call with the limit minus `without_auth`, per repetition.
    pub envoy_cpu_delta_us: Spread,
    pub goal: String,
    pub goal_met: bool,
}

/// What a service whose credential is each caller's token exchanged costs per call once the
/// exchanged token is cached, against the same auth configuration without it (paired).
#[derive(Debug, Serialize)]
pub struct ExchangeCost {
    pub variant: VariantResult,
    /// Requests/s with the exchange over `with_auth`, per repetition.
    pub ratio_to_with_auth: Spread,
    /// Envoy CPU µs per call with the exchange minus `with_auth`, per repetition.
    pub envoy_cpu_delta_us: Spread,
    /// Exchanges the issuer performed in the whole suite (warm: one per caller and cache).
    pub exchanges: u64,
}

pub async fn run(env: &TestEnv, cores: usize, opts: &Options) -> anyhow::Result<AuthBench> {
    let wasm = filter_wasm();
    if !wasm.exists() {
        bail!("{} is missing: run `make build`", wasm.display());
    }
    if let Some(noop) = opts.noop_filter.as_ref().filter(|p| !p.exists()) {
        bail!(
            "{} is missing: build bench/noop-filter (make bench-filters)",
            noop.display()
        );
    }
    let pinned = cores >= 2;
    let own_pid = std::process::id() as i32;
    let own_affinity = affinity(own_pid).join(",");
    if pinned {
        // As in the data-plane suite: everything started from here on inherits core 0, the
        // Envoys are moved to core 1.
        pin(own_pid, CLIENT_CORE)?;
    }
    let result = measure(env, pinned, wasm, opts).await;
    if pinned && !own_affinity.is_empty() {
        let _ = pin(own_pid, &own_affinity);
    }
    result
}

async fn measure(
    env: &TestEnv,
    pinned: bool,
    wasm: PathBuf,
    opts: &Options,
) -> anyhow::Result<AuthBench> {
    let etcd = Etcd::start(env).await;
    let issuer = Issuer::start().await;
    let xds_open = Xds::start(env, "xds-open", &etcd.endpoint(), &[]).await;
    let xds_auth = Xds::start(
        env,
        "xds-auth",
        &etcd.endpoint(),
        &["--prefix", AUTH_PREFIX],
    )
    .await;
    let xds_exchange = Xds::start(
        env,
        "xds-exchange",
        &etcd.endpoint(),
        &["--prefix", EXCHANGE_PREFIX],
    )
    .await;
    let xds_limits = Xds::start(
        env,
        "xds-limits",
        &etcd.endpoint(),
        &["--prefix", LIMITS_PREFIX],
    )
    .await;
    let lab = McpServer::lab(env, "lab-json", &["--stateless", "--json-response"]).await;
    let mut client = etcd.client().await;
    let registration = json!({
        "instance_id": lab.instance_id,
        "endpoint": lab.endpoint(),
        "tools": TOOLS,
    })
    .to_string();
    for prefix in [OPEN_PREFIX, AUTH_PREFIX, EXCHANGE_PREFIX, LIMITS_PREFIX] {
        client
            .put(
                format!("{prefix}services/{SERVICE}/{}", lab.instance_id),
                registration.clone(),
                None,
            )
            .await?;
    }
    let wasm = wasm.to_string_lossy().into_owned();
    let open = Envoy::start_with(env, "envoy-open", &xds_open, 1, &["--filter", &wasm]).await;
    let authd = Envoy::start_with(env, "envoy-auth", &xds_auth, 1, &["--filter", &wasm]).await;
    let exchanging = Envoy::start_with(
        env,
        "envoy-exchange",
        &xds_exchange,
        1,
        &["--filter", &wasm],
    )
    .await;
    let limited =
        Envoy::start_with(env, "envoy-limits", &xds_limits, 1, &["--filter", &wasm]).await;
    let noop = match &opts.noop_filter {
        Some(p) => {
            let p = p.to_string_lossy().into_owned();
            // It names no cluster for the shared routes: routes per service (see dataplane.rs).
            let flags = ["--filter", &p, "--route-table", "per-service"];
            Some((
                Envoy::start_with(env, "envoy-noop-open", &xds_open, 1, &flags).await,
                Envoy::start_with(env, "envoy-noop-auth", &xds_auth, 1, &flags).await,
            ))
        }
        None => None,
    };
    let mut envoys = vec![&open, &authd, &exchanging, &limited];
    if let Some((a, b)) = &noop {
        envoys.extend([a, b]);
    }
    let pinning = Pinning {
        on: pinned,
        envoys,
        labs: vec![&lab],
    };
    pinning.apply_and_check()?;

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()?;
    let body = request_body(1024);
    let (open_url, auth_url) = (open.url(SERVICE), authd.url(SERVICE));
    let exchange_url = exchanging.url(SERVICE);
    // Before any auth configuration, both serve the call alike.
    for url in [&open_url, &auth_url] {
        wait_for_answer(&http, url, &body, None, Expect::Served)
            .await
            .with_context(|| format!("{url} before the auth configuration"))?;
    }

    // The gateway's resource is the auth Envoy's base URL; the issuer names no audiences, so
    // the token must name the service it is used for (RFC 8707, as MCP clients ask), which
    // the filter checks.
    let resource = auth_url
        .strip_suffix(&format!("/mcp/{SERVICE}"))
        .context("an Envoy service URL ends with /mcp/<service>")?
        .to_string();
    let config = json!({
        "resource": resource,
        "authorization_servers": [issuer.issuer()],
        "issuers": [{"issuer": issuer.issuer(), "jwks": {"remote": {"uri": issuer.jwks_uri()}}}],
        "required": ["*"],
        "cache_verified_tokens": opts.token_cache,
    });
    let rules = json!({
        "rules": TOOLS.iter().map(|t| json!({"tools": [t], "roles": [ROLE]})).collect::<Vec<_>>(),
    });
    client
        .put(
            format!("{AUTH_PREFIX}auth/config"),
            config.to_string(),
            None,
        )
        .await?;
    client
        .put(
            format!("{AUTH_PREFIX}auth/rules/{SERVICE}"),
            rules.to_string(),
            None,
        )
        .await?;
    // The exchanging Envoy: the same configuration for its own resource, and the service's
    // credential exchanged per caller at the issuer.
    let exchange_resource = exchange_url
        .strip_suffix(&format!("/mcp/{SERVICE}"))
        .context("an Envoy service URL ends with /mcp/<service>")?
        .to_string();
    let client_secret = format!("{:032x}", rand::random::<u128>());
    issuer.register_client(EXCHANGE_CLIENT, &client_secret);
    // Valid as long as the caller's token: one exchange per cache for the whole suite.
    issuer.set_exchange_lifetime(Duration::from_secs(4 * 3600));
    let secret_file = env.path("bench-exchange-client-secret");
    std::fs::write(&secret_file, &client_secret)?;
    let mut exchange_config = config.clone();
    exchange_config["resource"] = json!(exchange_resource);
    let exchange = json!({"exchange": {
        "token_endpoint": issuer.token_endpoint(),
        "audience": "urn:toolgate:bench:lab",
        "client": {"id": EXCHANGE_CLIENT, "secret": format!("file:{}", secret_file.display())}
    }});
    for (key, value) in [
        ("auth/config".to_string(), exchange_config),
        (format!("auth/rules/{SERVICE}"), rules.clone()),
        (format!("auth/upstream/{SERVICE}"), exchange),
    ] {
        client
            .put(format!("{EXCHANGE_PREFIX}{key}"), value.to_string(), None)
            .await?;
    }
    let exchange_token = issuer
        .token()
        .sub("bench-agent")
        .aud(format!("{exchange_resource}/mcp/{SERVICE}"))
        .roles([ROLE])
        .expires_in(Duration::from_secs(4 * 3600))
        .sign();
    let audience = format!("{resource}/mcp/{SERVICE}");
    // Valid for the whole suite, reused for every call.
    let token = issuer
        .token()
        .sub("bench-agent")
        .aud(audience.clone())
        .roles([ROLE])
        .expires_in(Duration::from_secs(4 * 3600))
        .sign();
    let stranger = issuer
        .token()
        .sub("someone-else")
        .aud(audience)
        .roles(["other"])
        .expires_in(Duration::from_secs(3600))
        .sign();
    let t0 = Instant::now();
    wait_for_answer(&http, &auth_url, &body, Some(&token), Expect::Served)
        .await
        .context("a valid token once the auth configuration is written")?;
    wait_for_answer(&http, &auth_url, &body, None, Expect::Unauthenticated)
        .await
        .context("no token once the auth configuration is written")?;
    wait_for_answer(&http, &auth_url, &body, Some(&stranger), Expect::ToolDenied)
        .await
        .context("a token whose roles no rule grants")?;
    wait_for_answer(&http, &open_url, &body, None, Expect::Served)
        .await
        .context("the Envoy without auth, after the auth configuration is written")?;
    wait_for_answer(
        &http,
        &exchange_url,
        &body,
        Some(&exchange_token),
        Expect::Served,
    )
    .await
    .context("a valid token at the exchanging Envoy")?;
    if issuer.exchanges() == 0 {
        bail!("the exchanging Envoy's call was served without an exchange");
    }
    // One rule on the called tool that never trips: counted by client (the address read
    // and a bucket taken on every call, the costlier kind without auth).
    let limit_rule = json!({"per": "client", "calls": 1_000_000_000u64, "per_seconds": 1});
    client
        .put(
            format!("{LIMITS_PREFIX}limits/{SERVICE}/echo"),
            limit_rule.to_string(),
            None,
        )
        .await?;
    let limits_url = limited.url(SERVICE);
    wait_for_answer(&http, &limits_url, &body, None, Expect::Served)
        .await
        .context("the Envoy with a call limit")?;
    let limit_config = wait_for_limit(&limited).await?;
    if let Some((noop_open, noop_auth)) = &noop {
        wait_for_answer(&http, &noop_open.url(SERVICE), &body, None, Expect::Served)
            .await
            .context("the no-op filter Envoy without auth")?;
        // The no-op filter refuses nothing: that jwt_authn verified the token shows in its
        // own counter of the requests it allowed.
        let before = noop_auth.stat(JWT_ALLOWED).await;
        wait_for_answer(
            &http,
            &noop_auth.url(SERVICE),
            &body,
            Some(&token),
            Expect::Served,
        )
        .await
        .context("the no-op filter Envoy with auth, a valid token")?;
        if noop_auth.stat(JWT_ALLOWED).await <= before {
            bail!("the no-op filter Envoy with auth did not verify the token ({JWT_ALLOWED} did not grow)");
        }
    }
    eprintln!(
        "auth: configuration and {} rules in force after {:.1} s",
        TOOLS.len(),
        t0.elapsed().as_secs_f64()
    );

    let open_script = env.path("wrk-auth-without.lua");
    std::fs::write(&open_script, lua_script(&body, &[]))?;
    let auth_script = env.path("wrk-auth-with.lua");
    std::fs::write(
        &auth_script,
        lua_script(&body, &[("Authorization", &format!("Bearer {token}"))]),
    )?;
    let exchange_script = env.path("wrk-auth-exchange.lua");
    std::fs::write(
        &exchange_script,
        lua_script(
            &body,
            &[("Authorization", &format!("Bearer {exchange_token}"))],
        ),
    )?;
    let mut targets = vec![
        Target {
            key: "without".into(),
            label: "toolgate filter, no auth configuration".into(),
            url: open_url.clone(),
            script: open_script,
            envoy: Some(&open),
        },
        Target {
            key: "with".into(),
            label: format!(
                "toolgate filter, jwt_authn (RS256) + {} rules, one per tool",
                TOOLS.len()
            ),
            url: auth_url.clone(),
            script: auth_script.clone(),
            envoy: Some(&authd),
        },
    ];
    if let Some((noop_open, noop_auth)) = &noop {
        targets.push(Target {
            key: "noop-without".into(),
            label: "no-op wasm filter, no auth configuration".into(),
            url: noop_open.url(SERVICE),
            script: env.path("wrk-auth-without.lua"),
            envoy: Some(noop_open),
        });
        targets.push(Target {
            key: "noop-with".into(),
            label: "no-op wasm filter, jwt_authn (RS256)".into(),
            url: noop_auth.url(SERVICE),
            script: auth_script,
            envoy: Some(noop_auth),
        });
    }

    let limits_index = targets.len();
    targets.push(Target {
        key: "limits".into(),
        label: "toolgate filter, no auth, one call limit per client that never trips".into(),
        url: limits_url.clone(),
        script: env.path("wrk-auth-without.lua"),
        envoy: Some(&limited),
    });
    let exchange_index = targets.len();
    targets.push(Target {
        key: "exchange".into(),
        label: "toolgate filter, jwt_authn + rules, the credential exchanged per caller (cached)"
            .into(),
        url: exchange_url.clone(),
        script: exchange_script,
        envoy: Some(&exchanging),
    });
    let dp = dataplane::Options {
        reps: opts.reps,
        secs: opts.secs,
        warmup_secs: opts.warmup_secs,
        connections: opts.connections,
        noop_filter: PathBuf::new(),
        toolgate_filter: PathBuf::from(&wasm),
        probe_filter: None,
        profile_reps: 0,
        profile_levels: Vec::new(),
        profile_workloads: Vec::new(),
        workloads: Vec::new(),
        quiet_wait: opts.quiet_wait,
        attempts: opts.attempts,
        extra_budget: Cell::new(opts.extra_budget),
    };
    eprintln!("auth: warm-up ...");
    for t in &targets {
        wrk(&t.script, &t.url, opts.warmup_secs, opts.connections).await?;
    }
    pinning.apply_and_check()?;
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    let mut pair_order = Vec::new();
    for rep in 0..opts.reps {
        // ABBA: every other repetition the other way round.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if rep % 2 == 1 {
            order.reverse();
        }
        pair_order.push(
            order
                .iter()
                .map(|&i| targets[i].key.as_str())
                .collect::<Vec<_>>()
                .join(","),
        );
        for i in order {
            let t = &targets[i];
            let envoy_pid = t.envoy.map(pid_of).transpose()?;
            let run = run_once(&t.script, &t.url, &dp, &lab, envoy_pid, rep).await?;
            eprintln!(
                "auth rep {}/{} ({:>7}) {:>8.0} calls/s  p50 {:.3} ms  p99 {:.3} ms  Envoy {} µs/call{}",
                rep + 1,
                opts.reps,
                t.key,
                run.rps,
                run.p50_ms,
                run.p99_ms,
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
    let anomalies = find_anomalies("auth 1 KB JSON", &targets, &runs);
    let rps_ratio = |with: usize, without: usize| -> Vec<f64> {
        runs[with]
            .iter()
            .zip(&runs[without])
            .map(|(w, o)| w.rps / o.rps.max(1.0))
            .collect()
    };
    let cpu_delta = |with: usize, without: usize| -> Vec<f64> {
        let cpu = |r: &Run| r.envoy_cpu_us_per_req.unwrap_or(f64::NAN);
        runs[with]
            .iter()
            .zip(&runs[without])
            .map(|(w, o)| cpu(w) - cpu(o))
            .collect()
    };
    let ratio = spread(&rps_ratio(1, 0));
    let toolgate_delta = cpu_delta(1, 0);
    let envoy_cpu_delta_us = spread(&toolgate_delta);
    let limits_figures = (
        spread(&rps_ratio(limits_index, 0)),
        spread(&cpu_delta(limits_index, 0)),
    );
    let exchange_figures = (
        spread(&rps_ratio(exchange_index, 1)),
        spread(&cpu_delta(exchange_index, 1)),
    );
    let breakdown_figures = noop.is_some().then(|| {
        let noop_delta = cpu_delta(3, 2);
        let filter: Vec<f64> = toolgate_delta
            .iter()
            .zip(&noop_delta)
            .map(|(t, n)| t - n)
            .collect();
        (
            spread(&rps_ratio(3, 2)),
            spread(&noop_delta),
            spread(&filter),
        )
    });
    let jwt_authn_stats = jwt_stats(&http, &authd).await;
    let mut results: Vec<Option<VariantResult>> = targets
        .iter()
        .zip(runs)
        .map(|(t, r)| Some(variant_result(t, r)))
        .collect();
    let exchange_result = results.get_mut(exchange_index).and_then(Option::take);
    let limits_result = results.get_mut(limits_index).and_then(Option::take);
    let mut results = results.into_iter().flatten();
    let (Some(without_auth), Some(with_auth)) = (results.next(), results.next()) else {
        bail!("two variants measured");
    };
    let breakdown = match (breakdown_figures, results.next(), results.next()) {
        (Some((noop_ratio, jwt_authn_us, filter_auth_us)), Some(a), Some(b)) => Some(Breakdown {
            noop_without_auth: a,
            noop_with_auth: b,
            noop_ratio,
            jwt_authn_us,
            filter_auth_us,
        }),
        _ => None,
    };
    let exchange = exchange_result.map(|variant| ExchangeCost {
        variant,
        ratio_to_with_auth: exchange_figures.0,
        envoy_cpu_delta_us: exchange_figures.1,
        exchanges: issuer.exchanges(),
    });
    let limits = limits_result.map(|variant| LimitsCost {
        variant,
        rule: limit_config,
        goal_met: limits_figures.0.median >= LIMITS_GOAL_RATIO,
        ratio_to_without: limits_figures.0,
        envoy_cpu_delta_us: limits_figures.1,
        goal: format!(
            "with one limit / without >= {LIMITS_GOAL_RATIO:.2} (calls/s, median of back-to-back pairs)"
        ),
    });
    let _ = (&xds_open, &xds_auth, &xds_exchange, &xds_limits, &issuer);
    Ok(AuthBench {
        token_cache: opts.token_cache,
        pinning: if pinned {
            format!(
                "the Envoys (--concurrency 1, all threads) on core {ENVOY_CORE}; wrk, the lab, etcd, \
                 the toolgate-xds, the issuer and the bench driver on core {CLIENT_CORE}"
            )
        } else {
            "not pinned: fewer than 2 cores".into()
        },
        workload: "1 KB JSON tools/call",
        request_bytes: body.len(),
        connections: opts.connections,
        wrk_threads: WRK_THREADS,
        reps: opts.reps,
        secs_per_run: opts.secs,
        warmup_secs: opts.warmup_secs,
        pair_order,
        rules: TOOLS.len(),
        token_alg: "RS256",
        token_bytes: token.len(),
        without_auth,
        with_auth,
        goal_met: ratio.median >= GOAL_RATIO,
        ratio,
        envoy_cpu_delta_us,
        breakdown,
        exchange,
        limits,
        goal: format!(
            "with auth / without >= {GOAL_RATIO:.2} (calls/s, median of back-to-back pairs)"
        ),
        jwt_authn_stats,
        anomalies,
    })
}

/// The limits as the limit Envoy's filter has them: the suite measures nothing until the rule
/// is in force.
async fn wait_for_limit(envoy: &Envoy) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(limits) = envoy
            .filter_config()
            .await
            .map(|c| c["limits"].clone())
            .filter(|l| !l.is_null())
        {
            return Ok(limits);
        }
        if Instant::now() > deadline {
            bail!("the limit Envoy's filter never got the call limit");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Debug, Clone, Copy)]
enum Expect {
    /// 200 with the lab's echo.
    Served,
    /// 401 with a `WWW-Authenticate` challenge.
    Unauthenticated,
    /// The JSON-RPC error of a tool no rule grants.
    ToolDenied,
}

/// Posts the call (with `token` as a bearer token) until the answer is the expected one, for
/// 30 s at most.
async fn wait_for_answer(
    http: &reqwest::Client,
    url: &str,
    body: &str,
    token: Option<&str>,
    expect: Expect,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut last = String::new();
    while t0.elapsed() < Duration::from_secs(30) {
        let mut req = http
            .post(url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        match req.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let challenge = r.headers().contains_key("www-authenticate");
                let text = r.text().await.unwrap_or_default();
                let ok = match expect {
                    Expect::Served => status == 200 && text.contains("\"instance_id\""),
                    Expect::Unauthenticated => status == 401 && challenge,
                    Expect::ToolDenied => {
                        status == 200
                            && serde_json::from_str::<Value>(&text)
                                .ok()
                                .and_then(|v| {
                                    v.pointer("/error/data/reason")
                                        .and_then(Value::as_str)
                                        .map(|r| r == "tool_denied")
                                })
                                .unwrap_or(false)
                    }
                };
                if ok {
                    return Ok(());
                }
                last = format!("HTTP {status}: {text:.300}");
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{url}: expected {expect:?} within 30 s, last answer {last}")
}

/// The Envoy's `jwt_authn` counters (`http.<prefix>.jwt_authn.<name>`), by name.
async fn jwt_stats(http: &reqwest::Client, envoy: &Envoy) -> BTreeMap<String, u64> {
    let url = format!("{}/stats?filter=jwt_authn", envoy.admin_url());
    let text = match http.get(&url).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(": ")?;
            let value = value.trim().parse::<u64>().ok()?;
            let short = name.rsplit_once("jwt_authn.").map_or(name, |(_, n)| n);
            Some((short.to_string(), value))
        })
        .collect()
}

impl AuthBench {
    pub fn markdown(&self) -> String {
        let f = |s: &Spread, prec: usize| {
            format!("{:.p$} ({:.p$}–{:.p$})", s.median, s.min, s.max, p = prec)
        };
        let mut out = format!(
            "Auth: {}, wrk -t{} -c{}, {} × {} s per variant, ABBA pairs; median (min–max). Pinning: {}.\n\n",
            self.workload, self.wrk_threads, self.connections, self.reps, self.secs_per_run, self.pinning
        );
        out.push_str(
            "| variant | calls/s | p50 ms | p99 ms | Envoy CPU µs/call | other load % |\n",
        );
        out.push_str("| --- | ---: | ---: | ---: | ---: | ---: |\n");
        let noop = self
            .breakdown
            .as_ref()
            .map(|b| [&b.noop_without_auth, &b.noop_with_auth]);
        for v in [&self.without_auth, &self.with_auth]
            .into_iter()
            .chain(noop.into_iter().flatten())
            .chain(self.exchange.iter().map(|x| &x.variant))
            .chain(self.limits.iter().map(|l| &l.variant))
        {
            out.push_str(&format!(
                "| ({}) {} | {} | {} | {} | {} | {:.0} |\n",
                v.variant,
                v.label,
                f(&v.rps, 0),
                f(&v.p50_ms, 3),
                f(&v.p99_ms, 3),
                v.envoy_cpu_us_per_req
                    .map(|s| f(&s, 1))
                    .unwrap_or_else(|| "–".into()),
                v.foreign_load_pct.max,
            ));
        }
        out.push_str(&format!(
            "| **with / without** (calls/s, paired) | {} | | | Δ {} µs | goal >= {GOAL_RATIO:.2}: {} |\n",
            f(&self.ratio, 3),
            f(&self.envoy_cpu_delta_us, 1),
            if self.goal_met { "met" } else { "MISSED" }
        ));
        if let Some(b) = &self.breakdown {
            out.push_str(&format!(
                "\nWhere the difference goes (Envoy CPU µs/call, paired per repetition): jwt_authn and the token (no-op filter pair; its calls/s ratio {}) {}; the toolgate filter's auth work (the toolgate pair's difference minus the no-op pair's) {}.\n",
                f(&b.noop_ratio, 3),
                f(&b.jwt_authn_us, 1),
                f(&b.filter_auth_us, 1),
            ));
        }
        if let Some(x) = &self.exchange {
            out.push_str(&format!(
                "\nThe credential exchanged per caller (RFC 8693), its cache warm: calls/s {} of the same auth configuration without it (paired), Δ {} µs Envoy CPU per call; {} exchanges at the issuer in the whole suite.\n",
                f(&x.ratio_to_with_auth, 3),
                f(&x.envoy_cpu_delta_us, 1),
                x.exchanges,
            ));
        }
        if let Some(l) = &self.limits {
            out.push_str(&format!(
                "\nOne call limit that never trips ({}): calls/s {} of the same filter without limits (paired), Δ {} µs Envoy CPU per call; goal >= {LIMITS_GOAL_RATIO:.2}: {}.\n",
                l.rule,
                f(&l.ratio_to_without, 3),
                f(&l.envoy_cpu_delta_us, 1),
                if l.goal_met { "met" } else { "MISSED" }
            ));
        }
        let stat = |k: &str| self.jwt_authn_stats.get(k).copied().unwrap_or(0);
        out.push_str(&format!(
            "\nToken: {} bytes ({}), one token for every call. jwt_authn on the auth Envoy: {} allowed, {} token cache hits / {} misses, {} JWKS fetches. Other load: the most CPU (percent of one core) that processes the bench did not start used during one run; runs above {MAX_FOREIGN_PCT}% were measured again.\n",
            self.token_bytes,
            self.token_alg,
            stat("allowed"),
            stat("jwt_cache_hit"),
            stat("jwt_cache_miss"),
            stat("jwks_fetch_success"),
        ));
        if !self.anomalies.is_empty() {
            out.push_str("\nAnomalies:\n");
            for a in &self.anomalies {
                out.push_str(&format!("- {a}\n"));
            }
        }
        out
    }
}
