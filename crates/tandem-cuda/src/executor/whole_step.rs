//! A whole training step ([`CudaExecutor::train_step`]): zeroed gradients; per micro-batch
//! (one, or `--grad-accum` of them, see `micro_batches.rs`) forward, loss and backward (with an
//! NCCL group joined, the last one's finished gradient buckets all-reduced on the group's
//! stream, as `data_parallel.rs` does eagerly); optimizer. Run eagerly or as a CUDA graph
//! (see `graph.rs`).
//!
//! The step is split so that the same kernels run on the same inputs either way:
//! 1. *inputs*, on the host: the storage is prepared (allocation, cuDNN's algorithm search),
//!    the optimizer's state made, and the images (or their dataset indices), the labels, the
//!    cleared bad-label record and the step's scalars (epoch, optimizer) are copied into fixed
//!    device buffers;
//! 2. *body*, device work only: no host copy, allocation, synchronization or per-step
//!    by-value argument; this is what is captured and replayed;
//! 3. *result*: one synchronization, the loss and the bad-label record read back.
//!
//! Nothing in the body touches a `cudarc` event but the NCCL group's own (below): the
//! executor's context does not track them (`CudaExecutor::new`), so `device_ptr` neither
//! waits on nor records one. Capture is in
//! `THREAD_LOCAL` mode: the executor is driven by one thread, and no other thread's legal
//! CUDA calls (e.g. the NCCL watchdog's `cuEventQuery` of earlier steps' events) can
//! invalidate its capture. A library call of this thread that allocates or synchronizes
//! inside the capture makes CUDA refuse it; the capture is then tried once more in `RELAXED`
//! mode, which allows such calls, before graphs are turned off (see `graph.rs`).
//!
//! With NCCL (version 2.9 or later captures collectives) the group's stream joins the capture
//! through the event it waits on, recorded on the capturing stream, and rejoins it through the
//! event the compute stream waits on at the end of the backward; the bucket sums (and
//! divisions by the world size) are nodes of the graph, ordered by those events as eagerly.
//! Inside the capture the group holds its events and registers none with the watchdog (a
//! query would invalidate the capture, and they mark nothing at a launch); after every step,
//! eager or launched, one event recorded on the compute stream after the whole step is the
//! step's deadline, so a peer that stops answering inside a graph still ends in
//! `ncclCommAbort` and a named error within the timeout. A graph is launched only on a
//! communicator that was not aborted (its NCCL kernels address the communicator).

use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use std::sync::Arc;
use tandem_engine::{AdamConfig, SgdConfig};
use tandem_models::executor::GradientsReady;
use tandem_models::workspace::{Mode, Plan};
use tandem_models::{LossOptions, Model, ModelError};

use super::dataset::{check_gathered_batch, DeviceDataset};
use super::error::{cublas, driver, same_length};
use super::graph::{CaptureFailure, CaptureMode, GraphKey, ImagesKey, OptimizerKind, StepRun};
use super::scalars::{StepScalars, STEP_SCALARS_BYTES};
use super::step::{GpuStep, GradientSink};
use super::{address, check_batch, CudaExecutor, GpuError};

/// Bytes of cuBLAS's workspace: 32 MiB, what cuBLAS recommends for Hopper (and PyTorch's
/// default there); the head's GEMMs need far less.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Where a step's images come from.
pub enum StepImages<'a> {
    /// NHWC floats on the host, copied into the input slot before the step.
    Host(&'a [f32]),
    /// The images `indices` of `dataset`, assembled on the device with the draws of `epoch`.
    Gathered {
        /// The training set on the device.
        dataset: &'a mut DeviceDataset,
        /// Dataset indices, in batch order.
        indices: &'a [usize],
        /// The epoch of the augmentation draws.
        epoch: u64,
    },
}

/// The optimizer that ends a step, with its settings at this step.
#[derive(Clone, Copy, Debug)]
pub enum StepOptimizer<'a> {
    /// SGD.
    Sgd(&'a SgdConfig),
    /// Adam or AdamW.
    Adam(&'a AdamConfig),
}

impl StepOptimizer<'_> {
    /// The kernel it runs.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            StepOptimizer::Sgd(_) => OptimizerKind::Sgd,
            StepOptimizer::Adam(_) => OptimizerKind::Adam,
        }
    }
}

/// One training step of one or more micro-batches of the plan's batch (`--grad-accum`:
/// their gradients summed, each micro-batch's loss scaled by the inverse of their count).
pub struct TrainStep<'a> {
    /// The images of the micro-batches, one after another.
    pub images: StepImages<'a>,
    /// Their labels, one after another.
    pub labels: &'a [u32],
    /// How many micro-batches (at least one).
    pub micro_batches: usize,
    /// The loss's settings.
    pub loss: &'a LossOptions,
    /// The optimizer and its settings at this step.
    pub optimizer: StepOptimizer<'a>,
}

/// What a step returned and how it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// Each micro-batch's mean loss (before the update).
    pub losses: Vec<f32>,
    /// Eagerly, captured (and launched), or replayed.
    pub run: StepRun,
    /// Why CUDA graphs are off, on the first step after they were turned off (by
    /// `TANDEM_CUDA_GRAPHS=0` or a failure to capture); `None` otherwise.
    pub graphs_off: Option<String>,
    /// Why steps are captured in relaxed mode (CUDA refused the thread-local capture), on the
    /// first step captured so; `None` otherwise.
    pub relaxed_capture: Option<String>,
}

/// Gives `blas` a workspace of its own (stream capture cannot allocate cuBLAS's default one).
/// The workspace must outlive the handle; `cublasSetStream` would reset it, and nothing calls
/// it after this.
pub(super) fn set_blas_workspace(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
) -> Result<CudaSlice<u8>, GpuError> {
    let workspace = stream
        .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
        .map_err(driver("cuMemAllocAsync"))?;
    let pointer = address(&workspace, stream);
    // SAFETY: the handle is valid for the life of `blas`; the workspace holds
    // BLAS_WORKSPACE_BYTES bytes on the handle's device and is kept by the executor, which
    // drops `blas` first.
    unsafe {
        cublas_sys::cublasSetWorkspace_v2(
            *blas.handle(),
            pointer as *mut std::ffi::c_void,
            BLAS_WORKSPACE_BYTES,
        )
    }
    .result()
    .map_err(cublas("cublasSetWorkspace_v2"))?;
    Ok(workspace)
}

/// Checks on the host every label of a step's micro-batches of `batch` against `classes`,
/// before the step (the loss kernel's record of a bad one would come after the update, and
/// would not say which micro-batch): the CPU's `InvalidLabel` error naming the sample in its
/// micro-batch.
fn check_labels(labels: &[u32], batch: usize, classes: usize) -> Result<(), ModelError> {
    match labels.iter().position(|&label| label as usize >= classes) {
        Some(index) => Err(tandem_engine::EngineError::InvalidLabel {
            sample: index % batch.max(1),
            label: labels[index],
            classes,
        }
        .into()),
        None => Ok(()),
    }
}

impl CudaExecutor {
    /// One training step of `model` over `step.micro_batches` of `plan`'s batch: gradients
    /// zeroed; per micro-batch forward, loss, backward of the loss scaled by the inverse of
    /// their count; optimizer step. Returns each micro-batch's loss. The running
    /// statistics, parameters and optimizer state on the device are updated (the caller
    /// counts each micro-batch in `num_batches_tracked`). The first step of a key (batch
    /// shape, micro-batch count, optimizer, label smoothing, image source) runs eagerly, the
    /// second is captured as a CUDA graph and the later ones replay it, unless graphs are
    /// off; a failure to capture turns them off and the step runs eagerly, with the same
    /// result. With an NCCL group joined, the last micro-batch's backward averages each
    /// finished gradient bucket over the ranks inside the step (captured with it), the end of
    /// the step is given the collective timeout, and a collective that timed out or failed is
    /// the step's error.
    pub fn train_step(
        &mut self,
        model: &Model,
        plan: &Plan,
        step: TrainStep<'_>,
    ) -> Result<StepOutcome, ModelError> {
        self.bind()?;
        if plan.mode != Mode::Train {
            return Err(GpuError::Unsupported("a training step with an evaluation plan").into());
        }
        let micro_batches = step.micro_batches;
        if micro_batches == 0 {
            return Err(GpuError::Unsupported("a training step of no micro-batch").into());
        }
        same_length("labels", step.labels.len(), plan.batch * micro_batches)?;
        let images_key = match &step.images {
            StepImages::Host(images) if micro_batches == 1 => {
                check_batch(plan, images, None)?;
                ImagesKey::Host
            }
            StepImages::Host(images) => {
                let values = plan.batch * plan.height * plan.width * plan.stem.shape.in_channels;
                same_length("images", images.len(), values * micro_batches)?;
                ImagesKey::Host
            }
            StepImages::Gathered {
                dataset, indices, ..
            } => {
                check_gathered_batch(plan, dataset, indices, micro_batches)?;
                ImagesKey::Gathered {
                    dataset: dataset.id(),
                }
            }
        };
        check_labels(step.labels, plan.batch, model.spec().num_classes())?;
        let key = GraphKey {
            batch: plan.batch,
            micro_batches,
            height: plan.height,
            width: plan.width,
            optimizer: step.optimizer.kind(),
            label_smoothing_bits: step.loss.label_smoothing.to_bits(),
            images: images_key,
        };
        let labels = step.labels;
        let gathered = self.load_step_inputs(plan, step)?;
        let dataset = gathered.as_deref();
        let run = match self.graphs.next_run(&key, self.generation) {
            StepRun::Eager => {
                self.step_body(model, plan, dataset, micro_batches)?;
                StepRun::Eager
            }
            StepRun::Capture => loop {
                let Err(failure) = self.capture_and_launch(model, plan, dataset, &key) else {
                    break StepRun::Capture;
                };
                if !self.graphs.after_failure(CaptureFailure::new(failure)) {
                    self.step_body(model, plan, dataset, micro_batches)?;
                    break StepRun::Eager;
                }
            },
            StepRun::Replay => {
                let graph = self.graphs.graph(&key).ok_or_else(|| {
                    ModelError::from(GpuError::Unsupported(
                        "replaying a graph that was not captured",
                    ))
                })?;
                self.launch_graph(graph)?;
                StepRun::Replay
            }
        };
        self.watch_step(run)?;
        let losses = match micro_batches {
            1 => self.read_loss(labels).map(|loss| vec![loss]),
            _ => self
                .read_micro_batch_losses(micro_batches)
                .map_err(ModelError::from),
        };
        // A collective that timed out or failed is the step's error (the losses read after
        // the abort are meaningless).
        self.nccl_health()?;
        let losses = losses?;
        Ok(StepOutcome {
            losses,
            run,
            graphs_off: self.graphs.take_off_reason(),
            relaxed_capture: self.graphs.take_relaxed_reason(),
        })
    }

    /// Turns the capture of training steps on or off, whatever `TANDEM_CUDA_GRAPHS` said
    /// (for tests comparing both in one process). Either way every graph is dropped and the
    /// schedule starts afresh: the next step of each key runs eagerly.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs =
            super::graph::GraphSchedule::new((!on).then(|| "turned off by the caller".to_string()));
    }

    /// Whether captured training steps are on.
    pub fn graphs_on(&self) -> bool {
        self.graphs.is_on()
    }

    /// The inputs phase of [`Self::train_step`]: everything on the host and every copy to
    /// the device, before the body. Returns the dataset of a gathered batch for the body.
    fn load_step_inputs<'a>(
        &mut self,
        plan: &Plan,
        step: TrainStep<'a>,
    ) -> Result<Option<&'a mut DeviceDataset>, GpuError> {
        self.prepare(plan)?;
        let optimizer = self.next_optimizer_scalars(step.optimizer)?;
        let several = step.micro_batches > 1;
        let (epoch, dataset) = match step.images {
            StepImages::Host(images) if several => {
                self.load_micro_batches(step.micro_batches, step.labels, Some(images))?;
                (0, None)
            }
            StepImages::Host(images) => {
                self.copy_images(images)?;
                (0, None)
            }
            StepImages::Gathered {
                dataset,
                indices,
                epoch,
            } => {
                self.load_indices(dataset, indices)?;
                if several {
                    self.load_micro_batches(step.micro_batches, step.labels, None)?;
                }
                (epoch, Some(dataset))
            }
        };
        if !several {
            self.load_labels(step.labels)?;
        }
        self.memory.label_smoothing = step.loss.label_smoothing;
        let scalars = StepScalars { epoch, optimizer }.bytes();
        debug_assert_eq!(scalars.len(), STEP_SCALARS_BYTES);
        self.write_scalars(0, &scalars)?;
        Ok(dataset)
    }

    /// The device work of a step (see the module's documentation): what is captured.
    fn step_body(
        &mut self,
        model: &Model,
        plan: &Plan,
        dataset: Option<&DeviceDataset>,
        micro_batches: usize,
    ) -> Result<(), ModelError> {
        self.zero_grads()?;
        let loss_scale = 1.0 / micro_batches as f32;
        let image_values = plan.batch * plan.height * plan.width * plan.stem.shape.in_channels;
        for index in 0..micro_batches {
            if micro_batches > 1 {
                self.move_in_micro_batch(index, image_values, dataset)?;
            } else if let Some(dataset) = dataset {
                let images = self.input_slot()?;
                self.augment(dataset, 0, plan.batch, images)?;
            }
            model.forward_on(&mut GpuStep::forward(self), plan, None)?;
            self.loss_kernels(self.memory.label_smoothing)?;
            if micro_batches > 1 {
                self.keep_micro_batch_loss(index)?;
            }
            // As the separate calls: only the last micro-batch's backward all-reduces.
            let sink = if self.has_nccl() && index + 1 == micro_batches {
                self.restart_buckets()?;
                GradientSink::AllReduce
            } else {
                GradientSink::Device
            };
            let mut ignore = |_: std::ops::Range<usize>, _: &[f32]| {};
            let mut ready = GradientsReady::new(&mut ignore);
            self.backward_walk(model, plan, loss_scale, None, &mut ready, sink)?;
        }
        if self.has_nccl() {
            self.finish_all_reduce()?;
        }
        Ok(self.launch_optimizer()?)
    }

    /// Ends a capture that cudarc's `end_capture` left open (it returns early, before
    /// `cuStreamEndCapture`, when the context recorded an error), discarding what was
    /// captured, so that the eager fallback runs on a stream that is not capturing.
    fn end_open_capture(&self) {
        let status = self.stream.capture_status();
        if status == Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) {
            return;
        }
        // SAFETY: the executor's own live stream; the partial graph it returns is not used,
        // only destroyed, once.
        unsafe {
            if let Ok(graph) = cudarc::driver::result::stream::end_capture(self.stream.cu_stream())
            {
                if !graph.is_null() {
                    let _ = cudarc::driver::result::graph::destroy(graph);
                }
            }
        }
    }

    /// Captures the step's body as a graph in the schedule's capture mode, instantiates and
    /// launches it (the captured work had not run), and keeps it under `key`. On any failure
    /// the capture is ended, its error cleared, and the failure returned: nothing of the body
    /// ran (a failed launch ran nothing either), and the caller captures again in relaxed
    /// mode or runs it eagerly. The failure is in words.
    fn capture_and_launch(
        &mut self,
        model: &Model,
        plan: &Plan,
        dataset: Option<&DeviceDataset>,
        key: &GraphKey,
    ) -> Result<(), String> {
        let searches = self.libraries.algorithms.searches();
        let generation = self.generation;
        let mode = match self.graphs.capture_mode() {
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        self.nccl_capture(true);
        if let Err(status) = self.stream.begin_capture(mode) {
            self.nccl_capture(false);
            return Err(format!("cuStreamBeginCapture failed: {status:?}"));
        }
        let body = self.step_body(model, plan, dataset, key.micro_batches);
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        if ended.is_err() {
            self.end_open_capture();
        }
        self.nccl_capture(false);
        // `prepare` searched for every convolution's algorithms before the capture, so a miss
        // of the cache here would be a shape outside the plan.
        if self.libraries.algorithms.searches() != searches {
            return Err("a convolution algorithm was searched for during capture".to_string());
        }
        if self.generation != generation {
            return Err("device memory was freed during capture".to_string());
        }
        // A call that CUDA refused inside the capture fails itself (a library reports it in
        // its own status) and invalidates the capture, which the end's status names.
        if let Err(error) = body {
            return Err(match &ended {
                Err(status) => format!(
                    "a call of the step cannot be captured: {error} (cuStreamEndCapture: {status:?})"
                ),
                Ok(_) => format!("a call of the step cannot be captured: {error}"),
            });
        }
        let graph = ended
            .map_err(|status| format!("cuStreamEndCapture/cuGraphInstantiate failed: {status:?}"))?
            .ok_or_else(|| "cuStreamEndCapture captured no graph".to_string())?;
        self.launch_graph(&graph)
            .map_err(|error| format!("the first launch of the new graph failed: {error}"))?;
        self.graphs.store(*key, self.generation, graph);
        Ok(())
    }

    /// Launches `graph` on the executor's stream; with an NCCL group, through the group,
    /// which refuses once its communicator was aborted.
    fn launch_graph(&self, graph: &CudaGraph) -> Result<(), GpuError> {
        match self.nccl_group() {
            Some(group) => Ok(group.launch_captured(|| graph.launch())?),
            None => graph.launch().map_err(driver("cuGraphLaunch")),
        }
    }
}
