//! The protocol revision a reply is written for, and its framing (one JSON body or an SSE
//! event), as the request's headers ask.

/// MCP protocol revisions the filter writes replies for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProtocolVersion {
    V2025_03_26,
    V2025_06_18,
    V2025_11_25,
    V2026_07_28,
}

impl ProtocolVersion {
    pub const ALL: [ProtocolVersion; 4] = [
        ProtocolVersion::V2025_03_26,
        ProtocolVersion::V2025_06_18,
        ProtocolVersion::V2025_11_25,
        ProtocolVersion::V2026_07_28,
    ];

    /// The revision named exactly by `value`, if the filter knows it.
    pub fn parse(value: &str) -> Option<ProtocolVersion> {
        Some(match value {
            "2025-03-26" => ProtocolVersion::V2025_03_26,
            "2025-06-18" => ProtocolVersion::V2025_06_18,
            "2025-11-25" => ProtocolVersion::V2025_11_25,
            "2026-07-28" => ProtocolVersion::V2026_07_28,
            _ => return None,
        })
    }

    /// The revision to answer a request in, from its `MCP-Protocol-Version` header.
    ///
    /// Absent: 2025-03-26, as the transport specification tells servers to assume (that
    /// revision had no such header). Unknown: 2025-11-25, the last revision before results
    /// carry `resultType`; 2026-07-28 clients read a result without it as `complete`, so this
    /// shape is understood by every client.
    pub fn from_header(value: Option<&str>) -> ProtocolVersion {
        match value {
            None => ProtocolVersion::V2025_03_26,
            Some(v) => ProtocolVersion::parse(v.trim()).unwrap_or(ProtocolVersion::V2025_11_25),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProtocolVersion::V2025_03_26 => "2025-03-26",
            ProtocolVersion::V2025_06_18 => "2025-06-18",
            ProtocolVersion::V2025_11_25 => "2025-11-25",
            ProtocolVersion::V2026_07_28 => "2026-07-28",
        }
    }

    /// Whether requests carry `Mcp-Method` / `Mcp-Name` that must match the body.
    pub fn has_request_headers(self) -> bool {
        self >= ProtocolVersion::V2026_07_28
    }

    /// Results carry `resultType` (required from 2026-07-28).
    pub(crate) fn has_result_type(self) -> bool {
        self >= ProtocolVersion::V2026_07_28
    }

    /// An error response may omit its id when it is unknown (2025-11-25 on); earlier schemas
    /// require one, and JSON-RPC's `null` is then the only honest value.
    pub(super) fn may_omit_error_id(self) -> bool {
        self >= ProtocolVersion::V2025_11_25
    }
}

/// How the reply body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    Json,
    /// One `message` event, for clients that accept only `text/event-stream`.
    Sse,
}

impl Framing {
    /// SSE only when `Accept` lists `text/event-stream` and nothing that covers
    /// `application/json` (`application/json`, `application/*`, `*/*`); JSON otherwise,
    /// including without an `Accept` header. A media range with `q=0` is not accepted.
    pub fn from_accept(accept: Option<&str>) -> Framing {
        let Some(accept) = accept else {
            return Framing::Json;
        };
        let (mut json, mut sse) = (false, false);
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim();
            if parts.any(is_q_zero) {
                continue;
            }
            if media.eq_ignore_ascii_case("application/json")
                || media.eq_ignore_ascii_case("application/*")
                || media == "*/*"
            {
                json = true;
            } else if media.eq_ignore_ascii_case("text/event-stream") {
                sse = true;
            }
        }
        if sse && !json {
            Framing::Sse
        } else {
            Framing::Json
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Framing::Json => "application/json",
            Framing::Sse => "text/event-stream",
        }
    }
}

pub(super) fn is_q_zero(param: &str) -> bool {
    let Some((name, value)) = param.split_once('=') else {
        return false;
    };
    name.trim().eq_ignore_ascii_case("q")
        && value
            .trim()
            .parse::<f32>()
            .map(|q| q == 0.0)
            .unwrap_or(false)
}
