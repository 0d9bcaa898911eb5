//! SIGTERM/SIGINT turn into one cancellation token that the HTTP server, the
//! MCP sessions and any parked request all watch.

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// Returns a token cancelled on the first SIGTERM or SIGINT.
///
/// The handlers are installed before this returns, so a signal sent right
/// after the caller announces readiness is not lost.
pub fn on_signal() -> anyhow::Result<CancellationToken> {
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        cancel.cancel();
    });
    Ok(token)
}
