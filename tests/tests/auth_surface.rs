//! Rules for resources and prompts: once a service's rule set names resources (or prompts),
//! a URI (a prompt) no rule grants the caller is refused and left out of its listings, on the
//! service's own route and through `/mcp` alike, and a URI that could resolve past its grant
//! (`../`) passes only a rule for every URI. Real etcd, toolgate-xds, Envoy verifying tokens
//! of a local issuer, the reference everything-server unchanged.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::mcp::Reply;
use toolgate_tests::{wait_until, Issuer, McpSession, Stack, TestEnv};

const STATIC: &str = "demo://resource/static/document/architecture.md";
const DYNAMIC: &str = "demo://resource/dynamic/text/1";
/// The filter's JSON-RPC code for a request no rule grants.
const NOT_AUTHORIZED: i64 = -32003;

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

/// The everything-server behind a gateway whose every route needs a token of `issuer`, with
/// `rules` for `ev`; its route, `/mcp`, and the gateway's base URL.
struct Secured {
    stack: Stack,
    issuer: Issuer,
    service: String,
    one_url: String,
    base: String,
    _server: toolgate_tests::Proc,
    _registrar: toolgate_tests::Proc,
}

async fn secured(env: &TestEnv, rules: Value) -> Secured {
    let issuer = Issuer::start().await;
    let stack = Stack::start(env).await;
    let (server, registrar) = stack.everything(env, "ev", None).await;
    let service = stack.url("ev");
    let one_url = stack.aggregate_url();
    let base = stack.base_url();
    stack
        .admin_put("/v1/auth/config", &issuer.auth_config(&base, json!(["*"])))
        .await;
    stack.admin_put("/v1/auth/rules/ev", &rules).await;
    let first = rules["rules"][0].clone();
    stack
        .wait_filter_config("the rules", |c| {
            c["auth"]["services"]["ev"]["rules"][0] == first
        })
        .await;
    let s = Secured {
        stack,
        issuer,
        service,
        one_url,
        base,
        _server: server,
        _registrar: registrar,
    };
    let token = s.issuer.token().sub("probe").aud(&s.base).sign();
    wait_until(
        "a token is accepted (JWKS fetched)",
        Duration::from_secs(20),
        || async {
            let mut c = McpSession::unconnected(&s.service);
            c.bearer = Some(token.clone());
            c.initialize().await.status == StatusCode::OK
        },
    )
    .await;
    s
}

#[tokio::test]
async fn resource_and_prompt_rules_hold_on_a_service_route_and_through_one_url() {
    let env = TestEnv::new("auth_surface");
    let s = secured(
        &env,
        json!({"rules": [
            {"tools": ["*"], "subjects": ["*"]},
            {"resources": ["demo://resource/static/*"], "subjects": ["*"]},
            {"resources": ["demo://resource/dynamic/*"], "roles": ["staff"]},
            {"prompts": ["simple-prompt"], "subjects": ["*"]},
            {"prompts": ["*"], "roles": ["staff"]}
        ]}),
    )
    .await;
    let (stack, issuer, service, one_url, base) =
        (&s.stack, &s.issuer, &s.service, &s.one_url, &s.base);
    let alice = issuer.token().sub("alice").aud(base).sign();
    let bob = issuer.token().sub("bob").aud(base).roles(["staff"]).sign();
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

/// Everything a GET stream of `/mcp` carries, as it comes, until dropped.
fn listen(
    url: &str,
    session: &str,
    token: &str,
) -> (Arc<Mutex<String>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(String::new()));
    let into = Arc::clone(&seen);
    let request = reqwest::Client::new()
        .get(url)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", session)
        .header(
            "mcp-protocol-version",
            toolgate_tests::mcp::PROTOCOL_VERSION,
        )
        .bearer_auth(token);
    let task = tokio::spawn(async move {
        let Ok(mut response) = request.send().await else {
            return;
        };
        into.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_str(&format!("HTTP {}\n", response.status()));
        while let Ok(Some(chunk)) = response.chunk().await {
            into.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&String::from_utf8_lossy(&chunk));
        }
    });
    (seen, task)
}

#[tokio::test]
async fn two_users_of_one_client_session_hear_and_cancel_only_their_own_calls() {
    let env = TestEnv::new("auth_surface_relay");
    let s = secured(
        &env,
        json!({"rules": [{"tools": ["*"], "subjects": ["*"]}]}),
    )
    .await;
    let alice = s.issuer.token().sub("alice").aud(&s.base).sign();
    let bob = s.issuer.token().sub("bob").aud(&s.base).sign();
    let a = McpSession::connect_with_token(&s.one_url, &alice).await;
    let shared = a.session.clone().expect("a gateway session");
    // Bob uses the session Alice's agent opened: the gateway holds his servers' sessions
    // apart from hers, and his servers' notifications must not reach her stream.
    let mut b = McpSession::unconnected(&s.one_url);
    b.bearer = Some(bob.clone());
    b.session = Some(shared.clone());
    let (hers, her_stream) = listen(&s.one_url, &shared, &alice);
    let (his, his_stream) = listen(&s.one_url, &shared, &bob);
    let document = "demo://resource/static/document/architecture.md";
    let subscribed = b
        .request("resources/subscribe", json!({"uri": document}))
        .await;
    assert!(subscribed.result().is_some(), "{}", subscribed.body);
    let toggled = b
        .request(
            "tools/call",
            json!({"name": "ev__toggle-subscriber-updates", "arguments": {}}),
        )
        .await;
    assert!(toggled.result().is_some(), "{}", toggled.body);
    let heard = |seen: &Arc<Mutex<String>>| {
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains("notifications/resources/updated")
    };
    let his_heard = wait_until(
        "bob's stream gets his subscription's update",
        Duration::from_secs(20),
        || async { heard(&his) },
    );
    his_heard.await;
    // One more update period: nothing of bob's reaches alice's stream.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let hers_text = hers.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        hers_text.starts_with("HTTP 200"),
        "alice's stream is open: {hers_text}"
    );
    if heard(&hers) {
        env.print_failure_logs();
    }
    assert!(!heard(&hers), "alice heard bob's server: {hers_text}");
    her_stream.abort();
    his_stream.abort();

    // Each user numbers its own requests: Alice cancelling her request 7 must not cancel
    // Bob's request 7 running on his server (and her level of logs is hers).
    let long = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "ev__trigger-long-running-operation", "arguments": {"duration": 3, "steps": 3}}});
    let his_call = tokio::spawn(async move { b.post_raw(long.to_string(), &[]).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "alice gave up on her own request 7"}});
    let cancelled = a.post_raw(cancel.to_string(), &[]).await;
    assert_eq!(cancelled.status, StatusCode::ACCEPTED, "{}", cancelled.body);
    let his = tokio::time::timeout(Duration::from_secs(15), his_call)
        .await
        .expect("bob's call ends in time")
        .expect("bob's call task");
    if !his.body.contains("Long running operation completed") {
        env.print_failure_logs();
        panic!("alice's cancellation reached bob's call: {}", his.body);
    }
}
