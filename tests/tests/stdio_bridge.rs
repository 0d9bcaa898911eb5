//! stdio MCP servers join the gateway: `toolgate-register --stdio -- <command>` runs the
//! server with pipes, serves it as Streamable HTTP and registers that endpoint. Real etcd,
//! toolgate-xds, Envoy with the filter; the reference servers `server-memory` and
//! `server-filesystem` (tests/node) and a stdio server on the official Python SDK
//! (tests/python/stdio_server.py); the official Python and TypeScript SDKs as clients.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{json, Value};
use toolgate_model::{InstanceMetadata, ProbeKind};
use toolgate_tests::mcp::{open_session, post_message, text_of};
use toolgate_tests::sdk::{self, PythonLive};
use toolgate_tests::{
    children_of, filesystem_server, memory_server, python_bin, wait_until, NodeClient, Proc,
    Registrant, Sdk, Stack, TestEnv,
};

/// The protocol version of the sessions this file opens by hand.
const VERSION: &str = "2025-11-25";

/// `.venv/bin/python tests/python/stdio_server.py`.
fn python_stdio_server() -> (PathBuf, Vec<String>) {
    let script = toolgate_tests::paths::workspace_root().join("tests/python/stdio_server.py");
    (python_bin(), vec![script.display().to_string()])
}

fn node() -> &'static Path {
    Path::new("node")
}

/// The one registration of `service`, if there is one.
async fn registration(stack: &Stack, service: &str) -> Option<InstanceMetadata> {
    let mut c = stack.etcd.client().await;
    let resp = c
        .get(
            format!("/mcp/services/{service}/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .ok()?;
    let kv = resp.kvs().first()?;
    InstanceMetadata::from_json(kv.value()).ok()
}

/// Waits until the registrar registered `service` (failing at once, with its log, if it
/// exits first).
async fn joined(stack: &Stack, registrar: &mut Proc, service: &str) -> InstanceMetadata {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(m) = registration(stack, service).await {
            return m;
        }
        if let Some(status) = registrar.try_exit_status() {
            panic!(
                "the registrar exited ({status}) before it registered {service}:\n{}",
                registrar.log()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{service} was not registered within 60 s:\n{}",
            registrar.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the instance is UP, Envoy routes it, and the filter knows the service.
async fn serving(stack: &Stack, service: &str, meta: &InstanceMetadata) {
    stack
        .wait_state(service, &meta.instance_id, "UP", Duration::from_secs(30))
        .await;
    stack
        .wait_healthy_addresses(
            service,
            &[meta.endpoint.to_string()],
            Duration::from_secs(20),
        )
        .await;
    stack
        .wait_filter_config(&format!("the catalog has {service}"), |c| {
            c["catalog"].get(service).is_some()
        })
        .await;
}

/// A bridged server, joined and routed.
async fn join(
    env: &TestEnv,
    stack: &Stack,
    service: &str,
    registrant: Registrant,
) -> (Proc, InstanceMetadata) {
    let mut registrar = registrant.spawn(env, &format!("{service}.registrar"));
    let meta = joined(stack, &mut registrar, service).await;
    serving(stack, service, &meta).await;
    (registrar, meta)
}

async fn wait_listed(url: &str, tool: &str) {
    wait_until(
        &format!("/mcp lists {tool}"),
        Duration::from_secs(20),
        || async {
            let lines = sdk::python(url, &["initialize", "list"]).await;
            lines.iter().any(|l| {
                l["step"] == "list"
                    && l["ok"]["tools"]
                        .as_array()
                        .is_some_and(|t| t.iter().any(|t| t["name"] == tool))
            })
        },
    )
    .await;
}

/// A log line without its ANSI colours.
fn without_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ ... m
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What a reply to a failed call says: an MCP error's message, or a tool result's text
/// (the gateway may answer a failed call as a tool result with `isError`).
fn failure_text(report: &Value) -> String {
    if let Some(e) = report.get("mcp_error") {
        return e["message"].as_str().unwrap_or_default().to_string();
    }
    if let Some(r) = report.get("ok") {
        assert_eq!(r["isError"], true, "the call should have failed: {report}");
        return text_of(r);
    }
    panic!("no MCP reply: {report}");
}

#[tokio::test]
async fn server_memory_joins_with_stdio_alone_and_the_official_sdks_call_it_through_both_urls() {
    let env = TestEnv::new("stdio_memory_joins");
    let stack = Stack::start(&env).await;
    let memory = memory_server().display().to_string();
    let graph = env.path("memory.jsonl").display().to_string();
    // No flag but --stdio: the tools, the probe and the endpoint are the bridge's to find.
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "memory")
        .env("MEMORY_FILE_PATH", &graph)
        .child(node(), &[memory]);
    let (_registrar, meta) = join(&env, &stack, "memory", registrant).await;
    assert_eq!(meta.probe, ProbeKind::Mcp);
    for tool in ["create_entities", "read_graph", "search_nodes"] {
        assert!(
            meta.tools.iter().any(|t| t == tool),
            "{tool} registered: {:?}",
            meta.tools
        );
    }
    assert_eq!(
        meta.protocol_versions,
        ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26"],
        "the bridge serves every revision"
    );

    let url = stack.url("memory");
    let alice =
        r#"{"entities":[{"name":"alice","entityType":"person","observations":["likes tea"]}]}"#;
    let create = format!("call:create_entities:{alice}");
    let lines = sdk::python(&url, &["initialize", "list", &create, "call:read_graph"]).await;
    assert!(
        sdk::step_ok(&lines, "list")["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["name"] == "read_graph")),
        "{lines:#?}"
    );
    assert!(
        text_of(sdk::step_ok(&lines, "call:read_graph")).contains("likes tea"),
        "{lines:#?}"
    );

    for which in Sdk::ALL {
        let run = NodeClient::new(which)
            .step(
                "tools/call",
                json!({"name": "search_nodes", "arguments": {"query": "alice"}}),
            )
            .run(&url)
            .await;
        let result = run.result("tools/call");
        assert!(
            text_of(result).contains("likes tea"),
            "{} through /mcp/memory: {}",
            run.sdk(),
            run.report
        );
    }
    // A 2026-07-28 client: stateless requests, answered by the bridge's pool.
    let run = NodeClient::new(Sdk::V2)
        .protocol_version("2026-07-28")
        .step("tools/call", json!({"name": "read_graph", "arguments": {}}))
        .run(&url)
        .await;
    assert_eq!(run.protocol_version(), Some("2026-07-28"), "{}", run.report);
    assert!(
        text_of(run.result("tools/call")).contains("likes tea"),
        "{}",
        run.report
    );

    let all = stack.aggregate_url();
    wait_listed(&all, "memory__read_graph").await;
    let lines = sdk::python(&all, &["initialize", "call:memory__read_graph"]).await;
    assert!(
        text_of(sdk::step_ok(&lines, "call:memory__read_graph")).contains("likes tea"),
        "{lines:#?}"
    );
    let run = NodeClient::new(Sdk::V2)
        .step(
            "tools/call",
            json!({"name": "memory__open_nodes", "arguments": {"names": ["alice"]}}),
        )
        .run(&all)
        .await;
    assert!(
        text_of(run.result("tools/call")).contains("likes tea"),
        "{}",
        run.report
    );
}

#[tokio::test]
async fn server_filesystem_joins_and_the_sdks_read_a_file_through_both_urls() {
    let env = TestEnv::new("stdio_filesystem_joins");
    let stack = Stack::start(&env).await;
    let dir = env.path("files");
    std::fs::create_dir_all(&dir).expect("files dir");
    let file = dir.join("hello.txt");
    std::fs::write(&file, "hello from a stdio server\n").expect("write the file");
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "fs").child(
        node(),
        &[
            filesystem_server().display().to_string(),
            dir.display().to_string(),
        ],
    );
    let (_registrar, meta) = join(&env, &stack, "fs", registrant).await;
    assert!(
        meta.tools.iter().any(|t| t == "read_text_file"),
        "{:?}",
        meta.tools
    );

    let url = stack.url("fs");
    let read = format!(
        r#"call:read_text_file:{{"path":{}}}"#,
        json!(file.display().to_string())
    );
    let lines = sdk::python(&url, &["initialize", &read]).await;
    assert!(
        text_of(sdk::step_ok(&lines, &read)).contains("hello from a stdio server"),
        "{lines:#?}"
    );
    let run = NodeClient::new(Sdk::V1)
        .step(
            "tools/call",
            json!({"name": "list_directory", "arguments": {"path": dir}}),
        )
        .run(&url)
        .await;
    assert!(
        text_of(run.result("tools/call")).contains("hello.txt"),
        "{}",
        run.report
    );

    let all = stack.aggregate_url();
    wait_listed(&all, "fs__read_text_file").await;
    let run = NodeClient::new(Sdk::V2)
        .step(
            "tools/call",
            json!({"name": "fs__read_text_file", "arguments": {"path": file}}),
        )
        .run(&all)
        .await;
    assert!(
        text_of(run.result("tools/call")).contains("hello from a stdio server"),
        "{}",
        run.report
    );
    let lines = sdk::python_in_mode(
        &all,
        "2026-07-28",
        &["initialize", "call:fs__list_directory:{\"path\":\".\"}"],
    )
    .await;
    // A path outside the allowed directory is refused by the server itself: its answer
    // reached the client through the pool.
    let report = lines
        .iter()
        .find(|l| l["step"] == "call:fs__list_directory:{\"path\":\".\"}")
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(
        report.get("ok").is_some() || report.get("mcp_error").is_some(),
        "{lines:#?}"
    );
}

#[tokio::test]
async fn a_python_sdk_stdio_server_joins_and_serves_2025_sessions_and_2026_requests() {
    let env = TestEnv::new("stdio_python_joins");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio").child(&python, &args);
    let (registrar, meta) = join(&env, &stack, "pystdio", registrant).await;
    assert!(meta.tools.iter().any(|t| t == "echo"), "{:?}", meta.tools);
    let log = registrar.log();
    assert!(
        log.contains("speaks 2026-07-28"),
        "the pool found the revision: {log}"
    );

    let url = stack.url("pystdio");
    let complain = "call:complain:{\"text\":\"a line on stderr\"}";
    let lines = sdk::python(
        &url,
        &[
            "initialize",
            "call:echo:{\"text\":\"legacy\"}",
            complain,
            "call:pid",
        ],
    )
    .await;
    assert_eq!(
        text_of(sdk::step_ok(&lines, "call:echo:{\"text\":\"legacy\"}")),
        "legacy"
    );
    sdk::step_ok(&lines, complain);
    // The server's stderr is in the registrar's log, with the server's pid.
    let pid = text_of(sdk::step_ok(&lines, "call:pid"));
    wait_until(
        "the server's stderr line is logged with its pid",
        Duration::from_secs(10),
        || async {
            registrar
                .log()
                .lines()
                .map(without_colours)
                .any(|l| l.contains("a line on stderr") && l.contains(&format!("pid={pid}")))
        },
    )
    .await;
    let lines = sdk::python_in_mode(
        &url,
        "2026-07-28",
        &["initialize", "call:echo:{\"text\":\"modern\"}"],
    )
    .await;
    assert_eq!(
        sdk::step_ok(&lines, "initialize")["protocolVersion"],
        "2026-07-28",
        "{lines:#?}"
    );
    assert_eq!(
        text_of(sdk::step_ok(&lines, "call:echo:{\"text\":\"modern\"}")),
        "modern"
    );
    for which in Sdk::ALL {
        let run = NodeClient::new(which)
            .step(
                "tools/call",
                json!({"name": "echo", "arguments": {"text": "node"}}),
            )
            .run(&url)
            .await;
        assert_eq!(text_of(run.result("tools/call")), "node", "{}", run.report);
    }
    let all = stack.aggregate_url();
    wait_listed(&all, "pystdio__echo").await;
    let lines = sdk::python_in_mode(
        &all,
        "auto",
        &["initialize", "call:pystdio__echo:{\"text\":\"all\"}"],
    )
    .await;
    assert_eq!(
        text_of(sdk::step_ok(
            &lines,
            "call:pystdio__echo:{\"text\":\"all\"}"
        )),
        "all",
        "{lines:#?}"
    );
}

#[tokio::test]
async fn progress_and_elicitation_from_a_stdio_tool_reach_the_python_sdk_through_the_gateway() {
    let env = TestEnv::new("stdio_progress_elicitation");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio").child(&python, &args);
    let (_registrar, _) = join(&env, &stack, "pystdio", registrant).await;

    let url = stack.url("pystdio");
    let progress = "progress-call:progress:{\"steps\":3}";
    let ask = "call:ask:{\"question\":\"your favourite colour?\"}";
    let lines = sdk::python_with(
        &["--elicit-answer", "blue"],
        &url,
        &["initialize", progress, ask],
    )
    .await;
    let reported = sdk::step_ok(&lines, progress);
    let seen = reported["progress"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        seen.len(),
        3,
        "three progress notifications reached the client: {lines:#?}"
    );
    assert_eq!(seen[2]["message"], "step 3 of 3");
    assert_eq!(text_of(&reported["result"]), "3 steps done");
    assert_eq!(
        text_of(sdk::step_ok(&lines, ask)),
        "the client answered 'blue'",
        "the elicitation request reached the client and its answer the tool: {lines:#?}"
    );
}

#[tokio::test]
async fn each_session_has_a_server_of_its_own_so_its_graph_stays_its_own() {
    let env = TestEnv::new("stdio_per_session_state");
    let stack = Stack::start(&env).await;
    // server-memory keeps its graph in a file: each process gets one of its own.
    let script = format!(
        "MEMORY_FILE_PATH=$(mktemp -p {}) exec node {}",
        env.dir().display(),
        memory_server().display()
    );
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "memory")
        .child(Path::new("sh"), &["-c".to_string(), script]);
    let (_registrar, _) = join(&env, &stack, "memory", registrant).await;
    let url = stack.url("memory");
    let flag = env.path("a-goes-on").display().to_string();
    let alice = r#"call:create_entities:{"entities":[{"name":"alice","entityType":"person","observations":["from session a"]}]}"#;
    let wait = format!("wait:{flag}");
    let mut a = PythonLive::spawn(&[], &url, &["initialize", alice, &wait, "call:read_graph"]);
    for _ in 0..2 {
        let r = a.next(Duration::from_secs(30)).await.expect("a report");
        assert!(r.get("ok").is_some(), "session a: {r}");
    }
    wait_until("session a waits", Duration::from_secs(20), || async {
        Path::new(&format!("{flag}.waiting")).exists()
    })
    .await;
    let bob = r#"call:create_entities:{"entities":[{"name":"bob","entityType":"person","observations":["from session b"]}]}"#;
    let lines = sdk::python(
        &url,
        &["initialize", "call:read_graph", bob, "call:read_graph"],
    )
    .await;
    let first = lines
        .iter()
        .find(|l| l["step"] == "call:read_graph")
        .map(|l| text_of(&l["ok"]))
        .unwrap_or_default();
    assert!(
        !first.contains("alice"),
        "session b does not see session a's graph: {lines:#?}"
    );
    std::fs::write(&flag, "").expect("let session a go on");
    a.next(Duration::from_secs(30))
        .await
        .expect("the wait step");
    let r = a.next(Duration::from_secs(30)).await.expect("a report");
    let graph = text_of(&r["ok"]);
    assert!(
        graph.contains("from session a") && !graph.contains("from session b"),
        "session a sees its own graph only: {r}"
    );
    a.finish().await;
}

#[tokio::test]
async fn in_shared_mode_one_server_serves_every_session_and_each_gets_its_own_progress() {
    let env = TestEnv::new("stdio_shared");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio")
        .flag("--shared")
        .child(&python, &args);
    let (_registrar, _) = join(&env, &stack, "pystdio", registrant).await;
    let url = stack.url("pystdio");

    // One process: what one session keeps, the other sees.
    let lines = sdk::python(
        &url,
        &["initialize", "call:remember:{\"x\":\"shared\"}", "call:pid"],
    )
    .await;
    let pid = text_of(sdk::step_ok(&lines, "call:pid"));
    let lines = sdk::python(&url, &["initialize", "call:recall", "call:pid"]).await;
    assert!(
        text_of(sdk::step_ok(&lines, "call:recall")).contains("'shared'"),
        "{lines:#?}"
    );
    assert_eq!(
        text_of(sdk::step_ok(&lines, "call:pid")),
        pid,
        "the same server"
    );

    // Two sessions at once, the same request ids and progress tokens on both: each hears its
    // own progress and gets its own answer.
    let four = "progress-call:progress:{\"steps\":4}";
    let six = "progress-call:progress:{\"steps\":6}";
    let steps_a = ["initialize", four];
    let steps_b = ["initialize", six];
    let (a, b) = tokio::join!(sdk::python(&url, &steps_a), sdk::python(&url, &steps_b));
    for (lines, step, n) in [(&a, four, 4), (&b, six, 6)] {
        let r = sdk::step_ok(lines, step);
        let seen = r["progress"].as_array().cloned().unwrap_or_default();
        assert_eq!(seen.len(), n, "{lines:#?}");
        assert!(
            seen.iter()
                .all(|p| p["total"] == json!(n as f64) || p["total"] == json!(n)),
            "{lines:#?}"
        );
        assert_eq!(text_of(&r["result"]), format!("{n} steps done"));
    }
    // A request of the server reaches the session whose call caused it.
    let ask = "call:ask:{\"question\":\"which?\"}";
    let lines = sdk::python_with(&["--elicit-answer", "green"], &url, &["initialize", ask]).await;
    assert_eq!(
        text_of(sdk::step_ok(&lines, ask)),
        "the client answered 'green'",
        "{lines:#?}"
    );
}

#[tokio::test]
async fn a_child_killed_mid_call_gets_the_agent_an_mcp_reply_and_the_next_call_a_new_child() {
    let env = TestEnv::new("stdio_sigkill");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio").child(&python, &args);
    let (registrar, _) = join(&env, &stack, "pystdio", registrant).await;
    let url = stack.url("pystdio");
    let flag = env.path("go-on").display().to_string();
    let wait = format!("wait:{flag}");
    let mut live = PythonLive::spawn(
        &["--go-on"],
        &url,
        &[
            "initialize",
            "call:pid",
            &wait,
            "call:slow:{\"seconds\":30}",
            "call:pid",
        ],
    );
    live.next(Duration::from_secs(30))
        .await
        .expect("initialize");
    let first = live.next(Duration::from_secs(30)).await.expect("pid");
    let pid: i32 = text_of(&first["ok"]).parse().expect("a pid");
    wait_until("the client waits", Duration::from_secs(20), || async {
        Path::new(&format!("{flag}.waiting")).exists()
    })
    .await;
    std::fs::write(&flag, "").expect("go on");
    live.next(Duration::from_secs(30))
        .await
        .expect("the wait step");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL");
    let killed_at = Instant::now();

    let slow = live
        .next(Duration::from_secs(20))
        .await
        .expect("the slow call's reply");
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "the reply came at once, not when the call would have ended"
    );
    let why = failure_text(&slow);
    assert!(
        why.contains(&pid.to_string()) && why.contains("signal: 9"),
        "the reply names the server and what happened: {why}"
    );
    let next = live
        .next(Duration::from_secs(30))
        .await
        .expect("the next call");
    let new_pid: i32 = text_of(&next["ok"])
        .parse()
        .unwrap_or_else(|_| panic!("{next}"));
    assert_ne!(new_pid, pid, "a new server serves the session");
    live.finish().await;
    assert!(registrar
        .log()
        .contains("starting the session's server again"));
}

#[tokio::test]
async fn garbage_or_a_100_mib_line_ends_only_that_child_and_other_sessions_go_on() {
    let env = TestEnv::new("stdio_garbage");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio").child(&python, &args);
    let (mut registrar, _) = join(&env, &stack, "pystdio", registrant).await;
    let url = stack.url("pystdio");

    // Session b keeps something in its server, and waits.
    let flag = env.path("b-goes-on").display().to_string();
    let wait = format!("wait:{flag}");
    let mut b = PythonLive::spawn(
        &[],
        &url,
        &[
            "initialize",
            "call:remember:{\"x\":\"kept by b\"}",
            "call:pid",
            &wait,
            "call:recall",
            "call:pid",
        ],
    );
    for _ in 0..2 {
        b.next(Duration::from_secs(30)).await.expect("b's report");
    }
    let b_pid = text_of(&b.next(Duration::from_secs(30)).await.expect("b's pid")["ok"]);

    let huge = "call:huge_line:{\"mib\":100}";
    let lines = sdk::python_with(
        &["--go-on"],
        &url,
        &[
            "initialize",
            "call:pid",
            "call:garbage",
            "call:pid",
            huge,
            "call:pid",
        ],
    )
    .await;
    let pids: Vec<String> = lines
        .iter()
        .filter(|l| l["step"] == "call:pid")
        .map(|l| text_of(&l["ok"]))
        .collect();
    assert_eq!(
        pids.len(),
        3,
        "each call after a fault is served: {lines:#?}"
    );
    assert!(
        pids[0] != pids[1] && pids[1] != pids[2],
        "a new server after each fault: {pids:?}"
    );
    let garbage = lines
        .iter()
        .find(|l| l["step"] == "call:garbage")
        .expect("garbage step");
    assert!(
        failure_text(garbage).contains("not JSON-RPC"),
        "the reply names the fault: {garbage}"
    );
    let long = lines
        .iter()
        .find(|l| l["step"] == huge)
        .expect("huge line step");
    assert!(
        failure_text(long).contains("longer than 4194304 bytes"),
        "the reply names the fault: {long}"
    );

    assert!(registrar.is_running(), "the bridge survives");
    let rss = toolgate_tests::rss_kib(registrar.pid());
    assert!(
        rss < 96 * 1024,
        "the bridge never held the 100 MiB line: RSS {rss} KiB"
    );
    std::fs::write(&flag, "").expect("let b go on");
    b.next(Duration::from_secs(30))
        .await
        .expect("the wait step");
    let recall = b.next(Duration::from_secs(30)).await.expect("b's recall");
    assert!(
        text_of(&recall["ok"]).contains("kept by b"),
        "b's server is untouched: {recall}"
    );
    let pid = b.next(Duration::from_secs(30)).await.expect("b's pid");
    assert_eq!(text_of(&pid["ok"]), b_pid);
    b.finish().await;
}

fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": VERSION, "capabilities": {},
        "clientInfo": {"name": "stdio-test", "version": "0"}}})
}

#[tokio::test]
async fn sessions_are_bounded_and_end_with_delete_or_idleness_taking_their_servers_along() {
    let env = TestEnv::new("stdio_session_bounds");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio")
        .arg("--max-sessions", "2")
        .arg("--session-idle-timeout", "3s")
        .arg("--spares", "0")
        .child(&python, &args);
    let (registrar, meta) = join(&env, &stack, "pystdio", registrant).await;
    let url = format!("http://{}/mcp", meta.endpoint);
    let http = reqwest::Client::new();
    let servers = || children_of(registrar.pid()).len();
    assert_eq!(servers(), 1, "the pool's server");

    let mut sessions = Vec::new();
    for _ in 0..2 {
        let resp = post_message(&http, &url, None, None, &initialize()).await;
        assert_eq!(resp.status(), 200);
        let id = resp.headers()["mcp-session-id"]
            .to_str()
            .expect("id")
            .to_string();
        sessions.push(id);
    }
    assert_eq!(servers(), 3, "a server per session");
    let resp = post_message(&http, &url, None, None, &initialize()).await;
    assert_eq!(resp.status(), 503);
    let body: Value = resp.json().await.expect("a JSON-RPC error");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("--max-sessions"), "{body}");

    let resp = http
        .delete(&url)
        .header("mcp-session-id", &sessions[0])
        .send()
        .await
        .expect("DELETE");
    assert_eq!(resp.status(), 204);
    wait_until(
        "the deleted session's server exits",
        Duration::from_secs(10),
        || async { servers() == 2 },
    )
    .await;
    let gone = post_message(
        &http,
        &url,
        Some(&sessions[0]),
        Some(VERSION),
        &json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}),
    )
    .await;
    assert_eq!(gone.status(), 404);
    let resp = post_message(&http, &url, None, None, &initialize()).await;
    assert_eq!(resp.status(), 200, "a place again");

    wait_until(
        "idle sessions end with their servers",
        Duration::from_secs(15),
        || async { servers() == 1 },
    )
    .await;
    let idle = post_message(
        &http,
        &url,
        Some(&sessions[1]),
        Some(VERSION),
        &json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}),
    )
    .await;
    assert_eq!(idle.status(), 404);
}

#[tokio::test]
async fn a_call_the_agent_cancels_is_cancelled_in_the_stdio_server_and_answered_at_once() {
    let env = TestEnv::new("stdio_cancel");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio").child(&python, &args);
    let (_registrar, _) = join(&env, &stack, "pystdio", registrant).await;
    // Through the gateway, as an agent speaks.
    let url = stack.url("pystdio");
    let http = reqwest::Client::new();
    let session = open_session(&http, &url, VERSION, json!({})).await;

    let marker = env.path("cancelled");
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "until_cancelled", "arguments": {"marker": marker, "seconds": 30}}});
    let pending = tokio::spawn({
        let (http, url, session) = (http.clone(), url.clone(), session.clone());
        async move {
            let resp = post_message(&http, &url, Some(&session), Some(VERSION), &call).await;
            let status = resp.status();
            (status, resp.text().await.unwrap_or_default())
        }
    });
    let started = PathBuf::from(format!("{}.started", marker.display()));
    wait_until("the tool runs", Duration::from_secs(20), || async {
        started.exists()
    })
    .await;
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "the agent gave up"}});
    let resp = post_message(&http, &url, Some(&session), Some(VERSION), &cancel).await;
    assert_eq!(resp.status(), 202);
    let (status, body) = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the cancelled call is answered at once, not when the tool would end")
        .expect("the call's task");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"id\":7") && body.contains("cancelled by the client"),
        "the caller hears its call was cancelled: {body}"
    );
    wait_until(
        "the server's tool is cancelled",
        Duration::from_secs(10),
        || async { marker.exists() },
    )
    .await;

    // The session goes on, on the same server.
    let echo = json!({"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {
        "name": "echo", "arguments": {"text": "still here"}}});
    let resp = post_message(&http, &url, Some(&session), Some(VERSION), &echo).await;
    let body = resp.text().await.unwrap_or_default();
    assert!(body.contains("still here"), "{body}");
}

/// The JSON-RPC message of an answer, sent as JSON or as an SSE stream.
fn answer_of(body: &str) -> Value {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        return v;
    }
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v.get("result").is_some() || v.get("error").is_some())
        .unwrap_or(Value::Null)
}

async fn call(
    http: &reqwest::Client,
    url: &str,
    session: &str,
    id: u64,
    tool: &str,
    args: Value,
) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": tool, "arguments": args}});
    let resp = post_message(http, url, Some(session), Some(VERSION), &body).await;
    answer_of(&resp.text().await.unwrap_or_default())
}

#[tokio::test]
async fn a_server_that_stops_reading_fills_only_its_own_queue_and_other_sessions_go_on() {
    let env = TestEnv::new("stdio_full_pipe");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    // No hang detection: the stopped server stays, its queue full, for as long as the test
    // looks.
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio")
        .arg("--hang-timeout", "0")
        .child(&python, &args);
    let (mut registrar, meta) = join(&env, &stack, "pystdio", registrant).await;
    let bridge = format!("http://{}/mcp", meta.endpoint);
    let http = reqwest::Client::new();

    let a = open_session(&http, &bridge, VERSION, json!({})).await;
    let a_pid: i32 = text_of(&call(&http, &bridge, &a, 2, "pid", json!({})).await["result"])
        .parse()
        .expect("a pid");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a_pid), Signal::SIGSTOP).expect("SIGSTOP");

    // 16 calls of 1.5 MiB to a server that reads nothing: more than its queue (16 MiB) holds.
    let big = "x".repeat(3 << 19);
    let mut flood = Vec::new();
    for i in 0..16u64 {
        let (http, bridge, a, big) = (http.clone(), bridge.clone(), a.clone(), big.clone());
        flood.push(tokio::spawn(async move {
            call(&http, &bridge, &a, 100 + i, "echo", json!({"text": big})).await
        }));
    }
    // The calls beyond the queue are refused at once, naming the server.
    let mut refused = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while refused.len() < 4 && Instant::now() < deadline {
        for task in flood.iter_mut().filter(|t| t.is_finished()) {
            let answer = task.await.expect("a call's task");
            refused.push(answer);
        }
        flood.retain(|t| !t.is_finished());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        refused.len() >= 4,
        "the calls beyond the queue were answered at once: {} of 16",
        refused.len()
    );
    for answer in &refused {
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("is not reading its input") && message.contains(&a_pid.to_string()),
            "{answer}"
        );
    }
    assert!(!flood.is_empty(), "some calls wait in the queue");

    // Another session, on its own server, goes on through the gateway meanwhile.
    let t0 = Instant::now();
    let lines = sdk::python(
        &stack.url("pystdio"),
        &["initialize", "call:echo:{\"text\":\"b goes on\"}"],
    )
    .await;
    assert_eq!(
        text_of(sdk::step_ok(&lines, "call:echo:{\"text\":\"b goes on\"}")),
        "b goes on"
    );
    assert!(t0.elapsed() < Duration::from_secs(15));
    assert!(registrar.is_running());

    // Once the server reads again, the calls that waited in its queue are answered (the
    // others were refused as above, maybe after this test last looked).
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a_pid), Signal::SIGCONT).expect("SIGCONT");
    let mut answered = 0;
    for task in flood {
        let answer = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("a queued call is answered")
            .expect("a call's task");
        if answer.get("result").is_some() {
            assert_eq!(text_of(&answer["result"]).len(), big.len());
            answered += 1;
        } else {
            let message = answer["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("is not reading its input"), "{answer}");
        }
    }
    assert!(
        answered >= 5,
        "the queue held calls until the server read them: {answered} answered"
    );
}

#[tokio::test]
async fn a_wedged_stdio_server_leaves_rotation_and_is_restarted() {
    let env = TestEnv::new("stdio_wedged");
    let stack = Stack::start(&env).await;
    let (python, args) = python_stdio_server();
    let registrant = Registrant::stdio(&stack.etcd.endpoint(), "pystdio")
        .arg("--spares", "0")
        // Longer than toolgate-xds takes to miss two probes (2 s apart): the gateway must see
        // the wedge through the bridge's answers before the bridge restarts the server.
        .arg("--hang-timeout", "8s")
        .child(&python, &args);
    let (registrar, meta) = join(&env, &stack, "pystdio", registrant).await;
    let pool = children_of(registrar.pid());
    assert_eq!(pool.len(), 1, "the pool's server alone");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pool[0]), Signal::SIGSTOP).expect("SIGSTOP");

    wait_until(
        "the wedged server leaves rotation",
        Duration::from_secs(20),
        || async { stack.healthy("pystdio").await.is_empty() },
    )
    .await;
    wait_until(
        "a new server is started in its place",
        Duration::from_secs(30),
        || async {
            let now = children_of(registrar.pid());
            now.len() == 1 && now[0] != pool[0]
        },
    )
    .await;
    serving(&stack, "pystdio", &meta).await;
    assert!(registrar.log().contains("hangs"), "{}", registrar.log());
    let lines = sdk::python(
        &stack.url("pystdio"),
        &["initialize", "call:echo:{\"text\":\"back\"}"],
    )
    .await;
    assert_eq!(
        text_of(sdk::step_ok(&lines, "call:echo:{\"text\":\"back\"}")),
        "back"
    );
}
