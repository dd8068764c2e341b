//! Every reader that inflates data stops at what its format can legitimately hold, before
//! it holds more: CIFAR-10 batch files and archive members (30,730,000 bytes at most), the
//! archive's whole inflated stream, python batches (10,000 rows), and images (their size
//! is read from the header before any pixel is decoded).

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use common::PyBatch;
use tandem_data::{load_dataset, read_image, read_image_resized, DataSource, Split};

/// The largest CIFAR-10 batch: 10,000 records of 3,073 bytes.
const MAX_BATCH_BYTES: u64 = 30_730_000;

fn error_text<T: std::fmt::Debug>(result: Result<T, tandem_data::DataError>) -> String {
    result.expect_err("expected a refusal").to_string()
}

/// A file of `len` bytes that takes no room (sparse): reading it would cost `len` bytes
/// of memory, refusing it by its size costs none.
fn sparse_file(path: &Path, len: u64) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("folder");
    let file = std::fs::File::create(path).expect("file");
    file.set_len(len).expect("set_len");
}

#[test]
fn a_binary_batch_longer_than_any_cifar_batch_is_refused_by_its_size() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("test_batch.bin");
    let len = MAX_BATCH_BYTES + 3073;
    sparse_file(&path, len);
    let source = DataSource::Cifar10Bin {
        dir: dir.path().into(),
    };
    assert_eq!(
        error_text(load_dataset(&source, Split::Test)),
        format!(
            "{}: {len} bytes, more than a CIFAR-10 batch holds (at most 30730000 bytes: 10000 records of 3073)",
            path.display()
        )
    );
}

/// A `.tar.gz` holding `members` (name, length of zeros), compressed as it is written.
fn tar_gz(path: &Path, members: &[(&str, u64)]) {
    let encoder = flate2::write::GzEncoder::new(
        std::fs::File::create(path).expect("archive"),
        flate2::Compression::fast(),
    );
    let mut builder = tar::Builder::new(encoder);
    for &(name, len) in members {
        let mut header = tar::Header::new_gnu();
        header.set_size(len);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, std::io::repeat(0).take(len))
            .expect("member");
    }
    builder
        .into_inner()
        .expect("tar")
        .finish()
        .expect("gzip")
        .flush()
        .expect("flush");
}

#[test]
fn an_archive_member_longer_than_a_batch_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let archive = dir.path().join("cifar-10-binary.tar.gz");
    let len = MAX_BATCH_BYTES + 3073;
    tar_gz(&archive, &[("cifar-10-batches-bin/test_batch.bin", len)]);
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin {
            dir: archive.clone(),
        },
        Split::Test,
    ));
    assert_eq!(
        error,
        format!(
            "{}: {len} bytes, more than a CIFAR-10 batch holds (at most 30730000 bytes: 10000 records of 3073)",
            archive.join("cifar-10-batches-bin/test_batch.bin").display()
        )
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
    let members: Vec<(&str, u64)> = names
        .iter()
        .map(|name| (name.as_str(), MAX_BATCH_BYTES))
        .chain([("cifar-10-batches-bin/test_batch.bin", 3073)])
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
fn a_python_batch_longer_than_any_cifar_batch_is_refused_by_its_size() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = python_test_batch(dir.path());
    let len = 40_000_000;
    sparse_file(&path, len);
    let source = DataSource::Cifar10Py {
        dir: dir.path().into(),
    };
    assert_eq!(
        error_text(load_dataset(&source, Split::Test)),
        format!(
            "{}: {len} bytes, more than this CIFAR-10 python file can hold (at most 32817152 bytes)",
            path.display()
        )
    );
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
    assert_eq!(
        error_text(load_dataset(&source, Split::Test)),
        format!(
            "{}: field 'data' has 10001 rows, more than a CIFAR-10 batch holds (10000)",
            path.display()
        )
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
