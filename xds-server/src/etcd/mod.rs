//! The etcd side: one Get of the prefix (in pages), then a Watch from the next revision, resumed after a
//! break and rebuilt after a compaction. Nothing here polls.

pub mod read;
pub mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

/// HTTP/2 pings find a silent partition even when nothing flows. etcd answers pings more
/// frequent than its `--grpc-keepalive-min-time` (5 s by default) with GOAWAY, which would
/// break the stream every few seconds, so stay well above it.
const ETCD_PING_INTERVAL: Duration = Duration::from_secs(10);

/// How toolgate-xds reaches etcd.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    /// How long one request (Get, watch creation) may take before it counts as failed.
    pub request_timeout: Duration,
    /// TLS and credentials for a secured etcd.
    pub access: toolgate_etcd_access::EtcdAccess,
}

impl EtcdConfig {
    /// The channel connects lazily and reconnects by itself; HTTP/2 pings find a silent
    /// partition within a few seconds even when no event flows.
    ///
    /// With an etcd user, connecting also logs in, so it needs etcd up and may be refused:
    /// callers that run from the start use [`LazyClient`] or retry.
    pub async fn connect(&self) -> Result<Client, etcd_client::Error> {
        let opts = self.access.apply(
            ConnectOptions::new()
                .with_connect_timeout(self.request_timeout)
                .with_keep_alive(ETCD_PING_INTERVAL, Duration::from_secs(3))
                .with_keep_alive_while_idle(true)
                .with_require_leader(true),
        );
        match tokio::time::timeout(
            self.request_timeout,
            Client::connect(&self.endpoints, Some(opts)),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(etcd_client::Error::EndpointError(format!(
                "connecting to {:?} timed out after {:?}",
                self.endpoints, self.request_timeout
            ))),
        }
    }

    /// Connects, waiting for etcd (with authentication, connecting logs in, which needs etcd
    /// up) instead of giving up. `None` only when the endpoints themselves are unusable, which
    /// is logged as disabling `what`.
    pub async fn connect_patiently(&self, what: &str) -> Option<Client> {
        loop {
            match self.connect().await {
                Ok(c) => return Some(c),
                Err(e) if Self::is_malformed(&e) => {
                    tracing::error!(error = %e, "{what} disabled: cannot use the etcd endpoints");
                    return None;
                }
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    }

    /// Whether `e` means the endpoints themselves are unusable (retrying cannot help).
    pub fn is_malformed(e: &etcd_client::Error) -> bool {
        matches!(
            e,
            etcd_client::Error::InvalidUri(_) | etcd_client::Error::InvalidArgs(_)
        )
    }
}

/// A client made on first use and kept: with etcd authentication, making one means logging
/// in, which must not stop toolgate-xds from starting (and serving its state dir) while etcd
/// is away.
#[derive(Clone)]
pub struct LazyClient {
    config: EtcdConfig,
    cell: std::sync::Arc<tokio::sync::OnceCell<Client>>,
}

impl LazyClient {
    pub fn new(config: EtcdConfig) -> LazyClient {
        LazyClient {
            config,
            cell: Default::default(),
        }
    }

    pub async fn get(&self) -> Result<Client, etcd_client::Error> {
        self.cell
            .get_or_try_init(|| self.config.connect())
            .await
            .cloned()
    }
}

/// A Get's key-values as [`crate::registry::Registry::reset`] takes them; keys that are not
/// UTF-8 cannot be registry keys and are left out.
pub fn kv_tuples(kvs: &[etcd_client::KeyValue]) -> Vec<crate::registry::KvEntry<'_>> {
    kvs.iter()
        .filter_map(|kv| {
            Some((
                kv.key_str().ok()?,
                kv.value(),
                kv.lease(),
                kv.create_revision(),
                kv.mod_revision(),
            ))
        })
        .collect()
}

/// Whether etcd is reachable now, for the admin API (the metric mirrors it).
#[derive(Debug, Default)]
pub struct EtcdStatus {
    up: AtomicBool,
}

impl EtcdStatus {
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }
    /// Returns whether the state changed.
    pub(crate) fn set(&self, up: bool) -> bool {
        self.up.swap(up, Ordering::Relaxed) != up
    }
}
