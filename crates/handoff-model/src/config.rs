//! Model hyper-parameters read from GGUF metadata (DESIGN.md §6).

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::ModelError;

/// Architectures whose GGUF tensors follow the Llama naming and math.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "mistral"];

/// Hyper-parameters of a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`.
    pub architecture: String,
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
    /// Elements per head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Dimensions rotated by RoPE (usually `head_dim`).
    pub rope_dims: usize,
}

fn get<'a>(c: &'a Content, key: &str) -> Option<&'a Value> {
    c.metadata.get(key)
}

fn get_usize(c: &Content, key: &str) -> Result<usize, ModelError> {
    let v =
        get(c, key).ok_or_else(|| ModelError::Malformed(format!("missing metadata key {key}")))?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
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

fn get_f32(c: &Content, key: &str) -> Option<f32> {
    match get(c, key)? {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        _ => None,
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

    /// Read the hyper-parameters, rejecting unsupported architectures by name.
    pub fn from_gguf(c: &Content) -> Result<Self, ModelError> {
        let arch = match get(c, "general.architecture") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(ModelError::Malformed("missing general.architecture".into())),
        };
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArchitecture(arch));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = get_usize(c, &k("embedding_length"))?;
        let heads = get_usize(c, &k("attention.head_count"))?;
        let kv_heads = match get(c, &k("attention.head_count_kv")) {
            Some(_) => get_usize(c, &k("attention.head_count_kv"))?,
            None => heads,
        };
        if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
            return Err(ModelError::Malformed(format!(
                "inconsistent heads: hidden {hidden}, heads {heads}, kv heads {kv_heads}"
            )));
        }
        let head_dim = hidden / heads;
        let vocab_size = match c.tensor_infos.get("token_embd.weight") {
            Some(t) => *t.shape.dims().first().unwrap_or(&0),
            None => {
                return Err(ModelError::Malformed(
                    "missing tensor token_embd.weight".into(),
                ))
            }
        };
        let rope_dims = match get(c, &k("rope.dimension_count")) {
            Some(_) => get_usize(c, &k("rope.dimension_count"))?,
            None => head_dim,
        };
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::Malformed(format!(
                "rope dimension count {rope_dims} must be even and at most head_dim {head_dim}"
            )));
        }
        let name = match get(c, "general.name") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(Self {
            layers: get_usize(c, &k("block_count"))?,
            hidden,
            ffn_hidden: get_usize(c, &k("feed_forward_length"))?,
            heads,
            kv_heads,
            head_dim,
            vocab_size,
            context_length: get_usize(c, &k("context_length"))?,
            rms_eps: get_f32(c, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope_theta: get_f32(c, &k("rope.freq_base")).unwrap_or(10_000.0),
            rope_dims,
            architecture: arch,
            name,
        })
    }
}
