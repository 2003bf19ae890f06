//! The requests in flight on this worker by request id, for
//! `/abort_request` (SGLang's route, `abort_api.rs`), so that an operator,
//! a client or a router can end one it no longer wants. A [`Generation`](crate::worker::generation::Generation) holds an
//! [`AbortWatch`] for its id; the watch leaves the registry when it drops,
//! so the registry holds exactly the requests in flight.
//!
//! Aborting ends the generation with a 499 `aborted` error (an SSE error
//! event once a stream started) and drops the engine's stream, which cancels
//! the request there: in PD the decode side aborts its room and frees its
//! pages, and the prefill side's ticket drop aborts its room too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::http::errors::ApiError;

/// Longest request id accepted (bytes).
pub const MAX_RID_BYTES: usize = 256;

/// Check a request id a client chose.
pub fn check_rid(rid: &str, field: &str) -> Result<(), ApiError> {
    if rid.is_empty() || rid.len() > MAX_RID_BYTES {
        return Err(ApiError::invalid_param(
            field,
            format!(
                "{field} must be 1 to {MAX_RID_BYTES} bytes, got {}",
                rid.len()
            ),
        ));
    }
    Ok(())
}

type Entries = HashMap<String, Vec<(u64, watch::Sender<bool>)>>;

/// The requests in flight, by id (two requests may share an id: an abort
/// ends both).
#[derive(Debug, Default)]
pub struct Aborts {
    entries: Mutex<Entries>,
    next: AtomicU64,
}

impl Aborts {
    /// Register a request under `rid`; the watch fires when it is aborted.
    pub fn register(self: &Arc<Self>, rid: &str) -> AbortWatch {
        let (tx, rx) = watch::channel(false);
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut e) = self.entries.lock() {
            e.entry(rid.to_string()).or_default().push((key, tx));
        }
        AbortWatch {
            registry: Arc::clone(self),
            rid: rid.to_string(),
            key,
            rx,
        }
    }

    /// Abort every request registered under `rid`; how many there were.
    pub fn abort(&self, rid: &str) -> usize {
        let Ok(e) = self.entries.lock() else {
            return 0;
        };
        e.get(rid).map_or(0, |senders| {
            senders.iter().for_each(|(_, tx)| {
                tx.send_replace(true);
            });
            senders.len()
        })
    }

    /// Abort every request in flight; how many there were.
    pub fn abort_all(&self) -> usize {
        let Ok(e) = self.entries.lock() else {
            return 0;
        };
        let mut n = 0;
        for (_, tx) in e.values().flatten() {
            tx.send_replace(true);
            n += 1;
        }
        n
    }

    /// Requests registered now.
    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .map(|e| e.values().map(Vec::len).sum())
            .unwrap_or(0)
    }

    /// No request is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One request's place in [`Aborts`]; leaves it on drop.
#[derive(Debug)]
pub struct AbortWatch {
    registry: Arc<Aborts>,
    rid: String,
    key: u64,
    rx: watch::Receiver<bool>,
}

impl AbortWatch {
    /// The request id.
    pub fn rid(&self) -> &str {
        &self.rid
    }

    /// Resolves once the request is aborted (never, if it is not).
    pub async fn aborted(&mut self) {
        if self.rx.wait_for(|a| *a).await.is_err() {
            // The sender left the registry: this request cannot be aborted
            // any more.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for AbortWatch {
    fn drop(&mut self) {
        if let Ok(mut e) = self.registry.entries.lock() {
            if let Some(v) = e.get_mut(&self.rid) {
                v.retain(|(k, _)| *k != self.key);
                if v.is_empty() {
                    e.remove(&self.rid);
                }
            }
        }
    }
}

/// The error a generation ends with once aborted.
pub fn aborted_error(rid: &str) -> ApiError {
    ApiError::new(
        499,
        "aborted",
        format!("request {rid} was aborted by /abort_request"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_abort_reaches_every_request_of_its_id_and_no_other() {
        let reg = Arc::new(Aborts::default());
        let mut a1 = reg.register("a");
        let mut a2 = reg.register("a");
        let mut b = reg.register("b");
        assert_eq!(reg.len(), 3);
        assert_eq!(reg.abort("a"), 2);
        assert_eq!(reg.abort("nobody"), 0);
        tokio::time::timeout(std::time::Duration::from_secs(1), a1.aborted())
            .await
            .expect("a1 aborted");
        tokio::time::timeout(std::time::Duration::from_secs(1), a2.aborted())
            .await
            .expect("a2 aborted");
        let quiet = tokio::time::timeout(std::time::Duration::from_millis(50), b.aborted()).await;
        assert!(quiet.is_err(), "b was not aborted");
        drop((a1, a2));
        assert_eq!(reg.len(), 1, "dropped watches leave the registry");
        assert_eq!(reg.abort_all(), 1);
        drop(b);
        assert!(reg.is_empty());
    }

    #[test]
    fn request_ids_have_a_length_limit() {
        assert!(check_rid("r-1", "rid").is_ok());
        let e = check_rid("", "rid").unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("rid")));
        assert!(check_rid(&"x".repeat(MAX_RID_BYTES + 1), "rid").is_err());
    }
}
