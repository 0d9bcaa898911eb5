//! What operators and the fleet set on tools: breaker policies (`<prefix>policies/`), fleet
//! breaker openings (`<prefix>breakers/`) and operator overrides (`<prefix>overrides/`); their
//! keys are read by `policy_keys` and `fleet_keys`.

use super::*;

#[derive(Debug, Clone, Default)]
pub(super) struct Controls {
    /// Breaker policies from `<prefix>policies/<service>[/<tool>]`: those in effect (raw JSON
    /// kept for the state-dir snapshot), and etcd's word on keys where it would make them
    /// invalid (see `policies.rs`).
    pub(super) policies: PolicyStore,
    /// Breaker openings shared by the fleet, with their key's mod_revision (the compare of
    /// the next write) and lease.
    pub(super) fleet: BTreeMap<(String, String), FleetEntry>,
    pub(super) overrides: BTreeMap<(String, String), Override>,
}
