//! Seeded random-weight GGUF test models, one preset per architecture that
//! handoff must run the way the pinned llama.cpp runs it (`llama` with its
//! RoPE variants, `qwen2`, `qwen3`, Mistral's layout, `gemma3`), plus
//! deliberately bad variants that a loader must refuse.
//!
//! The files are written at test time ([`write_model`]) and are byte-for-byte
//! deterministic for a preset (seeded `StdRng`, ordered metadata), so a test
//! can check a file's sha256 against the one recorded next to llama.cpp's
//! reference outputs (`crates/handoff-model/tests/data/arch/`, made by
//! `scripts/gen-arch-refs.sh`).
//!
//! Each preset mixes quantization types like a real `Q4_K_M` file: `Q4_K`
//! for most matrices, `Q6_K` for `attn_v`, `ffn_down` and `output`, `Q8_0`
//! for `token_embd` and one attention matrix, `F16` for one matrix, `F32`
//! for norms, biases and `rope_freqs`. The tensor names, shapes and metadata
//! keys are those llama.cpp's loader expects for each architecture (see
//! the doc of each [`ModelSpec::preset`] name).
//!
//! The vocabulary is the tiny byte-level BPE of `handoff_model::tiny` (a
//! copy: this crate does not depend on handoff-model).

use std::collections::HashMap;
use std::io::{Cursor, Seek, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Presets of models llama.cpp runs, each with reference outputs.
pub const PRESETS: &[&str] = &[
    "llama",
    "llama3",
    "llama-linear",
    "llama-yarn",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
];

/// Presets a loader must refuse (see [`ModelSpec::preset`]).
pub const BAD_PRESETS: &[&str] = &["llama-extra-tensor", "llama-bad-rope-scaling"];

/// The extra tensor of the `llama-extra-tensor` preset.
pub const EXTRA_TENSOR_NAME: &str = "blk.0.attn_mystery.weight";

/// The `rope.scaling.type` of the `llama-bad-rope-scaling` preset.
pub const BAD_ROPE_SCALING_TYPE: &str = "mystery";

/// Ids `0..CONTROL_TOKENS` are the vocabulary's control tokens; their
/// `output.weight` rows are zero (see [`write_model`]).
pub const CONTROL_TOKENS: usize = 3;

/// What can go wrong writing a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No preset of that name.
    #[error("unknown preset {0:?} (known: {known})", known = all_preset_names().join(", "))]
    UnknownPreset(String),
    /// The spec's shapes do not fit together.
    #[error("invalid model spec: {0}")]
    Spec(String),
    /// Quantizing or serializing failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Writing the file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

fn all_preset_names() -> Vec<&'static str> {
    PRESETS
        .iter()
        .chain(BAD_PRESETS)
        .copied()
        .chain(["llama3-no-rope-freqs"])
        .collect()
}

/// The graph family (`general.architecture` unless overridden).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `llama`: RMSNorm, SwiGLU, RoPE on consecutive pairs (llama.cpp `LLAMA_ROPE_TYPE_NORM`).
    Llama,
    /// `qwen2`: llama plus q/k/v biases; RoPE on halves (`NEOX`).
    Qwen2,
    /// `qwen3`: per-head RMSNorm of q and k before RoPE (`NEOX`), head dim from `attention.key_length`.
    Qwen3,
    /// `gemma3`: embedding × sqrt(hidden), q/k norms, post-attention and
    /// post-FFN norms, GeGLU, interleaved sliding-window/global layers.
    Gemma3,
}

impl Arch {
    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// RoPE scaling written into the file.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No `rope.scaling.*` keys.
    None,
    /// `rope.scaling.type = "linear"`, `rope.scaling.factor`.
    Linear {
        /// Positions are divided by this.
        factor: f32,
    },
    /// `rope.scaling.type = "yarn"`, `rope.scaling.factor`,
    /// `rope.scaling.original_context_length` (the keys convert_hf_to_gguf.py
    /// writes for a config with only `factor` and
    /// `original_max_position_embeddings`).
    Yarn {
        /// Context extension factor.
        factor: f32,
        /// Training context before extension.
        original_context: u32,
    },
    /// Llama 3.1 "llama3" RoPE: no `rope.scaling.*` keys, a `rope_freqs.weight`
    /// tensor of per-pair frequency divisors computed like convert_hf_to_gguf.py.
    Llama3 {
        /// `factor` (32 for Llama 3.2, 8 for Llama 3.1).
        factor: f32,
        /// `low_freq_factor`.
        low_freq_factor: f32,
        /// `high_freq_factor`.
        high_freq_factor: f32,
        /// `original_max_position_embeddings`.
        original_context: u32,
    },
    /// `rope.scaling.type = kind` and `rope.scaling.factor` as given, whatever
    /// `kind` is (for refusal tests).
    Named {
        /// The type string.
        kind: String,
        /// The factor.
        factor: f32,
    },
}

/// Quantization types per tensor role. K-quant types fall back to `Q8_0`
/// (or `F16`) for a matrix whose rows are not a multiple of 256.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightTypes {
    /// attn_q, attn_k, attn_output, ffn_gate, ffn_up.
    pub matrix: GgmlDType,
    /// attn_v.
    pub attn_v: GgmlDType,
    /// ffn_down.
    pub ffn_down: GgmlDType,
    /// output (the LM head).
    pub output: GgmlDType,
    /// token_embd.
    pub token_embd: GgmlDType,
    /// Per-tensor overrides by full name.
    pub overrides: Vec<(String, GgmlDType)>,
}

impl WeightTypes {
    /// Every matrix and the embedding table of type `t`.
    pub fn every(t: GgmlDType) -> Self {
        Self {
            matrix: t,
            attn_v: t,
            ffn_down: t,
            output: t,
            token_embd: t,
            overrides: Vec::new(),
        }
    }
}

/// The GGUF type of a lower-case name as llama.cpp spells it (`q4_k`).
pub fn dtype_named(name: &str) -> Option<GgmlDType> {
    use GgmlDType as G;
    Some(match name {
        "f32" => G::F32,
        "f16" => G::F16,
        "q4_0" => G::Q4_0,
        "q4_1" => G::Q4_1,
        "q5_0" => G::Q5_0,
        "q5_1" => G::Q5_1,
        "q8_0" => G::Q8_0,
        "q2_k" => G::Q2K,
        "q3_k" => G::Q3K,
        "q4_k" => G::Q4K,
        "q5_k" => G::Q5K,
        "q6_k" => G::Q6K,
        _ => return None,
    })
}

impl Default for WeightTypes {
    fn default() -> Self {
        Self {
            matrix: GgmlDType::Q4K,
            attn_v: GgmlDType::Q6K,
            ffn_down: GgmlDType::Q6K,
            output: GgmlDType::Q6K,
            token_embd: GgmlDType::Q8_0,
            overrides: vec![
                ("blk.0.attn_output.weight".into(), GgmlDType::F16),
                ("blk.1.attn_q.weight".into(), GgmlDType::Q8_0),
            ],
        }
    }
}

/// Ranges of the uniform random weights. A matrix with `n` inputs draws from
/// `±scale/sqrt(n)`; vectors from `[lo, hi]`.
///
/// The defaults were chosen with llama.cpp: logits span about ±16 with a
/// median top-1/top-2 margin of about 1.3, and the model is calm enough that
/// llama.cpp's own activation rounding (quantized files vs the same weights
/// dequantized to F32) moves logits by a median 0.04-0.06, while the
/// attention is sharp enough that positions matter (dropping `rope_freqs`
/// moves logits by 1-2 on 600+ token prompts). Larger `attn_vo`/`ffn` (1.5)
/// made the network chaotic (rounding noise 0.16 median, 0.7 worst).
#[derive(Debug, Clone, PartialEq)]
pub struct Scales {
    /// token_embd entries: `±embed`.
    pub embed: f32,
    /// attn_q / attn_k: `±attn_qk/sqrt(in)` (larger: sharper attention).
    pub attn_qk: f32,
    /// attn_v / attn_output.
    pub attn_vo: f32,
    /// ffn_gate / ffn_up / ffn_down.
    pub ffn: f32,
    /// output entries: `±output` (sets the logit spread).
    pub output: f32,
    /// RMSNorm weights (attn_norm, ffn_norm, output_norm, post norms).
    pub norm: (f32, f32),
    /// attn_q_norm / attn_k_norm weights.
    pub qk_norm: (f32, f32),
    /// q/k/v biases: `±bias`.
    pub bias: f32,
}

impl Default for Scales {
    fn default() -> Self {
        Self {
            embed: 1.0,
            attn_qk: 3.0,
            attn_vo: 1.0,
            ffn: 1.0,
            output: 0.6,
            norm: (0.8, 1.2),
            qk_norm: (1.0, 2.0),
            bias: 0.5,
        }
    }
}

/// Everything that defines a test model. Start from [`ModelSpec::preset`] and
/// change fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Graph family.
    pub arch: Arch,
    /// `general.architecture` if not `arch.name()`.
    pub architecture_override: Option<String>,
    /// `general.name`.
    pub name: String,
    /// Seed of the weights.
    pub seed: u64,
    /// Blocks.
    pub layers: usize,
    /// Hidden size (multiple of 256 for K-quants).
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head (may differ from `hidden / heads`).
    pub head_dim: usize,
    /// FFN inner size.
    pub ffn: usize,
    /// `context_length`.
    pub context_length: usize,
    /// Write `attention.key_length` / `attention.value_length` (= head_dim).
    pub write_head_dim: bool,
    /// Write `rope.dimension_count` (= head_dim).
    pub write_rope_dims: bool,
    /// Write `<arch>.vocab_size`.
    pub write_vocab_size: bool,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base` (global layers for gemma3).
    pub rope_theta: f32,
    /// `rope.freq_base_swa` (gemma3's sliding-window layers).
    pub rope_theta_swa: Option<f32>,
    /// `attention.sliding_window` (tokens).
    pub sliding_window: Option<usize>,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// With [`RopeScaling::Llama3`]: leave the `rope_freqs.weight` tensor out
    /// (everything else byte-identical; to show that it matters).
    pub omit_rope_freqs: bool,
    /// q/k/v biases (`attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm weights (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// gemma3's `post_attention_norm` / `post_ffw_norm`.
    pub post_norms: bool,
    /// No `output.weight` (the LM head is `token_embd`).
    pub tied_output: bool,
    /// Extra `[hidden, hidden]` random Q8_0 tensors with these names (no
    /// architecture has them: a loader must refuse the file).
    pub extra_tensors: Vec<String>,
    /// Quantization types.
    pub types: WeightTypes,
    /// Weight ranges.
    pub scales: Scales,
}

impl ModelSpec {
    /// The plain llama layout every preset starts from: 4 blocks, hidden 256,
    /// 4 query heads and 2 KV heads of 64, FFN 512, RoPE base 10000.
    fn base_llama() -> Self {
        Self {
            arch: Arch::Llama,
            architecture_override: None,
            name: "handoff-test-llama".into(),
            seed: 0x11a3a,
            layers: 4,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
            context_length: 4096,
            write_head_dim: false,
            write_rope_dims: true,
            write_vocab_size: true,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_theta_swa: None,
            sliding_window: None,
            rope_scaling: RopeScaling::None,
            omit_rope_freqs: false,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            tied_output: false,
            extra_tensors: Vec::new(),
            types: WeightTypes::default(),
            scales: Scales::default(),
        }
    }

    /// A named preset:
    ///
    /// - `llama`: plain Llama (SmolLM2-like keys), RoPE base 10000.
    /// - `llama3`: Llama 3.2-like: RoPE base 500000, context 131072,
    ///   `attention.key_length`/`value_length`, and `rope_freqs.weight` from the
    ///   Llama 3.1 formula (factor 32, low 1, high 4, original context 8192);
    ///   no `rope.scaling.*` keys (a converted Llama 3.2 has none).
    /// - `llama3-no-rope-freqs`: `llama3` without the `rope_freqs.weight` tensor.
    /// - `llama-linear`: `rope.scaling.type` linear, factor 4.
    /// - `llama-yarn`: `rope.scaling.type` yarn, factor 4, original context 4096.
    /// - `qwen2`: Qwen2.5-like: q/k/v biases, RoPE base 1e6, eps 1e-6.
    /// - `qwen3`: Qwen3-like: q/k norms, head dim 128 (key/value_length) with
    ///   hidden 256 and 4 heads, RoPE base 1e6, eps 1e-6.
    /// - `mistral`: Mistral's layout as llama.cpp has it: architecture `llama`
    ///   (convert_hf_to_gguf.py maps MistralForCausalLM to llama, and llama.cpp
    ///   has no `mistral` architecture), 4:1 GQA, RoPE base 1e6, no sliding
    ///   window (llama.cpp's llama graph reads none).
    /// - `gemma3`: 7 blocks (0-4 and 6 sliding-window, 5 global: llama.cpp's
    ///   default pattern of 6), window 32, RoPE bases 1e6 (global) and 10000
    ///   (`rope.freq_base_swa`), head dim 128, 4 heads, 1 KV head, eps 1e-6.
    /// - `llama-extra-tensor`: `llama` plus `blk.0.attn_mystery.weight`.
    /// - `llama-bad-rope-scaling`: `llama` with `rope.scaling.type = "mystery"`.
    pub fn preset(name: &str) -> Result<Self, Error> {
        let mut s = Self::base_llama();
        s.name = format!("handoff-test-{name}");
        match name {
            "llama" => {}
            "llama3" | "llama3-no-rope-freqs" => {
                s.seed = 0x11a3a3;
                s.context_length = 131_072;
                s.rope_theta = 500_000.0;
                s.write_head_dim = true;
                s.rope_scaling = RopeScaling::Llama3 {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_context: 8192,
                };
                s.omit_rope_freqs = name == "llama3-no-rope-freqs";
            }
            "llama-linear" => {
                s.seed = 0x11a3a1;
                s.context_length = 16_384;
                s.rope_scaling = RopeScaling::Linear { factor: 4.0 };
            }
            "llama-yarn" => {
                s.seed = 0x11a3a7;
                s.context_length = 16_384;
                s.rope_scaling = RopeScaling::Yarn {
                    factor: 4.0,
                    original_context: 4096,
                };
            }
            "qwen2" => {
                s.arch = Arch::Qwen2;
                s.seed = 0x9e2;
                s.context_length = 32_768;
                s.rope_theta = 1_000_000.0;
                s.rms_eps = 1e-6;
                s.qkv_bias = true;
                s.write_rope_dims = false;
                s.write_vocab_size = false;
            }
            "qwen3" => {
                s.arch = Arch::Qwen3;
                s.seed = 0x9e3;
                s.head_dim = 128;
                s.context_length = 40_960;
                s.rope_theta = 1_000_000.0;
                s.rms_eps = 1e-6;
                s.qk_norm = true;
                s.write_head_dim = true;
                s.write_rope_dims = false;
                s.write_vocab_size = false;
            }
            "mistral" => {
                s.seed = 0x3157;
                s.kv_heads = 1;
                s.context_length = 32_768;
                s.rope_theta = 1_000_000.0;
            }
            "gemma3" => {
                s.arch = Arch::Gemma3;
                s.seed = 0x6e3;
                s.layers = 7;
                s.kv_heads = 1;
                s.head_dim = 128;
                s.ffn = 256;
                s.context_length = 32_768;
                s.rope_theta = 1_000_000.0;
                s.rope_theta_swa = Some(10_000.0);
                s.sliding_window = Some(32);
                s.rms_eps = 1e-6;
                s.qk_norm = true;
                s.post_norms = true;
                s.write_head_dim = true;
                s.write_rope_dims = false;
                s.write_vocab_size = false;
                // The input is scaled by sqrt(hidden) = 16 (residual rms ~5.5)
                // and every block adds two post-normed outputs (rms ~1): a
                // smaller embedding makes the random model chaotic (logits
                // sensitive to llama.cpp's own activation rounding).
                s.scales.embed = 0.6;
            }
            "llama-extra-tensor" => {
                s.extra_tensors = vec![EXTRA_TENSOR_NAME.into()];
            }
            "llama-bad-rope-scaling" => {
                s.rope_scaling = RopeScaling::Named {
                    kind: BAD_ROPE_SCALING_TYPE.into(),
                    factor: 4.0,
                };
            }
            other => return Err(Error::UnknownPreset(other.into())),
        }
        Ok(s)
    }

    /// The `general.architecture` written.
    pub fn architecture(&self) -> &str {
        self.architecture_override
            .as_deref()
            .unwrap_or(self.arch.name())
    }

    /// Layer `il` is a sliding-window layer in llama.cpp's reading of this
    /// file (gemma3 with a window: `il % 6 < 5`, `llama_hparams::set_swa_pattern(6)`).
    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.arch == Arch::Gemma3 && self.sliding_window.is_some_and(|w| w > 0) && il % 6 < 5
    }

    fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Spec(m));
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad("layers, heads, kv_heads and head_dim must be positive".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads {} not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even", self.head_dim));
        }
        for (what, n) in [
            ("hidden", self.hidden),
            ("ffn", self.ffn),
            ("heads*head_dim", self.heads * self.head_dim),
        ] {
            if !n.is_multiple_of(32) {
                return bad(format!("{what} = {n} must be a multiple of 32"));
            }
        }
        if !self.write_head_dim && self.head_dim * self.heads != self.hidden {
            return bad("head_dim differs from hidden/heads: set write_head_dim".into());
        }
        Ok(())
    }
}

/// Llama 3.1 RoPE frequency divisors (`rope_freqs.weight`, one per rotated
/// pair), computed in f32 in the order convert_hf_to_gguf.py's
/// `LlamaModel.generate_extra_tensors` computes them with torch float32.
pub fn llama3_rope_freqs(
    dim: usize,
    base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    old_context_len: u32,
) -> Vec<f32> {
    let old = old_context_len as f32;
    let low_freq_wavelen = old / low_freq_factor;
    let high_freq_wavelen = old / high_freq_factor;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    (0..dim)
        .step_by(2)
        .map(|i| {
            // freqs = 1.0 / (base ** (torch.arange(0, dim, 2) / dim))
            let freq = 1.0f32 / base.powf(i as f32 / dim as f32);
            let wavelen = two_pi / freq;
            if wavelen < high_freq_wavelen {
                1.0
            } else if wavelen > low_freq_wavelen {
                factor
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A K-quant needs rows of 256, Q8_0 rows of 32.
fn fit(dtype: GgmlDType, inner: usize) -> GgmlDType {
    let bs = dtype.block_size();
    if inner.is_multiple_of(bs) {
        dtype
    } else if inner.is_multiple_of(32) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F16
    }
}

struct Builder<'a> {
    spec: &'a ModelSpec,
    rng: StdRng,
    tensors: Vec<(String, QTensor)>,
}

impl Builder<'_> {
    fn dtype_for(&self, name: &str, role: GgmlDType, inner: usize) -> GgmlDType {
        let t = self
            .spec
            .types
            .overrides
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| *t)
            .unwrap_or(role);
        fit(t, inner)
    }

    fn push(
        &mut self,
        name: String,
        data: Vec<f32>,
        shape: &[usize],
        dtype: GgmlDType,
    ) -> Result<(), Error> {
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        let q = QTensor::quantize(&t, dtype)?;
        self.tensors.push((name, q));
        Ok(())
    }

    /// `[out, inp]` matrix, entries `±scale/sqrt(inp)`.
    fn matrix(
        &mut self,
        name: String,
        out: usize,
        inp: usize,
        scale: f32,
        role: GgmlDType,
    ) -> Result<(), Error> {
        let a = scale / (inp as f32).sqrt();
        let v = uniform(&mut self.rng, out * inp, -a, a);
        let dt = self.dtype_for(&name, role, inp);
        self.push(name, v, &[out, inp], dt)
    }

    fn vector(&mut self, name: String, n: usize, (lo, hi): (f32, f32)) -> Result<(), Error> {
        let v = uniform(&mut self.rng, n, lo, hi);
        self.push(name, v, &[n], GgmlDType::F32)
    }
}

/// The GGUF bytes of a spec.
pub fn model_bytes(spec: &ModelSpec) -> Result<Vec<u8>, Error> {
    let mut cur = Cursor::new(Vec::new());
    write_to(&mut cur, spec)?;
    Ok(cur.into_inner())
}

/// Write a spec's GGUF to `path`. Weights are uniform random from the
/// spec's seed; with an untied output, the rows of the control tokens
/// (`0..CONTROL_TOKENS`) in `output.weight` are zero, so that greedy decoding
/// never picks an end-of-generation token.
pub fn write_model(path: &Path, spec: &ModelSpec) -> Result<(), Error> {
    let bytes = model_bytes(spec)?;
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::create(path).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)
}

/// Write a named preset's GGUF to `path`.
pub fn write_preset(path: &Path, preset: &str) -> Result<ModelSpec, Error> {
    let spec = ModelSpec::preset(preset)?;
    write_model(path, &spec)?;
    Ok(spec)
}

fn write_to<W: Write + Seek>(w: &mut W, spec: &ModelSpec) -> Result<(), Error> {
    spec.validate()?;
    let vocab_meta = tiny_vocab_metadata();
    let vocab = match vocab_meta.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => t.len(),
        _ => unreachable!("the tiny vocabulary has tokens"),
    };
    let (h, hd) = (spec.hidden, spec.head_dim);
    let (qw, kvw) = (spec.heads * hd, spec.kv_heads * hd);
    let sc = spec.scales.clone();
    let ty = spec.types.clone();
    let mut b = Builder {
        spec,
        rng: StdRng::seed_from_u64(spec.seed),
        tensors: Vec::new(),
    };

    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_context,
    } = spec.rope_scaling
    {
        if !spec.omit_rope_freqs {
            // Not random: leaving it out keeps every other tensor identical.
            let f = llama3_rope_freqs(
                hd,
                spec.rope_theta,
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            );
            let n = f.len();
            b.push("rope_freqs.weight".into(), f, &[n], GgmlDType::F32)?;
        }
    }
    let e = sc.embed;
    let embd = uniform(&mut b.rng, vocab * h, -e, e);
    let dt = b.dtype_for("token_embd.weight", ty.token_embd, h);
    b.push("token_embd.weight".into(), embd, &[vocab, h], dt)?;

    for i in 0..spec.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        b.vector(n("attn_norm.weight"), h, sc.norm)?;
        b.matrix(n("attn_q.weight"), qw, h, sc.attn_qk, ty.matrix)?;
        b.matrix(n("attn_k.weight"), kvw, h, sc.attn_qk, ty.matrix)?;
        b.matrix(n("attn_v.weight"), kvw, h, sc.attn_vo, ty.attn_v)?;
        if spec.qkv_bias {
            let r = (-sc.bias, sc.bias);
            b.vector(n("attn_q.bias"), qw, r)?;
            b.vector(n("attn_k.bias"), kvw, r)?;
            b.vector(n("attn_v.bias"), kvw, r)?;
        }
        if spec.qk_norm {
            b.vector(n("attn_q_norm.weight"), hd, sc.qk_norm)?;
            b.vector(n("attn_k_norm.weight"), hd, sc.qk_norm)?;
        }
        b.matrix(n("attn_output.weight"), h, qw, sc.attn_vo, ty.matrix)?;
        if spec.post_norms {
            b.vector(n("post_attention_norm.weight"), h, sc.norm)?;
        }
        b.vector(n("ffn_norm.weight"), h, sc.norm)?;
        b.matrix(n("ffn_gate.weight"), spec.ffn, h, sc.ffn, ty.matrix)?;
        b.matrix(n("ffn_up.weight"), spec.ffn, h, sc.ffn, ty.matrix)?;
        b.matrix(n("ffn_down.weight"), h, spec.ffn, sc.ffn, ty.ffn_down)?;
        if spec.post_norms {
            b.vector(n("post_ffw_norm.weight"), h, sc.norm)?;
        }
    }
    for name in &spec.extra_tensors {
        b.matrix(name.clone(), h, h, 1.0, GgmlDType::Q8_0)?;
    }
    b.vector("output_norm.weight".into(), h, sc.norm)?;
    if !spec.tied_output {
        let o = sc.output;
        let mut v = uniform(&mut b.rng, vocab * h, -o, o);
        // Control tokens (0 `<|endoftext|>`, 1, 2 `<|im_end|>`) get zero
        // rows, hence logit 0, below the top of ~300 random logits: greedy
        // decoding never stops early at an end-of-generation token.
        v[..CONTROL_TOKENS * h].fill(0.0);
        let dt = b.dtype_for("output.weight", ty.output, h);
        b.push("output.weight".into(), v, &[vocab, h], dt)?;
    }

    let arch = spec.architecture().to_string();
    let k = |s: &str| format!("{arch}.{s}");
    let u = |x: usize| Value::U32(x as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.clone())),
        ("general.name".into(), Value::String(spec.name.clone())),
        // LLAMA_FTYPE_MOSTLY_Q4_K_M: informational only.
        ("general.file_type".into(), Value::U32(15)),
        ("general.quantization_version".into(), Value::U32(2)),
        (k("block_count"), u(spec.layers)),
        (k("context_length"), u(spec.context_length)),
        (k("embedding_length"), u(h)),
        (k("feed_forward_length"), u(spec.ffn)),
        (k("attention.head_count"), u(spec.heads)),
        (k("attention.head_count_kv"), u(spec.kv_heads)),
        (k("rope.freq_base"), Value::F32(spec.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(spec.rms_eps),
        ),
    ];
    if let Some(t) = spec.rope_theta_swa {
        meta.push((k("rope.freq_base_swa"), Value::F32(t)));
    }
    if let Some(wnd) = spec.sliding_window {
        meta.push((k("attention.sliding_window"), u(wnd)));
    }
    if spec.write_head_dim {
        meta.push((k("attention.key_length"), u(hd)));
        meta.push((k("attention.value_length"), u(hd)));
    }
    if spec.write_rope_dims {
        meta.push((k("rope.dimension_count"), u(hd)));
    }
    match &spec.rope_scaling {
        RopeScaling::None | RopeScaling::Llama3 { .. } => {}
        RopeScaling::Linear { factor } => {
            meta.push((k("rope.scaling.type"), Value::String("linear".into())));
            meta.push((k("rope.scaling.factor"), Value::F32(*factor)));
        }
        RopeScaling::Yarn {
            factor,
            original_context,
        } => {
            meta.push((k("rope.scaling.type"), Value::String("yarn".into())));
            meta.push((k("rope.scaling.factor"), Value::F32(*factor)));
            meta.push((
                k("rope.scaling.original_context_length"),
                Value::U32(*original_context),
            ));
        }
        RopeScaling::Named { kind, factor } => {
            meta.push((k("rope.scaling.type"), Value::String(kind.clone())));
            meta.push((k("rope.scaling.factor"), Value::F32(*factor)));
        }
    }
    if spec.write_vocab_size {
        meta.push((k("vocab_size"), u(vocab)));
    }
    let mut vm: Vec<_> = vocab_meta.into_iter().collect();
    vm.sort_by(|a, b| a.0.cmp(&b.0));
    meta.extend(vm);

    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        b.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(w, &meta_refs, &tensor_refs)?;
    Ok(())
}

/// GPT-2's byte-to-unicode table (the byte-level BPE alphabet).
fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    table
}

/// SmolLM2's chat template (as in `handoff_model::chat_template::SMOLLM2_TEMPLATE`).
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The tiny test vocabulary (a copy of `handoff_model::tiny::tiny_vocab_metadata`):
/// `tokenizer.*` GGUF metadata for a byte-level BPE with the control tokens
/// `<|endoftext|>` (0), `<|im_start|>` (1, BOS) and `<|im_end|>` (2, EOS), the
/// 256 byte symbols (ids 3..259, id = 3 + byte) and a few English merges,
/// plus SmolLM2's chat template.
pub fn tiny_vocab_metadata() -> HashMap<String, Value> {
    const MERGES: &[(&str, &str)] = &[
        ("Ġ", "t"),
        ("Ġ", "a"),
        ("h", "e"),
        ("i", "n"),
        ("r", "e"),
        ("o", "n"),
        ("Ġt", "he"),
        ("e", "r"),
        ("Ġ", "s"),
        ("a", "t"),
        ("Ġ", "w"),
        ("Ġ", "o"),
        ("e", "n"),
        ("Ġ", "c"),
        ("i", "t"),
        ("i", "s"),
        ("a", "n"),
        ("o", "r"),
        ("e", "s"),
        ("Ġ", "b"),
        ("e", "d"),
        ("Ġ", "f"),
        ("in", "g"),
        ("Ġ", "p"),
        ("o", "u"),
        ("Ġa", "n"),
        ("a", "l"),
        ("a", "r"),
        ("Ġt", "o"),
        ("Ġ", "m"),
        ("Ġo", "f"),
        ("Ġ", "in"),
        ("Ġ", "d"),
        ("Ġ", "h"),
        ("Ġan", "d"),
        ("l", "l"),
        ("Ġ", "Ġ"),
        ("Ġ", "H"),
        ("l", "o"),
        ("Ġw", "or"),
        ("H", "e"),
        ("He", "ll"),
        ("Hell", "o"),
    ];
    let control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut tokens: Vec<String> = control.iter().map(|s| s.to_string()).collect();
    let mut types: Vec<Value> = vec![Value::I32(3); control.len()];
    for c in byte_to_unicode() {
        tokens.push(c.to_string());
        types.push(Value::I32(1));
    }
    let mut merges = Vec::new();
    for (a, b) in MERGES {
        let joined = format!("{a}{b}");
        if !tokens.contains(&joined) {
            tokens.push(joined);
            types.push(Value::I32(1));
        }
        merges.push(Value::String(format!("{a} {b}")));
    }
    let mut m = HashMap::new();
    let s = |v: &str| Value::String(v.to_string());
    m.insert("tokenizer.ggml.model".into(), s("gpt2"));
    m.insert("tokenizer.ggml.pre".into(), s("smollm"));
    m.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    m.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    m.insert("tokenizer.ggml.merges".into(), Value::Array(merges));
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    m.insert("tokenizer.ggml.padding_token_id".into(), Value::U32(2));
    m.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    m.insert("tokenizer.chat_template".into(), s(SMOLLM2_TEMPLATE));
    m
}

/// Vocabulary size of every preset.
pub fn vocab_size() -> usize {
    match tiny_vocab_metadata().get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => t.len(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Content;

    #[test]
    fn presets_are_deterministic_and_distinct() {
        let mut seen = Vec::new();
        for &p in PRESETS.iter().chain(BAD_PRESETS) {
            let spec = ModelSpec::preset(p).unwrap();
            let a = model_bytes(&spec).unwrap();
            let b = model_bytes(&ModelSpec::preset(p).unwrap()).unwrap();
            assert!(a == b, "{p}: two writes differ");
            assert!(a.len() < 3 << 20, "{p}: {} bytes", a.len());
            assert!(!seen.contains(&a), "{p}: same bytes as another preset");
            seen.push(a);
        }
    }

    #[test]
    fn write_model_matches_model_bytes() {
        let dir = std::env::temp_dir().join(format!("handoff-testmodels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("llama.gguf");
        let spec = write_preset(&path, "llama").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), model_bytes(&spec).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_parse_with_expected_tensors_and_keys() {
        for &p in PRESETS.iter().chain(BAD_PRESETS) {
            let spec = ModelSpec::preset(p).unwrap();
            let bytes = model_bytes(&spec).unwrap();
            let c = Content::read(&mut Cursor::new(&bytes)).unwrap();
            let arch = spec.architecture();
            assert_eq!(
                c.metadata["general.architecture"].to_string().unwrap(),
                arch,
                "{p}"
            );
            let q = &c.tensor_infos["blk.0.attn_q.weight"];
            assert_eq!(
                q.shape.dims(),
                &[spec.heads * spec.head_dim, spec.hidden],
                "{p}"
            );
            assert_eq!(
                c.tensor_infos["blk.2.attn_q.weight"].ggml_dtype,
                GgmlDType::Q4K,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos["blk.0.attn_v.weight"].ggml_dtype,
                GgmlDType::Q6K,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos["blk.0.attn_output.weight"].ggml_dtype,
                GgmlDType::F16,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos["token_embd.weight"].ggml_dtype,
                GgmlDType::Q8_0,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos["output.weight"].ggml_dtype,
                GgmlDType::Q6K,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos.contains_key("rope_freqs.weight"),
                p == "llama3",
                "{p}"
            );
            assert_eq!(
                c.tensor_infos.contains_key(EXTRA_TENSOR_NAME),
                p == "llama-extra-tensor",
                "{p}"
            );
            assert_eq!(
                c.tensor_infos.contains_key("blk.0.attn_q_norm.weight"),
                spec.qk_norm,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos.contains_key("blk.0.attn_q.bias"),
                spec.qkv_bias,
                "{p}"
            );
            assert_eq!(
                c.tensor_infos.contains_key("blk.0.post_ffw_norm.weight"),
                spec.post_norms,
                "{p}"
            );
        }
    }

    #[test]
    fn llama3_rope_freqs_follow_the_formula() {
        let f = llama3_rope_freqs(64, 500_000.0, 32.0, 1.0, 4.0, 8192);
        assert_eq!(f.len(), 32);
        // High frequencies untouched, low ones divided by the factor, a
        // smooth ramp between (wavelengths 2048..8192 tokens).
        assert!(f[..15].iter().all(|&x| x == 1.0), "{f:?}");
        assert!(f[18..].iter().all(|&x| x == 32.0), "{f:?}");
        assert!(f[15..18].iter().all(|&x| x > 1.0 && x < 32.0), "{f:?}");
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn removing_rope_freqs_changes_nothing_else() {
        let with = ModelSpec::preset("llama3").unwrap();
        let without = ModelSpec::preset("llama3-no-rope-freqs").unwrap();
        let (a, b) = (model_bytes(&with).unwrap(), model_bytes(&without).unwrap());
        let ca = Content::read(&mut Cursor::new(&a)).unwrap();
        let cb = Content::read(&mut Cursor::new(&b)).unwrap();
        assert_eq!(ca.tensor_infos.len(), cb.tensor_infos.len() + 1);
        for (name, _) in cb.tensor_infos.iter() {
            let x = ca.tensor(&mut Cursor::new(&a), name, &Device::Cpu).unwrap();
            let y = cb.tensor(&mut Cursor::new(&b), name, &Device::Cpu).unwrap();
            assert_eq!(x.data().unwrap(), y.data().unwrap(), "{name}");
        }
    }

    #[test]
    fn gemma3_has_both_layer_kinds() {
        let s = ModelSpec::preset("gemma3").unwrap();
        let swa: Vec<bool> = (0..s.layers).map(|i| s.is_swa_layer(i)).collect();
        assert_eq!(swa, [true, true, true, true, true, false, true]);
    }

    #[test]
    fn unknown_preset_is_an_error() {
        assert!(matches!(
            ModelSpec::preset("nope"),
            Err(Error::UnknownPreset(_))
        ));
    }
}
