//! The GPU work of the units and the head that the [`Executor`] methods of `step.rs` run:
//! a unit's convolution and batch-norm statistics, its backward, the head's backward, and the
//! column sums and biases they share; plus the plumbing of device addresses and kept errors.

use cudarc::driver::{CudaStream, LaunchConfig};
use tandem_engine::shape::Conv2dShape;
use tandem_engine::BatchNormReducer;
use tandem_models::executor::{GradBuffer, GradTarget, GradientsReady, Unit, UnitGrad};
use tandem_models::workspace::{Slot, UnitPlan};
use tandem_models::{Head, ModelError};

use super::autocast::{ConvBackward, GemmOperand, Role};
use super::conv::{ConvBuffers, ConvPlan};
use super::error::driver;
#[cfg(doc)]
use super::launch::Kernels;
use super::launch::{column_sums, per_element, Arg};
use super::launch::{row_blocks, ROWS_PER_BLOCK};
use super::linear::LinearShape;
use super::memory::{Activations, DeviceStorage, StatePart};
use super::{address, at, device, CudaExecutor, GpuError};
#[cfg(doc)]
use tandem_models::executor::Executor;

/// The addresses of one plan's storage, copied out so that launches borrow nothing.
pub(super) struct Addresses<'a> {
    pub(super) storage: &'a DeviceStorage,
    pub(super) stream: &'a CudaStream,
}

impl Addresses<'_> {
    pub(super) fn slot(&self, slot: Slot) -> u64 {
        self.storage.slots[slot].address(self.stream)
    }
    /// Whether `unit` reads the images, float32 whatever the activations.
    pub(super) fn reads_images(&self, unit: &UnitPlan) -> bool {
        unit.index == self.storage.image_reader
    }
    pub(super) fn grad(&self, buffer: GradBuffer) -> u64 {
        self.storage.grads[buffer.0].address(self.stream)
    }
    pub(super) fn state(&self, unit: &UnitPlan, part: StatePart) -> u64 {
        let offset = self.storage.sizes.bn_state.offset(unit.index, part);
        at(address(&self.storage.bn_state, self.stream), offset)
    }
}

/// Where `bn_stats` writes a batch norm's training coefficients and updates its running
/// statistics (device addresses of `channels` floats each).
pub(super) struct TrainCoefficients {
    pub(super) weight: u64,
    pub(super) bias: u64,
    pub(super) running_mean: u64,
    pub(super) running_var: u64,
    pub(super) mean: u64,
    pub(super) invstd: u64,
    pub(super) scale: u64,
    pub(super) shift: u64,
}

impl TrainCoefficients {
    /// The eight pointers as the kernels take them (`weight, bias, running_mean, running_var,
    /// mean, invstd, scale, shift`).
    fn args(&self) -> [Arg; 8] {
        [
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.mean,
            self.invstd,
            self.scale,
            self.shift,
        ]
        .map(Arg::Ptr)
    }
}

impl CudaExecutor {
    /// Runs `work` unless an error is kept, and keeps its error.
    pub(super) fn run(&mut self, work: impl FnOnce(&mut Self) -> Result<(), GpuError>) {
        if self.error.borrow().is_some() {
            return;
        }
        if let Err(error) = work(self) {
            *self.error.borrow_mut() = Some(error);
        }
    }

    /// The kept error, if any, as the models crate's error.
    pub(super) fn kept(&self) -> Result<(), ModelError> {
        self.take_error().map_err(device)
    }

    pub(super) fn storage(&self) -> Result<&DeviceStorage, GpuError> {
        self.storages.active().ok_or(GpuError::NotPrepared)
    }

    /// The kernel `name` for the active plan's activations (its `_bf16` twin for bfloat16).
    pub(super) fn activation_kernel(&self, name: &'static str) -> Result<&'static str, GpuError> {
        self.storage()?.sizes.activations.kernel(name)
    }

    pub(super) fn addresses(&self) -> Result<Addresses<'_>, GpuError> {
        Ok(Addresses {
            storage: self.storage()?,
            stream: &self.stream,
        })
    }

    /// `launch` of the executor's kernels on its stream.
    ///
    /// # Safety
    /// As [`Kernels::launch`].
    pub(super) unsafe fn launch(
        &self,
        name: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.kernels.launch(&self.stream, name, config, args) }
    }

    /// `totals = [rows, Σx…, Σx²…]` of the `[rows, channels]` tensor of `kind` at `values`, in the
    /// fixed two-pass order of `batchnorm.cu`, in one launch; with `coefficients`, also a
    /// batch norm's training coefficients and running statistics from those totals.
    pub(super) fn column_totals(
        &self,
        values: u64,
        kind: Activations,
        rows: usize,
        channels: usize,
        coefficients: Option<&TrainCoefficients>,
    ) -> Result<(), GpuError> {
        let addresses = self.addresses()?;
        let storage = addresses.storage;
        let [weight, bias, running_mean, running_var, mean, invstd, scale, shift] =
            coefficients.map_or([Arg::Ptr(0); 8], TrainCoefficients::args);
        // SAFETY: bn_stats(_bf16)(const Act*, int, int, int, double*, unsigned int*, double*,
        // const float* x2, float* x6): `values` holds rows * channels values of `kind`; partials holds at
        // least row_blocks * 2 * channels doubles and arrivals one zero per channel group
        // (StorageSizes: the maxima over the plan); totals holds 1 + 2 * channels doubles;
        // each coefficient pointer addresses `channels` floats, or all are null.
        unsafe {
            self.launch(
                kind.kernel("bn_stats")?,
                column_sums(channels, row_blocks(rows)),
                &[
                    Arg::Ptr(values),
                    Arg::I32(rows as i32),
                    Arg::I32(channels as i32),
                    Arg::I32(ROWS_PER_BLOCK as i32),
                    Arg::Ptr(address(&storage.partials, &self.stream)),
                    Arg::Ptr(address(&storage.arrivals, &self.stream)),
                    Arg::Ptr(address(&storage.totals, &self.stream)),
                    weight,
                    bias,
                    running_mean,
                    running_var,
                    mean,
                    invstd,
                    scale,
                    shift,
                ],
            )
        }
    }

    /// `grad_bias += column sums of the [rows, channels] gradient at values` (of `kind`).
    pub(super) fn bias_gradient(
        &self,
        values: u64,
        kind: Activations,
        rows: usize,
        channels: usize,
        grad_bias: u64,
    ) -> Result<(), GpuError> {
        self.column_totals(values, kind, rows, channels, None)?;
        let totals = address(&self.storage()?.totals, &self.stream);
        // SAFETY: add_channel_sums(const double*, int, float*): totals as bn_stats wrote
        // them; grad_bias holds `channels` floats.
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

    /// `values[i] += bias[i % channels]` over `n` values of `kind`.
    pub(super) fn bias_add(
        &self,
        values: u64,
        kind: Activations,
        bias: u64,
        n: usize,
        channels: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: bias_add(_bf16)(float* or bf16_bits*, const float*, long long, int); `values`
        // holds n values of `kind` and `bias` `channels` floats.
        unsafe {
            self.launch(
                kind.kernel("bias_add")?,
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

    /// The plan of the convolution of `shape` under the executor's settings, which
    /// [`CudaExecutor::prepare`] measured for every convolution of the active plan.
    pub(super) fn conv_plan(&self, shape: &Conv2dShape) -> Result<&ConvPlan, GpuError> {
        self.algorithms
            .get(shape, self.settings.algorithms())
            .ok_or(GpuError::NotPrepared)
    }

    /// `output slot = conv(input slot) [+ bias]`.
    pub(super) fn conv_forward(&mut self, unit: Unit, output: Slot) -> Result<(), GpuError> {
        let shape = unit.plan.shape;
        let (input, input_is_f32, output_address, params, workspace) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(unit.plan.input),
                addresses.reads_images(unit.plan),
                addresses.slot(output),
                self.params.address(&self.stream),
                address(&self.workspace, &self.stream),
            )
        };
        let workspace_len = self.workspace.len();
        let plan = self.conv_plan(&shape)?;
        self.convolve_forward(
            plan,
            &shape,
            &ConvBuffers {
                input,
                filter: at(params, unit.conv.weight.start),
                output: output_address,
                workspace: (workspace, workspace_len),
            },
            input_is_f32,
        )?;
        if let Some(bias) = &unit.conv.bias {
            let bias = at(params, bias.start);
            let kind = self.storage()?.sizes.activations;
            self.bias_add(
                output_address,
                kind,
                bias,
                shape.output_len(),
                shape.out_channels,
            )?;
        }
        Ok(())
    }

    /// Copies the device gradients up to `end` to the (page-locked) host gradients and
    /// reports them, when this backward has a hook to report to; in a backward that
    /// all-reduces through NCCL, queues the buckets that are now complete instead (nothing
    /// crosses to the host).
    pub(super) fn report(
        &mut self,
        end: usize,
        ready: &mut GradientsReady,
    ) -> Result<(), GpuError> {
        if self.all_reducing {
            return self.all_reduce_finished(end);
        }
        if !self.gradients_to_host {
            return Ok(());
        }
        if end > self.grads_on_host {
            let range = self.grads_on_host..end;
            let host = self.host_grads.values(&self.context)?;
            self.stream
                .memcpy_dtoh(&self.grads.view(range.clone()), &mut host[range])
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            self.synchronize()?;
            self.grads_on_host = end;
        }
        ready.finished_up_to(end, self.host_grads.values(&self.context)?);
        Ok(())
    }

    /// How this training pass sums batch-norm totals over the processes: through `reducer`
    /// (the host) when there is one, else through NCCL when the executor syncs batch norm on
    /// the device, else not at all.
    fn totals_sync<'a>(&self, reducer: Option<&'a mut dyn BatchNormReducer>) -> TotalsSync<'a> {
        match (reducer, self.batch_norm_world()) {
            (Some(reducer), _) => TotalsSync::Host(reducer),
            (None, Some(world_size)) => TotalsSync::Nccl { world_size },
            (None, None) => TotalsSync::Local,
        }
    }

    /// Sums `totals[..len]` over the processes as `sync` says.
    fn sum_totals(&mut self, len: usize, sync: &mut TotalsSync) -> Result<(), GpuError> {
        match sync {
            TotalsSync::Local => Ok(()),
            TotalsSync::Host(reducer) => self.reduce_totals(len, &mut **reducer),
            TotalsSync::Nccl { .. } => self.all_reduce_batch_norm_totals(len),
        }
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

    /// The training forward of a unit (see [`Executor::conv_bn_statistics`]): the
    /// convolution, then its statistics and coefficients in one launch, or with a `reducer`
    /// (SyncBatchNorm) the totals, their sum across processes and the coefficients.
    pub(super) fn unit_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        let plan = unit.plan;
        let channels = plan.shape.out_channels;
        let rows = plan.shape.output_len() / channels.max(1);
        self.conv_forward(unit, plan.z).map_err(device)?;
        let too_few = |count: f64| {
            (count <= 1.0).then_some(tandem_engine::EngineError::BatchNormTooFewValues { count })
        };
        let activations = self.storage().map_err(device)?.sizes.activations;
        let (z, coefficients) = {
            let addresses = self.addresses().map_err(device)?;
            let (params, buffers) = (
                self.params.address(&self.stream),
                address(&self.buffers, &self.stream),
            );
            let bn = unit.bn;
            (
                addresses.slot(plan.z),
                TrainCoefficients {
                    weight: at(params, bn.weight.start),
                    bias: at(params, bn.bias.start),
                    running_mean: at(buffers, bn.running_mean.start),
                    running_var: at(buffers, bn.running_var.start),
                    mean: addresses.state(plan, StatePart::Mean),
                    invstd: addresses.state(plan, StatePart::InvStd),
                    scale: addresses.state(plan, StatePart::Scale),
                    shift: addresses.state(plan, StatePart::Shift),
                },
            )
        };
        let count = match self.totals_sync(reducer) {
            TotalsSync::Local => {
                let count = rows as f64;
                if let Some(error) = too_few(count) {
                    return Err(error.into());
                }
                self.column_totals(z, activations, rows, channels, Some(&coefficients))
                    .map_err(device)?;
                count
            }
            mut sync => {
                self.column_totals(z, activations, rows, channels, None)
                    .map_err(device)?;
                self.sum_totals(1 + 2 * channels, &mut sync)
                    .map_err(device)?;
                let count = match sync {
                    // Every rank's batch has this unit's rows (see
                    // `sync_batch_norm_through_nccl`); the device reads the summed count.
                    TotalsSync::Nccl { world_size } => (rows * world_size) as f64,
                    _ => self.storage().map_err(device)?.host_totals[0],
                };
                if let Some(error) = too_few(count) {
                    return Err(error.into());
                }
                let totals = address(&self.storage().map_err(device)?.totals, &self.stream);
                let [weight, bias, running_mean, running_var, mean, invstd, scale, shift] =
                    coefficients.args();
                let args = [
                    Arg::Ptr(totals),
                    Arg::I32(channels as i32),
                    weight,
                    bias,
                    running_mean,
                    running_var,
                    mean,
                    invstd,
                    scale,
                    shift,
                ];
                // SAFETY: bn_train_coefficients' ten parameters in order; every per-channel
                // pointer addresses `channels` floats (the layer's ranges and the unit's
                // state).
                unsafe { self.launch("bn_train_coefficients", per_element(channels), &args) }
                    .map_err(device)?;
                count
            }
        };
        if let Some(storage) = self.storages.active_mut() {
            storage.counts[plan.index] = count;
        }
        Ok(())
    }

    /// The backward of a unit (see [`Executor::conv_bn_backward`]).
    pub(super) fn unit_backward(
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
        let (params, grads) = (
            self.params.address(&self.stream),
            self.grads.address(&self.stream),
        );
        let count = self.storage()?.counts[plan.index];
        let (dy, relu_out, z, mean, invstd, partials, arrivals, totals, coefficients, dz) = {
            let addresses = self.addresses()?;
            let storage = addresses.storage;
            (
                addresses.grad(grad_output.values),
                grad_output
                    .relu_output
                    .map_or(0, |slot| addresses.slot(slot)),
                addresses.slot(plan.z),
                addresses.state(plan, StatePart::Mean),
                addresses.state(plan, StatePart::InvStd),
                address(&storage.partials, &self.stream),
                address(&storage.arrivals, &self.stream),
                address(&storage.totals, &self.stream),
                address(&storage.coefficients, &self.stream),
                storage.dz.address(&self.stream),
            )
        };
        let weight = at(params, bn.weight.start);
        let mut sync = self.totals_sync(reducer);
        let local = matches!(sync, TotalsSync::Local);
        // Without SyncBatchNorm the sums' launch also computes the coefficients.
        let coefficients_in_sums = if local { coefficients } else { 0 };
        // SAFETY: bn_backward_sums(_bf16)(const Act* x3, const float* x2, int, int, int,
        // double*, unsigned int*, double*, float*, float*, double, const float*, float*): dy,
        // relu_out (or null), z hold `len` activations, mean and invstd `channels` floats; partials holds at least
        // row_blocks * 2 * channels doubles and arrivals one zero per channel group; totals
        // 2 * channels doubles; the gradient ranges and the weight `channels` floats; the
        // coefficients (or null) 3 * channels floats.
        unsafe {
            self.launch(
                self.activation_kernel("bn_backward_sums")?,
                column_sums(channels, row_blocks(rows)),
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
                    Arg::Ptr(arrivals),
                    Arg::Ptr(totals),
                    Arg::Ptr(at(grads, bn.weight.start)),
                    Arg::Ptr(at(grads, bn.bias.start)),
                    Arg::F64(count),
                    Arg::Ptr(weight),
                    Arg::Ptr(coefficients_in_sums),
                ],
            )?;
        }
        if !local {
            self.sum_totals(2 * channels, &mut sync)?;
            // SAFETY: bn_backward_coefficients(const double*, double, int, const float*, const
            // float*, float*): totals as above, summed across processes; coefficients holds
            // 3 * channels floats.
            unsafe {
                self.launch(
                    "bn_backward_coefficients",
                    per_element(channels),
                    &[
                        Arg::Ptr(totals),
                        Arg::F64(count),
                        Arg::I32(channels as i32),
                        Arg::Ptr(weight),
                        Arg::Ptr(invstd),
                        Arg::Ptr(coefficients),
                    ],
                )?;
            }
        }
        self.report(bn.param_range().end, ready)?;
        // The block's output gradient, masked in place for the shortcut that reads it next.
        let masked_dy = if grad_output.keep_masked && relu_out != 0 {
            dy
        } else {
            0
        };
        // SAFETY: bn_backward_input(_bf16)(const Act* x3, const float* x3, long long, int,
        // Act*, Act*): dy, relu_out, z as above; dz holds at least `len` activations
        // (grad_len); masked_dy is dy or null, each thread reading and writing only element i
        // of it.
        unsafe {
            self.launch(
                self.activation_kernel("bn_backward_input")?,
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
                    Arg::Ptr(masked_dy),
                ],
            )?;
        }
        if let Some(bias) = &conv.bias {
            let kind = self.storage()?.sizes.activations;
            self.bias_gradient(dz, kind, rows, channels, at(grads, bias.start))?;
        }
        let (input, input_is_f32) = {
            let addresses = self.addresses()?;
            (addresses.slot(plan.input), addresses.reads_images(plan))
        };
        let target = match grad_input {
            GradTarget::Skip => None,
            GradTarget::Overwrite(buffer) => Some((self.addresses()?.grad(buffer), false)),
            GradTarget::Accumulate(buffer) => Some((self.addresses()?.grad(buffer), true)),
        };
        let workspace = (address(&self.workspace, &self.stream), self.workspace.len());
        let conv_plan = self.conv_plan(&plan.shape)?;
        self.convolve_backward(
            conv_plan,
            &plan.shape,
            &ConvBackward {
                input,
                input_is_f32,
                filter: at(params, conv.weight.start),
                grad_output: dz,
                grad_filter: at(grads, conv.weight.start),
                grad_input: target,
                workspace,
            },
        )?;
        self.report(conv.param_range().end, ready)
    }

    /// The head's backward (see [`Executor::head_backward`]).
    pub(super) fn head_gradients(
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
            self.params.address(&self.stream),
            self.grads.address(&self.stream),
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
        // pooled is [batch, inputs], grad_logits [batch, outputs], the weight gradient range
        // [outputs, inputs], grad_pooled [batch, inputs], as the GEMMs address them.
        let pooled = GemmOperand {
            address: pooled,
            len: batch * head.in_features,
            role: Role::Input,
        };
        let grad_logits_operand = GemmOperand {
            address: grad_logits,
            len: batch * classes,
            role: Role::Output,
        };
        let weight = GemmOperand {
            address: at(params, head.weight.start),
            len: head.weight.len(),
            role: Role::Filter,
        };
        self.linear_gemm(
            &shape.weight_gradient()?,
            pooled,
            grad_logits_operand,
            at(grads, head.weight.start),
        )?;
        self.bias_gradient(
            grad_logits,
            Activations::F32,
            batch,
            classes,
            at(grads, head.bias.start),
        )?;
        self.linear_gemm(
            &shape.input_gradient()?,
            weight,
            grad_logits_operand,
            grad_pooled,
        )?;
        self.report(head.bias.end, ready)?;
        let pixels = features.shape.out_height() * features.shape.out_width();
        // SAFETY: average_pool_backward(_bf16)(const float*, int, int, int, Act*): the target
        // buffer holds batch * pixels * channels activations (the features' length ≤
        // grad_len).
        unsafe {
            self.launch(
                self.activation_kernel("average_pool_backward")?,
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

/// How a training pass sums a batch-norm layer's column totals over the processes.
enum TotalsSync<'a> {
    /// Not at all: this process's batch alone.
    Local,
    /// Through the host, by the caller's reducer.
    Host(&'a mut dyn BatchNormReducer),
    /// Through NCCL on the device, over this many ranks.
    Nccl {
        /// The ranks of the NCCL group.
        world_size: usize,
    },
}
