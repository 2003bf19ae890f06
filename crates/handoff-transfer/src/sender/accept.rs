//! Prefill's accept loop: control connections and data links from decode
//! peers, each told apart by its preface.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use handoff_kv::{KvLayout, ShmRegion};
use handoff_proto::datalink::{decode_preface, PREFACE_CONTROL, PREFACE_DATA, PREFACE_LEN};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use super::commands::{Cmd, Ev};
use super::config::SenderConfig;
use crate::conn::{run_control, CtlEvent, TaskCounter};
use crate::link::{accept_link, LinkCounters};

pub(super) async fn accept_loop(
    listener: TcpListener,
    config: SenderConfig,
    pool: Arc<ShmRegion>,
    layout: KvLayout,
    tx: mpsc::WeakUnboundedSender<Ev>,
    tasks: TaskCounter,
    counters: Arc<LinkCounters>,
) {
    let mut conn_id = 0u64;
    loop {
        let Ok((mut stream, _addr)) = listener.accept().await else {
            continue;
        };
        let Some(tx) = tx.upgrade() else { return };
        conn_id += 1;
        let id = conn_id;
        let config = config.clone();
        let pool = pool.clone();
        let counters = counters.clone();
        let t2 = tasks.clone();
        tasks.spawn(async move {
            let mut preface = [0u8; PREFACE_LEN];
            let got =
                tokio::time::timeout(config.handshake_timeout, stream.read_exact(&mut preface))
                    .await;
            if !matches!(got, Ok(Ok(_))) {
                counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let (kind, endpoint_id, connect) = decode_preface(&preface);
            // The endpoint owns peer identity: ask it (the driver is gone
            // when it does not answer, and so is this connection).
            let (reply, id_rx) = oneshot::channel();
            if tx.send(Ev::Cmd(Cmd::PeerId(endpoint_id, reply))).is_err() {
                return;
            }
            let Ok(peer) = id_rx.await else { return };
            match kind {
                PREFACE_CONTROL => {
                    let send = move |e: CtlEvent| tx.send(Ev::Ctl(e, connect)).map_err(|_| ());
                    run_control(
                        stream,
                        config.handshake.clone(),
                        config.handshake_timeout,
                        id,
                        peer,
                        t2,
                        send,
                    )
                    .await;
                }
                PREFACE_DATA => {
                    match accept_link(
                        stream,
                        peer,
                        config.handshake.clone(),
                        config.handshake_timeout,
                        pool,
                        &layout,
                    )
                    .await
                    {
                        Ok(link) => {
                            let _ = tx.send(Ev::Accepted(Box::new(link), endpoint_id, connect));
                        }
                        Err(e) => {
                            counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "data link refused");
                        }
                    }
                }
                _ => {
                    counters.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
}
