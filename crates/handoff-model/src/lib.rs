//! The model: GGUF loading, a Llama-family
//! forward over a paged KV pool, tokenizer and chat template, sampling.
// `unsafe` is denied everywhere but in `simd` (run-time chosen
// `#[target_feature]` kernels, each call with its SAFETY comment),
// `mapped` (the read-only mapping of the model file) and `heap`
// (`malloc_trim`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

/// `$e`, a `simd` kernel's `Option` of results, where the build targets
/// x86-64 with AVX2 and FMA (the baseline those kernels are compiled
/// beyond); `None` elsewhere, where the portable kernel runs (`$arg`: the
/// arguments `$e` would have used).
macro_rules! simd_kernel {
    ($e:expr, $($arg:ident),*) => {{
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
        let r = $e;
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
        let r = {
            $(let _ = $arg;)*
            None
        };
        r
    }};
}

pub mod attention;
pub mod chat_template;
pub mod config;
mod embedding;
pub mod error;
#[allow(unsafe_code)]
pub mod heap;
mod k_tile;
pub mod kquant;
pub mod linear;
#[allow(unsafe_code)]
pub mod mapped;
pub mod model;
pub mod native;
pub mod ops;
pub mod q8_matmul;
mod q8_tile;
pub mod reference;
pub mod rope;
pub mod sampling;
#[allow(unsafe_code)]
pub mod simd;
mod slab;
#[cfg(any(test, feature = "testing"))]
pub mod tiny;
pub mod tokenizer;
pub mod weight_cache;
pub mod weight_format;

pub use config::{Arch, LlamaConfig, SamplingDefaults};
pub use error::ModelError;
pub use linear::{Phase, PhaseFormats, WeightFormat};
pub use model::{check_gguf, estimate_weights, Llama, SeqChunk, WeightEstimate};
pub use weight_cache::CacheOutcome;
