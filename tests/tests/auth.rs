//! Issue 20: the gateway as an OAuth 2.1 resource server, on real processes. A local issuer
//! (keys generated here, its JWKS served over HTTP) signs the tokens; Envoy's `jwt_authn`
//! verifies them, configured over ECDS from `<prefix>auth/config`; the filter answers the
//! 401/403s and applies the per-tool rules of `<prefix>auth/rules/<service>`.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use toolgate_tests::issuer::Alg;
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{wait_until, Envoy, Issuer, McpSession, Member, Options, Stack, TestEnv, Xds};

const TTL: u32 = 10;

/// The auth configuration of these tests: every service needs a token of `issuer`, and the
/// gateway at `base` advertises the scopes of `orders`.
fn auth_config(base: &str, issuer: &Issuer) -> Value {
    let mut config = issuer.auth_config(base, json!(["*"]));
    config["scopes_supported"] = json!(["orders:read", "orders:write"]);
    config
}

/// One `tools/call` on a fresh session (with `token`, if any); `initialize` may be the
/// request refused.
async fn call(url: &str, token: Option<&str>, tool: &str) -> toolgate_tests::mcp::Reply {
    let mut s = McpSession::unconnected(url);
    s.bearer = token.map(str::to_string);
    let init = s.initialize().await;
    if init.status != StatusCode::OK {
        return init;
    }
    s.call_tool(tool, json!({})).await
}

async fn listed(url: &str, token: &str) -> Vec<String> {
    let mut s = McpSession::connect_with_token(url, token).await;
    let r = s.list_tools().await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let mut names: Vec<String> = r
        .result()
        .and_then(|v| v["tools"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

/// The lab's `GET /control`.
async fn lab(m: &Member) -> Value {
    m.server.control().await
}

async fn python_client(url: &str, tool: &str, token: Option<&str>) -> Value {
    let python = toolgate_tests::paths::workspace_root().join(".venv/bin/python");
    let script = toolgate_tests::paths::workspace_root().join("tests/python/auth_client.py");
    let mut args = vec![
        script.display().to_string(),
        url.to_string(),
        tool.to_string(),
    ];
    args.extend(token.map(str::to_string));
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(python).args(&args).output(),
    )
    .await
    .expect("the python client finished within 60 s")
    .expect("the python client runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed: {}\nstderr:\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// `toolgate_auth_denied{service, reason}` as Envoy's Prometheus endpoint shows it.
async fn denied(gw: &Stack, service: &str, reason: &str) -> f64 {
    let text = gw.envoy.prometheus().await;
    text.lines()
        .filter(|l| l.starts_with("toolgate_auth_denied{"))
        .filter(|l| {
            l.contains(&format!("service=\"{service}\""))
                && l.contains(&format!("reason=\"{reason}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn tokens_are_verified_by_envoy_and_refused_callers_never_reach_the_server() {
    let env = TestEnv::new("auth_tokens");
    let issuer = Issuer::start().await;
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    let m = Member::start(&env, &gw.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    gw.routes("orders", &[&m]).await;
    let url = gw.url("orders");
    let base = gw.base_url();
    let aud = format!("{base}/mcp/orders");

    // Off by default: no token needed.
    assert_eq!(call(&url, None, "read_order").await.status, StatusCode::OK);

    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/auth/config",
            Some(&auth_config(&base, &issuer)),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("the auth configuration", |c| {
        c["auth"]["resource"] == base.as_str()
    })
    .await;
    let token = issuer
        .token()
        .sub("alice")
        .aud(&aud)
        .roles(["reader"])
        .sign();
    wait_until(
        "a valid token is accepted (JWKS fetched)",
        Duration::from_secs(20),
        || async {
            call(&url, Some(&token), "read_order")
                .await
                .text()
                .contains("read_order")
        },
    )
    .await;

    // No token: 401 naming where the metadata is, which Envoy serves.
    let r = call(&url, None, "read_order").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{}", r.body);
    let challenge = r.www_authenticate.clone().expect("WWW-Authenticate");
    let metadata_url = format!("{base}/.well-known/oauth-protected-resource/mcp/orders");
    assert_eq!(
        challenge,
        format!("Bearer resource_metadata=\"{metadata_url}\"")
    );
    let doc: Value = reqwest::get(&metadata_url)
        .await
        .expect("metadata")
        .json()
        .await
        .expect("json");
    assert_eq!(doc["resource"], aud);
    assert_eq!(doc["authorization_servers"][0], issuer.issuer());
    assert_eq!(doc["bearer_methods_supported"][0], "header");
    assert_eq!(doc["scopes_supported"][1], "orders:write");
    let root: Value = reqwest::get(format!("{base}/.well-known/oauth-protected-resource"))
        .await
        .expect("root metadata")
        .json()
        .await
        .expect("json");
    assert_eq!(root["resource"], base);

    // Every hostile token: 401 invalid_token, and the server saw none of them.
    let before = lab(&m).await;
    for (label, bad) in issuer.hostile_tokens("alice", &aud) {
        let r = call(&url, Some(&bad), "read_order").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{label}: {}", r.body);
        let challenge = r.www_authenticate.clone().unwrap_or_default();
        assert!(
            challenge.contains("error=\"invalid_token\""),
            "{label}: {challenge}"
        );
        assert!(challenge.contains(&metadata_url), "{label}: {challenge}");
    }
    let after = lab(&m).await;
    assert_eq!(
        after["total_calls"], before["total_calls"],
        "no refused call reached the lab"
    );
    assert_eq!(
        after["initializes"], before["initializes"],
        "nor any refused initialize"
    );
    // A token for another resource of the same gateway is no token for this one.
    let elsewhere = issuer
        .token()
        .sub("alice")
        .aud(format!("{base}/mcp/payments"))
        .sign();
    assert_eq!(
        call(&url, Some(&elsewhere), "read_order").await.status,
        StatusCode::UNAUTHORIZED
    );

    // The server never gets the client's token, nor the verified payload.
    let headers = &lab(&m).await["headers"];
    assert!(headers.get("authorization").is_none(), "{headers}");
    assert!(headers.get("x-toolgate-jwt-payload").is_none(), "{headers}");

    wait_until(
        "denials counted by service and reason",
        Duration::from_secs(10),
        || async {
            denied(&gw, "orders", "missing_token").await >= 1.0
                && denied(&gw, "orders", "invalid_token").await >= 10.0
        },
    )
    .await;

    // Envoy fetches nothing from the issuer: toolgate-xds does, and hands the keys over
    // inline, with Envoy's cache of verified tokens on (the default configuration).
    let dump: Value = reqwest::get(format!("{}/config_dump", gw.envoy.admin_url()))
        .await
        .expect("config_dump")
        .json()
        .await
        .expect("json");
    let dump_text = dump.to_string();
    assert!(
        !dump_text.contains("toolgate-jwks"),
        "a JWKS cluster in Envoy"
    );
    assert!(!dump_text.contains("remote_jwks"), "Envoy fetches a JWKS");
    assert!(dump_text.contains("local_jwks"), "keys inline");
    assert!(dump_text.contains("jwt_cache_config"), "token cache on");
    assert!(
        gw.xds
            .metrics_text()
            .await
            .lines()
            .any(|l| l.starts_with("toolgate_jwks_fetches_total{result=\"ok\"}")),
        "toolgate-xds counts its fetches"
    );

    // Key rotation: a key published later is accepted after the refresh (1 s)...
    let kid = issuer.rotate_in_new(Alg::Es256);
    let rotated = issuer
        .token()
        .sub("alice")
        .aud(&aud)
        .alg(Alg::Es256)
        .kid(&kid)
        .sign();
    let took = wait_until(
        "the new key is accepted",
        Duration::from_secs(10),
        || async { call(&url, Some(&rotated), "read_order").await.status == StatusCode::OK },
    )
    .await;
    println!("new key accepted after {took:?}");
    // ...a removed one is refused within a refresh, although Envoy verified (and cached)
    // this very token a moment ago...
    for _ in 0..3 {
        assert_eq!(
            call(&url, Some(&rotated), "read_order").await.status,
            StatusCode::OK
        );
    }
    issuer.remove(&kid);
    let took = wait_until(
        "the removed key is refused, the token cached",
        Duration::from_secs(10),
        || async {
            call(&url, Some(&rotated), "read_order").await.status == StatusCode::UNAUTHORIZED
        },
    )
    .await;
    println!("withdrawn key refused after {took:?}");
    // ...while the tokens of the keys still published verify (a fresh cache).
    assert_eq!(
        call(&url, Some(&token), "read_order").await.status,
        StatusCode::OK
    );
    // ...and with the JWKS server down, the keys held still verify.
    issuer.stop().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = call(&url, Some(&token), "read_order").await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "cached keys verify while the JWKS is down: {}",
        r.body
    );
    issuer.restart().await;

    // The official Python SDK: with a token it lists and calls; without, it is refused and
    // its own helper finds the metadata URL in the 401.
    let with = python_client(&url, "read_order", Some(&token)).await;
    assert_eq!(with["isError"], false, "{with}");
    assert!(
        with["tools"].as_array().is_some_and(|t| !t.is_empty()),
        "{with}"
    );
    let without = python_client(&url, "read_order", None).await;
    assert_eq!(without["status"], 401, "{without}");
    assert_eq!(without["resource_metadata"], metadata_url, "{without}");
    assert_eq!(without["metadata"]["resource"], aud, "{without}");
    assert!(
        without["sdk_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{without}"
    );

    // A second issuer whose JWKS cannot be fetched: Envoy takes the configuration with an
    // empty key set for it (no rejection), and the first issuer's tokens still verify.
    let mut two = auth_config(&base, &issuer);
    two["issuers"]
        .as_array_mut()
        .expect("issuers")
        .push(json!({"issuer": "https://down.invalid",
                     "jwks": {"remote": {"uri": "http://127.0.0.1:1/jwks.json", "timeout_ms": 200}}}));
    let (status, body) = gw.admin(Method::PUT, "/v1/auth/config", Some(&two)).await;
    assert!(status.is_success(), "{status}: {body}");
    wait_until(
        "Envoy applies a configuration with an issuer that has no keys",
        Duration::from_secs(20),
        || async {
            reqwest::get(format!("{}/config_dump", gw.envoy.admin_url()))
                .await
                .expect("config_dump")
                .text()
                .await
                .expect("text")
                .contains("https://down.invalid")
        },
    )
    .await;
    assert_eq!(
        call(&url, Some(&token), "read_order").await.status,
        StatusCode::OK
    );
    assert!(
        gw.xds
            .metrics_text()
            .await
            .lines()
            .any(|l| l == "toolgate_jwks_failing 1"),
        "the failing JWKS is counted"
    );

    // Turned off again: open as before.
    let (status, _) = gw.admin(Method::DELETE, "/v1/auth/config", None).await;
    assert!(status.is_success());
    wait_until("auth off again", Duration::from_secs(10), || async {
        call(&url, None, "read_order").await.status == StatusCode::OK
    })
    .await;
}

#[tokio::test]
async fn rules_decide_per_tool_on_both_gateways_and_a_bad_rule_changes_nothing() {
    let env = TestEnv::new("auth_rules");
    let issuer = Issuer::start().await;
    let a = Stack::with(&env, Options::default()).await;
    // A second gateway of the fleet on the same etcd.
    let xds_b = Xds::start_with_env(
        &env,
        "xds-b",
        &a.etcd.endpoint(),
        &["--admin-token-env", "TOOLGATE_TEST_ADMIN_TOKEN"],
        &[("TOOLGATE_TEST_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
    .await;
    let envoy_b = Envoy::start_with_filter(&env, "envoy-b", &xds_b, 1, &[]).await;
    let m = Member::start(&env, &a.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    a.routes("orders", &[&m]).await;
    envoy_b
        .wait_addresses("orders", &[m.server.endpoint()], Duration::from_secs(20))
        .await;
    let base = a.base_url();
    let (status, body) = a
        .admin(
            Method::PUT,
            "/v1/auth/config",
            Some(&auth_config(&base, &issuer)),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    let rules = json!({"rules": [
        {"tools": ["read_order"], "roles": ["reader", "writer"]},
        {"tools": ["write_order"], "roles": ["writer"], "scopes": ["orders:write"]}
    ]});
    let (status, body) = a
        .admin(Method::PUT, "/v1/auth/rules/orders", Some(&rules))
        .await;
    assert!(status.is_success(), "{status}: {body}");

    let url_a = a.url("orders");
    let url_b = envoy_b.url("orders");
    let aud = format!("{base}/mcp/orders");
    // Valid for the service's own route and for `/mcp` (RFC 8707: a token names the
    // resources it is for; one for `/mcp/orders` alone is refused at `/mcp`).
    let reader = issuer
        .token()
        .sub("rita")
        .auds([aud.clone(), format!("{base}/mcp")])
        .roles(["reader"])
        .sign();
    let orders_only = issuer
        .token()
        .sub("rita")
        .aud(&aud)
        .roles(["reader"])
        .sign();
    let writer = issuer
        .token()
        .sub("walt")
        .aud(&aud)
        .roles(["writer"])
        .scope("orders:read")
        .sign();
    // Envoy B checks the audience against the gateway A's URL the configuration names: the
    // fleet shares one resource identifier.
    a.wait_filter_config("the rules", |c| {
        c["auth"]["services"]["orders"]["rules"]
            .as_array()
            .is_some_and(|r| r.len() == 2)
    })
    .await;
    wait_until("tokens verified on A", Duration::from_secs(20), || async {
        call(&url_a, Some(&reader), "read_order")
            .await
            .text()
            .contains("read_order")
    })
    .await;

    // A reader lists and calls read_order, and neither sees nor calls write_order.
    assert_eq!(listed(&url_a, &reader).await, ["read_order"]);
    let r = call(&url_a, Some(&reader), "write_order").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let error = &r.message.clone().expect("a JSON-RPC answer")["error"];
    assert_eq!(error["data"]["reason"], "tool_denied", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("write_order"),
        "{error}"
    );
    // The same on the aggregate endpoint (`/mcp`, tools named `<service>__<tool>`).
    let aggregate = format!("{base}/mcp");
    wait_until(
        "/mcp lists the service's tools",
        Duration::from_secs(20),
        || async {
            listed(&aggregate, &reader)
                .await
                .iter()
                .any(|t| t == "orders__read_order")
        },
    )
    .await;
    assert_eq!(listed(&aggregate, &reader).await, ["orders__read_order"]);
    let r = call(&aggregate, Some(&orders_only), "orders__read_order").await;
    assert_eq!(
        r.status,
        StatusCode::UNAUTHORIZED,
        "a token for another resource: {}",
        r.body
    );
    let r = call(&aggregate, Some(&reader), "orders__write_order").await;
    let error = &r.message.clone().expect("a JSON-RPC answer")["error"];
    assert_eq!(error["data"]["reason"], "tool_denied", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("orders__write_order"),
        "named as the agent sees it: {error}"
    );
    assert!(call(&aggregate, Some(&reader), "orders__read_order")
        .await
        .text()
        .contains("read_order"));

    // A writer without the scope: 403 insufficient_scope naming it.
    let r = call(&url_a, Some(&writer), "write_order").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    let challenge = r.www_authenticate.unwrap_or_default();
    assert!(
        challenge.starts_with("Bearer error=\"insufficient_scope\", scope=\"orders:write\""),
        "{challenge}"
    );
    let calls_before = m.server.calls("write_order").await;
    assert_eq!(calls_before, 0, "no denied call reached the server");

    // A rule changed through the admin API of A holds on both gateways, without a restart.
    let open_writes = json!({"rules": [
        {"tools": ["read_order", "write_order"], "roles": ["reader"]}
    ]});
    let (status, body) = a
        .admin(Method::PUT, "/v1/auth/rules/orders", Some(&open_writes))
        .await;
    assert!(status.is_success(), "{status}: {body}");
    for url in [&url_a, &url_b] {
        let took = wait_until(
            &format!("the new rule on {url}"),
            Duration::from_secs(10),
            || async {
                call(url, Some(&reader), "write_order")
                    .await
                    .text()
                    .contains("write_order")
            },
        )
        .await;
        println!("rule change in force on {url} after {took:?}");
    }

    // A malformed rule: refused with the field named, and nothing changes.
    let bad = json!({"rules": [{"tools": ["write_order"], "role": ["reader"]}]});
    let (status, body) = a
        .admin(Method::PUT, "/v1/auth/rules/orders", Some(&bad))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["field"], "rules[0].role", "{body}");
    // Written to etcd directly, it is ignored with a log line; the last good set stays.
    a.put("/mcp/auth/rules/orders", &bad.to_string()).await;
    wait_until(
        "toolgate-xds logs the refused rule set",
        Duration::from_secs(10),
        || async { a.xds.log().contains("bad_auth") },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for url in [&url_a, &url_b] {
        assert!(
            call(url, Some(&reader), "write_order")
                .await
                .text()
                .contains("write_order"),
            "the last good rule set holds on {url}"
        );
    }
}
