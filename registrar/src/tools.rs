//! The tool list a registration carries when the server's own `tools/list` decides it: what to
//! say about a listing, how two lists differ, and the task that keeps the registered list
//! current (the server's GET stream when it announces list changes, an interval otherwise).

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use toolgate_probe::mcp::tools::{ListLimits, Listing};
use toolgate_probe::mcp::{Failure, McpClient, SseScanner};
use tracing::{info, warn};

use crate::keepalive::ToolsUpdater;

/// How one list became another, names sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolsDiff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl ToolsDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

impl fmt::Display for ToolsDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "added {:?}, removed {:?}", self.added, self.removed)
    }
}

/// What `new` adds to and removes from `old` (order does not count: the gateway keeps a set).
pub fn diff(old: &[String], new: &[String]) -> ToolsDiff {
    let old: BTreeSet<&String> = old.iter().collect();
    let new: BTreeSet<&String> = new.iter().collect();
    ToolsDiff {
        added: new.difference(&old).map(|s| s.to_string()).collect(),
        removed: old.difference(&new).map(|s| s.to_string()).collect(),
    }
}

/// The warnings a listing deserves: each refused tool and why, a cut listing, an empty one.
pub fn listing_notes(listing: &Listing) -> Vec<String> {
    let mut notes: Vec<String> = listing
        .refused
        .iter()
        .map(|r| {
            format!(
                "tool {:?} of the server is not registered: {}",
                r.name, r.why
            )
        })
        .collect();
    if let Some(cut) = &listing.cut {
        notes.push(format!(
            "the tool listing was capped ({cut}); tools past the cap are not registered"
        ));
    }
    if listing.names.is_empty() {
        notes.push(
            "the server lists no registrable tool; registering with none (the gateway then \
             judges calls of any tool name, breakers for at most 64 names)"
                .into(),
        );
    }
    notes
}

/// Warnings for `--tools` given by hand that differ from what the server lists.
pub fn compare_given(given: &[String], listed: &[String]) -> Vec<String> {
    let d = diff(given, listed);
    let mut notes = Vec::new();
    if !d.removed.is_empty() {
        notes.push(format!(
            "tools registered by --tools that the server does not list: {:?}",
            d.removed
        ));
    }
    if !d.added.is_empty() {
        notes.push(format!(
            "tools the server lists that --tools does not register: {:?}",
            d.added
        ));
    }
    notes
}

/// Does an SSE event's data carry `notifications/tools/list_changed`?
pub fn is_list_changed(data: &str) -> bool {
    serde_json::from_str::<Value>(data)
        .ok()
        .and_then(|v| {
            v.get("method")
                .and_then(Value::as_str)
                .map(|m| m == "notifications/tools/list_changed")
        })
        .unwrap_or(false)
}

/// Does the server announce tool list changes (`capabilities.tools.listChanged: true`)?
pub fn announces_changes(capabilities: &Value) -> bool {
    capabilities
        .get("tools")
        .and_then(|t| t.get("listChanged"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// The most one event of the GET stream may hold before the stream is dropped.
const MAX_EVENT_BYTES: usize = 1 << 20;
/// Stream openings that may fail in a row before falling back to the interval.
const MAX_STREAM_FAILURES: u32 = 3;

/// Keeps a registration's tool list equal to the server's.
pub struct Follower {
    pub mcp: McpClient,
    pub updater: ToolsUpdater,
    /// The list registered now.
    pub current: Vec<String>,
    /// The interval refresh of a server without a usable stream; zero: never.
    pub refresh: Duration,
    pub limits: ListLimits,
    /// For the GET stream: no total timeout, or every stream would end after it.
    pub stream_http: reqwest::Client,
    notes: Vec<String>,
}

impl Follower {
    pub fn new(
        mcp: McpClient,
        updater: ToolsUpdater,
        listing: &Listing,
        refresh: Duration,
        limits: ListLimits,
        connect_timeout: Duration,
    ) -> Self {
        let stream_http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .build()
            // Only a TLS backend or a resolver that cannot start fails here; neither is used.
            .unwrap_or_else(|_| reqwest::Client::new());
        Follower {
            mcp,
            updater,
            current: listing.names.clone(),
            refresh,
            limits,
            stream_http,
            notes: listing_notes(listing),
        }
    }

    /// Follows the server until `stop`, then hands the MCP client back (its session is to be
    /// closed while the server still runs).
    pub async fn run(mut self, mut stop: oneshot::Receiver<()>) -> McpClient {
        let mut streaming =
            announces_changes(self.mcp.capabilities()) && self.mcp.open_session().is_some();
        if !streaming {
            self.say_interval("the server does not announce tool list changes on a session");
        }
        let mut failures = 0;
        loop {
            if streaming {
                let opened = tokio::select! {
                    _ = &mut stop => break,
                    opened = self.mcp.open_stream(&self.stream_http) => opened,
                };
                match opened {
                    Ok(resp) => {
                        failures = 0;
                        info!(url = %self.mcp.url(), "following the server's tool list changes on its GET stream");
                        // A change between the listing and this stream would go unannounced.
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = self.refresh_once() => {}
                        }
                        let end = tokio::select! {
                            _ = &mut stop => break,
                            end = self.read_stream(resp) => end,
                        };
                        warn!(reason = %end, "the server's GET stream ended; listing again and reopening it");
                        // A second apart: a server that ends every stream at once must not
                        // get a busy loop of listings.
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = async {
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                self.refresh_once().await
                            } => {}
                        }
                    }
                    // 405: the server offers no stream; 400 on a first try: it refuses this one.
                    Err(e)
                        if matches!(e.status(), Some(405))
                            || failures == 0 && e.status() == Some(400) =>
                    {
                        streaming = false;
                        self.say_interval(&format!("no GET stream ({e})"));
                    }
                    Err(e) => {
                        failures += 1;
                        if failures >= MAX_STREAM_FAILURES {
                            streaming = false;
                            self.say_interval(&format!(
                                "the GET stream failed {failures} times in a row, last: {e}"
                            ));
                            continue;
                        }
                        warn!(error = %e, "opening the server's GET stream failed; retrying");
                        // The session may be gone (a restarted server): the probe renews it.
                        let _ = self.mcp.probe().await;
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                    }
                }
            } else {
                if self.refresh.is_zero() {
                    let _ = stop.await;
                    break;
                }
                tokio::select! {
                    _ = &mut stop => break,
                    _ = tokio::time::sleep(self.refresh) => {}
                }
                tokio::select! {
                    _ = &mut stop => break,
                    _ = self.refresh_once() => {}
                }
            }
        }
        self.mcp
    }

    fn say_interval(&self, why: &str) {
        if self.refresh.is_zero() {
            info!(why, "the tool list is not refreshed (--tools-refresh 0)");
        } else {
            info!(why, every = %humantime::format_duration(self.refresh), "refreshing the tool list on an interval");
        }
    }

    /// Reads the stream until it ends, listing again at each change it announces.
    async fn read_stream(&mut self, mut resp: reqwest::Response) -> String {
        let mut scanner = SseScanner::default();
        loop {
            let chunk = match resp.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => return "the server closed it".into(),
                Err(e) => return format!("it broke: {e}"),
            };
            for data in scanner.push(&chunk) {
                if is_list_changed(&data) {
                    info!("the server announced a tool list change");
                    self.refresh_once().await;
                }
            }
            if scanner.buffered() > MAX_EVENT_BYTES {
                return format!("an event is larger than {MAX_EVENT_BYTES} bytes");
            }
        }
    }

    /// Lists the tools once and registers the list if it changed; a failed listing keeps the
    /// last one.
    pub async fn refresh_once(&mut self) {
        let listing = match self.mcp.list_tools(self.limits).await {
            Ok(l) => l,
            Err(first) => {
                // A restarted server forgot the session: the probe makes a new one.
                let retried = match self.mcp.probe().await {
                    Ok(_) => self.mcp.list_tools(self.limits).await,
                    Err(_) => Err(first),
                };
                match retried {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(error = %describe(&e), "listing the server's tools failed; keeping the last list");
                        return;
                    }
                }
            }
        };
        let notes = listing_notes(&listing);
        if notes != self.notes {
            for n in &notes {
                warn!("{n}");
            }
            self.notes = notes;
        }
        let change = diff(&self.current, &listing.names);
        if change.is_empty() {
            return;
        }
        match self.updater.update_tools(listing.names.clone()).await {
            Ok(()) => {
                info!(added = ?change.added, removed = ?change.removed, "the server's tool list changed; registration updated");
                self.current = listing.names;
            }
            Err(e) => {
                warn!(error = %e, %change, "registering the changed tool list failed; trying again at the next refresh")
            }
        }
    }
}

fn describe(f: &Failure) -> String {
    f.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_probe::mcp::tools::Refused;

    fn v(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_diff_names_what_came_and_went_regardless_of_order() {
        let d = diff(&v(&["a", "b", "c"]), &v(&["d", "c", "a"]));
        assert_eq!(d.added, ["d"]);
        assert_eq!(d.removed, ["b"]);
        assert_eq!(d.to_string(), "added [\"d\"], removed [\"b\"]");
        assert!(diff(&v(&["a", "b"]), &v(&["b", "a"])).is_empty());
        assert_eq!(diff(&[], &v(&["x"])).added, ["x"]);
        assert_eq!(diff(&v(&["x"]), &[]).removed, ["x"]);
    }

    #[test]
    fn tools_given_by_hand_are_compared_both_ways() {
        let notes = compare_given(&v(&["read", "gone"]), &v(&["read", "extra"]));
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("does not list") && notes[0].contains("gone"));
        assert!(notes[1].contains("does not register") && notes[1].contains("extra"));
        assert!(compare_given(&v(&["a"]), &v(&["a"])).is_empty());
    }

    #[test]
    fn notes_name_each_refused_tool_a_cut_and_an_empty_list() {
        let listing = Listing {
            names: vec![],
            refused: vec![Refused {
                name: "a b".into(),
                why: "contains ' '".into(),
            }],
            cut: Some("stopped at 2000 tools; the server lists more".into()),
            pages: 1,
            ..Listing::default()
        };
        let notes = listing_notes(&listing);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes[0].contains("\"a b\"") && notes[0].contains("contains ' '"));
        assert!(notes[1].contains("capped") && notes[1].contains("2000"));
        assert!(notes[2].contains("no registrable tool"));
        let fine = Listing {
            names: v(&["a"]),
            ..Listing::default()
        };
        assert!(listing_notes(&fine).is_empty());
    }

    #[test]
    fn only_the_list_changed_notification_counts() {
        assert!(is_list_changed(
            r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#
        ));
        assert!(!is_list_changed(
            r#"{"jsonrpc":"2.0","method":"notifications/message"}"#
        ));
        assert!(!is_list_changed("not json"));
        assert!(!is_list_changed(r#"{"method":5}"#));
        assert!(announces_changes(
            &serde_json::json!({"tools": {"listChanged": true}})
        ));
        assert!(!announces_changes(&serde_json::json!({"tools": {}})));
        assert!(!announces_changes(&Value::Null));
    }
}
