//! Call limits on the request path: the rules of the service (every request) and of the tool
//! called, each a bucket per caller in shared data (see [`crate::limits`]). Checked after the
//! caller is authenticated and authorized and before the breaker: a refused call is never
//! evidence about the tool, and a call an operator forced open takes no token.

use toolgate_model::limits::{LimitRule, Per};

use super::*;
use crate::limits::{self, Share, Take};

/// The `tool` label of a rule that covers every request of its service.
pub const SERVICE_WIDE: &str = "*";
/// The JSON-RPC error code of a request other than `tools/call` refused for a limit (the
/// range JSON-RPC leaves to servers).
pub const LIMITED_CODE: i64 = -32029;

/// A request over a limit: the rule as stored (its fleet-wide figures) and when the bucket
/// has a token again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OverLimit {
    pub(super) rule: String,
    pub(super) per: Per,
    pub(super) calls: u64,
    pub(super) per_seconds: u64,
    pub(super) burst: u64,
    pub(super) retry_after_secs: u64,
}

impl OverLimit {
    pub(super) fn limit(&self) -> reply::Limit<'_> {
        reply::Limit {
            rule: &self.rule,
            per: self.per.as_str(),
            calls: self.calls,
            per_seconds: self.per_seconds,
            burst: self.burst,
        }
    }
}

/// The client's address as Envoy sees it. The connection manager uses the remote address
/// and appends it to `X-Forwarded-For` before any filter runs, so its last entry is that
/// address, whatever a client wrote before it; it is read from the headers already at hand.
/// Without it (a bootstrap that does not append), the stream's source address (a host call).
pub(super) fn client_address(host: &impl CallHost) -> String {
    if let Some(last) = host
        .request_header("x-forwarded-for")
        .as_deref()
        .and_then(|xff| xff.rsplit(',').next())
        .map(str::trim)
        .filter(|a| !a.is_empty())
    {
        return crate::held_session::host_of(last).to_string();
    }
    let address = host
        .property(&["source", "address"])
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default();
    crate::held_session::host_of(&address).to_string()
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// Whether `service` has limits at all: the one lookup a request without any pays.
    pub(super) fn has_limits(&self, service: &str) -> bool {
        let shared = self.shared.borrow();
        !shared.config.limits.services.is_empty()
            && shared.config.limits.services.contains_key(service)
    }

    /// Takes a token from each bucket this request counts against: the service's rules, and
    /// the tool's when it is a `tools/call`. The first bucket that is empty refuses it (the
    /// tokens taken before it stay taken: a refused caller is refused a little longer, never
    /// admitted more).
    pub(super) fn over_limit(
        &mut self,
        host: &impl CallHost,
        service: &str,
        tool: Option<&str>,
    ) -> Option<OverLimit> {
        let now = host.now_ms();
        let subject = self
            .auth
            .verified
            .as_ref()
            .map(|v| v.caller.subject.clone())
            .filter(|s| !s.is_empty());
        // The source address, read once and only when a rule needs it: a session id is the
        // client's to choose or to renew, so counting by it would let a client reset its
        // budget at will; Envoy's downstream address (after its trusted-hops setting) is not.
        let mut client: Option<String> = None;
        let refused = {
            let shared = self.shared.borrow();
            let limits = &shared.config.limits;
            let service_limits = limits.services.get(service)?;
            let tool_rules = tool.and_then(|t| Some((t, service_limits.tools.get(t)?)));
            let scoped = tool_rules
                .into_iter()
                .flat_map(|(t, rules)| rules.iter().map(move |r| (t, r)))
                .chain(service_limits.rules.iter().map(|r| (SERVICE_WIDE, r)));
            let store = shared.breakers.store();
            let mut local = shared.limit_tokens.borrow_mut();
            let mut refused: Option<(&str, &LimitRule, u64, String)> = None;
            for (scope, rule) in scoped {
                let caller = match (rule.per, &subject) {
                    (Per::Gateway, _) => String::new(),
                    (Per::Subject, Some(sub)) => format!("s:{sub}"),
                    (Per::Subject, None) | (Per::Client, _) => client
                        .get_or_insert_with(|| format!("c:{}", client_address(host)))
                        .clone(),
                };
                let id = limits::rule_bucket(service, scope, rule, &caller);
                if let Take::Refused { retry_after_ms } =
                    local.take(store, id, Share::of(rule, limits.gateways), now)
                {
                    refused = Some((scope, rule, retry_after_ms, caller));
                    break;
                }
            }
            refused.map(|(scope, rule, retry_after_ms, caller)| {
                (
                    scope.to_string(),
                    caller,
                    OverLimit {
                        rule: rule.label(),
                        per: rule.per,
                        calls: rule.calls,
                        per_seconds: rule.per_seconds,
                        burst: rule.burst(),
                        retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
                    },
                )
            })
        };
        let (scope, caller, over) = refused?;
        {
            let shared = self.shared.borrow();
            let shown = match caller.split_once(':') {
                Some(("s", sub)) => format!("subject:{sub}"),
                Some(("c", address)) => format!("client:{address}"),
                _ => "gateway".to_string(),
            };
            shared
                .feedback
                .borrow_mut()
                .record_limited(service, &scope, &over.rule, &shown);
        }
        self.shared
            .borrow_mut()
            .stats
            .count_named(limit_metric(service, &scope, &over.rule));
        self.log_field(host, log_field::LIMIT, &over.rule);
        Some(over)
    }

    /// A request other than `tools/call` over a limit: HTTP 429 with `Retry-After`, and a
    /// JSON-RPC error with its id saying which limit and when to try again.
    pub(super) fn refuse_over_limit(
        &mut self,
        host: &impl CallHost,
        id: &RawId,
        over: &OverLimit,
    ) -> Action {
        let secs = over.retry_after_secs;
        let message = format!(
            "The request was not made: {} at this gateway. Do not retry it before {secs} {}.",
            over.limit().describe(),
            if secs == 1 { "second" } else { "seconds" }
        );
        let data = serde_json::json!({
            "state": "limited",
            "retryAfterSeconds": secs,
            "limit": {
                "rule": over.rule,
                "per": over.per.as_str(),
                "calls": over.calls,
                "perSeconds": over.per_seconds,
                "burst": over.burst,
            },
        });
        let reply = reply::error(
            self.version,
            Some(id),
            LIMITED_CODE,
            &message,
            Some(data),
            self.framing,
        );
        let retry_after = secs.to_string();
        self.send_local(host, 429, &reply, &[("retry-after", &retry_after)])
    }
}

/// The counter of requests a rule refused (before Envoy's `wasmcustom.`); the bootstrap's
/// tags make it `toolgate_limited_total{service, tool, rule}`. Never labelled by caller: one
/// series per subject would be unbounded. Names come from the configuration, not requests.
pub fn limit_metric(service: &str, tool: &str, rule: &str) -> String {
    format!(
        "{}.service={service}.tool={tool}.rule={rule}.limited_total",
        crate::stats::PREFIX
    )
}
