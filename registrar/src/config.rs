//! The builder: what to register and where.

use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, PutOptions};
use toolgate_etcd_access::EtcdAccess;
use toolgate_model::{validate_name, Endpoint, InstanceMetadata, KeyLayout};
use tracing::warn;

use crate::error::RegisterError;
use toolgate_model::Backoff;

/// HTTP/2 pings find a silent partition even when nothing flows. etcd answers pings more
/// frequent than its `--grpc-keepalive-min-time` (5 s by default) with GOAWAY, which would
/// break the stream every few seconds, so stay well above it.
const ETCD_PING_INTERVAL: Duration = Duration::from_secs(10);

/// etcd raises any smaller TTL to its minimum: 1.5 election timeouts, 2 s with the default
/// 1 s election timeout. Asking for less would silently give a longer-lived lease.
pub const MIN_TTL_SECS: i64 = 2;

/// How long one etcd call may take before it counts as failed.
pub(crate) const RPC_TIMEOUT: Duration = Duration::from_secs(2);

/// A lease granted for the key: its id and the TTL etcd gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub id: i64,
    pub ttl: i64,
}

#[derive(Debug, Clone)]
pub struct Registrar {
    pub(crate) etcd: Vec<String>,
    pub(crate) layout: KeyLayout,
    pub(crate) service: String,
    pub(crate) metadata: InstanceMetadata,
    pub(crate) ttl: i64,
    pub(crate) startup_timeout: Duration,
    pub(crate) access: EtcdAccess,
}

impl Registrar {
    /// An instance of `service` at `endpoint`; the instance id defaults to `<hostname>-<port>`,
    /// stable across restarts so a restarted instance replaces its own key.
    pub fn new<S: AsRef<str>>(
        etcd: impl IntoIterator<Item = S>,
        service: impl Into<String>,
        endpoint: Endpoint,
    ) -> Self {
        let instance_id = default_instance_id(&endpoint);
        Registrar {
            etcd: etcd.into_iter().map(|s| s.as_ref().to_string()).collect(),
            layout: KeyLayout::default(),
            service: service.into(),
            metadata: InstanceMetadata::new(instance_id, endpoint),
            ttl: 10,
            startup_timeout: Duration::from_secs(5),
            access: EtcdAccess::none(),
        }
    }

    /// TLS and credentials for a secured etcd.
    pub fn etcd_access(mut self, access: EtcdAccess) -> Self {
        self.access = access;
        self
    }

    pub fn prefix(mut self, prefix: &str) -> Self {
        self.layout = KeyLayout::new(prefix);
        self
    }
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.metadata.instance_id = id.into();
        self
    }
    pub fn tools<T: Into<String>>(mut self, tools: impl IntoIterator<Item = T>) -> Self {
        self.metadata.tools = tools.into_iter().map(Into::into).collect();
        self
    }
    pub fn ttl_secs(mut self, ttl: i64) -> Self {
        self.ttl = ttl;
        self
    }
    /// How long `register` keeps trying to reach etcd before giving up.
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }
    /// Everything else in the metadata (weight, paths, version, zone, labels).
    pub fn metadata(mut self, edit: impl FnOnce(&mut InstanceMetadata)) -> Self {
        edit(&mut self.metadata);
        self
    }

    pub fn key(&self) -> String {
        self.layout
            .instance_key(&self.service, &self.metadata.instance_id)
    }

    /// Checks the input without touching etcd.
    pub fn validate(&self) -> Result<(), RegisterError> {
        validate_name("service", &self.service)?;
        self.metadata.validate()?;
        if self.ttl < MIN_TTL_SECS {
            return Err(RegisterError::Invalid(format!(
                "TTL {} s is below etcd's minimum lease TTL of {MIN_TTL_SECS} s",
                self.ttl
            )));
        }
        if self.etcd.is_empty() {
            return Err(RegisterError::Invalid("no etcd endpoints given".into()));
        }
        self.access
            .check_endpoints(&self.etcd)
            .map_err(|e| RegisterError::Invalid(e.to_string()))?;
        Ok(())
    }

    async fn connect(&self) -> Result<Client, RegisterError> {
        let opts = self.access.apply(
            ConnectOptions::new()
                .with_connect_timeout(RPC_TIMEOUT)
                .with_timeout(RPC_TIMEOUT)
                .with_keep_alive(ETCD_PING_INTERVAL, Duration::from_secs(3))
                .with_keep_alive_while_idle(true),
        );
        // Without a user the channel connects lazily and this only fails on malformed URLs;
        // with one it authenticates at once, so etcd must answer (the caller retries).
        Client::connect(&self.etcd, Some(opts))
            .await
            .map_err(|e| match refusal(&e) {
                Some(detail) => RegisterError::Refused {
                    what: format!(
                        "the login of etcd user {}",
                        self.access.user().unwrap_or("-")
                    ),
                    detail,
                },
                None if self.access.user().is_some() => RegisterError::Etcd(e),
                None => {
                    RegisterError::Invalid(format!("etcd endpoints {:?}: {e}", self.etcd.join(",")))
                }
            })
    }

    /// The first registration retries with backoff, but only for `startup_timeout`: a
    /// registrar pointed at the wrong address must say so rather than hang. A refusal by
    /// etcd (wrong password, no permission on the key) is final and said at once.
    pub(crate) async fn connect_and_register(&self) -> Result<(Client, Lease), RegisterError> {
        let started = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut warned = false;
        let mut client = None;
        loop {
            let attempt = async {
                let c = match &client {
                    Some(c) => Client::clone(c),
                    None => self.connect().await?,
                };
                client = Some(c.clone());
                self.grant_and_put(c, &self.metadata).await
            };
            match tokio::time::timeout(RPC_TIMEOUT, attempt).await {
                Ok(Ok(lease)) => {
                    let Some(client) = client else {
                        return Err(RegisterError::Invalid("no etcd client".into()));
                    };
                    return Ok((client, lease));
                }
                Ok(Err(e @ RegisterError::TtlBelowServerMinimum { .. })) => return Err(e),
                Ok(Err(e @ (RegisterError::Refused { .. } | RegisterError::Invalid(_)))) => {
                    return Err(e)
                }
                Ok(Err(e)) => {
                    if started.elapsed() >= self.startup_timeout {
                        return Err(self.unreachable(started, e.to_string()));
                    }
                    if !warned {
                        warn!(error = %e, "etcd not reachable yet; retrying until the startup timeout");
                        warned = true;
                    }
                }
                Err(_) => {
                    if started.elapsed() >= self.startup_timeout {
                        return Err(self.unreachable(started, "request timed out".into()));
                    }
                }
            }
            tokio::time::sleep(backoff.next_delay(rand::random())).await;
        }
    }

    fn unreachable(&self, started: Instant, last_error: String) -> RegisterError {
        RegisterError::Unreachable {
            endpoints: self.etcd.join(","),
            waited_ms: started.elapsed().as_millis(),
            last_error,
        }
    }

    /// Grants a lease and binds the key, holding `metadata`, to it. Used at start and again
    /// whenever the lease is lost (with the metadata as it is then: the tools may have changed).
    pub(crate) async fn grant_and_put(
        &self,
        mut client: Client,
        metadata: &InstanceMetadata,
    ) -> Result<Lease, RegisterError> {
        let grant = client.lease_grant(self.ttl, None).await?;
        let lease = Lease {
            id: grant.id(),
            ttl: grant.ttl(),
        };
        if lease.ttl > self.ttl {
            let _ = client.lease_revoke(lease.id).await;
            return Err(RegisterError::TtlBelowServerMinimum {
                requested: self.ttl,
                granted: lease.ttl,
            });
        }
        let put = client
            .put(
                self.key(),
                metadata.to_json(),
                Some(PutOptions::new().with_lease(lease.id)),
            )
            .await;
        if let Err(e) = put {
            // Don't leave an orphan lease behind a failed put.
            let _ = client.lease_revoke(lease.id).await;
            return Err(match refusal(&e) {
                Some(detail) => RegisterError::Refused {
                    what: format!(
                        "writing {}{}",
                        self.key(),
                        self.access
                            .user()
                            .map(|u| format!(" as etcd user {u}"))
                            .unwrap_or_default()
                    ),
                    detail,
                },
                None => e.into(),
            });
        }
        Ok(lease)
    }
}

/// etcd's answer when it will not let this client do something: no retry can change it.
fn refusal(e: &etcd_client::Error) -> Option<String> {
    match e {
        etcd_client::Error::GRpcStatus(s)
            if matches!(
                s.code(),
                tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
            ) || s.message().contains("authentication failed") =>
        {
            Some(s.message().to_string())
        }
        _ => None,
    }
}

fn default_instance_id(endpoint: &Endpoint) -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "instance".to_string());
    let id: String = format!("{host}-{}", endpoint.port)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    id.chars().take(toolgate_model::MAX_NAME_LEN).collect()
}
