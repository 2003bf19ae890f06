//! Model hyper-parameters read from GGUF metadata.
//!
//! The rule is the HTTP API's: honour or refuse. Every metadata key under
//! the architecture's prefix is either read and applied here or makes the
//! load fail naming it ([`ModelError::Unsupported`]); a key that changes no
//! arithmetic (`vocab_size`, `rope.scaling.finetuned`) is read and checked.
//! Keys outside the architecture's prefix: `general.*` is provenance (its
//! `sampling.*` keys are the file's sampling defaults, [`SamplingDefaults`]),
//! `tokenizer.*` belongs to the tokenizer, `quantize.*` records how the file
//! was made; `split.*` (a model in several files) is refused, and so is any
//! other prefix.

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::ModelError;

/// The family of a supported architecture: which tensors a block has and
/// how they combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (and `mistral`, the same layout): SwiGLU, RoPE on adjacent
    /// pairs, optional Llama 3 frequency factors (`rope_freqs.weight`).
    Llama,
    /// `qwen2`: Llama with Q/K/V biases and RoPE on halves.
    Qwen2,
    /// `qwen3`: per-head RMSNorm of Q and K before RoPE (on halves); the
    /// head size comes from `attention.key_length`.
    Qwen3,
    /// `gemma3`: GeGLU, embeddings scaled by √hidden, Q/K norms, norms
    /// after attention and after the FFN, sliding-window layers
    /// interleaved with global ones, each kind with its own RoPE base.
    Gemma3,
}

impl Arch {
    /// Per-head RMSNorm of Q and K before RoPE.
    pub fn has_qk_norms(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Gemma3)
    }

    /// RMSNorms of the attention and FFN outputs before their residuals.
    pub fn has_post_norms(self) -> bool {
        self == Arch::Gemma3
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            _ => return None,
        })
    }
}

/// The FFN's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu(gate) * up` with GELU's tanh approximation (GeGLU).
    GeluTanh,
}

/// How RoPE positions are stretched beyond the trained context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions as they are.
    None,
    /// Every frequency divided by `factor` (`rope.scaling.type = linear`).
    Linear {
        /// The scaling factor.
        factor: f32,
    },
    /// YaRN (`rope.scaling.type = yarn`), as ggml computes it.
    Yarn {
        /// The scaling factor.
        factor: f32,
        /// `rope.scaling.original_context_length`.
        original_context: usize,
        /// Extrapolation mix (`rope.scaling.yarn_ext_factor`, default 1).
        ext_factor: f32,
        /// `rope.scaling.yarn_beta_fast` (default 32).
        beta_fast: f32,
        /// `rope.scaling.yarn_beta_slow` (default 1).
        beta_slow: f32,
    },
}

/// Sampling defaults the file's authors recommend (`general.sampling.*`,
/// which llama.cpp also reads): a request that leaves a field unset gets
/// the file's value.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SamplingDefaults {
    /// `general.sampling.temp`.
    pub temperature: Option<f32>,
    /// `general.sampling.top_k`.
    pub top_k: Option<u32>,
    /// `general.sampling.top_p`.
    pub top_p: Option<f32>,
    /// `general.sampling.min_p`.
    pub min_p: Option<f32>,
    /// `general.sampling.penalty_repeat`.
    pub repetition_penalty: Option<f32>,
}

/// Hyper-parameters of a supported model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`.
    pub architecture: String,
    /// The family [`Self::architecture`] belongs to.
    pub arch: Arch,
    /// `general.name`, if any.
    pub name: Option<String>,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Feed-forward inner size.
    pub ffn_hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA when fewer than `heads`).
    pub kv_heads: usize,
    /// Elements per head, keys and values alike (`attention.key_length`,
    /// else hidden / heads).
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency (of the global layers where they differ).
    pub rope_theta: f32,
    /// RoPE base frequency of the sliding-window layers.
    pub rope_theta_swa: f32,
    /// Dimensions rotated by RoPE (usually `head_dim`).
    pub rope_dims: usize,
    /// Position scaling of the global layers (sliding-window layers are
    /// never scaled, as in llama.cpp).
    pub rope_scaling: RopeScaling,
    /// `rope.scaling.attn_factor`: a factor on RoPE's cos and sin.
    pub rope_attn_factor: f32,
    /// Tokens a sliding-window layer sees (its own and the `window - 1`
    /// before it); `None` when no layer slides.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer.
    pub swa_layers: Vec<bool>,
    /// Scale of the query·key product.
    pub attn_scale: f32,
    /// Factor applied to the token embeddings (Gemma: √hidden).
    pub embed_scale: Option<f32>,
    /// `final_logit_softcapping`: logits become `c·tanh(logit/c)`.
    pub final_softcap: Option<f32>,
    /// The FFN's gate activation.
    pub activation: Activation,
    /// The file's sampling defaults.
    pub sampling: SamplingDefaults,
}

fn get<'a>(c: &'a Content, key: &str) -> Option<&'a Value> {
    c.metadata.get(key)
}

fn count(key: &str, v: &Value) -> Result<usize, ModelError> {
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I8(x) if *x >= 0 => *x as u64,
        Value::I16(x) if *x >= 0 => *x as u64,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(ModelError::Malformed(format!(
                "metadata {key} is not a count: {other:?}"
            )))
        }
    };
    usize::try_from(n).map_err(|_| ModelError::Malformed(format!("metadata {key} too large: {n}")))
}

fn get_usize(c: &Content, key: &str) -> Result<usize, ModelError> {
    let v =
        get(c, key).ok_or_else(|| ModelError::Malformed(format!("missing metadata key {key}")))?;
    count(key, v)
}

fn opt_usize(c: &Content, key: &str) -> Result<Option<usize>, ModelError> {
    get(c, key).map(|v| count(key, v)).transpose()
}

fn opt_f32(c: &Content, key: &str) -> Result<Option<f32>, ModelError> {
    match get(c, key) {
        None => Ok(None),
        Some(Value::F32(x)) => Ok(Some(*x)),
        Some(Value::F64(x)) => Ok(Some(*x as f32)),
        Some(other) => Err(ModelError::Malformed(format!(
            "metadata {key} is not a number: {other:?}"
        ))),
    }
}

fn opt_string(c: &Content, key: &str) -> Result<Option<String>, ModelError> {
    match get(c, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ModelError::Malformed(format!(
            "metadata {key} is not a string: {other:?}"
        ))),
    }
}

fn unsupported(what: impl Into<String>) -> ModelError {
    ModelError::Unsupported(what.into())
}

/// Keys under the architecture's prefix that [`LlamaConfig::from_gguf`]
/// reads, for every architecture; each `arch_keys` adds its own.
const COMMON_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "rope.scaling.finetuned",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "expert_count",
    "expert_used_count",
    // LayerNorm's epsilon, which converters write when the source config
    // names one: none of these architectures has a LayerNorm (llama.cpp
    // reads it for none of them either).
    "attention.layer_norm_epsilon",
    // Causal attention: only `true` is accepted (checked in `check_keys`).
    "attention.causal",
];

fn arch_keys(arch: Arch) -> &'static [&'static str] {
    match arch {
        // A `mistral`/`llama` file may carry Mistral's sliding window: it
        // applies to every layer (llama.cpp at our pin does not read it).
        Arch::Llama => &["attention.sliding_window"],
        Arch::Qwen2 | Arch::Qwen3 => &[],
        Arch::Gemma3 => &[
            "attention.sliding_window",
            "attention.sliding_window_pattern",
            "rope.freq_base_swa",
            "final_logit_softcapping",
        ],
    }
}

/// Refuse a key this implementation does not read, and a prefix it does
/// not know.
fn check_keys(c: &Content, arch_name: &str, arch: Arch) -> Result<(), ModelError> {
    let mut keys: Vec<&String> = c.metadata.keys().collect();
    keys.sort();
    for key in keys {
        if let Some(rest) = key
            .strip_prefix(arch_name)
            .and_then(|r| r.strip_prefix('.'))
        {
            if rest == "attention.causal" && !matches!(get(c, key), Some(Value::Bool(true))) {
                return Err(unsupported(format!(
                    "{key} is not true: handoff runs causal decoders only"
                )));
            }
            if !COMMON_KEYS.contains(&rest) && !arch_keys(arch).contains(&rest) {
                return Err(unsupported(format!(
                    "metadata key {key} (handoff does not implement it for {arch_name}, and ignoring it could change the model's output)"
                )));
            }
            continue;
        }
        let prefix = key.split('.').next().unwrap_or("");
        match prefix {
            "general" => check_sampling_key(c, key)?,
            "tokenizer" | "quantize" => {}
            "split" => {
                if key == "split.count" && opt_usize(c, key)?.unwrap_or(1) > 1 {
                    return Err(unsupported(
                        "a model split over several files (split.count > 1): merge it first with llama-gguf-split --merge",
                    ));
                }
            }
            _ => {
                return Err(unsupported(format!(
                    "metadata key {key} (not a {arch_name} key, nor general, tokenizer or quantize metadata)"
                )))
            }
        }
    }
    Ok(())
}

/// `general.sampling.*`: the keys [`SamplingDefaults`] reads; the others
/// (XTC, Mirostat, the penalty window, the sampler order) only at the
/// value that turns them off, else refused.
fn check_sampling_key(c: &Content, key: &str) -> Result<(), ModelError> {
    let Some(name) = key.strip_prefix("general.sampling.") else {
        return Ok(());
    };
    match name {
        "temp" | "top_k" | "top_p" | "min_p" | "penalty_repeat" => Ok(()),
        "xtc_probability" if opt_f32(c, key)? == Some(0.0) => Ok(()),
        "mirostat" if opt_usize(c, key)? == Some(0) => Ok(()),
        _ => Err(unsupported(format!(
            "metadata key {key}: a sampling default handoff does not implement (it implements temp, top_k, top_p, min_p and penalty_repeat)"
        ))),
    }
}

impl LlamaConfig {
    /// The KV geometry this model needs for a page size and element type.
    pub fn kv_geometry(
        &self,
        page_size: usize,
        dtype: handoff_kv::KvDtype,
    ) -> handoff_kv::KvGeometry {
        handoff_kv::KvGeometry {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            page_size,
            dtype,
        }
    }

    /// Width of the query projection (`heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the key and of the value projection (`kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Read the hyper-parameters: an architecture or metadata key this
    /// implementation does not run is refused by name.
    pub fn from_gguf(c: &Content) -> Result<Self, ModelError> {
        let arch_name = match get(c, "general.architecture") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(ModelError::Malformed("missing general.architecture".into())),
        };
        let arch = Arch::from_name(&arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.clone()))?;
        check_keys(c, &arch_name, arch)?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let hidden = get_usize(c, &k("embedding_length"))?;
        let heads = get_usize(c, &k("attention.head_count"))?;
        let kv_heads = opt_usize(c, &k("attention.head_count_kv"))?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(ModelError::Malformed(format!(
                "inconsistent heads: heads {heads}, kv heads {kv_heads}"
            )));
        }
        for key in ["expert_count", "expert_used_count"] {
            if opt_usize(c, &k(key))?.unwrap_or(0) > 0 {
                return Err(unsupported(format!(
                    "mixture of experts ({} is set): handoff runs dense models only",
                    k(key)
                )));
            }
        }
        let key_length = opt_usize(c, &k("attention.key_length"))?;
        let value_length = opt_usize(c, &k("attention.value_length"))?;
        let head_dim = match key_length {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(ModelError::Malformed(format!(
                    "hidden size {hidden} is not a multiple of {heads} heads and attention.key_length is missing"
                )))
            }
        };
        if head_dim == 0 || value_length.unwrap_or(head_dim) != head_dim {
            return Err(unsupported(format!(
                "key length {head_dim} and value length {} differ ({} / {}): the KV pool holds one head size",
                value_length.unwrap_or(head_dim),
                k("attention.key_length"),
                k("attention.value_length")
            )));
        }
        let vocab_size = match c.tensor_infos.get("token_embd.weight") {
            Some(t) => *t.shape.dims().first().unwrap_or(&0),
            None => {
                return Err(ModelError::Malformed(
                    "missing tensor token_embd.weight".into(),
                ))
            }
        };
        if let Some(v) = opt_usize(c, &k("vocab_size"))? {
            if v != vocab_size {
                return Err(ModelError::Malformed(format!(
                    "{} is {v} but token_embd.weight has {vocab_size} rows",
                    k("vocab_size")
                )));
            }
        }
        let rope_dims = opt_usize(c, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 || rope_dims == 0 {
            return Err(ModelError::Malformed(format!(
                "rope dimension count {rope_dims} must be even, non-zero and at most head_dim {head_dim}"
            )));
        }
        let layers = get_usize(c, &k("block_count"))?;
        let context_length = get_usize(c, &k("context_length"))?;
        let rope_scaling = rope_scaling(c, &arch_name, context_length)?;
        let rope_attn_factor = opt_f32(c, &k("rope.scaling.attn_factor"))?.unwrap_or(1.0);
        let (sliding_window, swa_layers) = sliding_window(c, &arch_name, arch, layers)?;
        let rope_theta = opt_f32(c, &k("rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_theta_swa = match arch {
            Arch::Gemma3 => opt_f32(c, &k("rope.freq_base_swa"))?.unwrap_or(10_000.0),
            _ => rope_theta,
        };
        let final_softcap = match opt_f32(c, &k("final_logit_softcapping"))? {
            Some(cap) if cap > 0.0 => Some(cap),
            _ => None,
        };
        let name = opt_string(c, "general.name")?;
        let (embed_scale, activation, default_eps) = match arch {
            Arch::Gemma3 => (Some((hidden as f32).sqrt()), Activation::GeluTanh, 1e-6),
            _ => (None, Activation::Silu, 1e-5),
        };
        let rms_eps = opt_f32(c, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(default_eps);
        Ok(Self {
            layers,
            hidden,
            ffn_hidden: get_usize(c, &k("feed_forward_length"))?,
            heads,
            kv_heads,
            head_dim,
            vocab_size,
            context_length,
            rms_eps,
            rope_theta,
            rope_theta_swa,
            rope_dims,
            rope_scaling,
            rope_attn_factor,
            sliding_window,
            swa_layers,
            // llama.cpp, after gemma_pytorch: Gemma 3 27B (62 layers) scales
            // queries by hidden / heads, the others by the head size.
            attn_scale: match arch {
                Arch::Gemma3 if layers == 62 => 1.0 / ((hidden / heads) as f32).sqrt(),
                _ => 1.0 / (head_dim as f32).sqrt(),
            },
            embed_scale,
            final_softcap,
            activation,
            sampling: sampling_defaults(c)?,
            architecture: arch_name,
            arch,
            name,
        })
    }
}

fn rope_scaling(c: &Content, arch: &str, ctx: usize) -> Result<RopeScaling, ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let factor = match opt_f32(c, &k("rope.scaling.factor"))? {
        Some(f) => Some(f),
        None => opt_f32(c, &k("rope.scale_linear"))?,
    };
    let kind = opt_string(c, &k("rope.scaling.type"))?;
    // llama.cpp's rule: no type means linear; a factor of 0 or none means 1.
    let factor = factor.filter(|&f| f != 0.0).unwrap_or(1.0);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::Malformed(format!(
            "{} is {factor}: it must be positive",
            k("rope.scaling.factor")
        )));
    }
    let yarn_keys = [
        "rope.scaling.yarn_ext_factor",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
    ];
    let scaling = match kind.as_deref().unwrap_or("linear") {
        "none" => RopeScaling::None,
        "linear" if factor == 1.0 => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => RopeScaling::Yarn {
            factor,
            original_context: opt_usize(c, &k("rope.scaling.original_context_length"))?
                .unwrap_or(ctx),
            ext_factor: opt_f32(c, &k(yarn_keys[0]))?.unwrap_or(1.0),
            beta_fast: opt_f32(c, &k(yarn_keys[1]))?.unwrap_or(32.0),
            beta_slow: opt_f32(c, &k(yarn_keys[2]))?.unwrap_or(1.0),
        },
        other => {
            return Err(unsupported(format!(
                "rope scaling type {other:?} ({}): handoff implements none, linear and yarn, and Llama 3's rope_freqs tensor",
                k("rope.scaling.type")
            )))
        }
    };
    if !matches!(scaling, RopeScaling::Yarn { .. }) {
        if let Some(key) = yarn_keys.iter().find(|s| get(c, &k(s)).is_some()) {
            return Err(unsupported(format!(
                "{} without rope.scaling.type yarn",
                k(key)
            )));
        }
    }
    Ok(scaling)
}

/// The window and which layers use it. Gemma 3: `attention.sliding_window`
/// with `sliding_window_pattern` N (default 6: every N-th layer is global,
/// the others slide) or a per-layer array of booleans, as llama.cpp reads
/// them. Llama/Mistral: every layer slides.
fn sliding_window(
    c: &Content,
    arch_name: &str,
    arch: Arch,
    layers: usize,
) -> Result<(Option<usize>, Vec<bool>), ModelError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let window = match opt_usize(c, &k("attention.sliding_window"))? {
        Some(w) if w > 0 => w,
        _ => {
            if get(c, &k("attention.sliding_window_pattern")).is_some() {
                return Err(unsupported(format!(
                    "{} without a sliding window",
                    k("attention.sliding_window_pattern")
                )));
            }
            return Ok((None, vec![false; layers]));
        }
    };
    let swa = match arch {
        Arch::Gemma3 => match get(c, &k("attention.sliding_window_pattern")) {
            Some(Value::Array(a)) => {
                if a.len() != layers {
                    return Err(ModelError::Malformed(format!(
                        "{} has {} entries for {layers} layers",
                        k("attention.sliding_window_pattern"),
                        a.len()
                    )));
                }
                a.iter()
                    .map(|v| match v {
                        Value::Bool(b) => Ok(*b),
                        other => Err(ModelError::Malformed(format!(
                            "{} holds {other:?}, not booleans",
                            k("attention.sliding_window_pattern")
                        ))),
                    })
                    .collect::<Result<Vec<bool>, _>>()?
            }
            Some(v) => {
                let n = count(&k("attention.sliding_window_pattern"), v)?;
                swa_pattern(n, layers)
            }
            None => swa_pattern(6, layers),
        },
        _ => vec![true; layers],
    };
    Ok((Some(window), swa))
}

/// llama.cpp's `set_swa_pattern(n)` (dense last): layer `il` slides when
/// `il % n < n - 1`; a pattern of 0 makes every layer slide.
fn swa_pattern(n: usize, layers: usize) -> Vec<bool> {
    (0..layers).map(|il| n == 0 || il % n < n - 1).collect()
}

fn sampling_defaults(c: &Content) -> Result<SamplingDefaults, ModelError> {
    let s = |key: &str| format!("general.sampling.{key}");
    let top_k = match opt_usize(c, &s("top_k"))? {
        Some(k) => Some(
            u32::try_from(k)
                .map_err(|_| ModelError::Malformed(format!("{} too large", s("top_k"))))?,
        ),
        None => None,
    };
    Ok(SamplingDefaults {
        temperature: opt_f32(c, &s("temp"))?,
        top_k,
        top_p: opt_f32(c, &s("top_p"))?,
        min_p: opt_f32(c, &s("min_p"))?,
        repetition_penalty: opt_f32(c, &s("penalty_repeat"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swa_pattern_matches_llamacpp() {
        // Gemma 3's default of 6: layers 5, 11, ... are global.
        let p = swa_pattern(6, 13);
        let global: Vec<usize> = (0..13).filter(|&i| !p[i]).collect();
        assert_eq!(global, vec![5, 11]);
        assert!(swa_pattern(0, 3).iter().all(|&b| b));
        assert!(swa_pattern(1, 3).iter().all(|&b| !b));
    }
}
