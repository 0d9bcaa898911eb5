//! `/v1/aggregate/{name}`: POST one JSON-RPC message, GET the legacy notification stream,
//! DELETE a gateway session. Agent traffic: no admin token (see `admin::guard_reads`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::jsonrpc::{self, Message, Revision, RpcError, INVALID_REQUEST};
use super::listing::Listing;
use super::session::Refused;
use super::stream::{self, OpenStream};
use super::{methods, Aggregate};
use crate::metrics::{AggregateLabel, StreamLabel};
use crate::upstream::UpstreamSessions;
use toolgate_model::session_owner::{
    bound_to, is_identity_digest, owner_of, OwnerKind, IDENTITY_HEADER,
};

/// What the handlers of `/v1/aggregate/{name}` use of the admin listener's state (which
/// provides it, see `admin::router`): the endpoint, and the sessions held upstream for its
/// clients. Its own type so this module does not import the admin API that routes to it.
#[derive(Clone)]
pub struct AggregateState {
    pub aggregate: Arc<Aggregate>,
    pub upstream: Arc<UpstreamSessions>,
}

/// The largest POST body read; a JSON-RPC message to this endpoint is a few hundred bytes.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
pub const SESSION_HEADER: &str = "mcp-session-id";

/// The methods counted by name; anything else is `other`, so a client cannot grow the label
/// set.
fn method_label(method: &str) -> &'static str {
    const KNOWN: [&str; 18] = [
        "initialize",
        "notifications/initialized",
        "ping",
        "tools/list",
        "tools/call",
        "server/discover",
        "subscriptions/listen",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "prompts/list",
        "prompts/get",
        "completion/complete",
        "resources/subscribe",
        "resources/unsubscribe",
        "logging/setLevel",
        "notifications/cancelled",
        "GET",
    ];
    KNOWN
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
}

fn count(a: &Aggregate, name: &str, method: &str) {
    a.metrics()
        .aggregate_requests
        .get_or_create(&AggregateLabel {
            virtual_server: name.to_string(),
            method: method_label(method),
        })
        .inc();
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// A result written straight from its parts (a page of pre-written tools), not through a
/// `Value`.
fn result_response(id: &Value, result: &impl serde::Serialize) -> Response {
    #[derive(serde::Serialize)]
    struct Reply<'a, R> {
        jsonrpc: &'static str,
        id: &'a Value,
        result: &'a R,
    }
    match serde_json::to_string(&Reply {
        jsonrpc: "2.0",
        id,
        result,
    }) {
        Ok(body) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => error_response(
            &RpcError::new(jsonrpc::INTERNAL_ERROR, format!("writing the answer: {e}")),
            Some(id),
        ),
    }
}

fn error_response(e: &RpcError, id: Option<&Value>) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    json_response(status, &e.to_response(id))
}

fn no_such_server(name: &str) -> RpcError {
    RpcError::new(
        INVALID_REQUEST,
        format!("no virtual server named {name:?} (the default one is \"default\", at /mcp)"),
    )
    .status(404)
}

/// The session a legacy request carries: 400 without one, 404 for one that is not (or no
/// longer) a session of this virtual server, so that the client initializes again.
fn session_of(a: &Aggregate, name: &str, headers: &HeaderMap) -> Result<String, RpcError> {
    let Some(id) = headers.get(SESSION_HEADER) else {
        return Err(RpcError::new(
            INVALID_REQUEST,
            "Bad Request: Mcp-Session-Id header is required (send initialize first)",
        )
        .status(400));
    };
    let id = id.to_str().unwrap_or("").trim().to_string();
    match a.sessions().touch(&id, name) {
        Ok(_) => Ok(id),
        Err(why) => {
            let message = match why {
                Refused::Unknown => "Session not found: initialize a new session",
                Refused::OtherServer => {
                    "Session not found: this session belongs to another virtual server; initialize a new session"
                }
                Refused::Ended => "Session not found: it ended or expired; initialize a new session",
            };
            Err(RpcError::new(INVALID_REQUEST, message).status(404))
        }
    }
}

pub async fn post(
    State(s): State<AggregateState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let a = &s.aggregate;
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return error_response(
            &RpcError::new(
                INVALID_REQUEST,
                format!("the request body is larger than {MAX_BODY_BYTES} bytes (1 MiB)"),
            )
            .status(413),
            None,
        );
    };
    let message = match jsonrpc::parse(&bytes) {
        Ok(m) => m,
        Err(e) => return error_response(&e, None),
    };
    let Some(listing) = a.listing(&name) else {
        let id = match &message {
            Message::Request { id, .. } => Some(id),
            _ => None,
        };
        return error_response(&no_such_server(&name), id);
    };
    match message {
        Message::Response => StatusCode::ACCEPTED.into_response(),
        Message::Notification { method } => {
            count(a, &name, &method);
            let revision = jsonrpc::revision(&headers, &Value::Null);
            if revision == Ok(Revision::Legacy) {
                let session = match session_of(a, &name, &headers) {
                    Ok(session) => session,
                    Err(e) => return error_response(&e, None),
                };
                if method == CANCELLED {
                    cancel_everywhere(&s, &name, &session, &headers, bytes.to_vec());
                }
            }
            StatusCode::ACCEPTED.into_response()
        }
        Message::Request { id, method, params } => {
            count(a, &name, &method);
            let revision = match jsonrpc::revision(&headers, &params) {
                Ok(r) => r,
                Err(e) => return error_response(&e, Some(&id)),
            };
            if method == "logging/setLevel" && revision == Revision::Legacy {
                return set_level(&s, &name, &headers, &id, &params).await;
            }
            match revision {
                Revision::Legacy => legacy(a, &name, &listing, &headers, &id, &method, &params),
                Revision::Modern => modern(a, &name, &listing, &id, &method, &params),
            }
        }
    }
}

const CANCELLED: &str = "notifications/cancelled";

/// The owner of the sessions held for the caller of a request on the gateway session
/// `session`: the client session, bound to the verified user the filter names (another user
/// of the same client session has sessions, requests and a log level of its own).
fn caller_owner(session: &str, headers: &HeaderMap) -> Option<String> {
    let identity = headers
        .get(IDENTITY_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|d| is_identity_digest(d));
    owner_of(OwnerKind::Gateway, session).map(|base| bound_to(base, identity))
}

/// A client's `notifications/cancelled` on a gateway session: passed on, in the background, to
/// every server holding a session for its caller (see `UpstreamSessions::cancel_everywhere`);
/// the client has its 202 at once, as a server would answer it.
fn cancel_everywhere(
    s: &AggregateState,
    name: &str,
    session: &str,
    headers: &HeaderMap,
    body: Vec<u8>,
) {
    let Some(owner) = caller_owner(session, headers) else {
        return;
    };
    let upstream = Arc::clone(&s.upstream);
    let name = name.to_string();
    tokio::spawn(async move {
        match upstream.cancel_everywhere(&owner, &body).await {
            Some(took) => tracing::info!(
                virtual_server = name,
                servers = took,
                "passed a client's cancellation on to the servers holding a session for it"
            ),
            None => tracing::warn!(
                virtual_server = name,
                in_flight = crate::upstream::MAX_CANCELLATIONS_IN_FLIGHT,
                "dropped a client's cancellation: as many are being passed on already"
            ),
        }
    });
}

/// `logging/setLevel` of a gateway session: passed on to every session the gateway holds for
/// it (and to each it opens later), so each server logs to the client at that level.
async fn set_level(
    s: &AggregateState,
    name: &str,
    headers: &HeaderMap,
    id: &Value,
    params: &Value,
) -> Response {
    let session = match session_of(&s.aggregate, name, headers) {
        Ok(session) => session,
        Err(e) => return error_response(&e, Some(id)),
    };
    let level = match methods::log_level(params) {
        Ok(level) => level,
        Err(e) => return error_response(&e, Some(id)),
    };
    if let Some(owner) = caller_owner(&session, headers) {
        let took = s.upstream.set_log_level(&owner, level).await;
        tracing::info!(
            virtual_server = name,
            level,
            servers = took,
            "passed a client's log level on to the servers holding a session for it"
        );
    }
    json_response(StatusCode::OK, &jsonrpc::result(id, serde_json::json!({})))
}

fn legacy(
    a: &Aggregate,
    name: &str,
    listing: &Listing,
    headers: &HeaderMap,
    id: &Value,
    method: &str,
    params: &Value,
) -> Response {
    if method == "initialize" {
        let (result, claims) = match methods::initialize(name, listing, params) {
            Ok(r) => r,
            Err(e) => return error_response(&e, Some(id)),
        };
        let Some(session) = a.sessions().issue(&claims) else {
            let e = RpcError::new(jsonrpc::INTERNAL_ERROR, "could not issue a session id");
            return error_response(&e, Some(id));
        };
        a.count_sessions();
        let mut response = json_response(StatusCode::OK, &jsonrpc::result(id, result));
        if let Ok(v) = HeaderValue::from_str(&session) {
            response.headers_mut().insert(SESSION_HEADER, v);
        }
        return response;
    }
    if let Err(e) = session_of(a, name, headers) {
        return error_response(&e, Some(id));
    }
    let answer = match method {
        "ping" => Ok(methods::ping(Revision::Legacy, name)),
        "tools/list" => {
            return match methods::tools_list(Revision::Legacy, name, listing, params) {
                Ok(page) => result_response(id, &page),
                Err(e) => error_response(&e, Some(id)),
            }
        }
        m => match methods::surface_list(Revision::Legacy, name, listing, m, params) {
            Some(Ok(page)) => return result_response(id, &page),
            Some(Err(e)) => Err(e),
            None => Err(methods::refused(m).unwrap_or_else(|| methods::unknown(m))),
        },
    };
    match answer {
        Ok(result) => json_response(StatusCode::OK, &jsonrpc::result(id, result)),
        Err(e) => error_response(&e, Some(id)),
    }
}

fn modern(
    a: &Aggregate,
    name: &str,
    listing: &Listing,
    id: &Value,
    method: &str,
    params: &Value,
) -> Response {
    let answer = match method {
        "server/discover" => Ok(methods::discover(name, listing)),
        "ping" => Ok(methods::ping(Revision::Modern, name)),
        "tools/list" => {
            return match methods::tools_list(Revision::Modern, name, listing, params) {
                Ok(page) => result_response(id, &page),
                Err(e) => error_response(&e, Some(id)),
            }
        }
        "subscriptions/listen" => {
            return match methods::listen_filter(params) {
                Ok(honoured) => {
                    let open = OpenStream::new(
                        a.metrics()
                            .aggregate_streams
                            .get_or_create(&StreamLabel { kind: "listen" })
                            .clone(),
                    );
                    stream::listen(a.streams().subscribe(name), id, honoured, open)
                }
                Err(e) => error_response(&e, Some(id)),
            }
        }
        m => match methods::surface_list(Revision::Modern, name, listing, m, params) {
            Some(Ok(page)) => return result_response(id, &page),
            Some(Err(e)) => Err(e),
            None => Err(methods::refused(m).unwrap_or_else(|| methods::unknown(m))),
        },
    };
    match answer {
        Ok(result) => json_response(StatusCode::OK, &jsonrpc::result(id, result)),
        // 2026-07-28: a method the server does not implement is a 404.
        Err(e) if e.code == jsonrpc::METHOD_NOT_FOUND => error_response(&e.status(404), Some(id)),
        Err(e) => error_response(&e, Some(id)),
    }
}

/// The legacy notification stream of a session.
pub async fn get(
    State(s): State<AggregateState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let a: &Arc<Aggregate> = &s.aggregate;
    if headers
        .get("mcp-protocol-version")
        .is_some_and(|v| v.as_bytes() == jsonrpc::MODERN.as_bytes())
    {
        // 2026-07-28 has no GET stream: subscriptions/listen replaces it.
        return (StatusCode::METHOD_NOT_ALLOWED, [("allow", "POST")]).into_response();
    }
    let accepts_sse = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")));
    if !accepts_sse {
        return (
            StatusCode::NOT_ACCEPTABLE,
            "GET opens an SSE stream: send Accept: text/event-stream",
        )
            .into_response();
    }
    if a.listing(&name).is_none() {
        return error_response(&no_such_server(&name), None);
    }
    count(a, &name, "GET");
    let session = match session_of(a, &name, &headers) {
        Ok(id) => id,
        Err(e) => return error_response(&e, None),
    };
    let open = OpenStream::new(
        a.metrics()
            .aggregate_streams
            .get_or_create(&StreamLabel { kind: "get" })
            .clone(),
    );
    let relayed = caller_owner(&session, &headers).map(|owner| {
        let shows = Arc::clone(a);
        let server = name.clone();
        a.relays().start(
            Arc::clone(&s.upstream),
            owner,
            Arc::new(move |service: &str, uri: &str| shows.shown_uri(&server, service, uri)),
        )
    });
    let owner = Arc::clone(a);
    stream::legacy(
        a.streams().subscribe(&name),
        a.sessions().endings(),
        move || owner.sessions().has_ended(&session),
        relayed,
        open,
    )
}

/// Ends a gateway session: 204, and the next request with it gets 404.
pub async fn delete(
    State(s): State<AggregateState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let a = &s.aggregate;
    let Some(id) = headers.get(SESSION_HEADER) else {
        return error_response(
            &RpcError::new(
                INVALID_REQUEST,
                "Bad Request: Mcp-Session-Id header is required",
            )
            .status(400),
            None,
        );
    };
    let id = id.to_str().unwrap_or("").trim().to_string();
    match a.sessions().end(&id, &name) {
        Ok(claims) => {
            a.session_ended(&id, Some(&claims));
            StatusCode::NO_CONTENT.into_response()
        }
        Err(_) => error_response(
            &RpcError::new(INVALID_REQUEST, "Session not found").status(404),
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_stay_bounded() {
        assert_eq!(method_label("tools/list"), "tools/list");
        assert_eq!(method_label("x/y/z"), "other");
    }
}
