//! Who is limited most: the refusals of call limits the filters report with their call
//! feedback, by (service, tool, rule, caller), for `GET /v1/limits`, the console and
//! `toolgate-xds status`. Not a metric: a series per caller would be unbounded. Bounded here
//! too: at most [`MAX_TRACKED`] entries, those not refused for [`WINDOW`] forgotten first,
//! then the least refused.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Entries kept; a report naming more new callers replaces the least refused.
pub const MAX_TRACKED: usize = 10_000;
/// An entry not refused for this long is forgotten.
pub const WINDOW: Duration = Duration::from_secs(600);
/// The longest name accepted in a report (service, tool, rule or caller).
const MAX_NAME: usize = 512;

/// One line of a filter's report.
#[derive(Debug, Clone, Deserialize)]
pub struct LimitedReport {
    pub service: String,
    pub tool: String,
    pub rule: String,
    /// `subject:<sub>`, `client:<address>` or `gateway`.
    pub caller: String,
    pub count: u64,
}

/// One caller as shown, most refused first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopLimited {
    pub service: String,
    pub tool: String,
    pub rule: String,
    pub caller: String,
    /// Requests refused since it was first seen (within the window).
    pub refused: u64,
    /// How long ago the last refusal was reported.
    pub last_ago_secs: u64,
}

type Key = (String, String, String, String);

#[derive(Debug, Default)]
pub struct Limited {
    entries: Mutex<HashMap<Key, (u64, Instant)>>,
}

impl Limited {
    /// Adds a filter's report; lines with names too long are ignored (a report token holder
    /// could otherwise make them as large as a request).
    pub fn record(&self, reports: &[LimitedReport], now: Instant) {
        if reports.is_empty() {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        for r in reports {
            if [&r.service, &r.tool, &r.rule, &r.caller]
                .iter()
                .any(|s| s.len() > MAX_NAME)
                || r.count == 0
            {
                continue;
            }
            let key = (
                r.service.clone(),
                r.tool.clone(),
                r.rule.clone(),
                r.caller.clone(),
            );
            if !entries.contains_key(&key) && entries.len() >= MAX_TRACKED {
                make_room(&mut entries, now);
            }
            let e = entries.entry(key).or_insert((0, now));
            e.0 = e.0.saturating_add(r.count);
            e.1 = now;
        }
    }

    /// The `n` callers refused most within the window.
    pub fn top(&self, n: usize, now: Instant) -> Vec<TopLimited> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let mut top: Vec<TopLimited> = entries
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) <= WINDOW)
            .map(
                |((service, tool, rule, caller), (refused, at))| TopLimited {
                    service: service.clone(),
                    tool: tool.clone(),
                    rule: rule.clone(),
                    caller: caller.clone(),
                    refused: *refused,
                    last_ago_secs: now.saturating_duration_since(*at).as_secs(),
                },
            )
            .collect();
        top.sort_by(|a, b| {
            b.refused
                .cmp(&a.refused)
                .then_with(|| a.last_ago_secs.cmp(&b.last_ago_secs))
                .then_with(|| a.caller.cmp(&b.caller))
        });
        top.truncate(n);
        top
    }
}

/// Forgets what is past the window, or else the tenth least refused.
fn make_room(entries: &mut HashMap<Key, (u64, Instant)>, now: Instant) {
    entries.retain(|_, (_, at)| now.saturating_duration_since(*at) <= WINDOW);
    if entries.len() < MAX_TRACKED {
        return;
    }
    let mut counts: Vec<u64> = entries.values().map(|(n, _)| *n).collect();
    let cut = counts.len() / 10;
    let (_, threshold, _) = counts.select_nth_unstable(cut);
    let threshold = *threshold;
    let mut dropped = 0;
    entries.retain(|_, (n, _)| {
        let drop = *n <= threshold && dropped <= cut;
        dropped += usize::from(drop);
        !drop
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(caller: &str, count: u64) -> LimitedReport {
        LimitedReport {
            service: "orders".into(),
            tool: "*".into(),
            rule: "reads".into(),
            caller: caller.into(),
            count,
        }
    }

    #[test]
    fn the_most_refused_callers_come_first_and_old_ones_go() {
        let l = Limited::default();
        let t0 = Instant::now();
        l.record(&[report("subject:alice", 3), report("subject:bob", 1)], t0);
        l.record(&[report("subject:bob", 5)], t0 + Duration::from_secs(1));
        let top = l.top(10, t0 + Duration::from_secs(2));
        assert_eq!(top[0].caller, "subject:bob");
        assert_eq!(top[0].refused, 6);
        assert_eq!(top[1].caller, "subject:alice");
        assert_eq!(top[1].last_ago_secs, 2);
        assert!(l.top(10, t0 + WINDOW + Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn the_table_stays_bounded_and_keeps_the_most_refused() {
        let l = Limited::default();
        let t0 = Instant::now();
        l.record(&[report("subject:heavy", 1000)], t0);
        let flood: Vec<LimitedReport> = (0..MAX_TRACKED + 500)
            .map(|i| report(&format!("subject:s{i}"), 1))
            .collect();
        l.record(&flood, t0);
        assert!(l.entries.lock().map(|e| e.len()).unwrap_or(0) <= MAX_TRACKED);
        assert_eq!(l.top(1, t0)[0].caller, "subject:heavy");
        l.record(&[report(&"x".repeat(MAX_NAME + 1), 1)], t0);
        assert!(l
            .top(MAX_TRACKED, t0)
            .iter()
            .all(|t| t.caller.len() <= MAX_NAME));
    }
}
