//! Issue 19, the aggregate endpoint's own part: toolgate-xds serves one MCP server over every
//! registered service at `/v1/aggregate/<name>` (Envoy routes `/mcp` there). Real etcd,
//! toolgate-xds and lab MCP servers under toolgate-register, talked to on toolgate-xds's admin
//! port directly: the official Python SDK client lists the tools of two services through one
//! URL; a legacy GET stream hears `notifications/tools/list_changed` within a second of a third
//! service registering; an operator's force-open annotates the tool; DELETE ends the session.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use toolgate_tests::mcp::{post_message, PROTOCOL_VERSION};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{sdk, wait_until, Etcd, McpServer, Proc, Registrant, TestEnv, Xds};

/// Probes every second, as the other health tests do.
const FAST_PROBES: [&str; 4] = ["--probe-interval", "1s", "--probe-timeout", "500ms"];

/// A lab server serving `tools`, registered as `service` with those tools.
async fn service(env: &TestEnv, etcd: &str, service: &str, tools: &str) -> (McpServer, Proc) {
    let id = format!("{service}-1");
    let server = McpServer::lab(env, &id, &["--tools", tools]).await;
    let registrar = Registrant::new(etcd, service, &server.endpoint())
        .arg("--instance-id", &id)
        .arg("--tools", tools)
        .arg("--ttl", "30")
        .spawn(env, &format!("{id}.registrar"));
    (server, registrar)
}

async fn list(http: &reqwest::Client, url: &str, session: &str) -> Vec<Value> {
    let resp = post_message(
        http,
        url,
        Some(session),
        Some(PROTOCOL_VERSION),
        &json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.expect("tools/list JSON");
    v["result"]["tools"].as_array().cloned().unwrap_or_default()
}

fn names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn one_endpoint_lists_every_service_and_tells_its_clients_what_changed() {
    let env = TestEnv::new("aggregate");
    let etcd = Etcd::start(&env).await;
    // A loaded test machine's disk can take over a second per etcd write; the override must
    // not time out on it.
    let mut args: Vec<&str> = vec![
        "--admin-token-env",
        "TOOLGATE_TEST_ADMIN_TOKEN",
        "--etcd-timeout",
        "5s",
    ];
    args.extend(FAST_PROBES);
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &args,
        &[("TOOLGATE_TEST_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
    .await;
    let url = format!("{}/v1/aggregate/default", xds.admin_url());
    let http = reqwest::Client::new();

    let _inventory = service(&env, &etcd.endpoint(), "inventory", "read_order,echo").await;
    let _finance = service(&env, &etcd.endpoint(), "finance", "echo").await;
    wait_until(
        "the catalog has read both services",
        Duration::from_secs(30),
        || async {
            let c = xds.catalog().await;
            ["inventory", "finance"].iter().all(|s| {
                c["services"][s]["read_at"]
                    .as_str()
                    .is_some_and(|r| !r.is_empty())
            })
        },
    )
    .await;

    // The official Python SDK, legacy revision, through one URL.
    let steps = sdk::python(&url, &["initialize", "list"]).await;
    assert_eq!(steps.len(), 2, "{steps:?}");
    let init = &steps[0]["ok"];
    assert_eq!(init["serverInfo"]["name"], "toolgate/default", "{steps:?}");
    assert_eq!(init["capabilities"]["tools"]["listChanged"], true);
    let tools = steps[1]["ok"]["tools"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        names(&tools),
        ["finance__echo", "inventory__echo", "inventory__read_order"],
        "{steps:?}"
    );
    let catalog = xds.catalog().await;
    let read_order = catalog["services"]["inventory"]["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "read_order"))
        .cloned()
        .expect("the catalog's read_order");
    let listed = tools
        .iter()
        .find(|t| t["name"] == "inventory__read_order")
        .expect("listed");
    assert_eq!(
        listed["inputSchema"], read_order["inputSchema"],
        "the full schema"
    );
    assert_eq!(listed["description"], read_order["description"]);

    // A legacy session by hand, to hold its GET stream open.
    let resp = post_message(
        &http,
        &url,
        None,
        Some(PROTOCOL_VERSION),
        &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "aggregate-test", "version": "1"}}}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let session = resp
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    assert!(session.starts_with("tgv1."), "{session}");
    let resp = post_message(
        &http,
        &url,
        Some(&session),
        Some(PROTOCOL_VERSION),
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert_eq!(resp.status(), 202);
    let no_session = post_message(
        &http,
        &url,
        None,
        Some(PROTOCOL_VERSION),
        &json!({"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {}}),
    )
    .await;
    assert_eq!(no_session.status(), 400, "a request without its session");

    let stream = http
        .get(&url)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &session)
        .send()
        .await
        .expect("GET stream");
    assert_eq!(stream.status(), 200);
    let (heard_tx, heard) = tokio::sync::oneshot::channel();
    // Reads the stream to its end: it hears list_changed, and ends with the session.
    let get_stream = tokio::spawn(async move {
        let mut body = stream.bytes_stream();
        let mut text = String::new();
        let mut heard_tx = Some(heard_tx);
        while let Some(Ok(chunk)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
            if text.contains("notifications/tools/list_changed") {
                if let Some(tx) = heard_tx.take() {
                    let _ = tx.send(Instant::now());
                }
            }
        }
    });

    // A third service registers: the stream hears it within a second of etcd having it.
    let _orders = service(&env, &etcd.endpoint(), "orders", "create_order").await;
    let mut client = etcd.client().await;
    let mut registered_at = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while registered_at.is_none() && Instant::now() < deadline {
        let got = client
            .get("/mcp/services/orders/orders-1", None)
            .await
            .expect("etcd get");
        if !got.kvs().is_empty() {
            registered_at = Some(Instant::now());
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let registered_at = registered_at.expect("orders registered within 20 s");
    let heard_at = tokio::time::timeout(Duration::from_secs(5), heard)
        .await
        .expect("list_changed within 5 s")
        .expect("list_changed on the stream");
    let lag = heard_at.saturating_duration_since(registered_at);
    assert!(
        lag < Duration::from_secs(1),
        "list_changed {lag:?} after the registration"
    );
    wait_until("orders is listed", Duration::from_secs(5), || async {
        names(&list(&http, &url, &session).await).contains(&"orders__create_order".to_string())
    })
    .await;

    // A 2026-07-28 client, stateless: discover, then a listen stream that is acknowledged and
    // hears the override below.
    let modern = |method: &str, params: Value| {
        let mut params = params;
        params["_meta"] = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "aggregate-test", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}
        });
        http.post(&url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2026-07-28")
            .header("mcp-method", method)
            .json(&json!({"jsonrpc": "2.0", "id": 40, "method": method, "params": params}))
            .send()
    };
    let discovered: Value = modern("server/discover", json!({}))
        .await
        .expect("discover")
        .json()
        .await
        .expect("discover JSON");
    assert_eq!(
        discovered["result"]["supportedVersions"][0], "2026-07-28",
        "{discovered}"
    );
    assert_eq!(discovered["result"]["resultType"], "complete");
    let refused = modern("tasks/list", json!({})).await.expect("tasks/list");
    assert_eq!(
        refused.status(),
        404,
        "2026-07-28: a method not served is a 404"
    );
    let refused: Value = refused.json().await.expect("error JSON");
    assert_eq!(refused["error"]["code"], -32601);
    let listen = modern(
        "subscriptions/listen",
        json!({"notifications": {"toolsListChanged": true}}),
    )
    .await
    .expect("listen");
    assert_eq!(listen.status(), 200);
    let (ack_tx, ack_rx) = tokio::sync::oneshot::channel();
    let modern_heard = tokio::spawn(async move {
        let mut body = listen.bytes_stream();
        let mut text = String::new();
        let mut ack = Some(ack_tx);
        while let Some(Ok(chunk)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
            if text.contains("notifications/subscriptions/acknowledged") {
                if let Some(tx) = ack.take() {
                    let _ = tx.send(());
                }
            }
            if text.contains("notifications/tools/list_changed") {
                return Some(text);
            }
        }
        None
    });
    tokio::time::timeout(Duration::from_secs(5), ack_rx)
        .await
        .expect("acknowledged within 5 s")
        .expect("the listen task");

    // An operator forces a tool open: the next listing says so.
    let forced = http
        .put(format!("{}/v1/overrides/inventory/echo", xds.admin_url()))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"mode": "force_open", "reason": "maintenance window"}))
        .send()
        .await
        .expect("PUT override");
    assert!(forced.status().is_success(), "{:?}", forced.text().await);
    let annotated = || async {
        list(&http, &url, &session)
            .await
            .into_iter()
            .find(|t| t["name"] == "inventory__echo")
            .filter(|t| t["_meta"]["io.toolgate/availability"]["state"] == "forced_open")
    };
    wait_until(
        "inventory__echo is annotated",
        Duration::from_secs(1),
        || async { annotated().await.is_some() },
    )
    .await;
    let echo = annotated().await.expect("annotated");
    let description = echo["description"].as_str().unwrap_or("");
    assert!(
        description.contains("Unavailable now") && description.contains("maintenance window"),
        "{description}"
    );
    let text = tokio::time::timeout(Duration::from_secs(1), modern_heard)
        .await
        .expect("the listen stream hears the override within a second")
        .expect("the listen task")
        .expect("list_changed on the listen stream");
    assert!(
        text.contains(r#""io.modelcontextprotocol/subscriptionId":40"#),
        "{text}"
    );
    let others = list(&http, &url, &session).await;
    let finance_echo = others
        .iter()
        .find(|t| t["name"] == "finance__echo")
        .expect("listed");
    assert!(finance_echo
        .get("_meta")
        .is_none_or(|m| m.get("io.toolgate/availability").is_none()));

    // DELETE ends the session: the next request with it is a 404.
    let deleted = http
        .delete(&url)
        .header("mcp-session-id", &session)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(deleted.status(), 204);
    let after = post_message(
        &http,
        &url,
        Some(&session),
        Some(PROTOCOL_VERSION),
        &json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {}}),
    )
    .await;
    assert_eq!(after.status(), 404);
    tokio::time::timeout(Duration::from_secs(2), get_stream)
        .await
        .expect("the session's GET stream ends with it")
        .expect("the stream task");

    // No admin token needed, even for reads guarded otherwise; and the counters moved.
    let metrics = xds.metrics_text().await;
    assert!(
        metrics.contains(
            "toolgate_aggregate_requests_total{virtual_server=\"default\",method=\"tools/list\"}"
        ),
        "{metrics}"
    );
}
