//! The active probe: `GET http://<endpoint><health_path>`, any 2xx within the timeout passes.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use super::machine::ProbeResult;

/// One client for every probe: connections to an instance are kept between probes (a probe
/// every 2 s to 5,000 instances would otherwise churn through the ephemeral ports), and a
/// frozen server is caught by the timeout on its idle connection.
pub fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout)
        .pool_max_idle_per_host(1)
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .build()
        // Only a TLS backend or a resolver that cannot start fails here; neither is used.
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// The URL the probe asks.
pub fn url(addr: SocketAddr, health_path: &str) -> String {
    let path = if health_path.starts_with('/') {
        health_path.to_string()
    } else {
        format!("/{health_path}")
    };
    format!("http://{addr}{path}")
}

pub async fn probe(client: &reqwest::Client, url: &str, timeout: Duration) -> ProbeResult {
    let started = Instant::now();
    let res = client.get(url).send().await;
    let latency_ms = started.elapsed().as_secs_f64() * 1000.0;
    let (ok, detail) = match res {
        Ok(resp) => {
            let status = resp.status();
            (status.is_success(), format!("HTTP {}", status.as_u16()))
        }
        Err(e) => (false, describe(&e, timeout)),
    };
    ProbeResult {
        at: SystemTime::now(),
        ok,
        latency_ms,
        detail,
    }
}

fn describe(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return format!("no answer within {}ms", timeout.as_millis());
    }
    // The root cause says what happened ("Connection refused"), the wrappers only "error
    // sending request".
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    if e.is_connect() {
        format!("connect failed: {source}")
    } else {
        format!("request failed: {source}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refused_and_silent_servers_fail_with_a_reason() {
        let url_of = |a: SocketAddr| url(a, "health");
        // A port nobody listens on: bind, learn the port, close.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let c = client(Duration::from_millis(300));
        let r = probe(&c, &url_of(addr), Duration::from_millis(300)).await;
        assert!(!r.ok);
        assert!(r.detail.starts_with("connect failed"), "{}", r.detail);

        // A server that accepts and never answers (a frozen process looks like this).
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let _hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        let r = probe(&c, &url_of(addr), Duration::from_millis(300)).await;
        assert!(!r.ok);
        assert_eq!(r.detail, "no answer within 300ms");
        assert!(r.latency_ms >= 290.0);
    }

    #[tokio::test]
    async fn a_2xx_passes_and_a_503_fails() {
        use axum::http::StatusCode;
        use axum::routing::get;
        let app = axum::Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/sick",
                get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "no") }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let c = client(Duration::from_secs(1));
        let r = probe(&c, &url(addr, "/health"), Duration::from_secs(1)).await;
        assert!(r.ok, "{}", r.detail);
        assert_eq!(r.detail, "HTTP 200");
        let r = probe(&c, &url(addr, "/sick"), Duration::from_secs(1)).await;
        assert!(!r.ok);
        assert_eq!(r.detail, "HTTP 503");
    }
}
