//! Sessions the gateway holds with MCP servers on behalf of its clients (issue 19, points 5
//! and 6).
//!
//! A client of a revision with sessions (2025-03-26 … 2025-11-25) needs a session on the
//! instance that serves it. Two cases open one here rather than through the client:
//! - the aggregate endpoint (`/mcp`): the client's session is the gateway's, so the gateway
//!   opens one per (client session, service) with the client's own `initialize` parameters
//!   when it first routes a call there;
//! - a session whose instance is gone (crashed, rolled) or forgot it (restarted): the
//!   survivor would answer 404, and the most used SDK keeps sending the dead id. The gateway
//!   opens a new session on a healthy instance with the client's parameters and replays the
//!   request there, so the client never sees the 404.
//!
//! The session is opened directly with the instance (its address comes from the registry), so
//! the answer can say which instance holds it: the `envelope` is the value Envoy's
//! stateful-session filter (envelope state, on `Mcp-Session-Id`) reads to route a request to
//! that instance, `base64(address);UV:base64(server's session id)`.
//!
//! **Where the state lives.** Here, in memory, per owner (an opaque key the filter derives
//! from the client's session) and service; the filter keeps its own copy of the envelope in
//! Envoy's shared data, so calls do not ask here. A restart of toolgate-xds forgets the map:
//! the filter's copy keeps working, and a later miss opens a new session (one more
//! `initialize` to the server, none for the client); the forgotten sessions are not deleted
//! by the gateway and expire on the server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toolgate_probe::mcp::{Forwarded, McpClient, Negotiated, OpenSession};
use tracing::{info, warn};

use crate::health::machine::State;
use crate::metrics::{HeldLabel, Metrics};
use crate::registry::Registry;
use toolgate_model::session_owner::OwnerKind;

/// Each request to a server on a client's behalf.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A held session nobody asked for this long is deleted. Filters ask again for a gateway
/// session's, or a stateless client's, every 5 minutes while it is in use
/// (`filter/src/held_session.rs`); a session re-opened for a client of a service's route is
/// asked for only when it is lost, so it is kept a day (and deleted first when [`MAX_HELD`]
/// are held).
pub const IDLE_EXPIRY: Duration = Duration::from_secs(30 * 60);
pub const ROUTE_EXPIRY: Duration = Duration::from_secs(24 * 3600);
/// The most sessions held at once; past it the least recently used is deleted first.
pub const MAX_HELD: usize = 100_000;
/// The most a client's `initialize` parameters may weigh (JSON).
pub const MAX_PARAMS_BYTES: usize = 4096;

/// A client's `initialize` parameters, replayed to the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitParams {
    #[serde(rename = "protocolVersion")]
    pub protocol_version: String,
    #[serde(default)]
    pub capabilities: Value,
    #[serde(rename = "clientInfo", default)]
    pub client_info: Value,
}

impl InitParams {
    /// The parameters as `initialize` sends them; `Err` names what is wrong.
    pub fn to_value(&self) -> Result<Value, String> {
        if self.protocol_version.is_empty() || self.protocol_version.len() > 32 {
            return Err(format!(
                "protocolVersion {:?} is not a revision",
                self.protocol_version
            ));
        }
        let v = serde_json::to_value(self).map_err(|e| e.to_string())?;
        let size = v.to_string().len();
        if size > MAX_PARAMS_BYTES {
            return Err(format!(
                "the initialize parameters weigh {size} bytes; at most {MAX_PARAMS_BYTES} are replayed"
            ));
        }
        Ok(v)
    }
}

/// Where a client's calls to a service go now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Opened {
    /// The `Mcp-Session-Id` value that routes to the session's instance; `None` when the server
    /// keeps no session (its requests may go to any instance).
    pub envelope: Option<String>,
    pub protocol_version: String,
    pub instance: String,
}

/// A request replayed on a new session, and the server's answer.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    #[serde(flatten)]
    pub opened: Opened,
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

/// Why no session could be opened, in words for the log and the client's error.
#[derive(Debug, Clone, PartialEq)]
pub enum OpenError {
    /// The request itself is wrong (parameters too large, not a revision).
    BadRequest(String),
    /// No UP instance of the service.
    NoInstance(String),
    /// Every instance tried refused or failed.
    Failed(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::BadRequest(m) | OpenError::NoInstance(m) | OpenError::Failed(m) => {
                f.write_str(m)
            }
        }
    }
}

/// The value Envoy's envelope session state routes on.
pub fn envelope(addr: SocketAddr, session: &str) -> String {
    format!(
        "{};UV:{}",
        STANDARD.encode(addr.to_string()),
        STANDARD.encode(session)
    )
}

/// The address an envelope routes to.
pub fn address_of(envelope: &str) -> Option<SocketAddr> {
    let (addr, _) = envelope.split_once(';')?;
    let bytes = STANDARD.decode(addr).ok()?;
    std::str::from_utf8(&bytes).ok()?.parse().ok()
}

struct Held {
    addr: SocketAddr,
    instance: String,
    opened: Opened,
    session: Option<OpenSession>,
    last_used: Instant,
}

/// The sessions held for clients, by (owner, service).
pub struct UpstreamSessions {
    registry: Arc<RwLock<Registry>>,
    metrics: Arc<Metrics>,
    http: reqwest::Client,
    held: Mutex<HashMap<(String, String), Held>>,
}

/// The metrics label of an owner's kind.
fn kind_label(owner: &str) -> &'static str {
    match OwnerKind::of(owner) {
        Some(OwnerKind::Gateway) => "gateway",
        Some(OwnerKind::Route) => "route",
        Some(OwnerKind::Stateless) => "stateless",
        None => "other",
    }
}

/// How long a session of `owner` may stay unused: the filters ask for gateway sessions' and
/// stateless clients' while in use, for a route client's only when it is lost.
fn expiry_of(owner: &str, idle: Duration) -> Duration {
    match OwnerKind::of(owner) {
        Some(OwnerKind::Gateway | OwnerKind::Stateless) => idle,
        _ => idle.max(ROUTE_EXPIRY),
    }
}

/// A candidate instance: its key, address and MCP URL.
struct Candidate {
    instance: String,
    addr: SocketAddr,
    url: String,
}

impl UpstreamSessions {
    pub fn new(registry: Arc<RwLock<Registry>>, metrics: Arc<Metrics>) -> Self {
        UpstreamSessions {
            registry,
            metrics,
            http: toolgate_probe::http::client(TIMEOUT),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// The UP instances of a service, those holding fewer of our sessions first, without the
    /// one at `avoid` (the instance that lost the session).
    fn candidates(&self, service: &str, avoid: Option<SocketAddr>) -> Vec<Candidate> {
        let load: HashMap<SocketAddr, usize> = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let mut load = HashMap::new();
            for h in held.values() {
                *load.entry(h.addr).or_default() += 1;
            }
            load
        };
        let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
        let mut up: Vec<Candidate> = registry
            .instances()
            .filter(|(k, i)| {
                k.service == service && i.health.state() == State::Up && Some(i.addr()) != avoid
            })
            .map(|(k, i)| Candidate {
                instance: k.instance.clone(),
                addr: i.addr(),
                url: toolgate_probe::http::url(i.addr(), &i.meta.mcp_path),
            })
            .collect();
        up.sort_by_key(|c| (load.get(&c.addr).copied().unwrap_or(0), c.instance.clone()));
        up
    }

    /// The session `owner` holds with `service`, opened now if there is none, or if the one
    /// held is the `stale` envelope the filter saw fail, or its instance is no longer UP.
    pub async fn open(
        &self,
        owner: &str,
        service: &str,
        params: &InitParams,
        stale: Option<&str>,
    ) -> Result<Opened, OpenError> {
        let key = (owner.to_string(), service.to_string());
        let lost = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            match held.get_mut(&key) {
                Some(h)
                    if stale.is_none_or(|s| h.opened.envelope.as_deref() != Some(s))
                        && self.is_up(service, h.addr) =>
                {
                    h.last_used = Instant::now();
                    return Ok(h.opened.clone());
                }
                Some(_) => {
                    let lost = held.remove(&key);
                    self.count(&held);
                    lost
                }
                None => None,
            }
        };
        let avoid = lost
            .as_ref()
            .map(|h| h.addr)
            .or_else(|| stale.and_then(address_of));
        if let Some(old) = lost {
            self.delete(old).await;
        }
        let (client, candidate) = self.initialize(service, params, avoid).await?;
        let opened = self.hold(key, client, candidate).await;
        Ok(opened)
    }

    /// Opens a new session for `owner` with `service` (not on the instance that held
    /// `stale`) and sends the client's message there; the server's whole answer.
    pub async fn replay(
        &self,
        owner: &str,
        service: &str,
        params: &InitParams,
        stale: Option<&str>,
        body: Vec<u8>,
    ) -> Result<Replayed, OpenError> {
        let opened = self.open(owner, service, params, stale).await?;
        let key = (owner.to_string(), service.to_string());
        let client = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.get(&key).map(|h| (h.session.clone(), h.addr))
        };
        let Some((session, addr)) = client else {
            return Err(OpenError::Failed(format!(
                "the session with {service} was closed while the request was replayed"
            )));
        };
        let mut client = McpClient::new(
            self.http.clone(),
            self.url_of(service, addr).unwrap_or_default(),
            TIMEOUT,
            "toolgate",
        );
        client.assume(match session {
            Some(s) => Negotiated::Session {
                version: s.version,
                session: Some(s.id),
            },
            None => Negotiated::Session {
                version: opened.protocol_version.clone(),
                session: None,
            },
        });
        let Forwarded {
            status,
            content_type,
            body,
        } = client
            .forward(body)
            .await
            .map_err(|e| OpenError::Failed(format!("replaying on {}: {e}", opened.instance)))?;
        Ok(Replayed {
            opened,
            status,
            content_type,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// Deletes every session `owner` holds (its client's session ended).
    pub async fn close_owner(&self, owner: &str) -> usize {
        let gone: Vec<Held> = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<_> = held.keys().filter(|(o, _)| o == owner).cloned().collect();
            let gone = keys.into_iter().filter_map(|k| held.remove(&k)).collect();
            self.count(&held);
            gone
        };
        let n = gone.len();
        for h in gone {
            self.delete(h).await;
        }
        n
    }

    /// Deletes the sessions idle for longer than `idle`; how many.
    pub async fn expire(&self, idle: Duration) -> usize {
        let gone: Vec<Held> = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<_> = held
                .iter()
                .filter(|((owner, _), h)| h.last_used.elapsed() > expiry_of(owner, idle))
                .map(|(k, _)| k.clone())
                .collect();
            let gone = keys.into_iter().filter_map(|k| held.remove(&k)).collect();
            self.count(&held);
            gone
        };
        let n = gone.len();
        for h in gone {
            self.delete(h).await;
        }
        n
    }

    /// Sets the gauge of sessions held, by owner kind, from the table (under its lock).
    fn count(&self, held: &HashMap<(String, String), Held>) {
        let mut by_kind: HashMap<&'static str, i64> =
            ["gateway", "route", "stateless"].map(|k| (k, 0)).into();
        for (owner, _) in held.keys() {
            *by_kind.entry(kind_label(owner)).or_default() += 1;
        }
        for (owner, n) in by_kind {
            self.metrics
                .upstream_sessions
                .get_or_create(&HeldLabel { owner })
                .set(n);
        }
    }

    /// Sessions held now.
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn is_up(&self, service: &str, addr: SocketAddr) -> bool {
        let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
        registry
            .find_by_addr(service, addr)
            .and_then(|k| registry.instance(k))
            .is_some_and(|i| i.health.state() == State::Up)
    }

    fn url_of(&self, service: &str, addr: SocketAddr) -> Option<String> {
        let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
        let key = registry.find_by_addr(service, addr)?;
        let i = registry.instance(key)?;
        Some(toolgate_probe::http::url(addr, &i.meta.mcp_path))
    }

    /// `initialize` on the first UP instance (least loaded) that accepts it.
    async fn initialize(
        &self,
        service: &str,
        params: &InitParams,
        avoid: Option<SocketAddr>,
    ) -> Result<(McpClient, Candidate), OpenError> {
        let value = params.to_value().map_err(OpenError::BadRequest)?;
        let mut candidates = self.candidates(service, avoid);
        if candidates.is_empty() && avoid.is_some() {
            // The instance that lost the session may be the only one left (it restarted).
            candidates = self.candidates(service, None);
        }
        if candidates.is_empty() {
            return Err(OpenError::NoInstance(format!(
                "service {service:?} has no healthy instance"
            )));
        }
        let mut failures = Vec::new();
        for c in candidates.into_iter().take(3) {
            let mut client = McpClient::new(self.http.clone(), c.url.clone(), TIMEOUT, "toolgate");
            match client.initialize_as(value.clone()).await {
                Ok(_) => return Ok((client, c)),
                Err(e) => {
                    warn!(service, instance = %c.instance, error = %e,
                        "opening a session for a client failed; trying another instance");
                    failures.push(format!("{}: {e}", c.instance));
                }
            }
        }
        Err(OpenError::Failed(format!(
            "no instance of {service:?} opened a session: {}",
            failures.join("; ")
        )))
    }

    async fn hold(&self, key: (String, String), client: McpClient, c: Candidate) -> Opened {
        let session = client.open_session();
        let version = client
            .negotiated()
            .map(|n| n.version().to_string())
            .unwrap_or_default();
        let opened = Opened {
            envelope: session.as_ref().map(|s| envelope(c.addr, &s.id)),
            protocol_version: version,
            instance: c.instance.clone(),
        };
        info!(service = %key.1, instance = %c.instance, owner = kind_label(&key.0),
            "opened a session for a client");
        self.metrics
            .upstream_sessions_opened
            .get_or_create(&HeldLabel {
                owner: kind_label(&key.0),
            })
            .inc();
        let evicted = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let evict = if held.len() >= MAX_HELD && !held.contains_key(&key) {
                held.iter()
                    .min_by_key(|(_, h)| h.last_used)
                    .map(|(k, _)| k.clone())
                    .and_then(|k| held.remove(&k))
            } else {
                None
            };
            let replaced = held.insert(
                key,
                Held {
                    addr: c.addr,
                    instance: c.instance,
                    opened: opened.clone(),
                    session,
                    last_used: Instant::now(),
                },
            );
            self.count(&held);
            evict.into_iter().chain(replaced).collect::<Vec<_>>()
        };
        for h in evicted {
            self.delete(h).await;
        }
        opened
    }

    async fn delete(&self, h: Held) {
        if let Some(s) = h.session {
            if let Err(e) = s.delete(&self.http, TIMEOUT).await {
                info!(instance = %h.instance, error = %e,
                    "deleting a client's session failed; the server expires it");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_is_what_envoys_envelope_state_reads() {
        let addr: SocketAddr = "127.0.0.1:44117".parse().expect("addr");
        assert_eq!(envelope(addr, "8c1f3a"), "MTI3LjAuMC4xOjQ0MTE3;UV:OGMxZjNh");
    }

    #[test]
    fn stateless_clients_sessions_expire_when_idle_like_gateway_sessions() {
        let idle = IDLE_EXPIRY;
        assert_eq!(expiry_of("gabc", idle), idle);
        assert_eq!(expiry_of("m0123", idle), idle);
        assert_eq!(expiry_of("sabc", idle), ROUTE_EXPIRY);
        assert_eq!(expiry_of("client-1", idle), ROUTE_EXPIRY);
        assert_eq!(kind_label("m0123"), "stateless");
    }

    #[test]
    fn parameters_are_bounded() {
        let small = InitParams {
            protocol_version: "2025-06-18".into(),
            capabilities: serde_json::json!({}),
            client_info: serde_json::json!({"name": "a", "version": "1"}),
        };
        assert!(small.to_value().is_ok());
        let big = InitParams {
            capabilities: serde_json::json!({"experimental": {"x": "y".repeat(MAX_PARAMS_BYTES)}}),
            ..small.clone()
        };
        assert!(big.to_value().unwrap_err().contains("at most"));
        let bad = InitParams {
            protocol_version: String::new(),
            ..small
        };
        assert!(bad.to_value().is_err());
    }
}
