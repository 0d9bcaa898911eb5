//! Breaker policy and the filter's plugin configuration.
//!
//! toolgate-xds sends [`FilterConfig`] to every Envoy over ECDS as JSON; the filter looks up
//! the policy of each `(service, tool)` with [`FilterConfig::policy_for`]. Unknown fields are
//! ignored so that a newer control plane can add knobs without older filters rejecting the
//! whole configuration; values are validated instead, and an invalid configuration is refused
//! as a whole so that the filter keeps the last good one.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::fleet::{ByTool, FleetOpen, Override};
use crate::names::{validate_name, NameError};

/// The shared-data record keeps one slot per probe; the bound keeps that record small.
pub const MAX_HALF_OPEN_PROBES: u32 = 16;
/// The shared-data record keeps one entry per bucket; the bound keeps that record small.
pub const MAX_BUCKETS: u32 = 60;
/// A longer window would mostly measure the past; an hour is already generous.
pub const MAX_WINDOW_SECS: u32 = 3600;
/// Open durations and timeouts above a day are almost certainly unit mistakes (µs for ms).
pub const MAX_DURATION_MS: u64 = 86_400_000;
/// The filter buffers a request body up to this size; larger limits defeat the point of one.
pub const MAX_BODY_BYTES_LIMIT: u64 = 64 * 1024 * 1024;
/// serde_json stops at 128 levels whatever the limit says: beyond that no body parses.
pub const MAX_JSON_DEPTH_LIMIT: u64 = 128;

/// The filter's limits on a request body. Its defaults match Envoy's default buffer limit
/// per connection (1 MiB) and a depth no tool schema needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Bodies above this many bytes are refused with a JSON-RPC error instead of buffered.
    pub max_body_bytes: u64,
    /// Bodies nested deeper than this (arrays and objects) are refused with a JSON-RPC error.
    pub max_json_depth: u64,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_body_bytes: 1024 * 1024,
            max_json_depth: 64,
        }
    }
}

/// One circuit breaker's knobs, plus the Envoy bulkhead limits of the service's cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BreakerPolicy {
    /// Length of the sliding window the rates are computed over.
    pub window_secs: u32,
    /// Width of one bucket; the window slides by one bucket at a time.
    pub bucket_secs: u32,
    /// Opens when failures / calls in the window reach this percentage.
    pub failure_rate_percent: u32,
    /// A call that takes at least this long is slow.
    pub slow_call_ms: u64,
    /// Opens when slow calls / calls in the window reach this percentage.
    pub slow_call_rate_percent: u32,
    /// No rate is judged on fewer calls than this: two failures out of three say little.
    pub min_calls: u32,
    /// Open duration after the first trip; it doubles with each trip in a row.
    pub open_ms: u64,
    /// Ceiling of the doubling open duration.
    pub max_open_ms: u64,
    /// Up to this percentage is taken off each open duration at random, so that gateways
    /// that tripped together do not probe together.
    pub open_jitter_percent: u32,
    /// Probes let through in HALF_OPEN; all of them must succeed to close.
    pub half_open_probes: u32,
    /// A probe that has not answered after this long frees its slot; `None` means twice
    /// `slow_call_ms` (see [`BreakerPolicy::probe_timeout_ms`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_timeout_ms: Option<u64>,
    /// Whether a tool result with `isError: true` counts as a failure. It is the tool's own
    /// answer (bad arguments, nothing found), so by default it does not.
    pub count_is_error: bool,
    /// A tool the agent is told to use instead while this one's breaker is open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_tool: Option<String>,
    /// Envoy cluster circuit-breaker thresholds (the bulkhead of the service).
    pub max_connections: u32,
    pub max_pending_requests: u32,
    pub max_requests: u32,
    pub max_retries: u32,
    /// Envoy's response timeout for the service's calls (the route timeout); a hung tool
    /// then fails as a timeout instead of holding the agent. MCP's long-lived GET stream is
    /// not subject to it.
    pub timeout_ms: u64,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            window_secs: 10,
            bucket_secs: 1,
            failure_rate_percent: 50,
            slow_call_ms: 2000,
            slow_call_rate_percent: 60,
            min_calls: 10,
            open_ms: 10_000,
            max_open_ms: 300_000,
            open_jitter_percent: 20,
            half_open_probes: 3,
            probe_timeout_ms: None,
            count_is_error: false,
            fallback_tool: None,
            max_connections: 1024,
            max_pending_requests: 1024,
            max_requests: 1024,
            max_retries: 3,
            timeout_ms: 60_000,
        }
    }
}

#[derive(Debug, Error)]
pub enum PolicyError {
    #[error("not valid filter configuration JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{field} = {value} is invalid: {rule}")]
    Invalid {
        field: String,
        value: String,
        rule: String,
    },
    #[error("{at}: {source}")]
    Name {
        at: String,
        #[source]
        source: NameError,
    },
}

impl PolicyError {
    fn invalid(field: &str, value: impl ToString, rule: impl Into<String>) -> Self {
        PolicyError::Invalid {
            field: field.to_string(),
            value: value.to_string(),
            rule: rule.into(),
        }
    }

    /// Puts the place in the configuration in front of the field name, so the operator
    /// learns which service or tool override is wrong.
    fn within(self, scope: &str) -> Self {
        match self {
            PolicyError::Invalid { field, value, rule } => PolicyError::Invalid {
                field: format!("{scope}.{field}"),
                value,
                rule,
            },
            PolicyError::Name { at, source } => PolicyError::Name {
                at: format!("{scope}.{at}"),
                source,
            },
            other => other,
        }
    }
}

fn check_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    value: T,
    min: T,
    max: T,
) -> Result<(), PolicyError> {
    if value < min || value > max {
        return Err(PolicyError::invalid(
            field,
            value,
            format!("must be {min}..={max}"),
        ));
    }
    Ok(())
}

impl BreakerPolicy {
    /// How long a half-open probe may hold its slot before another request may probe.
    pub fn probe_timeout_ms(&self) -> u64 {
        self.probe_timeout_ms
            .unwrap_or_else(|| self.slow_call_ms.saturating_mul(2))
    }

    /// The number of buckets in the window. Only meaningful on a validated policy.
    pub fn buckets(&self) -> u32 {
        self.window_secs / self.bucket_secs.max(1)
    }

    /// Checks every value; the error names the first bad field and its value.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check_range("window_secs", self.window_secs, 1, MAX_WINDOW_SECS)?;
        check_range("bucket_secs", self.bucket_secs, 1, self.window_secs)?;
        if !self.window_secs.is_multiple_of(self.bucket_secs) {
            return Err(PolicyError::invalid(
                "bucket_secs",
                self.bucket_secs,
                format!("must divide window_secs ({})", self.window_secs),
            ));
        }
        if self.buckets() > MAX_BUCKETS {
            return Err(PolicyError::invalid(
                "bucket_secs",
                self.bucket_secs,
                format!(
                    "makes {} buckets in a {}s window; at most {MAX_BUCKETS} are allowed",
                    self.buckets(),
                    self.window_secs
                ),
            ));
        }
        check_range("failure_rate_percent", self.failure_rate_percent, 1, 100)?;
        check_range("slow_call_ms", self.slow_call_ms, 1, MAX_DURATION_MS)?;
        check_range(
            "slow_call_rate_percent",
            self.slow_call_rate_percent,
            1,
            100,
        )?;
        check_range("min_calls", self.min_calls, 1, u32::MAX)?;
        check_range("open_ms", self.open_ms, 1, MAX_DURATION_MS)?;
        check_range(
            "max_open_ms",
            self.max_open_ms,
            self.open_ms,
            MAX_DURATION_MS,
        )?;
        check_range("open_jitter_percent", self.open_jitter_percent, 0, 100)?;
        check_range(
            "half_open_probes",
            self.half_open_probes,
            1,
            MAX_HALF_OPEN_PROBES,
        )?;
        if let Some(ms) = self.probe_timeout_ms {
            check_range("probe_timeout_ms", ms, 1, MAX_DURATION_MS)?;
        }
        if let Some(tool) = &self.fallback_tool {
            validate_name("tool", tool).map_err(|source| PolicyError::Name {
                at: "fallback_tool".to_string(),
                source,
            })?;
        }
        check_range("max_connections", self.max_connections, 1, u32::MAX)?;
        check_range(
            "max_pending_requests",
            self.max_pending_requests,
            1,
            u32::MAX,
        )?;
        check_range("max_requests", self.max_requests, 1, u32::MAX)?;
        check_range("timeout_ms", self.timeout_ms, 1, MAX_DURATION_MS)?;
        Ok(())
    }
}

/// A partial policy: each field that is set replaces the one it is laid over.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyOverrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_secs: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_secs: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_rate_percent: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_call_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_call_rate_percent: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_calls: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_open_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_jitter_percent: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub half_open_probes: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count_is_error: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_tool: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pending_requests: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_requests: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl PolicyOverrides {
    /// Lays these overrides over `policy`.
    pub fn apply_to(&self, policy: &mut BreakerPolicy) {
        fn set<T: Clone>(field: &mut T, value: &Option<T>) {
            if let Some(v) = value {
                *field = v.clone();
            }
        }
        set(&mut policy.window_secs, &self.window_secs);
        set(&mut policy.bucket_secs, &self.bucket_secs);
        set(&mut policy.failure_rate_percent, &self.failure_rate_percent);
        set(&mut policy.slow_call_ms, &self.slow_call_ms);
        set(
            &mut policy.slow_call_rate_percent,
            &self.slow_call_rate_percent,
        );
        set(&mut policy.min_calls, &self.min_calls);
        set(&mut policy.open_ms, &self.open_ms);
        set(&mut policy.max_open_ms, &self.max_open_ms);
        set(&mut policy.open_jitter_percent, &self.open_jitter_percent);
        set(&mut policy.half_open_probes, &self.half_open_probes);
        if self.probe_timeout_ms.is_some() {
            policy.probe_timeout_ms = self.probe_timeout_ms;
        }
        set(&mut policy.count_is_error, &self.count_is_error);
        if self.fallback_tool.is_some() {
            policy.fallback_tool.clone_from(&self.fallback_tool);
        }
        set(&mut policy.max_connections, &self.max_connections);
        set(&mut policy.max_pending_requests, &self.max_pending_requests);
        set(&mut policy.max_requests, &self.max_requests);
        set(&mut policy.max_retries, &self.max_retries);
        set(&mut policy.timeout_ms, &self.timeout_ms);
    }
}

/// Overrides for one service and for its tools.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServicePolicy {
    /// Laid over the defaults for every tool of the service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyOverrides>,
    /// Laid over the service's policy for one tool.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<String, PolicyOverrides>,
}

/// The filter's plugin configuration, sent by toolgate-xds over ECDS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FilterConfig {
    pub defaults: BreakerPolicy,
    pub services: BTreeMap<String, ServicePolicy>,
    /// Request bodies above this are refused with a JSON-RPC error instead of buffered.
    pub max_body_bytes: u64,
    /// Request bodies nested deeper than this (arrays and objects) are refused with a JSON-RPC
    /// error: a parser, the gateway's or a tool server's, must not be made to recurse that far.
    pub max_json_depth: u64,
    /// Tools a gateway of the fleet opened: open here too until `until_ms`, then probed
    /// locally (HALF_OPEN) as usual.
    pub fleet_open: ByTool<FleetOpen>,
    /// Operator overrides, until lifted.
    pub overrides: ByTool<Override>,
    /// The Envoy node id this configuration was served to (filled per Envoy by toolgate-xds):
    /// the `gateway` of this filter's breaker events.
    pub gateway: String,
    /// The bearer token the filter sends with its reports to toolgate-xds (`/v1/feedback`,
    /// `/v1/breaker-events`); filled per Envoy by toolgate-xds when it requires one.
    #[serde(skip_serializing_if = "SecretString::is_empty")]
    pub report_token: SecretString,
    /// Whether this Envoy writes an access log that reads the filter's MCP fields (filled per
    /// Envoy by toolgate-xds from its node metadata): without one, the filter skips them.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub access_log: bool,
    /// Every service with instances, and the tools its registrations list (the union over its
    /// instances; empty when they list none). The filter keeps breakers only for what is
    /// here: a request cannot create state by naming a service or tool nobody registered.
    pub catalog: BTreeMap<String, BTreeSet<String>>,
    /// The key (32 bytes, standard base64) the filter seals `Mcp-Session-Id` with, so that no
    /// upstream address reaches a client; empty: not sealed.
    #[serde(skip_serializing_if = "SecretString::is_empty")]
    pub session_key: SecretString,
    /// The virtual servers (issue 19), by name: the tool names an agent may call on each
    /// and the (service, tool) each calls. `default` is served at `/mcp`, every one at
    /// `/virtual/<name>`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub virtual_servers: BTreeMap<String, crate::virtual_server::VirtualRoutes>,
    /// The services whose servers speak only a revision with sessions (2025-03-26 …
    /// 2025-11-25), and the one toolgate-xds's catalog agreed on with them. A 2026-07-28
    /// client of the aggregate endpoint has no session: its calls to these services go on a
    /// session the gateway holds for its stated identity (`filter/src/held_session.rs`).
    /// Empty until the catalog has read a service (never with `--no-probes`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub legacy_revisions: BTreeMap<String, String>,
    /// Who may call (issue 20): absent while `<prefix>auth/config` is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth: Option<crate::auth::FilterAuth>,
    /// Every header name a stored rule set copies a verified claim into (lower case), whether
    /// or not an auth configuration is on: the filter removes them from every request on an
    /// MCP path, so that no client can write what a server takes for a verified claim.
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub claim_header_names: BTreeSet<String>,
    /// Services whose credential toward their servers is each caller's own token exchanged
    /// (RFC 8693) by toolgate-xds, with a fingerprint of the exchange's configuration: the
    /// filter asks for it (`/v1/token-exchange`), sends no request to them without it, and
    /// forgets what it cached when a fingerprint changes.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub exchanged: BTreeMap<String, String>,
    /// What each virtual server lists (by name), for the filter to answer `tools/list` on its
    /// own while no toolgate-xds of the fleet answers: each tool under the name shown there
    /// with the definition toolgate-xds last read (`title`, `description`, `inputSchema`,
    /// `outputSchema`, `annotations`), never its availability. Bounded: over its budget
    /// only names with `{"type": "object"}` schemas (the description says so), or none.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub offline_listings: BTreeMap<String, Vec<serde_json::Value>>,
    /// The call limits in force (`<prefix>limits/...`), and the fleet's size they are split
    /// by.
    #[serde(skip_serializing_if = "crate::limits::FilterLimits::is_empty")]
    pub limits: crate::limits::FilterLimits,
}

/// A secret that never shows in a `Debug` print (configurations are logged and asserted on):
/// the filters' report token, the session-sealing key.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretString(pub String);

impl SecretString {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_empty() {
            "SecretString(none)"
        } else {
            "SecretString(set)"
        })
    }
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            defaults: BreakerPolicy::default(),
            services: BTreeMap::new(),
            max_body_bytes: RequestLimits::default().max_body_bytes,
            max_json_depth: RequestLimits::default().max_json_depth,
            fleet_open: BTreeMap::new(),
            overrides: BTreeMap::new(),
            gateway: String::new(),
            report_token: SecretString::default(),
            access_log: false,
            catalog: BTreeMap::new(),
            session_key: SecretString::default(),
            virtual_servers: BTreeMap::new(),
            legacy_revisions: BTreeMap::new(),
            auth: None,
            claim_header_names: BTreeSet::new(),
            exchanged: BTreeMap::new(),
            offline_listings: BTreeMap::new(),
            limits: crate::limits::FilterLimits::default(),
        }
    }
}

impl FilterConfig {
    /// Parses and validates a configuration as the filter receives it.
    pub fn from_json(bytes: &[u8]) -> Result<Self, PolicyError> {
        let config: FilterConfig = serde_json::from_slice(bytes)?;
        config.validate()?;
        Ok(config)
    }

    /// The policy of one tool: defaults, then the service's overrides, then the tool's.
    pub fn policy_for(&self, service: &str, tool: &str) -> BreakerPolicy {
        let mut policy = self.defaults.clone();
        if let Some(svc) = self.services.get(service) {
            if let Some(overrides) = &svc.policy {
                overrides.apply_to(&mut policy);
            }
            if let Some(overrides) = svc.tools.get(tool) {
                overrides.apply_to(&mut policy);
            }
        }
        policy
    }

    /// Validates the defaults and every merged policy an override can produce, so that
    /// [`FilterConfig::policy_for`] on a validated configuration always yields a valid policy.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check_range(
            "max_body_bytes",
            self.max_body_bytes,
            1,
            MAX_BODY_BYTES_LIMIT,
        )?;
        check_range(
            "max_json_depth",
            self.max_json_depth,
            1,
            MAX_JSON_DEPTH_LIMIT,
        )?;
        self.defaults.validate().map_err(|e| e.within("defaults"))?;
        for (service, svc) in &self.services {
            let scope = format!("services.{service}");
            validate_name("service", service).map_err(|source| PolicyError::Name {
                at: scope.clone(),
                source,
            })?;
            let mut service_policy = self.defaults.clone();
            if let Some(overrides) = &svc.policy {
                overrides.apply_to(&mut service_policy);
            }
            service_policy
                .validate()
                .map_err(|e| e.within(&format!("{scope}.policy")))?;
            for (tool, overrides) in &svc.tools {
                let scope = format!("{scope}.tools.{tool}");
                validate_name("tool", tool).map_err(|source| PolicyError::Name {
                    at: scope.clone(),
                    source,
                })?;
                let mut tool_policy = service_policy.clone();
                overrides.apply_to(&mut tool_policy);
                tool_policy.validate().map_err(|e| e.within(&scope))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones_and_valid() {
        let p = BreakerPolicy::default();
        assert_eq!(p.window_secs, 10);
        assert_eq!(p.bucket_secs, 1);
        assert_eq!(p.buckets(), 10);
        assert_eq!(p.failure_rate_percent, 50);
        assert_eq!(p.slow_call_ms, 2000);
        assert_eq!(p.slow_call_rate_percent, 60);
        assert_eq!(p.min_calls, 10);
        assert_eq!(p.open_ms, 10_000);
        assert_eq!(p.max_open_ms, 300_000);
        assert_eq!(p.half_open_probes, 3);
        assert_eq!(p.probe_timeout_ms(), 4000);
        assert!(!p.count_is_error);
        assert_eq!(
            (
                p.max_connections,
                p.max_pending_requests,
                p.max_requests,
                p.max_retries
            ),
            (1024, 1024, 1024, 3)
        );
        p.validate().unwrap();

        let from_empty: BreakerPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(from_empty, p);
        let config = FilterConfig::from_json(b"{}").unwrap();
        assert_eq!(config.max_body_bytes, 1024 * 1024);
        assert_eq!(config.policy_for("any", "tool"), p);
    }

    #[test]
    fn merges_defaults_then_service_then_tool() {
        let config = FilterConfig::from_json(
            br#"{
                "defaults": {"min_calls": 20, "open_ms": 5000},
                "services": {
                    "weather": {
                        "policy": {"min_calls": 5, "failure_rate_percent": 30},
                        "tools": {
                            "forecast": {"failure_rate_percent": 80, "fallback_tool": "forecast_cached"}
                        }
                    }
                }
            }"#,
        )
        .unwrap();

        let other = config.policy_for("maps", "route");
        assert_eq!((other.min_calls, other.open_ms), (20, 5000));
        assert_eq!(other.failure_rate_percent, 50);

        let svc = config.policy_for("weather", "alerts");
        assert_eq!(svc.min_calls, 5);
        assert_eq!(svc.failure_rate_percent, 30);
        assert_eq!(svc.open_ms, 5000);
        assert_eq!(svc.fallback_tool, None);

        let tool = config.policy_for("weather", "forecast");
        assert_eq!(tool.min_calls, 5);
        assert_eq!(tool.failure_rate_percent, 80);
        assert_eq!(tool.fallback_tool.as_deref(), Some("forecast_cached"));
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let config = FilterConfig::from_json(
            br#"{
                "future_knob": true,
                "defaults": {"min_calls": 3, "adaptive": {"x": 1}},
                "services": {"s": {"weight": 2, "tools": {"t": {"new_field": "y", "open_ms": 7}}}}
            }"#,
        )
        .unwrap();
        assert_eq!(config.policy_for("s", "t").min_calls, 3);
        assert_eq!(config.policy_for("s", "t").open_ms, 7);
    }

    fn invalid_field(err: PolicyError) -> (String, String) {
        match err {
            PolicyError::Invalid { field, value, .. } => (field, value),
            other => panic!("expected an invalid field, got {other}"),
        }
    }

    #[test]
    fn validation_names_the_bad_field_and_value() {
        let cases: Vec<(PolicyOverrides, &str, &str)> = vec![
            (
                PolicyOverrides {
                    failure_rate_percent: Some(0),
                    ..Default::default()
                },
                "failure_rate_percent",
                "0",
            ),
            (
                PolicyOverrides {
                    slow_call_rate_percent: Some(101),
                    ..Default::default()
                },
                "slow_call_rate_percent",
                "101",
            ),
            (
                PolicyOverrides {
                    bucket_secs: Some(3),
                    ..Default::default()
                },
                "bucket_secs",
                "3",
            ),
            (
                PolicyOverrides {
                    window_secs: Some(120),
                    bucket_secs: Some(1),
                    ..Default::default()
                },
                "bucket_secs",
                "1",
            ),
            (
                PolicyOverrides {
                    bucket_secs: Some(0),
                    ..Default::default()
                },
                "bucket_secs",
                "0",
            ),
            (
                PolicyOverrides {
                    open_ms: Some(0),
                    ..Default::default()
                },
                "open_ms",
                "0",
            ),
            (
                PolicyOverrides {
                    max_open_ms: Some(1000),
                    ..Default::default()
                },
                "max_open_ms",
                "1000",
            ),
            (
                PolicyOverrides {
                    half_open_probes: Some(17),
                    ..Default::default()
                },
                "half_open_probes",
                "17",
            ),
            (
                PolicyOverrides {
                    probe_timeout_ms: Some(0),
                    ..Default::default()
                },
                "probe_timeout_ms",
                "0",
            ),
            (
                PolicyOverrides {
                    min_calls: Some(0),
                    ..Default::default()
                },
                "min_calls",
                "0",
            ),
            (
                PolicyOverrides {
                    max_requests: Some(0),
                    ..Default::default()
                },
                "max_requests",
                "0",
            ),
        ];
        for (overrides, field, value) in cases {
            let mut p = BreakerPolicy::default();
            overrides.apply_to(&mut p);
            let err = p.validate().expect_err(field);
            assert!(err.to_string().contains(field), "{err}");
            assert_eq!(invalid_field(err), (field.to_string(), value.to_string()));
        }
        let bad_fallback = BreakerPolicy {
            fallback_tool: Some("no/slash".into()),
            ..Default::default()
        };
        assert!(matches!(
            bad_fallback.validate(),
            Err(PolicyError::Name { .. })
        ));
        let zeros_allowed = BreakerPolicy {
            max_retries: 0,
            open_jitter_percent: 0,
            ..Default::default()
        };
        zeros_allowed.validate().unwrap();
    }

    #[test]
    fn config_errors_say_where_the_override_is() {
        let err = FilterConfig::from_json(
            br#"{"services": {"weather": {"tools": {"forecast": {"failure_rate_percent": 200}}}}}"#,
        )
        .unwrap_err();
        assert_eq!(
            invalid_field(err),
            (
                "services.weather.tools.forecast.failure_rate_percent".into(),
                "200".into()
            )
        );

        let err = FilterConfig::from_json(
            br#"{"services": {"weather": {"policy": {"window_secs": 0}}}}"#,
        )
        .unwrap_err();
        assert_eq!(
            invalid_field(err),
            ("services.weather.policy.window_secs".into(), "0".into())
        );

        let err = FilterConfig::from_json(br#"{"defaults": {"bucket_secs": 4}}"#).unwrap_err();
        assert_eq!(
            invalid_field(err),
            ("defaults.bucket_secs".into(), "4".into())
        );

        let err = FilterConfig::from_json(br#"{"services": {"bad name": {}}}"#).unwrap_err();
        assert!(err.to_string().contains("services.bad name"), "{err}");

        let err = FilterConfig::from_json(br#"{"max_body_bytes": 0}"#).unwrap_err();
        assert_eq!(invalid_field(err), ("max_body_bytes".into(), "0".into()));
        let err = FilterConfig::from_json(br#"{"max_json_depth": 129}"#).unwrap_err();
        assert_eq!(invalid_field(err), ("max_json_depth".into(), "129".into()));

        assert!(matches!(
            FilterConfig::from_json(br#"{"defaults": {"min_calls": "ten"}}"#),
            Err(PolicyError::Json(_))
        ));
    }

    #[test]
    fn round_trips_through_json() {
        let mut config = FilterConfig::default();
        config.services.insert(
            "s".into(),
            ServicePolicy {
                policy: Some(PolicyOverrides {
                    open_ms: Some(2000),
                    ..Default::default()
                }),
                tools: BTreeMap::from([(
                    "t".into(),
                    PolicyOverrides {
                        count_is_error: Some(true),
                        ..Default::default()
                    },
                )]),
            },
        );
        let json = serde_json::to_vec(&config).unwrap();
        assert_eq!(FilterConfig::from_json(&json).unwrap(), config);
        assert!(config.policy_for("s", "t").count_is_error);
    }
}
