//! Request ids and the clock they are stamped with.

use crate::http::errors::ApiError;

/// A fresh request id like `chatcmpl-8c1f0e5a9b3d47e2a6f01c9d`: `prefix`,
/// a dash and 96 random bits in hex, so ids from different workers (and
/// restarts) do not collide.
pub fn new_request_id(prefix: &str) -> String {
    let bits: u128 = rand::random::<u128>() >> 32;
    format!("{prefix}-{bits:024x}")
}

/// A request's id: the `rid` its sender chose, checked (a router gives both
/// PD workers the same one, so `/abort_request` reaches both), else a fresh
/// one.
pub fn request_id(rid: Option<&String>, prefix: &str) -> Result<String, ApiError> {
    match rid {
        Some(rid) => {
            crate::worker::aborts::check_rid(rid, "rid")?;
            Ok(rid.clone())
        }
        None => Ok(new_request_id(prefix)),
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
