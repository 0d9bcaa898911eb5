//! JSON-RPC pieces shared by the request reader (`request`) and the response reader
//! (`response`): request ids kept as the client wrote them, and strings borrowed from the body
//! wherever the JSON has no escapes.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Request id exactly as the client sent it: the raw JSON text of a string or a number.
///
/// Kept raw so that a synthesized reply echoes it byte for byte; a client that matches responses
/// by re-serialized id (`1` vs `1.0`, `"é"` vs `"\u00e9"`) would otherwise lose the reply.
/// Equality (`==`, [`RawId::matches`]) is JSON-RPC equality, not byte equality: a server that
/// parsed and re-serialized the id still answers the same request.
#[derive(Clone, Debug)]
pub struct RawId(Box<RawValue>);

#[derive(Clone, Copy, PartialEq, Eq)]
enum IdKind {
    Str,
    Num,
}

fn id_kind(raw: &str) -> Option<IdKind> {
    match raw.as_bytes().first()? {
        b'"' => Some(IdKind::Str),
        b'-' | b'0'..=b'9' => Some(IdKind::Num),
        // MCP forbids null ids, and objects, arrays and booleans are not ids in JSON-RPC.
        _ => None,
    }
}

impl RawId {
    /// Takes `text` as the JSON text of an id; `None` unless it is one JSON string or number.
    pub fn from_json(text: &str) -> Option<RawId> {
        let raw: &RawValue = serde_json::from_str(text).ok()?;
        RawId::from_raw(raw)
    }

    pub(crate) fn from_raw(raw: &RawValue) -> Option<RawId> {
        id_kind(raw.get())?;
        Some(RawId(raw.to_owned()))
    }

    /// The id's JSON text as the client sent it, ready to be written into a reply.
    pub fn as_json(&self) -> &str {
        self.0.get()
    }

    /// The id as serde_json writes it: byte for byte.
    pub fn as_raw(&self) -> &RawValue {
        &self.0
    }

    /// Whether the JSON text `other` (an id from a response) names the same request.
    pub fn matches(&self, other: &str) -> bool {
        let mine_text = self.as_json();
        // Fast path: servers almost always echo the id unchanged.
        if mine_text == other {
            return true;
        }
        let (Some(mine), Some(theirs)) = (id_kind(mine_text), id_kind(other)) else {
            return false;
        };
        match (mine, theirs) {
            (IdKind::Str, IdKind::Str) => {
                let a: Result<Cow<'_, str>, _> = serde_json::from_str(mine_text);
                let b: Result<Cow<'_, str>, _> = serde_json::from_str(other);
                matches!((a, b), (Ok(a), Ok(b)) if a == b)
            }
            (IdKind::Num, IdKind::Num) => numbers_equal(mine_text, other),
            _ => false,
        }
    }
}

impl PartialEq for RawId {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other.as_json())
    }
}

impl Eq for RawId {}

impl fmt::Display for RawId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_json())
    }
}

/// Compares two JSON numbers by value: integers exactly (ids beyond 2^53 exist), others as f64.
fn numbers_equal(a: &str, b: &str) -> bool {
    fn as_int(s: &str) -> Option<i128> {
        if s.bytes().any(|c| matches!(c, b'.' | b'e' | b'E')) {
            return None;
        }
        s.parse().ok()
    }
    if let (Some(x), Some(y)) = (as_int(a), as_int(b)) {
        return x == y;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// What a request body is, as far as the breaker is concerned.
pub(crate) fn first_non_ws(body: &[u8]) -> Option<u8> {
    body.iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
}
pub(crate) fn present_raw<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

/// A string borrowed from the body when it has no escapes. serde's own `Cow<str>` impl always
/// copies, and `#[serde(borrow)]` only borrows a bare `Cow` field.
pub(crate) struct Str<'a>(pub(crate) Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A string, or anything else skipped without being built: `params.name` of a method the
/// filter does not know may legitimately be of any type.
pub(crate) enum MaybeStr<'a> {
    Str(Cow<'a, str>),
    NotStr,
}

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MaybeStr::Str(Cow::Owned(v)))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MaybeStr::NotStr)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeStr::NotStr)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeStr::NotStr)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'a> MaybeStr<'a> {
    pub(crate) fn into_str(self) -> Option<Cow<'a, str>> {
        match self {
            MaybeStr::Str(s) => Some(s),
            MaybeStr::NotStr => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> RawId {
        RawId::from_json(text).expect("test id")
    }

    #[test]
    fn ids_compare_as_json_values() {
        assert!(id("1").matches("1"));
        assert!(id("1").matches("1.0"));
        assert!(id("100").matches("1e2"));
        assert!(id("12345678901234567890").matches("12345678901234567890"));
        assert!(!id("9007199254740993").matches("9007199254740992"));
        assert!(id(r#""é""#).matches(r#""\u00e9""#));
        assert!(!id("1").matches(r#""1""#));
        assert!(!id(r#""a""#).matches(r#""b""#));
        assert!(!id("1").matches("null"));
        assert!(!id("1").matches("garbage"));
        assert_eq!(RawId::from_json("null"), None);
        assert_eq!(RawId::from_json("\"unterminated"), None);
        assert_eq!(
            RawId::from_json(" 5 ").map(|i| i.to_string()),
            Some("5".into())
        );
    }
}
