//! `/v1/upstream-sessions`: the filters ask toolgate-xds to open (or re-open) a session with a
//! server on a client's behalf, and to replay a request whose session the server lost (see
//! `crate::upstream`). Only filters ask, with their report token: the answer routes to an
//! instance of the filter's choosing, which no client may pick.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{delete, post};
use axum::{Json, Router};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use serde_json::json;

use super::AdminState;
use crate::upstream::{InitParams, OpenError};

/// The largest request a filter may ask to replay (its own `max_body_bytes` is lower).
const MAX_REPLAY_BYTES: usize = 8 << 20;
/// Owners are opaque keys the filter derives; bounded like names.
const MAX_OWNER_LEN: usize = 128;

pub fn routes() -> Router<AdminState> {
    Router::new()
        .route("/v1/upstream-sessions", post(open))
        .route("/v1/upstream-sessions/replay", post(replay))
        .route("/v1/upstream-sessions/{owner}", delete(close))
}

#[derive(Debug, Deserialize)]
struct OpenRequest {
    owner: String,
    service: String,
    /// The client's `initialize` parameters (a client of a service's route)...
    #[serde(default)]
    params: Option<InitParams>,
    /// ...or the gateway session of a client of the aggregate endpoint, which carries them.
    #[serde(default)]
    gateway_session: Option<String>,
    /// The envelope the filter saw fail (404), if any: a new session is opened elsewhere.
    #[serde(default)]
    stale: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ReplayRequest {
    #[serde(flatten)]
    open: OpenRequest,
    /// The client's message, base64 (it is bytes, judged by the filter).
    body: String,
}

fn bad(message: String) -> axum::response::Response {
    (StatusCode::BAD_REQUEST, Json(json!({"error": message}))).into_response()
}

fn failed(e: OpenError) -> axum::response::Response {
    let status = match e {
        OpenError::BadRequest(_) => StatusCode::BAD_REQUEST,
        OpenError::NoInstance(_) => StatusCode::SERVICE_UNAVAILABLE,
        OpenError::Failed(_) => StatusCode::BAD_GATEWAY,
    };
    (status, Json(json!({"error": e.to_string()}))).into_response()
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(body))
        .map_err(|e| format!("not an upstream-session request: {e}"))
}

/// The client's parameters, given or read out of its gateway session.
fn params_of(s: &AdminState, r: &OpenRequest) -> Result<InitParams, (StatusCode, String)> {
    match (&r.params, &r.gateway_session) {
        (Some(p), None) => Ok(p.clone()),
        (None, Some(id)) => s.aggregate.client_params(id).ok_or((
            StatusCode::NOT_FOUND,
            "gateway_session: not a live gateway session (forged, ended or expired)".to_string(),
        )),
        _ => Err((
            StatusCode::BAD_REQUEST,
            "give exactly one of params and gateway_session".to_string(),
        )),
    }
}

fn check(r: &OpenRequest) -> Result<(), String> {
    if r.owner.is_empty() || r.owner.len() > MAX_OWNER_LEN {
        return Err(format!(
            "owner: 1 to {MAX_OWNER_LEN} characters, got {}",
            r.owner.len()
        ));
    }
    toolgate_model::validate_name("service", &r.service).map_err(|e| format!("service: {e}"))
}

/// What `open` and `replay` both do first: the report token, the request read and checked,
/// and the client's parameters found. `Err` is the answer to give (boxed: a response is
/// large, and the `Ok` path is the common one).
fn admit<T: serde::de::DeserializeOwned>(
    s: &AdminState,
    headers: &HeaderMap,
    body: &[u8],
    open_of: impl Fn(&T) -> &OpenRequest,
) -> Result<(T, InitParams), Box<axum::response::Response>> {
    s.reports
        .check(headers)
        .map_err(|e| Box::new(e.into_response()))?;
    let r: T = parse(body).map_err(|e| Box::new(bad(e)))?;
    check(open_of(&r)).map_err(|e| Box::new(bad(e)))?;
    let params = params_of(s, open_of(&r))
        .map_err(|(status, e)| Box::new((status, Json(json!({"error": e}))).into_response()))?;
    Ok((r, params))
}

async fn open(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let (r, params) = match admit::<OpenRequest>(&s, &headers, &body, |r| r) {
        Ok(admitted) => admitted,
        Err(answer) => return *answer,
    };
    match s
        .upstream
        .open(&r.owner, &r.service, &params, r.stale.as_deref())
        .await
    {
        Ok(opened) => Json(opened).into_response(),
        Err(e) => failed(e),
    }
}

async fn replay(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    if body.len() > MAX_REPLAY_BYTES * 2 {
        if let Err(e) = s.reports.check(&headers) {
            return e.into_response();
        }
        return bad(format!(
            "the request is larger than {MAX_REPLAY_BYTES} bytes"
        ));
    }
    let (r, params) = match admit::<ReplayRequest>(&s, &headers, &body, |r| &r.open) {
        Ok(admitted) => admitted,
        Err(answer) => return *answer,
    };
    let message = match STANDARD.decode(r.body.as_bytes()) {
        Ok(m) if m.len() <= MAX_REPLAY_BYTES => m,
        Ok(_) => return bad(format!("body: larger than {MAX_REPLAY_BYTES} bytes")),
        Err(e) => return bad(format!("body: not base64: {e}")),
    };
    match s
        .upstream
        .replay(
            &r.open.owner,
            &r.open.service,
            &params,
            r.open.stale.as_deref(),
            message,
        )
        .await
    {
        Ok(replayed) => Json(replayed).into_response(),
        Err(e) => {
            tracing::warn!(service = %r.open.service, error = %e,
                "replaying a request on a new session for a client failed");
            failed(e)
        }
    }
}

async fn close(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(owner): Path<String>,
) -> axum::response::Response {
    if let Err(e) = s.reports.check(&headers) {
        return e.into_response();
    }
    let n = s.upstream.close_owner(&owner).await;
    Json(json!({"closed": n})).into_response()
}
