//! The GPU check's first seconds: which file each CUDA library was loaded from (and that none
//! was loaded twice), and one fp32 training step of each tutorial model against the CPU. The
//! GPU check runs this binary first, so a wrong library or a broken step costs seconds, not
//! the call; the thorough comparisons are in `gpu_executor.rs`.

mod common;

use common::{formula_batch, gpu_probe, seed_004};
use tandem_cuda::probe::{duplicated_stems, mapped_cuda_files};
use tandem_cuda::Precision;
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model, ModelSpec};

const BATCH: usize = 4;
const SIDE: usize = 32;

/// Makes a model, with the same weights each time.
type NewModel = fn() -> Model;

/// The GPU's loss, logits and gradients of one training forward and backward of the model
/// that `new_model` makes (the same weights each time) on the formula batch, beside the CPU's.
fn one_step(
    probe: &tandem_cuda::Probe,
    new_model: NewModel,
) -> ([f32; 2], [Vec<f32>; 2], [Vec<f32>; 2]) {
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    let model = &new_model();
    let mut cpu = new_model();
    let cpu_loss = cpu
        .forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
        .unwrap();
    cpu.backward(1.0, None, &mut |_, _| {}).unwrap();

    let mut exec = common::executor(probe, Precision::Fp32, model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let gpu_loss = exec
        .forward_train(model, &plan, &images, &labels, &loss, None)
        .unwrap();
    let mut gpu_logits = Vec::new();
    exec.logits_to_host(&mut gpu_logits).unwrap();
    exec.backward(model, &plan, 1.0, None, None).unwrap();
    let mut gpu_grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut gpu_grads).unwrap();
    (
        [gpu_loss, cpu_loss],
        [gpu_logits, cpu.logits().to_vec()],
        [gpu_grads, cpu.grads().to_vec()],
    )
}

/// The cosine of the angle between `a` and `b`, in float64.
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The largest `|gpu - cpu| / (1 + |cpu|)`.
fn worst_relative(gpu: &[f32], cpu: &[f32]) -> f32 {
    gpu.iter()
        .zip(cpu)
        .map(|(g, c)| (g - c).abs() / (1.0 + c.abs()))
        .fold(0.0, f32::max)
}

#[test]
fn the_cuda_libraries_each_load_from_one_file() {
    let Some(probe) = gpu_probe("the_cuda_libraries_each_load_from_one_file", &[]) else {
        return;
    };
    for line in probe.to_string().lines() {
        println!("library: {line}");
    }
    // An executor and one evaluation load everything a step uses: cuBLAS with cuBLASLt,
    // cuDNN with the sub-libraries it opens at its first convolution, NVRTC's builtins.
    let model = seed_004();
    let mut exec = common::executor(probe, Precision::Fp32, &model);
    let plan = model.plan(Mode::Eval, BATCH, SIDE, SIDE).unwrap();
    let (images, _) = formula_batch(BATCH, SIDE, 0);
    exec.forward_eval(&model, &plan, &images, &mut Vec::new())
        .unwrap();
    let mapped = mapped_cuda_files();
    for file in &mapped {
        println!("mapped: {} {}", file.stem, file.path.display());
    }
    let duplicated = duplicated_stems(&mapped);
    assert!(
        duplicated.is_empty(),
        "libraries mapped from more than one file: {duplicated:?}"
    );
}

#[test]
fn one_fp32_step_of_each_tutorial_model_matches_the_cpu() {
    let Some(probe) = gpu_probe("one_fp32_step_of_each_tutorial_model_matches_the_cpu", &[]) else {
        return;
    };
    fn resnet18() -> Model {
        Model::new(&ModelSpec::ResNet18 { num_classes: 10 }).unwrap()
    }
    let models: [(&str, NewModel); 2] = [("resnet18", resnet18), ("resnet-base", seed_004)];
    for (name, new_model) in models {
        let ([gpu_loss, cpu_loss], [gpu_logits, cpu_logits], [gpu_grads, cpu_grads]) =
            one_step(probe, new_model);
        let logits_error = worst_relative(&gpu_logits, &cpu_logits);
        let grads_cosine = cosine(&gpu_grads, &cpu_grads);
        println!(
            "smoke: {name}: loss GPU {gpu_loss} CPU {cpu_loss}, logits within {logits_error:e}, \
             gradients' cosine {grads_cosine:.7}"
        );
        assert!(
            (gpu_loss - cpu_loss).abs() <= 1e-4 * cpu_loss.abs(),
            "{name}: loss GPU {gpu_loss} CPU {cpu_loss}"
        );
        assert!(
            logits_error <= 1e-4,
            "{name}: logits within {logits_error:e}"
        );
        // A whole-vector check: single ReLUs on the knife's edge may flip between devices.
        assert!(
            grads_cosine >= 0.9999,
            "{name}: gradients' cosine {grads_cosine}"
        );
    }
}
