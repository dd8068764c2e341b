//! Direct convolution for layers with few channels (the seed-004 model's 8 to 64), where
//! im2col + GEMM spends more time copying and packing than multiplying.
//!
//! Everything here works on one image at a time, zero-padded into a scratch buffer so the
//! kernels never test for borders. A block of `R` neighbouring output pixels keeps its
//! `R x V` accumulators (`V` vectors of 8 output channels each) in AVX registers while it
//! walks the kernel taps and input channels: one broadcast input value per pixel times one
//! weight vector. The input gradient is the same correlation, run on the padded output
//! gradient with the kernel flipped and its channel axes swapped. The weight gradient adds,
//! over every output pixel, the outer product of that pixel's output gradient and the input
//! vector under each tap.
//!
//! Two special cases matter most for speed. With one output vector and a 3-wide kernel
//! (the bottleneck layers' 3x3 convolutions with 8 channels), each broadcast input value
//! feeds the three taps of its kernel row, cutting the loads per multiply by more than half;
//! the weight gradient likewise takes a kernel row's three taps together. A 1x1 stride-1
//! layer treats the image as one long row, so pixel blocks do not stop at row ends.
//!
//! The kernels need AVX2 and FMA, detected at run time; elsewhere [`is_available`] is false
//! and the caller uses im2col + GEMM.

use crate::shape::Conv2dShape;
use crate::simd;

/// Whether this CPU runs the direct kernels.
pub(crate) fn is_available() -> bool {
    simd::has_avx2_fma()
}

/// Whether the forward pass of `shape` runs on the direct kernels (any stride).
pub(crate) fn forward_applies(shape: &Conv2dShape) -> bool {
    is_available()
        && is_narrow(shape)
        && shape.stride >= 1
        && shape.padding < shape.kernel
        && is_vector_width(shape.out_channels)
}

/// Whether the backward pass of `shape` runs on the direct kernels (weight gradient, and the
/// input gradient when `needs_input_grad`).
pub(crate) fn backward_applies(shape: &Conv2dShape, needs_input_grad: bool) -> bool {
    is_available()
        && is_narrow(shape)
        && shape.stride == 1
        && shape.padding < shape.kernel
        && shape.in_channels.is_multiple_of(8)
        && shape.in_channels > 0
        && (!needs_input_grad || is_vector_width(shape.in_channels))
}

/// An output channel count the direct kernels handle: whole vectors of 8, not too many.
fn is_vector_width(channels: usize) -> bool {
    channels.is_multiple_of(8) && (8..=MAX_DIRECT_CHANNELS).contains(&channels)
}

/// Whether a layer is narrow enough for the direct kernels to beat im2col + GEMM: one side
/// at most 32 channels, the other at most 64. Wider layers (ResNet-18's 64 to 512) are 2.5x
/// faster on GEMM, whose cache blocking the direct kernels lack; narrower ones (the seed-004
/// model's) are faster direct.
fn is_narrow(shape: &Conv2dShape) -> bool {
    shape.in_channels.min(shape.out_channels) <= 32
        && shape.in_channels.max(shape.out_channels) <= MAX_DIRECT_CHANNELS
}

/// The most channels on either side of a direct layer.
const MAX_DIRECT_CHANNELS: usize = 64;

/// OHWI weights rearranged for the forward correlation: `[ky][kx][in][out]`.
pub(crate) fn forward_taps(shape: &Conv2dShape, weight: &[f32], taps: &mut Vec<f32>) {
    let (outputs, inputs, kernel) = (shape.out_channels, shape.in_channels, shape.kernel);
    taps.clear();
    taps.resize(weight.len(), 0.0);
    for out in 0..outputs {
        for tap in 0..kernel * kernel {
            for input in 0..inputs {
                taps[(tap * inputs + input) * outputs + out] =
                    weight[(out * kernel * kernel + tap) * inputs + input];
            }
        }
    }
}

/// OHWI weights rearranged for the input-gradient correlation: the kernel flipped on both
/// axes, channels swapped, `[ky][kx][out][in]`.
pub(crate) fn input_grad_taps(shape: &Conv2dShape, weight: &[f32], taps: &mut Vec<f32>) {
    let (outputs, inputs, kernel) = (shape.out_channels, shape.in_channels, shape.kernel);
    let taps_len = kernel * kernel;
    taps.clear();
    taps.resize(weight.len(), 0.0);
    for out in 0..outputs {
        for tap in 0..taps_len {
            let flipped = taps_len - 1 - tap;
            for input in 0..inputs {
                taps[(flipped * outputs + out) * inputs + input] =
                    weight[(out * taps_len + tap) * inputs + input];
            }
        }
    }
}

/// An image zero-padded on every side, ready for a correlation.
#[derive(Clone, Copy)]
pub(crate) struct PaddedImage<'a> {
    data: &'a [f32],
    height: usize,
    width: usize,
    channels: usize,
}

impl PaddedImage<'_> {
    /// The same pixels as one long row, for a 1x1 stride-1 kernel: the output is then one
    /// row too, in the same order, and pixel blocks run on across the image's rows.
    fn as_single_row_for(self, kernel: usize, stride: usize) -> Self {
        if kernel == 1 && stride == 1 {
            PaddedImage {
                height: 1,
                width: self.height * self.width,
                ..self
            }
        } else {
            self
        }
    }
}

/// One input image of `shape` zero-padded for the kernels (in `buffer`, unless unpadded).
pub(crate) fn padded_input<'a>(
    shape: &Conv2dShape,
    image: &'a [f32],
    buffer: &'a mut Vec<f32>,
) -> PaddedImage<'a> {
    pad_image(
        image,
        shape.in_height,
        shape.in_width,
        shape.in_channels,
        shape.padding,
        buffer,
    )
}

/// Pads one `[height, width, channels]` image with `padding` zeros on each side, copying
/// into `buffer` unless `padding` is 0.
pub(crate) fn pad_image<'a>(
    image: &'a [f32],
    height: usize,
    width: usize,
    channels: usize,
    padding: usize,
    buffer: &'a mut Vec<f32>,
) -> PaddedImage<'a> {
    assert_eq!(
        image.len(),
        height * width * channels,
        "pad_image: image length"
    );
    if padding == 0 {
        return PaddedImage {
            data: image,
            height,
            width,
            channels,
        };
    }
    let (padded_height, padded_width) = (height + 2 * padding, width + 2 * padding);
    let row_len = padded_width * channels;
    let border = padding * channels;
    // Only the border is zeroed; the interior is overwritten row by row.
    if buffer.len() < padded_height * row_len {
        buffer.resize(padded_height * row_len, 0.0);
    }
    let padded = &mut buffer[..padded_height * row_len];
    let (top, rest) = padded.split_at_mut(padding * row_len);
    let (middle, bottom) = rest.split_at_mut(height * row_len);
    top.fill(0.0);
    bottom.fill(0.0);
    for (row, source) in middle
        .chunks_exact_mut(row_len)
        .zip(image.chunks_exact(width * channels))
    {
        row[..border].fill(0.0);
        row[border..border + source.len()].copy_from_slice(source);
        row[border + source.len()..].fill(0.0);
    }
    PaddedImage {
        data: &buffer[..padded_height * row_len],
        height: padded_height,
        width: padded_width,
        channels,
    }
}

/// What a correlation's output starts from.
#[derive(Clone, Copy)]
pub(crate) enum Start<'a> {
    /// Zero.
    Zero,
    /// A per-channel bias.
    Bias(&'a [f32]),
    /// The values already in the output (the result is added to them).
    Existing,
}

/// `output[y][x][o] = start + Σ_{ky,kx,c} image[s·y+ky][s·x+kx][c] · taps[ky][kx][c][o]`
/// for stride `s`, `o` below `out_channels` (a multiple of 8) and every `(y, x)` where the
/// kernel fits.
pub(crate) fn correlate(
    image: &PaddedImage,
    kernel: usize,
    stride: usize,
    taps: &[f32],
    out_channels: usize,
    start: Start,
    output: &mut [f32],
) {
    let image = &image.as_single_row_for(kernel, stride);
    assert!(is_available() && out_channels.is_multiple_of(8) && out_channels > 0);
    assert!(kernel >= 1 && kernel <= image.height && kernel <= image.width && stride >= 1);
    let out_height = (image.height - kernel) / stride + 1;
    let out_width = (image.width - kernel) / stride + 1;
    assert_eq!(taps.len(), kernel * kernel * image.channels * out_channels);
    assert_eq!(output.len(), out_height * out_width * out_channels);
    assert_eq!(
        image.data.len(),
        image.height * image.width * image.channels
    );
    if let Start::Bias(bias) = start {
        assert_eq!(bias.len(), out_channels);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA are present (`is_available`), and the asserts above bound every
    // pointer the kernel forms: output pixel (y, x) reads rows `s·y..s·y+kernel` and columns
    // `s·x..s·x+kernel`, inside the padded image by the definition of the output size.
    unsafe {
        avx2::correlate(image, kernel, stride, taps, out_channels, start, output);
    }
}

/// Adds to `grad_weight` (OHWI, `out_channels` rows of `kernel² · channels`) the weight
/// gradient of one image: `Σ_{y,x} grad_output[y][x][o] · image[y+ky][x+kx][c]`.
pub(crate) fn accumulate_weight_grad(
    image: &PaddedImage,
    kernel: usize,
    grad_output: &[f32],
    out_channels: usize,
    grad_weight: &mut [f32],
) {
    let image = &image.as_single_row_for(kernel, 1);
    assert!(is_available() && image.channels.is_multiple_of(8) && image.channels > 0);
    assert!(kernel >= 1 && kernel <= image.height && kernel <= image.width);
    let (out_height, out_width) = (image.height - kernel + 1, image.width - kernel + 1);
    assert_eq!(grad_output.len(), out_height * out_width * out_channels);
    assert_eq!(
        grad_weight.len(),
        out_channels * kernel * kernel * image.channels
    );
    assert_eq!(
        image.data.len(),
        image.height * image.width * image.channels
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA are present, and the asserts above bound every access: for each
    // tap the kernel reads the `out_height x out_width` window at that tap's offset.
    unsafe {
        avx2::accumulate_weight_grad(image, kernel, grad_output, out_channels, grad_weight);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{PaddedImage, Start};

    /// Pixels per correlation block for `V` output vectors: as many accumulators as the
    /// 16 registers allow next to the weights and the broadcast.
    const fn block_pixels(vectors: usize) -> usize {
        match vectors {
            1 => 12,
            2 => 6,
            3 => 3,
            _ => 2,
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn correlate(
        image: &PaddedImage,
        kernel: usize,
        stride: usize,
        taps: &[f32],
        out_channels: usize,
        start: Start,
        output: &mut [f32],
    ) {
        // Output channels in groups of at most 4 vectors, the most a block holds in registers.
        let mut first_channel = 0;
        while first_channel < out_channels {
            let vectors = ((out_channels - first_channel) / 8).min(4);
            let layer = Layer {
                image,
                kernel,
                stride,
                taps,
                start,
                out_channels,
                first_channel,
            };
            match vectors {
                1 => correlate_with_step::<1>(&layer, output),
                2 => correlate_with_step::<2>(&layer, output),
                3 => correlate_with_step::<3>(&layer, output),
                _ => correlate_with_step::<4>(&layer, output),
            }
            first_channel += 8 * vectors;
        }
    }

    /// The arguments of one correlation, for the group of output channels starting at
    /// `first_channel`.
    struct Layer<'a, 'b> {
        image: &'a PaddedImage<'b>,
        kernel: usize,
        stride: usize,
        taps: &'a [f32],
        start: Start<'a>,
        out_channels: usize,
        first_channel: usize,
    }

    /// Picks a block kernel with the input channel count built in for stride 1 and the
    /// common counts, so each pixel's input is a constant offset from the block's first one
    /// and the channel loop has a known length.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn correlate_with_step<const V: usize>(layer: &Layer, output: &mut [f32]) {
        let channels = if layer.stride == 1 {
            layer.image.channels
        } else {
            0
        };
        match channels {
            8 => correlate_rows::<V, 8>(layer, output),
            16 => correlate_rows::<V, 16>(layer, output),
            32 => correlate_rows::<V, 32>(layer, output),
            64 => correlate_rows::<V, 64>(layer, output),
            _ => correlate_rows::<V, 0>(layer, output),
        }
    }

    /// `C` is the input channel count of a stride-1 correlation, or 0 for any channel count
    /// and stride, known only at run time.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn correlate_rows<const V: usize, const C: usize>(layer: &Layer, output: &mut [f32]) {
        let Layer {
            image,
            kernel,
            stride,
            taps,
            start,
            out_channels,
            first_channel,
        } = *layer;
        let out_width = (image.width - kernel) / stride + 1;
        let out_height = (image.height - kernel) / stride + 1;
        let row_stride = image.width * image.channels;
        let pixel_step = stride * image.channels;
        let three_wide = V == 1 && kernel == 3 && stride == 1;
        // The 3-wide kernel holds three taps' weights too, so fewer pixels.
        let block = if three_wide { 8 } else { block_pixels(V) };
        let input = image.data.as_ptr();
        let out = output.as_mut_ptr().add(first_channel);
        let bias = match start {
            Start::Bias(bias) => bias.as_ptr().add(first_channel),
            _ => std::ptr::null(),
        };
        let accumulate = matches!(start, Start::Existing);
        let geometry = BlockGeometry {
            row_stride,
            channels: image.channels,
            pixel_step,
            kernel,
            taps: taps.as_ptr().add(first_channel),
            out_channels,
            bias,
            accumulate,
        };
        for y in 0..out_height {
            let mut x = 0;
            while x < out_width {
                let pixels = block.min(out_width - x);
                let source = input.add(y * stride * row_stride + x * pixel_step);
                let target = out.add((y * out_width + x) * out_channels);
                if three_wide {
                    match pixels {
                        8 => correlate_block_3wide::<8, C>(&geometry, source, target),
                        7 => correlate_block_3wide::<7, C>(&geometry, source, target),
                        6 => correlate_block_3wide::<6, C>(&geometry, source, target),
                        5 => correlate_block_3wide::<5, C>(&geometry, source, target),
                        4 => correlate_block_3wide::<4, C>(&geometry, source, target),
                        3 => correlate_block_3wide::<3, C>(&geometry, source, target),
                        2 => correlate_block_3wide::<2, C>(&geometry, source, target),
                        _ => correlate_block_3wide::<1, C>(&geometry, source, target),
                    }
                    x += pixels;
                    continue;
                }
                match pixels {
                    12 => correlate_block::<12, V, C>(&geometry, source, target),
                    11 => correlate_block::<11, V, C>(&geometry, source, target),
                    10 => correlate_block::<10, V, C>(&geometry, source, target),
                    9 => correlate_block::<9, V, C>(&geometry, source, target),
                    8 => correlate_block::<8, V, C>(&geometry, source, target),
                    7 => correlate_block::<7, V, C>(&geometry, source, target),
                    6 => correlate_block::<6, V, C>(&geometry, source, target),
                    5 => correlate_block::<5, V, C>(&geometry, source, target),
                    4 => correlate_block::<4, V, C>(&geometry, source, target),
                    3 => correlate_block::<3, V, C>(&geometry, source, target),
                    2 => correlate_block::<2, V, C>(&geometry, source, target),
                    _ => correlate_block::<1, V, C>(&geometry, source, target),
                }
                x += pixels;
            }
        }
    }

    /// What every block of one correlation shares.
    struct BlockGeometry {
        row_stride: usize,
        channels: usize,
        pixel_step: usize,
        kernel: usize,
        /// The taps at the group's first output channel; rows `out_channels` apart.
        taps: *const f32,
        /// Distance between neighbouring output pixels, and between rows of the taps.
        out_channels: usize,
        bias: *const f32,
        accumulate: bool,
    }

    /// `R` neighbouring output pixels of one row; `source` is the padded input at the
    /// block's first pixel, `target` the output at that pixel.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn correlate_block<const R: usize, const V: usize, const C: usize>(
        geometry: &BlockGeometry,
        source: *const f32,
        target: *mut f32,
    ) {
        let mut sums = [[_mm256_setzero_ps(); V]; R];
        if geometry.accumulate {
            for (pixel, sum) in sums.iter_mut().enumerate() {
                for (vector, value) in sum.iter_mut().enumerate() {
                    *value =
                        _mm256_loadu_ps(target.add(pixel * geometry.out_channels + vector * 8));
                }
            }
        } else if !geometry.bias.is_null() {
            for sum in sums.iter_mut() {
                for (vector, value) in sum.iter_mut().enumerate() {
                    *value = _mm256_loadu_ps(geometry.bias.add(vector * 8));
                }
            }
        }
        let channels = if C == 0 { geometry.channels } else { C };
        let pixel_step = if C == 0 { geometry.pixel_step } else { C };
        // Within one kernel row the (kx, channel) pairs are contiguous in both the padded
        // input row and the taps.
        let row_span = geometry.kernel * channels;
        let mut tap = geometry.taps;
        for ky in 0..geometry.kernel {
            let row = source.add(ky * geometry.row_stride);
            for offset in 0..row_span {
                let mut weights = [_mm256_setzero_ps(); V];
                for (vector, weight) in weights.iter_mut().enumerate() {
                    *weight = _mm256_loadu_ps(tap.add(vector * 8));
                }
                for (pixel, sum) in sums.iter_mut().enumerate() {
                    let value = _mm256_broadcast_ss(&*row.add(pixel * pixel_step + offset));
                    for (acc, weight) in sum.iter_mut().zip(&weights) {
                        *acc = _mm256_fmadd_ps(value, *weight, *acc);
                    }
                }
                tap = tap.add(geometry.out_channels);
            }
        }
        for (pixel, sum) in sums.iter().enumerate() {
            for (vector, value) in sum.iter().enumerate() {
                _mm256_storeu_ps(
                    target.add(pixel * geometry.out_channels + vector * 8),
                    *value,
                );
            }
        }
    }

    /// [`correlate_block`] for one output vector and a 3x3 stride-1 kernel: each input value
    /// is broadcast once and multiplied by the three taps of its kernel row (for the three
    /// output pixels it reaches), instead of once per tap.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn correlate_block_3wide<const R: usize, const C: usize>(
        geometry: &BlockGeometry,
        source: *const f32,
        target: *mut f32,
    ) {
        let mut sums = [_mm256_setzero_ps(); R];
        if geometry.accumulate {
            for (pixel, sum) in sums.iter_mut().enumerate() {
                *sum = _mm256_loadu_ps(target.add(pixel * geometry.out_channels));
            }
        } else if !geometry.bias.is_null() {
            for sum in sums.iter_mut() {
                *sum = _mm256_loadu_ps(geometry.bias);
            }
        }
        let channels = if C == 0 { geometry.channels } else { C };
        let pixel_step = if C == 0 { geometry.pixel_step } else { C };
        let tap_row = geometry.out_channels;
        for ky in 0..3 {
            let row = source.add(ky * geometry.row_stride);
            let taps = geometry.taps.add(ky * 3 * channels * tap_row);
            for channel in 0..channels {
                let left = _mm256_loadu_ps(taps.add(channel * tap_row));
                let middle = _mm256_loadu_ps(taps.add((channels + channel) * tap_row));
                let right = _mm256_loadu_ps(taps.add((2 * channels + channel) * tap_row));
                // Input pixel q feeds output q (left tap), q - 1 (middle) and q - 2 (right).
                for q in 0..R + 2 {
                    let value = _mm256_broadcast_ss(&*row.add(q * pixel_step + channel));
                    if q < R {
                        sums[q] = _mm256_fmadd_ps(value, left, sums[q]);
                    }
                    if (1..=R).contains(&q) {
                        sums[q - 1] = _mm256_fmadd_ps(value, middle, sums[q - 1]);
                    }
                    if q >= 2 {
                        sums[q - 2] = _mm256_fmadd_ps(value, right, sums[q - 2]);
                    }
                }
            }
        }
        for (pixel, sum) in sums.iter().enumerate() {
            _mm256_storeu_ps(target.add(pixel * geometry.out_channels), *sum);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate_weight_grad(
        image: &PaddedImage,
        kernel: usize,
        grad_output: &[f32],
        out_channels: usize,
        grad_weight: &mut [f32],
    ) {
        let channels = image.channels;
        let patch_len = kernel * kernel * channels;
        let geometry = WindowGeometry {
            row_stride: image.width * channels,
            channels,
            out_height: image.height - kernel + 1,
            out_width: image.width - kernel + 1,
            out_channels,
            patch_len,
        };
        let mut channel = 0;
        while channel < channels {
            if kernel == 3 {
                for ky in 0..3 {
                    let window = image.data.as_ptr().add(ky * geometry.row_stride + channel);
                    let target = grad_weight.as_mut_ptr().add(ky * 3 * channels + channel);
                    weight_grad_rows_3wide(&geometry, window, grad_output.as_ptr(), target);
                }
                channel += 8;
                continue;
            }
            let vectors = if channels - channel >= 16 { 2 } else { 1 };
            for ky in 0..kernel {
                for kx in 0..kernel {
                    let window = image
                        .data
                        .as_ptr()
                        .add(ky * geometry.row_stride + kx * channels + channel);
                    let target = grad_weight
                        .as_mut_ptr()
                        .add((ky * kernel + kx) * channels + channel);
                    if vectors == 2 {
                        weight_grad_rows::<2>(&geometry, window, grad_output.as_ptr(), target);
                    } else {
                        weight_grad_rows::<1>(&geometry, window, grad_output.as_ptr(), target);
                    }
                }
            }
            channel += 8 * vectors;
        }
    }

    /// What every block of one weight-gradient pass shares.
    struct WindowGeometry {
        row_stride: usize,
        channels: usize,
        out_height: usize,
        out_width: usize,
        out_channels: usize,
        patch_len: usize,
    }

    /// One tap and `8·V` input channels, all output channels in blocks of `O`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weight_grad_rows<const V: usize>(
        geometry: &WindowGeometry,
        window: *const f32,
        grad_output: *const f32,
        target: *mut f32,
    ) {
        // Blocks that divide the usual channel counts (multiples of 8) evenly.
        let block = if V == 1 { 8 } else { 4 };
        let mut out = 0;
        while out < geometry.out_channels {
            let rows = block.min(geometry.out_channels - out);
            let grad = grad_output.add(out);
            let dst = target.add(out * geometry.patch_len);
            match rows {
                8 => weight_grad_block::<8, V>(geometry, window, grad, dst),
                7 => weight_grad_block::<7, V>(geometry, window, grad, dst),
                6 => weight_grad_block::<6, V>(geometry, window, grad, dst),
                5 => weight_grad_block::<5, V>(geometry, window, grad, dst),
                4 => weight_grad_block::<4, V>(geometry, window, grad, dst),
                3 => weight_grad_block::<3, V>(geometry, window, grad, dst),
                2 => weight_grad_block::<2, V>(geometry, window, grad, dst),
                _ => weight_grad_block::<1, V>(geometry, window, grad, dst),
            }
            out += rows;
        }
    }

    /// One kernel row of a 3-wide kernel and 8 input channels: the three taps together, so
    /// each output-gradient value is broadcast once for all three.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weight_grad_rows_3wide(
        geometry: &WindowGeometry,
        window: *const f32,
        grad_output: *const f32,
        target: *mut f32,
    ) {
        // 3 taps x 3 outputs accumulators, 3 inputs and a broadcast: 13 of the 16 registers.
        let mut out = 0;
        while out < geometry.out_channels {
            let rows = 3.min(geometry.out_channels - out);
            let grad = grad_output.add(out);
            let dst = target.add(out * geometry.patch_len);
            match rows {
                3 => weight_grad_block_3wide::<3>(geometry, window, grad, dst),
                2 => weight_grad_block_3wide::<2>(geometry, window, grad, dst),
                _ => weight_grad_block_3wide::<1>(geometry, window, grad, dst),
            }
            out += rows;
        }
    }

    /// `target[o][kx][0..8] += Σ_{y,x} grad[y][x][o] · window[y][x+kx][0..8]` for the three
    /// `kx` and `O` output channels.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weight_grad_block_3wide<const O: usize>(
        geometry: &WindowGeometry,
        window: *const f32,
        grad: *const f32,
        target: *mut f32,
    ) {
        let mut sums = [[_mm256_setzero_ps(); O]; 3];
        let channels = geometry.channels;
        for y in 0..geometry.out_height {
            let window_row = window.add(y * geometry.row_stride);
            let grad_row = grad.add(y * geometry.out_width * geometry.out_channels);
            for x in 0..geometry.out_width {
                let mut inputs = [_mm256_setzero_ps(); 3];
                for (kx, input) in inputs.iter_mut().enumerate() {
                    *input = _mm256_loadu_ps(window_row.add((x + kx) * channels));
                }
                let grad_pixel = grad_row.add(x * geometry.out_channels);
                for out in 0..O {
                    let value = _mm256_broadcast_ss(&*grad_pixel.add(out));
                    for (tap, input) in sums.iter_mut().zip(&inputs) {
                        tap[out] = _mm256_fmadd_ps(value, *input, tap[out]);
                    }
                }
            }
        }
        for (kx, tap) in sums.iter().enumerate() {
            for (out, value) in tap.iter().enumerate() {
                let place = target.add(out * geometry.patch_len + kx * channels);
                _mm256_storeu_ps(place, _mm256_add_ps(_mm256_loadu_ps(place), *value));
            }
        }
    }

    /// `target[o][0..8V] += Σ_{y,x} grad[y][x][o] · window[y][x][0..8V]` for `O` output
    /// channels, with the sums held in registers over the whole image.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weight_grad_block<const O: usize, const V: usize>(
        geometry: &WindowGeometry,
        window: *const f32,
        grad: *const f32,
        target: *mut f32,
    ) {
        let mut sums = [[_mm256_setzero_ps(); V]; O];
        for y in 0..geometry.out_height {
            let window_row = window.add(y * geometry.row_stride);
            let grad_row = grad.add(y * geometry.out_width * geometry.out_channels);
            for x in 0..geometry.out_width {
                let mut inputs = [_mm256_setzero_ps(); V];
                for (vector, input) in inputs.iter_mut().enumerate() {
                    *input = _mm256_loadu_ps(window_row.add(x * geometry.channels + vector * 8));
                }
                let grad_pixel = grad_row.add(x * geometry.out_channels);
                for (out, sum) in sums.iter_mut().enumerate() {
                    let value = _mm256_broadcast_ss(&*grad_pixel.add(out));
                    for (acc, input) in sum.iter_mut().zip(&inputs) {
                        *acc = _mm256_fmadd_ps(value, *input, *acc);
                    }
                }
            }
        }
        for (out, sum) in sums.iter().enumerate() {
            for (vector, value) in sum.iter().enumerate() {
                let place = target.add(out * geometry.patch_len + vector * 8);
                _mm256_storeu_ps(place, _mm256_add_ps(_mm256_loadu_ps(place), *value));
            }
        }
    }
}
