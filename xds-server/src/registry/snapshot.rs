//! What the registry shows of itself: raw values for the state file and the admin API,
//! fingerprints, health counts and the view the console reads.

use super::*;

/// Instances per (service, state), and (zombies, instances) per service.
pub type HealthCounts = (BTreeMap<(String, State), i64>, BTreeMap<String, (i64, i64)>);

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

pub(super) fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Registry {
    /// The raw (key, value) pairs of every admitted instance, policy, fleet opening, override,
    /// virtual server, auth value and limits, for the state-dir snapshot.
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
    /// overrides, virtual servers, auth values and limits (a few hundred at most) and the recorded
    /// service ages (one per service).
    pub fn raw_values_but_instances(&self) -> Vec<(String, String)> {
        let policies = self
            .controls
            .policies
            .applied()
            .iter()
            .map(|(k, (_, raw))| (self.policy_key(k), raw.clone()));
        let fleet = self.controls.fleet.iter().map(|((service, tool), e)| {
            (
                self.layout.breaker_key(service, tool),
                serde_json::to_string(&e.open).unwrap_or_default(),
            )
        });
        let overrides = self.controls.overrides.iter().map(|((service, tool), o)| {
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
        let ages = self.ages.recorded.iter().map(|(service, revision)| {
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
            .chain(self.raw_limits())
            .chain(members)
            .collect()
    }

    /// The create revision of every instance key, for the state-dir snapshot: a restart
    /// during an etcd outage must give services the ages (and so the tool names) they had.
    pub fn create_revisions(&self) -> BTreeMap<String, i64> {
        self.table
            .instances
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
            .table
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
                        .and_then(|n| self.controls.fleet.get(&n))
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
        out.extend(self.controls.policies.refused().iter().map(|(k, want)| {
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
        for service in self.table.services.keys() {
            for s in State::ALL {
                by_state.insert((service.clone(), s), 0);
            }
            zombies.insert(service.clone(), (0, 0));
        }
        for (sk, inst) in &self.table.instances {
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
            .table
            .services
            .keys()
            .map(|s| (s.clone(), Vec::new()))
            .collect();
        let now = Instant::now();
        for (sk, inst) in &self.table.instances {
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
            instances: self.table.instances.len(),
            services,
        }
    }
}
