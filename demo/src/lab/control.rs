//! The lab's control API: `GET /control` shows identity, knobs and counts
//! (tool calls, `initialize`s, DELETEs, live MCP sessions), the headers `/mcp`
//! received and the last request line (`last_request`); `POST /control`
//! changes knobs; `POST /control/reset-counters` zeroes the counts (live
//! sessions are not a count and stay). Every answer is the full state after
//! the change.

use std::sync::Arc;

use axum::{
    body::Bytes,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde_json::{json, Value};

use super::state::LabState;

pub fn router(lab: Arc<LabState>) -> Router {
    Router::new()
        .route("/control", get(show).post(update))
        .route("/control/reset-counters", post(reset_counters))
        .with_state(lab)
}

async fn show(State(lab): State<Arc<LabState>>) -> Json<Value> {
    Json(lab.snapshot().await)
}

// Takes raw bytes rather than axum's Json extractor so that every refusal,
// including a missing content type or broken JSON, is a 400 in our words.
async fn update(State(lab): State<Arc<LabState>>, body: Bytes) -> Response {
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(patch) => patch,
        Err(error) => return bad_request(format!("control body is not JSON: {error}")),
    };
    match lab.update_knobs(&patch) {
        Ok(()) => {
            tracing::info!(change = %patch, "knobs changed");
            Json(lab.snapshot().await).into_response()
        }
        Err(error) => bad_request(error.to_string()),
    }
}

async fn reset_counters(State(lab): State<Arc<LabState>>) -> Json<Value> {
    lab.reset_counters();
    Json(lab.snapshot().await)
}

fn bad_request(message: String) -> Response {
    tracing::warn!(%message, "control request refused");
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}
