//! The aggregate MCP endpoint (issue 19): one MCP server per virtual server, over the tools of
//! many services, served at `/v1/aggregate/<name>` (Envoy routes `/mcp` and `/virtual/<name>`
//! here). `initialize`, `server/discover` and `tools/list` are answered from listings built
//! when the registry or the catalog changes (`listing`), never by asking the servers per
//! request; `tools/call` never comes here (the filter routes it to the tool's service).
//!
//! `jsonrpc` reads one message and the revision it speaks, `methods` answers each method,
//! `session` holds the legacy clients' gateway sessions (state in the id; see there what a
//! restart costs), `stream` carries `notifications/tools/list_changed`, `http` is the axum
//! side.

pub mod http;
pub mod jsonrpc;
pub mod listing;
pub mod methods;
pub mod relay;
pub mod session;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use toolgate_model::session_owner::{owner_of, OwnerKind};
use tracing::{debug, warn};

use crate::catalog::Catalog;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::routing::RoutingSnapshot;
use listing::{Inputs, Listing};
use session::{SessionClaims, Sessions};
use stream::Streams;

/// How often time alone may change a listing (a fleet breaker's `until` passing) is checked;
/// each check compares one number per virtual server.
const EXPIRY_CHECK: Duration = Duration::from_millis(200);
/// The least time between two refreshes: changes arriving meanwhile (a burst of registrations,
/// churn over thousands of instances) share the next one, which stays well within the second
/// clients are promised.
const COALESCE: Duration = Duration::from_millis(50);
/// A refresh reads every service and instance; at 10,000 services one takes tens of
/// milliseconds, and churn would have them back to back. The pause after one is this many
/// times as long as it took, up to [`COALESCE_MAX`].
const COALESCE_FACTOR: u32 = 5;
/// The longest pause between refreshes: a listing stays well within the promised second.
const COALESCE_MAX: Duration = Duration::from_millis(400);
/// How often idle sessions are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The endpoint's state, shared by the handlers and the refresh task.
pub struct Aggregate {
    registry: Arc<RwLock<Registry>>,
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    listings: RwLock<Arc<BTreeMap<String, Arc<Listing>>>>,
    sessions: Sessions,
    streams: Streams,
    /// What servers send clients outside calls, relayed to their GET streams.
    relays: Arc<relay::Relays>,
    /// The sessions held with servers for gateway sessions: deleted when theirs ends.
    upstream: std::sync::OnceLock<Arc<crate::upstream::UpstreamSessions>>,
    /// What the last refresh read from the registry.
    last_read: Mutex<Option<RegistryInputs>>,
}

/// The registry's part of a refresh's inputs. Most registry changes leave it alone (an
/// instance coming or going in a service that keeps serving): no listing can change then,
/// and at 10,000 services making them again costs a tenth of a second of CPU.
#[derive(PartialEq)]
struct RegistryInputs {
    servers: BTreeMap<String, toolgate_model::virtual_server::VirtualServer>,
    config: Arc<toolgate_model::policy::FilterConfig>,
    serving: std::collections::BTreeSet<String>,
}

impl Aggregate {
    /// `session_key`: the registry's session key (base64 of 32 bytes), the one the filters
    /// seal with, so that every gateway of a fleet opens every gateway session.
    pub fn new(
        registry: Arc<RwLock<Registry>>,
        catalog: Arc<Catalog>,
        metrics: Arc<Metrics>,
        session_key: &str,
    ) -> Arc<Aggregate> {
        let a = Arc::new(Aggregate {
            registry,
            catalog,
            metrics,
            listings: RwLock::default(),
            sessions: Sessions::new(session_key),
            streams: Streams::default(),
            relays: Arc::default(),
            upstream: std::sync::OnceLock::new(),
            last_read: Mutex::default(),
        });
        a.refresh();
        a
    }

    /// Rebuilds every virtual server's listing and tells the streams of those that changed.
    pub fn refresh(&self) {
        self.refresh_if(true);
    }

    /// [`refresh`](Self::refresh), unless `always` is false and the registry's part of the
    /// inputs is what the last refresh read (the catalog and the clock are the caller's to
    /// judge: it refreshes always when the catalog changed or a breaker's time is up).
    fn refresh_if(&self, always: bool) {
        // One refresh at a time (the refresh task, and a request for a virtual server defined
        // a moment ago, can both start one), so an older refresh never stores its listings
        // over a newer one's.
        let mut last = self.last_read.lock().unwrap_or_else(|p| p.into_inner());
        let listings: BTreeMap<String, Arc<Listing>> = {
            let catalog = self.catalog.read();
            // The registry's lock only for reading the inputs: the listings of 10,000 services
            // take tens of milliseconds to make, and the publisher waits for a reader to go.
            let inputs = {
                let reg = self.registry.read().unwrap_or_else(|p| p.into_inner());
                Inputs::read(&reg, &catalog, crate::fleet::now_ms())
            };
            let read = RegistryInputs {
                servers: inputs.servers.clone(),
                config: Arc::clone(&inputs.config),
                serving: inputs.serving.clone(),
            };
            if !always && last.as_ref() == Some(&read) {
                return;
            }
            *last = Some(read);
            inputs
                .servers
                .keys()
                .filter_map(|name| Some((name.clone(), Arc::new(inputs.listing(name)?))))
                .collect()
        };
        let listings = Arc::new(listings);
        // Stored before any stream is told: a client that lists again as soon as it hears
        // list_changed must get the listing that changed, or it has the old one and no reason
        // to ask again.
        *self.listings.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&listings);
        for (name, l) in listings.iter() {
            if self.streams.announce(name, l.fingerprint) {
                debug!(virtual_server = %name, tools = l.tools.len(), "tool list changed");
            }
        }
        self.streams.retain(|name| listings.contains_key(name));
    }

    /// The current listing of a virtual server; `None` when there is no such server.
    pub fn listing(&self, name: &str) -> Option<Arc<Listing>> {
        let found = self
            .listings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned();
        if found.is_some() {
            return found;
        }
        // Defined a moment ago, before the refresh task got to it?
        let defined = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .virtual_servers()
            .contains_key(name);
        if !defined {
            return None;
        }
        self.refresh();
        self.listings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// Whether a fleet breaker some listing shows open has closed since it was built.
    fn expiry_due(&self, now_ms: u64) -> bool {
        self.listings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .any(|l| l.next_expiry_ms.is_some_and(|at| at <= now_ms))
    }

    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A gateway session ended (DELETE or idle expiry): the sessions held with servers for it
    /// get their HTTP DELETE.
    pub fn session_ended(&self, id: &str, claims: Option<&SessionClaims>) {
        debug!(session = %short(id), virtual_server = ?claims.map(|c| &c.virtual_server),
            "gateway session ended");
        self.count_sessions();
        if let (Some(upstream), Some(owner)) =
            (self.upstream.get(), owner_of(OwnerKind::Gateway, id))
        {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                upstream.close_owner(&owner).await;
            });
        }
    }

    /// Ends a gateway session from the gateway's side (a server it held a session with for
    /// this one ended that session); nothing for an id that is not a live one.
    pub fn end_session(&self, id: &str) {
        let Ok(claims) = self.sessions.touch_any(id) else {
            return;
        };
        if let Ok(claims) = self.sessions.end(id, &claims.virtual_server) {
            self.session_ended(id, Some(&claims));
        }
    }

    pub fn relays(&self) -> &Arc<relay::Relays> {
        &self.relays
    }

    /// The URI a client of virtual server `server` sees for `uri` of `service`
    /// (`VirtualRoutes::shown_uri`).
    pub fn shown_uri(&self, server: &str, service: &str, uri: &str) -> String {
        let config = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .filter_config();
        match config.virtual_servers.get(server) {
            Some(routes) => routes.shown_uri(service, uri).into_owned(),
            None => uri.to_string(),
        }
    }

    /// Where the sessions held for gateway sessions live (set once, by `main`).
    pub fn hold_upstream_in(&self, upstream: Arc<crate::upstream::UpstreamSessions>) {
        let _ = self.upstream.set(upstream);
    }

    /// The `initialize` parameters of a live gateway session, to open a session with a server
    /// on its client's behalf; `None` for an id that is not one (or has ended).
    pub fn client_params(&self, id: &str) -> Option<crate::upstream::InitParams> {
        let claims = self.sessions.touch_any(id).ok()?;
        Some(crate::upstream::InitParams {
            protocol_version: claims.protocol_version,
            capabilities: claims.capabilities,
            client_info: claims.client_info,
        })
    }

    fn count_sessions(&self) {
        self.metrics
            .aggregate_sessions
            .set(self.sessions.live() as i64);
    }
}

/// Enough of an id to tell sessions apart in a log, not enough to use one.
fn short(id: &str) -> &str {
    let end = id.char_indices().nth(16).map_or(id.len(), |(i, _)| i);
    &id[..end]
}

/// Keeps the listings current until the process ends: on every state the registry publishes
/// (registrations, health, fleet breakers, overrides, virtual servers), on every catalog
/// change, and when a breaker shown open reaches its `until`; sweeps idle sessions.
pub async fn run(aggregate: Arc<Aggregate>, mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>) {
    let mut catalog = aggregate.catalog.subscribe();
    let mut expiry = tokio::time::interval(EXPIRY_CHECK);
    expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut publishing, mut reading) = (true, true);
    loop {
        // Whether the listings must be made again even if the registry's part of their inputs
        // did not change.
        let always = tokio::select! {
            changed = snapshots.changed(), if publishing => {
                publishing = changed.is_ok();
                false
            }
            changed = catalog.changed(), if reading => {
                reading = changed.is_ok();
                true
            }
            _ = expiry.tick() => {
                if !aggregate.expiry_due(crate::fleet::now_ms()) {
                    continue;
                }
                true
            }
            _ = sweep.tick() => {
                for id in aggregate.sessions.sweep() {
                    aggregate.session_ended(&id, None);
                }
                aggregate.count_sessions();
                continue;
            }
        };
        let started = std::time::Instant::now();
        // Off the async workers: at 10,000 services a refresh takes a tenth of a second of
        // CPU, and on a worker it held back the tasks queued behind it (the watch, the
        // publisher, the xDS streams: the churn's propagation p99 at 100,000 instances).
        let refreshing = Arc::clone(&aggregate);
        if let Err(e) = tokio::task::spawn_blocking(move || refreshing.refresh_if(always)).await {
            warn!(error = %e, "refreshing the aggregate listings failed");
        }
        let pause = (started.elapsed() * COALESCE_FACTOR).clamp(COALESCE, COALESCE_MAX);
        tokio::time::sleep(pause).await;
    }
}
