//! `tandem bench step`: training-step and eval throughput of a model on random data.
//!
//! Prints exactly three lines, for scripts:
//! `train: 1234.5 img/s`, `eval: 4321.0 img/s`, `peak memory: 812 MB`.
//!
//! Under `tandem launch` (or any environment with `WORLD_SIZE` > 1) every rank runs the
//! data-parallel step of `tandem train` (gradients averaged in buckets during backward, BN
//! buffers broadcast) and rank 0 prints the aggregate images per second of all ranks.

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tandem_models::training_device::{StepRequest, TrainBatch, TrainImages};
use tandem_models::{CpuDevice, LossOptions, Model, ModelSpec, TrainingDevice};

use super::workload::{random_batch, GpuBench, OptimizerKind, IMAGE_SIZE};
use crate::backend::BackendRequest;
use crate::device::Announce;
use crate::model_args::ModelArgs;
use crate::settings::{available_cores, PlacementFlags};
use crate::train::ddp::{Ddp, WorkerPlacement};
use crate::train::gradient_sync::{self, run_step, GradientSync};
use crate::train::on_device::StepNotes;
use crate::train::placement::find_placement;
use crate::train::shards::ShardSync;
use tandem_data::ShardPlan;

/// Gradient buckets as `tandem train` uses them by default.
const BUCKET_BYTES: usize = 25_000_000;
const FIRST_BUCKET_BYTES: usize = 1_000_000;

/// Settings of `tandem bench step`.
#[derive(Args)]
pub struct StepArgs {
    /// The model to measure.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Images per step [default: 128 for resnet18, 256 for resnet-base].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Worker threads [default: the cores available].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Timed steps for each of train and eval, after one untimed warm-up step.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Optimizer of the training step [default: adam for resnet18, sgd for resnet-base].
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerKind>,
    #[arg(long, default_value = "auto", help = crate::device::DEVICE_HELP)]
    pub device: tandem_cuda::DeviceRequest,
    #[arg(long, value_enum, help = crate::math::PRECISION_HELP)]
    pub precision: Option<crate::math::PrecisionRequest>,
    #[arg(long, value_enum, default_value_t, help = crate::math::ALGORITHMS_HELP)]
    pub algorithms: crate::math::Algorithms,
    /// What carries the gradients under `launch`: auto (nccl when every rank has its own GPU
    /// and NCCL loads, else ring), nccl or ring.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendRequest,
    /// Time `train --global-batch-size`'s step instead: this many logical shards of `--batch`
    /// images per process, their gradients summed exactly (CPU only).
    #[arg(long)]
    pub shards_per_process: Option<usize>,
}

/// Runs the benchmark on the CPU; on a GPU, returns what to measure there.
pub fn run(args: StepArgs) -> anyhow::Result<Option<GpuBench>> {
    let (device, math) = crate::device::select(
        args.device,
        args.precision,
        args.algorithms,
        crate::device::Announce::Stdout,
    )?;
    let spec = args.model.to_spec()?;
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let is_resnet18 = matches!(spec, ModelSpec::ResNet18 { .. });
    let batch = args.batch.unwrap_or(if is_resnet18 { 128 } else { 256 });
    anyhow::ensure!(batch > 0, "--batch must be at least 1");
    let optimizer_kind = args.optimizer.unwrap_or(if is_resnet18 {
        OptimizerKind::Adam
    } else {
        OptimizerKind::Sgd
    });
    let placement = find_placement(&PlacementFlags::default())?;
    if let tandem_cuda::Device::Cuda { .. } = device {
        let math = math.context("a GPU computes with a precision and algorithms")?;
        check_gpu_bench(&args, placement.is_some())?;
        return Ok(Some(GpuBench {
            spec,
            batch,
            steps: args.steps,
            optimizer: optimizer_kind,
            device,
            math,
        }));
    }
    let local_world_size = placement.as_ref().map_or(1, |place| place.local_world_size);
    let threads = args
        .threads
        .unwrap_or((available_cores() / local_world_size.max(1)).max(1));
    anyhow::ensure!(threads > 0, "--threads must be at least 1");
    tandem_engine::set_threads(threads);

    let mut model = Model::new(&spec)?;
    model.init_default(0);
    let ddp = placement
        .as_ref()
        .map(|place| join_job(place, model.params().len()))
        .transpose()?;
    crate::backend::choose(args.backend, &device, ddp.as_ref(), Announce::Stdout)?;
    let mut cpu = CpuDevice::new(model);
    cpu.set_optimizer(optimizer_kind.config());
    let shards = args.shards_per_process.unwrap_or(1);
    let mut sync = step_sync(ddp, args.shards_per_process, batch, &mut cpu)?;
    sync.agree_on_the_model(&mut cpu)?;
    let (images, labels) = random_batch(&spec, batch);
    let loss = LossOptions::default();
    let micro_batch = TrainBatch {
        images: TrainImages::Host(&images),
        labels: &labels,
    };
    let micro_batches = vec![micro_batch; shards];
    let request = StepRequest {
        micro_batches: &micro_batches,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        loss: &loss,
        lr: f64::from(optimizer_kind.lr()),
        momentum: None,
    };
    let mut notes = StepNotes::default();
    let train_rate = images_per_second(shards * batch, args.steps, || -> anyhow::Result<()> {
        run_step(&mut cpu, &mut *sync, &mut notes, request, 0)?;
        Ok(())
    })?;
    let eval_rate = images_per_second(batch, args.steps, || -> anyhow::Result<()> {
        cpu.forward_eval(&images, batch, IMAGE_SIZE, IMAGE_SIZE)?;
        Ok(())
    })?;
    let mut rates = [train_rate, eval_rate];
    if let Some(ddp) = sync.group_mut() {
        ddp.sum_f64(&mut rates)?;
        if ddp.rank() != 0 {
            return Ok(None);
        }
        match args.shards_per_process {
            Some(shards) => {
                say!("gradients: {shards} shard(s) of {batch} images per process, summed exactly")
            }
            None => say!(
                "gradients: all-reduced through {}",
                ddp.gradient_transport()
            ),
        }
    }
    say!("train: {:.1} img/s", rates[0]);
    say!("eval: {:.1} img/s", rates[1]);
    say!("peak memory: {} MB", peak_memory_kib()? / 1024);
    Ok(None)
}

/// Refuses what a GPU benchmark does not measure: a job of several processes (`launched`),
/// and `--shards-per-process`.
fn check_gpu_bench(args: &StepArgs, launched: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !launched,
        "--device {}: bench step runs on a GPU in one process only (no launch, WORLD_SIZE 1)",
        args.device
    );
    anyhow::ensure!(
        args.shards_per_process.is_none(),
        "--device {}: --shards-per-process is measured on the CPU only",
        args.device
    );
    Ok(())
}

/// The gradient sync of the measured step: `train`'s per-process one, or with
/// `shards_per_process` that of `--global-batch-size` (that many shards of `batch` images per
/// process).
fn step_sync(
    ddp: Option<Ddp>,
    shards_per_process: Option<usize>,
    batch: usize,
    cpu: &mut CpuDevice,
) -> anyhow::Result<Box<dyn GradientSync>> {
    let Some(shards) = shards_per_process else {
        return Ok(gradient_sync::choose(ddp, cpu, false));
    };
    anyhow::ensure!(shards > 0, "--shards-per-process must be at least 1");
    let world_size = ddp.as_ref().map_or(1, Ddp::world_size);
    let global = shards * batch * world_size;
    let plan = ShardPlan::new(global, batch, global)?;
    Ok(Box::new(ShardSync::new(ddp, plan, cpu)?))
}

/// Joins the job of `place` with `params` parameters in `tandem train`'s default buckets.
fn join_job(place: &WorkerPlacement, params: usize) -> anyhow::Result<Ddp> {
    let token = tandem_dist::JobToken::from_env()?
        .context("a job of several processes needs TANDEM_JOB_TOKEN (tandem launch sets it)")?;
    Ddp::join(
        place,
        token,
        tandem_dist::DEFAULT_TIMEOUT,
        params,
        BUCKET_BYTES,
        FIRST_BUCKET_BYTES,
    )
}

/// Runs `step` once to warm up (workspaces are allocated then), then `steps` times timed.
fn images_per_second(
    batch: usize,
    steps: usize,
    mut step: impl FnMut() -> anyhow::Result<()> + Send,
) -> anyhow::Result<f64> {
    // As `tandem train` runs its steps.
    tandem_engine::run_on_kernel_threads(|| {
        step()?;
        let start = Instant::now();
        for _ in 0..steps {
            step()?;
        }
        let seconds = start.elapsed().as_secs_f64();
        Ok((batch * steps) as f64 / seconds.max(1e-9))
    })
}

/// The process's peak resident memory (`VmHWM` of /proc/self/status) in KiB.
fn peak_memory_kib() -> anyhow::Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .context("/proc/self/status has no VmHWM line")?;
    line.split_whitespace()
        .nth(1)
        .and_then(|kib| kib.parse().ok())
        .with_context(|| format!("/proc/self/status: cannot read the VmHWM value in '{line}'"))
}
