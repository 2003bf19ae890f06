//! The one module of handoff-model that may use `unsafe` (issue 13 item 6):
//! block-product kernels compiled for CPU features beyond the build's
//! baseline (x86-64-v3: AVX2 + FMA) and chosen at run time when the CPU has
//! them. Everything else in the crate is `deny(unsafe_code)`, and a test
//! (`only_simd_may_use_unsafe`) checks that no other file allows it.
//!
//! Each kernel here computes exactly what the safe baseline in
//! `q8_matmul.rs` computes, bit for bit: the same 8 i32 lanes per block
//! (lane `j` = the sum of the products of elements `4j..4j+3`), converted to
//! f32 and accumulated with one fused multiply-add by the block's scale
//! product. `q8_matmul::tests::every_path_gives_the_same_bits` runs every
//! path this CPU has on the same inputs and requires identical output.
//!
//! The VNNI kernels replace the baseline's `vpmaddubsw` + `vpmaddwd` (pairs
//! to i16, saturating, then pairs of those to i32) by one `vpdpbusd` (groups
//! of 4 to i32, not saturating). The two agree whenever the baseline does
//! not saturate, that is whenever no weight quant is -128, which Q8_0 made
//! by quantization never holds (`|round(x·127/amax)| ≤ 127`; see
//! `q8_matmul.rs`).

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
pub(crate) use vnni::block_products;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod vnni {
    use core::arch::x86_64::{
        __m256, __m256i, _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_setzero_si256, _mm256_sign_epi8,
    };
    use safe_arch::m256i;

    use super::Q8Path;

    /// One kernel per instruction set: `TILE` weight rows against `C`
    /// activation rows over `blocks` blocks; the 8 f32 lanes of each
    /// output. Every slice holds at least `blocks` elements (indexing is
    /// checked).
    macro_rules! kernel {
        ($name:ident, $features:literal, $dot:path) => {
            #[target_feature(enable = $features)]
            fn $name<const C: usize, const TILE: usize>(
                w: &[[m256i; TILE]],
                xs: [&[m256i]; C],
                ax: [&[m256i]; C],
                ds: [&[[f32; TILE]]; C],
                blocks: usize,
            ) -> [[[f32; 8]; C]; TILE] {
                let mut acc: [[__m256; C]; TILE] = [[_mm256_setzero_ps(); C]; TILE];
                let w = &w[..blocks];
                for b in 0..blocks {
                    let x: [__m256i; C] = std::array::from_fn(|k| xs[k][b].0);
                    let a: [__m256i; C] = std::array::from_fn(|k| ax[k][b].0);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let wr = w[b][r].0;
                        for k in 0..C {
                            // w·sign(x), then |x|·that in groups of 4 to
                            // i32: lane j sums elements 4j..4j+3 of w·x.
                            let sw = _mm256_sign_epi8(wr, x[k]);
                            let lanes = $dot(_mm256_setzero_si256(), a[k], sw);
                            acc[k] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(lanes),
                                _mm256_set1_ps(ds[k][b][r]),
                                acc[k],
                            );
                        }
                    }
                }
                acc.map(|row| row.map(|v| safe_arch::m256(v).into()))
            }
        };
    }

    kernel!(
        products_avx512_vnni,
        "avx2,fma,avx512f,avx512vl,avx512vnni",
        core::arch::x86_64::_mm256_dpbusd_epi32
    );
    kernel!(
        products_avx_vnni,
        "avx2,fma,avxvnni",
        core::arch::x86_64::_mm256_dpbusd_avx_epi32
    );

    /// The lanes of [`kernel!`] by `path`; `None` for the baseline (the
    /// caller runs its own) or a path this CPU lacks.
    pub(crate) fn block_products<const C: usize, const TILE: usize>(
        path: Q8Path,
        w: &[[m256i; TILE]],
        xs: [&[m256i]; C],
        ax: [&[m256i]; C],
        ds: [&[[f32; TILE]]; C],
        blocks: usize,
    ) -> Option<[[[f32; 8]; C]; TILE]> {
        match path {
            Q8Path::Baseline => None,
            Q8Path::Avx512Vnni => {
                let ok = std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512f");
                // SAFETY: the function is compiled for AVX2, FMA, AVX-512F,
                // AVX-512VL and AVX-512 VNNI, and the CPU was just checked
                // to have all of them (the build's baseline guarantees AVX2
                // and FMA). It reads its arguments through references only.
                ok.then(|| unsafe { products_avx512_vnni::<C, TILE>(w, xs, ax, ds, blocks) })
            }
            Q8Path::AvxVnni => {
                let ok = std::arch::is_x86_feature_detected!("avxvnni");
                // SAFETY: compiled for AVX2, FMA and AVX-VNNI; the CPU was
                // just checked for AVX-VNNI, and the build's baseline
                // guarantees AVX2 and FMA. References only, as above.
                ok.then(|| unsafe { products_avx_vnni::<C, TILE>(w, xs, ax, ds, blocks) })
            }
        }
    }
}
