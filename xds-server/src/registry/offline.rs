//! What each virtual server lists, for the filters to answer `tools/list` on their own while
//! no toolgate-xds of the fleet answers (`FilterConfig::offline_listings`): every tool it
//! names, under the name shown there, with the definition the tool catalog last read (title,
//! description, inputSchema, outputSchema, annotations) and nothing that changes with the
//! fleet's state (no availability), so a breaker or a health change never changes it.
//!
//! Every worker of every Envoy parses the filters' configuration again at each change, so
//! this part is bounded: above [`BUDGET_BYTES`] every tool keeps only its name, an object
//! schema and a description saying so; if even that is over the budget, there are no
//! listings (the names are in the configuration's virtual servers already).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_json::{json, Map, Value};
use toolgate_model::virtual_server::VirtualRoutes;

/// The most the offline listings may weigh (JSON), all virtual servers together.
pub const BUDGET_BYTES: usize = 512 * 1024;

/// The fields of a definition a listing keeps.
const KEPT: [&str; 5] = [
    "title",
    "description",
    "inputSchema",
    "outputSchema",
    "annotations",
];

/// The description of a tool whose definition is not in the listing.
pub const NOT_READ: &str = "Not read from its server yet: its arguments are not described.";
pub const OMITTED: &str = "Its definition is not kept offline: its arguments are not described.";

/// How complete the listings are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Every tool with its definition as read.
    Full,
    /// Names only: the full listings were over the budget.
    NamesOnly,
    /// None: even the names were over the budget.
    Omitted,
}

/// The listings as the configuration carries them: a JSON object (virtual server → tools),
/// empty when there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfflineListings {
    pub json: String,
    pub form: Form,
    /// What the full listings weighed.
    pub full_bytes: usize,
}

/// The listings of `routes` (each virtual server's names) with `definitions` (by service,
/// as the tool catalog read them).
pub fn build(
    routes: &BTreeMap<String, VirtualRoutes>,
    definitions: &BTreeMap<String, Arc<Vec<Value>>>,
) -> OfflineListings {
    let by_tool: HashMap<&str, HashMap<&str, &Value>> = definitions
        .iter()
        .map(|(service, tools)| {
            let tools = tools
                .iter()
                .filter_map(|d| Some((d.get("name")?.as_str()?, d)))
                .collect();
            (service.as_str(), tools)
        })
        .collect();
    let listings = |full: bool| -> Map<String, Value> {
        routes
            .iter()
            .filter(|(_, r)| !r.tools.is_empty())
            .map(|(server, r)| {
                let tools = r
                    .tools
                    .iter()
                    .map(|(visible, target)| {
                        let def = by_tool
                            .get(target.service.as_str())
                            .and_then(|t| t.get(target.tool.as_str()));
                        match (full, def) {
                            (true, Some(def)) => listed(visible, def),
                            (true, None) => minimal(visible, NOT_READ),
                            (false, _) => minimal(visible, OMITTED),
                        }
                    })
                    .collect();
                (server.clone(), Value::Array(tools))
            })
            .collect()
    };
    let full = Value::Object(listings(true)).to_string();
    let full_bytes = full.len();
    if full_bytes <= BUDGET_BYTES {
        let json = if full == "{}" { String::new() } else { full };
        return OfflineListings {
            json,
            form: Form::Full,
            full_bytes,
        };
    }
    let names = Value::Object(listings(false)).to_string();
    if names.len() <= BUDGET_BYTES {
        return OfflineListings {
            json: names,
            form: Form::NamesOnly,
            full_bytes,
        };
    }
    OfflineListings {
        json: String::new(),
        form: Form::Omitted,
        full_bytes,
    }
}

/// A tool as listed: its definition's kept fields under its visible name; an object schema
/// when it has none.
fn listed(visible: &str, def: &Value) -> Value {
    let mut tool = Map::new();
    tool.insert("name".into(), json!(visible));
    for field in KEPT {
        if let Some(v) = def.get(field) {
            tool.insert(field.into(), v.clone());
        }
    }
    if !tool.get("inputSchema").is_some_and(Value::is_object) {
        tool.insert("inputSchema".into(), json!({"type": "object"}));
    }
    Value::Object(tool)
}

fn minimal(visible: &str, description: &str) -> Value {
    json!({"name": visible, "description": description, "inputSchema": {"type": "object"}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_model::virtual_server::VirtualTool;

    /// (visible name, service, tool)
    type Named<'a> = (&'a str, &'a str, &'a str);

    fn routes(servers: &[(&str, &[Named])]) -> BTreeMap<String, VirtualRoutes> {
        servers
            .iter()
            .map(|(name, tools)| {
                let tools = tools
                    .iter()
                    .map(|(visible, service, tool)| {
                        (
                            visible.to_string(),
                            VirtualTool {
                                service: service.to_string(),
                                tool: tool.to_string(),
                            },
                        )
                    })
                    .collect();
                (
                    name.to_string(),
                    VirtualRoutes {
                        tools,
                        ..VirtualRoutes::default()
                    },
                )
            })
            .collect()
    }

    #[test]
    fn each_server_lists_its_names_with_the_definitions_read_and_nothing_of_the_fleets_state() {
        let defs = BTreeMap::from([(
            "inv".to_string(),
            Arc::new(vec![json!({
                "name": "get_stock", "title": "Stock", "description": "Stock of an item.",
                "inputSchema": {"type": "object", "properties": {"sku": {"type": "string"}}},
                "outputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true},
                "icons": [{"src": "https://example.com/i.png"}], "_meta": {"x": 1}
            })]),
        )]);
        let r = routes(&[
            (
                "default",
                &[
                    ("inv__get_stock", "inv", "get_stock"),
                    ("fin__pay", "fin", "pay"),
                ],
            ),
            ("ops", &[("stock", "inv", "get_stock")]),
            ("empty", &[]),
        ]);
        let built = build(&r, &defs);
        assert_eq!(built.form, Form::Full);
        let v: Value = serde_json::from_str(&built.json).expect("JSON");
        assert_eq!(
            v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()),
            Some(vec!["default".to_string(), "ops".to_string()])
        );
        // In visible-name order, as `tools/list` shows them.
        assert_eq!(v["default"][0]["name"], "fin__pay");
        assert_eq!(v["default"][0]["description"], NOT_READ);
        assert_eq!(v["default"][0]["inputSchema"], json!({"type": "object"}));
        let stock = &v["default"][1];
        assert_eq!(
            stock,
            &json!({
                "name": "inv__get_stock", "title": "Stock", "description": "Stock of an item.",
                "inputSchema": {"type": "object", "properties": {"sku": {"type": "string"}}},
                "outputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true}
            })
        );
        assert_eq!(v["ops"][0]["name"], "stock");
        assert_eq!(v["ops"][0]["title"], "Stock");
        assert!(build(&BTreeMap::new(), &defs).json.is_empty());
    }

    #[test]
    fn over_the_budget_only_names_and_over_it_again_nothing() {
        let big = "x".repeat(4096);
        let tools: Vec<(String, String, String)> = (0..200)
            .map(|i| (format!("s__t{i}"), "s".to_string(), format!("t{i}")))
            .collect();
        let defs = BTreeMap::from([(
            "s".to_string(),
            Arc::new(
                (0..200)
                    .map(|i| json!({"name": format!("t{i}"), "description": big}))
                    .collect::<Vec<_>>(),
            ),
        )]);
        let refs: Vec<Named> = tools
            .iter()
            .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
            .collect();
        let built = build(&routes(&[("default", &refs)]), &defs);
        assert_eq!(built.form, Form::NamesOnly);
        assert!(built.full_bytes > BUDGET_BYTES);
        assert!(built.json.len() <= BUDGET_BYTES);
        let v: Value = serde_json::from_str(&built.json).expect("JSON");
        assert_eq!(v["default"].as_array().map(Vec::len), Some(200));
        assert_eq!(
            v["default"][0],
            json!({"name": "s__t0", "description": OMITTED, "inputSchema": {"type": "object"}})
        );

        let many: Vec<(String, String, String)> = (0..10_000)
            .map(|i| {
                (
                    format!("service{i:05}__tool"),
                    format!("service{i:05}"),
                    "tool".into(),
                )
            })
            .collect();
        let refs: Vec<Named> = many
            .iter()
            .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
            .collect();
        let built = build(&routes(&[("default", &refs)]), &BTreeMap::new());
        assert_eq!(built.form, Form::Omitted, "{} bytes", built.full_bytes);
        assert!(built.json.is_empty());
    }
}
