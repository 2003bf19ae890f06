//! A segment: one run of KV bytes, where it lies in the source pool and
//! where it goes in the destination pool.

use std::ops::Range;

use handoff_proto::datalink::SegmentHeader;

/// One coalesced run of pages of one layer: where it comes from in the
/// source pool and where it goes in the destination pool (byte ranges, both
/// bounds-checked before the segment is built).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Placement as the decode side sees it.
    pub header: SegmentHeader,
    /// Source byte range.
    pub src: Range<usize>,
    /// Source pages the range lies in (what a pull checks the generations
    /// of).
    pub src_pages: Range<u32>,
    /// Destination byte range.
    pub dst: Range<usize>,
}
