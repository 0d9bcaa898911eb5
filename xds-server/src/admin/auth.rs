//! The bearer token that guards every mutating admin call.

use axum::http::{HeaderMap, StatusCode};

use crate::fleet::AdminError;

/// `None`: no token configured, so nothing can be changed through the admin API.
#[derive(Clone, Default)]
pub struct AdminToken(Option<String>);

impl std::fmt::Debug for AdminToken {
    // Never print the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "AdminToken(set)"
        } else {
            "AdminToken(none)"
        })
    }
}

impl AdminToken {
    pub fn new(token: Option<String>) -> Self {
        AdminToken(
            token
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty()),
        )
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
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
        let Some(expected) = &self.0 else {
            return Err(AdminError {
                status: StatusCode::FORBIDDEN,
                message: "changes through the admin API are disabled: start toolgate-xds with \
                          --admin-token-file or --admin-token-env"
                    .into(),
            });
        };
        match bearer(headers) {
            None => Err(AdminError {
                status: StatusCode::UNAUTHORIZED,
                message: missing.into(),
            }),
            Some(t) if constant_time_eq(t.as_bytes(), expected.as_bytes()) => Ok(()),
            Some(_) => Err(AdminError {
                status: StatusCode::FORBIDDEN,
                message: "the bearer token is not the admin token".into(),
            }),
        }
    }
}

/// The token the filters' reports (`POST /v1/feedback`, `/v1/breaker-events`) must carry.
/// Reports move health states and open breakers fleet-wide, so whoever reaches the admin
/// listener must not be able to fake them. `None`: reports are taken from anyone (loopback
/// deployments).
#[derive(Clone, Default)]
pub struct ReportToken(Option<String>);

impl std::fmt::Debug for ReportToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ReportToken(set)"
        } else {
            "ReportToken(none)"
        })
    }
}

impl ReportToken {
    pub fn new(token: Option<String>) -> Self {
        ReportToken(
            token
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty()),
        )
    }

    pub fn get(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// 401 without a bearer token, 403 with a wrong one; always fine when none is required.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AdminError> {
        let Some(expected) = &self.0 else {
            return Ok(());
        };
        match bearer(headers) {
            None => Err(AdminError {
                status: StatusCode::UNAUTHORIZED,
                message: "reports to this toolgate-xds need its report token (--report-token-*): \
                          send Authorization: Bearer <token>"
                    .into(),
            }),
            Some(t) if constant_time_eq(t.as_bytes(), expected.as_bytes()) => Ok(()),
            Some(_) => Err(AdminError {
                status: StatusCode::FORBIDDEN,
                message: "the bearer token is not the report token".into(),
            }),
        }
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

/// Compares without an early exit, so the time taken does not tell how much of a guess was
/// right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
