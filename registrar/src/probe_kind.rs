//! Which probe kind an instance is registered with, and waiting until that probe passes before
//! registering it, so that no gateway routes to an instance that cannot answer yet.
//!
//! `auto` prefers the health endpoint (cheap, and the server chose to have it) and falls back
//! to the MCP endpoint, which every MCP server has. TCP is only ever asked for: a connect
//! proves too little to be picked silently.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;
use toolgate_model::{Endpoint, ProbeKind};
use toolgate_probe::mcp::McpClient;

/// What `--probe` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requested {
    Auto,
    Kind(ProbeKind),
}

impl std::str::FromStr for Requested {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Requested::Auto);
        }
        s.parse::<ProbeKind>()
            .map(Requested::Kind)
            .map_err(|_| format!("probe kind {s:?} is not one of auto, http, mcp, tcp"))
    }
}

/// Where the instance answers, and the client that asks it.
pub struct Target {
    pub endpoint: Endpoint,
    pub health_path: String,
    pub mcp_path: String,
    pub timeout: Duration,
    http: reqwest::Client,
}

impl Target {
    pub fn new(endpoint: Endpoint, health_path: &str, mcp_path: &str, timeout: Duration) -> Self {
        Target {
            endpoint,
            health_path: health_path.to_string(),
            mcp_path: mcp_path.to_string(),
            timeout,
            http: toolgate_probe::http::client(timeout),
        }
    }

    pub fn health_url(&self) -> String {
        toolgate_probe::http::url(&self.endpoint, &self.health_path)
    }

    pub fn mcp_url(&self) -> String {
        toolgate_probe::http::url(&self.endpoint, &self.mcp_path)
    }

    /// The registrar's one MCP client of the instance (probe, listing, stream, session).
    pub fn mcp_client(&self) -> McpClient {
        McpClient::new(
            self.http.clone(),
            self.mcp_url(),
            self.timeout,
            "toolgate-register",
        )
        // Its listing decides the registered tools: it sees what a client of /mcp may.
        .offering(toolgate_probe::mcp::offered_for_listing())
    }

    async fn socket_addr(&self) -> Result<SocketAddr, String> {
        let hostport = self.endpoint.to_string();
        let resolved = tokio::net::lookup_host(hostport.as_str())
            .await
            .map(|mut addrs| addrs.next());
        match resolved {
            Ok(Some(addr)) => Ok(addr),
            Ok(None) => Err(format!("{hostport} resolves to no address")),
            Err(e) => Err(format!("resolving {hostport}: {e}")),
        }
    }

    /// One check of `kind`; `Ok` says what answered.
    pub async fn check(&self, kind: ProbeKind, mcp: &mut McpClient) -> Result<String, String> {
        match kind {
            ProbeKind::Http => {
                toolgate_probe::http::get(&self.http, &self.health_url(), self.timeout).await
            }
            ProbeKind::Mcp => mcp.probe().await.map_err(|e| e.to_string()),
            ProbeKind::Tcp => {
                let addr = self.socket_addr().await?;
                toolgate_probe::tcp::connect(addr, self.timeout).await
            }
        }
    }

    /// One round of `auto`: the health endpoint, then the MCP endpoint.
    pub async fn detect_once(&self, mcp: &mut McpClient) -> Result<Chosen, Attempts> {
        let http =
            match toolgate_probe::http::get(&self.http, &self.health_url(), self.timeout).await {
                Ok(detail) => {
                    return Ok(Chosen {
                        kind: ProbeKind::Http,
                        why: format!("GET {} answered {detail}", self.health_path),
                    })
                }
                Err(why) => why,
            };
        if says_unhealthy(&http) {
            // The server has a health endpoint and says it is not healthy (yet): probing it
            // some other way would route to an instance that says it cannot serve.
            return Err(Attempts { http, mcp: None });
        }
        match mcp.probe().await {
            Ok(detail) => {
                // The health endpoint was not reached at all (nothing listened yet, the
                // server was starting while MCP was asked): it is asked again now that the
                // server answers, or a server with one would be probed the costlier way.
                let http = if http.starts_with("HTTP ") {
                    http
                } else {
                    match toolgate_probe::http::get(&self.http, &self.health_url(), self.timeout)
                        .await
                    {
                        Ok(detail) => {
                            return Ok(Chosen {
                                kind: ProbeKind::Http,
                                why: format!(
                                    "GET {} answered {detail} (once the server was up)",
                                    self.health_path
                                ),
                            })
                        }
                        Err(why) if says_unhealthy(&why) => {
                            return Err(Attempts {
                                http: why,
                                mcp: None,
                            })
                        }
                        Err(why) => why,
                    }
                };
                Ok(Chosen {
                    kind: ProbeKind::Mcp,
                    why: format!(
                        "GET {}: {http}; MCP at {}: {detail}",
                        self.health_path, self.mcp_path
                    ),
                })
            }
            Err(e) => Err(Attempts {
                http,
                mcp: Some(e.to_string()),
            }),
        }
    }

    /// The message for an `auto` that found nothing, naming both attempts.
    pub fn no_kind_works(&self, attempts: &Attempts) -> String {
        no_kind_works(&self.endpoint, &self.health_path, &self.mcp_path, attempts)
    }
}

/// The revisions a server listed that a registration can carry (the model's rules, at most
/// [`toolgate_model::instance::MAX_PROTOCOL_VERSIONS`], in the given order), and the rest: a
/// server listing nonsense must not keep its instance from being registered.
pub fn registrable_versions(
    endpoint: &Endpoint,
    versions: Vec<String>,
) -> (Vec<String>, Vec<String>) {
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for v in versions {
        let mut probe = toolgate_model::InstanceMetadata::new("x", endpoint.clone());
        probe.protocol_versions = vec![v.clone()];
        if probe.validate().is_ok() && kept.len() < toolgate_model::instance::MAX_PROTOCOL_VERSIONS
        {
            kept.push(v);
        } else {
            dropped.push(v.chars().take(40).collect());
        }
    }
    (kept, dropped)
}

/// A 5xx from the health endpoint: it exists and reports the server unhealthy, unlike a 404
/// (no health endpoint: the MCP endpoint is asked instead). Matches the wording of
/// [`toolgate_probe::http::get`].
fn says_unhealthy(http_error: &str) -> bool {
    http_error.starts_with("HTTP 5")
}

/// The kind `auto` picked and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Chosen {
    pub kind: ProbeKind,
    pub why: String,
}

/// What each attempt of an `auto` round got; `mcp` is `None` when it was not tried.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempts {
    pub http: String,
    pub mcp: Option<String>,
}

pub fn no_kind_works(
    endpoint: &Endpoint,
    health_path: &str,
    mcp_path: &str,
    attempts: &Attempts,
) -> String {
    let mcp = match &attempts.mcp {
        Some(why) => why.clone(),
        None => "not tried: the health endpoint exists and reports the server unhealthy".into(),
    };
    format!(
        "no probe kind works for {endpoint}: GET {health_path}: {}; MCP at {mcp_path}: {mcp}",
        attempts.http
    )
}

/// Retries `auto` detection (or the asked kind's check) every 100 ms until it passes, the
/// deadline passes (at least one round is made), or `still_wanted` says the server is gone.
pub async fn settle(
    target: &Target,
    requested: Requested,
    mcp: &mut McpClient,
    deadline: Instant,
    mut still_wanted: impl FnMut() -> bool,
) -> Result<Chosen, String> {
    let started = Instant::now();
    loop {
        let failed = match requested {
            Requested::Auto => match target.detect_once(mcp).await {
                Ok(chosen) => return Ok(chosen),
                Err(attempts) => target.no_kind_works(&attempts),
            },
            Requested::Kind(kind) => match target.check(kind, mcp).await {
                Ok(detail) => {
                    return Ok(Chosen {
                        kind,
                        why: format!("asked for; {detail}"),
                    })
                }
                Err(why) => format!("the {kind} probe of {} fails: {why}", target.endpoint),
            },
        };
        if Instant::now() >= deadline {
            return Err(if started.elapsed() >= Duration::from_millis(500) {
                format!(
                    "{failed} (still so after {} ms)",
                    started.elapsed().as_millis()
                )
            } else {
                failed
            });
        }
        if !still_wanted() {
            return Err(format!("the server exited before it answered: {failed}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failure_names_both_attempts() {
        let ep: Endpoint = "127.0.0.1:9000".parse().unwrap();
        let msg = no_kind_works(
            &ep,
            "/health",
            "/mcp",
            &Attempts {
                http: "HTTP 404 on GET /health: no".into(),
                mcp: Some("server/discover: HTTP 404".into()),
            },
        );
        assert_eq!(
            msg,
            "no probe kind works for 127.0.0.1:9000: GET /health: HTTP 404 on GET /health: no; \
             MCP at /mcp: server/discover: HTTP 404"
        );
        let sick = no_kind_works(
            &ep,
            "/hz",
            "/m",
            &Attempts {
                http: "HTTP 503 on GET /hz".into(),
                mcp: None,
            },
        );
        assert!(sick.contains("GET /hz: HTTP 503"), "{sick}");
        assert!(sick.contains("MCP at /m: not tried"), "{sick}");
    }

    #[test]
    fn nonsense_revisions_are_dropped_not_fatal() {
        let ep: Endpoint = "127.0.0.1:9000".parse().unwrap();
        let mut listed = vec!["2026-07-28".to_string(), "a b".into(), String::new()];
        listed.extend((0..20).map(|i| format!("v{i}")));
        let (kept, dropped) = registrable_versions(&ep, listed);
        assert_eq!(kept.len(), 16);
        assert_eq!(kept[0], "2026-07-28");
        assert_eq!(dropped.len(), 7);
        assert_eq!(dropped[0], "a b");
        let mut m = toolgate_model::InstanceMetadata::new("x", ep);
        m.protocol_versions = kept;
        assert!(m.validate().is_ok());
    }

    #[test]
    fn requested_kinds_parse_and_bad_ones_name_the_choices() {
        assert_eq!("auto".parse::<Requested>(), Ok(Requested::Auto));
        assert_eq!(
            "tcp".parse::<Requested>(),
            Ok(Requested::Kind(ProbeKind::Tcp))
        );
        let e = "grpc".parse::<Requested>().unwrap_err();
        assert!(e.contains("auto, http, mcp, tcp"), "{e}");
    }

    #[tokio::test]
    async fn a_404_health_falls_through_to_mcp_and_a_503_does_not() {
        use axum::http::StatusCode;
        use axum::routing::{get, post};
        let app = axum::Router::new()
            .route(
                "/sick",
                get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "no") }),
            )
            // A JSON-RPC answer to anything: server/discover lists the stateless revision.
            .route(
                "/mcp",
                post(|body: String| async move {
                    let id = serde_json::from_str::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v.get("id").cloned())
                        .unwrap_or(serde_json::Value::Null);
                    axum::Json(serde_json::json!({
                        "jsonrpc": "2.0", "id": id,
                        "result": {"supportedVersions": ["2026-07-28"], "capabilities": {}}
                    }))
                }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let ep: Endpoint = addr.to_string().parse().unwrap();

        let t = Target::new(ep.clone(), "/health", "/mcp", Duration::from_secs(1));
        let chosen = t.detect_once(&mut t.mcp_client()).await.unwrap();
        assert_eq!(chosen.kind, ProbeKind::Mcp);
        assert!(chosen.why.contains("HTTP 404"), "{}", chosen.why);

        let t = Target::new(ep.clone(), "/sick", "/mcp", Duration::from_secs(1));
        let attempts = t.detect_once(&mut t.mcp_client()).await.unwrap_err();
        assert_eq!(attempts.mcp, None);
        assert!(attempts.http.starts_with("HTTP 503"), "{}", attempts.http);

        let t = Target::new(ep, "/health", "/nothing", Duration::from_secs(1));
        let err = settle(
            &t,
            Requested::Auto,
            &mut t.mcp_client(),
            Instant::now(),
            || true,
        )
        .await
        .unwrap_err();
        assert!(err.contains("GET /health: HTTP 404"), "{err}");
        assert!(err.contains("MCP at /nothing: "), "{err}");
    }
}
