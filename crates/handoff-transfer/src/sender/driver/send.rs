//! The send path: a room's layers and pages as segments on each of its
//! destinations' links.

use std::ops::Range;
use std::sync::atomic::Ordering;

use handoff_kv::PageIndex;
use handoff_proto::rank::PairPlan;
use handoff_proto::sender_endpoint::SendRefused;
use handoff_proto::{RoomId, TransferError};

use super::super::segments::build_segments;
use super::{now, Driver};
use crate::link::{page_span, LinkJob};
use crate::plan::build_sliced_segments;

impl Driver {
    /// Check the source pages, let the endpoint check the room and its
    /// destinations, then queue each destination's segments on its link.
    pub(super) fn send(
        &mut self,
        room: RoomId,
        layers: Range<usize>,
        pages: Range<usize>,
        src: &[PageIndex],
    ) -> Result<(), TransferError> {
        // Only the pages this call sends are checked: a room streamed in
        // many calls costs O(pages sent), not O(room) per call.
        let sent = src.get(pages.clone());
        if sent.is_none_or(|s| s.iter().any(|p| p.0 as usize >= self.layout.num_pages)) {
            return Err(SendRefused::OutOfRange { layers, pages }.into());
        }
        let (dests, cancel) = self
            .endpoint
            .send(room, layers.clone(), pages.clone(), now())?;
        let span = page_span(&self.layout);
        let max_run = (self.config.max_segment_bytes / span).max(1);
        for w in dests {
            let (peer, d, dest_pages) = (w.peer, w.destination, w.dest_pool_pages);
            let Some(link) = self.links.get(&peer) else {
                continue; // the endpoint knows of no link either
            };
            // Room page `i` goes to destination page `i - skip`.
            let (src, pages) = (&src[w.skip..], w.pages.start - w.skip..w.pages.end - w.skip);
            let segs = match &link.plan.pair {
                PairPlan::Whole => build_segments(
                    room,
                    &self.layout,
                    dest_pages,
                    layers.clone(),
                    pages,
                    src,
                    &d.pages,
                    max_run,
                ),
                PairPlan::Sliced(slices) => match build_sliced_segments(
                    room,
                    slices,
                    &self.layout,
                    link.plan.decode_heads,
                    dest_pages,
                    layers.clone(),
                    pages,
                    src,
                    &d.pages,
                ) {
                    Ok(segs) => segs,
                    Err(e) => {
                        let err = TransferError::Internal {
                            reason: format!("head-sliced segments: {e}"),
                        };
                        self.endpoint.handle_write_failed(room, peer, err, now());
                        continue;
                    }
                },
            };
            let bytes: usize = segs.iter().map(|s| s.src.len()).sum();
            self.counters
                .kv_bytes_sent
                .fetch_add(bytes as u64, Ordering::Relaxed);
            let _ = link.tx(room).send(LinkJob::Segments {
                room,
                segs,
                cancel: cancel.clone(),
            });
        }
        Ok(())
    }
}
