//! The contracts shared by every toolgate program (see docs/design.md, "Contracts").
//!
//! Only serde and std: the wasm filter links this crate too.

pub mod auth;
pub mod availability;
pub mod backoff;
pub mod control_plane;
pub mod endpoint;
pub mod envoy;
pub mod fleet;
pub mod instance;
pub mod keys;
pub mod limits;
pub mod names;
pub mod policy;
pub mod session_loss;
pub mod session_owner;
pub mod upstream_auth;
pub mod virtual_server;

pub use backoff::Backoff;
pub use endpoint::{Endpoint, EndpointError};
pub use instance::{InstanceError, InstanceMetadata, ProbeKind, MAX_WEIGHT};
pub use keys::{KeyError, KeyLayout, ServiceKey, DEFAULT_PREFIX};
pub use names::{validate_name, NameError, MAX_NAME_LEN};
pub use policy::{
    BreakerPolicy, FilterConfig, PolicyError, PolicyOverrides, RequestLimits, ServicePolicy,
    MAX_BODY_BYTES_LIMIT, MAX_BUCKETS, MAX_HALF_OPEN_PROBES, MAX_JSON_DEPTH_LIMIT,
};
