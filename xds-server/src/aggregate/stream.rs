//! The long-lived streams that carry `notifications/tools/list_changed`: a legacy client's GET
//! SSE stream (in its session), and a 2026-07-28 client's `subscriptions/listen` response.
//!
//! Each virtual server has a watch channel of its listing's fingerprint: a refresh that
//! changes it wakes every stream of that server, and changes that come faster than a client
//! reads coalesce into one notification.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::jsonrpc::notification;

/// SSE comments this often keep intermediaries and clients from closing a quiet stream.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
pub const LIST_CHANGED: &str = "notifications/tools/list_changed";
pub const ACKNOWLEDGED: &str = "notifications/subscriptions/acknowledged";
pub const SUBSCRIPTION_ID: &str = "io.modelcontextprotocol/subscriptionId";

/// Per virtual server, the fingerprint of its listing.
#[derive(Default)]
pub struct Streams {
    channels: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl Streams {
    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes each time the listing of `name` changes.
    pub fn subscribe(&self, name: &str) -> watch::Receiver<u64> {
        self.channels()
            .entry(name.to_string())
            .or_insert_with(|| watch::Sender::new(0))
            .subscribe()
    }

    /// Records the fingerprint of `name`'s listing; wakes its streams when it changed.
    /// Returns whether it changed (the first fingerprint of a server is no change).
    pub fn announce(&self, name: &str, fingerprint: u64) -> bool {
        let mut channels = self.channels();
        match channels.get(name) {
            Some(tx) => tx.send_if_modified(|f| {
                let changed = *f != fingerprint;
                *f = fingerprint;
                changed
            }),
            None => {
                channels.insert(name.to_string(), watch::Sender::new(fingerprint));
                false
            }
        }
    }

    /// Forgets servers that are no longer offered (their streams end).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.channels().retain(|name, _| keep(name));
    }
}

/// Counts a stream as open for as long as it lives.
pub struct OpenStream(Gauge);

impl OpenStream {
    pub fn new(gauge: Gauge) -> OpenStream {
        gauge.inc();
        OpenStream(gauge)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn event(message: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(message.to_string()))
}

/// `list_changed` on every change of `changes`, until the server leaves or the client goes.
fn changes(
    changes: watch::Receiver<u64>,
    message: Value,
    open: OpenStream,
) -> BoxStream<'static, Result<Event, Infallible>> {
    stream::unfold(
        (changes, message, open),
        |(mut changes, message, open)| async move {
            changes.changed().await.ok()?;
            let e = event(&message);
            Some((e, (changes, message, open)))
        },
    )
    .boxed()
}

fn respond(events: BoxStream<'static, Result<Event, Infallible>>) -> Response {
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // Reverse proxies must not buffer the notifications.
    response.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    response
}

/// A legacy client's GET stream, open until the client goes or its session ends (`endings`
/// changes and `ended` says so): `list_changed` on every change of the listing, and what its
/// servers send outside calls (`relayed`, see [`super::relay`]).
pub fn legacy(
    changes: watch::Receiver<u64>,
    endings: watch::Receiver<u64>,
    ended: impl Fn() -> bool + Send + 'static,
    relayed: Option<mpsc::Receiver<Value>>,
    open: OpenStream,
) -> Response {
    let message = notification(LIST_CHANGED, None);
    let events = stream::unfold(
        (changes, endings, ended, relayed, message, open),
        |(mut changes, mut endings, ended, mut relayed, message, open)| async move {
            loop {
                let from_servers = async {
                    match relayed.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changed = changes.changed() => {
                        changed.ok()?;
                        let e = event(&message);
                        return Some((e, (changes, endings, ended, relayed, message, open)));
                    }
                    sent = from_servers => {
                        match sent {
                            Some(m) => {
                                let e = event(&m);
                                return Some((e, (changes, endings, ended, relayed, message, open)));
                            }
                            // The relay stopped: the list changes still come.
                            None => relayed = None,
                        }
                    }
                    changed = endings.changed() => {
                        changed.ok()?;
                        if ended() {
                            return None;
                        }
                    }
                }
            }
        },
    );
    respond(events.boxed())
}

/// A 2026-07-28 `subscriptions/listen` response: the acknowledgement first, then the
/// notifications the client asked for (`honoured`), each with the subscription's id.
pub fn listen(
    rx: watch::Receiver<u64>,
    subscription_id: &Value,
    honoured: Value,
    open: OpenStream,
) -> Response {
    let meta = json!({ SUBSCRIPTION_ID: subscription_id });
    let tools = honoured.get("toolsListChanged") == Some(&json!(true));
    let ack = notification(
        ACKNOWLEDGED,
        Some(json!({"notifications": honoured, "_meta": meta})),
    );
    let first = stream::iter([event(&ack)]);
    let rest = if tools {
        changes(
            rx,
            notification(LIST_CHANGED, Some(json!({"_meta": meta}))),
            open,
        )
    } else {
        // Nothing to send, but the stream stays open (and counted) until the client closes it.
        stream::unfold(open, |open| async move {
            std::future::pending::<()>().await;
            Some((event(&Value::Null), open))
        })
        .boxed()
    };
    respond(first.chain(rest).boxed())
}
