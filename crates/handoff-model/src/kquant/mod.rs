//! K-quant matrices × Q8_K activations over the file's own quants,
//! repacked once in row groups of 8 (issue 31: compute from the weights as
//! the file holds them, at well under the bytes per token of a Q8_0 copy).
//! A format's layout and arithmetic are in its file (`q4k.rs`, `q6k.rs`);
//! this module holds what formats share: the matrix, the threads, the
//! register tiles and the activation rows.
//!
//! A matrix is one array of group-blocks, each its scales then its quants,
//! so that a decode step reads it as one sequential stream: on a Zen 4
//! core, quants and scales in two arrays (or three interleaved streams of
//! Q6_K's nibbles, high bits and scales) read at 14-21 GB/s where one
//! stream reads 28-37 (`kquant_timing`, BENCHMARKS.md).
//!
//! Q6_K is computed from its repacked quants in decode only
//! (`linear::repacked_in`): its 6 bits are unpacked for every product,
//! which costs less than the bytes saved at one activation row (0.70-0.81x
//! the Q8_0 copy's time) and more at many (1.33-1.37x at 8, 1.4-1.5x at 64),
//! so prefill keeps a Q8_0 copy of each Q6_K matrix.
//!
//! Per group of [`GROUP`] = 8 rows and 256-element block, a format keeps
//! its quants interleaved so that one 32-byte vector holds 4 consecutive
//! quants of each of the 8 rows (32-bit lane `r` = row `r`, as `q8_matmul`
//! does for Q8_0): one `vpdpbusd` against the broadcast 4 activation quants
//! adds, in lane `r`, 4 products of row `r`, with no horizontal sum.
//!
//! Every output element depends only on its weight row and its activation
//! row (the formats' arithmetic is exact integer sums per block, then
//! fused multiply-adds in block order), so a prompt's results do not
//! depend on its batch, its chunking or the thread count, and every path
//! (AVX-512 VNNI, AVX-VNNI in `simd/kquant.rs`, portable Rust here) gives
//! the same bits (`every_path_gives_the_same_bits`). Without VNNI, loads
//! keep K-quants as Q8_0 ([`supported`]).

pub(crate) mod q4k;
pub(crate) mod q6k;

use rayon::prelude::*;

use crate::native::act::q8k_block;
use crate::simd::Q8Path;
use crate::slab::Slab;

pub(crate) use crate::k_tile::GROUP;
pub use crate::k_tile::{Format, Q4k, Q6k, Tile};

/// Elements per K-quant block.
pub const QK_K: usize = 256;

/// Whether this CPU runs the fast kernels (the load keeps K-quants as
/// Q8_0 where it does not: the portable path is for tests).
pub fn supported() -> bool {
    Q8Path::chosen() != Q8Path::Baseline
}

/// Weights `[out, in]` of format `F` in groups of 8 rows (the last padded
/// with zero rows, whose scales are zero).
pub struct KMatrix<F: Format> {
    out_dim: usize,
    in_dim: usize,
    blocks: usize,
    /// `[group][block]`.
    qs: Slab<F::B>,
}

/// Q4_K weights, repacked.
pub type Q4kMatrix = KMatrix<Q4k>;

/// Q6_K weights, repacked.
pub type Q6kMatrix = KMatrix<Q6k>;

/// Activation rows quantized to Q8_K, laid out for the kernels.
pub struct Q8kRows {
    /// Quants as words of 4 (`i8` bytes, little endian), `[n][in / 4]`.
    pub(crate) x: Vec<i32>,
    /// Sums of each 32 quants in pairs (two i16 in one word),
    /// `[n][blocks][4]` (Q4_K's minimums).
    pub(crate) bs: Vec<i32>,
    /// Scales, `[n][blocks]`.
    pub(crate) d: Vec<f32>,
    /// 32 × the sum of each 16 quants, `[n][blocks][16]` (Q6_K's offset;
    /// empty when the format does not read it).
    pub(crate) bs16: Vec<i32>,
}

impl<F: Format> KMatrix<F> {
    /// Group-blocks a `rows` × `cols` matrix stores (`None` when `cols`
    /// is not whole blocks).
    pub(crate) fn stored_len(rows: usize, cols: usize) -> Option<usize> {
        cols.is_multiple_of(QK_K)
            .then(|| rows.div_ceil(GROUP).checked_mul(cols / QK_K))
            .flatten()
    }

    /// A matrix over stored group-blocks, if their length fits.
    pub(crate) fn from_slab(rows: usize, cols: usize, qs: Slab<F::B>) -> Option<Self> {
        let n = Self::stored_len(rows, cols)?;
        (qs.as_slice().len() == n).then_some(Self {
            out_dim: rows,
            in_dim: cols,
            blocks: cols / QK_K,
            qs,
        })
    }

    /// The stored group-blocks, as bytes (for the weight cache).
    pub(crate) fn stored_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.qs.as_slice())
    }

    /// Bytes this matrix holds.
    pub fn bytes(&self) -> usize {
        self.stored_bytes().len()
    }

    /// Of [`Self::bytes`], those mapped from a weight cache file.
    pub fn mapped_bytes(&self) -> usize {
        if self.qs.is_mapped() {
            self.bytes()
        } else {
            0
        }
    }

    /// Bytes per weight when stored (for estimates).
    pub fn bytes_per_weight() -> f64 {
        std::mem::size_of::<F::B>() as f64 / (GROUP * QK_K) as f64
    }

    /// Repack GGUF data of this format (`out · in / 256` blocks, row-major)
    /// of a `[out, in]` matrix.
    pub fn from_ggml(data: &[u8], out_dim: usize, in_dim: usize) -> Result<Self, String> {
        let name = F::DTYPE;
        if !in_dim.is_multiple_of(QK_K) {
            return Err(format!(
                "{name:?} rows of {in_dim} are not whole blocks of {QK_K}"
            ));
        }
        let blocks = in_dim / QK_K;
        let expected = out_dim * blocks * F::BLOCK_BYTES;
        if data.len() != expected {
            return Err(format!(
                "{name:?} data of {} bytes, expected {expected}",
                data.len()
            ));
        }
        let groups = out_dim.div_ceil(GROUP);
        let mut qs = vec![<F::B as bytemuck::Zeroable>::zeroed(); groups * blocks];
        // Groups are independent: repack them on the pool.
        qs.par_chunks_mut(blocks)
            .zip(data.par_chunks(blocks * F::BLOCK_BYTES * GROUP))
            .for_each(|(qs, src)| {
                for (r, row) in src.chunks_exact(blocks * F::BLOCK_BYTES).enumerate() {
                    for (blk, b) in row.chunks_exact(F::BLOCK_BYTES).zip(&mut *qs) {
                        F::pack(blk, r, b);
                    }
                }
            });
        Ok(Self {
            out_dim,
            in_dim,
            blocks,
            qs: Slab::Owned(qs),
        })
    }

    /// Output features.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// Input features.
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// `x` is `[n, in]` row-major; returns `[n, out]`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.forward_with(x, n, Q8Path::chosen())
    }

    /// [`KMatrix::forward`] on a given path (`Baseline`: the portable
    /// kernel). Every path gives the same bits.
    pub fn forward_with(&self, x: &[f32], n: usize, path: Q8Path) -> Vec<f32> {
        assert_eq!(x.len(), n * self.in_dim, "activation shape");
        if n == 0 || self.out_dim == 0 {
            return vec![0.0; n * self.out_dim];
        }
        let acts = quantize_rows(x, n, self.in_dim, F::SUMS16);
        crate::q8_matmul::by_groups(self.out_dim, n, |g0, out| {
            self.groups(&acts, n, g0, out, path)
        })
    }

    /// Groups `g0..` (as many as `out` holds, `[group][n][8]`) against all
    /// `n` activation rows, in register tiles.
    fn groups(&self, acts: &Q8kRows, n: usize, g0: usize, out: &mut [f32], path: Q8Path) {
        let count = out.len() / (n * GROUP);
        let (tg, tc) = tile_shape(path, n);
        let mut i = 0;
        while i < count {
            let g = if count - i >= tg { tg } else { 1 };
            let mut c = 0;
            while c < n {
                let take = (n - c).min(tc);
                match (g, take) {
                    (4, _) => self.tile::<4, 1>(acts, n, g0, i, c, out, path),
                    (2, 4) => self.tile::<2, 4>(acts, n, g0, i, c, out, path),
                    (2, 3) => self.tile::<2, 3>(acts, n, g0, i, c, out, path),
                    (2, 2) => self.tile::<2, 2>(acts, n, g0, i, c, out, path),
                    (2, _) => self.tile::<2, 1>(acts, n, g0, i, c, out, path),
                    (_, 4) => self.tile::<1, 4>(acts, n, g0, i, c, out, path),
                    (_, 3) => self.tile::<1, 3>(acts, n, g0, i, c, out, path),
                    (_, 2) => self.tile::<1, 2>(acts, n, g0, i, c, out, path),
                    _ => self.tile::<1, 1>(acts, n, g0, i, c, out, path),
                }
                c += take;
            }
            i += g;
        }
    }

    /// `G` groups from `g0 + i` against activation rows `c..c + C`.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn tile<const G: usize, const C: usize>(
        &self,
        acts: &Q8kRows,
        n: usize,
        g0: usize,
        i: usize,
        c: usize,
        out: &mut [f32],
        path: Q8Path,
    ) {
        let blocks = self.blocks;
        let qs = self.qs.as_slice();
        let t: Tile<'_, F, G, C> = Tile {
            w: std::array::from_fn(|k| &qs[(g0 + i + k) * blocks..][..blocks]),
            x: std::array::from_fn(|k| &acts.x[(c + k) * blocks * 64..][..blocks * 64]),
            bs: std::array::from_fn(|k| &acts.bs[(c + k) * blocks * 4..][..blocks * 4]),
            xd: std::array::from_fn(|k| &acts.d[(c + k) * blocks..][..blocks]),
            bs16: std::array::from_fn(|k| {
                if F::SUMS16 {
                    &acts.bs16[(c + k) * blocks * 16..][..blocks * 16]
                } else {
                    &acts.bs16[..0]
                }
            }),
            blocks,
        };
        let res = F::simd::<G, C>(path, &t).unwrap_or_else(|| F::portable::<G, C>(&t));
        for (gg, res) in res.iter().enumerate() {
            for (k, v) in res.iter().enumerate() {
                out[((i + gg) * n + c + k) * GROUP..][..GROUP].copy_from_slice(v);
            }
        }
    }
}

/// Groups and activation rows per register tile: on AVX-512 (32 vector
/// registers), one group for one row (a decode step reads each weight once
/// and is bound by memory: one sequential stream per thread read 20-23 GB/s
/// on one Zen 4 core where 4 groups' interleaved streams read 13-15,
/// `kquant_bandwidth`; the kernel splits its sums in two chains to hide the
/// dot instruction's latency), 2 × 2 for two and 2 × 4 for many (each
/// weight vector unpacked once for 4 rows; `kquant_timing`: 2 × 4 fastest
/// of 1-2 × 1-8); elsewhere (16 registers) 1 × 2.
fn tile_shape(path: Q8Path, n: usize) -> (usize, usize) {
    match (path, n) {
        (Q8Path::Avx512Vnni, 1) => (1, 1),
        (Q8Path::Avx512Vnni, 2) => (2, 2),
        (Q8Path::Avx512Vnni, _) => (2, 4),
        _ => (1, 2),
    }
}

/// Quantize `n` rows of `in_dim` (a multiple of 256) to Q8_K (as
/// `native::act` does, llama.cpp's `quantize_row_q8_K_ref`), with the sums
/// per 16 where `sums16`, rows in parallel when there are many (each row
/// on its own: the same quants).
pub(crate) fn quantize_rows(x: &[f32], n: usize, in_dim: usize, sums16: bool) -> Q8kRows {
    let blocks = in_dim / QK_K;
    let mut out = Q8kRows {
        x: vec![0; n * in_dim / 4],
        bs: vec![0; n * blocks * 4],
        d: vec![0.0; n * blocks],
        bs16: Vec::new(),
    };
    let row = |src: &[f32], x: &mut [i32], bs: &mut [i32], d: &mut [f32]| {
        let mut q = [0i8; QK_K];
        let mut sums = [0i16; 8];
        for (((src, x), bs), d) in src
            .chunks_exact(QK_K)
            .zip(x.chunks_exact_mut(QK_K / 4))
            .zip(bs.chunks_exact_mut(4))
            .zip(d.iter_mut())
        {
            *d = q8k_block(src, &mut q, &mut sums);
            for (w, q) in x.iter_mut().zip(q.chunks_exact(4)) {
                *w = i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
            }
            for (p, s) in bs.iter_mut().zip(sums.chunks_exact(2)) {
                *p = (u32::from(s[0] as u16) | u32::from(s[1] as u16) << 16) as i32;
            }
        }
    };
    // Below a few rows the pool costs more than it saves.
    if n >= 4 {
        x.par_chunks(in_dim)
            .zip(out.x.par_chunks_mut(in_dim / 4))
            .zip(out.bs.par_chunks_mut(blocks * 4))
            .zip(out.d.par_chunks_mut(blocks))
            .for_each(|(((s, x), b), d)| row(s, x, b, d));
    } else {
        x.chunks(in_dim)
            .zip(out.x.chunks_mut(in_dim / 4))
            .zip(out.bs.chunks_mut(blocks * 4))
            .zip(out.d.chunks_mut(blocks))
            .for_each(|(((s, x), b), d)| row(s, x, b, d));
    }
    if sums16 {
        // Each 16 quants are 4 words.
        out.bs16 = out
            .x
            .chunks_exact(4)
            .map(|w| {
                32 * w
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .map(|b| i32::from(b as i8))
                    .sum::<i32>()
            })
            .collect();
    }
    out
}

#[cfg(test)]
mod tests;
