//! Capability bits negotiated per connection.

use std::fmt;

/// Capability bits negotiated per connection (intersection of both ends).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities(u64);

impl Default for Capabilities {
    /// None: a connection not yet negotiated can do nothing optional.
    fn default() -> Self {
        Capabilities::NONE
    }
}

impl Capabilities {
    /// No capability.
    pub const NONE: Capabilities = Capabilities(0);
    /// `Status::Failed` and `Abort` carry an HTTP status and `Abort` its origin
    /// (protocol 2).
    pub const FAILURE_DETAIL: Capabilities = Capabilities(1 << 0);
    /// `Destination` carries the decode prefix-hit length (protocol 2).
    pub const DESTINATION_PREFIX: Capabilities = Capabilities(1 << 1);
    /// The end has a shared secret and runs challenge-response (protocol 1).
    pub const AUTH: Capabilities = Capabilities(1 << 2);
    /// A `Status(Failed)` carries a rejection's API code ([`crate::RejectCode`]).
    pub const REJECT_CODE: Capabilities = Capabilities(1 << 3);
    /// The prefill sends the first position's most likely tokens as
    /// data-link `AuxTop` records ahead of the aux record, for requests
    /// that ask for top logprobs.
    pub const AUX_TOP: Capabilities = Capabilities(1 << 4);
    /// Everything protocol 1 knew.
    pub const V1: Capabilities = Capabilities::AUTH;
    /// Everything this build knows.
    pub const ALL: Capabilities = Capabilities(0b1_1111);

    /// From raw bits; unknown bits are kept (and then lost in intersection).
    pub const fn from_bits(bits: u64) -> Self {
        Capabilities(bits)
    }

    /// Raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits set in both.
    pub const fn intersect(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }

    /// Bits set in either.
    pub const fn union(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// `self` without the bits of `other`.
    pub const fn without(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & !other.0)
    }
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (bit, name) in [
            (Capabilities::FAILURE_DETAIL, "FAILURE_DETAIL"),
            (Capabilities::DESTINATION_PREFIX, "DESTINATION_PREFIX"),
            (Capabilities::AUTH, "AUTH"),
            (Capabilities::REJECT_CODE, "REJECT_CODE"),
            (Capabilities::AUX_TOP, "AUX_TOP"),
        ] {
            if self.contains(bit) {
                names.push(name);
            }
        }
        let unknown = self.0 & !Capabilities::ALL.0;
        if unknown != 0 {
            return write!(f, "Capabilities({} | {unknown:#x})", names.join(" | "));
        }
        write!(f, "Capabilities({})", names.join(" | "))
    }
}
