//! `pooling.cu`: the head's global average pooling and its backward.

use super::{kernels, ActPtr, Ptr};

kernels! {
    file "pooling";

    /// `output[b, c]` (float32) = the mean over `pixels` of `input[b, p, c]` (activations).
    fn average_pool_forward / average_pool_forward_bf16(
        input: ActPtr,
        batch: i32,
        pixels: i32,
        channels: i32,
        output: Ptr<f32>,
    );

    /// `grad_input[b, p, c]` (activations) = `grad_output[b, c] / pixels` (float32).
    fn average_pool_backward / average_pool_backward_bf16(
        grad_output: Ptr<f32>,
        batch: i32,
        pixels: i32,
        channels: i32,
        grad_input: ActPtr,
    );
}
