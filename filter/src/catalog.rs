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
//! - A service whose registrations list tools: a call of another tool is refused (the
//!   registration is the contract; a server would answer "unknown tool" anyway).
//! - A service whose registrations list no tools: tools get records by name, at most
//!   [`MAX_UNLISTED_TOOLS`] per service, shared by all workers; past that, calls pass unjudged.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::breaker::{SharedStore, CREATE_CAS};

/// Tools with breakers of their own in a service whose registrations list none.
pub const MAX_UNLISTED_TOOLS: usize = 64;
/// Attempts at adding a name to a service's shared list before giving up for this call.
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

/// One worker's view of the unlisted tools that have records, per service.
#[derive(Default)]
pub struct Unlisted {
    seen: HashMap<String, HashSet<String>>,
}

impl Unlisted {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `tool` of the unlisted `service` may have a breaker: it already has one, or
    /// there is room for it (then it is added to the shared list). `false` when the service's
    /// list is full or the host fails: the call then passes unjudged.
    pub fn admit<S: SharedStore>(&mut self, store: &S, service: &str, tool: &str) -> bool {
        if self.seen.get(service).is_some_and(|s| s.contains(tool)) {
            return true;
        }
        let key = unlisted_key(service);
        for _ in 0..CAS_ATTEMPTS {
            let Ok(record) = store.get(&key) else {
                return false;
            };
            let (text, cas) = match &record {
                Some((bytes, cas)) => (String::from_utf8_lossy(bytes).into_owned(), *cas),
                None => (String::new(), CREATE_CAS),
            };
            let names: HashSet<String> = text
                .split('\n')
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            let known = names.contains(tool);
            let full = names.len() >= MAX_UNLISTED_TOOLS;
            if known || full {
                self.seen.insert(service.to_owned(), names);
                return known;
            }
            let mut next = text;
            if !next.is_empty() {
                next.push('\n');
            }
            next.push_str(tool);
            if store.set(&key, next.as_bytes(), Some(cas)).is_ok() {
                let mut names = names;
                names.insert(tool.to_owned());
                self.seen.insert(service.to_owned(), names);
                return true;
            }
        }
        false
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
    fn unlisted_tools_get_records_up_to_the_bound_shared_by_workers() {
        let store = MemStore::new();
        let (mut a, mut b) = (Unlisted::new(), Unlisted::new());
        for i in 0..MAX_UNLISTED_TOOLS {
            let w = if i % 2 == 0 { &mut a } else { &mut b };
            assert!(w.admit(&store, "bare", &format!("t{i}")), "t{i}");
        }
        assert!(!a.admit(&store, "bare", "one_too_many"));
        assert!(!b.admit(&store, "bare", "one_too_many"));
        // Names that have a record keep it, on every worker.
        assert!(b.admit(&store, "bare", "t0"));
        assert!(a.admit(&store, "bare", "t1"));
        // Another service has its own room.
        assert!(a.admit(&store, "other", "t0"));
    }

    #[test]
    fn a_host_error_admits_nothing_new() {
        let store = MemStore::new();
        let mut a = Unlisted::new();
        store.fail_next_gets(1);
        assert!(!a.admit(&store, "bare", "x"));
        assert!(a.admit(&store, "bare", "x"));
    }
}
