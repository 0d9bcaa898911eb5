//! Which endpoint addresses toolgate routes agents' calls to. A registration decides where
//! traffic goes, so an address that would reach the host itself, a cloud metadata service or
//! a multicast group is refused outright, and an operator can narrow what is admitted to the
//! networks the tool servers really run on (`--allowed-cidrs`).

use std::net::{IpAddr, Ipv6Addr};

use ipnet::IpNet;

/// AWS's IPv6 instance metadata address (the IPv4 one, 169.254.169.254, is link-local).
const AWS_METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);

#[derive(Debug, Clone, Default)]
pub struct EndpointPolicy {
    /// Empty: any address that is not dangerous.
    allowed: Vec<IpNet>,
}

impl EndpointPolicy {
    pub fn new(allowed: Vec<IpNet>) -> EndpointPolicy {
        EndpointPolicy { allowed }
    }

    /// Why `ip` must not be routed to, if it must not.
    pub fn check(&self, ip: IpAddr) -> Result<(), String> {
        // ::ffff:169.254.169.254 is the metadata service too.
        let ip = ip.to_canonical();
        if let Some(why) = dangerous(ip) {
            return Err(format!("{ip} is {why}"));
        }
        if !self.allowed.is_empty() && !self.allowed.iter().any(|net| net.contains(&ip)) {
            return Err(format!(
                "{ip} is outside the allowed networks ({})",
                self.allowed
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(())
    }
}

fn dangerous(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
            if v4.is_unspecified() {
                Some("an unspecified address")
            } else if v4.is_link_local() {
                Some("link-local (169.254.0.0/16, where cloud metadata services answer)")
            } else if v4.is_multicast() {
                Some("a multicast address")
            } else if v4.is_broadcast() {
                Some("the broadcast address")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some("an unspecified address")
            } else if v6.is_unicast_link_local() {
                Some("link-local (fe80::/10)")
            } else if v6.is_multicast() {
                Some("a multicast address")
            } else if v6 == AWS_METADATA_V6 {
                Some("a cloud metadata address")
            } else {
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn dangerous_addresses_are_refused_whatever_is_allowed() {
        let open = EndpointPolicy::default();
        for bad in [
            "0.0.0.0",
            "::",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "169.254.1.1",
            "fe80::1",
            "224.0.0.1",
            "ff02::1",
            "255.255.255.255",
            "fd00:ec2::254",
        ] {
            let err = open.check(ip(bad)).expect_err(bad);
            assert!(err.contains(&ip(bad).to_canonical().to_string()), "{err}");
        }
        for good in ["127.0.0.1", "10.1.2.3", "::1", "2001:db8::1", "fd00::5"] {
            assert_eq!(open.check(ip(good)), Ok(()), "{good}");
        }
    }

    #[test]
    fn allowed_networks_narrow_what_is_admitted() {
        let p = EndpointPolicy::new(vec![
            "10.0.0.0/8".parse().expect("net"),
            "127.0.0.0/8".parse().expect("net"),
        ]);
        assert_eq!(p.check(ip("10.9.9.9")), Ok(()));
        assert_eq!(p.check(ip("127.0.0.1")), Ok(()));
        let err = p.check(ip("192.168.1.5")).expect_err("outside");
        assert!(
            err.contains("outside the allowed networks (10.0.0.0/8, 127.0.0.0/8)"),
            "{err}"
        );
        assert!(p.check(ip("169.254.169.254")).is_err());
    }
}
