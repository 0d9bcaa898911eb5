//! The invariants, judged from the records once the run is over.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

use serde_json::{json, Value};

use crate::agents::{Call, Outcome};
use crate::observe::{EnvoyPoll, Records};

/// Envoy applies an update on its main thread, then on each worker: a call routed in between
/// is sent slightly after the main thread's view (what the admin API shows) changed.
pub const WORKER_LAG_MS: f64 = 50.0;
/// Endpoints equal etcd's this soon after the last change (the bound).
pub const CONVERGENCE_MS: f64 = 1000.0;
/// A removal Envoy has not applied this long after the delete, it never applies: the longest
/// partition (5 s) plus toolgate-xds's reconnect backoff (at most 5 s), with room. Only a key
/// back in etcd sooner excuses an address Envoy never dropped.
pub const REMOVAL_DEADLINE_MS: f64 = 15_000.0;

pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

pub struct Verdict {
    pub checks: Vec<Check>,
    pub json: Value,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
}

/// A delete of an instance's key, and when Envoy stopped listing its address.
struct Removal<'a> {
    instance: &'a str,
    address: &'a str,
    deleted_ms: f64,
    /// The first poll after the delete without the address; `None` if Envoy listed it until
    /// the key came back (`until_ms`) or the run ended.
    applied_ms: Option<f64>,
    /// When the key came back; infinite if it never did.
    until_ms: f64,
}

/// What became of a removal in Envoy.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    /// Envoy dropped the address at this poll.
    Applied(f64),
    /// The key came back within [`REMOVAL_DEADLINE_MS`], before Envoy dropped the address:
    /// etcd's state was restored before Envoy had to act on it.
    Undone,
    /// Envoy kept routing to an address etcd had removed: until the end of the run, or until
    /// the key came back later than the deadline.
    NeverApplied,
}

impl Removal<'_> {
    fn fate(&self) -> Fate {
        match self.applied_ms {
            Some(at) => Fate::Applied(at),
            None if self.until_ms - self.deleted_ms <= REMOVAL_DEADLINE_MS => Fate::Undone,
            None => Fate::NeverApplied,
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn removals<'a>(records: &'a Records) -> Vec<Removal<'a>> {
    let mut events: HashMap<&str, Vec<(f64, Option<&str>)>> = HashMap::new();
    for e in &records.etcd {
        events
            .entry(e.instance.as_str())
            .or_default()
            .push((e.ms, e.endpoint.as_deref()));
    }
    let mut out = Vec::new();
    for (instance, evs) in &events {
        let Some(address) = evs.iter().find_map(|(_, ep)| *ep) else {
            continue;
        };
        for (i, (deleted_ms, ep)) in evs.iter().enumerate() {
            if ep.is_some() {
                continue;
            }
            let until_ms = evs[i + 1..]
                .iter()
                .find(|(_, ep)| ep.is_some())
                .map_or(f64::INFINITY, |(t, _)| *t);
            let from = records.envoy.partition_point(|p| p.ms < *deleted_ms);
            let applied_ms = records.envoy[from..]
                .iter()
                .take_while(|p| p.ms < until_ms)
                .find(|p| !p.addresses.contains(address))
                .map(|p| p.ms);
            out.push(Removal {
                instance,
                address,
                deleted_ms: *deleted_ms,
                applied_ms,
                until_ms,
            });
        }
    }
    out.sort_by(|a, b| a.deleted_ms.total_cmp(&b.deleted_ms));
    out
}

fn no_call_after_removal(calls: &[Call], removals: &[Removal]) -> (Check, Value) {
    let mut by_instance: HashMap<&str, Vec<&Removal>> = HashMap::new();
    for r in removals {
        by_instance.entry(r.instance).or_default().push(r);
    }
    let mut late = Vec::new();
    let mut in_flight = 0u64;
    let mut to_unapplied = 0u64;
    for c in calls {
        let Outcome::Answered { instance } = &c.outcome else {
            continue;
        };
        for r in by_instance.get(instance.as_str()).into_iter().flatten() {
            if c.sent_ms <= r.deleted_ms || c.sent_ms >= r.until_ms {
                continue;
            }
            match r.fate() {
                Fate::Applied(applied) if c.sent_ms > applied + WORKER_LAG_MS => {
                    late.push((c, Some(applied)))
                }
                Fate::Applied(_) | Fate::Undone => in_flight += 1,
                // No moment at which Envoy caught up: nothing makes such a call in flight.
                Fate::NeverApplied => {
                    to_unapplied += 1;
                    late.push((c, None));
                }
            }
        }
    }
    let never: Vec<&Removal> = removals
        .iter()
        .filter(|r| r.fate() == Fate::NeverApplied)
        .collect();
    let undone = removals.iter().filter(|r| r.fate() == Fate::Undone).count();
    let mut lags: Vec<f64> = removals
        .iter()
        .filter_map(|r| r.applied_ms.map(|a| a - r.deleted_ms))
        .collect();
    lags.sort_by(f64::total_cmp);
    let mut detail = format!(
        "{} removals from etcd; Envoy applied them p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms after the delete \
         (100 ms polls); {undone} undone in etcd within {:.0} s before Envoy applied them; {} never applied; \
         {} calls reached an instance after its delete but before Envoy applied it",
        removals.len(),
        percentile(&lags, 0.5),
        percentile(&lags, 0.99),
        lags.last().copied().unwrap_or(f64::NAN),
        REMOVAL_DEADLINE_MS / 1000.0,
        never.len(),
        in_flight
    );
    for r in never.iter().take(5) {
        let until = if r.until_ms.is_finite() {
            format!("until its key came back at {:.0} ms", r.until_ms)
        } else {
            "to the end of the run".to_string()
        };
        let _ = write!(
            detail,
            "\n    {} ({}) deleted at {:.0} ms was never applied: Envoy listed it {until}",
            r.instance, r.address, r.deleted_ms
        );
    }
    for (c, applied) in late.iter().take(5) {
        let Outcome::Answered { instance } = &c.outcome else {
            continue;
        };
        let removed = match applied {
            Some(at) => format!("removed from Envoy at {at:.0} ms"),
            None => "whose removal Envoy never applied".to_string(),
        };
        let _ = write!(
            detail,
            "\n    call sent at {:.0} ms (agent {}, {}) was answered by {instance}, {removed}",
            c.sent_ms, c.agent, c.tool
        );
    }
    let json = json!({
        "removals": removals.len(),
        "applied_ms": {"p50": percentile(&lags, 0.5), "p99": percentile(&lags, 0.99), "max": lags.last()},
        "undone_before_applied": undone,
        "never_applied": never.len(),
        "calls_before_applied": in_flight,
        "calls_after_applied": late.len() as u64 - to_unapplied,
        "calls_to_never_applied": to_unapplied,
    });
    (
        Check {
            name: "every removal reached Envoy, and no call reached an instance after that",
            passed: late.is_empty() && never.is_empty(),
            detail,
        },
        json,
    )
}

fn only_semantic_failures(calls: &[Call]) -> (Check, Value) {
    let mut answered = 0u64;
    let mut semantic: BTreeMap<String, u64> = BTreeMap::new();
    let mut bad = Vec::new();
    for c in calls {
        match &c.outcome {
            Outcome::Answered { .. } | Outcome::Listed => answered += 1,
            Outcome::Semantic { kind } => *semantic.entry(kind.clone()).or_default() += 1,
            Outcome::Bare { .. } | Outcome::Transport { .. } => bad.push(c),
        }
    }
    let mut detail = format!(
        "{} calls: {answered} answered by a tool, {} failed with an MCP reply {:?}, {} bare HTTP errors or transport errors",
        calls.len(),
        semantic.values().sum::<u64>(),
        semantic,
        bad.len()
    );
    for c in bad.iter().take(5) {
        let _ = write!(
            detail,
            "\n    call sent at {:.0} ms (agent {}, {}, {:.0} ms): {}",
            c.sent_ms, c.agent, c.tool, c.took_ms, c.outcome
        );
    }
    let json = json!({
        "calls": calls.len(),
        "answered": answered,
        "semantic_failures": semantic,
        "bare_or_transport": bad.len(),
    });
    (
        Check {
            name: "every failure an agent saw was an MCP reply",
            passed: bad.is_empty() && !calls.is_empty(),
            detail,
        },
        json,
    )
}

/// What agents of the aggregate endpoint saw: every answer MCP (a result, or a JSON-RPC
/// response saying what failed), through toolgate-xds's SIGKILL and a server's restart in
/// place; and how many of them came while no toolgate-xds was running (`xds_down`, from..to ms).
fn aggregate_answers_mcp(calls: &[Call], xds_down: &[(f64, f64)]) -> (Check, Value) {
    let on_mcp: Vec<&Call> = calls.iter().filter(|c| c.aggregate).collect();
    let bad: Vec<&&Call> = on_mcp
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Bare { .. } | Outcome::Transport { .. }))
        .collect();
    let during = |c: &&Call| {
        xds_down
            .iter()
            .any(|(a, b)| c.sent_ms >= *a && c.sent_ms < *b)
    };
    let offline = on_mcp.iter().filter(|c| during(c)).count();
    let offline_answered = on_mcp
        .iter()
        .filter(|c| during(c) && matches!(c.outcome, Outcome::Answered { .. } | Outcome::Listed))
        .count();
    let desk: Vec<&&Call> = on_mcp.iter().filter(|c| c.tool == "desk__echo").collect();
    let desk_answered = desk
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Answered { .. }))
        .count();
    let mut detail = format!(
        "{} requests on /mcp ({} initialize or tools/list); {} while no toolgate-xds ran, {offline_answered} of them answered; the desk (held sessions, restarted in place): {desk_answered} of {} calls answered; {} not MCP",
        on_mcp.len(),
        on_mcp
            .iter()
            .filter(|c| matches!(c.tool, "initialize" | "tools/list"))
            .count(),
        offline,
        desk.len(),
        bad.len()
    );
    for c in bad.iter().take(5) {
        let _ = write!(
            detail,
            "\n    {} sent at {:.0} ms (agent {}, {:.0} ms): {}",
            c.tool, c.sent_ms, c.agent, c.took_ms, c.outcome
        );
    }
    let json = json!({
        "requests": on_mcp.len(),
        "while_no_xds": offline,
        "answered_while_no_xds": offline_answered,
        "desk_calls": desk.len(),
        "desk_answered": desk_answered,
        "not_mcp": bad.len(),
    });
    (
        Check {
            name: "every answer on /mcp was MCP",
            passed: bad.is_empty() && !on_mcp.is_empty(),
            detail,
        },
        json,
    )
}

/// After the last registration change, the first poll from which Envoy lists exactly etcd's
/// endpoints until the end.
fn converged(records: &Records, want_instances: usize) -> (Check, Value) {
    let mut state: BTreeMap<&str, &str> = BTreeMap::new();
    for e in &records.etcd {
        match &e.endpoint {
            Some(ep) => state.insert(&e.instance, ep),
            None => state.remove(e.instance.as_str()),
        };
    }
    let want: BTreeSet<String> = state.values().map(|s| s.to_string()).collect();
    let last_change = records.etcd.last().map_or(0.0, |e| e.ms);
    let after: Vec<&EnvoyPoll> = records
        .envoy
        .iter()
        .filter(|p| p.ms >= last_change)
        .collect();
    // The earliest poll such that it and every later one equal etcd's set.
    let stable_from = after
        .iter()
        .rposition(|p| *p.addresses != want)
        .map_or(0, |i| i + 1);
    let first_equal = after.get(stable_from).map(|p| p.ms);
    let observed_for = after.last().map_or(0.0, |p| p.ms) - first_equal.unwrap_or(f64::INFINITY);
    let lag = first_equal.map(|t| t - last_change);
    let passed = want.len() == want_instances
        && lag.is_some_and(|l| l <= CONVERGENCE_MS)
        && observed_for >= 2000.0;
    let detail = match lag {
        Some(l) => format!(
            "etcd holds {} endpoints (want {want_instances}); Envoy listed exactly them {l:.0} ms after the last change \
             (bound {CONVERGENCE_MS:.0} ms) and kept them for the last {:.1} s",
            want.len(),
            observed_for / 1000.0
        ),
        None => format!(
            "etcd holds {} endpoints (want {want_instances}); Envoy never listed exactly them after the last change; \
             its last poll: {:?}",
            want.len(),
            records.envoy.last().map(|p| p.addresses.clone())
        ),
    };
    (
        Check {
            name: "after the last fault, Envoy's endpoints equal etcd's within 1 s",
            passed,
            detail,
        },
        json!({"endpoints": want.len(), "lag_ms": lag, "stable_for_ms": observed_for}),
    )
}

/// The newest toolgate-xds process's resident memory, after a warm-up: the last third of its
/// life may not be well above the first third.
fn bounded_memory(records: &Records, warmup_ms: f64) -> (Check, Value) {
    let generation = records.rss.iter().map(|s| s.generation).max().unwrap_or(0);
    let samples: Vec<_> = records
        .rss
        .iter()
        .filter(|s| s.generation == generation)
        .collect();
    let start = samples.first().map_or(0.0, |s| s.ms) + warmup_ms;
    let kept: Vec<u64> = samples
        .iter()
        .filter(|s| s.ms >= start)
        .map(|s| s.kib)
        .collect();
    let third = kept.len() / 3;
    let early = kept[..third].iter().max().copied().unwrap_or(0);
    let late = kept[kept.len() - third..]
        .iter()
        .max()
        .copied()
        .unwrap_or(0);
    let peak = kept.iter().max().copied().unwrap_or(0);
    let limit = early + early / 2 + 8 * 1024;
    let passed = third >= 3 && late <= limit;
    (
        Check {
            name: "toolgate-xds memory did not grow without bound",
            passed,
            detail: format!(
                "process {generation} (after {} restart(s)), {} samples after a {:.0} s warm-up: max {:.1} MiB in the first third, \
                 {:.1} MiB in the last (limit 1.5 x + 8 MiB = {:.1} MiB), peak {:.1} MiB",
                generation,
                kept.len(),
                warmup_ms / 1000.0,
                early as f64 / 1024.0,
                late as f64 / 1024.0,
                limit as f64 / 1024.0,
                peak as f64 / 1024.0
            ),
        },
        json!({"early_max_kib": early, "late_max_kib": late, "peak_kib": peak, "samples": kept.len()}),
    )
}

pub fn judge(
    calls: &[Call],
    xds_down: &[(f64, f64)],
    records: &Records,
    want_instances: usize,
    warmup_ms: f64,
    faults: &BTreeMap<String, u32>,
    notes: &[String],
) -> Verdict {
    let removals = removals(records);
    let (c1, j1) = no_call_after_removal(calls, &removals);
    let (c2, j2) = only_semantic_failures(calls);
    let (c3, j3) = converged(records, want_instances);
    let (c4, j4) = bounded_memory(records, warmup_ms);
    let (c5, j5) = aggregate_answers_mcp(calls, xds_down);
    let checks: Vec<Value> = [&c1, &c2, &c3, &c4, &c5]
        .iter()
        .map(|c| json!({"check": c.name, "passed": c.passed, "detail": c.detail}))
        .collect();
    let json = json!({
        "faults": faults,
        "notes": notes,
        "removals": j1,
        "calls": j2,
        "convergence": j3,
        "xds_memory": j4,
        "aggregate": j5,
        "watch_breaks_of_the_run": records.watch_breaks,
        "checks": checks,
    });
    Verdict {
        checks: vec![c1, c2, c3, c4, c5],
        json,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::KeyEvent;
    use std::sync::Arc;

    const A: &str = "10.0.0.1:9000";
    const B: &str = "10.0.0.2:9000";

    fn put(ms: f64, instance: &str, endpoint: &str) -> KeyEvent {
        KeyEvent {
            ms,
            instance: instance.into(),
            endpoint: Some(endpoint.into()),
        }
    }

    fn delete(ms: f64, instance: &str) -> KeyEvent {
        KeyEvent {
            ms,
            instance: instance.into(),
            endpoint: None,
        }
    }

    /// Envoy polled every 100 ms from 0 to `until_ms`; `listed(ms)` says what it listed.
    fn polls(until_ms: f64, listed: impl Fn(f64) -> Vec<&'static str>) -> Vec<EnvoyPoll> {
        (0..=(until_ms / 100.0) as usize)
            .map(|i| {
                let ms = i as f64 * 100.0;
                EnvoyPoll {
                    ms,
                    addresses: Arc::new(listed(ms).into_iter().map(String::from).collect()),
                }
            })
            .collect()
    }

    fn answered(sent_ms: f64, instance: &str) -> Call {
        Call {
            sent_ms,
            took_ms: 5.0,
            agent: 0,
            tool: "echo",
            aggregate: false,
            outcome: Outcome::Answered {
                instance: instance.into(),
            },
        }
    }

    fn check(records: &Records, calls: &[Call]) -> Check {
        no_call_after_removal(calls, &removals(records)).0
    }

    #[test]
    fn a_removal_envoy_never_applies_fails_the_run() {
        // `a` is deleted at 1 s and never comes back; Envoy lists it to the end (20 s), and a
        // call sent at 5 s is answered by it.
        let records = Records {
            etcd: vec![put(0.0, "a", A), put(0.0, "b", B), delete(1000.0, "a")],
            envoy: polls(20_000.0, |_| vec![A, B]),
            ..Default::default()
        };
        let c = check(&records, &[answered(5000.0, "a"), answered(5000.0, "b")]);
        println!("{}", c.detail);
        assert!(
            !c.passed,
            "a removal Envoy never applied passed: {}",
            c.detail
        );
        assert!(c.detail.contains("never applied"), "{}", c.detail);
    }

    #[test]
    fn a_removal_undone_in_etcd_before_the_deadline_is_no_violation() {
        // `a` is deleted at 1 s and registered again at 1.05 s, between two polls.
        let records = Records {
            etcd: vec![put(0.0, "a", A), delete(1000.0, "a"), put(1050.0, "a", A)],
            envoy: polls(20_000.0, |_| vec![A]),
            ..Default::default()
        };
        let c = check(&records, &[answered(1020.0, "a"), answered(5000.0, "a")]);
        assert!(c.passed, "{}", c.detail);
    }

    #[test]
    fn a_removal_undone_only_after_the_deadline_still_fails() {
        // `a` is away in etcd for 30 s, and Envoy never stops listing it.
        let records = Records {
            etcd: vec![put(0.0, "a", A), delete(1000.0, "a"), put(31_000.0, "a", A)],
            envoy: polls(40_000.0, |_| vec![A]),
            ..Default::default()
        };
        let c = check(&records, &[]);
        assert!(!c.passed, "{}", c.detail);
    }

    #[test]
    fn calls_before_envoy_applied_a_removal_are_in_flight_and_after_it_violations() {
        // Envoy drops `a` from the poll at 1.2 s.
        let records = Records {
            etcd: vec![put(0.0, "a", A), put(0.0, "b", B), delete(1000.0, "a")],
            envoy: polls(
                10_000.0,
                |ms| if ms < 1200.0 { vec![A, B] } else { vec![B] },
            ),
            ..Default::default()
        };
        let ok = check(&records, &[answered(1100.0, "a"), answered(1240.0, "a")]);
        assert!(ok.passed, "{}", ok.detail);
        assert!(ok.detail.contains("2 calls reached"), "{}", ok.detail);
        let late = check(&records, &[answered(1300.0, "a")]);
        assert!(!late.passed, "{}", late.detail);
    }
}
