//! [`Executor`] for [`CudaExecutor`]: each method launches the GPU work of one step of the
//! shared walk in `tandem-models`.

use tandem_engine::BatchNormReducer;
use tandem_models::executor::{
    Executor, GradBuffer, GradTarget, GradientsReady, ResidualInput, Unit, UnitGrad,
};
use tandem_models::workspace::{Slot, UnitPlan};
use tandem_models::{Head, ModelError};

use super::autocast::{GemmOperand, Role};
use super::error::driver;
use super::launch::{per_element, Arg};
use super::linear::LinearShape;
use super::memory::{Activations, StatePart};
use super::{address, at, device, CudaExecutor, GpuError};

/// The bad-label record's value before the loss kernel: no sample. A `static`, because a copy
/// from pageable memory may read its source after the call returns.
static NO_BAD_SAMPLE: [i32; 1] = [i32::MAX];

impl Executor for CudaExecutor {
    fn images_from_host(&mut self, images: &[f32]) {
        self.run(|exec| {
            let stream = exec.stream.clone();
            let Some(storage) = exec.storages.active_mut() else {
                return Err(GpuError::NotPrepared);
            };
            let slot = storage.slots[storage.images].f32_mut()?;
            if images.len() > slot.len() {
                return Err(GpuError::Length {
                    what: "images",
                    found: images.len(),
                    expected: slot.len(),
                });
            }
            stream
                .memcpy_htod(images, &mut slot.slice_mut(..images.len()))
                .map_err(driver("cuMemcpyHtoDAsync"))
        });
    }

    fn conv_bn_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        self.kept()?;
        self.unit_statistics(unit, reducer)
    }

    fn bn_apply(&mut self, unit: Unit, residual: ResidualInput, relu: bool) {
        self.run(|exec| {
            let plan = unit.plan;
            let addresses = exec.addresses()?;
            let (kind, residual, scale2, shift2) = match residual {
                ResidualInput::None => (0, 0, 0, 0),
                ResidualInput::Identity(slot) => (1, addresses.slot(slot), 0, 0),
                ResidualInput::Normalized(projection) => (
                    2,
                    addresses.slot(projection.z),
                    addresses.state(projection, StatePart::Scale),
                    addresses.state(projection, StatePart::Shift),
                ),
            };
            let len = plan.output_len();
            let args = [
                Arg::Ptr(addresses.slot(plan.z)),
                Arg::Ptr(addresses.state(plan, StatePart::Scale)),
                Arg::Ptr(addresses.state(plan, StatePart::Shift)),
                Arg::Ptr(residual),
                Arg::Ptr(scale2),
                Arg::Ptr(shift2),
                Arg::I32(kind),
                Arg::I32(i32::from(relu)),
                Arg::I64(len as i64),
                Arg::I32(plan.shape.out_channels as i32),
                Arg::Ptr(addresses.slot(plan.out)),
            ];
            // SAFETY: bn_apply(_bf16)'s eleven parameters in order; z, the residual and out
            // hold `len` activations, the state vectors `channels` floats; unused pointers are null and
            // not read (residual_kind says which are).
            unsafe { exec.launch(exec.activation_kernel("bn_apply")?, per_element(len), &args) }
        });
    }

    fn conv_bn_eval(&mut self, unit: Unit, residual: Option<Slot>, relu: bool, output: Slot) {
        self.run(|exec| {
            let (plan, bn) = (unit.plan, unit.bn);
            let channels = plan.shape.out_channels;
            let (params, buffers) = (
                exec.params.address(&exec.stream),
                address(&exec.buffers, &exec.stream),
            );
            let (invstd, scale, shift) = {
                let addresses = exec.addresses()?;
                (
                    addresses.state(plan, StatePart::InvStd),
                    addresses.state(plan, StatePart::Scale),
                    addresses.state(plan, StatePart::Shift),
                )
            };
            let args = [
                Arg::I32(channels as i32),
                Arg::Ptr(at(params, bn.weight.start)),
                Arg::Ptr(at(params, bn.bias.start)),
                Arg::Ptr(at(buffers, bn.running_mean.start)),
                Arg::Ptr(at(buffers, bn.running_var.start)),
                Arg::Ptr(invstd),
                Arg::Ptr(scale),
                Arg::Ptr(shift),
            ];
            // SAFETY: bn_eval_coefficients' eight parameters in order, `channels` floats each.
            unsafe { exec.launch("bn_eval_coefficients", per_element(channels), &args) }?;
            exec.conv_forward(unit, output)?;
            let addresses = exec.addresses()?;
            let out = addresses.slot(output);
            let residual = residual.map_or(0, |slot| addresses.slot(slot));
            let len = plan.output_len();
            let args = [
                Arg::Ptr(out),
                Arg::Ptr(scale),
                Arg::Ptr(shift),
                Arg::Ptr(residual),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::I32(i32::from(residual != 0)),
                Arg::I32(i32::from(relu)),
                Arg::I64(len as i64),
                Arg::I32(channels as i32),
                Arg::Ptr(out),
            ];
            // SAFETY: bn_apply in place: each thread reads x[i] before it writes out[i] and
            // touches no other element; the residual slot is not the output (the planner keeps
            // it live).
            unsafe { exec.launch(exec.activation_kernel("bn_apply")?, per_element(len), &args) }
        });
    }

    fn head_forward(&mut self, head: &Head, features: &UnitPlan) {
        self.run(|exec| {
            let batch = features.shape.batch;
            let pixels = features.shape.out_height() * features.shape.out_width();
            let params = exec.params.address(&exec.stream);
            let (input, pooled, logits) = {
                let addresses = exec.addresses()?;
                (
                    addresses.slot(features.out),
                    address(&addresses.storage.pooled, &exec.stream),
                    address(&addresses.storage.logits, &exec.stream),
                )
            };
            // SAFETY: average_pool_forward(_bf16)(const Act*, int, int, int, float*): the
            // features hold batch * pixels * channels activations, pooled batch * channels
            // floats.
            unsafe {
                exec.launch(
                    exec.activation_kernel("average_pool_forward")?,
                    per_element(batch * head.in_features),
                    &[
                        Arg::Ptr(input),
                        Arg::I32(batch as i32),
                        Arg::I32(pixels as i32),
                        Arg::I32(head.in_features as i32),
                        Arg::Ptr(pooled),
                    ],
                )
            }?;
            let shape = LinearShape {
                batch,
                inputs: head.in_features,
                outputs: head.classes,
            };
            // weight [classes, in_features], pooled [batch, in_features], logits [batch,
            // classes], as the forward GEMM addresses them.
            exec.linear_gemm(
                &shape.forward()?,
                GemmOperand {
                    address: at(params, head.weight.start),
                    len: head.weight.len(),
                    role: Role::Filter,
                },
                GemmOperand {
                    address: pooled,
                    len: batch * head.in_features,
                    role: Role::Input,
                },
                logits,
            )?;
            exec.bias_add(
                logits,
                Activations::F32,
                at(params, head.bias.start),
                batch * head.classes,
                head.classes,
            )
        });
    }

    fn loss_forward(&mut self, labels: &[u32], label_smoothing: f32) -> Result<f32, ModelError> {
        self.kept()?;
        self.label_smoothing = label_smoothing;
        self.loss_on_device(labels, label_smoothing)
    }

    fn logits_to_host(&self, logits: &mut Vec<f32>) {
        if self.error.borrow().is_some() {
            return;
        }
        let result = self.storage().and_then(|storage| {
            let host = self
                .stream
                .clone_dtoh(&storage.logits.slice(..storage.sizes.logits))
                .map_err(driver("cuMemcpyDtoHAsync"))?;
            // A copy to pageable memory may still be running when the call returns.
            self.synchronize()?;
            *logits = host;
            Ok(())
        });
        if let Err(error) = result {
            *self.error.borrow_mut() = Some(error);
        }
    }

    fn head_backward(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
    ) {
        self.run(|exec| exec.head_gradients(head, features, loss_scale, into, ready));
    }

    fn relu_backward(&mut self, grad: GradBuffer, output: Slot, len: usize) {
        self.run(|exec| {
            let addresses = exec.addresses()?;
            let (values, relu_out) = (addresses.grad(grad), addresses.slot(output));
            // SAFETY: relu_backward(_bf16)(const Act*, const Act*, long long, Act*) in place:
            // each thread reads and writes only element i; both buffers hold `len`
            // activations.
            unsafe {
                exec.launch(
                    exec.activation_kernel("relu_backward")?,
                    per_element(len),
                    &[
                        Arg::Ptr(values),
                        Arg::Ptr(relu_out),
                        Arg::I64(len as i64),
                        Arg::Ptr(values),
                    ],
                )
            }
        });
    }

    fn copy_gradient(&mut self, from: GradBuffer, to: GradBuffer, len: usize) {
        self.run(|exec| {
            let addresses = exec.addresses()?;
            let (source, target) = (addresses.grad(from), addresses.grad(to));
            let bytes = len * addresses.storage.sizes.activations.bytes();
            // SAFETY: two distinct gradient buffers of grad_len ≥ len activations, on the
            // stream.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    target,
                    source,
                    bytes,
                    exec.stream.cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyDtoDAsync"))
        });
    }

    fn conv_bn_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: GradTarget,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        self.kept()?;
        self.unit_backward(unit, grad_output, grad_input, reducer, ready)
            .map_err(device)
    }
}

impl CudaExecutor {
    /// The loss on the device: labels in, probabilities kept for the backward, the mean loss
    /// copied to the host (this waits for the forward to finish).
    fn loss_on_device(&mut self, labels: &[u32], label_smoothing: f32) -> Result<f32, ModelError> {
        self.load_labels(labels).map_err(device)?;
        self.loss_kernels(label_smoothing).map_err(device)?;
        self.read_loss(labels)
    }

    /// Copies `labels` to the active storage and clears its bad-label record, before a step.
    pub(super) fn load_labels(&mut self, labels: &[u32]) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.storages.active_mut() else {
            return Err(GpuError::NotPrepared);
        };
        let batch = labels.len();
        super::error::same_length("labels", batch, storage.shape.1)?;
        stream
            .memcpy_htod(labels, &mut storage.labels.slice_mut(..batch))
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream
            .memcpy_htod(&NO_BAD_SAMPLE, &mut storage.bad_sample)
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// The loss kernels over the active storage's logits and labels: probabilities, each
    /// sample's loss, the mean (no host work: capturable).
    pub(super) fn loss_kernels(&mut self, label_smoothing: f32) -> Result<(), GpuError> {
        self.label_smoothing = label_smoothing;
        let stream = &self.stream;
        let storage = self.storage()?;
        let batch = storage.shape.1;
        let classes = storage.sizes.logits / batch.max(1);
        let pointer = |slice: u64| Arg::Ptr(slice);
        let (logits, labels_address, probabilities, sample_loss, bad_sample, loss) = (
            address(&storage.logits, stream),
            address(&storage.labels, stream),
            address(&storage.probabilities, stream),
            address(&storage.sample_loss, stream),
            address(&storage.bad_sample, stream),
            address(&storage.loss, stream),
        );
        // SAFETY: cross_entropy_rows(const float*, const unsigned*, int, int, float, float*,
        // double*, int*): logits and probabilities hold batch * classes floats, sample_loss
        // batch doubles. cross_entropy_mean(const double*, int, float*): one thread.
        unsafe {
            self.launch(
                "cross_entropy_rows",
                per_element(batch),
                &[
                    pointer(logits),
                    pointer(labels_address),
                    Arg::I32(batch as i32),
                    Arg::I32(classes as i32),
                    Arg::F32(label_smoothing),
                    pointer(probabilities),
                    pointer(sample_loss),
                    pointer(bad_sample),
                ],
            )?;
            self.launch(
                "cross_entropy_mean",
                per_element(1),
                &[pointer(sample_loss), Arg::I32(batch as i32), pointer(loss)],
            )
        }
    }

    /// Waits for the queued work and reads the mean loss of the active storage; a label out
    /// of range (recorded by the loss kernel) is the CPU's `InvalidLabel` error naming its
    /// sample among `labels`.
    pub(super) fn read_loss(&self, labels: &[u32]) -> Result<f32, ModelError> {
        let stream = &self.stream;
        let storage = self.storage().map_err(device)?;
        let classes = storage.sizes.logits / labels.len().max(1);
        let mut bad = [i32::MAX];
        stream
            .memcpy_dtoh(&storage.bad_sample, &mut bad)
            .map_err(driver("cuMemcpyDtoHAsync"))
            .map_err(device)?;
        let mut value = [0f32];
        stream
            .memcpy_dtoh(&storage.loss, &mut value)
            .map_err(driver("cuMemcpyDtoHAsync"))
            .map_err(device)?;
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
            .map_err(device)?;
        if let Ok(sample) = usize::try_from(bad[0]) {
            if let Some(&label) = labels.get(sample) {
                return Err(tandem_engine::EngineError::InvalidLabel {
                    sample,
                    label,
                    classes,
                }
                .into());
            }
        }
        Ok(value[0])
    }
}
