//! Virtual servers (`<prefix>virtual/<name>`): admitted whole or not at all, and resolved
//! with the services' tools, prompts and resources into the names each one shows.

use super::*;

/// What [`Registry::virtual_routes`] computes from: the versions of the catalog and of the
/// surfaces, the ages of the services whose age can decide a name (see `order_sensitive`), in
/// name order, and the virtual servers' definitions.
pub(super) type VirtualKey = (u64, u64, Vec<i64>, BTreeMap<String, VirtualServer>);

/// The versions of the catalog and the surfaces, and the definitions → the services whose age
/// can decide a name.
pub(super) type OrderKey = (u64, u64, BTreeMap<String, VirtualServer>);

/// What a service offers besides tools, by what the filters route on: its prompts' names,
/// its resources' URIs and its resource templates (see `crate::catalog::Surface`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SurfaceRoutes {
    pub prompts: Vec<String>,
    pub resources: Vec<String>,
    pub templates: Vec<String>,
}

pub type VirtualOutput = (BTreeMap<String, VirtualRoutes>, Vec<(String, Unnamed)>);

impl Registry {
    /// A virtual server definition, parsed and validated, or why not (the field it is about
    /// leads the detail).
    pub(super) fn admit_virtual(
        &self,
        key: &str,
        value: &[u8],
    ) -> Result<(String, VirtualServer), Rejected> {
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
    pub(super) fn put_virtual(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let (name, vs) = self.admit_virtual(key, value)?;
        let unknown: Vec<&str> = vs
            .services
            .iter()
            .filter(|s| !self.table.services.contains_key(s.as_str()))
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

    /// The virtual servers stored in etcd (without the built-in default), as admitted.
    pub fn stored_virtual_servers(&self) -> impl Iterator<Item = (&String, &VirtualServer)> {
        self.virtuals.iter().map(|(name, (vs, _))| (name, vs))
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
            self.catalog.tools.version(),
            self.catalog.surfaces.version(),
            definitions.clone(),
        );
        let sensitive = self.memo.order.get_or_make(order_key, |_| {
            let tools: Vec<(&str, Vec<&str>)> = self
                .catalog
                .tools
                .iter()
                .map(|(s, t)| (s.as_str(), t.iter().map(String::as_str).collect()))
                .collect();
            let prompts: Vec<(&str, Vec<&str>)> = self
                .catalog
                .surfaces
                .iter()
                .filter(|(s, _)| self.catalog.tools.contains_key(*s))
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
            for (service, f) in self.catalog.surfaces.iter() {
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
            self.catalog.tools.version(),
            self.catalog.surfaces.version(),
            ages,
            definitions.clone(),
        );
        self.memo.virtual_routes.get_or_make(key, |before| {
            let made = self.resolve_virtual_routes(&definitions);
            match before {
                Some(before) if **before == made => Arc::clone(before),
                _ => Arc::new(made),
            }
        })
    }

    pub(super) fn resolve_virtual_routes(
        &self,
        definitions: &BTreeMap<String, VirtualServer>,
    ) -> VirtualOutput {
        let services: Vec<ServiceTools<'_>> = self
            .catalog
            .tools
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
            .catalog
            .surfaces
            .iter()
            .filter(|(s, _)| self.catalog.tools.contains_key(*s))
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

    /// Logs the tools no virtual server could name that the last publish could: once per
    /// change, not at every push.
    pub(super) fn log_unnamed(&mut self, unnamed: Vec<(String, Unnamed)>) {
        if unnamed == self.memo.unnamed {
            return;
        }
        for (vs, u) in unnamed.iter().filter(|u| !self.memo.unnamed.contains(u)) {
            tracing::warn!(virtual_server = %vs, service = %u.service, tool = %u.tool,
                reason = %u.reason, "a tool cannot be offered on a virtual server");
        }
        self.memo.unnamed = unnamed;
    }
}
