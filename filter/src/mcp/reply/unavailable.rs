//! What the agent is told when a tool or a server cannot be had: why (an open breaker, an
//! override, a failed upstream), whether the call may have run, and what to do next.

use super::*;

/// Why a call is not passed to the server, and what the agent should do instead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unavailable<'a> {
    pub kind: UnavailableKind<'a>,
    /// The tool called; `None` for methods other than `tools/call`.
    pub tool: Option<&'a str>,
    /// How long the gateway itself refuses the tool. `None` when nothing is enforced (an
    /// operator's override lasts until lifted; an upstream failure stops nobody retrying):
    /// an automatic retrier reads `0` as "retry now".
    pub retry_after_secs: Option<u64>,
    /// A tool the policy names to use instead.
    pub fallback_tool: Option<&'a str>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnavailableKind<'a> {
    /// The breaker is open; `cause` says which threshold tripped it.
    Open { cause: OpenCause },
    /// The breaker is half-open and its trial calls are all in flight.
    Probing,
    /// An operator forced the breaker open; `reason` is theirs and is shown to the model.
    ForcedOpen { reason: &'a str },
    /// This call's upstream failed.
    UpstreamFailure { what: UpstreamFailure },
    /// The service's connection pool is full (its bulkhead): too many calls in flight.
    Overloaded,
    /// The gateway has no configuration it accepted: it cannot judge the call, so it does not
    /// make it.
    Unconfigured,
    /// The aggregate endpoint `endpoint` (`/mcp`, `/virtual/<name>`) offers no tool of this
    /// name (unknown, or excluded by its selection). A tool result rather than a protocol
    /// error, as the reference servers answer an unknown tool: the model reads it and lists
    /// the tools again, where a client library would raise.
    NotOffered { endpoint: &'a str },
    /// The server takes each caller's own credential, exchanged by the gateway, and none
    /// could be had: `why` is toolgate-xds's sentence ("the identity provider refused to
    /// issue a token for orders: invalid_target"); `lasting`: another try fails alike until
    /// the configuration or the caller's rights change.
    NoCredential { why: &'a str, lasting: bool },
    /// The caller is over an operator's call limit; `limit` names the rule.
    Limited { limit: Limit<'a> },
}

/// A call limit as the agent is told of it: the rule's name and figures (this gateway's
/// share of them when a fleet splits the rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit<'a> {
    pub rule: &'a str,
    /// Whose budget: `subject`, `client` or `gateway`.
    pub per: &'static str,
    pub calls: u64,
    pub per_seconds: u64,
    pub burst: u64,
}

impl Limit<'_> {
    /// "this caller has used up its limit of 60 calls per 60 seconds (rule `r`)".
    pub fn describe(&self) -> String {
        let whose = match self.per {
            "gateway" => "all callers together have used up the",
            "client" => "this client has used up its",
            _ => "this caller has used up its",
        };
        format!(
            "{whose} limit of {} {} per {} {} (rule `{}`)",
            self.calls,
            plural(self.calls, "call", "calls"),
            self.per_seconds,
            plural(self.per_seconds, "second", "seconds"),
            self.rule
        )
    }
}

/// Why a breaker opened, with the figures that tripped it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenCause {
    FailureRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
    },
    SlowCallRate {
        percent: u32,
        calls: u32,
        window_secs: u64,
        slow_call_ms: u64,
    },
    /// A half-open trial call failed.
    ProbeFailed,
    /// A half-open trial call was slow.
    ProbeSlow,
    /// Another gateway of the fleet opened it.
    Fleet,
    /// A record that does not say (written by an older filter).
    Unknown,
}

/// How the upstream failed, as Envoy reports it; deliberately without any text from Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamFailure {
    ConnectFailure,
    Reset,
    Timeout,
    Http5xx(u16),
    NoHealthyUpstream,
    /// The server answered with something that is not the response to this request.
    BadResponse,
    /// The server's stream ended before it sent the response.
    NoResponse,
    /// The server refused to open a session for the call (this HTTP status; 503: it holds as
    /// many as it allows).
    SessionRefused(u16),
    /// The gateway holds as many sessions with the service as it allows, `limit` for this
    /// caller (`per_caller`) or for all its callers, none idle long enough to end.
    SessionLimit {
        limit: u32,
        per_caller: bool,
    },
    /// The server needs a session, and none could be opened: no toolgate-xds of the fleet is
    /// reachable.
    NoControlPlane,
}

impl UpstreamFailure {
    pub(super) fn code(self) -> &'static str {
        match self {
            UpstreamFailure::ConnectFailure => "connect_failure",
            UpstreamFailure::Reset => "reset",
            UpstreamFailure::Timeout => "timeout",
            UpstreamFailure::Http5xx(_) => "http_5xx",
            UpstreamFailure::NoHealthyUpstream => "no_healthy_upstream",
            UpstreamFailure::BadResponse => "bad_response",
            UpstreamFailure::NoResponse => "no_response",
            UpstreamFailure::SessionRefused(_) => "session_refused",
            UpstreamFailure::SessionLimit { .. } => "session_limit",
            UpstreamFailure::NoControlPlane => "no_control_plane",
        }
    }

    /// What happened, as the clause after "The call …".
    pub(super) fn clause(self) -> Cow<'static, str> {
        match self {
            UpstreamFailure::ConnectFailure => "could not reach a server".into(),
            UpstreamFailure::Reset => {
                "was cut off: the connection to the server was reset before it answered".into()
            }
            UpstreamFailure::Timeout => "got no answer from the server in time".into(),
            UpstreamFailure::Http5xx(status) => {
                format!("failed on the server (HTTP status {status})").into()
            }
            UpstreamFailure::NoHealthyUpstream => {
                "was not made: no healthy server is available right now".into()
            }
            UpstreamFailure::BadResponse => {
                "got an answer from the server that is not a valid response".into()
            }
            UpstreamFailure::NoResponse => {
                "was cut off: the server ended its answer before the response".into()
            }
            UpstreamFailure::SessionRefused(status) => format!(
                "was not made: the server refused to open a session for it (HTTP status {status})"
            )
            .into(),
            UpstreamFailure::SessionLimit { limit, per_caller } => format!(
                "was not made: the gateway holds at most {limit} {} with this service {}, and \
                 none has been idle long enough to end",
                plural(u64::from(limit), "session", "sessions"),
                if per_caller {
                    "for this caller"
                } else {
                    "for all its callers"
                }
            )
            .into(),
            UpstreamFailure::NoControlPlane => {
                "was not made: its server needs a session, and the gateway cannot open one \
                 while its control plane is unreachable"
                    .into()
            }
        }
    }

    /// Whether the call may have run on the server: it matters to a model about to repeat a
    /// call that changes something.
    pub(super) fn may_have_run(self) -> bool {
        !matches!(
            self,
            UpstreamFailure::ConnectFailure
                | UpstreamFailure::NoHealthyUpstream
                | UpstreamFailure::SessionRefused(_)
                | UpstreamFailure::SessionLimit { .. }
                | UpstreamFailure::NoControlPlane
        )
    }
}

impl OpenCause {
    pub(super) fn code(self) -> Option<&'static str> {
        Some(match self {
            OpenCause::FailureRate { .. } => "failure_rate",
            OpenCause::SlowCallRate { .. } => "slow_call_rate",
            OpenCause::ProbeFailed => "probe_failed",
            OpenCause::ProbeSlow => "probe_slow",
            OpenCause::Fleet => "fleet",
            OpenCause::Unknown => return None,
        })
    }

    pub(super) fn describe(self) -> Cow<'static, str> {
        match self {
            OpenCause::FailureRate {
                percent,
                calls,
                window_secs,
            } => format!(
                "{percent}% of its {calls} calls in the last {window_secs} {} failed",
                plural(window_secs, "second", "seconds")
            )
            .into(),
            OpenCause::SlowCallRate {
                percent,
                calls,
                window_secs,
                slow_call_ms,
            } => format!(
                "{percent}% of its {calls} calls in the last {window_secs} {} took {} or longer",
                plural(window_secs, "second", "seconds"),
                duration_words(slow_call_ms)
            )
            .into(),
            OpenCause::ProbeFailed => "a trial call after an earlier outage failed".into(),
            OpenCause::ProbeSlow => "a trial call after an earlier outage was too slow".into(),
            OpenCause::Fleet => "another gateway of this fleet found it failing".into(),
            OpenCause::Unknown => "its recent calls failed".into(),
        }
    }
}

/// Why a gateway without an accepted configuration refuses everything.
pub const UNCONFIGURED: &str = "the gateway has no valid configuration";

pub(super) fn plural(n: u64, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 {
        one
    } else {
        many
    }
}

pub(super) fn duration_words(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        let s = ms / 1000;
        format!("{s} {}", plural(s, "second", "seconds"))
    } else {
        format!("{ms} ms")
    }
}

/// The operator's reason as it may appear in a sentence: bounded, on one line, without a final
/// period (the sentence adds its own).
pub fn clean_reason(reason: &str) -> Cow<'_, str> {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let cut = &reason[..end];
    let trimmed = cut.trim().trim_end_matches('.').trim_end();
    if trimmed.chars().any(char::is_control) {
        Cow::Owned(
            trimmed
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(trimmed)
    }
}

impl UnavailableKind<'_> {
    pub(super) fn state(&self) -> &'static str {
        match self {
            UnavailableKind::Open { .. } => "open",
            UnavailableKind::Probing => "half_open",
            UnavailableKind::ForcedOpen { .. } => "forced_open",
            UnavailableKind::UpstreamFailure { .. } => "upstream_failure",
            UnavailableKind::Overloaded => "overloaded",
            UnavailableKind::Unconfigured => "unconfigured",
            UnavailableKind::NotOffered { .. } => "not_offered",
            UnavailableKind::NoCredential { .. } => "no_credential",
            UnavailableKind::Limited { .. } => "limited",
        }
    }

    /// The cause without a subject, for `_meta.reason`.
    pub(super) fn reason(&self) -> Cow<'_, str> {
        match self {
            UnavailableKind::Open { cause } => cause.describe(),
            UnavailableKind::Probing => "trial calls after an outage are in flight".into(),
            UnavailableKind::ForcedOpen { reason } => clean_reason(reason),
            UnavailableKind::UpstreamFailure { what } => what.clause(),
            UnavailableKind::Overloaded => "too many calls to its server are in flight".into(),
            UnavailableKind::Unconfigured => UNCONFIGURED.into(),
            UnavailableKind::NotOffered { .. } => {
                "this endpoint offers no tool of this name".into()
            }
            UnavailableKind::NoCredential { why, .. } => clean_reason(why),
            UnavailableKind::Limited { limit } => limit.describe().into(),
        }
    }
}

impl Unavailable<'_> {
    /// The content text the model reads: what happened, whether waiting helps, what to do
    /// instead.
    pub fn text(&self) -> String {
        let mut text = String::with_capacity(200);
        let subject = match self.tool {
            Some(tool) => format!("The tool `{tool}`"),
            None => "The server".to_string(),
        };
        match self.kind {
            UnavailableKind::Open { cause } => {
                let _ = write!(
                    text,
                    "{subject} is temporarily unavailable: {}.",
                    cause.describe()
                );
            }
            UnavailableKind::Probing => {
                let _ = write!(
                    text,
                    "{subject} is being tested after an outage and takes no other calls now."
                );
            }
            UnavailableKind::ForcedOpen { reason } => {
                let reason = clean_reason(reason);
                if reason.is_empty() {
                    let _ = write!(text, "{subject} is disabled by an operator.");
                } else {
                    let _ = write!(text, "{subject} is disabled by an operator: {reason}.");
                }
                text.push_str(" It stays disabled until the operator lifts this.");
            }
            UnavailableKind::UpstreamFailure { what } => {
                let call = match self.tool {
                    Some(tool) => format!("The call to the tool `{tool}`"),
                    None => "The request".to_string(),
                };
                let _ = write!(text, "{call} {}.", what.clause());
                if what.may_have_run() {
                    text.push_str(
                        " It may or may not have taken effect: check before repeating a call \
                         that changes something.",
                    );
                }
                match what {
                    UpstreamFailure::NoHealthyUpstream => {
                        text.push_str(" Another try may succeed once a server is back.")
                    }
                    UpstreamFailure::SessionRefused(_) | UpstreamFailure::SessionLimit { .. } => {
                        text.push_str(" Another try may succeed once a session is free.")
                    }
                    _ => text.push_str(" Another try may reach a healthy server."),
                }
            }
            UnavailableKind::Overloaded => {
                let _ = write!(
                    text,
                    "{subject} is busy: too many calls to its server are in flight. The call \
                     was not made; another try may succeed shortly."
                );
            }
            UnavailableKind::Unconfigured => {
                let _ = write!(
                    text,
                    "{subject} cannot be called: {UNCONFIGURED}, so it judges no call and \
                     makes none. An operator must look at the gateway."
                );
            }
            UnavailableKind::NotOffered { endpoint } => {
                text.push_str(&tool_not_offered_message(
                    endpoint,
                    self.tool.unwrap_or_default(),
                ));
            }
            UnavailableKind::NoCredential { why, lasting } => {
                let call = match self.tool {
                    Some(tool) => format!("The call to the tool `{tool}`"),
                    None => "The request".to_string(),
                };
                let _ = write!(
                    text,
                    "{call} was not made: its server takes a credential issued for each \
                     caller, and {}.",
                    clean_reason(why)
                );
                text.push_str(if lasting {
                    " Do not retry it: another try is refused alike until an operator or the \
                     identity provider changes this."
                } else {
                    " Another try may succeed in a few seconds."
                });
            }
            UnavailableKind::Limited { limit } => {
                let call = match self.tool {
                    Some(tool) => format!("The call to the tool `{tool}`"),
                    None => "The request".to_string(),
                };
                let _ = write!(
                    text,
                    "{call} was not made: {} at this gateway. The tool is not failing.",
                    limit.describe()
                );
            }
        }
        if let Some(n) = self.retry_after_secs {
            let _ = write!(
                text,
                " The gateway refuses it for the next {n} {}: do not retry it before then.",
                plural(n, "second", "seconds")
            );
        }
        match self.fallback_tool {
            Some(fallback) => {
                let _ = write!(text, " Use the tool `{fallback}` instead.");
            }
            None => text.push_str(" Continue without it or try a different approach."),
        }
        text
    }
}
