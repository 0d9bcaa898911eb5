//! Waiting for a server's health endpoint before registering it, so that no gateway routes to
//! an instance that cannot answer yet.

use std::time::{Duration, Instant};

use toolgate_model::Endpoint;

/// Polls `GET http://<endpoint><path>` until it answers 2xx or `timeout` passes. This is a
/// one-off readiness check at start, not discovery, so polling is the right tool here.
pub async fn wait_healthy(
    endpoint: &Endpoint,
    path: &str,
    timeout: Duration,
    mut still_wanted: impl FnMut() -> bool,
) -> Result<Duration, String> {
    let url = format!("http://{endpoint}{path}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .no_proxy()
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < timeout {
        if !still_wanted() {
            return Err("the server exited before it became healthy".into());
        }
        match client.get(&url).send().await {
            Ok(resp) if resp.status().is_success() => return Ok(started.elapsed()),
            Ok(resp) => last = format!("HTTP {}", resp.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "{url} did not answer 2xx within {} ms (last: {last})",
        timeout.as_millis()
    ))
}
