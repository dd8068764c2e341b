//! The GPU work of the units and the head that the [`Executor`] methods of `step.rs` run:
//! a unit's convolution and batch-norm statistics, its backward, the head's backward, and the
//! column sums and biases they share; plus the plumbing of device addresses.

use cudarc::driver::CudaStream;
use tandem_engine::shape::Conv2dShape;
use tandem_engine::BatchNormReducer;
use tandem_models::executor::{GradBuffer, GradTarget, GradientsReady, Unit, UnitGrad};
use tandem_models::workspace::{Slot, UnitPlan};
use tandem_models::{Head, ModelError};

use super::autocast::{ConvBackward, GemmOperand, Role};
use super::conv::{ConvBuffers, ConvPlan};
use super::error::driver;
use super::kernels::{batchnorm, bias, loss, pooling, ActPtr, Ptr};
use super::launch::{column_sums, per_element};
use super::launch::{row_blocks, ROWS_PER_BLOCK};
use super::linear::LinearShape;
use super::memory::{DeviceStorage, StatePart};
use super::step::GradientSink;
use super::{address, CudaExecutor, GpuError};
#[cfg(doc)]
use tandem_models::executor::Executor;

/// The addresses of one plan's storage, copied out so that launches borrow nothing.
pub(super) struct Addresses<'a> {
    pub(super) storage: &'a DeviceStorage,
    pub(super) stream: &'a CudaStream,
}

impl Addresses<'_> {
    /// The activations of `slot` (of the plan's element type; the images slot is only ever
    /// read as float32 by the stem's convolution, which [`Self::reads_images`] tells).
    pub(super) fn slot(&self, slot: Slot) -> ActPtr {
        self.activations(self.storage.slots[slot].address(self.stream))
    }
    /// Whether `unit` reads the images, float32 whatever the activations.
    pub(super) fn reads_images(&self, unit: &UnitPlan) -> bool {
        unit.index == self.storage.image_reader
    }
    pub(super) fn grad(&self, buffer: GradBuffer) -> ActPtr {
        self.activations(self.storage.grads[buffer.0].address(self.stream))
    }
    /// The batch norm's input gradient.
    pub(super) fn dz(&self) -> ActPtr {
        self.activations(self.storage.dz.address(self.stream))
    }
    pub(super) fn state(&self, unit: &UnitPlan, part: StatePart) -> Ptr<f32> {
        let offset = self.storage.sizes.bn_state.offset(unit.index, part);
        Ptr::of(&self.storage.bn_state, self.stream).at(offset)
    }
    /// The column sums' partial sums, arrival counters and totals.
    pub(super) fn column_scratch(&self) -> (Ptr<f64>, Ptr<u32>, Ptr<f64>) {
        let storage = self.storage;
        (
            Ptr::of(&storage.partials, self.stream),
            Ptr::of(&storage.arrivals, self.stream),
            Ptr::of(&storage.totals, self.stream),
        )
    }
    fn activations(&self, address: u64) -> ActPtr {
        ActPtr::new(address, self.storage.sizes.activations)
    }
}

/// Where `bn_stats` writes a batch norm's training coefficients and updates its running
/// statistics (`channels` floats each).
pub(super) struct TrainCoefficients {
    pub(super) weight: Ptr<f32>,
    pub(super) bias: Ptr<f32>,
    pub(super) running_mean: Ptr<f32>,
    pub(super) running_var: Ptr<f32>,
    pub(super) mean: Ptr<f32>,
    pub(super) invstd: Ptr<f32>,
    pub(super) scale: Ptr<f32>,
    pub(super) shift: Ptr<f32>,
}

impl TrainCoefficients {
    /// No coefficients: `bn_stats` computes the totals alone.
    const NULL: TrainCoefficients = TrainCoefficients {
        weight: Ptr::NULL,
        bias: Ptr::NULL,
        running_mean: Ptr::NULL,
        running_var: Ptr::NULL,
        mean: Ptr::NULL,
        invstd: Ptr::NULL,
        scale: Ptr::NULL,
        shift: Ptr::NULL,
    };
}

impl CudaExecutor {
    pub(super) fn storage(&self) -> Result<&DeviceStorage, GpuError> {
        self.memory.storages.active().ok_or(GpuError::NotPrepared)
    }

    pub(super) fn addresses(&self) -> Result<Addresses<'_>, GpuError> {
        Ok(Addresses {
            storage: self.storage()?,
            stream: &self.stream,
        })
    }

    /// `totals = [rows, Σx…, Σx²…]` of the `[rows, channels]` activations at `values`, in the
    /// fixed two-pass order of `batchnorm.cu`, in one launch; with `coefficients`, also a
    /// batch norm's training coefficients and running statistics from those totals.
    pub(super) fn column_totals(
        &self,
        values: ActPtr,
        rows: usize,
        channels: usize,
        coefficients: Option<&TrainCoefficients>,
    ) -> Result<(), GpuError> {
        // The storage's scratch holds the largest column sums of the plan (`StorageSizes`).
        let (partials, arrivals, totals) = self.addresses()?.column_scratch();
        let c = coefficients.unwrap_or(&TrainCoefficients::NULL);
        batchnorm::bn_stats(
            &self.queue(),
            column_sums(channels, row_blocks(rows)),
            values,
            rows as i32,
            channels as i32,
            ROWS_PER_BLOCK as i32,
            partials,
            arrivals,
            totals,
            c.weight,
            c.bias,
            c.running_mean,
            c.running_var,
            c.mean,
            c.invstd,
            c.scale,
            c.shift,
        )
    }

    /// `grad_bias += column sums of the [rows, channels] gradient at values`.
    pub(super) fn bias_gradient(
        &self,
        values: ActPtr,
        rows: usize,
        channels: usize,
        grad_bias: Ptr<f32>,
    ) -> Result<(), GpuError> {
        self.column_totals(values, rows, channels, None)?;
        let totals = Ptr::of(&self.storage()?.totals, &self.stream);
        let config = per_element(channels);
        bias::add_channel_sums(&self.queue(), config, totals, channels as i32, grad_bias)
    }

    /// `values[i] += bias[i % channels]` over `n` activations.
    pub(super) fn bias_add(
        &self,
        values: ActPtr,
        bias: Ptr<f32>,
        n: usize,
        channels: usize,
    ) -> Result<(), GpuError> {
        let config = per_element(n);
        bias::bias_add(
            &self.queue(),
            config,
            values,
            bias,
            n as i64,
            channels as i32,
        )
    }

    /// The plan of the convolution of `shape` under the executor's settings, which
    /// [`CudaExecutor::prepare`] measured for every convolution of the active plan.
    pub(super) fn conv_plan(&self, shape: &Conv2dShape) -> Result<&ConvPlan, GpuError> {
        self.libraries
            .algorithms
            .get(shape, self.libraries.settings.algorithms())
            .ok_or(GpuError::NotPrepared)
    }

    /// `output slot = conv(input slot) [+ bias]`.
    pub(super) fn conv_forward(&mut self, unit: Unit, output: Slot) -> Result<(), GpuError> {
        let shape = unit.plan.shape;
        let (input, input_is_f32, output, params, workspace) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(unit.plan.input).address(),
                addresses.reads_images(unit.plan),
                addresses.slot(output),
                self.flat.params.ptr(&self.stream),
                address(&self.libraries.workspace, &self.stream),
            )
        };
        let workspace_len = self.libraries.workspace.len();
        let plan = self.conv_plan(&shape)?;
        self.convolve_forward(
            plan,
            &shape,
            &ConvBuffers {
                input,
                filter: params.at(unit.conv.weight.start).address(),
                output: output.address(),
                workspace: (workspace, workspace_len),
            },
            input_is_f32,
        )?;
        if let Some(bias) = &unit.conv.bias {
            let bias = params.at(bias.start);
            self.bias_add(output, bias, shape.output_len(), shape.out_channels)?;
        }
        Ok(())
    }

    /// Hands the device gradients up to `end`, now final, to `sink`: to the host hook, copied
    /// to the (page-locked) host gradients first; or to NCCL, which queues the buckets that
    /// are now complete (nothing crosses to the host).
    pub(super) fn report(
        &mut self,
        end: usize,
        ready: &mut GradientsReady,
        sink: GradientSink,
    ) -> Result<(), GpuError> {
        match sink {
            GradientSink::Device => Ok(()),
            GradientSink::AllReduce => self.all_reduce_finished(end),
            GradientSink::Host => {
                let current = self.flat.host_grads.current();
                if end > current {
                    let range = current..end;
                    let host = self.flat.host_grads.values(&self.context)?;
                    self.stream
                        .memcpy_dtoh(&self.flat.grads.view(range.clone()), &mut host[range])
                        .map_err(driver("cuMemcpyDtoHAsync"))?;
                    self.synchronize()?;
                    self.flat.host_grads.mark_current(end);
                }
                ready.finished_up_to(end, self.flat.host_grads.values(&self.context)?);
                Ok(())
            }
        }
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
        let Some(storage) = self.memory.storages.active_mut() else {
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
        self.conv_forward(unit, plan.z)?;
        let too_few = |count: f64| {
            (count <= 1.0).then_some(tandem_engine::EngineError::BatchNormTooFewValues { count })
        };
        let (z, coefficients) = {
            let addresses = self.addresses()?;
            let (params, buffers) = (
                self.flat.params.ptr(&self.stream),
                Ptr::of(&self.flat.buffers, &self.stream),
            );
            let bn = unit.bn;
            (
                addresses.slot(plan.z),
                TrainCoefficients {
                    weight: params.at(bn.weight.start),
                    bias: params.at(bn.bias.start),
                    running_mean: buffers.at(bn.running_mean.start),
                    running_var: buffers.at(bn.running_var.start),
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
                self.column_totals(z, rows, channels, Some(&coefficients))?;
                count
            }
            mut sync => {
                self.column_totals(z, rows, channels, None)?;
                self.sum_totals(1 + 2 * channels, &mut sync)?;
                let count = match sync {
                    // Every rank's batch has this unit's rows (see
                    // `sync_batch_norm_through_nccl`); the device reads the summed count.
                    TotalsSync::Nccl { world_size } => (rows * world_size) as f64,
                    _ => self.storage()?.host_totals[0],
                };
                if let Some(error) = too_few(count) {
                    return Err(error.into());
                }
                let totals = Ptr::of(&self.storage()?.totals, &self.stream);
                let c = &coefficients;
                batchnorm::bn_train_coefficients(
                    &self.queue(),
                    per_element(channels),
                    totals,
                    channels as i32,
                    c.weight,
                    c.bias,
                    c.running_mean,
                    c.running_var,
                    c.mean,
                    c.invstd,
                    c.scale,
                    c.shift,
                )?;
                count
            }
        };
        if let Some(storage) = self.memory.storages.active_mut() {
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
        sink: GradientSink,
    ) -> Result<(), GpuError> {
        let (bn, plan) = (unit.bn, unit.plan);
        let channels = plan.shape.out_channels;
        let len = plan.output_len();
        let rows = len / channels.max(1);
        let (params, grads) = (
            self.flat.params.ptr(&self.stream),
            self.flat.grads.ptr(&self.stream),
        );
        let count = self.storage()?.counts[plan.index];
        let (dy, relu_out, z, mean, invstd, coefficients, dz) = {
            let addresses = self.addresses()?;
            (
                addresses.grad(grad_output.values),
                grad_output
                    .relu_output
                    .map_or(ActPtr::NULL, |slot| addresses.slot(slot)),
                addresses.slot(plan.z),
                addresses.state(plan, StatePart::Mean),
                addresses.state(plan, StatePart::InvStd),
                Ptr::of(&addresses.storage.coefficients, &self.stream),
                addresses.dz(),
            )
        };
        let (partials, arrivals, totals) = self.addresses()?.column_scratch();
        let weight = params.at(bn.weight.start);
        let mut sync = self.totals_sync(reducer);
        let local = matches!(sync, TotalsSync::Local);
        // Without SyncBatchNorm the sums' launch also computes the coefficients.
        let coefficients_in_sums = if local { coefficients } else { Ptr::NULL };
        batchnorm::bn_backward_sums(
            &self.queue(),
            column_sums(channels, row_blocks(rows)),
            dy,
            relu_out,
            z,
            mean,
            invstd,
            rows as i32,
            channels as i32,
            ROWS_PER_BLOCK as i32,
            partials,
            arrivals,
            totals,
            grads.at(bn.weight.start),
            grads.at(bn.bias.start),
            count,
            weight,
            coefficients_in_sums,
        )?;
        if !local {
            self.sum_totals(2 * channels, &mut sync)?;
            batchnorm::bn_backward_coefficients(
                &self.queue(),
                per_element(channels),
                totals,
                count,
                channels as i32,
                weight,
                invstd,
                coefficients,
            )?;
        }
        self.report(bn.param_range().end, ready, sink)?;
        // The block's output gradient, masked in place for the shortcut that reads it next.
        let masked_dy = match relu_out.non_null() {
            Some(_) if grad_output.keep_masked => dy,
            _ => ActPtr::NULL,
        };
        batchnorm::bn_backward_input(
            &self.queue(),
            per_element(len),
            dy,
            relu_out,
            z,
            mean,
            invstd,
            coefficients,
            len as i64,
            channels as i32,
            dz,
            masked_dy,
        )?;
        self.conv_backward(unit, dz, grad_input, ready, sink)
    }

    /// The convolution's part of a unit's backward, from `dz`, the batch norm's input
    /// gradient: the bias gradient, the filter gradient and the input gradient.
    fn conv_backward(
        &mut self,
        unit: Unit,
        dz: ActPtr,
        grad_input: GradTarget,
        ready: &mut GradientsReady,
        sink: GradientSink,
    ) -> Result<(), GpuError> {
        let (conv, plan) = (unit.conv, unit.plan);
        let channels = plan.shape.out_channels;
        let rows = plan.output_len() / channels.max(1);
        let (params, grads) = (
            self.flat.params.ptr(&self.stream),
            self.flat.grads.ptr(&self.stream),
        );
        if let Some(bias) = &conv.bias {
            self.bias_gradient(dz, rows, channels, grads.at(bias.start))?;
        }
        let (input, input_is_f32) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(plan.input).address(),
                addresses.reads_images(plan),
            )
        };
        let target = match grad_input {
            GradTarget::Skip => None,
            GradTarget::Overwrite(buffer) => {
                Some((self.addresses()?.grad(buffer).address(), false))
            }
            GradTarget::Accumulate(buffer) => {
                Some((self.addresses()?.grad(buffer).address(), true))
            }
        };
        let workspace = (
            address(&self.libraries.workspace, &self.stream),
            self.libraries.workspace.len(),
        );
        let conv_plan = self.conv_plan(&plan.shape)?;
        self.convolve_backward(
            conv_plan,
            &plan.shape,
            &ConvBackward {
                input,
                input_is_f32,
                filter: params.at(conv.weight.start).address(),
                grad_output: dz.address(),
                grad_filter: grads.at(conv.weight.start).address(),
                grad_input: target,
                workspace,
            },
        )?;
        self.report(conv.param_range().end, ready, sink)
    }

    /// The head's backward (see [`Executor::head_backward`]).
    pub(super) fn head_gradients(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
        sink: GradientSink,
    ) -> Result<(), GpuError> {
        let batch = self.storage()?.labels.len();
        let classes = head.classes;
        let shape = LinearShape {
            batch,
            inputs: head.in_features,
            outputs: classes,
        };
        let (params, grads) = (
            self.flat.params.ptr(&self.stream),
            self.flat.grads.ptr(&self.stream),
        );
        let (probabilities, labels, grad_logits, pooled, grad_pooled, into) = {
            let addresses = self.addresses()?;
            let (storage, stream) = (addresses.storage, &self.stream);
            (
                Ptr::of(&storage.probabilities, stream),
                Ptr::of(&storage.labels, stream),
                Ptr::of(&storage.grad_logits, stream),
                Ptr::of(&storage.pooled, stream),
                Ptr::of(&storage.grad_pooled, stream),
                addresses.grad(into),
            )
        };
        loss::cross_entropy_backward(
            &self.queue(),
            per_element(batch * classes),
            probabilities,
            labels,
            batch as i32,
            classes as i32,
            self.memory.label_smoothing,
            loss_scale,
            grad_logits,
        )?;
        // pooled is [batch, inputs], grad_logits [batch, outputs], the weight gradient range
        // [outputs, inputs], grad_pooled [batch, inputs], as the GEMMs address them.
        let pooled = GemmOperand {
            address: pooled.address(),
            len: batch * head.in_features,
            role: Role::Input,
        };
        let grad_logits_operand = GemmOperand {
            address: grad_logits.address(),
            len: batch * classes,
            role: Role::Output,
        };
        let weight = GemmOperand {
            address: params.at(head.weight.start).address(),
            len: head.weight.len(),
            role: Role::Filter,
        };
        self.linear_gemm(
            &shape.weight_gradient()?,
            pooled,
            grad_logits_operand,
            grads.at(head.weight.start).address(),
        )?;
        self.bias_gradient(
            ActPtr::f32(grad_logits),
            batch,
            classes,
            grads.at(head.bias.start),
        )?;
        self.linear_gemm(
            &shape.input_gradient()?,
            weight,
            grad_logits_operand,
            grad_pooled.address(),
        )?;
        self.report(head.bias.end, ready, sink)?;
        // The target buffer holds batch * pixels * channels activations (the features'
        // length ≤ grad_len).
        let pixels = features.shape.out_height() * features.shape.out_width();
        pooling::average_pool_backward(
            &self.queue(),
            per_element(features.output_len()),
            grad_pooled,
            batch as i32,
            pixels as i32,
            head.in_features as i32,
            into,
        )
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
