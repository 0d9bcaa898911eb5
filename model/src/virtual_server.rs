//! Virtual servers: one MCP endpoint over the tools of many services (`<prefix>virtual/<name>`).
//!
//! A virtual server is a selection: which services, which of their tools (glob patterns), how
//! the tools are named to the agent, and whether a tool that cannot work right now is shown
//! with a note or hidden. The default one (`default`, served at `/mcp`) offers every tool of
//! every service, prefixed, unless `<prefix>virtual/default` says otherwise.
//!
//! Names an agent sees must not change because an unrelated service registered later, so a
//! conflict is always settled in favour of the service that has been registered the longest
//! (the smallest etcd create revision among its live instance keys, then the service name):
//! see [`resolve`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::names::{validate_name, MAX_NAME_LEN};

/// The virtual server served at `/mcp`.
pub const DEFAULT_VIRTUAL: &str = "default";
/// Between the service and the tool in a prefixed name (`inventory__get_stock`).
pub const SEPARATOR: &str = "__";
/// Patterns per list, and characters per pattern.
pub const MAX_PATTERNS: usize = 64;
pub const MAX_PATTERN_LEN: usize = 2 * MAX_NAME_LEN + 1;
/// Services a virtual server may list by name.
pub const MAX_SERVICES: usize = 1024;
/// The longest description kept.
pub const MAX_DESCRIPTION_LEN: usize = 1024;

/// How the agent sees a tool's name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Naming {
    /// Always `<service>__<tool>`.
    #[default]
    Prefixed,
    /// The tool's own name; where two services offer the same name, the longest-registered
    /// service keeps it and the others' tools are offered as `<service>__<tool>`.
    Bare,
}

/// What `tools/list` does with a tool that cannot work right now (no UP instance, breaker
/// open fleet-wide, forced open by an operator).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenUnavailable {
    /// Listed, with `_meta["io.toolgate/availability"]` and a sentence in its description.
    #[default]
    Annotate,
    /// Not listed until it works again.
    Hide,
}

/// The definition stored at `<prefix>virtual/<name>`. Unknown fields are refused: a typo in
/// `exclude` must not silently offer a tool the operator meant to withhold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VirtualServer {
    /// The services offered; empty: every registered service.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<String>,
    /// Only tools matching one of these are offered; empty: every tool. A pattern with a `/`
    /// matches `<service>/<tool>`, one without matches the tool name; `*` matches any run of
    /// characters, `?` one character.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    /// Tools matching one of these are never offered (wins over `include`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    pub naming: Naming,
    pub unavailable: WhenUnavailable,
    /// Shown to the agent as the server's `instructions`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// Why a definition was refused, with the field it is about (`services[2]`, `include[0]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for VirtualError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for VirtualError {}

fn error(field: impl Into<String>, message: impl Into<String>) -> VirtualError {
    VirtualError {
        field: field.into(),
        message: message.into(),
    }
}

impl VirtualServer {
    /// Every server (all services, prefixed, annotated): what `/mcp` offers when no
    /// `<prefix>virtual/default` exists.
    pub fn everything() -> Self {
        VirtualServer::default()
    }

    /// Parses and validates a stored value.
    pub fn parse(value: &[u8]) -> Result<Self, VirtualError> {
        let parsed: VirtualServer =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value))
                .map_err(|e| {
                    let path = e.path().to_string();
                    let field = if path == "." || path == "?" {
                        "value".to_string()
                    } else {
                        path
                    };
                    error(
                        field,
                        format!("not a virtual server definition: {}", e.inner()),
                    )
                })?;
        parsed.validate()?;
        Ok(parsed)
    }

    /// The structural rules: names, patterns, sizes. Whether the services exist is the admin
    /// API's question (a service may be between instances when a stored value is read).
    pub fn validate(&self) -> Result<(), VirtualError> {
        if self.services.len() > MAX_SERVICES {
            return Err(error(
                "services",
                format!(
                    "lists {} services; at most {MAX_SERVICES} are allowed",
                    self.services.len()
                ),
            ));
        }
        let mut seen = BTreeSet::new();
        for (i, s) in self.services.iter().enumerate() {
            validate_name("service", s)
                .map_err(|e| error(format!("services[{i}]"), e.to_string()))?;
            if !seen.insert(s) {
                return Err(error(
                    format!("services[{i}]"),
                    format!("{s:?} is listed twice"),
                ));
            }
        }
        for (list, patterns) in [("include", &self.include), ("exclude", &self.exclude)] {
            if patterns.len() > MAX_PATTERNS {
                return Err(error(
                    list,
                    format!(
                        "has {} patterns; at most {MAX_PATTERNS} are allowed",
                        patterns.len()
                    ),
                ));
            }
            for (i, p) in patterns.iter().enumerate() {
                check_pattern(p).map_err(|m| error(format!("{list}[{i}]"), m))?;
            }
        }
        if let Some(d) = &self.description {
            if d.chars().count() > MAX_DESCRIPTION_LEN {
                return Err(error(
                    "description",
                    format!("is longer than {MAX_DESCRIPTION_LEN} characters"),
                ));
            }
        }
        Ok(())
    }

    /// Whether the service is offered at all.
    pub fn offers_service(&self, service: &str) -> bool {
        self.services.is_empty() || self.services.iter().any(|s| s == service)
    }

    /// Whether the tool of the service is offered (service selected, included, not excluded).
    pub fn offers(&self, service: &str, tool: &str) -> bool {
        self.offers_service(service)
            && (self.include.is_empty() || self.include.iter().any(|p| matches(p, service, tool)))
            && !self.exclude.iter().any(|p| matches(p, service, tool))
    }
}

fn check_pattern(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("is empty".to_string());
    }
    if p.chars().count() > MAX_PATTERN_LEN {
        return Err(format!("is longer than {MAX_PATTERN_LEN} characters"));
    }
    if p.matches('/').count() > 1 {
        return Err(format!(
            "{p:?} has more than one '/' (the form is <service>/<tool>)"
        ));
    }
    if let Some(ch) = p
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '*' | '?' | '/')))
    {
        return Err(format!(
            "{p:?} contains {ch:?}; only name characters, '*', '?' and one '/' are allowed"
        ));
    }
    Ok(())
}

/// Whether a pattern matches the tool of the service.
pub fn matches(pattern: &str, service: &str, tool: &str) -> bool {
    match pattern.split_once('/') {
        Some((s, t)) => {
            glob(s.as_bytes(), service.as_bytes()) && glob(t.as_bytes(), tool.as_bytes())
        }
        None => glob(pattern.as_bytes(), tool.as_bytes()),
    }
}

/// `*` and `?` glob, iterative with one backtrack point: linear enough for names of 128
/// characters, and no recursion a hostile pattern could deepen.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// A tool as the agent sees it on one virtual server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtualTool {
    pub service: String,
    pub tool: String,
}

/// What the filter needs of one virtual server: the names the agent may call and what each
/// calls, and where its prompts and resources are. Built by toolgate-xds ([`resolve`],
/// [`resolve_resources`]) and delivered in the filter's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VirtualRoutes {
    pub tools: BTreeMap<String, VirtualTool>,
    /// Prompts by visible name (named like tools); `tool` is the prompt's own name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub prompts: BTreeMap<String, VirtualTool>,
    /// Resources by the URI the agent sees; `tool` is the URI its server wrote.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub resources: BTreeMap<String, VirtualTool>,
    /// Resource templates as the agent sees them, oldest service first: a URI that is no
    /// listed resource goes to the first whose template it matches.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub templates: Vec<VirtualTemplate>,
}

/// A resource template as the agent sees it on one virtual server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtualTemplate {
    /// The template as listed (prefixed with `toolgate+<service>:` when another service
    /// offers the same one).
    pub visible: String,
    pub service: String,
}

/// The scheme prefix of a URI rewritten because two services offer it:
/// `toolgate+<service>:<the server's URI>`.
pub const URI_PREFIX: &str = "toolgate+";

/// The URI an agent sees for `uri` of `service` when an older service offers the same one.
pub fn prefixed_uri(service: &str, uri: &str) -> String {
    format!("{URI_PREFIX}{service}:{uri}")
}

/// The service and the server's URI of a rewritten URI; `None` for any other.
pub fn unprefixed_uri(uri: &str) -> Option<(&str, &str)> {
    let (service, inner) = uri.strip_prefix(URI_PREFIX)?.split_once(':')?;
    validate_name("service", service).ok()?;
    Some((service, inner))
}

/// Whether `uri` is one of the URIs an RFC 6570 template makes: its literal parts in order,
/// each expression standing for any run of characters (a query expression `{?a,b}` also for
/// none). Loose on purpose: it only picks the server to ask, which judges the URI itself.
pub fn template_matches(template: &str, uri: &str) -> bool {
    if template.len() > MAX_URI_LEN || uri.len() > MAX_URI_LEN {
        return false;
    }
    // `None` stands for an expression.
    let mut pattern: Vec<Option<u8>> = Vec::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        pattern.extend(rest[..open].bytes().map(Some));
        let Some(close) = rest[open..].find('}') else {
            return false;
        };
        pattern.push(None);
        rest = &rest[open + close + 1..];
    }
    pattern.extend(rest.bytes().map(Some));
    matches_pattern(&pattern, uri.as_bytes())
}

/// The longest URI or template routed by its template.
pub const MAX_URI_LEN: usize = 2048;

/// [`glob`] over a pattern whose wildcards are `None`: linear enough for [`MAX_URI_LEN`].
fn matches_pattern(pattern: &[Option<u8>], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(Some(c)) if *c == text[t] => {
                p += 1;
                t += 1;
            }
            Some(None) => {
                star = Some((p, t));
                p += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(Option::is_none)
}

impl VirtualRoutes {
    /// The service and the server's URI of a URI an agent reads here: a listed resource, a
    /// rewritten URI of a service offered here, else the first template it matches, else the
    /// one service offering resources here if there is only one.
    pub fn resource_target(&self, uri: &str) -> Option<(String, String)> {
        if let Some(t) = self.resources.get(uri) {
            return Some((t.service.clone(), t.tool.clone()));
        }
        if let Some((service, inner)) = unprefixed_uri(uri) {
            let offered = self.resources.values().any(|t| t.service == service)
                || self.templates.iter().any(|t| t.service == service);
            return offered.then(|| (service.to_string(), inner.to_string()));
        }
        if let Some(t) = self
            .templates
            .iter()
            .find(|t| template_matches(&t.visible, uri))
        {
            return Some((t.service.clone(), uri.to_string()));
        }
        // A URI nothing listed names, where only one service offers resources: that service
        // is the only one that can know it (servers accept URIs they do not list), and it
        // judges the URI itself. With several, the gateway cannot guess and says so.
        let mut services = self
            .resources
            .values()
            .map(|t| &t.service)
            .chain(self.templates.iter().map(|t| &t.service));
        let only = services.next()?;
        services
            .all(|s| s == only)
            .then(|| (only.clone(), uri.to_string()))
    }

    /// The URI an agent of this endpoint is shown for `uri` of `service` (in a listing, a
    /// notification, a resource link or an embedded resource): the server's own where a read
    /// of it here leads back to that resource, else `toolgate+<service>:<uri>`, which always
    /// leads back to it while the service offers resources. Inverse of [`Self::resource_target`].
    pub fn shown_uri<'u>(&self, service: &str, uri: &'u str) -> std::borrow::Cow<'u, str> {
        match self.resource_target(uri) {
            Some((s, own)) if s == service && own == uri => std::borrow::Cow::Borrowed(uri),
            _ => std::borrow::Cow::Owned(prefixed_uri(service, uri)),
        }
    }

    /// The name the agent sees for a tool of a service on this endpoint, if it is offered.
    pub fn visible_name(&self, service: &str, tool: &str) -> Option<&str> {
        self.tools
            .iter()
            .find(|(_, t)| t.service == service && t.tool == tool)
            .map(|(name, _)| name.as_str())
    }
}

/// A service as [`resolve`] needs it: its age (the smallest create revision among its live
/// instance keys) and its tools.
#[derive(Debug, Clone)]
pub struct ServiceTools<'a> {
    pub service: &'a str,
    pub since_revision: i64,
    pub tools: Vec<&'a str>,
}

/// A tool [`resolve`] could not name, and why (logged by toolgate-xds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unnamed {
    pub service: String,
    pub tool: String,
    pub reason: String,
}

/// The names a tool of a service may get on `vs`, in the order they are tried.
fn candidates(vs: &VirtualServer, service: &str, tool: &str) -> Vec<String> {
    let prefixed = format!("{service}{SEPARATOR}{tool}");
    match vs.naming {
        Naming::Prefixed => vec![prefixed],
        Naming::Bare => vec![tool.to_string(), prefixed],
    }
}

/// The services whose age can change what [`resolve`] gives for `vs`: those with a tool that
/// could be named what another tool could (a contest the older service wins), or that
/// cannot be named at all (its place in the list of unnamed tools follows the ages). The
/// ages of the others decide nothing: toolgate-xds resolves again only when an age among
/// these changes, not whenever an instance replaces a service's oldest one.
pub fn order_sensitive<'a>(
    vs: &VirtualServer,
    services: impl IntoIterator<Item = (&'a str, &'a [&'a str])>,
) -> BTreeSet<&'a str> {
    let mut claims: BTreeMap<String, BTreeSet<(&'a str, &'a str)>> = BTreeMap::new();
    let mut sensitive = BTreeSet::new();
    for (service, tools) in services {
        if !vs.offers_service(service) {
            continue;
        }
        for tool in tools.iter().copied() {
            if !vs.offers(service, tool) {
                continue;
            }
            let names: Vec<String> = candidates(vs, service, tool)
                .into_iter()
                .filter(|n| n.len() <= MAX_NAME_LEN)
                .collect();
            if names.is_empty() {
                sensitive.insert(service);
            }
            for name in names {
                claims.entry(name).or_default().insert((service, tool));
            }
        }
    }
    for claimants in claims.values().filter(|c| c.len() > 1) {
        sensitive.extend(claimants.iter().map(|(service, _)| *service));
    }
    sensitive
}

/// The names of one virtual server's tools. Services are taken oldest first, so a name once
/// given stays with its tool while the tool's service lives, whatever registers later.
pub fn resolve(vs: &VirtualServer, services: &[ServiceTools<'_>]) -> (VirtualRoutes, Vec<Unnamed>) {
    let mut order: Vec<&ServiceTools<'_>> = services
        .iter()
        .filter(|s| vs.offers_service(s.service))
        .collect();
    order.sort_by(|a, b| (a.since_revision, a.service).cmp(&(b.since_revision, b.service)));
    let mut routes = VirtualRoutes::default();
    let mut unnamed = Vec::new();
    for s in order {
        for tool in &s.tools {
            if !vs.offers(s.service, tool) {
                continue;
            }
            let candidates = candidates(vs, s.service, tool);
            let entry = VirtualTool {
                service: s.service.to_string(),
                tool: tool.to_string(),
            };
            let mut named = false;
            for name in &candidates {
                if name.len() > MAX_NAME_LEN {
                    continue;
                }
                if !routes.tools.contains_key(name) {
                    routes.tools.insert(name.clone(), entry.clone());
                    named = true;
                    break;
                }
            }
            if !named {
                let reason = match candidates.iter().find(|n| n.len() <= MAX_NAME_LEN) {
                    Some(n) => format!(
                        "{n:?} is taken by {} of a service registered earlier",
                        routes
                            .tools
                            .get(n)
                            .map(|t| format!("{}/{}", t.service, t.tool))
                            .unwrap_or_default()
                    ),
                    None => format!("its name would be longer than {MAX_NAME_LEN} characters"),
                };
                unnamed.push(Unnamed {
                    service: s.service.to_string(),
                    tool: tool.to_string(),
                    reason,
                });
            }
        }
    }
    (routes, unnamed)
}

/// A service's resources as [`resolve_resources`] needs them: its age, its resources' URIs
/// and its templates.
#[derive(Debug, Clone)]
pub struct ServiceResources<'a> {
    pub service: &'a str,
    pub since_revision: i64,
    pub uris: Vec<&'a str>,
    pub templates: Vec<&'a str>,
}

/// The resources and templates of one virtual server's services. A URI (or template) keeps
/// the server's text unless an older service offers the same: then it is
/// `toolgate+<service>:<uri>`, which is never taken by a server (no two services share a
/// name), so every resource of every offered service is reachable and a URI an agent once
/// saw stays with its resource while both services live.
pub fn resolve_resources(
    vs: &VirtualServer,
    services: &[ServiceResources<'_>],
) -> (BTreeMap<String, VirtualTool>, Vec<VirtualTemplate>) {
    let mut order: Vec<&ServiceResources<'_>> = services
        .iter()
        .filter(|s| vs.offers_service(s.service))
        .collect();
    order.sort_by(|a, b| (a.since_revision, a.service).cmp(&(b.since_revision, b.service)));
    let mut resources = BTreeMap::new();
    let mut templates: Vec<VirtualTemplate> = Vec::new();
    let mut seen_templates = BTreeSet::new();
    for s in order {
        for uri in &s.uris {
            let visible = if resources.contains_key(*uri) {
                prefixed_uri(s.service, uri)
            } else {
                uri.to_string()
            };
            resources.entry(visible).or_insert_with(|| VirtualTool {
                service: s.service.to_string(),
                tool: uri.to_string(),
            });
        }
        for t in &s.templates {
            let visible = if seen_templates.contains(*t) {
                prefixed_uri(s.service, t)
            } else {
                t.to_string()
            };
            if seen_templates.insert(visible.clone()) {
                templates.push(VirtualTemplate {
                    visible,
                    service: s.service.to_string(),
                });
            }
        }
    }
    (resources, templates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colliding_uris_are_prefixed_for_the_younger_service_and_route_back() {
        let vs = VirtualServer::everything();
        let services = [
            ServiceResources {
                service: "beta",
                since_revision: 9,
                uris: vec!["secret://report", "b://only"],
                templates: vec!["file:///{path}"],
            },
            ServiceResources {
                service: "alpha",
                since_revision: 3,
                uris: vec!["secret://report"],
                templates: vec!["file:///{path}", "demo://text/{id}"],
            },
        ];
        let (resources, templates) = resolve_resources(&vs, &services);
        let names: Vec<&str> = resources.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "b://only",
                "secret://report",
                "toolgate+beta:secret://report"
            ]
        );
        assert_eq!(resources["secret://report"].service, "alpha");
        let routes = VirtualRoutes {
            resources,
            templates,
            ..VirtualRoutes::default()
        };
        let target = |u: &str| routes.resource_target(u);
        assert_eq!(
            target("toolgate+beta:secret://report"),
            Some(("beta".into(), "secret://report".into()))
        );
        assert_eq!(
            target("secret://report"),
            Some(("alpha".into(), "secret://report".into()))
        );
        // A rewritten URI that no listed resource has, by the service's templates.
        assert_eq!(
            target("toolgate+beta:file:///etc/x"),
            Some(("beta".into(), "file:///etc/x".into()))
        );
        assert_eq!(
            target("file:///etc/x"),
            Some(("alpha".into(), "file:///etc/x".into()))
        );
        assert_eq!(
            target("demo://text/7"),
            Some(("alpha".into(), "demo://text/7".into()))
        );
        assert_eq!(target("toolgate+gamma:secret://report"), None);
        assert_eq!(target("nothing://here"), None);
        // Shown back: every URI a service writes leads to it again when read here.
        for (service, own, shown) in [
            ("alpha", "secret://report", "secret://report"),
            ("beta", "secret://report", "toolgate+beta:secret://report"),
            ("beta", "b://only", "b://only"),
            ("beta", "file:///etc/x", "toolgate+beta:file:///etc/x"),
            ("alpha", "file:///etc/x", "file:///etc/x"),
            ("beta", "unlisted://x", "toolgate+beta:unlisted://x"),
        ] {
            assert_eq!(routes.shown_uri(service, own), shown, "{service} {own}");
            assert_eq!(
                target(shown),
                Some((service.to_string(), own.to_string())),
                "{shown}"
            );
        }
        let only_alpha = VirtualServer {
            services: vec!["alpha".into()],
            ..VirtualServer::default()
        };
        let (resources, _) = resolve_resources(&only_alpha, &services);
        assert_eq!(resources.len(), 1, "beta is not offered there");
    }

    #[test]
    fn templates_match_their_literal_parts_only() {
        assert!(template_matches("demo://text/{id}", "demo://text/1"));
        assert!(!template_matches("demo://text/{id}", "demo://blob/1"));
        assert!(template_matches("a{x}b{y}c", "a1b2c"));
        assert!(!template_matches("what?{x}", "whatX1"));
        assert!(template_matches("what?{x}", "what?1"));
        assert!(template_matches("q{?a,b}", "q"));
        assert!(!template_matches("broken{x", "broken1"));
    }

    fn svc<'a>(service: &'a str, since: i64, tools: &[&'a str]) -> ServiceTools<'a> {
        ServiceTools {
            service,
            since_revision: since,
            tools: tools.to_vec(),
        }
    }

    #[test]
    fn only_contested_or_unnameable_services_are_order_sensitive() {
        let long = "x".repeat(MAX_NAME_LEN + 1);
        let tools: Vec<(&str, Vec<&str>)> = vec![
            ("inv", vec!["read", "write"]),
            ("pay", vec!["read", "charge"]),
            ("solo", vec!["unique"]),
            ("a__b", vec!["c"]),
            ("a", vec!["b__c"]),
            ("big", vec![long.as_str()]),
        ];
        let of = |vs: &VirtualServer| -> Vec<&str> {
            order_sensitive(vs, tools.iter().map(|(s, t)| (*s, t.as_slice())))
                .into_iter()
                .collect()
        };
        let bare: VirtualServer = serde_json::from_str(r#"{"naming":"bare"}"#).unwrap();
        assert_eq!(of(&bare), ["a", "a__b", "big", "inv", "pay"]);
        assert_eq!(of(&VirtualServer::everything()), ["a", "a__b", "big"]);
        // Whatever the ages of the others, the result is the same.
        let with = |solo: i64, inv: i64| {
            let services: Vec<ServiceTools<'_>> = tools
                .iter()
                .map(|(s, t)| {
                    let since = match *s {
                        "solo" => solo,
                        "inv" => inv,
                        _ => 5,
                    };
                    svc(s, since, t)
                })
                .collect();
            resolve(&VirtualServer::everything(), &services)
        };
        assert_eq!(with(1, 1), with(9, 9));
    }

    #[test]
    fn prefixed_names_carry_the_service() {
        let (routes, unnamed) = resolve(
            &VirtualServer::everything(),
            &[
                svc("inventory", 5, &["get_stock"]),
                svc("finance", 9, &["get_stock"]),
            ],
        );
        assert!(unnamed.is_empty());
        let names: Vec<_> = routes.tools.keys().cloned().collect();
        assert_eq!(names, ["finance__get_stock", "inventory__get_stock"]);
        assert_eq!(
            routes.visible_name("finance", "get_stock"),
            Some("finance__get_stock")
        );
    }

    #[test]
    fn a_bare_name_stays_with_the_service_registered_first() {
        let vs = VirtualServer {
            naming: Naming::Bare,
            ..VirtualServer::default()
        };
        let before = resolve(&vs, &[svc("zeta", 3, &["search"])]).0;
        assert_eq!(before.tools["search"].service, "zeta");
        // "alpha" sorts first by name but registered later: "search" stays zeta's.
        let after = resolve(
            &vs,
            &[svc("alpha", 7, &["search"]), svc("zeta", 3, &["search"])],
        )
        .0;
        assert_eq!(after.tools["search"].service, "zeta");
        assert_eq!(after.tools["alpha__search"].service, "alpha");
    }

    #[test]
    fn a_conflict_with_no_free_name_is_reported() {
        let (routes, unnamed) = resolve(
            &VirtualServer::everything(),
            &[svc("a__b", 1, &["c"]), svc("a", 2, &["b__c"])],
        );
        assert_eq!(routes.tools["a__b__c"].service, "a__b");
        assert_eq!(unnamed.len(), 1);
        assert!(unnamed[0].reason.contains("a__b/c"), "{:?}", unnamed[0]);
    }

    #[test]
    fn include_and_exclude_select_tools() {
        let vs = VirtualServer {
            services: vec!["orders".into(), "inventory".into()],
            include: vec!["read_*".into(), "inventory/*".into()],
            exclude: vec!["*/read_secret".into()],
            ..VirtualServer::default()
        };
        assert!(vs.offers("orders", "read_order"));
        assert!(!vs.offers("orders", "write_order"));
        assert!(vs.offers("inventory", "write_stock"));
        assert!(!vs.offers("orders", "read_secret"));
        assert!(!vs.offers("billing", "read_order"));
    }

    #[test]
    fn globs_match_like_a_shell() {
        assert!(glob(b"*", b""));
        assert!(glob(b"a*c", b"abbbc"));
        assert!(glob(b"a?c", b"abc"));
        assert!(!glob(b"a?c", b"ac"));
        assert!(glob(b"*x*y*", b"aaxbbyc"));
        assert!(!glob(b"*x*y", b"aaxbbyc"));
    }

    #[test]
    fn bad_definitions_name_their_field() {
        let e = VirtualServer::parse(br#"{"services":["ok","bad name"]}"#).unwrap_err();
        assert_eq!(e.field, "services[1]");
        let e = VirtualServer::parse(br#"{"include":["a/b/c"]}"#).unwrap_err();
        assert_eq!(e.field, "include[0]");
        let e = VirtualServer::parse(br#"{"naming":"sideways"}"#).unwrap_err();
        assert_eq!(e.field, "naming");
        let e = VirtualServer::parse(br#"{"exlude":["x"]}"#).unwrap_err();
        assert!(e.message.contains("exlude"), "{e}");
        let e = VirtualServer::parse(b"{not json").unwrap_err();
        assert_eq!(e.field, "value");
        assert!(VirtualServer::parse(br#"{"naming":"bare","unavailable":"hide"}"#).is_ok());
    }
}
