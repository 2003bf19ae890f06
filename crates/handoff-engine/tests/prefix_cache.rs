//! The colocated engine's prefix cache on the tiny seeded model: greedy
//! output with the cache on equals output with it off, token for token, for
//! repeated prompts, prompts sharing 1..n pages and a prompt that is a prefix
//! of another, at concurrency 16, for page sizes 1, 16 and 64 and for f16 and
//! f32 KV; hits are reported; eviction under memory pressure never takes a
//! page a running request reads; `flush_cache` empties it.

use std::time::{Duration, Instant};

use handoff_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateRequest, SamplingParams, StreamEvent,
};
use handoff_kv::KvDtype;
use handoff_model::tiny::write_tiny_gguf;

fn engine(
    page_size: usize,
    kv_pages: usize,
    dtype: KvDtype,
    cache: bool,
) -> (EngineHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, 11).unwrap();
    let mut cfg = EngineConfig::new(&path);
    cfg.page_size = page_size;
    cfg.kv_pages = kv_pages;
    cfg.kv_dtype = dtype;
    cfg.prefix_cache = cache;
    cfg.prefill_chunk = 16;
    cfg.threads = 1;
    (Engine::start(cfg).unwrap(), dir)
}

fn req(prompt: Vec<u32>, max_new: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        sampling: SamplingParams {
            max_new_tokens: max_new,
            ignore_eos: true,
            ..Default::default()
        },
        arrived: Instant::now(),
    }
}

fn tokens(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 250)
        .collect()
}

/// (output ids, finish reason, cached prompt tokens)
type Out = (Vec<u32>, FinishReason, usize);

fn run(h: &EngineHandle, r: GenerateRequest) -> Out {
    let mut s = h.submit(r).unwrap();
    let mut ids = Vec::new();
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => ids.push(t.id),
            Some(StreamEvent::Finished(f)) => {
                assert_eq!(f.completion_tokens, ids.len());
                return (ids, f.reason, f.cached_tokens);
            }
            Some(StreamEvent::Error(e)) => panic!("unexpected error {e}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

fn idle(h: &EngineHandle) {
    let t = Instant::now();
    while h.load().pages_used != 0 || h.load().running + h.load().waiting != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not idle: {:?}",
            h.load()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The workload: a system prompt shared by conversations whose turns grow
/// (each turn's prompt is the previous prompt plus more), repeats, prompts
/// sharing 1, 2 and 3 pages of `page_size`, and one that is a prefix of
/// another.
fn workload(page_size: usize) -> Vec<GenerateRequest> {
    let system = tokens(40, 1);
    let mut out = Vec::new();
    for conv in 0..3u32 {
        let mut history = system.clone();
        for turn in 0..3u32 {
            history.extend(tokens(9 + turn as usize, 10 + conv * 3 + turn));
            out.push(req(history.clone(), 5));
        }
    }
    let base = tokens(3 * page_size + 5, 7);
    for shared in 1..=3 {
        let mut p = base[..shared * page_size].to_vec();
        p.extend(tokens(page_size / 2 + 2, 20 + shared as u32));
        out.push(req(p, 4));
    }
    out.push(req(base.clone(), 4));
    out.push(req(base.clone(), 4)); // repeated
    out.push(req(base[..2 * page_size + 1].to_vec(), 4)); // a prefix of `base`
    out
}

fn outputs_match(page_size: usize, dtype: KvDtype) {
    let reqs = workload(page_size);
    let pages = 4096 / page_size;
    let (off, _d1) = engine(page_size, pages, dtype, false);
    let want: Vec<Out> = reqs.iter().map(|r| run(&off, r.clone())).collect();
    assert!(want.iter().all(|w| w.2 == 0), "no hits with the cache off");
    let (on, _d2) = engine(page_size, pages, dtype, true);
    // One by one: later turns hit the earlier ones.
    let got: Vec<Out> = reqs.iter().map(|r| run(&on, r.clone())).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            (&g.0, &g.1),
            (&w.0, &w.1),
            "request {i}, page size {page_size}"
        );
    }
    let hits: usize = got.iter().map(|g| g.2).sum();
    assert!(hits > 0, "page size {page_size}: no prefix hit at all");
    // The second turn of conversation 0 reuses at least the system prompt's
    // whole pages.
    assert!(got[1].2 >= 40 / page_size * page_size, "{:?}", got[1]);
    idle(&on);
    assert!(on.load().pages_cached > 0);
    // Concurrency 16, everything at once, warm cache and cold.
    for _ in 0..2 {
        let conc: Vec<Out> = std::thread::scope(|sc| {
            let hs: Vec<_> = reqs
                .iter()
                .map(|r| sc.spawn(|| run(&on, r.clone())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (g, w)) in conc.iter().zip(&want).enumerate() {
            assert_eq!((&g.0, &g.1), (&w.0, &w.1), "concurrent request {i}");
        }
        idle(&on);
        let freed = tokio_block(on.flush_cache()).unwrap();
        assert!(freed > 0, "flush freed nothing");
        assert_eq!(on.load().pages_cached, 0);
    }
}

fn tokio_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn cache_on_equals_cache_off_page_size_1() {
    outputs_match(1, KvDtype::F16);
}

#[test]
fn cache_on_equals_cache_off_page_size_16() {
    outputs_match(16, KvDtype::F16);
    outputs_match(16, KvDtype::F32);
}

#[test]
fn cache_on_equals_cache_off_page_size_64() {
    outputs_match(64, KvDtype::F16);
}

#[test]
fn a_repeated_prompt_reuses_its_whole_pages_and_flush_reports_them() {
    let (h, _d) = engine(16, 256, KvDtype::F16, true);
    let p = tokens(50, 3); // 3 full pages + 2 tokens
    let first = run(&h, req(p.clone(), 4));
    assert_eq!(first.2, 0);
    let again = run(&h, req(p.clone(), 4));
    assert_eq!(again.0, first.0);
    assert_eq!(again.2, 48, "3 whole pages came from the cache");
    // Exactly 48 tokens: the last page is recomputed for the first token.
    let exact = run(&h, req(p[..48].to_vec(), 4));
    assert_eq!(exact.2, 32);
    idle(&h);
    let l = h.load();
    assert_eq!(l.pages_used, 0, "cached pages nobody reads are not 'used'");
    assert_eq!(l.pages_cached, 3);
    assert_eq!(tokio_block(h.flush_cache()).unwrap(), 3);
    assert_eq!(tokio_block(h.flush_cache()).unwrap(), 0);
    assert_eq!(run(&h, req(p, 4)).2, 0, "flushed: a miss again");
}

#[test]
fn eviction_under_memory_pressure_keeps_running_requests_intact() {
    // A pool of 40 pages of 4 tokens: 16 distinct prompts of 10 pages each
    // cannot all stay cached, so admission evicts while others run.
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| {
            let mut p = tokens(24, 100); // 6 shared pages
            p.extend(tokens(14, 200 + i));
            req(p, 6)
        })
        .collect();
    let (off, _d1) = engine(4, 40, KvDtype::F16, false);
    let want: Vec<Out> = reqs.iter().map(|r| run(&off, r.clone())).collect();
    let (on, _d2) = engine(4, 40, KvDtype::F16, true);
    for round in 0..3 {
        let got: Vec<Out> = std::thread::scope(|sc| {
            let hs: Vec<_> = reqs
                .iter()
                .map(|r| sc.spawn(|| run(&on, r.clone())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((&g.0, &g.1), (&w.0, &w.1), "round {round}, request {i}");
        }
        idle(&on);
        // 6 shared + 16 x 3 own full pages would be 54: some were evicted.
        let cached = on.load().pages_cached;
        assert!(cached < 54 && cached > 0, "{cached} pages cached");
    }
}
