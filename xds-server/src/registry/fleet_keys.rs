//! Fleet-wide breaker openings and operator overrides, as etcd holds them.

use super::*;

/// An override as the admin API and the watch accept it.
pub fn parse_override(value: &[u8]) -> Result<Override, String> {
    let o: Override = serde_json::from_slice(value).map_err(|e| format!("not an override: {e}"))?;
    if o.reason.trim().is_empty() {
        return Err("reason: say why (it is shown to the agents)".into());
    }
    if o.reason.chars().count() > MAX_REASON_LEN {
        return Err(format!(
            "reason: {} characters, at most {MAX_REASON_LEN}",
            o.reason.chars().count()
        ));
    }
    Ok(o)
}

impl Registry {
    pub(super) fn put_fleet(
        &mut self,
        key: &str,
        value: &[u8],
        lease: i64,
        mod_revision: i64,
    ) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let names = self
            .layout
            .parse_tool_key(&self.layout.breakers_prefix(), key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let open: FleetOpen = serde_json::from_slice(value)
            .map_err(|e| reject("bad_breaker", format!("not a fleet breaker opening: {e}")))?;
        let changed = self
            .controls
            .fleet
            .get(&names)
            .is_none_or(|e| e.open != open);
        self.controls.fleet.insert(
            names,
            FleetEntry {
                open,
                mod_revision,
                lease,
            },
        );
        Ok(changed)
    }

    pub(super) fn put_override(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let names = self
            .layout
            .parse_tool_key(&self.layout.overrides_prefix(), key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let o = parse_override(value).map_err(|e| reject("bad_override", e))?;
        let changed = self.controls.overrides.get(&names) != Some(&o);
        self.controls.overrides.insert(names, o);
        Ok(changed)
    }

    pub fn fleet(&self) -> &BTreeMap<(String, String), FleetEntry> {
        &self.controls.fleet
    }

    pub fn overrides(&self) -> &BTreeMap<(String, String), Override> {
        &self.controls.overrides
    }
}
