//! Call-failure feedback: what the filters saw happen to real calls, per upstream instance,
//! posted to `/v1/feedback` a few times a second by every Envoy worker.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::machine::CallCounts;
use super::Hub;
use crate::metrics::RoutingErrorLabel;

#[derive(Debug, Deserialize)]
pub struct FeedbackBody {
    pub reports: Vec<Report>,
    /// Requests call limits refused since the worker's last report, by caller.
    #[serde(default)]
    pub limited: Vec<crate::limited::LimitedReport>,
}

#[derive(Debug, Deserialize)]
pub struct Report {
    pub service: String,
    /// The upstream address Envoy used (`ip:port`).
    pub address: String,
    #[serde(flatten)]
    pub counts: CallCounts,
}

#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct FeedbackOutcome {
    pub applied: usize,
    /// Reports for addresses no registered instance of the service has (it just left).
    pub unknown: usize,
    /// Reports whose address does not parse, with the offending value.
    pub invalid: Vec<String>,
}

pub fn apply(hub: &Hub, body: FeedbackBody) -> FeedbackOutcome {
    let mut out = FeedbackOutcome::default();
    for report in body.reports {
        let Ok(addr) = report.address.parse::<SocketAddr>() else {
            out.invalid.push(report.address);
            continue;
        };
        let c = report.counts;
        let key = {
            let reg = hub.registry.read().unwrap_or_else(|p| p.into_inner());
            reg.find_by_addr(&report.service, addr).cloned()
        };
        let Some(key) = key else {
            hub.metrics.feedback_unknown.inc();
            out.unknown += 1;
            continue;
        };
        // Counted only for registered instances: a service label comes from the registry,
        // never from whatever a report names.
        for (kind, n) in [
            ("connect_failure", c.connect_failure),
            ("reset", c.reset),
            ("timeout", c.timeout),
            ("http_5xx", c.http_5xx),
        ] {
            if n > 0 {
                hub.metrics
                    .routing_errors
                    .get_or_create(&RoutingErrorLabel {
                        service: key.service.clone(),
                        kind,
                    })
                    .inc_by(n);
            }
        }
        let applied = hub.update(&key, |h, now, cfg| (h.on_calls(&c, now, cfg), ()));
        if applied.is_none() {
            out.unknown += 1;
            continue;
        }
        out.applied += 1;
        // A failed connect or a reset is strong evidence the process is gone: let a probe
        // confirm it now rather than at the next interval (a refused probe then takes the
        // instance out of rotation at once).
        if c.connect_failure > 0 || c.reset > 0 {
            let reg = hub.registry.read().unwrap_or_else(|p| p.into_inner());
            if let Some(inst) = reg.instance(&key) {
                inst.wake.notify_one();
            }
        }
    }
    out
}
