//! Failpoints: faults that only tests switch on (the pattern of etcd's gofail). They exist
//! only in a build with the `failpoints` feature, which every test build has (through
//! toolgate-xds's dev-dependency on itself) and no shipped build does (`cargo build`, `make
//! build`, the Docker image): there each failpoint is a constant `false` and the variables
//! below mean nothing.
//!
//! toolgate's own validation keeps every real registration within what Envoy accepts, so these
//! are the only way to prove end to end that a rejected configuration is NACKed, counted, not
//! resent in a loop, and does not hold back the rest:
//!
//! - `TOOLGATE_FAILPOINT_NACK_SERVICE=<service>`: the cluster of that service is built with an
//!   invalid connect timeout, so Envoy rejects the CDS response that carries it.
//! - `TOOLGATE_FAILPOINT_NACK_INSTANCE=<id>[,<id>...]`: an endpoint of one of these instances
//!   is built with a load-balancing weight of 0, so Envoy rejects the EDS response that
//!   carries its assignment (all of it: Envoy validates every resource before applying any).
//!
//! - `TOOLGATE_FAILPOINT_SKEW_FILTER_CONFIG=<path>`: while the file at `path` holds a JSON
//!   object, its fields are merged into every per-Envoy filter configuration after it was
//!   checked, as a toolgate-xds newer than the filter would send a field the filter refuses.
//!   Read at each configuration built, so a test can switch it on and off.
//!
//! The first two are read once, at first use; tests that run the ADS server in process add instances
//! with [`arm_nack_instance`] instead.

/// Whether the cluster of `service` is to be built invalid.
#[cfg(feature = "failpoints")]
pub fn nack_service(service: &str) -> bool {
    use std::sync::OnceLock;
    static SERVICE: OnceLock<Option<String>> = OnceLock::new();
    SERVICE
        .get_or_init(|| std::env::var("TOOLGATE_FAILPOINT_NACK_SERVICE").ok())
        .as_deref()
        == Some(service)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn nack_service(_service: &str) -> bool {
    false
}

/// Whether an endpoint of `instance_id` is to be built invalid.
#[cfg(feature = "failpoints")]
pub fn nack_instance(instance_id: &str) -> bool {
    armed::instances()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(instance_id)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn nack_instance(_instance_id: &str) -> bool {
    false
}

/// Builds every endpoint of `instance_id` invalid from now on, as
/// `TOOLGATE_FAILPOINT_NACK_INSTANCE` does from the start. For tests that run the ADS server
/// in process: the set is global, so each test names instances of its own.
#[cfg(feature = "failpoints")]
pub fn arm_nack_instance(instance_id: &str) {
    armed::instances()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(instance_id.to_string());
}

/// `plugin_json` with the fields of the skew file merged in (see the module's notes), or as
/// it is when no skew file is there.
#[cfg(feature = "failpoints")]
pub fn skew_filter_config(plugin_json: String) -> String {
    let Ok(path) = std::env::var("TOOLGATE_FAILPOINT_SKEW_FILTER_CONFIG") else {
        return plugin_json;
    };
    let skew = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let Some(serde_json::Value::Object(skew)) = skew else {
        return plugin_json;
    };
    let Ok(serde_json::Value::Object(mut map)) = serde_json::from_str(&plugin_json) else {
        return plugin_json;
    };
    tracing::warn!(fields = ?skew.keys().collect::<Vec<_>>(), "failpoint: skewing a filter configuration");
    map.extend(skew);
    serde_json::Value::Object(map).to_string()
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn skew_filter_config(plugin_json: String) -> String {
    plugin_json
}

/// Whether this build has failpoints; toolgate-xds logs it at start, so a test that needs
/// them can tell a binary built without them from a failpoint that did not fire.
pub const COMPILED_IN: bool = cfg!(feature = "failpoints");

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::BTreeSet;
    use std::sync::{Mutex, OnceLock};

    pub(super) fn instances() -> &'static Mutex<BTreeSet<String>> {
        static INSTANCES: OnceLock<Mutex<BTreeSet<String>>> = OnceLock::new();
        INSTANCES.get_or_init(|| {
            let from_env = std::env::var("TOOLGATE_FAILPOINT_NACK_INSTANCE").unwrap_or_default();
            Mutex::new(
                from_env
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect(),
            )
        })
    }
}
