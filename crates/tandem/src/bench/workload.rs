//! What a step benchmark runs, on the CPU or the GPU: random CIFAR-sized images and labels,
//! and the optimizers with the tutorials' settings.

use clap::ValueEnum;
use tandem_engine::rng::Rng;
use tandem_engine::{AdamConfig, OptimizerConfig, SgdConfig};
use tandem_models::ModelSpec;

use crate::math::GpuMath;

/// Side of the square random images, as CIFAR-10.
pub(super) const IMAGE_SIZE: usize = 32;

/// The optimizers the benchmark can step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// Adam, lr 0.01 (seed 000's choice).
    Adam,
    /// Plain SGD, lr 1e-3 (seed 004's choice).
    Sgd,
}

/// A step benchmark on a GPU, as `bench step` settled it.
pub struct GpuBench {
    /// The model measured.
    pub spec: ModelSpec,
    /// Images per step.
    pub batch: usize,
    /// Timed steps for each of train and eval.
    pub steps: usize,
    /// The optimizer of the training step.
    pub optimizer: OptimizerKind,
    /// The GPU.
    pub device: tandem_cuda::Device,
    /// How it computes.
    pub math: GpuMath,
}

impl OptimizerKind {
    /// The benchmark's settings of this optimizer.
    pub(super) fn config(self) -> OptimizerConfig {
        match self {
            OptimizerKind::Adam => OptimizerConfig::Adam(adam_config()),
            OptimizerKind::Sgd => OptimizerConfig::Sgd(sgd_config()),
        }
    }

    /// The learning rate of [`OptimizerKind::config`].
    pub(super) fn lr(self) -> f32 {
        match self {
            OptimizerKind::Adam => adam_config().lr,
            OptimizerKind::Sgd => sgd_config().lr,
        }
    }
}

/// Adam's settings in the benchmark (seed 000's).
pub(super) fn adam_config() -> AdamConfig {
    AdamConfig::with_lr(0.01)
}

/// SGD's settings in the benchmark (seed 004's).
pub(super) fn sgd_config() -> SgdConfig {
    SgdConfig::with_lr(1e-3)
}

/// Uniform random NHWC images in [-1, 1) and random labels.
pub(super) fn random_batch(spec: &ModelSpec, batch: usize) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(2024);
    let images = (0..batch * IMAGE_SIZE * IMAGE_SIZE * spec.img_channels())
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let classes = spec.num_classes() as u64;
    let labels = (0..batch)
        .map(|_| (rng.next_u64() % classes) as u32)
        .collect();
    (images, labels)
}
