//! The ADS server, incremental variant (`DeltaAggregatedResources`): the protocol half for an
//! Envoy whose bootstrap says `api_type: DELTA_GRPC`. It shares the cache with state of the
//! world (`ads.rs`); what differs is what goes on the wire. Each resource has its own version
//! (its content hash), a push carries only the resources whose version this Envoy does not
//! hold, and a resource that is gone is named in `removed_resources`. So a new service costs
//! one cluster, its assignment and the route configuration, not every cluster again.
//!
//! Envoy's rules that shape the pushes: a cluster that is new or changed warms until it gets an
//! assignment, so every assignment whose cluster was just sent goes again even if its version
//! did not change; and removals go after every update of the push, so a route never points at
//! a cluster that is already gone.
//!
//! One rule of ours: a filter configuration that changed only with services (the catalog, the
//! virtual servers' names, the legacy revisions) goes after the clusters and routes it changed
//! with, once Envoy has answered them. Envoy applies responses one after another on its main
//! thread, and a new cluster takes traffic once its assignment is applied, which Envoy asks for
//! only after it has the cluster: sent beside the cluster and routes, the filter configuration
//! was applied before that assignment. It costs Envoy 9-17 ms (its `update_duration`, p50 at 40
//! and at 1,000 services; 4 ms for a wasm filter that does nothing), and a new service changes
//! it (the catalog), so that was on the path of every new service to its first routed call;
//! now the service is routed first. Until the configuration lands (a few ms later; it
//! already came after the routes before), the filter treats the new service as any service
//! outside its catalog: auth rules and operators' overrides apply, no breaker is created.
//!
//! A configuration in which anything else changed (an operator's override, a policy, an auth
//! rule, a fleet opening: [`TypeSnapshot::urgency`]) never waits, and ends any wait: it goes
//! at once, whole (one ECDS resource cannot be split), new services' catalog included. That
//! costs those services the 9-17 ms above before their first routed call, once; an override
//! held behind a burst of registrations would leave a tool the operator closed open for as
//! long as the burst lasts.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::ControlPlane;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};
use tracing::{debug, warn};

use super::ads::{log_end, record_push, CacheView, Closed, ConnectedGuard, End, CONTROL_PLANE_ID};
use super::cache::{resource_hash, CacheSnapshot, TypeSnapshot};
use super::connections::Connections;
use super::node::{self, FilterGuard, NodeView};
use super::resources::ResourceType;
use crate::metrics::{Metrics, TypeLabel};

/// Unanswered responses kept per type (as in state of the world): only an Envoy that reads
/// but never answers reaches the bound, and an answer to a response no longer kept is
/// treated as naming an unknown response.
const UNANSWERED_KEPT: usize = 256;

/// How long a filter configuration that changed only with services waits at most for Envoy to
/// answer the clusters and routes it went with, or the configuration before it (Envoy answers
/// every response; this bounds a stream that stops).
const FILTER_CONFIG_WAIT: Duration = Duration::from_secs(1);

/// A resource's version as Envoy holds it: toolgate's are their content hash, in hex.
type Version = String;

fn version_of(hash: u64) -> Version {
    format!("{hash:016x}")
}

/// Whether `version` is [`version_of`]`(hash)`, without allocating.
fn is_version(version: &str, hash: u64) -> bool {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = version.as_bytes();
    bytes.len() == 16
        && bytes
            .iter()
            .enumerate()
            .all(|(i, b)| *b == HEX[((hash >> (60 - 4 * i)) & 0xf) as usize])
}

/// One resource a response carries.
#[derive(Debug, Clone)]
struct Update {
    name: String,
    version: Version,
    any: Any,
}

/// A resource a response carried, and what Envoy held of it before: restored if Envoy rejects
/// the response.
#[derive(Debug)]
struct Carried {
    name: String,
    version: Version,
    before: Option<Version>,
}

/// A response Envoy has not answered yet.
#[derive(Debug)]
struct Unanswered {
    /// Numbered in increasing order on a stream; a string on the wire.
    nonce: u64,
    /// The type's version (`system_version_info`) it was computed from.
    version: String,
    carried: Vec<Carried>,
}

/// Protocol state of one type on one delta stream.
#[derive(Debug, Default)]
struct TypeState {
    /// Every resource of the type (CDS's first request with no names, or `*`).
    wildcard: bool,
    /// Resources subscribed by name.
    names: BTreeSet<String>,
    /// What Envoy holds, by name: its `initial_resource_versions`, then what was sent
    /// (taken back if Envoy rejects the response).
    holds: HashMap<String, Version>,
    /// Resources Envoy rejected alone, at the version it rejected: not sent again in that
    /// form (Envoy would reject it again, in a loop); the next change goes out as usual.
    rejected: HashMap<String, Version>,
    /// Resources that were in a rejected response together with others: each goes again in a
    /// response of its own, until Envoy accepts it or rejects it alone, so one invalid
    /// resource cannot hold back the rest.
    suspects: BTreeSet<String>,
    /// EDS: assignments to send even though Envoy holds their version, because their cluster
    /// was just sent and warms until it gets one.
    refresh: BTreeSet<String>,
    /// Envoy waits for a first response per type, even an empty one, before it finishes
    /// initializing.
    owes_first: bool,
    unanswered: VecDeque<Unanswered>,
    /// The type version of the last response sent, and of the last one Envoy accepted.
    sent: Option<String>,
    acked: Option<String>,
    /// The version what this type owes was last worked out against, in full or from an earlier
    /// one, with nothing since that could change it but the responses of that reckoning. What
    /// it owes against a later version is then only among the names that changed between the
    /// two, and the assignments to refresh: a push at 10,000 clusters looks at its own change,
    /// not at every name. `None` after anything else changed the state (a subscription, a
    /// rejection): the next reckoning walks every name.
    reckoned: Option<Arc<TypeSnapshot>>,
}

impl TypeState {
    fn subscribed(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// Applies the subscription changes of a request. The first request of a type brings what
    /// Envoy already holds (a reconnect) and, for CDS, an empty list means a wildcard.
    fn subscribe(&mut self, ty: ResourceType, request: &DeltaDiscoveryRequest, first: bool) {
        if first
            || !request.resource_names_subscribe.is_empty()
            || !request.resource_names_unsubscribe.is_empty()
        {
            self.reckoned = None;
        }
        if first {
            self.owes_first = true;
            self.wildcard =
                ty.empty_names_mean_wildcard() && request.resource_names_subscribe.is_empty();
            self.holds = request
                .initial_resource_versions
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
        }
        for name in &request.resource_names_subscribe {
            if name == "*" {
                self.wildcard = true;
                continue;
            }
            // A name subscribed again after the first request is sent again: Envoy asks
            // because a new watch of its needs it, whatever it held.
            if !first {
                self.holds.remove(name);
            }
            self.names.insert(name.clone());
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                self.wildcard = false;
                continue;
            }
            self.names.remove(name);
            if !self.wildcard {
                // Envoy drops what it unsubscribed: nothing to update or remove later.
                self.holds.remove(name);
                self.rejected.remove(name);
                self.suspects.remove(name);
                self.refresh.remove(name);
            }
        }
    }

    /// Takes the response `nonce` names off the unanswered list, with every older one; the
    /// named one is last. Empty if the nonce is not known.
    fn settle(&mut self, nonce: &str) -> Vec<Unanswered> {
        let Ok(nonce) = nonce.parse::<u64>() else {
            return Vec::new();
        };
        match self.unanswered.iter().position(|u| u.nonce == nonce) {
            Some(at) => self.unanswered.drain(..=at).collect(),
            None => Vec::new(),
        }
    }

    /// Envoy rejected `response`: it holds what it held before of each resource (unless a
    /// later response changed it since), and the resources go again one by one, or not at
    /// all in this form if the response carried only one.
    fn rejected_response(&mut self, response: &Unanswered) {
        self.reckoned = None;
        for c in &response.carried {
            if self.holds.get(&c.name) == Some(&c.version) {
                match &c.before {
                    Some(v) => self.holds.insert(c.name.clone(), v.clone()),
                    None => self.holds.remove(&c.name),
                };
            }
        }
        match response.carried.as_slice() {
            [one] => {
                self.suspects.remove(&one.name);
                self.rejected.insert(one.name.clone(), one.version.clone());
            }
            many => self.suspects.extend(many.iter().map(|c| c.name.clone())),
        }
    }

    fn accepted(&mut self, response: &Unanswered) {
        for c in &response.carried {
            self.suspects.remove(&c.name);
        }
        self.acked = Some(response.version.clone());
    }
}

/// A resource as made for one Envoy, and the hash of what it was made from.
#[derive(Debug)]
struct Tailored {
    source: u64,
    any: Any,
    version: Version,
}

/// What a type owes an Envoy: resources to send and names to remove.
#[derive(Debug, Default)]
struct Pending {
    updates: Vec<Update>,
    removals: Vec<String>,
}

/// One delta ADS stream: one Envoy.
pub(super) struct DeltaStream {
    id: u64,
    connections: Arc<Connections>,
    peer: Option<SocketAddr>,
    node: NodeView,
    report_token: Option<Arc<str>>,
    started: Instant,
    nonce: u64,
    types: BTreeMap<ResourceType, TypeState>,
    /// Resources made for this Envoy, by type and name (see [`NodeView::tailor`]).
    tailored: HashMap<(ResourceType, String), Tailored>,
    /// Keeps a filter configuration the filter would refuse from this Envoy.
    guard: FilterGuard,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    shutdown: CancellationToken,
    /// The filter's configuration is held (see the module's doc) until Envoy has answered
    /// every CDS and RDS response up to this nonce, or until the deadline.
    filter_config_after: Option<(u64, tokio::time::Instant)>,
    /// The urgency ([`TypeSnapshot::urgency`]) of the filter configuration this Envoy was
    /// last answered with: a configuration whose urgency differs goes at once.
    answered_urgency: Option<u64>,
}

impl DeltaStream {
    pub(super) fn new(
        id: u64,
        connections: Arc<Connections>,
        peer: Option<SocketAddr>,
        report_token: Option<Arc<str>>,
        metrics: Arc<Metrics>,
        tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
        shutdown: CancellationToken,
    ) -> DeltaStream {
        DeltaStream {
            id,
            connections,
            peer,
            node: NodeView::default(),
            report_token,
            started: Instant::now(),
            nonce: 0,
            types: BTreeMap::new(),
            tailored: HashMap::new(),
            guard: FilterGuard::default(),
            metrics,
            tx,
            shutdown,
            filter_config_after: None,
            answered_urgency: None,
        }
    }

    pub(super) async fn run(
        mut self,
        mut requests: Streaming<DeltaDiscoveryRequest>,
        mut cache: watch::Receiver<CacheView>,
    ) {
        let shutdown = self.shutdown.clone();
        let _connected = ConnectedGuard::new(&self.metrics);
        let _listed = self.connections.open(self.id, self.peer);
        debug!(stream = self.id, peer = ?self.peer, "delta ADS stream opened");
        cache.borrow_and_update();
        let mut cache_open = true;
        let end = loop {
            let hold_ends = self.filter_config_after.map(|(_, deadline)| deadline);
            tokio::select! {
                () = shutdown.cancelled() => break End::Shutdown,
                () = sleep_until_some(hold_ends) => {
                    warn!(node = %self.node, waited_ms = FILTER_CONFIG_WAIT.as_millis() as u64,
                        "Envoy has not answered what a filter configuration waits for (the \
                         clusters and routes it came with, or the configuration before it); \
                         sending it anyway");
                    let view = cache.borrow().clone();
                    if self.release_filter_config(view.as_deref()).await.is_err() {
                        break End::ResponseDropped;
                    }
                }
                message = requests.message() => match message {
                    Ok(Some(request)) => {
                        let view = cache.borrow().clone();
                        if self.on_request(request, view.as_deref()).await.is_err() {
                            break End::ResponseDropped;
                        }
                    }
                    Ok(None) => break End::EnvoyClosed,
                    Err(status) => break End::EnvoyError(status),
                },
                changed = cache.changed(), if cache_open => match changed {
                    Ok(()) => {
                        let view = cache.borrow_and_update().clone();
                        if let Some(view) = view {
                            if self.push(&view).await.is_err() {
                                break End::ResponseDropped;
                            }
                        }
                    }
                    Err(_) => cache_open = false,
                },
            }
        };
        let end = if shutdown.is_cancelled() {
            End::Shutdown
        } else {
            end
        };
        let acked: Vec<String> = self
            .types
            .iter()
            .map(|(t, s)| format!("{}={}", t.short_name(), s.acked.as_deref().unwrap_or("-")))
            .collect();
        log_end(end, &self.node.id, self.id, self.peer, &acked.join(" "));
    }

    /// Handles one request: subscription changes, the ACK or NACK of an earlier response, and
    /// an answer if the Envoy now lacks something.
    async fn on_request(
        &mut self,
        request: DeltaDiscoveryRequest,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        if !self.node.is_identified() {
            if let Some(node) = &request.node {
                self.node =
                    NodeView::identify(node, self.id, self.peer, "delta", &self.connections);
            }
        }
        let Some(ty) = ResourceType::from_type_url(&request.type_url) else {
            debug!(node = %self.node, type_url = %request.type_url,
                "request for a type toolgate does not serve; ignored");
            return Ok(());
        };
        let node = self.node.id.clone();
        let first = !self.types.contains_key(&ty);
        let state = self.types.entry(ty).or_default();
        state.subscribe(ty, &request, first);

        if !request.response_nonce.is_empty() {
            let answered = state.settle(&request.response_nonce);
            let last = answered.last();
            if let Some(error) = &request.error_detail {
                let version = last.map(|r| r.version.as_str()).unwrap_or("unknown");
                let names: Vec<&str> = last
                    .map(|r| r.carried.iter().map(|c| c.name.as_str()).collect())
                    .unwrap_or_default();
                warn!(node = %node, r#type = ty.short_name(), %version,
                    nonce = %request.response_nonce, resources = ?names,
                    error = %error.message, protocol = "delta", "Envoy rejected an xDS response (NACK)");
                self.metrics
                    .nacks
                    .get_or_create(&TypeLabel {
                        r#type: ty.short_name(),
                    })
                    .inc();
                if let Some(response) = last {
                    self.connections
                        .nacked(self.id, ty, &response.version, &error.message);
                    state.rejected_response(response);
                }
            } else if let Some(response) = last {
                debug!(node = %node, r#type = ty.short_name(), version = %response.version, "ACK");
                self.connections.acked(self.id, ty, &response.version);
                state.accepted(response);
            } else {
                debug!(node = %node, r#type = ty.short_name(), nonce = %request.response_nonce,
                    "answer to a response not kept (answered already); ignored");
            }
        }

        if matches!(
            ty,
            ResourceType::Cluster | ResourceType::Route | ResourceType::ExtensionConfig
        ) && self.filter_config_due()
        {
            self.release_filter_config(view).await?;
        }

        let Some(current) = view.and_then(|v| v.get(ty)) else {
            // Not ready: answered by the push that brings the first view.
            return Ok(());
        };
        let current = Arc::clone(current);
        let deferred = self.send_owed(ty, &current, true).await?;
        debug_assert!(deferred.is_empty());
        // Clusters sent in answer to a request (a reconnect, a resent suspect) warm until their
        // assignment comes, as after a push: it goes now, not with the next EDS change.
        let refresh_due = self
            .types
            .get(&ResourceType::Endpoint)
            .is_some_and(|eds| !eds.refresh.is_empty());
        if ty == ResourceType::Cluster && refresh_due {
            if let Some(eds) = view.and_then(|v| v.get(ResourceType::Endpoint)) {
                let eds = Arc::clone(eds);
                self.send_owed(ResourceType::Endpoint, &eds, true).await?;
            }
        }
        Ok(())
    }

    /// A new cache view: every type's updates in push order (CDS, EDS, RDS, ECDS), then every
    /// type's removals in the same order. The filter's configuration waits if this push sent
    /// clusters or routes (see the module's doc), or an earlier one's still wait.
    async fn push(&mut self, view: &CacheSnapshot) -> Result<(), Closed> {
        let mut removals = Vec::new();
        let before = self.nonce;
        for ty in ResourceType::ALL {
            if !self.types.contains_key(&ty) {
                continue;
            }
            let Some(current) = view.get(ty) else {
                continue;
            };
            if ty == ResourceType::ExtensionConfig {
                if self.answered_urgency != Some(current.urgency) {
                    // An operator's change goes now, and takes whatever waited with it.
                    self.filter_config_after = None;
                } else if self.filter_config_after.is_none() {
                    // Waits for the clusters and routes sent with it, if any (0: none), and
                    // for Envoy's answer to the configuration before it.
                    let after = if self.routing_unanswered_after(before) {
                        Some(self.nonce)
                    } else {
                        self.filter_config_unanswered().then_some(0)
                    };
                    self.filter_config_after = after
                        .map(|after| (after, tokio::time::Instant::now() + FILTER_CONFIG_WAIT));
                }
                if self.filter_config_after.is_some() {
                    continue;
                }
            }
            let current = Arc::clone(current);
            let deferred = self.send_owed(ty, &current, false).await?;
            if !deferred.is_empty() {
                removals.push((ty, current, deferred));
            }
        }
        for (ty, current, names) in removals {
            self.send_response(ty, &current, Vec::new(), names).await?;
        }
        Ok(())
    }

    /// Whether a CDS or RDS response numbered above `nonce` is unanswered.
    fn routing_unanswered_after(&self, nonce: u64) -> bool {
        self.routing_unanswered(|n| n > nonce)
    }

    /// Whether the held filter configuration may go: Envoy answered what it waits for.
    fn filter_config_due(&self) -> bool {
        self.filter_config_after.is_some_and(|(after, _)| {
            !self.routing_unanswered(|n| n <= after) && !self.filter_config_unanswered()
        })
    }

    /// Whether Envoy has not answered a filter configuration yet. It applies each one whole
    /// (9-17 ms, more with a large catalog), one after another: while services keep coming,
    /// their catalog changes wait for that answer and go as one, so that an operator's change
    /// never queues behind a row of them in Envoy.
    fn filter_config_unanswered(&self) -> bool {
        self.types
            .get(&ResourceType::ExtensionConfig)
            .is_some_and(|state| !state.unanswered.is_empty())
    }

    /// Whether an unanswered CDS or RDS response has a nonce `which` picks.
    fn routing_unanswered(&self, which: impl Fn(u64) -> bool) -> bool {
        [ResourceType::Cluster, ResourceType::Route]
            .iter()
            .filter_map(|ty| self.types.get(ty))
            .any(|state| state.unanswered.iter().any(|u| which(u.nonce)))
    }

    /// Ends the hold and sends what the filter's configuration owes against the latest view.
    async fn release_filter_config(&mut self, view: Option<&CacheSnapshot>) -> Result<(), Closed> {
        self.filter_config_after = None;
        let ty = ResourceType::ExtensionConfig;
        if !self.types.contains_key(&ty) {
            return Ok(());
        }
        let Some(current) = view.and_then(|v| v.get(ty)) else {
            return Ok(());
        };
        let current = Arc::clone(current);
        self.send_owed(ty, &current, true).await?;
        Ok(())
    }

    /// What `ty` owes this Envoy against `current`.
    fn pending(&mut self, ty: ResourceType, current: &Arc<TypeSnapshot>) -> Pending {
        let DeltaStream {
            types,
            node,
            tailored,
            guard,
            report_token,
            metrics,
            ..
        } = self;
        let Some(state) = types.get_mut(&ty) else {
            return Pending::default();
        };
        let reckoned = state.reckoned.replace(Arc::clone(current));
        let state = &*state;
        // Resources made per Envoy are one or two names: always looked at in full.
        let made_per_envoy = matches!(ty, ResourceType::Route | ResourceType::ExtensionConfig);
        let candidates: Option<BTreeSet<&String>> = reckoned
            .as_ref()
            .filter(|_| !made_per_envoy)
            .map(|earlier| {
                current
                    .changed_since(earlier)
                    .chain(state.refresh.iter())
                    .collect()
            });
        let names: Box<dyn Iterator<Item = &String>> = match &candidates {
            Some(changed) => Box::new(changed.iter().copied().filter(|n| state.subscribed(n))),
            None if state.wildcard => Box::new(current.names()),
            None => Box::new(state.names.iter()),
        };
        let mut pending = Pending::default();
        for name in names {
            if !node.serves(ty, name) {
                continue;
            }
            let Some((any, hash)) = current.entry(name) else {
                continue;
            };
            // A resource made for this Envoy (its filter configuration, a shard's routes) has
            // the version of the bytes it gets: a change elsewhere that leaves them alone is
            // not sent. Made again only when its source changes, not on every push.
            if !made_per_envoy {
                // Thousands of names per push at scale: compare without copying the resource
                // or formatting its version unless it goes out.
                let is = |v: Option<&Version>| v.is_some_and(|v| is_version(v, hash));
                if is(state.rejected.get(name)) {
                    continue;
                }
                if !is(state.holds.get(name)) || state.refresh.contains(name) {
                    pending.updates.push(Update {
                        name: name.clone(),
                        version: version_of(hash),
                        any: any.clone(),
                    });
                }
                continue;
            }
            let (any, version) = {
                let key = (ty, name.clone());
                match tailored.get(&key) {
                    Some(t) if t.source == hash => (t.any.clone(), t.version.clone()),
                    _ => match guard.tailor(
                        node,
                        ty,
                        name,
                        any,
                        hash,
                        report_token.as_deref(),
                        metrics,
                    ) {
                        node::Tailored::Made(made) => {
                            let version = version_of(resource_hash(&made));
                            let entry = Tailored {
                                source: hash,
                                any: made.clone(),
                                version: version.clone(),
                            };
                            tailored.insert(key, entry);
                            (made, version)
                        }
                        node::Tailored::AsIs => (any.clone(), version_of(hash)),
                        // Refused, and none good before it: nothing goes.
                        node::Tailored::Nothing => continue,
                    },
                }
            };
            if state.rejected.get(name) == Some(&version) {
                continue;
            }
            if state.holds.get(name) != Some(&version) || state.refresh.contains(name) {
                pending.updates.push(Update {
                    name: name.clone(),
                    version,
                    any,
                });
            }
        }
        let held: Box<dyn Iterator<Item = &String>> = match &candidates {
            Some(changed) => Box::new(
                changed
                    .iter()
                    .copied()
                    .filter(|n| state.holds.contains_key(*n)),
            ),
            None => Box::new(state.holds.keys()),
        };
        pending.removals = held
            .filter(|name| {
                state.subscribed(name) && (current.entry(name).is_none() || !node.serves(ty, name))
            })
            .cloned()
            .collect();
        pending.removals.sort();
        pending
    }

    /// Sends what `ty` owes, the suspects of an earlier rejection each alone. Removals go in
    /// the same response when `with_removals`, else they are returned for the caller to send
    /// after every other type's updates.
    async fn send_owed(
        &mut self,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        with_removals: bool,
    ) -> Result<Vec<String>, Closed> {
        if ty == ResourceType::ExtensionConfig && self.node.filter.is_none() {
            warn!(node = %self.node, "Envoy asked for the filter configuration but its bootstrap names no filter path (node metadata toolgate.filter_path); not answering");
            return Ok(Vec::new());
        }
        let held = ty == ResourceType::ExtensionConfig && self.filter_config_after.is_some();
        if held && self.types.get(&ty).is_some_and(|state| !state.owes_first) {
            // Goes when the hold ends (an ACK of an earlier one brought us here).
            return Ok(Vec::new());
        }
        let Pending { updates, removals } = self.pending(ty, current);
        if ty == ResourceType::ExtensionConfig {
            // What goes now (or nothing: the Envoy holds it already) is this version's.
            self.answered_urgency = Some(current.urgency);
        }
        let Some(state) = self.types.get(&ty) else {
            return Ok(Vec::new());
        };
        let owes_first = state.owes_first;
        let (alone, together): (Vec<_>, Vec<_>) = updates
            .into_iter()
            .partition(|u| state.suspects.contains(&u.name));
        let (here, deferred) = if with_removals {
            (removals, Vec::new())
        } else {
            (Vec::new(), removals)
        };
        let mut responses = Vec::new();
        if !together.is_empty() || !here.is_empty() || (alone.is_empty() && owes_first) {
            responses.push((together, here));
        }
        responses.extend(alone.into_iter().map(|one| (vec![one], Vec::new())));
        for (updates, removals) in responses {
            self.send_response(ty, current, updates, removals).await?;
        }
        Ok(deferred)
    }

    /// Sends one response of `current`'s version and records what Envoy now holds.
    async fn send_response(
        &mut self,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        updates: Vec<Update>,
        removals: Vec<String>,
    ) -> Result<(), Closed> {
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        self.nonce += 1;
        let nonce = self.nonce;
        let count = updates.len();
        let mut carried = Vec::with_capacity(updates.len());
        let mut resources = Vec::with_capacity(updates.len());
        for u in updates {
            let before = state.holds.insert(u.name.clone(), u.version.clone());
            state.refresh.remove(&u.name);
            carried.push(Carried {
                name: u.name.clone(),
                version: u.version.clone(),
                before,
            });
            resources.push(Resource {
                name: u.name,
                version: u.version,
                resource: Some(u.any),
                ..Default::default()
            });
        }
        for name in &removals {
            state.holds.remove(name);
            state.rejected.remove(name);
            state.suspects.remove(name);
        }
        state.owes_first = false;
        let first_of_version = state.sent.as_deref() != Some(current.version.as_str());
        state.sent = Some(current.version.clone());
        if state.unanswered.len() == UNANSWERED_KEPT {
            state.unanswered.pop_front();
        }
        let sent_clusters: Vec<String> = if ty == ResourceType::Cluster {
            carried.iter().map(|c| c.name.clone()).collect()
        } else {
            Vec::new()
        };
        state.unanswered.push_back(Unanswered {
            nonce,
            version: current.version.clone(),
            carried,
        });
        // A cluster Envoy just got warms until it gets an assignment, changed or not.
        if let Some(eds) = self.types.get_mut(&ResourceType::Endpoint) {
            for name in sent_clusters {
                if eds.holds.contains_key(&name) {
                    eds.refresh.insert(name);
                }
            }
        }
        let removed = removals.len();
        let response = DeltaDiscoveryResponse {
            system_version_info: current.version.clone(),
            resources,
            type_url: ty.type_url().to_string(),
            removed_resources: removals,
            nonce: nonce.to_string(),
            control_plane: Some(ControlPlane {
                identifier: CONTROL_PLANE_ID.to_string(),
            }),
            ..Default::default()
        };
        tokio::select! {
            sent = self.tx.send(Ok(response)) => sent.map_err(|_| Closed)?,
            () = self.shutdown.cancelled() => return Err(Closed),
        }
        record_push(
            &self.metrics,
            &self.connections,
            self.id,
            &self.node.id,
            self.started,
            ty,
            current,
            count,
            first_of_version,
        );
        // How long after the etcd event that caused the version: with the ACK's time beside
        // it, an operator (or the bench) sees which side of the wire a slow change spent its
        // time on.
        let since_change_ms = current.changed_at.elapsed().as_secs_f64() * 1e3;
        debug!(node = %self.node, r#type = ty.short_name(), version = %current.version,
            nonce = %nonce, resources = count, removed,
            since_change_ms = format_args!("{since_change_ms:.2}"), "delta xDS response sent");
        Ok(())
    }
}

/// Sleeps until `deadline`, or forever without one (a `select!` branch that never fires).
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_recognized_without_formatting() {
        for hash in [0, 1, 0xdead_beef, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert!(is_version(&version_of(hash), hash), "{hash:x}");
            assert!(!is_version(&version_of(hash ^ 1), hash), "{hash:x}");
        }
        assert!(!is_version("", 0));
        assert!(!is_version("00000000000000000", 0));
        assert!(!is_version("000000000000000é", 0));
    }
    use crate::routing::RoutingSnapshot;
    use crate::xds::ads::tests::routing;
    use crate::xds::cache::SnapshotCache;
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::google::rpc::Status as RpcStatus;

    const CDS: ResourceType = ResourceType::Cluster;
    const EDS: ResourceType = ResourceType::Endpoint;
    const RDS: ResourceType = ResourceType::Route;
    const ECDS: ResourceType = ResourceType::ExtensionConfig;

    struct Harness {
        stream: DeltaStream,
        rx: mpsc::Receiver<Result<DeltaDiscoveryResponse, Status>>,
        cache: SnapshotCache,
        metrics: Arc<Metrics>,
    }

    impl Harness {
        fn new() -> Harness {
            let metrics = Arc::new(Metrics::new());
            let (tx, rx) = mpsc::channel(64);
            Harness {
                stream: DeltaStream::new(
                    1,
                    Arc::default(),
                    None,
                    None,
                    Arc::clone(&metrics),
                    tx,
                    CancellationToken::new(),
                ),
                rx,
                cache: SnapshotCache::new(),
                metrics,
            }
        }

        async fn publish(&mut self, snapshot: RoutingSnapshot) {
            self.cache.update(&snapshot);
            let view = self.cache.current().expect("a view after an update");
            assert!(self.stream.push(&view).await.is_ok());
        }

        async fn request(&mut self, request: DeltaDiscoveryRequest) {
            let view = self.cache.current();
            assert!(self
                .stream
                .on_request(request, view.as_deref())
                .await
                .is_ok());
        }

        /// Sends `request` and ACKs every response it draws, as Envoy does.
        async fn request_and_ack(
            &mut self,
            request: DeltaDiscoveryRequest,
        ) -> Vec<DeltaDiscoveryResponse> {
            self.request(request).await;
            let sent = self.sent();
            for r in &sent {
                self.request(ack(r)).await;
            }
            sent
        }

        fn sent(&mut self) -> Vec<DeltaDiscoveryResponse> {
            let mut out = Vec::new();
            while let Ok(r) = self.rx.try_recv() {
                out.push(r.expect("no error responses"));
            }
            out
        }

        fn nacks(&self, ty: ResourceType) -> u64 {
            self.metrics
                .nacks
                .get_or_create(&TypeLabel {
                    r#type: ty.short_name(),
                })
                .get()
        }
    }

    /// An Envoy whose bootstrap names the filter, so that it is served ECDS.
    fn node() -> Node {
        use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
        let string = |s: &str| Value {
            kind: Some(Kind::StringValue(s.to_string())),
        };
        let toolgate = Struct {
            fields: [(
                crate::xds::ecds::NODE_FILTER_PATH_FIELD.to_string(),
                string("/filter.wasm"),
            )]
            .into(),
        };
        Node {
            id: "envoy-1".into(),
            metadata: Some(Struct {
                fields: [(
                    crate::xds::ecds::NODE_METADATA_KEY.to_string(),
                    Value {
                        kind: Some(Kind::StructValue(toolgate)),
                    },
                )]
                .into(),
            }),
            ..Default::default()
        }
    }

    fn subscribe(ty: ResourceType, names: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node: Some(node()),
            type_url: ty.type_url().into(),
            resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        }
    }

    fn nack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "bad resource".into(),
                details: Vec::new(),
            }),
            ..ack(response)
        }
    }

    fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
        r.resources.iter().map(|r| r.name.as_str()).collect()
    }

    fn of(ty: ResourceType, r: &DeltaDiscoveryResponse) -> bool {
        r.type_url == ty.type_url()
    }

    /// A harness whose Envoy subscribed CDS (wildcard), EDS for `services` and the routes,
    /// every response acknowledged.
    async fn subscribed(services: &[(&str, &[u8])]) -> Harness {
        let mut h = Harness::new();
        h.publish(routing(1, services)).await;
        let cds = h.request_and_ack(subscribe(CDS, &[])).await;
        assert_eq!(cds.len(), 1);
        assert_eq!(cds[0].resources.len(), services.len());
        let clusters: Vec<String> = services.iter().map(|(s, _)| format!("mcp.{s}")).collect();
        let clusters: Vec<&str> = clusters.iter().map(String::as_str).collect();
        let eds = h.request_and_ack(subscribe(EDS, &clusters)).await;
        assert_eq!(names(&eds[0]), clusters);
        // The table an Envoy with the filter asks for (its bootstrap names it).
        let rds = h
            .request_and_ack(subscribe(
                RDS,
                &[crate::xds::resources::SHARED_ROUTE_CONFIG_NAME],
            ))
            .await;
        assert_eq!(rds.len(), 1);
        h
    }

    #[tokio::test]
    async fn the_control_assignment_is_sent_once_and_again_only_when_the_members_change() {
        use crate::routing::ControlMembers;
        const CONTROL: &str = crate::bootstrap::CONTROL_CLUSTER;
        let members = |peers: &[&str]| {
            Arc::new(ControlMembers {
                local: Some("127.0.0.1:19000".parse().expect("addr")),
                peers: peers.iter().map(|p| p.parse().expect("addr")).collect(),
            })
        };
        let mut h = subscribed(&[("a", &[1])]).await;
        // The bootstrap's static cluster asks for its assignment by name.
        let sent = h.request_and_ack(subscribe(EDS, &[CONTROL])).await;
        assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec![CONTROL]]);
        // An instance change: not the control assignment.
        h.publish(routing(2, &[("a", &[1, 2])])).await;
        let sent = h.sent();
        assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec!["mcp.a"]]);
        for r in &sent {
            h.request(ack(r)).await;
        }
        // Another toolgate-xds joins: the control assignment alone.
        let mut snap = routing(3, &[("a", &[1, 2])]);
        snap.control = members(&["127.0.0.2:19000"]);
        h.publish(snap).await;
        let sent = h.sent();
        assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec![CONTROL]]);
    }

    #[tokio::test]
    async fn a_new_service_sends_its_cluster_and_its_assignment_and_routes_only_of_its_own() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
        let summary = |sent: &[DeltaDiscoveryResponse]| -> Vec<(&str, Vec<String>, Vec<String>)> {
            sent.iter()
                .map(|r| {
                    (
                        ResourceType::from_type_url(&r.type_url)
                            .expect("known")
                            .short_name(),
                        names(r).into_iter().map(String::from).collect(),
                        r.removed_resources.clone(),
                    )
                })
                .collect()
        };
        // The default path and timeout: the shared routes take it, no route changes.
        h.publish(routing(2, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        let sent = h.sent();
        assert_eq!(summary(&sent), [("cds", vec!["mcp.c".to_string()], vec![])]);
        // Envoy subscribes to the new cluster's assignment when it creates the cluster.
        for r in &sent {
            h.request(ack(r)).await;
        }
        let eds = h.request_and_ack(subscribe(EDS, &["mcp.c"])).await;
        assert_eq!(eds.len(), 1);
        assert_eq!(names(&eds[0]), ["mcp.c"]);
        // The same content again sends nothing.
        h.publish(routing(3, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        assert!(h.sent().is_empty());
        // A path of its own needs routes of its own: the route configuration goes too.
        let four = [
            ("a", &[1u8][..]),
            ("b", &[2][..]),
            ("c", &[3][..]),
            ("d", &[4][..]),
        ];
        h.publish(own_path(routing(4, &four), "d")).await;
        let sent = summary(&h.sent());
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert_eq!(sent[0], ("cds", vec!["mcp.d".to_string()], vec![]));
        assert_eq!(sent[1].0, "rds", "{sent:?}");
    }

    /// `service` serves MCP at a path of its own, so it has routes of its own.
    fn own_path(mut snapshot: RoutingSnapshot, service: &str) -> RoutingSnapshot {
        if let Some(route) = snapshot.services.get_mut(service) {
            Arc::make_mut(route).mcp_path = "/rpc".into();
        }
        snapshot
    }

    /// `json` as the filter configuration, with its urgency as the registry makes it: the
    /// digest of all but what changes with services (0 when that is empty, as in
    /// [`routing`]).
    fn with_filter_config(mut snapshot: RoutingSnapshot, json: &str) -> RoutingSnapshot {
        let mut rest: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(json).unwrap();
        for services_part in ["catalog", "virtual_servers", "legacy_revisions"] {
            rest.remove(services_part);
        }
        snapshot.filter_urgency = if rest.is_empty() {
            0
        } else {
            std::hash::BuildHasher::hash_one(
                &std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default(),
                serde_json::Value::Object(rest).to_string(),
            )
        };
        snapshot.filter_config = Arc::from(json);
        snapshot
    }

    fn types(sent: &[DeltaDiscoveryResponse]) -> Vec<&'static str> {
        sent.iter()
            .map(|r| {
                ResourceType::from_type_url(&r.type_url)
                    .expect("known")
                    .short_name()
            })
            .collect()
    }

    #[tokio::test]
    async fn the_filter_configuration_goes_once_envoy_answered_the_clusters_and_routes_it_came_with(
    ) {
        let mut h = subscribed(&[("a", &[1])]).await;
        let name = crate::xds::ecds::FILTER_CONFIG_NAME;
        let first = h.request_and_ack(subscribe(ECDS, &[name])).await;
        assert_eq!(types(&first), ["ecds"]);

        // A new service whose tools change the configuration (its catalog): clusters and
        // routes first (a path of its own: routes of its own).
        let two = [("a", &[1u8][..]), ("b", &[2][..])];
        h.publish(with_filter_config(
            own_path(routing(2, &two), "b"),
            r#"{"catalog":{"b":[]}}"#,
        ))
        .await;
        let sent = h.sent();
        assert_eq!(types(&sent), ["cds", "rds"]);
        // An answer to an earlier configuration, or a route ACK alone, does not release it.
        h.request(ack(&first[0])).await;
        h.request(ack(&sent[1])).await;
        assert!(h.sent().is_empty());

        // Another new service meanwhile: its clusters and routes go, the configuration still
        // waits for the first ones only, and then goes in its latest form.
        let three = [("a", &[1u8][..]), ("b", &[2][..]), ("c", &[3][..])];
        h.publish(with_filter_config(
            own_path(own_path(routing(3, &three), "b"), "c"),
            r#"{"catalog":{"c":[]}}"#,
        ))
        .await;
        let later = h.sent();
        assert_eq!(types(&later), ["cds", "rds"]);
        h.request(ack(&sent[0])).await;
        let released = h.sent();
        assert_eq!(types(&released), ["ecds"], "{released:?}");
        let json = crate::xds::ecds::tests::plugin_json(
            released[0].resources[0]
                .resource
                .as_ref()
                .expect("a resource"),
        );
        assert!(json.contains(r#""c":[]"#), "{json}");

        // A catalog change alone does not wait for the later clusters and routes, only for
        // Envoy's answer to the configuration before it (each is applied whole, one after
        // another: a row of them would delay whatever comes next).
        h.publish(with_filter_config(
            own_path(own_path(routing(4, &three), "b"), "c"),
            r#"{"catalog":{"d":[]}}"#,
        ))
        .await;
        assert!(h.sent().is_empty());
        h.request(ack(&released[0])).await;
        let alone = h.sent();
        assert_eq!(types(&alone), ["ecds"]);

        // A new service that shares the routes: its cluster alone, and the configuration once
        // Envoy answered that.
        for r in later.iter().chain(&released).chain(&alone) {
            h.request(ack(r)).await;
        }
        let five = [
            ("a", &[1u8][..]),
            ("b", &[2][..]),
            ("c", &[3][..]),
            ("e", &[5][..]),
        ];
        h.publish(with_filter_config(
            own_path(own_path(routing(5, &five), "b"), "c"),
            r#"{"catalog":{"e":[]}}"#,
        ))
        .await;
        let sent = h.sent();
        assert_eq!(types(&sent), ["cds"]);
        h.request(ack(&sent[0])).await;
        assert_eq!(types(&h.sent()), ["ecds"]);
    }

    #[tokio::test]
    async fn a_filter_configuration_the_filter_would_refuse_is_never_sent() {
        // A tool's open time above the default ceiling, which no service policy raises.
        const REFUSED: &str = r#"{"services":{"a":{"tools":{"t":{"open_ms":400000}}}}}"#;
        let name = crate::xds::ecds::FILTER_CONFIG_NAME;
        // Refused from the first: nothing goes, and Envoy keeps what it has (or waits).
        let mut h = subscribed(&[("a", &[1])]).await;
        h.publish(with_filter_config(routing(2, &[("a", &[1])]), REFUSED))
            .await;
        assert!(h
            .request_and_ack(subscribe(ECDS, &[name]))
            .await
            .iter()
            .all(|r| r.resources.is_empty()));
        assert_eq!(h.metrics.filter_config_invalid.get(), 1);

        let mut h = subscribed(&[("a", &[1])]).await;
        let good = r#"{"services":{"a":{"policy":{"max_open_ms":600000},"tools":{"t":{"open_ms":400000}}}}}"#;
        h.publish(with_filter_config(routing(2, &[("a", &[1])]), good))
            .await;
        let first = h.request_and_ack(subscribe(ECDS, &[name])).await;
        assert_eq!(types(&first), ["ecds"]);
        let held = first[0].resources[0].version.clone();
        // The service's policy goes: what comes out would be refused, so nothing is sent,
        // once, however often it is published.
        for generation in 3..6 {
            h.publish(with_filter_config(
                routing(generation, &[("a", &[1])]),
                REFUSED,
            ))
            .await;
            assert!(h.sent().is_empty(), "generation {generation}");
        }
        assert_eq!(h.metrics.filter_config_invalid.get(), 1, "counted once");
        // A resubscription gets the last good one, not the refused one.
        let again = h.request_and_ack(subscribe(ECDS, &[name])).await;
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].resources[0].version, held);
        // A good configuration goes again.
        h.publish(with_filter_config(routing(6, &[("a", &[1])]), r#"{"x":2}"#))
            .await;
        let sent = h.sent();
        assert_eq!(types(&sent), ["ecds"]);
        assert_ne!(sent[0].resources[0].version, held);
    }

    #[tokio::test]
    async fn an_operators_change_goes_at_once_beside_new_clusters_and_takes_a_held_one_along() {
        const OVERRIDE: &str = r#""overrides":{"a":{"t":{"mode":"force_open","reason":"r"}}}"#;
        let mut h = subscribed(&[("a", &[1])]).await;
        let name = crate::xds::ecds::FILTER_CONFIG_NAME;
        h.request_and_ack(subscribe(ECDS, &[name])).await;

        // A new service and an override in one push: the override does not wait for Envoy to
        // answer the cluster and routes (the catalog goes with it, whole).
        let two = [("a", &[1u8][..]), ("b", &[2][..])];
        h.publish(with_filter_config(
            own_path(routing(2, &two), "b"),
            &format!(r#"{{"catalog":{{"b":[]}},{OVERRIDE}}}"#),
        ))
        .await;
        let sent = h.sent();
        assert_eq!(types(&sent), ["cds", "rds", "ecds"]);
        for r in &sent {
            h.request(ack(r)).await;
        }

        // Another new service alone: its configuration waits for Envoy's answer...
        let three = [("a", &[1u8][..]), ("b", &[2][..]), ("c", &[3][..])];
        h.publish(with_filter_config(
            own_path(own_path(routing(3, &three), "b"), "c"),
            &format!(r#"{{"catalog":{{"b":[],"c":[]}},{OVERRIDE}}}"#),
        ))
        .await;
        let routing_sent = h.sent();
        assert_eq!(types(&routing_sent), ["cds", "rds"]);
        // ...until an operator's change comes: it goes at once, with the held catalog.
        h.publish(with_filter_config(
            own_path(own_path(routing(4, &three), "b"), "c"),
            r#"{"catalog":{"b":[],"c":[]}}"#,
        ))
        .await;
        let sent = h.sent();
        assert_eq!(
            types(&sent),
            ["ecds"],
            "the CDS and RDS are still unanswered"
        );
        let json = crate::xds::ecds::tests::plugin_json(
            sent[0].resources[0].resource.as_ref().expect("a resource"),
        );
        assert!(
            json.contains(r#""c":[]"#) && !json.contains("overrides"),
            "{json}"
        );
        // The answers to the routing release nothing more: nothing is owed.
        for r in &routing_sent {
            h.request(ack(r)).await;
        }
        assert!(h.sent().is_empty());
    }

    #[tokio::test]
    async fn a_rejected_route_configuration_releases_the_filter_configuration_too() {
        let mut h = subscribed(&[("a", &[1])]).await;
        let name = crate::xds::ecds::FILTER_CONFIG_NAME;
        h.request_and_ack(subscribe(ECDS, &[name])).await;
        let mut snapshot =
            with_filter_config(routing(2, &[("a", &[1])]), r#"{"catalog":{"a":["x"]}}"#);
        let mut a = crate::routing::ServiceRoute::clone(&snapshot.services["a"]);
        a.timeout_ms = 5_000;
        snapshot.services.insert("a".to_string(), Arc::new(a));
        h.publish(snapshot).await;
        let sent = h.sent();
        assert_eq!(types(&sent), ["rds"]);
        h.request(nack(&sent[0])).await;
        assert_eq!(types(&h.sent()), ["ecds"]);
    }

    #[tokio::test]
    async fn an_endpoint_change_sends_one_assignment_and_a_changed_cluster_its_assignment_too() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
        h.publish(routing(2, &[("a", &[1, 9]), ("b", &[2])])).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert!(of(EDS, &sent[0]));
        assert_eq!(names(&sent[0]), ["mcp.a"]);
        h.request(ack(&sent[0])).await;

        // A cluster change (another connection limit) re-creates the cluster in Envoy: its assignment
        // goes again, unchanged, or the cluster would warm until Envoy's fetch timeout.
        let mut changed = routing(3, &[("a", &[1, 9]), ("b", &[2])]);
        if let Some(b) = changed.services.get_mut("b") {
            Arc::make_mut(b).limits.max_connections = 65;
        }
        h.publish(changed).await;
        let sent = h.sent();
        let cds: Vec<_> = sent.iter().filter(|r| of(CDS, r)).collect();
        let eds: Vec<_> = sent.iter().filter(|r| of(EDS, r)).collect();
        assert_eq!(cds.len(), 1);
        assert_eq!(names(cds[0]), ["mcp.b"]);
        assert_eq!(eds.len(), 1);
        assert_eq!(names(eds[0]), ["mcp.b"]);
    }

    #[tokio::test]
    async fn a_cluster_resent_in_answer_to_a_request_brings_its_assignment_along() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
        let mut changed = routing(2, &[("a", &[1]), ("b", &[2])]);
        if let Some(b) = changed.services.get_mut("b") {
            Arc::make_mut(b).limits.max_connections = 65;
        }
        h.publish(changed).await;
        let sent = h.sent();
        let cds = sent.iter().find(|r| of(CDS, r)).expect("a CDS response");
        // Envoy rejects it alone; the assignment that followed was accepted.
        h.request(nack(cds)).await;
        for r in sent.iter().filter(|r| of(EDS, r)) {
            h.request(ack(r)).await;
        }
        assert!(h.sent().is_empty());
        // The same cluster, accepted this time (another change), answering a CDS request:
        // its assignment follows in the same turn.
        let mut again = routing(3, &[("a", &[1]), ("b", &[2])]);
        if let Some(b) = again.services.get_mut("b") {
            Arc::make_mut(b).limits.max_connections = 66;
        }
        h.cache.update(&again);
        h.request(DeltaDiscoveryRequest {
            type_url: CDS.type_url().into(),
            ..Default::default()
        })
        .await;
        let sent = h.sent();
        let kinds: Vec<(bool, Vec<&str>)> = sent.iter().map(|r| (of(CDS, r), names(r))).collect();
        assert_eq!(
            kinds,
            [(true, vec!["mcp.b"]), (false, vec!["mcp.b"])],
            "{sent:?}"
        );
    }

    #[tokio::test]
    async fn removals_go_after_every_update_of_the_push() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
        // b with routes of its own, which its removal changes.
        h.publish(own_path(routing(2, &[("a", &[1]), ("b", &[2])]), "b"))
            .await;
        for r in h.sent() {
            h.request(ack(&r)).await;
        }
        h.publish(routing(3, &[("a", &[1])])).await;
        let sent = h.sent();
        let kinds: Vec<(&str, bool)> = sent
            .iter()
            .map(|r| {
                (
                    ResourceType::from_type_url(&r.type_url)
                        .expect("known")
                        .short_name(),
                    r.removed_resources.is_empty(),
                )
            })
            .collect();
        // The routes stop pointing at b first; then b's cluster and assignment go.
        assert_eq!(
            kinds,
            [("rds", true), ("cds", false), ("eds", false)],
            "{sent:?}"
        );
        assert_eq!(sent[1].removed_resources, ["mcp.b"]);
        assert_eq!(sent[2].removed_resources, ["mcp.b"]);
    }

    #[tokio::test]
    async fn a_reconnecting_envoy_gets_only_what_differs_from_what_it_holds() {
        let mut old = Harness::new();
        old.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
        let held = old.request_and_ack(subscribe(CDS, &[])).await;
        let initial: HashMap<String, String> = held[0]
            .resources
            .iter()
            .map(|r| (r.name.clone(), r.version.clone()))
            .collect();

        // toolgate-xds restarts; meanwhile a was changed and b removed.
        let mut h = Harness::new();
        let mut now = routing(1, &[("a", &[1])]);
        if let Some(a) = now.services.get_mut("a") {
            Arc::make_mut(a).limits.max_connections = 65;
        }
        h.publish(now).await;
        h.request(DeltaDiscoveryRequest {
            initial_resource_versions: initial.clone(),
            ..subscribe(CDS, &[])
        })
        .await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(names(&sent[0]), ["mcp.a"]);
        assert_eq!(sent[0].removed_resources, ["mcp.b"]);

        // Nothing changed: an empty first response, which Envoy needs to finish starting.
        let mut same = Harness::new();
        same.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
        same.request(DeltaDiscoveryRequest {
            initial_resource_versions: initial,
            ..subscribe(CDS, &[])
        })
        .await;
        let sent = same.sent();
        assert_eq!(sent.len(), 1);
        assert!(sent[0].resources.is_empty() && sent[0].removed_resources.is_empty());
    }

    #[tokio::test]
    async fn a_rejected_resource_is_not_resent_until_it_changes_and_its_companions_go_alone() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2]), ("c", &[3])]).await;
        h.publish(routing(2, &[("a", &[1, 7]), ("b", &[2, 8]), ("c", &[3])]))
            .await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(names(&sent[0]), ["mcp.a", "mcp.b"]);
        // Envoy rejects the response: each assignment goes again alone.
        h.request(nack(&sent[0])).await;
        assert_eq!(h.nacks(EDS), 1);
        let alone = h.sent();
        let alone_names: Vec<Vec<&str>> = alone.iter().map(names).collect();
        assert_eq!(alone_names, [vec!["mcp.a"], vec!["mcp.b"]]);
        // a is accepted, b rejected alone: b is not sent again in that form.
        h.request(ack(&alone[0])).await;
        h.request(nack(&alone[1])).await;
        assert!(
            h.sent().is_empty(),
            "nothing resent after the lone rejection"
        );
        h.publish(routing(
            3,
            &[("a", &[1, 7]), ("b", &[2, 8]), ("c", &[3, 4])],
        ))
        .await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(names(&sent[0]), ["mcp.c"], "b stays out");
        h.request(ack(&sent[0])).await;
        // b goes back to what Envoy kept: nothing to send.
        h.publish(routing(4, &[("a", &[1, 7]), ("b", &[2]), ("c", &[3, 4])]))
            .await;
        assert!(h.sent().is_empty(), "Envoy holds b in this form");
        // b changes again: it goes out.
        h.publish(routing(
            5,
            &[("a", &[1, 7]), ("b", &[2, 5]), ("c", &[3, 4])],
        ))
        .await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(names(&sent[0]), ["mcp.b"]);
    }

    #[tokio::test]
    async fn an_unsubscribed_name_is_neither_updated_nor_removed() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
        h.request(DeltaDiscoveryRequest {
            resource_names_unsubscribe: vec!["mcp.b".into()],
            ..subscribe(EDS, &[])
        })
        .await;
        assert!(h.sent().is_empty());
        h.publish(routing(2, &[("a", &[1])])).await;
        let eds: Vec<_> = h.sent().into_iter().filter(|r| of(EDS, r)).collect();
        assert!(eds.is_empty(), "{eds:?}");
    }

    /// What `ty` owes, as (name, version) updates and removals.
    type Owed = (Vec<(String, String)>, Vec<String>);

    /// What the stream owes against the cache's current view, worked out from the names that
    /// changed (as a push does) and by walking every name; the stream is left as it was.
    /// Also says whether the first was really the shortcut.
    fn owed_both_ways(h: &mut Harness, ty: ResourceType) -> (Owed, Owed, bool) {
        let current = h
            .cache
            .current()
            .and_then(|v| v.get(ty).cloned())
            .expect("type served");
        let saved = h.stream.types.get(&ty).and_then(|s| s.reckoned.clone());
        let owed = |p: Pending| -> Owed {
            (
                p.updates.into_iter().map(|u| (u.name, u.version)).collect(),
                p.removals,
            )
        };
        let quick = owed(h.stream.pending(ty, &current));
        if let Some(state) = h.stream.types.get_mut(&ty) {
            state.reckoned = None;
        }
        let full = owed(h.stream.pending(ty, &current));
        if let Some(state) = h.stream.types.get_mut(&ty) {
            state.reckoned = saved.clone();
        }
        (quick, full, saved.is_some())
    }

    #[tokio::test]
    async fn what_a_push_owes_from_the_changed_names_is_what_a_full_walk_finds() {
        let mut h = subscribed(&[("a", &[1]), ("b", &[2]), ("c", &[3])]).await;
        let steps: [&[(&str, &[u8])]; 5] = [
            // An endpoint change; a new service (its assignment not subscribed); a service gone;
            // endpoints back to an earlier form; everything at once.
            &[("a", &[1]), ("b", &[2, 4]), ("c", &[3])],
            &[("a", &[1]), ("b", &[2, 4]), ("c", &[3]), ("d", &[5])],
            &[("a", &[1]), ("b", &[2, 4]), ("d", &[5])],
            &[("a", &[1]), ("b", &[2]), ("d", &[5])],
            &[("b", &[6]), ("d", &[]), ("e", &[7])],
        ];
        for (i, step) in steps.iter().enumerate() {
            let rejecting = i == 2;
            h.cache.update(&routing(i as u64 + 2, step));
            for ty in [CDS, EDS] {
                let (quick, full, shortcut) = owed_both_ways(&mut h, ty);
                assert!(shortcut, "step {i}: {ty:?} walked in full after plain ACKs");
                assert_eq!(quick, full, "step {i}: {ty:?}");
            }
            let view = h.cache.current().expect("a view");
            assert!(h.stream.push(&view).await.is_ok());
            for r in h.sent() {
                // One rejection along the way: the state it leaves is walked in full once.
                let answer = if rejecting && of(EDS, &r) {
                    nack(&r)
                } else {
                    ack(&r)
                };
                h.request(answer).await;
            }
            for r in h.sent() {
                h.request(ack(&r)).await;
            }
        }
        assert_eq!(h.nacks(EDS), 1);
    }
}
