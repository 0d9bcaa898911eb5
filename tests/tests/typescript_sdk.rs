//! The official TypeScript SDK clients (`@modelcontextprotocol/sdk` 1.x and
//! `@modelcontextprotocol/client` 2.x, run by `tests/node/call.mjs`) through the gateway.

use serde_json::json;
use toolgate_tests::{Member, NodeClient, Sdk, Stack, TestEnv};

#[tokio::test]
async fn both_typescript_sdks_call_a_lab_tool_through_the_gateway() {
    let env = TestEnv::new("both_typescript_sdks_call_a_lab_tool_through_the_gateway");
    let stack = Stack::start(&env).await;
    let envoy = &stack.envoy;
    let m = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], 10).await;
    stack.routes("orders", &[&m]).await;

    // Each SDK with its default version, and 2.x also at the 2026-07-28 revision, which it
    // negotiates with server/discover instead of initialize.
    let runs = [
        (Sdk::V1, None),
        (Sdk::V2, None),
        (Sdk::V2, Some("2026-07-28")),
    ];
    for (i, (sdk, version)) in runs.into_iter().enumerate() {
        let mut client = NodeClient::new(sdk)
            .method("tools/list")
            .step("tools/call", json!({"name": "echo", "arguments": {"n": i}}));
        if let Some(v) = version {
            client = client.protocol_version(v);
        }
        let run = client.run(&envoy.url("orders")).await;
        println!(
            "{} at {:?}: exit {:?}, {}",
            run.sdk(),
            run.protocol_version(),
            run.exit_code,
            run.report
        );
        assert_eq!(run.exit_code, Some(0), "{}\n{}", run.report, run.stderr);
        if let Some(v) = version {
            assert_eq!(run.protocol_version(), Some(v));
        }
        let tools = run.result("tools/list")["tools"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["name"].as_str())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        assert!(tools.contains(&"echo"), "{}", run.report);
        let result = run.result("tools/call");
        assert_eq!(result["isError"], false, "{}", run.report);
        assert_eq!(result["structuredContent"]["instance_id"], "orders-1");
        assert_eq!(result["structuredContent"]["arguments"]["n"], i);
        assert_eq!(
            m.server.calls("echo").await,
            i as u64 + 1,
            "the call reached the lab"
        );
    }
}
