//! What a K-quant register tile reads: the format trait, the tile and the
//! Q4_K and Q6_K group-block layouts, shared by the matrix (`kquant/`) and
//! its kernels (`simd/kquant.rs`). Each layout is described in its format's
//! file (`kquant/q4k.rs`, `kquant/q6k.rs`), beside its packing and
//! arithmetic.

use crate::simd::Q8Path;

/// Weight rows per group (one 32-bit lane each in a 256-bit vector).
pub(crate) const GROUP: usize = 8;

/// A repacked K-quant format.
pub trait Format: Sized + Send + Sync + 'static {
    /// One group-block: its quants and scales together (a decode step
    /// reads a matrix as one sequential stream: a second stream of scales
    /// cost a quarter of the read rate on Zen 4, `kquant_bandwidth`).
    type B: bytemuck::Pod + Send + Sync;
    /// Its GGUF type.
    const DTYPE: candle_core::quantized::GgmlDType;
    /// Bytes of one block in the file.
    const BLOCK_BYTES: usize;
    /// Whether the kernels read the activation's sums per 16 quants
    /// ([`Tile::bs16`]).
    const SUMS16: bool;
    /// Repack one row's block `blk` (as the file holds it) as row `r` of
    /// a group-block.
    fn pack(blk: &[u8], r: usize, b: &mut Self::B);
    /// The portable kernel: the format's arithmetic, element by element.
    fn portable<const G: usize, const C: usize>(t: &Tile<'_, Self, G, C>)
        -> [[[f32; GROUP]; C]; G];
    /// A run-time chosen SIMD kernel (`None`: run the portable one).
    fn simd<const G: usize, const C: usize>(
        path: Q8Path,
        t: &Tile<'_, Self, G, C>,
    ) -> Option<[[[f32; GROUP]; C]; G]>;
}

/// What a register tile reads: `G` groups and `C` activation rows (every
/// slice holds at least `blocks` of its units).
pub struct Tile<'a, F: Format, const G: usize, const C: usize> {
    /// Group-blocks, `[block]` per group.
    pub(crate) w: [&'a [F::B]; G],
    /// Activation words, `[block · 64]` per row.
    pub(crate) x: [&'a [i32]; C],
    /// Activation pair sums, `[block · 4]` per row.
    pub(crate) bs: [&'a [i32]; C],
    /// Activation scales, `[block]` per row.
    pub(crate) xd: [&'a [f32]; C],
    /// 32 × each 16 activation quants' sum, `[block · 16]` per row (empty
    /// unless the format's [`Format::SUMS16`]).
    pub(crate) bs16: [&'a [i32]; C],
    /// Blocks per row.
    pub(crate) blocks: usize,
}

impl<F: Format, const G: usize, const C: usize> Clone for Tile<'_, F, G, C> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F: Format, const G: usize, const C: usize> Copy for Tile<'_, F, G, C> {}

/// Vectors per group and block: 4 pairs of sub-blocks × 8 words.
pub(crate) const VECS: usize = 32;

/// One group-block's nibbles, interleaved.
pub(crate) type Nibbles = [[u8; 32]; VECS];

/// One group-block's scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Meta {
    /// Each row's `d`, f16 bits.
    pub(crate) d: [u16; GROUP],
    /// Each row's `dmin`, f16 bits.
    pub(crate) dmin: [u16; GROUP],
    /// `[sub-block][row]`: the 6-bit scales.
    pub(crate) sc: [[u8; GROUP]; 8],
    /// `[pair][2·row + k]`: the 6-bit minimum of sub-block `2·pair + k`
    /// (widened to i16 pairs against the activation's pair of sums:
    /// `vpmaddwd`).
    pub(crate) m: [[u8; 2 * GROUP]; 4],
}

/// One Q4_K group-block: scales, then nibbles (in the order a kernel
/// reads them: scales at the end of a block are read before the stream
/// prefetch reaches them, and a decode step waited on them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q4kBlock {
    /// The scales.
    pub(crate) m: Meta,
    /// The interleaved nibbles.
    pub(crate) q: Nibbles,
}

/// The Q4_K format.
pub struct Q4k;

/// One group-block of Q6_K: per sub-block, 2 vectors of interleaved low
/// nibbles and one of interleaved high bit pairs (`kquant/q6k.rs`).
pub(crate) type Q6Quants = [[u8; 32]; 48];

/// One group-block's Q6_K scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q6Meta {
    /// Each row's `d`, f16 bits.
    pub(crate) d: [u16; GROUP],
    /// `[sub-block][row]`: the 8-bit signed scales of the 16 sub-blocks.
    pub(crate) sc: [[i8; GROUP]; 16],
}

/// One Q6_K group-block: scales, then quants (as [`Q4kBlock`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q6kBlock {
    /// The scales.
    pub(crate) m: Q6Meta,
    /// The interleaved quants.
    pub(crate) q: Q6Quants,
}

/// The Q6_K format.
pub struct Q6k;
