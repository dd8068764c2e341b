//! The GPU executor: [`CudaExecutor`] runs a [`Plan`] of the shared network description on
//! one GPU through the [`Executor`] interface of `tandem-models`: convolutions through cuDNN
//! ([`conv`]), the linear layer through cuBLAS ([`linear`]), and our NVRTC-compiled kernels
//! for batch norm, the fused epilogue, pooling, the loss, biases and the optimizers; in
//! bfloat16 ([`Precision::Bf16`]) the convolutions and GEMMs go through `autocast.rs`.
//!
//! The executor owns, each in a part of its own: the libraries (cuDNN, cuBLAS, our kernels,
//! the chosen convolution algorithms); the flat parameter, gradient and running-statistic
//! buffers with the optimizer's state over them; the memory the steps run on (the plans'
//! storage, micro-batches, per-step scalars); and, once joined, the NCCL group. The host sees
//! the flat buffers through [`CudaExecutor::params_to_host`] and the like. Each walk of the
//! model runs on a `GpuStep` (`step.rs`), made for that walk with where its backward's
//! finished gradients go: nowhere, to the host (a host mirror, then the interface's
//! gradient-ready hook, which hands out host values), or to NCCL.
//!
//! [`CudaExecutor::train_step`] runs a whole training step, alone or through an NCCL group,
//! eagerly or as a CUDA graph with the same result (`whole_step.rs`, `graph.rs`, `scalars.rs`).

pub mod algorithm;
pub mod algorithm_store;
mod autocast;
pub mod conv;
pub mod cudnn;
mod data_parallel;
pub mod dataset;
pub mod error;
pub mod exact_sum;
pub mod flat;
pub mod graph;
mod host_grads;
pub mod kernels;
pub mod launch;
pub mod linear;
pub mod memory;
mod micro_batches;
pub mod scalars;
mod step;
mod units;
mod whole_step;

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, CudaView, DevicePtr};
use tandem_engine::{AdamConfig, BatchNormReducer, OptimizerState, SgdConfig};
#[cfg(doc)]
use tandem_models::executor::Executor;
use tandem_models::executor::GradientsReady;
use tandem_models::workspace::{Mode, Plan};
use tandem_models::{LossOptions, Model, ModelError, TensorKind};

use crate::arch::GpuArch;
use crate::compile::Compiler;
use crate::probe::{Library, Probe};
use crate::ptx_cache::PtxCache;
use algorithm::AlgorithmSettings;
use algorithm_store::AlgorithmStore;
use conv::{AlgorithmCache, AlgorithmCounts};
use cudnn::CudnnHandle;
pub use data_parallel::DeviceDataParallel;
pub use dataset::{AugmentSettings, DatasetShape, DeviceDataset, HostPixels};
pub use error::GpuError;
use error::{driver, same_length};
use flat::FlatBuffer;
use graph::{GraphSchedule, OptimizerKind};
use host_grads::HostGradients;
use kernels::{optimizers, Kernels, Ptr, Queue};
use launch::per_element;
use memory::PlanStorages;
use micro_batches::MicroBatchBuffers;
pub use scalars::AdamScalars;
use scalars::{
    AdamStepScalars, OptimizerScalars, SgdScalars, OPTIMIZER_OFFSET, STEP_SCALARS_BYTES,
};
use step::{GpuStep, GradientSink};
pub use whole_step::{StepImages, StepOptimizer, StepOutcome, TrainStep};

pub use tandem_models::training_device::GradientHook;

/// The math of convolutions and the linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Strict float32 (the parity tests).
    Fp32,
    /// TF32 tensor cores for convolutions and matmuls (PyTorch's default on GPUs).
    Tf32,
    /// PyTorch autocast's bfloat16: convolutions and the linear layer take bfloat16 operands
    /// and accumulate in float32; everything else (batch norm, the loss, the optimizer, the
    /// master weights, the activations in memory) stays float32. Each convolution and GEMM
    /// narrows its float32 operands to bfloat16 scratch buffers and widens its result back
    /// (`autocast.rs`).
    Bf16,
}

/// The executor's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuSettings {
    /// The GPU's ordinal among the visible ones.
    pub ordinal: usize,
    /// Math of convolutions and matmuls.
    pub precision: Precision,
    /// Admit only deterministic cuDNN algorithms.
    pub deterministic: bool,
}

impl GpuSettings {
    /// What decides the choice of convolution algorithms.
    pub fn algorithms(&self) -> AlgorithmSettings {
        AlgorithmSettings {
            precision: self.precision,
            deterministic: self.deterministic,
        }
    }
}

/// The optimizer state on the device, made at the first step (or loaded from the host).
enum DeviceOptimizer {
    None,
    Sgd {
        momentum: CudaSlice<f32>,
        steps: u64,
    },
    Adam {
        exp_avg: CudaSlice<f32>,
        exp_avg_sq: CudaSlice<f32>,
        steps: u64,
    },
}

/// A model's flat buffers and one plan's storage on one GPU.
pub struct CudaExecutor {
    // Handles first: they are dropped before the stream and context they use.
    libraries: Libraries,
    flat: FlatState,
    memory: StepMemory,
    /// The captured training steps.
    graphs: GraphSchedule<CudaGraph>,
    /// How many times an allocation a captured step may address was freed (see `graph`).
    generation: u64,
    /// The NCCL group and gradient buckets, once joined (a job of several GPU ranks).
    data_parallel: Option<DeviceDataParallel>,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
}

/// The libraries on the executor's stream: cuDNN and cuBLAS, our kernels, and the
/// convolution algorithms chosen for the executor's settings with their workspace.
struct Libraries {
    cudnn: CudnnHandle,
    /// Dropped by hand (in `CudaExecutor`'s `Drop`): cudarc's own drop panics when the handle
    /// cannot be destroyed, as after a sticky CUDA error.
    blas: ManuallyDrop<CudaBlas>,
    /// cuBLAS's workspace, set explicitly (stream capture cannot allocate one); only cuBLAS
    /// reads it, so it is kept here until the handle is gone (`blas` is dropped first).
    #[allow(dead_code)]
    blas_workspace: CudaSlice<u8>,
    kernels: Kernels,
    algorithms: AlgorithmCache,
    settings: GpuSettings,
    /// cuDNN's workspace: as large as the largest that a prepared plan's algorithms need.
    workspace: CudaSlice<u8>,
}

/// The model's flat buffers on the device, the optimizer's state over them, and the
/// gradients' host side.
struct FlatState {
    params: FlatBuffer,
    grads: FlatBuffer,
    buffers: CudaSlice<f32>,
    /// Values in the flat running-statistic buffer (its device allocation holds at least one).
    buffer_len: usize,
    optimizer: DeviceOptimizer,
    /// The gradients on the host (page-locked), for a backward's host hook and
    /// [`CudaExecutor::with_host_grads`].
    host_grads: HostGradients,
    /// The kept shard gradients of `--global-batch-size` and their exact sum's buffers,
    /// allocated at the first shard.
    shards: Option<exact_sum::ShardGradients>,
}

/// What the steps run on: the plans' storage, the micro-batches of a whole step, and the
/// per-step scalars.
struct StepMemory {
    storages: PlanStorages,
    /// The labels, host images and losses of a step of several micro-batches.
    micro_batches: MicroBatchBuffers,
    /// The per-step scalars the optimizer and augmentation kernels read (`scalars`).
    step_scalars: CudaSlice<u8>,
    /// The host side of the step-scalar copies: a copy from pageable memory may read its
    /// source after the call returns, so the source outlives the call.
    host_scalars: Box<[u8; STEP_SCALARS_BYTES]>,
    /// The label smoothing of the last loss.
    label_smoothing: f32,
}

// SAFETY: the executor is not `Send` only because its cuDNN handle and descriptors are raw
// pointers. It owns them alone (nothing hands them out), and `&mut self`/`&self` keep their
// calls from running at once. CUDA, cuDNN and cuBLAS allow a handle to be used by one thread
// after another, provided the handle's context is current on the calling thread: every entry
// point that reaches cuDNN (`prepare`, hence `forward_train` and `forward_eval`, and
// `backward`) binds the context first, and `cudarc` binds it for its own stream, memory and
// launch calls. So `tandem train` may build the executor on the main thread and train on a
// kernel thread.
unsafe impl Send for CudaExecutor {}

/// Opens GPU `settings.ordinal` once every library the executor calls has been found: its
/// context, with `cudarc`'s event tracking off, and its architecture, which must run
/// `settings.precision`.
fn open_context(
    probe: &Probe,
    settings: &GpuSettings,
) -> Result<(Arc<CudaContext>, GpuArch), GpuError> {
    for library in [
        Library::Driver,
        Library::Nvrtc,
        Library::Cublas,
        Library::Cudnn,
    ] {
        probe.require(library)?;
    }
    let context = CudaContext::new(settings.ordinal).map_err(driver("CudaContext::new"))?;
    // SAFETY: before any allocation, so no slice of this context records events. The
    // contract (ordering between streams is ours) holds: every launch, copy and library
    // call runs on the executor's one stream, in order, and the NCCL group's stream orders
    // itself against it with events of its own (`NcclGroup::wait_for`/`hand_back`). With
    // tracking on, the executor's own stream would make every `device_ptr` wait on and
    // record per-slice events, which inside a stream capture would wait on events
    // recorded outside it.
    unsafe { context.disable_event_tracking() };
    let (major, minor) = context
        .compute_capability()
        .map_err(driver("cuDeviceGetAttribute(compute capability)"))?;
    let arch = GpuArch {
        major: major as u32,
        minor: minor as u32,
    };
    if !precision_supported(settings.precision, arch) {
        return Err(GpuError::Bf16NeedsAmpere {
            ordinal: settings.ordinal,
            arch,
        });
    }
    Ok((context, arch))
}

impl CudaExecutor {
    /// Opens GPU `settings.ordinal`, compiles our kernels (with the PTX cache in `cache`, whose
    /// folder also keeps the chosen convolution algorithms, `algorithm_store.rs`) and
    /// copies `model`'s flat parameters and buffers to it (the parameters and gradients placed
    /// so that its convolution filters are 16-byte aligned, [`flat`]). Every library it calls
    /// must have been found by `probe`: a missing one is an error naming it, never a panic.
    pub fn new(
        probe: &Probe,
        settings: GpuSettings,
        cache: Option<PtxCache>,
        model: &Model,
    ) -> Result<Self, GpuError> {
        let (params, buffers) = (model.params(), model.buffers());
        let offset = flat::aligning_offset(
            model
                .tensors()
                .iter()
                .filter(|tensor| tensor.kind == TensorKind::Param && tensor.shape.len() == 4)
                .map(|tensor| tensor.offset),
        );
        let (context, arch) = open_context(probe, &settings)?;
        let algorithm_store = match &cache {
            Some(cache) => Some(AlgorithmStore::new(
                cache.clone(),
                device_identity(probe, &context, arch)?,
            )),
            None => None,
        };
        let compiler = Compiler::new(probe, arch, cache)?;
        let kernels = Kernels::load(&context, &compiler)?;
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = context.new_stream().map_err(driver("cuStreamCreate"))?;
        let cudnn = CudnnHandle::new(&stream)?;
        let blas = CudaBlas::new(stream.clone()).map_err(error::cublas("cublasCreate_v2"))?;
        linear::set_math_mode(&blas, settings.precision)?;
        let blas_workspace = whole_step::set_blas_workspace(&blas, &stream)?;
        let graphs_off =
            (!graph::graphs_requested(std::env::var(graph::GRAPHS_ENV).ok().as_deref()))
                .then(|| format!("{}=0", graph::GRAPHS_ENV));
        let upload = |values: &[f32]| -> Result<CudaSlice<f32>, GpuError> {
            if values.is_empty() {
                stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))
            } else {
                stream
                    .clone_htod(values)
                    .map_err(driver("cuMemcpyHtoDAsync"))
            }
        };
        let flat = FlatState {
            params: FlatBuffer::upload(&stream, params, offset)?,
            grads: FlatBuffer::zeros(&stream, params.len(), offset)?,
            buffers: upload(buffers)?,
            buffer_len: buffers.len(),
            optimizer: DeviceOptimizer::None,
            host_grads: HostGradients::new(params.len()),
            shards: None,
        };
        let workspace = stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?;
        let memory = StepMemory {
            storages: PlanStorages::default(),
            step_scalars: stream
                .alloc_zeros(STEP_SCALARS_BYTES)
                .map_err(driver("cuMemAllocAsync"))?,
            host_scalars: Box::new([0; STEP_SCALARS_BYTES]),
            micro_batches: MicroBatchBuffers::new(&stream)?,
            label_smoothing: 0.0,
        };
        Ok(CudaExecutor {
            libraries: Libraries {
                cudnn,
                blas: ManuallyDrop::new(blas),
                blas_workspace,
                kernels,
                algorithms: AlgorithmCache::new(algorithm_store),
                settings,
                workspace,
            },
            flat,
            memory,
            graphs: GraphSchedule::new(graphs_off),
            generation: 0,
            data_parallel: None,
            stream,
            context,
        })
    }

    /// Makes the executor's context current on this thread.
    fn bind(&self) -> Result<(), GpuError> {
        self.context
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))
    }

    /// Makes the GPU current on this thread, allocates the storage of `plan` (one training
    /// and one evaluation storage are kept, each while its batch shape stays) and measures the
    /// algorithms of its convolutions (an evaluation plan's forward alone).
    pub fn prepare(&mut self, plan: &Plan) -> Result<(), GpuError> {
        self.bind()?;
        if self
            .memory
            .storages
            .activate(&self.stream, plan, self.libraries.settings.precision)?
        {
            self.generation += 1;
        }
        let mut workspace = 0;
        for unit in plan.unit_plans() {
            let measured = self.libraries.algorithms.get_or_measure(
                &self.libraries.cudnn,
                &unit.shape,
                self.libraries.settings.algorithms(),
                plan.mode == Mode::Train,
            )?;
            workspace = workspace.max(measured.workspace_bytes());
        }
        if workspace > self.libraries.workspace.len() {
            self.libraries.workspace = self
                .stream
                .alloc_zeros(workspace)
                .map_err(driver("cuMemAllocAsync"))?;
            self.generation += 1;
        }
        Ok(())
    }

    /// How many convolution algorithm searches this executor made and how many shapes it read
    /// from the kernel cache's folder instead (see `algorithm_store.rs`).
    pub fn algorithm_counts(&self) -> AlgorithmCounts {
        self.libraries.algorithms.counts()
    }

    /// A training forward of `images` (NHWC) and `labels` with `model`'s walk: returns the
    /// mean loss; the running statistics on the device are updated (the caller counts the
    /// step in `num_batches_tracked`, which lives in the model). `model` supplies only the
    /// network description; its host buffers are not read.
    pub fn forward_train(
        &mut self,
        model: &Model,
        plan: &Plan,
        images: &[f32],
        labels: &[u32],
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<f32, ModelError> {
        check_batch(plan, images, Some(labels))?;
        self.prepare(plan)?;
        self.copy_images(images)?;
        self.forward_train_loaded(model, plan, labels, loss, bn_sync)
    }

    /// The training forward of the images already in the prepared plan's input.
    fn forward_train_loaded(
        &mut self,
        model: &Model,
        plan: &Plan,
        labels: &[u32],
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<f32, ModelError> {
        model.forward_on(&mut GpuStep::forward(self), plan, bn_sync)?;
        self.loss_on_device(labels, loss.label_smoothing)
    }

    /// An evaluation forward of `images`; the logits go to `logits`.
    pub fn forward_eval(
        &mut self,
        model: &Model,
        plan: &Plan,
        images: &[f32],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        check_batch(plan, images, None)?;
        self.prepare(plan)?;
        self.copy_images(images)?;
        model.forward_on(&mut GpuStep::forward(self), plan, None)?;
        Ok(self.logits_to_host(logits)?)
    }

    /// The backward of the last [`CudaExecutor::forward_train`]: adds the gradients of
    /// `loss_scale · loss` to the device gradients and, with `grad_ready`, reports each
    /// finished range with its host values (copying it to the host and waiting for it).
    /// Without it (one process), no gradient crosses to the host.
    pub fn backward(
        &mut self,
        model: &Model,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
    ) -> Result<(), ModelError> {
        self.bind()?;
        let sink = match grad_ready {
            Some(_) => GradientSink::Host,
            None => GradientSink::Device,
        };
        self.backward_reporting(model, plan, loss_scale, bn_sync, grad_ready, sink)
    }

    /// The model's backward walk of the last training forward, handing each finished range
    /// to `sink` (`grad_ready` is the hook of [`GradientSink::Host`]).
    fn backward_reporting(
        &mut self,
        model: &Model,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
        sink: GradientSink,
    ) -> Result<(), ModelError> {
        // An evaluation since the forward would have left its storage active.
        if !self.memory.storages.resume_training(plan) {
            return Err(ModelError::NoForward);
        }
        let mut ignore = |_: std::ops::Range<usize>, _: &[f32]| {};
        let mut ready = GradientsReady::new(grad_ready.unwrap_or(&mut ignore));
        self.backward_walk(model, plan, loss_scale, bn_sync, &mut ready, sink)
    }

    /// The model's backward walk over the device gradients, which it changes (no host
    /// gradient is current after it but those `sink` copied).
    fn backward_walk(
        &mut self,
        model: &Model,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
        sink: GradientSink,
    ) -> Result<(), ModelError> {
        self.flat.host_grads.mark_stale();
        let mut step = GpuStep {
            exec: self,
            gradients: sink,
        };
        model.backward_on(&mut step, plan, loss_scale, bn_sync, ready)
    }

    /// Sets every device gradient to zero.
    pub fn zero_grads(&mut self) -> Result<(), GpuError> {
        self.flat.host_grads.mark_stale();
        self.flat.grads.zero(&self.stream)
    }

    /// Copies the device parameters into `params`.
    pub fn params_to_host(&self, params: &mut [f32]) -> Result<(), GpuError> {
        copy_to_host(
            "parameters",
            &self.stream,
            self.flat.params.values(),
            params,
        )
    }

    /// Copies the device gradients into `grads`.
    pub fn grads_to_host(&self, grads: &mut [f32]) -> Result<(), GpuError> {
        copy_to_host("gradients", &self.stream, self.flat.grads.values(), grads)
    }

    /// Copies the device running statistics into `buffers`.
    pub fn buffers_to_host(&self, buffers: &mut [f32]) -> Result<(), GpuError> {
        let values = self.flat.buffers.slice(..self.flat.buffer_len);
        copy_to_host("running statistics", &self.stream, values, buffers)
    }

    /// Replaces the device parameters and running statistics (a checkpoint, a broadcast).
    pub fn params_from_host(&mut self, params: &[f32], buffers: &[f32]) -> Result<(), GpuError> {
        same_length("parameters", params.len(), self.flat.host_grads.len())?;
        same_length("running statistics", buffers.len(), self.flat.buffer_len)?;
        if !params.is_empty() {
            self.stream
                .memcpy_htod(params, &mut self.flat.params.values_mut())
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        if !buffers.is_empty() {
            self.stream
                .memcpy_htod(buffers, &mut self.flat.buffers.slice_mut(..buffers.len()))
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        Ok(())
    }

    /// Replaces the device gradients by `grads`.
    pub fn grads_from_host(&mut self, grads: &[f32]) -> Result<(), GpuError> {
        same_length("gradients", grads.len(), self.flat.host_grads.len())?;
        self.flat.host_grads.mark_stale();
        if grads.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_htod(grads, &mut self.flat.grads.values_mut())
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// Lets `change` read and replace the device gradients on the host (the ring backend's
    /// average): they cross through the page-locked host gradients, where a reporting
    /// backward has already copied all or most of them (only the rest is copied), and go
    /// back from there to the device, which `change`'s values then replace.
    pub fn with_host_grads<R>(
        &mut self,
        change: impl FnOnce(&mut [f32]) -> R,
    ) -> Result<R, GpuError> {
        let n = self.flat.host_grads.len();
        if n == 0 {
            return Ok(change(&mut []));
        }
        self.bind()?;
        let current = self.flat.host_grads.current();
        if current < n {
            let range = current..n;
            let host = self.flat.host_grads.values(&self.context)?;
            self.stream
                .memcpy_dtoh(&self.flat.grads.view(range.clone()), &mut host[range])
                .map_err(driver("cuMemcpyDtoHAsync"))?;
        }
        // Also ends a copy from the host gradients to the device that may still be reading
        // them (an earlier call's), before `change` writes them.
        self.synchronize()?;
        let host = self.flat.host_grads.values(&self.context)?;
        let result = change(host);
        self.stream
            .memcpy_htod(&host[..], &mut self.flat.grads.values_mut())
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        self.flat.host_grads.mark_current(n);
        Ok(result)
    }

    /// One step of PyTorch's SGD over the flat device buffers (`sgd_step`, bit-identical to
    /// the CPU's `Sgd` per element).
    pub fn sgd_step(&mut self, config: &SgdConfig) -> Result<(), GpuError> {
        let scalars = self.next_optimizer_scalars(StepOptimizer::Sgd(config))?;
        self.write_scalars(OPTIMIZER_OFFSET, &scalars.bytes())?;
        self.launch_optimizer()
    }

    /// One step of PyTorch's Adam or AdamW over the flat device buffers; the scalars are
    /// computed on the host in double as the CPU's `Adam` does.
    pub fn adam_step(&mut self, config: &AdamConfig) -> Result<(), GpuError> {
        let scalars = self.next_optimizer_scalars(StepOptimizer::Adam(config))?;
        self.write_scalars(OPTIMIZER_OFFSET, &scalars.bytes())?;
        self.launch_optimizer()
    }

    /// Counts a step of `optimizer` and returns its scalars, making its (zero) state on the
    /// device first if the state is of another kind or missing (a freed state counts as a new
    /// generation).
    fn next_optimizer_scalars(
        &mut self,
        optimizer: StepOptimizer<'_>,
    ) -> Result<OptimizerScalars, GpuError> {
        let n = self.flat.host_grads.len();
        let kind = optimizer.kind();
        let kept = match &self.flat.optimizer {
            DeviceOptimizer::None => None,
            DeviceOptimizer::Sgd { .. } => Some(OptimizerKind::Sgd),
            DeviceOptimizer::Adam { .. } => Some(OptimizerKind::Adam),
        };
        if kept != Some(kind) {
            let alloc = || {
                self.stream
                    .alloc_zeros::<f32>(n.max(1))
                    .map_err(driver("cuMemAllocAsync"))
            };
            let fresh = match kind {
                OptimizerKind::Sgd => DeviceOptimizer::Sgd {
                    momentum: alloc()?,
                    steps: 0,
                },
                OptimizerKind::Adam => DeviceOptimizer::Adam {
                    exp_avg: alloc()?,
                    exp_avg_sq: alloc()?,
                    steps: 0,
                },
            };
            self.replace_optimizer(fresh);
        }
        match (&mut self.flat.optimizer, optimizer) {
            (DeviceOptimizer::Sgd { steps, .. }, StepOptimizer::Sgd(config)) => {
                let scalars = SgdScalars::new(config, *steps);
                *steps += 1;
                Ok(OptimizerScalars::Sgd(scalars))
            }
            (DeviceOptimizer::Adam { steps, .. }, StepOptimizer::Adam(config)) => {
                *steps += 1;
                Ok(OptimizerScalars::Adam(AdamStepScalars::new(config, *steps)))
            }
            _ => Err(GpuError::Unsupported("an optimizer state of another kind")),
        }
    }

    /// Replaces the optimizer state; freeing a device state is a new generation.
    fn replace_optimizer(&mut self, state: DeviceOptimizer) {
        if !matches!(self.flat.optimizer, DeviceOptimizer::None) {
            self.generation += 1;
        }
        self.flat.optimizer = state;
    }

    /// Copies `bytes` into the step-scalar buffer at `offset` (on the stream: kernels queued
    /// before read the old values).
    fn write_scalars(&mut self, offset: usize, bytes: &[u8]) -> Result<(), GpuError> {
        let range = offset..offset + bytes.len();
        self.memory.host_scalars[range.clone()].copy_from_slice(bytes);
        self.stream
            .memcpy_htod(
                &self.memory.host_scalars[range.clone()],
                &mut self.memory.step_scalars.slice_mut(range),
            )
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// The device address of the step-scalar buffer's byte `offset`.
    fn scalars_at(&self, offset: usize) -> u64 {
        address(&self.memory.step_scalars, &self.stream) + offset as u64
    }

    /// Launches the optimizer kernel of the device state over the flat buffers, with the
    /// scalars in the step-scalar buffer.
    fn launch_optimizer(&self) -> Result<(), GpuError> {
        let n = self.flat.host_grads.len();
        let (queue, config) = (self.queue(), per_element(n));
        let scalars = self.scalars_at(OPTIMIZER_OFFSET);
        let (params, grads) = (
            self.flat.params.ptr(&self.stream),
            self.flat.grads.ptr(&self.stream),
        );
        let state = |buffer| Ptr::of(buffer, &self.stream);
        match &self.flat.optimizer {
            DeviceOptimizer::None => Err(GpuError::Unsupported("an optimizer step without state")),
            DeviceOptimizer::Sgd { momentum, .. } => {
                let scalars = Ptr::from_address(scalars);
                optimizers::sgd_step(
                    &queue,
                    config,
                    params,
                    grads,
                    state(momentum),
                    n as i64,
                    scalars,
                )
            }
            DeviceOptimizer::Adam {
                exp_avg,
                exp_avg_sq,
                ..
            } => {
                let (exp_avg, exp_avg_sq) = (state(exp_avg), state(exp_avg_sq));
                let scalars = Ptr::from_address(scalars);
                optimizers::adam_step(
                    &queue, config, params, grads, exp_avg, exp_avg_sq, n as i64, scalars,
                )
            }
        }
    }

    /// Launches of our kernels on the executor's stream.
    fn queue(&self) -> Queue<'_> {
        Queue::new(&self.libraries.kernels, &self.stream)
    }

    /// The optimizer state on the device, copied to the host in the slot layout of
    /// `tandem_engine`'s optimizers (SGD: `momentum_buffer`; Adam: `exp_avg`, `exp_avg_sq`)
    /// with the steps taken, for a snapshot; `None` before the first step or load.
    pub fn optimizer_state_to_host(&self) -> Result<Option<OptimizerState>, GpuError> {
        let n = self.flat.host_grads.len();
        let download =
            |name: &str, slot: &CudaSlice<f32>| -> Result<(String, Vec<f32>), GpuError> {
                let mut values = vec![0.0; n];
                copy_to_host(
                    "optimizer state",
                    &self.stream,
                    slot.slice(..n),
                    &mut values,
                )?;
                Ok((name.to_string(), values))
            };
        Ok(match &self.flat.optimizer {
            DeviceOptimizer::None => None,
            DeviceOptimizer::Sgd { momentum, steps } => Some(OptimizerState {
                step: *steps,
                slots: vec![download("momentum_buffer", momentum)?],
            }),
            DeviceOptimizer::Adam {
                exp_avg,
                exp_avg_sq,
                steps,
            } => Some(OptimizerState {
                step: *steps,
                slots: vec![
                    download("exp_avg", exp_avg)?,
                    download("exp_avg_sq", exp_avg_sq)?,
                ],
            }),
        })
    }

    /// Makes SGD's state on the device: `steps` taken and the momentum buffer (`None`: zeros,
    /// as for SGD without momentum), e.g. from a snapshot written on either device.
    pub fn load_sgd_state(&mut self, steps: u64, momentum: Option<&[f32]>) -> Result<(), GpuError> {
        let momentum = self.upload_state("momentum_buffer", momentum)?;
        self.replace_optimizer(DeviceOptimizer::Sgd { momentum, steps });
        Ok(())
    }

    /// Makes Adam's state on the device: `steps` taken and both moments.
    pub fn load_adam_state(
        &mut self,
        steps: u64,
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> Result<(), GpuError> {
        let exp_avg = self.upload_state("exp_avg", Some(exp_avg))?;
        let exp_avg_sq = self.upload_state("exp_avg_sq", Some(exp_avg_sq))?;
        self.replace_optimizer(DeviceOptimizer::Adam {
            exp_avg,
            exp_avg_sq,
            steps,
        });
        Ok(())
    }

    /// A device copy of one optimizer slot (one value per parameter; `None`: zeros).
    fn upload_state(
        &self,
        what: &'static str,
        values: Option<&[f32]>,
    ) -> Result<CudaSlice<f32>, GpuError> {
        let n = self.flat.host_grads.len();
        match values {
            Some(values) if n > 0 => {
                same_length(what, values.len(), n)?;
                self.stream
                    .clone_htod(values)
                    .map_err(driver("cuMemcpyHtoDAsync"))
            }
            _ => self
                .stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(driver("cuMemAllocAsync")),
        }
    }

    /// Bytes of this GPU's memory in use (by every process), from `cuMemGetInfo`.
    pub fn device_memory_in_use(&self) -> Result<usize, GpuError> {
        let (free, total) = self.memory_info()?;
        Ok(total.saturating_sub(free))
    }

    /// Bytes of the GPU's memory free now (`cuMemGetInfo`).
    pub fn device_memory_free(&self) -> Result<usize, GpuError> {
        Ok(self.memory_info()?.0)
    }

    /// `cuMemGetInfo`: free and total bytes of this executor's GPU.
    fn memory_info(&self) -> Result<(usize, usize), GpuError> {
        self.bind()?;
        cudarc::driver::result::mem_get_info().map_err(driver("cuMemGetInfo_v2"))
    }

    /// Waits until the GPU has run everything queued. In a job of several GPU ranks the
    /// stream may hold NCCL collectives, so the wait counts as a wait for the peers: the
    /// launcher then tells a rank that waits for a hung peer from the hung rank.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        let _waiting = self
            .data_parallel
            .is_some()
            .then(crate::collective::peer_wait);
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }
}

/// What, besides a convolution's shape and settings, decides what cuDNN measures: the GPU's
/// name and architecture and the driver's and cuDNN's versions (the measured algorithms on
/// disk are kept per identity).
fn device_identity(
    probe: &Probe,
    context: &CudaContext,
    arch: GpuArch,
) -> Result<String, GpuError> {
    let name = context.name().map_err(driver("cuDeviceGetName"))?;
    let driver_version = &probe.require(Library::Driver)?.version;
    let cudnn_version = &probe.require(Library::Cudnn)?.version;
    Ok(format!(
        "{name} {arch} driver {driver_version} cudnn {cudnn_version}"
    ))
}

/// Whether a GPU of `arch` computes in `precision`: bfloat16 tensor cores, and cuDNN's
/// bfloat16 convolutions, start with compute capability 8.0 (Ampere).
pub fn precision_supported(precision: Precision, arch: GpuArch) -> bool {
    precision != Precision::Bf16 || arch.major >= 8
}

impl Drop for CudaExecutor {
    /// Destroys the captured graphs (they may hold the NCCL group's collectives), ends the
    /// NCCL group (its stream may still use the flat buffers, which the fields' own drops
    /// free), waits for the stream, then destroys the cuBLAS handle without panicking when
    /// the context is broken; the other fields drop after this, in order.
    fn drop(&mut self) {
        self.release_graphs();
        self.data_parallel = None;
        let healthy = self.context.bind_to_thread().is_ok() && self.stream.synchronize().is_ok();
        if healthy {
            // SAFETY: `blas` is not used after this.
            unsafe { ManuallyDrop::drop(&mut self.libraries.blas) };
        } else {
            // After a sticky error cuBLAS may refuse to destroy its handle, which cudarc's drop
            // turns into a panic that would bury the error being reported; the handle (and
            // the stream reference it holds) is given up instead.
            // SAFETY: the handle is destroyed once, here, and `blas` is never used or dropped
            // after this (its `ManuallyDrop` is not dropped again).
            let _ =
                unsafe { cudarc::cublas::result::destroy_handle(*self.libraries.blas.handle()) };
        }
    }
}

/// Checks that `images` (and `labels`) have the lengths of `plan`'s batch.
fn check_batch(plan: &Plan, images: &[f32], labels: Option<&[u32]>) -> Result<(), GpuError> {
    let channels = plan.stem.shape.in_channels;
    same_length(
        "images",
        images.len(),
        plan.batch * plan.height * plan.width * channels,
    )?;
    if let Some(labels) = labels {
        same_length("labels", labels.len(), plan.batch)?;
    }
    Ok(())
}

/// The device address of `slice`. Every launch and library call runs on the executor's one
/// stream, in order, and the executor's context tracks no events (`CudaExecutor::new`), so
/// this neither waits on nor records one (nothing that a stream capture would refuse).
fn address<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (pointer, _record) = slice.device_ptr(stream);
    pointer
}

/// The address of element `offset` of a float buffer at `base`.
fn at(base: u64, offset: usize) -> u64 {
    base + (offset * std::mem::size_of::<f32>()) as u64
}

/// Copies `source` into `target` (of its length) and waits for the copy.
fn copy_to_host(
    what: &'static str,
    stream: &Arc<CudaStream>,
    source: CudaView<'_, f32>,
    target: &mut [f32],
) -> Result<(), GpuError> {
    same_length(what, target.len(), source.len())?;
    if target.is_empty() {
        return Ok(());
    }
    stream
        .memcpy_dtoh(&source, target)
        .map_err(driver("cuMemcpyDtoHAsync"))?;
    stream.synchronize().map_err(driver("cuStreamSynchronize"))
}
