//! The servers the bridge keeps running itself, each in a slot that restarts it as
//! `--restart` says: the pool that answers 2026-07-28 requests (and the probes), and the one
//! server every session shares with `--shared`.
//!
//! The first pool server tells what the command speaks: asked `server/discover` in
//! 2026-07-28 terms, a server of that revision lists it (the official Python SDK decides a
//! connection's revision on its first request), and every later pool server is sent
//! 2026-07-28 requests as they are. A server that refuses the method speaks an earlier
//! revision: the bridge opens it with `initialize` (and so every later one), and writes each
//! 2026-07-28 request to it without the revision's envelope.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{info, warn};

use super::child::Fault;
use super::core::Core;
use super::link::{Audience, CallError, Link, Speaks};
use super::wire;
use crate::restart::{Decision, Restarts};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// Serves 2026-07-28 requests and probes.
    Pool,
    /// The one server of every session (`--shared`).
    Shared,
}

/// Where a slot's server stands.
#[derive(Debug, Clone)]
pub enum Readiness {
    Starting,
    /// Serving; what its handshake answered (`initialize` or `server/discover` result).
    Ready(Arc<Value>),
    /// Ended, waiting to be restarted: why.
    Down(String),
}

pub struct Slot {
    pub link: Link,
    pub kind: SlotKind,
    ready: watch::Sender<Readiness>,
}

impl Slot {
    pub fn new(
        name: String,
        kind: SlotKind,
        hang_timeout: Duration,
        audience: Audience,
    ) -> Arc<Slot> {
        Arc::new(Slot {
            link: Link::new(name, hang_timeout, audience),
            kind,
            ready: watch::channel(Readiness::Starting).0,
        })
    }

    pub fn readiness(&self) -> Readiness {
        self.ready.borrow().clone()
    }

    /// What the handshake answered, once the server is ready (and alive).
    pub fn info(&self) -> Option<Arc<Value>> {
        match self.readiness() {
            Readiness::Ready(info) if self.link.alive() => Some(info),
            _ => None,
        }
    }

    /// Waits up to `within` for the server to be ready.
    pub async fn wait_ready(&self, within: Duration) -> Result<Arc<Value>, String> {
        let mut rx = self.ready.subscribe();
        let waited = tokio::time::timeout(within, async {
            loop {
                if let Some(info) = self.info() {
                    return info;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        waited.map_err(|_| match self.readiness() {
            Readiness::Down(why) => why,
            _ => format!(
                "the stdio server was not ready within {}",
                humantime::format_duration(within)
            ),
        })
    }
}

/// Keeps the slot's server running: starts it, opens it, waits for its end, and restarts it
/// as the policy says; a policy that gives up ends the bridge.
pub async fn supervise(core: Arc<Core>, slot: Arc<Slot>) {
    let mut restarts = Restarts::new(core.options.restart, core.options.restart_limits);
    loop {
        slot.ready.send_replace(Readiness::Starting);
        if slot.kind == SlotKind::Pool && core.era() == Speaks::Unknown && !core.learns_era(&slot) {
            core.era_known().await;
        }
        let seen = slot.link.ends_so_far();
        match core.spawn_child() {
            Ok(spawned) => {
                slot.link.attach(spawned);
                match handshake(&core, &slot).await {
                    Ok(info) => {
                        info!(slot = slot.link.name(), pid = slot.link.pid().unwrap_or(0), speaks = ?slot.link.speaks(), "stdio server ready");
                        slot.ready.send_replace(Readiness::Ready(Arc::new(info)));
                    }
                    Err(why) => {
                        warn!(slot = slot.link.name(), "{why}");
                        slot.link.kill(Fault::Handshake(why));
                    }
                }
            }
            Err(e) => {
                let why = format!(
                    "cannot start the stdio server {:?}: {e}",
                    core.options.command
                );
                core.fail(why, None);
                return;
            }
        }
        let end = tokio::select! {
            end = slot.link.wait_end(seen) => end,
            () = core.stopping() => return,
        };
        let Some(end) = end else { return };
        let why = end.describe();
        slot.ready.send_replace(Readiness::Down(why.clone()));
        if core.is_stopping() {
            return;
        }
        let policy = restarts.policy();
        match restarts.after_exit(end.failed(), end.ran, rand::random()) {
            Decision::Restart { delay, nth } => {
                warn!(
                    slot = slot.link.name(),
                    restart = nth,
                    delay_ms = delay.as_millis() as u64,
                    "{why}; restarting it (--restart {policy})"
                );
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = core.stopping() => return,
                }
            }
            Decision::Exit => {
                core.fail(
                    format!("{why}, and --restart {policy} does not start it again"),
                    end.status,
                );
                return;
            }
            Decision::GiveUp { exits } => {
                let limits = restarts.limits();
                core.fail(
                    format!(
                        "{why}: giving up after {exits} exits in a row, each less than {} after \
                         it started (--restart-window), with --restart-limit {}",
                        humantime::format_duration(limits.window),
                        limits.limit
                    ),
                    end.status,
                );
                return;
            }
        }
    }
}

/// Opens a fresh server of the slot; what its handshake answered.
async fn handshake(core: &Core, slot: &Slot) -> Result<Value, String> {
    let link = &slot.link;
    let timeout = core.options.startup_timeout;
    if slot.kind == SlotKind::Shared {
        // Every session's calls run on this one server: it may ask whoever calls it (the
        // bridge answers for a client that cannot), but has no roots, which are a client's.
        let caps = json!({"elicitation": {}, "sampling": {}});
        return initialize(link, caps, timeout).await;
    }
    match core.era() {
        Speaks::Legacy => initialize(link, json!({}), timeout).await,
        Speaks::Modern => {
            link.set_speaks(Speaks::Modern, None);
            discover(link, timeout)
                .await
                .map_err(|e| format!("server/discover: {e}"))
        }
        Speaks::Unknown => match discover(link, timeout).await {
            Ok(result) if lists_modern(&result) => {
                link.set_speaks(Speaks::Modern, None);
                core.set_era(Speaks::Modern);
                info!(
                    "the stdio server speaks {}: 2026-07-28 requests go to it as they are",
                    wire::MODERN
                );
                Ok(result)
            }
            Ok(_) | Err(CallError::Rpc(_)) => {
                let answer = initialize(link, json!({}), timeout).await?;
                core.set_era(Speaks::Legacy);
                info!(version = answer["protocolVersion"].as_str().unwrap_or("?"),
                    "the stdio server speaks a revision with initialize: 2026-07-28 requests go to it without the envelope");
                Ok(answer)
            }
            Err(e) => Err(format!("server/discover: {e}")),
        },
    }
}

fn lists_modern(discover: &Value) -> bool {
    discover["supportedVersions"]
        .as_array()
        .is_some_and(|v| v.iter().any(|v| v == wire::MODERN))
}

/// `server/discover` in 2026-07-28 terms (the envelope given here: before the handshake the
/// link adds none of its own).
async fn discover(link: &Link, timeout: Duration) -> Result<Value, CallError> {
    let params = json!({"_meta": wire::envelope()});
    link.request("server/discover", params, timeout).await
}

/// `initialize` as the newest revision with it, then `notifications/initialized`.
async fn initialize(link: &Link, capabilities: Value, timeout: Duration) -> Result<Value, String> {
    let params = json!({
        "protocolVersion": wire::LEGACY[0],
        "capabilities": capabilities,
        "clientInfo": wire::client_info(),
    });
    let answer = link
        .request("initialize", params, timeout)
        .await
        .map_err(|e| format!("initialize: {e}"))?;
    link.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    link.set_speaks(Speaks::Legacy, answer.get("serverInfo").cloned());
    Ok(answer)
}

/// What a ready pool server tells of itself, as a `server/discover` result of the bridge:
/// every revision the bridge serves, the server's capabilities and name.
pub fn discover_result(info: &Value) -> Value {
    let server_info = info
        .pointer(&format!(
            "/_meta/{}",
            wire::SERVER_INFO_META.replace('/', "~1")
        ))
        .or_else(|| info.get("serverInfo"))
        .cloned()
        .unwrap_or(json!({"name": "stdio", "version": ""}));
    let mut result = json!({
        "supportedVersions": wire::served(),
        "capabilities": info.get("capabilities").cloned().unwrap_or(json!({})),
        "resultType": "complete",
        "_meta": {wire::SERVER_INFO_META: server_info},
    });
    if let Some(i) = info.get("instructions") {
        result["instructions"] = i.clone();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bridge_lists_every_revision_with_the_servers_name_and_capabilities() {
        let legacy = json!({"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
            "serverInfo": {"name": "memory-server", "version": "0.6.3"}});
        let r = discover_result(&legacy);
        assert_eq!(r["supportedVersions"][0], wire::MODERN);
        assert_eq!(r["supportedVersions"].as_array().map(Vec::len), Some(4));
        assert_eq!(r["capabilities"]["tools"], json!({}));
        assert_eq!(r["_meta"][wire::SERVER_INFO_META]["name"], "memory-server");
        let modern = json!({"supportedVersions": ["2026-07-28"], "capabilities": {},
            "_meta": {wire::SERVER_INFO_META: {"name": "py"}}, "instructions": "hi"});
        let r = discover_result(&modern);
        assert_eq!(r["_meta"][wire::SERVER_INFO_META]["name"], "py");
        assert_eq!(r["instructions"], "hi");
        assert!(lists_modern(&modern) && !lists_modern(&legacy));
    }
}
