//! What a Q8_0 register tile reads: the layout the matrix (`q8_matmul.rs`)
//! and its kernels (`simd/`) share.

/// Elements per Q8_0 block.
pub const QK: usize = 32;
/// Weight rows per group (one 32-bit lane each in a 256-bit vector).
pub(crate) const GROUP: usize = 8;
/// Vectors per block of a group: 4 quants of each row per vector.
pub(crate) const WORDS: usize = QK / 4;

/// 32 bytes, 32-byte aligned: 4 quants of each of 8 rows.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) type Quants = safe_arch::m256i;

/// 32 bytes: 4 quants of each of 8 rows.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(32))]
pub struct Quants(pub(crate) [u8; 32]);

/// What a register tile reads: `G` groups of 8 weight rows and `C`
/// activation rows, `blocks` blocks each (every slice holds at least that
/// many).
#[derive(Clone, Copy)]
// The portable kernel reads neither `ax` (the AVX2 baseline's) nor `corr`
// (the VNNI kernels').
#[cfg_attr(
    not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )),
    allow(dead_code)
)]
pub(crate) struct Tile<'a, const G: usize, const C: usize> {
    /// Weight quants, `q + 128`, `[block]` per group.
    pub w: [&'a [[Quants; WORDS]]; G],
    /// Weight scales as f16 bits, `[block][row]` per group.
    pub wd: [&'a [[u16; GROUP]]; G],
    /// Activation quants as words of 4, `[block]` per row.
    pub x: [&'a [[i32; WORDS]]; C],
    /// Their absolute values, laid out the same way.
    pub ax: [&'a [[i32; WORDS]]; C],
    /// `-128 · Σ quants` per block.
    pub corr: [&'a [i32]; C],
    /// Activation scales per block.
    pub xd: [&'a [f32]; C],
    /// Blocks per row.
    pub blocks: usize,
}
