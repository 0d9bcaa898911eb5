//! Envoy at the edge: what a client that holds connections, trickles bytes or parks streams
//! can take from the gateway, with the bootstrap `toolgate-xds bootstrap` prints.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use toolgate_tests::{rss_kib, wait_until, Envoy, McpSession, Member, Options, Stack, TestEnv};

const MIB: u64 = 1024 * 1024;

struct Gateway {
    stack: Stack,
    member: Member,
    _env: TestEnv,
}

/// The shared stack with `bootstrap_args`, and one `orders` instance that Envoy routes to.
async fn gateway(name: &str, bootstrap_args: &[&str]) -> Gateway {
    let env = TestEnv::new(name);
    let stack = Stack::with(&env, Options::default().bootstrap_arg(bootstrap_args)).await;
    let member = Member::start(&env, &stack.etcd.endpoint(), "orders", "orders-1", &[], 10).await;
    stack.routes("orders", &[&member]).await;
    Gateway {
        stack,
        member,
        _env: env,
    }
}

/// How a trickling connection ended.
#[derive(Debug)]
struct Trickled {
    /// From the first byte sent until Envoy answered (or closed without answering); `None`:
    /// still open at the deadline.
    cut_after: Option<Duration>,
    /// What Envoy sent back before closing (its first bytes).
    answer: String,
}

/// Sends `head` at once, then `body_now` bytes of body, then one more byte every `every`
/// (never the whole declared body), until Envoy answers or closes, or `deadline` passes.
async fn trickle(
    port: u16,
    head: String,
    body_now: usize,
    every: Duration,
    deadline: Duration,
) -> Trickled {
    let started = Instant::now();
    let mut stream = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) => {
            return Trickled {
                cut_after: Some(started.elapsed()),
                answer: format!("connect: {e}"),
            }
        }
    };
    let mut first = head.into_bytes();
    first.extend(std::iter::repeat_n(b'x', body_now));
    let mut buf = vec![0u8; 4096];
    let mut answer = Vec::new();
    let mut answered = None;
    let mut sent = stream.write_all(&first).await.is_ok();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    while sent {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                // Envoy closes the connection after its answer: the request never ended.
                Ok(n) => {
                    answered.get_or_insert_with(|| started.elapsed());
                    answer.extend_from_slice(&buf[..n]);
                }
            },
            _ = tick.tick() => {
                sent = stream.write_all(b"x").await.is_ok();
            }
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(started + deadline)) => {
                return Trickled { cut_after: answered, answer: String::from_utf8_lossy(&answer).into_owned() };
            }
        }
    }
    Trickled {
        cut_after: Some(answered.unwrap_or_else(|| started.elapsed())),
        answer: String::from_utf8_lossy(&answer).into_owned(),
    }
}

/// Headers of a `tools/call` POST declaring a body of `content_length` bytes.
fn call_head(content_length: usize) -> String {
    format!(
        "POST /mcp/orders HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\nmcp-protocol-version: 2025-06-18\r\n\
         content-length: {content_length}\r\n\r\n"
    )
}

/// The request that opens MCP's GET stream of `session`.
fn get_stream_head(service: &str, session: &str) -> String {
    format!(
        "GET /mcp/{service} HTTP/1.1\r\nhost: gateway\r\naccept: text/event-stream\r\n\
         mcp-protocol-version: 2025-06-18\r\nmcp-session-id: {session}\r\n\r\n"
    )
}

/// Opens MCP's GET stream (SSE) for `session` on `service` and reads its response headers;
/// panics unless they say 200 and `text/event-stream`. The stream stays open in the returned
/// connection.
async fn open_get_stream(envoy: &Envoy, service: &str, session: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", envoy.port))
        .await
        .expect("connect");
    stream
        .write_all(get_stream_head(service, session).as_bytes())
        .await
        .expect("send GET");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("GET stream headers within 10 s")
            .expect("read");
        assert!(
            n > 0,
            "GET stream closed: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got).to_lowercase();
    assert!(
        head.starts_with("http/1.1 200") && head.contains("text/event-stream"),
        "{head}"
    );
    stream
}

/// Envoy's heap in use now.
async fn allocated(envoy: &Envoy) -> u64 {
    envoy.admin().heap_allocated().await
}

#[tokio::test]
async fn slow_bodies_and_slow_headers_are_cut_at_the_request_timeout_and_their_memory_freed() {
    // Short timeouts, so the test is quick; the defaults are 30 s and 10 s.
    const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
    const HEADERS_TIMEOUT: Duration = Duration::from_secs(2);
    const SLOW_BODIES: usize = 64;
    const SLOW_HEADERS: usize = 16;
    let gw = gateway(
        "edge_slow_bodies",
        &["--request-timeout", "3s", "--request-headers-timeout", "2s"],
    )
    .await;
    let envoy = &gw.stack.envoy;
    let pid = envoy.proc.as_ref().map_or(0, |p| p.pid());
    // A GET stream opened before: the request timeout must not cut it.
    let sse_client = McpSession::connect(&envoy.url("orders")).await;
    let mut sse = open_get_stream(
        envoy,
        "orders",
        sse_client.session.as_deref().expect("a session"),
    )
    .await;
    let sse_opened = Instant::now();
    let log = envoy.proc.as_ref().map(|p| p.log()).unwrap_or_default();
    assert!(
        !log.contains("no configured limit to the number of allowed active downstream connections"),
        "Envoy warns that it has no connection limit"
    );
    let (rss0, heap0) = (rss_kib(pid), allocated(envoy).await);

    // Each slow body: just under the 1 MiB body limit at once, then a byte every second, of a
    // body declared 2 KiB longer than that. Each slow header: a request line, then a header
    // byte every 500 ms.
    let body_now = (MIB - 64 * 1024) as usize;
    let deadline = REQUEST_TIMEOUT + Duration::from_secs(7);
    let mut tasks = Vec::new();
    for _ in 0..SLOW_BODIES {
        let head = call_head(body_now + 2048);
        let port = envoy.port;
        tasks.push(tokio::spawn(trickle(
            port,
            head,
            body_now,
            Duration::from_secs(1),
            deadline,
        )));
    }
    let mut header_tasks = Vec::new();
    for _ in 0..SLOW_HEADERS {
        let head = "POST /mcp/orders HTTP/1.1\r\nhost: gateway\r\nx-slow: ".to_string();
        let port = envoy.port;
        header_tasks.push(tokio::spawn(trickle(
            port,
            head,
            0,
            Duration::from_millis(500),
            deadline,
        )));
    }

    // While they hold their connections, the heap grows by what they sent, and a normal
    // client is still served.
    let held = wait_until(
        "Envoy buffers the slow bodies",
        Duration::from_secs(20),
        || async { allocated(envoy).await > heap0 + (SLOW_BODIES as u64 * body_now as u64) / 2 },
    )
    .await;
    let (rss_peak, heap_peak) = (rss_kib(pid), allocated(envoy).await);
    let mut s = McpSession::connect(&envoy.url("orders")).await;
    let reply = s.call_tool("echo", json!({"during": "slow clients"})).await;
    assert!(
        reply.text().contains("orders-1"),
        "a normal call is answered: {}",
        reply.body
    );
    println!("slow bodies buffered {held:?} after the start; a normal call answered meanwhile");

    let mut cut = Vec::new();
    let mut open = 0;
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    let mut bodies = Vec::new();
    for t in tasks {
        let r = t.await.expect("slow body task");
        *answers
            .entry(r.answer.lines().next().unwrap_or("(closed)").to_string())
            .or_default() += 1;
        bodies.push(r.answer);
        match r.cut_after {
            Some(d) => cut.push(d),
            None => open += 1,
        }
    }
    let mut header_cut = Vec::new();
    let mut header_open = 0;
    for t in header_tasks {
        match t.await.expect("slow header task").cut_after {
            Some(d) => header_cut.push(d),
            None => header_open += 1,
        }
    }
    cut.sort();
    header_cut.sort();
    println!(
        "slow bodies: {} cut (first {:?}, last {:?}), {open} still open after {deadline:?}; answers {answers:?}",
        cut.len(),
        cut.first(),
        cut.last()
    );
    println!(
        "slow headers: {} cut (first {:?}, last {:?}), {header_open} still open",
        header_cut.len(),
        header_cut.first(),
        header_cut.last()
    );
    println!(
        "Envoy heap: {} MiB before, {} MiB with the slow bodies, {} MiB now; RSS {} -> {} -> {} MiB",
        heap0 / MIB,
        heap_peak / MIB,
        allocated(envoy).await / MIB,
        rss0 / 1024,
        rss_peak / 1024,
        rss_kib(pid) / 1024
    );
    assert_eq!(
        open, 0,
        "{open} of {SLOW_BODIES} slow bodies still open {deadline:?} after they started"
    );
    assert_eq!(
        header_open, 0,
        "{header_open} of {SLOW_HEADERS} slow headers still open {deadline:?} after they started"
    );
    // Each got the JSON-RPC error that names the limit.
    let body = |a: &str| {
        a.split_once("\r\n\r\n")
            .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(b).ok())
            .unwrap_or_default()
    };
    for a in &bodies {
        let v = body(a);
        assert_eq!(v["error"]["code"], -32600, "{a}");
        assert_eq!(
            v["error"]["data"]["io.toolgate/limits"]["requestTimeoutMs"], 3000,
            "{a}"
        );
    }
    // Not before the timeout: what cuts them is the request timeout, nothing else.
    assert!(
        cut[0] >= REQUEST_TIMEOUT - Duration::from_millis(500),
        "{cut:?}"
    );
    assert!(
        header_cut[0] >= HEADERS_TIMEOUT - Duration::from_millis(500),
        "{header_cut:?}"
    );

    // The GET stream outlives the request timeout (twice over).
    let watch =
        (REQUEST_TIMEOUT * 2).saturating_sub(sse_opened.elapsed()) + Duration::from_millis(200);
    assert_eq!(
        closed_within(&mut sse, watch).await,
        None,
        "the GET stream was cut within {:?}",
        sse_opened.elapsed()
    );
    println!(
        "the GET stream opened before is still open after {:?}",
        sse_opened.elapsed()
    );

    // Their buffers are freed once they are cut.
    let (_, freed_in) = toolgate_tests::wait_for(
        "Envoy frees the slow bodies",
        Duration::from_secs(10),
        || async {
            let now = allocated(envoy).await;
            (now < heap0 + 16 * MIB).then_some(now)
        },
    )
    .await;
    let heap_after = allocated(envoy).await;
    println!(
        "Envoy heap: {} MiB before, {} MiB with the slow bodies, {} MiB {freed_in:?} after the last cut; RSS {} -> {} -> {} MiB",
        heap0 / MIB,
        heap_peak / MIB,
        heap_after / MIB,
        rss0 / 1024,
        rss_peak / 1024,
        rss_kib(pid) / 1024
    );
    assert_eq!(
        gw.member.server.calls("echo").await,
        1,
        "only the normal call reached the tool"
    );
}

/// Whether Envoy closes `stream` (EOF or reset) within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(
            within.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test]
async fn connections_beyond_the_limit_are_closed_and_idle_ones_time_out() {
    const LIMIT: usize = 8;
    const IDLE: Duration = Duration::from_secs(2);
    let gw = gateway(
        "edge_connection_limit",
        &[
            "--max-connections",
            &LIMIT.to_string(),
            "--idle-timeout",
            "2s",
        ],
    )
    .await;
    let envoy = &gw.stack.envoy;
    let overflow = "listener.127.0.0.1_{port}.downstream_cx_overflow"
        .replace("{port}", &envoy.port.to_string());

    // LIMIT connections that send nothing hold every slot.
    let mut idle = Vec::new();
    for _ in 0..LIMIT {
        idle.push(
            TcpStream::connect(("127.0.0.1", envoy.port))
                .await
                .expect("connect"),
        );
    }
    wait_until(
        "Envoy holds the idle connections",
        Duration::from_secs(10),
        || async { envoy.stat("http.toolgate.downstream_cx_active").await >= LIMIT as u64 },
    )
    .await;
    // One more is accepted by the kernel and closed by Envoy at once.
    let mut extra = TcpStream::connect(("127.0.0.1", envoy.port))
        .await
        .expect("connect");
    let closed = closed_within(&mut extra, Duration::from_secs(5)).await;
    println!(
        "connection {} closed by Envoy after {closed:?}; overflow counter {}",
        LIMIT + 1,
        envoy.stat(&overflow).await
    );
    assert!(
        closed.is_some(),
        "a connection beyond the limit of {LIMIT} stays open"
    );
    assert_eq!(envoy.stat(&overflow).await, 1, "{overflow}");

    // The idle ones are closed at the idle timeout, and the slots are free again.
    let mut closed_after = Vec::new();
    for s in &mut idle {
        closed_after.push(closed_within(s, IDLE + Duration::from_secs(5)).await);
    }
    println!("idle connections closed after {closed_after:?} (idle timeout {IDLE:?})");
    assert!(closed_after.iter().all(Option::is_some), "{closed_after:?}");
    let mut s = McpSession::connect(&envoy.url("orders")).await;
    let reply = s.call_tool("echo", json!({})).await;
    assert!(reply.text().contains("orders-1"), "{}", reply.body);
}

/// One HTTP/2 (h2c) connection to Envoy: requests on it are shed by the overload manager's
/// request action, not by the HTTP/1 codec's own abort.
struct H2 {
    sender: hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    url: String,
}

impl H2 {
    async fn connect(envoy: &Envoy) -> H2 {
        let tcp = TcpStream::connect(("127.0.0.1", envoy.port))
            .await
            .expect("connect");
        let (sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("h2c handshake");
        tokio::spawn(conn);
        H2 {
            sender,
            url: envoy.url("orders"),
        }
    }

    /// A stateless-style `initialize` POST: (status, body).
    async fn initialize(&mut self) -> (u16, String) {
        use http_body_util::BodyExt;
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"h2","version":"0"}}}"#;
        let req = hyper::Request::post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(10), self.sender.send_request(req))
            .await
            .expect("an answer within 10 s")
            .expect("h2 request");
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        (status, body)
    }
}

#[tokio::test]
async fn under_a_flood_of_bodies_envoy_sheds_load_at_its_heap_budget() {
    // A heap budget just above what Envoy needs at rest (about 20 MiB with the filter), and a
    // request timeout long enough that what stops the flood is the overload manager.
    const BUDGET_MIB: u64 = 48;
    // 20 waves of 20 clients, 250 ms apart (the overload manager's refresh interval), each
    // sending 512 KiB of a longer body and then nothing: 200 MiB offered in 5 s.
    const WAVES: usize = 20;
    const PER_WAVE: usize = 20;
    const BODY: usize = 512 * 1024;
    let gw = gateway(
        "edge_heap_budget",
        &[
            "--max-heap-mib",
            &BUDGET_MIB.to_string(),
            "--request-timeout",
            "8s",
        ],
    )
    .await;
    let envoy = &gw.stack.envoy;
    let budget = BUDGET_MIB * MIB;
    let heap0 = allocated(envoy).await;
    // A client that connected before the flood.
    let mut h2 = H2::connect(envoy).await;
    let (status, body) = h2.initialize().await;
    assert_eq!(status, 200, "{body}");

    let started = Instant::now();
    let deadline = Duration::from_secs(25);
    let port = envoy.port;
    let flood = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..WAVES {
            for _ in 0..PER_WAVE {
                let head = call_head(BODY + 2048);
                tasks.push(tokio::spawn(trickle(
                    port,
                    head,
                    BODY,
                    Duration::from_secs(3600),
                    deadline,
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("slow body task"));
        }
        out
    });

    // Meanwhile: the heap, and a request on the connection made before, once the overload
    // manager refuses requests.
    let mut peak = heap0;
    let mut refused: Option<(u16, String, u64)> = None;
    while !flood.is_finished() && started.elapsed() < deadline + Duration::from_secs(5) {
        let now = allocated(envoy).await;
        peak = peak.max(now);
        if refused.is_none()
            && envoy
                .stat("overload.envoy.overload_actions.stop_accepting_requests.active")
                .await
                == 1
        {
            let (status, body) = h2.initialize().await;
            if status == 503 {
                refused = Some((status, body, now));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let results = flood.await.expect("the flood");
    let mut cut = Vec::new();
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for r in results {
        *answers
            .entry(r.answer.lines().next().unwrap_or("(closed)").to_string())
            .or_default() += 1;
        cut.extend(r.cut_after);
    }
    cut.sort();
    let shed_http1 = envoy
        .stat("overload.envoy.load_shed_points.http1_server_abort_dispatch.shed_load_count")
        .await;
    let shed_accept = envoy
        .stat("overload.envoy.load_shed_points.tcp_listener_accept.shed_load_count")
        .await;
    let offered = (WAVES * PER_WAVE * BODY) as u64;
    println!(
        "heap budget {BUDGET_MIB} MiB, {} MiB offered: heap {} MiB at rest, peak {} MiB (sampled every 20 ms); {} of {} clients cut (last after {:?}); answers {answers:?}; HTTP/1 dispatches aborted {shed_http1}, connections closed at accept {shed_accept}",
        offered / MIB,
        heap0 / MIB,
        peak / MIB,
        cut.len(),
        WAVES * PER_WAVE,
        cut.last()
    );
    let (status, body, at) =
        refused.expect("a request refused while the heap was over 95% of the budget");
    println!("refused at {} MiB of heap: {status} {body}", at / MIB);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    assert_eq!(v["error"]["code"], -32000, "{body}");
    assert_eq!(
        v["error"]["data"]["io.toolgate/overload"]["maxHeapBytes"], budget,
        "{body}"
    );
    assert_eq!(cut.len(), WAVES * PER_WAVE, "every client was cut");
    assert!(
        shed_http1 + shed_accept > 0,
        "the overload manager shed load"
    );
    // The margin is about what one wave brings in before the next refresh acts on it.
    assert!(
        peak < budget + 24 * MIB,
        "heap peaked at {} MiB",
        peak / MIB
    );

    // Once the pressure is gone, Envoy serves again.
    wait_until(
        "Envoy's heap is back under 85% of its budget",
        Duration::from_secs(15),
        || async { allocated(envoy).await * 100 < budget * 85 },
    )
    .await;
    let mut s = McpSession::connect(&envoy.url("orders")).await;
    let reply = s.call_tool("echo", json!({})).await;
    assert!(reply.text().contains("orders-1"), "{}", reply.body);
}

/// The thresholds of one priority of a cluster's circuit breakers, as Envoy holds them
/// (admin `/clusters?format=json`).
async fn thresholds(envoy: &Envoy, cluster: &str, priority: &str) -> serde_json::Value {
    let v: serde_json::Value = reqwest::get(format!("{}/clusters?format=json", envoy.admin_url()))
        .await
        .expect("GET /clusters")
        .json()
        .await
        .expect("/clusters JSON");
    v["cluster_statuses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == cluster)
        .and_then(|c| c["circuit_breakers"]["thresholds"].as_array())
        .into_iter()
        .flatten()
        // Envoy leaves out the default priority's name (the enum's zero).
        .find(|t| t["priority"].as_str().unwrap_or("DEFAULT") == priority)
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn idle_get_streams_leave_the_connection_slots_of_calls_free() {
    const SLOTS: u64 = 4;
    let gw = gateway("edge_get_streams", &[]).await;
    let envoy = &gw.stack.envoy;
    // The bulkhead of 4 connections; a call that cannot get one fails after 5 s.
    let mut etcd = gw.stack.etcd.client().await;
    etcd.put(
        "/mcp/policies/orders",
        json!({"max_connections": SLOTS, "max_requests": SLOTS, "timeout_ms": 5000}).to_string(),
        None,
    )
    .await
    .expect("put the policy");
    wait_until(
        "Envoy has the bulkhead of 4",
        Duration::from_secs(20),
        || async { thresholds(envoy, "mcp.orders", "DEFAULT").await["max_connections"] == SLOTS },
    )
    .await;

    // A client that will call a tool, connected first; then 6 clients that open their GET
    // stream and stay silent.
    let mut caller = McpSession::connect(&envoy.url("orders")).await;
    let mut sessions = Vec::new();
    for _ in 0..SLOTS + 2 {
        let s = McpSession::connect(&envoy.url("orders")).await;
        sessions.push(s.session.clone().expect("a session"));
    }
    // As many GET streams as the bulkhead has slots, answered; two more that wait for one.
    let mut streams = Vec::new();
    for session in &sessions[..SLOTS as usize] {
        streams.push(open_get_stream(envoy, "orders", session).await);
    }
    for session in &sessions[SLOTS as usize..] {
        let mut s = TcpStream::connect(("127.0.0.1", envoy.port))
            .await
            .expect("connect");
        s.write_all(get_stream_head("orders", session).as_bytes())
            .await
            .expect("send GET");
        streams.push(s);
    }
    let open = envoy.stat("cluster.mcp.orders.upstream_rq_active").await;
    println!(
        "{} GET streams opened ({SLOTS} answered, the others waiting), {open} requests active upstream",
        streams.len()
    );

    let started = Instant::now();
    let reply = caller
        .call_tool("echo", json!({"beside": "GET streams"}))
        .await;
    println!(
        "tools/call answered after {:?}: {}",
        started.elapsed(),
        reply.body
    );
    assert!(
        reply.text().contains("orders-1"),
        "the tool did not answer beside {} idle GET streams: {}",
        streams.len(),
        reply.body
    );
    assert_eq!(gw.member.server.calls("echo").await, 1);
    // The streams hold their own bulkhead, the same size as the calls'.
    let high = thresholds(envoy, "mcp.orders", "HIGH").await;
    assert_eq!(high["max_connections"], SLOTS, "{high}");
    let stream_cx = envoy
        .stat("cluster.mcp.orders.circuit_breakers.high.cx_open")
        .await;
    println!("GET-stream bulkhead: {high}; full: {stream_cx}");
}
