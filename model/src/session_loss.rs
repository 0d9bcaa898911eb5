//! When a server no longer knows a session, whose doing it was, and what the gateway does:
//! the one rule the filter (which sees the answer), toolgate-xds (which knows the instances)
//! and the MCP probe (which keeps a session of its own) share, for every kind of held session
//! and on every route.
//!
//! - "Session unknown" is HTTP 404, as the MCP specification has servers answer, or HTTP 400
//!   with JSON-RPC error -32000, which the TypeScript SDK's servers answer instead
//!   ("Bad Request: No valid session ID provided") ([`session_unknown`]).
//! - A session ends for the client when the client deleted it or the live server ended it
//!   (expired it): the server's answer then reaches the client, which initializes again, as
//!   the specification expects. The gateway re-opens a session for the client, and replays the
//!   call once, only when the instance that held it is gone (it left the registry, is not
//!   serving, or did not answer: another one did) or restarted since the session was opened
//!   ([`fate`]).

/// The JSON-RPC error code the TypeScript SDK's servers answer an unknown session with (in an
/// HTTP 400).
pub const UNKNOWN_SESSION_CODE: i64 = -32000;

/// Whether an answer with HTTP `status` and JSON-RPC error `code` (read from its body, see
/// [`rpc_error_code`]) says the server does not know the session the request named.
pub fn session_unknown(status: u16, code: Option<i64>) -> bool {
    status == 404 || (status == 400 && code == Some(UNKNOWN_SESSION_CODE))
}

/// The most of an answer's body [`rpc_error_code`] reads: an error message is short.
pub const MAX_ERROR_BODY: usize = 64 * 1024;

/// The `error.code` of the JSON-RPC message in a body: JSON, or the first `data:` line of an
/// event stream that holds one.
pub fn rpc_error_code(body: &[u8]) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct Message {
        error: Option<Error>,
    }
    #[derive(serde::Deserialize)]
    struct Error {
        code: i64,
    }
    let code = |json: &[u8]| {
        serde_json::from_slice::<Message>(json)
            .ok()
            .and_then(|m| m.error)
            .map(|e| e.code)
    };
    let body = &body[..body.len().min(MAX_ERROR_BODY)];
    if body.trim_ascii_start().starts_with(b"{") {
        return code(body);
    }
    body.split(|b| *b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .find_map(|data| code(data.trim_ascii()))
}

/// What toolgate-xds knows of the instance that held a session the server no longer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Left the registry, not serving (UNKNOWN, SUSPECT, DOWN), or another instance answered.
    Gone,
    /// Restarted after the session was opened: whatever it held is lost.
    Restarted,
    /// The same process, live: it ended the session itself (or the client did).
    Live,
}

/// The instance that held a session, as toolgate-xds's registry describes it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderFacts {
    /// Registered and serving (UP, or UNHEALTHY: still routed).
    pub serving: bool,
    /// When its current incarnation began, in milliseconds since the Unix epoch: when this
    /// toolgate-xds saw it restart or register; 0 when it has known it since before it could
    /// tell.
    pub incarnation_ms: u64,
}

/// Which [`Holder`] an instance is for a session opened at `opened_ms` (`None`: a session
/// whose opening time is not known, opened before any restart could be seen) that the
/// instance at `answered_by_holder` did (true) or did not (false: Envoy sent the request to
/// another instance) answer; `facts` is `None` for an instance no longer registered.
pub fn holder(
    facts: Option<HolderFacts>,
    opened_ms: Option<u64>,
    answered_by_holder: bool,
) -> Holder {
    let Some(facts) = facts.filter(|f| f.serving && answered_by_holder) else {
        return Holder::Gone;
    };
    if facts.incarnation_ms > opened_ms.unwrap_or(0) {
        Holder::Restarted
    } else {
        Holder::Live
    }
}

/// What becomes of a session the server no longer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// The client or the live server ended it: the server's answer reaches the client.
    Ended,
    /// Lost with its instance: opened again for the client, and the call replayed once.
    Reopen,
}

/// The rule: only a session lost with its instance is re-opened.
pub fn fate(holder: Holder) -> Fate {
    match holder {
        Holder::Gone | Holder::Restarted => Fate::Reopen,
        Holder::Live => Fate::Ended,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_unknown_is_404_or_the_typescript_sdks_400() {
        let ts = br#"{"jsonrpc":"2.0","error":{"code":-32000,"message":"Bad Request: No valid session ID provided"},"id":null}"#;
        assert!(session_unknown(400, rpc_error_code(ts)));
        assert!(session_unknown(404, None));
        assert!(session_unknown(
            404,
            rpc_error_code(br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}"#)
        ));
        // Any other 400 is the request's own fault, not a lost session.
        let other = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad params"}}"#;
        assert!(!session_unknown(400, rpc_error_code(other)));
        assert!(!session_unknown(400, None));
        assert!(!session_unknown(500, rpc_error_code(ts)));
        assert!(!session_unknown(200, None));
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"error\":{\"code\":-32000,\"message\":\"x\"},\"id\":null}\n\n";
        assert_eq!(rpc_error_code(sse), Some(-32000));
        for junk in [b"".as_slice(), b"not json", b"{\"error\":7}", b"data: [1]"] {
            assert_eq!(rpc_error_code(junk), None);
        }
    }

    #[test]
    fn only_a_session_lost_with_its_instance_is_reopened() {
        let live = HolderFacts {
            serving: true,
            incarnation_ms: 1_000,
        };
        // The same live process answered: the client or the server ended it.
        assert_eq!(holder(Some(live), Some(2_000), true), Holder::Live);
        assert_eq!(fate(Holder::Live), Fate::Ended);
        // It restarted after the session was opened.
        assert_eq!(holder(Some(live), Some(500), true), Holder::Restarted);
        assert_eq!(fate(Holder::Restarted), Fate::Reopen);
        // Gone from the registry, not serving, or another instance answered.
        assert_eq!(holder(None, Some(2_000), true), Holder::Gone);
        let down = HolderFacts {
            serving: false,
            ..live
        };
        assert_eq!(holder(Some(down), Some(2_000), true), Holder::Gone);
        assert_eq!(holder(Some(live), Some(2_000), false), Holder::Gone);
        assert_eq!(fate(Holder::Gone), Fate::Reopen);
        // An instance known since before toolgate-xds could see restarts, and a session
        // whose opening time is unknown: the same process, as far as anyone can tell.
        let known = HolderFacts {
            serving: true,
            incarnation_ms: 0,
        };
        assert_eq!(holder(Some(known), None, true), Holder::Live);
        assert_eq!(holder(Some(live), None, true), Holder::Restarted);
    }
}
