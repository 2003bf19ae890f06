//! The GGUF block formats the native kernels read as stored, and the
//! portable kernel: the arithmetic every path computes, bit for bit.
//!
//! The arithmetic of one output element (one weight row `w` against one
//! quantized activation row `x`), the same for every path and batch size:
//! - per block (32 elements for Q4_0..Q8_0, 256 for the K-quants), eight
//!   i32 lanes: lane `l` holds, exactly, the products of elements
//!   `4l..4l+3` of each 32-element chunk of the block, each times the
//!   integer sub-block scale of its element for the K-quants (what
//!   `vpmaddubsw` then `vpmaddwd` leave in lane `l` of a 256-bit vector);
//! - each lane is converted to f32 and accumulated with one fused
//!   multiply-add by the f32 product `d_w·d_x` into its own f32 lane;
//! - the types with minimums (Q4_1, Q5_1: `m·s_x`; Q4_K, Q5_K:
//!   `Σ m_j·bsum_j` times `-(dmin·d_x)`) add theirs, one fused multiply-add
//!   per block, into a separate f32 (`bsum_j`: the sum of sub-block `j`'s
//!   activation quants);
//! - at the end the eight lanes are summed in a fixed tree ([`hsum8`]) and
//!   the minimum sum added.
//!
//! Integer sums are exact (no lane can overflow i32 for any stored bytes),
//! so any instruction order that computes them gives these bits; only the
//! float steps, written once here and in `avx2.rs` in the same order,
//! fix the result. Q8_0 weights are multiplied as `vpsignb` does (a stored
//! -128 against a negative activation wraps to -128), which
//! `quantize_row_q8_0` never writes; a file that holds it gets the same
//! bits on every path.

use half::f16;

use super::act::{ActKind, Acts};

/// A GGUF block format with a native kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockType {
    /// 4-bit, scale; 32 per block.
    Q4_0,
    /// 4-bit, scale and minimum; 32 per block.
    Q4_1,
    /// 5-bit, scale; 32 per block.
    Q5_0,
    /// 5-bit, scale and minimum; 32 per block.
    Q5_1,
    /// 8-bit, scale; 32 per block.
    Q8_0,
    /// 4-bit in 8 sub-blocks of 32 with 6-bit scales and minimums; 256.
    Q4K,
    /// 5-bit, as Q4_K; 256 per block.
    Q5K,
    /// 6-bit in 16 sub-blocks of 16 with 8-bit scales; 256 per block.
    Q6K,
}

impl BlockType {
    /// Every type, for tests and messages.
    pub const ALL: [BlockType; 8] = [
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q5_1,
        BlockType::Q8_0,
        BlockType::Q4K,
        BlockType::Q5K,
        BlockType::Q6K,
    ];

    /// The type of a GGUF tensor, if it has a native kernel.
    pub fn of(dtype: candle_core::quantized::GgmlDType) -> Option<BlockType> {
        use candle_core::quantized::GgmlDType as G;
        Some(match dtype {
            G::Q4_0 => BlockType::Q4_0,
            G::Q4_1 => BlockType::Q4_1,
            G::Q5_0 => BlockType::Q5_0,
            G::Q5_1 => BlockType::Q5_1,
            G::Q8_0 => BlockType::Q8_0,
            G::Q4K => BlockType::Q4K,
            G::Q5K => BlockType::Q5K,
            G::Q6K => BlockType::Q6K,
            _ => return None,
        })
    }

    /// Its GGUF type (the inverse of [`Self::of`]).
    pub fn ggml(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType as G;
        match self {
            BlockType::Q4_0 => G::Q4_0,
            BlockType::Q4_1 => G::Q4_1,
            BlockType::Q5_0 => G::Q5_0,
            BlockType::Q5_1 => G::Q5_1,
            BlockType::Q8_0 => G::Q8_0,
            BlockType::Q4K => G::Q4K,
            BlockType::Q5K => G::Q5K,
            BlockType::Q6K => G::Q6K,
        }
    }

    /// Elements per block.
    pub fn elems(self) -> usize {
        match self {
            BlockType::Q4K | BlockType::Q5K | BlockType::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn bytes(self) -> usize {
        match self {
            BlockType::Q4_0 => 18,
            BlockType::Q4_1 => 20,
            BlockType::Q5_0 => 22,
            BlockType::Q5_1 => 24,
            BlockType::Q8_0 => 34,
            BlockType::Q4K => 144,
            BlockType::Q5K => 176,
            BlockType::Q6K => 210,
        }
    }

    /// The activation format it multiplies with (as llama.cpp pairs them).
    pub fn act(self) -> ActKind {
        match self {
            BlockType::Q4_0 | BlockType::Q5_0 | BlockType::Q8_0 => ActKind::Q8_0,
            BlockType::Q4_1 | BlockType::Q5_1 => ActKind::Q8_1,
            BlockType::Q4K | BlockType::Q5K | BlockType::Q6K => ActKind::Q8K,
        }
    }
}

/// An f16 at `b[at..at + 2]`, as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K/Q5_K's 6-bit scales and minimums of the 8 sub-blocks, from the 12
/// packed bytes (llama.cpp's `get_scale_min_k4`, all 8 at once, with its
/// word operations): scale `j` is byte `j` of the first word, minimum `j`
/// byte `j` of the second.
#[inline(always)]
pub(crate) fn k4_scales(s: &[u8]) -> (u64, u64) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (u0, u1, u2) = (w(0), w(4), w(8));
    let scales_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let mins_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    (
        u64::from(u0 & K1) | u64::from(scales_hi) << 32,
        u64::from(u1 & K1) | u64::from(mins_hi) << 32,
    )
}

/// The eight f32 lanes summed in the fixed order of a 256-bit reduction:
/// halves, then pairs, then the last two.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// One block's quants as signed values, with its scales.
pub(crate) struct Unpacked {
    /// Element values (`q - offset` where the type has one).
    pub(crate) q: [i32; 256],
    /// Integer scale of each group of 16 elements (1 for 32-blocks).
    pub(crate) sc: [i32; 16],
    /// Q4_K/Q5_K minimums of the 8 sub-blocks.
    pub(crate) m: [i32; 8],
    pub(crate) d: f32,
    /// The minimum (Q4_1/Q5_1) or `dmin` (Q4_K/Q5_K).
    pub(crate) min: f32,
}

/// One block of type `t` unpacked (the tests' reference for other
/// layouts too).
pub(crate) fn unpack(t: BlockType, b: &[u8]) -> Unpacked {
    let mut u = Unpacked {
        q: [0; 256],
        sc: [1; 16],
        m: [0; 8],
        d: 0.0,
        min: 0.0,
    };
    match t {
        BlockType::Q4_0 | BlockType::Q4_1 => {
            let (qs, off) = if t == BlockType::Q4_0 {
                (&b[2..18], 8)
            } else {
                u.min = f16_at(b, 2);
                (&b[4..20], 0)
            };
            u.d = f16_at(b, 0);
            for (j, v) in qs.iter().enumerate() {
                u.q[j] = i32::from(v & 0xF) - off;
                u.q[j + 16] = i32::from(v >> 4) - off;
            }
        }
        BlockType::Q5_0 | BlockType::Q5_1 => {
            let (h, qs, off) = if t == BlockType::Q5_0 {
                (2, &b[6..22], 16)
            } else {
                u.min = f16_at(b, 2);
                (4, &b[8..24], 0)
            };
            u.d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            for (j, v) in qs.iter().enumerate() {
                let hi0 = ((qh >> j) & 1) << 4;
                let hi1 = ((qh >> (j + 16)) & 1) << 4;
                u.q[j] = (u32::from(v & 0xF) | hi0) as i32 - off;
                u.q[j + 16] = (u32::from(v >> 4) | hi1) as i32 - off;
            }
        }
        BlockType::Q8_0 => {
            u.d = f16_at(b, 0);
            for j in 0..32 {
                u.q[j] = i32::from(b[2 + j] as i8);
            }
        }
        BlockType::Q4K | BlockType::Q5K => {
            u.d = f16_at(b, 0);
            u.min = f16_at(b, 2);
            let (sc, m) = k4_scales(&b[4..16]);
            for (j, (sc, m)) in sc
                .to_le_bytes()
                .into_iter()
                .zip(m.to_le_bytes())
                .enumerate()
            {
                u.sc[2 * j] = i32::from(sc);
                u.sc[2 * j + 1] = i32::from(sc);
                u.m[j] = i32::from(m);
            }
            let (qh, qs) = if t == BlockType::Q4K {
                (None, &b[16..144])
            } else {
                (Some(&b[16..48]), &b[48..176])
            };
            for g in 0..4 {
                for l in 0..32 {
                    let v = qs[32 * g + l];
                    let (h0, h1) = qh.map_or((0, 0), |h| {
                        (
                            ((h[l] >> (2 * g)) & 1) << 4,
                            ((h[l] >> (2 * g + 1)) & 1) << 4,
                        )
                    });
                    u.q[64 * g + l] = i32::from((v & 0xF) | h0);
                    u.q[64 * g + 32 + l] = i32::from((v >> 4) | h1);
                }
            }
        }
        BlockType::Q6K => {
            let (ql, qh) = (&b[0..128], &b[128..192]);
            for (j, s) in b[192..208].iter().enumerate() {
                u.sc[j] = i32::from(*s as i8);
            }
            u.d = f16_at(b, 208);
            for h in 0..2 {
                let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
                for l in 0..32 {
                    let e = 128 * h + l;
                    u.q[e] = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                    u.q[e + 32] = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    u.q[e + 64] = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    u.q[e + 96] = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                }
            }
        }
    }
    u
}

/// One product as the vector paths compute it.
#[inline(always)]
fn product(t: BlockType, w: i32, x: i8) -> i32 {
    if t == BlockType::Q8_0 {
        // `vpsignb` then `vpmaddubsw` by |x|: -128 negated stays -128.
        let w = w as i8;
        let signed = match x.signum() {
            -1 => w.wrapping_neg(),
            0 => 0,
            _ => w,
        };
        i32::from(signed) * i32::from(x.unsigned_abs())
    } else {
        w * i32::from(x)
    }
}

/// The portable kernel: weight row `w` (whole blocks of `t`) against
/// activation row `r` of `acts`.
pub fn dot_row(t: BlockType, w: &[u8], acts: &Acts, r: usize) -> f32 {
    let ne = t.elems();
    let blocks = acts.cols / ne;
    debug_assert_eq!(w.len(), blocks * t.bytes());
    let x = &acts.qs[r * acts.cols..][..acts.cols];
    let per_row = acts.cols / t.act().block();
    let mut acc = [0f32; 8];
    let mut accm = 0f32;
    for (b, blk) in w.chunks_exact(t.bytes()).enumerate() {
        let u = unpack(t, blk);
        let xb = &x[b * ne..][..ne];
        let dx = acts.d[r * per_row + b];
        let mut lanes = [0i32; 8];
        for (e, (&q, &xv)) in u.q[..ne].iter().zip(xb).enumerate() {
            lanes[(e % 32) / 4] += u.sc[e / 16] * product(t, q, xv);
        }
        let ds = u.d * dx;
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = (l as f32).mul_add(ds, *a);
        }
        match t {
            BlockType::Q4_1 | BlockType::Q5_1 => {
                accm = u.min.mul_add(acts.s[r * per_row + b], accm);
            }
            BlockType::Q4K | BlockType::Q5K => {
                let bs = &acts.bsums[(r * per_row + b) * 8..][..8];
                let msum: i32 = (0..8).map(|j| u.m[j] * i32::from(bs[j])).sum();
                accm = (msum as f32).mul_add(-(u.min * dx), accm);
            }
            _ => {}
        }
    }
    hsum8(acc) + accm
}

/// The weight row dequantized to f32 (for tests: the reference that
/// llama.cpp's own dot product is within rounding of).
pub fn dequantize_row(t: BlockType, w: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(w.len() / t.bytes() * t.elems());
    for blk in w.chunks_exact(t.bytes()) {
        let u = unpack(t, blk);
        for e in 0..t.elems() {
            let q = u.q[e] as f32;
            out.push(match t {
                BlockType::Q4_1 | BlockType::Q5_1 => u.d * q + u.min,
                BlockType::Q4K | BlockType::Q5K => {
                    u.d * u.sc[e / 16] as f32 * q - u.min * u.m[e / 32] as f32
                }
                BlockType::Q6K => u.d * u.sc[e / 16] as f32 * q,
                _ => u.d * q,
            });
        }
    }
    out
}
