//! Every message the filter sends in a server's place validates against the official MCP schema
//! of the protocol version the client speaks (`shared/mcp-schema/<version>.schema.json`), in JSON
//! and in SSE framing.

use std::collections::HashMap;

use jsonschema::Validator;
use serde_json::{json, Value};
use toolgate_filter::mcp::headers::Mismatch;
use toolgate_filter::mcp::jsonrpc::RawId;
use toolgate_filter::mcp::reply::{
    batch_refused, body_too_large, header_mismatch, refused, service_unavailable, too_deep,
    tool_unavailable, BatchAnswer, Framing, OpenCause, ProtocolVersion, Reply, Unavailable,
    UnavailableKind, UpstreamFailure, INTERNAL_ERROR,
};
use toolgate_filter::mcp::request::Refusal;

const SCHEMA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/mcp-schema/");

/// One schema file, with validators built for its definitions on demand.
struct Schema {
    version: ProtocolVersion,
    file: Value,
    /// `definitions` (draft-07 files) or `$defs` (2020-12 files).
    defs_key: &'static str,
    built: HashMap<String, Validator>,
}

impl Schema {
    fn load(version: ProtocolVersion) -> Schema {
        let path = format!("{SCHEMA_DIR}{}.schema.json", version.as_str());
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let file: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        let defs_key = if file.get("$defs").is_some() {
            "$defs"
        } else {
            "definitions"
        };
        Schema {
            version,
            file,
            defs_key,
            built: HashMap::new(),
        }
    }

    fn has(&self, definition: &str) -> bool {
        self.file[self.defs_key].get(definition).is_some()
    }

    /// A validator for one definition: the file's definitions plus a root that refers to it
    /// (through `allOf`, since draft-07 ignores the siblings of a root `$ref`).
    fn validator(&mut self, definition: &str) -> &Validator {
        assert!(
            self.has(definition),
            "{} has no definition {definition}",
            self.version.as_str()
        );
        let (file, defs_key) = (&self.file, self.defs_key);
        self.built.entry(definition.to_string()).or_insert_with(|| {
            let root = json!({
                "$schema": file["$schema"],
                defs_key: file[defs_key],
                "allOf": [{"$ref": format!("#/{defs_key}/{definition}")}],
            });
            jsonschema::validator_for(&root)
                .unwrap_or_else(|e| panic!("schema for {definition}: {e}"))
        })
    }

    fn errors(&mut self, definition: &str, instance: &Value) -> Vec<String> {
        self.validator(definition)
            .iter_errors(instance)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect()
    }

    fn assert_valid(&mut self, definition: &str, instance: &Value) {
        let errors = self.errors(definition, instance);
        assert!(
            errors.is_empty(),
            "{} {definition} rejects {instance}:\n{}",
            self.version.as_str(),
            errors.join("\n")
        );
    }

    /// The definition a successful response validates as.
    fn result_response(&self) -> &'static str {
        if self.has("JSONRPCResultResponse") {
            "JSONRPCResultResponse"
        } else {
            "JSONRPCResponse"
        }
    }

    /// The definition an error response validates as.
    fn error_response(&self) -> &'static str {
        if self.has("JSONRPCErrorResponse") {
            "JSONRPCErrorResponse"
        } else {
            "JSONRPCError"
        }
    }
}

fn schemas() -> Vec<Schema> {
    ProtocolVersion::ALL.into_iter().map(Schema::load).collect()
}

/// The JSON in a reply: the body itself, or the data of its one SSE event.
fn message(reply: &Reply, framing: Framing) -> Value {
    let body = std::str::from_utf8(&reply.body).expect("reply is UTF-8");
    assert_eq!(reply.content_type, framing.content_type());
    let json = match framing {
        Framing::Json => body,
        Framing::Sse => {
            assert!(body.ends_with("\n\n"), "SSE event is terminated: {body:?}");
            let data: Vec<&str> = body
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .collect();
            assert_eq!(data.len(), 1, "one data line: {body:?}");
            assert!(body.lines().any(|line| line == "event: message"));
            data[0]
        }
    };
    serde_json::from_str(json).unwrap_or_else(|e| panic!("reply is not JSON ({e}): {json}"))
}

const FRAMINGS: [Framing; 2] = [Framing::Json, Framing::Sse];

fn ids() -> Vec<RawId> {
    [
        "0",
        "42",
        "-7",
        "9007199254740993",
        r#""req-1""#,
        r#""quote\" back\\ \u00e9 😀""#,
        r#""""#,
    ]
    .into_iter()
    .map(|text| RawId::from_json(text).expect("test id"))
    .collect()
}

fn failures() -> Vec<UpstreamFailure> {
    vec![
        UpstreamFailure::ConnectFailure,
        UpstreamFailure::Reset,
        UpstreamFailure::Timeout,
        UpstreamFailure::Http5xx(503),
        UpstreamFailure::NoHealthyUpstream,
        UpstreamFailure::BadResponse,
        UpstreamFailure::NoResponse,
        UpstreamFailure::SessionRefused(503),
        UpstreamFailure::SessionLimit {
            limit: 16,
            per_caller: true,
        },
    ]
}

fn kinds() -> Vec<UnavailableKind<'static>> {
    let mut kinds = vec![
        UnavailableKind::Open {
            cause: OpenCause::FailureRate {
                percent: 70,
                calls: 10,
                window_secs: 10,
            },
        },
        UnavailableKind::Open {
            cause: OpenCause::SlowCallRate {
                percent: 60,
                calls: 10,
                window_secs: 10,
                slow_call_ms: 2500,
            },
        },
        UnavailableKind::Open {
            cause: OpenCause::ProbeFailed,
        },
        UnavailableKind::Open {
            cause: OpenCause::Unknown,
        },
        UnavailableKind::Probing,
        UnavailableKind::Unconfigured,
        UnavailableKind::ForcedOpen {
            reason: "maintenance until 14:00 \"UTC\"\n\\ \u{0} \u{2028}",
        },
        UnavailableKind::ForcedOpen { reason: "" },
        UnavailableKind::Overloaded,
    ];
    kinds.extend(
        failures()
            .into_iter()
            .map(|what| UnavailableKind::UpstreamFailure { what }),
    );
    kinds
}

fn details() -> Vec<Unavailable<'static>> {
    let mut all = Vec::new();
    for kind in kinds() {
        for fallback_tool in [None, Some("write_order_queue")] {
            for retry_after_secs in [None, Some(1), Some(30)] {
                all.push(Unavailable {
                    kind,
                    tool: Some("write_order"),
                    retry_after_secs,
                    fallback_tool,
                });
            }
        }
    }
    all
}

#[test]
fn tool_unavailable_is_a_call_tool_result_in_every_version() {
    let mut checked = 0;
    for mut schema in schemas() {
        let response = schema.result_response();
        for framing in FRAMINGS {
            for id in ids() {
                for details in details() {
                    let reply = tool_unavailable(schema.version, &id, &details, framing);
                    let message = message(&reply, framing);
                    schema.assert_valid(response, &message);
                    schema.assert_valid("JSONRPCMessage", &message);
                    schema.assert_valid("CallToolResult", &message["result"]);
                    if schema.has("CallToolResultResponse") {
                        schema.assert_valid("CallToolResultResponse", &message);
                    }
                    assert_eq!(message["result"]["isError"], true);
                    assert_eq!(
                        message["id"],
                        serde_json::from_str::<Value>(id.as_json()).expect("id")
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 4 * 2 * ids().len() * details().len());
}

#[test]
fn service_unavailable_errors_are_json_rpc_errors_in_every_version() {
    for mut schema in schemas() {
        let error = schema.error_response();
        for framing in FRAMINGS {
            for id in ids() {
                for what in failures() {
                    let message = message(
                        &service_unavailable(schema.version, &id, "orders", what, framing),
                        framing,
                    );
                    schema.assert_valid(error, &message);
                    schema.assert_valid("JSONRPCMessage", &message);
                    if schema.has("InternalError") {
                        schema.assert_valid("InternalError", &message["error"]);
                    }
                    assert_eq!(message["error"]["code"], INTERNAL_ERROR);
                    assert!(message["error"]["data"]["io.toolgate/breaker"].is_object());
                }
            }
        }
    }
}

/// Refusals of requests the gateway cannot judge and too-deep bodies are
/// JSON-RPC errors, with the request's id when it could be read.
#[test]
fn refusals_are_json_rpc_errors_in_every_version() {
    let refusals = [
        Refusal::NotJson { line: 1, column: 7 },
        Refusal::Empty,
        Refusal::DuplicateKey("params.name"),
        Refusal::NotAnObject,
        Refusal::NotJsonRpc2,
        Refusal::MethodNotString,
        Refusal::BadId,
        Refusal::ParamsNotObject,
        Refusal::NotAMessage,
        Refusal::BadBatch,
        Refusal::BatchNotAllowed,
        Refusal::RequestWithoutId,
        Refusal::ToolNameAbsent,
        Refusal::ToolNameInvalid,
        Refusal::Encoded,
        Refusal::MethodNotAllowed,
        Refusal::BodyNotAllowed,
        Refusal::HeaderNotText("mcp-session-id"),
    ];
    for mut schema in schemas() {
        let error = schema.error_response();
        for framing in FRAMINGS {
            for refusal in refusals {
                let id = RawId::from_json("3").expect("id");
                let m = message(
                    &refused(schema.version, Some(&id), refusal, framing),
                    framing,
                );
                schema.assert_valid(error, &m);
                assert_eq!(m["error"]["code"], refusal.code());
            }
            if schema.version >= ProtocolVersion::V2025_11_25 {
                let m = message(&too_deep(schema.version, 64, framing), framing);
                schema.assert_valid(error, &m);
            }
        }
    }
}

/// A refused 2025-03-26 batch is an array of responses, each valid on its own.
#[test]
fn a_refused_batch_is_an_array_of_valid_responses() {
    let mut schema = Schema::load(ProtocolVersion::V2025_03_26);
    let (a, b, c) = (
        RawId::from_json("1").expect("id"),
        RawId::from_json("\"b\"").expect("id"),
        RawId::from_json("3").expect("id"),
    );
    let details = details()[0];
    let reply = batch_refused(
        schema.version,
        &[
            BatchAnswer::NotRun(&a),
            BatchAnswer::Unavailable(&b, details),
            BatchAnswer::Error(&c, -32602, "Unknown tool"),
        ],
        Framing::Json,
    );
    let array = message(&reply, Framing::Json);
    let answers = array.as_array().expect("an array");
    assert_eq!(answers.len(), 3);
    schema.assert_valid(schema.error_response(), &answers[0]);
    schema.assert_valid(schema.result_response(), &answers[1]);
    schema.assert_valid("CallToolResult", &answers[1]["result"]);
    schema.assert_valid(schema.error_response(), &answers[2]);
    if schema.has("JSONRPCBatchResponse") {
        schema.assert_valid("JSONRPCBatchResponse", &array);
    }
}

#[test]
fn header_mismatch_is_the_2026_header_mismatch_error() {
    let mut schema = Schema::load(ProtocolVersion::V2026_07_28);
    for framing in FRAMINGS {
        for id in ids().iter().map(Some).chain([None]) {
            let message = message(
                &header_mismatch(schema.version, id, Mismatch::NameDiffers, framing),
                framing,
            );
            schema.assert_valid("HeaderMismatchError", &message);
            schema.assert_valid("JSONRPCErrorResponse", &message);
        }
    }
}

#[test]
fn body_too_large_with_a_known_id_is_an_error_in_every_version() {
    for mut schema in schemas() {
        let error = schema.error_response();
        for framing in FRAMINGS {
            for id in ids() {
                let message = message(
                    &body_too_large(schema.version, Some(&id), 1 << 20, framing),
                    framing,
                );
                schema.assert_valid(error, &message);
                if schema.has("InvalidRequestError") {
                    schema.assert_valid("InvalidRequestError", &message["error"]);
                }
            }
        }
    }
}

/// From 2025-11-25 an error response may omit its id; before, the schemas require a string or
/// integer id, so the JSON-RPC `"id": null` for an unread request is the one deviation, and it
/// must be the only one.
#[test]
fn body_too_large_with_an_unknown_id() {
    for mut schema in schemas() {
        let error = schema.error_response();
        for framing in FRAMINGS {
            let message = message(
                &body_too_large(schema.version, None, u64::MAX, framing),
                framing,
            );
            if schema.version >= ProtocolVersion::V2025_11_25 {
                assert_eq!(message.get("id"), None);
                schema.assert_valid(error, &message);
            } else {
                assert_eq!(message.get("id"), Some(&Value::Null));
                let errors = schema.errors(error, &message);
                assert!(!errors.is_empty(), "the schema now accepts a null id");
                assert!(errors.iter().all(|e| e.ends_with(" at /id")), "{errors:?}");
                let mut with_id = message.clone();
                with_id["id"] = json!(0);
                schema.assert_valid(error, &with_id);
            }
        }
    }
}

/// The validators are not vacuous: broken replies fail them.
#[test]
fn the_validators_reject_broken_replies() {
    let id = RawId::from_json("1").expect("id");
    let details = details()[0];
    for mut schema in schemas() {
        let good = message(
            &tool_unavailable(schema.version, &id, &details, Framing::Json),
            Framing::Json,
        );
        let response = schema.result_response();

        let mut no_content = good.clone();
        no_content["result"]
            .as_object_mut()
            .expect("result")
            .remove("content");
        assert!(!schema
            .errors("CallToolResult", &no_content["result"])
            .is_empty());

        let mut bad_text = good.clone();
        bad_text["result"]["content"][0]["text"] = json!(5);
        assert!(!schema
            .errors("CallToolResult", &bad_text["result"])
            .is_empty());

        let mut null_id = good.clone();
        null_id["id"] = Value::Null;
        assert!(!schema.errors(response, &null_id).is_empty());

        let mut no_version = good.clone();
        no_version["jsonrpc"] = json!("1.0");
        assert!(!schema.errors(response, &no_version).is_empty());

        if schema.version == ProtocolVersion::V2026_07_28 {
            let mut incomplete = good.clone();
            incomplete["result"]
                .as_object_mut()
                .expect("result")
                .remove("resultType");
            assert!(!schema
                .errors("CallToolResult", &incomplete["result"])
                .is_empty());
        }
    }
}
