//! A model instance: flat buffers, forward passes, backward pass and default init.

use std::ops::Range;

use tandem_engine::batchnorm::BatchNormReducer;
use tandem_engine::rng::Rng;

use crate::cpu::Workspace;
use crate::cpu::{two_ranges_mut, CpuStep};
use crate::error::ModelError;
use crate::executor::{
    Executor, GradBuffer, GradTarget, GradientsReady, ResidualInput, Unit, UnitGrad,
};
use crate::network::{Block, ConvBn, Network};
use crate::spec::ModelSpec;
use crate::tensors::{from_pytorch_order, to_pytorch_order, TensorInfo, TensorKind};
use crate::workspace::{BlockPlan, Mode, Plan, UnitPlan};

/// Settings of the training loss.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossOptions {
    /// As PyTorch's `CrossEntropyLoss(label_smoothing=...)`; 0 for plain cross-entropy.
    pub label_smoothing: f32,
}

/// A model: its structure, flat parameter/gradient/statistics buffers and workspaces.
pub struct Model {
    spec: ModelSpec,
    network: Network,
    tensors: Vec<TensorInfo>,
    params: Vec<f32>,
    grads: Vec<f32>,
    buffers: Vec<f32>,
    num_batches_tracked: u64,
    train_workspace: Option<Workspace>,
    eval_workspace: Option<Workspace>,
    logits: Vec<f32>,
    backward_pending: bool,
}

impl Model {
    /// Builds the model of `spec` with PyTorch's default initialization from seed 0.
    pub fn new(spec: &ModelSpec) -> Result<Model, ModelError> {
        spec.validate()?;
        let (network, layout) = Network::build(spec);
        let mut model = Model {
            spec: spec.clone(),
            network,
            tensors: layout.tensors,
            params: vec![0.0; layout.params_len],
            grads: vec![0.0; layout.params_len],
            buffers: vec![0.0; layout.buffers_len],
            num_batches_tracked: 0,
            train_workspace: None,
            eval_workspace: None,
            logits: Vec::new(),
            backward_pending: false,
        };
        model.init_default(0);
        Ok(model)
    }

    /// The specification this model was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// PyTorch's default initialization, drawn from our own generator seeded with `seed`:
    /// convolution and linear weights and biases `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`, batch
    /// norm weight 1 and bias 0, running mean 0 and variance 1, no batches tracked.
    pub fn init_default(&mut self, seed: u64) {
        let mut stream = 0u64;
        let mut fill_uniform = |values: &mut [f32], fan_in: usize| {
            let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
            let mut rng = Rng::stream(seed, stream);
            stream += 1;
            for value in values {
                *value = rng.uniform(-bound, bound);
            }
        };
        for unit in self.network.conv_bns() {
            let conv = &unit.conv;
            fill_uniform(&mut self.params[conv.weight.clone()], conv.fan_in());
            if let Some(bias) = &conv.bias {
                fill_uniform(&mut self.params[bias.clone()], conv.fan_in());
            }
            self.params[unit.bn.weight.clone()].fill(1.0);
            self.params[unit.bn.bias.clone()].fill(0.0);
            self.buffers[unit.bn.running_mean.clone()].fill(0.0);
            self.buffers[unit.bn.running_var.clone()].fill(1.0);
        }
        let head = &self.network.head;
        fill_uniform(&mut self.params[head.weight.clone()], head.in_features);
        fill_uniform(&mut self.params[head.bias.clone()], head.in_features);
        self.num_batches_tracked = 0;
    }

    /// Every `state_dict` entry in PyTorch order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The entry named `name`, if the model has one.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|info| info.name == name)
    }

    /// The values of a parameter or buffer in PyTorch's layout (e.g. OIHW), or `None` for
    /// an unknown name or a `num_batches_tracked` entry.
    pub fn tensor_values(&self, name: &str) -> Option<Vec<f32>> {
        let info = self.tensor_info(name)?;
        let stored = match info.kind {
            TensorKind::Param => &self.params[info.range()],
            TensorKind::Buffer => &self.buffers[info.range()],
            TensorKind::BatchCount => return None,
        };
        Some(to_pytorch_order(info.layout, &info.shape, stored))
    }

    /// The gradient of a parameter in PyTorch's layout, or `None` if `name` is no parameter.
    pub fn grad_values(&self, name: &str) -> Option<Vec<f32>> {
        let info = self
            .tensor_info(name)
            .filter(|info| info.kind == TensorKind::Param)?;
        Some(to_pytorch_order(
            info.layout,
            &info.shape,
            &self.grads[info.range()],
        ))
    }

    /// Sets a parameter or buffer from values in PyTorch's layout. `values` must hold
    /// exactly the tensor's number of elements; returns `false` (changing nothing) otherwise
    /// or for an unknown name.
    pub fn set_tensor_values(&mut self, name: &str, values: &[f32]) -> bool {
        let Some(info) = self.tensors.iter().find(|info| info.name == name) else {
            return false;
        };
        if values.len() != info.len {
            return false;
        }
        let stored = match info.kind {
            TensorKind::Param => &mut self.params[info.offset..info.offset + info.len],
            TensorKind::Buffer => &mut self.buffers[info.offset..info.offset + info.len],
            TensorKind::BatchCount => return false,
        };
        from_pytorch_order(info.layout, &info.shape, values, stored);
        true
    }

    /// All parameters, flat, in gradient-completion order.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// All parameters, flat, mutable (for the optimizer and broadcasts).
    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    /// All gradients, flat, in the same layout as [`Model::params`].
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }

    /// All gradients, flat, mutable (for all-reduce).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }

    /// Parameters (mutable) and gradients together, for an optimizer step:
    /// `let (params, grads) = model.params_and_grads_mut(); optimizer.step(params, grads);`
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &[f32]) {
        (&mut self.params, &self.grads)
    }

    /// Batch-norm running means and variances, flat.
    pub fn buffers(&self) -> &[f32] {
        &self.buffers
    }

    /// Batch-norm running statistics, mutable.
    pub fn buffers_mut(&mut self) -> &mut [f32] {
        &mut self.buffers
    }

    /// Train-mode forward passes done so far (every batch norm's `num_batches_tracked`).
    pub fn num_batches_tracked(&self) -> u64 {
        self.num_batches_tracked
    }

    /// Sets the count of train-mode forward passes.
    pub fn set_num_batches_tracked(&mut self, n: u64) {
        self.num_batches_tracked = n;
    }

    /// The length of one training forward's batch statistics: per batch norm, its count
    /// and its sums and sums of squares per channel.
    pub fn batch_statistics_len(&self) -> usize {
        self.network.conv_bns().count() + self.buffers.len()
    }

    /// Moves the running statistics as one training forward did, and counts that batch:
    /// `statistics` is what the forward handed its [`BatchNormReducer`], one batch norm after
    /// the other (`[count, Σx per channel…, Σx² per channel…]` each). Applied in the order the
    /// forwards ran, the statistics of forwards recorded elsewhere leave the running
    /// statistics as if those forwards had run here.
    pub fn apply_batch_statistics(&mut self, statistics: &[f64]) -> Result<(), ModelError> {
        if statistics.len() != self.batch_statistics_len() {
            return Err(ModelError::InputLength {
                what: "batch statistics",
                found: statistics.len(),
                expected: self.batch_statistics_len(),
                shape: "a count, sums and sums of squares per batch norm".to_string(),
            });
        }
        let mut rest = statistics;
        for unit in self.network.conv_bns_in_statistics_order() {
            let (totals, next) = rest.split_at(1 + unit.bn.running_mean.len() * 2);
            let (running_mean, running_var) = two_ranges_mut(
                &mut self.buffers,
                &unit.bn.running_mean,
                &unit.bn.running_var,
            );
            tandem_engine::batchnorm::update_running_statistics(totals, running_mean, running_var)?;
            rest = next;
        }
        self.num_batches_tracked += 1;
        Ok(())
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
    }

    /// The logits `[batch, classes]` of the most recent forward pass.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Train-mode forward of NHWC images `[batch, height, width, channels]`; `labels` in
    /// `0..num_classes`. Returns the mean loss and updates the batch-norm running statistics.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
        labels: &[u32],
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<f32, ModelError> {
        self.backward_pending = false;
        if labels.len() != batch {
            return Err(ModelError::InputLength {
                what: "labels",
                found: labels.len(),
                expected: batch,
                shape: format!("one per image of a batch of {batch}"),
            });
        }
        let classes = self.spec.num_classes();
        if let Some(sample) = labels.iter().position(|&label| label as usize >= classes) {
            return Err(tandem_engine::EngineError::InvalidLabel {
                sample,
                label: labels[sample],
                classes,
            }
            .into());
        }
        let mut workspace = self.take_workspace(Mode::Train, images, batch, height, width)?;
        let result = self.run_step(&mut workspace, |exec, network, plan| {
            exec.images_from_host(images)?;
            forward(exec, network, plan, bn_sync)?;
            exec.loss_forward(labels, loss.label_smoothing)
        });
        self.train_workspace = Some(workspace);
        let loss = result?;
        self.num_batches_tracked += 1;
        self.backward_pending = true;
        Ok(loss)
    }

    /// Eval-mode forward (running statistics); returns the logits `[batch, classes]`.
    pub fn forward_eval(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> Result<&[f32], ModelError> {
        let mut workspace = self.take_workspace(Mode::Eval, images, batch, height, width)?;
        let result = self.run_step(&mut workspace, |exec, network, plan| {
            exec.images_from_host(images)?;
            forward(exec, network, plan, None)
        });
        self.eval_workspace = Some(workspace);
        result?;
        Ok(&self.logits)
    }

    /// Backward of the last [`Model::forward_train`]: adds the gradients of
    /// `loss_scale · loss` to [`Model::grads`] and calls `grad_ready` with each range (and the values) of
    /// the gradient buffer as soon as it is final, in increasing order.
    pub fn backward(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: &mut dyn FnMut(Range<usize>, &[f32]),
    ) -> Result<(), ModelError> {
        if !self.backward_pending {
            return Err(ModelError::NoForward);
        }
        self.backward_pending = false;
        let Some(mut workspace) = self.train_workspace.take() else {
            return Err(ModelError::NoForward);
        };
        let mut ready = GradientsReady::new(grad_ready);
        let result = self.run_step(&mut workspace, |exec, network, plan| {
            backward_pass(exec, network, plan, loss_scale, bn_sync, &mut ready)
        });
        self.train_workspace = Some(workspace);
        result
    }

    /// The plan of this model for `batch` images of `height x width` in `mode`, for an
    /// executor other than the built-in CPU one (e.g. the GPU's), which allocates its own
    /// storage for it.
    pub fn plan(
        &self,
        mode: Mode,
        batch: usize,
        height: usize,
        width: usize,
    ) -> Result<Plan, ModelError> {
        if batch == 0 {
            return Err(ModelError::EmptyBatch);
        }
        Plan::new(
            &self.network,
            mode,
            batch,
            height,
            width,
            self.spec.img_channels(),
        )
    }

    /// The network up to the logits on `exec`, whose images are already in `plan`'s image
    /// slot: training mode (batch statistics, summed by `bn_sync`) or evaluation mode, as
    /// the plan says. The same walk [`Model::forward_train`] and [`Model::forward_eval`] run
    /// on the CPU; `exec` holds the flat buffers it reads and writes.
    pub fn forward_on<E: Executor>(
        &self,
        exec: &mut E,
        plan: &Plan,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        forward(exec, &self.network, plan, bn_sync)
    }

    /// The backward of the last training forward on `exec` (after its
    /// [`Executor::loss_forward`]): the same walk as [`Model::backward`], reporting each
    /// final gradient range to `ready`.
    pub fn backward_on<E: Executor>(
        &self,
        exec: &mut E,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError> {
        backward_pass(exec, &self.network, plan, loss_scale, bn_sync, ready)
    }

    /// Takes (or builds) the workspace for this mode and batch shape; checks that `images`
    /// has the batch's length.
    fn take_workspace(
        &mut self,
        mode: Mode,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> Result<Workspace, ModelError> {
        if batch == 0 {
            return Err(ModelError::EmptyBatch);
        }
        let channels = self.spec.img_channels();
        let expected = batch * height * width * channels;
        if images.len() != expected {
            return Err(ModelError::InputLength {
                what: "images",
                found: images.len(),
                expected,
                shape: format!("NHWC [{batch}, {height}, {width}, {channels}]"),
            });
        }
        let cached = match mode {
            Mode::Train => self.train_workspace.take(),
            Mode::Eval => self.eval_workspace.take(),
        };
        match cached {
            Some(workspace) if workspace.plan.fits(batch, height, width) => Ok(workspace),
            _ => Workspace::new(&self.network, mode, batch, height, width, channels),
        }
    }

    /// Runs `work` on the CPU executor over the model's flat buffers and `workspace`, then
    /// copies the logits of the step to the host.
    fn run_step<R>(
        &mut self,
        workspace: &mut Workspace,
        work: impl FnOnce(&mut CpuStep, &Network, &Plan) -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        let Model {
            network,
            params,
            grads,
            buffers,
            logits,
            ..
        } = self;
        let Workspace { plan, storage } = workspace;
        let mut exec = CpuStep {
            images: plan.images,
            params,
            grads,
            buffers,
            storage,
        };
        let result = work(&mut exec, network, plan);
        let copied = exec.logits_to_host(logits);
        let value = result?;
        copied?;
        Ok(value)
    }
}

/// The optional SyncBatchNorm reducer, re-borrowable for each layer.
type Reducer<'a> = Option<&'a mut dyn BatchNormReducer>;

/// Re-borrows the optional reducer for one layer.
fn reborrow<'s>(reducer: &'s mut Reducer<'_>) -> Option<&'s mut dyn BatchNormReducer> {
    match reducer {
        Some(reducer) => Some(&mut **reducer),
        None => None,
    }
}

/// A block's projection shortcut as a unit, if it has one.
fn shortcut_unit<'a>(block: &'a Block, plan: &'a BlockPlan) -> Option<Unit<'a>> {
    match (&block.shortcut, &plan.shortcut) {
        (Some(layers), Some(unit_plan)) => Some(unit(layers, unit_plan)),
        _ => None,
    }
}

/// A block's chain of units, in forward order.
fn chain_units<'a>(
    block: &'a Block,
    plan: &'a BlockPlan,
) -> impl DoubleEndedIterator<Item = Unit<'a>> + ExactSizeIterator {
    block
        .units
        .iter()
        .zip(&plan.units)
        .map(|(layers, unit_plan)| unit(layers, unit_plan))
}

fn unit<'a>(layers: &'a ConvBn, plan: &'a UnitPlan) -> Unit<'a> {
    Unit {
        conv: &layers.conv,
        bn: &layers.bn,
        plan,
    }
}

/// The network up to the logits on the images in the executor: training mode (batch
/// statistics, summed by `reducer`) or evaluation mode, as the plan says.
fn forward<E: Executor>(
    exec: &mut E,
    network: &Network,
    plan: &Plan,
    mut reducer: Reducer,
) -> Result<(), ModelError> {
    if plan.mode == Mode::Eval {
        return forward_eval_layers(exec, network, plan);
    }
    let stem = unit(&network.stem, &plan.stem);
    exec.conv_bn_statistics(stem, reborrow(&mut reducer))?;
    exec.bn_apply(stem, ResidualInput::None, network.stem_relu)?;
    for (block, block_plan) in network.blocks.iter().zip(&plan.blocks) {
        block_forward(exec, block, block_plan, &mut reducer)?;
    }
    exec.head_forward(&network.head, plan.final_output())
}

/// The eval-mode network up to the logits: each convolution with its batch norm (running
/// statistics), residual add and ReLU in one step.
fn forward_eval_layers<E: Executor>(
    exec: &mut E,
    network: &Network,
    plan: &Plan,
) -> Result<(), ModelError> {
    exec.conv_bn_eval(
        unit(&network.stem, &plan.stem),
        None,
        network.stem_relu,
        plan.stem.out,
    )?;
    for (block, block_plan) in network.blocks.iter().zip(&plan.blocks) {
        let mut residual = block_plan.units.first().map(|unit_plan| unit_plan.input);
        if let Some(shortcut) = shortcut_unit(block, block_plan) {
            exec.conv_bn_eval(shortcut, None, false, shortcut.plan.z)?;
            residual = Some(shortcut.plan.z);
        }
        let last = block.units.len().saturating_sub(1);
        for (index, unit) in chain_units(block, block_plan).enumerate() {
            let residual = if index == last { residual } else { None };
            exec.conv_bn_eval(unit, residual, true, unit.plan.out)?;
        }
    }
    exec.head_forward(&network.head, plan.final_output())
}

/// Forward of one residual block in training mode.
fn block_forward<E: Executor>(
    exec: &mut E,
    block: &Block,
    plan: &BlockPlan,
    reducer: &mut Reducer,
) -> Result<(), ModelError> {
    let shortcut = shortcut_unit(block, plan);
    if let Some(shortcut) = shortcut {
        exec.conv_bn_statistics(shortcut, reborrow(reducer))?;
    }
    let block_input = plan.units.first().map_or(0, |unit_plan| unit_plan.input);
    let last = block.units.len().saturating_sub(1);
    for (index, unit) in chain_units(block, plan).enumerate() {
        exec.conv_bn_statistics(unit, reborrow(reducer))?;
        let residual = match (index < last, shortcut) {
            (true, _) => ResidualInput::None,
            (false, Some(projection)) => ResidualInput::Normalized(projection.plan),
            (false, None) => ResidualInput::Identity(block_input),
        };
        exec.bn_apply(unit, residual, true)?;
    }
    Ok(())
}

/// The gradient buffers of the backward pass: `current` holds the gradient at the output of
/// the block being processed, `other` receives the block input gradient when the block has
/// a projection shortcut, `first`/`second` hold gradients inside the block.
struct GradBuffers {
    current: GradBuffer,
    other: GradBuffer,
    first: GradBuffer,
    second: GradBuffer,
}

/// The backward of the last training forward: loss, head, blocks from last to first, stem.
fn backward_pass<E: Executor>(
    exec: &mut E,
    network: &Network,
    plan: &Plan,
    loss_scale: f32,
    mut reducer: Reducer,
    ready: &mut GradientsReady,
) -> Result<(), ModelError> {
    let mut buffers = GradBuffers {
        current: GradBuffer(0),
        other: GradBuffer(1),
        first: GradBuffer(2),
        second: GradBuffer(3),
    };
    exec.head_backward(
        &network.head,
        plan.final_output(),
        loss_scale,
        buffers.current,
        ready,
    )?;
    for (block, block_plan) in network.blocks.iter().zip(&plan.blocks).rev() {
        let projected = block_backward(exec, block, block_plan, &mut buffers, &mut reducer, ready)?;
        if projected {
            std::mem::swap(&mut buffers.current, &mut buffers.other);
        }
    }
    let stem_grad = UnitGrad {
        values: buffers.current,
        relu_output: network.stem_relu.then_some(plan.stem.out),
        keep_masked: false,
    };
    exec.conv_bn_backward(
        unit(&network.stem, &plan.stem),
        stem_grad,
        GradTarget::Skip,
        reborrow(&mut reducer),
        ready,
    )
}

/// Backward of one residual block; `buffers.current` holds the gradient at its output, before
/// the block's ReLU. Returns `true` when the input gradient was left in `buffers.other`
/// (projection shortcut) rather than in `buffers.current` (identity shortcut).
///
/// The ReLU's backward is applied once, in place, by the block's first unit backward (the
/// projection's, else the chain's last unit), which reads the gradient in `current` first;
/// the shortcut then reads the masked gradient there. A one-unit block with an identity
/// shortcut copies the masked gradient before its unit, so it masks with a pass of its own.
fn block_backward<E: Executor>(
    exec: &mut E,
    block: &Block,
    plan: &BlockPlan,
    buffers: &mut GradBuffers,
    reducer: &mut Reducer,
    ready: &mut GradientsReady,
) -> Result<bool, ModelError> {
    let Some(last_plan) = plan.units.last() else {
        return Ok(false);
    };
    let last = plan.units.len() - 1;
    let shortcut = shortcut_unit(block, plan);
    let projected = shortcut.is_some();
    // A one-unit block with an identity shortcut gathers its input gradient in `other`,
    // since its unit reads the gradient in `current`.
    let input_in_other = projected || last == 0;
    let block_output = if !projected && last == 0 {
        exec.relu_backward(buffers.current, last_plan.out, last_plan.output_len())?;
        exec.copy_gradient(buffers.current, buffers.other, last_plan.shape.input_len())?;
        UnitGrad {
            values: buffers.current,
            relu_output: None,
            keep_masked: false,
        }
    } else {
        UnitGrad {
            values: buffers.current,
            relu_output: Some(last_plan.out),
            keep_masked: true,
        }
    };
    // After the first unit backward that reads it, `current` holds the masked gradient.
    let masked_output = UnitGrad {
        values: buffers.current,
        relu_output: None,
        keep_masked: false,
    };
    if let Some(shortcut) = shortcut {
        let grad_input = GradTarget::Overwrite(buffers.other);
        exec.conv_bn_backward(shortcut, block_output, grad_input, reborrow(reducer), ready)?;
    }
    for (index, unit) in chain_units(block, plan).enumerate().rev() {
        // Inside the block, the gradient at a unit's output is in `second`, the ReLU after the
        // unit undone within its batch-norm pass; the unit writes the gradient at its input
        // into `first`, and the two swap roles for the next unit.
        let (grad_output, grad_input) = if index == last {
            let grad_output = if projected {
                masked_output
            } else {
                block_output
            };
            let grad_input = if index == 0 {
                GradTarget::Accumulate(buffers.other)
            } else {
                GradTarget::Overwrite(buffers.first)
            };
            (grad_output, grad_input)
        } else {
            let grad_output = UnitGrad {
                values: buffers.second,
                relu_output: Some(unit.plan.out),
                keep_masked: false,
            };
            let grad_input = match (index, input_in_other) {
                (0, true) => GradTarget::Accumulate(buffers.other),
                (0, false) => GradTarget::Accumulate(buffers.current),
                _ => GradTarget::Overwrite(buffers.first),
            };
            (grad_output, grad_input)
        };
        exec.conv_bn_backward(unit, grad_output, grad_input, reborrow(reducer), ready)?;
        std::mem::swap(&mut buffers.first, &mut buffers.second);
    }
    Ok(input_in_other)
}

#[cfg(test)]
mod tests {
    //! The walk over the network keeps the contract [`Executor`] documents, checked with an
    //! executor that only records what it is asked to do.

    use super::*;
    use crate::network::Head;
    use crate::spec::ResNetBaseSpec;
    use crate::workspace::Slot;

    /// What the model asked of each unit, by unit number.
    #[derive(Default)]
    struct Recorder {
        statistics: Vec<usize>,
        applied: Vec<usize>,
        evaluated: Vec<usize>,
        backward: Vec<usize>,
        head_backward: bool,
        grads: Vec<f32>,
        /// ReLU backwards applied: by `relu_backward` or a unit's `keep_masked`.
        masks: usize,
    }

    impl Executor for Recorder {
        fn images_from_host(&mut self, _images: &[f32]) -> Result<(), ModelError> {
            Ok(())
        }

        fn conv_bn_statistics(
            &mut self,
            unit: Unit,
            _reducer: Option<&mut dyn BatchNormReducer>,
        ) -> Result<(), ModelError> {
            self.statistics.push(unit.plan.index);
            Ok(())
        }

        fn bn_apply(
            &mut self,
            unit: Unit,
            residual: ResidualInput,
            _relu: bool,
        ) -> Result<(), ModelError> {
            assert!(
                self.statistics.contains(&unit.plan.index),
                "apply before statistics"
            );
            if let ResidualInput::Normalized(projection) = residual {
                assert!(
                    self.statistics.contains(&projection.index),
                    "projection first"
                );
            }
            assert_ne!(unit.plan.out, unit.plan.z, "apply in place");
            self.applied.push(unit.plan.index);
            Ok(())
        }

        fn conv_bn_eval(
            &mut self,
            unit: Unit,
            residual: Option<Slot>,
            _relu: bool,
            output: Slot,
        ) -> Result<(), ModelError> {
            assert_ne!(output, unit.plan.input, "eval output over its input");
            assert_ne!(residual, Some(output), "eval output over its residual");
            self.evaluated.push(unit.plan.index);
            Ok(())
        }

        fn head_forward(&mut self, _head: &Head, _features: &UnitPlan) -> Result<(), ModelError> {
            Ok(())
        }

        fn loss_forward(&mut self, _labels: &[u32], _smoothing: f32) -> Result<f32, ModelError> {
            Ok(0.0)
        }

        fn logits_to_host(&self, _logits: &mut Vec<f32>) -> Result<(), ModelError> {
            Ok(())
        }

        fn head_backward(
            &mut self,
            head: &Head,
            _features: &UnitPlan,
            _loss_scale: f32,
            _into: GradBuffer,
            ready: &mut GradientsReady,
        ) -> Result<(), ModelError> {
            self.head_backward = true;
            ready.finished_up_to(head.bias.end, &self.grads);
            Ok(())
        }

        fn relu_backward(
            &mut self,
            _grad: GradBuffer,
            _output: Slot,
            _len: usize,
        ) -> Result<(), ModelError> {
            self.masks += 1;
            Ok(())
        }

        fn copy_gradient(
            &mut self,
            from: GradBuffer,
            to: GradBuffer,
            _len: usize,
        ) -> Result<(), ModelError> {
            assert_ne!(from, to, "copy onto itself");
            Ok(())
        }

        fn conv_bn_backward(
            &mut self,
            unit: Unit,
            grad_output: UnitGrad,
            grad_input: GradTarget,
            _reducer: Option<&mut dyn BatchNormReducer>,
            ready: &mut GradientsReady,
        ) -> Result<(), ModelError> {
            assert!(self.head_backward, "unit backward before the head's");
            if let GradTarget::Overwrite(target) | GradTarget::Accumulate(target) = grad_input {
                assert_ne!(target, grad_output.values, "one buffer as input and output");
            }
            if grad_output.keep_masked {
                assert!(
                    grad_output.relu_output.is_some(),
                    "keep_masked without a ReLU"
                );
                self.masks += 1;
            }
            self.backward.push(unit.plan.index);
            ready.finished_up_to(unit.bn.param_range().end, &self.grads);
            ready.finished_up_to(unit.conv.param_range().end, &self.grads);
            Ok(())
        }
    }

    fn specs() -> Vec<ModelSpec> {
        let plain_one_block = ResNetBaseSpec {
            n_blocks: vec![1, 1, 1],
            bottlenecks: None,
            ..ResNetBaseSpec::tutorial_default()
        };
        vec![
            ModelSpec::ResNet18 { num_classes: 10 },
            ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default()),
            ModelSpec::ResNetBase(plain_one_block),
        ]
    }

    fn sorted(mut units: Vec<usize>) -> Vec<usize> {
        units.sort_unstable();
        units
    }

    /// A training step visits every unit once forward and once backward, never hands one
    /// buffer to a method as both input and output, and reports the whole gradient buffer
    /// in increasing, contiguous ranges.
    #[test]
    fn a_training_step_keeps_the_executor_contract() {
        for spec in specs() {
            let (network, layout) = Network::build(&spec);
            let plan = Plan::new(&network, Mode::Train, 2, 32, 32, 3).expect("plan");
            let every_unit: Vec<usize> = (0..plan.units).collect();
            let mut recorder = Recorder {
                grads: vec![0.0; layout.params_len],
                ..Recorder::default()
            };
            forward(&mut recorder, &network, &plan, None).expect("forward");
            assert_eq!(sorted(recorder.statistics.clone()), every_unit, "{spec:?}");
            let shortcuts = plan.blocks.iter().filter(|block| block.shortcut.is_some());
            assert_eq!(
                recorder.applied.len(),
                plan.units - shortcuts.count(),
                "{spec:?}: every unit but the projections applies its batch norm"
            );
            let mut reported = Vec::new();
            let mut hook = |range: Range<usize>, _: &[f32]| reported.push(range);
            let mut ready = GradientsReady::new(&mut hook);
            backward_pass(&mut recorder, &network, &plan, 1.0, None, &mut ready).expect("backward");
            assert_eq!(sorted(recorder.backward.clone()), every_unit, "{spec:?}");
            assert_eq!(
                recorder.masks,
                plan.blocks.len(),
                "{spec:?}: each block's ReLU is undone once"
            );
            assert_eq!(reported.first().map(|range| range.start), Some(0));
            assert_eq!(
                reported.last().map(|range| range.end),
                Some(layout.params_len)
            );
            for pair in reported.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "{spec:?}: ranges {pair:?}");
            }
        }
    }

    /// An evaluation step runs every unit once, never writing a slot it reads.
    #[test]
    fn an_evaluation_step_runs_every_unit_once() {
        for spec in specs() {
            let (network, _) = Network::build(&spec);
            let plan = Plan::new(&network, Mode::Eval, 3, 32, 32, 3).expect("plan");
            let mut recorder = Recorder::default();
            forward(&mut recorder, &network, &plan, None).expect("forward");
            assert_eq!(
                sorted(recorder.evaluated),
                (0..plan.units).collect::<Vec<_>>(),
                "{spec:?}"
            );
            assert!(
                recorder.statistics.is_empty(),
                "{spec:?}: no batch statistics"
            );
        }
    }
}
