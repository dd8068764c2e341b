//! `optimizers.cu`: one SGD or Adam step over the flat parameters, its per-step scalars read
//! through a pointer (so that a captured step replays with the next step's values).

use super::{kernels, Ptr};
use crate::executor::scalars::{AdamStepScalars, SgdScalars};

kernels! {
    file "optimizers";

    /// One SGD step over `n` floats of each buffer.
    fn sgd_step(
        params: Ptr<f32>,
        grads: Ptr<f32>,
        momentum_buffer: Ptr<f32>,
        n: i64,
        scalars: Ptr<SgdScalars>,
    );

    /// One Adam (or AdamW) step over `n` floats of each buffer.
    fn adam_step(
        params: Ptr<f32>,
        grads: Ptr<f32>,
        exp_avg: Ptr<f32>,
        exp_avg_sq: Ptr<f32>,
        n: i64,
        scalars: Ptr<AdamStepScalars>,
    );
}
