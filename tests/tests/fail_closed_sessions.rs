//! The sessions the gateway holds with servers for its clients fail closed: a session the
//! client or the live server ended stays ended, one lost to a restart or a gone instance is
//! re-opened (and the call replayed, once, and counted), two users never share one, and a
//! caller or a service cannot make the gateway hold sessions without bound. Real etcd,
//! toolgate-xds, Envoy with the filter; servers on the official Python SDK (stateful, with
//! per-session state: `remember` / `recall`) and the reference everything-server (TypeScript
//! SDK); clients on raw HTTP, the official Python SDK and the TypeScript SDK.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{
    free_port, sdk, wait_until, Issuer, McpServer, McpSession, NodeClient, Options, Proc,
    Registrant, Reply, Sdk, ServerCommand, Stack, TestEnv,
};

/// The tools the notes server registers.
const NOTES_TOOLS: &str = "read_order,write_order,fail_order,slow_order,remember,recall";

/// The official Python SDK server with per-session notes (`tests/python/server.py --notes`),
/// registered as `service`, routed by Envoy and known to the filter.
struct Notes {
    server: McpServer,
    _registrar: Proc,
}

impl Notes {
    async fn start(env: &TestEnv, stack: &Stack, service: &str, id: &str, extra: &[&str]) -> Notes {
        let mut args = vec!["--notes"];
        args.extend_from_slice(extra);
        let server = McpServer::python(env, id, &args).await;
        let registrar = Registrant::new(&stack.etcd.endpoint(), service, &server.endpoint())
            .arg("--instance-id", id)
            .arg("--tools", NOTES_TOOLS)
            .arg("--ttl", "10")
            .spawn(env, &format!("{id}.registrar"));
        stack
            .wait_healthy_addresses(service, &[server.endpoint()], Duration::from_secs(30))
            .await;
        let remember = format!("{service}__remember");
        stack
            .wait_filter_config(&format!("{service} in the catalog, on /mcp"), |c| {
                c["catalog"].get(service).is_some()
                    && c["virtual_servers"]["default"]["tools"][remember.as_str()]["tool"]
                        == "remember"
            })
            .await;
        Notes {
            server,
            _registrar: registrar,
        }
    }

    /// How many sessions the server opened (initializes it accepted).
    async fn initializes(&self) -> u64 {
        self.server.calls("initialize").await
    }
}

/// A 2026-07-28 `tools/call` (no session: the client states who it is in `_meta`), with a
/// bearer token when given.
async fn modern_call(
    url: &str,
    token: Option<&str>,
    client: &str,
    tool: &str,
    arguments: Value,
) -> Reply {
    let mut s = McpSession::unconnected(url);
    s.bearer = token.map(str::to_string);
    let body = json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {
            "name": tool,
            "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientInfo": {"name": client, "version": "1.0"},
                "io.modelcontextprotocol/clientCapabilities": {}
            }
        }
    });
    s.post_raw(
        body.to_string(),
        &[
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", tool),
        ],
    )
    .await
}

/// Turns the gateway's token checks on against `issuer` (`required`: who needs a token).
async fn auth_on(stack: &Stack, issuer: &Issuer, required: Value) {
    let base = stack.base_url();
    stack
        .admin_put("/v1/auth/config", &issuer.auth_config(&base, required))
        .await;
    stack
        .wait_filter_config("the auth configuration", |c| {
            c["auth"]["resource"] == base.as_str()
        })
        .await;
}

fn delete(url: &str, session: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .delete(url)
        .header("mcp-session-id", session)
        .header(
            "mcp-protocol-version",
            toolgate_tests::mcp::PROTOCOL_VERSION,
        )
}

#[tokio::test]
async fn a_session_the_client_deleted_stays_deleted() {
    let env = TestEnv::new("fail_closed_sessions_deleted");
    let stack = Stack::start(&env).await;
    let notes = Notes::start(&env, &stack, "notes", "notes-1", &[]).await;
    let url = stack.url("notes");

    let mut s = McpSession::connect(&url).await;
    let r = s.call_tool("remember", json!({"x": "kept"})).await;
    assert!(r.text().contains("kept"), "{}", r.body);
    let id = s.session.clone().expect("a session id");
    let ended = delete(&url, &id).send().await.expect("DELETE");
    assert_eq!(ended.status(), StatusCode::OK);

    // The same id again: the server's 404 reaches the client, which must initialize anew.
    let r = s.call_tool("recall", json!({})).await;
    if r.status != StatusCode::NOT_FOUND {
        env.print_failure_logs();
    }
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "a deleted session came back: {}",
        r.body
    );
    assert_eq!(notes.initializes().await, 1, "no session was opened anew");
}

#[tokio::test]
async fn a_session_the_server_expired_ends_for_the_client() {
    let env = TestEnv::new("fail_closed_sessions_expired");
    let stack = Stack::start(&env).await;
    let notes = Notes::start(
        &env,
        &stack,
        "notes",
        "notes-1",
        &["--session-idle-timeout", "3"],
    )
    .await;
    let opened_before = notes.initializes().await;

    // On the service's route (the client's own session) and on /mcp (a session the gateway
    // holds for the client's gateway session).
    let mut routed = McpSession::connect(&stack.url("notes")).await;
    let r = routed.call_tool("remember", json!({"x": "route"})).await;
    assert!(r.text().contains("route"), "{}", r.body);
    let mut aggregate = McpSession::connect(&stack.aggregate_url()).await;
    let r = aggregate
        .call_tool("notes__remember", json!({"x": "aggregate"}))
        .await;
    assert!(r.text().contains("aggregate"), "{}", r.body);
    assert_eq!(notes.initializes().await, opened_before + 2);

    // The server ends both after 3 s unused.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let r = routed.call_tool("recall", json!({})).await;
    let a = aggregate.call_tool("notes__recall", json!({})).await;
    if r.status != StatusCode::NOT_FOUND || a.status != StatusCode::NOT_FOUND {
        env.print_failure_logs();
    }
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "an expired session came back on the route: {}",
        r.body
    );
    assert_eq!(
        a.status,
        StatusCode::NOT_FOUND,
        "an expired session came back on /mcp: {}",
        a.body
    );
    assert_eq!(
        notes.initializes().await,
        opened_before + 2,
        "no session was revived"
    );
    // The gateway session ended with it: the client initializes again, and goes on.
    let again = aggregate.list_tools().await;
    assert_eq!(again.status, StatusCode::NOT_FOUND, "{}", again.body);
    let mut fresh = McpSession::connect(&stack.aggregate_url()).await;
    let r = fresh.call_tool("notes__recall", json!({})).await;
    assert!(r.text().contains("holds nothing"), "{}", r.body);
}

#[tokio::test]
async fn two_users_stating_the_same_client_never_share_a_session() {
    let env = TestEnv::new("fail_closed_sessions_two_users");
    let issuer = Issuer::start().await;
    let stack = Stack::start(&env).await;
    let notes = Notes::start(&env, &stack, "notes", "notes-1", &["--legacy-only"]).await;
    stack
        .wait_filter_config("notes speaks only legacy revisions", |c| {
            c["legacy_revisions"]["notes"].is_string()
        })
        .await;
    auth_on(&stack, &issuer, json!(["*"])).await;
    let base = stack.base_url();
    let url = stack.aggregate_url();
    let alice = issuer.token().sub("alice").aud(&base).sign();
    let bob = issuer.token().sub("bob").aud(&base).sign();
    let opened_before = notes.initializes().await;

    wait_until(
        "alice's token is accepted (JWKS fetched)",
        Duration::from_secs(20),
        || async {
            let r = modern_call(
                &url,
                Some(&alice),
                "shared-agent",
                "notes__remember",
                json!({"x": "alice-secret-42"}),
            )
            .await;
            r.text().contains("alice-secret-42")
        },
    )
    .await;
    let r = modern_call(&url, Some(&bob), "shared-agent", "notes__recall", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    if r.text().contains("alice-secret-42") {
        env.print_failure_logs();
    }
    assert!(
        !r.text().contains("alice-secret-42"),
        "bob read alice's session: {}",
        r.text()
    );
    let r = modern_call(
        &url,
        Some(&bob),
        "shared-agent",
        "notes__remember",
        json!({"x": "bob-7"}),
    )
    .await;
    assert!(r.text().contains("bob-7"), "{}", r.body);
    let r = modern_call(
        &url,
        Some(&alice),
        "shared-agent",
        "notes__recall",
        json!({}),
    )
    .await;
    assert!(
        r.text().contains("alice-secret-42"),
        "bob overwrote alice's value: {}",
        r.text()
    );
    assert_eq!(
        notes.initializes().await,
        opened_before + 2,
        "one session each"
    );
    assert_eq!(
        stack
            .xds
            .metric("toolgate_upstream_sessions", r#"owner="stateless""#)
            .await,
        2.0
    );
}

#[tokio::test]
async fn held_sessions_are_bounded_per_caller_and_per_service() {
    let env = TestEnv::new("fail_closed_sessions_bounded");
    let issuer = Issuer::start().await;
    let stack = Stack::with(
        &env,
        Options::default().xds_arg(&[
            "--max-held-sessions-per-caller",
            "2",
            "--max-held-sessions-per-service",
            "4",
            "--held-session-evictable-after",
            "3s",
        ]),
    )
    .await;
    let notes = Notes::start(&env, &stack, "notes", "notes-1", &["--legacy-only"]).await;
    stack
        .wait_filter_config("notes speaks only legacy revisions", |c| {
            c["legacy_revisions"]["notes"].is_string()
        })
        .await;
    // Tokens are optional: a caller with one is its subject, one without its address.
    auth_on(&stack, &issuer, json!([])).await;
    let base = stack.base_url();
    let url = stack.aggregate_url();
    let alice = issuer.token().sub("alice").aud(&base).sign();
    let bob = issuer.token().sub("bob").aud(&base).sign();
    let opened_before = notes.initializes().await;
    let recall = |token: Option<String>, client: &'static str| {
        let url = url.clone();
        async move { modern_call(&url, token.as_deref(), client, "notes__recall", json!({})).await }
    };

    // Without a token, one address: two sessions, then the bound.
    for client in ["c0", "c1"] {
        let r = recall(None, client).await;
        assert!(r.text().contains("holds nothing"), "{client}: {}", r.body);
    }
    let r = recall(None, "c2").await;
    if !r.text().contains("at most 2") {
        env.print_failure_logs();
    }
    assert!(
        r.text().contains("at most 2") && r.text().contains("for this caller"),
        "the caller's bound: {}",
        r.body
    );
    // Alice's sessions fill the service's bound; bob is refused until one is idle.
    wait_until(
        "alice's token is accepted",
        Duration::from_secs(20),
        || async {
            recall(Some(alice.clone()), "a0")
                .await
                .text()
                .contains("holds nothing")
        },
    )
    .await;
    let r = recall(Some(alice.clone()), "a1").await;
    assert!(r.text().contains("holds nothing"), "{}", r.body);
    let r = recall(Some(bob.clone()), "b0").await;
    assert!(
        r.text().contains("at most 4") && r.text().contains("for all its callers"),
        "the service's bound: {}",
        r.body
    );
    assert_eq!(notes.initializes().await, opened_before + 4);
    let refused = stack
        .xds
        .metric(
            "toolgate_upstream_sessions_refused_total",
            r#"service="notes""#,
        )
        .await;
    assert!(refused >= 2.0, "{}", stack.xds.metrics_text().await);

    // Past the idle time, the least recently used makes room.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let r = recall(Some(bob.clone()), "b0").await;
    assert!(r.text().contains("holds nothing"), "{}", r.body);
    assert_eq!(
        stack
            .xds
            .metric(
                "toolgate_upstream_sessions_evicted_total",
                r#"service="notes""#
            )
            .await,
        1.0
    );
    assert_eq!(notes.initializes().await, opened_before + 5);
}

/// A server that refuses to open a session (the Python SDK's at its `max_sessions`: HTTP 503)
/// is named as such in the client's error, not as a server the gateway could not reach.
#[tokio::test]
async fn a_server_refusing_a_session_is_named_as_such() {
    let env = TestEnv::new("fail_closed_sessions_refused");
    let stack = Stack::start(&env).await;
    let _tight = Notes::start(
        &env,
        &stack,
        "tight",
        "tight-1",
        &["--legacy-only", "--max-sessions", "1"],
    )
    .await;
    stack
        .wait_filter_config("tight speaks only legacy revisions", |c| {
            c["legacy_revisions"]["tight"].is_string()
        })
        .await;
    let url = stack.aggregate_url();
    let r = recall_on(&url, "t0", "tight__recall").await;
    assert!(r.text().contains("holds nothing"), "{}", r.body);
    let r = recall_on(&url, "t1", "tight__recall").await;
    let text = r.text();
    if !text.contains("refused to open a session") {
        env.print_failure_logs();
    }
    assert!(
        text.contains("refused to open a session") && text.contains("503"),
        "{}",
        r.body
    );
    assert!(!text.contains("could not reach"), "{}", r.body);
}

async fn recall_on(url: &str, client: &str, tool: &str) -> Reply {
    modern_call(url, None, client, tool, json!({})).await
}

/// A server restarted in place (same address, every session it held gone) under clients
/// whose sessions the gateway holds or seals: the TypeScript SDK's servers answer an unknown
/// session with 400 and JSON-RPC -32000, which means the same as a 404. The next call of each
/// client succeeds, on `/mcp` and on the service's route, with the Python and the TypeScript
/// SDK, and the re-opens are counted.
#[tokio::test]
async fn a_server_restarted_in_place_costs_its_clients_nothing() {
    let env = TestEnv::new("fail_closed_sessions_restart");
    let stack = Stack::start(&env).await;
    let port = free_port();
    let command = ServerCommand::everything(port);
    let mut server = command.spawn(&env, "ev");
    // Unwatched: the registration outlives the server, as it does under a supervisor that
    // restarts it quicker than a registrar would deregister.
    let _registrar = Registrant::new(&stack.etcd.endpoint(), "ev", &command.endpoint())
        .arg("--instance-id", "ev-1")
        .arg("--probe", "mcp")
        .arg("--tools", "echo")
        .arg("--watch-interval", "0")
        .spawn(&env, "ev.registrar");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(30))
        .await;
    stack
        .wait_healthy_addresses("ev", &[command.endpoint()], Duration::from_secs(20))
        .await;
    stack
        .wait_filter_config("ev__echo on /mcp", |c| {
            c["virtual_servers"]["default"]["tools"]["ev__echo"]["tool"] == "echo"
        })
        .await;

    let route = stack.url("ev");
    let aggregate = stack.aggregate_url();
    let echo = |text: &str| json!({"message": text}).to_string();
    let go: Vec<_> = (0..4).map(|i| env.path(&format!("go{i}"))).collect();
    let python = |url: String, tool: &'static str, go: std::path::PathBuf| {
        let (one, two) = (
            format!("call:{tool}:{}", echo("one")),
            format!("call:{tool}:{}", echo("two")),
        );
        tokio::spawn(async move {
            let wait = format!("wait:{}", go.display());
            sdk::python(&url, &["initialize", &one, &wait, &two]).await
        })
    };
    let node = |sdk: Sdk, url: String, tool: &'static str, go: std::path::PathBuf| {
        let client = NodeClient::new(sdk)
            .timeout(Duration::from_secs(80))
            .step(
                "tools/call",
                json!({"name": tool, "arguments": {"message": "one"}}),
            )
            .step("toolgate/wait-file", json!({"path": go}))
            .step(
                "tools/call",
                json!({"name": tool, "arguments": {"message": "two"}}),
            );
        tokio::spawn(async move { client.run(&url).await })
    };
    let py_mcp = python(aggregate.clone(), "ev__echo", go[0].clone());
    let py_route = python(route.clone(), "echo", go[1].clone());
    let ts_mcp = node(Sdk::V1, aggregate.clone(), "ev__echo", go[2].clone());
    let ts_route = node(Sdk::V1, route.clone(), "echo", go[3].clone());
    for g in &go {
        let waiting = g.with_extension("waiting");
        wait_until(
            &format!("the client of {} waits", g.display()),
            Duration::from_secs(40),
            || async { waiting.exists() },
        )
        .await;
    }

    // SIGKILL, and the same server again on the same address.
    server.kill();
    wait_until(
        "the crash is seen (the instance leaves UP)",
        Duration::from_secs(10),
        || async { stack.state("ev", "ev-1").await != "UP" },
    )
    .await;
    let _restarted = command.spawn(&env, "ev-restarted");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(30))
        .await;
    stack
        .wait_healthy_addresses("ev", &[command.endpoint()], Duration::from_secs(20))
        .await;
    for g in &go {
        std::fs::write(g, b"go").expect("write a go file");
    }

    let mut failures = Vec::new();
    for (name, lines) in [
        ("python on /mcp", py_mcp.await.expect("task")),
        ("python on /mcp/ev", py_route.await.expect("task")),
    ] {
        // One line per step, the last the second call's.
        let ok = lines.len() == 4
            && lines.last().is_some_and(|l| {
                l["ok"]["isError"] == false && l["ok"].to_string().contains("two")
            });
        if !ok {
            failures.push(format!("{name}: {lines:?}"));
        }
    }
    for (name, run) in [
        ("typescript 1.x on /mcp", ts_mcp.await.expect("task")),
        ("typescript 1.x on /mcp/ev", ts_route.await.expect("task")),
    ] {
        let calls: Vec<&Value> = run.report["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["method"] == "tools/call")
            .collect();
        let ok = run.exit_code == Some(0)
            && calls.len() == 2
            && calls[1]["ok"] == true
            && calls[1]["result"]["isError"] != true
            && calls[1]["result"].to_string().contains("two");
        if !ok {
            failures.push(format!("{name}: {}", run.report));
        }
    }
    if !failures.is_empty() {
        env.print_failure_logs();
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let reopened = stack
        .xds
        .metric(
            "toolgate_upstream_sessions_reopened_total",
            r#"service="ev""#,
        )
        .await;
    assert!(reopened >= 4.0, "{}", stack.xds.metrics_text().await);
}

/// A call replayed on a new session keeps the verified claims the filter put on it as headers
/// (the service's `claim_headers`): the survivor of a killed instance sees who calls.
#[tokio::test]
async fn a_replayed_call_keeps_its_claim_headers() {
    let env = TestEnv::new("fail_closed_sessions_claims");
    let issuer = Issuer::start().await;
    let stack = Stack::start(&env).await;
    let etcd = stack.etcd.endpoint();
    let mut a = toolgate_tests::Member::start(&env, &etcd, "orders", "a", &[], 30).await;
    let mut b = toolgate_tests::Member::start(&env, &etcd, "orders", "b", &[], 30).await;
    stack
        .wait_healthy("orders", &[&a, &b], Duration::from_secs(20))
        .await;
    auth_on(&stack, &issuer, json!(["*"])).await;
    stack
        .admin_put(
            "/v1/auth/rules/orders",
            &json!({"rules": [{"tools": ["*"], "subjects": ["*"]}],
                "claim_headers": {"sub": "x-caller"}}),
        )
        .await;
    stack
        .wait_filter_config("orders' claim headers", |c| {
            c["auth"]["services"]["orders"]["claim_headers"]["sub"] == "x-caller"
        })
        .await;
    let token = issuer.token().sub("alice").aud(stack.base_url()).sign();
    let url = stack.url("orders");
    let mut s = McpSession::unconnected(&url);
    s.bearer = Some(token.clone());
    wait_until(
        "alice's token is accepted (JWKS fetched)",
        Duration::from_secs(20),
        || async {
            let mut probe = McpSession::unconnected(&url);
            probe.bearer = Some(token.clone());
            probe.initialize().await.status == StatusCode::OK
        },
    )
    .await;
    assert_eq!(s.initialize().await.status, StatusCode::OK);
    let r = s.call_tool("echo", json!({"text": "one"})).await;
    assert!(r.text().contains("one"), "{}", r.body);
    let a_took_it = a.server.calls("echo").await == 1;
    let (dead, survivor) = if a_took_it {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    survivor.server.reset_counters().await;
    dead.server.proc.kill();
    let r = s.call_tool("echo", json!({"text": "two"})).await;
    if !r.text().contains("two") {
        env.print_failure_logs();
    }
    assert!(
        r.text().contains("two"),
        "the call was replayed: {}",
        r.body
    );
    let ran_on = r
        .result()
        .map(|v| v["structuredContent"]["instance_id"].clone())
        .unwrap_or_default();
    assert_eq!(ran_on, survivor.server.instance_id.as_str(), "{}", r.body);
    // What reached the survivor with the claim: every request through Envoy (the filter puts
    // it on each), and what toolgate-xds sent there itself, the replayed call among them.
    let control = survivor.server.control().await;
    let count = |h: &str| control["headers"][h]["count"].as_u64().unwrap_or(0);
    assert_eq!(control["headers"]["x-caller"]["last"], "alice", "{control}");
    assert!(
        count("x-caller") > count("x-envoy-original-path"),
        "the replayed call kept its claim: {control}"
    );
}
