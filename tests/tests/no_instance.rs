//! A service whose only instance left keeps its tool definitions: `/mcp` on a real Envoy with
//! the filter still lists the definition the catalog read (description, inputSchema), annotated
//! `no_instance`, `/v1/catalog` keeps the service with its state, and a call gets a tool result
//! saying no server can take it. When an instance is back, the annotation goes and the state
//! is `serving` again. Real etcd, toolgate-xds, Envoy, the demo's finance server under
//! toolgate-register.

use std::time::Duration;

use nix::sys::signal::Signal;
use reqwest::StatusCode;
use serde_json::Value;
use toolgate_tests::{wait_for, wait_until, McpServer, McpSession, Registrant, Stack, TestEnv};

const AVAILABILITY: &str = "io.toolgate/availability";
const TOOL: &str = "finance__tax_calc";

fn mcp_url(stack: &Stack) -> String {
    let service_url = stack.url("x");
    format!("{}/mcp", service_url.trim_end_matches("/mcp/x"))
}

/// `TOOL` as `/mcp`'s `tools/list` shows it, if listed.
async fn listed(url: &str) -> Option<Value> {
    let mut s = McpSession::connect(url).await;
    let r = s.list_tools().await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    r.result()?["tools"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == TOOL)
        .cloned()
}

fn registrar(stack: &Stack, server: &McpServer) -> Registrant {
    Registrant::new(&stack.etcd.endpoint(), "finance", &server.endpoint())
        .arg("--instance-id", "fin-1")
        .arg("--tools", "tax_calc")
        .arg("--ttl", "10")
}

#[tokio::test]
async fn a_service_without_instances_keeps_its_definitions_on_mcp_and_in_the_catalog() {
    let env = TestEnv::new("no_instance_keeps_definitions");
    let stack = Stack::start(&env).await;
    let server = McpServer::demo(&env, "finance", "fin-1").await;
    let mut first = registrar(&stack, &server).spawn(&env, "fin-1.registrar");
    stack
        .wait_state("finance", "fin-1", "UP", Duration::from_secs(30))
        .await;
    let url = mcp_url(&stack);

    // The definition as the catalog read it, and as /mcp shows it while the service serves.
    let (read, _) = wait_for(
        "the catalog has read tax_calc",
        Duration::from_secs(30),
        || async {
            stack.xds.catalog().await["services"]["finance"]["tools"]
                .as_array()
                .and_then(|t| t.iter().find(|t| t["name"] == "tax_calc").cloned())
        },
    )
    .await;
    assert!(
        read["inputSchema"]["properties"]["region"].is_object(),
        "the demo's schema names its arguments: {read}"
    );
    let description = read["description"].as_str().unwrap_or_default().to_string();
    assert!(!description.is_empty(), "{read}");
    let (serving, _) = wait_for(
        "/mcp shows tax_calc's real schema",
        Duration::from_secs(20),
        || async {
            listed(&url)
                .await
                .filter(|t| t["inputSchema"] == read["inputSchema"])
        },
    )
    .await;
    assert!(serving["_meta"].get(AVAILABILITY).is_none(), "{serving}");

    // Its only instance leaves: the registrar revokes its lease (the server runs on).
    first.signal(Signal::SIGTERM);
    first
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the registrar exits on SIGTERM");
    wait_until(
        "toolgate-xds has no instance of finance",
        Duration::from_secs(10),
        || async { stack.state("finance", "fin-1").await == "absent" },
    )
    .await;
    let (gone, _) = wait_for(
        "/mcp annotates tax_calc no_instance",
        Duration::from_secs(10),
        || async {
            listed(&url)
                .await
                .filter(|t| t["_meta"][AVAILABILITY]["state"] == "no_instance")
        },
    )
    .await;
    assert_eq!(
        gone["inputSchema"], read["inputSchema"],
        "the definition read before stays: {gone}"
    );
    let shown = gone["description"].as_str().unwrap_or_default();
    assert!(
        shown.starts_with(&description) && !shown.contains("not available yet"),
        "the description read before, with the availability sentence: {shown:?}"
    );
    // Kept, not merely not yet forgotten: the builder's passes (every second) keep it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let catalog = stack.xds.catalog().await;
    let entry = &catalog["services"]["finance"];
    assert_eq!(entry["state"], "no_instance", "{catalog}");
    assert!(
        entry["no_instance_since"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{catalog}"
    );
    assert_eq!(
        entry["tools"].as_array().map(Vec::len),
        Some(1),
        "{catalog}"
    );
    assert_eq!(entry["tools"][0]["inputSchema"], read["inputSchema"]);
    let still = listed(&url).await.expect("still listed");
    assert_eq!(still["inputSchema"], read["inputSchema"], "{still}");
    // A call meanwhile: a tool result saying no server can take it, in MCP.
    let mut s = McpSession::connect(&url).await;
    let r = s
        .call_tool(TOOL, serde_json::json!({"amount": 1, "region": "de"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.result().map(|v| &v["isError"]), Some(&Value::Bool(true)));
    assert!(r.text().contains("no healthy server"), "{}", r.body);

    // An instance is back: serving again, the annotation gone.
    let _second = registrar(&stack, &server).spawn(&env, "fin-1.registrar-2");
    stack
        .wait_state("finance", "fin-1", "UP", Duration::from_secs(30))
        .await;
    wait_until(
        "/mcp shows tax_calc available again",
        Duration::from_secs(10),
        || async {
            listed(&url).await.is_some_and(|t| {
                t["_meta"].get(AVAILABILITY).is_none() && t["inputSchema"] == read["inputSchema"]
            })
        },
    )
    .await;
    wait_until(
        "the catalog says finance serves",
        Duration::from_secs(10),
        || async {
            let c = stack.xds.catalog().await;
            c["services"]["finance"]["state"] == "serving"
                && c["services"]["finance"]["no_instance_since"].is_null()
        },
    )
    .await;
}
