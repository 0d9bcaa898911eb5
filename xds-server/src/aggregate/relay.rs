//! What servers send a client of the aggregate endpoint outside any call: updates of the
//! resources it subscribed to, and the log messages they write between calls.
//!
//! A server sends those on the stream of its own session (the GET stream of Streamable HTTP).
//! The sessions the gateway holds for a legacy client are the gateway's, so while the
//! client's GET stream is open, toolgate-xds opens that stream on each session it holds for
//! the client and the stream's verified user (the filter names the user: two users of one
//! client session never hear each other's servers), and on each it opens later, and passes
//! on what the client can use: the
//! notifications in [`RELAYED`], a resource's URI shown as the virtual server shows it. A
//! server's requests there (`roots/list`, a question outside any call) are not passed on: no
//! answer could find its way back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use toolgate_probe::mcp::{ExtraHeader, OpenSession, SseScanner};
use tracing::{debug, info, warn};

use crate::upstream::UpstreamSessions;
use crate::upstream_credentials::Credentials;

pub const RESOURCE_UPDATED: &str = "notifications/resources/updated";
pub const LOG_MESSAGE: &str = "notifications/message";
/// The notifications a client gets from its servers' own streams.
pub const RELAYED: [&str; 2] = [RESOURCE_UPDATED, LOG_MESSAGE];
/// The largest event read; a server sending a larger one loses its stream (opened again).
pub const MAX_EVENT_BYTES: usize = 256 * 1024;
/// Notifications waiting for a slow client, per client stream: a server that sends more
/// waits (its stream is read no faster than the client reads).
const QUEUE: usize = 64;
/// Before opening a server's stream again once it ended or was refused for now (409: one
/// stream per session, and the client's previous GET may still hold it).
const RETRY: Duration = Duration::from_secs(2);
/// How often the sessions of a client are looked at again (one may have been closed).
const RECHECK: Duration = Duration::from_secs(15);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A server's stream quiet this long is opened again (a half-open connection ends there).
const READ_TIMEOUT: Duration = Duration::from_secs(300);

/// The URI a client of this virtual server sees for `uri` of `service`.
pub type ShowUri = Arc<dyn Fn(&str, &str) -> String + Send + Sync>;

/// The relay of each owner (a client session, bound to the verified user of the stream when
/// there is one): one at a time, so that a client opening GET streams in a loop does not open
/// as many streams on each of its servers. The latest GET stream gets what its servers send;
/// an earlier one still open keeps its `list_changed`.
#[derive(Default)]
pub struct Relays {
    /// By owner: the generation of its relay, and what keeps that relay going.
    current: Mutex<HashMap<String, (u64, watch::Sender<()>)>>,
    generations: std::sync::atomic::AtomicU64,
}

impl Relays {
    fn current(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, watch::Sender<()>)>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts relaying what the sessions held for `owner` receive (stopping its earlier
    /// relay): the notifications come out of the receiver, until it is dropped (the client's
    /// stream ended).
    pub fn start(
        self: &Arc<Self>,
        upstream: Arc<UpstreamSessions>,
        owner: String,
        show_uri: ShowUri,
    ) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let generation = self
            .generations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (keep, kept) = watch::channel(());
        // The earlier relay's sender is dropped here: it stops.
        self.current().insert(owner.clone(), (generation, keep));
        let relays = Arc::clone(self);
        tokio::spawn(async move {
            supervise(upstream, &owner, show_uri, tx, kept).await;
            let mut current = relays.current();
            if current.get(&owner).is_some_and(|(g, _)| *g == generation) {
                current.remove(&owner);
            }
        });
        rx
    }

    /// Relays running now.
    pub fn running(&self) -> usize {
        self.current().len()
    }
}

/// One reader per session held for `owner`, started as sessions are held and stopped when
/// they are not any more, when the client goes, or when a later relay takes over (`kept`
/// closes).
async fn supervise(
    upstream: Arc<UpstreamSessions>,
    owner: &str,
    show_uri: ShowUri,
    tx: mpsc::Sender<Value>,
    mut kept: watch::Receiver<()>,
) {
    let http = match reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .build()
    {
        Ok(http) => http,
        Err(e) => {
            warn!(error = %e, "cannot relay servers' notifications: no HTTP client");
            return;
        }
    };
    let mut openings = upstream.openings_of(owner);
    let mut readers = JoinSet::new();
    let mut reading: HashMap<String, tokio::task::AbortHandle> = HashMap::new();
    let mut recheck = tokio::time::interval(RECHECK);
    loop {
        let held = upstream.sessions_of(owner);
        reading.retain(|id, reader| {
            let still = held.iter().any(|(_, s)| &s.id == id);
            if !still {
                reader.abort();
            }
            still
        });
        for (service, session) in held {
            if reading.contains_key(&session.id) {
                continue;
            }
            let id = session.id.clone();
            let reader = readers.spawn(read(
                http.clone(),
                upstream.credentials().clone(),
                service,
                session,
                Arc::clone(&show_uri),
                tx.clone(),
            ));
            reading.insert(id, reader);
        }
        tokio::select! {
            _ = tx.closed() => return,
            _ = kept.changed() => return,
            changed = openings.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = recheck.tick() => {}
            Some(_) = readers.join_next() => {}
        }
    }
}

/// How reading a server's stream ended.
enum Ended {
    /// For good: the client went, the session is gone, or the server has no such stream.
    Done,
    /// For now: opened again after [`RETRY`].
    Again,
}

/// Reads one session's stream, opening it again while it ends for now. Each opening carries
/// the service's credential from `credentials`, as last read.
async fn read(
    http: reqwest::Client,
    credentials: Credentials,
    service: String,
    session: OpenSession,
    show_uri: ShowUri,
    tx: mpsc::Sender<Value>,
) {
    while let Ended::Again =
        read_once(&http, &credentials, &service, &session, &show_uri, &tx).await
    {
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(RETRY) => {}
        }
    }
}

async fn read_once(
    http: &reqwest::Client,
    credentials: &Credentials,
    service: &str,
    session: &OpenSession,
    show_uri: &ShowUri,
    tx: &mpsc::Sender<Value>,
) -> Ended {
    let mut request = http
        .get(&session.url)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &session.id)
        .header("mcp-protocol-version", &session.version);
    if let Some(h) = ExtraHeader::of(credentials.header(service)) {
        request = h.apply(request);
    }
    let request = request.send();
    let mut response = tokio::select! {
        _ = tx.closed() => return Ended::Done,
        r = request => match r {
            Ok(r) => r,
            Err(e) => {
                debug!(service, error = %e, "opening a server's stream failed");
                return Ended::Again;
            }
        },
    };
    let status = response.status().as_u16();
    match status {
        200 => {}
        405 => {
            info!(
                service,
                "the server offers no stream of its own: what it sends outside calls does not reach the client"
            );
            return Ended::Done;
        }
        // The session is gone there; the filter finds out on the next call.
        400 | 404 => return Ended::Done,
        _ => {
            debug!(service, status, "a server refused its stream for now");
            return Ended::Again;
        }
    }
    let mut events = SseScanner::default();
    loop {
        let chunk = tokio::select! {
            _ = tx.closed() => return Ended::Done,
            c = response.chunk() => c,
        };
        let bytes = match chunk {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ended::Again,
            Err(e) => {
                debug!(service, error = %e, "a server's stream broke");
                return Ended::Again;
            }
        };
        for data in events.push(&bytes) {
            if let Some(message) = relayed(service, &data, show_uri) {
                if tx.send(message).await.is_err() {
                    return Ended::Done;
                }
            }
        }
        if events.buffered() > MAX_EVENT_BYTES {
            warn!(
                service,
                limit = MAX_EVENT_BYTES,
                "a server sent an event larger than the limit on its stream; opened again"
            );
            return Ended::Again;
        }
    }
}

/// The message a client gets for one event of `service`'s stream, if any: a notification of
/// [`RELAYED`], a resource's URI as the client sees it.
pub fn relayed(service: &str, data: &str, show_uri: &ShowUri) -> Option<Value> {
    let mut message: Value = serde_json::from_str(data).ok()?;
    let method = message.get("method")?.as_str()?;
    if message.get("id").is_some() || !RELAYED.contains(&method) {
        return None;
    }
    if method == RESOURCE_UPDATED {
        let uri = message.pointer("/params/uri")?.as_str()?;
        let shown = show_uri(service, uri);
        message["params"]["uri"] = Value::String(shown);
    }
    Some(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn prefixing() -> ShowUri {
        Arc::new(|service: &str, uri: &str| {
            if uri.starts_with("dup://") {
                format!("toolgate+{service}:{uri}")
            } else {
                uri.to_string()
            }
        })
    }

    #[test]
    fn updates_and_log_messages_pass_with_the_uri_the_client_sees() {
        let show = prefixing();
        let updated = r#"{"jsonrpc":"2.0","method":"notifications/resources/updated","params":{"uri":"dup://x"}}"#;
        assert_eq!(
            relayed("beta", updated, &show),
            Some(json!({"jsonrpc": "2.0", "method": RESOURCE_UPDATED,
                        "params": {"uri": "toolgate+beta:dup://x"}}))
        );
        let log = r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"hi"}}"#;
        assert_eq!(
            relayed("beta", log, &show).map(|m| m["params"]["data"].clone()),
            Some(json!("hi"))
        );
    }

    #[tokio::test]
    async fn a_later_stream_of_a_client_takes_its_relay_over() {
        let registry = Arc::new(std::sync::RwLock::new(crate::registry::Registry::new(
            Default::default(),
        )));
        let upstream = Arc::new(UpstreamSessions::new(
            registry,
            Arc::new(crate::metrics::Metrics::new()),
        ));
        let relays = Arc::new(Relays::default());
        let mut first = relays.start(Arc::clone(&upstream), "gA".into(), prefixing());
        let second = relays.start(Arc::clone(&upstream), "gA".into(), prefixing());
        let other = relays.start(Arc::clone(&upstream), "gB".into(), prefixing());
        // The first relay stops: its receiver ends.
        let ended = tokio::time::timeout(Duration::from_secs(5), first.recv()).await;
        assert_eq!(ended.ok(), Some(None));
        assert_eq!(relays.running(), 2);
        drop((second, other));
        for _ in 0..100 {
            if relays.running() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(relays.running(), 0, "a relay ends with its client's stream");
    }

    #[test]
    fn requests_answers_and_other_notifications_do_not() {
        let show = prefixing();
        for data in [
            r#"{"jsonrpc":"2.0","id":1,"method":"roots/list"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"notifications/message","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/resources/updated","params":{"uri":7}}"#,
            "not json",
            "",
        ] {
            assert_eq!(relayed("a", data, &show), None, "{data}");
        }
    }
}
