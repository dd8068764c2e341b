//! A model instance: flat buffers, forward passes, backward pass and default init.

use std::ops::Range;

use tandem_engine::batchnorm::{
    self, BatchNormParams, BatchNormReducer, BatchNormScratch, BatchNormState, OutputGrad, Residual,
};
use tandem_engine::conv::{
    conv2d_backward, conv2d_forward_fused, ConvOutputGrad, ConvScratch, Epilogue, Fused, InputGrad,
};
use tandem_engine::head;
use tandem_engine::rng::Rng;
use tandem_engine::shape::Conv2dShape;

use crate::error::ModelError;
use crate::network::{BatchNormLayer, Block, ConvLayer, Network};
use crate::spec::ModelSpec;
use crate::tensors::{from_pytorch_order, to_pytorch_order, TensorInfo, TensorKind};
use crate::workspace::{with_output, BlockPlan, Mode, UnitPlan, Workspace};

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

/// The optional SyncBatchNorm reducer, re-borrowable for each layer.
type Reducer<'a> = Option<&'a mut dyn BatchNormReducer>;

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
        let result = self.forward(&mut workspace, bn_sync).and_then(|()| {
            workspace.labels.clear();
            workspace.labels.extend_from_slice(labels);
            workspace.label_smoothing = loss.label_smoothing;
            head::cross_entropy_forward(
                &workspace.logits,
                labels,
                loss.label_smoothing,
                &mut workspace.probabilities,
            )
            .map_err(ModelError::from)
        });
        self.logits.clear();
        self.logits.extend_from_slice(&workspace.logits);
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
        let result = self.forward(&mut workspace, None);
        self.logits.clear();
        self.logits.extend_from_slice(&workspace.logits);
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
        let mut reporter = Reporter {
            done: 0,
            grad_ready,
        };
        let result = backward_pass(
            &self.network,
            &self.params,
            &mut self.grads,
            &mut workspace,
            loss_scale,
            bn_sync,
            &mut reporter,
        );
        self.train_workspace = Some(workspace);
        result
    }

    /// Takes (or builds) the workspace for this mode and batch shape, with the images copied in.
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
        let mut workspace = match cached {
            Some(workspace) if workspace.fits(batch, height, width) => workspace,
            _ => Workspace::new(&self.network, mode, batch, height, width, channels)?,
        };
        let slot = workspace.images;
        workspace.slots[slot][..images.len()].copy_from_slice(images);
        Ok(workspace)
    }

    /// Runs the network on the images in the workspace, leaving logits in `workspace.logits`.
    fn forward(
        &mut self,
        workspace: &mut Workspace,
        mut reducer: Reducer,
    ) -> Result<(), ModelError> {
        let Model {
            network,
            params,
            buffers,
            ..
        } = self;
        let mode = workspace.mode;
        let ws = workspace;
        if mode == Mode::Eval {
            forward_eval_layers(network, params, buffers, ws)?;
            return Ok(());
        }
        let network: &Network = network;
        let stem = &network.stem;
        let mut layer = TrainLayers {
            params,
            buffers,
            conv_scratch: &mut ws.conv_scratch,
            bn_scratch: &mut ws.bn_scratch,
            output_sums: &mut ws.output_sums,
        };
        layer.conv_with_statistics(
            &stem.conv,
            &stem.bn,
            &mut ws.stem,
            &mut ws.slots,
            reborrow(&mut reducer),
        )?;
        let (z, out, len) = (ws.stem.z, ws.stem.out, ws.stem.output_len());
        let relu = network.stem_relu;
        with_output(&mut ws.slots, out, |slots, output| {
            batchnorm::apply(
                &slots[z][..len],
                &ws.stem.bn,
                Residual::None,
                relu,
                &mut output[..len],
            );
        });
        for (block, plan) in network.blocks.iter().zip(&mut ws.blocks) {
            block_forward(block, plan, &mut layer, &mut ws.slots, &mut reducer)?;
        }
        head_forward(network, params, ws);
        Ok(())
    }
}

/// Average pooling and the linear classifier on the last block's output, into
/// `ws.logits`.
fn head_forward(network: &Network, params: &[f32], ws: &mut Workspace) {
    let last = ws.final_output();
    let features = &ws.slots[last.out][..last.output_len()];
    head::average_pool_forward(features, ws.final_pixels, ws.final_channels, &mut ws.pooled);
    let head = &network.head;
    head::linear_forward(
        &ws.pooled,
        &params[head.weight.clone()],
        &params[head.bias.clone()],
        &mut ws.logits,
    );
}

/// The eval-mode network up to the logits: each convolution with its batch norm (running
/// statistics), residual add and ReLU in one pass.
fn forward_eval_layers(
    network: &Network,
    params: &[f32],
    buffers: &[f32],
    ws: &mut Workspace,
) -> Result<(), ModelError> {
    let mut layers = EvalLayers {
        params,
        buffers,
        slots: &mut ws.slots,
        scratch: &mut ws.conv_scratch,
    };
    let stem = &network.stem;
    let stem_out = ws.stem.out;
    layers.run(
        &stem.conv,
        &stem.bn,
        &mut ws.stem,
        None,
        network.stem_relu,
        stem_out,
    );
    for (block, plan) in network.blocks.iter().zip(&mut ws.blocks) {
        let Block { units, shortcut } = block;
        let mut residual = plan.units.first().map(|unit_plan| unit_plan.input);
        if let (Some(unit), Some(unit_plan)) = (shortcut, &mut plan.shortcut) {
            let z = unit_plan.z;
            layers.run(&unit.conv, &unit.bn, unit_plan, None, false, z);
            residual = Some(z);
        }
        let last = units.len().saturating_sub(1);
        for (index, (unit, unit_plan)) in units.iter().zip(&mut plan.units).enumerate() {
            let residual = if index == last { residual } else { None };
            let out = unit_plan.out;
            layers.run(&unit.conv, &unit.bn, unit_plan, residual, true, out);
        }
    }
    head_forward(network, params, ws);
    Ok(())
}

/// What every eval-mode layer reads and writes.
struct EvalLayers<'a> {
    params: &'a [f32],
    buffers: &'a [f32],
    slots: &'a mut [Vec<f32>],
    scratch: &'a mut ConvScratch,
}

impl EvalLayers<'_> {
    /// `slots[output] = [relu](bn(conv(slots[plan.input])) [+ slots[residual]])`.
    fn run(
        &mut self,
        conv: &ConvLayer,
        bn: &BatchNormLayer,
        plan: &mut UnitPlan,
        residual: Option<usize>,
        relu: bool,
        output: usize,
    ) {
        let affine = BatchNormParams {
            weight: &self.params[bn.weight.clone()],
            bias: &self.params[bn.bias.clone()],
        };
        batchnorm::eval_statistics(
            &affine,
            &self.buffers[bn.running_mean.clone()],
            &self.buffers[bn.running_var.clone()],
            &mut plan.bn,
        );
        let work = UnitWork::Epilogue {
            state: &plan.bn,
            residual,
            relu,
        };
        run_conv(
            conv,
            plan,
            self.params,
            self.slots,
            output,
            work,
            self.scratch,
        );
    }
}

/// What a unit's convolution does to its output chunks besides computing them.
enum UnitWork<'a> {
    /// Evaluation: the batch norm (its scale and shift), the residual in the named slot and
    /// the ReLU, applied in place.
    Epilogue {
        state: &'a BatchNormState,
        residual: Option<usize>,
        relu: bool,
    },
    /// Training: gather the output's per-channel sums for its batch norm.
    OutputSums(&'a mut Vec<f64>),
}

/// `slots[output] = conv(slots[plan.input])`, with `work` fused into it.
fn run_conv(
    conv: &ConvLayer,
    plan: &UnitPlan,
    params: &[f32],
    slots: &mut [Vec<f32>],
    output: usize,
    work: UnitWork,
    scratch: &mut ConvScratch,
) {
    let shape = &plan.shape;
    let weight = &params[conv.weight.clone()];
    let bias = conv.bias.as_ref().map(|range| &params[range.clone()]);
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
            &slots[plan.input][..shape.input_len()],
            weight,
            bias,
            fused,
            &mut output[..shape.output_len()],
            scratch,
        );
    });
}

/// Forward of one residual block in training mode.
fn block_forward(
    block: &Block,
    plan: &mut BlockPlan,
    layer: &mut TrainLayers,
    slots: &mut [Vec<f32>],
    reducer: &mut Reducer,
) -> Result<(), ModelError> {
    let Block { units, shortcut } = block;
    let BlockPlan {
        units: unit_plans,
        shortcut: shortcut_plan,
    } = plan;
    if let (Some(unit), Some(unit_plan)) = (shortcut, shortcut_plan.as_mut()) {
        layer.conv_with_statistics(&unit.conv, &unit.bn, unit_plan, slots, reborrow(reducer))?;
    }
    let block_input = unit_plans.first().map_or(0, |unit_plan| unit_plan.input);
    let last = units.len().saturating_sub(1);
    for (index, (unit, unit_plan)) in units.iter().zip(unit_plans.iter_mut()).enumerate() {
        layer.conv_with_statistics(&unit.conv, &unit.bn, unit_plan, slots, reborrow(reducer))?;
        let (z, out, len) = (unit_plan.z, unit_plan.out, unit_plan.output_len());
        with_output(slots, out, |slots, output| {
            let residual = if index < last {
                Residual::None
            } else {
                match shortcut_plan {
                    Some(projection_plan) => Residual::Normalized {
                        input: &slots[projection_plan.z][..len],
                        state: &projection_plan.bn,
                    },
                    _ => Residual::Identity(&slots[block_input][..len]),
                }
            };
            batchnorm::apply(
                &slots[z][..len],
                &unit_plan.bn,
                residual,
                true,
                &mut output[..len],
            );
        });
    }
    Ok(())
}

/// What every training-mode layer reads and writes, besides the activations.
struct TrainLayers<'a> {
    params: &'a [f32],
    buffers: &'a mut [f32],
    conv_scratch: &'a mut ConvScratch,
    bn_scratch: &'a mut BatchNormScratch,
    output_sums: &'a mut Vec<f64>,
}

impl TrainLayers<'_> {
    /// `slots[plan.z] = conv(slots[plan.input])`, with the batch statistics of the result
    /// gathered on the way and turned into the batch norm's state (and running statistics).
    fn conv_with_statistics(
        &mut self,
        conv: &ConvLayer,
        bn: &BatchNormLayer,
        plan: &mut UnitPlan,
        slots: &mut [Vec<f32>],
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        let shape: &Conv2dShape = &plan.shape;
        let work = UnitWork::OutputSums(&mut *self.output_sums);
        run_conv(
            conv,
            plan,
            self.params,
            slots,
            plan.z,
            work,
            self.conv_scratch,
        );
        let affine = BatchNormParams {
            weight: &self.params[bn.weight.clone()],
            bias: &self.params[bn.bias.clone()],
        };
        let (running_mean, running_var) =
            two_ranges_mut(self.buffers, &bn.running_mean, &bn.running_var);
        let rows = shape.output_len() / shape.out_channels.max(1);
        batchnorm::train_statistics_from_sums(
            rows,
            self.output_sums,
            &affine,
            running_mean,
            running_var,
            &mut plan.bn,
            reducer,
            self.bn_scratch,
        )?;
        Ok(())
    }
}

/// Re-borrows the optional reducer for one layer.
fn reborrow<'s>(reducer: &'s mut Reducer<'_>) -> Option<&'s mut dyn BatchNormReducer> {
    match reducer {
        Some(reducer) => Some(&mut **reducer),
        None => None,
    }
}

/// Calls `grad_ready` with the part of the gradient buffer finished since the last call.
struct Reporter<'a> {
    done: usize,
    grad_ready: &'a mut dyn FnMut(Range<usize>, &[f32]),
}

impl Reporter<'_> {
    fn finished_up_to(&mut self, end: usize, grads: &[f32]) {
        if end > self.done {
            (self.grad_ready)(self.done..end, &grads[self.done..end]);
            self.done = end;
        }
    }
}

/// The gradient buffers of the backward pass: `current` holds the gradient at the output of
/// the block being processed, `other` receives the block input gradient when the block has
/// a projection shortcut, `first`/`second` hold gradients inside the block.
struct GradBuffers<'a> {
    current: &'a mut Vec<f32>,
    other: &'a mut Vec<f32>,
    first: &'a mut Vec<f32>,
    second: &'a mut Vec<f32>,
}

fn backward_pass(
    network: &Network,
    params: &[f32],
    grads: &mut [f32],
    ws: &mut Workspace,
    loss_scale: f32,
    mut reducer: Reducer,
    reporter: &mut Reporter,
) -> Result<(), ModelError> {
    head::cross_entropy_backward(
        &ws.probabilities,
        &ws.labels,
        ws.label_smoothing,
        loss_scale,
        &mut ws.grad_logits,
    );
    let head = &network.head;
    let (grad_weight, grad_bias) = two_ranges_mut(grads, &head.weight, &head.bias);
    head::linear_backward(
        &ws.pooled,
        &params[head.weight.clone()],
        &ws.grad_logits,
        grad_weight,
        grad_bias,
        Some(&mut ws.grad_pooled),
    );
    reporter.finished_up_to(head.bias.end, grads);

    let [g0, g1, g2, g3] = &mut ws.grad_buffers;
    let mut buffers = GradBuffers {
        current: g0,
        other: g1,
        first: g2,
        second: g3,
    };
    let last = ws
        .blocks
        .last()
        .and_then(|block| block.units.last())
        .unwrap_or(&ws.stem);
    let last_len = last.output_len();
    head::average_pool_backward(
        &ws.grad_pooled,
        ws.final_pixels,
        ws.final_channels,
        &mut buffers.current[..last_len],
    );
    for (block, plan) in network.blocks.iter().zip(&ws.blocks).rev() {
        let projected = block_backward(
            block,
            plan,
            params,
            grads,
            &ws.slots,
            &mut buffers,
            &mut ws.conv_scratch,
            &mut ws.bn_scratch,
            &mut reducer,
            reporter,
        )?;
        if projected {
            std::mem::swap(&mut buffers.current, &mut buffers.other);
        }
    }
    let stem = &network.stem;
    let len = ws.stem.output_len();
    let stem_grad = OutputGrad {
        values: &buffers.current[..len],
        relu_output: network.stem_relu.then(|| &ws.slots[ws.stem.out][..len]),
    };
    let mut scratch = Scratch {
        conv: &mut ws.conv_scratch,
        bn: &mut ws.bn_scratch,
    };
    unit_backward(
        (&stem.conv, &stem.bn, &ws.stem),
        params,
        grads,
        &ws.slots,
        stem_grad,
        InputGrad::Skip,
        &mut scratch,
        reborrow(&mut reducer),
        reporter,
    )?;
    Ok(())
}

/// Backward of one residual block; `buffers.current` holds the gradient at its output.
/// Returns `true` when the input gradient was left in `buffers.other` (projection shortcut)
/// rather than in `buffers.current` (identity shortcut).
#[allow(clippy::too_many_arguments)]
fn block_backward(
    block: &Block,
    plan: &BlockPlan,
    params: &[f32],
    grads: &mut [f32],
    slots: &[Vec<f32>],
    buffers: &mut GradBuffers,
    conv_scratch: &mut ConvScratch,
    bn_scratch: &mut BatchNormScratch,
    reducer: &mut Reducer,
    reporter: &mut Reporter,
) -> Result<bool, ModelError> {
    let Some(last_plan) = plan.units.last() else {
        return Ok(false);
    };
    let out_len = last_plan.output_len();
    batchnorm::relu_backward_in_place(
        &mut buffers.current[..out_len],
        &slots[last_plan.out][..out_len],
    );
    let mut scratch = Scratch {
        conv: conv_scratch,
        bn: bn_scratch,
    };
    let projected = match (&block.shortcut, &plan.shortcut) {
        (Some(unit), Some(unit_plan)) => {
            let len = unit_plan.output_len();
            let input_len = unit_plan.shape.input_len();
            let grad_output = OutputGrad {
                values: &buffers.current[..len],
                relu_output: None,
            };
            unit_backward(
                (&unit.conv, &unit.bn, unit_plan),
                params,
                grads,
                slots,
                grad_output,
                InputGrad::Overwrite(&mut buffers.other[..input_len]),
                &mut scratch,
                reborrow(reducer),
                reporter,
            )?;
            true
        }
        _ => false,
    };
    let last = plan.units.len() - 1;
    // A one-unit block with an identity shortcut gathers its input gradient in `other`,
    // since its unit reads the gradient in `current`.
    let input_in_other = projected || last == 0;
    if !projected && last == 0 {
        let len = last_plan.shape.input_len();
        buffers.other[..len].copy_from_slice(&buffers.current[..len]);
    }
    for (index, (unit, unit_plan)) in block.units.iter().zip(&plan.units).enumerate().rev() {
        let len = unit_plan.output_len();
        let input_len = unit_plan.shape.input_len();
        let GradBuffers {
            current,
            other,
            first,
            second,
        } = &mut *buffers;
        // Inside the block, the gradient at a unit's output is in `second`, the ReLU after the
        // unit undone within its batch-norm pass; the unit writes the gradient at its input
        // into `first`, and the two swap roles for the next unit.
        let (grad_output, grad_input) = if index == last {
            let grad_output = OutputGrad {
                values: &current[..len],
                relu_output: None,
            };
            let grad_input = if index == 0 {
                InputGrad::Accumulate(&mut other[..input_len])
            } else {
                InputGrad::Overwrite(&mut first[..input_len])
            };
            (grad_output, grad_input)
        } else {
            let grad_output = OutputGrad {
                values: &second[..len],
                relu_output: Some(&slots[unit_plan.out][..len]),
            };
            let grad_input = match (index, input_in_other) {
                (0, true) => InputGrad::Accumulate(&mut other[..input_len]),
                (0, false) => InputGrad::Accumulate(&mut current[..input_len]),
                _ => InputGrad::Overwrite(&mut first[..input_len]),
            };
            (grad_output, grad_input)
        };
        unit_backward(
            (&unit.conv, &unit.bn, unit_plan),
            params,
            grads,
            slots,
            grad_output,
            grad_input,
            &mut scratch,
            reborrow(reducer),
            reporter,
        )?;
        std::mem::swap(&mut buffers.first, &mut buffers.second);
    }
    Ok(input_in_other)
}

/// The kernels' scratch buffers.
struct Scratch<'a> {
    conv: &'a mut ConvScratch,
    bn: &'a mut BatchNormScratch,
}

/// Backward of one convolution + batch-norm unit, given the gradient at the batch norm's
/// output: the batch norm's sums (and its parameter gradients), then the convolution's
/// backward with the batch norm's input gradient computed chunk by chunk inside it.
#[allow(clippy::too_many_arguments)]
fn unit_backward(
    (conv, bn, plan): (&ConvLayer, &BatchNormLayer, &UnitPlan),
    params: &[f32],
    grads: &mut [f32],
    slots: &[Vec<f32>],
    grad_output: OutputGrad,
    grad_input: InputGrad,
    scratch: &mut Scratch,
    reducer: Reducer,
    reporter: &mut Reporter,
) -> Result<(), ModelError> {
    let z = &slots[plan.z][..plan.output_len()];
    let (grad_weight, grad_bias) = two_ranges_mut(grads, &bn.weight, &bn.bias);
    let coefficients = batchnorm::backward_coefficients(
        grad_output,
        z,
        &params[bn.weight.clone()],
        &plan.bn,
        grad_weight,
        grad_bias,
        reducer,
        scratch.bn,
    )?;
    reporter.finished_up_to(bn.param_range().end, grads);
    let through_batch_norm = ConvOutputGrad::ThroughBatchNorm {
        grad: grad_output,
        bn_input: z,
        coefficients,
    };
    conv_backward(
        conv,
        plan,
        params,
        grads,
        slots,
        through_batch_norm,
        grad_input,
        scratch.conv,
    );
    reporter.finished_up_to(conv.param_range().end, grads);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn conv_backward(
    conv: &ConvLayer,
    plan: &UnitPlan,
    params: &[f32],
    grads: &mut [f32],
    slots: &[Vec<f32>],
    grad_output: ConvOutputGrad,
    grad_input: InputGrad,
    scratch: &mut ConvScratch,
) {
    let shape = &plan.shape;
    let input = &slots[plan.input][..shape.input_len()];
    let weight = &params[conv.weight.clone()];
    let (grad_weight, grad_bias) = match &conv.bias {
        Some(bias) => {
            let (weight, bias) = two_ranges_mut(grads, &conv.weight, bias);
            (weight, Some(bias))
        }
        None => (&mut grads[conv.weight.clone()], None),
    };
    conv2d_backward(
        shape,
        input,
        weight,
        grad_output,
        grad_weight,
        grad_bias,
        grad_input,
        scratch,
    );
}

/// Two disjoint ranges of one buffer, mutably; `first` must end before `second` starts.
fn two_ranges_mut<'a>(
    buffer: &'a mut [f32],
    first: &Range<usize>,
    second: &Range<usize>,
) -> (&'a mut [f32], &'a mut [f32]) {
    let (head, tail) = buffer.split_at_mut(second.start);
    (&mut head[first.clone()], &mut tail[..second.len()])
}
