//! A small client of etcd's v3 API through its JSON gateway (`/v3/...` on
//! the client port, served by every etcd since 3.3; the server this project
//! tests against is Debian's `etcd-server` 3.4): leases, puts, prefix
//! ranges and prefix watches. The gateway is etcd's own HTTP mapping of its
//! gRPC API, so no protobuf compiler is needed to build handoff. Keys and
//! values travel base64-encoded; 64-bit numbers as decimal strings.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The endpoint is not `etcd://HOST:PORT[/PREFIX]`.
    #[error("discovery endpoint {0:?}: expected etcd://HOST:PORT[/PREFIX]")]
    Endpoint(String),
    /// etcd could not be reached or the connection broke.
    #[error("etcd at {url}: {source}")]
    Unreachable {
        /// The gateway URL.
        url: String,
        /// The error.
        #[source]
        source: reqwest::Error,
    },
    /// etcd answered with an error.
    #[error("etcd {path}: {status}: {message}")]
    Refused {
        /// The API path.
        path: String,
        /// HTTP status.
        status: u16,
        /// etcd's message.
        message: String,
    },
    /// An answer that is not what the API defines.
    #[error("etcd {path}: malformed answer: {detail}")]
    Malformed {
        /// The API path.
        path: &'static str,
        /// What was wrong.
        detail: String,
    },
}

/// Where discovery lives: an etcd client endpoint and the key prefix every
/// handoff worker of one deployment registers under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdEndpoint {
    /// `http://HOST:PORT`.
    pub base: String,
    /// Key prefix, `/handoff` unless the endpoint names one; no trailing `/`.
    pub prefix: String,
}

impl std::str::FromStr for EtcdEndpoint {
    type Err = EtcdError;

    fn from_str(s: &str) -> Result<Self, EtcdError> {
        let bad = || EtcdError::Endpoint(s.to_string());
        let rest = s.strip_prefix("etcd://").ok_or_else(bad)?;
        let (hostport, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = hostport.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad());
        }
        let path = path.trim_end_matches('/');
        if path.chars().any(|c| c.is_control() || c == ' ') {
            return Err(bad());
        }
        Ok(EtcdEndpoint {
            base: format!("http://{hostport}"),
            prefix: if path.is_empty() {
                "/handoff".into()
            } else {
                format!("/{path}")
            },
        })
    }
}

/// One change under a watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// `key` was created or changed to `value`.
    Put {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
    },
    /// `key` was deleted (or its lease expired).
    Delete {
        /// The key.
        key: String,
    },
}

/// A client of one etcd endpoint.
#[derive(Debug, Clone)]
pub struct Etcd {
    http: reqwest::Client,
    base: String,
    timeout: Duration,
}

/// The end of the key range of every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn key_value(kv: &Value) -> Option<(String, Vec<u8>)> {
    let key = B64.decode(kv.get("key")?.as_str()?).ok()?;
    let value = match kv.get("value").and_then(Value::as_str) {
        Some(v) => B64.decode(v).ok()?,
        None => Vec::new(),
    };
    Some((String::from_utf8(key).ok()?, value))
}

impl Etcd {
    /// A client of the etcd at `base` (`http://HOST:PORT`); every call is
    /// bounded by `timeout` (a watch only while it connects).
    pub fn new(base: &str, timeout: Duration) -> Result<Self, EtcdError> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .no_proxy()
            .build()
            .map_err(|source| EtcdError::Unreachable {
                url: base.to_string(),
                source,
            })?;
        Ok(Etcd {
            http,
            base: base.trim_end_matches('/').to_string(),
            timeout,
        })
    }

    async fn call(&self, path: &'static str, body: Value) -> Result<Value, EtcdError> {
        let url = format!("{}{path}", self.base);
        let unreachable = |source| EtcdError::Unreachable {
            url: url.clone(),
            source,
        };
        let resp = self
            .http
            .post(&url)
            .timeout(self.timeout)
            .json(&body)
            .send()
            .await
            .map_err(unreachable)?;
        let status = resp.status();
        let v: Value = resp.json().await.map_err(unreachable)?;
        if !status.is_success() || v.get("error").is_some() {
            return Err(EtcdError::Refused {
                path: path.to_string(),
                status: status.as_u16(),
                message: v
                    .get("message")
                    .or_else(|| v.get("error"))
                    .map(|m| m.to_string())
                    .unwrap_or_default(),
            });
        }
        Ok(v)
    }

    /// A lease of `ttl` (whole seconds, at least 1); its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let v = self
            .call("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1) }))
            .await?;
        v.get("ID").and_then(num).ok_or(EtcdError::Malformed {
            path: "/v3/lease/grant",
            detail: "no lease ID".into(),
        })
    }

    /// Renew lease `id` once; false when it is gone (expired or revoked).
    pub async fn keep_alive(&self, id: i64) -> Result<bool, EtcdError> {
        let v = self
            .call("/v3/lease/keepalive", json!({ "ID": id.to_string() }))
            .await?;
        let ttl = v
            .get("result")
            .and_then(|r| r.get("TTL"))
            .and_then(num)
            .unwrap_or(0);
        Ok(ttl > 0)
    }

    /// Whether etcd answers at all (its maintenance status), within the
    /// client's timeout.
    pub async fn status(&self) -> Result<(), EtcdError> {
        self.call("/v3/maintenance/status", json!({}))
            .await
            .map(drop)
    }

    /// Revoke lease `id`: every key under it goes at once.
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({ "ID": id.to_string() }))
            .await
            .map(drop)
    }

    /// Put `key` = `value`, attached to `lease` when given.
    pub async fn put(&self, key: &str, value: &[u8], lease: Option<i64>) -> Result<(), EtcdError> {
        let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if let Some(l) = lease {
            body["lease"] = json!(l.to_string());
        }
        self.call("/v3/kv/put", body).await.map(drop)
    }

    /// Every key under `prefix` with its value, and the store's revision.
    pub async fn range_prefix(
        &self,
        prefix: &str,
    ) -> Result<(i64, Vec<(String, Vec<u8>)>), EtcdError> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) }),
            )
            .await?;
        let revision = v
            .get("header")
            .and_then(|h| h.get("revision"))
            .and_then(num)
            .ok_or(EtcdError::Malformed {
                path: "/v3/kv/range",
                detail: "no header revision".into(),
            })?;
        let kvs = v
            .get("kvs")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(key_value).collect())
            .unwrap_or_default();
        Ok((revision, kvs))
    }

    /// Watch every key under `prefix` from revision `from`: `on_event`
    /// gets each change in order; returns when the watch stream ends or
    /// breaks (the caller ranges again and re-watches).
    pub async fn watch_prefix(
        &self,
        prefix: &str,
        from: i64,
        mut on_event: impl FnMut(WatchEvent),
    ) -> Result<(), EtcdError> {
        let url = format!("{}/v3/watch", self.base);
        let unreachable = |source| EtcdError::Unreachable {
            url: url.clone(),
            source,
        };
        let body = json!({ "create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix)),
            "start_revision": from.to_string(),
        }});
        let resp = self
            .http
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(unreachable)?;
        if !resp.status().is_success() {
            return Err(EtcdError::Refused {
                path: "/v3/watch".into(),
                status: resp.status().as_u16(),
                message: String::new(),
            });
        }
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.map_err(unreachable)?);
            // The gateway streams one JSON object per message.
            let mut values = serde_json::Deserializer::from_slice(&buf).into_iter::<Value>();
            let mut used = 0;
            while let Some(Ok(v)) = values.next() {
                used = values.byte_offset();
                let result = v.get("result").unwrap_or(&v);
                if result.get("canceled").and_then(Value::as_bool) == Some(true) {
                    return Ok(());
                }
                for e in result
                    .get("events")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let Some((key, value)) = e.get("kv").and_then(key_value) else {
                        continue;
                    };
                    on_event(match e.get("type").and_then(Value::as_str) {
                        Some("DELETE") => WatchEvent::Delete { key },
                        _ => WatchEvent::Put { key, value },
                    });
                }
            }
            buf.drain(..used);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_a_default_prefix_and_bad_ones_are_named() {
        let e: EtcdEndpoint = "etcd://127.0.0.1:2379".parse().unwrap();
        assert_eq!(
            (e.base.as_str(), e.prefix.as_str()),
            ("http://127.0.0.1:2379", "/handoff")
        );
        let e: EtcdEndpoint = "etcd://etcd.svc:2379/prod/llm/".parse().unwrap();
        assert_eq!(
            (e.base.as_str(), e.prefix.as_str()),
            ("http://etcd.svc:2379", "/prod/llm")
        );
        for bad in [
            "http://x:1",
            "etcd://x",
            "etcd://:1",
            "etcd://x:99999",
            "etcd://x:1/a b",
        ] {
            let err = bad.parse::<EtcdEndpoint>().unwrap_err().to_string();
            assert!(
                err.contains(bad) && err.contains("etcd://HOST:PORT"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_prefix_range_ends_past_every_key_under_it() {
        assert_eq!(prefix_end("/h/"), b"/h0".to_vec());
        assert_eq!(prefix_end("ab"), b"ac".to_vec());
    }
}
