//! `write-test-gguf PRESET OUT.gguf [--set KNOB=VALUE]...`: write a
//! handoff-testmodels preset. `--list` prints the presets, `--vocab-size` the
//! vocabulary size they share. Knobs (for experiments; the reference data
//! uses the presets as they are): seed, layers, hidden, heads, kv_heads,
//! head_dim, ffn, window, rope_theta, rope_theta_swa, embed, attn_qk, attn_vo, ffn_scale,
//! output, and `types=T` (every matrix and the embedding table of GGUF
//! type T: f32, f16, q4_0, ..., q6_k; what `llama-quantize --pure` makes).

use std::path::Path;
use std::process::ExitCode;

use handoff_testmodels::{ModelSpec, WeightTypes};

fn set(spec: &mut ModelSpec, kv: &str) -> Result<(), String> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| format!("--set {kv}: expected KNOB=VALUE"))?;
    let f = || v.parse::<f32>().map_err(|e| format!("{k}: {e}"));
    let n = || v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
    match k {
        "seed" => spec.seed = v.parse().map_err(|e| format!("{k}: {e}"))?,
        "layers" => spec.layers = n()?,
        "hidden" => spec.hidden = n()?,
        "heads" => spec.heads = n()?,
        "kv_heads" => spec.kv_heads = n()?,
        "head_dim" => spec.head_dim = n()?,
        "ffn" => spec.ffn = n()?,
        "window" => spec.sliding_window = Some(n()?),
        "rope_theta" => spec.rope_theta = f()?,
        "rope_theta_swa" => spec.rope_theta_swa = Some(f()?),
        "embed" => spec.scales.embed = f()?,
        "attn_qk" => spec.scales.attn_qk = f()?,
        "attn_vo" => spec.scales.attn_vo = f()?,
        "ffn_scale" => spec.scales.ffn = f()?,
        "output" => spec.scales.output = f()?,
        "types" => {
            let t = handoff_testmodels::dtype_named(v).ok_or_else(|| {
                format!("types={v}: expected f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k or q6_k")
            })?;
            spec.types = WeightTypes::every(t);
        }
        _ => return Err(format!("unknown knob {kv:?}")),
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--list") => {
            for p in handoff_testmodels::PRESETS
                .iter()
                .chain(handoff_testmodels::BAD_PRESETS)
            {
                println!("{p}");
            }
            println!("llama3-no-rope-freqs");
            return ExitCode::SUCCESS;
        }
        Some("--vocab-size") => {
            println!("{}", handoff_testmodels::vocab_size());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    let usage = || {
        eprintln!(
            "usage: write-test-gguf PRESET OUT.gguf [--set KNOB=VALUE]...   (--list: the presets)"
        );
        ExitCode::from(2)
    };
    let (preset, out) = match (args.first(), args.get(1)) {
        (Some(p), Some(o)) if !p.starts_with("--") => (p, o),
        _ => return usage(),
    };
    let mut spec = match ModelSpec::preset(preset) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("write-test-gguf: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut rest = args[2..].iter();
    while let Some(a) = rest.next() {
        let r = match (a.as_str(), rest.next()) {
            ("--set", Some(kv)) => set(&mut spec, kv),
            _ => return usage(),
        };
        if let Err(e) = r {
            eprintln!("write-test-gguf: {e}");
            return ExitCode::from(2);
        }
    }
    match handoff_testmodels::write_model(Path::new(out), &spec) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("write-test-gguf: {e}");
            ExitCode::FAILURE
        }
    }
}
