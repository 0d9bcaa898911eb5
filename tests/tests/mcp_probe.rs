//! Issue 18 end to end: MCP servers with no `/health` join under `toolgate-register` with no
//! flag but where they are, are probed in MCP's own terms, reach UP and are routed; the `mcp`
//! probe takes a killed, frozen or wedged server out of rotation as the `/health` probe does,
//! and keeps one server session however many probes it sends. Real etcd, toolgate-xds, Envoy
//! with the filter, the official everything-server (Node) and the official Python SDK server,
//! called through Envoy by the official Python SDK client.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;
use toolgate_tests::paths::free_port;
use toolgate_tests::{
    sdk, wait_until, McpServer, Options, Proc, Registrant, ServerCommand, Stack, TestEnv,
};

/// Probes every second, as the other health tests do, so each case takes seconds.
const FAST_PROBES: [&str; 4] = ["--probe-interval", "1s", "--probe-timeout", "500ms"];

/// A registrar with the zero-flag command line of the issue: etcd, service, endpoint, and the
/// server as its child. The instance id defaults to `<hostname>-<port>`.
fn join(env: &TestEnv, etcd: &str, service: &str, server: &ServerCommand) -> Proc {
    Registrant::new(etcd, service, &server.endpoint())
        .server(server)
        .spawn(env, &format!("{service}.registrar"))
}

/// The only instance of `service` in toolgate-xds's registry, once there is one.
async fn sole_instance(stack: &Stack, service: &str, within: Duration) -> Value {
    let one = || async {
        let reg = stack.xds.registry().await;
        match reg["services"][service].as_array() {
            Some(list) if list.len() == 1 => Some(list[0].clone()),
            _ => None,
        }
    };
    wait_until(
        &format!("{service} has an instance in the registry"),
        within,
        || async { one().await.is_some() },
    )
    .await;
    one().await.unwrap_or(Value::Null)
}

async fn wait_up(stack: &Stack, service: &str, within: Duration) -> Value {
    let started = Instant::now();
    let inst = sole_instance(stack, service, within).await;
    let id = inst["instance_id"].as_str().unwrap_or("").to_string();
    stack
        .wait_state(service, &id, "UP", within.saturating_sub(started.elapsed()))
        .await;
    stack.instance(service, &id).await
}

fn tools_of(inst: &Value) -> Vec<String> {
    inst["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect()
}

/// The catalog's definition of `tool` in `service`, once toolgate-xds has read it.
async fn catalog_tool(stack: &Stack, service: &str, tool: &str) -> Value {
    let find = || async {
        let catalog = stack.xds.catalog().await;
        catalog["services"][service]["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["name"] == tool)
            .cloned()
    };
    wait_until(
        &format!("the catalog has {service}/{tool}"),
        Duration::from_secs(15),
        || async { find().await.is_some() },
    )
    .await;
    find().await.unwrap_or(Value::Null)
}

fn last_probe(inst: &Value) -> String {
    inst["probes"]
        .as_array()
        .and_then(|p| p.last())
        .map(|p| p["detail"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_reference_everything_server_joins_with_no_flags_and_is_routed() {
    let env = TestEnv::new("mcp_probe_everything");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let server = ServerCommand::everything(free_port());
    let mut registrar = join(&env, &stack.etcd.endpoint(), "everything", &server);

    let inst = wait_up(&stack, "everything", Duration::from_secs(30)).await;
    assert_eq!(inst["probe"], "mcp", "no /health: auto picks mcp: {inst}");
    assert_eq!(inst["protocol_versions"][0], "2025-11-25", "{inst}");
    let tools = tools_of(&inst);
    assert!(
        tools.iter().any(|t| t == "echo") && tools.iter().any(|t| t == "get-sum"),
        "the tools come from the server's tools/list: {tools:?}"
    );
    assert!(
        last_probe(&inst).contains("session kept"),
        "a legacy server is pinged on a kept session: {inst}"
    );
    // The catalog holds the server's own definitions, read over MCP.
    let echo = catalog_tool(&stack, "everything", "echo").await;
    assert!(
        echo["description"].as_str().is_some_and(|d| !d.is_empty())
            && echo["inputSchema"]["properties"]["message"].is_object(),
        "{echo}"
    );
    let entry = &stack.xds.catalog().await["services"]["everything"];
    assert_eq!(entry["protocol_version"], "2025-11-25", "{entry}");
    assert_eq!(entry["tools"].as_array().map(Vec::len), Some(tools.len()));

    stack
        .envoy
        .wait_addresses("everything", &[server.endpoint()], Duration::from_secs(20))
        .await;
    let steps = sdk::python(
        &stack.url("everything"),
        &[
            "initialize",
            "list",
            r#"call:echo:{"message":"through toolgate"}"#,
        ],
    )
    .await;
    assert_eq!(steps.len(), 3, "{steps:?}");
    let echoed = steps[2]["ok"].to_string();
    assert!(
        echoed.contains("through toolgate") && steps[2]["ok"]["isError"] != true,
        "the official client's call ran on the everything-server: {steps:?}"
    );
    assert!(registrar.is_running());
    registrar.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn the_python_sdk_server_without_health_joins_and_is_probed_statelessly() {
    let env = TestEnv::new("mcp_probe_python");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let server = ServerCommand::python(free_port(), &["--no-health"]);
    let mut registrar = join(&env, &stack.etcd.endpoint(), "pyorders", &server);

    let inst = wait_up(&stack, "pyorders", Duration::from_secs(30)).await;
    assert_eq!(inst["probe"], "mcp", "{inst}");
    assert_eq!(inst["protocol_versions"][0], "2026-07-28", "{inst}");
    let mut tools = tools_of(&inst);
    tools.sort();
    assert_eq!(
        tools,
        ["fail_order", "read_order", "slow_order", "write_order"]
    );
    assert!(
        last_probe(&inst).contains("server/discover"),
        "a 2026-07-28 server is probed without a session: {inst}"
    );
    let read_order = catalog_tool(&stack, "pyorders", "read_order").await;
    assert!(
        read_order["inputSchema"]["properties"]["order_id"].is_object(),
        "{read_order}"
    );
    stack
        .envoy
        .wait_addresses("pyorders", &[server.endpoint()], Duration::from_secs(20))
        .await;
    let steps = sdk::python(
        &stack.url("pyorders"),
        &["initialize", r#"call:read_order:{"order_id":"o-7"}"#],
    )
    .await;
    assert!(
        steps.len() == 2 && steps[1]["ok"].to_string().contains("order o-7: 1 item"),
        "{steps:?}"
    );
    let calls: Value = reqwest::get(format!("http://{}/calls", server.endpoint()))
        .await
        .expect("GET /calls")
        .json()
        .await
        .expect("/calls JSON");
    assert_eq!(calls["read_order"], 1, "the call reached the server once");
    registrar.stop(Duration::from_secs(10)).await;
}

/// A lab registered with `--probe mcp` (it has a `/health`, which would make auto pick http).
/// A lab registered with `mcp` probes, and its registrar (killed when dropped: keep it for
/// as long as the instance should stay registered).
async fn mcp_probed_lab(
    env: &TestEnv,
    stack: &Stack,
    service: &str,
    id: &str,
) -> (McpServer, toolgate_tests::Proc) {
    let server = McpServer::lab(env, id, &["--tools", "read_order,echo"]).await;
    let registrar = Registrant::new(&stack.etcd.endpoint(), service, &server.endpoint())
        .arg("--instance-id", id)
        .arg("--probe", "mcp")
        .arg("--ttl", "30")
        // The probes must find the kill: the registrar does not watch its server.
        .arg("--watch-interval", "0")
        .spawn(env, &format!("{id}.registrar"));
    (server, registrar)
}

#[tokio::test]
async fn mcp_probes_take_a_killed_a_frozen_and_a_wedged_server_out_of_rotation() {
    let env = TestEnv::new("mcp_probe_removal");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    // The registrars are held to the end: a forgotten one outlived the test (and its etcd).
    let (mut killed, _killed_registrar) = mcp_probed_lab(&env, &stack, "rm", "rm-killed").await;
    let (frozen, _frozen_registrar) = mcp_probed_lab(&env, &stack, "rm", "rm-frozen").await;
    let (wedged, _wedged_registrar) = mcp_probed_lab(&env, &stack, "rm", "rm-wedged").await;
    let (spare, _spare_registrar) = mcp_probed_lab(&env, &stack, "rm", "rm-spare").await;
    for id in ["rm-killed", "rm-frozen", "rm-wedged", "rm-spare"] {
        stack
            .wait_state("rm", id, "UP", Duration::from_secs(30))
            .await;
        let inst = stack.instance("rm", id).await;
        assert_eq!(inst["probe"], "mcp", "{inst}");
    }
    let all = [&killed, &frozen, &wedged, &spare].map(|s| s.endpoint());
    stack
        .envoy
        .wait_addresses("rm", &all, Duration::from_secs(20))
        .await;

    // The HTTP stack still answers /health while MCP hangs: only an MCP probe sees it.
    wedged.set(serde_json::json!({"mcp_wedged": true})).await;
    let health = reqwest::get(format!("{}/health", wedged.base_url()))
        .await
        .expect("GET /health");
    assert!(health.status().is_success());
    let t0 = Instant::now();
    killed.proc.kill();
    frozen.proc.signal(Signal::SIGSTOP);
    for id in ["rm-killed", "rm-frozen", "rm-wedged"] {
        // Two probes 1 s apart, each with a 500 ms timeout: about 2 s; the bound is the
        // /health probe's in tests/health.rs.
        stack
            .wait_state("rm", id, "SUSPECT", Duration::from_secs(6))
            .await;
        let inst = stack.instance("rm", id).await;
        println!(
            "{id}: SUSPECT after {} ms: {}",
            t0.elapsed().as_millis(),
            inst["cause"]
        );
    }
    let wedged_inst = stack.instance("rm", "rm-wedged").await;
    assert!(
        last_probe(&wedged_inst).contains("no answer within 500ms"),
        "the wedge reads as a timeout in words: {wedged_inst}"
    );
    let killed_inst = stack.instance("rm", "rm-killed").await;
    assert!(
        last_probe(&killed_inst).contains("connect failed"),
        "{killed_inst}"
    );
    stack
        .wait_healthy_addresses("rm", &[spare.endpoint()], Duration::from_secs(5))
        .await;

    // Recovery works the same way.
    frozen.proc.signal(Signal::SIGCONT);
    wedged.set(serde_json::json!({"mcp_wedged": false})).await;
    for id in ["rm-frozen", "rm-wedged"] {
        stack
            .wait_state("rm", id, "UP", Duration::from_secs(10))
            .await;
    }
}

async fn probes_passed(stack: &Stack) -> f64 {
    stack
        .xds
        .metric("toolgate_health_probes_total", "result=\"pass\"")
        .await
}

/// The everything-server run on its own (not as the registrar's child, so its log outlives
/// both), registered beside it as `ev/ev-1` with the `mcp` probe and tools given by hand; UP.
async fn legacy_beside(env: &TestEnv, stack: &Stack, name: &str) -> (ServerCommand, Proc, Proc) {
    let cmd = ServerCommand::everything(free_port());
    let server = cmd.spawn(env, name);
    let registrar = Registrant::new(&stack.etcd.endpoint(), "ev", &cmd.endpoint())
        .arg("--instance-id", "ev-1")
        .arg("--probe", "mcp")
        .arg("--tools", "echo")
        .arg("--wait-healthy", "true")
        // A restart must reach the prober, not a registrar that deregisters in between.
        .arg("--watch-interval", "0")
        .spawn(env, "ev.registrar");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(30))
        .await;
    (cmd, server, registrar)
}

/// Counts the everything-server's own session log lines: sessions it created and sessions a
/// client ended with DELETE.
fn session_counts(server: &Proc) -> (usize, usize) {
    let log = server.log();
    (
        log.matches("Session initialized with ID").count(),
        log.matches("Received session termination request").count(),
    )
}

#[tokio::test]
async fn a_hundred_probes_of_a_legacy_server_hold_one_session_deleted_when_the_prober_stops() {
    let env = TestEnv::new("mcp_probe_sessions");
    let mut stack = Stack::with(
        &env,
        Options::default().xds_arg(&["--probe-interval", "100ms", "--probe-timeout", "80ms"]),
    )
    .await;
    let (_cmd, server, mut registrar) = legacy_beside(&env, &stack, "everything").await;
    let start = probes_passed(&stack).await;
    wait_until(
        "100 more probes passed",
        Duration::from_secs(40),
        || async { probes_passed(&stack).await >= start + 100.0 },
    )
    .await;
    let (created, ended) = session_counts(&server);
    println!("after 100+ probes: the server created {created} sessions, {ended} were deleted");
    // The registrar's check of --tools and the catalog's read each opened one and closed it;
    // the prober keeps one.
    assert!(
        created <= 3 && created - ended == 1,
        "one prober session, kept: created {created}, deleted {ended}\n{}",
        server.log()
    );

    // toolgate-xds stops: the prober deletes its session.
    stack.xds.stop().await;
    wait_until(
        "the prober's session is deleted",
        Duration::from_secs(5),
        || async {
            let (c, e) = session_counts(&server);
            c == e
        },
    )
    .await;
    registrar.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn an_instance_that_leaves_gets_its_prober_session_deleted() {
    let env = TestEnv::new("mcp_probe_leave");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let (_cmd, server, mut registrar) = legacy_beside(&env, &stack, "everything").await;
    assert!(session_counts(&server).0 >= 1);
    // SIGTERM: the registrar revokes the lease; toolgate-xds drops the instance and its prober
    // deletes the session while toolgate-xds keeps running.
    registrar.stop(Duration::from_secs(10)).await;
    wait_until(
        "every session is deleted",
        Duration::from_secs(5),
        || async {
            let (c, e) = session_counts(&server);
            c == e
        },
    )
    .await;
    assert_eq!(stack.state("ev", "ev-1").await, "absent");
}

#[tokio::test]
async fn a_server_without_health_probed_over_http_is_never_routed_and_says_why() {
    let env = TestEnv::new("mcp_probe_http_404");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let server = McpServer::lab(&env, "nh-1", &["--tools", "echo", "--no-health"]).await;
    let mut registrar = Registrant::new(&stack.etcd.endpoint(), "nh", &server.endpoint())
        .arg("--instance-id", "nh-1")
        .arg("--probe", "http")
        .arg("--tools", "echo")
        .arg("--wait-healthy", "false")
        .spawn(&env, "nh.registrar");
    wait_until("nh-1 is probed", Duration::from_secs(20), || async {
        stack.instance("nh", "nh-1").await["probes"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    })
    .await;
    let inst = stack.instance("nh", "nh-1").await;
    assert_eq!(inst["state"], "UNKNOWN");
    let cause = inst["cause"].as_str().unwrap_or("");
    assert!(
        cause.contains("not routed") && cause.contains("the server has no health endpoint"),
        "{inst}"
    );
    assert!(
        stack
            .xds
            .log()
            .contains("instance not routed: its first probe failed"),
        "one warning line tells the operator"
    );
    let status = stack.xds.status_text().await;
    assert!(
        status.contains("http failed: HTTP 404 on GET /health"),
        "{status}"
    );
    registrar.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_tcp_probe_sees_a_crash_but_not_a_freeze_as_documented() {
    let env = TestEnv::new("mcp_probe_tcp");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let mut crashes = McpServer::lab(&env, "tcp-crash", &["--tools", "echo"]).await;
    let freezes = McpServer::lab(&env, "tcp-freeze", &["--tools", "echo"]).await;
    let mut registrars = Vec::new();
    for server in [&crashes, &freezes] {
        registrars.push(
            Registrant::new(&stack.etcd.endpoint(), "tcp", &server.endpoint())
                .arg("--instance-id", &server.instance_id)
                .arg("--probe", "tcp")
                .arg("--tools", "echo")
                .arg("--watch-interval", "0")
                .spawn(&env, &format!("{}.registrar", server.instance_id)),
        );
    }
    for id in ["tcp-crash", "tcp-freeze"] {
        stack
            .wait_state("tcp", id, "UP", Duration::from_secs(30))
            .await;
        assert_eq!(stack.instance("tcp", id).await["probe"], "tcp");
    }
    freezes.proc.signal(Signal::SIGSTOP);
    crashes.proc.kill();
    stack
        .wait_state("tcp", "tcp-crash", "SUSPECT", Duration::from_secs(6))
        .await;
    // Three more probe intervals: the kernel still accepts for the frozen process.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stack.state("tcp", "tcp-freeze").await, "UP");
    freezes.proc.signal(Signal::SIGCONT);
    for mut r in registrars {
        r.stop(Duration::from_secs(10)).await;
    }
}

#[tokio::test]
async fn a_restarted_legacy_server_gets_one_new_prober_session_not_one_per_probe() {
    let env = TestEnv::new("mcp_probe_restart");
    let stack = Stack::with(&env, Options::default().xds_arg(&FAST_PROBES)).await;
    let (cmd, mut first, mut registrar) = legacy_beside(&env, &stack, "everything-1").await;
    first.kill();
    stack
        .wait_state("ev", "ev-1", "SUSPECT", Duration::from_secs(6))
        .await;
    // The same server starts again on the same port: it knows nothing of the old session.
    let second = cmd.spawn(&env, "everything-2");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(15))
        .await;
    let inst = stack.instance("ev", "ev-1").await;
    let recreated = inst["probes"].as_array().into_iter().flatten().any(|p| {
        p["detail"]
            .as_str()
            .unwrap_or("")
            .contains("session re-created")
    });
    assert!(recreated, "the lost session was replaced: {inst}");
    // Five more probes on the new server: still the one session it gave the prober.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (created, ended) = session_counts(&second);
    // The prober's; at most one more from a catalog read retried here, closed at once.
    assert!(
        created <= 2 && created - ended == 1,
        "one prober session on the restarted server: created {created}, deleted {ended}\n{}",
        second.log()
    );
    registrar.stop(Duration::from_secs(10)).await;
}
