//! `augment.cu`: the loader's random crop and flip of a batch, and its normalization, on the
//! device.

use super::{kernels, Ptr};

kernels! {
    file "augment";

    /// Per sample of `batch` (one thread each): its crop offsets and flip, from `seed`, the
    /// epoch at `epoch` and its image index `indices[s]`, into `draws[3s..3s + 3]`.
    fn augment_draws(
        indices: Ptr<u32>,
        batch: i32,
        seed: u64,
        epoch: Ptr<u64>,
        padding: i32,
        flip: i32,
        draws: Ptr<i32>,
    );

    /// The batch's images of bytes, augmented by `draws` and normalized by `mean` and `std`
    /// (3 floats each) into `output` (`batch * height * width * channels` floats).
    fn augment_apply(
        images: Ptr<u8>,
        indices: Ptr<u32>,
        draws: Ptr<i32>,
        batch: i32,
        height: i32,
        width: i32,
        channels: i32,
        padding: i32,
        mean: Ptr<f32>,
        std: Ptr<f32>,
        output: Ptr<f32>,
    );

    /// [`augment_apply`] of float32 images.
    fn augment_apply_f32(
        images: Ptr<f32>,
        indices: Ptr<u32>,
        draws: Ptr<i32>,
        batch: i32,
        height: i32,
        width: i32,
        channels: i32,
        padding: i32,
        mean: Ptr<f32>,
        std: Ptr<f32>,
        output: Ptr<f32>,
    );
}
