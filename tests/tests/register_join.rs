//! Issue 18, the registrar's part: an MCP server joins toolgate as it is. toolgate-register
//! picks the probe kind (`--probe auto`), lists the tools itself when `--tools` is not given,
//! and keeps the registered list current, against a real etcd (no Envoy needed).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use etcd_client::Client;
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::broadcast;
use toolgate_model::{InstanceMetadata, ProbeKind};
use toolgate_tests::{free_port, wait_until, Etcd, Registrant, TestEnv};

async fn registered(client: &Client, key: &str) -> Option<(InstanceMetadata, i64)> {
    let resp = client.clone().get(key, None).await.ok()?;
    let kv = resp.kvs().first()?;
    let meta = InstanceMetadata::from_json(kv.value()).expect("the value parses");
    Some((meta, kv.lease()))
}

async fn wait_registered(client: &Client, key: &str, within: Duration) -> (InstanceMetadata, i64) {
    wait_until(&format!("{key} is registered"), within, || async {
        registered(client, key).await.is_some()
    })
    .await;
    registered(client, key).await.expect("registered")
}

/// `tests/python/server.py` (the official Python SDK) on `port`, as a registrar's child.
fn python_server(port: u16, extra: &[&str]) -> (std::path::PathBuf, Vec<String>) {
    let root = toolgate_tests::paths::workspace_root();
    let mut args = vec![
        root.join("tests/python/server.py").display().to_string(),
        port.to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    (root.join(".venv/bin/python"), args)
}

/// A log without its colours (the registrar's tracing output carries ANSI escapes).
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

const PY_TOOLS: [&str; 4] = ["read_order", "write_order", "fail_order", "slow_order"];

#[tokio::test]
async fn the_python_sdk_server_without_health_or_tools_joins_with_the_mcp_probe_and_its_tools() {
    let env = TestEnv::new("register_join_python_no_health");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let port = free_port();
    let (python, args) = python_server(port, &["--no-health"]);
    let mut reg = Registrant::new(&etcd.endpoint(), "py", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "py-1")
        .child(&python, &args)
        .spawn(&env, "registrar");
    let key = "/mcp/services/py/py-1";
    let (meta, _) = wait_registered(&client, key, Duration::from_secs(30)).await;
    assert_eq!(meta.probe, ProbeKind::Mcp, "no /health: auto picks mcp");
    assert_eq!(
        meta.tools, PY_TOOLS,
        "the tools come from the server's tools/list"
    );
    assert_eq!(meta.protocol_versions, ["2026-07-28"]);
    let log = plain(&reg.log());
    assert!(log.contains("probe kind chosen"), "{log}");
    assert!(log.contains("HTTP 404 on GET /health"), "{log}");

    reg.signal(Signal::SIGTERM);
    reg.wait_exit(Duration::from_secs(15))
        .await
        .expect("the registrar exits");
    assert!(registered(&client, key).await.is_none(), "deregistered");
}

#[tokio::test]
async fn the_python_sdk_server_with_health_gets_the_http_probe_and_its_tools_still_listed() {
    let env = TestEnv::new("register_join_python_health");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let port = free_port();
    let (python, args) = python_server(port, &[]);
    let mut reg = Registrant::new(&etcd.endpoint(), "py", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "py-2")
        .child(&python, &args)
        .spawn(&env, "registrar");
    let (meta, _) =
        wait_registered(&client, "/mcp/services/py/py-2", Duration::from_secs(30)).await;
    assert_eq!(
        meta.probe,
        ProbeKind::Http,
        "/health answers: auto picks http"
    );
    assert_eq!(meta.tools, PY_TOOLS);
    assert!(
        meta.protocol_versions.is_empty(),
        "versions go with the mcp probe"
    );
    reg.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_server_answering_neither_health_nor_mcp_fails_naming_both_attempts() {
    let env = TestEnv::new("register_join_neither");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let port = free_port();
    let python = toolgate_tests::paths::workspace_root().join(".venv/bin/python");
    // A plain static file server: 404 on GET /health, 501 on POST /mcp.
    let args = strings(&[
        "-m",
        "http.server",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--directory",
        &env.dir().display().to_string(),
    ]);
    let started = Instant::now();
    let mut reg = Registrant::new(&etcd.endpoint(), "plain", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "plain-1")
        .arg("--wait-healthy-timeout", "3s")
        .child(&python, &args)
        .spawn(&env, "registrar");
    let status = reg
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("the registrar gives up");
    assert!(!status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "gave up after {:?}",
        started.elapsed()
    );
    let log = plain(&reg.log());
    assert!(
        log.contains(&format!("no probe kind works for 127.0.0.1:{port}")),
        "{log}"
    );
    assert!(log.contains("GET /health: HTTP 404"), "{log}");
    assert!(log.contains("MCP at /mcp: "), "{log}");
    assert!(log.contains("HTTP 501"), "what the MCP attempt got: {log}");
    assert!(
        registered(&client, "/mcp/services/plain/plain-1")
            .await
            .is_none(),
        "nothing registered"
    );
    assert!(
        reqwest::get(format!("http://127.0.0.1:{port}/"))
            .await
            .is_err(),
        "the child was stopped"
    );
}

#[tokio::test]
async fn tools_given_by_hand_win_and_their_differences_from_the_server_are_named() {
    let env = TestEnv::new("register_join_given_tools");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let port = free_port();
    let (python, args) = python_server(port, &["--no-health"]);
    let mut reg = Registrant::new(&etcd.endpoint(), "py", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "py-3")
        .arg("--tools", "read_order,ghost_tool")
        .child(&python, &args)
        .spawn(&env, "registrar");
    let (meta, _) =
        wait_registered(&client, "/mcp/services/py/py-3", Duration::from_secs(30)).await;
    assert_eq!(meta.tools, ["read_order", "ghost_tool"], "--tools wins");
    assert_eq!(meta.probe, ProbeKind::Mcp);
    let log = plain(&reg.log());
    assert!(
        log.contains("tools registered by --tools that the server does not list: [\"ghost_tool\"]"),
        "{log}"
    );
    assert!(
        log.contains(
            "tools the server lists that --tools does not register: [\"fail_order\", \"slow_order\", \"write_order\"]"
        ),
        "{log}"
    );
    reg.stop(Duration::from_secs(10)).await;
}

/// A minimal MCP server whose tool list a test changes at run time: in `session` mode it
/// speaks 2025-11-25 with a session, announces `tools.listChanged` and offers the GET stream
/// (on which the test pushes `notifications/tools/list_changed`); otherwise it speaks the
/// stateless 2026-07-28 and has no stream.
#[derive(Clone)]
struct Mutable {
    session: bool,
    tools: Arc<Mutex<Value>>,
    changed: broadcast::Sender<()>,
    deletes: Arc<AtomicU32>,
}

impl Mutable {
    fn set_tools(&self, tools: Value) {
        *self.tools.lock().unwrap() = tools;
        let _ = self.changed.send(());
    }
}

fn rpc(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

async fn mutable_post(State(s): State<Mutable>, body: String) -> Response {
    let Ok(req) = serde_json::from_str::<Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    let caps = json!({"tools": {"listChanged": true}});
    match req.get("method").and_then(Value::as_str).unwrap_or("") {
        "server/discover" if !s.session => axum::Json(rpc(
            &id,
            json!({"supportedVersions": ["2026-07-28"], "capabilities": caps}),
        ))
        .into_response(),
        "initialize" if s.session => (
            [("mcp-session-id", "sess-1")],
            axum::Json(rpc(
                &id,
                json!({"protocolVersion": "2025-11-25", "capabilities": caps,
                       "serverInfo": {"name": "mutable", "version": "1"}}),
            )),
        )
            .into_response(),
        "notifications/initialized" => StatusCode::ACCEPTED.into_response(),
        "ping" => axum::Json(rpc(&id, json!({}))).into_response(),
        "tools/list" => {
            let tools = s.tools.lock().unwrap().clone();
            axum::Json(rpc(&id, json!({"tools": tools}))).into_response()
        }
        _ => axum::Json(json!({"jsonrpc": "2.0", "id": id,
            "error": {"code": -32601, "message": "method not found"}}))
        .into_response(),
    }
}

async fn mutable_get(State(s): State<Mutable>, headers: HeaderMap) -> Response {
    if !s.session || headers.get("mcp-session-id").is_none() {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let rx = s.changed.subscribe();
    let events = futures::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(()) => {
                    let event = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\n\n";
                    return Some((Ok::<_, std::io::Error>(event.to_string()), rx));
                }
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(events),
    )
        .into_response()
}

async fn mutable_delete(State(s): State<Mutable>) -> StatusCode {
    s.deletes.fetch_add(1, Ordering::SeqCst);
    StatusCode::OK
}

async fn start_mutable(session: bool, tools: Value) -> (Mutable, u16) {
    let state = Mutable {
        session,
        tools: Arc::new(Mutex::new(tools)),
        changed: broadcast::channel(16).0,
        deletes: Arc::new(AtomicU32::new(0)),
    };
    let app = axum::Router::new()
        .route(
            "/mcp",
            post(mutable_post).get(mutable_get).delete(mutable_delete),
        )
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (state, port)
}

fn tool_list(names: &[&str]) -> Value {
    Value::Array(
        names
            .iter()
            .map(|n| json!({"name": n, "inputSchema": {"type": "object"}}))
            .collect(),
    )
}

#[tokio::test]
async fn an_announced_tool_list_change_is_registered_again_under_the_same_lease() {
    let env = TestEnv::new("register_join_stream_change");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    // Malformed entries among good ones: the good are registered, the rest named.
    let first = json!([
        {"name": "alpha"}, {"name": "beta"}, {"name": "bad name"}, {"name": 5}
    ]);
    let (server, port) = start_mutable(true, first).await;
    // --tools-refresh 0: only the stream can bring the change.
    let mut reg = Registrant::new(&etcd.endpoint(), "mut", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "m-1")
        .arg("--tools-refresh", "0")
        .spawn(&env, "registrar");
    let key = "/mcp/services/mut/m-1";
    let (meta, lease) = wait_registered(&client, key, Duration::from_secs(10)).await;
    assert_eq!(meta.tools, ["alpha", "beta"]);
    assert_eq!(meta.probe, ProbeKind::Mcp);
    assert_eq!(meta.protocol_versions, ["2025-11-25"]);
    wait_until(
        "the registrar follows the stream",
        Duration::from_secs(10),
        || async { plain(&reg.log()).contains("on its GET stream") },
    )
    .await;
    let log = plain(&reg.log());
    assert!(
        log.contains("tool \"bad name\" of the server is not registered"),
        "{log}"
    );
    assert!(log.contains("(page 1, entry 3)"), "{log}");

    server.set_tools(tool_list(&["alpha", "gamma"]));
    wait_until(
        "the new list is registered",
        Duration::from_secs(10),
        || async {
            registered(&client, key)
                .await
                .is_some_and(|(m, _)| m.tools == ["alpha", "gamma"])
        },
    )
    .await;
    let (_, lease_after) = registered(&client, key).await.expect("registered");
    assert_eq!(lease_after, lease, "the same lease holds the key");
    let log = plain(&reg.log());
    assert!(
        log.contains("added=[\"gamma\"] removed=[\"beta\"]"),
        "the change is logged: {log}"
    );

    // An empty list is registered too (the gateway then judges any tool name), with a warning.
    server.set_tools(json!([]));
    wait_until(
        "the empty list is registered",
        Duration::from_secs(10),
        || async {
            registered(&client, key)
                .await
                .is_some_and(|(m, _)| m.tools.is_empty())
        },
    )
    .await;
    assert!(plain(&reg.log()).contains("no registrable tool"));

    reg.signal(Signal::SIGTERM);
    let status = reg.wait_exit(Duration::from_secs(10)).await.expect("exits");
    assert!(status.success(), "{status}");
    assert!(registered(&client, key).await.is_none(), "deregistered");
    assert_eq!(
        server.deletes.load(Ordering::SeqCst),
        1,
        "the registrar's MCP session is closed on stop"
    );
}

#[tokio::test]
async fn a_stateless_servers_tool_list_is_refreshed_on_the_interval() {
    let env = TestEnv::new("register_join_interval_change");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let (server, port) = start_mutable(false, tool_list(&["one"])).await;
    let mut reg = Registrant::new(&etcd.endpoint(), "mut", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "m-2")
        .arg("--tools-refresh", "300ms")
        .spawn(&env, "registrar");
    let key = "/mcp/services/mut/m-2";
    let (meta, lease) = wait_registered(&client, key, Duration::from_secs(10)).await;
    assert_eq!(meta.tools, ["one"]);
    assert_eq!(meta.protocol_versions, ["2026-07-28"]);
    server.set_tools(tool_list(&["one", "two"]));
    wait_until(
        "the refreshed list is registered",
        Duration::from_secs(10),
        || async {
            registered(&client, key)
                .await
                .is_some_and(|(m, _)| m.tools == ["one", "two"])
        },
    )
    .await;
    assert_eq!(registered(&client, key).await.map(|(_, l)| l), Some(lease));
    assert!(plain(&reg.log()).contains("refreshing the tool list on an interval"));
    reg.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn without_tools_a_malformed_listing_is_an_error_naming_the_answer() {
    let env = TestEnv::new("register_join_malformed");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let (_server, port) = start_mutable(false, json!("not a list")).await;
    let mut reg = Registrant::new(&etcd.endpoint(), "mut", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "m-3")
        .spawn(&env, "registrar");
    let status = reg
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("the registrar gives up");
    assert!(!status.success());
    let log = plain(&reg.log());
    assert!(log.contains("tools/list"), "{log}");
    assert!(log.contains("no \"tools\" array"), "{log}");
    assert!(registered(&client, "/mcp/services/mut/m-3").await.is_none());
}

#[tokio::test]
async fn a_huge_listing_is_cut_at_the_cap_and_bad_names_are_named_not_fatal() {
    let env = TestEnv::new("register_join_huge");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let mut tools: Vec<Value> = vec![
        json!({"name": "has space"}),
        json!({"name": "a/b"}),
        json!({"name": 42}),
        json!({"name": "x".repeat(200)}),
    ];
    let names: Vec<String> = (0..2_500).map(|i| format!("tool_{i:04}")).collect();
    tools.extend(
        names
            .iter()
            .map(|n| json!({"name": n, "inputSchema": {"type": "object"}})),
    );
    let (_server, port) = start_mutable(false, Value::Array(tools)).await;
    let mut reg = Registrant::new(&etcd.endpoint(), "huge", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "h-1")
        .spawn(&env, "registrar");
    let (meta, _) =
        wait_registered(&client, "/mcp/services/huge/h-1", Duration::from_secs(15)).await;
    assert_eq!(meta.tools.len(), 2_000, "registered up to the cap");
    assert_eq!(meta.tools[..], names[..2_000]);
    let log = plain(&reg.log());
    assert!(
        log.contains("stopped at 2000 tools"),
        "the cut is said: {log}"
    );
    for refused in ["has space", "a/b", "(page 1, entry 2)", "xxxxxxxx"] {
        assert!(log.contains(refused), "{refused} is named: {log}");
    }
    assert!(reg.is_running(), "bad input is no reason to stop");
    reg.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn update_tools_puts_the_new_list_under_the_same_lease() {
    let env = TestEnv::new("register_join_update_tools");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let registration = toolgate_registrar::Registrar::new(
        [etcd.endpoint()],
        "lib",
        "127.0.0.1:9".parse().expect("endpoint"),
    )
    .instance_id("lib-1")
    .tools(["a"])
    .register()
    .await
    .expect("registered");
    let key = "/mcp/services/lib/lib-1";
    let (meta, lease) = registered(&client, key).await.expect("the key is there");
    assert_eq!(meta.tools, ["a"]);
    assert_eq!(lease, registration.lease_id());

    registration
        .update_tools(strings(&["a", "b"]))
        .await
        .expect("updated");
    let (meta, lease_after) = registered(&client, key).await.expect("still there");
    assert_eq!(meta.tools, ["a", "b"]);
    assert_eq!(lease_after, lease);
    assert_eq!(registration.metadata().tools, ["a", "b"]);

    let bad = registration.update_tools(strings(&["no good"])).await;
    assert!(bad.is_err(), "a bad name is refused");
    assert_eq!(
        registered(&client, key).await.map(|(m, _)| m.tools),
        Some(strings(&["a", "b"])),
        "and nothing is written"
    );

    registration.deregister().await.expect("deregistered");
    assert!(registered(&client, key).await.is_none());
}

#[tokio::test]
async fn the_official_everything_server_joins_with_its_stream_followed_and_its_session_closed() {
    let env = TestEnv::new("register_join_everything");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let root = toolgate_tests::paths::workspace_root();
    let port = free_port();
    // Unmodified: its `app.listen(PORT)` is kept on loopback by the preload.
    let args = strings(&[
        &format!("PORT={port}"),
        "node",
        "--import",
        &root.join("tests/node/loopback.mjs").display().to_string(),
        &root
            .join("tests/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js")
            .display()
            .to_string(),
        "streamableHttp",
    ]);
    let mut reg = Registrant::new(&etcd.endpoint(), "ev", &format!("127.0.0.1:{port}"))
        .arg("--instance-id", "ev-1")
        .child(std::path::Path::new("/usr/bin/env"), &args)
        .spawn(&env, "registrar");
    let key = "/mcp/services/ev/ev-1";
    let (meta, _) = wait_registered(&client, key, Duration::from_secs(30)).await;
    assert_eq!(meta.probe, ProbeKind::Mcp, "no /health: auto picks mcp");
    assert_eq!(meta.protocol_versions, ["2025-11-25"]);
    assert!(
        meta.tools.iter().any(|t| t == "echo") && meta.tools.len() > 5,
        "{:?}",
        meta.tools
    );
    // It announces tools.listChanged on a session: the registrar follows its GET stream.
    wait_until(
        "the registrar follows the stream",
        Duration::from_secs(10),
        || async { plain(&reg.log()).contains("on its GET stream") },
    )
    .await;
    reg.signal(Signal::SIGTERM);
    reg.wait_exit(Duration::from_secs(15))
        .await
        .expect("the registrar exits");
    assert!(registered(&client, key).await.is_none(), "deregistered");
    let log = plain(&reg.log());
    assert!(log.contains("MCP session closed"), "{log}");
    assert!(
        log.contains("Received session termination request"),
        "the server saw the DELETE: {log}"
    );
}
