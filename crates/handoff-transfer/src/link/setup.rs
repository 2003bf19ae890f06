//! Opening a data link: decode connects ([`connect_link_stream`]),
//! prefill accepts ([`accept_link`]); both run the control handshake, then
//! agree on one transport and the link's plan.

use std::sync::Arc;
use std::time::Duration;

use handoff_kv::{KvLayout, KvPool, PageGenerations, ShmRegion};
use handoff_proto::datalink::{
    encode_preface, TcpStreamSetup, PREFACE_DATA, SETUP_NIXL, SETUP_SHM, SETUP_SHM_PUSH, SETUP_TCP,
};
use handoff_proto::handshake::{Fingerprint, HandshakeConfig};
use handoff_proto::PeerId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;

use super::error::SetupRefusal;
use super::source::{PullSource, SourcePool, SHM_REPLY_LEN};
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
/// A NIXL link READs into `local` (our pool). Returns the socket and the
/// prefill's fingerprint (its TP rank and size).
#[allow(clippy::too_many_arguments)]
pub async fn connect_link(
    addr: std::net::SocketAddr,
    endpoint: u64,
    connect: u64,
    config: HandshakeConfig,
    timeout: Duration,
    kind: TransportKind,
    num_pages: usize,
    local: Option<&Arc<ShmRegion>>,
) -> Result<(TcpStream, Fingerprint), TransportError> {
    let one = TcpStreamSetup {
        nonce: rand::random(),
        index: 0,
        count: 1,
    };
    connect_link_stream(
        addr, endpoint, connect, config, timeout, kind, num_pages, one, local,
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
    /// Over shm or NIXL, the prefill's pool this link pulls from.
    pub source: Option<PullSource>,
}

/// [`connect_link`] for stream `stream.index` of a TCP link of
/// `stream.count` streams (`stream` is ignored for shm and NIXL). A NIXL
/// link READs into `local`, our pool (registered here).
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
    local: Option<&Arc<ShmRegion>>,
) -> Result<LinkStream, TransportError> {
    // A build or process that cannot do NIXL says so before connecting.
    crate::check_transport(kind)?;
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
        TransportKind::Nixl => {
            setup.push(SETUP_NIXL);
            setup.extend_from_slice(&(num_pages as u64).to_le_bytes());
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
            Some(PullSource::Mapped(Arc::new(SourcePool::open(&reply)?)))
        }
        TransportKind::Tcp => None,
        TransportKind::Nixl => Some(nixl_source(&mut s, timeout, local).await?),
    };
    Ok(LinkStream {
        stream: s,
        fingerprint: n.peer_fingerprint,
        source,
    })
}

/// Read prefill's answer to a NIXL setup and load its agent.
#[cfg(feature = "nixl")]
async fn nixl_source(
    s: &mut TcpStream,
    timeout: Duration,
    local: Option<&Arc<ShmRegion>>,
) -> Result<PullSource, TransportError> {
    use handoff_proto::datalink::NixlSetupHead;
    let local = local
        .ok_or_else(|| TransportError::Nixl("a NIXL link needs the pool it READs into".into()))?;
    let mut h = [0u8; NixlSetupHead::LEN];
    read_setup(s, &mut h, timeout, "nixl link setup reply").await?;
    let head =
        NixlSetupHead::decode(&h).map_err(|e| TransportError::PeerMisbehaved(e.to_string()))?;
    let mut name = vec![0u8; usize::from(head.name_len)];
    read_setup(s, &mut name, timeout, "nixl link setup reply").await?;
    let mut md = vec![0u8; head.metadata_len as usize];
    read_setup(s, &mut md, timeout, "nixl link setup reply").await?;
    let name = String::from_utf8(name).map_err(|_| {
        TransportError::PeerMisbehaved("nixl link setup: an agent name that is not UTF-8".into())
    })?;
    let src = crate::nixl::NixlSource::open(&head, &name, &md, local)?;
    Ok(PullSource::Nixl(Arc::new(src)))
}

#[cfg(not(feature = "nixl"))]
async fn nixl_source(
    _: &mut TcpStream,
    _: Duration,
    _: Option<&Arc<ShmRegion>>,
) -> Result<PullSource, TransportError> {
    Err(TransportError::Nixl(crate::NO_NIXL.into()))
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
    /// Pull announcements as over shm, and the registration decode READs.
    Nixl(ShmTransport, NixlOffer),
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
    /// Over NIXL, the same, our pool's registration (kept while the link
    /// lives) and the agent metadata decode loads.
    nixl: Option<NixlOffer>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

/// What a NIXL link's prefill offers decode.
pub(crate) struct NixlOffer {
    gens: PageGenerations,
    head: handoff_proto::datalink::NixlSetupHead,
    /// Our agent's name, then its metadata.
    name_and_metadata: Vec<u8>,
    #[cfg(feature = "nixl")]
    _registration: Arc<crate::nixl::Registration>,
}

/// Register our pool with the process's agent and describe it for decode.
#[cfg(feature = "nixl")]
pub(crate) fn offer_nixl(
    src: &Arc<ShmRegion>,
    gens: PageGenerations,
) -> Result<NixlOffer, TransportError> {
    let n = crate::nixl::nixl()?;
    let registration = n.register(src)?;
    let metadata = n.local_metadata()?;
    let head = handoff_proto::datalink::NixlSetupHead {
        base: src.addr() as u64,
        len: src.len() as u64,
        pages: gens.pages() as u64,
        generations_at: gens.offset() as u64,
        metadata_len: u32::try_from(metadata.len()).unwrap_or(u32::MAX),
        name_len: n.name().len() as u16,
    };
    let mut name_and_metadata = n.name().as_bytes().to_vec();
    name_and_metadata.extend_from_slice(&metadata);
    Ok(NixlOffer {
        gens,
        head,
        name_and_metadata,
        _registration: registration,
    })
}

impl NixlOffer {
    /// The setup answer after the status byte: head, name, metadata.
    pub(crate) fn reply(&self) -> Vec<u8> {
        let mut b = self.head.encode().to_vec();
        b.extend_from_slice(&self.name_and_metadata);
        b
    }
}

#[cfg(not(feature = "nixl"))]
fn offer_nixl(_: &Arc<ShmRegion>, _: PageGenerations) -> Result<NixlOffer, TransportError> {
    Err(TransportError::Nixl(crate::NO_NIXL.into()))
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
        if let Some(n) = &self.nixl {
            ok.extend_from_slice(&n.reply());
        }
        self.w
            .write_all(&ok)
            .await
            .map_err(TransportError::io("data link setup reply"))?;
        Ok(match (self.shm, self.nixl) {
            (Some(gens), _) => LinkWriter::Shm(ShmTransport::new(gens, self.w)),
            (None, Some(n)) => LinkWriter::Nixl(ShmTransport::nixl(n.gens.clone(), self.w), n),
            (None, None) => LinkWriter::Tcp(TcpTransport::new(self.src, self.w)),
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
    let mut nixl = None;
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
            (Ok(_), SETUP_NIXL) => {
                let mut b = [0u8; 8];
                read_setup(&mut s, &mut b, timeout, "nixl link setup").await?;
                let pages = u64::from_le_bytes(b);
                let gens_at = KvPool::generations_offset(layout);
                if pages == 0 || pages > u64::from(u32::MAX) {
                    Err(SetupRefusal::Pages(pages))
                } else {
                    // Decode READs our registered pool, as it maps it over shm.
                    PageGenerations::new(src.clone(), gens_at, layout.num_pages)
                        .map_err(SetupRefusal::from)
                        .and_then(|g| {
                            offer_nixl(&src, g).map_err(|e| SetupRefusal::Nixl(e.to_string()))
                        })
                        .map(|offer| {
                            nixl = Some(offer);
                            (TransportKind::Nixl, pages as usize, None)
                        })
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
        writer: PendingWriter { src, shm, nixl, w },
        acks: r,
    })
}
