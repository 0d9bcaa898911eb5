//! Policies (`<prefix>policies/...`): parsed, layered into the filter's configuration and
//! the bulkheads, and a delete refused while another policy depends on its value.

use super::*;

impl Registry {
    /// Whether deleting the policy at `key` would be admitted, without changing anything: the
    /// admin API refuses a delete that would leave another policy invalid, naming it.
    pub fn check_policy_delete(&self, key: &str) -> Result<(), Rejected> {
        let Ok(k) = self.layout.parse_policy_key(key) else {
            return Ok(());
        };
        self.controls
            .policies
            .check_delete(&k, &self.policy_base())
            .map_err(|why| self.policy_rejected(&k, why))
    }

    /// A policy override: parsed, merged over the defaults and the other policies and
    /// validated before it is admitted, so a bad value never reaches a filter.
    pub(super) fn put_policy(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let (k, value) = match self.parse_policy(key, value) {
            Ok(parsed) => parsed,
            Err((k, r)) => {
                if let Some(k) = k {
                    self.controls.policies.forget_refused(&k);
                }
                return Err(r);
            }
        };
        let base = self.policy_base();
        let applied = self
            .controls
            .policies
            .put(k.clone(), value, &base)
            .map_err(|why| self.policy_rejected(&k, why))?;
        Ok(self.policies_applied(&k, applied))
    }

    /// Marks every route stale when policies changed (a policy sets its service's bulkhead
    /// and timeout; rare enough to rebuild all), and logs the changes held back before that
    /// took effect with `key`'s. Whether anything changed.
    pub(super) fn policies_applied(&mut self, key: &PolicyKey, applied: Vec<PolicyKey>) -> bool {
        for other in applied.iter().filter(|k| *k != key) {
            tracing::info!(key = %self.policy_key(other), after = %self.policy_key(key),
                "a policy change held back (it would have left another policy invalid) took effect");
        }
        if applied.is_empty() {
            return false;
        }
        self.routes.all_stale = true;
        true
    }

    /// A deleted policy leaves, unless another policy depends on it: then its value stays in
    /// effect (refused like an invalid value) until that changes.
    pub(super) fn delete_policy(&mut self, key: &str, k: PolicyKey) -> Result<bool, Rejected> {
        let base = self.policy_base();
        let applied = self
            .controls
            .policies
            .delete(&k, &base)
            .map_err(|why| self.policy_rejected(&k, why))?;
        if !applied.is_empty() {
            tracing::debug!(key, "policy removed");
        }
        Ok(self.policies_applied(&k, applied))
    }

    /// A policy key and value, parsed; on error the key (when it is one) and why.
    #[allow(clippy::result_large_err)]
    pub(super) fn parse_policy(
        &self,
        key: &str,
        value: &[u8],
    ) -> Result<(PolicyKey, policies::PolicyValue), (Option<PolicyKey>, Rejected)> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let k = self
            .layout
            .parse_policy_key(key)
            .map_err(|e| (None, reject("bad_key", e.to_string())))?;
        let overrides: PolicyOverrides =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value))
                .map_err(|e| {
                    (
                        Some(k.clone()),
                        reject("bad_policy", format!("not policy JSON: {e}")),
                    )
                })?;
        let raw = String::from_utf8_lossy(value).into_owned();
        Ok((k, (overrides, raw)))
    }

    /// What every policy is laid over: the defaults and the request limits, as the filters get
    /// them.
    pub(super) fn policy_base(&self) -> FilterConfig {
        FilterConfig {
            max_body_bytes: self.request_limits.max_body_bytes,
            max_json_depth: self.request_limits.max_json_depth,
            ..FilterConfig::default()
        }
    }

    /// The policy key as stored in etcd.
    pub(super) fn policy_key(&self, (service, tool): &PolicyKey) -> String {
        match tool {
            Some(t) => format!("{}{service}/{t}", self.layout.policies_prefix()),
            None => format!("{}{service}", self.layout.policies_prefix()),
        }
    }

    /// A refused policy change as the watch logs it and the admin API answers it.
    pub(super) fn policy_rejected(&self, k: &PolicyKey, why: Refusal) -> Rejected {
        let key = self.policy_key(k);
        match why {
            Refusal::Invalid(detail) => Rejected {
                key,
                reason: "bad_policy",
                detail,
            },
            Refusal::Dependents(dependents) => {
                let named: Vec<String> = dependents
                    .iter()
                    .map(|(d, e)| format!("{} ({e})", self.policy_key(d)))
                    .collect();
                Rejected {
                    key,
                    reason: DELETE_BREAKS_DEPENDENT,
                    detail: format!(
                        "deleting it would leave {} invalid; its value stays in effect until \
                         the dependent policy is changed or deleted",
                        named.join(", ")
                    ),
                }
            }
        }
    }
}
