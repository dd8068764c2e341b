//! A plain mutation-fuzzing loop for machines without cargo-fuzz (outside CI: ignored).
//! Run with `cargo test --release -p tandem-pickle --test fuzz_loop -- --ignored --nocapture`;
//! `TANDEM_FUZZ_SECONDS` sets the duration (default 60). Real pickles and a real torch.save
//! archive are mutated (bit flips, length fields overwritten, ranges cut, duplicated or
//! spliced); every input must end in a value or an error. An input that panics is written
//! to `fuzz-crash-<n>.bin` in the temporary folder before the test fails.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_pickle::{loads, ndarray_from_value, read_torch_state_dict_from_bytes};

use tandem_testdata::shared_path as shared_file;

/// xorshift64*: the mutation choices only need to be cheap and reproducible.
struct Mutator(u64);

impl Mutator {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound.max(1) as u64) as usize
    }

    /// Applies one to four random mutations.
    fn mutate(&mut self, input: &mut Vec<u8>, other: &[u8]) {
        for _ in 0..1 + self.below(4) {
            let len = input.len().max(1);
            let at = self.below(len);
            match self.below(7) {
                0 => {
                    if let Some(byte) = input.get_mut(at) {
                        *byte ^= 1 << self.below(8);
                    }
                }
                1 => {
                    let interesting = [0x00, 0xff, 0x7f, 0x80, 0x01, b'(', b'.', b'q', b'h'];
                    if let Some(byte) = input.get_mut(at) {
                        *byte = interesting[self.below(interesting.len())];
                    }
                }
                2 => {
                    let word = match self.below(3) {
                        0 => u32::MAX,
                        1 => 0x7fff_ffff,
                        _ => self.next() as u32,
                    };
                    for (offset, byte) in word.to_le_bytes().into_iter().enumerate() {
                        if let Some(slot) = input.get_mut(at + offset) {
                            *slot = byte;
                        }
                    }
                }
                3 => input.truncate(at),
                4 => {
                    let end = (at + self.below(64)).min(input.len());
                    input.drain(at.min(end)..end);
                }
                5 => {
                    let end = (at + self.below(64)).min(input.len());
                    let copy: Vec<u8> = input[at.min(end)..end].to_vec();
                    let insert_at = self.below(input.len() + 1);
                    input.splice(insert_at..insert_at, copy);
                }
                _ => {
                    let start = self.below(other.len());
                    let end = (start + self.below(128)).min(other.len());
                    let insert_at = self.below(input.len() + 1);
                    input.splice(insert_at..insert_at, other[start..end].iter().copied());
                }
            }
        }
    }
}

fn seconds() -> u64 {
    std::env::var("TANDEM_FUZZ_SECONDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(60)
}

fn run_guarded(input: &[u8], index: usize, target: fn(&[u8])) {
    let outcome = std::panic::catch_unwind(|| target(input));
    if outcome.is_err() {
        let path = std::env::temp_dir().join(format!("fuzz-crash-{index}.bin"));
        std::fs::write(&path, input).unwrap();
        panic!("input {index} panicked; saved to {}", path.display());
    }
}

fn pickle_target(input: &[u8]) {
    if let Ok(value) = loads(input) {
        let _ = ndarray_from_value(&value);
        if let Some(data) = value.get("data") {
            let _ = ndarray_from_value(data);
        }
    }
}

fn torch_target(input: &[u8]) {
    let _ = read_torch_state_dict_from_bytes(input, Path::new("fuzz.pt"));
}

#[test]
#[ignore = "fuzzing loop, run by hand"]
fn mutated_pickles_and_archives_never_panic() {
    tandem_testdata::skip_without_shared!();
    let snapshot = std::fs::read(shared_file("golden/pytorch-checkpoints/snapshot.pt")).unwrap();
    let meta = std::fs::read(shared_file(
        "data/cifar10/py-mini/cifar-10-batches-py/batches.meta",
    ))
    .unwrap();
    let batch = std::fs::read(shared_file(
        "data/cifar10/py-mini/cifar-10-batches-py/data_batch_1",
    ))
    .unwrap();
    // The head of a real batch up to the array data, then the end of the batch.
    let numpy_head = [&batch[..1220], &[b'.'][..]].concat();
    let data_pkl_start = snapshot
        .windows(8)
        .position(|window| window == b"data.pkl")
        .unwrap()
        + 8
        + 20;
    let data_pkl = snapshot[data_pkl_start..data_pkl_start + 4000].to_vec();
    let pickle_seeds = [meta, numpy_head, data_pkl];

    let deadline = Instant::now() + Duration::from_secs(seconds());
    let mut mutator = Mutator(0x9e37_79b9_7f4a_7c15);
    let (mut pickles, mut archives, mut loaded) = (0usize, 0usize, 0usize);
    while Instant::now() < deadline {
        let index = pickles + archives;
        if index % 50 == 49 {
            let mut input = snapshot.clone();
            mutator.mutate(&mut input, &pickle_seeds[2]);
            run_guarded(&input, index, torch_target);
            archives += 1;
        } else {
            let seed = &pickle_seeds[mutator.below(pickle_seeds.len())];
            let mut input = seed.clone();
            let donor = &pickle_seeds[mutator.below(pickle_seeds.len())];
            mutator.mutate(&mut input, donor);
            run_guarded(&input, index, pickle_target);
            loaded += usize::from(loads(&input).is_ok());
            pickles += 1;
        }
    }
    println!(
        "fuzz loop: {pickles} mutated pickles ({loaded} still loaded), {archives} mutated archives, {} s, no panics",
        seconds()
    );
}
