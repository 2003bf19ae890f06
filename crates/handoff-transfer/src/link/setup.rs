//! Opening a data link: decode connects ([`connect_link_stream`]),
//! prefill accepts ([`accept_link`]); both run the control handshake, then
//! agree on one transport and the link's plan.

use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, KvPool, PageGenerations, ShmRegion};
use handoff_proto::datalink::{
    encode_preface, TcpStreamSetup, PREFACE_DATA, SETUP_SHM, SETUP_SHM_PUSH, SETUP_TCP,
};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig};
use handoff_proto::PeerId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;

use super::error::SetupRefusal;
use super::source::{SourcePool, SHM_REPLY_LEN};
use crate::conn::handshake_exact;
use crate::error::TransportError;
use crate::plan::LinkPlan;
use crate::transport::{ShmTransport, TcpTransport, TransportKind};

async fn refuse_setup(stream: &mut TcpStream, msg: &str) {
    let mut out = vec![1u8];
    let b = msg.as_bytes();
    let n = b.len().min(1024);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&b[..n]);
    let _ = stream.write_all(&out).await;
}

/// `read_exact` bounded by `timeout`: a peer that stalls in the middle of
/// link setup cannot hold the task forever.
async fn read_setup(
    s: &mut TcpStream,
    buf: &mut [u8],
    timeout: Duration,
    what: &'static str,
) -> Result<(), TransportError> {
    match tokio::time::timeout(timeout, s.read_exact(buf)).await {
        Ok(r) => r.map(|_| ()).map_err(TransportError::io(what)),
        Err(_) => Err(TransportError::PeerMisbehaved(format!(
            "{what}: no answer within {timeout:?}"
        ))),
    }
}

/// Decode side: open a data link of one stream to `addr` for `kind`, for
/// our pool of `num_pages` pages, as decode endpoint
/// `endpoint`, for its connect number `connect` ([`handoff_proto::datalink::CONNECT_SEQ_LEN`]).
/// Returns the socket and the prefill's fingerprint (its TP rank and size).
#[allow(clippy::too_many_arguments)]
pub async fn connect_link(
    addr: std::net::SocketAddr,
    endpoint: u64,
    connect: u64,
    config: HandshakeConfig,
    timeout: Duration,
    kind: TransportKind,
    num_pages: usize,
) -> Result<(TcpStream, Fingerprint), TransportError> {
    let one = TcpStreamSetup {
        nonce: rand::random(),
        index: 0,
        count: 1,
    };
    connect_link_stream(
        addr, endpoint, connect, config, timeout, kind, num_pages, one,
    )
    .await
    .map(|l| (l.stream, l.fingerprint))
}

/// A data link stream decode opened.
pub struct LinkStream {
    /// The socket.
    pub stream: TcpStream,
    /// The prefill's fingerprint (its TP rank and size).
    pub fingerprint: Fingerprint,
    /// Over shm, the prefill's pool, mapped read-only, that this link
    /// pulls from.
    pub source: Option<Arc<SourcePool>>,
}

/// [`connect_link`] for stream `stream.index` of a TCP link of
/// `stream.count` streams (`stream` is ignored for shm).
#[allow(clippy::too_many_arguments)]
pub async fn connect_link_stream(
    addr: std::net::SocketAddr,
    endpoint: u64,
    connect: u64,
    config: HandshakeConfig,
    timeout: Duration,
    kind: TransportKind,
    num_pages: usize,
    stream: TcpStreamSetup,
) -> Result<LinkStream, TransportError> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(TransportError::io("data link connect"))?;
    let _ = s.set_nodelay(true);
    s.write_all(&encode_preface(PREFACE_DATA, endpoint, connect))
        .await
        .map_err(TransportError::io("data link preface"))?;
    let n = handshake_exact(&mut s, config, timeout).await?;
    let mut setup = Vec::new();
    match kind {
        TransportKind::Shm => {
            setup.push(SETUP_SHM);
            setup.extend_from_slice(&(num_pages as u64).to_le_bytes());
        }
        TransportKind::Tcp => {
            setup.push(SETUP_TCP);
            setup.extend_from_slice(&(num_pages as u64).to_le_bytes());
            setup.extend_from_slice(&stream.encode());
        }
    }
    s.write_all(&setup)
        .await
        .map_err(TransportError::io("data link setup"))?;
    let mut status = [0u8; 1];
    read_setup(&mut s, &mut status, timeout, "data link setup reply").await?;
    if status[0] != 0 {
        let mut len = [0u8; 2];
        read_setup(&mut s, &mut len, timeout, "data link setup reply").await?;
        let mut msg = vec![0u8; u16::from_le_bytes(len) as usize];
        read_setup(&mut s, &mut msg, timeout, "data link setup reply").await?;
        return Err(TransportError::PeerMisbehaved(format!(
            "prefill refused the {} link: {}",
            kind.name(),
            String::from_utf8_lossy(&msg)
        )));
    }
    let source = match kind {
        TransportKind::Shm => {
            let mut reply = [0u8; SHM_REPLY_LEN];
            read_setup(&mut s, &mut reply, timeout, "data link setup reply").await?;
            Some(Arc::new(SourcePool::open(&reply)?))
        }
        TransportKind::Tcp => None,
    };
    Ok(LinkStream {
        stream: s,
        fingerprint: n.peer_fingerprint,
        source,
    })
}

/// A link accepted on the prefill side, ready to run.
pub struct AcceptedLink {
    /// The decode peer.
    pub peer: PeerId,
    /// Pages in the decode pool (every destination page is checked against it).
    pub dest_pages: usize,
    /// Transport kind.
    pub kind: TransportKind,
    /// Which stream of its link this is (one stream of one for shm).
    pub stream: TcpStreamSetup,
    /// What this link moves (whole spans, or head slices when TP differs).
    pub plan: LinkPlan,
    pub(super) writer: PendingWriter,
    pub(super) acks: OwnedReadHalf,
}

pub(super) enum LinkWriter {
    Shm(ShmTransport),
    Tcp(TcpTransport),
}

/// A link whose setup succeeded but was not yet confirmed to decode: the
/// success reply goes out only once the driver registered the link
/// ([`AcceptedLink::spawn`]), so a destination decode sends after its
/// `connect` returned can never reach the driver before its link.
pub(super) struct PendingWriter {
    src: Arc<ShmRegion>,
    /// Over shm, our pool's page generations (their table's place goes to
    /// decode with the pool's handle).
    shm: Option<PageGenerations>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

impl PendingWriter {
    /// Send decode the setup success and build the transport.
    pub(super) async fn confirm(mut self) -> Result<LinkWriter, TransportError> {
        // Over shm, decode learns which pool to map (read-only) and where
        // its page generations are.
        let mut ok = vec![0u8];
        if let Some(g) = &self.shm {
            ok.extend_from_slice(&self.src.handle().to_bytes());
            ok.extend_from_slice(&(g.pages() as u64).to_le_bytes());
            ok.extend_from_slice(&(g.offset() as u64).to_le_bytes());
        }
        self.w
            .write_all(&ok)
            .await
            .map_err(TransportError::io("data link setup reply"))?;
        Ok(match self.shm {
            Some(gens) => LinkWriter::Shm(ShmTransport::new(gens, self.w)),
            None => LinkWriter::Tcp(TcpTransport::new(self.src, self.w)),
        })
    }
}

/// Prefill side: finish accepting a data link from the decode endpoint known
/// here as `peer` (preface already read).
pub async fn accept_link(
    mut s: TcpStream,
    peer: PeerId,
    config: HandshakeConfig,
    timeout: Duration,
    src: Arc<ShmRegion>,
    layout: &KvLayout,
) -> Result<AcceptedLink, TransportError> {
    let _ = s.set_nodelay(true);
    let ours = config.fingerprint.clone();
    let n = handshake_exact(&mut s, config, timeout).await?;
    let plan = LinkPlan::new(&ours, &n.peer_fingerprint, true, layout.geometry.kv_heads);
    let mut kind = [0u8; 1];
    let read = tokio::time::timeout(timeout, s.read_exact(&mut kind)).await;
    if !matches!(read, Ok(Ok(_))) {
        return Err(TransportError::PeerMisbehaved("no link setup".into()));
    }
    let mut stream = TcpStreamSetup {
        nonce: 0,
        index: 0,
        count: 1,
    };
    let setup: Result<(TransportKind, usize, Option<PageGenerations>), SetupRefusal> =
        match (&plan, kind[0]) {
            (Err(e), _) => Err(e.clone().into()),
            (Ok(_), SETUP_SHM) => {
                let mut b = [0u8; 8];
                read_setup(&mut s, &mut b, timeout, "shm link setup").await?;
                let pages = u64::from_le_bytes(b);
                if pages == 0 || pages > u64::from(u32::MAX) {
                    Err(SetupRefusal::Pages(pages))
                } else {
                    // Decode maps our pool read-only and pulls from it.
                    let gens_at = KvPool::generations_offset(layout);
                    PageGenerations::new(src.clone(), gens_at, layout.num_pages)
                        .map(|g| (TransportKind::Shm, pages as usize, Some(g)))
                        .map_err(SetupRefusal::from)
                }
            }
            (Ok(_), SETUP_SHM_PUSH) => Err(SetupRefusal::ShmPush),
            (Ok(_), SETUP_TCP) => {
                let mut b = [0u8; 8];
                read_setup(&mut s, &mut b, timeout, "tcp link setup").await?;
                let pages = u64::from_le_bytes(b);
                let mut sb = [0u8; TcpStreamSetup::LEN];
                read_setup(&mut s, &mut sb, timeout, "tcp link setup").await?;
                match TcpStreamSetup::decode(&sb) {
                    Err(e) => Err(e.into()),
                    Ok(_) if pages == 0 || pages > u64::from(u32::MAX) => {
                        Err(SetupRefusal::Pages(pages))
                    }
                    Ok(st) => {
                        stream = st;
                        Ok((TransportKind::Tcp, pages as usize, None))
                    }
                }
            }
            (Ok(_), other) => Err(SetupRefusal::UnknownTransport(other)),
        };
    // A refusal is answered now; success only once the link is registered.
    if let Err(why) = &setup {
        refuse_setup(&mut s, &why.to_string()).await;
    }
    let (kind, dest_pages, shm) = setup?;
    let plan = plan.map_err(SetupRefusal::from)?;
    let (r, w) = s.into_split();
    Ok(AcceptedLink {
        peer,
        dest_pages,
        kind,
        stream,
        plan,
        writer: PendingWriter { src, shm, w },
        acks: r,
    })
}
