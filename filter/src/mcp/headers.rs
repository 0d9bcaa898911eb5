//! The 2026-07-28 request-metadata headers (`Mcp-Method`, `Mcp-Name`), checked against the body.
//!
//! The gateway judges what the body says, because the body is what the server executes. A
//! header that says something else would let a client be routed or counted as one tool while
//! calling another, so a request whose headers disagree with its body is refused by the gateway
//! itself (HTTP 400, `HeaderMismatch`), whichever revision the client claims to speak.

use std::borrow::Cow;

use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;

use super::request::{Body, Request};

/// Outcome of comparing the headers with the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderCheck {
    /// Headers present and equal to the body's values.
    Match,
    /// Headers and body disagree: refused, never counted against a breaker.
    Mismatch(Mismatch),
    /// Neither header was sent (clients of revisions before 2026-07-28).
    NoHeaders,
}

/// Which header rule a request broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// `Mcp-Name` was sent without `Mcp-Method`.
    MethodMissing,
    MethodDiffers,
    /// The method requires `Mcp-Name` (tools/call, prompts/get, resources/read) and it is absent.
    NameMissing,
    NameDiffers,
    /// `Mcp-Name` uses the `=?base64?…?=` form but is not canonical Base64 of UTF-8 text.
    NameEncoding,
    /// Headers were sent with a body that is not one request or notification (a batch, or a
    /// response).
    BodyUnreadable,
}

impl Mismatch {
    /// A sentence for the JSON-RPC error: names the header, never echoes a value (header and
    /// body values are the client's and can be arbitrarily long).
    pub fn describe(self) -> &'static str {
        match self {
            Mismatch::MethodMissing => "Header mismatch: the Mcp-Method header is missing.",
            Mismatch::MethodDiffers => {
                "Header mismatch: the Mcp-Method header does not match the request body's method."
            }
            Mismatch::NameMissing => "Header mismatch: the Mcp-Name header is missing.",
            Mismatch::NameDiffers => {
                "Header mismatch: the Mcp-Name header does not match the request body."
            }
            Mismatch::NameEncoding => {
                "Header mismatch: the Mcp-Name header is not valid Base64-encoded UTF-8."
            }
            Mismatch::BodyUnreadable => {
                "Header mismatch: the request body is not a single JSON-RPC request."
            }
        }
    }
}

/// The body value `Mcp-Name` must mirror, for the methods that require it.
enum NameRule<'b> {
    Required(Option<&'b str>),
    NotApplicable,
}

fn name_rule<'b>(request: &'b Request<'_>) -> NameRule<'b> {
    match request.method.as_ref() {
        "tools/call" | "prompts/get" => NameRule::Required(request.params_name.as_deref()),
        "resources/read" => NameRule::Required(request.params_uri.as_deref()),
        _ => NameRule::NotApplicable,
    }
}

/// Checks the request-metadata headers against the body.
pub fn check_headers(
    method_header: Option<&str>,
    name_header: Option<&str>,
    body: &Body<'_>,
) -> HeaderCheck {
    if method_header.is_none() && name_header.is_none() {
        return HeaderCheck::NoHeaders;
    }
    let (method, rule) = match body {
        Body::Request(request) => (request.method.as_ref(), name_rule(request)),
        Body::Notification { method } => (method.as_ref(), NameRule::NotApplicable),
        Body::Batch(_) | Body::Response => return HeaderCheck::Mismatch(Mismatch::BodyUnreadable),
    };
    match method_header {
        None => return HeaderCheck::Mismatch(Mismatch::MethodMissing),
        Some(header) if header != method => return HeaderCheck::Mismatch(Mismatch::MethodDiffers),
        Some(_) => {}
    }
    // An Mcp-Name on a method that does not mirror one is ignored, as intermediaries ignore
    // headers they have no rule for.
    if let NameRule::Required(expected) = rule {
        let sent = match name_header.map(decode_header_value) {
            None => None,
            Some(Some(value)) => Some(value),
            Some(None) => return HeaderCheck::Mismatch(Mismatch::NameEncoding),
        };
        match (sent.as_deref(), expected) {
            (None, None) => {}
            (None, Some(_)) => return HeaderCheck::Mismatch(Mismatch::NameMissing),
            (Some(sent), Some(expected)) if sent == expected => {}
            (Some(_), _) => return HeaderCheck::Mismatch(Mismatch::NameDiffers),
        }
    }
    HeaderCheck::Match
}

const B64_PREFIX: &str = "=?base64?";
const B64_SUFFIX: &str = "?=";

/// Standard alphabet with canonical padding (as the specification's examples and both official
/// SDKs write it) and no stray trailing bits: one text has exactly one encoding, so the value
/// the gateway compares is the value the server compares.
const B64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::RequireCanonical),
);

/// Decodes a header value that may use the `=?base64?{value}?=` sentinel form (2026-07-28
/// "Value Encoding"); `None` when the sentinel is there but its content is not Base64 of UTF-8.
pub fn decode_header_value(value: &str) -> Option<Cow<'_, str>> {
    let encoded = value
        .strip_prefix(B64_PREFIX)
        .and_then(|rest| rest.strip_suffix(B64_SUFFIX));
    match encoded {
        None => Some(Cow::Borrowed(value)),
        Some(encoded) => {
            let bytes = B64.decode(encoded).ok()?;
            String::from_utf8(bytes).ok().map(Cow::Owned)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp::request::read_body;

    fn tools_call(name: &str) -> String {
        format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":{name}}}}}"#)
    }

    fn body(text: &str) -> Body<'_> {
        read_body(text.as_bytes()).expect("a readable body")
    }

    #[test]
    fn headers_equal_to_the_body_match() {
        let text = tools_call(r#""get_weather""#);
        let b = body(&text);
        assert_eq!(
            check_headers(Some("tools/call"), Some("get_weather"), &b),
            HeaderCheck::Match
        );
        assert_eq!(check_headers(None, None, &b), HeaderCheck::NoHeaders);
    }

    #[test]
    fn base64_encoded_names_are_decoded_before_comparing() {
        let text = tools_call(r#""Hello, 世界""#);
        let b = body(&text);
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?SGVsbG8sIOS4lueVjA==?="),
                &b
            ),
            HeaderCheck::Match
        );
        // Another spelling of the same bytes (no padding) is not canonical: refused.
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?SGVsbG8sIOS4lueVjA?="),
                &b
            ),
            HeaderCheck::Mismatch(Mismatch::NameEncoding)
        );
        let text = tools_call(r#""=?base64?literal?=""#);
        assert_eq!(
            check_headers(
                Some("tools/call"),
                Some("=?base64?PT9iYXNlNjQ/bGl0ZXJhbD89?="),
                &body(&text)
            ),
            HeaderCheck::Match
        );
    }

    #[test]
    fn spec_examples_decode_and_non_canonical_base64_does_not() {
        for (encoded, plain) in [
            ("=?base64?IHBhZGRlZCA=?=", " padded "),
            ("=?base64?bGluZTEKbGluZTI=?=", "line1\nline2"),
            ("=?base64??=", ""),
            ("plain", "plain"),
            ("=?base64?", "=?base64?"),
        ] {
            assert_eq!(
                decode_header_value(encoded).as_deref(),
                Some(plain),
                "{encoded}"
            );
        }
        for bad in [
            "=?base64?!!!!?=",
            "=?base64?A?=",
            "=?base64?QQ=?=",
            "=?base64?/w==?=",
            // "QR==" has non-zero trailing bits: another spelling of "QQ==" ("A").
            "=?base64?QR==?=",
            "=?base64?QQ?=",
        ] {
            assert_eq!(decode_header_value(bad), None, "{bad}");
        }
    }

    #[test]
    fn headers_that_differ_from_the_body_mismatch() {
        let text = tools_call(r#""write_order""#);
        let b = body(&text);
        let check = |m, n| check_headers(m, n, &b);
        assert_eq!(
            check(Some("tools/list"), Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodDiffers)
        );
        assert_eq!(
            check(Some("tools/call"), Some("read_order")),
            HeaderCheck::Mismatch(Mismatch::NameDiffers)
        );
        assert_eq!(
            check(Some("tools/call"), None),
            HeaderCheck::Mismatch(Mismatch::NameMissing)
        );
        assert_eq!(
            check(None, Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodMissing)
        );
        assert_eq!(
            check(Some("tools/call"), Some("=?base64?@@?=")),
            HeaderCheck::Mismatch(Mismatch::NameEncoding)
        );
        // Values are case-sensitive.
        assert_eq!(
            check(Some("Tools/Call"), Some("write_order")),
            HeaderCheck::Mismatch(Mismatch::MethodDiffers)
        );
        let batch = format!("[{text}]");
        assert_eq!(
            check_headers(Some("tools/call"), Some("x"), &body(&batch)),
            HeaderCheck::Mismatch(Mismatch::BodyUnreadable)
        );
    }

    #[test]
    fn resources_read_mirrors_the_uri_and_other_methods_ignore_mcp_name() {
        let text =
            r#"{"jsonrpc":"2.0","id":2,"method":"resources/read","params":{"uri":"file:///a"}}"#;
        let b = body(text);
        assert_eq!(
            check_headers(Some("resources/read"), Some("file:///a"), &b),
            HeaderCheck::Match
        );
        assert_eq!(
            check_headers(Some("resources/read"), Some("file:///b"), &b),
            HeaderCheck::Mismatch(Mismatch::NameDiffers)
        );
        let text = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#;
        let b = body(text);
        assert_eq!(
            check_headers(Some("tools/list"), None, &b),
            HeaderCheck::Match
        );
        assert_eq!(
            check_headers(Some("tools/list"), Some("anything"), &b),
            HeaderCheck::Match
        );
    }
}
