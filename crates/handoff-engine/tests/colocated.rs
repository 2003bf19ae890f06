//! The colocated engine on the tiny seeded model: continuous batching gives
//! each request the output it gets alone, pages come back, limits are
//! enforced before queueing, cancellation frees pages; the prefix cache
//! changes no output.

use std::time::{Duration, Instant};

use handoff_engine::{
    Engine, EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, SamplingParams,
    StreamEvent,
};
use handoff_kv::KvDtype;
use handoff_model::tiny::write_tiny_gguf;

fn engine(page_size: usize, kv_pages: usize, chunk: usize) -> (EngineHandle, tempfile::TempDir) {
    engine_with(page_size, kv_pages, chunk, |_| {})
}

fn engine_with(
    page_size: usize,
    kv_pages: usize,
    chunk: usize,
    tweak: impl FnOnce(&mut EngineConfig),
) -> (EngineHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, 11).unwrap();
    let mut cfg = EngineConfig::new(&path);
    cfg.page_size = page_size;
    cfg.kv_pages = kv_pages;
    cfg.prefill_chunk = chunk;
    cfg.threads = 1;
    tweak(&mut cfg);
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
        output_so_far: Vec::new(),
        class: Default::default(),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 250)
        .collect()
}

/// Collect a stream: (token ids, text, finish reason).
fn collect(h: &EngineHandle, r: GenerateRequest) -> (Vec<u32>, String, FinishReason) {
    drain(h.submit(r).unwrap())
}

/// Read a submitted request's stream to its end.
fn drain(s: handoff_engine::handle::RequestStream) -> (Vec<u32>, String, FinishReason) {
    drain_from(s, Vec::new(), String::new())
}

/// `drain` for a stream whose first tokens (`ids`, `text`) were already read.
fn drain_from(
    mut s: handoff_engine::handle::RequestStream,
    mut ids: Vec<u32>,
    mut text: String,
) -> (Vec<u32>, String, FinishReason) {
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Some(StreamEvent::Finished(f)) => {
                assert_eq!(f.completion_tokens, ids.len());
                return (ids, text, f.reason);
            }
            Some(StreamEvent::Error(e)) => panic!("unexpected error {e}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

fn wait_for_pages_free(h: &EngineHandle) {
    let t = Instant::now();
    while h.load().pages_used != 0 || h.load().running + h.load().waiting != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "pages still in use: {:?}",
            h.load()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_requests_get_their_solo_outputs_and_pages_return() {
    let (h, _d) = engine(4, 512, 16);
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| req(prompt(5 + i * 3, i as u32), 12 + i % 5))
        .collect();
    let solo: Vec<_> = reqs.iter().map(|r| collect(&h, r.clone())).collect();
    for (r, (ids, _, reason)) in reqs.iter().zip(&solo) {
        assert_eq!(ids.len(), r.sampling.max_new_tokens);
        assert_eq!(*reason, FinishReason::Length);
    }
    assert_eq!(h.load().pages_used, 0);
    let before = h.load();
    // All 16 at once, from 16 threads.
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs
            .iter()
            .map(|r| s.spawn(|| collect(&h, r.clone())))
            .collect();
        hs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(
            a.0, b.0,
            "request {i}: batched output differs from solo output"
        );
        assert_eq!(a.1, b.1);
    }
    // Prompts that wait together share prefill passes (the default format
    // computes rows on their own), and keep their solo outputs above.
    let after = h.load();
    let passes = after.prefill_passes - before.prefill_passes;
    let sequences = after.prefill_pass_sequences - before.prefill_pass_sequences;
    assert!(
        sequences > passes,
        "{sequences} sequences in {passes} passes: no pass held two prompts"
    );
    wait_for_pages_free(&h);
}

#[test]
fn limits_are_enforced_before_queueing() {
    let (h, _d) = engine(4, 8, 16);
    let ctx = h.model().context_length;
    let e = h.submit(req(prompt(ctx, 0), 1)).unwrap_err();
    assert_eq!(
        e,
        EngineError::ContextExceeded {
            prompt_tokens: ctx,
            max_new_tokens: 1,
            context_length: ctx
        }
    );
    assert_eq!(e.http_status(), 400);
    assert!(e
        .to_string()
        .contains(&format!("context length of {ctx} tokens")));
    // 8 pages of 4 tokens: 40 tokens can never fit.
    let e = h.submit(req(prompt(30, 0), 10)).unwrap_err();
    assert_eq!(
        e,
        EngineError::ExceedsKvCapacity {
            needed_pages: 10,
            total_pages: 8
        }
    );
    assert_eq!(
        h.submit(req(vec![], 3)).unwrap_err(),
        EngineError::EmptyPrompt
    );
    let e = h.submit(req(vec![3, 100_000], 3)).unwrap_err();
    assert_eq!(e.error_type(), "invalid_token_id");
    let mut r = req(prompt(3, 0), 3);
    r.sampling.top_p = 0.0;
    assert!(
        matches!(h.submit(r).unwrap_err(), EngineError::InvalidParams(m) if m.contains("top_p"))
    );
    assert_eq!(h.load().pages_used, 0);
    assert_eq!(h.load().waiting, 0);
}

#[test]
fn requests_that_do_not_fit_now_wait_and_then_run() {
    // 12 pages of 4 tokens; each request needs 8 pages: only one runs at a time.
    let (h, _d) = engine(4, 12, 16);
    let reqs: Vec<_> = (0..3).map(|i| req(prompt(20, i), 12)).collect();
    let solo: Vec<_> = reqs.iter().map(|r| collect(&h, r.clone()).0).collect();
    // All three submitted at once: two must wait while one runs.
    let streams: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    let mut most_waiting = 0;
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = streams
            .into_iter()
            .map(|st| s.spawn(move || drain(st).0))
            .collect();
        while hs.iter().any(|j| !j.is_finished()) {
            let load = h.load();
            assert!(
                load.running <= 1,
                "two requests of 8 pages ran in 12: {load:?}"
            );
            most_waiting = most_waiting.max(load.waiting);
            std::thread::sleep(Duration::from_micros(200));
        }
        hs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(solo, together);
    assert!(most_waiting >= 1, "no request was ever seen waiting");
    wait_for_pages_free(&h);
}

#[test]
fn dropping_the_stream_cancels_and_frees_pages() {
    let (h, _d) = engine(4, 512, 16);
    let mut s = h.submit(req(prompt(40, 1), 500)).unwrap();
    // Wait for the first token, then walk away.
    loop {
        if let Some(StreamEvent::Token(_)) = s.blocking_next() {
            break;
        }
    }
    assert!(h.load().pages_used > 0);
    drop(s);
    wait_for_pages_free(&h);
    assert_eq!(h.load().running, 0);
}

/// A reader that stops taking tokens pauses its request after a full buffer:
/// the engine generates no further while the neighbour runs on, and once the
/// reader drains the request resumes and loses nothing.
#[test]
fn a_reader_that_lags_pauses_its_request_and_loses_nothing() {
    use handoff_engine::events::STREAM_BUFFER;
    let (h, _d) = engine(4, 512, 16);
    let n = STREAM_BUFFER * 4;
    let solo = collect(&h, req(prompt(20, 3), n));
    let mut lagging = h.submit(req(prompt(20, 3), n)).unwrap();
    // Never read: the request must pause with a full buffer.
    let t = Instant::now();
    while h.load().paused == 0 {
        assert!(t.elapsed() < Duration::from_secs(60), "never paused");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(h.load().running, 1);
    // A neighbour runs to its end while the lagging one stays paused.
    let neighbour = collect(&h, req(prompt(12, 9), 40));
    assert_eq!(neighbour.0.len(), 40);
    assert_eq!(h.load().paused, 1, "the unread request was stepped");
    // Exactly a buffer's worth was generated: nothing past it, nothing lost.
    let (mut ids, mut text) = (Vec::new(), String::new());
    for _ in 0..STREAM_BUFFER {
        match lagging.blocking_next() {
            Some(StreamEvent::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            other => panic!("expected a token, got {other:?}"),
        }
    }
    assert_eq!(ids[..], solo.0[..STREAM_BUFFER]);
    // Reading on resumes it: the rest arrives in order, then `Finished`.
    assert_eq!(drain_from(lagging, ids, text), solo);
    wait_for_pages_free(&h);
    assert_eq!(h.load().paused, 0);
}

#[test]
fn stop_strings_and_stop_ids_end_generation() {
    let (h, _d) = engine(4, 512, 16);
    let base = req(prompt(10, 3), 30);
    let (ids, text, _) = collect(&h, base.clone());
    assert!(
        text.chars().count() > 4,
        "tiny model produced text {text:?}"
    );
    // Stop at the third generated token's id.
    let mut r = base.clone();
    r.sampling.stop_token_ids = vec![ids[2]];
    let first_hit = ids.iter().position(|&t| t == ids[2]).unwrap();
    let (ids2, _, reason) = collect(&h, r);
    assert_eq!(reason, FinishReason::Eos { token: ids[2] });
    assert_eq!(ids2, ids[..=first_hit].to_vec());
    // A stop string taken from the middle of the text: output ends right before it.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[2..4].iter().collect();
    let mut r = base.clone();
    r.sampling.stop = vec![stop.clone()];
    let (_, text3, reason) = collect(&h, r);
    assert_eq!(
        reason,
        FinishReason::StopString {
            matched: stop.clone()
        }
    );
    let cut = text.find(&stop).unwrap();
    assert_eq!(text3, text[..cut]);
}

#[test]
fn same_seed_same_sampled_output() {
    let (h, _d) = engine(4, 512, 16);
    let mut r = req(prompt(8, 5), 20);
    r.sampling.temperature = 1.0;
    r.sampling.top_k = 20;
    r.sampling.seed = Some(42);
    let a = collect(&h, r.clone()).0;
    let b = collect(&h, r.clone()).0;
    assert_eq!(a, b);
    r.sampling.seed = Some(43);
    assert_ne!(a, collect(&h, r).0);
}

#[test]
fn a_full_waiting_queue_refuses_with_503() {
    // 60 pages of 4 tokens; each request needs 55: one runs, the rest wait.
    let (h, _d) = engine_with(4, 60, 16, |c| c.max_waiting = 2);
    let mut streams = Vec::new();
    let t = Instant::now();
    let err = loop {
        match h.submit(req(prompt(20, 1), 200)) {
            Ok(s) => streams.push(s),
            Err(e) => break e,
        }
        assert!(t.elapsed() < Duration::from_secs(10), "never refused");
    };
    assert!(
        matches!(err, EngineError::Overloaded { limit: 2, waiting } if waiting >= 2),
        "{err:?}"
    );
    assert_eq!(err.http_status(), 503);
    assert_eq!(err.error_type(), "overloaded");
    drop(streams);
    wait_for_pages_free(&h);
    // Once the queue drained, requests are taken again.
    assert_eq!(collect(&h, req(prompt(5, 2), 3)).0.len(), 3);
}

// The prefix cache: greedy output with the cache on equals output with it
// off, token for token, for repeated prompts, prompts sharing 1..n pages and
// a prompt that is a prefix of another, at concurrency 16, for page sizes 1,
// 16 and 64 and for f16 and f32 KV; hits are reported; eviction under memory
// pressure never takes a page a running request reads; `flush_cache` empties
// it.

fn cached_engine(
    page_size: usize,
    kv_pages: usize,
    dtype: KvDtype,
    cache: bool,
) -> (EngineHandle, tempfile::TempDir) {
    engine_with(page_size, kv_pages, 16, |c| {
        c.kv_dtype = dtype;
        c.prefix_cache = cache;
    })
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

/// The workload: a system prompt shared by conversations whose turns grow
/// (each turn's prompt is the previous prompt plus more), repeats, prompts
/// sharing 1, 2 and 3 pages of `page_size`, and one that is a prefix of
/// another.
fn workload(page_size: usize) -> Vec<GenerateRequest> {
    let system = prompt(40, 1);
    let mut out = Vec::new();
    for conv in 0..3u32 {
        let mut history = system.clone();
        for turn in 0..3u32 {
            history.extend(prompt(9 + turn as usize, 10 + conv * 3 + turn));
            out.push(req(history.clone(), 5));
        }
    }
    let base = prompt(3 * page_size + 5, 7);
    for shared in 1..=3 {
        let mut p = base[..shared * page_size].to_vec();
        p.extend(prompt(page_size / 2 + 2, 20 + shared as u32));
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
    let (off, _d1) = cached_engine(page_size, pages, dtype, false);
    let want: Vec<Out> = reqs.iter().map(|r| run(&off, r.clone())).collect();
    assert!(want.iter().all(|w| w.2 == 0), "no hits with the cache off");
    let (on, _d2) = cached_engine(page_size, pages, dtype, true);
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
    wait_for_pages_free(&on);
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
        wait_for_pages_free(&on);
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
    let (h, _d) = cached_engine(16, 256, KvDtype::F16, true);
    let p = prompt(50, 3); // 3 full pages + 2 tokens
    let first = run(&h, req(p.clone(), 4));
    assert_eq!(first.2, 0);
    let again = run(&h, req(p.clone(), 4));
    assert_eq!(again.0, first.0);
    assert_eq!(again.2, 48, "3 whole pages came from the cache");
    // Exactly 48 tokens: the last page is recomputed for the first token.
    let exact = run(&h, req(p[..48].to_vec(), 4));
    assert_eq!(exact.2, 32);
    wait_for_pages_free(&h);
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
            let mut p = prompt(24, 100); // 6 shared pages
            p.extend(prompt(14, 200 + i));
            req(p, 6)
        })
        .collect();
    let (off, _d1) = cached_engine(4, 40, KvDtype::F16, false);
    let want: Vec<Out> = reqs.iter().map(|r| run(&off, r.clone())).collect();
    let (on, _d2) = cached_engine(4, 40, KvDtype::F16, true);
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
        wait_for_pages_free(&on);
        // 6 shared + 16 x 3 own full pages would be 54: some were evicted.
        let cached = on.load().pages_cached;
        assert!(cached < 54 && cached > 0, "{cached} pages cached");
    }
}

#[test]
fn waiting_requests_go_by_priority_then_fair_share_then_arrival() {
    use handoff_engine::fair::Class;
    // One request runs at a time.
    let (h, _d) = engine_with(4, 64, 16, |c| c.max_batch = 1);
    let class = |priority, tenant: &str| Class {
        priority,
        tenant: Some(tenant.into()),
    };
    let with = |mut r: GenerateRequest, c| {
        r.class = c;
        r
    };
    // Tenant a's first request takes the batch and keeps it while the rest
    // queue (its stream is not read, so it pauses once its channel fills).
    let mut first = h
        .submit(with(req(prompt(8, 0), 200), class(0, "a")))
        .unwrap();
    let Some(StreamEvent::Token(t0)) = first.blocking_next() else {
        panic!("no first token");
    };
    let queued = [
        ("a1", class(0, "a")),
        ("a2", class(0, "a")),
        ("a-high", class(5, "a")),
        ("b1", class(0, "b")),
        ("a-low", class(-1, "a")),
    ];
    let streams: Vec<_> = queued
        .iter()
        .enumerate()
        .map(|(i, (name, c))| {
            let s = h
                .submit(with(req(prompt(8, 1 + i as u32), 4), c.clone()))
                .unwrap();
            (*name, s)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.load().waiting < queued.len() {
        assert!(Instant::now() < deadline, "{:?}", h.load());
        std::thread::sleep(Duration::from_millis(1));
    }
    let started: Vec<(Instant, &str)> = std::thread::scope(|s| {
        let hs: Vec<_> = streams
            .into_iter()
            .map(|(name, mut st)| {
                s.spawn(move || {
                    let Some(StreamEvent::Token(t)) = st.blocking_next() else {
                        panic!("{name}: no first token");
                    };
                    let at = Instant::now();
                    drain_from(st, vec![t.id], t.text);
                    (at, name)
                })
            })
            .collect();
        drain_from(first, vec![t0.id], t0.text);
        hs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut order = started;
    order.sort();
    let order: Vec<&str> = order.into_iter().map(|(_, n)| n).collect();
    // a-high first (priority 5); then b, whose tenant has had nothing while
    // a had two turns; then a's in arrival order, the lower priority last.
    assert_eq!(order, ["a-high", "b1", "a1", "a2", "a-low"]);
    wait_for_pages_free(&h);
}
