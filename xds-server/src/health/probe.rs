//! The active probe of one instance, in the kind its registration asks for: `GET health_path`
//! (http), an MCP request on `mcp_path` (mcp), or a TCP connect (tcp). See `toolgate-probe`.
//!
//! An MCP prober keeps one server session for the life of its instance's probe task (a legacy
//! server would otherwise hold one session per probe); [`ProbeSessions`] knows every session
//! open, so a stopped task or a stopping toolgate-xds deletes them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use toolgate_model::ProbeKind;
use toolgate_probe::mcp::{ExtraHeader, McpClient, OpenSession};
use tracing::{debug, info};

use super::machine::ProbeResult;
use crate::registry::ProbeTarget;
use crate::upstream_credentials::Credentials;

pub use toolgate_probe::http::client;

/// The name the prober gives itself in `clientInfo`, so a server's logs say who initialized.
pub const CLIENT_NAME: &str = "toolgate-prober";

/// The credential an instance's server may require (`<prefix>auth/upstream/<service>`): its
/// service's, looked up before each probe, so that a rotated one is in use at the next.
#[derive(Debug, Clone, Default)]
pub struct Credential {
    service: String,
    credentials: Credentials,
}

impl Credential {
    /// `service`'s credential, as `credentials` last read it.
    pub fn of(service: &str, credentials: &Credentials) -> Credential {
        Credential {
            service: service.to_string(),
            credentials: credentials.clone(),
        }
    }

    fn header(&self) -> Option<ExtraHeader> {
        ExtraHeader::of(self.credentials.header(&self.service))
    }
}

/// One instance's prober: what it asks, and for MCP the client holding the session. The HTTP
/// and MCP probes carry the service's credential.
pub enum Prober {
    Http {
        url: String,
        addr: std::net::SocketAddr,
        credential: Credential,
    },
    Mcp(Box<McpClient>, std::net::SocketAddr, Credential),
    Tcp(std::net::SocketAddr),
}

impl Prober {
    pub fn new(
        target: &ProbeTarget,
        http: &reqwest::Client,
        timeout: Duration,
        credential: Credential,
    ) -> Prober {
        match target.kind {
            ProbeKind::Http => Prober::Http {
                url: toolgate_probe::http::url(target.addr, &target.path),
                addr: target.addr,
                credential,
            },
            ProbeKind::Mcp => Prober::Mcp(
                Box::new(McpClient::new(
                    http.clone(),
                    toolgate_probe::http::url(target.addr, &target.path),
                    timeout,
                    CLIENT_NAME,
                )),
                target.addr,
                credential,
            ),
            ProbeKind::Tcp => Prober::Tcp(target.addr),
        }
    }

    /// Probes once. A failed probe is followed by a bare connect, so the result says whether
    /// the connection was refused (nothing listens: the process is gone), which the health
    /// machine takes as certain where a timeout or an error status is not.
    pub async fn probe(&mut self, http: &reqwest::Client, timeout: Duration) -> ProbeResult {
        let started = Instant::now();
        let mut session_lost = false;
        let outcome = match self {
            Prober::Http {
                url, credential, ..
            } => {
                let header = credential.header();
                toolgate_probe::http::get_with(http, url, timeout, header.as_ref()).await
            }
            Prober::Mcp(c, _, credential) => {
                c.set_header(credential.header());
                let outcome = c
                    .probe()
                    .await
                    .map_err(|e| format!("MCP at {}: {e}", toolgate_probe::http::path_of(c.url())));
                session_lost = c.take_session_lost();
                outcome
            }
            Prober::Tcp(addr) => toolgate_probe::tcp::connect(*addr, timeout).await,
        };
        let latency_ms = started.elapsed().as_secs_f64() * 1000.0;
        let (ok, detail) = match outcome {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        let refused = !ok && toolgate_probe::tcp::refused(self.addr(), timeout).await;
        ProbeResult {
            at: SystemTime::now(),
            ok,
            latency_ms,
            detail,
            refused,
            // The server forgot the session the prober keeps: it restarted (the loop adds
            // what it saw between two passing probes).
            restarted: ok && session_lost,
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        match self {
            Prober::Http { addr, .. } | Prober::Mcp(_, addr, _) | Prober::Tcp(addr) => *addr,
        }
    }

    pub fn kind(&self) -> ProbeKind {
        match self {
            Prober::Http { .. } => ProbeKind::Http,
            Prober::Mcp(..) => ProbeKind::Mcp,
            Prober::Tcp(_) => ProbeKind::Tcp,
        }
    }

    /// The server session this prober holds, if any.
    pub fn session(&self) -> Option<OpenSession> {
        match self {
            Prober::Mcp(c, ..) => c.open_session(),
            _ => None,
        }
    }
}

/// Every MCP session the probers hold, by probe task.
#[derive(Clone)]
pub struct ProbeSessions {
    open: Arc<Mutex<HashMap<u64, OpenSession>>>,
    next: Arc<AtomicU64>,
    http: reqwest::Client,
    timeout: Duration,
}

impl ProbeSessions {
    pub fn new(http: reqwest::Client, timeout: Duration) -> Self {
        ProbeSessions {
            open: Arc::default(),
            next: Arc::new(AtomicU64::new(1)),
            http,
            timeout,
        }
    }

    /// A number for a new probe task.
    pub fn task_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Records what task `id` holds now.
    pub fn set(&self, id: u64, session: Option<OpenSession>) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        match session {
            Some(s) => {
                open.insert(id, s);
            }
            None => {
                open.remove(&id);
            }
        }
    }

    /// Deletes task `id`'s session in the background (its task is gone, or going).
    pub fn release(&self, id: u64) {
        let session = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.remove(&id)
        };
        let (Some(session), Ok(rt)) = (session, tokio::runtime::Handle::try_current()) else {
            return;
        };
        let (http, timeout) = (self.http.clone(), self.timeout);
        rt.spawn(async move {
            match session.delete(&http, timeout).await {
                Ok(()) => debug!(url = %session.url, "prober session deleted"),
                Err(e) => {
                    debug!(url = %session.url, error = %e, "deleting a prober session failed")
                }
            }
        });
    }

    /// Deletes every session, concurrently, within one timeout (toolgate-xds is stopping).
    pub async fn close_all(&self) -> usize {
        let all: Vec<OpenSession> = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.drain().map(|(_, s)| s).collect()
        };
        if all.is_empty() {
            return 0;
        }
        let deletes = all.iter().map(|s| s.delete(&self.http, self.timeout));
        let results = futures::future::join_all(deletes).await;
        let closed = results.iter().filter(|r| r.is_ok()).count();
        info!(
            sessions = all.len(),
            closed, "deleted the probers' MCP sessions"
        );
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(addr: std::net::SocketAddr, kind: ProbeKind) -> ProbeTarget {
        ProbeTarget {
            addr,
            kind,
            path: "/p".into(),
        }
    }

    #[tokio::test]
    async fn refused_and_silent_servers_fail_with_a_reason_in_every_kind() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let t = Duration::from_millis(300);
        let c = client(t);
        for kind in ProbeKind::ALL {
            let target = target(addr, kind);
            let r = Prober::new(&target, &c, t, Credential::default())
                .probe(&c, t)
                .await;
            assert!(!r.ok);
            assert!(r.detail.contains("connect failed"), "{kind}: {}", r.detail);
            assert!(r.refused, "{kind}: a closed port is a refusal");
        }

        // A server that accepts and never answers (a frozen process looks like this).
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let _hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        for kind in [ProbeKind::Http, ProbeKind::Mcp] {
            let target = target(addr, kind);
            let r = Prober::new(&target, &c, t, Credential::default())
                .probe(&c, t)
                .await;
            assert!(!r.ok);
            assert!(r.detail.ends_with("no answer within 300ms"), "{}", r.detail);
            assert!(r.latency_ms >= 290.0);
            assert!(!r.refused, "a silent server is not a refusal");
        }
        // TCP alone cannot tell: the kernel accepts for the frozen process.
        let target = target(addr, ProbeKind::Tcp);
        assert!(
            Prober::new(&target, &c, t, Credential::default())
                .probe(&c, t)
                .await
                .ok
        );
    }
}
