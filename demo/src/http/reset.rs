//! A listener whose connections a request handler can tear down with a TCP
//! reset (SO_LINGER 0, then close), without a single byte of HTTP response:
//! what a gateway sees when an upstream process crashes mid-request.
//!
//! hyper owns the socket while it serves a connection, so a handler cannot
//! close it directly. Instead the handler flips the connection's
//! [`ResetHandle`]; the stream then fails hyper's next read or write (the
//! handler's own response is the next write), hyper drops the connection, and
//! the drop closes the socket with SO_LINGER 0, which makes the kernel send RST.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    extract::connect_info::Connected,
    serve::{IncomingStream, Listener},
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};

/// Per-connection switch; handlers find it as `ConnectInfo<ResetHandle>` in
/// the request extensions.
#[derive(Clone, Debug, Default)]
pub struct ResetHandle(Arc<AtomicBool>);

impl ResetHandle {
    /// Tears the connection down with RST as soon as hyper next touches it.
    /// Whatever response the handler returns afterwards is never sent.
    pub fn reset(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Connected<IncomingStream<'_, ResettableListener>> for ResetHandle {
    fn connect_info(stream: IncomingStream<'_, ResettableListener>) -> Self {
        stream.io().reset.clone()
    }
}

pub struct ResettableListener {
    inner: TcpListener,
}

impl ResettableListener {
    pub fn new(inner: TcpListener) -> Self {
        Self { inner }
    }
}

impl Listener for ResettableListener {
    type Io = ResettableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    // Small JSON-RPC replies must not wait for Nagle's algorithm.
                    if let Err(error) = stream.set_nodelay(true) {
                        tracing::debug!(%addr, %error, "could not set TCP_NODELAY");
                    }
                    let stream = ResettableStream {
                        inner: stream,
                        reset: ResetHandle::default(),
                    };
                    return (stream, addr);
                }
                Err(error) if is_per_connection_error(&error) => {
                    tracing::debug!(%error, "accept failed for one connection");
                }
                Err(error) => {
                    // Out of file descriptors and the like: retrying at once would spin.
                    tracing::warn!(%error, "accept failed; retrying in 1s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

fn is_per_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

pub struct ResettableStream {
    inner: TcpStream,
    reset: ResetHandle,
}

fn reset_requested() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection reset on purpose",
    )
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.reset.requested() {
            return Poll::Ready(Err(reset_requested()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.reset.requested() {
            return Poll::Ready(Err(reset_requested()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.reset.requested() {
            return Poll::Ready(Err(reset_requested()));
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.reset.requested() {
            return Poll::Ready(Err(reset_requested()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A clean shutdown would send FIN first, and the peer would see an
        // orderly close instead of a reset.
        if self.reset.requested() {
            return Poll::Ready(Err(reset_requested()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Drop for ResettableStream {
    fn drop(&mut self) {
        if self.reset.requested() {
            if let Err(error) = self.inner.set_zero_linger() {
                tracing::warn!(%error, "could not set SO_LINGER 0; the peer sees FIN, not RST");
            }
        }
    }
}
