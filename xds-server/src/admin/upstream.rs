//! `/v1/upstream-sessions`: the filters ask toolgate-xds to open a session with a server on a
//! client's behalf, and to replay a request whose session the server no longer knows (see
//! `crate::upstream`). Only filters ask, with their report token: the answer routes to an
//! instance of the filter's choosing, which no client may pick.
//!
//! A refusal names what happened in `failure` (with `status`, `bound` and `limit` where they
//! apply), for the filter to tell the client: `no_instance` (503), `at_bound` (429), `ended`
//! (410: the client or the live server ended the session; the server's answer is the
//! client's), `overloaded` (503), `refused` / `unreachable` / `timeout` / `failed` (502:
//! opening the session), and for a replayed call that itself failed, `timeout`, `reset` or
//! `bad_response` with `"in_call": true` (504/502).

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
use crate::upstream::{HeldFor, InitParams, Lost, OpenError};

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
    /// Whom the bounds count the session for: the verified user, or the client's address
    /// (opaque to toolgate-xds). Absent: the owner.
    #[serde(default)]
    caller: Option<String>,
    /// The client's `initialize` parameters (a client of a service's route)...
    #[serde(default)]
    params: Option<InitParams>,
    /// ...or the gateway session of a client of the aggregate endpoint, which carries them.
    #[serde(default)]
    gateway_session: Option<String>,
    /// The envelope whose session the server no longer knows, if any: it is opened again only
    /// if it was lost with its instance.
    #[serde(default)]
    stale: Option<String>,
    /// When that session was opened (ms since the Unix epoch), when the filter knows.
    #[serde(default)]
    opened_ms: Option<u64>,
    /// The instance that answered "session unknown" (`ip:port`), when the filter knows.
    #[serde(default)]
    answered_by: Option<String>,
}

impl OpenRequest {
    fn lost(&self) -> Option<Lost> {
        self.stale.as_ref().map(|stale| Lost {
            stale: Some(stale.clone()),
            opened_ms: self.opened_ms,
            answered_by: self.answered_by.as_deref().and_then(|a| a.parse().ok()),
        })
    }

    fn held_for<'a>(&'a self, params: &'a InitParams) -> HeldFor<'a> {
        HeldFor {
            owner: &self.owner,
            service: &self.service,
            caller: self.caller.as_deref().unwrap_or(&self.owner),
            params,
        }
    }
}

#[derive(Debug, Deserialize)]
struct ReplayRequest {
    #[serde(flatten)]
    open: OpenRequest,
    /// The client's message, base64 (it is bytes, judged by the filter).
    body: String,
    /// Headers the filter put on the client's request (the verified claims the service asked
    /// for), which the replay keeps; only the service's claim headers are sent.
    #[serde(default)]
    headers: Vec<(String, String)>,
}

fn bad(message: String) -> axum::response::Response {
    (StatusCode::BAD_REQUEST, Json(json!({"error": message}))).into_response()
}

fn failed(e: OpenError) -> axum::response::Response {
    let status = match &e {
        OpenError::BadRequest(_) => StatusCode::BAD_REQUEST,
        OpenError::NoInstance(_) | OpenError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        OpenError::AtBound { .. } => StatusCode::TOO_MANY_REQUESTS,
        OpenError::Ended(_) => StatusCode::GONE,
        OpenError::CallFailed {
            failure: "timeout", ..
        } => StatusCode::GATEWAY_TIMEOUT,
        OpenError::Refused { .. }
        | OpenError::Unreachable(_)
        | OpenError::Timeout(_)
        | OpenError::Failed(_)
        | OpenError::CallFailed { .. } => StatusCode::BAD_GATEWAY,
    };
    let mut body = json!({"error": e.to_string(), "failure": e.code()});
    match &e {
        OpenError::Refused { status, .. } => body["status"] = json!(status),
        OpenError::AtBound { bound, limit } => {
            body["bound"] = json!(bound.as_str());
            body["limit"] = json!(limit);
        }
        OpenError::CallFailed { .. } => body["in_call"] = json!(true),
        _ => {}
    }
    (status, Json(body)).into_response()
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
/// and the client's parameters found. `Err` is the answer to give.
fn admit<T: serde::de::DeserializeOwned>(
    s: &AdminState,
    headers: &HeaderMap,
    body: &[u8],
    open_of: impl Fn(&T) -> &OpenRequest,
) -> Result<(T, InitParams), Box<axum::response::Response>> {
    let answer = |r: axum::response::Response| Box::new(r);
    s.reports
        .check(headers)
        .map_err(|e| answer(e.into_response()))?;
    let r: T = parse(body).map_err(|e| answer(bad(e)))?;
    check(open_of(&r)).map_err(|e| answer(bad(e)))?;
    let params = params_of(s, open_of(&r))
        .map_err(|(status, e)| answer((status, Json(json!({"error": e}))).into_response()))?;
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
    let lost = r.lost();
    match s.upstream.open(r.held_for(&params), lost.as_ref()).await {
        Ok(opened) => Json(opened).into_response(),
        Err(e) => {
            end_gateway_session(&s, &r, &e);
            failed(e)
        }
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
    let lost = r.open.lost().unwrap_or_default();
    match s
        .upstream
        .replay(r.open.held_for(&params), &lost, message, &r.headers)
        .await
    {
        Ok(replayed) => Json(replayed).into_response(),
        Err(e) => {
            if !matches!(e, OpenError::Ended(_)) {
                tracing::warn!(service = %r.open.service, error = %e,
                    "replaying a request on a new session for a client failed");
            }
            end_gateway_session(&s, &r.open, &e);
            failed(e)
        }
    }
}

/// A session held for a gateway session was ended by its live server: the gateway session
/// ends with it (its client gets the server's 404 and initializes again, as after any 404),
/// rather than going on without the state that server kept.
fn end_gateway_session(s: &AdminState, r: &OpenRequest, e: &OpenError) {
    if let (OpenError::Ended(_), Some(id)) = (e, &r.gateway_session) {
        s.aggregate.end_session(id);
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
