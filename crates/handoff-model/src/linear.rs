//! Weight matrices in the format chosen for each phase: prefill and decode
//! may use different formats, chosen from measurements, as long as
//! colocated and disaggregated serving use the same ones.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::error::ModelError;
use crate::kquant::{Q4kMatrix, Q6kMatrix};
use crate::native::{BlockType, NativeMatrix, Part, WeightBytes};
use crate::q8_matmul::Q8Matrix;
use crate::weight_cache::Q8Store;

pub use crate::weight_format::{PhaseFormats, WeightFormat};

/// Inner-dimension multiple for Q8_0 matrices (see `Mat::build`).
const Q8_PAD: usize = 256;

/// Which phase a forward belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Many tokens per sequence.
    Prefill,
    /// One token per sequence.
    Decode,
}

enum Mat {
    /// Quantized weights; the input is zero-padded to `padded_in` columns.
    Quant(QMatMul, usize),
    /// Q8_0 weights for handoff's small-batch kernel.
    Q8(Q8Matrix),
    /// Q4_K weights in row groups of 8 (`repacked`).
    Q4k(Q4kMatrix),
    /// Q6_K weights in row groups of 8 (`repacked`).
    Q6k(Q6kMatrix),
    /// Rows stacked from parts of different types, each part a matrix of
    /// its own (`repacked`: a Q4_K_M file's Q4_K queries and keys beside
    /// Q6_K values), with its row count.
    Parts(Vec<(Mat, usize)>),
    /// The file's own blocks for the native kernels.
    Native(NativeMatrix),
    /// `[in, out]`, contiguous (pre-transposed for the GEMM).
    Dense(Tensor),
}

impl Mat {
    /// `small_batch`: the matrix runs with few activation rows (decode, LM
    /// head); `q8_0` then uses handoff's kernel rather than candle's.
    /// `store`: where a Q8_0 matrix for handoff's kernel comes from (a
    /// weight cache file, or converted here).
    fn build(
        src: &Source<'_>,
        format: WeightFormat,
        small_batch: bool,
        store: &mut Q8Store<'_>,
    ) -> Result<Self, ModelError> {
        let dev = Device::Cpu;
        let float = matches!(src.dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if format.own_kernel(small_batch) && !float {
            if format == WeightFormat::Repacked && repacked_in(src.dtype, src.cols, small_batch) {
                let (key, rows, cols) = (&src.key, src.rows, src.cols);
                let malformed = |e| ModelError::Malformed(format!("tensor {key}: {e}"));
                if src.dtype == GgmlDType::Q6K {
                    // Beside the prefill's Q8_0 copy of the same tensor.
                    let key = format!("{key}#q6k");
                    if let Some(m) = store.lookup_k(&key, rows, cols) {
                        return Ok(Mat::Q6k(m));
                    }
                    let m = Q6kMatrix::from_ggml(&src.tensor()?.data()?, rows, cols)
                        .map_err(malformed)?;
                    store.record_k(&key, &m);
                    return Ok(Mat::Q6k(m));
                }
                if let Some(m) = store.lookup_k(key, rows, cols) {
                    return Ok(Mat::Q4k(m));
                }
                let m =
                    Q4kMatrix::from_ggml(&src.tensor()?.data()?, rows, cols).map_err(malformed)?;
                store.record_k(key, &m);
                return Ok(Mat::Q4k(m));
            }
            if let Some(m) = store.lookup(&src.key, src.rows, src.cols) {
                return Ok(Mat::Q8(m));
            }
            let q = src.tensor()?;
            let (out, in_dim) = q.shape().dims2()?;
            let data = if q.dtype() == GgmlDType::Q8_0 {
                q.data()?
            } else {
                std::borrow::Cow::Owned(requantize_q8_0(q, out, in_dim)?)
            };
            let m = Q8Matrix::from_ggml_q8_0(&data, out, in_dim)
                .map_err(|e| ModelError::Malformed(e.to_string()))?;
            store.record(&src.key, &m);
            return Ok(Mat::Q8(m));
        }
        let q = src.tensor()?;
        Ok(match (format, q.dtype()) {
            (WeightFormat::F32, _) | (_, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
                Mat::Dense(q.dequantize(&dev)?.t()?.contiguous()?)
            }
            (WeightFormat::AsLoaded, _)
            | (WeightFormat::Q8_0 | WeightFormat::Q8_0Candle, GgmlDType::Q8_0) => {
                let (out, in_dim) = q.shape().dims2()?;
                Mat::Quant(
                    QMatMul::QTensor(std::sync::Arc::new(qtensor_of(
                        q.data()?,
                        q.dtype(),
                        out,
                        in_dim,
                    )?)),
                    in_dim,
                )
            }
            // candle's AVX-512 VNNI kernel for Q8_0 needs the inner
            // dimension to be a multiple of 256: zero-pad the columns (zeros
            // quantize exactly) to get it.
            (
                WeightFormat::Q8_0
                | WeightFormat::Q8_0Candle
                | WeightFormat::Q8_0Vnni
                | WeightFormat::Q8_0Rows
                | WeightFormat::Native
                | WeightFormat::Repacked,
                _,
            ) => {
                let t = q.dequantize(&dev)?;
                let (out, in_dim) = t.dims2()?;
                let padded = match format {
                    WeightFormat::Q8_0Vnni => in_dim.div_ceil(Q8_PAD) * Q8_PAD,
                    _ => in_dim,
                };
                let t = if padded != in_dim {
                    let zeros =
                        Tensor::zeros((out, padded - in_dim), candle_core::DType::F32, &dev)?;
                    Tensor::cat(&[&t, &zeros], 1)?
                } else {
                    t
                };
                Mat::Quant(
                    QMatMul::QTensor(std::sync::Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0)?)),
                    padded,
                )
            }
        })
    }

    /// Bytes of weights this matrix holds.
    /// Of [`Self::bytes`], those in a mapped file.
    fn mapped_bytes(&self) -> usize {
        match self {
            Mat::Native(m) => m.mapped_bytes(),
            Mat::Q8(m) => m.mapped_bytes(),
            Mat::Q4k(m) => m.mapped_bytes(),
            Mat::Q6k(m) => m.mapped_bytes(),
            Mat::Parts(p) => p.iter().map(|(m, _)| m.mapped_bytes()).sum(),
            _ => 0,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Mat::Q8(m) => m.bytes(),
            Mat::Q4k(m) => m.bytes(),
            Mat::Q6k(m) => m.bytes(),
            Mat::Parts(p) => p.iter().map(|(m, _)| m.bytes()).sum(),
            Mat::Native(m) => m.bytes(),
            Mat::Quant(QMatMul::QTensor(q), _) => q.storage_size_in_bytes(),
            Mat::Quant(_, _) => 0,
            Mat::Dense(w) => w.elem_count() * 4,
        }
    }

    /// Whether each activation row is computed on its own.
    fn rows_independent(&self) -> bool {
        match self {
            Mat::Q8(_) | Mat::Q4k(_) | Mat::Q6k(_) | Mat::Native(_) => true,
            Mat::Parts(p) => p.iter().all(|(m, _)| m.rows_independent()),
            Mat::Quant(..) | Mat::Dense(_) => false,
        }
    }

    fn forward(&self, x: &[f32], n: usize, in_dim: usize) -> Result<Vec<f32>, ModelError> {
        let y = match self {
            Mat::Q8(m) => return Ok(m.forward(x, n)),
            Mat::Q4k(m) => return Ok(m.forward(x, n)),
            Mat::Q6k(m) => return Ok(m.forward(x, n)),
            Mat::Native(m) => return Ok(m.forward(x, n)),
            Mat::Parts(parts) => {
                let out: usize = parts.iter().map(|(_, r)| r).sum();
                let mut y = vec![0f32; n * out];
                let mut at = 0;
                for (m, rows) in parts {
                    let part = m.forward(x, n, in_dim)?;
                    for (dst, src) in y.chunks_exact_mut(out).zip(part.chunks_exact(*rows)) {
                        dst[at..at + rows].copy_from_slice(src);
                    }
                    at += rows;
                }
                return Ok(y);
            }
            Mat::Quant(q, padded) if *padded != in_dim => {
                let mut xp = vec![0.0f32; n * padded];
                for (dst, src) in xp.chunks_exact_mut(*padded).zip(x.chunks_exact(in_dim)) {
                    dst[..in_dim].copy_from_slice(src);
                }
                q.forward(&Tensor::from_vec(xp, (n, *padded), &Device::Cpu)?)?
            }
            Mat::Quant(q, _) => q.forward(&Tensor::from_slice(x, (n, in_dim), &Device::Cpu)?)?,
            Mat::Dense(w) => Tensor::from_slice(x, (n, in_dim), &Device::Cpu)?.matmul(w)?,
        };
        Ok(y.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// A `[rows, cols]` tensor's bytes as the file holds them.
#[derive(Debug, Clone)]
pub struct RawTensor {
    /// Its name in the file (for messages).
    pub name: String,
    /// Its GGUF type.
    pub dtype: GgmlDType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// The bytes, mapped or read.
    pub data: WeightBytes,
}

impl RawTensor {
    /// A candle tensor holding a copy of the bytes.
    pub fn qtensor(&self) -> Result<QTensor, ModelError> {
        qtensor_of(
            std::borrow::Cow::Borrowed(self.data.bytes()),
            self.dtype,
            self.rows,
            self.cols,
        )
    }

    /// Parts stacked by rows into one tensor. Parts of one type are a byte
    /// concat (rows are whole blocks), exact. Parts of different types (a
    /// Q4_K_M file's Q4_K queries and keys with Q6_K values) are requantized
    /// to Q8_0, what the Q8_0 formats do to each part anyway (an f32 stack
    /// would be a dense f32 GEMM in decode, and would turn batched prefill
    /// off); only when a phase computes in f32 do they stay f32.
    pub fn stack(parts: &[RawTensor], formats: PhaseFormats) -> Result<QTensor, ModelError> {
        let first = parts
            .first()
            .ok_or_else(|| ModelError::Malformed("nothing to stack".into()))?;
        let (dtype, inp) = (first.dtype, first.cols);
        if parts.len() == 1 {
            return first.qtensor();
        }
        if parts.iter().any(|p| p.dtype != dtype || p.cols != inp) {
            let ts = parts
                .iter()
                .map(|p| {
                    p.qtensor()?
                        .dequantize(&Device::Cpu)
                        .map_err(ModelError::from)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let t = Tensor::cat(&ts, 0)?;
            return Ok(QTensor::quantize(&t, stacked_dtype(parts, formats))?);
        }
        let mut bytes = Vec::new();
        for p in parts {
            bytes.extend_from_slice(p.data.bytes());
        }
        let rows = parts.iter().map(|p| p.rows).sum::<usize>();
        qtensor_of(std::borrow::Cow::Owned(bytes), dtype, rows, inp)
    }
}

/// A matrix as a load has it: its name (the weight cache's key), shape and
/// type, and its candle tensor, made only when a conversion needs it (a
/// matrix mapped from the cache needs none: no stacking, no copy).
pub(crate) struct Source<'a> {
    key: String,
    rows: usize,
    cols: usize,
    dtype: GgmlDType,
    tensor: SourceTensor<'a>,
}

enum SourceTensor<'a> {
    Ready(&'a QTensor),
    Lazy(
        Box<dyn Fn() -> Result<QTensor, ModelError> + 'a>,
        std::cell::OnceCell<QTensor>,
    ),
}

impl<'a> Source<'a> {
    /// A tensor at hand (nothing to cache it under).
    fn ready(q: &'a QTensor) -> Result<Self, ModelError> {
        let (rows, cols) = q
            .shape()
            .dims2()
            .map_err(|e| ModelError::Malformed(e.to_string()))?;
        Ok(Source {
            key: String::new(),
            rows,
            cols,
            dtype: q.dtype(),
            tensor: SourceTensor::Ready(q),
        })
    }

    /// Parts stacked by rows ([`RawTensor::stack`]) when first needed.
    fn stacked(parts: &'a [RawTensor], formats: PhaseFormats, key: String) -> Self {
        Source {
            key,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: parts.first().map_or(0, |p| p.cols),
            dtype: stacked_dtype(parts, formats),
            tensor: SourceTensor::Lazy(
                Box::new(move || RawTensor::stack(parts, formats)),
                Default::default(),
            ),
        }
    }

    fn tensor(&self) -> Result<&QTensor, ModelError> {
        match &self.tensor {
            SourceTensor::Ready(q) => Ok(q),
            SourceTensor::Lazy(make, made) => {
                if made.get().is_none() {
                    let t = make()?;
                    debug_assert_eq!(t.dtype(), self.dtype, "{}", self.key);
                    let _ = made.set(t);
                }
                made.get()
                    .ok_or_else(|| ModelError::Malformed(format!("tensor {} not made", self.key)))
            }
        }
    }
}

/// `q` (`rows` × `cols`, quantized) requantized to GGML Q8_0 bytes, in
/// chunks of rows on the rayon pool: both steps work block by block within
/// a row, so the bytes are those of converting the whole tensor at once
/// (what a load did before, on one thread).
fn requantize_q8_0(q: &QTensor, rows: usize, cols: usize) -> Result<Vec<u8>, ModelError> {
    use rayon::prelude::*;
    const ROWS: usize = 64;
    let dtype = q.dtype();
    let row_bytes = cols / dtype.block_size() * dtype.type_size();
    let data = q.data()?;
    if data.len() != rows * row_bytes || row_bytes == 0 {
        return Err(ModelError::Malformed(format!(
            "{dtype:?} data of {} bytes for {rows} rows of {cols}",
            data.len()
        )));
    }
    let parts = data
        .par_chunks(ROWS * row_bytes)
        .map(|c| -> Result<Vec<u8>, ModelError> {
            let t = qtensor_of(
                std::borrow::Cow::Borrowed(c),
                dtype,
                c.len() / row_bytes,
                cols,
            )?;
            let q8 = QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?;
            Ok(q8.data()?.into_owned())
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(parts.concat())
}

/// The type [`RawTensor::stack`] gives `parts`: theirs when they share one
/// type and width, else Q8_0, or f32 when a phase computes in f32 or the
/// rows are not whole Q8_0 blocks.
fn stacked_dtype(parts: &[RawTensor], formats: PhaseFormats) -> GgmlDType {
    let cols = parts.first().map_or(0, |p| p.cols);
    match parts.first() {
        Some(p) if parts.iter().all(|q| q.dtype == p.dtype && q.cols == cols) => p.dtype,
        _ if [formats.prefill, formats.decode].contains(&WeightFormat::F32)
            || !cols.is_multiple_of(32) =>
        {
            GgmlDType::F32
        }
        _ => GgmlDType::Q8_0,
    }
}

/// Whether `repacked` keeps a `dtype` matrix of `cols` columns in its own
/// quants (Q4_K, whole blocks, on a CPU with VNNI).
pub(crate) fn repacks(dtype: GgmlDType, cols: usize) -> bool {
    matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K)
        && cols.is_multiple_of(crate::kquant::QK_K)
        && crate::kquant::supported()
}

/// Whether a stack of parts of these types and widths is kept as parts
/// (`Mat::Parts`, each part built for prefill and shared by decode):
/// `repacked` in both phases, types that differ, one part repacked in
/// prefill (a Q4_K_M file's Q4_K queries and keys beside Q6_K values).
pub(crate) fn kept_as_parts(
    parts: impl Iterator<Item = (GgmlDType, usize)> + Clone,
    formats: PhaseFormats,
) -> bool {
    let first = parts.clone().next().map(|(t, _)| t);
    formats.prefill == WeightFormat::Repacked
        && formats.decode == WeightFormat::Repacked
        && parts.clone().any(|(t, _)| Some(t) != first)
        && parts.clone().any(|(t, cols)| repacked_in(t, cols, false))
}

/// Whether `repacked` computes a `dtype` matrix from its repacked quants
/// when it runs with few activation rows (`small_batch`: decode, the LM
/// head) or many (prefill). Q4_K in both; Q6_K with few only: its 6 bits
/// are unpacked for every product, which costs less than the bytes it
/// saves at one row (0.81x the Q8_0 copy's time on the 1B shape's
/// matrices) and more at many (1.16x at 8 rows, 1.37x at 64;
/// `kquant_timing`), so prefill keeps a Q8_0 copy of Q6_K matrices.
pub(crate) fn repacked_in(dtype: GgmlDType, cols: usize, small_batch: bool) -> bool {
    repacks(dtype, cols) && (dtype == GgmlDType::Q4K || small_batch)
}

/// A `[rows, cols]` candle tensor of `dtype` from its bytes.
fn qtensor_of(
    bytes: std::borrow::Cow<'_, [u8]>,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
) -> Result<QTensor, ModelError> {
    let storage = candle_core::quantized::QStorage::from_data(bytes, &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

/// The parts as one native matrix, if every part has a native kernel.
fn native_matrix(parts: &[RawTensor]) -> Result<Option<NativeMatrix>, ModelError> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let Some(t) = BlockType::of(p.dtype) else {
            return Ok(None);
        };
        if p.cols != first.cols {
            return Err(ModelError::Malformed(format!(
                "tensor {} has {} columns, {} has {}",
                p.name, p.cols, first.name, first.cols
            )));
        }
        out.push(Part {
            t,
            rows: p.rows,
            data: p.data.clone(),
        });
    }
    NativeMatrix::new(out, first.cols)
        .map(Some)
        .map_err(|e| ModelError::Malformed(format!("tensor {}: {e}", first.name)))
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
    /// Bytes of weights held for both phases (once when they share a copy).
    pub fn bytes(&self) -> usize {
        let p = self.prefill.bytes();
        if std::sync::Arc::ptr_eq(&self.prefill, &self.decode) {
            p
        } else {
            p + self.decode.bytes()
        }
    }

    /// Of [`Self::bytes`], those read in place from the mapped model file
    /// (one copy per host, in the page cache) rather than this process's.
    pub fn mapped_bytes(&self) -> usize {
        let p = self.prefill.mapped_bytes();
        if std::sync::Arc::ptr_eq(&self.prefill, &self.decode) {
            p
        } else {
            p + self.decode.mapped_bytes()
        }
    }

    /// Bytes of the decode copy (what a decode step reads).
    pub fn decode_bytes(&self) -> usize {
        self.decode.bytes()
    }

    /// Build from a GGUF tensor of shape `[out, in]`.
    pub fn new(q: &QTensor, formats: PhaseFormats) -> Result<Self, ModelError> {
        Self::build(&Source::ready(q)?, formats, &mut Q8Store::Build)
    }

    fn build(
        src: &Source<'_>,
        formats: PhaseFormats,
        store: &mut Q8Store<'_>,
    ) -> Result<Self, ModelError> {
        let (out_dim, in_dim) = (src.rows, src.cols);
        let prefill = std::sync::Arc::new(Mat::build(src, formats.prefill, false, store)?);
        // One copy when both phases run the same kernel on the same data:
        // equal formats, or handoff's kernel in both (`q8_0-rows` prefill,
        // `q8_0` decode: the defaults). `q8_0` alone is a different kernel
        // per phase (candle's in prefill), and so a different copy.
        // (`repacked` packs Q4_K unlike the others: shared only with
        // itself.)
        // (`repacked` computes Q6_K from its own quants in decode only, from
        // a Q8_0 copy in prefill: two copies.)
        let split = formats.decode == WeightFormat::Repacked
            && repacked_in(src.dtype, src.cols, true) != repacked_in(src.dtype, src.cols, false);
        let same = formats.decode == formats.prefill && formats.decode != WeightFormat::Q8_0;
        let both_own = formats.prefill.own_kernel(false)
            && formats.decode.own_kernel(true)
            && (formats.prefill == WeightFormat::Repacked)
                == (formats.decode == WeightFormat::Repacked);
        let decode = if (same || both_own) && !split {
            prefill.clone()
        } else {
            std::sync::Arc::new(Mat::build(src, formats.decode, true, store)?)
        };
        Ok(Self {
            prefill,
            decode,
            in_dim,
            out_dim,
        })
    }

    /// Build a matrix that only ever runs with few rows (one per sequence,
    /// e.g. the LM head): one copy in `format`, used by both phases.
    pub fn new_small_batch(q: &QTensor, format: WeightFormat) -> Result<Self, ModelError> {
        Self::build_small_batch(&Source::ready(q)?, format, &mut Q8Store::Build)
    }

    fn build_small_batch(
        src: &Source<'_>,
        format: WeightFormat,
        store: &mut Q8Store<'_>,
    ) -> Result<Self, ModelError> {
        let mat = Mat::build(src, format, true, store)?;
        Ok(Self::shared(mat, src.cols, src.rows))
    }

    /// One matrix for both phases.
    fn shared(mat: Mat, in_dim: usize, out_dim: usize) -> Self {
        let mat = std::sync::Arc::new(mat);
        Self {
            prefill: mat.clone(),
            decode: mat,
            in_dim,
            out_dim,
        }
    }

    /// Build from tensors `[out_i, in]` stacked by rows, as the file holds
    /// them: a `native` phase computes from their bytes in place when every
    /// part has a native kernel; otherwise the parts are stacked into one
    /// tensor (see [`RawTensor::stack`]) and converted as [`Linear::new`].
    pub fn from_parts(parts: &[RawTensor], formats: PhaseFormats) -> Result<Self, ModelError> {
        Self::from_parts_in(parts, formats, &mut Q8Store::Build)
    }

    /// [`Self::from_parts`], its Q8_0 matrix from `store`.
    pub(crate) fn from_parts_in(
        parts: &[RawTensor],
        formats: PhaseFormats,
        store: &mut Q8Store<'_>,
    ) -> Result<Self, ModelError> {
        let in_dim = parts.first().map_or(0, |p| p.cols);
        let out_dim = parts.iter().map(|p| p.rows).sum();
        let native = native_matrix(parts)?;
        if let Some(m) = &native {
            let both =
                formats.prefill == WeightFormat::Native && formats.decode == WeightFormat::Native;
            if both {
                return Ok(Self::shared(Mat::Native(m.clone()), in_dim, out_dim));
            }
        }
        // `repacked` keeps the Q4_K parts of a mixed stack (a Q4_K_M
        // file's Q4_K queries and keys with Q6_K values) Q4_K, each part a
        // matrix of its own.
        if kept_as_parts(parts.iter().map(|p| (p.dtype, p.cols)), formats) {
            let mut mats = Vec::with_capacity(parts.len());
            for p in parts {
                let src = Source::stacked(std::slice::from_ref(p), formats, p.name.clone());
                mats.push((
                    Mat::build(&src, WeightFormat::Repacked, false, store)?,
                    p.rows,
                ));
            }
            return Ok(Self::shared(Mat::Parts(mats), in_dim, out_dim));
        }
        let key = parts
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join("+");
        let mut lin = Self::build(&Source::stacked(parts, formats, key), formats, store)?;
        if let Some(m) = native {
            let mat = std::sync::Arc::new(Mat::Native(m));
            if formats.prefill == WeightFormat::Native {
                lin.prefill = mat.clone();
            }
            if formats.decode == WeightFormat::Native {
                lin.decode = mat;
            }
        }
        Ok(lin)
    }

    /// [`Linear::new_small_batch`] from one tensor as the file holds it.
    pub fn small_batch_from(part: &RawTensor, format: WeightFormat) -> Result<Self, ModelError> {
        Self::small_batch_from_in(part, format, &mut Q8Store::Build)
    }

    /// [`Self::small_batch_from`], its Q8_0 matrix from `store`.
    pub(crate) fn small_batch_from_in(
        part: &RawTensor,
        format: WeightFormat,
        store: &mut Q8Store<'_>,
    ) -> Result<Self, ModelError> {
        if format == WeightFormat::Native {
            if let Some(m) = native_matrix(std::slice::from_ref(part))? {
                return Ok(Self::shared(Mat::Native(m), part.cols, part.rows));
            }
        }
        let formats = PhaseFormats {
            prefill: format,
            decode: format,
        };
        let src = Source::stacked(
            std::slice::from_ref(part),
            formats,
            format!("{}#head", part.name),
        );
        Self::build_small_batch(&src, format, store)
    }

    /// Output features.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// Whether the prefill matrix computes each activation row on its own
    /// (handoff's kernel; the f32 GEMM and candle's kernels do not promise
    /// it).
    pub fn prefill_rows_independent(&self) -> bool {
        self.prefill.rows_independent()
    }

    /// `x` is `[n, in]` row-major; returns `[n, out]`.
    pub fn forward(&self, x: &[f32], n: usize, phase: Phase) -> Result<Vec<f32>, ModelError> {
        debug_assert_eq!(x.len(), n * self.in_dim);
        let mat = match phase {
            Phase::Prefill => &self.prefill,
            Phase::Decode => &self.decode,
        };
        mat.forward(x, n, self.in_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Requantizing in chunks of rows on the pool gives the bytes of
    /// converting the whole tensor at once, for row counts that are and
    /// are not whole chunks.
    #[test]
    fn chunked_requantization_equals_the_whole_tensor_at_once() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (rows, dtype) in [
            (200, GgmlDType::Q4K),
            (64, GgmlDType::Q6K),
            (3, GgmlDType::Q4_1),
        ] {
            let cols = 512;
            let w: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-1f32..1.0))
                .collect();
            let q = QTensor::quantize(
                &Tensor::from_slice(&w, (rows, cols), &Device::Cpu).unwrap(),
                dtype,
            )
            .unwrap();
            let whole = QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), GgmlDType::Q8_0)
                .unwrap()
                .data()
                .unwrap()
                .into_owned();
            let chunked = requantize_q8_0(&q, rows, cols).unwrap();
            assert!(chunked == whole, "{dtype:?} {rows} rows");
        }
    }

    /// `q8_0` (handoff's kernel) gives the same bits in both phases and as
    /// a small-batch matrix, and is within float rounding of
    /// `q8_0-candle` (candle adds its partial sums in another order), for
    /// a Q4_1 source like SmolLM2's.
    #[test]
    fn q8_0_close_to_candle_q8_0() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (out, inp, n) = (70, 576, 5);
        let w: Vec<f32> = (0..out * inp)
            .map(|_| rng.random_range(-0.2f32..0.2))
            .collect();
        let x: Vec<f32> = (0..n * inp).map(|_| rng.random_range(-3f32..3.0)).collect();
        let q = QTensor::quantize(
            &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
            GgmlDType::Q4_1,
        )
        .unwrap();
        let f = |format| PhaseFormats {
            prefill: format,
            decode: format,
        };
        let ours = Linear::new(&q, f(WeightFormat::Q8_0)).unwrap();
        let rows = Linear::new(&q, f(WeightFormat::Q8_0Rows)).unwrap();
        let candle = Linear::new(&q, f(WeightFormat::Q8_0Candle)).unwrap();
        let head = Linear::new_small_batch(&q, WeightFormat::Q8_0).unwrap();
        let expected = ours.forward(&x, n, Phase::Decode).unwrap();
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for got in [
            rows.forward(&x, n, Phase::Prefill).unwrap(),
            rows.forward(&x, n, Phase::Decode).unwrap(),
            head.forward(&x, n, Phase::Prefill).unwrap(),
        ] {
            assert_eq!(bits(&got), bits(&expected));
        }
        let theirs = candle.forward(&x, n, Phase::Decode).unwrap();
        let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in expected.iter().zip(&theirs) {
            assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
        }
        assert_eq!("q8_0-candle".parse(), Ok(WeightFormat::Q8_0Candle));
        assert_eq!(WeightFormat::Q8_0Candle.to_string(), "q8_0-candle");
    }
}
