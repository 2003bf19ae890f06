//! The token embedding table, kept as the file stores it where a row can be
//! read on its own: a table of a type with a native block format (Q4_0 to
//! Q8_0, Q4_K, Q5_K, Q6_K) is read in place from the mapped file, and a row
//! is dequantized when its token is looked up, to the same f32 values a
//! whole-table dequantization gives (`native::blocks::dequantize_row` is
//! llama.cpp's arithmetic, bit for bit). Gemma 3's 262,144 × 640 Q8_0 table
//! is 178 MB so, 671 MB as f32, and with the file mapped it is the page
//! cache's one copy, not this process's. Other types are dequantized whole.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::error::ModelError;
use crate::linear::RawTensor;
use crate::native::blocks::dequantize_row;
use crate::native::{BlockType, WeightBytes};

/// `[vocab][hidden]` embeddings.
pub(crate) enum Embedding {
    /// Dequantized.
    F32 { rows: Vec<f32>, hidden: usize },
    /// The file's rows, in their block format.
    Blocks {
        data: WeightBytes,
        t: BlockType,
        row_bytes: usize,
    },
}

impl Embedding {
    /// Whether a table of `dtype` with rows of `hidden` is kept in its
    /// blocks ([`Self::from_raw`]) rather than dequantized.
    pub(crate) fn keeps_blocks(dtype: GgmlDType, hidden: usize) -> bool {
        BlockType::of(dtype).is_some_and(|t| hidden.is_multiple_of(t.elems()))
    }

    /// The table as the file holds it (`[vocab, hidden]`, a type for which
    /// [`Self::keeps_blocks`]).
    pub(crate) fn from_raw(t: &RawTensor, vocab: usize, hidden: usize) -> Result<Self, ModelError> {
        let bt = BlockType::of(t.dtype)
            .filter(|b| hidden.is_multiple_of(b.elems()))
            .ok_or_else(|| {
                ModelError::Malformed(format!(
                    "token_embd.weight: {:?} rows of {hidden} cannot be read on their own",
                    t.dtype
                ))
            })?;
        let row_bytes = hidden / bt.elems() * bt.bytes();
        if (t.rows, t.cols) != (vocab, hidden) || t.data.bytes().len() != vocab * row_bytes {
            return Err(ModelError::Malformed(
                "token_embd.weight has the wrong size".into(),
            ));
        }
        Ok(Embedding::Blocks {
            data: t.data.clone(),
            t: bt,
            row_bytes,
        })
    }

    /// The table of `t` (`[vocab, hidden]`), dequantized.
    pub(crate) fn new(t: &QTensor, vocab: usize, hidden: usize) -> Result<Self, ModelError> {
        if t.shape().dims() != [vocab, hidden] {
            return Err(ModelError::Malformed(
                "token_embd.weight does not match the hidden size".into(),
            ));
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
            Embedding::Blocks {
                data,
                t: bt,
                row_bytes,
            } => {
                let row = &data.bytes()[t * row_bytes..(t + 1) * row_bytes];
                out.extend(dequantize_row(*bt, row));
            }
        }
    }

    /// Bytes the table takes.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Embedding::F32 { rows, .. } => rows.len() * 4,
            Embedding::Blocks { data, .. } => data.bytes().len(),
        }
    }

    /// Of [`Self::bytes`], those read in place from the mapped file.
    pub(crate) fn mapped_bytes(&self) -> usize {
        match self {
            Embedding::Blocks {
                data: WeightBytes::Mapped(..),
                ..
            } => self.bytes(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A row read from a block table is the same bits as the whole table
    /// dequantized by candle (llama.cpp's `dequantize_row_*`), for every
    /// type kept in blocks.
    #[test]
    fn block_rows_equal_the_dequantized_table() {
        let (vocab, hidden) = (7, 256);
        let v: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let t = candle_core::Tensor::from_vec(v, (vocab, hidden), &Device::Cpu).unwrap();
        for dtype in crate::native::BlockType::ALL.map(crate::native::BlockType::ggml) {
            let q = QTensor::quantize(&t, dtype).unwrap();
            let whole = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(Embedding::keeps_blocks(dtype, hidden), "{dtype:?}");
            let raw = RawTensor {
                name: "token_embd.weight".into(),
                dtype,
                rows: vocab,
                cols: hidden,
                data: WeightBytes::Owned(Arc::new(q.data().unwrap().into_owned())),
            };
            let e = Embedding::from_raw(&raw, vocab, hidden).unwrap();
            for tok in 0..vocab {
                let mut row = Vec::new();
                e.push_row(tok, &mut row);
                let want = &whole[tok * hidden..(tok + 1) * hidden];
                assert!(
                    row.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?}: token {tok}"
                );
            }
        }
        assert!(!Embedding::keeps_blocks(GgmlDType::F16, hidden));
        assert!(
            !Embedding::keeps_blocks(GgmlDType::Q4K, 32),
            "rows of part of a block"
        );
    }
}
