//! `/v1/virtual`: the virtual servers (issue 19), what each offers under which name, and their
//! definitions in etcd (`<prefix>virtual/<name>`), changed with the admin token.
//!
//! A refused definition answers 400 with the field it is about (`{"error": "...", "field":
//! "services[1]"}`), so a script or the console can point at it. Besides what the watch refuses
//! (see `VirtualServer::validate`), the API refuses services that are not registered: a typo
//! there would silently offer nothing. A definition written to etcd directly may name them (a
//! service may be between instances); the watch admits it with a warning.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use toolgate_model::virtual_server::{VirtualError, VirtualServer, DEFAULT_VIRTUAL};

use super::AdminState;
use crate::fleet::AdminError;
use toolgate_model::envoy::{AGGREGATE_PATH, VIRTUAL_PATH_PREFIX};

/// A refusal naming the field it is about (also `/v1/auth`'s).
pub(super) struct Refusal {
    pub(super) status: StatusCode,
    pub(super) error: String,
    pub(super) field: Option<String>,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut body = json!({"error": self.error});
        if let Some(field) = self.field {
            body["field"] = field.into();
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<AdminError> for Refusal {
    fn from(e: AdminError) -> Self {
        Refusal {
            status: e.status,
            error: e.message,
            field: None,
        }
    }
}

impl From<VirtualError> for Refusal {
    fn from(e: VirtualError) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            error: e.message,
            field: Some(e.field),
        }
    }
}

/// Every virtual server: its definition (stored, or the built-in default), where it is
/// served, the names it offers and what each calls, and the tools it could not name.
pub async fn list(State(s): State<AdminState>) -> impl IntoResponse {
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    let resolved = reg.virtual_routes();
    let (routes, unnamed) = &*resolved;
    let stored: Vec<&String> = reg.stored_virtual_servers().map(|(n, _)| n).collect();
    let list: Vec<Value> = reg
        .virtual_servers()
        .into_iter()
        .map(|(name, vs)| {
            let mut paths = vec![format!("{VIRTUAL_PATH_PREFIX}{name}")];
            if name == DEFAULT_VIRTUAL {
                paths.insert(0, AGGREGATE_PATH.to_string());
            }
            let tools: serde_json::Map<String, Value> = routes
                .get(&name)
                .map(|r| {
                    r.tools
                        .iter()
                        .map(|(visible, t)| {
                            (visible.clone(), format!("{}/{}", t.service, t.tool).into())
                        })
                        .collect()
                })
                .unwrap_or_default();
            let not_offered: Vec<Value> = unnamed
                .iter()
                .filter(|(vs, _)| *vs == name)
                .map(|(_, u)| json!({"service": u.service, "tool": u.tool, "reason": u.reason}))
                .collect();
            json!({
                "name": name,
                "stored": stored.contains(&&name),
                "paths": paths,
                "definition": vs,
                "tools": tools,
                "unnamed": not_offered,
            })
        })
        .collect();
    Json(json!({"etcd_up": s.etcd.is_up(), "virtual_servers": list}))
}

/// Checks a definition as the watch will, and that its services are registered, then writes
/// it to etcd; every toolgate-xds takes it from its watch.
pub async fn put(
    State(s): State<AdminState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match put_checked(&s, &name, &headers, &body).await {
        Ok(vs) => Json(json!({"name": name, "stored": true, "definition": vs})).into_response(),
        Err(r) => r.into_response(),
    }
}

async fn put_checked(
    s: &AdminState,
    name: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<VirtualServer, Refusal> {
    s.token.check(headers)?;
    let key = key_of(s, name)?;
    let vs = VirtualServer::parse(body)?;
    {
        let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
        for (i, service) in vs.services.iter().enumerate() {
            if !reg.has_service(service) {
                return Err(VirtualError {
                    field: format!("services[{i}]"),
                    message: format!(
                        "no such service is registered: {service:?} (GET /v1/registry lists them)"
                    ),
                }
                .into());
            }
        }
        // What the watch will say of it (the same parse, so only a surprise lands here).
        reg.check(&key, body)
            .map_err(|r| AdminError::bad_request(r.detail))?;
    }
    s.fleet.put_raw(&key, body, "virtual server").await?;
    Ok(vs)
}

pub async fn delete(
    State(s): State<AdminState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let deleted = async {
        s.token.check(&headers)?;
        let key = key_of(&s, &name)?;
        Ok::<_, Refusal>(s.fleet.delete(&key, "virtual server").await?)
    }
    .await;
    match deleted {
        Ok(true) => Json(json!({"name": name, "deleted": true})).into_response(),
        Ok(false) => Refusal {
            status: StatusCode::NOT_FOUND,
            error: format!("no virtual server {name:?} is stored"),
            field: None,
        }
        .into_response(),
        Err(r) => r.into_response(),
    }
}

/// `<prefix>virtual/<name>`, the name checked like a service name.
fn key_of(s: &AdminState, name: &str) -> Result<String, Refusal> {
    let layout = s
        .registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .layout()
        .clone();
    let key = format!("{}{name}", layout.virtual_prefix());
    layout.parse_virtual_key(&key).map_err(|e| Refusal {
        status: StatusCode::BAD_REQUEST,
        error: e.to_string(),
        field: Some("name".to_string()),
    })?;
    Ok(key)
}
