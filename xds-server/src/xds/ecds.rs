//! ECDS: the wasm filter's configuration as an `envoy.config.core.v3.TypedExtensionConfig`.
//!
//! The plugin configuration (policies now; fleet state and overrides later) changes live; the
//! VM configuration does not, so Envoy keeps the same VM and the breaker state it holds in
//! shared data survives every configuration change.
//!
//! The path of the `.wasm` file is the Envoy's own business (its filesystem): its bootstrap
//! puts it in the node metadata (`toolgate.filter_path`) and each stream fills it in.

use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, data_source, AsyncDataSource, DataSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::wasm::v3::{
    plugin_config, FailurePolicy, PluginConfig, VmConfig,
};
use envoy_types::pb::google::protobuf::{Any, BoolValue, StringValue, Struct};
use prost::Message;

use super::any::to_any;

/// Name of the filter in the bootstrap's HTTP filter chain and of its ECDS resource.
pub const FILTER_CONFIG_NAME: &str = "toolgate.mcp";
/// One VM id for every worker: Envoy shares proxy-wasm shared data between VMs of one id.
pub const VM_ID: &str = "toolgate";
pub const ROOT_ID: &str = "toolgate";
/// Node metadata key under which the bootstrap names the filter file.
pub const NODE_METADATA_KEY: &str = "toolgate";
pub const NODE_FILTER_PATH_FIELD: &str = "filter_path";
/// Set to the access log's path when the bootstrap configures one: the filter then sets the
/// log's MCP fields, and skips those host calls otherwise.
pub const NODE_ACCESS_LOG_FIELD: &str = "access_log";
/// Set by a bootstrap that runs `jwt_authn` before the filter and strips the verified-payload
/// header from incoming requests (issue 20). An Envoy without it (an older bootstrap) gets
/// the auth configuration marked `untrusted_payload`: its filter then takes no payload
/// header as verified, and every route that needs a token refuses (fail closed), since a
/// client could have written that header itself.
pub const NODE_JWT_AUTHN_FIELD: &str = "jwt_authn";

/// What an Envoy's node metadata says about its filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFilter {
    /// Where this Envoy finds the wasm file.
    pub path: String,
    /// Whether its access log reads the filter's MCP fields.
    pub access_log: bool,
    /// Whether its bootstrap verifies tokens before the filter ([`NODE_JWT_AUTHN_FIELD`]).
    pub jwt_authn: bool,
}

/// The ECDS resource for a plugin configuration (JSON), with the filter path left empty.
pub fn extension_config(plugin_json: &str) -> Any {
    to_any(&typed_extension_config(plugin_json, ""))
}

/// Fills the node's filter path into a resource made by [`extension_config`], its node id
/// into the plugin configuration's `gateway` (the filter names itself with it in its breaker
/// events; Envoy does not show the node id to wasm reliably), the token its reports must
/// carry, if toolgate-xds requires one, and whether it writes an access log. A shard's
/// catalog lists only its services. Other resources (`jwt_authn`'s) are the same for all.
///
/// The plugin configuration that comes out is read with the filter's own parser before it is
/// returned: a configuration the filter refuses is an error (the parser's, naming the field),
/// never a resource, since a filter that refuses its configuration cannot judge with it.
pub fn for_node(
    resource: &Any,
    node: &NodeFilter,
    node_id: &str,
    report_token: Option<&str>,
    services: Option<&super::shard::ServiceSelector>,
) -> Result<Any, String> {
    let tec = TypedExtensionConfig::decode(resource.value.as_slice())
        .map_err(|e| format!("not an extension configuration: {e}"))?;
    if tec.name != FILTER_CONFIG_NAME {
        return Ok(resource.clone());
    }
    let wasm = tec
        .typed_config
        .as_ref()
        .and_then(|a| Wasm::decode(a.value.as_slice()).ok())
        .ok_or("not a wasm filter configuration")?;
    let plugin_json = wasm
        .config
        .as_ref()
        .and_then(|c| c.configuration.as_ref())
        .and_then(|a| StringValue::decode(a.value.as_slice()).ok())
        .map(|s| s.value)
        .unwrap_or_default();
    let Ok(serde_json::Value::Object(mut map)) =
        serde_json::from_str::<serde_json::Value>(&plugin_json)
    else {
        return Err("the plugin configuration is not a JSON object".into());
    };
    map.insert("gateway".into(), node_id.into());
    if let Some(token) = report_token {
        map.insert("report_token".into(), token.into());
    }
    if node.access_log {
        map.insert("access_log".into(), true.into());
    }
    if !node.jwt_authn {
        if let Some(serde_json::Value::Object(auth)) = map.get_mut("auth") {
            auth.insert("untrusted_payload".into(), true.into());
        }
    }
    drop_own_openings(&mut map, node_id);
    if let Some(services) = services {
        services.plugin_config(&mut map);
    }
    let plugin_json = serde_json::Value::Object(map).to_string();
    toolgate_model::policy::FilterConfig::from_json(plugin_json.as_bytes())
        .map_err(|e| e.to_string())?;
    let plugin_json = crate::failpoint::skew_filter_config(plugin_json);
    Ok(to_any(&typed_extension_config(&plugin_json, &node.path)))
}

/// Removes the fleet openings this Envoy reported itself: its breaker already holds them, and
/// a configuration change for nothing would replace the filter's root contexts, which
/// cancels their calls in flight (the very posts that report openings).
fn drop_own_openings(map: &mut serde_json::Map<String, serde_json::Value>, node_id: &str) {
    let Some(serde_json::Value::Object(services)) = map.get_mut("fleet_open") else {
        return;
    };
    for tools in services.values_mut() {
        if let serde_json::Value::Object(tools) = tools {
            tools.retain(|_, open| open["opened_by"] != node_id);
        }
    }
    services.retain(|_, tools| tools.as_object().is_none_or(|t| !t.is_empty()));
}

/// The filter an Envoy's node metadata names, if its bootstrap set a filter path.
pub fn node_filter(metadata: Option<&Struct>) -> Option<NodeFilter> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let toolgate = metadata?.fields.get(NODE_METADATA_KEY)?;
    let Some(Kind::StructValue(s)) = &toolgate.kind else {
        return None;
    };
    let string = |field: &str| match s.fields.get(field).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(v)) if !v.is_empty() => Some(v.clone()),
        _ => None,
    };
    Some(NodeFilter {
        path: string(NODE_FILTER_PATH_FIELD)?,
        access_log: string(NODE_ACCESS_LOG_FIELD).is_some(),
        jwt_authn: string(NODE_JWT_AUTHN_FIELD).is_some(),
    })
}

fn typed_extension_config(plugin_json: &str, path: &str) -> TypedExtensionConfig {
    let plugin = PluginConfig {
        name: FILTER_CONFIG_NAME.to_string(),
        root_id: ROOT_ID.to_string(),
        vm: Some(plugin_config::Vm::VmConfig(VmConfig {
            vm_id: VM_ID.to_string(),
            runtime: "envoy.wasm.runtime.v8".to_string(),
            code: Some(AsyncDataSource {
                specifier: Some(async_data_source::Specifier::Local(DataSource {
                    specifier: Some(data_source::Specifier::Filename(path.to_string())),
                    ..Default::default()
                })),
            }),
            ..Default::default()
        })),
        configuration: Some(to_any(&StringValue {
            value: plugin_json.to_string(),
        })),
        // A panic in the filter must not take a worker's traffic down with it: the next
        // request gets a fresh VM (breaker state lives in shared data and survives).
        failure_policy: FailurePolicy::FailReload as i32,
        // The filter reads the JSON-RPC body before routing decides anything.
        allow_on_headers_stop_iteration: Some(BoolValue { value: true }),
        ..Default::default()
    };
    TypedExtensionConfig {
        name: FILTER_CONFIG_NAME.to_string(),
        typed_config: Some(to_any(&Wasm {
            config: Some(plugin),
        })),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The plugin configuration (JSON) inside an ECDS resource.
    pub(crate) fn plugin_json(resource: &Any) -> String {
        let tec = TypedExtensionConfig::decode(resource.value.as_slice()).unwrap();
        let wasm = Wasm::decode(tec.typed_config.unwrap().value.as_slice()).unwrap();
        StringValue::decode(wasm.config.unwrap().configuration.unwrap().value.as_slice())
            .unwrap()
            .value
    }

    fn node(path: &str) -> NodeFilter {
        NodeFilter {
            path: path.to_string(),
            access_log: false,
            jwt_authn: true,
        }
    }

    #[test]
    fn the_path_is_filled_in_and_the_configuration_kept() {
        let any = extension_config(r#"{"x":1}"#);
        let filled = for_node(
            &any,
            &node("/opt/toolgate/filter.wasm"),
            "envoy-1",
            None,
            None,
        )
        .unwrap();
        let tec = TypedExtensionConfig::decode(filled.value.as_slice()).unwrap();
        assert_eq!(tec.name, FILTER_CONFIG_NAME);
        let wasm = Wasm::decode(tec.typed_config.unwrap().value.as_slice()).unwrap();
        let plugin = wasm.config.unwrap();
        let Some(plugin_config::Vm::VmConfig(vm)) = plugin.vm else {
            panic!("no vm config")
        };
        let Some(async_data_source::Specifier::Local(ds)) = vm.code.unwrap().specifier else {
            panic!("no local code")
        };
        assert_eq!(
            ds.specifier,
            Some(data_source::Specifier::Filename(
                "/opt/toolgate/filter.wasm".into()
            ))
        );
        let conf = StringValue::decode(plugin.configuration.unwrap().value.as_slice()).unwrap();
        assert_eq!(conf.value, r#"{"gateway":"envoy-1","x":1}"#);

        // An Envoy does not get back the openings it reported itself.
        let any = extension_config(
            r#"{"fleet_open":{"s":{"a":{"opened_by":"envoy-1","until_ms":9},"b":{"opened_by":"envoy-2","until_ms":9}},"t":{"c":{"opened_by":"envoy-1","until_ms":9}}}}"#,
        );
        let filled = for_node(&any, &node("/f.wasm"), "envoy-1", None, None).unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"fleet_open":{"s":{"b":{"opened_by":"envoy-2","until_ms":9}}},"gateway":"envoy-1"}"#
        );

        // The report token, when toolgate-xds requires one, is the filter's to send.
        let filled = for_node(
            &extension_config("{}"),
            &node("/f.wasm"),
            "envoy-1",
            Some("s3cret"),
            None,
        )
        .unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"gateway":"envoy-1","report_token":"s3cret"}"#
        );
        let config =
            toolgate_model::policy::FilterConfig::from_json(plugin_json(&filled).as_bytes())
                .expect("the filter reads it");
        assert_eq!(config.report_token.0, "s3cret");
        assert_eq!(format!("{:?}", config.report_token), "SecretString(set)");
        assert_eq!(
            plugin.allow_on_headers_stop_iteration,
            Some(BoolValue { value: true })
        );

        // An Envoy with an access log gets the filter's MCP fields; others are spared them.
        let logged = NodeFilter {
            access_log: true,
            ..node("/f.wasm")
        };
        let filled = for_node(&extension_config("{}"), &logged, "envoy-1", None, None).unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"access_log":true,"gateway":"envoy-1"}"#
        );

        // An older bootstrap (no `jwt_authn` before the filter): the payload header could be
        // a client's, so the filter is told to trust none.
        let old = NodeFilter {
            jwt_authn: false,
            ..node("/f.wasm")
        };
        let filled = for_node(
            &extension_config(r#"{"auth":{"resource":"http://gw"}}"#),
            &old,
            "e",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"auth":{"resource":"http://gw","untrusted_payload":true},"gateway":"e"}"#
        );
        let filled = for_node(
            &extension_config(r#"{"auth":{"resource":"http://gw"}}"#),
            &node("/f.wasm"),
            "e",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"auth":{"resource":"http://gw"},"gateway":"e"}"#
        );

        // A shard's catalog lists its services only.
        let shard = crate::xds::shard::ServiceSelector::parse_list("a*").unwrap();
        let filled = for_node(
            &extension_config(r#"{"catalog":{"alpha":["t"],"beta":["u"]}}"#),
            &node("/f.wasm"),
            "e",
            None,
            Some(&shard),
        )
        .unwrap();
        assert_eq!(
            plugin_json(&filled),
            r#"{"catalog":{"alpha":["t"]},"gateway":"e"}"#
        );
    }

    #[test]
    fn a_configuration_the_filter_would_refuse_is_never_made() {
        // A tool's open time above the default ceiling, with no service policy to raise it.
        let refused =
            extension_config(r#"{"services":{"orders":{"tools":{"pay":{"open_ms":400000}}}}}"#);
        let err = for_node(&refused, &node("/f.wasm"), "e", None, None).unwrap_err();
        assert!(
            err.contains("services.orders.tools.pay.max_open_ms"),
            "the error names the field: {err}"
        );
        // A field of the wrong type (as from a newer control plane's misuse) is refused too.
        let err = for_node(
            &extension_config(r#"{"max_body_bytes":"big"}"#),
            &node("/f.wasm"),
            "e",
            None,
            None,
        )
        .unwrap_err();
        assert!(
            err.contains("max_body_bytes") || err.contains("invalid type"),
            "{err}"
        );
        assert!(for_node(&extension_config("[]"), &node("/f.wasm"), "e", None, None).is_err());
        // Another filter's resource passes as it is.
        let jwt = crate::xds::auth::jwt_extension_config(None, &Default::default(), false)
            .expect("built");
        assert_eq!(
            for_node(&jwt, &node("/f.wasm"), "e", None, None).unwrap(),
            jwt
        );
    }

    #[test]
    fn the_node_metadata_names_the_filter_and_the_access_log() {
        use envoy_types::pb::google::protobuf::{value::Kind, Value};
        let string = |s: &str| Value {
            kind: Some(Kind::StringValue(s.to_string())),
        };
        let metadata = |fields: &[(&str, &str)]| Struct {
            fields: [(
                NODE_METADATA_KEY.to_string(),
                Value {
                    kind: Some(Kind::StructValue(Struct {
                        fields: fields
                            .iter()
                            .map(|(k, v)| (k.to_string(), string(v)))
                            .collect(),
                    })),
                },
            )]
            .into(),
        };
        // A bootstrap from before issue 20: no `jwt_authn` field.
        assert_eq!(
            node_filter(Some(&metadata(&[(NODE_FILTER_PATH_FIELD, "/f.wasm")]))),
            Some(NodeFilter {
                jwt_authn: false,
                ..node("/f.wasm")
            })
        );
        assert_eq!(
            node_filter(Some(&metadata(&[
                (NODE_FILTER_PATH_FIELD, "/f.wasm"),
                (NODE_JWT_AUTHN_FIELD, "1"),
                (NODE_ACCESS_LOG_FIELD, "/dev/stdout")
            ]))),
            Some(NodeFilter {
                access_log: true,
                ..node("/f.wasm")
            })
        );
        assert_eq!(
            node_filter(Some(&metadata(&[(NODE_ACCESS_LOG_FIELD, "/dev/stdout")]))),
            None
        );
        assert_eq!(node_filter(None), None);
    }
}
