//! The Streamable HTTP side: `POST` one JSON-RPC message, `GET` a session's stream,
//! `DELETE` a session. A request's answer is JSON, unless something of the server for that
//! call (progress, a request to the client) comes first and the client reads SSE: then the
//! answer is an event stream, ending with the response.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::Value;
use tokio::sync::mpsc;

use super::core::{Core, Refusal};
use super::link::{Route, Waiter};
use super::session::Session;
use super::wire::{self, Kind};

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";
/// Messages of the server for one call that may wait unread on its stream.
const CALL_STREAM_BUFFER: usize = 64;

pub fn router(core: Arc<Core>) -> Router {
    let path = core.options.mcp_path.clone();
    Router::new()
        .route(
            &path,
            post(post_message).get(get_stream).delete(delete_session),
        )
        .with_state(core)
}

fn json_response(status: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn refused(r: &Refusal, id: Option<&Value>) -> Response {
    let mut resp = json_response(r.status, &r.body(id));
    if let Some(secs) = r.retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

/// The answer to a request, with the status its revision gives it.
fn reply_json(reply: &Value, modern: bool) -> Response {
    let status = match wire::error_code(reply) {
        Some(code) if modern => wire::modern_status(code),
        _ => 200,
    };
    json_response(status, reply)
}

fn event(message: &Value) -> Result<Vec<u8>, Infallible> {
    let mut e = b"event: message\ndata: ".to_vec();
    e.extend_from_slice(message.to_string().as_bytes());
    e.extend_from_slice(b"\n\n");
    Ok(e)
}

fn sse_response(body: Body) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// Waits for a call: JSON when the answer comes first, else an event stream of what belongs
/// to the call, ending with its answer. `keep` lives as long as the call (the session's
/// activity).
async fn answer<K: Send + 'static>(
    waiter: Waiter,
    related: Option<mpsc::Receiver<Value>>,
    modern: bool,
    keep: K,
) -> Response {
    let Some(mut related) = related else {
        let reply = waiter.wait().await;
        drop(keep);
        return reply_json(&reply, modern);
    };
    // The call's stream closes when its answer is in (or it failed): the answer then waits.
    let Some(first) = related.recv().await else {
        let reply = waiter.wait().await;
        drop(keep);
        return reply_json(&reply, modern);
    };
    enum Stage<K> {
        First(Value, mpsc::Receiver<Value>, Waiter, K),
        Related(mpsc::Receiver<Value>, Waiter, K),
        Done,
    }
    let stream = futures::stream::unfold(
        Stage::First(first, related, waiter, keep),
        |stage| async move {
            match stage {
                Stage::First(m, related, waiter, keep) => {
                    Some((event(&m), Stage::Related(related, waiter, keep)))
                }
                Stage::Related(mut related, waiter, keep) => match related.recv().await {
                    Some(m) => Some((event(&m), Stage::Related(related, waiter, keep))),
                    None => {
                        let reply = waiter.wait().await;
                        drop(keep);
                        Some((event(&reply), Stage::Done))
                    }
                },
                Stage::Done => None,
            }
        },
    );
    sse_response(Body::from_stream(stream))
}

fn accepts_sse(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")))
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap_or("").trim())
}

/// The session a 2025-era request names: 400 without one, 404 for one the bridge does not
/// know (any more).
fn session_of(core: &Core, headers: &HeaderMap) -> Result<Arc<Session>, Refusal> {
    let Some(id) = header_str(headers, SESSION_HEADER) else {
        return Err(Refusal::new(
            400,
            wire::INVALID_REQUEST,
            "Bad Request: Mcp-Session-Id header is required (send initialize first)",
        ));
    };
    core.sessions.get(id).ok_or_else(|| {
        Refusal::session_not_found("no such session (it ended, or the bridge restarted)")
    })
}

async fn post_message(State(core): State<Arc<Core>>, headers: HeaderMap, body: Body) -> Response {
    let limit = core.options.max_message_bytes;
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return json_response(
            413,
            &wire::error(
                None,
                wire::INVALID_REQUEST,
                format!("the message is larger than {limit} bytes (--max-message-bytes)"),
            ),
        );
    };
    let message: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return json_response(
                400,
                &wire::error(None, wire::PARSE_ERROR, format!("Parse error: {e}")),
            )
        }
    };
    if message.is_array() {
        return json_response(
            400,
            &wire::error(
                None,
                wire::INVALID_REQUEST,
                "Invalid Request: batches are not supported; send one JSON-RPC message per POST",
            ),
        );
    }
    let kind = wire::kind(&message);
    if let Kind::Invalid(why) = kind {
        return json_response(
            400,
            &wire::error(
                None,
                wire::INVALID_REQUEST,
                format!("Invalid Request: {why}"),
            ),
        );
    }
    let sse = accepts_sse(&headers);
    let version = header_str(&headers, VERSION_HEADER);
    let is_initialize = matches!(&kind, Kind::Request { method } if method == "initialize");
    if let Some(v) = version {
        if !is_initialize && !wire::served().contains(&v) {
            let id = message.get("id");
            return json_response(
                400,
                &wire::error_with(
                    id,
                    wire::UNSUPPORTED_VERSION,
                    format!("Unsupported protocol version {v:?}"),
                    Some(serde_json::json!({"requested": v, "supported": wire::served()})),
                ),
            );
        }
    }
    let modern = !is_initialize
        && match version {
            Some(v) => v == wire::MODERN,
            None => wire::meta_version(message.get("params")) == Some(wire::MODERN),
        };
    if modern {
        modern_message(&core, message, kind, sse).await
    } else {
        legacy_message(&core, &headers, message, kind, sse).await
    }
}

fn call_stream(sse: bool) -> (Option<mpsc::Sender<Value>>, Option<mpsc::Receiver<Value>>) {
    if sse {
        let (tx, rx) = mpsc::channel(CALL_STREAM_BUFFER);
        (Some(tx), Some(rx))
    } else {
        (None, None)
    }
}

/// 2026-07-28: every request stands alone and goes to a pool server.
async fn modern_message(core: &Arc<Core>, message: Value, kind: Kind, sse: bool) -> Response {
    let Kind::Request { method } = kind else {
        // The revision defines no client notification to act on (cancelling is closing the
        // request's stream), and the bridge asks 2026-07-28 clients nothing.
        return StatusCode::ACCEPTED.into_response();
    };
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    match method.as_str() {
        "server/discover" => match core.discover().await {
            Ok(result) => json_response(200, &wire::result(&id, result)),
            Err(r) => refused(&r, Some(&id)),
        },
        "subscriptions/listen" => json_response(
            404,
            &wire::error(
                Some(&id),
                wire::METHOD_NOT_FOUND,
                "subscriptions/listen is not served by the stdio bridge (toolgate-register \
                 --stdio); list again instead",
            ),
        ),
        _ => {
            let (link, _) = match core.pool_link().await {
                Ok(l) => l,
                Err(r) => return refused(&r, Some(&id)),
            };
            let (tx, rx) = call_stream(sse);
            let route = Route {
                session: None,
                related: tx,
                modern: true,
                cancel_on_drop: true,
            };
            match link.call(message, route) {
                Ok(waiter) => answer(waiter, rx, true, ()).await,
                Err(e) => reply_json(&e, true),
            }
        }
    }
}

/// 2025 revisions: `initialize` opens a session; everything else names one.
async fn legacy_message(
    core: &Arc<Core>,
    headers: &HeaderMap,
    message: Value,
    kind: Kind,
    sse: bool,
) -> Response {
    let id = message.get("id").cloned();
    if matches!(&kind, Kind::Request { method } if method == "initialize") {
        return match core.open_session(message).await {
            Ok((answer, session)) => {
                let mut resp = json_response(200, &answer);
                if let Some(Ok(v)) = session.as_deref().map(HeaderValue::from_str) {
                    resp.headers_mut().insert(SESSION_HEADER, v);
                }
                resp
            }
            Err(r) => refused(&r, id.as_ref()),
        };
    }
    let session = match session_of(core, headers) {
        Ok(s) => s,
        Err(r) => return refused(&r, id.as_ref()),
    };
    match kind {
        Kind::Notification { method } => {
            match method.as_str() {
                // The bridge opened the shared server itself.
                "notifications/initialized" if !session.own_child => {}
                "notifications/cancelled" => session.link.cancel_from(&session.id, message),
                _ => session.link.send(&message),
            }
            StatusCode::ACCEPTED.into_response()
        }
        Kind::Response => {
            session.link.answer_from(&session.id, &message);
            StatusCode::ACCEPTED.into_response()
        }
        Kind::Request { .. } => {
            let active = session.begin();
            let link = match core.session_link(&session).await {
                Ok(l) => l,
                Err(r) => return refused(&r, id.as_ref()),
            };
            let (tx, rx) = call_stream(sse);
            let route = Route {
                session: Some(Arc::clone(&session)),
                related: tx,
                modern: false,
                cancel_on_drop: false,
            };
            match link.call(message, route) {
                Ok(waiter) => answer(waiter, rx, false, active).await,
                Err(e) => reply_json(&e, false),
            }
        }
        Kind::Invalid(_) => StatusCode::BAD_REQUEST.into_response(),
    }
}

/// A 2025-era session's stream of what its server sends outside any call.
async fn get_stream(State(core): State<Arc<Core>>, headers: HeaderMap) -> Response {
    if header_str(&headers, VERSION_HEADER) == Some(wire::MODERN) {
        // 2026-07-28 has no GET stream.
        return (StatusCode::METHOD_NOT_ALLOWED, [(header::ALLOW, "POST")]).into_response();
    }
    if !accepts_sse(&headers) {
        return (
            StatusCode::NOT_ACCEPTABLE,
            "GET opens an SSE stream: send Accept: text/event-stream",
        )
            .into_response();
    }
    let session = match session_of(&core, &headers) {
        Ok(s) => s,
        Err(r) => return refused(&r, None),
    };
    let rx = session.open_stream();
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|m| (event(&m), rx))
    });
    sse_response(Body::from_stream(stream))
}

/// Ends a session (and its server): 204; 404 for one the bridge does not know.
async fn delete_session(State(core): State<Arc<Core>>, headers: HeaderMap) -> Response {
    match session_of(&core, &headers) {
        Ok(s) => {
            core.end_session(&s, "the client ended it (DELETE)");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(r) => refused(&r, None),
    }
}
