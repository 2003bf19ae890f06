//! Q4_K × Q8_K matrix product over the file's own 4-bit quants, repacked
//! in row groups of 8 (issue 31: compute from the weights as the file
//! holds them, at about half the bytes per token of the Q8_0 copy).
//!
//! Layout: per group of [`GROUP`] = 8 rows and 256-element block, the
//! block's 128 bytes of nibbles of each row are interleaved into
//! [`VECS`] = 32 vectors of 32 bytes: vector `8p + w` holds, in bytes
//! `4r..4r + 4`, bytes `32p + 4w..32p + 4w + 4` of row `r`'s nibbles. Their
//! low nibbles are 4 quants of sub-block `2p`, their high nibbles 4 quants
//! of sub-block `2p + 1`, so one dot instruction against the broadcast 4
//! activation quants adds, in lane `r`, 4 products of row `r` (as
//! `q8_matmul` does for Q8_0). Beside them, [`Meta`] holds each row's `d`
//! and `dmin` (the file's f16 bits) and its 6-bit scales and minimums,
//! unpacked once at load. 1248 bytes per 8 rows and 256 columns: 4.9 bits
//! a weight, against 4.5 in the file and 8.5 as Q8_0.
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
//! Paths: AVX-512 VNNI and AVX-VNNI (`simd/q4k.rs`, chosen at run time:
//! `vpdpbusd` takes the unsigned nibbles as they are, `vpmulld` the
//! scales) and a portable one in Rust; every path gives the same bits
//! (`every_path_gives_the_same_bits`). Without VNNI, loads keep Q4_K as
//! Q8_0 ([`Q4kMatrix::supported`]).

use rayon::prelude::*;

use crate::native::act::q8k_block;
use crate::native::blocks::k4_scales;
use crate::simd::Q8Path;
use crate::weight_cache::Slab;

/// Weight rows per group (one 32-bit lane each in a 256-bit vector).
pub(crate) const GROUP: usize = 8;
/// Elements per Q4_K block.
pub const QK_K: usize = 256;
/// Bytes of one Q4_K block in the file.
const BLOCK_BYTES: usize = 144;
/// Vectors per group and block: 4 pairs of sub-blocks × 8 words.
pub(crate) const VECS: usize = 32;

/// One group-block's nibbles, interleaved.
pub(crate) type Nibbles = [[u8; 32]; VECS];

/// One group-block's scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub(crate) struct Meta {
    /// Each row's `d`, f16 bits.
    pub d: [u16; GROUP],
    /// Each row's `dmin`, f16 bits.
    pub dmin: [u16; GROUP],
    /// `[sub-block][row]`: the 6-bit scales.
    pub sc: [[u8; GROUP]; 8],
    /// `[pair][2·row + k]`: the 6-bit minimum of sub-block `2·pair + k`,
    /// as i16 (pairs against the activation's pair of sums: `vpmaddwd`).
    pub m: [[i16; 2 * GROUP]; 4],
}

/// Q4_K weights `[out, in]` in groups of 8 rows (the last padded with zero
/// rows, whose scales are zero).
pub struct Q4kMatrix {
    out_dim: usize,
    in_dim: usize,
    blocks: usize,
    /// `[group][block]`.
    qs: Slab<Nibbles>,
    /// `[group][block]`.
    meta: Slab<Meta>,
}

/// Activation rows quantized to Q8_K, laid out for the kernels.
pub(crate) struct Q8kRows {
    /// Quants as words of 4 (`i8` bytes, little endian), `[n][in / 4]`.
    pub x: Vec<i32>,
    /// Sums of each sub-block's quants in pairs (two i16 in one word),
    /// `[n][blocks][4]`.
    pub bs: Vec<i32>,
    /// Scales, `[n][blocks]`.
    pub d: Vec<f32>,
}

/// What a register tile reads: `G` groups and `C` activation rows.
#[derive(Clone, Copy)]
pub(crate) struct Tile<'a, const G: usize, const C: usize> {
    /// Nibbles, `[block]` per group.
    pub w: [&'a [Nibbles]; G],
    /// Scales, `[block]` per group.
    pub meta: [&'a [Meta]; G],
    /// Activation words, `[block · 64]` per row.
    pub x: [&'a [i32]; C],
    /// Activation pair sums, `[block · 4]` per row.
    pub bs: [&'a [i32]; C],
    /// Activation scales, `[block]` per row.
    pub xd: [&'a [f32]; C],
    /// Blocks per row.
    pub blocks: usize,
}

impl Q4kMatrix {
    /// Whether this CPU runs the fast kernels (the load keeps Q4_K as
    /// Q8_0 where it does not: the portable path is for tests).
    pub fn supported() -> bool {
        Q8Path::chosen() != Q8Path::Baseline
    }

    /// Elements of each of the nibbles and scales a `rows` × `cols`
    /// matrix stores (`None` when `cols` is not whole blocks).
    pub(crate) fn stored_len(rows: usize, cols: usize) -> Option<usize> {
        cols.is_multiple_of(QK_K)
            .then(|| rows.div_ceil(GROUP).checked_mul(cols / QK_K))
            .flatten()
    }

    /// A matrix over stored nibbles and scales, if their lengths fit.
    pub(crate) fn from_slabs(
        rows: usize,
        cols: usize,
        qs: Slab<Nibbles>,
        meta: Slab<Meta>,
    ) -> Option<Self> {
        let n = Self::stored_len(rows, cols)?;
        (qs.as_slice().len() == n && meta.as_slice().len() == n).then_some(Self {
            out_dim: rows,
            in_dim: cols,
            blocks: cols / QK_K,
            qs,
            meta,
        })
    }

    /// The stored nibbles and scales, as bytes (for the weight cache).
    pub(crate) fn stored_bytes(&self) -> (&[u8], &[u8]) {
        (
            bytemuck::cast_slice(self.qs.as_slice()),
            bytemuck::cast_slice(self.meta.as_slice()),
        )
    }

    /// Bytes this matrix holds.
    pub fn bytes(&self) -> usize {
        let (a, b) = self.stored_bytes();
        a.len() + b.len()
    }

    /// Of [`Self::bytes`], those mapped from a weight cache file.
    pub fn mapped_bytes(&self) -> usize {
        if self.qs.is_mapped() && self.meta.is_mapped() {
            self.bytes()
        } else {
            0
        }
    }

    /// Repack GGUF Q4_K data (`out · in / 256` blocks of 144 bytes,
    /// row-major) of a `[out, in]` matrix.
    pub fn from_ggml_q4k(data: &[u8], out_dim: usize, in_dim: usize) -> Result<Self, String> {
        if !in_dim.is_multiple_of(QK_K) {
            return Err(format!(
                "Q4_K rows of {in_dim} are not whole blocks of {QK_K}"
            ));
        }
        let blocks = in_dim / QK_K;
        let expected = out_dim * blocks * BLOCK_BYTES;
        if data.len() != expected {
            return Err(format!(
                "Q4_K data of {} bytes, expected {expected}",
                data.len()
            ));
        }
        let groups = out_dim.div_ceil(GROUP);
        let mut qs = vec![[[0u8; 32]; VECS]; groups * blocks];
        let mut meta = vec![Meta::default(); groups * blocks];
        // Groups are independent: repack them on the pool.
        let rows_per_group = blocks * BLOCK_BYTES * GROUP;
        qs.par_chunks_mut(blocks)
            .zip(meta.par_chunks_mut(blocks))
            .zip(data.par_chunks(rows_per_group))
            .for_each(|((qs, meta), src)| {
                for (r, row) in src.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
                    for (b, blk) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                        let m = &mut meta[b];
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
                            m.m[j / 2][2 * r + j % 2] = i16::from(mn);
                        }
                        let nib = &blk[16..];
                        for (v, dst) in qs[b].iter_mut().enumerate() {
                            let (p, w) = (v / 8, v % 8);
                            dst[4 * r..4 * r + 4]
                                .copy_from_slice(&nib[32 * p + 4 * w..32 * p + 4 * w + 4]);
                        }
                    }
                }
            });
        Ok(Self {
            out_dim,
            in_dim,
            blocks,
            qs: Slab::Owned(qs),
            meta: Slab::Owned(meta),
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

    /// [`Q4kMatrix::forward`] on a given path (`Baseline`: the portable
    /// kernel). Every path gives the same bits.
    pub fn forward_with(&self, x: &[f32], n: usize, path: Q8Path) -> Vec<f32> {
        assert_eq!(x.len(), n * self.in_dim, "activation shape");
        if n == 0 || self.out_dim == 0 {
            return vec![0.0; n * self.out_dim];
        }
        let acts = quantize_rows(x, n, self.in_dim);
        let groups = self.out_dim.div_ceil(GROUP);
        let mut yg = vec![0f32; groups * n * GROUP];
        let threads = rayon::current_num_threads().max(1);
        let per_chunk = groups.div_ceil(threads * 4).max(1);
        yg.par_chunks_mut(per_chunk * n * GROUP)
            .enumerate()
            .for_each(|(chunk, out)| self.groups(&acts, n, chunk * per_chunk, out, path));
        let mut y = vec![0f32; n * self.out_dim];
        for (g, col) in yg.chunks_exact(n * GROUP).enumerate() {
            let rows = (self.out_dim - g * GROUP).min(GROUP);
            for (dst, src) in y
                .chunks_exact_mut(self.out_dim)
                .zip(col.chunks_exact(GROUP))
            {
                dst[g * GROUP..][..rows].copy_from_slice(&src[..rows]);
            }
        }
        y
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
        let (qs, meta) = (self.qs.as_slice(), self.meta.as_slice());
        let t = Tile {
            w: std::array::from_fn(|k| &qs[(g0 + i + k) * blocks..][..blocks]),
            meta: std::array::from_fn(|k| &meta[(g0 + i + k) * blocks..][..blocks]),
            x: std::array::from_fn(|k| &acts.x[(c + k) * blocks * 64..][..blocks * 64]),
            bs: std::array::from_fn(|k| &acts.bs[(c + k) * blocks * 4..][..blocks * 4]),
            xd: std::array::from_fn(|k| &acts.d[(c + k) * blocks..][..blocks]),
            blocks,
        };
        let res = faster::<G, C>(path, &t).unwrap_or_else(|| kernel::<G, C>(&t));
        for (gg, res) in res.iter().enumerate() {
            for (k, v) in res.iter().enumerate() {
                out[((i + gg) * n + c + k) * GROUP..][..GROUP].copy_from_slice(v);
            }
        }
    }
}

/// Groups and activation rows per register tile: on AVX-512 (32 vector
/// registers), 4 groups for one row (independent sums to hide the dot
/// instruction's latency) and 2 × 4 for many (each weight vector unpacked
/// once for 4 rows; `q4k_timing`: 2 × 4 fastest of 1-2 × 1-8); elsewhere
/// (16 registers) 1 × 2.
fn tile_shape(path: Q8Path, n: usize) -> (usize, usize) {
    match (path, n) {
        (Q8Path::Avx512Vnni, 1) => (4, 1),
        (Q8Path::Avx512Vnni, 2) => (2, 2),
        (Q8Path::Avx512Vnni, _) => (2, 4),
        _ => (1, 2),
    }
}

/// A run-time chosen SIMD kernel's results (`None`: run the portable one).
#[inline(always)]
fn faster<const G: usize, const C: usize>(
    path: Q8Path,
    t: &Tile<'_, G, C>,
) -> Option<[[[f32; GROUP]; C]; G]> {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    return crate::simd::q4k_products::<G, C>(path, t);
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let _ = (path, t);
        None
    }
}

/// The portable kernel: the arithmetic of the module's doc, element by
/// element.
#[allow(clippy::needless_range_loop)] // indices as the doc writes them
fn kernel<const G: usize, const C: usize>(t: &Tile<'_, G, C>) -> [[[f32; GROUP]; C]; G] {
    let mut acc = [[[0f32; GROUP]; C]; G];
    for b in 0..t.blocks {
        for g in 0..G {
            let (w, m) = (&t.w[g][b], &t.meta[g][b]);
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
                        msum += i32::from(m.m[p][2 * r]) * i32::from(i16::from_le_bytes([b0, b1]))
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

/// Quantize `n` rows of `in_dim` (a multiple of 256) to Q8_K (as
/// `native::act` does, llama.cpp's `quantize_row_q8_K_ref`), rows in
/// parallel when there are many (each row on its own: the same quants).
pub(crate) fn quantize_rows(x: &[f32], n: usize, in_dim: usize) -> Q8kRows {
    let blocks = in_dim / QK_K;
    let mut out = Q8kRows {
        x: vec![0; n * in_dim / 4],
        bs: vec![0; n * blocks * 4],
        d: vec![0.0; n * blocks],
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
    out
}

#[cfg(test)]
mod tests;
