//! The ADS server: the protocol half of go-control-plane's cache/server split. It decides
//! *when* to send *which version* to one Envoy; what a version contains comes from `cache.rs`.
//!
//! One task folds every routing snapshot into a shared
//! [`CacheSnapshot`](super::cache::CacheSnapshot) (so N Envoys cost one
//! encoding, and all see the same versions); one task per ADS stream speaks the protocol
//! (`stream.rs`), state of the world (`ads.rs`) or incremental (`delta.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    aggregated_discovery_service_server::AggregatedDiscoveryService, DeltaDiscoveryRequest,
    DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use super::ads::Sotw;
use super::cache::SnapshotCache;
use super::connections::Connections;
use super::delta::Delta;
use super::resources::ResourceOptions;
use super::stream::{CacheView, Envoy, Protocol, Stream, RESPONSE_QUEUE};
use crate::metrics::Metrics;
use crate::routing::RoutingSnapshot;

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`, state of the world and incremental.
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

    /// Starts the task that serves one stream in protocol `P`, and gives its responses.
    fn open<P: Protocol + Default>(
        &self,
        request: Request<Streaming<P::Request>>,
    ) -> Response<ReceiverStream<Result<P::Response, Status>>> {
        let peer = request.remote_addr();
        let requests = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let envoy = Envoy::new(
            id,
            Arc::clone(&self.connections),
            peer,
            self.report_token.clone(),
            Arc::clone(&self.metrics),
            tx,
            self.shutdown.clone(),
        );
        let stream = Stream {
            envoy,
            protocol: P::default(),
        };
        tokio::spawn(stream.run(requests, self.cache.clone()));
        Response::new(ReceiverStream::new(rx))
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
        Ok(self.open::<Sotw>(request))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Ok(self.open::<Delta>(request))
    }
}
