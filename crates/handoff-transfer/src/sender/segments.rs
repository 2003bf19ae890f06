//! A send's (layer, page) spans as segments: runs contiguous on both
//! sides coalesce (pure).

use std::ops::Range;

use handoff_kv::{KvLayout, PageIndex};
use handoff_proto::datalink::SegmentHeader;
use handoff_proto::RoomId;

use crate::link::{page_span, span_offset};
use crate::segment::Segment;

/// Coalesce (layer, page) spans into runs contiguous on both sides.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_segments(
    room: RoomId,
    layout: &KvLayout,
    dest_pages: usize,
    layers: Range<usize>,
    pages: Range<usize>,
    src: &[PageIndex],
    dst: &[handoff_proto::PageIndex],
    max_run: usize,
) -> Vec<Segment> {
    let span = page_span(layout);
    let mut out = Vec::new();
    for layer in layers {
        let mut i = pages.start;
        while i < pages.end {
            let (s0, d0) = (src[i].0 as usize, dst[i].0 as usize);
            let mut n = 1;
            while i + n < pages.end
                && n < max_run
                && src[i + n].0 as usize == s0 + n
                && dst[i + n].0 as usize == d0 + n
            {
                n += 1;
            }
            let s = span_offset(layout, layout.num_pages, layer, s0);
            let d = span_offset(layout, dest_pages, layer, d0);
            out.push(Segment {
                header: SegmentHeader {
                    room,
                    layer: layer as u32,
                    dst_page: d0 as u32,
                    n_pages: n as u32,
                    heads: None,
                },
                src: s..s + n * span,
                src_pages: s0 as u32..(s0 + n) as u32,
                dst: d..d + n * span,
            });
            i += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kv::{KvDtype, KvGeometry};

    fn layout(pages: usize) -> KvLayout {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 1,
            head_dim: 2,
            page_size: 2,
            dtype: KvDtype::F32,
        };
        match KvLayout::new(g, pages) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    fn dst(p: &[u32]) -> Vec<handoff_proto::PageIndex> {
        p.iter().map(|x| handoff_proto::PageIndex(*x)).collect()
    }

    #[test]
    fn runs_contiguous_on_both_sides_coalesce_per_layer() {
        let l = layout(16);
        let span = page_span(&l);
        let room = RoomId::new(5).unwrap();
        let src: Vec<PageIndex> = [3, 4, 5, 9, 10].into_iter().map(PageIndex).collect();
        // Destination breaks the second run: 7, 8 | 2, 3 | 12.
        let d = dst(&[6, 7, 8, 2, 3]);
        let segs = build_segments(room, &l, 32, 0..2, 0..5, &src, &d, 64);
        let shape: Vec<(u32, u32, u32)> = segs
            .iter()
            .map(|s| (s.header.layer, s.header.dst_page, s.header.n_pages))
            .collect();
        assert_eq!(
            shape,
            vec![(0, 6, 3), (0, 2, 2), (1, 6, 3), (1, 2, 2)],
            "runs split where either side breaks"
        );
        // Byte ranges follow each pool's own page count.
        assert_eq!(
            segs[0].src,
            span_offset(&l, 16, 0, 3)..span_offset(&l, 16, 0, 3) + 3 * span
        );
        assert_eq!(
            segs[2].dst,
            span_offset(&l, 32, 1, 6)..span_offset(&l, 32, 1, 6) + 3 * span
        );
        // A run limit splits long runs; a page range sends only its pages.
        let capped = build_segments(room, &l, 32, 0..1, 0..3, &src, &d, 2);
        assert_eq!(
            capped.iter().map(|s| s.header.n_pages).collect::<Vec<_>>(),
            vec![2, 1]
        );
        let tail = build_segments(room, &l, 32, 1..2, 3..5, &src, &d, 64);
        assert_eq!(tail.len(), 1);
        assert_eq!((tail[0].header.dst_page, tail[0].header.n_pages), (2, 2));
    }
}
