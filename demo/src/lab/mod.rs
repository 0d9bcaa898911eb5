//! `toolgate-lab`: an MCP server whose latency and failures tests set at run
//! time, and which counts every `tools/call` it receives so a test can prove
//! whether a call reached it.

pub mod control;
pub mod faults;
pub mod jsonrpc;
pub mod knobs;
pub mod state;
pub mod tools;

use std::sync::Arc;

use axum::{middleware, Router};

use self::{state::LabState, tools::EchoTools};
use crate::{http, mcp};

/// `/mcp` behind the fault layer, `/control`, and `/health` that follows the
/// `health_fail` knob.
pub fn app(lab: Arc<LabState>) -> Router {
    let tools_lab = lab.clone();
    let mcp = mcp::router(
        move || EchoTools::new(tools_lab.clone()),
        lab.transport,
        &lab.shutdown,
    )
    .layer(middleware::from_fn_with_state(lab.clone(), faults::inject));
    let health_lab = lab.clone();
    http::router(
        mcp.merge(control::router(lab)),
        Arc::new(move || !health_lab.health_fail()),
    )
}
