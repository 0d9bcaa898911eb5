//! The bridge's state and what the HTTP side asks of it: opening, restarting and ending
//! sessions, picking a pool server, answering a probe.

use std::collections::VecDeque;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{info, warn};

use super::child::{self, Fault, Spawned};
use super::link::{Audience, Link, Route, Speaks};
use super::pool::{self, Slot};
use super::session::{short, Session, Sessions};
use super::wire;
use super::Options;
use crate::restart::{Decision, Restarts};

/// How long a request waits for a pool or shared server that is (re)starting.
const READY_WAIT: Duration = Duration::from_secs(30);
/// How long one step of ending a session's server may take (input closed, then SIGTERM).
const SESSION_STOP_GRACE: Duration = Duration::from_secs(2);

/// A refusal of the bridge's own, as a JSON-RPC error and the HTTP status it goes with.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
    pub retry_after: Option<u64>,
}

impl Refusal {
    pub fn new(status: u16, code: i64, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            code,
            message: message.into(),
            data: None,
            retry_after: None,
        }
    }

    /// A session the bridge does not know (any more): the client initializes again.
    pub fn session_not_found(why: &str) -> Refusal {
        Refusal::new(
            404,
            wire::SESSION_NOT_FOUND,
            format!("Session not found: {why}; initialize a new session"),
        )
    }

    /// No server can take the request now.
    pub fn unavailable(why: String) -> Refusal {
        let mut r = Refusal::new(503, wire::INTERNAL_ERROR, why);
        r.retry_after = Some(1);
        r
    }

    pub fn body(&self, id: Option<&Value>) -> Value {
        wire::error_with(id, self.code, self.message.clone(), self.data.clone())
    }
}

/// Why the bridge cannot go on.
#[derive(Debug, Clone)]
pub struct Fatal {
    pub why: String,
    /// The exit of the server that ended it, when one did.
    pub status: Option<ExitStatus>,
}

pub struct Core {
    pub options: Options,
    pub sessions: Arc<Sessions>,
    pub pool: Vec<Arc<Slot>>,
    pub shared: Option<Arc<Slot>>,
    spares: Mutex<VecDeque<Spawned>>,
    era: watch::Sender<Speaks>,
    /// Which pool slot learns what the command speaks.
    learner: Mutex<Option<usize>>,
    fatal: watch::Sender<Option<Fatal>>,
    stopping: watch::Sender<bool>,
}

impl Core {
    pub fn new(options: Options) -> Arc<Core> {
        let sessions = Arc::new(Sessions::new(options.max_sessions));
        let pool = (0..options.pool.max(1))
            .map(|i| {
                Slot::new(
                    format!("pool-{}", i + 1),
                    pool::SlotKind::Pool,
                    options.hang_timeout,
                    Audience::Nobody,
                )
            })
            .collect();
        let shared = options.shared.then(|| {
            Slot::new(
                "shared".into(),
                pool::SlotKind::Shared,
                options.hang_timeout,
                Audience::Everyone(Arc::downgrade(&sessions)),
            )
        });
        Arc::new(Core {
            options,
            sessions,
            pool,
            shared,
            spares: Mutex::new(VecDeque::new()),
            era: watch::channel(Speaks::Unknown).0,
            learner: Mutex::new(None),
            fatal: watch::channel(None).0,
            stopping: watch::channel(false).0,
        })
    }

    /// Starts the slots' servers, the spares and the idle sweep.
    pub fn start(self: &Arc<Self>) {
        for slot in self.pool.iter().chain(self.shared.iter()) {
            tokio::spawn(pool::supervise(Arc::clone(self), Arc::clone(slot)));
        }
        self.refill_spares();
        tokio::spawn(sweep(Arc::clone(self)));
    }

    pub fn spawn_child(&self) -> std::io::Result<Spawned> {
        child::spawn(
            &self.options.command,
            self.options.max_message_bytes,
            queue_bytes(self.options.max_message_bytes),
        )
    }

    /// What the command speaks, as far as known.
    pub fn era(&self) -> Speaks {
        *self.era.borrow()
    }

    pub fn set_era(&self, speaks: Speaks) {
        self.era.send_replace(speaks);
    }

    /// Whether `slot` is the one that finds out what the command speaks (the first to ask).
    pub fn learns_era(&self, slot: &Slot) -> bool {
        let me = self
            .pool
            .iter()
            .position(|s| std::ptr::eq(Arc::as_ptr(s), slot));
        let mut learner = self.learner.lock().unwrap_or_else(|p| p.into_inner());
        match (*learner, me) {
            (None, Some(i)) => {
                *learner = Some(i);
                true
            }
            (Some(l), Some(i)) => l == i,
            _ => false,
        }
    }

    pub async fn era_known(&self) {
        let mut rx = self.era.subscribe();
        let _ = rx.wait_for(|s| *s != Speaks::Unknown).await;
    }

    pub fn fail(&self, why: String, status: Option<ExitStatus>) {
        warn!("the stdio bridge cannot go on: {why}");
        self.fatal.send_if_modified(|f| {
            let first = f.is_none();
            if first {
                *f = Some(Fatal { why, status });
            }
            first
        });
    }

    pub async fn failed(&self) -> Fatal {
        let mut rx = self.fatal.subscribe();
        loop {
            if let Some(f) = rx.borrow_and_update().clone() {
                return f;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    pub async fn stopping(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// A server for a new session: a spare one if one is fit, else a new one.
    fn take_child(&self) -> std::io::Result<Spawned> {
        let spare = {
            let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
            let mut found = None;
            while let Some(s) = spares.pop_front() {
                if s.untouched() {
                    found = Some(s);
                    break;
                }
                // It said something or ended before it had a client: dropped (and so ended).
                info!(
                    pid = s.pid,
                    "a spare stdio server was not fit to take a session"
                );
            }
            found
        };
        match spare {
            Some(s) => Ok(s),
            None => self.spawn_child(),
        }
    }

    /// Keeps `--spares` servers started ahead of the sessions that will need them.
    fn refill_spares(&self) {
        if self.options.shared || self.is_stopping() {
            return;
        }
        let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
        while spares.len() < self.options.spares {
            match self.spawn_child() {
                Ok(s) => spares.push_back(s),
                Err(e) => {
                    warn!(error = %e, "cannot start a spare stdio server");
                    break;
                }
            }
        }
    }

    fn restarts(&self) -> Restarts {
        Restarts::new(self.options.restart, self.options.restart_limits)
    }

    /// Opens a session for a client's `initialize` (`message`): the answer, and the new
    /// session's id when the server accepted.
    pub async fn open_session(&self, message: Value) -> Result<(Value, Option<String>), Refusal> {
        let place = self.sessions.reserve().ok_or_else(|| {
            let mut r = Refusal::new(
                503,
                wire::INTERNAL_ERROR,
                format!(
                    "this stdio server has {} sessions open, as many as --max-sessions allows; \
                     try again later, or another instance",
                    self.sessions.max
                ),
            );
            r.retry_after = Some(1);
            r.data = Some(
                json!({wire::FAULT_DATA_KEY: {"limit": "max_sessions", "max": self.sessions.max}}),
            );
            r
        })?;
        let params = message.get("params").cloned().unwrap_or(json!({}));
        let id = new_session_id();
        if let Some(shared) = &self.shared {
            let info = shared.wait_ready(READY_WAIT).await.map_err(|why| {
                Refusal::unavailable(format!("the shared stdio server is not ready: {why}"))
            })?;
            let requested = params["protocolVersion"].as_str().unwrap_or_default();
            // The HTTP side speaks every 2025 revision; the server's messages are the
            // revision it was opened with, which older clients read too.
            let version = if wire::LEGACY.contains(&requested) {
                requested.to_string()
            } else {
                info["protocolVersion"]
                    .as_str()
                    .unwrap_or(wire::LEGACY[0])
                    .to_string()
            };
            let mut result = (*info).clone();
            result["protocolVersion"] = json!(version);
            let session = Arc::new(Session::new(
                id.clone(),
                shared.link.clone(),
                false,
                params,
                self.restarts(),
            ));
            self.sessions.insert(place, session);
            info!(session = %short(&id), %version, "session opened on the shared stdio server");
            let client_id = message.get("id").cloned().unwrap_or(Value::Null);
            return Ok((wire::result(&client_id, result), Some(id)));
        }

        let spawned = self.take_child().map_err(|e| {
            Refusal::unavailable(format!(
                "cannot start the stdio server {:?}: {e}",
                self.options.command
            ))
        })?;
        let pid = spawned.pid;
        let link = Link::new(
            format!("session-{}", short(&id)),
            self.options.hang_timeout,
            Audience::Nobody,
        );
        link.attach(spawned);
        self.refill_spares();
        let route = Route {
            session: None,
            related: None,
            modern: false,
            cancel_on_drop: false,
        };
        let waiter = link.call(message, route).map_err(|e| {
            Refusal::unavailable(
                e.pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("the stdio server is gone")
                    .to_string(),
            )
        })?;
        let timeout = self.options.startup_timeout;
        let answer = match tokio::time::timeout(timeout, waiter.wait()).await {
            Ok(a) => a,
            Err(_) => {
                let why = format!(
                    "no answer to initialize within {}",
                    humantime::format_duration(timeout)
                );
                link.kill(Fault::Handshake(why.clone()));
                return Err(Refusal::unavailable(format!(
                    "the stdio server (pid {pid}) gave {why}"
                )));
            }
        };
        let version = match answer
            .pointer("/result/protocolVersion")
            .and_then(Value::as_str)
        {
            Some(v) => v.to_string(),
            None => {
                // Refused (or broken): the client hears the server's answer; no session.
                link.stop(SESSION_STOP_GRACE);
                return Ok((answer, None));
            }
        };
        let session = Arc::new(Session::new(
            id.clone(),
            link.clone(),
            true,
            params,
            self.restarts(),
        ));
        link.set_audience(Audience::Owner(Arc::downgrade(&session)));
        link.set_speaks(Speaks::Legacy, None);
        self.sessions.insert(place, session);
        info!(session = %short(&id), pid, %version, "session opened on a stdio server of its own");
        Ok((answer, Some(id)))
    }

    /// Ends a session: its calls are answered, its server (its own) is stopped.
    pub fn end_session(&self, session: &Arc<Session>, why: &str) {
        self.sessions.remove(&session.id);
        session.end(why);
        session.link.drop_session(&session.id, why);
        if session.own_child {
            session.link.stop(SESSION_STOP_GRACE);
        }
        info!(session = %short(&session.id), "session ended: {why}");
    }

    /// The session's server, restarted first if it ended (as `--restart` says; a session whose
    /// server is not restarted ends).
    pub async fn session_link(&self, session: &Arc<Session>) -> Result<Link, Refusal> {
        if let Some(why) = session.ended() {
            return Err(Refusal::session_not_found(&why));
        }
        if session.link.alive() {
            return Ok(session.link.clone());
        }
        if !session.own_child {
            return match &self.shared {
                Some(shared) => shared
                    .wait_ready(READY_WAIT)
                    .await
                    .map(|_| shared.link.clone())
                    .map_err(|why| {
                        Refusal::unavailable(format!("the shared stdio server is not ready: {why}"))
                    }),
                None => Err(Refusal::unavailable("no shared stdio server".into())),
            };
        }
        let mut restarts = session.restarts.lock().await;
        if session.link.alive() {
            return Ok(session.link.clone());
        }
        if let Some(why) = session.ended() {
            return Err(Refusal::session_not_found(&why));
        }
        let Some(end) = session.link.last_end() else {
            return Err(Refusal::unavailable(
                "the session's stdio server is not running".into(),
            ));
        };
        let policy = restarts.policy();
        match restarts.after_exit(end.failed(), end.ran, rand::random()) {
            Decision::Exit => {
                let why = format!(
                    "{}, and --restart {policy} does not start it again",
                    end.describe()
                );
                self.end_session(session, &why);
                Err(Refusal::session_not_found(&why))
            }
            Decision::GiveUp { exits } => {
                let why = format!(
                    "{}: it ended {exits} times in a row soon after it started; not started again \
                     (--restart-limit {})",
                    end.describe(),
                    restarts.limits().limit
                );
                self.end_session(session, &why);
                Err(Refusal::session_not_found(&why))
            }
            Decision::Restart { delay, nth } => {
                warn!(session = %short(&session.id), restart = nth, delay_ms = delay.as_millis() as u64,
                    "{}; starting the session's server again (--restart {policy})", end.describe());
                tokio::time::sleep(delay).await;
                let spawned = self.take_child().map_err(|e| {
                    Refusal::unavailable(format!("cannot start the stdio server again: {e}"))
                })?;
                session.link.attach(spawned);
                self.refill_spares();
                let opened = session
                    .link
                    .request(
                        "initialize",
                        session.init.clone(),
                        self.options.startup_timeout,
                    )
                    .await;
                match opened {
                    Ok(_) => {
                        session.link.send(
                            &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                        );
                        session.link.set_speaks(Speaks::Legacy, None);
                        info!(session = %short(&session.id), pid = session.link.pid().unwrap_or(0),
                            "the session's stdio server was started again and opened with the client's initialize");
                        Ok(session.link.clone())
                    }
                    Err(e) => {
                        let why = format!("initialize again: {e}");
                        session.link.kill(Fault::Handshake(why.clone()));
                        Err(Refusal::unavailable(format!(
                            "the session's stdio server was started again but did not open: {why}"
                        )))
                    }
                }
            }
        }
    }

    /// A pool server for a 2026-07-28 request: the least busy ready one (waiting a while for
    /// one that is starting).
    pub async fn pool_link(&self) -> Result<(Link, Arc<Value>), Refusal> {
        let deadline = tokio::time::Instant::now() + READY_WAIT.min(self.options.startup_timeout);
        loop {
            let best = self
                .pool
                .iter()
                .filter_map(|s| s.info().map(|info| (s, info)))
                .min_by_key(|(s, _)| s.link.load());
            if let Some((slot, info)) = best {
                return Ok((slot.link.clone(), info));
            }
            if tokio::time::Instant::now() >= deadline {
                let why = self
                    .pool
                    .iter()
                    .find_map(|s| match s.readiness() {
                        pool::Readiness::Down(why) => Some(why),
                        _ => None,
                    })
                    .unwrap_or_else(|| "it is still starting".into());
                return Err(Refusal::unavailable(format!(
                    "no stdio server is ready: {why}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The bridge's `server/discover`: a pool server is pinged first, so that a wedged server
    /// fails the probe and leaves rotation.
    pub async fn discover(&self) -> Result<Value, Refusal> {
        let (link, info) = self.pool_link().await?;
        let hang = self.options.hang_timeout;
        let ping = tokio::spawn(async move { link.ping(hang).await });
        match ping.await {
            Ok(Ok(_)) => Ok(pool::discover_result(&info)),
            Ok(Err(why)) => Err(Refusal::unavailable(why)),
            Err(e) => Err(Refusal::unavailable(format!("the ping failed: {e}"))),
        }
    }

    /// Ends every session and server, waiting (within the stop timeout's steps) for them to
    /// exit.
    pub async fn shutdown(&self) {
        self.stopping.send_replace(true);
        let mut links: Vec<Link> = Vec::new();
        for s in self.sessions.all() {
            if s.own_child {
                links.push(s.link.clone());
            }
            self.end_session(&s, "the bridge stops");
        }
        // Dropped spares are ended at once: they never had a client.
        self.spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let grace = self.options.stop_timeout;
        for slot in self.pool.iter().chain(self.shared.iter()) {
            slot.link.stop(grace);
            links.push(slot.link.clone());
        }
        // Each server gets its grace, SIGTERM, then as long again before SIGKILL.
        let _ = tokio::time::timeout(grace * 2 + Duration::from_secs(3), async {
            while links.iter().any(Link::alive) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
}

/// How many bytes may wait to be written to one server: two of the largest messages, and
/// never less than 16 MiB.
fn queue_bytes(max_message: usize) -> usize {
    max_message
        .saturating_mul(2)
        .saturating_add(64 * 1024)
        .max(16 << 20)
}

/// 128 random bits, hex: unguessable, and visible ASCII as MCP wants a session id.
fn new_session_id() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}

/// Ends the sessions unused for `--session-idle-timeout`.
async fn sweep(core: Arc<Core>) {
    let idle = core.options.session_idle_timeout;
    if idle.is_zero() {
        return;
    }
    let every = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = core.stopping() => return,
        }
        for s in core.sessions.idle(idle) {
            core.end_session(
                &s,
                &format!(
                    "unused for {} (--session-idle-timeout)",
                    humantime::format_duration(idle)
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_long_and_visible_ascii() {
        let a = new_session_id();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_session_id());
    }

    #[test]
    fn a_queue_holds_two_of_the_largest_messages() {
        assert_eq!(queue_bytes(4 << 20), 16 << 20);
        assert_eq!(queue_bytes(64 << 20), (128 << 20) + 64 * 1024);
    }
}
