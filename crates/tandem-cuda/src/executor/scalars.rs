//! The per-step scalars of a training step in one small device buffer: the augmentation's
//! epoch and the optimizer's settings at this step (SGD's learning rate and first-step flag,
//! Adam's host-computed step size and bias corrections, ...). The host writes the buffer with
//! one copy before each step and the kernels read it through a pointer, so a step captured as
//! a CUDA graph replays with the next step's values, and an eager step runs the same kernels
//! on the same values (see `kernels/optimizers.cu` and `kernels/augment.cu`).
//!
//! Layout (little-endian, as every CUDA GPU): bytes `0..8` the epoch (`unsigned long long`),
//! from byte 8 the optimizer's `SgdScalars` or `AdamScalars` struct of `optimizers.cu`
//! (4-byte floats and ints in declaration order, no padding).

use tandem_engine::{AdamConfig, SgdConfig};

/// Bytes of the device buffer.
pub const STEP_SCALARS_BYTES: usize = 48;
/// Byte offset of the epoch (`const unsigned long long*` of `augment_draws`).
pub const EPOCH_OFFSET: usize = 0;
/// Byte offset of the optimizer's struct (`const SgdScalars*`/`const AdamScalars*`).
pub const OPTIMIZER_OFFSET: usize = 8;

/// SGD's settings at one step, as `struct SgdScalars` of `optimizers.cu` (24 bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor.
    pub momentum: f32,
    /// Dampening of the momentum.
    pub dampening: f32,
    /// L2 penalty.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Whether this is the first step (the momentum buffer starts as the gradient).
    pub first_step: bool,
}

impl SgdScalars {
    /// The scalars of `config` for the step after `steps_taken` steps.
    pub fn new(config: &SgdConfig, steps_taken: u64) -> Self {
        SgdScalars {
            lr: config.lr,
            momentum: config.momentum,
            dampening: config.dampening,
            weight_decay: config.weight_decay,
            nesterov: config.nesterov,
            first_step: steps_taken == 0,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let floats = [self.lr, self.momentum, self.dampening, self.weight_decay];
        let ints = [i32::from(self.nesterov), i32::from(self.first_step)];
        words(&floats, &ints)
    }
}

/// Adam's host-computed scalars at step `step` (1-based), in double as the CPU's `Adam`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
    /// `1 - lr * weight_decay` (AdamW).
    pub decay_factor: f32,
    /// `1 - beta1`.
    pub lerp_weight: f32,
    /// `1 - beta2`.
    pub sq_weight: f32,
}

impl AdamScalars {
    /// The scalars of `config` at step `step`.
    pub fn new(config: &AdamConfig, step: u64) -> Self {
        let lr = f64::from(config.lr);
        let bias_correction1 = 1.0 - f64::from(config.beta1).powf(step as f64);
        let bias_correction2 = 1.0 - f64::from(config.beta2).powf(step as f64);
        AdamScalars {
            step_size: (lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            decay_factor: (1.0 - lr * f64::from(config.weight_decay)) as f32,
            lerp_weight: (1.0 - f64::from(config.beta1)) as f32,
            sq_weight: (1.0 - f64::from(config.beta2)) as f32,
        }
    }
}

/// Adam's settings at one step, as `struct AdamScalars` of `optimizers.cu` (36 bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStepScalars {
    /// The host-computed scalars.
    pub computed: AdamScalars,
    /// The configuration at this step.
    pub config: AdamConfig,
}

impl AdamStepScalars {
    /// The scalars of `config` at step `step` (1-based).
    pub fn new(config: &AdamConfig, step: u64) -> Self {
        AdamStepScalars {
            computed: AdamScalars::new(config, step),
            config: *config,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let (computed, config) = (&self.computed, &self.config);
        let floats = [
            computed.step_size,
            config.beta2,
            computed.bias_correction2_sqrt,
            config.eps,
            config.weight_decay,
            computed.decay_factor,
            computed.lerp_weight,
            computed.sq_weight,
        ];
        words(&floats, &[i32::from(config.decoupled)])
    }
}

/// The optimizer part of the buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerScalars {
    /// `sgd_step`'s.
    Sgd(SgdScalars),
    /// `adam_step`'s.
    Adam(AdamStepScalars),
}

impl OptimizerScalars {
    /// The bytes of the kernel's struct.
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            OptimizerScalars::Sgd(scalars) => scalars.bytes(),
            OptimizerScalars::Adam(scalars) => scalars.bytes(),
        }
    }
}

/// Everything a training step reads from the buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// The epoch of the augmentation's draws (0 where the batch comes from the host).
    pub epoch: u64,
    /// The optimizer's scalars at this step.
    pub optimizer: OptimizerScalars,
}

impl StepScalars {
    /// The buffer's bytes (unused bytes zero).
    pub fn bytes(&self) -> [u8; STEP_SCALARS_BYTES] {
        let mut bytes = [0u8; STEP_SCALARS_BYTES];
        bytes[EPOCH_OFFSET..EPOCH_OFFSET + 8].copy_from_slice(&self.epoch.to_le_bytes());
        let optimizer = self.optimizer.bytes();
        bytes[OPTIMIZER_OFFSET..OPTIMIZER_OFFSET + optimizer.len()].copy_from_slice(&optimizer);
        bytes
    }
}

/// 4-byte floats then 4-byte ints, little-endian, as a C struct of them lays them out.
fn words(floats: &[f32], ints: &[i32]) -> Vec<u8> {
    let floats = floats.iter().flat_map(|value| value.to_le_bytes());
    let ints = ints.iter().flat_map(|value| value.to_le_bytes());
    floats.chain(ints).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_at(bytes: &[u8], offset: usize) -> f32 {
        f32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
    }

    fn i32_at(bytes: &[u8], offset: usize) -> i32 {
        i32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
    }

    #[test]
    fn sgd_scalars_sit_where_the_kernel_reads_them() {
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
            weight_decay: 5e-4,
        };
        let first = StepScalars {
            epoch: 0x0102_0304_0506_0708,
            optimizer: OptimizerScalars::Sgd(SgdScalars::new(&config, 0)),
        }
        .bytes();
        assert_eq!(
            &first[..8],
            &[8, 7, 6, 5, 4, 3, 2, 1],
            "the epoch, little-endian"
        );
        let o = OPTIMIZER_OFFSET;
        assert_eq!(f32_at(&first, o), 0.05);
        assert_eq!(f32_at(&first, o + 4), 0.9);
        assert_eq!(f32_at(&first, o + 8), 0.1);
        assert_eq!(f32_at(&first, o + 12), 5e-4);
        assert_eq!((i32_at(&first, o + 16), i32_at(&first, o + 20)), (1, 1));
        assert!(first[o + 24..].iter().all(|&byte| byte == 0));
        let later = SgdScalars::new(&config, 7).bytes();
        assert_eq!((i32_at(&later, 16), i32_at(&later, 20)), (1, 0));
    }

    /// The buffer of step k holds `AdamScalars::new(config, k)`, the CPU optimizer's values.
    #[test]
    fn adam_scalars_at_step_k_are_the_cpu_optimizers() {
        let config = AdamConfig {
            lr: 3e-3,
            beta1: 0.85,
            beta2: 0.995,
            eps: 1e-7,
            weight_decay: 0.01,
            decoupled: true,
        };
        for step in [1u64, 2, 10, 1000] {
            let expected = AdamScalars::new(&config, step);
            let bytes = StepScalars {
                epoch: 3,
                optimizer: OptimizerScalars::Adam(AdamStepScalars::new(&config, step)),
            }
            .bytes();
            let o = OPTIMIZER_OFFSET;
            let floats: Vec<u32> = (0..8)
                .map(|k| f32_at(&bytes, o + 4 * k).to_bits())
                .collect();
            let want = [
                expected.step_size,
                config.beta2,
                expected.bias_correction2_sqrt,
                config.eps,
                config.weight_decay,
                expected.decay_factor,
                expected.lerp_weight,
                expected.sq_weight,
            ]
            .map(f32::to_bits);
            assert_eq!(floats, want, "step {step}");
            assert_eq!(i32_at(&bytes, o + 32), 1, "decoupled");
            assert_eq!(o + 36, 44);
            assert!(bytes[44..].iter().all(|&byte| byte == 0));
        }
        let step_2 = AdamScalars::new(&config, 2);
        let bias_correction1 = 1.0 - 0.85f32 as f64 * 0.85f32 as f64;
        assert_eq!(step_2.step_size, (3e-3f32 as f64 / bias_correction1) as f32);
    }
}
