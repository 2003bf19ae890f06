//! One of the three places in handoff-model that may use `unsafe` (issue 13 item 6):
//! block-product kernels compiled for CPU features beyond the build's
//! baseline (x86-64-v3: AVX2 + FMA) and chosen at run time when the CPU has
//! them. Everything else in the crate but the file mapping (`mapped.rs`) and
//! `malloc_trim` (`heap.rs`) is `deny(unsafe_code)`, and a test
//! (`only_simd_the_mapping_and_heap_may_use_unsafe`) checks that no other
//! file allows it.
//!
//! Each kernel here computes exactly what the safe baseline in
//! `q8_matmul.rs` computes, bit for bit: per output element and block the
//! exact i32 dot product of 32 quant pairs, converted to f32 and
//! accumulated with one fused multiply-add by the block's scale product.
//! `q8_matmul::tests::every_path_gives_the_same_bits` runs every path this
//! CPU has on the same inputs and requires identical output.
//!
//! The VNNI kernels replace the baseline's sign, `vpmaddubsw`, `vpmaddwd`
//! and add (pairs to i16, saturating, then pairs of those to i32) by one
//! `vpdpbusd` (unsigned × signed, groups of 4 added to i32, not
//! saturating) on weights stored offset to unsigned. The two agree whenever
//! the baseline does not saturate, that is whenever no weight quant is
//! -128, which Q8_0 made by quantization never holds
//! (`|round(x·127/amax)| ≤ 127`; see `q8_matmul.rs`).

use std::sync::OnceLock;

/// A block-product kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Path {
    /// The safe baseline of the build (AVX2 + FMA through `safe_arch` on
    /// x86-64-v3; portable Rust elsewhere).
    Baseline,
    /// 256-bit `vpdpbusd` of AVX-VNNI (Alder Lake, Zen 5 and later).
    AvxVnni,
    /// 256-bit `vpdpbusd` of AVX-512 VNNI with AVX-512 VL (Ice Lake,
    /// Sapphire Rapids, Zen 4 and later).
    Avx512Vnni,
}

impl Q8Path {
    /// Its name (`baseline`, `avx_vnni`, `avx512_vnni`).
    pub fn name(self) -> &'static str {
        match self {
            Q8Path::Baseline => "baseline",
            Q8Path::AvxVnni => "avx_vnni",
            Q8Path::Avx512Vnni => "avx512_vnni",
        }
    }

    /// Every path this build and this CPU can run, the baseline first.
    pub fn available() -> Vec<Q8Path> {
        let mut out = vec![Q8Path::Baseline];
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        {
            if std::arch::is_x86_feature_detected!("avxvnni") {
                out.push(Q8Path::AvxVnni);
            }
            if std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                out.push(Q8Path::Avx512Vnni);
            }
        }
        out
    }

    /// The path matmuls use: the last of [`Q8Path::available`], unless the
    /// environment variable `HANDOFF_Q8_KERNEL` names another available one
    /// (`baseline` to measure against). Decided once per process.
    pub fn chosen() -> Q8Path {
        static CHOSEN: OnceLock<Q8Path> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let available = Q8Path::available();
            let best = *available.last().unwrap_or(&Q8Path::Baseline);
            match std::env::var("HANDOFF_Q8_KERNEL") {
                Ok(want) => match available.iter().find(|p| p.name() == want) {
                    Some(p) => *p,
                    None => {
                        let names: Vec<&str> = available.iter().map(|p| p.name()).collect();
                        eprintln!(
                            "HANDOFF_Q8_KERNEL={want:?} names no kernel this CPU runs (it runs {names:?}): using {}",
                            best.name()
                        );
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) use vnni::group_products;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod kquant;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) use kquant::{q4k_products, q6k_products};

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod vnni {
    use core::arch::x86_64::{
        __m256, _mm256_cvtepi32_ps, _mm256_cvtph_ps, _mm256_fmadd_ps, _mm256_mul_ps,
        _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256,
        _mm_loadu_si128,
    };
    use safe_arch::m256;

    use super::Q8Path;
    use crate::q8_tile::{Tile, GROUP, WORDS};

    /// One kernel per instruction set: `G` groups of 8 weight rows against
    /// `C` activation rows over `blocks` blocks; `[G][C][8]` results.
    macro_rules! kernel {
        ($name:ident, $features:literal, $dot:path) => {
            #[target_feature(enable = $features)]
            fn $name<const G: usize, const C: usize>(t: &Tile<'_, G, C>) -> [[[f32; GROUP]; C]; G] {
                let Tile {
                    w,
                    wd,
                    x,
                    corr,
                    xd,
                    blocks,
                    ..
                } = *t;
                // Every index below is `b < blocks` into these slices:
                // checked once here.
                for g in 0..G {
                    assert!(w[g].len() >= blocks && wd[g].len() >= blocks);
                }
                for k in 0..C {
                    assert!(
                        x[k].len() >= blocks && corr[k].len() >= blocks && xd[k].len() >= blocks
                    );
                }
                let mut acc: [[__m256; C]; G] = [[_mm256_setzero_ps(); C]; G];
                for b in 0..blocks {
                    // SAFETY: `b < blocks`, and every slice indexed by `b`
                    // holds at least `blocks` elements (asserted above);
                    // the other indices are into arrays of constant size.
                    // Checked indexing here cost about 50 compare-and-branch
                    // pairs per block, against 8·G·C dot instructions.
                    let (wb, wdb, xb, cb, xdb) = unsafe {
                        (
                            w.map(|s| s.get_unchecked(b)),
                            wd.map(|s| s.get_unchecked(b)),
                            x.map(|s| s.get_unchecked(b)),
                            corr.map(|s| *s.get_unchecked(b)),
                            xd.map(|s| *s.get_unchecked(b)),
                        )
                    };
                    // Weights are stored as q + 128 (unsigned, as the
                    // instruction wants them): starting from -128·Σx makes
                    // the sum the exact dot product.
                    let mut init = [_mm256_setzero_si256(); C];
                    for k in 0..C {
                        init[k] = _mm256_set1_epi32(cb[k]);
                    }
                    let mut dot = [init; G];
                    for j in 0..WORDS {
                        let mut bx = [_mm256_setzero_si256(); C];
                        for k in 0..C {
                            bx[k] = _mm256_set1_epi32(xb[k][j]);
                        }
                        for g in 0..G {
                            let wv = wb[g][j].0;
                            for k in 0..C {
                                // Lane r adds 4 products of row r.
                                dot[g][k] = $dot(dot[g][k], wv, bx[k]);
                            }
                        }
                    }
                    for g in 0..G {
                        // SAFETY: `wdb[g]` is 8 f16 values (16 bytes);
                        // an unaligned load reads exactly them.
                        let dw =
                            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(wdb[g].as_ptr().cast()) });
                        for k in 0..C {
                            acc[g][k] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(dot[g][k]),
                                _mm256_mul_ps(dw, _mm256_set1_ps(xdb[k])),
                                acc[g][k],
                            );
                        }
                    }
                }
                acc.map(|row| row.map(|a| m256(a).into()))
            }
        };
    }

    kernel!(
        products_avx512_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        core::arch::x86_64::_mm256_dpbusd_epi32
    );
    kernel!(
        products_avx_vnni,
        "avx2,fma,f16c,avxvnni",
        core::arch::x86_64::_mm256_dpbusd_avx_epi32
    );

    /// The results of [`kernel!`] by `path`; `None` for the baseline (the
    /// caller runs its own) or a path this CPU lacks.
    pub(crate) fn group_products<const G: usize, const C: usize>(
        path: Q8Path,
        t: &Tile<'_, G, C>,
    ) -> Option<[[[f32; GROUP]; C]; G]> {
        if !runs(path) {
            return None;
        }
        Some(match path {
            // SAFETY: the function is compiled for AVX2, FMA, F16C,
            // AVX-512F, AVX-512VL and AVX-512 VNNI; `runs` just checked the
            // CPU for the last four and the build's baseline guarantees
            // AVX2 and FMA. It reads its arguments through references only.
            Q8Path::Avx512Vnni => unsafe { products_avx512_vnni::<G, C>(t) },
            // SAFETY: compiled for AVX2, FMA, F16C and AVX-VNNI; `runs` just
            // checked F16C and AVX-VNNI. References only, as above.
            _ => unsafe { products_avx_vnni::<G, C>(t) },
        })
    }

    /// Whether `path`'s kernels (these and `kquant.rs`'s) can run on this
    /// CPU (`false` for the baseline: the caller runs its own kernel).
    pub(super) fn runs(path: Q8Path) -> bool {
        match path {
            Q8Path::Baseline => false,
            Q8Path::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512f")
            }
            Q8Path::AvxVnni => {
                std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("avxvnni")
            }
        }
    }
}
