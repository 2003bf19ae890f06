//! One control connection, sans-IO:
//! bytes in, events out; messages in, bytes out. The I/O shell owns the
//! socket (one writer per socket) and does nothing clever: it pushes what it
//! reads into [`Connection::handle_bytes`], writes what
//! [`Connection::take_output`] returns, and hands [`ConnectionEvent::Message`]s
//! to its room table. Transports never parse control frames themselves.
//!
//! A malformed frame after the handshake is reported as
//! [`ConnectionEvent::Malformed`], counted, and skipped; the connection and
//! every room on it carry on. During the handshake any error is fatal
//! ([`ConnectionEvent::Failed`]); nothing more is sent to a peer that has not
//! proved the shared secret.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::{CodecError, HandshakeError};
use crate::frame::{encode_frame, DecoderStats, FrameDecoder, HANDSHAKE_FRAME_VERSION};
use crate::handshake::{Capabilities, Handshake, HandshakeConfig, Negotiated};
use crate::message::{Message, NONCE_LEN};

/// What happened on a connection.
#[derive(Debug, Clone, PartialEq)]
pub enum ConnectionEvent {
    /// The handshake completed; messages may flow.
    Established(Negotiated),
    /// A control message for the room table.
    Message(Message),
    /// A bad frame was dropped (the connection continues).
    Malformed(CodecError),
    /// The handshake failed: close the connection.
    Failed(HandshakeError),
}

/// Why a message could not be queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The handshake has not completed (or failed).
    #[error("connection not established")]
    NotEstablished,
    /// The message cannot be encoded for this peer (too large).
    #[error(transparent)]
    Codec(#[from] CodecError),
}

/// A control connection's protocol state.
#[derive(Debug)]
pub struct Connection {
    handshake: Handshake,
    decoder: FrameDecoder,
    negotiated: Option<Negotiated>,
    failed: bool,
    out: Vec<u8>,
    events: VecDeque<ConnectionEvent>,
    handshake_deadline: Option<Instant>,
    handshake_timeout: Duration,
}

impl Connection {
    /// A new connection; our `Register` is already queued in the output.
    /// `nonce` must be fresh random bytes; the handshake must complete
    /// within `handshake_timeout` of `now`.
    pub fn new(
        config: HandshakeConfig,
        nonce: [u8; NONCE_LEN],
        handshake_timeout: Duration,
        now: Instant,
    ) -> Self {
        let decoder = FrameDecoder::new(config.max_frame_len);
        let mut c = Self {
            handshake: Handshake::new(config, nonce),
            decoder,
            negotiated: None,
            failed: false,
            out: Vec::new(),
            events: VecDeque::new(),
            handshake_deadline: Some(now + handshake_timeout),
            handshake_timeout,
        };
        c.flush_handshake();
        c
    }

    fn flush_handshake(&mut self) {
        while let Some(m) = self.handshake.poll_transmit() {
            // Handshake messages are small and fixed-size; encoding cannot
            // exceed any legal limit.
            let _ = encode_frame(
                &m,
                HANDSHAKE_FRAME_VERSION,
                Capabilities::NONE,
                u32::MAX,
                &mut self.out,
            );
        }
    }

    fn fail(&mut self, e: HandshakeError) {
        self.failed = true;
        self.handshake_deadline = None;
        self.events.push_back(ConnectionEvent::Failed(e));
    }

    /// Bytes read from the socket. Then drain [`Self::poll_event`] and
    /// write [`Self::take_output`].
    pub fn handle_bytes(&mut self, bytes: &[u8], now: Instant) {
        let _ = now;
        if self.failed {
            return;
        }
        self.decoder.push(bytes);
        while let Some(result) = self.decoder.poll() {
            match (result, self.negotiated.is_some()) {
                (Ok(m), true) => self.events.push_back(ConnectionEvent::Message(m)),
                (Err(e), true) => self.events.push_back(ConnectionEvent::Malformed(e)),
                (Err(e), false) => {
                    self.fail(HandshakeError::Codec(e));
                    return;
                }
                (Ok(m), false) => {
                    if let Err(e) = self.handshake.handle(m) {
                        // Only an authenticated peer still gets our proof.
                        self.flush_handshake();
                        self.fail(e);
                        return;
                    }
                    self.flush_handshake();
                    if let Some(n) = self.handshake.negotiated() {
                        let n = n.clone();
                        self.decoder.set_capabilities(n.capabilities);
                        self.handshake_deadline = None;
                        self.negotiated = Some(n.clone());
                        self.events.push_back(ConnectionEvent::Established(n));
                    }
                }
            }
        }
    }

    /// Queue `msg` for the peer, encoded for the negotiated version and
    /// capabilities.
    pub fn send(&mut self, msg: &Message) -> Result<(), SendError> {
        let n = self.negotiated.as_ref().ok_or(SendError::NotEstablished)?;
        if self.failed {
            return Err(SendError::NotEstablished);
        }
        encode_frame(
            msg,
            n.version,
            n.capabilities,
            n.peer_max_frame_len,
            &mut self.out,
        )?;
        Ok(())
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<ConnectionEvent> {
        self.events.pop_front()
    }

    /// Everything to write to the socket, in order.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// The handshake deadline while it is pending.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.handshake_deadline
    }

    /// Fail the handshake if its deadline passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.handshake_deadline.is_some_and(|d| d <= now) {
            self.fail(HandshakeError::TimedOut(self.handshake_timeout));
        }
    }

    /// What the handshake agreed on, once established.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// Whether the connection failed and must be closed.
    pub fn is_failed(&self) -> bool {
        self.failed
    }

    /// Frame decoder counters (malformed frames, skipped bytes).
    pub fn decoder_stats(&self) -> &DecoderStats {
        self.decoder.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::sample_fingerprint;
    use crate::ids::{Role, RoomId};
    use crate::message::{AbortAck, Heartbeat};

    fn pair(secret_p: Option<&[u8]>, secret_d: Option<&[u8]>) -> (Connection, Connection, Instant) {
        let now = Instant::now();
        let mut p = HandshakeConfig::new(Role::Prefill, sample_fingerprint());
        p.secret = secret_p.map(<[u8]>::to_vec);
        let mut d = HandshakeConfig::new(Role::Decode, sample_fingerprint());
        d.secret = secret_d.map(<[u8]>::to_vec);
        let t = Duration::from_secs(30);
        (
            Connection::new(p, [1; 32], t, now),
            Connection::new(d, [2; 32], t, now),
            now,
        )
    }

    /// Exchange bytes until both are quiet; returns each side's events.
    fn pump(
        a: &mut Connection,
        b: &mut Connection,
        now: Instant,
    ) -> (Vec<ConnectionEvent>, Vec<ConnectionEvent>) {
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        for _ in 0..8 {
            let to_b = a.take_output();
            let to_a = b.take_output();
            if to_a.is_empty() && to_b.is_empty() {
                break;
            }
            b.handle_bytes(&to_b, now);
            a.handle_bytes(&to_a, now);
            ea.extend(std::iter::from_fn(|| a.poll_event()));
            eb.extend(std::iter::from_fn(|| b.poll_event()));
        }
        (ea, eb)
    }

    #[test]
    fn establishes_then_carries_messages_past_garbage() {
        let (mut p, mut d, now) = pair(Some(b"k"), Some(b"k"));
        assert_eq!(
            p.send(&Message::Heartbeat(Heartbeat { seq: 0 })),
            Err(SendError::NotEstablished)
        );
        let (ep, ed) = pump(&mut p, &mut d, now);
        assert!(
            matches!(ep.as_slice(), [ConnectionEvent::Established(n)] if n.peer_role == Role::Decode)
        );
        assert!(matches!(ed.as_slice(), [ConnectionEvent::Established(_)]));
        let ack = Message::AbortAck(AbortAck {
            room: RoomId::new(3).unwrap(),
            drained: true,
        });
        d.send(&ack).unwrap();
        let mut bytes = d.take_output();
        bytes.splice(0..0, b"junk".iter().copied());
        p.handle_bytes(&bytes, now);
        let events: Vec<_> = std::iter::from_fn(|| p.poll_event()).collect();
        assert!(matches!(
            &events[0],
            ConnectionEvent::Malformed(CodecError::BadMagic { .. })
        ));
        assert_eq!(events[1], ConnectionEvent::Message(ack));
        assert_eq!(p.decoder_stats().errors, 1);
        assert!(!p.is_failed());
    }

    #[test]
    fn bad_secret_fails_and_sends_nothing_more() {
        let (mut p, mut d, now) = pair(Some(b"right"), Some(b"wrong"));
        let (ep, ed) = pump(&mut p, &mut d, now);
        assert_eq!(
            ep,
            vec![ConnectionEvent::Failed(HandshakeError::AuthFailed)]
        );
        assert!(ed.is_empty(), "decode never hears back");
        assert!(p.take_output().is_empty());
        assert_eq!(
            p.send(&Message::Heartbeat(Heartbeat { seq: 1 })),
            Err(SendError::NotEstablished)
        );
    }

    #[test]
    fn handshake_times_out() {
        let (mut p, _d, now) = pair(None, None);
        assert_eq!(p.poll_timeout(), Some(now + Duration::from_secs(30)));
        p.handle_timeout(now + Duration::from_secs(29));
        assert!(p.poll_event().is_none());
        p.handle_timeout(now + Duration::from_secs(30));
        assert_eq!(
            p.poll_event(),
            Some(ConnectionEvent::Failed(HandshakeError::TimedOut(
                Duration::from_secs(30)
            )))
        );
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn garbage_during_handshake_is_fatal() {
        let (mut p, _d, now) = pair(None, None);
        p.handle_bytes(b"NOPE NOPE NOPE", now);
        assert!(matches!(
            p.poll_event(),
            Some(ConnectionEvent::Failed(HandshakeError::Codec(
                CodecError::BadMagic { .. }
            )))
        ));
        assert!(p.is_failed());
    }
}
