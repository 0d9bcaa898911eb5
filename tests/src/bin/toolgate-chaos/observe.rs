//! What the run records besides the calls: every registration change in etcd (from a watch of
//! its own), Envoy's endpoints every 100 ms, and toolgate-xds's resident memory every second.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, WatchOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use toolgate_tests::envoy::AdminView;
use toolgate_tests::rss_kib;

/// One registration change: `endpoint` is `None` for a delete.
#[derive(Debug, Clone)]
pub struct KeyEvent {
    pub ms: f64,
    pub instance: String,
    pub endpoint: Option<String>,
}

/// Envoy's endpoints of the service at one poll.
#[derive(Debug, Clone)]
pub struct EnvoyPoll {
    pub ms: f64,
    pub addresses: Arc<BTreeSet<String>>,
}

#[derive(Debug, Clone, Copy)]
pub struct RssSample {
    pub ms: f64,
    pub kib: u64,
    /// Which toolgate-xds process (0 before its restart, 1 after).
    pub generation: u32,
}

#[derive(Default)]
pub struct Records {
    pub etcd: Vec<KeyEvent>,
    pub envoy: Vec<EnvoyPoll>,
    pub rss: Vec<RssSample>,
    /// Why the etcd watch of the run itself broke and resumed (it must not miss a change).
    pub watch_breaks: Vec<String>,
}

pub struct Observers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    pub records: Arc<Mutex<Records>>,
    /// The pid whose memory is sampled, and its generation; set again after a restart.
    pub xds_pid: Arc<AtomicI32>,
    pub xds_generation: Arc<AtomicI32>,
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

impl Observers {
    pub fn start(
        t0: Instant,
        etcd_endpoints: Vec<String>,
        prefix: String,
        envoy: AdminView,
        service: String,
        xds_pid: i32,
    ) -> Observers {
        let (stop, stopped) = watch::channel(false);
        let records = Arc::new(Mutex::new(Records::default()));
        let pid = Arc::new(AtomicI32::new(xds_pid));
        let generation = Arc::new(AtomicI32::new(0));
        let tasks = vec![
            tokio::spawn(watch_etcd(
                t0,
                etcd_endpoints,
                prefix,
                records.clone(),
                stopped.clone(),
            )),
            tokio::spawn(poll_envoy(
                t0,
                envoy,
                service,
                records.clone(),
                stopped.clone(),
            )),
            tokio::spawn(sample_rss(
                t0,
                pid.clone(),
                generation.clone(),
                records.clone(),
                stopped,
            )),
        ];
        Observers {
            stop,
            tasks,
            records,
            xds_pid: pid,
            xds_generation: generation,
        }
    }

    pub fn xds_restarted(&self, pid: i32) {
        self.xds_pid.store(pid, Ordering::SeqCst);
        self.xds_generation.fetch_add(1, Ordering::SeqCst);
    }

    pub async fn finish(self) -> Records {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        let mut r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *r)
    }
}

async fn connect(endpoints: &[String]) -> Option<Client> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(3));
    Client::connect(endpoints, Some(opts)).await.ok()
}

fn instance_of(key: &[u8], prefix: &str) -> String {
    String::from_utf8_lossy(key)
        .strip_prefix(prefix)
        .unwrap_or_default()
        .to_string()
}

fn endpoint_of(value: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    v["endpoint"].as_str().map(str::to_string)
}

/// Reads the prefix once, then watches it; after a break, resumes from the next revision, so
/// no change is missed (the run compacts only up to revisions this watch has seen).
async fn watch_etcd(
    t0: Instant,
    endpoints: Vec<String>,
    prefix: String,
    records: Arc<Mutex<Records>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut revision: Option<i64> = None;
    while !*stopped.borrow() {
        let Some(mut client) = connect(&endpoints).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let from = match revision {
            Some(r) => r + 1,
            None => {
                let Ok(resp) = client
                    .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                    .await
                else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                let now = ms(t0);
                let mut r = records.lock().unwrap_or_else(|p| p.into_inner());
                for kv in resp.kvs() {
                    r.etcd.push(KeyEvent {
                        ms: now,
                        instance: instance_of(kv.key(), &prefix),
                        endpoint: endpoint_of(kv.value()),
                    });
                }
                let rev = resp.header().map_or(0, |h| h.revision());
                revision = Some(rev);
                rev + 1
            }
        };
        let opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let mut stream = match client.watch(prefix.as_str(), Some(opts)).await {
            Ok(s) => s,
            Err(e) => {
                note_break(&records, format!("watch from {from} failed: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = stopped.changed() => return,
            };
            match msg {
                Ok(Some(resp)) => {
                    if resp.compact_revision() > 0 {
                        note_break(
                            &records,
                            format!(
                                "compacted at {} before {from}: changes were missed",
                                resp.compact_revision()
                            ),
                        );
                        revision = None;
                        break;
                    }
                    let now = ms(t0);
                    let mut r = records.lock().unwrap_or_else(|p| p.into_inner());
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        r.etcd.push(KeyEvent {
                            ms: now,
                            instance: instance_of(kv.key(), &prefix),
                            endpoint: match ev.event_type() {
                                EventType::Put => endpoint_of(kv.value()),
                                EventType::Delete => None,
                            },
                        });
                        revision = Some(revision.unwrap_or(0).max(kv.mod_revision()));
                    }
                }
                Ok(None) => {
                    note_break(&records, "watch stream ended".into());
                    break;
                }
                Err(e) => {
                    note_break(&records, format!("watch stream failed: {e}"));
                    break;
                }
            }
        }
    }
}

fn note_break(records: &Mutex<Records>, why: String) {
    let mut r = records.lock().unwrap_or_else(|p| p.into_inner());
    r.watch_breaks.push(why);
}

async fn poll_envoy(
    t0: Instant,
    envoy: AdminView,
    service: String,
    records: Arc<Mutex<Records>>,
    stopped: watch::Receiver<bool>,
) {
    let mut last: Arc<BTreeSet<String>> = Arc::default();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !*stopped.borrow() {
        tick.tick().await;
        // During a hot restart the admin listener moves between processes: skip that poll.
        let Some(mut hosts) = envoy.try_hosts().await else {
            continue;
        };
        let now = ms(t0);
        let addresses: BTreeSet<String> = hosts
            .remove(&service)
            .unwrap_or_default()
            .into_iter()
            .map(|h| h.address)
            .collect();
        if *last != addresses {
            last = Arc::new(addresses);
        }
        let mut r = records.lock().unwrap_or_else(|p| p.into_inner());
        r.envoy.push(EnvoyPoll {
            ms: now,
            addresses: last.clone(),
        });
    }
}

async fn sample_rss(
    t0: Instant,
    pid: Arc<AtomicI32>,
    generation: Arc<AtomicI32>,
    records: Arc<Mutex<Records>>,
    stopped: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !*stopped.borrow() {
        tick.tick().await;
        let kib = rss_kib(pid.load(Ordering::SeqCst));
        if kib == 0 {
            continue;
        }
        let mut r = records.lock().unwrap_or_else(|p| p.into_inner());
        r.rss.push(RssSample {
            ms: ms(t0),
            kib,
            generation: generation.load(Ordering::SeqCst) as u32,
        });
    }
}
