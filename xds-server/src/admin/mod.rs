//! The admin HTTP API: `/healthz`, `/metrics` (Prometheus text), `/v1/registry` (JSON), and
//! `/v1/feedback`, where the filters report call outcomes per instance, `/v1/breaker-events`,
//! where they report their breaker transitions, `/v1/filter-config-status`, where they report
//! a configuration they refused (shown per Envoy in `/v1/envoys`), and the operator's `/v1/breakers`,
//! `/v1/overrides`, `/v1/policies`, `/v1/limits`, `/v1/virtual` and `/v1/auth` (changes need
//! the bearer token), the aggregate MCP endpoint `/v1/aggregate/{name}` (agent traffic, see
//! `crate::aggregate`), `/v1/upstream-sessions`, where the filters ask for sessions held
//! for their clients, and `/v1/token-exchange`, where they ask for a caller's token exchanged
//! for one meant for a service's servers.

pub mod auth;
mod auth_config;
mod console;
mod limits;
mod token_exchange;
mod upstream;
mod virtual_servers;

use std::future::Future;
use std::sync::{Arc, RwLock};

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::json;

use crate::aggregate::http::AggregateState;
use crate::etcd::EtcdStatus;
use crate::fleet::{now_ms, AdminError, FleetWriter};
use crate::health::feedback::{self, FeedbackBody};
use crate::health::{self, Hub};
use crate::metrics::Metrics;
use crate::registry::Registry;
use auth::{AdminToken, ReportToken};
use toolgate_model::fleet::{
    BreakerEvents, FilterConfigStatus, Override, FILTER_CONFIG_STATUS_PATH,
};

#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub registry: Arc<RwLock<Registry>>,
    pub etcd: Arc<EtcdStatus>,
    pub hub: Hub,
    pub fleet: FleetWriter,
    pub token: AdminToken,
    /// The Envoys connected over ADS, for `/v1/envoys`.
    pub envoys: Arc<crate::xds::Connections>,
    /// Reads (`/metrics`, `GET /v1/...`) need the token too.
    pub protect_reads: bool,
    /// What the filters' reports must carry.
    pub reports: ReportToken,
    /// Each service's tool definitions, for `/v1/catalog`.
    pub catalog: Arc<crate::catalog::Catalog>,
    /// Sessions opened with servers on clients' behalf (`/v1/upstream-sessions`).
    pub upstream: Arc<crate::upstream::UpstreamSessions>,
    /// The aggregate MCP endpoint, `/v1/aggregate/{name}`.
    pub aggregate: Arc<crate::aggregate::Aggregate>,
    /// Callers' tokens exchanged for the filters (`/v1/token-exchange`).
    pub exchanger: crate::token_exchange::Exchanger,
    /// Who call limits refused most, from the filters' reports (`GET /v1/limits`).
    pub limited: Arc<crate::limited::Limited>,
}

/// The aggregate endpoint's handlers are routed here but take only their part of the state
/// (axum's `State` extracts it with this), so they need nothing of the admin API.
impl FromRef<AdminState> for AggregateState {
    fn from_ref(s: &AdminState) -> AggregateState {
        AggregateState {
            aggregate: Arc::clone(&s.aggregate),
            upstream: Arc::clone(&s.upstream),
        }
    }
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/registry", get(registry))
        .route("/v1/catalog", get(catalog))
        .route("/v1/envoys", get(envoys))
        .route("/v1/feedback", post(report_calls))
        .route("/v1/breaker-events", post(breaker_events))
        .route(FILTER_CONFIG_STATUS_PATH, post(filter_config_status))
        .route("/v1/breakers", get(breakers))
        .route("/v1/overrides", get(overrides))
        .route(
            "/v1/overrides/{service}/{tool}",
            put(put_override).delete(delete_override),
        )
        .route(
            "/v1/aggregate/{name}",
            post(crate::aggregate::http::post)
                .get(crate::aggregate::http::get)
                .delete(crate::aggregate::http::delete),
        )
        .route("/v1/virtual", get(virtual_servers::list))
        .route(
            "/v1/virtual/{name}",
            put(virtual_servers::put).delete(virtual_servers::delete),
        )
        .route("/v1/auth", get(auth_config::get))
        .route(
            "/v1/auth/config",
            put(auth_config::put_config).delete(auth_config::delete_config),
        )
        .route(
            "/v1/auth/rules/{service}",
            put(auth_config::put_service_rules).delete(auth_config::delete_service_rules),
        )
        .route(
            "/v1/auth/virtual/{name}",
            put(auth_config::put_virtual_rules).delete(auth_config::delete_virtual_rules),
        )
        .route(
            "/v1/auth/upstream/{service}",
            get(auth_config::get_upstream)
                .put(auth_config::put_upstream)
                .delete(auth_config::delete_upstream),
        )
        .route("/v1/policies", get(policies))
        .route(
            "/v1/policies/{service}",
            put(put_service_policy).delete(delete_service_policy),
        )
        .route(
            "/v1/policies/{service}/{tool}",
            put(put_tool_policy).delete(delete_tool_policy),
        )
        .route("/v1/limits", get(limits::list))
        .route(
            "/v1/limits/{service}",
            put(limits::put_service).delete(limits::delete_service),
        )
        .route(
            "/v1/limits/{service}/{tool}",
            put(limits::put_tool).delete(limits::delete_tool),
        )
        .merge(console::routes())
        .merge(upstream::routes())
        .merge(token_exchange::routes())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            guard_reads,
        ))
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

/// With `--protect-reads`, what the admin API tells (registry, breakers, overrides, policies,
/// Envoys, metrics) needs the admin token like a change does. `/healthz` stays open for
/// liveness probes and `/ui/` for the page itself, which then asks for the token. The
/// filters' reports (`POST /v1/feedback`, `/v1/breaker-events`) are not reads. Nor is the
/// aggregate MCP endpoint (`/v1/aggregate/`): it is agent traffic, which reaches it through
/// Envoy and never holds the admin token.
async fn guard_reads(
    State(s): State<AdminState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let read = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    let path = request.uri().path();
    let agent = path.starts_with("/v1/aggregate/");
    if s.protect_reads && read && !agent && (path == "/metrics" || path.starts_with("/v1/")) {
        if let Err(e) = s.token.check_read(request.headers()) {
            return e.into_response();
        }
    }
    next.run(request).await
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
    s.metrics
        .filter_config_rejecting_envoys
        .set(s.envoys.rejecting_envoys());
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

/// `GET /v1/registry`: every instance with its health. Serialized straight from the view: a
/// `json!` tree of 100,000 instances took 350 MB on its way out, which the allocator then
/// kept as the process's RSS.
async fn registry(State(s): State<AdminState>) -> impl IntoResponse {
    #[derive(serde::Serialize)]
    struct Body {
        etcd_up: bool,
        #[serde(flatten)]
        view: crate::registry::RegistryView,
    }
    let view = s.registry.read().unwrap_or_else(|p| p.into_inner()).view();
    Json(Body {
        etcd_up: s.etcd.is_up(),
        view,
    })
}

async fn catalog(State(s): State<AdminState>) -> impl IntoResponse {
    Json(json!({"services": s.catalog.view()}))
}

async fn envoys(State(s): State<AdminState>) -> impl IntoResponse {
    Json(json!({"envoys": s.envoys.list()}))
}

async fn report_calls(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Json<FeedbackBody>, JsonRejection>,
) -> axum::response::Response {
    if let Err(e) = s.reports.check(&headers) {
        return e.into_response();
    }
    match body {
        Ok(Json(body)) => {
            s.limited.record(&body.limited, std::time::Instant::now());
            let hub = s.hub.clone();
            // Lock-taking work off the async workers.
            match tokio::task::spawn_blocking(move || feedback::apply(&hub, body)).await {
                Ok(outcome) => (StatusCode::OK, Json(json!(outcome))).into_response(),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Json(json!({"error": format!("applying the report failed: {e}")})),
                )
                    .into_response(),
            }
        }
        Err(rejection) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("not a feedback report: {}", rejection.body_text())})),
        )
            .into_response(),
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> axum::response::Response {
        (self.status, Json(json!({"error": self.message}))).into_response()
    }
}

async fn breaker_events(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Json<BreakerEvents>, JsonRejection>,
) -> axum::response::Response {
    if let Err(e) = s.reports.check(&headers) {
        return e.into_response();
    }
    match body {
        Ok(Json(body)) => {
            Json(json!({"events": s.fleet.breaker_events(body).await})).into_response()
        }
        Err(rejection) => AdminError::bad_request(format!(
            "not a breaker event report: {}",
            rejection.body_text()
        ))
        .into_response(),
    }
}

/// A filter's word on the configuration it was sent (one report per worker VM): refused, or
/// accepted again after a refusal.
async fn filter_config_status(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Result<Json<FilterConfigStatus>, JsonRejection>,
) -> axum::response::Response {
    if let Err(e) = s.reports.check(&headers) {
        return e.into_response();
    }
    let report = match body {
        Ok(Json(report)) => report,
        Err(rejection) => {
            return AdminError::bad_request(format!(
                "not a filter configuration status: {}",
                rejection.body_text()
            ))
            .into_response()
        }
    };
    if !report.accepted {
        s.metrics.filter_config_rejected.inc();
    }
    let kept = s.envoys.filter_config_report(&report);
    s.metrics
        .filter_config_rejecting_envoys
        .set(s.envoys.rejecting_envoys());
    match kept {
        Ok(changed) => {
            if changed && !report.accepted {
                tracing::error!(gateway = %report.gateway,
                    error = report.error.as_deref().unwrap_or_default(),
                    "an Envoy's filter refused its configuration; it keeps judging with the last \
                     one it accepted (or refuses calls, having none)");
            } else if changed {
                tracing::info!(gateway = %report.gateway,
                    "an Envoy's filter accepted its configuration again");
            }
            Json(json!({"gateway": report.gateway, "stored": true})).into_response()
        }
        Err(crate::xds::connections::NotKept::Invalid(why)) => {
            AdminError::bad_request(why).into_response()
        }
        Err(crate::xds::connections::NotKept::Full) => AdminError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "the states of {} gateways are kept already; this one is not",
                crate::xds::connections::MAX_REPORTED
            ),
        }
        .into_response(),
    }
}

/// Breaker openings shared by the fleet, with the time left.
async fn breakers(State(s): State<AdminState>) -> impl IntoResponse {
    let now = now_ms();
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    let list: Vec<_> = reg
        .fleet()
        .iter()
        .map(|((service, tool), e)| {
            json!({
                "service": service,
                "tool": tool,
                "state": if e.open.until_ms > now { "open" } else { "expiring" },
                "until": humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.open.until_ms)).to_string(),
                "remaining_ms": e.open.until_ms.saturating_sub(now),
                "opened_by": e.open.opened_by,
            })
        })
        .collect();
    Json(json!({"etcd_up": s.etcd.is_up(), "breakers": list}))
}

async fn overrides(State(s): State<AdminState>) -> impl IntoResponse {
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    let list: Vec<_> = reg
        .overrides()
        .iter()
        .map(|((service, tool), o)| {
            json!({
                "service": service,
                "tool": tool,
                "mode": o.mode,
                "reason": o.reason,
                "author": o.author,
                "since": humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(o.at_ms)).to_string(),
            })
        })
        .collect();
    Json(json!({"etcd_up": s.etcd.is_up(), "overrides": list}))
}

async fn put_override(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, AdminError> {
    s.token.check(&headers)?;
    let o: Override =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body))
            .map_err(|e| {
                AdminError::bad_request(format!(
            "expected {{\"mode\": \"force_open\" | \"force_closed\", \"reason\": \"...\"}}: {e}"
        ))
            })?;
    let stored = s.fleet.put_override(&service, &tool, o).await?;
    Ok(Json(
        json!({"service": service, "tool": tool, "override": stored}),
    ))
}

async fn delete_override(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, AdminError> {
    s.token.check(&headers)?;
    if s.fleet.delete_override(&service, &tool).await? {
        Ok(Json(
            json!({"service": service, "tool": tool, "lifted": true}),
        ))
    } else {
        Err(AdminError {
            status: StatusCode::NOT_FOUND,
            message: format!("no override on {service}/{tool}"),
        })
    }
}

async fn policies(State(s): State<AdminState>) -> impl IntoResponse {
    let config = s
        .registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .filter_config();
    Json(json!({"defaults": config.defaults, "services": config.services}))
}

async fn put_policy(
    s: &AdminState,
    headers: &HeaderMap,
    service: &str,
    tool: Option<&str>,
    body: &[u8],
) -> Result<Json<serde_json::Value>, AdminError> {
    s.token.check(headers)?;
    s.fleet.put_policy(service, tool, body).await?;
    Ok(Json(
        json!({"service": service, "tool": tool, "stored": true}),
    ))
}

async fn delete_policy(
    s: &AdminState,
    headers: &HeaderMap,
    service: &str,
    tool: Option<&str>,
) -> Result<Json<serde_json::Value>, AdminError> {
    s.token.check(headers)?;
    if s.fleet.delete_policy(service, tool).await? {
        Ok(Json(
            json!({"service": service, "tool": tool, "deleted": true}),
        ))
    } else {
        Err(AdminError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "no policy for {service}{}",
                tool.map(|t| format!("/{t}")).unwrap_or_default()
            ),
        })
    }
}

async fn put_service_policy(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<serde_json::Value>, AdminError> {
    put_policy(&s, &headers, &service, None, &body).await
}

async fn put_tool_policy(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<serde_json::Value>, AdminError> {
    put_policy(&s, &headers, &service, Some(&tool), &body).await
}

async fn delete_service_policy(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, AdminError> {
    delete_policy(&s, &headers, &service, None).await
}

async fn delete_tool_policy(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, AdminError> {
    delete_policy(&s, &headers, &service, Some(&tool)).await
}
