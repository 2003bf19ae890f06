//! Fuzz the data-link decoders (records, acks, stream setups, the preface)
//! and the verification of a router's bootstrap signature.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = handoff_proto::fuzz::data_link(data);
});
