//! Shared-memory backing for a KV pool (DESIGN.md §5 `shm` transport).
//!
//! A [`ShmRegion`] is an anonymous memory file (`memfd_create`) mapped shared
//! into this process. Another process on the host maps the same pages by
//! opening `/proc/<pid>/fd/<fd>` ([`ShmRegionHandle`], [`ShmRegion::open`]) or
//! from a file descriptor it received ([`ShmRegion::from_fd`]), and then
//! writes KV straight into our pages, like a one-sided RDMA write.
//!
//! The bytes of a shared region can change under us at any time (another
//! process writes them), so this module never hands out a reference to the
//! whole region except to the pool's owner, and moves bytes with copies
//! through raw pointers ([`ShmRegion::write_at`], [`ShmRegion::read_at`],
//! [`ShmRegion::with_mut`], [`ShmRegion::with_slices`]). Which pages a writer
//! may touch is decided by page leases (`crate::lease`): a page is written by
//! at most one party at a time, and every range is bounds-checked here.
//!
//! This is the only module of the crate with `unsafe`; each block says why it
//! holds.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use memmap2::MmapRaw;

use crate::error::KvError;

/// The memfd name of KV pools ([`crate::KvPool::new_shared`]); a peer's
/// `/proc/<pid>/fd/<fd>` reads as `/memfd:` followed by it, which lets a
/// transport refuse to write into anything that is not a pool.
pub const POOL_MEMFD_NAME: &str = "handoff-kv-pool";

/// What another process on this host needs to map a region: our pid, the
/// descriptor number and the length. Plain data; send it over any channel
/// (the transfer layer sends it after an authenticated handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShmRegionHandle {
    /// Process holding the descriptor.
    pub pid: u32,
    /// Descriptor number in that process.
    pub fd: i32,
    /// Region length in bytes.
    pub len: u64,
}

impl ShmRegionHandle {
    /// Encoded size of [`Self::to_bytes`].
    pub const ENCODED_LEN: usize = 16;

    /// Fixed little-endian encoding.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.fd.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decode [`Self::to_bytes`].
    pub fn from_bytes(b: &[u8; Self::ENCODED_LEN]) -> Self {
        let mut pid = [0u8; 4];
        let mut fd = [0u8; 4];
        let mut len = [0u8; 8];
        pid.copy_from_slice(&b[0..4]);
        fd.copy_from_slice(&b[4..8]);
        len.copy_from_slice(&b[8..16]);
        Self {
            pid: u32::from_le_bytes(pid),
            fd: i32::from_le_bytes(fd),
            len: u64::from_le_bytes(len),
        }
    }
}

/// A shared, memfd-backed memory region mapped read-write.
pub struct ShmRegion {
    map: MmapRaw,
    file: File,
    len: usize,
}

impl std::fmt::Debug for ShmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRegion")
            .field("fd", &self.file.as_raw_fd())
            .field("len", &self.len)
            .finish()
    }
}

fn io_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Shm(format!("{what}: {e}"))
}

impl ShmRegion {
    /// A new zeroed region of `len` bytes (`len > 0`), named `name` in
    /// `/proc/<pid>/fd` listings. Its pages are allocated and mapped now
    /// (`MAP_POPULATE`), as a heap pool's are when it is zero-filled: no
    /// write into it (a transfer landing, an attention step) takes a page
    /// fault on a page's first use. A peer's [`Self::open`] maps lazily, so
    /// opening a large region does not stall the opener.
    pub fn create(name: &str, len: usize) -> Result<Self, KvError> {
        if len == 0 {
            return Err(KvError::Shm(
                "a shared region needs at least one byte".into(),
            ));
        }
        let fd: OwnedFd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| io_err("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io_err("ftruncate", e))?;
        Self::map(File::from(fd), len, true)
    }

    /// Map the region another process described in `handle`, through
    /// `/proc/<pid>/fd/<fd>` (same user, same host).
    pub fn open(handle: &ShmRegionHandle) -> Result<Self, KvError> {
        let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_err(&format!("open {path}"), e))?;
        let len = usize::try_from(handle.len)
            .map_err(|_| KvError::Shm(format!("region of {} bytes", handle.len)))?;
        Self::map(file, len, false)
    }

    /// Map a region from a descriptor received from another process.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self, KvError> {
        Self::map(File::from(fd), len, false)
    }

    fn map(file: File, len: usize, populate: bool) -> Result<Self, KvError> {
        let actual = file.metadata().map_err(|e| io_err("fstat", e))?.len();
        if len == 0 || actual < len as u64 {
            return Err(KvError::Shm(format!(
                "region file holds {actual} bytes, {len} expected"
            )));
        }
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        if populate {
            options.populate();
        }
        let map = options.map_raw(&file).map_err(|e| io_err("mmap", e))?;
        Ok(Self { map, file, len })
    }

    /// What another process needs to map this region.
    pub fn handle(&self) -> ShmRegionHandle {
        ShmRegionHandle {
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            len: self.len as u64,
        }
    }

    /// The memory file's descriptor (for passing with `SCM_RIGHTS`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Check `range` lies inside the region.
    pub fn check(&self, range: &Range<usize>) -> Result<(), KvError> {
        if range.start <= range.end && range.end <= self.len {
            Ok(())
        } else {
            Err(KvError::OutOfBounds {
                start: range.start,
                end: range.end,
                len: self.len,
            })
        }
    }

    /// Copy `src` into the region at `offset`, bounds-checked.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), KvError> {
        let end = offset.saturating_add(src.len());
        self.check(&(offset..end))?;
        // SAFETY: `offset..end` is inside the mapping (checked above), the
        // mapping lives as long as `self`, and `src` is a Rust slice that
        // cannot overlap the mapping through a reference we handed out for
        // writing (the only such references are the pool owner's, over pages
        // a transfer does not write). Bytes are copied, never referenced.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            );
        }
        Ok(())
    }

    /// Copy region bytes at `offset` into `dst`, bounds-checked.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), KvError> {
        let end = offset.saturating_add(dst.len());
        self.check(&(offset..end))?;
        // SAFETY: in bounds (checked), mapping alive for `self`'s lifetime;
        // `dst` is an exclusive Rust slice, so it cannot alias the source.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copy `len` bytes from `src` at `src_offset` to this region at
    /// `dst_offset` (a one-sided write between two mappings), bounds-checked
    /// on both sides.
    pub fn copy_from(
        &self,
        dst_offset: usize,
        src: &ShmRegion,
        src_offset: usize,
        len: usize,
    ) -> Result<(), KvError> {
        let dst_end = dst_offset.saturating_add(len);
        let src_end = src_offset.saturating_add(len);
        self.check(&(dst_offset..dst_end))?;
        src.check(&(src_offset..src_end))?;
        // SAFETY: both ranges are inside their mappings (checked) which live
        // for the borrows of `self` and `src`. If both are the same region
        // the ranges may overlap, so `copy` (memmove) is used in that case.
        unsafe {
            let d = self.map.as_mut_ptr().add(dst_offset);
            let s = src.map.as_ptr().add(src_offset);
            if std::ptr::eq(self, src) {
                std::ptr::copy(s, d, len);
            } else {
                std::ptr::copy_nonoverlapping(s, d, len);
            }
        }
        Ok(())
    }

    /// Run `f` on a mutable view of `range` (e.g. to `read()` a socket
    /// straight into destination pages). The caller must hold the right to
    /// write those bytes (a page lease or writer guard): the view is exclusive
    /// only by that discipline.
    pub fn with_mut<R>(
        &self,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, KvError> {
        self.check(&range)?;
        // SAFETY: in bounds (checked); the mapping outlives the closure call.
        // Exclusivity of these bytes within this process is the lease
        // discipline documented above; other processes cannot be constrained
        // by Rust references at all, and the view does not escape `f`.
        let view = unsafe {
            std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(range.start), range.len())
        };
        Ok(f(view))
    }

    /// Run `f` on read-only views of `ranges`, as [`IoSlice`]s ready for a
    /// vectored write. The bytes must not be written while `f` runs (they are
    /// source pages whose KV is computed).
    pub fn with_slices<R>(
        &self,
        ranges: &[Range<usize>],
        f: impl FnOnce(&[IoSlice<'_>]) -> R,
    ) -> Result<R, KvError> {
        for r in ranges {
            self.check(r)?;
        }
        let slices: Vec<IoSlice<'_>> = ranges
            .iter()
            .map(|r| {
                // SAFETY: in bounds (checked above); the mapping outlives the
                // slices, which do not escape `f`; the owner does not write
                // computed source pages while they are sent.
                IoSlice::new(unsafe {
                    std::slice::from_raw_parts(self.map.as_ptr().add(r.start), r.len())
                })
            })
            .collect();
        Ok(f(&slices))
    }

    /// The whole region as `f32`s, for the pool's owner.
    pub(crate) fn as_f32(&self) -> &[f32] {
        // SAFETY: the mapping is page-aligned (so aligned for f32), `len` is a
        // multiple of 4 for pools (the pool creates it so), the mapping lives
        // as long as `&self`. Pages other parties write are leased to them and
        // not read through this view until the lease comes back.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<f32>(), self.len / 4) }
    }

    /// The whole region as mutable `f32`s, for the pool's owner: the pool
    /// calls it only under `&mut KvPool`, which makes the view exclusive
    /// among the pool's users in this process.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn as_f32_owner_mut(&self) -> &mut [f32] {
        // SAFETY: as `as_f32`; the only caller holds `&mut KvPool`, the
        // region's owner, so no other view of the pool's pages exists in
        // this process; transports copy into leased pages through raw
        // pointers, never through references.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().cast::<f32>(), self.len / 4) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_sees_writes_and_bounds_are_checked() {
        let a = ShmRegion::create("test-region", 8192).unwrap();
        let b = ShmRegion::open(&a.handle()).unwrap();
        b.write_at(4090, b"hello").unwrap();
        let mut out = [0u8; 5];
        a.read_at(4090, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(matches!(
            b.write_at(8190, b"xyz"),
            Err(KvError::OutOfBounds { .. })
        ));
        assert!(b.write_at(usize::MAX, b"x").is_err());
        let c = ShmRegion::create("src", 16).unwrap();
        c.write_at(0, b"0123456789abcdef").unwrap();
        a.copy_from(100, &c, 4, 8).unwrap();
        a.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"45678");
        assert!(a.copy_from(0, &c, 10, 8).is_err());
        let n = a
            .with_slices(&[0..2, 4090..4092], |s| {
                s.iter().map(|s| s.len()).sum::<usize>()
            })
            .unwrap();
        assert_eq!(n, 4);
        a.with_mut(0..3, |v| v.copy_from_slice(b"abc")).unwrap();
        b.read_at(0, &mut out[..3]).unwrap();
        assert_eq!(&out[..3], b"abc");
        let h = a.handle();
        assert_eq!(ShmRegionHandle::from_bytes(&h.to_bytes()), h);
    }

    /// Resident bytes of the mapping that starts at `addr`, from
    /// `/proc/self/smaps`.
    fn rss_of(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(l) = lines.next() {
            let start = l.split('-').next().unwrap_or("");
            if usize::from_str_radix(start, 16).ok() != Some(addr) {
                continue;
            }
            for l in lines.by_ref() {
                if let Some(kb) = l.strip_prefix("Rss:") {
                    let kb = kb.trim().trim_end_matches("kB").trim();
                    return kb.parse::<usize>().unwrap() * 1024;
                }
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    #[test]
    fn a_created_region_is_resident_and_an_opened_one_maps_lazily() {
        let len = 4 << 20;
        let a = ShmRegion::create("populated", len).unwrap();
        assert_eq!(rss_of(a.map.as_ptr() as usize), len);
        let b = ShmRegion::open(&a.handle()).unwrap();
        assert_eq!(rss_of(b.map.as_ptr() as usize), 0);
    }

    #[test]
    fn short_or_missing_files_are_refused() {
        let a = ShmRegion::create("short", 4096).unwrap();
        let mut h = a.handle();
        h.len = 8192;
        assert!(ShmRegion::open(&h).is_err());
        h.fd = 1_000_000;
        assert!(ShmRegion::open(&h).is_err());
        assert!(ShmRegion::create("zero", 0).is_err());
    }
}
