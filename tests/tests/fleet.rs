//! One fleet: breaker openings, operator overrides and policies shared by every gateway
//! through etcd. One etcd, two (or three) toolgate-xds, two Envoys with the filter, lab
//! servers.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, Envoy, Etcd, McpSession, Member, Reply, TestEnv, Xds};

const TTL: u32 = 10;
const TOKEN: &str = "fleet-test-token";

struct Gateway {
    xds: Xds,
    envoy: Envoy,
}

impl Gateway {
    async fn start(env: &TestEnv, name: &str, etcd: &Etcd) -> Gateway {
        let xds = Xds::start_with_env(
            env,
            &format!("{name}.xds"),
            &etcd.endpoint(),
            &["--admin-token-env", "TOOLGATE_TEST_TOKEN"],
            &[("TOOLGATE_TEST_TOKEN", TOKEN)],
        )
        .await;
        let envoy = Envoy::start_with_filter(env, &format!("{name}.envoy"), &xds, 1, &[]).await;
        Gateway { xds, envoy }
    }

    async fn routes(&self, service: &str, m: &Member) {
        self.envoy
            .wait_addresses(service, &[m.server.endpoint()], Duration::from_secs(20))
            .await;
    }

    async fn call(&self, service: &str, tool: &str) -> Reply {
        let mut s = McpSession::connect(&self.envoy.url(service)).await;
        s.call_tool(tool, json!({})).await
    }

    /// The ECDS configuration this Envoy applied (the filter's plugin configuration).
    async fn filter_config(&self) -> String {
        reqwest::get(format!(
            "{}/config_dump?resource=ecds_filters",
            self.envoy.admin_url()
        ))
        .await
        .expect("config_dump")
        .text()
        .await
        .unwrap_or_default()
    }

    async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let client = reqwest::Client::new();
        let mut req = client.request(method, format!("{}{path}", self.xds.admin_url()));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("admin request");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }
}

/// Whether `gw`'s toolgate-xds itself (not its Envoy) holds the override on `service/tool`.
async fn lists_override(gw: &Gateway, service: &str, tool: &str, reason: &str) -> bool {
    let (_, listed) = gw
        .admin(reqwest::Method::GET, "/v1/overrides", None, None)
        .await;
    listed["overrides"].as_array().is_some_and(|l| {
        l.iter().any(|o| {
            o["service"] == service
                && o["tool"] == tool
                && o["mode"] == "force_open"
                && o["reason"] == reason
        })
    })
}

async fn breaker_keys(etcd: &Etcd) -> Vec<(String, String)> {
    let mut c = etcd.client().await;
    let resp = c
        .get(
            "/mcp/breakers/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get breakers");
    resp.kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap_or_default().to_string(),
                kv.value_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Two gateways on one etcd, and `flt` routed by both: a lab whose `write_order` fails with
/// HTTP 500, under a policy that opens after 5 calls for `open_ms` (no jitter).
async fn failing_behind_two(env: &TestEnv, open_ms: u64) -> (Etcd, Gateway, Gateway, Member) {
    let etcd = Etcd::start(env).await;
    let mut c = etcd.client().await;
    c.put(
        "/mcp/policies/flt",
        json!({"min_calls": 5, "open_ms": open_ms, "open_jitter_percent": 0}).to_string(),
        None,
    )
    .await
    .expect("policy");
    let a = Gateway::start(env, "a", &etcd).await;
    let b = Gateway::start(env, "b", &etcd).await;
    let m = Member::start(
        env,
        &etcd.endpoint(),
        "flt",
        "flt-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    a.routes("flt", &m).await;
    b.routes("flt", &m).await;
    (etcd, a, b, m)
}

#[tokio::test]
async fn a_breaker_opened_on_one_gateway_protects_the_other_and_both_close_after_recovery() {
    let env = TestEnv::new("fleet_breaker");
    let (etcd, a, b, m) = failing_behind_two(&env, 3000).await;

    // Fail through A until A's own breaker opens.
    let mut opened = None;
    for _ in 0..20 {
        let r = a.call("flt", "write_order").await;
        if r.breaker_state().as_deref() == Some("open") {
            opened = Some(Instant::now());
            break;
        }
    }
    let opened = opened.expect("A's breaker never opened");
    let calls_at_open = m.server.calls("write_order").await;
    wait_until(
        "B's Envoy has the fleet opening",
        Duration::from_secs(5),
        || async { b.filter_config().await.contains("opened_by") },
    )
    .await;
    let took = opened.elapsed();
    println!(
        "A's breaker open -> B's Envoy configured with it: {} ms (an upper bound: includes polling)",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(1), "took {took:?}");
    let r = b.call("flt", "write_order").await;
    assert_eq!(r.breaker_state().as_deref(), Some("open"), "{}", r.body);
    assert_eq!(
        m.server.calls("write_order").await,
        calls_at_open,
        "B rejected without any call of its own reaching the tool"
    );
    assert_eq!(
        b.envoy.stat("toolgate_failures").await,
        0,
        "no call failed on B"
    );
    let keys = breaker_keys(&etcd).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].1.contains("a.envoy"), "opened by A: {keys:?}");
    let (status, listed) = b
        .admin(reqwest::Method::GET, "/v1/breakers", None, None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed["breakers"][0]["opened_by"], "a.envoy", "{listed}");

    // The tool recovers; once the opening expires both gateways probe and close.
    m.server.set(json!({"fail": {"write_order": "none"}})).await;
    for gw in [&a, &b] {
        wait_until(
            &format!("{} closes again", gw.envoy.name),
            Duration::from_secs(15),
            || async {
                gw.call("flt", "write_order")
                    .await
                    .breaker_state()
                    .is_none()
            },
        )
        .await;
    }
    wait_until("the fleet key is gone", Duration::from_secs(10), || async {
        breaker_keys(&etcd).await.is_empty()
    })
    .await;
}

#[tokio::test]
async fn operator_overrides_apply_everywhere_survive_restarts_and_etcd_loss() {
    let env = TestEnv::new("fleet_overrides");
    let mut etcd = Etcd::start(&env).await;
    let mut a = Gateway::start(&env, "a", &etcd).await;
    let mut b = Gateway::start(&env, "b", &etcd).await;
    let m = Member::start(&env, &etcd.endpoint(), "ovr", "ovr-1", &[], TTL).await;
    a.routes("ovr", &m).await;
    b.routes("ovr", &m).await;
    assert!(a.call("ovr", "read_order").await.breaker_state().is_none());

    let reason = "maintenance of the orders database until 14:00";
    let (status, body) = a
        .admin(
            reqwest::Method::PUT,
            "/v1/overrides/ovr/read_order",
            Some(TOKEN),
            Some(json!({"mode": "force_open", "reason": reason, "author": "alice"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for gw in [&a, &b] {
        wait_until(
            &format!("{} forces read_order open", gw.envoy.name),
            Duration::from_secs(5),
            || async {
                let r = gw.call("ovr", "read_order").await;
                r.breaker_state().as_deref() == Some("forced_open") && r.text().contains(reason)
            },
        )
        .await;
    }
    let before = m.server.calls("read_order").await;
    for gw in [&a, &b] {
        let r = gw.call("ovr", "read_order").await;
        assert_eq!(
            r.breaker_state().as_deref(),
            Some("forced_open"),
            "{}",
            r.body
        );
    }
    assert_eq!(
        m.server.calls("read_order").await,
        before,
        "no forced call reached the tool"
    );
    assert!(
        a.call("ovr", "write_order").await.breaker_state().is_none(),
        "other tools unaffected"
    );
    let (_, listed) = b
        .admin(reqwest::Method::GET, "/v1/overrides", None, None)
        .await;
    assert_eq!(listed["overrides"][0]["reason"], reason, "{listed}");
    assert_eq!(listed["overrides"][0]["author"], "alice", "{listed}");

    // A restarted toolgate-xds reads it back from etcd. Its Envoy keeps the last filter
    // configuration it was sent whatever the restarted process knows, so ask the process.
    b.xds.restart(&env).await;
    wait_until(
        "the restarted b.xds lists the override (from etcd)",
        Duration::from_secs(10),
        || async { lists_override(&b, "ovr", "read_order", reason).await },
    )
    .await;
    let r = b.call("ovr", "read_order").await;
    assert_eq!(
        r.breaker_state().as_deref(),
        Some("forced_open"),
        "{}",
        r.body
    );

    // etcd gone: both keep the override, even across a restart (from the state dir). The
    // state dir is written a moment after a change: wait until a's has the override.
    let state = env.path("a.xds.state").join("registry.json");
    wait_until(
        "a.xds's state dir holds the override",
        Duration::from_secs(10),
        || async {
            std::fs::read_to_string(&state)
                .is_ok_and(|s| s.contains("/mcp/overrides/ovr/read_order"))
        },
    )
    .await;
    etcd.kill();
    a.xds.restart(&env).await;
    wait_until(
        "the restarted a.xds serves its state-dir snapshot",
        Duration::from_secs(15),
        || async { a.xds.log().contains("serving the state-dir snapshot") },
    )
    .await;
    assert!(
        lists_override(&a, "ovr", "read_order", reason).await,
        "a.xds restored the override from its state dir: {}",
        a.admin(reqwest::Method::GET, "/v1/overrides", None, None)
            .await
            .1
    );
    // An Envoy that connects only now has nothing but what the restarted a.xds sends it.
    let fresh = Envoy::start_with_filter(&env, "a.envoy-fresh", &a.xds, 1, &[]).await;
    wait_until(
        "a fresh Envoy on the restarted a.xds forces read_order open",
        Duration::from_secs(15),
        || async {
            if fresh.addresses("ovr").await.is_empty() {
                return false;
            }
            let mut s = McpSession::connect(&fresh.url("ovr")).await;
            let r = s.call_tool("read_order", json!({})).await;
            r.breaker_state().as_deref() == Some("forced_open") && r.text().contains(reason)
        },
    )
    .await;
    drop(fresh);
    for gw in [&a, &b] {
        let r = gw.call("ovr", "read_order").await;
        assert_eq!(
            r.breaker_state().as_deref(),
            Some("forced_open"),
            "{}",
            r.body
        );
    }
    etcd.restart(&env).await;

    let (status, body) = b
        .admin(
            reqwest::Method::DELETE,
            "/v1/overrides/ovr/read_order",
            Some(TOKEN),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for gw in [&a, &b] {
        wait_until(
            &format!("{} lets read_order through again", gw.envoy.name),
            Duration::from_secs(10),
            || async { gw.call("ovr", "read_order").await.breaker_state().is_none() },
        )
        .await;
    }
    assert!(m.server.calls("read_order").await > before);
}

#[tokio::test]
async fn admin_changes_need_the_token_and_a_refused_one_changes_nothing() {
    let env = TestEnv::new("fleet_token");
    let etcd = Etcd::start(&env).await;
    let a = Gateway::start(&env, "a", &etcd).await;
    let body = json!({"mode": "force_open", "reason": "test"});
    let revision = etcd.revision().await;
    let put = reqwest::Method::PUT;
    let cases = [
        (None, StatusCode::UNAUTHORIZED),
        (Some("wrong-token"), StatusCode::FORBIDDEN),
    ];
    for (token, want) in cases {
        let (status, resp) = a
            .admin(
                put.clone(),
                "/v1/overrides/svc/tool",
                token,
                Some(body.clone()),
            )
            .await;
        assert_eq!(status, want, "{resp}");
        assert!(
            resp["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{resp}"
        );
        let (status, _) = a
            .admin(
                put.clone(),
                "/v1/policies/svc",
                token,
                Some(json!({"min_calls": 3})),
            )
            .await;
        assert_eq!(status, want);
        let (status, _) = a
            .admin(
                reqwest::Method::DELETE,
                "/v1/overrides/svc/tool",
                token,
                None,
            )
            .await;
        assert_eq!(status, want);
    }
    // Bad input with the right token: 400 with the reason, nothing written.
    for (path, bad, says) in [
        (
            "/v1/policies/svc",
            json!({"failure_rate_percent": 0}),
            "failure_rate_percent",
        ),
        (
            "/v1/policies/svc/t",
            json!({"min_calls": "many"}),
            "min_calls",
        ),
        (
            "/v1/overrides/svc/tool",
            json!({"mode": "sideways", "reason": "x"}),
            "mode",
        ),
        (
            "/v1/overrides/svc/tool",
            json!({"mode": "force_open", "reason": " "}),
            "reason",
        ),
        (
            "/v1/overrides/s%20v/tool",
            json!({"mode": "force_open", "reason": "x"}),
            "service",
        ),
    ] {
        let (status, resp) = a.admin(put.clone(), path, Some(TOKEN), Some(bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {resp}");
        assert!(
            resp["error"].as_str().unwrap_or("").contains(says),
            "{path}: {resp}"
        );
    }
    assert_eq!(
        etcd.revision().await,
        revision,
        "nothing refused reached etcd"
    );

    // A toolgate-xds without a token refuses every change and says why. It registers its own
    // admin listener in etcd as it starts: the revision to compare with is the one after that.
    let bare = Xds::start(&env, "bare.xds", &etcd.endpoint(), &[]).await;
    let members = || async {
        let mut c = etcd.client().await;
        c.get(
            "/mcp/xds/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .map(|r| r.kvs().len())
        .unwrap_or(0)
    };
    wait_until(
        "the bare toolgate-xds registered",
        Duration::from_secs(10),
        || async { members().await == 2 },
    )
    .await;
    let revision = etcd.revision().await;
    let resp = reqwest::Client::new()
        .put(format!("{}/v1/overrides/svc/tool", bare.admin_url()))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .expect("put");
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let text = resp.text().await.unwrap_or_default();
    assert!(text.contains("disabled"), "{text}");
    assert_eq!(etcd.revision().await, revision);

    // And the right token works.
    let (status, _) = a
        .admin(put, "/v1/overrides/svc/tool", Some(TOKEN), Some(body))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(etcd.revision().await > revision);
}

#[tokio::test]
async fn a_policy_change_reaches_both_gateways_and_keeps_an_open_breaker_open() {
    let env = TestEnv::new("fleet_policy");
    let etcd = Etcd::start(&env).await;
    let a = Gateway::start(&env, "a", &etcd).await;
    let b = Gateway::start(&env, "b", &etcd).await;
    let m = Member::start(
        &env,
        &etcd.endpoint(),
        "pol",
        "pol-1",
        &[
            "--fail",
            "write_order=http500",
            "--fail",
            "read_order=http500",
        ],
        TTL,
    )
    .await;
    a.routes("pol", &m).await;
    b.routes("pol", &m).await;
    // Open write_order (10 failures by default) and keep it open through a policy change.
    let put = |path: &'static str, body: Value| {
        let a = &a;
        async move {
            a.admin(reqwest::Method::PUT, path, Some(TOKEN), Some(body))
                .await
        }
    };
    let (status, body) = put("/v1/policies/pol/write_order", json!({"open_ms": 60000})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_until(
        "A has the write_order policy",
        Duration::from_secs(5),
        || async { a.filter_config().await.contains("60000") },
    )
    .await;
    let mut open = false;
    for _ in 0..15 {
        if a.call("pol", "write_order")
            .await
            .breaker_state()
            .as_deref()
            == Some("open")
        {
            open = true;
            break;
        }
    }
    assert!(open, "write_order opened on A");

    // Lower read_order's threshold to 3 calls, through the admin API of A.
    let (status, body) = put("/v1/policies/pol/read_order", json!({"min_calls": 3})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for gw in [&a, &b] {
        wait_until(
            &format!("{} has the new policy", gw.envoy.name),
            Duration::from_secs(5),
            || async { gw.filter_config().await.contains("min_calls\\\":3") },
        )
        .await;
    }
    // On B, the 4th call is refused: three failures opened it under the new policy.
    let mut states = Vec::new();
    for _ in 0..4 {
        states.push(b.call("pol", "read_order").await.breaker_state());
    }
    assert_eq!(
        states,
        vec![
            Some("upstream_failure".to_string()),
            Some("upstream_failure".to_string()),
            Some("upstream_failure".to_string()),
            Some("open".to_string()),
        ]
    );
    // write_order's breaker on A stayed open through both changes.
    assert_eq!(
        a.call("pol", "write_order")
            .await
            .breaker_state()
            .as_deref(),
        Some("open")
    );
}

#[tokio::test]
async fn three_gateways_opening_one_tool_at_once_leave_one_key_and_no_echo() {
    let env = TestEnv::new("fleet_race");
    let etcd = Etcd::start(&env).await;
    let mut gateways = Vec::new();
    for i in 0..3 {
        gateways.push(Xds::start(&env, &format!("x{i}"), &etcd.endpoint(), &[]).await);
    }
    let before = etcd.revision().await;
    let client = reqwest::Client::new();
    let posts = gateways.iter().enumerate().map(|(i, x)| {
        let client = client.clone();
        let url = format!("{}/v1/breaker-events", x.admin_url());
        async move {
            client
                .post(url)
                .json(&json!({"gateway": format!("gw-{i}"), "events": [
                    {"service": "race", "tool": "t", "state": "open", "open_ms": 5000}]}))
                .send()
                .await
                .expect("post")
                .json::<Value>()
                .await
                .expect("json")
        }
    });
    let results = futures::future::join_all(posts).await;
    let written = results
        .iter()
        .filter(|r| r["events"][0]["result"] == "written")
        .count();
    assert_eq!(written, 1, "{results:?}");
    assert_eq!(breaker_keys(&etcd).await.len(), 1);
    // Every toolgate-xds learns it; reporting it again writes nothing.
    for x in &gateways {
        wait_until("fleet opening seen", Duration::from_secs(5), || async {
            x.registry().await.is_object()
                && reqwest::get(format!("{}/v1/breakers", x.admin_url()))
                    .await
                    .expect("get")
                    .json::<Value>()
                    .await
                    .expect("json")["breakers"]
                    .as_array()
                    .is_some_and(|b| b.len() == 1)
        })
        .await;
        let r: Value = client
            .post(format!("{}/v1/breaker-events", x.admin_url()))
            .json(&json!({"gateway": "late", "events": [
                {"service": "race", "tool": "t", "state": "open", "open_ms": 5000}]}))
            .send()
            .await
            .expect("post")
            .json()
            .await
            .expect("json");
        assert_eq!(r["events"][0]["result"], "already_open", "{r}");
    }
    let after = etcd.revision().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        etcd.revision().await,
        after,
        "no writes keep coming (no echo)"
    );
    assert!(
        after - before <= 2,
        "bounded writes: {} revisions",
        after - before
    );
}

/// Every override mode README.md, docs/design.md and the book's pages (`docs/src/**/*.md`:
/// the runbook, the admin API and etcd key references, ...) show in an example body
/// (`"mode": "…"`, alternatives separated by `|`), with the document it came from.
fn documented_override_modes() -> Vec<(String, String)> {
    let root = toolgate_tests::paths::workspace_root();
    let mut docs = vec![root.join("README.md"), root.join("docs/design.md")];
    docs.extend(crate::docs::book_pages());
    let mut modes = Vec::new();
    for path in docs {
        let doc = path
            .strip_prefix(&root)
            .unwrap_or(&path)
            .display()
            .to_string();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {doc}: {e}"));
        for (at, _) in text.match_indices("\"mode\":") {
            let mut rest = text[at + "\"mode\":".len()..].trim_start();
            // "force_open" | "force_closed" | …
            while let Some(quoted) = rest.strip_prefix('"') {
                let Some(end) = quoted.find('"') else { break };
                modes.push((doc.clone(), quoted[..end].to_string()));
                rest = quoted[end + 1..].trim_start();
                // A markdown table writes the `|` as `\|`.
                let rest_bar = rest.strip_prefix('\\').unwrap_or(rest);
                match rest_bar.strip_prefix('|') {
                    Some(more) => rest = more.trim_start(),
                    None => break,
                }
            }
        }
    }
    modes.sort();
    modes.dedup();
    modes
}

#[tokio::test]
async fn every_override_mode_the_documents_show_is_accepted_by_the_admin_api() {
    let env = TestEnv::new("fleet_documented_modes");
    let modes = documented_override_modes();
    println!("documented modes: {modes:?}");
    let runbook = std::fs::read_to_string(
        toolgate_tests::paths::workspace_root().join("docs/src/operations/runbook.md"),
    )
    .expect("the book's runbook, docs/src/operations/runbook.md");
    assert!(
        runbook.contains("# Runbook") && runbook.contains("\"mode\""),
        "the runbook shows an override body"
    );
    assert!(
        modes
            .iter()
            .any(|(doc, _)| doc == "docs/src/operations/runbook.md"),
        "the runbook's modes are among those tried: {modes:?}"
    );
    assert!(
        modes.iter().any(|(_, m)| m.contains("close"))
            && modes.iter().any(|(_, m)| m == "force_open"),
        "both kinds of override are documented: {modes:?}"
    );
    let etcd = Etcd::start(&env).await;
    let gw = Gateway::start(&env, "a", &etcd).await;
    for (doc, mode) in &modes {
        let (status, body) = gw
            .admin(
                reqwest::Method::PUT,
                "/v1/overrides/docs/some_tool",
                Some(TOKEN),
                Some(json!({"mode": mode, "reason": format!("as {doc} shows"), "author": "test"})),
            )
            .await;
        assert!(
            status.is_success(),
            "mode {mode:?} from {doc}: HTTP {status}: {body}"
        );
        let (status, body) = gw
            .admin(
                reqwest::Method::DELETE,
                "/v1/overrides/docs/some_tool",
                Some(TOKEN),
                None,
            )
            .await;
        assert!(
            status.is_success(),
            "lifting {mode:?}: HTTP {status}: {body}"
        );
    }
}

/// `tool` as `tools/list` shows it in the session (of a gateway's `/mcp`).
async fn mcp_listed(session: &tokio::sync::Mutex<McpSession>, tool: &str) -> Option<Value> {
    let reply = session.lock().await.list_tools().await;
    reply
        .result()?
        .get("tools")?
        .as_array()?
        .iter()
        .find(|t| t["name"] == tool)
        .cloned()
}

#[tokio::test]
async fn a_breaker_opened_on_one_gateway_is_annotated_on_the_others_mcp() {
    const LISTED: &str = "flt__write_order";
    let env = TestEnv::new("fleet_catalog");
    let (etcd, a, b, _m) = failing_behind_two(&env, 20000).await;
    let on_b = tokio::sync::Mutex::new(
        McpSession::connect(&format!("http://127.0.0.1:{}/mcp", b.envoy.port)).await,
    );
    wait_until(
        "B's /mcp lists the tool, unannotated",
        Duration::from_secs(20),
        || async {
            mcp_listed(&on_b, LISTED)
                .await
                .is_some_and(|t| t["_meta"]["io.toolgate/availability"].is_null())
        },
    )
    .await;

    // Fail through A until A's own breaker opens.
    let mut opened = None;
    for _ in 0..20 {
        let r = a.call("flt", "write_order").await;
        if r.breaker_state().as_deref() == Some("open") {
            opened = Some(Instant::now());
            break;
        }
    }
    let opened = opened.expect("A's breaker never opened");
    wait_until("A's opening is in etcd", Duration::from_secs(5), || async {
        !breaker_keys(&etcd).await.is_empty()
    })
    .await;
    let annotated = wait_until(
        "B's /mcp annotates the tool open",
        Duration::from_secs(5),
        || async {
            mcp_listed(&on_b, LISTED)
                .await
                .is_some_and(|t| t["_meta"]["io.toolgate/availability"]["state"] == "open")
        },
    )
    .await;
    let since_opening = opened.elapsed();
    println!(
        "A's opening in etcd -> B's /mcp annotates it: {} ms; A's breaker open -> annotated: {} \
         ms (upper bounds: they include polling)",
        annotated.as_millis(),
        since_opening.as_millis()
    );
    assert!(
        since_opening < Duration::from_secs(5),
        "took {since_opening:?}"
    );
    let listed = mcp_listed(&on_b, LISTED).await.expect("listed");
    let availability = &listed["_meta"]["io.toolgate/availability"];
    assert!(availability["until"].is_string(), "{listed}");
    assert!(
        listed["description"]
            .as_str()
            .is_some_and(|d| d.contains("Unavailable now")),
        "{listed}"
    );
    // The other tools of the service are not annotated.
    let echo = mcp_listed(&on_b, "flt__echo").await.expect("flt__echo");
    assert!(
        echo["_meta"]["io.toolgate/availability"].is_null(),
        "{echo}"
    );
    // Nothing was called through B: B knows it from the fleet only.
    assert_eq!(b.envoy.stat("toolgate_failures").await, 0);
}
