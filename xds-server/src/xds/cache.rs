//! The versioned state toolgate serves, per resource type: what every Envoy should have (the
//! "cache" half of go-control-plane's cache/server split). No protocol here: streams, nonces
//! and ACKs live in `ads.rs`.
//!
//! Versions are content hashes of each type's encoded resources. So a version changes exactly
//! when the bytes of that type change, and it means the same thing across restarts of
//! toolgate-xds: an Envoy that reconnects reporting version `v` really holds the content `v`
//! names (a counter restarting at 1 could name different content with the same string).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::google::protobuf::Any;

use super::resources::{self, NamedResources, ResourceType};
use crate::routing::{RoutingSnapshot, ServiceRoute};

/// All resources of one type at one version. Immutable: shared by every stream through `Arc`,
/// and reused as is by the next [`CacheSnapshot`] when the type did not change.
#[derive(Debug)]
pub struct TypeSnapshot {
    /// Changes if and only if the encoded resources change.
    pub version: String,
    pub resources: NamedResources,
    /// A content hash per resource, so a stream can send only the resources it has not
    /// delivered in this form yet (EDS in state of the world allows partial responses).
    pub hashes: BTreeMap<String, u64>,
    /// `changed_at` of the routing snapshot that produced this version: when the oldest etcd
    /// event folded into it reached toolgate-xds. Push latency is measured from here.
    pub changed_at: Instant,
    /// When this version became current in the cache. A stream that started later is catching
    /// up, not propagating a change, and does not measure push latency.
    pub current_since: Instant,
}

/// The content hash of one resource.
fn resource_hash(any: &Any) -> u64 {
    fnv1a([any.type_url.as_bytes(), &any.value[..]])
}

impl TypeSnapshot {
    fn from_parts(
        resources: NamedResources,
        hashes: BTreeMap<String, u64>,
        changed_at: Instant,
    ) -> TypeSnapshot {
        TypeSnapshot {
            version: content_version(&hashes),
            resources,
            hashes,
            changed_at,
            current_since: Instant::now(),
        }
    }

    /// The resources among `names` that exist, in name order. A name toolgate does not know
    /// is left out: xDS lets a response omit a requested resource.
    pub fn select<'a>(&'a self, names: impl IntoIterator<Item = &'a String>) -> Vec<Any> {
        names
            .into_iter()
            .filter_map(|n| self.resources.get(n).cloned())
            .collect()
    }

    /// Every resource of the type, in name order (a wildcard subscription).
    pub fn all(&self) -> Vec<Any> {
        self.resources.values().cloned().collect()
    }
}

/// A consistent view of every type as of one routing snapshot.
#[derive(Debug, Clone)]
pub struct CacheSnapshot {
    generation: u64,
    types: BTreeMap<ResourceType, Arc<TypeSnapshot>>,
}

impl CacheSnapshot {
    /// The `RoutingSnapshot::generation` this view was built from.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// `None` for a type the cache does not serve (yet).
    pub fn get(&self, ty: ResourceType) -> Option<&Arc<TypeSnapshot>> {
        self.types.get(&ty)
    }

    pub fn version(&self, ty: ResourceType) -> Option<&str> {
        self.types.get(&ty).map(|t| t.version.as_str())
    }
}

/// Folds routing snapshots into versioned [`CacheSnapshot`]s. Owned by one task; readers get
/// the immutable `Arc<CacheSnapshot>`.
#[derive(Debug, Default)]
pub struct SnapshotCache {
    /// The services and filter configuration of the last applied snapshot: an unchanged
    /// registry costs one comparison.
    services: Option<(BTreeMap<String, ServiceRoute>, String)>,
    current: Option<Arc<CacheSnapshot>>,
}

impl SnapshotCache {
    pub fn new() -> SnapshotCache {
        SnapshotCache::default()
    }

    /// The current view; `None` until the first [`update`](Self::update).
    pub fn current(&self) -> Option<Arc<CacheSnapshot>> {
        self.current.clone()
    }

    /// Applies `snapshot` and returns the types whose version changed, in push order. The first
    /// update reports every type. Types that did not change keep their `Arc`, version and
    /// `changed_at`.
    pub fn update(&mut self, snapshot: &RoutingSnapshot) -> Vec<ResourceType> {
        if let (Some(current), Some(services)) = (&self.current, &self.services) {
            if services.0 == snapshot.services && services.1 == snapshot.filter_config {
                if current.generation != snapshot.generation {
                    self.current = Some(Arc::new(CacheSnapshot {
                        generation: snapshot.generation,
                        types: current.types.clone(),
                    }));
                }
                return Vec::new();
            }
        }
        let mut changed = Vec::new();
        let mut types = BTreeMap::new();
        for (ty, (built, hashes)) in self.build(snapshot) {
            let previous = self.current.as_ref().and_then(|c| c.types.get(&ty));
            let next = match previous {
                // Compare bytes, not versions: a hash only says "maybe equal".
                Some(prev) if prev.resources == built => Arc::clone(prev),
                _ => {
                    changed.push(ty);
                    Arc::new(TypeSnapshot::from_parts(built, hashes, snapshot.changed_at))
                }
            };
            types.insert(ty, next);
        }
        self.services = Some((snapshot.services.clone(), snapshot.filter_config.clone()));
        self.current = Some(Arc::new(CacheSnapshot {
            generation: snapshot.generation,
            types,
        }));
        changed
    }
}

impl SnapshotCache {
    /// Every resource of `snapshot`, with its hash. A service whose route did not change since
    /// the last snapshot keeps its encoded cluster and assignment: under churn over 10,000
    /// instances only the services that changed are encoded again.
    fn build(
        &self,
        snapshot: &RoutingSnapshot,
    ) -> BTreeMap<ResourceType, (NamedResources, BTreeMap<String, u64>)> {
        let previous_routes = self.services.as_ref().map(|(s, _)| s);
        let previous = |ty| self.current.as_ref().and_then(|c| c.types.get(&ty));
        let (prev_clusters, prev_assignments) = (
            previous(ResourceType::Cluster),
            previous(ResourceType::Endpoint),
        );
        let reuse = |snap: Option<&Arc<TypeSnapshot>>, name: &str| {
            let snap = snap?;
            Some((snap.resources.get(name)?.clone(), *snap.hashes.get(name)?))
        };
        let mut clusters = (NamedResources::new(), BTreeMap::new());
        let mut assignments = (NamedResources::new(), BTreeMap::new());
        for (service, route) in &snapshot.services {
            let name = resources::cluster_name(service);
            let same = previous_routes
                .and_then(|p| p.get(service))
                .is_some_and(|r| r == route);
            let kept = same
                .then(|| {
                    Some((
                        reuse(prev_clusters, &name)?,
                        reuse(prev_assignments, &name)?,
                    ))
                })
                .flatten();
            let ((c, ch), (a, ah)) = kept.unwrap_or_else(|| {
                let c = resources::to_any(&resources::cluster(service, route));
                let a = resources::to_any(&resources::load_assignment(service, route));
                let (ch, ah) = (resource_hash(&c), resource_hash(&a));
                ((c, ch), (a, ah))
            });
            clusters.0.insert(name.clone(), c);
            clusters.1.insert(name.clone(), ch);
            assignments.0.insert(name.clone(), a);
            assignments.1.insert(name, ah);
        }
        let hashed = |resources: NamedResources| {
            let hashes = resources
                .iter()
                .map(|(n, a)| (n.clone(), resource_hash(a)))
                .collect();
            (resources, hashes)
        };
        let mut routes = NamedResources::new();
        routes.insert(
            resources::ROUTE_CONFIG_NAME.to_string(),
            resources::to_any(&resources::route_configuration(snapshot)),
        );
        let mut extension = NamedResources::new();
        extension.insert(
            super::ecds::FILTER_CONFIG_NAME.to_string(),
            super::ecds::extension_config(&snapshot.filter_config),
        );
        BTreeMap::from([
            (ResourceType::Cluster, clusters),
            (ResourceType::Endpoint, assignments),
            (ResourceType::Route, hashed(routes)),
            (ResourceType::ExtensionConfig, hashed(extension)),
        ])
    }
}

/// 64-bit FNV-1a over every (name, content hash), each length-prefixed so that no two
/// different contents concatenate to the same input. Stable across builds and restarts, unlike
/// `std`'s `DefaultHasher`.
fn content_version(hashes: &BTreeMap<String, u64>) -> String {
    let encoded: Vec<[u8; 8]> = hashes.values().map(|h| h.to_le_bytes()).collect();
    let hash = fnv1a(
        hashes
            .keys()
            .zip(&encoded)
            .flat_map(|(name, h)| [name.as_bytes(), &h[..]]),
    );
    format!("{hash:016x}")
}

/// 64-bit FNV-1a over length-prefixed parts.
fn fnv1a<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for bytes in parts {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hash
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_incremental_build_equals_a_full_build() {
        let mut cache = SnapshotCache::new();
        let first = snapshot(1, &[("a", &[("a-1", 1), ("a-2", 2)]), ("b", &[("b-1", 3)])]);
        cache.update(&first);
        // b changes, a does not, c appears: a's resources are reused, the rest rebuilt.
        let second = snapshot(
            2,
            &[
                ("a", &[("a-1", 1), ("a-2", 2)]),
                ("b", &[("b-2", 4)]),
                ("c", &[("c-1", 5)]),
            ],
        );
        let incremental = cache.build(&second);
        let full = resources::build(&second);
        assert_eq!(incremental.len(), full.len());
        for (ty, resources) in full {
            assert_eq!(incremental[&ty].0, resources, "{ty:?}");
            let hashes: BTreeMap<String, u64> = resources
                .iter()
                .map(|(n, a)| (n.clone(), resource_hash(a)))
                .collect();
            assert_eq!(incremental[&ty].1, hashes, "{ty:?}");
        }
    }
    use super::*;
    use crate::routing::{Bulkhead, EndpointHealth, RouteEndpoint};
    use std::net::IpAddr;

    fn snapshot(generation: u64, services: &[(&str, &[(&str, u8)])]) -> RoutingSnapshot {
        RoutingSnapshot {
            generation,
            changed_at: Instant::now(),
            services: services
                .iter()
                .map(|(name, endpoints)| {
                    (
                        name.to_string(),
                        ServiceRoute {
                            mcp_path: "/mcp".into(),
                            limits: Bulkhead::default(),
                            timeout_ms: 60_000,
                            endpoints: endpoints
                                .iter()
                                .map(|(id, octet)| RouteEndpoint {
                                    instance_id: id.to_string(),
                                    ip: IpAddr::from([127, 0, 0, *octet]),
                                    port: 9000,
                                    weight: 1,
                                    health: EndpointHealth::Healthy,
                                })
                                .collect(),
                        },
                    )
                })
                .collect(),
            filter_config: String::from("{}"),
        }
    }

    fn versions(cache: &SnapshotCache) -> Vec<String> {
        let current = cache.current().expect("cache has a snapshot");
        [
            ResourceType::Cluster,
            ResourceType::Endpoint,
            ResourceType::Route,
        ]
        .iter()
        .map(|t| current.version(*t).expect("type served").to_string())
        .collect()
    }

    #[test]
    fn first_update_reports_every_served_type() {
        let mut cache = SnapshotCache::new();
        assert!(cache.current().is_none());
        let changed = cache.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        assert_eq!(
            changed,
            [
                ResourceType::Cluster,
                ResourceType::Endpoint,
                ResourceType::Route,
                ResourceType::ExtensionConfig
            ]
        );
    }

    #[test]
    fn a_filter_configuration_change_alone_changes_only_ecds() {
        let mut cache = SnapshotCache::new();
        let mut snap = snapshot(1, &[("inventory", &[("a", 1)])]);
        cache.update(&snap);
        snap.generation = 2;
        snap.filter_config = r#"{"max_body_bytes":10}"#.to_string();
        assert_eq!(cache.update(&snap), [ResourceType::ExtensionConfig]);
    }

    #[test]
    fn same_content_keeps_every_version_and_reports_nothing() {
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        let before = versions(&cache);
        let changed = cache.update(&snapshot(2, &[("inventory", &[("a", 1)])]));
        assert!(changed.is_empty());
        assert_eq!(versions(&cache), before);
        assert_eq!(cache.current().map(|c| c.generation()), Some(2));
    }

    #[test]
    fn an_endpoint_change_changes_only_eds() {
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        let before = versions(&cache);
        let changed = cache.update(&snapshot(2, &[("inventory", &[("a", 1), ("b", 2)])]));
        assert_eq!(changed, [ResourceType::Endpoint]);
        let after = versions(&cache);
        assert_eq!(after[0], before[0]);
        assert_ne!(after[1], before[1]);
        assert_eq!(after[2], before[2]);
    }

    #[test]
    fn a_new_service_changes_cds_eds_and_rds() {
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        let changed = cache.update(&snapshot(
            2,
            &[("inventory", &[("a", 1)]), ("billing", &[])],
        ));
        assert_eq!(
            changed,
            [
                ResourceType::Cluster,
                ResourceType::Endpoint,
                ResourceType::Route
            ]
        );
    }

    #[test]
    fn returning_to_earlier_content_returns_to_its_version() {
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        let first = versions(&cache);
        cache.update(&snapshot(2, &[("inventory", &[("b", 2)])]));
        assert_ne!(versions(&cache), first);
        cache.update(&snapshot(3, &[("inventory", &[("a", 1)])]));
        assert_eq!(versions(&cache), first);
    }

    #[test]
    fn versions_do_not_depend_on_the_process() {
        // Same content, fresh cache (as after a restart): same versions.
        let mut a = SnapshotCache::new();
        let mut b = SnapshotCache::new();
        a.update(&snapshot(1, &[("inventory", &[("a", 1)])]));
        b.update(&snapshot(9, &[("inventory", &[("a", 1)])]));
        assert_eq!(versions(&a), versions(&b));
    }
}
