//! Runs the cargo-fuzz target bodies (`handoff_proto::fuzz`) as ordinary
//! tests: over the committed corpus in `fuzz/corpus/<target>/`, over random
//! mutations of it, and over random bytes; the coverage-guided runs are
//! `scripts/fuzz-smoke.sh`. Also checks the committed corpus matches the
//! seeds the crate generates; regenerate it with
//! `HANDOFF_WRITE_CORPUS=1 cargo test -p handoff-proto --test fuzz_corpus`.

use std::fs;
use std::path::PathBuf;

use handoff_proto::fuzz::{
    data_link, data_link_seeds, decode_frames, frame_decoder_seeds, handshake, handshake_seeds,
    placement_holds,
};
use proptest::prelude::*;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

fn read_corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(corpus_dir(target))
        .unwrap_or_else(|e| panic!("corpus for {target}: {e}"))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

fn check_seeds(target: &str, seeds: Vec<(&'static str, Vec<u8>)>) {
    let dir = corpus_dir(target);
    if std::env::var_os("HANDOFF_WRITE_CORPUS").is_some() {
        fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in &seeds {
            fs::write(dir.join(format!("{name}.bin")), bytes).unwrap();
        }
    }
    for (name, bytes) in seeds {
        let path = dir.join(format!("{name}.bin"));
        let on_disk = fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (regenerate the corpus)", path.display()));
        assert_eq!(
            on_disk,
            bytes,
            "{} is stale (regenerate the corpus)",
            path.display()
        );
    }
}

#[test]
fn committed_corpus_matches_the_seeds() {
    check_seeds("frame_decoder", frame_decoder_seeds());
    check_seeds("handshake", handshake_seeds());
    check_seeds("data_link", data_link_seeds());
}

#[test]
fn data_link_corpus() {
    let files = read_corpus("data_link");
    assert!(files.len() >= 9, "{} files", files.len());
    for (name, bytes) in files {
        let n = data_link(&bytes);
        // Each valid piece decodes (a record's bytes may also read as an
        // ack or a preface); three records in a row decode as three.
        match name.as_str() {
            "garbage.bin" => assert_eq!(n, 0, "{name}"),
            "records_in_a_row.bin" => assert!(n >= 3, "{name}: {n}"),
            _ => assert!(n >= 1, "{name} decoded nothing"),
        }
    }
    // The placed seeds are placed (and the check of where is what runs).
    for (name, bytes) in data_link_seeds() {
        if name.starts_with("placed_") {
            let b: &[u8; 32] = bytes[..32].try_into().unwrap();
            let Ok(handoff_proto::datalink::Record::Segment(h)) =
                handoff_proto::datalink::Record::decode(b)
            else {
                panic!("{name} is not a segment")
            };
            assert!(placement_holds(&h, &bytes), "{name} was not placed");
        }
    }
    // The signed claim verifies (counted), and one flipped byte of it does not.
    let mut seeds = data_link_seeds();
    let (_, claim) = seeds
        .iter_mut()
        .find(|(n, _)| *n == "signed_claim")
        .unwrap();
    let verified = data_link(claim);
    let last = claim.len() - 1;
    claim[last] ^= 1;
    assert_eq!(data_link(claim), verified - 1);
}

#[test]
fn frame_decoder_corpus() {
    let files = read_corpus("frame_decoder");
    assert!(files.len() >= 12, "{} files", files.len());
    for (name, bytes) in files {
        let n = decode_frames(&bytes);
        if name == "valid_stream_all_kinds.bin" {
            // Eight kinds, decoded under two capability sets... the v1 pass
            // sees v2-only fields as trailing bytes where they exist.
            assert!(n >= 8 + 4, "{name}: {n}");
        } else if name.starts_with("valid_") {
            assert!(n >= 1, "{name} decoded nothing");
        } else if name == "garbage_then_heartbeat.bin" {
            assert_eq!(
                n, 2,
                "{name}: the heartbeat survives the garbage in both passes"
            );
        } else {
            assert_eq!(n, 0, "{name} must not decode");
        }
    }
}

#[test]
fn handshake_corpus() {
    let files = read_corpus("handshake");
    assert!(files.len() >= 5);
    for (name, bytes) in files {
        let done = handshake(&bytes);
        let expected = match name.as_str() {
            // The prefill end (nonce [1; 32]) completes without a secret.
            "decode_register_plain.bin" => 1,
            // ... and with the secret, given a correct proof.
            "decode_register_with_proof.bin" => 1,
            "prefill_register_plain.bin" => 1,
            // The decode end completes only once prefill proves itself.
            "prefill_register_with_proof.bin" => 1,
            "decode_register_page_size_64.bin" => 0,
            // Authenticated, then incompatible: fails after prefill's proof.
            "decode_register_with_proof_page_size_64.bin" => 0,
            other => panic!("unexpected corpus file {other}"),
        };
        assert_eq!(done, expected, "{name}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_frames(&data);
        handshake(&data);
        data_link(&data);
    }

    #[test]
    fn mutated_corpus(pick in any::<prop::sample::Index>(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4), cut in any::<prop::sample::Index>()) {
        let mut seeds = frame_decoder_seeds();
        seeds.extend(handshake_seeds());
        seeds.extend(data_link_seeds());
        let (_, mut bytes) = seeds.swap_remove(pick.index(seeds.len()));
        for (at, b) in flips {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep.max(bytes.len() / 2));
        decode_frames(&bytes);
        handshake(&bytes);
        data_link(&bytes);
    }
}
