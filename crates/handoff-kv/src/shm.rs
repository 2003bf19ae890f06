//! Shared-memory backing for a KV pool.
//!
//! A [`ShmRegion`] is an anonymous memory file (`memfd_create`) mapped shared
//! into this process. Another process on the host maps the same pages by
//! opening `/proc/<pid>/fd/<fd>` ([`ShmRegionHandle`]): a transfer peer maps
//! a pool *read-only* ([`ShmRegion::open_read_only`]) and copies KV out of it
//! (decode pulls from prefill, DESIGN.md "No write after release"), so no
//! process ever writes into memory another process owns.
//!
//! Soundness: no safe function here hands out `&mut` into a region. Bytes
//! are written and read by copies through raw pointers
//! ([`ShmRegion::write_at`], [`ShmRegion::read_at`], [`ShmRegion::copy_from`],
//! and [`ShmRegion::readv_into`], where the kernel writes), each
//! bounds-checked; bytes are sent with [`ShmRegion::writev_to`], whose
//! region pieces the kernel reads by raw pointer. No function, safe or
//! not, makes a reference to region bytes: the pool's blocks
//! ([`crate::KvBlock`]) are read by the same copies. The one exception is
//! [`PageGenerations`]' table, reached only as atomics; every byte copy
//! refuses its range ([`ShmRegion::check_bytes`]), so a plain copy never
//! races an atomic store. Which pages a writer may touch is decided by
//! page leases (`crate::lease`); [`PageGenerations`] lets a reader in
//! another process detect a page handed out again under its copy.
//!
//! This is the only module of the crate with `unsafe`; each block says why it
//! holds.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

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
    /// False for a peer's pool mapped read-only: writes are refused here,
    /// and the kernel would fault them anyway.
    writable: bool,
    /// Bytes accessed only atomically (a [`PageGenerations`] table, set
    /// once): every byte copy in or out of the region refuses them, so a
    /// plain copy never races an atomic store.
    atomics: OnceLock<Range<usize>>,
}

impl std::fmt::Debug for ShmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRegion")
            .field("fd", &self.file.as_raw_fd())
            .field("len", &self.len)
            .field("writable", &self.writable)
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
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd: OwnedFd =
            rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .map_err(|e| io_err("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io_err("ftruncate", e))?;
        // Its size is fixed for good: a peer that maps it can never take a
        // SIGBUS from a shrink, and nobody can remove the seals.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| io_err("sealing the region's size", e))?;
        Self::map(File::from(fd), len, true, true)
    }

    /// A peer's region is mapped only if its size is sealed: reading a page
    /// of a memfd its owner shrank kills the reader with SIGBUS, so an
    /// unsealed (hostile or foreign) region is refused here, before any
    /// page of it is touched.
    fn check_sealed(file: &File, what: &str) -> Result<(), KvError> {
        use rustix::fs::SealFlags;
        let seals = rustix::fs::fcntl_get_seals(file).map_err(|e| {
            KvError::Shm(format!(
                "{what} is not a sealable memory file ({e}): refused, a shrink of it would crash this process"
            ))
        })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(KvError::Shm(format!(
                "{what} is not sealed against shrinking: refused, a shrink of it would crash this process"
            )));
        }
        Ok(())
    }

    /// Map the region another process described in `handle`, through
    /// `/proc/<pid>/fd/<fd>` (same user, same host), read-write.
    pub fn open(handle: &ShmRegionHandle) -> Result<Self, KvError> {
        Self::open_with(handle, true)
    }

    /// Map a peer's region read-only: nothing this process does can change
    /// the peer's memory (decode maps a prefill's pool this way and pulls
    /// KV out of it).
    pub fn open_read_only(handle: &ShmRegionHandle) -> Result<Self, KvError> {
        Self::open_with(handle, false)
    }

    fn open_with(handle: &ShmRegionHandle, writable: bool) -> Result<Self, KvError> {
        let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(&path)
            .map_err(|e| io_err(&format!("open {path}"), e))?;
        Self::check_sealed(&file, &path)?;
        let len = usize::try_from(handle.len)
            .map_err(|_| KvError::Shm(format!("region of {} bytes", handle.len)))?;
        Self::map(file, len, false, writable)
    }

    /// Map a region from a descriptor received from another process.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self, KvError> {
        let file = File::from(fd);
        Self::check_sealed(&file, "the received region")?;
        Self::map(file, len, false, true)
    }

    fn map(file: File, len: usize, populate: bool, writable: bool) -> Result<Self, KvError> {
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
        let map = if writable {
            options.map_raw(&file)
        } else {
            options.map_raw_read_only(&file)
        }
        .map_err(|e| io_err("mmap", e))?;
        Ok(Self {
            map,
            file,
            len,
            writable,
            atomics: OnceLock::new(),
        })
    }

    /// Whether this mapping may be written.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    fn check_writable(&self) -> Result<(), KvError> {
        if self.writable {
            Ok(())
        } else {
            Err(KvError::Shm("the region is mapped read-only".into()))
        }
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

    /// The address this process maps the region at: what a transfer
    /// library registers (NIXL) and names in its descriptors. Only an
    /// address: nothing here hands out a reference into shared memory.
    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
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

    /// Check `range` lies inside the region and outside its atomic words
    /// (what every byte copy in or out of the region checks).
    pub fn check_bytes(&self, range: &Range<usize>) -> Result<(), KvError> {
        self.check(range)?;
        match self.atomics.get() {
            Some(a) if range.start < a.end && a.start < range.end => Err(KvError::Shm(format!(
                "bytes {range:?} overlap the atomic words at {a:?}: they are never copied"
            ))),
            _ => Ok(()),
        }
    }

    /// Mark `range` as accessed only atomically, once per region (the same
    /// range again is accepted).
    fn reserve_atomics(&self, range: Range<usize>) -> Result<(), KvError> {
        self.check(&range)?;
        let set = self.atomics.get_or_init(|| range.clone());
        if *set == range {
            Ok(())
        } else {
            Err(KvError::Shm(format!(
                "atomic words at {range:?} asked for, {set:?} already kept"
            )))
        }
    }

    /// Copy `src` into the region at `offset`, bounds-checked.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), KvError> {
        let end = offset.saturating_add(src.len());
        self.check_bytes(&(offset..end))?;
        self.check_writable()?;
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
        self.check_bytes(&(offset..end))?;
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

    /// Read `dst.len()` f16 elements at `offset`, converted to f32, into
    /// `dst`: a copy like [`Self::read_at`] that converts as it copies (a
    /// shared pool's f16 blocks are read this way, in one pass).
    pub fn read_f16_as_f32(&self, offset: usize, dst: &mut [f32]) -> Result<(), KvError> {
        let end = offset.saturating_add(2 * dst.len());
        self.check_bytes(&(offset..end))?;
        if !offset.is_multiple_of(2) {
            return Err(KvError::Shm(format!("f16 elements at odd offset {offset}")));
        }
        // SAFETY: in bounds (checked) and 2-aligned (the mapping is
        // page-aligned); the mapping lives as long as `self`. The slice
        // exists only for this conversion and never leaves the function:
        // it is this copy's source pointer, as `read_at`'s is, with the
        // same rule that the bytes' writer is whoever holds their pages.
        unsafe {
            let src = std::slice::from_raw_parts(
                self.map.as_ptr().add(offset).cast::<half::f16>(),
                dst.len(),
            );
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
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
        self.check_bytes(&(dst_offset..dst_end))?;
        src.check_bytes(&(src_offset..src_end))?;
        self.check_writable()?;
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

    /// Read from `fd` (a socket, `read`-style, once) straight into `range`
    /// of the region, then on into `tail` when `range` is full: one
    /// `readv(2)` whose first buffer is region memory reached by raw pointer
    /// only, so no Rust reference to shared bytes is ever made. Returns the
    /// bytes read (`range` first). The caller must hold the right to write
    /// those bytes (a writer guard over their pages).
    pub fn readv_into(
        &self,
        range: Range<usize>,
        tail: &mut [u8],
        fd: BorrowedFd<'_>,
    ) -> Result<std::io::Result<usize>, KvError> {
        self.check_bytes(&range)?;
        self.check_writable()?;
        let iov = [
            libc::iovec {
                // SAFETY: in bounds (checked), the mapping outlives the call;
                // the pointer is handed to the kernel, not dereferenced here.
                iov_base: unsafe { self.map.as_mut_ptr().add(range.start) }.cast(),
                iov_len: range.len(),
            },
            libc::iovec {
                iov_base: tail.as_mut_ptr().cast(),
                iov_len: tail.len(),
            },
        ];
        // SAFETY: both iovecs describe writable memory that lives for the
        // call: mapped region bytes checked above and an exclusive slice.
        let n = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), 2) };
        Ok(if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        })
    }

    /// One `writev(2)` to `fd` (a socket, `write`-style: it may write less)
    /// of `parts` concatenated, from byte `skip` on, at most [`MAX_IOV`]
    /// pieces at a time. Region bytes are reached by raw pointer only, as in
    /// [`Self::readv_into`]: no Rust reference to shared memory is made, so
    /// a write to those bytes elsewhere (which the page leases rule out
    /// anyway) could change what is sent but not make a reference unsound.
    /// Returns the bytes written.
    pub fn writev_to(
        &self,
        parts: &[WritePart<'_>],
        skip: usize,
        fd: BorrowedFd<'_>,
    ) -> Result<std::io::Result<usize>, KvError> {
        for p in parts {
            if let WritePart::Region(r) = p {
                self.check_bytes(r)?;
            }
        }
        let mut skip = skip;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(parts.len().min(MAX_IOV));
        for p in parts {
            if iov.len() == MAX_IOV {
                break;
            }
            let (base, len): (*const u8, usize) = match p {
                WritePart::Bytes(b) => (b.as_ptr(), b.len()),
                // SAFETY: in bounds (checked above); the mapping outlives the
                // call; the pointer goes to the kernel, never dereferenced.
                WritePart::Region(r) => (unsafe { self.map.as_ptr().add(r.start) }, r.len()),
            };
            if skip >= len {
                skip -= len;
                continue;
            }
            iov.push(libc::iovec {
                // SAFETY: `skip < len`, so the pointer stays in the piece.
                iov_base: unsafe { base.add(skip) }.cast_mut().cast(),
                iov_len: len - skip,
            });
            skip = 0;
        }
        if iov.is_empty() {
            return Ok(Ok(0));
        }
        // SAFETY: every iovec describes memory that lives for the call and
        // that `writev` only reads: caller slices and checked region bytes.
        let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
        Ok(if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        })
    }

    /// The atomic 64-bit word at `offset` (8-aligned, in bounds).
    fn word(&self, offset: usize) -> Result<&AtomicU64, KvError> {
        self.check(&(offset..offset.saturating_add(8)))?;
        if !offset.is_multiple_of(8) {
            return Err(KvError::Shm(format!("word at {offset} is not 8-aligned")));
        }
        // SAFETY: in bounds and aligned (checked; the mapping is
        // page-aligned), alive as long as `&self`. Every access to these
        // words, in any process, is atomic; an atomic load of read-only
        // memory (a peer's read-only mapping) is allowed for lock-free
        // native sizes such as `AtomicU64` on the platforms we build for.
        Ok(unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU64>() })
    }
}

/// Most pieces one [`ShmRegion::writev_to`] hands the kernel (Linux's
/// `IOV_MAX`).
pub const MAX_IOV: usize = 1024;

/// A piece of a vectored write: bytes of the caller's, or a range of the
/// region ([`ShmRegion::writev_to`]).
#[derive(Debug, Clone)]
pub enum WritePart<'a> {
    /// The caller's bytes (a record header, say).
    Bytes(&'a [u8]),
    /// Bytes of the region, bounds-checked.
    Region(Range<usize>),
}

/// Per-page generations kept in a pool's shared region, after its KV bytes:
/// word 0 is the epoch (how many times pages were handed out), word `1 + p`
/// the epoch at which page `p` was last handed out. The pool's allocator
/// stamps pages before their new owner can write them; a peer that copies
/// pages out (decode pulling KV over shm) checks afterwards that none was
/// stamped past the epoch its sender named, seqlock style: if one was, the
/// page may have been rewritten under the copy and the copy is discarded.
#[derive(Debug, Clone)]
pub struct PageGenerations {
    region: Arc<ShmRegion>,
    offset: usize,
    pages: usize,
}

impl PageGenerations {
    /// Bytes the table of a pool of `pages` pages takes.
    pub fn table_bytes(pages: usize) -> usize {
        (pages + 1) * 8
    }

    /// The table at `offset` of `region`, for `pages` pages; refused unless
    /// it is 8-aligned and lies inside the region.
    pub fn new(region: Arc<ShmRegion>, offset: usize, pages: usize) -> Result<Self, KvError> {
        let end = Self::table_bytes(pages)
            .checked_add(offset)
            .ok_or_else(|| KvError::Shm(format!("generation table of {pages} pages")))?;
        if !offset.is_multiple_of(8) {
            return Err(KvError::Shm(format!(
                "generation table at {offset} is not 8-aligned"
            )));
        }
        region.reserve_atomics(offset..end)?;
        Ok(Self {
            region,
            offset,
            pages,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // Checked at construction: every index below `pages + 1` is inside.
        self.region
            .word(self.offset + 8 * i)
            .expect("generation word inside its checked table")
    }

    /// Pages in the table.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Where the table starts in its region (after the pool's KV bytes).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The current epoch: every page handed out so far was stamped at most
    /// this.
    pub fn epoch(&self) -> u64 {
        self.word(0).load(Ordering::SeqCst)
    }

    /// Stamp `pages` with a new epoch, before anyone writes them (the
    /// allocator calls it as it hands them out). Pages out of range are
    /// skipped (the allocator never has any).
    pub fn stamp(&self, pages: impl IntoIterator<Item = u32>) {
        let epoch = self.word(0).fetch_add(1, Ordering::SeqCst) + 1;
        for p in pages {
            if (p as usize) < self.pages {
                self.word(1 + p as usize).store(epoch, Ordering::SeqCst);
            }
        }
        // The stamps are visible before any write the new owner makes.
        fence(Ordering::SeqCst);
    }

    /// After copying `pages` out: whether none was handed out again after
    /// `epoch` (the copy then read what the sender meant). `None` when a
    /// page is out of range.
    pub fn unchanged_since(&self, pages: Range<u32>, epoch: u64) -> Option<bool> {
        if pages.end as usize > self.pages || pages.start > pages.end {
            return None;
        }
        // The copy's loads are ordered before the stamps' loads.
        fence(Ordering::Acquire);
        Some(
            pages
                .into_iter()
                .all(|p| self.word(1 + p as usize).load(Ordering::SeqCst) <= epoch),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region's size is sealed: its owner cannot shrink it (what would
    /// SIGBUS a peer reading a page past the new end), and a peer refuses to
    /// map a region that is not sealed.
    #[test]
    fn regions_are_sealed_and_unsealed_ones_are_refused() {
        let r = ShmRegion::create("handoff-seal-test", 1 << 16).unwrap();
        let err = rustix::fs::ftruncate(&r.file, 4096).unwrap_err();
        assert_eq!(err, rustix::io::Errno::PERM);
        assert!(ShmRegion::open_read_only(&r.handle()).is_ok());
        // A memory file without seals, as a hostile peer might offer.
        let fd =
            rustix::fs::memfd_create("handoff-kv-pool", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 16).unwrap();
        let file = File::from(fd);
        let handle = ShmRegionHandle {
            pid: std::process::id(),
            fd: file.as_raw_fd(),
            len: 1 << 16,
        };
        let err = ShmRegion::open_read_only(&handle).unwrap_err().to_string();
        assert!(err.contains("not sealed against shrinking"), "{err}");
        let err = ShmRegion::from_fd(file.into(), 1 << 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not sealed against shrinking"), "{err}");
    }

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
        // A vectored write of own bytes and region bytes, from byte 1 on.
        let (tx, mut rx) = std::os::unix::net::UnixStream::pair().unwrap();
        let parts = [WritePart::Bytes(b"ab"), WritePart::Region(4090..4095)];
        assert_eq!(a.writev_to(&parts, 1, tx.as_fd()).unwrap().unwrap(), 6);
        let mut got = [0u8; 6];
        std::io::Read::read_exact(&mut rx, &mut got).unwrap();
        assert_eq!(&got, b"bhello");
        assert!(matches!(
            a.writev_to(&[WritePart::Region(8190..8200)], 0, tx.as_fd()),
            Err(KvError::OutOfBounds { .. })
        ));
        // At most MAX_IOV pieces a call.
        let many = vec![WritePart::Region(0..1); MAX_IOV + 50];
        assert_eq!(a.writev_to(&many, 0, tx.as_fd()).unwrap().unwrap(), MAX_IOV);
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
    fn a_socket_read_lands_in_the_range_then_the_tail() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let a = ShmRegion::create("readv", 4096).unwrap();
        let (mut w, r) = std::os::unix::net::UnixStream::pair().unwrap();
        w.write_all(b"0123456789").unwrap();
        let mut tail = [0u8; 8];
        let n = a
            .readv_into(100..104, &mut tail, r.as_fd())
            .unwrap()
            .unwrap();
        assert_eq!(n, 10);
        let mut out = [0u8; 6];
        a.read_at(99, &mut out).unwrap();
        assert_eq!(&out, b"\x000123\x00");
        assert_eq!(&tail[..6], b"456789");
        assert!(matches!(
            a.readv_into(4090..4100, &mut tail, r.as_fd()),
            Err(KvError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn a_read_only_mapping_refuses_every_write_and_still_reads() {
        let a = ShmRegion::create("ro", 4096).unwrap();
        a.write_at(0, b"kv").unwrap();
        let b = ShmRegion::open_read_only(&a.handle()).unwrap();
        assert!(!b.is_writable() && a.is_writable());
        let mut out = [0u8; 2];
        b.read_at(0, &mut out).unwrap();
        assert_eq!(&out, b"kv");
        let (_w, r) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        for e in [
            b.write_at(0, b"x").unwrap_err(),
            b.copy_from(0, &a, 0, 1).unwrap_err(),
            b.readv_into(0..1, &mut [], r.as_fd()).unwrap_err(),
        ] {
            assert_eq!(
                e.to_string(),
                KvError::Shm("the region is mapped read-only".into()).to_string()
            );
        }
        // Copying out of it into a writable region works.
        let c = ShmRegion::create("dst", 4096).unwrap();
        c.copy_from(10, &b, 0, 2).unwrap();
        c.read_at(10, &mut out).unwrap();
        assert_eq!(&out, b"kv");
    }

    #[test]
    fn generations_show_a_page_handed_out_after_an_epoch_even_to_a_read_only_peer() {
        let region = Arc::new(ShmRegion::create("gens", 4096).unwrap());
        let g = PageGenerations::new(region.clone(), 64, 4).unwrap();
        assert_eq!(g.epoch(), 0);
        g.stamp([0, 1]);
        let e = g.epoch();
        assert_eq!(e, 1);
        let peer = Arc::new(ShmRegion::open_read_only(&region.handle()).unwrap());
        let seen = PageGenerations::new(peer, 64, 4).unwrap();
        assert_eq!(seen.unchanged_since(0..2, e), Some(true));
        g.stamp([1]);
        assert_eq!(seen.epoch(), 2);
        assert_eq!(seen.unchanged_since(0..1, e), Some(true));
        assert_eq!(seen.unchanged_since(0..2, e), Some(false));
        assert_eq!(seen.unchanged_since(3..5, e), None);
        // The table must be aligned and inside the region.
        assert!(PageGenerations::new(region.clone(), 60, 4).is_err());
        assert!(PageGenerations::new(region, 4096 - 16, 4).is_err());
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
