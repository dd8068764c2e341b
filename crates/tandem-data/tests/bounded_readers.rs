//! Every reader that inflates data stops at what its format can legitimately hold, before
//! it holds more: CIFAR-10 batch files and archive members (30,730,000 bytes at most), the
//! archive's whole inflated stream, python batches (10,000 rows), and images (their size
//! is read from the header before any pixel is decoded).

mod common;

use std::path::{Path, PathBuf};

use common::PyBatch;
use tandem_data::{load_dataset, read_image, read_image_resized, DataSource, Split};
use tandem_testdata::archive::tar_gz;

/// The largest CIFAR-10 batch: 10,000 records of 3,073 bytes.
const MAX_BATCH_BYTES: u64 = 30_730_000;

fn error_text<T: std::fmt::Debug>(result: Result<T, tandem_data::DataError>) -> String {
    result.expect_err("expected a refusal").to_string()
}

/// Loading the test split of `source` fails, naming `path` then `problem`.
fn assert_test_split_refused(source: DataSource, path: &Path, problem: &str) {
    assert_eq!(
        error_text(load_dataset(&source, Split::Test)),
        format!("{}: {problem}", path.display())
    );
}

/// A file of `len` bytes that takes no room (sparse): reading it would cost `len` bytes
/// of memory, refusing it by its size costs none.
fn sparse_file(path: &Path, len: u64) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("folder");
    let file = std::fs::File::create(path).expect("file");
    file.set_len(len).expect("set_len");
}

#[test]
fn binary_and_python_batches_longer_than_any_cifar_batch_are_refused_by_their_size() {
    let dir = tempfile::tempdir().expect("temp dir");
    let binary = MAX_BATCH_BYTES + 3073;
    let python = 40_000_000;
    let cases = [
        (
            DataSource::Cifar10Bin {
                dir: dir.path().into(),
            },
            dir.path().join("test_batch.bin"),
            binary,
            format!("{binary} bytes, more than a CIFAR-10 batch holds (at most 30730000 bytes: 10000 records of 3073)"),
        ),
        (
            DataSource::Cifar10Py {
                dir: dir.path().into(),
            },
            python_test_batch(dir.path()),
            python,
            format!(
                "{python} bytes, more than this CIFAR-10 python file can hold (at most 32817152 bytes)"
            ),
        ),
    ];
    for (source, path, len, problem) in cases {
        sparse_file(&path, len);
        assert_test_split_refused(source, &path, &problem);
    }
}

#[test]
fn an_archive_member_longer_than_a_batch_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let archive = dir.path().join("cifar-10-binary.tar.gz");
    let len = MAX_BATCH_BYTES + 3073;
    tar_gz(&archive, &[("cifar-10-batches-bin/test_batch.bin", len, 0)]);
    let source = DataSource::Cifar10Bin {
        dir: archive.clone(),
    };
    assert_test_split_refused(
        source,
        &archive.join("cifar-10-batches-bin/test_batch.bin"),
        &format!("{len} bytes, more than a CIFAR-10 batch holds (at most 30730000 bytes: 10000 records of 3073)"),
    );
}

#[test]
fn an_archive_inflating_beyond_cifar_10_is_refused_even_in_members_it_skips() {
    let dir = tempfile::tempdir().expect("temp dir");
    let archive = dir.path().join("cifar-10-binary.tar.gz");
    // Seven members the test split does not read, each a legal batch size: 215 MB inflated.
    let names: Vec<String> = (1..=7)
        .map(|batch| format!("cifar-10-batches-bin/extra_{batch}.bin"))
        .collect();
    let members: Vec<(&str, u64, u8)> = names
        .iter()
        .map(|name| (name.as_str(), MAX_BATCH_BYTES, 0))
        .chain([("cifar-10-batches-bin/test_batch.bin", 3073, 0)])
        .collect();
    tar_gz(&archive, &members);
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin { dir: archive },
        Split::Test,
    ));
    assert!(
        error.contains("inflates to more than 192768608 bytes, more than CIFAR-10's archive holds"),
        "{error}"
    );
}

fn python_test_batch(dir: &Path) -> PathBuf {
    dir.join("cifar-10-batches-py/test_batch")
}

#[test]
fn a_python_batch_of_more_than_ten_thousand_rows_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = python_test_batch(dir.path());
    std::fs::create_dir_all(path.parent().expect("parent")).expect("folder");
    std::fs::write(&path, PyBatch::valid(10_001).to_pickle()).expect("batch");
    let source = DataSource::Cifar10Py {
        dir: dir.path().into(),
    };
    assert_test_split_refused(
        source,
        &path,
        "field 'data' has 10001 rows, more than a CIFAR-10 batch holds (10000)",
    );
}

/// A PNG that declares `width` x `height` RGB pixels but carries almost none: a reader that
/// decoded before checking the size would fail on the missing data, not on the size.
fn png_header_only(path: &Path, width: u32, height: u32) {
    let png = tandem_testdata::png::rgb_png(width, height, &[0x78, 0x9c]);
    std::fs::write(path, png).expect("png");
}

#[test]
fn image_sizes_are_checked_from_the_header_before_decoding() {
    let dir = tempfile::tempdir().expect("temp dir");
    let giant = dir.path().join("giant.png");
    png_header_only(&giant, 13_000, 13_000);
    assert_eq!(
        error_text(read_image(&giant)),
        format!(
            "{}: image is 13000x13000 (width x height), expected 32x32 RGB",
            giant.display()
        )
    );
    assert_eq!(
        error_text(read_image_resized(&giant, 32, 32)),
        format!(
            "{}: image is 13000x13000 (width x height), more than the 4096x4096 this reader resizes",
            giant.display()
        )
    );
}
