//! URIs of resources as the agent of the aggregate endpoint sees them. Where two services offer
//! the same URI the gateway shows one of them as `toolgate+<service>:<uri>`
//! (`VirtualRoutes::shown_uri`): the answer to a read of such a URI carries the server's own
//! ([`rewrite`]), and so do resource links and embedded resources in a tool's result or a
//! prompt's messages ([`rewrite_links`]); the agent gets back the URIs that lead to them.

use serde_json::Value;

/// `body` (one JSON-RPC message, or an SSE stream of them) with every `result.contents[].uri`
/// equal to `own` written as `visible`; `None` when nothing needed it (or nothing was read).
pub fn rewrite(body: &[u8], own: &str, visible: &str) -> Option<Vec<u8>> {
    edit_messages(body, |message| rewrite_message(message, own, visible))
}

/// `body` (as for [`rewrite`]) with the URI of every resource link and embedded resource in
/// `result.content` (a tool's result) and `result.messages[].content` (a prompt's) written
/// as `shown` gives it; `None` when nothing changed. A body without the word cannot have one
/// and is not parsed.
pub fn rewrite_links(body: &[u8], shown: impl Fn(&str) -> Option<String>) -> Option<Vec<u8>> {
    may_hold_links(body).then_some(())?;
    edit_messages(body, |message| rewrite_links_in(message, &shown))
}

/// Whether `body` can hold a resource link or an embedded resource at all (their `type` has
/// the word): one that cannot is not parsed.
pub fn may_hold_links(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"resource").is_some()
}

/// [`rewrite_links`] on one message.
pub fn rewrite_links_in(message: &mut Value, shown: &impl Fn(&str) -> Option<String>) -> bool {
    let Some(result) = message.get_mut("result") else {
        return false;
    };
    let mut changed = false;
    if let Some(items) = result.get_mut("content").and_then(Value::as_array_mut) {
        for item in items {
            changed |= rewrite_link(item, shown);
        }
    }
    if let Some(messages) = result.get_mut("messages").and_then(Value::as_array_mut) {
        for m in messages {
            // One content block per prompt message (an array in drafts: both read).
            match m.get_mut("content") {
                Some(Value::Array(items)) => {
                    for item in items {
                        changed |= rewrite_link(item, shown);
                    }
                }
                Some(item) => changed |= rewrite_link(item, shown),
                None => {}
            }
        }
    }
    changed
}

/// One content block: a `resource_link` names its URI, an embedded `resource` its
/// `resource.uri`.
fn rewrite_link(item: &mut Value, shown: &impl Fn(&str) -> Option<String>) -> bool {
    let uri = match item.get("type").and_then(Value::as_str) {
        Some("resource_link") => item.get_mut("uri"),
        Some("resource") => item.get_mut("resource").and_then(|r| r.get_mut("uri")),
        _ => None,
    };
    let Some(uri) = uri else {
        return false;
    };
    match uri.as_str().and_then(shown) {
        Some(visible) => {
            *uri = Value::String(visible);
            true
        }
        None => false,
    }
}

/// `body` with `edit` applied to its message (JSON) or to each message of its events (SSE);
/// `None` when `edit` changed nothing.
pub fn edit_messages(body: &[u8], mut edit: impl FnMut(&mut Value) -> bool) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    if text.trim_start().starts_with('{') {
        let mut message: Value = serde_json::from_str(text).ok()?;
        return edit(&mut message)
            .then(|| serde_json::to_vec(&message).ok())
            .flatten();
    }
    // SSE: each `data:` line holding a whole message (how the SDKs write them). A message
    // split over several `data:` lines is left as it is.
    let mut out = String::with_capacity(text.len() + 64);
    let mut changed = false;
    for line in text.split_inclusive('\n') {
        let content = line.trim_end_matches(['\r', '\n']);
        let ending = &line[content.len()..];
        let data = content
            .strip_prefix("data:")
            .map(|d| d.strip_prefix(' ').unwrap_or(d));
        let edited = data.and_then(|d| {
            let mut message: Value = serde_json::from_str(d).ok()?;
            edit(&mut message)
                .then(|| serde_json::to_string(&message).ok())
                .flatten()
        });
        match edited {
            Some(json) => {
                changed = true;
                out.push_str("data: ");
                out.push_str(&json);
                out.push_str(ending);
            }
            None => out.push_str(line),
        }
    }
    changed.then(|| out.into_bytes())
}

/// Whether `body` (a buffered SSE stream) ends where an event ends: what it holds can be
/// edited and let go without cutting a message.
pub fn ends_an_event(body: &[u8]) -> bool {
    body.ends_with(b"\n\n") || body.ends_with(b"\r\n\r\n") || body.ends_with(b"\r\r")
}

fn rewrite_message(message: &mut Value, own: &str, visible: &str) -> bool {
    let Some(contents) = message
        .get_mut("result")
        .and_then(|r| r.get_mut("contents"))
        .and_then(Value::as_array_mut)
    else {
        return false;
    };
    let mut changed = false;
    for c in contents.iter_mut() {
        if let Some(uri) = c.get_mut("uri") {
            if uri.as_str() == Some(own) {
                *uri = Value::String(visible.to_string());
                changed = true;
            }
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "secret://report";
    const VISIBLE: &str = "toolgate+beta:secret://report";

    #[test]
    fn json_and_sse_answers_get_the_uri_the_agent_asked_for() {
        let json = br#"{"jsonrpc":"2.0","id":3,"result":{"contents":[{"uri":"secret://report","text":"x"}]}}"#;
        let out = rewrite(json, OWN, VISIBLE).expect("rewritten");
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["result"]["contents"][0]["uri"], VISIBLE);
        assert_eq!(v["id"], 3);
        let sse = "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"contents\":[{\"uri\":\"secret://report\"},{\"uri\":\"other://x\"}]}}\r\n\r\n";
        let out =
            String::from_utf8(rewrite(sse.as_bytes(), OWN, VISIBLE).expect("sse")).expect("utf-8");
        assert!(out.starts_with("event: message\r\ndata: {"), "{out}");
        assert!(
            out.contains(VISIBLE) && out.contains("other://x") && out.ends_with("}\r\n\r\n"),
            "{out}"
        );
        let error = br#"{"jsonrpc":"2.0","id":3,"error":{"code":-32002,"message":"no"}}"#;
        assert_eq!(rewrite_links(error, |_| Some("x".into())), None);
        assert_eq!(rewrite(error, OWN, VISIBLE), None);
        assert_eq!(rewrite(b"not json", OWN, VISIBLE), None);
    }

    #[test]
    fn links_in_results_and_prompts_get_the_uris_that_lead_back() {
        let shown = |uri: &str| (uri == OWN).then(|| VISIBLE.to_string());
        let result = br#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"resource_link","uri":"secret://report"},{"type":"resource","resource":{"uri":"secret://report","blob":"eA=="}},{"type":"resource_link","uri":"other://x"},{"type":"text","text":"secret://report"}],"isError":false}}"#;
        let out = rewrite_links(result, shown).expect("rewritten");
        let v: Value = serde_json::from_slice(&out).expect("json");
        let content = &v["result"]["content"];
        assert_eq!(content[0]["uri"], VISIBLE);
        assert_eq!(content[1]["resource"]["uri"], VISIBLE);
        assert_eq!(content[2]["uri"], "other://x");
        assert_eq!(content[3]["text"], OWN);
        let prompt = br#"{"jsonrpc":"2.0","id":2,"result":{"messages":[{"role":"user","content":{"type":"resource","resource":{"uri":"secret://report","text":"t"}}},{"role":"user","content":[{"type":"resource_link","uri":"secret://report"}]}]}}"#;
        let out = rewrite_links(prompt, shown).expect("rewritten");
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(
            v["result"]["messages"][0]["content"]["resource"]["uri"],
            VISIBLE
        );
        assert_eq!(v["result"]["messages"][1]["content"][0]["uri"], VISIBLE);
        // Nothing to change, nothing parsed or written.
        let plain =
            br#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi"}]}}"#;
        assert_eq!(rewrite_links(plain, shown), None);
        let unbound =
            br#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"resource_link","uri":7}]}}"#;
        assert_eq!(rewrite_links(unbound, shown), None);
        assert!(ends_an_event(b"data: {}\n\n") && ends_an_event(b"data: {}\r\n\r\n"));
        assert!(!ends_an_event(b"data: {}\n"));
    }
}
