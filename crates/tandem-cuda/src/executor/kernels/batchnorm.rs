//! `batchnorm.cu`: the column sums of the batch-norm statistics and of its backward (two
//! passes in one launch, in a fixed order), and the per-channel coefficients.

use super::{kernels, ActPtr, Ptr};

kernels! {
    file "batchnorm";

    /// `totals = [rows, Σx…, Σx²…]` of the `[rows, channels]` activations `x`, launched as
    /// `launch::column_sums`: `partials` holds `row_blocks * 2 * channels` doubles, `arrivals`
    /// one zero per channel group, `totals` `1 + 2 * channels` doubles. With non-null
    /// coefficient pointers (`channels` floats each), also the training coefficients and the
    /// running statistics.
    fn bn_stats / bn_stats_bf16(
        x: ActPtr,
        rows: i32,
        channels: i32,
        rows_per_block: i32,
        partials: Ptr<f64>,
        arrivals: Ptr<u32>,
        totals: Ptr<f64>,
        weight: Ptr<f32>,
        bias: Ptr<f32>,
        running_mean: Ptr<f32>,
        running_var: Ptr<f32>,
        mean_out: Ptr<f32>,
        invstd_out: Ptr<f32>,
        scale_out: Ptr<f32>,
        shift_out: Ptr<f32>,
    );

    /// The training coefficients and running statistics from `totals` as `bn_stats` wrote
    /// them (summed over the processes); every other pointer addresses `channels` floats.
    fn bn_train_coefficients(
        totals: Ptr<f64>,
        channels: i32,
        weight: Ptr<f32>,
        bias: Ptr<f32>,
        running_mean: Ptr<f32>,
        running_var: Ptr<f32>,
        mean_out: Ptr<f32>,
        invstd_out: Ptr<f32>,
        scale_out: Ptr<f32>,
        shift_out: Ptr<f32>,
    );

    /// The evaluation coefficients from the running statistics, `channels` floats each.
    fn bn_eval_coefficients(
        channels: i32,
        weight: Ptr<f32>,
        bias: Ptr<f32>,
        running_mean: Ptr<f32>,
        running_var: Ptr<f32>,
        invstd_out: Ptr<f32>,
        scale_out: Ptr<f32>,
        shift_out: Ptr<f32>,
    );

    /// The backward's column sums (`Σdy…, Σdy·x̂…` into `totals`, `2 * channels` doubles) and
    /// the weight and bias gradients, launched as `bn_stats`; `dy`, `relu_out` (or null) and
    /// `x` hold `rows * channels` activations, `mean`, `invstd`, `weight` and the gradients
    /// `channels` floats; with non-null `coefficients` (`3 * channels` floats), also the
    /// backward coefficients.
    fn bn_backward_sums / bn_backward_sums_bf16(
        dy: ActPtr,
        relu_out: ActPtr,
        x: ActPtr,
        mean: Ptr<f32>,
        invstd: Ptr<f32>,
        rows: i32,
        channels: i32,
        rows_per_block: i32,
        partials: Ptr<f64>,
        arrivals: Ptr<u32>,
        totals: Ptr<f64>,
        grad_weight: Ptr<f32>,
        grad_bias: Ptr<f32>,
        count: f64,
        weight: Ptr<f32>,
        coefficients: Ptr<f32>,
    );

    /// The backward coefficients (`3 * channels` floats) from `totals` as `bn_backward_sums`
    /// wrote them (summed over the processes).
    fn bn_backward_coefficients(
        totals: Ptr<f64>,
        count: f64,
        channels: i32,
        weight: Ptr<f32>,
        invstd: Ptr<f32>,
        coefficients: Ptr<f32>,
    );

    /// `dx` from the coefficients, one thread per element of `n`; `masked_dy` is `dy` (each
    /// thread writes only its element) or null.
    fn bn_backward_input / bn_backward_input_bf16(
        dy: ActPtr,
        relu_out: ActPtr,
        x: ActPtr,
        mean: Ptr<f32>,
        invstd: Ptr<f32>,
        coefficients: Ptr<f32>,
        n: i64,
        channels: i32,
        dx: ActPtr,
        masked_dy: ActPtr,
    );
}
