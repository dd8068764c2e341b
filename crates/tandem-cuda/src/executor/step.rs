//! [`Executor`] for the GPU ([`GpuStep`]): each method launches the GPU work of one step of
//! the shared walk in `tandem-models`; a backward's [`GradientSink`] says where its finished
//! gradients go.

use tandem_engine::BatchNormReducer;
use tandem_models::executor::{
    Executor, GradBuffer, GradTarget, GradientsReady, ResidualInput, Unit, UnitGrad,
};
use tandem_models::workspace::{Slot, UnitPlan};
use tandem_models::{Head, ModelError};

use super::autocast::{GemmOperand, Role};
use super::error::driver;
use super::kernels::{batchnorm, epilogue, loss, pooling, ActPtr, Ptr};
use super::launch::per_element;
use super::linear::LinearShape;
use super::memory::StatePart;
use super::{CudaExecutor, GpuError};

/// The bad-label record's value before the loss kernel: no sample. A `static`, because a copy
/// from pageable memory may read its source after the call returns.
static NO_BAD_SAMPLE: [i32; 1] = [i32::MAX];

/// The executor of one walk of the model over the GPU: the [`CudaExecutor`] and where the
/// walk's finished gradients go.
pub(super) struct GpuStep<'a> {
    /// The executor.
    pub(super) exec: &'a mut CudaExecutor,
    /// Where a backward's finished gradients go (a forward finishes none).
    pub(super) gradients: GradientSink,
}

/// Where a backward puts each gradient range as it becomes final.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GradientSink {
    /// Nowhere: they stay in the device gradients (one process).
    Device,
    /// Copied to the page-locked host gradients and reported to the walk's hook with them.
    Host,
    /// All-reduced bucket by bucket through the NCCL group.
    AllReduce,
}

impl<'a> GpuStep<'a> {
    /// A forward walk over `exec`.
    pub(super) fn forward(exec: &'a mut CudaExecutor) -> Self {
        GpuStep {
            exec,
            gradients: GradientSink::Device,
        }
    }
}

impl Executor for GpuStep<'_> {
    fn images_from_host(&mut self, images: &[f32]) -> Result<(), ModelError> {
        Ok(self.exec.copy_images(images)?)
    }

    fn conv_bn_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        self.exec.unit_statistics(unit, reducer)
    }

    fn bn_apply(
        &mut self,
        unit: Unit,
        residual: ResidualInput,
        relu: bool,
    ) -> Result<(), ModelError> {
        Ok(self.exec.bn_apply(unit, residual, relu)?)
    }

    fn conv_bn_eval(
        &mut self,
        unit: Unit,
        residual: Option<Slot>,
        relu: bool,
        output: Slot,
    ) -> Result<(), ModelError> {
        Ok(self.exec.conv_bn_eval(unit, residual, relu, output)?)
    }

    fn head_forward(&mut self, head: &Head, features: &UnitPlan) -> Result<(), ModelError> {
        Ok(self.exec.head_forward(head, features)?)
    }

    fn loss_forward(&mut self, labels: &[u32], label_smoothing: f32) -> Result<f32, ModelError> {
        self.exec.loss_on_device(labels, label_smoothing)
    }

    fn logits_to_host(&self, logits: &mut Vec<f32>) -> Result<(), ModelError> {
        Ok(self.exec.logits_to_host(logits)?)
    }

    fn head_backward(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        let sink = self.gradients;
        Ok(self
            .exec
            .head_gradients(head, features, loss_scale, into, ready, sink)?)
    }

    fn relu_backward(
        &mut self,
        grad: GradBuffer,
        output: Slot,
        len: usize,
    ) -> Result<(), ModelError> {
        Ok(self.exec.relu_backward(grad, output, len)?)
    }

    fn copy_gradient(
        &mut self,
        from: GradBuffer,
        to: GradBuffer,
        len: usize,
    ) -> Result<(), ModelError> {
        Ok(self.exec.copy_gradient(from, to, len)?)
    }

    fn conv_bn_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: GradTarget,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        let sink = self.gradients;
        Ok(self
            .exec
            .unit_backward(unit, grad_output, grad_input, reducer, ready, sink)?)
    }
}

impl CudaExecutor {
    /// See [`Executor::bn_apply`].
    pub(super) fn bn_apply(
        &mut self,
        unit: Unit,
        residual: ResidualInput,
        relu: bool,
    ) -> Result<(), GpuError> {
        let plan = unit.plan;
        let addresses = self.addresses()?;
        // Unused pointers are null and not read (`kind` says which are).
        let (kind, residual, scale2, shift2) = match residual {
            ResidualInput::None => (0, ActPtr::NULL, Ptr::NULL, Ptr::NULL),
            ResidualInput::Identity(slot) => (1, addresses.slot(slot), Ptr::NULL, Ptr::NULL),
            ResidualInput::Normalized(projection) => (
                2,
                addresses.slot(projection.z),
                addresses.state(projection, StatePart::Scale),
                addresses.state(projection, StatePart::Shift),
            ),
        };
        let len = plan.output_len();
        epilogue::bn_apply(
            &self.queue(),
            per_element(len),
            addresses.slot(plan.z),
            addresses.state(plan, StatePart::Scale),
            addresses.state(plan, StatePart::Shift),
            residual,
            scale2,
            shift2,
            kind,
            i32::from(relu),
            len as i64,
            plan.shape.out_channels as i32,
            addresses.slot(plan.out),
        )
    }

    /// See [`Executor::conv_bn_eval`].
    pub(super) fn conv_bn_eval(
        &mut self,
        unit: Unit,
        residual: Option<Slot>,
        relu: bool,
        output: Slot,
    ) -> Result<(), GpuError> {
        let (plan, bn) = (unit.plan, unit.bn);
        let channels = plan.shape.out_channels;
        let (params, buffers) = (
            self.flat.params.ptr(&self.stream),
            Ptr::of(&self.flat.buffers, &self.stream),
        );
        let (invstd, scale, shift) = {
            let addresses = self.addresses()?;
            (
                addresses.state(plan, StatePart::InvStd),
                addresses.state(plan, StatePart::Scale),
                addresses.state(plan, StatePart::Shift),
            )
        };
        batchnorm::bn_eval_coefficients(
            &self.queue(),
            per_element(channels),
            channels as i32,
            params.at(bn.weight.start),
            params.at(bn.bias.start),
            buffers.at(bn.running_mean.start),
            buffers.at(bn.running_var.start),
            invstd,
            scale,
            shift,
        )?;
        self.conv_forward(unit, output)?;
        let addresses = self.addresses()?;
        let out = addresses.slot(output);
        let residual = residual.map_or(ActPtr::NULL, |slot| addresses.slot(slot));
        let len = plan.output_len();
        // In place: each thread reads x[i] before it writes out[i] and touches no other
        // element; the residual slot is not the output (the planner keeps it live).
        epilogue::bn_apply(
            &self.queue(),
            per_element(len),
            out,
            scale,
            shift,
            residual,
            Ptr::NULL,
            Ptr::NULL,
            i32::from(residual.non_null().is_some()),
            i32::from(relu),
            len as i64,
            channels as i32,
            out,
        )
    }

    /// See [`Executor::head_forward`].
    pub(super) fn head_forward(
        &mut self,
        head: &Head,
        features: &UnitPlan,
    ) -> Result<(), GpuError> {
        let batch = features.shape.batch;
        let pixels = features.shape.out_height() * features.shape.out_width();
        let params = self.flat.params.ptr(&self.stream);
        let (input, pooled, logits) = {
            let addresses = self.addresses()?;
            (
                addresses.slot(features.out),
                Ptr::of(&addresses.storage.pooled, &self.stream),
                Ptr::of(&addresses.storage.logits, &self.stream),
            )
        };
        // The features hold batch * pixels * channels activations, pooled batch *
        // channels floats.
        pooling::average_pool_forward(
            &self.queue(),
            per_element(batch * head.in_features),
            input,
            batch as i32,
            pixels as i32,
            head.in_features as i32,
            pooled,
        )?;
        let shape = LinearShape {
            batch,
            inputs: head.in_features,
            outputs: head.classes,
        };
        // weight [classes, in_features], pooled [batch, in_features], logits [batch,
        // classes], as the forward GEMM addresses them.
        self.linear_gemm(
            &shape.forward()?,
            GemmOperand {
                address: params.at(head.weight.start).address(),
                len: head.weight.len(),
                role: Role::Filter,
            },
            GemmOperand {
                address: pooled.address(),
                len: batch * head.in_features,
                role: Role::Input,
            },
            logits.address(),
        )?;
        self.bias_add(
            ActPtr::f32(logits),
            params.at(head.bias.start),
            batch * head.classes,
            head.classes,
        )
    }

    /// Copies the logits `[batch, classes]` of the last forward to the host.
    pub fn logits_to_host(&self, logits: &mut Vec<f32>) -> Result<(), GpuError> {
        let storage = self.storage()?;
        let host = self
            .stream
            .clone_dtoh(&storage.logits.slice(..storage.sizes.logits))
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        // A copy to pageable memory may still be running when the call returns.
        self.synchronize()?;
        *logits = host;
        Ok(())
    }

    /// See [`Executor::relu_backward`].
    pub(super) fn relu_backward(
        &mut self,
        grad: GradBuffer,
        output: Slot,
        len: usize,
    ) -> Result<(), GpuError> {
        let addresses = self.addresses()?;
        let (values, relu_out) = (addresses.grad(grad), addresses.slot(output));
        // In place: each thread reads and writes only element i.
        let config = per_element(len);
        epilogue::relu_backward(&self.queue(), config, values, relu_out, len as i64, values)
    }

    /// See [`Executor::copy_gradient`].
    pub(super) fn copy_gradient(
        &mut self,
        from: GradBuffer,
        to: GradBuffer,
        len: usize,
    ) -> Result<(), GpuError> {
        let addresses = self.addresses()?;
        let (source, target) = (addresses.grad(from).address(), addresses.grad(to).address());
        let bytes = len * addresses.storage.sizes.activations.bytes();
        // SAFETY: two distinct gradient buffers of grad_len ≥ len activations, on the
        // stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                target,
                source,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver("cuMemcpyDtoDAsync"))
    }

    /// The loss on the device: labels in, probabilities kept for the backward, the mean loss
    /// copied to the host (this waits for the forward to finish).
    pub(super) fn loss_on_device(
        &mut self,
        labels: &[u32],
        label_smoothing: f32,
    ) -> Result<f32, ModelError> {
        self.load_labels(labels)?;
        self.loss_kernels(label_smoothing)?;
        self.read_loss(labels)
    }

    /// Copies the NHWC `images` into the start of the active storage's image slot.
    pub(super) fn copy_images(&mut self, images: &[f32]) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.memory.storages.active_mut() else {
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
    }

    /// Copies `labels` to the active storage and clears its bad-label record, before a step.
    pub(super) fn load_labels(&mut self, labels: &[u32]) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.memory.storages.active_mut() else {
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
        self.memory.label_smoothing = label_smoothing;
        let stream = &self.stream;
        let storage = self.storage()?;
        let batch = storage.shape.1;
        let classes = storage.sizes.logits / batch.max(1);
        let (logits, labels, probabilities, sample_loss, bad_sample, loss) = (
            Ptr::of(&storage.logits, stream),
            Ptr::of(&storage.labels, stream),
            Ptr::of(&storage.probabilities, stream),
            Ptr::of(&storage.sample_loss, stream),
            Ptr::of(&storage.bad_sample, stream),
            Ptr::of(&storage.loss, stream),
        );
        let queue = self.queue();
        loss::cross_entropy_rows(
            &queue,
            per_element(batch),
            logits,
            labels,
            batch as i32,
            classes as i32,
            label_smoothing,
            probabilities,
            sample_loss,
            bad_sample,
        )?;
        // One thread.
        loss::cross_entropy_mean(&queue, per_element(1), sample_loss, batch as i32, loss)
    }

    /// Waits for the queued work and reads the mean loss of the active storage; a label out
    /// of range (recorded by the loss kernel) is the CPU's `InvalidLabel` error naming its
    /// sample among `labels`.
    pub(super) fn read_loss(&self, labels: &[u32]) -> Result<f32, ModelError> {
        let stream = &self.stream;
        let storage = self.storage()?;
        let classes = storage.sizes.logits / labels.len().max(1);
        let mut bad = [i32::MAX];
        stream
            .memcpy_dtoh(&storage.bad_sample, &mut bad)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        let mut value = [0f32];
        stream
            .memcpy_dtoh(&storage.loss, &mut value)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.synchronize()?;
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
