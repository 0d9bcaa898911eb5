//! Waiting for conditions instead of sleeping for fixed times.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every 10 ms until it returns true; panics naming `what` after `timeout`.
/// Returns how long it took.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, timeout, || {
        let fut = check();
        async move { fut.await.then_some(()) }
    })
    .await
    .1
}

/// Polls `check` every 10 ms until it returns `Some`; panics naming `what` after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await {
            return (v, started.elapsed());
        }
        if started.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
