//! `epilogue.cu`: the fused batch-norm epilogue and the ReLU's backward.

use super::{kernels, ActPtr, Ptr};

kernels! {
    file "epilogue";

    /// `out = relu?(x * scale + shift [+ residual])` over `n` activations; `residual_kind` 0
    /// reads no residual, 1 the activations `s`, 2 `s * scale2 + shift2` (unused pointers
    /// null). Each thread reads element `i` before it writes it: `out` may be `x`.
    fn bn_apply / bn_apply_bf16(
        x: ActPtr,
        scale: Ptr<f32>,
        shift: Ptr<f32>,
        s: ActPtr,
        scale2: Ptr<f32>,
        shift2: Ptr<f32>,
        residual_kind: i32,
        relu: i32,
        n: i64,
        channels: i32,
        out: ActPtr,
    );

    /// `grad_in = grad_out` where `relu_out > 0`, else 0, over `n` activations (in place when
    /// `grad_in` is `grad_out`).
    fn relu_backward / relu_backward_bf16(
        grad_out: ActPtr,
        relu_out: ActPtr,
        n: i64,
        grad_in: ActPtr,
    );
}
