//! Readers of the llama.cpp reference JSON (tests/data/README.md) shared by
//! the tests that compare against it.
#![allow(dead_code)] // each test file uses what it needs

/// A case's token ids under `key` (`prompt_ids`, `output_ids`).
pub fn ids(case: &serde_json::Value, key: &str) -> Vec<u32> {
    case[key]
        .as_array()
        .unwrap_or_else(|| panic!("case has no `{key}`"))
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Per step: llama.cpp's top-5 `(id, logit)`, descending.
pub fn top_logits(case: &serde_json::Value) -> Vec<Vec<(usize, f32)>> {
    case["top_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().unwrap() as usize,
                        p[1].as_f64().unwrap() as f32,
                    )
                })
                .collect()
        })
        .collect()
}

/// Print the teacher-forced figures (top-5 logit differences' median, p90
/// and p99, argmax agreement, worst difference) and require the median and
/// the agreement to be within their bounds.
pub fn report_and_check(
    diffs: &mut [f32],
    worst: f32,
    argmax_same: usize,
    steps: usize,
    median_bound: f32,
    min_agreement: f64,
) {
    diffs.sort_by(f32::total_cmp);
    let pct = |p: f64| diffs[((diffs.len() - 1) as f64 * p) as usize];
    println!(
        "top-5 logit |diff|: median {:.3}, p90 {:.3}, p99 {:.3}",
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
    println!("argmax equal at {argmax_same}/{steps} teacher-forced steps; worst top-5 logit difference {worst:.3}");
    assert!(
        pct(0.5) <= median_bound,
        "median logit difference {} too large",
        pct(0.5)
    );
    assert!(
        argmax_same as f64 >= min_agreement * steps as f64,
        "argmax agrees at only {argmax_same}/{steps} steps"
    );
}
