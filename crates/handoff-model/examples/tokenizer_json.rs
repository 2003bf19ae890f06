//! Write a GGUF model's byte-level BPE tokenizer as Hugging Face's
//! `tokenizer.json` (with a `tokenizer_config.json`) into a directory, so a
//! client that counts tokens (lm-eval's `local-completions`, run by
//! `tests/lmeval/run.sh`) counts them as handoff does.
//!
//! `cargo run --release -p handoff-model --example tokenizer_json -- MODEL.gguf OUT_DIR`

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(out)) = (args.next(), args.next()) else {
        return Err("usage: tokenizer_json MODEL.gguf OUT_DIR".into());
    };
    let mut file = std::fs::File::open(&model)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
    let tok = handoff_model::tokenizer::Tokenizer::from_gguf(&content)?;
    let json = tok
        .hf_json()
        .ok_or("the model's vocabulary is SentencePiece, not byte-level BPE")?;
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("tokenizer.json"), json)?;
    std::fs::write(
        out.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": false, "model_max_length": 8192}"#,
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
