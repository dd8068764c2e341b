//! Optimizers on flat parameter and gradient slices, with PyTorch's update rules in the
//! order of float operations of its single-tensor (`foreach=False`) implementation.

use rayon::prelude::*;

use crate::error::EngineError;

/// Values per parallel chunk of an optimizer step; fixed so results do not depend on threads.
const CHUNK: usize = 1 << 14;

/// An optimizer that updates a flat parameter slice from a flat gradient slice.
pub trait Optimizer: Send {
    /// One update step.
    fn step(&mut self, params: &mut [f32], grads: &[f32]);
    /// The current learning rate.
    fn lr(&self) -> f32;
    /// Sets the learning rate for the following steps (for schedules).
    fn set_lr(&mut self, lr: f32);
    /// Sets the momentum for the following steps (for schedules that cycle it, as
    /// `OneCycleLR` does): SGD's momentum factor, Adam's `beta1`. SGD configured without
    /// momentum keeps none.
    fn set_momentum(&mut self, momentum: f32);
    /// The state to save in a snapshot: step count and named flat slots.
    fn state(&self) -> OptimizerState;
    /// Restores a state saved by [`Optimizer::state`].
    fn load_state(&mut self, state: &OptimizerState) -> Result<(), EngineError>;
}

/// An optimizer's state: the number of steps taken and its named per-parameter slots.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    /// Steps taken so far.
    pub step: u64,
    /// Named flat slots, e.g. `("momentum_buffer", …)`, `("exp_avg", …)`, `("exp_avg_sq", …)`.
    pub slots: Vec<(String, Vec<f32>)>,
}

/// Settings of [`Sgd`], as `torch.optim.SGD`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0 = plain SGD).
    pub momentum: f32,
    /// Dampening for momentum.
    pub dampening: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
}

impl SgdConfig {
    /// Plain SGD (no momentum, dampening, Nesterov or weight decay) with learning rate `lr`.
    pub fn with_lr(lr: f32) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

/// Panics unless `params` and `grads` (of optimizer `name`) have the same length.
fn assert_same_lengths(name: &str, params: &[f32], grads: &[f32]) {
    assert_eq!(
        params.len(),
        grads.len(),
        "{name}: params and grads lengths differ"
    );
}

/// Stochastic gradient descent with optional momentum, as `torch.optim.SGD`.
pub struct Sgd {
    config: SgdConfig,
    step: u64,
    momentum_buffer: Vec<f32>,
}

impl Sgd {
    /// An optimizer for `len` parameters.
    pub fn new(len: usize, config: SgdConfig) -> Self {
        let buffer_len = if config.momentum != 0.0 { len } else { 0 };
        Sgd {
            config,
            step: 0,
            momentum_buffer: vec![0.0; buffer_len],
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        assert_same_lengths("sgd", params, grads);
        let SgdConfig {
            lr,
            momentum,
            dampening,
            nesterov,
            weight_decay,
        } = self.config;
        let first_step = self.step == 0;
        let update = move |p: &mut f32, g: f32, buffer: Option<&mut f32>| {
            let mut g = if weight_decay != 0.0 {
                g + weight_decay * *p
            } else {
                g
            };
            if let Some(buffer) = buffer {
                *buffer = if first_step {
                    g
                } else {
                    *buffer * momentum + (1.0 - dampening) * g
                };
                g = if nesterov {
                    g + momentum * *buffer
                } else {
                    *buffer
                };
            }
            *p += -lr * g;
        };
        if momentum != 0.0 {
            assert_eq!(
                self.momentum_buffer.len(),
                params.len(),
                "sgd: optimizer built for another length"
            );
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .zip(self.momentum_buffer.par_chunks_mut(CHUNK))
                .for_each(|((p, g), b)| {
                    for ((p, &g), b) in p.iter_mut().zip(g).zip(b) {
                        update(p, g, Some(b));
                    }
                });
        } else {
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .for_each(|(p, g)| {
                    for (p, &g) in p.iter_mut().zip(g) {
                        update(p, g, None);
                    }
                });
        }
        self.step += 1;
    }

    fn lr(&self) -> f32 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.config.lr = lr;
    }

    fn set_momentum(&mut self, momentum: f32) {
        if self.config.momentum != 0.0 {
            self.config.momentum = momentum;
        }
    }

    fn state(&self) -> OptimizerState {
        let slots = if self.config.momentum != 0.0 {
            vec![("momentum_buffer".to_string(), self.momentum_buffer.clone())]
        } else {
            Vec::new()
        };
        OptimizerState {
            step: self.step,
            slots,
        }
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<(), EngineError> {
        let mut slots: Vec<(&str, &mut Vec<f32>)> = Vec::new();
        if self.config.momentum != 0.0 {
            slots.push(("momentum_buffer", &mut self.momentum_buffer));
        }
        load_slots(state, &mut slots)?;
        self.step = state.step;
        Ok(())
    }
}

/// Settings of [`Adam`], as `torch.optim.Adam` / `torch.optim.AdamW`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Weight decay: an L2 penalty for Adam, decoupled for AdamW.
    pub weight_decay: f32,
    /// `true` for AdamW (decoupled weight decay).
    pub decoupled: bool,
}

impl AdamConfig {
    /// PyTorch's defaults (betas 0.9, 0.999, eps 1e-8, no weight decay) with learning rate `lr`.
    pub fn with_lr(lr: f32) -> Self {
        AdamConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }
}

/// Adam and AdamW, as `torch.optim.Adam` / `torch.optim.AdamW` (no amsgrad).
pub struct Adam {
    config: AdamConfig,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
}

impl Adam {
    /// An optimizer for `len` parameters.
    pub fn new(len: usize, config: AdamConfig) -> Self {
        Adam {
            config,
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
        }
    }
}

impl Optimizer for Adam {
    fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        assert_same_lengths("adam", params, grads);
        assert_eq!(
            self.exp_avg.len(),
            params.len(),
            "adam: optimizer built for another length"
        );
        self.step += 1;
        let AdamConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } = self.config;
        // Scalars as PyTorch computes them: in f64 (Python floats), then used as f32.
        let lr64 = f64::from(lr);
        let step = self.step as f64;
        let bias_correction1 = 1.0 - f64::from(beta1).powf(step);
        let bias_correction2 = 1.0 - f64::from(beta2).powf(step);
        let step_size = (lr64 / bias_correction1) as f32;
        let bias_correction2_sqrt = bias_correction2.sqrt() as f32;
        let decay_factor = (1.0 - lr64 * f64::from(weight_decay)) as f32;
        let lerp_weight = (1.0 - f64::from(beta1)) as f32;
        let sq_weight = (1.0 - f64::from(beta2)) as f32;
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(self.exp_avg.par_chunks_mut(CHUNK))
            .zip(self.exp_avg_sq.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                    let mut g = g;
                    if weight_decay != 0.0 {
                        if decoupled {
                            *p *= decay_factor;
                        } else {
                            g += weight_decay * *p;
                        }
                    }
                    *m = lerp(*m, g, lerp_weight);
                    *v = *v * beta2 + sq_weight * g * g;
                    let denom = v.sqrt() / bias_correction2_sqrt + eps;
                    *p += -step_size * (*m / denom);
                }
            });
    }

    fn lr(&self) -> f32 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.config.lr = lr;
    }

    fn set_momentum(&mut self, momentum: f32) {
        self.config.beta1 = momentum;
    }

    fn state(&self) -> OptimizerState {
        OptimizerState {
            step: self.step,
            slots: vec![
                ("exp_avg".to_string(), self.exp_avg.clone()),
                ("exp_avg_sq".to_string(), self.exp_avg_sq.clone()),
            ],
        }
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<(), EngineError> {
        load_slots(
            state,
            &mut [
                ("exp_avg", &mut self.exp_avg),
                ("exp_avg_sq", &mut self.exp_avg_sq),
            ],
        )?;
        self.step = state.step;
        Ok(())
    }
}

/// An optimizer's settings, whichever device runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`.
    Sgd(SgdConfig),
    /// `torch.optim.Adam` / `AdamW`.
    Adam(AdamConfig),
}

impl OptimizerConfig {
    /// The CPU optimizer of these settings over `len` parameters, with a zero state.
    pub fn cpu(&self, len: usize) -> Box<dyn Optimizer> {
        match *self {
            OptimizerConfig::Sgd(config) => Box::new(Sgd::new(len, config)),
            OptimizerConfig::Adam(config) => Box::new(Adam::new(len, config)),
        }
    }

    /// Sets the learning rate, as [`Optimizer::set_lr`].
    pub fn set_lr(&mut self, lr: f32) {
        match self {
            OptimizerConfig::Sgd(config) => config.lr = lr,
            OptimizerConfig::Adam(config) => config.lr = lr,
        }
    }

    /// Sets the momentum, as [`Optimizer::set_momentum`]: SGD's factor unless it has none,
    /// Adam's `beta1`.
    pub fn set_momentum(&mut self, momentum: f32) {
        match self {
            OptimizerConfig::Sgd(config) if config.momentum != 0.0 => config.momentum = momentum,
            OptimizerConfig::Sgd(_) => {}
            OptimizerConfig::Adam(config) => config.beta1 = momentum,
        }
    }
}

/// `torch.lerp(start, end, weight)` as ATen computes it.
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// Copies each known slot from `state`, checking names and lengths first so a bad state
/// changes nothing.
fn load_slots(
    state: &OptimizerState,
    slots: &mut [(&str, &mut Vec<f32>)],
) -> Result<(), EngineError> {
    let known = slots
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ");
    for (name, _) in &state.slots {
        if !slots.iter().any(|(known_name, _)| known_name == name) {
            return Err(EngineError::UnknownOptimizerSlot {
                slot: name.clone(),
                known,
            });
        }
    }
    let mut sources = Vec::with_capacity(slots.len());
    for (name, target) in slots.iter() {
        let Some((_, values)) = state.slots.iter().find(|(slot, _)| slot == name) else {
            let present = state
                .slots
                .iter()
                .map(|(slot, _)| slot.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(EngineError::MissingOptimizerSlot {
                slot: (*name).to_string(),
                present,
            });
        };
        if values.len() != target.len() {
            return Err(EngineError::OptimizerSlotLength {
                slot: (*name).to_string(),
                found: values.len(),
                expected: target.len(),
            });
        }
        sources.push(values);
    }
    for ((_, target), values) in slots.iter_mut().zip(sources) {
        target.copy_from_slice(values);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_optimizer_settings_follow_the_cpu_optimizers_rules() {
        let mut sgd = OptimizerConfig::Sgd(SgdConfig::with_lr(0.1));
        sgd.set_momentum(0.9);
        sgd.set_lr(0.5);
        let OptimizerConfig::Sgd(config) = sgd else {
            unreachable!()
        };
        assert_eq!(
            (config.lr, config.momentum),
            (0.5, 0.0),
            "no momentum stays none"
        );
        let mut adam = OptimizerConfig::Adam(AdamConfig::with_lr(0.01));
        adam.set_momentum(0.85);
        let OptimizerConfig::Adam(config) = adam else {
            unreachable!()
        };
        assert_eq!(config.beta1, 0.85);
    }
}
