//! What went wrong upstream, from what Envoy tells the filter about a response: its status,
//! the `x-envoy-overloaded` header and `response.code_details`.

use crate::mcp::reply::UpstreamFailure;

/// How the filter treats a response it watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The server answered; its body says how the call went.
    Answered,
    /// A client error (unknown session, header mismatch): the tool is not to blame.
    ClientError,
    /// Envoy's circuit breaker for the service (the bulkhead) refused the call.
    Overloaded,
    /// The upstream failed: the agent gets the semantic reply instead.
    Failed(UpstreamFailure),
}

/// Classifies a response by its status and Envoy's details. `code_details` is Envoy's
/// `response.code_details` (e.g. `no_healthy_upstream`,
/// `upstream_reset_before_response_started{connection_failure}`, `upstream_response_timeout`).
pub fn verdict(status: u16, overloaded: bool, code_details: &str) -> Verdict {
    if overloaded {
        return Verdict::Overloaded;
    }
    if status < 500 {
        return if status >= 400 && status != 429 {
            Verdict::ClientError
        } else {
            Verdict::Answered
        };
    }
    let what =
        if code_details.starts_with("no_healthy_upstream") || code_details == "cluster_not_found" {
            UpstreamFailure::NoHealthyUpstream
        } else if code_details.contains("connection_failure") {
            UpstreamFailure::ConnectFailure
        } else if code_details.starts_with("response_timeout")
            || code_details.starts_with("upstream_response_timeout")
            || code_details.starts_with("upstream_per_try_timeout")
        {
            UpstreamFailure::Timeout
        } else if code_details.starts_with("upstream_reset") {
            UpstreamFailure::Reset
        } else {
            UpstreamFailure::Http5xx(status)
        };
    Verdict::Failed(what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_details_map_to_failures() {
        assert_eq!(verdict(200, false, "via_upstream"), Verdict::Answered);
        assert_eq!(verdict(404, false, "via_upstream"), Verdict::ClientError);
        assert_eq!(
            verdict(
                503,
                true,
                "upstream_reset_before_response_started{overflow}"
            ),
            Verdict::Overloaded
        );
        assert_eq!(
            verdict(503, false, "no_healthy_upstream"),
            Verdict::Failed(UpstreamFailure::NoHealthyUpstream)
        );
        assert_eq!(
            verdict(503, false, "upstream_reset_before_response_started{remote_connection_failure,delayed_connect_error:_Connection_refused}"),
            Verdict::Failed(UpstreamFailure::ConnectFailure)
        );
        assert_eq!(
            verdict(
                503,
                false,
                "upstream_reset_before_response_started{connection_termination}"
            ),
            Verdict::Failed(UpstreamFailure::Reset)
        );
        // Envoy 1.40 says `response_timeout`; older ones `upstream_response_timeout`.
        for details in ["response_timeout", "upstream_response_timeout"] {
            assert_eq!(
                verdict(504, false, details),
                Verdict::Failed(UpstreamFailure::Timeout)
            );
        }
        assert_eq!(
            verdict(500, false, "via_upstream"),
            Verdict::Failed(UpstreamFailure::Http5xx(500))
        );
    }
}
