//! One URL for every tool, through the whole gateway (issue 19): three services behind `/mcp`
//! (the lab, stateful rmcp; the official Python SDK server, stateless; the official
//! everything-server, stateful and speaking only up to 2025-11-25), and the official clients
//! (Python SDK, TypeScript SDK 1.x and 2.x) each list and call tools of all three through
//! Envoy's `/mcp`. The gateway initializes the stateful servers' sessions on each client's
//! behalf; a server restarted under a client costs it nothing. Real etcd, toolgate-xds, Envoy
//! with the filter.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::mcp::text_of;
use toolgate_tests::{rmcp_client, sdk, wait_until, Member, NodeClient, Proc, Sdk, Stack, TestEnv};

/// The names `/mcp` shows, one tool of each service.
const LAB: &str = "orders__echo";
const PY: &str = "py__read_order";
const EV: &str = "ev__echo";

/// The names `/mcp`'s `tools/list` shows, through Envoy.
async fn listed(url: &str) -> Vec<String> {
    let lines = sdk::python(url, &["initialize", "list"]).await;
    lines
        .iter()
        .find(|l| l["step"] == "list")
        .and_then(|l| l["ok"]["tools"].as_array())
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The three services behind one gateway, each serving (UP in toolgate-xds, HEALTHY in Envoy),
/// and `/mcp` listing a tool of each.
struct ThreeServers {
    stack: Stack,
    _lab: Member,
    _py: Member,
    _ev: (Proc, Proc),
    url: String,
}

impl ThreeServers {
    async fn start(env: &TestEnv) -> ThreeServers {
        let stack = Stack::start(env).await;
        let etcd = stack.etcd.endpoint();
        let lab = Member::start(env, &etcd, "orders", "lab-1", &[], 10).await;
        let py = Member::python(env, &etcd, "py", "py-1", &["--stateless"], 10).await;
        let ev = stack.everything(env, "ev", Some("echo")).await;
        stack
            .wait_healthy("orders", &[&lab], Duration::from_secs(20))
            .await;
        stack
            .wait_healthy("py", &[&py], Duration::from_secs(20))
            .await;
        let url = stack.aggregate_url();
        wait_until(
            "/mcp lists the tools of all three",
            Duration::from_secs(20),
            || async {
                let names = listed(&url).await;
                [LAB, PY, EV].iter().all(|n| names.iter().any(|m| m == n))
            },
        )
        .await;
        ThreeServers {
            stack,
            _lab: lab,
            _py: py,
            _ev: ev,
            url,
        }
    }
}

#[tokio::test]
async fn the_official_clients_list_and_call_three_servers_through_one_url() {
    let env = TestEnv::new("aggregate_sdk_three_servers");
    let three = ThreeServers::start(&env).await;
    let url = three.url.clone();

    // The official Python SDK (2025-era, with a gateway session).
    let lines = sdk::python(
        &url,
        &[
            "initialize",
            "list",
            &format!("call:{LAB}:{}", json!({"text": "from python"})),
            &format!("call:{PY}:{}", json!({"order_id": "o-9"})),
            &format!("call:{EV}:{}", json!({"message": "hello ev"})),
        ],
    )
    .await;
    let calls: Vec<&Value> = lines
        .iter()
        .filter(|l| l["step"].as_str().is_some_and(|s| s.starts_with("call:")))
        .collect();
    if calls.len() != 3 || calls.iter().any(|c| c["ok"]["isError"] != false) {
        env.print_failure_logs();
    }
    assert_eq!(calls.len(), 3, "python: {lines:?}");
    for c in &calls {
        assert_eq!(c["ok"]["isError"], false, "python: {c}");
    }
    assert!(
        text_of(&calls[0]["ok"]).contains("from python"),
        "{}",
        calls[0]
    );
    assert!(
        text_of(&calls[1]["ok"]).contains("order o-9"),
        "{}",
        calls[1]
    );
    assert!(
        text_of(&calls[2]["ok"]).contains("hello ev"),
        "{}",
        calls[2]
    );

    // The TypeScript SDKs: 1.x as it connects by default, 2.x pinned to 2025-11-25 (sessions).
    for sdk in Sdk::ALL {
        let mut client = NodeClient::new(sdk).timeout(Duration::from_secs(30));
        if sdk == Sdk::V2 {
            client = client.protocol_version("2025-11-25");
        }
        let run = client
            .method("tools/list")
            .step(
                "tools/call",
                json!({"name": LAB, "arguments": {"text": "from ts"}}),
            )
            .step(
                "tools/call",
                json!({"name": PY, "arguments": {"order_id": "o-7"}}),
            )
            .step(
                "tools/call",
                json!({"name": EV, "arguments": {"message": "ts ev"}}),
            )
            .run(&url)
            .await;
        if run.exit_code != Some(0) {
            env.print_failure_logs();
        }
        assert_eq!(
            run.exit_code,
            Some(0),
            "{}: {}\n{}",
            run.sdk(),
            run.report,
            run.stderr
        );
        let names: Vec<&str> = run.result("tools/list")["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["name"].as_str())
            .collect();
        for n in [LAB, PY, EV] {
            assert!(
                names.contains(&n),
                "{}: {n} not listed: {names:?}",
                run.sdk()
            );
        }
        let results: Vec<&Value> = run.report["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["method"] == "tools/call")
            .map(|s| &s["result"])
            .collect();
        assert_eq!(results.len(), 3, "{}", run.report);
        assert!(text_of(results[0]).contains("from ts"), "{}", run.report);
        assert!(text_of(results[1]).contains("order o-7"), "{}", run.report);
        assert!(text_of(results[2]).contains("ts ev"), "{}", run.report);
    }
}

#[tokio::test]
async fn a_restarted_stateful_server_costs_a_client_of_mcp_nothing() {
    let env = TestEnv::new("aggregate_sdk_restart");
    let stack = Stack::start(&env).await;
    let etcd = stack.etcd.endpoint();
    // Unwatched: the restart below is quicker than a registrar would deregister and rejoin.
    let mut lab = Member::start_unwatched(&env, &etcd, "orders", "lab-1", &[], 10).await;
    stack
        .wait_healthy("orders", &[&lab], Duration::from_secs(20))
        .await;
    let url = stack.aggregate_url();
    wait_until("/mcp lists the lab", Duration::from_secs(20), || async {
        listed(&url).await.iter().any(|n| n == LAB)
    })
    .await;

    let go = env.path("go");
    let client = NodeClient::new(Sdk::V1)
        .timeout(Duration::from_secs(40))
        .step(
            "tools/call",
            json!({"name": LAB, "arguments": {"text": "one"}}),
        )
        .step("toolgate/wait-file", json!({"path": go}))
        .step(
            "tools/call",
            json!({"name": LAB, "arguments": {"text": "two"}}),
        );
    let node_url = url.clone();
    let run = tokio::spawn(async move { client.run(&node_url).await });
    wait_until("the first call lands", Duration::from_secs(20), || async {
        lab.server.calls("echo").await == 1
    })
    .await;
    // And its answer is back: killing the server while it is on the wire would cut the call
    // off, which is not what this test is about.
    let waiting = env.path("go.waiting");
    wait_until(
        "the client waits for the go file",
        Duration::from_secs(20),
        || async { waiting.exists() },
    )
    .await;
    // The server restarts on the same address: every session it held is gone.
    let port = lab.server.port;
    lab.server.proc.kill();
    let restarted = toolgate_tests::McpServer::lab_on(
        &env,
        "lab-1",
        port,
        &["--tools", "read_order,write_order,echo"],
    )
    .await;
    // The gateway saw the crash (the prober's crash watch drains a dead instance within
    // milliseconds) and routes to the instance again once a probe passes: this test is
    // about the sessions the restart lost, so the second call waits for that, and for
    // toolgate-xds to have seen the restart (before it has, a lost session looks ended by
    // a live server, whose answer reaches the client as it is).
    wait_until(
        "toolgate-xds sees lab-1 restarted",
        Duration::from_secs(20),
        || async { stack.instance("orders", "lab-1").await["restarts"].as_u64() >= Some(1) },
    )
    .await;
    stack
        .wait_healthy("orders", &[&lab], Duration::from_secs(20))
        .await;
    std::fs::write(&go, b"go").expect("write the go file");
    let run = run.await.expect("the node task");
    if run.exit_code != Some(0) {
        env.print_failure_logs();
    }
    assert_eq!(run.exit_code, Some(0), "{}\n{}", run.report, run.stderr);
    let second = run.report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["method"] == "tools/call")
        .nth(1)
        .cloned()
        .unwrap_or_default();
    assert!(text_of(&second["result"]).contains("two"), "{}", run.report);
    assert!(
        restarted.calls("echo").await >= 1,
        "the second call ran on the restarted server"
    );
}

#[tokio::test]
async fn rmcps_client_lists_and_calls_three_servers_through_one_url() {
    let env = TestEnv::new("aggregate_sdk_rmcp");
    let three = ThreeServers::start(&env).await;
    let client = rmcp_client::connect(&three.url).await;
    let info = client.peer_info();
    let names = rmcp_client::list_tools(&client).await;
    if ![LAB, PY, EV].iter().all(|n| names.iter().any(|m| m == n)) {
        env.print_failure_logs();
    }
    for n in [LAB, PY, EV] {
        assert!(names.iter().any(|m| m == n), "{n} not listed: {names:?}");
    }
    assert_eq!(
        info.and_then(|i| i.server_info.as_ref().map(|s| s.name.clone())),
        Some("toolgate/default".to_string()),
        "rmcp initialized with the gateway's own server"
    );
    // rmcp's client panics (in the harness) on a protocol error: each call is answered by
    // its own server, in the text only that server writes.
    let lab = rmcp_client::call_text(&client, LAB, json!({"text": "from rmcp"})).await;
    let py = rmcp_client::call_text(&client, PY, json!({"order_id": "o-5"})).await;
    let ev = rmcp_client::call_text(&client, EV, json!({"message": "rmcp ev"})).await;
    assert!(lab.contains("from rmcp"), "{lab}");
    assert!(py.contains("order o-5"), "{py}");
    assert!(ev.contains("rmcp ev"), "{ev}");
    let _ = client.cancel().await;
}

/// The official Python SDK's `Client` in mode "auto": it probes `server/discover` and adopts
/// the newest version both speak, so the gateway must be found to speak 2026-07-28 (no
/// `initialize`, no session). Runs `steps` after the handshake; every step must succeed.
async fn python_2026(env: &TestEnv, url: &str, steps: &[String]) -> Vec<Value> {
    let mut all = vec!["initialize", "list"];
    all.extend(steps.iter().map(String::as_str));
    let lines = sdk::python_in_mode(url, "auto", &all).await;
    if lines.len() != all.len() || lines.iter().any(|l| l.get("ok").is_none()) {
        env.print_failure_logs();
    }
    assert_eq!(lines.len(), all.len(), "{lines:?}");
    for l in &lines {
        assert!(l.get("ok").is_some(), "{l}");
    }
    assert_eq!(lines[0]["ok"]["protocolVersion"], "2026-07-28", "{lines:?}");
    let names: Vec<&str> = lines[1]["ok"]["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str())
        .collect();
    for n in [LAB, PY, EV] {
        assert!(names.contains(&n), "{n} not listed: {names:?}");
    }
    lines[2..].to_vec()
}

#[tokio::test]
async fn the_python_sdk_in_2026_07_28_mode_lists_and_calls_through_one_url() {
    let env = TestEnv::new("aggregate_sdk_python_modern");
    let three = ThreeServers::start(&env).await;
    let calls = python_2026(
        &env,
        &three.url,
        &[
            format!("call:{LAB}:{}", json!({"text": "from modern python"})),
            format!("call:{PY}:{}", json!({"order_id": "o-3"})),
        ],
    )
    .await;
    for c in &calls {
        assert_eq!(c["ok"]["isError"], false, "{c}");
    }
    assert!(
        text_of(&calls[0]["ok"]).contains("from modern python"),
        "{}",
        calls[0]
    );
    assert!(
        text_of(&calls[1]["ok"]).contains("order o-3"),
        "{}",
        calls[1]
    );
}

/// The everything-server speaks only up to 2025-11-25 and needs a session, which a 2026-07-28
/// client does not have: the gateway holds one for the identity the client states, opened
/// once and used by every call of that identity (the sessions held stay bounded). A legacy
/// client calling the same server through the same URL keeps its own, deleted when its
/// gateway session ends.
#[tokio::test]
async fn the_python_sdk_in_2026_07_28_mode_calls_a_server_that_needs_a_session() {
    let env = TestEnv::new("aggregate_sdk_python_modern_ev");
    let three = ThreeServers::start(&env).await;
    let xds = &three.stack.xds;
    // The catalog found the everything-server to speak only a revision with sessions, and
    // the filter knows it.
    three
        .stack
        .wait_filter_config("ev is a legacy service", |c| {
            c["legacy_revisions"]["ev"].is_string()
        })
        .await;

    // A legacy client first: its gateway session holds a session of its own with the server.
    let lines = sdk::python(
        &three.url,
        &[
            "initialize",
            &format!("call:{EV}:{}", json!({"message": "legacy ev"})),
        ],
    )
    .await;
    let legacy = lines.iter().find(|l| l["step"] != "initialize");
    if legacy.is_none_or(|l| l["ok"]["isError"] != false) {
        env.print_failure_logs();
    }
    let legacy = legacy.cloned().unwrap_or_default();
    assert_eq!(legacy["ok"]["isError"], false, "{lines:?}");
    assert!(text_of(&legacy["ok"]).contains("legacy ev"), "{legacy}");

    // The same SDK in 2026-07-28 mode, twice (two processes stating the same identity),
    // three calls each.
    for run in 0..2 {
        let calls = python_2026(
            &env,
            &three.url,
            &(0..3)
                .map(|i| {
                    format!(
                        "call:{EV}:{}",
                        json!({"message": format!("modern ev {run}.{i}")})
                    )
                })
                .collect::<Vec<_>>(),
        )
        .await;
        for (i, c) in calls.iter().enumerate() {
            if c["ok"]["isError"] != false {
                env.print_failure_logs();
            }
            assert_eq!(c["ok"]["isError"], false, "{c}");
            assert!(
                text_of(&c["ok"]).contains(&format!("modern ev {run}.{i}")),
                "{c}"
            );
        }
    }
    // One session for that identity, however many calls and processes.
    let stateless = r#"owner="stateless""#;
    assert_eq!(
        xds.metric("toolgate_upstream_sessions_opened_total", stateless)
            .await,
        1.0,
        "{}",
        xds.metrics_text().await
    );
    assert_eq!(
        xds.metric("toolgate_upstream_sessions", stateless).await,
        1.0
    );
    // The Python client leaves its gateway session to expire (it does not DELETE it): one
    // session held for it. A legacy client that ends its gateway session gets what was held
    // for it deleted.
    let gateway = r#"owner="gateway""#;
    assert_eq!(xds.metric("toolgate_upstream_sessions", gateway).await, 1.0);
    let mut ending = toolgate_tests::mcp::McpSession::connect(&three.url).await;
    let reply = ending.call_tool(EV, json!({"message": "ending ev"})).await;
    assert!(reply.text().contains("ending ev"), "{}", reply.body);
    assert_eq!(xds.metric("toolgate_upstream_sessions", gateway).await, 2.0);
    let id = ending.session.clone().expect("a gateway session");
    let status = reqwest::Client::new()
        .delete(&three.url)
        .header("mcp-session-id", id)
        .header("mcp-protocol-version", "2025-06-18")
        .send()
        .await
        .expect("DELETE the gateway session")
        .status();
    assert!(status.is_success(), "DELETE: {status}");
    wait_until(
        "the ended gateway session's held session is deleted",
        Duration::from_secs(10),
        || async { xds.metric("toolgate_upstream_sessions", gateway).await == 1.0 },
    )
    .await;
    assert_eq!(
        xds.metric("toolgate_upstream_sessions_opened_total", stateless)
            .await,
        1.0
    );
}
