//! Learning-rate schedules, as functions of the optimizer step.
//!
//! Each schedule maps the global optimizer step (0-based) to a learning rate, so that a run
//! resumed at step `s` gets exactly the rate an uninterrupted run had there.

use serde::{Deserialize, Serialize};

/// The shape of the learning-rate curve over a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// The base rate throughout.
    Constant,
    /// The base rate times `gamma` after every `step_epochs` epochs (PyTorch's `StepLR`).
    Step,
    /// Cosine annealing from the base rate to zero over the run (`CosineAnnealingLR`).
    Cosine,
    /// PyTorch's `OneCycleLR` with cosine annealing: up from `lr / 25` to `lr` over the first
    /// 30% of the steps, then down to `lr / (25 * 1e4)`; the momentum (Adam's `beta1`)
    /// cycles the other way, from 0.95 down to 0.85 and back, as `OneCycleLR` does by
    /// default (`cycle_momentum=True`).
    Onecycle,
}

/// A learning-rate schedule resolved for one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// The curve's shape.
    pub kind: ScheduleKind,
    /// The peak (base) learning rate.
    pub base_lr: f64,
    /// Optimizer steps in one epoch.
    pub steps_per_epoch: u64,
    /// Optimizer steps in the whole run.
    pub total_steps: u64,
    /// Linear warm-up from near zero to the curve's value over this many steps.
    pub warmup_steps: u64,
    /// For `Step`: epochs between decays.
    pub step_epochs: u64,
    /// For `Step`: the decay factor.
    pub gamma: f64,
}

/// `OneCycleLR`'s defaults.
const ONECYCLE_PCT_START: f64 = 0.3;
const ONECYCLE_DIV_FACTOR: f64 = 25.0;
const ONECYCLE_FINAL_DIV_FACTOR: f64 = 1e4;
const ONECYCLE_BASE_MOMENTUM: f64 = 0.85;
const ONECYCLE_MAX_MOMENTUM: f64 = 0.95;

impl Schedule {
    /// The learning rate for optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        let curve = match self.kind {
            ScheduleKind::Constant => self.base_lr,
            ScheduleKind::Step => {
                let epoch = step / self.steps_per_epoch.max(1);
                let decays = epoch / self.step_epochs.max(1);
                self.base_lr * self.gamma.powi(decays.min(i32::MAX as u64) as i32)
            }
            ScheduleKind::Cosine => {
                let progress = step.min(self.total_steps) as f64 / self.total_steps.max(1) as f64;
                self.base_lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            ScheduleKind::Onecycle => self.onecycle_lr(step),
        };
        if step < self.warmup_steps {
            curve * (step + 1) as f64 / self.warmup_steps as f64
        } else {
            curve
        }
    }

    /// The momentum for optimizer step `step`, for schedules that cycle it (one-cycle);
    /// `None` leaves the optimizer's own.
    pub fn momentum_at(&self, step: u64) -> Option<f64> {
        match self.kind {
            ScheduleKind::Onecycle => Some(match self.onecycle_phase(step) {
                OnecyclePhase::Rising(fraction) => {
                    cosine(ONECYCLE_MAX_MOMENTUM, ONECYCLE_BASE_MOMENTUM, fraction)
                }
                OnecyclePhase::Falling(fraction) => {
                    cosine(ONECYCLE_BASE_MOMENTUM, ONECYCLE_MAX_MOMENTUM, fraction)
                }
            }),
            _ => None,
        }
    }

    /// `OneCycleLR` (two phases, cosine annealing), as PyTorch computes it per step.
    fn onecycle_lr(&self, step: u64) -> f64 {
        let initial_lr = self.base_lr / ONECYCLE_DIV_FACTOR;
        let min_lr = initial_lr / ONECYCLE_FINAL_DIV_FACTOR;
        match self.onecycle_phase(step) {
            OnecyclePhase::Rising(fraction) => cosine(initial_lr, self.base_lr, fraction),
            OnecyclePhase::Falling(fraction) => cosine(self.base_lr, min_lr, fraction),
        }
    }

    /// Where `step` falls in `OneCycleLR`'s two phases: the first ends at step
    /// `0.3 · total - 1`, the second at the last step.
    fn onecycle_phase(&self, step: u64) -> OnecyclePhase {
        let last_step = self.total_steps.saturating_sub(1).max(1) as f64;
        let warm_end = ONECYCLE_PCT_START * self.total_steps as f64 - 1.0;
        let step = step as f64;
        if step <= warm_end {
            OnecyclePhase::Rising(step / warm_end.max(f64::MIN_POSITIVE))
        } else {
            let span = (last_step - warm_end).max(f64::MIN_POSITIVE);
            OnecyclePhase::Falling(((step - warm_end) / span).min(1.0))
        }
    }
}

/// A step's place in `OneCycleLR`: the fraction done of the rising or the falling phase.
enum OnecyclePhase {
    Rising(f64),
    Falling(f64),
}

/// Cosine annealing from `start` to `end`, `fraction` of the way.
fn cosine(start: f64, end: f64, fraction: f64) -> f64 {
    end + (start - end) / 2.0 * ((std::f64::consts::PI * fraction).cos() + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: ScheduleKind) -> Schedule {
        Schedule {
            kind,
            base_lr: 0.1,
            steps_per_epoch: 10,
            total_steps: 100,
            warmup_steps: 0,
            step_epochs: 3,
            gamma: 0.1,
        }
    }

    #[test]
    fn constant_and_step() {
        assert_eq!(schedule(ScheduleKind::Constant).lr_at(57), 0.1);
        let step = schedule(ScheduleKind::Step);
        assert_eq!(step.lr_at(29), 0.1);
        assert!((step.lr_at(30) - 0.01).abs() < 1e-15);
        assert!((step.lr_at(60) - 0.001).abs() < 1e-15);
    }

    #[test]
    fn cosine_ends_at_zero() {
        let cosine = schedule(ScheduleKind::Cosine);
        assert_eq!(cosine.lr_at(0), 0.1);
        assert!((cosine.lr_at(50) - 0.05).abs() < 1e-12);
        assert!(cosine.lr_at(100).abs() < 1e-12);
    }

    #[test]
    fn onecycle_matches_pytorch_shape() {
        // PyTorch OneCycleLR(max_lr=0.1, total_steps=100): step 0 = 0.004, peak at step 29,
        // last step = 0.004 / 1e4.
        let onecycle = schedule(ScheduleKind::Onecycle);
        assert!((onecycle.lr_at(0) - 0.004).abs() < 1e-12);
        assert!((onecycle.lr_at(29) - 0.1).abs() < 1e-12);
        assert!((onecycle.lr_at(99) - 4e-7).abs() < 1e-15);
        assert!(onecycle.lr_at(14) > 0.004 && onecycle.lr_at(14) < 0.1);
    }

    #[test]
    fn onecycle_cycles_momentum_against_the_rate() {
        // PyTorch OneCycleLR(max_lr=0.1, total_steps=100) on SGD: momentum 0.95 at step 0,
        // 0.85 at the peak (step 29), back to 0.95 at the last step.
        let onecycle = schedule(ScheduleKind::Onecycle);
        let momentum = |step| onecycle.momentum_at(step).expect("one-cycle sets momentum");
        assert!((momentum(0) - 0.95).abs() < 1e-12);
        assert!((momentum(29) - 0.85).abs() < 1e-12);
        assert!((momentum(99) - 0.95).abs() < 1e-12);
        assert!(momentum(14) > 0.85 && momentum(14) < 0.95);
        assert!(momentum(64) > 0.85 && momentum(64) < 0.95);
        assert_eq!(schedule(ScheduleKind::Cosine).momentum_at(3), None);
    }

    #[test]
    fn warmup_is_linear() {
        let mut constant = schedule(ScheduleKind::Constant);
        constant.warmup_steps = 4;
        assert!((constant.lr_at(0) - 0.025).abs() < 1e-15);
        assert!((constant.lr_at(3) - 0.1).abs() < 1e-15);
        assert_eq!(constant.lr_at(4), 0.1);
    }
}
