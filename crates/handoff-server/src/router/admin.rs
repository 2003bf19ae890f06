//! `/admin/restart` (issue 15 item 4): a rolling restart of the workers of
//! `handoff serve`, one at a time, asked for over HTTP. The router only
//! passes the request on to whoever runs the workers (a [`RestartHook`] in
//! its configuration) and reports progress; without a hook the route does
//! not exist. The route always needs the API key, even if `--open-path`
//! names it, and a router without a key refuses it (403): restarting every
//! worker is not for anyone who can reach the port.

use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::http::errors::ApiError;
use crate::router::RouterState;

/// How a restart went, as `GET /admin/restart` shows it.
#[derive(Debug, Default, Clone)]
struct Progress {
    /// Restarts asked for since the start.
    requested: u64,
    /// A restart is under way.
    running: bool,
    /// Workers replaced by the restart under way (or the last one).
    replaced: usize,
    /// Restarts finished (well or not).
    finished: u64,
    /// The last finished restart's error, if it failed.
    last_error: Option<String>,
}

/// The link between the router and whoever runs the workers: the router
/// sends a request per `POST /admin/restart` (or the owner's own trigger,
/// such as SIGHUP) and the owner reports progress.
#[derive(Debug, Clone)]
pub struct RestartHook {
    tx: tokio::sync::mpsc::Sender<()>,
    progress: Arc<Mutex<Progress>>,
}

/// The owner's end of a [`RestartHook`].
#[derive(Debug)]
pub struct RestartRequests {
    rx: tokio::sync::mpsc::Receiver<()>,
    progress: Arc<Mutex<Progress>>,
}

/// A hook and the receiving end the owner keeps.
pub fn restart_hook() -> (RestartHook, RestartRequests) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let progress = Arc::new(Mutex::new(Progress::default()));
    (
        RestartHook {
            tx,
            progress: Arc::clone(&progress),
        },
        RestartRequests { rx, progress },
    )
}

/// Why a restart was not started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStarted {
    /// One is under way or already asked for.
    Busy,
    /// Nobody runs the workers any more.
    Gone,
}

impl RestartHook {
    /// Ask for a restart.
    pub fn request(&self) -> Result<u64, NotStarted> {
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        if p.running {
            return Err(NotStarted::Busy);
        }
        match self.tx.try_send(()) {
            Ok(()) => {
                p.requested += 1;
                Ok(p.requested)
            }
            Err(tokio::sync::mpsc::error::TrySendError::Full(())) => Err(NotStarted::Busy),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(())) => Err(NotStarted::Gone),
        }
    }

    fn describe(&self) -> Value {
        let p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        json!({
            "requested": p.requested,
            "running": p.running,
            "replaced": p.replaced,
            "finished": p.finished,
            "last_error": p.last_error,
        })
    }
}

impl RestartRequests {
    /// The next restart asked for (`None` once every hook is gone).
    pub async fn next(&mut self) -> Option<()> {
        let r = self.rx.recv().await;
        if r.is_some() {
            let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            p.running = true;
            p.replaced = 0;
        }
        r
    }

    /// One more worker was replaced.
    pub fn replaced_one(&self) {
        self.progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replaced += 1;
    }

    /// The restart under way ended.
    pub fn finished(&self, result: Result<(), String>) {
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.running = false;
        p.finished += 1;
        p.last_error = result.err();
    }
}

fn admitted(state: &RouterState, req: &Request) -> Result<(), ApiError> {
    match &state.config.api_key {
        None => Err(ApiError::new(
            403,
            "admin_needs_api_key",
            "/admin/restart needs the server to have an API key (--api-key, --api-key-file or HANDOFF_API_KEY); restart with SIGHUP instead",
        )),
        // A tenant's key is not enough: only the cluster's.
        Some(k) if k.is_cluster_key(req.headers().get(AUTHORIZATION)) => Ok(()),
        Some(_) => Err(ApiError::new(
            401,
            "invalid_api_key",
            "/admin/restart needs `Authorization: Bearer KEY` with the cluster's key (the first of a key file)",
        )),
    }
}

/// `POST /admin/restart`: start a rolling restart (202), or 409 if one is
/// under way.
pub async fn restart(State(state): State<RouterState>, req: Request) -> Response {
    let Some(hook) = &state.config.restart else {
        return no_workers();
    };
    if let Err(e) = admitted(&state, &req) {
        return e.into_response();
    }
    match hook.request() {
        Ok(n) => (
            StatusCode::ACCEPTED,
            Json(json!({"restart": n, "status": "started", "progress": hook.describe()})),
        )
            .into_response(),
        Err(NotStarted::Busy) => ApiError::new(
            409,
            "restart_in_progress",
            "a rolling restart is under way: see GET /admin/restart",
        )
        .into_response(),
        Err(NotStarted::Gone) => {
            ApiError::new(503, "shutting_down", "the workers are stopping").into_response()
        }
    }
}

/// `GET /admin/restart`: the progress of the restart under way or the last.
pub async fn restart_status(State(state): State<RouterState>, req: Request) -> Response {
    let Some(hook) = &state.config.restart else {
        return no_workers();
    };
    match admitted(&state, &req) {
        Ok(()) => Json(hook.describe()).into_response(),
        Err(e) => e.into_response(),
    }
}

fn no_workers() -> Response {
    ApiError::new(
        404,
        "not_found",
        "this router runs no workers to restart (only `handoff serve` does)",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_restart_at_a_time() {
        let (hook, mut reqs) = restart_hook();
        assert_eq!(hook.request(), Ok(1));
        assert_eq!(hook.request(), Err(NotStarted::Busy), "queued already");
        reqs.next().await.unwrap();
        assert_eq!(hook.request(), Err(NotStarted::Busy), "running");
        reqs.replaced_one();
        reqs.replaced_one();
        assert_eq!(hook.describe()["replaced"], 2);
        reqs.finished(Err("worker 3 never became healthy".into()));
        let d = hook.describe();
        assert_eq!(
            (d["running"].as_bool(), d["finished"].as_u64()),
            (Some(false), Some(1))
        );
        assert_eq!(d["last_error"], "worker 3 never became healthy");
        assert_eq!(hook.request(), Ok(2));
        drop(reqs);
        let (hook, reqs) = restart_hook();
        drop(reqs);
        assert_eq!(hook.request(), Err(NotStarted::Gone));
    }
}
