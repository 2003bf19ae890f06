//! The tokenizer built from SmolLM2's GGUF gives exactly llama.cpp's ids.
//!
//! Reference: `tests/data/llamacpp_tokenize.json`, made by
//! `scripts/llamacpp-greedy` (`llamacpp-greedy tokenize -m MODEL -f
//! tests/data/llamacpp_tokenize_inputs.jsonl`): for every string the ids with
//! `parse_special` true (`ids_special`) and false (`ids_no_special`), no BOS,
//! and with `add_special` (`ids_add_special`). Exact equality is required.

use std::path::PathBuf;

use candle_core::quantized::gguf_file::Content;
use handoff_model::chat_template::ChatTemplate;
use handoff_model::tokenizer::Tokenizer;

fn model_path() -> PathBuf {
    match std::env::var_os("HANDOFF_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn load_content() -> Content {
    let path = model_path();
    let mut f = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "model GGUF {} is missing ({e}): run scripts/fetch-model.sh (or set HANDOFF_MODEL)",
            path.display()
        )
    });
    Content::read(&mut f).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn reference() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/llamacpp_tokenize.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reference {} is missing: {e}", path.display()));
    serde_json::from_str(&text).expect("reference JSON")
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("case has no `{key}`: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn smollm2_ids_match_llamacpp() {
    let content = load_content();
    let tok = Tokenizer::from_gguf(&content).expect("tokenizer from GGUF");
    let reference = reference();
    assert_eq!(
        tok.vocab_size() as u64,
        reference["vocab_size"].as_u64().unwrap()
    );
    assert_eq!(tok.add_bos(), reference["add_bos"].as_bool().unwrap());
    assert_eq!(
        tok.bos_id().map(u64::from),
        reference["bos_id"].as_u64(),
        "bos id"
    );
    assert_eq!(
        tok.eos_id().map(u64::from),
        reference["eos_id"].as_u64(),
        "eos id"
    );
    let cases = reference["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let name = case["name"].as_str().unwrap_or(text);
        for (parse_special, key) in [(true, "ids_special"), (false, "ids_no_special")] {
            let want = ids(case, key);
            let got = tok.encode(text, parse_special).expect("encode");
            if got != want {
                failures.push(format!(
                    "{name} (parse_special={parse_special}) {text:?}:\n  got  {got:?}\n  want {want:?}"
                ));
            }
            assert_eq!(
                tok.decode(&got, false).unwrap(),
                text,
                "round trip of {name}"
            );
        }
        let mut with_bos = Vec::new();
        if tok.add_bos() {
            with_bos.extend(tok.bos_id());
        }
        with_bos.extend(tok.encode(text, true).unwrap());
        assert_eq!(
            with_bos,
            ids(case, "ids_add_special"),
            "{name} with add_special"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len() * 2,
        failures.join("\n")
    );
}

#[test]
fn smollm2_chat_template_from_gguf() {
    let content = load_content();
    let t = ChatTemplate::from_gguf(&content)
        .expect("template compiles")
        .expect("SmolLM2 has a template");
    assert_eq!(t.source(), handoff_model::chat_template::SMOLLM2_TEMPLATE);
    let out = t
        .render(
            &[handoff_model::chat_template::ChatMessage::new(
                "user",
                "What is 2+2?",
            )],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let tok = Tokenizer::from_gguf(&content).unwrap();
    let ids = tok.encode(&out, true).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one token");
    // llama.cpp's EOG set for SmolLM2 (its load log: "printing all EOG
    // tokens"): <|endoftext|>, <|im_end|>, and <reponame>, a FIM marker.
    assert_eq!(tok.eog_ids(), &[0, 2, 4]);
    assert_eq!(tok.token_text(4), Some("<reponame>"));
}

mod round_trip {
    use std::sync::OnceLock;

    use handoff_model::tokenizer::Tokenizer;
    use proptest::prelude::*;

    fn smollm2() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::from_gguf(&super::load_content()).expect("tokenizer"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any string survives encode -> decode, with and without special-token parsing,
        /// and streaming the ids one by one gives the same text.
        #[test]
        fn smollm2_round_trips(s in any::<String>(), special in any::<bool>()) {
            let tok = smollm2();
            let ids = tok.encode(&s, special).unwrap();
            prop_assert_eq!(tok.decode(&ids, false).unwrap(), s.clone());
            let mut dec = tok.incremental_decoder(false);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&dec.push(id).unwrap());
            }
            streamed.push_str(&dec.finish());
            prop_assert_eq!(streamed, s);
        }
    }
}
