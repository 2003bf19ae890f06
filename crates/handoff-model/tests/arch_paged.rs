//! The paged forward of every architecture against the textbook reference
//! (`Llama::reference_logits`: whole sequence, contiguous K/V, the sliding
//! window as a plain mask), prefill in uneven chunks over scattered pages
//! and then decode steps. Besides the llama.cpp presets, a Mistral-layout
//! file that sets `llama.attention.sliding_window` (llama.cpp ignores that
//! key, so only this test checks handoff's window on every layer).

use handoff_kv::{KvDtype, KvPool, PageIndex};
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk, WeightFormat};
use handoff_testmodels::ModelSpec;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(name: &str, spec: &ModelSpec) {
    let dir = tempfile_dir(name);
    let path = dir.join("m.gguf");
    handoff_testmodels::write_model(&path, spec).unwrap();
    // f32 prefill and decode: the two paths then differ only in attention
    // and page layout, which is what this test is about.
    let formats = PhaseFormats {
        prefill: WeightFormat::F32,
        decode: WeightFormat::F32,
    };
    let (model, _) = Llama::load(&path, formats).unwrap();
    let n: usize = 90;
    let tokens: Vec<u32> = (0..n as u32).map(|i| 3 + (i * 37 + 11) % 290).collect();
    let reference = model.reference_logits(&tokens, Phase::Prefill).unwrap();
    let page_size = 16;
    let pool_pages = n.div_ceil(page_size) * 2 + 1;
    let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F32), pool_pages).unwrap();
    let pages: Vec<PageIndex> = (0..n.div_ceil(page_size))
        .map(|i| PageIndex((i * 2 + 1) as u32))
        .collect();
    let mut start = 0;
    for len in [30, 1, 44] {
        let chunk = SeqChunk {
            tokens: &tokens[start..start + len],
            start_pos: start,
            pages: &pages,
        };
        let logits = model.forward(&mut pool, &[chunk], Phase::Prefill).unwrap();
        start += len;
        let d = max_diff(&logits[0], &reference[start - 1]);
        assert!(d < 2e-3, "{name}: prefill to {start}: max |diff| {d}");
    }
    for pos in start..n {
        let chunk = SeqChunk {
            tokens: &tokens[pos..pos + 1],
            start_pos: pos,
            pages: &pages,
        };
        let logits = model.forward(&mut pool, &[chunk], Phase::Decode).unwrap();
        let d = max_diff(&logits[0], &reference[pos]);
        assert!(d < 2e-3, "{name}: decode at {pos}: max |diff| {d}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("handoff-arch-paged-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_preset_pages_like_the_reference() {
    for &name in handoff_testmodels::PRESETS {
        check(name, &ModelSpec::preset(name).unwrap());
    }
}

#[test]
fn a_mistral_window_applies_to_every_layer() {
    let mut spec = ModelSpec::preset("mistral").unwrap();
    spec.sliding_window = Some(20);
    check("mistral-window", &spec);
    // The window changes the output: without it the late logits differ.
    let dir = tempfile_dir("mistral-window-effect");
    let (with, without) = (dir.join("w.gguf"), dir.join("n.gguf"));
    handoff_testmodels::write_model(&with, &spec).unwrap();
    handoff_testmodels::write_model(&without, &ModelSpec::preset("mistral").unwrap()).unwrap();
    let tokens: Vec<u32> = (0..60u32).map(|i| 3 + (i * 53 + 5) % 290).collect();
    let logits = |p: &std::path::Path| {
        let (m, _) = Llama::load(p, PhaseFormats::default()).unwrap();
        m.reference_logits(&tokens, Phase::Prefill).unwrap()
    };
    let (a, b) = (logits(&with), logits(&without));
    assert_eq!(a[10], b[10], "inside the window nothing changes");
    assert!(max_diff(&a[59], &b[59]) > 0.05, "the window had no effect");
    std::fs::remove_dir_all(&dir).ok();
}
