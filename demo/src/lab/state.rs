//! What the lab shares between its fault layer, its MCP tools and its
//! control API: identity, knobs, call counters, and the MCP session counts
//! that let a test prove a prober closes what it opens.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, OnceLock, PoisonError,
    },
    time::Duration,
};

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::knobs::{FailureMode, KnobError, Knobs, Layer};
use crate::mcp::TransportOptions;

pub struct LabState {
    pub instance_id: String,
    pub tools: Vec<String>,
    /// Resources `lab://doc/<i>` served, and with them one prompt (`brief`); 0: tools only.
    pub documents: usize,
    pub transport: TransportOptions,
    /// Cancelled on SIGTERM/SIGINT; releases requests parked by `hang`.
    pub shutdown: CancellationToken,
    knobs: Mutex<Knobs>,
    calls: Mutex<BTreeMap<String, u64>>,
    /// `initialize` requests received on `/mcp`, whatever rmcp made of them.
    initializes: AtomicU64,
    /// HTTP DELETEs received on `/mcp` (a client closing its session).
    deletes: AtomicU64,
    /// rmcp's session table, set once the MCP router is built (which happens
    /// after this state exists, since the router's handlers hold the state).
    /// Unset when stateless: there are no sessions to count.
    sessions: OnceLock<Arc<LocalSessionManager>>,
    /// The request headers `/mcp` received, by name: how many requests carried each, and
    /// the value the last one carried (a test proves what a gateway passed on or kept back,
    /// e.g. that no client's `Authorization` ever reached the server).
    headers: Mutex<BTreeMap<String, (u64, String)>>,
    /// The method and request target (path and query) of the last request to `/mcp`, as it
    /// arrived: a test proves what a gateway's path rewrite sent on.
    last_request: Mutex<Option<String>>,
}

/// The data behind these locks stays consistent whatever a panicking holder
/// did (each update is a single assignment), so a poisoned lock is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LabState {
    pub fn new(
        instance_id: String,
        tools: Vec<String>,
        knobs: Knobs,
        transport: TransportOptions,
        shutdown: CancellationToken,
    ) -> Self {
        let calls = tools.iter().map(|tool| (tool.clone(), 0)).collect();
        Self {
            instance_id,
            tools,
            documents: 0,
            transport,
            shutdown,
            knobs: Mutex::new(knobs),
            calls: Mutex::new(calls),
            initializes: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            sessions: OnceLock::new(),
            headers: Mutex::new(BTreeMap::new()),
            last_request: Mutex::new(None),
        }
    }

    /// Hands the state rmcp's session table, so `/control` can count live sessions.
    /// Only the first call counts: the lab builds one MCP router.
    pub fn attach_sessions(&self, sessions: Arc<LocalSessionManager>) {
        if self.sessions.set(sessions).is_err() {
            tracing::warn!("a second session table was attached; /control keeps the first");
        }
    }

    /// Live MCP sessions (0 when stateless).
    pub async fn live_sessions(&self) -> usize {
        match self.sessions.get() {
            Some(manager) => manager.sessions.read().await.len(),
            None => 0,
        }
    }

    pub fn record_initialize(&self, count: u64) {
        self.initializes.fetch_add(count, Ordering::Relaxed);
    }

    pub fn record_delete(&self) {
        self.deletes.fetch_add(1, Ordering::Relaxed);
    }

    pub fn serves(&self, tool: &str) -> bool {
        self.tools.iter().any(|served| served == tool)
    }

    pub fn knobs(&self) -> Knobs {
        lock(&self.knobs).clone()
    }

    pub fn update_knobs(&self, patch: &Value) -> Result<(), KnobError> {
        lock(&self.knobs).apply(patch)
    }

    pub fn health_fail(&self) -> bool {
        lock(&self.knobs).health_fail
    }

    pub fn mcp_wedged(&self) -> bool {
        lock(&self.knobs).mcp_wedged
    }

    pub fn listing_unreadable(&self) -> bool {
        lock(&self.knobs).listing_unreadable
    }

    pub fn latency_for(&self, tool: &str) -> Duration {
        lock(&self.knobs).latency_for(tool)
    }

    /// Decides whether this call to `tool` fails at `layer`: its mode must
    /// belong there, and the `fail_rate` draw must say so.
    pub fn draw_failure(&self, tool: &str, layer: Layer) -> Option<FailureMode> {
        let knobs = lock(&self.knobs);
        let mode = knobs.mode_for(tool);
        if mode.layer() != Some(layer) {
            return None;
        }
        // random() is in [0, 1), so a rate of 1.0 always fails and 0.0 never does.
        (rand::random::<f64>() < knobs.fail_rate).then_some(mode)
    }

    /// Counts a `tools/call` as received, whatever happens to it next. Names
    /// the lab does not serve are counted too: the call still reached it.
    pub fn record_call(&self, tool: &str) {
        *lock(&self.calls).entry(tool.to_owned()).or_default() += 1;
    }

    /// Records the request line and headers of one request to `/mcp`.
    pub fn record_request(&self, request: &axum::extract::Request) {
        let target = request.uri().path_and_query().map_or_else(
            || request.uri().path().to_owned(),
            |pq| pq.as_str().to_owned(),
        );
        *lock(&self.last_request) = Some(format!("{} {target}", request.method()));
        let headers = request.headers();
        let mut seen = lock(&self.headers);
        for name in headers.keys() {
            let value = headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
                .join(", ");
            let entry = seen.entry(name.as_str().to_owned()).or_default();
            entry.0 += 1;
            entry.1 = value;
        }
    }

    pub fn reset_counters(&self) {
        lock(&self.headers).clear();
        *lock(&self.last_request) = None;
        let mut calls = lock(&self.calls);
        calls.retain(|tool, _| self.tools.contains(tool));
        calls.values_mut().for_each(|count| *count = 0);
        self.initializes.store(0, Ordering::Relaxed);
        self.deletes.store(0, Ordering::Relaxed);
    }

    /// The `GET /control` document. Async because rmcp's session table sits
    /// behind a tokio lock.
    pub async fn snapshot(&self) -> Value {
        let calls = lock(&self.calls).clone();
        let total_calls: u64 = calls.values().sum();
        json!({
            "instance_id": self.instance_id,
            "tools": self.tools,
            "transport": self.transport,
            "knobs": self.knobs(),
            "calls": calls,
            "total_calls": total_calls,
            "sessions": self.live_sessions().await,
            "initializes": self.initializes.load(Ordering::Relaxed),
            "deletes": self.deletes.load(Ordering::Relaxed),
            "headers": lock(&self.headers)
                .iter()
                .map(|(name, (count, last))| (name.clone(), json!({"count": count, "last": last})))
                .collect::<serde_json::Map<_, _>>(),
            "last_request": *lock(&self.last_request),
        })
    }
}
