//! 2-D convolution over NHWC tensors, PyTorch `Conv2d` semantics (square kernel, equal
//! stride and zero padding on both axes, no dilation, no groups).
//!
//! Weights are stored `[out_channels, kernel, kernel, in_channels]` (OHWI): one row of
//! `kernel * kernel * in_channels` values per output channel, matching the im2col patch
//! order, so the layer is `output[rows, out] = patches[rows, patch] × weightᵀ`. A 1x1
//! stride-1 unpadded convolution skips im2col: an NHWC tensor already is the
//! `[pixels, channels]` matrix.
//!
//! Three kernels compute the forward pass and the input gradient, chosen by shape: direct
//! kernels for narrow layers (`direct`), Winograd F(2x2, 3x3) for wider 3x3 stride-1
//! padding-1 layers (`winograd`), and im2col + GEMM for the rest. The weight gradient runs
//! on the direct kernels or on im2col + GEMM.
//!
//! Work is split by images into one fixed part per worker; each worker walks its part in
//! chunks of a few images so the patch matrix stays small and in cache.

use rayon::prelude::*;

use crate::batchnorm::{self, BackwardCoefficients, OutputGrad};
use crate::channels::{ChannelTile, ColumnSums};
use crate::direct::{self, Start};
use crate::matmul::{matmul, MatRef};
use crate::scratch::grow;
use crate::shape::Conv2dShape;
use crate::threads::threads;
use crate::winograd::{self, Plane, WinogradScratch};

/// Rows of the patch matrix one chunk aims for: big enough for efficient GEMM, small
/// enough that the patches stay in cache.
const TARGET_CHUNK_ROWS: usize = 256;

/// How the CPU kernels split a convolution into chunks and worker parts.
impl Conv2dShape {
    fn images_per_chunk(&self) -> usize {
        (TARGET_CHUNK_ROWS / self.output_pixels().max(1)).clamp(1, self.batch.max(1))
    }

    /// Images each worker handles: equal parts, whole chunks, one part per worker.
    fn images_per_worker(&self) -> usize {
        let per_chunk = self.images_per_chunk();
        let chunks = self.batch.div_ceil(per_chunk);
        chunks.div_ceil(threads().max(1)).max(1) * per_chunk
    }

    fn columns_len(&self) -> usize {
        if self.is_pointwise() {
            0
        } else {
            self.images_per_chunk() * self.output_pixels() * self.patch_len()
        }
    }
}

/// Per-worker buffers of the convolution kernels, grown on first use and then reused.
#[derive(Default)]
pub struct ConvScratch {
    workers: Vec<WorkerScratch>,
    /// The weights rearranged for the direct kernels.
    taps: Vec<f32>,
    /// The epilogue's scale and shift as tiles.
    epilogue_scale: ChannelTile,
    epilogue_shift: ChannelTile,
    /// The bias gradient summed over the workers.
    bias_totals: Vec<f64>,
}

#[derive(Default)]
struct WorkerScratch {
    columns: Vec<f32>,
    /// The output gradient of the current chunk, when it is computed on the fly.
    grad_output: Vec<f32>,
    output_sums: ColumnSums,
    weight_grad: Vec<f32>,
    /// Per-channel sums of the output gradient: the partial bias gradient.
    bias_sums: ColumnSums,
    winograd: WinogradScratch,
}

impl ConvScratch {
    fn prepare(&mut self, workers: usize, columns: usize, weight_grad: usize) {
        if self.workers.len() < workers {
            self.workers.resize_with(workers, WorkerScratch::default);
        }
        for worker in &mut self.workers[..workers] {
            grow(&mut worker.columns, columns);
            grow(&mut worker.weight_grad, weight_grad);
        }
    }
}

/// The gradient at a convolution's output.
#[derive(Clone, Copy)]
pub enum ConvOutputGrad<'a> {
    /// A tensor shaped like the output.
    Values(&'a [f32]),
    /// Through the training-mode batch norm that follows the convolution: computed chunk by
    /// chunk inside the backward pass, never written out whole.
    ThroughBatchNorm {
        /// The gradient at the batch norm's output.
        grad: OutputGrad<'a>,
        /// The batch norm's input: this convolution's output.
        bn_input: &'a [f32],
        /// The batch norm's input-gradient coefficients.
        coefficients: &'a BackwardCoefficients,
    },
}

impl<'a> ConvOutputGrad<'a> {
    fn len(&self) -> usize {
        match self {
            ConvOutputGrad::Values(values) => values.len(),
            ConvOutputGrad::ThroughBatchNorm { bn_input, .. } => bn_input.len(),
        }
    }

    /// The gradient of the values in `range` (whole rows).
    fn part(&self, range: std::ops::Range<usize>) -> ConvOutputGrad<'a> {
        match *self {
            ConvOutputGrad::Values(values) => ConvOutputGrad::Values(&values[range]),
            ConvOutputGrad::ThroughBatchNorm {
                grad,
                bn_input,
                coefficients,
            } => ConvOutputGrad::ThroughBatchNorm {
                grad: OutputGrad {
                    values: &grad.values[range.clone()],
                    relu_output: grad.relu_output.map(|relu| &relu[range.clone()]),
                },
                bn_input: &bn_input[range],
                coefficients,
            },
        }
    }

    /// The gradient values: as given, or computed into `buffer`.
    fn values<'b>(&self, buffer: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            ConvOutputGrad::Values(values) => values,
            ConvOutputGrad::ThroughBatchNorm {
                grad,
                bn_input,
                coefficients,
            } => {
                if buffer.len() < bn_input.len() {
                    buffer.resize(bn_input.len(), 0.0);
                }
                let values = &mut buffer[..bn_input.len()];
                coefficients.input_gradient(grad, bn_input, values);
                values
            }
        }
    }
}

/// Where the backward pass puts the input gradient.
pub enum InputGrad<'a> {
    /// The input gradient is not needed (e.g. the first layer).
    Skip,
    /// Write the input gradient, replacing what the slice holds.
    Overwrite(&'a mut [f32]),
    /// Add the input gradient to what the slice holds.
    Accumulate(&'a mut [f32]),
}

/// Forward: `output = conv(input, weight) + bias`.
///
/// `input` is `[batch, in_height, in_width, in_channels]`, `weight` OHWI, `bias`
/// `[out_channels]`, `output` `[batch, out_height, out_width, out_channels]`.
pub fn conv2d_forward(
    shape: &Conv2dShape,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    output: &mut [f32],
    scratch: &mut ConvScratch,
) {
    conv2d_forward_fused(shape, input, weight, bias, Fused::Nothing, output, scratch);
}

/// What [`conv2d_forward_fused`] does with each part of the output while it is in cache.
pub enum Fused<'a, 'b> {
    /// Nothing: a plain convolution.
    Nothing,
    /// Transform the output in place (inference-mode batch norm, residual, ReLU).
    Epilogue(Epilogue<'a>),
    /// Gather the output's per-channel `[Σx…, Σx²…]` into the vector (training-mode batch
    /// norm statistics, without a pass of their own).
    OutputSums(&'b mut Vec<f64>),
}

/// What [`conv2d_forward_fused`] applies to each part of the output while it is still in
/// cache: `output = [relu](output · scale + shift [+ residual])`, per output channel. An
/// inference-mode batch norm, residual add and ReLU, without a pass of their own.
#[derive(Clone, Copy)]
pub struct Epilogue<'a> {
    /// Per-channel factor.
    pub scale: &'a [f32],
    /// Per-channel offset.
    pub shift: &'a [f32],
    /// A tensor shaped like the output, added after the affine map.
    pub residual: Option<&'a [f32]>,
    /// Whether negative results become zero.
    pub relu: bool,
}

impl Epilogue<'_> {
    fn check_lengths(&self, shape: &Conv2dShape) {
        let channels = shape.out_channels;
        assert_eq!(self.scale.len(), channels, "conv2d: epilogue scale");
        assert_eq!(self.shift.len(), channels, "conv2d: epilogue shift");
        if let Some(residual) = self.residual {
            assert_eq!(
                residual.len(),
                shape.output_len(),
                "conv2d: epilogue residual"
            );
        }
    }
}

/// [`conv2d_forward`] with the work that `fused` names done on each image chunk right after
/// it is computed.
pub fn conv2d_forward_fused(
    shape: &Conv2dShape,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    fused: Fused,
    output: &mut [f32],
    scratch: &mut ConvScratch,
) {
    shape.check_lengths(input, weight, output.len());
    let (epilogue, mut output_sums) = match fused {
        Fused::Nothing => (None, None),
        Fused::Epilogue(epilogue) => (Some(epilogue), None),
        Fused::OutputSums(sums) => (None, Some(sums)),
    };
    if let Some(epilogue) = &epilogue {
        epilogue.check_lengths(shape);
    }
    if let Some(sums) = output_sums.as_deref_mut() {
        sums.clear();
        sums.resize(2 * shape.out_channels, 0.0);
    }
    if shape.batch == 0 {
        return;
    }
    let images_per_worker = shape.images_per_worker();
    let workers = shape.batch.div_ceil(images_per_worker);
    scratch.prepare(workers, shape.columns_len(), 0);
    let kernel = if direct::forward_applies(shape) {
        direct::forward_taps(shape, weight, &mut scratch.taps);
        ForwardKernel::Direct {
            taps: &scratch.taps,
            start: bias.map_or(Start::Zero, Start::Bias),
        }
    } else if winograd::applies(shape) {
        winograd::forward_weights(shape, weight, &mut scratch.taps);
        ForwardKernel::Winograd {
            weights: &scratch.taps,
            bias,
        }
    } else {
        ForwardKernel::Gemm {
            weight_t: MatRef::row_major(weight, shape.out_channels, shape.patch_len()).transposed(),
            bias,
        }
    };
    let tiles = epilogue.as_ref().map(|epilogue| {
        let channels = shape.out_channels;
        scratch
            .epilogue_scale
            .refill(channels, |c| epilogue.scale[c]);
        scratch
            .epilogue_shift
            .refill(channels, |c| epilogue.shift[c]);
        EpilogueTiles {
            scale: &scratch.epilogue_scale.values,
            shift: &scratch.epilogue_shift.values,
            relu: epilogue.relu,
        }
    });
    let part_len = images_per_worker * shape.output_image_len();
    let residual = epilogue.as_ref().and_then(|epilogue| epilogue.residual);
    let gather_sums = output_sums.is_some();
    if gather_sums {
        for worker in &mut scratch.workers[..workers] {
            worker.output_sums.reset(shape.out_channels);
        }
    }
    scratch.workers[..workers]
        .par_iter_mut()
        .zip(input.par_chunks(images_per_worker * shape.input_image_len()))
        .zip(output.par_chunks_mut(part_len))
        .enumerate()
        .for_each(|(part, ((worker, input_part), output_part))| {
            let residual_part = residual.map(|residual| &residual[part * part_len..]);
            let images = kernel.images_per_chunk(shape);
            let input_chunks = input_part.chunks(images * shape.input_image_len());
            let output_chunks = output_part.chunks_mut(images * shape.output_image_len());
            for (index, (input_chunk, output_chunk)) in input_chunks.zip(output_chunks).enumerate()
            {
                kernel.run(shape, input_chunk, output_chunk, worker);
                if let Some(tiles) = &tiles {
                    let chunk_len = images * shape.output_image_len();
                    let residual =
                        residual_part.map(|part| &part[index * chunk_len..][..output_chunk.len()]);
                    apply_epilogue(tiles, residual, output_chunk);
                }
                if gather_sums {
                    worker.output_sums.add(output_chunk);
                }
            }
        });
    if let Some(sums) = output_sums {
        for worker in &scratch.workers[..workers] {
            worker.output_sums.add_to(sums);
        }
    }
}

/// How the forward pass computes a chunk of images.
enum ForwardKernel<'a> {
    /// The direct kernels, image by image, with the weights as taps.
    Direct { taps: &'a [f32], start: Start<'a> },
    /// Winograd F(2x2, 3x3), with the weights transformed.
    Winograd {
        weights: &'a [f32],
        bias: Option<&'a [f32]>,
    },
    /// im2col + GEMM, a few images at a time.
    Gemm {
        weight_t: MatRef<'a>,
        bias: Option<&'a [f32]>,
    },
}

impl ForwardKernel<'_> {
    fn images_per_chunk(&self, shape: &Conv2dShape) -> usize {
        match self {
            ForwardKernel::Direct { .. } => 1,
            ForwardKernel::Winograd { .. } => winograd::images_per_chunk(&Plane::of(shape)),
            ForwardKernel::Gemm { .. } => shape.images_per_chunk(),
        }
    }

    /// `output_chunk = conv(input_chunk) + bias`, in `worker`'s scratch buffers.
    fn run(
        &self,
        shape: &Conv2dShape,
        input_chunk: &[f32],
        output_chunk: &mut [f32],
        worker: &mut WorkerScratch,
    ) {
        match *self {
            ForwardKernel::Direct { taps, start } => {
                let padded = direct::padded_input(shape, input_chunk, &mut worker.columns);
                direct::correlate(
                    &padded,
                    shape.kernel,
                    shape.stride,
                    taps,
                    shape.out_channels,
                    start,
                    output_chunk,
                );
            }
            ForwardKernel::Winograd { weights, bias } => {
                winograd::correlate(
                    &Plane::of(shape),
                    input_chunk,
                    weights,
                    output_chunk,
                    false,
                    &mut worker.winograd,
                );
                if let Some(bias) = bias {
                    add_per_channel(output_chunk, bias);
                }
            }
            ForwardKernel::Gemm { weight_t, bias } => {
                let rows = output_chunk.len() / shape.out_channels;
                let patches = patch_matrix(shape, input_chunk, rows, &mut worker.columns);
                matmul(output_chunk, shape.out_channels, patches, weight_t, false);
                if let Some(bias) = bias {
                    add_per_channel(output_chunk, bias);
                }
            }
        }
    }
}

/// Adds `values[c]` to channel `c` of every row of `data` (`[rows, channels]`).
fn add_per_channel(data: &mut [f32], values: &[f32]) {
    for row in data.chunks_exact_mut(values.len()) {
        for (value, add) in row.iter_mut().zip(values) {
            *value += add;
        }
    }
}

/// An [`Epilogue`]'s scale and shift repeated over a tile of whole rows, so the per-element
/// loop runs over long slices (which vectorize) rather than one short row at a time.
struct EpilogueTiles<'a> {
    scale: &'a [f32],
    shift: &'a [f32],
    relu: bool,
}

/// `output = [relu](output · scale + shift [+ residual])`, tile by tile.
fn apply_epilogue(tiles: &EpilogueTiles, residual: Option<&[f32]>, output: &mut [f32]) {
    batchnorm::scale_shift(output, residual, tiles.scale, tiles.shift, tiles.relu);
}

/// Backward: adds the weight (and bias) gradients to `grad_weight` (`grad_bias`) and
/// writes or adds the input gradient as `grad_input` says.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    shape: &Conv2dShape,
    input: &[f32],
    weight: &[f32],
    grad_output: ConvOutputGrad,
    grad_weight: &mut [f32],
    grad_bias: Option<&mut [f32]>,
    grad_input: InputGrad,
    scratch: &mut ConvScratch,
) {
    shape.check_lengths(input, weight, grad_output.len());
    assert_eq!(
        grad_weight.len(),
        shape.weight_len(),
        "conv2d: weight gradient length"
    );
    if shape.batch == 0 {
        return;
    }
    let images_per_worker = shape.images_per_worker();
    let workers = shape.batch.div_ceil(images_per_worker);
    scratch.prepare(workers, shape.columns_len(), shape.weight_len());
    let accumulate_input = matches!(grad_input, InputGrad::Accumulate(_));
    let sum_bias = grad_bias.is_some();
    let input_grad_parts: Vec<Option<&mut [f32]>> = match grad_input {
        InputGrad::Skip => (0..workers).map(|_| None).collect(),
        InputGrad::Overwrite(grad) | InputGrad::Accumulate(grad) => {
            assert_eq!(
                grad.len(),
                shape.input_len(),
                "conv2d: input gradient length"
            );
            grad.chunks_mut(images_per_worker * shape.input_image_len())
                .map(Some)
                .collect()
        }
    };
    let wants_input_grad = input_grad_parts[0].is_some();
    let use_direct = direct::backward_applies(shape, wants_input_grad);
    let use_winograd = !use_direct && wants_input_grad && winograd::applies(shape);
    if use_direct {
        direct::input_grad_taps(shape, weight, &mut scratch.taps);
    } else if use_winograd {
        winograd::input_grad_weights(shape, weight, &mut scratch.taps);
    }
    let taps = &scratch.taps;
    let winograd_weights = use_winograd.then_some(taps.as_slice());
    let part_len = images_per_worker * shape.output_image_len();
    scratch.workers[..workers]
        .par_iter_mut()
        .zip(input.par_chunks(images_per_worker * shape.input_image_len()))
        .zip(input_grad_parts.into_par_iter())
        .enumerate()
        .for_each(|(part, ((worker, input_part), grad_input_part))| {
            let start = part * part_len;
            let grad_output_part =
                grad_output.part(start..(start + part_len).min(shape.output_len()));
            let parts = WorkerParts {
                input: input_part,
                grad_output: grad_output_part,
                grad_input: grad_input_part,
                accumulate_input,
                sum_bias,
            };
            if use_direct {
                backward_worker_direct(shape, taps, parts, worker);
            } else {
                backward_worker(shape, weight, winograd_weights, parts, worker);
            }
        });
    for worker in &scratch.workers[..workers] {
        for (total, partial) in grad_weight.iter_mut().zip(&worker.weight_grad) {
            *total += partial;
        }
    }
    if let Some(grad_bias) = grad_bias {
        let totals = &mut scratch.bias_totals;
        totals.clear();
        totals.resize(2 * shape.out_channels, 0.0);
        for worker in &scratch.workers[..workers] {
            worker.bias_sums.add_to(totals);
        }
        for (total, sum) in grad_bias.iter_mut().zip(&totals[..shape.out_channels]) {
            *total += *sum as f32;
        }
    }
}

/// One worker's share of the backward pass: partial weight and bias gradients over its
/// images, and the input gradient of those images (on Winograd when `winograd_weights`, the
/// weights transformed for it, are given).
fn backward_worker(
    shape: &Conv2dShape,
    weight: &[f32],
    winograd_weights: Option<&[f32]>,
    parts: WorkerParts,
    worker: &mut WorkerScratch,
) {
    let WorkerParts {
        input: input_part,
        grad_output: grad_output_part,
        grad_input: mut grad_input_part,
        accumulate_input,
        sum_bias,
    } = parts;
    let (out_channels, patch_len) = (shape.out_channels, shape.patch_len());
    worker.weight_grad[..shape.weight_len()].fill(0.0);
    worker.bias_sums.reset(shape.out_channels);
    let weight_matrix = MatRef::row_major(weight, out_channels, patch_len);
    let chunk_images = shape.images_per_chunk();
    let chunk_output_len = chunk_images * shape.output_image_len();
    let input_chunks = input_part.chunks(chunk_images * shape.input_image_len());
    for (chunk_index, input_chunk) in input_chunks.enumerate() {
        let start = chunk_index * chunk_output_len;
        let end = (start + chunk_output_len).min(grad_output_part.len());
        let grad_output_chunk = grad_output_part
            .part(start..end)
            .values(&mut worker.grad_output);
        let rows = grad_output_chunk.len() / out_channels;
        let grad_output_matrix = MatRef::row_major(grad_output_chunk, rows, out_channels);
        let patches = patch_matrix(shape, input_chunk, rows, &mut worker.columns);
        matmul(
            &mut worker.weight_grad[..shape.weight_len()],
            patch_len,
            grad_output_matrix.transposed(),
            patches,
            true,
        );
        if sum_bias {
            worker.bias_sums.add(grad_output_chunk);
        }
        let Some(grad_input_part) = grad_input_part.as_deref_mut() else {
            continue;
        };
        let chunk_input_len = chunk_images * shape.input_image_len();
        let start = chunk_index * chunk_input_len;
        let grad_input_chunk = &mut grad_input_part[start..start + input_chunk.len()];
        if let Some(weights) = winograd_weights {
            let plane = Plane::of(shape).reversed();
            winograd::correlate(
                &plane,
                grad_output_chunk,
                weights,
                grad_input_chunk,
                accumulate_input,
                &mut worker.winograd,
            );
        } else if shape.is_pointwise() {
            matmul(
                grad_input_chunk,
                shape.in_channels,
                grad_output_matrix,
                weight_matrix,
                accumulate_input,
            );
        } else {
            let grad_columns = &mut worker.columns[..rows * patch_len];
            matmul(
                grad_columns,
                patch_len,
                grad_output_matrix,
                weight_matrix,
                false,
            );
            if !accumulate_input {
                grad_input_chunk.fill(0.0);
            }
            col2im_add(shape, grad_columns, grad_input_chunk);
        }
    }
}

/// One worker's slices of a backward pass.
struct WorkerParts<'a> {
    input: &'a [f32],
    grad_output: ConvOutputGrad<'a>,
    grad_input: Option<&'a mut [f32]>,
    accumulate_input: bool,
    /// Whether the layer has a bias whose gradient is wanted.
    sum_bias: bool,
}

/// [`backward_worker`] on the direct kernels, one image at a time; `taps` are the weights
/// arranged for the input gradient.
fn backward_worker_direct(
    shape: &Conv2dShape,
    taps: &[f32],
    parts: WorkerParts,
    worker: &mut WorkerScratch,
) {
    let WorkerParts {
        input: input_part,
        grad_output: grad_output_part,
        grad_input: grad_input_part,
        accumulate_input,
        sum_bias,
    } = parts;
    worker.weight_grad[..shape.weight_len()].fill(0.0);
    worker.bias_sums.reset(shape.out_channels);
    let images = input_part.chunks(shape.input_image_len());
    let mut grad_inputs = grad_input_part.map(|part| part.chunks_mut(shape.input_image_len()));
    let image_len = shape.output_image_len();
    for (index, image) in images.enumerate() {
        let grad_output_image = grad_output_part
            .part(index * image_len..(index + 1) * image_len)
            .values(&mut worker.grad_output);
        let padded = direct::padded_input(shape, image, &mut worker.columns);
        direct::accumulate_weight_grad(
            &padded,
            shape.kernel,
            grad_output_image,
            shape.out_channels,
            &mut worker.weight_grad[..shape.weight_len()],
        );
        if sum_bias {
            worker.bias_sums.add(grad_output_image);
        }
        let Some(grad_input_image) = grad_inputs.as_mut().and_then(|parts| parts.next()) else {
            continue;
        };
        let padded_grad = direct::pad_image(
            grad_output_image,
            shape.out_height(),
            shape.out_width(),
            shape.out_channels,
            shape.kernel - 1 - shape.padding,
            &mut worker.columns,
        );
        let start = if accumulate_input {
            Start::Existing
        } else {
            Start::Zero
        };
        direct::correlate(
            &padded_grad,
            shape.kernel,
            1,
            taps,
            shape.in_channels,
            start,
            grad_input_image,
        );
    }
}

/// The `[rows, patch_len]` patch matrix of a chunk of images: the input itself for a
/// pointwise convolution, else im2col into `columns`.
fn patch_matrix<'a>(
    shape: &Conv2dShape,
    input_chunk: &'a [f32],
    rows: usize,
    columns: &'a mut [f32],
) -> MatRef<'a> {
    if shape.is_pointwise() {
        MatRef::row_major(input_chunk, rows, shape.in_channels)
    } else {
        let columns = &mut columns[..rows * shape.patch_len()];
        im2col(shape, input_chunk, columns);
        MatRef::row_major(columns, rows, shape.patch_len())
    }
}

/// For one output pixel and one kernel row `ky`, the input row `iy` it reads (if inside the
/// image) and the range of kernel columns `kx` that fall inside the image, with the first
/// input column they read.
struct TapSpan {
    input_row: usize,
    first_input_col: usize,
    kernel_cols: std::ops::Range<usize>,
}

fn tap_span(shape: &Conv2dShape, out_y: usize, out_x: usize, ky: usize) -> Option<TapSpan> {
    let input_row = (out_y * shape.stride + ky).checked_sub(shape.padding)?;
    if input_row >= shape.in_height {
        return None;
    }
    let left = out_x * shape.stride;
    // Kernel column kx reads input column left + kx - padding.
    let first_kx = shape.padding.saturating_sub(left);
    let end_kx = (shape.in_width + shape.padding)
        .saturating_sub(left)
        .min(shape.kernel);
    if first_kx >= end_kx {
        return None;
    }
    Some(TapSpan {
        input_row,
        first_input_col: left + first_kx - shape.padding,
        kernel_cols: first_kx..end_kx,
    })
}

/// Where one kernel row of one patch reads the images: `values` among the images' values,
/// filling `columns` of the kernel row (the rest of the kernel row falls in the padding).
struct Tap {
    values: std::ops::Range<usize>,
    columns: std::ops::Range<usize>,
}

/// Calls `visit(kernel_row, tap)` for every kernel row of every output pixel's receptive
/// field over the whole images among `images_len` values: the kernel row's range in the
/// patch matrix, and its tap (`None` where the whole kernel row falls in the padding).
fn for_each_tap(
    shape: &Conv2dShape,
    images_len: usize,
    mut visit: impl FnMut(std::ops::Range<usize>, Option<Tap>),
) {
    let channels = shape.in_channels;
    let row_span = shape.kernel * channels;
    let pixels = shape.out_height() * shape.out_width();
    let images = images_len / shape.input_image_len();
    for patch in 0..images * pixels {
        let (image, pixel) = (patch / pixels, patch % pixels);
        let (out_y, out_x) = (pixel / shape.out_width(), pixel % shape.out_width());
        let image_start = image * shape.input_image_len();
        for ky in 0..shape.kernel {
            let tap = tap_span(shape, out_y, out_x, ky).map(|span| {
                let start = image_start
                    + (span.input_row * shape.in_width + span.first_input_col) * channels;
                Tap {
                    values: start..start + span.kernel_cols.len() * channels,
                    columns: span.kernel_cols.start * channels..span.kernel_cols.end * channels,
                }
            });
            let row_start = patch * shape.patch_len() + ky * row_span;
            visit(row_start..row_start + row_span, tap);
        }
    }
}

/// Copies each output pixel's receptive field (zeros where it falls in the padding) into
/// one row of `columns`, in `(ky, kx, channel)` order.
fn im2col(shape: &Conv2dShape, images: &[f32], columns: &mut [f32]) {
    for_each_tap(shape, images.len(), |kernel_row, tap| {
        let row = &mut columns[kernel_row];
        let Some(tap) = tap else {
            row.fill(0.0);
            return;
        };
        row[..tap.columns.start].fill(0.0);
        row[tap.columns.clone()].copy_from_slice(&images[tap.values]);
        row[tap.columns.end..].fill(0.0);
    });
}

/// The adjoint of [`im2col`]: adds each patch-row gradient back onto the input pixels it
/// was read from.
fn col2im_add(shape: &Conv2dShape, columns: &[f32], grad_images: &mut [f32]) {
    for_each_tap(shape, grad_images.len(), |kernel_row, tap| {
        let Some(tap) = tap else { return };
        let source = &columns[kernel_row][tap.columns];
        for (target, value) in grad_images[tap.values].iter_mut().zip(source) {
            *target += value;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use tandem_testdata::Tolerance;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect()
    }

    /// A random input and weight for `shape`, drawn from `seed` and `seed + 1`.
    fn random_input_and_weight(shape: &Conv2dShape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let input = random(shape.input_len(), seed);
        let weight = random(shape.weight_len(), seed + 1);
        (input, weight)
    }

    /// `(output, grad_input, grad_weight, grad_bias)` computed by definition in f64.
    fn reference(
        shape: &Conv2dShape,
        input: &[f32],
        weight: &[f32],
        bias: &[f32],
        grad_output: &[f32],
    ) -> [Vec<f64>; 4] {
        let (out_h, out_w) = (shape.out_height(), shape.out_width());
        let (cin, cout, k) = (shape.in_channels, shape.out_channels, shape.kernel);
        let mut output = vec![0.0; shape.output_len()];
        let mut grad_input = vec![0.0; shape.input_len()];
        let mut grad_weight = vec![0.0; shape.weight_len()];
        let mut grad_bias = vec![0.0; cout];
        for n in 0..shape.batch {
            for (y, x, o) in (0..out_h)
                .flat_map(|y| (0..out_w).map(move |x| (y, x)))
                .flat_map(|(y, x)| (0..cout).map(move |o| (y, x, o)))
            {
                let out_index = ((n * out_h + y) * out_w + x) * cout + o;
                let g = f64::from(grad_output[out_index]);
                let mut sum = f64::from(bias[o]);
                grad_bias[o] += g;
                for ky in 0..k {
                    for kx in 0..k {
                        let iy = (y * shape.stride + ky) as isize - shape.padding as isize;
                        let ix = (x * shape.stride + kx) as isize - shape.padding as isize;
                        if iy < 0 || ix < 0 {
                            continue;
                        }
                        let (iy, ix) = (iy as usize, ix as usize);
                        if iy >= shape.in_height || ix >= shape.in_width {
                            continue;
                        }
                        for c in 0..cin {
                            let in_index =
                                ((n * shape.in_height + iy) * shape.in_width + ix) * cin + c;
                            let w_index = ((o * k + ky) * k + kx) * cin + c;
                            sum += f64::from(input[in_index]) * f64::from(weight[w_index]);
                            grad_input[in_index] += g * f64::from(weight[w_index]);
                            grad_weight[w_index] += g * f64::from(input[in_index]);
                        }
                    }
                }
                output[out_index] = sum;
            }
        }
        [output, grad_input, grad_weight, grad_bias]
    }

    fn assert_close(what: &str, got: &[f32], expected: &[f64]) {
        let got: Vec<f64> = got.iter().map(|&g| f64::from(g)).collect();
        tandem_testdata::assert_close(what, &got, expected, Tolerance::OfLargest(1e-5));
    }

    /// Every code path (direct kernels for narrow layers with multiples of 8 channels,
    /// Winograd for wider 3x3 stride-1 padding-1 layers, including odd sizes and channel
    /// counts, im2col + GEMM for the rest) against the definition, forward and backward,
    /// overwriting and accumulating.
    #[test]
    fn convolution_matches_definition_on_every_path() {
        let cases = [
            // (batch, height, width, in, out, kernel, stride, padding)
            (2, 7, 5, 8, 8, 3, 1, 1),
            (3, 6, 6, 16, 8, 1, 1, 0),
            (2, 5, 9, 8, 16, 3, 1, 1),
            (1, 4, 4, 16, 24, 3, 1, 0),
            (2, 9, 7, 32, 32, 3, 1, 1),
            (2, 8, 8, 24, 16, 5, 1, 2),
            (2, 4, 4, 64, 16, 1, 1, 0),
            (2, 5, 5, 3, 8, 3, 1, 1),
            (2, 8, 8, 8, 16, 3, 2, 1),
            (2, 9, 9, 3, 16, 3, 2, 1),
            (2, 5, 5, 16, 64, 1, 1, 0),
            (1, 6, 5, 56, 48, 3, 1, 1),
            (2, 8, 8, 16, 32, 1, 2, 0),
            (1, 10, 7, 8, 24, 5, 3, 2),
            (1, 6, 6, 40, 40, 3, 1, 1),
            (3, 7, 5, 40, 72, 3, 1, 1),
            (2, 1, 3, 17, 19, 3, 1, 1),
        ];
        for (seed, &(batch, h, w, cin, cout, k, stride, padding)) in cases.iter().enumerate() {
            let shape = Conv2dShape::new(batch, (h, w), (cin, cout), k, stride, padding);
            let seed = 10 * seed as u64;
            let input = random(shape.input_len(), seed);
            let weight = random(shape.weight_len(), seed + 1);
            let bias = random(cout, seed + 2);
            let grad_output = random(shape.output_len(), seed + 3);
            let [output, grad_input, grad_weight, grad_bias] =
                reference(&shape, &input, &weight, &bias, &grad_output);
            let label = format!("{shape:?}");
            let mut scratch = ConvScratch::default();
            let mut got = vec![0.0; shape.output_len()];
            conv2d_forward(&shape, &input, &weight, Some(&bias), &mut got, &mut scratch);
            assert_close(&format!("output {label}"), &got, &output);

            let mut backward = |grad_weight: &mut [f32],
                                grad_bias: Option<&mut [f32]>,
                                grad_input: InputGrad<'_>| {
                conv2d_backward(
                    &shape,
                    &input,
                    &weight,
                    ConvOutputGrad::Values(&grad_output),
                    grad_weight,
                    grad_bias,
                    grad_input,
                    &mut scratch,
                )
            };
            let mut got_weight = vec![0.25; shape.weight_len()];
            let mut got_bias = vec![0.25; cout];
            let mut got_input = vec![0.5; shape.input_len()];
            backward(
                &mut got_weight,
                Some(&mut got_bias),
                InputGrad::Accumulate(&mut got_input),
            );
            let shifted =
                |values: &[f64], by: f64| values.iter().map(|v| v + by).collect::<Vec<_>>();
            assert_close(
                &format!("grad weight {label}"),
                &got_weight,
                &shifted(&grad_weight, 0.25),
            );
            assert_close(
                &format!("grad bias {label}"),
                &got_bias,
                &shifted(&grad_bias, 0.25),
            );
            assert_close(
                &format!("accumulated grad input {label}"),
                &got_input,
                &shifted(&grad_input, 0.5),
            );
            backward(&mut got_weight, None, InputGrad::Overwrite(&mut got_input));
            assert_close(&format!("grad input {label}"), &got_input, &grad_input);
        }
    }

    /// The fused epilogue equals the convolution followed by the separate affine map,
    /// residual add and ReLU, on both code paths and with a partial last chunk.
    #[test]
    fn fused_epilogue_equals_separate_passes() {
        for (seed, (in_channels, out_channels, stride)) in
            [(8, 16, 1), (16, 8, 1), (3, 40, 1), (8, 16, 2)]
                .into_iter()
                .enumerate()
        {
            let seed = 100 + 10 * seed as u64;
            let shape = Conv2dShape::new(37, (6, 5), (in_channels, out_channels), 3, stride, 1);
            let (input, weight) = random_input_and_weight(&shape, seed);
            let bias = random(out_channels, seed + 2);
            let scale = random(out_channels, seed + 3);
            let shift = random(out_channels, seed + 4);
            let residual = random(shape.output_len(), seed + 5);
            let mut scratch = ConvScratch::default();
            let mut plain = vec![0.0; shape.output_len()];
            conv2d_forward(
                &shape,
                &input,
                &weight,
                Some(&bias),
                &mut plain,
                &mut scratch,
            );
            for (relu, with_residual) in [(false, false), (true, false), (true, true)] {
                let epilogue = Epilogue {
                    scale: &scale,
                    shift: &shift,
                    residual: with_residual.then_some(&residual[..]),
                    relu,
                };
                let mut fused = vec![0.0; shape.output_len()];
                conv2d_forward_fused(
                    &shape,
                    &input,
                    &weight,
                    Some(&bias),
                    Fused::Epilogue(epilogue),
                    &mut fused,
                    &mut scratch,
                );
                for (index, (got, z)) in fused.iter().zip(&plain).enumerate() {
                    let channel = index % out_channels;
                    let mut expected = z * scale[channel] + shift[channel];
                    if with_residual {
                        expected += residual[index];
                    }
                    if relu {
                        expected = expected.max(0.0);
                    }
                    assert!(
                        (got - expected).abs() <= 1e-6 * (1.0 + expected.abs()),
                        "{shape:?} relu={relu} residual={with_residual} index {index}: {got} vs {expected}"
                    );
                }
            }
        }
    }

    /// The sums gathered during the convolution equal the sums of its output.
    #[test]
    fn gathered_output_sums_equal_sums_of_the_output() {
        for (in_channels, out_channels, stride) in [(8, 16, 1), (3, 40, 1), (8, 16, 2)] {
            let shape = Conv2dShape::new(23, (7, 6), (in_channels, out_channels), 3, stride, 1);
            let (input, weight) = random_input_and_weight(&shape, 7);
            let bias = random(out_channels, 9);
            let mut scratch = ConvScratch::default();
            let mut output = vec![0.0; shape.output_len()];
            let mut sums = vec![1.0; 3];
            conv2d_forward_fused(
                &shape,
                &input,
                &weight,
                Some(&bias),
                Fused::OutputSums(&mut sums),
                &mut output,
                &mut scratch,
            );
            let mut expected = vec![0.0f64; 2 * out_channels];
            for (index, value) in output.iter().enumerate() {
                let channel = index % out_channels;
                expected[channel] += f64::from(*value);
                expected[out_channels + channel] += f64::from(*value) * f64::from(*value);
            }
            assert_eq!(sums.len(), expected.len());
            for (channel, (got, want)) in sums.iter().zip(&expected).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{shape:?} sum {channel}: {got} vs {want}"
                );
            }
        }
    }

    /// The batch norm's input gradient computed inside the convolution's backward pass gives
    /// the same gradients as computing it first, on both code paths, with and without a ReLU.
    #[test]
    fn backward_through_batch_norm_equals_the_two_passes() {
        use crate::batchnorm::{self, BatchNormParams, BatchNormScratch, BatchNormState};
        for (seed, (in_channels, out_channels, relu)) in
            [(8, 16, true), (16, 8, false), (3, 40, true)]
                .into_iter()
                .enumerate()
        {
            let seed = 300 + 10 * seed as u64;
            let shape = Conv2dShape::new(19, (6, 7), (in_channels, out_channels), 3, 1, 1);
            let (input, weight) = random_input_and_weight(&shape, seed);
            let bn_weight = random(out_channels, seed + 2);
            let bn_bias = random(out_channels, seed + 3);
            let grad = random(shape.output_len(), seed + 4);
            let mut scratch = ConvScratch::default();
            let mut z = vec![0.0; shape.output_len()];
            conv2d_forward(&shape, &input, &weight, None, &mut z, &mut scratch);
            let params = BatchNormParams {
                weight: &bn_weight,
                bias: &bn_bias,
            };
            let mut state = BatchNormState::new(out_channels);
            let mut bn_scratch = BatchNormScratch::default();
            let (mut running_mean, mut running_var) =
                (vec![0.0; out_channels], vec![1.0; out_channels]);
            batchnorm::train_statistics(
                &z,
                &params,
                &mut running_mean,
                &mut running_var,
                &mut state,
            )
            .expect("statistics");
            let relu_output: Vec<f32> = z.iter().map(|v| (v - 0.1).max(0.0)).collect();
            let grad_output = batchnorm::OutputGrad {
                values: &grad,
                relu_output: relu.then_some(&relu_output[..]),
            };
            let run =
                |fused: bool, scratch: &mut ConvScratch, bn_scratch: &mut BatchNormScratch| {
                    let (mut bn_grad_weight, mut bn_grad_bias) =
                        (vec![0.0; out_channels], vec![0.0; out_channels]);
                    let mut grad_weight = vec![0.0; shape.weight_len()];
                    let mut grad_input = vec![0.0; shape.input_len()];
                    let mut grad_z = vec![0.0; shape.output_len()];
                    let coefficients = batchnorm::backward_coefficients(
                        grad_output,
                        &z,
                        &bn_weight,
                        &state,
                        &mut bn_grad_weight,
                        &mut bn_grad_bias,
                        None,
                        bn_scratch,
                    )
                    .expect("coefficients");
                    let through = if fused {
                        ConvOutputGrad::ThroughBatchNorm {
                            grad: grad_output,
                            bn_input: &z,
                            coefficients,
                        }
                    } else {
                        batchnorm::backward(grad_output, &z, coefficients, &mut grad_z);
                        ConvOutputGrad::Values(&grad_z)
                    };
                    conv2d_backward(
                        &shape,
                        &input,
                        &weight,
                        through,
                        &mut grad_weight,
                        None,
                        InputGrad::Overwrite(&mut grad_input),
                        scratch,
                    );
                    [bn_grad_weight, bn_grad_bias, grad_weight, grad_input]
                };
            let separate = run(false, &mut scratch, &mut bn_scratch);
            let fused = run(true, &mut scratch, &mut bn_scratch);
            for (what, (a, b)) in ["bn weight", "bn bias", "conv weight", "input"]
                .iter()
                .zip(separate.iter().zip(&fused))
            {
                assert_eq!(a, b, "{shape:?} relu={relu}: {what} gradient");
            }
        }
    }
}
