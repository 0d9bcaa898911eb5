//! Just enough JSON-RPC to see which tools a request body calls, before rmcp
//! parses it. Tolerant by design: anything it does not recognise is rmcp's to
//! answer, so it yields nothing rather than an error.

use serde_json::Value;

/// Tool names of the `tools/call` requests in `body` (a single message or a
/// batch), in order.
pub fn called_tools(body: &[u8]) -> Vec<String> {
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    match &message {
        Value::Array(batch) => batch.iter().filter_map(tool_call_name).collect(),
        single => tool_call_name(single).into_iter().collect(),
    }
}

/// The id of the first `tools/call` request in `body`, as JSON text (for failures that must
/// answer it in JSON-RPC's own terms).
pub fn call_id(body: &[u8]) -> Option<String> {
    let message = serde_json::from_slice::<Value>(body).ok()?;
    let first = match &message {
        Value::Array(batch) => batch.iter().find(|m| tool_call_name(m).is_some())?,
        single => single,
    };
    tool_call_name(first)?;
    Some(first.get("id")?.to_string())
}

/// The id (as JSON) of a single request in `body` that calls `method`.
pub fn request_id(body: &[u8], method: &str) -> Option<String> {
    let message = serde_json::from_slice::<Value>(body).ok()?;
    if message.get("method").and_then(Value::as_str) != Some(method) {
        return None;
    }
    Some(message.get("id")?.to_string())
}

/// How many requests (with an `id`) in `body` call `method`: a single message
/// or a batch. The lab counts `initialize`s with it, so a test can see how
/// many sessions a prober tried to open.
pub fn count_requests(body: &[u8], method: &str) -> u64 {
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    let is_call = |m: &Value| {
        m.get("method").and_then(Value::as_str) == Some(method) && m.get("id").is_some()
    };
    match &message {
        Value::Array(batch) => batch.iter().filter(|m| is_call(m)).count() as u64,
        single => u64::from(is_call(single)),
    }
}

fn tool_call_name(message: &Value) -> Option<String> {
    // A response or notification has no `id`-bearing `tools/call` to fail.
    if message.get("method")?.as_str()? != "tools/call" || message.get("id").is_none() {
        return None;
    }
    let name = message.get("params")?.get("name")?.as_str()?;
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_tool_of_a_call() {
        let body = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_order","arguments":{}}}"#;
        assert_eq!(called_tools(body), vec!["write_order"]);
    }

    #[test]
    fn finds_every_call_in_a_batch() {
        let body = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"}},
                       {"jsonrpc":"2.0","id":2,"method":"tools/list"},
                       {"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"b"}}]"#;
        assert_eq!(called_tools(body), vec!["a", "b"]);
    }

    #[test]
    fn counts_requests_of_a_method() {
        let init = br#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{}}"#;
        assert_eq!(count_requests(init, "initialize"), 1);
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"initialize"},
                        {"jsonrpc":"2.0","method":"initialize"},
                        {"jsonrpc":"2.0","id":2,"method":"ping"},
                        {"jsonrpc":"2.0","id":3,"method":"initialize"}]"#;
        assert_eq!(count_requests(batch, "initialize"), 2);
        assert_eq!(count_requests(b"not json", "initialize"), 0);
        assert_eq!(
            count_requests(br#"{"jsonrpc":"2.0","method":"initialize"}"#, "initialize"),
            0,
            "a notification is not a request"
        );
    }

    #[test]
    fn ignores_everything_else() {
        for body in [
            &b"not json"[..],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"no_id"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":42}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
            br#""tools/call""#,
        ] {
            assert!(
                called_tools(body).is_empty(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
