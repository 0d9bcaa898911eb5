//! The issuers' signing keys, fetched by toolgate-xds and handed to Envoy inline.
//!
//! Envoy once fetched each remote JWKS itself. It now receives the keys in `jwt_authn`'s
//! configuration (ECDS), for two reasons: a fleet of Envoys costs the identity provider one
//! fetch per toolgate-xds, not one per Envoy; and Envoy's cache of verified tokens is safe.
//! A changed key set is a changed configuration, which gives Envoy a fresh filter and an
//! empty token cache, so a withdrawn key stops verifying within one refresh, as before; an
//! unchanged set changes no byte and keeps the cache warm.
//!
//! Each remote JWKS is fetched when the auth configuration names it, then every `cache_secs`;
//! a failed fetch keeps the last good set and is tried again a second later (Envoy's own
//! rules). The set handed on is the fetched JSON re-serialized, so whitespace or key order
//! the provider changes does not look like new keys.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::watch;
use toolgate_model::auth::{AuthConfig, Jwks, RemoteJwks};
use tracing::{info, warn};

use crate::idp::{FetchError, IdpClient};
use crate::metrics::{JwksLabel, Metrics};
use crate::registry::publish::Publisher;
use crate::registry::Registry;
use crate::routing::{FetchedKeys, RoutingSnapshot};

/// A failed fetch is tried again after this long.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Keys in one set at most; more is no JWKS an issuer publishes.
const MAX_KEYS: usize = 100;

/// What is known of one JWKS URL.
#[derive(Debug)]
struct Source {
    remote: RemoteJwks,
    /// The last good set (canonical JSON text).
    keys: Option<Arc<str>>,
    /// When the next fetch is due.
    due: Instant,
    /// The last failure, while fetches fail (logged once per distinct failure).
    failing: Option<String>,
    tried: bool,
}

/// Fetches the remote JWKS of the auth configuration the snapshots carry, for as long as the
/// publisher runs.
pub async fn run(
    registry: Arc<RwLock<Registry>>,
    mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    publisher: Publisher,
    client: IdpClient,
    metrics: Arc<Metrics>,
) {
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    let mut auth: Option<Arc<AuthConfig>> = None;
    loop {
        let latest = snapshots.borrow_and_update().auth.clone();
        if !same(&auth, &latest) {
            auth = latest;
            reconcile(&mut sources, auth.as_deref(), Instant::now());
            publish(&registry, &publisher, &sources);
            metrics.jwks_failing.set(failing(&sources));
        }
        let next = sources.values().map(|s| s.due).min();
        tokio::select! {
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return; // The publisher is gone: shutting down.
                }
                continue;
            }
            _ = sleep_until(next) => {}
        }
        let now = Instant::now();
        let due: Vec<(String, RemoteJwks)> = sources
            .iter()
            .filter(|(_, s)| s.due <= now)
            .map(|(uri, s)| (uri.clone(), s.remote.clone()))
            .collect();
        let fetched = futures::future::join_all(due.into_iter().map(|(uri, remote)| {
            let client = client.clone();
            async move {
                let result = fetch(&client, &remote).await;
                (uri, result)
            }
        }))
        .await;
        let mut changed = false;
        for (uri, result) in fetched {
            // The configuration may have dropped it while the fetch ran.
            let Some(source) = sources.get_mut(&uri) else {
                continue;
            };
            changed |= source.settle(&uri, result, &metrics);
        }
        metrics.jwks_failing.set(failing(&sources));
        if changed {
            publish(&registry, &publisher, &sources);
        }
    }
}

fn failing(sources: &BTreeMap<String, Source>) -> i64 {
    sources.values().filter(|s| s.failing.is_some()).count() as i64
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

fn same(a: &Option<Arc<AuthConfig>>, b: &Option<Arc<AuthConfig>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        (None, None) => true,
        _ => false,
    }
}

/// The remote JWKS `auth` names, by URL (one fetch serves issuers sharing a URL; the
/// shortest refresh and the longest timeout of those win).
fn wanted(auth: Option<&AuthConfig>) -> BTreeMap<String, RemoteJwks> {
    let mut wanted: BTreeMap<String, RemoteJwks> = BTreeMap::new();
    for issuer in auth.map(|a| a.issuers.as_slice()).unwrap_or_default() {
        if let Jwks::Remote(r) = &issuer.jwks {
            wanted
                .entry(r.uri.clone())
                .and_modify(|w| {
                    w.cache_secs = w.cache_secs.min(r.cache_secs);
                    w.timeout_ms = w.timeout_ms.max(r.timeout_ms);
                })
                .or_insert_with(|| r.clone());
        }
    }
    wanted
}

/// Keeps the sources `auth` still names (their keys too), adds the new ones due at once.
fn reconcile(sources: &mut BTreeMap<String, Source>, auth: Option<&AuthConfig>, now: Instant) {
    let wanted = wanted(auth);
    sources.retain(|uri, _| wanted.contains_key(uri));
    for (uri, remote) in wanted {
        match sources.get_mut(&uri) {
            Some(source) => {
                let sooner = remote.cache_secs < source.remote.cache_secs;
                source.remote = remote;
                if sooner {
                    source.due = source.due.min(now + refresh(&source.remote));
                }
            }
            None => {
                sources.insert(
                    uri,
                    Source {
                        remote,
                        keys: None,
                        due: now,
                        failing: None,
                        tried: false,
                    },
                );
            }
        }
    }
}

fn refresh(remote: &RemoteJwks) -> Duration {
    Duration::from_secs(u64::from(remote.cache_secs))
}

impl Source {
    /// Takes a fetch's outcome; whether the keys handed to Envoy change.
    fn settle(&mut self, uri: &str, result: Result<Value, String>, metrics: &Metrics) -> bool {
        let first = !self.tried;
        self.tried = true;
        match result {
            Ok(set) => {
                metrics
                    .jwks_fetches
                    .get_or_create(&JwksLabel { result: "ok" })
                    .inc();
                self.due = Instant::now() + refresh(&self.remote);
                if let Some(was) = self.failing.take() {
                    info!(%uri, after = %was, "JWKS fetched again");
                }
                let text: Arc<str> = Arc::from(set.to_string());
                if self.keys.as_deref() == Some(&*text) {
                    return first;
                }
                if kids(&set).is_empty() {
                    warn!(%uri, "the JWKS holds no key now: tokens of its issuers are refused");
                } else {
                    info!(%uri, kids = ?kids(&set), "JWKS keys changed: Envoy verifies with these now");
                }
                self.keys = Some(text);
                true
            }
            Err(e) => {
                metrics
                    .jwks_fetches
                    .get_or_create(&JwksLabel { result: "failed" })
                    .inc();
                self.due = Instant::now() + RETRY_AFTER;
                if self.failing.as_deref() != Some(e.as_str()) {
                    if self.keys.is_some() {
                        warn!(%uri, error = %e, "JWKS fetch failed: the keys fetched before stay in use; retrying every second");
                    } else {
                        warn!(%uri, error = %e, "JWKS fetch failed and no keys were ever fetched: tokens of its issuers are refused until one succeeds; retrying every second");
                    }
                }
                self.failing = Some(e);
                first
            }
        }
    }
}

/// The `kid`s of a set, for the log (keys without one show as `-`).
fn kids(set: &Value) -> Vec<&str> {
    set["keys"]
        .as_array()
        .map(|keys| {
            keys.iter()
                .map(|k| k["kid"].as_str().unwrap_or("-"))
                .collect()
        })
        .unwrap_or_default()
}

/// One fetch: the set, or why there is none.
async fn fetch(client: &IdpClient, remote: &RemoteJwks) -> Result<Value, String> {
    let timeout = Duration::from_millis(u64::from(remote.timeout_ms));
    let body = client
        .get(&remote.uri, timeout)
        .await
        .map_err(|e: FetchError| e.to_string())?;
    parse_set(&body)
}

/// A JWKS as RFC 7517 §5 has it: an object whose `keys` is an array of key objects. Envoy
/// checks each key further (and skips those it cannot use); an answer that is no JWKS at
/// all is a failed fetch, so the last good set stays. An empty set is a set: a provider that
/// withdrew every key wants its tokens refused, not the old keys kept.
pub fn parse_set(body: &[u8]) -> Result<Value, String> {
    let set: Value =
        serde_json::from_slice(body).map_err(|e| format!("the answer is not JSON: {e}"))?;
    let keys = set
        .get("keys")
        .and_then(Value::as_array)
        .ok_or("the answer is no JWKS: no `keys` array")?;
    if keys.len() > MAX_KEYS {
        return Err(format!(
            "the JWKS holds {} keys (at most {MAX_KEYS})",
            keys.len()
        ));
    }
    if let Some(i) = keys.iter().position(|k| !k.is_object()) {
        return Err(format!("keys[{i}] is not a JSON object"));
    }
    Ok(set)
}

/// Hands the keys to the registry, which publishes them when they differ.
fn publish(registry: &RwLock<Registry>, publisher: &Publisher, sources: &BTreeMap<String, Source>) {
    let keys = FetchedKeys {
        sets: sources
            .iter()
            .filter_map(|(uri, s)| Some((uri.clone(), s.keys.clone()?)))
            .collect(),
        tried: sources
            .iter()
            .filter(|(_, s)| s.tried)
            .map(|(uri, _)| uri.clone())
            .collect::<BTreeSet<String>>(),
    };
    let changed = registry
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .set_fetched_keys(keys);
    if changed {
        publisher.changed(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(issuers: serde_json::Value) -> AuthConfig {
        AuthConfig::parse(
            serde_json::json!({
                "resource": "https://gw.example.com",
                "authorization_servers": ["https://idp.example.com"],
                "issuers": issuers
            })
            .to_string()
            .as_bytes(),
        )
        .expect("valid")
    }

    #[test]
    fn a_set_must_be_a_jwks() {
        assert!(parse_set(br#"{"keys":[{"kty":"EC"}]}"#).is_ok());
        // Every key withdrawn: applied, so their tokens stop verifying.
        assert!(parse_set(br#"{"keys":[]}"#).is_ok());
        for (body, why) in [
            (&b"<html>"[..], "not JSON"),
            (br#"{"key":[]}"#, "no `keys`"),
            (br#"{"keys":[1]}"#, "keys[0]"),
        ] {
            let e = parse_set(body).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
        let many = serde_json::json!({"keys": vec![serde_json::json!({}); 101]});
        assert!(parse_set(many.to_string().as_bytes()).is_err());
    }

    #[test]
    fn issuers_sharing_a_url_share_a_fetch_at_the_shortest_refresh() {
        let auth = config(serde_json::json!([
            {"issuer": "a", "jwks": {"remote": {"uri": "https://idp/jwks", "cache_secs": 60}}},
            {"issuer": "b", "jwks": {"remote": {"uri": "https://idp/jwks", "cache_secs": 5,
                                                "timeout_ms": 100}}},
            {"issuer": "c", "jwks": {"inline": {"keys": [{"kty": "EC"}]}}}
        ]));
        let w = wanted(Some(&auth));
        assert_eq!(w.len(), 1);
        assert_eq!(w["https://idp/jwks"].cache_secs, 5);
        assert_eq!(w["https://idp/jwks"].timeout_ms, 2000);
    }

    #[test]
    fn a_failed_fetch_keeps_the_last_good_set_and_an_equal_one_changes_nothing() {
        let metrics = Metrics::new();
        let auth = config(serde_json::json!([
            {"issuer": "a", "jwks": {"remote": {"uri": "https://idp/jwks"}}}
        ]));
        let mut sources = BTreeMap::new();
        let now = Instant::now();
        reconcile(&mut sources, Some(&auth), now);
        let s = sources.get_mut("https://idp/jwks").expect("source");
        assert!(!s.tried && s.due == now);
        // The first attempt changes what is handed on even when it fails (tried now).
        assert!(s.settle("u", Err("refused".into()), &metrics));
        assert!(s.keys.is_none() && s.failing.is_some());
        let set = parse_set(br#"{"keys":[{"kty":"EC","kid":"k1"}]}"#).expect("set");
        assert!(s.settle("u", Ok(set.clone()), &metrics));
        assert!(s.failing.is_none());
        assert!(!s.settle("u", Ok(set), &metrics), "the same keys again");
        assert!(!s.settle("u", Err("timeout".into()), &metrics));
        assert!(s.keys.as_deref().is_some_and(|k| k.contains("k1")), "kept");
        let other = parse_set(br#"{"keys":[{"kty":"EC","kid":"k2"}]}"#).expect("set");
        assert!(s.settle("u", Ok(other), &metrics));
        // Dropped from the configuration: forgotten.
        reconcile(&mut sources, None, now);
        assert!(sources.is_empty());
    }
}
