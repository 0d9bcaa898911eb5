//! The bearer tokens toolgate-xds checks: the admin token that guards every mutating admin
//! call (and reads, with `--protect-reads`), and the report token of the filters' reports.

use axum::http::{HeaderMap, StatusCode};

use crate::fleet::AdminError;

/// A configured bearer token: trimmed, an empty one is none, and never printed.
#[derive(Clone, Default)]
struct Secret(Option<String>);

impl Secret {
    fn new(token: Option<String>) -> Secret {
        Secret(
            token
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty()),
        )
    }

    fn get(&self) -> Option<&str> {
        self.0.as_deref()
    }

    fn debug(&self, name: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.0.is_some() { "set" } else { "none" };
        write!(f, "{name}({state})")
    }
}

/// 401 saying `missing` without a bearer token, 403 saying `wrong` with another one.
fn check_bearer(
    expected: &str,
    headers: &HeaderMap,
    missing: &str,
    wrong: &str,
) -> Result<(), AdminError> {
    match bearer(headers) {
        None => Err(AdminError {
            status: StatusCode::UNAUTHORIZED,
            message: missing.into(),
        }),
        Some(t) if constant_time_eq(t.as_bytes(), expected.as_bytes()) => Ok(()),
        Some(_) => Err(AdminError {
            status: StatusCode::FORBIDDEN,
            message: wrong.into(),
        }),
    }
}

/// None configured: nothing can be changed through the admin API.
#[derive(Clone, Default)]
pub struct AdminToken(Secret);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.debug("AdminToken", f)
    }
}

impl AdminToken {
    pub fn new(token: Option<String>) -> Self {
        AdminToken(Secret::new(token))
    }

    pub fn is_set(&self) -> bool {
        self.0.get().is_some()
    }

    /// 401 without a bearer token, 403 with a wrong one (or when mutation is disabled).
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AdminError> {
        self.check_for(
            headers,
            "this call changes the fleet: send Authorization: Bearer <token>",
        )
    }

    /// The same check for a read, when toolgate-xds runs with `--protect-reads`.
    pub fn check_read(&self, headers: &HeaderMap) -> Result<(), AdminError> {
        self.check_for(
            headers,
            "this toolgate-xds protects its reads too (--protect-reads): send Authorization: \
             Bearer <token>",
        )
    }

    fn check_for(&self, headers: &HeaderMap, missing: &str) -> Result<(), AdminError> {
        let Some(expected) = self.0.get() else {
            return Err(AdminError {
                status: StatusCode::FORBIDDEN,
                message: "changes through the admin API are disabled: start toolgate-xds with \
                          --admin-token-file or --admin-token-env"
                    .into(),
            });
        };
        check_bearer(
            expected,
            headers,
            missing,
            "the bearer token is not the admin token",
        )
    }
}

/// The token the filters' reports (`POST /v1/feedback`, `/v1/breaker-events`) must carry.
/// Reports move health states and open breakers fleet-wide, so whoever reaches the admin
/// listener must not be able to fake them. None configured: reports are taken from anyone
/// (loopback deployments).
#[derive(Clone, Default)]
pub struct ReportToken(Secret);

impl std::fmt::Debug for ReportToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.debug("ReportToken", f)
    }
}

impl ReportToken {
    pub fn new(token: Option<String>) -> Self {
        ReportToken(Secret::new(token))
    }

    pub fn get(&self) -> Option<&str> {
        self.0.get()
    }

    /// 401 without a bearer token, 403 with a wrong one; always fine when none is required.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AdminError> {
        let Some(expected) = self.get() else {
            return Ok(());
        };
        check_bearer(
            expected,
            headers,
            "reports to this toolgate-xds need its report token (--report-token-*): send \
             Authorization: Bearer <token>",
            "the bearer token is not the report token",
        )
    }
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Compares in time that depends on the lengths only, so the time taken does not tell how much
/// of a guess was right. A guess of the wrong length is refused at once: that tells the
/// token's length and nothing else (the length of a random token is no secret worth a padded
/// comparison). `subtle` keeps the byte comparison free of early exits and of branches the
/// optimiser could add.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(axum::http::header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    #[test]
    fn tokens_match_only_byte_for_byte_and_length_for_length() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cre"), "a prefix");
        assert!(!constant_time_eq(b"s3cret", b"s3cret!"), "an extension");
        assert!(!constant_time_eq(b"", b"s3cret"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn statuses_follow_what_was_presented() {
        let t = AdminToken::new(Some("s3cret\n".into()));
        assert!(t.check(&headers(Some("Bearer s3cret"))).is_ok());
        assert_eq!(
            t.check(&headers(None)).unwrap_err().status,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            t.check(&headers(Some("Basic s3cret"))).unwrap_err().status,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            t.check(&headers(Some("Bearer nope"))).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        let none = AdminToken::new(None);
        let e = none.check(&headers(Some("Bearer s3cret"))).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        assert!(e.message.contains("disabled"));
        assert!(!format!("{t:?}").contains("s3cret"));
    }
}
