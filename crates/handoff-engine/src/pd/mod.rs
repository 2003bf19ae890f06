//! Disaggregated serving engines: a [`PrefillEngine`] computes
//! a prompt's KV and writes it into pages a [`DecodeEngine`] reserved; the
//! decode engine then generates in its continuous batch.
//!
//! Both run exactly the forward calls of the colocated engine (chunked
//! prefill from position 0 with `Phase::Prefill`, then `Phase::Decode` steps),
//! so greedy output is token for token the colocated output. Each engine owns
//! a small tokio runtime for its transfer endpoint (`handoff-transfer`); the
//! compute stays on its own thread, as in the colocated engine.
//!
//! Pairing: the caller (router or test) gives both engines the same
//! [`RoomId`]; the decode engine also gets the prefill's bootstrap address
//! ([`PrefillHandle::bootstrap_addr`]).
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use handoff_engine::pd::{DecodeEngine, PdConfig, PrefillEngine, RoomId};
//! use handoff_engine::{EngineConfig, GenerateRequest, StreamEvent};
//! use handoff_transfer::TransportKind;
//!
//! let cfg = EngineConfig::new("model.gguf");
//! let prefill = PrefillEngine::start(cfg.clone(), PdConfig::new(TransportKind::Shm))?;
//! let decode = DecodeEngine::start(cfg, PdConfig::new(TransportKind::Shm))?;
//! let req = GenerateRequest {
//!     prompt_ids: vec![1, 2, 3],
//!     sampling: Default::default(),
//!     arrived: std::time::Instant::now(),
//!     output_so_far: Vec::new(),
//!     class: Default::default(),
//! };
//! let room = RoomId::new(42).expect("non-zero");
//! // Both halves at once, as a router does; either may refuse (400 ...),
//! // and the other side then learns the same status and reason.
//! let ticket = prefill.submit(req.clone(), room)?;
//! let mut stream = decode.submit(req, room, prefill.bootstrap_addr())?;
//! while let Some(ev) = stream.blocking_next() {
//!     match ev {
//!         StreamEvent::Token(t) => print!("{}", t.text),
//!         StreamEvent::Finished(_) => break,
//!         StreamEvent::Error(e) => return Err(e.into()),
//!     }
//! }
//! let done = ticket.blocking_wait()?; // the prefill's view: KV landed
//! # let _ = done;
//! # Ok(())
//! # }
//! ```
//!
//! Sampling: the prefill samples the first token with the request's seed and
//! the decode engine continues from the same seed, so a *seeded* request gives
//! the colocated output. An unseeded, non-greedy request draws independent
//! seeds on each side and is not reproducible (it is not in colocated mode
//! either).

pub mod decode;
pub mod prefill;

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_kv::{PageAllocator, PageIndex, PageLease, PrefixCache, PrefixLock};
use handoff_proto::handshake::{Capabilities, Fingerprint, HandshakeConfig, KvLayoutKind};
use handoff_proto::room::RoomConfig;
use handoff_proto::Role;

use crate::config::EngineConfig;
use crate::engine::Loaded;
use crate::error::EngineError;
use crate::handle::LoadSnapshot;
use crate::request::GenerateRequest;

pub use decode::{DecodeEngine, DecodeHandle, LocalPrefills};
pub use handoff_proto::RoomId;
pub use handoff_transfer::TransportKind;
pub use prefill::{PrefillDone, PrefillEngine, PrefillHandle, PrefillTicket, PrefillTimings};

/// Transfer settings of a prefill or decode engine.
#[derive(Debug, Clone)]
pub struct PdConfig {
    /// Prefill: where decode peers connect (the bootstrap address; port 0
    /// picks one). Ignored by decode.
    pub listen: SocketAddr,
    /// Decode: transport of its data links (prefill follows decode's choice).
    pub transport_choice: TransportChoice,
    /// Room deadlines (bootstrap, waiting, transfer, abort fence, heartbeat)
    /// and limits.
    pub rooms: RoomConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Optional shared secret authenticating the handshake.
    pub secret: Option<Vec<u8>>,
    /// Threads of the engine's I/O runtime.
    pub io_threads: usize,
    /// Decode: TCP streams per data link (rooms are spread over them; they
    /// run in parallel with as many `io_threads`).
    pub tcp_streams: u8,
    /// Offer delta transfer in the handshake (the `DESTINATION_PREFIX`
    /// capability): a decode holding a cached prefix of a prompt reserves
    /// and receives only the pages past it. Both sides must offer it; off
    /// on either, every room moves its whole prompt.
    pub delta_transfer: bool,
    /// Offer the first position's alternatives (the `AUX_TOP` capability):
    /// off, this end behaves as a peer of the version before it, and
    /// decode refuses requests that ask for top logprobs from it.
    pub aux_top: bool,
    /// Decode: what a request whose KV transfer failed (the prefill died,
    /// timed out, misbehaved or could not be reached) gets by default.
    pub on_transfer_failure: OnTransferFailure,
}

/// What a decode engine does with a request whose KV transfer failed for a
/// reason on the prefill's side or between the two (not a refusal of the
/// request itself, not the client leaving).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnTransferFailure {
    /// Prefill the prompt here and go on: the client sees no error, only
    /// the time the local prefill took.
    #[default]
    Recompute,
    /// End the request with the transfer's typed error.
    Fail,
}

impl OnTransferFailure {
    /// The name the flag and the request field take.
    pub const fn name(self) -> &'static str {
        match self {
            OnTransferFailure::Recompute => "recompute",
            OnTransferFailure::Fail => "fail",
        }
    }
}

impl std::str::FromStr for OnTransferFailure {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "recompute" => Ok(OnTransferFailure::Recompute),
            "fail" => Ok(OnTransferFailure::Fail),
            other => Err(format!("`{other}`: expected recompute or fail")),
        }
    }
}

impl PdConfig {
    /// Defaults: listen on 127.0.0.1 (any port), always `transport`,
    /// protocol default timers, 1 I/O thread.
    pub fn new(transport: TransportKind) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            transport_choice: TransportChoice::Fixed(transport),
            rooms: RoomConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            secret: None,
            io_threads: 1,
            tcp_streams: 1,
            delta_transfer: true,
            aux_top: true,
            on_transfer_failure: OnTransferFailure::default(),
        }
    }
}

/// Which transport a decode engine uses for the data link to a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory for a prefill on a loopback address (same host), TCP
    /// otherwise.
    Auto,
    /// Always this transport (shm fails at link setup if the prefill is on
    /// another host).
    Fixed(TransportKind),
}

impl TransportChoice {
    /// The transport for a prefill listening at `addr`.
    pub fn for_peer(self, addr: SocketAddr) -> TransportKind {
        match self {
            TransportChoice::Fixed(k) => k,
            TransportChoice::Auto if addr.ip().is_loopback() => TransportKind::Shm,
            TransportChoice::Auto => TransportKind::Tcp,
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportChoice::Auto => f.write_str("auto"),
            TransportChoice::Fixed(k) => f.write_str(k.name()),
        }
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "shm" => Ok(TransportChoice::Fixed(TransportKind::Shm)),
            "tcp" => Ok(TransportChoice::Fixed(TransportKind::Tcp)),
            "nixl" => Ok(TransportChoice::Fixed(TransportKind::Nixl)),
            other => Err(format!(
                "unknown transport `{other}`: expected auto, shm, tcp or nixl"
            )),
        }
    }
}

/// `live_rooms` of an endpoint's `stats`, run on the engine's I/O runtime
/// and waited for from a non-async caller (0 once the runtime is gone).
fn blocking_live_rooms<F>(rt: Option<&tokio::runtime::Runtime>, stats: F) -> usize
where
    F: std::future::Future<
            Output = Result<handoff_transfer::EndpointStats, handoff_transfer::TransportError>,
        > + Send
        + 'static,
{
    let Some(rt) = rt else {
        return 0;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let _ = tx.send(stats.await.map(|s| s.live_rooms).unwrap_or(0));
    });
    rx.recv().unwrap_or(0)
}

/// The engine's I/O runtime (transfer endpoint and per-request tasks).
fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime, EngineError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| EngineError::Model(format!("cannot start the I/O runtime: {e}")))
}

/// What prefill and decode must agree on before they pair (the handshake):
/// model identity and weights, weight formats, KV geometry.
fn fingerprint(loaded: &Loaded, config: &EngineConfig) -> Result<Fingerprint, EngineError> {
    let g = loaded.pool.geometry();
    let cfg = loaded.model.config();
    let model_id = cfg.name.clone().unwrap_or_else(|| cfg.architecture.clone());
    Ok(Fingerprint {
        model_id,
        model_hash: model_hash(&config.model_path, &format!("{:?}", config.formats))?,
        layers: g.layers as u32,
        kv_heads: g.kv_heads as u32,
        head_dim: g.head_dim as u32,
        page_size: g.page_size as u32,
        dtype: g.dtype,
        layout: KvLayoutKind::LayerPageKv,
        tp_rank: 0,
        tp_size: 1,
    })
}

/// A 64-bit FNV-1a hash of the GGUF file and the weight formats (not
/// cryptographic: it only keeps two different models from pairing), in the
/// first 8 bytes; the file length in the next 8.
fn model_hash(path: &Path, formats: &str) -> Result<[u8; 32], EngineError> {
    let io = |e: std::io::Error| EngineError::Model(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(formats.as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        len += n as u64;
        eat(&buf[..n]);
    }
    let mut out = [0u8; 32];
    out[..8].copy_from_slice(&h.to_le_bytes());
    out[8..16].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Pages for a request's prompt, waiting in the fair order
/// ([`crate::fair`]: priority, tenant's share, arrival) behind other
/// requests while the pool is full (the prealloc queue: pool memory is the
/// backpressure):
/// once at the head of the queue, lock the longest cached prefix of
/// `prompt` that ends by token `max_tokens` and lease the rest of `total`
/// pages, evicting cached pages nothing reads when the free ones do not
/// suffice. Only the head holds a lock while it waits, so queued requests
/// never pin cached pages the head needs evicted. Never spins or polls: it
/// wakes when pages return ([`PageQueue::new`]).
async fn lease_prompt_pages(
    queue: &PageQueue,
    req: &GenerateRequest,
    max_tokens: usize,
    total: usize,
) -> (PrefixLock, PageLease) {
    let prompt = &req.prompt_ids;
    let work = prompt.len() + req.sampling.max_new_tokens;
    let _turn = queue.turn.turn(&req.class, work).await;
    let prefix = match &queue.cache {
        Some(c) => lock_cache(c).lookup_within(prompt, max_tokens),
        None => PrefixLock::default(),
    };
    let lease = lease_at_head(queue, total - prefix.pages().len()).await;
    (prefix, lease)
}

/// Lease `n` pages for the head of the queue (the caller holds the turn).
async fn lease_at_head(queue: &PageQueue, n: usize) -> PageLease {
    loop {
        // Registered before the attempt, so a return in between still wakes.
        let returned = queue.returned.notified();
        tokio::pin!(returned);
        returned.as_mut().enable();
        let leased = match &queue.cache {
            Some(c) => lock_cache(c).lease(&queue.allocator, n),
            None => queue.allocator.lease(n),
        };
        if let Ok(lease) = leased {
            return lease;
        }
        returned.await;
    }
}

/// The prefix cache, even if a panicking holder poisoned its lock (its
/// tree is only changed by complete operations).
fn lock_cache(cache: &Mutex<PrefixCache>) -> std::sync::MutexGuard<'_, PrefixCache> {
    cache.lock().unwrap_or_else(|e| e.into_inner())
}

/// The handshake settings of an engine with `pd`'s secret and capabilities.
fn handshake_config(role: Role, fp: Fingerprint, pd: &PdConfig) -> HandshakeConfig {
    let mut hs = HandshakeConfig::new(role, fp);
    hs.secret = pd.secret.clone();
    if !pd.delta_transfer {
        hs.capabilities = hs.capabilities.without(Capabilities::DESTINATION_PREFIX);
    }
    if !pd.aux_top {
        hs.capabilities = hs.capabilities.without(Capabilities::AUX_TOP);
    }
    hs
}

/// The requests of one engine waiting for pages of its pool, head first.
struct PageQueue {
    allocator: PageAllocator,
    /// Head of the queue, handed on in the fair order.
    turn: crate::fair::Turnstile,
    /// Woken each time pages return to the pool.
    returned: std::sync::Arc<tokio::sync::Notify>,
    /// The pool's prefix cache, whose unread pages give way to requests.
    cache: Option<Arc<Mutex<PrefixCache>>>,
}

impl PageQueue {
    /// A queue for `allocator`'s pages (and `cache`'s, if any).
    fn new(allocator: PageAllocator, cache: Option<Arc<Mutex<PrefixCache>>>) -> Self {
        let returned = std::sync::Arc::new(tokio::sync::Notify::new());
        let wake = returned.clone();
        allocator.on_return(move || wake.notify_waiters());
        Self {
            allocator,
            turn: crate::fair::Turnstile::new(),
            returned,
            cache,
        }
    }

    /// Empty the prefix cache of every page nothing reads; how many pages
    /// that freed (0 with the cache off).
    fn flush_cache(&self) -> usize {
        let freed = self.cache.as_ref().map_or(0, |c| lock_cache(c).flush());
        tracing::info!(pages = freed, "prefix cache flushed");
        freed
    }

    /// A computed (or received) prompt's full pages join the cache: see
    /// [`PrefixCache::insert`]. Nothing with the cache off.
    fn cache_prompt(
        &self,
        prompt: &[u32],
        pages: &[PageIndex],
        lease: &mut PageLease,
        lock: &mut PrefixLock,
    ) {
        if let Some(c) = &self.cache {
            lock_cache(c).insert(prompt, pages, lease, lock);
        }
    }

    /// A load report whose page counts leave out the cached pages nothing
    /// reads (eviction frees them on demand).
    fn load(&self, running: usize, waiting: usize, paused: usize) -> LoadSnapshot {
        // Both counts under the cache's lock, which every lease takes: a
        // request finishing in between can only lower the figure, a lease
        // that took its pages cannot raise it past the truth.
        let guard = self.cache.as_ref().map(|c| lock_cache(c));
        let cache = guard.as_ref().map(|c| c.stats()).unwrap_or_default();
        let pages = self.allocator.stats();
        drop(guard);
        LoadSnapshot {
            running,
            waiting,
            paused,
            pages_total: pages.total,
            pages_used: pages.leased.saturating_sub(cache.evictable),
            pages_cached: cache.pages,
            ..LoadSnapshot::default()
        }
    }
}

/// A gauge held up for as long as the guard lives.
struct Gauge<'a>(&'a AtomicUsize);

impl<'a> Gauge<'a> {
    fn enter(g: &'a AtomicUsize) -> Self {
        g.fetch_add(1, Ordering::AcqRel);
        Gauge(g)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
