//! `handoff serve`: load the model, start the engine and the HTTP API, stop
//! gracefully on SIGTERM / ctrl-c.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::Args;
use handoff_engine::{Engine, EngineConfig};
use handoff_model::{PhaseFormats, WeightFormat};

/// The default model, relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Flags of `handoff serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf,
    /// fetched with scripts/fetch-model.sh if missing]
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    port: u16,
    /// Compute threads of the engine.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) threads: u16,
    /// KV page size in tokens.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    page_size: u32,
    /// Number of KV pages in the pool [default: 2048].
    #[arg(long, conflicts_with = "kv_memory_mb", value_parser = clap::value_parser!(u64).range(1..))]
    kv_pages: Option<u64>,
    /// Size the KV pool by memory instead of pages (MiB).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    kv_memory_mb: Option<u64>,
    /// Most requests in the running batch.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    max_batch: u32,
    /// Most requests waiting for admission; more are refused with 503.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    max_waiting: u32,
    /// Most prompt tokens computed per request per step (chunked prefill).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    prefill_chunk: u32,
    /// Context length limit [default: the model's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    context_length: Option<u32>,
    /// Model name served in /v1/models and responses [default: the file name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Weight format for prefill: f32, q8_0, q8_0-vnni or as-loaded (BENCHMARKS.md).
    #[arg(long, default_value = "f32")]
    prefill_format: WeightFormat,
    /// Weight format for decode: q8_0, q8_0-vnni (faster on AVX-512 VNNI CPUs,
    /// coarser activation rounding), f32 or as-loaded.
    #[arg(long, default_value = "q8_0")]
    decode_format: WeightFormat,
}

/// The repository root: `$HANDOFF_REPO`, else the current directory.
fn repo_root() -> PathBuf {
    std::env::var_os("HANDOFF_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The model path to load; fetches the default model if it is missing.
fn resolve_model(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = arg {
        if !path.is_file() {
            bail!(
                "model file {} does not exist (omit --model to use the default SmolLM2 model)",
                path.display()
            );
        }
        return Ok(path);
    }
    let root = repo_root();
    let path = root.join(DEFAULT_MODEL);
    if path.is_file() {
        return Ok(path);
    }
    let script = root.join("scripts/fetch-model.sh");
    tracing::info!(
        "default model {} is missing: running {}",
        path.display(),
        script.display()
    );
    if !script.is_file() {
        bail!(
            "default model {} is missing and {} was not found: run handoff from the repository root or set HANDOFF_REPO",
            path.display(),
            script.display()
        );
    }
    let status = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() || !path.is_file() {
        bail!(
            "{} failed ({status}); the default model {} is still missing",
            script.display(),
            path.display()
        );
    }
    tracing::info!("fetched {}", path.display());
    Ok(path)
}

/// KV pages that fit in `mb` MiB for this model (f32 K and V, every layer).
fn pages_for_memory(model: &Path, mb: u64, page_size: usize) -> anyhow::Result<usize> {
    let mut f =
        std::fs::File::open(model).with_context(|| format!("opening {}", model.display()))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)
        .with_context(|| format!("reading the GGUF header of {}", model.display()))?;
    let cfg = handoff_model::LlamaConfig::from_gguf(&content)
        .with_context(|| format!("reading the model configuration of {}", model.display()))?;
    let bytes_per_page = cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 4 * page_size;
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

fn served_name(args: &ServeArgs, model: &Path) -> String {
    args.served_model_name.clone().unwrap_or_else(|| {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "handoff".to_string())
    })
}

/// Run `handoff serve` until SIGTERM / ctrl-c.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let model = resolve_model(args.model.clone())?;
    let defaults = EngineConfig::new(&model);
    let page_size = args.page_size as usize;
    let kv_pages = match (args.kv_pages, args.kv_memory_mb) {
        (Some(p), _) => usize::try_from(p).context("--kv-pages is too large")?,
        (None, Some(mb)) => pages_for_memory(&model, mb, page_size)?,
        (None, None) => defaults.kv_pages,
    };
    let config = EngineConfig {
        threads: usize::from(args.threads),
        page_size,
        kv_pages,
        max_batch: args.max_batch as usize,
        max_waiting: args.max_waiting as usize,
        prefill_chunk: args.prefill_chunk as usize,
        max_context: args.context_length.map(|c| c as usize),
        served_name: Some(served_name(&args, &model)),
        formats: PhaseFormats {
            prefill: args.prefill_format,
            decode: args.decode_format,
        },
        ..defaults
    };
    tracing::info!(model = %model.display(), threads = args.threads, page_size = args.page_size, "loading model");
    let engine = Engine::start(config)
        .with_context(|| format!("starting the engine on {}", model.display()))?;
    let info = engine.model().clone();
    tracing::info!(
        served_model_name = %info.served_name,
        context_length = info.context_length,
        kv_pages = engine.load().pages_total,
        "engine ready"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        tracing::info!("listening on http://{addr}");
        axum::serve(listener, handoff_server::app(engine))
            .with_graceful_shutdown(crate::signal::shutdown_signal())
            .await
            .context("serving HTTP")?;
        tracing::info!("shut down");
        Ok::<_, anyhow::Error>(())
    })
}
