//! A worker's registration: the record it puts under
//! `PREFIX/workers/ROLE/ID` with a lease, and the task that keeps the lease
//! alive, puts the record again when the lease was lost (etcd restarted or
//! was unreachable past the TTL), and revokes it on a clean shutdown so
//! routers stop sending at once.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::etcd::{Etcd, EtcdEndpoint};

/// What a worker tells the deployment about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// `prefill` or `decode`.
    pub role: String,
    /// Its HTTP base URL as routers reach it.
    pub url: String,
    /// Prefill: the port of its KV transfer endpoint (on the URL's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Model name.
    pub model: String,
    /// Hex of the weights' hash and formats (the transfer handshake's).
    pub model_hash: String,
    /// KV geometry and dtype: `layers/kv_heads/head_dim/page_size/dtype`.
    pub kv: String,
    /// Transfer protocol versions it speaks, lowest and highest.
    pub protocol: [u8; 2],
    /// HMAC-SHA256 of the fields above under the transfer secret
    /// ([`Self::sign`]): a router with the secret takes only records that
    /// verify, so whoever can write to etcd cannot register an impostor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

/// The namespace of record signatures.
const RECORD_DOMAIN: &str = "handoff-worker-record-v1";

impl WorkerRecord {
    fn signed_parts(&self) -> [Vec<u8>; 7] {
        [
            self.role.clone().into_bytes(),
            self.url.clone().into_bytes(),
            self.bootstrap_port
                .map(|p| p.to_string())
                .unwrap_or_default()
                .into_bytes(),
            self.model.clone().into_bytes(),
            self.model_hash.clone().into_bytes(),
            self.kv.clone().into_bytes(),
            self.protocol.to_vec(),
        ]
    }

    /// Sign the record with the transfer secret.
    pub fn sign(&mut self, secret: &[u8]) {
        let parts = self.signed_parts();
        let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        self.sig = Some(handoff_proto::bootstrap_auth::sign_message(
            secret,
            RECORD_DOMAIN,
            &parts,
        ));
    }

    /// Check the record's signature under the transfer secret; the error
    /// says why it is refused.
    pub fn verify(&self, secret: &[u8]) -> Result<(), String> {
        let Some(sig) = &self.sig else {
            return Err(
                "unsigned record: this router has a transfer secret and takes only records signed with it (give the worker the same --transfer-secret-file)".into(),
            );
        };
        let parts = self.signed_parts();
        let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        handoff_proto::bootstrap_auth::verify_message(secret, RECORD_DOMAIN, &parts, sig)
            .map_err(|e| format!("record signature refused: {e}"))
    }

    /// What must match between a router's workers for them to pair: model,
    /// weights and KV layout (URLs, ports and versions may differ).
    pub fn fingerprint(&self) -> String {
        format!("{} {} {}", self.model, self.model_hash, self.kv)
    }
}

/// Keeps one worker's record registered until told to stop.
#[derive(Debug)]
pub struct Registrar {
    etcd: Etcd,
    key: String,
    value: Vec<u8>,
    ttl: Duration,
}

impl Registrar {
    /// A registrar for `record` at `endpoint` with leases of `ttl`.
    pub fn new(
        endpoint: &EtcdEndpoint,
        record: &WorkerRecord,
        ttl: Duration,
    ) -> Result<Self, super::EtcdError> {
        let id: u64 = rand::random();
        Ok(Registrar {
            etcd: Etcd::new(&endpoint.base, Duration::from_secs(2))?,
            key: format!("{}/workers/{}/{id:016x}", endpoint.prefix, record.role),
            value: serde_json::to_vec(record).unwrap_or_default(),
            ttl: ttl.max(Duration::from_secs(1)),
        })
    }

    /// Its key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Register once: a new lease and the record under it.
    async fn register(&self) -> Result<i64, super::EtcdError> {
        let lease = self.etcd.grant(self.ttl).await?;
        self.etcd.put(&self.key, &self.value, Some(lease)).await?;
        Ok(lease)
    }

    /// Register now (an error if etcd cannot be reached: a worker told to
    /// register that cannot should say so at start), then keep the lease
    /// alive every third of its TTL until `stop` resolves; registers again
    /// whenever the lease is lost; revokes it at the end.
    pub async fn run(self, first: i64, stop: impl std::future::Future<Output = ()>) {
        let mut lease = Some(first);
        let beat = self.ttl / 3;
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(beat) => {}
            }
            lease = match lease {
                Some(id) => match self.etcd.keep_alive(id).await {
                    Ok(true) => Some(id),
                    Ok(false) => {
                        tracing::warn!(key = %self.key, "discovery lease lost: registering again");
                        self.register().await.ok()
                    }
                    Err(e) => {
                        tracing::warn!(key = %self.key, error = %e, "discovery: etcd unreachable, keeping the lease when it returns");
                        Some(id)
                    }
                },
                None => match self.register().await {
                    Ok(id) => {
                        tracing::info!(key = %self.key, "registered again in discovery");
                        Some(id)
                    }
                    Err(_) => None,
                },
            };
        }
        if let Some(id) = lease {
            match self.etcd.revoke(id).await {
                Ok(()) => tracing::info!(key = %self.key, "deregistered from discovery"),
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "discovery: could not revoke the lease (it expires within its TTL)")
                }
            }
        }
    }

    /// The first registration, before serving.
    pub async fn start(&self) -> Result<i64, super::EtcdError> {
        self.register().await
    }
}
