//! Greedy continuations of SmolLM2 Q4_1 through the whole engine (chunked
//! prefill, paged decode) against llama.cpp's greedy continuations of the same
//! GGUF (crates/handoff-model/tests/data/llamacpp_greedy_fa_off.json, made by
//! scripts/gen-llamacpp-refs.sh with the command recorded in the file).
//!
//! Agreement required, and why not exact identity everywhere: llama.cpp
//! multiplies Q4_1 weights by activations quantized to 8 bits; our default
//! formats (BENCHMARKS.md) compute prefill in f32 and decode with Q8_0
//! weights and 8-bit activations in blocks of 32. Both are faithful to the same weights but round differently, so
//! logits differ: teacher-forced on llama.cpp's tokens, the top-5 logit
//! difference is 0.17 at the median and 0.45 at p90
//! (crates/handoff-model/tests/llamacpp_logits.rs, the stricter step-by-step
//! check of the logits themselves), and how much also depends on the CPU
//! (candle's f32 GEMM picks its kernels at run time: `chat_multiturn` kept
//! llama.cpp's token at a step of margin 0.296 on an Intel Xeon and not on
//! an AMD EPYC, with the same binary inputs). Where llama.cpp's top-1/top-2
//! logit gap is within that difference, either choice is a correct greedy
//! answer and the continuations may part ways from there on. So we require
//! token identity for every step up to the first step whose llama.cpp margin
//! is below `NEAR_TIE` (the p90 difference, rounded up), and print the
//! overall figures.

use std::path::PathBuf;
use std::time::Instant;

use handoff_engine::{Engine, EngineConfig, GenerateRequest, SamplingParams, StreamEvent};

const NEAR_TIE: f64 = 0.5;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_path() -> PathBuf {
    match std::env::var("HANDOFF_MODEL") {
        Ok(p) => PathBuf::from(p),
        Err(_) => repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

#[test]
fn greedy_output_tracks_llamacpp() {
    let path = model_path();
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
    let mut cfg = EngineConfig::new(&path);
    if let Ok(f) = std::env::var("HANDOFF_FORMATS") {
        let (p, d) = f.split_once(',').unwrap();
        cfg.formats.prefill = p.parse().unwrap();
        cfg.formats.decode = d.parse().unwrap();
    }
    cfg.prefill_chunk = 128;
    let h = Engine::start(cfg).unwrap();
    let (mut total, mut same_total, mut full) = (0, 0, 0);
    let cases = data["cases"].as_array().unwrap();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<u32> = case["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let margins: Vec<f64> = case["logit_margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        // Our tokenizer must give llama.cpp's prompt ids.
        let ours = h
            .tokenizer()
            .encode(case["prompt"].as_str().unwrap(), true)
            .unwrap();
        assert_eq!(ours, prompt, "{name}: prompt tokenization differs");
        let req = GenerateRequest {
            prompt_ids: prompt,
            sampling: SamplingParams {
                max_new_tokens: want.len().max(1),
                ..Default::default()
            },
            arrived: Instant::now(),
            output_so_far: Vec::new(),
            class: Default::default(),
        };
        let mut s = h.submit(req).unwrap();
        let mut got = Vec::new();
        while let Some(ev) = s.blocking_next() {
            match ev {
                StreamEvent::Token(t) => got.push(t.id),
                StreamEvent::Finished(_) => break,
                StreamEvent::Error(e) => panic!("{name}: {e}"),
            }
        }
        let common = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let must = margins
            .iter()
            .take_while(|&&m| m >= NEAR_TIE)
            .count()
            .min(want.len());
        println!(
            "{name}: {common}/{} tokens identical (required {must}; first near-tie at step {must})",
            want.len()
        );
        assert!(
            common >= must,
            "{name}: output diverges from llama.cpp at step {common}, before the first near-tie (step {must}, margin {:.3})\nours:  {got:?}\ntheirs: {want:?}",
            margins[common]
        );
        total += want.len();
        same_total += common;
        if common == want.len() {
            full += 1;
        }
    }
    println!(
        "{full}/{} continuations fully identical; {same_total}/{total} tokens on the common prefix",
        cases.len()
    );
    // Measured 256/560 (3 of 14 continuations whole) on an AMD EPYC host
    // and 129/560 (1 of 14), the same on every run, on an Intel Xeon with
    // AVX-512 (candle's f32 GEMM picks other kernels there, so logits round
    // differently and near-ties fall the other way sooner); past a
    // near-tie either engine may go its own way. The per-case check above,
    // identity up to the first near-tie, is the strict one; this floor sits
    // about 20% below the lower figure, and a model that drifted keeps few
    // tokens anywhere (a broken one, none).
    assert!(
        same_total >= AGREEMENT_FLOOR,
        "only {same_total}/{total} generated tokens match llama.cpp's greedy continuations (floor {AGREEMENT_FLOOR})"
    );
}

/// Tokens on the common prefix with llama.cpp, summed over the cases, below
/// which greedy decoding has drifted (see the measurement at the assert).
const AGREEMENT_FLOOR: usize = 100;
