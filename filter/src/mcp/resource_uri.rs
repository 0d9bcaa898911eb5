//! The answer to a `resources/read` of the aggregate endpoint whose URI the gateway rewrote
//! (`toolgate+<service>:<uri>`, where two services offer the same URI): the contents the
//! server returns carry its own URI, and the agent gets the one it asked for.

use serde_json::Value;

/// `body` (one JSON-RPC message, or an SSE stream of them) with every `result.contents[].uri`
/// equal to `own` written as `visible`; `None` when nothing needed it (or nothing was read).
pub fn rewrite(body: &[u8], own: &str, visible: &str) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    if text.trim_start().starts_with('{') {
        let mut message: Value = serde_json::from_str(text).ok()?;
        return rewrite_message(&mut message, own, visible)
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
            rewrite_message(&mut message, own, visible)
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
        assert_eq!(rewrite(error, OWN, VISIBLE), None);
        assert_eq!(rewrite(b"not json", OWN, VISIBLE), None);
    }
}
