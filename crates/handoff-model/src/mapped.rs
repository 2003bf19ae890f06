//! A model file mapped read-only: the native kernels compute from the
//! file's bytes where the page cache holds them, so every process on a
//! host that serves the file (a PD pair, replicas) shares one copy.
//!
//! One of the crate's `unsafe` blocks outside `simd/` (with `heap.rs`):
//! creating the mapping.

use std::path::Path;
use std::sync::Arc;

/// A file's bytes, mapped read-only for the life of the value.
#[derive(Debug)]
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Map `path` read-only.
    pub fn open(path: &Path) -> std::io::Result<Arc<MappedFile>> {
        let file = std::fs::File::open(path)?;
        // SAFETY: the mapping is read-only and private to this value, and
        // Rust code only ever sees it as `&[u8]`. What the type system
        // cannot rule out is another process truncating or rewriting the
        // file while it is mapped (a model file being replaced in place);
        // that is the same contract every mmap-based model loader has
        // (llama.cpp's `--mmap`, the default there), and ARCHITECTURE.md
        // says to replace model files by rename, never in place.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Arc::new(MappedFile { map }))
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}
