//! The native kernels in AVX2 + FMA (safe, through `safe_arch`): the
//! arithmetic of `blocks.rs` with the integer lanes computed by
//! `vpmaddubsw` (unsigned quants × signed activations, pairs to i16) and
//! `vpmaddwd` (by the sub-block scale, pairs to i32). One weight block is
//! unpacked once for `C` activation rows.

use safe_arch::{
    abs_i8_m256i, add_i32_m256i, bitand_m256i, bitor_m256i, blend_imm_i32_m256i,
    cmp_eq_mask_i8_m256i, convert_to_i16_m256i_from_i8_m128i, convert_to_m256_from_i32_m256i,
    convert_to_u16_m128i_from_lower8_u8_m128i, fused_mul_add_m256, load_unaligned_m256i, m128i,
    m256, m256i, mul_i16_horizontal_add_m128i, mul_i16_horizontal_add_m256i,
    mul_u8i8_add_horizontal_saturating_m256i, set_m128i_m256i, set_splat_i16_m256i,
    set_splat_i32_m256i, set_splat_i8_m256i, set_splat_m256, shl_imm_u16_m256i, shr_imm_u16_m256i,
    shuffle_av_i8z_all_m128i, shuffle_av_i8z_half_m256i, sign_apply_i8_m256i, sub_i16_m256i,
    zeroed_m128i, zeroed_m256, zeroed_m256i,
};

use super::act::Acts;
use super::blocks::{f16_at, hsum8, k4_scales, BlockType};

#[inline(always)]
fn load32(b: &[u8]) -> m256i {
    m256i::from(<[u8; 32]>::try_from(&b[..32]).expect("32 bytes"))
}

#[inline(always)]
fn load_x(x: &[i8]) -> m256i {
    load_unaligned_m256i(<&[i8; 32]>::try_from(&x[..32]).expect("32 quants"))
}

/// 16 bytes of nibbles as 32 quants: low nibbles, then high nibbles.
#[inline(always)]
fn nibbles16(b: &[u8]) -> m256i {
    let v = m128i::from(<[u8; 16]>::try_from(&b[..16]).expect("16 bytes"));
    let v = set_m128i_m256i(v, v);
    let low = set_splat_i8_m256i(0x0F);
    blend_imm_i32_m256i::<0xF0>(
        bitand_m256i(v, low),
        bitand_m256i(shr_imm_u16_m256i::<4>(v), low),
    )
}

/// Bit `e` of `qh` as `0x10` in byte `e`.
#[inline(always)]
fn high_bits(qh: u32) -> m256i {
    let spread = m256i::from([
        0u8, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    ]);
    let bit = m256i::from([
        1u8, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1,
        2, 4, 8, 16, 32, 64, 128,
    ]);
    let bytes = shuffle_av_i8z_half_m256i(set_splat_i32_m256i(qh as i32), spread);
    let set = cmp_eq_mask_i8_m256i(bitand_m256i(bytes, bit), bit);
    bitand_m256i(set, set_splat_i8_m256i(0x10))
}

/// Bit `k` of each byte of `h` as `0x10`.
#[inline(always)]
fn bit_as_16(h: m256i, k: u32) -> m256i {
    let b = set_splat_i8_m256i((1u8 << k) as i8);
    let set = cmp_eq_mask_i8_m256i(bitand_m256i(h, b), b);
    bitand_m256i(set, set_splat_i8_m256i(0x10))
}

/// Ask for `bytes` in cache ahead of use (one prefetch per cache line).
#[inline(always)]
pub fn prefetch(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        safe_arch::prefetch_t0(&line[0]);
    }
}

/// Weight row `w` against activation rows `rows` (see `blocks::dot_row`).
pub fn dot_rows<const C: usize>(t: BlockType, w: &[u8], acts: &Acts, rows: [usize; C]) -> [f32; C] {
    // One copy of each kernel per type, so that nothing in a block's
    // loop asks which type it is.
    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q5_0: u8 = 2;
    const Q5_1: u8 = 3;
    const Q8_0: u8 = 4;
    const Q4K: u8 = 5;
    const Q5K: u8 = 6;
    const Q6K: u8 = 7;
    match t {
        BlockType::Q4_0 => legacy::<C, Q4_0>(w, acts, rows),
        BlockType::Q4_1 => legacy::<C, Q4_1>(w, acts, rows),
        BlockType::Q5_0 => legacy::<C, Q5_0>(w, acts, rows),
        BlockType::Q5_1 => legacy::<C, Q5_1>(w, acts, rows),
        BlockType::Q8_0 => legacy::<C, Q8_0>(w, acts, rows),
        BlockType::Q4K => k_quant::<C, Q4K>(w, acts, rows),
        BlockType::Q5K => k_quant::<C, Q5K>(w, acts, rows),
        BlockType::Q6K => k_quant::<C, Q6K>(w, acts, rows),
    }
}

/// The block type a kernel's `T` stands for (see `dot_rows`).
#[inline(always)]
const fn type_of(t: u8) -> BlockType {
    match t {
        0 => BlockType::Q4_0,
        1 => BlockType::Q4_1,
        2 => BlockType::Q5_0,
        3 => BlockType::Q5_1,
        4 => BlockType::Q8_0,
        5 => BlockType::Q4K,
        6 => BlockType::Q5K,
        _ => BlockType::Q6K,
    }
}

fn legacy<const C: usize, const T: u8>(w: &[u8], acts: &Acts, rows: [usize; C]) -> [f32; C] {
    let t = type_of(T);
    let cols = acts.cols;
    let nb = cols / 32;
    let xs: [&[i8]; C] = rows.map(|r| &acts.qs[r * cols..][..cols]);
    let ones = set_splat_i16_m256i(1);
    let offset = set_splat_i8_m256i(match t {
        BlockType::Q4_0 => 8,
        _ => 16,
    });
    let has_offset = matches!(t, BlockType::Q4_0 | BlockType::Q5_0);
    let has_min = matches!(t, BlockType::Q4_1 | BlockType::Q5_1);
    let mut acc = [zeroed_m256(); C];
    let mut accm = [0f32; C];
    for (b, blk) in w.chunks_exact(t.bytes()).enumerate() {
        let d = f16_at(blk, 0);
        let (q, m) = match t {
            BlockType::Q4_0 => (nibbles16(&blk[2..]), 0.0),
            BlockType::Q4_1 => (nibbles16(&blk[4..]), f16_at(blk, 2)),
            BlockType::Q5_0 => {
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                (bitor_m256i(nibbles16(&blk[6..]), high_bits(qh)), 0.0)
            }
            BlockType::Q5_1 => {
                let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
                (
                    bitor_m256i(nibbles16(&blk[8..]), high_bits(qh)),
                    f16_at(blk, 2),
                )
            }
            _ => (load32(&blk[2..]), 0.0),
        };
        for c in 0..C {
            let xv = load_x(&xs[c][b * 32..]);
            let mut p = if t == BlockType::Q8_0 {
                mul_u8i8_add_horizontal_saturating_m256i(
                    abs_i8_m256i(xv),
                    sign_apply_i8_m256i(q, xv),
                )
            } else {
                mul_u8i8_add_horizontal_saturating_m256i(q, xv)
            };
            if has_offset {
                p = sub_i16_m256i(p, mul_u8i8_add_horizontal_saturating_m256i(offset, xv));
            }
            let s = mul_i16_horizontal_add_m256i(p, ones);
            let i = rows[c] * nb + b;
            acc[c] = fused_mul_add_m256(
                convert_to_m256_from_i32_m256i(s),
                set_splat_m256(d * acts.d[i]),
                acc[c],
            );
            if has_min {
                accm[c] = m.mul_add(acts.s[i], accm[c]);
            }
        }
    }
    std::array::from_fn(|c| hsum8(<[f32; 8]>::from(acc[c])) + accm[c])
}

/// `vpshufb` indices that broadcast i16 lane `j` of each 128-bit half.
const fn k4_shuffle(j: usize) -> [u8; 32] {
    let mut a = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        a[i] = (2 * j + i % 2) as u8;
        i += 1;
    }
    a
}

/// `vpshufb` indices: byte `2j` eight times, then byte `2j + 1` eight times.
const fn q6_shuffle(j: usize) -> [u8; 16] {
    let mut a = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        a[i] = (2 * j + i / 8) as u8;
        i += 1;
    }
    a
}

const K4_SHUFFLE: [[u8; 32]; 8] = [
    k4_shuffle(0),
    k4_shuffle(1),
    k4_shuffle(2),
    k4_shuffle(3),
    k4_shuffle(4),
    k4_shuffle(5),
    k4_shuffle(6),
    k4_shuffle(7),
];
const Q6_SHUFFLE: [[u8; 16]; 8] = [
    q6_shuffle(0),
    q6_shuffle(1),
    q6_shuffle(2),
    q6_shuffle(3),
    q6_shuffle(4),
    q6_shuffle(5),
    q6_shuffle(6),
    q6_shuffle(7),
];

/// Chunk `j` (elements `32j..32j+32`) of a Q6_K block as unsigned 6-bit
/// quants.
#[inline(always)]
fn q6_chunk(blk: &[u8], j: usize) -> m256i {
    let (h, k) = (j / 4, j % 4);
    let low = set_splat_i8_m256i(0x0F);
    let b30 = set_splat_i8_m256i(0x30);
    let l = load32(&blk[64 * h + 32 * (k % 2)..]);
    let hb = load32(&blk[128 + 32 * h..]);
    match k {
        0 => bitor_m256i(
            bitand_m256i(l, low),
            shl_imm_u16_m256i::<4>(bitand_m256i(hb, set_splat_i8_m256i(3))),
        ),
        1 => bitor_m256i(
            bitand_m256i(l, low),
            bitand_m256i(shl_imm_u16_m256i::<2>(hb), b30),
        ),
        2 => bitor_m256i(
            bitand_m256i(shr_imm_u16_m256i::<4>(l), low),
            bitand_m256i(hb, b30),
        ),
        _ => bitor_m256i(
            bitand_m256i(shr_imm_u16_m256i::<4>(l), low),
            bitand_m256i(shr_imm_u16_m256i::<2>(hb), b30),
        ),
    }
}

/// Chunk `j` of a Q4_K (`qh` None) or Q5_K block as unsigned quants.
#[inline(always)]
fn k4_chunk(qs: &[u8], qh: Option<m256i>, j: usize) -> m256i {
    let low = set_splat_i8_m256i(0x0F);
    let v = load32(&qs[32 * (j / 2)..]);
    let q = if j.is_multiple_of(2) {
        bitand_m256i(v, low)
    } else {
        bitand_m256i(shr_imm_u16_m256i::<4>(v), low)
    };
    match qh {
        Some(h) => bitor_m256i(q, bit_as_16(h, j as u32)),
        None => q,
    }
}

/// The K-quants, chunk by chunk: each 32-element chunk is unpacked once
/// and multiplied into all `C` rows' integer sums (which stay in
/// registers), then each row's sums meet the block's float scales.
fn k_quant<const C: usize, const T: u8>(w: &[u8], acts: &Acts, rows: [usize; C]) -> [f32; C] {
    let t = type_of(T);
    let cols = acts.cols;
    let nb = cols / 256;
    let xs: [&[i8]; C] = rows.map(|r| &acts.qs[r * cols..][..cols]);
    let m32 = set_splat_i8_m256i(32);
    let mut acc: [m256; C] = [zeroed_m256(); C];
    let mut accm = [0f32; C];
    for (b, blk) in w.chunks_exact(t.bytes()).enumerate() {
        let mut sums = [zeroed_m256i(); C];
        let q6 = t == BlockType::Q6K;
        let (d, dmin, mins) = if q6 {
            let sc = m128i::from(<[u8; 16]>::try_from(&blk[192..208]).expect("16 scales"));
            for j in 0..8 {
                let q = q6_chunk(blk, j);
                let s = convert_to_i16_m256i_from_i8_m128i(shuffle_av_i8z_all_m128i(
                    sc,
                    m128i::from(Q6_SHUFFLE[j]),
                ));
                for c in 0..C {
                    let xv = load_x(&xs[c][b * 256 + 32 * j..]);
                    let p = sub_i16_m256i(
                        mul_u8i8_add_horizontal_saturating_m256i(q, xv),
                        mul_u8i8_add_horizontal_saturating_m256i(m32, xv),
                    );
                    sums[c] = add_i32_m256i(sums[c], mul_i16_horizontal_add_m256i(p, s));
                }
            }
            (f16_at(blk, 208), 0.0, zeroed_m128i())
        } else {
            let (sc, mn) = k4_scales(&blk[4..16]);
            let sc = convert_to_u16_m128i_from_lower8_u8_m128i(m128i::from([sc, 0]));
            let sc = set_m128i_m256i(sc, sc);
            let (qh, qs) = if t == BlockType::Q4K {
                (None, &blk[16..144])
            } else {
                (Some(load32(&blk[16..48])), &blk[48..176])
            };
            for j in 0..8 {
                let q = k4_chunk(qs, qh, j);
                let s = shuffle_av_i8z_half_m256i(sc, m256i::from(K4_SHUFFLE[j]));
                for c in 0..C {
                    let xv = load_x(&xs[c][b * 256 + 32 * j..]);
                    let p = mul_u8i8_add_horizontal_saturating_m256i(q, xv);
                    sums[c] = add_i32_m256i(sums[c], mul_i16_horizontal_add_m256i(p, s));
                }
            }
            let mins = convert_to_u16_m128i_from_lower8_u8_m128i(m128i::from([mn, 0]));
            (f16_at(blk, 0), f16_at(blk, 2), mins)
        };
        for c in 0..C {
            let i = rows[c] * nb + b;
            let dx = acts.d[i];
            acc[c] = fused_mul_add_m256(
                convert_to_m256_from_i32_m256i(sums[c]),
                set_splat_m256(d * dx),
                acc[c],
            );
            if !q6 {
                let bs = <[i16; 8]>::try_from(&acts.bsums[i * 8..][..8]).expect("8 sums");
                let m = <[i32; 4]>::from(mul_i16_horizontal_add_m128i(mins, m128i::from(bs)));
                let msum = m[0] + m[1] + m[2] + m[3];
                accm[c] = (msum as f32).mul_add(-(dmin * dx), accm[c]);
            }
        }
    }
    std::array::from_fn(|c| hsum8(<[f32; 8]>::from(acc[c])) + accm[c])
}
