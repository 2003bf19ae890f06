//! The weight cache (`weight_cache.rs`) on a seeded random
//! Llama-layout file with a Q4_K_M-like mix (Q4_K matrices, Q6_K values and
//! down projections: the stacked QKV is requantized):
//! - a cached load computes the same bits as an uncached one, in both
//!   phases, and its Q8_0 weights are mapped from the cache file, not held;
//! - the first load writes the file, a later one maps it;
//! - a truncated file, a file with another key, a damaged index or a
//!   changed model file is rebuilt, never used; files of changed or
//!   removed model files are swept when another is written;
//! - two loaders at once convert once;
//! - a cache directory that cannot be made loads without a cache.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use handoff_model::{CacheOutcome, Llama, Phase, PhaseFormats};
use handoff_testmodels::{ModelSpec, WeightTypes};

fn model(dir: &Path) -> PathBuf {
    let mut spec = ModelSpec::preset("llama").unwrap();
    spec.types = WeightTypes {
        matrix: GgmlDType::Q4K,
        attn_v: GgmlDType::Q6K,
        ffn_down: GgmlDType::Q6K,
        output: GgmlDType::Q6K,
        token_embd: GgmlDType::Q4K,
        overrides: vec![],
    };
    let path = dir.join("mix.gguf");
    handoff_testmodels::write_model(&path, &spec).unwrap();
    path
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("handoff-wcache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fresh directory holding the model, and the cache directory to use.
fn setup(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = fresh_dir(name);
    let path = model(&dir);
    let cache = dir.join("cache");
    (dir, path, cache)
}

fn uncached(path: &Path) -> Llama {
    Llama::load(path, PhaseFormats::default()).unwrap().0
}

const TOKENS: [u32; 12] = [3, 40, 77, 120, 5, 9, 200, 31, 64, 150, 12, 99];

fn logits(m: &Llama) -> (Vec<u32>, Vec<u32>) {
    let bits = |p| {
        m.reference_logits(&TOKENS, p)
            .unwrap()
            .iter()
            .flatten()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    (bits(Phase::Prefill), bits(Phase::Decode))
}

fn load(path: &Path, cache: &Path) -> (Llama, CacheOutcome) {
    let (m, _, outcome) = Llama::load_cached(path, PhaseFormats::default(), Some(cache)).unwrap();
    (m, outcome)
}

#[test]
fn cached_weights_are_mapped_and_compute_the_same_bits() {
    let (dir, path, cache) = setup("same");
    let own = uncached(&path);
    let want = logits(&own);

    let (first, outcome) = load(&path, &cache);
    let file = match outcome {
        CacheOutcome::Written(p) => p,
        other => panic!("the first load should write the cache, got {other:?}"),
    };
    assert!(file.starts_with(&cache), "{}", file.display());
    let (second, outcome) = load(&path, &cache);
    assert_eq!(outcome, CacheOutcome::Hit(file.clone()));

    for m in [&first, &second] {
        assert_eq!(logits(m), want, "cached weights give other bits");
        assert_eq!(m.weight_bytes(), own.weight_bytes());
        // What the process still holds itself: norms and RoPE tables (most
        // of this tiny model's), no matrix.
        let private = m.weight_bytes() - m.mapped_weight_bytes();
        let own_private = own.weight_bytes() - own.mapped_weight_bytes();
        assert!(
            private * 2 < own_private,
            "{private} bytes private with the cache, {own_private} without"
        );
        // Exactly the converted copies (Q8_0 and repacked Q4_K) moved from
        // private to mapped.
        assert_eq!(
            m.mapped_weight_bytes() - own.mapped_weight_bytes(),
            own_private - private,
            "mapped bytes gained with the cache"
        );
    }
    // The header-only estimate counts the Q8_0 copies as mapped too.
    let content =
        candle_core::quantized::gguf_file::Content::read(&mut std::fs::File::open(&path).unwrap())
            .unwrap();
    let est =
        handoff_model::estimate_weights(second.config(), &content, PhaseFormats::default(), true);
    let mapped = second.mapped_weight_bytes() as f64;
    assert!(
        (est.mapped as f64 - mapped).abs() <= 0.05 * mapped,
        "estimated {} mapped, loaded {mapped}",
        est.mapped
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_damaged_or_foreign_cache_is_rebuilt_not_used() {
    let (dir, path, cache) = setup("damaged");
    let own = uncached(&path);
    let want = logits(&own);
    let CacheOutcome::Written(file) = load(&path, &cache).1 else {
        panic!("no cache written");
    };
    let good = std::fs::read(&file).unwrap();
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let damage: [(&str, Damage); 4] = [
        ("cut in half", Box::new(|b| b.truncate(b.len() / 2))),
        ("another key", Box::new(|b| b[20] ^= 1)),
        (
            "index past the end",
            Box::new(|b| b[40..48].copy_from_slice(&(u64::MAX / 2).to_le_bytes())),
        ),
        (
            "a matrix offset past the end",
            Box::new(|b| {
                // The last entry's scales offset: the index's last 8 bytes.
                let n = b.len();
                b[n - 8..].copy_from_slice(&(1u64 << 40).to_le_bytes());
            }),
        ),
    ];
    for (what, f) in damage {
        let mut b = good.clone();
        f(&mut b);
        std::fs::write(&file, &b).unwrap();
        let (m, outcome) = load(&path, &cache);
        assert_eq!(outcome, CacheOutcome::Written(file.clone()), "{what}");
        assert_eq!(logits(&m), want, "{what}");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            good,
            "{what}: rebuilt as it was"
        );
    }
    // A model file changed since (here: only its time): another key, so
    // another file; the old one is not read.
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let (_, outcome) = load(&path, &cache);
    let newer = match outcome {
        CacheOutcome::Written(p) => p,
        other => panic!("a changed model file must not reuse the cache: {other:?}"),
    };
    assert_ne!(newer, file, "the changed model's cache");
    // Writing it swept the old model's file (its model changed since).
    assert!(!file.exists(), "a stale cache file left behind");
    // A cache whose model file is gone is swept when another is written.
    let other = dir.join("other.gguf");
    std::fs::copy(&path, &other).unwrap();
    let CacheOutcome::Written(other_cache) = load(&other, &cache).1 else {
        panic!("no cache written for the copy");
    };
    assert!(newer.exists() && other_cache.exists());
    std::fs::remove_file(&path).unwrap();
    std::fs::rename(&other, &path).unwrap();
    let (_, outcome) = load(&path, &cache);
    assert!(matches!(outcome, CacheOutcome::Written(_)), "{outcome:?}");
    assert!(
        !newer.exists() && !other_cache.exists(),
        "caches of removed or renamed model files left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_loaders_at_once_convert_once() {
    let (dir, path, cache) = setup("race");
    let outcomes: Vec<CacheOutcome> = std::thread::scope(|s| {
        let a = s.spawn(|| load(&path, &cache).1);
        let b = s.spawn(|| load(&path, &cache).1);
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    let written = outcomes
        .iter()
        .filter(|o| matches!(o, CacheOutcome::Written(_)))
        .count();
    let hits = outcomes
        .iter()
        .filter(|o| matches!(o, CacheOutcome::Hit(_)))
        .count();
    assert_eq!((written, hits), (1, 1), "{outcomes:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cache_directory_that_cannot_be_made_loads_without_it() {
    let (dir, path, _) = setup("unwritable");
    // Under a regular file: no directory can be made there.
    let cache = path.join("cache");
    let own = uncached(&path);
    let (m, outcome) = load(&path, &cache);
    match &outcome {
        CacheOutcome::Unavailable(reason) => {
            assert!(reason.contains(&cache.display().to_string()), "{reason}")
        }
        other => panic!("expected the cache to be unavailable, got {other:?}"),
    }
    assert_eq!(logits(&m), logits(&own));
    assert_eq!(m.mapped_weight_bytes(), own.mapped_weight_bytes());
    std::fs::remove_dir_all(&dir).unwrap();
}
