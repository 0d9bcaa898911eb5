//! The toolgate-xds processes of a fleet: each registers where Envoys reach its admin listener
//! as `<prefix>xds/<id>`, bound to a lease it keeps alive, and every toolgate-xds gives its
//! Envoys the others' as the control cluster's second priority (its own first), so the
//! aggregate endpoint and the filters' reports outlive any one of them.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// The value of `<prefix>xds/<id>`. Unknown fields are ignored, so a newer toolgate-xds may
/// add some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdsMember {
    /// Where Envoys reach its admin listener: an IP address and a port.
    pub admin: String,
    /// The toolgate version that registered, for operators.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// How many Envoys its ADS streams serve now: the fleet's size, summed over its
    /// toolgate-xds, is what each call limit's budget is split by.
    #[serde(default)]
    pub envoys: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemberError {
    #[error("not a toolgate-xds member: {0}")]
    Json(String),
    #[error("admin {0:?} is not an IP address and port")]
    Address(String),
    #[error("admin {0}: port 0 and unspecified addresses reach nothing")]
    Unusable(SocketAddr),
}

impl XdsMember {
    pub fn new(admin: SocketAddr, version: &str) -> XdsMember {
        XdsMember {
            admin: admin.to_string(),
            version: version.to_string(),
            envoys: 0,
        }
    }

    /// Reads a value, with its admin address.
    pub fn parse(value: &[u8]) -> Result<(XdsMember, SocketAddr), MemberError> {
        let member: XdsMember =
            serde_json::from_slice(value).map_err(|e| MemberError::Json(e.to_string()))?;
        let addr: SocketAddr = member
            .admin
            .parse()
            .map_err(|_| MemberError::Address(member.admin.clone()))?;
        if addr.port() == 0 || addr.ip().is_unspecified() {
            return Err(MemberError::Unusable(addr));
        }
        Ok((member, addr))
    }

    pub fn to_json(&self) -> String {
        // Two strings: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The key id of the toolgate-xds reached at `admin`: the address in the characters a name
    /// allows (`10.0.0.5_19000`, `fd00--1_19000`). One address, one member: a restarted
    /// toolgate-xds takes its own key over instead of leaving a second one until its TTL.
    pub fn id_for(admin: SocketAddr) -> String {
        format!(
            "{}_{}",
            admin.ip().to_string().replace(':', "-"),
            admin.port()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_an_admin_address_and_ignores_what_it_does_not_know() {
        let (m, addr) =
            XdsMember::parse(br#"{"admin":"10.0.0.5:19000","version":"0.1.0","zone":"a"}"#)
                .expect("valid");
        assert_eq!(addr, "10.0.0.5:19000".parse().unwrap());
        assert_eq!(m.version, "0.1.0");
        let round = XdsMember::parse(m.to_json().as_bytes()).expect("round trip");
        assert_eq!(round.0, m);
        for bad in [
            &br#"{"admin":"xds:19000"}"#[..],
            br#"{"admin":"10.0.0.5"}"#,
            br#"{"admin":"0.0.0.0:19000"}"#,
            br#"{"admin":"10.0.0.5:0"}"#,
            br#"{"version":"1"}"#,
            b"not json",
        ] {
            assert!(
                XdsMember::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn ids_are_names() {
        for (addr, id) in [
            ("10.0.0.5:19000", "10.0.0.5_19000"),
            ("[fd00::1]:19000", "fd00--1_19000"),
        ] {
            let got = XdsMember::id_for(addr.parse().unwrap());
            assert_eq!(got, id);
            assert!(crate::validate_name("id", &got).is_ok());
        }
    }
}
