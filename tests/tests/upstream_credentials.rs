//! Credentials toward the servers: a server that requires `Authorization: Bearer s3cret` (the
//! Python SDK server with a check) answers calls through its route and through `/mcp`, gets the
//! secret read from a file and never the agent's own token; the secret shows nowhere an
//! operator or an agent looks; a rotated file is in use within the refresh.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, McpSession, Member, Options, Stack, TestEnv};

const TTL: u32 = 10;
const SECRET: &str = "s3cret";
const ROTATED: &str = "r0tated";
/// What the agent sends as its own credential (auth is off at the gateway: it would reach
/// the server if nothing took its place).
const AGENT_TOKEN: &str = "agent-token";

/// What the server counted: every `Authorization` value it received, with its count.
async fn authorizations(m: &Member) -> Value {
    reqwest::get(format!("{}/calls", m.server.base_url()))
        .await
        .expect("GET /calls")
        .json::<Value>()
        .await
        .expect("/calls JSON")["authorizations"]
        .clone()
}

/// One `tools/call` on a fresh session, as an agent with its own bearer token.
async fn call(url: &str, tool: &str) -> toolgate_tests::mcp::Reply {
    let mut s = McpSession::unconnected(url);
    s.bearer = Some(AGENT_TOKEN.to_string());
    let init = s.initialize().await;
    if init.status != StatusCode::OK {
        return init;
    }
    s.call_tool(tool, json!({})).await
}

fn answered(reply: &toolgate_tests::mcp::Reply) -> bool {
    reply.status == StatusCode::OK
        && reply
            .result()
            .is_some_and(|r| r["isError"] == false && r.to_string().contains("order o-1"))
}

#[tokio::test]
async fn a_server_gets_its_credential_and_never_the_agents_token() {
    let env = TestEnv::new("upstream_credentials");
    let secret_file = env.path("orders-token");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("writing the secret");
    let gw = Stack::with(
        &env,
        Options::default().xds_arg(&["--secret-refresh", "1s"]),
    )
    .await;
    // A reference to the file, never the secret.
    gw.admin_put(
        "/v1/auth/upstream/orders",
        &json!({"header": "Authorization", "format": "Bearer {secret}",
                "secret": format!("file:{}", secret_file.display())}),
    )
    .await;
    let required = format!("Bearer {SECRET}");
    let m = Member::python(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &[
            "--stateless",
            "--json-response",
            "--require-authorization",
            &required,
        ],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;

    // Through the service's route.
    let url = gw.url("orders");
    wait_until(
        "a call through /mcp/orders is answered",
        Duration::from_secs(20),
        || async { answered(&call(&url, "read_order").await) },
    )
    .await;
    // toolgate-xds's own read of the server's tools carried it too.
    wait_until(
        "the catalog read the server",
        Duration::from_secs(40),
        || async {
            let (_, catalog) = gw.admin(reqwest::Method::GET, "/v1/catalog", None).await;
            let entry = &catalog["services"]["orders"];
            entry["read_at"].as_str().is_some_and(|t| !t.is_empty()) && entry["error"].is_null()
        },
    )
    .await;
    // Through /mcp.
    let aggregate = gw.aggregate_url();
    let mut listed = McpSession::unconnected(&aggregate);
    listed.bearer = Some(AGENT_TOKEN.to_string());
    assert_eq!(listed.initialize().await.status, StatusCode::OK);
    let tools = listed.list_tools().await;
    let name = tools
        .result()
        .and_then(|r| r["tools"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .find(|n| n.ends_with("read_order"))
        .unwrap_or_else(|| panic!("/mcp lists read_order: {}", tools.body));
    let via_mcp = call(&aggregate, &name).await;
    assert!(answered(&via_mcp), "through /mcp: {}", via_mcp.body);

    // The server got the secret, never the agent's token.
    let seen = authorizations(&m).await;
    assert!(seen[&required].as_u64().unwrap_or(0) >= 2, "{seen}");
    // Besides the secret, only nothing: the registrar's own check of the server's tools,
    // beside the server, carries no credential (and is refused).
    let others: Vec<&String> = seen
        .as_object()
        .expect("an object")
        .keys()
        .filter(|k| **k != required && !k.is_empty())
        .collect();
    assert!(
        others.is_empty(),
        "the server got other credentials: {others:?}"
    );
    assert!(
        seen.get(format!("Bearer {AGENT_TOKEN}")).is_none(),
        "{seen}"
    );

    // Rotation: the new value is what the server receives within the refresh (it refuses it:
    // it checks for the old one), and the old one again after.
    std::fs::write(&secret_file, format!("{ROTATED}\n")).expect("rotating");
    let rotated = format!("Bearer {ROTATED}");
    let took = wait_until(
        "the rotated secret arrives",
        Duration::from_secs(15),
        || async {
            let _ = call(&url, "read_order").await;
            authorizations(&m).await.get(&rotated).is_some()
        },
    )
    .await;
    println!("rotated secret in use after {took:?}");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("rotating back");
    wait_until("the secret again", Duration::from_secs(15), || async {
        answered(&call(&url, "read_order").await)
    })
    .await;

    // Nowhere an operator or an agent looks.
    let mut looked = Vec::new();
    for path in [
        "/v1/registry",
        "/v1/catalog",
        "/v1/envoys",
        "/v1/auth",
        "/v1/auth/upstream/orders",
        "/v1/breakers",
        "/v1/overrides",
        "/v1/virtual",
        "/v1/policies",
        "/metrics",
    ] {
        let text = reqwest::Client::new()
            .get(format!("{}{path}", gw.xds.admin_url()))
            .bearer_auth(toolgate_tests::stack::ADMIN_TOKEN)
            .send()
            .await
            .expect("admin GET")
            .text()
            .await
            .expect("text");
        looked.push((path.to_string(), text));
    }
    for path in ["/config_dump?include_eds", "/clusters", "/stats"] {
        let text = reqwest::get(format!("{}{path}", gw.envoy.admin_url()))
            .await
            .expect("Envoy admin")
            .text()
            .await
            .expect("text");
        looked.push((format!("Envoy {path}"), text));
    }
    let dump = &looked
        .iter()
        .find(|(p, _)| p.contains("config_dump"))
        .expect("dump")
        .1;
    assert!(
        dump.contains("toolgate.upstream.orders"),
        "the SDS secret is in Envoy"
    );
    assert!(dump.contains("[redacted]"), "and redacted");
    let mut etcd = gw.etcd.client().await;
    let all = etcd
        .get("/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("etcd read");
    let values: String = all
        .kvs()
        .iter()
        .map(|kv| {
            format!(
                "{} {}\n",
                kv.key_str().unwrap_or(""),
                kv.value_str().unwrap_or("")
            )
        })
        .collect();
    looked.push(("etcd".to_string(), values));
    for name in ["xds.log", "envoy.log"] {
        let text = std::fs::read_to_string(env.path(name)).unwrap_or_default();
        assert!(!text.is_empty(), "{name} was read");
        looked.push((name.to_string(), text));
    }
    for (where_, text) in &looked {
        for secret in [SECRET, ROTATED] {
            assert!(!text.contains(secret), "{secret} in {where_}");
        }
    }

    // Deleted: the server gets no credential from the gateway any more, and refuses.
    let (status, _) = gw
        .admin(reqwest::Method::DELETE, "/v1/auth/upstream/orders", None)
        .await;
    assert!(status.is_success(), "{status}");
    wait_until(
        "the credential is gone",
        Duration::from_secs(15),
        || async { !answered(&call(&url, "read_order").await) },
    )
    .await;
}
