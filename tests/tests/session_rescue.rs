//! Sessions that outlive their instance (issue 19, point 6): the official TypeScript SDK (1.x
//! and 2.x) keeps sending a dead session id after the instance it is pinned to dies, and the
//! survivor answers 404. Through the gateway, its next calls succeed on the survivor with no
//! reconnect in client code, on the service's own route and on `/mcp` (where the session the
//! client holds is the gateway's, and the one pinned to the instance is held for it). Real
//! etcd, toolgate-xds, Envoy with the filter, two lab servers (rmcp, stateful) whose
//! registrations outlive the SIGKILL (the lease is alive).

use std::time::Duration;

use serde_json::json;
use toolgate_tests::{wait_until, Member, NodeClient, Sdk, Stack, TestEnv};

const ECHO: &str = "echo";

/// Where the client connects.
#[derive(Debug, Clone, Copy)]
enum Route {
    /// `/mcp/orders`, where `echo` is `echo`.
    Service,
    /// `/mcp`, the default virtual server, where it is `orders__echo`.
    Aggregate,
}

impl Route {
    fn url(self, stack: &Stack) -> String {
        match self {
            Route::Service => stack.url("orders"),
            Route::Aggregate => format!("http://127.0.0.1:{}/mcp", stack.envoy.port),
        }
    }

    fn tool(self) -> &'static str {
        match self {
            Route::Service => ECHO,
            Route::Aggregate => "orders__echo",
        }
    }
}

#[tokio::test]
async fn a_typescript_client_pinned_to_a_killed_instance_goes_on_on_the_survivor() {
    rescued(Route::Service).await;
}

#[tokio::test]
async fn a_typescript_client_of_mcp_pinned_to_a_killed_instance_goes_on_on_the_survivor() {
    rescued(Route::Aggregate).await;
}

async fn rescued(route: Route) {
    for sdk in Sdk::ALL {
        let env = TestEnv::new(&format!("session_rescue_{route:?}_{sdk:?}"));
        let stack = Stack::start(&env).await;
        let etcd = stack.etcd.endpoint();
        let mut a = Member::start(&env, &etcd, "orders", "a", &[], 30).await;
        let mut b = Member::start(&env, &etcd, "orders", "b", &[], 30).await;
        stack
            .wait_healthy("orders", &[&a, &b], Duration::from_secs(20))
            .await;
        stack
            .wait_filter_config("/mcp's name of orders' echo", |c| {
                c["virtual_servers"]["default"]["tools"]["orders__echo"]["tool"] == ECHO
            })
            .await;
        let tool = route.tool();

        let go = env.path("go");
        let client = NodeClient::new(sdk)
            .protocol_version("2025-11-25")
            .timeout(Duration::from_secs(40))
            .step(
                "tools/call",
                json!({"name": tool, "arguments": {"text": "one"}}),
            )
            .step("toolgate/wait-file", json!({"path": go}))
            .step(
                "tools/call",
                json!({"name": tool, "arguments": {"text": "two"}}),
            )
            .step(
                "tools/call",
                json!({"name": tool, "arguments": {"text": "three"}}),
            );
        let url = route.url(&stack);
        let run = tokio::spawn(async move { client.run(&url).await });

        // The session is pinned to whichever instance took the first call.
        wait_until("the first call lands", Duration::from_secs(20), || async {
            a.server.calls(ECHO).await + b.server.calls(ECHO).await == 1
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
        let a_took_it = a.server.calls(ECHO).await == 1;
        let (dead, survivor) = if a_took_it {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        dead.server.proc.kill();
        std::fs::write(&go, b"go").expect("write the go file");

        let run = run.await.expect("the node task");
        if run.exit_code != Some(0) {
            env.print_failure_logs();
        }
        assert_eq!(
            run.exit_code,
            Some(0),
            "{} on {route:?}: a call failed after its instance died: {}\n{}",
            run.sdk(),
            run.report,
            run.stderr
        );
        let steps = run.report["steps"].as_array().cloned().unwrap_or_default();
        let calls: Vec<_> = steps
            .iter()
            .filter(|s| s["method"] == "tools/call")
            .collect();
        assert_eq!(calls.len(), 3, "{}", run.report);
        for c in &calls {
            assert_eq!(c["ok"], true, "{}", run.report);
            assert_ne!(c["result"]["isError"], true, "{}", run.report);
        }
        // Each call ran where its answer says: the first on the instance that died, the
        // others on the survivor.
        let ran_on: Vec<String> = calls
            .iter()
            .map(|c| {
                c["result"]["structuredContent"]["instance_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        assert_eq!(
            ran_on,
            [
                dead.server.instance_id.clone(),
                survivor.server.instance_id.clone(),
                survivor.server.instance_id.clone()
            ],
            "{} on {route:?}",
            run.sdk()
        );
    }
}
