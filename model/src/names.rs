//! Service, instance and tool names: `[A-Za-z0-9_.-]{1,128}`, the MCP tool-name rule.
//!
//! Names become etcd key segments, Envoy cluster names and stats tags, so a `/`, a space
//! or an empty name would break the key layout or the routing table.

use thiserror::Error;

pub const MAX_NAME_LEN: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NameError {
    #[error("{kind} name is empty")]
    Empty { kind: &'static str },
    #[error("{kind} name {name:?} is {len} characters long; at most {MAX_NAME_LEN} are allowed")]
    TooLong {
        kind: &'static str,
        name: String,
        len: usize,
    },
    #[error(
        "{kind} name {name:?} contains {ch:?}; only letters, digits, '_', '.' and '-' are allowed"
    )]
    BadChar {
        kind: &'static str,
        name: String,
        ch: char,
    },
}

/// Checks `name` against the naming rule; `kind` ("service", "tool", "instance") goes into the error.
pub fn validate_name(kind: &'static str, name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { kind });
    }
    let len = name.chars().count();
    if len > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            kind,
            name: name.to_string(),
            len,
        });
    }
    if let Some(ch) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(NameError::BadChar {
            kind,
            name: name.to_string(),
            ch,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_mcp_tool_name_alphabet() {
        for ok in ["a", "query_inventory_db", "v1.2-beta", &"x".repeat(128)] {
            assert_eq!(validate_name("tool", ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn rejects_empty_long_and_foreign_characters() {
        assert_eq!(
            validate_name("service", ""),
            Err(NameError::Empty { kind: "service" })
        );
        assert!(matches!(
            validate_name("tool", &"x".repeat(129)),
            Err(NameError::TooLong { len: 129, .. })
        ));
        for (bad, ch) in [("a/b", '/'), ("a b", ' '), ("é", 'é'), ("a:b", ':')] {
            assert!(
                matches!(validate_name("tool", bad), Err(NameError::BadChar { ch: c, .. }) if c == ch),
                "{bad}"
            );
        }
    }

    #[test]
    fn error_names_the_offending_value() {
        let err = validate_name("service", "in ventory")
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"in ventory\""), "{err}");
        assert!(err.contains("service"), "{err}");
    }
}
