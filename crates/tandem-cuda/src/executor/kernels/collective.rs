//! `collective.cu`: the division of the summed gradients by the number of ranks.

use super::{kernels, Ptr};

kernels! {
    file "collective";

    /// `x[i] /= divisor` over `n` floats.
    fn divide_in_place(x: Ptr<f32>, n: i64, divisor: f32);
}
