//! The issuer's token endpoint: OAuth 2.0 Token Exchange (RFC 8693) and nothing else, with
//! client authentication by `client_secret_basic` or `client_secret_post`. Every answer is an
//! OAuth one (a token or an RFC 6749 §5.2 error), so a gateway under test can read why it
//! was refused.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::FormRejection;
use axum::extract::{Form, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use jsonwebtoken::{DecodingKey, Validation};
use serde_json::{json, Map, Value};

use super::{
    lock, unix_now, Shared, SigningKey, ACCESS_TOKEN_TYPE, CLIENT_REALM, JWT_TOKEN_TYPE,
    TOKEN_EXCHANGE_GRANT,
};

/// An error answer of the token endpoint (RFC 6749 §5.2).
#[derive(Debug)]
struct OAuthError {
    status: StatusCode,
    error: &'static str,
    description: String,
}

impl OAuthError {
    fn invalid_request(description: impl Into<String>) -> OAuthError {
        OAuthError::bad_request("invalid_request", description)
    }

    /// 401, with the challenge RFC 6749 §5.2 asks for when the client may have tried HTTP
    /// authentication (answered whatever it tried, so a client learns the scheme).
    fn invalid_client(description: impl Into<String>) -> OAuthError {
        OAuthError {
            status: StatusCode::UNAUTHORIZED,
            error: "invalid_client",
            description: description.into(),
        }
    }

    fn bad_request(error: &'static str, description: impl Into<String>) -> OAuthError {
        OAuthError {
            status: StatusCode::BAD_REQUEST,
            error,
            description: description.into(),
        }
    }
}

impl IntoResponse for OAuthError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "error_description": self.description});
        let mut response = (
            self.status,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            body.to_string(),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_str(&format!("Basic realm=\"{CLIENT_REALM}\""))
                    .expect("a header value"),
            );
        }
        response
    }
}

/// The token endpoint: one grant, token exchange. Whatever the request, the answer is an
/// OAuth one (a token or an RFC 6749 error), never a framework's plain-text rejection: a
/// gateway under test must be able to read why it was refused.
pub(super) async fn token_handler(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    form: Result<Form<Vec<(String, String)>>, FormRejection>,
) -> Response {
    match exchange(&shared, &headers, form) {
        Ok(answer) => {
            shared.exchanges.fetch_add(1, Ordering::SeqCst);
            (
                [
                    (header::CONTENT_TYPE, "application/json"),
                    (header::CACHE_CONTROL, "no-store"),
                    (header::PRAGMA, "no-cache"),
                ],
                answer.to_string(),
            )
                .into_response()
        }
        Err(e) => {
            shared.exchange_refusals.fetch_add(1, Ordering::SeqCst);
            e.into_response()
        }
    }
}

/// A token request's parameters, in the order sent (a repeated one is an error for most).
struct Params(Vec<(String, String)>);

impl Params {
    /// Every non-empty value of `name`: RFC 8693 lets `audience` and `resource` repeat.
    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The value of a parameter that must not repeat (RFC 6749 §3.2); an empty one counts as
    /// absent (§3.1).
    fn one(&self, name: &str) -> Result<Option<&str>, OAuthError> {
        match self.all(name)[..] {
            [] => Ok(None),
            [value] => Ok(Some(value)),
            _ => Err(OAuthError::invalid_request(format!(
                "the parameter {name} is repeated"
            ))),
        }
    }

    fn required(&self, name: &str) -> Result<&str, OAuthError> {
        self.one(name)?
            .ok_or_else(|| OAuthError::invalid_request(format!("missing parameter {name}")))
    }
}

/// Checks a token exchange request and answers it with the token's JSON.
fn exchange(
    shared: &Shared,
    headers: &HeaderMap,
    form: Result<Form<Vec<(String, String)>>, FormRejection>,
) -> Result<Value, OAuthError> {
    let params = match form {
        Ok(Form(pairs)) => Params(pairs),
        Err(FormRejection::InvalidFormContentType(_)) => {
            return Err(OAuthError::invalid_request(
                "the body must be application/x-www-form-urlencoded",
            ))
        }
        Err(e) => {
            return Err(OAuthError::invalid_request(format!(
                "unreadable form body: {}",
                e.body_text()
            )))
        }
    };
    let client = authenticate_client(shared, headers, &params)?;

    match params.required("grant_type")? {
        TOKEN_EXCHANGE_GRANT => {}
        other => {
            return Err(OAuthError::bad_request(
                "unsupported_grant_type",
                format!("grant_type {other:?}: this issuer grants token exchange (RFC 8693) only"),
            ))
        }
    }
    let subject_token = params.required("subject_token")?;
    match params.required("subject_token_type")? {
        ACCESS_TOKEN_TYPE | JWT_TOKEN_TYPE => {}
        other => {
            return Err(OAuthError::invalid_request(format!(
                "subject_token_type {other:?} is not supported: \
                 {ACCESS_TOKEN_TYPE} or {JWT_TOKEN_TYPE}"
            )))
        }
    }
    // Delegation by an actor token is not implemented: the client itself is the actor. Said
    // rather than ignored, so that a test sending one learns its `act` would be wrong.
    if params.one("actor_token")?.is_some() {
        return Err(OAuthError::invalid_request(
            "actor_token is not supported: the authenticated client is the actor",
        ));
    }
    match params.one("requested_token_type")? {
        None | Some(ACCESS_TOKEN_TYPE) | Some(JWT_TOKEN_TYPE) => {}
        Some(other) => {
            return Err(OAuthError::invalid_request(format!(
                "requested_token_type {other:?} is not supported: this issuer issues access tokens"
            )))
        }
    }
    let audiences = params.all("audience");
    let resources = params.all("resource");
    if audiences.is_empty() && resources.is_empty() {
        return Err(OAuthError::invalid_request(
            "missing parameter audience or resource: the target of the exchange",
        ));
    }
    let scope = params
        .one("scope")?
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty());

    let subject = verify_subject(shared, subject_token)?;

    let target_error = |why: String| OAuthError::bad_request("invalid_target", why);
    if let Some(bad) = resources.iter().find(|r| !is_absolute_uri(r)) {
        return Err(target_error(format!(
            "resource {bad:?} is not an absolute URI (RFC 8707)"
        )));
    }
    {
        let refused = lock(&shared.refused_targets);
        if let Some(t) = audiences
            .iter()
            .chain(&resources)
            .find(|t| refused.contains(**t))
        {
            return Err(target_error(format!(
                "this issuer does not issue tokens for {t:?}"
            )));
        }
    }

    let targets = if audiences.is_empty() {
        resources
    } else {
        audiences
    };
    let aud = match &targets[..] {
        [one] => json!(one),
        many => json!(many),
    };
    let now = unix_now();
    let lifetime = shared.exchange_lifetime.load(Ordering::SeqCst);
    // Present and numeric: the verification required it.
    let subject_exp = subject
        .get("exp")
        .and_then(|e| e.as_u64().or_else(|| e.as_f64().map(|f| f as u64)))
        .unwrap_or(now);
    let exp = subject_exp.min(now.saturating_add(lifetime));
    // RFC 8693 §4.1: the current actor on top, the subject token's own chain of actors
    // (if it was itself exchanged) nested below it.
    let mut act = Map::new();
    act.insert("sub".into(), json!(client));
    if let Some(prior) = subject.get("act") {
        act.insert("act".into(), prior.clone());
    }
    let mut claims = Map::new();
    claims.insert("iss".into(), json!(shared.issuer));
    claims.insert("sub".into(), subject["sub"].clone());
    claims.insert("aud".into(), aud);
    if let Some(scope) = &scope {
        claims.insert("scope".into(), json!(scope));
    }
    claims.insert("client_id".into(), json!(client));
    claims.insert("act".into(), Value::Object(act));
    claims.insert("iat".into(), json!(now));
    claims.insert("exp".into(), json!(exp));
    claims.insert(
        "jti".into(),
        json!(format!("{:032x}", rand::random::<u128>())),
    );
    let key = &shared.exchange_key;
    let access_token = key.sign(&claims, Some(&key.kid));

    let mut answer = json!({
        "access_token": access_token,
        "issued_token_type": ACCESS_TOKEN_TYPE,
        "token_type": "Bearer",
        "expires_in": exp.saturating_sub(now),
    });
    if let Some(scope) = scope {
        answer["scope"] = json!(scope);
    }
    Ok(answer)
}

/// The id of the client that authenticated, by `client_secret_basic` or `client_secret_post`
/// (one of them: RFC 6749 §2.3 forbids using both).
fn authenticate_client(
    shared: &Shared,
    headers: &HeaderMap,
    params: &Params,
) -> Result<String, OAuthError> {
    let basic = match headers.get(header::AUTHORIZATION) {
        None => None,
        Some(value) => Some(basic_credentials(value).ok_or_else(|| {
            OAuthError::invalid_client("the Authorization header is not HTTP Basic credentials")
        })?),
    };
    let form_id = params.one("client_id")?;
    let form_secret = params.one("client_secret")?;
    let (id, secret) = match (basic, form_id, form_secret) {
        (Some(_), _, Some(_)) => {
            return Err(OAuthError::invalid_request(
                "two client authentication methods: HTTP Basic and client_secret",
            ))
        }
        (Some((id, _)), Some(form_id), None) if form_id != id => {
            return Err(OAuthError::invalid_client(
                "client_id differs from the HTTP Basic user",
            ))
        }
        (Some((id, secret)), _, None) => (id, secret),
        (None, Some(id), Some(secret)) => (id.to_owned(), secret.to_owned()),
        (None, Some(_), None) => {
            return Err(OAuthError::invalid_client(
                "no client_secret: only confidential clients may exchange tokens",
            ))
        }
        (None, None, _) => {
            return Err(OAuthError::invalid_client(
                "no client authentication (client_secret_basic or client_secret_post)",
            ))
        }
    };
    match lock(&shared.clients).get(&id) {
        Some(known) if *known == secret => Ok(id),
        _ => Err(OAuthError::invalid_client("unknown client or wrong secret")),
    }
}

/// The id and secret of `Basic <base64(id:secret)>`, each form-urlencoded before encoding as
/// RFC 6749 §2.3.1 has it (so that a `:` may be in the id). None if anything is malformed.
fn basic_credentials(value: &header::HeaderValue) -> Option<(String, String)> {
    let value = value.to_str().ok()?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = STANDARD.decode(encoded.trim()).ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (id, secret) = decoded.split_once(':')?;
    Some((form_decode(id)?, form_decode(secret)?))
}

/// Decodes `application/x-www-form-urlencoded` text (`+` is a space); None if a `%` escape is
/// malformed or the result is not UTF-8.
fn form_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// An absolute URI: a scheme (`ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )`), a colon, and no
/// fragment (RFC 8707 §2).
fn is_absolute_uri(s: &str) -> bool {
    let Some((scheme, _)) = s.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        && !s.contains('#')
}

/// The claims of a subject token this issuer signed with a key it publishes, for any
/// audience, neither expired nor premature (no leeway: the issuer's clock is the one that
/// counts) and with a `sub` to carry over; else `invalid_grant` saying what is wrong.
fn verify_subject(shared: &Shared, token: &str) -> Result<Map<String, Value>, OAuthError> {
    use jsonwebtoken::errors::ErrorKind;
    let grant = |why: String| OAuthError::bad_request("invalid_grant", why);
    let header = jsonwebtoken::decode_header(token)
        .map_err(|e| grant(format!("the subject token is not a signed JWT: {e}")))?;
    let keys: Vec<Arc<SigningKey>> = lock(&shared.published)
        .iter()
        .filter(|k| k.alg.jwt() == header.alg)
        .filter(|k| header.kid.as_deref().is_none_or(|kid| kid == k.kid))
        .cloned()
        .collect();
    if keys.is_empty() {
        return Err(grant(match &header.kid {
            Some(kid) => format!(
                "the subject token's key {kid:?} ({:?}) is not one this issuer publishes",
                header.alg
            ),
            None => format!("this issuer publishes no {:?} key", header.alg),
        }));
    }
    let mut validation = Validation::new(header.alg);
    validation.set_issuer(&[&shared.issuer]);
    validation.set_required_spec_claims(&["exp", "iss", "sub"]);
    validation.validate_aud = false;
    validation.validate_nbf = true;
    validation.leeway = 0;
    let mut last = None;
    for key in keys {
        let decoding = DecodingKey::from_jwk(&key.jwk)
            .map_err(|e| grant(format!("the issuer's key {}: {e}", key.kid)))?;
        match jsonwebtoken::decode::<Map<String, Value>>(token, &decoding, &validation) {
            Ok(data) => return Ok(data.claims),
            Err(e) => last = Some(e),
        }
    }
    let why = match last.as_ref().map(|e| e.kind()) {
        Some(ErrorKind::ExpiredSignature) => "the subject token has expired".to_owned(),
        Some(ErrorKind::ImmatureSignature) => "the subject token is not valid yet (nbf)".into(),
        Some(ErrorKind::InvalidSignature) => {
            "the subject token's signature does not verify with this issuer's keys".into()
        }
        Some(ErrorKind::InvalidIssuer) => {
            format!("the subject token was not issued by {}", shared.issuer)
        }
        Some(ErrorKind::MissingRequiredClaim(claim)) => {
            format!("the subject token has no {claim} claim")
        }
        _ => match last {
            Some(e) => format!("the subject token does not verify: {e}"),
            None => "the subject token does not verify".into(),
        },
    };
    Err(grant(why))
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use base64::engine::general_purpose::STANDARD;
    use serde_json::{json, Value};

    const AUD: &str = "http://127.0.0.1:1/mcp";

    async fn fetch_jwks(issuer: &Issuer) -> reqwest::Result<String> {
        reqwest::get(issuer.jwks_uri()).await?.text().await
    }

    const CLIENT: &str = "toolgate-gateway";
    const SECRET: &str = "s3cret:+/%";
    const UPSTREAM: &str = "http://127.0.0.1:2/mcp";

    /// `application/x-www-form-urlencoded`, every byte outside the unreserved set escaped.
    fn form_encode(s: &str) -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }

    fn form(pairs: &[(&str, &str)]) -> String {
        pairs
            .iter()
            .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// `client_secret_basic` credentials (id and secret form-encoded first, RFC 6749 §2.3.1).
    fn basic(id: &str, secret: &str) -> String {
        let pair = format!("{}:{}", form_encode(id), form_encode(secret));
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    }

    /// POSTs `body` to the token endpoint; the status, the JSON answer and the response.
    async fn post_token(
        issuer: &Issuer,
        authorization: Option<&str>,
        body: String,
    ) -> (u16, Value, reqwest::header::HeaderMap) {
        let mut request = reqwest::Client::new()
            .post(issuer.token_endpoint())
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(authorization) = authorization {
            request = request.header("authorization", authorization);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json, headers)
    }

    /// An exchange of `subject` for `UPSTREAM` with `extra` parameters, by Basic auth.
    async fn exchange(issuer: &Issuer, subject: &str, extra: &[(&str, &str)]) -> (u16, Value) {
        let mut pairs = vec![
            ("grant_type", TOKEN_EXCHANGE_GRANT),
            ("subject_token", subject),
            ("subject_token_type", ACCESS_TOKEN_TYPE),
        ];
        pairs.extend_from_slice(extra);
        let (status, json, _) =
            post_token(issuer, Some(&basic(CLIENT, SECRET)), form(&pairs)).await;
        (status, json)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn token_exchange_issues_a_token_for_the_audience() {
        let issuer = Issuer::start().await;
        issuer.register_client(CLIENT, SECRET);
        let subject = issuer
            .token()
            .sub("alice")
            .aud(AUD)
            .expires_in(Duration::from_secs(3600))
            .sign();
        let pairs = [
            ("grant_type", TOKEN_EXCHANGE_GRANT),
            ("subject_token", subject.as_str()),
            ("subject_token_type", ACCESS_TOKEN_TYPE),
            ("audience", UPSTREAM),
            ("scope", "orders:read  orders:write"),
            ("requested_token_type", ACCESS_TOKEN_TYPE),
        ];
        let (status, answer, headers) =
            post_token(&issuer, Some(&basic(CLIENT, SECRET)), form(&pairs)).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(headers["cache-control"], "no-store");
        assert_eq!(answer["issued_token_type"], ACCESS_TOKEN_TYPE);
        assert_eq!(answer["token_type"], "Bearer");
        assert_eq!(answer["scope"], "orders:read orders:write");
        let expires_in = answer["expires_in"].as_u64().unwrap();
        assert!((299..=300).contains(&expires_in), "{answer}");

        let token = answer["access_token"].as_str().unwrap();
        let jwks = fetch_jwks(&issuer).await.unwrap();
        let claims = verify(&jwks, token, &issuer.issuer(), UPSTREAM).unwrap();
        assert_eq!(claims["sub"], "alice");
        assert_eq!(claims["aud"], UPSTREAM);
        assert_eq!(claims["act"], json!({"sub": CLIENT}));
        assert_eq!(claims["client_id"], CLIENT);
        assert_eq!(claims["scope"], "orders:read orders:write");
        let header = jsonwebtoken::decode_header(token).unwrap();
        assert_eq!(header.alg, Algorithm::RS256);
        assert_eq!(header.kid.unwrap(), issuer.kid(Alg::Rs256));
        // Not valid where the subject token was.
        assert!(verify(&jwks, token, &issuer.issuer(), AUD).is_err());

        // Exchanged again (an ES256 subject this time), by the token it got: a new jti, the
        // actors nested, the resource as audience, and no longer than the subject lives.
        let (status, again) = exchange(
            &issuer,
            token,
            &[("resource", "https://upstream.example/mcp")],
        )
        .await;
        assert_eq!(status, 200, "{again}");
        assert!(again.get("scope").is_none());
        let second = payload(again["access_token"].as_str().unwrap());
        assert_eq!(second["aud"], "https://upstream.example/mcp");
        assert_eq!(
            second["act"],
            json!({"sub": CLIENT, "act": {"sub": CLIENT}})
        );
        assert_ne!(second["jti"], claims["jti"]);
        let es256 = issuer
            .token()
            .alg(Alg::Es256)
            .sub("bob")
            .expires_in(Duration::from_secs(30))
            .sign();
        let (status, short) = exchange(&issuer, &es256, &[("audience", UPSTREAM)]).await;
        assert_eq!(status, 200, "{short}");
        assert!(short["expires_in"].as_u64().unwrap() <= 30, "{short}");
        assert_eq!(
            payload(short["access_token"].as_str().unwrap())["sub"],
            "bob"
        );
        issuer.set_exchange_lifetime(Duration::from_secs(5));
        let (_, brief) = exchange(&issuer, &subject, &[("audience", UPSTREAM)]).await;
        assert!(brief["expires_in"].as_u64().unwrap() <= 5, "{brief}");
        assert_eq!(issuer.exchanges(), 4);
        assert_eq!(issuer.exchange_refusals(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn token_exchange_authenticates_the_client() {
        let issuer = Issuer::start().await;
        issuer.register_client(CLIENT, SECRET);
        let subject = issuer.token().sub("alice").aud(AUD).sign();
        let base = [
            ("grant_type", TOKEN_EXCHANGE_GRANT),
            ("subject_token", subject.as_str()),
            ("subject_token_type", JWT_TOKEN_TYPE),
            ("audience", UPSTREAM),
        ];
        // client_secret_basic.
        let (status, answer, _) =
            post_token(&issuer, Some(&basic(CLIENT, SECRET)), form(&base)).await;
        assert_eq!(status, 200, "{answer}");
        // client_secret_post.
        let mut post = base.to_vec();
        post.extend([("client_id", CLIENT), ("client_secret", SECRET)]);
        let (status, answer, _) = post_token(&issuer, None, form(&post)).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            payload(answer["access_token"].as_str().unwrap())["client_id"],
            CLIENT
        );
        assert_eq!(issuer.exchanges(), 2);

        let mut wrong_post = base.to_vec();
        wrong_post.extend([("client_id", CLIENT), ("client_secret", "nope")]);
        let mut unknown_post = base.to_vec();
        unknown_post.extend([("client_id", "stranger"), ("client_secret", SECRET)]);
        let mut public = base.to_vec();
        public.push(("client_id", CLIENT));
        let cases = [
            (
                "wrong secret (basic)",
                Some(basic(CLIENT, "nope")),
                form(&base),
            ),
            (
                "unknown client (basic)",
                Some(basic("stranger", SECRET)),
                form(&base),
            ),
            (
                "secret not form-encoded",
                Some(format!(
                    "Basic {}",
                    STANDARD.encode(format!("{CLIENT}:{SECRET}"))
                )),
                form(&base),
            ),
            ("wrong secret (post)", None, form(&wrong_post)),
            ("unknown client (post)", None, form(&unknown_post)),
            ("no secret", None, form(&public)),
            ("no authentication", None, form(&base)),
            (
                "a bearer token",
                Some(format!("Bearer {subject}")),
                form(&base),
            ),
            ("not base64", Some("Basic !!!".into()), form(&base)),
        ];
        for (label, authorization, body) in cases {
            let (status, answer, headers) =
                post_token(&issuer, authorization.as_deref(), body).await;
            assert_eq!(status, 401, "{label}: {answer}");
            assert_eq!(answer["error"], "invalid_client", "{label}");
            assert_eq!(
                headers["www-authenticate"], "Basic realm=\"toolgate-dev-issuer\"",
                "{label}"
            );
        }
        // Both methods at once.
        let (status, answer, _) =
            post_token(&issuer, Some(&basic(CLIENT, SECRET)), form(&post)).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (400, Some("invalid_request"))
        );
        assert_eq!(issuer.exchanges(), 2);
        assert_eq!(issuer.exchange_refusals(), 10);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn token_exchange_refuses_bad_grants_targets_and_requests() {
        let issuer = Issuer::start().await;
        issuer.register_client(CLIENT, SECRET);
        issuer.refuse_target(UPSTREAM);
        let subject = issuer.token().sub("alice").aud(AUD).sign();
        let error = |answer: &Value| answer["error"].as_str().unwrap_or("").to_owned();

        // Refused targets, as audience or as resource.
        for param in ["audience", "resource"] {
            let (status, answer) = exchange(&issuer, &subject, &[(param, UPSTREAM)]).await;
            assert_eq!(
                (status, error(&answer)),
                (400, "invalid_target".into()),
                "{param}"
            );
            assert!(answer["error_description"]
                .as_str()
                .unwrap()
                .contains(UPSTREAM));
        }
        let (status, answer) = exchange(&issuer, &subject, &[("resource", "not a uri")]).await;
        assert_eq!((status, error(&answer)), (400, "invalid_target".into()));

        // Subject tokens the issuer did not sign, or not any more.
        let t = || issuer.token().sub("alice").aud(AUD);
        let stranger = t().unknown_kid().sign();
        let grants = [
            ("tampered", t().sign_tampered(), "signature"),
            ("expired", t().expired().sign(), "expired"),
            ("not yet valid", t().not_yet_valid().sign(), "not valid yet"),
            ("wrong issuer", t().wrong_issuer().sign(), "not issued by"),
            ("alg none", t().sign_alg_none(), "not a signed JWT"),
            ("unknown kid", stranger, "not one this issuer publishes"),
            ("no sub", issuer.token().aud(AUD).sign(), "no sub claim"),
            ("garbage", "not-a-jwt".into(), "not a signed JWT"),
        ];
        for (label, token, why) in grants {
            let (status, answer) = exchange(&issuer, &token, &[("audience", "urn:ok")]).await;
            assert_eq!(
                (status, error(&answer)),
                (400, "invalid_grant".into()),
                "{label}: {answer}"
            );
            let description = answer["error_description"].as_str().unwrap();
            assert!(description.contains(why), "{label}: {description}");
        }

        // Malformed requests.
        let auth = basic(CLIENT, SECRET);
        let (status, answer, _) = post_token(
            &issuer,
            Some(&auth),
            form(&[
                ("grant_type", "client_credentials"),
                ("subject_token", &subject),
                ("subject_token_type", ACCESS_TOKEN_TYPE),
                ("audience", "urn:ok"),
            ]),
        )
        .await;
        assert_eq!(
            (status, error(&answer)),
            (400, "unsupported_grant_type".into())
        );
        let requests = [
            (
                "no grant_type",
                form(&[("subject_token", &subject)]),
                "grant_type",
            ),
            (
                "no subject_token",
                form(&[("grant_type", TOKEN_EXCHANGE_GRANT), ("audience", "urn:ok")]),
                "subject_token",
            ),
            (
                "no target",
                form(&[
                    ("grant_type", TOKEN_EXCHANGE_GRANT),
                    ("subject_token", &subject),
                    ("subject_token_type", ACCESS_TOKEN_TYPE),
                ]),
                "audience or resource",
            ),
            (
                "a SAML subject",
                form(&[
                    ("grant_type", TOKEN_EXCHANGE_GRANT),
                    ("subject_token", &subject),
                    (
                        "subject_token_type",
                        "urn:ietf:params:oauth:token-type:saml2",
                    ),
                    ("audience", "urn:ok"),
                ]),
                "subject_token_type",
            ),
            (
                "a repeated grant_type",
                format!(
                    "{}&grant_type=x",
                    form(&[("grant_type", TOKEN_EXCHANGE_GRANT)])
                ),
                "repeated",
            ),
        ];
        for (label, body, why) in requests {
            let (status, answer, _) = post_token(&issuer, Some(&auth), body).await;
            assert_eq!(
                (status, error(&answer)),
                (400, "invalid_request".into()),
                "{label}: {answer}"
            );
            assert!(
                answer["error_description"].as_str().unwrap().contains(why),
                "{label}: {answer}"
            );
        }
        // A JSON body is not a form.
        let response = reqwest::Client::new()
            .post(issuer.token_endpoint())
            .header("authorization", &auth)
            .json(&json!({"grant_type": TOKEN_EXCHANGE_GRANT}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        let answer: Value = response.json().await.unwrap();
        assert_eq!(error(&answer), "invalid_request");
        assert_eq!(issuer.exchanges(), 0);
        assert_eq!(issuer.exchange_refusals(), 18);
    }
}
