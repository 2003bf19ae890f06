//! What one data link carries when prefill and decode TP sizes differ:
//! the shell side of
//! [`handoff_proto::rank`]. A link's [`LinkPlan`] is fixed at link setup
//! from both ends' handshake fingerprints; the prefill side builds its
//! segments from it and the decode side checks every incoming header
//! against it.
//!
//! With equal TP sizes the plan is [`PairPlan::Whole`] and links move whole
//! (layer, page) spans coalesced over contiguous pages, exactly as before.
//! Otherwise each (layer, page, K|V) block moves as one head-sliced segment
//! per slice: the source and destination blocks hold different head counts,
//! so nothing is contiguous across blocks on both sides.

use std::ops::Range;

use handoff_kv::{KvLayout, PageIndex};
use handoff_proto::handshake::Fingerprint;
use handoff_proto::layout::KvPart;
use handoff_proto::rank::{PairPlan, RankError, RankMap, SliceTransfer};
use handoff_proto::{RankId, RoomId};

use crate::segment::Segment;
use handoff_proto::datalink::{HeadSlice, SegmentHeader};

/// Why no plan fits a link: the error names the setting that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The two ends' TP sizes and head count admit no rank mapping.
    #[error("rank mapping: {0}")]
    RankMap(#[from] RankError),
    /// A pool's blocks do not hold this rank's share of the heads.
    #[error("the {side} pool holds {local_heads} KV heads per block, but TP size {tp} over {kv_heads} KV heads gives each rank {per_rank}")]
    NotOurShare {
        /// `prefill` or `decode`: whose pool.
        side: &'static str,
        /// KV heads per block in that pool.
        local_heads: usize,
        /// That side's TP size.
        tp: u32,
        /// The model's KV heads.
        kv_heads: u32,
        /// The share each rank should hold.
        per_rank: u32,
    },
}

/// What a link between one prefill rank and one decode rank moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkPlan {
    /// Whole spans, or these head slices.
    pub pair: PairPlan,
    /// KV heads in each block of the decode rank's pool.
    pub decode_heads: u32,
}

impl LinkPlan {
    /// The plan of a link between `prefill` and `decode` (their handshake
    /// fingerprints, already checked compatible). `local_heads` is the
    /// heads per block of the pool on *our* side (`our_side_is_prefill`
    /// says which): it must be that rank's share of the model's heads. The
    /// error says which setting is wrong.
    pub fn new(
        prefill: &Fingerprint,
        decode: &Fingerprint,
        our_side_is_prefill: bool,
        local_heads: usize,
    ) -> Result<LinkPlan, PlanError> {
        let map = RankMap::new(prefill.kv_heads, prefill.tp_size, decode.tp_size)?;
        let (side, ours) = if our_side_is_prefill {
            ("prefill", &map.prefill)
        } else {
            ("decode", &map.decode)
        };
        if local_heads != ours.heads_per_rank as usize {
            return Err(PlanError::NotOurShare {
                side,
                local_heads,
                tp: ours.tp,
                kv_heads: ours.kv_heads,
                per_rank: ours.heads_per_rank,
            });
        }
        let pair = map.pair_plan(RankId(prefill.tp_rank), RankId(decode.tp_rank))?;
        Ok(LinkPlan {
            pair,
            decode_heads: map.decode.heads_per_rank,
        })
    }

    /// True when the link moves whole (layer, page) spans.
    pub fn is_whole(&self) -> bool {
        self.pair == PairPlan::Whole
    }

    /// Bytes of one page of the decode rank's pool over all layers, K and
    /// V (`layout` is either side's: only its head count differs).
    pub fn decode_page_bytes(&self, layout: &KvLayout) -> usize {
        layout
            .geometry
            .page_layout(self.decode_heads as usize, 1)
            .map_or(usize::MAX, |l| l.page_bytes())
    }
}

/// One head-sliced segment per (layer, room page, K|V, slice): room pages
/// `pages` (indices into `src` and `dst`) of `layers`, read from our pool
/// (`layout`) and written into the decode pool (`decode_heads` heads per
/// block, `dest_pages` pages). Every range is bounds-checked against its
/// own pool; the first that is not fails the whole build.
#[allow(clippy::too_many_arguments)]
pub fn build_sliced_segments(
    room: RoomId,
    slices: &[SliceTransfer],
    layout: &KvLayout,
    decode_heads: u32,
    dest_pages: usize,
    layers: Range<usize>,
    pages: Range<usize>,
    src: &[PageIndex],
    dst: &[handoff_proto::PageIndex],
) -> Result<Vec<Segment>, RankError> {
    const TOO_BIG: RankError = RankError::OutOfRange { what: "pool size" };
    let src_heads = u32::try_from(layout.geometry.kv_heads).map_err(|_| TOO_BIG)?;
    let g = &layout.geometry;
    let src_layout = g
        .page_layout(src_heads as usize, layout.num_pages)
        .ok_or(TOO_BIG)?;
    let dst_layout = g
        .page_layout(decode_heads as usize, dest_pages)
        .ok_or(TOO_BIG)?;
    let mut out = Vec::with_capacity(layers.len() * pages.len() * 2 * slices.len());
    for layer in layers {
        let layer = u32::try_from(layer).map_err(|_| RankError::OutOfRange { what: "layer" })?;
        for i in pages.clone() {
            let (Some(s), Some(d)) = (src.get(i), dst.get(i)) else {
                return Err(RankError::OutOfRange { what: "page" });
            };
            let (s, d) = (handoff_proto::PageIndex(s.0), *d);
            for part in [KvPart::K, KvPart::V] {
                for slice in slices {
                    let n = slice.num_heads();
                    out.push(Segment {
                        header: SegmentHeader {
                            room,
                            layer,
                            dst_page: d.0,
                            n_pages: 1,
                            heads: Some(HeadSlice {
                                part,
                                first: slice.dst_head_offset,
                                count: n,
                            }),
                        },
                        src: src_layout.head_range(layer, s, part, slice.src_head_offset, n)?,
                        src_pages: s.0..s.0 + 1,
                        dst: dst_layout.head_range(layer, d, part, slice.dst_head_offset, n)?,
                    });
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kv::{KvDtype, KvGeometry};
    use handoff_proto::handshake::KvLayoutKind;

    fn fp(kv_heads: u32, tp_rank: u32, tp_size: u32) -> Fingerprint {
        Fingerprint {
            model_id: "m".into(),
            model_hash: [0; 32],
            layers: 2,
            kv_heads,
            head_dim: 4,
            page_size: 4,
            dtype: KvDtype::F32,
            layout: KvLayoutKind::LayerPageKv,
            tp_rank,
            tp_size,
        }
    }

    fn layout(heads: usize, pages: usize) -> KvLayout {
        let g = KvGeometry {
            layers: 2,
            kv_heads: heads,
            head_dim: 4,
            page_size: 4,
            dtype: KvDtype::F32,
        };
        KvLayout::new(g, pages).unwrap()
    }

    #[test]
    fn plans_follow_the_fingerprints_and_check_our_pool() {
        let whole = LinkPlan::new(&fp(4, 0, 1), &fp(4, 0, 1), true, 4).unwrap();
        assert!(whole.is_whole());
        assert_eq!(whole.decode_heads, 4);
        // Fan-in 2 -> 1, seen from prefill rank 1 and from the decode rank.
        let p = LinkPlan::new(&fp(4, 1, 2), &fp(4, 0, 1), true, 2).unwrap();
        assert_eq!(
            p,
            LinkPlan::new(&fp(4, 1, 2), &fp(4, 0, 1), false, 4).unwrap()
        );
        assert!(!p.is_whole());
        assert_eq!(p.decode_heads, 4);
        assert_eq!(
            p.decode_page_bytes(&layout(2, 1)),
            layout(4, 1).pool_bytes()
        );
        // A pool that is not this rank's share is refused, naming the setting.
        let e = LinkPlan::new(&fp(4, 1, 2), &fp(4, 0, 1), true, 4).unwrap_err();
        assert!(
            matches!(
                e,
                PlanError::NotOurShare {
                    side: "prefill",
                    local_heads: 4,
                    per_rank: 2,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("prefill pool holds 4 KV heads"),
            "{e}"
        );
        let e = LinkPlan::new(&fp(4, 0, 1), &fp(4, 1, 2), false, 4).unwrap_err();
        assert!(e.to_string().contains("decode pool holds 4"), "{e}");
        assert!(matches!(
            LinkPlan::new(&fp(4, 2, 2), &fp(4, 0, 1), true, 2),
            Err(PlanError::RankMap(_))
        ));
    }

    #[test]
    fn sliced_segments_cover_each_block_slice_once() {
        // Fan-out 1 -> 2, decode rank 1: prefill heads 2..4 -> decode 0..2.
        let plan = LinkPlan::new(&fp(4, 0, 1), &fp(4, 1, 2), true, 4).unwrap();
        let PairPlan::Sliced(slices) = &plan.pair else {
            panic!("sliced")
        };
        let ours = layout(4, 8);
        let room = RoomId::new(3).unwrap();
        let src = [PageIndex(5), PageIndex(6)];
        let dst = [handoff_proto::PageIndex(9), handoff_proto::PageIndex(2)];
        let build = |layers, pages, dst: &[handoff_proto::PageIndex]| {
            build_sliced_segments(room, slices, &ours, 2, 16, layers, pages, &src, dst)
        };
        let segs = build(1..2, 0..2, &dst).unwrap();
        assert_eq!(segs.len(), 4, "2 pages x K,V x 1 slice");
        let head = 4 * 4 * 4;
        let s0 = &segs[1];
        assert_eq!(
            s0.header.heads,
            Some(HeadSlice {
                part: KvPart::V,
                first: 0,
                count: 2
            })
        );
        assert_eq!((s0.header.layer, s0.header.dst_page), (1, 9));
        // Source: layer 1, page 5, V block, heads 2..4 of 4.
        let src_block = ((8 + 5) * 2 + 1) * 4 * head;
        assert_eq!(s0.src, src_block + 2 * head..src_block + 4 * head);
        // Destination: layer 1, page 9, V block, heads 0..2 of 2.
        let dst_block = ((16 + 9) * 2 + 1) * 2 * head;
        assert_eq!(s0.dst, dst_block..dst_block + 2 * head);
        // A page outside either pool fails the build.
        let far = [handoff_proto::PageIndex(16), handoff_proto::PageIndex(2)];
        assert_eq!(
            build(0..1, 0..1, &far),
            Err(RankError::OutOfRange { what: "page" })
        );
        assert!(build(0..1, 0..3, &dst).is_err(), "past the room's pages");
        assert!(build(2..3, 0..1, &dst).is_err(), "past the layers");
    }
}
