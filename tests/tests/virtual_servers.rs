//! Virtual servers (issue 19) on real etcd, toolgate-xds and Envoy: definitions in etcd and
//! through the admin API, the names each offers (the longest-registered service keeps a
//! contested bare name), and the routes Envoy gets for `/mcp` and `/virtual/<name>`.
//!
//! Services are registered by writing their keys (what toolgate-register writes): names come
//! from registrations, so no server needs to run.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{wait_until, Stack, TestEnv};

async fn register(stack: &Stack, service: &str, id: &str, port: u16, tools: &[&str]) {
    let value = json!({"instance_id": id, "endpoint": format!("127.0.0.1:{port}"), "tools": tools});
    stack
        .put(&format!("/mcp/services/{service}/{id}"), &value.to_string())
        .await;
}

/// `PUT /v1/virtual/<name>` with the admin token (or none); the status and the JSON body.
async fn put_virtual(stack: &Stack, name: &str, body: &str, token: bool) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .put(format!("{}/v1/virtual/{name}", stack.xds.admin_url()))
        .body(body.to_string());
    if token {
        req = req.bearer_auth(ADMIN_TOKEN);
    }
    let resp = req.send().await.expect("PUT /v1/virtual");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn list_virtual(stack: &Stack) -> Value {
    reqwest::get(format!("{}/v1/virtual", stack.xds.admin_url()))
        .await
        .expect("GET /v1/virtual")
        .json()
        .await
        .expect("/v1/virtual JSON")
}

/// The virtual server `name` in `GET /v1/virtual`.
async fn listed(stack: &Stack, name: &str) -> Value {
    list_virtual(stack).await["virtual_servers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

/// What the name calls on the virtual server, in the filter configuration Envoy holds.
fn calls(config: &Value, vs: &str, name: &str) -> String {
    let t = &config["virtual_servers"][vs]["tools"][name];
    format!(
        "{}/{}",
        t["service"].as_str().unwrap_or("-"),
        t["tool"].as_str().unwrap_or("-")
    )
}

#[tokio::test]
async fn virtual_servers_are_validated_named_by_age_and_routed_to_toolgate_xds() {
    let env = TestEnv::new("virtual_servers");
    let stack = Stack::start(&env).await;
    // zeta registers first, alpha later: alpha sorts first, zeta is older.
    register(&stack, "zeta", "z-1", 19001, &["search", "z_only"]).await;
    register(&stack, "alpha", "a-1", 19002, &["search"]).await;
    stack
        .wait_filter_config("the default virtual server names both services", |c| {
            calls(c, "default", "zeta__search") == "zeta/search"
                && calls(c, "default", "alpha__search") == "alpha/search"
        })
        .await;

    // (a) The admin API refuses bad definitions with 400 naming the field.
    let (status, body) =
        put_virtual(&stack, "ops", r#"{"services":["zeta","nosuch"]}"#, true).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "services[1]", "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("no such service is registered")),
        "{body}"
    );
    let (status, body) = put_virtual(&stack, "ops", r#"{"include":["a/b/c"]}"#, true).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("include[0]")),
        "{body}"
    );
    let (status, body) = put_virtual(&stack, "ops", r#"{"include":["se arch"]}"#, true).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("include[0]")),
        "{body}"
    );
    let (status, body) = put_virtual(&stack, "ops", r#"{"exlude":["x"]}"#, true).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["field"].is_string(), "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("exlude")),
        "{body}"
    );
    let (status, body) = put_virtual(&stack, "ops", "{not json", true).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("value")),
        "{body}"
    );
    let (status, body) = put_virtual(&stack, "bad name", "{}", true).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("name")),
        "{body}"
    );
    let (status, _) = put_virtual(&stack, "ops", "{}", false).await;
    assert_eq!(status, 401, "a change needs the admin token");
    assert_eq!(
        listed(&stack, "ops").await,
        Value::Null,
        "nothing was stored"
    );

    // (c) Bare names: the older service keeps the bare name.
    let (status, body) = put_virtual(&stack, "default", r#"{"naming":"bare"}"#, true).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = put_virtual(
        &stack,
        "ops",
        r#"{"services":["zeta"],"include":["search"]}"#,
        true,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    stack
        .wait_filter_config("bare names, the older service first", |c| {
            calls(c, "default", "search") == "zeta/search"
                && calls(c, "default", "alpha__search") == "alpha/search"
                && calls(c, "default", "z_only") == "zeta/z_only"
                && calls(c, "ops", "zeta__search") == "zeta/search"
                && calls(c, "ops", "zeta__z_only") == "-/-"
        })
        .await;
    let before = stack.envoy.filter_config().await.expect("filter config");
    // A third service with the same tool changes no one else's names.
    register(&stack, "beta", "b-1", 19003, &["search"]).await;
    stack
        .wait_filter_config("the newcomer is prefixed", |c| {
            calls(c, "default", "beta__search") == "beta/search"
        })
        .await;
    let after = stack.envoy.filter_config().await.expect("filter config");
    for name in ["search", "alpha__search", "z_only"] {
        assert_eq!(
            calls(&after, "default", name),
            calls(&before, "default", name),
            "{name} kept its meaning"
        );
    }
    let default = listed(&stack, "default").await;
    assert_eq!(default["stored"], true);
    assert_eq!(default["definition"]["naming"], "bare");
    assert_eq!(default["paths"], json!(["/mcp", "/virtual/default"]));
    assert_eq!(default["tools"]["search"], "zeta/search");
    assert_eq!(default["tools"]["beta__search"], "beta/search");

    // (b) A bad value written to etcd directly is ignored, logged and counted; the last good
    // definition stays, in the admin API and in the filter.
    let counted = || async {
        stack
            .xds
            .metric(
                "toolgate_registry_invalid_values_total",
                r#"reason="bad_virtual""#,
            )
            .await
    };
    let before_count = counted().await;
    stack
        .put("/mcp/virtual/default", r#"{"naming":"sideways"}"#)
        .await;
    wait_until(
        "the bad definition is counted",
        Duration::from_secs(10),
        || async { counted().await > before_count },
    )
    .await;
    assert!(
        stack.xds.log().contains("bad_virtual"),
        "the refusal is logged"
    );
    assert_eq!(
        listed(&stack, "default").await["definition"]["naming"],
        "bare"
    );
    let config = stack.envoy.filter_config().await.expect("filter config");
    assert_eq!(calls(&config, "default", "search"), "zeta/search");

    // (d) Envoy routes /mcp and /virtual/<name> to toolgate-xds's /v1/aggregate/<name>.
    let routes = wait_for_routes(&stack, &["/mcp", "/virtual/default", "/virtual/ops"]).await;
    for (path, name) in [
        ("/mcp", "default"),
        ("/virtual/default", "default"),
        ("/virtual/ops", "ops"),
    ] {
        let matching: Vec<&Value> = routes
            .iter()
            .filter(|r| r["match"]["path"] == path)
            .collect();
        assert_eq!(
            matching.len(),
            2,
            "a GET route and a general one for {path}"
        );
        for r in matching {
            assert_eq!(r["route"]["cluster"], "toolgate_control", "{r}");
            assert_eq!(
                r["route"]["prefix_rewrite"],
                format!("/v1/aggregate/{name}"),
                "{r}"
            );
            assert!(
                r["typed_per_filter_config"]["envoy.filters.http.stateful_session"]["disabled"]
                    == true,
                "no session affinity on {path}: {r}"
            );
        }
    }
    // An unknown virtual server gets a JSON-RPC error from Envoy.
    let resp = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/virtual/nosuch",
            stack.envoy.port
        ))
        .header("content-type", "application/json")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
        .send()
        .await
        .expect("POST /virtual/nosuch");
    assert_eq!(resp.status().as_u16(), 404);
    let body: Value = resp.json().await.expect("a JSON body");
    assert_eq!(body["jsonrpc"], "2.0", "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");

    // A deleted virtual server loses its route.
    let resp = reqwest::Client::new()
        .delete(format!("{}/v1/virtual/ops", stack.xds.admin_url()))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("DELETE /v1/virtual/ops");
    assert_eq!(resp.status().as_u16(), 200);
    wait_until(
        "the route of ops is gone",
        Duration::from_secs(10),
        || async {
            !route_dump(&stack)
                .await
                .iter()
                .any(|r| r["match"]["path"] == "/virtual/ops")
        },
    )
    .await;
}

/// The routes of Envoy's dynamic route configuration (from `/config_dump`).
async fn route_dump(stack: &Stack) -> Vec<Value> {
    let dump: Value = match reqwest::get(format!(
        "{}/config_dump?resource=dynamic_route_configs",
        stack.envoy.admin_url()
    ))
    .await
    {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["route_config"]["virtual_hosts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|vh| vh["routes"].as_array().cloned().unwrap_or_default())
        .collect()
}

async fn wait_for_routes(stack: &Stack, paths: &[&str]) -> Vec<Value> {
    wait_until(
        "envoy has the virtual servers' routes",
        Duration::from_secs(20),
        || async {
            let routes = route_dump(stack).await;
            paths
                .iter()
                .all(|p| routes.iter().any(|r| r["match"]["path"] == *p))
        },
    )
    .await;
    route_dump(stack).await
}
