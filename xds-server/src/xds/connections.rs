//! Which Envoys are connected right now and what each was last sent, acknowledged or refused:
//! the operator's `/v1/envoys` (and the console's "Envoys" table). Written by the ADS streams,
//! read by the admin API; a stream removes its row however it ends.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Serialize;

use super::resources::ResourceType;

/// Every open ADS stream, by stream id.
#[derive(Debug, Default)]
pub struct Connections {
    streams: Mutex<BTreeMap<u64, Connection>>,
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

    /// Every open stream, oldest first.
    pub fn list(&self) -> Vec<Connection> {
        self.with(|s| s.values().cloned().collect())
    }
}

/// Removes its stream's row on drop, whether the stream ended cleanly, failed or panicked.
pub struct ConnectionGuard {
    table: Arc<Connections>,
    stream: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.table.with(|s| s.remove(&self.stream));
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
}
