//! Control connections: one task per
//! socket owns the sans-IO [`Connection`] and the read half; one writer task
//! owns the write half (one writer per socket). The task does nothing clever:
//! bytes in, events to the endpoint's driver; messages from the driver,
//! bytes out.
//!
//! Also the exact-frame handshake used by data connections, which must not
//! read a byte past the last handshake frame.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_proto::connection::{Connection, ConnectionEvent};
use handoff_proto::frame::HEADER_LEN;
use handoff_proto::handshake::{Capabilities, HandshakeConfig, Negotiated};
use handoff_proto::message::{Message, NONCE_LEN};
use handoff_proto::{CodecError, HandshakeError, PeerId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::TransportError;

/// Counts live tasks of an endpoint; a test asserts it returns to zero.
#[derive(Debug, Clone, Default)]
pub struct TaskCounter(Arc<AtomicUsize>);

/// Held by a running task; decrements the counter when the task ends.
pub struct TaskGuard(Arc<AtomicUsize>);

impl TaskCounter {
    /// Register a task that is starting.
    pub fn enter(&self) -> TaskGuard {
        self.0.fetch_add(1, Ordering::AcqRel);
        TaskGuard(self.0.clone())
    }

    /// Tasks alive now.
    pub fn live(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Spawn `fut` as a counted task.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let guard = self.enter();
        tokio::spawn(async move {
            let _guard = guard;
            fut.await
        })
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A fresh handshake nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

/// What a control connection task reports to its endpoint's driver.
#[derive(Debug)]
pub enum CtlEvent {
    /// Handshake done: `tx` sends messages to `peer`.
    Established {
        /// Connection id.
        conn: u64,
        /// Our id for the peer.
        peer: PeerId,
        /// What the handshake negotiated.
        capabilities: Capabilities,
        /// Outbound messages; dropping every clone closes the connection.
        tx: mpsc::UnboundedSender<Message>,
    },
    /// A message from the peer.
    Message {
        /// Connection id.
        conn: u64,
        /// Our id for the peer.
        peer: PeerId,
        /// The message.
        msg: Message,
    },
    /// A bad frame was counted and dropped.
    Malformed {
        /// Connection id.
        conn: u64,
        /// Why.
        error: CodecError,
    },
    /// The handshake failed; the connection is closed.
    HandshakeFailed {
        /// Connection id.
        conn: u64,
        /// Why.
        error: HandshakeError,
    },
    /// The connection closed (peer gone, I/O error, or we dropped it).
    Closed {
        /// Connection id.
        conn: u64,
        /// The peer, if the handshake had completed.
        peer: Option<PeerId>,
    },
}

async fn writer_task(
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    while let Some(buf) = rx.recv().await {
        if w.write_all(&buf).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

/// Run one control connection until it closes. `send` delivers events to
/// the driver (mapped into its event type). Events name the peer `peer`,
/// the endpoint's own id for it, once the handshake is done.
#[allow(clippy::too_many_arguments)]
pub async fn run_control<E, F>(
    stream: TcpStream,
    config: HandshakeConfig,
    handshake_timeout: Duration,
    conn_id: u64,
    peer: PeerId,
    tasks: TaskCounter,
    send: F,
) where
    F: Fn(CtlEvent) -> Result<(), E> + Send + 'static,
    E: Send,
{
    let _ = stream.set_nodelay(true);
    let (mut r, w) = stream.into_split();
    let (wtx, wrx) = mpsc::unbounded_channel::<Vec<u8>>();
    tasks.spawn(writer_task(w, wrx));
    let mut conn = Connection::new(
        config,
        nonce(),
        handshake_timeout,
        std::time::Instant::now(),
    );
    let (mtx, mut mrx) = mpsc::unbounded_channel::<Message>();
    let mut mtx = Some(mtx);
    let mut established = false;
    let mut buf = vec![0u8; 64 * 1024];
    let flush = |conn: &mut Connection| {
        let out = conn.take_output();
        if !out.is_empty() {
            let _ = wtx.send(out);
        }
    };
    flush(&mut conn);
    let deadline = Instant::now() + handshake_timeout;
    loop {
        tokio::select! {
            n = r.read(&mut buf) => {
                let n = match n { Ok(0) | Err(_) => break, Ok(n) => n };
                conn.handle_bytes(&buf[..n], std::time::Instant::now());
                let mut failed = false;
                while let Some(ev) = conn.poll_event() {
                    let sent = match ev {
                        ConnectionEvent::Established(n) => {
                            established = true;
                            let capabilities = n.capabilities;
                            match mtx.take() {
                                Some(tx) => send(CtlEvent::Established { conn: conn_id, peer, capabilities, tx }),
                                None => Ok(()),
                            }
                        }
                        ConnectionEvent::Message(msg) if established => {
                            send(CtlEvent::Message { conn: conn_id, peer, msg })
                        }
                        ConnectionEvent::Message(_) => Ok(()),
                        ConnectionEvent::Malformed(error) => {
                            tracing::warn!(conn = conn_id, %error, "malformed control frame dropped");
                            send(CtlEvent::Malformed { conn: conn_id, error })
                        }
                        ConnectionEvent::Failed(error) => {
                            tracing::warn!(conn = conn_id, %error, "control handshake failed");
                            failed = true;
                            send(CtlEvent::HandshakeFailed { conn: conn_id, error })
                        }
                    };
                    if sent.is_err() {
                        failed = true;
                    }
                }
                flush(&mut conn);
                if failed {
                    break;
                }
            }
            m = mrx.recv() => {
                let Some(m) = m else { break };
                if let Err(e) = conn.send(&m) {
                    tracing::warn!(conn = conn_id, %e, "control message not sent");
                }
                flush(&mut conn);
            }
            _ = tokio::time::sleep_until(deadline), if conn.negotiated().is_none() && !conn.is_failed() => {
                conn.handle_timeout(std::time::Instant::now());
                if let Some(ConnectionEvent::Failed(error)) = conn.poll_event() {
                    let _ = send(CtlEvent::HandshakeFailed { conn: conn_id, error });
                }
                break;
            }
        }
    }
    drop(wtx);
    let _ = send(CtlEvent::Closed {
        conn: conn_id,
        peer: established.then_some(peer),
    });
}

/// Largest handshake frame payload accepted on a data connection.
const MAX_HANDSHAKE_PAYLOAD: usize = 64 * 1024;

/// Run the proto handshake on a data connection reading exactly one frame at
/// a time, so that no data-link byte is consumed by the frame decoder.
pub async fn handshake_exact(
    stream: &mut TcpStream,
    config: HandshakeConfig,
    timeout: Duration,
) -> Result<Negotiated, TransportError> {
    let run = async {
        let mut conn = Connection::new(config, nonce(), timeout, std::time::Instant::now());
        loop {
            let out = conn.take_output();
            if !out.is_empty() {
                stream
                    .write_all(&out)
                    .await
                    .map_err(TransportError::io("data handshake write"))?;
            }
            if let Some(n) = conn.negotiated() {
                return Ok(n.clone());
            }
            let mut header = [0u8; HEADER_LEN];
            stream
                .read_exact(&mut header)
                .await
                .map_err(TransportError::io("data handshake read"))?;
            let mut len = [0u8; 4];
            len.copy_from_slice(&header[8..12]);
            let len = u32::from_le_bytes(len) as usize;
            if len > MAX_HANDSHAKE_PAYLOAD {
                return Err(TransportError::Handshake(HandshakeError::Codec(
                    CodecError::Oversize {
                        len: len as u32,
                        max: MAX_HANDSHAKE_PAYLOAD as u32,
                    },
                )));
            }
            let mut frame = header.to_vec();
            frame.resize(HEADER_LEN + len, 0);
            stream
                .read_exact(&mut frame[HEADER_LEN..])
                .await
                .map_err(TransportError::io("data handshake read"))?;
            conn.handle_bytes(&frame, std::time::Instant::now());
            while let Some(ev) = conn.poll_event() {
                if let ConnectionEvent::Failed(e) = ev {
                    let out = conn.take_output();
                    let _ = stream.write_all(&out).await;
                    return Err(TransportError::Handshake(e));
                }
            }
        }
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => Err(TransportError::Handshake(HandshakeError::TimedOut(timeout))),
    }
}
