//! The KV pool's vocabulary and layout math, in one place: element type,
//! K or V, and the byte offset of every block. handoff-kv's
//! pool, the rank map's head slices, the transfer plans and the binary's
//! memory sizing all compute through [`PageLayout`].
//!
//! A pool is one plain region laid out layer-major, then page, then K before
//! V; one such *block* holds `[kv_head][token_slot][head_dim]` elements, so
//! the slice of a page for a run of heads is one contiguous byte range, and a
//! whole (layer, page) is two adjacent blocks.

use std::ops::Range;

use crate::error::RankError;
use crate::ids::PageIndex;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, E4M3.
    F8E4M3,
    /// 8-bit float, E5M2.
    F8E5M2,
}

impl KvDtype {
    /// Every dtype.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::F8E4M3,
        KvDtype::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F8E4M3 | KvDtype::F8E5M2 => 1,
        }
    }

    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F8E4M3 => "f8e4m3",
            KvDtype::F8E5M2 => "f8e5m2",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::Bf16 => 2,
            KvDtype::F8E4M3 => 3,
            KvDtype::F8E5M2 => 4,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        KvDtype::ALL.into_iter().find(|d| d.code() == code)
    }
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// Keys (stored after RoPE).
    K = 0,
    /// Values.
    V = 1,
}

/// One rank's pool geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLayout {
    /// Layers.
    pub layers: u32,
    /// KV heads held by this rank.
    pub local_heads: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Pages in the pool.
    pub num_pages: u32,
}

impl PageLayout {
    /// Bytes of one head in one block (`page_size × head_dim × dtype`).
    pub fn head_bytes(&self) -> usize {
        self.page_size as usize * self.head_dim as usize * self.dtype_bytes as usize
    }

    /// Bytes of one (layer, page, K|V) block.
    pub fn block_bytes(&self) -> usize {
        self.local_heads as usize * self.head_bytes()
    }

    /// Bytes of the whole pool, or `None` on overflow.
    pub fn pool_bytes(&self) -> Option<usize> {
        self.block_bytes()
            .checked_mul(2)?
            .checked_mul(self.num_pages as usize)?
            .checked_mul(self.layers as usize)
    }

    /// Bytes of one page over every layer, K and V.
    pub fn page_bytes(&self) -> usize {
        2 * self.layers as usize * self.block_bytes()
    }

    /// The position of the (layer, page, part) block among the pool's
    /// blocks, unchecked: layer-major, then page, then K before V. Every
    /// offset into a pool, in bytes here or in elements in handoff-kv, is
    /// this times a block's size.
    pub fn block_index(&self, layer: u32, page: PageIndex, part: KvPart) -> usize {
        ((layer as usize * self.num_pages as usize + page.0 as usize) * 2) + part as usize
    }

    /// Byte offset of the (layer, page, part) block.
    pub fn block_offset(
        &self,
        layer: u32,
        page: PageIndex,
        part: KvPart,
    ) -> Result<usize, RankError> {
        if layer >= self.layers {
            return Err(RankError::OutOfRange { what: "layer" });
        }
        if page.0 >= self.num_pages {
            return Err(RankError::OutOfRange { what: "page" });
        }
        self.block_index(layer, page, part)
            .checked_mul(self.block_bytes())
            .ok_or(RankError::OutOfRange { what: "offset" })
    }

    /// The byte range of `num_heads` heads from local head `first` in a block.
    pub fn head_range(
        &self,
        layer: u32,
        page: PageIndex,
        part: KvPart,
        first: u32,
        num_heads: u32,
    ) -> Result<Range<usize>, RankError> {
        if first
            .checked_add(num_heads)
            .is_none_or(|end| end > self.local_heads)
        {
            return Err(RankError::OutOfRange { what: "head" });
        }
        let start = self.block_offset(layer, page, part)? + first as usize * self.head_bytes();
        Ok(start..start + num_heads as usize * self.head_bytes())
    }
}
