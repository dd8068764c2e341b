//! `--precision bf16` on a GPU: one training step of the seed-004 model in bf16 against the
//! fp32 CPU executor within bf16 tolerances; and two backwards accumulating exactly twice one
//! (the bfloat16 gradients are added into the float32 ones as fp32 adds them). The conversion
//! kernels of `convert.cu` are checked with the other kernels (`gpu_kernels.rs`,
//! `kernels_on_cpu.rs`). Skipped with a printed reason without the driver, the CUDA libraries
//! or a GPU (as on CI's machines); **it has not yet run on a GPU**.

mod common;

use common::{formula_batch, gpu_probe, seed_004};
use tandem_cuda::{CudaExecutor, GpuSettings, Precision, Probe};
use tandem_models::workspace::Mode;
use tandem_models::{Executor, LossOptions, Model};

const BATCH: usize = 8;
const SIDE: usize = 32;

/// The loss of one bf16 step against fp32, relative. Each bfloat16 operand carries a relative
/// rounding error of at most 2^-9 (about 2e-3); a convolution output sums products of two
/// rounded operands (at most about 4e-3 each, of random signs, so their sum's error is
/// usually far smaller) and is rounded once more; batch norm renormalizes each layer, so the
/// errors of the model's ten-odd layers add rather than multiply, to about 1e-2 at worst on
/// the logits. The loss (about ln 10 at initialization, label smoothing 0.1) moves by less
/// than the logits do, so 2e-2 bounds it with room, while a convolution computed on the
/// wrong data (a missing conversion, a wrong layout) moves it by far more.
const LOSS_TOLERANCE: f32 = 2e-2;
/// The cosine similarity of the bf16 gradients (all of them, one vector) to the fp32 CPU's:
/// per-element errors of a few percent of the typical magnitude give about 1 - 1e-3; a
/// layer's gradient lost or counted twice gives far less.
const GRADIENT_COSINE: f64 = 0.99;
/// The bf16 gradient vector's norm against the CPU's, relative.
const GRADIENT_NORM_TOLERANCE: f64 = 5e-2;

fn bf16_executor(probe: &Probe, model: &Model) -> CudaExecutor {
    let settings = GpuSettings {
        ordinal: 0,
        precision: Precision::Bf16,
        deterministic: true,
    };
    CudaExecutor::new(probe, settings, None, model).unwrap()
}

/// Cosine similarity and norm ratio of `found` to `expected`, in f64.
fn cosine_and_norm_ratio(found: &[f32], expected: &[f32]) -> (f64, f64) {
    let (mut dot, mut found_sq, mut expected_sq) = (0.0f64, 0.0f64, 0.0f64);
    for (&f, &e) in found.iter().zip(expected) {
        let (f, e) = (f64::from(f), f64::from(e));
        dot += f * e;
        found_sq += f * f;
        expected_sq += e * e;
    }
    (
        dot / (found_sq.sqrt() * expected_sq.sqrt()),
        found_sq.sqrt() / expected_sq.sqrt(),
    )
}

#[test]
fn a_bf16_training_step_is_within_bf16_tolerances_of_the_fp32_cpu() {
    let Some(probe) = gpu_probe(
        "a_bf16_training_step_is_within_bf16_tolerances_of_the_fp32_cpu",
        &[],
    ) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let mut cpu = seed_004();
    let cpu_loss = cpu
        .forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
        .unwrap();
    cpu.backward(1.0, None, &mut |_, _| {}).unwrap();

    let model = seed_004();
    let mut exec = bf16_executor(probe, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let gpu_loss = exec
        .forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut logits = Vec::new();
    exec.logits_to_host(&mut logits);
    exec.take_error().unwrap();

    let loss_error = (gpu_loss - cpu_loss).abs() / cpu_loss.abs();
    eprintln!("bf16 loss {gpu_loss}, fp32 CPU {cpu_loss}: relative error {loss_error:e}");
    assert!(
        loss_error <= LOSS_TOLERANCE,
        "loss bf16 {gpu_loss} CPU {cpu_loss} (relative error {loss_error:e} > {LOSS_TOLERANCE:e})"
    );
    assert!(logits.iter().all(|value| value.is_finite()), "{logits:?}");
    let mut grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut grads).unwrap();
    let (cosine, norm_ratio) = cosine_and_norm_ratio(&grads, cpu.grads());
    eprintln!("bf16 gradients: cosine {cosine}, norm ratio {norm_ratio}");
    assert!(cosine >= GRADIENT_COSINE, "gradient cosine {cosine}");
    assert!(
        (norm_ratio - 1.0).abs() <= GRADIENT_NORM_TOLERANCE,
        "gradient norm ratio {norm_ratio}"
    );
}

#[test]
fn two_bf16_backwards_accumulate_exactly_twice_one() {
    let Some(probe) = gpu_probe("two_bf16_backwards_accumulate_exactly_twice_one", &[]) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    let model = seed_004();
    let mut exec = bf16_executor(probe, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    exec.forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut once = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut once).unwrap();
    // The same backward again (deterministic algorithms: the same bfloat16 gradients), added
    // to the first: x + x is exact, so every gradient must be exactly twice the first.
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut twice = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut twice).unwrap();
    assert!(once.iter().any(|&value| value != 0.0), "no gradient at all");
    for (i, (&one, &two)) in once.iter().zip(&twice).enumerate() {
        assert_eq!(
            two.to_bits(),
            (2.0 * one).to_bits(),
            "gradient {i}: {one} then {two}"
        );
    }
}
