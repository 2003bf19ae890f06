//! A tiny Llama model with seeded random weights, written as a real GGUF file
//! (tests that must not download use it), and its tiny
//! vocabulary. Same tensor names, quantization types and tokenizer kind as
//! SmolLM2, only smaller. A test fixture: compiled only with the `testing`
//! feature (and in this crate's unit tests), which no product build turns on.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::error::ModelError;

/// Shape of the tiny model.
#[derive(Debug, Clone, Copy)]
pub struct TinyConfig {
    /// Blocks.
    pub layers: usize,
    /// Hidden size (multiple of 32).
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// FFN inner size (multiple of 32).
    pub ffn_hidden: usize,
    /// Context length.
    pub context_length: usize,
}

impl Default for TinyConfig {
    fn default() -> Self {
        Self {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn_hidden: 128,
            context_length: 1024,
        }
    }
}

fn random(rng: &mut rand::rngs::StdRng, shape: &[usize], scale: f32) -> Result<Tensor, ModelError> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Write a tiny seeded-random Llama GGUF (linears Q4_1, embedding Q8_0,
/// norms F32, separate Q8_0 output matrix) with the tiny byte-level vocabulary.
pub fn write_tiny_gguf(path: &Path, seed: u64) -> Result<(), ModelError> {
    write_tiny_gguf_with(path, seed, TinyConfig::default())
}

/// [`write_tiny_gguf`] with a chosen shape.
pub fn write_tiny_gguf_with(path: &Path, seed: u64, cfg: TinyConfig) -> Result<(), ModelError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vocab_meta = tiny_vocab_metadata();
    let vocab = match vocab_meta.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => t.len(),
        _ => {
            return Err(ModelError::Malformed(
                "tiny vocabulary has no tokens".into(),
            ))
        }
    };
    let head_dim = cfg.hidden / cfg.heads;
    let kvw = cfg.kv_heads * head_dim;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let q = |t: Tensor, dt: GgmlDType| QTensor::quantize(&t, dt).map_err(ModelError::from);
    tensors.push((
        "token_embd.weight".into(),
        q(
            random(&mut rng, &[vocab, cfg.hidden], 1.0)?,
            GgmlDType::Q8_0,
        )?,
    ));
    let lin =
        |rng: &mut rand::rngs::StdRng, out: usize, inp: usize| -> Result<QTensor, ModelError> {
            q(
                random(rng, &[out, inp], 1.5 / (inp as f32).sqrt())?,
                GgmlDType::Q4_1,
            )
        };
    let norm = |rng: &mut rand::rngs::StdRng, n: usize| -> Result<QTensor, ModelError> {
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(0.8f32..1.2)).collect();
        q(Tensor::from_vec(v, n, &Device::Cpu)?, GgmlDType::F32)
    };
    for i in 0..cfg.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        tensors.push((n("attn_norm.weight"), norm(&mut rng, cfg.hidden)?));
        tensors.push((n("attn_q.weight"), lin(&mut rng, cfg.hidden, cfg.hidden)?));
        tensors.push((n("attn_k.weight"), lin(&mut rng, kvw, cfg.hidden)?));
        tensors.push((n("attn_v.weight"), lin(&mut rng, kvw, cfg.hidden)?));
        tensors.push((
            n("attn_output.weight"),
            lin(&mut rng, cfg.hidden, cfg.hidden)?,
        ));
        tensors.push((n("ffn_norm.weight"), norm(&mut rng, cfg.hidden)?));
        tensors.push((
            n("ffn_gate.weight"),
            lin(&mut rng, cfg.ffn_hidden, cfg.hidden)?,
        ));
        tensors.push((
            n("ffn_up.weight"),
            lin(&mut rng, cfg.ffn_hidden, cfg.hidden)?,
        ));
        tensors.push((
            n("ffn_down.weight"),
            lin(&mut rng, cfg.hidden, cfg.ffn_hidden)?,
        ));
    }
    tensors.push(("output_norm.weight".into(), norm(&mut rng, cfg.hidden)?));
    // An untied output matrix: with tied embeddings a random model mostly
    // repeats its input token, which makes a poor test of sampling.
    tensors.push((
        "output.weight".into(),
        q(
            random(&mut rng, &[vocab, cfg.hidden], 0.5)?,
            GgmlDType::Q8_0,
        )?,
    ));

    let u = |x: usize| Value::U32(x as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String(format!("handoff-tiny-{seed}")),
        ),
        ("llama.block_count".into(), u(cfg.layers)),
        ("llama.context_length".into(), u(cfg.context_length)),
        ("llama.embedding_length".into(), u(cfg.hidden)),
        ("llama.feed_forward_length".into(), u(cfg.ffn_hidden)),
        ("llama.attention.head_count".into(), u(cfg.heads)),
        ("llama.attention.head_count_kv".into(), u(cfg.kv_heads)),
        ("llama.rope.freq_base".into(), Value::F32(10_000.0)),
        ("llama.rope.dimension_count".into(), u(head_dim)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.vocab_size".into(), u(vocab)),
    ];
    let mut vm: Vec<_> = vocab_meta.into_iter().collect();
    vm.sort_by(|a, b| a.0.cmp(&b.0));
    meta.extend(vm);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    Ok(())
}

/// The tiny byte-level vocabulary (every byte a token, a few merges, the
/// three ChatML control tokens, SmolLM2's chat template), as GGUF metadata:
/// the one `handoff-testmodels` writes into every test model.
pub fn tiny_vocab_metadata() -> HashMap<String, Value> {
    handoff_testmodels::tiny_vocab_metadata()
}
