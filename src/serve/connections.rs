//! A cap on open connections (`--max-connections`). Each connection holds a permit until it
//! closes; one accepted beyond the cap is answered at once with a 503 in the API's error shape
//! and closed, so a client learns why instead of hanging in the kernel's backlog, and the
//! network thread keeps a bounded number of sockets and tasks however many clients connect.
#![forbid(unsafe_code)]

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use super::limits::Watch;
use super::metrics::Shared;

/// How long a refused client gets to take its 503 before the socket is dropped.
const REFUSE_LINGER: Duration = Duration::from_secs(1);

/// A listener that accepts at most `max` connections open at once.
pub struct CappedListener {
    inner: TcpListener,
    open: Arc<Semaphore>,
    max: usize,
    shared: Arc<Shared>,
}

impl CappedListener {
    pub fn new(inner: TcpListener, max: usize, shared: Arc<Shared>) -> CappedListener {
        CappedListener { inner, open: Arc::new(Semaphore::new(max)), max, shared }
    }
}

impl axum::serve::Listener for CappedListener {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        loop {
            // axum's accept for a TcpListener logs and retries its errors (EMFILE included).
            let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            match Arc::clone(&self.open).try_acquire_owned() {
                Ok(permit) => {
                    self.shared.connections.fetch_add(1, Ordering::Relaxed);
                    let shared = Arc::clone(&self.shared);
                    return (Counted { io: stream, _permit: permit, shared, watch: Watch::new() }, addr);
                }
                Err(_) => {
                    self.shared.connections_refused.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(refuse(stream, self.max));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// Writes the 503 and closes; reads what the client sent meanwhile, so that closing does not
/// reset the connection before the client has read the reply.
async fn refuse(mut stream: TcpStream, max: usize) {
    let err = ApiError::too_many_connections(format!(
        "the server has {max} connections open (--max-connections); retry later"
    ));
    let body = err.body().to_string();
    let status = axum::http::StatusCode::from_u16(err.status).unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: {}\r\nconnection: close\r\n\r\n{body}",
        body.len(),
        err.retry_after.unwrap_or(1),
    );
    let linger = async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    };
    let _ = tokio::time::timeout(REFUSE_LINGER, linger).await;
}

/// An accepted connection; its permit returns to the cap when it is dropped. It tells its
/// [`Watch`] when bytes arrive, for the per-connection limits.
pub struct Counted {
    io: TcpStream,
    _permit: OwnedSemaphorePermit,
    shared: Arc<Shared>,
    watch: Arc<Watch>,
}

impl Counted {
    /// The connection's state for its limits ([`super::limits`]).
    pub fn watch(&self) -> Arc<Watch> {
        Arc::clone(&self.watch)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.shared.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.watch.bytes_read();
        }
        r
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
