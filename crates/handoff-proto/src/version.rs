//! Protocol versions and frame size limits (leaf constants every layer of
//! the wire reads).

/// The protocol version this build prefers.
pub const PROTOCOL_VERSION: u8 = 2;
/// The oldest protocol version this build still speaks (N-1).
pub const PROTOCOL_VERSION_MIN: u8 = 1;
/// Version put in the header of handshake frames, which every version parses.
pub const HANDSHAKE_FRAME_VERSION: u8 = PROTOCOL_VERSION_MIN;
/// Default largest payload accepted (1 MiB: a quarter of a million pages).
pub const DEFAULT_MAX_FRAME_LEN: u32 = 1 << 20;
/// No end may announce a smaller limit than this.
pub const MIN_MAX_FRAME_LEN: u32 = 4096;
