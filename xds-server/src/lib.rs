//! toolgate-xds: turns etcd registrations into Envoy configuration.
//!
//! `etcd/` reads and watches the key prefix, `registry/` folds what it sees into a
//! [`routing::RoutingSnapshot`], `xds/` serves that snapshot to Envoys over ADS, `admin/`
//! exposes health, metrics and the registry over HTTP.

pub mod admin;
pub mod aggregate;
pub mod bootstrap;
pub mod catalog;
pub mod etcd;
pub mod failpoint;
pub mod fleet;
pub mod health;
pub mod idp;
pub mod jwks;
pub mod limited;
pub mod membership;
pub mod metrics;
pub mod registry;
pub mod routing;
pub mod service_ages;
pub mod session_key;
pub mod status;
pub mod token_exchange;
pub mod trace;
pub mod upstream;
pub mod upstream_credentials;
pub mod xds;
