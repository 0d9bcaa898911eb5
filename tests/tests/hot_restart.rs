//! An Envoy hot restart under agent load: every call in flight or sent during it is answered.
//! The parent drains and is shut down `--parent-shutdown-time-s` after the restart with
//! whatever it still serves, so that time must cover the drain plus the longest call.

use std::time::{Duration, Instant};

use serde_json::json;
use toolgate_tests::{wait_until, Envoy, Etcd, McpSession, Member, TestEnv, Xds};

/// Each call takes this long at the server: long enough that a call started on the parent
/// as its drain ends is still running when a too-short parent shutdown time runs out.
const CALL: Duration = Duration::from_millis(3000);

#[tokio::test]
async fn calls_in_flight_and_sent_during_an_envoy_hot_restart_are_all_answered() {
    let env = TestEnv::new("hot_restart");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(&env, "xds", &etcd.endpoint(), &[]).await;
    // Calls this slow are the service's normal: the breaker must not count them as slow.
    etcd.client()
        .await
        .put(
            "/mcp/policies/slow",
            json!({"slow_call_ms": 10 * CALL.as_millis()}).to_string(),
            None,
        )
        .await
        .expect("writing the policy");
    let mut envoy = Envoy::start_with_filter(&env, "envoy", &xds, 2, &[]).await;
    let latency = CALL.as_millis().to_string();
    let member = Member::start(
        &env,
        &etcd.endpoint(),
        "slow",
        "slow-1",
        &["--stateless", "--json-response", "--latency-ms", &latency],
        10,
    )
    .await;
    wait_until(
        "envoy routes to slow-1",
        Duration::from_secs(20),
        || async { envoy.addresses("slow").await == vec![member.server.endpoint()] },
    )
    .await;

    // Keep-alive agents calling back to back, started at staggered times so that some call
    // is always about to start.
    let url = envoy.url("slow");
    let t0 = Instant::now();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut agents = Vec::new();
    for agent in 0..6u64 {
        let (url, stopped) = (url.clone(), stopped.clone());
        agents.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(agent * 350)).await;
            let mut s = McpSession::connect(&url).await;
            let mut calls = Vec::new();
            while !*stopped.borrow() {
                let sent = t0.elapsed();
                let r = s.call_tool("echo", json!({"text": "hi"})).await;
                let answered = r.result().is_some_and(|res| res["isError"] != true);
                calls.push((sent, t0.elapsed(), answered, r.status.as_u16(), r.body));
            }
            calls
        }));
    }
    tokio::time::sleep(CALL * 2).await;
    let restart_at = t0.elapsed();
    envoy.hot_restart(&env, CALL).await;
    let parent_gone = t0.elapsed();
    println!(
        "hot restart at {restart_at:?}; the parent exited {:?} later (--parent-shutdown-time-s {})",
        parent_gone - restart_at,
        envoy.parent_shutdown().as_secs()
    );
    tokio::time::sleep(CALL * 2).await;
    let _ = stop.send(true);

    let mut failed = Vec::new();
    let (mut total, mut during, mut after) = (0, 0, 0);
    for a in agents {
        for (sent, done, answered, status, body) in a.await.expect("agent task") {
            total += 1;
            if sent > restart_at && sent < parent_gone {
                during += 1;
            }
            if sent > parent_gone && answered {
                after += 1;
            }
            if !answered {
                failed.push(format!("sent {sent:?}, ended {done:?}: {status} {body}"));
            }
        }
    }
    println!("{total} calls, {during} sent while the parent drained, {after} answered after it");
    // Six agents start a call every CALL / 6 on average.
    assert!(during >= 6, "{during} calls sent during the drain");
    assert!(after >= 6, "{after} calls answered by the new epoch alone");
    assert!(
        failed.is_empty(),
        "{} of {total} calls were not answered:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
