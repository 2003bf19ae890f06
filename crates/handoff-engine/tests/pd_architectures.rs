//! Every supported architecture end to end through the engines: colocated
//! with the prefix cache on equals it off, prompts batched into shared
//! prefill passes equal them one at a time, disaggregated (shm, all at once)
//! equals colocated token for token, and structured output (a regex)
//! gives the same text both ways. The models are the seeded random-weight
//! presets of `handoff-testmodels` (written at test time; the same files
//! `crates/handoff-model/tests/arch_llamacpp.rs` checks against llama.cpp)
//! and, when present, the real Gemma 3 270M (`scripts/fetch-gemma3.sh`;
//! `HANDOFF_REQUIRE_GEMMA3=1` makes its absence a failure, as in CI).
//!
//! The prompts cross what differs per architecture: lengths past the
//! presets' 32-token sliding window (Gemma 3 real: past 512) and past the
//! 64-token prefill chunk, and two prompts sharing a 96-token prefix so the
//! second one hits the prefix cache (six whole 16-token pages) with a
//! window shorter than the hit.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use handoff_engine::grammar::{GrammarSpec, Grammars};
use handoff_engine::pd::{DecodeEngine, PdConfig, PrefillEngine};
use handoff_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateRequest, RequestStream,
    SamplingParams, StreamEvent,
};
use handoff_model::{PhaseFormats, WeightFormat};
use handoff_proto::RoomId;
use handoff_transfer::TransportKind;
use rand::{Rng, SeedableRng};

const PAGE: usize = 16;
const CHUNK: usize = 64;

fn config(
    model: &Path,
    kv_pages: usize,
    prefix_cache: bool,
    f: Option<PhaseFormats>,
) -> EngineConfig {
    let mut cfg = EngineConfig::new(model);
    if let Some(f) = f {
        cfg.formats = f;
    }
    cfg.page_size = PAGE;
    cfg.kv_pages = kv_pages;
    cfg.prefill_chunk = CHUNK;
    cfg.threads = 2;
    cfg.prefix_cache = prefix_cache;
    cfg
}

fn room() -> RoomId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    RoomId::new(((std::process::id() as u64) << 32) | (n + 1)).unwrap()
}

/// Greedy requests of seeded random token ids (control tokens excluded).
fn requests(vocab: usize, lens: &[usize], max_new: usize, seed: u64) -> Vec<GenerateRequest> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut draw =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..vocab as u32)).collect() };
    let shared = draw(96);
    let mut prompts: Vec<Vec<u32>> = lens.iter().map(|&n| draw(n)).collect();
    for tail in [7, 30] {
        let mut p = shared.clone();
        p.extend(draw(tail));
        prompts.push(p);
    }
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt_ids)| GenerateRequest {
            prompt_ids,
            sampling: SamplingParams {
                max_new_tokens: max_new + i % 3,
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            },
            arrived: Instant::now(),
            output_so_far: Vec::new(),
            class: Default::default(),
        })
        .collect()
}

/// A request's tokens and text, and how many prompt tokens came from the
/// prefix cache.
fn drain_cached(mut s: RequestStream) -> ((Vec<u32>, String), usize) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Some(StreamEvent::Finished(f)) => {
                assert!(
                    !matches!(f.reason, FinishReason::StopString { .. }),
                    "{:?}",
                    f.reason
                );
                return ((ids, text), f.cached_tokens);
            }
            Some(StreamEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Finished or Error"),
        }
    }
}

fn drain(s: RequestStream) -> (Vec<u32>, String) {
    drain_cached(s).0
}

fn one_by_one(engine: &EngineHandle, reqs: &[GenerateRequest]) -> Vec<(Vec<u32>, String)> {
    reqs.iter()
        .map(|r| drain(engine.submit(r.clone()).unwrap()))
        .collect()
}

fn all_at_once(engine: &EngineHandle, reqs: &[GenerateRequest]) -> Vec<(Vec<u32>, String)> {
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    streams.into_iter().map(drain).collect()
}

fn pages_for(reqs: &[GenerateRequest]) -> usize {
    reqs.iter()
        .map(|r| (r.prompt_ids.len() + r.sampling.max_new_tokens).div_ceil(PAGE) + 1)
        .sum()
}

fn assert_same(what: &str, got: &[(Vec<u32>, String)], want: &[(Vec<u32>, String)]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let at = g.0.iter().zip(&w.0).take_while(|(a, b)| a == b).count();
        assert_eq!(g, w, "{what}: request {i} differs from position {at}");
    }
}

/// The whole check for one model file.
/// `formats`: the weight formats of every engine (None: the defaults).
fn check_model(
    name: &str,
    model: &Path,
    lens: &[usize],
    max_new: usize,
    formats: Option<PhaseFormats>,
) {
    let t0 = Instant::now();
    let colocated = Engine::start(config(model, 4096, true, formats)).unwrap();
    let vocab = colocated.tokenizer().vocab_size();
    let reqs = requests(vocab, lens, max_new, 7);
    let (want, cached): (Vec<_>, Vec<usize>) = reqs
        .iter()
        .map(|r| drain_cached(colocated.submit(r.clone()).unwrap()))
        .unzip();
    // Real outputs: not all alike.
    let mut distinct: Vec<&Vec<u32>> = want.iter().map(|w| &w.0).collect();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() > want.len() / 2,
        "{name}: outputs alike: {want:?}"
    );
    // The second shared-prefix prompt hit the cache (one by one, after
    // the first finished): its 96-token prefix is six whole pages, past
    // the presets' window.
    assert!(
        cached[cached.len() - 1] >= 96,
        "{name}: the shared prefix was not reused: {cached:?}"
    );
    assert!(
        colocated.load().pages_used == 0,
        "{name}: colocated pages left in use"
    );
    // Prompts batched into shared prefill passes, and decode steps of
    // several sequences: the same tokens.
    assert_same(
        &format!("{name}: colocated, all at once"),
        &all_at_once(&colocated, &reqs),
        &want,
    );
    drop(colocated);
    let no_cache = Engine::start(config(model, 4096, false, formats)).unwrap();
    assert_same(
        &format!("{name}: prefix cache off"),
        &one_by_one(&no_cache, &reqs),
        &want,
    );
    drop(no_cache);

    // Disaggregated over shared memory, every request at once.
    let cfg = config(model, pages_for(&reqs), true, formats);
    let decode = DecodeEngine::start(cfg.clone(), PdConfig::new(TransportKind::Shm)).unwrap();
    let prefill = PrefillEngine::start(cfg, PdConfig::new(TransportKind::Shm)).unwrap();
    let pending: Vec<_> = reqs
        .iter()
        .map(|r| {
            let room = room();
            let ticket = prefill.submit(r.clone(), room).unwrap();
            let stream = decode
                .submit(r.clone(), room, prefill.bootstrap_addr())
                .unwrap();
            (ticket, stream)
        })
        .collect();
    let got: Vec<_> = pending
        .into_iter()
        .map(|(ticket, stream)| {
            let out = drain(stream);
            let done = ticket.blocking_wait().expect("prefill");
            assert_eq!(done.first_token, out.0[0], "{name}: prefill's first token");
            out
        })
        .collect();
    assert_same(&format!("{name}: PD (shm)"), &got, &want);
    // The KV came over the transfer (a decode that recomputes after a
    // failed transfer gives the same answer).
    assert_eq!(decode.local_prefills().recomputed, 0, "{name}: recomputed");

    // Structured output through both: a regex over the model's own text.
    let grammars = Grammars::new(decode.tokenizer().clone());
    let grammar = grammars
        .compile(GrammarSpec::Regex("[a-z]{2,6}( [a-z]{2,6}){1,3}".into()))
        .unwrap();
    let mut structured = reqs[1].clone();
    structured.sampling.grammar = Some(grammar);
    structured.sampling.ignore_eos = false;
    structured.sampling.max_new_tokens = 40;
    let room = room();
    let ticket = prefill.submit(structured.clone(), room).unwrap();
    let pd = drain(
        decode
            .submit(structured.clone(), room, prefill.bootstrap_addr())
            .unwrap(),
    );
    ticket.blocking_wait().expect("structured prefill");
    let colocated = Engine::start(config(model, 4096, true, formats)).unwrap();
    let co = drain(colocated.submit(structured).unwrap());
    assert_eq!(pd, co, "{name}: structured output, PD vs colocated");
    let re = regex_lite(&co.1);
    assert!(
        re,
        "{name}: structured output {:?} is not in the language",
        co.1
    );
    let t = Instant::now();
    while prefill.load().pages_used + decode.load().pages_used > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{name}: PD pages not freed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    eprintln!("{name}: identical everywhere, {:?}", t0.elapsed());
}

/// `[a-z]{2,6}( [a-z]{2,6}){1,3}`, whole, without a regex crate.
fn regex_lite(s: &str) -> bool {
    let words: Vec<&str> = s.split(' ').collect();
    (2..=4).contains(&words.len())
        && words
            .iter()
            .all(|w| (2..=6).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase()))
}

fn preset(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    handoff_testmodels::write_preset(&path, name).unwrap();
    check_model(name, &path, &[5, 17, 40, 70, 130, 300], 10, None);
}

/// The native kernels in both phases (weights computed in place from the
/// mapped file, Q4_K/Q6_K/Q8_0/F16 as the preset mixes them): the same
/// identities hold, since they compute each row on its own too.
#[test]
fn llama3_native_weights() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama3.gguf");
    handoff_testmodels::write_preset(&path, "llama3").unwrap();
    let native = PhaseFormats {
        prefill: WeightFormat::Native,
        decode: WeightFormat::Native,
    };
    check_model(
        "llama3 native",
        &path,
        &[5, 17, 40, 70, 130, 300],
        10,
        Some(native),
    );
}

#[test]
fn llama3_rope_freqs() {
    preset("llama3");
}

#[test]
fn llama_yarn() {
    preset("llama-yarn");
}

#[test]
fn qwen2() {
    preset("qwen2");
}

#[test]
fn qwen3() {
    preset("qwen3");
}

#[test]
fn mistral() {
    preset("mistral");
}

#[test]
fn gemma3_sliding_window() {
    preset("gemma3");
}

fn gemma3_path() -> Option<PathBuf> {
    let path = std::env::var("HANDOFF_GEMMA3_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf")
        });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var("HANDOFF_REQUIRE_GEMMA3").as_deref() != Ok("1"),
        "{} is missing: run scripts/fetch-gemma3.sh",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing (scripts/fetch-gemma3.sh)",
        path.display()
    );
    None
}

/// The real Gemma 3 270M: a prompt past its 512-token window too.
#[test]
fn gemma3_270m_real() {
    if let Some(path) = gemma3_path() {
        check_model("gemma3 270M", &path, &[9, 70, 600], 8, None);
    }
}
