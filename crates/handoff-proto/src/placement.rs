//! Where a data-link segment may land in decode's pool (sans-IO, DESIGN.md
//! "No write after release"): the one check decode's link reader runs on
//! every segment, on every transport, before a byte of it is written. A
//! segment names a layer, a run of destination pages and, when the TP sizes
//! differ, one head slice of one block; it is placed only if the layer
//! exists, every page is one of the room's own, the range lies in the pool,
//! and a head slice is one the link's plan lets this prefill rank write.

use std::ops::Range;

use crate::datalink::{PullRef, SegmentHeader};
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

/// A prefill pool as decode's shm pulls see it: `layers` layers of `pages`
/// pages, its KV bytes `0..kv_end` (layer-major, then page, K before V, at
/// the prefill's own head count, padded to 8 bytes at the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceShape {
    /// Layers (the model's, the same on both sides).
    pub layers: u32,
    /// The prefill pool's pages.
    pub pages: u32,
    /// End of its KV bytes.
    pub kv_end: usize,
}

impl SourceShape {
    /// Bytes of one (layer, page) in the source pool, or `None` when the
    /// shape does not describe a pool (no pages, or KV bytes that are not
    /// a whole number of (layer, page) spans).
    fn span(&self) -> Option<usize> {
        let n = (self.layers as usize).checked_mul(self.pages as usize)?;
        if n == 0 {
            return None;
        }
        let per = self.kv_end / n;
        (per.checked_mul(n)?.next_multiple_of(8) == self.kv_end).then_some(per)
    }

    /// Where a pull of `len` bytes for a segment of `layer` may read: its
    /// `src_offset` when `src_offset..+len` lies in `layer`'s blocks of the
    /// pages `src_page..src_page + src_pages` it names (the pages whose
    /// generations decode checks after the copy), else `None`. A pull that
    /// names one page and reads another could copy a page reused under it.
    pub fn pull_source(&self, layer: u32, pull: &PullRef, len: usize) -> Option<usize> {
        let per = self.span()?;
        let end_page = pull.src_page.checked_add(pull.src_pages)?;
        if layer >= self.layers || end_page > self.pages {
            return None;
        }
        let at = |page: u32| (layer as usize * self.pages as usize + page as usize) * per;
        let o = usize::try_from(pull.src_offset).ok()?;
        let end = o.checked_add(len)?;
        (at(pull.src_page) <= o && end <= at(end_page)).then_some(o)
    }
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
    fn a_pull_reads_only_its_layers_blocks_of_the_pages_it_names() {
        // 2 layers of 4 pages, 100 bytes a (layer, page), padded to 8.
        let s = SourceShape {
            layers: 2,
            pages: 4,
            kv_end: 800,
        };
        let pull = |src_offset, src_page, src_pages| PullRef {
            src_offset,
            src_page,
            src_pages,
            epoch: 1,
        };
        // Layer 1, pages 2..4: bytes 600..800.
        assert_eq!(s.pull_source(1, &pull(600, 2, 2), 200), Some(600));
        assert_eq!(s.pull_source(1, &pull(650, 2, 2), 100), Some(650));
        for (what, layer, p, len) in [
            ("past its pages", 1, pull(650, 2, 2), 200),
            ("before its pages", 1, pull(500, 2, 2), 100),
            ("another layer's bytes", 0, pull(600, 2, 2), 100),
            ("no such layer", 2, pull(600, 2, 2), 100),
            ("pages past the pool", 1, pull(600, 3, 2), 100),
            ("an overflowing page run", 1, pull(600, u32::MAX, 2), 100),
            ("an overflowing range", 1, pull(u64::MAX, 2, 2), 100),
        ] {
            assert_eq!(s.pull_source(layer, &p, len), None, "{what}");
        }
        let odd = SourceShape { kv_end: 803, ..s };
        assert_eq!(
            odd.pull_source(1, &pull(600, 2, 2), 100),
            None,
            "not a pool"
        );
        let empty = SourceShape { pages: 0, ..s };
        assert_eq!(empty.pull_source(0, &pull(0, 0, 0), 0), None, "no pages");
    }

    proptest::proptest! {
        /// Whatever a hostile prefill names, an accepted pull reads only
        /// bytes of the named layer and pages, inside the KV bytes.
        #[test]
        fn an_accepted_pull_stays_in_its_named_blocks(
            layers in 1u32..4, pages in 1u32..6, per in 1usize..5,
            layer in 0u32..5, src_page in 0u32..8, src_pages in 0u32..8,
            off in 0u64..200, len in 0usize..64,
        ) {
            let per = per * 8;
            let s = SourceShape { layers, pages, kv_end: per * (layers * pages) as usize };
            let p = PullRef { src_offset: off, src_page, src_pages, epoch: 0 };
            if let Some(o) = s.pull_source(layer, &p, len) {
                let base = (layer * pages) as usize * per;
                proptest::prop_assert!(layer < layers && src_page + src_pages <= pages);
                proptest::prop_assert!(o >= base + src_page as usize * per);
                proptest::prop_assert!(o + len <= base + (src_page + src_pages) as usize * per);
                proptest::prop_assert!(o + len <= s.kv_end);
            }
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
