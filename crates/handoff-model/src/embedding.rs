//! The token embedding table, kept as the file stores it where a row can be
//! read on its own: a Q8_0 table stays Q8_0 (34 bytes per 32 values) and a
//! row is dequantized when a token is looked up, to the same f32 values a
//! whole-table dequantization gives. Gemma 3's 262,144 × 640 table is
//! 178 MB so, 671 MB as f32.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::error::ModelError;

use crate::q8_matmul::BLOCK_BYTES as Q8_0_BLOCK;

/// `[vocab][hidden]` embeddings.
pub(crate) enum Embedding {
    /// Dequantized.
    F32 { rows: Vec<f32>, hidden: usize },
    /// The file's Q8_0 rows.
    Q8_0 { data: Vec<u8>, hidden: usize },
}

impl Embedding {
    /// The table of `t` (`[vocab, hidden]`).
    pub(crate) fn new(t: &QTensor, vocab: usize, hidden: usize) -> Result<Self, ModelError> {
        if t.shape().dims() != [vocab, hidden] {
            return Err(ModelError::Malformed(
                "token_embd.weight does not match the hidden size".into(),
            ));
        }
        if t.dtype() == GgmlDType::Q8_0 && hidden.is_multiple_of(32) {
            let data = t.data()?.into_owned();
            if data.len() != vocab * hidden / 32 * Q8_0_BLOCK {
                return Err(ModelError::Malformed(
                    "token_embd.weight has the wrong size".into(),
                ));
            }
            return Ok(Embedding::Q8_0 { data, hidden });
        }
        let rows = t
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(Embedding::F32 { rows, hidden })
    }

    /// Append token `t`'s row to `out`.
    pub(crate) fn push_row(&self, t: usize, out: &mut Vec<f32>) {
        match self {
            Embedding::F32 { rows, hidden } => {
                out.extend_from_slice(&rows[t * hidden..(t + 1) * hidden]);
            }
            Embedding::Q8_0 { data, hidden } => {
                let row_bytes = hidden / 32 * Q8_0_BLOCK;
                for block in data[t * row_bytes..(t + 1) * row_bytes].chunks_exact(Q8_0_BLOCK) {
                    let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                    out.extend(block[2..].iter().map(|&q| q as i8 as f32 * d));
                }
            }
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Embedding::F32 { rows, .. } => rows.len() * 4,
            Embedding::Q8_0 { data, .. } => data.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row read from the Q8_0 table is the same bits as the whole table
    /// dequantized.
    #[test]
    fn q8_0_rows_equal_the_dequantized_table() {
        let (vocab, hidden) = (7, 64);
        let v: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let t = candle_core::Tensor::from_vec(v, (vocab, hidden), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let whole = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let e = Embedding::new(&q, vocab, hidden).unwrap();
        assert!(matches!(e, Embedding::Q8_0 { .. }));
        for tok in 0..vocab {
            let mut row = Vec::new();
            e.push_row(tok, &mut row);
            let want = &whole[tok * hidden..(tok + 1) * hidden];
            assert!(
                row.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "token {tok}"
            );
        }
    }
}
