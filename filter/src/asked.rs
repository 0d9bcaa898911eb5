//! Which server asked a client of the aggregate endpoint a question.
//!
//! During a call, a server may ask its client something (`elicitation/create`,
//! `sampling/createMessage`) on the call's stream. Through `/mcp` the client answers the
//! gateway: the answer (a JSON-RPC response, no method) carries only the id the server gave
//! its request, and every server numbers its own. So when a routed call's stream carries a
//! server's request, the filter notes (client session, request id) → service here, and the
//! client's answer with that id goes to that service's route on the session held for the
//! client. Shared by every worker of this Envoy: the answer may land on another worker than
//! the call.
//!
//! Every server numbers its questions from the same start, so two servers asking one client
//! session at once would ask under the same id. The client therefore sees each question under
//! an id naming its server ([`shown_id`]: `"toolgate:<service>:<the server's id>"`), and the
//! answer goes back with the server's own ([`own_id`]). Should a question pass unrenamed (an
//! SSE event too large to hold for editing) and another server's share its id, the later note
//! wins and the earlier question goes unanswered (it times out as it would with a client that
//! does not answer); the filter logs it when it happens.
//!
//! One record, the most recent [`MAX_ENTRIES`] notes, each forgotten after [`KEEP_MS`].

use crate::breaker::{SharedStore, CREATE_CAS};

/// The shared-data key of the notes.
pub const KEY: &str = "tg/asked";
/// Questions remembered at once; the oldest go first.
pub const MAX_ENTRIES: usize = 256;
/// How long a question waits for its answer: as long as a call may run in practice.
pub const KEEP_MS: u64 = 10 * 60 * 1000;
const CAS_ATTEMPTS: usize = 4;

/// What noting a question found.
#[derive(Debug, PartialEq, Eq)]
pub enum Noted {
    Noted,
    /// Another service had asked this session a question under the same id, still open.
    Replaced {
        earlier: String,
    },
    /// Not an id, a service name that cannot be stored, a host error, or lost races.
    Failed,
}

/// (note, when, service), oldest first, the expired left out.
fn parse(bytes: &[u8], now_ms: u64) -> Vec<(String, u64, String)> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ' ');
            let note = fields.next()?;
            let at: u64 = fields.next()?.parse().ok()?;
            let service = fields.next()?;
            (now_ms.saturating_sub(at) < KEEP_MS)
                .then(|| (note.to_string(), at, service.to_string()))
        })
        .collect()
}

/// Notes that `service` asked the client of `session` a question with id `id_json` (raw
/// JSON).
pub fn note<S: SharedStore>(
    store: &S,
    session: &str,
    id_json: &str,
    service: &str,
    now_ms: u64,
) -> Noted {
    let Some(mine) = crate::cancel::note(session, id_json) else {
        return Noted::Failed;
    };
    if service.is_empty() || service.contains(char::is_whitespace) {
        return Noted::Failed;
    }
    for _ in 0..CAS_ATTEMPTS {
        let Ok(record) = store.get(KEY) else {
            return Noted::Failed;
        };
        let (mut notes, cas) = match &record {
            Some((bytes, cas)) => (parse(bytes, now_ms), *cas),
            None => (Vec::new(), CREATE_CAS),
        };
        let earlier = notes
            .iter()
            .find(|(n, _, s)| *n == mine && s != service)
            .map(|(_, _, s)| s.clone());
        notes.retain(|(n, _, _)| *n != mine);
        notes.push((mine.clone(), now_ms, service.to_string()));
        let skip = notes.len().saturating_sub(MAX_ENTRIES);
        let text: String = notes[skip..]
            .iter()
            .map(|(n, at, s)| format!("{n} {at} {s}\n"))
            .collect();
        if store.set(KEY, text.as_bytes(), Some(cas)).is_ok() {
            return match earlier {
                Some(earlier) => Noted::Replaced { earlier },
                None => Noted::Noted,
            };
        }
    }
    Noted::Failed
}

/// The service that asked the client of `session` the question `id_json` answers.
pub fn asker<S: SharedStore>(
    store: &S,
    session: &str,
    id_json: &str,
    now_ms: u64,
) -> Option<String> {
    let mine = crate::cancel::note(session, id_json)?;
    let (bytes, _) = store.get(KEY).ok()??;
    parse(&bytes, now_ms)
        .into_iter()
        .rev()
        .find(|(n, _, _)| *n == mine)
        .map(|(_, _, service)| service)
}

/// What a question's id starts with when the client sees it.
const SHOWN_PREFIX: &str = "toolgate:";

/// The id the client sees for the question `service` asked with `id`: a string naming the
/// service and holding the server's id (its JSON text), so questions of two servers never
/// share one, and the answer can be given back its own ([`own_id`]).
pub fn shown_id(service: &str, id: &serde_json::Value) -> serde_json::Value {
    serde_json::Value::String(format!("{SHOWN_PREFIX}{service}:{id}"))
}

/// The service and the server's own id (a JSON value) of an id [`shown_id`] made; `None` for
/// any other (a question that passed unrenamed, or an id the client made up).
pub fn own_id(shown: &serde_json::Value) -> Option<(&str, serde_json::Value)> {
    let (service, id) = shown
        .as_str()?
        .strip_prefix(SHOWN_PREFIX)?
        .split_once(':')?;
    let id: serde_json::Value = serde_json::from_str(id).ok()?;
    (id.is_string() || id.is_number()).then_some((service, id))
}

/// Gives the server's questions (and its cancellations of them) in `message` the ids the
/// client sees ([`shown_id`]); whether it changed anything.
pub fn rename_questions(message: &mut serde_json::Value, service: &str) -> bool {
    let Some(method) = message.get("method").and_then(|m| m.as_str()) else {
        return false;
    };
    let cancels = method == crate::cancel::METHOD;
    let id = if cancels {
        message
            .get_mut("params")
            .and_then(|p| p.get_mut("requestId"))
    } else {
        message.get_mut("id")
    };
    match id {
        Some(id) if id.is_string() || id.is_number() => {
            *id = shown_id(service, id);
            true
        }
        _ => false,
    }
}

/// The `id` of a client's response (raw JSON); `None` when absent, given twice, or not
/// readable.
pub fn response_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Response<'a> {
        #[serde(borrow)]
        id: Option<&'a serde_json::value::RawValue>,
    }
    let response: Response<'_> = serde_json::from_slice(body).ok()?;
    Some(response.id?.get().to_string())
}

/// An id for a log line: as sent, cut after 64 bytes (a server or client chooses it, and may
/// make it long).
pub fn shown(id_json: &str) -> String {
    const MAX: usize = 64;
    if id_json.len() <= MAX {
        return id_json.to_string();
    }
    let mut end = MAX;
    while !id_json.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &id_json[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::MemStore;

    #[test]
    fn questions_of_two_servers_never_share_an_id_and_answers_get_theirs_back() {
        use serde_json::json;
        let mut a =
            json!({"jsonrpc": "2.0", "id": 0, "method": "elicitation/create", "params": {}});
        let mut b =
            json!({"jsonrpc": "2.0", "id": 0, "method": "sampling/createMessage", "params": {}});
        assert!(rename_questions(&mut a, "alpha") && rename_questions(&mut b, "beta"));
        assert_ne!(a["id"], b["id"]);
        assert_eq!(own_id(&a["id"]), Some(("alpha", json!(0))));
        assert_eq!(own_id(&b["id"]), Some(("beta", json!(0))));
        let mut s = json!({"jsonrpc": "2.0", "id": "q:1", "method": "roots/list"});
        assert!(rename_questions(&mut s, "gamma"));
        assert_eq!(own_id(&s["id"]), Some(("gamma", json!("q:1"))));
        // A server withdrawing its question names it as the client saw it.
        let mut c = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 0}});
        assert!(rename_questions(&mut c, "alpha"));
        assert_eq!(c["params"]["requestId"], a["id"]);
        // Not a question, or no id to rename: left alone.
        for mut m in [
            json!({"jsonrpc": "2.0", "id": 0, "result": {}}),
            json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}),
            json!({"jsonrpc": "2.0", "id": null, "method": "ping"}),
        ] {
            let before = m.clone();
            assert!(!rename_questions(&mut m, "alpha"));
            assert_eq!(m, before);
        }
        for made_up in [
            json!(0),
            json!("toolgate:alpha"),
            json!("toolgate:alpha:[1]"),
            json!("x"),
        ] {
            assert_eq!(own_id(&made_up), None, "{made_up}");
        }
    }

    #[test]
    fn an_answer_finds_the_service_that_asked_in_its_session() {
        let store = MemStore::new();
        assert_eq!(note(&store, "g1", "0", "everything", 1_000), Noted::Noted);
        assert_eq!(note(&store, "g1", "\"q\"", "orders", 1_000), Noted::Noted);
        assert_eq!(
            asker(&store, "g1", "0", 2_000).as_deref(),
            Some("everything")
        );
        assert_eq!(
            asker(&store, "g1", "0.0", 2_000).as_deref(),
            Some("everything")
        );
        assert_eq!(
            asker(&store, "g1", "\"q\"", 2_000).as_deref(),
            Some("orders")
        );
        assert_eq!(asker(&store, "g2", "0", 2_000), None, "another session");
        assert_eq!(
            asker(&store, "g1", "\"0\"", 2_000),
            None,
            "a string is another id"
        );
        assert_eq!(asker(&store, "g1", "0", 1_000 + KEEP_MS), None, "forgotten");
    }

    #[test]
    fn a_second_asker_under_one_id_is_reported() {
        let store = MemStore::new();
        assert_eq!(note(&store, "g1", "3", "a", 1_000), Noted::Noted);
        assert_eq!(
            note(&store, "g1", "3", "a", 1_001),
            Noted::Noted,
            "the same asker again"
        );
        assert_eq!(
            note(&store, "g1", "3", "b", 1_002),
            Noted::Replaced {
                earlier: "a".into()
            }
        );
        assert_eq!(asker(&store, "g1", "3", 1_003).as_deref(), Some("b"));
    }

    #[test]
    fn notes_are_bounded_and_bad_input_is_not_noted() {
        let store = MemStore::new();
        for i in 0..(MAX_ENTRIES + 5) {
            assert_eq!(note(&store, "s", &i.to_string(), "x", 1_000), Noted::Noted);
        }
        assert_eq!(
            asker(&store, "s", "0", 1_000),
            None,
            "the oldest went first"
        );
        assert_eq!(asker(&store, "s", "260", 1_000).as_deref(), Some("x"));
        assert_eq!(note(&store, "s", "null", "x", 1), Noted::Failed);
        assert_eq!(note(&store, "s", "1", "two words", 1), Noted::Failed);
        assert_eq!(note(&store, "s", "1", "", 1), Noted::Failed);
        store.fail_next_gets(1);
        assert_eq!(note(&store, "s", "1", "x", 1), Noted::Failed);
    }

    #[test]
    fn long_ids_are_cut_for_the_log() {
        assert_eq!(shown("7"), "7");
        let long = format!("\"{}\"", "é".repeat(100));
        let cut = shown(&long);
        assert!(cut.ends_with("...") && cut.len() <= 67, "{cut}");
    }

    #[test]
    fn the_id_is_read_from_the_response() {
        assert_eq!(
            response_id(br#"{"jsonrpc":"2.0","id":7,"result":{}}"#).as_deref(),
            Some("7")
        );
        assert_eq!(
            response_id(br#"{"jsonrpc":"2.0","id":1,"id":2,"result":{}}"#),
            None
        );
        assert_eq!(response_id(br#"{"jsonrpc":"2.0","result":{}}"#), None);
        assert_eq!(response_id(b"not json"), None);
    }
}
