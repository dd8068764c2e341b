//! A plain mutation-fuzzing loop over the annotation-JSON reader, for machines without
//! cargo-fuzz (outside CI: ignored). Run with
//! `cargo test --release -p tandem-data --test fuzz_loop -- --ignored --nocapture`;
//! `TANDEM_FUZZ_SECONDS` sets the duration (default 60).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_data::parse_annotations;

#[test]
#[ignore = "fuzzing loop, run by hand"]
fn mutated_annotation_files_never_panic() {
    tandem_testdata::skip_without_shared!();
    let seed = std::fs::read(tandem_testdata::shared_path(
        "data/cifar10/json-subset/annotations/cifar10_test.json",
    ))
    .unwrap();
    let seconds: u64 = std::env::var("TANDEM_FUZZ_SECONDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(60);
    let tokens: [&[u8]; 10] = [
        b"{",
        b"}",
        b"[",
        b"]",
        b"\"",
        b",",
        b"-1",
        b"1e400",
        b"null",
        b"\"images\"",
    ];
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound.max(1) as u64) as usize
    };
    let (mut runs, mut parsed) = (0usize, 0usize);
    while Instant::now() < deadline {
        let mut input = seed.clone();
        for _ in 0..1 + next(4) {
            let at = next(input.len() + 1);
            match next(4) {
                0 => input.truncate(at),
                1 => {
                    let end = (at + next(40)).min(input.len());
                    input.drain(at..end);
                }
                2 => {
                    let token = tokens[next(tokens.len())];
                    input.splice(at..at, token.iter().copied());
                }
                _ => {
                    if let Some(byte) = input.get_mut(at) {
                        *byte ^= 1 << next(8);
                    }
                }
            }
        }
        if let Ok(text) = std::str::from_utf8(&input) {
            parsed += usize::from(parse_annotations(Path::new("fuzz.json"), text).is_ok());
        }
        runs += 1;
    }
    println!("fuzz loop: {runs} mutated annotation files ({parsed} still parsed), {seconds} s, no panics");
}
