//! The registry: every valid instance under `<prefix>services/`, folded from etcd's Get and
//! Watch into one map, and turned into a [`RoutingSnapshot`] for the xDS side.
//!
//! Invalid values are rejected here with their key and a reason; they never remove a valid
//! instance's last good value and never empty a service.

pub mod admission;
pub mod ages;
pub mod auth;
mod members;
mod memo;
pub mod offline;
pub mod persist;
mod policies;
pub mod publish;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use serde::Serialize;
use tokio::sync::Notify;
use toolgate_model::auth::{AuthConfig, ToolRules};
use toolgate_model::fleet::{FleetOpen, Override, MAX_REASON_LEN};
use toolgate_model::policy::{FilterConfig, PolicyOverrides, RequestLimits};
use toolgate_model::virtual_server::{
    order_sensitive, resolve, resolve_resources, ServiceResources, ServiceTools, Unnamed,
    VirtualRoutes, VirtualServer, DEFAULT_VIRTUAL,
};
use toolgate_model::{InstanceMetadata, KeyLayout, ProbeKind, ServiceKey};

use memo::{Memo, Versioned};
use policies::{PolicyKey, PolicyStore, Refusal};

use crate::health::machine::{CallCounts, Health, ProbeResult, State};
use crate::health::HealthConfig;
use crate::routing::{Bulkhead, EndpointHealth, RouteEndpoint, RoutingSnapshot, ServiceRoute};

/// The reason label of a policy delete refused because another policy depends on its value.
pub const DELETE_BREAKS_DEPENDENT: &str = "delete_breaks_dependent";

/// Envoy weights are the registered weight times this, so an UNHEALTHY instance's reduced
/// share stays a whole number even for weight 1.
pub const WEIGHT_SCALE: u32 = 100;

/// One valid registration.
#[derive(Debug, Clone)]
pub struct Instance {
    pub meta: InstanceMetadata,
    /// `meta` as JSON, encoded once: the state-dir writer and the inspection read every
    /// instance's, under the registry lock the watcher waits for.
    pub json: Arc<str>,
    pub ip: IpAddr,
    pub lease: i64,
    /// When etcd created the key (kept across overwrites): the service's age for naming.
    pub create_revision: i64,
    pub mod_revision: i64,
    pub health: Health,
    /// Wakes this instance's probe task early (a reported connect failure, a lagging lease,
    /// the inspection).
    pub wake: Arc<Notify>,
    pub lease_check: Option<LeaseCheck>,
    /// The value as read from etcd, hashed with the registry's keyed hasher: with the
    /// revisions and the lease, what tells a full read that this key did not change.
    value_hash: u64,
    /// The full read ([`Registry::reset`]) that last saw this key.
    read_mark: u64,
}

impl Instance {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.meta.endpoint.port)
    }

    /// How and where the instance is probed: the address, the kind, and the path the kind
    /// asks (`health_path` for http, `mcp_path` for mcp, none for tcp).
    pub fn probe_target(&self) -> ProbeTarget {
        let path = match self.meta.probe {
            ProbeKind::Http => self.meta.health_path.clone(),
            ProbeKind::Mcp => self.meta.mcp_path.clone(),
            ProbeKind::Tcp => String::new(),
        };
        ProbeTarget {
            addr: self.addr(),
            kind: self.meta.probe,
            path,
        }
    }
}

/// See [`Instance::probe_target`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub addr: SocketAddr,
    pub kind: ProbeKind,
    pub path: String,
}

/// What etcd's lease TimeToLive said at the last heartbeat check.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseCheck {
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    pub granted_ttl_s: i64,
    pub remaining_ttl_s: i64,
    /// Keepalives the registrar should have sent but etcd did not see.
    pub missed_keepalives: u32,
}

fn rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*t))
}

/// A fleet breaker opening as stored in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetEntry {
    pub open: FleetOpen,
    pub mod_revision: i64,
    pub lease: i64,
}

/// One key of a read as [`Registry::reset`] takes it: key, value, lease, create revision,
/// mod revision.
pub type KvEntry<'a> = (&'a str, &'a [u8], i64, i64, i64);

/// What a [`Registry::reset`] did not take from the read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reset {
    /// Every value that was not admitted.
    pub rejected: Vec<Rejected>,
    /// The keys among them that kept their last good value.
    pub kept: Vec<String>,
}

/// A value that was not admitted, with the key it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub key: String,
    /// Short, fixed reason for the metric label.
    pub reason: &'static str,
    pub detail: String,
}

#[derive(Debug, Clone)]
pub struct Registry {
    layout: KeyLayout,
    instances: BTreeMap<ServiceKey, Instance>,
    /// Services stay known after their last instance leaves: Envoy then gets an empty
    /// assignment (a clean "no healthy upstream") instead of a vanished cluster, and the route
    /// keeps the MCP path last registered (so an emptied service costs no route push).
    services: BTreeMap<String, String>,
    /// Breaker policies from `<prefix>policies/<service>[/<tool>]`: those in effect (raw JSON
    /// kept for the state-dir snapshot), and etcd's word on keys where it would make them
    /// invalid (see `policies.rs`).
    policies: PolicyStore,
    /// Breaker openings shared by the fleet (`<prefix>breakers/`), with their key's
    /// mod_revision (the compare of the next write) and lease.
    fleet: BTreeMap<(String, String), FleetEntry>,
    /// Operator overrides (`<prefix>overrides/`).
    overrides: BTreeMap<(String, String), Override>,
    revision: i64,
    health: Arc<HealthConfig>,
    /// Instances whose probe target appeared, changed or left since the health monitor last
    /// looked; it starts and stops probe tasks for exactly these.
    dirty: BTreeSet<ServiceKey>,
    membership: Arc<Notify>,
    /// (service, address) → instance, for the filters' call reports.
    by_addr: HashMap<(String, SocketAddr), ServiceKey>,
    /// Each service's route as last built. A publish rebuilds only the services marked stale
    /// since (all of them after a reset or a policy change): one change among 10,000 instances
    /// costs the work of its own service, not of the registry.
    routes: crate::routing::ServiceRoutes,
    stale: BTreeSet<String>,
    all_stale: bool,
    endpoints: Arc<admission::EndpointPolicy>,
    request_limits: RequestLimits,
    /// The tools each service's registrations list (the union over its instances), for the
    /// filter, which keeps breakers only for these. A service whose last instance left keeps
    /// its last list, as it keeps its route. Refreshed with the routes of stale services.
    catalog: Versioned<BTreeMap<String, BTreeSet<String>>>,
    /// The key the filters seal `Mcp-Session-Id` with (base64), if any.
    session_key: String,
    /// Virtual servers from `<prefix>virtual/<name>`, as last admitted (issue 19), with the
    /// raw JSON for the state-dir snapshot.
    virtuals: BTreeMap<String, (VirtualServer, String)>,
    /// Each service's age as its instance keys tell it: the smallest etcd create revision
    /// among its live instance keys. A service whose last instance left keeps its last one
    /// while it stays known. What names a service is its recorded age (below) once there is
    /// one; this until then, and it is what gets recorded.
    since_revision: BTreeMap<String, i64>,
    /// Each service's age for naming as the fleet recorded it (`<prefix>service-ages/`, see
    /// `ages.rs`): the older service keeps a contested name, across re-registrations.
    recorded_ages: BTreeMap<String, i64>,
    /// Notified when a service may lack a recorded age (`crate::service_ages` writes it).
    ages_wanted: Arc<Notify>,
    /// The tools the last publish could not name, so that each is logged once, when it
    /// appears, not at every push.
    unnamed: Vec<(String, Unnamed)>,
    /// The services whose servers speak only a revision with sessions, and that revision, as
    /// the tool catalog (`crate::catalog`) last found them: the filters hold sessions with
    /// them for 2026-07-28 clients of the aggregate endpoint.
    legacy_revisions: BTreeMap<String, String>,
    /// The tools the tool catalog read from the server of a service whose registrations list
    /// none: such a service's catalog for the filters, so that a breaker belongs to a name its
    /// server lists, never to a name a client made up.
    discovered: BTreeMap<String, BTreeSet<String>>,
    /// The auth configuration and rule sets from `<prefix>auth/` (issue 20), as last
    /// admitted.
    auth: auth::AuthStore,
    /// Whether the last publish had rule sets but no configuration to apply them with, so
    /// that this is logged once, when it starts, not at every push.
    auth_rules_unused: bool,
    /// The fleet's toolgate-xds (`<prefix>xds/`), and this one's own address: what Envoy's
    /// control cluster holds.
    members: members::Members,
    /// Each service's tool definitions as the tool catalog last read them: what the filters'
    /// offline listings show.
    definitions: Versioned<BTreeMap<String, Arc<Vec<serde_json::Value>>>>,
    /// Each service's prompt names, resource URIs and templates as the tool catalog last read
    /// them: the virtual servers route `prompts/get` and `resources/read` by them.
    surfaces: Versioned<BTreeMap<String, SurfaceRoutes>>,
    /// The last offline listings, keyed on what they were made from.
    offline_memo: Memo<OfflineKey, Arc<offline::OfflineListings>>,
    /// The last [`virtual_routes`](Self::virtual_routes), keyed on what it was made from.
    virtual_memo: Memo<VirtualKey, Arc<VirtualOutput>>,
    order_memo: Memo<OrderKey, Arc<BTreeSet<String>>>,
    /// The last filters' configuration, keyed on what it was made from.
    filter_memo: Memo<FilterKey, FilterMade>,
    /// Counts full reads; each instance carries the count of the last one that saw it.
    read_generation: u64,
    /// Keyed (per process), so a registrant cannot craft a value that hashes like another.
    value_hasher: std::hash::RandomState,
}

/// What [`Registry::virtual_routes`] computes from: the versions of the catalog and of the
/// surfaces, the ages of the services whose age can decide a name (see `order_sensitive`), in
/// name order, and the virtual servers' definitions.
type VirtualKey = (u64, u64, Vec<i64>, BTreeMap<String, VirtualServer>);
/// The versions of the catalog and the surfaces, and the definitions → the services whose age
/// can decide a name.
type OrderKey = (u64, u64, BTreeMap<String, VirtualServer>);

/// What a service offers besides tools, by what the filters route on: its prompts' names,
/// its resources' URIs and its resource templates (see `crate::catalog::Surface`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SurfaceRoutes {
    pub prompts: Vec<String>,
    pub resources: Vec<String>,
    pub templates: Vec<String>,
}
pub type VirtualOutput = (BTreeMap<String, VirtualRoutes>, Vec<(String, Unnamed)>);

/// What the filters' configuration is made from: the catalog's version (the large input,
/// compared by version), the virtual servers' names (compared by pointer: the memo of
/// [`Registry::virtual_routes`] keeps its `Arc` while they come out the same, as they do
/// when a service's age moves without deciding a contested name), and the configuration
/// without its catalog and virtual servers (the small inputs, compared whole: policies, fleet
/// openings, overrides, limits, auth, the session key). The key holds the `Arc`, so its
/// address cannot be reused while compared.
struct FilterKey {
    catalog: u64,
    virtual_routes: Arc<VirtualOutput>,
    offline: Arc<offline::OfflineListings>,
    rest: FilterConfig,
}

impl PartialEq for FilterKey {
    fn eq(&self, other: &Self) -> bool {
        self.catalog == other.catalog
            && Arc::ptr_eq(&self.virtual_routes, &other.virtual_routes)
            && Arc::ptr_eq(&self.offline, &other.offline)
            && self.rest == other.rest
    }
}

/// What the offline listings are made from: the definitions' version and the virtual servers'
/// names (by pointer, as in [`FilterKey`]).
struct OfflineKey {
    definitions: u64,
    virtual_routes: Arc<VirtualOutput>,
}

impl PartialEq for OfflineKey {
    fn eq(&self, other: &Self) -> bool {
        self.definitions == other.definitions
            && Arc::ptr_eq(&self.virtual_routes, &other.virtual_routes)
    }
}

/// The filters' configuration as a publish sends it, made once per change of its inputs.
#[derive(Clone)]
struct FilterMade {
    config: Arc<FilterConfig>,
    json: Arc<str>,
    /// See [`RoutingSnapshot::filter_urgency`].
    urgency: u64,
    unnamed: Vec<(String, Unnamed)>,
}

impl Registry {
    /// A registry without active probes: instances are UP while their lease lives.
    pub fn new(layout: KeyLayout) -> Self {
        Self::with_health(
            layout,
            Arc::new(HealthConfig {
                probes: false,
                ..HealthConfig::default()
            }),
        )
    }

    pub fn with_health(layout: KeyLayout, health: Arc<HealthConfig>) -> Self {
        Registry {
            layout,
            instances: BTreeMap::new(),
            services: BTreeMap::new(),
            policies: PolicyStore::default(),
            fleet: BTreeMap::new(),
            overrides: BTreeMap::new(),
            revision: 0,
            health,
            dirty: BTreeSet::new(),
            membership: Arc::new(Notify::new()),
            by_addr: HashMap::new(),
            routes: Default::default(),
            stale: BTreeSet::new(),
            all_stale: true,
            endpoints: Arc::default(),
            request_limits: RequestLimits::default(),
            catalog: Versioned::default(),
            session_key: String::new(),
            virtuals: BTreeMap::new(),
            since_revision: BTreeMap::new(),
            recorded_ages: BTreeMap::new(),
            ages_wanted: Arc::new(Notify::new()),
            unnamed: Vec::new(),
            legacy_revisions: BTreeMap::new(),
            discovered: BTreeMap::new(),
            auth: auth::AuthStore::default(),
            auth_rules_unused: false,
            members: members::Members::default(),
            definitions: Versioned::default(),
            surfaces: Versioned::default(),
            offline_memo: Memo::default(),
            virtual_memo: Memo::default(),
            order_memo: Memo::default(),
            filter_memo: Memo::default(),
            read_generation: 0,
            value_hasher: std::hash::RandomState::new(),
        }
    }

    /// What the tool catalog found a service's server to speak: `Some(revision)` when only a
    /// revision with sessions, `None` when 2026-07-28 or when the service is gone. Whether
    /// the filters' configuration changed (a publish is then due).
    pub fn set_legacy_revision(&mut self, service: &str, revision: Option<String>) -> bool {
        match revision {
            Some(r) => self.legacy_revisions.insert(service.to_string(), r.clone()) != Some(r),
            None => self.legacy_revisions.remove(service).is_some(),
        }
    }

    /// The tools the tool catalog read from `service`'s server, for a service whose
    /// registrations list none (`None`: forget them, the service is gone). Whether its
    /// catalog may change (a publish is then due).
    pub fn set_discovered_tools(&mut self, service: &str, tools: Option<BTreeSet<String>>) -> bool {
        let changed = match tools {
            Some(t) => {
                self.discovered.get(service) != Some(&t) && {
                    self.discovered.insert(service.to_string(), t);
                    true
                }
            }
            None => self.discovered.remove(service).is_some(),
        };
        if changed {
            self.mark_stale(service);
        }
        changed
    }

    /// Where this process's Envoys reach its admin listener, and its key id under
    /// `<prefix>xds/` when it registers itself (its own key is not one of the others).
    pub fn set_control_local(&mut self, own_id: Option<String>, local: SocketAddr) {
        self.members.set_local(own_id, local);
    }

    /// The tool definitions the tool catalog read from `service`'s server (`None`: forget
    /// them, the service is gone). Whether the filters' configuration changes (a publish is
    /// then due): only a change of the definitions themselves does.
    pub fn set_definitions(
        &mut self,
        service: &str,
        tools: Option<Vec<serde_json::Value>>,
    ) -> bool {
        match tools {
            Some(t) if self.definitions.get(service).is_some_and(|d| **d == t) => false,
            Some(t) => {
                self.definitions
                    .modify()
                    .insert(service.to_string(), Arc::new(t));
                true
            }
            None if self.definitions.contains_key(service) => {
                self.definitions.modify().remove(service);
                true
            }
            None => false,
        }
    }

    /// The prompts, resources and templates the tool catalog read from `service`'s server
    /// (`None`: forget them, the service is gone). Whether the filters' configuration changes.
    pub fn set_surface(&mut self, service: &str, surface: Option<SurfaceRoutes>) -> bool {
        match surface {
            Some(s) if self.surfaces.get(service) == Some(&s) => false,
            Some(s) => {
                self.surfaces.modify().insert(service.to_string(), s);
                true
            }
            None if self.surfaces.contains_key(service) => {
                self.surfaces.modify().remove(service);
                true
            }
            None => false,
        }
    }

    /// What the filters list on their own while no toolgate-xds answers, made again only when
    /// the names or the definitions change.
    fn offline_listings(
        &self,
        virtual_routes: &Arc<VirtualOutput>,
    ) -> Arc<offline::OfflineListings> {
        let key = OfflineKey {
            definitions: self.definitions.version(),
            virtual_routes: Arc::clone(virtual_routes),
        };
        self.offline_memo.get_or_make(key, |before| {
            let made = offline::build(&virtual_routes.0, &self.definitions);
            let form_changed = before.is_none_or(|b| b.form != made.form);
            if form_changed && made.form != offline::Form::Full {
                tracing::warn!(bytes = made.full_bytes, budget = offline::BUDGET_BYTES,
                    form = ?made.form,
                    "the filters' offline listings are over their budget: they list names only, or nothing");
            }
            match before {
                Some(before) if **before == made => Arc::clone(before),
                _ => Arc::new(made),
            }
        })
    }

    /// The key the filters seal session ids with (see `session_key.rs`).
    pub fn with_session_key(mut self, key: String) -> Self {
        self.session_key = key;
        self
    }

    /// An empty registry that admits exactly what this one does (layout, endpoint policy,
    /// limits, and the policies in effect, since whether a policy change is admitted depends
    /// on the others), so that a read of etcd folded into it compares with this one like for
    /// like: it settles the policies as a resync of this one would.
    pub fn empty_like(&self) -> Registry {
        let mut r = Registry::with_health(self.layout.clone(), self.health.clone());
        r.endpoints = self.endpoints.clone();
        r.request_limits = self.request_limits;
        r.policies = self.policies.clone();
        r
    }

    /// Which endpoint addresses registrations may name (dangerous ones never).
    pub fn with_endpoint_policy(mut self, policy: admission::EndpointPolicy) -> Self {
        self.endpoints = Arc::new(policy);
        self
    }

    /// The body limits every filter enforces (sent in their configuration).
    pub fn with_request_limits(mut self, limits: RequestLimits) -> Self {
        self.request_limits = limits;
        self
    }

    pub fn health_config(&self) -> &Arc<HealthConfig> {
        &self.health
    }

    /// Notified whenever [`take_dirty`](Self::take_dirty) has something.
    pub fn membership(&self) -> Arc<Notify> {
        self.membership.clone()
    }

    /// The instances whose probe target changed since the last call.
    pub fn take_dirty(&mut self) -> BTreeSet<ServiceKey> {
        std::mem::take(&mut self.dirty)
    }

    fn mark_dirty(&mut self, key: ServiceKey) {
        self.dirty.insert(key);
        self.membership.notify_one();
    }

    pub fn instance(&self, key: &ServiceKey) -> Option<&Instance> {
        self.instances.get(key)
    }

    /// Mutable access marks the instance's route stale: whatever the caller changes is
    /// published.
    pub fn instance_mut(&mut self, key: &ServiceKey) -> Option<&mut Instance> {
        let inst = self.instances.get_mut(key)?;
        if !self.stale.contains(&key.service) {
            self.stale.insert(key.service.clone());
        }
        Some(inst)
    }

    pub fn health_mut(&mut self, key: &ServiceKey) -> Option<&mut Health> {
        self.instance_mut(key).map(|i| &mut i.health)
    }

    /// Records a lease check on `key`'s instance if it still holds `lease`. Returns the missed
    /// keepalives of the previous check and the instance's wake handle. Envoy sees nothing of
    /// it, so unlike [`instance_mut`](Self::instance_mut) no route goes stale: a check of
    /// 10,000 leases must not make the next publish rebuild every service.
    pub fn record_lease_check(
        &mut self,
        key: &ServiceKey,
        lease: i64,
        check: LeaseCheck,
    ) -> Option<(u32, Arc<Notify>)> {
        let inst = self.instances.get_mut(key).filter(|i| i.lease == lease)?;
        let before = inst
            .lease_check
            .replace(check)
            .map_or(0, |c| c.missed_keepalives);
        Some((before, Arc::clone(&inst.wake)))
    }

    fn mark_stale(&mut self, service: &str) {
        if !self.stale.contains(service) {
            self.stale.insert(service.to_string());
        }
    }

    pub fn instances(&self) -> impl Iterator<Item = (&ServiceKey, &Instance)> {
        self.instances.iter()
    }

    /// The instances whose key comes after `after` (all of them for `None`), in key order: a
    /// pass over the registry in chunks, letting go of its lock between them.
    pub fn instances_after(
        &self,
        after: Option<&ServiceKey>,
    ) -> impl Iterator<Item = (&ServiceKey, &Instance)> {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.instances.range((from, Bound::Unbounded))
    }

    /// The instance a filter's report names by its upstream address.
    pub fn find_by_addr(&self, service: &str, addr: SocketAddr) -> Option<&ServiceKey> {
        self.by_addr.get(&(service.to_string(), addr))
    }

    /// Instances still waiting for their first probe.
    pub fn unknown_count(&self) -> usize {
        self.instances
            .values()
            .filter(|i| i.health.state() == State::Unknown)
            .count()
    }

    pub fn layout(&self) -> &KeyLayout {
        &self.layout
    }

    /// The etcd revision this registry reflects.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn set_revision(&mut self, revision: i64) {
        self.revision = self.revision.max(revision);
    }

    pub fn instance_count(&self) -> usize {
        self.instances.len()
    }

    /// Replaces everything with a full read of the prefix (cold start, resync after compaction).
    /// A key whose value in the read is invalid keeps the last good value it had, as it does
    /// when the watch brings the same value: a resync never loses what a put would not.
    /// Each entry is (key, value, lease, create revision, mod revision).
    pub fn reset<'a>(
        &mut self,
        kvs: impl IntoIterator<Item = KvEntry<'a>>,
        revision: i64,
    ) -> Reset {
        // Instances are compared with the read, not rebuilt from it: one unchanged since it was
        // admitted (same value, revisions and lease) is left as it is, health and all, and
        // only the changed ones go through admission. Rebuilding all 10,000 cost a resync
        // about 70 ms of parsing and allocating; the handful of other keys are still re-read
        // in full.
        self.read_generation += 1;
        let generation = self.read_generation;
        let instances_prefix = self.layout.services_prefix();
        let mut kept_instances = BTreeSet::new();
        let mut old_fleet = std::mem::take(&mut self.fleet);
        let mut old_overrides = std::mem::take(&mut self.overrides);
        let mut old_virtuals = std::mem::take(&mut self.virtuals);
        let mut old_ages = std::mem::take(&mut self.recorded_ages);
        let mut old_auth = std::mem::take(&mut self.auth);
        let mut old_members = self.members.take();
        self.all_stale = true;
        let mut rejected = Vec::new();
        // Rule sets name services and virtual servers, which sort after `auth/` in a read:
        // applied last, they find them in, and warn only of names that are really unknown.
        let auth_prefix = self.layout.auth_prefix();
        let mut auth_kvs = Vec::new();
        // Policies are settled together, from those in effect (see `policies.rs`).
        let policies_prefix = self.layout.policies_prefix();
        let mut policy_read = BTreeMap::new();
        let mut policy_present = BTreeSet::new();
        for entry in kvs {
            if entry.0.starts_with(&auth_prefix) {
                auth_kvs.push(entry);
                continue;
            }
            if entry.0.starts_with(&policies_prefix) {
                match self.parse_policy(entry.0, entry.1) {
                    Ok((k, value)) => {
                        policy_present.insert(k.clone());
                        policy_read.insert(k, value);
                    }
                    Err((k, r)) => {
                        if let Some(k) = k {
                            policy_present.insert(k);
                        }
                        rejected.push(r);
                    }
                }
                continue;
            }
            let (key, value, lease, create_revision, mod_revision) = entry;
            let instance = key
                .starts_with(&instances_prefix)
                .then(|| self.layout.parse_instance_key(key).ok())
                .flatten();
            if let Some(sk) = &instance {
                let hash = self.value_hasher.hash_one(value);
                if let Some(inst) = self.instances.get_mut(sk) {
                    if inst.value_hash == hash
                        && inst.mod_revision == mod_revision
                        && inst.create_revision == create_revision
                        && inst.lease == lease
                    {
                        inst.read_mark = generation;
                        continue;
                    }
                }
            }
            if let Err(r) = self.put(key, value, lease, create_revision, mod_revision) {
                // An instance whose new value is invalid keeps its last good one.
                if let Some(inst) = instance.and_then(|sk| self.instances.get_mut(&sk)) {
                    if inst.read_mark != generation {
                        inst.read_mark = generation;
                        kept_instances.insert(r.key.clone());
                    }
                }
                rejected.push(r);
            }
        }
        let gone: Vec<ServiceKey> = self
            .instances
            .iter()
            .filter(|(_, inst)| inst.read_mark != generation)
            .map(|(sk, _)| sk.clone())
            .collect();
        for sk in gone {
            self.remove_instance(sk);
        }
        for (key, value, lease, create_revision, mod_revision) in auth_kvs {
            if let Err(r) = self.put(key, value, lease, create_revision, mod_revision) {
                rejected.push(r);
            }
        }
        let base = self.policy_base();
        let (refused, _) = self.policies.reset(policy_read, &policy_present, &base);
        let mut kept = Vec::new();
        for (k, why) in refused {
            let r = self.policy_rejected(&k, why);
            if self.policies.applied().contains_key(&k) {
                kept.push(r.key.clone());
            }
            rejected.push(r);
        }
        for r in &rejected {
            if r.key.starts_with(&instances_prefix) {
                if kept_instances.contains(&r.key) {
                    kept.push(r.key.clone());
                }
                continue;
            }
            if r.key.starts_with(&policies_prefix) {
                // Settled above: a policy with no value that fits keeps the one in effect.
                if self
                    .layout
                    .parse_policy_key(&r.key)
                    .is_ok_and(|k| self.policies.applied().contains_key(&k))
                    && !kept.contains(&r.key)
                {
                    kept.push(r.key.clone());
                }
                continue;
            }
            let restored = if let Ok(id) = self.layout.parse_xds_key(&r.key) {
                self.members.restore(&id, &mut old_members)
            } else {
                match self.layout.parse_auth_key(&r.key) {
                    Ok(which) => self.auth.restore(&which, &mut old_auth),
                    Err(_) => self.restore_last_good(
                        &r.key,
                        &mut old_fleet,
                        &mut old_overrides,
                        &mut old_virtuals,
                        &mut old_ages,
                    ),
                }
            };
            if restored {
                kept.push(r.key.clone());
            }
        }
        self.auth.keep_arc_of(&old_auth);
        self.revision = revision;
        self.ages_wanted.notify_one();
        kept.sort();
        Reset { rejected, kept }
    }

    /// Puts back the value `key` had before a reset, taken from the old maps. Returns whether
    /// there was one to put back.
    fn restore_last_good(
        &mut self,
        key: &str,
        fleet: &mut BTreeMap<(String, String), FleetEntry>,
        overrides: &mut BTreeMap<(String, String), Override>,
        virtuals: &mut BTreeMap<String, (VirtualServer, String)>,
        ages: &mut BTreeMap<String, i64>,
    ) -> bool {
        if let Ok(service) = self.layout.parse_service_age_key(key) {
            return match ages.remove(&service) {
                Some(age) => self.recorded_ages.insert(service, age).is_none(),
                None => false,
            };
        }
        if let Ok(name) = self.layout.parse_virtual_key(key) {
            return match virtuals.remove(&name) {
                Some(v) => self.virtuals.insert(name, v).is_none(),
                None => false,
            };
        }
        if let Ok(names) = self
            .layout
            .parse_tool_key(&self.layout.breakers_prefix(), key)
        {
            return match fleet.remove(&names) {
                Some(e) => self.fleet.insert(names, e).is_none(),
                None => false,
            };
        }
        if let Ok(names) = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
        {
            return match overrides.remove(&names) {
                Some(o) => self.overrides.insert(names, o).is_none(),
                None => false,
            };
        }
        false
    }

    /// Applies a PUT anywhere under the prefix, with the key's etcd lease and revisions.
    /// `Ok(true)` when what Envoy gets changed. Keys of kinds toolgate-xds does not follow
    /// here are ignored.
    pub fn put(
        &mut self,
        key: &str,
        value: &[u8],
        lease: i64,
        create_revision: i64,
        mod_revision: i64,
    ) -> Result<bool, Rejected> {
        if key.starts_with(&self.layout.services_prefix()) {
            self.put_instance(key, value, lease, create_revision, mod_revision)
        } else if key.starts_with(&self.layout.virtual_prefix()) {
            self.put_virtual(key, value)
        } else if key.starts_with(&self.layout.auth_prefix()) {
            self.put_auth(key, value)
        } else if key.starts_with(&self.layout.policies_prefix()) {
            self.put_policy(key, value)
        } else if key.starts_with(&self.layout.breakers_prefix()) {
            self.put_fleet(key, value, lease, mod_revision)
        } else if key.starts_with(&self.layout.overrides_prefix()) {
            self.put_override(key, value)
        } else if key.starts_with(&self.layout.service_ages_prefix()) {
            self.put_service_age(key, value)
        } else if key.starts_with(&self.layout.xds_prefix()) {
            self.members
                .put(&self.layout, &self.endpoints, key, value, lease)
        } else {
            Ok(false)
        }
    }

    fn put_fleet(
        &mut self,
        key: &str,
        value: &[u8],
        lease: i64,
        mod_revision: i64,
    ) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let names = self
            .layout
            .parse_tool_key(&self.layout.breakers_prefix(), key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let open: FleetOpen = serde_json::from_slice(value)
            .map_err(|e| reject("bad_breaker", format!("not a fleet breaker opening: {e}")))?;
        let changed = self.fleet.get(&names).is_none_or(|e| e.open != open);
        self.fleet.insert(
            names,
            FleetEntry {
                open,
                mod_revision,
                lease,
            },
        );
        Ok(changed)
    }

    fn put_override(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let names = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let o = parse_override(value).map_err(|e| reject("bad_override", e))?;
        let changed = self.overrides.get(&names) != Some(&o);
        self.overrides.insert(names, o);
        Ok(changed)
    }

    pub fn fleet(&self) -> &BTreeMap<(String, String), FleetEntry> {
        &self.fleet
    }

    pub fn overrides(&self) -> &BTreeMap<(String, String), Override> {
        &self.overrides
    }

    /// Whether `value` would be admitted at `key` (a policy, an override, a virtual server,
    /// an auth value), without changing anything: the admin API refuses with the same reason
    /// the watch would log.
    pub fn check(&self, key: &str, value: &[u8]) -> Result<(), Rejected> {
        if key.starts_with(&self.layout.virtual_prefix()) {
            return self.admit_virtual(key, value).map(|_| ());
        }
        if key.starts_with(&self.layout.auth_prefix()) {
            return auth::admit(&self.layout, key, value).map(|_| ());
        }
        if key.starts_with(&self.layout.policies_prefix()) {
            let (k, (overrides, _)) = self.parse_policy(key, value).map_err(|(_, r)| r)?;
            return self
                .policies
                .check_put(&k, &overrides, &self.policy_base())
                .map_err(|why| self.policy_rejected(&k, why));
        }
        let mut scratch = Registry::new(self.layout.clone());
        scratch.put(key, value, 0, 0, 0).map(|_| ())
    }

    /// Whether deleting the policy at `key` would be admitted, without changing anything: the
    /// admin API refuses a delete that would leave another policy invalid, naming it.
    pub fn check_policy_delete(&self, key: &str) -> Result<(), Rejected> {
        let Ok(k) = self.layout.parse_policy_key(key) else {
            return Ok(());
        };
        self.policies
            .check_delete(&k, &self.policy_base())
            .map_err(|why| self.policy_rejected(&k, why))
    }

    /// A virtual server definition, parsed and validated, or why not (the field it is about
    /// leads the detail).
    fn admit_virtual(&self, key: &str, value: &[u8]) -> Result<(String, VirtualServer), Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let name = self
            .layout
            .parse_virtual_key(key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let vs = VirtualServer::parse(value).map_err(|e| reject("bad_virtual", e.to_string()))?;
        Ok((name, vs))
    }

    /// A virtual server: admitted whole or not at all (the last good definition stays). One
    /// naming services that are not registered is admitted: a service may be between
    /// instances, and its tools appear when it registers.
    fn put_virtual(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let (name, vs) = self.admit_virtual(key, value)?;
        let unknown: Vec<&str> = vs
            .services
            .iter()
            .filter(|s| !self.services.contains_key(s.as_str()))
            .map(String::as_str)
            .collect();
        if !unknown.is_empty() {
            tracing::warn!(key, ?unknown,
                "virtual server names services that are not registered; their tools appear when they register");
        }
        let changed = self.virtuals.get(&name).is_none_or(|(old, _)| *old != vs);
        let raw = String::from_utf8_lossy(value).into_owned();
        self.virtuals.insert(name, (vs, raw));
        Ok(changed)
    }

    /// A value under `<prefix>auth/`: admitted whole or not at all (the last good one stays).
    /// A rule set for a service or virtual server that does not exist is admitted: it may be
    /// between instances, or be defined after its rules, and its rules then apply.
    fn put_auth(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let admitted = auth::admit(&self.layout, key, value)?;
        match &admitted {
            auth::Admitted::Service(name, _) if !self.services.contains_key(name) => {
                tracing::warn!(key, service = %name,
                    "rule set for a service that is not registered; it applies when the service registers");
            }
            auth::Admitted::Virtual(name, _)
                if name != DEFAULT_VIRTUAL && !self.virtuals.contains_key(name) =>
            {
                tracing::warn!(key, virtual_server = %name,
                    "rule set for a virtual server that is not defined; it applies when the server is");
            }
            _ => {}
        }
        let raw = String::from_utf8_lossy(value).into_owned();
        Ok(self.auth.insert(admitted, raw))
    }

    /// The auth configuration (`<prefix>auth/config`), when one is admitted.
    pub fn auth_config(&self) -> Option<&AuthConfig> {
        self.auth.config().map(|c| &**c)
    }

    /// The rule sets of services (`<prefix>auth/rules/<service>`), by service.
    pub fn auth_service_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.auth.service_rules()
    }

    /// The rule sets of virtual servers (`<prefix>auth/virtual/<name>`), by name.
    pub fn auth_virtual_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.auth.virtual_rules()
    }

    /// Every known service (registered now, or before and emptied since), sorted.
    pub fn service_names(&self) -> impl Iterator<Item = &String> {
        self.services.keys()
    }

    /// The virtual servers stored in etcd (without the built-in default), as admitted.
    pub fn stored_virtual_servers(&self) -> impl Iterator<Item = (&String, &VirtualServer)> {
        self.virtuals.iter().map(|(name, (vs, _))| (name, vs))
    }

    /// Whether a service is known (registered now, or before and emptied since).
    pub fn has_service(&self, service: &str) -> bool {
        self.services.contains_key(service)
    }

    /// Each known service's age for naming: the one the fleet recorded, else the smallest
    /// etcd create revision among its instance keys (the last one it had, for a service with
    /// none left).
    pub fn service_ages(&self) -> BTreeMap<String, i64> {
        self.since_revision
            .keys()
            .chain(self.recorded_ages.keys())
            .filter_map(|s| Some((s.clone(), self.service_age(s)?)))
            .collect()
    }

    /// A service's age for naming (see [`service_ages`](Self::service_ages)).
    pub fn service_age(&self, service: &str) -> Option<i64> {
        self.recorded_ages
            .get(service)
            .or_else(|| self.since_revision.get(service))
            .copied()
    }

    /// The services with an age from their instance keys that the fleet has not recorded yet,
    /// with that age: what `crate::service_ages` writes.
    pub fn unrecorded_ages(&self) -> Vec<(String, i64)> {
        self.since_revision
            .iter()
            .filter(|(s, _)| !self.recorded_ages.contains_key(*s))
            .map(|(s, age)| (s.clone(), *age))
            .collect()
    }

    /// Notified whenever [`unrecorded_ages`](Self::unrecorded_ages) may have changed.
    pub fn ages_wanted(&self) -> Arc<Notify> {
        self.ages_wanted.clone()
    }

    /// `<prefix>service-ages/<service>`: the age the fleet recorded for a service. Whether
    /// its age for naming changed.
    fn put_service_age(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let service = self
            .layout
            .parse_service_age_key(key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let age = ages::ServiceAge::parse(value).map_err(|e| reject("bad_service_age", e))?;
        let before = self.service_age(&service);
        self.recorded_ages.insert(service.clone(), age.revision);
        self.ages_wanted.notify_one();
        Ok(self.service_age(&service) != before)
    }

    /// Sets a service's age to the smallest create revision among its instances; a service
    /// with none keeps the age it had.
    fn refresh_since(&mut self, service: &str) {
        if let Some(rev) = self
            .service_instances(service)
            .map(|(_, inst)| inst.create_revision)
            .min()
        {
            self.since_revision.insert(service.to_string(), rev);
        }
    }

    /// A policy override: parsed, merged over the defaults and the other policies and
    /// validated before it is admitted, so a bad value never reaches a filter.
    fn put_policy(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let (k, value) = match self.parse_policy(key, value) {
            Ok(parsed) => parsed,
            Err((k, r)) => {
                if let Some(k) = k {
                    self.policies.forget_refused(&k);
                }
                return Err(r);
            }
        };
        let base = self.policy_base();
        let applied = self
            .policies
            .put(k.clone(), value, &base)
            .map_err(|why| self.policy_rejected(&k, why))?;
        Ok(self.policies_applied(&k, applied))
    }

    /// Marks every route stale when policies changed (a policy sets its service's bulkhead
    /// and timeout; rare enough to rebuild all), and logs the changes held back before that
    /// took effect with `key`'s. Whether anything changed.
    fn policies_applied(&mut self, key: &PolicyKey, applied: Vec<PolicyKey>) -> bool {
        for other in applied.iter().filter(|k| *k != key) {
            tracing::info!(key = %self.policy_key(other), after = %self.policy_key(key),
                "a policy change held back (it would have left another policy invalid) took effect");
        }
        if applied.is_empty() {
            return false;
        }
        self.all_stale = true;
        true
    }

    /// A deleted policy leaves, unless another policy depends on it: then its value stays in
    /// effect (refused like an invalid value) until that changes.
    fn delete_policy(&mut self, key: &str, k: PolicyKey) -> Result<bool, Rejected> {
        let base = self.policy_base();
        let applied = self
            .policies
            .delete(&k, &base)
            .map_err(|why| self.policy_rejected(&k, why))?;
        if !applied.is_empty() {
            tracing::debug!(key, "policy removed");
        }
        Ok(self.policies_applied(&k, applied))
    }

    /// A policy key and value, parsed; on error the key (when it is one) and why.
    #[allow(clippy::result_large_err)]
    fn parse_policy(
        &self,
        key: &str,
        value: &[u8],
    ) -> Result<(PolicyKey, policies::PolicyValue), (Option<PolicyKey>, Rejected)> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let k = self
            .layout
            .parse_policy_key(key)
            .map_err(|e| (None, reject("bad_key", e.to_string())))?;
        let overrides: PolicyOverrides =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value))
                .map_err(|e| {
                    (
                        Some(k.clone()),
                        reject("bad_policy", format!("not policy JSON: {e}")),
                    )
                })?;
        let raw = String::from_utf8_lossy(value).into_owned();
        Ok((k, (overrides, raw)))
    }

    /// What every policy is laid over: the defaults and the request limits, as the filters get
    /// them.
    fn policy_base(&self) -> FilterConfig {
        FilterConfig {
            max_body_bytes: self.request_limits.max_body_bytes,
            max_json_depth: self.request_limits.max_json_depth,
            ..FilterConfig::default()
        }
    }

    /// The policy key as stored in etcd.
    fn policy_key(&self, (service, tool): &PolicyKey) -> String {
        match tool {
            Some(t) => format!("{}{service}/{t}", self.layout.policies_prefix()),
            None => format!("{}{service}", self.layout.policies_prefix()),
        }
    }

    /// A refused policy change as the watch logs it and the admin API answers it.
    fn policy_rejected(&self, k: &PolicyKey, why: Refusal) -> Rejected {
        let key = self.policy_key(k);
        match why {
            Refusal::Invalid(detail) => Rejected {
                key,
                reason: "bad_policy",
                detail,
            },
            Refusal::Dependents(dependents) => {
                let named: Vec<String> = dependents
                    .iter()
                    .map(|(d, e)| format!("{} ({e})", self.policy_key(d)))
                    .collect();
                Rejected {
                    key,
                    reason: DELETE_BREAKS_DEPENDENT,
                    detail: format!(
                        "deleting it would leave {} invalid; its value stays in effect until \
                         the dependent policy is changed or deleted",
                        named.join(", ")
                    ),
                }
            }
        }
    }

    /// The virtual servers offered: every admitted `<prefix>virtual/<name>`, and `default`
    /// (every tool of every service, prefixed) unless one is stored under that name.
    pub fn virtual_servers(&self) -> BTreeMap<String, VirtualServer> {
        let mut all: BTreeMap<String, VirtualServer> = self
            .virtuals
            .iter()
            .map(|(name, (vs, _))| (name.clone(), vs.clone()))
            .collect();
        all.entry(DEFAULT_VIRTUAL.to_string())
            .or_insert_with(VirtualServer::everything);
        all
    }

    /// The names each virtual server offers and what they call, and the tools that could not
    /// be named (with why).
    pub fn virtual_routes(&self) -> Arc<VirtualOutput> {
        let definitions = self.virtual_servers();
        // Ages decide only contests: resolving again for every instance that replaces a
        // service's oldest one was most of a publish at 100,000 instances.
        let order_key = (
            self.catalog.version(),
            self.surfaces.version(),
            definitions.clone(),
        );
        let sensitive = self.order_memo.get_or_make(order_key, |_| {
            let tools: Vec<(&str, Vec<&str>)> = self
                .catalog
                .iter()
                .map(|(s, t)| (s.as_str(), t.iter().map(String::as_str).collect()))
                .collect();
            let prompts: Vec<(&str, Vec<&str>)> = self
                .surfaces
                .iter()
                .filter(|(s, _)| self.catalog.contains_key(*s))
                .map(|(s, f)| (s.as_str(), f.prompts.iter().map(String::as_str).collect()))
                .collect();
            let services = || tools.iter().map(|(s, t)| (*s, t.as_slice()));
            let prompted = || prompts.iter().map(|(s, p)| (*s, p.as_slice()));
            let mut union: BTreeSet<String> = definitions
                .values()
                .flat_map(|vs| {
                    order_sensitive(vs, services())
                        .into_iter()
                        .chain(order_sensitive(vs, prompted()))
                })
                .map(str::to_string)
                .collect();
            // A resource URI or template two services offer goes to the older one.
            let mut owners: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
            for (service, f) in self.surfaces.iter() {
                for uri in f.resources.iter().chain(&f.templates) {
                    owners
                        .entry(uri.as_str())
                        .or_default()
                        .insert(service.as_str());
                }
            }
            for shared in owners.values().filter(|o| o.len() > 1) {
                union.extend(shared.iter().map(|s| s.to_string()));
            }
            Arc::new(union)
        });
        let ages: Vec<i64> = sensitive
            .iter()
            .map(|s| self.service_age(s).unwrap_or(i64::MAX))
            .collect();
        let key = (
            self.catalog.version(),
            self.surfaces.version(),
            ages,
            definitions.clone(),
        );
        self.virtual_memo.get_or_make(key, |before| {
            let made = self.resolve_virtual_routes(&definitions);
            match before {
                Some(before) if **before == made => Arc::clone(before),
                _ => Arc::new(made),
            }
        })
    }

    fn resolve_virtual_routes(
        &self,
        definitions: &BTreeMap<String, VirtualServer>,
    ) -> VirtualOutput {
        let services: Vec<ServiceTools<'_>> = self
            .catalog
            .iter()
            .map(|(service, tools)| ServiceTools {
                service,
                since_revision: self.service_age(service).unwrap_or(i64::MAX),
                tools: tools.iter().map(String::as_str).collect(),
            })
            .collect();
        // Prompts are named like tools, by the same rules; resources keep their URIs unless
        // an older service has the same one. Only services with a route have them.
        let surfaces: Vec<(&str, i64, &SurfaceRoutes)> = self
            .surfaces
            .iter()
            .filter(|(s, _)| self.catalog.contains_key(*s))
            .map(|(s, f)| (s.as_str(), self.service_age(s).unwrap_or(i64::MAX), f))
            .collect();
        let prompts: Vec<ServiceTools<'_>> = surfaces
            .iter()
            .map(|(service, since_revision, f)| ServiceTools {
                service,
                since_revision: *since_revision,
                tools: f.prompts.iter().map(String::as_str).collect(),
            })
            .collect();
        let resources: Vec<ServiceResources<'_>> = surfaces
            .iter()
            .map(|(service, since_revision, f)| ServiceResources {
                service,
                since_revision: *since_revision,
                uris: f.resources.iter().map(String::as_str).collect(),
                templates: f.templates.iter().map(String::as_str).collect(),
            })
            .collect();
        let mut routes = BTreeMap::new();
        let mut unnamed = Vec::new();
        for (name, vs) in definitions {
            let (mut r, u) = resolve(vs, &services);
            unnamed.extend(u.into_iter().map(|u| (name.clone(), u)));
            if !surfaces.is_empty() {
                r.prompts = resolve(vs, &prompts).0.tools;
                (r.resources, r.templates) = resolve_resources(vs, &resources);
            }
            routes.insert(name.clone(), r);
        }
        (routes, unnamed)
    }

    /// The filter's configuration: the defaults, every admitted policy override, the fleet's
    /// breaker openings, the operator overrides and each virtual server's names.
    pub fn filter_config(&self) -> Arc<FilterConfig> {
        self.filter_made().config
    }

    /// [`filter_config`](Self::filter_config), its JSON, and the tools the virtual servers
    /// could not name; made again only when an input changed (see `memo.rs`).
    fn filter_made(&self) -> FilterMade {
        let virtual_routes = self.virtual_routes();
        let key = FilterKey {
            catalog: self.catalog.version(),
            offline: self.offline_listings(&virtual_routes),
            virtual_routes,
            rest: self.filter_config_without_catalog(),
        };
        let (virtual_routes, offline, rest) = (
            key.virtual_routes.clone(),
            key.offline.clone(),
            key.rest.clone(),
        );
        self.filter_memo.get_or_make(key, |_| {
            let (virtual_servers, unnamed) = &*virtual_routes;
            // What changes with services (their tools, names and revisions) may wait for their
            // clusters and routes; the rest (policies, openings, overrides, auth) may not.
            let urgent = FilterConfig {
                legacy_revisions: BTreeMap::new(),
                ..rest.clone()
            };
            let urgency = std::hash::BuildHasher::hash_one(
                &std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default(),
                serde_json::to_string(&urgent).unwrap_or_default(),
            );
            let config = FilterConfig {
                catalog: BTreeMap::clone(&self.catalog),
                virtual_servers: virtual_servers.clone(),
                ..rest
            };
            // Serializing plain structs with string keys cannot fail.
            let mut json = serde_json::to_string(&config).unwrap_or_default();
            // The offline listings go into the text only, written once when they change:
            // nothing here reads them back, and a copy of them in every configuration made
            // (at each breaker opening) would cost as much again.
            if !offline.json.is_empty() && json.ends_with('}') {
                json.pop();
                json.push_str(",\"offline_listings\":");
                json.push_str(&offline.json);
                json.push('}');
            }
            FilterMade {
                config: Arc::new(config),
                json: json.into(),
                urgency,
                unnamed: unnamed.clone(),
            }
        })
    }

    /// The filter's configuration but for its catalog and virtual servers: what is small
    /// enough to make and compare on every publish.
    fn filter_config_without_catalog(&self) -> FilterConfig {
        let mut config = FilterConfig {
            max_body_bytes: self.request_limits.max_body_bytes,
            max_json_depth: self.request_limits.max_json_depth,
            session_key: toolgate_model::policy::ReportToken(self.session_key.clone()),
            legacy_revisions: self
                .legacy_revisions
                .iter()
                .filter(|(service, _)| self.catalog.contains_key(*service))
                .map(|(s, r)| (s.clone(), r.clone()))
                .collect(),
            auth: self.auth.filter_auth(),
            claim_header_names: self.auth.claim_header_names(),
            ..FilterConfig::default()
        };
        for ((service, tool), e) in &self.fleet {
            config
                .fleet_open
                .entry(service.clone())
                .or_default()
                .insert(tool.clone(), e.open.clone());
        }
        for ((service, tool), o) in &self.overrides {
            config
                .overrides
                .entry(service.clone())
                .or_default()
                .insert(tool.clone(), o.clone());
        }
        policies::add_policies(&mut config, self.policies.applied());
        config
    }

    /// Logs the tools no virtual server could name that the last publish could: once per
    /// change, not at every push.
    fn log_unnamed(&mut self, unnamed: Vec<(String, Unnamed)>) {
        if unnamed == self.unnamed {
            return;
        }
        for (vs, u) in unnamed.iter().filter(|u| !self.unnamed.contains(u)) {
            tracing::warn!(virtual_server = %vs, service = %u.service, tool = %u.tool,
                reason = %u.reason, "a tool cannot be offered on a virtual server");
        }
        self.unnamed = unnamed;
    }

    /// Rule sets without a configuration are kept but not applied (nothing checks tokens
    /// then, so no rule could be): logged once when that starts, not at every push.
    fn log_auth_rules_unused(&mut self) {
        let unused = self.auth.config().is_none() && self.auth.has_rules();
        if unused && !self.auth_rules_unused {
            tracing::warn!(
                "auth rule sets are stored but no auth configuration is: they are not applied \
                 until <prefix>auth/config holds one"
            );
        }
        self.auth_rules_unused = unused;
    }

    fn put_instance(
        &mut self,
        key: &str,
        value: &[u8],
        lease: i64,
        create_revision: i64,
        mod_revision: i64,
    ) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let sk = self
            .layout
            .parse_instance_key(key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let meta =
            InstanceMetadata::from_json(value).map_err(|e| reject("bad_value", e.to_string()))?;
        if meta.instance_id != sk.instance {
            return Err(reject(
                "id_mismatch",
                format!(
                    "instance_id {:?} in the value differs from {:?} in the key",
                    meta.instance_id, sk.instance
                ),
            ));
        }
        // EDS endpoints are socket addresses; Envoy does not resolve names for them.
        let ip = meta.endpoint.ip().ok_or_else(|| {
            reject(
                "bad_endpoint",
                format!(
                    "endpoint {} has a host name; register an IP address",
                    meta.endpoint
                ),
            )
        })?;
        if let Err(why) = self.endpoints.check(ip) {
            return Err(reject(
                "refused_endpoint",
                format!("endpoint {}: {why}; not routed", meta.endpoint),
            ));
        }
        let mut instance = Instance {
            json: meta.to_json().into(),
            meta,
            ip,
            lease,
            create_revision,
            mod_revision,
            health: Health::new(self.health.probes),
            wake: Arc::new(Notify::new()),
            lease_check: None,
            value_hash: self.value_hasher.hash_one(value),
            read_mark: self.read_generation,
        };
        self.services
            .insert(sk.service.clone(), instance.meta.mcp_path.clone());
        let (routing_changed, target_changed) = match self.instances.get_mut(&sk) {
            Some(old) if same_target(old, &instance) => {
                // A new lease or new metadata at the same address: the health verdict holds.
                std::mem::swap(&mut instance.health, &mut old.health);
                std::mem::swap(&mut instance.wake, &mut old.wake);
                instance.lease_check = old.lease_check.take();
                (!same_routing(old, &instance), false)
            }
            Some(old) => {
                let old_addr = old.addr();
                self.by_addr.remove(&(sk.service.clone(), old_addr));
                (true, true)
            }
            None => (true, true),
        };
        if target_changed && self.revision > 0 {
            // Appeared while toolgate-xds watched (not in its first read): a new process, as
            // far as the sessions opened before it are concerned.
            instance.health.registered_now();
        }
        self.by_addr
            .insert((sk.service.clone(), instance.addr()), sk.clone());
        self.mark_stale(&sk.service);
        let service = sk.service.clone();
        let old_age = self.service_age(&service);
        self.instances.insert(sk.clone(), instance);
        self.refresh_since(&service);
        if !self.recorded_ages.contains_key(&service) {
            self.ages_wanted.notify_one();
        }
        if target_changed {
            self.mark_dirty(sk);
        }
        // A new age can rename tools on a virtual server: the filter must hear of it.
        Ok(routing_changed || self.service_age(&service) != old_age)
    }

    /// Removes an instance (its key was deleted, or a full read no longer has it). `true`
    /// when there was one.
    fn remove_instance(&mut self, sk: ServiceKey) -> bool {
        let Some(old) = self.instances.remove(&sk) else {
            return false;
        };
        let addr_key = (sk.service.clone(), old.addr());
        if self.by_addr.get(&addr_key) == Some(&sk) {
            self.by_addr.remove(&addr_key);
        }
        self.mark_stale(&sk.service);
        self.refresh_since(&sk.service);
        self.mark_dirty(sk);
        true
    }

    /// Applies a DELETE. `Ok(true)` when an instance, a policy, a virtual server or an auth
    /// value left; refused (the value stays in effect) when it is a policy another depends on.
    pub fn delete(&mut self, key: &str) -> Result<bool, Rejected> {
        if let Ok(sk) = self.layout.parse_instance_key(key) {
            return Ok(self.remove_instance(sk));
        }
        if let Ok(name) = self.layout.parse_virtual_key(key) {
            return Ok(self.virtuals.remove(&name).is_some());
        }
        if let Ok(service) = self.layout.parse_service_age_key(key) {
            // An operator resets a service's age by deleting it: it is recorded again from
            // its instance keys.
            let before = self.service_age(&service);
            self.recorded_ages.remove(&service);
            self.ages_wanted.notify_one();
            return Ok(self.service_age(&service) != before);
        }
        if let Ok(which) = self.layout.parse_auth_key(key) {
            return Ok(self.auth.remove(&which));
        }
        if let Ok(id) = self.layout.parse_xds_key(key) {
            return Ok(self.members.remove(&id));
        }
        if let Ok(k) = self
            .layout
            .parse_tool_key(&self.layout.breakers_prefix(), key)
        {
            return Ok(self.fleet.remove(&k).is_some());
        }
        if let Ok(k) = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
        {
            return Ok(self.overrides.remove(&k).is_some());
        }
        match self.layout.parse_policy_key(key) {
            Ok(k) => self.delete_policy(key, k),
            Err(_) => Ok(false),
        }
    }

    /// What Envoy should route to now. Rebuilds the routes of the services that changed since
    /// the last call; the others are shared with the previous snapshot.
    pub fn routing(&mut self, generation: u64, changed_at: Instant) -> RoutingSnapshot {
        let stale: Vec<String> = if std::mem::take(&mut self.all_stale) {
            self.stale.clear();
            let gone: Vec<String> = self
                .routes
                .keys()
                .filter(|s| !self.services.contains_key(*s))
                .cloned()
                .collect();
            for s in gone {
                self.routes.remove(&s);
            }
            let services = &self.services;
            if self.catalog.keys().any(|s| !services.contains_key(s)) {
                self.catalog
                    .modify()
                    .retain(|s, _| services.contains_key(s));
            }
            self.services.keys().cloned().collect()
        } else {
            std::mem::take(&mut self.stale).into_iter().collect()
        };
        for service in &stale {
            if !self.services.contains_key(service) {
                if self.catalog.contains_key(service) {
                    self.catalog.modify().remove(service);
                }
                continue;
            }
            let mut any = false;
            let tools: BTreeSet<String> = self
                .service_instances(service)
                .flat_map(|(_, inst)| {
                    any = true;
                    inst.meta.tools.iter().cloned()
                })
                .collect();
            if any {
                // Registrations that list nothing: the names the server itself listed, once
                // the tool catalog has read them.
                let tools = match self.discovered.get(service) {
                    Some(found) if tools.is_empty() => found.clone(),
                    _ => tools,
                };
                if self.catalog.get(service) != Some(&tools) {
                    self.catalog.modify().insert(service.clone(), tools);
                }
            } else if !self.catalog.contains_key(service) {
                // No instance left: the last list stands, as the route does.
                self.catalog
                    .modify()
                    .insert(service.clone(), BTreeSet::new());
            }
        }
        let made = self.filter_made();
        let filter = &made.config;
        self.log_unnamed(made.unnamed.clone());
        self.log_auth_rules_unused();
        for service in stale {
            if self.services.contains_key(&service) {
                let route = self.build_route(&service, filter);
                match self.routes.get(&service) {
                    Some(old) if **old == route => {}
                    _ => {
                        self.routes.insert(service, Arc::new(route));
                    }
                }
            } else {
                self.routes.remove(&service);
            }
        }
        RoutingSnapshot {
            generation,
            changed_at,
            traces: Default::default(),
            recent: std::sync::Arc::from([]),
            services: self.routes.clone(),
            filter_config: made.json.clone(),
            filter_urgency: made.urgency,
            virtual_servers: filter.virtual_servers.keys().cloned().collect(),
            max_body_bytes: self.request_limits.max_body_bytes,
            default_timeout_ms: filter.defaults.timeout_ms,
            auth: self.auth.config().cloned(),
            control: self.members.control(),
        }
    }

    /// The instances of one service: a range of the ordered instance map.
    fn service_instances<'a>(
        &'a self,
        service: &'a str,
    ) -> impl Iterator<Item = (&'a ServiceKey, &'a Instance)> + 'a {
        let first = ServiceKey {
            service: service.to_string(),
            instance: String::new(),
        };
        self.instances
            .range(first..)
            .take_while(move |(sk, _)| sk.service == service)
    }

    /// One service's route from its instances.
    fn build_route(&self, service: &str, filter: &FilterConfig) -> ServiceRoute {
        // The bulkhead comes from the service's policy (a tool cannot have its own pool).
        let policy = filter.policy_for(service, "");
        let mut route = ServiceRoute {
            mcp_path: String::new(),
            limits: Bulkhead {
                max_connections: policy.max_connections,
                max_pending_requests: policy.max_pending_requests,
                max_requests: policy.max_requests,
                max_retries: policy.max_retries,
            },
            timeout_ms: policy.timeout_ms,
            endpoints: Vec::new(),
        };
        for (sk, inst) in self.service_instances(service) {
            // Instances of one service share the MCP path; the first one (by id) decides.
            if route.mcp_path.is_empty() {
                route.mcp_path = inst.meta.mcp_path.clone();
            } else if route.mcp_path != inst.meta.mcp_path {
                tracing::warn!(service = %sk.service, instance = %sk.instance,
                    mcp_path = %inst.meta.mcp_path, using = %route.mcp_path,
                    "instance registered a different mcp_path than the rest of its service");
            }
            let weight = inst.meta.weight.max(1) * WEIGHT_SCALE;
            let (health, weight) = match inst.health.state() {
                // Not yet known to work, or known not to: Envoy does not get it at all.
                State::Unknown | State::Down => continue,
                State::Up => (EndpointHealth::Healthy, weight),
                State::Suspect => (EndpointHealth::Draining, weight),
                State::Unhealthy => (
                    EndpointHealth::Healthy,
                    (weight * self.health.unhealthy_weight_percent / 100).max(1),
                ),
            };
            route.endpoints.push(RouteEndpoint {
                instance_id: sk.instance.clone(),
                ip: inst.ip,
                port: inst.meta.endpoint.port,
                weight,
                health,
            });
        }
        if route.mcp_path.is_empty() {
            route.mcp_path = self.services.get(service).cloned().unwrap_or_default();
        }
        route
    }

    /// The raw (key, value) pairs of every admitted instance, policy, fleet opening, override,
    /// virtual server and auth value, for the state-dir snapshot.
    pub fn raw_values(&self) -> Vec<(String, String)> {
        let mut values: Vec<(String, String)> = self
            .raw_instances(None, usize::MAX)
            .0
            .into_iter()
            .map(|(key, value, _)| (key, value))
            .collect();
        values.extend(self.raw_values_but_instances());
        values
    }

    /// (key, value, create revision) of up to `limit` instances whose key comes after `after`
    /// (from the first for `None`), in key order, and the last one's key: the state-dir
    /// snapshot copies the instances in chunks, letting go of the registry's lock between them.
    pub fn raw_instances(
        &self,
        after: Option<&ServiceKey>,
        limit: usize,
    ) -> (Vec<(String, String, i64)>, Option<ServiceKey>) {
        let mut last = None;
        let values = self
            .instances_after(after)
            .take(limit)
            .map(|(sk, inst)| {
                last = Some(sk);
                (
                    self.layout.instance_key(&sk.service, &sk.instance),
                    inst.json.to_string(),
                    inst.create_revision,
                )
            })
            .collect();
        (values, last.cloned())
    }

    /// [`raw_values`](Self::raw_values) without the instances: policies, fleet openings,
    /// overrides, virtual servers and auth values (a few hundred at most) and the recorded
    /// service ages (one per service).
    pub fn raw_values_but_instances(&self) -> Vec<(String, String)> {
        let policies = self
            .policies
            .applied()
            .iter()
            .map(|(k, (_, raw))| (self.policy_key(k), raw.clone()));
        let fleet = self.fleet.iter().map(|((service, tool), e)| {
            (
                self.layout.breaker_key(service, tool),
                serde_json::to_string(&e.open).unwrap_or_default(),
            )
        });
        let overrides = self.overrides.iter().map(|((service, tool), o)| {
            (
                self.layout.override_key(service, tool),
                serde_json::to_string(o).unwrap_or_default(),
            )
        });
        let virtuals = self.virtuals.iter().map(|(name, (_, raw))| {
            (
                format!("{}{name}", self.layout.virtual_prefix()),
                raw.clone(),
            )
        });
        let ages = self.recorded_ages.iter().map(|(service, revision)| {
            (
                self.layout.service_age_key(service),
                ages::ServiceAge {
                    revision: *revision,
                }
                .to_json(),
            )
        });
        let members = self
            .members
            .iter()
            .map(|(id, m)| (self.layout.xds_key(id), m.raw.clone()));
        policies
            .chain(fleet)
            .chain(overrides)
            .chain(virtuals)
            .chain(ages)
            .chain(self.auth.raw_values(&self.layout))
            .chain(members)
            .collect()
    }

    /// The create revision of every instance key, for the state-dir snapshot: a restart
    /// during an etcd outage must give services the ages (and so the tool names) they had.
    pub fn create_revisions(&self) -> BTreeMap<String, i64> {
        self.instances
            .iter()
            .map(|(sk, inst)| {
                (
                    self.layout.instance_key(&sk.service, &sk.instance),
                    inst.create_revision,
                )
            })
            .collect()
    }

    /// Everything etcd decides (key, value, lease), for comparing this registry with a fresh
    /// read of etcd; and for each policy key where etcd's word is refused, what it is (a
    /// value, or `deleted`) under `<key>#refused`, so that a missed change there is a
    /// difference too.
    pub fn fingerprint(&self) -> Vec<(String, String, i64)> {
        let mut out: Vec<(String, String, i64)> = self
            .instances
            .iter()
            .map(|(sk, inst)| {
                (
                    self.layout.instance_key(&sk.service, &sk.instance),
                    inst.json.to_string(),
                    inst.lease,
                )
            })
            .collect();
        let services = self.layout.services_prefix();
        out.extend(
            self.raw_values()
                .into_iter()
                .filter(|(k, _)| !k.starts_with(&services))
                .map(|(k, v)| {
                    let breaker = self
                        .layout
                        .parse_tool_key(&self.layout.breakers_prefix(), &k)
                        .ok()
                        .and_then(|n| self.fleet.get(&n))
                        .map(|e| e.lease);
                    let member = || {
                        let id = self.layout.parse_xds_key(&k).ok()?;
                        self.members
                            .iter()
                            .find(|(i, _)| **i == id)
                            .map(|(_, m)| m.lease)
                    };
                    let lease = breaker.or_else(member).unwrap_or(0);
                    (k, v, lease)
                }),
        );
        out.extend(self.policies.refused().iter().map(|(k, want)| {
            let what = match want {
                Some((_, raw)) => raw.clone(),
                None => "deleted".to_string(),
            };
            (format!("{}#refused", self.policy_key(k)), what, 0)
        }));
        out
    }

    /// Instances per (service, state), and zombies per service, for the metrics.
    pub fn health_counts(&self) -> HealthCounts {
        let mut by_state = BTreeMap::new();
        let mut zombies: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for service in self.services.keys() {
            for s in State::ALL {
                by_state.insert((service.clone(), s), 0);
            }
            zombies.insert(service.clone(), (0, 0));
        }
        for (sk, inst) in &self.instances {
            *by_state
                .entry((sk.service.clone(), inst.health.state()))
                .or_insert(0) += 1;
            let z = zombies.entry(sk.service.clone()).or_insert((0, 0));
            z.1 += 1;
            if inst.health.is_zombie(&self.health) {
                z.0 += 1;
            }
        }
        (by_state, zombies)
    }

    /// JSON for `/v1/registry`.
    pub fn view(&self) -> RegistryView {
        let mut services: BTreeMap<String, Vec<InstanceView>> = self
            .services
            .keys()
            .map(|s| (s.clone(), Vec::new()))
            .collect();
        let now = Instant::now();
        for (sk, inst) in &self.instances {
            let (calls, call_failure_rate) = inst.health.recent_calls(now, &self.health);
            services
                .entry(sk.service.clone())
                .or_default()
                .push(InstanceView {
                    instance_id: sk.instance.clone(),
                    endpoint: inst.meta.endpoint.to_string(),
                    weight: inst.meta.weight,
                    tools: inst.meta.tools.clone(),
                    mcp_path: inst.meta.mcp_path.clone(),
                    health_path: inst.meta.health_path.clone(),
                    probe: inst.meta.probe,
                    protocol_versions: inst.meta.protocol_versions.clone(),
                    version: inst.meta.version.clone(),
                    zone: inst.meta.zone.clone(),
                    lease: format!("{:x}", inst.lease),
                    mod_revision: inst.mod_revision,
                    state: inst.health.state(),
                    since: humantime::format_rfc3339_millis(inst.health.since_wall()).to_string(),
                    cause: inst.health.cause().to_string(),
                    probes: inst.health.probes().cloned().collect(),
                    restarts: inst.health.incarnation().1,
                    calls,
                    call_failure_rate,
                    lease_check: inst.lease_check.clone(),
                });
        }
        RegistryView {
            revision: self.revision,
            instances: self.instances.len(),
            services,
        }
    }
}

/// Instances per (service, state), and (zombies, instances) per service.
pub type HealthCounts = (BTreeMap<(String, State), i64>, BTreeMap<String, (i64, i64)>);

/// An override as the admin API and the watch accept it.
pub fn parse_override(value: &[u8]) -> Result<Override, String> {
    let o: Override = serde_json::from_slice(value).map_err(|e| format!("not an override: {e}"))?;
    if o.reason.trim().is_empty() {
        return Err("reason: say why (it is shown to the agents)".into());
    }
    if o.reason.chars().count() > MAX_REASON_LEN {
        return Err(format!(
            "reason: {} characters, at most {MAX_REASON_LEN}",
            o.reason.chars().count()
        ));
    }
    Ok(o)
}

/// Whether two registrations of one key route the same (a lease change alone does not).
fn same_routing(a: &Instance, b: &Instance) -> bool {
    a.ip == b.ip && a.meta == b.meta
}

/// Whether two registrations of one key are probed the same way (same server).
fn same_target(a: &Instance, b: &Instance) -> bool {
    a.probe_target() == b.probe_target()
}

#[derive(Debug, Serialize)]
pub struct RegistryView {
    pub revision: i64,
    pub instances: usize,
    pub services: BTreeMap<String, Vec<InstanceView>>,
}

#[derive(Debug, Serialize)]
pub struct InstanceView {
    pub instance_id: String,
    pub endpoint: String,
    pub weight: u32,
    pub tools: Vec<String>,
    pub mcp_path: String,
    pub health_path: String,
    /// The probe kind the registration asked for.
    pub probe: ProbeKind,
    /// The MCP revisions the registrar learned the server speaks, newest first.
    pub protocol_versions: Vec<String>,
    pub version: String,
    pub zone: String,
    pub lease: String,
    pub mod_revision: i64,
    pub state: State,
    /// When the instance entered its state (RFC 3339).
    pub since: String,
    pub cause: String,
    /// The last probes, oldest first.
    pub probes: Vec<ProbeResult>,
    /// Restarts in place the probes saw (a new process at the same address; the sessions it
    /// held were lost with the old one).
    #[serde(skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// Calls the filters reported over the call window.
    pub calls: CallCounts,
    pub call_failure_rate: f64,
    pub lease_check: Option<LeaseCheck>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    pub(super) fn reg() -> Registry {
        Registry::new(KeyLayout::default())
    }

    const V1: &[u8] = br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9001","tools":["a"]}"#;

    #[test]
    fn the_fleets_toolgate_xds_follow_etcd_and_a_full_read_keeps_a_last_good_one() {
        let mut r = reg();
        let me: SocketAddr = "127.0.0.1:19000".parse().expect("addr");
        r.set_control_local(Some("127.0.0.1_19000".into()), me);
        let own = br#"{"admin":"127.0.0.1:19000"}"#;
        let other = br#"{"admin":"127.0.0.2:19000"}"#;
        assert_eq!(r.put("/mcp/xds/127.0.0.1_19000", own, 5, 2, 2), Ok(true));
        assert_eq!(r.put("/mcp/xds/127.0.0.2_19000", other, 6, 3, 3), Ok(true));
        let control = r.routing(1, Instant::now()).control;
        assert_eq!(control.local, Some(me));
        assert_eq!(control.peers, ["127.0.0.2:19000".parse().expect("addr")]);
        let rejected = r
            .put("/mcp/xds/127.0.0.2_19000", b"{}", 6, 3, 4)
            .expect_err("invalid");
        assert_eq!(rejected.reason, "bad_xds_member");
        // A full read where the other's value is invalid and a third is new: the other keeps
        // its last good value; our own key is never one of the others.
        let read = r.reset(
            [
                ("/mcp/xds/127.0.0.1_19000", &own[..], 5, 2, 2),
                ("/mcp/xds/127.0.0.2_19000", &b"{}"[..], 6, 3, 4),
                (
                    "/mcp/xds/127.0.0.3_19000",
                    &br#"{"admin":"127.0.0.3:19000"}"#[..],
                    7,
                    5,
                    5,
                ),
            ],
            5,
        );
        assert_eq!(read.kept, ["/mcp/xds/127.0.0.2_19000"]);
        let control = r.routing(2, Instant::now()).control;
        assert_eq!(
            control.peers,
            [
                "127.0.0.2:19000".parse().expect("addr"),
                "127.0.0.3:19000".parse().expect("addr")
            ]
        );
        assert_eq!(r.delete("/mcp/xds/127.0.0.3_19000"), Ok(true));
        assert_eq!(
            r.routing(3, Instant::now()).control.peers,
            ["127.0.0.2:19000".parse().expect("addr")]
        );
        // Members are in the state-dir snapshot like any other key.
        assert!(r
            .raw_values()
            .iter()
            .any(|(k, _)| k == "/mcp/xds/127.0.0.2_19000"));
    }

    #[test]
    fn put_and_delete_drive_the_routing() {
        let mut r = reg();
        assert_eq!(r.put("/mcp/services/inv/i-1", V1, 7, 2, 2), Ok(true));
        assert_eq!(
            r.put("/mcp/services/inv/i-1", V1, 8, 2, 3),
            Ok(false),
            "same routing"
        );
        let snap = r.routing(1, Instant::now());
        assert_eq!(snap.services["inv"].endpoints.len(), 1);
        assert_eq!(snap.services["inv"].mcp_path, "/mcp");
        assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
        let snap = r.routing(2, Instant::now());
        assert!(
            snap.services["inv"].endpoints.is_empty(),
            "a known service keeps an empty assignment"
        );
        assert_eq!(
            snap.services["inv"].mcp_path, "/mcp",
            "and its last MCP path"
        );
    }

    #[test]
    fn garbage_is_rejected_with_its_key_and_keeps_the_last_good_value() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        for (key, value, reason) in [
            ("/mcp/services/inv/i-1", &b"{not json"[..], "bad_value"),
            ("/mcp/services/in v/i-1", V1, "bad_key"),
            ("/mcp/services/inv", V1, "bad_key"),
            ("/mcp/services/inv/i-2", V1, "id_mismatch"),
            (
                "/mcp/services/inv/i-3",
                br#"{"instance_id":"i-3","endpoint":"example.com:80"}"#,
                "bad_endpoint",
            ),
            (
                "/mcp/services/inv/i-4",
                br#"{"instance_id":"i-4","endpoint":"0.0.0.0:80"}"#,
                "refused_endpoint",
            ),
            (
                "/mcp/services/inv/i-1",
                br#"{"instance_id":"i-1","endpoint":"169.254.169.254:80"}"#,
                "refused_endpoint",
            ),
        ] {
            let err = r.put(key, value, 1, 3, 3).unwrap_err();
            assert_eq!(err.reason, reason, "{key}");
            assert_eq!(err.key, key);
        }
        let snap = r.routing(1, Instant::now());
        assert_eq!(snap.services.len(), 1);
        assert_eq!(
            snap.services["inv"].endpoints.len(),
            1,
            "the valid instance keeps serving"
        );
    }

    #[test]
    fn policies_shape_the_filter_config_and_the_bulkhead() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        assert_eq!(
            r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 3, 3),
            Ok(true)
        );
        assert_eq!(
            r.put(
                "/mcp/policies/inv/a",
                br#"{"failure_rate_percent":20}"#,
                0,
                4,
                4
            ),
            Ok(true)
        );
        let snap = r.routing(1, Instant::now());
        assert_eq!(snap.services["inv"].limits.max_requests, 7);
        let config: FilterConfig = serde_json::from_str(&snap.filter_config).unwrap();
        assert_eq!(config.policy_for("inv", "a").failure_rate_percent, 20);
        assert_eq!(config.policy_for("inv", "b").failure_rate_percent, 50);
        for (key, value) in [
            ("/mcp/policies/inv/a", &br#"{"failure_rate_percent":0}"#[..]),
            ("/mcp/policies/inv/a", b"nope"),
            ("/mcp/policies/in v", b"{}"),
        ] {
            let err = r.put(key, value, 0, 5, 5).unwrap_err();
            assert_eq!(err.key, key);
        }
        let config: FilterConfig =
            serde_json::from_str(&r.routing(2, Instant::now()).filter_config).unwrap();
        assert_eq!(
            config.policy_for("inv", "a").failure_rate_percent,
            20,
            "a bad value keeps the last good one"
        );
        assert_eq!(r.delete("/mcp/policies/inv/a"), Ok(true));
        let config: FilterConfig =
            serde_json::from_str(&r.routing(3, Instant::now()).filter_config).unwrap();
        assert_eq!(config.policy_for("inv", "a").failure_rate_percent, 50);
        assert_eq!(r.put("/mcp/elsewhere/x", b"whatever", 0, 6, 6), Ok(false));
    }

    #[test]
    fn a_policy_another_depends_on_outlives_its_delete_until_the_dependent_goes() {
        let mut r = reg();
        r.put("/mcp/services/orders/i-1", V1, 7, 2, 2).unwrap();
        r.put(
            "/mcp/policies/orders",
            br#"{"max_open_ms":600000}"#,
            0,
            3,
            3,
        )
        .unwrap();
        r.put(
            "/mcp/policies/orders/pay",
            br#"{"open_ms":400000}"#,
            0,
            4,
            4,
        )
        .unwrap();
        // The admin API's check names the dependent and the validation error.
        let refused = r.check_policy_delete("/mcp/policies/orders").unwrap_err();
        assert_eq!(refused.reason, DELETE_BREAKS_DEPENDENT);
        assert!(
            refused.detail.contains("/mcp/policies/orders/pay")
                && refused.detail.contains("max_open_ms"),
            "{}",
            refused.detail
        );
        assert_eq!(r.check_policy_delete("/mcp/policies/orders/pay"), Ok(()));

        // The same delete from the watch: refused, the value stays in effect.
        let err = r.delete("/mcp/policies/orders").unwrap_err();
        assert_eq!(
            (err.key.as_str(), err.reason),
            ("/mcp/policies/orders", DELETE_BREAKS_DEPENDENT)
        );
        let config = published(&mut r);
        config.validate().expect("what the filters get is valid");
        assert_eq!(config.policy_for("orders", "pay").max_open_ms, 600000);

        // The inspection's read of etcd (the service's policy gone) settles like the watch did:
        // no difference, and a resync keeps the value too.
        let read: Vec<(&str, &[u8], i64, i64, i64)> = vec![
            (
                "/mcp/policies/orders/pay",
                br#"{"open_ms":400000}"#,
                0,
                4,
                4,
            ),
            ("/mcp/services/orders/i-1", V1, 7, 2, 2),
        ];
        let mut fresh = r.empty_like();
        let reset = fresh.reset(read.clone(), 5);
        assert_eq!(fresh.fingerprint(), r.fingerprint(), "like with like");
        assert_eq!(reset.kept, ["/mcp/policies/orders".to_string()]);
        assert_eq!(reset.rejected[0].reason, DELETE_BREAKS_DEPENDENT);
        // A missed delete is a difference: the registry did not know etcd lost the key.
        let mut unaware = reg();
        unaware
            .put("/mcp/services/orders/i-1", V1, 7, 2, 2)
            .unwrap();
        unaware
            .put(
                "/mcp/policies/orders",
                br#"{"max_open_ms":600000}"#,
                0,
                3,
                3,
            )
            .unwrap();
        unaware
            .put(
                "/mcp/policies/orders/pay",
                br#"{"open_ms":400000}"#,
                0,
                4,
                4,
            )
            .unwrap();
        let mut fresh = unaware.empty_like();
        fresh.reset(read.clone(), 5);
        assert_ne!(fresh.fingerprint(), unaware.fingerprint());
        unaware.reset(read, 5);
        assert_eq!(unaware.fingerprint(), r.fingerprint(), "a resync learns it");

        // The dependent leaves: the held delete takes effect with it.
        assert_eq!(r.delete("/mcp/policies/orders/pay"), Ok(true));
        let config = published(&mut r);
        assert!(!config.services.contains_key("orders"), "{config:?}");
        // A cold start reading only the dependent refuses it: the configuration stays valid.
        let mut cold = reg();
        let reset = cold.reset(
            [(
                "/mcp/policies/orders/pay",
                &br#"{"open_ms":400000}"#[..],
                0,
                4,
                4,
            )],
            5,
        );
        assert_eq!(reset.rejected[0].reason, "bad_policy");
        published(&mut cold).validate().expect("valid");
    }

    #[test]
    fn the_filter_learns_every_services_tools_and_keeps_them_when_it_empties() {
        let mut r = reg();
        let catalog = |r: &mut Registry, generation| {
            let config: FilterConfig =
                serde_json::from_str(&r.routing(generation, Instant::now()).filter_config).unwrap();
            config.catalog
        };
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put(
            "/mcp/services/inv/i-2",
            br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002","tools":["a","b"]}"#,
            8,
            3,
            3,
        )
        .unwrap();
        r.put(
            "/mcp/services/bare/i-1",
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9003"}"#,
            9,
            4,
            4,
        )
        .unwrap();
        let c = catalog(&mut r, 1);
        assert_eq!(c["inv"], BTreeSet::from(["a".to_string(), "b".to_string()]));
        assert!(c["bare"].is_empty(), "registrations that list no tools");
        assert_eq!(r.delete("/mcp/services/inv/i-2"), Ok(true));
        let c = catalog(&mut r, 2);
        assert_eq!(c["inv"], BTreeSet::from(["a".to_string()]));
        assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
        let c = catalog(&mut r, 3);
        assert_eq!(
            c["inv"],
            BTreeSet::from(["a".to_string()]),
            "an emptied service keeps its last list, as it keeps its route"
        );
    }

    #[test]
    fn a_reset_admits_again_only_the_instances_that_changed() {
        let mut r = reg();
        let key = "/mcp/services/inv/i-1";
        let sk = ServiceKey {
            service: "inv".into(),
            instance: "i-1".into(),
        };
        r.put(key, V1, 7, 2, 2).unwrap();
        let admitted = |r: &Registry| Arc::clone(&r.instance(&sk).unwrap().json);
        let first = admitted(&r);

        let read = r.reset([(key, V1, 7, 2, 2)], 9);
        assert!(read.rejected.is_empty() && read.kept.is_empty());
        assert!(
            Arc::ptr_eq(&first, &admitted(&r)),
            "unchanged: left as it was"
        );

        // Other bytes at the same revisions (an etcd restored from a snapshot can reuse them):
        // the value decides, and the new one is admitted.
        let moved: &[u8] = br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9002","tools":["a"]}"#;
        r.reset([(key, moved, 7, 2, 2)], 10);
        assert_eq!(r.instance(&sk).unwrap().addr().port(), 9002);
        // A new lease alone is a change too: the lease is what the instance lives by.
        r.reset([(key, moved, 8, 2, 2)], 11);
        assert_eq!(r.instance(&sk).unwrap().lease, 8);
        // And what a read no longer has is gone, its probe stopped.
        r.take_dirty();
        r.reset(std::iter::empty(), 12);
        assert_eq!(r.instance_count(), 0);
        assert!(r.take_dirty().contains(&sk));
    }

    #[test]
    fn reset_replaces_everything() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002"}"#;
        let read = r.reset(
            [
                ("/mcp/services/fin/i-2", v2, 1, 5, 5),
                ("/mcp/services/fin/bad", &b"x"[..], 1, 5, 5),
            ],
            9,
        );
        assert_eq!(read.rejected.len(), 1);
        assert!(read.kept.is_empty(), "fin/bad never had a good value");
        assert_eq!(r.revision(), 9);
        assert_eq!(r.instance_count(), 1);
        let snap = r.routing(1, Instant::now());
        assert_eq!(snap.services["fin"].endpoints[0].instance_id, "i-2");
    }

    #[test]
    fn a_reset_keeps_the_last_good_value_of_every_key_invalid_in_the_read() {
        let mut r = reg();
        let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002"}"#;
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/services/inv/i-2", v2, 7, 3, 3).unwrap();
        r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 4, 4)
            .unwrap();
        r.put(
            "/mcp/overrides/inv/a",
            br#"{"mode":"force_open","reason":"maintenance"}"#,
            0,
            5,
            5,
        )
        .unwrap();
        let read = r.reset(
            [
                ("/mcp/overrides/inv/a", &b"{"[..], 0, 9, 9),
                ("/mcp/policies/inv", br#"{"max_requests":0}"#, 0, 9, 9),
                ("/mcp/services/inv/i-1", b"garbage", 7, 9, 9),
                // i-2 is gone from etcd: deleted, not invalid.
                ("/mcp/services/inv/i-3", b"garbage", 7, 9, 9),
            ],
            9,
        );
        assert_eq!(read.rejected.len(), 4);
        assert_eq!(
            read.kept,
            vec![
                "/mcp/overrides/inv/a".to_string(),
                "/mcp/policies/inv".to_string(),
                "/mcp/services/inv/i-1".to_string(),
            ],
            "i-3 never had a good value"
        );
        let snap = r.routing(1, Instant::now());
        let ids: Vec<&str> = snap.services["inv"]
            .endpoints
            .iter()
            .map(|e| e.instance_id.as_str())
            .collect();
        assert_eq!(ids, ["i-1"], "i-1 keeps its last good value; i-2 left");
        assert_eq!(snap.services["inv"].limits.max_requests, 7);
        assert_eq!(r.overrides().len(), 1);
        assert_eq!(
            r.find_by_addr("inv", "127.0.0.1:9001".parse().unwrap())
                .map(|k| k.instance.as_str()),
            Some("i-1")
        );
    }

    #[test]
    fn health_decides_what_envoy_gets_and_survives_a_resync() {
        use crate::health::machine::ProbeResult;
        let probed = Arc::new(HealthConfig::default());
        let mut r = Registry::with_health(KeyLayout::default(), probed.clone());
        let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002","weight":3}"#;
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/services/inv/i-2", v2, 7, 3, 3).unwrap();
        let dirty = r.take_dirty();
        assert_eq!(dirty.len(), 2, "both need a probe task");
        let routed = |r: &mut Registry| {
            r.routing(1, Instant::now()).services["inv"]
                .endpoints
                .clone()
        };
        assert!(routed(&mut r).is_empty(), "UNKNOWN is not routed");

        let pass = || ProbeResult {
            at: SystemTime::now(),
            ok: true,
            latency_ms: 1.0,
            detail: "HTTP 200".into(),
            refused: false,
            restarted: false,
        };
        let now = Instant::now();
        let k1 = ServiceKey {
            service: "inv".into(),
            instance: "i-1".into(),
        };
        let k2 = ServiceKey {
            service: "inv".into(),
            instance: "i-2".into(),
        };
        r.health_mut(&k1).unwrap().on_probe(pass(), now, &probed);
        r.health_mut(&k2).unwrap().on_probe(pass(), now, &probed);
        let bad = crate::health::machine::CallCounts {
            http_5xx: 20,
            ..Default::default()
        };
        r.health_mut(&k2).unwrap().on_calls(&bad, now, &probed);
        let eps = routed(&mut r);
        assert_eq!(eps[0].weight, WEIGHT_SCALE, "UP: the registered weight");
        assert_eq!(eps[1].health, EndpointHealth::Healthy);
        assert_eq!(eps[1].weight, 3 * WEIGHT_SCALE / 10, "UNHEALTHY: a tenth");

        // A resync with the same registrations keeps their states and asks for no new task.
        r.reset(
            [
                ("/mcp/services/inv/i-1", V1, 8, 4, 4),
                ("/mcp/services/inv/i-2", v2, 8, 4, 4),
            ],
            4,
        );
        assert!(r.take_dirty().is_empty());
        assert_eq!(routed(&mut r).len(), 2);
        // The same key at a new address is a new server: UNKNOWN again.
        r.put(
            "/mcp/services/inv/i-1",
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9009"}"#,
            8,
            5,
            5,
        )
        .unwrap();
        assert_eq!(
            r.take_dirty().into_iter().collect::<Vec<_>>(),
            vec![k1.clone()]
        );
        assert_eq!(routed(&mut r).len(), 1);
        assert_eq!(
            r.find_by_addr("inv", "127.0.0.1:9009".parse().unwrap()),
            Some(&k1)
        );
        assert_eq!(
            r.find_by_addr("inv", "127.0.0.1:9001".parse().unwrap()),
            None
        );
    }

    #[test]
    fn the_offline_listings_follow_names_and_definitions_and_nothing_else() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        let listings = |r: &mut Registry| -> (Value, Arc<str>) {
            let sent = r.routing(1, Instant::now()).filter_config;
            let v: Value = serde_json::from_str(&sent).unwrap();
            (v["offline_listings"].clone(), sent)
        };
        let (first, _) = listings(&mut r);
        assert_eq!(first["default"][0]["name"], "inv__a");
        assert_eq!(first["default"][0]["description"], offline::NOT_READ);
        // The catalog read the definition: listed as read.
        let def = serde_json::json!({"name": "a", "description": "Does a.",
            "inputSchema": {"type": "object", "properties": {"x": {"type": "number"}}}});
        assert!(r.set_definitions("inv", Some(vec![def.clone()])));
        assert!(
            !r.set_definitions("inv", Some(vec![def])),
            "the same read again"
        );
        let (read, sent) = listings(&mut r);
        assert_eq!(read["default"][0]["description"], "Does a.");
        assert_eq!(
            read["default"][0]["inputSchema"]["properties"]["x"]["type"],
            "number"
        );
        // A fleet opening changes the configuration but not the listings (not made again).
        let made = r.filter_made().config;
        let before = r.offline_listings(&r.virtual_routes());
        r.put(
            "/mcp/breakers/inv/a",
            br#"{"until_ms":99999999999999,"opened_by":"gw","opened_at_ms":1}"#,
            0,
            9,
            9,
        )
        .unwrap();
        let (after, sent_after) = listings(&mut r);
        assert_ne!(sent, sent_after);
        assert!(!Arc::ptr_eq(&made, &r.filter_made().config));
        assert!(Arc::ptr_eq(
            &before,
            &r.offline_listings(&r.virtual_routes())
        ));
        assert_eq!(read, after);
        assert!(
            after["default"][0].get("_meta").is_none(),
            "no availability"
        );
        // Nothing read and no names: no field at all.
        let empty = reg();
        assert!(!empty.filter_made().json.contains("offline_listings"));
    }

    pub(super) fn instance(id: &str, port: u16, tools: &[&str]) -> Vec<u8> {
        serde_json::json!({"instance_id": id, "endpoint": format!("127.0.0.1:{port}"), "tools": tools})
            .to_string()
            .into_bytes()
    }

    fn published(r: &mut Registry) -> FilterConfig {
        serde_json::from_str(&r.routing(1, Instant::now()).filter_config).unwrap()
    }

    const BARE: &[u8] = br#"{"naming":"bare"}"#;

    #[test]
    fn the_kept_filter_configuration_follows_every_input() {
        let mut r = reg();
        let mut generation = 0;
        // After each change: what the publish sends is what a registry without a memo makes.
        let mut check = |r: &mut Registry, what: &str| -> Arc<str> {
            generation += 1;
            let sent = r.routing(generation, Instant::now()).filter_config;
            let fresh = r.clone().filter_made().json;
            assert_eq!(&*sent, &*fresh, "after {what}");
            sent
        };
        r.put(
            "/mcp/services/inv/i-1",
            &instance("i-1", 9001, &["a"]),
            7,
            2,
            2,
        )
        .unwrap();
        check(&mut r, "a first service");
        r.put(
            "/mcp/services/pay/i-1",
            &instance("i-1", 9101, &["a"]),
            7,
            3,
            3,
        )
        .unwrap();
        let before = check(&mut r, "a second service with a contested name");
        r.put(
            "/mcp/services/inv/i-2",
            &instance("i-2", 9002, &["a"]),
            7,
            4,
            4,
        )
        .unwrap();
        let same = check(&mut r, "an instance that changes no input");
        assert!(Arc::ptr_eq(&before, &same), "kept, not made again");
        r.put(
            "/mcp/services/inv/i-3",
            &instance("i-3", 9003, &["a", "b"]),
            7,
            5,
            5,
        )
        .unwrap();
        check(&mut r, "a new tool");
        r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 6, 6)
            .unwrap();
        check(&mut r, "a policy");
        r.put(
            "/mcp/overrides/inv/a",
            br#"{"mode":"force_open","reason":"maintenance"}"#,
            0,
            7,
            7,
        )
        .unwrap();
        check(&mut r, "an override");
        r.put("/mcp/virtual/ops", BARE, 0, 8, 8).unwrap();
        check(&mut r, "a virtual server");
        // inv's oldest instance leaves: pay becomes the older service and keeps the bare name.
        assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
        assert_eq!(r.delete("/mcp/services/inv/i-2"), Ok(true));
        check(&mut r, "a service growing younger");
        assert!(r.set_legacy_revision("pay", Some("2025-06-18".into())));
        check(&mut r, "a legacy revision");
        assert_eq!(r.delete("/mcp/overrides/inv/a"), Ok(true));
        check(&mut r, "an override lifted");
        assert_eq!(r.delete("/mcp/policies/inv"), Ok(true));
        check(&mut r, "a policy removed");
        r.put(
            "/mcp/services/solo/i-1",
            &instance("i-1", 9201, &["z"]),
            7,
            10,
            10,
        )
        .unwrap();
        let before = check(&mut r, "a service with a tool nobody else has");
        r.put(
            "/mcp/services/solo/i-2",
            &instance("i-2", 9202, &["z"]),
            7,
            11,
            11,
        )
        .unwrap();
        assert_eq!(r.delete("/mcp/services/solo/i-1"), Ok(true));
        let same = check(&mut r, "an age that decides no name");
        assert!(Arc::ptr_eq(&before, &same), "kept, not made again");
        let kvs = [(
            "/mcp/services/pay/i-1",
            &instance("i-1", 9101, &["c"])[..],
            7,
            3,
            9,
        )];
        r.reset(kvs.iter().map(|(k, v, l, c, m)| (*k, *v, *l, *c, *m)), 9);
        check(&mut r, "a full resync");
    }

    #[test]
    fn the_filters_learn_the_legacy_services_while_they_exist() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        assert!(published(&mut r).legacy_revisions.is_empty());
        assert!(r.set_legacy_revision("inv", Some("2025-06-18".into())));
        assert!(!r.set_legacy_revision("inv", Some("2025-06-18".into())));
        assert_eq!(
            published(&mut r)
                .legacy_revisions
                .get("inv")
                .map(String::as_str),
            Some("2025-06-18")
        );
        // Not for a service the registry does not have.
        assert!(r.set_legacy_revision("gone", Some("2025-06-18".into())));
        assert!(!published(&mut r).legacy_revisions.contains_key("gone"));
        assert!(r.set_legacy_revision("inv", None));
        assert!(published(&mut r).legacy_revisions.is_empty());
    }

    #[test]
    fn a_service_registered_without_tools_gets_the_names_its_server_listed() {
        let mut r = reg();
        r.put(
            "/mcp/services/bare/i-1",
            &instance("i-1", 9001, &[]),
            7,
            2,
            2,
        )
        .unwrap();
        r.put(
            "/mcp/services/inv/i-1",
            &instance("i-1", 9002, &["a"]),
            7,
            3,
            3,
        )
        .unwrap();
        assert_eq!(published(&mut r).catalog["bare"], BTreeSet::new());
        let listed = BTreeSet::from(["fail_order".to_string(), "read_order".to_string()]);
        assert!(r.set_discovered_tools("bare", Some(listed.clone())));
        assert!(!r.set_discovered_tools("bare", Some(listed.clone())));
        assert_eq!(published(&mut r).catalog["bare"], listed);
        // A service whose registrations list tools keeps its registered list.
        assert!(r.set_discovered_tools("inv", Some(listed.clone())));
        assert_eq!(
            published(&mut r).catalog["inv"],
            BTreeSet::from(["a".to_string()])
        );
        assert!(r.set_discovered_tools("bare", None));
        assert_eq!(published(&mut r).catalog["bare"], BTreeSet::new());
    }

    #[test]
    fn virtual_servers_are_admitted_whole_or_not_at_all() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        let config = published(&mut r);
        assert_eq!(
            config.virtual_servers["default"].tools["inv__a"].tool, "a",
            "the built-in default: every tool, prefixed"
        );
        assert_eq!(r.put("/mcp/virtual/ops", BARE, 0, 3, 3), Ok(true));
        assert_eq!(
            r.put("/mcp/virtual/ops", BARE, 0, 3, 4),
            Ok(false),
            "same definition"
        );
        // Naming a service that is not registered (yet) is admitted.
        let later = br#"{"services":["inv","billing"]}"#;
        assert_eq!(r.put("/mcp/virtual/later", later, 0, 5, 5), Ok(true));
        for (key, value, reason, field) in [
            (
                "/mcp/virtual/ops",
                &br#"{"include":["a/b/c"]}"#[..],
                "bad_virtual",
                "include[0]",
            ),
            (
                "/mcp/virtual/ops",
                br#"{"exlude":["x"]}"#,
                "bad_virtual",
                "exlude",
            ),
            ("/mcp/virtual/ops", b"{not json", "bad_virtual", "value"),
            (
                "/mcp/virtual/ops",
                br#"{"services":["ok","bad name"]}"#,
                "bad_virtual",
                "services[1]",
            ),
            ("/mcp/virtual/b d", BARE, "bad_key", "b d"),
        ] {
            let err = r.put(key, value, 0, 6, 6).unwrap_err();
            assert_eq!((err.reason, err.key.as_str()), (reason, key));
            assert!(err.detail.contains(field), "{field}: {}", err.detail);
            assert_eq!(
                r.check(key, value),
                Err(err),
                "check refuses what the watch refuses"
            );
        }
        assert_eq!(r.check("/mcp/virtual/ops", BARE), Ok(()));
        let config = published(&mut r);
        assert_eq!(
            config.virtual_servers["ops"].tools["a"].service, "inv",
            "the last good definition stays"
        );
        assert!(config.virtual_servers["later"].tools.contains_key("inv__a"));
        assert_eq!(r.delete("/mcp/virtual/ops"), Ok(true));
        assert_eq!(r.delete("/mcp/virtual/ops"), Ok(false));
        assert!(!published(&mut r).virtual_servers.contains_key("ops"));
    }

    #[test]
    fn the_older_service_keeps_a_contested_bare_name() {
        let mut r = reg();
        r.put("/mcp/virtual/default", BARE, 0, 1, 1).unwrap();
        // zeta registered first although alpha sorts first.
        r.put(
            "/mcp/services/zeta/z-1",
            &instance("z-1", 9001, &["search"]),
            1,
            10,
            10,
        )
        .unwrap();
        r.put(
            "/mcp/services/alpha/a-1",
            &instance("a-1", 9002, &["search"]),
            1,
            20,
            20,
        )
        .unwrap();
        let names = |r: &mut Registry| -> Vec<(String, String)> {
            published(r).virtual_servers["default"]
                .tools
                .iter()
                .map(|(name, t)| (name.clone(), t.service.clone()))
                .collect()
        };
        let before = names(&mut r);
        assert_eq!(
            before,
            [
                ("alpha__search".to_string(), "alpha".to_string()),
                ("search".to_string(), "zeta".to_string())
            ]
        );
        // A third service with the same tool changes nothing of the others' names.
        r.put(
            "/mcp/services/beta/b-1",
            &instance("b-1", 9003, &["search"]),
            1,
            30,
            30,
        )
        .unwrap();
        let after = names(&mut r);
        assert!(before.iter().all(|n| after.contains(n)), "{after:?}");
        assert!(after.contains(&("beta__search".to_string(), "beta".to_string())));

        // An overwrite keeps the key's create revision; a second, younger instance does not
        // make its service younger.
        r.put(
            "/mcp/services/zeta/z-1",
            &instance("z-1", 9001, &["search"]),
            2,
            10,
            40,
        )
        .unwrap();
        r.put(
            "/mcp/services/zeta/z-2",
            &instance("z-2", 9004, &["search"]),
            2,
            41,
            41,
        )
        .unwrap();
        assert_eq!(r.service_ages()["zeta"], 10);
        // The oldest instance leaves: until the fleet recorded its age (see
        // `a_recorded_age_keeps_a_contested_name_across_a_re_registration`), the service is as
        // old as its oldest live key.
        assert_eq!(r.delete("/mcp/services/zeta/z-1"), Ok(true));
        assert_eq!(r.service_ages()["zeta"], 41);
        // zeta is now the younger: alpha takes the bare name.
        let n = names(&mut r);
        assert!(
            n.contains(&("search".to_string(), "alpha".to_string())),
            "{n:?}"
        );
        assert!(
            n.contains(&("zeta__search".to_string(), "zeta".to_string())),
            "{n:?}"
        );
        // An emptied service keeps its last age, and with it its names, while it is known.
        assert_eq!(r.delete("/mcp/services/alpha/a-1"), Ok(true));
        assert_eq!(r.service_ages()["alpha"], 20);
        assert!(names(&mut r).contains(&("search".to_string(), "alpha".to_string())));
    }

    #[test]
    fn a_recorded_age_keeps_a_contested_name_across_a_re_registration() {
        let mut r = reg();
        let wanted = r.ages_wanted();
        r.put("/mcp/virtual/default", BARE, 0, 1, 1).unwrap();
        r.put(
            "/mcp/services/zeta/z-1",
            &instance("z-1", 9001, &["search"]),
            1,
            10,
            10,
        )
        .unwrap();
        r.put(
            "/mcp/services/alpha/a-1",
            &instance("a-1", 9002, &["search"]),
            1,
            20,
            20,
        )
        .unwrap();
        // Both are to be recorded, at the ages their keys give.
        assert_eq!(
            r.unrecorded_ages(),
            [("alpha".to_string(), 20), ("zeta".to_string(), 10)]
        );
        assert!(futures::FutureExt::now_or_never(wanted.notified()).is_some());
        for (service, revision) in [("zeta", 10), ("alpha", 20)] {
            let key = format!("/mcp/service-ages/{service}");
            let value = format!(r#"{{"revision":{revision}}}"#);
            assert_eq!(r.put(&key, value.as_bytes(), 0, 30, 30), Ok(false));
        }
        assert!(r.unrecorded_ages().is_empty());
        let bare = |r: &mut Registry| {
            published(r).virtual_servers["default"].tools["search"]
                .service
                .clone()
        };
        assert_eq!(bare(&mut r), "zeta");
        // zeta's registrar stops and registers again: new keys, younger than alpha's.
        assert_eq!(r.delete("/mcp/services/zeta/z-1"), Ok(true));
        r.put(
            "/mcp/services/zeta/z-2",
            &instance("z-2", 9003, &["search"]),
            2,
            40,
            40,
        )
        .unwrap();
        assert_eq!(r.service_ages()["zeta"], 10, "the recorded age");
        assert_eq!(bare(&mut r), "zeta", "the bare name stays");
        // A resync and a restart from the state snapshot keep it.
        let values = r.raw_values();
        assert!(values
            .iter()
            .any(|(k, v)| k == "/mcp/service-ages/zeta" && v == r#"{"revision":10}"#));
        let mut restarted = reg();
        restarted.reset(
            values
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_bytes(), 0, 0, 0)),
            41,
        );
        assert_eq!(bare(&mut restarted), "zeta");
        // A bad value is refused; the last good age stays.
        let err = r
            .put(
                "/mcp/service-ages/zeta",
                br#"{"revision":"old"}"#,
                0,
                42,
                42,
            )
            .unwrap_err();
        assert_eq!(err.reason, "bad_service_age");
        assert_eq!(r.service_ages()["zeta"], 10);
        // An operator deletes it: it is recorded again from the instance keys.
        assert_eq!(r.delete("/mcp/service-ages/zeta"), Ok(true));
        assert_eq!(r.unrecorded_ages(), [("zeta".to_string(), 40)]);
        assert_eq!(bare(&mut r), "alpha");
    }

    #[test]
    fn the_state_snapshot_keeps_virtual_servers_and_service_ages() {
        let mut r = reg();
        r.put(
            "/mcp/services/zeta/z-1",
            &instance("z-1", 9001, &["search"]),
            1,
            10,
            12,
        )
        .unwrap();
        r.put(
            "/mcp/services/alpha/a-1",
            &instance("a-1", 9002, &["search"]),
            1,
            20,
            20,
        )
        .unwrap();
        r.put("/mcp/virtual/default", BARE, 0, 21, 21).unwrap();
        let values = r.raw_values();
        let created = r.create_revisions();
        assert!(values
            .iter()
            .any(|(k, v)| k == "/mcp/virtual/default" && v.as_bytes() == BARE));
        assert_eq!(created["/mcp/services/zeta/z-1"], 10);

        // A restart serving the snapshot (leases and mod revisions unknown).
        let mut restarted = reg();
        restarted.reset(
            values.iter().map(|(k, v)| {
                (
                    k.as_str(),
                    v.as_bytes(),
                    0,
                    created.get(k).copied().unwrap_or(0),
                    0,
                )
            }),
            21,
        );
        assert_eq!(
            published(&mut restarted).virtual_servers,
            published(&mut r).virtual_servers
        );
        assert_eq!(
            published(&mut restarted).virtual_servers["default"].tools["search"].service,
            "zeta"
        );
        // A resync whose read holds a bad definition keeps the last good one.
        let read = restarted.reset(
            values.iter().map(|(k, v)| {
                let v = if k.contains("/virtual/") {
                    &b"{\"naming\":1}"[..]
                } else {
                    v.as_bytes()
                };
                (k.as_str(), v, 0, created.get(k).copied().unwrap_or(0), 0)
            }),
            22,
        );
        assert_eq!(read.kept, ["/mcp/virtual/default".to_string()]);
        assert_eq!(read.rejected[0].reason, "bad_virtual");
        assert_eq!(
            published(&mut restarted).virtual_servers["default"].tools["search"].service,
            "zeta"
        );
    }

    const AUTH: &[u8] = br#"{"resource": "http://127.0.0.1:10000/",
        "authorization_servers": ["http://127.0.0.1:9000"], "required": ["inv"],
        "issuers": [{"issuer": "http://127.0.0.1:9000",
                     "jwks": {"remote": {"uri": "http://127.0.0.1:9000/jwks.json"}}}]}"#;
    const READERS: &[u8] = br#"{"rules": [{"tools": ["read_*"], "roles": ["reader"]}]}"#;

    #[test]
    fn an_auth_configuration_is_admitted_and_shared_while_unchanged() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        assert!(r.auth_config().is_none());
        assert!(
            published(&mut r).auth.is_none(),
            "no configuration: no auth"
        );
        assert!(r.routing(1, Instant::now()).auth.is_none());
        assert_eq!(r.put("/mcp/auth/config", AUTH, 0, 3, 3), Ok(true));
        assert_eq!(
            r.auth_config().map(|c| c.resource.as_str()),
            Some("http://127.0.0.1:10000")
        );
        let first = r
            .routing(2, Instant::now())
            .auth
            .expect("auth in the snapshot");
        assert!(first.requires("inv"));
        // The same configuration, even written differently, changes nothing.
        let respaced = String::from_utf8_lossy(AUTH).replace("\n", " ");
        assert_eq!(
            r.put("/mcp/auth/config", respaced.as_bytes(), 0, 3, 4),
            Ok(false)
        );
        let second = r.routing(3, Instant::now()).auth.expect("still there");
        assert!(
            Arc::ptr_eq(&first, &second),
            "an unchanged config keeps its Arc"
        );
        let auth = published(&mut r).auth.expect("the filter's share");
        assert_eq!(auth.resource, "http://127.0.0.1:10000");
        assert_eq!(auth.required, ["inv"]);
        assert!(auth.resource_audience.contains("http://127.0.0.1:9000"));
        // A resync reading the same configuration keeps the Arc too.
        let values = r.raw_values();
        r.reset(
            values
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_bytes(), 7, 2, 2)),
            9,
        );
        let third = r.routing(4, Instant::now()).auth.expect("after the reset");
        assert!(Arc::ptr_eq(&first, &third), "a reset that changed nothing");
    }

    #[test]
    fn a_bad_auth_value_is_rejected_and_the_last_good_one_kept() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/auth/config", AUTH, 0, 3, 3).unwrap();
        r.put("/mcp/auth/rules/inv", READERS, 0, 4, 4).unwrap();
        let bad_config = br#"{"resource": "http://gw", "authorization_servers": ["http://idp"],
            "issuers": [{"issuer": "i", "jwks": {"remote": {"uri": "ftp://x"}}}]}"#;
        for (key, value, reason, field) in [
            (
                "/mcp/auth/config",
                &bad_config[..],
                "bad_auth",
                "issuers[0].jwks.remote.uri",
            ),
            ("/mcp/auth/config", b"{not json", "bad_auth", "value"),
            (
                "/mcp/auth/rules/inv",
                br#"{"rules": [{"tools": ["a"]}]}"#,
                "bad_auth",
                "rules[0]",
            ),
            (
                "/mcp/auth/virtual/ops",
                br#"{"rules": [{"tools": ["a"], "role": ["x"]}]}"#,
                "bad_auth",
                "rules[0].role",
            ),
            ("/mcp/auth/rules/in v", READERS, "bad_key", "in v"),
            ("/mcp/auth/other", READERS, "bad_key", "other"),
        ] {
            let err = r.put(key, value, 0, 5, 5).unwrap_err();
            assert_eq!((err.reason, err.key.as_str()), (reason, key));
            assert!(err.detail.contains(field), "{field}: {}", err.detail);
            assert_eq!(
                r.check(key, value),
                Err(err),
                "check refuses what the watch refuses"
            );
        }
        assert_eq!(r.check("/mcp/auth/config", AUTH), Ok(()));
        let auth = published(&mut r).auth.expect("the last good configuration");
        assert_eq!(auth.resource, "http://127.0.0.1:10000");
        assert_eq!(auth.services["inv"].rules[0].roles, ["reader"]);
        assert!(auth.virtual_servers.is_empty());

        // A resync whose read holds bad values keeps the last good ones as well.
        let read = r.reset(
            [
                ("/mcp/auth/config", &bad_config[..], 0, 9, 9),
                ("/mcp/auth/rules/inv", b"[]", 0, 9, 9),
                ("/mcp/auth/virtual/ops", b"{", 0, 9, 9),
                ("/mcp/services/inv/i-1", V1, 7, 2, 2),
            ],
            9,
        );
        let reasons: Vec<&str> = read.rejected.iter().map(|r| r.reason).collect();
        assert_eq!(reasons, ["bad_auth", "bad_auth", "bad_auth"]);
        assert_eq!(
            read.kept,
            [
                "/mcp/auth/config".to_string(),
                "/mcp/auth/rules/inv".to_string()
            ],
            "ops never had a good rule set"
        );
        let auth = published(&mut r).auth.expect("kept across the reset");
        assert_eq!(auth.resource, "http://127.0.0.1:10000");
        assert!(auth.services.contains_key("inv"));
        assert!(r.routing(2, Instant::now()).auth.is_some());
    }

    #[test]
    fn rule_sets_reach_the_filter_with_a_configuration_and_leave_on_delete() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/virtual/ops", BARE, 0, 3, 3).unwrap();
        // A rule set for a service not registered (yet) is admitted, as are rule sets before
        // any configuration: kept, but not sent (nothing would check the callers).
        assert_eq!(r.put("/mcp/auth/rules/billing", READERS, 0, 4, 4), Ok(true));
        assert_eq!(r.put("/mcp/auth/rules/inv", READERS, 0, 5, 5), Ok(true));
        assert_eq!(r.put("/mcp/auth/rules/inv", READERS, 0, 5, 6), Ok(false));
        assert_eq!(r.put("/mcp/auth/virtual/ops", READERS, 0, 6, 6), Ok(true));
        assert!(published(&mut r).auth.is_none());
        assert_eq!(r.auth_service_rules().count(), 2);
        r.put("/mcp/auth/config", AUTH, 0, 7, 7).unwrap();
        let auth = published(&mut r).auth.expect("configured");
        let services: Vec<&String> = auth.services.keys().collect();
        assert_eq!(services, ["billing", "inv"]);
        assert_eq!(
            auth.virtual_servers["ops"],
            ToolRules::parse(READERS).unwrap()
        );
        assert!(auth.requires("inv") && !auth.requires("ops"));

        assert_eq!(r.delete("/mcp/auth/rules/billing"), Ok(true));
        assert_eq!(
            r.delete("/mcp/auth/rules/billing"),
            Ok(false),
            "already gone"
        );
        assert_eq!(r.delete("/mcp/auth/virtual/ops"), Ok(true));
        let auth = published(&mut r).auth.expect("configured");
        assert_eq!(auth.services.keys().collect::<Vec<_>>(), ["inv"]);
        assert!(auth.virtual_servers.is_empty());
        assert_eq!(r.delete("/mcp/auth/config"), Ok(true));
        assert_eq!(r.delete("/mcp/auth/config"), Ok(false));
        assert!(r.auth_config().is_none());
        assert!(published(&mut r).auth.is_none());
        assert!(r.routing(9, Instant::now()).auth.is_none());
        assert_eq!(r.auth_service_rules().count(), 1, "the rules stay, unused");
    }

    #[test]
    fn claim_header_names_reach_the_filter_with_or_without_a_configuration() {
        let mut r = reg();
        let with_claims = |header: &str| {
            format!(
                r#"{{"rules": [{{"tools": ["*"], "subjects": ["*"]}}],
                     "claim_headers": {{"sub": "{header}", "email": "X-Mail"}}}}"#
            )
        };
        r.put(
            "/mcp/auth/rules/inv",
            with_claims("X-Caller").as_bytes(),
            0,
            2,
            2,
        )
        .unwrap();
        r.put(
            "/mcp/auth/virtual/ops",
            with_claims("x_user").as_bytes(),
            0,
            3,
            3,
        )
        .unwrap();
        let config = published(&mut r);
        assert!(config.auth.is_none(), "no configuration");
        let names: Vec<&str> = config
            .claim_header_names
            .iter()
            .map(String::as_str)
            .collect();
        assert_eq!(names, ["x-caller", "x-mail", "x_user"]);
        r.put("/mcp/auth/config", AUTH, 0, 4, 4).unwrap();
        assert_eq!(published(&mut r).claim_header_names.len(), 3);
        assert_eq!(r.delete("/mcp/auth/virtual/ops"), Ok(true));
        assert_eq!(r.delete("/mcp/auth/rules/inv"), Ok(true));
        assert!(published(&mut r).claim_header_names.is_empty());
    }

    #[test]
    fn the_state_snapshot_keeps_the_auth_values() {
        let mut r = reg();
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/auth/config", AUTH, 0, 3, 3).unwrap();
        r.put("/mcp/auth/rules/inv", READERS, 0, 4, 4).unwrap();
        r.put("/mcp/auth/virtual/default", READERS, 0, 5, 5)
            .unwrap();
        let values = r.raw_values();
        for key in [
            "/mcp/auth/config",
            "/mcp/auth/rules/inv",
            "/mcp/auth/virtual/default",
        ] {
            assert!(values.iter().any(|(k, _)| k == key), "{key}");
        }
        let mut restarted = reg();
        let read = restarted.reset(
            values
                .iter()
                // The instance's lease as etcd would give it: the fingerprint compares leases.
                .map(|(k, v)| (k.as_str(), v.as_bytes(), 7, 2, 2)),
            5,
        );
        assert!(read.rejected.is_empty(), "{:?}", read.rejected);
        assert_eq!(published(&mut restarted).auth, published(&mut r).auth);
        assert_eq!(restarted.fingerprint(), r.fingerprint());
    }
}
