//! The demo binaries as an MCP client sees them: rmcp's own Streamable HTTP
//! client against the sample services and the lab, plus raw HTTP/TCP where
//! the failure is below MCP (HTTP 500, reset, hang). Every server runs as a
//! child process on 127.0.0.1 with an OS-picked port.

use std::{
    io::ErrorKind,
    net::SocketAddr,
    path::PathBuf,
    process::{ExitStatus, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use rmcp::{
    model::{CallToolRequestParams, CallToolResult, ClientConfig, ErrorCode},
    service::RunningService,
    transport::StreamableHttpClientTransport,
    RoleClient, ServiceError, ServiceExt,
};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines},
    net::TcpStream,
    process::{Child, ChildStdout, Command},
    time::timeout,
};

const DEMO: &str = env!("CARGO_BIN_EXE_toolgate-demo");
const LAB: &str = env!("CARGO_BIN_EXE_toolgate-lab");

/// Longest a server may take to print its address.
const STARTUP: Duration = Duration::from_secs(15);
/// Longest any single MCP exchange may take before the test fails.
const EXCHANGE: Duration = Duration::from_secs(10);
/// Longest a whole test may run.
const TEST: Duration = Duration::from_secs(90);

type Client = RunningService<RoleClient, ClientConfig>;

/// A demo binary running as a child process; killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    // Kept open so a late write to stdout cannot kill the child with SIGPIPE.
    _stdout: Lines<BufReader<ChildStdout>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

static STARTED: AtomicUsize = AtomicUsize::new(0);

impl Server {
    async fn start(bin: &str, args: &[&str]) -> Server {
        let name = PathBuf::from(bin)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let n = STARTED.fetch_add(1, Ordering::SeqCst);
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{name}-{}-{n}.log", std::process::id()));
        let stderr = std::fs::File::create(&log).expect("create server log file");
        let mut child = Command::new(bin)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {bin}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = timeout(STARTUP, lines.next_line())
            .await
            .unwrap_or_else(|_| {
                panic!("{name} {args:?} printed nothing in {STARTUP:?}; log: {log:?}")
            })
            .expect("reading server stdout")
            .unwrap_or_else(|| panic!("{name} {args:?} exited before listening; log: {log:?}"));
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first stdout line {line:?}"));
        Server {
            child,
            addr,
            log,
            _stdout: lines,
        }
    }

    async fn demo(service: &str, instance_id: &str) -> Server {
        Server::start(DEMO, &["--service", service, "--instance-id", instance_id]).await
    }

    async fn lab(args: &[&str]) -> Server {
        Server::start(LAB, args).await
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// An rmcp client that has completed `initialize`.
    async fn client(&self) -> Client {
        let transport = StreamableHttpClientTransport::from_uri(self.url("/mcp"));
        match timeout(EXCHANGE, ClientConfig::default().serve(transport)).await {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => panic!("initialize failed: {error}; log: {:?}", self.log),
            Err(_) => panic!("initialize timed out; log: {:?}", self.log),
        }
    }

    async fn control(&self) -> Value {
        let response = http()
            .get(self.url("/control"))
            .send()
            .await
            .expect("GET /control");
        assert_eq!(response.status(), 200);
        response.json().await.expect("GET /control is JSON")
    }

    /// POSTs `body` to `path` and returns status and body.
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = http()
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = response.status().as_u16();
        (status, response.json().await.expect("control answers JSON"))
    }

    async fn set(&self, knobs: Value) -> Value {
        let (status, state) = self.post("/control", knobs.clone()).await;
        assert_eq!(status, 200, "POST /control {knobs} refused: {state}");
        state
    }

    async fn calls(&self, tool: &str) -> u64 {
        self.control().await["calls"][tool].as_u64().unwrap_or(0)
    }

    async fn health(&self) -> u16 {
        http()
            .get(self.url("/health"))
            .send()
            .await
            .expect("GET /health")
            .status()
            .as_u16()
    }

    /// A raw `tools/call` POST as any MCP client would send it, without a session.
    fn raw_call(&self, tool: &str, id: u64) -> reqwest::RequestBuilder {
        http()
            .post(self.url("/mcp"))
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-06-18")
            .json(&tool_call(tool, id))
    }

    /// SIGTERM, then the exit status (bounded).
    async fn stop(mut self) -> ExitStatus {
        let pid = self.child.id().expect("child still running") as i32;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("send SIGTERM");
        timeout(Duration::from_secs(10), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("no exit within 10s of SIGTERM; log: {:?}", self.log))
            .expect("wait for child")
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(EXCHANGE)
        .build()
        .expect("reqwest client")
}

fn tool_call(tool: &str, id: u64) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {"name": tool, "arguments": {"order": id}},
    })
}

fn args(value: Value) -> serde_json::Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("arguments must be an object, got {other}"),
    }
}

async fn call(
    client: &Client,
    tool: &str,
    arguments: Value,
) -> Result<CallToolResult, ServiceError> {
    let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args(arguments));
    timeout(EXCHANGE, client.call_tool(params))
        .await
        .unwrap_or_else(|_| panic!("tools/call {tool} timed out"))
}

async fn call_ok(client: &Client, tool: &str, arguments: Value) -> CallToolResult {
    call(client, tool, arguments.clone())
        .await
        .unwrap_or_else(|e| panic!("tools/call {tool} {arguments} failed: {e}"))
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|block| block.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

fn structured(result: &CallToolResult) -> Value {
    result
        .structured_content
        .clone()
        .unwrap_or_else(|| panic!("no structured content in {result:?}"))
}

async fn tool_names(client: &Client) -> Vec<String> {
    let mut names: Vec<String> = timeout(EXCHANGE, client.list_all_tools())
        .await
        .expect("tools/list timed out")
        .expect("tools/list failed")
        .into_iter()
        .map(|tool| tool.name.into_owned())
        .collect();
    names.sort();
    names
}

async fn bounded<F: std::future::Future<Output = ()>>(test: F) {
    timeout(TEST, test)
        .await
        .expect("test ran over its time bound");
}

#[tokio::test]
async fn inventory_answers_from_database_and_cache_naming_its_instance() {
    bounded(async {
        let server = Server::demo("inventory", "inv-a").await;
        let client = server.client().await;
        let info = client.peer_info().expect("initialized");
        assert_eq!(
            info.server_info.as_ref().map(|i| i.name.as_str()),
            Some("toolgate-inventory")
        );
        assert_eq!(
            tool_names(&client).await,
            ["query_cached_inventory", "query_inventory_db"]
        );

        let live = call_ok(&client, "query_inventory_db", json!({"sku": "widget-1"})).await;
        assert_eq!(live.is_error, Some(false));
        assert_eq!(structured(&live)["in_stock"], 42);
        assert_eq!(structured(&live)["source"], "database");
        assert_eq!(structured(&live)["instance_id"], "inv-a");
        assert!(text_of(&live).contains("inv-a"), "{}", text_of(&live));

        let cached = call_ok(
            &client,
            "query_cached_inventory",
            json!({"sku": "WIDGET-1"}),
        )
        .await;
        assert_eq!(structured(&cached)["cached"], true);
        assert_eq!(structured(&cached)["in_stock"], 42);
        assert!(text_of(&cached).contains("cached"));

        let unknown = call_ok(&client, "query_inventory_db", json!({"sku": "NOPE-9"})).await;
        assert_eq!(unknown.is_error, Some(true));
        assert!(text_of(&unknown).contains("NOPE-9"));
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn finance_computes_tax_and_refuses_unknown_regions() {
    bounded(async {
        let server = Server::demo("finance", "fin-a").await;
        let client = server.client().await;
        assert_eq!(tool_names(&client).await, ["tax_calc"]);

        let taxed = call_ok(
            &client,
            "tax_calc",
            json!({"amount": 200.0, "region": "us-ca"}),
        )
        .await;
        assert_eq!(taxed.is_error, Some(false));
        assert_eq!(structured(&taxed)["tax"], 14.5);
        assert_eq!(structured(&taxed)["instance_id"], "fin-a");

        let refused = call_ok(
            &client,
            "tax_calc",
            json!({"amount": 1.0, "region": "atlantis"}),
        )
        .await;
        assert_eq!(refused.is_error, Some(true));
        assert!(
            text_of(&refused).contains("'atlantis'"),
            "{}",
            text_of(&refused)
        );
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn code_reports_tokens_and_bracket_balance() {
    bounded(async {
        let server = Server::demo("code", "code-a").await;
        let client = server.client().await;
        assert_eq!(tool_names(&client).await, ["ast_parse"]);

        let balanced = call_ok(
            &client,
            "ast_parse",
            json!({"source": "fn f(x) { [x, 1] }"}),
        )
        .await;
        assert_eq!(structured(&balanced)["balanced"], true);
        assert_eq!(structured(&balanced)["max_depth"], 2);
        assert_eq!(structured(&balanced)["instance_id"], "code-a");

        let broken = call_ok(&client, "ast_parse", json!({"source": "f(a[1)]"})).await;
        assert_eq!(structured(&broken)["balanced"], false);
        assert!(text_of(&broken).contains("1:6"), "{}", text_of(&broken));
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn lab_echoes_through_rmcp_in_every_transport_mode() {
    bounded(async {
        // (flags, session id expected, content type of a tools/call reply)
        let modes: [(&[&str], bool, &str); 3] = [
            (&[], true, "text/event-stream"),
            (&["--stateless"], false, "text/event-stream"),
            (
                &["--stateless", "--json-response"],
                false,
                "application/json",
            ),
        ];
        for (flags, stateful, content_type) in modes {
            let mut lab_args = vec!["--instance-id", "lab-modes"];
            lab_args.extend_from_slice(flags);
            let lab = Server::lab(&lab_args).await;

            let client = lab.client().await;
            assert_eq!(
                tool_names(&client).await,
                ["echo", "read_order", "write_order"],
                "{flags:?}"
            );
            let echoed = call_ok(&client, "write_order", json!({"order": 7, "qty": 2})).await;
            let echo = structured(&echoed);
            assert_eq!(echo["tool"], "write_order", "{flags:?}");
            assert_eq!(echo["instance_id"], "lab-modes", "{flags:?}");
            assert_eq!(
                echo["arguments"],
                json!({"order": 7, "qty": 2}),
                "{flags:?}"
            );
            let text: Value = serde_json::from_str(&text_of(&echoed)).expect("echo text is JSON");
            assert_eq!(text, echo, "{flags:?}");
            let _ = client.cancel().await;

            // The same modes as seen on the wire.
            let init = http()
                .post(lab.url("/mcp"))
                .header("accept", "application/json, text/event-stream")
                .json(&json!({
                    "jsonrpc": "2.0", "id": 1, "method": "initialize",
                    "params": {
                        "protocolVersion": "2025-06-18",
                        "capabilities": {},
                        "clientInfo": {"name": "raw", "version": "1"},
                    },
                }))
                .send()
                .await
                .expect("raw initialize");
            assert_eq!(init.status(), 200, "{flags:?}");
            assert_eq!(
                init.headers().contains_key("mcp-session-id"),
                stateful,
                "{flags:?}"
            );
            if !stateful {
                let reply = lab
                    .raw_call("echo", 5)
                    .send()
                    .await
                    .expect("raw tools/call");
                let got = reply
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                assert!(
                    got.starts_with(content_type),
                    "{flags:?}: content-type {got}"
                );
                let body = reply.text().await.expect("reply body");
                assert!(body.contains("\"lab-modes\""), "{flags:?}: {body}");
            }
        }
    })
    .await;
}

#[tokio::test]
async fn lab_latency_delays_every_call_and_can_be_set_per_tool() {
    bounded(async {
        let lab = Server::lab(&[]).await;
        let client = lab.client().await;
        let fast = Instant::now();
        call_ok(&client, "echo", json!({})).await;
        assert!(
            fast.elapsed() < Duration::from_millis(300),
            "{:?}",
            fast.elapsed()
        );

        lab.set(json!({"latency_ms": 400, "tool_latency_ms": {"read_order": 0}}))
            .await;
        let slow = Instant::now();
        call_ok(&client, "echo", json!({})).await;
        assert!(
            slow.elapsed() >= Duration::from_millis(400),
            "{:?}",
            slow.elapsed()
        );
        let exempt = Instant::now();
        call_ok(&client, "read_order", json!({})).await;
        assert!(
            exempt.elapsed() < Duration::from_millis(400),
            "{:?}",
            exempt.elapsed()
        );

        let state = lab.set(json!({"latency_ms": 0})).await;
        assert_eq!(state["knobs"]["latency_ms"], 0);
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn lab_http500_is_a_plain_500_without_json_rpc() {
    bounded(async {
        let lab = Server::lab(&["--stateless", "--fail", "write_order=http500"]).await;
        let reply = lab
            .raw_call("write_order", 1)
            .send()
            .await
            .expect("tools/call");
        assert_eq!(reply.status(), 500);
        let content_type = reply
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(content_type.starts_with("text/plain"), "{content_type}");
        let body = reply.text().await.expect("500 body");
        assert!(
            serde_json::from_str::<Value>(&body).is_err(),
            "body is JSON: {body}"
        );
        assert!(body.contains("write_order"), "{body}");
        assert_eq!(lab.calls("write_order").await, 1);

        // Only the failing tool fails.
        let other = lab
            .raw_call("read_order", 2)
            .send()
            .await
            .expect("tools/call");
        assert_eq!(other.status(), 200);

        // rmcp's client sees it as a transport failure, not a tool result.
        let client = lab.client().await;
        assert!(call(&client, "write_order", json!({})).await.is_err());
        assert_eq!(lab.calls("write_order").await, 2);
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn lab_reset_tears_the_connection_down_without_a_response() {
    bounded(async {
        let lab = Server::lab(&["--fail", "write_order=reset"]).await;
        let body = tool_call("write_order", 1).to_string();
        let request = format!(
            "POST /mcp HTTP/1.1\r\nhost: {}\r\naccept: application/json, text/event-stream\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            lab.addr,
            body.len()
        );
        let mut stream = TcpStream::connect(lab.addr).await.expect("connect");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("send request");
        let mut received = Vec::new();
        let outcome = timeout(EXCHANGE, stream.read_to_end(&mut received))
            .await
            .expect("the lab neither answered nor reset");
        let error = outcome.expect_err("connection closed without a reset");
        assert_eq!(error.kind(), ErrorKind::ConnectionReset, "{error}");
        assert!(
            received.is_empty(),
            "got bytes: {}",
            String::from_utf8_lossy(&received)
        );
        assert_eq!(lab.calls("write_order").await, 1);

        // reqwest sees a failed request, not a response.
        let reply = lab.raw_call("write_order", 2).send().await;
        assert!(reply.is_err(), "{reply:?}");
        assert_eq!(lab.calls("write_order").await, 2);
        assert_eq!(lab.health().await, 200, "the lab itself survives");
    })
    .await;
}

#[tokio::test]
async fn lab_hang_never_answers_until_the_client_gives_up() {
    bounded(async {
        let lab = Server::lab(&["--stateless", "--fail", "read_order=hang"]).await;
        let started = Instant::now();
        let reply = lab
            .raw_call("read_order", 1)
            .timeout(Duration::from_millis(600))
            .send()
            .await;
        let error = reply.expect_err("a hung call answered");
        assert!(error.is_timeout(), "{error}");
        assert!(started.elapsed() >= Duration::from_millis(600));
        assert_eq!(lab.calls("read_order").await, 1);

        // Other tools and the lab itself still answer.
        let other = lab.raw_call("echo", 2).send().await.expect("echo");
        assert_eq!(other.status(), 200);
        assert_eq!(lab.health().await, 200);
    })
    .await;
}

#[tokio::test]
async fn lab_json_rpc_failures_reach_the_client_as_mcp_answers() {
    bounded(async {
        let lab = Server::lab(&[
            "--fail",
            "write_order=jsonrpc_error",
            "--fail",
            "read_order=is_error",
        ])
        .await;
        let client = lab.client().await;

        match call(&client, "write_order", json!({})).await {
            Err(ServiceError::McpError(error)) => {
                assert_eq!(error.code, ErrorCode::INTERNAL_ERROR);
                assert_eq!(error.code.0, -32603);
            }
            other => panic!("expected a JSON-RPC error, got {other:?}"),
        }
        let failed = call_ok(&client, "read_order", json!({})).await;
        assert_eq!(failed.is_error, Some(true));
        assert!(text_of(&failed).contains("read_order"));
        assert_eq!(
            call_ok(&client, "echo", json!({})).await.is_error,
            Some(false)
        );
        let _ = client.cancel().await;

        let state = lab.control().await;
        assert_eq!(state["calls"]["write_order"], 1);
        assert_eq!(state["calls"]["read_order"], 1);
        assert_eq!(state["calls"]["echo"], 1);
    })
    .await;
}

#[tokio::test]
async fn lab_json_rpc_error_carries_the_request_id() {
    bounded(async {
        let lab = Server::lab(&[
            "--stateless",
            "--json-response",
            "--fail",
            "echo=jsonrpc_error",
        ])
        .await;
        let reply = lab.raw_call("echo", 4242).send().await.expect("tools/call");
        assert_eq!(reply.status(), 200);
        let body: Value = reply.json().await.expect("JSON-RPC body");
        assert_eq!(body["id"], 4242, "{body}");
        assert_eq!(body["error"]["code"], -32603, "{body}");
    })
    .await;
}

#[tokio::test]
async fn lab_fail_rate_decides_how_often_a_failure_mode_fires() {
    bounded(async {
        let lab = Server::lab(&[
            "--stateless",
            "--fail",
            "write_order=http500",
            "--fail-rate",
            "0",
        ])
        .await;
        for id in 0..5 {
            let reply = lab
                .raw_call("write_order", id)
                .send()
                .await
                .expect("tools/call");
            assert_eq!(reply.status(), 200, "fail_rate 0 must never fail");
        }
        lab.set(json!({"fail_rate": 1.0})).await;
        for id in 0..5 {
            let reply = lab
                .raw_call("write_order", id)
                .send()
                .await
                .expect("tools/call");
            assert_eq!(reply.status(), 500, "fail_rate 1 must always fail");
        }
        assert_eq!(lab.calls("write_order").await, 10);
    })
    .await;
}

#[tokio::test]
async fn lab_counts_calls_on_arrival_and_resets_counters() {
    bounded(async {
        let lab = Server::lab(&["--tools", "read_order,write_order"]).await;
        let client = lab.client().await;
        for _ in 0..3 {
            call_ok(&client, "read_order", json!({})).await;
        }
        // A call to a tool the lab does not serve still reached it.
        assert!(call(&client, "missing_tool", json!({})).await.is_err());
        let state = lab.control().await;
        assert_eq!(
            state["calls"],
            json!({"read_order": 3, "write_order": 0, "missing_tool": 1})
        );
        assert_eq!(state["total_calls"], 4);

        // A body that is not JSON-RPC goes to rmcp untouched and is not counted.
        let garbage = http()
            .post(lab.url("/mcp"))
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .expect("POST garbage");
        assert!(garbage.status().is_client_error(), "{}", garbage.status());
        assert_eq!(lab.control().await["total_calls"], 4);

        let (status, state) = lab.post("/control/reset-counters", json!({})).await;
        assert_eq!(status, 200);
        assert_eq!(state["calls"], json!({"read_order": 0, "write_order": 0}));
        assert_eq!(state["total_calls"], 0);
        let _ = client.cancel().await;
    })
    .await;
}

#[tokio::test]
async fn lab_health_follows_the_health_fail_knob() {
    bounded(async {
        let lab = Server::lab(&["--health-fail"]).await;
        assert_eq!(lab.health().await, 503);
        lab.set(json!({"health_fail": false})).await;
        assert_eq!(lab.health().await, 200);
        lab.set(json!({"health_fail": true})).await;
        assert_eq!(lab.health().await, 503);
    })
    .await;
}

#[tokio::test]
async fn lab_control_shows_state_and_refuses_bad_input_by_name() {
    bounded(async {
        let lab = Server::lab(&["--instance-id", "lab-ctl", "--latency-ms", "5"]).await;
        let state = lab.control().await;
        assert_eq!(state["instance_id"], "lab-ctl");
        assert_eq!(state["knobs"]["latency_ms"], 5);
        assert_eq!(state["knobs"]["fail_rate"], 1.0);
        assert_eq!(state["knobs"]["fail"]["write_order"], "none");
        assert_eq!(state["total_calls"], 0);

        let refusals = [
            (json!({"fail": {"write_order": "explode"}}), "explode"),
            (json!({"fail": {"ghost": "reset"}}), "ghost"),
            (json!({"fail_rate": 1.5}), "fail_rate"),
            (json!({"latency_ms": "slow"}), "latency_ms"),
            (json!({"health_fail": 1}), "health_fail"),
            (json!({"speed": 3}), "speed"),
        ];
        for (patch, named) in refusals {
            let (status, body) = lab.post("/control", patch.clone()).await;
            assert_eq!(status, 400, "{patch} accepted");
            let error = body["error"].as_str().unwrap_or_default();
            assert!(
                error.contains(named),
                "{patch}: error {error:?} does not name {named}"
            );
        }
        assert_eq!(
            lab.control().await["knobs"],
            state["knobs"],
            "refusals changed knobs"
        );

        let changed = lab
            .set(json!({"fail": {"write_order": "hang"}, "fail_rate": 0.5}))
            .await;
        assert_eq!(changed["knobs"]["fail"]["write_order"], "hang");
        assert_eq!(changed["knobs"]["fail_rate"], 0.5);
        assert_eq!(
            changed["knobs"]["latency_ms"], 5,
            "untouched knobs keep their value"
        );
    })
    .await;
}

#[tokio::test]
async fn bad_flags_exit_2_naming_the_bad_value() {
    bounded(async {
        let cases: [(&str, &[&str], &str); 5] = [
            (DEMO, &["--service", "bogus"], "bogus"),
            (LAB, &["--fail", "write_order=explode"], "explode"),
            (LAB, &["--fail", "ghost=reset"], "ghost"),
            (LAB, &["--fail", "write_order"], "write_order"),
            (LAB, &["--fail-rate", "2"], "2"),
        ];
        for (bin, args, named) in cases {
            let output = timeout(
                EXCHANGE,
                Command::new(bin)
                    .args(["--listen", "127.0.0.1:0"])
                    .args(args)
                    .stdin(Stdio::null())
                    .output(),
            )
            .await
            .expect("bad flags must exit at once")
            .expect("run binary");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
            assert!(stderr.contains(named), "{args:?}: {stderr}");
            assert!(output.stdout.is_empty(), "{args:?} started listening");
        }
    })
    .await;
}

#[tokio::test]
async fn sigterm_stops_servers_cleanly_even_with_open_sessions() {
    bounded(async {
        let demo = Server::demo("inventory", "inv-stop").await;
        let client = demo.client().await;
        call_ok(&client, "query_cached_inventory", json!({"sku": "BOLT-M8"})).await;
        let status = demo.stop().await;
        assert_eq!(status.code(), Some(0), "{status}");
        drop(client);

        let lab = Server::lab(&["--fail", "write_order=hang"]).await;
        let parked = tokio::spawn(lab.raw_call("write_order", 1).send());
        // Wait until the hanging call has arrived, so the stop has to release it.
        let deadline = Instant::now() + EXCHANGE;
        while lab.calls("write_order").await == 0 {
            assert!(
                Instant::now() < deadline,
                "the parked call never reached the lab"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = lab.stop().await;
        assert_eq!(status.code(), Some(0), "{status}");
        let released = parked.await.expect("join parked call");
        assert!(
            released.is_err(),
            "a hung call got a response: {released:?}"
        );
    })
    .await;
}
