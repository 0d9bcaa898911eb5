//! A small MCP client over Streamable HTTP, for checking a server and listing its tools, never
//! for calling them.
//!
//! It negotiates the newest revision the server speaks: `server/discover` in 2026-07-28 terms
//! first (stateless: every later request stands alone), and, when the server does not answer
//! that, `initialize` as the client of 2025-11-25 (the server picks the revision it speaks). A
//! session the server hands out is kept for every later request, re-created when the server
//! forgets it, and deleted (`DELETE`) by [`McpClient::close`]: a prober that initialized once
//! per probe would leave the server one session per probe, 43,200 a day at a 2 s interval.

mod sse;
pub mod tools;

pub use crate::http::ExtraHeader;
pub use sse::SseScanner;

use std::fmt;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, CONTENT_TYPE};
use serde_json::{json, Value};

/// The stateless revision.
pub const STATELESS_REVISION: &str = "2026-07-28";
/// The newest revision with sessions and `initialize`, offered when the server does not speak
/// the stateless one; the server answers with the revision it picks.
pub const SESSION_REVISION: &str = "2025-11-25";

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";
const METHOD_HEADER: &str = "mcp-method";
/// The most a probe or one page of a listing may answer before it is cut.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 << 20;

/// Why an MCP request did not give an answer, in words.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Nothing came back within the timeout.
    Timeout(Duration),
    /// The TCP connection could not be made, or broke.
    Transport(String),
    /// A non-2xx status, with the JSON-RPC error the body carried, if any.
    Http {
        status: u16,
        request: String,
        error: Option<RpcError>,
        body: String,
    },
    /// A JSON-RPC error in a 2xx answer.
    Rpc { request: String, error: RpcError },
    /// An answer that is not the JSON-RPC response asked for.
    Malformed { request: String, why: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JSON-RPC error {}: {}", self.code, self.message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Timeout(t) => write!(f, "no answer within {}ms", t.as_millis()),
            Failure::Transport(why) => f.write_str(why),
            Failure::Http {
                status,
                request,
                error: Some(e),
                ..
            } => write!(f, "{request}: HTTP {status}, {e}"),
            Failure::Http {
                status,
                request,
                error: None,
                body,
            } if body.is_empty() => write!(f, "{request}: HTTP {status}"),
            Failure::Http {
                status,
                request,
                body,
                ..
            } => write!(f, "{request}: HTTP {status}: {body}"),
            Failure::Rpc { request, error } => write!(f, "{request}: {error}"),
            Failure::Malformed { request, why } => write!(f, "{request}: {why}"),
        }
    }
}

impl Failure {
    /// The HTTP status of a non-2xx answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            Failure::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The server no longer knows the session the request named.
    pub fn session_unknown(&self) -> bool {
        match self {
            Failure::Http { status, error, .. } => toolgate_model::session_loss::session_unknown(
                *status,
                error.as_ref().map(|e| e.code),
            ),
            _ => false,
        }
    }

    /// The server answered, but not in MCP terms the client asked in: another revision may do.
    fn is_refusal(&self) -> bool {
        matches!(
            self,
            Failure::Http { .. } | Failure::Rpc { .. } | Failure::Malformed { .. }
        )
    }
}

/// The revision agreed with the server and what it implies for every later request.
#[derive(Debug, Clone, PartialEq)]
pub enum Negotiated {
    /// 2026-07-28: requests carry the revision and stand alone; `versions` are those the
    /// server listed.
    Stateless { versions: Vec<String> },
    /// An `initialize`d connection of `version`; `session` is the id the server gave, if any
    /// (a server without sessions keeps nothing between requests).
    Session {
        version: String,
        session: Option<String>,
    },
}

impl Negotiated {
    pub fn version(&self) -> &str {
        match self {
            Negotiated::Stateless { .. } => STATELESS_REVISION,
            Negotiated::Session { version, .. } => version,
        }
    }

    /// The revisions the server is known to speak, newest first.
    pub fn versions(&self) -> Vec<String> {
        match self {
            Negotiated::Stateless { versions } => {
                let mut v = versions.clone();
                v.sort_by(|a, b| b.cmp(a));
                v.dedup();
                v
            }
            Negotiated::Session { version, .. } => vec![version.clone()],
        }
    }
}

/// A server's whole answer to a forwarded message.
#[derive(Debug, Clone)]
pub struct Forwarded {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// A session to close later, taken out of a client that can no longer do it itself (its task
/// was stopped).
#[derive(Debug, Clone)]
pub struct OpenSession {
    pub url: String,
    pub id: String,
    pub version: String,
    /// The extra header of the client that holds it (a credential toward the server), sent
    /// with every request on it made from here; its value never shows in `Debug`.
    pub header: Option<ExtraHeader>,
}

impl OpenSession {
    /// `req` with this session's extra header, if any.
    pub fn apply_header(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.header {
            Some(h) => h.apply(req),
            None => req,
        }
    }

    /// `DELETE` the session; the server may refuse (405: it does not let clients end sessions),
    /// which leaves it to expire there.
    pub async fn delete(&self, http: &reqwest::Client, timeout: Duration) -> Result<(), String> {
        let req = self.apply_header(
            http.delete(&self.url)
                .header(SESSION_HEADER, &self.id)
                .header(VERSION_HEADER, &self.version),
        );
        match tokio::time::timeout(timeout, req.send()).await {
            Err(_) => Err(format!("no answer within {}ms", timeout.as_millis())),
            Ok(Err(e)) => Err(crate::describe_reqwest(&e, timeout)),
            Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
            Ok(Ok(resp)) => Err(format!("HTTP {}", resp.status().as_u16())),
        }
    }
}

/// One MCP client of one server endpoint. Not shared: each prober or registrar owns one.
pub struct McpClient {
    http: reqwest::Client,
    url: String,
    timeout: Duration,
    client_name: String,
    max_response_bytes: usize,
    negotiated: Option<Negotiated>,
    capabilities: Value,
    /// The client capabilities this client states (`{}` unless [`McpClient::offering`]).
    offered: Value,
    next_id: u64,
    /// The server forgot the session this client kept (see [`McpClient::take_session_lost`]).
    session_lost: bool,
    /// Added to every request (see [`McpClient::with_header`]).
    header: Option<ExtraHeader>,
}

/// The client capabilities a reader of what a server offers states: those of a client of the
/// aggregate endpoint that can answer a server's questions during a call. A server may list
/// some tools only to such a client (the everything-server's elicitation and sampling tools);
/// a client that cannot answer calls them on a session opened with its own capabilities and
/// gets the server's own answer.
pub fn offered_for_listing() -> Value {
    json!({"elicitation": {}, "sampling": {}})
}

impl McpClient {
    /// A client of `url` (`http://host:port/mcp`) that names itself `client_name` in
    /// `clientInfo` and gives each request `timeout`.
    pub fn new(
        http: reqwest::Client,
        url: impl Into<String>,
        timeout: Duration,
        client_name: &str,
    ) -> Self {
        McpClient {
            http,
            url: url.into(),
            timeout,
            client_name: client_name.to_string(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            negotiated: None,
            capabilities: Value::Null,
            offered: json!({}),
            next_id: 1,
            session_lost: false,
            header: None,
        }
    }

    /// Adds `name: value` to every request this client makes (and to the `DELETE` of its
    /// session): a credential the server requires. A header invalid in HTTP is ignored.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.set_header(ExtraHeader::new(name, value));
        self
    }

    /// Replaces the header added to every request (`None`: none), for a credential that
    /// changed since the client was made.
    pub fn set_header(&mut self, header: Option<ExtraHeader>) {
        self.header = header;
    }

    /// States client `capabilities` (in `initialize`, or in every 2026-07-28 request). The
    /// client still answers no request of the server: for a reader of what a server offers
    /// to a client that could.
    pub fn offering(mut self, capabilities: Value) -> Self {
        self.offered = capabilities;
        self
    }

    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// What the server said it can do (`initialize` or `server/discover` result).
    pub fn capabilities(&self) -> &Value {
        &self.capabilities
    }

    /// The session the server holds for this client, if any.
    pub fn open_session(&self) -> Option<OpenSession> {
        match &self.negotiated {
            Some(Negotiated::Session {
                version,
                session: Some(id),
            }) => Some(OpenSession {
                url: self.url.clone(),
                id: id.clone(),
                version: version.clone(),
                header: self.header.clone(),
            }),
            _ => None,
        }
    }

    /// Ends the session, if any, and forgets the negotiation.
    pub async fn close(&mut self) -> Result<(), String> {
        let open = self.open_session();
        self.negotiated = None;
        match open {
            Some(s) => s.delete(&self.http, self.timeout).await,
            None => Ok(()),
        }
    }

    /// Opens the session's GET stream (server-to-client messages such as
    /// `notifications/tools/list_changed`) with `http`, which must have no total timeout: the
    /// stream stays open for as long as the server keeps it. Only the answer's headers are
    /// bounded by this client's timeout; read the body with [`SseScanner`]. A stateless
    /// revision or a server without a session has no such stream.
    pub async fn open_stream(&self, http: &reqwest::Client) -> Result<reqwest::Response, Failure> {
        const REQUEST: &str = "GET stream";
        let Some(session) = self.open_session() else {
            return Err(Failure::Malformed {
                request: REQUEST.into(),
                why: "no session: a stateless server or one without sessions has no stream".into(),
            });
        };
        let req = http
            .get(&self.url)
            .header(ACCEPT, "text/event-stream")
            .header(SESSION_HEADER, &session.id)
            .header(VERSION_HEADER, &session.version);
        let resp = self.send(req, REQUEST).await?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(Failure::Http {
                status,
                request: REQUEST.into(),
                error: None,
                body: String::new(),
            });
        }
        let sse = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().starts_with("text/event-stream"));
        if !sse {
            return Err(Failure::Malformed {
                request: REQUEST.into(),
                why: format!("HTTP {status} is not a text/event-stream"),
            });
        }
        Ok(resp)
    }

    /// Agrees on a revision if none is agreed yet.
    pub async fn connect(&mut self) -> Result<&Negotiated, Failure> {
        if self.negotiated.is_none() {
            let n = self.negotiate().await?;
            self.negotiated = Some(n);
        }
        match &self.negotiated {
            Some(n) => Ok(n),
            None => Err(Failure::Transport("no revision agreed".into())),
        }
    }

    async fn negotiate(&mut self) -> Result<Negotiated, Failure> {
        let discover = match self.discover().await {
            Ok(versions) if versions.iter().any(|v| v == STATELESS_REVISION) => {
                return Ok(Negotiated::Stateless { versions });
            }
            Ok(versions) => Failure::Malformed {
                request: "server/discover".into(),
                why: format!("the server lists {versions:?}, without {STATELESS_REVISION}"),
            },
            Err(e) => e,
        };
        // A server that cannot be reached will not answer initialize either.
        if !discover.is_refusal() {
            return Err(discover);
        }
        match self.initialize().await {
            Ok(n) => Ok(n),
            Err(e) if e.is_refusal() => Err(Failure::Malformed {
                request: "MCP".into(),
                why: format!(
                    "the server answered neither server/discover ({discover}) nor initialize ({e})"
                ),
            }),
            Err(e) => Err(e),
        }
    }

    /// `server/discover` in 2026-07-28 terms; the revisions the server lists.
    async fn discover(&mut self) -> Result<Vec<String>, Failure> {
        let result = self
            .request_as(
                &Negotiated::Stateless { versions: vec![] },
                "server/discover",
                json!({}),
            )
            .await?;
        let versions = result
            .get("supportedVersions")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        self.capabilities = result.get("capabilities").cloned().unwrap_or(Value::Null);
        Ok(versions)
    }

    /// `initialize` offering [`SESSION_REVISION`], then `notifications/initialized`.
    async fn initialize(&mut self) -> Result<Negotiated, Failure> {
        let params = json!({
            "protocolVersion": SESSION_REVISION,
            "capabilities": self.offered,
            "clientInfo": {"name": self.client_name, "version": env!("CARGO_PKG_VERSION")},
        });
        self.initialize_with(params).await
    }

    /// `initialize` with `params`, then `notifications/initialized`. A session id the client
    /// could not send back (empty, too long, not visible ASCII) fails the negotiation: every
    /// later request on that session would be refused.
    async fn initialize_with(&mut self, params: Value) -> Result<Negotiated, Failure> {
        let (result, headers) = self.exchange(None, "initialize", Some(params)).await?;
        let version = match result.get("protocolVersion").and_then(Value::as_str) {
            Some(v) if !v.is_empty() && v.len() <= 32 => v.to_string(),
            other => {
                return Err(Failure::Malformed {
                    request: "initialize".into(),
                    why: format!("the result carries no usable protocolVersion ({other:?})"),
                })
            }
        };
        let session = match headers.get(SESSION_HEADER) {
            None => None,
            Some(v) => match v.to_str() {
                Ok(id) if !id.is_empty() && id.len() <= 512 => Some(id.to_string()),
                _ => {
                    return Err(Failure::Malformed {
                        request: "initialize".into(),
                        why: "the Mcp-Session-Id header is not a usable session id".into(),
                    })
                }
            },
        };
        self.capabilities = result.get("capabilities").cloned().unwrap_or(Value::Null);
        let negotiated = Negotiated::Session { version, session };
        // The server may refuse requests on a session that was not confirmed.
        self.notify(&negotiated, "notifications/initialized")
            .await?;
        Ok(negotiated)
    }

    /// Whether the server forgot the session this client kept since the last time this was
    /// asked: a server whose sessions are lost at once (the prober pings its own every probe
    /// interval, far below any idle expiry) restarted.
    pub fn take_session_lost(&mut self) -> bool {
        std::mem::take(&mut self.session_lost)
    }

    /// Takes a negotiation made elsewhere (a session another client of the same server
    /// opened), so that this client sends on it.
    pub fn assume(&mut self, negotiated: Negotiated) {
        self.negotiated = Some(negotiated);
    }

    /// `initialize` with a client's own parameters (its `protocolVersion`, `capabilities`,
    /// `clientInfo`), then `notifications/initialized`: the session the gateway opens on a
    /// client's behalf. Replaces any earlier negotiation (the caller closes that first).
    pub async fn initialize_as(&mut self, params: Value) -> Result<&Negotiated, Failure> {
        self.negotiated = None;
        let negotiated = self.initialize_with(params).await?;
        Ok(self.negotiated.insert(negotiated))
    }

    /// Sends a client's JSON-RPC message as it is, on the session this client holds, and
    /// reads the whole answer (JSON or SSE, up to the size bound): a call replayed on a new
    /// session for a client whose server forgot the old one.
    /// It accepts JSON and SSE, as every Streamable HTTP client must.
    pub async fn forward(&self, body: Vec<u8>) -> Result<Forwarded, Failure> {
        self.forward_with(body, &[]).await
    }

    /// [`forward`](Self::forward) with `headers` besides the session's (the claims the
    /// gateway put on the client's request, which a replay keeps).
    pub async fn forward_with(
        &self,
        body: Vec<u8>,
        headers: &[(reqwest::header::HeaderName, HeaderValue)],
    ) -> Result<Forwarded, Failure> {
        const REQUEST: &str = "forwarded request";
        let mut req = self.post(self.negotiated.as_ref(), "").body(body);
        for (name, value) in headers {
            req = req.header(name.clone(), value.clone());
        }
        let max = self.max_response_bytes;
        let read = async {
            let mut resp = self.send(req, REQUEST).await?;
            let status = resp.status().as_u16();
            let content_type = resp
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let mut body = Vec::new();
            loop {
                match resp.chunk().await {
                    Ok(Some(c)) => {
                        if body.len() + c.len() > max {
                            return Err(Failure::Malformed {
                                request: REQUEST.into(),
                                why: format!("the answer is larger than {max} bytes"),
                            });
                        }
                        body.extend_from_slice(&c);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return Err(Failure::Transport(format!(
                            "{REQUEST}: the answer broke off: {}",
                            crate::describe_reqwest(&e, Duration::ZERO)
                        )))
                    }
                }
            }
            Ok(Forwarded {
                status,
                content_type,
                body,
            })
        };
        match tokio::time::timeout(self.timeout, read).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout(self.timeout)),
        }
    }

    /// One liveness check: `server/discover` (stateless) or `ping` on the kept session, which
    /// is re-created once if the server forgot it. `Ok` says what answered.
    pub async fn probe(&mut self) -> Result<String, Failure> {
        let negotiated = self.connect().await?.clone();
        let outcome = match &negotiated {
            Negotiated::Stateless { .. } => self
                .request_as(&negotiated, "server/discover", json!({}))
                .await
                .map(|_| format!("MCP server/discover answered ({STATELESS_REVISION})")),
            // A server that keeps no sessions keeps nothing for an initialize either.
            Negotiated::Session { session: None, .. } => self
                .initialize()
                .await
                .map(|n| format!("MCP initialize answered ({}, no session)", n.version())),
            Negotiated::Session {
                version,
                session: Some(_),
            } => {
                let version = version.clone();
                match self.request_as(&negotiated, "ping", json!({})).await {
                    Ok(_) => Ok(format!("MCP ping answered ({version}, session kept)")),
                    // The spec says 404 for a session the server no longer has; the
                    // TypeScript SDK's servers say 400 with -32000 (one rule for every part
                    // of toolgate: `toolgate_model::session_loss`).
                    Err(e) if e.session_unknown() => {
                        self.session_lost = true;
                        return self.renew_session(e).await;
                    }
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(e) = &outcome {
            // Renegotiate next time when the server refused the revision's terms (it may have
            // been replaced by a build speaking another revision).
            if e.is_refusal() && matches!(negotiated, Negotiated::Stateless { .. }) {
                self.negotiated = None;
            }
        }
        outcome
    }

    /// The session was lost: one new one, checked with a ping. A server that refuses pings on
    /// fresh sessions too gets that session deleted, so probing never piles them up.
    async fn renew_session(&mut self, lost: Failure) -> Result<String, Failure> {
        // Usually the server forgot it (a restart) and refuses the DELETE; a server that
        // refuses pings on live sessions must not keep one per probe.
        let _ = self.close().await;
        let fresh = match self.initialize().await {
            Ok(n) => n,
            Err(e) => {
                return Err(Failure::Malformed {
                    request: "ping".into(),
                    why: format!("session lost ({lost}); initialize again failed: {e}"),
                })
            }
        };
        self.negotiated = Some(fresh.clone());
        match self.request_as(&fresh, "ping", json!({})).await {
            Ok(_) => Ok(format!(
                "MCP ping answered ({}, session re-created after: {lost})",
                fresh.version()
            )),
            Err(e) => {
                let _ = self.close().await;
                Err(e)
            }
        }
    }

    /// A request in the terms of the agreed revision; its `result`.
    pub async fn request(&mut self, method: &str, params: Value) -> Result<Value, Failure> {
        let negotiated = self.connect().await?.clone();
        self.request_as(&negotiated, method, params).await
    }

    async fn request_as(
        &mut self,
        negotiated: &Negotiated,
        method: &str,
        mut params: Value,
    ) -> Result<Value, Failure> {
        if let (Negotiated::Stateless { .. }, Some(obj)) = (negotiated, params.as_object_mut()) {
            // 2026-07-28 carries the revision, the client and its capabilities in every request.
            let meta = obj.entry("_meta").or_insert_with(|| json!({}));
            if let Some(meta) = meta.as_object_mut() {
                meta.insert(
                    "io.modelcontextprotocol/protocolVersion".into(),
                    json!(STATELESS_REVISION),
                );
                meta.insert(
                    "io.modelcontextprotocol/clientInfo".into(),
                    json!({"name": self.client_name, "version": env!("CARGO_PKG_VERSION")}),
                );
                meta.insert(
                    "io.modelcontextprotocol/clientCapabilities".into(),
                    self.offered.clone(),
                );
            }
        }
        self.exchange(Some(negotiated), method, Some(params))
            .await
            .map(|(result, _)| result)
    }

    async fn notify(&mut self, negotiated: &Negotiated, method: &str) -> Result<(), Failure> {
        let body = json!({"jsonrpc": "2.0", "method": method});
        let req = self.post(Some(negotiated), method).json(&body);
        let resp = self.send(req, method).await?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            Ok(())
        } else {
            Err(Failure::Http {
                status,
                request: method.to_string(),
                error: None,
                body: String::new(),
            })
        }
    }

    fn post(&self, negotiated: Option<&Negotiated>, method: &str) -> reqwest::RequestBuilder {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        match negotiated {
            Some(Negotiated::Stateless { .. }) => {
                headers.insert(VERSION_HEADER, HeaderValue::from_static(STATELESS_REVISION));
                if let Ok(m) = HeaderValue::from_str(method) {
                    headers.insert(METHOD_HEADER, m);
                }
            }
            Some(Negotiated::Session { version, session }) => {
                if let Ok(v) = HeaderValue::from_str(version) {
                    headers.insert(VERSION_HEADER, v);
                }
                if let Some(Ok(id)) = session.as_deref().map(HeaderValue::from_str) {
                    headers.insert(SESSION_HEADER, id);
                }
            }
            None => {}
        }
        self.http.post(&self.url).headers(headers)
    }

    /// Sends one request, with the client's extra header (last: it replaces any other value of
    /// that header, such as one a forwarded request carried).
    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        request: &str,
    ) -> Result<reqwest::Response, Failure> {
        let req = match &self.header {
            Some(h) => h.apply(req),
            None => req,
        };
        match tokio::time::timeout(self.timeout, req.send()).await {
            Err(_) => Err(Failure::Timeout(self.timeout)),
            Ok(Err(e)) if e.is_timeout() => Err(Failure::Timeout(self.timeout)),
            Ok(Err(e)) => Err(Failure::Transport(format!(
                "{request}: {}",
                crate::describe_reqwest(&e, self.timeout)
            ))),
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// Sends one request and reads its response, JSON or SSE, within the timeout and the size
    /// bound; the `result` and the response headers.
    async fn exchange(
        &mut self,
        negotiated: Option<&Negotiated>,
        method: &str,
        params: Option<Value>,
    ) -> Result<(Value, HeaderMap), Failure> {
        let id = self.next_id;
        self.next_id += 1;
        let mut body = json!({"jsonrpc": "2.0", "id": id, "method": method});
        if let Some(p) = params {
            body["params"] = p;
        }
        let req = self.post(negotiated, method).json(&body);
        let timeout = self.timeout;
        let max = self.max_response_bytes;
        let read = async {
            let resp = self.send(req, method).await?;
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let sse = headers
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.to_ascii_lowercase().starts_with("text/event-stream"));
            let message = read_message(resp, id, sse, max, method).await;
            if !(200..300).contains(&status) {
                let (error, body) = match message {
                    Ok(Message::Error(e)) => (Some(e), String::new()),
                    Ok(Message::Other(text)) => (None, text),
                    _ => (None, String::new()),
                };
                return Err(Failure::Http {
                    status,
                    request: method.to_string(),
                    error,
                    body,
                });
            }
            match message? {
                Message::Result(r) => Ok((r, headers)),
                Message::Error(error) => Err(Failure::Rpc {
                    request: method.to_string(),
                    error,
                }),
                Message::Other(text) => Err(Failure::Malformed {
                    request: method.to_string(),
                    why: format!("HTTP {status} without a JSON-RPC response for id {id}: {text}"),
                }),
            }
        };
        match tokio::time::timeout(timeout, read).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout(timeout)),
        }
    }
}

enum Message {
    Result(Value),
    Error(RpcError),
    /// Not a response to the request: a snippet of what came instead.
    Other(String),
}

/// Reads the response to request `id` from a JSON body or an SSE stream (skipping the
/// notifications and requests the server sends first), stopping once it is there.
async fn read_message(
    mut resp: reqwest::Response,
    id: u64,
    sse: bool,
    max: usize,
    request: &str,
) -> Result<Message, Failure> {
    let mut scanner = SseScanner::default();
    let mut body = Vec::new();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                return Err(Failure::Transport(format!(
                    "{request}: the answer broke off: {}",
                    crate::describe_reqwest(&e, Duration::ZERO)
                )))
            }
        };
        if sse {
            for data in scanner.push(&chunk) {
                if let Some(m) = response_to(&data, id) {
                    return Ok(m);
                }
            }
            if scanner.buffered() > max {
                return Err(too_large(request, max));
            }
        } else {
            body.extend_from_slice(&chunk);
            if body.len() > max {
                return Err(too_large(request, max));
            }
        }
    }
    if sse {
        return Ok(Message::Other("the event stream ended without it".into()));
    }
    let text = String::from_utf8_lossy(&body);
    Ok(response_to(&text, id).unwrap_or_else(|| Message::Other(snippet(&text))))
}

fn too_large(request: &str, max: usize) -> Failure {
    Failure::Malformed {
        request: request.to_string(),
        why: format!("the answer is larger than {max} bytes; not read further"),
    }
}

/// The JSON-RPC response for `id` in `text`, if that is what it is. An error with a null id is
/// taken too: servers answer so when they could not read the request at all.
fn response_to(text: &str, id: u64) -> Option<Message> {
    let v: Value = serde_json::from_str(text).ok()?;
    let matches = match v.get("id") {
        Some(Value::Number(n)) => n.as_u64() == Some(id),
        Some(Value::String(s)) => s == &id.to_string(),
        Some(Value::Null) | None => v.get("error").is_some() && v.get("method").is_none(),
        _ => false,
    };
    if !matches {
        return None;
    }
    if let Some(e) = v.get("error") {
        return Some(Message::Error(RpcError {
            code: e.get("code").and_then(Value::as_i64).unwrap_or(0),
            message: snippet(e.get("message").and_then(Value::as_str).unwrap_or("")),
        }));
    }
    v.get("result").cloned().map(Message::Result)
}

/// At most 200 characters of what a server said, on one line.
fn snippet(text: &str) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let trimmed = one_line.trim();
    if trimmed.chars().count() > 200 {
        format!("{}…", trimmed.chars().take(200).collect::<String>())
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Every request a test server saw: method (HTTP, then JSON-RPC) and its `authorization`
    /// values. It answers as a legacy server with sessions, and 401 without the credential.
    type Seen = Arc<Mutex<Vec<(String, Vec<String>)>>>;

    async fn serve(seen: Seen) -> String {
        use axum::http::{HeaderMap as Headers, Method, StatusCode};
        use axum::response::IntoResponse;
        let app = axum::Router::new().route(
            "/mcp",
            axum::routing::any(move |method: Method, h: Headers, body: String| {
                let seen = seen.clone();
                async move {
                    let auth: Vec<String> = h
                        .get_all("authorization")
                        .iter()
                        .map(|v| v.to_str().unwrap_or("?").to_string())
                        .collect();
                    let req: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                    let rpc = req["method"].as_str().unwrap_or("").to_string();
                    seen.lock()
                        .unwrap()
                        .push((format!("{method} {rpc}"), auth.clone()));
                    if auth != ["Bearer s3cret"] {
                        return StatusCode::UNAUTHORIZED.into_response();
                    }
                    let id = req["id"].clone();
                    match (method, rpc.as_str()) {
                        (Method::DELETE, _) => StatusCode::OK.into_response(),
                        (Method::GET, _) => (
                            [("content-type", "text/event-stream")],
                            ": open\n\n".to_string(),
                        )
                            .into_response(),
                        (_, "initialize") => (
                            [("mcp-session-id", "s1")],
                            axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": {
                                "protocolVersion": SESSION_REVISION, "capabilities": {}}})),
                        )
                            .into_response(),
                        (_, "notifications/initialized") => StatusCode::ACCEPTED.into_response(),
                        (_, "ping") => {
                            axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": {}}))
                                .into_response()
                        }
                        _ => (
                            StatusCode::BAD_REQUEST,
                            axum::Json(json!({"jsonrpc": "2.0", "id": id,
                                "error": {"code": -32601, "message": "Method not found"}})),
                        )
                            .into_response(),
                    }
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}/mcp")
    }

    #[tokio::test]
    async fn the_extra_header_goes_with_every_request_once_and_never_shows() {
        let seen = Seen::default();
        let url = serve(seen.clone()).await;
        let t = Duration::from_secs(2);
        let http = crate::http::client(t);
        let mut c = McpClient::new(http.clone(), &url, t, "test")
            .with_header("Authorization", "Bearer s3cret");
        c.probe().await.expect("probe");
        assert!(c.probe().await.expect("probe").contains("session kept"));
        // A forwarded request's own value of the header is replaced, not doubled.
        let other = [(
            reqwest::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer theirs"),
        )];
        let body = json!({"jsonrpc": "2.0", "id": 9, "method": "ping"}).to_string();
        let answer = c
            .forward_with(body.into_bytes(), &other)
            .await
            .expect("forwarded");
        assert_eq!(answer.status, 200);
        assert!(c.open_stream(&http).await.is_ok());
        let open = c.open_session().expect("a session");
        assert!(!format!("{open:?}").contains("s3cret"), "{open:?}");
        c.close().await.expect("deleted");
        let seen = seen.lock().unwrap().clone();
        let methods: Vec<&str> = seen.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(
            methods,
            [
                "POST server/discover",
                "POST initialize",
                "POST notifications/initialized",
                "POST ping",
                "POST ping",
                "POST ping",
                "GET ",
                "DELETE "
            ]
        );
        assert!(
            seen.iter().all(|(_, auth)| auth == &["Bearer s3cret"]),
            "{seen:?}"
        );

        // Without it the server refuses; an invalid header is ignored (none is sent).
        let mut bare = McpClient::new(http.clone(), &url, t, "test").with_header("bad name", "x");
        let refused = bare.probe().await.expect_err("refused");
        assert!(refused.to_string().contains("HTTP 401"), "{refused}");
    }
}
