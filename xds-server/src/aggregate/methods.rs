//! The answers of the aggregate endpoint, per method, from the listing built beforehand.

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::jsonrpc::{
    Revision, RpcError, INTERNAL_ERROR, INVALID_PARAMS, LEGACY, METHOD_NOT_FOUND,
};
use super::listing::{BadCursor, Listing};
use super::session::{fresh_nonce, SessionClaims, MAX_CLIENT_PARAMS_BYTES};

/// `serverInfo`: `toolgate/<virtual server>` and this build's version.
pub fn server_info(name: &str) -> Value {
    json!({"name": format!("toolgate/{name}"), "version": env!("CARGO_PKG_VERSION")})
}

/// Tools (clients are told when their list changes), and resources and prompts when a
/// serving service of this virtual server offers them.
pub fn capabilities(listing: &Listing) -> Value {
    listing.capabilities()
}

/// A result as the revision wants it: 2026-07-28 results carry `resultType` and the server's
/// identity in `_meta`.
fn finish(revision: Revision, name: &str, result: Map<String, Value>) -> Value {
    Value::Object(finish_map(revision, name, result))
}

fn finish_map(
    revision: Revision,
    name: &str,
    mut result: Map<String, Value>,
) -> Map<String, Value> {
    if revision == Revision::Modern {
        result.insert("resultType".into(), json!("complete"));
        let meta = result
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(m) = meta.as_object_mut() {
            m.insert(
                "io.modelcontextprotocol/serverInfo".into(),
                server_info(name),
            );
        }
    }
    result
}

/// `initialize` (legacy revisions): the result, and what the session id will carry.
pub fn initialize(
    name: &str,
    listing: &Listing,
    params: &Value,
) -> Result<(Value, SessionClaims), RpcError> {
    let requested = params
        .get("protocolVersion")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            RpcError::new(
                INVALID_PARAMS,
                "initialize: params.protocolVersion is required",
            )
        })?;
    let capabilities = params.get("capabilities").cloned().unwrap_or(json!({}));
    let client_info = params.get("clientInfo").cloned().unwrap_or(json!({}));
    if !capabilities.is_object() || !client_info.is_object() {
        return Err(RpcError::new(
            INVALID_PARAMS,
            "initialize: params.capabilities and params.clientInfo must be objects",
        ));
    }
    let size = capabilities.to_string().len() + client_info.to_string().len();
    if size > MAX_CLIENT_PARAMS_BYTES {
        return Err(RpcError::new(
            INVALID_PARAMS,
            format!(
                "initialize: capabilities and clientInfo take {size} bytes; at most \
                 {MAX_CLIENT_PARAMS_BYTES} bytes (4 KiB) are accepted"
            ),
        ));
    }
    let version = if LEGACY.contains(&requested) {
        requested
    } else {
        LEGACY[0]
    };
    let mut result = Map::new();
    result.insert("protocolVersion".into(), json!(version));
    result.insert("capabilities".into(), listing.legacy_capabilities());
    result.insert("serverInfo".into(), server_info(name));
    if let Some(i) = &listing.instructions {
        result.insert("instructions".into(), json!(i));
    }
    let claims = SessionClaims {
        virtual_server: name.to_string(),
        protocol_version: version.to_string(),
        client_info,
        capabilities,
        issued_ms: crate::fleet::now_ms(),
        nonce: fresh_nonce(),
    };
    Ok((Value::Object(result), claims))
}

/// `ping`.
pub fn ping(revision: Revision, name: &str) -> Value {
    finish(revision, name, Map::new())
}

/// `tools/list`'s result: one page of the listing, its tools as the JSON text written when
/// the listing was built.
#[derive(Debug, serde::Serialize)]
pub struct ListResult<'a> {
    tools: &'a [Box<RawValue>],
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `tools/list`: one page of the listing.
pub fn tools_list<'a>(
    revision: Revision,
    name: &str,
    listing: &'a Listing,
    params: &Value,
) -> Result<ListResult<'a>, RpcError> {
    let page = page_of(revision, name, listing, params, "tools/list")?;
    Ok(ListResult {
        tools: page.items,
        rest: page.rest,
    })
}

/// One page of a list: its items as JSON text, and the rest of the result (`nextCursor`...).
struct PageOf<'a> {
    items: &'a [Box<RawValue>],
    rest: Map<String, Value>,
}

/// The page of `list` after `params.cursor`.
fn page_of<'a>(
    revision: Revision,
    name: &str,
    list: &'a Listing,
    params: &Value,
    method: &str,
) -> Result<PageOf<'a>, RpcError> {
    let cursor = match params.get("cursor") {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) => Some(c.as_str()),
        Some(other) => {
            return Err(RpcError::new(
                INVALID_PARAMS,
                format!("{method}: the cursor must be a string, not {other}"),
            ))
        }
    };
    let page = list.page(cursor).map_err(|BadCursor(c)| {
        RpcError::new(
            INVALID_PARAMS,
            format!("{method}: invalid cursor {c:?} (use the nextCursor of a previous page)"),
        )
    })?;
    let mut rest = Map::new();
    if let Some(n) = page.next {
        rest.insert("nextCursor".into(), json!(n));
    }
    if revision == Revision::Modern {
        // Nothing in it depends on who asks; it changes with health, so it is stale at once
        // (listen for list_changed instead of polling).
        rest.insert("cacheScope".into(), json!("public"));
        rest.insert("ttlMs".into(), json!(0));
    }
    Ok(PageOf {
        items: page.rendered,
        rest: finish_map(revision, name, rest),
    })
}

/// A page of a list besides tools, its items under `key`.
#[derive(Debug)]
pub struct ItemsResult<'a> {
    key: &'static str,
    items: &'a [Box<RawValue>],
    rest: Map<String, Value>,
}

impl serde::Serialize for ItemsResult<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(1 + self.rest.len()))?;
        m.serialize_entry(self.key, self.items)?;
        for (k, v) in &self.rest {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// `resources/list`, `resources/templates/list`, `prompts/list`: one page of what toolgate-xds
/// read, with the cursors of `tools/list`; `None` for another method.
pub fn surface_list<'a>(
    revision: Revision,
    name: &str,
    listing: &'a Listing,
    method: &str,
    params: &Value,
) -> Option<Result<ItemsResult<'a>, RpcError>> {
    static EMPTY: std::sync::OnceLock<Listing> = std::sync::OnceLock::new();
    let surface = listing.surface.as_deref();
    let (key, list) = match method {
        "resources/list" => ("resources", surface.map(|s| &s.resources)),
        "resources/templates/list" => ("resourceTemplates", surface.map(|s| &s.templates)),
        "prompts/list" => ("prompts", surface.map(|s| &s.prompts)),
        _ => return None,
    };
    let list = list.unwrap_or_else(|| EMPTY.get_or_init(Listing::default));
    Some(
        page_of(revision, name, list, params, method).map(|page| ItemsResult {
            key,
            items: page.items,
            rest: page.rest,
        }),
    )
}

/// `server/discover` (2026-07-28).
pub fn discover(name: &str, listing: &Listing) -> Value {
    let mut result = Map::new();
    result.insert(
        "supportedVersions".into(),
        json!(super::jsonrpc::supported()),
    );
    result.insert("capabilities".into(), capabilities(listing));
    if let Some(i) = &listing.instructions {
        result.insert("instructions".into(), json!(i));
    }
    result.insert("cacheScope".into(), json!("public"));
    result.insert("ttlMs".into(), json!(0));
    finish(Revision::Modern, name, result)
}

/// The notifications a `subscriptions/listen` asks for, and those this server honours
/// (tool list changes only).
pub fn listen_filter(params: &Value) -> Result<Value, RpcError> {
    let asked = params.get("notifications").ok_or_else(|| {
        RpcError::new(
            INVALID_PARAMS,
            "subscriptions/listen: params.notifications is required",
        )
    })?;
    if !asked.is_object() {
        return Err(RpcError::new(
            INVALID_PARAMS,
            "subscriptions/listen: params.notifications must be an object",
        ));
    }
    let tools = asked.get("toolsListChanged").and_then(Value::as_bool) == Some(true);
    let mut honoured = Map::new();
    if tools {
        honoured.insert("toolsListChanged".into(), json!(true));
    }
    Ok(Value::Object(honoured))
}

/// The level of a `logging/setLevel`: one of RFC 5424's eight, as MCP names them.
pub fn log_level(params: &Value) -> Result<&str, RpcError> {
    const LEVELS: [&str; 8] = [
        "debug",
        "info",
        "notice",
        "warning",
        "error",
        "critical",
        "alert",
        "emergency",
    ];
    match params.get("level").and_then(Value::as_str) {
        Some(level) if LEVELS.contains(&level) => Ok(level),
        other => Err(RpcError::new(
            INVALID_PARAMS,
            format!(
                "logging/setLevel: params.level must be one of {}; got {}",
                LEVELS.join(", "),
                other.map_or_else(|| "none".to_string(), |l| format!("{l:?}"))
            ),
        )),
    }
}

/// Methods the filter routes to the service that offers what they name: reaching the catalog
/// means the request did not come through the gateway's MCP endpoint.
pub fn refused(method: &str) -> Option<RpcError> {
    match method {
        "tools/call"
        | "resources/read"
        | "resources/subscribe"
        | "resources/unsubscribe"
        | "prompts/get"
        | "completion/complete" => Some(RpcError::new(
            INTERNAL_ERROR,
            format!(
                "{method} is routed by the gateway to the service that offers what it names and \
                 should not reach the catalog; send it through the gateway's MCP endpoint"
            ),
        )),
        _ => None,
    }
}

/// Anything else.
pub fn unknown(method: &str) -> RpcError {
    RpcError::new(METHOD_NOT_FOUND, format!("Method not found: {method}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate::jsonrpc::{self, RpcError, UNSUPPORTED_VERSION};
    use crate::aggregate::listing::{render, Availability, Unavailable};
    use crate::aggregate::stream::{ACKNOWLEDGED, LIST_CHANGED, SUBSCRIPTION_ID};
    use toolgate_tests::schema::assert_valid;

    fn listing(n: usize) -> Listing {
        let def = json!({
            "name": "get_stock", "title": "Stock", "description": "Stock of an item.",
            "inputSchema": {"type": "object", "properties": {"sku": {"type": "string"}}},
            "outputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true}
        });
        let open = Availability {
            why: Unavailable::Open {
                until_ms: 1_800_000_000_000,
            },
            fallback: Some("inv__get_stock_cached".into()),
        };
        let tools = (0..n)
            .map(|i| {
                let name = format!("inv__t{i:03}");
                let t = match i % 3 {
                    0 => render(&name, Some(&def), None),
                    1 => render(&name, Some(&def), Some(&open)),
                    _ => render(&name, None, None),
                };
                (name, t)
            })
            .collect();
        Listing::of(Some("Inventory and finance tools.".into()), tools)
    }

    #[test]
    fn initialize_answers_the_clients_revision_or_the_newest() {
        for (asked, answered) in [
            ("2025-03-26", "2025-03-26"),
            ("2025-06-18", "2025-06-18"),
            ("2025-11-25", "2025-11-25"),
            ("2024-11-05", "2025-11-25"),
        ] {
            let params = json!({"protocolVersion": asked, "capabilities": {},
                "clientInfo": {"name": "agent", "version": "1"}});
            let (result, claims) = initialize("default", &listing(1), &params).expect("ok");
            assert_eq!(result["protocolVersion"], answered);
            assert_eq!(
                result["capabilities"],
                json!({"tools": {"listChanged": true}})
            );
            assert_eq!(result["serverInfo"]["name"], "toolgate/default");
            assert_eq!(result["instructions"], "Inventory and finance tools.");
            assert_eq!(claims.protocol_version, answered);
            assert_eq!(claims.client_info["name"], "agent");
            assert_valid(answered, "InitializeResult", &result);
            assert_valid(
                answered,
                "JSONRPCResponse",
                &jsonrpc::result(&json!(1), result),
            );
        }
    }

    #[test]
    fn initialize_refuses_oversized_or_malformed_parameters() {
        let big = json!({"protocolVersion": "2025-06-18",
            "capabilities": {"experimental": {"x": {"blob": "a".repeat(5000)}}},
            "clientInfo": {"name": "agent", "version": "1"}});
        let e = initialize("default", &listing(1), &big).unwrap_err();
        assert_eq!(e.code, INVALID_PARAMS);
        assert!(e.message.contains("4096"), "{}", e.message);
        let e = initialize("default", &listing(1), &json!({})).unwrap_err();
        assert!(e.message.contains("protocolVersion"));
        let e = initialize(
            "default",
            &listing(1),
            &json!({"protocolVersion": "2025-06-18", "capabilities": []}),
        )
        .unwrap_err();
        assert_eq!(e.code, INVALID_PARAMS);
    }

    fn as_value(page: Result<ListResult<'_>, RpcError>) -> Value {
        serde_json::to_value(page.expect("page")).expect("a page serializes")
    }

    #[test]
    fn tools_list_pages_validate_in_every_revision() {
        let l = listing(150);
        for version in ["2025-03-26", "2025-06-18", "2025-11-25"] {
            let first = as_value(tools_list(Revision::Legacy, "default", &l, &json!({})));
            assert_eq!(first["tools"].as_array().map(Vec::len), Some(100));
            assert_valid(version, "ListToolsResult", &first);
            let cursor = first["nextCursor"].as_str().expect("more").to_string();
            let second = as_value(tools_list(
                Revision::Legacy,
                "default",
                &l,
                &json!({"cursor": cursor}),
            ));
            assert_eq!(second["tools"].as_array().map(Vec::len), Some(50));
            assert!(second.get("nextCursor").is_none());
            assert_valid(version, "ListToolsResult", &second);
        }
        let modern = as_value(tools_list(Revision::Modern, "default", &l, &json!({})));
        assert_eq!(modern["resultType"], "complete");
        assert_valid("2026-07-28", "ListToolsResult", &modern);
        assert_valid(
            "2026-07-28",
            "ListToolsResultResponse",
            &jsonrpc::result(&json!("a"), modern),
        );
        let e =
            tools_list(Revision::Legacy, "default", &l, &json!({"cursor": "bogus"})).unwrap_err();
        assert_eq!(e.code, INVALID_PARAMS);
        assert!(e.message.contains("\"bogus\""), "{}", e.message);
    }

    #[test]
    fn resource_and_prompt_pages_validate_in_every_revision() {
        use crate::aggregate::listing::SurfaceListing;
        let mut l = listing(1);
        let resources = (0..120)
            .map(|i| {
                let uri = format!("demo://r/{i:03}");
                (uri.clone(), json!({"uri": uri, "name": format!("r{i}")}))
            })
            .collect();
        l.surface = Some(std::sync::Arc::new(SurfaceListing {
            resources: Listing::of(None, resources),
            templates: Listing::of(
                None,
                vec![(
                    "demo://t/{id}".into(),
                    json!({"uriTemplate": "demo://t/{id}", "name": "t"}),
                )],
            ),
            prompts: Listing::of(
                None,
                vec![("ev__p".into(), json!({"name": "ev__p", "arguments": []}))],
            ),
            offers_resources: true,
            offers_prompts: true,
            offers_logging: false,
            offers_completions: false,
            offers_subscribe: false,
        }));
        let page = |revision, method, params: Value| {
            let r = surface_list(revision, "default", &l, method, &params)
                .expect("a list method")
                .expect("a page");
            serde_json::to_value(r).expect("serializes")
        };
        for version in ["2025-03-26", "2025-06-18", "2025-11-25"] {
            let first = page(Revision::Legacy, "resources/list", json!({}));
            assert_eq!(first["resources"].as_array().map(Vec::len), Some(100));
            assert_valid(version, "ListResourcesResult", &first);
            let next = page(
                Revision::Legacy,
                "resources/list",
                json!({"cursor": first["nextCursor"]}),
            );
            assert_eq!(next["resources"].as_array().map(Vec::len), Some(20));
            assert_valid(
                version,
                "ListResourceTemplatesResult",
                &page(Revision::Legacy, "resources/templates/list", json!({})),
            );
            assert_valid(
                version,
                "ListPromptsResult",
                &page(Revision::Legacy, "prompts/list", json!({})),
            );
            let (result, _) = initialize(
                "default",
                &l,
                &json!({"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "a", "version": "1"}}),
            )
            .expect("initialize");
            assert_eq!(result["capabilities"]["resources"], json!({}));
            assert_eq!(result["capabilities"]["prompts"], json!({}));
            assert_valid(version, "InitializeResult", &result);
        }
        for (method, schema) in [
            ("resources/list", "ListResourcesResult"),
            ("resources/templates/list", "ListResourceTemplatesResult"),
            ("prompts/list", "ListPromptsResult"),
        ] {
            let modern = page(Revision::Modern, method, json!({}));
            assert_eq!(modern["resultType"], "complete");
            assert_valid("2026-07-28", schema, &modern);
        }
        assert_valid("2026-07-28", "DiscoverResult", &discover("default", &l));
        let e = surface_list(
            Revision::Legacy,
            "default",
            &l,
            "prompts/list",
            &json!({"cursor": "bogus"}),
        )
        .expect("a list method")
        .unwrap_err();
        assert!(
            e.message.starts_with("prompts/list: invalid cursor"),
            "{}",
            e.message
        );
        assert!(surface_list(Revision::Legacy, "default", &l, "tools/list", &json!({})).is_none());
    }

    #[test]
    fn discover_ping_and_listen_validate_for_2026() {
        let d = discover("default", &listing(1));
        assert_eq!(d["supportedVersions"][0], "2026-07-28");
        assert_valid("2026-07-28", "DiscoverResult", &d);
        assert_valid("2026-07-28", "Result", &ping(Revision::Modern, "default"));
        assert_eq!(ping(Revision::Legacy, "default"), json!({}));
        let honoured = listen_filter(
            &json!({"notifications": {"toolsListChanged": true, "promptsListChanged": true}}),
        )
        .expect("filter");
        assert_eq!(honoured, json!({"toolsListChanged": true}));
        let meta = json!({ SUBSCRIPTION_ID: 7 });
        let ack = jsonrpc::notification(
            ACKNOWLEDGED,
            Some(json!({"notifications": honoured, "_meta": meta})),
        );
        assert_valid("2026-07-28", "SubscriptionsAcknowledgedNotification", &ack);
        let changed = jsonrpc::notification(LIST_CHANGED, Some(json!({"_meta": meta})));
        assert_valid("2026-07-28", "ToolListChangedNotification", &changed);
        for v in ["2025-03-26", "2025-06-18", "2025-11-25"] {
            assert_valid(
                v,
                "ToolListChangedNotification",
                &jsonrpc::notification(LIST_CHANGED, None),
            );
        }
        assert!(listen_filter(&json!({})).is_err());
    }

    #[test]
    fn refusals_and_errors_validate() {
        // What the filter routes never reaches the catalog through the gateway.
        let e = refused("completion/complete").expect("refused");
        assert_eq!(e.code, INTERNAL_ERROR);
        assert!(e.message.contains("routed by the gateway"), "{}", e.message);
        assert!(refused("resources/subscribe").is_some());
        assert!(refused("logging/setLevel").is_none(), "answered here");
        assert_eq!(log_level(&json!({"level": "info"})).ok(), Some("info"));
        let bad = log_level(&json!({"level": "loud"})).expect_err("refused");
        assert_eq!(bad.code, INVALID_PARAMS);
        assert!(bad.message.contains("\"loud\""), "{}", bad.message);
        assert!(
            refused("resources/list").is_none(),
            "served from the listing"
        );
        assert_eq!(refused("prompts/get").map(|e| e.code), Some(INTERNAL_ERROR));
        assert_eq!(refused("tools/call").map(|e| e.code), Some(INTERNAL_ERROR));
        assert!(refused("tools/list").is_none());
        let response = e.to_response(Some(&json!(3)));
        for v in ["2025-03-26", "2025-06-18"] {
            assert_valid(v, "JSONRPCError", &response);
        }
        for v in ["2025-11-25", "2026-07-28"] {
            assert_valid(v, "JSONRPCErrorResponse", &response);
        }
        let unsupported = RpcError::new(UNSUPPORTED_VERSION, "Unsupported protocol version")
            .data(json!({"requested": "2099-01-01", "supported": jsonrpc::supported()}));
        assert_valid(
            "2026-07-28",
            "UnsupportedProtocolVersionError",
            &unsupported.to_response(Some(&json!(1))),
        );
    }
}
