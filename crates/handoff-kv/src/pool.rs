//! The KV pool's memory: one plain f32 region addressed by [`KvLayout`].
//! A later transport maps the same region across processes (shared memory);
//! everything here works on a plain slice so the backing can change.

use crate::error::KvError;
use crate::layout::{KvGeometry, KvKind, KvLayout, PageIndex};
use crate::lease::PageAllocator;

/// A paged KV cache: memory plus the allocator of its pages.
pub struct KvPool {
    layout: KvLayout,
    memory: Vec<f32>,
    allocator: PageAllocator,
}

impl KvPool {
    /// A zeroed pool of `num_pages` pages on the heap.
    pub fn new(geometry: KvGeometry, num_pages: usize) -> Result<Self, KvError> {
        let layout = KvLayout::new(geometry, num_pages)?;
        let mut memory = Vec::new();
        memory.try_reserve_exact(layout.pool_elems()).map_err(|_| {
            KvError::InvalidGeometry(format!(
                "cannot allocate a KV pool of {} bytes",
                layout.pool_bytes()
            ))
        })?;
        memory.resize(layout.pool_elems(), 0.0);
        Ok(Self {
            layout,
            memory,
            allocator: PageAllocator::new(num_pages),
        })
    }

    /// The pool's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.layout.geometry
    }

    /// The allocator of this pool's pages.
    pub fn allocator(&self) -> &PageAllocator {
        &self.allocator
    }

    /// One (layer, page, kind) block: `[kv_head][slot][head_dim]`.
    pub fn block(&self, layer: usize, page: PageIndex, kind: KvKind) -> &[f32] {
        let off = self.layout.block_offset(layer, page, kind);
        &self.memory[off..off + self.layout.geometry.block_elems()]
    }

    /// Mutable access to one block.
    pub fn block_mut(&mut self, layer: usize, page: PageIndex, kind: KvKind) -> &mut [f32] {
        let off = self.layout.block_offset(layer, page, kind);
        let n = self.layout.geometry.block_elems();
        &mut self.memory[off..off + n]
    }

    /// The whole region as bytes (what a transport reads).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.memory)
    }

    /// The whole region as mutable bytes (what a transport writes into).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.memory)
    }

    /// Write K and V of one token at sequence position `pos` of a sequence
    /// whose pages are `pages`. `k` and `v` are `[kv_head][head_dim]`.
    pub fn write_token(
        &mut self,
        layer: usize,
        pages: &[PageIndex],
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let g = self.layout.geometry;
        let page = *pages.get(pos / g.page_size).ok_or(KvError::OutOfPages {
            needed: pos / g.page_size + 1,
            free: pages.len(),
        })?;
        self.layout.check_page(page)?;
        let slot = pos % g.page_size;
        for (kind, src) in [(KvKind::K, k), (KvKind::V, v)] {
            let layout = self.layout;
            let block = self.block_mut(layer, page, kind);
            for h in 0..g.kv_heads {
                let off = layout.slot_offset(h, slot);
                block[off..off + g.head_dim]
                    .copy_from_slice(&src[h * g.head_dim..(h + 1) * g.head_dim]);
            }
        }
        Ok(())
    }

    /// Copy keys or values of positions `0..len` of one head into `out`
    /// (contiguous `[len][head_dim]`).
    pub fn gather_head(
        &self,
        layer: usize,
        pages: &[PageIndex],
        kind: KvKind,
        head: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) {
        let g = self.layout.geometry;
        let mut left = len;
        for &page in pages {
            if left == 0 {
                break;
            }
            let n = left.min(g.page_size);
            let block = self.block(layer, page, kind);
            let off = self.layout.slot_offset(head, 0);
            out.extend_from_slice(&block[off..off + n * g.head_dim]);
            left -= n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvDtype;

    #[test]
    fn tokens_written_are_gathered_back_in_order() {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 3,
            page_size: 4,
            dtype: KvDtype::F32,
        };
        let mut pool = KvPool::new(g, 8).unwrap();
        let pages = [PageIndex(5), PageIndex(2), PageIndex(7)];
        for pos in 0..10 {
            let k: Vec<f32> = (0..6).map(|i| (pos * 100 + i) as f32).collect();
            let v: Vec<f32> = (0..6).map(|i| -((pos * 100 + i) as f32)).collect();
            pool.write_token(1, &pages, pos, &k, &v).unwrap();
        }
        let mut out = Vec::new();
        pool.gather_head(1, &pages, KvKind::K, 1, 10, &mut out);
        let want: Vec<f32> = (0..10)
            .flat_map(|p| (3..6).map(move |i| (p * 100 + i) as f32))
            .collect();
        assert_eq!(out, want);
        out.clear();
        pool.gather_head(0, &pages, KvKind::V, 0, 10, &mut out);
        assert!(out.iter().all(|&x| x == 0.0), "layer 0 untouched");
        assert!(pool
            .write_token(1, &pages, 12, &[0.0; 6], &[0.0; 6])
            .is_err());
    }
}
