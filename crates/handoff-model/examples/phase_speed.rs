//! Prefill/decode speed of each weight format on a GGUF, to choose the
//! per-phase formats (BENCHMARKS.md). Usage:
//! `cargo run --release -p handoff-model --example phase_speed -- MODEL.gguf [threads]`

use std::time::Instant;

use handoff_kv::{KvPool, PageIndex};
use handoff_model::{Llama, Phase, PhaseFormats, SeqChunk, WeightFormat};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(
        args.get(1)
            .expect("usage: phase_speed MODEL.gguf [threads]"),
    );
    let threads: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let formats: Vec<WeightFormat> = std::env::var("FORMATS")
        .unwrap_or("f32,q8_0,as-loaded".into())
        .split(",")
        .map(|s| s.parse().unwrap())
        .collect();
    for format in formats {
        let formats = PhaseFormats {
            prefill: format,
            decode: format,
        };
        let (model, _) = Llama::load(&path, formats).unwrap();
        let page_size = 16;
        let tokens: Vec<u32> = (0..512u32).map(|i| 100 + (i * 7919) % 40000).collect();
        let pages: Vec<PageIndex> = (0..40).map(PageIndex).collect();
        pool.install(|| {
            for n in [128usize, 512] {
                let mut kv = KvPool::new(model.kv_geometry(page_size), 320).unwrap();
                let t = Instant::now();
                model
                    .forward(
                        &mut kv,
                        &[SeqChunk {
                            tokens: &tokens[..n],
                            start_pos: 0,
                            pages: &pages,
                        }],
                        Phase::Prefill,
                    )
                    .unwrap();
                let s = t.elapsed().as_secs_f64();
                println!("{format}: prefill {n}: {:.1} tok/s", n as f64 / s);
            }
            for batch in [1usize, 8] {
                let mut kv = KvPool::new(model.kv_geometry(page_size), 320).unwrap();
                let pages: Vec<Vec<PageIndex>> = (0..batch)
                    .map(|b| (0..8).map(|p| PageIndex((b * 8 + p) as u32)).collect())
                    .collect();
                for p in &pages {
                    model
                        .forward(
                            &mut kv,
                            &[SeqChunk {
                                tokens: &tokens[..32],
                                start_pos: 0,
                                pages: p,
                            }],
                            Phase::Prefill,
                        )
                        .unwrap();
                }
                let steps = 32;
                let t = Instant::now();
                for step in 0..steps {
                    let chunks: Vec<SeqChunk<'_>> = (0..batch)
                        .map(|b| SeqChunk {
                            tokens: &tokens[40 + step..41 + step],
                            start_pos: 32 + step,
                            pages: &pages[b],
                        })
                        .collect();
                    model.forward(&mut kv, &chunks, Phase::Decode).unwrap();
                }
                let s = t.elapsed().as_secs_f64();
                println!(
                    "{format}: decode batch {batch}: {:.1} tok/s",
                    (steps * batch) as f64 / s
                );
            }
        });
    }
}
