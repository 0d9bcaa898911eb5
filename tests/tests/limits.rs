//! Data-plane limits: a request body nested deeper than the filter accepts is answered by the
//! gateway with a JSON-RPC error naming the limit, and never reaches the tool server.

use std::time::Duration;

use serde_json::Value;
use toolgate_tests::{wait_until, Envoy, Etcd, Member, TestEnv, Xds};

#[tokio::test]
async fn a_request_nested_too_deep_gets_a_json_rpc_error_and_never_reaches_the_server() {
    let env = TestEnv::new("limits_depth");
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(&env, "xds", &etcd.endpoint(), &[]).await;
    let envoy = Envoy::start_with_filter(&env, "envoy", &xds, 1, &[]).await;
    let m = Member::start(&env, &etcd.endpoint(), "orders", "orders-1", &[], 10).await;
    let want = vec![m.server.endpoint()];
    wait_until("Envoy routes orders", Duration::from_secs(20), || async {
        envoy.addresses("orders").await == want
    })
    .await;

    let nested = format!("{}1{}", "[".repeat(100), "]".repeat(100));
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"echo","arguments":{{"x":{nested}}}}}}}"#
    );
    let resp = reqwest::Client::new()
        .post(envoy.url("orders"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .body(body)
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.expect("a JSON-RPC body");
    assert_eq!(v["jsonrpc"], "2.0", "{v}");
    assert_eq!(v["error"]["code"], -32600, "{v}");
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"]["maxJsonDepth"], 64,
        "{v}"
    );
    assert!(
        !v.to_string().contains("127.0.0.1"),
        "no internal address in the reply: {v}"
    );
    assert_eq!(m.server.calls("echo").await, 0, "the server never saw it");

    // Headers beyond Envoy's limit: refused in its codec, answered as JSON-RPC.
    let resp = reqwest::Client::new()
        .post(envoy.url("orders"))
        .header("content-type", "application/json")
        .header("x-padding", "p".repeat(70 * 1024))
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 431);
    let v: Value = resp.json().await.expect("a JSON-RPC body");
    assert_eq!(v["error"]["code"], -32600, "{v}");
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"]["maxRequestHeadersKb"], 60,
        "{v}"
    );
}
