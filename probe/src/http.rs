//! The health-endpoint probe: `GET http://<endpoint><health_path>`, any 2xx within the timeout.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

/// The URL of `path` on `addr`.
pub fn url(addr: impl std::fmt::Display, path: &str) -> String {
    if path.starts_with('/') {
        format!("http://{addr}{path}")
    } else {
        format!("http://{addr}/{path}")
    }
}

/// A header added to every request of a client (a credential the server requires): its value
/// is marked sensitive and never shows in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct ExtraHeader {
    name: HeaderName,
    value: HeaderValue,
}

impl ExtraHeader {
    /// `name: value`, or `None` when either is not valid in HTTP.
    pub fn new(name: &str, value: &str) -> Option<ExtraHeader> {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        let mut value = HeaderValue::from_str(value).ok()?;
        value.set_sensitive(true);
        Some(ExtraHeader { name, value })
    }

    /// [`new`](Self::new) of a `(name, value)` pair, as a credential lookup gives it.
    pub fn of<N: AsRef<str>, V: AsRef<str>>(pair: Option<(N, V)>) -> Option<ExtraHeader> {
        pair.and_then(|(n, v)| ExtraHeader::new(n.as_ref(), v.as_ref()))
    }

    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// `req` with this header, replacing any value of the same name it had.
    pub fn apply(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let mut one = HeaderMap::with_capacity(1);
        one.insert(self.name.clone(), self.value.clone());
        req.headers(one)
    }
}

impl std::fmt::Debug for ExtraHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: [redacted]", self.name)
    }
}

/// `Ok(detail)` on a 2xx; `Err(why)` otherwise. A 404 says what it most often means: the server
/// has no health endpoint, and an MCP probe would serve.
pub async fn get(client: &reqwest::Client, url: &str, timeout: Duration) -> Result<String, String> {
    get_with(client, url, timeout, None).await
}

/// [`get`] with `header` (the credential the server requires), if any.
pub async fn get_with(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
    header: Option<&ExtraHeader>,
) -> Result<String, String> {
    let mut req = client.get(url);
    if let Some(h) = header {
        req = h.apply(req);
    }
    let sent = tokio::time::timeout(timeout, req.send()).await;
    match sent {
        Err(_) => Err(format!("no answer within {}ms", timeout.as_millis())),
        Ok(Err(e)) => Err(crate::describe_reqwest(&e, timeout)),
        Ok(Ok(resp)) => {
            let status = resp.status();
            if status.is_success() {
                Ok(format!("HTTP {}", status.as_u16()))
            } else if status == reqwest::StatusCode::NOT_FOUND {
                Err(format!(
                    "HTTP 404 on GET {}: the server has no health endpoint there (probe it with \
                     --probe mcp, or let toolgate-register pick with --probe auto)",
                    path_of(url)
                ))
            } else {
                Err(format!("HTTP {} on GET {}", status.as_u16(), path_of(url)))
            }
        }
    }
}

/// The path part of an `http://host:port/path` URL, for messages.
pub fn path_of(url: &str) -> &str {
    url.strip_prefix("http://")
        .and_then(|rest| rest.find('/').map(|i| &rest[i..]))
        .unwrap_or(url)
}

/// The one client every HTTP and MCP probe of a process shares: connections to an instance are
/// kept between probes (a probe every 2 s to 5,000 instances would otherwise churn through the
/// ephemeral ports), and a frozen server is caught by the timeout on its idle connection.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_2xx_passes_a_404_names_the_missing_endpoint_and_a_503_fails() {
        use axum::http::StatusCode;
        use axum::routing::get as route_get;
        let app = axum::Router::new()
            .route("/health", route_get(|| async { "ok" }))
            .route(
                "/sick",
                route_get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "no") }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let c = client(Duration::from_secs(1));
        let t = Duration::from_secs(1);
        assert_eq!(get(&c, &url(addr, "/health"), t).await.unwrap(), "HTTP 200");
        assert_eq!(
            get(&c, &url(addr, "/sick"), t).await.unwrap_err(),
            "HTTP 503 on GET /sick"
        );
        let missing = get(&c, &url(addr, "health2"), t).await.unwrap_err();
        assert!(
            missing.starts_with("HTTP 404 on GET /health2: the server has no health endpoint"),
            "{missing}"
        );
    }

    #[tokio::test]
    async fn a_probe_with_a_header_carries_it_and_never_shows_its_value() {
        use axum::http::{HeaderMap as Headers, StatusCode};
        let app = axum::Router::new().route(
            "/health",
            axum::routing::get(|h: Headers| async move {
                let values: Vec<_> = h.get_all("authorization").iter().collect();
                if values.len() == 1 && values[0] == "Bearer s3cret" {
                    StatusCode::OK
                } else {
                    StatusCode::UNAUTHORIZED
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let c = client(Duration::from_secs(1));
        let t = Duration::from_secs(1);
        let u = url(addr, "/health");
        let h = ExtraHeader::new("Authorization", "Bearer s3cret").expect("valid");
        assert_eq!(get_with(&c, &u, t, Some(&h)).await.unwrap(), "HTTP 200");
        assert_eq!(get(&c, &u, t).await.unwrap_err(), "HTTP 401 on GET /health");
        let shown = format!("{h:?}");
        assert_eq!(shown, "authorization: [redacted]");
        assert!(ExtraHeader::new("bad name", "v").is_none());
        assert!(ExtraHeader::new("x-key", "line\nbreak").is_none());
        assert!(ExtraHeader::of(None::<(String, String)>).is_none());
        assert_eq!(
            ExtraHeader::of(Some(("x-key".to_string(), "v".to_string()))).map(|h| h.name().clone()),
            Some(HeaderName::from_static("x-key"))
        );
    }
}
