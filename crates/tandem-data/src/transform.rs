//! Per-image transforms, in seed 004's order: to float (`u8 / 255`), random crop with zero
//! padding (`RandomCrop(32, padding=4)`), horizontal flip (`RandomHorizontalFlip(0.5)`),
//! normalize (`Normalize(mean, std)`). The random draws of an image depend only on
//! (seed, epoch, sample index).

use crate::dataset::{Dataset, Pixels};
use crate::rng::{stream, SampleRng};

/// Random augmentation of training images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Augment {
    /// Pad by this many zero pixels on every side, then crop back to the original size at a
    /// uniformly random offset (`RandomCrop(size, padding)`).
    pub random_crop_padding: Option<usize>,
    /// Mirror left-right with probability 0.5.
    pub horizontal_flip: bool,
}

impl Augment {
    /// The augmentation of seed 004: pad-4 random crop and horizontal flip.
    pub fn crop_and_flip() -> Augment {
        Augment {
            random_crop_padding: Some(4),
            horizontal_flip: true,
        }
    }
}

/// Per-channel normalization `(value - mean) / std`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    /// Mean per channel (R, G, B).
    pub mean: [f32; 3],
    /// Standard deviation per channel (R, G, B).
    pub std: [f32; 3],
}

/// Seed 004's normalization (the ImageNet statistics).
pub const IMAGENET_NORMALIZE: Normalize = Normalize {
    mean: [0.485, 0.456, 0.406],
    std: [0.229, 0.224, 0.225],
};

/// The random choices for one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Draw {
    /// Crop offset in the padded image (0..=2*padding), rows and columns.
    top: usize,
    left: usize,
    flip: bool,
}

impl Draw {
    fn for_sample(augment: &Augment, seed: u64, epoch: u64, index: u64) -> Draw {
        let mut rng = SampleRng::new(seed, stream::AUGMENT, epoch, index);
        let padding = augment.random_crop_padding.unwrap_or(0) as u64;
        let (top, left) = if padding > 0 {
            (
                rng.below(2 * padding + 1) as usize,
                rng.below(2 * padding + 1) as usize,
            )
        } else {
            (0, 0)
        };
        let flip = augment.horizontal_flip && rng.coin();
        Draw { top, left, flip }
    }
}

/// A table from input value to output value per channel, so the inner loop is one load.
pub(crate) struct ValueMap {
    /// For bytes: `table[channel][byte]`.
    byte_table: [[f32; 256]; 3],
    /// For floats: scale and shift per channel.
    scale: [f32; 3],
    shift: [f32; 3],
}

impl ValueMap {
    pub(crate) fn new(normalize: Option<&Normalize>) -> ValueMap {
        let (mean, std) = match normalize {
            Some(normalize) => (normalize.mean, normalize.std),
            None => ([0.0; 3], [1.0; 3]),
        };
        let mut byte_table = [[0f32; 256]; 3];
        for (channel, table) in byte_table.iter_mut().enumerate() {
            for (byte, value) in table.iter_mut().enumerate() {
                *value = (byte as f32 / 255.0 - mean[channel]) / std[channel];
            }
        }
        let scale = [1.0 / std[0], 1.0 / std[1], 1.0 / std[2]];
        let shift = [-mean[0] / std[0], -mean[1] / std[1], -mean[2] / std[2]];
        ValueMap {
            byte_table,
            scale,
            shift,
        }
    }

    /// What a zero-padding pixel of `channel` becomes.
    fn padding(&self, channel: usize) -> f32 {
        self.shift[channel % 3]
    }
}

/// The geometry of the images being transformed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub height: usize,
    pub width: usize,
    pub channels: usize,
}

/// Transforms image `index` of `dataset` into `output` (HWC, `dataset.image_len()` values),
/// with the random draws of (seed, epoch, index).
pub fn transform_image(
    dataset: &Dataset,
    index: usize,
    augment: &Augment,
    normalize: Option<&Normalize>,
    seed: u64,
    epoch: u64,
    output: &mut [f32],
) {
    let map = ValueMap::new(normalize);
    let geometry = Geometry {
        height: dataset.height,
        width: dataset.width,
        channels: dataset.channels,
    };
    transform_with_map(
        &dataset.images,
        geometry,
        index,
        augment,
        &map,
        (seed, epoch),
        output,
    );
}

/// [`transform_image`] with a prepared [`ValueMap`] (the loader makes one per thread).
pub(crate) fn transform_with_map(
    source: &Pixels,
    geometry: Geometry,
    index: usize,
    augment: &Augment,
    map: &ValueMap,
    (seed, epoch): (u64, u64),
    output: &mut [f32],
) {
    let Geometry {
        height,
        width,
        channels,
    } = geometry;
    let image_len = height * width * channels;
    // The values of image `index` start at `start` in `source`.
    let (source, start) = match source {
        Pixels::U8(bytes) => (Values::U8(bytes), index * image_len),
        Pixels::F32(floats) => (Values::F32(floats), index * image_len),
        Pixels::Synthetic(synthetic) => (Values::F32(synthetic.image(index)), 0),
    };
    let draw = Draw::for_sample(augment, seed, epoch, index as u64);
    let padding = augment.random_crop_padding.unwrap_or(0);
    let row_len = width * channels;
    for (row, output_row) in output.chunks_exact_mut(row_len).enumerate().take(height) {
        // Row `row` of the crop is row `row + top` of the padded image.
        let source_row = (row + draw.top)
            .checked_sub(padding)
            .filter(|&source_row| source_row < height);
        let Some(source_row) = source_row else {
            for (position, value) in output_row.iter_mut().enumerate() {
                *value = map.padding(position % channels);
            }
            continue;
        };
        let row_start = start + source_row * row_len;
        for column in 0..width {
            let cropped_column = if draw.flip {
                width - 1 - column
            } else {
                column
            };
            let source_column = (cropped_column + draw.left)
                .checked_sub(padding)
                .filter(|&source_column| source_column < width);
            let pixel = &mut output_row[column * channels..(column + 1) * channels];
            match source_column {
                None => {
                    for (channel, value) in pixel.iter_mut().enumerate() {
                        *value = map.padding(channel);
                    }
                }
                Some(source_column) => {
                    let offset = row_start + source_column * channels;
                    copy_pixel(source, offset, map, pixel);
                }
            }
        }
    }
}

/// The values an image is read from.
#[derive(Clone, Copy)]
enum Values<'a> {
    U8(&'a [u8]),
    F32(&'a [f32]),
}

fn copy_pixel(source: Values<'_>, offset: usize, map: &ValueMap, pixel: &mut [f32]) {
    match source {
        Values::U8(bytes) => {
            let input = bytes.get(offset..offset + pixel.len()).unwrap_or(&[]);
            for (channel, (value, &byte)) in pixel.iter_mut().zip(input).enumerate() {
                *value = map.byte_table[channel % 3][usize::from(byte)];
            }
        }
        Values::F32(floats) => {
            let input = floats.get(offset..offset + pixel.len()).unwrap_or(&[]);
            for (channel, (value, &float)) in pixel.iter_mut().zip(input).enumerate() {
                *value = float * map.scale[channel % 3] + map.shift[channel % 3];
            }
        }
    }
}
