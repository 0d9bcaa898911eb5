//! The ADS server, incremental variant (`DeltaAggregatedResources`): the protocol half for an
//! Envoy whose bootstrap says `api_type: DELTA_GRPC`. It shares the cache with state of the
//! world (`ads.rs`); what differs is what goes on the wire. Each resource has its own version
//! (its content hash), a push carries only the resources whose version this Envoy does not
//! hold, and a resource that is gone is named in `removed_resources`. So a new service costs
//! one cluster, its assignment and the route configuration, not every cluster again.
//!
//! Envoy's rules that shape the pushes: a cluster that is new or changed warms until it gets an
//! assignment, so every assignment whose cluster was just sent goes again even if its version
//! did not change; and removals go after every update of the push, so a route never points at
//! a cluster that is already gone.
//!
//! One rule of ours: a filter configuration that changed only with services (the catalog, the
//! virtual servers' names, the legacy revisions) goes after the clusters and routes it changed
//! with, once Envoy has answered them. Envoy applies responses one after another on its main
//! thread, and a new cluster takes traffic once its assignment is applied, which Envoy asks for
//! only after it has the cluster: sent beside the cluster and routes, the filter configuration
//! was applied before that assignment. It costs Envoy 9-17 ms (its `update_duration`, p50 at 40
//! and at 1,000 services; 4 ms for a wasm filter that does nothing), and a new service changes
//! it (the catalog), so that was on the path of every new service to its first routed call;
//! now the service is routed first. Until the configuration lands (a few ms later; it
//! already came after the routes before), the filter treats the new service as any service
//! outside its catalog: auth rules and operators' overrides apply, no breaker is created.
//!
//! A configuration in which anything else changed (an operator's override, a policy, an auth
//! rule, a fleet opening: [`TypeSnapshot::urgency`]) never waits, and ends any wait: it goes
//! at once, whole (one ECDS resource cannot be split), new services' catalog included. That
//! costs those services the 9-17 ms above before their first routed call, once; an override
//! held behind a burst of registrations would leave a tool the operator closed open for as
//! long as the burst lasts.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use tracing::{debug, warn};

use super::cache::{resource_hash, CacheSnapshot, TypeSnapshot};
use super::node;
use super::resources::ResourceType;
use super::stream::{control_plane, Closed, Envoy, Protocol, Unanswered};

/// How long a filter configuration that changed only with services waits at most for Envoy to
/// answer the clusters and routes it went with, or the configuration before it (Envoy answers
/// every response; this bounds a stream that stops).
const FILTER_CONFIG_WAIT: Duration = Duration::from_secs(1);

/// A resource's version as Envoy holds it: toolgate's are their content hash, in hex.
type Version = String;

fn version_of(hash: u64) -> Version {
    format!("{hash:016x}")
}

/// Whether `version` is [`version_of`]`(hash)`, without allocating.
fn is_version(version: &str, hash: u64) -> bool {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = version.as_bytes();
    bytes.len() == 16
        && bytes
            .iter()
            .enumerate()
            .all(|(i, b)| *b == HEX[((hash >> (60 - 4 * i)) & 0xf) as usize])
}

/// One resource a response carries.
#[derive(Debug, Clone)]
struct Update {
    name: String,
    version: Version,
    any: Any,
}

/// A resource a response carried (by name), and what Envoy held of it before: restored if
/// Envoy rejects the response.
#[derive(Debug)]
pub(super) struct Carried {
    version: Version,
    before: Option<Version>,
}

/// Protocol state of one type on one delta stream.
#[derive(Debug, Default)]
struct TypeState {
    /// Every resource of the type (CDS's first request with no names, or `*`).
    wildcard: bool,
    /// Resources subscribed by name.
    names: BTreeSet<String>,
    /// What Envoy holds, by name: its `initial_resource_versions`, then what was sent
    /// (taken back if Envoy rejects the response).
    holds: HashMap<String, Version>,
    /// Resources Envoy rejected alone, at the version it rejected: not sent again in that
    /// form (Envoy would reject it again, in a loop); the next change goes out as usual.
    rejected: HashMap<String, Version>,
    /// Resources that were in a rejected response together with others: each goes again in a
    /// response of its own, until Envoy accepts it or rejects it alone, so one invalid
    /// resource cannot hold back the rest.
    suspects: BTreeSet<String>,
    /// EDS: assignments to send even though Envoy holds their version, because their cluster
    /// was just sent and warms until it gets one.
    refresh: BTreeSet<String>,
    /// Envoy waits for a first response per type, even an empty one, before it finishes
    /// initializing.
    owes_first: bool,
    /// The version what this type owes was last worked out against, in full or from an earlier
    /// one, with nothing since that could change it but the responses of that reckoning. What
    /// it owes against a later version is then only among the names that changed between the
    /// two, and the assignments to refresh: a push at 10,000 clusters looks at its own change,
    /// not at every name. `None` after anything else changed the state (a subscription, a
    /// rejection): the next reckoning walks every name.
    reckoned: Option<Arc<TypeSnapshot>>,
}

impl TypeState {
    fn subscribed(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// Applies the subscription changes of a request. The first request of a type brings what
    /// Envoy already holds (a reconnect) and, for CDS, an empty list means a wildcard.
    fn subscribe(&mut self, ty: ResourceType, request: &DeltaDiscoveryRequest, first: bool) {
        if first
            || !request.resource_names_subscribe.is_empty()
            || !request.resource_names_unsubscribe.is_empty()
        {
            self.reckoned = None;
        }
        if first {
            self.owes_first = true;
            self.wildcard =
                ty.empty_names_mean_wildcard() && request.resource_names_subscribe.is_empty();
            self.holds = request
                .initial_resource_versions
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
        }
        for name in &request.resource_names_subscribe {
            if name == "*" {
                self.wildcard = true;
                continue;
            }
            // A name subscribed again after the first request is sent again: Envoy asks
            // because a new watch of its needs it, whatever it held.
            if !first {
                self.holds.remove(name);
            }
            self.names.insert(name.clone());
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                self.wildcard = false;
                continue;
            }
            self.names.remove(name);
            if !self.wildcard {
                // Envoy drops what it unsubscribed: nothing to update or remove later.
                self.holds.remove(name);
                self.rejected.remove(name);
                self.suspects.remove(name);
                self.refresh.remove(name);
            }
        }
    }

    /// Envoy rejected `response`: it holds what it held before of each resource (unless a
    /// later response changed it since), and the resources go again one by one, or not at
    /// all in this form if the response carried only one.
    fn rejected_response(&mut self, response: &Unanswered<Carried>) {
        self.reckoned = None;
        for (name, c) in &response.carried {
            if self.holds.get(name) == Some(&c.version) {
                match &c.before {
                    Some(v) => self.holds.insert(name.clone(), v.clone()),
                    None => self.holds.remove(name),
                };
            }
        }
        match response.carried.as_slice() {
            [(name, one)] => {
                self.suspects.remove(name);
                self.rejected.insert(name.clone(), one.version.clone());
            }
            many => self
                .suspects
                .extend(many.iter().map(|(name, _)| name.clone())),
        }
    }

    fn accepted_response(&mut self, response: &Unanswered<Carried>) {
        for (name, _) in &response.carried {
            self.suspects.remove(name);
        }
    }
}

/// A resource as made for one Envoy, and the hash of what it was made from.
#[derive(Debug)]
struct Tailored {
    source: u64,
    any: Any,
    version: Version,
}

/// What a type owes an Envoy: resources to send and names to remove.
#[derive(Debug, Default)]
struct Pending {
    updates: Vec<Update>,
    removals: Vec<String>,
}

/// The incremental protocol on one stream.
#[derive(Debug, Default)]
pub(super) struct Delta {
    /// Only types the Envoy has asked for: nothing is pushed before it subscribes.
    types: BTreeMap<ResourceType, TypeState>,
    /// Resources made for this Envoy, by type and name (see [`NodeView::tailor`]).
    ///
    /// [`NodeView::tailor`]: super::node::NodeView::tailor
    tailored: HashMap<(ResourceType, String), Tailored>,
    /// The filter's configuration is held (see the module's doc) until Envoy has answered
    /// every CDS and RDS response up to this nonce, or until the deadline.
    filter_config_after: Option<(u64, tokio::time::Instant)>,
    /// The urgency ([`TypeSnapshot::urgency`]) of the filter configuration this Envoy was
    /// last answered with: a configuration whose urgency differs goes at once.
    answered_urgency: Option<u64>,
}

impl Protocol for Delta {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    type Carried = Carried;
    const NAME: &'static str = "delta";

    /// Applies the subscription changes of a request, stale or not: they are changes, not the
    /// whole subscription, and hold whichever response the request was written after.
    fn subscribe(&mut self, ty: ResourceType, request: &DeltaDiscoveryRequest, _stale: bool) {
        let first = !self.types.contains_key(&ty);
        self.types
            .entry(ty)
            .or_default()
            .subscribe(ty, request, first);
    }

    fn accepted(&mut self, ty: ResourceType, answered: &[Unanswered<Carried>]) {
        if let (Some(state), Some(response)) = (self.types.get_mut(&ty), answered.last()) {
            state.accepted_response(response);
        }
    }

    fn rejected(&mut self, ty: ResourceType, answered: &[Unanswered<Carried>]) {
        if let (Some(state), Some(response)) = (self.types.get_mut(&ty), answered.last()) {
            state.rejected_response(response);
        }
    }

    /// Answers the request with what `ty` owes, and releases a held filter configuration if
    /// Envoy has now answered what it waits for.
    async fn answer(
        &mut self,
        envoy: &mut Envoy<Delta>,
        ty: ResourceType,
        _request: &DeltaDiscoveryRequest,
        _stale: bool,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        if matches!(
            ty,
            ResourceType::Cluster | ResourceType::Route | ResourceType::ExtensionConfig
        ) && self.filter_config_due(envoy)
        {
            self.release_filter_config(envoy, view).await?;
        }

        let Some(current) = view.and_then(|v| v.get(ty)) else {
            // Not ready: answered by the push that brings the first view.
            return Ok(());
        };
        let current = Arc::clone(current);
        let deferred = self.send_owed(envoy, ty, &current, true).await?;
        debug_assert!(deferred.is_empty());
        // Clusters sent in answer to a request (a reconnect, a resent suspect) warm until their
        // assignment comes, as after a push: it goes now, not with the next EDS change.
        let refresh_due = self
            .types
            .get(&ResourceType::Endpoint)
            .is_some_and(|eds| !eds.refresh.is_empty());
        if ty == ResourceType::Cluster && refresh_due {
            if let Some(eds) = view.and_then(|v| v.get(ResourceType::Endpoint)) {
                let eds = Arc::clone(eds);
                self.send_owed(envoy, ResourceType::Endpoint, &eds, true)
                    .await?;
            }
        }
        Ok(())
    }

    /// A new cache view: every type's updates in push order (CDS, EDS, RDS, ECDS), then every
    /// type's removals in the same order. The filter's configuration waits if this push sent
    /// clusters or routes (see the module's doc), or an earlier one's still wait.
    async fn push(&mut self, envoy: &mut Envoy<Delta>, view: &CacheSnapshot) -> Result<(), Closed> {
        let mut removals = Vec::new();
        let before = envoy.last_nonce();
        for ty in ResourceType::ALL {
            if !self.types.contains_key(&ty) {
                continue;
            }
            let Some(current) = view.get(ty) else {
                continue;
            };
            if ty == ResourceType::ExtensionConfig {
                if self.answered_urgency != Some(current.urgency) {
                    // An operator's change goes now, and takes whatever waited with it.
                    self.filter_config_after = None;
                } else if self.filter_config_after.is_none() {
                    // Waits for the clusters and routes sent with it, if any (0: none), and
                    // for Envoy's answer to the configuration before it.
                    let after = if routing_unanswered(envoy, |n| n > before) {
                        Some(envoy.last_nonce())
                    } else {
                        filter_config_unanswered(envoy).then_some(0)
                    };
                    self.filter_config_after = after
                        .map(|after| (after, tokio::time::Instant::now() + FILTER_CONFIG_WAIT));
                }
                if self.filter_config_after.is_some() {
                    continue;
                }
            }
            let current = Arc::clone(current);
            let deferred = self.send_owed(envoy, ty, &current, false).await?;
            if !deferred.is_empty() {
                removals.push((ty, current, deferred));
            }
        }
        for (ty, current, names) in removals {
            self.send_response(envoy, ty, &current, Vec::new(), names)
                .await?;
        }
        Ok(())
    }

    /// The hold of the filter's configuration ends at its deadline at the latest.
    fn wake_at(&self) -> Option<tokio::time::Instant> {
        self.filter_config_after.map(|(_, deadline)| deadline)
    }

    async fn woken(
        &mut self,
        envoy: &mut Envoy<Delta>,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        warn!(node = %envoy.node, waited_ms = FILTER_CONFIG_WAIT.as_millis() as u64,
            "Envoy has not answered what a filter configuration waits for (the \
             clusters and routes it came with, or the configuration before it); \
             sending it anyway");
        self.release_filter_config(envoy, view).await
    }
}

/// Whether Envoy has not answered a filter configuration yet. It applies each one whole (9-17
/// ms, more with a large catalog), one after another: while services keep coming, their
/// catalog changes wait for that answer and go as one, so that an operator's change never
/// queues behind a row of them in Envoy.
fn filter_config_unanswered(envoy: &Envoy<Delta>) -> bool {
    envoy
        .unanswered(ResourceType::ExtensionConfig)
        .next()
        .is_some()
}

/// Whether an unanswered CDS or RDS response has a nonce `which` picks.
fn routing_unanswered(envoy: &Envoy<Delta>, which: impl Fn(u64) -> bool) -> bool {
    [ResourceType::Cluster, ResourceType::Route]
        .into_iter()
        .any(|ty| envoy.unanswered(ty).any(|u| which(u.nonce)))
}

impl Delta {
    /// Whether the held filter configuration may go: Envoy answered what it waits for.
    fn filter_config_due(&self, envoy: &Envoy<Delta>) -> bool {
        self.filter_config_after.is_some_and(|(after, _)| {
            !routing_unanswered(envoy, |n| n <= after) && !filter_config_unanswered(envoy)
        })
    }

    /// Ends the hold and sends what the filter's configuration owes against the latest view.
    async fn release_filter_config(
        &mut self,
        envoy: &mut Envoy<Delta>,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        self.filter_config_after = None;
        let ty = ResourceType::ExtensionConfig;
        if !self.types.contains_key(&ty) {
            return Ok(());
        }
        let Some(current) = view.and_then(|v| v.get(ty)) else {
            return Ok(());
        };
        let current = Arc::clone(current);
        self.send_owed(envoy, ty, &current, true).await?;
        Ok(())
    }

    /// What `ty` owes this Envoy against `current`.
    fn pending(
        &mut self,
        envoy: &mut Envoy<Delta>,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
    ) -> Pending {
        let Delta {
            types, tailored, ..
        } = self;
        let Some(state) = types.get_mut(&ty) else {
            return Pending::default();
        };
        let reckoned = state.reckoned.replace(Arc::clone(current));
        let state = &*state;
        // Resources made per Envoy are one or two names: always looked at in full.
        let made_per_envoy = matches!(ty, ResourceType::Route | ResourceType::ExtensionConfig);
        let candidates: Option<BTreeSet<&String>> = reckoned
            .as_ref()
            .filter(|_| !made_per_envoy)
            .map(|earlier| {
                current
                    .changed_since(earlier)
                    .chain(state.refresh.iter())
                    .collect()
            });
        let names: Box<dyn Iterator<Item = &String>> = match &candidates {
            Some(changed) => Box::new(changed.iter().copied().filter(|n| state.subscribed(n))),
            None if state.wildcard => Box::new(current.names()),
            None => Box::new(state.names.iter()),
        };
        let mut pending = Pending::default();
        for name in names {
            if !envoy.node.serves(ty, name) {
                continue;
            }
            let Some((any, hash)) = current.entry(name) else {
                continue;
            };
            // A resource made for this Envoy (its filter configuration, a shard's routes) has
            // the version of the bytes it gets: a change elsewhere that leaves them alone is
            // not sent. Made again only when its source changes, not on every push.
            if !made_per_envoy {
                // Thousands of names per push at scale: compare without copying the resource
                // or formatting its version unless it goes out.
                let is = |v: Option<&Version>| v.is_some_and(|v| is_version(v, hash));
                if is(state.rejected.get(name)) {
                    continue;
                }
                if !is(state.holds.get(name)) || state.refresh.contains(name) {
                    pending.updates.push(Update {
                        name: name.clone(),
                        version: version_of(hash),
                        any: any.clone(),
                    });
                }
                continue;
            }
            let (any, version) = {
                let key = (ty, name.clone());
                match tailored.get(&key) {
                    Some(t) if t.source == hash => (t.any.clone(), t.version.clone()),
                    _ => match envoy.tailor(ty, name, any, hash) {
                        node::Tailored::Made(made) => {
                            let version = version_of(resource_hash(&made));
                            let entry = Tailored {
                                source: hash,
                                any: made.clone(),
                                version: version.clone(),
                            };
                            tailored.insert(key, entry);
                            (made, version)
                        }
                        node::Tailored::AsIs => (any.clone(), version_of(hash)),
                        // Refused, and none good before it: nothing goes.
                        node::Tailored::Nothing => continue,
                    },
                }
            };
            if state.rejected.get(name) == Some(&version) {
                continue;
            }
            if state.holds.get(name) != Some(&version) || state.refresh.contains(name) {
                pending.updates.push(Update {
                    name: name.clone(),
                    version,
                    any,
                });
            }
        }
        let held: Box<dyn Iterator<Item = &String>> = match &candidates {
            Some(changed) => Box::new(
                changed
                    .iter()
                    .copied()
                    .filter(|n| state.holds.contains_key(*n)),
            ),
            None => Box::new(state.holds.keys()),
        };
        pending.removals = held
            .filter(|name| {
                state.subscribed(name)
                    && (current.entry(name).is_none() || !envoy.node.serves(ty, name))
            })
            .cloned()
            .collect();
        pending.removals.sort();
        pending
    }

    /// Sends what `ty` owes, the suspects of an earlier rejection each alone. Removals go in
    /// the same response when `with_removals`, else they are returned for the caller to send
    /// after every other type's updates.
    async fn send_owed(
        &mut self,
        envoy: &mut Envoy<Delta>,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        with_removals: bool,
    ) -> Result<Vec<String>, Closed> {
        if envoy.lacks_filter_path(ty) {
            return Ok(Vec::new());
        }
        let held = ty == ResourceType::ExtensionConfig && self.filter_config_after.is_some();
        if held && self.types.get(&ty).is_some_and(|state| !state.owes_first) {
            // Goes when the hold ends (an ACK of an earlier one brought us here).
            return Ok(Vec::new());
        }
        let Pending { updates, removals } = self.pending(envoy, ty, current);
        if ty == ResourceType::ExtensionConfig {
            // What goes now (or nothing: the Envoy holds it already) is this version's.
            self.answered_urgency = Some(current.urgency);
        }
        let Some(state) = self.types.get(&ty) else {
            return Ok(Vec::new());
        };
        let owes_first = state.owes_first;
        let (alone, together): (Vec<_>, Vec<_>) = updates
            .into_iter()
            .partition(|u| state.suspects.contains(&u.name));
        let (here, deferred) = if with_removals {
            (removals, Vec::new())
        } else {
            (Vec::new(), removals)
        };
        let mut responses = Vec::new();
        if !together.is_empty() || !here.is_empty() || (alone.is_empty() && owes_first) {
            responses.push((together, here));
        }
        responses.extend(alone.into_iter().map(|one| (vec![one], Vec::new())));
        for (updates, removals) in responses {
            self.send_response(envoy, ty, current, updates, removals)
                .await?;
        }
        Ok(deferred)
    }

    /// Sends one response of `current`'s version and records what Envoy now holds.
    async fn send_response(
        &mut self,
        envoy: &mut Envoy<Delta>,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        updates: Vec<Update>,
        removals: Vec<String>,
    ) -> Result<(), Closed> {
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        let nonce = envoy.next_nonce();
        let count = updates.len();
        let mut carried = Vec::with_capacity(updates.len());
        let mut resources = Vec::with_capacity(updates.len());
        for u in updates {
            let before = state.holds.insert(u.name.clone(), u.version.clone());
            state.refresh.remove(&u.name);
            carried.push((
                u.name.clone(),
                Carried {
                    version: u.version.clone(),
                    before,
                },
            ));
            resources.push(Resource {
                name: u.name,
                version: u.version,
                resource: Some(u.any),
                ..Default::default()
            });
        }
        for name in &removals {
            state.holds.remove(name);
            state.rejected.remove(name);
            state.suspects.remove(name);
        }
        state.owes_first = false;
        // A cluster Envoy just got warms until it gets an assignment, changed or not.
        if ty == ResourceType::Cluster {
            if let Some(eds) = self.types.get_mut(&ResourceType::Endpoint) {
                for (name, _) in &carried {
                    if eds.holds.contains_key(name) {
                        eds.refresh.insert(name.clone());
                    }
                }
            }
        }
        let removed = removals.len();
        let response = DeltaDiscoveryResponse {
            system_version_info: current.version.clone(),
            resources,
            type_url: ty.type_url().to_string(),
            removed_resources: removals,
            nonce: nonce.to_string(),
            control_plane: control_plane(),
            ..Default::default()
        };
        envoy
            .send(ty, current, nonce, response, carried, count)
            .await?;
        // How long after the etcd event that caused the version: with the ACK's time beside
        // it, an operator (or the bench) sees which side of the wire a slow change spent its
        // time on.
        let since_change_ms = current.changed_at.elapsed().as_secs_f64() * 1e3;
        debug!(node = %envoy.node, r#type = ty.short_name(), version = %current.version,
            %nonce, resources = count, removed,
            since_change_ms = format_args!("{since_change_ms:.2}"), "delta xDS response sent");
        Ok(())
    }
}

#[cfg(test)]
mod tests;
