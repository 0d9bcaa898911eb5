// Every end-to-end test in one binary; each file beside this one is a module of it
// (`cargo test --release -p toolgate-tests --test gateway -- abuse::` runs one file's tests).
// Linked once instead of once per file: after a change to the harness (src/), building the
// tests took 7 min 20 s as 36 binaries and 3 min 12 s as one, on two cores; and libtest's two
// threads stay busy across files instead of idling at the end of each.
mod abuse;
mod access_log;
mod aggregate;
mod aggregate_calls;
mod aggregate_mrtr;
mod aggregate_questions;
mod aggregate_sdk;
mod aggregate_surface;
mod auth;
mod auth_surface;
mod breaker;
mod call_limits;
mod cluster;
mod conformance;
mod console;
mod deploy;
mod discovery;
mod docs;
mod edge;
mod envoy_drain;
mod fail_closed;
mod fail_closed_config;
mod fail_closed_sessions;
mod fleet;
mod fleet_control;
mod health;
mod limits;
mod mcp_probe;
mod no_instance;
mod reference_servers;
mod register_join;
mod registrar;
mod security;
mod service_listing;
mod session_rescue;
mod stdio_bridge;
mod token_exchange;
mod tracing;
mod typescript_sdk;
mod upstream;
mod upstream_credentials;
mod upstream_sessions;
mod virtual_servers;
