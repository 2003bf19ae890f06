//! The paged forward equals the unpaged reference, for several page sizes,
//! chunkings and scattered page orders; batched decode equals one-by-one decode.

use handoff_kv::{KvDtype, KvPool, PageIndex};
use handoff_model::tiny::write_tiny_gguf;
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk, WeightFormat};

fn tiny(formats: PhaseFormats) -> Llama {
    let dir = std::env::temp_dir().join(format!("handoff-tiny-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!(
        "tiny-{:?}-{:?}.gguf",
        formats.prefill, formats.decode
    ));
    write_tiny_gguf(&path, 7).unwrap();
    Llama::load(&path, formats).unwrap().0
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 37 + salt * 11) % 250)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Pages handed out in a scrambled order so page i of a sequence is not pool page i.
fn scattered_pages(n: usize, pool_pages: usize) -> Vec<PageIndex> {
    (0..n)
        .map(|i| PageIndex(((i * 7 + 3) % pool_pages) as u32))
        .collect()
}

#[test]
fn paged_prefill_matches_unpaged_reference_for_several_page_sizes() {
    let formats = PhaseFormats {
        prefill: WeightFormat::F32,
        decode: WeightFormat::Q8_0,
    };
    let model = tiny(formats);
    let tokens = prompt(75, 1);
    let reference = model.reference_logits(&tokens, Phase::Prefill).unwrap();
    for page_size in [1, 4, 16, 64] {
        let pool_pages = 75usize.div_ceil(page_size) * 2 + 1;
        let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F32), pool_pages).unwrap();
        let pages = scattered_pages(75usize.div_ceil(page_size), pool_pages);
        // Prefill in uneven chunks: 30 + 1 + 44 tokens.
        let mut start = 0;
        for len in [30, 1, 44] {
            let chunk = SeqChunk {
                tokens: &tokens[start..start + len],
                start_pos: start,
                pages: &pages,
            };
            let logits = model.forward(&mut pool, &[chunk], Phase::Prefill).unwrap();
            start += len;
            let diff = max_diff(&logits[0], &reference[start - 1]);
            assert!(
                diff < 1e-3,
                "page size {page_size}, position {}: max |diff| {diff}",
                start - 1
            );
        }
    }
}

#[test]
fn paged_decode_matches_reference_and_batching_changes_nothing() {
    let formats = PhaseFormats {
        prefill: WeightFormat::Q8_0,
        decode: WeightFormat::Q8_0,
    };
    let model = tiny(formats);
    let page_size = 4;
    let lens = [5usize, 17, 9];
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| prompt(l + 6, i as u32))
        .collect();
    // One by one.
    let mut solo = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F32), 64).unwrap();
        let pages: Vec<PageIndex> = (0..8).map(|p| PageIndex(p * 3 + 1)).collect();
        let pre = &s[..lens[i]];
        model
            .forward(
                &mut pool,
                &[SeqChunk {
                    tokens: pre,
                    start_pos: 0,
                    pages: &pages,
                }],
                Phase::Prefill,
            )
            .unwrap();
        let mut outs = Vec::new();
        for pos in lens[i]..s.len() {
            let c = SeqChunk {
                tokens: &s[pos..pos + 1],
                start_pos: pos,
                pages: &pages,
            };
            outs.push(
                model
                    .forward(&mut pool, &[c], Phase::Decode)
                    .unwrap()
                    .remove(0),
            );
        }
        let reference = model.reference_logits(s, Phase::Decode).unwrap();
        for (j, o) in outs.iter().enumerate() {
            let diff = max_diff(o, &reference[lens[i] + j]);
            assert!(diff < 1e-3, "seq {i} step {j}: max |diff| {diff}");
        }
        solo.push(outs);
    }
    // All three in one pool, decoded as a batch.
    let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F32), 64).unwrap();
    let pages: Vec<Vec<PageIndex>> = (0..3)
        .map(|i| (0..8).map(|p| PageIndex((p * 3 + i) as u32)).collect())
        .collect();
    for i in 0..3 {
        let c = SeqChunk {
            tokens: &seqs[i][..lens[i]],
            start_pos: 0,
            pages: &pages[i],
        };
        model.forward(&mut pool, &[c], Phase::Prefill).unwrap();
    }
    for step in 0..6 {
        let chunks: Vec<SeqChunk<'_>> = (0..3)
            .map(|i| SeqChunk {
                tokens: &seqs[i][lens[i] + step..lens[i] + step + 1],
                start_pos: lens[i] + step,
                pages: &pages[i],
            })
            .collect();
        let out = model.forward(&mut pool, &chunks, Phase::Decode).unwrap();
        for i in 0..3 {
            assert_eq!(
                out[i], solo[i][step],
                "seq {i} step {step}: batched decode differs from solo decode"
            );
        }
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let model = tiny(PhaseFormats::default());
    let mut pool = KvPool::new(model.kv_geometry(4, KvDtype::F32), 4).unwrap();
    let pages = [PageIndex(0)];
    let too_long = prompt(5, 0);
    let e = model.forward(
        &mut pool,
        &[SeqChunk {
            tokens: &too_long,
            start_pos: 0,
            pages: &pages,
        }],
        Phase::Prefill,
    );
    assert!(e.unwrap_err().to_string().contains("cannot hold 5 tokens"));
    let bad_page = [PageIndex(9)];
    let e = model.forward(
        &mut pool,
        &[SeqChunk {
            tokens: &[3],
            start_pos: 0,
            pages: &bad_page,
        }],
        Phase::Decode,
    );
    assert!(e.unwrap_err().to_string().contains("out of range"));
    let e = model.forward(
        &mut pool,
        &[SeqChunk {
            tokens: &[99_999],
            start_pos: 0,
            pages: &pages,
        }],
        Phase::Decode,
    );
    assert!(e.unwrap_err().to_string().contains("token id 99999"));
}

#[test]
fn unsupported_architectures_are_named_in_the_error() {
    use candle_core::quantized::gguf_file::{self, Value};
    let dir = tempfile_dir();
    let path = dir.join("gpt2.gguf");
    let arch = Value::String("gpt2".into());
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[]).unwrap();
    drop(f);
    let err = Llama::load(&path, PhaseFormats::default()).err().unwrap();
    assert_eq!(
        err.to_string(),
        "unsupported model architecture \"gpt2\": handoff runs llama, mistral, qwen2, qwen3 and gemma3"
    );
    // A key the implementation does not read is refused by name, and a
    // non-causal model is refused even though the key is known.
    for (key, value, needle) in [
        (
            "llama.attention.mystery",
            Value::U32(7),
            "metadata key llama.attention.mystery",
        ),
        (
            "llama.attention.causal",
            Value::Bool(false),
            "llama.attention.causal is not true",
        ),
    ] {
        let path = dir.join("key.gguf");
        let arch = Value::String("llama".into());
        let mut f = std::fs::File::create(&path).unwrap();
        gguf_file::write(
            &mut f,
            &[("general.architecture", &arch), (key, &value)],
            &[],
        )
        .unwrap();
        drop(f);
        let err = Llama::load(&path, PhaseFormats::default()).err().unwrap();
        assert!(
            err.to_string().starts_with("unsupported model: ") && err.to_string().contains(needle),
            "{err}"
        );
    }
    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"not a gguf file at all").unwrap();
    let err = Llama::load(&garbage, PhaseFormats::default())
        .err()
        .unwrap();
    assert!(err.to_string().starts_with("invalid GGUF file"), "{err}");
    let err = Llama::load(&dir.join("missing.gguf"), PhaseFormats::default())
        .err()
        .unwrap();
    assert!(
        err.to_string().starts_with("cannot read model file"),
        "{err}"
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("handoff-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn f16_kv_tracks_the_f32_reference_in_prefill_and_decode() {
    // K and V rounded to f16 on the way into the pool: the logits move by
    // f16's rounding, not more, in both attention paths (prefill gathers,
    // decode reads pages in place).
    let formats = PhaseFormats {
        prefill: WeightFormat::F32,
        decode: WeightFormat::F32,
    };
    let model = tiny(formats);
    let tokens = prompt(40, 5);
    let reference = model.reference_logits(&tokens, Phase::Decode).unwrap();
    let page_size = 4;
    let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F16), 32).unwrap();
    let pages = scattered_pages(40usize.div_ceil(page_size), 32);
    let prefill = model
        .forward(
            &mut pool,
            &[SeqChunk {
                tokens: &tokens[..30],
                start_pos: 0,
                pages: &pages,
            }],
            Phase::Prefill,
        )
        .unwrap();
    let mut worst = max_diff(&prefill[0], &reference[29]);
    for pos in 30..40 {
        let out = model
            .forward(
                &mut pool,
                &[SeqChunk {
                    tokens: &tokens[pos..pos + 1],
                    start_pos: pos,
                    pages: &pages,
                }],
                Phase::Decode,
            )
            .unwrap();
        worst = worst.max(max_diff(&out[0], &reference[pos]));
    }
    eprintln!("f16 KV: max |logit diff| {worst}");
    assert!(worst > 0.0, "f16 storage rounds something");
    assert!(worst < 1e-2, "max |logit diff| {worst}");
}
