//! MCP replies the gateway sends in the server's place.
//!
//! When a breaker is open or the upstream failed, the agent gets a message its MCP client
//! accepts, for the protocol version it speaks and with its request's own id: for `tools/call` a
//! `CallToolResult` with `isError: true` whose text tells the model what happened and what to do
//! next, otherwise a JSON-RPC error. Machine-readable details sit under `io.toolgate/breaker`.
//!
//! The inputs are closed enums, validated names and numbers: no upstream text (addresses,
//! cluster names, response bodies) can reach a reply. The one free-form string, an operator's
//! reason for forcing a breaker open, is cleaned and cut to a bounded length.
//!
//! Retry advice is only given where it is true: a wait is named only when the gateway itself
//! refuses the tool until then (an open breaker), and an upstream failure says whether the
//! call may have taken effect rather than inventing a wait nothing enforces.
//!
//! Messages are written with serde_json; the id is a `RawValue`, echoed byte for byte.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::value::RawValue;

use super::headers::Mismatch;
use super::jsonrpc::RawId;
use super::request::{Refusal, INVALID_PARAMS, INVALID_REQUEST};
use super::response::HEADER_MISMATCH;

/// JSON-RPC "Internal error": the receiver cannot fulfil a valid request. The gateway uses it
/// for an unavailable server on methods other than `tools/call`; -32000..-32019 are legacy and
/// -32020..-32099 are reserved for codes the MCP specification defines (2026-07-28 basic,
/// "Error Codes"), so no code of its own is minted there.
pub const INTERNAL_ERROR: i64 = -32603;

/// Key of the gateway's details in `_meta` and in an error's `data` (a `_meta` key prefix must
/// be a reverse-DNS label the gateway owns; `io.modelcontextprotocol/` is reserved).
pub const META_KEY: &str = "io.toolgate/breaker";

/// Longest operator reason copied into a reply, in bytes.
pub const MAX_REASON_BYTES: usize = 512;

mod envelope;
mod framing;
#[cfg(test)]
mod tests;
mod unavailable;

pub use envelope::ById;
use envelope::*;
pub use framing::*;
pub use unavailable::*;

/// A reply ready to send: the body and its `Content-Type`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub body: Vec<u8>,
    pub content_type: &'static str,
}
/// The `CallToolResult` for a `tools/call` that is not passed on: `isError: true`, so the model
/// sees the failure and can change course, rather than its client raising a protocol error.
pub fn tool_unavailable(
    version: ProtocolVersion,
    id: &RawId,
    details: &Unavailable<'_>,
    framing: Framing,
) -> Reply {
    let text = details.text();
    let message = ResultMessage {
        jsonrpc: "2.0",
        id: id.as_raw(),
        result: ToolResult {
            content: [TextContent {
                kind: "text",
                text: &text,
            }],
            is_error: true,
            result_type: version.has_result_type().then_some("complete"),
            meta: Meta(details),
        },
    };
    framed(&message, framing, text.len() + 400)
}

/// A JSON-RPC error for request `id` (or an unknown id), in the client's framing. `message`
/// must be the gateway's own words.
pub fn error(
    version: ProtocolVersion,
    id: Option<&RawId>,
    code: i64,
    message: &str,
    data: Option<impl Serialize>,
    framing: Framing,
) -> Reply {
    let message_json = ErrorMessage {
        id: error_id(version, id),
        code,
        message,
        data,
    };
    framed(&message_json, framing, message.len() + 200)
}

/// A JSON-RPC result with the request's id, in the client's framing.
pub fn result(id: &RawId, result: &impl Serialize, framing: Framing) -> Reply {
    framed(
        &ResultMessage {
            jsonrpc: "2.0",
            id: id.as_raw(),
            result,
        },
        framing,
        512,
    )
}

/// The error for a method other than `tools/call` when no server could take it (16.10): says
/// which service and that no server is available, with the details in `data`.
pub fn service_unavailable(
    version: ProtocolVersion,
    id: &RawId,
    service: &str,
    what: UpstreamFailure,
    framing: Framing,
) -> Reply {
    let details = Unavailable {
        kind: UnavailableKind::UpstreamFailure { what },
        tool: None,
        retry_after_secs: None,
        fallback_tool: None,
    };
    let message = match what {
        UpstreamFailure::NoHealthyUpstream | UpstreamFailure::ConnectFailure => format!(
            "No server of the MCP service `{service}` is available right now; try again in a \
             few seconds."
        ),
        UpstreamFailure::Timeout => format!(
            "The MCP service `{service}` did not answer in time; try again in a few seconds."
        ),
        UpstreamFailure::SessionRefused(status) => format!(
            "The MCP service `{service}` refused to open a session (HTTP status {status}); try \
             again later."
        ),
        UpstreamFailure::SessionLimit { limit, per_caller } => format!(
            "The gateway holds at most {limit} sessions with the MCP service `{service}` {}, and \
             none has been idle long enough to end; try again later.",
            if per_caller {
                "for this caller"
            } else {
                "for all its callers"
            }
        ),
        _ => format!(
            "The MCP service `{service}` failed to answer this request; try again in a few \
             seconds."
        ),
    };
    error(
        version,
        Some(id),
        INTERNAL_ERROR,
        &message,
        Some(Meta(&details)),
        framing,
    )
}

/// The answer to a GET stream that could not be opened: no request id exists, so the error
/// has none (`null` before 2025-11-25); always JSON, since the client is not told an event
/// stream opened.
pub fn stream_unavailable(version: ProtocolVersion, service: &str, what: UpstreamFailure) -> Reply {
    let details = Unavailable {
        kind: UnavailableKind::UpstreamFailure { what },
        tool: None,
        retry_after_secs: None,
        fallback_tool: None,
    };
    let message = format!(
        "No server of the MCP service `{service}` is available for this stream right now; open \
         it again in a few seconds."
    );
    error(
        version,
        None,
        INTERNAL_ERROR,
        &message,
        Some(Meta(&details)),
        Framing::Json,
    )
}

/// The answer to a body the gateway cannot judge (see [`Refusal`]).
pub fn refused(
    version: ProtocolVersion,
    id: Option<&RawId>,
    refusal: Refusal,
    framing: Framing,
) -> Reply {
    let message = refusal.to_string();
    error(version, id, refusal.code(), &message, None::<()>, framing)
}

/// What an aggregate endpoint says of a tool it does not offer ([`UnavailableKind::NotOffered`]).
pub fn tool_not_offered_message(endpoint: &str, tool: &str) -> String {
    format!(
        "Unknown tool: this endpoint (`{endpoint}`) offers no tool `{tool}`. Call tools/list \
         for the tools it has."
    )
}

/// The answer to a `tools/call` on `/virtual/<name>` when no virtual server of that name is
/// configured. `name` follows the naming rule (checked on the path).
pub fn unknown_virtual_server(
    version: ProtocolVersion,
    id: &RawId,
    name: &str,
    framing: Framing,
) -> Reply {
    let message = format!(
        "Unknown endpoint: this gateway has no virtual server `{name}`, so it offers no tools \
         here. Use `/mcp` for every tool, or the name of a configured virtual server."
    );
    error(
        version,
        Some(id),
        INVALID_PARAMS,
        &message,
        None::<()>,
        framing,
    )
}

/// The message for a `tools/call` inside a batch on the aggregate endpoint: one request goes
/// to one service, so a call is routed only when it is sent alone.
pub const BATCHED_VIRTUAL_CALL: &str = "On this endpoint each tools/call must be sent alone, \
     not in a batch: the gateway routes every call to the service that owns its tool.";

/// `HeaderMismatch` (-32020) for a request whose headers disagree with its body.
pub fn header_mismatch(
    version: ProtocolVersion,
    id: Option<&RawId>,
    mismatch: Mismatch,
    framing: Framing,
) -> Reply {
    error(
        version,
        id,
        HEADER_MISMATCH,
        mismatch.describe(),
        None::<()>,
        framing,
    )
}

#[derive(Serialize)]
struct Limits {
    #[serde(rename = "io.toolgate/limits")]
    limits: LimitFields,
}

#[derive(Serialize)]
struct LimitFields {
    #[serde(rename = "maxBodyBytes", skip_serializing_if = "Option::is_none")]
    max_body_bytes: Option<u64>,
    #[serde(rename = "maxJsonDepth", skip_serializing_if = "Option::is_none")]
    max_json_depth: Option<u64>,
}

/// The error for a request body over the gateway's limit of `limit_bytes`. `id` is `None` when
/// the body was not read.
pub fn body_too_large(
    version: ProtocolVersion,
    id: Option<&RawId>,
    limit_bytes: u64,
    framing: Framing,
) -> Reply {
    let message = format!(
        "The request body is larger than this gateway accepts ({limit_bytes} bytes); send a smaller request."
    );
    let data = Limits {
        limits: LimitFields {
            max_body_bytes: Some(limit_bytes),
            max_json_depth: None,
        },
    };
    error(version, id, INVALID_REQUEST, &message, Some(data), framing)
}

/// The answer to a request body nested deeper than the gateway accepts (no id: such a body
/// is not parsed).
pub fn too_deep(version: ProtocolVersion, limit: u64, framing: Framing) -> Reply {
    let message = format!(
        "The request nests arrays and objects deeper than this gateway accepts ({limit} levels); send a flatter request."
    );
    let data = Limits {
        limits: LimitFields {
            max_body_bytes: None,
            max_json_depth: Some(limit),
        },
    };
    error(
        version,
        None,
        INVALID_REQUEST,
        &message,
        Some(data),
        framing,
    )
}

/// One element of a refused batch's answer.
pub enum BatchAnswer<'a> {
    /// The tool of this call is unavailable: its semantic tool result.
    Unavailable(&'a RawId, Unavailable<'a>),
    /// Refused as a request (an unknown tool, an invalid name): its JSON-RPC error.
    Error(&'a RawId, i64, &'a str),
    /// Not executed because another element was refused.
    NotRun(&'a RawId),
}

/// The answer to a 2025-03-26 batch of which some call was refused: nothing of it ran. One
/// response per request of the batch (notifications get none), in the client's framing.
pub fn batch_refused(
    version: ProtocolVersion,
    answers: &[BatchAnswer<'_>],
    framing: Framing,
) -> Reply {
    struct Batch<'r, 'a>(&'r [BatchAnswer<'a>], ProtocolVersion);
    impl Serialize for Batch<'_, '_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeSeq;
            let mut seq = s.serialize_seq(Some(self.0.len()))?;
            for answer in self.0 {
                match answer {
                    BatchAnswer::Unavailable(id, details) => {
                        let text = details.text();
                        seq.serialize_element(&ResultMessage {
                            jsonrpc: "2.0",
                            id: id.as_raw(),
                            result: ToolResult {
                                content: [TextContent {
                                    kind: "text",
                                    text: &text,
                                }],
                                is_error: true,
                                result_type: self.1.has_result_type().then_some("complete"),
                                meta: Meta(details),
                            },
                        })?;
                    }
                    BatchAnswer::Error(id, code, message) => {
                        seq.serialize_element(&ErrorMessage {
                            id: ErrorId::Raw(id.as_raw()),
                            code: *code,
                            message,
                            data: None::<()>,
                        })?
                    }
                    BatchAnswer::NotRun(id) => seq.serialize_element(&ErrorMessage {
                        id: ErrorId::Raw(id.as_raw()),
                        code: INVALID_REQUEST,
                        message: "Not run: another call in this batch was refused, so the \
                                  gateway ran none of it. Send the calls one by one.",
                        data: None::<()>,
                    })?,
                }
            }
            seq.end()
        }
    }
    framed(&Batch(answers, version), framing, 400 * answers.len())
}
