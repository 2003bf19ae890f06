//! Readers of the llama.cpp reference JSON (tests/data/README.md) shared by
//! the tests that compare against it.
#![allow(dead_code)] // each test file uses what it needs

/// A case's token ids under `key` (`prompt_ids`, `output_ids`).
pub fn ids(case: &serde_json::Value, key: &str) -> Vec<u32> {
    case[key]
        .as_array()
        .unwrap_or_else(|| panic!("case has no `{key}`"))
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Per step: llama.cpp's top-5 `(id, logit)`, descending.
pub fn top_logits(case: &serde_json::Value) -> Vec<Vec<(usize, f32)>> {
    case["top_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().unwrap() as usize,
                        p[1].as_f64().unwrap() as f32,
                    )
                })
                .collect()
        })
        .collect()
}
