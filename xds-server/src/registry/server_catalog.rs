//! What the tool catalog (`crate::catalog`) read from each service's server: its tools (for
//! a service whose registrations list none), their definitions, its prompts and resources,
//! the revision it speaks; and, from these and the registrations, the tools the filters keep
//! breakers for.

use super::*;

#[derive(Debug, Clone, Default)]
pub(super) struct ServerCatalog {
    /// The tools each service's registrations list (the union over its instances), for the
    /// filter, which keeps breakers only for these. A service whose last instance left keeps
    /// its last list, as it keeps its route. Refreshed with the routes of stale services.
    pub(super) tools: Versioned<BTreeMap<String, BTreeSet<String>>>,
    /// The tools the tool catalog read from the server of a service whose registrations list
    /// none: such a service's catalog for the filters, so that a breaker belongs to a name its
    /// server lists, never to a name a client made up.
    pub(super) discovered: BTreeMap<String, BTreeSet<String>>,
    /// Each service's tool definitions as the tool catalog last read them: what the filters'
    /// offline listings show.
    pub(super) definitions: Versioned<BTreeMap<String, Arc<Vec<serde_json::Value>>>>,
    /// Each service's prompt names, resource URIs and templates as the tool catalog last read
    /// them: the virtual servers route `prompts/get` and `resources/read` by them.
    pub(super) surfaces: Versioned<BTreeMap<String, SurfaceRoutes>>,
    /// The services whose servers speak only a revision with sessions, and that revision, as
    /// the tool catalog last found them: the filters hold sessions with them for 2026-07-28
    /// clients of the aggregate endpoint.
    pub(super) legacy_revisions: BTreeMap<String, String>,
}

impl Registry {
    /// What the tool catalog found a service's server to speak: `Some(revision)` when only a
    /// revision with sessions, `None` when 2026-07-28 or when the service is gone. Whether
    /// the filters' configuration changed (a publish is then due).
    pub fn set_legacy_revision(&mut self, service: &str, revision: Option<String>) -> bool {
        match revision {
            Some(r) => {
                self.catalog
                    .legacy_revisions
                    .insert(service.to_string(), r.clone())
                    != Some(r)
            }
            None => self.catalog.legacy_revisions.remove(service).is_some(),
        }
    }

    /// The tools the tool catalog read from `service`'s server, for a service whose
    /// registrations list none (`None`: forget them, the service is gone). Whether its
    /// catalog may change (a publish is then due).
    pub fn set_discovered_tools(&mut self, service: &str, tools: Option<BTreeSet<String>>) -> bool {
        let changed = match tools {
            Some(t) => {
                self.catalog.discovered.get(service) != Some(&t) && {
                    self.catalog.discovered.insert(service.to_string(), t);
                    true
                }
            }
            None => self.catalog.discovered.remove(service).is_some(),
        };
        if changed {
            self.mark_stale(service);
        }
        changed
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
            Some(t)
                if self
                    .catalog
                    .definitions
                    .get(service)
                    .is_some_and(|d| **d == t) =>
            {
                false
            }
            Some(t) => {
                self.catalog
                    .definitions
                    .modify()
                    .insert(service.to_string(), Arc::new(t));
                true
            }
            None if self.catalog.definitions.contains_key(service) => {
                self.catalog.definitions.modify().remove(service);
                true
            }
            None => false,
        }
    }

    /// The prompts, resources and templates the tool catalog read from `service`'s server
    /// (`None`: forget them, the service is gone). Whether the filters' configuration changes.
    pub fn set_surface(&mut self, service: &str, surface: Option<SurfaceRoutes>) -> bool {
        match surface {
            Some(s) if self.catalog.surfaces.get(service) == Some(&s) => false,
            Some(s) => {
                self.catalog
                    .surfaces
                    .modify()
                    .insert(service.to_string(), s);
                true
            }
            None if self.catalog.surfaces.contains_key(service) => {
                self.catalog.surfaces.modify().remove(service);
                true
            }
            None => false,
        }
    }
}
