//! The ADS server, state of the world (the incremental variant is `delta.rs`): the protocol half of go-control-plane's cache/server
//! split. It decides *when* to send *which version* to one Envoy; what a version contains comes
//! from `cache.rs`.
//!
//! One task folds every routing snapshot into a shared [`CacheSnapshot`] (so N Envoys cost one
//! encoding, and all see the same versions); one task per ADS stream speaks the protocol.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::ControlPlane;
use envoy_types::pb::envoy::service::discovery::v3::{
    aggregated_discovery_service_server::AggregatedDiscoveryService, DeltaDiscoveryRequest,
    DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use super::cache::{CacheSnapshot, SnapshotCache, TypeSnapshot};
use super::connections::Connections;
use super::node::{FilterGuard, NodeView, Tailored};
use super::resources::{ResourceOptions, ResourceType};
use crate::metrics::{Metrics, TypeLabel};
use crate::routing::RoutingSnapshot;

/// Sent in every response, so Envoy's config dump says who configured it.
pub(super) const CONTROL_PLANE_ID: &str = "toolgate-xds";
/// Responses queued per stream before the stream task waits for Envoy to read.
pub(super) const RESPONSE_QUEUE: usize = 8;

/// The shared, versioned state; `None` until the registry has published its first snapshot.
pub(super) type CacheView = Option<Arc<CacheSnapshot>>;

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`, state of the world.
pub struct AdsService {
    cache: watch::Receiver<CacheView>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    next_stream: AtomicU64,
    connections: Arc<Connections>,
    /// The token each Envoy's filter must send with its reports, put into its configuration.
    report_token: Option<Arc<str>>,
}

impl AdsService {
    /// Starts the task that folds `snapshots` into the shared cache; it ends with `shutdown`
    /// or when the snapshot sender is dropped (streams then keep serving the last state).
    /// Must be called inside a Tokio runtime.
    ///
    /// A snapshot of generation 0 is the registry's placeholder before it has read etcd (or
    /// its state dir): it is never served, because an empty configuration would wipe the
    /// routes of every Envoy that reconnects to a restarting toolgate-xds. Requests that
    /// arrive before the first real snapshot are answered when it arrives. Resources are
    /// built with `options`.
    pub fn new(
        snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
        options: ResourceOptions,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> AdsService {
        let (tx, rx) = watch::channel(None);
        tokio::spawn(fold_snapshots(snapshots, options, tx, shutdown.clone()));
        AdsService {
            cache: rx,
            metrics,
            shutdown,
            next_stream: AtomicU64::new(1),
            connections: Arc::default(),
            report_token: None,
        }
    }

    /// Puts `token` into every Envoy's filter configuration: toolgate-xds requires it on the
    /// filters' reports.
    pub fn with_report_token(mut self, token: Option<Arc<str>>) -> AdsService {
        self.report_token = token;
        self
    }

    /// Lists its streams in `connections` (the admin API's `/v1/envoys`).
    pub fn with_connections(mut self, connections: Arc<Connections>) -> AdsService {
        self.connections = connections;
        self
    }
}

/// Applies every routing snapshot to the cache and publishes the new view when a type changed.
/// A burst of snapshots coalesces for free: `watch` keeps only the latest.
async fn fold_snapshots(
    mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    options: ResourceOptions,
    views: watch::Sender<CacheView>,
    shutdown: CancellationToken,
) {
    let mut cache = SnapshotCache::with_options(options);
    loop {
        let snapshot = Arc::clone(&snapshots.borrow_and_update());
        if snapshot.generation > 0 {
            let changed = cache.update(&snapshot);
            if !changed.is_empty() {
                let names: Vec<&str> = changed.iter().map(|t| t.short_name()).collect();
                debug!(generation = snapshot.generation, changed = ?names, "xDS cache updated");
                views.send_replace(cache.current());
            }
        }
        tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { break },
            () = shutdown.cancelled() => break,
        }
    }
    debug!("xDS cache task ended");
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsService {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let peer = request.remote_addr();
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = AdsStream {
            id,
            connections: Arc::clone(&self.connections),
            peer,
            node: NodeView::default(),
            report_token: self.report_token.clone(),
            started: Instant::now(),
            nonce: 0,
            types: BTreeMap::new(),
            guard: FilterGuard::default(),
            metrics: Arc::clone(&self.metrics),
            tx,
            shutdown: self.shutdown.clone(),
        };
        tokio::spawn(stream.run(requests, self.cache.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let peer = request.remote_addr();
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = super::delta::DeltaStream::new(
            id,
            Arc::clone(&self.connections),
            peer,
            self.report_token.clone(),
            Arc::clone(&self.metrics),
            tx,
            self.shutdown.clone(),
        );
        tokio::spawn(stream.run(requests, self.cache.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What an Envoy subscribed for one type.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Subscription {
    /// Everything of the type (CDS with no names, or any type with `*`).
    Wildcard,
    Names(BTreeSet<String>),
}

impl Subscription {
    fn from_request(ty: ResourceType, names: &[String]) -> Subscription {
        if names.iter().any(|n| n == "*") || (names.is_empty() && ty.empty_names_mean_wildcard()) {
            Subscription::Wildcard
        } else {
            Subscription::Names(names.iter().cloned().collect())
        }
    }

    /// Whether a response computed for `self` answered everything `other` asks for.
    fn covers(&self, other: &Subscription) -> bool {
        match (self, other) {
            (Subscription::Wildcard, _) => true,
            (Subscription::Names(_), Subscription::Wildcard) => false,
            (Subscription::Names(mine), Subscription::Names(theirs)) => theirs.is_subset(mine),
        }
    }
}

/// The last response sent for a type. A request whose `response_nonce` is not this `nonce` was
/// written before Envoy saw this response: the subscription it carries is stale and ignored
/// (its ACK or NACK is not: see [`Unanswered`]).
#[derive(Debug)]
struct Sent {
    version: String,
    nonce: String,
    /// The subscription the response was computed for (not the names it held: a subscribed
    /// name toolgate does not know is covered, or every ACK would trigger another response).
    subscription: Subscription,
}

/// A response Envoy has not answered yet. Envoy answers every response, in order, but may read
/// several before its first answer arrives: a NACK then names an older response than the last
/// one sent, and is accounted to that response and what it carried.
#[derive(Debug)]
struct Unanswered {
    nonce: String,
    version: String,
    /// EDS only: the assignments it carried, each with its content hash.
    carried: Vec<(String, u64)>,
}

/// Unanswered responses kept per type. Envoy answers in order, so only the responses sent
/// since its last answer are kept; the bound matters only for an Envoy that reads but never
/// answers. An answer to a response no longer kept is treated as naming an unknown response.
const UNANSWERED_KEPT: usize = 256;

/// Protocol state of one type on one stream.
#[derive(Debug)]
struct TypeState {
    subscription: Subscription,
    sent: Option<Sent>,
    /// Responses sent and not answered yet, oldest first.
    unanswered: VecDeque<Unanswered>,
    /// Last version Envoy accepted: logged when the stream ends, to tell what it kept.
    acked: Option<String>,
    /// Not EDS: last version Envoy rejected. It is never sent again on this stream: Envoy
    /// would reject it again, in a loop. The next different version is sent as usual. EDS
    /// keeps rejections per assignment instead (`rejected`, `suspects`): a rejected version
    /// must not hold back the other assignments it carried, nor the assignments re-created
    /// clusters wait for.
    nacked: Option<String>,
    /// EDS only: CDS was sent after the last EDS response. Envoy's new and changed clusters
    /// warm until they receive an assignment, even one whose version has not changed, so the
    /// next EDS push or request is answered regardless of versions.
    answer_next: bool,
    /// EDS only: the content hash of each assignment as last delivered on this stream (sent,
    /// and not known to be rejected). A push sends only the assignments that differ: a SotW
    /// EDS response may omit resources, and Envoy then leaves those clusters alone instead of
    /// re-applying a thousand unchanged ones.
    delivered: HashMap<String, u64>,
    /// EDS only: assignments Envoy rejected in a response that carried nothing else, by
    /// content hash. Not sent again in that form (Envoy would reject it again, in a loop); the
    /// next change of the assignment goes out as usual.
    rejected: HashMap<String, u64>,
    /// EDS only: assignments that were in a rejected response together with others. Envoy
    /// validates every resource of a response before applying any, so it applied none of
    /// them: each goes again in a response of its own, until Envoy accepts it or rejects it
    /// alone. One invalid assignment cannot hold back the rest.
    suspects: BTreeSet<String>,
}

impl TypeState {
    fn new(ty: ResourceType) -> TypeState {
        TypeState {
            subscription: Subscription::from_request(ty, &[]),
            sent: None,
            unanswered: VecDeque::new(),
            acked: None,
            nacked: None,
            answer_next: false,
            delivered: HashMap::new(),
            rejected: HashMap::new(),
            suspects: BTreeSet::new(),
        }
    }

    /// Takes the response `nonce` names off the unanswered list, with every older one (Envoy
    /// answers in order, so an answer to a later response settles them too); the named one is
    /// last. Empty if the nonce is not known (answered already, or no longer kept).
    fn settle(&mut self, nonce: &str) -> Vec<Unanswered> {
        match self.unanswered.iter().position(|u| u.nonce == nonce) {
            Some(at) => self.unanswered.drain(..=at).collect(),
            None => Vec::new(),
        }
    }

    /// EDS: Envoy rejected `responses` (from [`settle`](Self::settle)), so what they
    /// carried was not applied and goes again: alone if it was alone (then it is the culprit
    /// and is not sent again in that form), each in its own response if there were several.
    fn eds_rejected(&mut self, responses: &[Unanswered]) {
        if responses.is_empty() {
            // Which response Envoy rejected is unknown: assume it holds nothing from us.
            self.delivered.clear();
            return;
        }
        let carried: BTreeSet<(&String, u64)> = responses
            .iter()
            .flat_map(|r| r.carried.iter().map(|(n, h)| (n, *h)))
            .collect();
        for (name, hash) in &carried {
            if self.delivered.get(*name) == Some(hash) {
                self.delivered.remove(*name);
            }
        }
        let mut names = carried.iter().map(|(n, h)| (*n, *h));
        match (names.next(), names.next()) {
            (Some((name, hash)), None) => {
                self.suspects.remove(name);
                self.rejected.insert(name.clone(), hash);
            }
            _ => self
                .suspects
                .extend(carried.iter().map(|(n, _)| (*n).clone())),
        }
    }

    /// EDS: Envoy accepted `responses`: what they carried is no longer suspect.
    fn eds_accepted(&mut self, responses: &[Unanswered]) {
        for (name, _) in responses.iter().flat_map(|r| &r.carried) {
            self.suspects.remove(name);
        }
    }

    /// EDS: the assignments to send for `current`, with their hashes: every subscribed one
    /// toolgate has when `full`, else those not delivered in their current form; never one
    /// Envoy rejected in its current form.
    /// Only `node`'s: a shard gets no other service's assignment.
    fn eds_wanted(
        &self,
        current: &TypeSnapshot,
        full: bool,
        node: &NodeView,
    ) -> Vec<(String, u64)> {
        let names: Vec<&String> = match &self.subscription {
            Subscription::Wildcard => current.names().collect(),
            Subscription::Names(names) => names.iter().collect(),
        };
        names
            .into_iter()
            .filter(|name| node.serves(ResourceType::Endpoint, name))
            .filter_map(|name| {
                let hash = current.hash(name)?;
                let wanted = self.rejected.get(name) != Some(&hash)
                    && (full || self.delivered.get(name) != Some(&hash));
                wanted.then(|| (name.clone(), hash))
            })
            .collect()
    }

    /// EDS: forgets what it knows of assignments this Envoy no longer subscribes to.
    fn eds_forget_unsubscribed(&mut self, current: &TypeSnapshot) {
        let subscription = &self.subscription;
        let keep = |name: &String| match subscription {
            Subscription::Wildcard => current.hash(name).is_some(),
            Subscription::Names(names) => names.contains(name),
        };
        self.delivered.retain(|n, _| keep(n));
        self.rejected.retain(|n, _| keep(n));
        self.suspects.retain(|n| keep(n));
    }
}

/// Why a stream task ended.
pub(super) enum End {
    EnvoyClosed,
    EnvoyError(Status),
    ResponseDropped,
    Shutdown,
}

/// The response side of the stream is gone (Envoy disconnected), or shutdown began.
pub(super) struct Closed;

/// One ADS stream: one Envoy.
struct AdsStream {
    id: u64,
    connections: Arc<Connections>,
    peer: Option<SocketAddr>,
    /// From the first request (`set_node_on_first_message_only`).
    node: NodeView,
    report_token: Option<Arc<str>>,
    started: Instant,
    nonce: u64,
    /// Only types the Envoy has asked for: nothing is pushed before it subscribes.
    types: BTreeMap<ResourceType, TypeState>,
    /// Keeps a filter configuration the filter would refuse from this Envoy.
    guard: FilterGuard,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    /// Also ends a send blocked on an Envoy that stopped reading, so shutdown never hangs.
    shutdown: CancellationToken,
}

/// Keeps `connected_envoys` right however the stream task ends, errors and panics included.
pub(super) struct ConnectedGuard(Arc<Metrics>);

impl ConnectedGuard {
    pub(super) fn new(metrics: &Arc<Metrics>) -> ConnectedGuard {
        metrics.connected_envoys.inc();
        ConnectedGuard(Arc::clone(metrics))
    }
}

impl Drop for ConnectedGuard {
    fn drop(&mut self) {
        self.0.connected_envoys.dec();
    }
}

impl AdsStream {
    async fn run(
        mut self,
        mut requests: Streaming<DiscoveryRequest>,
        mut cache: watch::Receiver<CacheView>,
    ) {
        let shutdown = self.shutdown.clone();
        let _connected = ConnectedGuard::new(&self.metrics);
        let _listed = self.connections.open(self.id, self.peer);
        debug!(stream = self.id, peer = ?self.peer, "ADS stream opened");
        // Responses already sent reflect the cache as of now; only later views are pushes.
        cache.borrow_and_update();
        let mut cache_open = true;
        let end = loop {
            tokio::select! {
                () = shutdown.cancelled() => break End::Shutdown,
                message = requests.message() => match message {
                    Ok(Some(request)) => {
                        // The latest view, even if its push is still pending: the push then
                        // finds nothing left to send.
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
                    // The cache task is gone (shutting down): keep serving the last view.
                    Err(_) => cache_open = false,
                },
            }
        };
        let end = if shutdown.is_cancelled() {
            End::Shutdown
        } else {
            end
        };
        // What this Envoy keeps serving until it reconnects.
        let acked: Vec<String> = self
            .types
            .iter()
            .map(|(t, s)| format!("{}={}", t.short_name(), s.acked.as_deref().unwrap_or("-")))
            .collect();
        log_end(end, &self.node.id, self.id, self.peer, &acked.join(" "));
    }

    /// Handles one DiscoveryRequest: ACK, NACK, or (re)subscription, and answers it if the
    /// Envoy lacks something.
    async fn on_request(
        &mut self,
        request: DiscoveryRequest,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        if !self.node.is_identified() {
            if let Some(node) = &request.node {
                self.node = NodeView::identify(node, self.id, self.peer, "sotw", &self.connections);
            }
        }
        let Some(ty) = ResourceType::from_type_url(&request.type_url) else {
            debug!(node = %self.node, type_url = %request.type_url,
                "request for a type toolgate does not serve; ignored");
            return Ok(());
        };
        let node = self.node.id.clone();
        let state = self.types.entry(ty).or_insert_with(|| TypeState::new(ty));

        // A request written before Envoy saw our latest response: the subscription it carries
        // is outdated (the request that answers the latest response carries the current one),
        // but its ACK or NACK is news about the response it names.
        let stale = !request.response_nonce.is_empty()
            && state
                .sent
                .as_ref()
                .is_none_or(|s| s.nonce != request.response_nonce);
        if !request.response_nonce.is_empty() {
            let answered = state.settle(&request.response_nonce);
            let version = answered.last().map(|a| a.version.clone());
            if let Some(error) = &request.error_detail {
                warn!(node = %node, r#type = ty.short_name(),
                    version = version.as_deref().unwrap_or("unknown"),
                    nonce = %request.response_nonce, stale, kept = %request.version_info,
                    error = %error.message, "Envoy rejected an xDS response (NACK)");
                self.metrics
                    .nacks
                    .get_or_create(&TypeLabel {
                        r#type: ty.short_name(),
                    })
                    .inc();
                if let Some(version) = &version {
                    self.connections
                        .nacked(self.id, ty, version, &error.message);
                }
                if ty == ResourceType::Endpoint {
                    state.eds_rejected(&answered);
                } else if version.is_some() {
                    state.nacked = version;
                }
            } else if let Some(version) = version {
                debug!(node = %node, r#type = ty.short_name(), %version, stale, "ACK");
                state.eds_accepted(&answered);
                self.connections.acked(self.id, ty, &version);
                state.acked = Some(version);
            } else {
                debug!(node = %node, r#type = ty.short_name(), nonce = %request.response_nonce,
                    "answer to a response not kept (answered already); ignored");
            }
        }
        if stale {
            debug!(node = %node, r#type = ty.short_name(), nonce = %request.response_nonce,
                "stale request: its subscription is ignored");
        } else {
            state.subscription = Subscription::from_request(ty, &request.resource_names);
        }

        let Some(current) = view.and_then(|v| v.get(ty)) else {
            // Not ready, or a type not built yet (ECDS): answered by the push that brings it.
            return Ok(());
        };
        let answer = if ty == ResourceType::Endpoint {
            // By assignment, not by version: a NACK (stale or not) may have taken back
            // assignments Envoy must get again, while a version it rejected must not be
            // resent just because Envoy still reports the one before.
            match &state.sent {
                None => !stale,
                Some(sent) => {
                    !state.eds_wanted(current, false, &self.node).is_empty()
                        || (!stale
                            && (state.answer_next
                                || !sent.subscription.covers(&state.subscription)))
                }
            }
        } else if stale || state.nacked.as_deref() == Some(current.version.as_str()) {
            false
        } else {
            match &state.sent {
                // Nothing sent on this stream yet: Envoy waits for a first answer.
                None => true,
                Some(sent) => {
                    request.version_info != current.version
                        || !sent.subscription.covers(&state.subscription)
                        || state.answer_next
                }
            }
        };
        if answer {
            let current = Arc::clone(current);
            self.send(ty, &current).await?;
        }
        Ok(())
    }

    /// A new cache view: sends every type whose version this Envoy lacks, in push order (CDS,
    /// EDS, RDS). Types the Envoy never asked for are not pushed.
    async fn push(&mut self, view: &CacheSnapshot) -> Result<(), Closed> {
        for ty in ResourceType::ALL {
            let Some(state) = self.types.get(&ty) else {
                continue;
            };
            let Some(current) = view.get(ty) else {
                continue;
            };
            let lacks = match &state.sent {
                None => true,
                Some(sent) if ty == ResourceType::Endpoint => {
                    sent.version != current.version
                        || state.answer_next
                        || !state.eds_wanted(current, false, &self.node).is_empty()
                }
                Some(_) if state.nacked.as_deref() == Some(current.version.as_str()) => false,
                Some(sent) => sent.version != current.version || state.answer_next,
            };
            if lacks {
                let current = Arc::clone(current);
                self.send(ty, &current).await?;
            }
        }
        Ok(())
    }

    /// Sends `current` for the names this Envoy subscribed and records it. EDS sends only what
    /// this Envoy lacks (everything after CDS), in one response, except that each suspect of
    /// an earlier rejection goes in a response of its own.
    async fn send(&mut self, ty: ResourceType, current: &Arc<TypeSnapshot>) -> Result<(), Closed> {
        if ty == ResourceType::ExtensionConfig && self.node.filter.is_none() {
            warn!(node = %self.node, "Envoy asked for the filter configuration but its bootstrap names no filter path (node metadata toolgate.filter_path); not answering");
            return Ok(());
        }
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        if ty != ResourceType::Endpoint {
            let names: Vec<&String> = match &state.subscription {
                Subscription::Wildcard => current.names().collect(),
                Subscription::Names(names) => names.iter().collect(),
            };
            let node = &self.node;
            let token = self.report_token.as_deref();
            let guard = &mut self.guard;
            let metrics = &self.metrics;
            let resources = names
                .into_iter()
                .filter(|name| node.serves(ty, name))
                .filter_map(|name| {
                    let (any, hash) = current.entry(name)?;
                    match guard.tailor(node, ty, name, any, hash, token, metrics) {
                        Tailored::Made(made) => Some(made),
                        Tailored::AsIs => Some(any.clone()),
                        Tailored::Nothing => None,
                    }
                })
                .collect();
            return self.send_response(ty, current, resources, Vec::new()).await;
        }
        // After CDS, re-created clusters warm until they get an assignment, changed or not:
        // then (and on a fresh stream, where `delivered` is empty) EDS goes out in full.
        let wanted = state.eds_wanted(current, state.answer_next, &self.node);
        state.eds_forget_unsubscribed(current);
        let (alone, together): (Vec<_>, Vec<_>) = wanted
            .into_iter()
            .partition(|(name, _)| state.suspects.contains(name));
        // The response with everything else goes also when empty: it answers the request and
        // carries the version.
        let mut responses = Vec::new();
        if !together.is_empty() || alone.is_empty() {
            responses.push(together);
        }
        responses.extend(alone.into_iter().map(|one| vec![one]));
        for carried in responses {
            let resources = current.select(carried.iter().map(|(name, _)| name));
            self.send_response(ty, current, resources, carried).await?;
        }
        Ok(())
    }

    /// Sends one response of `current`'s version with `resources` and records it; `carried`
    /// names (EDS) the assignments among them, with their hashes.
    async fn send_response(
        &mut self,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        resources: Vec<envoy_types::pb::google::protobuf::Any>,
        carried: Vec<(String, u64)>,
    ) -> Result<(), Closed> {
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        let count = resources.len();
        let response = DiscoveryResponse {
            version_info: current.version.clone(),
            resources,
            type_url: ty.type_url().to_string(),
            nonce: nonce.clone(),
            control_plane: Some(ControlPlane {
                identifier: CONTROL_PLANE_ID.to_string(),
            }),
            ..Default::default()
        };
        let first_of_version = state
            .sent
            .as_ref()
            .is_none_or(|s| s.version != current.version);
        state.sent = Some(Sent {
            version: current.version.clone(),
            nonce: nonce.clone(),
            subscription: state.subscription.clone(),
        });
        for (name, hash) in &carried {
            state.delivered.insert(name.clone(), *hash);
        }
        if state.unanswered.len() == UNANSWERED_KEPT {
            state.unanswered.pop_front();
        }
        state.unanswered.push_back(Unanswered {
            nonce: nonce.clone(),
            version: current.version.clone(),
            carried,
        });
        state.answer_next = false;
        if ty == ResourceType::Cluster {
            if let Some(eds) = self.types.get_mut(&ResourceType::Endpoint) {
                eds.answer_next = true;
            }
        }
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
        debug!(node = %self.node, r#type = ty.short_name(), version = %current.version,
            nonce = %nonce, resources = count, "xDS response sent");
        Ok(())
    }
}

/// Logs how a stream ended and what its Envoy kept (`acked`, per type).
pub(super) fn log_end(end: End, node: &str, id: u64, peer: Option<SocketAddr>, acked: &str) {
    match end {
        End::EnvoyClosed | End::ResponseDropped => {
            info!(node = %node, stream = id, peer = ?peer, %acked, "Envoy disconnected")
        }
        End::EnvoyError(status) => {
            info!(node = %node, stream = id, peer = ?peer, %acked,
            code = ?status.code(), error = %status.message(), "Envoy disconnected")
        }
        End::Shutdown => {
            info!(node = %node, stream = id, %acked, "ADS stream closed for shutdown")
        }
    }
}

/// Records that one response of `current` (`count` resources) went to an Envoy: the push span
/// (a child of every etcd change folded into the version), the metrics, `/v1/envoys`.
#[allow(clippy::too_many_arguments)]
pub(super) fn record_push(
    metrics: &Metrics,
    connections: &Connections,
    stream: u64,
    node: &str,
    stream_started: Instant,
    ty: ResourceType,
    current: &TypeSnapshot,
    count: usize,
    first_of_version: bool,
) {
    let label = TypeLabel {
        r#type: ty.short_name(),
    };
    // A version whose changes carried no trace (the first read) is still recorded, as a root
    // span.
    let untraced = [crate::trace::TraceParent::default()];
    let traces = if current.traces.is_empty() {
        &untraced[..]
    } else {
        &current.traces[..]
    };
    for trace in traces {
        let span = tracing::info_span!(target: crate::trace::TARGET, "xds.push",
            node = %node, r#type = ty.short_name(), version = %current.version,
            resources = count);
        trace.adopt(&span);
    }
    metrics.pushes.get_or_create(&label).inc();
    connections.sent(stream, ty, &current.version);
    // Latency of propagating a change, not of catching up: only a version that became current
    // while this Envoy was connected, measured once per version.
    if first_of_version && current.current_since >= stream_started {
        metrics
            .push_latency
            .get_or_create(&label)
            .observe(current.changed_at.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::routing::{Bulkhead, EndpointHealth, RouteEndpoint, ServiceRoute};
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use std::net::IpAddr;

    const CDS: ResourceType = ResourceType::Cluster;
    const EDS: ResourceType = ResourceType::Endpoint;
    const RDS: ResourceType = ResourceType::Route;

    /// Services named in `services`, each with one instance per entry of its list.
    pub(in crate::xds) fn routing(generation: u64, services: &[(&str, &[u8])]) -> RoutingSnapshot {
        RoutingSnapshot {
            generation,
            changed_at: Instant::now(),
            traces: Default::default(),
            recent: std::sync::Arc::from([]),
            services: services
                .iter()
                .map(|(name, octets)| {
                    (
                        name.to_string(),
                        ServiceRoute {
                            mcp_path: "/mcp".into(),
                            limits: Bulkhead::default(),
                            timeout_ms: 60_000,
                            endpoints: octets
                                .iter()
                                .map(|o| RouteEndpoint {
                                    instance_id: format!("{name}-{o}"),
                                    ip: IpAddr::from([10, 0, 0, *o]),
                                    port: 80,
                                    weight: 1,
                                    health: EndpointHealth::Healthy,
                                })
                                .collect(),
                        },
                    )
                })
                .collect(),
            filter_config: Arc::from("{}"),
            filter_urgency: 0,
            virtual_servers: Vec::new(),
            max_body_bytes: 1024 * 1024,
            default_timeout_ms: 60_000,
            auth: None,
            control: Default::default(),
        }
    }

    /// A stream under test, its response queue, and the cache that feeds it.
    struct Harness {
        stream: AdsStream,
        rx: mpsc::Receiver<Result<DiscoveryResponse, Status>>,
        cache: SnapshotCache,
        metrics: Arc<Metrics>,
    }

    impl Harness {
        fn new() -> Harness {
            let metrics = Arc::new(Metrics::new());
            let (tx, rx) = mpsc::channel(64);
            Harness {
                stream: AdsStream {
                    connections: Arc::default(),
                    id: 1,
                    peer: None,
                    node: NodeView::default(),
                    report_token: None,
                    started: Instant::now(),
                    nonce: 0,
                    types: BTreeMap::new(),
                    guard: FilterGuard::default(),
                    metrics: Arc::clone(&metrics),
                    tx,
                    shutdown: CancellationToken::new(),
                },
                rx,
                cache: SnapshotCache::new(),
                metrics,
            }
        }

        fn view(&self) -> Option<Arc<CacheSnapshot>> {
            self.cache.current()
        }

        /// Applies a routing snapshot and pushes the new view, as the stream task does.
        async fn publish(&mut self, snapshot: RoutingSnapshot) {
            self.cache.update(&snapshot);
            let view = self.view().expect("a view after an update");
            assert!(self.stream.push(&view).await.is_ok());
        }

        async fn request(&mut self, request: DiscoveryRequest) {
            let view = self.view();
            assert!(self
                .stream
                .on_request(request, view.as_deref())
                .await
                .is_ok());
        }

        /// The responses sent since the last call.
        fn sent(&mut self) -> Vec<DiscoveryResponse> {
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

    fn request(ty: ResourceType, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            node: Some(Node {
                id: "envoy-1".into(),
                ..Default::default()
            }),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            type_url: ty.type_url().into(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    /// The ACK of `response`, keeping the subscription `names`.
    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        let ty = ResourceType::from_type_url(&response.type_url).expect("known type");
        request(ty, names, &response.version_info, &response.nonce)
    }

    fn nack(response: &DiscoveryResponse, names: &[&str], kept: &str) -> DiscoveryRequest {
        let ty = ResourceType::from_type_url(&response.type_url).expect("known type");
        DiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "bad cluster".into(),
                details: Vec::new(),
            }),
            ..request(ty, names, kept, &response.nonce)
        }
    }

    fn resource_count(r: &DiscoveryResponse) -> usize {
        r.resources.len()
    }

    #[tokio::test]
    async fn first_request_is_answered_and_its_ack_is_not() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        assert!(
            h.sent().is_empty(),
            "nothing pushed before Envoy subscribes"
        );

        h.request(request(CDS, &[], "", "")).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].type_url, CDS.type_url());
        assert_eq!(resource_count(&sent[0]), 1);
        assert_eq!(h.stream.node.id, "envoy-1");

        h.request(ack(&sent[0], &[])).await;
        assert!(
            h.sent().is_empty(),
            "an ACK of the current version needs no answer"
        );
    }

    #[tokio::test]
    async fn requests_before_the_first_snapshot_are_answered_when_it_arrives() {
        let mut h = Harness::new();
        h.request(request(CDS, &[], "", "")).await;
        assert!(h.sent().is_empty(), "nothing to serve yet");
        h.publish(routing(1, &[("a", &[1])])).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].type_url, CDS.type_url());
    }

    #[tokio::test]
    async fn a_stale_nonce_is_ignored() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        let first = h.sent().remove(0);
        h.publish(routing(2, &[("a", &[1, 2])])).await;
        let second = h.sent().remove(0);
        assert_ne!(first.version_info, second.version_info);
        // Written before Envoy saw `second`: asks for a new name, but is stale.
        h.request(request(EDS, &["mcp.a", "mcp.b"], "", &first.nonce))
            .await;
        assert!(h.sent().is_empty());
    }

    #[tokio::test]
    async fn a_nacked_version_is_never_sent_again_but_the_next_one_is() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(CDS, &[], "", "")).await;
        let v1 = h.sent().remove(0);
        h.request(ack(&v1, &[])).await;
        h.publish(routing(2, &[("a", &[1]), ("b", &[])])).await;
        let v2 = h.sent().remove(0);
        assert_eq!(v2.type_url, CDS.type_url());

        h.request(nack(&v2, &[], &v1.version_info)).await;
        assert_eq!(h.nacks(CDS), 1);
        assert!(h.sent().is_empty(), "the rejected version is not resent");
        // The same content under a new generation is the same version: still not resent.
        h.publish(routing(3, &[("a", &[1]), ("b", &[])])).await;
        assert!(h.sent().is_empty());
        // Envoy asks again (e.g. after another type's update): still not resent.
        h.request(request(CDS, &[], &v1.version_info, &v2.nonce))
            .await;
        assert!(h.sent().is_empty());

        h.publish(routing(4, &[("a", &[1]), ("c", &[])])).await;
        let v3 = h.sent().remove(0);
        assert_eq!(v3.type_url, CDS.type_url());
        assert_ne!(v3.version_info, v2.version_info);
    }

    #[tokio::test]
    async fn new_names_are_answered_at_once_even_if_the_version_is_unchanged() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        let r = h.sent().remove(0);
        assert_eq!(resource_count(&r), 1);
        // A cluster started warming: its name joins the subscription.
        h.request(request(EDS, &["mcp.a", "mcp.b"], &r.version_info, &r.nonce))
            .await;
        let r2 = h.sent().remove(0);
        assert_eq!(r2.version_info, r.version_info);
        assert_eq!(
            resource_count(&r2),
            1,
            "only the new name; mcp.a was delivered"
        );
        // A name toolgate does not know is answered once (without it), not on every ACK.
        h.request(request(
            EDS,
            &["mcp.a", "mcp.b", "mcp.x"],
            &r2.version_info,
            &r2.nonce,
        ))
        .await;
        let r3 = h.sent().remove(0);
        assert_eq!(resource_count(&r3), 0, "nothing this stream lacks");
        h.request(ack(&r3, &["mcp.a", "mcp.b", "mcp.x"])).await;
        assert!(h.sent().is_empty());
        // Fewer names need no answer.
        h.request(ack(&r3, &["mcp.a"])).await;
        assert!(h.sent().is_empty());
    }

    /// The EDS responses among `sent`, each as the names it carried.
    fn eds_names(sent: &[DiscoveryResponse]) -> Vec<Vec<String>> {
        use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
        use prost::Message;
        sent.iter()
            .filter(|r| r.type_url == EDS.type_url())
            .map(|r| {
                r.resources
                    .iter()
                    .map(|a| {
                        ClusterLoadAssignment::decode(a.value.as_slice())
                            .expect("an assignment")
                            .cluster_name
                    })
                    .collect()
            })
            .collect()
    }

    const ABC: &[&str] = &["mcp.a", "mcp.b", "mcp.c"];

    #[tokio::test]
    async fn an_eds_push_carries_only_the_assignments_that_changed_and_a_rejected_one_stays_out() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        assert_eq!(resource_count(&r), 3, "a fresh stream gets everything");
        h.request(ack(&r, ABC)).await;
        h.publish(routing(2, &[("a", &[1]), ("b", &[2, 4]), ("c", &[3])]))
            .await;
        let pushed = h.sent();
        assert_eq!(eds_names(&pushed), [vec!["mcp.b"]], "only mcp.b changed");
        // Envoy rejects it: b alone was in it, so b in that form is not sent again, and a and
        // c, which Envoy holds, are not either.
        h.request(nack(&pushed[0], ABC, &r.version_info)).await;
        assert_eq!(h.nacks(EDS), 1);
        assert!(h.sent().is_empty(), "the rejected assignment is not resent");
        // Envoy asks again, still reporting the version before: nothing to send.
        h.request(request(EDS, ABC, &r.version_info, &pushed[0].nonce))
            .await;
        assert!(h.sent().is_empty());
        // b's next form goes out as usual, still alone.
        h.publish(routing(3, &[("a", &[1]), ("b", &[2, 5]), ("c", &[3])]))
            .await;
        assert_eq!(eds_names(&h.sent()), [vec!["mcp.b"]]);
    }

    #[tokio::test]
    async fn a_shard_gets_the_control_assignment_and_a_member_change_sends_only_it() {
        use crate::routing::ControlMembers;
        use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
        const CONTROL: &str = crate::bootstrap::CONTROL_CLUSTER;
        let members = |peers: &[&str]| {
            Arc::new(ControlMembers {
                local: Some("127.0.0.1:19000".parse().expect("addr")),
                peers: peers.iter().map(|p| p.parse().expect("addr")).collect(),
            })
        };
        let mut h = Harness::new();
        let mut snap = routing(1, &[("a", &[1]), ("b", &[2])]);
        snap.control = members(&[]);
        h.publish(snap.clone()).await;
        // An Envoy that serves service `a` only.
        let services = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![Value {
                    kind: Some(Kind::StringValue("a".into())),
                }],
            })),
        };
        let toolgate = Struct {
            fields: [(
                super::super::shard::NODE_SERVICES_FIELD.to_string(),
                services,
            )]
            .into(),
        };
        let metadata = Struct {
            fields: [(
                super::super::ecds::NODE_METADATA_KEY.to_string(),
                Value {
                    kind: Some(Kind::StructValue(toolgate)),
                },
            )]
            .into(),
        };
        let names = ["mcp.a", "mcp.b", CONTROL];
        let mut first = request(EDS, &names, "", "");
        if let Some(node) = first.node.as_mut() {
            node.metadata = Some(metadata);
        }
        h.request(first).await;
        let r = h.sent().remove(0);
        assert_eq!(
            eds_names(std::slice::from_ref(&r)),
            [vec!["mcp.a", CONTROL]]
        );
        h.request(ack(&r, &names)).await;
        // A second toolgate-xds joins the fleet: only the control assignment goes.
        snap.generation = 2;
        snap.control = members(&["127.0.0.2:19000"]);
        h.publish(snap).await;
        assert_eq!(eds_names(&h.sent()), [vec![CONTROL]]);
    }

    #[tokio::test]
    async fn a_rejected_eds_response_with_several_assignments_goes_again_one_by_one() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(CDS, &[], "", "")).await;
        let cds = h.sent().remove(0);
        h.request(ack(&cds, &[])).await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        h.request(ack(&r, ABC)).await;
        let two = || routing(2, &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3])]);
        h.publish(two()).await;
        let both = h.sent().remove(0);
        assert_eq!(
            eds_names(std::slice::from_ref(&both)),
            [vec!["mcp.a", "mcp.b"]]
        );
        // Envoy applied none of it: a and b go again, each alone, so the invalid one cannot
        // hold back the other.
        h.request(nack(&both, ABC, &r.version_info)).await;
        let again = h.sent();
        assert_eq!(eds_names(&again), [vec!["mcp.a"], vec!["mcp.b"]]);
        // Envoy reads both before answering: its ACK of the first names an older response.
        h.request(ack(&again[0], ABC)).await;
        h.request(nack(&again[1], ABC, &again[0].version_info))
            .await;
        assert_eq!(h.nacks(EDS), 2);
        assert!(
            h.sent().is_empty(),
            "b in that form is the culprit: not resent"
        );
        // A CDS change re-creates clusters: each gets its assignment again, except the
        // rejected one, although the EDS version did not change.
        let mut limited = two();
        limited.generation = 3;
        if let Some(a) = limited.services.get_mut("a") {
            Arc::make_mut(a).limits.max_connections = 7;
        }
        h.publish(limited).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 2, "CDS, then EDS for the warming clusters");
        assert_eq!(eds_names(&sent), [vec!["mcp.a", "mcp.c"]]);
    }

    #[tokio::test]
    async fn a_nack_that_names_an_older_response_is_counted_and_what_it_carried_goes_again() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        h.request(ack(&r, ABC)).await;
        h.publish(routing(2, &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3])]))
            .await;
        let n = h.sent().remove(0);
        h.publish(routing(
            3,
            &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3, 6])],
        ))
        .await;
        let n1 = h.sent().remove(0);
        assert_eq!(eds_names(std::slice::from_ref(&n1)), [vec!["mcp.c"]]);
        // Envoy rejects N after N+1 went out: counted against N's version, and what N carried
        // goes again (each alone), although N+1 is what Envoy will hold.
        h.request(nack(&n, ABC, &r.version_info)).await;
        assert_eq!(h.nacks(EDS), 1);
        assert_eq!(eds_names(&h.sent()), [vec!["mcp.a"], vec!["mcp.b"]]);
        // The subscription of a stale request is outdated, though: a name it adds is not
        // answered (the request answering the latest response will say what Envoy wants).
        h.request(ack(&n1, &["mcp.a", "mcp.b", "mcp.c", "mcp.d"]))
            .await;
        assert!(h.sent().is_empty());
    }

    #[tokio::test]
    async fn changes_are_pushed_cds_eds_rds_and_eds_follows_every_cds() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(CDS, &[], "", "")).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        h.request(request(RDS, &["toolgate_routes"], "", "")).await;
        let initial = h.sent();
        assert_eq!(initial.len(), 3);
        let last: Vec<DiscoveryRequest> = initial
            .iter()
            .zip([&[][..], &["mcp.a"][..], &["toolgate_routes"][..]])
            .map(|(r, names)| ack(r, names))
            .collect();
        for a in last {
            h.request(a).await;
        }
        assert!(h.sent().is_empty());

        // A new service changes all three: pushed in order.
        h.publish(routing(2, &[("a", &[1]), ("b", &[2])])).await;
        let pushed: Vec<String> = h.sent().into_iter().map(|r| r.type_url).collect();
        assert_eq!(pushed, [CDS.type_url(), EDS.type_url(), RDS.type_url()]);

        // Only an endpoint changes: EDS alone.
        h.publish(routing(3, &[("a", &[1, 3]), ("b", &[2])])).await;
        let pushed: Vec<String> = h.sent().into_iter().map(|r| r.type_url).collect();
        assert_eq!(pushed, [EDS.type_url()]);

        // Only the limits change (CDS): EDS is sent too, unchanged, because Envoy re-creates
        // the cluster and it warms until it gets an assignment.
        let limited = |generation| {
            let mut r = routing(generation, &[("a", &[1, 3]), ("b", &[2])]);
            if let Some(a) = r.services.get_mut("a") {
                Arc::make_mut(a).limits.max_connections = 7;
            }
            r
        };
        let eds_before = h.view().and_then(|v| v.version(EDS).map(str::to_string));
        h.publish(limited(4)).await;
        let pushed = h.sent();
        let types: Vec<&str> = pushed.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(types, [CDS.type_url(), EDS.type_url()]);
        assert_eq!(Some(pushed[1].version_info.clone()), eds_before);

        // Nothing changed: nothing sent.
        h.publish(limited(5)).await;
        assert!(h.sent().is_empty());
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn empty_names_are_a_wildcard_only_for_cds() {
        assert_eq!(
            Subscription::from_request(ResourceType::Cluster, &[]),
            Subscription::Wildcard
        );
        assert_eq!(
            Subscription::from_request(ResourceType::Endpoint, &[]),
            Subscription::Names(BTreeSet::new())
        );
        assert_eq!(
            Subscription::from_request(ResourceType::Endpoint, &names(&["*"])),
            Subscription::Wildcard
        );
    }

    #[test]
    fn a_new_name_is_not_covered_by_the_last_response() {
        let sent = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a"]));
        let same = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a"]));
        let fewer = Subscription::from_request(ResourceType::Endpoint, &[]);
        let more = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a", "mcp.b"]));
        assert!(sent.covers(&same));
        assert!(sent.covers(&fewer));
        assert!(!sent.covers(&more));
        assert!(Subscription::Wildcard.covers(&more));
        assert!(!sent.covers(&Subscription::Wildcard));
    }
}
