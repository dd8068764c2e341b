//! Every kind of bad input ends in an error that names the file (and record or field) and
//! what was expected: never a panic, never a silent skip.

mod common;

use std::path::Path;

use common::{hwc_to_planes, PyBatch};
use tandem_data::{load_dataset, read_image, read_image_resized, DataError, DataSource, Split};

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn error_text(result: Result<impl std::fmt::Debug, DataError>) -> String {
    result.unwrap_err().to_string()
}

/// A binary-layout folder whose test batch holds the given records.
fn binary_folder_with_test_batch(bytes: &[u8]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cifar-10-batches-bin/test_batch.bin");
    write(&path, bytes);
    (dir, path.display().to_string())
}

#[test]
fn binary_batch_whose_size_is_not_a_multiple_of_the_record() {
    let (dir, path) = binary_folder_with_test_batch(&vec![0u8; 3073 * 2 + 100]);
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin {
            dir: dir.path().into(),
        },
        Split::Test,
    ));
    assert_eq!(
        error,
        format!("{path}: size 6246 bytes is not a multiple of the 3073-byte record (1 label byte + 3,072 pixel bytes)")
    );
}

#[test]
fn binary_label_byte_above_nine() {
    let mut records = vec![0u8; 3073 * 3];
    records[3073] = 10;
    let (dir, path) = binary_folder_with_test_batch(&records);
    let source = DataSource::Cifar10Bin {
        dir: dir.path().join("cifar-10-batches-bin"),
    };
    let error = error_text(load_dataset(&source, Split::Test));
    assert_eq!(
        error,
        format!("{path}: record 1: label byte 10, expected 0..=9")
    );
}

#[test]
fn binary_folder_reads_any_record_count_and_finds_the_batches_folder() {
    let dir = tempfile::tempdir().unwrap();
    let mut expected_labels = Vec::new();
    let mut expected_pixels = Vec::new();
    for batch in 1..=5 {
        let mut records = Vec::new();
        for record in 0..batch {
            let label = ((batch + record) % 10) as u8;
            let hwc: Vec<u8> = (0..3072)
                .map(|value| ((value * batch + record) % 256) as u8)
                .collect();
            records.push(label);
            records.extend_from_slice(&hwc_to_planes(&hwc));
            expected_labels.push(u32::from(label));
            expected_pixels.extend_from_slice(&hwc);
        }
        write(
            &dir.path()
                .join(format!("cifar-10-batches-bin/data_batch_{batch}.bin")),
            &records,
        );
    }
    for dir in [
        dir.path().to_path_buf(),
        dir.path().join("cifar-10-batches-bin"),
    ] {
        let train = load_dataset(&DataSource::Cifar10Bin { dir }, Split::Train).unwrap();
        assert_eq!(train.labels, expected_labels);
        assert_eq!(
            train.images,
            tandem_data::Pixels::U8(expected_pixels.clone())
        );
    }
}

#[test]
fn binary_data_that_is_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin {
            dir: dir.path().into(),
        },
        Split::Train,
    ));
    assert!(
        error.starts_with(&format!(
            "{}: no CIFAR-10 binary data: expected data_batch_1.bin here",
            dir.path().display()
        )),
        "{error}"
    );
}

#[test]
fn corrupt_and_truncated_archives() {
    tandem_testdata::skip_without_shared!();
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("cifar-10-binary.tar.gz");
    write(&garbage, b"this is not gzip data at all");
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin {
            dir: dir.path().into(),
        },
        Split::Test,
    ));
    assert!(
        error.starts_with(&format!("{}: ", garbage.display())),
        "{error}"
    );

    // The first megabyte of the real archive: valid gzip, cut off inside the first member.
    let real = std::fs::read(tandem_testdata::shared_path(
        "data/cifar10/cifar-10-batches-bin.tar.gz",
    ))
    .unwrap();
    let cut = dir.path().join("cut/cifar-10-batches-bin.tar.gz");
    write(&cut, &real[..1 << 20]);
    let error = error_text(load_dataset(
        &DataSource::Cifar10Bin { dir: cut.clone() },
        Split::Test,
    ));
    assert!(
        error.starts_with(&format!("{}: damaged", cut.display())),
        "{error}"
    );
}

#[test]
fn archive_lacking_a_member() {
    let dir = tempfile::tempdir().unwrap();
    let archive_path = dir.path().join("cifar-10-binary.tar.gz");
    let record = ("cifar-10-batches-bin/data_batch_1.bin", 3073, 3);
    tandem_testdata::archive::tar_gz(&archive_path, &[record]);
    let source = DataSource::Cifar10Bin {
        dir: dir.path().into(),
    };
    let error = error_text(load_dataset(&source, Split::Train));
    assert_eq!(
        error,
        format!(
            "{}: archive lacks the member cifar-10-batches-bin/data_batch_2.bin",
            archive_path.display()
        )
    );
    let error = error_text(load_dataset(&source, Split::Test));
    assert!(
        error.ends_with("archive lacks the member cifar-10-batches-bin/test_batch.bin"),
        "{error}"
    );
}

/// A python-layout folder with a test batch.
fn python_folder(batch: &[u8]) -> (tempfile::TempDir, String, DataSource) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cifar-10-batches-py/test_batch");
    write(&path, batch);
    let source = DataSource::Cifar10Py {
        dir: dir.path().into(),
    };
    (dir, path.display().to_string(), source)
}

#[test]
fn python_batch_with_any_row_count_loads() {
    let batch = PyBatch::valid(7);
    let (_dir, _, source) = python_folder(&batch.to_pickle());
    let test = load_dataset(&source, Split::Test).unwrap();
    assert_eq!(test.len(), 7);
    assert_eq!(test.labels, vec![0, 1, 2, 3, 4, 5, 6]);
    let tandem_data::Pixels::U8(pixels) = &test.images else {
        panic!("bytes expected")
    };
    assert_eq!(hwc_to_planes(&pixels[3072..6144]), batch.pixels[3072..6144]);
}

#[test]
fn python_batch_truncated() {
    let pickle = PyBatch::valid(2).to_pickle();
    let (_dir, path, source) = python_folder(&pickle[..pickle.len() - 10]);
    let error = error_text(load_dataset(&source, Split::Test));
    assert!(
        error.starts_with(&format!(
            "{path}: pickle truncated at byte {}",
            pickle.len() - 10
        )),
        "{error}"
    );
}

#[test]
fn python_batches_with_a_wrong_key_dtype_row_size_or_labels_are_refused() {
    let valid = || PyBatch::valid(2);
    let cases = [
        (
            PyBatch {
                data_key: "pixels",
                ..valid()
            },
            "missing key 'data' (found keys: bytes of length 6, bytes of length 6)",
        ),
        (
            PyBatch {
                dtype: "f4",
                pixels: vec![0; 2 * 3072 * 4],
                ..valid()
            },
            "field 'data' has dtype f4, expected u1 (uint8)",
        ),
        (
            PyBatch {
                row_len: 3000,
                pixels: vec![0; 2 * 3000],
                ..valid()
            },
            "field 'data' has rows of 3000 values, expected 3072 (3 x 32 x 32)",
        ),
        (
            PyBatch {
                labels: vec![1, 2, 3],
                ..valid()
            },
            "field 'labels' has 3 entries, expected 2 (one per row of 'data')",
        ),
        (
            PyBatch {
                labels: vec![1, 12],
                ..valid()
            },
            "field 'labels' entry 1 is int 12, expected an int in 0..=9",
        ),
    ];
    for (batch, problem) in cases {
        let (_dir, path, source) = python_folder(&batch.to_pickle());
        let error = error_text(load_dataset(&source, Split::Test));
        assert_eq!(error, format!("{path}: {problem}"));
    }
}

/// A JSON-layout folder with the given test annotations and images.
fn json_folder(
    annotations: &str,
    images: &[(&str, Vec<u8>)],
) -> (tempfile::TempDir, String, DataSource) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("annotations/cifar10_test.json");
    write(&path, annotations.as_bytes());
    for (name, bytes) in images {
        write(&dir.path().join("test_cifar10").join(name), bytes);
    }
    let source = DataSource::JsonFolder {
        root: dir.path().into(),
    };
    (dir, path.display().to_string(), source)
}

fn png(image: image::DynamicImage) -> Vec<u8> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    image.write_to(&mut bytes, image::ImageFormat::Png).unwrap();
    bytes.into_inner()
}

fn jpeg(image: image::DynamicImage) -> Vec<u8> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut bytes, image::ImageFormat::Jpeg)
        .unwrap();
    bytes.into_inner()
}

fn rgb_image(width: u32, height: u32) -> image::DynamicImage {
    image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([(x * 8 % 256) as u8, (y * 8 % 256) as u8, 128])
    }))
}

#[test]
fn json_folder_reads_png_and_jpeg() {
    let annotations = r#"{"images": ["a.png", "b.jpg"], "categories": [4, 9]}"#;
    let (_dir, _, source) = json_folder(
        annotations,
        &[
            ("a.png", png(rgb_image(32, 32))),
            ("b.jpg", jpeg(rgb_image(32, 32))),
        ],
    );
    let test = load_dataset(&source, Split::Test).unwrap();
    assert_eq!(test.labels, vec![4, 9]);
    let tandem_data::Pixels::U8(pixels) = &test.images else {
        panic!("bytes expected")
    };
    // PNG is lossless: pixel (x=3, y=2) of image 0 is (24, 16, 128).
    assert_eq!(
        pixels[(2 * 32 + 3) * 3..(2 * 32 + 3) * 3 + 3],
        [24, 16, 128]
    );
    // JPEG is lossy: close, not equal.
    let jpeg_pixel = &pixels[3072 + (2 * 32 + 3) * 3..3072 + (2 * 32 + 3) * 3 + 3];
    for (value, expected) in jpeg_pixel.iter().zip([24u8, 16, 128]) {
        assert!(value.abs_diff(expected) <= 12, "{jpeg_pixel:?}");
    }
}

#[test]
fn json_malformed_missing_key_and_count_mismatch() {
    let cases = [
        (
            r#"{"images": ["a.png"], "categories": [1]"#,
            "malformed JSON: EOF while parsing an object at line 1 column 39",
        ),
        (r#"{"images": ["a.png"]}"#, "missing key \"categories\""),
        (
            r#"{"images": ["a.png", "b.png"], "categories": [1]}"#,
            "2 images but 1 categories, expected one category per image",
        ),
        (
            r#"{"images": "a.png", "categories": [1]}"#,
            "key \"images\" is \"a.png\", expected an array",
        ),
        (
            r#"{"images": ["a.png"], "categories": [10]}"#,
            "categories[0] is 10, expected an integer in 0..=9",
        ),
        (
            r#"{"images": ["../a.png"], "categories": [1]}"#,
            "images[0] is \"../a.png\", expected a file name inside the image folder",
        ),
        (
            r#"{"images": ["a.png", "b.png", "a.png"], "categories": [1, 2, 3]}"#,
            "images[2] is \"a.png\" again (as images[0]), expected each image once",
        ),
        (
            r#"[1, 2]"#,
            "top level is not a JSON object, expected {\"images\": [...], \"categories\": [...]}",
        ),
    ];
    for (annotations, expected) in cases {
        let (_dir, path, source) = json_folder(annotations, &[]);
        let error = error_text(load_dataset(&source, Split::Test));
        assert_eq!(error, format!("{path}: {expected}"));
    }
}

#[test]
fn json_entries_beyond_the_folders_files_are_refused_before_decoding() {
    let names: Vec<String> = (0..5).map(|index| format!("\"{index}.png\"")).collect();
    let annotations = format!(
        r#"{{"images": [{}], "categories": [1, 2, 3, 4, 5]}}"#,
        names.join(", ")
    );
    let (dir, path, source) = json_folder(&annotations, &[("0.png", png(rgb_image(32, 32)))]);
    let error = error_text(load_dataset(&source, Split::Test));
    assert_eq!(
        error,
        format!(
            "{path}: 5 images listed, but the folder {} holds fewer files (1): each image is a \
             file of its own",
            dir.path().join("test_cifar10").display()
        )
    );
}

#[test]
fn json_missing_image_file() {
    let (dir, _, source) = json_folder(r#"{"images": ["gone.png"], "categories": [1]}"#, &[]);
    let error = error_text(load_dataset(&source, Split::Test));
    let image_path = dir.path().join("test_cifar10/gone.png");
    assert!(
        error.starts_with(&format!("{}: No such file", image_path.display())),
        "{error}"
    );
}

#[test]
fn json_images_of_the_wrong_size_or_colour() {
    let annotations = r#"{"images": ["small.png"], "categories": [1]}"#;
    let gray = image::DynamicImage::ImageLuma8(image::GrayImage::new(32, 32));
    let cases = [
        (
            rgb_image(16, 32),
            "image is 16x32 (width x height), expected 32x32 RGB",
        ),
        (gray, "image has color type L8, expected 8-bit RGB"),
    ];
    for (image, problem) in cases {
        let (dir, _, source) = json_folder(annotations, &[("small.png", png(image))]);
        let error = error_text(load_dataset(&source, Split::Test));
        let image_path = dir.path().join("test_cifar10/small.png");
        assert_eq!(error, format!("{}: {problem}", image_path.display()));
    }
}

#[test]
fn read_image_checks_size_and_resizes_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let exact = dir.path().join("exact.png");
    write(&exact, &png(rgb_image(32, 32)));
    let image = read_image(&exact).unwrap();
    assert_eq!(
        (image.height, image.width, image.pixels.len()),
        (32, 32, 3072)
    );
    assert_eq!(image.pixels[(2 * 32 + 3) * 3], 24.0 / 255.0);

    let large = dir.path().join("large.png");
    write(&large, &png(rgb_image(64, 48)));
    let error = error_text(read_image(&large));
    assert_eq!(
        error,
        format!(
            "{}: image is 64x48 (width x height), expected 32x32 RGB",
            large.display()
        )
    );
    let resized = read_image_resized(&large, 32, 32).unwrap();
    assert_eq!(resized.pixels.len(), 3072);
    assert!(resized
        .pixels
        .iter()
        .all(|value| (0.0..=1.0).contains(value)));

    let broken = dir.path().join("broken.png");
    write(&broken, b"\x89PNG\r\n\x1a\nnot really");
    let error = error_text(read_image_resized(&broken, 32, 32));
    assert!(
        error.starts_with(&format!(
            "{}: cannot decode as PNG or JPEG",
            broken.display()
        )),
        "{error}"
    );
}
