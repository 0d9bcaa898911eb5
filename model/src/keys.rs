//! The etcd key layout under a configurable prefix (default `/mcp/`).

use crate::names::{validate_name, NameError};

pub const DEFAULT_PREFIX: &str = "/mcp/";

/// Builds and parses keys under one prefix; the prefix always ends with `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLayout {
    prefix: String,
}

/// The (service, instance) a key under `services/` names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub service: String,
    pub instance: String,
}

/// What a key under `<prefix>auth/` names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AuthKey {
    /// `<prefix>auth/config`
    Config,
    /// `<prefix>auth/rules/<service>`
    Service(String),
    /// `<prefix>auth/virtual/<name>`
    Virtual(String),
    /// `<prefix>auth/upstream/<service>`: the credential toward the service's servers.
    Upstream(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key {0:?} is not under the expected prefix")]
    NotAService(String),
    #[error("key {key:?} is not <prefix>services/<service>/<instance>")]
    Shape { key: String },
    #[error("key {key:?}: {source}")]
    Name { key: String, source: NameError },
}

/// Splits `<prefix><service>[/<tool>]` into the service and the tool, if any, each checked
/// as a name.
fn service_and_tool(prefix: &str, key: &str) -> Result<(String, Option<String>), KeyError> {
    let rest = key
        .strip_prefix(prefix)
        .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
    let name_err = |source| KeyError::Name {
        key: key.to_string(),
        source,
    };
    match rest.split_once('/') {
        None => {
            validate_name("service", rest).map_err(name_err)?;
            Ok((rest.to_string(), None))
        }
        Some((service, tool)) => {
            validate_name("service", service).map_err(name_err)?;
            validate_name("tool", tool).map_err(name_err)?;
            Ok((service.to_string(), Some(tool.to_string())))
        }
    }
}

impl Default for KeyLayout {
    fn default() -> Self {
        KeyLayout::new(DEFAULT_PREFIX)
    }
}

impl KeyLayout {
    pub fn new(prefix: &str) -> Self {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        KeyLayout { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `<prefix>services/`: the prefix every instance key lives under.
    pub fn services_prefix(&self) -> String {
        format!("{}services/", self.prefix)
    }

    pub fn service_prefix(&self, service: &str) -> String {
        format!("{}services/{}/", self.prefix, service)
    }

    pub fn instance_key(&self, service: &str, instance: &str) -> String {
        format!("{}services/{}/{}", self.prefix, service, instance)
    }

    /// `<prefix>policies/`: breaker policies, per service or per (service, tool).
    pub fn policies_prefix(&self) -> String {
        format!("{}policies/", self.prefix)
    }

    /// Splits `<prefix>policies/<service>[/<tool>]` into the service and the tool, if any.
    pub fn parse_policy_key(&self, key: &str) -> Result<(String, Option<String>), KeyError> {
        service_and_tool(&self.policies_prefix(), key)
    }

    /// `<prefix>limits/`: call limits, per service or per (service, tool).
    pub fn limits_prefix(&self) -> String {
        format!("{}limits/", self.prefix)
    }

    /// The limits key of a service, or of one of its tools.
    pub fn limit_key(&self, service: &str, tool: Option<&str>) -> String {
        match tool {
            Some(t) => format!("{}limits/{service}/{t}", self.prefix),
            None => format!("{}limits/{service}", self.prefix),
        }
    }

    /// Splits `<prefix>limits/<service>[/<tool>]` into the service and the tool, if any.
    pub fn parse_limit_key(&self, key: &str) -> Result<(String, Option<String>), KeyError> {
        service_and_tool(&self.limits_prefix(), key)
    }

    /// `<prefix>virtual/`: virtual servers, one key per name (issue 19).
    pub fn virtual_prefix(&self) -> String {
        format!("{}virtual/", self.prefix)
    }

    /// The name in `<prefix>virtual/<name>`, checked like a service name.
    pub fn parse_virtual_key(&self, key: &str) -> Result<String, KeyError> {
        let rest = key
            .strip_prefix(self.virtual_prefix().as_str())
            .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
        validate_name("virtual server", rest).map_err(|source| KeyError::Name {
            key: key.to_string(),
            source,
        })?;
        Ok(rest.to_string())
    }

    /// `<prefix>auth/`: token validation and per-tool authorization (issue 20).
    pub fn auth_prefix(&self) -> String {
        format!("{}auth/", self.prefix)
    }

    /// `<prefix>auth/config`: the one auth configuration.
    pub fn auth_config_key(&self) -> String {
        format!("{}auth/config", self.prefix)
    }

    /// `<prefix>auth/rules/<service>`: a service's tool rules.
    pub fn auth_rules_key(&self, service: &str) -> String {
        format!("{}auth/rules/{service}", self.prefix)
    }

    /// `<prefix>auth/virtual/<name>`: a virtual server's tool rules.
    pub fn auth_virtual_key(&self, name: &str) -> String {
        format!("{}auth/virtual/{name}", self.prefix)
    }

    pub fn auth_upstream_key(&self, service: &str) -> String {
        format!("{}auth/upstream/{service}", self.prefix)
    }

    /// What a key under `<prefix>auth/` holds.
    pub fn parse_auth_key(&self, key: &str) -> Result<AuthKey, KeyError> {
        let rest = key
            .strip_prefix(self.auth_prefix().as_str())
            .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
        let name_err = |source| KeyError::Name {
            key: key.to_string(),
            source,
        };
        if rest == "config" {
            return Ok(AuthKey::Config);
        }
        if let Some(service) = rest.strip_prefix("rules/") {
            validate_name("service", service).map_err(name_err)?;
            return Ok(AuthKey::Service(service.to_string()));
        }
        if let Some(name) = rest.strip_prefix("virtual/") {
            validate_name("virtual server", name).map_err(name_err)?;
            return Ok(AuthKey::Virtual(name.to_string()));
        }
        if let Some(service) = rest.strip_prefix("upstream/") {
            validate_name("service", service).map_err(name_err)?;
            return Ok(AuthKey::Upstream(service.to_string()));
        }
        Err(KeyError::Shape {
            key: key.to_string(),
        })
    }

    /// `<prefix>service-ages/`: each service's age for naming, the etcd revision at which the
    /// fleet first saw it (written once, whichever toolgate-xds sees the service first).
    pub fn service_ages_prefix(&self) -> String {
        format!("{}service-ages/", self.prefix)
    }

    pub fn service_age_key(&self, service: &str) -> String {
        format!("{}{service}", self.service_ages_prefix())
    }

    /// The service in `<prefix>service-ages/<service>`.
    pub fn parse_service_age_key(&self, key: &str) -> Result<String, KeyError> {
        let rest = key
            .strip_prefix(self.service_ages_prefix().as_str())
            .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
        validate_name("service", rest).map_err(|source| KeyError::Name {
            key: key.to_string(),
            source,
        })?;
        Ok(rest.to_string())
    }

    /// `<prefix>breakers/`: breaker openings shared by the fleet, leased for the open duration.
    pub fn breakers_prefix(&self) -> String {
        format!("{}breakers/", self.prefix)
    }

    /// `<prefix>overrides/`: operator overrides, kept until lifted.
    pub fn overrides_prefix(&self) -> String {
        format!("{}overrides/", self.prefix)
    }

    pub fn breaker_key(&self, service: &str, tool: &str) -> String {
        format!("{}{service}/{tool}", self.breakers_prefix())
    }

    pub fn override_key(&self, service: &str, tool: &str) -> String {
        format!("{}{service}/{tool}", self.overrides_prefix())
    }

    /// `<prefix>xds/`: the toolgate-xds processes of the fleet, each under a lease.
    pub fn xds_prefix(&self) -> String {
        format!("{}xds/", self.prefix)
    }

    /// `<prefix>xds/<id>`: one toolgate-xds's admin listener.
    pub fn xds_key(&self, id: &str) -> String {
        format!("{}xds/{id}", self.prefix)
    }

    /// The id in `<prefix>xds/<id>`, checked like a service name.
    pub fn parse_xds_key(&self, key: &str) -> Result<String, KeyError> {
        let rest = key
            .strip_prefix(self.xds_prefix().as_str())
            .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
        validate_name("toolgate-xds id", rest).map_err(|source| KeyError::Name {
            key: key.to_string(),
            source,
        })?;
        Ok(rest.to_string())
    }

    /// Splits `<kind_prefix><service>/<tool>` (a breaker or override key) into its names.
    pub fn parse_tool_key(
        &self,
        kind_prefix: &str,
        key: &str,
    ) -> Result<(String, String), KeyError> {
        split_names(kind_prefix, key, "tool")
    }

    /// Splits an instance key into its service and instance, validating both names.
    pub fn parse_instance_key(&self, key: &str) -> Result<ServiceKey, KeyError> {
        let (service, instance) = split_names(&self.services_prefix(), key, "instance")?;
        Ok(ServiceKey { service, instance })
    }
}

/// `<prefix><service>/<second>`, both names validated (`second_kind` names the second in
/// errors).
fn split_names(
    prefix: &str,
    key: &str,
    second_kind: &'static str,
) -> Result<(String, String), KeyError> {
    let rest = key
        .strip_prefix(prefix)
        .ok_or_else(|| KeyError::NotAService(key.to_string()))?;
    let (service, second) = rest.split_once('/').ok_or_else(|| KeyError::Shape {
        key: key.to_string(),
    })?;
    let name_err = |source| KeyError::Name {
        key: key.to_string(),
        source,
    };
    validate_name("service", service).map_err(name_err)?;
    validate_name(second_kind, second).map_err(name_err)?;
    Ok((service.to_string(), second.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_and_parses_auth_keys() {
        let k = KeyLayout::default();
        assert_eq!(k.parse_auth_key(&k.auth_config_key()), Ok(AuthKey::Config));
        assert_eq!(
            k.parse_auth_key(&k.auth_rules_key("orders")),
            Ok(AuthKey::Service("orders".into()))
        );
        assert_eq!(
            k.parse_auth_key(&k.auth_virtual_key("ops")),
            Ok(AuthKey::Virtual("ops".into()))
        );
        assert_eq!(
            k.parse_auth_key(&k.auth_upstream_key("orders")),
            Ok(AuthKey::Upstream("orders".into()))
        );
        for bad in [
            "/mcp/auth/rules/",
            "/mcp/auth/rules/a/b",
            "/mcp/auth/other",
            "/mcp/auth/",
        ] {
            assert!(k.parse_auth_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn builds_and_parses_service_age_keys() {
        let k = KeyLayout::default();
        assert_eq!(k.service_age_key("orders"), "/mcp/service-ages/orders");
        assert_eq!(
            k.parse_service_age_key("/mcp/service-ages/orders"),
            Ok("orders".to_string())
        );
        for bad in [
            "/mcp/service-ages/",
            "/mcp/service-ages/a/b",
            "/mcp/services/a",
        ] {
            assert!(k.parse_service_age_key(bad).is_err(), "{bad}");
        }
        assert!(!k
            .service_age_key("orders")
            .starts_with(&k.services_prefix()));
    }

    #[test]
    fn builds_and_parses_breaker_and_override_keys() {
        let k = KeyLayout::default();
        let key = k.breaker_key("inv", "read");
        assert_eq!(key, "/mcp/breakers/inv/read");
        assert_eq!(
            k.parse_tool_key(&k.breakers_prefix(), &key).unwrap(),
            ("inv".to_string(), "read".to_string())
        );
        assert_eq!(k.override_key("inv", "read"), "/mcp/overrides/inv/read");
        for bad in [
            "/mcp/breakers/inv",
            "/mcp/breakers/in v/t",
            "/mcp/breakers/a/b/c",
        ] {
            assert!(
                k.parse_tool_key(&k.breakers_prefix(), bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn builds_and_parses_xds_keys() {
        let k = KeyLayout::default();
        let key = k.xds_key("10.0.0.5_19000");
        assert_eq!(key, "/mcp/xds/10.0.0.5_19000");
        assert_eq!(k.parse_xds_key(&key).unwrap(), "10.0.0.5_19000");
        for bad in [
            "/mcp/xds/",
            "/mcp/xds/a/b",
            "/mcp/xds/a:1",
            "/mcp/services/a/b",
        ] {
            assert!(k.parse_xds_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn builds_and_parses_instance_keys() {
        let k = KeyLayout::new("/mcp");
        assert_eq!(k.prefix(), "/mcp/");
        let key = k.instance_key("inventory", "i-1");
        assert_eq!(key, "/mcp/services/inventory/i-1");
        assert_eq!(
            k.parse_instance_key(&key).unwrap(),
            ServiceKey {
                service: "inventory".into(),
                instance: "i-1".into()
            }
        );
    }

    #[test]
    fn parses_policy_keys() {
        let k = KeyLayout::default();
        assert_eq!(
            k.parse_policy_key("/mcp/policies/inv").unwrap(),
            ("inv".to_string(), None)
        );
        assert_eq!(
            k.parse_policy_key("/mcp/policies/inv/write_order").unwrap(),
            ("inv".to_string(), Some("write_order".to_string()))
        );
        assert!(k.parse_policy_key("/mcp/policies/inv/a/b").is_err());
        assert!(k.parse_policy_key("/mcp/policies/").is_err());
        assert!(k.parse_policy_key("/mcp/services/inv").is_err());
    }

    #[test]
    fn rejects_foreign_and_malformed_keys() {
        let k = KeyLayout::default();
        assert!(matches!(
            k.parse_instance_key("/other/services/a/b"),
            Err(KeyError::NotAService(_))
        ));
        assert!(matches!(
            k.parse_instance_key("/mcp/services/a"),
            Err(KeyError::Shape { .. })
        ));
        assert!(matches!(
            k.parse_instance_key("/mcp/services/a/b/c"),
            Err(KeyError::Name { .. })
        ));
        assert!(matches!(
            k.parse_instance_key("/mcp/services//b"),
            Err(KeyError::Name { .. })
        ));
    }
}
