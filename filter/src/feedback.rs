//! Per-endpoint call outcomes for toolgate-xds, whose health state machine marks an instance
//! UNHEALTHY when its calls fail: the filter sees every call, the control plane's probes only
//! see `/health`.
//!
//! Each worker VM counts the outcomes of the `tools/call`s it admitted, per (service, upstream
//! address), and its root context posts the counts since the last report at most every
//! [`INTERVAL_MS`] (see `host.rs`). The request path does one map lookup per call and allocates
//! only the first time an endpoint is seen; an endpoint with no call during a whole report
//! interval is forgotten, so the map holds the endpoints in use, up to [`MAX_ENDPOINTS`].

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use crate::mcp::reply::UpstreamFailure;
use crate::upstream::Verdict;

/// The Envoy cluster of toolgate-xds's feedback API; the bootstrap defines it.
pub const CLUSTER: &str = toolgate_model::envoy::CONTROL_CLUSTER;

/// `Bearer <token>` when toolgate-xds requires a token of the filters, else empty: what every
/// request to it carries (reports, and questions about sessions held for clients).
pub fn authorization(token: &toolgate_model::policy::SecretString) -> String {
    if token.is_empty() {
        String::new()
    } else {
        format!("Bearer {}", token.0)
    }
}

/// The headers of a report to toolgate-xds (`authorization` only when it is not empty).
pub fn report_headers<'a>(path: &'a str, authorization: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", AUTHORITY),
        ("content-type", "application/json"),
    ];
    if !authorization.is_empty() {
        headers.push(("authorization", authorization));
    }
    headers
}

pub const PATH: &str = "/v1/feedback";
pub const AUTHORITY: &str = "toolgate-xds";
/// A report is worth less than the request path it must never slow down: short, never retried.
pub const TIMEOUT: Duration = Duration::from_secs(1);
/// Reports per worker are at least this far apart.
pub const INTERVAL_MS: u64 = 250;
/// (service, address) pairs counted per worker. Addresses come from Envoy's endpoints, so more
/// than this means something is off; the excess is dropped, not buffered.
pub const MAX_ENDPOINTS: usize = 1024;

/// How an admitted call went, as the instance that served it is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The instance answered, whatever it said: a JSON-RPC error or a 4xx is still an answer.
    Ok,
    ConnectFailure,
    Reset,
    Timeout,
    Http5xx,
}

impl Kind {
    /// What a response verdict says about the instance; `None` when no instance is to blame
    /// (Envoy refused the call before choosing one).
    pub fn of_verdict(v: Verdict) -> Option<Kind> {
        match v {
            Verdict::Answered | Verdict::ClientError => Some(Kind::Ok),
            Verdict::Overloaded => None,
            Verdict::Failed(what) => Kind::of_failure(what),
        }
    }

    pub fn of_failure(what: UpstreamFailure) -> Option<Kind> {
        match what {
            UpstreamFailure::ConnectFailure => Some(Kind::ConnectFailure),
            UpstreamFailure::Reset => Some(Kind::Reset),
            UpstreamFailure::Timeout => Some(Kind::Timeout),
            UpstreamFailure::Http5xx(_) => Some(Kind::Http5xx),
            UpstreamFailure::NoHealthyUpstream => None,
            // It answered, if with something that is not the response: the instance is up.
            UpstreamFailure::BadResponse => Some(Kind::Ok),
            // Its stream ended before the response: as good as a reset.
            UpstreamFailure::NoResponse => Some(Kind::Reset),
            // Never sent to an instance: nothing to say of one.
            UpstreamFailure::SessionRefused(_) | UpstreamFailure::SessionLimit { .. } => None,
            // The instance answered that it needs a session: nothing against it.
            UpstreamFailure::NoControlPlane => None,
        }
    }
}

/// Calls to one endpoint since the last report. Every field is always written: the server
/// then needs no defaults.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub ok: u64,
    pub connect_failure: u64,
    pub reset: u64,
    pub timeout: u64,
    pub http_5xx: u64,
}

impl Counts {
    fn add(&mut self, kind: Kind) {
        let n = match kind {
            Kind::Ok => &mut self.ok,
            Kind::ConnectFailure => &mut self.connect_failure,
            Kind::Reset => &mut self.reset,
            Kind::Timeout => &mut self.timeout,
            Kind::Http5xx => &mut self.http_5xx,
        };
        *n = n.saturating_add(1);
    }

    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

#[derive(Serialize)]
struct Report<'a> {
    service: &'a str,
    address: &'a str,
    #[serde(flatten)]
    counts: Counts,
}

#[derive(Serialize)]
struct Body<'a> {
    reports: Vec<Report<'a>>,
    /// Requests a call limit refused since the last report, by (service, tool, rule, caller):
    /// toolgate-xds keeps who is limited most (never a metric: one series per caller would
    /// be unbounded).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    limited: Vec<Limited<'a>>,
}

#[derive(Serialize)]
struct Limited<'a> {
    service: &'a str,
    tool: &'a str,
    rule: &'a str,
    caller: &'a str,
    count: u64,
}

/// (service, tool, rule, caller) of a refusal counted for the report.
type LimitedKey = (String, String, String, String);

/// Distinct refused (service, tool, rule, caller) counted per worker between reports; a
/// flood of callers beyond is counted as dropped.
pub const MAX_LIMITED: usize = 256;

/// What one flush has to say.
#[derive(Debug, PartialEq, Eq)]
pub struct Batch {
    /// The JSON body to post; `None` when only drops happened.
    pub body: Option<Vec<u8>>,
    /// Endpoints in the body.
    pub endpoints: usize,
    /// Calls not counted since the last flush because the map was full.
    pub dropped: u64,
}

/// One worker's counts, by service then address, so that a known endpoint is found by `&str`
/// without building a key.
#[derive(Debug, Default)]
pub struct Feedback {
    services: HashMap<String, HashMap<String, Counts>>,
    endpoints: usize,
    limited: HashMap<LimitedKey, u64>,
    /// Something was counted since the last flush.
    pending: bool,
    dropped: u64,
    flushed_at_ms: Option<u64>,
}

impl Feedback {
    pub fn new() -> Feedback {
        Feedback::default()
    }

    /// Counts one call to `address` of `service`.
    pub fn record(&mut self, service: &str, address: &str, kind: Kind) {
        if let Some(counts) = self
            .services
            .get_mut(service)
            .and_then(|addresses| addresses.get_mut(address))
        {
            counts.add(kind);
            self.pending = true;
            return;
        }
        if self.endpoints >= MAX_ENDPOINTS {
            self.dropped = self.dropped.saturating_add(1);
            return;
        }
        let mut counts = Counts::default();
        counts.add(kind);
        if !self.services.contains_key(service) {
            self.services.insert(service.to_owned(), HashMap::new());
        }
        if let Some(addresses) = self.services.get_mut(service) {
            addresses.insert(address.to_owned(), counts);
            self.endpoints += 1;
            self.pending = true;
        }
    }

    /// Counts one request a call limit refused: `caller` as the rule counts it
    /// (`subject:<sub>`, `client:<address>`, `gateway`).
    pub fn record_limited(&mut self, service: &str, tool: &str, rule: &str, caller: &str) {
        let key = (
            service.to_owned(),
            tool.to_owned(),
            rule.to_owned(),
            caller.to_owned(),
        );
        if let Some(n) = self.limited.get_mut(&key) {
            *n = n.saturating_add(1);
        } else if self.limited.len() < MAX_LIMITED {
            self.limited.insert(key, 1);
        } else {
            self.dropped = self.dropped.saturating_add(1);
            return;
        }
        self.pending = true;
    }

    /// (service, address) pairs held, counted or idle since the last flush.
    pub fn len(&self) -> usize {
        self.endpoints
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints == 0
    }

    /// The report due at `now_ms`, if any: at most one per [`INTERVAL_MS`], and only when
    /// there is something to say. Resets the counts and forgets the endpoints that had no call
    /// since the previous flush.
    pub fn flush(&mut self, now_ms: u64) -> Option<Batch> {
        let due = match self.flushed_at_ms {
            // A clock that went back must not silence the reports until it catches up.
            Some(at) => now_ms < at || now_ms - at >= INTERVAL_MS,
            None => true,
        };
        if !due || (!self.pending && self.dropped == 0) {
            return None;
        }
        let (body, endpoints) = if self.pending {
            let mut reports: Vec<Report<'_>> = self
                .services
                .iter()
                .flat_map(|(service, addresses)| {
                    addresses
                        .iter()
                        .filter(|(_, counts)| !counts.is_zero())
                        .map(move |(address, counts)| Report {
                            service,
                            address,
                            counts: *counts,
                        })
                })
                .collect();
            // Map order is random: a stable order makes bodies comparable in logs and tests.
            reports.sort_unstable_by(|a, b| (a.service, a.address).cmp(&(b.service, b.address)));
            let endpoints = reports.len();
            let mut limited: Vec<Limited<'_>> = self
                .limited
                .iter()
                .map(|((service, tool, rule, caller), &count)| Limited {
                    service,
                    tool,
                    rule,
                    caller,
                    count,
                })
                .collect();
            limited.sort_unstable_by(|a, b| {
                (a.service, a.tool, a.rule, a.caller).cmp(&(b.service, b.tool, b.rule, b.caller))
            });
            // Strings and integers always serialize; `ok()` only avoids a panic path.
            (
                serde_json::to_vec(&Body { reports, limited }).ok(),
                endpoints,
            )
        } else {
            (None, 0)
        };
        self.services.retain(|_, addresses| {
            addresses.retain(|_, counts| {
                let used = !counts.is_zero();
                *counts = Counts::default();
                used
            });
            !addresses.is_empty()
        });
        self.endpoints = self.services.values().map(HashMap::len).sum();
        self.limited.clear();
        self.pending = false;
        self.flushed_at_ms = Some(now_ms);
        Some(Batch {
            body,
            endpoints,
            dropped: std::mem::take(&mut self.dropped),
        })
    }
}

/// How toolgate-xds answered a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Accepted,
    /// Any status but 2xx.
    Rejected(u16),
    /// Timeout or connection failure: Envoy calls back with no headers.
    NoAnswer,
}

impl Answer {
    pub fn of_status(status: Option<u16>) -> Answer {
        match status {
            Some(s) if (200..300).contains(&s) => Answer::Accepted,
            Some(s) => Answer::Rejected(s),
            None => Answer::NoAnswer,
        }
    }
}

/// How reports fare, so that each change is logged once rather than every flush.
#[derive(Debug, Default)]
pub struct Delivery {
    dispatch_failing: bool,
    last_answer: Option<Answer>,
}

impl Delivery {
    pub fn new() -> Delivery {
        Delivery::default()
    }

    /// Whether the host accepted a report for sending; true when a refusal starts a run of them
    /// (log it then).
    pub fn dispatched(&mut self, accepted: bool) -> bool {
        let starts_failing = !accepted && !self.dispatch_failing;
        self.dispatch_failing = !accepted;
        starts_failing
    }

    /// An answer arrived; returns it when it differs from the previous one (log it then).
    /// The first acceptance is not news.
    pub fn answered(&mut self, answer: Answer) -> Option<Answer> {
        match self.last_answer.replace(answer) {
            None if answer == Answer::Accepted => None,
            Some(last) if last == answer => None,
            _ => Some(answer),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    fn body(batch: &Batch) -> Value {
        let bytes = batch.body.as_deref().expect("a body");
        serde_json::from_slice(bytes).expect("valid JSON")
    }

    #[test]
    fn refusals_by_a_limit_are_reported_by_caller_and_bounded() {
        let mut f = Feedback::new();
        f.record_limited("orders", "*", "reads", "subject:alice");
        f.record_limited("orders", "*", "reads", "subject:alice");
        f.record_limited("orders", "pay", "daily", "client:10.0.0.1");
        let batch = f.flush(1000).expect("a batch");
        assert_eq!(
            body(&batch)["limited"],
            json!([
                {"service": "orders", "tool": "*", "rule": "reads", "caller": "subject:alice", "count": 2},
                {"service": "orders", "tool": "pay", "rule": "daily", "caller": "client:10.0.0.1", "count": 1},
            ])
        );
        assert!(f.flush(2000).is_none(), "reported once");
        for i in 0..MAX_LIMITED + 10 {
            f.record_limited("orders", "*", "reads", &format!("subject:s{i}"));
        }
        let batch = f.flush(3000).expect("a batch");
        assert_eq!(
            body(&batch)["limited"].as_array().map(Vec::len),
            Some(MAX_LIMITED)
        );
        assert_eq!(batch.dropped, 10);
    }

    #[test]
    fn the_body_has_every_count_per_endpoint() {
        let mut f = Feedback::new();
        for _ in 0..12 {
            f.record("inv", "127.0.0.1:9001", Kind::Ok);
        }
        f.record("inv", "127.0.0.1:9001", Kind::Reset);
        f.record("inv", "127.0.0.1:9001", Kind::Http5xx);
        f.record("inv", "127.0.0.1:9001", Kind::Http5xx);
        f.record("inv", "127.0.0.1:9002", Kind::ConnectFailure);
        f.record("orders", "127.0.0.1:9001", Kind::Timeout);
        let batch = f.flush(1000).expect("a batch");
        assert_eq!(batch.endpoints, 3);
        assert_eq!(batch.dropped, 0);
        assert_eq!(
            body(&batch),
            json!({"reports": [
                {"service": "inv", "address": "127.0.0.1:9001",
                 "ok": 12, "connect_failure": 0, "reset": 1, "timeout": 0, "http_5xx": 2},
                {"service": "inv", "address": "127.0.0.1:9002",
                 "ok": 0, "connect_failure": 1, "reset": 0, "timeout": 0, "http_5xx": 0},
                {"service": "orders", "address": "127.0.0.1:9001",
                 "ok": 0, "connect_failure": 0, "reset": 0, "timeout": 1, "http_5xx": 0},
            ]})
        );
    }

    #[test]
    fn names_are_escaped() {
        let mut f = Feedback::new();
        f.record("a\"b\\c", "[::1]:80\n", Kind::Ok);
        let batch = f.flush(0).expect("a batch");
        assert_eq!(body(&batch)["reports"][0]["service"], "a\"b\\c");
        assert_eq!(body(&batch)["reports"][0]["address"], "[::1]:80\n");
    }

    #[test]
    fn counts_are_since_the_last_report_and_paced() {
        let mut f = Feedback::new();
        assert_eq!(f.flush(0), None, "nothing to send");
        f.record("inv", "a:1", Kind::Ok);
        assert!(f.flush(0).is_some());
        f.record("inv", "a:1", Kind::Reset);
        assert_eq!(f.flush(INTERVAL_MS - 1), None, "too soon");
        let batch = f.flush(INTERVAL_MS).expect("due");
        let report = &body(&batch)["reports"][0];
        assert_eq!(
            (report["ok"].as_u64(), report["reset"].as_u64()),
            (Some(0), Some(1))
        );
        assert_eq!(f.flush(10 * INTERVAL_MS), None, "nothing since");
        // A clock that went back does not hold reports until it catches up.
        f.record("inv", "a:1", Kind::Ok);
        assert!(f.flush(5).is_some());
    }

    #[test]
    fn endpoints_idle_for_a_whole_interval_are_forgotten() {
        let mut f = Feedback::new();
        f.record("inv", "a:1", Kind::Ok);
        f.record("inv", "b:1", Kind::Ok);
        f.record("orders", "c:1", Kind::Ok);
        assert!(f.flush(0).is_some());
        assert_eq!(f.len(), 3, "kept: counted during the interval");
        f.record("inv", "a:1", Kind::Ok);
        let batch = f.flush(INTERVAL_MS).expect("due");
        assert_eq!(batch.endpoints, 1, "idle endpoints are not reported");
        assert_eq!(f.len(), 1);
        assert!(!f.services.contains_key("orders"), "empty services go too");
    }

    #[test]
    fn past_the_cap_new_endpoints_are_dropped_and_counted() {
        let mut f = Feedback::new();
        for i in 0..MAX_ENDPOINTS {
            f.record("svc", &format!("10.0.0.1:{i}"), Kind::Ok);
        }
        f.record("svc", "10.0.0.2:1", Kind::Reset);
        f.record("other", "10.0.0.2:1", Kind::Reset);
        f.record("svc", "10.0.0.1:0", Kind::Reset);
        assert_eq!(f.len(), MAX_ENDPOINTS);
        let batch = f.flush(0).expect("a batch");
        assert_eq!(batch.dropped, 2);
        assert_eq!(batch.endpoints, MAX_ENDPOINTS);
        assert_eq!(
            body(&batch)["reports"][0]["reset"],
            1,
            "known ones still count"
        );

        // Only drops: still worth a flush, which frees the idle endpoints.
        f.record("svc", "10.0.0.3:1", Kind::Ok);
        let batch = f.flush(INTERVAL_MS).expect("due");
        assert_eq!((batch.body, batch.endpoints, batch.dropped), (None, 0, 1));
        assert!(f.is_empty());
        f.record("svc", "10.0.0.3:1", Kind::Ok);
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn verdicts_blame_an_instance_only_when_there_is_one() {
        use UpstreamFailure::*;
        assert_eq!(Kind::of_verdict(Verdict::Answered), Some(Kind::Ok));
        assert_eq!(Kind::of_verdict(Verdict::ClientError), Some(Kind::Ok));
        assert_eq!(Kind::of_verdict(Verdict::Overloaded), None);
        let failed = |w| Kind::of_verdict(Verdict::Failed(w));
        assert_eq!(failed(NoHealthyUpstream), None);
        assert_eq!(failed(ConnectFailure), Some(Kind::ConnectFailure));
        assert_eq!(failed(Reset), Some(Kind::Reset));
        assert_eq!(failed(Timeout), Some(Kind::Timeout));
        assert_eq!(failed(Http5xx(502)), Some(Kind::Http5xx));
    }

    #[test]
    fn delivery_problems_are_news_once_per_change() {
        let mut d = Delivery::new();
        assert!(d.dispatched(false), "first refusal");
        assert!(!d.dispatched(false), "not per tick");
        assert!(!d.dispatched(true));
        assert!(d.dispatched(false), "a new run");

        assert_eq!(d.answered(Answer::of_status(Some(204))), None);
        assert_eq!(
            d.answered(Answer::of_status(Some(503))),
            Some(Answer::Rejected(503))
        );
        assert_eq!(d.answered(Answer::of_status(Some(503))), None);
        assert_eq!(
            d.answered(Answer::of_status(Some(404))),
            Some(Answer::Rejected(404))
        );
        assert_eq!(d.answered(Answer::of_status(None)), Some(Answer::NoAnswer));
        assert_eq!(
            d.answered(Answer::of_status(Some(200))),
            Some(Answer::Accepted),
            "recovery is news"
        );
        assert_eq!(d.answered(Answer::Accepted), None);

        let mut d = Delivery::new();
        assert_eq!(d.answered(Answer::NoAnswer), Some(Answer::NoAnswer));
    }
}
