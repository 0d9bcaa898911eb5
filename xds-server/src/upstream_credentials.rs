//! Credentials toward the servers (`<prefix>auth/upstream/<service>`): toolgate-xds reads each
//! referenced secret, keeps the last good value, and hands the header's value on twice: to
//! Envoy as an SDS secret (the service's cluster injects it, see `xds/resources.rs`), and to
//! its own MCP clients of the service's instances (the catalog read, the probes, the sessions
//! held for `/mcp`), which reach the servers without Envoy.
//!
//! A value never leaves this process except toward Envoy and the service's own servers: it
//! is not in etcd (the value there names a file or a variable), not in a log line (errors name
//! the reference), not in the admin API, and `Debug` shows it redacted.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use toolgate_model::upstream_auth::UpstreamCredential;
use tracing::{info, warn};

use crate::registry::publish::Publisher;
use crate::registry::Registry;
use crate::routing::RoutingSnapshot;

/// How often the secrets are read again when nothing else changed (`--secret-refresh`).
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(30);

/// A header value holding a secret: compared and cloned, never shown.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(Arc<str>);

impl SecretValue {
    pub fn new(value: impl Into<Arc<str>>) -> SecretValue {
        SecretValue(value.into())
    }

    /// The value itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

/// What is added to a service's requests: `header: value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injected {
    /// Lower case.
    pub header: String,
    pub value: SecretValue,
}

/// Every service's credential as last read, by service.
pub type InjectedByService = BTreeMap<String, Injected>;

/// The credentials as last read, shared with toolgate-xds's own MCP clients.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    inner: Arc<RwLock<Arc<InjectedByService>>>,
}

impl Credentials {
    /// The header toolgate-xds adds to its own requests to `service`'s instances, if the
    /// service has a credential that was read.
    pub fn header(&self, service: &str) -> Option<(String, String)> {
        let all = self.inner.read().unwrap_or_else(|p| p.into_inner());
        all.get(service)
            .map(|i| (i.header.clone(), i.value.expose().to_string()))
    }

    /// Every credential, for the xDS side.
    pub fn all(&self) -> Arc<InjectedByService> {
        Arc::clone(&self.inner.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Replaces them; whether they changed.
    fn set(&self, next: InjectedByService) -> bool {
        let mut all = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if **all == next {
            return false;
        }
        *all = Arc::new(next);
        true
    }
}

/// One service's reference and what reading it gave.
struct Read {
    credential: UpstreamCredential,
    /// The last good value of this reference.
    value: Option<SecretValue>,
    /// The last failure, while reads fail (logged once per distinct failure).
    failing: Option<String>,
}

/// Reads the configured secrets when the configuration changes and every `refresh`, for as
/// long as the publisher runs.
pub async fn run(
    registry: Arc<RwLock<Registry>>,
    mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    publisher: Publisher,
    credentials: Credentials,
    refresh: Duration,
) {
    let mut reads: BTreeMap<String, Read> = BTreeMap::new();
    let mut every = tokio::time::interval(refresh);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let configured: BTreeMap<String, UpstreamCredential> = {
            let reg = registry.read().unwrap_or_else(|p| p.into_inner());
            // An exchanged credential is each caller's, asked for per call
            // (`token_exchange.rs`): there is nothing to read ahead nor to hand to Envoy.
            reg.auth_upstreams()
                .filter(|(_, c)| c.secret.is_some())
                .map(|(s, c)| (s.clone(), c.clone()))
                .collect()
        };
        let mut due = reconcile(&mut reads, configured);
        if due.is_empty() {
            tokio::select! {
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return; // The publisher is gone: shutting down.
                    }
                    continue;
                }
                _ = every.tick() => due = reads.keys().cloned().collect(),
            }
        }
        for service in due {
            if let Some(read) = reads.get_mut(&service) {
                read.again(&service);
            }
        }
        let next: InjectedByService = reads
            .iter()
            .filter_map(|(service, r)| {
                Some((
                    service.clone(),
                    Injected {
                        header: r.credential.header.clone(),
                        value: r.value.clone()?,
                    },
                ))
            })
            .collect();
        if credentials.set(next.clone()) {
            let changed = registry
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .set_upstream_credentials(Arc::new(next));
            if changed {
                publisher.changed(Instant::now());
            }
        }
    }
}

/// Follows the configuration: a new or changed reference is read at once (returned), a
/// removed one forgotten with its value.
fn reconcile(
    reads: &mut BTreeMap<String, Read>,
    configured: BTreeMap<String, UpstreamCredential>,
) -> Vec<String> {
    reads.retain(|s, _| configured.contains_key(s));
    let mut due = Vec::new();
    for (service, credential) in configured {
        match reads.get_mut(&service) {
            Some(r) if r.credential == credential => {}
            Some(r) => {
                *r = Read {
                    credential,
                    value: None,
                    failing: None,
                };
                due.push(service);
            }
            None => {
                reads.insert(
                    service.clone(),
                    Read {
                        credential,
                        value: None,
                        failing: None,
                    },
                );
                due.push(service);
            }
        }
    }
    due
}

impl Read {
    /// Reads the secret again; a failure keeps the last good value.
    fn again(&mut self, service: &str) {
        // `run` keeps only static credentials; an exchange has no secret of its own to read.
        let Some(secret) = &self.credential.secret else {
            return;
        };
        match secret.read() {
            Ok(text) => {
                let value = SecretValue::new(self.credential.value(&text));
                if self.failing.take().is_some() || self.value.is_none() {
                    info!(%service, %secret, header = %self.credential.header,
                        "upstream credential read");
                } else if self.value.as_ref() != Some(&value) {
                    info!(%service, %secret, "upstream credential changed (rotated)");
                }
                self.value = Some(value);
            }
            Err(e) => {
                if self.failing.as_deref() != Some(e.as_str()) {
                    if self.value.is_some() {
                        warn!(%service, error = %e, "reading the upstream credential failed: the value read before stays in use");
                    } else {
                        warn!(%service, error = %e, "reading the upstream credential failed and it was never read: the service's calls are refused until it is");
                    }
                }
                self.failing = Some(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_never_shows_in_debug() {
        let i = Injected {
            header: "authorization".into(),
            value: SecretValue::new("Bearer s3cret"),
        };
        let shown = format!("{i:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("[redacted]"));
    }

    #[test]
    fn a_read_follows_its_reference_and_keeps_the_last_good_value() {
        let dir = std::env::temp_dir().join(format!("toolgate-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("orders");
        std::fs::write(&file, "s3cret\n").expect("write");
        let credential = |path: &std::path::Path| {
            UpstreamCredential::parse(
                serde_json::json!({"secret": format!("file:{}", path.display())})
                    .to_string()
                    .as_bytes(),
            )
            .expect("valid")
        };
        let mut reads = BTreeMap::new();
        let due = reconcile(
            &mut reads,
            BTreeMap::from([("orders".to_string(), credential(&file))]),
        );
        assert_eq!(due, ["orders"]);
        let r = reads.get_mut("orders").expect("read");
        r.again("orders");
        assert_eq!(
            r.value.as_ref().map(SecretValue::expose),
            Some("Bearer s3cret")
        );
        std::fs::remove_file(&file).expect("remove");
        r.again("orders");
        assert_eq!(
            r.value.as_ref().map(SecretValue::expose),
            Some("Bearer s3cret"),
            "kept"
        );
        assert!(r.failing.is_some());
        // The same reference again: nothing to read now.
        assert!(reconcile(
            &mut reads,
            BTreeMap::from([("orders".to_string(), credential(&file))])
        )
        .is_empty());
        // Another reference: read at once, the old value forgotten.
        let other = dir.join("other");
        let due = reconcile(
            &mut reads,
            BTreeMap::from([("orders".to_string(), credential(&other))]),
        );
        assert_eq!(due, ["orders"]);
        assert!(reads["orders"].value.is_none());
        assert!(reconcile(&mut reads, BTreeMap::new()).is_empty());
        assert!(reads.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
