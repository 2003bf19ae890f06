//! One request's events, from the scheduler to whoever answers the client.
//!
//! Tokens go through a bounded channel: when its reader lags
//! [`STREAM_BUFFER`] tokens behind (a client that stopped reading its
//! stream), the scheduler leaves the request out of its decode steps until
//! the reader catches up, so a stalled client costs neither compute nor
//! memory. The last event (finished or failed) has its own slot, so it can
//! always be delivered, full buffer or not, and arrives after every token.

use tokio::sync::{mpsc, oneshot};

use crate::request::{StreamEvent, TokenOut};

/// Tokens a request may have produced and its reader not yet taken; past
/// this the request is paused.
pub const STREAM_BUFFER: usize = 32;

/// The scheduler's end of one request's events.
#[derive(Debug)]
pub(crate) struct EventSender {
    tokens: mpsc::Sender<StreamEvent>,
    last: oneshot::Sender<StreamEvent>,
}

/// A token could not be delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotSent {
    /// The reader is gone: the request is cancelled.
    Closed,
    /// The buffer is full; callers check [`EventSender::has_room`] first,
    /// so this is a scheduler bug, reported as a failure, never a lost token.
    Full,
}

/// A connected pair: the scheduler's sender and the handler's stream.
pub(crate) fn channel() -> (EventSender, RequestStream) {
    let (tokens, rx) = mpsc::channel(STREAM_BUFFER);
    let (last, last_rx) = oneshot::channel();
    (
        EventSender { tokens, last },
        RequestStream::new(rx, last_rx),
    )
}

impl EventSender {
    /// Whether one more token fits; a request without room is not stepped.
    pub fn has_room(&self) -> bool {
        self.tokens.capacity() > 0
    }

    /// Whether the reader dropped its stream (the client went away).
    pub fn is_closed(&self) -> bool {
        self.tokens.is_closed()
    }

    /// Resolves once the reader dropped its stream.
    pub async fn closed(&self) {
        self.tokens.closed().await
    }

    /// Deliver one token.
    pub fn token(&self, t: TokenOut) -> Result<(), NotSent> {
        self.tokens
            .try_send(StreamEvent::Token(t))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => NotSent::Full,
                mpsc::error::TrySendError::Closed(_) => NotSent::Closed,
            })
    }

    /// Deliver the last event (`Finished` or `Error`); it follows every
    /// token sent before it, whatever the buffer holds.
    pub fn end(self, ev: StreamEvent) {
        drop(self.tokens);
        let _ = self.last.send(ev);
    }
}

/// The events of one request: its tokens, then one `Finished` or `Error`.
/// Drop it to cancel the request. A reader that falls
/// [`STREAM_BUFFER`] tokens behind pauses the
/// request's generation until it catches up.
#[derive(Debug)]
pub struct RequestStream {
    tokens: mpsc::Receiver<StreamEvent>,
    last: Option<oneshot::Receiver<StreamEvent>>,
}

impl RequestStream {
    pub(crate) fn new(
        tokens: mpsc::Receiver<StreamEvent>,
        last: oneshot::Receiver<StreamEvent>,
    ) -> Self {
        Self {
            tokens,
            last: Some(last),
        }
    }

    /// Next event; `None` after `Finished`/`Error` has been yielded (or
    /// when the engine dropped the request without a last event).
    pub async fn next(&mut self) -> Option<StreamEvent> {
        if let Some(ev) = self.tokens.recv().await {
            return Some(ev);
        }
        self.last.take()?.await.ok()
    }

    /// Blocking variant of [`RequestStream::next`] for non-async callers (tests, benches).
    pub fn blocking_next(&mut self) -> Option<StreamEvent> {
        if let Some(ev) = self.tokens.blocking_recv() {
            return Some(ev);
        }
        self.last.take()?.blocking_recv().ok()
    }
}
