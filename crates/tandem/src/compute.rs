//! Where a model's steps run: [`Compute`] is the one interface `train`, `eval` and `predict`
//! are written against, over the CPU (the model's own host buffers) or the
//! GPU executor of `tandem-cuda` (device copies of the flat buffers).
//!
//! # Host/device crossings on the GPU
//! Each step: the batch goes to the device (or, once the training set is in GPU memory
//! ([`Compute::upload_train_set`]), only its sample indices, and the device assembles it); the loss (and, in evaluation, the logits) comes
//! back; in a job of several processes, the backward copies each finished gradient range to
//! the host for the gradient-ready hook (the executor's interface hands out host values),
//! and with one process no gradient leaves the device; with the NCCL backend
//! ([`Compute::join_nccl`]) the gradients are averaged on the device and none crosses either.
//! The optimizer runs on the device
//! over the flat buffers. A step of one micro-batch without SyncBatchNorm, in one process or
//! through NCCL, is one [`Compute::train_step`]: its inputs and per-step scalars go to the
//! device first, the loss
//! comes back after the update (one wait per step), and the GPU replays it as a CUDA graph
//! after its first two runs (`TANDEM_CUDA_GRAPHS=0` turns that off). Parameters, running statistics and optimizer state come to the
//! host only when asked for ([`Compute::host_model`] for checkpoints, snapshots and
//! broadcasts, [`Compute::optimizer_state`] for snapshots), and go back after the host
//! changed them ([`Compute::update_host`]). The snapshot format is the same flat buffers on
//! both devices, so a run may resume on the other device.
//!
//! **The GPU side has not yet run on a GPU**: it compiles here and the GPU tests
//! (`tests/gpu_train.rs`) wait for a machine with one.

use std::borrow::Cow;
use std::sync::{Arc, Weak};

use anyhow::Context;
use tandem_cuda::executor::graph::{StepConditions, StepRun};
use tandem_cuda::executor::{
    AugmentSettings, DatasetShape, DeviceDataset, GradientHook, HostPixels, StepImages,
    StepOptimizer, TrainStep,
};
use tandem_cuda::{CudaExecutor, Device, GpuSettings, Precision, Probe, PtxCache};

use crate::math::{Algorithms, GpuMath};
use tandem_data::{Augment, Dataset, Normalize, Pixels};
use tandem_engine::{Optimizer, OptimizerConfig, OptimizerState};
use tandem_models::workspace::{Mode, Plan};
use tandem_models::{BatchNormReducer, LossOptions, Model, ModelSpec};

/// The images of one training micro-batch.
#[derive(Clone, Copy, Debug)]
pub enum TrainImages<'a> {
    /// NHWC floats on the host (the CPU loader's batch).
    Host(&'a [f32]),
    /// The training set's images `indices`, assembled on the GPU with the augmentation draws
    /// of `epoch` (after [`Compute::upload_train_set`]).
    OnDevice {
        /// Dataset indices, in batch order.
        indices: &'a [usize],
        /// The epoch of the draws.
        epoch: u64,
    },
}

/// One micro-batch of a whole training step ([`Compute::train_step`]).
#[derive(Clone, Copy, Debug)]
pub struct TrainBatch<'a> {
    /// Its images.
    pub images: TrainImages<'a>,
    /// Their labels.
    pub labels: &'a [u32],
}

/// The images of a whole step's micro-batches, one after another.
enum JoinedImages<'a> {
    /// Host images.
    Host(Cow<'a, [f32]>),
    /// Dataset indices, with the epoch of their draws.
    OnDevice {
        indices: Cow<'a, [usize]>,
        epoch: u64,
    },
}

/// The images and labels of `micro_batches` one after another (borrowed when there is one):
/// an error unless there is at least one, all of one size and of one kind (host images, or
/// indices with the draws of one epoch).
fn join_micro_batches<'a>(
    micro_batches: &[TrainBatch<'a>],
) -> anyhow::Result<(JoinedImages<'a>, Cow<'a, [u32]>)> {
    let (first, rest) = micro_batches
        .split_first()
        .context("a training step needs at least one micro-batch")?;
    let batch = first.labels.len();
    if let Some(other) = rest.iter().find(|other| other.labels.len() != batch) {
        anyhow::bail!(
            "the micro-batches of one whole step must have one size: {batch} and {} images",
            other.labels.len()
        );
    }
    if rest.is_empty() {
        let images = match first.images {
            TrainImages::Host(images) => JoinedImages::Host(Cow::Borrowed(images)),
            TrainImages::OnDevice { indices, epoch } => JoinedImages::OnDevice {
                indices: Cow::Borrowed(indices),
                epoch,
            },
        };
        return Ok((images, Cow::Borrowed(first.labels)));
    }
    let labels: Vec<u32> = micro_batches
        .iter()
        .flat_map(|micro_batch| micro_batch.labels.iter().copied())
        .collect();
    let images = match first.images {
        TrainImages::Host(_) => {
            let mut joined = Vec::new();
            for micro_batch in micro_batches {
                let TrainImages::Host(images) = micro_batch.images else {
                    anyhow::bail!("the micro-batches of one whole step mix host and GPU images");
                };
                joined.extend_from_slice(images);
            }
            JoinedImages::Host(Cow::Owned(joined))
        }
        TrainImages::OnDevice { epoch, .. } => {
            let mut joined = Vec::new();
            for micro_batch in micro_batches {
                match micro_batch.images {
                    TrainImages::OnDevice {
                        indices,
                        epoch: its_epoch,
                    } if its_epoch == epoch => joined.extend_from_slice(indices),
                    _ => anyhow::bail!(
                        "the micro-batches of one whole step must be GPU images of one epoch"
                    ),
                }
            }
            JoinedImages::OnDevice {
                indices: Cow::Owned(joined),
                epoch,
            }
        }
    };
    Ok((images, Cow::Owned(labels)))
}

/// A model and the device its steps run on.
pub struct Compute {
    /// The network description and the host copies of the flat buffers (the CPU computes on
    /// them; on the GPU they are refreshed on demand).
    model: Model,
    engine: Engine,
}

/// The device side of a [`Compute`].
enum Engine {
    /// The CPU executor inside [`Model`], and the CPU optimizer.
    Cpu {
        optimizer: Option<Box<dyn Optimizer>>,
    },
    /// The GPU executor.
    Cuda(Box<GpuSide>),
}

/// What the GPU side keeps besides the executor.
struct GpuSide {
    exec: CudaExecutor,
    /// The plans of the last training and evaluation batch shapes.
    train_plan: Option<Plan>,
    eval_plan: Option<Plan>,
    /// The logits of the last evaluation forward, on the host.
    logits: Vec<f32>,
    /// Whether the device parameters or running statistics changed since the host copies
    /// were made.
    host_behind: bool,
    /// The optimizer's settings (its state is on the device).
    optimizer: Option<OptimizerConfig>,
    /// The training set in GPU memory, once uploaded.
    train_set: Option<DeviceDataset>,
    /// The test set in GPU memory, once uploaded, with the host data set it copies (so that
    /// only its evaluations use it; the `Weak` keeps its address from being reused).
    eval_set: Option<(DeviceDataset, Weak<Dataset>)>,
    /// Whether the note saying why CUDA graphs are off was printed.
    graphs_off_noted: bool,
    /// How the last [`Compute::train_step`] ran: eagerly, captured or replayed.
    last_step_run: Option<StepRun>,
}

impl Compute {
    /// Runs `model` on `device`: on the CPU as it is; on a GPU, `model`'s parameters and
    /// running statistics are copied to a new executor computing as `math` says (TF32 with
    /// deterministic algorithms when `None`).
    pub fn new(model: Model, device: &Device, math: Option<GpuMath>) -> anyhow::Result<Self> {
        let engine = match device {
            Device::Cpu { .. } => Engine::Cpu { optimizer: None },
            Device::Cuda { ordinal, .. } => {
                let math = math.unwrap_or(GpuMath {
                    precision: Precision::Tf32,
                    algorithms: Algorithms::Deterministic,
                });
                let exec = open_executor(&model, *ordinal, math)?;
                Engine::Cuda(Box::new(GpuSide {
                    exec,
                    train_plan: None,
                    eval_plan: None,
                    logits: Vec::new(),
                    host_behind: false,
                    optimizer: None,
                    train_set: None,
                    eval_set: None,
                    graphs_off_noted: false,
                    last_step_run: None,
                }))
            }
        };
        Ok(Compute { model, engine })
    }

    /// Adds the optimizer of `config` (zero state) for [`Compute::optimizer_step`].
    pub fn with_optimizer(mut self, config: OptimizerConfig) -> Self {
        let len = self.model.params().len();
        match &mut self.engine {
            Engine::Cpu { optimizer } => *optimizer = Some(config.cpu(len)),
            Engine::Cuda(gpu) => gpu.optimizer = Some(config),
        }
        self
    }

    /// The model's specification.
    pub fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }

    /// The number of parameters.
    pub fn param_count(&self) -> usize {
        self.model.params().len()
    }

    /// The model with host buffers as they stand on the device (copied from a GPU when they
    /// are behind), for checkpoints, snapshots and broadcasts.
    pub fn host_model(&mut self) -> anyhow::Result<&Model> {
        self.refresh_host()?;
        Ok(&self.model)
    }

    /// Lets `change` change the host model (weights loaded, a snapshot restored, a broadcast
    /// received), then copies its parameters and running statistics to the device.
    pub fn update_host<R>(
        &mut self,
        change: impl FnOnce(&mut Model) -> anyhow::Result<R>,
    ) -> anyhow::Result<R> {
        self.refresh_host()?;
        let result = change(&mut self.model)?;
        if let Engine::Cuda(gpu) = &mut self.engine {
            gpu.exec
                .params_from_host(self.model.params(), self.model.buffers())
                .context("copying the parameters to the GPU")?;
        }
        Ok(result)
    }

    /// On a GPU, copies `dataset`'s pixels to the device once, so that training batches are
    /// assembled there ([`TrainImages::OnDevice`]) with `augment`, `normalize` and `seed` as
    /// the CPU loader would. Returns the bytes uploaded, or `None` where batches stay on the
    /// host: on the CPU, and for a data set larger than half the GPU's free memory.
    pub fn upload_train_set(
        &mut self,
        dataset: &Dataset,
        augment: Option<Augment>,
        normalize: Option<Normalize>,
        seed: u64,
    ) -> anyhow::Result<Option<usize>> {
        let Some((uploaded, bytes)) = self
            .upload(dataset, augment, normalize, seed)
            .context("copying the training set to the GPU")?
        else {
            return Ok(None);
        };
        if let Engine::Cuda(gpu) = &mut self.engine {
            gpu.train_set = Some(uploaded);
        }
        Ok(Some(bytes))
    }

    /// Copies the pixels of `dataset` (a test split) to the GPU once, so that
    /// [`crate::evaluation::evaluate`] of it assembles and normalizes its batches there as the
    /// CPU loader would ([`Compute::forward_eval_on_device`]). Returns the bytes uploaded, or
    /// `None` where its batches stay on the host (as for [`Compute::upload_train_set`]).
    pub fn upload_eval_set(
        &mut self,
        dataset: &Arc<Dataset>,
        normalize: Option<Normalize>,
    ) -> anyhow::Result<Option<usize>> {
        let Some((uploaded, bytes)) = self
            .upload(dataset, None, normalize, 0)
            .context("copying the test set to the GPU")?
        else {
            return Ok(None);
        };
        if let Engine::Cuda(gpu) = &mut self.engine {
            gpu.eval_set = Some((uploaded, Arc::downgrade(dataset)));
        }
        Ok(Some(bytes))
    }

    /// Whether evaluations of `dataset` run from its copy in GPU memory.
    pub fn evaluates_on_device(&self, dataset: &Arc<Dataset>) -> bool {
        matches!(&self.engine, Engine::Cuda(gpu)
            if gpu.eval_set.as_ref().is_some_and(|(_, source)| source.ptr_eq(&Arc::downgrade(dataset))))
    }

    /// Evaluation forward of the images `indices` of the test set in GPU memory (see
    /// [`Compute::upload_eval_set`]), `height x width` each; returns the logits.
    pub fn forward_eval_on_device(
        &mut self,
        indices: &[usize],
        height: usize,
        width: usize,
    ) -> anyhow::Result<&[f32]> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("the test set is in GPU memory only with the model on a GPU");
        };
        let (eval_set, _) = gpu
            .eval_set
            .as_mut()
            .context("the test set was not copied to the GPU")?;
        let plan = plan_for(
            &mut gpu.eval_plan,
            &self.model,
            Mode::Eval,
            indices.len(),
            height,
            width,
        )?;
        gpu.exec
            .forward_eval_gathered(&self.model, plan, eval_set, indices, &mut gpu.logits)?;
        Ok(&gpu.logits)
    }

    /// `dataset`'s pixels on the GPU with `augment`, `normalize` and `seed` for the device's
    /// batch assembly, and the bytes copied; `None` on the CPU, and (with a note) for a data
    /// set larger than half the GPU's free memory, whose batches then come from the host.
    fn upload(
        &mut self,
        dataset: &Dataset,
        augment: Option<Augment>,
        normalize: Option<Normalize>,
        seed: u64,
    ) -> anyhow::Result<Option<(DeviceDataset, usize)>> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            return Ok(None);
        };
        let pixels = match &dataset.images {
            Pixels::U8(bytes) => HostPixels::U8(bytes),
            Pixels::F32(floats) => HostPixels::F32(floats),
        };
        let free = gpu.exec.device_memory_free()?;
        if !fits_in_device_memory(pixels.bytes(), free) {
            tell!(
                "note: the data set's {:.1} MB of pixels are more than half the GPU's {:.1} MB \
                 of free memory; its batches are assembled on the host",
                pixels.bytes() as f64 / 1e6,
                free as f64 / 1e6
            );
            return Ok(None);
        }
        let augment = augment.unwrap_or_default();
        let normalize = normalize.unwrap_or(Normalize {
            mean: [0.0; 3],
            std: [1.0; 3],
        });
        let shape = DatasetShape {
            len: dataset.len(),
            height: dataset.height,
            width: dataset.width,
            channels: dataset.channels,
        };
        let settings = AugmentSettings {
            crop_padding: augment.random_crop_padding.unwrap_or(0),
            horizontal_flip: augment.horizontal_flip,
            mean: normalize.mean,
            std: normalize.std,
            seed,
        };
        let uploaded = gpu.exec.upload_dataset(pixels, shape, settings)?;
        Ok(Some((uploaded, pixels.bytes())))
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) -> anyhow::Result<()> {
        match &mut self.engine {
            Engine::Cpu { .. } => self.model.zero_grads(),
            Engine::Cuda(gpu) => gpu.exec.zero_grads().context("zeroing the GPU gradients")?,
        }
        Ok(())
    }

    /// Train-mode forward of NHWC `images` (`batch` of `height x width`; host floats, or the
    /// images the GPU assembles from the uploaded training set) with `labels`: returns the
    /// mean loss and updates the running statistics (as [`Model::forward_train`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train(
        &mut self,
        images: TrainImages<'_>,
        batch: usize,
        height: usize,
        width: usize,
        labels: &[u32],
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> anyhow::Result<f32> {
        let gpu = match (&mut self.engine, images) {
            (Engine::Cpu { .. }, TrainImages::Host(images)) => {
                return Ok(self
                    .model
                    .forward_train(images, batch, height, width, labels, loss, bn_sync)?)
            }
            (Engine::Cpu { .. }, TrainImages::OnDevice { .. }) => {
                anyhow::bail!("images on the device need the model on a GPU")
            }
            (Engine::Cuda(gpu), _) => gpu,
        };
        check_labels(labels, batch, self.model.spec().num_classes())?;
        let plan = plan_for(
            &mut gpu.train_plan,
            &self.model,
            Mode::Train,
            batch,
            height,
            width,
        )?;
        let value = match images {
            TrainImages::Host(images) => {
                gpu.exec
                    .forward_train(&self.model, plan, images, labels, loss, bn_sync)?
            }
            TrainImages::OnDevice { indices, epoch } => {
                let train_set = gpu
                    .train_set
                    .as_mut()
                    .context("the training set was not copied to the GPU")?;
                gpu.exec.forward_train_gathered(
                    &self.model,
                    plan,
                    train_set,
                    indices,
                    epoch,
                    labels,
                    loss,
                    bn_sync,
                )?
            }
        };
        // The count lives on the host, as the CPU model keeps it.
        let tracked = self.model.num_batches_tracked();
        self.model.set_num_batches_tracked(tracked + 1);
        gpu.host_behind = true;
        Ok(value)
    }

    /// Whether a training step of `conditions` runs as one [`Compute::train_step`] (a GPU
    /// step of one or more micro-batches, in one process or with its gradients, and with
    /// SyncBatchNorm its batch statistics, summed through NCCL, which the executor captures
    /// as a CUDA graph);
    /// otherwise the step runs through `forward_train`, `backward` and `optimizer_step`, and
    /// on a GPU the first such step prints why it is not captured.
    pub fn whole_steps(&mut self, conditions: &StepConditions) -> bool {
        let Engine::Cuda(gpu) = &mut self.engine else {
            return false;
        };
        match conditions.refusal() {
            None => true,
            Some(reason) => {
                note_graphs_off(&mut gpu.graphs_off_noted, &reason.to_string());
                false
            }
        }
    }

    /// One whole training step on the GPU over `micro_batches` (one, or `--grad-accum` of
    /// one size): gradients zeroed; per micro-batch a train-mode forward and a backward of its
    /// loss scaled by the inverse of their count (with NCCL joined, the last one's gradients
    /// averaged over the ranks bucket by bucket); the optimizer at learning rate `lr` (and
    /// `momentum`). Returns the mean of the micro-batches' losses, read after the update, as
    /// the separate calls would average them. The GPU runs it eagerly or as a CUDA graph with
    /// the same result; the first captured step of each batch shape prints a note, and so
    /// does the first step after graphs were turned off (with the reason).
    pub fn train_step(
        &mut self,
        micro_batches: &[TrainBatch<'_>],
        height: usize,
        width: usize,
        loss: &LossOptions,
        lr: f64,
        momentum: Option<f64>,
    ) -> anyhow::Result<f64> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("a whole training step needs the model on a GPU");
        };
        let gpu = &mut **gpu;
        let (images, labels) = join_micro_batches(micro_batches)?;
        let count = micro_batches.len();
        let batch = labels.len() / count;
        let config = gpu.optimizer.as_mut().context("no optimizer was set up")?;
        config.set_lr(lr as f32);
        if let Some(momentum) = momentum {
            config.set_momentum(momentum as f32);
        }
        let config = *config;
        let plan = plan_for(
            &mut gpu.train_plan,
            &self.model,
            Mode::Train,
            batch,
            height,
            width,
        )?;
        let images = match &images {
            JoinedImages::Host(images) => StepImages::Host(images),
            JoinedImages::OnDevice { indices, epoch } => StepImages::Gathered {
                dataset: gpu
                    .train_set
                    .as_mut()
                    .context("the training set was not copied to the GPU")?,
                indices,
                epoch: *epoch,
            },
        };
        let optimizer = match &config {
            OptimizerConfig::Sgd(config) => StepOptimizer::Sgd(config),
            OptimizerConfig::Adam(config) => StepOptimizer::Adam(config),
        };
        let step = TrainStep {
            images,
            labels: &labels,
            micro_batches: count,
            loss,
            optimizer,
        };
        let outcome = gpu.exec.train_step(&self.model, plan, step)?;
        // Each micro-batch's forward counts in the running statistics, as PyTorch's does.
        let tracked = self.model.num_batches_tracked();
        self.model.set_num_batches_tracked(tracked + count as u64);
        gpu.host_behind = true;
        if let Some(reason) = &outcome.graphs_off {
            note_graphs_off(&mut gpu.graphs_off_noted, reason);
        }
        if let Some(reason) = &outcome.relaxed_capture {
            tell!(
                "note: CUDA graphs are captured in relaxed mode: the thread-local capture was \
                 refused ({reason})"
            );
        }
        gpu.last_step_run = Some(outcome.run);
        if outcome.run == StepRun::Capture {
            let shape = match count {
                1 => format!("{batch} images of {height}x{width}"),
                _ => format!("{count} micro-batches of {batch} images of {height}x{width}"),
            };
            tell!("note: CUDA graphs on: training steps of {shape} replay one captured graph");
        }
        let loss_sum: f64 = outcome.losses.iter().map(|&loss| f64::from(loss)).sum();
        Ok(loss_sum / count as f64)
    }

    /// How the last [`Compute::train_step`] ran (eagerly, captured, replayed); `None` on the
    /// CPU.
    pub fn last_step_run(&self) -> Option<StepRun> {
        match &self.engine {
            Engine::Cuda(gpu) => gpu.last_step_run,
            Engine::Cpu { .. } => None,
        }
    }

    /// Backward of the last [`Compute::forward_train`]: adds the gradients of `loss_scale ·
    /// loss` and calls `grad_ready`, if given, with each final range and its host values (on
    /// a GPU, only then do the gradients cross to the host during the backward).
    pub fn backward(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
    ) -> anyhow::Result<()> {
        match &mut self.engine {
            Engine::Cpu { .. } => {
                let mut ignore = |_: std::ops::Range<usize>, _: &[f32]| {};
                let grad_ready = grad_ready.unwrap_or(&mut ignore);
                self.model.backward(loss_scale, bn_sync, grad_ready)?
            }
            Engine::Cuda(gpu) => {
                let plan = gpu
                    .train_plan
                    .as_ref()
                    .ok_or(tandem_models::ModelError::NoForward)?;
                gpu.exec
                    .backward(&self.model, plan, loss_scale, bn_sync, grad_ready)?;
            }
        }
        Ok(())
    }

    /// Lets `change` read and replace the gradients on the host (the data-parallel average):
    /// on a GPU they cross through the executor's page-locked host gradients, to the host and
    /// back.
    pub fn with_host_grads(
        &mut self,
        change: impl FnOnce(&mut [f32]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        match &mut self.engine {
            Engine::Cpu { .. } => change(self.model.grads_mut()),
            Engine::Cuda(gpu) => gpu
                .exec
                .with_host_grads(change)
                .context("copying the gradients between the GPU and the host")?,
        }
    }

    /// Joins the NCCL communicator of a job whose backend is `nccl` (a GPU each rank): the
    /// gradients are then averaged on the device in `buckets` by
    /// [`Compute::backward_all_reduced`] and [`Compute::finish_all_reduce`], and the
    /// broadcasts run on the device. An error on the CPU.
    pub fn join_nccl(
        &mut self,
        unique_id: &[u8; tandem_cuda::nccl::UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        timeout: std::time::Duration,
        buckets: Vec<std::ops::Range<usize>>,
    ) -> anyhow::Result<()> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("NCCL needs the model on a GPU; this rank computes on the CPU");
        };
        gpu.exec
            .join_nccl(
                Probe::process(),
                unique_id,
                rank,
                world_size,
                timeout,
                buckets,
            )
            .with_context(|| {
                format!("rank {rank} cannot join the NCCL communicator of {world_size} rank(s)")
            })
    }

    /// SyncBatchNorm through the joined NCCL communicator: every training forward and
    /// backward sums its batch-norm statistics over the ranks on the device, with no host
    /// wait, so that such steps are whole steps too (captured as CUDA graphs); pass no host
    /// reducer to [`Compute::forward_train`] and [`Compute::backward`] then. An error before
    /// [`Compute::join_nccl`].
    pub fn sync_batch_norm_through_nccl(&mut self) -> anyhow::Result<()> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("SyncBatchNorm through NCCL needs the model on a GPU");
        };
        gpu.exec
            .sync_batch_norm_through_nccl()
            .context("SyncBatchNorm through NCCL")
    }

    /// Whether the gradients and broadcasts go through NCCL on the device.
    pub fn uses_nccl(&self) -> bool {
        matches!(&self.engine, Engine::Cuda(gpu) if gpu.exec.has_nccl())
    }

    /// The NCCL collective that timed out or failed, if one did (the communicator is then
    /// aborted).
    pub fn nccl_failure(&self) -> Option<String> {
        match &self.engine {
            Engine::Cuda(gpu) => gpu.exec.nccl_health().err().map(|error| error.to_string()),
            Engine::Cpu { .. } => None,
        }
    }

    /// Backward of the last [`Compute::forward_train`] with each gradient bucket averaged
    /// over the ranks through NCCL as soon as it is final (nothing crosses to the host); call
    /// [`Compute::finish_all_reduce`] after it.
    pub fn backward_all_reduced(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> anyhow::Result<()> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("NCCL needs the model on a GPU");
        };
        let plan = gpu
            .train_plan
            .as_ref()
            .ok_or(tandem_models::ModelError::NoForward)?;
        gpu.exec
            .backward_all_reduced(&self.model, plan, loss_scale, bn_sync)?;
        Ok(())
    }

    /// Averages the gradient buckets the backward did not hand to NCCL (all of them after a
    /// plain [`Compute::backward`]) and orders the optimizer after the average.
    pub fn finish_all_reduce(&mut self) -> anyhow::Result<()> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("NCCL needs the model on a GPU");
        };
        Ok(gpu.exec.finish_all_reduce()?)
    }

    /// Gives every rank rank 0's running statistics, and with `params` its parameters,
    /// through NCCL on the device.
    pub fn broadcast_on_device(&mut self, params: bool) -> anyhow::Result<()> {
        let Engine::Cuda(gpu) = &mut self.engine else {
            anyhow::bail!("NCCL needs the model on a GPU");
        };
        match params {
            true => gpu.exec.broadcast_params_and_buffers()?,
            false => gpu.exec.broadcast_buffers()?,
        }
        gpu.host_behind = true;
        Ok(())
    }

    /// One optimizer step at learning rate `lr` (and `momentum`, for schedules that cycle it).
    pub fn optimizer_step(&mut self, lr: f64, momentum: Option<f64>) -> anyhow::Result<()> {
        match &mut self.engine {
            Engine::Cpu { optimizer } => {
                let optimizer = optimizer.as_mut().context("no optimizer was set up")?;
                optimizer.set_lr(lr as f32);
                if let Some(momentum) = momentum {
                    optimizer.set_momentum(momentum as f32);
                }
                let (params, grads) = self.model.params_and_grads_mut();
                optimizer.step(params, grads);
            }
            Engine::Cuda(gpu) => {
                let config = gpu.optimizer.as_mut().context("no optimizer was set up")?;
                config.set_lr(lr as f32);
                if let Some(momentum) = momentum {
                    config.set_momentum(momentum as f32);
                }
                match config {
                    OptimizerConfig::Sgd(config) => gpu.exec.sgd_step(config),
                    OptimizerConfig::Adam(config) => gpu.exec.adam_step(config),
                }
                .context("the optimizer step on the GPU")?;
                gpu.host_behind = true;
            }
        }
        Ok(())
    }

    /// The optimizer's state in the CPU optimizers' layout (copied from a GPU), for a
    /// snapshot that either device can resume.
    pub fn optimizer_state(&mut self) -> anyhow::Result<OptimizerState> {
        let len = self.model.params().len();
        match &mut self.engine {
            Engine::Cpu { optimizer } => Ok(optimizer
                .as_ref()
                .context("no optimizer was set up")?
                .state()),
            Engine::Cuda(gpu) => {
                let config = gpu.optimizer.context("no optimizer was set up")?;
                let state = gpu
                    .exec
                    .optimizer_state_to_host()
                    .context("copying the optimizer state from the GPU")?;
                Ok(match (state, config) {
                    // Before the first step: the CPU optimizer's zero state.
                    (None, config) => config.cpu(len).state(),
                    // SGD without momentum keeps no buffer, as on the CPU.
                    (Some(state), OptimizerConfig::Sgd(sgd)) if sgd.momentum == 0.0 => {
                        OptimizerState {
                            step: state.step,
                            slots: Vec::new(),
                        }
                    }
                    (Some(state), _) => state,
                })
            }
        }
    }

    /// Restores an optimizer state saved by [`Compute::optimizer_state`] on either device;
    /// a state that does not fit the optimizer (names, lengths) changes nothing.
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> anyhow::Result<()> {
        let len = self.model.params().len();
        match &mut self.engine {
            Engine::Cpu { optimizer } => optimizer
                .as_mut()
                .context("no optimizer was set up")?
                .load_state(state)?,
            Engine::Cuda(gpu) => {
                let config = gpu.optimizer.context("no optimizer was set up")?;
                // The CPU optimizer checks the slots' names and lengths with its own rules.
                config.cpu(len).load_state(state)?;
                let slot = |name: &str| {
                    state
                        .slots
                        .iter()
                        .find(|(slot, _)| slot == name)
                        .map(|(_, values)| values.as_slice())
                };
                match config {
                    OptimizerConfig::Sgd(_) => {
                        gpu.exec.load_sgd_state(state.step, slot("momentum_buffer"))
                    }
                    OptimizerConfig::Adam(_) => {
                        let (Some(exp_avg), Some(exp_avg_sq)) =
                            (slot("exp_avg"), slot("exp_avg_sq"))
                        else {
                            anyhow::bail!("the optimizer state lacks Adam's exp_avg or exp_avg_sq");
                        };
                        gpu.exec.load_adam_state(state.step, exp_avg, exp_avg_sq)
                    }
                }
                .context("copying the optimizer state to the GPU")?;
            }
        }
        Ok(())
    }

    /// Eval-mode forward of NHWC `images`; returns the logits `[batch, classes]` on the host.
    pub fn forward_eval(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> anyhow::Result<&[f32]> {
        match &mut self.engine {
            Engine::Cpu { .. } => Ok(self.model.forward_eval(images, batch, height, width)?),
            Engine::Cuda(gpu) => {
                let plan = plan_for(
                    &mut gpu.eval_plan,
                    &self.model,
                    Mode::Eval,
                    batch,
                    height,
                    width,
                )?;
                gpu.exec
                    .forward_eval(&self.model, plan, images, &mut gpu.logits)?;
                Ok(&gpu.logits)
            }
        }
    }

    /// Copies the device parameters and running statistics to the host model when they are
    /// behind.
    fn refresh_host(&mut self) -> anyhow::Result<()> {
        if let Engine::Cuda(gpu) = &mut self.engine {
            if gpu.host_behind {
                gpu.exec
                    .params_to_host(self.model.params_mut())
                    .context("copying the parameters from the GPU")?;
                gpu.exec
                    .buffers_to_host(self.model.buffers_mut())
                    .context("copying the running statistics from the GPU")?;
                gpu.host_behind = false;
            }
        }
        Ok(())
    }
}

/// The GPU executor on GPU `ordinal`, holding `model`'s parameters and buffers, computing
/// as `math` says.
pub fn open_executor(model: &Model, ordinal: usize, math: GpuMath) -> anyhow::Result<CudaExecutor> {
    let settings = GpuSettings {
        ordinal,
        precision: math.precision,
        deterministic: math.algorithms == Algorithms::Deterministic,
    };
    let cache = PtxCache::default_dir().map(PtxCache::new);
    CudaExecutor::new(Probe::process(), settings, cache, model)
        .with_context(|| format!("opening cuda:{ordinal}"))
}

/// Whether a data set of `bytes` goes to a GPU with `free` bytes of free memory: at most
/// half of it, so that the model's activations, workspaces and graphs still fit.
fn fits_in_device_memory(bytes: usize, free: usize) -> bool {
    bytes <= free / 2
}

/// The kept plan when it fits the batch, else a new one for it.
fn plan_for<'a>(
    kept: &'a mut Option<Plan>,
    model: &Model,
    mode: Mode,
    batch: usize,
    height: usize,
    width: usize,
) -> anyhow::Result<&'a Plan> {
    if !kept
        .as_ref()
        .is_some_and(|plan| plan.fits(batch, height, width))
    {
        *kept = Some(model.plan(mode, batch, height, width)?);
    }
    kept.as_ref().context("no plan")
}

/// Prints `note: CUDA graphs off: {reason}` unless a note was printed (`noted`).
fn note_graphs_off(noted: &mut bool, reason: &str) {
    if !*noted {
        tell!("note: CUDA graphs off: {reason}");
        *noted = true;
    }
}

/// The CPU model's label checks, for the GPU: one label per image, each below `classes`.
fn check_labels(labels: &[u32], batch: usize, classes: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        labels.len() == batch,
        "{} labels for a batch of {batch} images",
        labels.len()
    );
    if let Some(sample) = labels.iter().position(|&label| label as usize >= classes) {
        return Err(tandem_engine::EngineError::InvalidLabel {
            sample,
            label: labels[sample],
            classes,
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::{AdamConfig, Sgd, SgdConfig};
    use tandem_models::ResNetBaseSpec;

    fn cpu() -> Device {
        Device::Cpu {
            reason: "requested".to_string(),
        }
    }

    fn small_model() -> Model {
        let spec = ResNetBaseSpec {
            n_blocks: vec![1, 1],
            n_channels: vec![4, 8],
            bottlenecks: None,
            ..ResNetBaseSpec::tutorial_default()
        };
        Model::new(&ModelSpec::ResNetBase(spec)).unwrap()
    }

    /// Images in about [-1, 1) and labels, from a fixed formula.
    fn batch(batch: usize) -> (Vec<f32>, Vec<u32>) {
        let images = (0..batch * 8 * 8 * 3)
            .map(|i| ((i as u64 * 2_654_435_761) % 2003) as f32 / 1001.5 - 1.0)
            .collect();
        let labels = (0..batch as u32).map(|i| (i * 7 + 3) % 10).collect();
        (images, labels)
    }

    /// Two SGD steps through [`Compute`] on the CPU give the bits of the model and optimizer
    /// driven directly, as the trainer did before, and the optimizer state round-trips.
    #[test]
    fn the_cpu_variant_computes_exactly_what_the_model_does() {
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 5e-4,
        };
        let (images, labels) = batch(4);
        let loss = LossOptions {
            label_smoothing: 0.1,
        };
        let mut direct = small_model();
        let mut optimizer = Sgd::new(direct.params().len(), config);
        let mut compute = Compute::new(small_model(), &cpu(), None)
            .unwrap()
            .with_optimizer(OptimizerConfig::Sgd(config));
        for step in 0..2 {
            let lr = 0.1 / f64::from(step + 1);
            direct.zero_grads();
            let expected = direct
                .forward_train(&images, 4, 8, 8, &labels, &loss, None)
                .unwrap();
            direct.backward(1.0, None, &mut |_, _| {}).unwrap();
            optimizer.set_lr(lr as f32);
            optimizer.set_momentum(0.8);
            let (params, grads) = direct.params_and_grads_mut();
            optimizer.step(params, grads);

            compute.zero_grads().unwrap();
            let got = compute
                .forward_train(TrainImages::Host(&images), 4, 8, 8, &labels, &loss, None)
                .unwrap();
            let mut reported = 0;
            compute
                .backward(1.0, None, Some(&mut |range, _| reported += range.len()))
                .unwrap();
            assert_eq!(reported, compute.param_count());
            compute.optimizer_step(lr, Some(0.8)).unwrap();
            assert_eq!(got.to_bits(), expected.to_bits(), "loss of step {step}");
        }
        let model = compute.host_model().unwrap();
        assert_eq!(model.params(), direct.params());
        assert_eq!(model.buffers(), direct.buffers());
        assert_eq!(model.num_batches_tracked(), 2);
        let state = compute.optimizer_state().unwrap();
        assert_eq!(state, optimizer.state());
        let eval = compute.forward_eval(&images, 4, 8, 8).unwrap().to_vec();
        assert_eq!(eval, direct.forward_eval(&images, 4, 8, 8).unwrap());

        let mut fresh = Compute::new(small_model(), &cpu(), None)
            .unwrap()
            .with_optimizer(OptimizerConfig::Sgd(config));
        fresh.load_optimizer_state(&state).unwrap();
        assert_eq!(fresh.optimizer_state().unwrap(), state);
        let wrong = OptimizerState {
            step: 1,
            slots: vec![("exp_avg".to_string(), vec![0.0; 3])],
        };
        let error = fresh.load_optimizer_state(&wrong).unwrap_err();
        assert!(error.to_string().contains("exp_avg"), "{error:#}");
        assert_eq!(
            fresh.optimizer_state().unwrap(),
            state,
            "a bad state changes nothing"
        );
    }

    /// The CPU never runs whole steps (its steps stay the separate calls, bit for bit as
    /// before), whatever the conditions (a step the GPU would capture with its NCCL
    /// all-reduces included), and says nothing about CUDA graphs.
    #[test]
    fn the_cpu_keeps_its_data_on_the_host() {
        let mut compute = Compute::new(small_model(), &cpu(), None).unwrap();
        let test_set = Arc::new(Dataset {
            images: Pixels::U8(vec![7; 2 * 8 * 8 * 3]),
            labels: vec![0, 1],
            height: 8,
            width: 8,
            channels: 3,
            num_classes: 10,
            class_names: Vec::new(),
        });
        assert_eq!(compute.upload_eval_set(&test_set, None).unwrap(), None);
        assert_eq!(
            compute.upload_train_set(&test_set, None, None, 0).unwrap(),
            None
        );
        assert!(!compute.evaluates_on_device(&test_set));
        let error = compute.forward_eval_on_device(&[0, 1], 8, 8).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the test set is in GPU memory only with the model on a GPU"
        );
    }

    #[test]
    fn the_micro_batches_of_a_whole_step_join_when_they_are_of_one_size_and_kind() {
        let (first_images, first_labels) = (vec![1.0, 2.0], vec![3, 4]);
        let (second_images, second_labels) = (vec![5.0, 6.0], vec![7, 8]);
        let host = |images, labels| TrainBatch {
            images: TrainImages::Host(images),
            labels,
        };
        let (images, labels) = join_micro_batches(&[host(&first_images, &first_labels)]).unwrap();
        assert!(matches!(images, JoinedImages::Host(Cow::Borrowed(_))));
        assert!(matches!(labels, Cow::Borrowed(&[3, 4])));
        let (images, labels) = join_micro_batches(&[
            host(&first_images, &first_labels),
            host(&second_images, &second_labels),
        ])
        .unwrap();
        match images {
            JoinedImages::Host(images) => assert_eq!(&images[..], &[1.0, 2.0, 5.0, 6.0]),
            JoinedImages::OnDevice { .. } => panic!("host images became indices"),
        }
        assert_eq!(&labels[..], &[3, 4, 7, 8]);

        let indices = [[10, 11], [12, 13]];
        let on_device = |indices, epoch| TrainBatch {
            images: TrainImages::OnDevice { indices, epoch },
            labels: &first_labels,
        };
        let (images, _) =
            join_micro_batches(&[on_device(&indices[0], 2), on_device(&indices[1], 2)]).unwrap();
        match images {
            JoinedImages::OnDevice { indices, epoch } => {
                assert_eq!((&indices[..], epoch), (&[10, 11, 12, 13][..], 2));
            }
            JoinedImages::Host(_) => panic!("indices became host images"),
        }

        let error = |micro_batches: &[TrainBatch<'_>]| match join_micro_batches(micro_batches) {
            Ok(_) => panic!("joined"),
            Err(error) => error.to_string(),
        };
        assert_eq!(error(&[]), "a training step needs at least one micro-batch");
        assert_eq!(
            error(&[
                host(&first_images, &first_labels),
                host(&first_images[..1], &[9])
            ]),
            "the micro-batches of one whole step must have one size: 2 and 1 images"
        );
        assert_eq!(
            error(&[
                host(&first_images, &first_labels),
                on_device(&indices[0], 2)
            ]),
            "the micro-batches of one whole step mix host and GPU images"
        );
        assert_eq!(
            error(&[on_device(&indices[0], 2), on_device(&indices[1], 3)]),
            "the micro-batches of one whole step must be GPU images of one epoch"
        );
    }

    #[test]
    fn whole_steps_are_a_gpu_matter() {
        let mut compute = Compute::new(small_model(), &cpu(), None)
            .unwrap()
            .with_optimizer(OptimizerConfig::Adam(AdamConfig::with_lr(0.01)));
        let single = StepConditions {
            data_parallel: false,
            sync_bn: false,
            nccl: false,
        };
        assert!(!compute.whole_steps(&single));
        let through_nccl = StepConditions {
            data_parallel: true,
            nccl: true,
            ..single
        };
        assert_eq!(through_nccl.refusal(), None);
        assert!(!compute.whole_steps(&through_nccl));
        assert_eq!(
            compute
                .sync_batch_norm_through_nccl()
                .unwrap_err()
                .to_string(),
            "SyncBatchNorm through NCCL needs the model on a GPU"
        );
        let (images, labels) = batch(4);
        let micro_batch = TrainBatch {
            images: TrainImages::Host(&images),
            labels: &labels,
        };
        let error = compute
            .train_step(&[micro_batch], 8, 8, &LossOptions::default(), 0.1, None)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "a whole training step needs the model on a GPU"
        );
        assert_eq!(compute.host_model().unwrap().num_batches_tracked(), 0);
    }

    #[test]
    fn host_changes_and_host_gradients_reach_the_cpu_model() {
        let mut compute = Compute::new(small_model(), &cpu(), None).unwrap();
        compute
            .update_host(|model| {
                model.params_mut()[0] = 7.0;
                Ok(())
            })
            .unwrap();
        assert_eq!(compute.host_model().unwrap().params()[0], 7.0);
        compute
            .with_host_grads(|grads| {
                grads.fill(0.25);
                Ok(())
            })
            .unwrap();
        assert!(compute.model.grads().iter().all(|&grad| grad == 0.25));
        let error = compute.optimizer_step(0.1, None).unwrap_err();
        assert_eq!(error.to_string(), "no optimizer was set up");
    }
}
