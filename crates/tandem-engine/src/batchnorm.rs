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

use crate::error::EngineError;
use crate::parallel::elementwise_rows_per_chunk;
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

/// The per-channel values of a [`BatchNormState`] as tiles; refreshed with the statistics.
#[derive(Clone, Debug, Default)]
struct StateTiles {
    scale: ChannelTile,
    shift: ChannelTile,
    mean: ChannelTile,
    invstd: ChannelTile,
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
    tile_partials: Vec<f64>,
    block_partials: Vec<f32>,
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

/// Training-mode statistics: computes the batch mean and variance of `input`
/// (`[rows, channels]`), updates `running_mean`/`running_var` (momentum [`MOMENTUM`],
/// unbiased variance) and fills `state` for [`apply`] and [`backward`].
pub fn train_statistics(
    input: &[f32],
    params: &BatchNormParams,
    running_mean: &mut [f32],
    running_var: &mut [f32],
    state: &mut BatchNormState,
    reducer: Option<&mut dyn BatchNormReducer>,
    scratch: &mut BatchNormScratch,
) -> Result<(), EngineError> {
    let channels = state.channels();
    assert_eq!(
        input.len() % channels.max(1),
        0,
        "batchnorm: input is not [rows, {channels}]"
    );
    let rows = input.len() / channels.max(1);
    column_sums(input, channels, scratch);
    let totals = std::mem::take(&mut scratch.totals);
    let result = train_statistics_from_sums(
        rows,
        &totals,
        params,
        running_mean,
        running_var,
        state,
        reducer,
        scratch,
    );
    scratch.totals = totals;
    result
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
    let count = totals[0];
    if count <= 1.0 {
        return Err(EngineError::BatchNormTooFewValues { count });
    }
    state.count = count;
    let (sums, sums_sq) = totals[1..].split_at(channels);
    for channel in 0..channels {
        let mean = sums[channel] / count;
        let variance = (sums_sq[channel] / count - mean * mean).max(0.0);
        let invstd = 1.0 / (variance + EPS).sqrt();
        let unbiased = variance * count / (count - 1.0);
        running_mean[channel] =
            ((1.0 - MOMENTUM) * f64::from(running_mean[channel]) + MOMENTUM * mean) as f32;
        running_var[channel] =
            ((1.0 - MOMENTUM) * f64::from(running_var[channel]) + MOMENTUM * unbiased) as f32;
        let scale = f64::from(params.weight[channel]) * invstd;
        state.mean[channel] = mean as f32;
        state.invstd[channel] = invstd as f32;
        state.scale[channel] = scale as f32;
        state.shift[channel] = (f64::from(params.bias[channel]) - mean * scale) as f32;
    }
    state.refresh_tiles();
    Ok(())
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

/// Per-channel values repeated over enough rows that per-element loops run over long
/// contiguous slices (which vectorize) instead of one short row at a time.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChannelTile {
    pub(crate) values: Vec<f32>,
}

impl ChannelTile {
    /// Values per tile; a whole number of rows.
    const TARGET_LEN: usize = 256;

    /// The tile length for `channels` channels.
    fn len_for(channels: usize) -> usize {
        (Self::TARGET_LEN / channels.max(1)).max(1) * channels
    }

    /// Refills the tile with `value(channel)`, reusing its buffer.
    pub(crate) fn refill(&mut self, channels: usize, value: impl Fn(usize) -> f32) {
        self.values.clear();
        let rows = Self::len_for(channels) / channels.max(1);
        for _ in 0..rows {
            self.values.extend((0..channels).map(&value));
        }
    }

    fn len(&self) -> usize {
        self.values.len()
    }
}

impl BatchNormState {
    fn refresh_tiles(&mut self) {
        let channels = self.channels();
        let BatchNormState {
            mean,
            invstd,
            scale,
            shift,
            tiles,
            ..
        } = self;
        tiles.scale.refill(channels, |c| scale[c]);
        tiles.shift.refill(channels, |c| shift[c]);
        tiles.mean.refill(channels, |c| mean[c]);
        tiles.invstd.refill(channels, |c| invstd[c]);
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

/// Training-mode backward. Adds the local `Σ dy·x̂` and `Σ dy` to `grad_weight`/`grad_bias`
/// and writes the input gradient into `grad_input`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    grad_output: OutputGrad,
    input: &[f32],
    weight: &[f32],
    state: &BatchNormState,
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
    grad_input: &mut [f32],
    reducer: Option<&mut dyn BatchNormReducer>,
    scratch: &mut BatchNormScratch,
) -> Result<(), EngineError> {
    assert_eq!(
        grad_input.len(),
        input.len(),
        "batchnorm backward: input gradient length"
    );
    let coefficients = backward_coefficients(
        grad_output,
        input,
        weight,
        state,
        grad_weight,
        grad_bias,
        reducer,
        scratch,
    )?;
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
    Ok(())
}

/// The first half of [`backward`]: the per-channel sums over the whole batch. Adds the local
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

/// Tiles summed in f32 before the partial sums are added into f64 ones: few enough that
/// the f32 sums lose only a few ulps, enough to amortize the widening.
const TILES_PER_BLOCK: usize = 16;

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
    let (mean_tile, invstd_tile) = (&state.tiles.mean.values, &state.tiles.invstd.values);
    let tile = mean_tile.len();
    let part_len = worker_part_len(input.len(), channels);
    let workers = input.len().div_ceil(part_len);
    grow_f64(&mut scratch.partials, workers * 2 * channels);
    grow_f64(&mut scratch.tile_partials, workers * 2 * tile);
    grow_f32(&mut scratch.block_partials, workers * 2 * tile);
    scratch.partials[..workers * 2 * channels]
        .par_chunks_mut(2 * channels)
        .zip(scratch.tile_partials[..workers * 2 * tile].par_chunks_mut(2 * tile))
        .zip(scratch.block_partials[..workers * 2 * tile].par_chunks_mut(2 * tile))
        .zip(dy.par_chunks(part_len))
        .zip(relu_output.par_chunks(part_len))
        .zip(input.par_chunks(part_len))
        .for_each(|(((((sums, tile_sums), block_sums), dy), relu), x)| {
            gradient_sums_part::<RELU>(
                [dy, relu, x],
                [mean_tile, invstd_tile],
                tile_sums,
                block_sums,
            );
            let (tile_dy, tile_dy_xhat) = tile_sums.split_at(tile);
            fold_tile_sums(tile_dy, tile_dy_xhat, channels, sums);
        });
    sum_worker_partials(
        &scratch.partials[..workers * 2 * channels],
        2 * channels,
        &mut scratch.totals,
    );
}

multiversion! {
    /// One worker's `[Σ dy…, Σ dy·x̂…]` per tile position into `tile_sums`, from the
    /// streams `[dy, relu output, x]` and the tiles `[mean, invstd]`.
    fn gradient_sums_part<const RELU: bool>(
        streams: [&[f32]; 3],
        coefficients: [&[f32]; 2],
        tile_sums: &mut [f64],
        block_sums: &mut [f32],
    ) {
        let ([dy, relu, x], [mean_tile, invstd_tile]) = (streams, coefficients);
        let tile = mean_tile.len();
        tile_sums.fill(0.0);
        let (tile_dy, tile_dy_xhat) = tile_sums.split_at_mut(tile);
        let (block_dy, block_dy_xhat) = block_sums.split_at_mut(tile);
        let block_len = tile * TILES_PER_BLOCK;
        let blocks = dy
            .chunks(block_len)
            .zip(relu.chunks(block_len))
            .zip(x.chunks(block_len));
        for ((dy, relu), x) in blocks {
            block_dy.fill(0.0);
            block_dy_xhat.fill(0.0);
            let rows = dy.chunks(tile).zip(relu.chunks(tile)).zip(x.chunks(tile));
            for ((dy, relu), x) in rows {
                let values = dy.iter().zip(relu).zip(x);
                let coefficients = mean_tile.iter().zip(invstd_tile);
                let targets = block_dy.iter_mut().zip(block_dy_xhat.iter_mut());
                for (((&dy, &relu), &x), ((&mean, &invstd), (sum_dy, sum_dy_xhat))) in
                    values.zip(coefficients.zip(targets))
                {
                    let dy = masked::<RELU>(dy, relu);
                    *sum_dy += dy;
                    *sum_dy_xhat += dy * ((x - mean) * invstd);
                }
            }
            widen_into(block_dy, tile_dy);
            widen_into(block_dy_xhat, tile_dy_xhat);
        }
    }
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

/// Adds each f32 block sum into its f64 total.
fn widen_into(block: &[f32], totals: &mut [f64]) {
    for (total, value) in totals.iter_mut().zip(block) {
        *total += f64::from(*value);
    }
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

/// Per-channel sums and sums of squares of a `[rows, channels]` tensor, gathered part by
/// part in a fixed order: by [`train_statistics`] over the rows of each worker, or by a
/// convolution over each chunk of its output while the chunk is still in cache. Values are
/// added in f32 over blocks of [`TILES_PER_BLOCK`] tiles, then in f64.
#[derive(Default)]
pub struct ColumnSums {
    channels: usize,
    /// `[Σx per tile position…, Σx² per tile position…]`.
    tile_sums: Vec<f64>,
    /// The same over the current block, in f32.
    block_sums: Vec<f32>,
}

impl ColumnSums {
    /// Starts over for a tensor of `channels` channels.
    pub fn reset(&mut self, channels: usize) {
        let tile = ChannelTile::len_for(channels);
        self.channels = channels;
        self.tile_sums.clear();
        self.tile_sums.resize(2 * tile, 0.0);
        self.block_sums.clear();
        self.block_sums.resize(2 * tile, 0.0);
    }

    /// Adds the values of `rows` (whole rows of `channels` values).
    pub fn add(&mut self, rows: &[f32]) {
        let tile = self.tile_sums.len() / 2;
        let (tile_sum, tile_sum_sq) = self.tile_sums.split_at_mut(tile);
        let (block_sum, block_sum_sq) = self.block_sums.split_at_mut(tile);
        sum_rows(rows, [tile_sum, tile_sum_sq], [block_sum, block_sum_sq]);
    }

    /// Adds this part's `[Σx per channel…, Σx² per channel…]` into `totals`.
    pub fn add_to(&self, totals: &mut [f64]) {
        let channels = self.channels;
        assert_eq!(totals.len(), 2 * channels, "column sums: totals length");
        let tile = self.tile_sums.len() / 2;
        let (tile_sum, tile_sum_sq) = self.tile_sums.split_at(tile);
        let (sums, sums_sq) = totals.split_at_mut(channels);
        for (row, row_sq) in tile_sum
            .chunks_exact(channels)
            .zip(tile_sum_sq.chunks_exact(channels))
        {
            widen_f64_into(row, sums);
            widen_f64_into(row_sq, sums_sq);
        }
    }
}

multiversion! {
    /// Adds `rows` (whole tiles) into the per-position `[Σx, Σx²]`, in f32 per block.
    fn sum_rows(rows: &[f32], tile_sums: [&mut [f64]; 2], block_sums: [&mut [f32]; 2]) {
        let ([tile_sum, tile_sum_sq], [block_sum, block_sum_sq]) = (tile_sums, block_sums);
        let tile = tile_sum.len();
        for block in rows.chunks(tile * TILES_PER_BLOCK) {
            block_sum.fill(0.0);
            block_sum_sq.fill(0.0);
            for values in block.chunks(tile) {
                let targets = block_sum.iter_mut().zip(block_sum_sq.iter_mut());
                for ((sum, sum_sq), &x) in targets.zip(values) {
                    *sum += x;
                    *sum_sq += x * x;
                }
            }
            widen_into(block_sum, tile_sum);
            widen_into(block_sum_sq, tile_sum_sq);
        }
    }
}

fn widen_f64_into(values: &[f64], totals: &mut [f64]) {
    for (total, value) in totals.iter_mut().zip(values) {
        *total += value;
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

/// Adds per-position tile sums into per-channel sums: `sums = [Σ first…, Σ second…]`.
fn fold_tile_sums(first: &[f64], second: &[f64], channels: usize, sums: &mut [f64]) {
    sums.fill(0.0);
    let (first_sums, second_sums) = sums.split_at_mut(channels);
    for (first_row, second_row) in first
        .chunks_exact(channels)
        .zip(second.chunks_exact(channels))
    {
        for (total, value) in first_sums.iter_mut().zip(first_row) {
            *total += value;
        }
        for (total, value) in second_sums.iter_mut().zip(second_row) {
            *total += value;
        }
    }
}

fn grow_f64(buffer: &mut Vec<f64>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}

fn grow_f32(buffer: &mut Vec<f32>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}
