//! When each service first registered: the age that decides who keeps a contested name,
//! recorded in etcd so it survives a restart.

use super::*;

#[derive(Debug, Clone, Default)]
pub(super) struct ServiceAges {
    /// Each service's age as its instance keys tell it: the smallest etcd create revision
    /// among its live instance keys. A service whose last instance left keeps its last one
    /// while it stays known. What names a service is its recorded age (below) once there is
    /// one; this until then, and it is what gets recorded.
    pub(super) since_revision: BTreeMap<String, i64>,
    /// Each service's age for naming as the fleet recorded it (`<prefix>service-ages/`, see
    /// `ages.rs`): the older service keeps a contested name, across re-registrations.
    pub(super) recorded: BTreeMap<String, i64>,
    /// Notified when a service may lack a recorded age (`crate::service_ages` writes it).
    pub(super) wanted: Arc<Notify>,
}

impl ServiceAges {
    /// The recorded age, else the one the instance keys tell.
    fn of(&self, service: &str) -> Option<i64> {
        self.recorded
            .get(service)
            .or_else(|| self.since_revision.get(service))
            .copied()
    }
}

impl Registry {
    /// Each known service's age for naming: the one the fleet recorded, else the smallest
    /// etcd create revision among its instance keys (the last one it had, for a service with
    /// none left).
    pub fn service_ages(&self) -> BTreeMap<String, i64> {
        self.ages
            .since_revision
            .keys()
            .chain(self.ages.recorded.keys())
            .filter_map(|s| Some((s.clone(), self.service_age(s)?)))
            .collect()
    }

    /// A service's age for naming (see [`service_ages`](Self::service_ages)).
    pub fn service_age(&self, service: &str) -> Option<i64> {
        self.ages.of(service)
    }

    /// The services with an age from their instance keys that the fleet has not recorded yet,
    /// with that age: what `crate::service_ages` writes.
    pub fn unrecorded_ages(&self) -> Vec<(String, i64)> {
        self.ages
            .since_revision
            .iter()
            .filter(|(s, _)| !self.ages.recorded.contains_key(*s))
            .map(|(s, age)| (s.clone(), *age))
            .collect()
    }

    /// Notified whenever [`unrecorded_ages`](Self::unrecorded_ages) may have changed.
    pub fn ages_wanted(&self) -> Arc<Notify> {
        self.ages.wanted.clone()
    }

    /// `<prefix>service-ages/<service>`: the age the fleet recorded for a service. Whether
    /// its age for naming changed.
    pub(super) fn put_service_age(&mut self, key: &str, value: &[u8]) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let service = self
            .layout
            .parse_service_age_key(key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let age = ages::ServiceAge::parse(value).map_err(|e| reject("bad_service_age", e))?;
        let before = self.service_age(&service);
        self.ages.recorded.insert(service.clone(), age.revision);
        self.ages.wanted.notify_one();
        Ok(self.service_age(&service) != before)
    }

    /// Sets a service's age to the smallest create revision among its instances; a service
    /// with none keeps the age it had.
    pub(super) fn refresh_since(&mut self, service: &str) {
        if let Some(rev) = self
            .service_instances(service)
            .map(|(_, inst)| inst.create_revision)
            .min()
        {
            self.ages.since_revision.insert(service.to_string(), rev);
        }
    }
}
