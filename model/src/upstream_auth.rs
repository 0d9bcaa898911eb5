//! Credentials toward the servers: `<prefix>auth/upstream/<service>`.
//!
//! A server behind the gateway may need its own credential (an API key, a bearer token for a
//! SaaS MCP server). The value names the secret by reference, never the secret itself, so it
//! appears in no etcd value, state-dir snapshot or admin answer:
//!
//! ```json
//! {"header": "Authorization", "format": "Bearer {secret}", "secret": "file:/var/run/secrets/orders-token"}
//! ```
//!
//! toolgate-xds reads the secret (a file, or an environment variable of its own process),
//! hands the header's value to Envoy as an SDS secret (redacted in `config_dump`) and adds it
//! to its own requests to the service's instances.
//!
//! Or the credential is each caller's own, exchanged (RFC 8693) for one meant for the server:
//!
//! ```json
//! {"exchange": {"token_endpoint": "https://idp.example/token", "audience": "https://orders.example/mcp",
//!               "scopes": ["orders:read"], "client": {"id": "toolgate", "secret": "file:/run/s/toolgate-client"}}}
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::auth::AuthError;

/// Where `format` puts the secret.
pub const PLACEHOLDER: &str = "{secret}";
/// A secret longer than this is refused (a token is a few kilobytes at most).
pub const MAX_SECRET_BYTES: usize = 16 * 1024;

/// Headers a credential may not be written to: hop-by-hop and framing headers, the ones MCP
/// and the gateway give meaning to.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "accept",
    "mcp-session-id",
    "mcp-protocol-version",
    "last-event-id",
    // Printed by the default access log.
    "traceparent",
    "x-request-id",
];

/// `<prefix>auth/upstream/<service>`. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamCredential {
    /// The request header the credential goes in (lower case once parsed).
    #[serde(default = "authorization")]
    pub header: String,
    /// The header's value, `{secret}` standing for the secret.
    #[serde(default = "bearer")]
    pub format: String,
    /// Where the secret is: `file:<absolute path>` or `env:<variable>` (a static credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretRef>,
    /// Or each caller's verified token exchanged for one meant for the server; `format`'s
    /// `{secret}` then stands for the exchanged access token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<TokenExchange>,
}

/// An OAuth 2.0 token exchange (RFC 8693) with the identity provider, per caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenExchange {
    /// The provider's token endpoint: an `https://` URL (`http://` only on loopback).
    pub token_endpoint: String,
    /// What the exchanged token is for: the server's resource (its `aud`).
    pub audience: String,
    /// The scopes asked for, if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// How the gateway authenticates to the provider (`client_secret_basic`).
    pub client: ExchangeClient,
}

/// The gateway's own client at the identity provider; its secret by reference.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExchangeClient {
    pub id: String,
    pub secret: SecretRef,
}

fn authorization() -> String {
    "authorization".to_string()
}

fn bearer() -> String {
    format!("Bearer {PLACEHOLDER}")
}

/// A reference to a secret, never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SecretRef {
    /// The file's content, a trailing newline ignored (a Kubernetes secret volume).
    File(PathBuf),
    /// An environment variable of the toolgate-xds process.
    Env(String),
}

impl TryFrom<String> for SecretRef {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        // The errors never quote the value: a secret pasted here by mistake must not come
        // back in an answer or a log line.
        if let Some(path) = s.strip_prefix("file:") {
            if !path.starts_with('/') || path.chars().any(char::is_control) {
                return Err("a file: reference takes an absolute path".to_string());
            }
            return Ok(SecretRef::File(PathBuf::from(path)));
        }
        if let Some(name) = s.strip_prefix("env:") {
            let valid = !name.is_empty()
                && name.len() <= 256
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(
                    "an env: reference names a variable ([A-Za-z_][A-Za-z0-9_]*)".to_string(),
                );
            }
            return Ok(SecretRef::Env(name.to_string()));
        }
        Err(
            "a secret is referenced as file:<absolute path> or env:<variable>, never given"
                .to_string(),
        )
    }
}

impl From<SecretRef> for String {
    fn from(r: SecretRef) -> String {
        r.to_string()
    }
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretRef::File(p) => write!(f, "file:{}", p.display()),
            SecretRef::Env(v) => write!(f, "env:{v}"),
        }
    }
}

impl SecretRef {
    /// Reads the secret now: the file's content or the variable's value, a trailing newline
    /// dropped. The error names the reference, never a value.
    pub fn read(&self) -> Result<String, String> {
        let raw = match self {
            SecretRef::File(path) => read_bounded(path).map_err(|e| format!("{self}: {e}"))?,
            SecretRef::Env(name) => std::env::var_os(name)
                .ok_or_else(|| format!("{self}: the variable is not set"))?
                .into_encoded_bytes(),
        };
        if raw.len() > MAX_SECRET_BYTES {
            return Err(format!("{self}: longer than {MAX_SECRET_BYTES} bytes"));
        }
        let text = String::from_utf8(raw).map_err(|_| format!("{self}: not UTF-8 text"))?;
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        if text.is_empty() {
            return Err(format!("{self}: empty"));
        }
        // A header value: a line break would be a header of the attacker's choosing.
        if text.chars().any(|c| c.is_control() && c != '\t') {
            return Err(format!(
                "{self}: a control character (a line break?) in the secret"
            ));
        }
        Ok(text.to_string())
    }
}

/// A regular file's first [`MAX_SECRET_BYTES`] + 1 bytes: a device (`/dev/zero`) or a FIFO
/// is refused before it is opened, and a huge file is not read whole.
fn read_bounded(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut raw = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_SECRET_BYTES as u64 + 1)
        .read_to_end(&mut raw)?;
    Ok(raw)
}

impl UpstreamCredential {
    pub fn parse(value: &[u8]) -> Result<Self, AuthError> {
        let mut c: UpstreamCredential =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(value))
                .map_err(|e| {
                    let path = e.path().to_string();
                    let field = if path == "." || path == "?" {
                        "value".to_string()
                    } else {
                        path
                    };
                    AuthError {
                        field,
                        message: format!("not an upstream credential: {}", e.inner()),
                    }
                })?;
        c.header = c.header.to_ascii_lowercase();
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), AuthError> {
        let bad = |field: &str, message: String| AuthError {
            field: field.to_string(),
            message,
        };
        let token = !self.header.is_empty()
            && self.header.len() <= 128
            && self
                .header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            return Err(bad(
                "header",
                format!("{:?} is not a header name", self.header),
            ));
        }
        if RESERVED.contains(&self.header.as_str())
            || self.header.starts_with("x-toolgate-")
            || self.header.starts_with("x-envoy-")
        {
            return Err(bad(
                "header",
                format!(
                    "{:?} is a header the gateway or HTTP itself sets",
                    self.header
                ),
            ));
        }
        match (&self.secret, &self.exchange) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "exchange",
                    "a credential is a static secret or a token exchange, not both".to_string(),
                ))
            }
            (None, None) => {
                return Err(bad(
                    "secret",
                    "missing: a secret reference (file:<path>, env:<variable>) or an exchange"
                        .to_string(),
                ))
            }
            (None, Some(x)) => x.validate()?,
            (Some(_), None) => {}
        }
        if self.format.matches(PLACEHOLDER).count() != 1 {
            return Err(bad(
                "format",
                format!("{:?} must hold {PLACEHOLDER} once", self.format),
            ));
        }
        if self.format.len() > 256 || self.format.chars().any(|c| c.is_control()) {
            return Err(bad(
                "format",
                "at most 256 characters, no control characters".to_string(),
            ));
        }
        Ok(())
    }

    /// The header's value for `secret`.
    pub fn value(&self, secret: &str) -> String {
        self.format.replacen(PLACEHOLDER, secret, 1)
    }
}

impl TokenExchange {
    fn validate(&self) -> Result<(), AuthError> {
        let bad = |field: &str, message: String| AuthError {
            field: format!("exchange.{field}"),
            message,
        };
        let url = &self.token_endpoint;
        let loopback = [
            "http://127.0.0.1:",
            "http://127.0.0.1/",
            "http://[::1]",
            "http://localhost",
        ];
        let secure = url.starts_with("https://") || loopback.iter().any(|p| url.starts_with(p));
        if !secure || url.len() > 2048 || url.chars().any(|c| c.is_control() || c == ' ') {
            return Err(bad(
                "token_endpoint",
                format!("{url:?}: an https:// URL (http:// only on loopback)"),
            ));
        }
        if self.audience.is_empty()
            || self.audience.len() > 1024
            || self.audience.chars().any(char::is_control)
        {
            return Err(bad("audience", "1 to 1024 characters".to_string()));
        }
        if let Some(s) = self.scopes.iter().find(|s| {
            s.is_empty()
                || !s
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
        }) {
            return Err(bad(
                "scopes",
                format!("{s:?} is not a scope token (RFC 6749 §3.3)"),
            ));
        }
        let id = &self.client.id;
        if id.is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
            return Err(bad("client.id", "1 to 256 characters".to_string()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_names_its_secret_and_never_holds_it() {
        let c = UpstreamCredential::parse(
            br#"{"header": "Authorization", "format": "Bearer {secret}", "secret": "file:/run/s/orders"}"#,
        )
        .expect("valid");
        assert_eq!(c.header, "authorization");
        assert_eq!(c.secret, Some(SecretRef::File("/run/s/orders".into())));
        assert_eq!(c.value("s3cret"), "Bearer s3cret");
        let defaults = UpstreamCredential::parse(br#"{"secret": "env:ORDERS_TOKEN"}"#).expect("ok");
        assert_eq!(defaults.header, "authorization");
        assert_eq!(defaults.value("t"), "Bearer t");
        let json = serde_json::to_value(&defaults).expect("serializes");
        assert_eq!(json["secret"], "env:ORDERS_TOKEN");

        let pasted = UpstreamCredential::parse(br#"{"secret": "sk-live-s3cret"}"#)
            .expect_err("a value, not a reference");
        assert!(!pasted.to_string().contains("s3cret"), "{pasted}");
        for (value, field) in [
            (r#"{"secret": "s3cret"}"#, "secret"),
            (r#"{"secret": "file:relative"}"#, "secret"),
            (r#"{"secret": "env:1X"}"#, "secret"),
            (r#"{"secret": "env:A", "value": "s3cret"}"#, "value"),
            (r#"{"secret": "env:A", "header": "Host"}"#, "header"),
            (
                r#"{"secret": "env:A", "header": "x-toolgate-jwt-payload"}"#,
                "header",
            ),
            (r#"{"secret": "env:A", "header": "a b"}"#, "header"),
            (r#"{"secret": "env:A", "format": "Bearer"}"#, "format"),
            (
                r#"{"secret": "env:A", "format": "{secret}{secret}"}"#,
                "format",
            ),
            (
                r#"{"secret": "env:A", "format": "a\r\nb {secret}"}"#,
                "format",
            ),
        ] {
            let e = UpstreamCredential::parse(value.as_bytes()).expect_err(value);
            assert!(
                e.field == field || e.message.contains(field),
                "{value}: {e}"
            );
        }
    }

    #[test]
    fn an_exchange_names_its_provider_and_its_client_secret_by_reference() {
        let c = UpstreamCredential::parse(
            br#"{"exchange": {"token_endpoint": "https://idp.example/token",
                 "audience": "https://orders.example/mcp", "scopes": ["orders:read"],
                 "client": {"id": "toolgate", "secret": "env:TOOLGATE_CLIENT_SECRET"}}}"#,
        )
        .expect("valid");
        let x = c.exchange.as_ref().expect("an exchange");
        assert_eq!(
            x.client.secret,
            SecretRef::Env("TOOLGATE_CLIENT_SECRET".into())
        );
        assert_eq!(c.value("tok"), "Bearer tok");
        assert!(c.secret.is_none());
        let exchange = |inner: &str| format!(r#"{{"exchange": {inner}}}"#);
        let client = r#""client": {"id": "toolgate", "secret": "env:S"}"#;
        for (value, field) in [
            (r#"{}"#.to_string(), "secret"),
            (
                format!(
                    r#"{{"secret": "env:A", "exchange": {{"token_endpoint": "https://i/t", "audience": "a", {client}}}}}"#
                ),
                "exchange",
            ),
            (
                exchange(&format!(
                    r#"{{"token_endpoint": "http://idp.example/t", "audience": "a", {client}}}"#
                )),
                "exchange.token_endpoint",
            ),
            (
                exchange(&format!(
                    r#"{{"token_endpoint": "https://i/t", "audience": "", {client}}}"#
                )),
                "exchange.audience",
            ),
            (
                exchange(&format!(
                    r#"{{"token_endpoint": "https://i/t", "audience": "a", "scopes": ["a b"], {client}}}"#
                )),
                "exchange.scopes",
            ),
            (
                exchange(
                    r#"{"token_endpoint": "https://i/t", "audience": "a", "client": {"id": "t", "secret": "s3cret"}}"#,
                ),
                "exchange.client.secret",
            ),
        ] {
            let e = UpstreamCredential::parse(value.as_bytes()).expect_err(&value);
            assert_eq!(e.field, field, "{value}: {e}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        }
        let loopback = exchange(&format!(
            r#"{{"token_endpoint": "http://127.0.0.1:8080/token", "audience": "a", {client}}}"#
        ));
        assert!(UpstreamCredential::parse(loopback.as_bytes()).is_ok());
    }

    #[test]
    fn a_secret_is_read_as_a_header_value() {
        let dir = std::env::temp_dir().join(format!("toolgate-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("token");
        std::fs::write(&file, "s3cret\n").expect("write");
        let r = SecretRef::File(file.clone());
        assert_eq!(r.read().as_deref(), Ok("s3cret"));
        std::fs::write(&file, "s3cret\r\nX-Evil: 1").expect("write");
        let e = r.read().expect_err("a line break");
        assert!(!e.contains("s3cret"), "the error shows no secret: {e}");
        std::fs::write(&file, "").expect("write");
        assert!(r.read().is_err());
        assert!(SecretRef::File("/dev/zero".into()).read().is_err());
        std::fs::write(&file, vec![b'a'; MAX_SECRET_BYTES + 10]).expect("write");
        assert!(r.read().expect_err("too long").contains("longer"));
        let gone = SecretRef::File(dir.join("absent"));
        assert!(gone.read().expect_err("absent").contains("absent"));
        assert!(SecretRef::Env("TOOLGATE_TEST_UNSET_VARIABLE".into())
            .read()
            .is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
