//! `POST /abort_request` (SGLang's route): end the requests in flight on
//! this worker by id ([`crate::worker::aborts`] holds them).

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::http::extract::JsonBody;
use crate::state::AppState;
use crate::worker::aborts::check_rid;

/// `POST /abort_request`'s body (SGLang's `AbortReq` fields).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortBody {
    /// The id of the request to abort.
    #[serde(default)]
    pub rid: Option<String>,
    /// Abort every request in flight.
    #[serde(default)]
    pub abort_all: bool,
}

/// `POST /abort_request`: end the requests in flight under `rid` (or all,
/// with `abort_all`). 200 with how many were aborted (0 when none was in
/// flight: it may have finished already).
pub async fn abort_request(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<AbortBody>,
) -> Result<Json<Value>, ApiError> {
    let aborted = match (&body.rid, body.abort_all) {
        (Some(rid), false) => {
            check_rid(rid, "rid")?;
            state.aborts.abort(rid)
        }
        (None, true) => state.aborts.abort_all(),
        (Some(_), true) => {
            return Err(ApiError::invalid_param(
                "abort_all",
                "send either `rid` or `abort_all: true`, not both",
            ))
        }
        (None, false) => {
            return Err(ApiError::invalid_param(
                "rid",
                "name the request to abort with `rid` (or send `abort_all: true`)",
            ))
        }
    };
    if aborted > 0 {
        tracing::info!(rid = ?body.rid, aborted, "requests aborted by /abort_request");
    }
    Ok(Json(json!({ "aborted": aborted })))
}
