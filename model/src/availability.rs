//! How a `tools/list` answer tells an agent that a tool will not work right now: a value under
//! `_meta["io.toolgate/availability"]` and a sentence at the end of the description. The
//! aggregate endpoint (toolgate-xds) and the per-service routes (the filter) annotate with
//! this one code, so the two can never say it differently.

use serde_json::{json, Map, Value};

/// The `_meta` key of a tool's availability.
pub const AVAILABILITY_KEY: &str = "io.toolgate/availability";

/// Why a tool cannot work right now.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Unavailable {
    /// Its service has no instance that takes calls.
    NoInstance,
    /// Its breaker is open until then (ms since the epoch).
    Open { until_ms: u64 },
    /// An operator forced it open, saying why.
    ForcedOpen { reason: String },
}

impl Unavailable {
    /// The `state` of the `_meta` value.
    pub fn state(&self) -> &'static str {
        match self {
            Unavailable::NoInstance => "no_instance",
            Unavailable::Open { .. } => "open",
            Unavailable::ForcedOpen { .. } => "forced_open",
        }
    }
}

/// A tool's availability as shown: the reason and, when the policy names one offered where
/// the tool is listed, the fallback's name as the agent sees it there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Availability {
    pub why: Unavailable,
    pub fallback: Option<String>,
}

impl Availability {
    /// `_meta["io.toolgate/availability"]`.
    pub fn meta(&self) -> Value {
        let mut m = Map::new();
        m.insert("state".into(), json!(self.why.state()));
        if let Unavailable::Open { until_ms } = self.why {
            m.insert("until".into(), json!(rfc3339(until_ms)));
        }
        if let Some(f) = &self.fallback {
            m.insert("fallback".into(), json!(f));
        }
        m.insert("reason".into(), json!(self.reason()));
        Value::Object(m)
    }

    /// Why, in words a model can act on.
    pub fn reason(&self) -> String {
        match &self.why {
            Unavailable::NoInstance => "its service has no healthy instance".into(),
            Unavailable::Open { until_ms } => {
                format!("its breaker is open until {}", clock(*until_ms))
            }
            Unavailable::ForcedOpen { reason } => {
                format!("an operator took it out of service: {reason}")
            }
        }
    }

    /// The sentence appended to the tool's description.
    pub fn sentence(&self) -> String {
        match &self.fallback {
            Some(f) => format!("Unavailable now: {}; use {f} instead.", self.reason()),
            None => format!("Unavailable now: {}.", self.reason()),
        }
    }
}

/// Annotates one tool definition (a `tools/list` entry): the sentence after its description
/// (the description if it had none) and the value under `_meta` (a `_meta` that is not an
/// object is replaced). Everything else is left as it is.
pub fn annotate(tool: &mut Map<String, Value>, avail: &Availability) {
    let sentence = avail.sentence();
    let description = match tool.get("description").and_then(Value::as_str) {
        Some(d) if !d.trim().is_empty() => format!("{} {sentence}", d.trim_end()),
        _ => sentence,
    };
    tool.insert("description".into(), json!(description));
    let meta = tool
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    if !meta.is_object() {
        *meta = Value::Object(Map::new());
    }
    if let Some(m) = meta.as_object_mut() {
        m.insert(AVAILABILITY_KEY.into(), avail.meta());
    }
}

/// The latest instant [`rfc3339`] writes: RFC 3339 has four-digit years.
const MAX_MS: u64 = 253_402_300_799_999;

/// `2026-12-02T05:52:36Z`, to the second, UTC. Written here rather than with a time crate: the
/// filter links this crate too, and a deadline from etcd may be any number (later than year
/// 9999 is shown as its last second).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms.min(MAX_MS) / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Year, month, day of a day count since 1970-01-01 (Howard Hinnant's `civil_from_days`,
/// for non-negative days).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// `12:00:05Z`: the time of day is what a model can act on.
fn clock(ms: u64) -> String {
    let full = rfc3339(ms);
    full.split_once('T')
        .map(|(_, t)| t.to_string())
        .unwrap_or(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn forced(fallback: Option<&str>) -> Availability {
        Availability {
            why: Unavailable::ForcedOpen {
                reason: "maintenance".into(),
            },
            fallback: fallback.map(str::to_string),
        }
    }

    #[test]
    fn the_meta_value_says_state_until_fallback_and_reason() {
        let a = Availability {
            why: Unavailable::Open {
                until_ms: 1_764_655_205_000,
            },
            fallback: Some("get_stock_cached".into()),
        };
        assert_eq!(
            a.meta(),
            json!({
                "state": "open",
                "until": "2025-12-02T06:00:05Z",
                "fallback": "get_stock_cached",
                "reason": "its breaker is open until 06:00:05Z"
            })
        );
        assert_eq!(
            a.sentence(),
            "Unavailable now: its breaker is open until 06:00:05Z; use get_stock_cached instead."
        );
        let f = forced(None).meta();
        assert_eq!(f["state"], "forced_open");
        assert!(f.get("until").is_none() && f.get("fallback").is_none());
        assert_eq!(
            f["reason"],
            "an operator took it out of service: maintenance"
        );
    }

    #[test]
    fn annotating_appends_to_the_description_and_keeps_the_rest() {
        let mut tool = json!({
            "name": "get_stock", "description": "Stock of an item.  ",
            "inputSchema": {"type": "object"}, "_meta": {"x": 1}
        });
        let Some(m) = tool.as_object_mut() else {
            panic!("object")
        };
        annotate(m, &forced(Some("get_stock_cached")));
        assert_eq!(
            tool["description"],
            "Stock of an item. Unavailable now: an operator took it out of service: \
             maintenance; use get_stock_cached instead."
        );
        assert_eq!(tool["_meta"]["x"], 1);
        assert_eq!(tool["_meta"][AVAILABILITY_KEY]["state"], "forced_open");
        assert_eq!(tool["inputSchema"], json!({"type": "object"}));
    }

    #[test]
    fn a_tool_without_description_or_with_a_bad_meta_gets_both() {
        for start in [
            json!({"name": "t"}),
            json!({"name": "t", "description": 3, "_meta": []}),
        ] {
            let mut tool = start;
            let Some(m) = tool.as_object_mut() else {
                panic!("object")
            };
            annotate(m, &forced(None));
            assert_eq!(
                tool["description"],
                "Unavailable now: an operator took it out of service: maintenance."
            );
            assert_eq!(
                tool["_meta"],
                json!({AVAILABILITY_KEY: forced(None).meta()})
            );
        }
    }

    #[test]
    fn far_deadlines_are_clamped_not_a_panic() {
        assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
    }

    proptest! {
        #[test]
        fn rfc3339_writes_what_humantime_writes(ms in 0u64..MAX_MS) {
            let want = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms))
                .to_string();
            prop_assert_eq!(rfc3339(ms), want);
        }
    }
}
