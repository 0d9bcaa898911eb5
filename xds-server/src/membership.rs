//! This toolgate-xds as a member of the fleet: `<prefix>xds/<id>` holds where Envoys reach its
//! admin listener, bound to a lease (TTL [`TTL_SECS`]) kept alive over one stream, registered
//! again with a new lease when etcd expired the old one (an outage longer than the TTL), and
//! revoked at a graceful stop, so the other toolgate-xds drop it from their Envoys' control
//! cluster at once; after a crash they drop it when the lease expires (Envoy's health checks
//! skip it long before). As `toolgate-register` keeps an instance's lease.

use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use toolgate_model::Backoff;
use tracing::{info, warn};

use crate::etcd::EtcdConfig;

/// The member key's lease: how long a toolgate-xds that vanished without revoking stays
/// listed.
pub const TTL_SECS: i64 = 10;

/// The registration while it runs; [`leave`](Self::leave) revokes it.
pub struct Membership {
    key: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Membership {
    /// Registers `value` at `key` from now on, retrying while etcd is away (serving does not
    /// wait for it).
    pub fn spawn(config: EtcdConfig, key: String, value: String) -> Membership {
        Membership::spawn_changing(config, key, watch::channel(value).1)
    }

    /// As [`spawn`](Self::spawn), with a value that changes: each change is put under the
    /// same lease (the value names how many Envoys this toolgate-xds serves).
    pub fn spawn_changing(
        config: EtcdConfig,
        key: String,
        value: watch::Receiver<String>,
    ) -> Membership {
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(keep(config, key.clone(), value, stopped));
        Membership {
            key,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Revokes the lease (the key goes at once) and ends the keepalives; waits for the revoke
    /// at most the etcd request timeout.
    pub async fn leave(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Why a keepalive stream ended.
enum End {
    Broken(String),
    LeaseLost,
}

async fn keep(
    config: EtcdConfig,
    key: String,
    mut value: watch::Receiver<String>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut client: Option<Client> = None;
    let mut lease: Option<i64> = None;
    // Logged once per outage, not once per retry.
    let mut failing = false;
    loop {
        let c = match &client {
            Some(c) => c.clone(),
            None => {
                let connected = tokio::select! {
                    _ = &mut stop => break,
                    c = config.connect() => c,
                };
                match connected {
                    Ok(c) => {
                        client = Some(c.clone());
                        c
                    }
                    Err(e) => {
                        if !failing {
                            warn!(key = %key, error = %e,
                                "cannot reach etcd to register this toolgate-xds; retrying");
                            failing = true;
                        }
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = tokio::time::sleep(backoff.next_delay(rand::random())) => {}
                        }
                        continue;
                    }
                }
            }
        };
        let id = match lease {
            Some(id) => id,
            None => {
                let current = value.borrow_and_update().clone();
                let granted = tokio::select! {
                    _ = &mut stop => break,
                    g = grant_and_put(&c, &key, &current, config.request_timeout) => g,
                };
                match granted {
                    Ok(id) => {
                        info!(key = %key, lease = format_args!("{id:x}"), ttl_s = TTL_SECS,
                            "registered this toolgate-xds in the fleet");
                        lease = Some(id);
                        failing = false;
                        id
                    }
                    Err(e) => {
                        if !failing {
                            warn!(key = %key, error = %e,
                                "registering this toolgate-xds failed; retrying");
                            failing = true;
                        }
                        // A fresh connection next time, as the watcher does.
                        client = None;
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = tokio::time::sleep(backoff.next_delay(rand::random())) => {}
                        }
                        continue;
                    }
                }
            }
        };
        let end = tokio::select! {
            _ = &mut stop => break,
            end = keep_alive(&c, id, config.request_timeout, &key, &mut value) => end,
        };
        match end {
            End::LeaseLost => {
                warn!(key = %key, lease = format_args!("{id:x}"),
                    "the lease expired while etcd was out of reach; registering again");
                lease = None;
                backoff.reset();
            }
            End::Broken(reason) => {
                if !failing {
                    warn!(key = %key, lease = format_args!("{id:x}"), %reason,
                        "keepalive stream broken; reconnecting");
                    failing = true;
                }
                client = None;
                tokio::select! {
                    _ = &mut stop => break,
                    _ = tokio::time::sleep(backoff.next_delay(rand::random())) => {}
                }
            }
        }
    }
    if let Some(id) = lease {
        revoke(&config, client, &key, id).await;
    }
}

/// Grants a lease and puts the key under it; returns the lease.
async fn grant_and_put(
    client: &Client,
    key: &str,
    value: &str,
    timeout: Duration,
) -> Result<i64, String> {
    let mut leases = client.lease_client();
    let grant = leases.grant(TTL_SECS, None);
    let id = tokio::time::timeout(timeout, grant)
        .await
        .map_err(|_| "granting a lease timed out".to_string())?
        .map_err(|e| format!("granting a lease: {e}"))?
        .id();
    let mut kv = client.kv_client();
    let put = kv.put(
        key.to_string(),
        value.to_string(),
        Some(PutOptions::new().with_lease(id)),
    );
    tokio::time::timeout(timeout, put)
        .await
        .map_err(|_| format!("putting {key} timed out"))?
        .map_err(|e| format!("putting {key}: {e}"))?;
    Ok(id)
}

/// Keeps lease `id` alive over one stream, every TTL/3 as etcd's own clients do, until the
/// stream breaks or etcd says the lease is gone; puts each new `value` under it meanwhile.
async fn keep_alive(
    client: &Client,
    id: i64,
    timeout: Duration,
    key: &str,
    value: &mut watch::Receiver<String>,
) -> End {
    // A value that can no longer change is simply kept.
    let mut changing = true;
    let mut leases = client.lease_client();
    let opened = tokio::time::timeout(timeout, leases.keep_alive(id)).await;
    let (mut keeper, mut stream) = match opened {
        Ok(Ok(pair)) => pair,
        Ok(Err(etcd_client::Error::LeaseKeepAliveError(msg))) if msg.contains("not found") => {
            return End::LeaseLost
        }
        Ok(Err(e)) => return End::Broken(e.to_string()),
        Err(_) => return End::Broken("opening the keepalive stream timed out".into()),
    };
    let every = Duration::from_millis(TTL_SECS as u64 * 1000 / 3);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = keeper.keep_alive().await {
                    return End::Broken(e.to_string());
                }
            }
            changed = value.changed(), if changing => {
                if changed.is_err() {
                    changing = false;
                    continue;
                }
                let current = value.borrow_and_update().clone();
                let mut kv = client.kv_client();
                let put = kv.put(key.to_string(), current, Some(PutOptions::new().with_lease(id)));
                let failed = match tokio::time::timeout(timeout, put).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => format!("putting {key}: {e}"),
                    Err(_) => format!("putting {key} timed out"),
                };
                // Put again once the stream is back.
                value.mark_changed();
                return End::Broken(failed);
            }
            msg = stream.message() => match msg {
                Ok(Some(resp)) if resp.ttl() <= 0 => return End::LeaseLost,
                Ok(Some(_)) => {}
                Ok(None) => return End::Broken("etcd closed the keepalive stream".into()),
                Err(e) => return End::Broken(e.to_string()),
            }
        }
    }
}

/// Revokes the lease, which deletes the key at once; on failure the key expires with its TTL.
async fn revoke(config: &EtcdConfig, client: Option<Client>, key: &str, id: i64) {
    let revoked = tokio::time::timeout(config.request_timeout, async {
        let client = match client {
            Some(c) => c,
            None => config.connect().await?,
        };
        let mut leases = client.lease_client();
        leases.revoke(id).await.map(|_| ())
    })
    .await;
    match revoked {
        Ok(Ok(())) => info!(key = %key, lease = format_args!("{id:x}"),
            "lease revoked; this toolgate-xds left the fleet"),
        Ok(Err(e)) => {
            warn!(key = %key, error = %e, "revoking the lease failed; the key expires with its TTL")
        }
        Err(_) => warn!(key = %key, "revoking the lease timed out; the key expires with its TTL"),
    }
}
