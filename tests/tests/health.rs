//! Instance health beyond the lease, end to end: real etcd, toolgate-xds with active probes,
//! Envoy with the filter reporting call outcomes, lab servers with their registrars.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;
use toolgate_tests::{
    cpu_ticks, rss_kib, wait_until, Etcd, McpServer, McpSession, Member, Options, Registrant,
    Stack, TestEnv, Xds,
};

const TTL: u32 = 10;

async fn stateless_member(
    env: &TestEnv,
    etcd: &str,
    service: &str,
    id: &str,
    extra: &[&str],
) -> Member {
    let mut args = vec!["--stateless", "--json-response"];
    args.extend_from_slice(extra);
    Member::start(env, etcd, service, id, &args, TTL).await
}

/// One `echo` call; true when the tool answered (not a semantic failure reply). Stateless
/// servers: every call is balanced on its own.
async fn echo(s: &mut McpSession) -> bool {
    let r = s.call_tool("echo", json!({"text": "hi"})).await;
    r.result().is_some_and(|res| res["isError"] != true)
}

#[tokio::test]
async fn a_new_instance_is_probed_at_once_not_after_a_probe_interval() {
    let env = TestEnv::new("health_probed_at_once");
    // A long interval: only an immediate probe can make the instance routable in time.
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&["--probe-interval", "20s", "--probe-timeout", "1s"]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let server = McpServer::lab(&env, "fresh-1", &["--stateless", "--json-response"]).await;
    let started = Instant::now();
    let _registrar = Registrant::new(&ep, "fresh", &server.endpoint())
        .arg("--instance-id", "fresh-1")
        .arg("--tools", "echo")
        .spawn(&env, "fresh-1.registrar");
    wait_until("envoy routes fresh-1", Duration::from_secs(10), || async {
        stack.healthy("fresh").await == vec![server.endpoint()]
    })
    .await;
    let took = started.elapsed();
    println!(
        "registrar start -> routed by Envoy: {} ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(5),
        "routed after {took:?}, a probe interval is 20 s"
    );
    let inst = stack.instance("fresh", "fresh-1").await;
    assert_eq!(inst["state"], "UP", "{inst}");
    assert_eq!(inst["probes"].as_array().map(Vec::len), Some(1), "{inst}");
    assert_eq!(inst["probes"][0]["ok"], true, "{inst}");
    assert!(echo(&mut McpSession::connect(&stack.envoy.url("fresh")).await).await);

    // A registration whose health check fails from the start is never routed.
    let sick = McpServer::lab(
        &env,
        "fresh-2",
        &["--stateless", "--json-response", "--health-fail"],
    )
    .await;
    let _r2 = Registrant::new(&ep, "fresh", &sick.endpoint())
        .arg("--instance-id", "fresh-2")
        .arg("--tools", "echo")
        .spawn(&env, "fresh-2.registrar");
    wait_until("fresh-2 probed", Duration::from_secs(10), || async {
        stack.instance("fresh", "fresh-2").await["probes"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    })
    .await;
    let inst = stack.instance("fresh", "fresh-2").await;
    assert_eq!(inst["state"], "UNKNOWN", "{inst}");
    assert_eq!(
        inst["probes"][0]["detail"], "HTTP 503 on GET /health",
        "{inst}"
    );
    assert!(
        inst["cause"]
            .as_str()
            .is_some_and(|c| c.contains("HTTP 503 on GET /health")),
        "an instance never routed says why: {inst}"
    );
    assert_eq!(stack.healthy("fresh").await, vec![server.endpoint()]);
    assert!(
        stack.envoy.hosts().await["fresh"]
            .iter()
            .all(|h| h.address != sick.endpoint()),
        "an UNKNOWN instance is not given to Envoy at all"
    );
}

#[tokio::test]
async fn a_failing_health_check_drains_the_instance_and_its_recovery_brings_traffic_back() {
    let env = TestEnv::new("health_drain");
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&["--probe-interval", "500ms", "--probe-timeout", "300ms"]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let a = stateless_member(&env, &ep, "drain", "drain-a", &["--latency-ms", "2500"]).await;
    let b = stateless_member(&env, &ep, "drain", "drain-b", &[]).await;
    stack
        .wait_healthy("drain", &[&a, &b], Duration::from_secs(20))
        .await;
    let url = stack.envoy.url("drain");
    let mut s = McpSession::connect(&url).await;

    // Slow calls in flight, some of them on `a` (round robin over two instances).
    let inflight: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { echo(&mut McpSession::connect(&url).await).await })
        })
        .collect();
    wait_until(
        "a slow call reached drain-a",
        Duration::from_secs(5),
        || async { a.server.calls("echo").await >= 1 },
    )
    .await;
    a.server.set(json!({"health_fail": true})).await;
    let took = stack
        .wait_state("drain", "drain-a", "SUSPECT", Duration::from_secs(10))
        .await;
    // Expected: two probe intervals, 1 s (plus probe time). The bound is generous for a loaded
    // machine; `make bench` (removal suite) keeps the real figure, at the default interval.
    println!(
        "health failing -> SUSPECT: measured {} ms; expected about 1000 ms (two probes 500 ms apart), bound 4000 ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(4),
        "health failing -> SUSPECT took {took:?}; expected about 1 s, bound 4 s"
    );
    wait_until("envoy drains drain-a", Duration::from_secs(5), || async {
        stack.envoy.hosts().await.get("drain").is_some_and(|h| {
            h.iter()
                .any(|h| h.address == a.server.endpoint() && h.health == "DRAINING")
        })
    })
    .await;
    let a_calls = a.server.calls("echo").await;
    for t in inflight {
        assert!(
            t.await.expect("call task"),
            "a call in flight on a draining instance finishes"
        );
    }
    // New calls go to b only; a's fast path would answer quickly, so set its latency to 0.
    a.server.set(json!({"latency_ms": 0})).await;
    for _ in 0..20 {
        assert!(echo(&mut s).await);
    }
    assert_eq!(
        a.server.calls("echo").await,
        a_calls,
        "no new call reached the SUSPECT instance"
    );

    a.server.set(json!({"health_fail": false})).await;
    stack
        .wait_state("drain", "drain-a", "UP", Duration::from_secs(10))
        .await;
    stack
        .wait_healthy("drain", &[&a, &b], Duration::from_secs(10))
        .await;
    for _ in 0..20 {
        assert!(echo(&mut s).await);
    }
    assert!(
        a.server.calls("echo").await > a_calls,
        "traffic came back to drain-a"
    );
    let inst = stack.instance("drain", "drain-a").await;
    assert!(
        inst["cause"]
            .as_str()
            .unwrap_or("")
            .contains("probe passed"),
        "{inst}"
    );
}

#[tokio::test]
async fn a_frozen_server_is_a_zombie_down_after_the_window_and_back_on_sigcont() {
    let env = TestEnv::new("health_frozen");
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&[
            "--probe-interval",
            "500ms",
            "--probe-timeout",
            "300ms",
            "--down-window",
            "3s",
        ]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let a = stateless_member(&env, &ep, "frz", "frz-a", &[]).await;
    let b = stateless_member(&env, &ep, "frz", "frz-b", &[]).await;
    stack
        .wait_healthy("frz", &[&a, &b], Duration::from_secs(20))
        .await;

    a.server.proc.signal(Signal::SIGSTOP);
    let suspect = stack
        .wait_state("frz", "frz-a", "SUSPECT", Duration::from_secs(10))
        .await;
    let down = stack
        .wait_state("frz", "frz-a", "DOWN", Duration::from_secs(15))
        .await;
    println!(
        "SIGSTOP -> SUSPECT {} ms, then -> DOWN {} ms later (down window 3 s)",
        suspect.as_millis(),
        down.as_millis()
    );
    wait_until("frz-a out of envoy", Duration::from_secs(5), || async {
        stack
            .envoy
            .hosts()
            .await
            .get("frz")
            .is_some_and(|h| h.iter().all(|h| h.address != a.server.endpoint()))
    })
    .await;
    // The lease is alive all along: the registrar kept it.
    assert!(stack.instance("frz", "frz-a").await["lease"].is_string());
    let zombie = stack
        .xds
        .metric("mcp_registry_zombie_instance_ratio", "service=\"frz\"")
        .await;
    assert!(
        (zombie - 0.5).abs() < 1e-9,
        "one of two instances is a zombie: {zombie}"
    );
    assert_eq!(
        stack
            .xds
            .metric("mcp_registry_instances", "service=\"frz\",state=\"DOWN\"")
            .await,
        1.0
    );
    let detections = stack
        .xds
        .metric(
            "mcp_registry_state_transition_latency_seconds_count",
            "from=\"UP\",to=\"SUSPECT\"",
        )
        .await;
    assert!(detections >= 1.0, "SUSPECT's detection time is measured");
    let inst = stack.instance("frz", "frz-a").await;
    assert!(
        inst["cause"]
            .as_str()
            .unwrap_or("")
            .contains("while the lease is alive"),
        "{inst}"
    );

    a.server.proc.signal(Signal::SIGCONT);
    stack
        .wait_state("frz", "frz-a", "UP", Duration::from_secs(10))
        .await;
    stack
        .wait_healthy("frz", &[&a, &b], Duration::from_secs(10))
        .await;
    assert_eq!(
        stack
            .xds
            .metric("mcp_registry_zombie_instance_ratio", "service=\"frz\"")
            .await,
        0.0
    );
}

#[tokio::test]
async fn a_killed_server_leaves_rotation_at_its_next_probe_not_the_lease_ttl() {
    let env = TestEnv::new("health_killed");
    // The crash watch off: the next probe must find the crash by itself.
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&[
            "--probe-interval",
            "1s",
            "--probe-timeout",
            "500ms",
            "--probe-watch-limit",
            "0",
        ]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    // The registrar does not watch its server: the probes alone must find the crash.
    let stateless = ["--stateless", "--json-response"];
    let mut a = Member::start_unwatched(&env, &ep, "kill", "kill-a", &stateless, TTL).await;
    let b = Member::start_unwatched(&env, &ep, "kill", "kill-b", &stateless, TTL).await;
    stack
        .wait_healthy("kill", &[&a, &b], Duration::from_secs(20))
        .await;

    let killed = Instant::now();
    a.server.proc.kill();
    stack
        .wait_healthy("kill", &[&b], Duration::from_secs(8))
        .await;
    let took = killed.elapsed();
    // Expected: the next probe, at most one interval (1 s, +10% jitter): its connection is
    // refused, which is certain, so no second probe is waited for. The bound is generous but
    // well under the lease TTL, which is what removal would wait for without probes; `make
    // bench` (removal suite) keeps the real figure, at the default interval.
    println!(
        "SIGKILL (registrar alive, lease TTL {TTL} s) -> out of rotation: measured {} ms; expected under 1100 ms (the next probe, 1 s interval), bound 4000 ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(4),
        "out of rotation after {took:?}; expected under 1.1 s, bound 4 s (the lease TTL is {TTL} s)"
    );
    assert!(
        a.registrar.is_running(),
        "the registrar still holds the lease"
    );
    assert_suspect_refused(&stack, "kill", "kill-a").await;
}

/// The killed instance is SUSPECT, and its cause says its connection was refused.
async fn assert_suspect_refused(stack: &Stack, service: &str, id: &str) {
    let detail = stack.instance(service, id).await;
    assert_eq!(detail["state"], "SUSPECT", "{detail}");
    assert!(
        detail["cause"]
            .as_str()
            .unwrap_or_default()
            .contains("refused"),
        "the cause says the connection was refused: {detail}"
    );
}

#[tokio::test]
async fn a_killed_server_leaves_rotation_when_its_kernel_closes_the_held_connection_and_is_back_soon_after_a_restart(
) {
    let env = TestEnv::new("health_killed_watch");
    // A probe interval far longer than the bounds: only the crash watch can meet the first,
    // and only the quick probes after a refusal the second.
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&["--probe-interval", "30s", "--probe-timeout", "1s"]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let stateless = ["--stateless", "--json-response"];
    let mut a = Member::start_unwatched(&env, &ep, "crash", "crash-a", &stateless, TTL).await;
    let b = Member::start_unwatched(&env, &ep, "crash", "crash-b", &stateless, TTL).await;
    stack
        .wait_healthy("crash", &[&a, &b], Duration::from_secs(20))
        .await;
    wait_until(
        "both instances watched",
        Duration::from_secs(10),
        || async { stack.xds.metric("toolgate_health_probe_watches", "").await == 2.0 },
    )
    .await;
    let probes = stack.xds.metric("toolgate_health_probes_total", "").await;
    let b_probes = stack.instance("crash", "crash-b").await["probes"].clone();

    let killed = Instant::now();
    a.server.proc.kill();
    stack
        .wait_healthy("crash", &[&b], Duration::from_secs(10))
        .await;
    let took = killed.elapsed();
    println!(
        "SIGKILL (registrar alive, lease TTL {TTL} s, probe interval 30 s) -> out of rotation: {} ms; bound 3000 ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(3),
        "out of rotation after {took:?}: the held connection's close should have been seen at once (the next probe is up to 33 s away)"
    );
    assert_suspect_refused(&stack, "crash", "crash-a").await;
    assert_eq!(
        stack
            .xds
            .metric("toolgate_health_probe_watch_ends_total", "end=\"gone\"")
            .await,
        1.0
    );
    // The live instance was left alone (no probe), and is still watched.
    assert_eq!(
        stack.instance("crash", "crash-b").await["probes"],
        b_probes,
        "no probe of the live instance"
    );
    assert_eq!(
        stack.xds.metric("toolgate_health_probe_watches", "").await,
        1.0
    );
    assert_eq!(stack.state("crash", "crash-b").await, "UP");

    // Restarted in place, as a supervisor or a container restart in the same pod does: the
    // probes after the refusal come 250 ms, 500 ms, 1 s... apart, not 30 s.
    let port = a.server.port;
    a.server = McpServer::lab_on(&env, "crash-a", port, &stateless).await;
    let listening = Instant::now();
    stack
        .wait_healthy("crash", &[&a, &b], Duration::from_secs(10))
        .await;
    let back = listening.elapsed();
    let spent = stack.xds.metric("toolgate_health_probes_total", "").await - probes;
    println!(
        "restarted on the same address {} ms after the kill -> routed again {} ms after it listened ({spent} probes since the kill, all of crash-a); bound 3000 ms",
        (listening - killed).as_millis(),
        back.as_millis()
    );
    assert!(
        back < Duration::from_secs(3),
        "routed again {back:?} after listening: the probes after a refusal should come within a second or two (the interval is 30 s)"
    );
    // One early probe from the watch, then a few doubling ones: never a probe per tick.
    let since_kill = killed.elapsed().as_secs_f64();
    let most = 2.0 + (since_kill / 0.225).log2().ceil();
    assert!(
        spent <= most,
        "{spent} probes in {since_kill:.1} s since the kill; at most {most} (doubling from 250 ms)"
    );
    assert_eq!(stack.state("crash", "crash-a").await, "UP");
    wait_until(
        "the restarted instance watched again",
        Duration::from_secs(10),
        || async { stack.xds.metric("toolgate_health_probe_watches", "").await == 2.0 },
    )
    .await;
}

#[tokio::test]
async fn a_server_that_serves_one_connection_at_a_time_is_not_blocked_by_the_crash_watch() {
    use std::io::{Read, Write};
    let env = TestEnv::new("health_one_at_a_time");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--probe-interval", "500ms", "--probe-timeout", "300ms"],
    )
    .await;
    // A blocking server loop: one connection at a time, read until the end of the request's
    // head, answer, close. An idle connection held open would stop it answering anyone.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match conn.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            if head.ends_with(b"\r\n\r\n") {
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    let mut c = etcd.client().await;
    let lease = c.lease_grant(30, None).await.expect("lease").id();
    let value = json!({"instance_id": "solo", "endpoint": format!("127.0.0.1:{port}")});
    c.put(
        "/mcp/services/solo/solo",
        value.to_string(),
        Some(etcd_client::PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("put");
    wait_until("the instance UP", Duration::from_secs(20), || async {
        xds.metric("mcp_registry_instances", "service=\"solo\",state=\"UP\"")
            .await
            == 1.0
    })
    .await;
    // Eight probe intervals: the watch blocks the server at once, the next probe goes
    // unanswered, and the watch must let go before a second one does.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let suspect = xds
        .metric("mcp_registry_state_transitions_total", "to=\"SUSPECT\"")
        .await;
    let failed = xds
        .metric("toolgate_health_probes_total", "result=\"fail\"")
        .await;
    let passed = xds
        .metric("toolgate_health_probes_total", "result=\"pass\"")
        .await;
    println!(
        "one connection at a time: {passed} probes passed, {failed} failed, {} requests served, {suspect} SUSPECT",
        served.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(suspect, 0.0, "the held connection made the server SUSPECT");
    assert!(
        failed <= 1.0,
        "{failed} probes failed; one at most, before the watch lets go"
    );
    assert!(
        passed >= 5.0,
        "{passed} probes passed in 4 s at a 500 ms interval"
    );
    assert_eq!(
        xds.metric("toolgate_health_probe_watches", "").await,
        0.0,
        "the instance is no longer watched"
    );
    assert!(
        xds.log().contains("no longer holding one"),
        "toolgate-xds says why it let go"
    );
}

#[tokio::test]
async fn failing_calls_reported_by_the_filter_make_an_instance_unhealthy_with_a_reduced_share() {
    let env = TestEnv::new("health_call_failures");
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&["--probe-interval", "1s", "--probe-timeout", "500ms"]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let bad = stateless_member(&env, &ep, "calls", "calls-bad", &["--fail", "echo=http500"]).await;
    let good = stateless_member(&env, &ep, "calls", "calls-good", &[]).await;
    stack
        .wait_healthy("calls", &[&bad, &good], Duration::from_secs(20))
        .await;
    // Half the tool's calls fail until the bad instance is demoted: keep the tool's breaker
    // closed so the instance-level verdict is what is measured.
    stack
        .policy(
            "calls",
            json!({"failure_rate_percent": 100, "min_calls": 1000}),
        )
        .await;
    let url = stack.envoy.url("calls");
    let mut s = McpSession::connect(&url).await;

    let started = Instant::now();
    while stack.state("calls", "calls-bad").await != "UNHEALTHY" {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "calls-bad never became UNHEALTHY"
        );
        for _ in 0..10 {
            echo(&mut s).await;
        }
    }
    println!(
        "500s on every call -> UNHEALTHY: {} ms",
        started.elapsed().as_millis()
    );
    let inst = stack.instance("calls", "calls-bad").await;
    assert!(
        inst["call_failure_rate"].as_f64().unwrap_or(0.0) > 0.9,
        "{inst}"
    );
    assert!(
        inst["cause"]
            .as_str()
            .unwrap_or("")
            .contains("calls failed"),
        "{inst}"
    );
    assert_eq!(stack.state("calls", "calls-good").await, "UP");
    wait_until(
        "envoy weighs calls-bad down",
        Duration::from_secs(5),
        || async {
            stack.envoy.hosts().await.get("calls").is_some_and(|h| {
                h.iter()
                    .any(|h| h.address == bad.server.endpoint() && h.weight == 10)
                    && h.iter()
                        .any(|h| h.address == good.server.endpoint() && h.weight == 100)
            })
        },
    )
    .await;

    let (bad0, good0) = (
        bad.server.calls("echo").await,
        good.server.calls("echo").await,
    );
    let n = 300;
    for _ in 0..n {
        echo(&mut s).await;
    }
    let bad_n = bad.server.calls("echo").await - bad0;
    let good_n = good.server.calls("echo").await - good0;
    let share = bad_n as f64 / (bad_n + good_n) as f64;
    println!(
        "UNHEALTHY share over {n} calls: {bad_n} of {} = {:.1}% (weight 10 vs 100: 9.1%)",
        bad_n + good_n,
        share * 100.0
    );
    assert!(
        bad_n > 0,
        "an UNHEALTHY instance keeps a reduced weight, never 0"
    );
    assert!(share < 0.2, "share {share}");
    let errors = stack
        .xds
        .metric(
            "mcp_scheduler_routing_error_count_total",
            "service=\"calls\",kind=\"http_5xx\"",
        )
        .await;
    assert!(errors >= 10.0, "routing errors counted: {errors}");
}

#[tokio::test]
async fn with_the_tolerance_option_two_lost_probes_do_not_leave_up() {
    let env = TestEnv::new("health_tolerance");
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&[
            "--probe-interval",
            "1s",
            "--probe-timeout",
            "300ms",
            "--probe-tolerance",
        ]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let a = stateless_member(&env, &ep, "tol", "tol-a", &[]).await;
    stack
        .wait_healthy("tol", &[&a], Duration::from_secs(20))
        .await;

    let failed_in_a_row = || async {
        let inst = stack.instance("tol", "tol-a").await;
        let probes = inst["probes"].as_array().cloned().unwrap_or_default();
        probes.iter().rev().take_while(|p| p["ok"] == false).count()
    };
    a.server.set(json!({"health_fail": true})).await;
    wait_until(
        "two failed probes in a row",
        Duration::from_secs(10),
        || async { failed_in_a_row().await >= 2 },
    )
    .await;
    a.server.set(json!({"health_fail": false})).await;
    assert_eq!(failed_in_a_row().await, 2, "restored before a third probe");
    assert_eq!(stack.state("tol", "tol-a").await, "UP");
    assert_eq!(stack.healthy("tol").await, vec![a.server.endpoint()]);
    wait_until("a probe passes again", Duration::from_secs(5), || async {
        failed_in_a_row().await == 0
    })
    .await;
    assert_eq!(
        stack
            .xds
            .metric(
                "mcp_registry_state_transitions_total",
                "from=\"UP\",to=\"SUSPECT\""
            )
            .await,
        0.0,
        "never left UP"
    );
}

#[tokio::test]
async fn a_stalled_registrar_shows_as_heartbeat_loss_before_its_lease_expires() {
    let env = TestEnv::new("health_heartbeat_loss");
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&[
            "--lease-check-interval",
            "500ms",
            "--inspect-interval",
            "1s",
        ]),
    )
    .await;
    let ep = stack.etcd.endpoint();
    let a = Member::start(&env, &ep, "hb", "hb-a", &[], 9).await;
    stack
        .wait_healthy("hb", &[&a], Duration::from_secs(20))
        .await;
    wait_until("the lease is checked", Duration::from_secs(5), || async {
        stack.instance("hb", "hb-a").await["lease_check"].is_object()
    })
    .await;
    assert_eq!(
        stack
            .xds
            .metric("mcp_registry_heartbeat_loss_rate", "service=\"hb\"")
            .await,
        0.0
    );

    a.registrar.signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    wait_until("heartbeat loss seen", Duration::from_secs(8), || async {
        stack
            .xds
            .metric("mcp_registry_heartbeat_loss_rate", "service=\"hb\"")
            .await
            > 0.0
    })
    .await;
    a.registrar.signal(Signal::SIGCONT);
    println!(
        "registrar stopped -> heartbeat loss seen: {} ms (keepalive every 3 s)",
        stopped.elapsed().as_millis()
    );
    let inst = stack.instance("hb", "hb-a").await;
    assert!(
        inst["lease_check"]["missed_keepalives"]
            .as_u64()
            .unwrap_or(0)
            >= 1,
        "{inst}"
    );
    assert!(
        stack
            .xds
            .metric("mcp_registry_heartbeats_missed_total", "service=\"hb\"")
            .await
            >= 1.0
    );
    wait_until("keepalives resume", Duration::from_secs(8), || async {
        stack
            .xds
            .metric("mcp_registry_heartbeat_loss_rate", "service=\"hb\"")
            .await
            == 0.0
    })
    .await;
    assert_eq!(
        stack.state("hb", "hb-a").await,
        "UP",
        "the lease never expired"
    );
}

#[tokio::test]
async fn five_hundred_instances_are_probed_every_interval() {
    use axum::routing::get;
    let env = TestEnv::new("health_500");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(&env, "xds", &etcd.endpoint(), &["--probe-interval", "2s"]).await;
    // A stand-in health endpoint per instance: 500 listeners in this process.
    let n = 500;
    let mut ports = Vec::new();
    for _ in 0..n {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        ports.push(l.local_addr().expect("addr").port());
        let app = axum::Router::new().route("/health", get(|| async { "ok" }));
        tokio::spawn(async move { axum::serve(l, app).await });
    }
    let mut c = etcd.client().await;
    let lease = c.lease_grant(30, None).await.expect("lease").id();
    let (mut keeper, _stream) = c.lease_keep_alive(lease).await.expect("keepalive");
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            if keeper.keep_alive().await.is_err() {
                return;
            }
        }
    });
    for (i, port) in ports.iter().enumerate() {
        let value =
            json!({"instance_id": format!("i-{i}"), "endpoint": format!("127.0.0.1:{port}")});
        c.put(
            format!("/mcp/services/bulk/i-{i}"),
            value.to_string(),
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .expect("put");
    }
    wait_until("500 instances UP", Duration::from_secs(30), || async {
        xds.metric("mcp_registry_instances", "service=\"bulk\",state=\"UP\"")
            .await
            == n as f64
    })
    .await;
    let pid = xds.pid();
    let (cpu0, probes0, t0) = (
        cpu_ticks(pid),
        xds.metric("toolgate_health_probes_total", "result=\"pass\"")
            .await,
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    let probes = xds
        .metric("toolgate_health_probes_total", "result=\"pass\"")
        .await
        - probes0;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(pid) - cpu0) as f64 / 100.0 / secs;
    let expected = n as f64 * secs / 2.0;
    let rss = rss_kib(pid);
    let watches = xds.metric("toolgate_health_probe_watches", "").await;
    println!(
        "500 instances, interval 2 s: {probes} probes in {secs:.1} s ({:.0}% of one round per interval); toolgate-xds CPU {:.1}% of a core, RSS {} MiB; {watches} connections held by the crash watch",
        probes / expected * 100.0,
        cpu * 100.0,
        rss / 1024
    );
    assert!(
        probes >= expected * 0.85,
        "probe rounds fall behind: {probes} of {expected:.0}"
    );
    // The crash watch holds one idle connection per instance and adds no probe: none of
    // these servers closes its connections, so no probe comes early.
    assert_eq!(watches, n as f64, "one held connection per instance");
    assert!(
        probes <= expected * 1.15,
        "more probes than one round per interval: {probes} of {expected:.0}"
    );
    let failed = xds
        .metric("toolgate_health_probes_total", "result=\"fail\"")
        .await;
    assert_eq!(failed, 0.0);
}
