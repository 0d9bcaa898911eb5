//! The aggregate endpoint survives its toolgate-xds. Two gateways (two toolgate-xds, two
//! Envoys with the filter) share one etcd, the session-sealing key and the report token; each
//! toolgate-xds registers its admin listener under a lease, and each Envoy's control cluster
//! holds both, its own first. SIGKILL gateway A's toolgate-xds while clients initialize, list
//! and call through A's `/mcp`: no request fails, a new client (the official Python SDK)
//! initializes, and A's filter reports to B.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{sdk, wait_until, Envoy, Etcd, McpSession, Member, Reply, TestEnv, Xds};

const TTL: u32 = 10;
const REPORT_TOKEN: &str = "fleet-control-report-token";
/// 32 bytes, base64: every gateway of a fleet seals session ids with the same key.
const SESSION_KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
/// The tool every round calls, as `/mcp` names it.
const TOOL: &str = "svc__echo";
/// The cluster Envoy reaches toolgate-xds's admin listener through.
const CONTROL_CLUSTER: &str = "toolgate_control";

struct Gateway {
    xds: Xds,
    envoy: Envoy,
}

impl Gateway {
    async fn start(env: &TestEnv, name: &str, etcd: &Etcd) -> Gateway {
        let key = env.path("session-key");
        std::fs::write(&key, SESSION_KEY).expect("writing the session key");
        let key = key.to_string_lossy().into_owned();
        let xds = Xds::start_with_env(
            env,
            &format!("{name}.xds"),
            &etcd.endpoint(),
            &[
                "--session-key-file",
                &key,
                "--report-token-env",
                "TOOLGATE_TEST_REPORT_TOKEN",
                "--probe-interval",
                "1s",
                "--probe-timeout",
                "500ms",
                // Every round's new client comes from the same address: the bound on
                // sessions held per caller is not what this file tests.
                "--max-held-sessions-per-caller",
                "100000",
            ],
            &[("TOOLGATE_TEST_REPORT_TOKEN", REPORT_TOKEN)],
        )
        .await;
        let envoy = Envoy::start_with_filter(env, &format!("{name}.envoy"), &xds, 1, &[]).await;
        Gateway { xds, envoy }
    }

    /// `http://127.0.0.1:<port>/mcp`: the aggregate endpoint.
    fn mcp(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.envoy.port)
    }

    /// The control cluster's hosts as this Envoy sees them: (address, priority, healthy).
    async fn control_hosts(&self) -> Vec<(String, u64, bool)> {
        let Ok(resp) =
            reqwest::get(format!("{}/clusters?format=json", self.envoy.admin_url())).await
        else {
            return Vec::new();
        };
        let v: Value = resp.json().await.unwrap_or_default();
        let mut hosts = Vec::new();
        for cluster in v["cluster_statuses"].as_array().into_iter().flatten() {
            if cluster["name"] != CONTROL_CLUSTER {
                continue;
            }
            for h in cluster["host_statuses"].as_array().into_iter().flatten() {
                let sa = &h["address"]["socket_address"];
                let address = format!(
                    "{}:{}",
                    sa["address"].as_str().unwrap_or_default(),
                    sa["port_value"].as_u64().unwrap_or_default()
                );
                let status = &h["health_status"];
                // Healthy: EDS says so and no failure flag (active check, outlier) is set.
                let healthy = status["eds_health_status"].as_str() == Some("HEALTHY")
                    && status
                        .as_object()
                        .is_some_and(|o| !o.keys().any(|k| k.starts_with("failed")));
                hosts.push((address, h["priority"].as_u64().unwrap_or_default(), healthy));
            }
        }
        hosts
    }
}

/// What went wrong with one reply, if anything: not HTTP 200, no JSON-RPC result, or a tool
/// result that is an error.
fn failure(what: &str, r: &Reply) -> Option<String> {
    if r.status != StatusCode::OK {
        return Some(format!("{what}: HTTP {} {}", r.status, r.body));
    }
    let Some(result) = r.result() else {
        return Some(format!("{what}: no result: {}", r.body));
    };
    if result["isError"] == true {
        return Some(format!("{what}: isError: {}", r.body));
    }
    None
}

/// Whether a `tools/list` result lists [`TOOL`].
fn lists_tool(r: &Reply) -> bool {
    r.result()
        .and_then(|res| res["tools"].as_array())
        .is_some_and(|tools| tools.iter().any(|t| t["name"] == TOOL))
}

/// One round through `url`: a new client initializes, lists and calls; the session kept from
/// the start lists and calls. Returns what failed.
async fn round(url: &str, kept: &mut McpSession, n: u64) -> Vec<String> {
    let mut failed = Vec::new();
    let mut fresh = McpSession::unconnected(url);
    let init = fresh.initialize().await;
    if let Some(f) = failure("initialize (new client)", &init) {
        failed.push(f);
        return failed;
    }
    for (who, s) in [("new client", &mut fresh), ("kept session", kept)] {
        let list = s.list_tools().await;
        match failure(&format!("tools/list ({who})"), &list) {
            Some(f) => failed.push(f),
            None if !lists_tool(&list) => {
                failed.push(format!("tools/list ({who}): {TOOL} missing: {}", list.body))
            }
            None => {}
        }
        let call = s.call_tool(TOOL, json!({"round": n})).await;
        if let Some(f) = failure(&format!("tools/call ({who})"), &call) {
            failed.push(f);
        }
    }
    failed
}

/// Two gateways on one etcd, both routing `svc` (a lab, `svc-1`).
async fn svc_behind_two(env: &TestEnv) -> (Etcd, Gateway, Gateway, Member) {
    let etcd = Etcd::start(env).await;
    let a = Gateway::start(env, "a", &etcd).await;
    let b = Gateway::start(env, "b", &etcd).await;
    let m = Member::start(env, &etcd.endpoint(), "svc", "svc-1", &[], TTL).await;
    for gw in [&a, &b] {
        gw.envoy
            .wait_addresses("svc", &[m.server.endpoint()], Duration::from_secs(20))
            .await;
    }
    (etcd, a, b, m)
}

#[tokio::test]
async fn the_aggregate_endpoint_survives_a_sigkill_of_its_toolgate_xds() {
    let env = TestEnv::new("fleet_control_sigkill");
    // A server with sessions: each client of `/mcp` that calls it needs a session the gateway
    // holds, opened through the control cluster.
    let (_etcd, mut a, b, _m) = svc_behind_two(&env).await;
    for gw in [&a, &b] {
        wait_until(
            &format!("{}'s /mcp lists {TOOL}", gw.envoy.name),
            Duration::from_secs(30),
            || async {
                let mut s = McpSession::unconnected(&gw.mcp());
                s.initialize().await.status == StatusCode::OK && lists_tool(&s.list_tools().await)
            },
        )
        .await;
    }
    // Both toolgate-xds in A's control cluster, A's own first, both passing their checks.
    let want = {
        let mut w = vec![(a.xds.admin_addr(), 0, true), (b.xds.admin_addr(), 1, true)];
        w.sort();
        w
    };
    // Not fatal here: what matters is what clients see below (and this says why they fail).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut hosts = a.control_hosts().await;
        hosts.sort();
        if hosts == want {
            break;
        }
        if Instant::now() > deadline {
            println!("A's control cluster never held both toolgate-xds as wanted: {hosts:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Clients through A's `/mcp`, in a loop, from before the kill until well after it.
    let url = a.mcp();
    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<(Duration, String)>>> = Arc::default();
    let rounds = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let clients = {
        let (url, stop, log, rounds) = (url.clone(), stop.clone(), log.clone(), rounds.clone());
        tokio::spawn(async move {
            let mut kept = McpSession::connect(&url).await;
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                for f in round(&url, &mut kept, n).await {
                    log.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((started.elapsed(), f));
                }
                rounds.fetch_add(1, Ordering::Relaxed);
                // Agents pause between calls; each round's new client leaves its session
                // held, so the pace keeps them under the service's bound.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    wait_until(
        "ten rounds before the kill",
        Duration::from_secs(20),
        || {
            let rounds = rounds.clone();
            async move { rounds.load(Ordering::Relaxed) >= 10 }
        },
    )
    .await;
    // A second of steady traffic: held sessions opened, reports sent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before_kill = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        before_kill.is_empty(),
        "failures before the kill: {before_kill:?}"
    );
    // Until now A's filter reported to A.
    let b_calls = || async {
        let reg = b.xds.registry().await;
        reg["services"]["svc"][0]["calls"]["ok"]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(
        b_calls().await,
        0,
        "B got reports before A's toolgate-xds went"
    );
    let killed_at = started.elapsed();
    let rounds_at_kill = rounds.load(Ordering::Relaxed);
    a.xds.kill();
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    tokio::time::timeout(Duration::from_secs(30), clients)
        .await
        .expect("the client loop ends")
        .expect("the client loop did not panic");
    let rounds_after = rounds.load(Ordering::Relaxed) - rounds_at_kill;
    let failures = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!(
        "A's toolgate-xds SIGKILLed at {killed_at:?}; {rounds_after} rounds after it, {} failures",
        failures.len()
    );
    for (at, f) in failures.iter().take(10) {
        println!("  at {at:?}: {f}");
    }
    assert!(
        rounds_after >= 10,
        "only {rounds_after} rounds ran after the kill"
    );
    assert!(
        failures.is_empty(),
        "{} requests through A's /mcp failed after its toolgate-xds was killed; first: {:?}",
        failures.len(),
        failures.first()
    );

    // A new client with the official Python SDK: initialize, list, call.
    let steps = sdk::python(&url, &["initialize", "list", &format!("call:{TOOL}")]).await;
    assert_eq!(steps.len(), 3, "{steps:?}");
    assert!(steps.iter().all(|s| s.get("ok").is_some()), "{steps:?}");
    let listed = steps[1]["ok"]["tools"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(listed.iter().any(|t| t["name"] == TOOL), "{steps:?}");
    assert_ne!(steps[2]["ok"]["isError"], true, "{steps:?}");

    // A's filter reports its calls to B now (B's own Envoy carried none).
    wait_until(
        "B's registry counts calls A's filter reported",
        Duration::from_secs(10),
        || async { b_calls().await > 0 },
    )
    .await;
}

#[tokio::test]
async fn a_toolgate_xds_registers_its_admin_listener_under_a_lease_and_revokes_it_at_stop() {
    let env = TestEnv::new("fleet_control_member");
    let etcd = Etcd::start(&env).await;
    let mut a = Gateway::start(&env, "a", &etcd).await;
    let b = Gateway::start(&env, "b", &etcd).await;
    let members = || async {
        let mut c = etcd.client().await;
        let resp = c
            .get(
                "/mcp/xds/",
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("get /mcp/xds/");
        resp.kvs()
            .iter()
            .map(|kv| {
                let v: Value = serde_json::from_slice(kv.value()).unwrap_or_default();
                (
                    v["admin"].as_str().unwrap_or_default().to_string(),
                    kv.lease(),
                )
            })
            .collect::<Vec<(String, i64)>>()
    };
    wait_until(
        "both toolgate-xds registered",
        Duration::from_secs(10),
        || async { members().await.len() == 2 },
    )
    .await;
    let listed = members().await;
    for gw in [&a, &b] {
        let (_, lease) = listed
            .iter()
            .find(|(admin, _)| *admin == gw.xds.admin_addr())
            .unwrap_or_else(|| panic!("{} not registered: {listed:?}", gw.xds.admin_addr()));
        assert_ne!(*lease, 0, "registered under a lease: {listed:?}");
    }
    // A graceful stop revokes the lease: the key is gone at once, not after its TTL.
    let stopping = Instant::now();
    a.xds.stop().await;
    wait_until("A's key is gone", Duration::from_secs(3), || async {
        members()
            .await
            .iter()
            .all(|(admin, _)| *admin != a.xds.admin_addr())
    })
    .await;
    println!("SIGTERM -> A's key gone: {:?}", stopping.elapsed());
    assert_eq!(members().await.len(), 1);
}

/// What is wrong with an answer of `/mcp` that is not MCP: anything but a JSON-RPC 2.0
/// response carrying the request's id (a plain-text 503 is what Envoy says when the route's
/// cluster has no host).
fn not_mcp(what: &str, r: &Reply) -> Option<String> {
    let Some(m) = &r.message else {
        return Some(format!(
            "{what}: not JSON-RPC: HTTP {} {}",
            r.status, r.body
        ));
    };
    if m["jsonrpc"] != "2.0" || (m.get("result").is_none() && m.get("error").is_none()) {
        return Some(format!("{what}: not a JSON-RPC response: {}", r.body));
    }
    None
}

/// The names and input schemas a `tools/list` result lists, sorted.
fn definitions(r: &Reply) -> Vec<Value> {
    let mut tools: Vec<Value> = r
        .result()
        .and_then(|res| res["tools"].as_array())
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|t| json!({"name": t["name"], "inputSchema": t["inputSchema"]}))
        .collect();
    tools.sort_by_key(|t| t["name"].to_string());
    tools
}

#[tokio::test]
async fn with_the_only_toolgate_xds_gone_every_answer_of_mcp_is_mcp() {
    let env = TestEnv::new("fleet_control_offline");
    let etcd = Etcd::start(&env).await;
    let mut a = Gateway::start(&env, "a", &etcd).await;
    // A server without sessions (its calls need nothing from toolgate-xds) and one with
    // sessions (a client of `/mcp` needs a session the gateway holds with it).
    let stateless = Member::python(
        &env,
        &etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let m = Member::start(&env, &etcd.endpoint(), "svc", "svc-1", &[], TTL).await;
    a.envoy
        .wait_addresses("svc", &[m.server.endpoint()], Duration::from_secs(20))
        .await;
    a.envoy
        .wait_addresses(
            "orders",
            &[stateless.server.endpoint()],
            Duration::from_secs(20),
        )
        .await;
    let url = a.mcp();
    wait_until(
        "/mcp lists both services with their definitions",
        Duration::from_secs(30),
        || async {
            let mut s = McpSession::unconnected(&url);
            s.initialize().await;
            let list = s.list_tools().await;
            lists_tool(&list)
                && list.body.contains("orders__read_order")
                && !list.body.contains("not available yet")
        },
    )
    .await;
    let listed_before = {
        let mut s = McpSession::unconnected(&url);
        s.initialize().await;
        definitions(&s.list_tools().await)
    };
    let mut kept = McpSession::connect(&url).await;
    let before = kept.call_tool(TOOL, json!({})).await;
    assert!(failure("call before", &before).is_none(), "{}", before.body);

    a.xds.kill();
    // Envoy's control cluster has no host left once its health check fails; from the kill on,
    // every answer must be MCP regardless.
    let started = Instant::now();
    let mut problems = Vec::new();
    let mut rounds = 0;
    while started.elapsed() < Duration::from_secs(8) {
        rounds += 1;
        let mut fresh = McpSession::unconnected(&url);
        let init = fresh.initialize().await;
        problems.extend(not_mcp("initialize (new client)", &init));
        if init.status == StatusCode::OK {
            let list = fresh.list_tools().await;
            problems.extend(not_mcp("tools/list (new client)", &list));
            if list.result().is_some() && definitions(&list) != listed_before {
                problems.push(format!(
                    "tools/list (new client) lists other tools than before: {}",
                    list.body
                ));
            }
            let call = fresh.call_tool("orders__read_order", json!({})).await;
            problems.extend(failure("tools/call orders (new client)", &call));
            let call = fresh.call_tool(TOOL, json!({})).await;
            problems.extend(not_mcp("tools/call svc (new client)", &call));
        }
        for (what, r) in [
            ("tools/list (kept)", kept.list_tools().await),
            (
                "tools/call svc (kept)",
                kept.call_tool(TOOL, json!({})).await,
            ),
            ("ping (kept)", kept.request("ping", json!({})).await),
        ] {
            problems.extend(not_mcp(what, &r));
        }
    }
    println!(
        "{rounds} rounds through /mcp with no toolgate-xds; {} problems",
        problems.len()
    );
    if !problems.is_empty() {
        env.print_failure_logs();
    }
    assert!(rounds >= 5, "only {rounds} rounds in 8 s");
    // Operators see it: Envoy counts what the filters answered alone.
    let prometheus = a.envoy.prometheus().await;
    for counter in [
        "toolgate_aggregate_answered_offline",
        "toolgate_aggregate_calls_without_session",
    ] {
        assert!(
            prometheus
                .lines()
                .any(|l| l.starts_with(counter) && !l.ends_with(" 0")),
            "{counter} counted nothing"
        );
    }
    assert!(
        problems.is_empty(),
        "{} answers of /mcp were not MCP, or lost what worked; first: {:?}",
        problems.len(),
        problems.iter().take(5).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn the_official_sdks_call_through_mcp_across_a_sigkill_of_its_toolgate_xds() {
    use toolgate_tests::{NodeClient, Sdk};
    let env = TestEnv::new("fleet_control_sdks");
    let (_etcd, mut a, _b, _m) = svc_behind_two(&env).await;
    let url = a.mcp();
    wait_until("/mcp lists the tool", Duration::from_secs(30), || async {
        let mut s = McpSession::unconnected(&url);
        s.initialize().await.status == StatusCode::OK && lists_tool(&s.list_tools().await)
    })
    .await;
    // Each client calls once, waits for its go file (written right after the kill), then
    // calls five times and lists.
    let go = |who: &str| env.path(&format!("go.{who}"));
    let call = format!("call:{TOOL}");
    let python_steps = |go: &std::path::Path, session: bool| -> Vec<String> {
        // A ClientSession initializes as its first step; the 2026 Client did at its start.
        let mut s: Vec<String> = session
            .then(|| "initialize".to_string())
            .into_iter()
            .collect();
        s.extend([call.clone(), format!("wait:{}", go.display())]);
        s.extend(std::iter::repeat_n(call.clone(), 5));
        s.push("list".into());
        s
    };
    let mut tasks = Vec::new();
    for (who, mode) in [("py-session", None), ("py-2026", Some("2026-07-28"))] {
        let steps = python_steps(&go(who), mode.is_none());
        let url = url.clone();
        tasks.push((
            who,
            tokio::spawn(async move {
                let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
                let out = match mode {
                    Some(mode) => sdk::python_in_mode(&url, mode, &steps).await,
                    None => sdk::python(&url, &steps).await,
                };
                let ok = out.len() == steps.len() && out.iter().all(|s| s.get("ok").is_some());
                (ok, Value::from(out).to_string())
            }),
        ));
    }
    for (who, version) in [("ts-v1", Sdk::V1), ("ts-v2", Sdk::V2)] {
        let mut client = NodeClient::new(version)
            .timeout(Duration::from_secs(60))
            .step("tools/call", json!({"name": TOOL, "arguments": {}}))
            .step("toolgate/wait-file", json!({"path": go(who)}));
        for _ in 0..5 {
            client = client.step("tools/call", json!({"name": TOOL, "arguments": {}}));
        }
        let client = client.step("tools/list", json!({}));
        let url = url.clone();
        tasks.push((
            who,
            tokio::spawn(async move {
                let run = client.run(&url).await;
                (
                    run.exit_code == Some(0),
                    format!("{} {}", run.report, run.stderr),
                )
            }),
        ));
    }
    let whos = ["py-session", "py-2026", "ts-v1", "ts-v2"];
    // A client whose first call failed never waits: the reports below say why.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !whos
        .iter()
        .all(|w| env.path(&format!("go.{w}.waiting")).exists())
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.xds.kill();
    for w in whos {
        std::fs::write(go(w), b"go").expect("writing a go file");
    }
    let mut failed = Vec::new();
    for (who, task) in tasks {
        let (ok, report) = task.await.expect("a client task");
        if !ok {
            failed.push(format!("{who}: {report}"));
        }
    }
    if !failed.is_empty() {
        env.print_failure_logs();
    }
    assert!(
        failed.is_empty(),
        "SDK clients failed across the SIGKILL: {failed:#?}"
    );
}
