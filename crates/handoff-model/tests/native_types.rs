//! Each native block format through the whole model, computed in place
//! from the mapped file: a seeded random Llama-layout file whose matrices
//! are all of one type (quantized by candle, whose quantizers are
//! llama.cpp's reference ones), loaded with `native` in both phases.
//! - the weights read by a decode step are exactly the file's matrix bytes
//!   (no copy, no conversion);
//! - the logits track the same file computed in f32 (dequantized weights,
//!   unquantized activations) within activation rounding, and pick the
//!   same token at nearly every position;
//! - prefill and decode share one matrix: a prompt's logits are the same
//!   bits through either phase's weights.

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use handoff_model::{Llama, Phase, PhaseFormats, WeightFormat};
use handoff_testmodels::{ModelSpec, WeightTypes};

fn formats(f: WeightFormat) -> PhaseFormats {
    PhaseFormats {
        prefill: f,
        decode: f,
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

#[test]
fn every_native_type_loads_in_place_and_tracks_f32() {
    let dir = std::env::temp_dir().join(format!("handoff-native-types-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens: Vec<u32> = (0..40u32).map(|i| 3 + (i * 37 + 11) % 290).collect();
    for dtype in handoff_model::native::BlockType::ALL.map(handoff_model::native::BlockType::ggml) {
        let mut spec = ModelSpec::preset("llama").unwrap();
        spec.types = WeightTypes {
            matrix: dtype,
            attn_v: dtype,
            ffn_down: dtype,
            output: dtype,
            token_embd: GgmlDType::Q8_0,
            overrides: vec![],
        };
        let path = dir.join(format!("{dtype:?}.gguf"));
        handoff_testmodels::write_model(&path, &spec).unwrap();
        let content = Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
        let mut matrix_bytes = 0;
        for (name, info) in &content.tensor_infos {
            if info.shape.dims().len() == 2 && name != "token_embd.weight" {
                assert_eq!(info.ggml_dtype, dtype, "{name}");
                matrix_bytes += info.shape.elem_count() / dtype.block_size() * dtype.type_size();
            }
        }
        let (native, _) = Llama::load(&path, formats(WeightFormat::Native)).unwrap();
        let (exact, _) = Llama::load(&path, formats(WeightFormat::F32)).unwrap();
        let c = native.config();
        // Besides the matrices, a decode step reads the norms and one row
        // of the (Q8_0) embedding table.
        let norms = (c.layers * 2 + 1) * c.hidden * 4;
        let embed_row = c.hidden / 32 * 34;
        assert_eq!(
            native.decode_weight_bytes(),
            matrix_bytes + norms + embed_row,
            "{dtype:?}: the decode step reads the file's bytes"
        );
        // Every matrix is read in place, and so is the (Q8_0) embedding
        // table: the mapped bytes are the file's, and the header-only
        // estimate says so before anything is loaded.
        let table = c.vocab_size * c.hidden / 32 * 34;
        assert_eq!(
            native.mapped_weight_bytes(),
            matrix_bytes + table,
            "{dtype:?}"
        );
        let est =
            handoff_model::estimate_weights(c, &content, formats(WeightFormat::Native), false);
        assert_eq!(
            est.mapped as usize,
            matrix_bytes + table,
            "{dtype:?}: estimated mapped bytes"
        );
        let own = native.weight_bytes() - native.mapped_weight_bytes();
        assert!(
            (est.private as f64 - own as f64).abs() <= 0.05 * own as f64,
            "{dtype:?}: estimated private bytes {} vs {own}",
            est.private
        );
        let default = handoff_model::estimate_weights(c, &content, Default::default(), false);
        assert_eq!(
            default.mapped as usize, table,
            "{dtype:?}: only the table mapped by default"
        );
        assert!(
            default.private > est.private,
            "{dtype:?}: a Q8_0 copy by default"
        );
        let ours = native.reference_logits(&tokens, Phase::Prefill).unwrap();
        let via_decode = native.reference_logits(&tokens, Phase::Decode).unwrap();
        let want = exact.reference_logits(&tokens, Phase::Prefill).unwrap();
        assert_eq!(ours, via_decode, "{dtype:?}: one matrix for both phases");
        let mut worst = 0f32;
        let mut same = 0;
        for (a, b) in ours.iter().zip(&want) {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            worst = worst.max(d);
            same += usize::from(argmax(a) == argmax(b));
        }
        println!("{dtype:?}: worst logit difference {worst:.3}, argmax {same}/40");
        assert!(worst < 0.75, "{dtype:?}: worst logit difference {worst}");
        assert!(same >= 36, "{dtype:?}: argmax equal at {same}/40 positions");
    }
    std::fs::remove_dir_all(&dir).ok();
}
