//! The router's side of discovery (issue 15): workers registered under
//! `PREFIX/workers/` in etcd join the router's worker set, and leave it the
//! moment their key goes (a clean shutdown revokes it; a dead worker's
//! lease expires within its TTL). The task ranges the prefix, then watches
//! it from the next revision; when etcd cannot be reached it keeps serving
//! with the last known workers, says once that discovery is stale, and
//! ranges again when etcd is back (what changed meanwhile is applied then).
//!
//! Every worker of a deployment must serve the same model with the same KV
//! layout: the router takes the fingerprint of the first worker it accepts
//! (`WorkerRecord::fingerprint`) and refuses any registration with another,
//! logging why and listing it in `/workers`. A router with a transfer
//! secret takes only records signed with it (`WorkerRecord::verify`); one
//! without says at start that anyone who can write under the prefix can
//! register a worker.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::json;

use crate::discovery::{Etcd, EtcdEndpoint, WatchEvent, WorkerRecord};
use crate::router::RouterState;
use handoff_proto::Role;

/// What discovery added, per key.
struct Discovered {
    state: RouterState,
    known: HashMap<String, (Role, String)>,
    fingerprint: Option<String>,
}

impl Discovered {
    fn put(&mut self, key: &str, value: &[u8]) {
        let refuse = |state: &RouterState, reason: String, record: Option<&WorkerRecord>| {
            tracing::warn!(key, %reason, "discovery refused a worker");
            state.workers.refuse(json!({
                "key": key,
                "url": record.map(|r| r.url.clone()),
                "role": record.map(|r| r.role.clone()),
                "health": "refused",
                "reason": reason,
            }));
        };
        let record: WorkerRecord = match serde_json::from_slice(value) {
            Ok(r) => r,
            Err(e) => return refuse(&self.state, format!("not a worker record: {e}"), None),
        };
        // With a transfer secret, only records signed with it: whoever can
        // write to etcd cannot point this router (and its API key) at a
        // server of their own.
        if let Some(secret) = &self.state.config.transfer_secret {
            if let Err(reason) = record.verify(secret.as_bytes()) {
                return refuse(&self.state, reason, Some(&record));
            }
        }
        let role = match record.role.as_str() {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            other => {
                return refuse(
                    &self.state,
                    format!("unknown role {other:?}"),
                    Some(&record),
                )
            }
        };
        let fp = record.fingerprint();
        match &self.fingerprint {
            Some(want) if *want != fp => {
                return refuse(
                    &self.state,
                    format!("model {fp} differs from the deployment's {want}"),
                    Some(&record),
                )
            }
            Some(_) => {}
            None => self.fingerprint = Some(fp),
        }
        if let Some((r, url)) = self.known.get(key) {
            if *url == record.url && *r == role {
                return;
            }
            self.state.workers.remove(url, *r);
        }
        let port = record.bootstrap_port.unwrap_or(0);
        match self
            .state
            .workers
            .add(&record.url, role, port, &self.state.metrics)
        {
            Ok(added) => {
                if added {
                    tracing::info!(url = %record.url, role = role.name(), "worker joined through discovery");
                }
                self.known.insert(key.to_string(), (role, record.url));
            }
            Err(e) => refuse(&self.state, e.to_string(), Some(&record)),
        }
    }

    fn delete(&mut self, key: &str) {
        self.state.workers.forget_refused(key);
        if let Some((role, url)) = self.known.remove(key) {
            if self.state.workers.remove(&url, role) {
                tracing::info!(%url, role = role.name(), "worker left (deregistered, or its lease expired)");
            }
        }
    }

    fn on_event(&mut self, e: WatchEvent) {
        match e {
            WatchEvent::Put { key, value } => self.put(&key, &value),
            WatchEvent::Delete { key } => self.delete(&key),
        }
    }
}

/// How often the router checks that etcd still answers while it watches.
const ALIVE_EVERY: Duration = Duration::from_secs(2);

/// Keep the router's worker set in step with `endpoint` until the task is
/// dropped.
pub async fn run(state: RouterState, endpoint: EtcdEndpoint) {
    let prefix = format!("{}/workers/", endpoint.prefix);
    let etcd = match Etcd::new(&endpoint.base, Duration::from_secs(2)) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = %e, "discovery cannot start");
            return;
        }
    };
    if state.config.transfer_secret.is_none() {
        tracing::warn!(
            "discovery without a transfer secret: records are not authenticated, so anyone who can write under {prefix} can register a worker this router will send requests (and its API key) to"
        );
    }
    let mut d = Discovered {
        state,
        known: HashMap::new(),
        fingerprint: None,
    };
    let mut stale = false;
    loop {
        match etcd.range_prefix(&prefix).await {
            Ok((revision, kvs)) => {
                if stale {
                    tracing::info!("discovery caught up with etcd");
                    stale = false;
                }
                let present: HashSet<&str> = kvs.iter().map(|(k, _)| k.as_str()).collect();
                let gone: Vec<String> = d
                    .known
                    .keys()
                    .filter(|k| !present.contains(k.as_str()))
                    .cloned()
                    .collect();
                for k in gone {
                    d.delete(&k);
                }
                for (k, v) in &kvs {
                    d.put(k, v);
                }
                // A frozen etcd keeps the watch open and silent: a status
                // call beside it notices (then the loop ranges again until
                // etcd answers, and catches up).
                let watch = etcd.watch_prefix(&prefix, revision + 1, |e| d.on_event(e));
                let alive = async {
                    loop {
                        tokio::time::sleep(ALIVE_EVERY).await;
                        if let Err(e) = etcd.status().await {
                            return e;
                        }
                    }
                };
                tokio::select! {
                    r = watch => if let Err(e) = r {
                        tracing::warn!(error = %e, "discovery watch broke: serving with the last known workers");
                        stale = true;
                    },
                    e = alive => {
                        tracing::warn!(error = %e, "discovery is stale: etcd does not answer; serving with the last known workers");
                        stale = true;
                    }
                }
            }
            Err(e) => {
                if !stale {
                    tracing::warn!(error = %e, "discovery is stale: etcd is unreachable; serving with the last known workers");
                    stale = true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
