//! `--precision bf16` on a GPU, its activations bfloat16 in memory: one training step of the
//! seed-004 model (one block per stage: see [`shallow_seed_004`]) in bf16 against the fp32 CPU
//! executor within bf16 tolerances; and two backwards accumulating exactly twice one (the
//! bfloat16 weight gradients are added into the float32 ones as fp32 adds them). The
//! conversion kernels of `convert.cu` and the `_bf16` kernels' float32 twins are checked with
//! the other kernels (`gpu_kernels.rs`). CI runs them on the fake GPU of `tests/fake_gpu`;
//! without a GPU they are skipped with a printed reason.

mod common;

use common::{formula_batch, gpu_probe, seed_004, shallow_seed_004};
use tandem_cuda::Precision;
use tandem_models::workspace::Mode;
use tandem_models::LossOptions;

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
/// The smallest cosine similarity of a parameter's bf16 gradient to the fp32 CPU's. bfloat16
/// operands move the ReLU masks and batch statistics of every layer, and the gradients of the
/// first layers, which add up everything below, move most: on the fake GPU of
/// `tests/fake_gpu` (bfloat16 operands, wider accumulation) the worst parameter of
/// [`shallow_seed_004`] reaches 0.86 and the whole vector 0.96, about what the CPU's own
/// gradients do when only the images move by a bfloat16 rounding (0.99). A layer's gradient
/// computed from the wrong data, lost or sent to another layer gives about 0.
const GRADIENT_COSINE: f64 = 0.8;
/// How far a parameter's bf16 gradient norm may stray from the CPU's, relative (seen: 16%);
/// a gradient counted twice is 100% off.
const GRADIENT_NORM_TOLERANCE: f64 = 0.35;
/// Gradients smaller than this fraction of the largest parameter's are rounding noise on both
/// sides (a convolution bias feeding a batch norm has an exact gradient of 0) and not compared.
const GRADIENT_FLOOR: f64 = 1e-4;

/// The smallest cosine similarity of a bf16 evaluation's logits to the fp32 CPU's, and how
/// far their norm may stray (relative). Seen on the fake GPU: 0.999997 and 0.4%; the stem
/// reading its float32 images as bfloat16 gives values unrelated to the CPU's.
const EVAL_LOGITS_COSINE: f64 = 0.99;
const EVAL_LOGITS_NORM_TOLERANCE: f64 = 0.1;

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
    let mut cpu = shallow_seed_004();
    let cpu_loss = cpu
        .forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
        .unwrap();
    cpu.backward(1.0, None, &mut |_, _| {}).unwrap();

    let model = shallow_seed_004();
    let mut exec = common::executor(probe, Precision::Bf16, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let gpu_loss = exec
        .forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut logits = Vec::new();
    exec.logits_to_host(&mut logits).unwrap();

    let loss_error = (gpu_loss - cpu_loss).abs() / cpu_loss.abs();
    eprintln!("bf16 loss {gpu_loss}, fp32 CPU {cpu_loss}: relative error {loss_error:e}");
    assert!(
        loss_error <= LOSS_TOLERANCE,
        "loss bf16 {gpu_loss} CPU {cpu_loss} (relative error {loss_error:e} > {LOSS_TOLERANCE:e})"
    );
    assert!(logits.iter().all(|value| value.is_finite()), "{logits:?}");
    let mut grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut grads).unwrap();
    let params: Vec<_> = model
        .tensors()
        .iter()
        .filter(|info| info.kind == tandem_models::TensorKind::Param)
        .collect();
    let norm = |values: &[f32]| {
        values
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let largest = params
        .iter()
        .map(|info| norm(&cpu.grads()[info.range()]))
        .fold(0.0, f64::max);
    let mut compared = 0;
    for info in params {
        let range = info.range();
        if norm(&cpu.grads()[range.clone()]) < GRADIENT_FLOOR * largest {
            continue;
        }
        let (cosine, norm_ratio) =
            cosine_and_norm_ratio(&grads[range.clone()], &cpu.grads()[range]);
        assert!(
            cosine >= GRADIENT_COSINE && (norm_ratio - 1.0).abs() <= GRADIENT_NORM_TOLERANCE,
            "{}: bf16 gradient cosine {cosine}, norm ratio {norm_ratio} against the fp32 CPU's",
            info.name
        );
        compared += 1;
    }
    assert!(compared >= 20, "only {compared} gradients above the floor");
    let (cosine, norm_ratio) = cosine_and_norm_ratio(&grads, cpu.grads());
    eprintln!("bf16 gradients: cosine {cosine}, norm ratio {norm_ratio}");
}

#[test]
fn two_bf16_backwards_accumulate_exactly_twice_one() {
    let Some(probe) = gpu_probe("two_bf16_backwards_accumulate_exactly_twice_one", &[]) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    let model = seed_004();
    let mut exec = common::executor(probe, Precision::Bf16, &model);
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

/// An evaluation plan reuses the images slot for later activations once the stem has read
/// the images (for the seed-004 model: the convolution outputs of later units, projection
/// shortcuts read back by the residual add): in bf16 those are bfloat16 in the float32
/// allocation, and only the stem's input is float32 (`DeviceStorage::image_reader`). The
/// logits of the bf16 evaluation stay close to the fp32 CPU's (the bound: bfloat16 rounding
/// of every layer's operands); reading bfloat16 values as float32 or the reverse would give
/// values unrelated to them.
#[test]
fn a_bf16_evaluation_through_the_reused_images_slot_is_close_to_the_fp32_cpu() {
    let Some(probe) = gpu_probe(
        "a_bf16_evaluation_through_the_reused_images_slot_is_close_to_the_fp32_cpu",
        &[],
    ) else {
        return;
    };
    let (images, _) = formula_batch(BATCH, SIDE, 0);
    let model = seed_004();
    let plan = model.plan(Mode::Eval, BATCH, SIDE, SIDE).unwrap();
    assert!(
        plan.unit_plans()
            .any(|unit| unit.index != plan.stem.index && unit.z == plan.images),
        "the plan no longer reuses the images slot for a later unit's activations"
    );
    let mut exec = common::executor(probe, Precision::Bf16, &model);
    let mut logits = Vec::new();
    exec.forward_eval(&model, &plan, &images, &mut logits)
        .unwrap();
    let mut cpu = seed_004();
    let cpu_logits = cpu
        .forward_eval(&images, BATCH, SIDE, SIDE)
        .unwrap()
        .to_vec();
    let (cosine, norm_ratio) = cosine_and_norm_ratio(&logits, &cpu_logits);
    eprintln!("bf16 evaluation logits: cosine {cosine}, norm ratio {norm_ratio}");
    assert!(
        cosine >= EVAL_LOGITS_COSINE && (norm_ratio - 1.0).abs() <= EVAL_LOGITS_NORM_TOLERANCE,
        "bf16 logits cosine {cosine}, norm ratio {norm_ratio} against the fp32 CPU's"
    );
}
