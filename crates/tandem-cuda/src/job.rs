//! The GPU's training device: [`GpuJob`] runs a model's training job on the GPU executor,
//! over device copies of the model's flat buffers.
//!
//! # Host/device crossings
//! Each step: the batch goes to the device (or, once the training set is in GPU memory, only
//! its sample indices, and the device assembles it); the loss (and, in evaluation, the
//! logits) comes back. In a job of several processes on the host ring, the backward copies
//! each finished gradient range to the host for the gradient-ready hook; with one process no
//! gradient leaves the device; with NCCL joined the gradients are averaged on the device and
//! none crosses either. The optimizer runs on the device over the flat buffers. A whole step
//! sends its inputs and per-step scalars first and reads the losses after the update (one
//! wait per step), and the executor replays it as a CUDA graph after its first two runs.
//! Parameters, running statistics and optimizer state come to the host only when asked for,
//! and go back after the host changed them. The snapshot format is the same flat buffers on
//! both devices, so a run may resume on the other device.

use std::borrow::Cow;

use tandem_engine::{BatchNormReducer, OptimizerConfig, OptimizerState};
use tandem_models::training_device::{
    CommunicatorAbort, DatasetUpload, DeviceResult, GradientHook, NcclJoin, StepConditions,
    StepReport, StepRequest, TrainBatch, TrainImages, TrainingDevice, TrainingDeviceError,
    UploadPixels, Uploaded, WholeSteps,
};
use tandem_models::workspace::{Mode, Plan};
use tandem_models::{LossOptions, Model, ModelError, ModelSpec};

use crate::executor::{
    AugmentSettings, DatasetShape, DeviceDataset, HostPixels, StepImages, StepOptimizer, TrainStep,
};
use crate::nccl::UNIQUE_ID_BYTES;
use crate::{CudaExecutor, GpuSettings, Probe, PtxCache};

/// A model and the GPU executor its training job runs on.
pub struct GpuJob {
    /// The network description and the host copies of the flat buffers, refreshed on
    /// demand.
    model: Model,
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
    /// The test set in GPU memory, once uploaded.
    eval_set: Option<DeviceDataset>,
}

impl GpuJob {
    /// Copies `model`'s parameters and running statistics to a new executor with `settings`
    /// (its GPU, precision and algorithms), with the process's libraries and PTX cache.
    pub fn open(model: Model, settings: GpuSettings) -> DeviceResult<Self> {
        let exec = open_executor(&model, settings)?;
        Ok(GpuJob {
            model,
            exec,
            train_plan: None,
            eval_plan: None,
            logits: Vec::new(),
            host_behind: false,
            optimizer: None,
            train_set: None,
            eval_set: None,
        })
    }

    /// The optimizer's settings at learning rate `lr` (and `momentum`).
    fn optimizer_at(&mut self, lr: f64, momentum: Option<f64>) -> DeviceResult<OptimizerConfig> {
        let config = self.optimizer.as_mut().ok_or_else(no_optimizer)?;
        config.set_lr(lr as f32);
        if let Some(momentum) = momentum {
            config.set_momentum(momentum as f32);
        }
        Ok(*config)
    }

    /// Copies the device parameters and running statistics to the host model when they are
    /// behind.
    fn refresh_host(&mut self) -> DeviceResult<()> {
        if self.host_behind {
            self.exec
                .params_to_host(self.model.params_mut())
                .map_err(|error| during("copying the parameters from the GPU", error))?;
            self.exec
                .buffers_to_host(self.model.buffers_mut())
                .map_err(|error| during("copying the running statistics from the GPU", error))?;
            self.host_behind = false;
        }
        Ok(())
    }

    /// `upload`'s pixels on the GPU for the device's batch assembly, and the bytes copied;
    /// `None` (with the bytes and the free memory) for a data set larger than half the GPU's
    /// free memory, whose batches then come from the host.
    fn upload(
        &mut self,
        upload: DatasetUpload<'_>,
    ) -> DeviceResult<Result<DeviceDataset, Uploaded>> {
        let pixels = match upload.pixels {
            UploadPixels::U8(bytes) => HostPixels::U8(bytes),
            UploadPixels::F32(floats) => HostPixels::F32(floats),
        };
        let free = self.exec.device_memory_free().map_err(device)?;
        if !fits_in_device_memory(pixels.bytes(), free) {
            return Ok(Err(Uploaded::TooLarge {
                bytes: pixels.bytes(),
                free,
            }));
        }
        let shape = DatasetShape {
            len: upload.len,
            height: upload.height,
            width: upload.width,
            channels: upload.channels,
        };
        let settings = AugmentSettings {
            crop_padding: upload.crop_padding,
            horizontal_flip: upload.horizontal_flip,
            mean: upload.mean,
            std: upload.std,
            seed: upload.seed,
        };
        let uploaded = self
            .exec
            .upload_dataset(pixels, shape, settings)
            .map_err(device)?;
        Ok(Ok(uploaded))
    }

    /// Counts `forwards` train-mode forwards in the host's `num_batches_tracked`, as the CPU
    /// model keeps it, and marks the host copies behind.
    fn count_forwards(&mut self, forwards: usize) {
        let tracked = self.model.num_batches_tracked();
        self.model
            .set_num_batches_tracked(tracked + forwards as u64);
        self.host_behind = true;
    }
}

impl TrainingDevice for GpuJob {
    fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }

    fn param_count(&self) -> usize {
        self.model.params().len()
    }

    fn set_optimizer(&mut self, config: OptimizerConfig) {
        self.optimizer = Some(config);
    }

    /// Runs eagerly or as a CUDA graph with the same result; with NCCL joined, the last
    /// micro-batch's gradients are averaged over the ranks bucket by bucket inside it. The
    /// losses are read after the update.
    fn train_step(&mut self, request: StepRequest<'_>) -> DeviceResult<StepReport> {
        let (images, labels) = join_micro_batches(request.micro_batches)?;
        let count = request.micro_batches.len();
        let batch = labels.len() / count;
        let config = self.optimizer_at(request.lr, request.momentum)?;
        let plan = plan_for(
            &mut self.train_plan,
            &self.model,
            Mode::Train,
            batch,
            request.height,
            request.width,
        )?;
        let images = match &images {
            JoinedImages::Host(images) => StepImages::Host(images),
            JoinedImages::OnDevice { indices, epoch } => StepImages::Gathered {
                dataset: self.train_set.as_mut().ok_or_else(no_train_set)?,
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
            loss: request.loss,
            optimizer,
        };
        let outcome = self.exec.train_step(&self.model, plan, step)?;
        // Each micro-batch's forward counts in the running statistics, as PyTorch's does.
        self.count_forwards(count);
        Ok(StepReport {
            losses: outcome.losses,
            run: Some(outcome.run),
            graphs_off: outcome.graphs_off,
            relaxed_capture: outcome.relaxed_capture,
        })
    }

    /// Whole steps in one process, or with the gradients (and, with SyncBatchNorm, the batch
    /// statistics) summed through NCCL; otherwise the reason no graph is captured.
    fn whole_steps(&self, conditions: &StepConditions) -> WholeSteps {
        match conditions.refusal() {
            None => WholeSteps::Yes,
            Some(reason) => WholeSteps::NoBecause(reason.to_string()),
        }
    }

    fn zero_grads(&mut self) -> DeviceResult<()> {
        self.exec
            .zero_grads()
            .map_err(|error| during("zeroing the GPU gradients", error))
    }

    fn forward_train(
        &mut self,
        micro_batch: TrainBatch<'_>,
        height: usize,
        width: usize,
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> DeviceResult<f32> {
        let (batch, labels) = (micro_batch.len(), micro_batch.labels);
        check_labels(labels, batch, self.model.spec().num_classes())?;
        let plan = plan_for(
            &mut self.train_plan,
            &self.model,
            Mode::Train,
            batch,
            height,
            width,
        )?;
        let value = match micro_batch.images {
            TrainImages::Host(images) => {
                self.exec
                    .forward_train(&self.model, plan, images, labels, loss, bn_sync)?
            }
            TrainImages::OnDevice { indices, epoch } => {
                let train_set = self.train_set.as_mut().ok_or_else(no_train_set)?;
                self.exec.forward_train_gathered(
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
        self.count_forwards(1);
        Ok(value)
    }

    /// On a GPU the gradients cross to the host during the backward only for `grad_ready`.
    fn backward(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
    ) -> DeviceResult<()> {
        let plan = self.train_plan.as_ref().ok_or(ModelError::NoForward)?;
        self.exec
            .backward(&self.model, plan, loss_scale, bn_sync, grad_ready)?;
        Ok(())
    }

    /// The gradients cross through the executor's page-locked host gradients, to the host
    /// and back.
    fn with_host_grads(&mut self, change: &mut dyn FnMut(&mut [f32])) -> DeviceResult<()> {
        self.exec
            .with_host_grads(change)
            .map_err(|error| during("copying the gradients between the GPU and the host", error))
    }

    fn optimizer_step(&mut self, lr: f64, momentum: Option<f64>) -> DeviceResult<()> {
        match self.optimizer_at(lr, momentum)? {
            OptimizerConfig::Sgd(config) => self.exec.sgd_step(&config),
            OptimizerConfig::Adam(config) => self.exec.adam_step(&config),
        }
        .map_err(|error| during("the optimizer step on the GPU", error))?;
        self.host_behind = true;
        Ok(())
    }

    fn forward_eval(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> DeviceResult<&[f32]> {
        let plan = plan_for(
            &mut self.eval_plan,
            &self.model,
            Mode::Eval,
            batch,
            height,
            width,
        )?;
        self.exec
            .forward_eval(&self.model, plan, images, &mut self.logits)?;
        Ok(&self.logits)
    }

    fn forward_eval_on_device(
        &mut self,
        indices: &[usize],
        height: usize,
        width: usize,
    ) -> DeviceResult<&[f32]> {
        let eval_set = self.eval_set.as_mut().ok_or_else(|| {
            TrainingDeviceError::unsupported("the test set was not copied to the GPU")
        })?;
        let plan = plan_for(
            &mut self.eval_plan,
            &self.model,
            Mode::Eval,
            indices.len(),
            height,
            width,
        )?;
        self.exec
            .forward_eval_gathered(&self.model, plan, eval_set, indices, &mut self.logits)?;
        Ok(&self.logits)
    }

    fn host_model(&mut self) -> DeviceResult<&Model> {
        self.refresh_host()?;
        Ok(&self.model)
    }

    fn update_host(&mut self, change: &mut dyn FnMut(&mut Model) -> bool) -> DeviceResult<()> {
        self.refresh_host()?;
        if change(&mut self.model) {
            self.exec
                .params_from_host(self.model.params(), self.model.buffers())
                .map_err(|error| during("copying the parameters to the GPU", error))?;
        }
        Ok(())
    }

    fn optimizer_state(&mut self) -> DeviceResult<OptimizerState> {
        let len = self.model.params().len();
        let config = self.optimizer.ok_or_else(no_optimizer)?;
        let state = self
            .exec
            .optimizer_state_to_host()
            .map_err(|error| during("copying the optimizer state from the GPU", error))?;
        Ok(match (state, config) {
            // Before the first step: the CPU optimizer's zero state.
            (None, config) => config.cpu(len).state(),
            // SGD without momentum keeps no buffer, as on the CPU.
            (Some(state), OptimizerConfig::Sgd(sgd)) if sgd.momentum == 0.0 => OptimizerState {
                step: state.step,
                slots: Vec::new(),
            },
            (Some(state), _) => state,
        })
    }

    fn load_optimizer_state(&mut self, state: &OptimizerState) -> DeviceResult<()> {
        let len = self.model.params().len();
        let config = self.optimizer.ok_or_else(no_optimizer)?;
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
            OptimizerConfig::Sgd(_) => self
                .exec
                .load_sgd_state(state.step, slot("momentum_buffer")),
            OptimizerConfig::Adam(_) => {
                let (Some(exp_avg), Some(exp_avg_sq)) = (slot("exp_avg"), slot("exp_avg_sq"))
                else {
                    return Err(TrainingDeviceError::unsupported(
                        "the optimizer state lacks Adam's exp_avg or exp_avg_sq",
                    ));
                };
                self.exec.load_adam_state(state.step, exp_avg, exp_avg_sq)
            }
        }
        .map_err(|error| during("copying the optimizer state to the GPU", error))
    }

    fn upload_train_set(&mut self, upload: DatasetUpload<'_>) -> DeviceResult<Uploaded> {
        let bytes = upload.pixels.bytes();
        match self
            .upload(upload)
            .map_err(|error| during("copying the training set to the GPU", error))?
        {
            Ok(uploaded) => {
                self.train_set = Some(uploaded);
                Ok(Uploaded::OnDevice(bytes))
            }
            Err(not) => Ok(not),
        }
    }

    fn takes_data_sets(&self) -> bool {
        true
    }

    fn upload_eval_set(&mut self, upload: DatasetUpload<'_>) -> DeviceResult<Uploaded> {
        let bytes = upload.pixels.bytes();
        match self
            .upload(upload)
            .map_err(|error| during("copying the test set to the GPU", error))?
        {
            Ok(uploaded) => {
                self.eval_set = Some(uploaded);
                Ok(Uploaded::OnDevice(bytes))
            }
            Err(not) => Ok(not),
        }
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.exec.synchronize().map_err(device)
    }

    fn memory_in_use(&self) -> DeviceResult<Option<usize>> {
        self.exec.device_memory_in_use().map(Some).map_err(device)
    }

    fn join_nccl(&mut self, join: NcclJoin<'_>) -> DeviceResult<()> {
        let (rank, world_size) = (join.rank, join.world_size);
        let cannot_join =
            || format!("rank {rank} cannot join the NCCL communicator of {world_size} rank(s)");
        let unique_id: &[u8; UNIQUE_ID_BYTES] = join.unique_id.try_into().map_err(|_| {
            TrainingDeviceError::unsupported(format!(
                "{}: an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {}",
                cannot_join(),
                join.unique_id.len()
            ))
        })?;
        self.exec
            .join_nccl(
                Probe::process(),
                unique_id,
                rank,
                world_size,
                join.timeout,
                join.buckets,
            )
            .map_err(|error| during(cannot_join(), error))
    }

    fn leave_nccl(&mut self) -> DeviceResult<()> {
        self.exec.leave_nccl();
        Ok(())
    }

    fn nccl_abort(&self) -> Option<CommunicatorAbort> {
        let handle = self.exec.nccl_abort_handle()?;
        Some(Box::new(move |why: &str| handle.abort(why)))
    }

    fn sync_batch_norm_through_nccl(&mut self) -> DeviceResult<()> {
        self.exec
            .sync_batch_norm_through_nccl()
            .map_err(|error| during("SyncBatchNorm through NCCL", error))
    }

    fn uses_nccl(&self) -> bool {
        self.exec.has_nccl()
    }

    fn nccl_failure(&self) -> Option<String> {
        self.exec.nccl_health().err().map(|error| error.to_string())
    }

    fn backward_all_reduced(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> DeviceResult<()> {
        let plan = self.train_plan.as_ref().ok_or(ModelError::NoForward)?;
        self.exec
            .backward_all_reduced(&self.model, plan, loss_scale, bn_sync)?;
        Ok(())
    }

    fn finish_all_reduce(&mut self) -> DeviceResult<()> {
        self.exec.finish_all_reduce().map_err(device)
    }

    fn keep_shard_grads(&mut self, slot: usize) -> DeviceResult<()> {
        self.exec
            .keep_shard_gradients(slot)
            .map_err(|error| during("keeping a shard's gradients on the GPU", error))
    }

    fn exact_sum_shards(&mut self, own: usize, total_terms: usize) -> DeviceResult<()> {
        self.exec
            .exact_sum_shards(own, total_terms)
            .map_err(|error| during("the exact sum of the shards' gradients on the GPU", error))
    }

    fn broadcast_on_device(&mut self, params: bool) -> DeviceResult<()> {
        match params {
            true => self.exec.broadcast_params_and_buffers(),
            false => self.exec.broadcast_buffers(),
        }
        .map_err(device)?;
        self.host_behind = true;
        Ok(())
    }
}

/// The GPU executor with `settings`, holding `model`'s parameters and buffers.
fn open_executor(model: &Model, settings: GpuSettings) -> DeviceResult<CudaExecutor> {
    let ordinal = settings.ordinal;
    let cache = PtxCache::default_dir().map(PtxCache::new);
    CudaExecutor::new(Probe::process(), settings, cache, model)
        .map_err(|error| during(format!("opening cuda:{ordinal}"), error))
}

/// A failure of the GPU's libraries.
fn device(error: crate::GpuError) -> TrainingDeviceError {
    TrainingDeviceError::Device(Box::new(error))
}

/// A failure of the GPU's libraries while doing `what`.
fn during(
    what: impl Into<String>,
    error: impl Into<tandem_models::training_device::BoxError>,
) -> TrainingDeviceError {
    TrainingDeviceError::during(what, error)
}

/// The error of a step before an optimizer was set up.
fn no_optimizer() -> TrainingDeviceError {
    TrainingDeviceError::unsupported("no optimizer was set up")
}

/// The error of a step from a training set that is not on the GPU.
fn no_train_set() -> TrainingDeviceError {
    TrainingDeviceError::unsupported("the training set was not copied to the GPU")
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
) -> DeviceResult<&'a Plan> {
    if !kept
        .as_ref()
        .is_some_and(|plan| plan.fits(batch, height, width))
    {
        *kept = Some(model.plan(mode, batch, height, width)?);
    }
    kept.as_ref()
        .ok_or_else(|| TrainingDeviceError::unsupported("no plan"))
}

/// The CPU model's label checks, for the GPU: one label per image, each below `classes`.
fn check_labels(labels: &[u32], batch: usize, classes: usize) -> DeviceResult<()> {
    if labels.len() != batch {
        return Err(TrainingDeviceError::unsupported(format!(
            "{} labels for a batch of {batch} images",
            labels.len()
        )));
    }
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

/// The images of a whole step's micro-batches, one after another.
#[derive(Debug)]
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
) -> DeviceResult<(JoinedImages<'a>, Cow<'a, [u32]>)> {
    let refuse = |why: &str| Err(TrainingDeviceError::unsupported(why));
    let Some((first, rest)) = micro_batches.split_first() else {
        return refuse("a training step needs at least one micro-batch");
    };
    let batch = first.labels.len();
    if let Some(other) = rest.iter().find(|other| other.labels.len() != batch) {
        return refuse(&format!(
            "the micro-batches of one whole step must have one size: {batch} and {} images",
            other.labels.len()
        ));
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
                    return refuse("the micro-batches of one whole step mix host and GPU images");
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
                    _ => {
                        return refuse(
                            "the micro-batches of one whole step must be GPU images of one epoch",
                        )
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_data_set_takes_at_most_half_the_free_memory() {
        assert!(fits_in_device_memory(50, 100));
        assert!(!fits_in_device_memory(51, 100));
    }
}
