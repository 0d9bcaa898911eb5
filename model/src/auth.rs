//! Who may call: the gateway as an OAuth 2.1 resource server (issue 20).
//!
//! Two kinds of etcd value, both validated whole (a refused value leaves the last good one):
//! - `<prefix>auth/config`: the token validation Envoy's `jwt_authn` does (issuers, audiences,
//!   JWKS), the Protected Resource Metadata (RFC 9728) the gateway publishes, and which
//!   services and virtual servers require a token. Absent: nothing requires one.
//! - `<prefix>auth/rules/<service>` and `<prefix>auth/virtual/<name>`: which callers may call
//!   which tools, read which resources and get which prompts. Once a rule set exists for a
//!   service, a tool no rule grants is refused; once one of its rules names resources (or
//!   prompts), so is a resource (a prompt) no rule grants.
//!
//! Token crypto is Envoy's; the filter only reads the payload `jwt_authn` verified and
//! applies [`ToolRules::decide`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::names::validate_name;

/// The request header `jwt_authn` writes the verified payload to (base64url JSON). Removed
/// from every request before `jwt_authn` runs (a client cannot send its own) and by the
/// filter after reading it (no upstream sees it).
pub const PAYLOAD_HEADER: &str = "x-toolgate-jwt-payload";
/// The dynamic metadata key of `jwt_authn`'s failure status (code and message).
pub const FAILURE_METADATA_KEY: &str = "jwt_failure";
/// Where Protected Resource Metadata is published (RFC 9728 §3), before the resource's path.
pub const METADATA_PATH: &str = "/.well-known/oauth-protected-resource";
/// Matches every service and virtual server in [`AuthConfig::required`].
pub const ALL: &str = "*";
pub const MAX_ISSUERS: usize = 16;
pub const MAX_RULES: usize = 256;
pub const MAX_LIST: usize = 256;
const MAX_TEXT: usize = 2048;

/// Why a value was refused, with the field it is about (`issuers[0].jwks.remote.uri`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for AuthError {}

fn error(field: impl Into<String>, message: impl Into<String>) -> AuthError {
    AuthError {
        field: field.into(),
        message: message.into(),
    }
}

/// `<prefix>auth/config`. Unknown fields are refused: a misspelt `required` must not leave
/// a service open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// The gateway's public base URL (`https://tools.example.com`): each service's resource
    /// identifier is `<resource>/mcp/<service>`, each virtual server's its path.
    pub resource: String,
    /// The authorization servers clients get tokens from (RFC 9728 `authorization_servers`).
    pub authorization_servers: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes_supported: Vec<String>,
    /// Whose tokens are accepted; a token is checked against the issuer its `iss` names.
    pub issuers: Vec<Issuer>,
    /// The services and virtual servers that require a token, by name; `*`: all of them.
    #[serde(default = "all")]
    pub required: Vec<String>,
    /// The claim holding the caller's roles or groups (an array of strings, or one string);
    /// a dotted path reaches into objects (`realm_access.roles`).
    #[serde(default = "roles_claim")]
    pub roles_claim: String,
    /// Leeway for `exp` and `nbf`.
    #[serde(default = "clock_skew")]
    pub clock_skew_secs: u32,
    /// Envoy keeps tokens it verified and skips the signature check when one comes again
    /// (about 60 µs of Envoy CPU per call saved, measured). On by default, and safe: the keys
    /// reach Envoy inline in its configuration, so a key set that changes (a key withdrawn)
    /// gives Envoy a fresh filter with an empty cache, and a token signed with a withdrawn
    /// key stops verifying at the next refresh, cached or not.
    #[serde(default = "cache_on")]
    pub cache_verified_tokens: bool,
}

fn cache_on() -> bool {
    true
}

fn all() -> Vec<String> {
    vec![ALL.to_string()]
}

fn roles_claim() -> String {
    "roles".to_string()
}

fn clock_skew() -> u32 {
    60
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Issuer {
    /// The `iss` its tokens carry.
    pub issuer: String,
    /// Accepted `aud` values, checked by Envoy. Empty: the token must name the resource it is
    /// used for (`<resource>/mcp/<service>`, the virtual server's URL, or `<resource>`
    /// itself), as MCP clients ask for with RFC 8707 `resource`; the filter checks that, so a
    /// token for one service does not open another.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub audiences: Vec<String>,
    pub jwks: Jwks,
}

/// Where an issuer's keys come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Jwks {
    /// Fetched by toolgate-xds, which hands the keys to Envoy inline, and refreshed every
    /// `cache_secs`; a failed refresh keeps the keys it has.
    Remote(RemoteJwks),
    /// The JWKS itself (a JSON object with `keys`).
    Inline(serde_json::Value),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteJwks {
    pub uri: String,
    #[serde(default = "cache_secs")]
    pub cache_secs: u32,
    #[serde(default = "timeout_ms")]
    pub timeout_ms: u32,
}

fn cache_secs() -> u32 {
    300
}

fn timeout_ms() -> u32 {
    2000
}

/// A URL's parts as far as the gateway uses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// From the first `/` (empty for none).
    pub path: String,
}

/// Reads an `http://` or `https://` URL strictly enough to put it in a header's quoted
/// string and in Envoy's configuration: no quotes, spaces, controls, userinfo or fragment.
pub fn parse_url(url: &str) -> Result<HttpUrl, String> {
    if url.len() > MAX_TEXT {
        return Err(format!("longer than {MAX_TEXT} bytes"));
    }
    if let Some(c) = url
        .chars()
        .find(|c| c.is_control() || c.is_whitespace() || matches!(c, '"' | '\\' | '#' | '<' | '>'))
    {
        return Err(format!("{url:?} contains {c:?}"));
    }
    let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!("{url:?} is not an http:// or https:// URL"));
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(format!("{url:?} carries credentials"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
            let port = p
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{url:?} has no valid port"))?;
            (h, port)
        }
        _ => (authority, if tls { 443 } else { 80 }),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    Ok(HttpUrl {
        tls,
        host: host.to_string(),
        port,
        path: path.to_string(),
    })
}

/// A scope as RFC 6749 §3.3 allows one (`scope-token`): it goes into a header's quoted
/// string as it is.
fn check_scope(field: &str, scope: &str) -> Result<(), AuthError> {
    if scope.is_empty() || scope.len() > 256 {
        return Err(error(field, "a scope is 1 to 256 characters"));
    }
    if let Some(c) = scope
        .chars()
        .find(|c| !matches!(c, '\x21' | '\x23'..='\x5B' | '\x5D'..='\x7E'))
    {
        return Err(error(
            field,
            format!("{scope:?}: {c:?} is not allowed in a scope (RFC 6749 scope-token)"),
        ));
    }
    Ok(())
}

fn check_list(field: &str, list: &[String]) -> Result<(), AuthError> {
    if list.len() > MAX_LIST {
        return Err(error(field, format!("at most {MAX_LIST} entries")));
    }
    if let Some((i, _)) = list
        .iter()
        .enumerate()
        .find(|(_, s)| s.is_empty() || s.len() > MAX_TEXT)
    {
        return Err(error(
            format!("{field}[{i}]"),
            format!("1 to {MAX_TEXT} bytes"),
        ));
    }
    Ok(())
}

/// Parses a JSON value strictly, naming the field serde stopped at.
fn parse_json<T: serde::de::DeserializeOwned>(value: &[u8], what: &str) -> Result<T, AuthError> {
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value)).map_err(
        |e| {
            let path = e.path().to_string();
            let field = if path == "." || path == "?" {
                "value".to_string()
            } else {
                path
            };
            error(field, format!("not {what}: {}", e.inner()))
        },
    )
}

impl AuthConfig {
    pub fn parse(value: &[u8]) -> Result<Self, AuthError> {
        let mut config: AuthConfig = parse_json(value, "an auth configuration")?;
        config.validate()?;
        config.resource = config.resource.trim_end_matches('/').to_string();
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), AuthError> {
        let resource = parse_url(&self.resource).map_err(|e| error("resource", e))?;
        if resource.path.contains('?') {
            return Err(error("resource", "a resource identifier has no query"));
        }
        if self.authorization_servers.is_empty() {
            return Err(error(
                "authorization_servers",
                "name at least one: clients find where to get a token here",
            ));
        }
        check_list("authorization_servers", &self.authorization_servers)?;
        for (i, s) in self.authorization_servers.iter().enumerate() {
            parse_url(s).map_err(|e| error(format!("authorization_servers[{i}]"), e))?;
        }
        check_list("scopes_supported", &self.scopes_supported)?;
        for (i, s) in self.scopes_supported.iter().enumerate() {
            check_scope(&format!("scopes_supported[{i}]"), s)?;
        }
        if self.issuers.is_empty() || self.issuers.len() > MAX_ISSUERS {
            return Err(error(
                "issuers",
                format!("name 1 to {MAX_ISSUERS} issuers whose tokens are accepted"),
            ));
        }
        let mut seen = BTreeSet::new();
        for (i, issuer) in self.issuers.iter().enumerate() {
            let field = format!("issuers[{i}]");
            if issuer.issuer.is_empty() || issuer.issuer.len() > MAX_TEXT {
                return Err(error(format!("{field}.issuer"), "1 to 2048 bytes"));
            }
            if !seen.insert(issuer.issuer.as_str()) {
                return Err(error(
                    format!("{field}.issuer"),
                    format!("{:?} is named twice", issuer.issuer),
                ));
            }
            check_list(&format!("{field}.audiences"), &issuer.audiences)?;
            match &issuer.jwks {
                Jwks::Remote(r) => {
                    parse_url(&r.uri).map_err(|e| error(format!("{field}.jwks.remote.uri"), e))?;
                    if !(1..=86_400).contains(&r.cache_secs) {
                        return Err(error(
                            format!("{field}.jwks.remote.cache_secs"),
                            "1 to 86400 seconds",
                        ));
                    }
                    if !(10..=60_000).contains(&r.timeout_ms) {
                        return Err(error(
                            format!("{field}.jwks.remote.timeout_ms"),
                            "10 to 60000 ms",
                        ));
                    }
                }
                Jwks::Inline(keys) => {
                    let ok = keys
                        .get("keys")
                        .and_then(|k| k.as_array())
                        .is_some_and(|k| !k.is_empty() && k.iter().all(|k| k.is_object()));
                    if !ok {
                        return Err(error(
                            format!("{field}.jwks.inline"),
                            "a JWKS: an object whose `keys` is a non-empty array of keys",
                        ));
                    }
                }
            }
        }
        check_list("required", &self.required)?;
        for (i, name) in self.required.iter().enumerate() {
            if name != ALL {
                validate_name("service or virtual server", name)
                    .map_err(|e| error(format!("required[{i}]"), e.to_string()))?;
            }
        }
        if self.roles_claim.is_empty()
            || self.roles_claim.len() > 256
            || self.roles_claim.split('.').any(str::is_empty)
        {
            return Err(error(
                "roles_claim",
                "a claim name, or a dotted path of names (`realm_access.roles`)",
            ));
        }
        if self.clock_skew_secs > 600 {
            return Err(error("clock_skew_secs", "at most 600 seconds"));
        }
        Ok(())
    }

    /// Whether a service or virtual server (by name) requires a token.
    pub fn requires(&self, name: &str) -> bool {
        requires(&self.required, name)
    }
}

fn requires(required: &[String], name: &str) -> bool {
    required.iter().any(|r| r == ALL || r == name)
}

/// The Protected Resource Metadata document (RFC 9728 §2) for the resource at `path`
/// (`/mcp/orders`; empty for the gateway as a whole).
pub fn resource_metadata(config: &AuthConfig, path: &str) -> serde_json::Value {
    let mut doc = serde_json::json!({
        "resource": format!("{}{path}", config.resource),
        "authorization_servers": config.authorization_servers,
        "bearer_methods_supported": ["header"],
    });
    if !config.scopes_supported.is_empty() {
        doc["scopes_supported"] = serde_json::json!(config.scopes_supported);
    }
    doc
}

/// The URL of the metadata for the resource at `path` (RFC 9728 §3.1: the well-known
/// segment goes between the host and the path).
pub fn resource_metadata_url(resource: &str, path: &str) -> String {
    format!("{resource}{METADATA_PATH}{path}")
}

/// `<prefix>auth/rules/<service>` or `<prefix>auth/virtual/<name>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolRules {
    /// A tool is allowed when one rule naming it grants the caller; no rule: refused.
    pub rules: Vec<Rule>,
    /// Verified claims the service receives as request headers (claim → header name), for a
    /// server that must know its caller. Such a server must accept traffic only from the
    /// gateway: from anywhere else these headers are whatever a client writes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub claim_headers: BTreeMap<String, String>,
}

/// One grant: the tools, resources and prompts it covers and who it grants them to. Within a
/// rule every list that is given must match (subjects AND roles AND all scopes); a rule must
/// give at least one, and name at least one tool, resource or prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rule {
    /// Tool names; `*` matches any run of characters (`read_*`, `*`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// Resource URIs (and templates, as listed); `*` matches any run of characters
    /// (`file:///public/*`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<String>,
    /// Prompt names; `*` as for tools.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompts: Vec<String>,
    /// `sub` values; `*` is any authenticated caller.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subjects: Vec<String>,
    /// Any one of these roles (from the configured roles claim).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
    /// All of these scopes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
}

/// What a rule grants: a service's tools, resources or prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item {
    Tool,
    Resource,
    Prompt,
}

impl Item {
    pub fn as_str(self) -> &'static str {
        match self {
            Item::Tool => "tool",
            Item::Resource => "resource",
            Item::Prompt => "prompt",
        }
    }
}

/// Headers a claim may not be copied into: they carry the protocol or the gateway's own
/// state.
const RESERVED_HEADERS: &[&str] = &[
    "authorization",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "mcp-session-id",
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
];

impl ToolRules {
    pub fn parse(value: &[u8]) -> Result<Self, AuthError> {
        let rules: ToolRules = parse_json(value, "a rule set")?;
        rules.validate()?;
        Ok(rules)
    }

    pub fn validate(&self) -> Result<(), AuthError> {
        if self.rules.len() > MAX_RULES {
            return Err(error("rules", format!("at most {MAX_RULES} rules")));
        }
        for (i, rule) in self.rules.iter().enumerate() {
            let field = format!("rules[{i}]");
            if rule.tools.is_empty() && rule.resources.is_empty() && rule.prompts.is_empty() {
                return Err(error(
                    format!("{field}.tools"),
                    "name the tools, resources or prompts this rule grants (`\"tools\": [\"*\"]` for every tool)",
                ));
            }
            for (list, what, patterns) in [
                ("tools", "tool pattern", &rule.tools),
                ("prompts", "prompt pattern", &rule.prompts),
            ] {
                check_list(&format!("{field}.{list}"), patterns)?;
                for (j, pattern) in patterns.iter().enumerate() {
                    let name = pattern.replace('*', "x");
                    validate_name(what, &name)
                        .map_err(|e| error(format!("{field}.{list}[{j}]"), e.to_string()))?;
                }
            }
            check_list(&format!("{field}.resources"), &rule.resources)?;
            for (j, pattern) in rule.resources.iter().enumerate() {
                if pattern.chars().any(|c| c.is_control() || c.is_whitespace()) {
                    return Err(error(
                        format!("{field}.resources[{j}]"),
                        "a URI pattern has no spaces or control characters",
                    ));
                }
            }
            if rule.subjects.is_empty() && rule.roles.is_empty() && rule.scopes.is_empty() {
                return Err(error(
                    field,
                    "grants to nobody: give subjects, roles or scopes (`\"subjects\": [\"*\"]` for every authenticated caller)",
                ));
            }
            check_list(&format!("{field}.subjects"), &rule.subjects)?;
            check_list(&format!("{field}.roles"), &rule.roles)?;
            check_list(&format!("{field}.scopes"), &rule.scopes)?;
            for (j, s) in rule.scopes.iter().enumerate() {
                check_scope(&format!("{field}.scopes[{j}]"), s)?;
            }
        }
        for (claim, header) in &self.claim_headers {
            let field = format!("claim_headers.{claim}");
            if claim.is_empty() || claim.len() > 256 {
                return Err(error(field, "a claim name of 1 to 256 bytes"));
            }
            let lower = header.to_ascii_lowercase();
            let token = !header.is_empty()
                && header.len() <= 128
                && header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !token {
                return Err(error(
                    field,
                    format!("{header:?} is not a header name (letters, digits, - and _)"),
                ));
            }
            if RESERVED_HEADERS.contains(&lower.as_str())
                || lower.starts_with("x-toolgate")
                || lower.starts_with("x-envoy")
            {
                return Err(error(field, format!("{header:?} is reserved")));
            }
        }
        Ok(())
    }

    /// Whether `caller` may call `tool`.
    pub fn decide(&self, tool: &str, caller: &Caller) -> Decision {
        self.decide_item(Item::Tool, tool, caller)
    }

    /// Whether this rule set judges items of `item` at all: tools always; resources and
    /// prompts once one of its rules names some (before that, any caller the service lets
    /// in reads them, as it always did).
    pub fn guards(&self, item: Item) -> bool {
        match item {
            Item::Tool => true,
            Item::Resource => self.rules.iter().any(|r| !r.resources.is_empty()),
            Item::Prompt => self.rules.iter().any(|r| !r.prompts.is_empty()),
        }
    }

    /// Whether `caller` may use `name` (a tool, a resource URI, a prompt): allowed when one
    /// rule naming it grants the caller, or when the set does not guard that kind.
    pub fn decide_item(&self, item: Item, name: &str, caller: &Caller) -> Decision {
        if !self.guards(item) {
            return Decision::Allow;
        }
        let mut wanting: Option<&[String]> = None;
        for rule in self.rules.iter().filter(|r| r.covers(item, name)) {
            let who = (rule.subjects.is_empty()
                || rule
                    .subjects
                    .iter()
                    .any(|s| s == ALL || *s == caller.subject))
                && (rule.roles.is_empty() || rule.roles.iter().any(|r| caller.roles.contains(r)));
            if !who {
                continue;
            }
            if rule.scopes.iter().all(|s| caller.scopes.contains(s)) {
                return Decision::Allow;
            }
            // A rule this caller would pass with more scopes: a token asked for with them
            // would do (RFC 6750 `insufficient_scope`). The first such rule is named.
            wanting.get_or_insert(&rule.scopes);
        }
        match wanting {
            Some(scopes) => Decision::InsufficientScope(scopes.join(" ")),
            None => Decision::Denied,
        }
    }
}

impl Rule {
    fn covers(&self, item: Item, name: &str) -> bool {
        match item {
            Item::Tool => self.tools.iter().any(|p| glob(p, name)),
            Item::Prompt => self.prompts.iter().any(|p| glob(p, name)),
            // A URI that could name another one once its server resolves it (dot segments,
            // escaped dots or slashes, backslashes) passes only a rule that grants every URI:
            // `file:///public/*` must not reach `file:///public/../secret`.
            Item::Resource if uri_may_escape(name) => self.resources.iter().any(|p| p == ALL),
            Item::Resource => self.resources.iter().any(|p| glob(p, name)),
        }
    }
}

/// Whether a server resolving `uri` could read something its text does not start with.
fn uri_may_escape(uri: &str) -> bool {
    let lower = uri.to_ascii_lowercase();
    let path = lower.split(['?', '#']).next().unwrap_or_default();
    path.contains('\\')
        || path.contains("%2e")
        || path.contains("%2f")
        || path.contains("%5c")
        || path
            .split('/')
            .skip(1)
            .any(|segment| segment == "." || segment == "..")
}

/// `*` matches any run of characters; nothing else is special.
fn glob(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// What a rule set says of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// A token with these scopes (space-separated) would be allowed.
    InsufficientScope(String),
    /// Nothing this caller could get would allow it.
    Denied,
}

/// The verified caller, as the filter reads it from `jwt_authn`'s payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    pub subject: String,
    pub roles: BTreeSet<String>,
    pub scopes: BTreeSet<String>,
}

impl Caller {
    /// Reads a verified JWT payload: `sub`, the roles claim (array of strings or one
    /// string), and the scopes (`scope`, space-separated, or `scp`, array or string).
    pub fn from_payload(payload: &serde_json::Value, roles_claim: &str) -> Caller {
        let strings = |v: Option<&serde_json::Value>, split: bool| -> BTreeSet<String> {
            match v {
                Some(serde_json::Value::String(s)) if split => {
                    s.split_whitespace().map(str::to_string).collect()
                }
                Some(serde_json::Value::String(s)) => BTreeSet::from([s.clone()]),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect(),
                _ => BTreeSet::new(),
            }
        };
        let roles = roles_claim
            .split('.')
            .try_fold(payload, |v, k| v.get(k))
            .into_iter()
            .flat_map(|v| strings(Some(v), false))
            .collect();
        let mut scopes = strings(payload.get("scope"), true);
        scopes.extend(strings(payload.get("scp"), true));
        Caller {
            subject: payload
                .get("sub")
                .and_then(|s| s.as_str())
                .unwrap_or_default()
                .to_string(),
            roles,
            scopes,
        }
    }
}

/// What the filter needs of the auth configuration (part of its `FilterConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FilterAuth {
    /// The gateway's public base URL (for the `resource_metadata` URL of a 401).
    pub resource: String,
    pub required: Vec<String>,
    pub roles_claim: String,
    /// Rule sets by service.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<String, ToolRules>,
    /// Rule sets by virtual server (tools by the names it shows).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub virtual_servers: BTreeMap<String, ToolRules>,
    /// The issuers configured without audiences: their tokens must name the resource they
    /// are used for ([`FilterAuth::audience_fits`]).
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub resource_audience: BTreeSet<String>,
    /// Set by toolgate-xds for an Envoy whose bootstrap does not verify tokens before the
    /// filter: no payload header there is Envoy's, so none is taken as verified.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub untrusted_payload: bool,
}

impl FilterAuth {
    pub fn new(
        config: &AuthConfig,
        services: BTreeMap<String, ToolRules>,
        virtual_servers: BTreeMap<String, ToolRules>,
    ) -> Self {
        FilterAuth {
            resource: config.resource.clone(),
            required: config.required.clone(),
            roles_claim: config.roles_claim.clone(),
            services,
            virtual_servers,
            resource_audience: config
                .issuers
                .iter()
                .filter(|i| i.audiences.is_empty())
                .map(|i| i.issuer.clone())
                .collect(),
            untrusted_payload: false,
        }
    }

    /// Whether a verified payload may be used at `path` (`/mcp/orders`): tokens of an
    /// issuer configured without audiences must carry, in `aud`, the gateway's resource or
    /// the resource at `path`; others were checked by Envoy.
    pub fn audience_fits(&self, payload: &serde_json::Value, path: &str) -> bool {
        let issuer = payload
            .get("iss")
            .and_then(|i| i.as_str())
            .unwrap_or_default();
        if !self.resource_audience.contains(issuer) {
            return true;
        }
        let fits = |aud: &str| {
            let aud = aud.trim_end_matches('/');
            aud == self.resource
                || aud
                    .strip_prefix(self.resource.as_str())
                    .is_some_and(|p| p == path)
        };
        match payload.get("aud") {
            Some(serde_json::Value::String(a)) => fits(a),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|a| a.as_str()).any(fits),
            _ => false,
        }
    }

    pub fn requires(&self, name: &str) -> bool {
        requires(&self.required, name)
    }

    /// Whether every request to `service` needs a valid token: it is in `required`, or it has
    /// a rule set. Rules name tools, but a service's other methods (`initialize`,
    /// `resources/read`, `prompts/get`, its GET stream) reach the same server: a service
    /// whose tools are guarded must not leave the rest of it open.
    pub fn requires_service(&self, service: &str) -> bool {
        self.requires(service) || self.services.contains_key(service)
    }

    /// The same for a virtual server (its name as `/virtual/<name>` shows it).
    pub fn requires_virtual(&self, server: &str) -> bool {
        self.requires(server) || self.virtual_servers.contains_key(server)
    }

    /// Whether `caller` (`None`: no valid token) may call `tool` of `service`: a service
    /// that requires a token refuses a caller without one, and one with a rule set refuses
    /// what no rule grants.
    pub fn decide_service(&self, service: &str, tool: &str, caller: Option<&Caller>) -> Verdict {
        self.decide_service_item(service, Item::Tool, tool, caller)
    }

    /// The same for a tool as a virtual server shows it (its own rules; the service's are
    /// checked as well by the caller of this).
    pub fn decide_virtual(&self, server: &str, visible: &str, caller: Option<&Caller>) -> Verdict {
        self.decide_virtual_item(server, Item::Tool, visible, caller)
    }

    /// [`FilterAuth::decide_service`] for any kind of item.
    pub fn decide_service_item(
        &self,
        service: &str,
        item: Item,
        name: &str,
        caller: Option<&Caller>,
    ) -> Verdict {
        decide(
            self.requires(service),
            self.services.get(service),
            item,
            name,
            caller,
        )
    }

    /// [`FilterAuth::decide_virtual`] for any kind of item (a prompt by the name the virtual
    /// server shows, a resource by the URI it shows).
    pub fn decide_virtual_item(
        &self,
        server: &str,
        item: Item,
        visible: &str,
        caller: Option<&Caller>,
    ) -> Verdict {
        decide(
            self.requires(server),
            self.virtual_servers.get(server),
            item,
            visible,
            caller,
        )
    }

    /// Whether the rules of `service` (or, with `server`, that virtual server's) judge items
    /// of `item`, so that a listing of them must be filtered for each caller.
    pub fn guards(&self, service: Option<&str>, server: Option<&str>, item: Item) -> bool {
        service
            .and_then(|s| self.services.get(s))
            .is_some_and(|r| r.guards(item))
            || server
                .and_then(|s| self.virtual_servers.get(s))
                .is_some_and(|r| r.guards(item))
    }
}

/// A call's verdict, with what the caller lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// No valid token where one is required.
    Unauthenticated,
    InsufficientScope(String),
    Denied,
}

fn decide(
    required: bool,
    rules: Option<&ToolRules>,
    item: Item,
    name: &str,
    caller: Option<&Caller>,
) -> Verdict {
    let Some(caller) = caller else {
        return if required || rules.is_some() {
            Verdict::Unauthenticated
        } else {
            Verdict::Allow
        };
    };
    match rules.map(|r| r.decide_item(item, name, caller)) {
        None | Some(Decision::Allow) => Verdict::Allow,
        Some(Decision::InsufficientScope(s)) => Verdict::InsufficientScope(s),
        Some(Decision::Denied) => Verdict::Denied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> serde_json::Value {
        json!({
            "resource": "http://127.0.0.1:10000/",
            "authorization_servers": ["http://127.0.0.1:9000"],
            "issuers": [{"issuer": "http://127.0.0.1:9000",
                         "jwks": {"remote": {"uri": "http://127.0.0.1:9000/jwks.json"}}}]
        })
    }

    fn refused(v: serde_json::Value) -> AuthError {
        AuthConfig::parse(v.to_string().as_bytes()).expect_err("refused")
    }

    #[test]
    fn a_configuration_is_read_with_its_defaults() {
        let c = AuthConfig::parse(config().to_string().as_bytes()).expect("valid");
        assert_eq!(c.resource, "http://127.0.0.1:10000");
        assert_eq!(c.required, ["*"]);
        assert_eq!(c.roles_claim, "roles");
        assert_eq!(c.clock_skew_secs, 60);
        assert!(c.requires("orders"));
        let Jwks::Remote(r) = &c.issuers[0].jwks else {
            panic!("remote")
        };
        assert_eq!((r.cache_secs, r.timeout_ms), (300, 2000));
    }

    #[test]
    fn a_bad_configuration_names_its_field() {
        let mut c = config();
        c["issuers"][0]["jwks"]["remote"]["uri"] = json!("ftp://x");
        assert_eq!(refused(c).field, "issuers[0].jwks.remote.uri");
        let mut c = config();
        c["requierd"] = json!(["x"]);
        assert_eq!(refused(c).field, "requierd");
        let mut c = config();
        c["resource"] = json!("http://gw\" , evil=\"1");
        assert_eq!(refused(c).field, "resource");
        let mut c = config();
        c["scopes_supported"] = json!(["ok", "bad\"scope"]);
        assert_eq!(refused(c).field, "scopes_supported[1]");
        let mut c = config();
        c["required"] = json!(["orders", "bad/name"]);
        assert_eq!(refused(c).field, "required[1]");
        let mut c = config();
        c["issuers"] = json!([]);
        assert_eq!(refused(c).field, "issuers");
        let mut c = config();
        c["issuers"][0]["jwks"] = json!({"inline": {"keys": []}});
        assert_eq!(refused(c).field, "issuers[0].jwks.inline");
        let mut c = config();
        c["issuers"][0]["jwks"]["remote"]["cache_secs"] = json!("soon");
        assert_eq!(refused(c).field, "issuers[0].jwks.remote.cache_secs");
    }

    #[test]
    fn urls_are_read_strictly() {
        let u = parse_url("https://idp.example.com/keys").expect("ok");
        assert_eq!(
            (u.tls, u.host.as_str(), u.port),
            (true, "idp.example.com", 443)
        );
        let u = parse_url("http://127.0.0.1:9000").expect("ok");
        assert_eq!((u.port, u.path.as_str()), (9000, ""));
        let u = parse_url("http://[::1]:8080/x").expect("ok");
        assert_eq!((u.host.as_str(), u.port), ("::1", 8080));
        for bad in [
            "http://",
            "http://a:0",
            "http://a:99999",
            "http://u:p@a",
            "http://a/#x",
            "file:///etc",
            "http://a b",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    fn rules(v: serde_json::Value) -> ToolRules {
        ToolRules::parse(v.to_string().as_bytes()).expect("valid rules")
    }

    fn caller(sub: &str, roles: &[&str], scopes: &[&str]) -> Caller {
        Caller {
            subject: sub.into(),
            roles: roles.iter().map(|s| s.to_string()).collect(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn rules_grant_by_subject_role_and_scope() {
        let r = rules(json!({"rules": [
            {"tools": ["read_*"], "roles": ["reader", "writer"]},
            {"tools": ["write_order"], "roles": ["writer"], "scopes": ["orders:write"]},
            {"tools": ["*"], "subjects": ["root"]}
        ]}));
        let reader = caller("alice", &["reader"], &[]);
        assert_eq!(r.decide("read_order", &reader), Decision::Allow);
        assert_eq!(r.decide("write_order", &reader), Decision::Denied);
        let writer = caller("bob", &["writer"], &["orders:read"]);
        assert_eq!(
            r.decide("write_order", &writer),
            Decision::InsufficientScope("orders:write".into())
        );
        let writer = caller("bob", &["writer"], &["orders:write"]);
        assert_eq!(r.decide("write_order", &writer), Decision::Allow);
        assert_eq!(r.decide("drop_db", &writer), Decision::Denied);
        assert_eq!(
            r.decide("drop_db", &caller("root", &[], &[])),
            Decision::Allow
        );
        // An empty rule set refuses everything: deny by default.
        assert_eq!(ToolRules::default().decide("x", &writer), Decision::Denied);
    }

    #[test]
    fn resources_and_prompts_are_guarded_once_a_rule_names_them() {
        let tools_only = rules(json!({"rules": [{"tools": ["*"], "roles": ["reader"]}]}));
        let nobody = caller("eve", &[], &[]);
        // A rule set naming tools only leaves resources and prompts to any caller let in.
        assert_eq!(
            tools_only.decide_item(Item::Resource, "file:///etc/passwd", &nobody),
            Decision::Allow
        );
        assert_eq!(
            tools_only.decide_item(Item::Prompt, "any", &nobody),
            Decision::Allow
        );
        assert_eq!(tools_only.decide("x", &nobody), Decision::Denied);
        let r = rules(json!({"rules": [
            {"resources": ["file:///public/*"], "subjects": ["*"]},
            {"resources": ["file:///private/*"], "roles": ["staff"], "scopes": ["files:read"]},
            {"prompts": ["summarize"], "roles": ["staff"]},
            {"resources": ["*"], "subjects": ["root"]}
        ]}));
        let reader = caller("alice", &[], &[]);
        let decide = |item, name: &str, who: &Caller| r.decide_item(item, name, who);
        assert_eq!(
            decide(Item::Resource, "file:///public/a.txt", &reader),
            Decision::Allow
        );
        assert_eq!(
            decide(Item::Resource, "file:///private/a.txt", &reader),
            Decision::Denied
        );
        let staff = caller("bob", &["staff"], &[]);
        assert_eq!(
            decide(Item::Resource, "file:///private/a.txt", &staff),
            Decision::InsufficientScope("files:read".into())
        );
        assert_eq!(decide(Item::Prompt, "summarize", &staff), Decision::Allow);
        assert_eq!(decide(Item::Prompt, "summarize", &reader), Decision::Denied);
        // A rule set naming no tools refuses every tool, as before.
        assert_eq!(r.decide("read", &staff), Decision::Denied);
        // A URI that may resolve elsewhere passes only a rule for every URI.
        for escaping in [
            "file:///public/../private/a.txt",
            "file:///public/%2e%2e/private/a.txt",
            "file:///public/..%2Fprivate",
            "file:///public/.\\..\\private",
            "file:///public/./a.txt",
        ] {
            assert_eq!(
                decide(Item::Resource, escaping, &reader),
                Decision::Denied,
                "{escaping}"
            );
            assert_eq!(
                decide(Item::Resource, escaping, &caller("root", &[], &[])),
                Decision::Allow,
                "{escaping}"
            );
        }
        assert_eq!(
            decide(Item::Resource, "file:///public/a..b?x=../y", &reader),
            Decision::Allow
        );
    }

    #[test]
    fn bad_rules_name_their_field() {
        let err = |v: serde_json::Value| ToolRules::parse(v.to_string().as_bytes()).unwrap_err();
        assert_eq!(err(json!({"rules": [{"tools": ["a"]}]})).field, "rules[0]");
        assert_eq!(
            err(json!({"rules": [{"tools": ["a"], "role": ["x"]}]})).field,
            "rules[0].role"
        );
        assert_eq!(
            err(json!({"rules": [{"tools": ["a/b"], "roles": ["x"]}]})).field,
            "rules[0].tools[0]"
        );
        assert_eq!(
            err(json!({"rules": [{"tools": ["a"], "scopes": ["a b"]}]})).field,
            "rules[0].scopes[0]"
        );
        assert_eq!(
            err(json!({"rules": [{"roles": ["x"]}]})).field,
            "rules[0].tools"
        );
        assert_eq!(
            err(json!({"rules": [{"prompts": ["a b"], "roles": ["x"]}]})).field,
            "rules[0].prompts[0]"
        );
        assert_eq!(
            err(json!({"rules": [{"resources": ["file:///a b"], "roles": ["x"]}]})).field,
            "rules[0].resources[0]"
        );
        assert_eq!(
            err(json!({"rules": [{"resources": [""], "roles": ["x"]}]})).field,
            "rules[0].resources[0]"
        );
        assert_eq!(
            err(json!({"rules": [], "claim_headers": {"sub": "Authorization"}})).field,
            "claim_headers.sub"
        );
        assert_eq!(
            err(json!({"rules": [], "claim_headers": {"sub": "x-user\r\nx"}})).field,
            "claim_headers.sub"
        );
    }

    #[test]
    fn globs_match_runs() {
        assert!(glob("*", "anything"));
        assert!(glob("read_*", "read_order"));
        assert!(!glob("read_*", "write_order"));
        assert!(glob("*_order", "read_order"));
        assert!(glob("a*b*c", "aXbYc"));
        assert!(!glob("a*b*c", "aXbY"));
        assert!(glob("exact", "exact"));
        assert!(!glob("exact", "exactly"));
        assert!(!glob("ab*ba", "aba"));
    }

    #[test]
    fn the_caller_is_read_from_a_payload() {
        let c = Caller::from_payload(
            &json!({"sub": "alice", "roles": ["reader"], "scope": "a b", "scp": ["c"]}),
            "roles",
        );
        assert_eq!(c, caller("alice", &["reader"], &["a", "b", "c"]));
        let c = Caller::from_payload(
            &json!({"sub": "k", "realm_access": {"roles": ["admin"]}}),
            "realm_access.roles",
        );
        assert_eq!(c.roles, BTreeSet::from(["admin".to_string()]));
        let c = Caller::from_payload(&json!({"roles": 5}), "roles");
        assert_eq!(c, Caller::default());
    }

    #[test]
    fn a_service_that_requires_a_token_refuses_a_caller_without_one() {
        let c = AuthConfig::parse(
            json!({"resource": "http://gw", "authorization_servers": ["http://idp"],
                   "required": ["orders"],
                   "issuers": [{"issuer": "i", "jwks": {"inline": {"keys": [{}]}}}]})
            .to_string()
            .as_bytes(),
        )
        .expect("valid");
        let auth = FilterAuth::new(
            &c,
            BTreeMap::from([(
                "orders".to_string(),
                rules(json!({"rules": [{"tools": ["read_order"], "roles": ["reader"]}]})),
            )]),
            BTreeMap::new(),
        );
        let reader = caller("a", &["reader"], &[]);
        assert_eq!(
            auth.decide_service("orders", "read_order", None),
            Verdict::Unauthenticated
        );
        assert_eq!(
            auth.decide_service("orders", "read_order", Some(&reader)),
            Verdict::Allow
        );
        assert_eq!(
            auth.decide_service("orders", "write_order", Some(&reader)),
            Verdict::Denied
        );
        assert_eq!(auth.decide_service("stock", "x", None), Verdict::Allow);
        assert_eq!(
            resource_metadata_url(&c.resource, "/mcp/orders"),
            "http://gw/.well-known/oauth-protected-resource/mcp/orders"
        );
        assert_eq!(
            resource_metadata(&c, "/mcp/orders")["resource"],
            "http://gw/mcp/orders"
        );
        // Issuer `i` has no audiences: its tokens must name the gateway or the resource used.
        let token = |aud: serde_json::Value| json!({"iss": "i", "aud": aud});
        assert!(auth.audience_fits(&token(json!("http://gw/mcp/orders")), "/mcp/orders"));
        assert!(auth.audience_fits(&token(json!(["x", "http://gw/"])), "/mcp/orders"));
        assert!(!auth.audience_fits(&token(json!("http://gw/mcp/payments")), "/mcp/orders"));
        assert!(!auth.audience_fits(&token(json!("http://gw/mcp/orders")), "/mcp/ordersX"));
        assert!(!auth.audience_fits(&json!({"iss": "i"}), "/mcp/orders"));
        assert!(auth.audience_fits(&json!({"iss": "other"}), "/mcp/orders"));
    }
}
