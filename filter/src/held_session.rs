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

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use serde_json::json;

/// toolgate-xds's endpoints (on the control cluster the reports use).
pub const OPEN_PATH: &str = "/v1/upstream-sessions";
pub const REPLAY_PATH: &str = "/v1/upstream-sessions/replay";
/// Prefix of the gateway's own session ids on the aggregate endpoint.
pub const GATEWAY_PREFIX: &str = "tgv1.";
/// Slots of answers in shared data.
pub const SLOTS: u64 = 4096;
pub use toolgate_model::session_owner::{owner_of, OwnerKind};

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
}

/// A gateway session's answer is asked for again after this long, which tells toolgate-xds
/// the session is in use (it ends gateway sessions idle for 30 minutes).
pub const REFRESH_MS: u64 = 5 * 60 * 1000;

/// A slot's value: owner, service, when it was asked, revision and envelope, one per line.
pub fn encode_slot(owner: &str, service: &str, held: &Held, now_ms: u64) -> Vec<u8> {
    format!(
        "{owner}\n{service}\n{now_ms}\n{}\n{}",
        held.protocol_version,
        held.envelope.as_deref().unwrap_or_default()
    )
    .into_bytes()
}

/// The answer a slot holds for (owner, service), if it holds theirs, and when it was asked.
pub fn decode_slot(bytes: &[u8], owner: &str, service: &str) -> Option<(Held, u64)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut lines = text.splitn(5, '\n');
    if lines.next()? != owner || lines.next()? != service {
        return None;
    }
    let asked_ms = lines.next()?.parse().ok()?;
    let protocol_version = lines.next()?.to_string();
    let envelope = lines.next().filter(|e| !e.is_empty()).map(str::to_string);
    Some((
        Held {
            envelope,
            protocol_version,
        },
        asked_ms,
    ))
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

fn question(
    owner: &str,
    service: &str,
    client: Client<'_>,
    stale: Option<&str>,
) -> serde_json::Value {
    let mut q = json!({"owner": owner, "service": service, "stale": stale});
    match client {
        Client::Gateway(id) => q["gateway_session"] = json!(id),
        Client::Params(p) => {
            q["params"] = serde_json::from_str(p).unwrap_or(serde_json::Value::Null);
        }
    }
    q
}

/// The body asking toolgate-xds for the session of `owner` with `service`; `stale`: the
/// envelope that just failed.
pub fn open_request(
    owner: &str,
    service: &str,
    client: Client<'_>,
    stale: Option<&str>,
) -> Vec<u8> {
    question(owner, service, client, stale)
        .to_string()
        .into_bytes()
}

/// The body asking toolgate-xds to replay `message` on a new session.
pub fn replay_request(
    owner: &str,
    service: &str,
    client: Client<'_>,
    stale: Option<&str>,
    message: &[u8],
) -> Vec<u8> {
    let mut q = question(owner, service, client, stale);
    q["body"] = json!(STANDARD.encode(message));
    q.to_string().into_bytes()
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

/// A sealed session value: the envelope, and the client's parameters after a newline.
pub fn join(envelope: &str, params: Option<&str>) -> String {
    match params {
        Some(p) => format!("{envelope}\n{p}"),
        None => envelope.to_string(),
    }
}

/// The envelope and the parameters of an opened value.
pub fn split(value: &str) -> (&str, Option<&str>) {
    match value.split_once('\n') {
        Some((e, p)) => (e, Some(p)),
        None => (value, None),
    }
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

/// Why toolgate-xds opened nothing, from its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unopened {
    /// 503: the service has no healthy instance.
    NoInstance,
    /// Anything else: no answer, a refusal, a failure.
    Failed,
}

pub fn unopened(status: Option<u16>) -> Unopened {
    match status {
        Some(503) => Unopened::NoInstance,
        _ => Unopened::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_answers_only_its_owner_and_service() {
        let held = Held {
            envelope: Some("MTI3LjAuMC4xOjE=;UV:YQ==".into()),
            protocol_version: "2025-06-18".into(),
        };
        let bytes = encode_slot("gabc", "orders", &held, 42);
        assert_eq!(decode_slot(&bytes, "gabc", "orders"), Some((held, 42)));
        assert_eq!(decode_slot(&bytes, "gabd", "orders"), None);
        assert_eq!(decode_slot(&bytes, "gabc", "billing"), None);
        let none = Held {
            envelope: None,
            protocol_version: "2026-07-28".into(),
        };
        let bytes = encode_slot("gabc", "orders", &none, 7);
        assert_eq!(decode_slot(&bytes, "gabc", "orders"), Some((none, 7)));
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
