//! The lab's run-time knobs, and the one place that validates them, whether
//! they come from the command line or from `POST /control`.

use std::{collections::BTreeMap, fmt, str::FromStr, time::Duration};

use serde::Serialize;
use serde_json::{Map, Value};

pub const DEFAULT_TOOLS: &str = "read_order,write_order,echo";

/// Upper bound for any injected latency, so a typo cannot park a test for hours.
pub const MAX_LATENCY_MS: u64 = 600_000;

const KNOWN_KNOBS: &str =
    "latency_ms, tool_latency_ms, fail, fail_rate, health_fail, mcp_wedged, listing_unreadable";

/// What a call to a tool does instead of answering normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    None,
    /// HTTP 500 with a plain-text body, no JSON-RPC.
    Http500,
    /// HTTP 500 with no body at all (`Content-Length: 0`).
    Http500Empty,
    /// HTTP 502 with an HTML body, as a broken proxy in front of a server sends.
    Http502Html,
    /// HTTP 503 whose body is a well-formed JSON-RPC error for the request's id.
    Http503Jsonrpc,
    /// HTTP 200 `text/event-stream` that sends a progress notification and ends the stream
    /// without the response.
    SseEndsEarly,
    /// HTTP 200 `text/event-stream`: a progress notification, then the connection is reset
    /// in the middle of the stream.
    SseReset,
    /// HTTP 200 `application/json` with the full `Content-Length`: half the body, then the
    /// connection is reset.
    JsonReset,
    /// TCP RST, no HTTP response at all.
    Reset,
    /// No answer; the connection stays open until the client gives up.
    Hang,
    /// A JSON-RPC error (-32603) with the request's id.
    JsonrpcError,
    /// A valid `CallToolResult` with `isError: true`.
    IsError,
}

/// Where a failure has to be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layer {
    /// Below JSON-RPC: before rmcp sees the request.
    Http,
    /// Inside the MCP server, as a JSON-RPC answer.
    JsonRpc,
}

impl FailureMode {
    pub const ALL: [FailureMode; 12] = [
        FailureMode::None,
        FailureMode::Http500,
        FailureMode::Http500Empty,
        FailureMode::Http502Html,
        FailureMode::Http503Jsonrpc,
        FailureMode::SseEndsEarly,
        FailureMode::SseReset,
        FailureMode::JsonReset,
        FailureMode::Reset,
        FailureMode::Hang,
        FailureMode::JsonrpcError,
        FailureMode::IsError,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FailureMode::None => "none",
            FailureMode::Http500 => "http500",
            FailureMode::Http500Empty => "http500_empty",
            FailureMode::Http502Html => "http502_html",
            FailureMode::Http503Jsonrpc => "http503_jsonrpc",
            FailureMode::SseEndsEarly => "sse_ends_early",
            FailureMode::SseReset => "sse_reset",
            FailureMode::JsonReset => "json_reset",
            FailureMode::Reset => "reset",
            FailureMode::Hang => "hang",
            FailureMode::JsonrpcError => "jsonrpc_error",
            FailureMode::IsError => "is_error",
        }
    }

    /// `None` for [`FailureMode::None`], which fails nowhere.
    pub fn layer(self) -> Option<Layer> {
        match self {
            FailureMode::None => None,
            FailureMode::Http500
            | FailureMode::Http500Empty
            | FailureMode::Http502Html
            | FailureMode::Http503Jsonrpc
            | FailureMode::SseEndsEarly
            | FailureMode::SseReset
            | FailureMode::JsonReset
            | FailureMode::Reset
            | FailureMode::Hang => Some(Layer::Http),
            FailureMode::JsonrpcError | FailureMode::IsError => Some(Layer::JsonRpc),
        }
    }
}

impl fmt::Display for FailureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FailureMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FailureMode::ALL
            .into_iter()
            .find(|mode| mode.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = FailureMode::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown failure mode '{s}' (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// A knob value that was refused; the message names the field and the value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnobError(String);

impl fmt::Display for KnobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KnobError {}

fn refuse<T>(message: String) -> Result<T, KnobError> {
    Err(KnobError(message))
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Knobs {
    /// Delay before answering every `tools/call`.
    pub latency_ms: u64,
    /// Per-tool delays that replace `latency_ms` for that tool.
    pub tool_latency_ms: BTreeMap<String, u64>,
    /// Failure mode of every served tool.
    pub fail: BTreeMap<String, FailureMode>,
    /// Probability that a call to a tool with a failure mode actually fails.
    pub fail_rate: f64,
    /// `/health` answers 503.
    pub health_fail: bool,
    /// Every request to `/mcp` (any method) hangs while `/health` still
    /// answers: an HTTP stack that is up with its MCP handler wedged, which
    /// only a probe in MCP's own terms can see. A request parked while wedged
    /// stays parked (until its client gives up) after the knob is cleared.
    pub mcp_wedged: bool,
    /// `tools/list` is answered on an SSE stream with a listing no strict reader can read
    /// (its `tools` member twice, the first with every tool): a lenient client shows one of
    /// them, so a gateway that must filter the listing must not pass it on.
    pub listing_unreadable: bool,
}

impl Knobs {
    /// Healthy, fast, never failing knobs for `tools`.
    pub fn new(tools: &[String]) -> Self {
        Self {
            latency_ms: 0,
            tool_latency_ms: BTreeMap::new(),
            fail: tools
                .iter()
                .map(|tool| (tool.clone(), FailureMode::None))
                .collect(),
            fail_rate: 1.0,
            health_fail: false,
            mcp_wedged: false,
            listing_unreadable: false,
        }
    }

    pub fn latency_for(&self, tool: &str) -> Duration {
        let ms = self
            .tool_latency_ms
            .get(tool)
            .copied()
            .unwrap_or(self.latency_ms);
        Duration::from_millis(ms)
    }

    pub fn mode_for(&self, tool: &str) -> FailureMode {
        self.fail.get(tool).copied().unwrap_or(FailureMode::None)
    }

    fn check_tool(&self, tool: &str, field: &str) -> Result<(), KnobError> {
        if self.fail.contains_key(tool) {
            return Ok(());
        }
        let served: Vec<&str> = self.fail.keys().map(String::as_str).collect();
        refuse(format!(
            "{field}: unknown tool '{tool}' (this lab serves: {})",
            served.join(", ")
        ))
    }

    pub fn set_fail(&mut self, tool: &str, mode: FailureMode) -> Result<(), KnobError> {
        self.check_tool(tool, "fail")?;
        self.fail.insert(tool.to_owned(), mode);
        Ok(())
    }

    pub fn set_latency(&mut self, ms: u64) -> Result<(), KnobError> {
        self.latency_ms = check_latency("latency_ms", ms)?;
        Ok(())
    }

    /// `None` drops the override, so the tool follows `latency_ms` again.
    pub fn set_tool_latency(&mut self, tool: &str, ms: Option<u64>) -> Result<(), KnobError> {
        self.check_tool(tool, "tool_latency_ms")?;
        match ms {
            Some(ms) => {
                let field = format!("tool_latency_ms.{tool}");
                self.tool_latency_ms
                    .insert(tool.to_owned(), check_latency(&field, ms)?);
            }
            None => {
                self.tool_latency_ms.remove(tool);
            }
        }
        Ok(())
    }

    pub fn set_fail_rate(&mut self, rate: f64) -> Result<(), KnobError> {
        self.fail_rate = check_fail_rate(rate).map_err(KnobError)?;
        Ok(())
    }

    /// Applies a partial knobs object, as `POST /control` receives it. All or
    /// nothing: one bad field leaves every knob as it was.
    pub fn apply(&mut self, patch: &Value) -> Result<(), KnobError> {
        let Value::Object(fields) = patch else {
            return refuse(format!(
                "expected a JSON object of knobs ({KNOWN_KNOBS}), got {patch}"
            ));
        };
        let mut next = self.clone();
        for (field, value) in fields {
            match field.as_str() {
                "latency_ms" => next.set_latency(expect_ms(field, value)?)?,
                "tool_latency_ms" => {
                    for (tool, value) in expect_object(field, value)? {
                        let ms = match value {
                            Value::Null => None,
                            value => Some(expect_ms(&format!("{field}.{tool}"), value)?),
                        };
                        next.set_tool_latency(tool, ms)?;
                    }
                }
                "fail" => {
                    for (tool, value) in expect_object(field, value)? {
                        let Some(name) = value.as_str() else {
                            return refuse(format!(
                                "fail.{tool}: expected a failure mode name, got {value}"
                            ));
                        };
                        let mode = name
                            .parse()
                            .map_err(|error| KnobError(format!("fail.{tool}: {error}")))?;
                        next.set_fail(tool, mode)?;
                    }
                }
                "fail_rate" => {
                    let Some(rate) = value.as_f64() else {
                        return refuse(format!(
                            "fail_rate: expected a number from 0.0 to 1.0, got {value}"
                        ));
                    };
                    next.set_fail_rate(rate)?;
                }
                "health_fail" => {
                    let Some(flag) = value.as_bool() else {
                        return refuse(format!("health_fail: expected true or false, got {value}"));
                    };
                    next.health_fail = flag;
                }
                "mcp_wedged" => {
                    let Some(flag) = value.as_bool() else {
                        return refuse(format!("mcp_wedged: expected true or false, got {value}"));
                    };
                    next.mcp_wedged = flag;
                }
                "listing_unreadable" => {
                    let Some(flag) = value.as_bool() else {
                        return refuse(format!(
                            "listing_unreadable: expected true or false, got {value}"
                        ));
                    };
                    next.listing_unreadable = flag;
                }
                unknown => {
                    return refuse(format!("unknown knob '{unknown}' (known: {KNOWN_KNOBS})"))
                }
            }
        }
        *self = next;
        Ok(())
    }
}

fn expect_ms(field: &str, value: &Value) -> Result<u64, KnobError> {
    value.as_u64().ok_or_else(|| {
        KnobError(format!(
            "{field}: expected a whole number of milliseconds, got {value}"
        ))
    })
}

fn expect_object<'a>(field: &str, value: &'a Value) -> Result<&'a Map<String, Value>, KnobError> {
    value.as_object().ok_or_else(|| {
        KnobError(format!(
            "{field}: expected an object keyed by tool name, got {value}"
        ))
    })
}

fn check_latency(field: &str, ms: u64) -> Result<u64, KnobError> {
    if ms > MAX_LATENCY_MS {
        return refuse(format!(
            "{field}: {ms} ms is above the {MAX_LATENCY_MS} ms limit"
        ));
    }
    Ok(ms)
}

fn check_fail_rate(rate: f64) -> Result<f64, String> {
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("fail_rate: {rate} is not between 0.0 and 1.0"))
    }
}

/// `--fail TOOL=MODE`. Whether TOOL is served is checked once `--tools` is known.
pub fn parse_fail_spec(spec: &str) -> Result<(String, FailureMode), String> {
    let (tool, mode) = spec
        .split_once('=')
        .ok_or_else(|| format!("'{spec}' is not TOOL=MODE"))?;
    Ok((tool.to_owned(), mode.parse()?))
}

/// `--tool-latency TOOL=MS`.
pub fn parse_tool_latency(spec: &str) -> Result<(String, u64), String> {
    let (tool, ms) = spec
        .split_once('=')
        .ok_or_else(|| format!("'{spec}' is not TOOL=MILLISECONDS"))?;
    let ms = ms
        .parse()
        .map_err(|_| format!("'{ms}' in '{spec}' is not a whole number of milliseconds"))?;
    Ok((tool.to_owned(), ms))
}

/// `--fail-rate F`.
pub fn parse_fail_rate(value: &str) -> Result<f64, String> {
    let rate = value
        .parse()
        .map_err(|_| format!("'{value}' is not a number"))?;
    check_fail_rate(rate)
}

/// A tool name as MCP allows it: `[A-Za-z0-9_.-]{1,128}`.
pub fn parse_tool_name(name: &str) -> Result<String, String> {
    let valid = (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if valid {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "'{name}' is not a valid tool name ([A-Za-z0-9_.-], 1 to 128 characters)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn knobs() -> Knobs {
        Knobs::new(&["read_order".to_owned(), "write_order".to_owned()])
    }

    fn error_of(patch: Value) -> String {
        let mut knobs = knobs();
        let before = knobs.clone();
        let error = knobs.apply(&patch).err().map(|e| e.to_string());
        assert_eq!(knobs, before, "a refused patch must change nothing");
        error.unwrap_or_else(|| panic!("{patch} was accepted"))
    }

    #[test]
    fn partial_patch_changes_only_named_knobs() {
        let mut knobs = knobs();
        let applied = knobs.apply(&json!({
            "latency_ms": 300,
            "fail": {"write_order": "http500"},
            "tool_latency_ms": {"read_order": 5},
        }));
        assert_eq!(applied, Ok(()));
        assert_eq!(knobs.latency_for("write_order"), Duration::from_millis(300));
        assert_eq!(knobs.latency_for("read_order"), Duration::from_millis(5));
        assert_eq!(knobs.mode_for("write_order"), FailureMode::Http500);
        assert_eq!(knobs.mode_for("read_order"), FailureMode::None);
        assert_eq!(knobs.fail_rate, 1.0);

        assert_eq!(
            knobs.apply(&json!({"tool_latency_ms": {"read_order": null}})),
            Ok(())
        );
        assert_eq!(knobs.latency_for("read_order"), Duration::from_millis(300));
    }

    #[test]
    fn bad_patches_name_the_field_and_value() {
        assert!(error_of(json!({"latency_ms": -5})).contains("latency_ms"));
        assert!(error_of(json!({"latency_ms": 700_000})).contains("700000"));
        assert!(error_of(json!({"fail": {"write_order": "explode"}})).contains("'explode'"));
        assert!(error_of(json!({"fail": {"nope": "reset"}})).contains("'nope'"));
        assert!(error_of(json!({"fail_rate": 1.5})).contains("1.5"));
        assert!(error_of(json!({"health_fail": "yes"})).contains("health_fail"));
        assert!(error_of(json!({"mcp_wedged": 1})).contains("mcp_wedged"));
        assert!(
            error_of(json!({"nope": 1})).contains("mcp_wedged"),
            "listed as known"
        );
        assert!(error_of(json!({"latencyms": 1})).contains("'latencyms'"));
        assert!(error_of(json!([1])).contains("object"));
    }

    #[test]
    fn mcp_wedged_toggles() {
        let mut knobs = knobs();
        assert!(!knobs.mcp_wedged);
        assert_eq!(knobs.apply(&json!({"mcp_wedged": true})), Ok(()));
        assert!(knobs.mcp_wedged);
        assert!(!knobs.health_fail, "wedging MCP leaves health alone");
        assert_eq!(knobs.apply(&json!({"mcp_wedged": false})), Ok(()));
        assert!(!knobs.mcp_wedged);
    }

    #[test]
    fn a_bad_field_rolls_back_the_good_ones() {
        error_of(json!({"latency_ms": 10, "fail_rate": 2}));
    }

    #[test]
    fn command_line_specs_parse() {
        assert_eq!(
            parse_fail_spec("write_order=jsonrpc_error"),
            Ok(("write_order".to_owned(), FailureMode::JsonrpcError))
        );
        assert!(parse_fail_spec("write_order").is_err());
        assert!(parse_fail_spec("write_order=boom")
            .err()
            .is_some_and(|e| e.contains("'boom'")));
        assert_eq!(parse_tool_latency("echo=25"), Ok(("echo".to_owned(), 25)));
        assert!(parse_fail_rate("1.01").is_err());
        assert!(parse_tool_name("bad name").is_err());
        assert!(parse_tool_name("ok.name-1_x").is_ok());
    }
}
