//! `tandem bench step --device cuda`: the same three lines as on the CPU, measured through
//! the GPU's training device (`--precision`, TF32 by default; deterministic algorithms; one
//! process), and a `graphs:` line saying whether the timed training steps replayed a CUDA
//! graph (`TANDEM_CUDA_GRAPHS=0` turns capture off, as in `train`). The batch lives in GPU
//! memory, as a training set does in `train` (and as PyTorch's benchmark keeps its batch):
//! each step assembles it there from its indices, so no image crosses from the host. The
//! executor has not yet run on a GPU, so the first line says it is unverified.

use std::time::Instant;

use anyhow::Context;
use tandem_models::training_device::{
    DatasetUpload, StepRequest, StepRun, TrainBatch, TrainImages, UploadPixels, Uploaded,
};
use tandem_models::{LossOptions, Model, TrainingDevice};

use super::workload::{random_batch, GpuBench, IMAGE_SIZE};

/// Runs the benchmark: `train:`, `eval:`, `peak memory:` (the most GPU memory in use after
/// the warm-up and after each timed phase, from `cuMemGetInfo`) and `graphs:`. A training
/// step is the device's whole step over the random batch in GPU memory (no crop, flip or
/// normalization): two warm-up steps (the eager first run and the capture), then the timed
/// ones; an evaluation is a forward of the same batch, from its own copy in GPU memory.
pub fn run(bench: GpuBench) -> anyhow::Result<()> {
    let GpuBench {
        spec,
        batch,
        steps,
        optimizer,
        device,
        math,
    } = bench;
    let model = Model::new(&spec)?;
    let mut job = crate::device::open_training_device(model, &device, Some(math))?;
    job.set_optimizer(optimizer.config());
    let (images, labels) = random_batch(&spec, batch);
    let as_they_are = DatasetUpload {
        pixels: UploadPixels::F32(&images),
        len: batch,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        channels: spec.img_channels(),
        crop_padding: 0,
        horizontal_flip: false,
        mean: [0.0; 3],
        std: [1.0; 3],
        seed: 0,
    };
    in_device_memory(job.upload_train_set(as_they_are)?)?;
    in_device_memory(job.upload_eval_set(as_they_are)?)?;
    let indices: Vec<usize> = (0..batch).collect();
    let loss = LossOptions::default();
    let micro_batches = [TrainBatch {
        images: TrainImages::OnDevice {
            indices: &indices,
            epoch: 0,
        },
        labels: &labels,
    }];
    let request = StepRequest {
        micro_batches: &micro_batches,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        loss: &loss,
        lr: f64::from(optimizer.lr()),
        momentum: None,
    };
    let mut peak_bytes = 0;
    let mut runs = Vec::new();
    let mut graphs_off = None;
    let mut relaxed_capture = None;
    let mut train_step = |job: &mut dyn TrainingDevice| -> anyhow::Result<()> {
        let report = job.train_step(request)?;
        runs.push(report.run.context("a GPU step says how it ran")?);
        graphs_off = graphs_off.take().or(report.graphs_off);
        relaxed_capture = relaxed_capture.take().or(report.relaxed_capture);
        Ok(())
    };
    // The first run is eager; the second is captured when graphs are on.
    train_step(&mut *job)?;
    let train_rate = timed(batch, steps, &mut *job, &mut peak_bytes, &mut train_step)?;
    let timed_runs = runs.split_off(runs.len().saturating_sub(steps));
    let eval_rate = timed(batch, steps, &mut *job, &mut peak_bytes, |job| {
        job.forward_eval_on_device(&indices, IMAGE_SIZE, IMAGE_SIZE)?;
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

/// An error unless the random batch went to GPU memory.
fn in_device_memory(uploaded: Uploaded) -> anyhow::Result<()> {
    match uploaded {
        Uploaded::OnDevice(_) => Ok(()),
        Uploaded::OnHost => anyhow::bail!("the benchmark's batch stayed on the host"),
        Uploaded::TooLarge { bytes, free } => anyhow::bail!(
            "the benchmark's batch of {bytes} bytes does not fit in half the GPU's {free} bytes \
             of free memory: lower --batch"
        ),
    }
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
    job: &mut dyn TrainingDevice,
    peak_bytes: &mut usize,
    mut step: impl FnMut(&mut dyn TrainingDevice) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    step(job)?;
    job.synchronize()?;
    *peak_bytes = (*peak_bytes).max(job.memory_in_use()?.unwrap_or(0));
    let start = Instant::now();
    for _ in 0..steps {
        step(job)?;
    }
    job.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    *peak_bytes = (*peak_bytes).max(job.memory_in_use()?.unwrap_or(0));
    Ok((batch * steps) as f64 / seconds.max(1e-9))
}
