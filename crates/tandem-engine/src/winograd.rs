//! Winograd F(2x2, 3x3) convolution for wide 3x3, stride-1, padding-1 layers (ResNet-18's
//! 64 to 512 channels): each 2x2 block of output pixels costs 16 multiplies per channel
//! pair instead of 36, 2.25x fewer than im2col + GEMM.
//!
//! The image is cut into tiles of 2x2 output pixels. Each tile's 4x4 receptive field `d`
//! (zeros outside the image) becomes 16 values per input channel, `Bᵀ d B`; each 3x3 kernel
//! `g` becomes 16 values per channel pair, `G g Gᵀ`. For each of the 16 positions one GEMM
//! multiplies the tiles' transformed inputs `[tiles, in]` by the transformed weights
//! `[in, out]`, and each tile's 16 products `m` turn back into its 2x2 outputs, `Aᵀ m A`
//! (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015).
//!
//! The transforms only add, subtract and halve, so the results differ from the direct sum
//! by a few roundings, as GEMM's own summation order does.
//!
//! The same routine gives a layer's input gradient: that is the 3x3 padding-1 correlation
//! of the output gradient with the kernel flipped and its channel axes swapped
//! ([`input_grad_weights`]).

use crate::matmul::{matmul, MatRef};
use crate::scratch::grow;
use crate::shape::Conv2dShape;
use crate::simd::multiversion;

/// Transformed values per tile and channel (the 4x4 positions).
const POSITIONS: usize = 16;

/// Tiles per batch of GEMMs: enough rows for `gemm` to run at speed, few enough that a
/// batch's transformed tiles stay in the caches.
const TARGET_TILES: usize = 192;

/// Fewest channels on either side for which the transforms pay for themselves.
const MIN_CHANNELS: usize = 16;

/// Whether the forward pass (and the input gradient) of `shape` runs on Winograd.
pub(crate) fn applies(shape: &Conv2dShape) -> bool {
    shape.kernel == 3
        && shape.stride == 1
        && shape.padding == 1
        && shape.in_channels >= MIN_CHANNELS
        && shape.out_channels >= MIN_CHANNELS
}

/// The OHWI 3x3 weights of `shape` transformed for the forward pass: `[16][in][out]`.
pub(crate) fn forward_weights(shape: &Conv2dShape, weight: &[f32], transformed: &mut Vec<f32>) {
    transform_weights(shape, weight, Direction::Forward, transformed);
}

/// The OHWI 3x3 weights of `shape` transformed for the input gradient: the kernel flipped on
/// both axes and its channel axes swapped, `[16][out][in]`.
pub(crate) fn input_grad_weights(shape: &Conv2dShape, weight: &[f32], transformed: &mut Vec<f32>) {
    transform_weights(shape, weight, Direction::InputGrad, transformed);
}

/// Which correlation transformed weights are for.
#[derive(Clone, Copy, PartialEq)]
enum Direction {
    Forward,
    InputGrad,
}

fn transform_weights(
    shape: &Conv2dShape,
    weight: &[f32],
    direction: Direction,
    transformed: &mut Vec<f32>,
) {
    let (outputs, inputs) = (shape.out_channels, shape.in_channels);
    assert_eq!(
        weight.len(),
        outputs * 9 * inputs,
        "winograd: weight length"
    );
    transformed.clear();
    transformed.resize(POSITIONS * outputs * inputs, 0.0);
    // Rows are the correlation's input channels, columns its output channels; walking the
    // columns innermost keeps the 16 streams of writes contiguous.
    let (rows, columns) = match direction {
        Direction::Forward => (inputs, outputs),
        Direction::InputGrad => (outputs, inputs),
    };
    let matrix_len = outputs * inputs;
    for row in 0..rows {
        for column in 0..columns {
            let (out, input) = match direction {
                Direction::Forward => (column, row),
                Direction::InputGrad => (row, column),
            };
            let kernel: [[f32; 3]; 3] = std::array::from_fn(|ky| {
                std::array::from_fn(|kx| {
                    let (ky, kx) = match direction {
                        Direction::Forward => (ky, kx),
                        Direction::InputGrad => (2 - ky, 2 - kx),
                    };
                    weight[((out * 3 + ky) * 3 + kx) * inputs + input]
                })
            });
            let values = kernel_transform(&kernel);
            for (position, value) in values.iter().flatten().enumerate() {
                transformed[position * matrix_len + row * columns + column] = *value;
            }
        }
    }
}

/// `G g Gᵀ` with `G = [[1, 0, 0], [½, ½, ½], [½, -½, ½], [0, 0, 1]]`.
fn kernel_transform(kernel: &[[f32; 3]; 3]) -> [[f32; 4]; 4] {
    let expand = |g: [f32; 3]| {
        [
            g[0],
            0.5 * (g[0] + g[1] + g[2]),
            0.5 * (g[0] - g[1] + g[2]),
            g[2],
        ]
    };
    let columns: [[f32; 4]; 3] = std::array::from_fn(|kx| expand(kernel.map(|row| row[kx])));
    std::array::from_fn(|i| expand(columns.map(|column| column[i])))
}

/// The geometry of one Winograd correlation: images of `height x width` pixels with
/// `in_channels`, giving outputs of the same size with `out_channels`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plane {
    /// Image height (input and output).
    pub height: usize,
    /// Image width (input and output).
    pub width: usize,
    /// Channels of the correlation's input.
    pub in_channels: usize,
    /// Channels of the correlation's output.
    pub out_channels: usize,
}

impl Plane {
    /// The geometry of a 3x3, stride-1, padding-1 convolution of `shape`.
    pub fn of(shape: &Conv2dShape) -> Plane {
        Plane {
            height: shape.in_height,
            width: shape.in_width,
            in_channels: shape.in_channels,
            out_channels: shape.out_channels,
        }
    }

    /// The correlation that gives this one's input gradient: outputs and inputs swapped.
    pub fn reversed(self) -> Plane {
        Plane {
            in_channels: self.out_channels,
            out_channels: self.in_channels,
            ..self
        }
    }

    fn tile_rows(&self) -> usize {
        self.height.div_ceil(2)
    }

    fn tile_columns(&self) -> usize {
        self.width.div_ceil(2)
    }

    fn tiles_per_image(&self) -> usize {
        self.tile_rows() * self.tile_columns()
    }
}

/// Images per call of [`correlate`] that give about one batch of tiles, so a caller that
/// works chunk by chunk keeps each chunk's output in cache.
pub(crate) fn images_per_chunk(plane: &Plane) -> usize {
    (TARGET_TILES / plane.tiles_per_image().max(1)).max(1)
}

/// A worker's buffers for [`correlate`], grown on first use and then reused.
#[derive(Default)]
pub(crate) struct WinogradScratch {
    /// Transformed input tiles, `[tiles][16][in]`.
    inputs: Vec<f32>,
    /// Products, `[tiles][16][out]`.
    products: Vec<f32>,
    /// A pixel of zeros, for the parts of tiles outside the image.
    zeros: Vec<f32>,
}

/// `output = conv3x3(images)` with padding 1 and stride 1 (or `output +=` it when
/// `accumulate`), for NHWC `images` and `output` of `plane`'s sizes and `weights` from
/// [`forward_weights`] or [`input_grad_weights`].
pub(crate) fn correlate(
    plane: &Plane,
    images: &[f32],
    weights: &[f32],
    output: &mut [f32],
    accumulate: bool,
    scratch: &mut WinogradScratch,
) {
    let Plane {
        height,
        width,
        in_channels,
        out_channels,
    } = *plane;
    let image_pixels = height * width;
    assert!(image_pixels > 0, "winograd: empty image");
    let images_count = images.len() / (image_pixels * in_channels);
    assert_eq!(
        images.len(),
        images_count * image_pixels * in_channels,
        "winograd: input length"
    );
    assert_eq!(
        output.len(),
        images_count * image_pixels * out_channels,
        "winograd: output length"
    );
    assert_eq!(
        weights.len(),
        POSITIONS * in_channels * out_channels,
        "winograd: weights length"
    );
    let total_tiles = images_count * plane.tiles_per_image();
    // Equal batches, so the last is not a sliver.
    let batches = total_tiles.div_ceil(TARGET_TILES).max(1);
    let batch_tiles = total_tiles.div_ceil(batches).max(1);
    grow(&mut scratch.inputs, batch_tiles * POSITIONS * in_channels);
    grow(
        &mut scratch.products,
        batch_tiles * POSITIONS * out_channels,
    );
    grow(&mut scratch.zeros, in_channels);
    let mut first = 0;
    while first < total_tiles {
        let tiles = batch_tiles.min(total_tiles - first);
        let transformed = &mut scratch.inputs[..tiles * POSITIONS * in_channels];
        for (index, tile) in transformed
            .chunks_exact_mut(POSITIONS * in_channels)
            .enumerate()
        {
            let pixels = tile_pixels(plane, images, first + index, &scratch.zeros);
            transform_input_tile(&pixels, tile, in_channels);
        }
        let products = &mut scratch.products[..tiles * POSITIONS * out_channels];
        for position in 0..POSITIONS {
            let lhs = MatRef {
                data: &transformed[position * in_channels..],
                rows: tiles,
                cols: in_channels,
                row_stride: POSITIONS * in_channels,
                col_stride: 1,
            };
            let matrix_len = in_channels * out_channels;
            let rhs = MatRef::row_major(
                &weights[position * matrix_len..][..matrix_len],
                in_channels,
                out_channels,
            );
            matmul(
                &mut products[position * out_channels..],
                POSITIONS * out_channels,
                lhs,
                rhs,
                false,
            );
        }
        for (index, tile) in products.chunks_exact(POSITIONS * out_channels).enumerate() {
            let mut pixels = output_tile(plane, output, first + index);
            transform_output_tile(tile, &mut pixels, out_channels, accumulate);
        }
        first += tiles;
    }
}

/// The 16 input pixels of tile `tile` (row-major over the 4x4 field), `zeros` where the
/// field leaves the image.
fn tile_pixels<'a>(
    plane: &Plane,
    images: &'a [f32],
    tile: usize,
    zeros: &'a [f32],
) -> [&'a [f32]; POSITIONS] {
    let channels = plane.in_channels;
    let (image, tile_y, tile_x) = tile_position(plane, tile);
    let image_start = image * plane.height * plane.width;
    std::array::from_fn(|position| {
        let y = (2 * tile_y + position / 4).checked_sub(1);
        let x = (2 * tile_x + position % 4).checked_sub(1);
        match (y, x) {
            (Some(y), Some(x)) if y < plane.height && x < plane.width => {
                let pixel = image_start + y * plane.width + x;
                &images[pixel * channels..][..channels]
            }
            _ => &zeros[..channels],
        }
    })
}

/// The output pixels of tile `tile` (row-major over its 2x2 block), `None` where the block
/// leaves the image.
fn output_tile<'a>(
    plane: &Plane,
    output: &'a mut [f32],
    tile: usize,
) -> [Option<&'a mut [f32]>; 4] {
    let channels = plane.out_channels;
    let (image, tile_y, tile_x) = tile_position(plane, tile);
    let (y, x) = (2 * tile_y, 2 * tile_x);
    let row_len = plane.width * channels;
    let image_len = plane.height * row_len;
    let image_output = &mut output[image * image_len..][..image_len];
    let (top, bottom) = image_output[y * row_len..].split_at_mut(row_len);
    let bottom = (y + 1 < plane.height).then_some(bottom);
    let split_row = |row: &'a mut [f32]| -> [Option<&'a mut [f32]>; 2] {
        let (left, rest) = row[x * channels..].split_at_mut(channels);
        let right = (x + 1 < plane.width).then(|| &mut rest[..channels]);
        [Some(left), right]
    };
    let [top_left, top_right] = split_row(top);
    let [bottom_left, bottom_right] = match bottom {
        Some(row) => split_row(row),
        None => [None, None],
    };
    [top_left, top_right, bottom_left, bottom_right]
}

/// `(image, tile row, tile column)` of tile number `tile`.
fn tile_position(plane: &Plane, tile: usize) -> (usize, usize, usize) {
    let per_image = plane.tiles_per_image();
    let within = tile % per_image;
    (
        tile / per_image,
        within / plane.tile_columns(),
        within % plane.tile_columns(),
    )
}

/// Lanes of channels transformed together (one AVX register).
const LANES: usize = 8;

multiversion! {
    /// `Bᵀ d B` of one tile for every channel: `transformed[ξ·channels + c]` from
    /// `pixels[·][c]`.
    fn transform_input_tile(pixels: &[&[f32]; POSITIONS], transformed: &mut [f32], channels: usize) {
        let mut start = 0;
        while start + LANES <= channels {
            transform_input_lanes::<LANES>(pixels, transformed, channels, start);
            start += LANES;
        }
        for channel in start..channels {
            transform_input_lanes::<1>(pixels, transformed, channels, channel);
        }
    }
}

#[inline(always)]
fn transform_input_lanes<const L: usize>(
    pixels: &[&[f32]; POSITIONS],
    transformed: &mut [f32],
    channels: usize,
    start: usize,
) {
    let d: [[f32; L]; POSITIONS] = std::array::from_fn(|position| load(pixels[position], start));
    // Rows: Bᵀ d, with Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]].
    let mut rows = [[0.0; L]; POSITIONS];
    for column in 0..4 {
        let [d0, d1, d2, d3] = [0, 1, 2, 3].map(|row| d[4 * row + column]);
        rows[column] = sub(d0, d2);
        rows[4 + column] = add(d1, d2);
        rows[8 + column] = sub(d2, d1);
        rows[12 + column] = sub(d1, d3);
    }
    // Columns: (Bᵀ d) B.
    for row in 0..4 {
        let [r0, r1, r2, r3] = [0, 1, 2, 3].map(|column| rows[4 * row + column]);
        let values = [sub(r0, r2), add(r1, r2), sub(r2, r1), sub(r1, r3)];
        for (column, value) in values.iter().enumerate() {
            transformed[(4 * row + column) * channels + start..][..L].copy_from_slice(value);
        }
    }
}

multiversion! {
    /// `Aᵀ m A` of one tile for every channel, written (or added) to its output pixels.
    fn transform_output_tile(
        products: &[f32],
        pixels: &mut [Option<&mut [f32]>; 4],
        channels: usize,
        accumulate: bool,
    ) {
        let mut start = 0;
        while start + LANES <= channels {
            transform_output_lanes::<LANES>(products, pixels, channels, start, accumulate);
            start += LANES;
        }
        for channel in start..channels {
            transform_output_lanes::<1>(products, pixels, channels, channel, accumulate);
        }
    }
}

#[inline(always)]
fn transform_output_lanes<const L: usize>(
    products: &[f32],
    pixels: &mut [Option<&mut [f32]>; 4],
    channels: usize,
    start: usize,
    accumulate: bool,
) {
    let m: [[f32; L]; POSITIONS] =
        std::array::from_fn(|position| load(&products[position * channels..], start));
    // Rows: Aᵀ m, with Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]].
    let mut rows = [[0.0; L]; 8];
    for column in 0..4 {
        let [m0, m1, m2, m3] = [0, 1, 2, 3].map(|row| m[4 * row + column]);
        rows[column] = add(add(m0, m1), m2);
        rows[4 + column] = sub(sub(m1, m2), m3);
    }
    // Columns: (Aᵀ m) A.
    for row in 0..2 {
        let [r0, r1, r2, r3] = [0, 1, 2, 3].map(|column| rows[4 * row + column]);
        let values = [add(add(r0, r1), r2), sub(sub(r1, r2), r3)];
        for (column, value) in values.iter().enumerate() {
            if let Some(pixel) = pixels[2 * row + column].as_deref_mut() {
                let target = &mut pixel[start..][..L];
                if accumulate {
                    for (target, value) in target.iter_mut().zip(value) {
                        *target += value;
                    }
                } else {
                    target.copy_from_slice(value);
                }
            }
        }
    }
}

#[inline(always)]
fn load<const L: usize>(values: &[f32], start: usize) -> [f32; L] {
    std::array::from_fn(|lane| values[start + lane])
}

#[inline(always)]
fn add<const L: usize>(a: [f32; L], b: [f32; L]) -> [f32; L] {
    std::array::from_fn(|lane| a[lane] + b[lane])
}

#[inline(always)]
fn sub<const L: usize>(a: [f32; L], b: [f32; L]) -> [f32; L] {
    std::array::from_fn(|lane| a[lane] - b[lane])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel transform of a kernel with a single 1 reproduces `G`'s outer products.
    #[test]
    fn kernel_transform_of_a_unit_tap_is_an_outer_product_of_g() {
        let g = [
            [1.0, 0.0, 0.0],
            [0.5, 0.5, 0.5],
            [0.5, -0.5, 0.5],
            [0.0, 0.0, 1.0],
        ];
        for ky in 0..3 {
            for kx in 0..3 {
                let mut kernel = [[0.0; 3]; 3];
                kernel[ky][kx] = 1.0;
                let values = kernel_transform(&kernel);
                for i in 0..4 {
                    for j in 0..4 {
                        assert_eq!(
                            values[i][j],
                            g[i][ky] * g[j][kx],
                            "tap {ky},{kx} at {i},{j}"
                        );
                    }
                }
            }
        }
    }
}
