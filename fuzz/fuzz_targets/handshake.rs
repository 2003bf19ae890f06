//! Fuzz the connection handshake of both roles, with and without a shared
//! secret, fed with the frames decoded from the input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = handoff_proto::fuzz::handshake(data);
});
