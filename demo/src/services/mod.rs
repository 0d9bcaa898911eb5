//! The sample services of `toolgate-demo`: small, plausible tools whose every
//! result names the instance that answered.

pub mod code;
pub mod finance;
pub mod inventory;

use std::{fmt, sync::Arc};

use axum::Router;
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::mcp::{self, TransportOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Service {
    /// query_inventory_db, query_cached_inventory
    Inventory,
    /// tax_calc
    Finance,
    /// ast_parse
    Code,
}

impl Service {
    pub fn name(self) -> &'static str {
        match self {
            Service::Inventory => "inventory",
            Service::Finance => "finance",
            Service::Code => "code",
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `/mcp` for `service`.
pub fn router(
    service: Service,
    instance_id: Arc<str>,
    options: TransportOptions,
    shutdown: &CancellationToken,
) -> Router {
    match service {
        Service::Inventory => mcp::router(
            move || inventory::Inventory::new(instance_id.clone()),
            options,
            shutdown,
        ),
        Service::Finance => mcp::router(
            move || finance::Finance::new(instance_id.clone()),
            options,
            shutdown,
        ),
        Service::Code => mcp::router(
            move || code::Code::new(instance_id.clone()),
            options,
            shutdown,
        ),
    }
}

/// A result for people (`text`) and for programs (`structured`, which always
/// carries `instance_id`).
fn answer(text: String, structured: Value) -> CallToolResult {
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(structured);
    result
}

/// The tool ran but could not do what was asked: an `isError` result the
/// model can read, not a protocol error.
fn refuse(text: String, structured: Value) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(text)]);
    result.structured_content = Some(structured);
    result
}
