//! Batch normalization over NHWC tensors (`[rows, channels]` with rows = batch·height·width),
//! PyTorch `BatchNorm2d` semantics, with the residual add and ReLU that follow it fused into
//! the same pass.
//!
//! Training mode normalizes with the batch mean and biased variance and updates the running
//! statistics with the unbiased variance; eval mode normalizes with the running statistics.
//! Per-channel sums are taken in `f64` over a fixed split of the rows per worker and added
//! in worker order, so they do not depend on scheduling. With a [`BatchNormReducer`] the sums
//! are summed across processes first (SyncBatchNorm).

use rayon::prelude::*;

use crate::channels::{
    fold_line, group_of, rows_fill_lines, widen_into, ChannelTile, ColumnSums, BLOCK_ROWS, LINE,
};
use crate::error::EngineError;
use crate::parallel::elementwise_rows_per_chunk;
use crate::scratch::grow;
use crate::simd::{multiversion, zero_where_not_positive};
use crate::threads::threads;

/// PyTorch's default `eps`.
pub const EPS: f64 = 1e-5;
/// PyTorch's default `momentum` for the running statistics.
pub const MOMENTUM: f64 = 0.1;

/// SyncBatchNorm hook: sums per-channel statistics across processes. Forward passes
/// `[count, sum per channel…, sum of squares per channel…]`, backward passes
/// `[sum of dy per channel…, sum of dy·x̂ per channel…]`. Every process must pass the same
/// layout in the same order.
pub trait BatchNormReducer {
    /// Replaces `values` by their element-wise sum over all processes.
    fn all_reduce_sum(
        &mut self,
        values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// What one batch-norm layer keeps between its forward and backward pass.
#[derive(Clone, Debug, Default)]
pub struct BatchNormState {
    /// Batch mean per channel (training mode).
    pub mean: Vec<f32>,
    /// `1 / sqrt(var + eps)` per channel.
    pub invstd: Vec<f32>,
    /// `weight · invstd` per channel: the output is `x · scale + shift`.
    pub scale: Vec<f32>,
    /// `bias − mean · scale` per channel.
    pub shift: Vec<f32>,
    /// Values per channel the statistics were taken over (global with SyncBatchNorm).
    pub count: f64,
    /// `scale`, `shift`, `mean` and `invstd` repeated over a tile of rows, for the kernels.
    tiles: StateTiles,
}

/// The scale and shift of a [`BatchNormState`] as tiles; refreshed with the statistics.
#[derive(Clone, Debug, Default)]
struct StateTiles {
    scale: ChannelTile,
    shift: ChannelTile,
}

impl BatchNormState {
    /// A state for `channels` channels.
    pub fn new(channels: usize) -> Self {
        BatchNormState {
            mean: vec![0.0; channels],
            invstd: vec![0.0; channels],
            scale: vec![0.0; channels],
            shift: vec![0.0; channels],
            count: 0.0,
            tiles: StateTiles::default(),
        }
    }

    fn channels(&self) -> usize {
        self.scale.len()
    }
}

/// Per-worker partial sums, grown on first use and then reused.
#[derive(Default)]
pub struct BatchNormScratch {
    partials: Vec<f64>,
    column_sums: Vec<ColumnSums>,
    totals: Vec<f64>,
    reduced: Vec<f64>,
    backward: BackwardCoefficients,
}

/// The learned affine parameters and running statistics of one layer.
pub struct BatchNormParams<'a> {
    /// `weight` (gamma) per channel.
    pub weight: &'a [f32],
    /// `bias` (beta) per channel.
    pub bias: &'a [f32],
}

/// Training-mode statistics of one process's batch: computes the batch mean and variance of
/// `input` (`[rows, channels]`), updates `running_mean`/`running_var` (momentum
/// [`MOMENTUM`], unbiased variance) and fills `state` for [`apply`] and [`backward_coefficients`]. A
/// layer whose statistics span processes, or that reuses its scratch space, calls
/// [`train_statistics_from_sums`].
pub fn train_statistics(
    input: &[f32],
    params: &BatchNormParams,
    running_mean: &mut [f32],
    running_var: &mut [f32],
    state: &mut BatchNormState,
) -> Result<(), EngineError> {
    let channels = state.channels();
    assert_eq!(
        input.len() % channels.max(1),
        0,
        "batchnorm: input is not [rows, {channels}]"
    );
    let rows = input.len() / channels.max(1);
    let mut scratch = BatchNormScratch::default();
    column_sums(input, channels, &mut scratch);
    let totals = std::mem::take(&mut scratch.totals);
    train_statistics_from_sums(
        rows,
        &totals,
        params,
        running_mean,
        running_var,
        state,
        None,
        &mut scratch,
    )
}

/// [`train_statistics`] from sums gathered elsewhere (e.g. by the convolution that produced
/// the tensor): `sums` is `[Σx per channel…, Σx² per channel…]` over `rows` rows.
#[allow(clippy::too_many_arguments)]
pub fn train_statistics_from_sums(
    rows: usize,
    sums: &[f64],
    params: &BatchNormParams,
    running_mean: &mut [f32],
    running_var: &mut [f32],
    state: &mut BatchNormState,
    reducer: Option<&mut dyn BatchNormReducer>,
    scratch: &mut BatchNormScratch,
) -> Result<(), EngineError> {
    let channels = state.channels();
    assert_eq!(sums.len(), 2 * channels, "batchnorm: sums length");
    let totals = &mut scratch.reduced;
    totals.clear();
    totals.push(rows as f64);
    totals.extend_from_slice(sums);
    if let Some(reducer) = reducer {
        reducer
            .all_reduce_sum(totals)
            .map_err(|error| EngineError::BatchNormSync(error.to_string()))?;
    }
    update_running_statistics(totals, running_mean, running_var)?;
    let count = totals[0];
    state.count = count;
    let (sums, sums_sq) = totals[1..].split_at(channels);
    for channel in 0..channels {
        let (mean, variance) = batch_moments(count, sums[channel], sums_sq[channel]);
        let invstd = 1.0 / (variance + EPS).sqrt();
        let scale = f64::from(params.weight[channel]) * invstd;
        state.mean[channel] = mean as f32;
        state.invstd[channel] = invstd as f32;
        state.scale[channel] = scale as f32;
        state.shift[channel] = (f64::from(params.bias[channel]) - mean * scale) as f32;
    }
    state.refresh_tiles();
    Ok(())
}

/// Moves the running statistics towards one batch's (momentum [`MOMENTUM`], unbiased
/// variance), from the batch's `totals`: `[count, Σx per channel…, Σx² per channel…]`, as
/// a training forward hands them to its [`BatchNormReducer`] (and gets them back summed).
pub fn update_running_statistics(
    totals: &[f64],
    running_mean: &mut [f32],
    running_var: &mut [f32],
) -> Result<(), EngineError> {
    let channels = running_mean.len();
    if totals.len() != 1 + 2 * channels || running_var.len() != channels {
        return Err(EngineError::BatchNormSync(format!(
            "{} batch totals for {channels} channels, expected {}",
            totals.len(),
            1 + 2 * channels
        )));
    }
    let count = totals[0];
    if count <= 1.0 {
        return Err(EngineError::BatchNormTooFewValues { count });
    }
    let (sums, sums_sq) = totals[1..].split_at(channels);
    for channel in 0..channels {
        let (mean, variance) = batch_moments(count, sums[channel], sums_sq[channel]);
        let unbiased = variance * count / (count - 1.0);
        running_mean[channel] =
            ((1.0 - MOMENTUM) * f64::from(running_mean[channel]) + MOMENTUM * mean) as f32;
        running_var[channel] =
            ((1.0 - MOMENTUM) * f64::from(running_var[channel]) + MOMENTUM * unbiased) as f32;
    }
    Ok(())
}

/// The mean and biased variance of `count` values with sum `sum` and sum of squares
/// `sum_sq`.
fn batch_moments(count: f64, sum: f64, sum_sq: f64) -> (f64, f64) {
    let mean = sum / count;
    (mean, (sum_sq / count - mean * mean).max(0.0))
}

/// Eval-mode statistics: fills `state.scale`/`state.shift` from the running statistics.
pub fn eval_statistics(
    params: &BatchNormParams,
    running_mean: &[f32],
    running_var: &[f32],
    state: &mut BatchNormState,
) {
    for channel in 0..state.channels() {
        let invstd = 1.0 / (f64::from(running_var[channel]) + EPS).sqrt();
        let scale = f64::from(params.weight[channel]) * invstd;
        state.invstd[channel] = invstd as f32;
        state.scale[channel] = scale as f32;
        state.shift[channel] =
            (f64::from(params.bias[channel]) - f64::from(running_mean[channel]) * scale) as f32;
    }
    state.refresh_tiles();
}

/// What is added to the normalized values before the optional ReLU.
pub enum Residual<'a> {
    /// Nothing.
    None,
    /// An identity shortcut: this tensor, as is.
    Identity(&'a [f32]),
    /// A projection shortcut: another batch-normalized tensor, `input · scale + shift`.
    Normalized {
        /// The shortcut's convolution output.
        input: &'a [f32],
        /// The shortcut batch norm's state (its scale and shift are used).
        state: &'a BatchNormState,
    },
}

/// `output = [relu](input · scale + shift [+ residual])`, per channel.
pub fn apply(
    input: &[f32],
    state: &BatchNormState,
    residual: Residual,
    relu: bool,
    output: &mut [f32],
) {
    let channels = state.channels();
    assert_eq!(
        input.len(),
        output.len(),
        "batchnorm: input and output lengths differ"
    );
    let (scale, shift) = (&state.tiles.scale, &state.tiles.shift);
    let side = match residual {
        Residual::None => Side::None,
        Residual::Identity(shortcut) => {
            assert_eq!(shortcut.len(), input.len(), "batchnorm: shortcut length");
            Side::Identity(shortcut)
        }
        Residual::Normalized {
            input: shortcut,
            state: shortcut_state,
        } => {
            assert_eq!(shortcut.len(), input.len(), "batchnorm: shortcut length");
            assert_eq!(
                shortcut_state.channels(),
                channels,
                "batchnorm: shortcut channels"
            );
            Side::Normalized(
                shortcut,
                &shortcut_state.tiles.scale,
                &shortcut_state.tiles.shift,
            )
        }
    };
    if relu {
        apply_tiles::<true>(input, scale, shift, side, output)
    } else {
        apply_tiles::<false>(input, scale, shift, side, output)
    }
}

/// The residual of [`apply`] in tile form.
enum Side<'a> {
    None,
    Identity(&'a [f32]),
    Normalized(&'a [f32], &'a ChannelTile, &'a ChannelTile),
}

impl BatchNormState {
    fn refresh_tiles(&mut self) {
        let channels = self.channels();
        let BatchNormState {
            scale,
            shift,
            tiles,
            ..
        } = self;
        tiles.scale.refill(channels, |c| scale[c]);
        tiles.shift.refill(channels, |c| shift[c]);
    }
}

/// The apply loop over tiles; `RELU` is a constant so the loop has no branch.
fn apply_tiles<const RELU: bool>(
    input: &[f32],
    scale: &ChannelTile,
    shift: &ChannelTile,
    side: Side,
    output: &mut [f32],
) {
    let tile = scale.len();
    let chunk = tile * elementwise_rows_per_chunk(tile);
    let (scale, shift) = (&scale.values[..], &shift.values[..]);
    match side {
        Side::None => output
            .par_chunks_mut(chunk)
            .zip(input.par_chunks(chunk))
            .for_each(|(out, x)| apply_plain::<RELU>(out, x, scale, shift)),
        Side::Identity(shortcut) => output
            .par_chunks_mut(chunk)
            .zip(input.par_chunks(chunk))
            .zip(shortcut.par_chunks(chunk))
            .for_each(|((out, x), s)| apply_identity::<RELU>(out, x, s, scale, shift)),
        Side::Normalized(shortcut, scale2, shift2) => {
            let side_coefficients = [&scale2.values[..], &shift2.values[..]];
            output
                .par_chunks_mut(chunk)
                .zip(input.par_chunks(chunk))
                .zip(shortcut.par_chunks(chunk))
                .for_each(|((out, x), s)| {
                    apply_normalized::<RELU>(out, x, s, [scale, shift], side_coefficients)
                })
        }
    }
}

/// `x` in the ReLU when `RELU`.
#[inline(always)]
fn relu_if<const RELU: bool>(x: f32) -> f32 {
    if RELU {
        x.max(0.0)
    } else {
        x
    }
}

multiversion! {
    /// `out = [relu](x · scale + shift)`, tile by tile.
    fn apply_plain<const RELU: bool>(out: &mut [f32], x: &[f32], scale: &[f32], shift: &[f32]) {
        let tile = scale.len();
        for (out, x) in out.chunks_mut(tile).zip(x.chunks(tile)) {
            let values = out.iter_mut().zip(x).zip(scale.iter().zip(shift));
            for ((out, &x), (&scale, &shift)) in values {
                *out = relu_if::<RELU>(x * scale + shift);
            }
        }
    }
}

multiversion! {
    /// `out = [relu](x · scale + shift + s)`, tile by tile.
    fn apply_identity<const RELU: bool>(
        out: &mut [f32],
        x: &[f32],
        s: &[f32],
        scale: &[f32],
        shift: &[f32],
    ) {
        let tile = scale.len();
        for ((out, x), s) in out.chunks_mut(tile).zip(x.chunks(tile)).zip(s.chunks(tile)) {
            let values = out.iter_mut().zip(x).zip(s).zip(scale.iter().zip(shift));
            for (((out, &x), &s), (&scale, &shift)) in values {
                *out = relu_if::<RELU>(x * scale + shift + s);
            }
        }
    }
}

multiversion! {
    /// `out = [relu](x · scale + shift + (s · scale2 + shift2))`, tile by tile, with
    /// `[scale, shift]` and `[scale2, shift2]` given as pairs.
    fn apply_normalized<const RELU: bool>(
        out: &mut [f32],
        x: &[f32],
        s: &[f32],
        main: [&[f32]; 2],
        side: [&[f32]; 2],
    ) {
        let ([scale, shift], [scale2, shift2]) = (main, side);
        let tile = scale.len();
        for ((out, x), s) in out.chunks_mut(tile).zip(x.chunks(tile)).zip(s.chunks(tile)) {
            let main = out.iter_mut().zip(x).zip(scale.iter().zip(shift));
            let side = s.iter().zip(scale2.iter().zip(shift2));
            for (((out, &x), (&scale, &shift)), (&s, (&scale2, &shift2))) in main.zip(side) {
                *out = relu_if::<RELU>(x * scale + shift + (s * scale2 + shift2));
            }
        }
    }
}

multiversion! {
    /// `values = [relu](values · scale + shift [+ residual])` in place, tile by tile.
    fn scale_shift_in_place<const RELU: bool>(
        values: &mut [f32],
        residual: Option<&[f32]>,
        scale: &[f32],
        shift: &[f32],
    ) {
        let tile = scale.len();
        match residual {
            None => {
                for values in values.chunks_mut(tile) {
                    for (value, (scale, shift)) in values.iter_mut().zip(scale.iter().zip(shift)) {
                        *value = relu_if::<RELU>(*value * scale + shift);
                    }
                }
            }
            Some(residual) => {
                for (values, added) in values.chunks_mut(tile).zip(residual.chunks(tile)) {
                    let coefficients = scale.iter().zip(shift);
                    for ((value, (scale, shift)), add) in
                        values.iter_mut().zip(coefficients).zip(added)
                    {
                        *value = relu_if::<RELU>(*value * scale + shift + add);
                    }
                }
            }
        }
    }
}

/// `values = [relu](values · scale + shift [+ residual])` in place, where `scale` and
/// `shift` are per-channel values repeated over a tile of whole rows and `values` starts
/// at a row.
pub(crate) fn scale_shift(
    values: &mut [f32],
    residual: Option<&[f32]>,
    scale: &[f32],
    shift: &[f32],
    relu: bool,
) {
    if relu {
        scale_shift_in_place::<true>(values, residual, scale, shift)
    } else {
        scale_shift_in_place::<false>(values, residual, scale, shift)
    }
}

/// ReLU backward given the ReLU's output: zeroes `grad` where `output` is not positive.
pub fn relu_backward_in_place(grad: &mut [f32], output: &[f32]) {
    assert_eq!(grad.len(), output.len(), "relu backward: lengths differ");
    const CHUNK: usize = 1 << 14;
    grad.par_chunks_mut(CHUNK)
        .zip(output.par_chunks(CHUNK))
        .for_each(|(g, y)| zero_where_not_positive(g, y));
}

/// The gradient arriving at a batch-norm layer's output.
#[derive(Clone, Copy)]
pub struct OutputGrad<'a> {
    /// The gradient values, `[rows, channels]`.
    pub values: &'a [f32],
    /// The output of a ReLU that followed the layer, if any: the gradient counts only where
    /// it is positive (the ReLU backward, fused into this pass).
    pub relu_output: Option<&'a [f32]>,
}

/// The second half of the training-mode backward, on its own pass over the whole batch:
/// writes into `grad_input` the input gradient that `coefficients` (from
/// [`backward_coefficients`]) give for `grad_output` and the layer's `input`.
pub fn backward(
    grad_output: OutputGrad,
    input: &[f32],
    coefficients: &BackwardCoefficients,
    grad_input: &mut [f32],
) {
    assert_eq!(
        grad_input.len(),
        input.len(),
        "batchnorm backward: input gradient length"
    );
    let tile = coefficients.gain.len();
    let chunk = tile * elementwise_rows_per_chunk(tile);
    grad_input
        .par_chunks_mut(chunk)
        .zip(grad_output.values.par_chunks(chunk))
        .zip(input.par_chunks(chunk))
        .enumerate()
        .for_each(|(index, ((dx, dy), x))| {
            let start = index * chunk;
            let grad = OutputGrad {
                values: dy,
                relu_output: grad_output
                    .relu_output
                    .map(|relu| &relu[start..start + dy.len()]),
            };
            coefficients.input_gradient(grad, x, dx);
        });
}

/// The first half of the training-mode backward: the per-channel sums over the whole batch. Adds the local
/// `Σ dy·x̂` and `Σ dy` to `grad_weight`/`grad_bias` and returns the coefficients of the input
/// gradient, which [`BackwardCoefficients::input_gradient`] applies chunk by chunk (possibly
/// inside the backward pass of the convolution before this layer).
#[allow(clippy::too_many_arguments)]
pub fn backward_coefficients<'s>(
    grad_output: OutputGrad,
    input: &[f32],
    weight: &[f32],
    state: &BatchNormState,
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
    reducer: Option<&mut dyn BatchNormReducer>,
    scratch: &'s mut BatchNormScratch,
) -> Result<&'s BackwardCoefficients, EngineError> {
    let channels = state.channels();
    let dy = grad_output.values;
    // Without a ReLU the gradient serves as its own (never consulted) mask.
    let relu_output = grad_output.relu_output.unwrap_or(dy);
    for (what, len) in [
        ("output gradient", dy.len()),
        ("ReLU output", relu_output.len()),
    ] {
        assert_eq!(len, input.len(), "batchnorm backward: {what} length");
    }
    if grad_output.relu_output.is_some() {
        gradient_sums::<true>(dy, relu_output, input, state, scratch);
    } else {
        gradient_sums::<false>(dy, relu_output, input, state, scratch);
    }
    let totals = &mut scratch.totals;
    for c in 0..channels {
        grad_bias[c] += totals[c] as f32;
        grad_weight[c] += totals[channels + c] as f32;
    }
    if let Some(reducer) = reducer {
        reducer
            .all_reduce_sum(totals)
            .map_err(|error| EngineError::BatchNormSync(error.to_string()))?;
    }
    let count = state.count;
    let invstd = &state.invstd[..channels];
    let BatchNormScratch {
        totals, backward, ..
    } = scratch;
    backward.mean.refill(channels, |c| state.mean[c]);
    backward.invstd.refill(channels, |c| invstd[c]);
    backward.gain.refill(channels, |c| weight[c] * invstd[c]);
    backward
        .mean_dy
        .refill(channels, |c| (totals[c] / count) as f32);
    backward
        .mean_dy_xhat
        .refill(channels, |c| (totals[channels + c] / count) as f32);
    Ok(backward)
}

/// The gradient where a following ReLU (when `RELU`) let it through.
#[inline(always)]
fn masked<const RELU: bool>(dy: f32, relu_output: f32) -> f32 {
    if RELU && relu_output <= 0.0 {
        0.0
    } else {
        dy
    }
}

/// `Σ dy` and `Σ dy·x̂` per channel over a fixed split of the rows per worker, into
/// `scratch.totals` as `[Σ dy…, Σ dy·x̂…]`.
fn gradient_sums<const RELU: bool>(
    dy: &[f32],
    relu_output: &[f32],
    input: &[f32],
    state: &BatchNormState,
    scratch: &mut BatchNormScratch,
) {
    let channels = state.channels();
    let statistics = [&state.mean[..channels], &state.invstd[..channels]];
    let part_len = worker_part_len(input.len(), channels);
    let workers = input.len().div_ceil(part_len);
    grow(&mut scratch.partials, workers * 2 * channels);
    scratch.partials[..workers * 2 * channels]
        .par_chunks_mut(2 * channels)
        .zip(dy.par_chunks(part_len))
        .zip(relu_output.par_chunks(part_len))
        .zip(input.par_chunks(part_len))
        .for_each(|(((sums, dy), relu), x)| {
            sums.fill(0.0);
            let (sum_dy, sum_dy_xhat) = sums.split_at_mut(channels);
            gradient_sums_part::<RELU>([dy, relu, x], statistics, sum_dy, sum_dy_xhat);
        });
    sum_worker_partials(
        &scratch.partials[..workers * 2 * channels],
        2 * channels,
        &mut scratch.totals,
    );
}

multiversion! {
    /// One worker's `Σ dy` and `Σ dy·x̂` per channel, added into `sum_dy` and `sum_dy_xhat`,
    /// from the streams `[dy, relu output, x]` and the per-channel `[mean, invstd]`.
    fn gradient_sums_part<const RELU: bool>(
        streams: [&[f32]; 3],
        statistics: [&[f32]; 2],
        sum_dy: &mut [f64],
        sum_dy_xhat: &mut [f64],
    ) {
        let channels = sum_dy.len();
        if !rows_fill_lines(channels) {
            gradient_sums_lines::<RELU>(streams, statistics, channels, [sum_dy, sum_dy_xhat]);
            return;
        }
        // Lines of several rows: the statistics repeat along the line, and the line sums
        // fold into the channels at the end; rows after the last whole line go one by one.
        let whole = streams[0].len() / LINE * LINE;
        let lines = streams.map(|stream| &stream[..whole]);
        let rest = streams.map(|stream| &stream[whole..]);
        let line_statistics = statistics.map(|values| {
            std::array::from_fn::<f32, LINE, _>(|position| values[position % channels])
        });
        let (mut line_dy, mut line_dy_xhat) = ([0f64; LINE], [0f64; LINE]);
        gradient_sums_lines::<RELU>(
            lines,
            [&line_statistics[0], &line_statistics[1]],
            LINE,
            [&mut line_dy, &mut line_dy_xhat],
        );
        fold_line(&line_dy, sum_dy);
        fold_line(&line_dy_xhat, sum_dy_xhat);
        gradient_sums_lines::<RELU>(rest, statistics, channels, [sum_dy, sum_dy_xhat]);
    }
}

/// [`gradient_sums_part`] over lines of `width` values, block by block of [`BLOCK_ROWS`]
/// lines, each block column group by column group.
#[inline(always)]
fn gradient_sums_lines<const RELU: bool>(
    [dy, relu, x]: [&[f32]; 3],
    statistics: [&[f32]; 2],
    width: usize,
    [sum_dy, sum_dy_xhat]: [&mut [f64]; 2],
) {
    let block_len = width * BLOCK_ROWS;
    let blocks = dy
        .chunks(block_len)
        .zip(relu.chunks(block_len))
        .zip(x.chunks(block_len));
    for ((dy, relu), x) in blocks {
        let block = [dy, relu, x];
        let mut start = 0;
        while start < width {
            let totals = [&mut sum_dy[start..], &mut sum_dy_xhat[start..]];
            start += match width - start {
                16.. => gradient_sums_group::<RELU, 16>(block, statistics, width, start, totals),
                8.. => gradient_sums_group::<RELU, 8>(block, statistics, width, start, totals),
                _ => gradient_sums_group::<RELU, 1>(block, statistics, width, start, totals),
            };
        }
    }
}

/// One block's `Σ dy` and `Σ dy·x̂` for the `W` columns from `start`, summed in registers in
/// f32 and added into the f64 totals; returns `W`.
#[inline(always)]
fn gradient_sums_group<const RELU: bool, const W: usize>(
    [dy, relu, x]: [&[f32]; 3],
    [mean, invstd]: [&[f32]; 2],
    width: usize,
    start: usize,
    [sum_dy, sum_dy_xhat]: [&mut [f64]; 2],
) -> usize {
    let (Some(mean), Some(invstd)) = (group_of::<W>(mean, start), group_of::<W>(invstd, start))
    else {
        return W;
    };
    let mut block_dy = [0f32; W];
    let mut block_dy_xhat = [0f32; W];
    let lines = dy
        .chunks_exact(width)
        .zip(relu.chunks_exact(width))
        .zip(x.chunks_exact(width));
    for ((dy, relu), x) in lines {
        let (Some(dy), Some(relu), Some(x)) = (
            group_of::<W>(dy, start),
            group_of::<W>(relu, start),
            group_of::<W>(x, start),
        ) else {
            break;
        };
        for lane in 0..W {
            let dy = masked::<RELU>(dy[lane], relu[lane]);
            block_dy[lane] += dy;
            block_dy_xhat[lane] += dy * ((x[lane] - mean[lane]) * invstd[lane]);
        }
    }
    widen_into(&block_dy, sum_dy);
    widen_into(&block_dy_xhat, sum_dy_xhat);
    W
}

/// The per-channel coefficients of a training-mode batch norm's input gradient, as tiles:
/// `dx = gain · (dy − mean(dy) − x̂ · mean(dy·x̂))` with `x̂ = (x − mean) · invstd`. Made by
/// [`backward_coefficients`].
#[derive(Default)]
pub struct BackwardCoefficients {
    mean: ChannelTile,
    invstd: ChannelTile,
    gain: ChannelTile,
    mean_dy: ChannelTile,
    mean_dy_xhat: ChannelTile,
}

impl BackwardCoefficients {
    /// The input gradient of a chunk of whole rows: `grad_input` from the gradient at the
    /// layer's output and the layer's input `input`, all starting at the same row.
    pub fn input_gradient(&self, grad_output: OutputGrad, input: &[f32], grad_input: &mut [f32]) {
        let dy = grad_output.values;
        assert_eq!(dy.len(), input.len(), "batchnorm backward: chunk lengths");
        assert_eq!(
            grad_input.len(),
            input.len(),
            "batchnorm backward: chunk lengths"
        );
        let tiles = [
            &self.mean.values[..],
            &self.invstd.values,
            &self.gain.values,
            &self.mean_dy.values,
            &self.mean_dy_xhat.values,
        ];
        match grad_output.relu_output {
            Some(relu) => {
                assert_eq!(relu.len(), input.len(), "batchnorm backward: chunk lengths");
                input_gradient_chunk::<true>(grad_input, [dy, relu, input], tiles)
            }
            None => input_gradient_chunk::<false>(grad_input, [dy, dy, input], tiles),
        }
    }
}

multiversion! {
    /// `dx = gain · (dy − mean_dy − x̂ · mean_dy_xhat)` over one chunk, from the streams
    /// `[dy, relu output, x]` and the tiles `[mean, invstd, gain, mean_dy, mean_dy_xhat]`.
    fn input_gradient_chunk<const RELU: bool>(
        dx: &mut [f32],
        streams: [&[f32]; 3],
        tiles: [&[f32]; 5],
    ) {
        let [dy, relu, x] = streams;
        let [mean, invstd, gain, mean_dy, mean_dy_xhat] = tiles;
        let tile = gain.len();
        let rows = dx
            .chunks_mut(tile)
            .zip(dy.chunks(tile))
            .zip(relu.chunks(tile))
            .zip(x.chunks(tile));
        for (((dx, dy), relu), x) in rows {
            let data = dx.iter_mut().zip(dy).zip(relu).zip(x);
            let normalize = mean.iter().zip(invstd);
            let means = mean_dy.iter().zip(mean_dy_xhat);
            let correct = gain.iter().zip(means);
            for ((((dx, &dy), &relu), &x), ((&mean, &invstd), (&gain, (&mean_dy, &mean_dy_xhat)))) in
                data.zip(normalize.zip(correct))
            {
                let xhat = (x - mean) * invstd;
                *dx = gain * (masked::<RELU>(dy, relu) - mean_dy - xhat * mean_dy_xhat);
            }
        }
    }
}

/// Values per worker part of a `[rows, channels]` tensor: whole rows, one part per worker.
fn worker_part_len(len: usize, channels: usize) -> usize {
    let rows = len / channels.max(1);
    rows.div_ceil(threads().max(1)).max(1) * channels.max(1)
}

/// Adds the workers' partial sums (`width` values each) in worker order into `totals`.
fn sum_worker_partials(partials: &[f64], width: usize, totals: &mut Vec<f64>) {
    totals.clear();
    totals.resize(width, 0.0);
    for sums in partials.chunks_exact(width.max(1)) {
        for (total, partial) in totals.iter_mut().zip(sums) {
            *total += partial;
        }
    }
}

/// Sums and sums of squares per channel over rows, split into one fixed part per worker;
/// leaves `[sum per channel…, sum of squares per channel…]` in `scratch.totals`.
fn column_sums(input: &[f32], channels: usize, scratch: &mut BatchNormScratch) {
    let part_len = worker_part_len(input.len(), channels);
    let workers = input.len().div_ceil(part_len);
    if scratch.column_sums.len() < workers {
        scratch
            .column_sums
            .resize_with(workers, ColumnSums::default);
    }
    scratch.column_sums[..workers]
        .par_iter_mut()
        .zip(input.par_chunks(part_len))
        .for_each(|(sums, part)| {
            sums.reset(channels);
            sums.add(part);
        });
    let totals = &mut scratch.totals;
    totals.clear();
    totals.resize(2 * channels, 0.0);
    for sums in &scratch.column_sums[..workers] {
        sums.add_to(totals);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_testdata::Tolerance;

    /// Channel counts that use every column-group width (32, 16, 8 and single columns) and
    /// rows read several to a line (1, 2 and 8 channels, with rows left after the last whole
    /// line); row counts that end inside a block of `BLOCK_ROWS`.
    const SHAPES: [(usize, usize); 9] = [
        (37, 1),
        (45, 2),
        (37, 3),
        (21, 8),
        (50, 13),
        (19, 16),
        (17, 29),
        (40, 40),
        (9, 67),
    ];

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0) * 3.0)
            .collect()
    }

    fn assert_close(got: f64, expected: f64, what: &str) {
        tandem_testdata::assert_close_one(what, got, expected, Tolerance::Scaled(1e-5));
    }

    #[test]
    fn column_sums_match_f64_sums_for_every_group_width() {
        for (rows, channels) in SHAPES {
            let input = values(rows * channels, channels);
            let mut sums = ColumnSums::default();
            sums.reset(channels);
            // Two uneven parts, as a convolution adds its chunks.
            let split = (rows / 3) * channels;
            sums.add(&input[..split]);
            sums.add(&input[split..]);
            let mut totals = vec![0.0; 2 * channels];
            sums.add_to(&mut totals);
            for c in 0..channels {
                let column = input.iter().skip(c).step_by(channels).map(|&x| x as f64);
                let (sum, sum_sq) = column.fold((0.0, 0.0), |(s, q), x| (s + x, q + x * x));
                assert_close(totals[c], sum, &format!("{rows}x{channels} Σx[{c}]"));
                assert_close(
                    totals[channels + c],
                    sum_sq,
                    &format!("{rows}x{channels} Σx²[{c}]"),
                );
            }
        }
    }

    #[test]
    fn gradient_sums_and_input_gradient_match_f64_with_and_without_the_relu_mask() {
        for (rows, channels) in SHAPES {
            let input = values(rows * channels, 1);
            let dy = values(rows * channels, 2);
            let relu_output = values(rows * channels, 3);
            let weight: Vec<f32> = (0..channels).map(|c| 0.5 + 0.1 * c as f32).collect();
            let bias = vec![0.0; channels];
            let params = BatchNormParams {
                weight: &weight,
                bias: &bias,
            };
            let mut state = BatchNormState::new(channels);
            let mut scratch = BatchNormScratch::default();
            let (mut running_mean, mut running_var) = (vec![0.0; channels], vec![1.0; channels]);
            train_statistics(
                &input,
                &params,
                &mut running_mean,
                &mut running_var,
                &mut state,
            )
            .expect("statistics");
            for relu in [false, true] {
                let (mut grad_weight, mut grad_bias) = (vec![0.0; channels], vec![0.0; channels]);
                let grad_output = OutputGrad {
                    values: &dy,
                    relu_output: relu.then_some(&relu_output[..]),
                };
                let coefficients = backward_coefficients(
                    grad_output,
                    &input,
                    &weight,
                    &state,
                    &mut grad_weight,
                    &mut grad_bias,
                    None,
                    &mut scratch,
                )
                .expect("coefficients");
                let mut grad_input = vec![0.0; rows * channels];
                coefficients.input_gradient(grad_output, &input, &mut grad_input);
                for c in 0..channels {
                    let (mut sum_dy, mut sum_dy_xhat) = (0.0f64, 0.0f64);
                    for row in 0..rows {
                        let index = row * channels + c;
                        if relu && relu_output[index] <= 0.0 {
                            continue;
                        }
                        let xhat = (input[index] - state.mean[c]) * state.invstd[c];
                        sum_dy += dy[index] as f64;
                        sum_dy_xhat += dy[index] as f64 * xhat as f64;
                    }
                    let what = format!("{rows}x{channels} relu {relu} channel {c}");
                    assert_close(grad_bias[c] as f64, sum_dy, &format!("{what} Σdy"));
                    assert_close(grad_weight[c] as f64, sum_dy_xhat, &format!("{what} Σdy·x̂"));
                    let gain = weight[c] as f64 * state.invstd[c] as f64;
                    for row in 0..rows {
                        let index = row * channels + c;
                        let dy = match relu && relu_output[index] <= 0.0 {
                            true => 0.0,
                            false => dy[index] as f64,
                        };
                        let xhat = (input[index] - state.mean[c]) as f64 * state.invstd[c] as f64;
                        let expected =
                            gain * (dy - sum_dy / rows as f64 - xhat * sum_dy_xhat / rows as f64);
                        assert_close(
                            grad_input[index] as f64,
                            expected,
                            &format!("{what} dx[{row}]"),
                        );
                    }
                }
            }
        }
    }
}
