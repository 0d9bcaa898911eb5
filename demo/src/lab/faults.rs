//! The lab's fault layer in front of `/mcp`: counts every `tools/call`,
//! `initialize` and DELETE on arrival, parks every request while `mcp_wedged`,
//! adds the configured latency, and injects the failures that live below
//! JSON-RPC (HTTP 500, TCP reset, hang). rmcp never sees a request this layer
//! fails; JSON-RPC-level failures are left to the tools themselves.

use std::sync::Arc;

use futures::StreamExt;

use axum::{
    body::{to_bytes, Body},
    extract::{ConnectInfo, Request, State},
    http::{header, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};

use super::{
    jsonrpc,
    knobs::{FailureMode, Layer},
    state::LabState,
};
use crate::http::reset::ResetHandle;

/// The most body this layer buffers to find the tool name: rmcp's own request
/// limit, so nothing rmcp would accept is refused here.
const MAX_INSPECTED_BODY: usize = 4 * 1024 * 1024;

pub async fn inject(State(lab): State<Arc<LabState>>, request: Request, next: Next) -> Response {
    lab.record_request(&request);
    if request.method() == Method::DELETE {
        lab.record_delete();
    }
    if request.method() != Method::POST {
        // GET streams and DELETEs hang too when wedged: a wedged handler
        // answers nothing, whatever the method.
        if lab.mcp_wedged() {
            return park(&lab, reset_handle(request.extensions())).await;
        }
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match to_bytes(body, MAX_INSPECTED_BODY).await {
        Ok(bytes) => bytes,
        Err(error) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body unreadable or above {MAX_INSPECTED_BODY} bytes: {error}"),
            )
                .into_response()
        }
    };
    let tools = jsonrpc::called_tools(&bytes);
    let id = jsonrpc::call_id(&bytes).unwrap_or_else(|| "null".into());
    let reset = reset_handle(&parts.extensions);
    // Counted before the wedge, so a test sees that a probe or a call reached
    // the lab even when the lab never answered it.
    let initializes = jsonrpc::count_requests(&bytes, "initialize");
    if initializes > 0 {
        lab.record_initialize(initializes);
    }
    for tool in &tools {
        lab.record_call(tool);
    }
    if lab.mcp_wedged() {
        return park(&lab, reset).await;
    }
    if lab.listing_unreadable() {
        if let Some(list_id) = jsonrpc::request_id(&bytes, "tools/list") {
            return unreadable_listing(&list_id, &lab.tools);
        }
    }
    let request = Request::from_parts(parts, Body::from(bytes));
    if tools.is_empty() {
        return next.run(request).await;
    }

    let delay = tools
        .iter()
        .map(|tool| lab.latency_for(tool))
        .max()
        .unwrap_or_default();
    if !delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = lab.shutdown.cancelled() => return tear_down(reset.as_ref()),
        }
    }

    let failure = tools
        .iter()
        .find_map(|tool| Some((tool, lab.draw_failure(tool, Layer::Http)?)));
    let Some((tool, mode)) = failure else {
        return next.run(request).await;
    };
    tracing::info!(tool = %tool, mode = %mode, "injecting failure");
    match mode {
        FailureMode::Http500 => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!(
                "injected failure: http500 for tool {tool} on instance {}\n",
                lab.instance_id
            ),
        )
            .into_response(),
        FailureMode::Http500Empty => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_LENGTH, "0")],
        )
            .into_response(),
        FailureMode::Http502Html => (
            StatusCode::BAD_GATEWAY,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            "<html><head><title>502 Bad Gateway</title></head><body>\
             <h1>502 Bad Gateway</h1><p>upstream 10.0.3.7:8080 unreachable</p></body></html>\n",
        )
            .into_response(),
        FailureMode::Http503Jsonrpc => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32603,"message":"injected: the server is overloaded (instance {})"}}}}"#,
                lab.instance_id
            ),
        )
            .into_response(),
        FailureMode::SseEndsEarly => cut_stream(id, reset, false),
        FailureMode::SseReset => cut_stream(id, reset, true),
        FailureMode::JsonReset => {
            let full = format!(
                r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"{}"}}],"isError":false}}}}"#,
                "x".repeat(512)
            );
            let half = full.as_bytes()[..full.len() / 2].to_vec();
            let body = cut_body(vec![half], reset);
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, full.len())
                .body(body)
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
        FailureMode::Reset => tear_down(reset.as_ref()),
        FailureMode::Hang => park(&lab, reset).await,
        FailureMode::None | FailureMode::JsonrpcError | FailureMode::IsError => {
            next.run(request).await
        }
    }
}

/// A `tools/list` answer on an SSE stream whose result has `tools` twice: every tool first,
/// none second. Readers disagree on which counts, so a strict one cannot read it.
fn unreadable_listing(id: &str, tools: &[String]) -> Response {
    let listed: Vec<String> = tools
        .iter()
        .map(|t| format!(r#"{{"name":"{t}","inputSchema":{{"type":"object"}}}}"#))
        .collect();
    let message = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[{}],"tools":[]}}}}"#,
        listed.join(",")
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from(format!("event: message\ndata: {message}\n\n")))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The connection's reset handle, which `http::serve`'s listener puts on every request.
fn reset_handle(extensions: &axum::http::Extensions) -> Option<ResetHandle> {
    extensions
        .get::<ConnectInfo<ResetHandle>>()
        .map(|ConnectInfo(handle)| handle.clone())
}

/// No answer: parked until the client gives up (hyper then drops this future)
/// or the lab stops, when the connection is reset rather than answered.
async fn park(lab: &LabState, reset: Option<ResetHandle>) -> Response {
    lab.shutdown.cancelled().await;
    tear_down(reset.as_ref())
}

/// An SSE answer that sends one progress notification for the call `id` and then ends
/// (`reset`: the connection is reset instead) without the response.
fn cut_stream(id: String, reset: Option<ResetHandle>, hard: bool) -> Response {
    let progress = format!(
        "event: message\ndata: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{{\"progressToken\":{id},\"progress\":1}}}}\n\n"
    );
    let body = if hard {
        cut_body(vec![progress.into_bytes()], reset)
    } else {
        Body::from(progress)
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A body that sends `chunks`, then resets the connection in the middle of the response
/// (the next write fails and the socket closes with RST).
fn cut_body(chunks: Vec<Vec<u8>>, reset: Option<ResetHandle>) -> Body {
    let stream = futures::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>)).chain(
        futures::stream::once(async move {
            // Let the first bytes reach the client before the connection goes.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            if let Some(handle) = reset {
                handle.reset();
            }
            Ok(b"  ".to_vec())
        }),
    );
    Body::from_stream(stream)
}

/// Resets the connection. The returned response is never written: the reset
/// connection fails hyper's write and is closed with RST.
fn tear_down(reset: Option<&ResetHandle>) -> Response {
    match reset {
        Some(handle) => handle.reset(),
        // Only when served without http::serve's listener (which always adds it).
        None => tracing::warn!("connection cannot be reset; answering 500 instead"),
    }
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}
