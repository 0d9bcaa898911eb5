//! The versioned state toolgate serves, per resource type: what every Envoy should have (the
//! "cache" half of go-control-plane's cache/server split). No protocol here: streams, nonces
//! and ACKs live in `ads.rs`.
//!
//! Versions are content hashes of each type's encoded resources. So a version changes exactly
//! when the bytes of that type change, and it means the same thing across restarts of
//! toolgate-xds: an Envoy that reconnects reporting version `v` really holds the content `v`
//! names (a counter restarting at 1 could name different content with the same string).

use std::collections::BTreeMap;

use imbl::ordmap::DiffItem;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::google::protobuf::Any;

use super::any::to_any;
use super::resources::{self, ResourceOptions, ResourceType};
use super::route_table::{self, EncodedRoutes};
use crate::bootstrap::RouteTable;
use crate::routing::{ControlMembers, FetchedKeys, RoutingSnapshot, ServiceRoute, ServiceRoutes};
use crate::upstream_credentials::InjectedByService;

/// The traces one version keeps, the oldest changes' first: each costs an `xds.push` span per
/// Envoy that gets the version, and a burst of skipped snapshots holds up to 16 traces each.
const TRACES_PER_VERSION: usize = 32;

/// All resources of one type at one version. Immutable: shared by every stream through `Arc`,
/// and reused as is by the next [`CacheSnapshot`] when the type did not change.
#[derive(Debug)]
pub struct TypeSnapshot {
    /// Changes if and only if the encoded resources change: [`digest`](Self::digest) in hex.
    pub version: String,
    /// The sum of every entry's [`entry_digest`]: kept up to date by each change instead of
    /// hashing 10,000 entries again for every new version.
    digest: u64,
    entries: Entries,
    /// `changed_at` of the routing snapshot that produced this version: when the oldest etcd
    /// event folded into it reached toolgate-xds. Push latency is measured from here.
    pub changed_at: Instant,
    /// The traces of the changes folded into this version (none without an exporter): each
    /// push of it is a child of every one.
    pub traces: Arc<[crate::trace::TraceParent]>,
    /// When this version became current in the cache. A stream that started later is catching
    /// up, not propagating a change, and does not measure push latency.
    pub current_since: Instant,
    /// ECDS: the [`RoutingSnapshot::filter_urgency`] of the filter configuration in this
    /// version (0 for the other types). Delta holds back a filter configuration that changed
    /// with clusters or routes only while this stays what the Envoy was last answered with.
    pub urgency: u64,
}

/// One encoded resource and its content hash. The hash lets a stream send only the resources
/// it has not delivered in this form yet (EDS in state of the world allows partial responses).
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    any: Arc<Any>,
    hash: u64,
}

impl Entry {
    fn new(any: Any) -> Entry {
        Entry {
            hash: resource_hash(&any),
            any: Arc::new(any),
        }
    }
}

/// The content hash of one encoded resource: its version in delta xDS.
pub fn resource_hash(any: &Any) -> u64 {
    fnv1a([any.type_url.as_bytes(), &any.value[..]])
}

impl TypeSnapshot {
    fn new(
        (entries, digest): (Entries, u64),
        changed_at: Instant,
        traces: Arc<[crate::trace::TraceParent]>,
        urgency: u64,
    ) -> TypeSnapshot {
        TypeSnapshot {
            version: format!("{digest:016x}"),
            digest,
            entries,
            changed_at,
            traces,
            current_since: Instant::now(),
            urgency,
        }
    }

    /// The content hash of the resource `name`, if the type has it.
    pub fn hash(&self, name: &str) -> Option<u64> {
        self.entries.get(name).map(|e| e.hash)
    }

    /// The resource `name` and its content hash, if the type has it.
    pub fn entry(&self, name: &str) -> Option<(&Any, u64)> {
        self.entries.get(name).map(|e| (&*e.any, e.hash))
    }

    /// The names whose resource came, went or changed since `earlier`, in name order. Walks
    /// only what the two versions do not share: a version made from another by one change
    /// shares all but a path of its tree.
    pub fn changed_since<'a>(
        &'a self,
        earlier: &'a TypeSnapshot,
    ) -> impl Iterator<Item = &'a String> {
        earlier
            .entries
            .diff(&self.entries)
            .filter_map(|item| match item {
                DiffItem::Add(name, _) | DiffItem::Remove(name, _) => Some(name),
                DiffItem::Update {
                    old: (_, before),
                    new: (name, after),
                } => (before.hash != after.hash).then_some(name),
            })
    }

    /// The names of the type's resources, in name order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.entries.keys()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The resources among `names` that exist, in name order. A name toolgate does not know
    /// is left out: xDS lets a response omit a requested resource.
    pub fn select<'a>(&'a self, names: impl IntoIterator<Item = &'a String>) -> Vec<Any> {
        names
            .into_iter()
            .filter_map(|n| self.entries.get(n).map(|e| Any::clone(&e.any)))
            .collect()
    }

    /// Every resource of the type, in name order (a wildcard subscription).
    pub fn all(&self) -> Vec<Any> {
        self.entries.values().map(|e| Any::clone(&e.any)).collect()
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
    /// The services and filter configuration of the last applied snapshot.
    services: Option<(ServiceRoutes, Arc<str>)>,
    /// The virtual servers of the last applied snapshot (each has its route).
    virtual_servers: Vec<String>,
    /// The auth configuration of the last applied snapshot (`jwt_authn` and the metadata
    /// routes are made from it).
    auth: Option<Arc<toolgate_model::auth::AuthConfig>>,
    /// The fetched keys of the last applied snapshot (in `jwt_authn`'s configuration).
    jwks: Option<Arc<FetchedKeys>>,
    keep_caller_tokens: Option<bool>,
    /// The credentials toward servers of the last applied snapshot (the SDS secrets).
    credentials: Option<Arc<InjectedByService>>,
    /// The default timeout of the last applied snapshot (the shared routes wait it).
    default_timeout_ms: Option<u64>,
    /// The control cluster's members of the last applied snapshot.
    control: Option<Arc<ControlMembers>>,
    current: Option<Arc<CacheSnapshot>>,
    /// The routes of the last applied snapshot's services, encoded: a new route configuration
    /// is assembled from them rather than built and encoded whole.
    encoded_routes: EncodedRoutes,
    /// How clusters are built; fixed for the life of the cache.
    options: ResourceOptions,
}

impl SnapshotCache {
    pub fn new() -> SnapshotCache {
        SnapshotCache::default()
    }

    /// A cache that builds every resource with `options`.
    pub fn with_options(options: ResourceOptions) -> SnapshotCache {
        SnapshotCache {
            options,
            ..SnapshotCache::default()
        }
    }

    /// The current view; `None` until the first [`update`](Self::update).
    pub fn current(&self) -> Option<Arc<CacheSnapshot>> {
        self.current.clone()
    }

    /// Applies `snapshot` and returns the types whose version changed, in push order. The first
    /// update reports every type. Types that did not change keep their `Arc`, version and
    /// `changed_at`.
    pub fn update(&mut self, snapshot: &RoutingSnapshot) -> Vec<ResourceType> {
        let (built, encoded_routes) = self.build(snapshot);
        self.encoded_routes = encoded_routes;
        // A burst coalesces (the `watch` keeps the latest): what changes now was caused by the
        // earliest snapshot this cache skipped, not by the latest alone.
        let applied = self.current.as_ref().map_or(0, |c| c.generation);
        let causes = snapshot.causes_since(applied);
        let changed_at = causes.first().map_or(snapshot.changed_at, |c| c.changed_at);
        let traces: Arc<[_]> = causes
            .iter()
            .flat_map(|c| c.traces.iter())
            .filter(|t| t.is_some())
            .take(TRACES_PER_VERSION)
            .cloned()
            .collect();
        let mut changed = Vec::new();
        let mut types = BTreeMap::new();
        for (ty, entries) in built {
            let previous = self.current.as_ref().and_then(|c| c.types.get(&ty));
            let next = match (previous, entries) {
                (Some(prev), None) => Arc::clone(prev),
                (_, Some(entries)) => {
                    changed.push(ty);
                    let urgency = match ty {
                        ResourceType::ExtensionConfig => snapshot.filter_urgency,
                        _ => 0,
                    };
                    Arc::new(TypeSnapshot::new(
                        entries,
                        changed_at,
                        traces.clone(),
                        urgency,
                    ))
                }
                (None, None) => continue,
            };
            types.insert(ty, next);
        }
        self.services = Some((snapshot.services.clone(), snapshot.filter_config.clone()));
        self.virtual_servers.clone_from(&snapshot.virtual_servers);
        self.auth.clone_from(&snapshot.auth);
        self.jwks = Some(Arc::clone(&snapshot.jwks));
        self.keep_caller_tokens = Some(snapshot.keep_caller_tokens);
        self.credentials = Some(Arc::clone(&snapshot.credentials));
        self.default_timeout_ms = Some(snapshot.default_timeout_ms);
        self.control = Some(Arc::clone(&snapshot.control));
        self.current = Some(Arc::new(CacheSnapshot {
            generation: snapshot.generation,
            types,
        }));
        changed
    }

    /// Each type's resources for `snapshot`, or `None` for a type whose bytes are those of the
    /// current version. Only what changed is encoded: a service whose route is the same `Arc`
    /// (or equal) keeps its encoded cluster and assignment; the route configuration is rebuilt
    /// only when a service came, went or changed its path or timeout; the filter configuration
    /// only when its text changed (a pointer compare while the registry kept it). One change
    /// among 10,000 instances costs its own service and O(log n) in the persistent maps, not
    /// an encoding or a copy of the registry.
    fn build(
        &self,
        snapshot: &RoutingSnapshot,
    ) -> (
        BTreeMap<ResourceType, Option<(Entries, u64)>>,
        EncodedRoutes,
    ) {
        let empty = ServiceRoutes::new();
        let previous_routes = self.services.as_ref().map_or(&empty, |(s, _)| s);
        let previous = |ty| self.current.as_ref().and_then(|c| c.types.get(&ty));
        let mut secrets = Patch::new(previous(ResourceType::Secret));
        let same_credentials = self
            .credentials
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &snapshot.credentials) || **c == *snapshot.credentials);
        if !same_credentials {
            for service in self.credentials.iter().flat_map(|c| c.keys()) {
                if !snapshot.credentials.contains_key(service) {
                    secrets.remove(&resources::secret_name(service));
                }
            }
            for (service, injected) in snapshot.credentials.iter() {
                secrets.put(
                    resources::secret_name(service),
                    &resources::secret(service, injected),
                );
            }
        }
        let mut clusters = Patch::new(previous(ResourceType::Cluster));
        let mut assignments = Patch::new(previous(ResourceType::Endpoint));
        let first = previous(ResourceType::Route).is_none();
        let auth_changed = first || self.auth != snapshot.auth;
        let mut route_table_changed =
            first || auth_changed || self.virtual_servers != snapshot.virtual_servers;
        let mut encoded_routes = self.encoded_routes.clone();
        for change in diff(previous_routes, &snapshot.services) {
            match change {
                Change::Gone(service) => {
                    route_table_changed = true;
                    encoded_routes.remove(service);
                    let name = resources::cluster_name(service);
                    clusters.remove(&name);
                    assignments.remove(&name);
                }
                Change::Set(service, old, route) => {
                    if route_table::routes_differ(old, route) {
                        route_table_changed = true;
                        encoded_routes.insert(
                            service.to_string(),
                            route_table::encode_service(service, route),
                        );
                    }
                    let name = resources::cluster_name(service);
                    clusters.put(
                        name.clone(),
                        &resources::cluster(service, route, &self.options),
                    );
                    assignments.put(name, &resources::load_assignment(service, route));
                }
            }
        }
        if self.control.as_deref() != Some(&*snapshot.control) {
            assignments.put(
                toolgate_model::envoy::CONTROL_CLUSTER.to_string(),
                &resources::control_load_assignment(&snapshot.control),
            );
        }
        let mut routes = Patch::new(previous(ResourceType::Route));
        if route_table_changed {
            let table = RouteTable::PerService;
            routes.put_any(
                table.config_name().to_string(),
                route_table::assemble(snapshot, &encoded_routes, table),
            );
        }
        // Whatever changes the routes may change the shared table: the routes before the
        // services' (a new service's metadata route under auth, the virtual servers' timeout,
        // the longest of any service's) are in both. It is assembled from the kept bytes of the
        // few services with routes of their own, and a table equal to the one Envoy holds is
        // no change (a new service with the default path and timeout, most often).
        if route_table_changed || self.default_timeout_ms != Some(snapshot.default_timeout_ms) {
            let table = RouteTable::Shared;
            routes.put_any(
                table.config_name().to_string(),
                route_table::assemble(snapshot, &encoded_routes, table),
            );
        }
        let mut extension = Patch::new(previous(ResourceType::ExtensionConfig));
        let same_filter = self.services.as_ref().is_some_and(|(_, f)| {
            Arc::ptr_eq(f, &snapshot.filter_config) || *f == snapshot.filter_config
        });
        if !same_filter {
            extension.put_any(
                super::ecds::FILTER_CONFIG_NAME.to_string(),
                super::ecds::extension_config(&snapshot.filter_config),
            );
        }
        let keys_changed = self
            .jwks
            .as_ref()
            .is_none_or(|k| !Arc::ptr_eq(k, &snapshot.jwks) && **k != *snapshot.jwks);
        let keeping_changed = self.keep_caller_tokens != Some(snapshot.keep_caller_tokens);
        if auth_changed || keys_changed || keeping_changed {
            // Held back (the previous one stays) while a JWKS is still being fetched.
            if let Some(jwt) = super::auth::jwt_extension_config(
                snapshot.auth.as_deref(),
                &snapshot.jwks,
                snapshot.keep_caller_tokens,
            ) {
                extension.put_any(super::auth::JWT_CONFIG_NAME.to_string(), jwt);
            }
        }
        let types = BTreeMap::from([
            (ResourceType::Secret, secrets.finish()),
            (ResourceType::Cluster, clusters.finish()),
            (ResourceType::Endpoint, assignments.finish()),
            (ResourceType::Route, routes.finish()),
            (ResourceType::ExtensionConfig, extension.finish()),
        ]);
        (types, encoded_routes)
    }
}

/// Persistent, like [`ServiceRoutes`]: the next version of a type copies its 10,000 entries
/// in O(1) and shares all but the changed ones.
type Entries = imbl::OrdMap<String, Entry>;

/// How a service's route differs between two snapshots.
enum Change<'a> {
    Gone(&'a str),
    /// New (no old route) or changed.
    Set(&'a str, Option<&'a ServiceRoute>, &'a ServiceRoute),
}

/// The services that came, went or changed. The maps share every route that did not change
/// (the registry rebuilds only stale services), and the persistent map's diff skips what two
/// maps share, so a change costs its own services, not a walk of all of them.
fn diff<'a>(old: &'a ServiceRoutes, new: &'a ServiceRoutes) -> Vec<Change<'a>> {
    old.diff(new)
        .filter_map(|item| match item {
            DiffItem::Add(name, route) => Some(Change::Set(name.as_str(), None, route)),
            // `Arc`'s `==` compares pointers first; an equal route rebuilt is no change.
            DiffItem::Update {
                old: (_, before),
                new: (name, after),
            } => (before != after).then_some(Change::Set(name.as_str(), Some(before), after)),
            DiffItem::Remove(name, _) => Some(Change::Gone(name.as_str())),
        })
        .collect()
}

/// A type's previous resources with some replaced or removed, copied on the first change;
/// remembers whether the bytes differ from the previous version's, and keeps the digest.
struct Patch<'a> {
    previous: Option<&'a Arc<TypeSnapshot>>,
    /// `None` while nothing changed.
    entries: Option<Entries>,
    digest: u64,
}

impl<'a> Patch<'a> {
    fn new(previous: Option<&'a Arc<TypeSnapshot>>) -> Patch<'a> {
        Patch {
            previous,
            entries: None,
            digest: previous.map_or(0, |p| p.digest),
        }
    }

    fn get(&self, name: &str) -> Option<&Entry> {
        match (&self.entries, self.previous) {
            (Some(entries), _) => entries.get(name),
            (None, Some(prev)) => prev.entries.get(name),
            (None, None) => None,
        }
    }

    fn entries(&mut self) -> &mut Entries {
        let previous = self.previous;
        self.entries
            .get_or_insert_with(|| previous.map(|p| p.entries.clone()).unwrap_or_default())
    }

    fn put<M: prost::Message + prost::Name>(&mut self, name: String, message: &M) {
        self.put_any(name, to_any(message));
    }

    fn put_any(&mut self, name: String, any: Any) {
        // Compare bytes, not hashes: a hash only says "maybe equal".
        let old = match self.get(&name) {
            Some(old) if *old.any == any => return,
            Some(old) => entry_digest(&name, old.hash),
            None => 0,
        };
        let entry = Entry::new(any);
        self.digest = self
            .digest
            .wrapping_sub(old)
            .wrapping_add(entry_digest(&name, entry.hash));
        self.entries().insert(name, entry);
    }

    fn remove(&mut self, name: &str) {
        if let Some(old) = self.get(name).map(|e| entry_digest(name, e.hash)) {
            self.digest = self.digest.wrapping_sub(old);
            self.entries().remove(name);
        }
    }

    /// The new entries and their digest, or `None` when they are the previous version's.
    fn finish(self) -> Option<(Entries, u64)> {
        match (self.entries, self.previous) {
            (None, Some(_)) => None,
            (entries, _) => Some((entries.unwrap_or_default(), self.digest)),
        }
    }
}

/// One entry's share of its type's digest: 64-bit FNV-1a over its name and content hash,
/// length-prefixed so that no two different entries hash the same input. The digest is the
/// sum of the shares, so it depends on the content only (not on the order of changes, the
/// build or the process: an Envoy reconnecting to a restarted toolgate-xds with version `v`
/// holds what `v` names), and a change adjusts it in O(1).
fn entry_digest(name: &str, hash: u64) -> u64 {
    fnv1a([name.as_bytes(), &hash.to_le_bytes()[..]])
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
    fn clusters_are_built_with_the_cache_options() {
        use envoy_types::pb::envoy::config::cluster::v3::Cluster;
        use prost::Message;
        let detects = |options| {
            let mut cache = SnapshotCache::with_options(options);
            cache.update(&snapshot(1, &[("a", &[("a-1", 1)])]));
            let view = cache.current().expect("updated");
            let clusters = view.get(ResourceType::Cluster).expect("CDS served");
            let any = &clusters.entries["mcp.a"].any;
            let cluster = Cluster::decode(any.value.as_slice()).expect("a cluster");
            cluster.outlier_detection.is_some()
        };
        assert!(!detects(ResourceOptions::default()));
        assert!(detects(ResourceOptions {
            envoy_outlier_detection: true
        }));
    }

    #[test]
    fn a_skipped_snapshot_still_dates_and_traces_the_change() {
        // Generation 2 arrives before the cache read generation 1 (the watch kept only the
        // latest): the new cluster came with generation 1's change, so its version is dated
        // from that change, not from the later one.
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("a", &[("a-1", 1)])]));
        let earlier = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut second = snapshot(3, &[("a", &[("a-1", 1)]), ("b", &[("b-1", 2)])]);
        let cause = |generation, changed_at| crate::routing::Cause {
            generation,
            changed_at,
            traces: Default::default(),
        };
        second.recent = std::sync::Arc::from([
            cause(1, earlier - std::time::Duration::from_secs(1)),
            cause(2, earlier),
            cause(3, second.changed_at),
        ]);
        assert_eq!(
            cache.update(&second),
            vec![
                ResourceType::Cluster,
                ResourceType::Endpoint,
                ResourceType::Route
            ]
        );
        let view = cache.current().expect("updated");
        let clusters = view.get(ResourceType::Cluster).expect("CDS served");
        assert_eq!(clusters.changed_at, earlier);
    }

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
        cache.update(&second);
        let incremental = cache.current().expect("updated");
        let full = resources::build(&second);
        for (ty, resources) in full {
            let entries = &incremental.get(ty).expect("type served").entries;
            let anys: resources::NamedResources = entries
                .iter()
                .map(|(n, e)| (n.clone(), e.any.clone()))
                .collect();
            assert_eq!(anys, resources, "{ty:?}");
            for (n, a) in &resources {
                assert_eq!(
                    entries[n].hash,
                    Entry::new(Any::clone(a)).hash,
                    "{ty:?} {n}"
                );
            }
        }
    }

    #[test]
    fn the_kept_routes_follow_every_kind_of_service_change() {
        // Both route configurations are assembled from each service's routes encoded when
        // they changed; after each step each must be the configuration built from scratch, and
        // the shared one must change only where a service with routes of its own came, went or
        // changed (or what every route depends on).
        let mut cache = SnapshotCache::new();
        let mut snap = snapshot(1, &[("a", &[("a-1", 1)]), ("b", &[("b-1", 2)])]);
        /// A step's name, the change it makes, and whether the shared table changes.
        type Step = (&'static str, fn(&mut RoutingSnapshot), bool);
        let steps: [Step; 13] = [
            ("first", |_| {}, true),
            (
                "new service",
                |s| {
                    let c = s.services.get("a").cloned().expect("a");
                    s.services.insert("c".into(), c);
                },
                false,
            ),
            (
                "path",
                |s| {
                    if let Some(r) = s.services.get_mut("a") {
                        Arc::make_mut(r).mcp_path = "/".into();
                    }
                },
                true,
            ),
            (
                "timeout",
                |s| {
                    if let Some(r) = s.services.get_mut("b") {
                        Arc::make_mut(r).timeout_ms = 5_000;
                    }
                },
                true,
            ),
            (
                "endpoints only",
                |s| {
                    if let Some(r) = s.services.get_mut("b") {
                        Arc::make_mut(r).endpoints.clear();
                    }
                },
                false,
            ),
            (
                "virtual server",
                |s| s.virtual_servers = vec!["ops".into()],
                true,
            ),
            // b's timeout becomes the default: b shares, c (60 s) gets routes of its own.
            ("default timeout", |s| s.default_timeout_ms = 5_000, true),
            (
                "new service with the default timeout",
                |s| {
                    let d = s.services.get("b").cloned().expect("b");
                    s.services.insert("d".into(), d);
                },
                false,
            ),
            (
                "removal of a service that shares",
                |s| {
                    s.services.remove("d");
                },
                false,
            ),
            (
                "path back to the default",
                |s| {
                    if let Some(r) = s.services.get_mut("a") {
                        Arc::make_mut(r).mcp_path = "/mcp".into();
                        Arc::make_mut(r).timeout_ms = 5_000;
                    }
                },
                true,
            ),
            (
                "removal of a service with routes of its own",
                |s| {
                    s.services.remove("c");
                },
                true,
            ),
            (
                "a default timeout longer than any",
                |s| s.default_timeout_ms = 120_000,
                true,
            ),
            // e shares the routes, but the virtual servers' routes now wait its timeout, the
            // longest of any service: they are in the shared table too.
            (
                "new service that shares, with the longest timeout",
                |s| {
                    let mut e = ServiceRoute::clone(&s.services["b"]);
                    e.timeout_ms = 120_000;
                    s.services.insert("e".into(), Arc::new(e));
                },
                true,
            ),
        ];
        let mut shared_before = None;
        for (i, (step, change, shared_changes)) in steps.iter().enumerate() {
            change(&mut snap);
            snap.generation = i as u64 + 1;
            cache.update(&snap);
            let view = cache.current().expect("updated");
            let routes = &view.get(ResourceType::Route).expect("RDS").entries;
            let built = to_any(&resources::route_configuration(&snap));
            assert!(
                *routes[resources::ROUTE_CONFIG_NAME].any == built,
                "after {step}: the kept route configuration is not the one built from scratch"
            );
            let shared = Arc::clone(&routes[resources::SHARED_ROUTE_CONFIG_NAME].any);
            let built = to_any(&resources::shared_route_configuration(&snap));
            assert!(
                *shared == built,
                "after {step}: the kept shared route configuration is not the one built from scratch"
            );
            let changed = shared_before
                .as_ref()
                .is_none_or(|before: &Arc<Any>| !Arc::ptr_eq(before, &shared));
            assert_eq!(
                changed, *shared_changes,
                "after {step}: the shared routes changed"
            );
            shared_before = Some(shared);
        }
    }

    #[test]
    fn a_change_re_encodes_only_its_own_service() {
        let mut cache = SnapshotCache::new();
        cache.update(&snapshot(1, &[("a", &[("a-1", 1)]), ("b", &[("b-1", 3)])]));
        let before = cache.current().expect("updated");
        let changed = cache.update(&snapshot(
            2,
            &[("a", &[("a-1", 1)]), ("b", &[("b-1", 3), ("b-2", 4)])],
        ));
        assert_eq!(changed, [ResourceType::Endpoint]);
        let after = cache.current().expect("updated");
        let entry = |c: &CacheSnapshot, ty, name: &str| {
            Arc::clone(&c.get(ty).expect("type served").entries[name].any)
        };
        let (a, b) = (resources::cluster_name("a"), resources::cluster_name("b"));
        assert!(Arc::ptr_eq(
            &entry(&before, ResourceType::Endpoint, &a),
            &entry(&after, ResourceType::Endpoint, &a)
        ));
        assert!(!Arc::ptr_eq(
            &entry(&before, ResourceType::Endpoint, &b),
            &entry(&after, ResourceType::Endpoint, &b)
        ));
        assert!(Arc::ptr_eq(
            before.get(ResourceType::Cluster).expect("cds"),
            after.get(ResourceType::Cluster).expect("cds")
        ));
    }
    use super::*;
    use crate::routing::{Bulkhead, EndpointHealth, RouteEndpoint};
    use std::net::IpAddr;

    fn snapshot(generation: u64, services: &[(&str, &[(&str, u8)])]) -> RoutingSnapshot {
        RoutingSnapshot {
            generation,
            changed_at: Instant::now(),
            traces: Default::default(),
            recent: std::sync::Arc::from([]),
            services: services
                .iter()
                .map(|(name, endpoints)| {
                    (
                        name.to_string(),
                        ServiceRoute {
                            mcp_path: "/mcp".into(),
                            limits: Bulkhead::default(),
                            timeout_ms: 60_000,
                            credential_header: None,
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
            filter_config: Arc::from("{}"),
            filter_urgency: 0,
            virtual_servers: Vec::new(),
            max_body_bytes: 1024 * 1024,
            default_timeout_ms: 60_000,
            auth: None,
            jwks: Default::default(),
            keep_caller_tokens: false,
            credentials: Default::default(),
            control: Default::default(),
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
                ResourceType::Secret,
                ResourceType::Cluster,
                ResourceType::Endpoint,
                ResourceType::Route,
                ResourceType::ExtensionConfig
            ]
        );
    }

    #[test]
    fn a_credential_is_a_secret_and_its_rotation_changes_only_sds() {
        use crate::upstream_credentials::{Injected, SecretValue};
        let mut cache = SnapshotCache::new();
        let mut snap = snapshot(1, &[("inventory", &[("a", 1)])]);
        cache.update(&snap);
        let credential = |value: &str| {
            Arc::new(InjectedByService::from([(
                "inventory".to_string(),
                Injected {
                    header: "authorization".into(),
                    value: SecretValue::new(value),
                },
            )]))
        };
        snap.generation = 2;
        snap.credentials = credential("Bearer one");
        assert_eq!(cache.update(&snap), [ResourceType::Secret]);
        let view = cache.current().expect("view");
        let secrets = &view.get(ResourceType::Secret).expect("SDS").entries;
        assert!(secrets.contains_key("toolgate.upstream.inventory"));
        snap.generation = 3;
        snap.credentials = credential("Bearer one");
        assert!(
            cache.update(&snap).is_empty(),
            "the same value is no change"
        );
        snap.generation = 4;
        snap.credentials = credential("Bearer two");
        assert_eq!(cache.update(&snap), [ResourceType::Secret]);
        snap.generation = 5;
        snap.credentials = Arc::default();
        assert_eq!(cache.update(&snap), [ResourceType::Secret]);
        let view = cache.current().expect("view");
        assert!(view
            .get(ResourceType::Secret)
            .expect("SDS")
            .entries
            .is_empty());
    }

    #[test]
    fn a_filter_configuration_change_alone_changes_only_ecds() {
        let mut cache = SnapshotCache::new();
        let mut snap = snapshot(1, &[("inventory", &[("a", 1)])]);
        cache.update(&snap);
        snap.generation = 2;
        snap.filter_config = Arc::from(r#"{"max_body_bytes":10}"#);
        assert_eq!(cache.update(&snap), [ResourceType::ExtensionConfig]);
    }

    #[test]
    fn a_new_virtual_server_changes_the_routes_and_the_filter_configuration() {
        let mut cache = SnapshotCache::new();
        let mut snap = snapshot(1, &[("inventory", &[("a", 1)])]);
        cache.update(&snap);
        snap.generation = 2;
        snap.virtual_servers = vec!["default".into(), "ops".into()];
        snap.filter_config = Arc::from(r#"{"virtual_servers":{"ops":{}}}"#);
        assert_eq!(
            cache.update(&snap),
            [ResourceType::Route, ResourceType::ExtensionConfig]
        );
        snap.generation = 3;
        assert!(cache.update(&snap).is_empty());
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
    fn a_version_kept_through_changes_is_that_of_a_fresh_build() {
        // The digest is adjusted by each change; after adds, changes and removals it must
        // equal the one a fresh cache computes for the same content.
        type Services<'a> = &'a [(&'a str, &'a [(&'a str, u8)])];
        let steps: [Services; 4] = [
            &[("a", &[("a-1", 1)]), ("b", &[("b-1", 2)])],
            &[("a", &[("a-1", 1), ("a-2", 3)]), ("c", &[])],
            &[
                ("a", &[("a-2", 3)]),
                ("b", &[("b-1", 4)]),
                ("c", &[("c-1", 5)]),
            ],
            &[("b", &[("b-1", 4)])],
        ];
        let mut kept = SnapshotCache::new();
        for (i, step) in steps.iter().enumerate() {
            kept.update(&snapshot(i as u64 + 1, step));
            let mut fresh = SnapshotCache::new();
            fresh.update(&snapshot(1, step));
            assert_eq!(versions(&kept), versions(&fresh), "after step {i}");
        }
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
