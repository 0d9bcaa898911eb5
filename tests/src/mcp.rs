//! A small MCP client over Streamable HTTP that shows the HTTP layer (status codes, session
//! headers), for assertions a full SDK client hides. Tests that need "a real MCP client" use
//! rmcp's client as well.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// What one POST returned.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub session: Option<String>,
    pub content_type: String,
    /// The JSON-RPC response with the request's id (from JSON or from the SSE stream).
    pub message: Option<Value>,
    pub body: String,
    /// The `WWW-Authenticate` header (issue 20's 401 and 403).
    pub www_authenticate: Option<String>,
}

impl Reply {
    /// The `result` of a successful JSON-RPC response.
    pub fn result(&self) -> Option<&Value> {
        self.message.as_ref()?.get("result")
    }

    /// The `io.toolgate/breaker` state of a semantic reply (`open`, `forced_open`,
    /// `upstream_failure`…), or `None` for the tool's own answer.
    pub fn breaker_state(&self) -> Option<String> {
        let result = self.result()?;
        if result["isError"] != true {
            return None;
        }
        result["_meta"]["io.toolgate/breaker"]["state"]
            .as_str()
            .map(str::to_string)
    }

    /// The text of the first content block of a tool result.
    pub fn text(&self) -> String {
        self.result()
            .and_then(|r| r["content"][0]["text"].as_str())
            .unwrap_or_default()
            .to_string()
    }
}

pub struct McpSession {
    http: reqwest::Client,
    pub url: String,
    pub session: Option<String>,
    /// Sent as `Authorization: Bearer <token>` with every request.
    pub bearer: Option<String>,
    next_id: u64,
}

impl McpSession {
    /// initialize + notifications/initialized. Panics if the server does not accept it.
    pub async fn connect(url: &str) -> McpSession {
        Self::unconnected(url).connected().await
    }

    /// [`connect`](Self::connect) with a bearer token on every request.
    pub async fn connect_with_token(url: &str, token: &str) -> McpSession {
        let mut s = Self::unconnected(url);
        s.bearer = Some(token.to_string());
        s.connected().await
    }

    async fn connected(mut self) -> McpSession {
        let url = self.url.clone();
        let reply = self.initialize().await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "initialize at {url}: {}",
            reply.body
        );
        self
    }

    pub fn unconnected(url: &str) -> McpSession {
        McpSession {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(15))
                .no_proxy()
                .build()
                .expect("http client"),
            url: url.to_string(),
            session: None,
            bearer: None,
            next_id: 1,
        }
    }

    /// Starts a new session (dropping any old one).
    pub async fn initialize(&mut self) -> Reply {
        self.session = None;
        let reply = self
            .request(
                "initialize",
                json!({
                    "protocolVersion": PROTOCOL_VERSION,
                    "capabilities": {},
                    "clientInfo": {"name": "toolgate-tests", "version": "0"}
                }),
            )
            .await;
        if reply.status == StatusCode::OK {
            self.session = reply.session.clone();
            self.notify("notifications/initialized").await;
        }
        reply
    }

    pub async fn notify(&self, method: &str) -> StatusCode {
        self.post(&json!({"jsonrpc": "2.0", "method": method}), &[])
            .await
            .map(|r| r.status)
            .unwrap_or(StatusCode::BAD_GATEWAY)
    }

    pub async fn call_tool(&mut self, name: &str, arguments: Value) -> Reply {
        self.request("tools/call", json!({"name": name, "arguments": arguments}))
            .await
    }

    pub async fn list_tools(&mut self) -> Reply {
        self.request("tools/list", json!({})).await
    }

    /// One JSON-RPC request; transport errors come back as status 599 with the error text.
    pub async fn request(&mut self, method: &str, params: Value) -> Reply {
        self.request_with_headers(method, params, &[]).await
    }

    /// A request with extra HTTP headers.
    pub async fn request_with_headers(
        &mut self,
        method: &str,
        params: Value,
        headers: &[(&str, &str)],
    ) -> Reply {
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        match self.post(&body, headers).await {
            Ok(mut reply) => {
                reply.message = find_response(&reply.body, &reply.content_type, id);
                reply
            }
            Err(e) => Reply {
                status: StatusCode::from_u16(599).unwrap_or(StatusCode::BAD_GATEWAY),
                session: None,
                content_type: String::new(),
                message: None,
                body: error_chain(&e),
                www_authenticate: None,
            },
        }
    }

    /// Posts `body` exactly as given (a hostile client's bytes), with this session's headers
    /// and `headers` (which may replace them); the reply's `message` is the JSON-RPC message
    /// in it, whatever its id.
    pub async fn post_raw(
        &self,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &str)],
    ) -> Reply {
        use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
        let mut map = HeaderMap::new();
        let mut set = |k: &str, v: &str| {
            if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
                map.insert(k, v);
            }
        };
        set("accept", "application/json, text/event-stream");
        set("content-type", "application/json");
        set("mcp-protocol-version", PROTOCOL_VERSION);
        if let Some(s) = &self.session {
            set("mcp-session-id", s);
        }
        let bearer = self.bearer.as_ref().map(|t| format!("Bearer {t}"));
        if let Some(b) = &bearer {
            set("authorization", b);
        }
        for (k, v) in headers {
            set(k, v);
        }
        let req = self.http.post(&self.url).headers(map).body(body);
        match req.send().await {
            Ok(resp) => {
                let status = resp.status();
                let content_type = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let session = resp
                    .headers()
                    .get("mcp-session-id")
                    .and_then(|v| v.to_str().ok())
                    .map(String::from);
                let www_authenticate = www_authenticate(resp.headers());
                let body = resp.text().await.unwrap_or_default();
                let message = first_message(&body, &content_type);
                Reply {
                    status,
                    session,
                    content_type,
                    message,
                    body,
                    www_authenticate,
                }
            }
            Err(e) => Reply {
                status: StatusCode::from_u16(599).unwrap_or(StatusCode::BAD_GATEWAY),
                session: None,
                content_type: String::new(),
                message: None,
                body: error_chain(&e),
                www_authenticate: None,
            },
        }
    }

    async fn post(&self, body: &Value, headers: &[(&str, &str)]) -> Result<Reply, reqwest::Error> {
        let mut req = self
            .http
            .post(&self.url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", PROTOCOL_VERSION)
            .json(body);
        if let Some(s) = &self.session {
            req = req.header("mcp-session-id", s);
        }
        if let Some(t) = &self.bearer {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let www_authenticate = www_authenticate(resp.headers());
        let body = resp.text().await?;
        Ok(Reply {
            status,
            session,
            content_type,
            message: None,
            body,
            www_authenticate,
        })
    }
}

fn www_authenticate(headers: &reqwest::header::HeaderMap) -> Option<String> {
    headers
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .map(String::from)
}

/// The JSON-RPC response with `id` in a JSON body or an SSE stream.
pub fn find_response(body: &str, content_type: &str, id: u64) -> Option<Value> {
    let matches = |v: &Value| v.get("id").and_then(Value::as_u64) == Some(id);
    if content_type.starts_with("text/event-stream") {
        body.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(matches)
    } else {
        serde_json::from_str::<Value>(body).ok().filter(matches)
    }
}

/// The first JSON-RPC message in a JSON body or an SSE stream (a JSON-RPC batch: the array).
pub fn first_message(body: &str, content_type: &str) -> Option<Value> {
    if content_type.starts_with("text/event-stream") {
        body.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .find_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
    } else {
        serde_json::from_str::<Value>(body).ok()
    }
}

/// An error with its causes ("error sending request ...: client error (Connect): tcp connect
/// error: Connection refused"): reqwest's own text alone does not say what failed.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// POSTs one JSON-RPC message by hand, for a test that reads the HTTP response itself (its
/// status and headers, an SSE stream as it comes): with `mcp-session-id: session` and
/// `mcp-protocol-version: version` when given (a client sends neither with `initialize`; a
/// test may send the version there, or leave it out after).
pub async fn send_message(
    http: &reqwest::Client,
    url: &str,
    session: Option<&str>,
    version: Option<&str>,
    body: &Value,
) -> reqwest::Result<reqwest::Response> {
    let mut req = http
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .json(body);
    if let Some(v) = version {
        req = req.header("mcp-protocol-version", v);
    }
    if let Some(s) = session {
        req = req.header("mcp-session-id", s);
    }
    req.send().await
}

/// [`send_message`] that must reach the server (panics with the error when it does not).
pub async fn post_message(
    http: &reqwest::Client,
    url: &str,
    session: Option<&str>,
    version: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    send_message(http, url, session, version, body)
        .await
        .unwrap_or_else(|e| panic!("POST to {url}: {}", error_chain(&e)))
}

/// Opens a session by hand at `url` as a client speaking `version` with `capabilities`:
/// `initialize` (answered 200 with a session id, or the test fails), then
/// `notifications/initialized`. The session's id.
pub async fn open_session(
    http: &reqwest::Client,
    url: &str,
    version: &str,
    capabilities: Value,
) -> String {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": capabilities,
        "clientInfo": {"name": "toolgate-tests", "version": "0"}}});
    let resp = post_message(http, url, None, None, &init).await;
    assert_eq!(resp.status(), StatusCode::OK, "initialize at {url}");
    let session = resp
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    let _ = resp.bytes().await;
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    post_message(http, url, Some(&session), Some(version), &initialized).await;
    session
}

/// The texts of a tool result's content blocks, one a line (empty when it has none): what an
/// agent reads of the result.
pub fn text_of(result: &Value) -> String {
    result["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}
