//! Transforms (against a direct implementation of pad, crop, flip, normalize), synthetic
//! data, and the loader's determinism, resume and batching.

use std::sync::Arc;

use tandem_data::{
    load_dataset, transform_image, Augment, Batch, DataSource, Dataset, Loader, LoaderOptions,
    Normalize, Pixels, Split, SyntheticSpec, IMAGENET_NORMALIZE,
};

/// A dataset of `count` 32x32 RGB images with varied bytes.
fn byte_dataset(count: usize) -> Dataset {
    Dataset {
        images: Pixels::U8(
            (0..count * 3072)
                .map(|index| (index * 31 % 256) as u8 ^ (index / 3072) as u8)
                .collect(),
        ),
        labels: (0..count).map(|index| (index % 10) as u32).collect(),
        height: 32,
        width: 32,
        channels: 3,
        num_classes: 10,
        class_names: (0..10).map(|class| class.to_string()).collect(),
    }
}

/// PyTorch's pipeline written out directly: pad with zeros, crop at (top, left), flip,
/// normalize.
fn reference(
    image: &[u8],
    padding: usize,
    top: usize,
    left: usize,
    flip: bool,
    normalize: &Normalize,
) -> Vec<f32> {
    let padded_size = 32 + 2 * padding;
    let mut padded = vec![0f32; padded_size * padded_size * 3];
    for row in 0..32 {
        for column in 0..32 {
            for channel in 0..3 {
                padded[((row + padding) * padded_size + column + padding) * 3 + channel] =
                    f32::from(image[(row * 32 + column) * 3 + channel]) / 255.0;
            }
        }
    }
    let mut output = vec![0f32; 3072];
    for row in 0..32 {
        for column in 0..32 {
            let crop_column = if flip { 31 - column } else { column };
            for channel in 0..3 {
                let value = padded[((row + top) * padded_size + crop_column + left) * 3 + channel];
                output[(row * 32 + column) * 3 + channel] =
                    (value - normalize.mean[channel]) / normalize.std[channel];
            }
        }
    }
    output
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5)
}

#[test]
fn without_augmentation_pixels_are_bytes_over_255_then_normalized() {
    let dataset = byte_dataset(3);
    let mut output = vec![0f32; 3072];
    transform_image(&dataset, 2, &Augment::default(), None, 0, 0, &mut output);
    let Pixels::U8(bytes) = &dataset.images else {
        unreachable!()
    };
    let expected: Vec<f32> = bytes[2 * 3072..3 * 3072]
        .iter()
        .map(|&byte| f32::from(byte) / 255.0)
        .collect();
    assert_eq!(output, expected);

    transform_image(
        &dataset,
        2,
        &Augment::default(),
        Some(&IMAGENET_NORMALIZE),
        0,
        0,
        &mut output,
    );
    assert!(close(
        &output,
        &reference(
            &bytes[2 * 3072..3 * 3072],
            0,
            0,
            0,
            false,
            &IMAGENET_NORMALIZE
        )
    ));
}

#[test]
fn crop_and_flip_match_the_direct_pipeline_and_cover_every_offset() {
    let dataset = byte_dataset(800);
    let Pixels::U8(bytes) = &dataset.images else {
        unreachable!()
    };
    let augment = Augment::crop_and_flip();
    let mut seen_offsets = std::collections::BTreeSet::new();
    let mut flips = 0;
    let mut output = vec![0f32; 3072];
    for index in 0..800 {
        transform_image(
            &dataset,
            index,
            &augment,
            Some(&IMAGENET_NORMALIZE),
            5,
            1,
            &mut output,
        );
        let image = &bytes[index * 3072..(index + 1) * 3072];
        let mut matches = Vec::new();
        for top in 0..=8 {
            for left in 0..=8 {
                for flip in [false, true] {
                    // Check the centre pixel first; build the whole reference only if it fits.
                    let row = 16 + top - 4;
                    let column = if flip { 15 } else { 16 } + left - 4;
                    let centre = (f32::from(image[(row * 32 + column) * 3]) / 255.0
                        - IMAGENET_NORMALIZE.mean[0])
                        / IMAGENET_NORMALIZE.std[0];
                    if (output[(16 * 32 + 16) * 3] - centre).abs() > 1e-5 {
                        continue;
                    }
                    if close(
                        &output,
                        &reference(image, 4, top, left, flip, &IMAGENET_NORMALIZE),
                    ) {
                        matches.push((top, left, flip));
                    }
                }
            }
        }
        assert_eq!(matches.len(), 1, "image {index} matches {matches:?}");
        let (top, left, flip) = matches[0];
        seen_offsets.insert((top, left));
        flips += usize::from(flip);
    }
    assert_eq!(
        seen_offsets.len(),
        81,
        "every crop offset 0..=8 x 0..=8 occurs"
    );
    assert!((340..=460).contains(&flips), "{flips} flips of 800");

    // Same (seed, epoch, index): same draw; another epoch: (almost surely) another.
    let mut again = vec![0f32; 3072];
    transform_image(
        &dataset,
        799,
        &augment,
        Some(&IMAGENET_NORMALIZE),
        5,
        1,
        &mut again,
    );
    assert_eq!(output, again);
    let changed = (0..20).filter(|&epoch| {
        transform_image(
            &dataset,
            799,
            &augment,
            Some(&IMAGENET_NORMALIZE),
            5,
            2 + epoch,
            &mut again,
        );
        again != output
    });
    assert!(changed.count() >= 15);
}

#[test]
fn synthetic_data_is_seed_000s_custom_data() {
    let spec = SyntheticSpec::default();
    let train = load_dataset(&DataSource::Synthetic(spec.clone()), Split::Train).unwrap();
    let test = load_dataset(&DataSource::Synthetic(spec.clone()), Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (5000, 1000));
    assert_eq!(train.class_counts(), vec![2500, 2500]);
    assert_eq!(test.class_counts(), vec![500, 500]);
    assert_ne!(train.labels[..20], [1; 20], "labels are shuffled");
    let Pixels::Synthetic(pixels) = &train.images else {
        panic!("synthetic pixels are made when read")
    };
    let values = &pixels.make_all();
    assert_eq!(values.len(), 5000 * 3072);
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64;
    let variance = values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / values.len() as f64;
    assert!(mean.abs() < 0.002, "mean {mean}");
    assert!((variance - 1.0).abs() < 0.002, "variance {variance}");
    let beyond_two_sigma =
        values.iter().filter(|v| v.abs() > 2.0).count() as f64 / values.len() as f64;
    assert!(
        (beyond_two_sigma - 0.0455).abs() < 0.001,
        "normal tails: {beyond_two_sigma}"
    );

    let again = load_dataset(&DataSource::Synthetic(spec.clone()), Split::Train).unwrap();
    assert_eq!(again, train, "deterministic from the seed");
    let other = SyntheticSpec {
        seed: 7,
        train_samples: 10,
        test_samples: 4,
        image_size: 8,
    };
    let small = load_dataset(&DataSource::Synthetic(other), Split::Test).unwrap();
    assert_eq!(
        (small.len(), small.height, small.images.len()),
        (4, 8, 4 * 8 * 8 * 3)
    );
}

fn options(threads: usize) -> LoaderOptions {
    LoaderOptions {
        batch_size: 32,
        drop_last: false,
        augment: Some(Augment::crop_and_flip()),
        normalize: Some(IMAGENET_NORMALIZE),
        seed: 3,
        epoch: 2,
        threads,
        prefetch: 3,
        start_batch: 0,
    }
}

type Contents = (usize, Vec<usize>, Vec<u32>, Vec<f32>);

fn contents(batch: Result<Batch, tandem_data::DataError>) -> Contents {
    let batch = batch.unwrap();
    (
        batch.batch_index,
        batch.indices.clone(),
        batch.labels.clone(),
        batch.images.clone(),
    )
}

#[test]
fn loader_contents_do_not_depend_on_thread_count() {
    let dataset = Arc::new(byte_dataset(300));
    let indices: Vec<usize> = (0..300).rev().step_by(2).chain(0..50).collect(); // 200 indices
    let runs: Vec<Vec<Contents>> = [0, 1, 3]
        .into_iter()
        .map(|threads| {
            let loader = Loader::new(dataset.clone(), indices.clone(), options(threads)).unwrap();
            assert_eq!(loader.num_batches(), 7);
            loader.map(contents).collect()
        })
        .collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    let sizes: Vec<usize> = runs[0].iter().map(|batch| batch.1.len()).collect();
    assert_eq!(
        sizes,
        vec![32, 32, 32, 32, 32, 32, 8],
        "last partial batch kept"
    );
    let delivered: Vec<usize> = runs[0].iter().flat_map(|batch| batch.1.clone()).collect();
    assert_eq!(delivered, indices);
    for (_, batch_indices, labels, images) in &runs[0] {
        assert_eq!(images.len(), batch_indices.len() * 3072);
        let expected: Vec<u32> = batch_indices
            .iter()
            .map(|&index| (index % 10) as u32)
            .collect();
        assert_eq!(labels, &expected);
        // Each image is the single-image transform of its dataset index.
        let mut single = vec![0f32; 3072];
        transform_image(
            &dataset,
            batch_indices[0],
            &Augment::crop_and_flip(),
            Some(&IMAGENET_NORMALIZE),
            3,
            2,
            &mut single,
        );
        assert_eq!(images[..3072], single[..]);
    }
}

#[test]
fn starting_at_batch_k_equals_skipping_k_batches() {
    let dataset = Arc::new(byte_dataset(100));
    let indices: Vec<usize> = (0..100).collect();
    let full: Vec<Contents> = Loader::new(dataset.clone(), indices.clone(), options(2))
        .unwrap()
        .map(contents)
        .collect();
    for start_batch in [0, 1, 3, 4, 9] {
        let resumed: Vec<Contents> = Loader::new(
            dataset.clone(),
            indices.clone(),
            LoaderOptions {
                start_batch,
                ..options(2)
            },
        )
        .unwrap()
        .map(contents)
        .collect();
        assert_eq!(
            resumed,
            full.iter().skip(start_batch).cloned().collect::<Vec<_>>(),
            "start at {start_batch}"
        );
    }
}

#[test]
fn drop_last_and_end_of_epoch() {
    let dataset = Arc::new(byte_dataset(50));
    let indices: Vec<usize> = (0..50).collect();
    let mut loader = Loader::new(
        dataset,
        indices,
        LoaderOptions {
            drop_last: true,
            ..options(2)
        },
    )
    .unwrap();
    assert_eq!(loader.num_batches(), 1);
    let first = loader.next().unwrap().unwrap();
    assert_eq!(first.len, 32);
    loader.recycle(first);
    assert!(loader.next().is_none());
    assert!(loader.next().is_none(), "the end stays the end");
}

#[test]
fn holding_every_batch_does_not_stall_the_workers() {
    let dataset = Arc::new(byte_dataset(64));
    let loader = Loader::new(
        dataset,
        (0..64).collect(),
        LoaderOptions {
            batch_size: 1,
            prefetch: 1,
            ..options(3)
        },
    )
    .unwrap();
    let held: Vec<Batch> = loader.map(Result::unwrap).collect();
    assert_eq!(held.len(), 64);
}

#[test]
fn synthetic_images_made_when_read_transform_as_the_same_floats_held_in_memory() {
    let spec = SyntheticSpec {
        seed: 3,
        train_samples: 6,
        test_samples: 2,
        image_size: 32,
    };
    let made = load_dataset(&DataSource::Synthetic(spec), Split::Train).unwrap();
    let Pixels::Synthetic(pixels) = &made.images else {
        panic!("synthetic pixels are made when read")
    };
    // An image is made once, then kept.
    assert!(std::ptr::eq(pixels.image(2), pixels.image(2)));
    assert!(pixels.image(6).is_empty());
    let held = Dataset {
        images: Pixels::F32(pixels.make_all()),
        ..made.clone()
    };
    let augment = Augment::crop_and_flip();
    let normalize = IMAGENET_NORMALIZE;
    let mut from_made = vec![0f32; made.image_len()];
    let mut from_held = vec![0f32; made.image_len()];
    for index in [5, 0, 3, 3] {
        for epoch in 0..3 {
            for (dataset, output) in [(&made, &mut from_made), (&held, &mut from_held)] {
                transform_image(dataset, index, &augment, Some(&normalize), 9, epoch, output);
            }
            assert_eq!(
                from_made.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                from_held.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "image {index}, epoch {epoch}"
            );
        }
    }
}

#[test]
fn floats_pass_through_and_bad_settings_are_errors() {
    let spec = SyntheticSpec {
        seed: 1,
        train_samples: 4,
        test_samples: 2,
        image_size: 32,
    };
    let dataset = Arc::new(load_dataset(&DataSource::Synthetic(spec), Split::Train).unwrap());
    let plain = LoaderOptions {
        augment: None,
        normalize: None,
        ..options(1)
    };
    let batch = Loader::new(dataset.clone(), vec![2], plain.clone())
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let Pixels::Synthetic(pixels) = &dataset.images else {
        unreachable!()
    };
    assert_eq!(batch.images, pixels.make_all()[2 * 3072..3 * 3072]);

    let error = Loader::new(dataset.clone(), vec![4], plain.clone())
        .err()
        .unwrap();
    assert_eq!(
        error.to_string(),
        "invalid setting: loader index 4, expected below the dataset size 4"
    );
    let error = Loader::new(
        dataset,
        vec![0],
        LoaderOptions {
            batch_size: 0,
            ..plain
        },
    )
    .err()
    .unwrap();
    assert_eq!(
        error.to_string(),
        "invalid setting: loader batch size 0, expected at least 1"
    );
}
