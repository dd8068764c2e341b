//! `tandem bench step --device cuda`: the same three lines as on the CPU, measured with the
//! GPU executor of `tandem-cuda` (`--precision`, TF32 by default; deterministic algorithms; one
//! process). The executor has not yet run on a GPU, so the first line says it is unverified.

use std::time::Instant;

use tandem_cuda::{CudaExecutor, Precision};
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model, ModelSpec};

use super::step::{adam_config, random_batch, sgd_config, OptimizerKind, IMAGE_SIZE};

/// Runs the benchmark on GPU `ordinal`: `train:`, `eval:` and `peak memory:` (the most GPU
/// memory in use after the warm-up and after each timed phase, from `cuMemGetInfo`).
pub fn run(
    spec: &ModelSpec,
    batch: usize,
    steps: usize,
    optimizer: OptimizerKind,
    ordinal: usize,
    precision: Precision,
) -> anyhow::Result<()> {
    let model = Model::new(spec)?;
    let mut exec = crate::compute::open_executor(&model, ordinal, precision)?;
    let (images, labels) = random_batch(spec, batch);
    let train_plan = model.plan(Mode::Train, batch, IMAGE_SIZE, IMAGE_SIZE)?;
    let eval_plan = model.plan(Mode::Eval, batch, IMAGE_SIZE, IMAGE_SIZE)?;
    let loss = LossOptions::default();
    let mut peak_bytes = 0;

    let train_rate = timed(batch, steps, &mut exec, &mut peak_bytes, |exec| {
        exec.zero_grads()?;
        exec.forward_train(&model, &train_plan, &images, &labels, &loss, None)?;
        exec.backward(&model, &train_plan, 1.0, None, None)?;
        match optimizer {
            OptimizerKind::Sgd => exec.sgd_step(&sgd_config())?,
            OptimizerKind::Adam => exec.adam_step(&adam_config())?,
        }
        Ok(())
    })?;
    let mut logits = Vec::new();
    let eval_rate = timed(batch, steps, &mut exec, &mut peak_bytes, |exec| {
        exec.forward_eval(&model, &eval_plan, &images, &mut logits)?;
        Ok(())
    })?;
    say!("train: {train_rate:.1} img/s");
    say!("eval: {eval_rate:.1} img/s");
    say!("peak memory: {} MB", peak_bytes / (1024 * 1024));
    Ok(())
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
