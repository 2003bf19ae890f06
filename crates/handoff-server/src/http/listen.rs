//! Serving HTTP/1.1 with connection hygiene: what a bare `axum::serve` does
//! not bound, a client could hold forever.
//!
//! - **Header timeout.** A request's headers must arrive within
//!   [`HttpLimits::header_timeout`]; hyper applies the same timer to a
//!   kept-alive connection waiting for its next request, so it is also the
//!   idle timeout.
//! - **Body timeout.** Handlers read a body within
//!   [`HttpLimits::body_timeout`] ([`crate::http::extract::read_body`], through the
//!   [`BodyDeadline`] each request carries) or answer 408.
//! - **Write timeout.** A write to the socket that makes no progress for
//!   [`HttpLimits::write_timeout`] (a client that stopped reading its stream)
//!   fails the connection; hyper then drops the response body, and with it
//!   the engine stream, which cancels the request and frees its pages.
//! - **Connection cap.** Past [`HttpLimits::max_connections`] open
//!   connections a new one gets a 503 and is closed.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// Bounds on what one connection may hold (the `--http-*` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time to receive a request's headers, and to wait idle for the next
    /// request on a kept-alive connection.
    pub header_timeout: Duration,
    /// Time to receive a request's body once its headers are in.
    pub body_timeout: Duration,
    /// Time a write to the client may make no progress before the
    /// connection (and the request it streams) is dropped.
    pub write_timeout: Duration,
    /// Open connections at most; more get a 503.
    pub max_connections: usize,
    /// After shutdown: longest open connections may take to finish their
    /// requests before they are cut.
    pub drain_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: 1024,
            drain_timeout: Duration::from_secs(60),
        }
    }
}

/// The body deadline of a request, set by [`serve`] as a request extension.
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadline(pub Duration);

/// Serve `app` on `listener` within `limits` until `shutdown` resolves; then
/// stop accepting and wait for open connections to finish their requests,
/// up to `limits.drain_timeout` (then they are cut).
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    // The connection tasks, so a drain that times out can cut them.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait, do not exit.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(
                "refusing a connection from {peer}: {} connections are open",
                limits.max_connections
            );
            tokio::spawn(refuse_connection(stream, limits.max_connections));
            continue;
        };
        let app = app.clone();
        let deadline = BodyDeadline(limits.body_timeout);
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(deadline);
            let mut app = app.clone();
            tower_service::Service::call(&mut app, req.map(Body::new))
        });
        let io = TokioIo::new(WriteDeadline::new(stream, limits.write_timeout));
        let conn = graceful.watch(builder.serve_connection(io, service));
        conns.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer} ended: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            open = limits
                .max_connections
                .saturating_sub(slots.available_permits()),
            "drain timeout ({} s): cutting the connections still open",
            limits.drain_timeout.as_secs()
        );
    }
    // Dropping the set aborts what is left (cut connections drop their
    // requests, which cancels them).
    drop(conns);
    Ok(())
}

/// Answer 503 to a connection past the cap and close it.
async fn refuse_connection(mut stream: TcpStream, cap: usize) {
    let body = format!(
        r#"{{"error":{{"message":"the server has {cap} open connections, its limit: retry later","type":"server_error","code":"too_many_connections","param":null}}}}"#
    );
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(resp.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// A stream whose writes fail once they have made no progress for
/// `timeout`.
struct WriteDeadline<T> {
    inner: T,
    timeout: Duration,
    /// Running while a write is blocked.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteDeadline<T> {
    fn new(inner: T, timeout: Duration) -> Self {
        WriteDeadline {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// After the inner write answered `poll`: time a block, clear it on
    /// progress, fail the write once the block outlasts the timeout.
    fn watch<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client read nothing for {} s: dropping the connection",
                    timeout.as_secs_f64()
                ),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_blocked_past_the_timeout_fails_and_progress_resets_it() {
        // A duplex pipe of 16 bytes that nobody reads: writes block.
        let (a, mut b) = tokio::io::duplex(16);
        let mut w = WriteDeadline::new(a, Duration::from_secs(5));
        w.write_all(&[1; 16]).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = w.write_all(&[2; 8]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        // Reading a little lets a write through, which resets the clock.
        let mut buf = [0; 8];
        tokio::io::AsyncReadExt::read_exact(&mut b, &mut buf)
            .await
            .unwrap();
        w.write_all(&[3; 8]).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = w.write_all(&[4; 1]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }
}
