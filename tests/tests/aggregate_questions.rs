//! A server's own requests and a client's cancellations through one URL. The reference
//! everything-server asks its client questions during a call (elicitation, sampling): through
//! `/mcp` they reach the official Python SDK client on the call's stream, and its answers find
//! the server that asked (the filter notes who asked). A client's `notifications/cancelled` on
//! `/mcp` reaches the server running the call, which then never finishes it. The updates of a
//! resource the client subscribed to, and the log messages a server writes between calls,
//! reach the client's GET stream from the server's own. Real etcd,
//! toolgate-xds, Envoy with the filter, the everything-server unchanged.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use toolgate_tests::mcp::{open_session, post_message, send_message, text_of, PROTOCOL_VERSION};
use toolgate_tests::{sdk, wait_for, NodeClient, Sdk, Stack, TestEnv};

/// The name /mcp lists for the everything-server's tool `tool`, once it lists it.
async fn listed_name(url: &str, tool: &str) -> String {
    let (name, _) = wait_for(
        &format!("/mcp lists the everything-server's {tool}"),
        Duration::from_secs(30),
        || async move {
            let lines = sdk::python(url, &["initialize", "list"]).await;
            lines
                .iter()
                .filter(|l| l["step"] == "list")
                .flat_map(|l| l["ok"]["tools"].as_array().cloned().unwrap_or_default())
                .filter_map(|t| t["name"].as_str().map(str::to_string))
                .find(|n| n.ends_with(tool))
        },
    )
    .await;
    name
}

#[tokio::test]
async fn a_servers_questions_during_a_call_reach_the_client_and_its_answers_the_server() {
    let env = TestEnv::new("aggregate_questions");
    let stack = Stack::start(&env).await;
    let _ev = stack.everything(&env, "ev", None).await;
    let url = stack.aggregate_url();
    let elicit = listed_name(&url, "trigger-elicitation-request").await;
    let sample = listed_name(&url, "trigger-sampling-request").await;
    let eliciting = format!("call:{elicit}");
    let sampling = format!(
        "call:{sample}:{}",
        json!({"prompt": "a haiku about gateways", "maxTokens": 50})
    );
    let lines = sdk::python_with(
        &[
            "--elicit-answer",
            "blue",
            "--sample-answer",
            "quiet packets",
        ],
        &url,
        &["initialize", &eliciting, &sampling, &eliciting],
    )
    .await;
    let elicited = text_of(sdk::step_ok(&lines, &eliciting));
    assert!(
        elicited.contains("User provided the requested information") && elicited.contains("blue"),
        "the everything-server did not get the client's answer to its elicitation: {elicited}"
    );
    let sampled = text_of(sdk::step_ok(&lines, &sampling));
    assert!(
        sampled.contains("quiet packets") && sampled.contains("toolgate-test"),
        "the everything-server did not get the client's sampling answer: {sampled}"
    );
    // A client that cannot answer: the server's own answer to it, as directly (the
    // everything-server offers the tool only to clients that can).
    let lines = sdk::python_with(&["--go-on"], &url, &["initialize", &eliciting]).await;
    let refused = lines.iter().find(|l| l["step"] == eliciting.as_str());
    let refused_text = refused.map(Value::to_string).unwrap_or_default();
    assert!(
        refused_text.contains("not found") || refused_text.contains("isError\":true"),
        "a client without elicitation got no refusal: {lines:#?}"
    );

    // Two servers asking one client session at once, each under the first id of its own
    // session: the client sees two ids, and each answer reaches the server that asked.
    let _ev2 = stack.everything(&env, "ev2", None).await;
    let elicit2 = listed_name(&url, "ev2__trigger-elicitation-request").await;
    let http = reqwest::Client::new();
    let session = open_session(&http, &url, PROTOCOL_VERSION, json!({"elicitation": {}})).await;
    let mut asked = Vec::new();
    for (id, tool) in [(11, &elicit), (12, &elicit2)] {
        let (question_tx, question_rx) = tokio::sync::oneshot::channel();
        let call = tokio::spawn(call_until_answered(
            http.clone(),
            url.clone(),
            session.clone(),
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                "params": {"name": tool, "arguments": {}}}),
            question_tx,
        ));
        let question = tokio::time::timeout(Duration::from_secs(20), question_rx)
            .await
            .ok()
            .and_then(Result::ok);
        let Some(question) = question else {
            env.print_failure_logs();
            panic!("{tool} asked no question on its stream");
        };
        asked.push((tool.clone(), question, call));
    }
    assert_ne!(
        asked[0].1, asked[1].1,
        "two servers' questions share an id on one client session"
    );
    for (tool, question, call) in asked {
        let answer = json!({"jsonrpc": "2.0", "id": question, "result": {
            "action": "accept", "content": {"answer": format!("for {tool}")}}});
        let answered = post_message(&http, &url, Some(&session), Some(PROTOCOL_VERSION), &answer);
        assert_eq!(answered.await.status(), 202, "{tool}");
        let text = tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        if !text.contains(&format!("for {tool}")) {
            env.print_failure_logs();
            panic!("{tool}'s server did not get its own answer: {text}");
        }
    }
}

/// Posts `call` and reads its SSE stream: the id of the first question the server asks on it
/// goes to `question`; the whole stream once it ends (or after 30 s).
async fn call_until_answered(
    http: reqwest::Client,
    url: String,
    session: String,
    call: Value,
    question: tokio::sync::oneshot::Sender<Value>,
) -> String {
    let started = Instant::now();
    let sent = send_message(&http, &url, Some(&session), Some(PROTOCOL_VERSION), &call);
    let Ok(mut resp) = sent.await else {
        return String::new();
    };
    let mut seen = String::new();
    let mut question = Some(question);
    let deadline = started + Duration::from_secs(30);
    while let Ok(Ok(Some(chunk))) = tokio::time::timeout_at(deadline.into(), resp.chunk()).await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
        let asked = seen
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|m| m["method"] == "elicitation/create");
        if let (Some(m), Some(tx)) = (asked, question.take()) {
            let _ = tx.send(m["id"].clone());
        }
    }
    seen
}

/// Calls the long-running tool as request 7 and reads its stream for at most `read_for`:
/// what arrived, and when the stream ended (if it did).
async fn long_call(
    http: reqwest::Client,
    url: String,
    session: String,
    tool: String,
    read_for: Duration,
) -> (String, Option<Duration>) {
    let started = Instant::now();
    let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": tool, "arguments": {"duration": 3, "steps": 3}}});
    let sent = send_message(&http, &url, Some(&session), Some(PROTOCOL_VERSION), &call);
    let Ok(mut resp) = sent.await else {
        return (String::new(), None);
    };
    let mut seen = Vec::new();
    let ended = loop {
        match tokio::time::timeout_at((started + read_for).into(), resp.chunk()).await {
            Ok(Ok(Some(chunk))) => seen.extend_from_slice(&chunk),
            Ok(_) => break Some(started.elapsed()),
            Err(_) => break None,
        }
    };
    (String::from_utf8_lossy(&seen).into_owned(), ended)
}

#[tokio::test]
async fn a_call_the_client_cancels_on_mcp_is_cancelled_on_its_server() {
    let env = TestEnv::new("aggregate_cancel");
    let stack = Stack::start(&env).await;
    let _ev = stack.everything(&env, "ev", None).await;
    let url = stack.aggregate_url();
    let tool = listed_name(&url, "trigger-long-running-operation").await;
    let http = reqwest::Client::new();
    const DONE: &str = "Long running operation completed";

    // Not cancelled, the call finishes in its three seconds.
    let session = open_session(&http, &url, PROTOCOL_VERSION, json!({})).await;
    let (text, _) = long_call(
        http.clone(),
        url.clone(),
        session,
        tool.clone(),
        Duration::from_secs(10),
    )
    .await;
    if !text.contains(DONE) {
        env.print_failure_logs();
        panic!("the uncancelled call did not finish: {text}");
    }

    // Cancelled a second in, it never finishes: the server got the cancellation.
    let session = open_session(&http, &url, PROTOCOL_VERSION, json!({})).await;
    let call = tokio::spawn(long_call(
        http.clone(),
        url.clone(),
        session.clone(),
        tool,
        Duration::from_secs(8),
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "the user gave up"}});
    let status = post_message(&http, &url, Some(&session), Some(PROTOCOL_VERSION), &cancel)
        .await
        .status();
    assert_eq!(status, 202, "the cancellation was not accepted");
    let (text, _) = call.await.expect("the call's task");
    if text.contains(DONE) {
        env.print_failure_logs();
        panic!("the cancelled call ran to its end on the server: {text}");
    }
    let xds_log = std::fs::read_to_string(env.path("xds.log")).unwrap_or_default();
    assert!(
        xds_log
            .lines()
            .any(|l| l.contains("passed a client's cancellation on") && l.contains("1")),
        "toolgate-xds did not pass the cancellation on"
    );
}

#[tokio::test]
async fn a_subscription_through_one_url_brings_the_servers_updates_and_log_messages() {
    let env = TestEnv::new("aggregate_relay");
    let stack = Stack::start(&env).await;
    let _ev = stack.everything(&env, "ev", None).await;
    let url = stack.aggregate_url();
    let updates = listed_name(&url, "toggle-subscriber-updates").await;
    let logging = listed_name(&url, "toggle-simulated-logging").await;
    let document = "demo://resource/static/document/architecture.md";
    let subscribe = format!("subscribe:{document}");
    let toggle_updates = format!("call:{updates}");
    let toggle_logging = format!("call:{logging}");
    // The updates and the log messages come on the server's own stream of the session the
    // gateway holds for this client, outside any call.
    let lines = sdk::python(
        &url,
        &[
            "initialize",
            &subscribe,
            &toggle_updates,
            "notified:notifications/resources/updated",
            "notified:notifications/resources/updated",
            &toggle_logging,
            "notified:notifications/message",
        ],
    )
    .await;
    let init = sdk::step_ok(&lines, "initialize");
    assert_eq!(
        init["capabilities"]["resources"]["subscribe"], true,
        "the gateway says updates reach its clients: {init}"
    );
    let updated = sdk::step_ok(&lines, "notified:notifications/resources/updated");
    assert_eq!(updated["params"]["uri"], document, "{updated}");
    let logged = sdk::step_ok(&lines, "notified:notifications/message");
    assert!(
        logged["params"]["level"].is_string() && !logged["params"]["data"].is_null(),
        "{logged}"
    );
    // Two updates: the stream stays open between them (they come 5 s apart).
    let seen = lines
        .iter()
        .filter(|l| {
            l["step"] == "notified:notifications/resources/updated" && l.get("ok").is_some()
        })
        .count();
    assert_eq!(seen, 2, "{lines:#?}");
}

#[tokio::test]
async fn both_typescript_sdks_subscribe_through_one_url_and_hear_the_updates() {
    let env = TestEnv::new("aggregate_relay_ts");
    let stack = Stack::start(&env).await;
    let _ev = stack.everything(&env, "ev", None).await;
    let url = stack.aggregate_url();
    let updates = listed_name(&url, "toggle-subscriber-updates").await;
    let logging = listed_name(&url, "toggle-simulated-logging").await;
    let document = "demo://resource/static/document/architecture.md";
    for sdk in Sdk::ALL {
        let run = NodeClient::new(sdk)
            .timeout(Duration::from_secs(40))
            .step("resources/subscribe", json!({"uri": document}))
            .step("tools/call", json!({"name": updates, "arguments": {}}))
            .step(
                "toolgate/notified",
                json!({"method": "notifications/resources/updated"}),
            )
            .step("tools/call", json!({"name": logging, "arguments": {}}))
            .step(
                "toolgate/notified",
                json!({"method": "notifications/message"}),
            )
            .run(&url)
            .await;
        if run.exit_code != Some(0) {
            env.print_failure_logs();
        }
        assert_eq!(run.exit_code, Some(0), "{}: {}", run.sdk(), run.report);
        let caps = &run.result("connect")["capabilities"];
        assert_eq!(
            caps["resources"]["subscribe"],
            true,
            "{}: {caps}",
            run.sdk()
        );
        let heard: Vec<&Value> = run.report["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["method"] == "toolgate/notified")
            .map(|s| &s["result"])
            .collect();
        assert_eq!(heard.len(), 2, "{}: {}", run.sdk(), run.report);
        assert_eq!(heard[0]["params"]["uri"], document, "{}", run.sdk());
        assert_eq!(heard[1]["method"], "notifications/message", "{}", run.sdk());
    }
}
