//! The data-link wire format, sans-IO like the control codec: what flows on a data connection
//! after its handshake. Control frames never travel here; these records only
//! carry KV payload placement (tcp), the aux record and end-of-room markers,
//! and the decode side's acknowledgements.
//!
//! Every record has a fixed-size header; a decoder validates the tag and
//! sizes before anything is acted on.

use crate::ids::RoomId;
use crate::layout::KvPart;

/// Preface byte of a control connection.
pub const PREFACE_CONTROL: u8 = b'C';
/// Preface byte of a data connection.
pub const PREFACE_DATA: u8 = b'D';
/// After the preface byte: the connecting (decode) endpoint's random id,
/// little-endian. Prefill pairs a decode's control connection and data link
/// by it and gives each decode endpoint its own peer id, so two decode
/// workers of the same TP rank never collide. The handshake that follows
/// authenticates the connection.
pub const ENDPOINT_ID_LEN: usize = 8;
/// After the endpoint id: decode's number for this connect (u64, little
/// endian), higher for each later connect of the same endpoint. Per decode
/// endpoint, prefill keeps the control connection and the data link of the
/// newest connect it has seen, so a connect that decode cancelled but whose
/// connections complete late on prefill never replaces a newer one.
pub const CONNECT_SEQ_LEN: usize = 8;
/// The whole preface: kind, endpoint id, connect number.
pub const PREFACE_LEN: usize = 1 + ENDPOINT_ID_LEN + CONNECT_SEQ_LEN;

/// The preface of a connection of `kind` ([`PREFACE_CONTROL`] or
/// [`PREFACE_DATA`]) from decode endpoint `endpoint`, for its connect
/// number `connect`.
pub fn encode_preface(kind: u8, endpoint: u64, connect: u64) -> [u8; PREFACE_LEN] {
    let mut b = [0u8; PREFACE_LEN];
    b[0] = kind;
    b[1..1 + ENDPOINT_ID_LEN].copy_from_slice(&endpoint.to_le_bytes());
    b[1 + ENDPOINT_ID_LEN..].copy_from_slice(&connect.to_le_bytes());
    b
}

/// A preface's kind byte, endpoint id and connect number (the kind is
/// checked by the caller).
pub fn decode_preface(b: &[u8; PREFACE_LEN]) -> (u8, u64, u64) {
    (
        b[0],
        u64::from_le_bytes(arr(&b[1..])),
        u64::from_le_bytes(arr(&b[1 + ENDPOINT_ID_LEN..])),
    )
}

/// Link setup: decode asks for a shared-memory link it pulls over. Followed
/// by decode's pool page count (u64). Prefill answers with its own pool's
/// region (pid, fd, length), page count and the offset of its page
/// generations; decode maps that region read-only and copies KV out of it,
/// as each segment record names it ([`PullRef`]). No process writes into
/// another's memory (DESIGN.md "No write after release").
pub const SETUP_SHM: u8 = b'P';
/// The shm setup of protocol 2 before pulls: decode offered its own pool
/// for prefill to write into. Refused by name.
pub const SETUP_SHM_PUSH: u8 = b'S';
/// Link setup: decode receives payloads over this TCP stream. Followed by
/// the pool's page count (u64) and a [`TcpStreamSetup`].
pub const SETUP_TCP: u8 = b'T';
/// Link setup: decode pulls over NIXL (a build with the `nixl` feature).
/// Followed by decode's pool page count (u64). Prefill answers with its
/// NIXL agent's metadata and where its pool is registered ([`NixlSetup`]);
/// decode READs each segment out of it, as [`PullRef`] names it, into its
/// own registered pages: as over shm, no process writes another's memory.
pub const SETUP_NIXL: u8 = b'N';
/// Most TCP streams one data link may have.
pub const MAX_TCP_STREAMS: u8 = 16;

/// Which stream of a TCP data link a connection is: a link of `count`
/// streams is `count` connections with the same `nonce` (chosen by decode
/// per link), each with its own `index`. Rooms are spread over the streams
/// by id ([`stream_of`]); a room's records all travel on one stream, so its
/// end marker follows every byte of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpStreamSetup {
    /// Link identity chosen by decode.
    pub nonce: u64,
    /// This connection's stream, `< count`.
    pub index: u8,
    /// Streams of the link, `1..=MAX_TCP_STREAMS`.
    pub count: u8,
}

impl TcpStreamSetup {
    /// Encoded bytes.
    pub const LEN: usize = 10;

    /// Encode.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.nonce.to_le_bytes());
        b[8] = self.index;
        b[9] = self.count;
        b
    }

    /// Decode and validate.
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, RecordError> {
        let mut n = [0u8; 8];
        n.copy_from_slice(&b[..8]);
        let s = Self {
            nonce: u64::from_le_bytes(n),
            index: b[8],
            count: b[9],
        };
        if s.count == 0 || s.count > MAX_TCP_STREAMS || s.index >= s.count {
            return Err(RecordError::StreamSetup {
                index: s.index,
                count: s.count,
            });
        }
        Ok(s)
    }
}

/// The stream of a link of `count` streams that carries `room`.
pub fn stream_of(room: RoomId, count: usize) -> usize {
    (room.get() % count.max(1) as u64) as usize
}

/// Record tags.
const TAG_SEGMENT: u8 = 1;
const TAG_AUX: u8 = 2;
const TAG_END: u8 = 3;
const TAG_ACK: u8 = 4;
const TAG_AUX_TOP: u8 = 5;
const TAG_AUX_PROMPT: u8 = 6;

/// Header bytes of every prefill → decode record (tag + fields, padded).
pub const RECORD_LEN: usize = 32;
/// Bytes of a decode → prefill acknowledgement.
pub const ACK_LEN: usize = 10;

/// Where a payload goes: either whole (layer, page) spans of `n_pages`
/// consecutive destination pages (`heads: None`, payload `n_pages ×
/// page_span` bytes), or one head slice of one page's K or V block
/// (`heads: Some`, `n_pages` 1, payload `count × head_bytes` bytes) when
/// prefill and decode TP sizes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The room.
    pub room: RoomId,
    /// Layer.
    pub layer: u32,
    /// First destination page.
    pub dst_page: u32,
    /// Consecutive pages.
    pub n_pages: u32,
    /// A head slice of one block instead of whole spans.
    pub heads: Option<HeadSlice>,
}

/// A run of heads of one (layer, page) block, as the decode rank's local
/// heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlice {
    /// K or V block.
    pub part: KvPart,
    /// First local head in the destination block.
    pub first: u32,
    /// Heads (at least 1).
    pub count: u32,
}

impl SegmentHeader {
    /// Payload bytes that follow this header on a tcp link, given one
    /// (layer, page) span and one head of one block in bytes; `None` on
    /// overflow.
    pub fn payload_len(&self, page_span: usize, head_bytes: usize) -> Option<usize> {
        match self.heads {
            None => (self.n_pages as usize).checked_mul(page_span),
            Some(h) => (h.count as usize).checked_mul(head_bytes),
        }
    }
}

/// On an shm link, what follows a segment header in place of its KV bytes:
/// where the bytes are in the prefill's pool, which source pages they come
/// from, and the prefill pool's page epoch when the segment was built.
/// Decode copies `src_offset..+len` (len from the header) out of its
/// read-only mapping of that pool into the destination it checked, then
/// keeps the copy only if no page of `src_page..src_page + src_pages` was
/// handed out again after `epoch` (`handoff_kv::PageGenerations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullRef {
    /// Byte offset of the payload in the prefill's pool.
    pub src_offset: u64,
    /// First source page.
    pub src_page: u32,
    /// Source pages (at least 1).
    pub src_pages: u32,
    /// The source pool's page epoch when the segment was built.
    pub epoch: u64,
}

impl PullRef {
    /// Encoded bytes.
    pub const LEN: usize = 24;

    /// Encode.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.src_offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.src_page.to_le_bytes());
        b[12..16].copy_from_slice(&self.src_pages.to_le_bytes());
        b[16..].copy_from_slice(&self.epoch.to_le_bytes());
        b
    }

    /// Decode and validate.
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, RecordError> {
        let r = Self {
            src_offset: u64::from_le_bytes(arr(&b[..8])),
            src_page: u32::from_le_bytes(arr(&b[8..12])),
            src_pages: u32::from_le_bytes(arr(&b[12..16])),
            epoch: u64::from_le_bytes(arr(&b[16..])),
        };
        if r.src_pages == 0 || r.src_page.checked_add(r.src_pages).is_none() {
            return Err(RecordError::PullPages {
                first: r.src_page,
                count: r.src_pages,
            });
        }
        Ok(r)
    }

    /// The source pages, as a range.
    pub fn pages(&self) -> std::ops::Range<u32> {
        self.src_page..self.src_page + self.src_pages
    }
}

/// Prefill's answer to [`SETUP_NIXL`] after its status byte: where its pool
/// is registered with its NIXL agent, its pages and the offset of its page
/// generations in that region, then its agent's name (`name_len` bytes)
/// and `metadata_len` bytes of the agent's metadata (what decode loads to
/// reach it; decode in the same process, which shares the agent, does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlSetupHead {
    /// Address of the registered region in the prefill process.
    pub base: u64,
    /// Its length in bytes (KV bytes, then the generation table).
    pub len: u64,
    /// The pool's pages.
    pub pages: u64,
    /// Offset of the page generation table in the region.
    pub generations_at: u64,
    /// Bytes of agent metadata that follow the name.
    pub metadata_len: u32,
    /// Bytes of the agent's name that follow this head.
    pub name_len: u16,
}

impl NixlSetupHead {
    /// Encoded bytes.
    pub const LEN: usize = 38;
    /// Longest agent name.
    pub const MAX_NAME: u16 = 255;
    /// Most metadata bytes a prefill may send (an agent's metadata with
    /// one registered region over UCX is a few KiB).
    pub const MAX_METADATA: u32 = 1 << 20;

    /// Encode.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.base.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.pages.to_le_bytes());
        b[24..32].copy_from_slice(&self.generations_at.to_le_bytes());
        b[32..36].copy_from_slice(&self.metadata_len.to_le_bytes());
        b[36..].copy_from_slice(&self.name_len.to_le_bytes());
        b
    }

    /// Decode and validate: some pages, the generation table (one word
    /// for the epoch, one per page) inside the region, the region inside
    /// the address space, and metadata of a bounded, non-zero size.
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, NixlSetupError> {
        let h = Self {
            base: u64::from_le_bytes(arr(&b[..8])),
            len: u64::from_le_bytes(arr(&b[8..16])),
            pages: u64::from_le_bytes(arr(&b[16..24])),
            generations_at: u64::from_le_bytes(arr(&b[24..32])),
            metadata_len: u32::from_le_bytes(arr(&b[32..36])),
            name_len: u16::from_le_bytes(arr(&b[36..])),
        };
        if h.metadata_len == 0 || h.metadata_len > Self::MAX_METADATA {
            return Err(NixlSetupError::Metadata(h.metadata_len));
        }
        if h.name_len == 0 || h.name_len > Self::MAX_NAME {
            return Err(NixlSetupError::Name(h.name_len));
        }
        let table_end = h
            .pages
            .checked_add(1)
            .and_then(|w| w.checked_mul(8))
            .and_then(|t| t.checked_add(h.generations_at));
        let region_end = h.base.checked_add(h.len);
        match (table_end, region_end) {
            (Some(t), Some(_)) if h.pages > 0 && h.pages <= u64::from(u32::MAX) && t <= h.len => {
                Ok(h)
            }
            _ => Err(NixlSetupError::Region {
                base: h.base,
                len: h.len,
                pages: h.pages,
                generations_at: h.generations_at,
            }),
        }
    }
}

/// Why a prefill's answer to [`SETUP_NIXL`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NixlSetupError {
    /// Agent metadata of zero bytes or more than [`NixlSetupHead::MAX_METADATA`].
    #[error("nixl link setup: {0} bytes of agent metadata (1 to {max} allowed)", max = NixlSetupHead::MAX_METADATA)]
    Metadata(u32),
    /// An agent name of zero bytes or more than [`NixlSetupHead::MAX_NAME`].
    #[error("nixl link setup: an agent name of {0} bytes (1 to {max} allowed)", max = NixlSetupHead::MAX_NAME)]
    Name(u16),
    /// A region that cannot hold its own generation table, or wraps.
    #[error("nixl link setup: a region of {len} bytes at {base:#x} cannot hold {pages} pages' generations at {generations_at}")]
    Region {
        /// Base address.
        base: u64,
        /// Length.
        len: u64,
        /// Pages.
        pages: u64,
        /// Generation table offset.
        generations_at: u64,
    },
}

/// Slice byte of a segment header: whole spans, or the block sliced.
const SLICE_NONE: u8 = 0;
const SLICE_K: u8 = 1;
const SLICE_V: u8 = 2;

/// The aux record: first token, its logprob, and the room id the decode side
/// checks before committing (FIELD-NOTES invariant 7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AuxData {
    /// First generated token.
    pub first_token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The first position's most likely tokens, when the request asked for
    /// them: sent as [`Record::AuxTop`] records ahead of the aux record
    /// (capability [`crate::handshake::Capabilities::AUX_TOP`]).
    pub top: TopLogprobs,
}

/// Most alternatives [`TopLogprobs`] holds.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Up to [`MAX_TOP_LOGPROBS`] (token, log-probability) pairs, most likely
/// first; fixed size, so [`AuxData`] stays `Copy`.
#[derive(Clone, Copy, PartialEq)]
pub struct TopLogprobs {
    len: u8,
    items: [(u32, f32); MAX_TOP_LOGPROBS],
}

impl TopLogprobs {
    /// None.
    pub const NONE: TopLogprobs = TopLogprobs {
        len: 0,
        items: [(0, 0.0); MAX_TOP_LOGPROBS],
    };

    /// The first [`MAX_TOP_LOGPROBS`] pairs of `pairs`.
    pub fn from_slice(pairs: &[(u32, f32)]) -> Self {
        let mut t = TopLogprobs::NONE;
        for &p in pairs.iter().take(MAX_TOP_LOGPROBS) {
            t.push(p);
        }
        t
    }

    /// The pairs.
    pub fn as_slice(&self) -> &[(u32, f32)] {
        &self.items[..usize::from(self.len)]
    }

    /// How many.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// None held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Append one; false when full.
    pub fn push(&mut self, pair: (u32, f32)) -> bool {
        if self.len() == MAX_TOP_LOGPROBS {
            return false;
        }
        self.items[self.len()] = pair;
        self.len += 1;
        true
    }

    /// The [`Record::AuxTop`] records that carry these pairs, two per
    /// record, in order.
    pub fn records(&self, room: RoomId, aux_slot: u32) -> Vec<Record> {
        self.as_slice()
            .chunks(2)
            .enumerate()
            .map(|(i, c)| Record::AuxTop {
                room,
                aux_slot,
                index: (2 * i) as u8,
                pairs: [c[0], c.get(1).copied().unwrap_or((0, 0.0))],
                count: c.len() as u8,
            })
            .collect()
    }
}

/// The [`Record::AuxPrompt`] records that carry a flat list of prompt
/// scores, two pairs per record, in order.
pub fn prompt_records(room: RoomId, pairs: &[(u32, f32)]) -> Vec<Record> {
    pairs
        .chunks(2)
        .enumerate()
        .map(|(i, c)| Record::AuxPrompt {
            room,
            index: (2 * i) as u32,
            pairs: [c[0], c.get(1).copied().unwrap_or((0, 0.0))],
            count: c.len() as u8,
        })
        .collect()
}

impl Default for TopLogprobs {
    fn default() -> Self {
        TopLogprobs::NONE
    }
}

impl std::fmt::Debug for TopLogprobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// One prefill → decode record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Record {
    /// KV payload placement (tcp only; payload follows).
    Segment(SegmentHeader),
    /// Part of the first position's most likely tokens of a room, ahead of
    /// its aux record: pairs `index..index + count` (count 1 or 2).
    AuxTop {
        /// The room.
        room: RoomId,
        /// The aux slot decode named in its destination.
        aux_slot: u32,
        /// Position of the first pair in the list.
        index: u8,
        /// The pairs (the second unused when `count` is 1).
        pairs: [(u32, f32); 2],
        /// Pairs in this record: 1 or 2.
        count: u8,
    },
    /// Part of a room's prompt scores, ahead of its aux record: entries
    /// `index..index + count` (count 1 or 2) of a flat list of (token,
    /// log-probability) pairs, for each scored prompt token its own pair
    /// then its alternatives (capability
    /// [`crate::handshake::Capabilities::AUX_TOP`]).
    AuxPrompt {
        /// The room.
        room: RoomId,
        /// Position of the first pair in the list.
        index: u32,
        /// The pairs (the second unused when `count` is 1).
        pairs: [(u32, f32); 2],
        /// Pairs in this record: 1 or 2.
        count: u8,
    },
    /// Aux slot contents for a room, carrying the room id it was written for.
    Aux {
        /// The room.
        room: RoomId,
        /// The aux slot decode named in its destination.
        aux_slot: u32,
        /// The room id written into the slot.
        written_room: u64,
        /// The data.
        aux: AuxData,
    },
    /// No more writes for this room on this link.
    End {
        /// The room.
        room: RoomId,
        /// True when writes were cancelled (the room failed).
        cancelled: bool,
    },
}

/// Decode → prefill: everything of `room` up to its `End` is in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// The room.
    pub room: RoomId,
    /// False when some segment was rejected (bounds) or the room was unknown.
    pub ok: bool,
}

/// Why bytes off a data link are not a valid record (the peer misbehaved).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Room id 0 is reserved.
    #[error("bad data-link record: room 0")]
    ZeroRoom,
    /// A record tag no version of the protocol defines.
    #[error("bad data-link record: unknown tag {0}")]
    UnknownTag(u8),
    /// A whole-span segment of zero pages.
    #[error("bad data-link record: segment of zero pages")]
    ZeroPages,
    /// Head-slice fields set on a whole-span segment.
    #[error("bad data-link record: head fields on a whole-span segment")]
    HeadFieldsOnWholeSpan,
    /// A slice kind other than none, K or V.
    #[error("bad data-link record: slice kind {0}")]
    SliceKind(u8),
    /// A head slice must cover one page and at least one head.
    #[error("bad data-link record: a head slice covers one page and at least one head ({pages} pages, {heads} heads)")]
    BadHeadSlice {
        /// Pages it named.
        pages: u32,
        /// Heads it named.
        heads: u32,
    },
    /// A pull reference naming no source page, or pages past `u32`.
    #[error("bad data-link record: pull of {count} source pages from page {first}")]
    PullPages {
        /// First page.
        first: u32,
        /// Pages.
        count: u32,
    },
    /// An aux-top record holding other than 1 or 2 pairs, or pairs past
    /// [`MAX_TOP_LOGPROBS`].
    #[error("bad data-link record: top logprobs {index}+{count} (1 or 2 pairs, at most {MAX_TOP_LOGPROBS} in all)")]
    AuxTop {
        /// Position of its first pair.
        index: u8,
        /// Its pair count.
        count: u8,
    },
    /// A prompt-scores record holding other than 1 or 2 pairs.
    #[error("bad data-link record: prompt scores of {0} pairs (1 or 2)")]
    AuxPrompt(u8),
    /// An end marker's cancelled flag is neither 0 nor 1.
    #[error("bad data-link record: end flag {0}")]
    EndFlag(u8),
    /// An acknowledgement with a wrong tag or flag.
    #[error("bad data-link record: bad ack (tag {tag}, flag {flag})")]
    BadAck {
        /// Its tag byte.
        tag: u8,
        /// Its ok flag byte.
        flag: u8,
    },
    /// A TCP stream setup outside `index < count <= MAX_TCP_STREAMS`.
    #[error(
        "bad data-link setup: tcp stream {index} of {count} (at most {MAX_TCP_STREAMS} streams)"
    )]
    StreamSetup {
        /// The stream's index.
        index: u8,
        /// The link's stream count.
        count: u8,
    },
}

fn room_at(b: &[u8]) -> Result<RoomId, RecordError> {
    let raw = u64::from_le_bytes(arr(b));
    RoomId::new(raw).ok_or(RecordError::ZeroRoom)
}

/// Two (token, log-probability) pairs into 16 bytes.
fn put_pairs(b: &mut [u8], pairs: &[(u32, f32); 2]) {
    for (k, (id, lp)) in pairs.iter().enumerate() {
        b[8 * k..8 * k + 4].copy_from_slice(&id.to_le_bytes());
        b[8 * k + 4..8 * k + 8].copy_from_slice(&lp.to_bits().to_le_bytes());
    }
}

/// The first `count` (1 or 2) pairs of 16 bytes; an unused second is
/// zero.
fn pairs_at(b: &[u8], count: u8) -> [(u32, f32); 2] {
    let pair = |k: usize| {
        let id = u32::from_le_bytes(arr(&b[8 * k..]));
        let lp = f32::from_bits(u32::from_le_bytes(arr(&b[8 * k + 4..])));
        (id, lp)
    };
    [pair(0), if count == 2 { pair(1) } else { (0, 0.0) }]
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

impl Record {
    /// Fixed-size encoding.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        match self {
            Record::Segment(s) => {
                b[0] = TAG_SEGMENT;
                b[1..9].copy_from_slice(&s.room.get().to_le_bytes());
                b[9..13].copy_from_slice(&s.layer.to_le_bytes());
                b[13..17].copy_from_slice(&s.dst_page.to_le_bytes());
                b[17..21].copy_from_slice(&s.n_pages.to_le_bytes());
                if let Some(h) = s.heads {
                    b[21] = match h.part {
                        KvPart::K => SLICE_K,
                        KvPart::V => SLICE_V,
                    };
                    b[22..26].copy_from_slice(&h.first.to_le_bytes());
                    b[26..30].copy_from_slice(&h.count.to_le_bytes());
                }
            }
            Record::Aux {
                room,
                aux_slot,
                written_room,
                aux,
            } => {
                b[0] = TAG_AUX;
                b[1..9].copy_from_slice(&room.get().to_le_bytes());
                b[9..13].copy_from_slice(&aux_slot.to_le_bytes());
                b[13..21].copy_from_slice(&written_room.to_le_bytes());
                b[21..25].copy_from_slice(&aux.first_token.to_le_bytes());
                b[25..29].copy_from_slice(&aux.logprob.to_bits().to_le_bytes());
            }
            Record::AuxTop {
                room,
                aux_slot,
                index,
                pairs,
                count,
            } => {
                b[0] = TAG_AUX_TOP;
                b[1..9].copy_from_slice(&room.get().to_le_bytes());
                b[9..13].copy_from_slice(&aux_slot.to_le_bytes());
                b[13] = *index;
                b[14] = *count;
                put_pairs(&mut b[15..31], pairs);
            }
            Record::AuxPrompt {
                room,
                index,
                pairs,
                count,
            } => {
                b[0] = TAG_AUX_PROMPT;
                b[1..9].copy_from_slice(&room.get().to_le_bytes());
                b[9..13].copy_from_slice(&index.to_le_bytes());
                b[13] = *count;
                put_pairs(&mut b[14..30], pairs);
            }
            Record::End { room, cancelled } => {
                b[0] = TAG_END;
                b[1..9].copy_from_slice(&room.get().to_le_bytes());
                b[9] = u8::from(*cancelled);
            }
        }
        b
    }

    /// Decode and validate one record header.
    pub fn decode(b: &[u8; RECORD_LEN]) -> Result<Record, RecordError> {
        let room = room_at(&b[1..9])?;
        match b[0] {
            TAG_SEGMENT => {
                let first = u32::from_le_bytes(arr(&b[22..26]));
                let count = u32::from_le_bytes(arr(&b[26..30]));
                let part = match b[21] {
                    SLICE_NONE if first == 0 && count == 0 => None,
                    SLICE_NONE => return Err(RecordError::HeadFieldsOnWholeSpan),
                    SLICE_K => Some(KvPart::K),
                    SLICE_V => Some(KvPart::V),
                    v => return Err(RecordError::SliceKind(v)),
                };
                let s = SegmentHeader {
                    room,
                    layer: u32::from_le_bytes(arr(&b[9..13])),
                    dst_page: u32::from_le_bytes(arr(&b[13..17])),
                    n_pages: u32::from_le_bytes(arr(&b[17..21])),
                    heads: part.map(|part| HeadSlice { part, first, count }),
                };
                if s.n_pages == 0 {
                    return Err(RecordError::ZeroPages);
                }
                if s.heads.is_some() && (s.n_pages != 1 || count == 0) {
                    return Err(RecordError::BadHeadSlice {
                        pages: s.n_pages,
                        heads: count,
                    });
                }
                Ok(Record::Segment(s))
            }
            TAG_AUX => Ok(Record::Aux {
                room,
                aux_slot: u32::from_le_bytes(arr(&b[9..13])),
                written_room: u64::from_le_bytes(arr(&b[13..21])),
                aux: AuxData {
                    first_token: u32::from_le_bytes(arr(&b[21..25])),
                    logprob: f32::from_bits(u32::from_le_bytes(arr(&b[25..29]))),
                    top: TopLogprobs::NONE,
                },
            }),
            TAG_AUX_TOP => {
                let (index, count) = (b[13], b[14]);
                if !(1..=2).contains(&count)
                    || usize::from(index) + usize::from(count) > MAX_TOP_LOGPROBS
                {
                    return Err(RecordError::AuxTop { index, count });
                }
                Ok(Record::AuxTop {
                    room,
                    aux_slot: u32::from_le_bytes(arr(&b[9..13])),
                    index,
                    pairs: pairs_at(&b[15..31], count),
                    count,
                })
            }
            TAG_AUX_PROMPT => {
                let count = b[13];
                if !(1..=2).contains(&count) {
                    return Err(RecordError::AuxPrompt(count));
                }
                Ok(Record::AuxPrompt {
                    room,
                    index: u32::from_le_bytes(arr(&b[9..13])),
                    pairs: pairs_at(&b[14..30], count),
                    count,
                })
            }
            TAG_END => match b[9] {
                0 | 1 => Ok(Record::End {
                    room,
                    cancelled: b[9] == 1,
                }),
                v => Err(RecordError::EndFlag(v)),
            },
            t => Err(RecordError::UnknownTag(t)),
        }
    }
}

impl Ack {
    /// Fixed-size encoding.
    pub fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0] = TAG_ACK;
        b[1..9].copy_from_slice(&self.room.get().to_le_bytes());
        b[9] = u8::from(self.ok);
        b
    }

    /// Decode and validate.
    pub fn decode(b: &[u8; ACK_LEN]) -> Result<Ack, RecordError> {
        if b[0] != TAG_ACK || b[9] > 1 {
            return Err(RecordError::BadAck {
                tag: b[0],
                flag: b[9],
            });
        }
        Ok(Ack {
            room: room_at(&b[1..9])?,
            ok: b[9] == 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_refs_round_trip_and_empty_or_overflowing_page_runs_are_refused() {
        let r = PullRef {
            src_offset: 0x1234_5678_9abc,
            src_page: 7,
            src_pages: 3,
            epoch: 42,
        };
        assert_eq!(PullRef::decode(&r.encode()), Ok(r));
        assert_eq!(r.pages(), 7..10);
        for (first, count) in [(7, 0), (u32::MAX, 1), (2, u32::MAX)] {
            let bad = PullRef {
                src_page: first,
                src_pages: count,
                ..r
            };
            assert_eq!(
                PullRef::decode(&bad.encode()),
                Err(RecordError::PullPages { first, count })
            );
        }
    }

    #[test]
    fn records_round_trip_and_garbage_is_rejected() {
        let room = RoomId::new(77).unwrap();
        for r in [
            Record::Segment(SegmentHeader {
                room,
                layer: 3,
                dst_page: 9,
                n_pages: 2,
                heads: None,
            }),
            Record::Segment(SegmentHeader {
                room,
                layer: 1,
                dst_page: 7,
                n_pages: 1,
                heads: Some(HeadSlice {
                    part: KvPart::V,
                    first: 2,
                    count: 3,
                }),
            }),
            Record::Aux {
                room,
                aux_slot: 4,
                written_room: 77,
                aux: AuxData {
                    first_token: 42,
                    logprob: -0.5,
                    top: TopLogprobs::NONE,
                },
            },
            Record::AuxTop {
                room,
                aux_slot: 4,
                index: 2,
                pairs: [(7, -0.25), (9, -1.5)],
                count: 2,
            },
            Record::AuxTop {
                room,
                aux_slot: 4,
                index: 18,
                pairs: [(3, -3.0), (0, 0.0)],
                count: 1,
            },
            Record::AuxPrompt {
                room,
                index: 70_000,
                pairs: [(5, -0.5), (6, -7.0)],
                count: 2,
            },
            Record::End {
                room,
                cancelled: true,
            },
        ] {
            assert_eq!(Record::decode(&r.encode()), Ok(r));
        }
        let mut bad = Record::End {
            room,
            cancelled: false,
        }
        .encode();
        bad[0] = 99;
        assert_eq!(Record::decode(&bad), Err(RecordError::UnknownTag(99)));
        assert_eq!(
            Record::decode(&[0u8; RECORD_LEN]),
            Err(RecordError::ZeroRoom)
        );
        // Malformed head slices: unknown kind, zero heads, several pages,
        // head fields on a whole-span segment.
        let sliced = |n_pages, count| {
            Record::Segment(SegmentHeader {
                room,
                layer: 0,
                dst_page: 1,
                n_pages,
                heads: Some(HeadSlice {
                    part: KvPart::K,
                    first: 0,
                    count,
                }),
            })
            .encode()
        };
        let mut kind = sliced(1, 1);
        kind[21] = 3;
        let mut whole_with_heads = sliced(1, 1);
        whole_with_heads[21] = 0;
        for (b, want) in [
            (kind, RecordError::SliceKind(3)),
            (
                sliced(1, 0),
                RecordError::BadHeadSlice { pages: 1, heads: 0 },
            ),
            (
                sliced(2, 1),
                RecordError::BadHeadSlice { pages: 2, heads: 1 },
            ),
            (whole_with_heads, RecordError::HeadFieldsOnWholeSpan),
        ] {
            assert_eq!(Record::decode(&b), Err(want), "{b:?}");
        }
        // Aux-top records: 1 or 2 pairs, none past the 20th.
        let top = |index: u8, count: u8| {
            let mut b = Record::AuxTop {
                room,
                aux_slot: 1,
                index: 0,
                pairs: [(1, -1.0), (2, -2.0)],
                count: 2,
            }
            .encode();
            b[13] = index;
            b[14] = count;
            b
        };
        for (index, count) in [(0, 0), (0, 3), (19, 2), (20, 1), (255, 1)] {
            assert_eq!(
                Record::decode(&top(index, count)),
                Err(RecordError::AuxTop { index, count }),
                "{index}+{count}"
            );
        }
        assert!(Record::decode(&top(18, 2)).is_ok());
        // The pairs of a top list, two per record, in order.
        let list: Vec<(u32, f32)> = (0..5).map(|i| (i * 10, -(i as f32))).collect();
        let t = TopLogprobs::from_slice(&list);
        let recs = t.records(room, 3);
        assert_eq!(recs.len(), 3);
        let mut back = TopLogprobs::NONE;
        for r in &recs {
            let Ok(Record::AuxTop {
                index,
                pairs,
                count,
                aux_slot: 3,
                ..
            }) = Record::decode(&r.encode())
            else {
                panic!("{r:?}");
            };
            assert_eq!(usize::from(index), back.len());
            for &p in &pairs[..usize::from(count)] {
                assert!(back.push(p));
            }
        }
        assert_eq!(back.as_slice(), list.as_slice());
        let many: Vec<(u32, f32)> = (0..30).map(|i| (i, 0.0)).collect();
        assert_eq!(TopLogprobs::from_slice(&many).len(), MAX_TOP_LOGPROBS);
        assert!(TopLogprobs::NONE.records(room, 3).is_empty());
        let mut p = Record::AuxPrompt {
            room,
            index: 0,
            pairs: [(1, -1.0), (0, 0.0)],
            count: 1,
        }
        .encode();
        p[13] = 3;
        assert_eq!(Record::decode(&p), Err(RecordError::AuxPrompt(3)));
        let flat: Vec<(u32, f32)> = (0..5).map(|i| (i, -(i as f32))).collect();
        let recs = prompt_records(room, &flat);
        assert_eq!(recs.len(), 3);
        assert!(matches!(
            recs[2],
            Record::AuxPrompt {
                index: 4,
                count: 1,
                ..
            }
        ));
        let a = Ack { room, ok: true };
        assert_eq!(Ack::decode(&a.encode()), Ok(a));
        assert_eq!(
            Ack::decode(&[9u8; ACK_LEN]),
            Err(RecordError::BadAck { tag: 9, flag: 9 })
        );
    }

    proptest::proptest! {
        /// Any bytes off a data link decode to a typed error or to a record
        /// that encodes and decodes back to itself; nothing panics.
        #[test]
        fn arbitrary_record_bytes_decode_or_fail_cleanly(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), RECORD_LEN)
        ) {
            let b: [u8; RECORD_LEN] = bytes.try_into().unwrap();
            if let Ok(r) = Record::decode(&b) {
                // Bytes, not values: a logprob may be NaN, which is not equal to itself.
                let e = r.encode();
                proptest::prop_assert_eq!(Record::decode(&e).map(|back| back.encode()), Ok(e));
            }
        }

        /// One flipped byte of a valid record: still a clean outcome.
        #[test]
        fn corrupted_records_decode_or_fail_cleanly(
            at in 0..RECORD_LEN, value in proptest::prelude::any::<u8>(), layer in 0u32..64,
            page in 0u32..1_000_000, room in 1u64..u64::MAX,
            slice in proptest::option::of((proptest::prelude::any::<bool>(), 0u32..64, 1u32..64)),
        ) {
            let room = RoomId::new(room).unwrap();
            let heads = slice.map(|(v, first, count)| HeadSlice {
                part: if v { KvPart::V } else { KvPart::K },
                first,
                count,
            });
            let mut b = Record::Segment(SegmentHeader { room, layer, dst_page: page, n_pages: 1, heads }).encode();
            b[at] = value;
            if let Ok(r) = Record::decode(&b) {
                // Bytes, not values: a logprob may be NaN, which is not equal to itself.
                let e = r.encode();
                proptest::prop_assert_eq!(Record::decode(&e).map(|back| back.encode()), Ok(e));
            }
        }

        /// Acks too.
        #[test]
        fn arbitrary_ack_bytes_decode_or_fail_cleanly(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), ACK_LEN)
        ) {
            let b: [u8; ACK_LEN] = bytes.try_into().unwrap();
            if let Ok(a) = Ack::decode(&b) {
                proptest::prop_assert_eq!(Ack::decode(&a.encode()), Ok(a));
            }
        }
    }
}

#[cfg(test)]
mod stream_setup_tests {
    use super::*;

    #[test]
    fn stream_setup_round_trips_and_rejects_bad_counts() {
        let s = TcpStreamSetup {
            nonce: 0xfeed_beef,
            index: 2,
            count: 3,
        };
        assert_eq!(TcpStreamSetup::decode(&s.encode()), Ok(s));
        for (index, count) in [(0, 0), (3, 3), (0, MAX_TCP_STREAMS + 1), (200, 100)] {
            let bad = TcpStreamSetup {
                nonce: 1,
                index,
                count,
            };
            let e = TcpStreamSetup::decode(&bad.encode()).unwrap_err();
            assert_eq!(e, RecordError::StreamSetup { index, count });
            assert!(
                e.to_string()
                    .contains(&format!("tcp stream {index} of {count}")),
                "{e}"
            );
        }
    }

    #[test]
    fn rooms_spread_over_every_stream() {
        let hits: std::collections::HashSet<usize> = (1..=8)
            .map(|n| stream_of(RoomId::new(n).unwrap(), 4))
            .collect();
        assert_eq!(hits.len(), 4);
        assert_eq!(stream_of(RoomId::new(9).unwrap(), 1), 0);
    }
}

#[cfg(test)]
mod nixl_setup_tests {
    use super::*;

    fn good() -> NixlSetupHead {
        NixlSetupHead {
            base: 0x7f00_0000_0000,
            len: 4096 + 8 * 5,
            pages: 4,
            generations_at: 4096,
            metadata_len: 900,
            name_len: 30,
        }
    }

    #[test]
    fn nixl_setup_round_trips() {
        assert_eq!(NixlSetupHead::decode(&good().encode()), Ok(good()));
    }

    /// A region too small for its own generation table, one that wraps the
    /// address space, no pages, and metadata of 0 or too many bytes are
    /// each refused with what was wrong.
    #[test]
    fn nixl_setup_refuses_regions_that_cannot_hold_their_table_and_bad_metadata() {
        let short = NixlSetupHead {
            len: 4096 + 8 * 4,
            ..good()
        };
        let wraps = NixlSetupHead {
            base: u64::MAX - 10,
            ..good()
        };
        let no_pages = NixlSetupHead { pages: 0, ..good() };
        let huge_table = NixlSetupHead {
            pages: u64::MAX,
            ..good()
        };
        for bad in [short, wraps, no_pages, huge_table] {
            let e = NixlSetupHead::decode(&bad.encode()).unwrap_err();
            assert!(matches!(e, NixlSetupError::Region { .. }), "{bad:?}: {e}");
            assert!(
                e.to_string().contains(&format!("{} pages", bad.pages)),
                "{e}"
            );
        }
        for n in [0, NixlSetupHead::MAX_METADATA + 1] {
            let bad = NixlSetupHead {
                metadata_len: n,
                ..good()
            };
            assert_eq!(
                NixlSetupHead::decode(&bad.encode()),
                Err(NixlSetupError::Metadata(n))
            );
        }
        for n in [0, NixlSetupHead::MAX_NAME + 1] {
            let bad = NixlSetupHead {
                name_len: n,
                ..good()
            };
            assert_eq!(
                NixlSetupHead::decode(&bad.encode()),
                Err(NixlSetupError::Name(n))
            );
        }
    }
}
