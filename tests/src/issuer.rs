//! A local OAuth issuer for end-to-end tests: signing keys generated at test time (one RSA
//! 2048 key for RS256, one P-256 key for ES256), a JWKS served over HTTP on a free loopback
//! port, and a token builder that also makes the hostile tokens (expired, not yet valid,
//! wrong audience or issuer, `alg: none`, a tampered signature, an unknown `kid`).
//!
//! The JWKS server runs on its own thread and runtime, like [`FaultProxy`](crate::FaultProxy),
//! so it keeps answering while a test blocks. It can be stopped and restarted on the same
//! port (a JWKS endpoint that is down), keys can be published and withdrawn (rotation), and
//! it counts the fetches it answered.
//!
//! Beside the JWKS, the same server has a token endpoint ([`TOKEN_PATH`]) that does OAuth 2.0
//! Token Exchange (RFC 8693) and nothing else: a gateway that trades a client's token for one
//! aimed at an upstream (its audience) is tested against it. Clients are registered by the
//! test; the endpoint refuses targets the test names, and counts what it issued and refused.
//!
//! ```ignore
//! let issuer = Issuer::start().await;
//! let token = issuer.token().sub("alice").aud("http://127.0.0.1:1/mcp").roles(["reader"]).sign();
//! let expired = issuer.token().sub("alice").aud("http://127.0.0.1:1/mcp").expired().sign();
//! issuer.register_client("toolgate-gateway", "s3cret");
//! issuer.refuse_target("http://127.0.0.1:2/mcp"); // an exchange for it: invalid_target
//! ```

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::jwk::{Jwk, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

mod exchange;

/// The path the JWKS is served at.
pub const JWKS_PATH: &str = "/jwks.json";

/// The path of the token endpoint (token exchange only).
pub const TOKEN_PATH: &str = "/token";

/// The `grant_type` of RFC 8693, the only one the token endpoint grants.
pub const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";

/// RFC 8693's token type of an access token: what the endpoint issues, and a subject token
/// type it takes.
pub const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";

/// RFC 8693's token type of a JWT: the other subject token type the endpoint takes (every
/// token it can verify is one).
pub const JWT_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:jwt";

/// The realm of the token endpoint's `WWW-Authenticate` challenge.
pub const CLIENT_REALM: &str = "toolgate-dev-issuer";

/// How long an exchanged token lives unless [`Issuer::set_exchange_lifetime`] says otherwise
/// (and never past its subject token).
pub const DEFAULT_EXCHANGE_LIFETIME: Duration = Duration::from_secs(300);

/// An `iss` no test issuer uses (for [`TokenBuilder::wrong_issuer`]).
pub const WRONG_ISSUER: &str = "https://wrong-issuer.invalid";

/// An `aud` no test gateway expects (for [`TokenBuilder::wrong_audience`]).
pub const WRONG_AUDIENCE: &str = "https://wrong-audience.invalid/mcp";

/// The signature algorithms the issuer signs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Alg {
    /// RSASSA-PKCS1-v1_5 with SHA-256, RSA 2048 key.
    Rs256,
    /// ECDSA with P-256 and SHA-256.
    Es256,
}

impl Alg {
    fn jwt(self) -> Algorithm {
        match self {
            Alg::Rs256 => Algorithm::RS256,
            Alg::Es256 => Algorithm::ES256,
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Alg::Rs256 => "rs256",
            Alg::Es256 => "es256",
        }
    }
}

/// A private signing key and its public JWK.
pub struct SigningKey {
    kid: String,
    alg: Alg,
    encoding: EncodingKey,
    jwk: Jwk,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// A fresh key with a random `kid` such as `rs256-1f2e3d4c`.
    pub fn generate(alg: Alg) -> SigningKey {
        let kid = format!("{}-{:08x}", alg.prefix(), rand::random::<u32>());
        SigningKey::generate_with_kid(alg, kid)
    }

    /// A fresh key with the given `kid`. An RSA 2048 key takes up to a quarter of a second
    /// (the `rsa` crates are optimised in the dev profile, see the root Cargo.toml): call it
    /// from `spawn_blocking` where that matters.
    pub fn generate_with_kid(alg: Alg, kid: impl Into<String>) -> SigningKey {
        let encoding = match alg {
            Alg::Rs256 => {
                use rsa::pkcs1::EncodeRsaPrivateKey as _;
                let key = rsa::PrivateKey::new(&mut getrandom::SysRng, 2048)
                    .expect("generating an RSA 2048 key");
                let der = key.to_pkcs1_der().expect("encoding the RSA key (PKCS#1)");
                EncodingKey::from_rsa_der(der.as_bytes())
            }
            Alg::Es256 => {
                use p256::elliptic_curve::Generate as _;
                use p256::pkcs8::EncodePrivateKey as _;
                let key = p256::SecretKey::generate();
                let der = key.to_pkcs8_der().expect("encoding the P-256 key (PKCS#8)");
                EncodingKey::from_ec_der(der.as_bytes())
            }
        };
        let kid = kid.into();
        let mut jwk = Jwk::from_encoding_key(&encoding, alg.jwt()).expect("the key's public JWK");
        jwk.common.key_id = Some(kid.clone());
        jwk.common.public_key_use = Some(PublicKeyUse::Signature);
        SigningKey {
            kid,
            alg,
            encoding,
            jwk,
        }
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    pub fn alg(&self) -> Alg {
        self.alg
    }

    /// The public key as a JWK (`kty`, `n`/`e` or `crv`/`x`/`y`, `alg`, `kid`, `use`).
    pub fn jwk(&self) -> Value {
        serde_json::to_value(&self.jwk).expect("serializing a JWK")
    }

    /// Signs `claims` with this key; the header carries `kid` unless `kid` is `None`.
    pub fn sign(&self, claims: &Map<String, Value>, kid: Option<&str>) -> String {
        let mut header = Header::new(self.alg.jwt());
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("signing a JWT")
    }
}

/// What the handlers read; shared with the server thread.
struct Shared {
    /// The keys the JWKS publishes, in publication order. A subject token must verify
    /// against one of them: what a gateway would trust is what the exchange trusts.
    published: Mutex<Vec<Arc<SigningKey>>>,
    /// Requests answered at [`JWKS_PATH`].
    fetches: AtomicU64,
    /// `iss` of every token, the subject tokens' included.
    issuer: String,
    /// Signs exchanged tokens: the primary RS256 key, which stays in the JWKS unless a test
    /// withdraws it, so a gateway verifying with the JWKS accepts them.
    exchange_key: Arc<SigningKey>,
    /// Registered clients, secret by id.
    clients: Mutex<HashMap<String, String>>,
    /// Audiences and resources the token endpoint will not issue tokens for.
    refused_targets: Mutex<HashSet<String>>,
    /// The longest an exchanged token lives, in seconds.
    exchange_lifetime: AtomicU64,
    /// Tokens issued at [`TOKEN_PATH`].
    exchanges: AtomicU64,
    /// Error answers at [`TOKEN_PATH`], whatever the error.
    exchange_refusals: AtomicU64,
}

impl Shared {
    fn jwks(&self) -> Value {
        let keys: Vec<Value> = lock(&self.published).iter().map(|k| k.jwk()).collect();
        json!({ "keys": keys })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The local OAuth issuer. Dropping it stops the JWKS server and its thread.
pub struct Issuer {
    port: u16,
    shared: Arc<Shared>,
    /// Every key this issuer made or was given, published or not, by `kid`.
    keys: Mutex<HashMap<String, Arc<SigningKey>>>,
    /// The key [`TokenBuilder::alg`] picks for each algorithm (the first one).
    primary: HashMap<Alg, Arc<SigningKey>>,
    /// Keys never published, for [`TokenBuilder::unknown_kid`]; made on first use.
    strangers: Mutex<HashMap<Alg, Arc<SigningKey>>>,
    runtime: tokio::runtime::Handle,
    /// Stops the JWKS server that is running, if one is.
    server: Mutex<Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>>,
    /// Ends the server thread (on drop).
    thread_stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Issuer {
    /// Generates an RS256 key and an ES256 key and serves their JWKS at
    /// `http://127.0.0.1:<free port>/jwks.json`.
    pub async fn start() -> Issuer {
        let (rsa, ec) = tokio::task::spawn_blocking(|| {
            (
                SigningKey::generate(Alg::Rs256),
                SigningKey::generate(Alg::Es256),
            )
        })
        .await
        .expect("generating the issuer's keys");
        let (rsa, ec) = (Arc::new(rsa), Arc::new(ec));

        let (handle_tx, handle_rx) = oneshot::channel();
        let (thread_stop, thread_stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("oauth-issuer".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("issuer runtime");
                let _ = handle_tx.send(rt.handle().clone());
                rt.block_on(async move {
                    let _ = thread_stop_rx.await;
                });
            })
            .expect("starting the issuer thread");
        let runtime = handle_rx.await.expect("the issuer runtime's handle");

        // A port below the ephemeral range (crate::free_port), so that no outgoing connection
        // takes it while the server is stopped. Another test process may bind it between the
        // probe and here: then take another.
        let mut port = 0;
        let mut listener = None;
        for _ in 0..20 {
            port = crate::free_port();
            if let Ok(l) = bind(&runtime, port).await {
                listener = Some(l);
                break;
            }
        }
        let listener = listener.expect("binding the issuer's JWKS port");
        let shared = Arc::new(Shared {
            published: Mutex::new(vec![rsa.clone(), ec.clone()]),
            fetches: AtomicU64::new(0),
            issuer: format!("http://127.0.0.1:{port}"),
            exchange_key: rsa.clone(),
            clients: Mutex::new(HashMap::new()),
            refused_targets: Mutex::new(HashSet::new()),
            exchange_lifetime: AtomicU64::new(DEFAULT_EXCHANGE_LIFETIME.as_secs()),
            exchanges: AtomicU64::new(0),
            exchange_refusals: AtomicU64::new(0),
        });

        let primary = HashMap::from([(Alg::Rs256, rsa.clone()), (Alg::Es256, ec.clone())]);
        let keys = HashMap::from([(rsa.kid.clone(), rsa.clone()), (ec.kid.clone(), ec.clone())]);
        let issuer = Issuer {
            port,
            shared,
            keys: Mutex::new(keys),
            primary,
            strangers: Mutex::new(HashMap::new()),
            runtime,
            server: Mutex::new(None),
            thread_stop: Some(thread_stop),
            thread: Some(thread),
        };
        issuer.serve(listener);
        issuer
    }

    /// `http://127.0.0.1:<port>`: the `iss` claim of the tokens.
    pub fn issuer(&self) -> String {
        self.shared.issuer.clone()
    }

    /// `http://127.0.0.1:<port>/jwks.json`.
    pub fn jwks_uri(&self) -> String {
        format!("{}{}", self.issuer(), JWKS_PATH)
    }

    /// `http://127.0.0.1:<port>/token`: where a client exchanges a token (RFC 8693).
    pub fn token_endpoint(&self) -> String {
        format!("{}{}", self.issuer(), TOKEN_PATH)
    }

    /// Lets a client authenticate at the token endpoint with this id and secret
    /// (`client_secret_basic` or `client_secret_post`); registering an id again replaces its
    /// secret.
    pub fn register_client(&self, id: impl Into<String>, secret: impl Into<String>) {
        lock(&self.shared.clients).insert(id.into(), secret.into());
    }

    /// Makes an exchange asking for `target` as its `audience` or `resource` fail with
    /// `invalid_target`, as an authorization server does for a service it does not know or
    /// will not let the client reach.
    pub fn refuse_target(&self, target: impl Into<String>) {
        lock(&self.shared.refused_targets).insert(target.into());
    }

    /// The longest an exchanged token lives ([`DEFAULT_EXCHANGE_LIFETIME`] unless set): a
    /// short one lets a test watch a gateway exchange again once it expired. An exchanged
    /// token never outlives its subject token, whatever this says.
    pub fn set_exchange_lifetime(&self, lifetime: Duration) {
        self.shared
            .exchange_lifetime
            .store(lifetime.as_secs(), Ordering::SeqCst);
    }

    /// Tokens the token endpoint issued so far.
    pub fn exchanges(&self) -> u64 {
        self.shared.exchanges.load(Ordering::SeqCst)
    }

    /// Error answers of the token endpoint so far (any error: a client's, a grant's, a
    /// target's).
    pub fn exchange_refusals(&self) -> u64 {
        self.shared.exchange_refusals.load(Ordering::SeqCst)
    }

    /// toolgate-xds's auth configuration (`PUT /v1/auth/config`) trusting this issuer, its
    /// JWKS cached for a second only (tests rotate and withdraw keys), for the gateway at
    /// `resource`; `required` names the services that need a token (`["*"]`: every one).
    pub fn auth_config(&self, resource: &str, required: Value) -> Value {
        json!({
            "resource": resource,
            "authorization_servers": [self.issuer()],
            "issuers": [{
                "issuer": self.issuer(),
                "jwks": {"remote": {"uri": self.jwks_uri(), "cache_secs": 1}}
            }],
            "required": required
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The `kid` of the first RS256 or ES256 key (the one [`TokenBuilder::alg`] picks).
    pub fn kid(&self, alg: Alg) -> String {
        self.primary[&alg].kid.clone()
    }

    /// The `kid`s the JWKS publishes now, in publication order.
    pub fn published_kids(&self) -> Vec<String> {
        lock(&self.shared.published)
            .iter()
            .map(|k| k.kid.clone())
            .collect()
    }

    /// The JWKS as served (`{"keys":[...]}`), for an inline (`local_jwks`) configuration.
    pub fn inline_jwks(&self) -> String {
        self.shared.jwks().to_string()
    }

    /// Publishes `key` in the JWKS (after the keys already there) and returns its `kid`.
    /// Tokens can then be signed with it by `.kid(..)`.
    pub fn rotate_in(&self, key: SigningKey) -> String {
        let kid = key.kid.clone();
        let key = Arc::new(key);
        lock(&self.keys).insert(kid.clone(), key.clone());
        let mut published = lock(&self.shared.published);
        published.retain(|k| k.kid != kid);
        published.push(key);
        kid
    }

    /// Generates a key for `alg` (blocking, see [`SigningKey::generate_with_kid`]), publishes
    /// it and returns its `kid`.
    pub fn rotate_in_new(&self, alg: Alg) -> String {
        self.rotate_in(SigningKey::generate(alg))
    }

    /// Withdraws a key from the JWKS; tokens can still be signed with it (they should then be
    /// refused once the gateway has refetched the JWKS). Returns whether it was published.
    pub fn remove(&self, kid: &str) -> bool {
        let mut published = lock(&self.shared.published);
        let before = published.len();
        published.retain(|k| k.kid != kid);
        published.len() != before
    }

    /// JWKS requests answered so far.
    pub fn fetches(&self) -> u64 {
        self.shared.fetches.load(Ordering::SeqCst)
    }

    /// Whether the JWKS server is running.
    pub fn is_serving(&self) -> bool {
        lock(&self.server).is_some()
    }

    /// Stops the JWKS server (and the token endpoint with it): the port refuses connections
    /// and idle keep-alive connections are closed (a request in flight is answered first).
    /// No-op if already stopped.
    pub async fn stop(&self) {
        let running = lock(&self.server).take();
        if let Some((stop, task)) = running {
            let _ = stop.send(());
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }

    /// Serves the JWKS again on the same port. No-op if running.
    pub async fn restart(&self) {
        if self.is_serving() {
            return;
        }
        let mut last = None;
        for _ in 0..50 {
            match bind(&self.runtime, self.port).await {
                Ok(listener) => return self.serve(listener),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("rebinding the issuer's port {}: {last:?}", self.port);
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let (stop, stop_rx) = oneshot::channel::<()>();
        let app = Router::new()
            .route(JWKS_PATH, get(jwks_handler))
            .route(TOKEN_PATH, post(exchange::token_handler))
            .with_state(self.shared.clone());
        let task = self.runtime.spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop_rx.await;
                })
                .await;
        });
        *lock(&self.server) = Some((stop, task));
    }

    /// A token builder: `iss` is this issuer, `iat` now, `exp` in five minutes, signed with
    /// the RS256 key; no `sub` or `aud` unless given.
    pub fn token(&self) -> TokenBuilder<'_> {
        let now = unix_now();
        let mut claims = Map::new();
        claims.insert("iss".into(), json!(self.issuer()));
        claims.insert("iat".into(), json!(now));
        claims.insert("exp".into(), json!(now + 300));
        TokenBuilder {
            issuer: self,
            claims,
            alg: Alg::Rs256,
            kid: None,
            header_kid: HeaderKid::OfKey,
            stranger: false,
        }
    }

    /// One of each hostile token for `sub`/`aud`, labelled; a gateway must refuse them all
    /// (each is otherwise a valid token).
    pub fn hostile_tokens(&self, sub: &str, aud: &str) -> Vec<(&'static str, String)> {
        let t = || self.token().sub(sub).aud(aud);
        vec![
            ("expired", t().expired().sign()),
            ("not yet valid", t().not_yet_valid().sign()),
            ("wrong audience", t().wrong_audience().sign()),
            ("wrong issuer", t().wrong_issuer().sign()),
            ("alg none", t().sign_alg_none()),
            ("tampered signature (RS256)", t().sign_tampered()),
            (
                "tampered signature (ES256)",
                t().alg(Alg::Es256).sign_tampered(),
            ),
            ("unknown kid (RS256)", t().unknown_kid().sign()),
            (
                "unknown kid (ES256)",
                t().alg(Alg::Es256).unknown_kid().sign(),
            ),
        ]
    }

    fn key_by_kid(&self, kid: &str) -> Arc<SigningKey> {
        lock(&self.keys)
            .get(kid)
            .cloned()
            .unwrap_or_else(|| panic!("the issuer has no key with kid {kid:?}"))
    }

    fn stranger(&self, alg: Alg) -> Arc<SigningKey> {
        lock(&self.strangers)
            .entry(alg)
            .or_insert_with(|| {
                let kid = format!("unknown-{}-{:08x}", alg.prefix(), rand::random::<u32>());
                Arc::new(SigningKey::generate_with_kid(alg, kid))
            })
            .clone()
    }
}

impl Drop for Issuer {
    fn drop(&mut self) {
        if let Some((stop, _task)) = lock(&self.server).take() {
            let _ = stop.send(());
        }
        if let Some(stop) = self.thread_stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn bind(
    runtime: &tokio::runtime::Handle,
    port: u16,
) -> std::io::Result<tokio::net::TcpListener> {
    // Bound on the issuer's runtime, whose reactor then drives it. tokio sets SO_REUSEADDR,
    // so the port can be bound again right after a stop despite connections in TIME_WAIT.
    runtime
        .spawn(tokio::net::TcpListener::bind(("127.0.0.1", port)))
        .await
        .expect("the bind task")
}

async fn jwks_handler(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    shared.fetches.fetch_add(1, Ordering::SeqCst);
    (
        [(header::CONTENT_TYPE, "application/json")],
        shared.jwks().to_string(),
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .expect("time after 1970")
        .as_secs()
}

enum HeaderKid {
    /// The signing key's `kid`.
    OfKey,
    /// No `kid` header.
    Absent,
    /// This `kid`, whatever the key.
    Given(String),
}

/// Builds one token; see [`Issuer::token`].
pub struct TokenBuilder<'a> {
    issuer: &'a Issuer,
    claims: Map<String, Value>,
    alg: Alg,
    kid: Option<String>,
    header_kid: HeaderKid,
    stranger: bool,
}

impl TokenBuilder<'_> {
    /// `sub` (named after the claim, not `std::ops::Sub`).
    #[allow(clippy::should_implement_trait)]
    pub fn sub(self, sub: impl Into<String>) -> Self {
        self.claim("sub", Value::String(sub.into()))
    }

    /// A single audience (`"aud": "..."`).
    pub fn aud(self, aud: impl Into<String>) -> Self {
        self.claim("aud", Value::String(aud.into()))
    }

    /// Several audiences (`"aud": [...]`).
    pub fn auds<I, S>(self, auds: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let auds: Vec<Value> = auds.into_iter().map(|a| Value::String(a.into())).collect();
        self.claim("aud", Value::Array(auds))
    }

    /// Overrides `iss` (the issuer's URL by default).
    pub fn iss(self, iss: impl Into<String>) -> Self {
        self.claim("iss", Value::String(iss.into()))
    }

    /// `"roles": [...]`.
    pub fn roles<I, S>(self, roles: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let roles: Vec<Value> = roles.into_iter().map(|r| Value::String(r.into())).collect();
        self.claim("roles", Value::Array(roles))
    }

    /// `"scope": "a b c"` (space-separated, RFC 8693).
    pub fn scope(self, scope: impl Into<String>) -> Self {
        self.claim("scope", Value::String(scope.into()))
    }

    /// `exp` = now + `d` (five minutes by default).
    pub fn expires_in(self, d: Duration) -> Self {
        self.claim("exp", json!(unix_now() + d.as_secs()))
    }

    /// `exp` at `t`.
    pub fn expires_at(self, t: SystemTime) -> Self {
        self.claim("exp", json!(unix(t)))
    }

    /// `nbf` at `t`.
    pub fn not_before(self, t: SystemTime) -> Self {
        self.claim("nbf", json!(unix(t)))
    }

    /// `iat` at `t` (now by default).
    pub fn issued_at(self, t: SystemTime) -> Self {
        self.claim("iat", json!(unix(t)))
    }

    /// Any claim; replaces one already set.
    pub fn claim(mut self, name: impl Into<String>, value: Value) -> Self {
        self.claims.insert(name.into(), value);
        self
    }

    /// Drops a claim (`exp`, `iss`, `iat` are set by default).
    pub fn without_claim(mut self, name: &str) -> Self {
        self.claims.remove(name);
        self
    }

    /// Signs with the issuer's first key for `alg` (RS256 by default), unless `.kid(..)`
    /// names another key.
    pub fn alg(mut self, alg: Alg) -> Self {
        self.alg = alg;
        self
    }

    /// Signs with the issuer's key of this `kid` (published or withdrawn; panics at `sign`
    /// if the issuer never had it).
    pub fn kid(mut self, kid: impl Into<String>) -> Self {
        self.kid = Some(kid.into());
        self
    }

    /// Puts this `kid` in the header whatever key signs (a `kid` naming another key than the
    /// signer's makes a token whose signature does not verify).
    pub fn header_kid(mut self, kid: impl Into<String>) -> Self {
        self.header_kid = HeaderKid::Given(kid.into());
        self
    }

    /// No `kid` in the header (a verifier then tries every key of the JWKS).
    pub fn no_kid(mut self) -> Self {
        self.header_kid = HeaderKid::Absent;
        self
    }

    // The hostile cases.

    /// Expired an hour ago (well past any clock skew allowance; Envoy's default is 60 s).
    pub fn expired(self) -> Self {
        let now = unix_now();
        self.claim("iat", json!(now - 7200))
            .claim("exp", json!(now - 3600))
    }

    /// `nbf` an hour from now.
    pub fn not_yet_valid(self) -> Self {
        self.claim("nbf", json!(unix_now() + 3600))
    }

    /// `aud` = [`WRONG_AUDIENCE`].
    pub fn wrong_audience(self) -> Self {
        self.aud(WRONG_AUDIENCE)
    }

    /// `iss` = [`WRONG_ISSUER`] (signed by this issuer's key all the same).
    pub fn wrong_issuer(self) -> Self {
        self.iss(WRONG_ISSUER)
    }

    /// Signs with a key of the same algorithm that the JWKS never published, whose `kid`
    /// (`unknown-...`) is in the header.
    pub fn unknown_kid(mut self) -> Self {
        self.stranger = true;
        self
    }

    /// The compact JWT.
    pub fn sign(self) -> String {
        let key = if self.stranger {
            self.issuer.stranger(self.alg)
        } else if let Some(kid) = &self.kid {
            self.issuer.key_by_kid(kid)
        } else {
            self.issuer.primary[&self.alg].clone()
        };
        let kid = match &self.header_kid {
            HeaderKid::OfKey => Some(key.kid.as_str()),
            HeaderKid::Absent => None,
            HeaderKid::Given(kid) => Some(kid.as_str()),
        };
        key.sign(&self.claims, kid)
    }

    /// An unsigned token: header `{"alg":"none","typ":"JWT"}`, these claims, and an empty
    /// signature (`<header>.<payload>.`).
    pub fn sign_alg_none(self) -> String {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
        let payload = URL_SAFE_NO_PAD.encode(Value::Object(self.claims).to_string());
        format!("{header}.{payload}.")
    }

    /// Signed as by [`sign`](Self::sign), then the first byte of the signature flipped.
    pub fn sign_tampered(self) -> String {
        tamper(&self.sign())
    }
}

/// Flips the low bit of the first byte of a compact JWT's signature.
pub fn tamper(jwt: &str) -> String {
    let (signed, signature) = jwt.rsplit_once('.').expect("a compact JWT");
    let mut signature = URL_SAFE_NO_PAD
        .decode(signature)
        .expect("a base64url signature");
    signature[0] ^= 0x01;
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// The payload of a compact JWT, unverified.
pub fn payload(jwt: &str) -> Value {
    let part = jwt.split('.').nth(1).expect("a compact JWT");
    let bytes = URL_SAFE_NO_PAD.decode(part).expect("a base64url payload");
    serde_json::from_slice(&bytes).expect("a JSON payload")
}

/// A reference verifier, to compare a gateway with: checks `token` against the JWKS JSON
/// (by `kid`, else any key of the header's algorithm), `iss`, `aud`, `exp` and `nbf` (60 s
/// leeway, like Envoy's default clock skew) and returns the claims.
pub fn verify(
    jwks: &str,
    token: &str,
    issuer: &str,
    audience: &str,
) -> Result<Map<String, Value>, jsonwebtoken::errors::Error> {
    let set: JwkSet = serde_json::from_str(jwks)?;
    let header = jsonwebtoken::decode_header(token)?;
    let mut validation = Validation::new(header.alg);
    validation.set_issuer(&[issuer]);
    validation.set_audience(&[audience]);
    validation.validate_nbf = true;
    validation.leeway = 60;
    let candidates: Vec<&Jwk> = match &header.kid {
        Some(kid) => set.find(kid).into_iter().collect(),
        None => set.keys.iter().collect(),
    };
    let mut last = jsonwebtoken::errors::ErrorKind::InvalidSignature.into();
    for jwk in candidates {
        let key = DecodingKey::from_jwk(jwk)?;
        match jsonwebtoken::decode::<Map<String, Value>>(token, &key, &validation) {
            Ok(data) => return Ok(data.claims),
            Err(e) => last = e,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUD: &str = "http://127.0.0.1:1/mcp";

    async fn fetch_jwks(issuer: &Issuer) -> reqwest::Result<String> {
        reqwest::get(issuer.jwks_uri()).await?.text().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokens_verify_against_the_served_jwks() {
        let issuer = Issuer::start().await;
        let jwks = fetch_jwks(&issuer).await.unwrap();
        assert_eq!(issuer.fetches(), 1);
        assert_eq!(jwks, issuer.inline_jwks());
        let set: Value = serde_json::from_str(&jwks).unwrap();
        assert_eq!(set["keys"][0]["kty"], "RSA");
        assert_eq!(set["keys"][0]["alg"], "RS256");
        assert_eq!(set["keys"][1]["kty"], "EC");
        assert_eq!(set["keys"][1]["crv"], "P-256");
        assert_eq!(set["keys"][1]["alg"], "ES256");

        for alg in [Alg::Rs256, Alg::Es256] {
            let token = issuer
                .token()
                .alg(alg)
                .sub("alice")
                .aud(AUD)
                .roles(["reader"])
                .scope("orders:read orders:write")
                .claim("tenant", json!({"id": 7}))
                .sign();
            let claims = verify(&jwks, &token, &issuer.issuer(), AUD)
                .unwrap_or_else(|e| panic!("{alg:?}: {e}"));
            assert_eq!(claims["sub"], "alice");
            assert_eq!(claims["iss"], issuer.issuer().as_str());
            assert_eq!(claims["roles"], json!(["reader"]));
            assert_eq!(claims["scope"], "orders:read orders:write");
            assert_eq!(claims["tenant"]["id"], 7);
            let header = jsonwebtoken::decode_header(&token).unwrap();
            assert_eq!(header.kid.unwrap(), issuer.kid(alg));
        }
        // Without a kid, a verifier tries the keys.
        let token = issuer.token().sub("alice").aud(AUD).no_kid().sign();
        verify(&jwks, &token, &issuer.issuer(), AUD).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_tokens_do_not_verify() {
        let issuer = Issuer::start().await;
        let jwks = issuer.inline_jwks();
        let hostile = issuer.hostile_tokens("alice", AUD);
        assert_eq!(hostile.len(), 9);
        for (label, token) in &hostile {
            let outcome = verify(&jwks, token, &issuer.issuer(), AUD);
            assert!(outcome.is_err(), "{label}: verified: {outcome:?}");
        }
        let none = issuer.token().sub("alice").aud(AUD).sign_alg_none();
        assert!(none.ends_with('.'));
        let header = URL_SAFE_NO_PAD
            .decode(none.split('.').next().unwrap())
            .unwrap();
        assert_eq!(header, br#"{"alg":"none","typ":"JWT"}"#);
        assert_eq!(payload(&none)["sub"], "alice");
        // A key's kid on another key's signature.
        let swapped = issuer
            .token()
            .sub("alice")
            .aud(AUD)
            .alg(Alg::Rs256)
            .unknown_kid()
            .header_kid(issuer.kid(Alg::Rs256))
            .sign();
        assert!(verify(&jwks, &swapped, &issuer.issuer(), AUD).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rotation_withdrawal_and_restart() {
        let issuer = Issuer::start().await;
        let first = issuer.kid(Alg::Es256);
        let new = issuer.rotate_in_new(Alg::Es256);
        assert_eq!(issuer.published_kids().len(), 3);
        let jwks = fetch_jwks(&issuer).await.unwrap();
        let token = issuer.token().sub("bob").aud(AUD).kid(&new).sign();
        verify(&jwks, &token, &issuer.issuer(), AUD).unwrap();

        assert!(issuer.remove(&first));
        assert!(!issuer.remove(&first));
        let jwks = fetch_jwks(&issuer).await.unwrap();
        assert!(!jwks.contains(&first));
        let old = issuer.token().sub("bob").aud(AUD).kid(&first).sign();
        assert!(verify(&jwks, &old, &issuer.issuer(), AUD).is_err());

        // Keep-alive connection open across the stop: it must be closed too.
        let client = reqwest::Client::new();
        client.get(issuer.jwks_uri()).send().await.unwrap();
        issuer.stop().await;
        assert!(!issuer.is_serving());
        assert!(client.get(issuer.jwks_uri()).send().await.is_err());
        assert!(tokio::net::TcpStream::connect(issuer.addr()).await.is_err());
        let fetched = issuer.fetches();
        issuer.restart().await;
        let again = client.get(issuer.jwks_uri()).send().await.unwrap();
        assert!(again.status().is_success());
        assert_eq!(issuer.fetches(), fetched + 1);
    }
}
