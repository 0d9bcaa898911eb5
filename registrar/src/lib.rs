//! How an MCP server instance joins and leaves toolgate.
//!
//! An instance grants an etcd lease, puts `<prefix>services/<service>/<instance_id>` with its
//! [`InstanceMetadata`] bound to that lease, keeps the lease alive over one stream and revokes it
//! on shutdown, so the key disappears at once on a graceful stop and within the TTL on a crash.
//!
//! ```no_run
//! # async fn run() -> Result<(), toolgate_registrar::RegisterError> {
//! use toolgate_registrar::Registrar;
//! let registration = Registrar::new(["http://127.0.0.1:2379"], "inventory", "127.0.0.1:9000".parse()?)
//!     .tools(["query_inventory_db"])
//!     .register()
//!     .await?;
//! // ... serve MCP until asked to stop ...
//! registration.deregister().await?;
//! # Ok(()) }
//! ```

mod config;
mod error;
mod keepalive;
pub mod liveness;
pub mod probe_kind;
pub mod ready;
pub mod restart;
pub mod stdio;
pub mod tools;

pub use config::{Registrar, MIN_TTL_SECS};
pub use error::RegisterError;
pub use keepalive::{Registration, RegistrationEvent, ToolsUpdater};
pub use toolgate_model::{Endpoint, InstanceMetadata, KeyLayout};
