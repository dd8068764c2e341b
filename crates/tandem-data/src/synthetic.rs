//! Seed 000's "custom data": images of standard-normal noise, half labelled 1 and half 0,
//! shuffled; deterministic from a seed and needing no files.

use std::sync::OnceLock;

use crate::dataset::{Dataset, Pixels, Split};
use crate::error::DataError;
use crate::rng::{stream, SampleRng};

/// The size and seed of synthetic data.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    /// Training images (seed 000: 5,000).
    pub train_samples: usize,
    /// Test images (seed 000: 1,000).
    pub test_samples: usize,
    /// Height and width (seed 000: 32).
    pub image_size: usize,
    /// Seed of pixels and label order (seed 000 shuffles labels with 2021).
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> SyntheticSpec {
        SyntheticSpec {
            train_samples: 5000,
            test_samples: 1000,
            image_size: 32,
            seed: 2021,
        }
    }
}

/// Makes one split. The two splits use different random streams. The labels are drawn now;
/// each image is made when it is first read (see [`SyntheticPixels`]).
pub(crate) fn generate(spec: &SyntheticSpec, split: Split) -> Result<Dataset, DataError> {
    let (samples, split_tag) = match split {
        Split::Train => (spec.train_samples, 0),
        Split::Test => (spec.test_samples, 1),
    };
    let image_len = spec
        .image_size
        .checked_mul(spec.image_size)
        .and_then(|pixels| pixels.checked_mul(3))
        .filter(|&len| len > 0 && len <= (1 << 24))
        .ok_or_else(|| DataError::Invalid {
            message: format!(
                "synthetic image size {}, expected 1..=2364",
                spec.image_size
            ),
        })?;
    samples
        .checked_mul(image_len)
        .filter(|&total| total <= (1 << 32))
        .ok_or_else(|| DataError::Invalid {
            message: format!(
                "{samples} synthetic images of {image_len} values do not fit in memory"
            ),
        })?;
    let mut labels: Vec<u32> = (0..samples)
        .map(|index| u32::from(index < samples / 2))
        .collect();
    SampleRng::new(spec.seed, stream::SYNTHETIC_LABELS, split_tag, 0).shuffle(&mut labels);
    Ok(Dataset {
        images: Pixels::Synthetic(SyntheticPixels::new(
            spec.seed, split_tag, image_len, samples,
        )),
        labels,
        height: spec.image_size,
        width: spec.image_size,
        channels: 3,
        num_classes: 2,
        class_names: vec!["0".to_string(), "1".to_string()],
    })
}

/// Synthetic images of standard-normal noise, each made from its own random stream the first
/// time it is read, then kept: a worker makes only the images it trains on, which matters
/// when many workers share a machine's cores.
#[derive(Clone)]
pub struct SyntheticPixels {
    seed: u64,
    split_tag: u64,
    image_len: usize,
    /// Each image, once made.
    made: Vec<OnceLock<Box<[f32]>>>,
}

impl SyntheticPixels {
    fn new(seed: u64, split_tag: u64, image_len: usize, images: usize) -> SyntheticPixels {
        SyntheticPixels {
            seed,
            split_tag,
            image_len,
            made: (0..images).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Number of values of all images.
    pub fn len(&self) -> usize {
        self.made.len() * self.image_len
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.made.is_empty()
    }

    /// Image `index`'s values (HWC), made now if no one read it before; empty past the last.
    pub fn image(&self, index: usize) -> &[f32] {
        let Some(made) = self.made.get(index) else {
            return &[];
        };
        made.get_or_init(|| {
            let mut image = vec![0f32; self.image_len];
            self.make(index, &mut image);
            image.into_boxed_slice()
        })
    }

    /// Every image's values, one after another (for a copy to a device). Images not read
    /// yet are made into the copy only: the device holds them, and the host need not.
    pub fn make_all(&self) -> Vec<f32> {
        let mut pixels = vec![0f32; self.len()];
        for (index, image) in pixels.chunks_exact_mut(self.image_len).enumerate() {
            match self.made[index].get() {
                Some(made) => image.copy_from_slice(made),
                None => self.make(index, image),
            }
        }
        pixels
    }

    /// Writes image `index`'s values into `image`, from its own random stream.
    fn make(&self, index: usize, image: &mut [f32]) {
        let mut rng = SampleRng::new(
            self.seed,
            stream::SYNTHETIC_PIXELS,
            self.split_tag,
            index as u64,
        );
        for pair in image.chunks_mut(2) {
            let (first, second) = rng.normal_pair();
            for (value, normal) in pair.iter_mut().zip([first, second]) {
                *value = normal as f32;
            }
        }
    }
}

/// Two synthetic sets are equal when they make the same images, made yet or not.
impl PartialEq for SyntheticPixels {
    fn eq(&self, other: &SyntheticPixels) -> bool {
        (self.seed, self.split_tag, self.image_len, self.made.len())
            == (
                other.seed,
                other.split_tag,
                other.image_len,
                other.made.len(),
            )
    }
}

impl std::fmt::Debug for SyntheticPixels {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SyntheticPixels")
            .field("seed", &self.seed)
            .field("split_tag", &self.split_tag)
            .field("image_len", &self.image_len)
            .field("images", &self.made.len())
            .finish()
    }
}
