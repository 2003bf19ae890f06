//! Counters an endpoint's link tasks share.

use std::sync::atomic::AtomicU64;

/// Counters shared by an endpoint's tasks (read for stats and metrics).
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// Malformed control frames dropped.
    pub malformed_frames: AtomicU64,
    /// Data segments rejected (unknown room, page not the room's, range).
    pub rejected_segments: AtomicU64,
    /// Handshakes refused.
    pub handshakes_failed: AtomicU64,
    /// Payload bytes placed into the pool.
    pub bytes_landed: AtomicU64,
    /// KV payload bytes queued onto data links (prefill; a room cancelled
    /// mid-write moves less).
    pub kv_bytes_sent: AtomicU64,
    /// NIXL READs given up after a stall (their rooms failed; their pages
    /// were held until each READ ended).
    pub stalled_reads: AtomicU64,
}
