//! What an Envoy's first request says about it (`set_node_on_first_message_only`): its id and
//! cluster, where it finds the wasm filter, and which services it serves. Both ADS variants
//! identify a node here and tailor its resources the same way.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::{value::Kind, Any};
use tracing::{error, info};

use super::connections::Connections;
use super::ecds::{self, NodeFilter, NODE_METADATA_KEY};
use super::resources::ResourceType;
use super::shard::{ServiceSelector, NODE_SERVICES_FIELD};
use crate::metrics::Metrics;

/// One Envoy, as its node says.
#[derive(Debug, Clone, Default)]
pub(super) struct NodeView {
    /// Empty until the first request names the node.
    pub id: String,
    /// Where this Envoy finds the wasm filter, for its ECDS resource.
    pub filter: Option<NodeFilter>,
    /// The services of a shard; `None`: every service.
    pub services: Option<ServiceSelector>,
}

impl NodeView {
    pub fn is_identified(&self) -> bool {
        !self.id.is_empty()
    }

    /// Reads the node of a stream's first request, records it in the connections table and
    /// logs the connection.
    pub fn identify(
        node: &Node,
        stream: u64,
        peer: Option<std::net::SocketAddr>,
        protocol: &'static str,
        connections: &Connections,
    ) -> NodeView {
        let services = match node_services(node) {
            Ok(services) => services,
            Err(e) => {
                // Every service instead could be more than this Envoy can hold: nothing, and
                // an error that says why it routes nothing.
                error!(node = %node.id, error = %e,
                    "the node metadata's toolgate.services is not a list of service patterns; this Envoy gets no service until its bootstrap is fixed");
                Some(ServiceSelector::none())
            }
        };
        let view = NodeView {
            id: node.id.clone(),
            filter: ecds::node_filter(node.metadata.as_ref()),
            services,
        };
        let shard = view.services.as_ref().map(ToString::to_string);
        connections.identified(stream, &node.id, &node.cluster, shard.clone());
        info!(node = %view.id, cluster = %node.cluster, stream, ?peer, protocol,
            services = shard.as_deref().unwrap_or("*"), "Envoy connected");
        view
    }

    /// Whether this Envoy gets resource `name` of `ty` at all: a shard gets only its
    /// services' clusters and assignments.
    pub fn serves(&self, ty: ResourceType, name: &str) -> bool {
        match (&self.services, ty) {
            (Some(services), ResourceType::Cluster | ResourceType::Endpoint) => {
                services.selects_cluster(name)
            }
            _ => true,
        }
    }

    /// `resource` as this Envoy gets it, when it is made per Envoy (its filter configuration;
    /// a shard's route configuration); `Ok(None)`: as it is. An error: a filter configuration
    /// the filter would refuse (see [`ecds::for_node`]).
    pub fn tailor(
        &self,
        ty: ResourceType,
        resource: &Any,
        report_token: Option<&str>,
    ) -> Result<Option<Any>, String> {
        match ty {
            ResourceType::Route => Ok(self
                .services
                .as_ref()
                .and_then(|s| s.route_configuration(resource))),
            ResourceType::ExtensionConfig => match self.filter.as_ref() {
                Some(filter) => ecds::for_node(
                    resource,
                    filter,
                    &self.id,
                    report_token,
                    self.services.as_ref(),
                )
                .map(Some),
                None => Ok(None),
            },
            _ => Ok(None),
        }
    }
}

/// What one stream keeps so that its Envoy never gets a filter configuration the filter would
/// refuse: the last one made for it that the filter accepts (per resource name), which it
/// keeps getting instead, and the source (hash) of the last refused one, so that a refusal is
/// logged and counted once, not at every push. Nothing at all is sent before a good one: the
/// Envoy keeps what it has (a new stream of a reconnecting Envoy), or waits.
#[derive(Debug, Default)]
pub(super) struct FilterGuard {
    last_good: HashMap<String, Any>,
    refused: HashMap<String, u64>,
}

/// What [`FilterGuard::tailor`] gives for a resource.
#[derive(Debug)]
pub(super) enum Tailored {
    /// Made for this Envoy (or the last good one made for it).
    Made(Any),
    /// Not made per Envoy: the resource as it is.
    AsIs,
    /// Nothing to send.
    Nothing,
}

impl FilterGuard {
    /// `resource` (named `name`, made from source `hash`) as `node` gets it: tailored, or the
    /// last good one if the filter would refuse it.
    #[allow(clippy::too_many_arguments)]
    pub fn tailor(
        &mut self,
        node: &NodeView,
        ty: ResourceType,
        name: &str,
        resource: &Any,
        hash: u64,
        report_token: Option<&str>,
        metrics: &Metrics,
    ) -> Tailored {
        match node.tailor(ty, resource, report_token) {
            Ok(Some(made)) => {
                if ty == ResourceType::ExtensionConfig {
                    self.refused.remove(name);
                    self.last_good.insert(name.to_string(), made.clone());
                }
                Tailored::Made(made)
            }
            Ok(None) => Tailored::AsIs,
            Err(error) => {
                if self.refused.insert(name.to_string(), hash) != Some(hash) {
                    metrics.filter_config_invalid.inc();
                    error!(node = %node.id, resource = name, %error,
                        kept_last_good = self.last_good.contains_key(name),
                        "not sending a filter configuration the filter would refuse; this \
                         Envoy keeps the last good one it was sent");
                }
                match self.last_good.get(name) {
                    Some(good) => Tailored::Made(good.clone()),
                    None => Tailored::Nothing,
                }
            }
        }
    }
}

impl std::fmt::Display for NodeView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id)
    }
}

/// `toolgate.services` of the node metadata: absent, every service; else a list of patterns.
fn node_services(node: &Node) -> Result<Option<ServiceSelector>, String> {
    let Some(toolgate) = node
        .metadata
        .as_ref()
        .and_then(|m| m.fields.get(NODE_METADATA_KEY))
    else {
        return Ok(None);
    };
    let Some(Kind::StructValue(fields)) = &toolgate.kind else {
        return Ok(None);
    };
    let Some(value) = fields.fields.get(NODE_SERVICES_FIELD) else {
        return Ok(None);
    };
    let Some(Kind::ListValue(list)) = &value.kind else {
        return Err("not a list".to_string());
    };
    let patterns = list
        .values
        .iter()
        .enumerate()
        .map(|(i, v)| match &v.kind {
            Some(Kind::StringValue(s)) => Ok(s.as_str()),
            _ => Err(format!("services[{i}] is not a string")),
        })
        .collect::<Result<Vec<&str>, String>>()?;
    ServiceSelector::parse(&patterns)
        .map(Some)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

    fn node(services: Option<Kind>) -> Node {
        let mut toolgate = Struct::default();
        if let Some(kind) = services {
            toolgate
                .fields
                .insert(NODE_SERVICES_FIELD.to_string(), Value { kind: Some(kind) });
        }
        let mut metadata = Struct::default();
        metadata.fields.insert(
            NODE_METADATA_KEY.to_string(),
            Value {
                kind: Some(Kind::StructValue(toolgate)),
            },
        );
        Node {
            id: "e1".to_string(),
            metadata: Some(metadata),
            ..Default::default()
        }
    }

    fn strings(items: &[&str]) -> Kind {
        Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue(s.to_string())),
                })
                .collect(),
        })
    }

    #[test]
    fn a_node_without_services_serves_every_service() {
        let view = NodeView::identify(&node(None), 1, None, "delta", &Connections::default());
        assert_eq!(view.services, None);
        assert!(view.serves(ResourceType::Cluster, "mcp.anything"));
    }

    #[test]
    fn a_shard_serves_its_clusters_and_assignments_only() {
        let view = NodeView::identify(
            &node(Some(strings(&["a*"]))),
            1,
            None,
            "delta",
            &Connections::default(),
        );
        assert!(view.serves(ResourceType::Cluster, "mcp.alpha"));
        assert!(view.serves(ResourceType::Endpoint, "mcp.alpha"));
        assert!(!view.serves(ResourceType::Cluster, "mcp.beta"));
        assert!(!view.serves(ResourceType::Endpoint, "mcp.beta"));
        assert!(view.serves(ResourceType::Route, "toolgate_routes"));
    }

    #[test]
    fn unreadable_services_select_nothing() {
        for bad in [
            Kind::StringValue("a*".to_string()),
            strings(&["a/b"]),
            Kind::ListValue(ListValue {
                values: vec![Value {
                    kind: Some(Kind::NumberValue(1.0)),
                }],
            }),
            strings(&[]),
        ] {
            let view =
                NodeView::identify(&node(Some(bad)), 1, None, "sotw", &Connections::default());
            assert_eq!(view.services, Some(ServiceSelector::none()));
            assert!(!view.serves(ResourceType::Cluster, "mcp.alpha"));
        }
    }
}
