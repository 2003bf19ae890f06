//! Where a data-link segment may land in decode's pool (sans-IO, DESIGN.md
//! "No write after release"): the one check decode's link reader runs on
//! every segment, on every transport, before a byte of it is written. A
//! segment names a layer, a run of destination pages and, when the TP sizes
//! differ, one head slice of one block; it is placed only if the layer
//! exists, every page is one of the room's own, the range lies in the pool,
//! and a head slice is one the link's plan lets this prefill rank write.

use std::ops::Range;

use crate::datalink::SegmentHeader;
use crate::ids::PageIndex;
use crate::layout::{KvPart, PageLayout};
use crate::rank::PairPlan;

/// A room's pages as a bitmap: whether a run of pages is the room's is a
/// bit test per page, with no search however many pages the room holds
/// (the check runs on every segment, and a 4 KiB page is one segment).
/// Sized by the room's highest page, so at most a bit per pool page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoomPages {
    bits: Vec<u64>,
}

impl RoomPages {
    /// The set of `pages` (any order, repeats allowed).
    pub fn new(pages: &[u32]) -> Self {
        let words = pages.iter().max().map_or(0, |&m| m as usize / 64 + 1);
        let mut bits = vec![0u64; words];
        for &p in pages {
            bits[p as usize / 64] |= 1 << (p % 64);
        }
        Self { bits }
    }

    /// Whether page `p` is the room's.
    pub fn contains(&self, p: u32) -> bool {
        self.bits
            .get(p as usize / 64)
            .is_some_and(|w| w >> (p % 64) & 1 == 1)
    }

    /// Whether every page of `start..end` is the room's (true when empty).
    pub fn contains_run(&self, run: Range<u32>) -> bool {
        run.into_iter().all(|p| self.contains(p))
    }
}

/// The byte range of `pool` (decode's layout: its heads per block, its page
/// count) that segment `h` may write, or `None` to refuse it. `room_pages`
/// are the pages of `h`'s room (`None`: no such room on this link); `decode_heads` are the heads in each block of decode's pool as
/// the link's `plan` counts them; `pool_len` is the pool region's length.
pub fn place(
    pool: &PageLayout,
    decode_heads: u32,
    plan: &PairPlan,
    room_pages: Option<&RoomPages>,
    h: &SegmentHeader,
    pool_len: usize,
) -> Option<Range<usize>> {
    let pages = room_pages?;
    let end = h.dst_page.checked_add(h.n_pages)?;
    let ok = h.layer < pool.layers && end <= pool.num_pages && pages.contains_run(h.dst_page..end);
    if !ok {
        return None;
    }
    let range = match (h.heads, plan) {
        (None, PairPlan::Whole) => {
            let span = 2 * pool.block_bytes();
            let start = pool
                .block_offset(h.layer, PageIndex(h.dst_page), KvPart::K)
                .ok()?;
            start..start.checked_add((h.n_pages as usize).checked_mul(span)?)?
        }
        (None, PairPlan::Sliced(_)) => return None,
        (Some(s), _) => {
            let heads = s.first..s.first.checked_add(s.count)?;
            if !plan.allows_dst_heads(heads, decode_heads) {
                return None;
            }
            let sliced = PageLayout {
                local_heads: decode_heads,
                ..*pool
            };
            sliced
                .head_range(h.layer, PageIndex(h.dst_page), s.part, s.first, s.count)
                .ok()?
        }
    };
    (!range.is_empty() && range.end <= pool_len).then_some(range)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalink::HeadSlice;
    use crate::ids::{RankId, RoomId};
    use crate::rank::SliceTransfer;

    fn pool() -> PageLayout {
        PageLayout {
            layers: 3,
            local_heads: 2,
            page_size: 4,
            head_dim: 8,
            dtype_bytes: 2,
            num_pages: 10,
        }
    }

    fn seg(layer: u32, dst_page: u32, n_pages: u32, heads: Option<HeadSlice>) -> SegmentHeader {
        SegmentHeader {
            room: RoomId::new(1).unwrap(),
            layer,
            dst_page,
            n_pages,
            heads,
        }
    }

    #[test]
    fn room_pages_hold_exactly_their_pages() {
        let r = RoomPages::new(&[130, 0, 63, 64, 64]);
        let held: Vec<u32> = (0..200).filter(|&p| r.contains(p)).collect();
        assert_eq!(held, [0, 63, 64, 130]);
        assert!(r.contains_run(63..65));
        assert!(!r.contains_run(63..66));
        assert!(r.contains_run(5..5), "an empty run");
        assert!(!r.contains(u32::MAX));
        assert!(!RoomPages::new(&[]).contains(0));
    }

    #[test]
    fn whole_spans_land_on_the_rooms_pages_only() {
        let p = pool();
        let len = p.pool_bytes().unwrap();
        let room = RoomPages::new(&[8, 2, 3, 4]);
        let span = 2 * p.block_bytes();
        let at = |layer, page| p.block_offset(layer, PageIndex(page), KvPart::K).unwrap();
        let place = |h| place(&p, 2, &PairPlan::Whole, Some(&room), &h, len);
        assert_eq!(
            place(seg(1, 2, 3, None)),
            Some(at(1, 2)..at(1, 2) + 3 * span)
        );
        assert_eq!(place(seg(2, 8, 1, None)), Some(at(2, 8)..at(2, 8) + span));
        for bad in [
            seg(1, 4, 2, None),        // page 5 is not the room's
            seg(3, 2, 1, None),        // no layer 3
            seg(0, 8, u32::MAX, None), // overflowing run
            seg(0, 2, 0, None),        // nothing
            seg(0, 9, 1, None),        // not the room's
        ] {
            assert_eq!(place(bad), None, "{bad:?}");
        }
        assert_eq!(
            super::place(&p, 2, &PairPlan::Whole, None, &seg(1, 2, 1, None), len),
            None,
            "an unknown room"
        );
        assert_eq!(
            super::place(
                &p,
                2,
                &PairPlan::Whole,
                Some(&RoomPages::new(&[9])),
                &seg(2, 9, 1, None),
                len - 1
            ),
            None,
            "past the region"
        );
        let last = super::place(
            &p,
            2,
            &PairPlan::Whole,
            Some(&RoomPages::new(&[9])),
            &seg(2, 9, 1, None),
            len,
        );
        assert_eq!(last.map(|r| r.end), Some(len), "the pool's last span");
    }

    #[test]
    fn head_slices_land_only_where_the_plan_allows() {
        let p = pool();
        let len = p.pool_bytes().unwrap();
        let plan = PairPlan::Sliced(vec![SliceTransfer {
            prefill_rank: RankId(0),
            decode_rank: RankId(0),
            heads: 1..2,
            src_head_offset: 1,
            dst_head_offset: 1,
        }]);
        let slice = |first, count| {
            Some(HeadSlice {
                part: KvPart::V,
                first,
                count,
            })
        };
        let room = RoomPages::new(&[5]);
        let place = |h| place(&p, 2, &plan, Some(&room), &h, len);
        let want = p.head_range(0, PageIndex(5), KvPart::V, 1, 1).unwrap();
        assert_eq!(place(seg(0, 5, 1, slice(1, 1))), Some(want));
        for bad in [
            seg(0, 5, 1, slice(0, 1)),        // head 0 comes from another rank
            seg(0, 5, 1, slice(1, 2)),        // past the local heads
            seg(0, 5, 1, slice(u32::MAX, 1)), // overflow
            seg(0, 5, 1, None),               // a whole span on a sliced link
            seg(0, 4, 1, slice(1, 1)),        // not the room's page
        ] {
            assert_eq!(place(bad), None, "{bad:?}");
        }
    }
}
