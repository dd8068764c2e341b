//! A dataset held in memory.

use crate::synthetic::SyntheticPixels;

/// CIFAR-10's class names, in label order.
pub const CIFAR10_CLASS_NAMES: [&str; 10] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training images.
    Train,
    /// The test (validation) images.
    Test,
}

impl Split {
    /// `train` or `test`, as in file names.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }
}

/// Pixel values of all images, NHWC.
#[derive(Debug, Clone, PartialEq)]
pub enum Pixels {
    /// Bytes 0..=255, as stored by image files; the loader divides by 255.
    U8(Vec<u8>),
    /// Ready floats; the loader uses them as they are.
    F32(Vec<f32>),
    /// Synthetic noise, each image made when it is read; the loader uses it as it is.
    Synthetic(SyntheticPixels),
}

impl Pixels {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Pixels::U8(values) => values.len(),
            Pixels::F32(values) => values.len(),
            Pixels::Synthetic(synthetic) => synthetic.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Images and labels in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// All images, NHWC, `len() * height * width * channels` values.
    pub images: Pixels,
    /// One label per image, below `num_classes`.
    pub labels: Vec<u32>,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
    /// Channels per pixel (3: RGB).
    pub channels: usize,
    /// Number of classes the labels are drawn from.
    pub num_classes: usize,
    /// A name per class.
    pub class_names: Vec<String>,
}

impl Dataset {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per image: `height * width * channels`.
    pub fn image_len(&self) -> usize {
        self.height * self.width * self.channels
    }

    /// How many images carry each label.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.num_classes];
        for &label in &self.labels {
            if let Some(count) = counts.get_mut(label as usize) {
                *count += 1;
            }
        }
        counts
    }

    /// A CIFAR-10 dataset from HWC bytes and labels.
    pub(crate) fn cifar10(pixels: Vec<u8>, labels: Vec<u32>, class_names: Vec<String>) -> Dataset {
        Dataset {
            images: Pixels::U8(pixels),
            labels,
            height: 32,
            width: 32,
            channels: 3,
            num_classes: 10,
            class_names,
        }
    }
}

/// CIFAR-10's standard class names as owned strings.
pub(crate) fn cifar10_class_names() -> Vec<String> {
    CIFAR10_CLASS_NAMES
        .iter()
        .map(|name| name.to_string())
        .collect()
}

/// Converts one CIFAR record's planes (all R, then all G, then all B) to HWC.
pub(crate) fn planes_to_hwc(planes: &[u8], hwc: &mut [u8]) {
    const PLANE: usize = 32 * 32;
    for (pixel, rgb) in hwc.chunks_exact_mut(3).enumerate().take(PLANE) {
        for (channel, value) in rgb.iter_mut().enumerate() {
            *value = planes.get(channel * PLANE + pixel).copied().unwrap_or(0);
        }
    }
}
