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
    totals: Vec<f64>,
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
    column_sums(input, channels, scratch, |values, sums| {
        let (sum, sum_sq) = sums.split_at_mut(channels);
        for row in values.chunks_exact(channels) {
            for ((s, q), &x) in sum.iter_mut().zip(sum_sq.iter_mut()).zip(row) {
                let x = f64::from(x);
                *s += x;
                *q += x * x;
            }
        }
    });
    let totals = &mut scratch.totals;
    totals.insert(0, rows as f64);
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
    let chunk = elementwise_rows_per_chunk(channels) * channels;
    let (scale, shift) = (&state.scale[..], &state.shift[..]);
    let finish = |value: f32| if relu { value.max(0.0) } else { value };
    match residual {
        Residual::None => {
            output
                .par_chunks_mut(chunk)
                .zip(input.par_chunks(chunk))
                .for_each(|(out, x)| {
                    for (out_row, x_row) in
                        out.chunks_exact_mut(channels).zip(x.chunks_exact(channels))
                    {
                        for c in 0..channels {
                            out_row[c] = finish(x_row[c] * scale[c] + shift[c]);
                        }
                    }
                });
        }
        Residual::Identity(shortcut) => {
            assert_eq!(shortcut.len(), input.len(), "batchnorm: shortcut length");
            output
                .par_chunks_mut(chunk)
                .zip(input.par_chunks(chunk))
                .zip(shortcut.par_chunks(chunk))
                .for_each(|((out, x), s)| {
                    let rows = out
                        .chunks_exact_mut(channels)
                        .zip(x.chunks_exact(channels))
                        .zip(s.chunks_exact(channels));
                    for ((out_row, x_row), s_row) in rows {
                        for c in 0..channels {
                            out_row[c] = finish(x_row[c] * scale[c] + shift[c] + s_row[c]);
                        }
                    }
                });
        }
        Residual::Normalized {
            input: shortcut,
            state: shortcut_state,
        } => {
            assert_eq!(shortcut.len(), input.len(), "batchnorm: shortcut length");
            let (scale2, shift2) = (&shortcut_state.scale[..], &shortcut_state.shift[..]);
            output
                .par_chunks_mut(chunk)
                .zip(input.par_chunks(chunk))
                .zip(shortcut.par_chunks(chunk))
                .for_each(|((out, x), s)| {
                    let rows = out
                        .chunks_exact_mut(channels)
                        .zip(x.chunks_exact(channels))
                        .zip(s.chunks_exact(channels));
                    for ((out_row, x_row), s_row) in rows {
                        for c in 0..channels {
                            let main = x_row[c] * scale[c] + shift[c];
                            out_row[c] = finish(main + (s_row[c] * scale2[c] + shift2[c]));
                        }
                    }
                });
        }
    }
}

/// ReLU backward given the ReLU's output: zeroes `grad` where `output` is not positive.
pub fn relu_backward_in_place(grad: &mut [f32], output: &[f32]) {
    assert_eq!(grad.len(), output.len(), "relu backward: lengths differ");
    const CHUNK: usize = 1 << 14;
    grad.par_chunks_mut(CHUNK)
        .zip(output.par_chunks(CHUNK))
        .for_each(|(g, y)| {
            for (g, &y) in g.iter_mut().zip(y) {
                if y <= 0.0 {
                    *g = 0.0;
                }
            }
        });
}

/// Training-mode backward. `grad_output` is the gradient at this layer's output (after any
/// ReLU mask); adds the local `Σ dy·x̂` and `Σ dy` to `grad_weight`/`grad_bias` and writes
/// the input gradient into `grad_input`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    grad_output: &[f32],
    input: &[f32],
    weight: &[f32],
    state: &BatchNormState,
    grad_weight: &mut [f32],
    grad_bias: &mut [f32],
    grad_input: &mut [f32],
    reducer: Option<&mut dyn BatchNormReducer>,
    scratch: &mut BatchNormScratch,
) -> Result<(), EngineError> {
    let channels = state.channels();
    assert_eq!(
        grad_output.len(),
        input.len(),
        "batchnorm backward: lengths differ"
    );
    assert_eq!(
        grad_input.len(),
        input.len(),
        "batchnorm backward: lengths differ"
    );
    let (mean, invstd) = (&state.mean[..], &state.invstd[..]);
    let rows_per_worker = (input.len() / channels.max(1))
        .div_ceil(threads().max(1))
        .max(1);
    let part_len = rows_per_worker * channels;
    grow_f64(&mut scratch.partials, threads().max(1) * 2 * channels);
    let workers = input.len().div_ceil(part_len.max(1));
    scratch.partials[..workers * 2 * channels]
        .par_chunks_mut(2 * channels)
        .zip(grad_output.par_chunks(part_len))
        .zip(input.par_chunks(part_len))
        .for_each(|((sums, dy), x)| {
            sums.fill(0.0);
            let (sum_dy, sum_dy_xhat) = sums.split_at_mut(channels);
            for (dy_row, x_row) in dy.chunks_exact(channels).zip(x.chunks_exact(channels)) {
                for c in 0..channels {
                    let dy = f64::from(dy_row[c]);
                    let xhat = f64::from((x_row[c] - mean[c]) * invstd[c]);
                    sum_dy[c] += dy;
                    sum_dy_xhat[c] += dy * xhat;
                }
            }
        });
    let totals = &mut scratch.totals;
    totals.clear();
    totals.resize(2 * channels, 0.0);
    for sums in scratch.partials[..workers * 2 * channels].chunks_exact(2 * channels) {
        for (total, partial) in totals.iter_mut().zip(sums) {
            *total += partial;
        }
    }
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
    let mean_dy: Vec<f32> = totals[..channels]
        .iter()
        .map(|s| (s / count) as f32)
        .collect();
    let mean_dy_xhat: Vec<f32> = totals[channels..]
        .iter()
        .map(|s| (s / count) as f32)
        .collect();
    let gain: Vec<f32> = (0..channels).map(|c| weight[c] * invstd[c]).collect();
    let chunk = elementwise_rows_per_chunk(channels) * channels;
    grad_input
        .par_chunks_mut(chunk)
        .zip(grad_output.par_chunks(chunk))
        .zip(input.par_chunks(chunk))
        .for_each(|((dx, dy), x)| {
            let rows = dx
                .chunks_exact_mut(channels)
                .zip(dy.chunks_exact(channels))
                .zip(x.chunks_exact(channels));
            for ((dx_row, dy_row), x_row) in rows {
                for c in 0..channels {
                    let xhat = (x_row[c] - mean[c]) * invstd[c];
                    dx_row[c] = gain[c] * (dy_row[c] - mean_dy[c] - xhat * mean_dy_xhat[c]);
                }
            }
        });
    Ok(())
}

/// Sums per channel over rows, split into one fixed part per worker; leaves
/// `[sum per channel…, second sum per channel…]` in `scratch.totals` (before the count).
fn column_sums(
    input: &[f32],
    channels: usize,
    scratch: &mut BatchNormScratch,
    accumulate: impl Fn(&[f32], &mut [f64]) + Sync,
) {
    let rows = input.len() / channels.max(1);
    let rows_per_worker = rows.div_ceil(threads().max(1)).max(1);
    let part_len = rows_per_worker * channels;
    let workers = input.len().div_ceil(part_len.max(1));
    grow_f64(&mut scratch.partials, workers * 2 * channels);
    scratch.partials[..workers * 2 * channels]
        .par_chunks_mut(2 * channels)
        .zip(input.par_chunks(part_len))
        .for_each(|(sums, part)| {
            sums.fill(0.0);
            accumulate(part, sums);
        });
    let totals = &mut scratch.totals;
    totals.clear();
    totals.resize(2 * channels, 0.0);
    for sums in scratch.partials[..workers * 2 * channels].chunks_exact(2 * channels) {
        for (total, partial) in totals.iter_mut().zip(sums) {
            *total += partial;
        }
    }
}

fn grow_f64(buffer: &mut Vec<f64>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}
