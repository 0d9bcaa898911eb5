//! `toolgate-register --stdio`: a stdio MCP server (one that reads JSON-RPC on stdin and
//! writes it on stdout, one client per process) served as Streamable HTTP, so that it joins
//! toolgate as an instance like any other.
//!
//! The bridge is a server toward the gateway, in every revision the gateway speaks
//! (2025-03-26 … 2026-07-28), and a client toward its server processes, which speak what they
//! speak. Its session models:
//!
//! - **A server per session** (the default): a 2025-era client's `initialize` starts a server
//!   of its own (a spare started ahead when there is one, `--spares`) and is passed to it as
//!   it is; the session's requests, answers and notifications go to that server, and what the
//!   server sends (progress, log messages, list changes, sampling, elicitation and roots
//!   requests) comes back on the session's streams. The server ends with the session
//!   (`DELETE`, `--session-idle-timeout`, or its own end when `--restart` does not start it
//!   again); beyond `--max-sessions` an `initialize` gets a JSON-RPC error. State a server
//!   keeps in its process stays with its session.
//! - **`--shared`**: one server for every session, opened by the bridge. Ids are rewritten so
//!   that each answer reaches the session that asked; progress goes to the call that gave
//!   the token, list changes to every session, and other messages of the server to the session
//!   whose call has waited longest. For servers that keep no per-client state; far cheaper.
//! - **2026-07-28 requests** stand alone: they go to a pool of warm servers (`--pool`), the
//!   least busy first.
//!
//! Faults are answered in MCP: a server that exits, writes something that is not JSON-RPC,
//! writes a line longer than `--max-message-bytes`, or hangs (calls waiting, nothing written
//! for `--hang-timeout`, and no answer to a ping) is ended, the calls waiting on it get a
//! JSON-RPC error naming what happened, and it is started again as `--restart` says. Each
//! server has its own input queue, so one that stops reading holds up nobody else.
//!
//! Layout: `child` (one process and its pipes), `lines` (bounded line reading), `wire`
//! (JSON-RPC and the revisions), `link` (the JSON-RPC connection to one server: ids, routing,
//! faults), `session` (2025-era sessions), `pool` (the servers the bridge keeps running),
//! `core` (the bridge's state and operations), `http` (the Streamable HTTP side).

mod child;
mod core;
mod http;
mod lines;
mod link;
mod pool;
mod session;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use crate::restart;

pub use self::core::Fatal;

/// How the bridge runs (the `--stdio` flags of `toolgate-register`).
#[derive(Debug, Clone)]
pub struct Options {
    /// The server's command line.
    pub command: Vec<String>,
    /// Where the MCP endpoint is served.
    pub mcp_path: String,
    /// One server for every session.
    pub shared: bool,
    pub max_sessions: usize,
    /// A session unused this long ends; zero: never.
    pub session_idle_timeout: Duration,
    /// Servers for 2026-07-28 requests and probes (at least one).
    pub pool: usize,
    /// Servers started ahead for new sessions (per-session mode).
    pub spares: usize,
    /// The longest message, each way.
    pub max_message_bytes: usize,
    /// A server with calls waiting that writes nothing this long is pinged, and ended if the
    /// ping goes unanswered as long; zero: never.
    pub hang_timeout: Duration,
    /// How long a server may take to answer its first `initialize` or `server/discover`.
    pub startup_timeout: Duration,
    /// When the bridge stops: the grace after a server's input is closed, and again after
    /// SIGTERM, before SIGKILL.
    pub stop_timeout: Duration,
    pub restart: restart::Policy,
    pub restart_limits: restart::Limits,
}

/// A running bridge.
pub struct Bridge {
    core: Arc<core::Core>,
    server: tokio::task::JoinHandle<()>,
}

impl Bridge {
    /// Serves `listener` and starts the servers the bridge keeps (the pool, the shared one,
    /// the spares). Must run on the thread that stays (children are tied to it, see
    /// `child::spawn`).
    pub fn start(listener: tokio::net::TcpListener, options: Options) -> Bridge {
        let core = core::Core::new(options);
        core.start();
        let app = http::router(Arc::clone(&core));
        let stopping = Arc::clone(&core);
        let server = tokio::spawn(async move {
            let shutdown = async move { stopping.stopping().await };
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::error!(error = %e, "the stdio bridge's HTTP server stopped");
            }
        });
        Bridge { core, server }
    }

    /// Resolves when the bridge cannot go on (its server gone for good, as `--restart` says).
    pub async fn failed(&self) -> Fatal {
        self.core.failed().await
    }

    /// Stops serving, ends every session and server.
    pub async fn shutdown(self) {
        self.core.shutdown().await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.server).await;
    }
}
