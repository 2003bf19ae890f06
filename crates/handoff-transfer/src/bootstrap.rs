//! Bootstrap (DESIGN.md §3, FIELD-NOTES "How SGLang does it"): the prefill
//! side publishes where each of its ranks listens; a decode worker asks once
//! and connects to every rank. One line-based TCP exchange:
//! `GET\n` is answered with `<rank> <addr>\n` lines and a blank line.
//! Decode retries with backoff, so a decode that starts first waits for
//! prefill instead of failing (sglang PR #25125).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_proto::RankId;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::conn::TaskCounter;
use crate::error::TransportError;

/// The prefill side's table of rank → control address, served over TCP.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    ranks: Arc<Mutex<BTreeMap<RankId, SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
    tasks: TaskCounter,
}

impl BootstrapServer {
    /// Listen on `addr` (port 0: any).
    pub async fn start(addr: SocketAddr) -> Result<Self, TransportError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(TransportError::io("bootstrap bind"))?;
        let addr = listener
            .local_addr()
            .map_err(TransportError::io("bootstrap bind"))?;
        let ranks: Arc<Mutex<BTreeMap<RankId, SocketAddr>>> = Arc::default();
        let tasks = TaskCounter::default();
        let table = ranks.clone();
        let per_conn = tasks.clone();
        let task = tasks.spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    continue;
                };
                let lines: String = {
                    let t = table.lock().unwrap_or_else(|e| e.into_inner());
                    t.iter().map(|(r, a)| format!("{} {a}\n", r.0)).collect()
                };
                per_conn.spawn(async move {
                    let mut req = [0u8; 4];
                    let ok = tokio::time::timeout(Duration::from_secs(2), async {
                        tokio::io::AsyncReadExt::read_exact(&mut s, &mut req).await
                    })
                    .await;
                    if matches!(ok, Ok(Ok(_))) && &req == b"GET\n" {
                        let _ = s.write_all(format!("{lines}\n").as_bytes()).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            ranks,
            task,
            tasks,
        })
    }

    /// Where decode asks.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Publish prefill rank `rank` listening at `addr`.
    pub fn register(&self, rank: RankId, addr: SocketAddr) {
        self.ranks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rank, addr);
    }

    /// Stop serving.
    pub fn shutdown(&self) {
        self.task.abort();
    }

    /// Live tasks (zero after shutdown).
    pub fn live_tasks(&self) -> usize {
        self.tasks.live()
    }
}

/// Ask the bootstrap server at `addr` for every prefill rank, retrying with
/// backoff until `expected` ranks are listed or `deadline` passes.
pub async fn query(
    addr: SocketAddr,
    expected: usize,
    deadline: Duration,
) -> Result<BTreeMap<RankId, SocketAddr>, TransportError> {
    let end = tokio::time::Instant::now() + deadline;
    let mut backoff = Duration::from_millis(10);
    let mut last;
    loop {
        match query_once(addr).await {
            Ok(t) if t.len() >= expected => return Ok(t),
            Ok(t) => last = format!("{} of {expected} ranks registered", t.len()),
            Err(e) => last = e.to_string(),
        }
        if tokio::time::Instant::now() + backoff > end {
            return Err(TransportError::Bootstrap(format!("{addr}: {last}")));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

async fn query_once(addr: SocketAddr) -> Result<BTreeMap<RankId, SocketAddr>, TransportError> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(TransportError::io("bootstrap connect"))?;
    s.write_all(b"GET\n")
        .await
        .map_err(TransportError::io("bootstrap request"))?;
    let mut lines = BufReader::new(s).lines();
    let mut out = BTreeMap::new();
    while let Some(line) = lines
        .next_line()
        .await
        .map_err(TransportError::io("bootstrap answer"))?
    {
        if line.is_empty() {
            break;
        }
        let mut it = line.split(' ');
        let rank = it.next().and_then(|r| r.parse::<u32>().ok());
        let a = it.next().and_then(|a| a.parse::<SocketAddr>().ok());
        match (rank, a) {
            (Some(r), Some(a)) => {
                out.insert(RankId(r), a);
            }
            _ => return Err(TransportError::Bootstrap(format!("bad line {line:?}"))),
        }
        if out.len() > 4096 {
            return Err(TransportError::Bootstrap("too many ranks".into()));
        }
    }
    Ok(out)
}
