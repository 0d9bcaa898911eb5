//! Sessions the gateway holds with MCP servers on behalf of its clients.
//!
//! A client of a revision with sessions (2025-03-26 … 2025-11-25) needs a session on the
//! instance that serves it. Three cases open one here rather than through the client:
//! - the aggregate endpoint (`/mcp`): the client's session is the gateway's, so the gateway
//!   opens one per (client session, service) with the client's own `initialize` parameters
//!   when it first routes a call there;
//! - a 2026-07-28 client of `/mcp` calling a server that needs a session: one per identity it
//!   states (and user it is, when it presents a token);
//! - a session lost with its instance (crashed, rolled, restarted in place): the server
//!   answers "session unknown", and the most used SDKs keep sending the dead id. The gateway
//!   opens a new session with the client's parameters and replays the request there, once, so
//!   the client never sees it. A session the client or the live server ended is not re-opened:
//!   the one rule is `toolgate_model::session_loss`, decided here ([`UpstreamSessions::replay`])
//!   with what the registry knows of the instance (gone, or restarted since the session was
//!   opened: see `health::machine::Health::incarnation`).
//!
//! The session is opened directly with the instance (its address comes from the registry), so
//! the answer can say which instance holds it: the `envelope` is the value Envoy's
//! stateful-session filter (envelope state, on `Mcp-Session-Id`) reads to route a request to
//! that instance, `base64(address);UV:base64(server's session id)`. A replay goes the same
//! way, under the service's own limits: at most its bulkhead's `max_requests` replays in
//! flight, each within its `timeout_ms` (see docs/design.md, "Held sessions").
//!
//! **Bounds.** Held sessions are bounded per caller (the verified user, or the client's
//! address) and service, and per service ([`SessionLimits`]): beyond, the least recently used
//! session idle for [`SessionLimits::evictable_after`] is deleted to make room, and without one
//! the client is told the bound (never "could not reach a server").
//!
//! **Where the state lives.** Here, in memory, per owner (an opaque key the filter derives
//! from the client's session and user) and service; the filter keeps its own copy of the
//! envelope in Envoy's shared data, so calls do not ask here. A restart of toolgate-xds forgets
//! the map: the filter's copy keeps working, and a later miss opens a new session (one more
//! `initialize` to the server, none for the client); the forgotten sessions are not deleted
//! by the gateway and expire on the server.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use toolgate_model::session_loss::{self, Fate, Holder, HolderFacts};
use toolgate_probe::mcp::{ExtraHeader, Failure, Forwarded, McpClient, Negotiated, OpenSession};
use tracing::{info, warn};

use crate::health::machine::State;
use crate::metrics::{BoundLabel, HeldLabel, Metrics, ServiceLabel};
use crate::registry::Registry;
use crate::upstream_credentials::Credentials;
use toolgate_model::session_owner::{is_owner_of, OwnerKind};

/// Each request to open or delete a session on a client's behalf.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A held session nobody asked for this long is deleted. Filters ask again for a gateway
/// session's, or a stateless client's, every 30 seconds while it is in use
/// (`filter/src/held_session.rs`); a session re-opened for a client of a service's route is
/// asked for only when it is lost, so it is kept a day (and is the first to go at a bound).
pub const IDLE_EXPIRY: Duration = Duration::from_secs(30 * 60);
pub const ROUTE_EXPIRY: Duration = Duration::from_secs(24 * 3600);
/// The most sessions held at once; past it the least recently used is deleted first.
pub const MAX_HELD: usize = 100_000;
/// The most a client's `initialize` parameters may weigh (JSON).
pub const MAX_PARAMS_BYTES: usize = 4096;

/// How many sessions the gateway holds with servers, and when one may be ended to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Per caller (a verified user, or without a token the client's address) and service.
    pub per_caller: usize,
    /// Per service, for all callers.
    pub per_service: usize,
    /// A session unused this long may be deleted to make room for another under a bound.
    pub evictable_after: Duration,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            per_caller: 16,
            per_service: 1024,
            evictable_after: Duration::from_secs(120),
        }
    }
}

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

    /// The parameters without the capabilities (of `kinds`) under which a server would send
    /// the client requests whose answers could not reach it: a server told the client can
    /// answer would wait for nothing; told it cannot, it does without (or says so in its
    /// result) instead.
    pub fn without(&self, kinds: &[&str]) -> InitParams {
        let mut params = self.clone();
        if let Some(caps) = params.capabilities.as_object_mut() {
            for kind in kinds {
                caps.remove(*kind);
            }
        }
        params
    }
}

/// The client capabilities under which a server may send the client requests of its own.
pub const CLIENT_REQUEST_CAPABILITIES: [&str; 3] = ["elicitation", "sampling", "roots"];

/// What a gateway session's client cannot answer through the aggregate endpoint. Elicitation
/// and sampling requests come during a call, on its stream, and the client's answer finds
/// its server again (the filter notes who asked: `filter/src/asked.rs`); a server asks for
/// roots outside any call, on a stream of its session the gateway does not relay.
pub const UNANSWERABLE_ON_GATEWAY_SESSIONS: [&str; 1] = ["roots"];

/// Where a client's calls to a service go now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Opened {
    /// The `Mcp-Session-Id` value that routes to the session's instance; `None` when the server
    /// keeps no session (its requests may go to any instance).
    pub envelope: Option<String>,
    pub protocol_version: String,
    pub instance: String,
    /// When it was opened (milliseconds since the Unix epoch): a session opened before its
    /// instance's current process began was lost with the previous one.
    pub opened_ms: u64,
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

/// Whose session with which service: the owner (an opaque key the filter derives from the
/// client's session and user), whom the bounds count it for (the verified user or the
/// client's address, opaque here), and the client's `initialize` parameters.
#[derive(Debug, Clone, Copy)]
pub struct HeldFor<'a> {
    pub owner: &'a str,
    pub service: &'a str,
    pub caller: &'a str,
    pub params: &'a InitParams,
}

/// What the filter knows of a session the server no longer knows.
#[derive(Debug, Clone, Default)]
pub struct Lost {
    /// The envelope the call went with.
    pub stale: Option<String>,
    /// When that session was opened, when the filter knows (ms since the Unix epoch).
    pub opened_ms: Option<u64>,
    /// The instance that answered "session unknown" (Envoy's upstream address), when known.
    pub answered_by: Option<SocketAddr>,
}

/// Which bound a session would break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Caller,
    Service,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Caller => "caller",
            Bound::Service => "service",
        }
    }
}

/// Why no session was opened, or no answer replayed: what happened, in words for the log and
/// in a code the filter turns into the client's error.
#[derive(Debug, Clone, PartialEq)]
pub enum OpenError {
    /// The request itself is wrong (parameters too large, not a revision).
    BadRequest(String),
    /// No UP instance of the service.
    NoInstance(String),
    /// The gateway holds as many sessions as it allows, none idle enough to end.
    AtBound { bound: Bound, limit: usize },
    /// The server answered the `initialize` with an HTTP error (503: it holds all it allows).
    Refused { status: u16, detail: String },
    /// No instance could be reached (connection refused or reset).
    Unreachable(String),
    /// No instance answered in time.
    Timeout(String),
    /// The server answered, but not with a session.
    Failed(String),
    /// The client or the live server ended the session: it is not re-opened.
    Ended(String),
    /// As many replays to the service are in flight as its bulkhead allows.
    Overloaded(String),
    /// The replayed call itself failed (`timeout`, `reset`, `bad_response`).
    CallFailed {
        failure: &'static str,
        detail: String,
    },
}

impl OpenError {
    /// The code the filter reads (`failure` of the answer).
    pub fn code(&self) -> &'static str {
        match self {
            OpenError::BadRequest(_) => "bad_request",
            OpenError::NoInstance(_) => "no_instance",
            OpenError::AtBound { .. } => "at_bound",
            OpenError::Refused { .. } => "refused",
            OpenError::Unreachable(_) => "unreachable",
            OpenError::Timeout(_) => "timeout",
            OpenError::Failed(_) => "failed",
            OpenError::Ended(_) => "ended",
            OpenError::Overloaded(_) => "overloaded",
            OpenError::CallFailed { failure, .. } => failure,
        }
    }

    /// Whether the call itself went to a server and failed there (not its session).
    pub fn in_call(&self) -> bool {
        matches!(self, OpenError::CallFailed { .. })
    }

    /// Opening a session failed like this.
    fn opening(e: Failure) -> OpenError {
        match e {
            Failure::Timeout(_) => OpenError::Timeout(e.to_string()),
            Failure::Transport(_) => OpenError::Unreachable(e.to_string()),
            Failure::Http { status, .. } => OpenError::Refused {
                status,
                detail: e.to_string(),
            },
            Failure::Rpc { .. } | Failure::Malformed { .. } => OpenError::Failed(e.to_string()),
        }
    }
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::BadRequest(m)
            | OpenError::NoInstance(m)
            | OpenError::Unreachable(m)
            | OpenError::Timeout(m)
            | OpenError::Failed(m)
            | OpenError::Ended(m)
            | OpenError::Overloaded(m)
            | OpenError::Refused { detail: m, .. }
            | OpenError::CallFailed { detail: m, .. } => f.write_str(m),
            OpenError::AtBound { bound, limit } => write!(
                f,
                "the gateway holds at most {limit} sessions with this service per {}, none idle long enough to end",
                bound.as_str()
            ),
        }
    }
}

/// The `logging/setLevel` request the gateway sends a server for its client.
fn level_request(level: &str) -> Vec<u8> {
    serde_json::json!({
        "jsonrpc": "2.0",
        "id": "toolgate-set-level",
        "method": "logging/setLevel",
        "params": {"level": level},
    })
    .to_string()
    .into_bytes()
}

/// Whether a server took a client's log level (a server without the logging capability
/// refuses, which changes nothing).
fn level_taken(service: &str, level: &str, answer: &Result<Forwarded, Failure>) -> bool {
    match answer {
        Ok(f) if f.status == 200 && String::from_utf8_lossy(&f.body).contains("\"result\"") => true,
        Ok(f) => {
            info!(
                service,
                status = f.status,
                level,
                "a server did not take a client's log level (it may not log)"
            );
            false
        }
        Err(e) => {
            info!(service, error = %e, level, "sending a client's log level to a server failed");
            false
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

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

struct Held {
    service: String,
    addr: SocketAddr,
    instance: String,
    opened: Opened,
    session: Option<OpenSession>,
    last_used: Instant,
    caller: String,
}

type Key = (String, String);

/// The held sessions, and how many each caller and service has (the bounds' counts, and the
/// gauges').
#[derive(Default)]
struct Table {
    /// Ordered, so that a client session's sessions (every user's) are one range.
    held: BTreeMap<Key, Held>,
    per_service: HashMap<String, usize>,
    per_caller: HashMap<Key, usize>,
}

impl Table {
    fn insert(&mut self, key: Key, h: Held) -> Option<Held> {
        let replaced = self.remove(&key);
        self.count_one(&key.1, &h.caller);
        self.held.insert(key, h);
        replaced
    }

    fn remove(&mut self, key: &Key) -> Option<Held> {
        let h = self.held.remove(key)?;
        self.uncount(&key.1, &h.caller);
        Some(h)
    }

    /// Counts one more session of `caller` with `service`.
    fn count_one(&mut self, service: &str, caller: &str) {
        *self.per_service.entry(service.to_string()).or_default() += 1;
        *self
            .per_caller
            .entry((caller.to_string(), service.to_string()))
            .or_default() += 1;
    }

    /// Counts one session of `caller` with `service` fewer.
    fn uncount(&mut self, service: &str, caller: &str) {
        let drop_one = |n: &mut usize| {
            *n = n.saturating_sub(1);
            *n == 0
        };
        if self.per_service.get_mut(service).is_some_and(drop_one) {
            self.per_service.remove(service);
        }
        let ck = (caller.to_string(), service.to_string());
        if self.per_caller.get_mut(&ck).is_some_and(drop_one) {
            self.per_caller.remove(&ck);
        }
    }

    /// The sessions held for the client session `base` (every user's).
    fn of_base<'a>(&'a self, base: &'a str) -> impl Iterator<Item = (&'a Key, &'a Held)> + 'a {
        self.held
            .range((base.to_string(), String::new())..)
            .take_while(move |((owner, _), _)| owner.starts_with(base))
            .filter(move |((owner, _), _)| is_owner_of(owner, base))
    }

    /// The least recently used session that `pick` takes and nobody used for `idle`.
    fn idlest(&self, idle: Duration, pick: impl Fn(&Key, &Held) -> bool) -> Option<Key> {
        self.held
            .iter()
            .filter(|(k, h)| pick(k, h) && h.last_used.elapsed() >= idle)
            .min_by_key(|(_, h)| h.last_used)
            .map(|(k, _)| k.clone())
    }
}

/// The sessions held for clients, by (owner, service).
pub struct UpstreamSessions {
    registry: Arc<RwLock<Registry>>,
    metrics: Arc<Metrics>,
    http: reqwest::Client,
    limits: SessionLimits,
    table: Mutex<Table>,
    /// Per service: its bulkhead's `max_requests`, and that many replay permits.
    replays: Mutex<HashMap<String, (u32, Arc<Semaphore>)>>,
    /// The log level each client session asked for (`logging/setLevel` on the aggregate
    /// endpoint), by owner base: sent on every session held for it, and on each opened later.
    levels: Mutex<HashMap<String, String>>,
    /// Permits for clients' cancellations being passed on ([`MAX_CANCELLATIONS_IN_FLIGHT`]).
    cancellations: Arc<Semaphore>,
    /// By client session with a relay of server notifications (`crate::aggregate::relay`):
    /// changes each time a session is held for it, so that its relay looks for the new one.
    openings: Mutex<HashMap<String, tokio::sync::watch::Sender<u64>>>,
    /// The credentials toward the services' servers: every request to an instance carries
    /// its service's, as last read.
    credentials: Credentials,
}

/// Cancellations passed on at once: each goes to every session held for its client, so a
/// client sending them in a loop would otherwise make the gateway send that many times more.
pub const MAX_CANCELLATIONS_IN_FLIGHT: usize = 64;

/// The base of an owner: without the verified user it may be bound to.
fn base_of(owner: &str) -> &str {
    owner
        .split_once(toolgate_model::session_owner::IDENTITY_SEPARATOR)
        .map_or(owner, |(base, _)| base)
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
        Self::with_limits(registry, metrics, SessionLimits::default())
    }

    pub fn with_limits(
        registry: Arc<RwLock<Registry>>,
        metrics: Arc<Metrics>,
        limits: SessionLimits,
    ) -> Self {
        UpstreamSessions {
            registry,
            metrics,
            http: toolgate_probe::http::client(TIMEOUT),
            limits,
            table: Mutex::new(Table::default()),
            replays: Mutex::new(HashMap::new()),
            levels: Mutex::new(HashMap::new()),
            cancellations: Arc::new(Semaphore::new(MAX_CANCELLATIONS_IN_FLIGHT)),
            openings: Mutex::new(HashMap::new()),
            credentials: Credentials::default(),
        }
    }

    /// Sends each service's credential from `credentials` with every request to its instances.
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// The credentials toward the services' servers (for the relay of their streams).
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// `service`'s credential as a header, as last read.
    fn header(&self, service: &str) -> Option<ExtraHeader> {
        ExtraHeader::of(self.credentials.header(service))
    }

    /// A client of an instance of `service` at `url`, carrying the service's credential.
    fn client(&self, service: &str, url: String, timeout: Duration) -> McpClient {
        let mut client = McpClient::new(self.http.clone(), url, timeout, "toolgate");
        client.set_header(self.header(service));
        client
    }

    /// The sessions `owner` holds (one user's of one client session), with their services.
    pub fn sessions_of(&self, owner: &str) -> Vec<(String, OpenSession)> {
        self.table()
            .of_base(base_of(owner))
            .filter(|((o, _), _)| o == owner)
            .filter_map(|((_, service), h)| Some((service.clone(), h.session.clone()?)))
            .collect()
    }

    fn openings(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, tokio::sync::watch::Sender<u64>>> {
        self.openings.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes each time a session is held for the client session of `owner` (any user's).
    pub fn openings_of(&self, owner: &str) -> tokio::sync::watch::Receiver<u64> {
        let base = base_of(owner);
        let mut openings = self.openings();
        // The channels of relays that ended go with the next one to start.
        openings.retain(|_, tx| tx.receiver_count() > 0);
        openings
            .entry(base.to_string())
            .or_insert_with(|| tokio::sync::watch::Sender::new(0))
            .subscribe()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The UP instances of a service, those holding fewer of our sessions first, without the
    /// one at `avoid` (the instance that lost the session).
    fn candidates(&self, service: &str, avoid: Option<SocketAddr>) -> Vec<Candidate> {
        let load: HashMap<SocketAddr, usize> = {
            let table = self.table();
            let mut load = HashMap::new();
            for h in table.held.values() {
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

    /// What the registry says of the instance of `service` at `addr` now.
    fn facts(&self, service: &str, addr: SocketAddr) -> Option<HolderFacts> {
        let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
        let i = registry
            .find_by_addr(service, addr)
            .and_then(|k| registry.instance(k))?;
        Some(HolderFacts {
            serving: matches!(i.health.state(), State::Up | State::Unhealthy),
            incarnation_ms: i.health.incarnation().0,
        })
    }

    /// Asks the instance's prober to probe it now, and waits (a little longer than a probe
    /// may take) for the result: a server restarted in place a moment ago is found so, by
    /// the refused connect or the MCP session the prober keeps. `false`: no probe came.
    async fn probe_now(&self, service: &str, addr: SocketAddr) -> bool {
        let (wake, last, wait) = {
            let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
            let config = registry.health_config();
            if !config.probes {
                return false;
            }
            let Some(i) = registry
                .find_by_addr(service, addr)
                .and_then(|k| registry.instance(k))
            else {
                return false;
            };
            (
                i.wake.clone(),
                i.health.probes().last().map(|p| p.at),
                config.probe_timeout + Duration::from_millis(600),
            )
        };
        wake.notify_one();
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
            let newest = registry
                .find_by_addr(service, addr)
                .and_then(|k| registry.instance(k))
                .map(|i| i.health.probes().last().map(|p| p.at));
            match newest {
                None => return true,
                Some(at) if at != last => return true,
                Some(_) => {}
            }
        }
        false
    }

    /// Who lost a session the server no longer knows (the rule: `session_loss`). An instance
    /// that looks live and unchanged is probed first, so that a restart in place a moment
    /// ago is not taken for the server ending the session.
    async fn holder_of(&self, service: &str, lost: &Lost, opened_ms: Option<u64>) -> Holder {
        let Some(addr) = lost.stale.as_deref().and_then(address_of) else {
            return Holder::Gone;
        };
        let answered = lost.answered_by.is_none_or(|a| a == addr);
        let holder = session_loss::holder(self.facts(service, addr), opened_ms, answered);
        if holder != Holder::Live || !self.probe_now(service, addr).await {
            return holder;
        }
        session_loss::holder(self.facts(service, addr), opened_ms, answered)
    }

    /// The session `owner` holds with `service`, opened now if there is none or if its
    /// instance is gone or restarted since. `lost`: the filter saw the held session unknown
    /// to its server; it is re-opened only if lost with its instance
    /// ([`OpenError::Ended`] otherwise). `caller`: whom the bounds count it for.
    pub async fn open(&self, whose: HeldFor<'_>, lost: Option<&Lost>) -> Result<Opened, OpenError> {
        let HeldFor {
            owner,
            service,
            caller,
            params,
        } = whose;
        let key = (owner.to_string(), service.to_string());
        let held = {
            let table = self.table();
            table
                .held
                .get(&key)
                .map(|h| (h.opened.clone(), h.addr, h.instance.clone()))
        };
        let stale = lost.and_then(|l| l.stale.as_deref());
        let mut avoid = None;
        if let Some(lost) = lost {
            // When this table opened the session, it knows when.
            let opened_ms = lost.opened_ms.or_else(|| {
                held.as_ref()
                    .filter(|(o, _, _)| o.envelope.as_deref() == stale)
                    .map(|(o, _, _)| o.opened_ms)
            });
            let holder = self.holder_of(service, lost, opened_ms).await;
            if session_loss::fate(holder) == Fate::Ended {
                let removed = {
                    let mut table = self.table();
                    let ours = table
                        .held
                        .get(&key)
                        .is_some_and(|h| h.opened.envelope.as_deref() == stale);
                    let removed = if ours { table.remove(&key) } else { None };
                    self.count(&table, service);
                    removed
                };
                self.metrics
                    .upstream_sessions_ended
                    .get_or_create(&ServiceLabel {
                        service: service.to_string(),
                    })
                    .inc();
                info!(service, owner = kind_label(owner), instance = ?removed.map(|h| h.instance),
                    "a held session was ended by its client or its server; not re-opened");
                return Err(OpenError::Ended(format!(
                    "the session with {service:?} was ended by the client or by its server, which is live; it is not re-opened"
                )));
            }
            avoid = stale.and_then(address_of);
        }
        if let Some((opened, addr, _)) = &held {
            let is_stale = stale.is_some() && opened.envelope.as_deref() == stale;
            let usable = !is_stale
                && session_loss::fate(session_loss::holder(
                    self.facts(service, *addr),
                    Some(opened.opened_ms),
                    true,
                )) == Fate::Ended;
            if usable {
                // Still live where it is: another call re-opened it already, or none was lost.
                let mut table = self.table();
                if let Some(h) = table.held.get_mut(&key) {
                    h.last_used = Instant::now();
                    return Ok(h.opened.clone());
                }
            }
        }
        let replaced = held.is_some();
        let gone = {
            let mut table = self.table();
            let gone = table.remove(&key);
            self.count(&table, service);
            gone
        };
        if let Some(old) = gone {
            avoid = avoid.or(Some(old.addr));
            // The server lost the stale one; any other goes, in the background.
            if old.opened.envelope.as_deref() != stale {
                self.delete_later(old);
            }
        }
        let evicted = self.admit(&key, caller)?;
        for h in evicted {
            self.delete_later(h);
        }
        // Held for a client of the aggregate endpoint: see `InitParams::without`. A stateless
        // (2026-07-28) client has no session for a server's request to reach it on.
        let unanswerable: &[&str] = match OwnerKind::of(owner) {
            Some(OwnerKind::Gateway) => &UNANSWERABLE_ON_GATEWAY_SESSIONS,
            Some(OwnerKind::Stateless) => &CLIENT_REQUEST_CAPABILITIES,
            _ => &[],
        };
        let stripped = params.without(unanswerable);
        let params = &stripped;
        let opened = match self.initialize(service, params, avoid).await {
            Ok((client, candidate)) => self.hold(key.clone(), caller, client, candidate),
            Err(e) => {
                self.release(&key.1, caller);
                return Err(e);
            }
        };
        let level = self
            .levels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(owner)
            .cloned();
        if let Some(level) = level {
            let session = self.table().held.get(&key).and_then(|h| h.session.clone());
            if let Some(session) = session {
                self.send_level(service, &session, &level).await;
            }
        }
        if replaced || lost.is_some() {
            self.metrics
                .upstream_sessions_reopened
                .get_or_create(&ServiceLabel {
                    service: service.to_string(),
                })
                .inc();
        }
        Ok(opened)
    }

    /// Makes room for one more session of `caller` with the key's service, or says which bound
    /// stands in the way. The room is taken (counted) at once, so that sessions opened at the
    /// same moment cannot all pass a bound; [`release`](Self::release) gives it back.
    fn admit(&self, key: &Key, caller: &str) -> Result<Vec<Held>, OpenError> {
        let service = key.1.as_str();
        let limits = self.limits;
        let mut table = self.table();
        let mut evicted = Vec::new();
        let checks = [
            (
                Bound::Caller,
                limits.per_caller,
                table
                    .per_caller
                    .get(&(caller.to_string(), service.to_string()))
                    .copied()
                    .unwrap_or(0),
            ),
            (
                Bound::Service,
                limits.per_service,
                table.per_service.get(service).copied().unwrap_or(0),
            ),
        ];
        for (bound, limit, count) in checks {
            if count < limit {
                continue;
            }
            let victim = table.idlest(limits.evictable_after, |k, h| {
                k.1 == service && (bound == Bound::Service || h.caller == caller)
            });
            match victim.and_then(|v| table.remove(&v)) {
                Some(h) => {
                    self.metrics
                        .upstream_sessions_evicted
                        .get_or_create(&ServiceLabel {
                            service: service.to_string(),
                        })
                        .inc();
                    info!(service, bound = bound.as_str(), limit,
                        "deleted the least recently used idle session held for a client to make room");
                    evicted.push(h);
                }
                None => {
                    self.count(&table, service);
                    drop(table);
                    for h in evicted {
                        self.delete_later(h);
                    }
                    self.metrics
                        .upstream_sessions_refused
                        .get_or_create(&BoundLabel {
                            service: service.to_string(),
                            bound: bound.as_str(),
                        })
                        .inc();
                    warn!(service, bound = bound.as_str(), limit,
                        "refused to open a session for a client: the bound is reached and no session is idle");
                    return Err(OpenError::AtBound { bound, limit });
                }
            }
        }
        // Counted now: a placeholder the session replaces when it is opened.
        table.count_one(service, caller);
        if table.held.len() >= MAX_HELD {
            if let Some(k) = table.idlest(Duration::ZERO, |_, _| true) {
                evicted.extend(table.remove(&k));
            }
        }
        self.count(&table, service);
        Ok(evicted)
    }

    /// Gives back the room [`admit`](Self::admit) took for a session that was not opened.
    fn release(&self, service: &str, caller: &str) {
        self.table().uncount(service, caller);
    }

    /// Re-opens a session `owner` held with `service` that its server no longer knows, if it
    /// was lost with its instance (the rule: `session_loss`), and sends the client's message
    /// there with `headers` (the claims the filter put on it), under the service's bulkhead
    /// and timeout; the server's whole answer.
    pub async fn replay(
        &self,
        whose: HeldFor<'_>,
        lost: &Lost,
        body: Vec<u8>,
        headers: &[(String, String)],
    ) -> Result<Replayed, OpenError> {
        let service = whose.service;
        let (timeout, permit) = self.replay_slot(service)?;
        let opened = self.open(whose, Some(lost)).await?;
        let key = (whose.owner.to_string(), service.to_string());
        let client = {
            let table = self.table();
            table.held.get(&key).map(|h| (h.session.clone(), h.addr))
        };
        let Some((session, addr)) = client else {
            return Err(OpenError::Failed(format!(
                "the session with {service} was closed while the request was replayed"
            )));
        };
        let mut client = self.client(
            service,
            self.url_of(service, addr).unwrap_or_default(),
            timeout,
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
        let headers = self.claim_headers(service, headers);
        let forwarded = client.forward_with(body, &headers).await;
        drop(permit);
        let Forwarded {
            status,
            content_type,
            body,
        } = forwarded.map_err(|e| {
            let failure = match e {
                Failure::Timeout(_) => "timeout",
                Failure::Transport(_) => "reset",
                _ => "bad_response",
            };
            OpenError::CallFailed {
                failure,
                detail: format!("replaying on {}: {e}", opened.instance),
            }
        })?;
        Ok(Replayed {
            opened,
            status,
            content_type,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// The service's timeout, and one of its replay permits (as many as its bulkhead's
    /// `max_requests`), or why not.
    fn replay_slot(&self, service: &str) -> Result<(Duration, OwnedSemaphorePermit), OpenError> {
        let policy = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .filter_config()
            .policy_for(service, "");
        let semaphore = {
            let mut replays = self.replays.lock().unwrap_or_else(|p| p.into_inner());
            let entry = replays
                .entry(service.to_string())
                .or_insert_with(|| (0, Arc::new(Semaphore::new(0))));
            if entry.0 != policy.max_requests {
                // The bulkhead changed: a new one (replays in flight keep the old permits).
                *entry = (
                    policy.max_requests,
                    Arc::new(Semaphore::new(policy.max_requests as usize)),
                );
            }
            entry.1.clone()
        };
        let permit = semaphore.try_acquire_owned().map_err(|_| {
            OpenError::Overloaded(format!(
                "{} replays to {service:?} are in flight, as many as its bulkhead allows",
                policy.max_requests
            ))
        })?;
        Ok((Duration::from_millis(policy.timeout_ms), permit))
    }

    /// Of `headers`, those the service asked to receive verified claims in (its
    /// `claim_headers`), valid as HTTP headers.
    fn claim_headers(
        &self,
        service: &str,
        headers: &[(String, String)],
    ) -> Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)> {
        if headers.is_empty() {
            return Vec::new();
        }
        let config = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .filter_config();
        let Some(rules) = config.auth.as_ref().and_then(|a| a.services.get(service)) else {
            return Vec::new();
        };
        headers
            .iter()
            .filter(|(name, _)| {
                rules
                    .claim_headers
                    .values()
                    .any(|h| h.eq_ignore_ascii_case(name))
            })
            .filter_map(|(name, value)| {
                Some((
                    reqwest::header::HeaderName::from_bytes(name.as_bytes()).ok()?,
                    reqwest::header::HeaderValue::from_str(value).ok()?,
                ))
            })
            .collect()
    }

    /// One user of a client session (`owner`) asked for `level` of log messages
    /// (`logging/setLevel`): sent now on every session held for that owner, and kept to be
    /// sent on each session opened for it later. Another user of the same client session
    /// keeps the level it chose. How many servers took it.
    pub async fn set_log_level(&self, owner: &str, level: &str) -> usize {
        {
            let mut levels = self.levels.lock().unwrap_or_else(|p| p.into_inner());
            // As many as sessions can be held: a level is forgotten with its client session
            // (close_owner), so this bound is only ever met by a flood of sessions.
            if levels.len() < MAX_HELD || levels.contains_key(owner) {
                levels.insert(owner.to_string(), level.to_string());
            }
        }
        let body = level_request(level);
        self.send_to_all(owner, &body, |service, answer| {
            level_taken(service, level, answer)
        })
        .await
    }

    /// `logging/setLevel` on one held session; whether the server took it.
    async fn send_level(&self, service: &str, session: &OpenSession, level: &str) -> bool {
        let answer = self.send_on(service, session, level_request(level)).await;
        level_taken(service, level, &answer)
    }

    /// A client's `notifications/cancelled` (its body as the client wrote it), sent on every
    /// session held for `owner`: the client session and the user who sent it. Its request ids
    /// number that user's requests across all of them, so only the server the cancelled
    /// request went to has one by that id in flight: the others ignore it, as the
    /// specification lets a receiver do with a request it does not know. Another user's
    /// sessions never see it: their request 7 is not this user's. Returns how many servers
    /// accepted it.
    /// `None`: [`MAX_CANCELLATIONS_IN_FLIGHT`] were being passed on already, and this one
    /// was not.
    pub async fn cancel_everywhere(&self, owner: &str, body: &[u8]) -> Option<usize> {
        let _permit = Arc::clone(&self.cancellations).try_acquire_owned().ok()?;
        let took = self.send_to_all(owner, body, |service, answer| match answer {
            Ok(f) if (200..300).contains(&f.status) => true,
            Ok(f) => {
                info!(
                    service,
                    status = f.status,
                    "a server refused a client's cancellation"
                );
                false
            }
            Err(e) => {
                info!(service, error = %e, "passing a client's cancellation on to a server failed");
                false
            }
        })
        .await;
        Some(took)
    }

    /// Sends `body` on every session held for `owner` (exactly: not another user's of the
    /// same client session), all at once (one slow server delays the end by its own timeout,
    /// not the sum), and counts the answers `took` accepts.
    async fn send_to_all(
        &self,
        owner: &str,
        body: &[u8],
        took: impl Fn(&str, &Result<Forwarded, Failure>) -> bool,
    ) -> usize {
        let held = self.sessions_of(owner);
        let sent = held.iter().map(|(service, session)| async move {
            (service, self.send_on(service, session, body.to_vec()).await)
        });
        futures::future::join_all(sent)
            .await
            .iter()
            .filter(|(service, answer)| took(service, answer))
            .count()
    }

    /// One message on a held session, as its client would send it.
    async fn send_on(
        &self,
        service: &str,
        session: &OpenSession,
        body: Vec<u8>,
    ) -> Result<Forwarded, Failure> {
        let mut client = self.client(service, session.url.clone(), TIMEOUT);
        client.assume(Negotiated::Session {
            version: session.version.clone(),
            session: Some(session.id.clone()),
        });
        client.forward_with(body, &[]).await
    }

    /// Deletes every session held for the client session `base` (an owner without its user;
    /// every user's: the client's session ended).
    pub async fn close_owner(&self, base: &str) -> usize {
        self.levels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|owner, _| !is_owner_of(owner, base));
        let gone: Vec<Held> = {
            let mut table = self.table();
            let keys: Vec<Key> = table.of_base(base).map(|(k, _)| k.clone()).collect();
            let gone: Vec<(String, Held)> = keys
                .into_iter()
                .filter_map(|k| table.remove(&k).map(|h| (k.1, h)))
                .collect();
            for (service, _) in &gone {
                self.count(&table, service);
            }
            gone.into_iter().map(|(_, h)| h).collect()
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
            let mut table = self.table();
            let keys: Vec<Key> = table
                .held
                .iter()
                .filter(|((owner, _), h)| h.last_used.elapsed() > expiry_of(owner, idle))
                .map(|(k, _)| k.clone())
                .collect();
            let gone: Vec<(String, Held)> = keys
                .into_iter()
                .filter_map(|k| table.remove(&k).map(|h| (k.1, h)))
                .collect();
            for (service, _) in &gone {
                self.count(&table, service);
            }
            gone.into_iter().map(|(_, h)| h).collect()
        };
        let n = gone.len();
        for h in gone {
            self.delete(h).await;
        }
        n
    }

    /// Sets the gauges of sessions held, by owner kind and for `service`, from the table
    /// (under its lock).
    fn count(&self, table: &Table, service: &str) {
        let mut by_kind: HashMap<&'static str, i64> =
            ["gateway", "route", "stateless"].map(|k| (k, 0)).into();
        for (owner, _) in table.held.keys() {
            *by_kind.entry(kind_label(owner)).or_default() += 1;
        }
        for (owner, n) in by_kind {
            self.metrics
                .upstream_sessions
                .get_or_create(&HeldLabel { owner })
                .set(n);
        }
        let held = table.held.keys().filter(|(_, s)| s == service).count();
        let label = ServiceLabel {
            service: service.to_string(),
        };
        if held == 0 {
            self.metrics.upstream_sessions_by_service.remove(&label);
        } else {
            self.metrics
                .upstream_sessions_by_service
                .get_or_create(&label)
                .set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }

    /// Sessions held now.
    pub fn held(&self) -> usize {
        self.table().held.len()
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
        let mut last = None;
        for c in candidates.into_iter().take(3) {
            let mut client = self.client(service, c.url.clone(), TIMEOUT);
            match client.initialize_as(value.clone()).await {
                Ok(_) => return Ok((client, c)),
                Err(e) => {
                    warn!(service, instance = %c.instance, error = %e,
                        "opening a session for a client failed; trying another instance");
                    last = Some(OpenError::opening(e));
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            OpenError::NoInstance(format!("service {service:?} has no healthy instance"))
        }))
    }

    /// Keeps the session just opened (its room was taken by [`admit`](Self::admit)).
    fn hold(&self, key: Key, caller: &str, client: McpClient, c: Candidate) -> Opened {
        let session = client.open_session();
        let version = client
            .negotiated()
            .map(|n| n.version().to_string())
            .unwrap_or_default();
        let opened = Opened {
            envelope: session.as_ref().map(|s| envelope(c.addr, &s.id)),
            protocol_version: version,
            instance: c.instance.clone(),
            opened_ms: now_ms(),
        };
        info!(service = %key.1, instance = %c.instance, owner = kind_label(&key.0),
            "opened a session for a client");
        self.metrics
            .upstream_sessions_opened
            .get_or_create(&HeldLabel {
                owner: kind_label(&key.0),
            })
            .inc();
        let base = base_of(&key.0).to_string();
        let replaced = {
            let mut table = self.table();
            let service = key.1.clone();
            let replaced = table.insert(
                key,
                Held {
                    service: service.clone(),
                    addr: c.addr,
                    instance: c.instance,
                    opened: opened.clone(),
                    session,
                    last_used: Instant::now(),
                    caller: caller.to_string(),
                },
            );
            // The room admit() took, now that the session holds it.
            table.uncount(&service, caller);
            self.count(&table, &service);
            replaced
        };
        if let Some(h) = replaced {
            self.delete_later(h);
        }
        if let Some(tx) = self.openings().get(&base) {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
        opened
    }

    /// Deletes a session on its server in the background (a gone server would hold up the
    /// client's call for the whole timeout).
    fn delete_later(&self, h: Held) {
        let Some(mut session) = h.session else {
            return;
        };
        session.header = self.header(&h.service);
        let http = self.http.clone();
        let instance = h.instance;
        tokio::spawn(async move {
            if let Err(e) = session.delete(&http, TIMEOUT).await {
                info!(%instance, error = %e,
                    "deleting a client's session failed; the server expires it");
            }
        });
    }

    async fn delete(&self, h: Held) {
        if let Some(mut s) = h.session {
            s.header = self.header(&h.service);
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
        assert_eq!(address_of(&envelope(addr, "x")), Some(addr));
    }

    #[test]
    fn a_client_of_the_aggregate_endpoint_is_not_offered_to_servers_as_answering_requests() {
        let params = InitParams {
            protocol_version: "2025-11-25".into(),
            capabilities: serde_json::json!({
                "elicitation": {}, "sampling": {}, "roots": {"listChanged": true},
                "experimental": {"x": {}}
            }),
            client_info: serde_json::json!({"name": "agent", "version": "1"}),
        };
        let stripped = params.without(&CLIENT_REQUEST_CAPABILITIES);
        assert_eq!(
            stripped.capabilities,
            serde_json::json!({"experimental": {"x": {}}})
        );
        assert_eq!(stripped.client_info, params.client_info);
    }

    #[test]
    fn stateless_clients_sessions_expire_when_idle_like_gateway_sessions() {
        let idle = IDLE_EXPIRY;
        assert_eq!(expiry_of("gabc", idle), idle);
        assert_eq!(expiry_of("m0123", idle), idle);
        assert_eq!(expiry_of("m0123~ab12", idle), idle);
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

    #[test]
    fn a_client_sessions_are_one_range_of_the_table() {
        let mut t = Table::default();
        for owner in ["gA", "gA~u1", "gAB", "gA~u2", "gB", "g", "gA~u1x"] {
            t.insert(key(owner, "svc"), held("c", Duration::ZERO));
        }
        t.insert(key("gA", "other"), held("c", Duration::ZERO));
        let found: Vec<(&str, &str)> = t
            .of_base("gA")
            .map(|((o, s), _)| (o.as_str(), s.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("gA", "other"),
                ("gA", "svc"),
                ("gA~u1", "svc"),
                ("gA~u1x", "svc"),
                ("gA~u2", "svc")
            ]
        );
        assert_eq!(t.of_base("gC").count(), 0);
    }

    fn held(caller: &str, idle_for: Duration) -> Held {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        Held {
            service: "svc".into(),
            addr,
            instance: "i".into(),
            opened: Opened {
                envelope: None,
                protocol_version: "2025-06-18".into(),
                instance: "i".into(),
                opened_ms: 0,
            },
            session: None,
            last_used: Instant::now() - idle_for,
            caller: caller.into(),
        }
    }

    fn sessions(limits: SessionLimits) -> UpstreamSessions {
        let registry = Arc::new(RwLock::new(Registry::new(Default::default())));
        UpstreamSessions::with_limits(registry, Arc::new(Metrics::new()), limits)
    }

    fn key(owner: &str, service: &str) -> Key {
        (owner.to_string(), service.to_string())
    }

    #[test]
    fn a_bound_makes_room_from_the_idlest_idle_session_or_refuses() {
        let limits = SessionLimits {
            per_caller: 2,
            per_service: 3,
            evictable_after: Duration::from_secs(60),
        };
        let s = sessions(limits);
        let busy = Duration::from_secs(1);
        let idle = Duration::from_secs(120);
        {
            let mut t = s.table();
            t.insert(key("m1", "orders"), held("10.0.0.1", busy));
            t.insert(key("m2", "orders"), held("10.0.0.1", busy));
            t.insert(key("m3", "orders"), held("alice", idle));
            t.insert(key("m4", "billing"), held("10.0.0.1", idle));
        }
        // The caller's two sessions with orders are in use: refused, not evicted.
        assert_eq!(
            s.admit(&key("m5", "orders"), "10.0.0.1").err(),
            Some(OpenError::AtBound {
                bound: Bound::Caller,
                limit: 2
            })
        );
        // Another caller: the service's bound, met by ending alice's idle session.
        let evicted = s.admit(&key("m6", "orders"), "bob").expect("room made");
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].caller, "alice");
        // The room is taken: a third caller finds the service full and nothing idle.
        assert_eq!(
            s.admit(&key("m7", "orders"), "carol").err(),
            Some(OpenError::AtBound {
                bound: Bound::Service,
                limit: 3
            })
        );
        s.release("orders", "bob");
        assert!(s.admit(&key("m7", "orders"), "carol").is_ok());
        // Another service has its own count.
        assert!(s.admit(&key("m8", "billing"), "10.0.0.1").is_ok());
    }
}
