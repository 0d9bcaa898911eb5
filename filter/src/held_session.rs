//! Sessions the gateway holds with servers for its clients: the filter's side.
//!
//! toolgate-xds opens them (`/v1/upstream-sessions`, see `xds-server/src/upstream.rs`); the
//! filter asks once per (client session, service), keeps the answer in shared data so that
//! every worker of this Envoy uses it, and puts it on the client's calls: the `envelope`, the
//! `Mcp-Session-Id` value that Envoy's session affinity routes to the instance holding it.
//!
//! Shared data is never freed, so the answers live in a fixed number of slots (a client
//! session and service hash to one; a collision overwrites). A lost answer costs one more
//! question to toolgate-xds, which still holds the session: no new session on the server.
//!
//! Owners are the last characters of the client's session id: the tail of an id sealed by the
//! gateway (its own `tgv1.` ids, and the `tgs1.` ids the filter seals on per-service routes)
//! is the authentication tag, which only the key holder can make, so no client can name
//! another client's owner.
//!
//! A 2026-07-28 client has no session id at all. When the aggregate endpoint routes its call
//! to a server that speaks only the revisions with sessions (toolgate-xds's catalog found it
//! so: `FilterConfig::legacy_revisions`), the call goes on a session held for the identity
//! the request states in its `_meta` ([`stateless_params`]): clients stating the same
//! identity share that session, and whatever the server keeps in it.
//!
//! With a verified token, every owner is also bound to its user ([`identity_tag`]): two users
//! never share a held session, whatever they state. Held sessions are bounded per caller (that
//! user, or the client's address: [`caller_key`]) in toolgate-xds.
//!
//! When the server answers a call on a held or sealed session with "session unknown"
//! (`toolgate_model::session_loss`), toolgate-xds decides: re-opened and replayed when the
//! session was lost with its instance, or ended (the client or the live server ended it), and
//! then the server's answer reaches the client and the slot says so ([`Slot::Ended`]).

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// toolgate-xds's endpoints (on the control cluster the reports use).
pub const OPEN_PATH: &str = "/v1/upstream-sessions";
pub const REPLAY_PATH: &str = "/v1/upstream-sessions/replay";
/// Prefix of the gateway's own session ids on the aggregate endpoint.
pub const GATEWAY_PREFIX: &str = "tgv1.";
/// Slots of answers in shared data.
pub const SLOTS: u64 = 4096;
pub use toolgate_model::session_owner::{bound_to, owner_of, owner_of_identity, OwnerKind};

/// The shared-data key of the slot for (owner, service).
pub fn slot_key(owner: &str, service: &str) -> String {
    // FNV-1a: spreads owners over the slots; the slot's value names its owner and service,
    // so a collision is a miss, never a wrong answer.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in owner.bytes().chain([0]).chain(service.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("tg/hs/{}", h % SLOTS)
}

/// What toolgate-xds answered: where this client's calls to the service go.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Held {
    /// `None`: the server keeps no session, calls go without one.
    pub envelope: Option<String>,
    pub protocol_version: String,
    /// When the session was opened (ms since the Unix epoch): what toolgate-xds compares with
    /// its instance's restarts should the server no longer know it.
    #[serde(default)]
    pub opened_ms: Option<u64>,
}

/// A held session's answer is asked for again after this long, which tells toolgate-xds the
/// session is in use (it ends gateway sessions idle for 30 minutes, and under a bound ends the
/// least recently used of those idle for a while first).
pub const REFRESH_MS: u64 = 30 * 1000;

/// What a slot says of (owner, service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// The session held, and when it was asked for.
    Held { held: Held, asked_ms: u64 },
    /// The client or the live server ended the session: it is not used or opened again.
    Ended,
}

const SLOT_HELD: &str = "h";
const SLOT_ENDED: &str = "e";

/// A slot's value: owner, service, state, when it was asked, when opened, revision and
/// envelope, one per line.
pub fn encode_slot(owner: &str, service: &str, held: &Held, now_ms: u64) -> Vec<u8> {
    format!(
        "{owner}\n{service}\n{SLOT_HELD}\n{now_ms}\n{}\n{}\n{}",
        held.opened_ms.map(|o| o.to_string()).unwrap_or_default(),
        held.protocol_version,
        held.envelope.as_deref().unwrap_or_default()
    )
    .into_bytes()
}

/// A slot's value saying (owner, service)'s session ended.
pub fn encode_ended(owner: &str, service: &str) -> Vec<u8> {
    format!("{owner}\n{service}\n{SLOT_ENDED}").into_bytes()
}

/// What a slot holds for (owner, service), if it holds theirs.
pub fn decode_slot(bytes: &[u8], owner: &str, service: &str) -> Option<Slot> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut lines = text.splitn(7, '\n');
    if lines.next()? != owner || lines.next()? != service {
        return None;
    }
    match lines.next()? {
        SLOT_ENDED => return Some(Slot::Ended),
        SLOT_HELD => {}
        _ => return None,
    }
    let asked_ms = lines.next()?.parse().ok()?;
    let opened_ms = lines.next()?.parse().ok();
    let protocol_version = lines.next()?.to_string();
    let envelope = lines.next().filter(|e| !e.is_empty()).map(str::to_string);
    Some(Slot::Held {
        held: Held {
            envelope,
            protocol_version,
            opened_ms,
        },
        asked_ms,
    })
}

/// The digest a held session's owner is bound to for a verified token's user: SHA-256 of
/// its issuer and subject, 128 bits in hex. Chosen subjects cannot make two users' digests
/// meet (a non-cryptographic hash would let one user aim at another's).
pub fn identity_tag(issuer: &str, subject: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(issuer.as_bytes());
    h.update([0]);
    h.update(subject.as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .fold(String::with_capacity(32), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// Whom toolgate-xds counts a held session for under its bounds: the verified user (its
/// [`identity_tag`]), or without one the client's address as Envoy saw the connection
/// (`source.address`, port dropped): the one thing about a client without a token that it
/// cannot change with each request, unlike a header or the `clientInfo` it states.
pub fn caller_key(identity: Option<&str>, source: Option<&str>) -> String {
    match (identity, source) {
        (Some(tag), _) => format!("user:{tag}"),
        (None, Some(address)) => format!("addr:{}", host_of(address)),
        (None, None) => "unknown".to_string(),
    }
}

/// `ip` of `ip:port` or `[ipv6]:port` (an address without a port as it is).
pub(crate) fn host_of(address: &str) -> &str {
    if let Some(rest) = address.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match address.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            host
        }
        _ => address,
    }
}

/// Whose session it is, as toolgate-xds needs to open one like the client would.
#[derive(Debug, Clone, Copy)]
pub enum Client<'a> {
    /// A gateway session of the aggregate endpoint (toolgate-xds reads the client's
    /// `initialize` parameters out of it).
    Gateway(&'a str),
    /// The client's own `initialize` parameters (JSON), kept in the id the filter sealed.
    Params(&'a str),
}

/// Whose session, with which service, counted for whom.
#[derive(Debug, Clone, Copy)]
pub struct Question<'a> {
    pub owner: &'a str,
    pub service: &'a str,
    pub client: Client<'a>,
    /// [`caller_key`].
    pub caller: &'a str,
}

impl Question<'_> {
    fn json(&self) -> serde_json::Value {
        let mut q = json!({"owner": self.owner, "service": self.service, "caller": self.caller});
        match self.client {
            Client::Gateway(id) => q["gateway_session"] = json!(id),
            Client::Params(p) => {
                q["params"] = serde_json::from_str(p).unwrap_or(serde_json::Value::Null);
            }
        }
        q
    }
}

/// A session the server answered "session unknown" for.
#[derive(Debug, Clone, Copy)]
pub struct LostSession<'a> {
    /// The envelope the call went with.
    pub stale: &'a str,
    /// When it was opened, if known.
    pub opened_ms: Option<u64>,
    /// The instance that answered (Envoy's upstream address), if known.
    pub answered_by: Option<&'a str>,
}

/// The body asking toolgate-xds for the session of the question's owner with its service.
pub fn open_request(q: &Question<'_>) -> Vec<u8> {
    q.json().to_string().into_bytes()
}

/// The body asking toolgate-xds to replay `message` on a new session, should the lost one have
/// been lost with its instance; `headers`: the claims the filter put on the request.
pub fn replay_request(
    q: &Question<'_>,
    lost: &LostSession<'_>,
    message: &[u8],
    headers: &[(String, String)],
) -> Vec<u8> {
    let mut v = q.json();
    v["stale"] = json!(lost.stale);
    v["opened_ms"] = json!(lost.opened_ms);
    v["answered_by"] = json!(lost.answered_by);
    v["body"] = json!(STANDARD.encode(message));
    v["headers"] = json!(headers);
    v.to_string().into_bytes()
}

/// The most `initialize` parameters kept in a sealed session id (JSON bytes); a client that
/// sends more keeps working, but its session is not re-opened when its instance is gone.
pub const MAX_PARAMS_BYTES: usize = 2048;

/// The parameters of an `initialize` body that matter to re-open its session, as compact JSON;
/// `None` when the body is not one or they weigh more than [`MAX_PARAMS_BYTES`].
pub fn initialize_params(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let p = v.get("params")?;
    let kept = json!({
        "protocolVersion": p.get("protocolVersion")?.as_str()?,
        "capabilities": p.get("capabilities").cloned().unwrap_or(json!({})),
        "clientInfo": p.get("clientInfo").cloned().unwrap_or(json!({})),
    });
    let text = kept.to_string();
    (text.len() <= MAX_PARAMS_BYTES).then_some(text)
}

/// A sealed session value: the envelope, and the client's parameters and when the session was
/// opened after newlines (compact JSON has none of its own).
pub fn join(envelope: &str, params: Option<&str>, opened_ms: Option<u64>) -> String {
    match (params, opened_ms) {
        (Some(p), Some(at)) => format!("{envelope}\n{p}\n{at}"),
        (Some(p), None) => format!("{envelope}\n{p}"),
        (None, _) => envelope.to_string(),
    }
}

/// The envelope, the parameters and the opening time of an opened value (an id sealed before
/// ids carried the time has none).
pub fn split(value: &str) -> (&str, Option<&str>, Option<u64>) {
    let mut parts = value.splitn(3, '\n');
    let envelope = parts.next().unwrap_or_default();
    let params = parts.next();
    let opened_ms = parts.next().and_then(|t| t.parse().ok());
    (envelope, params, opened_ms)
}

/// The `clientInfo` a session held for a stateless client is opened with when its request
/// states none that a server would take (a `name` and a `version`).
pub const UNSTATED_CLIENT: &str = "toolgate-stateless-client";

/// Capabilities that make a server send requests to the client (`sampling/createMessage`,
/// `elicitation/create`, `roots/list`). A session held for a stateless client has no way to
/// bring those to it and their answers back, so they are not declared: the server then
/// does without them, or says it cannot, instead of waiting for an answer that never comes.
const SERVER_REQUESTS: [&str; 3] = ["sampling", "elicitation", "roots"];

/// The `_meta` of a 2026-07-28 request, as far as it states who the client is. Borrowed raw,
/// so the rest of the body (the arguments) is skipped, not copied.
#[derive(Deserialize)]
struct Stated<'a> {
    #[serde(borrow, default)]
    params: Option<StatedParams<'a>>,
}

#[derive(Deserialize)]
struct StatedParams<'a> {
    #[serde(rename = "_meta", borrow, default)]
    meta: Option<StatedMeta<'a>>,
}

#[derive(Deserialize)]
struct StatedMeta<'a> {
    #[serde(rename = "io.modelcontextprotocol/clientInfo", borrow, default)]
    client_info: Option<&'a RawValue>,
    #[serde(rename = "io.modelcontextprotocol/clientCapabilities", borrow, default)]
    capabilities: Option<&'a RawValue>,
}

/// The `initialize` parameters (compact JSON, keys sorted: one identity, one text) of the
/// session held for the stateless client that sent `body`, in `revision` (the one the
/// server agreed on with the catalog). Its owner is [`owner_of_identity`] of this text.
/// A request that states no usable identity, or one weighing more than
/// [`MAX_PARAMS_BYTES`], gets the unstated identity: every such client shares one session.
pub fn stateless_params(body: &[u8], revision: &str) -> String {
    let meta = serde_json::from_slice::<Stated<'_>>(body)
        .ok()
        .and_then(|s| s.params)
        .and_then(|p| p.meta);
    let parse = |raw: Option<&RawValue>| {
        raw.and_then(|r| serde_json::from_str::<Value>(r.get()).ok())
            .filter(Value::is_object)
    };
    let client_info = meta
        .as_ref()
        .and_then(|m| parse(m.client_info))
        .filter(|i| i["name"].is_string() && i["version"].is_string());
    let mut capabilities = meta
        .as_ref()
        .and_then(|m| parse(m.capabilities))
        .unwrap_or_else(|| json!({}));
    if let Some(caps) = capabilities.as_object_mut() {
        caps.retain(|k, _| !SERVER_REQUESTS.contains(&k.as_str()));
    }
    let unstated = || {
        json!({
            "protocolVersion": revision,
            "capabilities": {},
            "clientInfo": {"name": UNSTATED_CLIENT, "version": "1"},
        })
        .to_string()
    };
    let Some(client_info) = client_info else {
        return unstated();
    };
    let text = json!({
        "protocolVersion": revision,
        "capabilities": capabilities,
        "clientInfo": client_info,
    })
    .to_string();
    if text.len() > MAX_PARAMS_BYTES {
        return unstated();
    }
    text
}

/// The most of a server's answer to a stateless client's call the filter holds to complete it
/// ([`complete_results`]); a larger one goes through as the server sent it.
pub const MAX_COMPLETED_BYTES: usize = 1 << 20;

/// A server of a session revision answers without `resultType`, which 2026-07-28 results
/// carry (`"complete"`, or `"input_required"`, which such a server never means) and which
/// strict 2026-07-28 clients require (the official Python SDK refuses the result without
/// it). The answer (JSON, or SSE whose `data:` lines are messages) with `"resultType":
/// "complete"` put first in each response's `result` that lacks one, the rest byte for
/// byte; `None` when nothing needed it.
pub fn complete_results(body: &[u8]) -> Option<Vec<u8>> {
    if body.trim_ascii_start().starts_with(b"{") {
        return complete_message(body);
    }
    let mut out = Vec::with_capacity(body.len() + 32);
    let mut changed = false;
    for line in body.split_inclusive(|b| *b == b'\n') {
        let completed = line
            .strip_prefix(b"data:")
            .and_then(complete_message)
            .map(|m| [b"data:".as_slice(), &m].concat());
        match completed {
            Some(c) => {
                out.extend_from_slice(&c);
                changed = true;
            }
            None => out.extend_from_slice(line),
        }
    }
    changed.then_some(out)
}

/// One JSON-RPC message, completed if it is a response whose `result` object has no
/// `resultType`.
fn complete_message(message: &[u8]) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Response<'a> {
        #[serde(borrow)]
        result: Option<&'a RawValue>,
    }
    let text = std::str::from_utf8(message).ok()?;
    let trimmed = text.trim_end_matches(['\r', '\n']);
    let result = serde_json::from_str::<Response<'_>>(trimmed).ok()?.result?;
    let keys: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
        serde_json::from_str(result.get()).ok()?;
    if keys.contains_key("resultType") {
        return None;
    }
    // The raw value is a slice of `text`: where its `{` is.
    let open = (result.get().as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    if text.as_bytes().get(open) != Some(&b'{') {
        return None;
    }
    let field = if keys.is_empty() {
        r#""resultType":"complete""#
    } else {
        r#""resultType":"complete","#
    };
    Some([&message[..=open], field.as_bytes(), &message[open + 1..]].concat())
}

/// toolgate-xds's answer to a replay: the new session and the server's answer.
#[derive(Debug, Clone, Deserialize)]
pub struct Replayed {
    #[serde(flatten)]
    pub held: Held,
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

/// Why toolgate-xds opened (or replayed) nothing, from its answer (`failure`, see
/// `xds-server/src/admin/upstream.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unopened {
    /// The service has no healthy instance.
    NoInstance,
    /// The gateway holds as many sessions with the service as it allows (`limit`, for this
    /// caller or for the service), none idle long enough to end.
    AtBound {
        limit: u32,
        per_caller: bool,
    },
    /// The server answered the `initialize` with this HTTP status.
    Refused(u16),
    /// No instance could be reached.
    Unreachable,
    /// No instance answered in time.
    Timeout,
    /// As many replays to the service are in flight as its bulkhead allows.
    Overloaded,
    /// The client or the live server ended the session: the server's answer is the client's.
    Ended,
    /// The gateway session named is not live (ended or expired).
    SessionGone,
    /// The replayed call went to a server and failed there.
    CallTimeout,
    CallReset,
    CallBadResponse,
    /// No answer from toolgate-xds, or one it does not explain.
    Failed,
}

#[derive(Deserialize)]
struct Refusal {
    /// toolgate-xds's words: present in every answer of its own (Envoy's own 503, when it
    /// cannot reach toolgate-xds, has none).
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    failure: Option<String>,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    bound: Option<String>,
    #[serde(default)]
    in_call: bool,
}

pub fn unopened(status: Option<u16>, body: &[u8]) -> Unopened {
    let r = serde_json::from_slice::<Refusal>(body).ok();
    let failure = r.as_ref().and_then(|r| r.failure.as_deref());
    let in_call = r.as_ref().is_some_and(|r| r.in_call);
    match (status, failure) {
        (Some(410), _) => Unopened::Ended,
        (Some(404), _) => Unopened::SessionGone,
        (_, Some("at_bound")) => Unopened::AtBound {
            limit: r.as_ref().and_then(|r| r.limit).unwrap_or(0),
            per_caller: r.as_ref().and_then(|r| r.bound.as_deref()) == Some("caller"),
        },
        (_, Some("no_instance")) => Unopened::NoInstance,
        (_, Some("overloaded")) => Unopened::Overloaded,
        (_, Some("timeout")) if in_call => Unopened::CallTimeout,
        (_, Some("reset")) if in_call => Unopened::CallReset,
        (_, Some("bad_response")) if in_call => Unopened::CallBadResponse,
        (_, Some("refused")) => Unopened::Refused(r.as_ref().and_then(|r| r.status).unwrap_or(502)),
        (_, Some("unreachable")) => Unopened::Unreachable,
        (_, Some("timeout")) => Unopened::Timeout,
        (Some(503), _) if r.as_ref().is_some_and(|r| r.error.is_some()) => Unopened::NoInstance,
        _ => Unopened::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_taken_off_an_address_and_a_bare_one_kept() {
        assert_eq!(host_of("10.0.0.1:4242"), "10.0.0.1");
        assert_eq!(host_of("[::1]:4242"), "::1");
        assert_eq!(host_of("::1"), "::1");
        assert_eq!(host_of("10.0.0.1"), "10.0.0.1");
        assert_eq!(host_of(""), "");
    }

    #[test]
    fn a_slot_answers_only_its_owner_and_service() {
        let held = Held {
            envelope: Some("MTI3LjAuMC4xOjE=;UV:YQ==".into()),
            protocol_version: "2025-06-18".into(),
            opened_ms: Some(5),
        };
        let bytes = encode_slot("gabc", "orders", &held, 42);
        assert_eq!(
            decode_slot(&bytes, "gabc", "orders"),
            Some(Slot::Held { held, asked_ms: 42 })
        );
        assert_eq!(decode_slot(&bytes, "gabd", "orders"), None);
        assert_eq!(decode_slot(&bytes, "gabc", "billing"), None);
        let none = Held {
            envelope: None,
            protocol_version: "2026-07-28".into(),
            opened_ms: None,
        };
        let bytes = encode_slot("gabc", "orders", &none, 7);
        assert_eq!(
            decode_slot(&bytes, "gabc", "orders"),
            Some(Slot::Held {
                held: none,
                asked_ms: 7
            })
        );
        let ended = encode_ended("gabc", "orders");
        assert_eq!(decode_slot(&ended, "gabc", "orders"), Some(Slot::Ended));
        assert_eq!(decode_slot(&ended, "gabc", "billing"), None);
        // A slot written before slots had a state is a miss, not a wrong answer.
        assert_eq!(
            decode_slot(b"gabc\norders\n42\n2025-06-18\nenv", "gabc", "orders"),
            None
        );
    }

    #[test]
    fn a_sealed_value_carries_the_parameters_and_the_opening_time() {
        let v = join("env", Some(r#"{"a":"b\nc"}"#), Some(17));
        assert_eq!(split(&v), ("env", Some(r#"{"a":"b\nc"}"#), Some(17)));
        assert_eq!(
            split(&join("env", Some("{}"), None)),
            ("env", Some("{}"), None)
        );
        assert_eq!(split(&join("env", None, Some(3))), ("env", None, None));
    }

    #[test]
    fn a_caller_is_its_user_or_its_address() {
        let alice = identity_tag("https://issuer", "alice");
        assert_eq!(alice.len(), 32);
        assert_ne!(alice, identity_tag("https://issuer", "bob"));
        assert_ne!(alice, identity_tag("https://other", "alice"));
        // The separator keeps issuer and subject apart.
        assert_ne!(identity_tag("ab", "c"), identity_tag("a", "bc"));
        assert_eq!(
            caller_key(Some(&alice), Some("10.0.0.1:5")),
            format!("user:{alice}")
        );
        assert_eq!(caller_key(None, Some("10.0.0.1:5")), "addr:10.0.0.1");
        assert_eq!(caller_key(None, Some("[::1]:5")), "addr:::1");
        assert_eq!(caller_key(None, Some("10.0.0.1")), "addr:10.0.0.1");
        assert_eq!(caller_key(None, None), "unknown");
    }

    #[test]
    fn toolgate_xds_refusals_are_told_apart() {
        let u = |status, body: &str| unopened(status, body.as_bytes());
        assert_eq!(u(Some(410), r#"{"failure":"ended"}"#), Unopened::Ended);
        assert_eq!(u(Some(404), r#"{"error":"x"}"#), Unopened::SessionGone);
        assert_eq!(
            u(
                Some(429),
                r#"{"failure":"at_bound","bound":"caller","limit":2}"#
            ),
            Unopened::AtBound {
                limit: 2,
                per_caller: true
            }
        );
        assert_eq!(
            u(Some(502), r#"{"failure":"refused","status":503}"#),
            Unopened::Refused(503)
        );
        assert_eq!(u(Some(502), r#"{"failure":"timeout"}"#), Unopened::Timeout);
        assert_eq!(
            u(Some(504), r#"{"failure":"timeout","in_call":true}"#),
            Unopened::CallTimeout
        );
        assert_eq!(
            u(Some(503), r#"{"failure":"no_instance"}"#),
            Unopened::NoInstance
        );
        assert_eq!(
            u(Some(503), r#"{"failure":"overloaded"}"#),
            Unopened::Overloaded
        );
        assert_eq!(u(None, ""), Unopened::Failed);
        // Envoy's own answer when toolgate-xds is away is not toolgate-xds's.
        assert_eq!(u(Some(503), "no healthy upstream"), Unopened::Failed);
        assert_eq!(
            u(Some(503), r#"{"error":"no instance"}"#),
            Unopened::NoInstance
        );
    }

    #[test]
    fn a_stateless_clients_identity_is_what_its_meta_states() {
        let call = |meta: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"echo","arguments":{{"a":[1,2]}},"_meta":{meta}}}}}"#
            )
        };
        let stated = call(
            r#"{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"version":"2","name":"py"},"io.modelcontextprotocol/clientCapabilities":{"sampling":{},"elicitation":{},"extensions":{"x":{}}}}"#,
        );
        let p: Value =
            serde_json::from_str(&stateless_params(stated.as_bytes(), "2025-06-18")).expect("json");
        assert_eq!(p["protocolVersion"], "2025-06-18");
        assert_eq!(p["clientInfo"], json!({"name": "py", "version": "2"}));
        assert_eq!(
            p["capabilities"],
            json!({"extensions": {"x": {}}}),
            "no capability a held session cannot serve"
        );
        // The same identity in another order is the same owner.
        let reordered = call(
            r#"{"io.modelcontextprotocol/clientCapabilities":{"extensions":{"x":{}},"elicitation":{},"sampling":{}},"io.modelcontextprotocol/clientInfo":{"name":"py","version":"2"}}"#,
        );
        assert_eq!(
            stateless_params(stated.as_bytes(), "2025-06-18"),
            stateless_params(reordered.as_bytes(), "2025-06-18")
        );
        let unstated = stateless_params(call("{}").as_bytes(), "2025-06-18");
        assert!(unstated.contains(UNSTATED_CLIENT), "{unstated}");
        for odd in [
            call(r#"{"io.modelcontextprotocol/clientInfo":"py"}"#),
            call(r#"{"io.modelcontextprotocol/clientInfo":{"name":"py"}}"#),
            call("7"),
            "not json".to_string(),
            r#"{"params":[1]}"#.to_string(),
            call(&format!(
                r#"{{"io.modelcontextprotocol/clientInfo":{{"name":"{}","version":"1"}}}}"#,
                "n".repeat(MAX_PARAMS_BYTES)
            )),
        ] {
            assert_eq!(
                stateless_params(odd.as_bytes(), "2025-06-18"),
                unstated,
                "{odd}"
            );
        }
    }

    #[test]
    fn results_of_a_session_revision_are_completed_for_a_stateless_client() {
        let json = br#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"a"}]}}"#;
        let done = complete_results(json).expect("completed");
        assert_eq!(
            String::from_utf8(done).expect("utf-8"),
            r#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"complete","content":[{"type":"text","text":"a"}]}}"#
        );
        assert_eq!(
            complete_results(br#"{"jsonrpc":"2.0","id":7,"result":{}}"#).as_deref(),
            Some(br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"complete"}}"#.as_slice())
        );
        let sse = "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"content\":[]}}\n\n";
        let done =
            String::from_utf8(complete_results(sse.as_bytes()).expect("completed")).expect("utf-8");
        assert_eq!(
            done,
            sse.replace(r#""result":{"#, r#""result":{"resultType":"complete","#)
        );
        for untouched in [
            br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"complete","content":[]}}"#
                .as_slice(),
            br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32000,"message":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":7,"result":[1]}"#,
            b"not json",
            b"",
        ] {
            assert_eq!(complete_results(untouched), None);
        }
    }

    #[test]
    fn slots_are_bounded() {
        let id = format!("tgv1.{}", "A".repeat(80));
        let owner = owner_of(OwnerKind::Gateway, &id).expect("owner");
        let key = slot_key(&owner, "orders");
        let n: u64 = key.trim_start_matches("tg/hs/").parse().expect("slot");
        assert!(n < SLOTS);
    }
}
