//! Teacher-forced comparison with llama.cpp: feed SmolLM2 Q4_1 the prompt and
//! llama.cpp's own greedy tokens, and at every step compare our logits for
//! llama.cpp's top-5 tokens with llama.cpp's values
//! (tests/data/llamacpp_greedy_fa_off.json, see tests/data/README.md).
//!
//! Required: (1) at every step our logits for llama.cpp's top-5 tokens are
//! within `MAX_LOGIT_DIFF` of llama.cpp's, with a median difference of at
//! most `MEDIAN_LOGIT_DIFF`; (2) our argmax equals llama.cpp's at
//! `MIN_ARGMAX_AGREEMENT` of the steps at least, and where it does not,
//! llama.cpp's pick trails ours by at most `NEAR_TIE` in our logits.
//! Why not exact equality: llama.cpp quantizes activations to 8 bits in
//! blocks of 32 before every Q4_1 matmul and stores K/V in f16. With the
//! default formats (BENCHMARKS.md) we store K/V in f16 too (the serving
//! default, `--kv-dtype f16`), prefill in f32 and decode with Q8_0 weights
//! (activations in blocks of 32, like llama.cpp; handoff's `q8_matmul`
//! kernel).
//! Measured here (2026-12-06, q8_0-rows prefill, q8_0 decode): median top-5
//! logit difference 0.191, worst 1.213, argmax equal at 528/560 steps.
//! Earlier, with f32 prefill: 0.161, worst 1.274, 537/560 (with f32 K/V: 0.168 and 534/560;
//! 0.18 and 529/560 before `q8_matmul`, when candle ran the
//! FFN down projection with activations in blocks of 256); with all-Q4_1
//! weights like llama.cpp: 0.14 and 532/560.
//! (The faster `q8_0-vnni` decode format quantizes activations in blocks of
//! 256: 0.29 and 521/560, which this test's bounds do not all accept.)
//! A wrong RoPE, norm, mask or layout gives differences of several units at
//! once, far outside these bounds.

mod common;
use common::{ids, top_logits};
use std::path::PathBuf;

use handoff_kv::{KvDtype, KvPool, PageIndex};
use handoff_model::sampling::argmax;
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk};

// Bounds above what the default formats measure (worst top-5 difference
// 1.213, median 0.191, argmax 528/560 = 0.943), so a change that
// makes the model drift fails here rather than hiding under slack.
const MAX_LOGIT_DIFF: f32 = 1.6;
const MEDIAN_LOGIT_DIFF: f32 = 0.2;
const NEAR_TIE: f32 = 1.0;
const MIN_ARGMAX_AGREEMENT: f64 = 0.93;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn logits_track_llamacpp_step_by_step() {
    let path = std::env::var("HANDOFF_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        path.display()
    );
    let data: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            repo().join("crates/handoff-model/tests/data/llamacpp_greedy_fa_off.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut formats = PhaseFormats::default();
    if let Ok(f) = std::env::var("HANDOFF_FORMATS") {
        let (p, d) = f.split_once(',').unwrap();
        formats = PhaseFormats {
            prefill: p.parse().unwrap(),
            decode: d.parse().unwrap(),
        };
    }
    let (model, _) = Llama::load(&path, formats).unwrap();
    let mut diffs = Vec::new();
    let page_size = 16;
    let (mut worst, mut steps, mut argmax_same) = (0.0f32, 0, 0);
    for case in data["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (prompt, out) = (ids(case, "prompt_ids"), ids(case, "output_ids"));
        let top = top_logits(case);
        let total = prompt.len() + out.len();
        let mut pool = KvPool::new(
            model.kv_geometry(page_size, KvDtype::F16),
            total.div_ceil(page_size),
        )
        .unwrap();
        let pages: Vec<PageIndex> = (0..total.div_ceil(page_size) as u32)
            .rev()
            .map(PageIndex)
            .collect();
        let mut logits = model
            .forward(
                &mut pool,
                &[SeqChunk {
                    tokens: &prompt,
                    start_pos: 0,
                    pages: &pages,
                }],
                Phase::Prefill,
            )
            .unwrap()
            .remove(0);
        for (step, want) in top.iter().enumerate() {
            for &(id, v) in want {
                let d = (logits[id] - v).abs();
                worst = worst.max(d);
                diffs.push(d);
                if std::env::var("HANDOFF_STATS_ONLY").is_err() {
                    assert!(
                        d <= MAX_LOGIT_DIFF,
                        "{name} step {step}: logit of token {id} is {} here, {v} in llama.cpp",
                        logits[id]
                    );
                }
            }
            let ours = argmax(&logits);
            if ours == want[0].0 {
                argmax_same += 1;
            } else {
                // A near-tie on our side: llama.cpp's pick is within NEAR_TIE of ours.
                let gap = logits[ours] - logits[want[0].0];
                assert!(
                    std::env::var("HANDOFF_STATS_ONLY").is_ok() || gap <= NEAR_TIE,
                    "{name} step {step}: we pick {ours}, llama.cpp picks {} which trails ours by {gap}",
                    want[0].0
                );
            }
            steps += 1;
            if step + 1 < top.len() {
                let pos = prompt.len() + step;
                let c = SeqChunk {
                    tokens: &out[step..step + 1],
                    start_pos: pos,
                    pages: &pages,
                };
                logits = model
                    .forward(&mut pool, &[c], Phase::Decode)
                    .unwrap()
                    .remove(0);
            }
        }
    }
    common::report_and_check(
        &mut diffs,
        worst,
        argmax_same,
        steps,
        MEDIAN_LOGIT_DIFF,
        MIN_ARGMAX_AGREEMENT,
    );
}
