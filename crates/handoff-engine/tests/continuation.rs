//! Surviving a worker's death inside the engine, on SmolLM2-135M (the real
//! model: near-ties and stop strings are real there):
//!
//! * a generation continued from the tokens another worker already streamed
//!   (`output_so_far`, mid-stream migration) yields exactly the rest of the
//!   uninterrupted output: greedy, seeded sampling with penalties, a stop
//!   string, on the colocated engine and on a decode worker prefilling
//!   itself;
//! * a decode worker whose prefill is dead prefills the prompt itself
//!   (`OnTransferFailure::Recompute`, the default) and answers the
//!   colocated output; with `Fail` it reports the typed transfer error;
//! * a continuation that would have ended already is refused by name.
//!
//! The model is `HANDOFF_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf`.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use handoff_engine::pd::{DecodeEngine, DecodeHandle, OnTransferFailure, PdConfig};
use handoff_engine::request::Penalties;
use handoff_engine::{
    Engine, EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, RequestStream,
    SamplingParams, StreamEvent,
};
use handoff_proto::RoomId;
use handoff_transfer::TransportKind;

fn model_path() -> PathBuf {
    match std::env::var("HANDOFF_MODEL") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn config() -> EngineConfig {
    let path = model_path();
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        path.display()
    );
    let mut cfg = EngineConfig::new(path);
    cfg.page_size = 16;
    cfg.kv_pages = 96;
    cfg.threads = 2;
    cfg
}

/// What a stream gave: token ids, text, how it ended, the counts it reported.
#[derive(Debug, Clone, PartialEq)]
struct Out {
    ids: Vec<u32>,
    text: String,
    reason: FinishReason,
    prompt_tokens: usize,
    completion_tokens: usize,
}

fn drain(mut s: RequestStream) -> Result<Out, EngineError> {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Some(StreamEvent::Finished(f)) => {
                return Ok(Out {
                    ids,
                    text,
                    reason: f.reason,
                    prompt_tokens: f.prompt_tokens,
                    completion_tokens: f.completion_tokens,
                })
            }
            Some(StreamEvent::Error(e)) => return Err(e),
            None => panic!("the stream ended without Finished"),
        }
    }
}

fn prompt(engine: &EngineHandle, text: &str) -> Vec<u32> {
    engine.tokenizer().encode(text, true).unwrap()
}

/// The three kinds of request: greedy; seeded sampling with penalties; a
/// stop string the greedy output reaches.
fn requests(engine: &EngineHandle) -> Vec<(&'static str, GenerateRequest)> {
    let greedy = SamplingParams {
        max_new_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(1234),
        penalties: Penalties {
            repetition: 1.1,
            frequency: 0.2,
            ..Default::default()
        },
        ..greedy.clone()
    };
    vec![
        (
            "greedy",
            GenerateRequest::new(
                prompt(engine, "The lighthouse keeper climbed the stairs and"),
                greedy.clone(),
            ),
        ),
        (
            "sampled",
            GenerateRequest::new(prompt(engine, "Once upon a time, in a village"), sampled),
        ),
        (
            "stop string",
            GenerateRequest::new(
                prompt(engine, "List three colours: red,"),
                SamplingParams {
                    stop: vec![" the".into(), "\n\n".into()],
                    ..greedy
                },
            ),
        ),
    ]
}

fn continued(r: &GenerateRequest, done: &[u32]) -> GenerateRequest {
    let mut c = r.clone();
    c.arrived = Instant::now();
    c.output_so_far = done.to_vec();
    c
}

/// `rest`, the continuation of `whole` after `cut` tokens, is its tail:
/// the same ids and text, the same end, the whole generation's counts.
fn check_tail(name: &str, cut: usize, whole: &Out, rest: &Out, prefix_text: &str) {
    assert_eq!(rest.ids, whole.ids[cut..], "{name}: ids after {cut}");
    assert_eq!(
        format!("{prefix_text}{}", rest.text),
        whole.text,
        "{name}: text after {cut}"
    );
    assert_eq!(
        rest.reason, whole.reason,
        "{name}: finish reason after {cut}"
    );
    assert_eq!(
        (rest.prompt_tokens, rest.completion_tokens),
        (whole.prompt_tokens, whole.completion_tokens),
        "{name}: counts after {cut}"
    );
}

/// The text the client already had after `cut` tokens: what the
/// uninterrupted stream sent with them.
fn text_after(engine: &EngineHandle, r: &GenerateRequest, cut: usize) -> String {
    let mut s = engine.submit(r.clone()).unwrap();
    let mut text = String::new();
    for _ in 0..cut {
        match s.blocking_next() {
            Some(StreamEvent::Token(t)) => text.push_str(&t.text),
            other => panic!("expected a token, got {other:?}"),
        }
    }
    text
}

#[test]
fn continuing_a_generation_gives_the_rest_of_the_uninterrupted_one() {
    let colocated = Engine::start(config()).unwrap();
    let decode = DecodeEngine::start(config(), PdConfig::new(TransportKind::Tcp)).unwrap();
    for (name, r) in requests(&colocated) {
        let whole = drain(colocated.submit(r.clone()).unwrap()).unwrap();
        assert_eq!(whole.completion_tokens, whole.ids.len(), "{name}");
        assert!(whole.ids.len() > 5, "{name}: {whole:?}");
        if name == "stop string" {
            assert!(
                matches!(whole.reason, FinishReason::StopString { .. }),
                "{name}: the prompt must reach a stop string to test it: {whole:?}"
            );
        }
        // Decode prefilling itself (no prefill worker) is the colocated output.
        let local = drain(decode.submit_local(r.clone()).unwrap()).unwrap();
        assert_eq!(local, whole, "{name}: decode-local vs colocated");
        let last = whole.ids.len() - 1;
        for cut in [1, 5, last / 2, last] {
            let had = text_after(&colocated, &r, cut);
            let rest = drain(colocated.submit(continued(&r, &whole.ids[..cut])).unwrap()).unwrap();
            check_tail(name, cut, &whole, &rest, &had);
            let rest = drain(
                decode
                    .submit_local(continued(&r, &whole.ids[..cut]))
                    .unwrap(),
            )
            .unwrap();
            check_tail(&format!("{name} (decode)"), cut, &whole, &rest, &had);
        }
    }
    assert_eq!(decode.local_prefills().asked, 3 + 3 * 4);
    assert_eq!(decode.load().pages_used, 0, "every page came back");
}

#[test]
fn a_continuation_that_would_have_ended_is_refused_by_name() {
    let colocated = Engine::start(config()).unwrap();
    let eos = colocated.tokenizer().eog_ids()[0];
    let mut r = GenerateRequest::new(
        prompt(&colocated, "Hello"),
        SamplingParams {
            max_new_tokens: 8,
            ..Default::default()
        },
    );
    r.output_so_far = vec![eos];
    let e = drain(colocated.submit(r.clone()).unwrap()).unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "resume_output_ids[0] (token {eos}) ends the generation"
        )),
        "{e}"
    );
    r.output_so_far = vec![100; 8];
    let e = colocated.submit(r.clone()).unwrap_err();
    assert!(e.to_string().contains("leaves nothing to generate"), "{e}");
    r.output_so_far = vec![u32::MAX];
    let e = colocated.submit(r).unwrap_err();
    assert!(matches!(e, EngineError::TokenOutOfRange { .. }), "{e:?}");
}

fn room() -> RoomId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    RoomId::new(((std::process::id() as u64) << 32) | NEXT.fetch_add(1, Ordering::Relaxed)).unwrap()
}

/// An address where nothing listens (bound, then closed).
fn dead_address() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a
}

fn decode_with(on_failure: OnTransferFailure) -> DecodeHandle {
    let mut pd = PdConfig::new(TransportKind::Tcp);
    pd.on_transfer_failure = on_failure;
    DecodeEngine::start(config(), pd).unwrap()
}

#[test]
fn a_dead_prefill_costs_no_request_unless_the_request_says_fail() {
    let colocated = Engine::start(config()).unwrap();
    let reqs = requests(&colocated);
    let decode = decode_with(OnTransferFailure::Recompute);
    let dead = dead_address();
    for (name, r) in &reqs {
        let whole = drain(colocated.submit(r.clone()).unwrap()).unwrap();
        let got = drain(decode.submit(r.clone(), room(), dead).unwrap()).unwrap();
        assert_eq!(got, whole, "{name}: recomputed on decode vs colocated");
    }
    assert_eq!(decode.local_prefills().recomputed, reqs.len() as u64);
    assert_eq!(decode.local_prefills().asked, 0);
    // Per request: `fail` ends it with the transfer's error.
    let (_, r) = &reqs[0];
    let e = drain(
        decode
            .submit_pd(r.clone(), room(), dead, Some(OnTransferFailure::Fail))
            .unwrap(),
    )
    .unwrap_err();
    assert!(
        matches!(e, EngineError::Transport(_) | EngineError::Transfer(_)),
        "{e:?}"
    );
    // Per server: `fail` by default, `recompute` when the request asks.
    let strict = decode_with(OnTransferFailure::Fail);
    let e = drain(strict.submit(r.clone(), room(), dead).unwrap()).unwrap_err();
    assert!(
        matches!(e, EngineError::Transport(_) | EngineError::Transfer(_)),
        "{e:?}"
    );
    let whole = drain(colocated.submit(r.clone()).unwrap()).unwrap();
    let got = drain(
        strict
            .submit_pd(r.clone(), room(), dead, Some(OnTransferFailure::Recompute))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(got, whole);
    assert_eq!(strict.local_prefills().recomputed, 1);
    assert_eq!(decode.load().pages_used, 0);
    assert_eq!(strict.load().pages_used, 0);
}
