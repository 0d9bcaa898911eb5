//! A crashed server's kernel tells the prober long before its next probe could.
//!
//! Between two probes an instance whose process died keeps its lease (the registrar or the
//! keep-alive outlives it for up to the TTL) and stays routed until the next probe: up to one
//! interval (2 s, +10% jitter). But a process that dies, by SIGKILL, the OOM killer or a
//! crash, has its sockets closed by the kernel, which sends FIN (or RST) on every connection
//! it had. So after a probe passes, the prober holds one idle TCP connection to the instance
//! and waits on it. When the instance's end closes it, one bare connect tells why:
//! - refused, reset, unreachable or unanswered: nothing serves there any more ([`Ended::Gone`]);
//!   the caller probes at once, and a refused probe makes the instance SUSPECT;
//! - accepted: the server is alive and closed an idle connection itself (an idle or header
//!   timeout, a restart of its listener); [`Ended::Closed`], and the schedule goes on.
//!
//! It costs no probe traffic. The connection sends nothing; the server sees one idle
//! connection per instance. A new one is opened only after a passing probe, so a server that
//! closes idle connections costs at most one connect per probe interval. The connections held
//! at once are bounded by a budget of file descriptors ([`budget`]).
//!
//! A host that vanishes without closing anything (power loss, a cut network) sends nothing:
//! the probes find it as before.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use toolgate_probe::tcp::{reach, Unreached};

/// How a held connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Its end closed and nothing serves at the address now: probe at once.
    Gone,
    /// Its end closed, or wrote to a connection that asked nothing, and the address still
    /// accepts connections: the server is alive.
    Closed,
    /// It could not be opened; nothing is known.
    NotOpened,
}

impl Ended {
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Gone => "gone",
            Ended::Closed => "closed",
            Ended::NotOpened => "not_opened",
        }
    }
}

/// What a server may write on a connection that never asked anything before the watch gives
/// it up (an HTTP server may answer 408 before closing; more than this is not a server
/// behaving as one).
const MOST_UNASKED_BYTES: usize = 16 * 1024;

/// Opens a connection to `addr` and returns when its other end closes it, having judged why.
/// Holds `permit` (one file descriptor of the budget) for as long as the connection is open.
/// Cancel-safe: dropping the future closes the connection and frees the permit.
pub async fn hold(addr: SocketAddr, timeout: Duration, permit: OwnedSemaphorePermit) -> Ended {
    // The probe that just passed connected; a failure here (the descriptor limit, a listener
    // that went away since) is left to the next probe, which is never late.
    let Ok(stream) = reach(addr, timeout).await else {
        return Ended::NotOpened;
    };
    let chatty = wait_closed(stream).await;
    drop(permit);
    if chatty {
        return Ended::Closed;
    }
    if serves(addr, timeout).await {
        Ended::Closed
    } else {
        Ended::Gone
    }
}

/// Reads until the other end closes; true when it wrote more than a server ever would to a
/// connection that asked nothing (then the watch gives the connection up).
async fn wait_closed(mut stream: TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    let mut seen = 0;
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => {
                seen += n;
                if seen > MOST_UNASKED_BYTES {
                    return true;
                }
            }
        }
    }
}

/// How long a connection the judging connect opened must stay open to count as served.
const SETTLE: Duration = Duration::from_millis(100);

/// Whether something still accepts connections at `addr`. Only a connection accepted and
/// still open [`SETTLE`] later says yes: a dying process's kernel closes its descriptors one
/// by one, so the held connection may close while the listener still exists, and the connect
/// lands in its queue, to be reset a moment later when the listener goes (seen in 4 of 30
/// SIGKILLs on this machine before this wait). A refusal, a reset, an unreachable host or no
/// answer within `timeout` all say the process is gone or cannot be reached, which the probe
/// that follows settles. An error of this process (no descriptor left) says nothing about the
/// server, and counts as yes, so the schedule decides.
async fn serves(addr: SocketAddr, timeout: Duration) -> bool {
    match reach(addr, timeout).await {
        Ok(mut s) => {
            let mut byte = [0u8; 1];
            match tokio::time::timeout(SETTLE, s.read(&mut byte)).await {
                // Open and quiet, as a server waiting for a request is; or it greeted us.
                Err(_) | Ok(Ok(1..)) => true,
                Ok(Ok(0) | Err(_)) => false,
            }
        }
        Err(Unreached::TimedOut(_)) => false,
        Err(e) => !e.nothing_serves(),
    }
}

/// Raises the soft limit on open files to the hard one, as a server that holds a connection
/// per instance should (Go's runtime does the same for every program), and returns the limit
/// now in force. Process-wide: called once, at the prober's start.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// How many connections the watch may hold at once: `limit` (0 turns it off), and never more
/// than half of the `files` this process may open beyond 1,024 kept for everything else
/// (etcd, Envoys, probes in flight, the admin API).
pub fn budget(limit: usize, files: u64) -> usize {
    let spare = files.saturating_sub(1024) / 2;
    limit.min(usize::try_from(spare).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;
    use tokio::sync::Semaphore;
    use tokio::task::JoinHandle;

    use super::*;

    fn permit(s: &Arc<Semaphore>) -> OwnedSemaphorePermit {
        s.clone().try_acquire_owned().expect("a permit")
    }

    const T: Duration = Duration::from_millis(500);

    /// A server with the watch's connection held to it, from a budget of one.
    struct Watched {
        listener: TcpListener,
        accepted: TcpStream,
        budget: Arc<Semaphore>,
        held: JoinHandle<Ended>,
    }

    async fn watched() -> Watched {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let budget = Arc::new(Semaphore::new(1));
        let held = tokio::spawn(hold(addr, T, permit(&budget)));
        let (accepted, _) = listener.accept().await.unwrap();
        assert_eq!(budget.available_permits(), 0, "held while open");
        Watched {
            listener,
            accepted,
            budget,
            held,
        }
    }

    async fn ended(held: JoinHandle<Ended>) -> Ended {
        tokio::time::timeout(Duration::from_secs(5), held)
            .await
            .expect("the watch ends within 5 s")
            .expect("the watch does not panic")
    }

    #[tokio::test]
    async fn a_process_gone_is_gone_and_frees_its_descriptor() {
        let w = watched().await;
        // What the kernel does for a killed process: its listener and connections close.
        drop(w.listener);
        drop(w.accepted);
        assert_eq!(ended(w.held).await, Ended::Gone);
        assert_eq!(w.budget.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_listener_closed_just_after_the_connection_is_gone() {
        // A dying process's kernel may close the held connection before the listener: the
        // judging connect then lands in the listener's queue and is reset when it goes.
        let w = watched().await;
        drop(w.accepted);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(w.listener);
        assert_eq!(ended(w.held).await, Ended::Gone);
    }

    #[tokio::test]
    async fn a_live_server_closing_an_idle_connection_is_not_gone() {
        let mut w = watched().await;
        // An idle timeout's goodbye, as some HTTP servers write it.
        w.accepted
            .write_all(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        drop(w.accepted);
        assert_eq!(ended(w.held).await, Ended::Closed);
        // The judging connect was accepted by the live listener.
        assert!(tokio::time::timeout(T, w.listener.accept()).await.is_ok());
    }

    #[tokio::test]
    async fn a_server_that_floods_an_unasked_connection_is_given_up() {
        let w = watched().await;
        let mut accepted = w.accepted;
        let flood = tokio::spawn(async move {
            let chunk = [b'x'; 4096];
            while accepted.write_all(&chunk).await.is_ok() {}
        });
        assert_eq!(ended(w.held).await, Ended::Closed);
        assert_eq!(w.budget.available_permits(), 1);
        flood.abort();
    }

    #[tokio::test]
    async fn nothing_listening_is_not_opened() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let budget = Arc::new(Semaphore::new(1));
        assert_eq!(hold(addr, T, permit(&budget)).await, Ended::NotOpened);
        assert_eq!(budget.available_permits(), 1);
    }

    #[test]
    fn the_budget_keeps_descriptors_for_everything_else() {
        assert_eq!(
            budget(usize::MAX, 1024),
            0,
            "the common default leaves no room"
        );
        assert_eq!(budget(usize::MAX, 1000), 0);
        assert_eq!(budget(usize::MAX, 65_536), 32_256);
        assert_eq!(budget(10_000, 65_536), 10_000);
        assert_eq!(budget(10_000, 1_048_576), 10_000);
        assert_eq!(budget(0, 1_048_576), 0, "0 turns it off");
    }
}
