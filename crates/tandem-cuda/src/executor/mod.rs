//! The GPU executor: [`CudaExecutor`] runs a [`Plan`] of the shared network description on
//! one GPU through the [`Executor`] interface of `tandem-models`: convolutions through cuDNN
//! ([`conv`]), the linear layer through cuBLAS ([`linear`]), and our NVRTC-compiled kernels
//! for batch norm, the fused epilogue, pooling, the loss, biases and the optimizers.
//!
//! The flat parameter, gradient and running-statistic buffers live on the GPU; the host sees
//! them through [`CudaExecutor::params_to_host`] and the like, and the backward copies each
//! finished gradient range to a host mirror before reporting it (the interface's gradient-ready
//! hook hands out host values).
//!
//! The interface's methods that cannot return an error (CUDA reports most errors at a later
//! call anyway) keep the first error; every later call does nothing, and the next method that
//! returns a `Result` (and [`CudaExecutor::take_error`]) returns it.
//!
//! **Unverified on a GPU:** this compiles and its host-side pieces are tested, but it has not
//! run on a GPU (see the crate's README).

pub mod conv;
pub mod cudnn;
pub mod error;
pub mod launch;
pub mod linear;
pub mod memory;
mod step;

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use tandem_engine::{AdamConfig, BatchNormReducer, SgdConfig};
use tandem_models::executor::{Executor, GradBuffer, GradTarget, GradientsReady, Unit, UnitGrad};
use tandem_models::workspace::{Plan, Slot, UnitPlan};
use tandem_models::{Head, LossOptions, Model, ModelError};

use crate::arch::GpuArch;
use crate::compile::Compiler;
use crate::probe::{Library, Probe};
use crate::ptx_cache::PtxCache;
use conv::{AlgorithmCache, ConvBuffers};
use cudnn::CudnnHandle;
pub use error::GpuError;
use error::{driver, same_length};
use launch::{column_sums, per_element, Arg, Kernels};
use linear::LinearShape;
use memory::{row_blocks, DeviceStorage, PlanStorages, StatePart, ROWS_PER_BLOCK};

/// The math of convolutions and the linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Strict float32 (the parity tests).
    Fp32,
    /// TF32 tensor cores for convolutions and matmuls (PyTorch's default on GPUs).
    Tf32,
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

/// The optimizer state on the device, made at the first step.
enum OptimizerState {
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
    cudnn: CudnnHandle,
    blas: CudaBlas,
    kernels: Kernels,
    algorithms: AlgorithmCache,
    settings: GpuSettings,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    buffers: CudaSlice<f32>,
    optimizer: OptimizerState,
    workspace: CudaSlice<u8>,
    storages: PlanStorages,
    /// Values in the flat running-statistic buffer (its device allocation holds at least one).
    buffer_len: usize,
    /// Host copy of the gradients, filled up to `grads_on_host` in a backward.
    host_grads: Vec<f32>,
    grads_on_host: usize,
    /// The label smoothing of the last loss.
    label_smoothing: f32,
    /// The first error of a method that cannot return one.
    error: RefCell<Option<GpuError>>,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
}

impl CudaExecutor {
    /// Opens GPU `settings.ordinal`, compiles our kernels (with the PTX cache in `cache`) and
    /// copies `params` and `buffers` (a model's flat buffers) to it. Every library it calls
    /// must have been found by `probe`: a missing one is an error naming it, never a panic.
    pub fn new(
        probe: &Probe,
        settings: GpuSettings,
        cache: Option<PtxCache>,
        params: &[f32],
        buffers: &[f32],
    ) -> Result<Self, GpuError> {
        for library in [
            Library::Driver,
            Library::Nvrtc,
            Library::Cublas,
            Library::Cudnn,
        ] {
            probe.require(library)?;
        }
        let context = CudaContext::new(settings.ordinal).map_err(driver("CudaContext::new"))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(driver("cuDeviceGetAttribute(compute capability)"))?;
        let arch = GpuArch {
            major: major as u32,
            minor: minor as u32,
        };
        let compiler = Compiler::new(probe, arch, cache)?;
        let kernels = Kernels::load(&context, &compiler)?;
        let stream = context.default_stream();
        let cudnn = CudnnHandle::new(&stream)?;
        let blas = CudaBlas::new(stream.clone()).map_err(error::cublas("cublasCreate_v2"))?;
        linear::set_math_mode(&blas, settings.precision)?;
        let upload = |values: &[f32]| -> Result<CudaSlice<f32>, GpuError> {
            if values.is_empty() {
                stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))
            } else {
                stream
                    .clone_htod(values)
                    .map_err(driver("cuMemcpyHtoDAsync"))
            }
        };
        Ok(CudaExecutor {
            cudnn,
            blas,
            kernels,
            algorithms: AlgorithmCache::default(),
            settings,
            params: upload(params)?,
            grads: upload(&vec![0.0; params.len()])?,
            buffers: upload(buffers)?,
            optimizer: OptimizerState::None,
            buffer_len: buffers.len(),
            workspace: stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?,
            storages: PlanStorages::default(),
            host_grads: vec![0.0; params.len()],
            grads_on_host: 0,
            label_smoothing: 0.0,
            error: RefCell::new(None),
            stream,
            context,
        })
    }

    /// Makes the GPU current on this thread, allocates the storage of `plan` (one training
    /// and one evaluation storage are kept, each while its batch shape stays) and measures the algorithms of its convolutions.
    pub fn prepare(&mut self, plan: &Plan) -> Result<(), GpuError> {
        self.context
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        self.storages.activate(&self.stream, plan)?;
        let mut workspace = 0;
        for unit in plan.unit_plans() {
            let measured = self.algorithms.get_or_measure(
                &self.cudnn,
                &unit.shape,
                self.settings.precision,
                self.settings.deterministic,
            )?;
            workspace = workspace.max(measured.workspace_bytes());
        }
        if workspace > self.workspace.len() {
            self.workspace = self
                .stream
                .alloc_zeros(workspace)
                .map_err(driver("cuMemAllocAsync"))?;
        }
        Ok(())
    }

    /// Returns (and clears) the first error kept by a method that could not return it.
    pub fn take_error(&self) -> Result<(), GpuError> {
        match self.error.borrow_mut().take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
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
        check_batch(plan, images, Some(labels)).map_err(device)?;
        self.prepare(plan).map_err(device)?;
        self.images_from_host(images);
        model.forward_on(self, plan, bn_sync)?;
        let value = self.loss_forward(labels, loss.label_smoothing)?;
        self.take_error().map_err(device)?;
        Ok(value)
    }

    /// An evaluation forward of `images`; the logits go to `logits`.
    pub fn forward_eval(
        &mut self,
        model: &Model,
        plan: &Plan,
        images: &[f32],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        check_batch(plan, images, None).map_err(device)?;
        self.prepare(plan).map_err(device)?;
        self.images_from_host(images);
        model.forward_on(self, plan, None)?;
        self.logits_to_host(logits);
        self.take_error().map_err(device)
    }

    /// The backward of the last [`CudaExecutor::forward_train`]: adds the gradients of
    /// `loss_scale · loss` to the device gradients and reports each finished range (with
    /// its host values) to `grad_ready`.
    pub fn backward(
        &mut self,
        model: &Model,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: &mut dyn FnMut(std::ops::Range<usize>, &[f32]),
    ) -> Result<(), ModelError> {
        self.context
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))
            .map_err(device)?;
        self.grads_on_host = 0;
        let mut ready = GradientsReady::new(grad_ready);
        model.backward_on(self, plan, loss_scale, bn_sync, &mut ready)?;
        self.take_error().map_err(device)
    }

    /// Sets every device gradient to zero.
    pub fn zero_grads(&mut self) -> Result<(), GpuError> {
        self.stream
            .memset_zeros(&mut self.grads)
            .map_err(driver("cuMemsetD8Async"))
    }

    /// Copies the device parameters into `params`.
    pub fn params_to_host(&self, params: &mut [f32]) -> Result<(), GpuError> {
        copy_to_host("parameters", &self.stream, &self.params, params)
    }

    /// Copies the device gradients into `grads`.
    pub fn grads_to_host(&self, grads: &mut [f32]) -> Result<(), GpuError> {
        copy_to_host("gradients", &self.stream, &self.grads, grads)
    }

    /// Copies the device running statistics into `buffers`.
    pub fn buffers_to_host(&self, buffers: &mut [f32]) -> Result<(), GpuError> {
        copy_to_host("running statistics", &self.stream, &self.buffers, buffers)
    }

    /// Replaces the device parameters and running statistics (a checkpoint, a broadcast).
    pub fn params_from_host(&mut self, params: &[f32], buffers: &[f32]) -> Result<(), GpuError> {
        same_length("parameters", params.len(), self.host_grads.len())?;
        same_length("running statistics", buffers.len(), self.buffer_len)?;
        if !params.is_empty() {
            self.stream
                .memcpy_htod(params, &mut self.params.slice_mut(..params.len()))
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        if !buffers.is_empty() {
            self.stream
                .memcpy_htod(buffers, &mut self.buffers.slice_mut(..buffers.len()))
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        Ok(())
    }

    /// Replaces the device gradients (e.g. by gradients all-reduced on the host).
    pub fn grads_from_host(&mut self, grads: &[f32]) -> Result<(), GpuError> {
        same_length("gradients", grads.len(), self.host_grads.len())?;
        if grads.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_htod(grads, &mut self.grads.slice_mut(..grads.len()))
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// One step of PyTorch's SGD over the flat device buffers (`sgd_step`, bit-identical to
    /// the CPU's `Sgd` per element).
    pub fn sgd_step(&mut self, config: &SgdConfig) -> Result<(), GpuError> {
        let n = self.host_grads.len();
        if !matches!(self.optimizer, OptimizerState::Sgd { .. }) {
            let momentum = self
                .stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(driver("cuMemAllocAsync"))?;
            self.optimizer = OptimizerState::Sgd { momentum, steps: 0 };
        }
        let OptimizerState::Sgd { momentum, steps } = &mut self.optimizer else {
            return Err(GpuError::Unsupported("an optimizer state of another kind"));
        };
        let args = [
            Arg::Ptr(address(&self.params, &self.stream)),
            Arg::Ptr(address(&self.grads, &self.stream)),
            Arg::Ptr(address(momentum, &self.stream)),
            Arg::I64(n as i64),
            Arg::F32(config.lr),
            Arg::F32(config.momentum),
            Arg::F32(config.dampening),
            Arg::F32(config.weight_decay),
            Arg::I32(i32::from(config.nesterov)),
            Arg::I32(i32::from(*steps == 0)),
        ];
        *steps += 1;
        // SAFETY: sgd_step(float*, const float*, float*, long long, float x4, int, int); the
        // three buffers hold n floats each.
        unsafe {
            self.kernels
                .launch(&self.stream, "sgd_step", per_element(n), &args)
        }
    }

    /// One step of PyTorch's Adam or AdamW over the flat device buffers; the scalars are
    /// computed on the host in double as the CPU's `Adam` does.
    pub fn adam_step(&mut self, config: &AdamConfig) -> Result<(), GpuError> {
        let n = self.host_grads.len();
        if !matches!(self.optimizer, OptimizerState::Adam { .. }) {
            let alloc = || self.stream.alloc_zeros::<f32>(n.max(1));
            let exp_avg = alloc().map_err(driver("cuMemAllocAsync"))?;
            let exp_avg_sq = alloc().map_err(driver("cuMemAllocAsync"))?;
            self.optimizer = OptimizerState::Adam {
                exp_avg,
                exp_avg_sq,
                steps: 0,
            };
        }
        let OptimizerState::Adam {
            exp_avg,
            exp_avg_sq,
            steps,
        } = &mut self.optimizer
        else {
            return Err(GpuError::Unsupported("an optimizer state of another kind"));
        };
        *steps += 1;
        let scalars = AdamScalars::new(config, *steps);
        let args = [
            Arg::Ptr(address(&self.params, &self.stream)),
            Arg::Ptr(address(&self.grads, &self.stream)),
            Arg::Ptr(address(exp_avg, &self.stream)),
            Arg::Ptr(address(exp_avg_sq, &self.stream)),
            Arg::I64(n as i64),
            Arg::F32(scalars.step_size),
            Arg::F32(config.beta2),
            Arg::F32(scalars.bias_correction2_sqrt),
            Arg::F32(config.eps),
            Arg::F32(config.weight_decay),
            Arg::F32(scalars.decay_factor),
            Arg::F32(scalars.lerp_weight),
            Arg::F32(scalars.sq_weight),
            Arg::I32(i32::from(config.decoupled)),
        ];
        // SAFETY: adam_step's 14 parameters in order; the four buffers hold n floats each.
        unsafe {
            self.kernels
                .launch(&self.stream, "adam_step", per_element(n), &args)
        }
    }

    /// Bytes of this GPU's memory in use (by every process), from `cuMemGetInfo`.
    pub fn device_memory_in_use(&self) -> Result<usize, GpuError> {
        self.context
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let (free, total) =
            cudarc::driver::result::mem_get_info().map_err(driver("cuMemGetInfo_v2"))?;
        Ok(total.saturating_sub(free))
    }

    /// Waits until the GPU has run everything queued.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }
}

/// Adam's host-computed scalars at step `step` (1-based), in double as the CPU's `Adam`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
    /// `1 - lr * weight_decay` (AdamW).
    pub decay_factor: f32,
    /// `1 - beta1`.
    pub lerp_weight: f32,
    /// `1 - beta2`.
    pub sq_weight: f32,
}

impl AdamScalars {
    /// The scalars of `config` at step `step`.
    pub fn new(config: &AdamConfig, step: u64) -> Self {
        let lr = f64::from(config.lr);
        let bias_correction1 = 1.0 - f64::from(config.beta1).powf(step as f64);
        let bias_correction2 = 1.0 - f64::from(config.beta2).powf(step as f64);
        AdamScalars {
            step_size: (lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            decay_factor: (1.0 - lr * f64::from(config.weight_decay)) as f32,
            lerp_weight: (1.0 - f64::from(config.beta1)) as f32,
            sq_weight: (1.0 - f64::from(config.beta2)) as f32,
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

/// A GPU error as the models crate's error.
fn device(error: GpuError) -> ModelError {
    ModelError::Device(Box::new(error))
}

/// The device address of `slice`. Every launch and library call runs on the executor's one
/// stream, in order, so the event `cudarc` records for cross-stream use is not needed.
fn address<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (pointer, _record) = slice.device_ptr(stream);
    pointer
}

/// The address of element `offset` of a float buffer at `base`.
fn at(base: u64, offset: usize) -> u64 {
    base + (offset * std::mem::size_of::<f32>()) as u64
}

fn copy_to_host(
    what: &'static str,
    stream: &Arc<CudaStream>,
    source: &CudaSlice<f32>,
    target: &mut [f32],
) -> Result<(), GpuError> {
    same_length(what, target.len(), source.len())?;
    if target.is_empty() {
        return Ok(());
    }
    stream
        .memcpy_dtoh(&source.slice(..target.len()), target)
        .map_err(driver("cuMemcpyDtoHAsync"))?;
    stream.synchronize().map_err(driver("cuStreamSynchronize"))
}

/// The addresses of one plan's storage, copied out so that launches borrow nothing.
struct Addresses<'a> {
    storage: &'a DeviceStorage,
    stream: &'a CudaStream,
}

impl Addresses<'_> {
    fn slot(&self, slot: Slot) -> u64 {
        address(&self.storage.slots[slot], self.stream)
    }
    fn grad(&self, buffer: GradBuffer) -> u64 {
        address(&self.storage.grads[buffer.0], self.stream)
    }
    fn state(&self, unit: &UnitPlan, part: StatePart) -> u64 {
        let offset = self.storage.sizes.bn_state.offset(unit.index, part);
        at(address(&self.storage.bn_state, self.stream), offset)
    }
}

impl CudaExecutor {
    /// Runs `work` unless an error is kept, and keeps its error.
    fn run(&mut self, work: impl FnOnce(&mut Self) -> Result<(), GpuError>) {
        if self.error.borrow().is_some() {
            return;
        }
        if let Err(error) = work(self) {
            *self.error.borrow_mut() = Some(error);
        }
    }

    /// The kept error, if any, as the models crate's error.
    fn kept(&self) -> Result<(), ModelError> {
        self.take_error().map_err(device)
    }

    fn storage(&self) -> Result<&DeviceStorage, GpuError> {
        self.storages.active().ok_or(GpuError::NotPrepared)
    }

    fn addresses(&self) -> Result<Addresses<'_>, GpuError> {
        Ok(Addresses {
            storage: self.storage()?,
            stream: &self.stream,
        })
    }

    /// `launch` of the executor's kernels on its stream.
    ///
    /// # Safety
    /// As [`Kernels::launch`].
    unsafe fn launch(
        &self,
        name: &'static str,
        config: cudarc::driver::LaunchConfig,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.kernels.launch(&self.stream, name, config, args) }
    }

    /// `totals = [rows, Σx…, Σx²…]` of the `[rows, channels]` tensor at `values`, in the
    /// fixed two-pass order of `batchnorm.cu`.
    fn column_totals(&self, values: u64, rows: usize, channels: usize) -> Result<(), GpuError> {
        let addresses = self.addresses()?;
        let (partials, totals) = (
            address(&addresses.storage.partials, &self.stream),
            address(&addresses.storage.totals, &self.stream),
        );
        let blocks = row_blocks(rows);
        // SAFETY: bn_stats_partial(const float*, int, int, int, double*): `values` holds
        // rows * channels floats; partials holds at least blocks * 2 * channels doubles
        // (StorageSizes::partials is the maximum over the plan).
        unsafe {
            self.launch(
                "bn_stats_partial",
                column_sums(channels, blocks),
                &[
                    Arg::Ptr(values),
                    Arg::I32(rows as i32),
                    Arg::I32(channels as i32),
                    Arg::I32(ROWS_PER_BLOCK as i32),
                    Arg::Ptr(partials),
                ],
            )?;
            // SAFETY: bn_stats_finish(const double*, int, int, int, double*): totals holds
            // 1 + 2 * channels doubles.
            self.launch(
                "bn_stats_finish",
                per_element(channels),
                &[
                    Arg::Ptr(partials),
                    Arg::I32(blocks as i32),
                    Arg::I32(rows as i32),
                    Arg::I32(channels as i32),
                    Arg::Ptr(totals),
                ],
            )
        }
    }

    /// `grad_bias += column sums of the [rows, channels] gradient at values`.
    fn bias_gradient(
        &self,
        values: u64,
        rows: usize,
        channels: usize,
        grad_bias: u64,
    ) -> Result<(), GpuError> {
        self.column_totals(values, rows, channels)?;
        let totals = address(&self.storage()?.totals, &self.stream);
        // SAFETY: add_channel_sums(const double*, int, float*): totals as bn_stats_finish
        // wrote them; grad_bias holds `channels` floats.
        unsafe {
            self.launch(
                "add_channel_sums",
                per_element(channels),
                &[
                    Arg::Ptr(totals),
                    Arg::I32(channels as i32),
                    Arg::Ptr(grad_bias),
                ],
            )
        }
    }

    /// `values[i] += bias[i % channels]` over `n` floats.
    fn bias_add(&self, values: u64, bias: u64, n: usize, channels: usize) -> Result<(), GpuError> {
        // SAFETY: bias_add(float*, const float*, long long, int); `values` holds n floats and
        // `bias` `channels` floats.
        unsafe {
            self.launch(
                "bias_add",
                per_element(n),
                &[
                    Arg::Ptr(values),
                    Arg::Ptr(bias),
                    Arg::I64(n as i64),
                    Arg::I32(channels as i32),
                ],
            )
        }
    }

    /// `output slot = conv(input slot) [+ bias]`.
    fn conv_forward(&mut self, unit: Unit, output: Slot) -> Result<(), GpuError> {
        let shape = unit.plan.shape;
        let (input, output_address, params, workspace) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(unit.plan.input),
                addresses.slot(output),
                address(&self.params, &self.stream),
                address(&self.workspace, &self.stream),
            )
        };
        let workspace_len = self.workspace.len();
        let plan = self.algorithms.get_or_measure(
            &self.cudnn,
            &shape,
            self.settings.precision,
            self.settings.deterministic,
        )?;
        plan.forward(
            &self.cudnn,
            &ConvBuffers {
                input,
                filter: at(params, unit.conv.weight.start),
                output: output_address,
                workspace: (workspace, workspace_len),
            },
        )?;
        if let Some(bias) = &unit.conv.bias {
            let bias = at(params, bias.start);
            self.bias_add(output_address, bias, shape.output_len(), shape.out_channels)?;
        }
        Ok(())
    }

    /// Copies the device gradients up to `end` to the host mirror and reports them.
    fn report(&mut self, end: usize, ready: &mut GradientsReady) -> Result<(), GpuError> {
        if end > self.grads_on_host {
            let range = self.grads_on_host..end;
            self.stream
                .memcpy_dtoh(
                    &self.grads.slice(range.clone()),
                    &mut self.host_grads[range],
                )
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            self.synchronize()?;
            self.grads_on_host = end;
        }
        ready.finished_up_to(end, &self.host_grads);
        Ok(())
    }

    /// Sums `totals[..len]` across processes through the host.
    fn reduce_totals(
        &mut self,
        len: usize,
        reducer: &mut dyn BatchNormReducer,
    ) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.storages.active_mut() else {
            return Err(GpuError::NotPrepared);
        };
        storage.host_totals.resize(len, 0.0);
        stream
            .memcpy_dtoh(&storage.totals.slice(..len), &mut storage.host_totals[..])
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        reducer
            .all_reduce_sum(&mut storage.host_totals)
            .map_err(|error| GpuError::BatchNormSync(error.to_string()))?;
        stream
            .memcpy_htod(
                &storage.host_totals[..],
                &mut storage.totals.slice_mut(..len),
            )
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// The training forward of a unit (see [`Executor::conv_bn_statistics`]).
    fn unit_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        let plan = unit.plan;
        let channels = plan.shape.out_channels;
        let rows = plan.shape.output_len() / channels.max(1);
        self.conv_forward(unit, plan.z).map_err(device)?;
        let z = self.addresses().map_err(device)?.slot(plan.z);
        self.column_totals(z, rows, channels).map_err(device)?;
        let count = match reducer {
            Some(reducer) => {
                self.reduce_totals(1 + 2 * channels, reducer)
                    .map_err(device)?;
                self.storage().map_err(device)?.host_totals[0]
            }
            None => rows as f64,
        };
        if count <= 1.0 {
            return Err(tandem_engine::EngineError::BatchNormTooFewValues { count }.into());
        }
        if let Some(storage) = self.storages.active_mut() {
            storage.counts[plan.index] = count;
        }
        let addresses = self.addresses().map_err(device)?;
        let (params, buffers) = (
            address(&self.params, &self.stream),
            address(&self.buffers, &self.stream),
        );
        let bn = unit.bn;
        let args = [
            Arg::Ptr(address(&addresses.storage.totals, &self.stream)),
            Arg::I32(channels as i32),
            Arg::Ptr(at(params, bn.weight.start)),
            Arg::Ptr(at(params, bn.bias.start)),
            Arg::Ptr(at(buffers, bn.running_mean.start)),
            Arg::Ptr(at(buffers, bn.running_var.start)),
            Arg::Ptr(addresses.state(plan, StatePart::Mean)),
            Arg::Ptr(addresses.state(plan, StatePart::InvStd)),
            Arg::Ptr(addresses.state(plan, StatePart::Scale)),
            Arg::Ptr(addresses.state(plan, StatePart::Shift)),
        ];
        // SAFETY: bn_train_coefficients' ten parameters in order; every per-channel pointer
        // addresses `channels` floats (the layer's ranges and the unit's state).
        unsafe { self.launch("bn_train_coefficients", per_element(channels), &args) }
            .map_err(device)
    }

    /// The backward of a unit (see [`Executor::conv_bn_backward`]).
    fn unit_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: GradTarget,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), GpuError> {
        let (conv, bn, plan) = (unit.conv, unit.bn, unit.plan);
        let channels = plan.shape.out_channels;
        let len = plan.output_len();
        let rows = len / channels.max(1);
        let blocks = row_blocks(rows);
        let (params, grads) = (
            address(&self.params, &self.stream),
            address(&self.grads, &self.stream),
        );
        let (dy, relu_out, z, mean, invstd, partials, totals, dz) = {
            let addresses = self.addresses()?;
            (
                addresses.grad(grad_output.values),
                grad_output
                    .relu_output
                    .map_or(0, |slot| addresses.slot(slot)),
                addresses.slot(plan.z),
                addresses.state(plan, StatePart::Mean),
                addresses.state(plan, StatePart::InvStd),
                address(&addresses.storage.partials, &self.stream),
                address(&addresses.storage.totals, &self.stream),
                address(&addresses.storage.dz, &self.stream),
            )
        };
        // SAFETY: bn_backward_partial(const float* x5, int, int, int, double*): dy, relu_out
        // (or null), z hold `len` floats, mean and invstd `channels`; partials holds
        // blocks * 2 * channels doubles. bn_backward_finish(const double*, int, int, double*,
        // float*, float*): the gradient ranges hold `channels` floats.
        unsafe {
            self.launch(
                "bn_backward_partial",
                column_sums(channels, blocks),
                &[
                    Arg::Ptr(dy),
                    Arg::Ptr(relu_out),
                    Arg::Ptr(z),
                    Arg::Ptr(mean),
                    Arg::Ptr(invstd),
                    Arg::I32(rows as i32),
                    Arg::I32(channels as i32),
                    Arg::I32(ROWS_PER_BLOCK as i32),
                    Arg::Ptr(partials),
                ],
            )?;
            self.launch(
                "bn_backward_finish",
                per_element(channels),
                &[
                    Arg::Ptr(partials),
                    Arg::I32(blocks as i32),
                    Arg::I32(channels as i32),
                    Arg::Ptr(totals),
                    Arg::Ptr(at(grads, bn.weight.start)),
                    Arg::Ptr(at(grads, bn.bias.start)),
                ],
            )?;
        }
        if let Some(reducer) = reducer {
            self.reduce_totals(2 * channels, reducer)?;
        }
        self.report(bn.param_range().end, ready)?;
        let (count, coefficients) = {
            let storage = self.storage()?;
            (
                storage.counts[plan.index],
                address(&storage.coefficients, &self.stream),
            )
        };
        // SAFETY: bn_backward_coefficients(const double*, double, int, const float*, const
        // float*, float*): coefficients holds 3 * channels floats. bn_backward_input(const
        // float* x6, long long, int, float*): dz holds at least `len` floats (grad_len).
        unsafe {
            self.launch(
                "bn_backward_coefficients",
                per_element(channels),
                &[
                    Arg::Ptr(totals),
                    Arg::F64(count),
                    Arg::I32(channels as i32),
                    Arg::Ptr(at(params, bn.weight.start)),
                    Arg::Ptr(invstd),
                    Arg::Ptr(coefficients),
                ],
            )?;
            self.launch(
                "bn_backward_input",
                per_element(len),
                &[
                    Arg::Ptr(dy),
                    Arg::Ptr(relu_out),
                    Arg::Ptr(z),
                    Arg::Ptr(mean),
                    Arg::Ptr(invstd),
                    Arg::Ptr(coefficients),
                    Arg::I64(len as i64),
                    Arg::I32(channels as i32),
                    Arg::Ptr(dz),
                ],
            )?;
        }
        if let Some(bias) = &conv.bias {
            self.bias_gradient(dz, rows, channels, at(grads, bias.start))?;
        }
        let input = self.addresses()?.slot(plan.input);
        let target = match grad_input {
            GradTarget::Skip => None,
            GradTarget::Overwrite(buffer) => Some((self.addresses()?.grad(buffer), false)),
            GradTarget::Accumulate(buffer) => Some((self.addresses()?.grad(buffer), true)),
        };
        let workspace = (address(&self.workspace, &self.stream), self.workspace.len());
        let conv_plan = self.algorithms.get_or_measure(
            &self.cudnn,
            &plan.shape,
            self.settings.precision,
            self.settings.deterministic,
        )?;
        conv_plan.backward_filter(
            &self.cudnn,
            &ConvBuffers {
                input,
                filter: at(grads, conv.weight.start),
                output: dz,
                workspace,
            },
        )?;
        if let Some((grad_input, accumulate)) = target {
            conv_plan.backward_data(
                &self.cudnn,
                &ConvBuffers {
                    input: grad_input,
                    filter: at(params, conv.weight.start),
                    output: dz,
                    workspace,
                },
                accumulate,
            )?;
        }
        self.report(conv.param_range().end, ready)
    }

    /// The head's backward (see [`Executor::head_backward`]).
    fn head_gradients(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
    ) -> Result<(), GpuError> {
        let batch = self.storage()?.labels.len();
        let classes = head.classes;
        let shape = LinearShape {
            batch,
            inputs: head.in_features,
            outputs: classes,
        };
        let (params, grads) = (
            address(&self.params, &self.stream),
            address(&self.grads, &self.stream),
        );
        let (probabilities, labels, grad_logits, pooled, grad_pooled, into_address, smoothing) = {
            let addresses = self.addresses()?;
            let storage = addresses.storage;
            (
                address(&storage.probabilities, &self.stream),
                address(&storage.labels, &self.stream),
                address(&storage.grad_logits, &self.stream),
                address(&storage.pooled, &self.stream),
                address(&storage.grad_pooled, &self.stream),
                addresses.grad(into),
                self.label_smoothing,
            )
        };
        // SAFETY: cross_entropy_backward(const float*, const unsigned*, int, int, float,
        // float, float*): probabilities and grad_logits hold batch * classes floats.
        unsafe {
            self.launch(
                "cross_entropy_backward",
                per_element(batch * classes),
                &[
                    Arg::Ptr(probabilities),
                    Arg::Ptr(labels),
                    Arg::I32(batch as i32),
                    Arg::I32(classes as i32),
                    Arg::F32(smoothing),
                    Arg::F32(loss_scale),
                    Arg::Ptr(grad_logits),
                ],
            )?;
        }
        // SAFETY: pooled is [batch, inputs], grad_logits [batch, outputs], the weight
        // gradient range [outputs, inputs], as the GEMMs address them.
        unsafe {
            linear::run(
                &self.blas,
                &shape.weight_gradient()?,
                pooled,
                grad_logits,
                at(grads, head.weight.start),
            )?;
        }
        self.bias_gradient(grad_logits, batch, classes, at(grads, head.bias.start))?;
        // SAFETY: the weight is [outputs, inputs]; grad_pooled holds batch * inputs floats.
        unsafe {
            linear::run(
                &self.blas,
                &shape.input_gradient()?,
                at(params, head.weight.start),
                grad_logits,
                grad_pooled,
            )?;
        }
        self.report(head.bias.end, ready)?;
        let pixels = features.shape.out_height() * features.shape.out_width();
        // SAFETY: average_pool_backward(const float*, int, int, int, float*): the target
        // buffer holds batch * pixels * channels floats (the features' length ≤ grad_len).
        unsafe {
            self.launch(
                "average_pool_backward",
                per_element(features.output_len()),
                &[
                    Arg::Ptr(grad_pooled),
                    Arg::I32(batch as i32),
                    Arg::I32(pixels as i32),
                    Arg::I32(head.in_features as i32),
                    Arg::Ptr(into_address),
                ],
            )
        }
    }
}
