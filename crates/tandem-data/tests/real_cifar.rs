//! CIFAR-10 from the shared real files, through all three layouts: counts, first labels,
//! channel statistics, and the same pixels for the same image in every layout.

mod common;

use std::collections::HashMap;
use std::sync::OnceLock;

use tandem_data::{load_dataset, DataSource, Dataset, Pixels, Split, CIFAR10_CLASS_NAMES};

/// The binary layout, read straight from the shared `.tar.gz` (once per test binary).
fn binary(split: Split) -> &'static Dataset {
    static TRAIN: OnceLock<Dataset> = OnceLock::new();
    static TEST: OnceLock<Dataset> = OnceLock::new();
    let cell = match split {
        Split::Train => &TRAIN,
        Split::Test => &TEST,
    };
    cell.get_or_init(|| {
        let source = DataSource::Cifar10Bin {
            dir: tandem_testdata::shared_path("data/cifar10"),
        };
        load_dataset(&source, split).unwrap()
    })
}

fn bytes(dataset: &Dataset) -> &[u8] {
    match &dataset.images {
        Pixels::U8(bytes) => bytes,
        _ => panic!("CIFAR-10 pixels should be bytes"),
    }
}

#[test]
fn binary_train_split_counts_labels_and_channel_statistics() {
    tandem_testdata::skip_without_shared!();
    let train = binary(Split::Train);
    assert_eq!(train.len(), 50_000);
    assert_eq!((train.height, train.width, train.channels), (32, 32, 3));
    assert_eq!(bytes(train).len(), 50_000 * 3072);
    assert_eq!(train.class_counts(), vec![5000; 10]);
    assert_eq!(train.labels[..5], [6, 9, 9, 4, 1]);
    assert_eq!(
        train.class_names,
        CIFAR10_CLASS_NAMES.map(String::from).to_vec()
    );

    let mut sums = [0f64; 3];
    let mut squares = [0f64; 3];
    for pixel in bytes(train).chunks_exact(3) {
        for channel in 0..3 {
            let value = f64::from(pixel[channel]) / 255.0;
            sums[channel] += value;
            squares[channel] += value * value;
        }
    }
    let count = (50_000 * 1024) as f64;
    let expected_mean = [0.4914, 0.4822, 0.4465];
    let expected_std = [0.2470, 0.2435, 0.2616];
    for channel in 0..3 {
        let mean = sums[channel] / count;
        let std = (squares[channel] / count - mean * mean).sqrt();
        assert!(
            (mean - expected_mean[channel]).abs() < 1e-4,
            "channel {channel} mean {mean}"
        );
        assert!(
            (std - expected_std[channel]).abs() < 1e-4,
            "channel {channel} std {std}"
        );
    }
}

#[test]
fn binary_test_split_counts_and_labels() {
    tandem_testdata::skip_without_shared!();
    let test = binary(Split::Test);
    assert_eq!(test.len(), 10_000);
    assert_eq!(test.class_counts(), vec![1000; 10]);
    assert_eq!(test.labels[..4], [3, 8, 8, 0]);
}

#[test]
fn python_pickle_layout_matches_the_first_500_rows_of_each_binary_batch() {
    tandem_testdata::skip_without_shared!();
    let source = DataSource::Cifar10Py {
        dir: tandem_testdata::shared_path("data/cifar10/py-mini"),
    };
    let python_train = load_dataset(&source, Split::Train).unwrap();
    assert_eq!(python_train.len(), 2500);
    assert_eq!(
        python_train.class_names,
        CIFAR10_CLASS_NAMES.map(String::from).to_vec()
    );
    let binary_train = binary(Split::Train);
    for batch in 0..5 {
        for row in 0..500 {
            let python_index = batch * 500 + row;
            let binary_index = batch * 10_000 + row;
            assert_eq!(
                python_train.labels[python_index],
                binary_train.labels[binary_index]
            );
            assert_eq!(
                bytes(&python_train)[python_index * 3072..(python_index + 1) * 3072],
                bytes(binary_train)[binary_index * 3072..(binary_index + 1) * 3072],
                "image {binary_index}"
            );
        }
    }
    let python_test = load_dataset(&source, Split::Test).unwrap();
    let binary_test = binary(Split::Test);
    assert_eq!(python_test.len(), 500);
    assert_eq!(python_test.labels[..], binary_test.labels[..500]);
    assert_eq!(bytes(&python_test)[..], bytes(binary_test)[..500 * 3072]);
}

/// The JSON subset holds the first `per_class` images of each class, in the original order.
fn check_json_subset(split: Split, per_class: usize) {
    let source = DataSource::JsonFolder {
        root: tandem_testdata::shared_path("data/cifar10/json-subset"),
    };
    let subset = load_dataset(&source, split).unwrap();
    assert_eq!(subset.len(), 10 * per_class);
    assert_eq!(subset.class_counts(), vec![per_class; 10]);
    let full = binary(split);
    let mut taken = [0usize; 10];
    let mut expected: HashMap<&[u8], (usize, u32)> = HashMap::new();
    let mut expected_order = Vec::new();
    for (index, &label) in full.labels.iter().enumerate() {
        if taken[label as usize] < per_class {
            taken[label as usize] += 1;
            let image = &bytes(full)[index * 3072..(index + 1) * 3072];
            expected.insert(image, (index, label));
            expected_order.push(index);
        }
    }
    let mut found_order = Vec::new();
    for (position, image) in bytes(&subset).chunks_exact(3072).enumerate() {
        let Some(&(index, label)) = expected.get(image) else {
            panic!(
                "{split:?} JSON image {position} matches none of the first {per_class} per class"
            );
        };
        assert_eq!(
            subset.labels[position], label,
            "label of JSON image {position}"
        );
        found_order.push(index);
    }
    assert_eq!(
        found_order, expected_order,
        "JSON images are in the original order"
    );
}

#[test]
fn json_subset_train_holds_the_first_100_of_each_class() {
    tandem_testdata::skip_without_shared!();
    check_json_subset(Split::Train, 100);
}

#[test]
fn json_subset_test_holds_the_first_20_of_each_class() {
    tandem_testdata::skip_without_shared!();
    check_json_subset(Split::Test, 20);
}
