//! Q8_0 × Q8_0 matrix product for decode-sized batches (1..=64 activation
//! rows), written for weight reuse: a tile of `TILE` weight rows is loaded
//! once per step and used for every activation row, where candle's generic
//! CPU kernel streams each weight row once per activation row.
//!
//! Arithmetic (chosen to equal candle's AVX2 `vec_dot_q8_0_q8_0`, which is
//! what the `q8_0` decode format ran before, bit for bit):
//! - every activation row is quantized to Q8_0 in blocks of 32 exactly as
//!   candle's `BlockQ8_0::from_float` (llama.cpp's `quantize_row_q8_0`
//!   reference): `d = amax / 127`, `id = 1/d` (0 when `d == 0`),
//!   `q = round(x·id)` (half away from zero), `d` stored as f16;
//! - per output element and block, the 32 products `q_w·q_x` are summed as
//!   i32 in 8 lanes (lane `j` holds elements `4j..4j+3`), each lane is
//!   converted to f32 and accumulated across blocks with one fused
//!   multiply-add by `f32(d_w)·f32(d_x)`, and the 8 lanes are summed at the
//!   end as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
//!
//! Every output element depends only on its weight row and its activation
//! row, never on the batch size or the thread count.
//!
//! On x86-64 with AVX2 and FMA (the release target, x86-64-v3) a block
//! product is candle's instruction sequence, called through `safe_arch`:
//! `vpsignb` (the weight's quants take the signs of the activation's),
//! `vpmaddubsw` (`|q_x|` times those, adjacent pairs summed to i16),
//! `vpmaddwd` by ones (pairs of those to i32: the lanes above),
//! `vcvtdq2ps` and `vfmadd`. The i16 pair sums are exact as long as no
//! weight quant is -128 (then `|q_x|·|q_w|·2 ≤ 128·127·2 < 2^15`); Q8_0
//! produced by quantization, candle's or llama.cpp's, never holds -128
//! (`|round(x·127/amax)| ≤ 127`). Elsewhere a portable version computes the
//! same lanes with i32 integer arithmetic and `f32::mul_add`, which gives
//! the same bits.

use half::f16;
use rayon::prelude::*;

use lanes::Quants;

/// Elements per Q8_0 block.
pub const QK: usize = 32;
/// Weight rows per tile.
const TILE: usize = 4;
/// Activation rows computed together against a tile (the register block
/// is `TILE × COLS` accumulators).
const COLS: usize = 2;
/// Bytes of one Q8_0 block in GGUF/candle storage: f16 scale + 32 × i8.
const BLOCK_BYTES: usize = 2 + QK;

/// The block product as vector instructions (x86-64 with AVX2 and FMA).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod lanes {
    use safe_arch::{
        convert_to_m256_from_i32_m256i, fused_mul_add_m256, m256, m256i,
        mul_i16_horizontal_add_m256i, mul_u8i8_add_horizontal_saturating_m256i,
        set_splat_i16_m256i, set_splat_m256, sign_apply_i8_m256i, zeroed_m256,
    };

    /// The 32 quants of one block, element order, 32-byte aligned.
    pub type Quants = m256i;
    /// 8 f32 lane accumulators.
    pub type Acc = m256;

    /// Quants from bytes (as `i8`).
    #[inline(always)]
    pub fn quants(q: [i8; 32]) -> Quants {
        m256i::from(q)
    }

    /// Zero accumulators.
    #[inline(always)]
    pub fn zero() -> Acc {
        zeroed_m256()
    }

    /// `w · x` for four weight-row scales (one 128-bit multiply: LLVM
    /// vectorizes the plain loop across blocks, with shuffles).
    #[inline(always)]
    pub fn scale4(w: [f32; 4], x: f32) -> [f32; 4] {
        use safe_arch::{m128, mul_m128, set_splat_m128};
        mul_m128(m128::from(w), set_splat_m128(x)).into()
    }

    /// Sixteen `1i16`, the multiplier that sums pairs of i16 lanes.
    #[inline(always)]
    pub fn ones() -> Quants {
        set_splat_i16_m256i(1)
    }

    /// `acc + f32(lanes(w·x))·d`, where `ax` holds `|x|` (as `u8`) and
    /// `x` the signed quants; `ones` is [`ones`].
    #[inline(always)]
    pub fn step(acc: Acc, w: Quants, x: Quants, ax: Quants, d: f32, ones: Quants) -> Acc {
        let sw = sign_apply_i8_m256i(w, x);
        let pairs = mul_u8i8_add_horizontal_saturating_m256i(ax, sw);
        let lanes = mul_i16_horizontal_add_m256i(pairs, ones);
        fused_mul_add_m256(
            convert_to_m256_from_i32_m256i(lanes),
            set_splat_m256(d),
            acc,
        )
    }

    /// The 8 lanes.
    #[inline(always)]
    pub fn lanes(acc: Acc) -> [f32; 8] {
        acc.into()
    }

    /// The bytes of quants.
    #[cfg(test)]
    pub fn bytes(q: Quants) -> [i8; 32] {
        q.into()
    }
}

/// The block product in portable Rust (same results).
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod lanes {
    /// The 32 quants of one block, element order.
    #[derive(Clone, Copy, Default)]
    #[repr(C, align(32))]
    pub struct Quants([i8; 32]);
    /// 8 f32 lane accumulators.
    pub type Acc = [f32; 8];

    /// Quants from bytes.
    pub fn quants(q: [i8; 32]) -> Quants {
        Quants(q)
    }

    /// Zero accumulators.
    pub fn zero() -> Acc {
        [0.0; 8]
    }

    /// `w · x` for four weight-row scales.
    pub fn scale4(w: [f32; 4], x: f32) -> [f32; 4] {
        w.map(|w| w * x)
    }

    /// Unused here.
    pub fn ones() -> Quants {
        Quants([0; 32])
    }

    /// `acc + f32(lanes(w·x))·d`; `ax` and `ones` are unused here.
    pub fn step(mut acc: Acc, w: Quants, x: Quants, _ax: Quants, d: f32, _ones: Quants) -> Acc {
        for (j, a) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * j..4 * j + 4)
                .map(|k| i32::from(w.0[k]) * i32::from(x.0[k]))
                .sum();
            *a = (s as f32).mul_add(d, *a);
        }
        acc
    }

    /// The 8 lanes.
    pub fn lanes(acc: Acc) -> [f32; 8] {
        acc
    }

    /// The bytes of quants.
    #[cfg(test)]
    pub fn bytes(q: Quants) -> [i8; 32] {
        q.0
    }
}

/// Q8_0 weights `[out, in]`, rows padded with zero rows to a multiple of
/// `TILE`; tile `t` holds rows `t·TILE..`, its quants and scales
/// interleaved by block (`[block][row]`, the order the kernel reads them).
pub struct Q8Matrix {
    out_dim: usize,
    in_dim: usize,
    blocks: usize,
    qs: Vec<Quants>,
    /// Scales, f16 values widened to f32.
    d: Vec<f32>,
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
        let tiles = out_dim.div_ceil(TILE);
        let mut qs = vec![lanes::quants([0; QK]); tiles * blocks * TILE];
        let mut d = vec![0f32; tiles * blocks * TILE];
        for (row, bytes) in data.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
            let (t, r) = (row / TILE, row % TILE);
            for (b, blk) in bytes.chunks_exact(BLOCK_BYTES).enumerate() {
                let i = (t * blocks + b) * TILE + r;
                d[i] = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                qs[i] = lanes::quants(std::array::from_fn(|k| blk[2 + k] as i8));
            }
        }
        Ok(Self {
            out_dim,
            in_dim,
            blocks,
            qs,
            d,
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
        let tiles = self.out_dim.div_ceil(TILE);
        let per_tile = TILE * self.blocks;
        // Results transposed, `[tiles · TILE, n]`: each tile owns a
        // contiguous chunk, so tiles can be split across threads safely.
        let mut yt = vec![0f32; tiles * TILE * n];
        let threads = rayon::current_num_threads().max(1);
        // A few chunks per thread so that a thread slowed by another process
        // does not hold the others up for long.
        let tiles_per_chunk = tiles.div_ceil(threads * 4).max(1);
        yt.par_chunks_mut(tiles_per_chunk * TILE * n)
            .enumerate()
            .for_each_init(Vec::new, |dd, (chunk, out)| {
                let t0 = chunk * tiles_per_chunk;
                for (i, out) in out.chunks_exact_mut(TILE * n).enumerate() {
                    let t = t0 + i;
                    let w = &self.qs[t * per_tile..(t + 1) * per_tile];
                    let wd = &self.d[t * per_tile..(t + 1) * per_tile];
                    tile(dd, w, wd, &acts, n, out, path);
                }
            });
        let mut y = vec![0f32; n * self.out_dim];
        for (o, col) in yt.chunks_exact(n).take(self.out_dim).enumerate() {
            for (c, &v) in col.iter().enumerate() {
                y[c * self.out_dim + o] = v;
            }
        }
        y
    }
}

/// Activation rows quantized to Q8_0, `[n][blocks]` each.
pub struct QuantizedRows {
    /// Quants.
    qs: Vec<Quants>,
    /// Their absolute values (as `u8`).
    abs: Vec<Quants>,
    /// Scales, f16 values widened to f32.
    d: Vec<f32>,
}

/// Quantize `n` rows of `in_dim` (a multiple of 32) to Q8_0 as candle's
/// `BlockQ8_0::from_float` does.
pub fn quantize_rows(x: &[f32], n: usize, in_dim: usize) -> QuantizedRows {
    let blocks = n * in_dim / QK;
    let mut out = QuantizedRows {
        qs: Vec::with_capacity(blocks),
        abs: Vec::with_capacity(blocks),
        d: Vec::with_capacity(blocks),
    };
    for src in x.chunks_exact(QK) {
        let (q, abs, d) = quantize_block(src);
        out.qs.push(lanes::quants(q));
        out.abs.push(lanes::quants(abs));
        out.d.push(d);
    }
    out
}

/// One block: quants, their absolute values (as `u8` bits) and the scale.
#[inline]
fn quantize_block(src: &[f32]) -> ([i8; QK], [i8; QK], f32) {
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
    let mut q = [0i8; QK];
    let mut abs = [0i8; QK];
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
        *q = (c + 12_582_912.0).to_bits() as u8 as i8;
        *a = (c.abs() + 12_582_912.0).to_bits() as u8 as i8;
    }
    (q, abs, f16::from_f32(dd).to_f32())
}

/// candle's `hsum_float_8` order.
#[inline(always)]
fn hsum(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// One tile of `TILE` weight rows (`w`, `wd`: `[blocks][TILE]`) against all
/// `n` activation rows; `out` is `[TILE, n]`.
/// `dd` is scratch for the scale products.
fn tile(
    dd: &mut Vec<f32>,
    w: &[Quants],
    wd: &[f32],
    acts: &QuantizedRows,
    n: usize,
    out: &mut [f32],
    path: crate::simd::Q8Path,
) {
    let blocks = wd.len() / TILE;
    // The scale products f32(d_w)·f32(d_x), `[n][blocks][TILE]`, computed
    // up front so that the block loop only loads them.
    // Every element is written below: resizing (not clearing) is enough.
    dd.resize(n * blocks * TILE, 0.0);
    let wd = wd.as_chunks::<TILE>().0;
    for (ddc, xd) in dd
        .chunks_exact_mut(blocks * TILE)
        .zip(acts.d.chunks_exact(blocks))
    {
        for ((ddb, wdb), &x) in ddc.as_chunks_mut::<TILE>().0.iter_mut().zip(wd).zip(xd) {
            *ddb = lanes::scale4(*wdb, x);
        }
    }
    let mut c = 0;
    while c < n {
        let take = (n - c).min(COLS);
        let res: [f32; TILE * COLS] = match take {
            COLS => kernel::<COLS>(w, acts, dd, blocks, c, path),
            _ => {
                let mut res = [0f32; TILE * COLS];
                for k in 0..take {
                    res[k * TILE..][..TILE]
                        .copy_from_slice(&kernel::<1>(w, acts, dd, blocks, c + k, path)[..TILE]);
                }
                res
            }
        };
        for k in 0..take {
            for r in 0..TILE {
                out[r * n + c + k] = res[k * TILE + r];
            }
        }
        c += take;
    }
}

/// `TILE` weight rows against activation rows `c0..c0 + C`; returns
/// `[C][TILE]` (padded to `TILE · COLS`). Not inlined, so that LLVM
/// allocates the accumulators to registers for this loop alone.
#[inline(never)]
fn kernel<const C: usize>(
    w: &[Quants],
    acts: &QuantizedRows,
    dd: &[f32],
    blocks: usize,
    c0: usize,
    path: crate::simd::Q8Path,
) -> [f32; TILE * COLS] {
    // Slices of exactly `blocks` elements, visible to LLVM: no bounds
    // checks in the loop.
    let w = &w.as_chunks::<TILE>().0[..blocks];
    let xs: [&[Quants]; C] = std::array::from_fn(|k| &acts.qs[(c0 + k) * blocks..][..blocks]);
    let ax: [&[Quants]; C] = std::array::from_fn(|k| &acts.abs[(c0 + k) * blocks..][..blocks]);
    let ds: [&[[f32; TILE]]; C] =
        std::array::from_fn(|k| &dd[(c0 + k) * blocks * TILE..].as_chunks::<TILE>().0[..blocks]);
    let lanes = faster_lanes::<C>(path, w, xs, ax, ds, blocks)
        .unwrap_or_else(|| baseline_lanes::<C>(w, xs, ax, ds, blocks));
    let mut res = [0f32; TILE * COLS];
    for (r, acc) in lanes.iter().enumerate() {
        for (k, acc) in acc.iter().enumerate() {
            res[k * TILE + r] = hsum(acc);
        }
    }
    res
}

/// The lanes of a run-time chosen SIMD kernel (`None`: run the baseline).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
fn faster_lanes<const C: usize>(
    path: crate::simd::Q8Path,
    w: &[[Quants; TILE]],
    xs: [&[Quants]; C],
    ax: [&[Quants]; C],
    ds: [&[[f32; TILE]]; C],
    blocks: usize,
) -> Option<[[[f32; 8]; C]; TILE]> {
    crate::simd::block_products::<C, TILE>(path, w, xs, ax, ds, blocks)
}

/// No faster kernel outside x86-64 with AVX2: the baseline runs.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
#[inline(always)]
fn faster_lanes<const C: usize>(
    _path: crate::simd::Q8Path,
    _w: &[[Quants; TILE]],
    _xs: [&[Quants]; C],
    _ax: [&[Quants]; C],
    _ds: [&[[f32; TILE]]; C],
    _blocks: usize,
) -> Option<[[[f32; 8]; C]; TILE]> {
    None
}

/// The safe kernel: the lanes of `TILE` weight rows against `C`
/// activation rows.
#[inline(always)]
fn baseline_lanes<const C: usize>(
    w: &[[Quants; TILE]],
    xs: [&[Quants]; C],
    ax: [&[Quants]; C],
    ds: [&[[f32; TILE]]; C],
    blocks: usize,
) -> [[[f32; 8]; C]; TILE] {
    let ones = lanes::ones();
    let mut acc = [[lanes::zero(); C]; TILE];
    for b in 0..blocks {
        let x: [Quants; C] = std::array::from_fn(|k| xs[k][b]);
        let a: [Quants; C] = std::array::from_fn(|k| ax[k][b]);
        for (r, acc) in acc.iter_mut().enumerate() {
            let wr = w[b][r];
            for k in 0..C {
                acc[k] = lanes::step(acc[k], wr, x[k], a[k], ds[k][b][r], ones);
            }
        }
    }
    acc.map(|row| row.map(lanes::lanes))
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

    /// Our kernel and candle's QMatMul on the same Q8_0 weights.
    fn both(w: &[f32], x: &[f32], out: usize, inp: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let dev = Device::Cpu;
        let wt = Tensor::from_slice(w, (out, inp), &dev).unwrap();
        let q = QTensor::quantize(&wt, GgmlDType::Q8_0).unwrap();
        let ours = Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp)
            .unwrap()
            .forward(x, n);
        let mm = QMatMul::from_qtensor(q).unwrap();
        let theirs = mm
            .forward(&Tensor::from_slice(x, (n, inp), &dev).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        (ours, theirs)
    }

    fn assert_bits_eq(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "element {i}: {x} vs {y}");
        }
    }

    /// Every kernel path this CPU runs (the safe baseline and the
    /// run-time chosen SIMD ones) gives the same bits, for every shape the
    /// model uses and odd ones, batch 1 to 17, with weights at the quant
    /// range's ends.
    #[test]
    fn every_path_gives_the_same_bits() {
        use crate::simd::Q8Path;
        let paths = Q8Path::available();
        eprintln!("kernel paths on this CPU: {paths:?}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(out, inp) in &[(960, 576), (576, 1536), (37, 576), (5, 32), (3, 2048)] {
            for &n in &[1usize, 2, 3, 8, 17] {
                let mut w = random(&mut rng, out * inp, 0.1);
                // A block whose largest weight sits at +127 and -127.
                w[0] = 0.5;
                w[1] = -0.5;
                let x = random(&mut rng, n * inp, 2.0);
                let dev = Device::Cpu;
                let wt = Tensor::from_slice(&w, (out, inp), &dev).unwrap();
                let q = QTensor::quantize(&wt, GgmlDType::Q8_0).unwrap();
                let m = Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp).unwrap();
                let base = m.forward_with(&x, n, Q8Path::Baseline);
                for &p in &paths[1..] {
                    let got = m.forward_with(&x, n, p);
                    for (i, (a, b)) in got.iter().zip(&base).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{} vs baseline, {out}x{inp} n={n} element {i}: {a} vs {b}",
                            p.name()
                        );
                    }
                }
                assert_eq!(m.forward(&x, n), base, "the chosen path");
            }
        }
    }

    /// `unsafe` lives in `simd/` only: no other source file of the crate
    /// allows it or uses it.
    #[test]
    fn only_simd_may_use_unsafe() {
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
                    let allowed = path == src.join("lib.rs")
                        && (line.trim() == "#[allow(unsafe_code)]"
                            || line.trim() == "#![deny(unsafe_code)]");
                    assert!(
                        allowed || !uses,
                        "{}:{}: `unsafe` outside simd/: {line}",
                        path.display(),
                        i + 1
                    );
                }
            }
        }
        assert!(checked > 10, "{checked} files");
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        assert!(lib.contains("#![deny(unsafe_code)]"));
        assert_eq!(lib.matches("allow(unsafe_code)").count(), 1);
        assert!(lib.contains("#[allow(unsafe_code)]\npub mod simd;"));
    }

    /// Shapes where candle takes its generic AVX2 path (inner dimension not
    /// a multiple of 256, or output not a multiple of 16): bit-identical.
    #[test]
    fn equals_candle_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for &(out, inp) in &[
            (960, 576),
            (37, 576),
            (5, 32),
            (13, 96),
            (22, 1536),
            (3, 2048),
        ] {
            for &n in &[1usize, 2, 3, 8, 17] {
                let w = random(&mut rng, out * inp, 0.1);
                let x = random(&mut rng, n * inp, 2.0);
                let (ours, theirs) = both(&w, &x, out, inp, n);
                assert_bits_eq(&ours, &theirs);
            }
        }
    }

    /// Where candle's QMatMul switches to its AVX-512 VNNI kernel (activations
    /// in blocks of 256) the results differ by activation rounding only.
    #[test]
    fn close_to_candle_vnni_shapes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let (out, inp, n) = (64, 1536, 4);
        let w = random(&mut rng, out * inp, 0.1);
        let x = random(&mut rng, n * inp, 2.0);
        let (ours, theirs) = both(&w, &x, out, inp, n);
        // Exact f32 product for scale.
        let mut max_ref = 0f32;
        for c in 0..n {
            for o in 0..out {
                let e: f32 = (0..inp).map(|i| w[o * inp + i] * x[c * inp + i]).sum();
                max_ref = max_ref.max(e.abs());
            }
        }
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() <= 0.02 * max_ref, "{a} vs {b}");
        }
    }

    /// Row `r` of the result is the same bits for any batch containing it.
    #[test]
    fn batch_independent() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(out, inp) in &[(49, 576), (3072, 576), (576, 1536)] {
            let w = random(&mut rng, out * inp, 0.05);
            let dev = Device::Cpu;
            let q = QTensor::quantize(
                &Tensor::from_slice(&w, (out, inp), &dev).unwrap(),
                GgmlDType::Q8_0,
            )
            .unwrap();
            let m = Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp).unwrap();
            let n = 17;
            let x = random(&mut rng, n * inp, 3.0);
            let all = m.forward(&x, n);
            for r in 0..n {
                let solo = m.forward(&x[r * inp..(r + 1) * inp], 1);
                assert_bits_eq(&solo, &all[r * out..(r + 1) * out]);
            }
            let eight = m.forward(&x[..8 * inp], 8);
            assert_bits_eq(&eight, &all[..8 * out]);
            // Same on a single-thread pool.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_bits_eq(&pool.install(|| m.forward(&x, n)), &all);
        }
    }

    #[test]
    fn zero_rows_and_empty_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (out, inp) = (7, 64);
        let w = random(&mut rng, out * inp, 1.0);
        let mut x = random(&mut rng, 3 * inp, 1.0);
        x[inp..2 * inp].fill(0.0);
        let (ours, theirs) = both(&w, &x, out, inp, 3);
        assert_bits_eq(&ours, &theirs);
        assert!(ours[out..2 * out].iter().all(|&v| v == 0.0));
        let dev = Device::Cpu;
        let q = QTensor::quantize(
            &Tensor::from_slice(&w, (out, inp), &dev).unwrap(),
            GgmlDType::Q8_0,
        )
        .unwrap();
        let m = Q8Matrix::from_ggml_q8_0(&q.data().unwrap(), out, inp).unwrap();
        assert!(m.forward(&[], 0).is_empty());
        // Zero weights.
        let (ours, _) = both(&vec![0.0; out * inp], &x, out, inp, 3);
        assert!(ours.iter().all(|&v| v == 0.0));
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
        for (b, blk) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            assert_eq!(
                f16::from_le_bytes([blk[0], blk[1]]).to_f32().to_bits(),
                rows.d[b].to_bits()
            );
            let (q, abs) = (lanes::bytes(rows.qs[b]), lanes::bytes(rows.abs[b]));
            for k in 0..QK {
                assert_eq!(q[k], blk[2 + k] as i8);
                assert_eq!(abs[k] as u8, (blk[2 + k] as i8).unsigned_abs());
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

    /// Kernel timing on SmolLM2-135M's shapes (one decode step: 30 layers
    /// and the LM head), n = 1 and 8:
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
        let dev = Device::Cpu;
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
                let q = QTensor::quantize(
                    &Tensor::from_slice(&w, (out, inp), &dev).unwrap(),
                    GgmlDType::Q8_0,
                )
                .unwrap();
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
        for n in [1usize, 8] {
            let xs: Vec<Vec<f32>> = mats
                .iter()
                .map(|(m, _)| random(&mut rng, n * m.in_dim(), 1.0))
                .collect();
            let step = |p: crate::simd::Q8Path| {
                for ((m, times), x) in mats.iter().zip(&xs) {
                    for _ in 0..*times {
                        std::hint::black_box(m.forward_with(x, n, p));
                    }
                }
            };
            let mut best = vec![f64::MAX; paths.len()];
            for round in 0..6 {
                for (i, &p) in paths.iter().enumerate() {
                    let t = std::time::Instant::now();
                    for _ in 0..10 {
                        pool.install(|| step(p));
                    }
                    if round > 0 {
                        best[i] = best[i].min(t.elapsed().as_secs_f64() / 10.0);
                    }
                }
            }
            let base = best[0];
            for (p, t) in paths.iter().zip(&best) {
                println!(
                    "n={n} {}: {:.2} ms per step, {:.1} tokens/s (matmuls only), {:.3}x baseline",
                    p.name(),
                    t * 1e3,
                    n as f64 / t,
                    base / t
                );
            }
        }
    }
}
