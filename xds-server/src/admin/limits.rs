//! `/v1/limits`: call limits (`<prefix>limits/<service>[/<tool>]`, see
//! `toolgate_model::limits`), those in force and the keys whose value in etcd is refused;
//! changed with the admin token.
//!
//! A refused body answers 400 with the field it is about (`{"error": "rules[0].per_seconds: 0
//! is not in 1..=2592000", "field": "rules[0].per_seconds"}`), as `/v1/virtual` does.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use toolgate_model::limits::{LimitError, Limits};
use toolgate_model::validate_name;

use super::virtual_servers::Refusal;
use super::AdminState;
use crate::registry::BAD_LIMITS;

/// Callers shown in `top_limited`: the most refused over the last ten minutes, as this
/// toolgate-xds's Envoys reported them.
const TOP_LIMITED: usize = 20;

impl From<LimitError> for Refusal {
    fn from(e: LimitError) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            error: e.to_string(),
            field: Some(e.field),
        }
    }
}

/// The limits in force, each rule with the label replies, metrics and logs use; and the keys
/// etcd holds a refused value at (`kept`: the key's last good value is still in force).
pub async fn list(State(s): State<AdminState>) -> impl IntoResponse {
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    let limits: Vec<Value> = reg
        .stored_limits()
        .map(|(service, tool, l)| json!({"service": service, "tool": tool, "rules": rules(l)}))
        .collect();
    let refused: Vec<Value> = reg
        .refused_limits()
        .map(|(key, detail)| {
            let kept = reg
                .layout()
                .parse_limit_key(key)
                .is_ok_and(|(service, tool)| {
                    reg.stored_limits()
                        .any(|(sv, tl, _)| sv == service && tl == tool.as_deref())
                });
            json!({"key": key, "reason": BAD_LIMITS, "detail": detail, "kept": kept})
        })
        .collect();
    drop(reg);
    let top = s.limited.top(TOP_LIMITED, std::time::Instant::now());
    Json(json!({
        "etcd_up": s.etcd.is_up(),
        "limits": limits,
        "refused": refused,
        "top_limited": top,
    }))
}

/// The rules as stored, each with its label.
fn rules(limits: &Limits) -> Vec<Value> {
    limits
        .rules
        .iter()
        .map(|r| {
            let mut v = json!(r);
            v["label"] = r.label().into();
            v
        })
        .collect()
}

pub async fn put_service(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    put(&s, &headers, &service, None, &body).await
}

pub async fn put_tool(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    put(&s, &headers, &service, Some(&tool), &body).await
}

pub async fn delete_service(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
) -> Response {
    delete(&s, &headers, &service, None).await
}

pub async fn delete_tool(
    State(s): State<AdminState>,
    Path((service, tool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    delete(&s, &headers, &service, Some(&tool)).await
}

async fn put(
    s: &AdminState,
    headers: &HeaderMap,
    service: &str,
    tool: Option<&str>,
    body: &[u8],
) -> Response {
    let stored = async {
        s.token.check(headers)?;
        names(service, tool)?;
        // Parsed here for the field at fault; the writer checks it again exactly as the
        // watch will before anything reaches etcd.
        let limits = Limits::parse(body)?;
        s.fleet.put_limits(service, tool, body).await?;
        Ok::<_, Refusal>(limits)
    }
    .await;
    match stored {
        Ok(limits) => Json(json!({
            "service": service,
            "tool": tool,
            "stored": true,
            "rules": rules(&limits),
        }))
        .into_response(),
        Err(r) => r.into_response(),
    }
}

async fn delete(
    s: &AdminState,
    headers: &HeaderMap,
    service: &str,
    tool: Option<&str>,
) -> Response {
    let deleted = async {
        s.token.check(headers)?;
        names(service, tool)?;
        Ok::<_, Refusal>(s.fleet.delete_limits(service, tool).await?)
    }
    .await;
    match deleted {
        Ok(true) => {
            Json(json!({"service": service, "tool": tool, "deleted": true})).into_response()
        }
        Ok(false) => Refusal {
            status: StatusCode::NOT_FOUND,
            error: format!(
                "no limits for {service}{}",
                tool.map(|t| format!("/{t}")).unwrap_or_default()
            ),
            field: None,
        }
        .into_response(),
        Err(r) => r.into_response(),
    }
}

/// The service and tool names of the path, checked: a bad one is refused naming it.
fn names(service: &str, tool: Option<&str>) -> Result<(), Refusal> {
    let bad = |field: &str, e: toolgate_model::NameError| Refusal {
        status: StatusCode::BAD_REQUEST,
        error: e.to_string(),
        field: Some(field.to_string()),
    };
    validate_name("service", service).map_err(|e| bad("service", e))?;
    if let Some(t) = tool {
        validate_name("tool", t).map_err(|e| bad("tool", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_value_names_its_field() {
        let err = Limits::parse(br#"{"per": "subject", "calls": 1, "per_seconds": 0}"#)
            .expect_err("refused");
        let r = Refusal::from(err);
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.error, "rules[0].per_seconds: 0 is not in 1..=2592000");
        assert_eq!(r.field.as_deref(), Some("rules[0].per_seconds"));
        let Err(r) = names("orders", Some("pa y")) else {
            panic!("a bad tool name is refused")
        };
        assert_eq!(r.field.as_deref(), Some("tool"));
        assert!(r.error.contains("tool name \"pa y\""), "{}", r.error);
    }

    #[test]
    fn each_rule_shows_its_label() {
        let l = Limits::parse(
            br#"{"rules": [{"per": "subject", "calls": 60, "per_seconds": 60},
                           {"per": "gateway", "calls": 9, "per_seconds": 1, "name": "spike"}]}"#,
        )
        .expect("valid");
        let shown = rules(&l);
        assert_eq!(
            shown[0],
            json!({"per": "subject", "calls": 60, "per_seconds": 60, "label": "subject-60-per-60s"})
        );
        assert_eq!(shown[1]["label"], "spike");
        assert_eq!(shown[1]["name"], "spike");
    }
}
