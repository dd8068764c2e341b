//! A device's whole training job: [`TrainingDevice`] is what `train`, `eval`, `predict` and
//! `bench step` are written against, whichever device computes.
//!
//! Its centre is [`TrainingDevice::train_step`]: the micro-batches of one optimizer step
//! go in, their losses and how the step ran come out. Beside it stand the evaluation
//! forwards, the model and optimizer state to and from the host, and the uploads of a data
//! set. A step that a device cannot run whole (the gradients or batch statistics cross the
//! host inside it) runs through the separate calls: [`TrainingDevice::zero_grads`],
//! [`TrainingDevice::forward_train`], [`TrainingDevice::backward`] and
//! [`TrainingDevice::optimizer_step`]; both ways give the same numbers.
//!
//! The CPU's device is [`crate::CpuDevice`]; the GPU's lives in `tandem-cuda`.

use std::fmt;
use std::ops::Range;

use tandem_engine::{BatchNormReducer, EngineError, OptimizerConfig, OptimizerState};

use crate::{LossOptions, Model, ModelError, ModelSpec};

/// Any error a device's own library reports.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Called with each final range of gradients and their host values during a backward.
pub type GradientHook<'a> = &'a mut dyn FnMut(Range<usize>, &[f32]);

/// What can go wrong on a training device.
#[derive(Debug, thiserror::Error)]
pub enum TrainingDeviceError {
    /// The model refused the call (shapes, labels, a backward without a forward).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The engine refused the call (an optimizer state that does not fit).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A call this device, or the way it was set up, cannot serve.
    #[error("{0}")]
    Unsupported(String),
    /// The device's own library failed.
    #[error(transparent)]
    Device(BoxError),
    /// The device's own library failed while doing `what`.
    #[error("{what}")]
    During {
        /// What the device was doing, e.g. `copying the parameters to the GPU`.
        what: String,
        /// The library's error.
        #[source]
        source: BoxError,
    },
}

impl TrainingDeviceError {
    /// A failure of the device's library while doing `what`.
    pub fn during(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        TrainingDeviceError::During {
            what: what.into(),
            source: source.into(),
        }
    }

    /// A call that cannot be served, saying why.
    pub fn unsupported(why: impl Into<String>) -> Self {
        TrainingDeviceError::Unsupported(why.into())
    }
}

/// A device call's result.
pub type DeviceResult<T> = Result<T, TrainingDeviceError>;

/// The images of one training micro-batch.
#[derive(Clone, Copy, Debug)]
pub enum TrainImages<'a> {
    /// NHWC floats on the host (the CPU loader's batch).
    Host(&'a [f32]),
    /// The training set's images `indices`, assembled on the device with the augmentation
    /// draws of `epoch` (after [`TrainingDevice::upload_train_set`]).
    OnDevice {
        /// Dataset indices, in batch order.
        indices: &'a [usize],
        /// The epoch of the draws.
        epoch: u64,
    },
}

/// One micro-batch of a training step.
#[derive(Clone, Copy, Debug)]
pub struct TrainBatch<'a> {
    /// Its images.
    pub images: TrainImages<'a>,
    /// Their labels.
    pub labels: &'a [u32],
}

impl TrainBatch<'_> {
    /// Its number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether it has no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// One optimizer step: what [`TrainingDevice::train_step`] runs.
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    /// The micro-batches of the step (one, or `--grad-accum` of one size), each of
    /// `height x width` images.
    pub micro_batches: &'a [TrainBatch<'a>],
    /// Rows of an image.
    pub height: usize,
    /// Columns of an image.
    pub width: usize,
    /// The loss's settings.
    pub loss: &'a LossOptions,
    /// The learning rate of the step.
    pub lr: f64,
    /// The momentum of the step, for schedules that cycle it.
    pub momentum: Option<f64>,
}

/// What one [`TrainingDevice::train_step`] returned and how it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Each micro-batch's mean loss, from the forward before the update.
    pub losses: Vec<f32>,
    /// How a GPU ran the step; `None` on the CPU.
    pub run: Option<StepRun>,
    /// Why CUDA graphs are off, on the first step after they were turned off.
    pub graphs_off: Option<String>,
    /// Why steps are captured in relaxed mode, on the first step captured so.
    pub relaxed_capture: Option<String>,
}

impl StepReport {
    /// The mean of the micro-batches' losses, as the separate calls average them.
    pub fn mean_loss(&self) -> f64 {
        let sum: f64 = self.losses.iter().map(|&loss| f64::from(loss)).sum();
        sum / self.losses.len().max(1) as f64
    }
}

/// How a GPU ran one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepRun {
    /// Its kernels are launched one by one.
    Eager,
    /// It is captured as a graph, which is then launched.
    Capture,
    /// Its key's graph is launched.
    Replay,
}

/// What a training step involves, as far as running it whole is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepConditions {
    /// Whether the step averages gradients with other processes.
    pub data_parallel: bool,
    /// Whether batch-norm statistics are summed across processes (through NCCL on the
    /// device when `nccl`, else through the host).
    pub sync_bn: bool,
    /// Whether the device joined an NCCL group.
    pub nccl: bool,
}

/// Why a step is not a whole step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotWholeStep {
    /// Several processes on the host ring: the gradients cross the host inside the step.
    DataParallel,
    /// SyncBatchNorm on the host ring: statistics cross the host inside the step.
    SyncBatchNorm,
}

impl fmt::Display for NotWholeStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotWholeStep::DataParallel => {
                write!(f, "data-parallel steps average gradients through the host")
            }
            NotWholeStep::SyncBatchNorm => {
                write!(f, "--sync-bn sums batch statistics through the host")
            }
        }
    }
}

impl StepConditions {
    /// `None` when the step runs in one process or with its gradients (and, with
    /// SyncBatchNorm, its batch statistics) summed through NCCL, of one micro-batch or of
    /// several (`--grad-accum`). Else the first reason it is not.
    pub fn refusal(&self) -> Option<NotWholeStep> {
        if self.sync_bn && !self.nccl {
            Some(NotWholeStep::SyncBatchNorm)
        } else if self.data_parallel && !self.nccl {
            Some(NotWholeStep::DataParallel)
        } else {
            None
        }
    }
}

/// Whether a step runs as one [`TrainingDevice::train_step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WholeSteps {
    /// It does.
    Yes,
    /// It runs through the separate calls.
    No,
    /// It runs through the separate calls, and a GPU says why it captures no graph.
    NoBecause(String),
}

/// A dataset's pixels on the host, as the loader holds them.
#[derive(Clone, Copy, Debug)]
pub enum UploadPixels<'a> {
    /// Bytes 0..=255 (image files), divided by 255 before the normalization.
    U8(&'a [u8]),
    /// Ready floats (synthetic data), normalized as they are.
    F32(&'a [f32]),
}

impl UploadPixels<'_> {
    /// Their size in bytes.
    pub fn bytes(&self) -> usize {
        match self {
            UploadPixels::U8(values) => values.len(),
            UploadPixels::F32(values) => std::mem::size_of_val(*values),
        }
    }
}

/// A data set to copy to a device once, with how its batches are augmented and normalized
/// there (as the CPU loader would).
#[derive(Clone, Copy, Debug)]
pub struct DatasetUpload<'a> {
    /// Its pixels, NHWC.
    pub pixels: UploadPixels<'a>,
    /// Number of images.
    pub len: usize,
    /// Rows of an image.
    pub height: usize,
    /// Columns of an image.
    pub width: usize,
    /// Values of a pixel.
    pub channels: usize,
    /// Zero padding of the random crop (0: no crop draws).
    pub crop_padding: usize,
    /// Whether to draw a horizontal flip.
    pub horizontal_flip: bool,
    /// `(value - mean[c % 3]) / std[c % 3]` of each value; `[0; 3]` and `[1; 3]` leave it.
    pub mean: [f32; 3],
    /// See `mean`.
    pub std: [f32; 3],
    /// The seed of the draws.
    pub seed: u64,
}

/// Where an uploaded data set ended up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Uploaded {
    /// In device memory: this many bytes of pixels.
    OnDevice(usize),
    /// On the host: the device computes on host memory.
    OnHost,
    /// On the host: its `bytes` are more than half the device's `free` memory.
    TooLarge {
        /// The pixels' bytes.
        bytes: usize,
        /// The device's free memory in bytes.
        free: usize,
    },
}

/// What joining an NCCL communicator needs.
#[derive(Clone, Debug)]
pub struct NcclJoin<'a> {
    /// The communicator's unique id, from rank 0.
    pub unique_id: &'a [u8],
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// How long a collective may take.
    pub timeout: std::time::Duration,
    /// The gradient buckets, in the order the backward finishes them.
    pub buckets: Vec<Range<usize>>,
}

/// A model and the device its training job runs on.
pub trait TrainingDevice: Send {
    /// The model's specification.
    fn spec(&self) -> &ModelSpec;

    /// The number of parameters.
    fn param_count(&self) -> usize;

    /// Sets up the optimizer of `config` with a zero state.
    fn set_optimizer(&mut self, config: OptimizerConfig);

    /// One whole optimizer step: gradients zeroed; per micro-batch a train-mode forward and
    /// a backward of its loss scaled by the inverse of their count; the optimizer at the
    /// request's learning rate (and momentum). Only for steps where
    /// [`TrainingDevice::whole_steps`] says [`WholeSteps::Yes`].
    fn train_step(&mut self, request: StepRequest<'_>) -> DeviceResult<StepReport>;

    /// Whether a step of `conditions` runs as one [`TrainingDevice::train_step`].
    fn whole_steps(&self, conditions: &StepConditions) -> WholeSteps;

    /// Sets every gradient to zero.
    fn zero_grads(&mut self) -> DeviceResult<()>;

    /// Train-mode forward of `micro_batch` (`height x width` images): returns the mean loss
    /// and updates the running statistics.
    fn forward_train(
        &mut self,
        micro_batch: TrainBatch<'_>,
        height: usize,
        width: usize,
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> DeviceResult<f32>;

    /// Backward of the last [`TrainingDevice::forward_train`]: adds the gradients of
    /// `loss_scale · loss` and calls `grad_ready`, if given, with each final range and its
    /// host values.
    fn backward(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
    ) -> DeviceResult<()>;

    /// Lets `change` read and replace the gradients on the host (the data-parallel average).
    fn with_host_grads(&mut self, change: &mut dyn FnMut(&mut [f32])) -> DeviceResult<()>;

    /// One optimizer step at learning rate `lr` (and `momentum`).
    fn optimizer_step(&mut self, lr: f64, momentum: Option<f64>) -> DeviceResult<()>;

    /// Eval-mode forward of NHWC `images`; returns the logits `[batch, classes]` on the host.
    fn forward_eval(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> DeviceResult<&[f32]>;

    /// Eval-mode forward of the images `indices` of the test set uploaded by
    /// [`TrainingDevice::upload_eval_set`]; returns the logits.
    fn forward_eval_on_device(
        &mut self,
        indices: &[usize],
        height: usize,
        width: usize,
    ) -> DeviceResult<&[f32]>;

    /// The model with host buffers as they stand on the device, for checkpoints, snapshots
    /// and broadcasts.
    fn host_model(&mut self) -> DeviceResult<&Model>;

    /// Lets `change` change the host model, then copies its parameters and running
    /// statistics to the device unless `change` returned `false` (it failed). See
    /// [`update_host`] for a change that returns a result.
    fn update_host(&mut self, change: &mut dyn FnMut(&mut Model) -> bool) -> DeviceResult<()>;

    /// The optimizer's state in the CPU optimizers' layout, which either device resumes.
    fn optimizer_state(&mut self) -> DeviceResult<OptimizerState>;

    /// Restores a state of [`TrainingDevice::optimizer_state`]; a state that does not fit
    /// the optimizer changes nothing.
    fn load_optimizer_state(&mut self, state: &OptimizerState) -> DeviceResult<()>;

    /// Copies a training set to the device once, so that its batches are assembled there
    /// ([`TrainImages::OnDevice`]).
    fn upload_train_set(&mut self, upload: DatasetUpload<'_>) -> DeviceResult<Uploaded>;

    /// Copies a test set to the device once, for
    /// [`TrainingDevice::forward_eval_on_device`].
    fn upload_eval_set(&mut self, upload: DatasetUpload<'_>) -> DeviceResult<Uploaded>;

    /// Whether the device keeps data sets in its memory (see
    /// [`TrainingDevice::upload_train_set`]); the host's batches come from the host.
    fn takes_data_sets(&self) -> bool {
        false
    }

    /// Waits until the device finished the work it was given.
    fn synchronize(&self) -> DeviceResult<()> {
        Ok(())
    }

    /// The device memory in use in bytes; `None` on the host.
    fn memory_in_use(&self) -> DeviceResult<Option<usize>> {
        Ok(None)
    }

    /// Joins the NCCL communicator of a job whose gradients and broadcasts then run on the
    /// devices.
    fn join_nccl(&mut self, _join: NcclJoin<'_>) -> DeviceResult<()> {
        Err(TrainingDeviceError::unsupported(
            "NCCL needs the model on a GPU; this rank computes on the CPU",
        ))
    }

    /// Leaves the NCCL communicator joined, if any, aborting it (a collective blocked on a
    /// lost peer returns): the device computes alone until it joins another.
    fn leave_nccl(&mut self) -> DeviceResult<()> {
        Ok(())
    }

    /// What aborts the joined NCCL communicator from another thread, given why: a
    /// collective blocked on a lost peer then returns, and the device's later NCCL work
    /// fails with that reason. `None` without a communicator.
    fn nccl_abort(&self) -> Option<CommunicatorAbort> {
        None
    }

    /// SyncBatchNorm through the joined NCCL communicator: pass no host reducer to the
    /// forward and backward then.
    fn sync_batch_norm_through_nccl(&mut self) -> DeviceResult<()> {
        Err(TrainingDeviceError::unsupported(
            "SyncBatchNorm through NCCL needs the model on a GPU",
        ))
    }

    /// Whether the gradients and broadcasts go through NCCL on the device.
    fn uses_nccl(&self) -> bool {
        false
    }

    /// The NCCL collective that timed out or failed, if one did.
    fn nccl_failure(&self) -> Option<String> {
        None
    }

    /// Backward with each gradient bucket averaged over the ranks through NCCL as soon as it
    /// is final; call [`TrainingDevice::finish_all_reduce`] after it.
    fn backward_all_reduced(
        &mut self,
        _loss_scale: f32,
        _bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> DeviceResult<()> {
        Err(no_nccl())
    }

    /// Averages the gradient buckets the backward did not hand to NCCL.
    fn finish_all_reduce(&mut self) -> DeviceResult<()> {
        Err(no_nccl())
    }

    /// Gives every rank rank 0's running statistics, and with `params` its parameters,
    /// through NCCL on the device.
    fn broadcast_on_device(&mut self, _params: bool) -> DeviceResult<()> {
        Err(no_nccl())
    }

    /// Keeps the gradients on the device as shard slot `slot`'s (`--global-batch-size`
    /// through NCCL) and sets them to zero for the next shard.
    fn keep_shard_grads(&mut self, _slot: usize) -> DeviceResult<()> {
        Err(no_device_shards())
    }

    /// Replaces the gradients by the exact sum (`tandem_dist::exact`, the same bits) of the
    /// first `own` kept shard gradients of every rank of the NCCL group, `total_terms` over
    /// all ranks, on the device.
    fn exact_sum_shards(&mut self, _own: usize, _total_terms: usize) -> DeviceResult<()> {
        Err(no_device_shards())
    }
}

/// Aborts a device's NCCL communicator from any thread, given why
/// ([`TrainingDevice::nccl_abort`]).
pub type CommunicatorAbort = Box<dyn Fn(&str) + Send + Sync>;

/// The error of a shard call on a device that keeps no shard gradients.
fn no_device_shards() -> TrainingDeviceError {
    TrainingDeviceError::unsupported("shard gradients on the device need the model on a GPU")
}

/// The error of an NCCL call on a device without NCCL.
fn no_nccl() -> TrainingDeviceError {
    TrainingDeviceError::unsupported("NCCL needs the model on a GPU")
}

/// [`TrainingDevice::update_host`] with a `change` that may fail: its error comes back as
/// it is, and the device copies are then left alone.
pub fn update_host<D, R, E>(
    device: &mut D,
    change: impl FnOnce(&mut Model) -> Result<R, E>,
) -> Result<R, E>
where
    D: TrainingDevice + ?Sized,
    E: From<TrainingDeviceError>,
{
    let mut change = Some(change);
    let mut result = None;
    device.update_host(&mut |model| {
        let outcome = change.take().map(|change| change(model));
        let changed = matches!(outcome, Some(Ok(_)));
        result = outcome;
        changed
    })?;
    result.unwrap_or_else(|| {
        Err(TrainingDeviceError::unsupported("the host model was not offered for a change").into())
    })
}

/// [`TrainingDevice::with_host_grads`] with a `change` that may fail: its error comes back
/// as it is.
pub fn with_host_grads<D, E>(
    device: &mut D,
    change: impl FnOnce(&mut [f32]) -> Result<(), E>,
) -> Result<(), E>
where
    D: TrainingDevice + ?Sized,
    E: From<TrainingDeviceError>,
{
    let mut change = Some(change);
    let mut result = Ok(());
    device.with_host_grads(&mut |grads| {
        if let Some(change) = change.take() {
            result = change(grads);
        }
    })?;
    result
}
