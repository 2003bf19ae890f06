//! What decode's link reader does with the records it read: segments
//! placed (or, over shm, pulled in batches), aux records joined to their
//! room, ends acknowledged. The rules are `handoff-proto`'s
//! (`placement::place`, `SourceShape::pull_source`, `RoomLanding`).

use std::sync::atomic::Ordering;

use handoff_proto::datalink::{Ack, PullRef, Record, RECORD_LEN};
use handoff_proto::RoomId;

use handoff_proto::landing::{prompt_pairs_cap, RoomLanding};

use super::{LinkReader, Pull, ReadState, NIXL_BATCH_BYTES, NIXL_PULL_BATCH, PULL_BATCH};
use crate::link::error::LinkReadError;
use crate::link::reader_api::ReaderEvent;
use crate::link::source::PullSource;
use crate::link::span::page_span;
use crate::transport::TransportKind;

impl LinkReader {
    /// Act on every complete record and payload byte in the staging buffer.
    /// Over shm, the pulls it gathers are all copied and checked before it
    /// returns.
    pub(super) fn drain_staging(&mut self) -> Result<(), LinkReadError> {
        let r = self.drain_records();
        self.run_pulls();
        match self.failed.take() {
            Some(e) => Err(e),
            None => r,
        }
    }

    fn drain_records(&mut self) -> Result<(), LinkReadError> {
        while self.pos < self.len {
            match &self.state {
                ReadState::Header => {
                    if self.len - self.pos < RECORD_LEN {
                        return Ok(());
                    }
                    let mut h = [0u8; RECORD_LEN];
                    h.copy_from_slice(&self.buf[self.pos..self.pos + RECORD_LEN]);
                    self.pos += RECORD_LEN;
                    let rec = Record::decode(&h)?;
                    // A room's aux and end act on what its pulls did.
                    if !matches!(rec, Record::Segment(_)) {
                        self.run_pulls();
                    }
                    self.record(rec)?;
                }
                ReadState::Pull { room, layer, dst } => {
                    if self.len - self.pos < PullRef::LEN {
                        return Ok(());
                    }
                    let (room, layer, dst) = (*room, *layer, dst.clone());
                    let mut b = [0u8; PullRef::LEN];
                    b.copy_from_slice(&self.buf[self.pos..self.pos + PullRef::LEN]);
                    self.pos += PullRef::LEN;
                    self.state = ReadState::Header;
                    let pull = PullRef::decode(&b)?;
                    if let Some(dst) = dst {
                        self.pull(room, layer, dst, pull);
                    }
                }
                ReadState::Payload {
                    dst, filled, keep, ..
                } => {
                    let n = (dst.len() - filled).min(self.len - self.pos);
                    if *keep {
                        self.pool
                            .write_at(dst.start + filled, &self.buf[self.pos..self.pos + n])?;
                    }
                    self.pos += n;
                    self.advance_payload(n);
                }
            }
        }
        Ok(())
    }

    fn record(&mut self, rec: Record) -> Result<(), LinkReadError> {
        match rec {
            Record::Segment(h) => {
                let head_bytes = self.layout.page_layout().head_bytes();
                let len = h
                    .payload_len(page_span(&self.layout), head_bytes)
                    .filter(|l| *l <= self.pool.len())
                    .ok_or(LinkReadError::SegmentTooLarge {
                        n_pages: h.n_pages,
                        heads: h.heads,
                    })?;
                let place = self.place(&h);
                if self.kind.pulls() {
                    // The bytes stay in prefill's pool until we pull them.
                    self.last_payload = PullRef::LEN;
                    self.state = ReadState::Pull {
                        room: h.room,
                        layer: h.layer,
                        dst: place,
                    };
                    return Ok(());
                }
                self.last_payload = len;
                let (dst, keep) = match place {
                    Some(r) => (r, true),
                    None => (0..len, false),
                };
                if !dst.is_empty() {
                    self.state = ReadState::Payload {
                        room: h.room,
                        dst,
                        filled: 0,
                        keep,
                    };
                }
            }
            Record::AuxTop {
                room,
                aux_slot,
                index,
                pairs,
                count,
            } => {
                if let Some(l) = self.landing(room) {
                    l.on_aux_top(aux_slot, index, &pairs[..usize::from(count)]);
                }
            }
            Record::AuxPrompt {
                room,
                index,
                pairs,
                count,
            } => {
                // Bounded by what the whole pool holds, so a peer cannot
                // make a room's list grow past it.
                let cap = prompt_pairs_cap(self.layout.num_pages * self.layout.geometry.page_size);
                if let Some(l) = self.landing(room) {
                    l.on_aux_prompt(index, &pairs[..usize::from(count)], cap);
                }
            }
            Record::Aux {
                room,
                aux_slot,
                written_room,
                aux,
            } => {
                if let Some(landed) = self
                    .landing(room)
                    .and_then(|l| l.on_aux(aux_slot, written_room, aux))
                {
                    self.events.push(ReaderEvent::Aux {
                        room,
                        written_room: landed.written_room,
                        aux: landed.aux,
                        prompt: landed.prompt,
                    });
                }
            }
            Record::End { room, .. } => {
                #[cfg(feature = "nixl")]
                self.check_nixl_stamps(room);
                // Nothing more lands for this room through this link, and
                // its writer guard goes before the ack does: once prefill
                // reports the room's success, no link holds its pages (the
                // decode engine may hand them to its prefix cache).
                let ok = self.rooms.remove(&room).is_some_and(|s| s.landing.end());
                self.acks.extend_from_slice(&Ack { room, ok }.encode());
            }
        }
        Ok(())
    }
}

impl LinkReader {
    /// The landing state of `room`, or `None` (counted as a refused record)
    /// for a room this link does not know.
    fn landing(&mut self, room: RoomId) -> Option<&mut RoomLanding> {
        match self.rooms.get_mut(&room) {
            Some(slot) => Some(&mut slot.landing),
            None => {
                self.counters
                    .rejected_segments
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Over shm: check a segment's pull and queue it for copying out of the
    /// prefill's pool into `dst` (our room's pages). A source range outside
    /// the layer's blocks of the pages it names rejects the room (its end
    /// is then acknowledged as failed).
    fn pull(&mut self, room: RoomId, layer: u32, dst: std::ops::Range<usize>, r: PullRef) {
        let layers = self.layout.page_layout().layers;
        let len = dst.len();
        // The bytes must lie in this layer's blocks of the pages whose
        // generations are checked after the copy.
        let src = self
            .source
            .as_ref()
            .and_then(|src| src.shape(layers).pull_source(layer, &r, len));
        match src {
            Some(src) => {
                self.pulls.push(Pull {
                    room,
                    dst: dst.start,
                    src,
                    len,
                    pages: r.pages(),
                    epoch: r.epoch,
                    copied: false,
                });
                self.pulled += len;
                let full = match self.kind {
                    TransportKind::Nixl => {
                        self.pulls.len() == NIXL_PULL_BATCH || self.pulled >= NIXL_BATCH_BYTES
                    }
                    _ => self.pulls.len() == PULL_BATCH,
                };
                if full {
                    self.run_pulls();
                }
            }
            None => self.reject(room),
        }
    }

    /// Copy the queued pulls back to back, then keep each only if none of
    /// its source pages was handed out again since its segment was built
    /// (seqlock style: every check follows every copy; checking later only
    /// rejects more). A changed page rejects its room.
    fn run_pulls(&mut self) {
        self.pulled = 0;
        // `pull` queues nothing without a source.
        let src = match self.source.clone() {
            None => return,
            Some(PullSource::Mapped(src)) => src,
            #[cfg(feature = "nixl")]
            Some(PullSource::Nixl(src)) => return self.run_nixl_pulls(&src),
        };
        let mut pulls = std::mem::take(&mut self.pulls);
        for p in &mut pulls {
            p.copied = self
                .pool
                .copy_from(p.dst, &src.region, p.src, p.len)
                .is_ok();
        }
        for p in pulls.drain(..) {
            if p.copied && src.gens.unchanged_since(p.pages, p.epoch) == Some(true) {
                self.landed += p.len as u64;
            } else {
                self.reject(p.room);
            }
        }
        self.pulls = pulls;
    }
}

/// How long decode waits for one batch's READ before it gives the batch
/// up: its rooms fail, and their pages stay held (with the READ) until the
/// READ ends ([`LinkReader::quarantine`]).
#[cfg(feature = "nixl")]
const NIXL_STALL: std::time::Duration = std::time::Duration::from_secs(2);

#[cfg(feature = "nixl")]
impl LinkReader {
    /// [`Self::run_pulls`] over NIXL: one READ for the batch. Its pages'
    /// stamps are checked at each room's end ([`Self::check_nixl_stamps`]):
    /// one round trip per room rather than one per batch.
    fn run_nixl_pulls(&mut self, src: &crate::nixl::NixlSource) {
        let mut pulls = std::mem::take(&mut self.pulls);
        let pieces = pulls.iter().map(|p| (p.dst, p.src, p.len));
        match src.read(pieces, NIXL_STALL) {
            Ok(()) => {
                for p in &pulls {
                    self.landed += p.len as u64;
                    if let Some(slot) = self.rooms.get_mut(&p.room) {
                        slot.unchecked.push((p.pages.clone(), p.epoch));
                    }
                }
            }
            Err(crate::nixl::PullError::Stalled(read)) => {
                self.quarantine(read, pulls.iter().map(|p| p.room))
            }
            // Nothing in flight; the link cannot move KV: it closes with
            // NIXL's own error, and its rooms fail with it.
            Err(crate::nixl::PullError::Failed(e)) => {
                for p in &pulls {
                    self.reject(p.room);
                }
                self.failed
                    .get_or_insert(LinkReadError::Nixl(e.to_string()));
            }
        }
        pulls.clear();
        self.pulls = pulls;
    }

    /// At `room`'s end, over NIXL: keep its bytes only if none of their
    /// source pages was handed out again after its segment's epoch.
    pub(super) fn check_nixl_stamps(&mut self, room: RoomId) {
        let Some(PullSource::Nixl(src)) = self.source.clone() else {
            return;
        };
        let Some(slot) = self.rooms.get_mut(&room) else {
            return;
        };
        let checks = std::mem::take(&mut slot.unchecked);
        // (A stamps READ that stalls answers `false`: it writes only a
        // buffer of the source's, never the room's pages.)
        let keep = match src.unchanged(&checks, NIXL_STALL) {
            Ok(keep) => keep,
            Err(e) => {
                self.failed
                    .get_or_insert(LinkReadError::Nixl(e.to_string()));
                false
            }
        };
        if !keep {
            self.reject(room);
        }
    }

    /// A READ that did not end in time: fail its rooms and keep their
    /// pages (the writer guards) with the READ until it ends, however long
    /// that is. Nothing of theirs is written by this reader again.
    fn quarantine(
        &mut self,
        mut read: crate::nixl::Transfer,
        rooms: impl Iterator<Item = handoff_proto::RoomId>,
    ) {
        let mut held = Vec::new();
        for room in rooms {
            self.reject(room);
            if let Some(slot) = self.rooms.remove(&room) {
                held.push(slot);
            }
        }
        self.counters.stalled_reads.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            rooms = held.len(),
            "a NIXL READ did not end within {NIXL_STALL:?}: its rooms fail, their pages stay held until it ends"
        );
        tokio::spawn(async move {
            while matches!(read.poll(), Ok(false)) {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            drop(held);
        });
    }
}
