//! rmcp's Streamable HTTP server transport, mounted at `/mcp`.

use std::sync::Arc;

use axum::Router;
use rmcp::{
    transport::streamable_http_server::{
        session::{local::LocalSessionManager, never::NeverSessionManager},
        StreamableHttpServerConfig, StreamableHttpService,
    },
    ServerHandler,
};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

pub const MCP_PATH: &str = "/mcp";

/// Transport choices fixed at start: rmcp takes them when the service is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TransportOptions {
    /// `Mcp-Session-Id` sessions (rmcp's legacy session mode) for clients that
    /// `initialize`; off means every POST is served on its own.
    pub stateful: bool,
    /// Plain `application/json` replies instead of SSE. rmcp honours this only
    /// when `stateful` is off; session-mode replies are always SSE.
    pub json_response: bool,
}

/// The start-time transport flags both binaries take.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct TransportArgs {
    /// Serve without MCP sessions: no Mcp-Session-Id, every POST stands alone.
    #[arg(long)]
    pub stateless: bool,
    /// Answer requests with application/json instead of an SSE stream
    /// (rmcp applies it only together with --stateless).
    #[arg(long)]
    pub json_response: bool,
}

impl TransportArgs {
    pub fn options(self) -> TransportOptions {
        if self.json_response && !self.stateless {
            tracing::warn!(
                "--json-response has no effect without --stateless: session replies are SSE"
            );
        }
        TransportOptions {
            stateful: !self.stateless,
            json_response: self.json_response,
        }
    }
}

/// A router with rmcp's Streamable HTTP service at [`MCP_PATH`]; `handler`
/// builds the MCP server for each session (or each request when stateless).
pub fn router<S, F>(handler: F, options: TransportOptions, shutdown: &CancellationToken) -> Router
where
    S: ServerHandler,
    F: Fn() -> S + Send + Sync + 'static,
{
    router_with_sessions(handler, options, shutdown).0
}

/// [`router`], plus the session manager when `options.stateful`, so a caller
/// can count the live sessions rmcp holds (the lab shows them in `/control`,
/// which lets a test prove that a prober closes the sessions it opens).
pub fn router_with_sessions<S, F>(
    handler: F,
    options: TransportOptions,
    shutdown: &CancellationToken,
) -> (Router, Option<Arc<LocalSessionManager>>)
where
    S: ServerHandler,
    F: Fn() -> S + Send + Sync + 'static,
{
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(options.stateful)
        .with_json_response(options.json_response)
        // Ends open SSE streams and sessions on shutdown, so the graceful stop
        // does not wait for clients that keep a GET stream open.
        .with_cancellation_token(shutdown.child_token())
        // rmcp only accepts loopback Host headers by default (DNS-rebinding
        // protection for desktop servers). These servers sit behind a gateway
        // that forwards whatever Host the agent used.
        .disable_allowed_hosts();
    let factory = move || Ok(handler());
    if options.stateful {
        let sessions = Arc::new(LocalSessionManager::default());
        let router = Router::new().route_service(
            MCP_PATH,
            StreamableHttpService::new(factory, sessions.clone(), config),
        );
        (router, Some(sessions))
    } else {
        let sessions = Arc::new(NeverSessionManager::default());
        let router = Router::new().route_service(
            MCP_PATH,
            StreamableHttpService::new(factory, sessions, config),
        );
        (router, None)
    }
}
