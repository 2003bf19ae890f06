//! `handoff bench-model`: prefill and decode throughput of the model runner
//! next to llama.cpp's `llama-bench` on the same GGUF, in one run, printed as
//! ratios (issue: colocated serving, BENCHMARKS.md).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use handoff_kv::{KvDtype, KvPool, PageIndex};
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk, WeightFormat};

/// Flags of `handoff bench-model`.
#[derive(Debug, clap::Args)]
pub struct BenchModelArgs {
    /// GGUF model file.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Compute threads (ours and llama.cpp's).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub(crate) threads: u16,
    /// Timed repetitions per case (median reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    reps: u16,
    /// Weight format for prefill (repacked, q8_0-rows, native, f32, q8_0, as-loaded).
    #[arg(long, default_value = "repacked")]
    prefill_format: WeightFormat,
    /// Weight format for decode (repacked, q8_0, native, f32, as-loaded).
    #[arg(long, default_value = "repacked")]
    decode_format: WeightFormat,
    /// Element type of the KV pool (f16, the serving default, or f32).
    #[arg(long, default_value = "f16", value_parser = crate::engine_args::parse_kv_dtype)]
    kv_dtype: KvDtype,
    /// Skip llama.cpp (print only our figures).
    #[arg(long)]
    no_llamacpp: bool,
    /// Weight cache as `serve` has it (auto, off or a directory): with one,
    /// the Q8_0 weights are computed from the mapped cache file as a
    /// server's are.
    #[arg(long, default_value = "off", value_name = "auto|off|DIR", value_parser = crate::engine_args::parse_weight_cache)]
    weight_cache: crate::engine_args::WeightCacheArg,
    /// Run only these of our cases (for profiling one of them); the others
    /// print "-". Default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    cases: Vec<Case>,
}

/// One of our measured cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Case {
    Prefill128,
    Prefill512,
    Decode1,
    Decode8,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `n` token ids spread over the model's vocabulary (whatever its size).
fn bench_tokens(model: &Llama, n: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size as u64;
    let (base, span) = if vocab > 40_100 {
        (100, 40_000)
    } else {
        (0, vocab)
    };
    (0..n as u64)
        .map(|i| (base + (i * 7919) % span) as u32)
        .collect()
}

/// Tokens/s of prefilling `n` tokens, median of `reps`.
fn prefill_rate(model: &Llama, dtype: KvDtype, n: usize, reps: usize) -> anyhow::Result<f64> {
    let tokens = bench_tokens(model, n);
    let pages: Vec<PageIndex> = (0..n.div_ceil(16) as u32).map(PageIndex).collect();
    let mut rates = Vec::new();
    for _ in 0..reps + 1 {
        let mut kv = KvPool::new(model.kv_geometry(16, dtype), pages.len())?;
        let t = Instant::now();
        model.forward(
            &mut kv,
            &[SeqChunk {
                tokens: &tokens,
                start_pos: 0,
                pages: &pages,
            }],
            Phase::Prefill,
        )?;
        rates.push(n as f64 / t.elapsed().as_secs_f64());
    }
    rates.remove(0); // warm-up
    Ok(median(rates))
}

/// Generated tokens/s of one run: `batch` sequences decoding `steps` tokens
/// each after a 32-token prompt.
fn decode_once(model: &Llama, dtype: KvDtype, batch: usize, steps: usize) -> anyhow::Result<f64> {
    let per_seq = (32 + steps).div_ceil(16);
    let tokens = bench_tokens(model, 32 + steps);
    let mut kv = KvPool::new(model.kv_geometry(16, dtype), per_seq * batch)?;
    let pages: Vec<Vec<PageIndex>> = (0..batch)
        .map(|b| {
            (0..per_seq)
                .map(|p| PageIndex((b * per_seq + p) as u32))
                .collect()
        })
        .collect();
    for p in &pages {
        model.forward(
            &mut kv,
            &[SeqChunk {
                tokens: &tokens[..32],
                start_pos: 0,
                pages: p,
            }],
            Phase::Prefill,
        )?;
    }
    let t = Instant::now();
    for step in 0..steps {
        let pos = 32 + step;
        let chunks: Vec<SeqChunk<'_>> = pages
            .iter()
            .map(|p| SeqChunk {
                tokens: &tokens[pos..pos + 1],
                start_pos: pos,
                pages: p,
            })
            .collect();
        model.forward(&mut kv, &chunks, Phase::Decode)?;
    }
    Ok((batch * steps) as f64 / t.elapsed().as_secs_f64())
}

/// Median decode tokens/s for each of `batches` (64 tokens after a 32-token
/// prompt), the batch sizes taking turns run by run (one warm-up round
/// dropped), so a slow phase of a shared host lands on all of them and the
/// ratio between them is measured in the same conditions.
fn decode_rates(
    model: &Llama,
    dtype: KvDtype,
    batches: &[usize],
    reps: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut rates = vec![Vec::new(); batches.len()];
    for round in 0..reps + 1 {
        for (r, &batch) in rates.iter_mut().zip(batches) {
            let rate = decode_once(model, dtype, batch, 64)?;
            if round > 0 {
                r.push(rate);
            }
        }
    }
    Ok(rates.into_iter().map(median).collect())
}

/// Standard output of `scripts/bench-llamacpp.sh` run with `env`; its
/// standard error in the error when it fails.
fn bench_script(env: &[(&str, String)]) -> anyhow::Result<Vec<u8>> {
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let out = Command::new("scripts/bench-llamacpp.sh")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .context("running scripts/bench-llamacpp.sh (run from the repository root)")?;
    if !out.status.success() {
        bail!(
            "{} scripts/bench-llamacpp.sh failed: {}",
            shown.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// llama-bench's tokens/s for (n_prompt, n_gen) pairs, via scripts/bench-llamacpp.sh.
fn llamacpp(model: &Path, threads: u16, reps: u16) -> anyhow::Result<Vec<(u64, u64, f64)>> {
    let out = bench_script(&[
        ("MODEL", model.display().to_string()),
        ("THREADS", threads.to_string()),
        ("REPS", reps.to_string()),
        ("TG", "64".into()),
    ])?;
    let v: serde_json::Value = serde_json::from_slice(&out).context("parsing llama-bench JSON")?;
    let rows = v.as_array().context("llama-bench JSON is not an array")?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            Some((
                r["n_prompt"].as_u64()?,
                r["n_gen"].as_u64()?,
                r["avg_ts"].as_f64()?,
            ))
        })
        .collect())
}

/// llama-batched-bench's generation tokens/s at batch 1 and batch 8 (32-token
/// prompts, 64 generated tokens each: the workload of `decode_once`), via
/// `MODE=batched scripts/bench-llamacpp.sh`.
fn llamacpp_batched(model: &Path, threads: u16) -> anyhow::Result<[Option<f64>; 2]> {
    let out = bench_script(&[
        ("MODEL", model.display().to_string()),
        ("MODE", "batched".into()),
        ("THREADS", threads.to_string()),
        ("PP", "32".into()),
        ("TG", "64".into()),
        ("NPL", "1,8".into()),
    ])?;
    let mut tg = [None; 2];
    for line in String::from_utf8_lossy(&out).lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).context("parsing llama-batched-bench JSONL")?;
        let slot = match v["pl"].as_u64() {
            Some(1) => 0,
            Some(8) => 1,
            _ => continue,
        };
        tg[slot] = v["speed_tg"].as_f64();
    }
    Ok(tg)
}

/// A figure, or "-" for a case that was not run.
fn fig(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.1}")
    }
}

/// Run the benchmark and print the table.
pub fn run(args: BenchModelArgs) -> anyhow::Result<()> {
    let threads = args.threads as usize;
    let reps = args.reps as usize;
    let formats = PhaseFormats {
        prefill: args.prefill_format,
        decode: args.decode_format,
    };
    let cache_dir = args.weight_cache.dir()?;
    let (model, _, cache) = Llama::load_cached(&args.model, formats, cache_dir.as_deref())
        .with_context(|| format!("loading {}", args.model.display()))?;
    println!("weight cache: {cache}");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    println!(
        "handoff bench-model: {} threads, formats prefill={} decode={}, loadavg {}",
        threads,
        formats.prefill,
        formats.decode,
        loadavg()
    );
    let wanted = |c: Case| args.cases.is_empty() || args.cases.contains(&c);
    let ours = pool.install(|| -> anyhow::Result<[f64; 4]> {
        let mut out = [f64::NAN; 4];
        let cases = [
            Case::Prefill128,
            Case::Prefill512,
            Case::Decode1,
            Case::Decode8,
        ];
        let mut decode = Vec::new();
        for (i, case) in cases.into_iter().enumerate() {
            if wanted(case) {
                match case {
                    Case::Prefill128 => out[i] = prefill_rate(&model, args.kv_dtype, 128, reps)?,
                    Case::Prefill512 => out[i] = prefill_rate(&model, args.kv_dtype, 512, reps)?,
                    Case::Decode1 => decode.push((i, 1)),
                    Case::Decode8 => decode.push((i, 8)),
                }
            }
        }
        let batches: Vec<usize> = decode.iter().map(|d| d.1).collect();
        for ((i, _), rate) in
            decode
                .iter()
                .zip(decode_rates(&model, args.kv_dtype, &batches, reps)?)
        {
            out[*i] = rate;
        }
        Ok(out)
    })?;
    let theirs = if args.no_llamacpp {
        None
    } else {
        let rows = llamacpp(&args.model, args.threads, args.reps)?;
        let find = |p: u64, g: u64| rows.iter().find(|r| r.0 == p && r.1 == g).map(|r| r.2);
        Some([find(128, 0), find(512, 0), find(0, 64)])
    };
    let batched = if args.no_llamacpp {
        None
    } else {
        Some(llamacpp_batched(&args.model, args.threads)?)
    };
    println!(
        "{:<22} {:>12} {:>14} {:>8}",
        "case", "handoff t/s", "llama.cpp t/s", "ratio"
    );
    let names = ["prefill 128", "prefill 512", "decode batch 1"];
    for (i, name) in names.iter().enumerate() {
        match theirs.and_then(|t| t[i]).filter(|_| !ours[i].is_nan()) {
            Some(t) => println!(
                "{name:<22} {:>12} {:>14.1} {:>8.2}",
                fig(ours[i]),
                t,
                ours[i] / t
            ),
            None => println!(
                "{name:<22} {:>12} {:>14} {:>8}",
                fig(ours[i]),
                theirs.and_then(|t| t[i]).map_or("-".into(), fig),
                "-"
            ),
        }
    }
    match batched.and_then(|b| b[1]).filter(|_| !ours[3].is_nan()) {
        Some(t) => println!(
            "{:<22} {:>12} {:>14.1} {:>8.2}  (llama.cpp: llama-batched-bench)",
            "decode batch 8",
            fig(ours[3]),
            t,
            ours[3] / t
        ),
        None => println!(
            "{:<22} {:>12} {:>14} {:>8}",
            "decode batch 8",
            fig(ours[3]),
            "-",
            "-"
        ),
    }
    println!(
        "{:<22} {:>12.2} {:>14} {:>8}  (batch-8 t/s over batch-1 t/s)",
        "batch 8 / batch 1",
        ours[3] / ours[2],
        match batched {
            Some([Some(b1), Some(b8)]) => format!("{:.2}", b8 / b1),
            _ => "-".into(),
        },
        "",
    );
    if !ours[2].is_nan() {
        // The physical limit of decode at batch 1: every weight it uses is
        // read once per token.
        let bytes = model.decode_weight_bytes() as f64;
        let bw = pool.install(read_bandwidth);
        let limit_ms = bytes / bw * 1e3;
        let ours_ms = 1e3 / ours[2];
        println!(
            "decode batch 1 limit: {:.0} MB of weights a token / {:.1} GB/s read ({threads} threads) = {limit_ms:.1} ms; ours {ours_ms:.1} ms = {:.2}x the limit",
            bytes / 1e6,
            bw / 1e9,
            ours_ms / limit_ms
        );
    }
    println!("loadavg after: {}", loadavg());
    Ok(())
}

/// Bytes a second the compute threads read from memory: a sum over a
/// 1 GiB buffer (far past any cache), split over the threads, best of 3.
fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buf: Vec<u64> = (0..(1usize << 27) as u64).collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                // Eight independent lanes, so the loop vectorizes and is
                // bound by memory, not by one add chain.
                let lanes = c.chunks_exact(8).fold([0u64; 8], |mut a, x| {
                    for (a, x) in a.iter_mut().zip(x) {
                        *a = a.wrapping_add(*x);
                    }
                    a
                });
                lanes.iter().fold(0u64, |a, &x| a.wrapping_add(x))
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (buf.len() * 8) as f64 / best
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
