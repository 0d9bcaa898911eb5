//! Call limits from `<prefix>limits/<service>[/<tool>]` (see `toolgate_model::limits`): what
//! is in effect, and which keys etcd holds a value for that is not.
//!
//! Unlike a policy, a limits value is valid or not on its own (no key is laid over another),
//! so each key is admitted alone: a refused value leaves the key's last good value in effect
//! and is remembered only to be shown (`GET /v1/limits`), never tried again.

use super::*;
use toolgate_model::limits::{FilterLimits, Limits};

/// `(service, tool)`; no tool: every request of the service.
pub type LimitKey = (String, Option<String>);

/// The reason label of a refused limits key (the metric's, the log's, the admin API's).
pub const BAD_LIMITS: &str = "bad_limits";

#[derive(Debug, Clone, Default)]
pub(super) struct LimitStore {
    /// In effect, with the JSON as stored: the state-dir snapshot and the inspection compare
    /// the text etcd holds.
    applied: BTreeMap<LimitKey, (Limits, String)>,
    /// Keys whose value in etcd is refused now, with why: the operator sees that what they
    /// wrote is not what the filters enforce.
    refused: BTreeMap<String, String>,
}

impl LimitStore {
    /// Admits `limits` at `key`; whether what the filters get changed.
    fn insert(&mut self, raw_key: &str, key: LimitKey, limits: Limits, raw: String) -> bool {
        self.refused.remove(raw_key);
        match self.applied.insert(key, (limits.clone(), raw)) {
            Some((before, _)) => before != limits,
            None => true,
        }
    }

    /// etcd no longer holds `key`: whatever was in effect there leaves.
    fn remove(&mut self, raw_key: &str, key: Option<&LimitKey>) -> bool {
        self.refused.remove(raw_key);
        key.is_some_and(|k| self.applied.remove(k).is_some())
    }

    /// Puts back the value `key` had before a full read took the store (`old`). Whether
    /// there was one.
    fn restore(&mut self, key: &LimitKey, old: &mut LimitStore) -> bool {
        match old.applied.remove(key) {
            Some(v) => self.applied.insert(key.clone(), v).is_none(),
            None => false,
        }
    }

    /// The limits as the filters get them: a service's rules and each tool's.
    fn filter_limits(&self, gateways: u32) -> FilterLimits {
        let mut out = FilterLimits::default();
        if !self.applied.is_empty() {
            out.gateways = gateways.max(1);
        }
        for ((service, tool), (limits, _)) in &self.applied {
            let entry = out.services.entry(service.clone()).or_default();
            match tool {
                Some(t) => {
                    entry.tools.insert(t.clone(), limits.rules.clone());
                }
                None => entry.rules = limits.rules.clone(),
            }
        }
        out
    }
}

impl Registry {
    /// A limits key and value, parsed and validated whole; refused with the field at fault.
    pub(super) fn admit_limits(
        &self,
        key: &str,
        value: &[u8],
    ) -> Result<(LimitKey, Limits), Rejected> {
        let reject = |detail: String| Rejected {
            key: key.to_string(),
            reason: BAD_LIMITS,
            detail,
        };
        let k = self
            .layout
            .parse_limit_key(key)
            .map_err(|e| reject(e.to_string()))?;
        let limits = Limits::parse(value).map_err(|e| reject(e.to_string()))?;
        Ok((k, limits))
    }

    /// A PUT under `<prefix>limits/`: admitted whole or not at all (the last good value
    /// stays). `Ok(true)` when the filters' limits changed.
    pub(super) fn put_limits(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        match self.admit_limits(key, value) {
            Ok((k, limits)) => {
                let raw = String::from_utf8_lossy(value).into_owned();
                Ok(self.limits.insert(key, k, limits, raw))
            }
            Err(r) => {
                self.limits
                    .refused
                    .insert(key.to_string(), r.detail.clone());
                Err(r)
            }
        }
    }

    /// A DELETE under `<prefix>limits/`: the key's limits are lifted.
    pub(super) fn delete_limits(&mut self, key: &str) -> bool {
        let k = self.layout.parse_limit_key(key).ok();
        let removed = self.limits.remove(key, k.as_ref());
        if removed {
            tracing::debug!(key, "limits lifted");
        }
        removed
    }

    /// See [`LimitStore::restore`].
    pub(super) fn restore_limits(&mut self, key: &str, old: &mut LimitStore) -> bool {
        match self.layout.parse_limit_key(key) {
            Ok(k) => self.limits.restore(&k, old),
            Err(_) => false,
        }
    }

    /// The limits in force, for the filters' configuration. One gateway: each Envoy enforces
    /// the whole budget until the fleet's size is shared with the filters.
    pub(super) fn filter_limits(&self) -> FilterLimits {
        self.limits.filter_limits(self.gateways())
    }

    /// The fleet's Envoys: this process's and those the other toolgate-xds registered.
    pub fn gateways(&self) -> u32 {
        self.local_envoys
            .saturating_add(self.members.others_envoys())
            .max(1)
    }

    /// How many Envoys this process serves now; whether what the filters get changed (only
    /// while some limit splits by it).
    pub fn set_local_envoys(&mut self, n: u32) -> bool {
        let before = self.filter_limits();
        self.local_envoys = n;
        before != self.filter_limits()
    }

    /// The limits in effect, by (service, tool), in key order.
    pub fn stored_limits(&self) -> impl Iterator<Item = (&str, Option<&str>, &Limits)> {
        self.limits
            .applied
            .iter()
            .map(|((s, t), (l, _))| (s.as_str(), t.as_deref(), l))
    }

    /// The limits keys whose value in etcd is refused now, with why; in key order.
    pub fn refused_limits(&self) -> impl Iterator<Item = (&str, &str)> {
        self.limits
            .refused
            .iter()
            .map(|(k, why)| (k.as_str(), why.as_str()))
    }

    /// `(key, JSON)` of every limits value in effect, for the state-dir snapshot.
    pub(super) fn raw_limits(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.limits
            .applied
            .iter()
            .map(|((s, t), (_, raw))| (self.layout.limit_key(s, t.as_deref()), raw.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::reg;
    use toolgate_model::limits::Per;

    const SERVICE: &[u8] = br#"{"rules": [{"per": "subject", "calls": 60, "per_seconds": 60}]}"#;
    const TOOL: &[u8] = br#"{"per": "gateway", "calls": 5, "per_seconds": 1, "burst": 2}"#;
    const BAD: &[u8] = br#"{"per": "subject", "calls": 1, "per_seconds": 0}"#;

    #[test]
    fn limits_reach_the_filter_config_by_service_and_tool() {
        let mut r = reg();
        assert!(r.filter_config().limits.is_empty());
        assert_eq!(r.put("/mcp/limits/orders", SERVICE, 0, 2, 2), Ok(true));
        assert_eq!(r.put("/mcp/limits/orders/pay", TOOL, 0, 3, 3), Ok(true));
        let limits = r.filter_config().limits.clone();
        assert_eq!(limits.gateways, 1);
        let orders = &limits.services["orders"];
        assert_eq!(orders.rules.len(), 1);
        assert_eq!(orders.rules[0].per, Per::Subject);
        assert_eq!(orders.tools["pay"][0].per, Per::Gateway);
        assert_eq!(orders.tools["pay"][0].burst(), 2);
        // The filters get them in their JSON.
        let json: serde_json::Value = serde_json::from_str(&r.filter_made().json).expect("json");
        assert_eq!(
            json["limits"]["services"]["orders"]["tools"]["pay"][0]["calls"],
            5
        );
        // The same limits again (spelt otherwise) change nothing the filters get.
        let again = br#"{"rules":[{"per":"subject","calls":60,"per_seconds":60}]}"#;
        assert_eq!(r.put("/mcp/limits/orders", again, 0, 2, 4), Ok(false));
        // And they are in the state-dir snapshot, as stored.
        assert!(r
            .raw_values()
            .iter()
            .any(|(k, v)| k == "/mcp/limits/orders/pay" && v.as_bytes() == TOOL));
    }

    #[test]
    fn a_bad_value_is_refused_with_its_field_and_the_last_good_one_stays() {
        let mut r = reg();
        r.put("/mcp/limits/orders", SERVICE, 0, 2, 2)
            .expect("valid");
        let err = r.put("/mcp/limits/orders", BAD, 0, 2, 3).unwrap_err();
        assert_eq!(err.reason, "bad_limits");
        assert_eq!(err.key, "/mcp/limits/orders");
        assert_eq!(
            err.detail, "rules[0].per_seconds: 0 is not in 1..=2592000",
            "{err:?}"
        );
        assert_eq!(
            r.filter_config().limits.services["orders"].rules[0].calls,
            60,
            "the last good value stays"
        );
        assert_eq!(
            r.refused_limits().collect::<Vec<_>>(),
            [(
                "/mcp/limits/orders",
                "rules[0].per_seconds: 0 is not in 1..=2592000"
            )]
        );
        // A bad key is refused the same way.
        let err = r.put("/mcp/limits/or ders", SERVICE, 0, 4, 4).unwrap_err();
        assert_eq!(err.reason, "bad_limits");
        assert!(err.detail.contains("service name"), "{err:?}");
        // A good value again clears the refusal.
        assert_eq!(r.put("/mcp/limits/orders", TOOL, 0, 2, 5), Ok(true));
        assert_eq!(
            r.refused_limits().map(|(k, _)| k).collect::<Vec<_>>(),
            ["/mcp/limits/or ders"]
        );
    }

    #[test]
    fn a_delete_lifts_the_limits() {
        let mut r = reg();
        r.put("/mcp/limits/orders", SERVICE, 0, 2, 2)
            .expect("valid");
        r.put("/mcp/limits/orders/pay", TOOL, 0, 3, 3)
            .expect("valid");
        assert_eq!(r.delete("/mcp/limits/orders/pay"), Ok(true));
        assert!(r.filter_config().limits.services["orders"].tools.is_empty());
        assert_eq!(r.delete("/mcp/limits/orders"), Ok(true));
        assert!(r.filter_config().limits.is_empty());
        assert_eq!(r.delete("/mcp/limits/orders"), Ok(false), "nothing left");
        // A delete also forgets a refusal.
        assert!(r.put("/mcp/limits/billing", BAD, 0, 4, 4).is_err());
        assert_eq!(r.delete("/mcp/limits/billing"), Ok(false));
        assert_eq!(r.refused_limits().count(), 0);
    }

    #[test]
    fn a_full_read_keeps_the_last_good_value_of_a_key_now_invalid() {
        let mut r = reg();
        r.put("/mcp/limits/orders", SERVICE, 0, 2, 2)
            .expect("valid");
        r.put("/mcp/limits/orders/pay", TOOL, 0, 3, 3)
            .expect("valid");
        let read = r.reset(
            [
                ("/mcp/limits/billing", TOOL, 0, 5, 5),
                ("/mcp/limits/orders", BAD, 0, 2, 6),
                ("/mcp/limits/shipping", BAD, 0, 7, 7),
            ],
            7,
        );
        assert_eq!(read.kept, ["/mcp/limits/orders"]);
        let rejected: Vec<(&str, &str)> = read
            .rejected
            .iter()
            .map(|r| (r.key.as_str(), r.reason))
            .collect();
        assert_eq!(
            rejected,
            [
                ("/mcp/limits/orders", "bad_limits"),
                ("/mcp/limits/shipping", "bad_limits")
            ]
        );
        let limits = r.filter_config().limits.clone();
        assert_eq!(limits.services["orders"].rules[0].calls, 60, "kept");
        assert!(
            limits.services["orders"].tools.is_empty(),
            "gone from the read: lifted"
        );
        assert_eq!(limits.services["billing"].rules[0].calls, 5);
        assert!(!limits.services.contains_key("shipping"));
        assert_eq!(r.refused_limits().count(), 2);
        // The inspection's copy, read from the same etcd, agrees (a refused key is no
        // difference).
        let mut fresh = r.empty_like();
        fresh.reset(
            [
                ("/mcp/limits/billing", TOOL, 0, 5, 5),
                ("/mcp/limits/orders", SERVICE, 0, 2, 2),
            ],
            7,
        );
        assert_eq!(fresh.fingerprint(), r.fingerprint());
    }

    #[test]
    fn the_admin_check_refuses_a_bad_value_as_the_watch_would() {
        let r = reg();
        assert_eq!(r.check("/mcp/limits/orders", SERVICE), Ok(()));
        assert_eq!(r.check("/mcp/limits/orders/pay", TOOL), Ok(()));
        let err = r.check("/mcp/limits/orders", BAD).unwrap_err();
        assert_eq!(err.reason, "bad_limits");
        assert!(err.detail.starts_with("rules[0].per_seconds: "), "{err:?}");
        let err = r.check("/mcp/limits/orders", b"[1]").unwrap_err();
        assert_eq!(err.reason, "bad_limits");
        assert!(err.detail.starts_with("value: "), "{err:?}");
        assert!(
            r.filter_config().limits.is_empty(),
            "a check changes nothing"
        );
        assert_eq!(r.refused_limits().count(), 0);
    }
}
