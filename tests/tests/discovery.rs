//! Discovery to Envoy, end to end: real etcd, toolgate-xds, Envoy, lab MCP servers and MCP
//! clients over HTTP.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use etcd_client::{EventType, GetOptions, PutOptions, WatchOptions};
use futures::StreamExt;
use nix::sys::signal::Signal;
use reqwest::StatusCode;
use serde_json::json;
use toolgate_tests::{
    rmcp_client, wait_until, Envoy, Etcd, FaultProxy, McpServer, McpSession, Member, Options,
    Stack, TestEnv, Xds,
};

const TTL: u32 = 10;

/// The shared stack without the filter: discovery is about what Envoy routes.
async fn stack(env: &TestEnv) -> Stack {
    Stack::with(env, Options::default().without_filter()).await
}

/// The sorted endpoints etcd holds for `service`.
async fn etcd_endpoints(etcd: &Etcd, service: &str) -> Vec<String> {
    let mut c = etcd.client().await;
    let resp = c
        .get(
            format!("/mcp/services/{service}/"),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .expect("etcd get");
    let mut v: Vec<String> = resp
        .kvs()
        .iter()
        .filter_map(|kv| {
            let m: serde_json::Value = serde_json::from_slice(kv.value()).ok()?;
            Some(m["endpoint"].as_str()?.to_string())
        })
        .collect();
    v.sort();
    v
}

fn endpoints(members: &[&Member]) -> Vec<String> {
    members.iter().map(|m| m.server.endpoint()).collect()
}

#[tokio::test]
async fn mcp_clients_call_tools_through_envoy_in_every_transport_mode() {
    let env = TestEnv::new("mcp_clients_call_tools_through_envoy_in_every_transport_mode");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let sse = Member::start(&env, &ep, "sse", "sse-1", &[], TTL).await;
    // rmcp answers JSON only without sessions; stateful sessions always stream SSE.
    let json_m = Member::start(
        &env,
        &ep,
        "json",
        "json-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let stateless =
        Member::start(&env, &ep, "stateless", "stateless-1", &["--stateless"], TTL).await;
    for (svc, m) in [("sse", &sse), ("json", &json_m), ("stateless", &stateless)] {
        stack
            .envoy
            .wait_addresses(svc, &endpoints(&[m]), Duration::from_secs(20))
            .await;
    }

    for svc in ["sse", "json", "stateless"] {
        // rmcp's own client: initialize, tools/list, tools/call.
        let client = rmcp_client::connect(&stack.envoy.url(svc)).await;
        let tools = rmcp_client::list_tools(&client).await;
        assert!(
            tools.contains(&"read_order".to_string()),
            "{svc}: tools {tools:?}"
        );
        let text = rmcp_client::call_text(&client, "read_order", json!({"order": 7})).await;
        assert!(
            text.contains(&format!("{svc}-1")),
            "{svc}: answered by the lab: {text}"
        );
        let _ = client.cancel().await;

        // The raw client sees the transport: SSE or JSON framing as the server chose.
        let mut s = McpSession::connect(&stack.envoy.url(svc)).await;
        let r = s.call_tool("echo", json!({"x": 1})).await;
        assert_eq!(r.status, StatusCode::OK, "{svc}: {}", r.body);
        let expect_sse = svc != "json";
        assert_eq!(
            r.content_type.starts_with("text/event-stream"),
            expect_sse,
            "{svc}: {}",
            r.content_type
        );
        assert!(r.text().contains("echo"), "{svc}: {}", r.body);
    }
    assert!(sse.server.calls("read_order").await >= 1);
}

#[tokio::test]
async fn a_session_sticks_to_its_instance_and_moves_with_a_404_when_it_dies() {
    let env = TestEnv::new("a_session_sticks_to_its_instance_and_moves_with_a_404_when_it_dies");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let mut members = Vec::new();
    for i in 0..5 {
        members
            .push(Member::start_unwatched(&env, &ep, "aff", &format!("aff-{i}"), &[], TTL).await);
    }
    let all: Vec<String> = members.iter().map(|m| m.server.endpoint()).collect();
    stack
        .envoy
        .wait_addresses("aff", &all, Duration::from_secs(20))
        .await;

    let mut session = McpSession::connect(&stack.envoy.url("aff")).await;
    for i in 0..100 {
        let r = session.call_tool("echo", json!({"i": i})).await;
        assert_eq!(r.status, StatusCode::OK, "call {i}: {}", r.body);
    }
    let mut owner = None;
    for (idx, m) in members.iter().enumerate() {
        let n = m.server.calls("echo").await;
        if n > 0 {
            assert_eq!(
                n, 100,
                "{} got {n} of the session's calls",
                m.server.instance_id
            );
            assert!(
                owner.replace(idx).is_none(),
                "calls went to more than one instance"
            );
        }
    }
    let owner = owner.expect("some instance served the session");
    println!("session pinned to {}", members[owner].server.instance_id);

    // The instance dies; its registrar does not watch it, so the lease is still alive.
    members[owner].server.proc.kill();
    let r = session.call_tool("echo", json!({"after": "death"})).await;
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "a session whose instance is gone ends in 404: {}",
        r.body
    );
    let init = session.initialize().await;
    assert_eq!(init.status, StatusCode::OK, "re-initialize: {}", init.body);
    let r = session.call_tool("echo", json!({"after": "reinit"})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        !r.text().contains(&members[owner].server.instance_id),
        "served by a live instance: {}",
        r.text()
    );
}

#[tokio::test]
async fn scale_out_from_5_to_50_instances_reaches_envoy() {
    let env = TestEnv::new("scale_out_from_5_to_50_instances_reaches_envoy");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let mut servers = Vec::new();
    for i in 0..50 {
        servers.push(
            McpServer::lab(&env, &format!("s-{i}"), &["--stateless", "--json-response"]).await,
        );
    }
    let register = |i: usize| {
        toolgate_tests::Registrant::new(&ep, "scale", &servers[i].endpoint())
            .arg("--instance-id", &format!("s-{i}"))
            .arg("--tools", "echo")
            .spawn(&env, &format!("s-{i}.registrar"))
    };
    let mut registrars: Vec<_> = (0..5).map(register).collect();
    let first5: Vec<String> = servers[..5].iter().map(|s| s.endpoint()).collect();
    stack
        .envoy
        .wait_addresses("scale", &first5, Duration::from_secs(20))
        .await;

    // Watch etcd to know when the last registration landed.
    let mut client = stack.etcd.client().await;
    let mut watch = client
        .watch(
            "/mcp/services/scale/",
            Some(WatchOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    registrars.extend((5..50).map(register));
    let mut puts = 0;
    let mut last_put = Instant::now();
    while puts < 45 {
        let resp = tokio::time::timeout(Duration::from_secs(30), watch.message())
            .await
            .expect("45 registrations within 30 s")
            .unwrap()
            .unwrap();
        for e in resp.events() {
            if e.event_type() == EventType::Put {
                puts += 1;
                last_put = Instant::now();
            }
        }
    }
    let all: Vec<String> = servers.iter().map(|s| s.endpoint()).collect();
    stack
        .envoy
        .wait_addresses("scale", &all, Duration::from_secs(20))
        .await;
    println!(
        "last of 45 registrations -> Envoy has all 50: {:.1} ms (includes admin polling every 10 ms)",
        last_put.elapsed().as_secs_f64() * 1e3
    );

    // Every instance receives calls (round robin over 50).
    let http = reqwest::Client::new();
    for i in 0..150 {
        let r = http
            .post(stack.envoy.url("scale"))
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc":"2.0","id":i,"method":"tools/call","params":{"name":"echo","arguments":{}}}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            StatusCode::OK,
            "{}",
            r.text().await.unwrap_or_default()
        );
    }
    for s in &servers {
        assert!(
            s.calls("echo").await > 0,
            "{} received no call",
            s.instance_id
        );
    }
    drop(registrars);
}

#[tokio::test]
async fn a_revoked_instance_leaves_envoy_and_gets_no_more_calls() {
    let env = TestEnv::new("a_revoked_instance_leaves_envoy_and_gets_no_more_calls");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(
        &env,
        &ep,
        "rev",
        "rev-a",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let b = Member::start(
        &env,
        &ep,
        "rev",
        "rev-b",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack
        .envoy
        .wait_addresses("rev", &endpoints(&[&a, &b]), Duration::from_secs(20))
        .await;

    let mut client = stack.etcd.client().await;
    let mut watch = client.watch(b.key.as_str(), None).await.unwrap();
    b.registrar.signal(Signal::SIGTERM);
    let revoked = loop {
        let resp = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if resp
            .events()
            .iter()
            .any(|e| e.event_type() == EventType::Delete)
        {
            break Instant::now();
        }
    };
    stack
        .envoy
        .wait_addresses("rev", &endpoints(&[&a]), Duration::from_secs(5))
        .await;
    println!(
        "revoke seen in etcd -> gone from Envoy: {:.1} ms (admin polled every 10 ms)",
        revoked.elapsed().as_secs_f64() * 1e3
    );

    let before = b.server.calls("echo").await;
    let mut s = McpSession::connect(&stack.envoy.url("rev")).await;
    for _ in 0..50 {
        let r = s.call_tool("echo", json!({})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    assert_eq!(
        b.server.calls("echo").await,
        before,
        "no call reached the revoked instance"
    );
    assert!(a.server.calls("echo").await >= 50);
}

#[tokio::test]
async fn a_killed_instance_leaves_envoy_when_its_lease_expires() {
    let env = TestEnv::new("a_killed_instance_leaves_envoy_when_its_lease_expires");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(&env, &ep, "crash", "crash-a", &[], 3).await;
    let mut b = Member::start(&env, &ep, "crash", "crash-b", &[], 3).await;
    stack
        .envoy
        .wait_addresses("crash", &endpoints(&[&a, &b]), Duration::from_secs(20))
        .await;
    let killed = Instant::now();
    b.registrar.kill();
    b.server.proc.kill();
    stack
        .envoy
        .wait_addresses("crash", &endpoints(&[&a]), Duration::from_secs(8))
        .await;
    let took = killed.elapsed();
    println!(
        "SIGKILL of instance and registrar -> out of Envoy: {:.2} s (TTL 3 s)",
        took.as_secs_f64()
    );
    assert!(
        took >= Duration::from_secs(1),
        "left before its lease could expire: {took:?}"
    );
}

async fn partition_scenario(name: &str, compact: bool) {
    let env = TestEnv::new(name);
    let etcd = Etcd::start(&env).await;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", etcd.port()).parse().unwrap());
    let xds = Xds::start(&env, "xds", &proxy.endpoint(), &[]).await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let ep = etcd.endpoint();
    let mut old = Vec::new();
    for i in 0..3 {
        old.push(Member::start(&env, &ep, "part", &format!("old-{i}"), &[], TTL).await);
    }
    wait_until(
        "etcd holds 3 instances",
        Duration::from_secs(10),
        || async { etcd_endpoints(&etcd, "part").await.len() == 3 },
    )
    .await;
    envoy
        .wait_addresses(
            "part",
            &etcd_endpoints(&etcd, "part").await,
            Duration::from_secs(20),
        )
        .await;
    let resyncs_before = xds.metric("toolgate_etcd_full_resyncs_total", "").await;

    proxy.cut();
    let cut = Instant::now();
    wait_until("toolgate_etcd_up is 0", Duration::from_secs(10), || async {
        xds.metric("toolgate_etcd_up", "").await == 0.0
    })
    .await;
    let mut new = Vec::new();
    for i in 0..3 {
        new.push(Member::start(&env, &ep, "part", &format!("new-{i}"), &[], TTL).await);
    }
    for m in old.iter_mut().take(2) {
        m.registrar.signal(Signal::SIGTERM);
        m.registrar
            .wait_exit(Duration::from_secs(5))
            .await
            .expect("registrar exits");
    }
    wait_until(
        "etcd holds the new set",
        Duration::from_secs(10),
        || async { etcd_endpoints(&etcd, "part").await.len() == 4 },
    )
    .await;
    assert_eq!(
        envoy.addresses("part").await.len(),
        3,
        "Envoy keeps the last known set while cut"
    );
    if compact {
        // Push the compaction past the revision toolgate-xds last applied.
        let mut c = etcd.client().await;
        c.put("/unrelated", "x", Some(PutOptions::new()))
            .await
            .unwrap();
        etcd.compact().await;
    }
    let left = Duration::from_secs(3).saturating_sub(cut.elapsed());
    tokio::time::sleep(left).await;
    proxy.restore();

    let want = etcd_endpoints(&etcd, "part").await;
    let took = envoy
        .wait_addresses("part", &want, Duration::from_secs(15))
        .await;
    println!(
        "partition healed -> Envoy equals etcd in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    wait_until("toolgate_etcd_up is 1", Duration::from_secs(10), || async {
        xds.metric("toolgate_etcd_up", "").await == 1.0
    })
    .await;
    let resyncs = xds.metric("toolgate_etcd_full_resyncs_total", "").await;
    if compact {
        assert!(
            resyncs > resyncs_before,
            "a compaction forces a full resync"
        );
    } else {
        assert_eq!(resyncs, resyncs_before, "the watch resumed; no full resync");
        assert!(xds.metric("toolgate_etcd_watch_resumes_total", "").await >= 1.0);
    }
}

#[tokio::test]
async fn a_partition_from_etcd_heals_by_resuming_the_watch() {
    partition_scenario("a_partition_from_etcd_heals_by_resuming_the_watch", false).await;
}

#[tokio::test]
async fn a_compaction_during_a_partition_forces_a_full_resync() {
    partition_scenario("a_compaction_during_a_partition_forces_a_full_resync", true).await;
}

/// (calls that succeeded, calls that failed, what the failures said)
type CallTally = (u32, u32, Vec<String>);

/// Calls the service at `url` through Envoy until the returned sender says stop.
fn steady_calls(
    url: String,
) -> (
    tokio::task::JoinHandle<CallTally>,
    tokio::sync::watch::Sender<bool>,
) {
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let (mut ok, mut failed, mut errors) = (0, 0, Vec::new());
        let mut i = 0u64;
        while !*stopped.borrow_and_update() {
            i += 1;
            let r = http
                .post(&url)
                .header("accept", "application/json, text/event-stream")
                .json(&json!({"jsonrpc":"2.0","id":i,"method":"tools/call","params":{"name":"echo","arguments":{}}}))
                .send()
                .await;
            match r {
                Ok(r) if r.status() == StatusCode::OK => ok += 1,
                Ok(r) => {
                    failed += 1;
                    errors.push(format!(
                        "HTTP {}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    ));
                }
                Err(e) => {
                    failed += 1;
                    errors.push(e.to_string());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (ok, failed, errors)
    });
    (task, stop)
}

#[tokio::test]
async fn with_etcd_gone_the_gateway_keeps_routing_even_across_a_control_plane_restart() {
    let env = TestEnv::new(
        "with_etcd_gone_the_gateway_keeps_routing_even_across_a_control_plane_restart",
    );
    let mut stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(
        &env,
        &ep,
        "keep",
        "keep-a",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let b = Member::start(
        &env,
        &ep,
        "keep",
        "keep-b",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack
        .envoy
        .wait_addresses("keep", &endpoints(&[&a, &b]), Duration::from_secs(20))
        .await;
    // The restart below must find both instances in the state dir: wait until it has them.
    let state = env.path("xds.state").join("registry.json");
    wait_until(
        "the state dir holds keep-a and keep-b",
        Duration::from_secs(10),
        || async {
            let Ok(bytes) = std::fs::read(&state) else {
                return false;
            };
            let Ok(saved) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                return false;
            };
            let keys: BTreeSet<&str> = saved["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|kv| kv[0].as_str())
                .collect();
            keys.contains(a.key.as_str()) && keys.contains(b.key.as_str())
        },
    )
    .await;

    let (calls, stop) = steady_calls(stack.envoy.url("keep"));
    stack.etcd.kill();
    wait_until("toolgate_etcd_up is 0", Duration::from_secs(10), || async {
        stack.xds.metric("toolgate_etcd_up", "").await == 0.0
    })
    .await;
    assert_eq!(
        stack.envoy.addresses("keep").await.len(),
        2,
        "last known endpoints kept"
    );

    stack.xds.restart(&env).await;
    wait_until(
        "the restarted toolgate-xds serves its state-dir snapshot",
        Duration::from_secs(15),
        || async { stack.xds.log().contains("serving the state-dir snapshot") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        stack.envoy.addresses("keep").await.len(),
        2,
        "Envoy keeps both endpoints"
    );
    assert_eq!(stack.xds.metric("toolgate_etcd_up", "").await, 0.0);
    let reg = stack.xds.registry().await;
    assert_eq!(reg["instances"], 2, "registry from the snapshot: {reg}");

    stack.etcd.restart(&env).await;
    let c = Member::start(
        &env,
        &ep,
        "keep",
        "keep-c",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack
        .envoy
        .wait_addresses("keep", &endpoints(&[&a, &b, &c]), Duration::from_secs(30))
        .await;
    let _ = stop.send(true);
    let (ok, failed, errors) = calls.await.unwrap();
    println!("calls during the outage: {ok} ok, {failed} failed");
    assert!(ok > 20, "calls kept flowing: {ok}");
    assert_eq!(failed, 0, "no call failed: {errors:?}");
}

#[tokio::test]
async fn a_control_plane_restart_never_empties_envoy() {
    let env = TestEnv::new("a_control_plane_restart_never_empties_envoy");
    let mut stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(
        &env,
        &ep,
        "cp",
        "cp-a",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let b = Member::start(
        &env,
        &ep,
        "cp",
        "cp-b",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack
        .envoy
        .wait_addresses("cp", &endpoints(&[&a, &b]), Duration::from_secs(20))
        .await;

    let (calls, stop) = steady_calls(stack.envoy.url("cp"));
    stack.xds.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        stack.envoy.addresses("cp").await.len(),
        2,
        "Envoy keeps routing without its control plane"
    );

    // Watch Envoy's view continuously across the restart.
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let (done_tx, mut done_rx) = tokio::sync::watch::channel(false);
    let admin = stack.envoy.admin_url();
    let watcher = tokio::spawn(async move {
        let envoy_view = toolgate_tests::envoy::AdminView::new(admin);
        let mut min = usize::MAX;
        while !*done_rx.borrow_and_update() {
            min = min.min(envoy_view.count("cp").await);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = seen_tx.send(min);
    });
    stack.xds.restart(&env).await;
    let c = Member::start(
        &env,
        &ep,
        "cp",
        "cp-c",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack
        .envoy
        .wait_addresses("cp", &endpoints(&[&a, &b, &c]), Duration::from_secs(20))
        .await;
    let _ = done_tx.send(true);
    watcher.await.unwrap();
    let min = seen_rx.await.unwrap();
    assert!(
        min >= 2,
        "Envoy's endpoints dropped to {min} during the restart"
    );
    let _ = stop.send(true);
    let (ok, failed, errors) = calls.await.unwrap();
    assert!(ok > 10);
    assert_eq!(failed, 0, "{errors:?}");
}

#[tokio::test]
async fn a_restarted_envoy_and_a_second_envoy_both_converge() {
    let env = TestEnv::new("a_restarted_envoy_and_a_second_envoy_both_converge");
    let mut stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(&env, &ep, "two", "two-a", &[], TTL).await;
    let b = Member::start(&env, &ep, "other", "other-a", &[], TTL).await;
    stack
        .envoy
        .wait_addresses("two", &endpoints(&[&a]), Duration::from_secs(20))
        .await;
    stack.envoy.restart(&env).await;
    stack
        .envoy
        .wait_addresses("two", &endpoints(&[&a]), Duration::from_secs(20))
        .await;
    stack
        .envoy
        .wait_addresses("other", &endpoints(&[&b]), Duration::from_secs(20))
        .await;

    let second = Envoy::start(&env, "envoy2", &stack.xds).await;
    second
        .wait_addresses("two", &endpoints(&[&a]), Duration::from_secs(20))
        .await;
    let c = Member::start(&env, &ep, "two", "two-c", &[], TTL).await;
    for envoy in [&stack.envoy, &second] {
        envoy
            .wait_addresses("two", &endpoints(&[&a, &c]), Duration::from_secs(20))
            .await;
        let mut s = McpSession::connect(&envoy.url("other")).await;
        assert_eq!(s.call_tool("echo", json!({})).await.status, StatusCode::OK);
    }
    assert_eq!(
        stack.xds.metric("toolgate_xds_connected_envoys", "").await,
        2.0
    );
}

#[tokio::test]
async fn garbage_in_the_registry_is_ignored_counted_and_harmless() {
    let env = TestEnv::new("garbage_in_the_registry_is_ignored_counted_and_harmless");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(&env, &ep, "inv", "inv-a", &[], TTL).await;
    stack
        .envoy
        .wait_addresses("inv", &endpoints(&[&a]), Duration::from_secs(20))
        .await;

    let mut c = stack.etcd.client().await;
    let garbage: [(&str, &str); 5] = [
        ("/mcp/services/inv/broken", "{not json"),
        (
            "/mcp/services/inv/bad-ep",
            r#"{"instance_id":"bad-ep","endpoint":"not-an-endpoint"}"#,
        ),
        (
            "/mcp/services/in v/x",
            r#"{"instance_id":"x","endpoint":"127.0.0.1:1"}"#,
        ),
        (
            "/mcp/services/inv/a/b",
            r#"{"instance_id":"b","endpoint":"127.0.0.1:1"}"#,
        ),
        (
            "/mcp/services/inv/zero",
            r#"{"instance_id":"zero","endpoint":"0.0.0.0:9"}"#,
        ),
    ];
    for (k, v) in garbage {
        c.put(k, v, None).await.unwrap();
    }
    wait_until(
        "five invalid values counted",
        Duration::from_secs(10),
        || async {
            stack
                .xds
                .metric("toolgate_registry_invalid_values_total", "")
                .await
                >= 5.0
        },
    )
    .await;
    let log = stack.xds.log();
    for (k, _) in garbage {
        assert!(log.contains(k), "the log names the key {k}");
    }
    assert_eq!(
        stack.envoy.addresses("inv").await,
        endpoints(&[&a]),
        "the valid instance keeps serving"
    );
    assert!(!stack.envoy.hosts().await.contains_key("in v"));
    let mut s = McpSession::connect(&stack.envoy.url("inv")).await;
    assert_eq!(s.call_tool("echo", json!({})).await.status, StatusCode::OK);
    // A valid instance overwritten with garbage keeps its last good value.
    c.put(a.key.as_str(), "garbage", None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stack.envoy.addresses("inv").await, endpoints(&[&a]));
    let names: BTreeSet<String> = stack.envoy.hosts().await.into_keys().collect();
    assert_eq!(names, BTreeSet::from(["inv".to_string()]));
}

#[tokio::test]
async fn a_configuration_envoy_rejects_is_nacked_once_and_not_resent() {
    let env = TestEnv::new("a_configuration_envoy_rejects_is_nacked_once_and_not_resent");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &[],
        &[("TOOLGATE_FAILPOINT_NACK_SERVICE", "poison")],
    )
    .await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let ep = etcd.endpoint();
    let good = Member::start(&env, &ep, "good", "good-1", &[], TTL).await;
    envoy
        .wait_addresses("good", &endpoints(&[&good]), Duration::from_secs(20))
        .await;
    let cds_before = xds
        .metric("toolgate_xds_pushes_total", "type=\"cds\"")
        .await;

    // The poisoned service's cluster is invalid: Envoy rejects that CDS version.
    let poison = Member::start(&env, &ep, "poison", "poison-1", &[], TTL).await;
    wait_until(
        "Envoy NACKs the poisoned CDS version",
        Duration::from_secs(10),
        || async { xds.metric("toolgate_xds_nacks_total", "type=\"cds\"").await >= 1.0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let nacks = xds.metric("toolgate_xds_nacks_total", "type=\"cds\"").await;
    let cds = xds
        .metric("toolgate_xds_pushes_total", "type=\"cds\"")
        .await;
    assert_eq!(nacks, 1.0, "one NACK for one rejected version");
    assert_eq!(
        cds - cds_before,
        1.0,
        "the rejected version was sent once, not in a loop"
    );
    assert!(xds.log().contains("Envoy rejected an xDS response (NACK)"));
    assert!(!envoy.hosts().await.contains_key("poison"));

    // The rest keeps working, and later changes still propagate.
    let mut s = McpSession::connect(&envoy.url("good")).await;
    assert_eq!(s.call_tool("echo", json!({})).await.status, StatusCode::OK);
    let good2 = Member::start(&env, &ep, "good", "good-2", &[], TTL).await;
    envoy
        .wait_addresses(
            "good",
            &endpoints(&[&good, &good2]),
            Duration::from_secs(10),
        )
        .await;
    drop(poison);
}

#[tokio::test]
async fn a_refused_registration_is_not_a_mismatch_and_causes_no_resync() {
    let env = TestEnv::new("a_refused_registration_is_not_a_mismatch_and_causes_no_resync");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--allowed-cidrs", "127.0.0.0/8", "--inspect-interval", "1s"],
    )
    .await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let ep = etcd.endpoint();
    let a = Member::start(&env, &ep, "cidr", "cidr-a", &[], TTL).await;
    envoy
        .wait_addresses("cidr", &endpoints(&[&a]), Duration::from_secs(20))
        .await;

    // A registration outside the allowed networks is refused by the watch...
    let mut c = etcd.client().await;
    c.put(
        "/mcp/services/cidr/outside",
        r#"{"instance_id":"outside","endpoint":"10.1.2.3:8080"}"#,
        None,
    )
    .await
    .unwrap();
    wait_until(
        "the refusal is counted",
        Duration::from_secs(10),
        || async {
            xds.metric(
                "toolgate_registry_invalid_values_total",
                "reason=\"refused_endpoint\"",
            )
            .await
                >= 1.0
        },
    )
    .await;
    // ...and the inspection, reading etcd with the same admission rules, must agree.
    let resyncs = xds.metric("toolgate_etcd_full_resyncs_total", "").await;
    let mismatches = xds
        .metric("toolgate_registry_reconcile_mismatches_total", "")
        .await;
    let inspections = xds.metric("toolgate_registry_inspections_total", "").await;
    wait_until(
        "three more inspections ran",
        Duration::from_secs(10),
        || async {
            xds.metric("toolgate_registry_inspections_total", "").await >= inspections + 3.0
        },
    )
    .await;
    assert_eq!(
        xds.metric("toolgate_registry_reconcile_mismatches_total", "")
            .await,
        mismatches,
        "a refused registration is not a mismatch"
    );
    assert_eq!(
        xds.metric("toolgate_etcd_full_resyncs_total", "").await,
        resyncs,
        "no full resync"
    );
    assert!(
        !xds.log().contains("the registry differs from etcd"),
        "no inspection logged a difference"
    );
    assert_eq!(envoy.addresses("cidr").await, endpoints(&[&a]));
}

#[tokio::test]
async fn a_full_resync_keeps_the_last_good_value_of_a_key_now_invalid() {
    let env = TestEnv::new("a_full_resync_keeps_the_last_good_value_of_a_key_now_invalid");
    let etcd = Etcd::start(&env).await;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", etcd.port()).parse().unwrap());
    let xds = Xds::start(&env, "xds", &proxy.endpoint(), &[]).await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let ep = etcd.endpoint();
    let a = Member::start(&env, &ep, "lg", "lg-a", &[], TTL).await;
    envoy
        .wait_addresses("lg", &endpoints(&[&a]), Duration::from_secs(20))
        .await;

    // Its value turns to garbage: the watch refuses it and keeps the last good value.
    let mut c = etcd.client().await;
    c.put(a.key.as_str(), "garbage", None).await.unwrap();
    wait_until(
        "the garbage is counted",
        Duration::from_secs(10),
        || async {
            xds.metric(
                "toolgate_registry_invalid_values_total",
                "reason=\"bad_value\"",
            )
            .await
                >= 1.0
        },
    )
    .await;
    let resyncs = xds.metric("toolgate_etcd_full_resyncs_total", "").await;
    let kept = xds
        .metric("toolgate_registry_kept_last_good_total", "")
        .await;

    // A full resync: cut from etcd, a new instance joins, etcd compacts past the watch.
    proxy.cut();
    wait_until("toolgate_etcd_up is 0", Duration::from_secs(10), || async {
        xds.metric("toolgate_etcd_up", "").await == 0.0
    })
    .await;
    let b = Member::start(&env, &ep, "lg", "lg-b", &[], TTL).await;
    wait_until("etcd holds lg-b", Duration::from_secs(10), || async {
        etcd_endpoints(&etcd, "lg")
            .await
            .contains(&b.server.endpoint())
    })
    .await;
    // Push the compaction past the revision the watch resumes from (lg-b's put).
    c.put("/unrelated", "x", None).await.unwrap();
    etcd.compact().await;
    proxy.restore();
    wait_until("the full resync ran", Duration::from_secs(15), || async {
        xds.metric("toolgate_etcd_full_resyncs_total", "").await > resyncs
    })
    .await;
    // lg-b is only in the resync's read: once Envoy has it, it has the resync's result.
    wait_until(
        "Envoy has the resync's result (lg-b)",
        Duration::from_secs(15),
        || async { envoy.addresses("lg").await.contains(&b.server.endpoint()) },
    )
    .await;
    assert_eq!(
        envoy.addresses("lg").await,
        {
            let mut v = endpoints(&[&a, &b]);
            v.sort();
            v
        },
        "lg-a keeps its last good value across the resync"
    );
    let reg = xds.registry().await;
    let ids: BTreeSet<String> = reg["services"]["lg"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["instance_id"].as_str().map(String::from))
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from(["lg-a".to_string(), "lg-b".to_string()]),
        "{reg}"
    );
    assert!(
        xds.metric("toolgate_registry_kept_last_good_total", "")
            .await
            > kept,
        "the kept value is counted"
    );
}

#[tokio::test]
async fn a_failed_full_sync_is_retried_with_a_fresh_etcd_client() {
    let env = TestEnv::new("a_failed_full_sync_is_retried_with_a_fresh_etcd_client");
    let etcd = Etcd::start(&env).await;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", etcd.port()).parse().unwrap());
    // Cut from the start: without etcd credentials the client is made at once (it connects
    // lazily), and every Get of the prefix fails.
    proxy.cut();
    let xds = Xds::start(&env, "xds", &proxy.endpoint(), &[]).await;
    wait_until(
        "three full syncs failed",
        Duration::from_secs(20),
        || async { xds.log().matches("the Get of the prefix").count() >= 3 },
    )
    .await;
    let failed = xds.log().matches("the Get of the prefix").count();
    let clients = xds.metric("toolgate_etcd_clients_total", "").await;
    println!("{failed} failed full syncs, {clients} etcd clients made");
    assert!(
        clients >= 3.0,
        "a failed full sync keeps no client: the next try makes a fresh one \
         ({failed} failed syncs, {clients} clients)"
    );

    proxy.restore();
    let restored = Instant::now();
    let a = Member::start(&env, &etcd.endpoint(), "fresh", "fresh-a", &[], TTL).await;
    wait_until("toolgate_etcd_up is 1", Duration::from_secs(10), || async {
        xds.metric("toolgate_etcd_up", "").await == 1.0
    })
    .await;
    println!(
        "link restored -> etcd_up 1: {} ms",
        restored.elapsed().as_millis()
    );
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    envoy
        .wait_addresses("fresh", &endpoints(&[&a]), Duration::from_secs(20))
        .await;
}

/// A change just before a graceful stop is in the state dir: the periodic writer can be up to
/// 250 ms behind, so toolgate-xds writes the snapshot once more as it stops.
#[tokio::test]
async fn a_change_just_before_a_stop_is_in_the_state_dir() {
    let env = TestEnv::new("a_change_just_before_a_stop_is_in_the_state_dir");
    let mut stack = stack(&env).await;
    let state = env.path("xds.state").join("registry.json");
    let saved_keys = || -> BTreeSet<String> {
        std::fs::read(&state)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .map(|saved| {
                saved["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|kv| Some(kv[0].as_str()?.to_string()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut c = stack.etcd.client().await;
    for (i, id) in ["late-a", "late-b"].into_iter().enumerate() {
        let key = format!("/mcp/services/late/{id}");
        let value = json!({"instance_id": id, "endpoint": format!("127.0.0.1:{}", 20_000 + i)});
        c.put(key.clone(), value.to_string(), None)
            .await
            .expect("etcd put");
        if i == 0 {
            // Written: the writer now pauses, and late-b arrives during its pause.
            wait_until(
                "the state dir holds late-a",
                Duration::from_secs(10),
                || {
                    let key = key.clone();
                    let keys = saved_keys();
                    async move { keys.contains(&key) }
                },
            )
            .await;
        }
    }
    wait_until(
        "toolgate-xds has late-b",
        Duration::from_secs(10),
        || async {
            stack.xds.registry().await["services"]["late"]
                .as_array()
                .is_some_and(|v| v.iter().any(|i| i["instance_id"] == "late-b"))
        },
    )
    .await;
    stack.xds.stop().await;
    assert!(
        saved_keys().contains("/mcp/services/late/late-b"),
        "the state dir after a graceful stop: {:?}",
        saved_keys()
    );
}

#[tokio::test]
async fn envoys_sharded_by_service_get_only_their_services() {
    let env = TestEnv::new("envoys_sharded_by_service_get_only_their_services");
    let stack = stack(&env).await;
    let ep = stack.etcd.endpoint();
    let alpha = Member::start(&env, &ep, "alpha", "alpha-1", &[], TTL).await;
    let beta = Member::start(&env, &ep, "beta", "beta-1", &[], TTL).await;
    // One shard with the filter (its catalog is cut too), one without; the stack's Envoy
    // serves every service.
    let shard_a =
        Envoy::start_with_filter(&env, "envoy-a", &stack.xds, 1, &["--services", "alpha*"]).await;
    let shard_b = Envoy::start_with(
        &env,
        "envoy-b",
        &stack.xds,
        1,
        &["--services", "beta,gamma"],
    )
    .await;
    for (envoy, services) in [
        (&shard_a, &[("alpha", &alpha)][..]),
        (&shard_b, &[("beta", &beta)][..]),
        (&stack.envoy, &[("alpha", &alpha), ("beta", &beta)][..]),
    ] {
        for (service, member) in services {
            envoy
                .wait_addresses(service, &endpoints(&[member]), Duration::from_secs(20))
                .await;
            let mut s = McpSession::connect(&envoy.url(service)).await;
            let r = s.call_tool("echo", json!({"x": 1})).await;
            assert_eq!(r.status, StatusCode::OK, "{service}: {}", r.body);
        }
    }

    // A shard has no cluster, no route and no catalog entry of another shard's service.
    for (envoy, foreign) in [(&shard_a, "beta"), (&shard_b, "alpha")] {
        let clusters: Vec<String> = envoy.hosts().await.into_keys().collect();
        assert!(
            !clusters.iter().any(|c| c == foreign),
            "{foreign} is not this shard's: {clusters:?}"
        );
        let r = McpSession::unconnected(&envoy.url(foreign))
            .initialize()
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{foreign}: {}", r.body);
    }
    // The aggregate endpoint is not sharded: a shard's `/mcp` reaches its own services'
    // tools, and another shard's get Envoy's 404.
    let base = shard_a.url("").trim_end_matches("/mcp/").to_string();
    for name in ["alpha__echo", "beta__echo"] {
        let resp = reqwest::Client::new()
            .post(format!("{base}/mcp"))
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 41, "method": "tools/call",
                "params": {"name": name, "arguments": {}}}))
            .send()
            .await
            .expect("the gateway answers");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        // Its own service's tool reaches the server (which asks for a session: the lab
        // speaks a revision with sessions); the other shard's has no route here.
        if name.starts_with("beta") {
            assert_eq!(status, StatusCode::NOT_FOUND, "{name}: {text}");
        } else {
            assert_ne!(status, StatusCode::NOT_FOUND, "{name}: {text}");
        }
    }
    let catalog = |config: Option<serde_json::Value>| -> Vec<String> {
        config
            .and_then(|c| c["catalog"].as_object().cloned())
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(catalog(shard_a.filter_config().await), ["alpha"]);

    // A new service reaches its shard (and the unsharded Envoy); the other shard's route
    // configuration is not even reloaded.
    let rds_reloads = "http.toolgate.rds.toolgate_routes.config_reload";
    let b_reloads = shard_b.stat(rds_reloads).await;
    assert!(b_reloads >= 1, "shard b loaded its routes once at least");
    let alpha2 = Member::start(&env, &ep, "alpha2", "alpha2-1", &[], TTL).await;
    for envoy in [&shard_a, &stack.envoy] {
        envoy
            .wait_addresses("alpha2", &endpoints(&[&alpha2]), Duration::from_secs(20))
            .await;
        let mut s = McpSession::connect(&envoy.url("alpha2")).await;
        assert_eq!(s.call_tool("echo", json!({})).await.status, StatusCode::OK);
    }
    wait_until(
        "shard a's catalog lists alpha2",
        Duration::from_secs(10),
        || async { catalog(shard_a.filter_config().await) == ["alpha", "alpha2"] },
    )
    .await;
    assert!(!shard_b.hosts().await.contains_key("alpha2"));
    assert_eq!(shard_b.stat(rds_reloads).await, b_reloads);

    // The operator sees which Envoy serves what.
    let envoys: serde_json::Value = reqwest::get(format!("{}/v1/envoys", stack.xds.admin_url()))
        .await
        .expect("GET /v1/envoys")
        .json()
        .await
        .expect("JSON");
    let services_of = |node: &str| {
        envoys["envoys"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["node"] == node))
            .map(|e| e["services"].clone())
    };
    assert_eq!(services_of("envoy-a"), Some(json!("alpha*")), "{envoys}");
    assert_eq!(
        services_of("envoy-b"),
        Some(json!("beta,gamma")),
        "{envoys}"
    );
    assert_eq!(
        services_of("envoy"),
        Some(serde_json::Value::Null),
        "{envoys}"
    );
}

#[tokio::test]
async fn a_registry_of_many_pages_is_read_whole_and_inspected() {
    let env = TestEnv::new("a_registry_of_many_pages_is_read_whole_and_inspected");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let lease = client.lease_grant(120, None).await.expect("lease").id();
    // More than two pages of the paged read (1,000 keys each), registered before
    // toolgate-xds starts: its first read is the paged Get, then an inspection reads them
    // all again at the registry's revision.
    const N: usize = 2_500;
    futures::stream::iter(0..N)
        .map(|i| {
            let mut c = client.clone();
            async move {
                let value = json!({
                    "instance_id": format!("i-{i}"),
                    "endpoint": format!("127.0.{}.{}:{}", 1 + i / 250, 1 + i % 250, 10_000 + i),
                    "tools": ["t"],
                });
                c.put(
                    format!("/mcp/services/s{}/i-{i}", i / 10),
                    value.to_string(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .expect("registrations");
    let xds = Xds::start(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--no-probes", "--inspect-interval", "1s"],
    )
    .await;
    wait_until(
        "every registration read",
        Duration::from_secs(20),
        || async { xds.metric("toolgate_registry_instances", "").await == N as f64 },
    )
    .await;
    wait_until(
        "an inspection found the registry equal to etcd",
        Duration::from_secs(20),
        || async { xds.log().contains("inspection: registry matches etcd") },
    )
    .await;
    assert!(
        !xds.log().contains("differs from etcd"),
        "the paged reads agree"
    );
}
