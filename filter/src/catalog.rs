//! Which services and tools the gateway keeps breakers for.
//!
//! Breaker records live in proxy-wasm shared data, which Envoy never frees, and stats are never
//! freed either: if a request could create them by naming a service or a tool, one client could
//! grow every Envoy's memory without bound. So only what the registry knows gets state. The
//! filter configuration carries the catalog (toolgate-xds fills it from the registrations):
//! every service with instances, and the tools its registrations list.
//!
//! - A service not in the catalog has no route either (or is about to get one): its calls are
//!   checked against overrides only, and nothing is created for them.
//! - A service whose registrations list tools: a call of another tool passes to the server,
//!   which answers for itself (most answer an unknown tool with an error result); it gets no
//!   breaker and no stats of its own, and is counted.
//! - A service whose registrations list no tools: a tool gets a breaker once its server has
//!   answered a call of it as a tool (not with a JSON-RPC error that blames the request, such
//!   as `-32602` for an unknown tool), at most [`MAX_UNLISTED_TOOLS`] per service, shared by
//!   all workers. Until then, and past the bound, its calls pass unjudged. A name nobody has
//!   called for [`UNLISTED_IDLE_MS`] makes room for a new one; a name still in use is never
//!   pushed out, so made-up names cannot switch a service's breakers off.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::breaker::{SharedStore, CREATE_CAS};

/// Tools with breakers of their own in a service whose registrations list none.
pub const MAX_UNLISTED_TOOLS: usize = 64;
/// A name of an unlisted service not called for this long may give its place to a new one.
pub const UNLISTED_IDLE_MS: u64 = 10 * 60 * 1000;
/// How stale this worker lets a name's last use in shared data get before writing it again:
/// one write per name per interval, not one per call.
const TOUCH_EVERY_MS: u64 = 60 * 1000;
/// Attempts at changing a service's shared list before giving up for this call.
const CAS_ATTEMPTS: usize = 4;

/// What the catalog says about one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    UnknownService,
    Listed,
    NotListed,
    Unlisted,
}

/// Looks up a tool of a service in the catalog.
pub fn lookup(catalog: &BTreeMap<String, BTreeSet<String>>, service: &str, tool: &str) -> Known {
    match catalog.get(service) {
        None => Known::UnknownService,
        Some(tools) if tools.is_empty() => Known::Unlisted,
        Some(tools) if tools.contains(tool) => Known::Listed,
        Some(_) => Known::NotListed,
    }
}

/// The shared-data key listing the tools of an unlisted service that have records.
pub fn unlisted_key(service: &str) -> String {
    format!("tg/u/{service}")
}

/// A service's shared list: each name and when it was last used (Unix ms), one per line.
fn parse(bytes: &[u8]) -> Vec<(String, u64)> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter(|l| !l.is_empty())
        .map(|line| match line.split_once(' ') {
            Some((name, at)) => (name.to_string(), at.parse().unwrap_or(0)),
            // A list written before names carried their last use.
            None => (line.to_string(), 0),
        })
        .collect()
}

fn render(names: &[(String, u64)]) -> String {
    names.iter().map(|(n, at)| format!("{n} {at}\n")).collect()
}

/// One worker's view of the unlisted tools that have records, per service: each name, and
/// when this worker last wrote its use.
#[derive(Default)]
pub struct Unlisted {
    seen: HashMap<String, HashMap<String, u64>>,
}

impl Unlisted {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `tool` of the unlisted `service` has a breaker (its server answered it as a
    /// tool before). Records its use, now and then, so that it is not taken for idle.
    pub fn admits<S: SharedStore>(
        &mut self,
        store: &S,
        service: &str,
        tool: &str,
        now_ms: u64,
    ) -> bool {
        if let Some(&written) = self.seen.get(service).and_then(|s| s.get(tool)) {
            if now_ms.saturating_sub(written) < TOUCH_EVERY_MS {
                return true;
            }
        }
        self.update(store, service, tool, now_ms, false)
    }

    /// The server answered a call of `tool` as a tool: it gets a breaker if there is room,
    /// or a name idle for [`UNLISTED_IDLE_MS`] to take the place of. `false`: the list is
    /// full of names in use, or the host failed.
    pub fn learn<S: SharedStore>(
        &mut self,
        store: &S,
        service: &str,
        tool: &str,
        now_ms: u64,
    ) -> bool {
        self.update(store, service, tool, now_ms, true)
    }

    /// Marks `tool` used now in the shared list; adds it only when `add`.
    fn update<S: SharedStore>(
        &mut self,
        store: &S,
        service: &str,
        tool: &str,
        now_ms: u64,
        add: bool,
    ) -> bool {
        let key = unlisted_key(service);
        for _ in 0..CAS_ATTEMPTS {
            let Ok(record) = store.get(&key) else {
                return false;
            };
            let (mut names, cas) = match &record {
                Some((bytes, cas)) => (parse(bytes), *cas),
                None => (Vec::new(), CREATE_CAS),
            };
            match names.iter().position(|(n, _)| n == tool) {
                Some(i) => names[i].1 = now_ms,
                None if !add => {
                    self.forget(service, tool);
                    return false;
                }
                None if names.len() < MAX_UNLISTED_TOOLS => names.push((tool.to_string(), now_ms)),
                None => {
                    let idle = names
                        .iter()
                        .enumerate()
                        .filter(|(_, (_, at))| now_ms.saturating_sub(*at) >= UNLISTED_IDLE_MS)
                        .min_by_key(|(_, (_, at))| *at)
                        .map(|(i, _)| i);
                    let Some(i) = idle else {
                        return false;
                    };
                    let (gone, _) = names.remove(i);
                    self.forget(service, &gone);
                    names.push((tool.to_string(), now_ms));
                }
            }
            if store
                .set(&key, render(&names).as_bytes(), Some(cas))
                .is_ok()
            {
                self.seen
                    .entry(service.to_string())
                    .or_default()
                    .insert(tool.to_string(), now_ms);
                return true;
            }
        }
        false
    }

    fn forget(&mut self, service: &str, tool: &str) {
        if let Some(s) = self.seen.get_mut(service) {
            s.remove(tool);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::MemStore;

    fn catalog() -> BTreeMap<String, BTreeSet<String>> {
        BTreeMap::from([
            (
                "orders".to_string(),
                BTreeSet::from(["read_order".to_string(), "write_order".to_string()]),
            ),
            ("bare".to_string(), BTreeSet::new()),
        ])
    }

    #[test]
    fn the_catalog_decides_what_is_judged() {
        let c = catalog();
        assert_eq!(lookup(&c, "orders", "write_order"), Known::Listed);
        assert_eq!(lookup(&c, "orders", "WRITE_ORDER"), Known::NotListed);
        assert_eq!(lookup(&c, "orders", "drop_tables"), Known::NotListed);
        assert_eq!(lookup(&c, "bare", "anything"), Known::Unlisted);
        assert_eq!(lookup(&c, "ghost", "write_order"), Known::UnknownService);
    }

    #[test]
    fn unlisted_tools_get_records_once_answered_up_to_the_bound_shared_by_workers() {
        let store = MemStore::new();
        let (mut a, mut b) = (Unlisted::new(), Unlisted::new());
        // Called but never answered as a tool: no record.
        assert!(!a.admits(&store, "bare", "made_up", 1));
        for i in 0..MAX_UNLISTED_TOOLS {
            let w = if i % 2 == 0 { &mut a } else { &mut b };
            assert!(w.learn(&store, "bare", &format!("t{i}"), 1), "t{i}");
        }
        assert!(!a.learn(&store, "bare", "one_too_many", 2));
        assert!(!b.admits(&store, "bare", "one_too_many", 2));
        // Names that have a record keep it, on every worker.
        assert!(b.admits(&store, "bare", "t0", 2));
        assert!(a.admits(&store, "bare", "t1", 2));
        // Another service has its own room.
        assert!(a.learn(&store, "other", "t0", 2));
    }

    #[test]
    fn only_an_idle_name_makes_room_and_names_in_use_stay() {
        let store = MemStore::new();
        let mut w = Unlisted::new();
        for i in 0..MAX_UNLISTED_TOOLS {
            assert!(w.learn(&store, "bare", &format!("t{i}"), 0));
        }
        let later = UNLISTED_IDLE_MS + 5;
        // Every name but t0 stays in use.
        for i in 1..MAX_UNLISTED_TOOLS {
            assert!(w.admits(&store, "bare", &format!("t{i}"), later - 1));
        }
        assert!(
            w.learn(&store, "bare", "failing_tool", later),
            "t0 was idle"
        );
        assert!(!w.admits(&store, "bare", "t0", later));
        assert!(
            !w.learn(&store, "bare", "another", later),
            "no idle name left"
        );
        assert!(w.admits(&store, "bare", "failing_tool", later));
    }

    #[test]
    fn a_list_written_before_names_carried_their_use_still_reads() {
        let store = MemStore::new();
        store
            .set(&unlisted_key("bare"), b"a\nb", Some(CREATE_CAS))
            .expect("set");
        let mut w = Unlisted::new();
        assert!(w.admits(&store, "bare", "a", 5));
        assert!(!w.admits(&store, "bare", "c", 5));
    }

    #[test]
    fn a_host_error_admits_nothing_new() {
        let store = MemStore::new();
        let mut a = Unlisted::new();
        store.fail_next_gets(1);
        assert!(!a.learn(&store, "bare", "x", 1));
        assert!(a.learn(&store, "bare", "x", 1));
    }
}
