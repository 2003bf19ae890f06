//! The report of `handoff bench`: percentiles, throughput and goodput of one
//! run, the table printed for one run or for a target next to its baseline
//! (with ratios), and the same as JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::client::Outcome;

/// The `q`-th percentile (0..=100) of sorted values, interpolated linearly
/// between the two nearest ranks (numpy's default); `None` when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = q.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// p50, p90, p99 and mean of one metric, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Mean.
    pub mean: Option<f64>,
    /// Number of samples.
    pub count: usize,
}

impl Percentiles {
    /// Summarise values (any order).
    pub fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        Percentiles {
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            mean: (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64),
            count: v.len(),
        }
    }
}

/// Service-level objective of one request.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Slo {
    /// Most time to first token, ms.
    pub ttft_ms: f64,
    /// Most p99 of the request's own inter-token gaps, ms.
    pub itl_ms: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Whether one successful request met the SLO (a request with no gaps meets
/// the ITL part).
pub fn meets(o: &Outcome, slo: Slo) -> bool {
    let ttft_ok = o.ttft.is_some_and(|t| ms(t) <= slo.ttft_ms);
    let mut gaps: Vec<f64> = o.itl.iter().copied().map(ms).collect();
    gaps.sort_by(f64::total_cmp);
    let itl_ok = percentile(&gaps, 99.0).is_none_or(|p| p <= slo.itl_ms);
    o.failure.is_none() && ttft_ok && itl_ok
}

/// One request in the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Index of its workload class.
    pub class: usize,
    /// Prompt tokens sent.
    pub prompt_tokens: u32,
    /// Output tokens received.
    pub output_tokens: u64,
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, ms.
    pub e2e_ms: f64,
    /// p99 of its inter-token gaps, ms.
    pub itl_p99_ms: Option<f64>,
    /// Failure message, if it failed.
    pub error: Option<String>,
}

/// Latencies of the successful requests of one workload class.
#[derive(Debug, Clone, Serialize)]
pub struct ClassReport {
    /// The class, as given to `--mix` (or the single class).
    pub class: String,
    /// Requests of this class that succeeded.
    pub ok: usize,
    /// Time to first token, ms.
    pub ttft_ms: Percentiles,
    /// Inter-token latency, ms.
    pub itl_ms: Percentiles,
    /// End-to-end latency, ms.
    pub e2e_ms: Percentiles,
}

impl ClassReport {
    fn of(class: &str, good: &[&Outcome]) -> Self {
        ClassReport {
            class: class.into(),
            ok: good.len(),
            ttft_ms: Percentiles::of(good.iter().filter_map(|o| o.ttft).map(ms).collect()),
            itl_ms: Percentiles::of(
                good.iter()
                    .flat_map(|o| o.itl.iter().copied().map(ms))
                    .collect(),
            ),
            e2e_ms: Percentiles::of(good.iter().map(|o| ms(o.e2e)).collect()),
        }
    }
}

/// Everything measured in one run against one endpoint.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// `--label` or `--baseline-label`.
    pub label: String,
    /// Base URL.
    pub url: String,
    /// Requests that succeeded.
    pub ok: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Failures by kind.
    pub errors_by_kind: BTreeMap<String, usize>,
    /// The first three distinct failure messages.
    pub first_errors: Vec<String>,
    /// Requests answered 429 (shed): the slowest answer and the p99, ms.
    pub shed_answer_ms: Option<(f64, f64)>,
    /// From the first send to the last completion, seconds.
    pub duration_s: f64,
    /// Successful requests per second.
    pub request_throughput: f64,
    /// Output tokens of successful requests per second.
    pub output_token_throughput: f64,
    /// Prompt tokens of successful requests.
    pub total_prompt_tokens: u64,
    /// Output tokens of successful requests.
    pub total_output_tokens: u64,
    /// Prompt tokens the server served from its prefix cache (as reported
    /// in `usage.prompt_tokens_details.cached_tokens`).
    pub total_cached_tokens: u64,
    /// KV bytes the endpoint's prefill workers sent to decode workers during
    /// the run, per request sent (a handoff router only: read from its
    /// prefill workers' `handoff_kv_transfer_bytes_total`).
    pub kv_bytes_per_request: Option<f64>,
    /// Time to first token, ms.
    pub ttft_ms: Percentiles,
    /// Inter-token latency over all gaps of successful requests, ms.
    pub itl_ms: Percentiles,
    /// End-to-end latency, ms.
    pub e2e_ms: Percentiles,
    /// The same latencies per workload class.
    pub per_class: Vec<ClassReport>,
    /// The SLO goodput is measured against.
    pub slo: Slo,
    /// Requests that met the SLO.
    pub slo_met: usize,
    /// Requests meeting the SLO per second.
    pub goodput: f64,
    /// Every measured request, in workload order.
    pub requests: Vec<RequestRecord>,
}

impl RunReport {
    /// Summarise a run's outcomes (workload order) over `duration`;
    /// `classes` names the workload classes the outcomes' `class` indexes.
    pub fn new(
        label: &str,
        url: &str,
        outcomes: &[Outcome],
        duration: Duration,
        slo: Slo,
        classes: &[String],
    ) -> Self {
        let secs = duration.as_secs_f64().max(1e-9);
        let good: Vec<&Outcome> = outcomes.iter().filter(|o| o.failure.is_none()).collect();
        let mut errors_by_kind = BTreeMap::new();
        let mut first_errors: Vec<String> = Vec::new();
        for f in outcomes.iter().filter_map(|o| o.failure.as_ref()) {
            *errors_by_kind.entry(f.kind.clone()).or_insert(0) += 1;
            if first_errors.len() < 3 && !first_errors.contains(&f.message) {
                first_errors.push(f.message.clone());
            }
        }
        let mut shed: Vec<f64> = outcomes
            .iter()
            .filter(|o| o.failure.as_ref().is_some_and(|f| f.kind == "http_429"))
            .map(|o| o.e2e.as_secs_f64() * 1e3)
            .collect();
        shed.sort_by(f64::total_cmp);
        let shed_answer_ms = shed.last().map(|&max| {
            let p99 = shed[((shed.len() as f64 * 0.99).ceil() as usize).clamp(1, shed.len()) - 1];
            (p99, max)
        });
        let total_output_tokens: u64 = good.iter().map(|o| o.output_tokens).sum();
        let slo_met = outcomes.iter().filter(|o| meets(o, slo)).count();
        let all = ClassReport::of("all", &good);
        let per_class = classes
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mine: Vec<&Outcome> = good.iter().copied().filter(|o| o.class == i).collect();
                ClassReport::of(name, &mine)
            })
            .collect();
        RunReport {
            label: label.into(),
            url: url.into(),
            ok: good.len(),
            failed: outcomes.len() - good.len(),
            errors_by_kind,
            first_errors,
            shed_answer_ms,
            duration_s: secs,
            request_throughput: good.len() as f64 / secs,
            output_token_throughput: total_output_tokens as f64 / secs,
            total_prompt_tokens: good.iter().map(|o| u64::from(o.prompt_tokens)).sum(),
            total_cached_tokens: good.iter().map(|o| o.cached_tokens).sum(),
            kv_bytes_per_request: None,
            total_output_tokens,
            ttft_ms: all.ttft_ms,
            itl_ms: all.itl_ms,
            e2e_ms: all.e2e_ms,
            per_class,
            slo,
            slo_met,
            goodput: slo_met as f64 / secs,
            requests: outcomes
                .iter()
                .map(|o| RequestRecord {
                    class: o.class,
                    prompt_tokens: o.prompt_tokens,
                    output_tokens: o.output_tokens,
                    ttft_ms: o.ttft.map(ms),
                    e2e_ms: ms(o.e2e),
                    itl_p99_ms: Percentiles::of(o.itl.iter().copied().map(ms).collect()).p99,
                    error: o.failure.as_ref().map(|f| f.message.clone()),
                })
                .collect(),
        }
    }
}

type Getter = fn(&RunReport) -> Option<f64>;

/// The rows of the table: name, value, decimals.
const ROWS: &[(&str, Getter, usize)] = &[
    ("requests ok", |r| Some(r.ok as f64), 0),
    ("requests failed", |r| Some(r.failed as f64), 0),
    ("duration (s)", |r| Some(r.duration_s), 2),
    (
        "request throughput (req/s)",
        |r| Some(r.request_throughput),
        3,
    ),
    (
        "output throughput (tok/s)",
        |r| Some(r.output_token_throughput),
        1,
    ),
    ("output tokens", |r| Some(r.total_output_tokens as f64), 0),
    (
        "prefix hit rate",
        |r| {
            (r.total_prompt_tokens > 0)
                .then(|| r.total_cached_tokens as f64 / r.total_prompt_tokens as f64)
        },
        3,
    ),
    ("KV bytes moved / request", |r| r.kv_bytes_per_request, 0),
    ("TTFT p50 (ms)", |r| r.ttft_ms.p50, 1),
    ("TTFT p90 (ms)", |r| r.ttft_ms.p90, 1),
    ("TTFT p99 (ms)", |r| r.ttft_ms.p99, 1),
    ("ITL p50 (ms)", |r| r.itl_ms.p50, 2),
    ("ITL p90 (ms)", |r| r.itl_ms.p90, 2),
    ("ITL p99 (ms)", |r| r.itl_ms.p99, 2),
    ("e2e p50 (ms)", |r| r.e2e_ms.p50, 1),
    ("e2e p90 (ms)", |r| r.e2e_ms.p90, 1),
    ("e2e p99 (ms)", |r| r.e2e_ms.p99, 1),
    ("SLO met", |r| Some(r.slo_met as f64), 0),
    ("goodput (req/s)", |r| Some(r.goodput), 3),
];

fn cell(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

/// ours / baseline, when both exist and the baseline is not zero.
pub fn ratio(ours: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (ours, base) {
        (Some(o), Some(b)) if b != 0.0 => Some(o / b),
        _ => None,
    }
}

type ClassGetter = fn(&ClassReport) -> Option<f64>;

/// Per-class rows: name, value, decimals.
const CLASS_ROWS: &[(&str, ClassGetter, usize)] = &[
    ("TTFT p50 (ms)", |c| c.ttft_ms.p50, 1),
    ("TTFT p99 (ms)", |c| c.ttft_ms.p99, 1),
    ("ITL p50 (ms)", |c| c.itl_ms.p50, 2),
    ("ITL p99 (ms)", |c| c.itl_ms.p99, 2),
    ("e2e p50 (ms)", |c| c.e2e_ms.p50, 1),
];

/// Every row of the report: name, one value per run, decimals. Per-class
/// rows (`[i] ...`) follow when the workload has several classes.
fn rows(runs: &[RunReport]) -> Vec<(String, Vec<Option<f64>>, usize)> {
    let mut out: Vec<_> = ROWS
        .iter()
        .map(|(name, get, d)| (name.to_string(), runs.iter().map(get).collect(), *d))
        .collect();
    let classes = runs.first().map_or(0, |r| r.per_class.len());
    if classes > 1 {
        for k in 0..classes {
            for (name, get, d) in CLASS_ROWS {
                let vals = runs
                    .iter()
                    .map(|r| r.per_class.get(k).and_then(get))
                    .collect();
                out.push((format!("[{k}] {name}"), vals, *d));
            }
        }
    }
    out
}

/// The ratio (first run / second run) of every row, keyed by row name.
pub fn ratios(ours: &RunReport, base: &RunReport) -> BTreeMap<String, Option<f64>> {
    rows(&[ours.clone(), base.clone()])
        .into_iter()
        .map(|(name, v, _)| (name, ratio(v[0], v[1])))
        .collect()
}

/// The human-readable table: one column per run, and with two runs a ratio
/// column (first / second).
pub fn table(runs: &[RunReport]) -> String {
    let mut out = String::new();
    let mut line = format!("{:<28}", "metric");
    for r in runs {
        line += &format!(" {:>12}", r.label);
    }
    if runs.len() == 2 {
        line += &format!(" {:>9}", "ratio");
    }
    out += line.trim_end();
    out.push('\n');
    for (name, vals, decimals) in rows(runs) {
        let mut line = format!("{name:<28}");
        for v in &vals {
            line += &format!(" {:>12}", cell(*v, decimals));
        }
        if let [a, b] = vals[..] {
            line += &format!(" {:>9}", cell(ratio(a, b), 3));
        }
        out += &line;
        out.push('\n');
    }
    if let Some(r) = runs.first() {
        if r.per_class.len() > 1 {
            let names: Vec<String> = r
                .per_class
                .iter()
                .enumerate()
                .map(|(k, c)| format!("[{k}] {}", c.class))
                .collect();
            out += &format!("classes (WEIGHT:PROMPT/OUTPUT): {}\n", names.join("  "));
        }
        out += &format!(
            "SLO: TTFT <= {} ms and per-request ITL p99 <= {} ms\n",
            r.slo.ttft_ms, r.slo.itl_ms
        );
    }
    for r in runs {
        if r.failed > 0 {
            let kinds: Vec<String> = r
                .errors_by_kind
                .iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect();
            out += &format!("{} failures: {}\n", r.label, kinds.join(", "));
            if let Some((p99, max)) = r.shed_answer_ms {
                out += &format!("  429 answers: p99 {p99:.1} ms, max {max:.1} ms\n");
            }
            for e in &r.first_errors {
                out += &format!("  {e}\n");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::client::Failure;

    #[test]
    fn percentiles_of_known_arrays() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.5));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert!((percentile(&v, 99.0).unwrap() - 99.01).abs() < 1e-9);
        assert!((percentile(&v, 90.0).unwrap() - 90.1).abs() < 1e-9);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[10.0, 20.0], 50.0), Some(15.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let p = Percentiles::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(p.p50, Some(3.0));
        assert_eq!(p.mean, Some(3.0));
        assert!((p.p90.unwrap() - 4.6).abs() < 1e-9);
        assert_eq!(p.count, 5);
    }

    fn outcome(ttft_ms: u64, gaps_ms: &[u64], tokens: u64, failed: bool) -> Outcome {
        Outcome {
            class: 0,
            ttft: Some(Duration::from_millis(ttft_ms)),
            itl: gaps_ms.iter().map(|&g| Duration::from_millis(g)).collect(),
            e2e: Duration::from_millis(ttft_ms + gaps_ms.iter().sum::<u64>()),
            output_tokens: tokens,
            prompt_tokens: 10,
            cached_tokens: 4,
            failure: failed.then(|| Failure {
                kind: "http_503".into(),
                message: "HTTP 503: overloaded".into(),
            }),
        }
    }

    #[test]
    fn goodput_counts_requests_meeting_both_slos() {
        let slo = Slo {
            ttft_ms: 100.0,
            itl_ms: 20.0,
        };
        let mut outcomes = [
            outcome(50, &[10, 10], 3, false),  // meets
            outcome(150, &[10, 10], 3, false), // TTFT too slow
            outcome(50, &[10, 30], 3, false),  // ITL p99 too slow
            outcome(50, &[], 1, false),        // meets: no gaps
            outcome(50, &[10], 2, true),       // failed
            outcome(50, &[10], 2, true),       // failed, same message
        ];
        outcomes[1].class = 1;
        outcomes[2].class = 1;
        let classes = ["1:8/4".to_string(), "1:64/4".to_string()];
        let r = RunReport::new("t", "u", &outcomes, Duration::from_secs(2), slo, &classes);
        assert_eq!((r.ok, r.failed, r.slo_met), (4, 2, 2));
        assert_eq!(r.goodput, 1.0);
        assert_eq!(r.request_throughput, 2.0);
        assert_eq!(r.total_output_tokens, 10);
        assert_eq!(r.output_token_throughput, 5.0);
        assert_eq!(r.errors_by_kind.get("http_503"), Some(&2));
        assert_eq!(r.first_errors, ["HTTP 503: overloaded"]);
        assert_eq!(r.ttft_ms.p50, Some(50.0));
        assert_eq!(r.itl_ms.count, 6);
        // 4 of 10 prompt tokens cached in each of the 4 good requests.
        assert_eq!((r.total_prompt_tokens, r.total_cached_tokens), (40, 16));
        let text = table(&[r.clone(), r.clone()]);
        let hit = text.lines().find(|l| l.starts_with("prefix hit rate"));
        assert!(hit.is_some_and(|l| l.contains("0.400")), "{text}");
        assert!(text.contains("goodput (req/s)"), "{text}");
        assert!(text.lines().nth(1).unwrap().ends_with("1.000"), "{text}");
        assert_eq!(r.per_class[0].ok, 2);
        assert_eq!(r.per_class[0].ttft_ms.p50, Some(50.0));
        assert_eq!(r.per_class[1].ok, 2);
        assert_eq!(r.per_class[1].ttft_ms.p50, Some(100.0));
        assert_eq!(r.requests[1].class, 1);
        assert!(text.contains("[1] TTFT p50 (ms)"), "{text}");
        assert!(text.contains("[1] 1:64/4"), "{text}");
        let ratios = ratios(&r, &r);
        assert_eq!(ratios["[0] ITL p99 (ms)"], Some(1.0));
        assert_eq!(ratios["TTFT p50 (ms)"], Some(1.0));
        assert_eq!(ratios["requests failed"], Some(1.0));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
    }
}
