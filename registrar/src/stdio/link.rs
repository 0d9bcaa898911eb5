//! The bridge's JSON-RPC connection to one server process, whichever process serves it now.
//!
//! Every request written to the server gets an id of the link's own (a counter), and a
//! progress token is replaced by that id too: so the answers of many sessions sharing one
//! server never mix, and a progress notification finds the call it belongs to exactly. The
//! answer goes back with the client's id and token.
//!
//! What the server sends on its own is routed by what it carries: a progress notification by
//! its token; a `notifications/cancelled` to the session the cancelled request was sent to;
//! list changes to every session of the server; anything else (a server-to-client request, a
//! log message) to the session whose call has waited longest (MCP over stdio does not say which
//! request such a message belongs to; a server with one session has no doubt). A `ping` from
//! the server the bridge answers itself.
//!
//! When the process ends, every call waiting on it gets a JSON-RPC error naming what happened.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::child::{Control, Ended, Event, Fault, Input, SendError, Spawned};
use super::session::{Session, Sessions};
use super::wire::{self, Kind};

/// What the server speaks, which decides how a 2026-07-28 client's request is written to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaks {
    /// Not known yet (before the bridge's handshake).
    Unknown,
    /// `initialize` and a session: the 2026-07-28 envelope is taken off, and results get
    /// the revision's `resultType`.
    Legacy,
    /// 2026-07-28: requests go as they are.
    Modern,
}

/// Where what the server sends on its own goes when no call claims it.
pub enum Audience {
    /// One session (a server per session).
    Owner(Weak<Session>),
    /// Every session (one server shared by all).
    Everyone(Weak<Sessions>),
    /// Nobody: 2026-07-28 clients hear only on the answers to their requests.
    Nobody,
}

/// Where one call's answer and what belongs to it go.
pub struct Route {
    pub session: Option<Arc<Session>>,
    /// The call's own stream (SSE), if its client reads one.
    pub related: Option<mpsc::Sender<Value>>,
    /// The client speaks 2026-07-28.
    pub modern: bool,
    /// The server is told (`notifications/cancelled`) when the caller gives up waiting.
    pub cancel_on_drop: bool,
}

impl Route {
    /// The bridge's own request.
    fn internal() -> Route {
        Route {
            session: None,
            related: None,
            modern: false,
            cancel_on_drop: false,
        }
    }
}

struct Pending {
    client_id: Value,
    /// The client's progress token, replaced by the link's id on the way in.
    token: Option<Value>,
    session: Option<Arc<Session>>,
    related: Option<mpsc::Sender<Value>>,
    reply: oneshot::Sender<Value>,
    modern: bool,
}

struct Attached {
    pid: u32,
    input: Input,
    control: Control,
}

struct State {
    child: Option<Attached>,
    generation: u64,
    next_id: u64,
    pending: BTreeMap<u64, Pending>,
    /// The server's requests to clients that await an answer: by the server's id, the
    /// session asked.
    asked: HashMap<String, Weak<Session>>,
    last_heard: Instant,
    last_end: Option<Ended>,
    speaks: Speaks,
    server_info: Option<Value>,
}

struct Inner {
    name: String,
    hang_timeout: Duration,
    audience: Mutex<Audience>,
    state: Mutex<State>,
    /// How many processes of this link have ended.
    ends: watch::Sender<u64>,
}

/// Why the bridge's own request got no result.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The server answered with a JSON-RPC error (the error object).
    Rpc(Value),
    /// No answer within the time given.
    Timeout(Duration),
    /// The server is gone, or cannot be written to (the error response's message).
    Gone(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Rpc(e) => write!(f, "JSON-RPC error {e}"),
            CallError::Timeout(t) => {
                write!(f, "no answer within {}", humantime::format_duration(*t))
            }
            CallError::Gone(why) => f.write_str(why),
        }
    }
}

#[derive(Clone)]
pub struct Link(Arc<Inner>);

/// A call in flight: its answer, and (dropped before it) the call given up.
pub struct Waiter {
    rx: oneshot::Receiver<Value>,
    guard: CallGuard,
}

struct CallGuard {
    link: Link,
    id: u64,
    cancel: bool,
    done: bool,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if !self.done {
            self.link.abandon(self.id, self.cancel);
        }
    }
}

impl Waiter {
    /// The answer, with the client's id.
    pub async fn wait(mut self) -> Value {
        let answer = (&mut self.rx).await;
        self.guard.done = true;
        answer.unwrap_or_else(|_| {
            wire::error(
                None,
                wire::INTERNAL_ERROR,
                "the bridge lost this call's answer",
            )
        })
    }
}

impl Link {
    pub fn new(name: impl Into<String>, hang_timeout: Duration, audience: Audience) -> Link {
        let (ends, _) = watch::channel(0);
        Link(Arc::new(Inner {
            name: name.into(),
            hang_timeout,
            audience: Mutex::new(audience),
            state: Mutex::new(State {
                child: None,
                generation: 0,
                next_id: 1,
                pending: BTreeMap::new(),
                asked: HashMap::new(),
                last_heard: Instant::now(),
                last_end: None,
                speaks: Speaks::Unknown,
                server_info: None,
            }),
            ends,
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    pub fn set_audience(&self, audience: Audience) {
        *self.0.audience.lock().unwrap_or_else(|p| p.into_inner()) = audience;
    }

    /// Serves with `spawned` from now on (the process before it has ended).
    pub fn attach(&self, spawned: Spawned) {
        let Spawned {
            pid,
            input,
            events,
            control,
            ..
        } = spawned;
        let generation = {
            let mut st = self.state();
            st.generation += 1;
            st.child = Some(Attached {
                pid,
                input,
                control,
            });
            st.last_heard = Instant::now();
            st.speaks = Speaks::Unknown;
            st.generation
        };
        tokio::spawn(pump(self.clone(), events, generation));
        tokio::spawn(watchdog(self.clone(), generation));
    }

    /// What the server speaks, and its name for 2026-07-28 results, once the handshake told.
    pub fn set_speaks(&self, speaks: Speaks, server_info: Option<Value>) {
        let mut st = self.state();
        st.speaks = speaks;
        st.server_info = server_info;
    }

    pub fn speaks(&self) -> Speaks {
        self.state().speaks
    }

    pub fn alive(&self) -> bool {
        self.state().child.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.state().child.as_ref().map(|c| c.pid)
    }

    /// How many calls wait on the server.
    pub fn load(&self) -> usize {
        self.state().pending.len()
    }

    /// How the last process ended.
    pub fn last_end(&self) -> Option<Ended> {
        self.state().last_end.clone()
    }

    /// How many processes ended so far, to wait on with [`Link::wait_end`].
    pub fn ends_so_far(&self) -> u64 {
        *self.0.ends.borrow()
    }

    /// Waits until more than `seen` processes have ended; the last one's end.
    pub async fn wait_end(&self, seen: u64) -> Option<Ended> {
        let mut rx = self.0.ends.subscribe();
        let _ = rx.wait_for(|n| *n > seen).await;
        self.last_end()
    }

    pub fn kill(&self, fault: Fault) {
        if let Some(c) = &self.state().child {
            c.control.kill(fault);
        }
    }

    /// Ends the process gently (its input closed first).
    pub fn stop(&self, grace: Duration) {
        if let Some(c) = &self.state().child {
            c.control.stop(grace);
        }
    }

    fn gone_message(&self, st: &State) -> String {
        match &st.last_end {
            Some(end) => format!("{}; it is being restarted", end.describe()),
            None => "the stdio server is not running".into(),
        }
    }

    fn fault_error(id: Option<&Value>, why: String, kind: &str, pid: Option<u32>) -> Value {
        wire::error_with(
            id,
            wire::INTERNAL_ERROR,
            why,
            Some(json!({wire::FAULT_DATA_KEY: {"fault": kind, "pid": pid}})),
        )
    }

    /// Sends a client's request (`message`, with the client's id) to the server. `Err` is the
    /// error response to give the client at once.
    pub fn call(&self, mut message: Value, route: Route) -> Result<Waiter, Value> {
        let client_id = message.get("id").cloned().unwrap_or(Value::Null);
        let mut st = self.state();
        let (input, pid) = match &st.child {
            Some(c) => (c.input.clone(), c.pid),
            None => {
                let why = self.gone_message(&st);
                let kind = st.last_end.as_ref().map_or("not_running", |e| e.kind());
                return Err(Self::fault_error(Some(&client_id), why, kind, None));
            }
        };
        let id = st.next_id;
        st.next_id += 1;
        message["id"] = json!(id);
        let token = message
            .pointer_mut("/params/_meta/progressToken")
            .map(|t| std::mem::replace(t, json!(id)));
        if route.modern && st.speaks == Speaks::Legacy {
            wire::strip_envelope(&mut message);
        }
        let mut line = serde_json::to_vec(&message).unwrap_or_default();
        line.push(b'\n');
        if let Err(e) = input.send(line) {
            let why = match e {
                SendError::Full { queued } => format!(
                    "the stdio server (pid {pid}) is not reading its input: {queued} bytes wait \
                     to be written to it; this request was not sent"
                ),
                SendError::Closed => format!("the stdio server's input (pid {pid}) is closed"),
            };
            return Err(Self::fault_error(
                Some(&client_id),
                why,
                "not_reading",
                Some(pid),
            ));
        }
        let (tx, rx) = oneshot::channel();
        st.pending.insert(
            id,
            Pending {
                client_id,
                token,
                session: route.session,
                related: route.related,
                reply: tx,
                modern: route.modern,
            },
        );
        Ok(Waiter {
            rx,
            guard: CallGuard {
                link: self.clone(),
                id,
                cancel: route.cancel_on_drop,
                done: false,
            },
        })
    }

    /// The bridge's own request; its `result`. A server that speaks 2026-07-28 gets the
    /// envelope with it.
    pub async fn request(
        &self,
        method: &str,
        mut params: Value,
        timeout: Duration,
    ) -> Result<Value, CallError> {
        if self.speaks() == Speaks::Modern && method != "initialize" {
            if let Some(p) = params.as_object_mut() {
                p.insert("_meta".into(), wire::envelope());
            }
        }
        let message = json!({"jsonrpc": "2.0", "id": 0, "method": method, "params": params});
        let waiter = self.call(message, Route::internal()).map_err(|e| {
            CallError::Gone(
                e.pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("the stdio server is gone")
                    .to_string(),
            )
        })?;
        match tokio::time::timeout(timeout, waiter.wait()).await {
            Err(_) => Err(CallError::Timeout(timeout)),
            Ok(answer) => match answer.get("result") {
                Some(r) => Ok(r.clone()),
                None => {
                    let error = answer.get("error").cloned().unwrap_or(Value::Null);
                    if error
                        .pointer(&format!("/data/{}", json_pointer_key(wire::FAULT_DATA_KEY)))
                        .is_some()
                    {
                        Err(CallError::Gone(
                            error["message"].as_str().unwrap_or_default().to_string(),
                        ))
                    } else {
                        Err(CallError::Rpc(error))
                    }
                }
            },
        }
    }

    /// A ping within `timeout`; a server that does not answer it hangs, and is ended.
    pub async fn ping(&self, timeout: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        match self.request("ping", json!({}), timeout).await {
            Ok(_) | Err(CallError::Rpc(_)) => Ok(started.elapsed()),
            Err(CallError::Timeout(t)) => {
                self.kill(Fault::Hung { after: t });
                Err(format!(
                    "the stdio server did not answer a ping within {}: it hangs (ended, to be restarted)",
                    humantime::format_duration(t)
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Writes a message the server gets as it is (a notification, an answer).
    pub fn send(&self, message: &Value) {
        let st = self.state();
        if let Some(c) = &st.child {
            let mut line = serde_json::to_vec(message).unwrap_or_default();
            line.push(b'\n');
            if let Err(e) = c.input.send(line) {
                debug!(link = %self.0.name, error = ?e, "a message to the stdio server was dropped");
            }
        }
    }

    /// A client's `notifications/cancelled`: the server hears it with its own id for the
    /// request, and the call is answered at once (the client stopped waiting).
    pub fn cancel_from(&self, session_id: &str, mut message: Value) {
        let Some(rid) = message.pointer("/params/requestId").map(wire::key) else {
            return;
        };
        let found = {
            let mut st = self.state();
            let id = st
                .pending
                .iter()
                .find(|(_, p)| {
                    wire::key(&p.client_id) == rid
                        && p.session.as_ref().is_some_and(|s| s.id == session_id)
                })
                .map(|(id, _)| *id);
            id.and_then(|id| st.pending.remove(&id).map(|p| (id, p)))
        };
        let Some((id, p)) = found else { return };
        message["params"]["requestId"] = json!(id);
        self.send(&message);
        let reason = message
            .pointer("/params/reason")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let _ = p.reply.send(wire::error(
            Some(&p.client_id),
            -32800,
            format!("Request cancelled by the client {reason}").trim_end(),
        ));
    }

    /// A client's answer to a request of the server: sent on if that request was asked of
    /// this session.
    pub fn answer_from(&self, session_id: &str, message: &Value) {
        let Some(id) = message.get("id").map(wire::key) else {
            return;
        };
        let asked_here = {
            let mut st = self.state();
            match st.asked.get(&id).and_then(Weak::upgrade) {
                Some(s) if s.id == session_id => {
                    st.asked.remove(&id);
                    true
                }
                _ => false,
            }
        };
        if asked_here {
            self.send(message);
        } else {
            debug!(link = %self.0.name, id, "an answer to no request of the server; dropped");
        }
    }

    /// A session ended: its calls are answered with `why`, and the server's requests to it
    /// with an error.
    pub fn drop_session(&self, session_id: &str, why: &str) {
        let (calls, asked) = {
            let mut st = self.state();
            let ids: Vec<u64> = st
                .pending
                .iter()
                .filter(|(_, p)| p.session.as_ref().is_some_and(|s| s.id == session_id))
                .map(|(id, _)| *id)
                .collect();
            let calls: Vec<Pending> = ids.iter().filter_map(|id| st.pending.remove(id)).collect();
            let asked: Vec<String> = st
                .asked
                .iter()
                .filter(|(_, s)| s.upgrade().is_none_or(|s| s.id == session_id))
                .map(|(k, _)| k.clone())
                .collect();
            for k in &asked {
                st.asked.remove(k);
            }
            (calls, asked)
        };
        for p in calls {
            let _ = p.reply.send(wire::error(
                Some(&p.client_id),
                wire::INTERNAL_ERROR,
                format!("the session ended: {why}"),
            ));
        }
        for k in asked {
            if let Ok(id) = serde_json::from_str::<Value>(&k) {
                self.send(&wire::error(
                    Some(&id),
                    wire::INTERNAL_ERROR,
                    "the client session this request went to ended",
                ));
            }
        }
    }

    fn abandon(&self, id: u64, cancel: bool) {
        let removed = self.state().pending.remove(&id).is_some();
        if removed && cancel {
            self.send(&wire::notification(
                "notifications/cancelled",
                json!({"requestId": id, "reason": "the client closed its request"}),
            ));
        }
    }

    fn heard(&self, generation: u64) {
        let mut st = self.state();
        if st.generation == generation {
            st.last_heard = Instant::now();
        }
    }

    fn on_ended(&self, generation: u64, ended: Ended) {
        let (calls, why) = {
            let mut st = self.state();
            if st.generation != generation {
                return;
            }
            st.child = None;
            st.asked.clear();
            let why = ended.describe();
            st.last_end = Some(ended.clone());
            (std::mem::take(&mut st.pending), why)
        };
        let kind = ended.kind();
        let restarting = if ended.fault == Fault::Stopped {
            why
        } else {
            format!("{why}; it is restarted")
        };
        for (_, p) in calls {
            let _ = p.reply.send(Self::fault_error(
                Some(&p.client_id),
                restarting.clone(),
                kind,
                Some(ended.pid),
            ));
        }
        self.0.ends.send_modify(|n| *n += 1);
    }

    fn on_message(&self, message: Value) {
        match wire::kind(&message) {
            Kind::Response => self.on_response(message),
            Kind::Notification { method } => self.on_notification(&method, message),
            Kind::Request { method } => self.on_request(&method, message),
            Kind::Invalid(_) => {}
        }
    }

    fn on_response(&self, mut message: Value) {
        let mut st = self.state();
        let Some(p) = message
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|id| st.pending.remove(&id))
        else {
            debug!(link = %self.0.name, "an answer to no request in flight (given up, or cancelled); dropped");
            return;
        };
        message["id"] = p.client_id.clone();
        if p.modern && st.speaks == Speaks::Legacy {
            wire::complete_result(&mut message, st.server_info.as_ref());
        }
        drop(st);
        let _ = p.reply.send(message);
    }

    fn on_notification(&self, method: &str, mut message: Value) {
        match method {
            "notifications/progress" => {
                let target = {
                    let st = self.state();
                    message
                        .pointer("/params/progressToken")
                        .and_then(Value::as_u64)
                        .and_then(|t| st.pending.get(&t))
                        .and_then(|p| {
                            p.token
                                .clone()
                                .map(|token| (token, p.session.clone(), p.related.clone()))
                        })
                };
                if let Some((token, session, related)) = target {
                    message["params"]["progressToken"] = token;
                    deliver(session.as_ref(), related.as_ref(), message);
                    return;
                }
            }
            "notifications/cancelled" => {
                // The server gave up a request it sent a client: that client hears it.
                let session = message
                    .pointer("/params/requestId")
                    .map(wire::key)
                    .and_then(|k| self.state().asked.remove(&k))
                    .and_then(|w| w.upgrade());
                if let Some(s) = session {
                    s.deliver(message);
                }
                return;
            }
            m if m.ends_with("/list_changed") || m == "notifications/resources/updated" => {
                self.broadcast(message);
                return;
            }
            _ => {}
        }
        match self.claimant() {
            Some(c) => deliver(c.session.as_ref(), c.related.as_ref(), message),
            None => self.broadcast(message),
        }
    }

    fn on_request(&self, method: &str, message: Value) {
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        if method == "ping" {
            self.send(&wire::result(&id, json!({})));
            return;
        }
        let Some(Claimant {
            session: Some(session),
            related,
        }) = self.claimant()
        else {
            self.send(&wire::error(
                Some(&id),
                wire::INTERNAL_ERROR,
                format!(
                    "no client to ask: {method} came while no call of a client that can be asked \
                     (a 2025-era session) was in flight"
                ),
            ));
            return;
        };
        let capability = match method {
            "elicitation/create" => Some("elicitation"),
            "sampling/createMessage" => Some("sampling"),
            "roots/list" => Some("roots"),
            _ => None,
        };
        if let Some(cap) = capability {
            if !session.supports(cap) {
                self.send(&wire::error(
                    Some(&id),
                    wire::METHOD_NOT_FOUND,
                    format!("the client of this session does not support {cap}"),
                ));
                return;
            }
        }
        self.state()
            .asked
            .insert(wire::key(&id), Arc::downgrade(&session));
        deliver(Some(&session), related.as_ref(), message);
    }

    /// The call a message the server sent on its own belongs to, as far as can be told: the
    /// one that has waited longest (of a client that hears such messages).
    fn claimant(&self) -> Option<Claimant> {
        let owner = match &*self.0.audience.lock().unwrap_or_else(|p| p.into_inner()) {
            Audience::Owner(w) => Some(w.upgrade()),
            _ => None,
        };
        let st = self.state();
        let oldest = st
            .pending
            .values()
            .find(|p| p.session.is_some() || p.related.is_some());
        let (session, related) = match (owner, oldest) {
            (Some(owner), Some(p)) => (owner.or_else(|| p.session.clone()), p.related.clone()),
            (Some(owner), None) => (owner, None),
            (None, Some(p)) => (p.session.clone(), p.related.clone()),
            (None, None) => return None,
        };
        Some(Claimant { session, related })
    }

    fn broadcast(&self, message: Value) {
        let audience = self.0.audience.lock().unwrap_or_else(|p| p.into_inner());
        match &*audience {
            Audience::Owner(w) => {
                if let Some(s) = w.upgrade() {
                    s.deliver(message);
                }
            }
            Audience::Everyone(w) => {
                if let Some(all) = w.upgrade() {
                    for s in all.all() {
                        s.deliver(message.clone());
                    }
                }
            }
            Audience::Nobody => {}
        }
    }
}

/// Who a message the server sent on its own goes to: a session, and the stream of the call
/// it most likely belongs to.
struct Claimant {
    session: Option<Arc<Session>>,
    related: Option<mpsc::Sender<Value>>,
}

/// A message for a call: on its own stream when its client reads one, else on its session's.
fn deliver(session: Option<&Arc<Session>>, related: Option<&mpsc::Sender<Value>>, message: Value) {
    let message = match related {
        Some(tx) => match tx.try_send(message) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(m) | mpsc::error::TrySendError::Closed(m)) => m,
        },
        None => message,
    };
    if let Some(s) = session {
        s.deliver(message);
    }
}

/// "a/b" as a JSON pointer key.
fn json_pointer_key(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

async fn pump(link: Link, mut events: mpsc::Receiver<Event>, generation: u64) {
    while let Some(event) = events.recv().await {
        match event {
            Event::Message(m) => {
                link.heard(generation);
                link.on_message(m);
            }
            Event::Ended(e) => {
                link.on_ended(generation, e);
                return;
            }
        }
    }
}

/// A server with calls waiting that writes nothing for the hang timeout is pinged; one that
/// does not answer that either is ended.
async fn watchdog(link: Link, generation: u64) {
    let timeout = link.0.hang_timeout;
    if timeout.is_zero() {
        return;
    }
    let period = (timeout / 4).max(Duration::from_millis(50));
    loop {
        tokio::time::sleep(period).await;
        let silent_with_work = {
            let st = link.state();
            if st.generation != generation || st.child.is_none() {
                return;
            }
            !st.pending.is_empty() && st.last_heard.elapsed() >= timeout
        };
        if silent_with_work {
            if let Err(e) = link.ping(timeout).await {
                warn!(link = %link.0.name, "{e}");
                return;
            }
        }
    }
}
