//! The CPU executor: the `tandem-engine` kernels over host memory, with their fusions (batch
//! norm sums inside the convolution's forward, the batch norm's input gradient inside the
//! convolution's backward, eval-mode batch norm + residual + ReLU as the convolution's
//! epilogue).

use tandem_engine::batchnorm::{
    self, BatchNormParams, BatchNormReducer, BatchNormScratch, BatchNormState, OutputGrad, Residual,
};
use tandem_engine::conv::{
    conv2d_backward, conv2d_forward_fused, ConvOutputGrad, ConvScratch, Epilogue, Fused, InputGrad,
};
use tandem_engine::head;

use crate::error::ModelError;
use crate::executor::{
    Executor, GradBuffer, GradTarget, GradientsReady, ResidualInput, Unit, UnitGrad,
};
use crate::network::{Head, Network};
use crate::workspace::{Mode, Plan, Slot, UnitPlan};

/// Everything the CPU keeps for one [`Plan`]: activation slots, head and loss buffers,
/// gradient buffers, per-unit batch-norm state and kernel scratch.
pub(crate) struct CpuStorage {
    slots: Vec<Vec<f32>>,
    pooled: Vec<f32>,
    logits: Vec<f32>,
    probabilities: Vec<f32>,
    grad_logits: Vec<f32>,
    grad_pooled: Vec<f32>,
    labels: Vec<u32>,
    label_smoothing: f32,
    grad_buffers: [Vec<f32>; 4],
    /// Per unit (by [`UnitPlan::index`]), training: the batch statistics of the last
    /// forward, kept for the backward; evaluation: the scale and shift from the running
    /// statistics.
    bn_states: Vec<BatchNormState>,
    conv_scratch: ConvScratch,
    bn_scratch: BatchNormScratch,
    /// Per-channel sums of the last convolution's output, for its batch norm.
    output_sums: Vec<f64>,
}

impl CpuStorage {
    /// Allocates the storage of `plan`.
    pub fn new(plan: &Plan) -> Self {
        let train = plan.mode == Mode::Train;
        let batch_outputs = if train { plan.batch * plan.classes } else { 0 };
        let mut bn_states = vec![BatchNormState::default(); plan.units];
        for unit in plan.unit_plans() {
            bn_states[unit.index] = BatchNormState::new(unit.shape.out_channels);
        }
        CpuStorage {
            slots: plan.slot_lens.iter().map(|&len| vec![0.0; len]).collect(),
            pooled: vec![0.0; plan.batch * plan.final_channels],
            logits: vec![0.0; plan.batch * plan.classes],
            probabilities: vec![0.0; batch_outputs],
            grad_logits: vec![0.0; batch_outputs],
            grad_pooled: vec![
                0.0;
                if train {
                    plan.batch * plan.final_channels
                } else {
                    0
                }
            ],
            labels: Vec::with_capacity(plan.batch),
            label_smoothing: 0.0,
            grad_buffers: std::array::from_fn(|_| vec![0.0; plan.grad_len]),
            bn_states,
            conv_scratch: ConvScratch::default(),
            bn_scratch: BatchNormScratch::default(),
            output_sums: Vec::new(),
        }
    }
}

/// The CPU executor for one step: the model's flat buffers and a plan's storage.
pub(crate) struct CpuStep<'a> {
    /// The image slot of the plan.
    pub images: Slot,
    /// Flat parameters.
    pub params: &'a [f32],
    /// Flat gradients.
    pub grads: &'a mut [f32],
    /// Flat running statistics.
    pub buffers: &'a mut [f32],
    /// The plan's storage.
    pub storage: &'a mut CpuStorage,
}

impl Executor for CpuStep<'_> {
    fn images_from_host(&mut self, images: &[f32]) -> Result<(), ModelError> {
        self.storage.slots[self.images][..images.len()].copy_from_slice(images);
        Ok(())
    }

    fn conv_bn_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        let storage = &mut *self.storage;
        let plan = unit.plan;
        run_conv(
            unit,
            self.params,
            &mut storage.slots,
            plan.z,
            UnitWork::OutputSums(&mut storage.output_sums),
            &mut storage.conv_scratch,
        );
        let bn = unit.bn;
        let affine = BatchNormParams {
            weight: &self.params[bn.weight.clone()],
            bias: &self.params[bn.bias.clone()],
        };
        let (running_mean, running_var) =
            two_ranges_mut(self.buffers, &bn.running_mean, &bn.running_var);
        let rows = plan.shape.output_len() / plan.shape.out_channels.max(1);
        batchnorm::train_statistics_from_sums(
            rows,
            &storage.output_sums,
            &affine,
            running_mean,
            running_var,
            &mut storage.bn_states[plan.index],
            reducer,
            &mut storage.bn_scratch,
        )?;
        Ok(())
    }

    fn bn_apply(
        &mut self,
        unit: Unit,
        residual: ResidualInput,
        relu: bool,
    ) -> Result<(), ModelError> {
        let plan = unit.plan;
        let (z, len) = (plan.z, plan.output_len());
        let states = &self.storage.bn_states;
        with_output(&mut self.storage.slots, plan.out, |slots, output| {
            let residual = match residual {
                ResidualInput::None => Residual::None,
                ResidualInput::Identity(slot) => Residual::Identity(&slots[slot][..len]),
                ResidualInput::Normalized(projection) => Residual::Normalized {
                    input: &slots[projection.z][..len],
                    state: &states[projection.index],
                },
            };
            batchnorm::apply(
                &slots[z][..len],
                &states[plan.index],
                residual,
                relu,
                &mut output[..len],
            );
        });
        Ok(())
    }

    fn conv_bn_eval(
        &mut self,
        unit: Unit,
        residual: Option<Slot>,
        relu: bool,
        output: Slot,
    ) -> Result<(), ModelError> {
        let bn = unit.bn;
        let storage = &mut *self.storage;
        let state = &mut storage.bn_states[unit.plan.index];
        let affine = BatchNormParams {
            weight: &self.params[bn.weight.clone()],
            bias: &self.params[bn.bias.clone()],
        };
        batchnorm::eval_statistics(
            &affine,
            &self.buffers[bn.running_mean.clone()],
            &self.buffers[bn.running_var.clone()],
            state,
        );
        let work = UnitWork::Epilogue {
            state,
            residual,
            relu,
        };
        run_conv(
            unit,
            self.params,
            &mut storage.slots,
            output,
            work,
            &mut storage.conv_scratch,
        );
        Ok(())
    }

    fn head_forward(&mut self, head: &Head, features: &UnitPlan) -> Result<(), ModelError> {
        let storage = &mut *self.storage;
        let values = &storage.slots[features.out][..features.output_len()];
        let pixels = features.shape.out_height() * features.shape.out_width();
        head::average_pool_forward(values, pixels, head.in_features, &mut storage.pooled);
        head::linear_forward(
            &storage.pooled,
            &self.params[head.weight.clone()],
            &self.params[head.bias.clone()],
            &mut storage.logits,
        );
        Ok(())
    }

    fn loss_forward(&mut self, labels: &[u32], label_smoothing: f32) -> Result<f32, ModelError> {
        let storage = &mut *self.storage;
        storage.labels.clear();
        storage.labels.extend_from_slice(labels);
        storage.label_smoothing = label_smoothing;
        Ok(head::cross_entropy_forward(
            &storage.logits,
            labels,
            label_smoothing,
            &mut storage.probabilities,
        )?)
    }

    fn logits_to_host(&self, logits: &mut Vec<f32>) -> Result<(), ModelError> {
        logits.clear();
        logits.extend_from_slice(&self.storage.logits);
        Ok(())
    }

    fn head_backward(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        let storage = &mut *self.storage;
        head::cross_entropy_backward(
            &storage.probabilities,
            &storage.labels,
            storage.label_smoothing,
            loss_scale,
            &mut storage.grad_logits,
        );
        let (grad_weight, grad_bias) = two_ranges_mut(self.grads, &head.weight, &head.bias);
        head::linear_backward(
            &storage.pooled,
            &self.params[head.weight.clone()],
            &storage.grad_logits,
            grad_weight,
            grad_bias,
            Some(&mut storage.grad_pooled),
        );
        ready.finished_up_to(head.bias.end, self.grads);
        let pixels = features.shape.out_height() * features.shape.out_width();
        head::average_pool_backward(
            &storage.grad_pooled,
            pixels,
            head.in_features,
            &mut storage.grad_buffers[into.0][..features.output_len()],
        );
        Ok(())
    }

    fn relu_backward(
        &mut self,
        grad: GradBuffer,
        output: Slot,
        len: usize,
    ) -> Result<(), ModelError> {
        let storage = &mut *self.storage;
        batchnorm::relu_backward_in_place(
            &mut storage.grad_buffers[grad.0][..len],
            &storage.slots[output][..len],
        );
        Ok(())
    }

    fn copy_gradient(
        &mut self,
        from: GradBuffer,
        to: GradBuffer,
        len: usize,
    ) -> Result<(), ModelError> {
        let buffers = &mut self.storage.grad_buffers;
        let source = std::mem::take(&mut buffers[from.0]);
        buffers[to.0][..len].copy_from_slice(&source[..len]);
        buffers[from.0] = source;
        Ok(())
    }

    fn conv_bn_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: GradTarget,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        let mut grad_output = grad_output;
        if let (true, Some(relu_output)) = (grad_output.keep_masked, grad_output.relu_output) {
            self.relu_backward(grad_output.values, relu_output, unit.plan.output_len())?;
            grad_output.relu_output = None;
        }
        let input_len = unit.plan.shape.input_len();
        // The input gradient's buffer is taken out while the gradient buffers are read.
        let (target, accumulate) = match grad_input {
            GradTarget::Skip => (None, false),
            GradTarget::Overwrite(buffer) => (Some(buffer), false),
            GradTarget::Accumulate(buffer) => (Some(buffer), true),
        };
        debug_assert!(
            target != Some(grad_output.values),
            "one buffer as input and output"
        );
        let mut taken = target
            .map(|buffer| std::mem::take(&mut self.storage.grad_buffers[buffer.0]))
            .unwrap_or_default();
        let input_grad = match (target, accumulate) {
            (None, _) => InputGrad::Skip,
            (Some(_), false) => InputGrad::Overwrite(&mut taken[..input_len]),
            (Some(_), true) => InputGrad::Accumulate(&mut taken[..input_len]),
        };
        let result = self.unit_backward(unit, grad_output, input_grad, reducer, ready);
        if let Some(buffer) = target {
            self.storage.grad_buffers[buffer.0] = taken;
        }
        result
    }
}

impl CpuStep<'_> {
    /// [`Executor::conv_bn_backward`] with the input gradient's destination resolved: the
    /// batch norm's sums and parameter gradients, then the convolution's backward with the
    /// batch norm's input gradient computed chunk by chunk inside it.
    fn unit_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: InputGrad,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        let (conv, bn, plan) = (unit.conv, unit.bn, unit.plan);
        let storage = &mut *self.storage;
        let slots = &storage.slots;
        let len = plan.output_len();
        let grad = OutputGrad {
            values: &storage.grad_buffers[grad_output.values.0][..len],
            relu_output: grad_output.relu_output.map(|slot| &slots[slot][..len]),
        };
        let z = &slots[plan.z][..len];
        let (grad_weight, grad_bias) = two_ranges_mut(self.grads, &bn.weight, &bn.bias);
        let coefficients = batchnorm::backward_coefficients(
            grad,
            z,
            &self.params[bn.weight.clone()],
            &storage.bn_states[plan.index],
            grad_weight,
            grad_bias,
            reducer,
            &mut storage.bn_scratch,
        )?;
        ready.finished_up_to(bn.param_range().end, self.grads);
        let through_batch_norm = ConvOutputGrad::ThroughBatchNorm {
            grad,
            bn_input: z,
            coefficients,
        };
        let (grad_weight, grad_bias) = match &conv.bias {
            Some(bias) => {
                let (weight, bias) = two_ranges_mut(self.grads, &conv.weight, bias);
                (weight, Some(bias))
            }
            None => (&mut self.grads[conv.weight.clone()], None),
        };
        conv2d_backward(
            &plan.shape,
            &slots[plan.input][..plan.shape.input_len()],
            &self.params[conv.weight.clone()],
            through_batch_norm,
            grad_weight,
            grad_bias,
            grad_input,
            &mut storage.conv_scratch,
        );
        ready.finished_up_to(conv.param_range().end, self.grads);
        Ok(())
    }
}

/// What a unit's convolution does to its output chunks besides computing them.
enum UnitWork<'a> {
    /// Evaluation: the batch norm (its scale and shift), the residual in the named slot and
    /// the ReLU, applied in place.
    Epilogue {
        state: &'a BatchNormState,
        residual: Option<Slot>,
        relu: bool,
    },
    /// Training: gather the output's per-channel sums for its batch norm.
    OutputSums(&'a mut Vec<f64>),
}

/// `slots[output] = conv(slots[unit.plan.input])`, with `work` fused into it.
fn run_conv(
    unit: Unit,
    params: &[f32],
    slots: &mut [Vec<f32>],
    output: Slot,
    work: UnitWork,
    scratch: &mut ConvScratch,
) {
    let (conv, shape) = (unit.conv, &unit.plan.shape);
    let weight = &params[conv.weight.clone()];
    let bias = conv.bias.as_ref().map(|range| &params[range.clone()]);
    let input = unit.plan.input;
    with_output(slots, output, |slots, output| {
        let fused = match work {
            UnitWork::Epilogue {
                state,
                residual,
                relu,
            } => Fused::Epilogue(Epilogue {
                scale: &state.scale,
                shift: &state.shift,
                residual: residual.map(|slot| &slots[slot][..shape.output_len()]),
                relu,
            }),
            UnitWork::OutputSums(sums) => Fused::OutputSums(sums),
        };
        conv2d_forward_fused(
            shape,
            &slots[input][..shape.input_len()],
            weight,
            bias,
            fused,
            &mut output[..shape.output_len()],
            scratch,
        );
    });
}

/// Runs `work` with `slots[output]` borrowed mutably and the other slots readable.
/// The planner never gives an output the slot of a live input, so nothing read is moved.
fn with_output<R>(
    slots: &mut [Vec<f32>],
    output: Slot,
    work: impl FnOnce(&[Vec<f32>], &mut [f32]) -> R,
) -> R {
    let mut buffer = std::mem::take(&mut slots[output]);
    let result = work(slots, &mut buffer);
    slots[output] = buffer;
    result
}

/// Two disjoint ranges of one buffer, mutably; `first` must end before `second` starts.
pub(crate) fn two_ranges_mut<'a>(
    buffer: &'a mut [f32],
    first: &std::ops::Range<usize>,
    second: &std::ops::Range<usize>,
) -> (&'a mut [f32], &'a mut [f32]) {
    let (head, tail) = buffer.split_at_mut(second.start);
    (&mut head[first.clone()], &mut tail[..second.len()])
}

/// A plan and the CPU executor's storage for it.
pub(crate) struct Workspace {
    pub plan: Plan,
    pub storage: CpuStorage,
}

impl Workspace {
    /// Plans `network` for this batch shape and allocates the storage of the plan.
    pub fn new(
        network: &Network,
        mode: Mode,
        batch: usize,
        height: usize,
        width: usize,
        channels: usize,
    ) -> Result<Self, ModelError> {
        let plan = Plan::new(network, mode, batch, height, width, channels)?;
        let storage = CpuStorage::new(&plan);
        Ok(Workspace { plan, storage })
    }
}
