//! Writes what the fleet shares to etcd: breaker openings reported by this gateway's filters
//! (leased for the open duration, one key per tool whoever writes first) and the operator's
//! overrides and policies from the admin API. Every toolgate-xds reads them back through its
//! watch, like registrations, and hands them to its Envoys over ECDS.

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use serde::Serialize;
use toolgate_model::fleet::{
    BreakerEvent, BreakerEvents, EventState, FleetOpen, Override, OverrideMode,
};
use toolgate_model::validate_name;
use tracing::{debug, info, warn};

use crate::metrics::{FleetLabel, Metrics};
use crate::registry::{parse_override, Registry};

/// The longest fleet opening accepted.
const MAX_OPEN_MS: u64 = 3_600_000;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// An admin request that cannot be served, with the status and the reason to show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminError {
    pub status: StatusCode,
    pub message: String,
}

impl AdminError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        AdminError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn etcd(what: &str, e: impl std::fmt::Display) -> Self {
        AdminError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("{what}: etcd did not accept the write ({e}); nothing changed"),
        }
    }
}

/// What became of one reported breaker event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EventOutcome {
    pub service: String,
    pub tool: String,
    pub result: &'static str,
}

#[derive(Clone)]
pub struct FleetWriter {
    pub client: crate::etcd::LazyClient,
    pub registry: Arc<RwLock<Registry>>,
    pub metrics: Arc<Metrics>,
    pub timeout: Duration,
}

impl FleetWriter {
    fn layout(&self) -> toolgate_model::KeyLayout {
        self.registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .layout()
            .clone()
    }

    /// Applies the breaker transitions one filter reported.
    pub async fn breaker_events(&self, body: BreakerEvents) -> Vec<EventOutcome> {
        let mut out = Vec::with_capacity(body.events.len());
        for event in body.events {
            let result = match (
                validate_name("service", &event.service),
                validate_name("tool", &event.tool),
            ) {
                (Ok(()), Ok(())) => match event.state {
                    EventState::Open => self.opened(&body.gateway, &event).await,
                    EventState::Closed => self.closed(&body.gateway, &event).await,
                },
                _ => "invalid_name",
            };
            let action = match event.state {
                EventState::Open => "open",
                EventState::Closed => "close",
            };
            self.metrics
                .fleet_writes
                .get_or_create(&FleetLabel { action, result })
                .inc();
            out.push(EventOutcome {
                service: event.service,
                tool: event.tool,
                result,
            });
        }
        out
    }

    /// Writes `<prefix>breakers/<service>/<tool>` unless the fleet already has it open: the
    /// compare makes concurrent openings by several gateways leave one key, and an event
    /// this gateway received (and applied) is never written back.
    async fn opened(&self, gateway: &str, e: &BreakerEvent) -> &'static str {
        let now = now_ms();
        let names = (e.service.clone(), e.tool.clone());
        let (known, forced_closed, layout) = {
            let reg = self.registry.read().unwrap_or_else(|p| p.into_inner());
            (
                reg.fleet().get(&names).cloned(),
                reg.overrides()
                    .get(&names)
                    .is_some_and(|o| o.mode == OverrideMode::ForceClosed),
                reg.layout().clone(),
            )
        };
        if forced_closed {
            return "skipped_force_closed";
        }
        if known.as_ref().is_some_and(|k| k.open.until_ms > now) {
            return "already_open";
        }
        // A filter's open duration is capped by its policy (5 min by default); an hour bounds
        // what a bogus report could do.
        let open_ms = e.open_ms.clamp(1, MAX_OPEN_MS);
        let key = layout.breaker_key(&e.service, &e.tool);
        let value = FleetOpen {
            until_ms: now + open_ms,
            opened_by: gateway.to_string(),
            opened_at_ms: now,
        };
        let mut client = match self.client.get().await {
            Ok(c) => c,
            Err(err) => {
                warn!(key, error = %err, "cannot share a breaker opening: no etcd client");
                return "etcd_error";
            }
        };
        // etcd's lease TTL is whole seconds; the value's until_ms is what the filters obey.
        let ttl = open_ms.div_ceil(1000) as i64;
        let lease = match tokio::time::timeout(self.timeout, client.lease_grant(ttl, None)).await {
            Ok(Ok(l)) => l.id(),
            Ok(Err(err)) => {
                warn!(key, error = %err, "cannot share a breaker opening: lease grant failed");
                return "etcd_error";
            }
            Err(_) => {
                warn!(
                    key,
                    "cannot share a breaker opening: etcd did not answer in time"
                );
                return "etcd_error";
            }
        };
        let compare = match &known {
            Some(k) => Compare::mod_revision(key.as_str(), CompareOp::Equal, k.mod_revision),
            None => Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
        };
        let txn = Txn::new().when([compare]).and_then([TxnOp::put(
            key.as_str(),
            serde_json::to_string(&value).unwrap_or_default(),
            Some(PutOptions::new().with_lease(lease)),
        )]);
        match tokio::time::timeout(self.timeout, client.txn(txn)).await {
            Ok(Ok(resp)) if resp.succeeded() => {
                info!(
                    key,
                    gateway, open_ms, "shared a breaker opening with the fleet"
                );
                "written"
            }
            other => {
                // Someone wrote first (or etcd failed): the lease holds nothing of ours.
                let result = match other {
                    Ok(Ok(_)) => "lost_race",
                    _ => "etcd_error",
                };
                debug!(key, gateway, result, "breaker opening not written");
                tokio::spawn(async move {
                    let _ = client.lease_revoke(lease).await;
                });
                result
            }
        }
    }

    /// Removes the fleet opening when this gateway closed the tool again, but only its own
    /// opening or one already past its time: another gateway's fresh opening stands.
    async fn closed(&self, gateway: &str, e: &BreakerEvent) -> &'static str {
        let names = (e.service.clone(), e.tool.clone());
        let (known, layout) = {
            let reg = self.registry.read().unwrap_or_else(|p| p.into_inner());
            (reg.fleet().get(&names).cloned(), reg.layout().clone())
        };
        let Some(known) = known else {
            return "nothing_open";
        };
        if known.open.opened_by != gateway && known.open.until_ms > now_ms() {
            return "kept_other_gateways_opening";
        }
        let key = layout.breaker_key(&e.service, &e.tool);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                known.mod_revision,
            )])
            .and_then([TxnOp::delete(key.as_str(), None)]);
        let Ok(mut client) = self.client.get().await else {
            return "etcd_error";
        };
        match tokio::time::timeout(self.timeout, client.txn(txn)).await {
            Ok(Ok(resp)) if resp.succeeded() => "deleted",
            Ok(Ok(_)) => "lost_race",
            _ => "etcd_error",
        }
    }

    pub async fn put_override(
        &self,
        service: &str,
        tool: &str,
        mut o: Override,
    ) -> Result<Override, AdminError> {
        names(service, tool)?;
        o.at_ms = now_ms();
        if o.author.trim().is_empty() {
            o.author = "operator".into();
        }
        let raw = serde_json::to_vec(&o).unwrap_or_default();
        parse_override(&raw).map_err(AdminError::bad_request)?;
        let key = self.layout().override_key(service, tool);
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd("override", e))?;
        tokio::time::timeout(self.timeout, client.put(key.as_str(), raw, None))
            .await
            .map_err(|_| AdminError::etcd("override", "timed out"))?
            .map_err(|e| AdminError::etcd("override", e))?;
        info!(key, mode = o.mode.as_str(), reason = %o.reason, author = %o.author, "override set");
        Ok(o)
    }

    /// `Ok(false)` when there was no such override.
    pub async fn delete_override(&self, service: &str, tool: &str) -> Result<bool, AdminError> {
        names(service, tool)?;
        let key = self.layout().override_key(service, tool);
        self.delete(&key, "override").await
    }

    /// Writes a policy after checking it exactly as the watch will.
    pub async fn put_policy(
        &self,
        service: &str,
        tool: Option<&str>,
        raw: &[u8],
    ) -> Result<(), AdminError> {
        let key = policy_key(&self.layout(), service, tool)?;
        self.registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .check(&key, raw)
            .map_err(|r| AdminError::bad_request(r.detail))?;
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd("policy", e))?;
        let resp = tokio::time::timeout(self.timeout, client.put(key.as_str(), raw.to_vec(), None))
            .await
            .map_err(|_| AdminError::etcd("policy", "timed out"))?
            .map_err(|e| AdminError::etcd("policy", e))?;
        info!(key, "policy set");
        if let Some(header) = resp.header() {
            self.applied(header.revision()).await;
        }
        Ok(())
    }

    /// Waits (up to the etcd timeout) until the registry has applied etcd's revision
    /// `revision`: the next policy change is checked against this one, so an operator's
    /// `PUT orders` followed at once by `PUT orders/pay`, which needs it, is not refused.
    async fn applied(&self, revision: i64) {
        let deadline = tokio::time::Instant::now() + self.timeout;
        while self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .revision()
            < revision
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Deletes a policy, unless another depends on it: a tool's policy may need its service's
    /// (an `open_ms` above the default `max_open_ms`), and a configuration with an invalid
    /// merged policy is one the filters refuse. Refused with the dependent key and why. The
    /// check holds at etcd too: the delete happens only if no policy of the service's tools
    /// changed since the revision the check saw.
    pub async fn delete_policy(
        &self,
        service: &str,
        tool: Option<&str>,
    ) -> Result<bool, AdminError> {
        let layout = self.layout();
        let key = policy_key(&layout, service, tool)?;
        let revision = {
            let reg = self.registry.read().unwrap_or_else(|p| p.into_inner());
            reg.check_policy_delete(&key)
                .map_err(|r| AdminError::bad_request(format!("{}: {}", r.key, r.detail)))?;
            reg.revision()
        };
        // Nothing is laid over a tool's policy: only a service's has dependents to compare.
        let dependents = format!("{key}/");
        let compares: Vec<Compare> = match tool {
            Some(_) => Vec::new(),
            None => vec![
                Compare::mod_revision(dependents.as_str(), CompareOp::Less, revision + 1)
                    .with_prefix(),
            ],
        };
        let txn = Txn::new()
            .when(compares)
            .and_then([TxnOp::delete(key.as_str(), None)]);
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd("policy", e))?;
        let resp = tokio::time::timeout(self.timeout, client.txn(txn))
            .await
            .map_err(|_| AdminError::etcd("policy", "timed out"))?
            .map_err(|e| AdminError::etcd("policy", e))?;
        if !resp.succeeded() {
            return Err(AdminError {
                status: StatusCode::CONFLICT,
                message: format!(
                    "{key}: a policy of one of its tools changed meanwhile; nothing was \
                     deleted, try again"
                ),
            });
        }
        let deleted = resp
            .op_responses()
            .iter()
            .any(|op| matches!(op, etcd_client::TxnOpResponse::Delete(d) if d.deleted() > 0));
        if deleted {
            info!(key, "policy lifted");
        }
        if let Some(header) = resp.header() {
            self.applied(header.revision()).await;
        }
        Ok(deleted)
    }

    /// Writes call limits after checking them exactly as the watch will: a bad value answers
    /// 400 naming the field (`rules[0].per_seconds: ...`), and nothing is written.
    pub async fn put_limits(
        &self,
        service: &str,
        tool: Option<&str>,
        raw: &[u8],
    ) -> Result<(), AdminError> {
        let key = limit_key(&self.layout(), service, tool)?;
        self.registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .check(&key, raw)
            .map_err(|r| AdminError::bad_request(r.detail))?;
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd("limits", e))?;
        let resp = tokio::time::timeout(self.timeout, client.put(key.as_str(), raw.to_vec(), None))
            .await
            .map_err(|_| AdminError::etcd("limits", "timed out"))?
            .map_err(|e| AdminError::etcd("limits", e))?;
        info!(key, "limits set");
        // A `GET /v1/limits` right after the answer shows them.
        if let Some(header) = resp.header() {
            self.applied(header.revision()).await;
        }
        Ok(())
    }

    /// Lifts call limits. `Ok(false)` when there were none.
    pub async fn delete_limits(
        &self,
        service: &str,
        tool: Option<&str>,
    ) -> Result<bool, AdminError> {
        let key = limit_key(&self.layout(), service, tool)?;
        self.delete(&key, "limits").await
    }

    /// Writes a value the caller has checked exactly as the watch will (a virtual server).
    pub async fn put_raw(&self, key: &str, raw: &[u8], what: &str) -> Result<(), AdminError> {
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd(what, e))?;
        tokio::time::timeout(self.timeout, client.put(key, raw.to_vec(), None))
            .await
            .map_err(|_| AdminError::etcd(what, "timed out"))?
            .map_err(|e| AdminError::etcd(what, e))?;
        info!(key, "{what} set");
        Ok(())
    }

    /// `Ok(false)` when there was no such key.
    pub async fn delete(&self, key: &str, what: &str) -> Result<bool, AdminError> {
        let mut client = self
            .client
            .get()
            .await
            .map_err(|e| AdminError::etcd(what, e))?;
        let resp = tokio::time::timeout(self.timeout, client.delete(key, None))
            .await
            .map_err(|_| AdminError::etcd(what, "timed out"))?
            .map_err(|e| AdminError::etcd(what, e))?;
        if resp.deleted() > 0 {
            info!(key, "{what} lifted");
        }
        Ok(resp.deleted() > 0)
    }
}

fn names(service: &str, tool: &str) -> Result<(), AdminError> {
    validate_name("service", service).map_err(|e| AdminError::bad_request(e.to_string()))?;
    validate_name("tool", tool).map_err(|e| AdminError::bad_request(e.to_string()))
}

/// `<prefix>limits/<service>[/<tool>]`, the names checked: a bad one answers 400 naming it.
fn limit_key(
    layout: &toolgate_model::KeyLayout,
    service: &str,
    tool: Option<&str>,
) -> Result<String, AdminError> {
    validate_name("service", service).map_err(|e| AdminError::bad_request(e.to_string()))?;
    if let Some(t) = tool {
        validate_name("tool", t).map_err(|e| AdminError::bad_request(e.to_string()))?;
    }
    Ok(layout.limit_key(service, tool))
}

fn policy_key(
    layout: &toolgate_model::KeyLayout,
    service: &str,
    tool: Option<&str>,
) -> Result<String, AdminError> {
    validate_name("service", service).map_err(|e| AdminError::bad_request(e.to_string()))?;
    Ok(match tool {
        Some(t) => {
            validate_name("tool", t).map_err(|e| AdminError::bad_request(e.to_string()))?;
            format!("{}{service}/{t}", layout.policies_prefix())
        }
        None => format!("{}{service}", layout.policies_prefix()),
    })
}
