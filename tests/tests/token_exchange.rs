//! Credentials per caller: a server that takes only tokens issued for it (the Python SDK
//! server requiring a bearer JWT whose `aud` is its own) answers alice and bob, each with a
//! token the identity provider issued by exchanging (RFC 8693) the caller's own; neither
//! caller's token reaches it; a refused exchange is an MCP tool result naming why, and the
//! server gets nothing.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, Issuer, McpSession, Member, Options, Stack, TestEnv};

const TTL: u32 = 10;
/// The server's own resource: the audience of the tokens it takes.
const SERVER_AUD: &str = "https://orders.example/mcp";
const CLIENT_ID: &str = "toolgate-gateway";
const CLIENT_SECRET: &str = "client-s3cret";

async fn calls(m: &Member) -> Value {
    reqwest::get(format!("{}/calls", m.server.base_url()))
        .await
        .expect("GET /calls")
        .json::<Value>()
        .await
        .expect("/calls JSON")
}

/// The requests the server received, whatever their credential.
async fn received(m: &Member) -> u64 {
    calls(m).await["authorizations"]
        .as_object()
        .map(|a| a.values().filter_map(Value::as_u64).sum())
        .unwrap_or(0)
}

async fn call(url: &str, token: &str, tool: &str) -> toolgate_tests::mcp::Reply {
    let mut s = McpSession::unconnected(url);
    s.bearer = Some(token.to_string());
    let init = s.initialize().await;
    if init.status != StatusCode::OK {
        return init;
    }
    s.call_tool(tool, json!({})).await
}

fn answered(reply: &toolgate_tests::mcp::Reply) -> bool {
    reply.status == StatusCode::OK
        && reply
            .result()
            .is_some_and(|r| r["isError"] == false && r.to_string().contains("order o-1"))
}

fn claims(token: &str) -> Value {
    token
        .split('.')
        .nth(1)
        .and_then(|p| URL_SAFE_NO_PAD.decode(p).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn each_caller_reaches_the_server_with_its_own_exchanged_token() {
    let env = TestEnv::new("token_exchange");
    let issuer = Issuer::start().await;
    issuer.register_client(CLIENT_ID, CLIENT_SECRET);
    let client_secret = env.path("client-secret");
    std::fs::write(&client_secret, format!("{CLIENT_SECRET}\n")).expect("writing the secret");
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    let base = gw.base_url();
    let aud = format!("{base}/mcp/orders");
    gw.admin_put("/v1/auth/config", &issuer.auth_config(&base, json!(["*"])))
        .await;
    let exchange = |audience: &str| {
        json!({"exchange": {
            "token_endpoint": issuer.token_endpoint(),
            "audience": audience,
            "scopes": ["orders:read"],
            "client": {"id": CLIENT_ID, "secret": format!("file:{}", client_secret.display())}
        }})
    };
    gw.admin_put("/v1/auth/upstream/orders", &exchange(SERVER_AUD))
        .await;
    let m = Member::python(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &[
            "--stateless",
            "--json-response",
            "--require-bearer-jwt-aud",
            SERVER_AUD,
        ],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    gw.wait_filter_config("orders' credential exchanged", |c| {
        c["exchanged"]["orders"].is_string() && c["auth"]["resource"] == base.as_str()
    })
    .await;
    let fingerprint = gw
        .envoy
        .filter_config()
        .await
        .expect("a filter configuration")["exchanged"]["orders"]
        .clone();

    let alice = issuer
        .token()
        .sub("alice")
        .aud(&aud)
        .scope("orders:read")
        .sign();
    let bob = issuer
        .token()
        .sub("bob")
        .aud(&aud)
        .scope("orders:read")
        .sign();
    let url = gw.url("orders");
    wait_until(
        "alice's call is answered",
        Duration::from_secs(20),
        || async { answered(&call(&url, &alice, "read_order").await) },
    )
    .await;
    let bobs = call(&url, &bob, "read_order").await;
    assert!(answered(&bobs), "bob: {}", bobs.body);

    // Warm: each further call finds its credential cached.
    let exchanged = issuer.exchanges();
    let started = Instant::now();
    let mut session = McpSession::unconnected(&url);
    session.bearer = Some(alice.clone());
    assert_eq!(session.initialize().await.status, StatusCode::OK);
    const WARM: u32 = 50;
    for _ in 0..WARM {
        let r = session.call_tool("read_order", json!({})).await;
        assert!(answered(&r), "{}", r.body);
    }
    println!(
        "{WARM} warm calls with an exchanged credential: {:?} each (end to end)",
        started.elapsed() / WARM
    );
    assert_eq!(
        issuer.exchanges(),
        exchanged,
        "a warm cache asks the identity provider nothing"
    );
    // One exchange per caller: toolgate-xds keeps them for every Envoy worker.
    assert_eq!(exchanged, 2, "alice and bob, once each");

    // What the server saw: alice's and bob's subjects, each only with the server's audience,
    // in tokens the provider issued (neither caller's own).
    let seen = calls(&m).await;
    let subjects = &seen["bearer_subjects"];
    assert_eq!(subjects["alice"], json!([SERVER_AUD]), "{seen}");
    assert_eq!(subjects["bob"], json!([SERVER_AUD]), "{seen}");
    let authorizations: BTreeSet<String> = seen["authorizations"]
        .as_object()
        .expect("an object")
        .keys()
        .cloned()
        .collect();
    for own in [&alice, &bob] {
        assert!(
            !authorizations.contains(&format!("Bearer {own}")),
            "a caller's own token reached the server"
        );
    }
    let by_subject: Vec<(String, Value)> = authorizations
        .iter()
        .filter_map(|a| a.strip_prefix("Bearer "))
        .map(|t| {
            (
                claims(t)["sub"].as_str().unwrap_or("").to_string(),
                claims(t),
            )
        })
        .collect();
    for (sub, c) in &by_subject {
        assert_eq!(c["aud"], SERVER_AUD, "{sub}: {c}");
        assert_eq!(c["act"]["sub"], CLIENT_ID, "the gateway acted: {c}");
        assert_eq!(c["iss"], issuer.issuer());
    }
    let subs: BTreeSet<&str> = by_subject.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(subs, BTreeSet::from(["alice", "bob"]), "{by_subject:?}");

    // Refused: the provider issues nothing for another audience. The agent is told why in a
    // tool result; the server gets nothing.
    const REFUSED_AUD: &str = "https://refused.example/mcp";
    issuer.refuse_target(REFUSED_AUD);
    gw.admin_put("/v1/auth/upstream/orders", &exchange(REFUSED_AUD))
        .await;
    // A new configuration: the filters forget what they cached.
    gw.wait_filter_config("the new exchange", |c| {
        c["exchanged"]["orders"].is_string() && c["exchanged"]["orders"] != fingerprint
    })
    .await;
    let before = received(&m).await;
    let refusals = issuer.exchange_refusals();
    let reply = wait_until_value(
        "the exchange for the new audience is refused",
        Duration::from_secs(20),
        || async {
            // The server is stateless: the call needs no `initialize` first.
            let mut s = McpSession::unconnected(&url);
            s.bearer = Some(alice.clone());
            let r = s.call_tool("read_order", json!({})).await;
            let refused = r.result().is_some_and(|v| v["isError"] == true);
            refused.then_some(r)
        },
    )
    .await;
    let result = reply.result().expect("a result");
    let text = result["content"][0]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("the identity provider refused to issue a token for orders: invalid_target"),
        "{text}"
    );
    assert_eq!(
        result["_meta"]["io.toolgate/breaker"]["state"], "no_credential",
        "{result}"
    );
    assert!(issuer.exchange_refusals() > refusals);
    assert_eq!(received(&m).await, before, "nothing reached the server");
}

async fn wait_until_value<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
