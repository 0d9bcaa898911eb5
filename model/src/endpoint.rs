//! `host:port` endpoints of MCP server instances.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// Where an instance listens. The host is an IP literal or a DNS name; IPv6 is written `[::1]:8080`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EndpointError {
    #[error("endpoint {0:?} is not host:port")]
    NotHostPort(String),
    #[error("endpoint {input:?} has port {port:?}; a port is a number from 1 to 65535")]
    BadPort { input: String, port: String },
    #[error("endpoint {input:?} has host {host:?}, which is neither an IP address nor a DNS name")]
    BadHost { input: String, host: String },
}

impl Endpoint {
    /// The host as an IP address, when it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let not_host_port = || EndpointError::NotHostPort(input.to_string());
        let (host, port) = if let Some(rest) = input.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(not_host_port)?;
            let port = after.strip_prefix(':').ok_or_else(not_host_port)?;
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(EndpointError::BadHost {
                    input: input.to_string(),
                    host: host.to_string(),
                });
            }
            (host, port)
        } else {
            let (host, port) = input.rsplit_once(':').ok_or_else(not_host_port)?;
            // An unbracketed IPv6 address is ambiguous: "::1:80" could be either.
            if host.contains(':') {
                return Err(not_host_port());
            }
            if host.parse::<std::net::Ipv4Addr>().is_err() && !is_dns_name(host) {
                return Err(EndpointError::BadHost {
                    input: input.to_string(),
                    host: host.to_string(),
                });
            }
            (host, port)
        };
        let port_num = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0 && !port.starts_with('+'))
            .ok_or_else(|| EndpointError::BadPort {
                input: input.to_string(),
                port: port.to_string(),
            })?;
        Ok(Endpoint {
            host: host.to_string(),
            port: port_num,
        })
    }
}

/// RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for Endpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Endpoint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ipv4_ipv6_and_names() {
        let e: Endpoint = "127.0.0.1:8080".parse().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 8080));
        let e: Endpoint = "[::1]:9".parse().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 9));
        assert_eq!(e.to_string(), "[::1]:9");
        let e: Endpoint = "mcp-0.inventory.svc:443".parse().unwrap();
        assert_eq!(e.host, "mcp-0.inventory.svc");
        assert_eq!(e.ip(), None);
    }

    #[test]
    fn rejects_what_is_not_host_port() {
        for bad in [
            "",
            "127.0.0.1",
            ":80",
            "host:",
            "host:0",
            "host:65536",
            "host:+80",
            "::1:80",
            "[::1]80",
            "[nope]:80",
            "a b:80",
            "-x:80",
            "x..y:80",
        ] {
            assert!(
                bad.parse::<Endpoint>().is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn error_names_the_input() {
        let err = "localhost:http"
            .parse::<Endpoint>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("localhost:http") && err.contains("\"http\""),
            "{err}"
        );
    }
}
