//! The filter's configuration, made from every part of the registry (policies, overrides,
//! fleet openings, virtual routes, auth, limits, catalog) and kept until one of them changes.

use super::*;

/// What the filters' configuration is made from: the catalog's version (the large input,
/// compared by version), the virtual servers' names (compared by pointer: the memo of
/// [`Registry::virtual_routes`] keeps its `Arc` while they come out the same, as they do
/// when a service's age moves without deciding a contested name), and the configuration
/// without its catalog and virtual servers (the small inputs, compared whole: policies, fleet
/// openings, overrides, limits, auth, the session key). The key holds the `Arc`, so its
/// address cannot be reused while compared.
pub(super) struct FilterKey {
    pub(super) catalog: u64,
    pub(super) virtual_routes: Arc<VirtualOutput>,
    pub(super) offline: Arc<offline::OfflineListings>,
    pub(super) rest: FilterConfig,
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
pub(super) struct OfflineKey {
    pub(super) definitions: u64,
    pub(super) virtual_routes: Arc<VirtualOutput>,
}

impl PartialEq for OfflineKey {
    fn eq(&self, other: &Self) -> bool {
        self.definitions == other.definitions
            && Arc::ptr_eq(&self.virtual_routes, &other.virtual_routes)
    }
}

/// The filters' configuration as a publish sends it, made once per change of its inputs.
#[derive(Clone)]
pub(super) struct FilterMade {
    pub(super) config: Arc<FilterConfig>,
    pub(super) json: Arc<str>,
    /// See [`RoutingSnapshot::filter_urgency`].
    pub(super) urgency: u64,
    pub(super) unnamed: Vec<(String, Unnamed)>,
}

impl Registry {
    /// What the filters list on their own while no toolgate-xds answers, made again only when
    /// the names or the definitions change.
    pub(super) fn offline_listings(
        &self,
        virtual_routes: &Arc<VirtualOutput>,
    ) -> Arc<offline::OfflineListings> {
        let key = OfflineKey {
            definitions: self.catalog.definitions.version(),
            virtual_routes: Arc::clone(virtual_routes),
        };
        self.memo.offline.get_or_make(key, |before| {
            let made = offline::build(&virtual_routes.0, &self.catalog.definitions);
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

    /// The filter's configuration: the defaults, every admitted policy override, the fleet's
    /// breaker openings, the operator overrides and each virtual server's names.
    pub fn filter_config(&self) -> Arc<FilterConfig> {
        self.filter_made().config
    }

    /// [`filter_config`](Self::filter_config), its JSON, and the tools the virtual servers
    /// could not name; made again only when an input changed (see `memo.rs`).
    pub(super) fn filter_made(&self) -> FilterMade {
        let virtual_routes = self.virtual_routes();
        let key = FilterKey {
            catalog: self.catalog.tools.version(),
            offline: self.offline_listings(&virtual_routes),
            virtual_routes,
            rest: self.filter_config_without_catalog(),
        };
        let (virtual_routes, offline, rest) = (
            key.virtual_routes.clone(),
            key.offline.clone(),
            key.rest.clone(),
        );
        self.memo.filter.get_or_make(key, |_| {
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
                catalog: BTreeMap::clone(&self.catalog.tools),
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
    pub(super) fn filter_config_without_catalog(&self) -> FilterConfig {
        let mut config = FilterConfig {
            max_body_bytes: self.request_limits.max_body_bytes,
            max_json_depth: self.request_limits.max_json_depth,
            session_key: toolgate_model::policy::SecretString(self.session_key.clone()),
            legacy_revisions: self
                .catalog
                .legacy_revisions
                .iter()
                .filter(|(service, _)| self.catalog.tools.contains_key(*service))
                .map(|(s, r)| (s.clone(), r.clone()))
                .collect(),
            auth: self.auth.filter_auth(),
            claim_header_names: self.auth.claim_header_names(),
            exchanged: self.auth.exchanged(),
            limits: self.filter_limits(),
            ..FilterConfig::default()
        };
        for ((service, tool), e) in &self.controls.fleet {
            config
                .fleet_open
                .entry(service.clone())
                .or_default()
                .insert(tool.clone(), e.open.clone());
        }
        for ((service, tool), o) in &self.controls.overrides {
            config
                .overrides
                .entry(service.clone())
                .or_default()
                .insert(tool.clone(), o.clone());
        }
        policies::add_policies(&mut config, self.controls.policies.applied());
        config
    }

    /// Rule sets without a configuration are kept but not applied (nothing checks tokens
    /// then, so no rule could be): logged once when that starts, not at every push.
    pub(super) fn log_auth_rules_unused(&mut self) {
        let unused = self.auth.config().is_none() && self.auth.has_rules();
        if unused && !self.memo.auth_rules_unused {
            tracing::warn!(
                "auth rule sets are stored but no auth configuration is: they are not applied \
                 until <prefix>auth/config holds one"
            );
        }
        self.memo.auth_rules_unused = unused;
    }
}
