//! `convert.cu`: float32 to bfloat16 (round to nearest even) and back.

use super::{kernels, Ptr};

kernels! {
    file "convert";

    /// `y = bfloat16(x)` over `n` values.
    fn float_to_bf16(x: Ptr<f32>, n: i64, y: Ptr<u16>);

    /// `y = float(x)` over `n` values.
    fn bf16_to_float(x: Ptr<u16>, n: i64, y: Ptr<f32>);

    /// `y += float(x)` over `n` values.
    fn bf16_add_to_float(x: Ptr<u16>, n: i64, y: Ptr<f32>);
}
