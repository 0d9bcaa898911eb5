//! The fleet's toolgate-xds processes as etcd lists them (`<prefix>xds/<id>`, each bound to
//! its process's lease), admitted like instances: a value that does not read, or an address
//! the endpoint policy refuses, is rejected with its key and reason and the key keeps its last
//! good value. From them and this process's own address comes what Envoy's control cluster
//! holds: this toolgate-xds first, the others after it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use toolgate_model::control_plane::XdsMember;
use toolgate_model::KeyLayout;

use super::admission::EndpointPolicy;
use super::Rejected;
use crate::routing::ControlMembers;

/// One admitted member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub admin: SocketAddr,
    /// The value as stored, for the state-dir snapshot and the inspection.
    pub raw: String,
    pub lease: i64,
    /// How many Envoys it serves now.
    pub envoys: u32,
}

/// Every admitted member by id, and where this process's own Envoys reach it.
#[derive(Debug, Clone, Default)]
pub struct Members {
    members: BTreeMap<String, Member>,
    /// This process's key id, when it registers itself: its own key is not one of "the
    /// others".
    own_id: Option<String>,
    /// Where this process's Envoys reach its admin listener.
    local: Option<SocketAddr>,
    /// The control members last made, kept while they come out the same.
    made: Arc<ControlMembers>,
}

impl Members {
    /// This process: its key id (`None` when it does not register) and its admin address.
    pub fn set_local(&mut self, own_id: Option<String>, local: SocketAddr) {
        self.own_id = own_id;
        self.local = Some(local);
    }

    /// Admits `value` at `key`; `Ok(true)` when the control cluster changes.
    pub fn put(
        &mut self,
        layout: &KeyLayout,
        policy: &EndpointPolicy,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<bool, Rejected> {
        let reject = |reason: &'static str, detail: String| Rejected {
            key: key.to_string(),
            reason,
            detail,
        };
        let id = layout
            .parse_xds_key(key)
            .map_err(|e| reject("bad_key", e.to_string()))?;
        let (parsed, admin) =
            XdsMember::parse(value).map_err(|e| reject("bad_xds_member", e.to_string()))?;
        policy.check(admin.ip()).map_err(|why| {
            reject(
                "refused_endpoint",
                format!("admin {admin}: {why}; not given to Envoys"),
            )
        })?;
        let member = Member {
            admin,
            raw: String::from_utf8_lossy(value).into_owned(),
            lease,
            envoys: parsed.envoys,
        };
        // The fleet's size (call limits are split by it) changes with its Envoys.
        let changed = self
            .members
            .get(&id)
            .is_none_or(|m| m.admin != admin || m.envoys != parsed.envoys);
        self.members.insert(id, member);
        Ok(changed)
    }

    /// Applies a DELETE of `id`'s key; whether there was a member.
    pub fn remove(&mut self, id: &str) -> bool {
        self.members.remove(id).is_some()
    }

    /// Empties the map for a full read; the old one is handed back to restore last good
    /// values from.
    pub fn take(&mut self) -> BTreeMap<String, Member> {
        std::mem::take(&mut self.members)
    }

    /// Puts back `id`'s last good value from `old` (its new one was rejected); whether there
    /// was one.
    pub fn restore(&mut self, id: &str, old: &mut BTreeMap<String, Member>) -> bool {
        match old.remove(id) {
            Some(m) => self.members.insert(id.to_string(), m).is_none(),
            None => false,
        }
    }

    /// The Envoys the fleet's other toolgate-xds serve (this process counts its own).
    pub fn others_envoys(&self) -> u32 {
        self.members
            .iter()
            .filter(|(id, _)| Some(*id) != self.own_id.as_ref())
            .filter(|(_, m)| Some(m.admin) != self.local)
            .fold(0u32, |n, (_, m)| n.saturating_add(m.envoys))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Member)> {
        self.members.iter()
    }

    /// What the control cluster holds now: this process first, then every other member by
    /// address (one address once; this process's own address is not repeated). The same
    /// `Arc` as long as nothing changed.
    pub fn control(&mut self) -> Arc<ControlMembers> {
        let local = self.local;
        let mut peers: Vec<SocketAddr> = self
            .members
            .iter()
            .filter(|(id, _)| Some(*id) != self.own_id.as_ref())
            .map(|(_, m)| m.admin)
            .filter(|a| Some(*a) != local)
            .collect();
        peers.sort();
        peers.dedup();
        let made = ControlMembers { local, peers };
        if *self.made != made {
            tracing::info!(local = ?made.local, others = ?made.peers,
                "the control cluster's toolgate-xds changed");
            self.made = Arc::new(made);
        }
        Arc::clone(&self.made)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(m: &mut Members, id: &str, value: &str) -> Result<bool, Rejected> {
        m.put(
            &KeyLayout::default(),
            &EndpointPolicy::new(vec!["10.0.0.0/8".parse().unwrap()]),
            &format!("/mcp/xds/{id}"),
            value.as_bytes(),
            7,
        )
    }

    #[test]
    fn the_control_cluster_is_this_process_first_then_the_others() {
        let mut m = Members::default();
        m.set_local(
            Some("10.0.0.1_19000".into()),
            "10.0.0.1:19000".parse().unwrap(),
        );
        assert_eq!(
            put(&mut m, "10.0.0.1_19000", r#"{"admin":"10.0.0.1:19000"}"#),
            Ok(true)
        );
        assert_eq!(
            put(&mut m, "10.0.0.3_19000", r#"{"admin":"10.0.0.3:19000"}"#),
            Ok(true)
        );
        assert_eq!(
            put(&mut m, "10.0.0.2_19000", r#"{"admin":"10.0.0.2:19000"}"#),
            Ok(true)
        );
        let first = m.control();
        assert_eq!(first.local, Some("10.0.0.1:19000".parse().unwrap()));
        assert_eq!(
            first.peers,
            [
                "10.0.0.2:19000".parse().unwrap(),
                "10.0.0.3:19000".parse().unwrap()
            ]
        );
        assert!(Arc::ptr_eq(&first, &m.control()), "unchanged: the same Arc");
        // The same address again (a new lease) changes nothing Envoy gets.
        assert_eq!(
            put(
                &mut m,
                "10.0.0.2_19000",
                r#"{"admin":"10.0.0.2:19000","version":"9"}"#
            ),
            Ok(false)
        );
        assert!(m.remove("10.0.0.3_19000"));
        assert_eq!(m.control().peers, ["10.0.0.2:19000".parse().unwrap()]);
    }

    #[test]
    fn bad_values_are_rejected_with_a_reason_and_keep_the_last_good_one() {
        let mut m = Members::default();
        m.set_local(None, "127.0.0.1:19000".parse().unwrap());
        assert_eq!(put(&mut m, "x", r#"{"admin":"10.0.0.2:19000"}"#), Ok(true));
        for (value, reason) in [
            ("nope", "bad_xds_member"),
            (r#"{"admin":"xds:19000"}"#, "bad_xds_member"),
            (r#"{"admin":"192.168.1.1:19000"}"#, "refused_endpoint"),
            (r#"{"admin":"169.254.169.254:80"}"#, "refused_endpoint"),
        ] {
            let r = put(&mut m, "x", value).expect_err(value);
            assert_eq!(r.reason, reason, "{value}: {}", r.detail);
        }
        assert_eq!(
            put(&mut m, "a/b", r#"{"admin":"10.0.0.2:1"}"#)
                .unwrap_err()
                .reason,
            "bad_key"
        );
        assert_eq!(m.control().peers, ["10.0.0.2:19000".parse().unwrap()]);
        // A full read that rejects the value keeps the last good one.
        let mut old = m.take();
        assert!(m.control().peers.is_empty());
        assert!(m.restore("x", &mut old));
        assert_eq!(m.control().peers, ["10.0.0.2:19000".parse().unwrap()]);
    }
}
