//! Issue 19, point 7 on the per-service routes: a server's own `tools/list` answer, read by
//! the filter in a real Envoy, carries the availability annotations the aggregate endpoint
//! shows. An operator forces a tool open through toolgate-xds's admin API: within seconds the
//! route's listing says so (state, reason, the policy's fallback), in a JSON answer and in an
//! SSE one; forced closed, the annotation is gone and the listing is the server's again.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{wait_until, McpSession, Member, Options, Stack, TestEnv};

const TTL: u32 = 10;
const KEY: &str = "io.toolgate/availability";
const REASON: &str = "orders database migration";

/// The tools of one `tools/list` on `url`, by name.
async fn listing(url: &str) -> Vec<Value> {
    let mut s = McpSession::connect(url).await;
    let r = s.list_tools().await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    r.result()
        .and_then(|v| v["tools"].as_array().cloned())
        .unwrap_or_else(|| panic!("no listing in {}", r.body))
}

fn tool<'a>(tools: &'a [Value], name: &str) -> &'a Value {
    tools
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} listed: {tools:?}"))
}

async fn override_tool(gw: &Stack, service: &str, tool: &str, mode: &str) {
    let resp = reqwest::Client::new()
        .put(format!(
            "{}/v1/overrides/{service}/{tool}",
            gw.xds.admin_url()
        ))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"mode": mode, "reason": REASON, "author": "test"}))
        .send()
        .await
        .expect("admin API");
    let status = resp.status();
    assert!(status.is_success(), "{status}: {:?}", resp.text().await);
}

#[tokio::test]
async fn a_forced_open_tool_is_annotated_in_its_services_own_listing() {
    let env = TestEnv::new("service_listing");
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    // `json`: a stateless lab answering application/json; `sse`: a lab with sessions, whose
    // answers are SSE streams.
    let json_member = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "json",
        "json-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    let sse_member = Member::start(&env, &gw.etcd.endpoint(), "sse", "sse-1", &[], TTL).await;
    for (service, member) in [("json", &json_member), ("sse", &sse_member)] {
        gw.policy(
            &format!("{service}/write_order"),
            json!({"fallback_tool": "read_order"}),
        )
        .await;
        gw.routes(service, &[member]).await;
    }

    for service in ["json", "sse"] {
        let url = gw.url(service);
        let before = listing(&url).await;
        assert!(
            before.iter().all(|t| t["_meta"].get(KEY).is_none()),
            "{service}: nothing annotated yet: {before:?}"
        );

        override_tool(&gw, service, "write_order", "force_open").await;
        wait_until(
            &format!("{service}: write_order annotated as forced open"),
            Duration::from_secs(5),
            || async {
                tool(&listing(&url).await, "write_order")["_meta"]
                    .get(KEY)
                    .is_some()
            },
        )
        .await;
        let tools = listing(&url).await;
        let forced = tool(&tools, "write_order");
        let a = &forced["_meta"][KEY];
        assert_eq!(a["state"], "forced_open", "{service}: {forced}");
        assert_eq!(a["fallback"], "read_order", "{service}: {forced}");
        assert!(
            a["reason"].as_str().unwrap_or("").contains(REASON),
            "{service}: {forced}"
        );
        assert!(a.get("until").is_none(), "{service}: {forced}");
        let description = forced["description"].as_str().unwrap_or("");
        assert!(
            description.ends_with("use read_order instead."),
            "{service}: {description}"
        );
        // The rest of the definition is the server's, and the other tools are untouched.
        let plain = tool(&before, "write_order");
        assert_eq!(forced["inputSchema"], plain["inputSchema"], "{service}");
        for other in ["read_order", "echo"] {
            assert_eq!(
                tool(&tools, other),
                tool(&before, other),
                "{service}: {other}"
            );
        }

        assert!(
            gw.envoy
                .stat("wasmcustom.toolgate.tools_list.annotated")
                .await
                > 0,
            "{service}: annotated listings are counted"
        );

        override_tool(&gw, service, "write_order", "force_closed").await;
        wait_until(
            &format!("{service}: the annotation is gone"),
            Duration::from_secs(5),
            || async {
                tool(&listing(&url).await, "write_order")["_meta"]
                    .get(KEY)
                    .is_none()
            },
        )
        .await;
        assert_eq!(
            listing(&url).await,
            before,
            "{service}: the server's listing again"
        );
    }
}
