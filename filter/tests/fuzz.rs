//! Property tests: the readers never panic on any input; a request is either refused or read
//! as the method and tool that every JSON reader sees (hostile envelopes included: duplicate
//! keys, escapes, non-finite numbers, odd encodings); the SSE scanner's answer does not depend on
//! where chunks split; the replies are always JSON that echoes the id.

use proptest::prelude::*;
use serde_json::Value;
use toolgate_filter::mcp::headers::{check_headers, decode_header_value};
use toolgate_filter::mcp::jsonrpc::RawId;
use toolgate_filter::mcp::reply::{
    body_too_large, refused, service_unavailable, tool_unavailable, Framing, OpenCause,
    ProtocolVersion, Reply, Unavailable, UnavailableKind, UpstreamFailure,
};
use toolgate_filter::mcp::request::{nests_deeper_than, read_body, Body, Refusal, ToolName};
use toolgate_filter::mcp::response::{classify_response, ResponseClass};
use toolgate_filter::mcp::sse::SseScanner;

fn version() -> impl Strategy<Value = ProtocolVersion> {
    prop::sample::select(ProtocolVersion::ALL.to_vec())
}

fn framing() -> impl Strategy<Value = Framing> {
    prop::sample::select(vec![Framing::Json, Framing::Sse])
}

/// Ids as clients send them: integers, and strings of any content (serialized, so escaped).
fn raw_id() -> impl Strategy<Value = RawId> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<String>().prop_map(|s| Value::String(s).to_string()),
        // The same strings with every non-ASCII character escaped, as some clients send them.
        any::<String>().prop_map(|s| escape_all(&s)),
    ]
    .prop_map(|text| RawId::from_json(&text).expect("generated id is a JSON string or number"))
}

fn escape_all(s: &str) -> String {
    let mut out = String::from("\"");
    for unit in s.encode_utf16() {
        out.push_str(&format!("\\u{unit:04x}"));
    }
    out.push('"');
    out
}

fn upstream_failure() -> impl Strategy<Value = UpstreamFailure> {
    prop_oneof![
        Just(UpstreamFailure::ConnectFailure),
        Just(UpstreamFailure::Reset),
        Just(UpstreamFailure::Timeout),
        any::<u16>().prop_map(UpstreamFailure::Http5xx),
        Just(UpstreamFailure::NoHealthyUpstream),
        Just(UpstreamFailure::BadResponse),
        Just(UpstreamFailure::NoResponse),
    ]
}

/// A JSON reply body: the bytes themselves or the data line of the one SSE event.
fn reply_json(reply: &Reply) -> Value {
    let body = std::str::from_utf8(&reply.body).expect("reply is UTF-8");
    let json = if reply.content_type == "text/event-stream" {
        body.strip_prefix("event: message\ndata: ")
            .and_then(|b| b.strip_suffix("\n\n"))
            .expect("one SSE event")
    } else {
        body
    };
    assert!(!json.contains('\n'), "JSON on one line");
    serde_json::from_str(json).expect("reply is JSON")
}

fn id_value(id: &RawId) -> Value {
    serde_json::from_str(id.as_json()).expect("id is JSON")
}

/// Reference reading of a request with a full `Value` (duplicate keys: the last one wins, as in
/// Python's and JavaScript's readers): what read_body must agree with.
fn reference_tool(body: &[u8]) -> Option<Option<String>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object()?;
    if object.get("method")?.as_str()? != "tools/call" {
        return Some(None);
    }
    Some(
        object
            .get("params")
            .and_then(|p| p.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned),
    )
}

/// Fragments that make random bodies look like JSON-RPC more often than random bytes do.
fn jsonish() -> impl Strategy<Value = Vec<u8>> {
    let token = prop::sample::select(vec![
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"",
        "\"id\"",
        "\"method\"",
        "\"params\"",
        "\"name\"",
        "\"tools/call\"",
        "\"result\"",
        "\"error\"",
        "\"isError\"",
        "\"code\"",
        "true",
        "null",
        "1",
        "-32020",
        "\"a\"",
        "\\u0000",
        "\\",
        " ",
        "\n",
        "é",
        "\u{feff}",
        "data: ",
        "\r\n",
    ]);
    prop::collection::vec(token, 0..40).prop_map(|t| t.concat().into_bytes())
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..512), jsonish()]
}

/// `TOOLGATE_FUZZ_CASES` sets the cases per property (`make fuzz-smoke` and `make fuzz` raise it).
fn cases() -> u32 {
    std::env::var("TOOLGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Nesting depth as a full JSON reading sees it.
fn depth(v: &Value) -> u64 {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn jsonrpc_depth_scan_agrees_with_a_full_json_reading(body in bytes(), limit in 1u64..8) {
        let deeper = nests_deeper_than(&body, limit);
        if let Ok(v) = serde_json::from_slice::<Value>(&body) {
            prop_assert_eq!(deeper, depth(&v) > limit, "{}", v);
        }
    }

    #[test]
    fn jsonrpc_read_body_never_panics(body in bytes(), method in proptest::option::of(".{0,20}"), name in proptest::option::of(".{0,20}")) {
        if let Ok(read) = read_body(&body) {
            let _ = check_headers(method.as_deref(), name.as_deref(), &read);
            if let Body::Request(request) = &read {
                let _ = request.tool();
            }
        }
    }

    #[test]
    fn reply_classify_and_decode_never_panic(body in bytes(), id in raw_id(), header in ".{0,40}") {
        let _ = classify_response(&body, &id);
        let _ = decode_header_value(&header);
        let _ = decode_header_value(&format!("=?base64?{header}?="));
    }

    #[test]
    fn jsonrpc_tool_calls_are_read_as_a_full_json_reading_would(
        id in raw_id(),
        name in ".{0,140}",
        filler in ".{0,20}",
        name_first in any::<bool>(),
    ) {
        let arguments = serde_json::json!({"name": filler, "list": [filler, {"name": 1}]});
        let name_json = Value::String(name.clone()).to_string();
        let params = if name_first {
            format!(r#"{{"name":{name_json},"arguments":{arguments}}}"#)
        } else {
            format!(r#"{{"arguments":{arguments},"_meta":{{}},"name":{name_json}}}"#)
        };
        let body = format!(r#"{{"params":{params},"jsonrpc":"2.0","id":{},"method":"tools/call"}}"#, id.as_json());
        let Ok(Body::Request(request)) = read_body(body.as_bytes()) else {
            panic!("not a request: {body}");
        };
        prop_assert_eq!(&request.id, &id);
        prop_assert_eq!(request.id.as_json(), id.as_json());
        let expected = reference_tool(body.as_bytes()).flatten();
        let got = match request.tool() {
            Some(ToolName::Valid(n)) | Some(ToolName::Invalid(n)) => Some(n.to_owned()),
            _ => None,
        };
        prop_assert_eq!(&got, &expected);
        let valid = !name.is_empty() && name.len() <= 128
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        prop_assert_eq!(matches!(request.tool(), Some(ToolName::Valid(_))), valid);
    }

    #[test]
    fn jsonrpc_random_bodies_agree_with_a_full_json_reading(body in bytes()) {
        let reference = reference_tool(&body);
        match read_body(&body) {
            Ok(Body::Request(request)) => {
                let expected = reference.expect("a request the reference cannot read");
                let got = request.tool().and_then(|t| match t {
                    ToolName::Valid(n) | ToolName::Invalid(n) => Some(n.to_owned()),
                    ToolName::Absent => None,
                });
                prop_assert_eq!(got, expected);
            }
            Ok(Body::Notification { .. }) => prop_assert!(reference.is_some()),
            Ok(Body::Batch(_) | Body::Response) | Err(_) => {}
        }
    }

    /// 17.5: hostile envelopes (duplicated members, escaped spellings of keys and values,
    /// non-finite numbers, a byte-order mark, odd whitespace) are either refused, or read as
    /// the very method and tool that a first-wins and a last-wins JSON reader both see: the
    /// gateway never judges one tool while the server runs another.
    #[test]
    fn jsonrpc_hostile_envelopes_are_refused_or_judged_as_every_reader_judges_them(
        envelope in hostile_envelope(),
    ) {
        let (body, non_finite) = envelope;
        let read = read_body(body.as_bytes());
        if non_finite {
            prop_assert!(read.is_err(), "{body} was read as {read:?}");
        }
        let Ok(read) = read else { return Ok(()) };
        let last = serde_json::from_str::<Value>(&body).expect("read_body accepted non-JSON");
        let first = first_wins(&body).expect("read_body accepted what a first-wins reader refuses");
        for reading in [&last, &first] {
            let method = reading.get("method").and_then(Value::as_str);
            let name = reading.get("params").and_then(|p| p.get("name")).and_then(Value::as_str);
            match &read {
                Body::Request(r) => {
                    prop_assert_eq!(Some(r.method.as_ref()), method, "{}", body);
                    prop_assert_eq!(r.params_name.as_deref(), name, "{}", body);
                    prop_assert!(reading.get("id").is_some());
                }
                Body::Notification { method: m } => {
                    prop_assert_eq!(Some(m.as_ref()), method, "{}", body);
                    prop_assert!(reading.get("id").is_none());
                }
                Body::Response => prop_assert!(method.is_none(), "{}", body),
                Body::Batch(_) => prop_assert!(reading.is_array()),
            }
        }
    }

    #[test]
    fn sse_answer_does_not_depend_on_chunking(
        id in raw_id(),
        prelude in prop::collection::vec(prop_oneof![
            Just(": keep-alive\n\n".to_string()),
            Just("event: ping\ndata: x\n\n".to_string()),
            Just("data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\n".to_string()),
            Just("data: not json\r\r".to_string()),
            Just("id: 5\nretry: 100\n\n".to_string()),
        ], 0..6),
        is_error in any::<bool>(),
        code in proptest::option::of(any::<i64>()),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        garbage in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let response = match code {
            Some(code) => format!(r#"{{"jsonrpc":"2.0","id":{},"error":{{"code":{code},"message":"m"}}}}"#, id.as_json()),
            None => format!(r#"{{"jsonrpc":"2.0","id":{},"result":{{"content":[],"isError":{is_error}}}}}"#, id.as_json()),
        };
        let expected = classify_response(response.as_bytes(), &id);
        prop_assert_ne!(expected, ResponseClass::Other);
        let stream = format!("{}data: {response}\n\n", prelude.concat());
        let mut stream = stream.into_bytes();
        stream.extend_from_slice(&garbage);
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
        points.sort_unstable();
        let mut scanner = SseScanner::new(id.clone());
        let mut found = None;
        let mut start = 0;
        for end in points.into_iter().chain([stream.len()]) {
            if let Some(class) = scanner.feed(&stream[start..end]) {
                prop_assert!(found.is_none(), "reported twice");
                found = Some(class);
            }
            start = end;
        }
        prop_assert_eq!(found, Some(expected));
        prop_assert_eq!(scanner.finish(), None);
    }

    #[test]
    fn sse_scanner_never_panics(id in raw_id(), chunks in prop::collection::vec(bytes(), 0..8), limit in 0usize..256) {
        let mut scanner = SseScanner::with_limit(id, limit);
        for chunk in &chunks {
            let _ = scanner.feed(chunk);
        }
        let _ = scanner.finish();
    }

    #[test]
    fn reply_synthesis_is_json_that_echoes_the_id(
        version in version(),
        framing in framing(),
        id in raw_id(),
        tool in proptest::option::of(".{0,40}"),
        fallback in proptest::option::of(".{0,40}"),
        reason in ".{0,600}",
        service in ".{0,40}",
        kind_pick in 0u8..5,
        failure in upstream_failure(),
        retry_after_secs in proptest::option::of(any::<u64>()),
        percent in any::<u32>(),
        calls in any::<u32>(),
        limit in any::<u64>(),
    ) {
        let kind = match kind_pick {
            0 => UnavailableKind::Open { cause: OpenCause::FailureRate { percent, calls, window_secs: limit } },
            1 => UnavailableKind::ForcedOpen { reason: &reason },
            2 => UnavailableKind::UpstreamFailure { what: failure },
            3 => UnavailableKind::Probing,
            _ => UnavailableKind::Overloaded,
        };
        let details = Unavailable {
            kind,
            tool: tool.as_deref(),
            retry_after_secs,
            fallback_tool: fallback.as_deref(),
        };
        let v = reply_json(&tool_unavailable(version, &id, &details, framing));
        prop_assert_eq!(&v["id"], &id_value(&id));
        prop_assert_eq!(&v["result"]["isError"], &Value::Bool(true));
        let meta = &v["result"]["_meta"]["io.toolgate/breaker"];
        prop_assert_eq!(meta.get("retryAfterSeconds").cloned(), retry_after_secs.map(Value::from));
        prop_assert!(v["result"]["content"][0]["text"].is_string());

        let v = reply_json(&service_unavailable(version, &id, &service, failure, framing));
        prop_assert_eq!(&v["id"], &id_value(&id));
        prop_assert!(v["error"]["message"].is_string());

        let v = reply_json(&refused(version, Some(&id), Refusal::DuplicateKey("method"), framing));
        prop_assert_eq!(&v["id"], &id_value(&id));

        let v = reply_json(&body_too_large(version, Some(&id), limit, framing));
        prop_assert_eq!(&v["id"], &id_value(&id));
        let v = reply_json(&body_too_large(version, None, limit, framing));
        prop_assert!(v.get("id").is_none_or(Value::is_null));
    }
}

/// A JSON reading in which the first of duplicated members wins (some servers' readers do).
fn first_wins(text: &str) -> Option<Value> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    struct FirstWins;
    impl<'de> DeserializeSeed<'de> for FirstWins {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for FirstWins {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_owned()))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = seq.next_element_seed(FirstWins)? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut out = serde_json::Map::new();
            while let Some(k) = map.next_key::<String>()? {
                let v = map.next_value_seed(FirstWins)?;
                out.entry(k).or_insert(v);
            }
            Ok(Value::Object(out))
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let v = FirstWins.deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(v)
}

/// Spellings of a key or string value that every JSON reader reads as the same text.
fn spelled(text: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        Just(format!("\"{text}\"")),
        // One character escaped as \uXXXX.
        (0..text.len().max(1)).prop_map(move |i| {
            let mut out = String::from("\"");
            for (j, c) in text.chars().enumerate() {
                if j == i {
                    out.push_str(&format!("\\u{:04x}", c as u32));
                } else if c == '/' {
                    out.push_str("\\/");
                } else {
                    out.push(c);
                }
            }
            out.push('"');
            out
        }),
    ]
}

fn tool_value() -> impl Strategy<Value = String> {
    prop_oneof![
        spelled("read_order"),
        spelled("write_order"),
        Just("7".to_string()),
        Just("null".to_string()),
        Just("[\"write_order\"]".to_string()),
    ]
}

/// A member of `params`: the name (maybe duplicated), arguments with maybe a non-finite number.
fn params_members() -> impl Strategy<Value = (Vec<String>, bool)> {
    let name = (spelled("name"), tool_value()).prop_map(|(k, v)| format!("{k}:{v}"));
    let number = prop_oneof![
        Just(("1".to_string(), false)),
        Just(("-0.5e3".to_string(), false)),
        Just(("NaN".to_string(), true)),
        Just(("Infinity".to_string(), true)),
        Just(("-Infinity".to_string(), true)),
    ];
    (prop::collection::vec(name, 0..3), number, any::<bool>()).prop_map(
        |(names, (n, bad), first)| {
            let arguments = format!(r#""arguments":{{"x":{n},"name":"not this"}}"#);
            let mut members = names;
            if first {
                members.insert(0, arguments);
            } else {
                members.push(arguments);
            }
            (members, bad)
        },
    )
}

/// A hostile top-level envelope, and whether it carries a non-finite number.
fn hostile_envelope() -> impl Strategy<Value = (String, bool)> {
    let method = (
        spelled("method"),
        prop_oneof![
            spelled("tools/call"),
            spelled("tools/list"),
            Just("5".to_string())
        ],
    )
        .prop_map(|(k, v)| format!("{k}:{v}"));
    let id = (
        spelled("id"),
        prop_oneof![
            Just("1".to_string()),
            Just("\"a\"".to_string()),
            Just("2.0".to_string()),
            Just("null".to_string())
        ],
    )
        .prop_map(|(k, v)| format!("{k}:{v}"));
    let jsonrpc = spelled("jsonrpc").prop_map(|k| format!("{k}:\"2.0\""));
    let params = (spelled("params"), params_members())
        .prop_map(|(k, (members, bad))| (format!("{k}:{{{}}}", members.join(",")), bad));
    (
        prop::collection::vec(method, 0..3),
        prop::collection::vec(id, 0..2),
        prop::collection::vec(params, 0..3),
        jsonrpc,
        any::<prop::sample::Index>(),
        prop_oneof![Just(""), Just(" \t\r\n"), Just("\u{feff}"), Just("\u{a0}")],
        any::<bool>(),
    )
        .prop_map(|(methods, ids, params, jsonrpc, at, prefix, batch)| {
            let non_finite = params.iter().any(|(_, bad)| *bad);
            let mut members: Vec<String> = methods;
            members.extend(ids);
            members.extend(params.into_iter().map(|(p, _)| p));
            let at = at.index(members.len() + 1);
            members.insert(at, jsonrpc);
            let object = format!("{{{}}}", members.join(","));
            let body = if batch { format!("[{object}]") } else { object };
            (format!("{prefix}{body}"), non_finite)
        })
}
