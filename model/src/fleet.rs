//! What one gateway tells the others through etcd: breaker openings (`<prefix>breakers/…`,
//! leased for the open duration) and operator overrides (`<prefix>overrides/…`, until lifted),
//! and how toolgate-xds hands both to its filters inside the ECDS configuration.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A breaker opened somewhere in the fleet: the value of `<prefix>breakers/<service>/<tool>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetOpen {
    /// Wall clock (Unix ms) until which the tool is open everywhere; the key's lease expires
    /// then too.
    pub until_ms: u64,
    /// The gateway (Envoy node id) whose breaker opened.
    pub opened_by: String,
    /// When it opened (Unix ms).
    #[serde(default)]
    pub opened_at_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverrideMode {
    /// Every call gets the semantic reply with the operator's reason.
    ForceOpen,
    /// The breaker never opens (its window still counts). `force_close` is accepted too: the
    /// runbook's "force close" reads that way, and a refused spelling would fail an operator
    /// in the middle of an incident.
    #[serde(alias = "force_close")]
    ForceClosed,
}

impl OverrideMode {
    pub fn as_str(self) -> &'static str {
        match self {
            OverrideMode::ForceOpen => "force_open",
            OverrideMode::ForceClosed => "force_closed",
        }
    }
}

/// An operator override: the value of `<prefix>overrides/<service>/<tool>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Override {
    pub mode: OverrideMode,
    pub reason: String,
    #[serde(default)]
    pub author: String,
    /// When it was set (Unix ms).
    #[serde(default)]
    pub at_ms: u64,
}

/// Longest operator reason accepted: it is shown to agents verbatim.
pub const MAX_REASON_LEN: usize = 500;

/// service → tool → value.
pub type ByTool<T> = BTreeMap<String, BTreeMap<String, T>>;

/// A breaker transition a filter reports to its toolgate-xds (`POST /v1/breaker-events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerEvent {
    pub service: String,
    pub tool: String,
    pub state: EventState,
    /// For `open`: how long this opening lasts (the lease TTL of the fleet event).
    #[serde(default)]
    pub open_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventState {
    Open,
    Closed,
}

/// The body of `POST /v1/breaker-events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerEvents {
    /// The reporting Envoy's node id.
    pub gateway: String,
    pub events: Vec<BreakerEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn force_close_and_force_closed_are_the_same_mode_written_one_way() {
        for spelling in ["force_close", "force_closed"] {
            let o: Override =
                serde_json::from_str(&format!(r#"{{"mode":"{spelling}","reason":"fixed"}}"#))
                    .unwrap();
            assert_eq!(o.mode, OverrideMode::ForceClosed, "{spelling}");
            assert!(serde_json::to_string(&o)
                .unwrap()
                .contains(r#""mode":"force_closed""#));
        }
        assert!(serde_json::from_str::<OverrideMode>(r#""force_shut""#).is_err());
    }
}

/// Where a filter tells its toolgate-xds how it took a configuration (with its report token,
/// like `/v1/feedback`).
pub const FILTER_CONFIG_STATUS_PATH: &str = "/v1/filter-config-status";

/// A filter's word on the configuration it was sent: refused (it keeps judging with the last
/// one it accepted, or refuses calls when it has none), or accepted again after a refusal. The
/// operator sees it per Envoy in `/v1/envoys`, as an ECDS NACK would show, since the filter
/// answers Envoy's configuration callback with success either way: a failed configure would
/// leave the plugin unusable on that worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterConfigStatus {
    /// The Envoy node id.
    pub gateway: String,
    pub accepted: bool,
    /// Why the configuration was refused (the filter's parse or validation error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
