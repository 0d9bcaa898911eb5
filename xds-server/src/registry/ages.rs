//! Each service's age for naming, as the fleet recorded it in etcd
//! (`<prefix>service-ages/<service>`): the revision at which a toolgate-xds first saw the
//! service (the smallest create revision among its instance keys then), written once, if
//! absent, by whichever sees it first (`crate::service_ages`). The older service keeps a
//! contested bare tool name on a virtual server, so the age must outlive the instance keys:
//! a service whose registrar stops and registers again gets new keys, younger than its
//! rival's, and would otherwise lose its names (and the rules written against them) to it.

use serde::{Deserialize, Serialize};

/// The value of `<prefix>service-ages/<service>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceAge {
    /// The etcd revision the service counts as registered since.
    pub revision: i64,
}

impl ServiceAge {
    pub fn parse(value: &[u8]) -> Result<ServiceAge, String> {
        let age: ServiceAge = serde_json::from_slice(value)
            .map_err(|e| format!("not a service age ({{\"revision\": <n>}}): {e}"))?;
        if age.revision <= 0 {
            return Err(format!("revision {} is not an etcd revision", age.revision));
        }
        Ok(age)
    }

    pub fn to_json(self) -> String {
        format!("{{\"revision\":{}}}", self.revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_is_a_positive_revision_and_nothing_else() {
        let age = ServiceAge::parse(br#"{"revision": 42}"#).unwrap();
        assert_eq!(age.revision, 42);
        assert_eq!(ServiceAge::parse(age.to_json().as_bytes()), Ok(age));
        for bad in [
            &br#"{"revision": 0}"#[..],
            br#"{"revision": -3}"#,
            br#"{"revision": "42"}"#,
            br#"{"revision": 42, "by": "x"}"#,
            b"42",
        ] {
            assert!(
                ServiceAge::parse(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
