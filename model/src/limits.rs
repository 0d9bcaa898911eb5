//! How much a caller may call: token-bucket rules stored at `<prefix>limits/<service>` (every
//! request of the service) and `<prefix>limits/<service>/<tool>` (that tool's calls), and how
//! toolgate-xds hands them to the filters inside the ECDS configuration.
//!
//! A rule is a bucket of `burst` tokens (default `calls`) refilled at `calls` per
//! `per_seconds`; each admitted request takes one token. `per` says whose bucket it is:
//! each verified subject's, each client's, or one for every caller of the gateway. A fleet of
//! `gateways` Envoys splits every rule evenly: each Envoy keeps `1/gateways` of the rate and
//! of the burst (at least one token), so the fleet admits at most the rule's budget while its
//! size is known.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Rules one key may hold: each is a bucket per caller and a check per request.
pub const MAX_RULES_PER_KEY: usize = 8;
/// Largest `calls` and `burst` accepted.
pub const MAX_CALLS: u64 = 1_000_000_000;
/// Longest window accepted: 30 days (a monthly quota).
pub const MAX_PER_SECONDS: u64 = 30 * 24 * 3600;
/// Longest rule name accepted (it is a metric label and is shown to agents).
pub const MAX_RULE_NAME_LEN: usize = 64;

/// Whose bucket a rule keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    /// The verified `sub` of the caller's token. Without a verified subject (no auth
    /// configuration, or a service that requires no token and got none) the caller is counted
    /// by its client identity instead, so a rule per subject never lets anonymous calls pass
    /// unlimited.
    Subject,
    /// The client identity the gateway sees without auth: the session the gateway sealed for
    /// it, else its source address.
    Client,
    /// One bucket for every caller of the gateway.
    Gateway,
}

impl Per {
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Subject => "subject",
            Per::Client => "client",
            Per::Gateway => "gateway",
        }
    }
}

/// One rule, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitRule {
    pub per: Per,
    /// Tokens added per `per_seconds`.
    pub calls: u64,
    pub per_seconds: u64,
    /// The bucket's size: the most calls admitted at once after a quiet time. Default
    /// `calls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// The rule's name in replies, metrics and logs. Default: `<per>-<calls>-per-<per_seconds>s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl LimitRule {
    pub fn burst(&self) -> u64 {
        self.burst.unwrap_or(self.calls)
    }

    /// The name replies, metrics and logs use.
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => n.clone(),
            None => format!(
                "{}-{}-per-{}s",
                self.per.as_str(),
                self.calls,
                self.per_seconds
            ),
        }
    }
}

/// A field of a limits value that was refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct LimitError {
    /// The refused field, as a path (`rules[1].per_seconds`), or `value` for the whole.
    pub field: String,
    pub message: String,
}

fn error(field: impl Into<String>, message: impl Into<String>) -> LimitError {
    LimitError {
        field: field.into(),
        message: message.into(),
    }
}

/// The value of a limits key: `{"rules": [rule, ...]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub rules: Vec<LimitRule>,
}

impl Limits {
    /// Parses and validates a stored value whole: `{"rules": [...]}`, or one rule object.
    /// Every refusal names its field.
    pub fn parse(value: &[u8]) -> Result<Self, LimitError> {
        let raw: serde_json::Value =
            serde_json::from_slice(value).map_err(|e| error("value", format!("not JSON: {e}")))?;
        let limits = match &raw {
            serde_json::Value::Object(o) if o.contains_key("rules") => {
                deserialize::<Limits>(value, "")?
            }
            serde_json::Value::Object(_) => Limits {
                rules: vec![deserialize::<LimitRule>(value, "rules[0]")?],
            },
            _ => {
                return Err(error(
                    "value",
                    "not a limits value: expected {\"rules\": [...]} or one rule object",
                ))
            }
        };
        limits.validate()?;
        Ok(limits)
    }

    fn validate(&self) -> Result<(), LimitError> {
        if self.rules.is_empty() {
            return Err(error(
                "rules",
                "no rule (delete the key to lift the limits)",
            ));
        }
        if self.rules.len() > MAX_RULES_PER_KEY {
            return Err(error(
                "rules",
                format!(
                    "{} rules; at most {MAX_RULES_PER_KEY} per key",
                    self.rules.len()
                ),
            ));
        }
        let mut labels = Vec::with_capacity(self.rules.len());
        for (i, rule) in self.rules.iter().enumerate() {
            let at = |f: &str| format!("rules[{i}].{f}");
            if rule.calls == 0 || rule.calls > MAX_CALLS {
                return Err(error(
                    at("calls"),
                    format!("{} is not in 1..={MAX_CALLS}", rule.calls),
                ));
            }
            if rule.per_seconds == 0 || rule.per_seconds > MAX_PER_SECONDS {
                return Err(error(
                    at("per_seconds"),
                    format!("{} is not in 1..={MAX_PER_SECONDS}", rule.per_seconds),
                ));
            }
            if let Some(b) = rule.burst {
                if b == 0 || b > MAX_CALLS {
                    return Err(error(at("burst"), format!("{b} is not in 1..={MAX_CALLS}")));
                }
            }
            if let Some(name) = &rule.name {
                let fits = !name.is_empty()
                    && name.len() <= MAX_RULE_NAME_LEN
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if !fits {
                    return Err(error(
                        at("name"),
                        format!(
                            "{name:?}: 1 to {MAX_RULE_NAME_LEN} of letters, digits, '-' and '_'"
                        ),
                    ));
                }
            }
            let label = rule.label();
            if labels.contains(&label) {
                return Err(error(
                    at("name"),
                    format!("{label:?} names two rules of this key; give them distinct names"),
                ));
            }
            labels.push(label);
        }
        Ok(())
    }
}

fn deserialize<T: serde::de::DeserializeOwned>(value: &[u8], at: &str) -> Result<T, LimitError> {
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value)).map_err(
        |e| {
            let path = e.path().to_string();
            let field = match (at, path.as_str()) {
                (_, "." | "?") if at.is_empty() => "value".to_string(),
                (_, "." | "?") => at.to_string(),
                ("", p) => p.to_string(),
                (at, p) => format!("{at}.{p}"),
            };
            error(field, format!("not a limits value: {}", e.inner()))
        },
    )
}

/// A service's limits as the filter gets them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceLimits {
    /// `<prefix>limits/<service>`: every request of the service (each `tools/call`, each other
    /// JSON-RPC request; not notifications, answers or GET streams).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<LimitRule>,
    /// `<prefix>limits/<service>/<tool>`: that tool's calls.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<String, Vec<LimitRule>>,
}

/// Every limit in force, and the fleet's size they are split by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterLimits {
    #[serde(default)]
    pub services: BTreeMap<String, ServiceLimits>,
    /// How many gateways (Envoys) share each rule's budget; at least 1.
    #[serde(default = "one")]
    pub gateways: u32,
}

fn one() -> u32 {
    1
}

impl Default for FilterLimits {
    fn default() -> Self {
        FilterLimits {
            services: BTreeMap::new(),
            gateways: 1,
        }
    }
}

impl FilterLimits {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(v: &str) -> LimitError {
        Limits::parse(v.as_bytes()).expect_err(v)
    }

    #[test]
    fn a_value_with_rules_or_one_rule_is_read() {
        let l = Limits::parse(
            br#"{"rules": [{"per": "subject", "calls": 60, "per_seconds": 60, "burst": 10},
                            {"per": "gateway", "calls": 1000, "per_seconds": 3600, "name": "hourly"}]}"#,
        )
        .expect("valid");
        assert_eq!(l.rules.len(), 2);
        assert_eq!(l.rules[0].burst(), 10);
        assert_eq!(l.rules[0].label(), "subject-60-per-60s");
        assert_eq!(l.rules[1].burst(), 1000);
        assert_eq!(l.rules[1].label(), "hourly");
        let one =
            Limits::parse(br#"{"per": "client", "calls": 5, "per_seconds": 1}"#).expect("one rule");
        assert_eq!(one.rules[0].per, Per::Client);
    }

    #[test]
    fn every_refusal_names_its_field() {
        assert_eq!(refused("[1]").field, "value");
        assert_eq!(refused("{").field, "value");
        assert_eq!(refused(r#"{"rules": []}"#).field, "rules");
        assert_eq!(
            refused(r#"{"rules": [{"per": "everyone", "calls": 1, "per_seconds": 1}]}"#).field,
            "rules[0].per"
        );
        assert_eq!(
            refused(r#"{"per": "subject", "calls": 0, "per_seconds": 1}"#).field,
            "rules[0].calls"
        );
        assert_eq!(
            refused(
                r#"{"rules": [{"per": "subject", "calls": 1, "per_seconds": 1},
                                  {"per": "subject", "calls": 1, "per_seconds": 0}]}"#
            )
            .field,
            "rules[1].per_seconds"
        );
        assert_eq!(
            refused(r#"{"per": "subject", "calls": 1, "per_seconds": 1, "burst": 0}"#).field,
            "rules[0].burst"
        );
        assert_eq!(
            refused(r#"{"per": "subject", "calls": 1, "per_seconds": 1, "name": "a.b"}"#).field,
            "rules[0].name"
        );
        assert_eq!(
            refused(r#"{"per": "subject", "calls": 1, "per_seconds": 1, "extra": 1}"#).field,
            "rules[0].extra"
        );
        assert_eq!(
            refused(
                r#"{"rules": [{"per": "subject", "calls": 1, "per_seconds": 1},
                              {"per": "subject", "calls": 1, "per_seconds": 1}]}"#
            )
            .field,
            "rules[1].name"
        );
        let many = format!(
            r#"{{"rules": [{}]}}"#,
            (0..9)
                .map(|i| format!(
                    r#"{{"per": "subject", "calls": {}, "per_seconds": 1}}"#,
                    i + 1
                ))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(refused(&many).field, "rules");
        assert_eq!(
            refused(r#"{"per": "subject", "calls": 1, "per_seconds": 2592001}"#).field,
            "rules[0].per_seconds"
        );
    }

    #[test]
    fn the_filter_form_round_trips_and_defaults_to_one_gateway() {
        let f: FilterLimits = serde_json::from_str("{}").expect("empty");
        assert_eq!(f.gateways, 1);
        assert!(f.is_empty());
    }
}
