//! `/v1/auth`: who may call (issue 20). The auth configuration (`<prefix>auth/config`), the
//! rule sets of services (`<prefix>auth/rules/<service>`) and of virtual servers
//! (`<prefix>auth/virtual/<name>`), the credentials toward the servers
//! (`<prefix>auth/upstream/<service>`), and, for every service and virtual server, whether it
//! requires a token, which rules it has and, for a service, its credential. Changes need the
//! admin token, like every change.
//!
//! A credential is a reference to a secret (`file:<path>`, `env:<variable>`), never the
//! secret: what is stored, shown and answered here names where the secret is, and toolgate-xds
//! reads it elsewhere (`crate::upstream_credentials`), so no answer of this API can hold it.
//!
//! A refused value answers 400 with the field it is about (`{"error": "...", "field":
//! "issuers[0].jwks.remote.uri"}`), as `/v1/virtual` does. Unlike a virtual server, a rule
//! set may name a service that is not registered (the answer warns of it): rules written
//! before a service first registers are the safe order, since it is then never served
//! without them.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use toolgate_model::auth::{AuthConfig, AuthError, ToolRules, ALL};
use toolgate_model::upstream_auth::UpstreamCredential;
use toolgate_model::virtual_server::DEFAULT_VIRTUAL;

use super::virtual_servers::Refusal;
use super::AdminState;
use crate::registry::Registry;

impl From<AuthError> for Refusal {
    fn from(e: AuthError) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            error: e.message,
            field: Some(e.field),
        }
    }
}

/// What `<prefix>auth/` holds, and what it means for each service and virtual server.
pub async fn get(State(s): State<AdminState>) -> impl IntoResponse {
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    let mut body = view(&reg);
    body["etcd_up"] = s.etcd.is_up().into();
    Json(body)
}

/// The body of `GET /v1/auth` (without `etcd_up`). Every known service and virtual server is
/// listed, and every one a rule set or a credential names (`registered`/`defined` false then).
/// `requires_token` is what the filter enforces: with a configuration, a service named in
/// `required` and one with a rule set refuse a caller without a valid token (see
/// `FilterAuth::decide_service`); without one, nothing does. A service's `upstream` is its
/// credential toward its servers (the reference, not the secret), or null.
pub fn view(reg: &Registry) -> Value {
    let config = reg.auth_config();
    let requires =
        |name: &str, has_rules: bool| config.is_some_and(|c| c.requires(name) || has_rules);
    let mut services = Map::new();
    for name in reg.service_names() {
        services.insert(name.clone(), json!({"registered": true}));
    }
    for (name, rules) in reg.auth_service_rules() {
        let entry = services
            .entry(name.clone())
            .or_insert_with(|| json!({"registered": false}));
        entry["rules"] = json!(rules);
    }
    for (name, credential) in reg.auth_upstreams() {
        let entry = services
            .entry(name.clone())
            .or_insert_with(|| json!({"registered": false}));
        entry["upstream"] = json!(credential);
    }
    for (name, entry) in services.iter_mut() {
        let has_rules = entry.get("rules").is_some();
        entry["requires_token"] = requires(name, has_rules).into();
        if !has_rules {
            entry["rules"] = Value::Null;
        }
        if entry.get("upstream").is_none() {
            entry["upstream"] = Value::Null;
        }
    }
    let mut virtuals = Map::new();
    for name in reg.virtual_servers().into_keys() {
        virtuals.insert(name, json!({"defined": true}));
    }
    for (name, rules) in reg.auth_virtual_rules() {
        let entry = virtuals
            .entry(name.clone())
            .or_insert_with(|| json!({"defined": false}));
        entry["rules"] = json!(rules);
    }
    for (name, entry) in virtuals.iter_mut() {
        let has_rules = entry.get("rules").is_some();
        entry["requires_token"] = requires(name, has_rules).into();
        if !has_rules {
            entry["rules"] = Value::Null;
        }
    }
    let rules_stored =
        reg.auth_service_rules().next().is_some() || reg.auth_virtual_rules().next().is_some();
    json!({
        "configured": config.is_some(),
        "config": config,
        // Rule sets without a configuration are kept but not applied.
        "rules_unused": config.is_none() && rules_stored,
        "services": services,
        "virtual_servers": virtuals,
    })
}

pub async fn put_config(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    let done = async {
        s.token.check(&headers)?;
        let key = layout(&s).auth_config_key();
        let config = AuthConfig::parse(&body)?;
        let warnings = {
            let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
            config
                .required
                .iter()
                .filter(|n| *n != ALL && !known(&reg, n, true) && !known(&reg, n, false))
                .map(|n| {
                    format!(
                        "{n:?} is no service or virtual server yet; it requires a token once it is"
                    )
                })
                .collect::<Vec<_>>()
        };
        store(&s, &key, &body, "auth configuration").await?;
        Ok::<_, Refusal>(json!({"stored": true, "config": config, "warnings": warnings}))
    }
    .await;
    answer(done)
}

pub async fn delete_config(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    if let Err(e) = s.token.check(&headers) {
        return Refusal::from(e).into_response();
    }
    let key = layout(&s).auth_config_key();
    remove(
        &s,
        &key,
        "auth configuration",
        "no auth configuration is stored",
    )
    .await
}

pub async fn put_service_rules(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    put_rules(&s, &headers, &service, true, &body).await
}

pub async fn delete_service_rules(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
) -> Response {
    delete_rules(&s, &headers, &service, true).await
}

pub async fn put_virtual_rules(
    State(s): State<AdminState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    put_rules(&s, &headers, &name, false, &body).await
}

pub async fn delete_virtual_rules(
    State(s): State<AdminState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    delete_rules(&s, &headers, &name, false).await
}

/// `GET /v1/auth/upstream/{service}`: the credential as stored (a reference to the secret),
/// ready to be edited and put back; 404 without one.
pub async fn get_upstream(State(s): State<AdminState>, Path(service): Path<String>) -> Response {
    let reg = s.registry.read().unwrap_or_else(|p| p.into_inner());
    match upstream_of(&reg, &service) {
        Some(credential) => Json(json!(credential)).into_response(),
        None => no_upstream(&service).into_response(),
    }
}

/// `PUT /v1/auth/upstream/{service}`: checked as the watch admits it, a bad one refused with
/// 400 naming the field. The secret is not read here: every toolgate-xds reads it itself
/// (and logs it when it cannot).
pub async fn put_upstream(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let done = async {
        s.token.check(&headers)?;
        let key = named_key(&layout(&s), &service, Named::Upstream)?;
        let credential = UpstreamCredential::parse(&body)?;
        let known = known(
            &s.registry.read().unwrap_or_else(|p| p.into_inner()),
            &service,
            true,
        );
        let warnings: Vec<String> = if known {
            Vec::new()
        } else {
            vec![format!(
                "no service {service:?} is registered; the credential is used when it registers"
            )]
        };
        store(&s, &key, &body, "upstream credential").await?;
        Ok::<_, Refusal>(
            json!({"name": service, "stored": true, "upstream": credential,
            "warnings": warnings}),
        )
    }
    .await;
    answer(done)
}

pub async fn delete_upstream(
    State(s): State<AdminState>,
    Path(service): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = s.token.check(&headers) {
        return Refusal::from(e).into_response();
    }
    let key = match named_key(&layout(&s), &service, Named::Upstream) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    remove(
        &s,
        &key,
        "upstream credential",
        &no_upstream(&service).error,
    )
    .await
}

/// The credential toward `service`'s servers, as admitted from etcd.
fn upstream_of<'r>(reg: &'r Registry, service: &str) -> Option<&'r UpstreamCredential> {
    reg.auth_upstreams()
        .find(|(name, _)| *name == service)
        .map(|(_, c)| c)
}

fn no_upstream(service: &str) -> Refusal {
    Refusal {
        status: StatusCode::NOT_FOUND,
        error: format!("no upstream credential is stored for the service {service:?}"),
        field: None,
    }
}

/// A rule set of a service (`service`) or of a virtual server.
async fn put_rules(
    s: &AdminState,
    headers: &HeaderMap,
    name: &str,
    service: bool,
    body: &[u8],
) -> Response {
    let done = async {
        s.token.check(headers)?;
        let key = named_key(&layout(s), name, Named::rules(service))?;
        let rules = ToolRules::parse(body)?;
        let known = known(
            &s.registry.read().unwrap_or_else(|p| p.into_inner()),
            name,
            service,
        );
        let warnings: Vec<String> = if known {
            Vec::new()
        } else if service {
            vec![format!(
                "no service {name:?} is registered; the rules apply when it registers"
            )]
        } else {
            vec![format!(
                "no virtual server {name:?} is defined; the rules apply when it is"
            )]
        };
        store(s, &key, body, "auth rule set").await?;
        Ok::<_, Refusal>(
            json!({"name": name, "stored": true, "rules": rules, "warnings": warnings}),
        )
    }
    .await;
    answer(done)
}

async fn delete_rules(s: &AdminState, headers: &HeaderMap, name: &str, service: bool) -> Response {
    if let Err(e) = s.token.check(headers) {
        return Refusal::from(e).into_response();
    }
    let key = match named_key(&layout(s), name, Named::rules(service)) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let what = if service { "service" } else { "virtual server" };
    remove(
        s,
        &key,
        "auth rule set",
        &format!("no rule set is stored for the {what} {name:?}"),
    )
    .await
}

/// Checks the value as the watch will admit it, then writes it to etcd: every toolgate-xds
/// (this one included) takes it from its watch.
async fn store(s: &AdminState, key: &str, body: &[u8], what: &str) -> Result<(), Refusal> {
    s.registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .check(key, body)
        .map_err(|r| crate::fleet::AdminError::bad_request(r.detail))?;
    s.fleet.put_raw(key, body, what).await?;
    Ok(())
}

/// Deletes `key` from etcd (the caller checked the token); 404 saying `missing` when it was
/// not there.
async fn remove(s: &AdminState, key: &str, what: &str, missing: &str) -> Response {
    match s.fleet.delete(key, what).await {
        Ok(true) => Json(json!({"key": key, "deleted": true})).into_response(),
        Ok(false) => Refusal {
            status: StatusCode::NOT_FOUND,
            error: missing.to_string(),
            field: None,
        }
        .into_response(),
        Err(e) => Refusal::from(e).into_response(),
    }
}

fn answer(done: Result<Value, Refusal>) -> Response {
    match done {
        Ok(body) => Json(body).into_response(),
        Err(r) => r.into_response(),
    }
}

fn layout(s: &AdminState) -> toolgate_model::KeyLayout {
    s.registry
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .layout()
        .clone()
}

/// What a key under `<prefix>auth/` names.
#[derive(Debug, Clone, Copy)]
enum Named {
    /// `<prefix>auth/rules/<service>`
    ServiceRules,
    /// `<prefix>auth/virtual/<name>`
    VirtualRules,
    /// `<prefix>auth/upstream/<service>`
    Upstream,
}

impl Named {
    fn rules(service: bool) -> Named {
        if service {
            Named::ServiceRules
        } else {
            Named::VirtualRules
        }
    }
}

/// The key of `name`'s rule set or credential, the name checked as the watch checks it.
fn named_key(
    layout: &toolgate_model::KeyLayout,
    name: &str,
    what: Named,
) -> Result<String, Refusal> {
    let key = match what {
        Named::ServiceRules => layout.auth_rules_key(name),
        Named::VirtualRules => layout.auth_virtual_key(name),
        Named::Upstream => layout.auth_upstream_key(name),
    };
    layout.parse_auth_key(&key).map_err(|e| Refusal {
        status: StatusCode::BAD_REQUEST,
        error: e.to_string(),
        field: Some("name".to_string()),
    })?;
    Ok(key)
}

/// Whether a service is known (`service`), or a virtual server is offered.
fn known(reg: &Registry, name: &str, service: bool) -> bool {
    if service {
        reg.has_service(name)
    } else {
        name == DEFAULT_VIRTUAL || reg.stored_virtual_servers().any(|(n, _)| n == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_model::KeyLayout;

    const AUTH: &[u8] = br#"{"resource": "http://gw", "authorization_servers": ["http://idp"],
        "required": ["inv"],
        "issuers": [{"issuer": "http://idp", "jwks": {"remote": {"uri": "http://idp/jwks"}}}]}"#;
    const READERS: &[u8] = br#"{"rules": [{"tools": ["read_*"], "roles": ["reader"]}]}"#;
    const INV_CREDENTIAL: &[u8] =
        br#"{"header": "X-Api-Key", "format": "{secret}", "secret": "env:INV_KEY"}"#;
    const V1: &[u8] = br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9001","tools":["a"]}"#;

    #[test]
    fn the_view_says_who_requires_a_token_and_with_which_rules() {
        let mut r = Registry::new(KeyLayout::default());
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/services/stock/i-1", V1, 7, 3, 3).unwrap();
        r.put("/mcp/auth/rules/stock", READERS, 0, 4, 4).unwrap();
        r.put("/mcp/auth/rules/later", READERS, 0, 5, 5).unwrap();
        let v = view(&r);
        assert_eq!(v["configured"], false);
        assert_eq!(v["config"], Value::Null);
        assert_eq!(v["rules_unused"], true);
        assert_eq!(v["services"]["inv"]["requires_token"], false);
        assert_eq!(
            v["services"]["stock"]["requires_token"], false,
            "rules without a configuration are not applied"
        );

        r.put("/mcp/auth/config", AUTH, 0, 6, 6).unwrap();
        r.put("/mcp/auth/virtual/ops", READERS, 0, 7, 7).unwrap();
        let v = view(&r);
        assert_eq!(v["configured"], true);
        assert_eq!(v["rules_unused"], false);
        assert_eq!(v["config"]["resource"], "http://gw");
        assert_eq!(
            v["services"]["inv"],
            json!({"registered": true, "requires_token": true, "rules": null, "upstream": null})
        );
        // Not in `required`, but a rule set refuses callers without a token.
        assert_eq!(v["services"]["stock"]["requires_token"], true);
        assert_eq!(
            v["services"]["stock"]["rules"]["rules"][0]["tools"],
            json!(["read_*"])
        );
        assert_eq!(v["services"]["later"]["registered"], false);
        assert_eq!(
            v["virtual_servers"]["default"],
            json!({"defined": true, "requires_token": false, "rules": null})
        );
        assert_eq!(v["virtual_servers"]["ops"]["defined"], false);
        assert_eq!(v["virtual_servers"]["ops"]["requires_token"], true);
    }

    #[test]
    fn the_view_shows_each_service_s_credential_as_a_reference() {
        let mut r = Registry::new(KeyLayout::default());
        r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
        r.put("/mcp/services/stock/i-1", V1, 7, 3, 3).unwrap();
        r.put("/mcp/auth/upstream/inv", INV_CREDENTIAL, 0, 4, 4)
            .unwrap();
        r.put(
            "/mcp/auth/upstream/later",
            br#"{"secret": "file:/run/secrets/later"}"#,
            0,
            5,
            5,
        )
        .unwrap();
        let v = view(&r);
        assert_eq!(
            v["services"]["inv"]["upstream"],
            json!({"header": "x-api-key", "format": "{secret}", "secret": "env:INV_KEY"})
        );
        assert_eq!(v["services"]["inv"]["registered"], true);
        assert_eq!(v["services"]["inv"]["rules"], Value::Null);
        assert_eq!(
            v["services"]["inv"]["requires_token"], false,
            "a credential toward the servers asks nothing of the callers"
        );
        assert_eq!(v["services"]["stock"]["upstream"], Value::Null);
        assert_eq!(
            v["services"]["later"],
            json!({"registered": false, "requires_token": false, "rules": null,
                "upstream": {"header": "authorization", "format": "Bearer {secret}",
                    "secret": "file:/run/secrets/later"}})
        );
        assert_eq!(v["rules_unused"], false, "a credential is no rule set");

        // What GET answers can be put back as it is.
        let got = upstream_of(&r, "later").expect("stored");
        let again = serde_json::to_vec(got).expect("serializes");
        assert_eq!(UpstreamCredential::parse(&again).as_ref(), Ok(got));
        assert!(upstream_of(&r, "stock").is_none());
        assert_eq!(no_upstream("stock").status, StatusCode::NOT_FOUND);

        r.delete("/mcp/auth/upstream/later").unwrap();
        assert!(view(&r)["services"].get("later").is_none());
    }

    #[test]
    fn a_credential_is_refused_naming_its_field_and_its_name_is_checked() {
        for (value, field) in [
            (&br#"{"secret": "s3cret"}"#[..], "secret"),
            (br#"{"secret": "env:A", "header": "Host"}"#, "header"),
            (br#"{"secret": "env:A", "format": "Bearer"}"#, "format"),
            (br#"{"secret": "env:A", "value": "s3cret"}"#, "value"),
            (b"not json", "value"),
        ] {
            let r = Refusal::from(UpstreamCredential::parse(value).unwrap_err());
            assert_eq!(r.status, StatusCode::BAD_REQUEST);
            assert_eq!(r.field.as_deref(), Some(field), "{}", r.error);
        }
        let layout = KeyLayout::default();
        assert_eq!(
            named_key(&layout, "orders", Named::Upstream)
                .ok()
                .as_deref(),
            Some("/mcp/auth/upstream/orders")
        );
        assert_eq!(
            named_key(&layout, "orders", Named::rules(true))
                .ok()
                .as_deref(),
            Some("/mcp/auth/rules/orders")
        );
        assert_eq!(
            named_key(&layout, "ops", Named::rules(false))
                .ok()
                .as_deref(),
            Some("/mcp/auth/virtual/ops")
        );
        for bad in ["", "a/b", "a b"] {
            let r = named_key(&layout, bad, Named::Upstream).expect_err(bad);
            assert_eq!(r.status, StatusCode::BAD_REQUEST);
            assert_eq!(r.field.as_deref(), Some("name"));
        }
    }

    #[test]
    fn an_auth_error_is_a_refusal_naming_its_field() {
        let e = AuthConfig::parse(b"{\"resource\": 1}").unwrap_err();
        let r = Refusal::from(e);
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.field.as_deref(), Some("resource"));
    }
}
