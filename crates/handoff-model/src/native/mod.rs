//! Native quantized matrices: weights multiplied in the GGUF's own block
//! formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), read in place
//! from the mapped file, with activation rows quantized the way llama.cpp
//! pairs them (`act.rs`). Each output element depends only on its weight
//! row and its activation row (`blocks.rs` fixes the arithmetic), so a
//! prompt's results do not depend on its batch, its chunking or the thread
//! count, and every path gives the same bits.

pub mod act;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2;
pub mod blocks;

use std::sync::Arc;

use rayon::prelude::*;

use crate::mapped::MappedFile;
use act::{ActKind, Acts};
pub use blocks::BlockType;

/// Where a matrix's bytes live.
#[derive(Debug, Clone)]
pub enum WeightBytes {
    /// A range of a mapped model file (shared with every process mapping it).
    Mapped(Arc<MappedFile>, std::ops::Range<usize>),
    /// Bytes read into this process (a reader that is not a file).
    Owned(Arc<Vec<u8>>),
}

impl WeightBytes {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            WeightBytes::Mapped(m, r) => &m.bytes()[r.clone()],
            WeightBytes::Owned(v) => v,
        }
    }
}

/// A kernel path; every path gives the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativePath {
    /// Portable Rust (`blocks::dot_row`).
    Portable,
    /// AVX2 + FMA (x86-64-v3 builds).
    Avx2,
}

impl NativePath {
    /// The fastest path this build has (no allocation: every forward asks).
    pub fn chosen() -> NativePath {
        if cfg!(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        )) {
            NativePath::Avx2
        } else {
            NativePath::Portable
        }
    }

    /// Every path this build has, the portable one first.
    pub fn available() -> Vec<NativePath> {
        let mut v = vec![NativePath::Portable];
        if NativePath::chosen() == NativePath::Avx2 {
            v.push(NativePath::Avx2);
        }
        v
    }
}

/// Rows `[rows, cols]` of one block type.
#[derive(Debug, Clone)]
pub struct Part {
    /// Block format.
    pub t: BlockType,
    /// Output rows.
    pub rows: usize,
    /// The rows' bytes, row-major, whole blocks.
    pub data: WeightBytes,
}

/// A weight matrix of one or more parts stacked by rows (a fused Q/K/V of
/// a Q4_K_M file holds Q4_K and Q6_K parts), each in its own format.
#[derive(Debug, Clone)]
pub struct NativeMatrix {
    parts: Vec<Part>,
    in_dim: usize,
    out_dim: usize,
}

impl NativeMatrix {
    /// Check each part's length against its shape.
    pub fn new(parts: Vec<Part>, in_dim: usize) -> Result<NativeMatrix, String> {
        let mut out_dim = 0;
        for p in &parts {
            if !in_dim.is_multiple_of(p.t.elems()) {
                return Err(format!(
                    "{:?} rows of {in_dim} are not whole blocks of {}",
                    p.t,
                    p.t.elems()
                ));
            }
            let want = p.rows * in_dim / p.t.elems() * p.t.bytes();
            if p.data.bytes().len() != want {
                return Err(format!(
                    "{:?} part of {} rows holds {} bytes, expected {want}",
                    p.t,
                    p.rows,
                    p.data.bytes().len()
                ));
            }
            out_dim += p.rows;
        }
        Ok(NativeMatrix {
            parts,
            in_dim,
            out_dim,
        })
    }

    /// Bytes of weights (a mapping's are shared with other processes).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.bytes().len()).sum()
    }

    /// Of [`Self::bytes`], those read in place from a mapped file (shared
    /// with every process that maps it).
    pub fn mapped_bytes(&self) -> usize {
        self.parts
            .iter()
            .filter(|p| matches!(p.data, WeightBytes::Mapped(..)))
            .map(|p| p.data.bytes().len())
            .sum()
    }

    /// `x` is `[n, in]` row-major; returns `[n, out]`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.forward_with(x, n, NativePath::chosen())
    }

    /// [`NativeMatrix::forward`] on a given path.
    pub fn forward_with(&self, x: &[f32], n: usize, path: NativePath) -> Vec<f32> {
        assert_eq!(x.len(), n * self.in_dim, "activation shape");
        if n == 0 || self.out_dim == 0 {
            return vec![0.0; n * self.out_dim];
        }
        // One quantization per activation kind the parts need.
        let mut acts: Vec<(ActKind, Acts)> = Vec::new();
        for p in &self.parts {
            let k = p.t.act();
            if !acts.iter().any(|(have, _)| *have == k) {
                acts.push((k, Acts::quantize(k, x, n, self.in_dim)));
            }
        }
        // Results by output row, `[out][n]`, so that rows split across
        // threads own contiguous memory.
        let mut yt = vec![0f32; self.out_dim * n];
        let threads = rayon::current_num_threads().max(1);
        // A few chunks per thread, so one slowed by another process does
        // not hold the others up for long.
        let per_chunk = self.out_dim.div_ceil(threads * 8).max(1);
        let mut rest = yt.as_mut_slice();
        let mut tasks: Vec<(&Part, &Acts, usize, &mut [f32])> = Vec::new();
        for p in &self.parts {
            let (mine, tail) = rest.split_at_mut(p.rows * n);
            rest = tail;
            let a = &acts
                .iter()
                .find(|(k, _)| *k == p.t.act())
                .expect("quantized")
                .1;
            for (i, out) in mine.chunks_mut(per_chunk * n).enumerate() {
                tasks.push((p, a, i * per_chunk, out));
            }
        }
        tasks.into_par_iter().for_each(|(p, a, r0, out)| {
            let rb = self.in_dim / p.t.elems() * p.t.bytes();
            let w = &p.data.bytes()[r0 * rb..][..out.len() / n * rb];
            rows_against(p.t, w, rb, a, out, path);
        });
        if n == 1 {
            return yt;
        }
        let mut y = vec![0f32; n * self.out_dim];
        for (o, col) in yt.chunks_exact(n).enumerate() {
            for (c, v) in col.iter().enumerate() {
                y[c * self.out_dim + o] = *v;
            }
        }
        y
    }
}

/// Rows ahead of the one being computed whose bytes are prefetched: the
/// hardware prefetcher alone leaves the kernel waiting on loads.
const AHEAD: usize = 4;

/// Weight rows per group: a group's bytes (16 rows of 2048 Q4_K columns
/// are 18 KiB) stay in L1 while every activation tile passes over them,
/// so that a long prefill streams its activations once per group, not
/// once per row.
const GROUP_ROWS: usize = 16;

/// Weight rows `w` (`rb` bytes each) against every activation row; `y` is
/// `[rows][n]`.
fn rows_against(t: BlockType, w: &[u8], rb: usize, a: &Acts, y: &mut [f32], path: NativePath) {
    let n = a.qs.len() / a.cols;
    if path == NativePath::Portable {
        for (row, y) in w.chunks_exact(rb).zip(y.chunks_exact_mut(n)) {
            for (r, v) in y.iter_mut().enumerate() {
                *v = blocks::dot_row(t, row, a, r);
            }
        }
        return;
    }
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    for (g, (wg, yg)) in w
        .chunks(GROUP_ROWS * rb)
        .zip(y.chunks_mut(GROUP_ROWS * n))
        .enumerate()
    {
        let mut c = 0;
        while c < n {
            let take = match n - c {
                k @ 1..=3 => k,
                4..=7 => 4,
                _ => 8,
            };
            for (i, (row, yr)) in wg.chunks_exact(rb).zip(yg.chunks_exact_mut(n)).enumerate() {
                if c == 0 {
                    let next = g * GROUP_ROWS + i + AHEAD;
                    if let Some(next) = w.get(next * rb..(next + 1) * rb) {
                        avx2::prefetch(next);
                    }
                }
                let y = &mut yr[c..c + take];
                match take {
                    1 => y[0] = avx2::dot_rows::<1>(t, row, a, [c])[0],
                    2 => y.copy_from_slice(&avx2::dot_rows::<2>(t, row, a, [c, c + 1])),
                    3 => y.copy_from_slice(&avx2::dot_rows::<3>(t, row, a, [c, c + 1, c + 2])),
                    4 => y.copy_from_slice(&avx2::dot_rows::<4>(
                        t,
                        row,
                        a,
                        std::array::from_fn(|k| c + k),
                    )),
                    _ => y.copy_from_slice(&avx2::dot_rows::<8>(
                        t,
                        row,
                        a,
                        std::array::from_fn(|k| c + k),
                    )),
                }
            }
            c += take;
        }
    }
}

#[cfg(test)]
mod tests;
