//! Data-plane limits: a request body larger or nested deeper than the filter accepts, or
//! headers beyond Envoy's limits, are answered by the gateway with a JSON-RPC error naming the
//! limit, and never reach the tool server.

use serde_json::Value;
use toolgate_tests::{Member, Options, Stack, TestEnv};

struct Gateway {
    stack: Stack,
    member: Member,
    _env: TestEnv,
}

/// The shared stack (toolgate-xds with `xds_args`) and one `orders` instance (lab flags
/// `member_args`) that Envoy routes to.
async fn gateway(name: &str, xds_args: &[&str], member_args: &[&str]) -> Gateway {
    let env = TestEnv::new(name);
    let stack = Stack::with(&env, Options::default().xds_arg(xds_args)).await;
    let member = Member::start(
        &env,
        &stack.etcd.endpoint(),
        "orders",
        "orders-1",
        member_args,
        10,
    )
    .await;
    stack.routes("orders", &[&member]).await;
    Gateway {
        stack,
        member,
        _env: env,
    }
}

#[tokio::test]
async fn a_request_nested_too_deep_gets_a_json_rpc_error_and_never_reaches_the_server() {
    let Gateway {
        stack: Stack { envoy, .. },
        member: m,
        ..
    } = &gateway("limits_depth", &[], &[]).await;

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

/// A `tools/call` of `echo` whose body is `size` bytes, sent chunked (no Content-Length), so
/// neither Envoy nor the filter knows its size before it has arrived.
async fn post_chunked(url: &str, size: usize) -> (reqwest::StatusCode, String) {
    let head = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"echo","arguments":{"pad":""#;
    let tail = r#""}}}"#;
    let body = format!("{head}{}{tail}", "x".repeat(size - head.len() - tail.len()));
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = body
        .into_bytes()
        .chunks(64 * 1024)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .expect("POST");
    let status = resp.status();
    (status, resp.text().await.unwrap_or_default())
}

fn assert_too_large(status: reqwest::StatusCode, body: &str, limit: u64) {
    assert_eq!(status, 413, "{body}");
    let v: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("not a JSON-RPC body ({e}): {body:.300}"));
    assert_eq!(v["jsonrpc"], "2.0", "{v}");
    assert_eq!(v["error"]["code"], -32600, "{v}");
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"]["maxBodyBytes"], limit,
        "{v}"
    );
}

#[tokio::test]
async fn a_chunked_body_over_the_limit_gets_the_filters_json_rpc_error_not_envoys_413() {
    let Gateway {
        stack: Stack { envoy, .. },
        member: m,
        ..
    } = &gateway("limits_body", &[], &[]).await;
    let (status, body) = post_chunked(&envoy.url("orders"), 2 * MIB).await;
    assert_too_large(status, &body, MIB as u64);
    assert_eq!(m.server.calls("echo").await, 0, "the server never saw it");
}

const MIB: usize = 1024 * 1024;

#[tokio::test]
async fn a_raised_body_limit_lets_larger_calls_through_and_refuses_beyond_it() {
    let limit = (4 * MIB).to_string();
    let Gateway {
        stack: Stack { envoy, .. },
        member: m,
        ..
    } = &gateway(
        "limits_body_raised",
        &["--max-body-bytes", &limit, "--max-json-depth", "8"],
        &["--stateless", "--json-response"],
    )
    .await;

    // 2 MiB: over Envoy's default buffer and the filter's default limit, under the raised ones.
    let (status, body) = post_chunked(&envoy.url("orders"), 2 * MIB).await;
    assert_eq!(status, 200, "{body:.300}");
    assert!(body.contains("orders-1"), "the tool answered: {body:.300}");
    assert_eq!(m.server.calls("echo").await, 1);

    let (status, body) = post_chunked(&envoy.url("orders"), 5 * MIB).await;
    assert_too_large(status, &body, 4 * MIB as u64);
    assert_eq!(m.server.calls("echo").await, 1, "the server never saw it");

    // The depth limit is the flag's too.
    let nested = format!("{}1{}", "[".repeat(10), "]".repeat(10));
    let resp = reqwest::Client::new()
        .post(envoy.url("orders"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"echo","arguments":{{"x":{nested}}}}}}}"#
        ))
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.expect("a JSON-RPC body");
    assert_eq!(
        v["error"]["data"]["io.toolgate/limits"]["maxJsonDepth"], 8,
        "{v}"
    );
}
