//! `InstanceMetadata`: the value stored under `/mcp/services/<service>/<instance_id>`.
//!
//! Unknown fields are ignored so that newer registrars can add fields without breaking
//! older control planes; a missing required field or an out-of-range value makes the
//! whole value invalid, and the reader decides what to do with it (log, count, skip).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::endpoint::Endpoint;
use crate::names::{validate_name, NameError};

/// Envoy accepts load-balancing weights from 1; 128 keeps one instance from drowning the rest.
pub const MAX_WEIGHT: u32 = 128;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceMetadata {
    pub instance_id: String,
    pub endpoint: Endpoint,
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default = "default_mcp_path")]
    pub mcp_path: String,
    #[serde(default = "default_health_path")]
    pub health_path: String,
    /// How toolgate-xds probes the instance. Registrations from before probe kinds existed
    /// carry none and keep today's `GET health_path` probe.
    #[serde(default)]
    pub probe: ProbeKind,
    /// MCP revisions the instance speaks, newest first, as its registrar learned them from
    /// the server (or the operator declared them). Empty: not known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocol_versions: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// How an instance's liveness is checked. Each kind sees a different depth of the server; the
/// The book's health page (docs/src/concepts/health.md) says which failures each one detects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// `GET health_path` answers 2xx in time.
    #[default]
    Http,
    /// The MCP endpoint answers an MCP request (`server/discover` for 2026-07-28, `ping` on a
    /// kept session before it): catches a wedged MCP handler behind a live HTTP stack.
    Mcp,
    /// A TCP connect succeeds: the weakest signal, for servers that answer nothing cheaply.
    Tcp,
}

impl ProbeKind {
    pub const ALL: [ProbeKind; 3] = [ProbeKind::Http, ProbeKind::Mcp, ProbeKind::Tcp];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Http => "http",
            ProbeKind::Mcp => "mcp",
            ProbeKind::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for ProbeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ProbeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ProbeKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("probe kind {s:?} is not one of http, mcp, tcp"))
    }
}

/// The longest protocol revision string kept; real ones are dates (`2025-11-25`).
pub const MAX_PROTOCOL_VERSION_LEN: usize = 32;
/// Revisions kept per instance; a server listing more is not telling the truth.
pub const MAX_PROTOCOL_VERSIONS: usize = 16;

fn default_weight() -> u32 {
    1
}
/// Where an instance serves MCP unless its metadata says otherwise.
pub const DEFAULT_MCP_PATH: &str = "/mcp";

fn default_mcp_path() -> String {
    DEFAULT_MCP_PATH.to_string()
}
fn default_health_path() -> String {
    "/health".to_string()
}

#[derive(Debug, Error)]
pub enum InstanceError {
    #[error("not valid instance metadata JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Name(#[from] NameError),
    #[error("weight {0} is out of range; it must be 1..={MAX_WEIGHT}")]
    Weight(u32),
    #[error("{field} {value:?} must be an absolute path starting with '/'")]
    Path { field: &'static str, value: String },
    #[error("protocol_versions: {0}")]
    ProtocolVersions(String),
    #[error("instance_id {in_value:?} does not match the key's instance id {in_key:?}")]
    IdMismatch { in_value: String, in_key: String },
}

impl InstanceMetadata {
    /// A minimal valid registration; the other fields take their defaults.
    pub fn new(instance_id: impl Into<String>, endpoint: Endpoint) -> Self {
        InstanceMetadata {
            instance_id: instance_id.into(),
            endpoint,
            weight: default_weight(),
            tools: Vec::new(),
            mcp_path: default_mcp_path(),
            health_path: default_health_path(),
            probe: ProbeKind::default(),
            protocol_versions: Vec::new(),
            version: String::new(),
            zone: String::new(),
            labels: BTreeMap::new(),
        }
    }

    /// Parses and validates a stored value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, InstanceError> {
        let meta: InstanceMetadata = serde_json::from_slice(bytes)?;
        meta.validate()?;
        Ok(meta)
    }

    pub fn to_json(&self) -> String {
        // Serializing plain strings, numbers and maps with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn validate(&self) -> Result<(), InstanceError> {
        validate_name("instance", &self.instance_id)?;
        for tool in &self.tools {
            validate_name("tool", tool)?;
        }
        if !(1..=MAX_WEIGHT).contains(&self.weight) {
            return Err(InstanceError::Weight(self.weight));
        }
        for (field, value) in [
            ("mcp_path", &self.mcp_path),
            ("health_path", &self.health_path),
        ] {
            if !value.starts_with('/') || value.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(InstanceError::Path {
                    field,
                    value: value.clone(),
                });
            }
        }
        if self.protocol_versions.len() > MAX_PROTOCOL_VERSIONS {
            return Err(InstanceError::ProtocolVersions(format!(
                "{} revisions listed, at most {MAX_PROTOCOL_VERSIONS}",
                self.protocol_versions.len()
            )));
        }
        for v in &self.protocol_versions {
            let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
            if v.is_empty() || v.len() > MAX_PROTOCOL_VERSION_LEN || !v.chars().all(plain) {
                return Err(InstanceError::ProtocolVersions(format!(
                    "{v:?} is not a revision like \"2025-11-25\""
                )));
            }
        }
        Ok(())
    }

    /// Whether the instance is known to speak `revision`.
    pub fn speaks(&self, revision: &str) -> bool {
        self.protocol_versions.iter().any(|v| v == revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_value_takes_defaults_and_ignores_unknown_fields() {
        let m = InstanceMetadata::from_json(
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9000","future_field":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(m.weight, 1);
        assert_eq!(m.mcp_path, "/mcp");
        assert_eq!(m.health_path, "/health");
        assert!(m.tools.is_empty());
        assert_eq!(m.probe, ProbeKind::Http);
        assert!(m.protocol_versions.is_empty());
        // An old registration serializes as before: no revisions field appears.
        assert!(!m.to_json().contains("protocol_versions"));
    }

    #[test]
    fn probe_kinds_and_revisions_round_trip_and_bad_ones_are_refused() {
        let m = InstanceMetadata::from_json(
            br#"{"instance_id":"i","endpoint":"h:1","probe":"mcp","protocol_versions":["2026-07-28","2025-11-25"]}"#,
        )
        .unwrap();
        assert_eq!(m.probe, ProbeKind::Mcp);
        assert!(m.speaks("2026-07-28") && !m.speaks("2025-03-26"));
        assert_eq!(
            InstanceMetadata::from_json(m.to_json().as_bytes()).unwrap(),
            m
        );
        for bad in [
            &br#"{"instance_id":"i","endpoint":"h:1","probe":"grpc"}"#[..],
            br#"{"instance_id":"i","endpoint":"h:1","probe":"MCP"}"#,
            br#"{"instance_id":"i","endpoint":"h:1","protocol_versions":[""]}"#,
            br#"{"instance_id":"i","endpoint":"h:1","protocol_versions":["2025 11 25"]}"#,
            br#"{"instance_id":"i","endpoint":"h:1","protocol_versions":"2025-11-25"}"#,
        ] {
            assert!(
                InstanceMetadata::from_json(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!("tcp".parse::<ProbeKind>(), Ok(ProbeKind::Tcp));
        assert!("auto".parse::<ProbeKind>().is_err());
    }

    #[test]
    fn round_trips() {
        let mut m = InstanceMetadata::new("i-1", "10.0.0.7:8080".parse().unwrap());
        m.tools = vec!["tax_calc".into()];
        m.labels.insert("team".into(), "finance".into());
        m.zone = "eu-1a".into();
        assert_eq!(
            InstanceMetadata::from_json(m.to_json().as_bytes()).unwrap(),
            m
        );
    }

    #[test]
    fn invalid_values_are_errors_not_panics() {
        for bad in [
            &b"not json"[..],
            br#"{"endpoint":"127.0.0.1:1"}"#,
            br#"{"instance_id":"i","endpoint":"nope"}"#,
            br#"{"instance_id":"i","endpoint":"h:1","weight":0}"#,
            br#"{"instance_id":"i","endpoint":"h:1","weight":129}"#,
            br#"{"instance_id":"i","endpoint":"h:1","weight":-1}"#,
            br#"{"instance_id":"i","endpoint":"h:1","tools":["a b"]}"#,
            br#"{"instance_id":"i/j","endpoint":"h:1"}"#,
            br#"{"instance_id":"i","endpoint":"h:1","mcp_path":"mcp"}"#,
            br#"[]"#,
        ] {
            assert!(
                InstanceMetadata::from_json(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
