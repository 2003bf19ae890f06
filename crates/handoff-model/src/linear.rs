//! Weight matrices in the format chosen for each phase (DESIGN.md §6: prefill
//! and decode may use different formats, chosen from measurements, as long
//! as colocated and disaggregated serving use the same ones).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::error::ModelError;

/// How a weight matrix is stored for one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Keep the GGUF's own quantization (e.g. Q4_1); activations are
    /// quantized on the fly as llama.cpp does.
    AsLoaded,
    /// Re-quantize to Q8_0 (8-bit blocks of 32).
    Q8_0,
    /// Dequantize to f32 and use a dense f32 GEMM.
    F32,
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "as-loaded" | "native" => Ok(Self::AsLoaded),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "f32" => Ok(Self::F32),
            other => Err(format!(
                "unknown weight format {other:?}: expected as-loaded, q8_0 or f32"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AsLoaded => "as-loaded",
            Self::Q8_0 => "q8_0",
            Self::F32 => "f32",
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
    /// The measured choice for SmolLM2 Q4_1 on 2 CPU threads (BENCHMARKS.md).
    fn default() -> Self {
        Self {
            prefill: WeightFormat::F32,
            decode: WeightFormat::Q8_0,
        }
    }
}

/// Which phase a forward belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Many tokens per sequence.
    Prefill,
    /// One token per sequence.
    Decode,
}

enum Mat {
    Quant(QMatMul),
    /// `[in, out]`, contiguous (pre-transposed for the GEMM).
    Dense(Tensor),
}

impl Mat {
    fn build(q: &QTensor, format: WeightFormat) -> Result<Self, ModelError> {
        let dev = Device::Cpu;
        Ok(match (format, q.dtype()) {
            (WeightFormat::F32, _) | (_, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
                Mat::Dense(q.dequantize(&dev)?.t()?.contiguous()?)
            }
            (WeightFormat::AsLoaded, _) | (WeightFormat::Q8_0, GgmlDType::Q8_0) => {
                Mat::Quant(QMatMul::QTensor(std::sync::Arc::new(QTensor::new(
                    clone_storage(q)?,
                    q.shape().clone(),
                )?)))
            }
            (WeightFormat::Q8_0, _) => {
                let t = q.dequantize(&dev)?;
                Mat::Quant(QMatMul::QTensor(std::sync::Arc::new(QTensor::quantize(
                    &t,
                    GgmlDType::Q8_0,
                )?)))
            }
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Mat::Quant(q) => q.forward(x),
            Mat::Dense(w) => x.matmul(w),
        }
    }
}

fn clone_storage(q: &QTensor) -> Result<candle_core::quantized::QStorage, ModelError> {
    let data = q.data()?;
    Ok(candle_core::quantized::QStorage::from_data(
        data,
        &Device::Cpu,
        q.dtype(),
    )?)
}

/// A linear layer `y = x W^T` with one matrix per phase (shared when the
/// formats are equal).
pub struct Linear {
    prefill: std::sync::Arc<Mat>,
    decode: std::sync::Arc<Mat>,
    in_dim: usize,
    out_dim: usize,
}

impl Linear {
    /// Build from a GGUF tensor of shape `[out, in]`.
    pub fn new(q: &QTensor, formats: PhaseFormats) -> Result<Self, ModelError> {
        let (out_dim, in_dim) = q
            .shape()
            .dims2()
            .map_err(|e| ModelError::Malformed(e.to_string()))?;
        let prefill = std::sync::Arc::new(Mat::build(q, formats.prefill)?);
        let decode = if formats.decode == formats.prefill {
            prefill.clone()
        } else {
            std::sync::Arc::new(Mat::build(q, formats.decode)?)
        };
        Ok(Self {
            prefill,
            decode,
            in_dim,
            out_dim,
        })
    }

    /// Output features.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// `x` is `[n, in]` row-major; returns `[n, out]`.
    pub fn forward(&self, x: &[f32], n: usize, phase: Phase) -> Result<Vec<f32>, ModelError> {
        debug_assert_eq!(x.len(), n * self.in_dim);
        let xt = Tensor::from_slice(x, (n, self.in_dim), &Device::Cpu)?;
        let mat = match phase {
            Phase::Prefill => &self.prefill,
            Phase::Decode => &self.decode,
        };
        let y = mat.forward(&xt)?;
        Ok(y.flatten_all()?.to_vec1::<f32>()?)
    }
}
