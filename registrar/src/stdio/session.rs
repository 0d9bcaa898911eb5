//! The MCP sessions of 2025-era clients: their ids, the server that serves each, what the
//! server sends them on their own (on the session's GET stream, or kept for it), and when
//! they end.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::warn;

use super::link::Link;
use crate::restart::Restarts;

/// Messages kept for a session without a GET stream, the oldest dropped first.
const KEPT: usize = 64;
/// Messages a GET stream may hold unread before more are dropped.
const STREAM_BUFFER: usize = 256;

pub struct Session {
    pub id: String,
    pub link: Link,
    /// The session has a server of its own (not the shared one).
    pub own_child: bool,
    /// The client's `initialize` params: a restarted server is opened with them again.
    pub init: Value,
    capabilities: Value,
    state: Mutex<SessionState>,
    /// The restart policy's count for this session's server; held while it restarts.
    pub restarts: tokio::sync::Mutex<Restarts>,
}

struct SessionState {
    stream: Option<mpsc::Sender<Value>>,
    kept: VecDeque<Value>,
    last_used: Instant,
    active: usize,
    ended: Option<String>,
}

impl Session {
    pub fn new(
        id: String,
        link: Link,
        own_child: bool,
        init: Value,
        restarts: Restarts,
    ) -> Session {
        let capabilities = init.get("capabilities").cloned().unwrap_or(Value::Null);
        Session {
            id,
            link,
            own_child,
            init,
            capabilities,
            state: Mutex::new(SessionState {
                stream: None,
                kept: VecDeque::new(),
                last_used: Instant::now(),
                active: 0,
                ended: None,
            }),
            restarts: tokio::sync::Mutex::new(restarts),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the client declared `capability` (elicitation, sampling, roots).
    pub fn supports(&self, capability: &str) -> bool {
        self.capabilities
            .get(capability)
            .is_some_and(|c| !c.is_null())
    }

    /// A message of the server for this session, outside any call: on its GET stream, or
    /// kept until one opens.
    pub fn deliver(&self, message: Value) {
        let mut st = self.state();
        if st.ended.is_some() {
            return;
        }
        let message = match &st.stream {
            Some(tx) => match tx.try_send(message) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    warn!(session = %short(&self.id), "the client does not read its GET stream: a message of the server was dropped");
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(m)) => {
                    st.stream = None;
                    m
                }
            },
            None => message,
        };
        if st.kept.len() >= KEPT {
            st.kept.pop_front();
        }
        st.kept.push_back(message);
    }

    /// Opens the session's GET stream (a newer one replaces an older one), with what was
    /// kept for it first.
    pub fn open_stream(&self) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let mut st = self.state();
        for m in st.kept.drain(..) {
            let _ = tx.try_send(m);
        }
        st.stream = Some(tx);
        st.last_used = Instant::now();
        rx
    }

    /// A request of the client in progress; the session is not idle until the guard drops.
    pub fn begin(self: &Arc<Self>) -> Active {
        let mut st = self.state();
        st.active += 1;
        st.last_used = Instant::now();
        Active(Arc::clone(self))
    }

    pub fn ended(&self) -> Option<String> {
        self.state().ended.clone()
    }

    /// Marks the session ended: its stream closes and nothing more is kept for it.
    pub fn end(&self, why: &str) {
        let mut st = self.state();
        st.ended.get_or_insert_with(|| why.to_string());
        st.stream = None;
        st.kept.clear();
    }

    /// Unused for `idle`: no request in progress, no GET stream open.
    fn idle_for(&self, idle: Duration) -> bool {
        let st = self.state();
        let streaming = st.stream.as_ref().is_some_and(|s| !s.is_closed());
        st.active == 0 && !streaming && st.last_used.elapsed() >= idle
    }
}

/// Held while a request of the session is in progress.
pub struct Active(Arc<Session>);

impl Drop for Active {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.active = st.active.saturating_sub(1);
        st.last_used = Instant::now();
    }
}

/// Every open session, and the bound on how many.
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
    /// Sessions being opened (counted against the bound before they exist).
    opening: AtomicUsize,
    pub max: usize,
}

/// A place among the sessions, taken before a session is opened.
pub struct Place<'a> {
    sessions: &'a Sessions,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.sessions.opening.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sessions {
    pub fn new(max: usize) -> Sessions {
        Sessions {
            map: Mutex::new(HashMap::new()),
            opening: AtomicUsize::new(0),
            max,
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more session, unless `max` are open or being opened.
    pub fn reserve(&self) -> Option<Place<'_>> {
        let map = self.map();
        let opening = self.opening.fetch_add(1, Ordering::SeqCst);
        if map.len() + opening >= self.max {
            self.opening.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Place { sessions: self })
    }

    /// Adds a session opened in `place`.
    pub fn insert(&self, _place: Place<'_>, session: Arc<Session>) {
        self.map().insert(session.id.clone(), session);
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.map().get(id).cloned()
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        self.map().remove(id)
    }

    pub fn all(&self) -> Vec<Arc<Session>> {
        self.map().values().cloned().collect()
    }

    /// The sessions unused for `idle`.
    pub fn idle(&self, idle: Duration) -> Vec<Arc<Session>> {
        self.map()
            .values()
            .filter(|s| s.idle_for(idle))
            .cloned()
            .collect()
    }
}

/// The start of a session id, for logs.
pub fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}
