//! `q8_0-rows` (handoff's own Q8_0 kernel in prefill too, the default)
//! computes each row on its own: a prompt's logits and KV are the same bits
//! however it is chunked, which is what lets a prefill worker batch several
//! prompts into one pass. The f32 GEMM (`--prefill-format f32`) does not
//! promise that (its summation order follows the row count), so with it
//! prefill runs one sequence per pass and a prompt's chunks are fixed; this
//! test shows both on SmolLM2-135M-Instruct Q4_1 (`HANDOFF_MODEL`, else
//! `models/`; run scripts/fetch-model.sh first).

use std::path::PathBuf;

use handoff_kv::{KvDtype, KvPool, PageIndex};
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk, WeightFormat};

fn model_path() -> PathBuf {
    match std::env::var_os("HANDOFF_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// The last logits' bits of `tokens` prefilled in chunks of `lens`.
fn chunked(model: &Llama, tokens: &[u32], lens: &[usize]) -> Vec<u32> {
    let page_size = 16;
    let pages: Vec<PageIndex> = (0..tokens.len().div_ceil(page_size) as u32)
        .map(PageIndex)
        .collect();
    let mut pool = KvPool::new(model.kv_geometry(page_size, KvDtype::F16), pages.len()).unwrap();
    let mut start = 0;
    let mut last = Vec::new();
    for &len in lens {
        let chunk = SeqChunk {
            tokens: &tokens[start..start + len],
            start_pos: start,
            pages: &pages,
        };
        last = model
            .forward(&mut pool, &[chunk], Phase::Prefill)
            .unwrap()
            .remove(0);
        start += len;
    }
    assert_eq!(start, tokens.len());
    last.into_iter().map(f32::to_bits).collect()
}

#[test]
fn q8_0_rows_prefill_gives_the_same_bits_however_the_prompt_is_chunked() {
    let tokens: Vec<u32> = (0..96u32).map(|i| 100 + (i * 7919) % 20000).collect();
    let chunkings: [&[usize]; 4] = [&[96], &[40, 1, 55], &[16; 6], &[95, 1]];
    let load = |prefill| {
        Llama::load(
            &model_path(),
            PhaseFormats {
                prefill,
                decode: WeightFormat::Q8_0,
            },
        )
        .unwrap()
        .0
    };
    let rows = load(WeightFormat::Q8_0Rows);
    // Every matrix, the LM head too, runs the row-invariant kernel: a
    // prefill worker may batch several prompts into a pass.
    assert!(rows.prefill_rows_independent());
    let whole = chunked(&rows, &tokens, chunkings[0]);
    for lens in &chunkings[1..] {
        assert!(
            chunked(&rows, &tokens, lens) == whole,
            "q8_0-rows, chunks {lens:?}"
        );
    }
    // The contrast: the f32 GEMM's bits follow the chunking.
    let f32 = load(WeightFormat::F32);
    assert!(!f32.prefill_rows_independent());
    let whole = chunked(&f32, &tokens, chunkings[0]);
    let differ = chunkings[1..]
        .iter()
        .filter(|lens| chunked(&f32, &tokens, lens) != whole)
        .count();
    assert!(
        differ > 0,
        "f32 prefill gave the same bits for every chunking"
    );
}
