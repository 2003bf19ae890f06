//! Where a (layer, page) span lies in a pool.

use handoff_kv::{KvLayout, KvPart, PageIndex, PageLayout};

/// Bytes of one (layer, page): its K and V blocks, adjacent in the layout.
pub fn page_span(layout: &KvLayout) -> usize {
    2 * layout.page_layout().block_bytes()
}

/// Byte offset of (layer, page) in a pool of `num_pages` pages (its K
/// block, which its V block follows).
pub fn span_offset(layout: &KvLayout, num_pages: usize, layer: usize, page: usize) -> usize {
    let l = PageLayout {
        num_pages: num_pages as u32,
        ..layout.page_layout()
    };
    l.block_index(layer as u32, PageIndex(page as u32), KvPart::K) * l.block_bytes()
}
