//! Q4_K repacked (`kquant`): 4-bit quants in 6-bit-scaled sub-blocks of
//! 32 with 6-bit minimums, 256 per block.
//!
//! Layout: per group of [`GROUP`] = 8 rows and 256-element block, the
//! block's 128 bytes of nibbles of each row are interleaved into
//! [`VECS`](crate::k_tile::VECS) = 32 vectors of 32 bytes: vector `8p + w` holds, in bytes
//! `4r..4r + 4`, bytes `32p + 4w..32p + 4w + 4` of row `r`'s nibbles. Their
//! low nibbles are 4 quants of sub-block `2p`, their high nibbles 4 quants
//! of sub-block `2p + 1`, so one dot instruction against the broadcast 4
//! activation quants adds, in lane `r`, 4 products of row `r` (as
//! `q8_matmul` does for Q8_0). Before them, [`Meta`](crate::k_tile::Meta)
//! holds each row's `d` and `dmin` (the file's f16 bits) and its 6-bit
//! scales and minimums, unpacked once at load to a byte each (one
//! sequential stream, [`Q4kBlock`]). 1184 bytes per 8 rows and 256
//! columns: 4.625 bits a weight, against 4.5 in the file and 8.5 as Q8_0.
//!
//! Arithmetic of one output element (weight row `w`, activation row `x`
//! quantized to Q8_K as llama.cpp does, `native::act`), the same for every
//! path and batch size, so each element depends only on its two rows:
//! - per block, the exact integers `S = Σ_j sc_j · Σ_{e∈j} q_e·x_e` and
//!   `M = Σ_j m_j · bsum_j` (`bsum_j`: the sum of sub-block `j`'s
//!   activation quants; `|S| < 2^25`, `|M| < 2^23`: no lane overflows);
//! - `acc = fma(f32(S), d·d_x, acc)`, then `acc = fma(f32(M), dmin·(-d_x),
//!   acc)`, in block order, from `acc = 0`.
//!
//! The VNNI kernels (`simd/kquant.rs`): `vpdpbusd` takes the unsigned
//! nibbles as they are, `vpmulld` the scales, `vpmaddwd` the minimums.

use crate::k_tile::{Format, Q4k, Q4kBlock, Tile, GROUP};
use crate::native::blocks::k4_scales;
use crate::simd::Q8Path;

impl Format for Q4k {
    type B = Q4kBlock;
    const DTYPE: candle_core::quantized::GgmlDType = candle_core::quantized::GgmlDType::Q4K;
    const BLOCK_BYTES: usize = 144;
    const SUMS16: bool = false;

    fn pack(blk: &[u8], r: usize, b: &mut Q4kBlock) {
        let Q4kBlock { q: w, m } = b;
        m.d[r] = u16::from_le_bytes([blk[0], blk[1]]);
        m.dmin[r] = u16::from_le_bytes([blk[2], blk[3]]);
        let (sc, mins) = k4_scales(&blk[4..16]);
        for (j, (s, mn)) in sc
            .to_le_bytes()
            .into_iter()
            .zip(mins.to_le_bytes())
            .enumerate()
        {
            m.sc[j][r] = s;
            m.m[j / 2][2 * r + j % 2] = mn;
        }
        let nib = &blk[16..];
        for (v, dst) in w.iter_mut().enumerate() {
            let (p, wd) = (v / 8, v % 8);
            dst[4 * r..4 * r + 4].copy_from_slice(&nib[32 * p + 4 * wd..32 * p + 4 * wd + 4]);
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
                    let bs = &t.bs[k][b * 4..][..4];
                    let dx = t.xd[k][b];
                    for r in 0..GROUP {
                        let mut s = 0i32;
                        for j in 0..8 {
                            let (p, hi) = (j / 2, j % 2);
                            let mut dot = 0i32;
                            for wd in 0..8 {
                                let xs = x[16 * p + 8 * hi + wd].to_le_bytes();
                                for e in 0..4 {
                                    let byte = w[8 * p + wd][4 * r + e];
                                    let q = if hi == 0 { byte & 0xF } else { byte >> 4 };
                                    dot += i32::from(q) * i32::from(xs[e] as i8);
                                }
                            }
                            s += i32::from(m.sc[j][r]) * dot;
                        }
                        let mut msum = 0i32;
                        for (p, &pair) in bs.iter().enumerate() {
                            let [b0, b1, b2, b3] = pair.to_le_bytes();
                            msum += i32::from(m.m[p][2 * r])
                                * i32::from(i16::from_le_bytes([b0, b1]))
                                + i32::from(m.m[p][2 * r + 1])
                                    * i32::from(i16::from_le_bytes([b2, b3]));
                        }
                        let dw = half::f16::from_bits(m.d[r]).to_f32();
                        let dm = half::f16::from_bits(m.dmin[r]).to_f32();
                        let a = &mut acc[g][k][r];
                        *a = (s as f32).mul_add(dw * dx, *a);
                        *a = (msum as f32).mul_add(dm * -dx, *a);
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
        simd_kernel!(crate::simd::q4k_products::<G, C>(path, t), path, t)
    }
}
