//! The background task that keeps a registration alive: one keepalive stream, reopened when it
//! breaks, and a fresh lease (and put) when etcd says the old lease is gone.

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::{Registrar, RPC_TIMEOUT};
use crate::error::RegisterError;
use toolgate_model::Backoff;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub id: i64,
    pub ttl: i64,
}

/// What the registration is doing, for callers that want to observe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationEvent {
    /// Registered, or keepalives answered again, with this lease.
    Alive { lease: i64 },
    /// The keepalive stream broke; reconnecting.
    Reconnecting { lease: i64 },
    /// The lease expired while etcd was out of reach; registering again.
    LeaseLost { lease: i64 },
}

/// A live registration. Call [`Registration::deregister`] on shutdown; dropping it only stops the
/// keepalives, and the key then lives until its lease expires.
pub struct Registration {
    key: String,
    events: watch::Receiver<RegistrationEvent>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), RegisterError>>>,
}

enum StreamEnd {
    Broken(String),
    LeaseLost,
}

impl Registration {
    pub(crate) fn spawn(registrar: Registrar, client: Client, lease: Lease) -> Self {
        let key = registrar.key();
        let (events_tx, events) = watch::channel(RegistrationEvent::Alive { lease: lease.id });
        let (stop, stop_rx) = oneshot::channel();
        let task = tokio::spawn(keep_registered(
            registrar, client, lease, events_tx, stop_rx,
        ));
        Registration {
            key,
            events,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease the key is bound to now (it changes after a lease loss).
    pub fn lease_id(&self) -> i64 {
        match *self.events.borrow() {
            RegistrationEvent::Alive { lease }
            | RegistrationEvent::Reconnecting { lease }
            | RegistrationEvent::LeaseLost { lease } => lease,
        }
    }

    pub fn events(&self) -> watch::Receiver<RegistrationEvent> {
        self.events.clone()
    }

    /// Revokes the lease, which deletes the key at once, and stops the keepalives.
    pub async fn deregister(mut self) -> Result<(), RegisterError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|e| RegisterError::Invalid(format!("registration task failed: {e}")))?,
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn keep_registered(
    registrar: Registrar,
    client: Client,
    mut lease: Lease,
    events: watch::Sender<RegistrationEvent>,
    mut stop: oneshot::Receiver<()>,
) -> Result<(), RegisterError> {
    let key = registrar.key();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut broken_since: Option<tokio::time::Instant> = None;
    loop {
        let opened = tokio::select! {
            _ = &mut stop => break,
            opened = open_stream(&client, lease) => opened,
        };
        let end = match opened {
            Ok((keeper, stream)) => {
                if let Some(since) = broken_since.take() {
                    info!(key = %key, lease = format_args!("{:x}", lease.id),
                        after_ms = since.elapsed().as_millis() as u64,
                        "keepalive stream restored; lease still alive");
                    events.send_replace(RegistrationEvent::Alive { lease: lease.id });
                }
                backoff.reset();
                tokio::select! {
                    _ = &mut stop => break,
                    end = run_stream((keeper, stream), lease) => end,
                }
            }
            Err(end) => end,
        };
        match end {
            StreamEnd::Broken(reason) => {
                // Log the break once, not once per reconnect attempt.
                if broken_since.is_none() {
                    warn!(key = %key, lease = format_args!("{:x}", lease.id), reason = %reason,
                        "keepalive stream broken; reconnecting");
                    broken_since = Some(tokio::time::Instant::now());
                    events.send_replace(RegistrationEvent::Reconnecting { lease: lease.id });
                }
                tokio::select! {
                    _ = &mut stop => break,
                    _ = tokio::time::sleep(backoff.next_delay(rand::random())) => {}
                }
            }
            StreamEnd::LeaseLost => {
                events.send_replace(RegistrationEvent::LeaseLost { lease: lease.id });
                let old = lease.id;
                tokio::select! {
                    _ = &mut stop => break,
                    new = reregister(&registrar, &client) => lease = new,
                }
                warn!(key = %key, old_lease = format_args!("{old:x}"), lease = format_args!("{:x}", lease.id),
                    "lease expired while etcd was out of reach; registered again with a new lease");
                broken_since = None;
                backoff.reset();
                events.send_replace(RegistrationEvent::Alive { lease: lease.id });
            }
        }
    }
    revoke(&client, &key, lease).await;
    Ok(())
}

type KeepAlivePair = (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

/// Opens a keepalive stream; its first request already refreshes the lease.
async fn open_stream(client: &Client, lease: Lease) -> Result<KeepAlivePair, StreamEnd> {
    let mut lease_client = client.lease_client();
    match tokio::time::timeout(RPC_TIMEOUT, lease_client.keep_alive(lease.id)).await {
        Ok(Ok(pair)) => Ok(pair),
        Ok(Err(etcd_client::Error::LeaseKeepAliveError(msg))) if msg.contains("not found") => {
            Err(StreamEnd::LeaseLost)
        }
        Ok(Err(e)) => Err(StreamEnd::Broken(e.to_string())),
        Err(_) => Err(StreamEnd::Broken(
            "opening the keepalive stream timed out".into(),
        )),
    }
}

/// Sends a keepalive every TTL/3, as etcd's own clients do, until the stream breaks or the
/// lease is gone.
async fn run_stream((mut keeper, mut stream): KeepAlivePair, lease: Lease) -> StreamEnd {
    let every = Duration::from_millis((lease.ttl.max(1) as u64) * 1000 / 3);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = keeper.keep_alive().await {
                    return StreamEnd::Broken(e.to_string());
                }
            }
            msg = stream.message() => match msg {
                Ok(Some(resp)) if resp.ttl() <= 0 => return StreamEnd::LeaseLost,
                Ok(Some(_)) => {}
                Ok(None) => return StreamEnd::Broken("etcd closed the keepalive stream".into()),
                Err(e) => return StreamEnd::Broken(e.to_string()),
            }
        }
    }
}

/// Grants a new lease and puts the key again, retrying until it works.
async fn reregister(registrar: &Registrar, client: &Client) -> Lease {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        match tokio::time::timeout(RPC_TIMEOUT, registrar.grant_and_put(client.clone())).await {
            Ok(Ok(lease)) => return lease,
            Ok(Err(e)) => warn!(error = %e, "registering again failed; retrying"),
            Err(_) => warn!("registering again timed out; retrying"),
        }
        tokio::time::sleep(backoff.next_delay(rand::random())).await;
    }
}

async fn revoke(client: &Client, key: &str, lease: Lease) {
    let mut lease_client = client.lease_client();
    match tokio::time::timeout(RPC_TIMEOUT, lease_client.revoke(lease.id)).await {
        Ok(Ok(_)) => {
            info!(key = %key, lease = format_args!("{:x}", lease.id), "lease revoked; deregistered")
        }
        Ok(Err(e)) => {
            warn!(key = %key, error = %e, "revoking the lease failed; the key expires with its TTL")
        }
        Err(_) => warn!(key = %key, "revoking the lease timed out; the key expires with its TTL"),
    }
}
