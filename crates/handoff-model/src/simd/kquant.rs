//! The K-quant kernels of `kquant` with VNNI (the layout and arithmetic
//! are in `kquant/q4k.rs`): per group of 8 rows, a 32-byte vector of
//! interleaved nibbles gives, masked, 4 Q4_K quants of each row for one
//! sub-block and, shifted, 4 of the next; `vpdpbusd` (unsigned quants ×
//! signed activations, groups of 4 to i32, exact) adds them into lane
//! `r` = row `r`; `vpmulld` applies each row's sub-block scale and
//! `vpmaddwd` its minimums against the activation's sub-block sums. The
//! float steps are the format doc's, in its order.

use core::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_cvtepi32_ps, _mm256_cvtepi8_epi32,
    _mm256_cvtepu8_epi16, _mm256_cvtepu8_epi32, _mm256_cvtph_ps, _mm256_fmadd_ps,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_mul_ps, _mm256_mullo_epi32, _mm256_or_si256,
    _mm256_set1_epi32, _mm256_set1_epi8, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256,
    _mm256_slli_epi16, _mm256_srli_epi16, _mm256_sub_epi32, _mm_loadl_epi64, _mm_loadu_si128,
};
use safe_arch::m256;

use super::vnni::runs;
use super::Q8Path;
use crate::k_tile::{Q4k, Q6k, Tile, GROUP};

macro_rules! q4k_kernel {
    ($name:ident, $features:literal, $dot:path) => {
        #[target_feature(enable = $features)]
        fn $name<const G: usize, const C: usize>(
            t: &Tile<'_, Q4k, G, C>,
        ) -> [[[f32; GROUP]; C]; G] {
            let Tile {
                w,
                x,
                bs,
                xd,
                blocks,
                ..
            } = *t;
            for g in 0..G {
                assert!(w[g].len() >= blocks);
            }
            for k in 0..C {
                assert!(
                    x[k].len() >= blocks * 64 && bs[k].len() >= blocks * 4 && xd[k].len() >= blocks
                );
            }
            let low = _mm256_set1_epi8(0x0F);
            let mut acc: [[__m256; C]; G] = [[_mm256_setzero_ps(); C]; G];
            for b in 0..blocks {
                let mut s: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                for p in 0..4 {
                    let mut lo: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    let mut hi: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    let mut lo2: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    let mut hi2: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    for wd in 0..8 {
                        let mut xl = [_mm256_setzero_si256(); C];
                        let mut xh = [_mm256_setzero_si256(); C];
                        for k in 0..C {
                            // SAFETY: `b * 64 + 16 * p + 8 + wd < blocks * 64`,
                            // asserted above.
                            let (l, h) = unsafe {
                                (
                                    *x[k].get_unchecked(b * 64 + 16 * p + wd),
                                    *x[k].get_unchecked(b * 64 + 16 * p + 8 + wd),
                                )
                            };
                            xl[k] = _mm256_set1_epi32(l);
                            xh[k] = _mm256_set1_epi32(h);
                        }
                        for g in 0..G {
                            // SAFETY: `b < blocks <= w[g].len()`, asserted
                            // above; the vector is 32 bytes, an unaligned
                            // load reads exactly them.
                            let v = unsafe {
                                _mm256_loadu_si256(
                                    w[g].get_unchecked(b).q[8 * p + wd].as_ptr().cast(),
                                )
                            };
                            let ql = _mm256_and_si256(v, low);
                            let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                            for k in 0..C {
                                if G * C == 1 && wd % 2 == 1 {
                                    lo2[g][k] = $dot(lo2[g][k], ql, xl[k]);
                                    hi2[g][k] = $dot(hi2[g][k], qh, xh[k]);
                                } else {
                                    lo[g][k] = $dot(lo[g][k], ql, xl[k]);
                                    hi[g][k] = $dot(hi[g][k], qh, xh[k]);
                                }
                            }
                        }
                    }
                    if G * C == 1 {
                        for g in 0..G {
                            for k in 0..C {
                                lo[g][k] = _mm256_add_epi32(lo[g][k], lo2[g][k]);
                                hi[g][k] = _mm256_add_epi32(hi[g][k], hi2[g][k]);
                            }
                        }
                    }
                    for g in 0..G {
                        // SAFETY: as above; each scale row is 8 bytes.
                        let (sl, sh) = unsafe {
                            let m = &w[g].get_unchecked(b).m;
                            (
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64(m.sc[2 * p].as_ptr().cast())),
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                    m.sc[2 * p + 1].as_ptr().cast(),
                                )),
                            )
                        };
                        for k in 0..C {
                            s[g][k] = _mm256_add_epi32(
                                s[g][k],
                                _mm256_add_epi32(
                                    _mm256_mullo_epi32(lo[g][k], sl),
                                    _mm256_mullo_epi32(hi[g][k], sh),
                                ),
                            );
                        }
                    }
                }
                for g in 0..G {
                    // SAFETY: as above; `d`, `dmin` and each pair row of
                    // minimums are 16 bytes each.
                    let m = unsafe { &w[g].get_unchecked(b).m };
                    let (dw, dm, mins) = unsafe {
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(m.d.as_ptr().cast())),
                            _mm256_cvtph_ps(_mm_loadu_si128(m.dmin.as_ptr().cast())),
                            [0, 1, 2, 3].map(|i| {
                                _mm256_cvtepu8_epi16(_mm_loadu_si128(m.m[i].as_ptr().cast()))
                            }),
                        )
                    };
                    for k in 0..C {
                        // SAFETY: `b * 4 + 3 < blocks * 4` and `b < blocks`,
                        // asserted above.
                        let (pairs, dx) = unsafe {
                            (
                                [0, 1, 2, 3].map(|i| *bs[k].get_unchecked(b * 4 + i)),
                                *xd[k].get_unchecked(b),
                            )
                        };
                        let mut msum = _mm256_setzero_si256();
                        for i in 0..4 {
                            msum = _mm256_add_epi32(
                                msum,
                                _mm256_madd_epi16(mins[i], _mm256_set1_epi32(pairs[i])),
                            );
                        }
                        acc[g][k] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s[g][k]),
                            _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
                            acc[g][k],
                        );
                        acc[g][k] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(msum),
                            _mm256_mul_ps(dm, _mm256_set1_ps(-dx)),
                            acc[g][k],
                        );
                    }
                }
            }
            acc.map(|row| row.map(|a| m256(a).into()))
        }
    };
}

q4k_kernel!(
    q4k_avx512_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    core::arch::x86_64::_mm256_dpbusd_epi32
);
q4k_kernel!(
    q4k_avx_vnni,
    "avx2,fma,f16c,avxvnni",
    core::arch::x86_64::_mm256_dpbusd_avx_epi32
);

/// The results of the Q4_K kernel by `path`; `None` for the baseline or a
/// path this CPU lacks.
pub(crate) fn q4k_products<const G: usize, const C: usize>(
    path: Q8Path,
    t: &Tile<'_, Q4k, G, C>,
) -> Option<[[[f32; GROUP]; C]; G]> {
    if !runs(path) {
        return None;
    }
    Some(match path {
        // SAFETY: compiled for AVX2, FMA, F16C, AVX-512F/VL/VNNI; `runs`
        // just checked the CPU for the last four and the build's baseline
        // guarantees AVX2 and FMA. References only.
        Q8Path::Avx512Vnni => unsafe { q4k_avx512_vnni::<G, C>(t) },
        // SAFETY: compiled for AVX2, FMA, F16C and AVX-VNNI; `runs` just
        // checked F16C and AVX-VNNI. References only.
        _ => unsafe { q4k_avx_vnni::<G, C>(t) },
    })
}

/// Quad `k` (0..4) of a Q6_K sub-block as bytes 0..64: the nibbles of
/// vector `n` (low for even `k`, high for odd) or'ed with bit pair `k` of
/// `h` moved to bits 4, 5 (`kquant/q6k.rs`).
macro_rules! q6_quad {
    ($k:expr, $n:expr, $h:expr, $combine:ident) => {{
        let low = _mm256_set1_epi8(0x0F);
        let nib = if $k % 2 == 0 {
            _mm256_and_si256($n, low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>($n), low)
        };
        let high = match $k {
            0 => _mm256_slli_epi16::<4>($h),
            1 => _mm256_slli_epi16::<2>($h),
            2 => $h,
            _ => _mm256_srli_epi16::<2>($h),
        };
        $combine!(nib, high)
    }};
}

/// `nib | (high & 0x30)` in one `vpternlogd` (truth table 0xEC:
/// `(a & c) | b`), for kernels compiled for AVX-512F/VL.
macro_rules! combine_ternlog {
    ($nib:expr, $high:expr) => {
        core::arch::x86_64::_mm256_ternarylogic_epi32::<0xEC>($high, $nib, _mm256_set1_epi8(0x30))
    };
}

/// `nib | (high & 0x30)` in two instructions.
macro_rules! combine_and_or {
    ($nib:expr, $high:expr) => {
        _mm256_or_si256($nib, _mm256_and_si256($high, _mm256_set1_epi8(0x30)))
    };
}

macro_rules! q6k_kernel {
    ($name:ident, $features:literal, $dot:path, $combine:ident) => {
        #[target_feature(enable = $features)]
        fn $name<const G: usize, const C: usize>(
            t: &Tile<'_, Q6k, G, C>,
        ) -> [[[f32; GROUP]; C]; G] {
            let Tile {
                w,
                x,
                bs16,
                xd,
                blocks,
                ..
            } = *t;
            for g in 0..G {
                assert!(w[g].len() >= blocks);
            }
            for k in 0..C {
                assert!(
                    x[k].len() >= blocks * 64
                        && bs16[k].len() >= blocks * 16
                        && xd[k].len() >= blocks
                );
            }
            let mut acc: [[__m256; C]; G] = [[_mm256_setzero_ps(); C]; G];
            for b in 0..blocks {
                let mut s: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                for u in 0..16 {
                    let mut dot: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    let mut dot2: [[__m256i; C]; G] = [[_mm256_setzero_si256(); C]; G];
                    for g in 0..G {
                        // SAFETY: `b < blocks <= w[g].len()`, asserted above;
                        // each vector is 32 bytes, an unaligned load reads
                        // exactly them.
                        let (n0, n1, h) = unsafe {
                            let v = &w[g].get_unchecked(b).q;
                            (
                                _mm256_loadu_si256(v[3 * u].as_ptr().cast()),
                                _mm256_loadu_si256(v[3 * u + 1].as_ptr().cast()),
                                _mm256_loadu_si256(v[3 * u + 2].as_ptr().cast()),
                            )
                        };
                        let q = [
                            q6_quad!(0, n0, h, $combine),
                            q6_quad!(1, n0, h, $combine),
                            q6_quad!(2, n1, h, $combine),
                            q6_quad!(3, n1, h, $combine),
                        ];
                        for k in 0..C {
                            for (quad, q) in q.iter().enumerate() {
                                // SAFETY: `b * 64 + 4 * u + quad < blocks * 64`,
                                // asserted above.
                                let xq = _mm256_set1_epi32(unsafe {
                                    *x[k].get_unchecked(b * 64 + 4 * u + quad)
                                });
                                if G * C == 1 && quad % 2 == 1 {
                                    dot2[g][k] = $dot(dot2[g][k], *q, xq);
                                } else {
                                    dot[g][k] = $dot(dot[g][k], *q, xq);
                                }
                            }
                        }
                    }
                    for g in 0..G {
                        // SAFETY: as above; each scale row is 8 bytes.
                        let sc = unsafe {
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                w[g].get_unchecked(b).m.sc[u].as_ptr().cast(),
                            ))
                        };
                        for k in 0..C {
                            // SAFETY: `b * 16 + u < blocks * 16`, asserted
                            // above.
                            let off =
                                _mm256_set1_epi32(unsafe { *bs16[k].get_unchecked(b * 16 + u) });
                            let sum =
                                _mm256_sub_epi32(_mm256_add_epi32(dot[g][k], dot2[g][k]), off);
                            s[g][k] = _mm256_add_epi32(s[g][k], _mm256_mullo_epi32(sum, sc));
                        }
                    }
                }
                for g in 0..G {
                    // SAFETY: as above; `d` is 16 bytes.
                    let dw = unsafe {
                        _mm256_cvtph_ps(_mm_loadu_si128(w[g].get_unchecked(b).m.d.as_ptr().cast()))
                    };
                    for k in 0..C {
                        // SAFETY: `b < blocks`, asserted above.
                        let dx = unsafe { *xd[k].get_unchecked(b) };
                        acc[g][k] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s[g][k]),
                            _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
                            acc[g][k],
                        );
                    }
                }
            }
            acc.map(|row| row.map(|a| m256(a).into()))
        }
    };
}

q6k_kernel!(
    q6k_avx512_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    core::arch::x86_64::_mm256_dpbusd_epi32,
    combine_ternlog
);
q6k_kernel!(
    q6k_avx_vnni,
    "avx2,fma,f16c,avxvnni",
    core::arch::x86_64::_mm256_dpbusd_avx_epi32,
    combine_and_or
);

/// The results of the Q6_K kernel by `path`; `None` for the baseline or a
/// path this CPU lacks.
pub(crate) fn q6k_products<const G: usize, const C: usize>(
    path: Q8Path,
    t: &Tile<'_, Q6k, G, C>,
) -> Option<[[[f32; GROUP]; C]; G]> {
    if !runs(path) {
        return None;
    }
    Some(match path {
        // SAFETY: as `q4k_products`.
        Q8Path::Avx512Vnni => unsafe { q6k_avx512_vnni::<G, C>(t) },
        // SAFETY: as `q4k_products`.
        _ => unsafe { q6k_avx_vnni::<G, C>(t) },
    })
}
