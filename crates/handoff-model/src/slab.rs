//! A typed array owned by the process or viewed in a mapped file.

use std::sync::Arc;

use bytemuck::Pod;

use crate::mapped::MappedFile;

/// A typed array owned by the process or viewed in a mapped cache file.
pub(crate) enum Slab<T> {
    /// In this process's memory.
    Owned(Vec<T>),
    /// `len` elements at byte `start` of a mapped file (checked aligned and
    /// in range when made).
    Mapped {
        file: Arc<MappedFile>,
        start: usize,
        len: usize,
    },
}

impl<T: Pod> Slab<T> {
    /// A view of `len` elements at byte `start` of `file`, if they lie in
    /// it and are aligned for `T`.
    pub(crate) fn mapped(file: &Arc<MappedFile>, start: usize, len: usize) -> Option<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        let end = start.checked_add(bytes)?;
        let b = file.bytes().get(start..end)?;
        bytemuck::try_cast_slice::<u8, T>(b).ok()?;
        Some(Slab::Mapped {
            file: file.clone(),
            start,
            len,
        })
    }

    /// The elements.
    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Slab::Owned(v) => v,
            // Checked aligned and in range when made; the mapping does not
            // move.
            Slab::Mapped { file, start, len } => {
                bytemuck::cast_slice(&file.bytes()[*start..*start + len * std::mem::size_of::<T>()])
            }
        }
    }

    /// Whether the elements are in a mapped file.
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self, Slab::Mapped { .. })
    }
}
