//! The last configuration this VM accepted.
//!
//! Envoy gives every new plugin configuration (each ECDS update) a fresh root context, and a
//! fresh root starts from nothing. Were a configuration the filter refuses to leave that root
//! with defaults, the defaults would mean no overrides, no auth, no catalog and no session
//! sealing: every call passing unjudged. So a refused configuration is never replaced by
//! defaults: the VM keeps the last configuration it accepted for its whole life, and a VM that
//! never accepted one refuses calls (see [`crate::call`]) instead of judging nothing.
//!
//! What to tell toolgate-xds follows from the same state: each refusal, and the first
//! acceptance after a refusal (so `/v1/envoys` shows the Envoy healthy again).

use toolgate_model::fleet::FilterConfigStatus;
use toolgate_model::policy::FilterConfig;

/// What a root context judges with after [`Keeper::take`].
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    /// The configuration it was sent.
    Applied(FilterConfig),
    /// The sent one was refused for `error`: the last one accepted stays.
    Kept { config: FilterConfig, error: String },
    /// The sent one was refused and none was ever accepted: calls are refused.
    Unconfigured { error: String },
}

/// The VM's memory of configurations: one per VM, shared by its root contexts.
#[derive(Debug, Default)]
pub struct Keeper {
    last_good: Option<FilterConfig>,
    /// The last configuration sent was refused (and no acceptance came since).
    refusing: bool,
}

impl Keeper {
    /// Parses and validates a sent configuration exactly as toolgate-xds checks it before
    /// sending (`FilterConfig::from_json`), and says what to judge with.
    pub fn take(&mut self, bytes: &[u8]) -> Taken {
        match FilterConfig::from_json(bytes) {
            Ok(config) => {
                self.last_good = Some(config.clone());
                Taken::Applied(config)
            }
            Err(e) => {
                let error = e.to_string();
                match &self.last_good {
                    Some(config) => Taken::Kept {
                        config: config.clone(),
                        error,
                    },
                    None => Taken::Unconfigured { error },
                }
            }
        }
    }

    /// The report toolgate-xds should get after `taken`, if any: every refusal, and an
    /// acceptance only when it ends refusals.
    pub fn status(&mut self, taken: &Taken, gateway: &str) -> Option<FilterConfigStatus> {
        match taken {
            Taken::Applied(_) if !self.refusing => None,
            Taken::Applied(_) => {
                self.refusing = false;
                Some(FilterConfigStatus {
                    gateway: gateway.to_string(),
                    accepted: true,
                    error: None,
                })
            }
            Taken::Kept { error, .. } | Taken::Unconfigured { error } => {
                self.refusing = true;
                Some(FilterConfigStatus {
                    gateway: gateway.to_string(),
                    accepted: false,
                    error: Some(error.clone()),
                })
            }
        }
    }

    /// The node id the last accepted configuration was served to (empty if none).
    pub fn gateway(&self) -> &str {
        self.last_good
            .as_ref()
            .map(|c| c.gateway.as_str())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &[u8] =
        br#"{"gateway":"envoy-1","overrides":{"orders":{"pay":{"mode":"force_open","reason":"x"}}}}"#;
    /// What the issue's reproduction produced: a tool's open time above the defaults' maximum.
    const REFUSED: &[u8] =
        br#"{"gateway":"envoy-1","services":{"orders":{"tools":{"pay":{"open_ms":400000}}}}}"#;

    #[test]
    fn a_refused_configuration_keeps_the_last_good_one() {
        let mut k = Keeper::default();
        let Taken::Applied(first) = k.take(GOOD) else {
            panic!("a valid configuration is applied")
        };
        assert_eq!(k.status(&Taken::Applied(first.clone()), "envoy-1"), None);
        let taken = k.take(REFUSED);
        let Taken::Kept { config, error } = &taken else {
            panic!("kept: {taken:?}")
        };
        assert_eq!(config, &first, "the override stays");
        assert!(error.contains("services.orders.tools.pay"), "{error}");
        let status = k.status(&taken, "envoy-1").expect("a refusal is reported");
        assert!(!status.accepted);
        // Not JSON at all, or a field this filter refuses (version skew): the same.
        assert!(matches!(k.take(b"not json"), Taken::Kept { .. }));
        assert!(matches!(
            k.take(br#"{"max_body_bytes":0}"#),
            Taken::Kept { .. }
        ));
        // The next good one ends the refusals, once.
        let again = k.take(GOOD);
        assert_eq!(k.status(&again, "envoy-1").map(|s| s.accepted), Some(true));
        assert_eq!(k.status(&again, "envoy-1"), None);
        assert_eq!(k.gateway(), "envoy-1");
    }

    #[test]
    fn with_nothing_accepted_calls_are_refused() {
        let mut k = Keeper::default();
        let taken = k.take(REFUSED);
        assert!(matches!(taken, Taken::Unconfigured { .. }), "{taken:?}");
        assert!(k.status(&taken, "").is_some());
        assert_eq!(k.gateway(), "");
    }
}
