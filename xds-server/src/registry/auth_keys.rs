//! The auth configuration and its rule sets, as etcd holds them.

use super::*;

impl Registry {
    /// A value under `<prefix>auth/`: admitted whole or not at all (the last good one stays).
    /// A rule set for a service or virtual server that does not exist is admitted: it may be
    /// between instances, or be defined after its rules, and its rules then apply.
    pub(super) fn put_auth(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let admitted = auth::admit(&self.layout, key, value)?;
        match &admitted {
            auth::Admitted::Service(name, _) if !self.table.services.contains_key(name) => {
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
        // A credential changes the service's cluster (the injector is there or not).
        let service = match &admitted {
            auth::Admitted::Upstream(name, _) => Some(name.clone()),
            _ => None,
        };
        let changed = self.auth.insert(admitted, raw);
        if let Some(service) = service.filter(|_| changed) {
            self.mark_stale(&service);
        }
        Ok(changed)
    }

    /// The auth configuration (`<prefix>auth/config`), when one is admitted.
    pub fn auth_config(&self) -> Option<&AuthConfig> {
        self.auth.config().map(|c| &**c)
    }

    /// The credentials toward servers (`<prefix>auth/upstream/<service>`), by service.
    pub fn auth_upstreams(
        &self,
    ) -> impl Iterator<Item = (&String, &toolgate_model::upstream_auth::UpstreamCredential)> {
        self.auth.upstreams()
    }

    /// `service`'s credential toward its servers, if one is admitted.
    pub fn auth_upstream(
        &self,
        service: &str,
    ) -> Option<&toolgate_model::upstream_auth::UpstreamCredential> {
        self.auth.upstream(service)
    }

    /// The rule sets of services (`<prefix>auth/rules/<service>`), by service.
    pub fn auth_service_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.auth.service_rules()
    }

    /// The rule sets of virtual servers (`<prefix>auth/virtual/<name>`), by name.
    pub fn auth_virtual_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.auth.virtual_rules()
    }
}
