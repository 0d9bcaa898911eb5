//! The sidecar's watch on its server. A registrar beside its server (no child) holds a lease
//! that outlives a crashed server; toolgate's probes would find the crash only at their next
//! interval. From beside the server a refused connect is certain and costs nothing on the
//! network: nothing listens on the port any more. Only a refusal counts: a frozen or slow
//! server still accepts connections, and judging it is the probes' work.

use std::io::ErrorKind;
use std::time::Duration;

use toolgate_model::Endpoint;

/// How long one connect may take before it counts as "not refused" (a slow answer is not a
/// dead server).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// What one connect to the server found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Accepting,
    /// Nothing listens: the connect was refused, with the system's words.
    Refused(String),
    /// Anything else (a timeout, a name that does not resolve): says nothing certain.
    Unsure(String),
}

/// One connect to `endpoint`, closed at once.
pub async fn look(endpoint: &Endpoint) -> Seen {
    let connect = tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port));
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(_)) => Seen::Accepting,
        Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => Seen::Refused(e.to_string()),
        Ok(Err(e)) => Seen::Unsure(e.to_string()),
        Err(_) => Seen::Unsure(format!(
            "connect not done within {}ms",
            CONNECT_TIMEOUT.as_millis()
        )),
    }
}

/// Returns, with the refusal's words, once a connect to `endpoint` is refused; looks every
/// `every`.
pub async fn until_refused(endpoint: &Endpoint, every: Duration) -> String {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Seen::Refused(why) = look(endpoint).await {
            return why;
        }
    }
}

/// Returns once `endpoint` accepts a connection; looks every `every`.
pub async fn until_accepting(endpoint: &Endpoint, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if look(endpoint).await == Seen::Accepting {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(port: u16) -> Endpoint {
        Endpoint {
            host: "127.0.0.1".into(),
            port,
        }
    }

    #[tokio::test]
    async fn a_closed_port_is_refused_and_a_listener_accepts() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        assert_eq!(look(&endpoint(port)).await, Seen::Accepting);
        drop(listener);
        let why = tokio::time::timeout(
            Duration::from_secs(5),
            until_refused(&endpoint(port), Duration::from_millis(20)),
        )
        .await
        .expect("the refusal is seen");
        assert!(why.to_lowercase().contains("refused"), "{why}");
        let back = tokio::net::TcpListener::bind(("127.0.0.1", port)).await;
        if let Ok(_listener) = back {
            tokio::time::timeout(
                Duration::from_secs(5),
                until_accepting(&endpoint(port), Duration::from_millis(20)),
            )
            .await
            .expect("the listener is seen again");
        }
    }

    #[tokio::test]
    async fn a_name_that_does_not_resolve_is_not_a_refusal() {
        let e = Endpoint {
            host: "no-such-host.invalid".into(),
            port: 80,
        };
        assert!(matches!(look(&e).await, Seen::Unsure(_)));
    }
}
