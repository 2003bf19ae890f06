//! The KV pool's memory: one plain region addressed by [`KvLayout`], either
//! on the heap ([`KvPool::new`]) or in shared memory ([`KvPool::new_shared`])
//! that a transfer peer maps across processes. Elements are f32 or f16
//! ([`KvDtype`]): K and V are written from f32 and read back as f32
//! ([`KvBlock`] converts), so the model's arithmetic is f32 either way.
//! Everything here works on a plain slice so the backing can change.

use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::KvError;
use crate::layout::{KvDtype, KvGeometry, KvLayout, KvPart, PageIndex};
use crate::lease::PageAllocator;
use crate::shm::{PageGenerations, ShmRegion, ShmRegionHandle};

/// Where a pool's bytes live. The heap backing is a vector of 4-byte words
/// so every dtype's view of it is aligned.
enum Backing {
    Heap(Vec<f32>),
    Shared(Arc<ShmRegion>),
}

/// One block (or a run of it) of a pool, in the pool's element type.
///
/// Not a view: a block's elements are only ever copied out
/// ([`Self::extend_f32`], [`Self::to_f32`]). A shared pool's bytes are
/// reachable by safe writers on other threads ([`ShmRegion::write_at`],
/// [`ShmRegion::copy_from`], [`ShmRegion::readv_into`], all raw copies
/// under a page lease or writer guard), so no `&[u8]` of them may exist
/// in safe code: a reference promises bytes that do not change while it
/// lives. Reading through the region's bounds-checked raw copies keeps
/// that promise out of the picture; which pages are written while the
/// model reads others is the leases' business, not the type system's.
///
/// ```compile_fail
/// # use handoff_kv::{KvBlock, KvDtype, KvGeometry, KvPart, KvPool, PageIndex};
/// # let g = KvGeometry { layers: 1, kv_heads: 1, head_dim: 2, page_size: 2, dtype: KvDtype::F32 };
/// let (pool, _) = KvPool::new_shared(g, 2).unwrap();
/// // There is no slice to take out of a block.
/// let view: &[f32] = match pool.block(0, PageIndex(0), KvPart::K) {
///     KvBlock::F32(s) => s,
///     _ => unreachable!(),
/// };
/// ```
#[derive(Debug, Clone, Copy)]
pub struct KvBlock<'a> {
    memory: BlockMemory<'a>,
    elem: Elem,
    /// Byte offset in the pool's memory.
    start: usize,
    /// Elements.
    len: usize,
}

/// Where a [`KvBlock`]'s bytes are read from.
#[derive(Debug, Clone, Copy)]
enum BlockMemory<'a> {
    /// A heap pool's words (private to this process, borrowed).
    Heap(&'a [u8]),
    /// A shared pool's region, read by copies only.
    Shared(&'a ShmRegion),
}

impl<'a> KvBlock<'a> {
    /// Elements in the block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `range` of this block.
    ///
    /// # Panics
    ///
    /// When `range` does not lie inside the block.
    pub fn slice(self, range: std::ops::Range<usize>) -> KvBlock<'a> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "elements {range:?} of a block of {}",
            self.len
        );
        KvBlock {
            start: self.start + range.start * self.elem.bytes(),
            len: range.len(),
            ..self
        }
    }

    /// The elements as f32, copied (converted from f16 when they are) into
    /// `scratch`.
    pub fn to_f32(self, scratch: &mut Vec<f32>) -> &[f32] {
        scratch.clear();
        self.extend_f32(scratch);
        scratch
    }

    /// Append the elements, as f32, to `out`.
    pub fn extend_f32(self, out: &mut Vec<f32>) {
        let from = out.len();
        out.resize(from + self.len, 0.0);
        let dst = &mut out[from..];
        let bytes = self.len * self.elem.bytes();
        match (self.memory, self.elem) {
            (BlockMemory::Heap(b), Elem::F32) => {
                dst.copy_from_slice(bytemuck::cast_slice(&b[self.start..self.start + bytes]))
            }
            (BlockMemory::Heap(b), Elem::F16) => {
                bytemuck::cast_slice::<u8, f16>(&b[self.start..self.start + bytes])
                    .convert_to_f32_slice(dst)
            }
            (BlockMemory::Shared(r), Elem::F32) => r
                .read_at(self.start, bytemuck::cast_slice_mut(dst))
                .expect("block inside its pool"),
            (BlockMemory::Shared(r), Elem::F16) => r
                .read_f16_as_f32(self.start, dst)
                .expect("block inside its pool"),
        }
    }
}

/// A paged KV cache: memory plus the allocator of its pages.
pub struct KvPool {
    layout: KvLayout,
    elem: Elem,
    memory: Backing,
    allocator: PageAllocator,
}

/// The element types a pool stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
}

impl Elem {
    fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 => 2,
        }
    }
}

/// The layout of a pool this module can hold, and its element type.
fn pool_layout(geometry: KvGeometry, num_pages: usize) -> Result<(KvLayout, Elem), KvError> {
    let elem = match geometry.dtype {
        KvDtype::F32 => Elem::F32,
        KvDtype::F16 => Elem::F16,
        other => {
            return Err(KvError::UnsupportedDtype {
                dtype: other.name(),
            })
        }
    };
    Ok((KvLayout::new(geometry, num_pages)?, elem))
}

impl KvPool {
    /// A zeroed pool of `num_pages` pages on the heap.
    pub fn new(geometry: KvGeometry, num_pages: usize) -> Result<Self, KvError> {
        let (layout, elem) = pool_layout(geometry, num_pages)?;
        // Pools are whole 4-byte words: every block count is even (K and V).
        let words = layout.pool_bytes().div_ceil(4);
        let mut memory = Vec::new();
        memory.try_reserve_exact(words).map_err(|_| {
            KvError::InvalidGeometry(format!(
                "cannot allocate a KV pool of {} bytes",
                layout.pool_bytes()
            ))
        })?;
        memory.resize(words, 0.0);
        Ok(Self {
            layout,
            elem,
            memory: Backing::Heap(memory),
            allocator: PageAllocator::new(num_pages),
        })
    }

    /// A zeroed pool of `num_pages` pages in shared memory (memfd), and the
    /// handle another process on this host maps it with. The region holds
    /// the KV bytes and, after them ([`Self::generations_offset`]), the
    /// pages' [`PageGenerations`], which the allocator stamps as it hands
    /// pages out.
    pub fn new_shared(
        geometry: KvGeometry,
        num_pages: usize,
    ) -> Result<(Self, ShmRegionHandle), KvError> {
        let (layout, elem) = pool_layout(geometry, num_pages)?;
        let gens_at = Self::generations_offset(&layout);
        let region = Arc::new(ShmRegion::create(
            crate::shm::POOL_MEMFD_NAME,
            gens_at + PageGenerations::table_bytes(num_pages),
        )?);
        let handle = region.handle();
        let gens = PageGenerations::new(region.clone(), gens_at, num_pages)?;
        Ok((
            Self {
                layout,
                elem,
                memory: Backing::Shared(region),
                allocator: PageAllocator::with_generations(num_pages, gens),
            },
            handle,
        ))
    }

    /// Where a shared pool of `layout` keeps its page generations: after
    /// its KV bytes, 8-aligned.
    pub fn generations_offset(layout: &KvLayout) -> usize {
        layout.pool_bytes().next_multiple_of(8)
    }

    /// The shared region behind this pool, if it is shared. Transports
    /// copy into leased pages (decode) and read computed pages (prefill)
    /// through it.
    pub fn shared_region(&self) -> Option<&Arc<ShmRegion>> {
        match &self.memory {
            Backing::Heap(_) => None,
            Backing::Shared(r) => Some(r),
        }
    }

    /// The page generations of a shared pool.
    pub fn generations(&self) -> Option<&PageGenerations> {
        self.allocator.generations()
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
    pub fn block(&self, layer: usize, page: PageIndex, kind: KvPart) -> KvBlock<'_> {
        let len = self.layout.geometry.block_elems();
        let start = self.layout.block_offset(layer, page, kind) * self.elem.bytes();
        let memory = match &self.memory {
            Backing::Heap(words) => BlockMemory::Heap(bytemuck::cast_slice(words)),
            Backing::Shared(r) => BlockMemory::Shared(r),
        };
        let block = KvBlock {
            memory,
            elem: self.elem,
            start,
            len,
        };
        // In bounds for every page the layout knows (checked once here, so
        // a bad page index fails at the call, not at a later copy).
        assert!(
            start + len * self.elem.bytes() <= self.layout.pool_bytes(),
            "block of page {page:?} inside its pool"
        );
        block
    }

    /// Bytes `range` of the KV region, copied out (what a transport
    /// would move; tests and tools).
    pub fn read_bytes(&self, range: std::ops::Range<usize>) -> Result<Vec<u8>, KvError> {
        let mut out = vec![0u8; range.len()];
        match &self.memory {
            Backing::Heap(v) => out.copy_from_slice(
                bytemuck::cast_slice::<f32, u8>(v)
                    .get(range.clone())
                    .ok_or(KvError::OutOfBounds {
                        start: range.start,
                        end: range.end,
                        len: 4 * v.len(),
                    })?,
            ),
            Backing::Shared(r) => r.read_at(range.start, &mut out)?,
        }
        Ok(out)
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
        let layout = self.layout;
        let elem = self.elem;
        let mut half_row: Vec<f16> = Vec::new();
        for (kind, src) in [(KvPart::K, k), (KvPart::V, v)] {
            let base = layout.block_offset(layer, page, kind);
            for h in 0..g.kv_heads {
                let off = base + layout.slot_offset(h, slot);
                let src = &src[h * g.head_dim..(h + 1) * g.head_dim];
                let row: &[u8] = match elem {
                    Elem::F32 => bytemuck::cast_slice(src),
                    Elem::F16 => {
                        half_row.clear();
                        half_row.resize(src.len(), f16::ZERO);
                        half_row.convert_from_f32_slice(src);
                        bytemuck::cast_slice(&half_row)
                    }
                };
                let at = off * elem.bytes();
                match &mut self.memory {
                    Backing::Heap(words) => bytemuck::cast_slice_mut::<f32, u8>(words)
                        [at..at + row.len()]
                        .copy_from_slice(row),
                    // The page is the caller's (its sequence's lease): a
                    // raw copy, no reference into shared memory.
                    Backing::Shared(r) => r.write_at(at, row)?,
                }
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
            let off = self.layout.slot_offset(head, 0);
            self.block(layer, page, kind)
                .slice(off..off + n * g.head_dim)
                .extend_f32(out);
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
        assert_eq!(
            handle.len as usize,
            pool.layout().pool_bytes() + PageGenerations::table_bytes(4)
        );
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
        let mut scratch = Vec::new();
        assert_eq!(
            pool.block(0, PageIndex(0), KvPart::V).to_f32(&mut scratch),
            &[9.0, 8.0, 7.0, 6.0]
        );
        assert!(pool.shared_region().is_some());
        assert!(KvPool::new(g, 4).unwrap().shared_region().is_none());
    }

    #[test]
    fn an_f16_pool_holds_half_the_bytes_and_reads_back_what_f16_can_hold() {
        let g = |dtype| KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            page_size: 2,
            dtype,
        };
        let f32_pool = KvPool::new(g(KvDtype::F32), 3).unwrap();
        let (mut pool, handle) = KvPool::new_shared(g(KvDtype::F16), 3).unwrap();
        assert_eq!(
            2 * pool.layout().pool_bytes(),
            f32_pool.layout().pool_bytes()
        );
        assert_eq!(
            handle.len as usize,
            KvPool::generations_offset(pool.layout()) + PageGenerations::table_bytes(3)
        );
        let pages = [PageIndex(2), PageIndex(0)];
        // Exactly representable in f16, and one value that is not.
        let k: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let v: Vec<f32> = vec![1.0 / 3.0; 8];
        pool.write_token(1, &pages, 3, &k, &v).unwrap();
        let mut out = Vec::new();
        pool.gather_head(1, &pages, KvPart::K, 1, 4, &mut out);
        // Positions 0..3 untouched, position 3 is head 1's keys.
        assert_eq!(&out[..12], &[0.0; 12]);
        assert_eq!(&out[12..], &k[4..]);
        out.clear();
        pool.gather_head(1, &pages, KvPart::V, 0, 4, &mut out);
        let third = half::f16::from_f32(1.0 / 3.0).to_f32();
        assert_ne!(third, 1.0 / 3.0);
        assert_eq!(&out[12..], &[third; 4]);
        // The bytes a transport moves are the f16 bits, in the block's place.
        let range = pool
            .layout()
            .head_slice_bytes(1, PageIndex(0), KvPart::K, 1..2)
            .unwrap();
        assert_eq!(range.len(), 2 * 4 * 2, "2 slots x 4 dims x 2 bytes");
        let raw = &pool.read_bytes(range).unwrap();
        let slot1: Vec<f32> = raw[8..]
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(slot1, &k[4..]);
    }

    #[test]
    fn a_shared_pools_allocator_stamps_every_page_it_hands_out() {
        let g = KvGeometry {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::F16,
        };
        let (pool, _) = KvPool::new_shared(g, 4).unwrap();
        let gens = pool.generations().unwrap();
        let a = pool.allocator().lease(2).unwrap();
        let e = gens.epoch();
        let pages = |l: &crate::PageLease| l.pages()[0].0..l.pages()[0].0 + 1;
        assert_eq!(gens.unchanged_since(pages(&a), e), Some(true));
        let first = pages(&a);
        drop(a);
        // The same page handed out again (exactly, or by a plain lease).
        let b = pool
            .allocator()
            .lease_exact(&[PageIndex(first.start)])
            .unwrap();
        assert_eq!(gens.unchanged_since(first.clone(), e), Some(false));
        let e2 = gens.epoch();
        let mut c = pool.allocator().lease(0).unwrap();
        c.grow(pool.allocator(), 1).unwrap();
        assert_eq!(gens.unchanged_since(pages(&c), e2), Some(false));
        assert_eq!(gens.unchanged_since(first, e2), Some(true));
        drop((b, c));
        assert!(KvPool::new(g, 4).unwrap().generations().is_none());
    }

    /// A block is read by copies: a write into the shared region after the
    /// block was taken shows in what it reads next (it is not a snapshot,
    /// and no reference to the bytes is held across the write), for both
    /// element types; and no byte copy reaches the generation table, in
    /// the owner's mapping or a peer's.
    #[test]
    fn blocks_read_by_copy_and_no_copy_touches_the_generation_table() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let g = KvGeometry {
                layers: 1,
                kv_heads: 1,
                head_dim: 300,
                page_size: 2,
                dtype,
            };
            let (pool, handle) = KvPool::new_shared(g, 2).unwrap();
            let region = pool.shared_region().unwrap();
            let block = pool.block(0, PageIndex(1), KvPart::V);
            assert_eq!(block.len(), 600);
            let mut out = Vec::new();
            block.extend_f32(&mut out);
            assert_eq!(out, vec![0.0; 600]);
            // Write 600 values under the block, after it was taken.
            let want: Vec<f32> = (0..600).map(|i| i as f32 - 300.0).collect();
            let bytes: Vec<u8> = match dtype {
                KvDtype::F32 => bytemuck::cast_slice(&want).to_vec(),
                _ => want
                    .iter()
                    .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            let at = pool
                .layout()
                .block_bytes(0, PageIndex(1), KvPart::V)
                .unwrap();
            region.write_at(at.start, &bytes).unwrap();
            let mut scratch = Vec::new();
            assert_eq!(block.to_f32(&mut scratch), &want[..]);
            assert_eq!(block.slice(10..13).to_f32(&mut scratch), &want[10..13]);

            let table = KvPool::generations_offset(pool.layout());
            let peer = ShmRegion::open_read_only(&handle).unwrap();
            PageGenerations::new(Arc::new(ShmRegion::open(&handle).unwrap()), table, 2).unwrap();
            let peer_gens = Arc::new(peer);
            PageGenerations::new(peer_gens.clone(), table, 2).unwrap();
            let refused = |r: Result<(), KvError>| {
                let e = r.expect_err("a copy over the generation table");
                assert!(e.to_string().contains("atomic words"), "{e}");
            };
            let mut word = [0u8; 8];
            refused(region.write_at(table, &[1u8; 8]));
            refused(region.read_at(table + 8, &mut word));
            refused(peer_gens.read_at(table - 4, &mut word));
            refused(region.copy_from(0, &peer_gens, table, 8));
            refused(region.copy_from(table, region, 0, 8));
            // The byte before the table is still KV.
            region.read_at(table - 1, &mut word[..1]).unwrap();
            // Another table range on the same region is refused.
            assert!(PageGenerations::new(region.clone(), table - 8, 2).is_err());
        }
    }

    #[test]
    fn a_dtype_the_pool_cannot_store_is_refused_by_name() {
        let g = KvGeometry {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::Bf16,
        };
        assert_eq!(
            KvPool::new(g, 4).err(),
            Some(KvError::UnsupportedDtype { dtype: "bf16" })
        );
        assert!(KvPool::new_shared(g, 4).is_err());
    }
}
