//! Frame header and the streaming frame decoder.
//!
//! ```text
//! offset  size  field
//! 0       4     magic  "HOFF"
//! 4       1     protocol version
//! 5       1     message kind
//! 6       2     flags (reserved, must be 0)
//! 8       4     payload length (LE), at most the receiver's max frame length
//! 12      len   payload (see [`crate::message`])
//! ```
//!
//! [`FrameDecoder`] takes bytes in any chunking and yields fully validated
//! [`Message`]s. A bad frame is reported as a typed [`CodecError`], counted in
//! [`DecoderStats`], and then skipped by its declared length (when the header
//! itself was sound) or by scanning for the next magic (when it was not), so
//! the reader, and every room on the connection, carries on.

use crate::capabilities::Capabilities;
use crate::error::CodecError;
use crate::message::{Message, MessageKind};

pub use crate::version::{
    DEFAULT_MAX_FRAME_LEN, HANDSHAKE_FRAME_VERSION, MIN_MAX_FRAME_LEN, PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"HOFF";
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;
/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version.
    pub version: u8,
    /// Message kind.
    pub kind: MessageKind,
    /// Payload length.
    pub len: u32,
}

/// Encode `msg` as one frame with header `version`, for a connection that
/// negotiated `caps`, appending to `out`. Fails with [`CodecError::Oversize`]
/// (and leaves `out` unchanged) if the payload exceeds `max_len`.
pub fn encode_frame(
    msg: &Message,
    version: u8,
    caps: Capabilities,
    max_len: u32,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.push(version);
    out.push(msg.kind().code());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    msg.encode_payload(caps, out);
    let len = out.len() - start - HEADER_LEN;
    if len > max_len as usize {
        out.truncate(start);
        return Err(CodecError::Oversize {
            len: u32::try_from(len).unwrap_or(u32::MAX),
            max: max_len,
        });
    }
    out[start + 8..start + 12].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Convenience: one frame in a fresh buffer.
pub fn frame_bytes(msg: &Message, version: u8, caps: Capabilities) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    encode_frame(msg, version, caps, DEFAULT_MAX_FRAME_LEN, &mut out)?;
    Ok(out)
}

/// Counters of a [`FrameDecoder`], for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecoderStats {
    /// Frames decoded into messages.
    pub frames: u64,
    /// Bad frames reported (each also returned as an error).
    pub errors: u64,
    /// Bytes thrown away while skipping bad frames or resynchronising.
    pub skipped_bytes: u64,
    /// Label of the last error ([`CodecError::reason_label`]).
    pub last_error: Option<&'static str>,
}

/// Streaming decoder: bytes in ([`Self::push`]), messages out ([`Self::poll`]).
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Bytes of a rejected frame still to discard as they arrive.
    skip: u64,
    max_len: u32,
    caps: Capabilities,
    stats: DecoderStats,
}

impl FrameDecoder {
    /// A decoder accepting payloads up to `max_len` bytes. Capabilities start
    /// empty (enough for the handshake); call [`Self::set_capabilities`] with
    /// the negotiated set once the handshake completes.
    pub fn new(max_len: u32) -> Self {
        Self {
            buf: Vec::new(),
            skip: 0,
            max_len,
            caps: Capabilities::NONE,
            stats: DecoderStats::default(),
        }
    }

    /// Use `caps` to decode optional fields from now on.
    pub fn set_capabilities(&mut self, caps: Capabilities) {
        self.caps = caps;
    }

    /// Counters so far.
    pub fn stats(&self) -> &DecoderStats {
        &self.stats
    }

    /// Bytes buffered but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Append received bytes. Call [`Self::poll`] until it returns `None`.
    pub fn push(&mut self, mut bytes: &[u8]) {
        if self.skip > 0 {
            let n = (self.skip.min(bytes.len() as u64)) as usize;
            self.skip -= n as u64;
            self.stats.skipped_bytes += n as u64;
            bytes = &bytes[n..];
        }
        self.buf.extend_from_slice(bytes);
    }

    fn discard(&mut self, n: usize) {
        let n = n.min(self.buf.len());
        self.buf.drain(..n);
        self.stats.skipped_bytes += n as u64;
    }

    fn fail(&mut self, e: CodecError) -> Option<Result<Message, CodecError>> {
        self.stats.errors += 1;
        self.stats.last_error = Some(e.reason_label());
        Some(Err(e))
    }

    /// Skip a frame whose header was sound: drop what is buffered of it and
    /// discard the rest as it arrives.
    fn skip_frame(&mut self, total: u64) {
        let have = (self.buf.len() as u64).min(total);
        self.discard(have as usize);
        self.skip = total - have;
    }

    /// Offset of the next position in `buf[1..]` where a magic could start
    /// (a full match, or a prefix of it at the very end).
    fn next_magic_candidate(&self) -> usize {
        (1..self.buf.len())
            .find(|&i| {
                let tail = &self.buf[i..];
                let n = tail.len().min(MAGIC.len());
                tail[..n] == MAGIC[..n]
            })
            .unwrap_or(self.buf.len())
    }

    /// The next message, a typed error for one bad frame, or `None` when more
    /// bytes are needed. Errors are never fatal: keep polling.
    pub fn poll(&mut self) -> Option<Result<Message, CodecError>> {
        if self.buf.is_empty() {
            return None;
        }
        let n = self.buf.len().min(MAGIC.len());
        if self.buf[..n] != MAGIC[..n] {
            let mut found = [0u8; 4];
            found[..n].copy_from_slice(&self.buf[..n]);
            let next = self.next_magic_candidate();
            self.discard(next);
            return self.fail(CodecError::BadMagic { found });
        }
        if self.buf.len() < HEADER_LEN {
            return None;
        }
        let version = self.buf[4];
        let kind_code = self.buf[5];
        let flags = u16::from_le_bytes([self.buf[6], self.buf[7]]);
        let len = u32::from_le_bytes([self.buf[8], self.buf[9], self.buf[10], self.buf[11]]);
        let total = HEADER_LEN as u64 + u64::from(len);
        if len > self.max_len {
            self.skip_frame(total);
            return self.fail(CodecError::Oversize {
                len,
                max: self.max_len,
            });
        }
        if !(PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION).contains(&version) {
            self.skip_frame(total);
            return self.fail(CodecError::UnsupportedVersion {
                version,
                min: PROTOCOL_VERSION_MIN,
                max: PROTOCOL_VERSION,
            });
        }
        if flags != 0 {
            self.skip_frame(total);
            return self.fail(CodecError::ReservedFlags(flags));
        }
        let kind = match MessageKind::from_code(kind_code) {
            Ok(k) => k,
            Err(e) => {
                self.skip_frame(total);
                return self.fail(e);
            }
        };
        let total = total as usize;
        if self.buf.len() < total {
            return None;
        }
        let result = Message::decode(kind, &self.buf[HEADER_LEN..total], self.caps);
        self.buf.drain(..total);
        match result {
            Ok(m) => {
                self.stats.frames += 1;
                Some(Ok(m))
            }
            Err(e) => {
                self.stats.skipped_bytes += total as u64;
                self.fail(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RoomId;
    use crate::message::{AbortAck, Heartbeat};

    fn hb(seq: u64) -> Vec<u8> {
        frame_bytes(
            &Message::Heartbeat(Heartbeat { seq }),
            PROTOCOL_VERSION,
            Capabilities::ALL,
        )
        .unwrap()
    }

    fn drain(d: &mut FrameDecoder) -> Vec<Result<Message, CodecError>> {
        std::iter::from_fn(|| d.poll()).collect()
    }

    #[test]
    fn header_layout_is_fixed() {
        let f = hb(1);
        assert_eq!(&f[..4], b"HOFF");
        assert_eq!(f[4], PROTOCOL_VERSION);
        assert_eq!(f[5], MessageKind::Heartbeat.code());
        assert_eq!(&f[6..8], &[0, 0]);
        assert_eq!(u32::from_le_bytes([f[8], f[9], f[10], f[11]]), 8);
        assert_eq!(f.len(), HEADER_LEN + 8);
    }

    #[test]
    fn byte_at_a_time_works() {
        let mut bytes = hb(1);
        bytes.extend(hb(2));
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        let mut out = Vec::new();
        for b in bytes {
            d.push(&[b]);
            out.extend(drain(&mut d));
        }
        assert_eq!(
            out,
            vec![
                Ok(Message::Heartbeat(Heartbeat { seq: 1 })),
                Ok(Message::Heartbeat(Heartbeat { seq: 2 }))
            ]
        );
        assert_eq!(d.stats().frames, 2);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn garbage_then_frame_resyncs_with_one_error() {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(b"GET / HTTP/1.1\r\n\r\n");
        d.push(&hb(5));
        let out = drain(&mut d);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(matches!(out[0], Err(CodecError::BadMagic { found }) if &found == b"GET "));
        assert_eq!(out[1], Ok(Message::Heartbeat(Heartbeat { seq: 5 })));
        assert_eq!(d.stats().errors, 1);
        assert_eq!(d.stats().skipped_bytes, 18);
    }

    #[test]
    fn unknown_kind_is_skipped_by_length() {
        let mut bad = hb(1);
        bad[5] = 200;
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(&bad);
        d.push(&hb(2));
        let out = drain(&mut d);
        assert_eq!(
            out,
            vec![
                Err(CodecError::UnknownKind(200)),
                Ok(Message::Heartbeat(Heartbeat { seq: 2 }))
            ]
        );
    }

    #[test]
    fn oversize_frame_is_skipped_without_buffering() {
        let mut d = FrameDecoder::new(MIN_MAX_FRAME_LEN);
        let mut header = MAGIC.to_vec();
        header.extend([PROTOCOL_VERSION, MessageKind::Heartbeat.code(), 0, 0]);
        header.extend(100_000u32.to_le_bytes());
        d.push(&header);
        assert_eq!(
            d.poll(),
            Some(Err(CodecError::Oversize {
                len: 100_000,
                max: MIN_MAX_FRAME_LEN
            }))
        );
        for _ in 0..100 {
            d.push(&[0xAB; 1000]);
            assert_eq!(d.poll(), None);
        }
        assert_eq!(d.buffered(), 0);
        d.push(&hb(9));
        assert_eq!(d.poll(), Some(Ok(Message::Heartbeat(Heartbeat { seq: 9 }))));
        assert_eq!(d.stats().skipped_bytes, 100_000 + HEADER_LEN as u64);
    }

    #[test]
    fn bad_payload_is_dropped_and_next_frame_decodes() {
        let ack = Message::AbortAck(AbortAck {
            room: RoomId::new(4).unwrap(),
            drained: true,
        });
        let mut bad = frame_bytes(&ack, PROTOCOL_VERSION, Capabilities::ALL).unwrap();
        let last = bad.len() - 1;
        bad[last] = 7; // drained must be 0 or 1
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(&bad);
        d.push(&frame_bytes(&ack, PROTOCOL_VERSION, Capabilities::ALL).unwrap());
        let out = drain(&mut d);
        assert_eq!(
            out,
            vec![
                Err(CodecError::BadValue {
                    field: "drained",
                    value: 7
                }),
                Ok(ack)
            ]
        );
        assert_eq!(d.stats().last_error, Some("bad_value"));
    }

    #[test]
    fn version_and_flags_are_checked() {
        let mut v = hb(1);
        v[4] = 9;
        let mut f = hb(1);
        f[6] = 1;
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN);
        d.push(&v);
        d.push(&f);
        d.push(&hb(3));
        let out = drain(&mut d);
        assert_eq!(
            out,
            vec![
                Err(CodecError::UnsupportedVersion {
                    version: 9,
                    min: 1,
                    max: 2
                }),
                Err(CodecError::ReservedFlags(1)),
                Ok(Message::Heartbeat(Heartbeat { seq: 3 }))
            ]
        );
    }

    #[test]
    fn encode_refuses_oversize() {
        use crate::ids::{AuxSlot, PageIndex};
        use crate::message::Destination;
        let m = Message::Destination(Destination {
            room: RoomId::new(1).unwrap(),
            pages: (0..2000).map(PageIndex).collect(),
            aux_slot: AuxSlot(0),
            required_destinations: 1,
            prefix_tokens: None,
        });
        let mut out = vec![1, 2, 3];
        let err = encode_frame(
            &m,
            PROTOCOL_VERSION,
            Capabilities::ALL,
            MIN_MAX_FRAME_LEN,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(
            err,
            CodecError::Oversize {
                max: MIN_MAX_FRAME_LEN,
                ..
            }
        ));
        assert_eq!(out, vec![1, 2, 3]);
    }
}
