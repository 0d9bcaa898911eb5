//! The aggregate endpoint's calls (issue 19): `POST /mcp` (the virtual server `default`) and
//! `POST /virtual/<name>`. toolgate-xds answers everything there but `tools/call`, which the
//! filter sends to the owning service's own route (`/mcp/<service>`) with the tool's own name
//! restored, so the call is judged, limited and counted exactly as on that route.
//!
//! This module holds the plain parts: which paths are virtual, what name an agent sees for a
//! tool on one endpoint, and the byte-exact rewrite of `params.name`.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use toolgate_model::virtual_server::{VirtualRoutes, DEFAULT_VIRTUAL};

/// Where the virtual server `default` is served.
pub const DEFAULT_PATH: &str = toolgate_model::envoy::AGGREGATE_PATH;
/// Where every virtual server is served, by name.
pub const VIRTUAL_PREFIX: &str = toolgate_model::envoy::VIRTUAL_PATH_PREFIX;
/// Where a service's own route starts (toolgate-xds routes `/mcp/<service>` to its cluster).
pub const SERVICE_PREFIX: &str = toolgate_model::envoy::SERVICE_PATH_PREFIX;

/// What a request path addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'p> {
    /// `/mcp/<service>` (and below it, or with a query).
    Service(&'p str),
    /// `/mcp` or `/virtual/<name>`, with the query that followed, if any (`?` included).
    Virtual { server: &'p str, query: &'p str },
}

/// Reads a request path; `None` for a path the filter leaves alone.
pub fn target_of(path: &str) -> Option<Target<'_>> {
    let (bare, query) = match path.find('?') {
        Some(i) => path.split_at(i),
        None => (path, ""),
    };
    if bare == DEFAULT_PATH {
        return Some(Target::Virtual {
            server: DEFAULT_VIRTUAL,
            query,
        });
    }
    if let Some(name) = bare.strip_prefix(VIRTUAL_PREFIX) {
        // Only a name the naming rule allows: `/virtual/a/b`, `/virtual/` or an escaped name
        // is not a virtual path (and never reaches a service through this filter).
        return toolgate_model::validate_name("virtual server", name)
            .is_ok()
            .then_some(Target::Virtual {
                server: name,
                query,
            });
    }
    // Envoy routes `/mcp/<service>` by path-separated prefix: the service ends at `/` or `?`.
    let rest = path.strip_prefix(SERVICE_PREFIX)?;
    let service = rest.split(['/', '?']).next().unwrap_or_default();
    (!service.is_empty()).then_some(Target::Service(service))
}

/// The path an agent uses for a virtual server (named in replies).
pub fn endpoint_path(server: &str) -> String {
    if server == DEFAULT_VIRTUAL {
        DEFAULT_PATH.to_string()
    } else {
        format!("{VIRTUAL_PREFIX}{server}")
    }
}

/// The service's own route, keeping the agent's query.
pub fn service_path(service: &str, query: &str) -> String {
    let mut path = String::with_capacity(SERVICE_PREFIX.len() + service.len() + query.len());
    path.push_str(SERVICE_PREFIX);
    path.push_str(service);
    path.push_str(query);
    path
}

/// The name each virtual server shows for a (service, tool): the reverse of
/// [`VirtualRoutes::tools`], built once per configuration so that a semantic reply finds a
/// fallback tool's visible name by lookup, not by a scan of every tool.
#[derive(Debug, Default)]
pub struct VisibleNames {
    by_server: HashMap<String, HashMap<String, HashMap<String, String>>>,
}

impl VisibleNames {
    pub fn new(servers: &BTreeMap<String, VirtualRoutes>) -> VisibleNames {
        let mut by_server: HashMap<String, HashMap<String, HashMap<String, String>>> =
            HashMap::with_capacity(servers.len());
        for (server, routes) in servers {
            let services = by_server.entry(server.clone()).or_default();
            for (visible, t) in &routes.tools {
                services
                    .entry(t.service.clone())
                    .or_default()
                    .insert(t.tool.clone(), visible.clone());
            }
        }
        VisibleNames { by_server }
    }

    /// The name `server` shows for `tool` of `service`; `None` when it does not offer it.
    pub fn get(&self, server: &str, service: &str, tool: &str) -> Option<&str> {
        self.by_server
            .get(server)?
            .get(service)?
            .get(tool)
            .map(String::as_str)
    }
}

/// Where `part` (a slice the strict reader borrowed from `body`) lies in `body`; `None` if it
/// is not a slice of it.
pub fn span_in(body: &[u8], part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= body.len()).then_some(start..end)
}

/// `body` with the bytes at `span` (the JSON string that was `params.name`, quotes included)
/// replaced by the JSON string `name`: every other byte as the agent sent it. One allocation,
/// of the new body's exact size; `None` if `span` is not within `body`.
pub fn with_name(body: &[u8], span: Range<usize>, name: &str) -> Option<Vec<u8>> {
    let (before, after) = (body.get(..span.start)?, body.get(span.end..)?);
    let quoted = serde_json::to_string(name).ok()?;
    let mut out = Vec::with_capacity(before.len() + quoted.len() + after.len());
    out.extend_from_slice(before);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(after);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_model::virtual_server::VirtualTool;

    #[test]
    fn virtual_paths_are_exact_and_service_paths_keep_their_rule() {
        assert_eq!(
            target_of("/mcp"),
            Some(Target::Virtual {
                server: "default",
                query: ""
            })
        );
        assert_eq!(
            target_of("/mcp?x=1"),
            Some(Target::Virtual {
                server: "default",
                query: "?x=1"
            })
        );
        assert_eq!(
            target_of("/virtual/ops-tools"),
            Some(Target::Virtual {
                server: "ops-tools",
                query: ""
            })
        );
        for not_virtual in [
            "/virtual/",
            "/virtual/a/b",
            "/virtual/a%2Fb",
            "/virtual",
            "/mcpx",
            "/mcp/",
            "/",
            "/virtual/a b",
        ] {
            assert_eq!(target_of(not_virtual), None, "{not_virtual}");
        }
        let long = format!("/virtual/{}", "v".repeat(129));
        assert_eq!(target_of(&long), None);
        assert_eq!(target_of("/mcp/orders"), Some(Target::Service("orders")));
        assert_eq!(target_of("/mcp/orders?a"), Some(Target::Service("orders")));
        assert_eq!(target_of("/mcp/orders/x"), Some(Target::Service("orders")));
    }

    #[test]
    fn paths_of_endpoints_and_services() {
        assert_eq!(endpoint_path("default"), "/mcp");
        assert_eq!(endpoint_path("ops"), "/virtual/ops");
        assert_eq!(service_path("orders", "?a=1"), "/mcp/orders?a=1");
    }

    #[test]
    fn visible_names_are_found_by_service_and_tool() {
        let routes = VirtualRoutes {
            tools: BTreeMap::from([(
                "orders__read".to_string(),
                VirtualTool {
                    service: "orders".into(),
                    tool: "read".into(),
                },
            )]),
            ..VirtualRoutes::default()
        };
        let names = VisibleNames::new(&BTreeMap::from([("default".to_string(), routes)]));
        assert_eq!(names.get("default", "orders", "read"), Some("orders__read"));
        assert_eq!(names.get("default", "orders", "write"), None);
        assert_eq!(names.get("other", "orders", "read"), None);
    }

    #[test]
    fn the_name_is_replaced_and_nothing_else() {
        let body = br#"{"id":1,"params":{"name":"a\u005fb","arguments":{"name":"x"}}}"#;
        let text = std::str::from_utf8(body).expect("utf-8");
        let at = text.find(r#""a\u005fb""#).expect("name");
        let span = at..at + r#""a\u005fb""#.len();
        let out = with_name(body, span.clone(), "real_tool").expect("within the body");
        assert_eq!(
            std::str::from_utf8(&out).expect("utf-8"),
            r#"{"id":1,"params":{"name":"real_tool","arguments":{"name":"x"}}}"#
        );
        assert_eq!(span_in(body, &text[span.clone()]), Some(span));
        assert_eq!(span_in(body, "elsewhere"), None);
        assert_eq!(with_name(body, 5..500, "x"), None);
    }
}
