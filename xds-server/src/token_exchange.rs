//! Each caller's token exchanged (RFC 8693) for one meant for a service's servers, when the
//! service's credential (`<prefix>auth/upstream/<service>`) is an `exchange`: the filters ask
//! for it per call (`POST /v1/token-exchange`, see `admin/token_exchange.rs`) with the
//! caller's verified token, and add the answer's header to the call.
//!
//! toolgate-xds authenticates to the identity provider as its own client
//! (`client_secret_basic`, RFC 6749 §2.3.1), its secret read by reference at each exchange.
//! An issued token is cached per (service, SHA-256 of the caller's token) until shortly before
//! it expires, and with the configuration it was made with: a changed audience, scope,
//! provider or header format is a miss. Concurrent misses for one key make one request.
//!
//! Neither the caller's token, the client secret nor an issued token is ever logged, nor put
//! in an error: `Exchanged`'s value shows redacted, errors carry the provider's OAuth error
//! code and description (sanitized) or the secret's reference.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use toolgate_model::upstream_auth::{TokenExchange, UpstreamCredential, MAX_SECRET_BYTES};

use crate::idp::{Answer, FetchError, IdpClient};
use crate::metrics::{ExchangeLabel, Metrics};
use crate::registry::Registry;
use crate::upstream_credentials::SecretValue;

/// RFC 8693's `grant_type`.
pub const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// RFC 8693's token type of an access token: what the caller's token is (Envoy verified it as
/// one) and what is asked for.
pub const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";
/// The largest subject token the filters may send, and the largest access token accepted
/// from a provider: the bound of a secret (a header value of a few kilobytes at most).
pub const MAX_TOKEN_BYTES: usize = MAX_SECRET_BYTES;
/// How long an issued token is taken to live when the answer has no `expires_in` (RFC 6749
/// §5.1 makes it optional): short, so that a token the provider meant to be brief is not
/// reused long.
pub const DEFAULT_EXPIRES_IN: Duration = Duration::from_secs(60);
/// The longest an issued token is cached, whatever `expires_in` says: the entry is keyed on
/// a caller's token, which lives far less, and an absurd lifetime must not overflow a clock.
pub const MAX_EXPIRES_IN: Duration = Duration::from_secs(24 * 3600);
/// A cached token stops being handed out this long before it expires (or a fifth of its
/// life, if shorter): a server must not get a token that expires on the way.
const EXPIRY_MARGIN: Duration = Duration::from_secs(30);
/// The longest OAuth error code kept (RFC 6749 names are short); a longer one is cut.
const MAX_ERROR_CODE: usize = 64;
/// The longest provider description kept for the log.
const MAX_DESCRIPTION: usize = 256;

/// How long an exchange may take and how many issued tokens are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The whole request to the provider, the answer read included. The filter waits 12 s
    /// for toolgate-xds; this leaves it room to answer with the failure.
    pub timeout: Duration,
    /// Cached tokens across services and callers.
    pub max_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(5),
            max_entries: 10_000,
        }
    }
}

/// The header a call to the service carries for this caller, and how long it may be reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchanged {
    /// Lower case.
    pub header: String,
    /// The credential's `format` with the issued token in it; redacted in `Debug`.
    pub value: SecretValue,
    /// How long the filter may reuse it for this caller (what is left of it, when cached).
    pub use_for: Duration,
}

/// Why no token: `code()` for the filter, `why(service)` for the agent, `Display` for the
/// log. None of them holds a token or a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error("no token exchange is configured")]
    NotConfigured,
    /// The provider answered with an OAuth error (RFC 6749 §5.2).
    #[error("the identity provider refused: {error}: {description}")]
    Refused {
        /// The OAuth error code, reduced to `[A-Za-z0-9_.-]` and 64 characters.
        error: String,
        /// The provider's `error_description`, for the log only (the agent gets the code).
        description: String,
    },
    #[error("the token endpoint is unreachable: {0}")]
    Unreachable(String),
    #[error("the token endpoint did not answer in time")]
    Timeout,
    #[error("the token endpoint's answer is not a usable token: {0}")]
    BadAnswer(String),
    /// The error names the reference (`file:/run/s/client`), never a value.
    #[error("the client secret is unreadable: {0}")]
    ClientSecret(String),
}

impl ExchangeError {
    /// A stable name for the filters and the answers.
    pub fn code(&self) -> &'static str {
        match self {
            ExchangeError::NotConfigured => "not_configured",
            ExchangeError::Refused { .. } => "refused",
            ExchangeError::Unreachable(_) => "unreachable",
            ExchangeError::Timeout => "timeout",
            ExchangeError::BadAnswer(_) => "bad_answer",
            ExchangeError::ClientSecret(_) => "client_secret",
        }
    }

    /// A sentence for the agent whose call is refused. The details (the provider's
    /// description, addresses, the secret's reference) are the operator's, in the log.
    pub fn why(&self, service: &str) -> String {
        let short = match self {
            ExchangeError::NotConfigured => {
                return format!("{service} has no token exchange configured")
            }
            ExchangeError::Refused { error, .. } => {
                return format!(
                    "the identity provider refused to issue a token for {service}: {error}"
                )
            }
            ExchangeError::Unreachable(_) => "its identity provider is unreachable",
            ExchangeError::Timeout => "its identity provider did not answer in time",
            ExchangeError::BadAnswer(_) => "its identity provider's answer is not a usable token",
            ExchangeError::ClientSecret(_) => "its client credential is unreadable",
        };
        format!("the gateway could not get a token for {service}: {short}")
    }

    /// The metric's result: the provider said no, or no answer could be had.
    fn result(&self) -> &'static str {
        match self {
            ExchangeError::Refused { .. } => "refused",
            _ => "failed",
        }
    }
}

/// (service, SHA-256 of the caller's token): the token itself is not kept.
type Key = (String, [u8; 32]);

/// What one exchange gave, shared with the calls that waited for it.
type Outcome = Result<Exchanged, ExchangeError>;

/// One exchange in flight for a key: its outcome once known, for the calls that waited.
type Flight = Arc<tokio::sync::Mutex<Option<Outcome>>>;

struct Entry {
    /// The configuration the token was asked with; another one now makes this a miss.
    credential: UpstreamCredential,
    value: SecretValue,
    valid_until: Instant,
}

/// Issued tokens, bounded.
struct Cache {
    entries: HashMap<Key, Entry>,
    max: usize,
}

impl Cache {
    fn get(&self, key: &Key, credential: &UpstreamCredential, now: Instant) -> Option<Exchanged> {
        let e = self.entries.get(key)?;
        if e.credential != *credential || e.valid_until <= now {
            return None;
        }
        Some(Exchanged {
            header: e.credential.header.clone(),
            value: e.value.clone(),
            use_for: e.valid_until - now,
        })
    }

    /// At the bound: the expired entries go, then the ones expiring soonest, down to a tenth
    /// below the bound, so that a full cache is not scanned again at every insert.
    fn insert(&mut self, key: Key, entry: Entry, now: Instant) {
        if self.max == 0 {
            return;
        }
        if !self.entries.contains_key(&key) && self.entries.len() >= self.max {
            self.entries.retain(|_, e| e.valid_until > now);
            let keep = self.max.saturating_sub(1 + self.max / 10);
            if self.entries.len() > keep {
                let mut by_expiry: Vec<(Instant, &Key)> = self
                    .entries
                    .iter()
                    .map(|(k, e)| (e.valid_until, k))
                    .collect();
                let drop = self.entries.len() - keep;
                // O(n): the `drop` soonest first, in no order among themselves.
                by_expiry.select_nth_unstable_by_key(drop - 1, |(until, _)| *until);
                let gone: Vec<Key> = by_expiry[..drop]
                    .iter()
                    .map(|(_, k)| (*k).clone())
                    .collect();
                for k in gone {
                    self.entries.remove(&k);
                }
            }
        }
        self.entries.insert(key, entry);
    }
}

/// Exchanges callers' tokens; cheap to clone (one cache and client for all clones).
#[derive(Clone)]
pub struct Exchanger {
    inner: Arc<Inner>,
}

struct Inner {
    idp: IdpClient,
    /// Where each service's current credential is read, at each call: a changed one takes
    /// effect at once, and a removed one ends the exchanges.
    registry: Arc<RwLock<Registry>>,
    metrics: Arc<Metrics>,
    timeout: Duration,
    cache: Mutex<Cache>,
    /// The exchanges in flight, by key; an entry lives while some call holds it.
    flights: Mutex<HashMap<Key, Flight>>,
}

impl std::fmt::Debug for Exchanger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchanger").finish_non_exhaustive()
    }
}

/// A call's hold on its key's flight: the last one out removes the flight from the map, also
/// when the call is dropped halfway (its filter went away).
struct Joined<'a> {
    flights: &'a Mutex<HashMap<Key, Flight>>,
    key: Key,
    flight: Flight,
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        // Counted under the map's lock, where every other holder took its clone: two is the
        // map's and this one's, so no call waits on this flight any more.
        let last = Arc::strong_count(&self.flight) == 2
            && flights
                .get(&self.key)
                .is_some_and(|f| Arc::ptr_eq(f, &self.flight));
        if last {
            flights.remove(&self.key);
        }
    }
}

impl Exchanger {
    pub fn new(idp: IdpClient, registry: Arc<RwLock<Registry>>, metrics: Arc<Metrics>) -> Self {
        Exchanger::with_limits(idp, registry, metrics, Limits::default())
    }

    pub fn with_limits(
        idp: IdpClient,
        registry: Arc<RwLock<Registry>>,
        metrics: Arc<Metrics>,
        limits: Limits,
    ) -> Self {
        Exchanger {
            inner: Arc::new(Inner {
                idp,
                registry,
                metrics,
                timeout: limits.timeout,
                cache: Mutex::new(Cache {
                    entries: HashMap::new(),
                    max: limits.max_entries,
                }),
                flights: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The header for a call of `subject_token`'s caller to `service`: cached, or exchanged
    /// at the service's identity provider now.
    pub async fn exchange(&self, service: &str, subject_token: &str) -> Outcome {
        let Some(credential) = self.credential(service) else {
            // The filter's configuration is behind the registry's: not an exchange to count.
            tracing::debug!(%service, "token exchange asked for a service without one");
            return Err(ExchangeError::NotConfigured);
        };
        let key: Key = (service.to_string(), Sha256::digest(subject_token).into());
        if let Some(hit) = self.cached(&key, &credential) {
            self.count(service, "cached");
            return Ok(hit);
        }
        let joined = self.join(key);
        let mut outcome = joined.flight.lock().await;
        if let Some(shared) = outcome.as_ref() {
            // Another call made the request while this one waited: its answer is this one's.
            let result = match shared {
                Ok(_) => "cached",
                Err(e) => e.result(),
            };
            self.count(service, result);
            return shared.clone();
        }
        // A flight that ended just before this one began may have filled the cache.
        if let Some(hit) = self.cached(&joined.key, &credential) {
            self.count(service, "cached");
            return Ok(hit);
        }
        let made = self.request(service, &credential, subject_token).await;
        match &made {
            Ok(x) => {
                self.count(service, "issued");
                if !x.use_for.is_zero() {
                    let now = Instant::now();
                    let entry = Entry {
                        credential: credential.clone(),
                        value: x.value.clone(),
                        valid_until: now + x.use_for,
                    };
                    self.lock_cache().insert(joined.key.clone(), entry, now);
                }
            }
            Err(e) => self.count(service, e.result()),
        }
        *outcome = Some(made.clone());
        made
    }

    /// `service`'s credential if it is an exchange.
    fn credential(&self, service: &str) -> Option<UpstreamCredential> {
        let registry = self
            .inner
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner());
        registry
            .auth_upstream(service)
            .filter(|c| c.exchange.is_some())
            .cloned()
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.inner.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, key: &Key, credential: &UpstreamCredential) -> Option<Exchanged> {
        self.lock_cache().get(key, credential, Instant::now())
    }

    fn join(&self, key: Key) -> Joined<'_> {
        let flights = &self.inner.flights;
        let flight = Arc::clone(
            flights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(key.clone())
                .or_default(),
        );
        Joined {
            flights,
            key,
            flight,
        }
    }

    fn count(&self, service: &str, result: &'static str) {
        self.inner
            .metrics
            .token_exchanges
            .get_or_create(&ExchangeLabel {
                service: service.to_string(),
                result,
            })
            .inc();
    }

    /// One token request to the provider, logged.
    async fn request(
        &self,
        service: &str,
        credential: &UpstreamCredential,
        subject_token: &str,
    ) -> Outcome {
        let Some(x) = &credential.exchange else {
            return Err(ExchangeError::NotConfigured);
        };
        match self.ask(x, subject_token).await.and_then(read_answer) {
            Ok((token, expires_in)) => {
                tracing::debug!(%service, expires_in_s = expires_in.as_secs(),
                    "token exchanged for a caller");
                Ok(Exchanged {
                    header: credential.header.clone(),
                    value: SecretValue::new(credential.value(&token)),
                    use_for: use_for(expires_in),
                })
            }
            Err(e) => {
                let (error, description) = match &e {
                    ExchangeError::Refused { error, description } => {
                        (error.as_str(), description.as_str())
                    }
                    _ => ("", ""),
                };
                tracing::warn!(%service, failure = e.code(), error, description,
                    token_endpoint = %x.token_endpoint, detail = %e,
                    "token exchange for a caller failed: the call is refused");
                Err(e)
            }
        }
    }

    /// Sends the token request (RFC 8693 §2.1) and gives back the answer as it came.
    async fn ask(&self, x: &TokenExchange, subject_token: &str) -> Result<Answer, ExchangeError> {
        // Read at each request (misses are rare): a rotated secret is in use at once.
        let secret = x
            .client
            .secret
            .read()
            .map_err(ExchangeError::ClientSecret)?;
        let authorization = basic_credentials(&x.client.id, &secret);
        self.inner
            .idp
            .post_form(
                &x.token_endpoint,
                Some(&authorization),
                token_request(x, subject_token),
                self.inner.timeout,
            )
            .await
            .map_err(|e| match e {
                FetchError::Timeout(_) => ExchangeError::Timeout,
                FetchError::Body(e) => ExchangeError::BadAnswer(format!("unreadable answer: {e}")),
                FetchError::Status(status) => {
                    ExchangeError::BadAnswer(format!("answered HTTP {status}"))
                }
                FetchError::Url(e) | FetchError::Transport(e) => ExchangeError::Unreachable(e),
            })
    }
}

/// The form of RFC 8693 §2.1. Made apart from any `await`: the serializer is not `Send`.
fn token_request(x: &TokenExchange, subject_token: &str) -> String {
    let mut form = form_urlencoded::Serializer::new(String::new());
    form.append_pair("grant_type", TOKEN_EXCHANGE_GRANT)
        .append_pair("subject_token", subject_token)
        .append_pair("subject_token_type", ACCESS_TOKEN_TYPE)
        .append_pair("requested_token_type", ACCESS_TOKEN_TYPE)
        .append_pair("audience", &x.audience);
    if !x.scopes.is_empty() {
        form.append_pair("scope", &x.scopes.join(" "));
    }
    form.finish()
}

/// `Basic base64(id ":" secret)`, each form-urlencoded first (RFC 6749 §2.3.1), so that a
/// `:` or a non-ASCII character in either survives.
fn basic_credentials(id: &str, secret: &str) -> String {
    let encode = |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let pair = format!("{}:{}", encode(id), encode(secret));
    format!("Basic {}", STANDARD.encode(pair))
}

/// How long an issued token may be handed out: its life but for a margin.
fn use_for(expires_in: Duration) -> Duration {
    expires_in - EXPIRY_MARGIN.min(expires_in / 5)
}

/// The issued token and its lifetime, or why the answer is no token. Messages never quote
/// the answer's fields but the error code and description, which are about the request.
fn read_answer(answer: Answer) -> Result<(String, Duration), ExchangeError> {
    let bad = |why: &str| ExchangeError::BadAnswer(why.to_string());
    let json: Option<Value> = serde_json::from_slice(&answer.body).ok();
    if answer.status != 200 {
        let error = json
            .as_ref()
            .and_then(|j| j.get("error"))
            .and_then(Value::as_str);
        return Err(match error {
            Some(error) => ExchangeError::Refused {
                error: sanitize_code(error),
                description: json
                    .as_ref()
                    .and_then(|j| j.get("error_description"))
                    .and_then(Value::as_str)
                    .map(sanitize_description)
                    .unwrap_or_default(),
            },
            // Not an OAuth answer: a provider (or a proxy before it) that is down.
            None if answer.status >= 500 => {
                ExchangeError::Unreachable(format!("answered HTTP {}", answer.status))
            }
            None => ExchangeError::BadAnswer(format!(
                "answered HTTP {} without an OAuth error",
                answer.status
            )),
        });
    }
    let json = json.ok_or_else(|| bad("a 200 whose body is not JSON"))?;
    let token = json
        .get("access_token")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("no access_token string"))?;
    // A header value: visible ASCII only (RFC 6750's b64token is a subset), so that no line
    // break or space can add to the call what the provider's answer chose.
    if token.is_empty()
        || token.len() > MAX_TOKEN_BYTES
        || !token.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(bad(&format!(
            "the access_token is not 1 to {MAX_TOKEN_BYTES} visible ASCII characters"
        )));
    }
    match json.get("token_type") {
        None => {}
        Some(Value::String(t)) if t.eq_ignore_ascii_case("bearer") || t == "N_A" => {}
        Some(Value::String(t)) => {
            return Err(bad(&format!(
                "token_type {} is not Bearer",
                sanitize_code(t)
            )))
        }
        Some(_) => return Err(bad("token_type is not a string")),
    }
    let expires_in = match json.get("expires_in") {
        None | Some(Value::Null) => DEFAULT_EXPIRES_IN,
        Some(v) => seconds(v).ok_or_else(|| bad("expires_in is not a number of seconds"))?,
    };
    Ok((token.to_string(), expires_in.min(MAX_EXPIRES_IN)))
}

/// A number of seconds, as a number or (some providers) a string of digits.
fn seconds(v: &Value) -> Option<Duration> {
    match v {
        Value::Number(n) => n.as_u64().map(Duration::from_secs).or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                .map(|f| Duration::from_secs(f.min(MAX_EXPIRES_IN.as_secs_f64()) as u64))
        }),
        Value::String(s) => s.parse::<u64>().ok().map(Duration::from_secs),
        _ => None,
    }
}

/// An OAuth error code as the agent and the metrics may see it: `[A-Za-z0-9_.-]`, 64 at
/// most, never empty.
fn sanitize_code(s: &str) -> String {
    let code: String = s
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        .take(MAX_ERROR_CODE)
        .collect();
    if code.is_empty() {
        "unnamed".to_string()
    } else {
        code
    }
}

/// A provider's description for one log line: no control character (no forged line), bounded.
fn sanitize_description(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_DESCRIPTION)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use toolgate_model::KeyLayout;
    use toolgate_tests::issuer::Issuer;

    const CLIENT: &str = "toolgate:gateway";
    /// A secret that form encoding and base64 must both carry: `+`, `/`, `=`, `:`, `&`, `%`.
    const SECRET: &str = "s3cret+/=:&%-value";
    pub(crate) const AUDIENCE: &str = "https://orders.example/mcp";

    /// A test issuer whose token endpoint knows toolgate-xds's client, and a registry where
    /// `orders` exchanges callers' tokens there for [`AUDIENCE`].
    pub(crate) struct Setup {
        pub(crate) issuer: Issuer,
        registry: Arc<RwLock<Registry>>,
        metrics: Arc<Metrics>,
        dir: PathBuf,
        revision: i64,
    }

    impl Setup {
        pub(crate) async fn new(name: &str) -> Setup {
            let issuer = Issuer::start().await;
            issuer.register_client(CLIENT, SECRET);
            let dir = std::env::temp_dir()
                .join(format!("toolgate-exchange-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            std::fs::write(dir.join("client"), format!("{SECRET}\n")).expect("secret");
            let mut setup = Setup {
                issuer,
                registry: Arc::new(RwLock::new(Registry::new(KeyLayout::default()))),
                metrics: Arc::new(Metrics::new()),
                dir,
                revision: 1,
            };
            let endpoint = setup.issuer.token_endpoint();
            setup.configure("orders", &endpoint, AUDIENCE, "Bearer {secret}");
            setup
        }

        fn configure(&mut self, service: &str, endpoint: &str, audience: &str, format: &str) {
            let credential = serde_json::json!({
                "format": format,
                "exchange": {
                    "token_endpoint": endpoint,
                    "audience": audience,
                    "scopes": ["orders:read", "orders:write"],
                    "client": {"id": CLIENT, "secret": format!("file:{}", self.dir.join("client").display())}
                }
            });
            self.revision += 1;
            self.registry
                .write()
                .expect("registry")
                .put(
                    &format!("/mcp/auth/upstream/{service}"),
                    credential.to_string().as_bytes(),
                    0,
                    self.revision,
                    self.revision,
                )
                .expect("admitted");
        }

        pub(crate) fn exchanger(&self, limits: Limits) -> Exchanger {
            let idp = IdpClient::new(Path::new("/nonexistent-ca.pem")).expect("client");
            Exchanger::with_limits(
                idp,
                Arc::clone(&self.registry),
                Arc::clone(&self.metrics),
                limits,
            )
        }

        pub(crate) fn subject(&self, sub: &str) -> String {
            self.issuer
                .token()
                .sub(sub)
                .aud("http://127.0.0.1:1/mcp")
                .expires_in(Duration::from_secs(3600))
                .sign()
        }

        fn counted(&self, service: &str, result: &'static str) -> u64 {
            self.metrics
                .token_exchanges
                .get_or_create(&ExchangeLabel {
                    service: service.to_string(),
                    result,
                })
                .get()
        }
    }

    impl Drop for Setup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// The claims of a JWT, unverified (the issuer's own tests verify its signatures).
    fn claims(header_value: &str) -> Value {
        let token = header_value
            .strip_prefix("Bearer ")
            .expect("a bearer value");
        let payload = token.split('.').nth(1).expect("a JWT");
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .expect("base64url");
        serde_json::from_slice(&bytes).expect("JSON claims")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_token_is_issued_for_the_audience_then_cached() {
        let s = Setup::new("issued").await;
        let x = s.exchanger(Limits::default());
        let subject = s.subject("alice");
        let issued = x.exchange("orders", &subject).await.expect("issued");
        assert_eq!(issued.header, "authorization");
        let alice = claims(issued.value.expose());
        assert_eq!(alice["sub"], "alice");
        assert_eq!(alice["aud"], AUDIENCE);
        assert_eq!(alice["scope"], "orders:read orders:write");
        assert_eq!(alice["client_id"], CLIENT, "Basic, form-encoded");
        // 300 s of life, 30 s of margin.
        assert!(
            issued.use_for <= Duration::from_secs(270)
                && issued.use_for >= Duration::from_secs(268),
            "{:?}",
            issued.use_for
        );
        assert_eq!(s.issuer.exchanges(), 1);

        let again = x.exchange("orders", &subject).await.expect("cached");
        assert_eq!(again.value, issued.value);
        assert!(again.use_for <= issued.use_for);
        assert_eq!(s.issuer.exchanges(), 1, "no second request");
        // A clone shares the cache.
        let clone = x.clone();
        assert_eq!(
            clone.exchange("orders", &subject).await.expect("ok").value,
            issued.value
        );
        // Another caller is another token.
        let bob = x.exchange("orders", &s.subject("bob")).await.expect("bob");
        assert_eq!(claims(bob.value.expose())["sub"], "bob");
        assert_eq!(s.issuer.exchanges(), 2);
        assert_eq!(s.counted("orders", "issued"), 2);
        assert_eq!(s.counted("orders", "cached"), 2);
        assert!(!format!("{issued:?}").contains(issued.value.expose()));
        assert_eq!(
            x.exchange("stock", &subject).await,
            Err(ExchangeError::NotConfigured)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refusal_names_its_oauth_error_and_is_not_cached() {
        let s = Setup::new("refused").await;
        s.issuer.refuse_target(AUDIENCE);
        let x = s.exchanger(Limits::default());
        let subject = s.subject("alice");
        for _ in 0..2 {
            let e = x.exchange("orders", &subject).await.expect_err("refused");
            assert_eq!(e.code(), "refused");
            assert!(
                matches!(&e, ExchangeError::Refused { error, description }
                    if error == "invalid_target" && description.contains(AUDIENCE)),
                "{e:?}"
            );
            assert_eq!(
                e.why("orders"),
                "the identity provider refused to issue a token for orders: invalid_target"
            );
        }
        assert_eq!(s.issuer.exchange_refusals(), 2, "each call asked");
        assert_eq!(s.counted("orders", "refused"), 2);
        // A subject token the provider did not sign.
        let e = x
            .exchange("orders", "not-a-jwt")
            .await
            .expect_err("refused");
        assert!(matches!(&e, ExchangeError::Refused { error, .. } if error == "invalid_grant"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_changed_configuration_is_a_miss() {
        let mut s = Setup::new("changed").await;
        let x = s.exchanger(Limits::default());
        let subject = s.subject("alice");
        let first = x.exchange("orders", &subject).await.expect("issued");
        let endpoint = s.issuer.token_endpoint();
        s.configure(
            "orders",
            &endpoint,
            "https://orders-v2.example/mcp",
            "Bearer {secret}",
        );
        let second = x.exchange("orders", &subject).await.expect("issued");
        assert_eq!(
            claims(second.value.expose())["aud"],
            "https://orders-v2.example/mcp"
        );
        assert_ne!(first.value, second.value);
        assert_eq!(s.issuer.exchanges(), 2);
        // Only the format: the same provider would answer alike, but the header differs.
        s.configure(
            "orders",
            &endpoint,
            "https://orders-v2.example/mcp",
            "Token {secret}",
        );
        let third = x.exchange("orders", &subject).await.expect("issued");
        assert!(third.value.expose().starts_with("Token "));
        assert_eq!(s.issuer.exchanges(), 3);
        assert_eq!(
            x.exchange("orders", &subject).await.expect("cached").value,
            third.value
        );
        assert_eq!(s.issuer.exchanges(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_bound_evicts_the_tokens_expiring_soonest() {
        let s = Setup::new("bound").await;
        let x = s.exchanger(Limits {
            max_entries: 3,
            ..Limits::default()
        });
        let subjects: Vec<String> = (0..4).map(|i| s.subject(&format!("user-{i}"))).collect();
        for subject in &subjects {
            x.exchange("orders", subject).await.expect("issued");
        }
        assert_eq!(s.issuer.exchanges(), 4);
        assert!(x.lock_cache().entries.len() <= 3);
        // The newest stayed, the oldest (expiring soonest) went.
        x.exchange("orders", &subjects[3]).await.expect("cached");
        assert_eq!(s.issuer.exchanges(), 4);
        x.exchange("orders", &subjects[0])
            .await
            .expect("issued again");
        assert_eq!(s.issuer.exchanges(), 5);
        assert!(x.lock_cache().entries.len() <= 3);
    }

    #[test]
    fn the_bound_drops_expired_entries_first() {
        let credential = UpstreamCredential::parse(br#"{"secret": "env:UNUSED"}"#).expect("ok");
        let mut cache = Cache {
            entries: HashMap::new(),
            max: 20,
        };
        let now = Instant::now();
        let entry = |until: Instant| Entry {
            credential: credential.clone(),
            value: SecretValue::new("v"),
            valid_until: until,
        };
        let key = |i: u8| ("orders".to_string(), [i; 32]);
        for i in 0..20 {
            // Every other one expired; the live ones expire later the higher `i`.
            let until = if i % 2 == 0 {
                now
            } else {
                now + Duration::from_secs(u64::from(i))
            };
            cache.insert(key(i), entry(until), now);
        }
        assert_eq!(cache.entries.len(), 20);
        cache.insert(key(100), entry(now + Duration::from_secs(1000)), now);
        assert_eq!(cache.entries.len(), 11, "the expired ones only");
        for i in 0..9 {
            cache.insert(key(101 + i), entry(now + Duration::from_secs(1000)), now);
        }
        assert_eq!(cache.entries.len(), 20);
        // None expired now: the soonest go, down to a tenth below the bound.
        cache.insert(key(200), entry(now + Duration::from_secs(1000)), now);
        assert_eq!(cache.entries.len(), 18);
        for gone in [1, 3, 5] {
            assert!(!cache.entries.contains_key(&key(gone)), "{gone}");
        }
        assert!(cache.get(&key(7), &credential, now).is_some());
        assert!(cache
            .get(&key(7), &credential, now + Duration::from_secs(7))
            .is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_misses_make_one_request() {
        let mut s = Setup::new("flight").await;
        let x = s.exchanger(Limits::default());
        let subject = s.subject("alice");
        let calls: Vec<_> = (0..16)
            .map(|_| {
                let x = x.clone();
                let subject = subject.clone();
                tokio::spawn(async move { x.exchange("orders", &subject).await })
            })
            .collect();
        let mut values = Vec::new();
        for call in calls {
            values.push(call.await.expect("joined").expect("issued").value);
        }
        assert!(values.iter().all(|v| *v == values[0]));
        assert_eq!(s.issuer.exchanges(), 1);
        assert_eq!(s.counted("orders", "issued"), 1);
        assert_eq!(s.counted("orders", "cached"), 15);
        assert!(x.inner.flights.lock().expect("flights").is_empty());

        // A refusal is shared with the calls that waited for it too: a slow provider, so
        // that every call is made while the first one waits.
        let (endpoint, asked) = serve(
            http("400 Bad Request", r#"{"error": "invalid_target"}"#),
            Duration::from_millis(500),
        )
        .await;
        s.configure("orders", &endpoint, AUDIENCE, "Bearer {secret}");
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let x = x.clone();
                let subject = subject.clone();
                tokio::spawn(async move { x.exchange("orders", &subject).await })
            })
            .collect();
        for call in calls {
            let e = call.await.expect("joined").expect_err("refused");
            assert_eq!(e.code(), "refused");
        }
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(s.counted("orders", "refused"), 8);
        assert!(x.inner.flights.lock().expect("flights").is_empty());
    }

    /// A token endpoint answering every request with `answer` after `delay`. Its URL and the
    /// requests it was sent (one per connection: the answers close it).
    async fn serve(
        answer: &'static str,
        delay: Duration,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let _ = tcp.read(&mut [0u8; 8192]).await;
                    tokio::time::sleep(delay).await;
                    let _ = tcp.write_all(answer.as_bytes()).await;
                });
            }
        });
        (format!("http://127.0.0.1:{port}/token"), asked)
    }

    fn http(status: &str, body: &str) -> &'static str {
        Box::leak(
            format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        )
    }

    /// A token endpoint that answers one request with `answer` and hands over the request's
    /// head and body as sent.
    async fn capture(answer: &'static str) -> (String, tokio::sync::oneshot::Receiver<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let mut request = Vec::new();
            let mut buf = [0u8; 8192];
            // Until the whole body is in: the head's content-length says how much.
            loop {
                let Ok(n) = tcp.read(&mut buf).await else {
                    return;
                };
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_string)
                        })
                        .and_then(|l| l.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if body.len() >= length || n == 0 {
                        let _ = tx.send(text);
                        break;
                    }
                }
                if n == 0 {
                    return;
                }
            }
            let _ = tcp.write_all(answer.as_bytes()).await;
        });
        (format!("http://127.0.0.1:{port}/token"), rx)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_request_is_rfc_8693s() {
        let mut s = Setup::new("request").await;
        let x = s.exchanger(Limits::default());
        let (endpoint, sent) = capture(http(
            "200 OK",
            r#"{"access_token": "issued-token", "issued_token_type": "urn:ietf:params:oauth:token-type:access_token", "token_type": "Bearer", "expires_in": 10}"#,
        ))
        .await;
        s.configure("orders", &endpoint, "urn:orders & more", "Bearer {secret}");
        let issued = x
            .exchange("orders", "the+subject/token=")
            .await
            .expect("issued");
        assert_eq!(issued.value.expose(), "Bearer issued-token");
        assert_eq!(
            issued.use_for,
            Duration::from_secs(8),
            "a fifth of 10 s off"
        );
        let sent = sent.await.expect("a request");
        let (head, body) = sent.split_once("\r\n\r\n").expect("a head");
        let head = head.to_ascii_lowercase();
        assert!(head.starts_with("post /token http/1.1\r\n"), "{head}");
        assert!(head.contains("\r\ncontent-type: application/x-www-form-urlencoded\r\n"));
        assert!(head.contains("\r\naccept: application/json\r\n"));
        let basic = format!(
            "\r\nauthorization: {}\r\n",
            basic_credentials(CLIENT, SECRET).to_ascii_lowercase()
        );
        assert!(head.contains(&basic), "{head}");
        assert_eq!(
            body,
            "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Atoken-exchange\
             &subject_token=the%2Bsubject%2Ftoken%3D\
             &subject_token_type=urn%3Aietf%3Aparams%3Aoauth%3Atoken-type%3Aaccess_token\
             &requested_token_type=urn%3Aietf%3Aparams%3Aoauth%3Atoken-type%3Aaccess_token\
             &audience=urn%3Aorders+%26+more\
             &scope=orders%3Aread+orders%3Awrite"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failures_are_named_and_never_show_a_secret() {
        let mut s = Setup::new("failures").await;
        let x = s.exchanger(Limits {
            timeout: Duration::from_millis(300),
            ..Limits::default()
        });
        let subject = s.subject("alice");
        let format = "Bearer {secret}";
        let mut errors = Vec::new();
        let mut check = |e: ExchangeError, code: &str| {
            assert_eq!(e.code(), code, "{e:?}");
            errors.push(e);
        };

        // The provider does not know the client's secret.
        s.issuer.register_client(CLIENT, "another");
        check(
            x.exchange("orders", &subject).await.expect_err("401"),
            "refused",
        );
        s.issuer.register_client(CLIENT, SECRET);

        for (answer, delay, code) in [
            (
                http("500 Internal Server Error", "oops"),
                Duration::ZERO,
                "unreachable",
            ),
            (
                http("404 Not Found", "<html>"),
                Duration::ZERO,
                "bad_answer",
            ),
            (
                http(
                    "200 OK",
                    r#"{"access_token": "a b", "token_type": "Bearer"}"#,
                ),
                Duration::ZERO,
                "bad_answer",
            ),
            (
                http("200 OK", r#"{"access_token": "t", "token_type": "DPoP"}"#),
                Duration::ZERO,
                "bad_answer",
            ),
            (
                http("200 OK", r#"{"token_type": "Bearer"}"#),
                Duration::ZERO,
                "bad_answer",
            ),
            (
                http(
                    "503 Service Unavailable",
                    r#"{"error": "temporarily_unavailable\r\nX: y"}"#,
                ),
                Duration::ZERO,
                "refused",
            ),
            (http("200 OK", "{}"), Duration::from_secs(5), "timeout"),
        ] {
            let (endpoint, _) = serve(answer, delay).await;
            s.configure("orders", &endpoint, AUDIENCE, format);
            check(
                x.exchange("orders", &subject).await.expect_err(answer),
                code,
            );
        }
        // Nothing listens.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        s.configure(
            "orders",
            &format!("http://127.0.0.1:{closed}/token"),
            AUDIENCE,
            format,
        );
        check(
            x.exchange("orders", &subject).await.expect_err("closed"),
            "unreachable",
        );
        // The client secret's file is gone.
        std::fs::remove_file(s.dir.join("client")).expect("remove");
        let endpoint = s.issuer.token_endpoint();
        s.configure("orders", &endpoint, AUDIENCE, format);
        let e = x.exchange("orders", &subject).await.expect_err("no secret");
        assert!(e.to_string().contains("client"), "names the reference: {e}");
        assert_eq!(
            e.why("orders"),
            "the gateway could not get a token for orders: its client credential is unreadable"
        );
        check(e, "client_secret");

        for e in &errors {
            for shown in [e.to_string(), format!("{e:?}"), e.why("orders")] {
                assert!(!shown.contains("s3cret"), "{shown}");
                assert!(!shown.contains(&subject), "{shown}");
                assert!(!shown.contains('\n') && !shown.contains('\r'), "{shown}");
            }
        }
        assert!(errors.iter().any(|e| matches!(e,
            ExchangeError::Refused { error, .. } if error == "temporarily_unavailableXy")));
        assert_eq!(s.counted("orders", "failed"), 8);
        assert_eq!(s.counted("orders", "refused"), 2);
    }

    #[test]
    fn an_answer_is_read_strictly() {
        let ok = |body: &str| {
            read_answer(Answer {
                status: 200,
                body: body.to_string().into(),
            })
        };
        assert_eq!(
            ok(r#"{"access_token": "t", "token_type": "bearer", "expires_in": 600}"#),
            Ok(("t".to_string(), Duration::from_secs(600)))
        );
        assert_eq!(
            ok(r#"{"access_token": "t", "token_type": "N_A"}"#),
            Ok(("t".to_string(), DEFAULT_EXPIRES_IN))
        );
        assert_eq!(
            ok(r#"{"access_token": "t", "expires_in": "90"}"#).map(|a| a.1),
            Ok(Duration::from_secs(90))
        );
        assert_eq!(
            ok(r#"{"access_token": "t", "expires_in": 1e12}"#).map(|a| a.1),
            Ok(MAX_EXPIRES_IN)
        );
        for bad in [
            r#"{"access_token": "", "token_type": "Bearer"}"#,
            r#"{"access_token": "t\u0000", "token_type": "Bearer"}"#,
            r#"{"access_token": "tök"}"#,
            r#"{"access_token": 5}"#,
            r#"{"access_token": "t", "expires_in": -1}"#,
            r#"{"access_token": "t", "token_type": 1}"#,
            "not json",
        ] {
            assert_eq!(ok(bad).map_err(|e| e.code()), Err("bad_answer"), "{bad}");
        }
        let long = format!(
            r#"{{"access_token": "{}"}}"#,
            "a".repeat(MAX_TOKEN_BYTES + 1)
        );
        assert!(ok(&long).is_err());
        assert_eq!(use_for(Duration::from_secs(300)), Duration::from_secs(270));
        assert_eq!(use_for(Duration::from_secs(60)), Duration::from_secs(48));
        assert_eq!(use_for(Duration::ZERO), Duration::ZERO);
        assert_eq!(sanitize_code(&"x".repeat(100)).len(), MAX_ERROR_CODE);
        assert_eq!(sanitize_code("\u{1b}[31m"), "31m");
        assert_eq!(sanitize_code(""), "unnamed");
    }

    #[test]
    fn client_credentials_are_form_encoded_before_base64() {
        let value = basic_credentials("a:b c", "p+w/d=");
        let encoded = value.strip_prefix("Basic ").expect("basic");
        let decoded = String::from_utf8(STANDARD.decode(encoded).expect("b64")).expect("utf8");
        assert_eq!(decoded, "a%3Ab+c:p%2Bw%2Fd%3D");
    }
}
