//! What an endpoint reports about itself.

use handoff_proto::room::RoomStats;
use handoff_proto::PeerId;

/// Counters and gauges of one endpoint (prefill or decode).
#[derive(Debug, Clone, Default)]
pub struct EndpointStats {
    /// Live rooms (Draining included).
    pub live_rooms: usize,
    /// Peers with an established control connection.
    pub peers: usize,
    /// Their ranks.
    pub peers_ranks: Vec<PeerId>,
    /// Data links up.
    pub links: usize,
    /// Their streams (a TCP link may have several; shm links have one).
    pub link_streams: usize,
    /// The room table's counters.
    pub room_stats: RoomStats,
    /// Malformed control frames counted and dropped.
    pub malformed_frames: u64,
    /// Data segments rejected by bounds checks.
    pub rejected_segments: u64,
    /// Handshakes refused (version, fingerprint, secret, garbage).
    pub handshakes_failed: u64,
    /// Live tasks.
    pub tasks: usize,
    /// How much later than due the driver woke, in all: its process or
    /// machine stalled. Not counted as any peer's heartbeat silence.
    pub stalled: std::time::Duration,
    /// KV payload bytes queued onto data links since the start (prefill;
    /// 0 on decode). A room whose decode already held a prefix moves only
    /// the pages past it.
    pub kv_bytes_sent: u64,
    /// NIXL READs given up after a stall (decode): their rooms failed, and
    /// their pages were held until each READ ended.
    pub stalled_reads: u64,
}
