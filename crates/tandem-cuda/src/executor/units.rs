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
use super::linear::LinearShape;
use super::memory::{row_blocks, DeviceStorage, StatePart, ROWS_PER_BLOCK};
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
        address(&self.storage.slots[slot], self.stream)
    }
    pub(super) fn grad(&self, buffer: GradBuffer) -> u64 {
        address(&self.storage.grads[buffer.0], self.stream)
    }
    pub(super) fn state(&self, unit: &UnitPlan, part: StatePart) -> u64 {
        let offset = self.storage.sizes.bn_state.offset(unit.index, part);
        at(address(&self.storage.bn_state, self.stream), offset)
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

    /// `totals = [rows, Σx…, Σx²…]` of the `[rows, channels]` tensor at `values`, in the
    /// fixed two-pass order of `batchnorm.cu`.
    pub(super) fn column_totals(
        &self,
        values: u64,
        rows: usize,
        channels: usize,
    ) -> Result<(), GpuError> {
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
                column_sums(channels, 1),
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
    pub(super) fn bias_gradient(
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
    pub(super) fn bias_add(
        &self,
        values: u64,
        bias: u64,
        n: usize,
        channels: usize,
    ) -> Result<(), GpuError> {
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

    /// The plan of the convolution of `shape` under the executor's settings, which
    /// [`CudaExecutor::prepare`] measured for every convolution of the active plan.
    pub(super) fn conv_plan(&self, shape: &Conv2dShape) -> Result<&ConvPlan, GpuError> {
        self.algorithms
            .get(shape, self.settings.precision, self.settings.deterministic)
            .ok_or(GpuError::NotPrepared)
    }

    /// `output slot = conv(input slot) [+ bias]`.
    pub(super) fn conv_forward(&mut self, unit: Unit, output: Slot) -> Result<(), GpuError> {
        let shape = unit.plan.shape;
        let (input, output_address, params, workspace) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(unit.plan.input),
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
        )?;
        if let Some(bias) = &unit.conv.bias {
            let bias = at(params, bias.start);
            self.bias_add(output_address, bias, shape.output_len(), shape.out_channels)?;
        }
        Ok(())
    }

    /// Copies the device gradients up to `end` to the host mirror and reports them, when
    /// this backward has a hook to report to; in a backward that all-reduces through NCCL,
    /// queues the buckets that are now complete instead (nothing crosses to the host).
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
            self.stream
                .memcpy_dtoh(&self.grads.view(range.clone()), &mut self.host_grads[range])
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            self.synchronize()?;
            self.grads_on_host = end;
        }
        ready.finished_up_to(end, &self.host_grads);
        Ok(())
    }

    /// Sums `totals[..len]` across processes through the host.
    pub(super) fn reduce_totals(
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
    pub(super) fn unit_statistics(
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
            self.params.address(&self.stream),
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
        let blocks = row_blocks(rows);
        let (params, grads) = (
            self.params.address(&self.stream),
            self.grads.address(&self.stream),
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
                column_sums(channels, 1),
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
        let conv_plan = self.conv_plan(&plan.shape)?;
        self.convolve_backward(
            conv_plan,
            &plan.shape,
            &ConvBackward {
                input,
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
        self.bias_gradient(grad_logits, batch, classes, at(grads, head.bias.start))?;
        self.linear_gemm(
            &shape.input_gradient()?,
            weight,
            grad_logits_operand,
            grad_pooled,
        )?;
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
