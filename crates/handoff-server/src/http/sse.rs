//! Server-sent events: `data: {json}\n\n` per chunk, `data: [DONE]` at the
//! end, and errors as an event whose data is the JSON error object.
//!
//! A producer task writes events into a bounded channel that the response
//! body reads. When the client goes away the body (and the channel's receiver)
//! is dropped; the producer sees it at once through [`SseSender::closed`] and
//! returns, dropping the engine stream, which cancels the request.
//!
//! Marks (`stream_marks`, asked by the router): each data event also carries
//! an SSE comment line `:handoff ids=3,17` naming the tokens whose text it
//! brings (tokens that brought no event ride on the next one), and
//! `:handoff ids=... end` on the event that ends the generation. SSE clients
//! ignore comments; the router strips them, and if the decode worker dies
//! mid-stream it continues the generation elsewhere from exactly those ids.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::http::errors::ApiError;

/// Events buffered between producer and body.
const CHANNEL_CAPACITY: usize = 64;

/// The producer's end of an SSE response.
#[derive(Debug, Clone)]
pub struct SseSender {
    tx: mpsc::Sender<Event>,
    /// With `stream_marks`: what the next data event covers.
    marks: Option<Arc<Mutex<Marks>>>,
}

/// Tokens (and the end) not yet named in a mark.
#[derive(Debug, Default)]
struct Marks {
    ids: Vec<u32>,
    end: bool,
}

/// The comment that names `ids` (and the end).
pub fn mark_comment(ids: &[u32], end: bool) -> String {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let mut c = format!("handoff ids={}", list.join(","));
    if end {
        c.push_str(" end");
    }
    c
}

/// The client went away; stop producing.
#[derive(Debug, Clone, Copy)]
pub struct Disconnected;

impl SseSender {
    /// Send one `data: {json}` event.
    pub async fn json<T: Serialize>(&self, value: &T) -> Result<(), Disconnected> {
        let data = serde_json::to_string(value).map_err(|_| Disconnected)?;
        let mut ev = Event::default();
        if let Some(m) = &self.marks {
            let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
            ev = ev.comment(mark_comment(&m.ids, m.end));
            m.ids.clear();
        }
        self.send(ev.data(data)).await
    }

    /// A token was generated: the next data event covers it.
    pub fn note_token(&self, id: u32) {
        if let Some(m) = &self.marks {
            m.lock().unwrap_or_else(|e| e.into_inner()).ids.push(id);
        }
    }

    /// The generation ended: the next data event (the last one with a
    /// finish reason) says so.
    pub fn note_end(&self) {
        if let Some(m) = &self.marks {
            m.lock().unwrap_or_else(|e| e.into_inner()).end = true;
        }
    }

    /// Send the error as `data: {"error":{...}}`.
    pub async fn error(&self, err: &ApiError) -> Result<(), Disconnected> {
        self.json(&err.to_json()).await
    }

    /// Send `data: [DONE]`.
    pub async fn done(&self) -> Result<(), Disconnected> {
        self.send(Event::default().data("[DONE]")).await
    }

    async fn send(&self, ev: Event) -> Result<(), Disconnected> {
        self.tx.send(ev).await.map_err(|_| Disconnected)
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    /// Await `fut` unless the client goes away first (then `Err`).
    pub async fn race<F: Future>(&self, fut: F) -> Result<F::Output, Disconnected> {
        tokio::select! {
            out = fut => Ok(out),
            _ = self.tx.closed() => Err(Disconnected),
        }
    }
}

/// Start `produce` on its own task and return the SSE response that streams
/// what it sends.
pub fn sse_response<F, Fut>(produce: F) -> Response
where
    F: FnOnce(SseSender) -> Fut,
    Fut: Future<Output = Result<(), Disconnected>> + Send + 'static,
{
    sse_response_marked(false, produce)
}

/// [`sse_response`], with marks on each data event when `marks`.
pub fn sse_response_marked<F, Fut>(marks: bool, produce: F) -> Response
where
    F: FnOnce(SseSender) -> Fut,
    Fut: Future<Output = Result<(), Disconnected>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    let marks = marks.then(|| Arc::new(Mutex::new(Marks::default())));
    let fut = produce(SseSender { tx, marks });
    tokio::spawn(async move {
        if fut.await.is_err() {
            tracing::debug!("SSE client disconnected; request cancelled");
        }
    });
    let body = stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
    });
    Sse::new(body)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_are_data_lines_and_errors_are_json() {
        let resp = sse_response(|tx| async move {
            tx.json(&serde_json::json!({"text": "a"})).await?;
            tx.error(&ApiError::new(500, "model_error", "boom")).await
        });
        assert_eq!(
            resp.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events[0], "data: {\"text\":\"a\"}");
        let err: serde_json::Value =
            serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(err["error"]["code"], "model_error");
        assert_eq!(err["error"]["type"], "server_error");
        assert_eq!(err["error"]["message"], "boom");
        assert_eq!(events.len(), 2, "the stream ends after the error");
    }

    #[tokio::test]
    async fn producer_stops_when_the_client_goes_away() {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let resp = sse_response(|tx| async move {
            let r = tx.race(std::future::pending::<()>()).await;
            let _ = done_tx.send(r.is_err());
            Ok(())
        });
        drop(resp);
        assert!(done_rx.await.unwrap(), "race returns Disconnected");
    }
}
