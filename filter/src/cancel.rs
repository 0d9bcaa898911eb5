//! Calls their own clients cancelled.
//!
//! A client that gives up on a call sends `notifications/cancelled` on the same session. The
//! server then answers `-32800 Request cancelled`, or nothing at all (its stream ends without a
//! response), or answers late. None of that is the tool's doing: counted as failures, a client
//! that cancels its own calls would open a healthy tool for the whole fleet. So each
//! cancellation is noted here (shared by every worker of this Envoy, since the call and its
//! cancellation may land on different workers), and an admitted call whose outcome would count
//! against its tool first asks whether its client cancelled it.
//!
//! A cancellation names a request by its id within a session, so it is keyed by the session id
//! exactly as the client sent it and the id: a client can only cancel calls of a session it
//! holds. Calls without a session (2026-07-28 clients) cancel by closing their stream, which
//! the filter already counts for nothing.
//!
//! Shared data is never freed: the notes live in one record, the most recent
//! [`MAX_ENTRIES`], each forgotten after [`KEEP_MS`].

use crate::breaker::{SharedStore, CREATE_CAS};
use crate::mcp::jsonrpc::RawId;

/// The notification a client cancels a request with.
pub const METHOD: &str = "notifications/cancelled";

/// The shared-data key of the notes.
pub const KEY: &str = "tg/cancelled";
/// Cancellations remembered at once; the oldest go first.
pub const MAX_ENTRIES: usize = 256;
/// How long a cancellation is remembered: longer than any call's timeout is allowed to be in
/// practice, short enough that the record stays small.
pub const KEEP_MS: u64 = 10 * 60 * 1000;
/// Attempts at writing the record before this cancellation is given up (another worker kept
/// winning the race): the call then counts as it would have.
const CAS_ATTEMPTS: usize = 4;

/// An id as JSON-RPC compares it: `"7"` and `7` differ, `1` and `1.0` do not, nor do a string
/// and the same string escaped differently.
fn canonical_id(id_json: &str) -> Option<String> {
    let id = RawId::from_json(id_json)?;
    let text = id.as_json();
    if text.starts_with('"') {
        let s: String = serde_json::from_str(text).ok()?;
        return Some(format!("s{s}"));
    }
    match text.parse::<i64>() {
        Ok(n) => Some(format!("n{n}")),
        Err(_) => text.parse::<f64>().ok().map(|f| format!("n{f}")),
    }
}

/// The note of one (session, id): 64 bits of FNV-1a, written as hex.
pub(crate) fn note(session: &str, id_json: &str) -> Option<String> {
    let id = canonical_id(id_json)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session.bytes().chain([0]).chain(id.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    Some(format!("{h:016x}"))
}

/// The live notes of a record: (note, when), oldest first.
fn parse(bytes: &[u8], now_ms: u64) -> Vec<(String, u64)> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let (note, at) = line.split_once(' ')?;
            let at: u64 = at.parse().ok()?;
            (now_ms.saturating_sub(at) < KEEP_MS).then(|| (note.to_string(), at))
        })
        .collect()
}

/// Notes that the client of `session` cancelled its request `id_json` (the raw JSON of
/// `params.requestId`). `false` when it could not be noted (not an id, a host error, lost
/// races).
pub fn mark<S: SharedStore>(store: &S, session: &str, id_json: &str, now_ms: u64) -> bool {
    let Some(mine) = note(session, id_json) else {
        return false;
    };
    for _ in 0..CAS_ATTEMPTS {
        let Ok(record) = store.get(KEY) else {
            return false;
        };
        let (mut notes, cas) = match &record {
            Some((bytes, cas)) => (parse(bytes, now_ms), *cas),
            None => (Vec::new(), CREATE_CAS),
        };
        notes.retain(|(n, _)| *n != mine);
        notes.push((mine.clone(), now_ms));
        let skip = notes.len().saturating_sub(MAX_ENTRIES);
        let text: String = notes[skip..]
            .iter()
            .map(|(n, at)| format!("{n} {at}\n"))
            .collect();
        if store.set(KEY, text.as_bytes(), Some(cas)).is_ok() {
            return true;
        }
    }
    false
}

/// `params.requestId` of a `notifications/cancelled` body, as raw JSON; `None` when absent,
/// given twice, or not readable.
pub fn request_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Note<'a> {
        #[serde(borrow)]
        params: Option<Params<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Params<'a> {
        #[serde(rename = "requestId", borrow)]
        request_id: Option<&'a serde_json::value::RawValue>,
    }
    let note: Note<'_> = serde_json::from_slice(body).ok()?;
    Some(note.params?.request_id?.get().to_string())
}

/// Whether the client of `session` cancelled its request `id`.
pub fn cancelled<S: SharedStore>(store: &S, session: &str, id: &RawId, now_ms: u64) -> bool {
    let Some(mine) = note(session, id.as_json()) else {
        return false;
    };
    match store.get(KEY) {
        Ok(Some((bytes, _))) => parse(&bytes, now_ms).iter().any(|(n, _)| *n == mine),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::MemStore;

    fn id(json: &str) -> RawId {
        RawId::from_json(json).expect("an id")
    }

    #[test]
    fn a_cancellation_names_one_request_of_one_session() {
        let store = MemStore::new();
        assert!(mark(&store, "tgs1.abc", "7", 1_000));
        assert!(cancelled(&store, "tgs1.abc", &id("7"), 2_000));
        assert!(
            cancelled(&store, "tgs1.abc", &id("7.0"), 2_000),
            "JSON-RPC equality"
        );
        assert!(!cancelled(&store, "tgs1.abc", &id("\"7\""), 2_000));
        assert!(
            !cancelled(&store, "tgs1.abd", &id("7"), 2_000),
            "another session"
        );
        assert!(!cancelled(&store, "tgs1.abc", &id("8"), 2_000));
        assert!(mark(&store, "s", r#""a\u0062""#, 1_000));
        assert!(cancelled(&store, "s", &id(r#""ab""#), 1_000));
        // Not an id: nothing noted.
        assert!(!mark(&store, "s", "null", 1_000));
        assert!(!mark(&store, "s", "{}", 1_000));
    }

    #[test]
    fn the_request_id_is_read_from_the_notification() {
        let body =
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r-7","reason":"user"}}"#;
        assert_eq!(request_id(body).as_deref(), Some(r#""r-7""#));
        let twice = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1,"requestId":2}}"#;
        assert_eq!(request_id(twice), None, "a duplicate names nothing");
        assert_eq!(request_id(br#"{"jsonrpc":"2.0","method":"x"}"#), None);
    }

    #[test]
    fn notes_are_bounded_and_forgotten() {
        let store = MemStore::new();
        for i in 0..(MAX_ENTRIES + 10) {
            assert!(mark(&store, "s", &i.to_string(), 1_000 + i as u64));
        }
        assert!(
            !cancelled(&store, "s", &id("0"), 2_000),
            "the oldest went first"
        );
        assert!(cancelled(&store, "s", &id("265"), 2_000));
        let (bytes, _) = store.get(KEY).expect("read").expect("set");
        assert_eq!(String::from_utf8_lossy(&bytes).lines().count(), MAX_ENTRIES);
        assert!(!cancelled(&store, "s", &id("265"), 1_265 + KEEP_MS));
    }

    #[test]
    fn a_host_error_notes_nothing_and_finds_nothing() {
        let store = MemStore::new();
        store.fail_next_gets(1);
        assert!(!mark(&store, "s", "1", 1));
        assert!(mark(&store, "s", "1", 1));
        store.fail_next_gets(1);
        assert!(!cancelled(&store, "s", &id("1"), 1));
    }
}
