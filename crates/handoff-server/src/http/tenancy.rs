//! Whom a request is served for and how urgently (issue 32 item 4): its
//! `priority` field (SGLang's and vLLM's; larger is sooner, as SGLang has
//! it) and its tenant, the name of the API key it came with. The engines
//! order waiting requests by priority, then share fairly between tenants
//! ([`handoff_engine::fair`]).
//!
//! The auth layer ([`crate::http::auth`]) writes both headers below from the key
//! a request carries, removing whatever the client sent, so neither can be
//! forged with another key: the tenant is the key's name (only the
//! cluster's own key, which the router uses, may name another), and a key
//! with a priority limit has it in [`MAX_PRIORITY_HEADER`]. With no key
//! configured nothing is checked and a client may name its own tenant.

use std::sync::Arc;

use axum::http::HeaderMap;
use handoff_engine::fair::{Class, PRIORITY_RANGE};
use serde_json::Value;

use crate::http::errors::ApiError;

/// The tenant a request is served for.
pub const TENANT_HEADER: &str = "x-handoff-tenant";

/// The highest priority the request's key may ask (set by the auth layer).
pub const MAX_PRIORITY_HEADER: &str = "x-handoff-max-priority";

/// The lowest priority.
pub const PRIORITY_MIN: i32 = *PRIORITY_RANGE.start();

/// The highest priority.
pub const PRIORITY_MAX: i32 = *PRIORITY_RANGE.end();

/// Longest tenant name, in bytes.
const MAX_TENANT_LEN: usize = 128;

/// Whether `p` is a priority a request may carry.
pub fn priority_in_range(p: i32) -> bool {
    PRIORITY_RANGE.contains(&p)
}

/// The `priority` field: an integer in range, `null` meaning absent.
pub fn parse_priority(v: Option<&Value>) -> Result<Option<i32>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    v.as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| priority_in_range(*p))
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid_param(
                "priority",
                format!("priority must be an integer in {PRIORITY_MIN}..={PRIORITY_MAX} (larger is served sooner), got {v}"),
            )
        })
}

/// The request's class: `priority` (default 0, or the key's limit if that
/// is lower) checked against its key's limit (403 above it), and the tenant
/// the headers name.
pub fn class_of(priority: Option<i32>, headers: &HeaderMap) -> Result<Class, ApiError> {
    let max = match headers.get(MAX_PRIORITY_HEADER) {
        None => None,
        Some(h) => Some(
            h.to_str()
                .ok()
                .and_then(|s| s.parse::<i32>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_header",
                        format!("{MAX_PRIORITY_HEADER} must be an integer"),
                    )
                })?,
        ),
    };
    let priority = match (priority, max) {
        (Some(p), Some(m)) if p > m => {
            return Err(ApiError::new(
                403,
                "priority_not_allowed",
                format!("priority {p} is above {m}, the highest this API key may ask"),
            ))
        }
        (Some(p), _) => p,
        (None, Some(m)) => m.min(0),
        (None, None) => 0,
    };
    let tenant = match headers.get(TENANT_HEADER) {
        None => None,
        Some(h) => {
            let name = h
                .to_str()
                .ok()
                .filter(|s| !s.is_empty() && s.len() <= MAX_TENANT_LEN)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_header",
                        format!("{TENANT_HEADER} must be 1 to {MAX_TENANT_LEN} printable ASCII characters"),
                    )
                })?;
            Some(Arc::from(name))
        }
    };
    Ok(Class { priority, tenant })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn priorities_are_checked_against_the_range_and_the_keys_limit() {
        assert_eq!(parse_priority(None).unwrap(), None);
        assert_eq!(parse_priority(Some(&Value::Null)).unwrap(), None);
        assert_eq!(parse_priority(Some(&json!(-7))).unwrap(), Some(-7));
        for bad in [
            json!(1001),
            json!(1.5),
            json!("high"),
            json!(-4_000_000_000i64),
        ] {
            let e = parse_priority(Some(&bad)).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(
                e.message,
                format!("priority must be an integer in -1000..=1000 (larger is served sooner), got {bad}")
            );
        }
        let mut h = HeaderMap::new();
        assert_eq!(class_of(None, &h).unwrap(), Class::default());
        h.insert(TENANT_HEADER, "alice".parse().unwrap());
        h.insert(MAX_PRIORITY_HEADER, "5".parse().unwrap());
        let c = class_of(Some(5), &h).unwrap();
        assert_eq!((c.priority, c.tenant.as_deref()), (5, Some("alice")));
        let e = class_of(Some(6), &h).unwrap_err();
        assert_eq!((e.status, e.code), (403, "priority_not_allowed"));
        assert_eq!(
            e.message,
            "priority 6 is above 5, the highest this API key may ask"
        );
        h.insert(MAX_PRIORITY_HEADER, "-10".parse().unwrap());
        assert_eq!(
            class_of(None, &h).unwrap().priority,
            -10,
            "the limit is the default"
        );
        h.insert(TENANT_HEADER, "".parse().unwrap());
        assert_eq!(class_of(None, &h).unwrap_err().status, 400);
    }
}
