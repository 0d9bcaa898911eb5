//! Envoys sharded by service. One Envoy cannot hold every cluster of a large fleet (Envoy
//! applies a new cluster on its main thread, and rebuilds the whole route configuration for
//! each new service), so a fleet of Envoys can split the services: an Envoy whose bootstrap
//! names services (`toolgate-xds bootstrap --services 'billing-*,search'`, node metadata
//! `toolgate.services`) gets only their clusters, assignments, routes and catalog entries.
//! What routes agents to the right shard (a load balancer by path prefix, `/mcp/billing-`) is
//! outside toolgate; the patterns are made to be written there too.
//!
//! Everything not of one service (the aggregate endpoint's routes, policies, overrides, the
//! auth configuration) goes to every shard.

use std::fmt;

use envoy_types::pb::envoy::config::route::v3::{
    route_match::PathSpecifier, Route, RouteConfiguration,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use toolgate_model::auth::METADATA_PATH;
use toolgate_model::envoy::{SERVICE_CLUSTER_PREFIX, SERVICE_PATH_PREFIX};

use super::any::to_any;

/// Node metadata field (under `toolgate`) listing the services an Envoy serves.
pub const NODE_SERVICES_FIELD: &str = "services";

/// One pattern: a service name, or a name prefix followed by `*` (`*` alone: every service).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Exact(String),
    Prefix(String),
}

/// The services an Envoy serves: those matching any of its patterns. Empty: none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceSelector {
    patterns: Vec<Pattern>,
}

/// A pattern that is not a service name or a name prefix followed by `*`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("services[{index}] {pattern:?}: {reason}")]
pub struct PatternError {
    pub index: usize,
    pub pattern: String,
    pub reason: &'static str,
}

impl ServiceSelector {
    /// Parses patterns, each a service name (letters, digits, `_`, `.`, `-`) or such a prefix
    /// followed by one `*`. At least one.
    pub fn parse<S: AsRef<str>>(patterns: &[S]) -> Result<ServiceSelector, PatternError> {
        let error = |index: usize, pattern: &str, reason| PatternError {
            index,
            pattern: pattern.to_string(),
            reason,
        };
        if patterns.is_empty() {
            return Err(error(0, "", "at least one pattern is needed"));
        }
        let mut parsed = Vec::with_capacity(patterns.len());
        for (index, pattern) in patterns.iter().enumerate() {
            let pattern = pattern.as_ref();
            let (name, prefix) = match pattern.strip_suffix('*') {
                Some(name) => (name, true),
                None => (pattern, false),
            };
            if name.is_empty() && !prefix {
                return Err(error(index, pattern, "empty"));
            }
            if name.len() > toolgate_model::names::MAX_NAME_LEN {
                return Err(error(index, pattern, "longer than a service name may be"));
            }
            if name
                .chars()
                .any(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
            {
                return Err(error(
                    index,
                    pattern,
                    "a service name may hold only letters, digits, '_', '.', '-', and '*' only at the end",
                ));
            }
            parsed.push(if prefix {
                Pattern::Prefix(name.to_string())
            } else {
                Pattern::Exact(name.to_string())
            });
        }
        Ok(ServiceSelector { patterns: parsed })
    }

    /// Comma-separated patterns (the bootstrap's `--services`).
    pub fn parse_list(list: &str) -> Result<ServiceSelector, PatternError> {
        let patterns: Vec<&str> = list.split(',').map(str::trim).collect();
        ServiceSelector::parse(&patterns)
    }

    /// A selector that selects nothing: what an Envoy whose metadata names its services
    /// unreadably gets (serving every service instead could overload it).
    pub fn none() -> ServiceSelector {
        ServiceSelector::default()
    }

    pub fn selects(&self, service: &str) -> bool {
        self.patterns.iter().any(|p| match p {
            Pattern::Exact(name) => name == service,
            Pattern::Prefix(prefix) => service.starts_with(prefix.as_str()),
        })
    }

    /// The patterns as written, for node metadata.
    pub fn patterns(&self) -> Vec<String> {
        self.patterns
            .iter()
            .map(|p| match p {
                Pattern::Exact(name) => name.clone(),
                Pattern::Prefix(prefix) => format!("{prefix}*"),
            })
            .collect()
    }

    /// Whether a cluster or load assignment (named `mcp.<service>`) is this shard's. Names of
    /// other shapes are nobody's service: kept.
    pub fn selects_cluster(&self, name: &str) -> bool {
        name.strip_prefix(SERVICE_CLUSTER_PREFIX)
            .is_none_or(|service| self.selects(service))
    }

    /// The route configuration without the routes of other shards' services (their
    /// `/mcp/<service>` routes and their protected-resource metadata). `None` if `resource`
    /// is not a route configuration (then it goes unchanged).
    pub fn route_configuration(&self, resource: &Any) -> Option<Any> {
        let mut rc = RouteConfiguration::decode(resource.value.as_slice()).ok()?;
        for vhost in &mut rc.virtual_hosts {
            vhost
                .routes
                .retain(|route| route_service(route).is_none_or(|s| self.selects(s)));
        }
        Some(to_any(&rc))
    }

    /// The filter's plugin configuration (JSON) without the catalog entries of other shards'
    /// services: the filter keeps breakers only for what its catalog lists, and a new service
    /// elsewhere does not change this Envoy's configuration.
    pub fn plugin_config(&self, map: &mut serde_json::Map<String, serde_json::Value>) {
        for field in ["catalog", "legacy_revisions"] {
            if let Some(serde_json::Value::Object(services)) = map.get_mut(field) {
                services.retain(|service, _| self.selects(service));
            }
        }
    }
}

impl fmt::Display for ServiceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.patterns().join(","))
    }
}

/// The service a route belongs to: `/mcp/<service>` (a path-separated prefix) or that path's
/// protected-resource metadata; `None` for everything else.
fn route_service(route: &Route) -> Option<&str> {
    match route.r#match.as_ref()?.path_specifier.as_ref()? {
        PathSpecifier::PathSeparatedPrefix(path) => path.strip_prefix(SERVICE_PATH_PREFIX),
        PathSpecifier::Path(path) => path
            .strip_prefix(METADATA_PATH)?
            .strip_prefix(SERVICE_PATH_PREFIX),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_select_names_and_prefixes() {
        let s = ServiceSelector::parse_list("billing-*, search").unwrap();
        assert!(s.selects("billing-eu"));
        assert!(s.selects("billing-"));
        assert!(s.selects("search"));
        assert!(!s.selects("searchX"));
        assert!(!s.selects("billing"));
        assert_eq!(s.to_string(), "billing-*,search");
        assert!(ServiceSelector::parse(&["*"]).unwrap().selects("anything"));
        assert!(!ServiceSelector::none().selects("anything"));
    }

    #[test]
    fn bad_patterns_are_named() {
        let e = ServiceSelector::parse_list("a,b*c").unwrap_err();
        assert_eq!((e.index, e.pattern.as_str()), (1, "b*c"));
        let e = ServiceSelector::parse_list("a,,b").unwrap_err();
        assert_eq!((e.index, e.reason), (1, "empty"));
        assert!(ServiceSelector::parse_list("x/y").is_err());
        assert!(ServiceSelector::parse::<&str>(&[]).is_err());
        assert!(ServiceSelector::parse_list("**").is_err());
    }

    #[test]
    fn clusters_of_other_services_are_not_selected() {
        let s = ServiceSelector::parse_list("a*").unwrap();
        assert!(s.selects_cluster("mcp.alpha"));
        assert!(!s.selects_cluster("mcp.beta"));
        assert!(s.selects_cluster("toolgate_control"));
    }

    #[test]
    fn plugin_config_lists_only_its_services() {
        let mut map = serde_json::json!({
            "catalog": {"alpha": ["t"], "beta": ["u"]},
            "legacy_revisions": {"beta": "2025-06-18"},
            "services": {"beta": {}},
        });
        let serde_json::Value::Object(map) = &mut map else {
            unreachable!()
        };
        ServiceSelector::parse_list("alpha")
            .unwrap()
            .plugin_config(map);
        assert_eq!(map["catalog"], serde_json::json!({"alpha": ["t"]}));
        assert_eq!(map["legacy_revisions"], serde_json::json!({}));
        assert_eq!(map["services"], serde_json::json!({"beta": {}}));
    }
}
