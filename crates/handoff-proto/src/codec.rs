//! Hand-written binary primitives of the wire format.
//!
//! Little endian integers; strings and lists are prefixed by their length.
//! [`Reader`] checks every length against the bytes actually left before it
//! allocates anything, so a hostile length prefix cannot make us reserve
//! memory, and every shortfall is a [`CodecError::Truncated`].

use crate::error::CodecError;

/// Longest string field accepted (reasons, model ids).
pub const MAX_STRING_LEN: usize = 4096;

/// Appends encoded fields to a byte buffer.
#[derive(Debug)]
pub struct Writer<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    /// A writer appending to `buf`.
    pub fn new(buf: &'a mut Vec<u8>) -> Self {
        Self { buf }
    }

    /// Append a byte.
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    /// Append a little-endian `u16`.
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Append a little-endian `u32`.
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Append a little-endian `u64`.
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Append raw bytes with no prefix (fixed-size fields).
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Append a `u16` length then the bytes. Longer input is cut at
    /// `u16::MAX` bytes (callers keep strings under [`MAX_STRING_LEN`]).
    pub fn bytes16(&mut self, bytes: &[u8]) {
        let len = bytes.len().min(u16::MAX as usize);
        self.u16(len as u16);
        self.raw(&bytes[..len]);
    }

    /// Append a string as `u16` length + UTF-8 bytes, cut to at most
    /// [`MAX_STRING_LEN`] bytes on a character boundary.
    pub fn string(&mut self, s: &str) {
        let mut end = s.len().min(MAX_STRING_LEN);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.bytes16(&s.as_bytes()[..end]);
    }

    /// Append a list of `u32` as `u32` count + items.
    pub fn u32_list(&mut self, items: impl ExactSizeIterator<Item = u32>) {
        self.u32(items.len() as u32);
        for v in items {
            self.u32(v);
        }
    }
}

/// Reads fields from a payload, never past its end.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Take `n` raw bytes.
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], CodecError> {
        if self.buf.len() < n {
            return Err(CodecError::Truncated {
                what,
                needed: n,
                remaining: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], CodecError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    /// Read a byte.
    pub fn u8(&mut self, what: &'static str) -> Result<u8, CodecError> {
        Ok(self.array::<1>(what)?[0])
    }

    /// Read a little-endian `u16`.
    pub fn u16(&mut self, what: &'static str) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    /// Read a little-endian `u32`.
    pub fn u32(&mut self, what: &'static str) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// Read a little-endian `u64`.
    pub fn u64(&mut self, what: &'static str) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Read a fixed-size byte array.
    pub fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], CodecError> {
        self.array(what)
    }

    /// Read a `u16`-prefixed byte string of at most `max` bytes.
    pub fn bytes16(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], CodecError> {
        let len = self.u16(what)? as usize;
        if len > max {
            return Err(CodecError::TooLong {
                field: what,
                len,
                max,
            });
        }
        self.take(len, what)
    }

    /// Read a `u16`-prefixed UTF-8 string of at most [`MAX_STRING_LEN`] bytes.
    pub fn string(&mut self, what: &'static str) -> Result<String, CodecError> {
        let bytes = self.bytes16(what, MAX_STRING_LEN)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| CodecError::InvalidUtf8 { field: what })
    }

    /// Read a `u32`-counted list of `u32` of at most `max` items. The count is
    /// checked against the bytes left before anything is allocated.
    pub fn u32_list(&mut self, what: &'static str, max: usize) -> Result<Vec<u32>, CodecError> {
        let count = self.u32(what)? as usize;
        if count > max {
            return Err(CodecError::TooLong {
                field: what,
                len: count,
                max,
            });
        }
        let needed = count.saturating_mul(4);
        if needed > self.buf.len() {
            return Err(CodecError::Truncated {
                what,
                needed,
                remaining: self.buf.len(),
            });
        }
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            out.push(self.u32(what)?);
        }
        Ok(out)
    }

    /// Fail with [`CodecError::TrailingBytes`] unless everything was read.
    pub fn finish(&self, kind: &'static str) -> Result<(), CodecError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(CodecError::TrailingBytes {
                count: self.buf.len(),
                kind,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_little_endian() {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        w.u16(0x0102);
        w.u32(0x0304_0506);
        w.u64(7);
        assert_eq!(&buf[..6], &[0x02, 0x01, 0x06, 0x05, 0x04, 0x03]);
        let mut r = Reader::new(&buf);
        assert_eq!(r.u16("a"), Ok(0x0102));
        assert_eq!(r.u32("b"), Ok(0x0304_0506));
        assert_eq!(r.u64("c"), Ok(7));
        assert_eq!(r.finish("t"), Ok(()));
    }

    #[test]
    fn hostile_list_count_is_rejected_before_allocating() {
        let mut buf = Vec::new();
        Writer::new(&mut buf).u32(u32::MAX);
        let err = Reader::new(&buf).u32_list("pages", usize::MAX).unwrap_err();
        assert!(
            matches!(
                err,
                CodecError::Truncated {
                    what: "pages",
                    remaining: 0,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = Reader::new(&buf).u32_list("pages", 10).unwrap_err();
        assert_eq!(
            err,
            CodecError::TooLong {
                field: "pages",
                len: u32::MAX as usize,
                max: 10
            }
        );
    }

    #[test]
    fn strings_are_checked() {
        let mut buf = Vec::new();
        Writer::new(&mut buf).bytes16(&[0xff, 0xfe]);
        assert_eq!(
            Reader::new(&buf).string("reason"),
            Err(CodecError::InvalidUtf8 { field: "reason" })
        );
        let long = "é".repeat(MAX_STRING_LEN);
        let mut buf = Vec::new();
        Writer::new(&mut buf).string(&long);
        let s = Reader::new(&buf).string("reason").unwrap();
        assert!(s.len() <= MAX_STRING_LEN && long.starts_with(&s));
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let r = Reader::new(&[1, 2]);
        assert_eq!(
            r.finish("Heartbeat"),
            Err(CodecError::TrailingBytes {
                count: 2,
                kind: "Heartbeat"
            })
        );
    }
}
