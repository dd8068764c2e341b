//! Decoding PNG and JPEG files into RGB pixels.

use std::path::Path;

use image::imageops::FilterType;
use image::ImageDecoder;

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
            let (height_u32, width_u32) = (dimension(path, height)?, dimension(path, width)?);
            let decoder = open_decoder(path)?;
            let (source_width, source_height) = decoder.dimensions();
            if source_width > MAX_SOURCE_SIDE || source_height > MAX_SOURCE_SIDE {
                return Err(DataError::format(
                    path,
                    format!(
                        "image is {source_width}x{source_height} (width x height), more than the {MAX_SOURCE_SIDE}x{MAX_SOURCE_SIDE} this reader resizes"
                    ),
                ));
            }
            let decoded = decode(path, decoder)?.into_rgb8();
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

/// The widest and tallest image [`read_image_resized`] decodes (48 MiB of RGB at most).
const MAX_SOURCE_SIDE: u32 = 4096;

fn dimension(path: &Path, value: usize) -> Result<u32, DataError> {
    u32::try_from(value)
        .ok()
        .filter(|&value| value > 0 && value <= MAX_SOURCE_SIDE)
        .ok_or_else(|| {
            DataError::format(
                path,
                format!("resize to {value} pixels, expected 1..={MAX_SOURCE_SIDE}"),
            )
        })
}

/// Opens the file and reads its header only: the decoder knows the image's size and color
/// type, and has decoded no pixel yet.
fn open_decoder(path: &Path) -> Result<impl ImageDecoder, DataError> {
    let reader = image::ImageReader::open(path).map_err(|source| DataError::io(path, source))?;
    let reader = reader
        .with_guessed_format()
        .map_err(|source| DataError::io(path, source))?;
    reader
        .into_decoder()
        .map_err(|error| cannot_decode(path, error))
}

fn decode(path: &Path, decoder: impl ImageDecoder) -> Result<image::DynamicImage, DataError> {
    image::DynamicImage::from_decoder(decoder).map_err(|error| cannot_decode(path, error))
}

fn cannot_decode(path: &Path, error: image::ImageError) -> DataError {
    DataError::format(path, format!("cannot decode as PNG or JPEG: {error}"))
}

/// Decodes a file that must be an RGB image of exactly `height` x `width`; returns HWC bytes.
/// The size and color type are checked from the header, before any pixel is decoded.
pub(crate) fn decode_rgb_exact(path: &Path, height: u32, width: u32) -> Result<Vec<u8>, DataError> {
    let decoder = open_decoder(path)?;
    let (found_width, found_height) = decoder.dimensions();
    if found_height != height || found_width != width {
        return Err(DataError::format(
            path,
            format!(
                "image is {found_width}x{found_height} (width x height), expected {width}x{height} RGB"
            ),
        ));
    }
    if decoder.color_type() != image::ColorType::Rgb8 {
        return Err(DataError::format(
            path,
            format!(
                "image has color type {:?}, expected 8-bit RGB",
                decoder.color_type()
            ),
        ));
    }
    match decode(path, decoder)? {
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
