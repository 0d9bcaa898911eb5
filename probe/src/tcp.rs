//! The weakest probe: a TCP connect. A process whose kernel still accepts connections passes
//! it even when frozen (SIGSTOP) or wedged, so it is for servers that answer nothing cheaply.

use std::net::SocketAddr;
use std::time::Duration;

pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Ok("TCP connect succeeded".into()),
        Ok(Err(e)) => Err(format!("connect failed: {e}")),
        Err(_) => Err(format!("connect not done within {}ms", timeout.as_millis())),
    }
}

/// Whether a connect to `addr` is refused: nothing listens there (the process is gone). A
/// timeout or any other error is not a refusal.
pub async fn refused(addr: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listener_passes_and_a_closed_port_fails() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        assert!(connect(addr, Duration::from_secs(1)).await.is_ok());
        drop(l);
        let e = connect(addr, Duration::from_secs(1)).await.unwrap_err();
        assert!(e.starts_with("connect failed"), "{e}");
        assert!(refused(addr, Duration::from_secs(1)).await);
    }
}
