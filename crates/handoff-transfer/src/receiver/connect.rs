//! Connecting a decode endpoint to a prefill: the control connection,
//! then the data link (one or more streams), cancel-safe.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use handoff_proto::datalink::{encode_preface, TcpStreamSetup, MAX_TCP_STREAMS, PREFACE_CONTROL};
use handoff_proto::receiver_endpoint::TpPosition;
use handoff_proto::PeerId;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::commands::{Cmd, Ev, NewLink};
use super::KvReceiver;
use crate::conn::{run_control, CtlEvent};
use crate::error::TransportError;
use crate::link::connect_link_stream;
use crate::plan::LinkPlan;
use crate::transport::TransportKind;

impl KvReceiver {
    /// Connect to the prefill peer listening at `addr`: a control
    /// connection and a data link, both authenticated by the handshake.
    /// Returns the peer id this endpoint gives that prefill peer (use it in
    /// [`Source::peer`](handoff_proto::receiver_room::Source::peer) of the rooms it serves) once both are up; a
    /// version, fingerprint or secret mismatch fails here, not at the first
    /// request.
    ///
    /// Cancel-safe: dropped before it returns, it leaves no control
    /// connection, data link or task behind. Prefill keeps one connection
    /// per decode endpoint, so connecting again to the same prefill
    /// replaces the earlier connection (its peer stops working).
    pub async fn connect(&self, addr: SocketAddr) -> Result<PeerId, TransportError> {
        self.connect_with(addr, self.config.transport).await
    }

    /// [`Self::connect`] with the data link over `transport` instead of the
    /// configured default.
    pub async fn connect_with(
        &self,
        addr: SocketAddr,
        transport: TransportKind,
    ) -> Result<PeerId, TransportError> {
        // This connect's number, before anything is sent: prefill keeps the
        // connections of the newest connect of this endpoint, so one
        // cancelled here but completed late there replaces nothing newer.
        let id = self.peers.conn_ids.fetch_add(1, Ordering::Relaxed) + 1;
        // An address that never answers costs the handshake deadline, not
        // the OS's SYN timeout.
        let timeout = self.config.handshake_timeout;
        let mut s = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer from {addr} within {timeout:?}"),
                ))
            })
            .map_err(TransportError::io("control connect"))?;
        s.write_all(&encode_preface(PREFACE_CONTROL, self.endpoint, id))
            .await
            .map_err(TransportError::io("control preface"))?;
        // Our own id for this prefill endpoint (two prefill workers of the
        // same TP rank are different peers).
        let peer = PeerId(self.peers.next_peer.fetch_add(1, Ordering::Relaxed));
        let tx = self.tx.downgrade();
        let send = move |e: CtlEvent| match tx.upgrade() {
            Some(tx) => tx.send(Ev::Ctl(e)).map_err(|_| ()),
            None => Err(()),
        };
        self.tasks.spawn(run_control(
            s,
            self.config.handshake.clone(),
            self.config.handshake_timeout,
            id,
            peer,
            self.tasks.clone(),
            send,
        ));
        // From here on, leaving early (an error, or the caller dropping
        // this future) abandons the peer: its control connection and any
        // data link go.
        let mut abandon = AbandonOnDrop {
            tx: self.tx.clone(),
            peer,
            armed: true,
        };
        let count = match transport {
            TransportKind::Shm | TransportKind::Nixl => 1,
            TransportKind::Tcp => self.config.tcp_streams.clamp(1, MAX_TCP_STREAMS),
        };
        // Every stream connects at once: prefill confirms a link's streams
        // only when all of them are there.
        let nonce: u64 = rand::random();
        let pending: Vec<_> = (0..count)
            .map(|index| {
                let (endpoint, config) = (self.endpoint, self.config.handshake.clone());
                let timeout = self.config.handshake_timeout;
                let num_pages = self.layout.num_pages;
                let pool = self.pool.clone();
                let setup = TcpStreamSetup {
                    nonce,
                    index,
                    count,
                };
                self.tasks.spawn(async move {
                    connect_link_stream(
                        addr,
                        endpoint,
                        id,
                        config,
                        timeout,
                        transport,
                        num_pages,
                        setup,
                        Some(&pool),
                    )
                    .await
                })
            })
            .collect();
        // Stream connects still running when this future is dropped stop.
        let mut pending = AbortOnDrop(pending);
        let mut sockets = Vec::with_capacity(pending.0.len());
        let mut prefill = None;
        let mut source = None;
        let mut failed = None;
        for p in &mut pending.0 {
            match p.await {
                Ok(Ok(l)) => {
                    sockets.push(l.stream);
                    source = source.or(l.source);
                    prefill = Some(l.fingerprint);
                }
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(_) => failed = failed.or(Some(TransportError::Shutdown)),
            }
        }
        // What this prefill peer writes into our pool: whole spans with
        // equal TP sizes, its head slices otherwise.
        let link = match (failed, prefill) {
            (Some(e), _) => Err(e),
            (None, None) => Err(TransportError::Shutdown),
            (None, Some(prefill)) => LinkPlan::new(
                &prefill,
                &self.config.handshake.fingerprint,
                false,
                self.layout.geometry.kv_heads,
            )
            .map(|plan| NewLink {
                kind: transport,
                sockets,
                plan,
                tp: TpPosition::of(&prefill),
                source,
            })
            .map_err(TransportError::Config),
        };
        // Do not keep a control connection without its data link: an error
        // here returns with `abandon` armed.
        let link = link?;
        self.tx
            .send(Ev::Cmd(Cmd::AddLink(peer, link)))
            .map_err(|_| TransportError::Shutdown)?;
        // The control handshake runs concurrently; the driver answers once
        // it is up.
        let up = self.ask(|r| Cmd::AwaitControl(peer, r));
        match tokio::time::timeout(self.config.handshake_timeout, up).await {
            Ok(Ok(())) => {
                abandon.armed = false;
                Ok(peer)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransportError::Handshake(
                handoff_proto::HandshakeError::TimedOut(self.config.handshake_timeout),
            )),
        }
    }
}

/// Sends `Abandon(peer)` to the driver when dropped armed: a connect that
/// failed or was cancelled leaves no control connection or link behind.
struct AbandonOnDrop {
    tx: mpsc::UnboundedSender<Ev>,
    peer: PeerId,
    armed: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Ev::Cmd(Cmd::Abandon(self.peer)));
        }
    }
}

/// Aborts the tasks when dropped (a no-op for those that finished).
struct AbortOnDrop<T>(Vec<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}
