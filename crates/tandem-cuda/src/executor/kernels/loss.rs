//! `loss.cu`: cross-entropy with label smoothing, its mean and its backward.

use super::{kernels, Ptr};

kernels! {
    file "loss";

    /// Per sample of `batch` (one thread each): the softmax of its `classes` logits into
    /// `probabilities` and its loss into `sample_loss`; the first sample with a label out of
    /// range into `bad_sample`.
    fn cross_entropy_rows(
        logits: Ptr<f32>,
        labels: Ptr<u32>,
        batch: i32,
        classes: i32,
        label_smoothing: f32,
        probabilities: Ptr<f32>,
        sample_loss: Ptr<f64>,
        bad_sample: Ptr<i32>,
    );

    /// `loss` = the mean of the `batch` sample losses, by one thread.
    fn cross_entropy_mean(sample_loss: Ptr<f64>, batch: i32, loss: Ptr<f32>);

    /// `grad_logits = (probabilities - smoothed one-hot) * (scale / batch)` over
    /// `batch * classes` floats.
    fn cross_entropy_backward(
        probabilities: Ptr<f32>,
        labels: Ptr<u32>,
        batch: i32,
        classes: i32,
        label_smoothing: f32,
        scale: f32,
        grad_logits: Ptr<f32>,
    );
}
