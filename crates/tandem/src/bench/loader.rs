//! `tandem bench loader`: how many augmented 32x32 images per second the loader delivers.
//!
//! One pass over a data set (random bytes by default, or the real CIFAR-10 training set
//! with `--data-dir`) with seed 004's training transforms: pad-4 random crop, horizontal
//! flip, normalize. The consumer only receives and drops the batches, so the figure is
//! the loader's own speed. Prints:
//!
//! ```text
//! loader: 61234 img/s
//! loader per thread: 30617 img/s (2 threads, batch 128, 50000 images)
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tandem_data::{
    load_dataset, Augment, DataSource, Dataset, Loader, LoaderOptions, Pixels, SampleRng, Split,
    CIFAR10_CLASS_NAMES, IMAGENET_NORMALIZE,
};

/// Settings of `tandem bench loader`.
#[derive(Args)]
pub struct LoaderArgs {
    /// Background loader threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Images per batch.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Images in the random data set (ignored with --data-dir).
    #[arg(long, default_value_t = 50_000)]
    images: usize,
    /// Read CIFAR-10's binary layout from here instead of using random bytes.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// Runs the benchmark.
pub fn run(args: LoaderArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    let dataset = match &args.data_dir {
        Some(dir) => load_dataset(&DataSource::Cifar10Bin { dir: dir.clone() }, Split::Train)
            .with_context(|| format!("cannot load CIFAR-10 from {}", dir.display()))?,
        None => random_dataset(args.images),
    };
    let images = dataset.len();
    let loader = Loader::new(
        Arc::new(dataset),
        (0..images).collect(),
        LoaderOptions {
            batch_size: args.batch,
            drop_last: false,
            augment: Some(Augment::crop_and_flip()),
            normalize: Some(IMAGENET_NORMALIZE),
            seed: 0,
            epoch: 0,
            threads: args.threads,
            prefetch: 2 * args.threads,
            start_batch: 0,
        },
    )?;
    let started = Instant::now();
    let mut delivered = 0usize;
    let mut checksum = 0f32;
    for batch in loader {
        let batch = batch?;
        delivered += batch.len;
        checksum += batch.images.first().copied().unwrap_or(0.0);
    }
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        delivered == images,
        "the loader delivered {delivered} of {images} images"
    );
    anyhow::ensure!(checksum.is_finite(), "non-finite pixel values");
    let per_second = delivered as f64 / seconds;
    say!("loader: {per_second:.0} img/s");
    say!(
        "loader per thread: {:.0} img/s ({} threads, batch {}, {images} images)",
        per_second / args.threads as f64,
        args.threads,
        args.batch
    );
    Ok(())
}

/// `count` CIFAR-shaped images of random bytes.
fn random_dataset(count: usize) -> Dataset {
    let mut rng = SampleRng::new(0, 0, 0, 0);
    let mut pixels = vec![0u8; count * 3072];
    for chunk in pixels.chunks_mut(8) {
        let bytes = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    Dataset {
        images: Pixels::U8(pixels),
        labels: (0..count).map(|index| (index % 10) as u32).collect(),
        height: 32,
        width: 32,
        channels: 3,
        num_classes: 10,
        class_names: CIFAR10_CLASS_NAMES
            .iter()
            .map(|name| name.to_string())
            .collect(),
    }
}
