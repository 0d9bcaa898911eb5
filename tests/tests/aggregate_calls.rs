//! `tools/call` on the aggregate endpoint (`POST /mcp`, issue 19): a real Envoy with the
//! filter routes each call to the owning service's own route with the tool's own name, and
//! judges it as a call of that (service, tool). Raw JSON-RPC POSTs: `initialize` and
//! `tools/list` on `/mcp` are toolgate-xds's and not part of this.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{wait_until, Member, Stack, TestEnv};

const TTL: u32 = 10;

struct Gateway {
    stack: Stack,
    http: reqwest::Client,
}

impl Gateway {
    /// `http://127.0.0.1:<port>` of the gateway listener.
    fn base(&self) -> String {
        self.stack
            .envoy
            .url("")
            .trim_end_matches("/mcp/")
            .to_string()
    }

    /// A legacy (2025-06-18) session on `url`: `initialize` and `notifications/initialized`.
    async fn initialize(&self, url: &str) -> String {
        let resp = self
            .http
            .post(url)
            .header("accept", "application/json, text/event-stream")
            .json(
                &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "toolgate-tests", "version": "1"}}}),
            )
            .send()
            .await
            .expect("initialize");
        assert_eq!(resp.status(), StatusCode::OK);
        let session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .expect("a session id")
            .to_string();
        let resp = self
            .http
            .post(url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-session-id", &session)
            .header("mcp-protocol-version", "2025-06-18")
            .json(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .send()
            .await
            .expect("initialized");
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
        session
    }

    /// POSTs a `tools/call` of `name` to `path`, with extra headers; status and JSON.
    async fn call(
        &self,
        path: &str,
        name: &str,
        arguments: Value,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base()))
            .header("accept", "application/json, text/event-stream")
            .json(&json!({
                "jsonrpc": "2.0",
                "id": 41,
                "method": "tools/call",
                "params": {"name": name, "arguments": arguments},
            }));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await.expect("the gateway answers");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, body)
    }
}

fn text_of(body: &Value) -> &str {
    body["result"]["content"][0]["text"].as_str().unwrap_or("")
}

fn breaker(body: &Value) -> &Value {
    &body["result"]["_meta"]["io.toolgate/breaker"]
}

#[tokio::test]
async fn calls_on_mcp_reach_the_owning_service_with_the_tools_own_name() {
    let env = TestEnv::new("aggregate_calls");
    let stack = Stack::start(&env).await;
    let ep = stack.etcd.endpoint();
    // The official Python SDK server and the lab server, both stateless.
    let inventory = Member::python(
        &env,
        &ep,
        "inventory",
        "inventory-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let billing = Member::start(
        &env,
        &ep,
        "billing",
        "billing-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack.routes("inventory", &[&inventory]).await;
    stack.routes("billing", &[&billing]).await;
    stack
        .wait_filter_config("the default virtual server's names", |c| {
            let tools = &c["virtual_servers"]["default"]["tools"];
            tools["inventory__read_order"]["tool"] == "read_order"
                && tools["billing__echo"]["service"] == "billing"
        })
        .await;
    let gw = Gateway {
        stack,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("client"),
    };

    // Each name reaches its own server, which executes the tool by its own name (a server
    // asked for `inventory__read_order` would answer "unknown tool").
    let (status, body) = gw
        .call(
            "/mcp",
            "inventory__read_order",
            json!({"order_id": "o-7"}),
            &[],
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(text_of(&body), "order o-7: 1 item", "{body}");
    assert_eq!(body["id"], 41);
    assert_eq!(inventory.server.calls("read_order").await, 1);
    assert_eq!(billing.server.calls("read_order").await, 0);

    // The same tool name of the other service, with the 2026-07-28 request headers: the
    // filter checks them against the body as sent, then restores the real name in both.
    let (status, body) = gw
        .call(
            "/mcp?client=test",
            "billing__read_order",
            json!({}),
            &[
                ("mcp-method", "tools/call"),
                ("mcp-name", "billing__read_order"),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_ne!(body["result"]["isError"], true, "{body}");
    // The lab server says what it executed, and where.
    let done = &body["result"]["structuredContent"];
    assert_eq!(done["tool"], "read_order", "{body}");
    assert_eq!(done["instance_id"], "billing-1", "{body}");
    assert_eq!(billing.server.calls("read_order").await, 1);
    assert_eq!(inventory.server.calls("read_order").await, 1);
    // A gateway session id the agent sends is not the server's: the stateless server never
    // sees it, so the call cannot be refused for an unknown session.
    let (status, body) = gw
        .call(
            "/virtual/default",
            "billing__echo",
            json!({"text": "hi"}),
            &[("mcp-session-id", "gateway-session-1")],
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_ne!(body["result"]["isError"], true, "{body}");
    assert_eq!(billing.server.calls("echo").await, 1);

    // Stats count the real (service, tool).
    wait_until(
        "the /mcp call is counted as inventory/read_order",
        Duration::from_secs(10),
        || async {
            gw.stack
                .envoy
                .tool_stat("toolgate_calls", "inventory", "read_order")
                .await
                .is_some_and(|v| v >= 1.0)
        },
    )
    .await;

    // Names the endpoint does not offer are answered by the gateway, as the reference servers
    // answer an unknown tool: a tool result the model reads (`isError`), naming the endpoint;
    // no server is asked. An endpoint that does not exist is a protocol error.
    for (path, name) in [
        ("/mcp", "inventory__nope"),
        ("/mcp", "read_order"),
        ("/mcp", "nowhere__read_order"),
    ] {
        let (status, body) = gw.call(path, name, json!({}), &[]).await;
        assert_eq!(status, StatusCode::OK, "{path} {name}: {body}");
        assert_eq!(body["result"]["isError"], true, "{path} {name}: {body}");
        assert_eq!(
            body["result"]["_meta"]["io.toolgate/breaker"]["state"], "not_offered",
            "{body}"
        );
        let text = body["result"]["content"][0]["text"].as_str().unwrap_or("");
        assert!(
            text.contains("`/mcp`") && text.contains(&format!("`{name}`")),
            "{text}"
        );
    }
    let (status, body) = gw
        .call("/virtual/nothing", "inventory__read_order", json!({}), &[])
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["error"]["code"], -32602, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("`nothing`"), "{message}");
    assert_eq!(inventory.server.calls("read_order").await, 1);
    assert_eq!(billing.server.calls("read_order").await, 1);

    // An operator forces inventory's write_order open (admin API); its policy names
    // read_order as the fallback. On /mcp the reply names both as the agent sees them there.
    gw.stack
        .policy(
            "inventory/write_order",
            json!({"fallback_tool": "read_order"}),
        )
        .await;
    let resp = gw
        .http
        .put(format!(
            "{}/v1/overrides/inventory/write_order",
            gw.stack.xds.admin_url()
        ))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"mode": "force_open", "reason": "stock count", "author": "test"}))
        .send()
        .await
        .expect("admin API");
    assert_eq!(resp.status(), StatusCode::OK);
    wait_until(
        "write_order is forced open on /mcp",
        Duration::from_secs(10),
        || async {
            let (_, body) = gw
                .call("/mcp", "inventory__write_order", json!({}), &[])
                .await;
            breaker(&body)["state"] == "forced_open"
        },
    )
    .await;
    // (Calls while the override was on its way ran.)
    let ran = inventory.server.calls("write_order").await;
    let (status, body) = gw
        .call("/mcp", "inventory__write_order", json!({}), &[])
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(breaker(&body)["tool"], "inventory__write_order", "{body}");
    assert_eq!(
        breaker(&body)["fallbackTool"],
        "inventory__read_order",
        "{body}"
    );
    let text = text_of(&body);
    assert!(
        text.contains("stock count") && text.contains("`inventory__read_order`"),
        "{text}"
    );
    assert_eq!(inventory.server.calls("write_order").await, ran);

    // The per-service routes are as they were: the same override, named by the tool's own
    // names there, and calls of other tools answered by their servers.
    let (_, body) = gw
        .call("/mcp/inventory", "write_order", json!({}), &[])
        .await;
    assert_eq!(breaker(&body)["state"], "forced_open", "{body}");
    assert_eq!(breaker(&body)["tool"], "write_order");
    assert_eq!(breaker(&body)["fallbackTool"], "read_order");
    let (status, body) = gw
        .call(
            "/mcp/inventory",
            "read_order",
            json!({"order_id": "o-8"}),
            &[],
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text_of(&body), "order o-8: 1 item", "{body}");
    let (status, body) = gw
        .call("/mcp/billing", "echo", json!({"text": "again"}), &[])
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_ne!(body["result"]["isError"], true, "{body}");
    assert_eq!(billing.server.calls("echo").await, 2);
    assert_eq!(inventory.server.calls("read_order").await, 2);
}

/// Reads a GET stream to its end, sending the time of each `notifications/tools/list_changed`.
fn hear_list_changed(
    stream: reqwest::Response,
) -> tokio::sync::mpsc::UnboundedReceiver<std::time::Instant> {
    use futures::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut body = stream.bytes_stream();
        let mut text = String::new();
        let mut heard = 0;
        while let Some(Ok(chunk)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
            let now = text.matches("notifications/tools/list_changed").count();
            for _ in heard..now {
                let _ = tx.send(std::time::Instant::now());
            }
            heard = now;
        }
    });
    rx
}

#[tokio::test]
async fn a_service_that_leaves_is_annotated_and_its_calls_name_the_fallback() {
    const WRITE: &str = "stock__write_order";
    const FALLBACK: &str = "stock__read_order";
    let env = TestEnv::new("aggregate_calls_leave");
    let stack = Stack::start(&env).await;
    let ep = stack.etcd.endpoint();
    let mut stock = Member::start(
        &env,
        &ep,
        "stock",
        "stock-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    stack.routes("stock", &[&stock]).await;
    stack
        .policy("stock/write_order", json!({"fallback_tool": "read_order"}))
        .await;
    // The catalog has read the service (a later read would change the listing by itself).
    wait_until(
        "the catalog has read stock",
        Duration::from_secs(20),
        || async {
            stack.xds.catalog().await["services"]["stock"]["read_at"]
                .as_str()
                .is_some_and(|r| !r.is_empty())
        },
    )
    .await;
    let gw = Gateway {
        stack,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("client"),
    };
    let url = format!("{}/mcp", gw.base());

    // A legacy session on /mcp, through Envoy, listening on its GET stream.
    let session = gw.initialize(&url).await;
    let with_session = [
        ("mcp-session-id", session.as_str()),
        ("mcp-protocol-version", "2025-06-18"),
    ];
    let listed = || async {
        let resp = gw
            .http
            .post(&url)
            .headers(header_map(&with_session))
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}))
            .send()
            .await
            .expect("tools/list");
        let body: Value = resp.json().await.unwrap_or_default();
        body["result"]["tools"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let write_order = |tools: &[Value]| tools.iter().find(|t| t["name"] == WRITE).cloned();
    // The listings are remade off the request path, a coalescing pause (50-400 ms) after the
    // catalog or the registry changes: the first listing after the catalog's read may still
    // be the one made before it (stock's tools without their definitions, stock-1 not UP).
    wait_until(
        "write_order listed without an availability note",
        Duration::from_secs(10),
        || async {
            write_order(&listed().await)
                .is_some_and(|t| t["_meta"]["io.toolgate/availability"].is_null())
        },
    )
    .await;
    // (The session's first call to stock: the gateway holds a session with it from now on.)
    let (status, body) = gw
        .call(
            "/mcp",
            "stock__echo",
            json!({"text": "before"}),
            &with_session,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_ne!(body["result"]["isError"], true, "{body}");
    let stream = gw
        .http
        .get(&url)
        .headers(header_map(&with_session))
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("GET stream");
    assert_eq!(stream.status(), StatusCode::OK);
    let mut heard = hear_list_changed(stream);

    // The service's last (only) instance deregisters; its server keeps running, so a call
    // that reached it would succeed.
    let left = std::time::Instant::now();
    stock.registrar.stop(Duration::from_secs(5)).await;
    let heard_at = loop {
        let at = tokio::time::timeout(Duration::from_secs(5), heard.recv())
            .await
            .expect("list_changed on the GET stream within 5 s")
            .expect("the GET stream is open");
        if at >= left {
            break at;
        }
    };
    let lag = heard_at.saturating_duration_since(left);
    println!(
        "deregistration started -> list_changed on the GET stream: {} ms",
        lag.as_millis()
    );
    assert!(lag < Duration::from_secs(2), "list_changed {lag:?} after");

    // The default virtual server annotates (does not hide) it, naming the fallback.
    let after = write_order(&listed().await).expect("write_order still listed");
    let availability = &after["_meta"]["io.toolgate/availability"];
    assert_eq!(availability["state"], "no_instance", "{after}");
    assert_eq!(availability["fallback"], FALLBACK, "{after}");
    assert!(
        after["description"]
            .as_str()
            .is_some_and(|d| d.contains("Unavailable now") && d.contains(FALLBACK)),
        "{after}"
    );

    // A call of it, in the session and without one, is a semantic reply naming the fallback
    // by its name on /mcp; the server is not reached.
    // Another session, that never called stock: the gateway has no session with it to use.
    let fresh = gw.initialize(&url).await;
    let fresh_session = [
        ("mcp-session-id", fresh.as_str()),
        ("mcp-protocol-version", "2025-06-18"),
    ];
    // list_changed comes from toolgate-xds as soon as its registry changes; Envoy learns of
    // the departure by its own EDS update, which under load can come a little later.
    gw.stack
        .envoy
        .wait_addresses("stock", &[], Duration::from_secs(10))
        .await;
    let ran = stock.server.calls("write_order").await;
    for headers in [&with_session[..], &fresh_session[..], &[]] {
        let (status, body) = gw.call("/mcp", WRITE, json!({}), headers).await;
        let headers = format!("{headers:?}");
        if body["result"]["isError"] != true {
            env.print_failure_logs();
        }
        assert_eq!(status, StatusCode::OK, "{headers}: {body}");
        assert_eq!(body["result"]["isError"], true, "{headers}: {body}");
        assert_eq!(
            breaker(&body)["fallbackTool"],
            FALLBACK,
            "{headers}: {body}"
        );
        assert!(
            text_of(&body).contains(&format!("`{FALLBACK}`")),
            "{}",
            text_of(&body)
        );
    }
    assert_eq!(stock.server.calls("write_order").await, ran);
}

fn header_map(pairs: &[(&str, &str)]) -> reqwest::header::HeaderMap {
    let mut map = reqwest::header::HeaderMap::new();
    for (k, v) in pairs {
        if let (Ok(k), Ok(v)) = (
            reqwest::header::HeaderName::from_bytes(k.as_bytes()),
            reqwest::header::HeaderValue::from_str(v),
        ) {
            map.insert(k, v);
        }
    }
    map
}
