//! `bias.cu`: a bias added to activations, and channel sums added to a bias gradient.

use super::{kernels, ActPtr, Ptr};

kernels! {
    file "bias";

    /// `x[i] += bias[i % channels]` over `n` activations.
    fn bias_add / bias_add_bf16(x: ActPtr, bias: Ptr<f32>, n: i64, channels: i32);

    /// `grad_bias[c] += totals[1 + c]` over `channels` floats, the totals as `bn_stats`
    /// wrote them.
    fn add_channel_sums(totals: Ptr<f64>, channels: i32, grad_bias: Ptr<f32>);
}
