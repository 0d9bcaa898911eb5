//! Virtual servers (issue 19) on real etcd, toolgate-xds and Envoy: definitions in etcd and
//! through the admin API, the names each offers (the longest-registered service keeps a
//! contested bare name), and the routes Envoy gets for `/mcp` and `/virtual/<name>`.
//!
//! Services are registered by writing their keys (what toolgate-register writes): names come
//! from registrations, so no server needs to run.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{wait_until, McpSession, Member, Stack, TestEnv};

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

/// The names `tools/list` shows on `/virtual/<vs>` through Envoy (a fresh session).
async fn shown(stack: &Stack, vs: &str) -> Vec<String> {
    let mut s = McpSession::connect(&virtual_url(stack, vs)).await;
    let reply = s.list_tools().await;
    let mut names: Vec<String> = reply
        .result()
        .and_then(|r| r["tools"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

fn virtual_url(stack: &Stack, vs: &str) -> String {
    format!("http://127.0.0.1:{}/virtual/{vs}", stack.envoy.port)
}

#[tokio::test]
async fn each_naming_mode_reaches_the_right_server_and_a_narrow_server_refuses_the_rest() {
    let env = TestEnv::new("virtual_servers_calls");
    let stack = Stack::start(&env).await;
    let ep = stack.etcd.endpoint();
    // Both offer `echo`; alpha registers first, so it is the older.
    let lab = ["--stateless", "--json-response"];
    let alpha =
        Member::start_with_tools(&env, &ep, "alpha", "alpha-1", &lab, "echo,read_order", 10).await;
    stack.routes("alpha", &[&alpha]).await;
    let beta =
        Member::start_with_tools(&env, &ep, "beta", "beta-1", &lab, "echo,write_order", 10).await;
    stack.routes("beta", &[&beta]).await;
    for (name, body) in [
        ("pre", r#"{"naming":"prefixed"}"#),
        ("bare", r#"{"naming":"bare"}"#),
        ("narrow", r#"{"services":["alpha"],"include":["echo"]}"#),
    ] {
        let (status, body) = put_virtual(&stack, name, body, true).await;
        assert_eq!(status, 200, "{name}: {body}");
    }
    stack
        .wait_filter_config("the three virtual servers' names", |c| {
            calls(c, "pre", "alpha__echo") == "alpha/echo"
                && calls(c, "pre", "beta__echo") == "beta/echo"
                && calls(c, "bare", "echo") == "alpha/echo"
                && calls(c, "bare", "beta__echo") == "beta/echo"
                && calls(c, "narrow", "alpha__echo") == "alpha/echo"
        })
        .await;
    wait_for_routes(
        &stack,
        &["/virtual/pre", "/virtual/bare", "/virtual/narrow"],
    )
    .await;

    // What each lists, through Envoy: prefixed always; bare with the older service keeping the
    // contested name and the other's prefixed, uncontested names bare; narrow only what it
    // includes.
    let want: [(&str, &[&str]); 3] = [
        (
            "pre",
            &[
                "alpha__echo",
                "alpha__read_order",
                "beta__echo",
                "beta__write_order",
            ],
        ),
        ("bare", &["beta__echo", "echo", "read_order", "write_order"]),
        ("narrow", &["alpha__echo"]),
    ];
    for (vs, names) in want {
        wait_until(
            &format!("/virtual/{vs} lists {names:?}"),
            Duration::from_secs(10),
            || async { shown(&stack, vs).await == names },
        )
        .await;
    }

    // Each name reaches its own server (the lab says which instance ran the call).
    for (vs, name, instance) in [
        ("pre", "alpha__echo", "alpha-1"),
        ("pre", "beta__echo", "beta-1"),
        ("bare", "echo", "alpha-1"),
        ("bare", "beta__echo", "beta-1"),
        ("bare", "write_order", "beta-1"),
        ("narrow", "alpha__echo", "alpha-1"),
    ] {
        let mut s = McpSession::connect(&virtual_url(&stack, vs)).await;
        let reply = s
            .call_tool(name, json!({"text": format!("{vs} {name}")}))
            .await;
        let result = reply.result().cloned().unwrap_or_default();
        if result["structuredContent"]["instance_id"] != instance {
            env.print_failure_logs();
        }
        assert_ne!(result["isError"], true, "{vs} {name}: {}", reply.body);
        assert_eq!(
            result["structuredContent"]["instance_id"], instance,
            "{vs} {name}: {}",
            reply.body
        );
        let tool = name.rsplit("__").next().unwrap_or(name);
        assert_eq!(
            result["structuredContent"]["tool"], tool,
            "{vs} {name} ran as the tool's own name: {}",
            reply.body
        );
    }
    assert_eq!(alpha.server.calls("echo").await, 3);
    assert_eq!(beta.server.calls("echo").await, 2);

    // The narrow server answers what it does not include, by any spelling, with a tool
    // result naming it (`isError`, as an unknown tool); no server is asked.
    let mut s = McpSession::connect(&virtual_url(&stack, "narrow")).await;
    for name in ["alpha__read_order", "read_order", "beta__echo", "echo"] {
        let reply = s.call_tool(name, json!({"order_id": "o-1"})).await;
        let message = reply.message.clone().unwrap_or_default();
        assert_eq!(message["result"]["isError"], true, "{name}: {}", reply.body);
        assert_eq!(
            reply.breaker_state().as_deref(),
            Some("not_offered"),
            "{name}"
        );
        let text = reply.text();
        assert!(text.contains("`/virtual/narrow`"), "{name}: {text}");
    }
    assert_eq!(alpha.server.calls("read_order").await, 0);
    assert_eq!(alpha.server.calls("echo").await, 3);
    assert_eq!(beta.server.calls("echo").await, 2);
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
