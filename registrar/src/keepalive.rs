//! The background task that keeps a registration alive: one keepalive stream, reopened when it
//! breaks, and a fresh lease (and put) when etcd says the old lease is gone.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::{Lease, Registrar, RPC_TIMEOUT};
use crate::error::RegisterError;
use toolgate_model::{Backoff, InstanceMetadata};

/// The metadata as it is now, shared by the keepalive task (which puts it again after a lost
/// lease) and whoever updates the tool list, so a re-registration never restores an old list.
type SharedMetadata = Arc<Mutex<InstanceMetadata>>;

fn snapshot(shared: &SharedMetadata) -> InstanceMetadata {
    // A panic while holding the lock cannot leave the metadata half-written (it is replaced
    // whole), so a poisoned lock still holds a usable value.
    match shared.lock() {
        Ok(m) => m.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
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

// `register` starts this module's task, so it is defined here: the builder (`config.rs`)
// then needs nothing of the keepalive side.
impl Registrar {
    /// Validates, registers, and keeps the registration alive in a background task until
    /// [`Registration::deregister`] is called or the registration is dropped.
    pub async fn register(self) -> Result<Registration, RegisterError> {
        self.validate()?;
        let (client, lease) = self.connect_and_register().await?;
        let key = self.key();
        info!(key = %key, lease = format_args!("{:x}", lease.id), ttl = lease.ttl, "registered");
        Ok(Registration::spawn(self, client, lease))
    }
}

/// A live registration. Call [`Registration::deregister`] on shutdown; dropping it only stops the
/// keepalives, and the key then lives until its lease expires.
pub struct Registration {
    key: String,
    updater: ToolsUpdater,
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
        let metadata: SharedMetadata = Arc::new(Mutex::new(registrar.metadata.clone()));
        let updater = ToolsUpdater {
            key: key.clone(),
            client: client.clone(),
            metadata: metadata.clone(),
            events: events.clone(),
            put_lock: Arc::new(tokio::sync::Mutex::new(())),
        };
        let task = tokio::spawn(keep_registered(
            registrar, client, lease, metadata, events_tx, stop_rx,
        ));
        Registration {
            key,
            updater,
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
        lease_of(&self.events.borrow())
    }

    pub fn events(&self) -> watch::Receiver<RegistrationEvent> {
        self.events.clone()
    }

    /// The metadata as registered now.
    pub fn metadata(&self) -> InstanceMetadata {
        snapshot(&self.updater.metadata)
    }

    /// Replaces the registered tool list: see [`ToolsUpdater::update_tools`].
    pub async fn update_tools(&self, tools: Vec<String>) -> Result<(), RegisterError> {
        self.updater.update_tools(tools).await
    }

    /// A handle that changes the tool list from another task (one following the server's
    /// list), while this registration stays with whoever deregisters it.
    pub fn updater(&self) -> ToolsUpdater {
        self.updater.clone()
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

/// Changes a live registration's tool list: the key is put again under the lease it holds.
#[derive(Clone)]
pub struct ToolsUpdater {
    key: String,
    client: Client,
    metadata: SharedMetadata,
    events: watch::Receiver<RegistrationEvent>,
    /// One put at a time, so two updates cannot land in the opposite order.
    put_lock: Arc<tokio::sync::Mutex<()>>,
}

impl ToolsUpdater {
    /// Registers `tools` instead of the current list: the key is put again under the lease it
    /// holds. The new list is kept even when the put fails, so a re-registration after a lost
    /// lease carries it; the caller decides whether the list changed (and calls again after a
    /// failure).
    pub async fn update_tools(&self, tools: Vec<String>) -> Result<(), RegisterError> {
        let _one_at_a_time = self.put_lock.lock().await;
        let mut next = snapshot(&self.metadata);
        next.tools = tools;
        next.validate()?;
        let value = next.to_json();
        match self.metadata.lock() {
            Ok(mut m) => *m = next,
            Err(poisoned) => *poisoned.into_inner() = next,
        }
        // The lease may be replaced between reading it and the put (etcd then answers "lease
        // not found"); the replacement already carries the new list, but one retry with the
        // new lease keeps this call's answer true.
        let mut last = None;
        for _ in 0..2 {
            let lease = lease_of(&self.events.borrow());
            let mut kv = self.client.kv_client();
            let put = kv.put(
                self.key.clone(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            );
            match tokio::time::timeout(RPC_TIMEOUT, put).await {
                Ok(Ok(_)) => {
                    info!(key = %self.key, lease = format_args!("{lease:x}"), "metadata updated");
                    return Ok(());
                }
                Ok(Err(e)) => last = Some(RegisterError::Etcd(e)),
                Err(_) => {
                    last = Some(RegisterError::Invalid(format!(
                        "putting {} timed out after {} ms",
                        self.key,
                        RPC_TIMEOUT.as_millis()
                    )))
                }
            }
            if lease_of(&self.events.borrow()) == lease {
                break;
            }
        }
        Err(last.unwrap_or_else(|| RegisterError::Invalid("the put was not tried".into())))
    }
}

fn lease_of(event: &RegistrationEvent) -> i64 {
    match *event {
        RegistrationEvent::Alive { lease }
        | RegistrationEvent::Reconnecting { lease }
        | RegistrationEvent::LeaseLost { lease } => lease,
    }
}

async fn keep_registered(
    registrar: Registrar,
    client: Client,
    mut lease: Lease,
    metadata: SharedMetadata,
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
                    new = reregister(&registrar, &client, &metadata) => lease = new,
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
async fn reregister(registrar: &Registrar, client: &Client, metadata: &SharedMetadata) -> Lease {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let current = snapshot(metadata);
        let put = registrar.grant_and_put(client.clone(), &current);
        match tokio::time::timeout(RPC_TIMEOUT, put).await {
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
