//! Who is calling (issue 20): the plain parts of the filter's side of OAuth. Envoy's
//! `jwt_authn` verifies the bearer token and writes the verified payload into a request
//! header (base64url JSON) that no client can write (the listener strips it first); here
//! that payload is read into a [`Caller`], and the refusals are worded: the 401 that starts
//! an MCP client's OAuth flow, the 403 `insufficient_scope`, the JSON-RPC error for a tool
//! the caller may not use.

use std::collections::HashMap;
use std::rc::Rc;

use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine as _;
use serde_json::Value;
use toolgate_model::auth::{resource_metadata_url, Caller, Item};

use crate::mcp::jsonrpc::RawId;
use crate::mcp::reply::{self, Framing, ProtocolVersion, Reply};

/// The code of the JSON-RPC error a refused caller gets (server-defined range).
pub const NOT_AUTHORIZED: i64 = -32003;

/// Why a request was refused, as counted (`toolgate_auth_denied{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// No bearer token where one is required.
    MissingToken,
    /// A token Envoy did not verify (signature, issuer, audience, time, algorithm) or one
    /// for another resource.
    InvalidToken,
    /// A rule would grant the tool with more scopes.
    InsufficientScope,
    /// No rule grants the tool to this caller.
    ToolDenied,
    /// No rule grants the resource to this caller.
    ResourceDenied,
    /// No rule grants the prompt to this caller.
    PromptDenied,
}

impl Denial {
    pub fn as_str(self) -> &'static str {
        match self {
            Denial::MissingToken => "missing_token",
            Denial::InvalidToken => "invalid_token",
            Denial::InsufficientScope => "insufficient_scope",
            Denial::ToolDenied => "tool_denied",
            Denial::ResourceDenied => "resource_denied",
            Denial::PromptDenied => "prompt_denied",
        }
    }

    /// The denial of an item no rule grants.
    pub fn of(item: Item) -> Denial {
        match item {
            Item::Tool => Denial::ToolDenied,
            Item::Resource => Denial::ResourceDenied,
            Item::Prompt => Denial::PromptDenied,
        }
    }
}

/// The per-(service, reason) counter (before Envoy's `wasmcustom.`); the bootstrap's tags turn
/// it into `toolgate_auth_denied{service, reason}`. Never labelled by subject: one series per
/// caller would be unbounded.
pub fn metric_name(service: &str, denial: Denial) -> String {
    format!(
        "{}.auth.service={service}.reason={}.denied",
        crate::stats::PREFIX,
        denial.as_str()
    )
}

/// A verified payload, read, with its caller.
#[derive(Debug)]
pub struct Verified {
    pub payload: Value,
    pub caller: Caller,
}

/// The payloads one worker read lately, by their header value: an agent sends the same token
/// with every call, and reading it again (base64, JSON, roles and scopes) would cost each call
/// the same microseconds. Bounded; emptied whole when full (tokens are short-lived and few
/// per worker), and by a new configuration (the roles claim may change).
#[derive(Debug, Default)]
pub struct CallerCache {
    read: HashMap<String, Rc<Verified>>,
}

/// Payloads a worker keeps read.
pub const CALLER_CACHE_SIZE: usize = 256;

impl CallerCache {
    /// The payload of this header value, read (once), if it is a JSON object.
    pub fn get(&mut self, header: String, roles_claim: &str) -> Option<Rc<Verified>> {
        if let Some(v) = self.read.get(&header) {
            return Some(Rc::clone(v));
        }
        let payload = decode_payload(&header)?;
        let caller = Caller::from_payload(&payload, roles_claim);
        let verified = Rc::new(Verified { payload, caller });
        if self.read.len() >= CALLER_CACHE_SIZE {
            self.read.clear();
        }
        self.read.insert(header, Rc::clone(&verified));
        Some(verified)
    }
}

/// The verified payload `jwt_authn` forwarded, if it reads as a JSON object.
pub fn decode_payload(header: &str) -> Option<Value> {
    let header = header.trim();
    let bytes = URL_SAFE_NO_PAD
        .decode(header)
        .or_else(|_| URL_SAFE.decode(header))
        .ok()?;
    match serde_json::from_slice::<Value>(&bytes).ok()? {
        v @ Value::Object(_) => Some(v),
        _ => None,
    }
}

/// Whether an `Authorization` value carries a bearer token (RFC 6750 §2.1: the scheme is
/// case-insensitive).
pub fn is_bearer(authorization: &str) -> bool {
    authorization
        .trim_start()
        .get(..7)
        .is_some_and(|s| s.eq_ignore_ascii_case("bearer "))
}

/// The `WWW-Authenticate` value of a 401: where the client finds how to get a token
/// (RFC 9728 §5.1), and `invalid_token` when the one it sent was refused (RFC 6750 §3.1).
pub fn unauthenticated_challenge(resource: &str, path: &str, denial: Denial) -> String {
    let url = resource_metadata_url(resource, path);
    match denial {
        Denial::InvalidToken => format!(
            "Bearer resource_metadata=\"{url}\", error=\"invalid_token\", error_description=\"The access token is invalid, expired, or not for this resource\""
        ),
        _ => format!("Bearer resource_metadata=\"{url}\""),
    }
}

/// The `WWW-Authenticate` value of a 403 for a token without the scopes a rule asks for.
/// `scope` holds scopes the configuration validated (RFC 6749 scope tokens: no quotes).
pub fn insufficient_scope_challenge(resource: &str, path: &str, scope: &str) -> String {
    let url = resource_metadata_url(resource, path);
    format!("Bearer error=\"insufficient_scope\", scope=\"{scope}\", resource_metadata=\"{url}\"")
}

/// The body of a 401: a JSON-RPC error (no request id is known before the body is read) an
/// agent or a person can act on.
pub fn unauthenticated_reply(
    version: ProtocolVersion,
    id: Option<&RawId>,
    what: &str,
    denial: Denial,
    framing: Framing,
) -> Reply {
    let message = match denial {
        Denial::InvalidToken => format!(
            "The bearer token was refused for {what}: it is invalid, expired, or issued for another resource. Get a new token (the resource metadata in WWW-Authenticate says from where) and send it as `Authorization: Bearer <token>`."
        ),
        _ => format!(
            "A bearer token is required for {what}: get one from an authorization server named in the resource metadata (WWW-Authenticate) and send it as `Authorization: Bearer <token>`."
        ),
    };
    reply::error(
        version,
        id,
        NOT_AUTHORIZED,
        &message,
        Some(serde_json::json!({"reason": denial.as_str()})),
        framing,
    )
}

/// The JSON-RPC error for a `tools/call` (a `resources/read`, a `prompts/get`, ...) the rules
/// do not grant this caller. `name` and `what` are names the naming rule allows, or a URI
/// (plain text, cut to [`SHOWN_NAME`] characters). With `scope`, a token with those scopes would
/// be allowed (sent with a 403).
pub fn not_permitted_reply(
    version: ProtocolVersion,
    id: &RawId,
    item: Item,
    name: &str,
    what: &str,
    scope: Option<&str>,
    framing: Framing,
) -> Reply {
    let kind = item.as_str();
    let name = shown_name(name);
    let verb = verb_of(item);
    let other = match item {
        Item::Tool => "use another tool",
        Item::Resource => "read another resource",
        Item::Prompt => "use another prompt",
    };
    let (message, data) = match scope {
        Some(scope) => (
            format!(
                "You may not {verb} the {kind} `{name}` of {what} with this token: it needs the scope `{scope}`. Ask for a token with that scope, or {other}."
            ),
            serde_json::json!({"reason": Denial::InsufficientScope.as_str(), kind: name, "scope": scope}),
        ),
        None => (
            format!(
                "You may not {verb} the {kind} `{name}` of {what}: no rule grants it to you. Do not retry; {other}, or ask an operator for access."
            ),
            serde_json::json!({"reason": Denial::of(item).as_str(), kind: name}),
        ),
    };
    reply::error(
        version,
        Some(id),
        NOT_AUTHORIZED,
        &message,
        Some(data),
        framing,
    )
}

/// The most of a name or URI a refusal repeats.
pub const SHOWN_NAME: usize = 512;

fn shown_name(name: &str) -> &str {
    name.char_indices()
        .nth(SHOWN_NAME)
        .map_or(name, |(at, _)| &name[..at])
}

/// The message of a denied request inside a batch.
pub fn not_permitted_message(item: Item, name: &str, what: &str) -> String {
    let (verb, kind, name) = (verb_of(item), item.as_str(), shown_name(name));
    format!(
        "You may not {verb} the {kind} `{name}` of {what}: no rule grants it to you with this token."
    )
}

fn verb_of(item: Item) -> &'static str {
    match item {
        Item::Tool => "use",
        Item::Resource => "read",
        Item::Prompt => "get",
    }
}

/// A claim's value as a header value: strings as they are, numbers and booleans as JSON,
/// arrays of those joined by commas; anything else (objects, or a value with a control
/// character) is not sent.
pub fn claim_header_value(claim: &Value) -> Option<String> {
    let one = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    };
    let value = match claim {
        Value::Array(items) => items.iter().map(one).collect::<Option<Vec<_>>>()?.join(","),
        other => one(other)?,
    };
    (!value.is_empty() && value.len() <= 4096 && !value.chars().any(char::is_control))
        .then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_payload_is_read_from_base64url_with_or_without_padding() {
        let json = br#"{"sub":"alice","roles":["reader"]}"#;
        let unpadded = URL_SAFE_NO_PAD.encode(json);
        let padded = URL_SAFE.encode(json);
        assert_eq!(
            decode_payload(&unpadded),
            Some(json!({"sub": "alice", "roles": ["reader"]}))
        );
        assert_eq!(decode_payload(&padded), decode_payload(&unpadded));
        assert_eq!(decode_payload("not base64!"), None);
        assert_eq!(decode_payload(&URL_SAFE_NO_PAD.encode(b"[1]")), None);
    }

    #[test]
    fn a_payload_is_read_once_and_the_cache_stays_bounded() {
        let mut cache = CallerCache::default();
        let header = URL_SAFE_NO_PAD.encode(br#"{"sub":"a","roles":"r"}"#);
        let first = cache.get(header.clone(), "roles").expect("read");
        assert_eq!(first.caller.subject, "a");
        let again = cache.get(header, "roles").expect("cached");
        assert!(Rc::ptr_eq(&first, &again));
        for i in 0..CALLER_CACHE_SIZE + 5 {
            let h = URL_SAFE_NO_PAD.encode(format!(r#"{{"sub":"s{i}"}}"#));
            assert!(cache.get(h, "roles").is_some());
        }
        assert!(cache.read.len() <= CALLER_CACHE_SIZE);
        assert!(cache.get("%%%".into(), "roles").is_none());
    }

    #[test]
    fn challenges_name_the_metadata_and_the_error() {
        assert_eq!(
            unauthenticated_challenge("http://gw", "/mcp/orders", Denial::MissingToken),
            r#"Bearer resource_metadata="http://gw/.well-known/oauth-protected-resource/mcp/orders""#
        );
        assert!(
            unauthenticated_challenge("http://gw", "/mcp", Denial::InvalidToken)
                .contains(r#"error="invalid_token""#)
        );
        assert_eq!(
            insufficient_scope_challenge("http://gw", "/mcp/orders", "orders:write"),
            r#"Bearer error="insufficient_scope", scope="orders:write", resource_metadata="http://gw/.well-known/oauth-protected-resource/mcp/orders""#
        );
        assert!(is_bearer("Bearer abc") && is_bearer("bearer abc") && !is_bearer("Basic abc"));
        assert!(!is_bearer("Bear"));
    }

    #[test]
    fn claims_become_header_values_only_when_plain() {
        assert_eq!(claim_header_value(&json!("alice")), Some("alice".into()));
        assert_eq!(claim_header_value(&json!(["a", "b"])), Some("a,b".into()));
        assert_eq!(claim_header_value(&json!(5)), Some("5".into()));
        assert_eq!(claim_header_value(&json!({"a": 1})), None);
        assert_eq!(claim_header_value(&json!("a\r\nx-evil: 1")), None);
        assert_eq!(claim_header_value(&json!("")), None);
    }

    #[test]
    fn denials_are_counted_by_service_and_reason() {
        assert_eq!(
            metric_name("orders", Denial::InvalidToken),
            "toolgate.auth.service=orders.reason=invalid_token.denied"
        );
    }
}
