//! `handoff bench`: a load generator against any OpenAI-compatible endpoint
//! (BENCHMARKS.md). It sends a seeded workload of streamed completions
//! closed-loop (`--concurrency`) or open-loop (`--rate`, Poisson arrivals),
//! measures TTFT, inter-token latency, end-to-end latency, throughput and
//! goodput, and with `--baseline-url` runs the same workload against a second
//! endpoint and prints the ratios (PD next to colocated).

mod client;
mod report;
mod workload;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use client::Outcome;
use report::{RunReport, Slo};
use workload::{Class, Endpoint, LenDist, SharedPrefix, WorkloadSpec};

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a positive number, got '{s}'")),
    }
}

fn base_url(s: &str) -> Result<String, String> {
    let s = s.trim_end_matches('/');
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .ok_or_else(|| format!("expected http://HOST:PORT, got '{s}'"))?;
    if rest.is_empty() {
        return Err(format!("expected http://HOST:PORT, got '{s}'"));
    }
    Ok(s.to_string())
}

/// Flags of `handoff bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Base URL of the endpoint under test (e.g. http://127.0.0.1:30000).
    #[arg(long, value_parser = base_url)]
    url: String,
    /// Base URL of a baseline endpoint: the same workload runs against it
    /// right after --url, and the ratios ours/baseline are printed.
    #[arg(long, value_parser = base_url)]
    baseline_url: Option<String>,
    /// Name of --url in the report.
    #[arg(long, default_value = "target")]
    label: String,
    /// API key sent as `Authorization: Bearer KEY` to both endpoints (also
    /// read from $HANDOFF_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Name of --baseline-url in the report.
    #[arg(long, default_value = "baseline")]
    baseline_label: String,
    /// Which API to load: completions (prompts as token ids, exact lengths)
    /// or chat (random words, approximate lengths).
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    endpoint: Endpoint,
    /// `model` field of the requests [default: the first id of /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Closed loop: this many requests in flight [default: 1 unless --rate].
    #[arg(long, conflicts_with = "rate", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    concurrency: Option<u32>,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, value_parser = positive_f64)]
    rate: Option<f64>,
    /// Open loop: most requests in flight; later arrivals wait.
    #[arg(long, default_value_t = 256, requires = "rate", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_in_flight: u32,
    /// Measured requests.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    requests: u32,
    /// Requests sent one at a time before the measurement, not counted.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    warmup: u32,
    /// Seed of prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Prompt length in tokens: N, uniform:A-B or normal:MEAN,SD.
    #[arg(long, default_value = "128")]
    prompt_len: LenDist,
    /// Output length in tokens (max_tokens with ignore_eos): N, uniform:A-B
    /// or normal:MEAN,SD.
    #[arg(long, default_value = "32")]
    output_len: LenDist,
    /// A workload class WEIGHT:PROMPT/OUTPUT (lengths as in --prompt-len),
    /// repeatable: each request draws its class by weight, and the report
    /// adds per-class latencies. E.g. --mix 0.8:32/128 --mix
    /// 0.2:uniform:512-1024/16 makes long prompts arrive while others decode.
    #[arg(long, value_name = "WEIGHT:PROMPT/OUTPUT", conflicts_with_all = ["prompt_len", "output_len"])]
    mix: Vec<Class>,
    /// The shared-prefix chat workload SYSTEMS:SYSTEM_LEN:CONVERSATIONS:TURNS
    /// instead of independent prompts: each turn's prompt is its
    /// conversation's whole history plus a new user message of --prompt-len
    /// tokens, answers --output-len long; CONVERSATIONS x TURNS measured
    /// requests (--requests is ignored). The report adds the prefix hit rate.
    #[arg(long, value_name = "S:L:C:T", conflicts_with = "mix")]
    shared_prefix: Option<SharedPrefix>,
    /// Smallest prompt token id (skips special tokens at low ids).
    #[arg(long, default_value_t = 100)]
    min_token_id: u32,
    /// Prompt token ids are below this (keep it within the vocabulary).
    #[arg(long, default_value_t = 10_000)]
    max_token_id: u32,
    /// SLO on time to first token, ms (goodput).
    #[arg(long, default_value_t = 1000.0, value_parser = positive_f64)]
    slo_ttft_ms: f64,
    /// Send --slo-ttft-ms with every request (the `x-slo-ttft-ms` header),
    /// for a server that sheds requests it cannot serve in time.
    #[arg(long)]
    send_slo: bool,
    /// Send this `priority` with every request (larger is served sooner by
    /// a server that orders its queue by it).
    #[arg(long, allow_hyphen_values = true)]
    priority: Option<i32>,
    /// SLO on the p99 of one request's inter-token gaps, ms (goodput).
    #[arg(long, default_value_t = 200.0, value_parser = positive_f64)]
    slo_itl_ms: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout_s: u64,
    /// Also write the full report (every request included) as JSON here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

/// The load shape of a run.
#[derive(Debug, Clone, Copy)]
enum Load {
    Closed { concurrency: usize },
    Open { rate: f64, max_in_flight: usize },
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Closed { concurrency } => write!(f, "concurrency {concurrency}"),
            Load::Open {
                rate,
                max_in_flight,
            } => write!(
                f,
                "Poisson rate {rate} req/s (max in flight {max_in_flight})"
            ),
        }
    }
}

/// What one run against one endpoint needs.
struct Target {
    label: String,
    base: String,
    model: Option<String>,
}

/// The shared settings of every run.
struct Plan {
    client: reqwest::Client,
    endpoint: Endpoint,
    load: Load,
    seed: u64,
    warmup: Vec<workload::RequestSpec>,
    measured: Arc<[workload::RequestSpec]>,
    timeout: Duration,
    slo: Slo,
    class_names: Vec<String>,
    /// `priority` sent with every request.
    priority: Option<i32>,
}

impl Plan {
    /// The body of `spec`'s request.
    fn body(&self, spec: &workload::RequestSpec, model: Option<&str>) -> Value {
        let mut b = client::body(spec, self.endpoint, model);
        if let Some(p) = self.priority {
            b["priority"] = p.into();
        }
        b
    }
}

/// Check that `base` answers and find its model name: `GET /v1/models`.
async fn preflight(client: &reqwest::Client, base: &str) -> anyhow::Result<Option<String>> {
    let resp = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {base} : {}", client::root_cause(&e)))?;
    if !resp.status().is_success() {
        return Ok(None);
    }
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    Ok(v["data"][0]["id"].as_str().map(str::to_string))
}

async fn run_one(plan: &Plan, target: &Target) -> anyhow::Result<RunReport> {
    let url = format!("{}{}", target.base, plan.endpoint.path());
    let listed = preflight(&plan.client, &target.base).await?;
    let model = target.model.clone().or(listed);
    let bodies: Arc<[Value]> = plan
        .measured
        .iter()
        .map(|s| plan.body(s, model.as_deref()))
        .collect();
    for spec in &plan.warmup {
        let body = plan.body(spec, model.as_deref());
        let o = client::send(&plan.client, &url, &body, spec, plan.timeout).await;
        if let Some(f) = o.failure {
            eprintln!(
                "warning: {} warm-up request failed: {}",
                target.label, f.message
            );
        }
    }
    let n = bodies.len();
    let kv_before = kv_bytes_sent(&plan.client, &target.base).await;
    let start = Instant::now();
    let mut outcomes: Vec<(usize, Outcome)> = Vec::with_capacity(n);
    match plan.load {
        Load::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..concurrency.min(n) {
                let (next, bodies, client, url) = (
                    next.clone(),
                    bodies.clone(),
                    plan.client.clone(),
                    url.clone(),
                );
                let (specs, timeout) = (plan.measured.clone(), plan.timeout);
                tasks.spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= bodies.len() {
                            return mine;
                        }
                        let o = client::send(&client, &url, &bodies[i], &specs[i], timeout).await;
                        mine.push((i, o));
                    }
                });
            }
            while let Some(r) = tasks.join_next().await {
                outcomes.extend(r.context("a bench worker panicked")?);
            }
        }
        Load::Open {
            rate,
            max_in_flight,
        } => {
            let arrivals = workload::poisson_arrivals(plan.seed, rate, n);
            let permits = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
            let mut tasks = tokio::task::JoinSet::new();
            for (i, at) in arrivals.into_iter().enumerate() {
                tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                let permit = permits.clone().acquire_owned().await?;
                let (bodies, client, url) = (bodies.clone(), plan.client.clone(), url.clone());
                let (specs, timeout) = (plan.measured.clone(), plan.timeout);
                tasks.spawn(async move {
                    let o = client::send(&client, &url, &bodies[i], &specs[i], timeout).await;
                    drop(permit);
                    (i, o)
                });
            }
            while let Some(r) = tasks.join_next().await {
                outcomes.push(r.context("a bench request task panicked")?);
            }
        }
    }
    let duration = start.elapsed();
    let kv_after = kv_bytes_sent(&plan.client, &target.base).await;
    outcomes.sort_by_key(|(i, _)| *i);
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|(_, o)| o).collect();
    let mut report = RunReport::new(
        &target.label,
        &target.base,
        &outcomes,
        duration,
        plan.slo,
        &plan.class_names,
    );
    if let (Some(before), Some(after)) = (kv_before, kv_after) {
        report.kv_bytes_per_request = Some(after.saturating_sub(before) as f64 / n.max(1) as f64);
    }
    Ok(report)
}

/// KV bytes sent so far by the prefill workers behind a handoff router at
/// `base` (its `/workers`, then each prefill's `/metrics`); `None` for any
/// other endpoint or if one of them does not answer.
async fn kv_bytes_sent(client: &reqwest::Client, base: &str) -> Option<u64> {
    let get = |url: String| async move {
        let r = client
            .get(url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .ok()?;
        r.status().is_success().then_some(r)
    };
    let workers: Value = get(format!("{base}/workers")).await?.json().await.ok()?;
    let mut total = None;
    for w in workers.as_array()? {
        if w["role"] != "prefill" {
            continue;
        }
        let text = get(format!("{}/metrics", w["url"].as_str()?))
            .await?
            .text()
            .await
            .ok()?;
        let bytes = text.lines().find_map(|l| {
            l.strip_prefix("handoff_kv_transfer_bytes_total ")?
                .trim()
                .parse::<u64>()
                .ok()
        })?;
        total = Some(total.unwrap_or(0) + bytes);
    }
    total
}

/// Run the benchmark and print its report.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.min_token_id >= args.max_token_id {
        bail!(
            "--min-token-id ({}) must be below --max-token-id ({})",
            args.min_token_id,
            args.max_token_id
        );
    }
    let load = match args.rate {
        Some(rate) => Load::Open {
            rate,
            max_in_flight: args.max_in_flight as usize,
        },
        None => Load::Closed {
            concurrency: args.concurrency.unwrap_or(1) as usize,
        },
    };
    let classes = if args.mix.is_empty() {
        vec![Class {
            weight: 1.0,
            prompt_len: args.prompt_len,
            output_len: args.output_len,
        }]
    } else {
        args.mix.clone()
    };
    let class_names: Vec<String> = classes.iter().map(Class::to_string).collect();
    let spec = WorkloadSpec {
        seed: args.seed,
        requests: (args.warmup + args.requests) as usize,
        classes,
        min_token_id: args.min_token_id,
        max_token_id: args.max_token_id,
        endpoint: args.endpoint,
    };
    let mut all = spec.generate();
    let measured: Arc<[workload::RequestSpec]> = match args.shared_prefix {
        Some(sp) => {
            all.truncate(args.warmup as usize);
            spec.shared_prefix(sp).into()
        }
        None => all.split_off(args.warmup as usize).into(),
    };
    let mut headers = reqwest::header::HeaderMap::new();
    let key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("HANDOFF_API_KEY").ok());
    if let Some(k) = key {
        let v = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", k.trim()))
            .context("--api-key: not a valid header value")?;
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    if let Some(ms) = args.send_slo.then_some(args.slo_ttft_ms) {
        // The SLO as a request header: a server that sheds by it answers
        // 429 at once instead of queueing past it.
        let v = reqwest::header::HeaderValue::from_str(&format!("{}", ms.round() as u64))
            .context("--slo-ttft-ms: not a header value")?;
        headers.insert("x-slo-ttft-ms", v);
    }
    let client = reqwest::Client::builder()
        .default_headers(headers)
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")?;
    let plan = Plan {
        client,
        endpoint: args.endpoint,
        load,
        seed: args.seed,
        warmup: all,
        measured,
        timeout: Duration::from_secs(args.timeout_s),
        slo: Slo {
            ttft_ms: args.slo_ttft_ms,
            itl_ms: args.slo_itl_ms,
        },
        class_names: class_names.clone(),
        priority: args.priority,
    };
    let shape = if let Some(sp) = args.shared_prefix {
        format!(
            "shared prefix {sp} (S:L:C:T), user message {} tokens, output {} tokens",
            args.prompt_len, args.output_len
        )
    } else if args.mix.is_empty() {
        format!(
            "prompt {} tokens, output {} tokens",
            args.prompt_len, args.output_len
        )
    } else {
        format!("mix {}", class_names.join(" "))
    };
    let mut targets = vec![Target {
        label: args.label.clone(),
        base: args.url.clone(),
        model: args.model.clone(),
    }];
    if let Some(b) = &args.baseline_url {
        targets.push(Target {
            label: args.baseline_label.clone(),
            base: b.clone(),
            model: args.model.clone(),
        });
    }
    println!(
        "handoff bench: {} {} requests (+{} warm-up), {}, {}, seed {}",
        args.endpoint.path(),
        plan.measured.len(),
        args.warmup,
        load,
        shape,
        args.seed
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for t in &targets {
        println!("{}: {}", t.label, t.base);
        runs.push(rt.block_on(run_one(&plan, t))?);
    }
    print!("{}", report::table(&runs));
    if let Some(path) = &args.json {
        let mut doc = json!({
            "config": {
                "endpoint": args.endpoint,
                "load": load.to_string(),
                "requests": plan.measured.len(),
                "shared_prefix": args.shared_prefix.map(|s| s.to_string()),
                "warmup": args.warmup,
                "seed": args.seed,
                "classes": class_names,
                "min_token_id": args.min_token_id,
                "max_token_id": args.max_token_id,
            },
            "runs": runs,
        });
        if let [a, b] = runs.as_slice() {
            doc["ratios"] = json!(report::ratios(a, b));
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    for r in &runs {
        if r.ok == 0 {
            bail!(
                "no request to {} succeeded: {}",
                r.url,
                r.first_errors.first().map_or("", String::as_str)
            );
        }
    }
    Ok(())
}
