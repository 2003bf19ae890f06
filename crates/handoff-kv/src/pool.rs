//! The KV pool's memory: one plain f32 region addressed by [`KvLayout`],
//! either on the heap ([`KvPool::new`]) or in shared memory
//! ([`KvPool::new_shared`]) that a transfer peer maps across processes.
//! Everything here works on a plain slice so the backing can change.

use std::sync::Arc;

use crate::error::KvError;
use crate::layout::{KvDtype, KvGeometry, KvLayout, KvPart, PageIndex};
use crate::lease::PageAllocator;
use crate::shm::{ShmRegion, ShmRegionHandle};

/// Where a pool's bytes live.
enum Backing {
    Heap(Vec<f32>),
    Shared(Arc<ShmRegion>),
}

/// A paged KV cache: memory plus the allocator of its pages.
pub struct KvPool {
    layout: KvLayout,
    memory: Backing,
    allocator: PageAllocator,
}

/// The layout of a pool this module can hold: its memory is f32.
fn pool_layout(geometry: KvGeometry, num_pages: usize) -> Result<KvLayout, KvError> {
    if geometry.dtype != KvDtype::F32 {
        return Err(KvError::UnsupportedDtype {
            dtype: geometry.dtype.name(),
        });
    }
    KvLayout::new(geometry, num_pages)
}

impl KvPool {
    /// A zeroed pool of `num_pages` pages on the heap.
    pub fn new(geometry: KvGeometry, num_pages: usize) -> Result<Self, KvError> {
        let layout = pool_layout(geometry, num_pages)?;
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
            memory: Backing::Heap(memory),
            allocator: PageAllocator::new(num_pages),
        })
    }

    /// A zeroed pool of `num_pages` pages in shared memory (memfd), and the
    /// handle another process on this host maps it with.
    pub fn new_shared(
        geometry: KvGeometry,
        num_pages: usize,
    ) -> Result<(Self, ShmRegionHandle), KvError> {
        let layout = pool_layout(geometry, num_pages)?;
        let region = ShmRegion::create(crate::shm::POOL_MEMFD_NAME, layout.pool_bytes())?;
        let handle = region.handle();
        Ok((
            Self {
                layout,
                memory: Backing::Shared(Arc::new(region)),
                allocator: PageAllocator::new(num_pages),
            },
            handle,
        ))
    }

    /// The shared region behind this pool, if it is shared. Transports
    /// write into (and read from) leased pages through it.
    pub fn shared_region(&self) -> Option<&Arc<ShmRegion>> {
        match &self.memory {
            Backing::Heap(_) => None,
            Backing::Shared(r) => Some(r),
        }
    }

    fn elems(&self) -> &[f32] {
        match &self.memory {
            Backing::Heap(v) => v,
            Backing::Shared(r) => r.as_f32(),
        }
    }

    fn elems_mut(&mut self) -> &mut [f32] {
        match &mut self.memory {
            Backing::Heap(v) => v,
            // A transport may hold the region too: the view is tied to
            // `&mut self`, the pool owner's exclusive borrow.
            Backing::Shared(r) => r.as_f32_owner_mut(),
        }
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
    pub fn block(&self, layer: usize, page: PageIndex, kind: KvPart) -> &[f32] {
        let off = self.layout.block_offset(layer, page, kind);
        &self.elems()[off..off + self.layout.geometry.block_elems()]
    }

    /// Mutable access to one block.
    pub fn block_mut(&mut self, layer: usize, page: PageIndex, kind: KvPart) -> &mut [f32] {
        let off = self.layout.block_offset(layer, page, kind);
        let n = self.layout.geometry.block_elems();
        &mut self.elems_mut()[off..off + n]
    }

    /// The whole region as bytes (what a transport reads).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.elems())
    }

    /// The whole region as mutable bytes (what a transport writes into).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self.elems_mut())
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
        for (kind, src) in [(KvPart::K, k), (KvPart::V, v)] {
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
        kind: KvPart,
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
        pool.gather_head(1, &pages, KvPart::K, 1, 10, &mut out);
        let want: Vec<f32> = (0..10)
            .flat_map(|p| (3..6).map(move |i| (p * 100 + i) as f32))
            .collect();
        assert_eq!(out, want);
        out.clear();
        pool.gather_head(0, &pages, KvPart::V, 0, 10, &mut out);
        assert!(out.iter().all(|&x| x == 0.0), "layer 0 untouched");
        assert!(pool
            .write_token(1, &pages, 12, &[0.0; 6], &[0.0; 6])
            .is_err());
    }

    #[test]
    fn shared_pool_is_visible_from_a_second_mapping() {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::F32,
        };
        let (mut pool, handle) = KvPool::new_shared(g, 4).unwrap();
        assert_eq!(handle.len as usize, pool.layout().pool_bytes());
        let peer = crate::shm::ShmRegion::open(&handle).unwrap();
        let pages = [PageIndex(3)];
        pool.write_token(1, &pages, 1, &[1.5, 2.5], &[3.5, 4.5])
            .unwrap();
        let range = pool
            .layout()
            .block_bytes(1, PageIndex(3), KvPart::K)
            .unwrap();
        let mut raw = vec![0u8; range.len()];
        peer.read_at(range.start, &mut raw).unwrap();
        let floats: &[f32] = bytemuck::cast_slice(&raw);
        assert_eq!(floats, &[0.0, 0.0, 1.5, 2.5]);
        // The peer writes V of layer 0, page 0; the owner reads it.
        let v = pool
            .layout()
            .block_bytes(0, PageIndex(0), KvPart::V)
            .unwrap();
        peer.write_at(v.start, bytemuck::cast_slice(&[9.0f32, 8.0, 7.0, 6.0]))
            .unwrap();
        assert_eq!(
            pool.block(0, PageIndex(0), KvPart::V),
            &[9.0, 8.0, 7.0, 6.0]
        );
        assert!(pool.shared_region().is_some());
        assert!(KvPool::new(g, 4).unwrap().shared_region().is_none());
    }

    #[test]
    fn a_dtype_the_pool_cannot_store_is_refused_by_name() {
        let g = KvGeometry {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::F16,
        };
        assert_eq!(
            KvPool::new(g, 4).err(),
            Some(KvError::UnsupportedDtype { dtype: "f16" })
        );
        assert!(KvPool::new_shared(g, 4).is_err());
    }
}
