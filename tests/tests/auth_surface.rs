//! Rules for resources and prompts: once a service's rule set names resources (or prompts),
//! a URI (a prompt) no rule grants the caller is refused and left out of its listings, on the
//! service's own route and through `/mcp` alike, and a URI that could resolve past its grant
//! (`../`) passes only a rule for every URI. Real etcd, toolgate-xds, Envoy verifying tokens
//! of a local issuer, the reference everything-server unchanged.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::mcp::Reply;
use toolgate_tests::stack::ADMIN_TOKEN;
use toolgate_tests::{
    free_port, wait_until, Issuer, McpSession, Registrant, ServerCommand, Stack, TestEnv,
};

const STATIC: &str = "demo://resource/static/document/architecture.md";
const DYNAMIC: &str = "demo://resource/dynamic/text/1";
/// The filter's JSON-RPC code for a request no rule grants.
const NOT_AUTHORIZED: i64 = -32003;

async fn put(stack: &Stack, path: &str, body: &Value) {
    let resp = reqwest::Client::new()
        .put(format!("{}{path}", stack.xds.admin_url()))
        .bearer_auth(ADMIN_TOKEN)
        .json(body)
        .send()
        .await
        .expect("admin API");
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    assert!(status.is_success(), "PUT {path}: {status} {text}");
}

/// The `reason` of a refusal, or `None` when the request was answered by the server.
fn refusal(r: &Reply) -> Option<String> {
    let error = r.message.as_ref()?.get("error")?;
    assert_eq!(error["code"], NOT_AUTHORIZED, "{}", r.body);
    Some(error["data"]["reason"].as_str().unwrap_or("?").to_string())
}

/// The strings at `field` of the listing `member` of a result.
fn listed(r: &Reply, member: &str, field: &str) -> Vec<String> {
    r.result()
        .and_then(|v| v[member].as_array().cloned())
        .unwrap_or_else(|| panic!("a {member} listing: {}", r.body))
        .iter()
        .filter_map(|v| v[field].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn resource_and_prompt_rules_hold_on_a_service_route_and_through_one_url() {
    let env = TestEnv::new("auth_surface");
    let issuer = Issuer::start().await;
    let stack = Stack::start(&env).await;
    let cmd = ServerCommand::everything(free_port());
    let _server = cmd.spawn(&env, "ev");
    let _registrar = Registrant::new(&stack.etcd.endpoint(), "ev", &cmd.endpoint())
        .arg("--instance-id", "ev-1")
        .arg("--probe", "mcp")
        .spawn(&env, "ev.registrar");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(30))
        .await;
    let service = stack.url("ev");
    let one_url = stack.aggregate_url();
    let base = service.trim_end_matches("/mcp/ev").to_string();
    put(
        &stack,
        "/v1/auth/config",
        &json!({
            "resource": base,
            "authorization_servers": [issuer.issuer()],
            "issuers": [{"issuer": issuer.issuer(),
                         "jwks": {"remote": {"uri": issuer.jwks_uri(), "cache_secs": 1}}}],
            "required": ["*"]
        }),
    )
    .await;
    put(
        &stack,
        "/v1/auth/rules/ev",
        &json!({"rules": [
            {"tools": ["*"], "subjects": ["*"]},
            {"resources": ["demo://resource/static/*"], "subjects": ["*"]},
            {"resources": ["demo://resource/dynamic/*"], "roles": ["staff"]},
            {"prompts": ["simple-prompt"], "subjects": ["*"]},
            {"prompts": ["*"], "roles": ["staff"]}
        ]}),
    )
    .await;
    stack
        .wait_filter_config("the resource and prompt rules", |c| {
            c["auth"]["services"]["ev"]["rules"][1]["resources"][0] == "demo://resource/static/*"
        })
        .await;
    let alice = issuer.token().sub("alice").aud(&base).sign();
    let bob = issuer.token().sub("bob").aud(&base).roles(["staff"]).sign();
    wait_until(
        "a token is accepted (JWKS fetched)",
        Duration::from_secs(20),
        || async {
            let mut s = McpSession::unconnected(&service);
            s.bearer = Some(alice.clone());
            s.initialize().await.status == StatusCode::OK
        },
    )
    .await;

    let mut failures = Vec::new();
    // On `/mcp` the prompts carry the service's prefix.
    for (url, prefix) in [(service.as_str(), ""), (one_url.as_str(), "ev__")] {
        let prompt_of = |p: &str| format!("{prefix}{p}");
        let mut a = McpSession::connect_with_token(url, &alice).await;
        let mut b = McpSession::connect_with_token(url, &bob).await;
        let read = |uri: &str| json!({"uri": uri});
        let checks: Vec<(&str, Reply, Option<&str>)> = vec![
            (
                "alice reads a static document",
                a.request("resources/read", read(STATIC)).await,
                None,
            ),
            (
                "alice reads a dynamic resource",
                a.request("resources/read", read(DYNAMIC)).await,
                Some("resource_denied"),
            ),
            (
                "alice climbs out of the static documents",
                a.request(
                    "resources/read",
                    read("demo://resource/static/../dynamic/text/1"),
                )
                .await,
                Some("resource_denied"),
            ),
            (
                "alice subscribes to a dynamic resource",
                a.request("resources/subscribe", read(DYNAMIC)).await,
                Some("resource_denied"),
            ),
            (
                "bob reads a dynamic resource",
                b.request("resources/read", read(DYNAMIC)).await,
                None,
            ),
            (
                "alice gets simple-prompt",
                a.request("prompts/get", json!({"name": prompt_of("simple-prompt")}))
                    .await,
                None,
            ),
            (
                "alice gets args-prompt",
                a.request(
                    "prompts/get",
                    json!({"name": prompt_of("args-prompt"), "arguments": {"city": "Paris"}}),
                )
                .await,
                Some("prompt_denied"),
            ),
            (
                "alice completes an argument of completable-prompt",
                a.request(
                    "completion/complete",
                    json!({"ref": {"type": "ref/prompt", "name": prompt_of("completable-prompt")},
                           "argument": {"name": "department", "value": "E"}}),
                )
                .await,
                Some("prompt_denied"),
            ),
            (
                "bob gets args-prompt",
                b.request(
                    "prompts/get",
                    json!({"name": prompt_of("args-prompt"), "arguments": {"city": "Paris"}}),
                )
                .await,
                None,
            ),
        ];
        for (what, reply, expected) in checks {
            let got = refusal(&reply);
            if reply.status != StatusCode::OK || got.as_deref() != expected {
                failures.push(format!(
                    "{url}: {what}: expected {expected:?}, got {} {:?}: {}",
                    reply.status, got, reply.body
                ));
            }
        }
        // Listings show alice only what she may read or get; bob sees the dynamic template.
        let resources = listed(
            &a.request("resources/list", json!({})).await,
            "resources",
            "uri",
        );
        if resources.is_empty() || resources.iter().any(|u| !u.contains("/static/")) {
            failures.push(format!("{url}: alice's resources: {resources:?}"));
        }
        let templates = |r: &Reply| listed(r, "resourceTemplates", "uriTemplate");
        let hers = templates(&a.request("resources/templates/list", json!({})).await);
        let his = templates(&b.request("resources/templates/list", json!({})).await);
        if hers.iter().any(|t| t.contains("/dynamic/"))
            || !his.iter().any(|t| t.contains("/dynamic/"))
        {
            failures.push(format!("{url}: templates: alice {hers:?}, bob {his:?}"));
        }
        let prompts = listed(
            &a.request("prompts/list", json!({})).await,
            "prompts",
            "name",
        );
        if prompts != [prompt_of("simple-prompt")] {
            failures.push(format!("{url}: alice's prompts: {prompts:?}"));
        }
        let all = listed(
            &b.request("prompts/list", json!({})).await,
            "prompts",
            "name",
        );
        if !all.contains(&prompt_of("args-prompt")) {
            failures.push(format!("{url}: bob's prompts: {all:?}"));
        }
    }
    if !failures.is_empty() {
        env.print_failure_logs();
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // Counted per service and reason.
    let text = stack.envoy.prometheus().await;
    for reason in ["resource_denied", "prompt_denied"] {
        assert!(
            text.lines().any(|l| l.starts_with("toolgate_auth_denied{")
                && l.contains("service=\"ev\"")
                && l.contains(&format!("reason=\"{reason}\""))),
            "no toolgate_auth_denied for {reason}"
        );
    }
}
