//! Fail-fast: a tool whose server hangs. The open-circuit reply's latency through the toolgate
//! filter, against what an agent waits per call without a breaker (the route timeout); and,
//! for the 10 s after the tool breaks, how many calls still reach it and what the agents see,
//! through the toolgate filter and through Envoy's own outlier detection (same cluster, same
//! timeout, no filter).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use serde_json::json;
use toolgate_tests::{filter_wasm, Envoy, Etcd, McpSession, Member, Reply, TestEnv, Xds};

use crate::stats::{summarize, Summary};

const SERVICE: &str = "ff";
const TOOL: &str = "write_order";
/// The service's call timeout (the route timeout) in this suite.
const TIMEOUT_MS: u64 = 2000;
const AGENTS: usize = 8;

#[derive(Debug, Serialize)]
pub struct Window {
    pub calls: u64,
    /// Calls the broken tool received.
    pub reached_tool: u64,
    /// What the agents saw, by kind.
    pub seen: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub struct FailFast {
    pub open_reply: Summary,
    /// What each failing call cost the agent without a breaker (the route timeout).
    pub without_breaker: Summary,
    pub window_secs: u64,
    pub toolgate: Window,
    pub outlier_detection: Window,
}

/// What an agent makes of a reply.
fn kind(r: &Reply) -> String {
    if let Some(result) = r.result() {
        if result["isError"] == true {
            let state = result["_meta"]["io.toolgate/breaker"]["state"]
                .as_str()
                .unwrap_or("tool error");
            return format!("tool result isError ({state})");
        }
        return "tool result".into();
    }
    format!("HTTP {} (no MCP answer)", r.status.as_u16())
}

/// `AGENTS` agents calling the tool back to back for `window`.
async fn window(
    url: &str,
    member: &Member,
    window: Duration,
) -> anyhow::Result<(Window, Vec<Duration>)> {
    let before = member.server.calls(TOOL).await;
    member.server.set(json!({"fail": {TOOL: "hang"}})).await;
    let seen = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
    let timed_out = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..AGENTS {
        let (url, seen, timed_out) = (url.to_string(), seen.clone(), timed_out.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = McpSession::connect(&url).await;
            let mut n = 0u64;
            while started.elapsed() < window {
                let t0 = Instant::now();
                let r = s.call_tool(TOOL, json!({})).await;
                let took = t0.elapsed();
                let k = kind(&r);
                // A call the route timeout ended (Envoy's 504, or the filter's timeout reply).
                if k.contains("504") || k.contains("(timeout)") {
                    timed_out
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(took);
                }
                *seen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(k)
                    .or_default() += 1;
                n += 1;
            }
            n
        }));
    }
    let mut calls = 0;
    for t in tasks {
        calls += t.await?;
    }
    let reached_tool = member.server.calls(TOOL).await - before;
    member.server.set(json!({"fail": {TOOL: "none"}})).await;
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let timed_out = timed_out.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok((
        Window {
            calls,
            reached_tool,
            seen,
        },
        timed_out,
    ))
}

pub async fn run(
    env: &TestEnv,
    open_samples: usize,
    window_len: Duration,
) -> anyhow::Result<FailFast> {
    let etcd = Etcd::start(env).await;
    let mut c = etcd.client().await;
    c.put(
        format!("/mcp/policies/{SERVICE}"),
        json!({"timeout_ms": TIMEOUT_MS, "open_ms": 30000, "open_jitter_percent": 0}).to_string(),
        None,
    )
    .await?;
    let wasm = filter_wasm();
    let xt = Xds::start(env, "toolgate.xds", &etcd.endpoint(), &[]).await;
    let xo = Xds::start(
        env,
        "outlier.xds",
        &etcd.endpoint(),
        &["--envoy-outlier-detection"],
    )
    .await;
    let with_filter = Envoy::start_with(
        env,
        "toolgate.envoy",
        &xt,
        1,
        &["--filter", &wasm.to_string_lossy()],
    )
    .await;
    let outlier = Envoy::start(env, "outlier.envoy", &xo).await;
    let member = Member::start(
        env,
        &etcd.endpoint(),
        SERVICE,
        "ff-1",
        &["--stateless", "--json-response"],
        10,
    )
    .await;
    for envoy in [&with_filter, &outlier] {
        let t0 = Instant::now();
        while envoy.addresses(SERVICE).await != vec![member.server.endpoint()] {
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("{} never routed the lab", envoy.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    eprintln!("  toolgate filter: {AGENTS} agents for {window_len:?} on a hung tool ...");
    let (toolgate, _) = window(&with_filter.url(SERVICE), &member, window_len).await?;
    // The breaker is open now (30 s): the open-circuit reply, one agent, back to back.
    let mut s = McpSession::connect(&with_filter.url(SERVICE)).await;
    let mut open_reply = Vec::with_capacity(open_samples);
    for _ in 0..open_samples {
        let t0 = Instant::now();
        let r = s.call_tool(TOOL, json!({})).await;
        open_reply.push(t0.elapsed());
        if kind(&r) != "tool result isError (open)" {
            bail!("expected the open-circuit reply, got {}", r.body);
        }
    }
    eprintln!("  Envoy outlier detection, no filter: {AGENTS} agents for {window_len:?} ...");
    let (outlier_detection, timed_out) = window(&outlier.url(SERVICE), &member, window_len).await?;
    Ok(FailFast {
        open_reply: summarize(&open_reply),
        without_breaker: summarize(&timed_out),
        window_secs: window_len.as_secs(),
        toolgate,
        outlier_detection,
    })
}

impl FailFast {
    pub fn markdown(&self) -> String {
        let seen = |w: &Window| {
            w.seen
                .iter()
                .map(|(k, n)| format!("{n}× {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "| fail-fast (tool hangs, timeout {TIMEOUT_MS} ms) | figure |\n| --- | --- |\n\
             | open-circuit reply p50 / p99 / max | {:.3} / {:.3} / {:.3} ms ({} calls) |\n\
             | a failing call without a breaker (route timeout) p50 / p99 | {:.0} / {:.0} ms |\n\
             | toolgate filter, first {} s: calls, reached the tool, agents saw | {}, {}, {} |\n\
             | Envoy outlier detection, first {} s: calls, reached the tool, agents saw | {}, {}, {} |\n",
            self.open_reply.p50_ms,
            self.open_reply.p99_ms,
            self.open_reply.max_ms,
            self.open_reply.n,
            self.without_breaker.p50_ms,
            self.without_breaker.p99_ms,
            self.window_secs,
            self.toolgate.calls,
            self.toolgate.reached_tool,
            seen(&self.toolgate),
            self.window_secs,
            self.outlier_detection.calls,
            self.outlier_detection.reached_tool,
            seen(&self.outlier_detection),
        )
    }
}
