//! KV geometry and the byte layout of the pool (DESIGN.md §5: this is exactly
//! what the transfer layer moves).
//!
//! The pool is one plain region. It is laid out layer-major, then page, then
//! K before V; one such *block* holds `[kv_head][slot][head_dim]` elements, so a
//! head slice of a page (needed when prefill and decode TP differ) is one
//! contiguous range, and a whole (layer, page) is two adjacent blocks.

use crate::error::KvError;

/// Index of a page in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageIndex(pub u32);

/// Element type of stored K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvDtype {
    /// 32-bit float.
    F32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
        }
    }

    /// Stable name used in handshakes and logs.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
        }
    }
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvKind {
    /// Keys (stored after RoPE).
    K = 0,
    /// Values.
    V = 1,
}

/// The shape of a model's KV cache and of one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// Check every field is non-zero.
    pub fn validate(&self) -> Result<(), KvError> {
        for (name, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("page_size", self.page_size),
        ] {
            if v == 0 {
                return Err(KvError::InvalidGeometry(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        Ok(())
    }

    /// Elements in one (layer, page, K|V) block.
    pub fn block_elems(&self) -> usize {
        self.kv_heads * self.page_size * self.head_dim
    }

    /// Bytes of KV one token occupies across all layers (K and V).
    pub fn bytes_per_token(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
}

/// Geometry plus the number of pages: gives the offset of every block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Shape of the cache.
    pub geometry: KvGeometry,
    /// Pages in the pool.
    pub num_pages: usize,
}

impl KvLayout {
    /// A layout for `num_pages` pages.
    pub fn new(geometry: KvGeometry, num_pages: usize) -> Result<Self, KvError> {
        geometry.validate()?;
        if num_pages == 0 || num_pages > u32::MAX as usize {
            return Err(KvError::InvalidGeometry(format!(
                "num_pages must be in 1..={}, got {num_pages}",
                u32::MAX
            )));
        }
        let layout = Self {
            geometry,
            num_pages,
        };
        layout
            .total_elems()
            .ok_or_else(|| KvError::InvalidGeometry("pool size overflows usize".into()))?;
        Ok(layout)
    }

    fn total_elems(&self) -> Option<usize> {
        self.geometry
            .block_elems()
            .checked_mul(2)?
            .checked_mul(self.num_pages)?
            .checked_mul(self.geometry.layers)
    }

    /// Elements in the whole pool.
    pub fn pool_elems(&self) -> usize {
        self.geometry.block_elems() * 2 * self.num_pages * self.geometry.layers
    }

    /// Bytes in the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.pool_elems() * self.geometry.dtype.size()
    }

    /// Check a page index against the pool.
    pub fn check_page(&self, page: PageIndex) -> Result<(), KvError> {
        if (page.0 as usize) < self.num_pages {
            Ok(())
        } else {
            Err(KvError::PageOutOfRange {
                page: page.0,
                num_pages: self.num_pages,
            })
        }
    }

    /// Element offset of the (layer, page, kind) block. The page must be in range.
    pub fn block_offset(&self, layer: usize, page: PageIndex, kind: KvKind) -> usize {
        ((layer * self.num_pages + page.0 as usize) * 2 + kind as usize)
            * self.geometry.block_elems()
    }

    /// Byte range of the (layer, page, kind) block, checked.
    pub fn block_bytes(
        &self,
        layer: usize,
        page: PageIndex,
        kind: KvKind,
    ) -> Result<std::ops::Range<usize>, KvError> {
        self.check_page(page)?;
        if layer >= self.geometry.layers {
            return Err(KvError::InvalidGeometry(format!(
                "layer {layer} out of range for {} layers",
                self.geometry.layers
            )));
        }
        let size = self.geometry.dtype.size();
        let start = self.block_offset(layer, page, kind) * size;
        Ok(start..start + self.geometry.block_elems() * size)
    }

    /// Byte range of heads `heads` of the (layer, page, kind) block: contiguous
    /// because a block is head-major.
    pub fn head_slice_bytes(
        &self,
        layer: usize,
        page: PageIndex,
        kind: KvKind,
        heads: std::ops::Range<usize>,
    ) -> Result<std::ops::Range<usize>, KvError> {
        let block = self.block_bytes(layer, page, kind)?;
        if heads.start > heads.end || heads.end > self.geometry.kv_heads {
            return Err(KvError::InvalidGeometry(format!(
                "head range {heads:?} out of range for {} KV heads",
                self.geometry.kv_heads
            )));
        }
        let head_bytes =
            self.geometry.page_size * self.geometry.head_dim * self.geometry.dtype.size();
        Ok(block.start + heads.start * head_bytes..block.start + heads.end * head_bytes)
    }

    /// Element offset of (head, slot) within a block.
    pub fn slot_offset(&self, head: usize, slot: usize) -> usize {
        (head * self.geometry.page_size + slot) * self.geometry.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> KvGeometry {
        KvGeometry {
            layers: 3,
            kv_heads: 2,
            head_dim: 4,
            page_size: 8,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn blocks_tile_the_pool_without_overlap() {
        let layout = KvLayout::new(geo(), 5).unwrap();
        let mut ranges = Vec::new();
        for layer in 0..3 {
            for page in 0..5 {
                for kind in [KvKind::K, KvKind::V] {
                    ranges.push(layout.block_bytes(layer, PageIndex(page), kind).unwrap());
                }
            }
        }
        ranges.sort_by_key(|r| r.start);
        assert_eq!(ranges[0].start, 0);
        for w in ranges.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert_eq!(ranges.last().unwrap().end, layout.pool_bytes());
        assert_eq!(layout.pool_bytes(), 3 * 5 * 2 * 2 * 8 * 4 * 4);
    }

    #[test]
    fn head_slices_are_contiguous_parts_of_a_block() {
        let layout = KvLayout::new(geo(), 5).unwrap();
        let block = layout.block_bytes(1, PageIndex(2), KvKind::V).unwrap();
        let h0 = layout
            .head_slice_bytes(1, PageIndex(2), KvKind::V, 0..1)
            .unwrap();
        let h1 = layout
            .head_slice_bytes(1, PageIndex(2), KvKind::V, 1..2)
            .unwrap();
        assert_eq!(h0.start, block.start);
        assert_eq!(h0.end, h1.start);
        assert_eq!(h1.end, block.end);
        assert!(layout
            .head_slice_bytes(1, PageIndex(2), KvKind::V, 1..3)
            .is_err());
    }

    #[test]
    fn out_of_range_pages_and_zero_fields_are_rejected() {
        let layout = KvLayout::new(geo(), 5).unwrap();
        assert_eq!(
            layout.block_bytes(0, PageIndex(5), KvKind::K),
            Err(KvError::PageOutOfRange {
                page: 5,
                num_pages: 5
            })
        );
        let mut g = geo();
        g.page_size = 0;
        assert!(
            matches!(KvLayout::new(g, 5), Err(KvError::InvalidGeometry(m)) if m.contains("page_size"))
        );
        assert!(KvLayout::new(geo(), 0).is_err());
    }
}
