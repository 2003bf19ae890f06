//! The colocated engine on the tiny seeded model: continuous batching gives
//! each request the output it gets alone, pages come back, limits are
//! enforced before queueing, cancellation frees pages.

use std::time::{Duration, Instant};

use handoff_engine::{
    Engine, EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, SamplingParams,
    StreamEvent,
};
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
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 250)
        .collect()
}

/// Collect a stream: (token ids, text, finish reason).
fn collect(h: &EngineHandle, r: GenerateRequest) -> (Vec<u32>, String, FinishReason) {
    let mut s = h.submit(r).unwrap();
    let (mut ids, mut text) = (Vec::new(), String::new());
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
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs
            .iter()
            .map(|r| s.spawn(|| collect(&h, r.clone()).0))
            .collect();
        hs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(solo, together);
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
