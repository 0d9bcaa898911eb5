//! A three-member etcd cluster: toolgate-xds and the registrars take every member's endpoint,
//! and when the leader is killed, the watch and the keepalives go on with the other two.

use std::time::Duration;

use etcd_client::GetOptions;
use serde_json::json;
use toolgate_tests::{wait_until, Envoy, EtcdCluster, McpSession, Member, TestEnv, Xds};

/// Short, so a keepalive that stopped would lose the lease within the test.
const TTL: u32 = 3;

/// `(key, lease)` of every registration under `service`.
async fn leases(cluster: &mut EtcdCluster, service: &str) -> Vec<(String, i64)> {
    let mut c = cluster.client().await;
    let resp = c
        .get(
            format!("/mcp/services/{service}/"),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .expect("etcd get");
    resp.kvs()
        .iter()
        .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease()))
        .collect()
}

/// The member that serves toolgate-xds's watch (the only watcher in the test).
async fn wait_for_watch(cluster: &EtcdCluster) -> usize {
    let started = std::time::Instant::now();
    loop {
        for i in 0..cluster.members.len() {
            if cluster.watchers(i).await > 0 {
                return i;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "no etcd member serves toolgate-xds's watch"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn watch_and_keepalives_survive_the_etcd_leader_being_killed() {
    let env = TestEnv::new("watch_and_keepalives_survive_the_etcd_leader_being_killed");
    let mut cluster = EtcdCluster::start(&env, "etcd", 3).await;
    let endpoints = cluster.endpoints();
    let xds = Xds::start(&env, "xds", &endpoints, &[]).await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let a = Member::start(
        &env,
        &endpoints,
        "orders",
        "orders-a",
        &["--stateless"],
        TTL,
    )
    .await;
    let b = Member::start(
        &env,
        &endpoints,
        "orders",
        "orders-b",
        &["--stateless"],
        TTL,
    )
    .await;
    let mut both = vec![a.server.endpoint(), b.server.endpoint()];
    both.sort();
    wait_until(
        "envoy routes to both instances",
        Duration::from_secs(20),
        || async { envoy.addresses("orders").await == both },
    )
    .await;
    let before = leases(&mut cluster, "orders").await;
    assert_eq!(before.len(), 2, "registrations: {before:?}");

    // toolgate-xds's one watch stream lives on one member; make that member the leader, so
    // killing the leader also breaks the watch.
    let watching = wait_for_watch(&cluster).await;
    cluster.move_leader(watching).await;
    let leader = cluster.wait_leader(Duration::from_secs(10)).await;
    assert_eq!(leader, watching);
    let killed = cluster.members[leader].name().to_string();
    cluster.kill(leader);
    let new_leader = cluster.wait_leader(Duration::from_secs(15)).await;
    assert_ne!(new_leader, leader, "a new leader is elected");
    let resumed_on = wait_for_watch(&cluster).await;
    assert_ne!(resumed_on, leader, "the watch moved off the killed member");

    // Keepalives: three TTLs later both leases are still the same ones. A registrar whose
    // stream died with the leader would have lost its lease (and registered a new one).
    tokio::time::sleep(Duration::from_secs(3 * u64::from(TTL))).await;
    let after = leases(&mut cluster, "orders").await;
    assert_eq!(
        after, before,
        "registrations after {killed} (the leader) was killed"
    );

    // The watch: it resumed on another member, and a new instance reaches Envoy, and a revoked one leaves it.
    let c = Member::start(
        &env,
        &endpoints,
        "orders",
        "orders-c",
        &["--stateless"],
        TTL,
    )
    .await;
    let mut want = vec![a.server.endpoint(), c.server.endpoint()];
    want.sort();
    let Member { mut registrar, .. } = b;
    registrar.stop(Duration::from_secs(10)).await;
    wait_until(
        "envoy follows a put and a revoke made after the leader died",
        Duration::from_secs(10),
        || async { envoy.addresses("orders").await == want },
    )
    .await;
    let mut agent = McpSession::connect(&envoy.url("orders")).await;
    let reply = agent.call_tool("read_order", json!({"order": 1})).await;
    assert!(
        reply.text().contains("orders-a") || reply.text().contains("orders-c"),
        "a call through the gateway: {}",
        reply.body
    );

    // The killed member rejoins on its data and catches up.
    cluster.restart(&env, leader).await;
    let rejoined = cluster.members[leader].client().await;
    wait_until(
        &format!("{killed} serves the registrations made while it was down"),
        Duration::from_secs(10),
        || {
            let key = c.key.clone();
            let mut client = rejoined.clone();
            async move {
                client
                    .get(key, None)
                    .await
                    .is_ok_and(|r| r.kvs().len() == 1)
            }
        },
    )
    .await;
    drop(a);
}
