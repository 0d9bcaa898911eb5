//! The route configurations assembled from each service's routes, encoded once.
//!
//! A route configuration is one resource holding two routes per service (in the shared one,
//! per service with routes of its own), so every new service with routes of its own sends all
//! of it again. Building and encoding 2,000 routes for each new service took
//! toolgate-xds 1.7 ms on an idle core and 8-13 ms beside a busy Envoy (the bench's new
//! service at 10,000 instances), all of it before the first byte went out. A service's routes
//! depend only on its name, path and timeout, so they are encoded when those change and kept;
//! a new configuration is the routes before the services', the kept bytes in the services'
//! order, and the rest of the virtual host, concatenated.
//!
//! The result is byte for byte what prost makes of [`resources::route_configuration`] (a
//! test holds it to that), so versions and content hashes are unchanged: protobuf writes a
//! repeated field as one record per element, and prost writes a message's fields in the order
//! they are declared, which for `VirtualHost` begins with `name`, `domains`, `routes`.

use std::sync::Arc;

use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, VirtualHost};
use envoy_types::pb::google::protobuf::Any;
use prost::encoding;
use prost::{Message, Name};

use super::resources;
use crate::bootstrap::RouteTable;
use crate::routing::{RoutingSnapshot, ServiceRoute};

/// `RouteConfiguration.virtual_hosts`.
const VIRTUAL_HOSTS_TAG: u32 = 2;
/// `VirtualHost.routes`.
const ROUTES_TAG: u32 = 3;

/// Each service's routes, encoded as records of `VirtualHost.routes`; persistent, so the next
/// version shares all but the changed services.
pub type EncodedRoutes = imbl::OrdMap<String, Arc<[u8]>>;

/// Whether a service's routes differ between `old` and `new` (what [`encode_service`] reads).
pub fn routes_differ(old: Option<&ServiceRoute>, new: &ServiceRoute) -> bool {
    old.is_none_or(|old| old.mcp_path != new.mcp_path || old.timeout_ms != new.timeout_ms)
}

/// A service's routes as records of `VirtualHost.routes`.
pub fn encode_service(service: &str, route: &ServiceRoute) -> Arc<[u8]> {
    let mut buf = Vec::new();
    encoding::message::encode_repeated(
        ROUTES_TAG,
        &resources::service_routes(service, route),
        &mut buf,
    );
    buf.into()
}

/// The route configuration `table` of `snapshot`, with the services' routes taken from
/// `encoded`, which must hold exactly `snapshot`'s services, each encoded from its current
/// route: [`resources::route_configuration`], or for the shared table
/// [`resources::shared_route_configuration`] (only the services with routes of their own, then
/// the shared routes).
pub fn assemble(snapshot: &RoutingSnapshot, encoded: &EncodedRoutes, table: RouteTable) -> Any {
    let shared = table == RouteTable::Shared;
    debug_assert_eq!(encoded.len(), snapshot.services.len());
    let mut rest = resources::virtual_host(snapshot);
    let head = VirtualHost {
        name: std::mem::take(&mut rest.name),
        domains: std::mem::take(&mut rest.domains),
        routes: std::mem::take(&mut rest.routes),
        ..Default::default()
    };
    let mut host = head.encode_to_vec();
    // Both maps are ordered by service name and hold the same names.
    let kept: Vec<&[u8]> = snapshot
        .services
        .iter()
        .zip(encoded.iter())
        .filter(|((name, route), (encoded_name, _))| {
            debug_assert_eq!(name, encoded_name);
            !shared || resources::has_own_routes(route, snapshot.default_timeout_ms)
        })
        .map(|(_, (_, routes))| &routes[..])
        .collect();
    host.reserve(kept.iter().map(|b| b.len()).sum());
    for routes in kept {
        host.extend_from_slice(routes);
    }
    if shared {
        encoding::message::encode_repeated(
            ROUTES_TAG,
            &resources::shared_service_routes(snapshot.default_timeout_ms),
            &mut host,
        );
    }
    encoding::message::encode(ROUTES_TAG, &resources::unknown_virtual_route(), &mut host);
    host.extend_from_slice(&rest.encode_to_vec());

    let mut value = RouteConfiguration {
        name: table.config_name().to_string(),
        ..Default::default()
    }
    .encode_to_vec();
    encoding::bytes::encode(VIRTUAL_HOSTS_TAG, &host, &mut value);
    Any {
        type_url: RouteConfiguration::type_url(),
        value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{Bulkhead, ServiceRoutes};
    use crate::xds::any::to_any;
    use std::time::Instant;

    fn route(path: &str, timeout_ms: u64) -> ServiceRoute {
        ServiceRoute {
            mcp_path: path.into(),
            limits: Bulkhead::default(),
            timeout_ms,
            endpoints: Vec::new(),
            credential_header: None,
        }
    }

    fn snapshot(services: ServiceRoutes, virtual_servers: &[&str]) -> RoutingSnapshot {
        RoutingSnapshot {
            generation: 1,
            changed_at: Instant::now(),
            traces: Default::default(),
            recent: Arc::from([]),
            services,
            filter_config: Arc::from("{}"),
            filter_urgency: 0,
            virtual_servers: virtual_servers.iter().map(|s| s.to_string()).collect(),
            max_body_bytes: 4096,
            default_timeout_ms: 60_000,
            auth: None,
            jwks: Default::default(),
            keep_caller_tokens: false,
            credentials: Default::default(),
            control: Default::default(),
        }
    }

    fn encode_all(services: &ServiceRoutes) -> EncodedRoutes {
        services
            .iter()
            .map(|(name, route)| (name.clone(), encode_service(name, route)))
            .collect()
    }

    #[test]
    fn the_assembled_configuration_is_prosts_encoding_of_the_built_one() {
        let none = snapshot(ServiceRoutes::new(), &[]);
        let services: ServiceRoutes = [
            ("billing", route("/mcp", 30_000)),
            ("inventory", route("/", 60_000)),
            ("a-long-service-name-of-many-bytes", route("/x/mcp", 1)),
        ]
        .into_iter()
        .map(|(n, r)| (n.to_string(), r))
        .collect();
        // Enough routes that the virtual host's length takes a three-byte varint.
        let many: ServiceRoutes = (0..1000)
            // Every third with the default path and timeout: shared routes in the shared table.
            .map(|i| {
                let timeout = if i % 3 == 0 { 60_000 } else { 1000 + i };
                (format!("s{i}"), route("/mcp", timeout))
            })
            .collect();
        for snap in [
            none,
            snapshot(services.clone(), &[]),
            snapshot(services, &["ops", "default"]),
            snapshot(many, &["ops"]),
        ] {
            let encoded = encode_all(&snap.services);
            for (table, built) in [
                (
                    RouteTable::PerService,
                    resources::route_configuration(&snap),
                ),
                (
                    RouteTable::Shared,
                    resources::shared_route_configuration(&snap),
                ),
            ] {
                let assembled = assemble(&snap, &encoded, table);
                let built = to_any(&built);
                assert_eq!(assembled.type_url, built.type_url);
                assert!(
                    assembled.value == built.value,
                    "{} services, {table:?}: assembled bytes differ from the built configuration's",
                    snap.services.len()
                );
            }
        }
    }

    #[test]
    fn only_a_path_or_timeout_change_re_encodes_a_service() {
        let base = route("/mcp", 60_000);
        let mut endpoints_only = base.clone();
        endpoints_only.limits.max_requests += 1;
        assert!(routes_differ(None, &base));
        assert!(!routes_differ(Some(&base), &endpoints_only));
        assert!(routes_differ(Some(&base), &route("/", 60_000)));
        assert!(routes_differ(Some(&base), &route("/mcp", 1)));
    }
}
