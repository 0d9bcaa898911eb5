//! `GET /ready` for orchestrators: 200 while the instance is registered (its key in etcd with
//! a live lease), 503 before, after a lost lease until it is registered again, and while it
//! deregisters. A Kubernetes readiness probe on it ties the pod's readiness to the
//! registration, so a rollout waits until new pods are routable before stopping old ones.

use std::future::Future;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::watch;

use crate::RegistrationEvent;

/// Where the registration stands, as `/ready` tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Waiting for the server's health check or for etcd.
    Starting,
    /// The key is in etcd under this lease.
    Registered { key: String, lease: i64 },
    /// The keepalive stream broke; the lease still holds the key for the rest of its TTL.
    Reconnecting { key: String, lease: i64 },
    /// The lease expired while etcd was out of reach; registering again.
    LeaseLost { key: String },
    /// Deregistering before the process stops.
    Stopping,
    /// Deregistered because the server refuses connections (crashed or stopped beside a
    /// registrar that runs on); registered again once it accepts them and passes its probe.
    ServerGone { why: String },
    /// Deregistered because the wrapped server exited; it is started again (`--restart`,
    /// restart `nth` in a row) and registered once it passes its probe.
    Restarting { exited: String, nth: u32 },
}

impl Readiness {
    /// What a registration event means for readiness.
    pub fn from_event(key: &str, event: RegistrationEvent) -> Readiness {
        let key = key.to_string();
        match event {
            RegistrationEvent::Alive { lease } => Readiness::Registered { key, lease },
            RegistrationEvent::Reconnecting { lease } => Readiness::Reconnecting { key, lease },
            RegistrationEvent::LeaseLost { .. } => Readiness::LeaseLost { key },
        }
    }

    fn answer(&self) -> (StatusCode, serde_json::Value) {
        let lease = |l: &i64| format!("{l:x}");
        match self {
            Readiness::Starting => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"state": "starting"}),
            ),
            Readiness::Registered { key, lease: l } => (
                StatusCode::OK,
                json!({"state": "registered", "key": key, "lease": lease(l)}),
            ),
            Readiness::Reconnecting { key, lease: l } => (
                StatusCode::OK,
                json!({"state": "reconnecting", "key": key, "lease": lease(l)}),
            ),
            Readiness::LeaseLost { key } => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"state": "lease_lost", "key": key}),
            ),
            Readiness::Stopping => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"state": "stopping"}),
            ),
            Readiness::ServerGone { why } => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"state": "server_gone", "why": why}),
            ),
            Readiness::Restarting { exited, nth } => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"state": "restarting", "exited": exited, "restart": nth}),
            ),
        }
    }
}

async fn ready(State(state): State<watch::Receiver<Readiness>>) -> impl IntoResponse {
    let (status, body) = state.borrow().answer();
    (status, Json(body))
}

/// Serves `GET /ready` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: watch::Receiver<Readiness>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new().route("/ready", get(ready)).with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_held_lease_is_ready() {
        let key = "/mcp/services/s/i";
        let alive = Readiness::from_event(key, RegistrationEvent::Alive { lease: 255 });
        assert_eq!(alive.answer().0, StatusCode::OK);
        assert_eq!(alive.answer().1["lease"], "ff");
        let reconnecting =
            Readiness::from_event(key, RegistrationEvent::Reconnecting { lease: 255 });
        assert_eq!(reconnecting.answer().0, StatusCode::OK);
        let lost = Readiness::from_event(key, RegistrationEvent::LeaseLost { lease: 255 });
        assert_eq!(lost.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            Readiness::Starting.answer().0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            Readiness::Stopping.answer().0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        let gone = Readiness::ServerGone {
            why: "Connection refused".into(),
        };
        assert_eq!(gone.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(gone.answer().1["state"], "server_gone");
        let restarting = Readiness::Restarting {
            exited: "signal: 9 (SIGKILL)".into(),
            nth: 2,
        };
        assert_eq!(restarting.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(restarting.answer().1["state"], "restarting");
        assert_eq!(restarting.answer().1["restart"], 2);
    }
}
