//! `POST /v1/token-exchange`: a filter asks for the header a call to a service whose
//! credential is an exchange (`<prefix>auth/upstream/<service>` with `exchange`) carries for
//! its caller, giving the caller's verified token (see `crate::token_exchange`). Only filters
//! ask, with their report token, as for `/v1/upstream-sessions`: the answer is a credential
//! toward a server.
//!
//! The request is `{"service": "orders", "subject_token": "<the caller's token>"}` (no other
//! field; the token 16 KiB at most). The answer, never to be stored by anything between
//! (`cache-control: no-store`):
//!
//! - 200 `{"header": "authorization", "value": "Bearer …", "use_for_ms": N}`: the filter adds
//!   `header: value` to the caller's calls to the service for at most `use_for_ms`;
//! - else `{"failure": code, "why": sentence for the agent}` with `"error"` (the provider's
//!   OAuth error code) when it refused: 404 `not_configured`, 502 `refused`, `unreachable`,
//!   `timeout`, `bad_answer` or `client_secret`, 400 `bad_request`.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CACHE_CONTROL;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::AdminState;
use crate::token_exchange::{ExchangeError, Exchanger, MAX_TOKEN_BYTES};

/// The largest request: the token and a name, with room for the JSON around them.
const MAX_REQUEST_BYTES: usize = MAX_TOKEN_BYTES + 1024;

pub fn routes() -> Router<AdminState> {
    Router::new().route("/v1/token-exchange", post(exchange))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExchangeRequest {
    service: String,
    subject_token: String,
}

async fn exchange(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    if let Err(e) = s.reports.check(&headers) {
        return e.into_response();
    }
    answer(&s.exchanger, &body).await
}

/// The answer to a filter whose report token was checked.
async fn answer(exchanger: &Exchanger, body: &[u8]) -> axum::response::Response {
    let r = match parse(body) {
        Ok(r) => r,
        Err(why) => {
            return respond(
                StatusCode::BAD_REQUEST,
                json!({"failure": "bad_request", "why": why}),
            )
        }
    };
    match exchanger.exchange(&r.service, &r.subject_token).await {
        Ok(x) => respond(
            StatusCode::OK,
            json!({
                "header": x.header,
                "value": x.value.expose(),
                "use_for_ms": u64::try_from(x.use_for.as_millis()).unwrap_or(u64::MAX),
            }),
        ),
        Err(e) => {
            let status = match e {
                ExchangeError::NotConfigured => StatusCode::NOT_FOUND,
                _ => StatusCode::BAD_GATEWAY,
            };
            let mut body = json!({"failure": e.code(), "why": e.why(&r.service)});
            if let ExchangeError::Refused { error, .. } = &e {
                body["error"] = json!(error);
            }
            respond(status, body)
        }
    }
}

/// The request, or why it is not one. The messages never quote the token.
fn parse(body: &[u8]) -> Result<ExchangeRequest, String> {
    if body.len() > MAX_REQUEST_BYTES {
        return Err(format!(
            "the request is larger than {MAX_REQUEST_BYTES} bytes"
        ));
    }
    // serde takes a struct from an array too (`["orders", "t"]`): only an object is one.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err("not a token exchange request: a JSON object is expected".to_string());
    }
    let r: ExchangeRequest =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(body))
            .map_err(|e| format!("not a token exchange request: {e}"))?;
    toolgate_model::validate_name("service", &r.service).map_err(|e| format!("service: {e}"))?;
    if r.subject_token.is_empty() || r.subject_token.len() > MAX_TOKEN_BYTES {
        return Err(format!(
            "subject_token: 1 to {MAX_TOKEN_BYTES} bytes, got {}",
            r.subject_token.len()
        ));
    }
    Ok(r)
}

/// Every answer, a credential or not, is the caller's alone: nothing may keep it.
fn respond(status: StatusCode, body: serde_json::Value) -> axum::response::Response {
    (status, [(CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_exchange::tests::{Setup, AUDIENCE};
    use crate::token_exchange::Limits;

    async fn call(x: &Exchanger, body: serde_json::Value) -> (StatusCode, serde_json::Value) {
        let response = answer(x, body.to_string().as_bytes()).await;
        let status = response.status();
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("a body");
        (status, serde_json::from_slice(&bytes).expect("JSON"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_filter_gets_the_header_or_why_not() {
        let s = Setup::new("admin").await;
        let x = s.exchanger(Limits::default());
        let subject = s.subject("alice");
        let (status, body) = call(&x, json!({"service": "orders", "subject_token": subject})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["header"], "authorization");
        assert!(body["value"]
            .as_str()
            .expect("value")
            .starts_with("Bearer ey"));
        let ms = body["use_for_ms"].as_u64().expect("ms");
        assert!((268_000..=270_000).contains(&ms), "{ms}");
        assert_eq!(body.as_object().expect("object").len(), 3);

        let (status, body) = call(&x, json!({"service": "stock", "subject_token": subject})).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(
            body,
            json!({"failure": "not_configured", "why": "stock has no token exchange configured"})
        );

        s.issuer.refuse_target(AUDIENCE);
        let (status, body) = call(
            &x,
            json!({"service": "orders", "subject_token": s.subject("bob")}),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(body["failure"], "refused");
        assert_eq!(body["error"], "invalid_target");
        assert_eq!(
            body["why"],
            "the identity provider refused to issue a token for orders: invalid_target"
        );

        for bad in [
            json!({"service": "orders"}),
            json!({"service": "orders", "subject_token": ""}),
            json!({"service": "orders", "subject_token": "t", "audience": "x"}),
            json!({"service": "a/b", "subject_token": "t"}),
            json!({"service": "orders", "subject_token": "a".repeat(MAX_TOKEN_BYTES + 1)}),
            json!(["orders", "t"]),
            json!("orders"),
        ] {
            let (status, body) = call(&x, bad.clone()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
            assert_eq!(body["failure"], "bad_request");
        }
        let huge = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert_eq!(answer(&x, &huge).await.status(), StatusCode::BAD_REQUEST);
    }
}
