//! Fleet sync: gateway A's breaker opens -> gateway B answers the same tool with the semantic
//! reply, over real processes (one etcd, two toolgate-xds, two Envoys with the filter, a lab
//! server). Each trial uses its own tool, so no trial waits for the previous opening to end.

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
}

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
    let xa = Xds::start(env, "a.xds", &etcd.endpoint(), &[]).await;
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
    Ok(FleetSync {
        a_open_to_b_rejects: summarize(&samples),
    })
}
