//! One ADS stream, whichever protocol it speaks: the loop that reads the Envoy's requests and
//! the cache's new views, identifies the node, settles ACKs and NACKs, sends responses and
//! logs how the stream ended. What state of the world (`ads.rs`) and incremental (`delta.rs`)
//! do differently is behind [`Protocol`]: how a request reads, what a type sends, and what an
//! answer changes in the protocol's own state.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{ControlPlane, Node};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

use super::cache::{CacheSnapshot, TypeSnapshot};
use super::connections::Connections;
use super::node::{FilterGuard, NodeView, Tailored};
use super::resources::ResourceType;
use crate::metrics::{Metrics, TypeLabel};

/// Sent in every response, so Envoy's config dump says who configured it.
const CONTROL_PLANE_ID: &str = "toolgate-xds";
/// Responses queued per stream before the stream task waits for Envoy to read.
pub(super) const RESPONSE_QUEUE: usize = 8;

/// Unanswered responses kept per type. Envoy answers in order, so only the responses sent
/// since its last answer are kept; the bound matters only for an Envoy that reads but never
/// answers. An answer to a response no longer kept is treated as naming an unknown response.
const UNANSWERED_KEPT: usize = 256;

/// The shared, versioned state; `None` until the registry has published its first snapshot.
pub(super) type CacheView = Option<Arc<CacheSnapshot>>;

/// Who configured the Envoy, for a response's `control_plane`.
pub(super) fn control_plane() -> Option<ControlPlane> {
    Some(ControlPlane {
        identifier: CONTROL_PLANE_ID.to_string(),
    })
}

/// One variant of the ADS protocol, as the stream driver ([`Stream::run`]) speaks it: how its requests
/// read, what it sends for a type, and what an ACK or NACK changes in its state. It keeps its
/// own state per type; what both keep (the unanswered responses, what Envoy accepted last, the
/// node) is the [`Envoy`]'s.
pub(super) trait Protocol: Sized + Send + 'static {
    type Request: AdsRequest + Send + Sync + 'static;
    type Response: Send + 'static;
    /// What a response carried of each resource it names, kept until Envoy answers it.
    type Carried: Send + Sync + 'static;
    /// In logs and in the connections table: "sotw" or "delta".
    const NAME: &'static str;

    /// Takes what a request for `ty` asks for, keeping state for `ty` from its first request
    /// on. `stale`: the request was written before Envoy saw the latest response of `ty`.
    fn subscribe(&mut self, ty: ResourceType, request: &Self::Request, stale: bool);
    /// Envoy accepted the last of `answered` (the responses an answer settled, oldest first).
    fn accepted(&mut self, ty: ResourceType, answered: &[Unanswered<Self::Carried>]);
    /// Envoy rejected the last of `answered`; empty if which response it rejected is unknown.
    fn rejected(&mut self, ty: ResourceType, answered: &[Unanswered<Self::Carried>]);

    /// Answers a request for `ty` whose subscription and ACK or NACK are taken: sends what the
    /// Envoy lacks of `view`.
    fn answer(
        &mut self,
        envoy: &mut Envoy<Self>,
        ty: ResourceType,
        request: &Self::Request,
        stale: bool,
        view: Option<&CacheSnapshot>,
    ) -> impl Future<Output = Result<(), Closed>> + Send;
    /// A new cache view: sends what the Envoy lacks of it.
    fn push(
        &mut self,
        envoy: &mut Envoy<Self>,
        view: &CacheSnapshot,
    ) -> impl Future<Output = Result<(), Closed>> + Send;

    /// When the protocol wants to act without a request or a new view; `None`: never.
    fn wake_at(&self) -> Option<tokio::time::Instant> {
        None
    }
    /// [`wake_at`](Self::wake_at) has come.
    fn woken(
        &mut self,
        envoy: &mut Envoy<Self>,
        view: Option<&CacheSnapshot>,
    ) -> impl Future<Output = Result<(), Closed>> + Send {
        let _ = (envoy, view);
        async { Ok(()) }
    }
}

/// What the stream driver reads of a request, in either protocol.
pub(super) trait AdsRequest {
    /// The node the request names (the first one of a stream, at least).
    fn node(&self) -> Option<&Node>;
    fn type_url(&self) -> &str;
    /// The response the request answers; empty if none.
    fn response_nonce(&self) -> &str;
    /// Set when the request rejects the response it answers (a NACK).
    fn error_detail(&self) -> Option<&RpcStatus>;
}

/// The two protocols' requests name these fields alike.
macro_rules! ads_request {
    ($($request:ty),*) => {$(
        impl AdsRequest for $request {
            fn node(&self) -> Option<&Node> {
                self.node.as_ref()
            }
            fn type_url(&self) -> &str {
                &self.type_url
            }
            fn response_nonce(&self) -> &str {
                &self.response_nonce
            }
            fn error_detail(&self) -> Option<&RpcStatus> {
                self.error_detail.as_ref()
            }
        }
    )*};
}

ads_request!(DiscoveryRequest, DeltaDiscoveryRequest);

/// Why a stream task ended.
enum End {
    EnvoyClosed,
    EnvoyError(Status),
    ResponseDropped,
    Shutdown,
}

/// The response side of the stream is gone (Envoy disconnected), or shutdown began.
pub(super) struct Closed;

/// A response Envoy has not answered yet. Envoy answers every response, in order, but may read
/// several before its first answer arrives: a NACK then names an older response than the last
/// one sent, and is accounted to that response and what it carried.
#[derive(Debug)]
pub(super) struct Unanswered<C> {
    /// Numbered in increasing order on a stream; a string on the wire.
    pub nonce: u64,
    /// The type's version it was computed from.
    pub version: String,
    /// The resources it carried that its answer concerns, by name.
    pub carried: Vec<(String, C)>,
}

/// What both protocols keep of the responses of one type on a stream.
#[derive(Debug)]
struct Responses<C> {
    /// The nonce and type version of the last response sent. A request whose `response_nonce`
    /// is not this nonce was written before Envoy saw that response: it is stale.
    last: Option<(u64, String)>,
    /// Responses sent and not answered yet, oldest first.
    unanswered: VecDeque<Unanswered<C>>,
    /// Last version Envoy accepted: logged when the stream ends, to tell what it kept.
    acked: Option<String>,
}

impl<C> Default for Responses<C> {
    fn default() -> Self {
        Responses {
            last: None,
            unanswered: VecDeque::new(),
            acked: None,
        }
    }
}

impl<C> Responses<C> {
    /// Takes the response `nonce` names off the unanswered list, with every older one (Envoy
    /// answers in order, so an answer to a later response settles them too); the named one is
    /// last. Empty if the nonce is not known (answered already, or no longer kept).
    fn settle(&mut self, nonce: &str) -> Vec<Unanswered<C>> {
        let Ok(nonce) = nonce.parse::<u64>() else {
            return Vec::new();
        };
        match self.unanswered.iter().position(|u| u.nonce == nonce) {
            Some(at) => self.unanswered.drain(..=at).collect(),
            None => Vec::new(),
        }
    }

    /// Whether a request answering `nonce` was written before Envoy saw the last response.
    fn is_stale(&self, nonce: &str) -> bool {
        !nonce.is_empty()
            && self
                .last
                .as_ref()
                .is_none_or(|(last, _)| nonce.parse::<u64>() != Ok(*last))
    }
}

/// The Envoy at the other end of one stream, as both protocols see it: who it is, what it was
/// sent and has not answered, and the way to send it more.
pub(super) struct Envoy<P: Protocol> {
    id: u64,
    connections: Arc<Connections>,
    peer: Option<SocketAddr>,
    /// From the first request (`set_node_on_first_message_only`).
    pub node: NodeView,
    report_token: Option<Arc<str>>,
    started: Instant,
    nonce: u64,
    /// Only types the Envoy has asked for.
    responses: BTreeMap<ResourceType, Responses<P::Carried>>,
    /// Keeps a filter configuration the filter would refuse from this Envoy.
    guard: FilterGuard,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Result<P::Response, Status>>,
    /// Also ends a send blocked on an Envoy that stopped reading, so shutdown never hangs.
    shutdown: CancellationToken,
}

impl<P: Protocol> Envoy<P> {
    pub fn new(
        id: u64,
        connections: Arc<Connections>,
        peer: Option<SocketAddr>,
        report_token: Option<Arc<str>>,
        metrics: Arc<Metrics>,
        tx: mpsc::Sender<Result<P::Response, Status>>,
        shutdown: CancellationToken,
    ) -> Envoy<P> {
        Envoy {
            id,
            connections,
            peer,
            node: NodeView::default(),
            report_token,
            started: Instant::now(),
            nonce: 0,
            responses: BTreeMap::new(),
            guard: FilterGuard::default(),
            metrics,
            tx,
            shutdown,
        }
    }

    /// The nonce of the next response.
    pub fn next_nonce(&mut self) -> u64 {
        self.nonce += 1;
        self.nonce
    }

    /// The nonce of the last response sent on this stream (0: none yet).
    pub fn last_nonce(&self) -> u64 {
        self.nonce
    }

    /// The type version of the last response of `ty` sent; `None` before the first.
    pub fn sent_version(&self, ty: ResourceType) -> Option<&str> {
        self.responses
            .get(&ty)
            .and_then(|r| r.last.as_ref())
            .map(|(_, version)| version.as_str())
    }

    /// The responses of `ty` Envoy has not answered yet, oldest first.
    pub fn unanswered(&self, ty: ResourceType) -> impl Iterator<Item = &Unanswered<P::Carried>> {
        self.responses
            .get(&ty)
            .into_iter()
            .flat_map(|r| r.unanswered.iter())
    }

    /// Whether `ty` is the filter configuration and this Envoy's bootstrap names no filter
    /// path: then it is not answered, and that is logged.
    pub fn lacks_filter_path(&self, ty: ResourceType) -> bool {
        let lacks = ty == ResourceType::ExtensionConfig && self.node.filter.is_none();
        if lacks {
            warn!(node = %self.node, "Envoy asked for the filter configuration but its bootstrap names no filter path (node metadata toolgate.filter_path); not answering");
        }
        lacks
    }

    /// `resource` (named `name`, made from source `hash`) as this Envoy gets it (see
    /// [`FilterGuard::tailor`]).
    pub fn tailor(&mut self, ty: ResourceType, name: &str, resource: &Any, hash: u64) -> Tailored {
        self.guard.tailor(
            &self.node,
            ty,
            name,
            resource,
            hash,
            self.report_token.as_deref(),
            &self.metrics,
        )
    }

    /// Sends `response` (numbered `nonce`, of `current`'s version, with `count` resources) and
    /// records it: unanswered until Envoy answers it (with what it `carried`), the push span,
    /// the metrics, `/v1/envoys`.
    pub async fn send(
        &mut self,
        ty: ResourceType,
        current: &TypeSnapshot,
        nonce: u64,
        response: P::Response,
        carried: Vec<(String, P::Carried)>,
        count: usize,
    ) -> Result<(), Closed> {
        let responses = self.responses.entry(ty).or_default();
        let first_of_version = responses
            .last
            .as_ref()
            .is_none_or(|(_, version)| *version != current.version);
        responses.last = Some((nonce, current.version.clone()));
        if responses.unanswered.len() == UNANSWERED_KEPT {
            responses.unanswered.pop_front();
        }
        responses.unanswered.push_back(Unanswered {
            nonce,
            version: current.version.clone(),
            carried,
        });
        tokio::select! {
            sent = self.tx.send(Ok(response)) => sent.map_err(|_| Closed)?,
            () = self.shutdown.cancelled() => return Err(Closed),
        }
        self.record_push(ty, current, count, first_of_version);
        Ok(())
    }

    /// Records that one response of `current` (`count` resources) went to this Envoy: the push
    /// span (a child of every etcd change folded into the version), the metrics, `/v1/envoys`.
    fn record_push(
        &self,
        ty: ResourceType,
        current: &TypeSnapshot,
        count: usize,
        first_of_version: bool,
    ) {
        let label = TypeLabel {
            r#type: ty.short_name(),
        };
        // A version whose changes carried no trace (the first read) is still recorded, as a
        // root span.
        let untraced = [crate::trace::TraceParent::default()];
        let traces = if current.traces.is_empty() {
            &untraced[..]
        } else {
            &current.traces[..]
        };
        for trace in traces {
            let span = tracing::info_span!(target: crate::trace::TARGET, "xds.push",
                node = %self.node.id, r#type = ty.short_name(), version = %current.version,
                resources = count);
            trace.adopt(&span);
        }
        self.metrics.pushes.get_or_create(&label).inc();
        self.connections.sent(self.id, ty, &current.version);
        // Latency of propagating a change, not of catching up: only a version that became
        // current while this Envoy was connected, measured once per version.
        if first_of_version && current.current_since >= self.started {
            self.metrics
                .push_latency
                .get_or_create(&label)
                .observe(current.changed_at.elapsed().as_secs_f64());
        }
    }

    /// What this Envoy keeps serving until it reconnects: the version it accepted last, per
    /// type.
    fn acked(&self) -> String {
        let acked: Vec<String> = self
            .responses
            .iter()
            .map(|(t, r)| format!("{}={}", t.short_name(), r.acked.as_deref().unwrap_or("-")))
            .collect();
        acked.join(" ")
    }
}

/// One ADS stream: one Envoy, spoken to in protocol `P`.
pub(super) struct Stream<P: Protocol> {
    pub envoy: Envoy<P>,
    pub protocol: P,
}

impl<P: Protocol> Stream<P> {
    /// Serves the stream until Envoy closes it, its response side is gone, or shutdown.
    pub async fn run(
        mut self,
        mut requests: Streaming<P::Request>,
        mut cache: watch::Receiver<CacheView>,
    ) {
        let shutdown = self.envoy.shutdown.clone();
        let (id, peer) = (self.envoy.id, self.envoy.peer);
        let _connected = ConnectedGuard::new(&self.envoy.metrics);
        let _listed = self.envoy.connections.open(id, peer);
        debug!(stream = id, ?peer, protocol = P::NAME, "ADS stream opened");
        // Responses already sent reflect the cache as of now; only later views are pushes.
        cache.borrow_and_update();
        let mut cache_open = true;
        let end = loop {
            let wake_at = self.protocol.wake_at();
            tokio::select! {
                () = shutdown.cancelled() => break End::Shutdown,
                () = sleep_until_some(wake_at) => {
                    let view = cache.borrow().clone();
                    if self.protocol.woken(&mut self.envoy, view.as_deref()).await.is_err() {
                        break End::ResponseDropped;
                    }
                }
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
        log_end(end, &self.envoy.node.id, id, peer, &self.envoy.acked());
    }

    /// Handles one request: the node if it is the first, the subscription, the ACK or NACK of
    /// an earlier response, and an answer if the Envoy now lacks something.
    pub async fn on_request(
        &mut self,
        request: P::Request,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        let envoy = &mut self.envoy;
        if !envoy.node.is_identified() {
            if let Some(node) = request.node() {
                envoy.node =
                    NodeView::identify(node, envoy.id, envoy.peer, P::NAME, &envoy.connections);
            }
        }
        let Some(ty) = ResourceType::from_type_url(request.type_url()) else {
            debug!(node = %envoy.node, type_url = %request.type_url(),
                "request for a type toolgate does not serve; ignored");
            return Ok(());
        };
        // A request written before Envoy saw our latest response: the subscription it carries
        // may be outdated (the request that answers the latest response carries the current
        // one), but its ACK or NACK is news about the response it names.
        let stale = envoy
            .responses
            .entry(ty)
            .or_default()
            .is_stale(request.response_nonce());
        self.protocol.subscribe(ty, &request, stale);
        self.settle(ty, &request, stale);
        self.protocol
            .answer(&mut self.envoy, ty, &request, stale, view)
            .await
    }

    /// The ACK or NACK `request` carries, if any: takes the responses it answers off the
    /// unanswered list, logs and counts it, and lets the protocol act on it.
    fn settle(&mut self, ty: ResourceType, request: &P::Request, stale: bool) {
        let nonce = request.response_nonce();
        if nonce.is_empty() {
            return;
        }
        let Envoy {
            id,
            connections,
            node,
            responses,
            metrics,
            ..
        } = &mut self.envoy;
        let responses = responses.entry(ty).or_default();
        let answered = responses.settle(nonce);
        let node = &node.id;
        if let Some(error) = request.error_detail() {
            let last = answered.last();
            let version = last.map(|r| r.version.as_str()).unwrap_or("unknown");
            let names: Vec<&str> = last
                .map(|r| r.carried.iter().map(|(name, _)| name.as_str()).collect())
                .unwrap_or_default();
            warn!(node = %node, r#type = ty.short_name(), %version, %nonce, stale,
                kept = responses.acked.as_deref().unwrap_or("-"), resources = ?names,
                error = %error.message, protocol = P::NAME,
                "Envoy rejected an xDS response (NACK)");
            metrics
                .nacks
                .get_or_create(&TypeLabel {
                    r#type: ty.short_name(),
                })
                .inc();
            if let Some(response) = last {
                connections.nacked(*id, ty, &response.version, &error.message);
            }
            self.protocol.rejected(ty, &answered);
        } else if let Some(response) = answered.last() {
            debug!(node = %node, r#type = ty.short_name(), version = %response.version, stale,
                "ACK");
            connections.acked(*id, ty, &response.version);
            responses.acked = Some(response.version.clone());
            self.protocol.accepted(ty, &answered);
        } else {
            debug!(node = %node, r#type = ty.short_name(), %nonce,
                "answer to a response not kept (answered already); ignored");
        }
    }

    /// A new cache view: sends what the Envoy lacks of it.
    pub async fn push(&mut self, view: &CacheSnapshot) -> Result<(), Closed> {
        self.protocol.push(&mut self.envoy, view).await
    }
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

/// Logs how a stream ended and what its Envoy kept (`acked`, per type).
fn log_end(end: End, node: &str, id: u64, peer: Option<SocketAddr>, acked: &str) {
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

/// Sleeps until `deadline`, or forever without one (a `select!` branch that never fires).
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::routing::{Bulkhead, EndpointHealth, RouteEndpoint, RoutingSnapshot, ServiceRoute};
    use crate::xds::cache::SnapshotCache;
    use std::net::IpAddr;

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
                            credential_header: None,
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
            jwks: Default::default(),
            keep_caller_tokens: false,
            credentials: Default::default(),
            control: Default::default(),
        }
    }

    /// A stream under test, its response queue, and the cache that feeds it.
    pub(in crate::xds) struct Harness<P: Protocol> {
        pub stream: Stream<P>,
        rx: mpsc::Receiver<Result<P::Response, Status>>,
        pub cache: SnapshotCache,
        pub metrics: Arc<Metrics>,
    }

    impl<P: Protocol + Default> Harness<P> {
        pub fn new() -> Harness<P> {
            let metrics = Arc::new(Metrics::new());
            let (tx, rx) = mpsc::channel(64);
            let envoy = Envoy::new(
                1,
                Arc::default(),
                None,
                None,
                Arc::clone(&metrics),
                tx,
                CancellationToken::new(),
            );
            Harness {
                stream: Stream {
                    envoy,
                    protocol: P::default(),
                },
                rx,
                cache: SnapshotCache::new(),
                metrics,
            }
        }
    }

    impl<P: Protocol> Harness<P> {
        pub fn view(&self) -> Option<Arc<CacheSnapshot>> {
            self.cache.current()
        }

        /// Applies a routing snapshot and pushes the new view, as the stream task does.
        pub async fn publish(&mut self, snapshot: RoutingSnapshot) {
            self.cache.update(&snapshot);
            let view = self.view().expect("a view after an update");
            assert!(self.stream.push(&view).await.is_ok());
        }

        pub async fn request(&mut self, request: P::Request) {
            let view = self.view();
            assert!(self
                .stream
                .on_request(request, view.as_deref())
                .await
                .is_ok());
        }

        /// The responses sent since the last call.
        pub fn sent(&mut self) -> Vec<P::Response> {
            let mut out = Vec::new();
            while let Ok(r) = self.rx.try_recv() {
                out.push(r.expect("no error responses"));
            }
            out
        }

        pub fn nacks(&self, ty: ResourceType) -> u64 {
            self.metrics
                .nacks
                .get_or_create(&TypeLabel {
                    r#type: ty.short_name(),
                })
                .get()
        }
    }

    #[test]
    fn an_answer_settles_the_response_it_names_and_every_older_one() {
        let mut responses = Responses::<()>::default();
        for nonce in 1..=3 {
            responses.unanswered.push_back(Unanswered {
                nonce,
                version: format!("v{nonce}"),
                carried: Vec::new(),
            });
        }
        responses.last = Some((3, "v3".to_string()));
        assert!(responses.is_stale("2"));
        assert!(!responses.is_stale("3"));
        assert!(!responses.is_stale(""));
        let answered: Vec<u64> = responses.settle("2").iter().map(|u| u.nonce).collect();
        assert_eq!(answered, [1, 2]);
        assert!(responses.settle("2").is_empty(), "answered already");
        assert!(responses.settle("x").is_empty());
        assert_eq!(responses.unanswered.len(), 1);
    }
}
