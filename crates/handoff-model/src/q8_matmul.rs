//! Q8_0 × Q8_0 matrix product, handoff's own kernel for every batch size:
//! one activation row (decode at batch 1, memory-bound) to a whole prefill
//! chunk (compute-bound).
//!
//! Layout: weight rows are packed in groups of [`GROUP`] = 8, interleaved
//! so that one 256-bit vector holds 4 consecutive quants of each of the 8
//! rows (32-bit lane `r` = row `r`). A block of 32 elements of 8 rows is 8
//! such vectors. A dot product instruction against the broadcast 4 quants
//! of one activation row then adds, in lane `r`, 4 products of row `r`:
//! 8 instructions give the 8 rows' exact integer block dot products, with
//! no horizontal sum. (llama.cpp's repacked CPU kernels use the same idea.)
//!
//! Arithmetic, the same for every kernel path and every batch size, so
//! every output element depends only on its weight row and its activation
//! row (never on the batch's row count, its other rows or the thread
//! count):
//! - every activation row is quantized to Q8_0 in blocks of 32 exactly as
//!   candle's `BlockQ8_0::from_float` (llama.cpp's `quantize_row_q8_0`
//!   reference): `d = amax / 127`, `id = 1/d` (0 when `d == 0`),
//!   `q = round(x·id)` (half away from zero), `d` stored as f16;
//! - per output element and block, the exact i32 dot product of the 32
//!   quant pairs is converted to f32 (exact: |dot| ≤ 32·127·128 < 2^24) and
//!   accumulated across blocks in order with one fused multiply-add by the
//!   f32 product `f32(d_w)·f32(d_x)`.
//!
//! Every path computes the same integer dot, so they give the same bits
//! (tested by `every_path_gives_the_same_bits`):
//! - VNNI (`simd/`, chosen at run time): weights are stored offset to
//!   unsigned (`q + 128`), which `vpdpbusd` (unsigned × signed, groups of 4
//!   to i32, not saturating) needs; it starts from `-128·Σx`, the offset's
//!   contribution, so the sum is the exact dot;
//! - the safe AVX2 baseline (x86-64-v3, through `safe_arch`): the signed
//!   weights (`stored ^ 0x80`) take the activation's signs (`vpsignb`),
//!   `vpmaddubsw` multiplies by `|x|` and adds pairs to i16 and
//!   `vpmaddwd` by ones adds those to i32. The i16 pair sums are exact as
//!   long as no weight quant is -128 (`|x|·|w|·2 ≤ 128·127·2 < 2^15`);
//!   Q8_0 produced by quantization, candle's or llama.cpp's, never holds
//!   -128 (`|round(x·127/amax)| ≤ 127`);
//! - elsewhere a portable version with i32 arithmetic and `f32::mul_add`.
//!
//! The result is not candle's `vec_dot_q8_0_q8_0` bit for bit (candle
//! keeps 8 partial sums and adds them at the end); it is within float
//! rounding of it (`close_to_candle`).

use half::f16;
use rayon::prelude::*;

use crate::slab::Slab;

pub use crate::q8_tile::QK;
pub(crate) use crate::q8_tile::{Quants, Tile, GROUP, WORDS};

/// Bytes of one Q8_0 block in GGUF/candle storage: f16 scale + 32 × i8.
pub(crate) const BLOCK_BYTES: usize = 2 + QK;

/// Block products as vector instructions (x86-64 with AVX2 and FMA).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod lanes {
    use safe_arch::{
        add_i32_m256i, bitxor_m256i, convert_to_m256_from_i32_m256i, fused_mul_add_m256, m256,
        m256i, mul_i16_horizontal_add_m256i, mul_m256, mul_u8i8_add_horizontal_saturating_m256i,
        set_splat_i16_m256i, set_splat_i32_m256i, set_splat_i8_m256i, set_splat_m256,
        sign_apply_i8_m256i, zeroed_m256, zeroed_m256i,
    };

    use super::{Quants, Tile, GROUP, WORDS};

    /// Quants from bytes.
    #[inline(always)]
    pub fn quants(q: [u8; 32]) -> Quants {
        m256i::from(q)
    }

    /// The bytes of quants.
    #[cfg(test)]
    pub fn bytes(q: Quants) -> [u8; 32] {
        q.into()
    }

    /// The safe kernel: `G` groups of 8 weight rows against `C` activation
    /// rows; the f32 results, `[G][C][8]`.
    #[inline(always)]
    pub fn kernel<const G: usize, const C: usize>(t: &Tile<'_, G, C>) -> [[[f32; GROUP]; C]; G] {
        let Tile {
            w,
            wd,
            x,
            ax,
            xd,
            blocks,
            ..
        } = *t;
        let flip = set_splat_i8_m256i(-128);
        let ones = set_splat_i16_m256i(1);
        let mut acc = [[zeroed_m256(); C]; G];
        for b in 0..blocks {
            let mut dot = [[zeroed_m256i(); C]; G];
            for j in 0..WORDS {
                let bx: [m256i; C] = std::array::from_fn(|k| set_splat_i32_m256i(x[k][b][j]));
                let bax: [m256i; C] = std::array::from_fn(|k| set_splat_i32_m256i(ax[k][b][j]));
                for (dot, w) in dot.iter_mut().zip(&w) {
                    // Back to signed quants, then w·sign(x) times |x|:
                    // lane r adds 4 products of row r.
                    let wi = bitxor_m256i(w[b][j], flip);
                    for k in 0..C {
                        let sw = sign_apply_i8_m256i(wi, bx[k]);
                        let pairs = mul_u8i8_add_horizontal_saturating_m256i(bax[k], sw);
                        dot[k] = add_i32_m256i(dot[k], mul_i16_horizontal_add_m256i(pairs, ones));
                    }
                }
            }
            for ((acc, dot), wd) in acc.iter_mut().zip(&dot).zip(&wd) {
                let dw = m256::from(super::widen(&wd[b]));
                for k in 0..C {
                    acc[k] = fused_mul_add_m256(
                        convert_to_m256_from_i32_m256i(dot[k]),
                        mul_m256(dw, set_splat_m256(xd[k][b])),
                        acc[k],
                    );
                }
            }
        }
        acc.map(|row| row.map(Into::into))
    }
}

/// Block products in portable Rust (same results).
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod lanes {
    use super::{Quants, Tile, GROUP, WORDS};

    /// Quants from bytes.
    pub fn quants(q: [u8; 32]) -> Quants {
        Quants(q)
    }

    /// The bytes of quants.
    #[cfg(test)]
    pub fn bytes(q: Quants) -> [u8; 32] {
        q.0
    }

    /// The portable kernel (see the x86 one).
    pub fn kernel<const G: usize, const C: usize>(t: &Tile<'_, G, C>) -> [[[f32; GROUP]; C]; G] {
        let Tile {
            w,
            wd,
            x,
            xd,
            blocks,
            ..
        } = *t;
        let mut acc = [[[0f32; GROUP]; C]; G];
        for b in 0..blocks {
            for g in 0..G {
                for k in 0..C {
                    for r in 0..GROUP {
                        let mut dot = 0i32;
                        for j in 0..WORDS {
                            let xs = x[k][b][j].to_le_bytes();
                            for e in 0..4 {
                                let wq = i32::from(w[g][b][j].0[4 * r + e]) - 128;
                                dot += wq * i32::from(xs[e] as i8);
                            }
                        }
                        let dw = half::f16::from_bits(wd[g][b][r]).to_f32();
                        acc[g][k][r] = (dot as f32).mul_add(dw * xd[k][b], acc[g][k][r]);
                    }
                }
            }
        }
        acc
    }
}

/// Q8_0 weights `[out, in]`, in groups of 8 rows (the last padded with zero
/// rows); per group and block, [`WORDS`] vectors whose lane `r` holds 4
/// quants of row `r`, each stored as `q + 128` (unsigned).
pub struct Q8Matrix {
    out_dim: usize,
    in_dim: usize,
    blocks: usize,
    /// `[group][block]`.
    qs: Slab<[Quants; WORDS]>,
    /// Scales, the file's f16 bits (widened to f32 in the kernel, exactly),
    /// `[group][block][row]`.
    d: Slab<[u16; GROUP]>,
}

/// Why a matrix cannot be packed.
#[derive(Debug, thiserror::Error)]
pub enum Q8Error {
    /// The inner dimension is not a multiple of 32.
    #[error("inner dimension {0} is not a multiple of {QK}")]
    InnerDim(usize),
    /// The byte buffer does not hold `out · in / 32` blocks.
    #[error("Q8_0 data of {got} bytes, expected {expected}")]
    Size {
        /// Bytes given.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
}

impl Q8Matrix {
    /// Bytes this matrix holds (quants and scales).
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.qs.as_slice()) + std::mem::size_of_val(self.d.as_slice())
    }

    /// Of [`Self::bytes`], those mapped from a weight cache file (one copy
    /// per host).
    pub fn mapped_bytes(&self) -> usize {
        if self.qs.is_mapped() && self.d.is_mapped() {
            self.bytes()
        } else {
            0
        }
    }

    /// Elements of each of the quants and the scales a `rows` × `cols`
    /// matrix stores (`None` when `cols` is not whole blocks).
    pub(crate) fn stored_len(rows: usize, cols: usize) -> Option<usize> {
        cols.is_multiple_of(QK)
            .then(|| rows.div_ceil(GROUP).checked_mul(cols / QK))
            .flatten()
    }

    /// A matrix over stored quants and scales (as [`Self::stored_bytes`]
    /// gave them), if their lengths fit the shape.
    pub(crate) fn from_slabs(
        rows: usize,
        cols: usize,
        qs: Slab<[Quants; WORDS]>,
        d: Slab<[u16; GROUP]>,
    ) -> Option<Self> {
        let n = Self::stored_len(rows, cols)?;
        (qs.as_slice().len() == n && d.as_slice().len() == n).then_some(Self {
            out_dim: rows,
            in_dim: cols,
            blocks: cols / QK,
            qs,
            d,
        })
    }

    /// The stored quants and scales, as bytes (for the weight cache).
    pub(crate) fn stored_bytes(&self) -> (&[u8], &[u8]) {
        (
            bytemuck::cast_slice(self.qs.as_slice()),
            bytemuck::cast_slice(self.d.as_slice()),
        )
    }

    /// Pack GGML Q8_0 data (`out · in / 32` blocks of 34 bytes, row-major)
    /// of a `[out, in]` matrix.
    pub fn from_ggml_q8_0(data: &[u8], out_dim: usize, in_dim: usize) -> Result<Self, Q8Error> {
        if !in_dim.is_multiple_of(QK) {
            return Err(Q8Error::InnerDim(in_dim));
        }
        let blocks = in_dim / QK;
        let expected = out_dim * blocks * BLOCK_BYTES;
        if data.len() != expected {
            return Err(Q8Error::Size {
                got: data.len(),
                expected,
            });
        }
        let groups = out_dim.div_ceil(GROUP);
        // Zero quants (stored as 128) and zero scales for padding rows.
        let mut bytes = vec![[[128u8; 32]; WORDS]; groups * blocks];
        let mut d = vec![[0u16; GROUP]; groups * blocks];
        for (row, src) in data.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
            let (g, r) = (row / GROUP, row % GROUP);
            for (b, blk) in src.chunks_exact(BLOCK_BYTES).enumerate() {
                let i = g * blocks + b;
                d[i][r] = u16::from_le_bytes([blk[0], blk[1]]);
                for (e, &q) in blk[2..].iter().enumerate() {
                    bytes[i][e / 4][4 * r + e % 4] = q ^ 0x80;
                }
            }
        }
        Ok(Self {
            out_dim,
            in_dim,
            blocks,
            qs: Slab::Owned(bytes.into_iter().map(|b| b.map(lanes::quants)).collect()),
            d: Slab::Owned(d),
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

    /// `x` is `[n, in]` row-major; returns `[n, out]`. Runs on the current
    /// rayon pool (the engine's compute threads).
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.forward_with(x, n, crate::simd::Q8Path::chosen())
    }

    /// [`Q8Matrix::forward`] on a given kernel path (one of
    /// [`crate::simd::Q8Path::available`]; another falls back to the
    /// baseline). Every path gives the same bits.
    pub fn forward_with(&self, x: &[f32], n: usize, path: crate::simd::Q8Path) -> Vec<f32> {
        assert_eq!(x.len(), n * self.in_dim, "activation shape");
        if n == 0 || self.out_dim == 0 {
            return vec![0.0; n * self.out_dim];
        }
        let acts = quantize_rows(x, n, self.in_dim);
        by_groups(self.out_dim, n, |g0, out| {
            self.groups(&acts, n, g0, out, path)
        })
    }

    /// Groups `g0..` (as many as `out` holds, `[group][n][8]`) against all
    /// `n` activation rows, in tiles of the path's register block.
    fn groups(
        &self,
        acts: &QuantizedRows,
        n: usize,
        g0: usize,
        out: &mut [f32],
        path: crate::simd::Q8Path,
    ) {
        let count = out.len() / (n * GROUP);
        let tile_g = tile_groups(path);
        let mut i = 0;
        while i < count {
            let g = if count - i >= tile_g { tile_g } else { 1 };
            let mut c = 0;
            while c < n {
                let take = (n - c).min(COLS);
                match (g, take) {
                    (3, 4) => self.tile::<3, 4>(acts, n, g0, i, c, out, path),
                    (3, 3) => self.tile::<3, 3>(acts, n, g0, i, c, out, path),
                    (3, 2) => self.tile::<3, 2>(acts, n, g0, i, c, out, path),
                    (3, _) => self.tile::<3, 1>(acts, n, g0, i, c, out, path),
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

    /// `G` groups from `g0 + i` against activation rows `c..c + C`, written
    /// into `out` (`[group - g0][n][8]`). Not inlined, so that LLVM
    /// allocates the accumulators to registers for this loop alone.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn tile<const G: usize, const C: usize>(
        &self,
        acts: &QuantizedRows,
        n: usize,
        g0: usize,
        i: usize,
        c: usize,
        out: &mut [f32],
        path: crate::simd::Q8Path,
    ) {
        let blocks = self.blocks;
        // Slices of exactly `blocks` elements, visible to LLVM: no bounds
        // checks in the loop.
        let (qs, d) = (self.qs.as_slice(), self.d.as_slice());
        let w: [&[[Quants; WORDS]]; G] =
            std::array::from_fn(|k| &qs[(g0 + i + k) * blocks..][..blocks]);
        let wd: [&[[u16; GROUP]]; G] =
            std::array::from_fn(|k| &d[(g0 + i + k) * blocks..][..blocks]);
        let row = |v: usize| (c + v) * blocks..(c + v + 1) * blocks;
        let t = Tile {
            w,
            wd,
            x: std::array::from_fn(|k| &acts.x[row(k)]),
            ax: std::array::from_fn(|k| &acts.ax[row(k)]),
            corr: std::array::from_fn(|k| &acts.corr[row(k)]),
            xd: std::array::from_fn(|k| &acts.d[row(k)]),
            blocks,
        };
        let res = faster::<G, C>(path, &t).unwrap_or_else(|| lanes::kernel::<G, C>(&t));
        for (gg, res) in res.iter().enumerate() {
            for (k, v) in res.iter().enumerate() {
                out[((i + gg) * n + c + k) * GROUP..][..GROUP].copy_from_slice(v);
            }
        }
    }
}

/// Runs `f(first_group, out)` for the groups of 8 rows of an `out_dim`-row
/// matrix against `n` activation rows on the rayon pool, each call owning
/// the results of consecutive groups (`out`: `[group][n][8]`, contiguous,
/// so groups split across threads safely), a few chunks per thread so that
/// a thread slowed by another process does not hold the others up for
/// long; returns the results as `[n][out_dim]` (a padding row's dropped).
/// Shared by `q8_matmul` and `kquant`.
pub(crate) fn by_groups(
    out_dim: usize,
    n: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let groups = out_dim.div_ceil(GROUP);
    let mut yg = vec![0f32; groups * n * GROUP];
    let threads = rayon::current_num_threads().max(1);
    let per_chunk = groups.div_ceil(threads * 4).max(1);
    yg.par_chunks_mut(per_chunk * n * GROUP)
        .enumerate()
        .for_each(|(chunk, out)| f(chunk * per_chunk, out));
    let mut y = vec![0f32; n * out_dim];
    for (g, col) in yg.chunks_exact(n * GROUP).enumerate() {
        let rows = (out_dim - g * GROUP).min(GROUP);
        for (dst, src) in y.chunks_exact_mut(out_dim).zip(col.chunks_exact(GROUP)) {
            dst[g * GROUP..][..rows].copy_from_slice(&src[..rows]);
        }
    }
    y
}

/// Eight f16 scales (as bits) widened to f32: exact, and one `vcvtph2ps`
/// where the build has F16C (x86-64-v3 does).
#[inline(always)]
pub(crate) fn widen(d: &[u16; GROUP]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    half::slice::HalfFloatSliceExt::convert_to_f32_slice(
        half::slice::HalfBitsSliceExt::reinterpret_cast::<f16>(&d[..]),
        &mut out,
    );
    out
}

/// Activation rows per register tile.
const COLS: usize = 4;

/// Groups per register tile on `path`: AVX-512 has 32 vector registers
/// (3 × 4 tiles measured fastest, `q8_timing`), the others 16.
fn tile_groups(path: crate::simd::Q8Path) -> usize {
    match path {
        crate::simd::Q8Path::Avx512Vnni => 3,
        _ => 1,
    }
}

/// The results of a run-time chosen SIMD kernel (`None`: run the
/// baseline, the only kernel outside x86-64 with AVX2).
#[inline(always)]
fn faster<const G: usize, const C: usize>(
    path: crate::simd::Q8Path,
    t: &Tile<'_, G, C>,
) -> Option<[[[f32; GROUP]; C]; G]> {
    simd_kernel!(crate::simd::group_products::<G, C>(path, t), path, t)
}

/// Activation rows quantized to Q8_0, `[n][blocks]` each.
pub struct QuantizedRows {
    /// The 32 quants of a block as 8 words of 4 (`i8` bytes, little
    /// endian: byte `e` of word `j` is quant `4j + e`).
    x: Vec<[i32; WORDS]>,
    /// Their absolute values (`u8` bytes), laid out the same way.
    ax: Vec<[i32; WORDS]>,
    /// `-128 · Σ quants`: the VNNI kernel's starting sum.
    corr: Vec<i32>,
    /// Scales, f16 values widened to f32.
    d: Vec<f32>,
}

/// Quantize `n` rows of `in_dim` (a multiple of 32) to Q8_0 as candle's
/// `BlockQ8_0::from_float` does.
pub fn quantize_rows(x: &[f32], n: usize, in_dim: usize) -> QuantizedRows {
    let blocks = n * in_dim / QK;
    let mut out = QuantizedRows {
        x: vec![[0; WORDS]; blocks],
        ax: vec![[0; WORDS]; blocks],
        corr: vec![0; blocks],
        d: vec![0.0; blocks],
    };
    let words = |b: &[u8; QK]| -> [i32; WORDS] {
        std::array::from_fn(|j| {
            i32::from_le_bytes([b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3]])
        })
    };
    let block =
        |src: &[f32], x: &mut [i32; WORDS], ax: &mut [i32; WORDS], corr: &mut i32, d: &mut f32| {
            let (q, abs, dd) = quantize_block(src);
            let sum: i32 = q.iter().map(|&v| i32::from(v as i8)).sum();
            *x = words(&q);
            *ax = words(&abs);
            *corr = -128 * sum;
            *d = dd;
        };
    // Each block on its own (the same quants in any order); many rows are
    // quantized on the pool, few here (the pool costs more than it saves).
    let per_row = (in_dim / QK).max(1);
    if n >= 4 {
        x.par_chunks(QK)
            .zip(out.x.par_iter_mut())
            .zip(out.ax.par_iter_mut())
            .zip(out.corr.par_iter_mut().zip(out.d.par_iter_mut()))
            .with_min_len(per_row)
            .for_each(|(((s, x), ax), (c, d))| block(s, x, ax, c, d));
    } else {
        x.chunks_exact(QK)
            .zip(out.x.iter_mut())
            .zip(out.ax.iter_mut())
            .zip(out.corr.iter_mut().zip(out.d.iter_mut()))
            .for_each(|(((s, x), ax), (c, d))| block(s, x, ax, c, d));
    }
    out
}

/// One block: quants (`i8` bits), their absolute values (`u8`) and the
/// scale.
#[inline]
fn quantize_block(src: &[f32]) -> ([u8; QK], [u8; QK], f32) {
    // Max is exact, so 8 partial maxima (vectorizable) give candle's
    // sequential `amax.max(|x|)`; a NaN never wins a `>` comparison, as
    // `max` ignores it.
    let mut m = [0f32; 8];
    for k in 0..QK / 8 {
        for (j, m) in m.iter_mut().enumerate() {
            let a = src[8 * k + j].abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let amax = m.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    let dd = amax / 127.0;
    let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
    let mut q = [0u8; QK];
    let mut abs = [0u8; QK];
    for ((q, a), &v) in q.iter_mut().zip(&mut abs).zip(src) {
        // Candle's `round(x·id) as i8` (saturating, NaN to 0), written so
        // that it vectorizes: an integer-valued c in [-128, 127] plus
        // 1.5·2^23 holds c in the low byte of its bits.
        let y = f32::round(v * id);
        let c = if y.is_nan() {
            0.0
        } else {
            y.clamp(-128.0, 127.0)
        };
        *q = (c + 12_582_912.0).to_bits() as u8;
        *a = (c.abs() + 12_582_912.0).to_bits() as u8;
    }
    (q, abs, f16::from_f32(dd).to_f32())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut rand::rngs::StdRng, len: usize, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect()
    }

    fn q8(w: &[f32], out: usize, inp: usize) -> QTensor {
        let dev = Device::Cpu;
        QTensor::quantize(
            &Tensor::from_slice(w, (out, inp), &dev).unwrap(),
            GgmlDType::Q8_0,
        )
        .unwrap()
    }

    /// The module's arithmetic written out one element at a time.
    fn reference(data: &[u8], x: &[f32], out: usize, inp: usize, n: usize) -> Vec<f32> {
        let blocks = inp / QK;
        let mut y = vec![0f32; n * out];
        for c in 0..n {
            let xq: Vec<_> = x[c * inp..(c + 1) * inp]
                .chunks_exact(QK)
                .map(quantize_block)
                .collect();
            for o in 0..out {
                let mut acc = 0f32;
                for (b, (q, _, dx)) in xq.iter().enumerate() {
                    let blk = &data[(o * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    let dw = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let dot: i32 = (0..QK)
                        .map(|e| i32::from(blk[2 + e] as i8) * i32::from(q[e] as i8))
                        .sum();
                    acc = (dot as f32).mul_add(dw * dx, acc);
                }
                y[c * out + o] = acc;
            }
        }
        y
    }

    fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
        }
    }

    /// Every kernel path this CPU runs (the safe baseline and the
    /// run-time chosen SIMD ones) gives the bits of the one-element-at-a-
    /// time reference, for every shape the model uses and odd ones (rows
    /// not a multiple of 8, every tile and tail shape), with weights at the
    /// quant range's ends.
    #[test]
    fn every_path_gives_the_same_bits() {
        use crate::simd::Q8Path;
        let paths = Q8Path::available();
        eprintln!("kernel paths on this CPU: {paths:?}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(out, inp) in &[(960, 576), (576, 1536), (37, 576), (5, 32), (17, 2048)] {
            for &n in &[1usize, 2, 3, 4, 5, 8, 17] {
                let mut w = random(&mut rng, out * inp, 0.1);
                // A block whose largest weight sits at +127 and -127.
                w[0] = 0.5;
                w[1] = -0.5;
                let mut x = random(&mut rng, n * inp, 2.0);
                // An activation quant at -128 is possible only with NaN or
                // rounding at the edge; the -127 end is certain.
                x[2] = 50.0;
                x[3] = -50.0;
                let q = q8(&w, out, inp);
                let data = q.data().unwrap();
                let m = Q8Matrix::from_ggml_q8_0(&data, out, inp).unwrap();
                let expected = reference(&data, &x, out, inp, n);
                for &p in &paths {
                    let what = format!("{} {out}x{inp} n={n}", p.name());
                    assert_bits_eq(&m.forward_with(&x, n, p), &expected, &what);
                }
                assert_bits_eq(&m.forward(&x, n), &expected, "the chosen path");
            }
        }
    }

    /// `unsafe` lives in `simd/`, `mapped.rs` and `heap.rs` (one block each) only: no other source file of the crate
    /// allows it or uses it.
    #[test]
    fn only_simd_the_mapping_and_heap_may_use_unsafe() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src.clone()];
        let mut checked = 0;
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    if path != src.join("simd") {
                        stack.push(path);
                    }
                    continue;
                }
                if path.extension().is_none_or(|x| x != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                checked += 1;
                for (i, line) in text.lines().enumerate() {
                    // The code before any comment or string on the line,
                    // as identifiers.
                    let code = line.split("//").next().unwrap_or("");
                    let code = code.split('"').next().unwrap_or("");
                    let uses = code
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .any(|t| t == "unsafe" || t == "unsafe_code");
                    let allowed = path == src.join("mapped.rs")
                        || path == src.join("heap.rs")
                        || path == src.join("lib.rs")
                            && (line.trim() == "#[allow(unsafe_code)]"
                                || line.trim() == "#![deny(unsafe_code)]");
                    assert!(
                        allowed || !uses,
                        "{}:{}: `unsafe` outside simd/, mapped.rs and heap.rs: {line}",
                        path.display(),
                        i + 1
                    );
                }
            }
        }
        assert!(checked > 10, "{checked} files");
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        assert!(lib.contains("#![deny(unsafe_code)]"));
        assert_eq!(lib.matches("allow(unsafe_code)").count(), 3);
        assert!(lib.contains("#[allow(unsafe_code)]\npub mod simd;"));
        assert!(lib.contains("#[allow(unsafe_code)]\npub mod mapped;"));
        assert!(lib.contains("#[allow(unsafe_code)]\npub mod heap;"));
        for file in ["mapped.rs", "heap.rs"] {
            let text = std::fs::read_to_string(src.join(file)).unwrap();
            assert_eq!(
                text.matches("unsafe {").count(),
                1,
                "one unsafe block in {file}"
            );
        }
    }

    /// Within float rounding of candle's QMatMul on the same Q8_0 weights
    /// (which adds its partial sums in another order, and at inner
    /// dimensions that are multiples of 256 quantizes activations in blocks
    /// of 256).
    #[test]
    fn close_to_candle() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for &(out, inp, n) in &[(64, 1536, 4), (960, 576, 3), (37, 576, 9)] {
            let w = random(&mut rng, out * inp, 0.1);
            let x = random(&mut rng, n * inp, 2.0);
            let q = q8(&w, out, inp);
            let ours = Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp)
                .unwrap()
                .forward(&x, n);
            let theirs = QMatMul::from_qtensor(q)
                .unwrap()
                .forward(&Tensor::from_slice(&x, (n, inp), &Device::Cpu).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // The exact f32 product's largest element, for scale.
            let mut max_ref = 0f32;
            for c in 0..n {
                for o in 0..out {
                    let e: f32 = (0..inp).map(|i| w[o * inp + i] * x[c * inp + i]).sum();
                    max_ref = max_ref.max(e.abs());
                }
            }
            let mut differ = 0;
            for (a, b) in ours.iter().zip(&theirs) {
                assert!((a - b).abs() <= 0.02 * max_ref, "{a} vs {b}");
                differ += usize::from(a != b);
            }
            eprintln!(
                "{out}x{inp} n={n}: {differ} of {} differ from candle",
                ours.len()
            );
        }
    }

    /// Row `r` of the result is the same bits for any batch containing it,
    /// and on any thread count.
    #[test]
    fn batch_independent() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(out, inp) in &[(49, 576), (3072, 576), (576, 1536)] {
            let w = random(&mut rng, out * inp, 0.05);
            let m = Q8Matrix::from_ggml_q8_0(&q8(&w, out, inp).data().unwrap(), out, inp).unwrap();
            let n = 37;
            let x = random(&mut rng, n * inp, 3.0);
            let all = m.forward(&x, n);
            for r in 0..n {
                let solo = m.forward(&x[r * inp..(r + 1) * inp], 1);
                assert_bits_eq(&solo, &all[r * out..(r + 1) * out], "alone");
            }
            let some = m.forward(&x[3 * inp..14 * inp], 11);
            assert_bits_eq(&some, &all[3 * out..14 * out], "rows 3..14");
            // Same on a single-thread pool.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_bits_eq(&pool.install(|| m.forward(&x, n)), &all, "one thread");
        }
    }

    #[test]
    fn zero_rows_and_empty_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (out, inp) = (7, 64);
        let w = random(&mut rng, out * inp, 1.0);
        let mut x = random(&mut rng, 3 * inp, 1.0);
        x[inp..2 * inp].fill(0.0);
        let data = q8(&w, out, inp).data().unwrap().into_owned();
        let m = Q8Matrix::from_ggml_q8_0(&data, out, inp).unwrap();
        let ours = m.forward(&x, 3);
        assert_bits_eq(&ours, &reference(&data, &x, out, inp, 3), "reference");
        assert!(ours[out..2 * out].iter().all(|&v| v == 0.0));
        assert!(m.forward(&[], 0).is_empty());
        // Zero weights.
        let zeros = q8(&vec![0.0; out * inp], out, inp);
        let z = Q8Matrix::from_ggml_q8_0(&zeros.data().unwrap(), out, inp).unwrap();
        assert!(z.forward(&x, 3).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn quantization_matches_candle() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let inp = 32 * 256;
        let mut x = random(&mut rng, inp, 4.0);
        // Blocks of very different magnitudes, and exact .5 ties.
        for (b, blk) in x.chunks_exact_mut(QK).enumerate().skip(8) {
            let scale = 10f32.powi((b % 13) as i32 - 6);
            blk.iter_mut().for_each(|v| *v *= scale);
            if b % 3 == 0 {
                blk[0] = 127.0 * scale;
                blk[1] = 0.5 * scale;
                blk[2] = -2.5 * scale;
            }
        }
        x[3] = 0.5; // ties and extremes
        x[40] = -127.5 / 127.0;
        x[64..96].fill(0.0);
        x[100] = f32::NAN; // NaN is ignored by amax and quantizes to 0
        x[128..160].fill(0.0);
        x[130] = 1e-38; // tiny block: infinite inverse scale
        x[131] = -3e-39;
        x[160] = f32::INFINITY;
        let q = QTensor::quantize(
            &Tensor::from_slice(&x, (1, inp), &Device::Cpu).unwrap(),
            GgmlDType::Q8_0,
        )
        .unwrap();
        let data = q.data().unwrap();
        let rows = quantize_rows(&x, 1, inp);
        let bytes =
            |w: &[i32; WORDS]| -> Vec<u8> { w.iter().flat_map(|v| v.to_le_bytes()).collect() };
        for (b, blk) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            assert_eq!(
                f16::from_le_bytes([blk[0], blk[1]]).to_f32().to_bits(),
                rows.d[b].to_bits()
            );
            let (q, abs) = (bytes(&rows.x[b]), bytes(&rows.ax[b]));
            let mut sum = 0;
            for k in 0..QK {
                assert_eq!(q[k], blk[2 + k]);
                assert_eq!(abs[k], (blk[2 + k] as i8).unsigned_abs());
                sum += i32::from(blk[2 + k] as i8);
            }
            assert_eq!(rows.corr[b], -128 * sum);
        }
    }

    /// Packing puts row `8g + r`'s quants `4j..4j+3` of block `b` in lane
    /// `r` of vector `j`, offset by 128; padding rows are zero.
    #[test]
    fn packing_layout() {
        let (out, inp) = (10, 64);
        let data: Vec<u8> = (0..out * 2)
            .flat_map(|blk| {
                let mut v = f16::from_f32(blk as f32).to_le_bytes().to_vec();
                v.extend((0..QK).map(|e| (blk * 3 + e) as u8));
                v
            })
            .collect();
        let m = Q8Matrix::from_ggml_q8_0(&data, out, inp).unwrap();
        assert_eq!(m.qs.as_slice().len(), 2 * 2);
        for row in 0..16 {
            let (g, r) = (row / GROUP, row % GROUP);
            for b in 0..2 {
                let i = g * 2 + b;
                let scale = if row < out { (row * 2 + b) as f32 } else { 0.0 };
                assert_eq!(f16::from_bits(m.d.as_slice()[i][r]).to_f32(), scale);
                for e in 0..QK {
                    let stored = lanes::bytes(m.qs.as_slice()[i][e / 4])[4 * r + e % 4];
                    let want = if row < out {
                        ((row * 2 + b) * 3 + e) as u8
                    } else {
                        0
                    };
                    assert_eq!(stored, want ^ 0x80, "row {row} block {b} element {e}");
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(matches!(
            Q8Matrix::from_ggml_q8_0(&[], 1, 33),
            Err(Q8Error::InnerDim(33))
        ));
        assert!(matches!(
            Q8Matrix::from_ggml_q8_0(&[0; 33], 1, 32),
            Err(Q8Error::Size { .. })
        ));
    }

    /// Kernel timing on SmolLM2-135M's shapes (one forward: 30 layers, and
    /// the LM head at n ≤ 8), n = 1, 8 and 128:
    /// `cargo test --release -p handoff-model --lib q8_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn q8_timing() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let shapes = [
            (960, 576, 30),
            (576, 576, 30),
            (3072, 576, 30),
            (576, 1536, 30),
            (49152, 576, 1),
        ];
        // Q8_DISTINCT=1: a distinct matrix per use (the model's ~143 MB
        // stream from memory); default: one matrix per shape, used `times`
        // times (cache-resident).
        let distinct = std::env::var("Q8_DISTINCT").is_ok_and(|v| v == "1");
        let mats: Vec<(Q8Matrix, usize)> = shapes
            .iter()
            .flat_map(|&(out, inp, times)| {
                let (copies, uses) = if distinct { (times, 1) } else { (1, times) };
                (0..copies).map(move |_| (out, inp, uses))
            })
            .map(|(out, inp, times)| {
                let w = random(&mut rng, out * inp, 0.1);
                let q = q8(&w, out, inp);
                (
                    Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp).unwrap(),
                    times,
                )
            })
            .collect();
        let threads: usize = std::env::var("Q8_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        // Every kernel path, in turns (best of 5 rounds each).
        let paths = crate::simd::Q8Path::available();
        for n in [1usize, 8, 128] {
            let xs: Vec<Vec<f32>> = mats
                .iter()
                .map(|(m, _)| random(&mut rng, n * m.in_dim(), 1.0))
                .collect();
            let step = |p: crate::simd::Q8Path| {
                for ((m, times), x) in mats.iter().zip(&xs) {
                    // The LM head runs on the last row only in prefill.
                    let rows = if m.out_dim() > 10_000 { n.min(8) } else { n };
                    for _ in 0..*times {
                        std::hint::black_box(m.forward_with(&x[..rows * m.in_dim()], rows, p));
                    }
                }
            };
            let reps = if n > 8 { 1 } else { 10 };
            let mut best = vec![f64::MAX; paths.len()];
            for round in 0..6 {
                for (i, &p) in paths.iter().enumerate() {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        pool.install(|| step(p));
                    }
                    if round > 0 {
                        best[i] = best[i].min(t.elapsed().as_secs_f64() / reps as f64);
                    }
                }
            }
            let base = best[0];
            for (p, t) in paths.iter().zip(&best) {
                println!(
                    "n={n} {}: {:.2} ms per forward, {:.1} tokens/s (matmuls only), {:.3}x baseline",
                    p.name(),
                    t * 1e3,
                    n as f64 / t,
                    base / t
                );
            }
        }
    }
}
