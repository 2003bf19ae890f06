//! The weight cache: the interleaved Q8_0 matrices that `q8_matmul`
//! and the repacked K-quant ones that `kquant` compute from, written once per model file and formats into a file that
//! every process on the host maps read-only, so a PD pair and its replicas
//! share one page-cache copy instead of each converting and holding its
//! own (issue 31: llama.cpp repacks into each process's private memory).
//!
//! The file is made by the first process to need it, under an exclusive
//! `flock` on a lock file beside it, written to a temporary name and renamed
//! into place: a reader sees a whole file or none, and a process that
//! waited for the lock finds the file its builder wrote. A file is used
//! only when its key matches: a hash of the model file's header bytes, size
//! and modification time, the phase formats, this crate's version and the
//! Q8 layout. Anything else (another model, a truncated or foreign file) is
//! rebuilt, never trusted. Files are never written in place, so a process
//! mapping an old one keeps valid bytes when a new one replaces it.
//!
//! Writing a file also sweeps the directory of files whose model file is
//! gone or changed since (each file names its model's path, size and
//! time), so replaced models do not leave their weights behind.
//!
//! Layout (little-endian): `MAGIC`, the 32-byte key, the index's offset and
//! length (u64 each); the source record (the model's path as u32 length and
//! bytes, its size u64 and modification time u128 in ns); each matrix's
//! quants and scales at 64-byte aligned offsets; the index: a u32 count and
//! per matrix its name (u32 length, bytes), its kind (u32: 0 Q8_0, 1
//! Q4_K, 2 Q6_K), rows, columns, quants offset
//! and scales offset (u64 each).

use std::collections::HashMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::kquant::{Format, KMatrix};
use crate::mapped::MappedFile;
use crate::q8_matmul::Q8Matrix;
use crate::slab::Slab;
use crate::weight_format::PhaseFormats;

const MAGIC: &[u8; 8] = b"HOFFQ8W3";
/// Bump when `Q8Matrix`'s or a `KMatrix`'s stored layout changes.
const LAYOUT: u32 = 4;
const HEADER: usize = 8 + 32 + 16;
const ALIGN: u64 = 64;

/// What became of the weight cache on a load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// No cache directory was given.
    Off,
    /// The Q8_0 matrices were mapped from this file, written earlier.
    Hit(PathBuf),
    /// This load wrote the file and then mapped it.
    Written(PathBuf),
    /// The cache could not be used (the reason); the weights are this
    /// process's own, as without a cache.
    Unavailable(String),
}

impl std::fmt::Display for CacheOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheOutcome::Off => f.write_str("off"),
            CacheOutcome::Hit(p) => write!(f, "mapped from {}", p.display()),
            CacheOutcome::Written(p) => write!(f, "written to {} and mapped", p.display()),
            CacheOutcome::Unavailable(r) => write!(f, "unavailable ({r})"),
        }
    }
}

/// Where a load takes its Q8_0 matrices from.
pub(crate) enum Q8Store<'a> {
    /// Converted in this process.
    Build,
    /// Mapped from a cache file (a matrix it lacks is converted and counted).
    Read { file: &'a CacheFile, missing: usize },
    /// Converted here and appended to a cache file being written.
    Write(&'a mut CacheWriter),
}

impl Q8Store<'_> {
    /// The matrix `name` (`rows` × `cols`) from the cache, if this store
    /// reads one that holds it.
    pub(crate) fn lookup(&mut self, name: &str, rows: usize, cols: usize) -> Option<Q8Matrix> {
        match self {
            Q8Store::Read { file, missing } => {
                let m = file.q8(name, rows, cols);
                if m.is_none() {
                    *missing += 1;
                }
                m
            }
            _ => None,
        }
    }

    /// Note a matrix converted in this process.
    pub(crate) fn record(&mut self, name: &str, m: &Q8Matrix) {
        if let Q8Store::Write(w) = self {
            let (qs, d) = m.stored_bytes();
            w.append(name, Kind::Q8, [m.out_dim(), m.in_dim()], qs, d);
        }
    }

    /// [`Self::lookup`] for a repacked K-quant matrix.
    pub(crate) fn lookup_k<F: Format>(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Option<KMatrix<F>> {
        match self {
            Q8Store::Read { file, missing } => {
                let m = file.k(name, rows, cols);
                if m.is_none() {
                    *missing += 1;
                }
                m
            }
            _ => None,
        }
    }

    /// [`Self::record`] for a repacked K-quant matrix.
    pub(crate) fn record_k<F: Format>(&mut self, name: &str, m: &KMatrix<F>) {
        if let Q8Store::Write(w) = self {
            if let Some(kind) = Kind::of::<F>() {
                w.append(name, kind, [m.out_dim(), m.in_dim()], m.stored_bytes(), &[]);
            }
        }
    }
}

/// What a cache entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `Q8Matrix`: quants, then scales.
    Q8 = 0,
    /// `Q4kMatrix`: its group-blocks (and an empty second array).
    Q4k = 1,
    /// `Q6kMatrix`: its group-blocks (and an empty second array).
    Q6k = 2,
}

impl Kind {
    /// The kind of a repacked `F` matrix (`None`: a format the cache does
    /// not keep).
    fn of<F: Format>() -> Option<Kind> {
        match F::DTYPE {
            candle_core::quantized::GgmlDType::Q4K => Some(Kind::Q4k),
            candle_core::quantized::GgmlDType::Q6K => Some(Kind::Q6k),
            _ => None,
        }
    }
}

struct Entry {
    kind: Kind,
    rows: usize,
    cols: usize,
    qs: usize,
    d: usize,
}

/// A cache file, mapped and its index read.
pub(crate) struct CacheFile {
    map: Arc<MappedFile>,
    entries: HashMap<String, Entry>,
}

impl CacheFile {
    /// Map `path` if it is a cache file with this `key`; why not otherwise.
    pub(crate) fn open(path: &Path, key: &[u8; 32]) -> Result<CacheFile, String> {
        let map = MappedFile::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let entries = Self::index(map.bytes(), key)?;
        let file = CacheFile { map, entries };
        for (name, e) in &file.entries {
            let fits = match e.kind {
                Kind::Q8 => file.q8(name, e.rows, e.cols).is_some(),
                Kind::Q4k => file.k::<crate::kquant::Q4k>(name, e.rows, e.cols).is_some(),
                Kind::Q6k => file.k::<crate::kquant::Q6k>(name, e.rows, e.cols).is_some(),
            };
            if !fits {
                return Err(format!("matrix {name} does not lie in the file"));
            }
        }
        Ok(file)
    }

    fn index(b: &[u8], key: &[u8; 32]) -> Result<HashMap<String, Entry>, String> {
        if b.len() < HEADER || &b[..8] != MAGIC {
            return Err("not a handoff Q8 weight cache of this version".into());
        }
        if &b[8..40] != key {
            return Err("made for another model file, formats or handoff version".into());
        }
        let mut r = Reader { b, at: 40 };
        let (off, len) = (r.u64()?, r.u64()?);
        let end = off.checked_add(len).ok_or("index out of range")?;
        let idx = b
            .get(off..end)
            .ok_or("index lies past the end of the file")?;
        let mut r = Reader { b: idx, at: 0 };
        let count = r.u32()?;
        let mut entries = HashMap::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            let n = r.u32()?;
            let name = std::str::from_utf8(r.take(n)?)
                .map_err(|_| "a matrix name is not UTF-8")?
                .to_string();
            let e = Entry {
                kind: match r.u32()? {
                    0 => Kind::Q8,
                    1 => Kind::Q4k,
                    2 => Kind::Q6k,
                    k => return Err(format!("matrix {name} is of unknown kind {k}")),
                },
                rows: r.u64()?,
                cols: r.u64()?,
                qs: r.u64()?,
                d: r.u64()?,
            };
            entries.insert(name, e);
        }
        if r.at != idx.len() {
            return Err("bytes after the index".into());
        }
        Ok(entries)
    }

    /// The matrix `name`, if the file holds it with this shape.
    pub(crate) fn q8(&self, name: &str, rows: usize, cols: usize) -> Option<Q8Matrix> {
        let e = self.entries.get(name)?;
        if (e.kind, e.rows, e.cols) != (Kind::Q8, rows, cols) {
            return None;
        }
        let n = Q8Matrix::stored_len(rows, cols)?;
        Q8Matrix::from_slabs(
            rows,
            cols,
            Slab::mapped(&self.map, e.qs, n)?,
            Slab::mapped(&self.map, e.d, n)?,
        )
    }
}

impl CacheFile {
    /// The repacked K-quant matrix `name`, if the file holds it with this
    /// format and shape.
    pub(crate) fn k<F: Format>(&self, name: &str, rows: usize, cols: usize) -> Option<KMatrix<F>> {
        let e = self.entries.get(name)?;
        if (Some(e.kind), e.rows, e.cols) != (Kind::of::<F>(), rows, cols) {
            return None;
        }
        let n = KMatrix::<F>::stored_len(rows, cols)?;
        // The second array is empty, but its offset must lie in the file
        // as every offset must.
        Slab::<u8>::mapped(&self.map, e.d, 0)?;
        KMatrix::from_slab(rows, cols, Slab::mapped(&self.map, e.qs, n)?)
    }
}

/// Reads little-endian fields, failing past the end.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).ok_or("field out of range")?;
        let s = self.b.get(self.at..end).ok_or("the index is cut short")?;
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<usize, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
    }
    fn u64(&mut self) -> Result<usize, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        usize::try_from(u64::from_le_bytes(a)).map_err(|_| "a field does not fit".into())
    }
}

/// A cache file being written under a temporary name.
pub(crate) struct CacheWriter {
    file: std::io::BufWriter<std::fs::File>,
    tmp: PathBuf,
    at: u64,
    index: Vec<u8>,
    count: u32,
    names: std::collections::HashSet<String>,
    error: Option<std::io::Error>,
}

impl CacheWriter {
    fn create(tmp: &Path, source: &ModelStamp) -> std::io::Result<CacheWriter> {
        let mut file = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        file.write_all(&[0u8; HEADER])?;
        let record = source.record();
        file.write_all(&record)?;
        Ok(CacheWriter {
            file,
            tmp: tmp.to_path_buf(),
            at: (HEADER + record.len()) as u64,
            index: Vec::new(),
            count: 0,
            names: Default::default(),
            error: None,
        })
    }

    fn put(&mut self, bytes: &[u8]) -> std::io::Result<u64> {
        let pad = self.at.next_multiple_of(ALIGN) - self.at;
        self.file
            .write_all(&[0u8; ALIGN as usize][..pad as usize])?;
        let at = self.at + pad;
        self.file.write_all(bytes)?;
        self.at = at + bytes.len() as u64;
        Ok(at)
    }

    /// Append a matrix of `kind` and `[rows, cols]`, its two stored
    /// arrays (once per name; a write error is kept for [`Self::finish`]).
    fn append(&mut self, name: &str, kind: Kind, shape: [usize; 2], qs: &[u8], d: &[u8]) {
        if self.error.is_some() || !self.names.insert(name.to_string()) {
            return;
        }
        let res = self.put(qs).and_then(|q| Ok((q, self.put(d)?)));
        match res {
            Ok((q, d)) => {
                self.index
                    .extend_from_slice(&(name.len() as u32).to_le_bytes());
                self.index.extend_from_slice(name.as_bytes());
                self.index.extend_from_slice(&(kind as u32).to_le_bytes());
                for v in [shape[0] as u64, shape[1] as u64, q, d] {
                    self.index.extend_from_slice(&v.to_le_bytes());
                }
                self.count += 1;
            }
            Err(e) => self.error = Some(e),
        }
    }

    /// Write the index and header, sync, and rename the file to `path`.
    fn finish(mut self, key: &[u8; 32], path: &Path) -> std::io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let off = self.at;
        self.file.write_all(&self.count.to_le_bytes())?;
        self.file.write_all(&self.index)?;
        let len = 4 + self.index.len() as u64;
        let mut file = self.file.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(key);
        head.extend_from_slice(&off.to_le_bytes());
        head.extend_from_slice(&len.to_le_bytes());
        file.write_all(&head)?;
        file.sync_all()?;
        std::fs::rename(&self.tmp, path)
    }
}

/// The model file a cache file was made from, as it was then.
#[derive(Debug, PartialEq, Eq)]
struct ModelStamp {
    path: PathBuf,
    size: u64,
    mtime: u128,
}

impl ModelStamp {
    fn of(path: &Path) -> std::io::Result<ModelStamp> {
        let path = std::fs::canonicalize(path)?;
        let meta = std::fs::metadata(&path)?;
        let mtime = meta
            .modified()?
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ok(ModelStamp {
            path,
            size: meta.len(),
            mtime,
        })
    }

    fn record(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let p = self.path.as_os_str().as_bytes();
        let mut r = Vec::with_capacity(4 + p.len() + 24);
        r.extend_from_slice(&(p.len() as u32).to_le_bytes());
        r.extend_from_slice(p);
        r.extend_from_slice(&self.size.to_le_bytes());
        r.extend_from_slice(&self.mtime.to_le_bytes());
        r
    }

    /// The source record of the cache file at `path`, if it is one.
    fn read(path: &Path) -> Option<ModelStamp> {
        use std::io::Read;
        use std::os::unix::ffi::OsStrExt;
        let mut head = Vec::new();
        std::fs::File::open(path)
            .ok()?
            .take(HEADER as u64 + 4 + 4096 + 24)
            .read_to_end(&mut head)
            .ok()?;
        // Any version's file: the source record has kept its place and
        // layout since the first, so older versions' files are swept too.
        if head.get(..7)? != &MAGIC[..7] {
            return None;
        }
        let mut r = Reader {
            b: &head,
            at: HEADER,
        };
        let n = r.u32().ok()?;
        let p = PathBuf::from(std::ffi::OsStr::from_bytes(r.take(n).ok()?));
        let size = r.u64().ok()? as u64;
        let mut t = [0u8; 16];
        t.copy_from_slice(r.take(16).ok()?);
        Some(ModelStamp {
            path: p,
            size,
            mtime: u128::from_le_bytes(t),
        })
    }
}

/// The cache's file names for one model and formats, and its lock.
pub(crate) struct CachePaths {
    /// The cache file.
    pub(crate) file: PathBuf,
    lock: PathBuf,
    tmp: PathBuf,
    /// What the file must hold to be used.
    pub(crate) key: [u8; 32],
    source: ModelStamp,
}

impl CachePaths {
    /// Names under `dir` for the model at `model` (mapped as `map`, its
    /// header `header_len` bytes) with `formats`.
    pub(crate) fn new(
        dir: &Path,
        model: &Path,
        map: &MappedFile,
        header_len: usize,
        formats: PhaseFormats,
    ) -> std::io::Result<CachePaths> {
        let source = ModelStamp::of(model)?;
        let mut h = Sha256::new();
        h.update(MAGIC);
        h.update(LAYOUT.to_le_bytes());
        h.update(env!("CARGO_PKG_VERSION").as_bytes());
        h.update(format!("{}/{}", formats.prefill, formats.decode).as_bytes());
        h.update(source.size.to_le_bytes());
        h.update(source.mtime.to_le_bytes());
        h.update(map.bytes().get(..header_len).unwrap_or_default());
        let key: [u8; 32] = h.finalize().into();
        let stem = model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let hex: String = key[..8].iter().map(|b| format!("{b:02x}")).collect();
        let base = format!("{stem}.{hex}");
        Ok(CachePaths {
            file: dir.join(format!("{base}.q8w")),
            lock: dir.join(format!("{base}.lock")),
            tmp: dir.join(format!("{base}.q8w.tmp")),
            key,
            source,
        })
    }

    /// Take the builder's lock (blocking while another process builds).
    pub(crate) fn lock(&self) -> std::io::Result<std::fs::File> {
        if let Some(dir) = self.lock.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock)?;
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)?;
        Ok(f)
    }

    /// Start writing the file (call with the lock held: the temporary name
    /// is the lock holder's).
    pub(crate) fn writer(&self) -> std::io::Result<CacheWriter> {
        CacheWriter::create(&self.tmp, &self.source)
    }

    /// Finish `w` into the cache file, then sweep the directory.
    pub(crate) fn finish(&self, w: CacheWriter) -> std::io::Result<()> {
        let tmp = w.tmp.clone();
        let res = w.finish(&self.key, &self.file);
        if res.is_err() {
            let _ = std::fs::remove_file(tmp);
        } else {
            self.sweep();
        }
        res
    }

    /// Remove the cache files (and their locks) of this directory whose
    /// model file is gone or has another size or time than when the file
    /// was made: no process will ask for them again. A process that maps
    /// one keeps its bytes (the file is only unlinked).
    fn sweep(&self) {
        let Some(dir) = self.file.parent() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path == self.file || path.extension().is_none_or(|x| x != "q8w") {
                continue;
            }
            let Some(src) = ModelStamp::read(&path) else {
                continue;
            };
            let now = ModelStamp::of(&src.path).ok();
            if now.is_none_or(|now| now != src) {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(path.with_extension("lock"));
            }
        }
    }
}
