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
//! The code is safe Rust shaped for LLVM's auto-vectorizer (target
//! x86-64-v3): blocks are stored as 16-bit integers in an order where the
//! pairs that `vpmaddwd` sums are adjacent (see `PERM`), so a block's
//! product is two `vpmaddwd` and one `vpaddd`.

use half::f16;
use rayon::prelude::*;

/// Elements per Q8_0 block.
pub const QK: usize = 32;
/// Weight rows per tile.
const TILE: usize = 4;
/// Bytes of one Q8_0 block in GGUF/candle storage: f16 scale + 32 × i8.
const BLOCK_BYTES: usize = 2 + QK;

/// `PERM[p]` is the original element index stored at position `p` of a
/// block. `vpmaddwd` over positions `0..16` and `16..32` gives i32 lanes
/// `j` = positions `{2j, 2j+1}` and `{16+2j, 17+2j}`; with this order those
/// are the original elements `4j..4j+3`, the lanes of candle's AVX2 kernel.
const PERM: [usize; QK] = {
    let mut p = [0usize; QK];
    let mut h = 0;
    while h < 2 {
        let mut j = 0;
        while j < 8 {
            let mut t = 0;
            while t < 2 {
                p[16 * h + 2 * j + t] = 4 * j + 2 * h + t;
                t += 1;
            }
            j += 1;
        }
        h += 1;
    }
    p
};

/// Q8_0 weights `[out, in]`, row-major, rows padded with zero rows to a
/// multiple of `TILE` (tile `t` is the contiguous rows `t·TILE..`).
pub struct Q8Matrix {
    out_dim: usize,
    in_dim: usize,
    blocks: usize,
    /// Quants in `PERM` order.
    qs: Vec<[i8; QK]>,
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
        let mut qs = vec![[0i8; QK]; tiles * blocks * TILE];
        let mut d = vec![0f32; tiles * blocks * TILE];
        for (row, bytes) in data.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
            for (b, blk) in bytes.chunks_exact(BLOCK_BYTES).enumerate() {
                let i = row * blocks + b;
                d[i] = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for (p, q) in qs[i].iter_mut().enumerate() {
                    *q = blk[2 + PERM[p]] as i8;
                }
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
        assert_eq!(x.len(), n * self.in_dim, "activation shape");
        if n == 0 || self.out_dim == 0 {
            return vec![0.0; n * self.out_dim];
        }
        let (xq, xd) = quantize_rows(x, n, self.in_dim);
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
            .for_each_init(Scratch::default, |scratch, (chunk, out)| {
                let t0 = chunk * tiles_per_chunk;
                let qs = |t: usize| &self.qs[t * per_tile..(t + 1) * per_tile];
                let tiles_here = out.len() / (TILE * n);
                widen(qs(t0), &mut scratch.w16);
                for (i, out) in out.chunks_exact_mut(TILE * n).enumerate() {
                    let t = t0 + i;
                    let d = &self.d[t * per_tile..(t + 1) * per_tile];
                    // The next tile's weights are widened row by row while
                    // this one computes, so their loads from memory overlap
                    // with arithmetic.
                    let next = (i + 1 < tiles_here).then(|| qs(t + 1));
                    tile(scratch, d, &xq, &xd, self.blocks, n, out, next);
                    std::mem::swap(&mut scratch.w16, &mut scratch.next);
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

/// Quantize `n` rows of `in_dim` (a multiple of 32) to Q8_0 as candle's
/// `BlockQ8_0::from_float` does; returns the quants widened to i16 in
/// `PERM` order and the f16 scales widened to f32, both `[n][blocks]`.
pub fn quantize_rows(x: &[f32], n: usize, in_dim: usize) -> (Vec<[i16; QK]>, Vec<f32>) {
    let blocks = in_dim / QK;
    let mut qs = vec![[0i16; QK]; n * blocks];
    let mut ds = vec![0f32; n * blocks];
    for ((src, q), d) in x.chunks_exact(QK).zip(&mut qs).zip(&mut ds) {
        // Max is exact, so 8 partial maxima (vectorizable) give candle's
        // sequential `amax.max(|x|)`; a NaN never wins a `>` comparison,
        // as `max` ignores it.
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
        *d = f16::from_f32(dd).to_f32();
        let mut raw = [0i8; QK];
        for (r, &v) in raw.iter_mut().zip(src) {
            // Candle's `round(x·id) as i8` (saturating, NaN to 0), written
            // so that it vectorizes: an integer-valued c in [-128, 127]
            // plus 1.5·2^23 holds c in the low byte of its bits.
            let y = f32::round(v * id);
            let c = if y.is_nan() {
                0.0
            } else {
                y.clamp(-128.0, 127.0)
            };
            *r = (c + 12_582_912.0).to_bits() as u8 as i8;
        }
        for (p, v) in q.iter_mut().enumerate() {
            *v = raw[PERM[p]] as i16;
        }
    }
    (qs, ds)
}

/// Widen a tile's quants to i16 (a separate pass, so that the dot products
/// below see two i16 operands and become `vpmaddwd`).
fn widen(qs: &[[i8; QK]], w16: &mut Vec<[i16; QK]>) {
    w16.clear();
    widen_more(qs, w16);
}

/// Append `qs` widened to i16.
fn widen_more(qs: &[[i8; QK]], w16: &mut Vec<[i16; QK]>) {
    w16.extend(qs.iter().map(|b| b.map(i16::from)));
}

/// The 8 lane sums of one block product (see `PERM`).
#[inline(always)]
fn block_dot(w: &[i16; QK], x: &[i16; QK]) -> [i32; 8] {
    let mut pairs = [0i32; 16];
    for (j, p) in pairs.iter_mut().enumerate() {
        // |w|, |x| <= 128: no overflow; wrapping ops keep overflow checks
        // (test profile) out of the vectorized loop.
        *p = (i32::from(w[2 * j]).wrapping_mul(i32::from(x[2 * j])))
            .wrapping_add(i32::from(w[2 * j + 1]).wrapping_mul(i32::from(x[2 * j + 1])));
    }
    let mut s = [0i32; 8];
    for (j, v) in s.iter_mut().enumerate() {
        *v = pairs[j].wrapping_add(pairs[j + 8]);
    }
    s
}

/// candle's `hsum_float_8` order.
#[inline(always)]
fn hsum(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// One tile of `TILE` weight rows (`w16`, `wd`: row-major, `blocks` per
/// row) against all `n` activation rows; `out` is `[TILE, n]`.
///
/// The loops are shaped so that LLVM keeps the accumulators in registers
/// and emits full-width `vpmaddwd`: one weight row against up to 4
/// activation rows, or 4 weight rows against one activation row (other
/// shapes, e.g. weight-row tiles against column pairs, came out as
/// shuffles). Every shape performs the same operations per output element
/// in the same order.
/// `next` (the following tile's quants, if any) is widened into
/// `scratch.next` along the way.
#[allow(clippy::too_many_arguments)]
fn tile(
    scratch: &mut Scratch,
    wd: &[f32],
    xq: &[[i16; QK]],
    xd: &[f32],
    blocks: usize,
    n: usize,
    out: &mut [f32],
    next: Option<&[[i8; QK]]>,
) {
    let Scratch {
        w16,
        dd,
        next: next16,
    } = scratch;
    next16.clear();
    let mut prefetch = |r: usize| {
        if let Some(q) = next {
            widen_more(&q[r * blocks..][..blocks], next16);
        }
    };
    let w16 = &w16[..TILE * blocks];
    let wrow = |r: usize| (&w16[r * blocks..][..blocks], &wd[r * blocks..][..blocks]);
    let xrow = |c: usize| (&xq[c * blocks..][..blocks], &xd[c * blocks..][..blocks]);
    // The scale products f32(d_w)·f32(d_x), computed up front (vectorized)
    // so that the block loops only load them.
    let scales = |dd: &mut Vec<f32>, pairs: &mut dyn Iterator<Item = (&[f32], &[f32])>| {
        dd.clear();
        for (a, b) in pairs {
            dd.extend(a.iter().zip(b).map(|(a, b)| a * b));
        }
    };
    let mut c = 0;
    while n - c >= 2 {
        let take = (n - c).min(4);
        for r in 0..TILE {
            let (w, wd) = wrow(r);
            scales(dd, &mut (c..c + take).map(|k| (wd, xrow(k).1)));
            let dst = &mut out[r * n + c..][..take];
            let ds = |k: usize| &dd[k * blocks..][..blocks];
            match take {
                4 => {
                    let x: [_; 4] = std::array::from_fn(|k| xrow(c + k).0);
                    dst.copy_from_slice(&row_cols(w, x, std::array::from_fn(ds)));
                }
                3 => {
                    let x: [_; 3] = std::array::from_fn(|k| xrow(c + k).0);
                    dst.copy_from_slice(&row_cols(w, x, std::array::from_fn(ds)));
                }
                _ => {
                    let x: [_; 2] = std::array::from_fn(|k| xrow(c + k).0);
                    dst.copy_from_slice(&row_cols(w, x, std::array::from_fn(ds)));
                }
            }
            if c == 0 {
                prefetch(r);
            }
        }
        c += take;
    }
    if c < n {
        let (x, xd) = xrow(c);
        scales(dd, &mut (0..TILE).map(|r| (wrow(r).1, xd)));
        let w: [_; TILE] = std::array::from_fn(|r| wrow(r).0);
        let ds: [_; TILE] = std::array::from_fn(|r| &dd[r * blocks..][..blocks]);
        let res = rows_col(w, ds, x);
        for (r, v) in res.into_iter().enumerate() {
            out[r * n + c] = v;
        }
        if c == 0 {
            (0..TILE).for_each(prefetch);
        }
    }
}

/// Per-thread buffers of the tile loop.
#[derive(Default)]
struct Scratch {
    /// The tile's weights widened to i16.
    w16: Vec<[i16; QK]>,
    /// Scale products, one row of `blocks` per dot product of a call.
    dd: Vec<f32>,
    /// The next tile's weights widened to i16.
    next: Vec<[i16; QK]>,
}

/// Accumulate one block product into `acc` (the per-element step).
#[inline(always)]
fn step(acc: &mut [f32; 8], w: &[i16; QK], x: &[i16; QK], d: f32) {
    let s = block_dot(w, x);
    for (a, &v) in acc.iter_mut().zip(&s) {
        *a = (v as f32).mul_add(d, *a);
    }
}

/// One weight row against `C` activation rows; `ds[k][b]` is the scale
/// product of block `b` for activation row `k`. Not inlined: inlined into
/// `tile` the loop was vectorized across rows with shuffles instead.
#[inline(never)]
fn row_cols<const C: usize>(w: &[[i16; QK]], xs: [&[[i16; QK]]; C], ds: [&[f32]; C]) -> [f32; C] {
    // Equal lengths, visible to LLVM: no bounds checks in the loop.
    let nb = w.len();
    let (xs, ds) = (xs.map(|x| &x[..nb]), ds.map(|d| &d[..nb]));
    let mut acc = [[0f32; 8]; C];
    for b in 0..nb {
        for k in 0..C {
            step(&mut acc[k], &w[b], &xs[k][b], ds[k][b]);
        }
    }
    std::array::from_fn(|k| hsum(&acc[k]))
}

/// `R` weight rows against one activation row (not inlined, as above).
#[inline(never)]
fn rows_col<const R: usize>(ws: [&[[i16; QK]]; R], ds: [&[f32]; R], x: &[[i16; QK]]) -> [f32; R] {
    let nb = x.len();
    let (ws, ds) = (ws.map(|w| &w[..nb]), ds.map(|d| &d[..nb]));
    let mut acc = [[0f32; 8]; R];
    for b in 0..nb {
        for r in 0..R {
            step(&mut acc[r], &ws[r][b], &x[b], ds[r][b]);
        }
    }
    std::array::from_fn(|r| hsum(&acc[r]))
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

    #[test]
    fn perm_is_a_permutation() {
        let mut seen = [false; QK];
        for &p in &PERM {
            assert!(!seen[p]);
            seen[p] = true;
        }
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
        let (qs, ds) = quantize_rows(&x, 1, inp);
        for (b, blk) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            assert_eq!(
                f16::from_le_bytes([blk[0], blk[1]]).to_f32().to_bits(),
                ds[b].to_bits()
            );
            for p in 0..QK {
                assert_eq!(qs[b][p], i16::from(blk[2 + PERM[p]] as i8));
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
        let mats: Vec<(Q8Matrix, usize)> = shapes
            .iter()
            .map(|&(out, inp, times)| {
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
        for n in [1usize, 8] {
            let xs: Vec<Vec<f32>> = mats
                .iter()
                .map(|(m, _)| random(&mut rng, n * m.in_dim(), 1.0))
                .collect();
            let step = || {
                for ((m, times), x) in mats.iter().zip(&xs) {
                    for _ in 0..*times {
                        std::hint::black_box(m.forward(x, n));
                    }
                }
            };
            pool.install(step);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..10 {
                    pool.install(step);
                }
                best = best.min(t.elapsed().as_secs_f64() / 10.0);
            }
            println!(
                "n={n}: {:.2} ms per step, {:.1} tokens/s (matmuls only)",
                best * 1e3,
                n as f64 / best
            );
        }
    }
}
