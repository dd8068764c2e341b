//! tandem-data: every way the two tutorials get their images, read in Rust, turned into
//! NHWC `f32` batches for the engine.
//!
//! - [`load_dataset`] reads a [`DataSource`]: CIFAR-10's binary layout (folder or
//!   `.tar.gz`), its python-pickle layout, the annotation-JSON + image-folder layout, or
//!   synthetic noise that needs no files.
//! - [`download_cifar10`] fetches the official archive, resuming and checking its md5.
//! - [`DistributedSampler`] and [`eval_shard`] split the indices between ranks.
//! - [`Loader`] assembles augmented batches ([`Augment`], [`Normalize`]) on background
//!   threads, deterministically from (seed, epoch, sample index).

mod cifar_bin;
mod cifar_py;
mod dataset;
mod download;
mod error;
mod image_file;
mod json_folder;
mod loader;
mod rng;
mod sampler;
mod shards;
mod source;
mod synthetic;
mod transform;

pub use dataset::{Dataset, Pixels, Split, CIFAR10_CLASS_NAMES};
pub use download::{
    download_cifar10, download_file, download_file_bounded, ensure_cifar10_downloaded, file_md5,
    DownloadLimits, CIFAR10_ARCHIVE_NAME, CIFAR10_MAX_DOWNLOAD_BYTES, CIFAR10_MD5, CIFAR10_URL,
    DOWNLOAD_STALL_TIMEOUT, MAX_DOWNLOAD_BYTES,
};
pub use error::DataError;
pub use image_file::{read_image, read_image_resized, Image};
pub use json_folder::parse_annotations;
pub use loader::{Batch, Loader, LoaderOptions};
pub use rng::SampleRng;
pub use sampler::{eval_shard, DistributedSampler};
pub use shards::ShardPlan;
pub use source::{load_dataset, DataSource};
pub use synthetic::{SyntheticPixels, SyntheticSpec};
pub use transform::{transform_image, Augment, Normalize, IMAGENET_NORMALIZE};
