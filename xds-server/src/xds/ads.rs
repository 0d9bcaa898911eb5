//! The ADS server, state of the world: the protocol half of go-control-plane's cache/server
//! split. It decides *when* to send *which version* to one Envoy; what a version contains comes
//! from `cache.rs`.
//!
//! One task folds every routing snapshot into a shared [`CacheSnapshot`] (so N Envoys cost one
//! encoding, and all see the same versions); one task per ADS stream speaks the protocol.

use std::collections::{BTreeMap, BTreeSet};
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
use super::resources::ResourceType;
use crate::metrics::{Metrics, TypeLabel};
use crate::routing::RoutingSnapshot;

/// Sent in every response, so Envoy's config dump says who configured it.
const CONTROL_PLANE_ID: &str = "toolgate-xds";
/// Responses queued per stream before the stream task waits for Envoy to read.
const RESPONSE_QUEUE: usize = 8;

/// The shared, versioned state; `None` until the registry has published its first snapshot.
type CacheView = Option<Arc<CacheSnapshot>>;

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`, state of the world.
pub struct AdsService {
    cache: watch::Receiver<CacheView>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    next_stream: AtomicU64,
}

impl AdsService {
    /// Starts the task that folds `snapshots` into the shared cache; it ends with `shutdown`
    /// or when the snapshot sender is dropped (streams then keep serving the last state).
    /// Must be called inside a Tokio runtime.
    ///
    /// A snapshot of generation 0 is the registry's placeholder before it has read etcd (or
    /// its state dir): it is never served, because an empty configuration would wipe the
    /// routes of every Envoy that reconnects to a restarting toolgate-xds. Requests that
    /// arrive before the first real snapshot are answered when it arrives.
    pub fn new(
        snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> AdsService {
        let (tx, rx) = watch::channel(None);
        tokio::spawn(fold_snapshots(snapshots, tx, shutdown.clone()));
        AdsService {
            cache: rx,
            metrics,
            shutdown,
            next_stream: AtomicU64::new(1),
        }
    }
}

/// Applies every routing snapshot to the cache and publishes the new view when a type changed.
/// A burst of snapshots coalesces for free: `watch` keeps only the latest.
async fn fold_snapshots(
    mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    views: watch::Sender<CacheView>,
    shutdown: CancellationToken,
) {
    let mut cache = SnapshotCache::new();
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
    type DeltaAggregatedResourcesStream =
        tokio_stream::Empty<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let peer = request.remote_addr();
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let stream = AdsStream {
            id: self.next_stream.fetch_add(1, Ordering::Relaxed),
            peer,
            node: String::new(),
            started: Instant::now(),
            nonce: 0,
            types: BTreeMap::new(),
            metrics: Arc::clone(&self.metrics),
            tx,
        };
        tokio::spawn(stream.run(requests, self.cache.clone(), self.shutdown.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "toolgate-xds speaks state-of-the-world ADS only (api_type GRPC, not DELTA_GRPC)",
        ))
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
/// written before Envoy saw this response: it is stale and ignored.
#[derive(Debug)]
struct Sent {
    version: String,
    nonce: String,
    /// The subscription the response was computed for (not the names it held: a subscribed
    /// name toolgate does not know is covered, or every ACK would trigger another response).
    subscription: Subscription,
}

/// Protocol state of one type on one stream.
#[derive(Debug)]
struct TypeState {
    subscription: Subscription,
    sent: Option<Sent>,
    /// Last version Envoy accepted (for logs).
    acked: Option<String>,
    /// Last version Envoy rejected. It is never sent again on this stream: Envoy would reject
    /// it again, in a loop. The next different version is sent as usual.
    nacked: Option<String>,
    /// EDS only: CDS was sent after the last EDS response. Envoy's new and changed clusters
    /// warm until they receive an assignment, even one whose version has not changed, so the
    /// next EDS push or request is answered regardless of versions.
    answer_next: bool,
}

impl TypeState {
    fn new(ty: ResourceType) -> TypeState {
        TypeState {
            subscription: Subscription::from_request(ty, &[]),
            sent: None,
            acked: None,
            nacked: None,
            answer_next: false,
        }
    }
}

/// Why a stream task ended.
enum End {
    EnvoyClosed,
    EnvoyError(Status),
    ResponseDropped,
    Shutdown,
}

/// The response side of the stream is gone (Envoy disconnected).
struct Closed;

/// One ADS stream: one Envoy.
struct AdsStream {
    id: u64,
    peer: Option<SocketAddr>,
    /// From the first request (`set_node_on_first_message_only`).
    node: String,
    started: Instant,
    nonce: u64,
    /// Only types the Envoy has asked for: nothing is pushed before it subscribes.
    types: BTreeMap<ResourceType, TypeState>,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
}

/// Keeps `connected_envoys` right however the stream task ends, errors and panics included.
struct ConnectedGuard(Arc<Metrics>);

impl ConnectedGuard {
    fn new(metrics: &Arc<Metrics>) -> ConnectedGuard {
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
        shutdown: CancellationToken,
    ) {
        let _connected = ConnectedGuard::new(&self.metrics);
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
        let node = self.node.as_str();
        match end {
            End::EnvoyClosed | End::ResponseDropped => {
                info!(node, stream = self.id, peer = ?self.peer, "Envoy disconnected")
            }
            End::EnvoyError(status) => info!(node, stream = self.id, peer = ?self.peer,
                code = ?status.code(), error = %status.message(), "Envoy disconnected"),
            End::Shutdown => info!(node, stream = self.id, "ADS stream closed for shutdown"),
        }
    }

    /// Handles one DiscoveryRequest: ACK, NACK, or (re)subscription, and answers it if the
    /// Envoy lacks something.
    async fn on_request(
        &mut self,
        request: DiscoveryRequest,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        if self.node.is_empty() {
            if let Some(node) = &request.node {
                self.node = node.id.clone();
                info!(node = %self.node, cluster = %node.cluster, stream = self.id,
                    peer = ?self.peer, "Envoy connected");
            }
        }
        let Some(ty) = ResourceType::from_type_url(&request.type_url) else {
            debug!(node = %self.node, type_url = %request.type_url,
                "request for a type toolgate does not serve; ignored");
            return Ok(());
        };
        let node = self.node.clone();
        let state = self.types.entry(ty).or_insert_with(|| TypeState::new(ty));

        if !request.response_nonce.is_empty() {
            let Some(sent) = state
                .sent
                .as_ref()
                .filter(|s| s.nonce == request.response_nonce)
            else {
                // Written before Envoy saw our latest response; the request that answers that
                // response follows and carries the current subscription.
                debug!(node = %node, r#type = ty.short_name(), nonce = %request.response_nonce,
                    "stale request ignored");
                return Ok(());
            };
            if let Some(error) = &request.error_detail {
                warn!(node = %node, r#type = ty.short_name(), version = %sent.version,
                    kept = %request.version_info, error = %error.message,
                    "Envoy rejected an xDS response (NACK)");
                self.metrics
                    .nacks
                    .get_or_create(&TypeLabel {
                        r#type: ty.short_name(),
                    })
                    .inc();
                state.nacked = Some(sent.version.clone());
            } else {
                debug!(node = %node, r#type = ty.short_name(), version = %sent.version, "ACK");
                state.acked = Some(sent.version.clone());
            }
        }
        state.subscription = Subscription::from_request(ty, &request.resource_names);

        let Some(current) = view.and_then(|v| v.get(ty)) else {
            // Not ready, or a type not built yet (ECDS): answered by the push that brings it.
            return Ok(());
        };
        if state.nacked.as_deref() == Some(current.version.as_str()) {
            return Ok(());
        }
        let answer = match &state.sent {
            // Nothing sent on this stream yet: Envoy waits for a first answer.
            None => true,
            Some(sent) => {
                request.version_info != current.version
                    || !sent.subscription.covers(&state.subscription)
                    || state.answer_next
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
            if state.nacked.as_deref() == Some(current.version.as_str()) {
                continue;
            }
            let lacks = match &state.sent {
                None => true,
                Some(sent) => sent.version != current.version || state.answer_next,
            };
            if lacks {
                let current = Arc::clone(current);
                self.send(ty, &current).await?;
            }
        }
        Ok(())
    }

    /// Sends `current` for the names this Envoy subscribed and records it.
    async fn send(&mut self, ty: ResourceType, current: &Arc<TypeSnapshot>) -> Result<(), Closed> {
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        let resources = match &state.subscription {
            Subscription::Wildcard => current.all(),
            Subscription::Names(names) => current.select(names),
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
        state.answer_next = false;
        if ty == ResourceType::Cluster {
            if let Some(eds) = self.types.get_mut(&ResourceType::Endpoint) {
                eds.answer_next = true;
            }
        }
        self.tx.send(Ok(response)).await.map_err(|_| Closed)?;

        let label = TypeLabel {
            r#type: ty.short_name(),
        };
        self.metrics.pushes.get_or_create(&label).inc();
        // Latency of propagating a change, not of catching up: only a version that became
        // current while this Envoy was connected, measured once per version.
        if first_of_version && current.current_since >= self.started {
            self.metrics
                .push_latency
                .get_or_create(&label)
                .observe(current.changed_at.elapsed().as_secs_f64());
        }
        debug!(node = %self.node, r#type = ty.short_name(), version = %current.version,
            nonce = %nonce, resources = count, "xDS response sent");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
