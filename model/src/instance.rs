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
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn default_weight() -> u32 {
    1
}
fn default_mcp_path() -> String {
    "/mcp".to_string()
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
        Ok(())
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
