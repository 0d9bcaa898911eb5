//! `/v1/upstream-sessions`: toolgate-xds opens sessions with a stateful server on a client's
//! behalf, with the client's own `initialize` parameters, keeps one per (owner, service),
//! leaves ended a session its live server no longer knows, moves one lost with its instance,
//! replays a message there, and deletes them when the owner's session ends. Real etcd,
//! toolgate-xds and two lab servers (rmcp, stateful).

use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};
use toolgate_tests::{wait_until, Etcd, Member, TestEnv, Xds};

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("http client")
}

fn params() -> Value {
    json!({
        "protocolVersion": "2025-06-18",
        "capabilities": {"roots": {"listChanged": true}},
        "clientInfo": {"name": "agent-7", "version": "3.1"},
    })
}

async fn post(xds: &Xds, path: &str, body: Value) -> (u16, Value) {
    let resp = http()
        .post(format!("{}{path}", xds.admin_url()))
        .json(&body)
        .send()
        .await
        .expect("POST");
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

/// The address an envelope routes to.
fn address_of(envelope: &str) -> String {
    let (addr, _) = envelope.split_once(";UV:").expect("envelope form");
    String::from_utf8(STANDARD.decode(addr).expect("base64")).expect("utf-8")
}

fn count(control: &Value, field: &str) -> u64 {
    control[field].as_u64().unwrap_or_default()
}

#[tokio::test]
async fn sessions_are_opened_for_a_client_moved_when_lost_and_deleted_with_their_owner() {
    let env = TestEnv::new("upstream_sessions_opened_moved_deleted");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(&env, "xds", &etcd.endpoint(), &[]).await;
    let mut a = Member::start(&env, &etcd.endpoint(), "orders", "a", &[], 10).await;
    let mut b = Member::start(&env, &etcd.endpoint(), "orders", "b", &[], 10).await;
    wait_until("both instances UP", Duration::from_secs(15), || async {
        let r = xds.registry().await;
        r["services"]["orders"]
            .as_array()
            .is_some_and(|i| i.len() == 2 && i.iter().all(|i| i["state"] == "UP"))
    })
    .await;

    let ask = json!({"owner": "client-1", "service": "orders", "params": params()});
    let (status, first) = post(&xds, "/v1/upstream-sessions", ask.clone()).await;
    assert_eq!(status, 200, "{first}\n{}", xds.log());
    let envelope = first["envelope"]
        .as_str()
        .expect("a stateful server gives a session");
    let holder = address_of(envelope);
    let (holder_member, other) = if holder == a.server.endpoint() {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(holder, holder_member.server.endpoint());
    assert_eq!(
        count(&holder_member.server.control().await, "initializes"),
        1
    );

    // Asked again: the same session, no new initialize.
    let (_, again) = post(&xds, "/v1/upstream-sessions", ask.clone()).await;
    assert_eq!(again["envelope"], first["envelope"]);
    assert_eq!(
        count(&holder_member.server.control().await, "initializes"),
        1
    );

    // The filter saw the server answer "session unknown" while the instance lives on,
    // unchanged: the client or the server ended it, so it is not opened again.
    let mut stale = ask.clone();
    stale["stale"] = json!(envelope);
    let (status, ended) = post(&xds, "/v1/upstream-sessions", stale.clone()).await;
    assert_eq!(status, 410, "{ended}");
    assert_eq!(ended["failure"], "ended", "{ended}");
    assert_eq!(
        count(&holder_member.server.control().await, "initializes"),
        1
    );
    // Lost with its instance: a new session, on the other instance.
    holder_member.server.proc.kill();
    let (status, moved) = post(&xds, "/v1/upstream-sessions", stale).await;
    assert_eq!(status, 200, "{moved}\n{}", xds.log());
    let moved_envelope = moved["envelope"].as_str().expect("envelope");
    assert_eq!(address_of(moved_envelope), other.server.endpoint());
    assert!(
        moved["opened_ms"].as_u64().is_some_and(|t| t > 0),
        "{moved}"
    );

    // A replayed call runs on the held session and its answer comes back whole.
    let call = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "hi"}}});
    let mut replay = ask.clone();
    replay["stale"] = json!(null);
    replay["body"] = json!(STANDARD.encode(call.to_string()));
    let (status, replayed) = post(&xds, "/v1/upstream-sessions/replay", replay).await;
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(replayed["status"], 200, "{replayed}");
    assert_eq!(replayed["envelope"], moved["envelope"]);
    assert!(
        replayed["body"]
            .as_str()
            .unwrap_or_default()
            .contains("\"id\":9"),
        "{replayed}"
    );
    assert_eq!(other.server.calls("echo").await, 1);

    // The owner's session ends: every session it holds is deleted.
    let closed = http()
        .delete(format!("{}/v1/upstream-sessions/client-1", xds.admin_url()))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(closed.status().as_u16(), 200);
    wait_until(
        "the held session is deleted",
        Duration::from_secs(5),
        || async { count(&other.server.control().await, "deletes") == 1 },
    )
    .await;

    // Bad requests name what is wrong.
    let (status, bad) = post(
        &xds,
        "/v1/upstream-sessions",
        json!({"owner": "x", "service": "no such", "params": params()}),
    )
    .await;
    assert_eq!(status, 400, "{bad}");
    assert!(
        bad["error"]
            .as_str()
            .unwrap_or_default()
            .contains("service"),
        "{bad}"
    );
    let (status, none) = post(
        &xds,
        "/v1/upstream-sessions",
        json!({"owner": "x", "service": "billing", "params": params()}),
    )
    .await;
    assert_eq!(status, 503, "{none}");
    assert!(
        none["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no healthy instance"),
        "{none}"
    );
}
