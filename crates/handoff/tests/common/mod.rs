//! Helpers the process-level tests share.

use serde_json::Value;

/// The router's `/workers` list at `url`.
pub async fn workers(url: &str) -> Vec<Value> {
    reqwest::get(format!("{url}/workers"))
        .await
        .expect("workers")
        .json::<Value>()
        .await
        .expect("JSON")
        .as_array()
        .cloned()
        .unwrap_or_default()
}
