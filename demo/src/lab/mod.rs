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

/// `/mcp` behind the fault layer, `/control`, and (when `health_route`) a
/// `/health` that follows the `health_fail` knob. Without it `/health` is a
/// 404, as on most MCP servers in the wild, which only MCP itself can probe.
pub fn app(lab: Arc<LabState>, health_route: bool) -> Router {
    let tools_lab = lab.clone();
    let (mcp, sessions) = mcp::router_with_sessions(
        move || EchoTools::new(tools_lab.clone()),
        lab.transport,
        &lab.shutdown,
    );
    if let Some(sessions) = sessions {
        lab.attach_sessions(sessions);
    }
    let mcp = mcp.layer(middleware::from_fn_with_state(lab.clone(), faults::inject));
    let routes = mcp.merge(control::router(lab.clone()));
    if !health_route {
        return routes;
    }
    let health_lab = lab;
    http::router(routes, Arc::new(move || !health_lab.health_fail()))
}
