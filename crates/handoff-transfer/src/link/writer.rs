//! Prefill's side of a link: the writer task that runs the driver's jobs
//! on the transport, and the task that reads decode's acks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use handoff_proto::datalink::{Ack, AuxData, Record, ACK_LEN};
use handoff_proto::{PeerId, RoomId};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::mpsc;

use super::setup::{AcceptedLink, LinkWriter};
use super::socket::{read_once, read_past_readiness};
use crate::error::TransportError;
use crate::segment::Segment;
use crate::transport::Transport;

/// Work for a prefill link writer.
#[derive(Debug)]
pub enum LinkJob {
    /// Write these segments of `room`.
    Segments {
        /// The room.
        room: RoomId,
        /// What to write.
        segs: Vec<Segment>,
        /// Set when the room's writes are cancelled.
        cancel: Arc<AtomicBool>,
    },
    /// No more segments: write the aux record (unless cancelled) and the end.
    Finish {
        /// The room.
        room: RoomId,
        /// Aux slot and data.
        aux: Option<(u32, AuxData)>,
        /// The room's prompt scores (flat pairs), sent ahead of the aux.
        prompt: Arc<[(u32, f32)]>,
        /// Set when the room's writes are cancelled.
        cancel: Arc<AtomicBool>,
    },
}

/// What prefill link tasks report to the driver.
#[derive(Debug)]
pub enum LinkEvent {
    /// Decode acknowledged everything of `room` up to its end.
    Acked {
        /// Decode peer.
        peer: PeerId,
        /// Link generation.
        link: u64,
        /// The ack.
        ack: Ack,
    },
    /// The link broke.
    Closed {
        /// Decode peer.
        peer: PeerId,
        /// Link generation.
        link: u64,
        /// Why.
        reason: String,
    },
}

/// Most queued jobs a writer takes in one go.
const WRITER_BATCH: usize = 64;

/// The aux (unless cancelled) and end records that close `room`.
fn finish_records(
    room: RoomId,
    aux: Option<(u32, AuxData)>,
    prompt: &[(u32, f32)],
    cancel: &AtomicBool,
) -> Vec<Record> {
    let cancelled = cancel.load(Ordering::Acquire);
    let mut recs = Vec::with_capacity(2);
    if let (false, Some((aux_slot, aux))) = (cancelled, aux) {
        recs.extend(aux.top.records(room, aux_slot));
        recs.extend(handoff_proto::datalink::prompt_records(room, prompt));
        recs.push(Record::Aux {
            room,
            aux_slot,
            written_room: room.get(),
            aux,
        });
    }
    recs.push(Record::End { room, cancelled });
    recs
}

/// Run a link's jobs in order. Jobs already queued are taken together: a
/// room's consecutive segment jobs become one write, and a room's finish
/// right behind them rides in the same write (one `writev` for a small
/// room, rather than one per job).
pub(super) async fn run_writer<T: Transport>(
    mut t: T,
    mut jobs: mpsc::UnboundedReceiver<LinkJob>,
    ended: &tokio::sync::Notify,
) -> Result<(), TransportError> {
    let mut queued = Vec::with_capacity(WRITER_BATCH);
    while jobs.recv_many(&mut queued, WRITER_BATCH).await > 0 {
        let mut it = queued.drain(..).peekable();
        while let Some(job) = it.next() {
            match job {
                LinkJob::Segments {
                    room,
                    mut segs,
                    cancel,
                } => {
                    while let Some(LinkJob::Segments { room: r, .. }) = it.peek() {
                        if *r != room {
                            break;
                        }
                        if let Some(LinkJob::Segments { segs: more, .. }) = it.next() {
                            segs.extend(more);
                        }
                    }
                    if cancel.load(Ordering::Acquire) {
                        continue;
                    }
                    let trailer = match it.peek() {
                        Some(LinkJob::Finish { room: r, .. }) if *r == room => match it.next() {
                            Some(LinkJob::Finish {
                                aux,
                                prompt,
                                cancel,
                                ..
                            }) => finish_records(room, aux, &prompt, &cancel),
                            _ => Vec::new(),
                        },
                        _ => Vec::new(),
                    };
                    let complete = t.write_segments(&segs, &trailer, &cancel).await?;
                    if !complete && !trailer.is_empty() {
                        // Cancelled mid-write: the room still needs its end.
                        t.write_records(&[Record::End {
                            room,
                            cancelled: true,
                        }])
                        .await?;
                    }
                    if !trailer.is_empty() {
                        ended.notify_one();
                    }
                }
                LinkJob::Finish {
                    room,
                    aux,
                    prompt,
                    cancel,
                } => {
                    t.write_records(&finish_records(room, aux, &prompt, &cancel))
                        .await?;
                    ended.notify_one();
                }
            }
        }
    }
    Ok(())
}

impl AcceptedLink {
    /// Spawn the writer and ack tasks; events go through `send`. Call once
    /// the link is registered: the writer first tells decode the setup
    /// succeeded.
    pub fn spawn<F>(
        self,
        link: u64,
        tasks: &crate::conn::TaskCounter,
        send: F,
    ) -> mpsc::UnboundedSender<LinkJob>
    where
        F: Fn(LinkEvent) -> bool + Send + Sync + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let peer = self.peer;
        let send = Arc::new(send);
        let s1 = send.clone();
        let ended = Arc::new(tokio::sync::Notify::new());
        let ended2 = ended.clone();
        tasks.spawn(async move {
            let r = match self.writer.confirm().await {
                Ok(LinkWriter::Shm(t)) => run_writer(t, rx, &ended2).await,
                Ok(LinkWriter::Tcp(t)) => run_writer(t, rx, &ended2).await,
                // The registration lives as long as the writer: decode
                // READs our pool only while the link is up.
                Ok(LinkWriter::Nixl(t, _offer)) => run_writer(t, rx, &ended2).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                s1(LinkEvent::Closed {
                    peer,
                    link,
                    reason: e.to_string(),
                });
            }
        });
        let acks = self.acks;
        tasks.spawn(async move {
            let deliver = |ack| send(LinkEvent::Acked { peer, link, ack });
            if let Some(reason) = read_acks(acks, ended, deliver).await {
                send(LinkEvent::Closed { peer, link, reason });
            }
        });
        tx
    }
}

/// Acks taken in one read at most.
const ACK_BATCH: usize = 256;

/// Prefill side: read decode's acks on `r` as they come (as many as arrived
/// per read) and hand each to `deliver`, until the link closes (the reason)
/// or `deliver` refuses one (the driver is gone: `None`). After delivering,
/// the task yields once before it reads again, so the driver completes the
/// acked rooms and their waiters run first. A short read clears readiness
/// ([`read_once`]), so the next wait needs no read that could only say
/// `EAGAIN`.
///
/// `ended` is signalled by the writer each time a room's end went out. The
/// task then reads at once, past tokio's readiness cache: when decode runs
/// on the same CPU its ack is usually in the socket before the writer's
/// `writev` even returned, and waiting for the runtime's next `epoll_wait`
/// to report it costs a whole extra turn of the I/O driver. If nothing is
/// there yet the read says `WouldBlock` and the task waits as before.
pub(super) async fn read_acks<F>(
    r: OwnedReadHalf,
    ended: Arc<tokio::sync::Notify>,
    deliver: F,
) -> Option<String>
where
    F: Fn(Ack) -> bool,
{
    let mut buf = [0u8; ACK_LEN * ACK_BATCH];
    let mut len = 0usize;
    loop {
        let direct = tokio::select! {
            biased;
            r = r.readable() => match r {
                Ok(()) => false,
                Err(e) => return Some(format!("link closed: {e}")),
            },
            () = ended.notified() => true,
        };
        let got = if direct {
            read_past_readiness(r.as_ref(), &mut [std::io::IoSliceMut::new(&mut buf[len..])])
        } else {
            read_once(r.as_ref(), &mut buf[len..])
        };
        match got {
            Ok(0) => return Some("link closed: end of stream".into()),
            Ok(n) => len += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Some(format!("link closed: {e}")),
        }
        let whole = len - len % ACK_LEN;
        for b in buf[..whole].chunks_exact(ACK_LEN) {
            let mut one = [0u8; ACK_LEN];
            one.copy_from_slice(b);
            match Ack::decode(&one) {
                Ok(ack) => {
                    if !deliver(ack) {
                        return None;
                    }
                }
                Err(e) => return Some(e.to_string()),
            }
        }
        buf.copy_within(whole..len, 0);
        len -= whole;
        if whole > 0 {
            tokio::task::yield_now().await;
        }
    }
}
