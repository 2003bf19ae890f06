//! What decode's link reader keeps for one room while the room's records
//! land, and the rules each record must follow (sans-IO). The reader
//! (`handoff-transfer`'s `link/reader.rs`) is the I/O shell: it reads
//! records off the link, asks here, and acts on the answer.
//!
//! A room holds its pages ([`RoomPages`], what [`crate::placement::place`]
//! checks a segment against), its aux slot, and the aux records read so
//! far. An aux record in order and for the room's own slot is kept; any
//! other rejects the room, and a rejected room's end is acknowledged as
//! failed ([`RoomLanding::end`]), so prefill never reports a room whose
//! writes decode refused as a success.

use crate::datalink::{AuxData, TopLogprobs};
use crate::placement::RoomPages;

/// Most prompt-score pairs per token a room may send: the token's own pair
/// and 20 alternatives.
pub const PROMPT_PAIRS_PER_TOKEN: usize = 21;

/// The most prompt-score pairs any room of a pool of `tokens` token slots
/// may send. A room's own pages do not bound it: with a prefix-cache hit on
/// decode they hold only the prompt's tail.
pub fn prompt_pairs_cap(tokens: usize) -> usize {
    tokens.saturating_mul(PROMPT_PAIRS_PER_TOKEN)
}

/// One room as decode's link reader holds it while its records land.
#[derive(Debug, Clone)]
pub struct RoomLanding {
    pages: RoomPages,
    aux_slot: u32,
    rejected: bool,
    /// The first position's most likely tokens read so far (`AuxTop`
    /// records, in order), joined to the aux record.
    top: TopLogprobs,
    /// The prompt scores read so far (`AuxPrompt` records, in order).
    prompt: Vec<(u32, f32)>,
}

/// A room's aux record, joined to the aux records that came ahead of it:
/// what the reader hands decode's driver.
#[derive(Debug, Clone, PartialEq)]
pub struct LandedAux {
    /// The room id written in the slot (the driver checks it is the room's).
    pub written_room: u64,
    /// The aux data, its top logprobs from the `AuxTop` records.
    pub aux: AuxData,
    /// The prompt scores (flat pairs; empty unless asked for).
    pub prompt: Vec<(u32, f32)>,
}

impl RoomLanding {
    /// A room that may be written at `pages`, with aux slot `aux_slot`.
    pub fn new(pages: &[u32], aux_slot: u32) -> Self {
        Self {
            pages: RoomPages::new(pages),
            aux_slot,
            rejected: false,
            top: TopLogprobs::NONE,
            prompt: Vec::new(),
        }
    }

    /// The room's pages.
    pub fn pages(&self) -> &RoomPages {
        &self.pages
    }

    /// Something of the room was refused (a segment, a pull, a record):
    /// its end is acknowledged as failed.
    pub fn reject(&mut self) {
        self.rejected = true;
    }

    /// Whether something of the room was refused.
    pub fn is_rejected(&self) -> bool {
        self.rejected
    }

    /// An `AuxTop` record: kept when it is for the room's slot and its
    /// `index` continues the list; anything else rejects the room.
    pub fn on_aux_top(&mut self, aux_slot: u32, index: u8, pairs: &[(u32, f32)]) {
        let fits = self.top.len() + pairs.len() <= crate::datalink::MAX_TOP_LOGPROBS;
        if aux_slot == self.aux_slot && usize::from(index) == self.top.len() && fits {
            for &p in pairs {
                self.top.push(p);
            }
        } else {
            self.reject();
        }
    }

    /// An `AuxPrompt` record: kept when its `index` continues the list and
    /// the list stays within `cap` pairs ([`prompt_pairs_cap`]); anything
    /// else rejects the room.
    pub fn on_aux_prompt(&mut self, index: u32, pairs: &[(u32, f32)], cap: usize) {
        if index as usize == self.prompt.len() && self.prompt.len() + pairs.len() <= cap {
            self.prompt.extend_from_slice(pairs);
        } else {
            self.reject();
        }
    }

    /// The `Aux` record: for the room's slot, the aux data joined to the
    /// records ahead of it (which it takes); for another slot, `None` and
    /// the room is rejected.
    pub fn on_aux(
        &mut self,
        aux_slot: u32,
        written_room: u64,
        mut aux: AuxData,
    ) -> Option<LandedAux> {
        if aux_slot != self.aux_slot {
            self.reject();
            return None;
        }
        aux.top = std::mem::take(&mut self.top);
        Some(LandedAux {
            written_room,
            aux,
            prompt: std::mem::take(&mut self.prompt),
        })
    }

    /// The room's end record: whether its end is acknowledged as landed
    /// (nothing of it was refused).
    pub fn end(self) -> bool {
        !self.rejected
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datalink::MAX_TOP_LOGPROBS;
    use proptest::prelude::*;

    fn aux() -> AuxData {
        AuxData {
            first_token: 7,
            logprob: -0.5,
            top: TopLogprobs::NONE,
        }
    }

    #[test]
    fn records_in_order_for_the_rooms_slot_land_joined() {
        let mut r = RoomLanding::new(&[4, 2], 9);
        assert!(r.pages().contains(2) && r.pages().contains(4) && !r.pages().contains(3));
        r.on_aux_top(9, 0, &[(1, -0.1), (2, -0.2)]);
        r.on_aux_top(9, 2, &[(3, -0.3)]);
        r.on_aux_prompt(0, &[(5, -1.0), (6, -2.0)], 4);
        r.on_aux_prompt(2, &[(7, -3.0)], 4);
        let got = r.on_aux(9, 77, aux()).expect("the room's slot");
        assert_eq!(got.written_room, 77);
        assert_eq!(got.aux.top.as_slice(), &[(1, -0.1), (2, -0.2), (3, -0.3)]);
        assert_eq!(got.prompt, [(5, -1.0), (6, -2.0), (7, -3.0)]);
        assert!(r.end());
    }

    #[test]
    fn each_out_of_rule_record_rejects_the_room() {
        type Case = (&'static str, fn(&mut RoomLanding));
        let cases: [Case; 6] = [
            ("top for another slot", |r| r.on_aux_top(8, 0, &[(1, 0.0)])),
            ("top out of order", |r| r.on_aux_top(9, 1, &[(1, 0.0)])),
            ("prompt out of order", |r| {
                r.on_aux_prompt(1, &[(1, 0.0)], 10)
            }),
            ("prompt past its cap", |r| {
                r.on_aux_prompt(0, &[(1, 0.0), (2, 0.0)], 1)
            }),
            ("aux for another slot", |r| {
                assert_eq!(r.on_aux(8, 1, aux()), None);
            }),
            ("a refused segment", |r| r.reject()),
        ];
        for (what, f) in cases {
            let mut r = RoomLanding::new(&[1], 9);
            f(&mut r);
            assert!(r.is_rejected(), "{what}");
            assert!(!r.end(), "{what}: its end must be acknowledged as failed");
        }
    }

    proptest! {
        /// Whatever records arrive, the room's end is acknowledged as landed
        /// exactly when every record followed the rules, and a landed aux
        /// carries exactly the pairs sent in order before it.
        #[test]
        fn an_end_is_ok_only_when_every_record_followed_the_rules(
            ops in prop::collection::vec((0u8..3, 0u32..4, 1usize..3, any::<bool>()), 0..12),
        ) {
            let cap = 6;
            let mut r = RoomLanding::new(&[0], 1);
            let (mut top, mut prompt) = (Vec::new(), Vec::new());
            let mut ok = true;
            for (i, (kind, index, n, own_slot)) in ops.into_iter().enumerate() {
                let pairs: Vec<(u32, f32)> = (0..n).map(|k| ((i * 2 + k) as u32, -1.0)).collect();
                let slot = if own_slot { 1 } else { 2 };
                match kind {
                    0 => {
                        let good = own_slot
                            && index as usize == top.len()
                            && top.len() + n <= MAX_TOP_LOGPROBS;
                        r.on_aux_top(slot, index as u8, &pairs);
                        if good { top.extend(&pairs) } else { ok = false }
                    }
                    1 => {
                        let good = index as usize == prompt.len() && prompt.len() + n <= cap;
                        r.on_aux_prompt(index, &pairs, cap);
                        if good { prompt.extend(&pairs) } else { ok = false }
                    }
                    _ => {
                        let landed = r.on_aux(slot, 5, aux());
                        if own_slot {
                            let l = landed.expect("own slot");
                            prop_assert_eq!(l.aux.top.as_slice(), &top[..]);
                            prop_assert_eq!(&l.prompt, &prompt);
                            top.clear();
                            prompt.clear();
                        } else {
                            prop_assert!(landed.is_none());
                            ok = false;
                        }
                    }
                }
            }
            prop_assert_eq!(r.end(), ok);
        }
    }
}
