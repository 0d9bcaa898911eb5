//! Multi-round-trip results (MCP 2026-07-28) through one URL. A server that needs its client's
//! input answers a `tools/call` with `"resultType": "input_required"`, carrying
//! `inputRequests` (here an `elicitation/create` asking for a colour) and a `requestState`;
//! the client calls the same tool again with `inputResponses` and the echoed `requestState`.
//! The README: "multi-round-trip results are ordinary results and their follow-up
//! `tools/call` is routed by its tool name". Both rounds through `/mcp` reach the server that
//! asked, the first round's result comes back whole (as on the service's own route), and the
//! official Python SDK client completes the call on either route. Real etcd, toolgate-xds,
//! Envoy with the filter, the official Python SDK server (`server.py --mrtr`).

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::mcp::text_of;
use toolgate_tests::{sdk, wait_until, McpSession, Member, Reply, Stack, TestEnv};

/// The service, its tool, and the name `/mcp` gives the tool.
const SERVICE: &str = "py";
const TOOL: &str = "ask_colour";
const AGGREGATE_TOOL: &str = "py__ask_colour";
/// What the client answers.
const ANSWER: &str = "teal";

/// A 2026-07-28 `tools/call` of `tool` on `url` (no session: the client states who it is in
/// `_meta`), with `extra` params (`inputResponses`, `requestState`) beside name and arguments.
async fn modern_call(url: &str, tool: &str, who: &str, extra: Value) -> Reply {
    let mut params = json!({
        "name": tool,
        "arguments": {"who": who},
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "mrtr-test", "version": "1.0"},
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}
        }
    });
    if let (Some(params), Some(extra)) = (params.as_object_mut(), extra.as_object()) {
        params.extend(extra.clone());
    }
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params});
    McpSession::unconnected(url)
        .post_raw(
            body.to_string(),
            &[
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/call"),
                ("mcp-name", tool),
            ],
        )
        .await
}

/// Both rounds by hand on `url` (tool named `tool` there): the first round's result, which
/// must be `input_required` with the server's question and a state, and the text the second
/// round answered with.
async fn by_hand(url: &str, tool: &str, who: &str) -> (Value, String) {
    let first = modern_call(url, tool, who, json!({})).await;
    let Some(asked) = first.result().cloned() else {
        panic!("{url}: the first round has no result: {first:?}")
    };
    assert_eq!(asked["resultType"], "input_required", "{url}: {asked}");
    let question = &asked["inputRequests"]["colour"];
    assert_eq!(question["method"], "elicitation/create", "{url}: {asked}");
    assert_eq!(
        question["params"]["message"],
        format!("Which colour? ({who})"),
        "{url}: {asked}"
    );
    assert_eq!(
        question["params"]["requestedSchema"]["properties"]["answer"]["type"], "string",
        "{url}: {asked}"
    );
    let Some(state) = asked["requestState"].as_str() else {
        panic!("{url}: no requestState: {asked}")
    };
    assert!(!state.is_empty(), "{url}: {asked}");

    let second = modern_call(
        url,
        tool,
        who,
        json!({
            "inputResponses": {"colour": {"action": "accept", "content": {"answer": ANSWER}}},
            "requestState": state,
        }),
    )
    .await;
    let Some(done) = second.result() else {
        panic!("{url}: the follow-up round has no result: {second:?}")
    };
    assert_ne!(done["resultType"], "input_required", "{url}: {done}");
    assert_eq!(done["isError"], false, "{url}: {done}");
    (asked, second.text())
}

/// The official Python SDK client in mode 2026-07-28, answering every elicitation with
/// [`ANSWER`]: it lists the tools (which must include `tool`), then calls `tool`, answering
/// the input_required round itself. The texts of the final result.
async fn by_sdk(url: &str, tool: &str, who: &str) -> String {
    let call = format!("call:{tool}:{}", json!({"who": who}));
    let lines = sdk::python_with(
        &["--mode", "2026-07-28", "--elicit-answer", ANSWER],
        url,
        &["initialize", "list", &call],
    )
    .await;
    let init = sdk::step_ok(&lines, "initialize");
    assert_eq!(init["protocolVersion"], "2026-07-28", "{url}: {lines:#?}");
    let listed: Vec<&str> = sdk::step_ok(&lines, "list")["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        listed.contains(&tool),
        "{url}: {tool} not listed: {listed:?}"
    );
    let result = sdk::step_ok(&lines, &call);
    assert_eq!(result["isError"], false, "{url}: {result}");
    text_of(result)
}

/// What the tool answers `who` once the client gave [`ANSWER`] in a follow-up round.
fn answered(who: &str) -> String {
    format!("favourite colour of {who}: {ANSWER} (after input_required)")
}

#[tokio::test]
async fn a_multi_round_trip_call_and_its_follow_up_pass_through_one_url() {
    let env = TestEnv::new("aggregate_mrtr");
    let stack = Stack::start(&env).await;
    let etcd = stack.etcd.endpoint();
    let py = Member::python(&env, &etcd, SERVICE, "py-1", &["--mrtr"], 10).await;
    stack
        .wait_healthy(SERVICE, &[&py], Duration::from_secs(20))
        .await;
    let aggregate = stack.aggregate_url();
    let own = stack.url(SERVICE);
    wait_until(
        "/mcp lists py__ask_colour",
        Duration::from_secs(20),
        || async {
            let lines = sdk::python_in_mode(&aggregate, "2026-07-28", &["list"]).await;
            lines.iter().any(|l| {
                l["ok"]["tools"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["name"] == AGGREGATE_TOOL))
            })
        },
    )
    .await;

    // By hand: each round is one call of the tool on the server, the first round's result
    // the same through /mcp as on the service's own route (but for the sealed state and
    // `_meta`), and
    // the follow-up answered with what the client gave.
    let mut rounds = py.server.calls(TOOL).await;
    let (asked_own, text) = by_hand(&own, TOOL, "Ada").await;
    assert!(text.contains(&answered("Ada")), "{own}: {text}");
    assert_eq!(py.server.calls(TOOL).await, rounds + 2, "{own}");
    rounds += 2;
    let (asked_one_url, text) = by_hand(&aggregate, AGGREGATE_TOOL, "Ada").await;
    assert!(text.contains(&answered("Ada")), "{aggregate}: {text}");
    assert_eq!(py.server.calls(TOOL).await, rounds + 2, "{aggregate}");
    rounds += 2;
    assert_eq!(
        asked_one_url["inputRequests"], asked_own["inputRequests"],
        "the question changed on its way through /mcp"
    );
    // `_meta` names the server that answered, which on /mcp is the gateway.
    let without_state = |v: &Value| {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            o.remove("requestState");
            o.remove("_meta");
        }
        v
    };
    assert_eq!(
        without_state(&asked_one_url),
        without_state(&asked_own),
        "the input_required result changed on its way through /mcp"
    );

    // The official Python SDK client, which answers the input_required round itself and
    // calls again: on the service's own route, then through /mcp.
    let text = by_sdk(&own, TOOL, "Bob").await;
    assert!(text.contains(&answered("Bob")), "{own}: {text}");
    assert_eq!(py.server.calls(TOOL).await, rounds + 2, "{own}");
    rounds += 2;
    let text = by_sdk(&aggregate, AGGREGATE_TOOL, "Cy").await;
    assert!(text.contains(&answered("Cy")), "{aggregate}: {text}");
    assert_eq!(py.server.calls(TOOL).await, rounds + 2, "{aggregate}");
}
