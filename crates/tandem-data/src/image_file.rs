//! Decoding PNG and JPEG files into RGB pixels.

use std::path::Path;

use image::imageops::FilterType;

use crate::error::DataError;

/// One decoded image, HWC, values in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// `height * width * 3` values, RGB, row-major.
    pub pixels: Vec<f32>,
}

/// Decodes a PNG or JPEG file that must be a 32x32 RGB image to `[32, 32, 3]` floats in
/// [0, 1] (for `predict`).
pub fn read_image(path: &Path) -> Result<Image, DataError> {
    decode_to_floats(path, None)
}

/// Decodes any PNG or JPEG file, converts it to RGB and resizes it (bilinear) to
/// `height` x `width`; floats in [0, 1].
pub fn read_image_resized(path: &Path, height: usize, width: usize) -> Result<Image, DataError> {
    decode_to_floats(path, Some((height, width)))
}

fn decode_to_floats(path: &Path, resize: Option<(usize, usize)>) -> Result<Image, DataError> {
    let rgb = match resize {
        None => decode_rgb_exact(path, 32, 32)?,
        Some((height, width)) => {
            let decoded = decode(path)?.into_rgb8();
            let (height_u32, width_u32) = (dimension(path, height)?, dimension(path, width)?);
            image::imageops::resize(&decoded, width_u32, height_u32, FilterType::Triangle)
                .into_raw()
        }
    };
    let (height, width) = resize.unwrap_or((32, 32));
    Ok(Image {
        height,
        width,
        pixels: rgb.iter().map(|&value| f32::from(value) / 255.0).collect(),
    })
}

fn dimension(path: &Path, value: usize) -> Result<u32, DataError> {
    u32::try_from(value)
        .ok()
        .filter(|&value| value > 0 && value <= 4096)
        .ok_or_else(|| {
            DataError::format(path, format!("resize to {value} pixels, expected 1..=4096"))
        })
}

fn decode(path: &Path) -> Result<image::DynamicImage, DataError> {
    let reader = image::ImageReader::open(path).map_err(|source| DataError::io(path, source))?;
    let reader = reader
        .with_guessed_format()
        .map_err(|source| DataError::io(path, source))?;
    reader
        .decode()
        .map_err(|error| DataError::format(path, format!("cannot decode as PNG or JPEG: {error}")))
}

/// Decodes a file that must be an RGB image of exactly `height` x `width`; returns HWC bytes.
pub(crate) fn decode_rgb_exact(path: &Path, height: u32, width: u32) -> Result<Vec<u8>, DataError> {
    let decoded = decode(path)?;
    if decoded.height() != height || decoded.width() != width {
        return Err(DataError::format(
            path,
            format!(
                "image is {}x{} (width x height), expected {width}x{height} RGB",
                decoded.width(),
                decoded.height()
            ),
        ));
    }
    match decoded {
        image::DynamicImage::ImageRgb8(rgb) => Ok(rgb.into_raw()),
        other => Err(DataError::format(
            path,
            format!(
                "image has color type {:?}, expected 8-bit RGB",
                other.color()
            ),
        )),
    }
}
