//! The weakest probe: a TCP connect. A process whose kernel still accepts connections passes
//! it even when frozen (SIGSTOP) or wedged, so it is for servers that answer nothing cheaply.
//!
//! Also the one bare connect the rest of the health code judges an address by
//! ([`reach`]): the probes' refusal check and the crash watch's judging connect.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

/// Why a connect to an instance did not give a connection.
#[derive(Debug)]
pub enum Unreached {
    /// No answer within the timeout: a frozen host, a dropped SYN, a full accept queue.
    TimedOut(Duration),
    /// The connect failed with an error.
    Failed(std::io::Error),
}

impl Unreached {
    /// Nothing listens at the address: the process is gone (its host answered for it).
    pub fn refused(&self) -> bool {
        matches!(self, Unreached::Failed(e) if e.kind() == ErrorKind::ConnectionRefused)
    }

    /// Nothing can serve at the address: refused, reset while connecting, or no route to
    /// its host. An error of this process (no descriptor left, say) is not one of them: it
    /// says nothing about the server.
    pub fn nothing_serves(&self) -> bool {
        matches!(self, Unreached::Failed(e) if matches!(
            e.kind(),
            ErrorKind::ConnectionRefused
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::HostUnreachable
                | ErrorKind::NetworkUnreachable
                | ErrorKind::AddrNotAvailable
        ))
    }
}

impl std::fmt::Display for Unreached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreached::TimedOut(t) => write!(f, "connect not done within {}ms", t.as_millis()),
            Unreached::Failed(e) => write!(f, "connect failed: {e}"),
        }
    }
}

/// One connect to `addr`, bounded by `timeout`.
pub async fn reach(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, Unreached> {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(Unreached::Failed(e)),
        Err(_) => Err(Unreached::TimedOut(timeout)),
    }
}

pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    reach(addr, timeout)
        .await
        .map(|_| "TCP connect succeeded".into())
        .map_err(|e| e.to_string())
}

/// Whether a connect to `addr` is refused: nothing listens there (the process is gone). A
/// timeout or any other error is not a refusal.
pub async fn refused(addr: SocketAddr, timeout: Duration) -> bool {
    reach(addr, timeout).await.is_err_and(|e| e.refused())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listener_passes_and_a_closed_port_fails() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        assert!(connect(addr, Duration::from_secs(1)).await.is_ok());
        assert!(!refused(addr, Duration::from_secs(1)).await);
        drop(l);
        let e = connect(addr, Duration::from_secs(1)).await.unwrap_err();
        assert!(e.starts_with("connect failed"), "{e}");
        assert!(refused(addr, Duration::from_secs(1)).await);
        let e = reach(addr, Duration::from_secs(1)).await.unwrap_err();
        assert!(e.refused() && e.nothing_serves(), "{e}");
    }

    #[test]
    fn a_timeout_is_neither_a_refusal_nor_proof_that_nothing_serves() {
        let e = Unreached::TimedOut(Duration::from_millis(250));
        assert!(!e.refused() && !e.nothing_serves());
        assert_eq!(e.to_string(), "connect not done within 250ms");
        let local = Unreached::Failed(std::io::Error::from_raw_os_error(24)); // EMFILE
        assert!(!local.refused() && !local.nothing_serves(), "{local}");
        let reset = Unreached::Failed(ErrorKind::ConnectionReset.into());
        assert!(!reset.refused() && reset.nothing_serves());
    }
}
