//! The executor interface: what a device implements to run the shared network description.
//!
//! The network (its layers, e.g. [`ConvLayer`], and their ranges in the flat buffers) and the
//! [`Plan`] of a batch shape (layer shapes, activation slots) are plain data shared by every
//! device. The walk over the network (forward order, residual adds, which gradient buffer
//! holds what in the backward, when a gradient range is final) is written once, in
//! `model.rs`, over this trait. An executor owns the storage: the activation slots of a
//! plan, four gradient buffers, per-unit batch-norm state, its scratch, and (through the
//! step it is made for) the flat parameter, gradient and running-statistic buffers. The CPU
//! executor (`cpu.rs`) is the first implementation; its fusions (batch-norm sums
//! inside the convolution's forward, the batch-norm input gradient inside the
//! convolution's backward, eval-mode batch norm + residual + ReLU as the convolution's
//! epilogue) sit behind single methods, so a device may fuse the same way or not at all.
//!
//! # Host/device crossings
//! Everything that crosses between host memory and the executor's memory is named here:
//! - **Images in, labels in, loss and logits out:** [`Executor::images_from_host`],
//!   [`Executor::loss_forward`] (labels in, the mean loss out as an `f32`),
//!   [`Executor::logits_to_host`].
//! - **Finished gradients:** [`Executor::conv_bn_backward`] and [`Executor::head_backward`]
//!   call [`GradientsReady::finished_up_to`] with the *host* values of the gradient buffer
//!   as each range becomes final (the data-parallel all-reduce reads them there); an
//!   executor on a device copies the range to the host first.
//! - **SyncBatchNorm:** the [`BatchNormReducer`] sums `f64` statistics in host memory
//!   (`[count, Σx…, Σx²…]` forward, `[Σdy…, Σdy·x̂…]` backward, per channel); an executor
//!   on a device copies its sums to the host, reduces, and copies them back.
//! - **Outside a step** (not in this trait): the flat buffers are host slices on the CPU
//!   (`Model::params()`, `grads()`, `buffers()` and their `_mut` forms, used by
//!   checkpoints, snapshots, broadcasts and the optimizer); `Optimizer::step(&mut [f32],
//!   &[f32])` updates host slices; `tandem_engine::set_threads` sets the CPU kernels'
//!   worker count for the whole process. A device executor keeps the flat buffers in its
//!   memory, copies them to and from the host only for those uses, and runs its own
//!   optimizer kernels with the same [`tandem_engine::OptimizerState`] slot layout.

use std::ops::Range;

use tandem_engine::BatchNormReducer;

use crate::error::ModelError;
use crate::network::{BatchNormLayer, ConvLayer, Head};
#[cfg(doc)]
use crate::workspace::Plan;
use crate::workspace::{Slot, UnitPlan};

/// One convolution + batch-norm unit in a step: its layers (parameter ranges in the flat
/// buffers) and its plan (shape, slots, unit number).
#[derive(Clone, Copy)]
pub struct Unit<'a> {
    /// The convolution: weight and optional bias ranges in the flat parameters.
    pub conv: &'a ConvLayer,
    /// The batch norm: parameter ranges and running-statistic ranges.
    pub bn: &'a BatchNormLayer,
    /// The unit's shape and slots for this batch.
    pub plan: &'a UnitPlan,
}

/// One of the four gradient buffers of the backward pass (each [`Plan::grad_len`] values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GradBuffer(pub usize);

/// What a training-mode unit adds to its normalized output before the ReLU.
#[derive(Clone, Copy)]
pub enum ResidualInput<'a> {
    /// Nothing.
    None,
    /// The values of a slot (an identity shortcut).
    Identity(Slot),
    /// A projection shortcut's convolution output, normalized with that unit's batch
    /// statistics (its batch norm applied inside the add).
    Normalized(&'a UnitPlan),
}

/// The gradient at a unit's output (after its batch norm, residual add and ReLU).
#[derive(Clone, Copy)]
pub struct UnitGrad {
    /// The buffer holding the gradient values (the unit's output length).
    pub values: GradBuffer,
    /// The slot holding the output of a ReLU that followed the unit, if its backward is
    /// still to be applied: the gradient counts only where that output is positive.
    pub relu_output: Option<Slot>,
    /// Whether the backward also leaves that ReLU's backward applied to `values`, for a
    /// shortcut that reads the same gradient next (a block's output gradient, masked once by
    /// the block's first unit backward rather than by a pass of its own). Only with
    /// `relu_output`.
    pub keep_masked: bool,
}

/// Where a unit's backward puts the gradient at its input.
#[derive(Clone, Copy)]
pub enum GradTarget {
    /// Not needed (the stem).
    Skip,
    /// Written into the buffer, replacing its values.
    Overwrite(GradBuffer),
    /// Added to the buffer's values.
    Accumulate(GradBuffer),
}

/// The gradient-ready hook of the backward pass: reports each part of the flat gradient
/// buffer once it is final, in increasing order, with its host values.
pub struct GradientsReady<'a> {
    done: usize,
    hook: &'a mut dyn FnMut(Range<usize>, &[f32]),
}

impl<'a> GradientsReady<'a> {
    /// A reporter that has reported nothing yet.
    pub fn new(hook: &'a mut dyn FnMut(Range<usize>, &[f32])) -> Self {
        GradientsReady { done: 0, hook }
    }

    /// Reports the gradients from the end of the last report up to `end`; `grads` are the
    /// host values of the whole flat gradient buffer (at least up to `end`).
    pub fn finished_up_to(&mut self, end: usize, grads: &[f32]) {
        if end > self.done {
            (self.hook)(self.done..end, &grads[self.done..end]);
            self.done = end;
        }
    }
}

/// A device's implementation of one training or evaluation step over a [`Plan`].
///
/// The model calls, for a training step: [`images_from_host`](Executor::images_from_host);
/// per unit in forward order [`conv_bn_statistics`](Executor::conv_bn_statistics) then (except
/// for projection shortcuts) [`bn_apply`](Executor::bn_apply); [`head_forward`](Executor::head_forward);
/// [`loss_forward`](Executor::loss_forward); then for the backward
/// [`head_backward`](Executor::head_backward) and, per block from last to first,
/// [`conv_bn_backward`](Executor::conv_bn_backward) per unit from last to first (the
/// projection shortcut's first), the first of them undoing the block's ReLU with
/// [`UnitGrad::keep_masked`]; a block of one unit with an identity shortcut calls
/// [`relu_backward`](Executor::relu_backward) and [`copy_gradient`](Executor::copy_gradient)
/// before its unit instead. An
/// evaluation step calls [`conv_bn_eval`](Executor::conv_bn_eval) per unit instead of the two
/// training-mode calls. Lengths are those of the plan; the model never passes one buffer both
/// as a method's input and its output.
///
/// # Errors
/// Every method returns a [`ModelError`], and the walk stops at the first: the engine's own
/// errors (a label out of range, a failed SyncBatchNorm reduction) as
/// [`ModelError::Engine`], whichever device found them, and a device's failure (a call and
/// its status) as [`ModelError::Device`].
pub trait Executor {
    /// Copies the NHWC images `[batch, height, width, channels]` into the plan's image slot.
    fn images_from_host(&mut self, images: &[f32]) -> Result<(), ModelError>;

    /// Training forward of a unit's convolution: `z = conv(input) [+ bias]`, then the batch
    /// norm's batch statistics of `z` (summed across processes by `reducer`), kept for
    /// [`bn_apply`](Executor::bn_apply) and the backward; updates the running statistics
    /// (momentum 0.1, unbiased variance), as PyTorch's `BatchNorm2d` does.
    fn conv_bn_statistics(
        &mut self,
        unit: Unit,
        reducer: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError>;

    /// Training forward of a unit's batch norm: `out = [relu](bn(z) [+ residual])` with the
    /// statistics of the last [`conv_bn_statistics`](Executor::conv_bn_statistics) of `unit`.
    fn bn_apply(
        &mut self,
        unit: Unit,
        residual: ResidualInput,
        relu: bool,
    ) -> Result<(), ModelError>;

    /// Evaluation forward of a unit: `slot output = [relu](bn(conv(input)) [+ slot residual])`
    /// with the running statistics.
    fn conv_bn_eval(
        &mut self,
        unit: Unit,
        residual: Option<Slot>,
        relu: bool,
        output: Slot,
    ) -> Result<(), ModelError>;

    /// Global average pooling of `features` (the last unit's output) and the linear layer,
    /// giving the logits `[batch, classes]`.
    fn head_forward(&mut self, head: &Head, features: &UnitPlan) -> Result<(), ModelError>;

    /// Cross-entropy of the logits against `labels` (with `label_smoothing`, as PyTorch's
    /// `CrossEntropyLoss`); keeps what the backward needs and returns the mean loss.
    fn loss_forward(&mut self, labels: &[u32], label_smoothing: f32) -> Result<f32, ModelError>;

    /// Copies the logits `[batch, classes]` of the last forward to the host.
    fn logits_to_host(&self, logits: &mut Vec<f32>) -> Result<(), ModelError>;

    /// Backward of the loss (scaled by `loss_scale`), the linear layer (adding to its
    /// parameter gradients, then reporting them to `ready`) and the pooling: writes the
    /// gradient at `features` (the last unit's output) into `into`.
    fn head_backward(
        &mut self,
        head: &Head,
        features: &UnitPlan,
        loss_scale: f32,
        into: GradBuffer,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError>;

    /// ReLU backward: zeroes the first `len` values of `grad` where slot `output` (the
    /// ReLU's output) is not positive.
    fn relu_backward(
        &mut self,
        grad: GradBuffer,
        output: Slot,
        len: usize,
    ) -> Result<(), ModelError>;

    /// Copies the first `len` values of gradient buffer `from` into `to`.
    fn copy_gradient(
        &mut self,
        from: GradBuffer,
        to: GradBuffer,
        len: usize,
    ) -> Result<(), ModelError>;

    /// Backward of a unit given the gradient at its output: adds the batch norm's parameter
    /// gradients (sums across processes by `reducer`) and reports them to `ready`, then adds
    /// the convolution's weight (and bias) gradients and reports them, and puts the gradient
    /// at the unit's input where `grad_input` says.
    fn conv_bn_backward(
        &mut self,
        unit: Unit,
        grad_output: UnitGrad,
        grad_input: GradTarget,
        reducer: Option<&mut dyn BatchNormReducer>,
        ready: &mut GradientsReady,
    ) -> Result<(), ModelError>;
}
