//! Fuzz the streaming frame decoder: arbitrary bytes, any chunking, under
//! both capability sets; every decoded message must re-encode identically.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = handoff_proto::fuzz::decode_frames(data);
});
