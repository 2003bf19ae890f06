//! A tiny Llama model with seeded random weights, written as a real GGUF file
//! (DESIGN.md §6: tests that must not download use it), and its tiny
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

/// The tiny test vocabulary: `tokenizer.*` GGUF metadata for a byte-level BPE
/// with the control tokens `<|endoftext|>` (0), `<|im_start|>` (1, BOS) and
/// `<|im_end|>` (2, EOS), the 256 byte symbols (ids 3..259, id = 3 + byte) and
/// a few English merges, plus SmolLM2's chat template. Lets tests build a
/// tokenizer (and a tiny model) without any download.
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
    for c in crate::tokenizer::byte_to_unicode() {
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
    m.insert(
        "tokenizer.chat_template".into(),
        s(crate::chat_template::SMOLLM2_TEMPLATE),
    );
    m
}
