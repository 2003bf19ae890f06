//! Activation rows quantized for the native kernels, each row on its own
//! (so a row's quants, and so its results, never depend on the batch), the
//! way llama.cpp quantizes them on x86 for the same weight type:
//! - Q8_0 (for Q4_0, Q5_0, Q8_0 weights): per 32, `d = amax/127` stored as
//!   f16, `q = round_ties_even(x·(127/amax))` (`quantize_row_q8_0`, AVX2);
//! - Q8_1 (for Q4_1, Q5_1): Q8_0 plus `s = f16(d·Σq)`;
//! - Q8_K (for the K-quants): per 256, `iscale = -127/max` with `max` the
//!   value of largest magnitude, `q = min(127, round_ties_even(iscale·x))`,
//!   `d = 1/iscale` in f32 (`quantize_row_q8_K_ref`, which x86 uses), and
//!   the sum of each 32 quants (llama.cpp keeps sums of 16 and adds them
//!   in pairs: the same integers).

use half::f16;

/// Which activation format a weight type multiplies with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    /// Blocks of 32, f16 scale.
    Q8_0,
    /// Blocks of 32, f16 scale and f16 scaled sum.
    Q8_1,
    /// Blocks of 256, f32 scale, sums of 16.
    Q8K,
}

impl ActKind {
    /// Elements per activation block.
    pub fn block(self) -> usize {
        match self {
            ActKind::Q8_0 | ActKind::Q8_1 => 32,
            ActKind::Q8K => 256,
        }
    }
}

/// `n` activation rows of `cols` each, quantized.
pub struct Acts {
    /// Columns per row.
    pub cols: usize,
    /// The quants, `[n][cols]`.
    pub qs: Vec<i8>,
    /// One scale per block, `[n][cols / block]`.
    pub d: Vec<f32>,
    /// Q8_1: `d·Σq` per block (f16-rounded), like `d`; else empty.
    pub s: Vec<f32>,
    /// Q8_K: the sum of each 32 quants, `[n][cols / 32]`; else empty.
    pub bsums: Vec<i16>,
}

impl Acts {
    /// Quantize `x` (`[n][cols]`, `cols` a multiple of the kind's block).
    pub fn quantize(kind: ActKind, x: &[f32], n: usize, cols: usize) -> Acts {
        assert_eq!(x.len(), n * cols, "activation shape");
        assert_eq!(cols % kind.block(), 0, "columns not whole blocks");
        let blocks = n * cols / kind.block();
        let mut a = Acts {
            cols,
            qs: vec![0; n * cols],
            d: Vec::with_capacity(blocks),
            s: Vec::new(),
            bsums: Vec::new(),
        };
        match kind {
            ActKind::Q8_0 | ActKind::Q8_1 => {
                if kind == ActKind::Q8_1 {
                    a.s.reserve(blocks);
                }
                for (src, dst) in x.chunks_exact(32).zip(a.qs.chunks_exact_mut(32)) {
                    let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let mut sum = 0i32;
                    for (q, v) in dst.iter_mut().zip(src) {
                        *q = (v * id).round_ties_even() as i8;
                        sum += i32::from(*q);
                    }
                    let d = f16::from_f32(d);
                    a.d.push(d.to_f32());
                    if kind == ActKind::Q8_1 {
                        a.s.push(f16::from_f32(d.to_f32() * sum as f32).to_f32());
                    }
                }
            }
            ActKind::Q8K => {
                a.bsums.resize(n * cols / 32, 0);
                a.d.resize(blocks, 0.0);
                for (((src, dst), bs), d) in x
                    .chunks_exact(256)
                    .zip(a.qs.chunks_exact_mut(256))
                    .zip(a.bsums.chunks_exact_mut(8))
                    .zip(a.d.iter_mut())
                {
                    *d = q8k_block(src, dst, bs);
                }
            }
        }
        a
    }
}

/// One Q8_K block: 256 values quantized into `q`, the sums of each 32
/// quants into `bsums`; returns the scale (0 for an all-zero block, whose
/// quants and sums are 0). Written so that the loops vectorize; the
/// results are those of the one-value-at-a-time rule in the module's doc.
#[inline]
pub(crate) fn q8k_block(src: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    let (src, q, bsums) = (&src[..256], &mut q[..256], &mut bsums[..8]);
    // The largest magnitude (max is exact, so partial maxima give it; a
    // NaN never wins `>`), then the first value that has it.
    let mut m = [0f32; 8];
    for c in src.chunks_exact(8) {
        for (m, v) in m.iter_mut().zip(c) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let amax = m.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    if amax == 0.0 {
        q.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let max = *src
        .iter()
        .find(|v| v.abs() == amax)
        .expect("the maximum is one of the values");
    let iscale = -127.0 / max;
    for (q, v) in q.iter_mut().zip(src) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    for (s, g) in bsums.iter_mut().zip(q.chunks_exact(32)) {
        *s = g.iter().map(|&v| i16::from(v)).sum();
    }
    1.0 / iscale
}
