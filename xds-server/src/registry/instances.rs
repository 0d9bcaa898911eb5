//! Instances under `<prefix>services/`: admitted, removed, their health, and the routing
//! snapshot the xDS side publishes from them.

use super::*;

/// Whether two registrations of one key route the same (a lease change alone does not).
pub(super) fn same_routing(a: &Instance, b: &Instance) -> bool {
    a.ip == b.ip && a.meta == b.meta
}

/// Whether two registrations of one key are probed the same way (same server).
pub(super) fn same_target(a: &Instance, b: &Instance) -> bool {
    a.probe_target() == b.probe_target()
}

/// Every valid instance, and the services they make.
#[derive(Debug, Clone, Default)]
pub(super) struct InstanceTable {
    pub(super) instances: BTreeMap<ServiceKey, Instance>,
    /// Services stay known after their last instance leaves: Envoy then gets an empty
    /// assignment (a clean "no healthy upstream") instead of a vanished cluster, and the route
    /// keeps the MCP path last registered (so an emptied service costs no route push).
    pub(super) services: BTreeMap<String, String>,
    /// (service, address) → instance, for the filters' call reports.
    pub(super) by_addr: HashMap<(String, SocketAddr), ServiceKey>,
    /// Instances whose probe target appeared, changed or left since the health monitor last
    /// looked; it starts and stops probe tasks for exactly these.
    pub(super) dirty: BTreeSet<ServiceKey>,
    pub(super) membership: Arc<Notify>,
    /// Counts full reads; each instance carries the count of the last one that saw it.
    pub(super) read_generation: u64,
    /// Keyed (per process), so a registrant cannot craft a value that hashes like another.
    pub(super) value_hasher: std::hash::RandomState,
}

/// Each service's route as last built. A publish rebuilds only the services marked stale
/// since (all of them after a reset or a policy change): one change among 10,000 instances
/// costs the work of its own service, not of the registry.
#[derive(Debug, Clone)]
pub(super) struct StaleRoutes {
    pub(super) built: crate::routing::ServiceRoutes,
    pub(super) stale: BTreeSet<String>,
    pub(super) all_stale: bool,
}

impl StaleRoutes {
    /// `service`'s route is built again at the next publish.
    pub(super) fn mark(&mut self, service: &str) {
        if !self.stale.contains(service) {
            self.stale.insert(service.to_string());
        }
    }
}

impl Default for StaleRoutes {
    fn default() -> Self {
        StaleRoutes {
            built: Default::default(),
            stale: BTreeSet::new(),
            all_stale: true,
        }
    }
}

impl Registry {
    pub fn instance(&self, key: &ServiceKey) -> Option<&Instance> {
        self.table.instances.get(key)
    }

    /// Mutable access marks the instance's route stale: whatever the caller changes is
    /// published.
    pub fn instance_mut(&mut self, key: &ServiceKey) -> Option<&mut Instance> {
        let inst = self.table.instances.get_mut(key)?;
        self.routes.mark(&key.service);
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
        let inst = self
            .table
            .instances
            .get_mut(key)
            .filter(|i| i.lease == lease)?;
        let before = inst
            .lease_check
            .replace(check)
            .map_or(0, |c| c.missed_keepalives);
        Some((before, Arc::clone(&inst.wake)))
    }

    pub(super) fn mark_stale(&mut self, service: &str) {
        self.routes.mark(service);
    }

    pub fn instances(&self) -> impl Iterator<Item = (&ServiceKey, &Instance)> {
        self.table.instances.iter()
    }

    /// The instances whose key comes after `after` (all of them for `None`), in key order: a
    /// pass over the registry in chunks, letting go of its lock between them.
    pub fn instances_after(
        &self,
        after: Option<&ServiceKey>,
    ) -> impl Iterator<Item = (&ServiceKey, &Instance)> {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.table.instances.range((from, Bound::Unbounded))
    }

    /// The instance a filter's report names by its upstream address.
    pub fn find_by_addr(&self, service: &str, addr: SocketAddr) -> Option<&ServiceKey> {
        self.table.by_addr.get(&(service.to_string(), addr))
    }

    /// Instances still waiting for their first probe.
    pub fn unknown_count(&self) -> usize {
        self.table
            .instances
            .values()
            .filter(|i| i.health.state() == State::Unknown)
            .count()
    }

    pub fn instance_count(&self) -> usize {
        self.table.instances.len()
    }

    pub(super) fn put_instance(
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
            value_hash: self.table.value_hasher.hash_one(value),
            read_mark: self.table.read_generation,
        };
        self.table
            .services
            .insert(sk.service.clone(), instance.meta.mcp_path.clone());
        let (routing_changed, target_changed) = match self.table.instances.get_mut(&sk) {
            Some(old) if same_target(old, &instance) => {
                // A new lease or new metadata at the same address: the health verdict holds.
                std::mem::swap(&mut instance.health, &mut old.health);
                std::mem::swap(&mut instance.wake, &mut old.wake);
                instance.lease_check = old.lease_check.take();
                (!same_routing(old, &instance), false)
            }
            Some(old) => {
                let old_addr = old.addr();
                self.table.by_addr.remove(&(sk.service.clone(), old_addr));
                (true, true)
            }
            None => (true, true),
        };
        if target_changed && self.revision > 0 {
            // Appeared while toolgate-xds watched (not in its first read): a new process, as
            // far as the sessions opened before it are concerned.
            instance.health.registered_now();
        }
        self.table
            .by_addr
            .insert((sk.service.clone(), instance.addr()), sk.clone());
        self.mark_stale(&sk.service);
        let service = sk.service.clone();
        let old_age = self.service_age(&service);
        self.table.instances.insert(sk.clone(), instance);
        self.refresh_since(&service);
        if !self.ages.recorded.contains_key(&service) {
            self.ages.wanted.notify_one();
        }
        if target_changed {
            self.mark_dirty(sk);
        }
        // A new age can rename tools on a virtual server: the filter must hear of it.
        Ok(routing_changed || self.service_age(&service) != old_age)
    }

    /// Removes an instance (its key was deleted, or a full read no longer has it). `true`
    /// when there was one.
    pub(super) fn remove_instance(&mut self, sk: ServiceKey) -> bool {
        let Some(old) = self.table.instances.remove(&sk) else {
            return false;
        };
        let addr_key = (sk.service.clone(), old.addr());
        if self.table.by_addr.get(&addr_key) == Some(&sk) {
            self.table.by_addr.remove(&addr_key);
        }
        self.mark_stale(&sk.service);
        self.refresh_since(&sk.service);
        self.mark_dirty(sk);
        true
    }

    /// What Envoy should route to now. Rebuilds the routes of the services that changed since
    /// the last call; the others are shared with the previous snapshot.
    pub fn routing(&mut self, generation: u64, changed_at: Instant) -> RoutingSnapshot {
        let stale: Vec<String> = if std::mem::take(&mut self.routes.all_stale) {
            self.routes.stale.clear();
            let gone: Vec<String> = self
                .routes
                .built
                .keys()
                .filter(|s| !self.table.services.contains_key(*s))
                .cloned()
                .collect();
            for s in gone {
                self.routes.built.remove(&s);
            }
            let services = &self.table.services;
            if self.catalog.tools.keys().any(|s| !services.contains_key(s)) {
                self.catalog
                    .tools
                    .modify()
                    .retain(|s, _| services.contains_key(s));
            }
            self.table.services.keys().cloned().collect()
        } else {
            std::mem::take(&mut self.routes.stale).into_iter().collect()
        };
        for service in &stale {
            if !self.table.services.contains_key(service) {
                if self.catalog.tools.contains_key(service) {
                    self.catalog.tools.modify().remove(service);
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
                let tools = match self.catalog.discovered.get(service) {
                    Some(found) if tools.is_empty() => found.clone(),
                    _ => tools,
                };
                if self.catalog.tools.get(service) != Some(&tools) {
                    self.catalog.tools.modify().insert(service.clone(), tools);
                }
            } else if !self.catalog.tools.contains_key(service) {
                // No instance left: the last list stands, as the route does.
                self.catalog
                    .tools
                    .modify()
                    .insert(service.clone(), BTreeSet::new());
            }
        }
        let made = self.filter_made();
        let filter = &made.config;
        self.log_unnamed(made.unnamed.clone());
        self.log_auth_rules_unused();
        for service in stale {
            if self.table.services.contains_key(&service) {
                let route = self.build_route(&service, filter);
                match self.routes.built.get(&service) {
                    Some(old) if **old == route => {}
                    _ => {
                        self.routes.built.insert(service, Arc::new(route));
                    }
                }
            } else {
                self.routes.built.remove(&service);
            }
        }
        RoutingSnapshot {
            generation,
            changed_at,
            traces: Default::default(),
            recent: std::sync::Arc::from([]),
            services: self.routes.built.clone(),
            filter_config: made.json.clone(),
            filter_urgency: made.urgency,
            virtual_servers: filter.virtual_servers.keys().cloned().collect(),
            max_body_bytes: self.request_limits.max_body_bytes,
            default_timeout_ms: filter.defaults.timeout_ms,
            auth: self.auth.config().cloned(),
            jwks: self.fetched_keys.clone(),
            keep_caller_tokens: self.auth.upstreams().any(|(_, c)| c.exchange.is_some()),
            credentials: self.upstream_credentials.clone(),
            control: self.members.control(),
        }
    }

    /// The instances of one service: a range of the ordered instance map.
    pub(super) fn service_instances<'a>(
        &'a self,
        service: &'a str,
    ) -> impl Iterator<Item = (&'a ServiceKey, &'a Instance)> + 'a {
        let first = ServiceKey {
            service: service.to_string(),
            instance: String::new(),
        };
        self.table
            .instances
            .range(first..)
            .take_while(move |(sk, _)| sk.service == service)
    }

    /// One service's route from its instances.
    pub(super) fn build_route(&self, service: &str, filter: &FilterConfig) -> ServiceRoute {
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
            // Only a static credential is Envoy's to inject: an exchanged one is each caller's,
            // added by the filter, and an injector without a secret would answer 401 to all.
            credential_header: self
                .auth
                .upstream(service)
                .filter(|c| c.secret.is_some())
                .map(|c| c.header.clone()),
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
            route.mcp_path = self
                .table
                .services
                .get(service)
                .cloned()
                .unwrap_or_default();
        }
        route
    }
}
