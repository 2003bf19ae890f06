//! Rank mapping between prefill TP and decode TP, and the head-sliced byte
//! ranges each (prefill rank, decode rank) pair moves. Pure functions.
//!
//! KV heads are sharded over TP ranks: with `tp <= kv_heads` rank `r` holds
//! heads `[r·h, (r+1)·h)` with `h = kv_heads / tp`; with `tp > kv_heads` each
//! head is replicated on `tp / kv_heads` consecutive ranks and rank `r` holds
//! head `r / replicas`. A decode rank needs every head it holds from some
//! prefill rank holding it; among replicas the source is chosen as
//! `decode_rank % replicas`, deterministically, spreading the load.
//!
//! Byte ranges come from the pool layout ([`PageLayout`], the one handoff-kv's
//! pool uses).

use std::ops::Range;

use crate::ids::{PageIndex, RankId};
use crate::layout::{KvPart, PageLayout};

pub use crate::error::RankError;

/// How heads are spread over one worker group's TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadAssignment {
    /// KV heads of the model.
    pub kv_heads: u32,
    /// TP size.
    pub tp: u32,
    /// Heads held by each rank (1 when replicated).
    pub heads_per_rank: u32,
    /// Ranks holding each head (1 when sharded).
    pub replicas: u32,
}

impl HeadAssignment {
    /// Global heads held by `rank`.
    pub fn heads_of(&self, rank: RankId) -> Result<Range<u32>, RankError> {
        if rank.0 >= self.tp {
            return Err(RankError::RankOutOfRange { rank, tp: self.tp });
        }
        let first = (rank.0 / self.replicas) * self.heads_per_rank;
        Ok(first..first + self.heads_per_rank)
    }

    /// Ranks holding global head `head`.
    pub fn ranks_holding(&self, head: u32) -> Range<u32> {
        let first_rank = (head / self.heads_per_rank) * self.replicas;
        first_rank..first_rank + self.replicas
    }
}

/// The head assignment for `tp` ranks over `kv_heads` heads.
pub fn head_assignment(kv_heads: u32, tp: u32) -> Result<HeadAssignment, RankError> {
    if tp == 0 || kv_heads == 0 {
        return Err(RankError::Zero { tp, kv_heads });
    }
    if tp <= kv_heads {
        if kv_heads % tp != 0 {
            return Err(RankError::Indivisible { tp, kv_heads });
        }
        Ok(HeadAssignment {
            kv_heads,
            tp,
            heads_per_rank: kv_heads / tp,
            replicas: 1,
        })
    } else {
        if tp % kv_heads != 0 {
            return Err(RankError::Indivisible { tp, kv_heads });
        }
        Ok(HeadAssignment {
            kv_heads,
            tp,
            heads_per_rank: 1,
            replicas: tp / kv_heads,
        })
    }
}

/// One head-sliced copy: a run of heads from one prefill rank to one decode rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceTransfer {
    /// Source rank.
    pub prefill_rank: RankId,
    /// Destination rank.
    pub decode_rank: RankId,
    /// Global heads moved.
    pub heads: Range<u32>,
    /// First of those heads within the prefill rank's local heads.
    pub src_head_offset: u32,
    /// First of those heads within the decode rank's local heads.
    pub dst_head_offset: u32,
}

impl SliceTransfer {
    /// Number of heads.
    pub fn num_heads(&self) -> u32 {
        self.heads.end - self.heads.start
    }

    /// The heads moved, as the decode rank's local heads.
    pub fn dst_heads(&self) -> Range<u32> {
        self.dst_head_offset..self.dst_head_offset + self.num_heads()
    }
}

/// How KV moves between one prefill rank and one decode rank: what a data
/// link between them carries, decided once when the link is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PairPlan {
    /// Both ranks hold exactly the same heads (equal TP sizes): whole
    /// (layer, page) spans move, coalesced over contiguous pages.
    Whole,
    /// Only these head runs move, one (layer, page, K|V) block slice at a
    /// time. Empty when the decode rank needs nothing from this prefill rank
    /// (replicated heads served by another replica).
    Sliced(Vec<SliceTransfer>),
}

impl PairPlan {
    /// Whether the decode rank may receive local heads `heads` of a block
    /// from this prefill rank: they lie inside one of the plan's slices.
    pub fn allows_dst_heads(&self, heads: Range<u32>, local_heads: u32) -> bool {
        if heads.start >= heads.end || heads.end > local_heads {
            return false;
        }
        match self {
            PairPlan::Whole => true,
            PairPlan::Sliced(slices) => slices.iter().any(|s| {
                let d = s.dst_heads();
                d.start <= heads.start && heads.end <= d.end
            }),
        }
    }
}

/// Both groups' assignments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMap {
    /// Prefill side.
    pub prefill: HeadAssignment,
    /// Decode side.
    pub decode: HeadAssignment,
}

impl RankMap {
    /// The mapping for a model with `kv_heads` between TP sizes.
    pub fn new(kv_heads: u32, prefill_tp: u32, decode_tp: u32) -> Result<Self, RankError> {
        Ok(Self {
            prefill: head_assignment(kv_heads, prefill_tp)?,
            decode: head_assignment(kv_heads, decode_tp)?,
        })
    }

    /// Every slice decode rank `d` needs, in head order (fan-in when prefill
    /// TP > decode TP).
    pub fn slices_for_decode_rank(&self, d: RankId) -> Result<Vec<SliceTransfer>, RankError> {
        let dst_heads = self.decode.heads_of(d)?;
        let mut out: Vec<SliceTransfer> = Vec::new();
        for head in dst_heads.clone() {
            let holders = self.prefill.ranks_holding(head);
            let p = RankId(holders.start + d.0 % self.prefill.replicas);
            let src_first = self.prefill.heads_of(p)?.start;
            if let Some(last) = out.last_mut() {
                if last.prefill_rank == p && last.heads.end == head {
                    last.heads.end += 1;
                    continue;
                }
            }
            out.push(SliceTransfer {
                prefill_rank: p,
                decode_rank: d,
                heads: head..head + 1,
                src_head_offset: head - src_first,
                dst_head_offset: head - dst_heads.start,
            });
        }
        Ok(out)
    }

    /// What moves from prefill rank `p` to decode rank `d`: [`PairPlan::Whole`]
    /// when the one slice between them is every local head of both ranks,
    /// otherwise their slices (possibly none).
    pub fn pair_plan(&self, p: RankId, d: RankId) -> Result<PairPlan, RankError> {
        if p.0 >= self.prefill.tp {
            return Err(RankError::RankOutOfRange {
                rank: p,
                tp: self.prefill.tp,
            });
        }
        let slices: Vec<SliceTransfer> = self
            .slices_for_decode_rank(d)?
            .into_iter()
            .filter(|s| s.prefill_rank == p)
            .collect();
        let whole = match slices.as_slice() {
            [s] => {
                s.num_heads() == self.prefill.heads_per_rank
                    && s.num_heads() == self.decode.heads_per_rank
            }
            _ => false,
        };
        Ok(if whole {
            PairPlan::Whole
        } else {
            PairPlan::Sliced(slices)
        })
    }

    /// Distinct prefill ranks decode rank `d` must hear Success from.
    pub fn required_prefill_ranks(&self, d: RankId) -> Result<Vec<RankId>, RankError> {
        let mut ranks: Vec<RankId> = self
            .slices_for_decode_rank(d)?
            .into_iter()
            .map(|s| s.prefill_rank)
            .collect();
        ranks.sort();
        ranks.dedup();
        Ok(ranks)
    }

    /// Every slice prefill rank `p` writes, over all decode ranks (fan-out
    /// when decode TP > prefill TP).
    pub fn slices_for_prefill_rank(&self, p: RankId) -> Result<Vec<SliceTransfer>, RankError> {
        if p.0 >= self.prefill.tp {
            return Err(RankError::RankOutOfRange {
                rank: p,
                tp: self.prefill.tp,
            });
        }
        let mut out = Vec::new();
        for d in 0..self.decode.tp {
            out.extend(
                self.slices_for_decode_rank(RankId(d))?
                    .into_iter()
                    .filter(|s| s.prefill_rank == p),
            );
        }
        Ok(out)
    }

    /// Distinct decode ranks prefill rank `p` must wait for (its
    /// `required_destinations`).
    pub fn destination_ranks(&self, p: RankId) -> Result<Vec<RankId>, RankError> {
        let mut ranks: Vec<RankId> = self
            .slices_for_prefill_rank(p)?
            .into_iter()
            .map(|s| s.decode_rank)
            .collect();
        ranks.dedup();
        Ok(ranks)
    }
}

/// One contiguous copy: `len` bytes from `src` in the prefill pool to `dst`
/// in the decode pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteCopy {
    /// Source range in the prefill rank's pool.
    pub src: Range<usize>,
    /// Destination range in the decode rank's pool.
    pub dst: Range<usize>,
}

/// Every copy moving `slice` for one page (`src_page` → `dst_page`): one per
/// layer and K/V. Both layouts must agree on page size, head dim and dtype.
pub fn page_copies(
    slice: &SliceTransfer,
    src: &PageLayout,
    dst: &PageLayout,
    src_page: PageIndex,
    dst_page: PageIndex,
) -> Result<Vec<ByteCopy>, RankError> {
    if src.head_bytes() != dst.head_bytes() || src.layers != dst.layers {
        return Err(RankError::OutOfRange {
            what: "layout geometry",
        });
    }
    let mut out = Vec::with_capacity(src.layers as usize * 2);
    for layer in 0..src.layers {
        for part in [KvPart::K, KvPart::V] {
            out.push(ByteCopy {
                src: src.head_range(
                    layer,
                    src_page,
                    part,
                    slice.src_head_offset,
                    slice.num_heads(),
                )?,
                dst: dst.head_range(
                    layer,
                    dst_page,
                    part,
                    slice.dst_head_offset,
                    slice.num_heads(),
                )?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments() {
        let a = head_assignment(8, 2).unwrap();
        assert_eq!(a.heads_of(RankId(1)).unwrap(), 4..8);
        let r = head_assignment(2, 8).unwrap();
        assert_eq!(r.replicas, 4);
        assert_eq!(r.heads_of(RankId(5)).unwrap(), 1..2);
        assert_eq!(r.ranks_holding(1), 4..8);
        assert_eq!(
            head_assignment(8, 3),
            Err(RankError::Indivisible { tp: 3, kv_heads: 8 })
        );
        assert_eq!(
            head_assignment(4, 6),
            Err(RankError::Indivisible { tp: 6, kv_heads: 4 })
        );
        assert_eq!(
            head_assignment(4, 0),
            Err(RankError::Zero { tp: 0, kv_heads: 4 })
        );
        assert!(matches!(
            a.heads_of(RankId(2)),
            Err(RankError::RankOutOfRange { .. })
        ));
    }

    #[test]
    fn one_to_one() {
        let m = RankMap::new(8, 1, 1).unwrap();
        let s = m.slices_for_decode_rank(RankId(0)).unwrap();
        assert_eq!(
            s,
            vec![SliceTransfer {
                prefill_rank: RankId(0),
                decode_rank: RankId(0),
                heads: 0..8,
                src_head_offset: 0,
                dst_head_offset: 0
            }]
        );
    }

    #[test]
    fn one_prefill_two_decode_fans_out() {
        let m = RankMap::new(8, 1, 2).unwrap();
        let d1 = m.slices_for_decode_rank(RankId(1)).unwrap();
        assert_eq!(
            d1,
            vec![SliceTransfer {
                prefill_rank: RankId(0),
                decode_rank: RankId(1),
                heads: 4..8,
                src_head_offset: 4,
                dst_head_offset: 0
            }]
        );
        assert_eq!(
            m.destination_ranks(RankId(0)).unwrap(),
            vec![RankId(0), RankId(1)]
        );
        assert_eq!(
            m.required_prefill_ranks(RankId(1)).unwrap(),
            vec![RankId(0)]
        );
    }

    #[test]
    fn two_prefill_one_decode_fans_in() {
        let m = RankMap::new(8, 2, 1).unwrap();
        let d0 = m.slices_for_decode_rank(RankId(0)).unwrap();
        assert_eq!(d0.len(), 2);
        assert_eq!(
            d0[1],
            SliceTransfer {
                prefill_rank: RankId(1),
                decode_rank: RankId(0),
                heads: 4..8,
                src_head_offset: 0,
                dst_head_offset: 4
            }
        );
        assert_eq!(
            m.required_prefill_ranks(RankId(0)).unwrap(),
            vec![RankId(0), RankId(1)]
        );
        assert_eq!(m.destination_ranks(RankId(1)).unwrap(), vec![RankId(0)]);
    }

    #[test]
    fn four_to_two_and_two_to_four() {
        let m = RankMap::new(8, 4, 2).unwrap();
        assert_eq!(
            m.required_prefill_ranks(RankId(1)).unwrap(),
            vec![RankId(2), RankId(3)]
        );
        let m = RankMap::new(8, 2, 4).unwrap();
        assert_eq!(
            m.required_prefill_ranks(RankId(3)).unwrap(),
            vec![RankId(1)]
        );
        assert_eq!(
            m.destination_ranks(RankId(1)).unwrap(),
            vec![RankId(2), RankId(3)]
        );
        let s = m.slices_for_decode_rank(RankId(3)).unwrap();
        assert_eq!(s[0].src_head_offset, 2);
        assert_eq!(s[0].num_heads(), 2);
    }

    #[test]
    fn replicated_heads_pick_one_source_per_decode_rank() {
        // 2 KV heads, prefill TP 4 (each head on 2 ranks), decode TP 1.
        let m = RankMap::new(2, 4, 1).unwrap();
        assert_eq!(
            m.required_prefill_ranks(RankId(0)).unwrap(),
            vec![RankId(0), RankId(2)]
        );
        // decode TP 4 replicated too: decode rank 3 holds head 1, takes it from prefill rank 2+1.
        let m = RankMap::new(2, 4, 4).unwrap();
        assert_eq!(
            m.required_prefill_ranks(RankId(3)).unwrap(),
            vec![RankId(3)]
        );
    }

    /// Move real bytes for every pair of a mapping and check each decode rank
    /// ends up with exactly its heads, for one page per rank pair.
    fn simulate(kv_heads: u32, p_tp: u32, d_tp: u32) {
        let m = RankMap::new(kv_heads, p_tp, d_tp).unwrap();
        let (layers, page_size, head_dim, dtype_bytes, num_pages) = (2u32, 4u32, 3u32, 2u32, 3u32);
        let layout = |local_heads| PageLayout {
            layers,
            local_heads,
            page_size,
            head_dim,
            dtype_bytes,
            num_pages,
        };
        let src_layout = layout(m.prefill.heads_per_rank);
        let dst_layout = layout(m.decode.heads_per_rank);
        // value of element (layer, part, global head, slot, dim) as u16
        let value = |l: u32, part: u32, h: u32, s: u32, d: u32| -> u16 {
            (((l * 2 + part) * 64 + h) * 64 + s * 8 + d) as u16
        };
        let src_page = PageIndex(1);
        let dst_page = PageIndex(2);
        let mut prefill_pools = Vec::new();
        for p in 0..p_tp {
            let heads = m.prefill.heads_of(RankId(p)).unwrap();
            let mut pool = vec![0u8; src_layout.pool_bytes().unwrap()];
            for l in 0..layers {
                for (pi, part) in [KvPart::K, KvPart::V].into_iter().enumerate() {
                    for (li, h) in heads.clone().enumerate() {
                        let r = src_layout
                            .head_range(l, src_page, part, li as u32, 1)
                            .unwrap();
                        for s in 0..page_size {
                            for d in 0..head_dim {
                                let at = r.start + ((s * head_dim + d) * dtype_bytes) as usize;
                                pool[at..at + 2]
                                    .copy_from_slice(&value(l, pi as u32, h, s, d).to_le_bytes());
                            }
                        }
                    }
                }
            }
            prefill_pools.push(pool);
        }
        for d in 0..d_tp {
            let mut pool = vec![0u8; dst_layout.pool_bytes().unwrap()];
            for slice in m.slices_for_decode_rank(RankId(d)).unwrap() {
                for c in page_copies(&slice, &src_layout, &dst_layout, src_page, dst_page).unwrap()
                {
                    pool[c.dst.clone()].copy_from_slice(
                        &prefill_pools[slice.prefill_rank.0 as usize][c.src.clone()],
                    );
                }
            }
            let heads = m.decode.heads_of(RankId(d)).unwrap();
            for l in 0..layers {
                for (pi, part) in [KvPart::K, KvPart::V].into_iter().enumerate() {
                    for (li, h) in heads.clone().enumerate() {
                        let r = dst_layout
                            .head_range(l, dst_page, part, li as u32, 1)
                            .unwrap();
                        for s in 0..page_size {
                            for dd in 0..head_dim {
                                let at = r.start + ((s * head_dim + dd) * dtype_bytes) as usize;
                                let got = u16::from_le_bytes([pool[at], pool[at + 1]]);
                                assert_eq!(
                                    got,
                                    value(l, pi as u32, h, s, dd),
                                    "{kv_heads} heads {p_tp}:{d_tp} decode {d} layer {l} head {h}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_land_where_they_belong() {
        for (heads, p, d) in [
            (8, 1, 1),
            (8, 1, 2),
            (8, 2, 1),
            (8, 4, 2),
            (8, 2, 4),
            (8, 8, 1),
            (8, 1, 8),
            (2, 4, 1),
            (2, 1, 4),
            (2, 4, 8),
            (4, 8, 2),
        ] {
            simulate(heads, p, d);
        }
    }

    #[test]
    fn pair_plans_are_whole_only_for_identical_heads() {
        // Equal TP sizes, sharded or replicated: whole spans.
        for (heads, tp) in [(8, 1), (8, 2), (8, 8), (2, 4)] {
            let m = RankMap::new(heads, tp, tp).unwrap();
            for r in 0..tp {
                assert_eq!(
                    m.pair_plan(RankId(r), RankId(r)).unwrap(),
                    PairPlan::Whole,
                    "{heads} heads TP {tp} rank {r}"
                );
            }
        }
        // Fan-in 2 -> 1: each prefill rank fills half of decode's heads.
        let m = RankMap::new(8, 2, 1).unwrap();
        let PairPlan::Sliced(s) = m.pair_plan(RankId(1), RankId(0)).unwrap() else {
            panic!("fan-in is sliced")
        };
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].src_head_offset, s[0].dst_heads()), (0, 4..8));
        // Fan-out 1 -> 2: decode rank 1 takes prefill's upper half.
        let m = RankMap::new(8, 1, 2).unwrap();
        let PairPlan::Sliced(s) = m.pair_plan(RankId(0), RankId(1)).unwrap() else {
            panic!("fan-out is sliced")
        };
        assert_eq!((s[0].src_head_offset, s[0].dst_heads()), (4, 0..4));
        // 4 -> 2: prefill rank 0 sends nothing to decode rank 1.
        let m = RankMap::new(8, 4, 2).unwrap();
        assert_eq!(
            m.pair_plan(RankId(0), RankId(1)).unwrap(),
            PairPlan::Sliced(vec![])
        );
        // Replicated heads: the replica not chosen sends nothing.
        let m = RankMap::new(2, 4, 1).unwrap();
        assert_eq!(
            m.pair_plan(RankId(1), RankId(0)).unwrap(),
            PairPlan::Sliced(vec![])
        );
        assert!(matches!(
            m.pair_plan(RankId(4), RankId(0)),
            Err(RankError::RankOutOfRange { .. })
        ));
        assert!(matches!(
            m.pair_plan(RankId(0), RankId(1)),
            Err(RankError::RankOutOfRange { .. })
        ));
    }

    #[test]
    fn plans_allow_only_their_own_destination_heads() {
        let m = RankMap::new(8, 2, 1).unwrap();
        let p1 = m.pair_plan(RankId(1), RankId(0)).unwrap();
        assert!(p1.allows_dst_heads(4..8, 8));
        assert!(p1.allows_dst_heads(5..6, 8));
        assert!(
            !p1.allows_dst_heads(3..5, 8),
            "straddles prefill rank 0's heads"
        );
        assert!(!p1.allows_dst_heads(0..4, 8), "prefill rank 0's heads");
        assert!(!p1.allows_dst_heads(6..6, 8), "empty");
        assert!(!p1.allows_dst_heads(7..9, 8), "past the local heads");
        let whole = PairPlan::Whole;
        assert!(whole.allows_dst_heads(0..8, 8));
        assert!(!whole.allows_dst_heads(0..9, 8));
        assert!(!PairPlan::Sliced(vec![]).allows_dst_heads(0..1, 8));
    }

    #[test]
    fn ranges_are_bounds_checked() {
        let l = PageLayout {
            layers: 2,
            local_heads: 4,
            page_size: 16,
            head_dim: 64,
            dtype_bytes: 2,
            num_pages: 10,
        };
        assert_eq!(
            l.head_range(0, PageIndex(10), KvPart::K, 0, 1),
            Err(RankError::OutOfRange { what: "page" })
        );
        assert_eq!(
            l.head_range(2, PageIndex(0), KvPart::K, 0, 1),
            Err(RankError::OutOfRange { what: "layer" })
        );
        assert_eq!(
            l.head_range(0, PageIndex(0), KvPart::K, 3, 2),
            Err(RankError::OutOfRange { what: "head" })
        );
        let r = l.head_range(1, PageIndex(9), KvPart::V, 3, 1).unwrap();
        assert_eq!(r.end, l.pool_bytes().unwrap());
        assert_eq!(
            l.head_range(0, PageIndex(0), KvPart::V, 0, 4).unwrap(),
            l.block_bytes()..2 * l.block_bytes()
        );
    }
}
