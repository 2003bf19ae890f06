//! KV geometry and the pool's layout: exactly what the transfer layer
//! moves.
//!
//! The ids, the dtype and the block order are handoff-proto's
//! ([`handoff_proto::layout`]), so the pool, the rank map's head slices and
//! the transfer plans compute every offset the same way: layer-major, then
//! page, then K before V, each block `[kv_head][slot][head_dim]`.

pub use handoff_proto::layout::{KvDtype, KvPart, PageLayout};
pub use handoff_proto::PageIndex;

use crate::error::KvError;

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
    /// Check every field is non-zero and fits the layout's `u32`s.
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
            if u32::try_from(v).is_err() {
                return Err(KvError::InvalidGeometry(format!(
                    "{name} {v} does not fit in 32 bits"
                )));
            }
        }
        Ok(())
    }

    /// This geometry with `local_heads` heads per block over `num_pages`
    /// pages, as the layout math sees it (a TP rank's share of a pool, or
    /// the whole of it); `None` when a size does not fit in 32 bits.
    pub fn page_layout(&self, local_heads: usize, num_pages: usize) -> Option<PageLayout> {
        Some(PageLayout {
            layers: u32::try_from(self.layers).ok()?,
            local_heads: u32::try_from(local_heads).ok()?,
            page_size: u32::try_from(self.page_size).ok()?,
            head_dim: u32::try_from(self.head_dim).ok()?,
            dtype_bytes: u32::try_from(self.dtype.bytes()).ok()?,
            num_pages: u32::try_from(num_pages).ok()?,
        })
    }

    /// Bytes of one page (every layer, K and V, all `kv_heads`).
    pub fn page_bytes(&self) -> usize {
        self.page_layout(self.kv_heads, 1)
            .map_or(usize::MAX, |l| l.page_bytes())
    }

    /// Elements in one (layer, page, K|V) block.
    pub fn block_elems(&self) -> usize {
        self.kv_heads * self.page_size * self.head_dim
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
        geometry
            .page_layout(geometry.kv_heads, num_pages)
            .and_then(|l| l.pool_bytes())
            .ok_or_else(|| KvError::InvalidGeometry("pool size overflows usize".into()))?;
        Ok(Self {
            geometry,
            num_pages,
        })
    }

    /// The whole pool as the layout math sees it (every KV head).
    pub fn page_layout(&self) -> PageLayout {
        self.geometry
            .page_layout(self.geometry.kv_heads, self.num_pages)
            .expect("checked by KvLayout::new")
    }

    /// Bytes in the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.page_layout()
            .pool_bytes()
            .expect("checked by KvLayout::new")
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
    pub fn block_offset(&self, layer: usize, page: PageIndex, kind: KvPart) -> usize {
        self.page_layout().block_index(layer as u32, page, kind) * self.geometry.block_elems()
    }

    /// Byte range of the (layer, page, kind) block, checked.
    pub fn block_bytes(
        &self,
        layer: usize,
        page: PageIndex,
        kind: KvPart,
    ) -> Result<std::ops::Range<usize>, KvError> {
        self.check_page(page)?;
        self.check_layer(layer)?;
        let l = self.page_layout();
        let start = l
            .block_offset(layer as u32, page, kind)
            .map_err(|e| KvError::InvalidGeometry(e.to_string()))?;
        Ok(start..start + l.block_bytes())
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer < self.geometry.layers {
            Ok(())
        } else {
            Err(KvError::InvalidGeometry(format!(
                "layer {layer} out of range for {} layers",
                self.geometry.layers
            )))
        }
    }

    /// Byte range of heads `heads` of the (layer, page, kind) block: contiguous
    /// because a block is head-major.
    pub fn head_slice_bytes(
        &self,
        layer: usize,
        page: PageIndex,
        kind: KvPart,
        heads: std::ops::Range<usize>,
    ) -> Result<std::ops::Range<usize>, KvError> {
        self.check_page(page)?;
        self.check_layer(layer)?;
        if heads.start > heads.end || heads.end > self.geometry.kv_heads {
            return Err(KvError::InvalidGeometry(format!(
                "head range {heads:?} out of range for {} KV heads",
                self.geometry.kv_heads
            )));
        }
        self.page_layout()
            .head_range(
                layer as u32,
                page,
                kind,
                heads.start as u32,
                (heads.end - heads.start) as u32,
            )
            .map_err(|e| KvError::InvalidGeometry(e.to_string()))
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
                for kind in [KvPart::K, KvPart::V] {
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
        let block = layout.block_bytes(1, PageIndex(2), KvPart::V).unwrap();
        let h0 = layout
            .head_slice_bytes(1, PageIndex(2), KvPart::V, 0..1)
            .unwrap();
        let h1 = layout
            .head_slice_bytes(1, PageIndex(2), KvPart::V, 1..2)
            .unwrap();
        assert_eq!(h0.start, block.start);
        assert_eq!(h0.end, h1.start);
        assert_eq!(h1.end, block.end);
        assert!(layout
            .head_slice_bytes(1, PageIndex(2), KvPart::V, 1..3)
            .is_err());
    }

    #[test]
    fn out_of_range_pages_and_zero_fields_are_rejected() {
        let layout = KvLayout::new(geo(), 5).unwrap();
        assert_eq!(
            layout.block_bytes(0, PageIndex(5), KvPart::K),
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
