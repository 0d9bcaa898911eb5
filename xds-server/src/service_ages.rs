//! Records each service's age for naming in etcd (`<prefix>service-ages/<service>`, see
//! `registry/ages.rs`), once: whichever toolgate-xds of the fleet first sees a service writes
//! the smallest create revision among its instance keys, in a transaction that writes only
//! if the key is absent. Every toolgate-xds reads the ages back through its watch and names
//! by them, so a contested tool name stays with its service across re-registrations, restarts
//! and resyncs.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use toolgate_model::Backoff;
use tracing::{debug, info, warn};

use crate::etcd::LazyClient;
use crate::registry::ages::ServiceAge;
use crate::registry::Registry;

/// Runs until the process ends.
pub async fn run(client: LazyClient, registry: Arc<RwLock<Registry>>, timeout: Duration) {
    let wanted = registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .ages_wanted();
    // Services written (or found written by another) whose age the watch has not brought
    // yet: not written again meanwhile.
    let mut sent: HashSet<String> = HashSet::new();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let notified = wanted.notified();
        let (missing, layout) = {
            let reg = registry.read().unwrap_or_else(|p| p.into_inner());
            (reg.unrecorded_ages(), reg.layout().clone())
        };
        sent.retain(|s| missing.iter().any(|(m, _)| m == s));
        let due: Vec<(String, i64)> = missing
            .into_iter()
            .filter(|(s, _)| !sent.contains(s))
            .collect();
        if due.is_empty() {
            notified.await;
            continue;
        }
        match record(&client, &layout, &due, timeout).await {
            Ok(()) => {
                backoff.reset();
                sent.extend(due.into_iter().map(|(s, _)| s));
            }
            Err(e) => {
                warn!(error = %e, services = due.len(),
                    "cannot record service ages in etcd yet; retrying");
                tokio::time::sleep(backoff.next_delay(rand::random())).await;
            }
        }
    }
}

/// Writes each age unless the key exists.
async fn record(
    client: &LazyClient,
    layout: &toolgate_model::KeyLayout,
    due: &[(String, i64)],
    timeout: Duration,
) -> Result<(), String> {
    let mut client = client.get().await.map_err(|e| e.to_string())?;
    for (service, revision) in due {
        let key = layout.service_age_key(service);
        let value = ServiceAge {
            revision: *revision,
        }
        .to_json();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value, None)]);
        match tokio::time::timeout(timeout, client.txn(txn)).await {
            Ok(Ok(resp)) if resp.succeeded() => {
                info!(key, revision, "recorded a service's age for naming");
            }
            Ok(Ok(_)) => debug!(key, "a service's age was recorded already"),
            Ok(Err(e)) => return Err(format!("{key}: {e}")),
            Err(_) => return Err(format!("{key}: etcd did not answer in time")),
        }
    }
    Ok(())
}
