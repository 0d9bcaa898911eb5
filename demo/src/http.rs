//! The server skeleton both binaries share: `/health` next to the caller's
//! routes, one listener, and a bounded graceful stop.

pub mod reset;

use std::{future::IntoFuture, io::Write, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use axum::{http::StatusCode, routing::get, Router};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use self::reset::{ResetHandle, ResettableListener};

/// Decides what `/health` answers; the lab flips it at run time.
pub type HealthProbe = Arc<dyn Fn() -> bool + Send + Sync>;

/// How long open connections (SSE streams, parked requests) get after the
/// stop signal before the process exits anyway: a client that never hangs up
/// must not keep a stopped server alive.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// `/health` (200 `ok` or 503 `unhealthy`) merged with `routes`.
pub fn router(routes: Router, healthy: HealthProbe) -> Router {
    let health = move || {
        let up = healthy();
        async move {
            if up {
                (StatusCode::OK, "ok")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "unhealthy")
            }
        }
    };
    Router::new().route("/health", get(health)).merge(routes)
}

/// Binds `listen`, prints `listening on <addr>` to stdout, serves `app` until
/// `shutdown` is cancelled, then drains for at most [`SHUTDOWN_GRACE`].
pub async fn serve(
    listen: SocketAddr,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let local_addr = listener
        .local_addr()
        .with_context(|| format!("reading the address bound for {listen}"))?;
    tracing::info!(%local_addr, "listening");
    // Harnesses wait for this exact line to learn the port the OS picked for
    // `--listen 127.0.0.1:0`; it is the only thing either binary prints to stdout.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {local_addr}").context("writing to stdout")?;
    stdout.flush().context("flushing stdout")?;
    drop(stdout);

    let server = axum::serve(
        ResettableListener::new(listener),
        app.into_make_service_with_connect_info::<ResetHandle>(),
    )
    .with_graceful_shutdown(shutdown.clone().cancelled_owned())
    .into_future();
    let grace_expired = async {
        shutdown.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = server => result.context("serving HTTP")?,
        () = grace_expired => tracing::warn!(
            grace = ?SHUTDOWN_GRACE,
            "connections still open after the grace period; exiting anyway"
        ),
    }
    tracing::info!("stopped");
    Ok(())
}
