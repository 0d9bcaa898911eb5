//! The registry: every valid instance under `<prefix>services/`, folded from etcd's Get and
//! Watch into one map, and turned into a [`RoutingSnapshot`] for the xDS side.
//!
//! Invalid values are rejected here with their key and a reason; they never remove a valid
//! instance's last good value and never empty a service.
//!
//! [`Registry`] is the one facade: [`Registry::put`], [`Registry::delete`] and
//! [`Registry::reset`] (here) send each key to the part it belongs to: `instances` (and the
//! routing snapshot), `policy_keys`, `fleet_keys` (openings and overrides), `virtual_keys`,
//! `auth_keys`, `service_ages`, `limits`; `filter_made` makes the filters' configuration from
//! all of them, `snapshot` shows the whole for the state file, the admin API and the console.

pub mod admission;
pub mod ages;
pub mod auth;
mod auth_keys;
mod controls;
mod filter_made;
mod fleet_keys;
mod instances;
mod limits;
mod members;
mod memo;
pub mod offline;
pub mod persist;
mod policies;
mod policy_keys;
pub mod publish;
mod server_catalog;
mod service_ages;
mod snapshot;
mod virtual_keys;

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

use controls::Controls;
use filter_made::*;
pub use fleet_keys::parse_override;
use instances::{InstanceTable, StaleRoutes};
pub use limits::BAD_LIMITS;
use memo::{Memo, Versioned};
use policies::{PolicyKey, PolicyStore, Refusal};
use server_catalog::ServerCatalog;
use service_ages::ServiceAges;
pub use snapshot::{HealthCounts, InstanceView, RegistryView};
use virtual_keys::{OrderKey, VirtualKey};
pub use virtual_keys::{SurfaceRoutes, VirtualOutput};

use crate::health::config::HealthConfig;
use crate::health::machine::{CallCounts, Health, ProbeResult, State};
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

/// Every part of the registry, behind one facade: each part is a concern of its own (the
/// instances, the operators' controls, what the tool catalog read, the services' ages, the
/// virtual servers, auth, the fleet's members), and the publisher reads each.
#[derive(Debug, Clone)]
pub struct Registry {
    layout: KeyLayout,
    revision: i64,
    health: Arc<HealthConfig>,
    endpoints: Arc<admission::EndpointPolicy>,
    request_limits: RequestLimits,
    /// The key the filters seal `Mcp-Session-Id` with (base64), if any.
    session_key: String,
    /// Every valid instance, and the services they make.
    table: InstanceTable,
    /// Each service's route as last built, and which need building again.
    routes: StaleRoutes,
    /// Breaker policies, fleet openings and operator overrides.
    controls: Controls,
    /// What the tool catalog read from the servers, and the tools the filters keep breakers
    /// for.
    catalog: ServerCatalog,
    /// Each service's age, which decides who keeps a contested name.
    ages: ServiceAges,
    /// Virtual servers from `<prefix>virtual/<name>`, as last admitted, with the raw JSON for
    /// the state-dir snapshot.
    virtuals: BTreeMap<String, (VirtualServer, String)>,
    /// The auth configuration and rule sets from `<prefix>auth/`, as last admitted.
    auth: auth::AuthStore,
    /// Call limits from `<prefix>limits/`, as last admitted.
    limits: limits::LimitStore,
    /// The issuers' keys toolgate-xds fetched (not from etcd: see `jwks.rs`).
    fetched_keys: Arc<crate::routing::FetchedKeys>,
    /// The credentials toward servers as last read (see `upstream_credentials.rs`).
    upstream_credentials: Arc<crate::upstream_credentials::InjectedByService>,
    /// The fleet's toolgate-xds (`<prefix>xds/`), and this one's own address: what Envoy's
    /// control cluster holds.
    members: members::Members,
    /// How many Envoys this process serves now (the other toolgate-xds say theirs in
    /// `members`): the fleet's size, which call limits are split by.
    local_envoys: u32,
    /// What the last publish made from the whole, kept until an input changes.
    memo: PublishMemo,
}

/// What a publish makes from the whole registry, kept until one of its inputs changes (see
/// `memo.rs`), and what it logged, so that each thing is logged once, when it appears.
#[derive(Debug, Clone, Default)]
struct PublishMemo {
    offline: Memo<OfflineKey, Arc<offline::OfflineListings>>,
    /// The last [`virtual_routes`](Registry::virtual_routes).
    virtual_routes: Memo<VirtualKey, Arc<VirtualOutput>>,
    order: Memo<OrderKey, Arc<BTreeSet<String>>>,
    /// The last filters' configuration.
    filter: Memo<FilterKey, FilterMade>,
    /// The tools the last publish could not name.
    unnamed: Vec<(String, Unnamed)>,
    /// The last publish had rule sets but no configuration to apply them with.
    auth_rules_unused: bool,
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
            revision: 0,
            health,
            endpoints: Arc::default(),
            request_limits: RequestLimits::default(),
            session_key: String::new(),
            table: InstanceTable::default(),
            routes: StaleRoutes::default(),
            controls: Controls::default(),
            catalog: ServerCatalog::default(),
            ages: ServiceAges::default(),
            virtuals: BTreeMap::new(),
            auth: auth::AuthStore::default(),
            limits: limits::LimitStore::default(),
            fetched_keys: Arc::default(),
            upstream_credentials: Arc::default(),
            members: members::Members::default(),
            local_envoys: 0,
            memo: PublishMemo::default(),
        }
    }

    /// The issuers' keys as last fetched; whether they differ from those held.
    pub fn set_fetched_keys(&mut self, keys: crate::routing::FetchedKeys) -> bool {
        if *self.fetched_keys == keys {
            return false;
        }
        self.fetched_keys = Arc::new(keys);
        true
    }

    /// The credentials toward servers as last read; whether they differ from those held.
    pub fn set_upstream_credentials(
        &mut self,
        credentials: Arc<crate::upstream_credentials::InjectedByService>,
    ) -> bool {
        if *self.upstream_credentials == *credentials {
            return false;
        }
        self.upstream_credentials = credentials;
        true
    }

    /// Where this process's Envoys reach its admin listener, and its key id under
    /// `<prefix>xds/` when it registers itself (its own key is not one of the others).
    pub fn set_control_local(&mut self, own_id: Option<String>, local: SocketAddr) {
        self.members.set_local(own_id, local);
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
        r.controls.policies = self.controls.policies.clone();
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
        self.table.membership.clone()
    }

    /// The instances whose probe target changed since the last call.
    pub fn take_dirty(&mut self) -> BTreeSet<ServiceKey> {
        std::mem::take(&mut self.table.dirty)
    }

    fn mark_dirty(&mut self, key: ServiceKey) {
        self.table.dirty.insert(key);
        self.table.membership.notify_one();
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
        self.table.read_generation += 1;
        let generation = self.table.read_generation;
        let instances_prefix = self.layout.services_prefix();
        let mut kept_instances = BTreeSet::new();
        let mut old_fleet = std::mem::take(&mut self.controls.fleet);
        let mut old_overrides = std::mem::take(&mut self.controls.overrides);
        let mut old_virtuals = std::mem::take(&mut self.virtuals);
        let mut old_ages = std::mem::take(&mut self.ages.recorded);
        let mut old_auth = std::mem::take(&mut self.auth);
        let mut old_limits = std::mem::take(&mut self.limits);
        let mut old_members = self.members.take();
        self.routes.all_stale = true;
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
                let hash = self.table.value_hasher.hash_one(value);
                if let Some(inst) = self.table.instances.get_mut(sk) {
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
                if let Some(inst) = instance.and_then(|sk| self.table.instances.get_mut(&sk)) {
                    if inst.read_mark != generation {
                        inst.read_mark = generation;
                        kept_instances.insert(r.key.clone());
                    }
                }
                rejected.push(r);
            }
        }
        let gone: Vec<ServiceKey> = self
            .table
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
        let (refused, _) = self
            .controls
            .policies
            .reset(policy_read, &policy_present, &base);
        let mut kept = Vec::new();
        for (k, why) in refused {
            let r = self.policy_rejected(&k, why);
            if self.controls.policies.applied().contains_key(&k) {
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
                    .is_ok_and(|k| self.controls.policies.applied().contains_key(&k))
                    && !kept.contains(&r.key)
                {
                    kept.push(r.key.clone());
                }
                continue;
            }
            let restored = if let Ok(id) = self.layout.parse_xds_key(&r.key) {
                self.members.restore(&id, &mut old_members)
            } else if r.key.starts_with(&self.layout.limits_prefix()) {
                self.restore_limits(&r.key, &mut old_limits)
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
        self.ages.wanted.notify_one();
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
                Some(age) => self.ages.recorded.insert(service, age).is_none(),
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
                Some(e) => self.controls.fleet.insert(names, e).is_none(),
                None => false,
            };
        }
        if let Ok(names) = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
        {
            return match overrides.remove(&names) {
                Some(o) => self.controls.overrides.insert(names, o).is_none(),
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
        } else if key.starts_with(&self.layout.limits_prefix()) {
            self.put_limits(key, value)
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

    /// Whether `value` would be admitted at `key` (a policy, an override, a virtual server,
    /// an auth value, limits), without changing anything: the admin API refuses with the same
    /// reason the watch would log.
    pub fn check(&self, key: &str, value: &[u8]) -> Result<(), Rejected> {
        if key.starts_with(&self.layout.virtual_prefix()) {
            return self.admit_virtual(key, value).map(|_| ());
        }
        if key.starts_with(&self.layout.auth_prefix()) {
            return auth::admit(&self.layout, key, value).map(|_| ());
        }
        if key.starts_with(&self.layout.limits_prefix()) {
            return self.admit_limits(key, value).map(|_| ());
        }
        if key.starts_with(&self.layout.policies_prefix()) {
            let (k, (overrides, _)) = self.parse_policy(key, value).map_err(|(_, r)| r)?;
            return self
                .controls
                .policies
                .check_put(&k, &overrides, &self.policy_base())
                .map_err(|why| self.policy_rejected(&k, why));
        }
        let mut scratch = Registry::new(self.layout.clone());
        scratch.put(key, value, 0, 0, 0).map(|_| ())
    }

    /// Every known service (registered now, or before and emptied since), sorted.
    pub fn service_names(&self) -> impl Iterator<Item = &String> {
        self.table.services.keys()
    }

    /// Whether a service is known (registered now, or before and emptied since).
    pub fn has_service(&self, service: &str) -> bool {
        self.table.services.contains_key(service)
    }

    /// Applies a DELETE. `Ok(true)` when an instance, a policy, a virtual server, an auth
    /// value or limits left; refused (the value stays in effect) when it is a policy another
    /// depends on.
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
            self.ages.recorded.remove(&service);
            self.ages.wanted.notify_one();
            return Ok(self.service_age(&service) != before);
        }
        if let Ok(which) = self.layout.parse_auth_key(key) {
            let removed = self.auth.remove(&which);
            if let (true, toolgate_model::keys::AuthKey::Upstream(service)) = (removed, &which) {
                self.mark_stale(service);
            }
            return Ok(removed);
        }
        if let Ok(id) = self.layout.parse_xds_key(key) {
            return Ok(self.members.remove(&id));
        }
        if key.starts_with(&self.layout.limits_prefix()) {
            return Ok(self.delete_limits(key));
        }
        if let Ok(k) = self
            .layout
            .parse_tool_key(&self.layout.breakers_prefix(), key)
        {
            return Ok(self.controls.fleet.remove(&k).is_some());
        }
        if let Ok(k) = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
        {
            return Ok(self.controls.overrides.remove(&k).is_some());
        }
        match self.layout.parse_policy_key(key) {
            Ok(k) => self.delete_policy(key, k),
            Err(_) => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests;
