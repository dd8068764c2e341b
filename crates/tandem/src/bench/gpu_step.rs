//! `tandem bench step --device cuda`: the same three lines as on the CPU, measured with the
//! GPU executor of `tandem-cuda` (`--precision`, TF32 by default; deterministic algorithms; one
//! process), and a `graphs:` line saying whether the timed training steps replayed a CUDA
//! graph (`TANDEM_CUDA_GRAPHS=0` turns capture off, as in `train`). The batch lives in GPU
//! memory, as a training set does in `train` (and as PyTorch's benchmark keeps its batch):
//! each step assembles it there from its indices, so no image crosses from the host. The
//! executor has not yet run on a GPU, so the first line says it is unverified.

use std::time::Instant;

use tandem_cuda::executor::graph::StepRun;
use tandem_cuda::executor::{
    AugmentSettings, DatasetShape, HostPixels, StepImages, StepOptimizer, TrainStep,
};
use tandem_cuda::CudaExecutor;
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model, ModelSpec};

use super::workload::{adam_config, random_batch, sgd_config, OptimizerKind, IMAGE_SIZE};
use crate::math::GpuMath;

/// Runs the benchmark on GPU `ordinal`: `train:`, `eval:`, `peak memory:` (the most GPU
/// memory in use after the warm-up and after each timed phase, from `cuMemGetInfo`) and
/// `graphs:`. A training step is the executor's whole step (`train_step`) over the random
/// batch in GPU memory (no crop, flip or normalization): two warm-up steps (the eager first
/// run and the capture), then the timed ones; an evaluation is a forward of the same batch.
pub fn run(
    spec: &ModelSpec,
    batch: usize,
    steps: usize,
    optimizer: OptimizerKind,
    ordinal: usize,
    math: GpuMath,
) -> anyhow::Result<()> {
    let model = Model::new(spec)?;
    let mut exec = crate::compute::open_executor(&model, ordinal, math)?;
    let (images, labels) = random_batch(spec, batch);
    let shape = DatasetShape {
        len: batch,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        channels: spec.img_channels(),
    };
    let as_they_are = AugmentSettings {
        crop_padding: 0,
        horizontal_flip: false,
        mean: [0.0; 3],
        std: [1.0; 3],
        seed: 0,
    };
    let mut dataset = exec.upload_dataset(HostPixels::F32(&images), shape, as_they_are)?;
    let indices: Vec<usize> = (0..batch).collect();
    let train_plan = model.plan(Mode::Train, batch, IMAGE_SIZE, IMAGE_SIZE)?;
    let eval_plan = model.plan(Mode::Eval, batch, IMAGE_SIZE, IMAGE_SIZE)?;
    let loss = LossOptions::default();
    let mut peak_bytes = 0;
    let (sgd, adam) = (sgd_config(), adam_config());
    let step_optimizer = match optimizer {
        OptimizerKind::Sgd => StepOptimizer::Sgd(&sgd),
        OptimizerKind::Adam => StepOptimizer::Adam(&adam),
    };
    let mut runs = Vec::new();
    let mut graphs_off = None;
    let mut relaxed_capture = None;
    let mut train_step = |exec: &mut CudaExecutor| -> anyhow::Result<()> {
        let step = TrainStep {
            images: StepImages::Gathered {
                dataset: &mut dataset,
                indices: &indices,
                epoch: 0,
            },
            labels: &labels,
            micro_batches: 1,
            loss: &loss,
            optimizer: step_optimizer,
        };
        let outcome = exec.train_step(&model, &train_plan, step)?;
        runs.push(outcome.run);
        graphs_off = graphs_off.take().or(outcome.graphs_off);
        relaxed_capture = relaxed_capture.take().or(outcome.relaxed_capture);
        Ok(())
    };
    // The first run is eager; the second is captured when graphs are on.
    train_step(&mut exec)?;
    let train_rate = timed(batch, steps, &mut exec, &mut peak_bytes, &mut train_step)?;
    let timed_runs = runs.split_off(runs.len().saturating_sub(steps));
    let mut logits = Vec::new();
    let eval_rate = timed(batch, steps, &mut exec, &mut peak_bytes, |exec| {
        exec.forward_eval_gathered(&model, &eval_plan, &mut dataset, &indices, &mut logits)?;
        Ok(())
    })?;
    say!("train: {train_rate:.1} img/s");
    say!("eval: {eval_rate:.1} img/s");
    say!("peak memory: {} MB", peak_bytes / (1024 * 1024));
    say!(
        "{}",
        graphs_line(
            &timed_runs,
            graphs_off.as_deref(),
            relaxed_capture.as_deref()
        )
    );
    Ok(())
}

/// The `graphs:` line: whether each timed training step replayed a captured graph, and in
/// which capture mode when it was relaxed (`relaxed`: why).
fn graphs_line(timed_runs: &[StepRun], off: Option<&str>, relaxed: Option<&str>) -> String {
    let replayed = timed_runs
        .iter()
        .filter(|run| **run == StepRun::Replay)
        .count();
    let line = graphs_runs_line(timed_runs.len(), replayed, off);
    match relaxed {
        Some(reason) if off.is_none() => format!(
            "{line}; captured in relaxed mode (the thread-local capture was refused: {reason})"
        ),
        _ => line,
    }
}

/// The `graphs:` line's first part: `replayed` of `timed` steps replayed a graph, or why
/// graphs were `off`.
fn graphs_runs_line(timed: usize, replayed: usize, off: Option<&str>) -> String {
    match off {
        Some(reason) => format!("graphs: off ({reason}); the timed training steps ran eagerly"),
        None if replayed == timed => {
            "graphs: on; every timed training step replayed one captured CUDA graph".to_string()
        }
        None => format!(
            "graphs: {replayed} of {timed} timed training steps replayed a captured CUDA graph"
        ),
    }
}

/// Runs `step` once to warm up (storage allocated, algorithms measured, kernels loaded), then
/// `steps` times timed, waiting for the GPU at the end; returns images per second and raises
/// `peak_bytes` to the GPU memory in use after the warm-up and after the timed steps.
fn timed(
    batch: usize,
    steps: usize,
    exec: &mut CudaExecutor,
    peak_bytes: &mut usize,
    mut step: impl FnMut(&mut CudaExecutor) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    step(exec)?;
    exec.synchronize()?;
    *peak_bytes = (*peak_bytes).max(exec.device_memory_in_use()?);
    let start = Instant::now();
    for _ in 0..steps {
        step(exec)?;
    }
    exec.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    *peak_bytes = (*peak_bytes).max(exec.device_memory_in_use()?);
    Ok((batch * steps) as f64 / seconds.max(1e-9))
}
