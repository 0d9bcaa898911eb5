//! What Envoy needs to be an OAuth 2.1 resource server (issue 20), built from the auth
//! configuration: `jwt_authn`'s configuration (an ECDS resource), a cluster per remote JWKS,
//! and the Protected Resource Metadata routes (RFC 9728).
//!
//! Envoy verifies tokens (signature, `iss`, `aud` when configured, `exp`/`nbf`) and writes
//! the verified payload into a request header; it never refuses by itself
//! (`allow_missing_or_failed`). The toolgate filter decides: it knows which service or
//! virtual server a request is for, answers a 401 naming that resource's metadata URL and
//! counts the denial by service, and applies the per-tool rules. A client cannot forge the
//! payload header: the listener removes it from every request before any filter runs
//! (bootstrap: early header mutation).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use envoy_types::pb::envoy::config::cluster::v3::{
    cluster::{ClusterDiscoveryType, DiscoveryType},
    Cluster,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, data_source, header_value_option::HeaderAppendAction, http_uri,
    socket_address::PortSpecifier, transport_socket, Address, DataSource, HeaderValue,
    HeaderValueOption, HttpUri, SocketAddress, TransportSocket, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_match::PathSpecifier, DirectResponseAction, Route, RouteMatch,
};
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider::JwksSourceSpecifier, jwt_requirement::RequiresType,
    requirement_rule::RequirementType, JwksAsyncFetch, JwtAuthentication, JwtCacheConfig,
    JwtProvider, JwtRequirement, JwtRequirementOrList, RemoteJwks, RequirementRule,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::ValidationContextType, CertificateValidationContext, CommonTlsContext,
    UpstreamTlsContext,
};
use envoy_types::pb::google::protobuf::{Any, Duration, Empty};
use toolgate_model::auth::{
    parse_url, resource_metadata, AuthConfig, Jwks, FAILURE_METADATA_KEY, METADATA_PATH,
    PAYLOAD_HEADER,
};
use toolgate_model::envoy::{AGGREGATE_PATH, SERVICE_PATH_PREFIX, VIRTUAL_PATH_PREFIX};

use super::any::to_any;
use crate::routing::RoutingSnapshot;

/// Name of `jwt_authn` in the bootstrap's HTTP filter chain and of its ECDS resource.
pub const JWT_CONFIG_NAME: &str = "toolgate.jwt_authn";
pub const JWT_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication";
/// Prefix of the clusters the JWKS are fetched through.
pub const JWKS_CLUSTER_PREFIX: &str = "toolgate-jwks.";
/// Where Envoy finds the CAs it checks an `https://` JWKS server's certificate with.
pub const SYSTEM_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Verified tokens Envoy keeps per worker, so a token used again costs no signature check.
const JWT_CACHE_SIZE: u32 = 4096;

/// `jwt_authn`'s configuration: without an auth configuration, one that does nothing (no
/// provider, no rule), so the chain is the same either way and turning auth on or off is an
/// ECDS update, never a listener change.
pub fn jwt_extension_config(auth: Option<&AuthConfig>) -> Any {
    let config = auth.map(jwt_authentication).unwrap_or_default();
    to_any(&TypedExtensionConfig {
        name: JWT_CONFIG_NAME.to_string(),
        typed_config: Some(to_any(&config)),
    })
}

fn provider_name(i: usize) -> String {
    format!("issuer-{i}")
}

fn jwt_authentication(auth: &AuthConfig) -> JwtAuthentication {
    let providers: HashMap<String, JwtProvider> = auth
        .issuers
        .iter()
        .enumerate()
        .map(|(i, issuer)| {
            let jwks = match &issuer.jwks {
                Jwks::Remote(r) => JwksSourceSpecifier::RemoteJwks(RemoteJwks {
                    http_uri: Some(HttpUri {
                        uri: r.uri.clone(),
                        timeout: Some(millis(u64::from(r.timeout_ms))),
                        http_upstream_type: Some(http_uri::HttpUpstreamType::Cluster(
                            jwks_cluster_name(&r.uri).unwrap_or_default(),
                        )),
                    }),
                    cache_duration: Some(millis(u64::from(r.cache_secs) * 1000)),
                    // Fetched on the main thread for every worker, refreshed before expiry;
                    // a failed refresh keeps the keys held and is retried every second. The
                    // listener does not wait for an identity provider that is down: calls
                    // to protected services get 401 until the keys come, the rest flow.
                    async_fetch: Some(JwksAsyncFetch {
                        fast_listener: true,
                        failed_refetch_duration: Some(millis(1000)),
                    }),
                    retry_policy: None,
                }),
                Jwks::Inline(keys) => JwksSourceSpecifier::LocalJwks(DataSource {
                    specifier: Some(data_source::Specifier::InlineString(keys.to_string())),
                    ..Default::default()
                }),
            };
            let provider = JwtProvider {
                issuer: issuer.issuer.clone(),
                audiences: issuer.audiences.clone(),
                // No token passthrough: Envoy drops the Authorization header of a verified
                // request (the filter drops any other on protected routes).
                forward: false,
                forward_payload_header: PAYLOAD_HEADER.to_string(),
                failed_status_in_metadata: FAILURE_METADATA_KEY.to_string(),
                clock_skew_seconds: auth.clock_skew_secs,
                require_expiration: true,
                jwt_cache_config: auth.cache_verified_tokens.then(|| JwtCacheConfig {
                    jwt_cache_size: JWT_CACHE_SIZE,
                    ..Default::default()
                }),
                jwks_source_specifier: Some(jwks),
                ..Default::default()
            };
            (provider_name(i), provider)
        })
        .collect();
    // Every request's token is verified (any path: a call to `/mcp` is judged as the
    // service it reaches); none is refused here. With the token cache on, as any one issuer
    // or else nothing: Envoy consults its cache of verified tokens only for a requirement
    // that names a provider (a bare `allow_missing_or_failed` checks every signature).
    let mut any: Vec<JwtRequirement> = if auth.cache_verified_tokens {
        (0..auth.issuers.len())
            .map(|i| JwtRequirement {
                requires_type: Some(RequiresType::ProviderName(provider_name(i))),
            })
            .collect()
    } else {
        Vec::new()
    };
    any.push(JwtRequirement {
        requires_type: Some(RequiresType::AllowMissingOrFailed(Empty {})),
    });
    JwtAuthentication {
        providers,
        rules: vec![RequirementRule {
            r#match: Some(RouteMatch {
                path_specifier: Some(PathSpecifier::Prefix("/".to_string())),
                ..Default::default()
            }),
            requirement_type: Some(RequirementType::Requires(if any.len() == 1 {
                any.remove(0)
            } else {
                JwtRequirement {
                    requires_type: Some(RequiresType::RequiresAny(JwtRequirementOrList {
                        requirements: any,
                    })),
                }
            })),
        }],
        ..Default::default()
    }
}

fn millis(ms: u64) -> Duration {
    Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// The cluster a JWKS URL is fetched through: one per (scheme, host, port).
pub fn jwks_cluster_name(uri: &str) -> Option<String> {
    let url = parse_url(uri).ok()?;
    let scheme = if url.tls { "https" } else { "http" };
    Some(format!(
        "{JWKS_CLUSTER_PREFIX}{scheme}.{}.{}",
        url.host, url.port
    ))
}

/// The clusters of every remote JWKS, by name.
pub fn jwks_clusters(auth: &AuthConfig) -> BTreeMap<String, Cluster> {
    auth.issuers
        .iter()
        .filter_map(|i| match &i.jwks {
            Jwks::Remote(r) => Some(r.uri.as_str()),
            Jwks::Inline(_) => None,
        })
        .filter_map(|uri| Some((jwks_cluster_name(uri)?, parse_url(uri).ok()?)))
        .map(|(name, url)| {
            let ip = url.host.parse::<IpAddr>().ok();
            let endpoint = LbEndpoint {
                host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            address: url.host.clone(),
                            port_specifier: Some(PortSpecifier::PortValue(u32::from(url.port))),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            };
            let transport_socket = url.tls.then(|| TransportSocket {
                name: "envoy.transport_sockets.tls".to_string(),
                config_type: Some(transport_socket::ConfigType::TypedConfig(to_any(
                    &UpstreamTlsContext {
                        sni: url.host.clone(),
                        common_tls_context: Some(CommonTlsContext {
                            validation_context_type: Some(
                                ValidationContextType::ValidationContext(
                                    CertificateValidationContext {
                                        trusted_ca: Some(DataSource {
                                            specifier: Some(data_source::Specifier::Filename(
                                                SYSTEM_CA_FILE.to_string(),
                                            )),
                                            ..Default::default()
                                        }),
                                        ..Default::default()
                                    },
                                ),
                            ),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                ))),
            });
            let cluster = Cluster {
                name: name.clone(),
                // An address needs no resolver; a name is resolved by Envoy, and again as
                // its records say.
                cluster_discovery_type: Some(ClusterDiscoveryType::Type(if ip.is_some() {
                    DiscoveryType::Static as i32
                } else {
                    DiscoveryType::StrictDns as i32
                })),
                connect_timeout: Some(millis(2000)),
                load_assignment: Some(ClusterLoadAssignment {
                    cluster_name: name.clone(),
                    endpoints: vec![LocalityLbEndpoints {
                        lb_endpoints: vec![endpoint],
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                transport_socket,
                ..Default::default()
            };
            (name, cluster)
        })
        .collect()
}

/// The Protected Resource Metadata routes: the gateway's own document at
/// `/.well-known/oauth-protected-resource`, and one per service and virtual server at the
/// well-known path followed by its path (RFC 9728 §3.1), each answered by Envoy itself.
pub fn metadata_routes(snapshot: &RoutingSnapshot) -> Vec<Route> {
    let Some(auth) = snapshot.auth.as_deref() else {
        return Vec::new();
    };
    let mut paths = vec![String::new(), AGGREGATE_PATH.to_string()];
    paths.extend(
        snapshot
            .services
            .keys()
            .map(|s| format!("{SERVICE_PATH_PREFIX}{s}")),
    );
    let mut virtuals: Vec<&str> = snapshot
        .virtual_servers
        .iter()
        .map(String::as_str)
        .collect();
    if !virtuals.contains(&toolgate_model::virtual_server::DEFAULT_VIRTUAL) {
        virtuals.push(toolgate_model::virtual_server::DEFAULT_VIRTUAL);
    }
    paths.extend(
        virtuals
            .into_iter()
            .map(|v| format!("{VIRTUAL_PATH_PREFIX}{v}")),
    );
    paths
        .into_iter()
        .map(|path| metadata_route(auth, &path))
        .collect()
}

fn metadata_route(auth: &AuthConfig, path: &str) -> Route {
    let header = |key: &str, value: &str| HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: value.to_string(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    };
    Route {
        name: format!("oauth-protected-resource{path}"),
        r#match: Some(RouteMatch {
            path_specifier: Some(PathSpecifier::Path(format!("{METADATA_PATH}{path}"))),
            ..Default::default()
        }),
        action: Some(route::Action::DirectResponse(DirectResponseAction {
            status: 200,
            body: Some(DataSource {
                specifier: Some(data_source::Specifier::InlineString(
                    resource_metadata(auth, path).to_string(),
                )),
                ..Default::default()
            }),
            ..Default::default()
        })),
        response_headers_to_add: vec![
            header("content-type", "application/json"),
            // Browser-based clients read it across origins (RFC 9728 §3 allows any client).
            header("access-control-allow-origin", "*"),
            header("cache-control", "max-age=60"),
        ],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn config(jwks: serde_json::Value) -> AuthConfig {
        AuthConfig::parse(
            serde_json::json!({
                "resource": "https://gw.example.com",
                "authorization_servers": ["https://idp.example.com"],
                "scopes_supported": ["orders:read"],
                "issuers": [{"issuer": "https://idp.example.com", "jwks": jwks}]
            })
            .to_string()
            .as_bytes(),
        )
        .expect("valid")
    }

    #[test]
    fn a_remote_jwks_gets_a_cluster_and_a_provider_that_verifies_without_refusing() {
        let auth = config(
            serde_json::json!({"remote": {"uri": "https://idp.example.com/jwks", "cache_secs": 2}}),
        );
        let any = jwt_extension_config(Some(&auth));
        let tec = TypedExtensionConfig::decode(any.value.as_slice()).expect("decodes");
        assert_eq!(tec.name, JWT_CONFIG_NAME);
        let typed = tec.typed_config.expect("typed");
        assert_eq!(typed.type_url, JWT_TYPE_URL);
        let jwt = JwtAuthentication::decode(typed.value.as_slice()).expect("decodes");
        let p = &jwt.providers["issuer-0"];
        assert!(!p.forward);
        assert_eq!(p.forward_payload_header, PAYLOAD_HEADER);
        let Some(JwksSourceSpecifier::RemoteJwks(r)) = &p.jwks_source_specifier else {
            panic!("remote")
        };
        let uri = r.http_uri.as_ref().expect("uri");
        assert_eq!(
            uri.http_upstream_type,
            Some(http_uri::HttpUpstreamType::Cluster(
                "toolgate-jwks.https.idp.example.com.443".into()
            ))
        );
        assert_eq!(r.cache_duration, Some(millis(2000)));
        assert!(matches!(
            jwt.rules[0].requirement_type,
            Some(RequirementType::Requires(JwtRequirement {
                requires_type: Some(RequiresType::AllowMissingOrFailed(_))
            }))
        ));
        assert!(
            p.jwt_cache_config.is_none(),
            "a withdrawn key must stop verifying at once"
        );
        // With the token cache asked for, the providers are named (Envoy's cache needs it).
        let cached = AuthConfig {
            cache_verified_tokens: true,
            ..auth.clone()
        };
        let jwt = jwt_authentication(&cached);
        assert!(jwt.providers["issuer-0"].jwt_cache_config.is_some());
        let Some(RequirementType::Requires(JwtRequirement {
            requires_type: Some(RequiresType::RequiresAny(any)),
        })) = &jwt.rules[0].requirement_type
        else {
            panic!("requires_any")
        };
        assert_eq!(
            any.requirements[0].requires_type,
            Some(RequiresType::ProviderName("issuer-0".into()))
        );
        assert!(matches!(
            any.requirements[1].requires_type,
            Some(RequiresType::AllowMissingOrFailed(_))
        ));
        let clusters = jwks_clusters(&auth);
        let c = &clusters["toolgate-jwks.https.idp.example.com.443"];
        assert_eq!(
            c.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32))
        );
        assert!(c.transport_socket.is_some());
    }

    #[test]
    fn without_a_configuration_jwt_authn_does_nothing() {
        let any = jwt_extension_config(None);
        let tec = TypedExtensionConfig::decode(any.value.as_slice()).expect("decodes");
        let jwt = JwtAuthentication::decode(tec.typed_config.expect("typed").value.as_slice())
            .expect("decodes");
        assert!(jwt.providers.is_empty() && jwt.rules.is_empty());
    }

    #[test]
    fn every_service_and_virtual_server_has_its_metadata_document() {
        let auth = config(serde_json::json!({"inline": {"keys": [{"kty": "EC"}]}}));
        assert!(jwks_clusters(&auth).is_empty());
        let mut snapshot = RoutingSnapshot::empty();
        snapshot.services.insert(
            "orders".into(),
            std::sync::Arc::new(crate::routing::ServiceRoute {
                mcp_path: "/mcp".into(),
                limits: Default::default(),
                timeout_ms: 1000,
                endpoints: Vec::new(),
            }),
        );
        snapshot.auth = Some(std::sync::Arc::new(auth));
        let routes = metadata_routes(&snapshot);
        let paths: Vec<String> = routes
            .iter()
            .map(
                |r| match &r.r#match.as_ref().expect("match").path_specifier {
                    Some(PathSpecifier::Path(p)) => p.clone(),
                    _ => String::new(),
                },
            )
            .collect();
        assert_eq!(
            paths,
            [
                "/.well-known/oauth-protected-resource",
                "/.well-known/oauth-protected-resource/mcp",
                "/.well-known/oauth-protected-resource/mcp/orders",
                "/.well-known/oauth-protected-resource/virtual/default",
            ]
        );
        let Some(route::Action::DirectResponse(d)) = &routes[2].action else {
            panic!("direct")
        };
        let Some(data_source::Specifier::InlineString(body)) =
            &d.body.as_ref().expect("body").specifier
        else {
            panic!("inline")
        };
        let doc: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(doc["resource"], "https://gw.example.com/mcp/orders");
        assert_eq!(doc["scopes_supported"][0], "orders:read");
        assert_eq!(doc["bearer_methods_supported"][0], "header");
    }
}
