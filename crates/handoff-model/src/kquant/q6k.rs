//! Q6_K repacked (`kquant`): 6-bit quants (4 low bits and 2 high bits,
//! offset by 32) in 16 sub-blocks of 16 with signed 8-bit scales, 256 per
//! block.
//!
//! Layout: per group of [`GROUP`] = 8 rows and 256-element block, quad `w`
//! means elements `4w..4w + 4` (activation word `w`), sub-block `u` quads
//! `4u..4u + 4`. 48 vectors of 32 bytes, three per sub-block in order (one
//! sequential read), each holding in bytes `4r..4r + 4` the 4 elements of
//! row `r` of some quad:
//! - vector `3u + t` (`t` = 0, 1), the low 4 bits: of quad `4u + 2t` in the
//!   low nibbles, of quad `4u + 2t + 1` in the high nibbles;
//! - vector `3u + 2`, the high 2 bits: of quad `4u + k` in bits `2k, 2k+1`.
//!
//! Before them, [`Q6Meta`](crate::k_tile::Q6Meta) holds each row's `d` (the
//! file's f16 bits) and its 16 scales (one sequential stream,
//! [`Q6kBlock`]). 1680 bytes per 8 rows and 256 columns: 6.5625 bits a
//! weight, the file's own size (8.5 as a Q8_0 copy).
//!
//! Arithmetic of one output element (weight row `w`, activation row `x`
//! quantized to Q8_K as llama.cpp does, `native::act`), the same for every
//! path and batch size, so each element depends only on its two rows:
//! - per block, the exact integer `S = Σ_u sc_u · (Σ_{e∈u} q_e·x_e −
//!   32·bsum_u)`, `q_e` in 0..64 unsigned (`bsum_u`: the sum of sub-block
//!   `u`'s activation quants; `|S| < 2^27`: no lane overflows);
//! - `acc = fma(f32(S), d·d_x, acc)`, in block order, from `acc = 0`.
//!
//! The VNNI kernels (`simd/kquant.rs`): each quad's 6-bit quants are its
//! nibbles or'ed with its shifted, masked bit pair (one `vpternlogd` on
//! AVX-512), `vpdpbusd` adds 4 products per row, `vpmulld` applies the
//! scale to each sub-block's sum less its offset.

use crate::k_tile::{Format, Q6k, Q6kBlock, Tile, GROUP};
use crate::simd::Q8Path;

/// The 6-bit quants of one file block (`ql[128]`, `qh[64]`, `scales[16]`,
/// `d`), element by element, as llama.cpp's `dequantize_row_q6_K` reads
/// them (before its offset of 32).
fn quants(blk: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&blk[..128], &blk[128..192]);
    let mut q = [0u8; 256];
    for (i, q) in q.iter_mut().enumerate() {
        let (half, j) = (i / 128, i % 128);
        let (l, k) = (j % 32, j / 32);
        let low = ql[64 * half + l + 32 * (k % 2)];
        let low = if k < 2 { low & 0xF } else { low >> 4 };
        let high = (qh[32 * half + l] >> (2 * k)) & 3;
        *q = low | high << 4;
    }
    q
}

impl Format for Q6k {
    type B = Q6kBlock;
    const DTYPE: candle_core::quantized::GgmlDType = candle_core::quantized::GgmlDType::Q6K;
    const BLOCK_BYTES: usize = 210;
    const SUMS16: bool = true;

    fn pack(blk: &[u8], r: usize, b: &mut Q6kBlock) {
        let Q6kBlock { q: w, m } = b;
        m.d[r] = u16::from_le_bytes([blk[208], blk[209]]);
        for (u, &s) in blk[192..208].iter().enumerate() {
            m.sc[u][r] = s as i8;
        }
        let q = quants(blk);
        for u in 0..16 {
            for e in 0..4 {
                let at = |k: usize| q[16 * u + 4 * k + e];
                for t in 0..2 {
                    w[3 * u + t][4 * r + e] = (at(2 * t) & 0xF) | (at(2 * t + 1) & 0xF) << 4;
                }
                w[3 * u + 2][4 * r + e] = (0..4).fold(0, |acc, k| acc | (at(k) >> 4) << (2 * k));
            }
        }
    }

    #[allow(clippy::needless_range_loop)] // indices as the doc writes them
    fn portable<const G: usize, const C: usize>(
        t: &Tile<'_, Self, G, C>,
    ) -> [[[f32; GROUP]; C]; G] {
        let mut acc = [[[0f32; GROUP]; C]; G];
        for b in 0..t.blocks {
            for g in 0..G {
                let (w, m) = (&t.w[g][b].q, &t.w[g][b].m);
                for k in 0..C {
                    let x = &t.x[k][b * 64..][..64];
                    let bs = &t.bs16[k][b * 16..][..16];
                    let dx = t.xd[k][b];
                    for r in 0..GROUP {
                        let mut s = 0i32;
                        for u in 0..16 {
                            let mut dot = 0i32;
                            for quad in 0..4 {
                                let xs = x[4 * u + quad].to_le_bytes();
                                for e in 0..4 {
                                    let nib = w[3 * u + quad / 2][4 * r + e] >> (4 * (quad % 2));
                                    let high = w[3 * u + 2][4 * r + e] >> (2 * quad) & 3;
                                    let q = (nib & 0xF) | high << 4;
                                    dot += i32::from(q) * i32::from(xs[e] as i8);
                                }
                            }
                            s += i32::from(m.sc[u][r]) * (dot - bs[u]);
                        }
                        let dw = half::f16::from_bits(m.d[r]).to_f32();
                        let a = &mut acc[g][k][r];
                        *a = (s as f32).mul_add(dw * dx, *a);
                    }
                }
            }
        }
        acc
    }

    fn simd<const G: usize, const C: usize>(
        path: Q8Path,
        t: &Tile<'_, Self, G, C>,
    ) -> Option<[[[f32; GROUP]; C]; G]> {
        simd_kernel!(crate::simd::q6k_products::<G, C>(path, t), path, t)
    }
}
