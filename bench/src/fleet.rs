//! Fleet sync: gateway A's breaker opens -> gateway B answers the same tool with the semantic
//! reply, over real processes (one etcd, two toolgate-xds, two Envoys with the filter, a lab
//! server). Each trial uses its own tool, so no trial waits for the previous opening to end.
//!
//! And an operator's override under churn: `PUT /v1/overrides/...` on A's toolgate-xds ->
//! A's filter has it (Envoy's config dump), while new services register in the same moments
//! (each trial registers one just before its override, and a task adds one every 20 ms), so
//! the pushes that carry the override also carry clusters Envoy has not answered yet.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::json;
use toolgate_tests::{filter_wasm, Envoy, Etcd, McpServer, McpSession, Registrant, TestEnv, Xds};

use crate::stats::{summarize, Summary};

#[derive(Debug, Serialize)]
pub struct FleetSync {
    /// A's tripping call answered -> B's first semantic "open" reply.
    pub a_open_to_b_rejects: Summary,
    /// An override PUT through the admin API -> the filter in Envoy has it, while services
    /// are being added.
    pub override_to_filter: Summary,
    /// The part of it until the admin API answered (the override is in etcd).
    pub override_put_answered: Summary,
    /// New services registered while the override trials ran.
    pub services_added: usize,
}

/// The admin token of gateway A's toolgate-xds.
const ADMIN_TOKEN: &str = "bench-admin-token";

/// Failures that trip a breaker in this suite (the service's `min_calls`).
const TRIP_AFTER: usize = 3;

pub async fn run(env: &TestEnv, trials: usize) -> anyhow::Result<FleetSync> {
    let etcd = Etcd::start(env).await;
    let mut c = etcd.client().await;
    c.put(
        "/mcp/policies/fleet",
        json!({"min_calls": TRIP_AFTER, "open_ms": 60000}).to_string(),
        None,
    )
    .await?;
    let wasm = filter_wasm();
    let wasm = wasm.to_string_lossy();
    let xa = Xds::start_with_env(
        env,
        "a.xds",
        &etcd.endpoint(),
        &["--admin-token-env", "TG_BENCH_ADMIN"],
        &[("TG_BENCH_ADMIN", ADMIN_TOKEN)],
    )
    .await;
    let xb = Xds::start(env, "b.xds", &etcd.endpoint(), &[]).await;
    let a = Envoy::start_with(env, "a.envoy", &xa, 1, &["--filter", &wasm]).await;
    let b = Envoy::start_with(env, "b.envoy", &xb, 1, &["--filter", &wasm]).await;
    let tools: Vec<String> = (0..trials).map(|i| format!("t{i}")).collect();
    let lab = McpServer::lab(
        env,
        "fleet-lab",
        &[
            "--stateless",
            "--json-response",
            "--tools",
            &tools.join(","),
        ],
    )
    .await;
    let _registrar = Registrant::new(&etcd.endpoint(), "fleet", &lab.endpoint())
        .arg("--instance-id", "fleet-1")
        .spawn(env, "fleet-1.registrar");
    for envoy in [&a, &b] {
        let started = Instant::now();
        while envoy.addresses("fleet").await != vec![lab.endpoint()] {
            if started.elapsed() > Duration::from_secs(20) {
                bail!("{} never routed the lab", envoy.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut sa = McpSession::connect(&a.url("fleet")).await;
    let mut sb = McpSession::connect(&b.url("fleet")).await;
    let mut samples = Vec::with_capacity(trials);
    for tool in &tools {
        lab.set(json!({"fail": {tool.as_str(): "http500"}})).await;
        for _ in 0..TRIP_AFTER {
            let r = sa.call_tool(tool, json!({})).await;
            if r.breaker_state().as_deref() != Some("upstream_failure") {
                bail!("{tool}: expected a failure through A, got {}", r.body);
            }
        }
        // The last failure tripped A's breaker before its reply left Envoy.
        let opened = Instant::now();
        lab.set(json!({"fail": {tool.as_str(): "none"}})).await;
        loop {
            let r = sb.call_tool(tool, json!({})).await;
            if r.breaker_state().as_deref() == Some("open") {
                samples.push(opened.elapsed());
                break;
            }
            if opened.elapsed() > Duration::from_secs(5) {
                bail!("{tool}: B never rejected; last reply {}", r.body);
            }
        }
        let r = sa.call_tool(tool, json!({})).await;
        if r.breaker_state().as_deref() != Some("open") {
            bail!("{tool}: A is not open after the trial: {}", r.body);
        }
    }
    let keys = c
        .get(
            "/mcp/breakers/fleet/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .context("reading the fleet openings")?;
    if keys.kvs().len() != trials {
        bail!(
            "expected {trials} fleet openings in etcd, found {}",
            keys.kvs().len()
        );
    }
    let (override_to_filter, override_put_answered, services_added) =
        override_under_churn(&etcd, &xa, &a, &lab, trials * 4).await?;
    Ok(FleetSync {
        a_open_to_b_rejects: summarize(&samples),
        override_to_filter,
        override_put_answered,
        services_added,
    })
}

/// `trials` overrides, each PUT through A's admin API right after a new service registered
/// (and another every 20 ms meanwhile); each sample ends when A's Envoy shows the override in
/// its applied filter configuration.
async fn override_under_churn(
    etcd: &Etcd,
    xds: &Xds,
    envoy: &Envoy,
    lab: &McpServer,
    trials: usize,
) -> anyhow::Result<(Summary, Summary, usize)> {
    let endpoint = lab.endpoint();
    let client = etcd.client().await;
    let register = move |n: usize| {
        let value =
            json!({"instance_id": format!("churn-{n}-1"), "endpoint": endpoint, "tools": ["t"]});
        let mut c = client.clone();
        async move {
            c.put(
                format!("/mcp/services/churn-{n}/churn-{n}-1"),
                value.to_string(),
                None,
            )
            .await
            .context("registering a churn service")?;
            anyhow::Ok(())
        }
    };
    let added = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (added, stop, register) = (added.clone(), stop.clone(), register.clone());
        tokio::spawn(async move {
            let mut n = 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                if register(n).await.is_ok() {
                    added.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut samples = Vec::with_capacity(trials);
    let mut answered = Vec::with_capacity(trials);
    let mut outcome = Ok(());
    for i in 0..trials {
        if let Err(e) = register(i).await {
            outcome = Err(e);
            break;
        }
        added.fetch_add(1, Ordering::Relaxed);
        let tool = format!("t{i}");
        let reason = format!("bench override {i}");
        let started = Instant::now();
        let resp = http
            .put(format!("{}/v1/overrides/fleet/{tool}", xds.admin_url()))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"mode": "force_open", "reason": reason}))
            .send()
            .await?;
        answered.push(started.elapsed());
        if !resp.status().is_success() {
            outcome = Err(anyhow::anyhow!(
                "override PUT answered {}: {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            ));
            break;
        }
        loop {
            let applied = envoy.filter_config().await.is_some_and(|c| {
                c["overrides"]["fleet"][tool.as_str()]["reason"] == reason.as_str()
            });
            if applied {
                samples.push(started.elapsed());
                break;
            }
            if started.elapsed() > Duration::from_secs(5) {
                outcome = Err(anyhow::anyhow!(
                    "{tool}: the override never reached the filter"
                ));
                break;
            }
            // Each config dump is work on Envoy's main thread, where it also applies xDS: a
            // tighter poll would slow what it measures.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if outcome.is_err() {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = churn.await;
    outcome?;
    Ok((
        summarize(&samples),
        summarize(&answered),
        added.load(Ordering::Relaxed),
    ))
}
