//! The control plane never switches the gateway's judgment off with a configuration: a policy
//! delete that would leave another policy invalid is refused (through the admin API) or kept
//! (written to etcd directly), so the filter never gets a configuration it would refuse; a
//! filter's report of a refused configuration shows per Envoy; and a contested tool name stays
//! with its service across a re-registration. Real etcd, toolgate-xds, Envoy with the filter,
//! and the official Python SDK server, whose own call counter tells whether a tool ran.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, McpSession, Member, Options, Stack, TestEnv, Xds};

const TTL: u32 = 10;

/// Waits until toolgate-xds has applied everything etcd holds now, and gives Envoy a moment
/// to apply what that sent (a push takes milliseconds).
async fn settled(stack: &Stack) {
    let revision = stack.etcd.revision().await;
    wait_until(
        "toolgate-xds applied the latest etcd revision",
        Duration::from_secs(10),
        || async { stack.xds.registry().await["revision"].as_i64().unwrap_or(0) >= revision },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// `orders` on the Python SDK server, with a service policy, a tool policy that depends on it
/// (its `open_ms` is above the default `max_open_ms`, allowed only by the service's) and the
/// tool forced open; the forced-open reply checked, the server's counter at zero.
async fn forced_open_under_dependent_policies(env: &TestEnv, xds_args: &[&str]) -> (Stack, Member) {
    let stack = Stack::with(env, Options::default().xds_arg(xds_args)).await;
    let member = stack.python_orders(env, TTL).await;
    let put = reqwest::Method::PUT;
    let (status, body) = stack
        .admin(
            put.clone(),
            "/v1/policies/orders",
            Some(&json!({"max_open_ms": 600000})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = stack
        .admin(
            put.clone(),
            "/v1/policies/orders/write_order",
            Some(&json!({"open_ms": 400000})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = stack
        .admin(
            put,
            "/v1/overrides/orders/write_order",
            Some(&json!({"mode": "force_open", "reason": "incident 9: payments frozen"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    stack
        .wait_filter_config("both policies and the override", |c| {
            c["services"]["orders"]["policy"]["max_open_ms"] == 600000
                && c["services"]["orders"]["tools"]["write_order"]["open_ms"] == 400000
                && c["overrides"]["orders"]["write_order"]["mode"] == "force_open"
        })
        .await;
    assert_forced_open(&stack, &member, "before anything is deleted").await;
    (stack, member)
}

/// `write_order` gets the forced-open reply and never runs on the server.
async fn assert_forced_open(stack: &Stack, member: &Member, when: &str) {
    let mut s = McpSession::unconnected(&stack.url("orders"));
    let r = s.call_tool("write_order", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{when}: {}", r.body);
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("forced_open"),
        "{when}: the forced-open reply, got {}",
        r.body
    );
    assert_eq!(
        member.server.calls("write_order").await,
        0,
        "{when}: the forced-open tool never ran on the server"
    );
}

#[tokio::test]
async fn a_policy_delete_that_would_break_another_policy_is_refused_and_the_tool_stays_forced_open()
{
    let env = TestEnv::new("fail_closed_admin_delete");
    let (stack, member) = forced_open_under_dependent_policies(&env, &[]).await;

    let (status, body) = stack
        .admin(reqwest::Method::DELETE, "/v1/policies/orders", None)
        .await;
    assert_eq!(status, 400, "the delete is refused: {body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("policies/orders/write_order") && error.contains("max_open_ms"),
        "the refusal names the dependent key and the validation error: {body}"
    );
    // Nothing was written to etcd.
    let mut etcd = stack.etcd.client().await;
    let kept = etcd.get("/mcp/policies/orders", None).await.expect("get");
    assert_eq!(kept.kvs().len(), 1, "the policy is still in etcd");

    settled(&stack).await;
    assert_forced_open(&stack, &member, "after the refused delete").await;

    // Deleting the dependent first, then the service's policy, works.
    for path in ["/v1/policies/orders/write_order", "/v1/policies/orders"] {
        let (status, body) = stack.admin(reqwest::Method::DELETE, path, None).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    stack
        .wait_filter_config("no policy for orders", |c| {
            c["services"].get("orders").is_none()
        })
        .await;
    assert_forced_open(&stack, &member, "after both policies are gone").await;
}

#[tokio::test]
async fn a_policy_deleted_in_etcd_under_a_dependent_keeps_its_last_good_value() {
    let env = TestEnv::new("fail_closed_etcd_delete");
    // Inspections every second: a kept value must not read as a missed event.
    let (stack, member) =
        forced_open_under_dependent_policies(&env, &["--inspect-interval", "1s"]).await;
    let reason = r#"reason="delete_breaks_dependent""#;
    let refused = || async {
        stack
            .xds
            .metric("toolgate_registry_invalid_values_total", reason)
            .await
    };
    assert_eq!(refused().await, 0.0);

    let mut etcd = stack.etcd.client().await;
    etcd.delete("/mcp/policies/orders", None)
        .await
        .expect("etcd delete");
    settled(&stack).await;
    assert_forced_open(&stack, &member, "after the policy was deleted in etcd").await;
    let config = stack.envoy.filter_config().await.expect("a filter config");
    assert_eq!(
        config["services"]["orders"]["policy"]["max_open_ms"], 600000,
        "the deleted policy's last good value stays in effect: {config}"
    );
    wait_until(
        "the refused delete is counted",
        Duration::from_secs(10),
        || async { refused().await >= 1.0 },
    )
    .await;
    let log = stack.xds.log();
    assert!(
        log.lines().any(|l| l.contains("/mcp/policies/orders")
            && l.contains("delete_breaks_dependent")
            && l.contains("write_order")),
        "the refusal is logged with the key and the reason"
    );

    // The inspection compares like with like: no mismatch, no resync for a kept value.
    let inspections = stack
        .xds
        .metric("toolgate_registry_inspections_total", "")
        .await;
    wait_until(
        "two more inspections ran",
        Duration::from_secs(10),
        || async {
            stack
                .xds
                .metric("toolgate_registry_inspections_total", "")
                .await
                >= inspections + 2.0
        },
    )
    .await;
    assert_eq!(
        stack
            .xds
            .metric("toolgate_registry_reconcile_mismatches_total", "")
            .await,
        0.0,
        "a kept value is no missed event"
    );
    assert_forced_open(&stack, &member, "after the inspections").await;

    // Once the dependency is gone, the delete takes effect.
    etcd.delete("/mcp/policies/orders/write_order", None)
        .await
        .expect("etcd delete");
    stack
        .wait_filter_config("no policy for orders", |c| {
            c["services"].get("orders").is_none()
        })
        .await;
    assert_forced_open(&stack, &member, "after the dependency left").await;
}

#[tokio::test]
async fn a_filters_report_of_a_refused_configuration_shows_per_envoy() {
    let env = TestEnv::new("fail_closed_status_report");
    let etcd = toolgate_tests::Etcd::start(&env).await;
    let xds = Xds::start_with_env(
        &env,
        "xds-reports",
        &etcd.endpoint(),
        &["--report-token-env", "TG_REPORT"],
        &[("TG_REPORT", "report-secret")],
    )
    .await;
    let envoy = toolgate_tests::Envoy::start_with_filter(&env, "envoy-reports", &xds, 1, &[]).await;
    let envoys = || async {
        reqwest::get(format!("{}/v1/envoys", xds.admin_url()))
            .await
            .expect("GET /v1/envoys")
            .json::<Value>()
            .await
            .expect("/v1/envoys JSON")
    };
    let (node, _) = toolgate_tests::wait_for(
        "Envoy is connected and named",
        Duration::from_secs(20),
        || async {
            envoys().await["envoys"]
                .as_array()
                .and_then(|l| {
                    l.iter()
                        .find_map(|e| e["node"].as_str().map(str::to_string))
                })
                .filter(|n| !n.is_empty())
        },
    )
    .await;
    let row = || async {
        envoys().await["envoys"]
            .as_array()
            .and_then(|l| l.iter().find(|e| e["node"] == node.as_str()).cloned())
            .unwrap_or(Value::Null)
    };
    assert!(
        row().await.get("filter_config").is_none(),
        "absent until the filter reports: {}",
        row().await
    );

    let post = |token: Option<&str>, body: Value| {
        let mut r = reqwest::Client::new()
            .post(format!("{}/v1/filter-config-status", xds.admin_url()))
            .json(&body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        async move {
            let resp = r.send().await.expect("POST /v1/filter-config-status");
            resp.status().as_u16()
        }
    };
    let refused = json!({"gateway": node, "accepted": false,
        "error": "services.orders.tools.pay.max_open_ms = 300000 is invalid: must be 400000..=86400000"});
    assert_eq!(
        post(None, refused.clone()).await,
        401,
        "the report token is needed"
    );
    assert_eq!(post(Some("guess"), refused.clone()).await, 403);
    assert_eq!(row().await.get("filter_config"), None);

    assert_eq!(post(Some("report-secret"), refused.clone()).await, 200);
    let shown = row().await["filter_config"].clone();
    assert_eq!(shown["state"], "rejected", "{shown}");
    assert!(
        shown["error"]
            .as_str()
            .is_some_and(|e| e.contains("max_open_ms")),
        "{shown}"
    );
    let since = shown["since"].as_str().unwrap_or_default().to_string();
    assert!(since.ends_with('Z'), "RFC 3339: {shown}");
    assert_eq!(
        xds.metric("toolgate_filter_config_rejected_total", "")
            .await,
        1.0
    );
    assert_eq!(
        xds.metric("toolgate_filter_config_rejecting_envoys", "")
            .await,
        1.0
    );
    // Every worker reports: the state and its start stay.
    assert_eq!(post(Some("report-secret"), refused).await, 200);
    assert_eq!(row().await["filter_config"]["since"], since.as_str());
    assert_eq!(
        xds.metric("toolgate_filter_config_rejected_total", "")
            .await,
        2.0
    );

    let accepted = json!({"gateway": node, "accepted": true});
    assert_eq!(post(Some("report-secret"), accepted).await, 200);
    let shown = row().await["filter_config"].clone();
    assert_eq!(shown["state"], "ok", "{shown}");
    assert_eq!(shown.get("error"), None, "{shown}");
    assert_eq!(
        xds.metric("toolgate_filter_config_rejecting_envoys", "")
            .await,
        0.0
    );
    // A report that is not one is refused.
    assert_eq!(
        post(Some("report-secret"), json!({"gateway": node})).await,
        400
    );
    drop(envoy);
}

/// Registers `service`'s instance `id` (offering `search`) under a lease of its own, as
/// toolgate-register does; returns the lease.
async fn register(stack: &Stack, service: &str, id: &str, port: u16) -> i64 {
    let mut etcd = stack.etcd.client().await;
    let lease = etcd.lease_grant(30, None).await.expect("lease").id();
    let value =
        json!({"instance_id": id, "endpoint": format!("127.0.0.1:{port}"), "tools": ["search"]});
    etcd.put(
        format!("/mcp/services/{service}/{id}"),
        value.to_string(),
        Some(etcd_client::PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("put");
    lease
}

fn bare_search(config: &Value) -> String {
    config["virtual_servers"]["default"]["tools"]["search"]["service"]
        .as_str()
        .unwrap_or("-")
        .to_string()
}

#[tokio::test]
async fn a_contested_bare_name_stays_with_the_older_service_across_a_re_registration() {
    let env = TestEnv::new("fail_closed_service_age");
    let stack = Stack::start(&env).await;
    let (status, body) = stack
        .admin(
            reqwest::Method::PUT,
            "/v1/virtual/default",
            Some(&json!({"naming": "bare"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // zeta registers first although alpha sorts first: zeta is the older.
    let zeta = register(&stack, "zeta", "z-1", 19101).await;
    stack
        .wait_filter_config("zeta's search", |c| bare_search(c) == "zeta")
        .await;
    register(&stack, "alpha", "a-1", 19102).await;
    stack
        .wait_filter_config("alpha's search, prefixed", |c| {
            c["virtual_servers"]["default"]["tools"]["alpha__search"]["service"] == "alpha"
        })
        .await;
    assert_eq!(
        bare_search(&stack.envoy.filter_config().await.expect("config")),
        "zeta"
    );

    // zeta's registrar stops (revoke) and registers again: a new key, a younger revision.
    let mut etcd = stack.etcd.client().await;
    etcd.lease_revoke(zeta).await.expect("revoke");
    settled(&stack).await;
    assert_eq!(
        bare_search(&stack.envoy.filter_config().await.expect("config")),
        "zeta",
        "while zeta has no instance"
    );
    register(&stack, "zeta", "z-2", 19103).await;
    settled(&stack).await;
    let config = stack.envoy.filter_config().await.expect("config");
    assert_eq!(
        bare_search(&config),
        "zeta",
        "the bare name stays with zeta after it registered again: {}",
        config["virtual_servers"]["default"]
    );
    assert_eq!(
        config["virtual_servers"]["default"]["tools"]["alpha__search"]["service"],
        "alpha"
    );

    // A restarted toolgate-xds reads the same ages from etcd.
    let mut stack = stack;
    stack.xds.restart(&env).await;
    wait_until(
        "the restarted toolgate-xds's filter configuration is applied",
        Duration::from_secs(20),
        || async {
            let envoys: Value = reqwest::get(format!("{}/v1/envoys", stack.xds.admin_url()))
                .await
                .expect("GET /v1/envoys")
                .json()
                .await
                .expect("JSON");
            envoys["envoys"].as_array().is_some_and(|l| {
                l.iter()
                    .any(|e| e["types"]["ecds"]["acked_version"].is_string())
            })
        },
    )
    .await;
    settled(&stack).await;
    let config = stack.envoy.filter_config().await.expect("config");
    assert_eq!(bare_search(&config), "zeta", "after a restart");
}

#[tokio::test]
async fn a_header_spelt_with_an_underscore_never_reaches_the_server() {
    let env = TestEnv::new("fail_closed_underscore_header");
    let stack = Stack::start(&env).await;
    let member = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    stack.routes("orders", &[&member]).await;
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": toolgate_tests::mcp::PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "underscore", "version": "1"}}});
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(stack.url("orders"))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        // What a server that maps `_` to `-` would read as the claim header `x-caller`.
        .header("x_caller", "alice")
        .header("x-unrelated", "1")
        .body(initialize.to_string())
        .send()
        .await
        .expect("POST initialize");
    assert_eq!(
        r.status(),
        StatusCode::OK,
        "{}",
        r.text().await.unwrap_or_default()
    );
    let seen = member.server.control().await;
    let headers = seen["headers"].as_object().cloned().unwrap_or_default();
    assert!(
        headers.contains_key("x-unrelated"),
        "the server reports the headers it got: {seen}"
    );
    assert!(
        !headers.keys().any(|h| h.contains('_')),
        "a header with an underscore reached the server: {seen}"
    );
}
