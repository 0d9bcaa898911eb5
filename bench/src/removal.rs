//! Removal: how fast an instance leaves rotation. Revoke (the registrar's SIGTERM revokes its
//! lease) -> Envoy stops routing to it; crash (SIGKILL of the server, its registrar and lease
//! alive) and a failing health check (the server up, `GET /health` answering 503) -> out of
//! rotation by the active probes (toolgate-xds defaults: every 2 s, 1 s timeout, two misses).
//! `tests/health.rs` checks the last two with generous bounds; these are the real figures.

use std::time::{Duration, Instant};

use anyhow::bail;
use nix::sys::signal::Signal;
use serde::Serialize;
use toolgate_tests::{Envoy, Etcd, Member, TestEnv, Xds};

use crate::stats::{summarize, Summary};

#[derive(Debug, Serialize)]
pub struct Removal {
    pub revoke: Summary,
    pub crash: Summary,
    /// Health check failing -> SUSPECT (DRAINING in Envoy: no new calls).
    pub unhealthy: Summary,
}

/// Whether Envoy sends new calls to `addr` in `service` (HEALTHY; DRAINING is out).
async fn routed(envoy: &Envoy, service: &str, addr: &str) -> bool {
    envoy
        .hosts()
        .await
        .get(service)
        .is_some_and(|h| h.iter().any(|h| h.address == addr && h.health == "HEALTHY"))
}

async fn until(
    what: &str,
    within: Duration,
    mut check: impl AsyncFnMut() -> bool,
) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    loop {
        if check().await {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > within {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

pub async fn run(
    env: &TestEnv,
    revokes: usize,
    crashes: usize,
    unhealthy_trials: usize,
) -> anyhow::Result<Removal> {
    let etcd = Etcd::start(env).await;
    let xds = Xds::start(env, "xds", &etcd.endpoint(), &[]).await;
    let envoy = Envoy::start(env, "envoy", &xds).await;
    let lab_args = ["--stateless", "--json-response"];
    let mut revoke = Vec::with_capacity(revokes);
    for i in 0..revokes {
        let m = Member::start(
            env,
            &etcd.endpoint(),
            "rm",
            &format!("rv-{i}"),
            &lab_args,
            10,
        )
        .await;
        let addr = m.server.endpoint();
        until("revoke: routed", Duration::from_secs(20), async || {
            routed(&envoy, "rm", &addr).await
        })
        .await?;
        let t0 = Instant::now();
        m.registrar.signal(Signal::SIGTERM);
        until(
            "revoke: out of rotation",
            Duration::from_secs(20),
            async || !routed(&envoy, "rm", &addr).await,
        )
        .await?;
        revoke.push(t0.elapsed());
    }
    let mut crash = Vec::with_capacity(crashes);
    for i in 0..crashes {
        let mut m = Member::start(
            env,
            &etcd.endpoint(),
            "cr",
            &format!("cr-{i}"),
            &lab_args,
            10,
        )
        .await;
        let addr = m.server.endpoint();
        until("crash: routed", Duration::from_secs(20), async || {
            routed(&envoy, "cr", &addr).await
        })
        .await?;
        let t0 = Instant::now();
        m.server.proc.kill();
        until(
            "crash: out of rotation",
            Duration::from_secs(20),
            async || !routed(&envoy, "cr", &addr).await,
        )
        .await?;
        crash.push(t0.elapsed());
        if !m.registrar.is_running() {
            bail!("crash trial {i}: the registrar died with its server");
        }
    }
    let mut unhealthy = Vec::with_capacity(unhealthy_trials);
    for i in 0..unhealthy_trials {
        let m = Member::start(
            env,
            &etcd.endpoint(),
            "uh",
            &format!("uh-{i}"),
            &lab_args,
            10,
        )
        .await;
        let addr = m.server.endpoint();
        until(
            "health failing: routed",
            Duration::from_secs(20),
            async || routed(&envoy, "uh", &addr).await,
        )
        .await?;
        let t0 = Instant::now();
        m.server.set(serde_json::json!({"health_fail": true})).await;
        until(
            "health failing: out of rotation",
            Duration::from_secs(20),
            async || !routed(&envoy, "uh", &addr).await,
        )
        .await?;
        unhealthy.push(t0.elapsed());
    }
    Ok(Removal {
        revoke: summarize(&revoke),
        crash: summarize(&crash),
        unhealthy: summarize(&unhealthy),
    })
}
