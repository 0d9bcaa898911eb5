//! Serves the routing snapshot to Envoys over ADS (CDS, EDS, RDS; ECDS later).
//!
//! Split as in go-control-plane: `resources` builds Envoy resources from a snapshot (what),
//! `cache` versions them per type (which version), `service` serves ADS, one `stream` per
//! Envoy, which speaks state of the world (`ads`) or incremental (`delta`) xDS (when). Only
//! those and this file know tonic.

mod ads;
pub mod any;
pub mod auth;
pub mod cache;
pub mod connections;
mod delta;
pub mod ecds;
mod node;
pub mod resources;
mod route_table;
mod service;
pub mod shard;
mod stream;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tracing::info;

use crate::metrics::Metrics;
use crate::routing::RoutingSnapshot;

pub use connections::Connections;
pub use resources::ResourceOptions;
pub use service::AdsService;

/// HTTP/2 PING interval on each connection: finds an Envoy that vanished without closing its
/// TCP connection (host crash, network partition), so its stream task and the
/// `connected_envoys` gauge do not linger. Envoy's bootstrap pings us on the same cadence.
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a PING may stay unanswered before the connection is closed.
const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive, a second line for idle half-open connections.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// How [`serve`] serves, beyond where and what: settings from `toolgate-xds serve`'s flags.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// mTLS for the ADS listener; plain gRPC when `None`.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// The token each Envoy's filter must send with its reports, put into its configuration.
    pub report_token: Option<Arc<str>>,
    /// How the resources are built.
    pub resources: ResourceOptions,
}

/// Serves ADS on `listener` until `shutdown` completes, fed by `snapshots`.
///
/// Each new snapshot is pushed at once to every connected Envoy (no debounce here: bursts are
/// coalesced by the registry and the `watch` channel). On shutdown the listener closes, every
/// ADS stream ends (an ADS stream never ends by itself, so tonic's connection drain would wait
/// forever otherwise), and the function returns once connections are drained.
pub async fn serve(
    listener: TcpListener,
    snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    metrics: Arc<Metrics>,
    connections: Arc<Connections>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ServeOptions {
        tls,
        report_token,
        resources,
    } = options;
    let addr = listener
        .local_addr()
        .context("reading the xDS listener's address")?;
    let token = CancellationToken::new();
    // Also stops the cache task if serving fails.
    let _stop_on_return = token.clone().drop_guard();
    let ads = AdsService::new(snapshots, resources, metrics, token.clone())
        .with_connections(connections)
        .with_report_token(report_token);
    // `serve_with_incoming` ignores the builder's TCP settings: they go on the incoming stream.
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(TCP_KEEPALIVE));
    let signal = {
        let token = token.clone();
        async move {
            shutdown.await;
            token.cancel();
        }
    };
    info!(%addr, mtls = tls.is_some(), "xDS server listening");
    let mut builder = Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .context("the xDS TLS configuration")?;
    }
    builder
        .http2_keepalive_interval(Some(HTTP2_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE_TIMEOUT))
        .add_service(AggregatedDiscoveryServiceServer::new(ads))
        .serve_with_incoming_shutdown(incoming, signal)
        .await
        .with_context(|| format!("serving xDS on {addr}"))?;
    info!(%addr, "xDS server stopped");
    Ok(())
}
