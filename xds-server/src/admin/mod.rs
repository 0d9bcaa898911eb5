//! The admin HTTP API: `/healthz`, `/metrics` (Prometheus text), `/v1/registry` (JSON), and
//! `/v1/feedback`, where the filters report call outcomes per instance.

use std::future::Future;
use std::sync::{Arc, RwLock};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::etcd::EtcdStatus;
use crate::health::feedback::{self, FeedbackBody};
use crate::health::{self, Hub};
use crate::metrics::Metrics;
use crate::registry::Registry;

#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub registry: Arc<RwLock<Registry>>,
    pub etcd: Arc<EtcdStatus>,
    pub hub: Hub,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/registry", get(registry))
        .route("/v1/feedback", post(report_calls))
        .with_state(state)
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Alive: the process serves. etcd being away is reported, not fatal: the gateway keeps
/// routing on the last known endpoints.
async fn healthz(State(s): State<AdminState>) -> impl IntoResponse {
    Json(json!({"status": "ok", "etcd_up": s.etcd.is_up()}))
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    health::export_gauges(
        &s.registry.read().unwrap_or_else(|p| p.into_inner()),
        &s.metrics,
    );
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn registry(State(s): State<AdminState>) -> impl IntoResponse {
    let view = s.registry.read().unwrap_or_else(|p| p.into_inner()).view();
    Json(json!({
        "etcd_up": s.etcd.is_up(),
        "revision": view.revision,
        "instances": view.instances,
        "services": view.services,
    }))
}

async fn report_calls(
    State(s): State<AdminState>,
    body: Result<Json<FeedbackBody>, JsonRejection>,
) -> impl IntoResponse {
    match body {
        Ok(Json(body)) => {
            let hub = s.hub.clone();
            // Lock-taking work off the async workers.
            match tokio::task::spawn_blocking(move || feedback::apply(&hub, body)).await {
                Ok(outcome) => (StatusCode::OK, Json(json!(outcome))),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Json(json!({"error": format!("applying the report failed: {e}")})),
                ),
            }
        }
        Err(rejection) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("not a feedback report: {}", rejection.body_text())})),
        ),
    }
}
