//! Small fixtures shared by the conformance suite, the peer process
//! (`src/bin/peer.rs`) and dependents' tests: a tiny geometry, short timers,
//! matching handshake configs. Compiled only with the `testing` feature,
//! which no product build turns on.

use std::time::Duration;

use handoff_kv::{KvDtype, KvGeometry, KvPool, ShmRegionHandle};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig, KvLayoutKind};
use handoff_proto::receiver_room::Source;
use handoff_proto::room::RoomConfig;
use handoff_proto::timer::TimerConfig;
use handoff_proto::{PeerId, Role};

use crate::{ReceiverConfig, SenderConfig, TransportKind};

/// Pages in a test pool.
pub const TEST_PAGES: usize = 64;

/// The test geometry: 2 layers, 1 KV head of 4, pages of 4 tokens.
pub fn geometry() -> KvGeometry {
    KvGeometry {
        layers: 2,
        kv_heads: 1,
        head_dim: 4,
        page_size: 4,
        dtype: KvDtype::F32,
    }
}

/// A shared test pool.
pub fn pool() -> (KvPool, ShmRegionHandle) {
    match KvPool::new_shared(geometry(), TEST_PAGES) {
        Ok(p) => p,
        Err(e) => panic!("shared pool: {e}"),
    }
}

/// A fingerprint for `g`.
pub fn fingerprint(g: &KvGeometry) -> Fingerprint {
    Fingerprint {
        model_id: "test-model".into(),
        model_hash: [3; 32],
        layers: g.layers as u32,
        kv_heads: g.kv_heads as u32,
        head_dim: g.head_dim as u32,
        page_size: g.page_size as u32,
        dtype: g.dtype,
        layout: KvLayoutKind::LayerPageKv,
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Short timers: the suite runs in seconds.
pub fn timers() -> TimerConfig {
    TimerConfig {
        bootstrap: Duration::from_secs(3),
        waiting_for_input: Duration::from_secs(3),
        transfer: Duration::from_secs(3),
        abort_ack_fence: Duration::from_millis(1000),
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_miss: Duration::from_millis(400),
        unknown_room_ttl: Duration::from_secs(3),
    }
}

fn rooms() -> RoomConfig {
    RoomConfig {
        timers: timers(),
        ..RoomConfig::default()
    }
}

/// Prefill settings for the test geometry.
pub fn sender_config() -> SenderConfig {
    let mut c = SenderConfig::new(HandshakeConfig::new(
        Role::Prefill,
        fingerprint(&geometry()),
    ));
    c.rooms = rooms();
    c.handshake_timeout = Duration::from_secs(2);
    c
}

tokio::task_local! {
    /// TCP streams per link for [`receiver_config`] inside [`with_tcp_streams`].
    static TCP_STREAMS: u8;
}

/// Run `body` with every [`receiver_config`] it makes asking for `streams`
/// TCP streams per link (the conformance suite runs its TCP cases once
/// with one stream and once with several).
pub async fn with_tcp_streams<F: std::future::Future>(streams: u8, body: F) -> F::Output {
    TCP_STREAMS.scope(streams, body).await
}

/// Decode settings for the test geometry.
pub fn receiver_config(kind: TransportKind) -> ReceiverConfig {
    let mut c = ReceiverConfig::new(
        HandshakeConfig::new(Role::Decode, fingerprint(&geometry())),
        kind,
    );
    c.rooms = rooms();
    c.handshake_timeout = Duration::from_secs(2);
    c.tcp_streams = TCP_STREAMS.try_with(|s| *s).unwrap_or(1);
    c
}

/// KV heads of the model in the TP (fan-in / fan-out) tests.
pub const TP_KV_HEADS: usize = 4;

/// The test geometry as seen by one rank of a TP group of `tp_size`: each
/// block holds that rank's share of [`TP_KV_HEADS`].
pub fn tp_geometry(tp_size: usize) -> KvGeometry {
    KvGeometry {
        kv_heads: TP_KV_HEADS / tp_size,
        ..geometry()
    }
}

/// A shared pool for one rank of a TP group of `tp_size`.
pub fn tp_pool(tp_size: usize) -> (KvPool, ShmRegionHandle) {
    match KvPool::new_shared(tp_geometry(tp_size), TEST_PAGES) {
        Ok(p) => p,
        Err(e) => panic!("shared pool: {e}"),
    }
}

/// The fingerprint of TP rank `rank` of `size` over [`TP_KV_HEADS`].
pub fn tp_fingerprint(rank: u32, size: u32) -> Fingerprint {
    Fingerprint {
        kv_heads: TP_KV_HEADS as u32,
        tp_rank: rank,
        tp_size: size,
        ..fingerprint(&geometry())
    }
}

/// Prefill settings for TP rank `rank` of `size`.
pub fn tp_sender_config(rank: u32, size: u32) -> SenderConfig {
    let mut c = sender_config();
    c.handshake.fingerprint = tp_fingerprint(rank, size);
    c
}

/// Decode settings for TP rank `rank` of `size`.
pub fn tp_receiver_config(kind: TransportKind, rank: u32, size: u32) -> ReceiverConfig {
    let mut c = receiver_config(kind);
    c.handshake.fingerprint = tp_fingerprint(rank, size);
    c
}

/// One source, prefill rank `rank`.
pub fn sources(peer: PeerId) -> Vec<Source> {
    vec![Source {
        peer,
        required_destinations: 1,
    }]
}

/// As a raw prefill: what follows the status byte of a NIXL link setup
/// answer for `pool` (registered with this process's agent while the
/// returned keeper lives).
#[cfg(feature = "nixl")]
pub fn nixl_setup_reply(pool: &handoff_kv::KvPool) -> (Vec<u8>, Box<dyn std::any::Any + Send>) {
    let region = pool.shared_region().expect("a shared pool").clone();
    let gens = pool.generations().expect("a shared pool").clone();
    let offer = crate::link::offer_nixl_for_tests(&region, gens).expect("nixl offer");
    (offer.reply(), Box::new(offer))
}
