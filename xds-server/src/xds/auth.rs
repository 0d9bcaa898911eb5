//! What Envoy needs to be an OAuth 2.1 resource server, built from the auth configuration
//! and the keys toolgate-xds fetched for it: `jwt_authn`'s configuration (an ECDS resource,
//! every issuer's keys inline) and the Protected Resource Metadata routes (RFC 9728).
//!
//! Envoy verifies tokens (signature, `iss`, `aud` when configured, `exp`/`nbf`) and writes
//! the verified payload into a request header; it never refuses by itself
//! (`allow_missing_or_failed`). The toolgate filter decides: it knows which service or
//! virtual server a request is for, answers a 401 naming that resource's metadata URL and
//! counts the denial by service, and applies the per-tool rules. A client cannot forge the
//! payload header: the listener removes it from every request before any filter runs
//! (bootstrap: early header mutation).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    data_source, header_value_option::HeaderAppendAction, DataSource, HeaderValue,
    HeaderValueOption, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_match::PathSpecifier, DirectResponseAction, Route, RouteMatch,
};
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider::JwksSourceSpecifier, jwt_requirement::RequiresType,
    requirement_rule::RequirementType, JwtAuthentication, JwtCacheConfig, JwtProvider,
    JwtRequirement, JwtRequirementOrList, RequirementRule,
};
use envoy_types::pb::google::protobuf::{Any, Empty};
use toolgate_model::auth::{
    resource_metadata, AuthConfig, Jwks, FAILURE_METADATA_KEY, METADATA_PATH, PAYLOAD_HEADER,
};
use toolgate_model::envoy::{AGGREGATE_PATH, SERVICE_PATH_PREFIX, VIRTUAL_PATH_PREFIX};

use super::any::to_any;
use crate::routing::{FetchedKeys, RoutingSnapshot};

/// Name of `jwt_authn` in the bootstrap's HTTP filter chain and of its ECDS resource.
pub const JWT_CONFIG_NAME: &str = "toolgate.jwt_authn";
pub const JWT_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication";
/// What an issuer whose keys were never fetched verifies with: nothing (Envoy logs the set
/// as invalid and refuses its tokens), until a fetch succeeds.
const NO_KEYS: &str = r#"{"keys":[]}"#;
/// Verified tokens Envoy keeps per worker, so a token used again costs no signature check.
const JWT_CACHE_SIZE: u32 = 4096;

/// `jwt_authn`'s configuration: without an auth configuration, one that does nothing (no
/// provider, no rule), so the chain is the same either way and turning auth on or off is an
/// ECDS update, never a listener change. `None` while a remote JWKS has not been tried yet
/// (see [`FetchedKeys::tried`]): the configuration Envoy holds stays until then.
pub fn jwt_extension_config(
    auth: Option<&AuthConfig>,
    keys: &FetchedKeys,
    keep_tokens: bool,
) -> Option<Any> {
    let untried = auth.iter().flat_map(|a| &a.issuers).any(|i| match &i.jwks {
        Jwks::Remote(r) => !keys.tried.contains(&r.uri),
        Jwks::Inline(_) => false,
    });
    if untried {
        return None;
    }
    let config = auth
        .map(|a| jwt_authentication(a, keys, keep_tokens))
        .unwrap_or_default();
    Some(to_any(&TypedExtensionConfig {
        name: JWT_CONFIG_NAME.to_string(),
        typed_config: Some(to_any(&config)),
    }))
}

fn provider_name(i: usize) -> String {
    format!("issuer-{i}")
}

fn jwt_authentication(
    auth: &AuthConfig,
    keys: &FetchedKeys,
    keep_tokens: bool,
) -> JwtAuthentication {
    let providers: HashMap<String, JwtProvider> = auth
        .issuers
        .iter()
        .enumerate()
        .map(|(i, issuer)| {
            // Inline either way: Envoy fetches nothing from identity providers.
            let set = match &issuer.jwks {
                Jwks::Remote(r) => keys
                    .sets
                    .get(&r.uri)
                    .map_or(NO_KEYS.to_string(), |k| k.to_string()),
                Jwks::Inline(keys) => keys.to_string(),
            };
            let jwks = JwksSourceSpecifier::LocalJwks(DataSource {
                specifier: Some(data_source::Specifier::InlineString(set)),
                ..Default::default()
            });
            let provider = JwtProvider {
                issuer: issuer.issuer.clone(),
                audiences: issuer.audiences.clone(),
                // No token passthrough: Envoy drops the Authorization header of a verified
                // request (the filter drops any other on protected routes), unless a service's
                // credential is exchanged for it: then the filter reads it and drops it.
                forward: keep_tokens,
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

    fn decode(any: Any) -> JwtAuthentication {
        let tec = TypedExtensionConfig::decode(any.value.as_slice()).expect("decodes");
        assert_eq!(tec.name, JWT_CONFIG_NAME);
        let typed = tec.typed_config.expect("typed");
        assert_eq!(typed.type_url, JWT_TYPE_URL);
        JwtAuthentication::decode(typed.value.as_slice()).expect("decodes")
    }

    fn inline_set(p: &JwtProvider) -> &str {
        let Some(JwksSourceSpecifier::LocalJwks(DataSource {
            specifier: Some(data_source::Specifier::InlineString(set)),
            ..
        })) = &p.jwks_source_specifier
        else {
            panic!("inline keys")
        };
        set
    }

    #[test]
    fn a_remote_jwks_is_delivered_inline_once_fetched_and_verified_tokens_are_cached() {
        let uri = "https://idp.example.com/jwks";
        let auth = config(serde_json::json!({"remote": {"uri": uri, "cache_secs": 2}}));
        // Not tried yet: Envoy keeps what it holds.
        assert!(jwt_extension_config(Some(&auth), &FetchedKeys::default(), false).is_none());
        // Tried and failed: no keys, its tokens refused.
        let failed = FetchedKeys {
            tried: [uri.to_string()].into(),
            ..Default::default()
        };
        let none = decode(jwt_extension_config(Some(&auth), &failed, false).expect("built"));
        assert_eq!(inline_set(&none.providers["issuer-0"]), NO_KEYS);
        let fetched = FetchedKeys {
            sets: [(
                uri.to_string(),
                std::sync::Arc::from(r#"{"keys":[{"kid":"k1"}]}"#),
            )]
            .into(),
            tried: [uri.to_string()].into(),
        };
        let jwt = decode(jwt_extension_config(Some(&auth), &fetched, false).expect("built"));
        let p = &jwt.providers["issuer-0"];
        assert_eq!(inline_set(p), r#"{"keys":[{"kid":"k1"}]}"#);
        assert!(!p.forward);
        assert_eq!(p.forward_payload_header, PAYLOAD_HEADER);
        // Kept for the filter only while a service's credential is exchanged for it.
        let kept = decode(jwt_extension_config(Some(&auth), &fetched, true).expect("built"));
        assert!(kept.providers["issuer-0"].forward);
        // The token cache is on by default, with the providers named (Envoy's cache needs it)
        // and none refusing by itself.
        assert!(p.jwt_cache_config.is_some());
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
        // Turned off: every token's signature is checked.
        let uncached = AuthConfig {
            cache_verified_tokens: false,
            ..auth.clone()
        };
        let jwt = jwt_authentication(&uncached, &fetched, false);
        assert!(jwt.providers["issuer-0"].jwt_cache_config.is_none());
        assert!(matches!(
            jwt.rules[0].requirement_type,
            Some(RequirementType::Requires(JwtRequirement {
                requires_type: Some(RequiresType::AllowMissingOrFailed(_))
            }))
        ));
        // Same keys, same bytes: the cache Envoy holds stays warm.
        assert_eq!(
            jwt_extension_config(Some(&auth), &fetched, false),
            jwt_extension_config(Some(&auth), &fetched.clone(), false)
        );
    }

    #[test]
    fn without_a_configuration_jwt_authn_does_nothing() {
        let jwt =
            decode(jwt_extension_config(None, &FetchedKeys::default(), false).expect("built"));
        assert!(jwt.providers.is_empty() && jwt.rules.is_empty());
    }

    #[test]
    fn every_service_and_virtual_server_has_its_metadata_document() {
        let auth = config(serde_json::json!({"inline": {"keys": [{"kty": "EC"}]}}));
        let jwt = jwt_authentication(&auth, &FetchedKeys::default(), false);
        assert_eq!(
            inline_set(&jwt.providers["issuer-0"]),
            r#"{"keys":[{"kty":"EC"}]}"#
        );
        let mut snapshot = RoutingSnapshot::empty();
        snapshot.services.insert(
            "orders".into(),
            std::sync::Arc::new(crate::routing::ServiceRoute {
                mcp_path: "/mcp".into(),
                limits: Default::default(),
                timeout_ms: 1000,
                credential_header: None,
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
