//! A Llama-family transformer over a paged KV pool: GGUF
//! weights, RMSNorm, RoPE with the GGUF's parameters, GQA, SwiGLU, K/V read
//! and written through [`KvPool`] pages.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::QTensor;
use candle_core::Device;
use handoff_kv::{KvDtype, KvGeometry, KvPool, PageIndex};

use crate::attention::{attend_decode, attend_prefill, AttnShape, SeqAttn};
use crate::config::{Activation, Arch, LlamaConfig, RopeScaling};
use crate::embedding::Embedding;
use crate::error::ModelError;
use crate::linear::{Linear, Phase, PhaseFormats, RawTensor, WeightFormat};
use crate::mapped::MappedFile;
use crate::native::WeightBytes;
use crate::ops::{
    add_assign, add_bias, gelu_mul, rms_norm, rms_norm_in_place, scale, silu_mul, softcap,
};
use crate::rope::{Rope, RopeMode, RopeParams};
use crate::weight_cache::{CacheFile, CacheOutcome, CachePaths, Q8Store};

pub(crate) struct Block {
    pub(crate) attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: one matmul per layer.
    pub(crate) wqkv: Linear,
    pub(crate) bq: Option<Vec<f32>>,
    pub(crate) bk: Option<Vec<f32>>,
    pub(crate) bv: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and K (Qwen 3, Gemma 3).
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) wo: Linear,
    /// RMSNorm of the attention output before the residual (Gemma 3).
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: one matmul per layer.
    pub(crate) w_gate_up: Linear,
    pub(crate) w_down: Linear,
    /// RMSNorm of the FFN output before the residual (Gemma 3).
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    /// A sliding-window layer.
    pub(crate) swa: bool,
}

impl Block {
    /// Bytes of the block's weights: every copy, or with `decode_only` the
    /// copies a decode step reads.
    fn mapped_bytes(&self) -> usize {
        [&self.wqkv, &self.wo, &self.w_gate_up, &self.w_down]
            .iter()
            .map(|l| l.mapped_bytes())
            .sum()
    }

    fn bytes(&self, decode_only: bool) -> usize {
        let vec = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        let matrices: usize = [&self.wqkv, &self.wo, &self.w_gate_up, &self.w_down]
            .iter()
            .map(|l| {
                if decode_only {
                    l.decode_bytes()
                } else {
                    l.bytes()
                }
            })
            .sum();
        let vectors: usize = [&self.bq, &self.bk, &self.bv, &self.q_norm, &self.k_norm]
            .into_iter()
            .chain([&self.post_attn_norm, &self.post_ffn_norm])
            .map(vec)
            .sum();
        matrices + vectors + (self.attn_norm.len() + self.ffn_norm.len()) * 4
    }
}

/// A loaded model, immutable and shareable across threads.
pub struct Llama {
    pub(crate) config: LlamaConfig,
    pub(crate) formats: PhaseFormats,
    pub(crate) embed: Embedding,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Linear,
    /// RoPE of the global layers.
    pub(crate) rope: Rope,
    /// RoPE of the sliding-window layers where it differs (Gemma 3).
    pub(crate) rope_swa: Option<Rope>,
}

/// Queries, keys and values of a block's rows (`[n][q_width]`,
/// `[n][kv_width]` twice).
pub(crate) type Qkv = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The new tokens of one sequence in a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Token ids to append.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence (tokens before it are already in the pool).
    pub start_pos: usize,
    /// The sequence's pages; must cover positions up to `start_pos + tokens.len()`.
    pub pages: &'a [PageIndex],
}

struct Loader<'a, R> {
    content: &'a Content,
    reader: &'a mut R,
    /// The file mapped read-only, when loading from a file: matrices in a
    /// `native` format are computed from it in place.
    map: Option<Arc<MappedFile>>,
    used: BTreeSet<String>,
    /// Where Q8_0 matrices come from (the weight cache, or converted here).
    store: Q8Store<'a>,
}

impl<R: std::io::Read + std::io::Seek> Loader<'_, R> {
    fn tensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(ModelError::Malformed(format!("missing tensor {name}")));
        }
        self.used.insert(name.to_string());
        self.content
            .tensor(self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::Malformed(format!("tensor {name}: {e}")))
    }

    /// A tensor's bytes as the file holds them: a range of the mapping, or
    /// read from the reader when there is none.
    fn raw(&mut self, name: &str, rows: usize, cols: usize) -> Result<RawTensor, ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Malformed(format!("missing tensor {name}")))?;
        let dims = info.shape.dims().to_vec();
        if dims != [rows, cols] {
            return Err(ModelError::Malformed(format!(
                "tensor {name} has shape {dims:?}, expected [{rows}, {cols}]"
            )));
        }
        self.used.insert(name.to_string());
        let dtype = info.ggml_dtype;
        let len = Some(cols)
            .filter(|c| c.is_multiple_of(dtype.block_size()))
            .and_then(|c| rows.checked_mul(c / dtype.block_size()))
            .and_then(|blocks| blocks.checked_mul(dtype.type_size()))
            .ok_or_else(|| {
                ModelError::Malformed(format!(
                    "tensor {name}: rows of {cols} are not whole {dtype:?} blocks"
                ))
            })?;
        let start = usize::try_from(self.content.tensor_data_offset + info.offset)
            .ok()
            .filter(|s| s.checked_add(len).is_some())
            .ok_or_else(|| ModelError::Malformed(format!("tensor {name}: offset out of range")))?;
        let data = match &self.map {
            Some(map) => {
                if start + len > map.bytes().len() {
                    return Err(ModelError::Malformed(format!(
                        "tensor {name}: bytes {start}..{} lie past the end of the file ({} bytes)",
                        start + len,
                        map.bytes().len()
                    )));
                }
                WeightBytes::Mapped(map.clone(), start..start + len)
            }
            None => {
                let mut buf = vec![0u8; len];
                self.reader
                    .seek(std::io::SeekFrom::Start(start as u64))
                    .and_then(|_| self.reader.read_exact(&mut buf))
                    .map_err(|e| ModelError::Malformed(format!("tensor {name}: {e}")))?;
                WeightBytes::Owned(Arc::new(buf))
            }
        };
        Ok(RawTensor {
            name: name.to_string(),
            dtype,
            rows,
            cols,
            data,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn optional_vector(&mut self, name: &str, len: usize) -> Result<Option<Vec<f32>>, ModelError> {
        if self.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.tensor(name)?.dequantize(&Device::Cpu)?;
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        if v.len() != len {
            return Err(ModelError::Malformed(format!(
                "tensor {name} has {} elements, expected {len}",
                v.len()
            )));
        }
        Ok(v)
    }

    fn linear(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        f: PhaseFormats,
    ) -> Result<Linear, ModelError> {
        let raw = self.raw(name, out, inp)?;
        Linear::from_parts_in(&[raw], f, &mut self.store)
    }

    /// Several `[out_i, inp]` matrices stacked into one `[sum out_i, inp]`.
    fn stacked(
        &mut self,
        parts: &[(String, usize)],
        inp: usize,
        f: PhaseFormats,
    ) -> Result<Linear, ModelError> {
        let mut tensors = Vec::with_capacity(parts.len());
        for (name, out) in parts {
            tensors.push(self.raw(name, *out, inp)?);
        }
        Linear::from_parts_in(&tensors, f, &mut self.store)
    }
}

/// A GGUF file opened, its header read and the whole file mapped.
fn open_gguf(path: &Path) -> Result<(std::fs::File, Content, Arc<MappedFile>), ModelError> {
    let p = path.display().to_string();
    let io = |source| ModelError::Io {
        path: p.clone(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let content = Content::read(&mut file).map_err(|e| ModelError::InvalidGguf {
        path: p.clone(),
        reason: e.to_string(),
    })?;
    let map = MappedFile::open(path).map_err(io)?;
    Ok((file, content, map))
}

impl Llama {
    /// Open and load a GGUF file.
    pub fn load(path: &Path, formats: PhaseFormats) -> Result<(Self, Content), ModelError> {
        crate::heap::keep_pass_buffers();
        let (mut file, content, map) = open_gguf(path)?;
        let (model, _) = Self::from_parts(&content, &mut file, Some(map), formats, Q8Store::Build)?;
        Ok((model, content))
    }

    /// [`Self::load`] with a Q8_0 weight cache in `cache_dir` (see
    /// `weight_cache`): the first process to load this file with these
    /// formats converts its matrices and writes them there, every later one
    /// (and this one, once written) maps them, so the processes of a host
    /// share one copy. A cache that cannot be used is reported in the
    /// outcome and the weights are this process's own, as without one.
    pub fn load_cached(
        path: &Path,
        formats: PhaseFormats,
        cache_dir: Option<&Path>,
    ) -> Result<(Self, Content, CacheOutcome), ModelError> {
        let Some(dir) = cache_dir else {
            let (m, c) = Self::load(path, formats)?;
            return Ok((m, c, CacheOutcome::Off));
        };
        crate::heap::keep_pass_buffers();
        let (mut file, content, mut map) = open_gguf(path)?;
        macro_rules! load {
            ($store:expr) => {
                Self::from_parts(&content, &mut file, Some(map.clone()), formats, $store)
            };
        }
        let unavailable =
            |e: std::io::Error| CacheOutcome::Unavailable(format!("{}: {e}", dir.display()));
        let header = usize::try_from(content.tensor_data_offset).unwrap_or(usize::MAX);
        let paths = match CachePaths::new(dir, path, &map, header, formats) {
            Ok(p) => p,
            Err(e) => return Ok((load!(Q8Store::Build)?.0, content, unavailable(e))),
        };
        // Held until this process has mapped the file (or given up): a
        // second process waits here rather than convert the same weights.
        let _lock = match paths.lock() {
            Ok(l) => l,
            Err(e) => return Ok((load!(Q8Store::Build)?.0, content, unavailable(e))),
        };
        if let Ok(cache) = CacheFile::open(&paths.file, &paths.key) {
            let (m, missing) = load!(Q8Store::Read {
                file: &cache,
                missing: 0,
            })?;
            if missing == 0 {
                return Ok((m, content, CacheOutcome::Hit(paths.file)));
            }
        }
        // Absent, stale or foreign: convert, write, then map what was written.
        let mut w = match paths.writer() {
            Ok(w) => w,
            Err(e) => return Ok((load!(Q8Store::Build)?.0, content, unavailable(e))),
        };
        let (m, _) = load!(Q8Store::Write(&mut w))?;
        if let Err(e) = paths.finish(w) {
            return Ok((m, content, unavailable(e)));
        }
        drop(m);
        crate::heap::trim();
        // A new mapping of the model file: the conversion read all of the
        // old one, whose pages would otherwise stay counted in this
        // process's resident memory for the life of the mapping.
        map = MappedFile::open(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let cache = CacheFile::open(&paths.file, &paths.key).map_err(|reason| {
            ModelError::Malformed(format!(
                "the weight cache just written at {}: {reason}",
                paths.file.display()
            ))
        })?;
        let (m, missing) = load!(Q8Store::Read {
            file: &cache,
            missing: 0,
        })?;
        debug_assert_eq!(missing, 0, "a matrix missing from the cache just written");
        Ok((m, content, CacheOutcome::Written(paths.file)))
    }

    /// Load from an already parsed GGUF header and its reader.
    pub fn from_content<R: std::io::Read + std::io::Seek>(
        content: &Content,
        reader: &mut R,
        formats: PhaseFormats,
    ) -> Result<Self, ModelError> {
        Self::from_parts(content, reader, None, formats, Q8Store::Build).map(|(m, _)| m)
    }

    fn from_parts<R: std::io::Read + std::io::Seek>(
        content: &Content,
        reader: &mut R,
        map: Option<Arc<MappedFile>>,
        formats: PhaseFormats,
        store: Q8Store<'_>,
    ) -> Result<(Self, usize), ModelError> {
        let config = LlamaConfig::from_gguf(content)?;
        check_tensor_names(&config, content)?;
        let mut ld = Loader {
            content,
            reader,
            map,
            used: BTreeSet::new(),
            store,
        };
        let (h, qw, kvw, d) = (
            config.hidden,
            config.q_width(),
            config.kv_width(),
            config.head_dim,
        );
        let embed_type = content
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.ggml_dtype)
            .ok_or_else(|| ModelError::Malformed("missing tensor token_embd.weight".into()))?;
        let embed = if Embedding::keeps_blocks(embed_type, h) {
            let raw = ld.raw("token_embd.weight", config.vocab_size, h)?;
            Embedding::from_raw(&raw, config.vocab_size, h)?
        } else {
            Embedding::new(&ld.tensor("token_embd.weight")?, config.vocab_size, h)?
        };
        // The output matrix runs once per sequence per step: it uses the decode
        // format in both phases (a Q8_0 tensor stays as it is under `q8_0`).
        let head_name = if ld.has("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let head = ld.raw(head_name, config.vocab_size, h)?;
        let lm_head = Linear::small_batch_from_in(&head, formats.decode, &mut ld.store)?;
        let gemma = config.arch == Arch::Gemma3;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let qk_norms = config.arch.has_qk_norms();
            let head_norm =
                |ld: &mut Loader<'_, R>, s: &str| -> Result<Option<Vec<f32>>, ModelError> {
                    if qk_norms {
                        ld.vector(&n(s), d).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            let post_norm =
                |ld: &mut Loader<'_, R>, s: &str| -> Result<Option<Vec<f32>>, ModelError> {
                    if config.arch.has_post_norms() {
                        ld.vector(&n(s), h).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            blocks.push(Block {
                attn_norm: ld.vector(&n("attn_norm.weight"), h)?,
                wqkv: ld.stacked(
                    &[
                        (n("attn_q.weight"), qw),
                        (n("attn_k.weight"), kvw),
                        (n("attn_v.weight"), kvw),
                    ],
                    h,
                    formats,
                )?,
                bq: ld.optional_vector(&n("attn_q.bias"), qw)?,
                bk: ld.optional_vector(&n("attn_k.bias"), kvw)?,
                bv: ld.optional_vector(&n("attn_v.bias"), kvw)?,
                q_norm: head_norm(&mut ld, "attn_q_norm.weight")?,
                k_norm: head_norm(&mut ld, "attn_k_norm.weight")?,
                wo: ld.linear(&n("attn_output.weight"), h, qw, formats)?,
                post_attn_norm: post_norm(&mut ld, "post_attention_norm.weight")?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), h)?,
                w_gate_up: ld.stacked(
                    &[
                        (n("ffn_gate.weight"), config.ffn_hidden),
                        (n("ffn_up.weight"), config.ffn_hidden),
                    ],
                    h,
                    formats,
                )?,
                w_down: ld.linear(&n("ffn_down.weight"), h, config.ffn_hidden, formats)?,
                post_ffn_norm: post_norm(&mut ld, "post_ffw_norm.weight")?,
                swa: config.swa_layers[i],
            });
        }
        let norm = ld.vector("output_norm.weight", h)?;
        // Llama 3's rope scaling: one divisor per rotated pair.
        let freq_factors = if config.arch == Arch::Llama && ld.has(ROPE_FREQS) {
            let f = ld.vector(ROPE_FREQS, config.rope_dims / 2)?;
            if f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(ModelError::Malformed(format!(
                    "{ROPE_FREQS} holds a value that is not a positive number"
                )));
            }
            Some(f)
        } else {
            None
        };
        // Every tensor of the file is used, or the load failed above.
        debug_assert_eq!(
            ld.used,
            content
                .tensor_infos
                .keys()
                .cloned()
                .collect::<BTreeSet<_>>()
        );
        let mode = match config.arch {
            Arch::Llama => RopeMode::Interleaved,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeMode::Halves,
        };
        let params = RopeParams {
            mode,
            dims: config.rope_dims,
            theta: config.rope_theta,
            scaling: config.rope_scaling,
            freq_factors,
            attn_factor: config.rope_attn_factor,
        };
        let rope = Rope::new(&params, config.context_length);
        // Gemma 3's sliding-window layers: their own base, never scaled.
        let rope_swa = (gemma && config.sliding_window.is_some()).then(|| {
            let swa = RopeParams {
                theta: config.rope_theta_swa,
                scaling: RopeScaling::None,
                freq_factors: None,
                ..params
            };
            Rope::new(&swa, config.context_length)
        });
        let missing = match ld.store {
            Q8Store::Read { missing, .. } => missing,
            _ => 0,
        };
        let model = Self {
            config,
            formats,
            embed,
            blocks,
            norm,
            lm_head,
            rope,
            rope_swa,
        };
        Ok((model, missing))
    }

    /// Bytes of weights the model reads: the matrices in their phase
    /// formats, the embedding table, the norms and the RoPE tables. Its own
    /// copy but for [`Self::mapped_weight_bytes`].
    pub fn weight_bytes(&self) -> usize {
        let blocks: usize = self.blocks.iter().map(|b| b.bytes(false)).sum();
        let rope = self.rope.bytes() + self.rope_swa.as_ref().map_or(0, Rope::bytes);
        self.embed.bytes() + self.norm.len() * 4 + self.lm_head.bytes() + blocks + rope
    }

    /// Of [`Self::weight_bytes`], those read in place from the mapped GGUF
    /// (the `native` format): one copy per host in the page cache, shared
    /// by every worker mapping the file, not this process's own.
    pub fn mapped_weight_bytes(&self) -> usize {
        let blocks: usize = self.blocks.iter().map(Block::mapped_bytes).sum();
        blocks + self.lm_head.mapped_bytes() + self.embed.mapped_bytes()
    }

    /// Bytes of weights one decode step at batch 1 reads: every matrix's
    /// decode copy, the norms and the LM head, one embedding row (not the
    /// table), no RoPE table.
    pub fn decode_weight_bytes(&self) -> usize {
        let blocks: usize = self.blocks.iter().map(|b| b.bytes(true)).sum();
        let row = self.embed.bytes() / self.config.vocab_size.max(1);
        blocks + self.lm_head.decode_bytes() + self.norm.len() * 4 + row
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Weight formats in use per phase.
    pub fn formats(&self) -> PhaseFormats {
        self.formats
    }

    /// Whether a prefill forward computes every token's row on its own:
    /// every matrix runs handoff's row-invariant kernel (`q8_0-rows`; a
    /// float tensor of the GGUF stays a dense GEMM). Then a sequence's
    /// results are the same bits whatever other rows, of its own prompt
    /// or of other sequences, share the pass (the norms, RoPE and
    /// attention are per row or per sequence already).
    pub fn prefill_rows_independent(&self) -> bool {
        self.lm_head.prefill_rows_independent()
            && self.blocks.iter().all(|b| {
                [&b.wqkv, &b.wo, &b.w_gate_up, &b.w_down]
                    .iter()
                    .all(|l| l.prefill_rows_independent())
            })
    }

    /// The KV geometry this model needs for a page size and element type.
    pub fn kv_geometry(&self, page_size: usize, dtype: KvDtype) -> KvGeometry {
        self.config.kv_geometry(page_size, dtype)
    }

    /// Attention shape of block `b`.
    pub(crate) fn attn_shape(&self, b: &Block) -> AttnShape {
        AttnShape {
            heads: self.config.heads,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
            scale: self.config.attn_scale,
            window: if b.swa {
                self.config.sliding_window
            } else {
                None
            },
        }
    }

    /// The RoPE tables of block `b`.
    pub(crate) fn rope_of(&self, b: &Block) -> &Rope {
        match (&self.rope_swa, b.swa) {
            (Some(r), true) => r,
            _ => &self.rope,
        }
    }

    /// The token embeddings of `tokens` (`[n][hidden]`), scaled where the
    /// architecture scales them.
    pub(crate) fn embed_tokens<'t>(&self, tokens: impl Iterator<Item = &'t u32>) -> Vec<f32> {
        let mut hidden = Vec::with_capacity(tokens.size_hint().0 * self.config.hidden);
        for &t in tokens {
            self.embed.push_row(t as usize, &mut hidden);
        }
        if let Some(s) = self.config.embed_scale {
            scale(&mut hidden, s);
        }
        hidden
    }

    /// Block `b`'s queries, keys and values of `n` rows of `hidden`
    /// (biases and per-head norms applied, RoPE not yet).
    pub(crate) fn qkv(
        &self,
        b: &Block,
        hidden: &[f32],
        n: usize,
        phase: Phase,
    ) -> Result<Qkv, ModelError> {
        let cfg = &self.config;
        let xn = rms_norm(hidden, &b.attn_norm, cfg.rms_eps);
        let (mut q, mut k, mut v) = split_qkv(
            &b.wqkv.forward(&xn, n, phase)?,
            cfg.q_width(),
            cfg.kv_width(),
        );
        for (x, bias) in [(&mut q, &b.bq), (&mut k, &b.bk), (&mut v, &b.bv)] {
            if let Some(bias) = bias {
                add_bias(x, bias);
            }
        }
        for (x, norm) in [(&mut q, &b.q_norm), (&mut k, &b.k_norm)] {
            if let Some(w) = norm {
                // One head is a row of `head_dim` elements.
                rms_norm_in_place(x, w, cfg.rms_eps);
            }
        }
        Ok((q, k, v))
    }

    /// The rest of block `b` after attention: output projection, the
    /// residual, the FFN and its residual, applied to `hidden` in place.
    pub(crate) fn finish_block(
        &self,
        b: &Block,
        hidden: &mut [f32],
        attn: &[f32],
        n: usize,
        phase: Phase,
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        let mut o = b.wo.forward(attn, n, phase)?;
        if let Some(w) = &b.post_attn_norm {
            rms_norm_in_place(&mut o, w, cfg.rms_eps);
        }
        add_assign(hidden, &o);
        let xn = rms_norm(hidden, &b.ffn_norm, cfg.rms_eps);
        let gate_up = b.w_gate_up.forward(&xn, n, phase)?;
        let act = glu_stacked(&gate_up, cfg.ffn_hidden, cfg.activation);
        let mut down = b.w_down.forward(&act, n, phase)?;
        if let Some(w) = &b.post_ffn_norm {
            rms_norm_in_place(&mut down, w, cfg.rms_eps);
        }
        add_assign(hidden, &down);
        Ok(())
    }

    /// Logits of `rows` final hidden states.
    pub(crate) fn logits(
        &self,
        hidden: &[f32],
        rows: usize,
        phase: Phase,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let last = rms_norm(hidden, &self.norm, self.config.rms_eps);
        let mut logits = self.lm_head.forward(&last, rows, phase)?;
        if let Some(c) = self.config.final_softcap {
            softcap(&mut logits, c);
        }
        let vocab = self.lm_head.out_dim();
        Ok(logits.chunks_exact(vocab).map(|c| c.to_vec()).collect())
    }

    /// Run the new tokens of each sequence through the model, writing their
    /// K/V into the pool, and return the logits of each sequence's last new
    /// token (`[vocab]` per sequence). With `Phase::Decode` every chunk must
    /// hold exactly one token.
    pub fn forward(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqChunk<'_>],
        phase: Phase,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_observed(pool, seqs, phase, &mut |_| {})
    }

    /// [`Self::forward`], calling `kv_written(layer)` as soon as that
    /// layer's K/V of every new token is in the pool (before the layer's
    /// attention and the later layers): a prefill worker streams those
    /// pages to decode while the rest of the forward computes.
    pub fn forward_observed(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqChunk<'_>],
        phase: Phase,
        kv_written: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_rows(pool, seqs, phase, kv_written, false)
    }

    /// [`Self::forward_observed`]; with `every_row`, the logits of every
    /// new token of every sequence (`[vocab]` per token, in order) rather
    /// than each sequence's last: prompt log-probabilities. The LM head is
    /// row-independent, so a sequence's last row gets the same bits either
    /// way.
    pub fn forward_rows(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqChunk<'_>],
        phase: Phase,
        kv_written: &mut dyn FnMut(usize),
        every_row: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let (qw, kvw) = (cfg.q_width(), cfg.kv_width());
        let pg = *pool.geometry();
        let page_size = pg.page_size;
        if pg != self.kv_geometry(page_size, pg.dtype) {
            return Err(ModelError::Forward(
                "KV pool geometry does not match the model".into(),
            ));
        }
        let mut total = 0;
        for s in seqs {
            let end = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(ModelError::Forward("empty chunk".into()));
            }
            if phase == Phase::Decode && s.tokens.len() != 1 {
                return Err(ModelError::Forward(
                    "decode chunks hold exactly one token".into(),
                ));
            }
            if end > self.rope.max_pos() {
                return Err(ModelError::Forward(format!(
                    "position {end} exceeds the context length {}",
                    self.rope.max_pos()
                )));
            }
            if s.pages.len() * page_size < end {
                return Err(ModelError::Forward(format!(
                    "{} pages cannot hold {end} tokens",
                    s.pages.len()
                )));
            }
            for &p in s.pages {
                pool.layout().check_page(p)?;
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::Forward(format!("token id {bad} out of range")));
            }
            total += s.tokens.len();
        }
        if total == 0 {
            return Ok(Vec::new());
        }
        let mut hidden = self.embed_tokens(seqs.iter().flat_map(|s| s.tokens.iter()));
        for (layer, b) in self.blocks.iter().enumerate() {
            let (mut q, mut k, v) = self.qkv(b, &hidden, total, phase)?;
            let rope = self.rope_of(b);
            let mut row = 0;
            for s in seqs {
                for i in 0..s.tokens.len() {
                    let pos = s.start_pos + i;
                    let r = row + i;
                    rope.apply(&mut q[r * qw..(r + 1) * qw], d, pos);
                    rope.apply(&mut k[r * kvw..(r + 1) * kvw], d, pos);
                    pool.write_token(
                        layer,
                        s.pages,
                        pos,
                        &k[r * kvw..(r + 1) * kvw],
                        &v[r * kvw..(r + 1) * kvw],
                    )?;
                }
                row += s.tokens.len();
            }
            kv_written(layer);
            let shape = self.attn_shape(b);
            let attn = match phase {
                Phase::Decode => {
                    let sa: Vec<SeqAttn<'_>> = seqs
                        .iter()
                        .map(|s| SeqAttn {
                            pages: s.pages,
                            start: s.start_pos,
                            n: 1,
                        })
                        .collect();
                    attend_decode(pool, layer, &sa, &q, shape)
                }
                Phase::Prefill => {
                    let mut out = Vec::with_capacity(total * qw);
                    let mut row = 0;
                    for s in seqs {
                        let n = s.tokens.len();
                        let sa = SeqAttn {
                            pages: s.pages,
                            start: s.start_pos,
                            n,
                        };
                        out.extend(attend_prefill(
                            pool,
                            layer,
                            &sa,
                            &q[row * qw..(row + n) * qw],
                            shape,
                        )?);
                        row += n;
                    }
                    out
                }
            };
            self.finish_block(b, &mut hidden, &attn, total, phase)?;
        }
        let (last, rows) = if every_row {
            (hidden, total)
        } else {
            let mut last = Vec::with_capacity(seqs.len() * h);
            let mut row = 0;
            for s in seqs {
                row += s.tokens.len();
                last.extend_from_slice(&hidden[(row - 1) * h..row * h]);
            }
            (last, seqs.len())
        };
        self.logits(&last, rows, phase)
    }
}

/// Name of Llama 3's rope frequency factors tensor.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// The tensors a model of `cfg` reads from `c`: the required ones, and the
/// optional ones the file has. Anything else in the file is refused by
/// [`check_tensor_names`].
pub(crate) fn expected_tensors(cfg: &LlamaConfig, c: &Content) -> BTreeSet<String> {
    let has = |n: &str| c.tensor_infos.contains_key(n);
    let mut names: BTreeSet<String> = ["token_embd.weight", "output_norm.weight"]
        .into_iter()
        .map(String::from)
        .collect();
    let mut optional = vec!["output.weight".to_string()];
    if cfg.arch == Arch::Llama {
        optional.push(ROPE_FREQS.into());
    }
    for i in 0..cfg.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        for s in [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        ] {
            names.insert(n(s));
        }
        if cfg.arch.has_qk_norms() {
            names.insert(n("attn_q_norm.weight"));
            names.insert(n("attn_k_norm.weight"));
        }
        if cfg.arch.has_post_norms() {
            names.insert(n("post_attention_norm.weight"));
            names.insert(n("post_ffw_norm.weight"));
        }
        for s in ["attn_q.bias", "attn_k.bias", "attn_v.bias"] {
            optional.push(n(s));
        }
    }
    names.extend(optional.into_iter().filter(|n| has(n)));
    names
}

/// Refuse a file with a tensor this implementation would not use: it was
/// put there to change the output, and ignoring it would serve other
/// logits than the model's authors trained (a Llama 3 file whose
/// `rope_freqs.weight` is dropped answers differently, with no error).
pub fn check_tensor_names(cfg: &LlamaConfig, c: &Content) -> Result<(), ModelError> {
    let expected = expected_tensors(cfg, c);
    let mut extra: Vec<&String> = c
        .tensor_infos
        .keys()
        .filter(|n| !expected.contains(*n))
        .collect();
    if extra.is_empty() {
        return Ok(());
    }
    extra.sort();
    let shown: Vec<&str> = extra.iter().take(5).map(|s| s.as_str()).collect();
    let more = match extra.len() {
        n if n > 5 => format!(" and {} more", n - 5),
        _ => String::new(),
    };
    Err(ModelError::Unsupported(format!(
        "tensor {}{more} is not used by handoff's {} implementation",
        shown.join(", "),
        cfg.architecture
    )))
}

/// About how many bytes of weights a model takes, from its header alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightEstimate {
    /// Held by each process that loads it.
    pub private: u64,
    /// Read in place from the mapped file (`native`): one copy per host, in
    /// the page cache, however many workers map it.
    pub mapped: u64,
}

/// Whether tensor `name` is a part of a stack (`blk.N.attn_{q,k,v}`,
/// `blk.N.ffn_{gate,up}`) that `repacked` keeps as parts
/// (`linear::kept_as_parts`, as `Linear::from_parts` decides).
fn mixed_stack(c: &Content, name: &str, formats: PhaseFormats) -> bool {
    let Some((layer, part)) = name.rsplit_once('.').and_then(|(s, _)| s.rsplit_once('.')) else {
        return false;
    };
    let siblings: &[&str] = match part {
        "attn_q" | "attn_k" | "attn_v" => &["attn_q", "attn_k", "attn_v"],
        "ffn_gate" | "ffn_up" => &["ffn_gate", "ffn_up"],
        _ => return false,
    };
    let infos: Vec<_> = siblings
        .iter()
        .filter_map(|s| c.tensor_infos.get(&format!("{layer}.{s}.weight")))
        .collect();
    crate::linear::kept_as_parts(
        infos.iter().map(|t| {
            let cols = t.shape.dims().last().copied().unwrap_or(0);
            (t.ggml_dtype, cols)
        }),
        formats,
    )
}

/// About how many bytes of weights a process holds after [`Llama::load`]
/// of this file with `formats`, from its header alone: a quantized matrix
/// with a native kernel, in a phase whose format is `native`, read in place
/// (`mapped`, the file's bytes); a Q4_K matrix in a `repacked` phase, and a
/// Q6_K one in a `repacked` decode or LM head, as its repacked copy
/// (`kquant`: 1184 and 1680 bytes per 8 × 256 weights); otherwise one Q8_0
/// copy (34 bytes per 32 weights) shared by the phases that need one; float ones as f32; the
/// embedding table read in place if its rows are whole blocks of a native
/// type, else f32 (a tied LM head is a matrix like the others); the RoPE
/// tables. Within a few percent of
/// [`Llama::weight_bytes`] and [`Llama::mapped_weight_bytes`].
///
/// `cached`: the Q8_0 copies are mapped from a weight cache file
/// ([`Llama::load_cached`]), so they count as mapped too.
pub fn estimate_weights(
    cfg: &LlamaConfig,
    c: &Content,
    formats: PhaseFormats,
    cached: bool,
) -> WeightEstimate {
    use crate::q8_matmul::{BLOCK_BYTES, QK};
    use candle_core::quantized::GgmlDType;
    // As `Q8Matrix` stores them: 32 quants and an f16 scale per block.
    let q8 = |n: u64| n * BLOCK_BYTES as u64 / QK as u64;
    let mut est = WeightEstimate::default();
    // Bytes of converted copies (Q8_0, repacked K-quants), apart: mapped when
    // cached.
    let mut q8_bytes = 0u64;
    // Where a phase in format `f` computes a matrix from: the file
    // (`native`), a repacked Q4_K copy, or a Q8_0 copy.
    #[derive(PartialEq)]
    enum Held {
        File,
        Repacked,
        Q8,
    }
    // `one`: the matrix is built once for both phases with few rows (the LM
    // head: `Linear::small_batch_from`) or with many (a part of a mixed
    // `repacked` stack: `Linear::from_parts`).
    let matrix = |est: &mut WeightEstimate,
                  q8_bytes: &mut u64,
                  dtype: GgmlDType,
                  n: u64,
                  cols,
                  one: Option<bool>| {
        let native = crate::native::BlockType::of(dtype).is_some();
        let copy = |f: WeightFormat, small_batch| match f {
            WeightFormat::Native if native => Held::File,
            WeightFormat::Repacked if crate::linear::repacked_in(dtype, cols, small_batch) => {
                Held::Repacked
            }
            _ => Held::Q8,
        };
        let (pre, dec) = match one {
            Some(small) => (copy(formats.decode, small), copy(formats.decode, small)),
            None => (copy(formats.prefill, false), copy(formats.decode, true)),
        };
        if pre == Held::File || dec == Held::File {
            est.mapped += n / dtype.block_size() as u64 * dtype.type_size() as u64;
        }
        let bytes = |c: &Held| match c {
            Held::File => 0,
            Held::Repacked if dtype == GgmlDType::Q6K => {
                (n as f64 * crate::kquant::Q6kMatrix::bytes_per_weight()) as u64
            }
            Held::Repacked => (n as f64 * crate::kquant::Q4kMatrix::bytes_per_weight()) as u64,
            Held::Q8 => q8(n),
        };
        // One copy when both phases compute from the same one.
        *q8_bytes += bytes(&pre) + if dec == pre { 0 } else { bytes(&dec) };
    };
    for (name, t) in &c.tensor_infos {
        let n = t.shape.elem_count() as u64;
        let float = matches!(
            t.ggml_dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        );
        if name == "token_embd.weight" {
            // Read in place when its rows are whole blocks of a native type.
            let hidden = t.shape.dims().last().copied().unwrap_or(0);
            if crate::embedding::Embedding::keeps_blocks(t.ggml_dtype, hidden) {
                est.mapped +=
                    n / t.ggml_dtype.block_size() as u64 * t.ggml_dtype.type_size() as u64;
            } else {
                est.private += n * 4;
            }
            if !c.tensor_infos.contains_key("output.weight") {
                if float {
                    q8_bytes += q8(n);
                } else {
                    matrix(&mut est, &mut q8_bytes, t.ggml_dtype, n, hidden, Some(true));
                }
            }
        } else if float || t.shape.rank() < 2 {
            est.private += n * 4;
        } else {
            let cols = t.shape.dims().last().copied().unwrap_or(0);
            let one = if name == "output.weight" {
                Some(true)
            } else {
                mixed_stack(c, name, formats).then_some(false)
            };
            matrix(&mut est, &mut q8_bytes, t.ggml_dtype, n, cols, one);
        }
    }
    if cached {
        est.mapped += q8_bytes;
    } else {
        est.private += q8_bytes;
    }
    let tables = if cfg.sliding_window.is_some() && cfg.arch == Arch::Gemma3 {
        2
    } else {
        1
    };
    est.private += tables * (cfg.context_length * cfg.rope_dims * 4) as u64;
    est
}

/// Check a GGUF header without loading any weight: its architecture, its
/// metadata keys and its tensor names, as [`Llama::load`] would.
pub fn check_gguf(c: &Content) -> Result<LlamaConfig, ModelError> {
    let cfg = LlamaConfig::from_gguf(c)?;
    check_tensor_names(&cfg, c)?;
    Ok(cfg)
}

/// Split rows of `[n, h + 2*kvw]` into Q `[n, h]`, K and V `[n, kvw]`.
pub(crate) fn split_qkv(qkv: &[f32], h: usize, kvw: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let w = h + 2 * kvw;
    let n = qkv.len() / w;
    let (mut q, mut k, mut v) = (
        Vec::with_capacity(n * h),
        Vec::with_capacity(n * kvw),
        Vec::with_capacity(n * kvw),
    );
    for row in qkv.chunks_exact(w) {
        q.extend_from_slice(&row[..h]);
        k.extend_from_slice(&row[h..h + kvw]);
        v.extend_from_slice(&row[h + kvw..]);
    }
    (q, k, v)
}

/// `act(gate) * up` for rows of `[n, 2*ffn]` holding gate then up.
pub(crate) fn glu_stacked(gate_up: &[f32], ffn: usize, act: Activation) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0f32; gate_up.len() / 2];
    // One row per task: `exp` dominates, and at batch 8 the rows are worth
    // spreading over the compute threads.
    out.par_chunks_mut(ffn)
        .zip(gate_up.par_chunks_exact(2 * ffn))
        .for_each(|(o, row)| {
            let (g, u) = row.split_at(ffn);
            o.copy_from_slice(&match act {
                Activation::Silu => silu_mul(g, u),
                Activation::GeluTanh => gelu_mul(g, u),
            })
        });
    out
}
