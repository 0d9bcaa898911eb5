//! Failpoints: faults that only tests switch on, through environment variables read once at
//! start (the pattern of etcd's gofail). Nothing in normal operation sets them.
//!
//! `TOOLGATE_FAILPOINT_NACK_SERVICE=<service>`: the cluster of that service is built with an
//! invalid connect timeout, so Envoy rejects it. toolgate's own validation keeps every real
//! registration within what Envoy accepts, so this is the only way to prove end to end that a
//! rejected configuration is NACKed once, counted, and not resent in a loop.

use std::sync::OnceLock;

pub fn nack_service() -> Option<&'static str> {
    static SERVICE: OnceLock<Option<String>> = OnceLock::new();
    SERVICE
        .get_or_init(|| std::env::var("TOOLGATE_FAILPOINT_NACK_SERVICE").ok())
        .as_deref()
}
