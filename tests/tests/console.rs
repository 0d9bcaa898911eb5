//! The operator console (`/ui/` on toolgate-xds's admin listener) in a real browser: headless
//! Chromium over WebDriver, against etcd, toolgate-xds, Envoy with the filter and lab servers.
//! Screenshots of each state are left in `tests/logs/console/` as artifacts.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::json;
use toolgate_tests::{wait_until, Browser, Envoy, Etcd, McpSession, Member, TestEnv, Xds};

const TOKEN: &str = "console-test-token";
const TTL: u32 = 10;
/// How long the page may take to show a change: it polls every second.
const SHOWN: Duration = Duration::from_secs(10);

#[tokio::test]
async fn the_console_shows_the_fleet_live_and_cuts_and_restores_a_tool() {
    let env = TestEnv::new("console");
    let mut etcd = Etcd::start(&env).await;
    etcd.client()
        .await
        .put(
            "/mcp/policies/orders",
            json!({"min_calls": 5, "open_ms": 60000, "open_jitter_percent": 0}).to_string(),
            None,
        )
        .await
        .expect("policy");
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &[
            "--admin-token-env",
            "TOOLGATE_TEST_TOKEN",
            "--probe-interval",
            "500ms",
            "--probe-timeout",
            "300ms",
        ],
        &[("TOOLGATE_TEST_TOKEN", TOKEN)],
    )
    .await;
    let envoy = Envoy::start_with_filter(&env, "envoy", &xds, 1, &[]).await;
    let a = Member::start(
        &env,
        &etcd.endpoint(),
        "orders",
        "orders-1",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    let b = Member::start(
        &env,
        &etcd.endpoint(),
        "orders",
        "orders-2",
        &["--fail", "write_order=http500"],
        TTL,
    )
    .await;
    wait_until(
        "Envoy routes both instances",
        Duration::from_secs(20),
        || async { envoy.addresses("orders").await.len() == 2 },
    )
    .await;

    let browser = Browser::start(&env, 1280, 800).await;
    let page = format!("{}/ui/", xds.admin_url());
    browser.client.goto(&page).await.expect("open the console");

    // 1. Services and instances, live.
    for id in ["orders-1", "orders-2"] {
        browser
            .wait_css(
                "instance listed UP",
                &format!("#instances tr[data-instance='{id}'][data-state='UP']"),
                SHOWN,
            )
            .await;
    }
    browser
        .wait_css(
            "tools listed",
            "#tools tr[data-tool='write_order'][data-breaker='closed']",
            SHOWN,
        )
        .await;
    browser.screenshot("1-fleet").await;

    // 2. A frozen instance turns SUSPECT without a reload; sorting by state puts it first.
    b.server.proc.signal(Signal::SIGSTOP);
    let row = browser
        .wait_css(
            "frozen instance SUSPECT",
            "#instances tr[data-instance='orders-2'][data-state='SUSPECT']",
            SHOWN,
        )
        .await;
    let text = row.text().await.unwrap_or_default();
    assert!(
        text.contains("SUSPECT"),
        "the state is written out, not only coloured: {text}"
    );
    browser
        .click(
            "state header",
            "#instances th button[data-sort='state']",
            SHOWN,
        )
        .await;
    let first = browser
        .wait_css("sorted", "#instances tbody tr:first-child", SHOWN)
        .await;
    assert_eq!(
        first.attr("data-state").await.ok().flatten().as_deref(),
        Some("SUSPECT"),
        "sorted by state, the worst first"
    );
    browser.screenshot("2-suspect").await;
    b.server.proc.signal(Signal::SIGCONT);

    // 3. Without a token, force open shows the 401 and changes nothing.
    let force_open = "#tools button[aria-label='Force open orders/read_order']";
    browser.click("force open button", force_open, SHOWN).await;
    browser
        .wait_css("dialog", "#confirm[open] #reason", SHOWN)
        .await
        .send_keys("maintenance of the order DB")
        .await
        .expect("type reason");
    browser.click("confirm", "#confirm-ok", SHOWN).await;
    let error = browser
        .wait_css("401 shown", "#confirm-error:not([hidden])", SHOWN)
        .await;
    let message = error.text().await.unwrap_or_default();
    assert!(message.contains("401"), "{message}");
    browser.screenshot("3-no-token").await;
    browser.click("cancel", "#confirm-cancel", SHOWN).await;
    let overrides: serde_json::Value = reqwest::get(format!("{}/v1/overrides", xds.admin_url()))
        .await
        .expect("GET overrides")
        .json()
        .await
        .expect("JSON");
    assert_eq!(overrides["overrides"], json!([]), "nothing changed");

    // 4. With the token: force open reaches the gateway with the reason; lifting restores.
    browser
        .css("#token")
        .await
        .expect("token field")
        .send_keys(TOKEN)
        .await
        .expect("type token");
    browser.click("use", "#token-use", SHOWN).await;
    browser.click("force open", force_open, SHOWN).await;
    browser
        .wait_css("dialog", "#confirm[open] #reason", SHOWN)
        .await
        .send_keys("maintenance of the order DB")
        .await
        .expect("type reason");
    browser
        .css("#author")
        .await
        .expect("author")
        .send_keys("console test")
        .await
        .expect("type author");
    browser.click("confirm", "#confirm-ok", SHOWN).await;
    browser
        .wait_css(
            "override shown",
            "#tools tr[data-tool='read_order'][data-override='force_open']",
            SHOWN,
        )
        .await;
    let url = envoy.url("orders");
    wait_until("the gateway answers with the reason", SHOWN, || async {
        let mut s = McpSession::connect(&url).await;
        s.call_tool("read_order", json!({}))
            .await
            .text()
            .contains("maintenance of the order DB")
    })
    .await;
    browser.screenshot("4-forced-open").await;
    browser
        .click(
            "lift button",
            "#tools button[aria-label='Lift the override on orders/read_order']",
            SHOWN,
        )
        .await;
    browser
        .click("dialog", "#confirm[open] #confirm-ok", SHOWN)
        .await;
    browser
        .wait_css(
            "override gone",
            "#tools tr[data-tool='read_order'][data-override='']",
            SHOWN,
        )
        .await;
    wait_until("calls flow again", SHOWN, || async {
        let mut s = McpSession::connect(&url).await;
        s.call_tool("read_order", json!({}))
            .await
            .breaker_state()
            .is_none()
    })
    .await;

    // 5. A breaker opened by failing calls shows as open, with its expiry and who opened it.
    let mut s = McpSession::connect(&url).await;
    for _ in 0..20 {
        if s.call_tool("write_order", json!({}))
            .await
            .breaker_state()
            .as_deref()
            == Some("open")
        {
            break;
        }
    }
    let row = browser
        .wait_css(
            "breaker open",
            "#tools tr[data-tool='write_order'][data-breaker='open']",
            SHOWN,
        )
        .await;
    let text = row.text().await.unwrap_or_default();
    assert!(
        text.contains("OPEN") && text.contains("until") && text.contains("opened by"),
        "{text}"
    );
    browser.screenshot("5-breaker-open").await;

    // 6. The filter box narrows both tables.
    browser
        .css("#filter")
        .await
        .expect("filter")
        .send_keys("write")
        .await
        .expect("type filter");
    wait_until("only write_order listed", SHOWN, || async {
        browser.count("#tools tbody tr[data-tool]").await == 1
    })
    .await;
    browser
        .css("#filter")
        .await
        .expect("filter")
        .clear()
        .await
        .expect("clear filter");

    // 7. etcd gone: said loudly, and the last known state stays on the page.
    etcd.kill();
    browser.wait_css("etcd alert", "#alert-etcd", SHOWN).await;
    assert_eq!(
        browser.count("#instances tbody tr[data-instance]").await,
        2,
        "last known state kept"
    );
    browser.screenshot("6-etcd-down").await;

    // 8. A narrow window still shows states and actions.
    browser
        .client
        .set_window_size(480, 900)
        .await
        .expect("resize");
    browser
        .wait_css("actions on a narrow window", force_open, SHOWN)
        .await;
    browser.screenshot("7-narrow").await;

    browser.close().await;
    drop((a, b));
}
