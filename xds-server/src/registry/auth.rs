//! What the registry keeps of `<prefix>auth/` (issue 20): the auth configuration and the rule
//! sets of services and virtual servers, each as last admitted, with the raw JSON etcd holds
//! (for the state-dir snapshot and the inspection's comparison with etcd).
//!
//! Each value is admitted whole or not at all: a refused one leaves the last good one, as a
//! refused virtual server does, so a typo in a rule set never opens or closes a service.

use std::collections::BTreeMap;
use std::sync::Arc;

use toolgate_model::auth::{AuthConfig, FilterAuth, ToolRules};
use toolgate_model::keys::AuthKey;
use toolgate_model::upstream_auth::UpstreamCredential;
use toolgate_model::KeyLayout;

use super::Rejected;

/// The reason a refused auth value is counted and logged under.
pub const BAD_AUTH: &str = "bad_auth";

/// A value under `<prefix>auth/`, parsed and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    Config(AuthConfig),
    Service(String, ToolRules),
    Virtual(String, ToolRules),
    Upstream(String, UpstreamCredential),
}

#[derive(Debug, Clone, Default)]
pub struct AuthStore {
    /// In an `Arc` the routing snapshot shares: the xDS side sees by pointer that the
    /// configuration did not change, and rebuilds nothing made of it.
    config: Option<(Arc<AuthConfig>, String)>,
    services: BTreeMap<String, (ToolRules, String)>,
    virtuals: BTreeMap<String, (ToolRules, String)>,
    /// The credential toward each service's servers (a reference to a secret, no value).
    upstreams: BTreeMap<String, (UpstreamCredential, String)>,
}

/// Parses a PUT under `<prefix>auth/` as the watch admits it, or says why not (the field the
/// value is refused for leads the detail: `issuers[0].jwks.remote.uri: ...`).
pub fn admit(layout: &KeyLayout, key: &str, value: &[u8]) -> Result<Admitted, Rejected> {
    let reject = |reason: &'static str, detail: String| Rejected {
        key: key.to_string(),
        reason,
        detail,
    };
    let which = layout
        .parse_auth_key(key)
        .map_err(|e| reject("bad_key", e.to_string()))?;
    let bad = |e: toolgate_model::auth::AuthError| reject(BAD_AUTH, e.to_string());
    Ok(match which {
        AuthKey::Config => Admitted::Config(AuthConfig::parse(value).map_err(bad)?),
        AuthKey::Service(name) => Admitted::Service(name, ToolRules::parse(value).map_err(bad)?),
        AuthKey::Virtual(name) => Admitted::Virtual(name, ToolRules::parse(value).map_err(bad)?),
        AuthKey::Upstream(name) => {
            Admitted::Upstream(name, UpstreamCredential::parse(value).map_err(bad)?)
        }
    })
}

impl AuthStore {
    /// Stores an admitted value (`raw`: as etcd holds it). Whether it differs from the one
    /// stored before.
    pub fn insert(&mut self, admitted: Admitted, raw: String) -> bool {
        match admitted {
            Admitted::Config(config) => match &mut self.config {
                // The same configuration keeps its `Arc` (see `config`); only the raw text,
                // which may differ in spacing, is taken.
                Some((old, old_raw)) if **old == config => {
                    *old_raw = raw;
                    false
                }
                slot => {
                    *slot = Some((Arc::new(config), raw));
                    true
                }
            },
            Admitted::Service(name, rules) => insert_rules(&mut self.services, name, rules, raw),
            Admitted::Virtual(name, rules) => insert_rules(&mut self.virtuals, name, rules, raw),
            Admitted::Upstream(name, credential) => {
                insert_rules(&mut self.upstreams, name, credential, raw)
            }
        }
    }

    /// Applies a DELETE; whether something was there.
    pub fn remove(&mut self, key: &AuthKey) -> bool {
        match key {
            AuthKey::Config => self.config.take().is_some(),
            AuthKey::Service(name) => self.services.remove(name).is_some(),
            AuthKey::Virtual(name) => self.virtuals.remove(name).is_some(),
            AuthKey::Upstream(name) => self.upstreams.remove(name).is_some(),
        }
    }

    /// Puts back `key`'s value from `old` (the store before a reset) unless the read gave it
    /// one. Whether it did.
    pub fn restore(&mut self, key: &AuthKey, old: &mut AuthStore) -> bool {
        match key {
            AuthKey::Config => {
                if self.config.is_some() {
                    return false;
                }
                self.config = old.config.take();
                self.config.is_some()
            }
            AuthKey::Service(name) => restore_rules(&mut self.services, &mut old.services, name),
            AuthKey::Virtual(name) => restore_rules(&mut self.virtuals, &mut old.virtuals, name),
            AuthKey::Upstream(name) => restore_rules(&mut self.upstreams, &mut old.upstreams, name),
        }
    }

    /// After a reset: a configuration equal to the one before keeps the old `Arc`, so a
    /// resync that changed nothing rebuilds nothing on the xDS side.
    pub fn keep_arc_of(&mut self, old: &AuthStore) {
        if let (Some((new, _)), Some((old, _))) = (&mut self.config, &old.config) {
            if **new == **old {
                *new = Arc::clone(old);
            }
        }
    }

    pub fn config(&self) -> Option<&Arc<AuthConfig>> {
        self.config.as_ref().map(|(c, _)| c)
    }

    pub fn service_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.services.iter().map(|(n, (r, _))| (n, r))
    }

    pub fn virtual_rules(&self) -> impl Iterator<Item = (&String, &ToolRules)> {
        self.virtuals.iter().map(|(n, (r, _))| (n, r))
    }

    /// The credential toward `service`'s servers, if one is configured.
    pub fn upstream(&self, service: &str) -> Option<&UpstreamCredential> {
        self.upstreams.get(service).map(|(c, _)| c)
    }

    pub fn upstreams(&self) -> impl Iterator<Item = (&String, &UpstreamCredential)> {
        self.upstreams.iter().map(|(n, (c, _))| (n, c))
    }

    pub fn has_rules(&self) -> bool {
        !self.services.is_empty() || !self.virtuals.is_empty()
    }

    /// The filter's share, when a configuration exists: without one nothing requires a token
    /// and rule sets have no issuer to check callers against, so they are not sent.
    pub fn filter_auth(&self) -> Option<FilterAuth> {
        let config = self.config()?;
        let clone_all = |m: &BTreeMap<String, (ToolRules, String)>| {
            m.iter()
                .map(|(n, (r, _))| (n.clone(), r.clone()))
                .collect::<BTreeMap<_, _>>()
        };
        Some(FilterAuth::new(
            config,
            clone_all(&self.services),
            clone_all(&self.virtuals),
        ))
    }

    /// Every header name a stored rule set copies a claim into (lower case), whether or not a
    /// configuration exists: the filters remove these from every request, so no client can
    /// write what a server takes for a verified claim, even while nothing verifies tokens.
    pub fn claim_header_names(&self) -> std::collections::BTreeSet<String> {
        self.service_rules()
            .chain(self.virtual_rules())
            .flat_map(|(_, rules)| rules.claim_headers.values())
            .map(|header| header.to_ascii_lowercase())
            .collect()
    }

    /// The services whose credential is each caller's token exchanged (RFC 8693): the
    /// filters ask toolgate-xds for it per caller and send those services nothing without it.
    pub fn exchanged(&self) -> BTreeMap<String, String> {
        use sha2::Digest as _;
        self.upstreams()
            .filter(|(_, c)| c.exchange.is_some())
            .map(|(service, c)| {
                // Serializing a parsed credential cannot fail; its fingerprint changes with
                // any field (audience, scopes, client, header, format).
                let json = serde_json::to_vec(c).unwrap_or_default();
                let digest = sha2::Sha256::digest(&json);
                let fingerprint: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
                (service.clone(), fingerprint)
            })
            .collect()
    }

    /// (key, raw value) of everything stored.
    pub fn raw_values(&self, layout: &KeyLayout) -> Vec<(String, String)> {
        let config = self
            .config
            .iter()
            .map(|(_, raw)| (layout.auth_config_key(), raw.clone()));
        let services = self
            .services
            .iter()
            .map(|(n, (_, raw))| (layout.auth_rules_key(n), raw.clone()));
        let virtuals = self
            .virtuals
            .iter()
            .map(|(n, (_, raw))| (layout.auth_virtual_key(n), raw.clone()));
        let upstreams = self
            .upstreams
            .iter()
            .map(|(n, (_, raw))| (layout.auth_upstream_key(n), raw.clone()));
        config
            .chain(services)
            .chain(virtuals)
            .chain(upstreams)
            .collect()
    }
}

fn insert_rules<T: PartialEq>(
    map: &mut BTreeMap<String, (T, String)>,
    name: String,
    rules: T,
    raw: String,
) -> bool {
    let changed = map.get(&name).is_none_or(|(old, _)| *old != rules);
    map.insert(name, (rules, raw));
    changed
}

fn restore_rules<T>(
    map: &mut BTreeMap<String, (T, String)>,
    old: &mut BTreeMap<String, (T, String)>,
    name: &str,
) -> bool {
    if map.contains_key(name) {
        return false;
    }
    match old.remove(name) {
        Some(v) => map.insert(name.to_string(), v).is_none(),
        None => false,
    }
}
