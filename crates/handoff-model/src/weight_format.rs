//! How weight matrices are stored, per phase.

/// How a weight matrix is stored for one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Keep the GGUF's own quantization (e.g. Q4_1); activations are
    /// quantized on the fly as llama.cpp does.
    AsLoaded,
    /// Re-quantize to Q8_0 (8-bit blocks of 32); activations are quantized
    /// in blocks of 32 too, as llama.cpp does. Decode (and the LM head) run
    /// handoff's own small-batch kernel (`q8_matmul`), which loads each
    /// weight block once for all sequences of a step; prefill runs candle's
    /// Q8_0 kernel.
    Q8_0,
    /// Q8_0 through candle's kernels in every phase (what `q8_0` was before
    /// `q8_matmul`; within float rounding of it), kept for comparison.
    Q8_0Candle,
    /// Q8_0 with the inner dimension zero-padded to a multiple of 256 so that
    /// candle's AVX-512 VNNI kernel runs (3-4x faster on CPUs that have it);
    /// that kernel quantizes activations in blocks of 256, which is coarser.
    Q8_0Vnni,
    /// Dequantize to f32 and use a dense f32 GEMM.
    F32,
    /// Q8_0 through handoff's own kernel (`q8_matmul`) in every phase,
    /// prefill too (the prefill default): each row is computed on its own,
    /// the same bits whatever the batch's row count (what f32 GEMM and
    /// candle's kernels do not promise), so a prompt's KV depends neither
    /// on how it is chunked nor on the other prompts of its pass.
    Q8_0Rows,
    /// The GGUF's own block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    /// Q5_K, Q6_K) through handoff's native kernels (`native/`), read in
    /// place from the mapped file: no copy, one page-cache copy per host.
    /// Like `q8_0-rows`, each row is computed on its own. Other quantized
    /// types fall back to `q8_0-rows`, float ones to f32.
    Native,
    /// Q4_K matrices in the file's own 4-bit quants, repacked once in row
    /// groups of 8 for handoff's VNNI kernel (`kquant`, where the CPU has
    /// VNNI); every other matrix as `q8_0-rows`. Each row is computed on
    /// its own.
    Repacked,
}

impl WeightFormat {
    /// Whether a matrix in this format runs handoff's kernel (`q8_matmul`);
    /// `small_batch`: the matrix runs with few activation rows (decode, LM
    /// head).
    pub(crate) fn own_kernel(self, small_batch: bool) -> bool {
        matches!(
            self,
            WeightFormat::Q8_0Rows | WeightFormat::Native | WeightFormat::Repacked
        ) || small_batch && self == WeightFormat::Q8_0
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "as-loaded" => Ok(Self::AsLoaded),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q8_0-vnni" => Ok(Self::Q8_0Vnni),
            "q8_0-candle" => Ok(Self::Q8_0Candle),
            "f32" => Ok(Self::F32),
            "q8_0-rows" => Ok(Self::Q8_0Rows),
            "native" => Ok(Self::Native),
            "repacked" => Ok(Self::Repacked),
            other => Err(format!(
                "unknown weight format {other:?}: expected repacked, native, as-loaded, q8_0, q8_0-vnni, q8_0-candle, q8_0-rows or f32"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AsLoaded => "as-loaded",
            Self::Q8_0 => "q8_0",
            Self::Q8_0Vnni => "q8_0-vnni",
            Self::Q8_0Candle => "q8_0-candle",
            Self::F32 => "f32",
            Self::Q8_0Rows => "q8_0-rows",
            Self::Native => "native",
            Self::Repacked => "repacked",
        })
    }
}

/// Weight formats for the two phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhaseFormats {
    /// Used for forwards of more than one token per sequence.
    pub prefill: WeightFormat,
    /// Used for one-token-per-sequence decode steps.
    pub decode: WeightFormat,
}

impl Default for PhaseFormats {
    /// The measured choice on 2 CPU threads (BENCHMARKS.md): `repacked`
    /// in both phases, one copy (for a file without Q4_K, the Q8_0 copy of
    /// `q8_0-rows` prefill with `q8_0` decode, the earlier default).
    fn default() -> Self {
        Self {
            prefill: WeightFormat::Repacked,
            decode: WeightFormat::Repacked,
        }
    }
}
