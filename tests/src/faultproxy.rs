//! A TCP proxy between two processes that can cut the link and restore it, for partition
//! tests. It runs on its own thread and runtime, so it keeps working whatever the test does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Bytes flow.
    Up,
    /// Every connection is reset at once and new ones are reset on accept.
    Reset,
    /// Connections stay open but no byte crosses, like a silent network partition; new
    /// connections are accepted and held.
    Blackhole,
}

pub struct FaultProxy {
    addr: SocketAddr,
    link: Arc<watch::Sender<Link>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards to `target`.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").expect("binding the fault proxy");
        std_listener
            .set_nonblocking(true)
            .expect("non-blocking proxy listener");
        let addr = std_listener.local_addr().expect("proxy address");
        let (link, _) = watch::channel(Link::Up);
        let link = Arc::new(link);
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let link2 = link.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("fault proxy runtime");
                rt.block_on(async move {
                    let listener =
                        TcpListener::from_std(std_listener).expect("tokio proxy listener");
                    tokio::select! {
                        _ = stop_rx => {}
                        _ = accept_loop(listener, target, link2) => {}
                    }
                });
            })
            .expect("starting the fault proxy thread");
        FaultProxy {
            addr,
            link,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Resets every connection and refuses new ones until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.link.send_replace(Link::Reset);
    }

    /// Holds every connection silent until [`restore`](Self::restore).
    pub fn blackhole(&self) {
        self.link.send_replace(Link::Blackhole);
    }

    pub fn restore(&self) {
        self.link.send_replace(Link::Up);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, link: Arc<watch::Sender<Link>>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if *link.borrow() == Link::Reset {
            reset(client);
            continue;
        }
        let rx = link.subscribe();
        tokio::spawn(async move {
            let Ok(Ok(server)) =
                tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(target)).await
            else {
                reset(client);
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            relay(client, server, rx).await;
        });
    }
}

/// Closes with RST rather than FIN, as a dropped route or a killed peer looks.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn relay(client: TcpStream, server: TcpStream, mut link: watch::Receiver<Link>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (up_link, down_link) = (link.clone(), link.clone());
    let cut = {
        let up = async {
            pump(&mut cr, &mut sw, up_link).await;
            let _ = sw.shutdown().await;
        };
        let down = async {
            pump(&mut sr, &mut cw, down_link).await;
            let _ = cw.shutdown().await;
        };
        tokio::select! {
            _ = futures::future::join(up, down) => false,
            _ = link.wait_for(|l| *l == Link::Reset) => true,
        }
    };
    if cut {
        if let (Ok(c), Ok(s)) = (cr.reunite(cw), sr.reunite(sw)) {
            reset(c);
            reset(s);
        }
    }
}

/// Copies one direction, pausing while the link is blackholed.
async fn pump<R, W>(from: &mut R, to: &mut W, mut link: watch::Receiver<Link>)
where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if link.wait_for(|l| *l == Link::Up).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if link.wait_for(|l| *l == Link::Up).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
