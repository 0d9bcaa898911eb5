//! Which Envoys are connected right now and what each was last sent, acknowledged or refused:
//! the operator's `/v1/envoys` (and the console's "Envoys" table). Written by the ADS streams,
//! read by the admin API; a stream removes its row however it ends.
//!
//! Beside them, what each Envoy's filter last said of its configuration
//! (`/v1/filter-config-status`): the filter answers Envoy's configuration callback with
//! success whatever it makes of the configuration, so a refusal shows nowhere in xDS. Kept by
//! node id, since reports and streams come and go independently; forgotten an hour after its
//! Envoy was last connected, and at most [`MAX_REPORTED`] of them.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio::sync::watch;
use toolgate_model::fleet::FilterConfigStatus;

use super::resources::ResourceType;

/// Gateways whose filter-configuration state is kept; beyond, a report of a new one is
/// refused (a report token could otherwise name unbounded gateways).
pub const MAX_REPORTED: usize = 10_000;
/// A gateway's state is forgotten this long after its Envoy was last connected.
const FORGET_AFTER: Duration = Duration::from_secs(3600);
/// The longest refusal text kept.
const MAX_ERROR_CHARS: usize = 2048;

/// Every open ADS stream, by stream id.
#[derive(Debug)]
pub struct Connections {
    streams: Mutex<BTreeMap<u64, Connection>>,
    filters: Mutex<HashMap<String, Reported>>,
    /// How many distinct Envoys (node ids) are connected: what this toolgate-xds adds to the
    /// fleet's size, which call limits are split by.
    envoys: watch::Sender<u32>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            streams: Mutex::default(),
            filters: Mutex::default(),
            envoys: watch::Sender::new(0),
        }
    }
}

/// What a gateway's filter last reported of its configuration.
#[derive(Debug, Clone, Serialize)]
pub struct FilterConfigState {
    /// `rejected`: it refused the configuration it was sent and judges with the last one it
    /// accepted (or refuses calls, having none); `ok`: it applied one after a refusal.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Since when it is in this state.
    #[serde(serialize_with = "rfc3339")]
    pub since: SystemTime,
}

#[derive(Debug, Clone)]
struct Reported {
    shown: FilterConfigState,
    /// When its Envoy was last seen connected (or reported).
    seen: Instant,
}

/// Why a report was not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotKept {
    Invalid(&'static str),
    Full,
}

#[derive(Debug, Clone, Serialize)]
pub struct Connection {
    pub stream: u64,
    /// Empty until the first request names the node.
    pub node: String,
    pub cluster: String,
    /// The services of a sharded Envoy (its bootstrap's `--services`); absent: every service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub services: Option<String>,
    /// What its filter last reported of its configuration; absent: never reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter_config: Option<FilterConfigState>,
    pub peer: Option<SocketAddr>,
    #[serde(serialize_with = "rfc3339")]
    pub connected_at: SystemTime,
    /// By short type name (`cds`, `eds`, `rds`, `ecds`).
    pub types: BTreeMap<&'static str, TypeStatus>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TypeStatus {
    pub sent_version: Option<String>,
    #[serde(serialize_with = "rfc3339_opt")]
    pub sent_at: Option<SystemTime>,
    pub acked_version: Option<String>,
    /// The version Envoy refused last, and why.
    pub nacked_version: Option<String>,
    pub nack_error: Option<String>,
}

fn rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*t))
}

fn rfc3339_opt<S: serde::Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => rfc3339(t, s),
        None => s.serialize_none(),
    }
}

impl Connections {
    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<u64, Connection>) -> R) -> R {
        f(&mut self.streams.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The number of distinct Envoys connected, as it changes.
    pub fn envoys(&self) -> watch::Receiver<u32> {
        self.envoys.subscribe()
    }

    /// Counts the distinct identified nodes of `streams` (an Envoy that reconnects may have
    /// two streams for a moment; it is one gateway).
    fn count_envoys(&self, streams: &BTreeMap<u64, Connection>) {
        let nodes: std::collections::BTreeSet<&str> = streams
            .values()
            .map(|c| c.node.as_str())
            .filter(|n| !n.is_empty())
            .collect();
        let n = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
        self.envoys.send_if_modified(|v| {
            let changed = *v != n;
            *v = n;
            changed
        });
    }

    /// A stream opened; the returned guard removes it when dropped.
    pub fn open(self: &Arc<Self>, stream: u64, peer: Option<SocketAddr>) -> ConnectionGuard {
        self.with(|s| {
            s.insert(
                stream,
                Connection {
                    stream,
                    node: String::new(),
                    cluster: String::new(),
                    services: None,
                    filter_config: None,
                    peer,
                    connected_at: SystemTime::now(),
                    types: BTreeMap::new(),
                },
            )
        });
        ConnectionGuard {
            table: Arc::clone(self),
            stream,
        }
    }

    pub fn identified(&self, stream: u64, node: &str, cluster: &str, services: Option<String>) {
        self.with(|s| {
            if let Some(c) = s.get_mut(&stream) {
                c.node = node.to_string();
                c.cluster = cluster.to_string();
                c.services = services;
            }
            self.count_envoys(s);
        })
    }

    pub fn sent(&self, stream: u64, ty: ResourceType, version: &str) {
        self.update(stream, ty, |t| {
            t.sent_version = Some(version.to_string());
            t.sent_at = Some(SystemTime::now());
        })
    }

    pub fn acked(&self, stream: u64, ty: ResourceType, version: &str) {
        self.update(stream, ty, |t| t.acked_version = Some(version.to_string()))
    }

    pub fn nacked(&self, stream: u64, ty: ResourceType, version: &str, error: &str) {
        self.update(stream, ty, |t| {
            t.nacked_version = Some(version.to_string());
            t.nack_error = Some(error.to_string());
        })
    }

    fn update(&self, stream: u64, ty: ResourceType, f: impl FnOnce(&mut TypeStatus)) {
        self.with(|s| {
            if let Some(c) = s.get_mut(&stream) {
                f(c.types.entry(ty.short_name()).or_default());
            }
        })
    }

    /// Every open stream, oldest first, with what its filter reported.
    pub fn list(&self) -> Vec<Connection> {
        let mut list: Vec<Connection> = self.with(|s| s.values().cloned().collect());
        let now = Instant::now();
        let mut filters = self.filters.lock().unwrap_or_else(|p| p.into_inner());
        for c in &mut list {
            if let Some(r) = filters.get_mut(&c.node) {
                r.seen = now;
                c.filter_config = Some(r.shown.clone());
            }
        }
        list
    }

    /// Takes a filter's report of its configuration. Refused when it names no gateway, or a
    /// new gateway while [`MAX_REPORTED`] are kept. Returns whether the state changed.
    pub fn filter_config_report(&self, report: &FilterConfigStatus) -> Result<bool, NotKept> {
        let gateway = report.gateway.as_str();
        if gateway.is_empty() || gateway.len() > 256 {
            return Err(NotKept::Invalid(
                "gateway: the Envoy node id, 1 to 256 bytes",
            ));
        }
        let connected = self.connected_nodes();
        let now = Instant::now();
        let mut filters = self.filters.lock().unwrap_or_else(|p| p.into_inner());
        for node in &connected {
            if let Some(r) = filters.get_mut(node) {
                r.seen = now;
            }
        }
        filters.retain(|_, r| now.duration_since(r.seen) < FORGET_AFTER);
        if !filters.contains_key(gateway) && filters.len() >= MAX_REPORTED {
            // Room goes to the gateway reporting now before the longest disconnected one.
            let oldest = filters
                .iter()
                .filter(|(node, _)| !connected.contains(node.as_str()))
                .min_by_key(|(_, r)| r.seen)
                .map(|(node, _)| node.clone());
            match oldest {
                Some(node) => {
                    filters.remove(&node);
                }
                None => return Err(NotKept::Full),
            }
        }
        let state = if report.accepted { "ok" } else { "rejected" };
        let error = (!report.accepted).then(|| {
            let e = report.error.as_deref().unwrap_or("no reason given");
            e.chars().take(MAX_ERROR_CHARS).collect::<String>()
        });
        let entry = filters
            .entry(gateway.to_string())
            .or_insert_with(|| Reported {
                shown: FilterConfigState {
                    state: "",
                    error: None,
                    since: SystemTime::now(),
                },
                seen: now,
            });
        entry.seen = now;
        let changed = entry.shown.state != state;
        if changed {
            entry.shown.state = state;
            entry.shown.since = SystemTime::now();
        }
        entry.shown.error = error;
        Ok(changed)
    }

    /// Connected Envoys whose filter last reported refusing its configuration.
    pub fn rejecting_envoys(&self) -> i64 {
        let connected = self.connected_nodes();
        let filters = self.filters.lock().unwrap_or_else(|p| p.into_inner());
        connected
            .iter()
            .filter(|node| {
                filters
                    .get(*node)
                    .is_some_and(|r| r.shown.state == "rejected")
            })
            .count() as i64
    }

    fn connected_nodes(&self) -> std::collections::BTreeSet<String> {
        self.with(|s| {
            s.values()
                .filter(|c| !c.node.is_empty())
                .map(|c| c.node.clone())
                .collect()
        })
    }
}

/// Removes its stream's row on drop, whether the stream ended cleanly, failed or panicked.
pub struct ConnectionGuard {
    table: Arc<Connections>,
    stream: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.table.with(|s| {
            s.remove(&self.stream);
            self.table.count_envoys(s);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_listed_while_open_with_what_it_was_sent() {
        let table = Arc::new(Connections::default());
        let guard = table.open(7, None);
        table.identified(7, "gw-1", "gateways", None);
        table.sent(7, ResourceType::Endpoint, "v1");
        table.acked(7, ResourceType::Endpoint, "v1");
        table.sent(7, ResourceType::Endpoint, "v2");
        table.nacked(7, ResourceType::Endpoint, "v2", "bad cluster");
        let list = table.list();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].node, "gw-1");
        let eds = &list[0].types["eds"];
        assert_eq!(eds.sent_version.as_deref(), Some("v2"));
        assert_eq!(eds.acked_version.as_deref(), Some("v1"));
        assert_eq!(eds.nack_error.as_deref(), Some("bad cluster"));
        let json = serde_json::to_value(&list).expect("serializes");
        assert!(json[0]["connected_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')));
        drop(guard);
        assert!(table.list().is_empty(), "removed when the stream ends");
    }

    #[test]
    fn the_envoys_are_counted_once_each_while_connected() {
        let table = Arc::new(Connections::default());
        let count = table.envoys();
        let a = table.open(1, None);
        assert_eq!(*count.borrow(), 0, "not identified yet");
        table.identified(1, "gw-1", "gateways", None);
        let b = table.open(2, None);
        table.identified(2, "gw-2", "gateways", None);
        // gw-1 reconnecting: two streams for a moment, one gateway.
        let a2 = table.open(3, None);
        table.identified(3, "gw-1", "gateways", None);
        assert_eq!(*count.borrow(), 2);
        drop(a);
        assert_eq!(*count.borrow(), 2);
        drop(b);
        assert_eq!(*count.borrow(), 1);
        drop(a2);
        assert_eq!(*count.borrow(), 0);
    }

    fn report(gateway: &str, accepted: bool) -> FilterConfigStatus {
        FilterConfigStatus {
            gateway: gateway.to_string(),
            accepted,
            error: (!accepted).then(|| "services.a.policy.open_ms = 0 is invalid".to_string()),
        }
    }

    #[test]
    fn a_filters_refusal_shows_on_its_envoy_until_it_accepts_again() {
        let table = Arc::new(Connections::default());
        let _guard = table.open(1, None);
        table.identified(1, "gw-1", "gateways", None);
        assert!(table.list()[0].filter_config.is_none(), "never reported");
        assert_eq!(table.filter_config_report(&report("gw-1", false)), Ok(true));
        let shown = table.list()[0].filter_config.clone().expect("shown");
        assert_eq!(shown.state, "rejected");
        assert!(shown
            .error
            .as_deref()
            .is_some_and(|e| e.contains("open_ms")));
        assert_eq!(table.rejecting_envoys(), 1);
        // Every worker reports: the state and its start stay.
        assert_eq!(
            table.filter_config_report(&report("gw-1", false)),
            Ok(false)
        );
        assert_eq!(
            table.list()[0].filter_config.as_ref().map(|f| f.since),
            Some(shown.since)
        );
        assert_eq!(table.filter_config_report(&report("gw-1", true)), Ok(true));
        let shown = table.list()[0].filter_config.clone().expect("shown");
        assert_eq!((shown.state, shown.error), ("ok", None));
        assert_eq!(table.rejecting_envoys(), 0);
        // A report of a gateway not connected is kept, but counts for no connected Envoy.
        assert_eq!(table.filter_config_report(&report("gw-2", false)), Ok(true));
        assert_eq!(table.rejecting_envoys(), 0);
        assert_eq!(
            table.filter_config_report(&report("", false)),
            Err(NotKept::Invalid(
                "gateway: the Envoy node id, 1 to 256 bytes"
            ))
        );
    }

    #[test]
    fn reports_of_many_gateways_are_bounded_and_a_connected_one_is_never_pushed_out() {
        let table = Arc::new(Connections::default());
        let _guard = table.open(1, None);
        table.identified(1, "gw-live", "gateways", None);
        assert!(table
            .filter_config_report(&report("gw-live", false))
            .is_ok());
        for n in 0..MAX_REPORTED + 10 {
            assert!(table
                .filter_config_report(&report(&format!("gone-{n}"), false))
                .is_ok());
        }
        let kept = table.filters.lock().unwrap().len();
        assert_eq!(kept, MAX_REPORTED);
        assert_eq!(table.rejecting_envoys(), 1, "the connected one stays");
    }
}
