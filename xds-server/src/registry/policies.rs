//! Breaker policies from `<prefix>policies/<service>[/<tool>]`: what is in effect, and what
//! etcd holds that cannot be.
//!
//! A tool's policy is laid over its service's, so one key's value decides whether another's
//! is valid: `orders/pay {"open_ms": 400000}` is valid only while `orders` raises
//! `max_open_ms` above it. A configuration with an invalid merged policy is one the filter
//! refuses as a whole, so no change may produce one: a value whose admission, or a delete
//! whose removal, would leave the policies invalid is refused and etcd's word on that key is
//! kept aside (the key's last good value stays in effect). Whatever is kept aside is tried
//! again, in key order until nothing more applies, whenever a policy changes: a delete held
//! back by a dependent takes effect once the dependent is gone, whichever order the operator
//! removes them in. A full read settles the same way from the values in effect, so a resync,
//! and the inspection (which folds its read into a copy of this store), reach what the watch
//! reached.

use std::collections::BTreeMap;

use toolgate_model::policy::{FilterConfig, PolicyError, PolicyOverrides, ServicePolicy};

/// `(service, tool)`; no tool: the service's policy.
pub type PolicyKey = (String, Option<String>);
/// A parsed policy and its JSON as stored.
pub type PolicyValue = (PolicyOverrides, String);

/// Why etcd's word on a key is not in effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The value would make the policies invalid (the filter's validation error).
    Invalid(String),
    /// Removing the key would leave these keys' merged policies invalid, with why.
    Dependents(Vec<(PolicyKey, String)>),
}

#[derive(Debug, Clone, Default)]
pub struct PolicyStore {
    /// In effect.
    applied: BTreeMap<PolicyKey, PolicyValue>,
    /// What etcd holds at keys where that is not in effect: a value (`Some`) or nothing
    /// (`None`: deleted while another policy depends on the value in effect).
    refused: BTreeMap<PolicyKey, Option<PolicyValue>>,
}

impl PolicyStore {
    /// The policies in effect.
    pub fn applied(&self) -> &BTreeMap<PolicyKey, PolicyValue> {
        &self.applied
    }

    /// etcd's word on the keys where it is not in effect.
    pub fn refused(&self) -> &BTreeMap<PolicyKey, Option<PolicyValue>> {
        &self.refused
    }

    /// etcd now holds `value` at `key`. The keys whose change took effect: this one, and any
    /// kept aside that fits now (empty: nothing changed); refused: the value stays aside.
    pub fn put(
        &mut self,
        key: PolicyKey,
        value: PolicyValue,
        base: &FilterConfig,
    ) -> Result<Vec<PolicyKey>, Refusal> {
        if self.applied.get(&key).is_some_and(|(o, _)| *o == value.0) {
            // The same policy again (perhaps spelt otherwise): nothing changes but the text.
            self.applied.insert(key.clone(), value);
            self.refused.remove(&key);
            return Ok(Vec::new());
        }
        self.refused.insert(key.clone(), Some(value));
        let applied = self.settle(base);
        if applied.contains(&key) {
            return Ok(applied);
        }
        debug_assert!(applied.is_empty(), "a refused put applies nothing else");
        Err(self.why_refused(&key, base))
    }

    /// etcd no longer holds `key`. The keys whose change took effect, as for [`put`];
    /// refused while another depends on it (its value stays in effect).
    ///
    /// [`put`]: Self::put
    pub fn delete(
        &mut self,
        key: &PolicyKey,
        base: &FilterConfig,
    ) -> Result<Vec<PolicyKey>, Refusal> {
        if !self.applied.contains_key(key) {
            self.refused.remove(key);
            return Ok(Vec::new());
        }
        self.refused.insert(key.clone(), None);
        let applied = self.settle(base);
        if applied.contains(key) {
            return Ok(applied);
        }
        debug_assert!(applied.is_empty(), "a refused delete applies nothing else");
        Err(self.why_refused(key, base))
    }

    /// etcd holds at `key` something that is no policy at all: nothing there can be applied
    /// (the value in effect, if any, stays as the key's last good value).
    pub fn forget_refused(&mut self, key: &PolicyKey) {
        self.refused.remove(key);
    }

    /// Whether `value` at `key` would be admitted now, without changing anything.
    pub fn check_put(
        &self,
        key: &PolicyKey,
        value: &PolicyOverrides,
        base: &FilterConfig,
    ) -> Result<(), Refusal> {
        let mut candidate = self.applied.clone();
        candidate.insert(key.clone(), (value.clone(), String::new()));
        validate(&candidate, base).map_err(|e| Refusal::Invalid(e.to_string()))
    }

    /// Whether deleting `key` would be admitted now, without changing anything.
    pub fn check_delete(&self, key: &PolicyKey, base: &FilterConfig) -> Result<(), Refusal> {
        let mut candidate = self.applied.clone();
        candidate.remove(key);
        match validate(&candidate, base) {
            Ok(()) => Ok(()),
            Err(_) => Err(Refusal::Dependents(invalid_entries(&candidate, base))),
        }
    }

    /// Takes a full read of the policies (every key etcd holds with a policy value) and
    /// `present`, the keys etcd holds with any value (a value that is no policy keeps the
    /// key's last good one). Settles from what is in effect, as the watch would have; returns
    /// what stays refused, with why, and whether what is in effect changed.
    pub fn reset(
        &mut self,
        read: BTreeMap<PolicyKey, PolicyValue>,
        present: &std::collections::BTreeSet<PolicyKey>,
        base: &FilterConfig,
    ) -> (Vec<(PolicyKey, Refusal)>, bool) {
        self.refused.clear();
        let before = self.applied.clone();
        for key in self.applied.keys() {
            if !present.contains(key) {
                self.refused.insert(key.clone(), None);
            }
        }
        for (key, value) in read {
            match self.applied.get_mut(&key) {
                Some(v) if v.0 == value.0 => *v = value,
                _ => {
                    self.refused.insert(key, Some(value));
                }
            }
        }
        self.settle(base);
        let refused: Vec<PolicyKey> = self.refused.keys().cloned().collect();
        let why = refused
            .into_iter()
            .map(|k| {
                let why = self.why_refused(&k, base);
                (k, why)
            })
            .collect();
        let changed = before.len() != self.applied.len()
            || before
                .iter()
                .zip(&self.applied)
                .any(|((k1, v1), (k2, v2))| k1 != k2 || v1.0 != v2.0);
        (why, changed)
    }

    /// Applies every refused change that now fits, in key order, again and again until none
    /// does (a service's policy comes before its tools', so a tool's new value that needs its
    /// service's new value gets it first). Returns the keys applied.
    fn settle(&mut self, base: &FilterConfig) -> Vec<PolicyKey> {
        let mut applied = Vec::new();
        loop {
            let mut progress = false;
            let keys: Vec<PolicyKey> = self.refused.keys().cloned().collect();
            for key in keys {
                let Some(want) = self.refused.get(&key).cloned() else {
                    continue;
                };
                let mut candidate = self.applied.clone();
                match &want {
                    Some(v) => {
                        candidate.insert(key.clone(), v.clone());
                    }
                    None => {
                        candidate.remove(&key);
                    }
                }
                if validate(&candidate, base).is_ok() {
                    self.applied = candidate;
                    self.refused.remove(&key);
                    applied.push(key);
                    progress = true;
                }
            }
            if !progress {
                return applied;
            }
        }
    }

    /// Why the refused change at `key` does not fit now.
    fn why_refused(&self, key: &PolicyKey, base: &FilterConfig) -> Refusal {
        let mut candidate = self.applied.clone();
        match self.refused.get(key) {
            Some(Some(v)) => {
                candidate.insert(key.clone(), v.clone());
                match validate(&candidate, base) {
                    Err(e) => Refusal::Invalid(e.to_string()),
                    Ok(()) => Refusal::Invalid("conflicts with another refused change".into()),
                }
            }
            _ => {
                candidate.remove(key);
                Refusal::Dependents(invalid_entries(&candidate, base))
            }
        }
    }
}

/// `base` (defaults and limits) with these policies, as the filter gets them.
pub fn with_policies(
    base: &FilterConfig,
    policies: &BTreeMap<PolicyKey, PolicyValue>,
) -> FilterConfig {
    let mut config = base.clone();
    add_policies(&mut config, policies);
    config
}

/// Lays `policies` into `config.services`.
pub fn add_policies(config: &mut FilterConfig, policies: &BTreeMap<PolicyKey, PolicyValue>) {
    for ((service, tool), (overrides, _)) in policies {
        let entry: &mut ServicePolicy = config.services.entry(service.clone()).or_default();
        match tool {
            Some(t) => {
                entry.tools.insert(t.clone(), overrides.clone());
            }
            None => entry.policy = Some(overrides.clone()),
        }
    }
}

/// The filter's own validation of the policies over `base`.
fn validate(
    policies: &BTreeMap<PolicyKey, PolicyValue>,
    base: &FilterConfig,
) -> Result<(), PolicyError> {
    with_policies(base, policies).validate()
}

/// Every key whose merged policy is invalid over `base`, with the validation error.
fn invalid_entries(
    policies: &BTreeMap<PolicyKey, PolicyValue>,
    base: &FilterConfig,
) -> Vec<(PolicyKey, String)> {
    let config = with_policies(base, policies);
    let mut out = Vec::new();
    for (service, svc) in &config.services {
        let mut service_policy = config.defaults.clone();
        if let Some(o) = &svc.policy {
            o.apply_to(&mut service_policy);
        }
        if let Err(e) = service_policy.validate() {
            out.push(((service.clone(), None), e.to_string()));
            continue;
        }
        for (tool, o) in &svc.tools {
            let mut tool_policy = service_policy.clone();
            o.apply_to(&mut tool_policy);
            if let Err(e) = tool_policy.validate() {
                out.push(((service.clone(), Some(tool.clone())), e.to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(service: &str, tool: Option<&str>) -> PolicyKey {
        (service.to_string(), tool.map(str::to_string))
    }

    fn value(json: &str) -> PolicyValue {
        (serde_json::from_str(json).unwrap(), json.to_string())
    }

    fn base() -> FilterConfig {
        FilterConfig::default()
    }

    /// `orders` raises the ceiling; `orders/pay` needs it.
    fn dependent() -> PolicyStore {
        let mut s = PolicyStore::default();
        let orders = value(r#"{"max_open_ms":600000}"#);
        assert_eq!(
            s.put(key("orders", None), orders, &base()),
            Ok(vec![key("orders", None)])
        );
        let pay = value(r#"{"open_ms":400000}"#);
        assert_eq!(
            s.put(key("orders", Some("pay")), pay, &base()),
            Ok(vec![key("orders", Some("pay"))])
        );
        s
    }

    #[test]
    fn a_delete_that_would_break_a_dependent_is_held_until_the_dependent_goes() {
        let mut s = dependent();
        let err = s.check_delete(&key("orders", None), &base()).unwrap_err();
        let Refusal::Dependents(deps) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(deps.len(), 1);
        assert_eq!(deps[0].0, key("orders", Some("pay")));
        assert!(deps[0].1.contains("max_open_ms"), "{deps:?}");

        assert_eq!(s.delete(&key("orders", None), &base()), Err(err));
        assert!(s.applied().contains_key(&key("orders", None)), "kept");
        assert_eq!(s.refused()[&key("orders", None)], None);
        // The dependent leaves: the held delete takes effect with it.
        assert_eq!(
            s.delete(&key("orders", Some("pay")), &base()),
            Ok(vec![key("orders", Some("pay")), key("orders", None)])
        );
        assert!(s.applied().is_empty(), "{:?}", s.applied());
        assert!(s.refused().is_empty());
    }

    #[test]
    fn a_held_delete_takes_effect_when_the_dependent_changes_to_fit() {
        let mut s = dependent();
        assert!(s.delete(&key("orders", None), &base()).is_err());
        let pay = value(r#"{"open_ms":20000}"#);
        assert_eq!(
            s.put(key("orders", Some("pay")), pay, &base()),
            Ok(vec![key("orders", Some("pay")), key("orders", None)])
        );
        assert_eq!(
            s.applied().keys().collect::<Vec<_>>(),
            [&key("orders", Some("pay"))]
        );
        // Put back in etcd, the service's policy is admitted again.
        let orders = value(r#"{"max_open_ms":500000}"#);
        assert_eq!(
            s.put(key("orders", None), orders, &base()),
            Ok(vec![key("orders", None)])
        );
        // The same policy spelt otherwise changes nothing.
        let again = value(r#"{ "max_open_ms": 500000 }"#);
        assert_eq!(s.put(key("orders", None), again, &base()), Ok(vec![]));
    }

    #[test]
    fn a_put_that_would_break_a_dependent_waits_aside_until_it_fits() {
        let mut s = dependent();
        let lower = value(r#"{"max_open_ms":300000}"#);
        let err = s.put(key("orders", None), lower, &base()).unwrap_err();
        assert!(
            matches!(&err, Refusal::Invalid(e) if e.contains("max_open_ms")),
            "{err:?}"
        );
        assert_eq!(
            s.applied()[&key("orders", None)].1,
            r#"{"max_open_ms":600000}"#
        );
        // The dependent goes: the value etcd holds is applied.
        assert_eq!(
            s.delete(&key("orders", Some("pay")), &base()),
            Ok(vec![key("orders", Some("pay")), key("orders", None)])
        );
        assert_eq!(
            s.applied()[&key("orders", None)].1,
            r#"{"max_open_ms":300000}"#
        );
        assert!(s.refused().is_empty());
        // A value invalid on its own is refused, and stays aside harmlessly.
        let bad = value(r#"{"failure_rate_percent":0}"#);
        assert!(s.put(key("x", None), bad, &base()).is_err());
        assert!(!s.applied().contains_key(&key("x", None)));
        s.forget_refused(&key("x", None));
        assert!(s.refused().is_empty());
    }

    #[test]
    fn a_full_read_settles_as_the_watch_would() {
        // The read lacks the service's policy: it stays, held, as a watched delete would.
        let mut s = dependent();
        let read = BTreeMap::from([(key("orders", Some("pay")), value(r#"{"open_ms":400000}"#))]);
        let present = read.keys().cloned().collect();
        let (refused, changed) = s.reset(read.clone(), &present, &base());
        assert!(!changed);
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].0, key("orders", None));
        assert!(matches!(refused[0].1, Refusal::Dependents(_)));

        // Read into a store with nothing in effect (a cold start), the dependent alone is
        // refused: the configuration stays valid.
        let mut cold = PolicyStore::default();
        let (refused, changed) = cold.reset(read, &present, &base());
        assert!(!changed);
        assert_eq!(refused[0].0, key("orders", Some("pay")));
        assert!(cold.applied().is_empty());

        // Changes missed while the watch was down that only fit together (a lower ceiling
        // and a shorter open time) are both applied, whatever order they sort in.
        let mut s = dependent();
        let read = BTreeMap::from([
            (key("orders", None), value(r#"{"max_open_ms":300000}"#)),
            (key("orders", Some("pay")), value(r#"{"open_ms":20000}"#)),
        ]);
        let present = read.keys().cloned().collect();
        let (refused, changed) = s.reset(read, &present, &base());
        assert!(refused.is_empty(), "{refused:?}");
        assert!(changed);
        assert_eq!(
            s.applied()[&key("orders", None)].1,
            r#"{"max_open_ms":300000}"#
        );
    }
}
