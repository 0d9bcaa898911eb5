//! Call limits on real processes: rules stored through the admin API, enforced by the filter
//! in a real Envoy with several workers, against a real MCP server whose own counter shows
//! what arrived.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use toolgate_tests::{wait_until, Issuer, McpSession, Member, Options, Stack, TestEnv};

const TTL: u32 = 10;

/// The availability details of a semantic reply.
fn details(reply: &toolgate_tests::mcp::Reply) -> Value {
    reply
        .result()
        .map(|r| r["_meta"]["io.toolgate/breaker"].clone())
        .unwrap_or_default()
}

/// `toolgate_limited_total{service, tool, rule}` as Envoy's Prometheus endpoint shows it.
async fn limited_total(gw: &Stack, service: &str, tool: &str, rule: &str) -> f64 {
    gw.envoy
        .prometheus()
        .await
        .lines()
        .filter(|l| l.starts_with("toolgate_limited_total{"))
        .filter(|l| {
            l.contains(&format!("service=\"{service}\""))
                && l.contains(&format!("tool=\"{tool}\""))
                && l.contains(&format!("rule=\"{rule}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_subject_over_its_tool_limit_is_refused_in_mcp_and_the_server_never_sees_the_calls() {
    let env = TestEnv::new("call_limits_subject");
    let issuer = Issuer::start().await;
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    let m = Member::start(&env, &gw.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    gw.routes("orders", &[&m]).await;
    let url = gw.url("orders");
    let base = gw.base_url();
    let aud = format!("{base}/mcp/orders");
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/auth/config",
            Some(&issuer.auth_config(&base, json!(["*"]))),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");

    // A bad rule is refused whole, naming its field; nothing is stored.
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/limits/orders/read_order",
            Some(&json!({"per": "subject", "calls": 3, "per_seconds": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("per_seconds"), "{body}");

    let rule =
        json!({"rules": [{"per": "subject", "calls": 3, "per_seconds": 6, "name": "reads"}]});
    let (status, body) = gw
        .admin(Method::PUT, "/v1/limits/orders/read_order", Some(&rule))
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("the limit of read_order", |c| {
        c["limits"]["services"]["orders"]["tools"]["read_order"][0]["name"] == "reads"
            && c["auth"]["resource"] == base.as_str()
    })
    .await;

    let token = |sub: &str| issuer.token().sub(sub).aud(&aud).sign();
    let (alice, bob) = (token("alice"), token("bob"));
    let mut a = McpSession::unconnected(&url);
    a.bearer = Some(alice.clone());
    wait_until(
        "alice's token is accepted (JWKS in force)",
        Duration::from_secs(20),
        || {
            let mut s = McpSession::unconnected(&url);
            s.bearer = Some(alice.clone());
            async move { s.initialize().await.status == StatusCode::OK }
        },
    )
    .await;
    assert_eq!(a.initialize().await.status, StatusCode::OK);
    let mut b = McpSession::connect_with_token(&url, &bob).await;

    let before = m.server.calls("read_order").await;
    let started = Instant::now();
    for i in 0..3 {
        let r = a.call_tool("read_order", json!({})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert!(
            details(&r).is_null(),
            "alice's call {i} was refused: {}",
            r.body
        );
    }
    let refused = a.call_tool("read_order", json!({})).await;
    assert_eq!(refused.status, StatusCode::OK, "{}", refused.body);
    let result = refused.result().cloned().unwrap_or_default();
    assert_eq!(result["isError"], true, "{}", refused.body);
    let d = details(&refused);
    assert_eq!(d["state"], "limited", "{}", refused.body);
    assert_eq!(d["limit"]["rule"], "reads");
    assert_eq!(d["limit"]["per"], "subject");
    let retry = d["retryAfterSeconds"].as_u64().unwrap_or(0);
    assert!(
        (1..=2).contains(&retry),
        "one token every 2 s: {}",
        refused.body
    );
    assert!(
        refused
            .text()
            .contains("limit of 3 calls per 6 seconds (rule `reads`)"),
        "{}",
        refused.text()
    );
    // Bob has his own bucket.
    for _ in 0..3 {
        let r = b.call_tool("read_order", json!({})).await;
        assert!(details(&r).is_null(), "bob was refused: {}", r.body);
    }
    // Only the admitted calls reached the server (unless a token came back meanwhile).
    let arrived = m.server.calls("read_order").await - before;
    let refills = (started.elapsed().as_secs_f64() / 2.0).floor() as u64;
    assert!(
        (6..=6 + refills).contains(&arrived),
        "{arrived} calls arrived in {:?}",
        started.elapsed()
    );
    // Counted by rule, never by subject; and not against the tool's breaker.
    wait_until(
        "toolgate_limited_total counts the refusal",
        Duration::from_secs(5),
        || async { limited_total(&gw, "orders", "read_order", "reads").await >= 1.0 },
    )
    .await;
    let prometheus = gw.envoy.prometheus().await;
    assert!(!prometheus.contains("alice"), "a metric names a subject");
    // Who is limited most is the admin API's to tell, from the filters' reports.
    wait_until(
        "GET /v1/limits names alice among the most limited",
        Duration::from_secs(5),
        || async {
            let (_, body) = gw.admin(Method::GET, "/v1/limits", None).await;
            body["top_limited"].as_array().is_some_and(|top| {
                top.iter().any(|t| {
                    t["caller"] == "subject:alice" && t["rule"] == "reads" && t["refused"] == 1
                })
            })
        },
    )
    .await;
    assert_eq!(
        gw.envoy
            .tool_stat("rejected", "orders", "read_order")
            .await
            .unwrap_or(0.0),
        0.0
    );

    // After the wait it was told, alice's call passes again.
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let again = a.call_tool("read_order", json!({})).await;
    assert!(details(&again).is_null(), "{}", again.body);

    // Lifted: no limit at all.
    let (status, body) = gw
        .admin(Method::DELETE, "/v1/limits/orders/read_order", None)
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("no limits", |c| c["limits"].is_null())
        .await;
    for _ in 0..5 {
        let r = a.call_tool("read_order", json!({})).await;
        assert!(details(&r).is_null(), "{}", r.body);
    }
}

#[tokio::test]
async fn four_workers_share_one_bucket_and_other_methods_get_429() {
    let env = TestEnv::new("call_limits_workers");
    let gw = Stack::with(&env, Options::default().concurrency(4)).await;
    let m = Member::start(&env, &gw.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    gw.routes("orders", &[&m]).await;
    let url = gw.url("orders");
    // 20 calls an hour for everyone: the test ends long before a token comes back.
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/limits/orders/read_order",
            Some(&json!({"per": "gateway", "calls": 20, "per_seconds": 3600})),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("the limit", |c| {
        c["limits"]["services"]["orders"]["tools"]["read_order"][0]["calls"] == 20
    })
    .await;

    // 100 calls from 25 clients at once, each on its own connections, so that all four
    // workers take calls.
    let before = m.server.calls("read_order").await;
    let mut tasks = Vec::new();
    for _ in 0..25 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = McpSession::connect(&url).await;
            let mut admitted = 0u64;
            for _ in 0..4 {
                let r = s.call_tool("read_order", json!({})).await;
                assert_eq!(r.status, StatusCode::OK, "{}", r.body);
                if details(&r).is_null() {
                    admitted += 1;
                } else {
                    assert_eq!(details(&r)["state"], "limited", "{}", r.body);
                }
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("client task");
    }
    let workers = gw.envoy.workers_with_connections().await;
    println!("admitted {admitted} of 100 with a bucket of 20; connections per worker {workers:?}");
    assert!(
        workers.iter().filter(|&&n| n > 0).count() >= 2,
        "the calls did not spread over workers: {workers:?}"
    );
    // The bound: the bucket (20) and what refills meanwhile (20 an hour: none).
    assert_eq!(admitted, 20, "{admitted} admitted");
    assert_eq!(m.server.calls("read_order").await - before, 20);

    // A service-wide rule counts every request; a request other than a call gets 429.
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/limits/orders",
            Some(&json!({"per": "client", "calls": 1, "per_seconds": 3600, "name": "one"})),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("the service's limit", |c| {
        c["limits"]["services"]["orders"]["rules"][0]["name"] == "one"
    })
    .await;
    let mut s = McpSession::connect(&url).await;
    let r = s.list_tools().await;
    let r = if r.status == StatusCode::OK {
        s.list_tools().await
    } else {
        r
    };
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    let error = r.message.clone().unwrap_or_default()["error"].clone();
    assert_eq!(error["data"]["limit"]["rule"], "one", "{}", r.body);
    assert!(error["data"]["retryAfterSeconds"].as_u64().unwrap_or(0) > 0);
}

/// Calls `tool` `n` times on `url` (one session); how many were admitted.
async fn admitted(url: &str, tool: &str, n: usize) -> u64 {
    let mut s = McpSession::connect(url).await;
    let mut admitted = 0;
    for _ in 0..n {
        let r = s.call_tool(tool, json!({})).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        if details(&r).is_null() {
            admitted += 1;
        } else {
            assert_eq!(details(&r)["state"], "limited", "{}", r.body);
        }
    }
    admitted
}

async fn gateways_of(envoy: &toolgate_tests::Envoy) -> Option<u64> {
    envoy.filter_config().await?["limits"]["gateways"].as_u64()
}

#[tokio::test]
async fn two_gateways_split_a_budget_and_the_survivor_takes_it_whole() {
    let env = TestEnv::new("call_limits_fleet");
    let gw = Stack::with(&env, Options::default()).await;
    let m = Member::start(&env, &gw.etcd.endpoint(), "orders", "orders-1", &[], TTL).await;
    gw.routes("orders", &[&m]).await;
    let mut second =
        toolgate_tests::Envoy::start_with_filter(&env, "envoy2", &gw.xds, 1, &[]).await;
    second
        .wait_addresses(
            "orders",
            &gw.envoy.addresses("orders").await,
            Duration::from_secs(20),
        )
        .await;
    // 20 calls an hour for the whole fleet: none comes back during the test.
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/limits/orders/read_order",
            Some(&json!({"per": "gateway", "calls": 20, "per_seconds": 3600})),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    for envoy in [&gw.envoy, &second] {
        wait_until(
            "both Envoys split the rule by 2",
            Duration::from_secs(20),
            || async { gateways_of(envoy).await == Some(2) },
        )
        .await;
    }
    let before = m.server.calls("read_order").await;
    let first = admitted(&gw.url("orders"), "read_order", 30).await;
    let other = admitted(&second.url("orders"), "read_order", 30).await;
    println!("admitted {first} + {other} of 60 with a fleet budget of 20 split by 2");
    assert_eq!((first, other), (10, 10));
    assert_eq!(m.server.calls("read_order").await - before, 20);

    // The second gateway leaves: the survivor's share becomes the whole budget, refilling
    // at the whole rate from what its bucket holds. The 20 calls the fleet made this hour
    // still count: its bucket is empty, and no call passes.
    second.kill();
    wait_until(
        "the survivor takes the whole budget",
        Duration::from_secs(20),
        || async { gateways_of(&gw.envoy).await == Some(1) },
    )
    .await;
    assert_eq!(admitted(&gw.url("orders"), "read_order", 5).await, 0);
    assert_eq!(m.server.calls("read_order").await - before, 20);
}

/// The most Envoy's heap may grow while 90,000 subjects it never saw before each get a
/// bucket, once the caches bounded by count are full (jwt_authn's 4,096 verified tokens per
/// worker, about 3.5 KB each; the filter's 256 payloads per worker): the limits' table
/// (4,096 keys of 96 bytes, about 0.6 MB with their keys) and the allocator's slack.
const FLOOD_HEAP_BOUND: u64 = 8 * 1024 * 1024;
/// Subjects that fill the caches bounded by count before the heap is measured: more than
/// jwt_authn keeps on the test's two workers.
const WARM_SUBJECTS: usize = 10_000;

#[tokio::test]
async fn a_hundred_thousand_subjects_leave_envoys_memory_within_its_bound() {
    use futures::StreamExt;
    const SUBJECTS: usize = 100_000;
    let env = TestEnv::new("call_limits_flood");
    let issuer = Issuer::start().await;
    let gw = Stack::with(&env, Options::default().concurrency(2)).await;
    let m = Member::start(
        &env,
        &gw.etcd.endpoint(),
        "orders",
        "orders-1",
        &["--stateless", "--json-response"],
        TTL,
    )
    .await;
    gw.routes("orders", &[&m]).await;
    let url = gw.url("orders");
    let base = gw.base_url();
    let aud = format!("{base}/mcp/orders");
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/auth/config",
            Some(&issuer.auth_config(&base, json!(["*"]))),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    let (status, body) = gw
        .admin(
            Method::PUT,
            "/v1/limits/orders/read_order",
            Some(&json!({"per": "subject", "calls": 5, "per_seconds": 3600})),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");
    gw.wait_filter_config("auth and the limit", |c| {
        c["auth"]["resource"] == base.as_str() && !c["limits"].is_null()
    })
    .await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(64)
        .build()
        .expect("client");
    let call = |token: String| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let resp = http
                .post(&url)
                .bearer_auth(token)
                .header("accept", "application/json, text/event-stream")
                .header("mcp-protocol-version", "2025-06-18")
                .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                    "params": {"name": "read_order", "arguments": {}}}))
                .send()
                .await
                .expect("the gateway answers");
            let status = resp.status();
            let body: Value = resp.json().await.unwrap_or_default();
            assert_eq!(status, StatusCode::OK, "{body}");
            body["result"]["_meta"]["io.toolgate/breaker"]["state"] == "limited"
        }
    };
    let token = |sub: String| {
        issuer
            .token()
            .alg(toolgate_tests::issuer::Alg::Es256)
            .sub(sub)
            .aud(&aud)
            .sign()
    };
    let warm = token("warm".into());
    wait_until("tokens are accepted", Duration::from_secs(20), || {
        let request = http
            .post(&url)
            .bearer_auth(&warm)
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
        async move {
            request
                .send()
                .await
                .is_ok_and(|r| r.status() == StatusCode::OK)
        }
    })
    .await;
    // A heavy subject uses up its bucket before the flood.
    let heavy = token("heavy".into());
    let mut refused = false;
    for _ in 0..6 {
        refused = call(heavy.clone()).await;
    }
    assert!(refused, "the heavy subject's sixth call was admitted");

    // Warm-up: the allocator, the table's first keys, the caches at their bounds.
    let cold = gw.envoy.admin().heap_allocated().await;
    let flood = |range: std::ops::Range<usize>| {
        let tokens: Vec<String> = range.map(|i| token(format!("s{i}"))).collect();
        let call = &call;
        async move {
            futures::stream::iter(tokens)
                .map(call)
                .buffer_unordered(32)
                .filter(|limited| std::future::ready(*limited))
                .count()
                .await
        }
    };
    let started = Instant::now();
    let mut limited = 0;
    for chunk in (0..WARM_SUBJECTS).step_by(4_000) {
        limited += flood(chunk..(chunk + 4_000).min(WARM_SUBJECTS)).await;
    }
    let before = gw.envoy.admin().heap_allocated().await;
    for chunk in (WARM_SUBJECTS..SUBJECTS).step_by(4_000) {
        limited += flood(chunk..(chunk + 4_000).min(SUBJECTS)).await;
    }
    let took = started.elapsed();
    let after = gw.envoy.admin().heap_allocated().await;
    println!(
        "{SUBJECTS} distinct subjects in {took:?}: Envoy's heap {cold} -> {before} bytes after \
         the first {WARM_SUBJECTS} (the caches bounded by count filled), -> {after} after the \
         rest ({:+} KiB)",
        (after as i64 - before as i64) / 1024
    );
    assert_eq!(limited, 0, "a subject seen once was refused");
    assert!(
        after <= before + FLOOD_HEAP_BOUND,
        "Envoy's heap grew from {before} to {after} bytes"
    );
    // The subject that used up its bucket is still refused: fresh buckets replace the least
    // used ones, not it.
    assert!(
        call(heavy).await,
        "the heavy subject's bucket was lost in the flood"
    );
}
