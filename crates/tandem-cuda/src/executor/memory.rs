//! How a [`Plan`] maps onto device allocations: plain sizes computed on the host (tested
//! without a GPU), then one allocation per slot and buffer ([`DeviceStorage`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tandem_models::workspace::{Mode, Plan};

use super::error::{driver, GpuError};
use super::launch::{channel_groups, row_blocks};
use super::{address, Precision};

/// The element type of a plan's activations: every slot but the images', the gradients at
/// them and the batch norm's input gradient. Float32, or under [`Precision::Bf16`] bfloat16,
/// as PyTorch autocast keeps them. The images slot is float32 (the loader's and the device
/// data set's images), which the stem's convolution narrows; an evaluation plan may reuse it
/// later for bfloat16 activations, which fit in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// float32.
    F32,
    /// bfloat16, as its 16 bits.
    Bf16,
}

impl Activations {
    /// The activations computing in `precision`.
    pub fn of(precision: Precision) -> Self {
        match precision {
            Precision::Fp32 | Precision::Tf32 => Activations::F32,
            Precision::Bf16 => Activations::Bf16,
        }
    }

    /// Bytes an element.
    pub fn bytes(self) -> usize {
        match self {
            Activations::F32 => 4,
            Activations::Bf16 => 2,
        }
    }
}

/// A device buffer of activations of one element type.
pub enum ActivationBuffer {
    /// float32 values.
    F32(CudaSlice<f32>),
    /// bfloat16 values, as their bits.
    Bf16(CudaSlice<u16>),
}

impl ActivationBuffer {
    /// `len` zeros of `kind`.
    fn zeros(stream: &Arc<CudaStream>, kind: Activations, len: usize) -> Result<Self, GpuError> {
        Ok(match kind {
            Activations::F32 => ActivationBuffer::F32(zeros(stream, len)?),
            Activations::Bf16 => ActivationBuffer::Bf16(zeros(stream, len)?),
        })
    }

    /// Its device address.
    pub fn address(&self, stream: &CudaStream) -> u64 {
        match self {
            ActivationBuffer::F32(slice) => address(slice, stream),
            ActivationBuffer::Bf16(slice) => address(slice, stream),
        }
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        match self {
            ActivationBuffer::F32(slice) => slice.len(),
            ActivationBuffer::Bf16(slice) => slice.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The float32 values; an error for bfloat16 ones (the images slot is float32 always).
    pub fn f32(&self) -> Result<&CudaSlice<f32>, GpuError> {
        match self {
            ActivationBuffer::F32(slice) => Ok(slice),
            ActivationBuffer::Bf16(_) => Err(GpuError::Unsupported(
                "float32 values asked of a bfloat16 buffer",
            )),
        }
    }

    /// The float32 values, mutably (see [`ActivationBuffer::f32`]).
    pub fn f32_mut(&mut self) -> Result<&mut CudaSlice<f32>, GpuError> {
        match self {
            ActivationBuffer::F32(slice) => Ok(slice),
            ActivationBuffer::Bf16(_) => Err(GpuError::Unsupported(
                "float32 values asked of a bfloat16 buffer",
            )),
        }
    }
}

/// Where each unit's batch-norm state (mean, 1/std, scale, shift; `channels` floats each)
/// lies in one flat device buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchNormStateLayout {
    /// Per unit (by `UnitPlan::index`): the offset of its mean and its channels.
    units: Vec<(usize, usize)>,
    /// Floats in all.
    pub len: usize,
}

/// One of the four per-channel vectors of a unit's batch-norm state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatePart {
    /// The batch mean (training).
    Mean = 0,
    /// 1 / sqrt(variance + eps).
    InvStd = 1,
    /// weight * invstd.
    Scale = 2,
    /// bias - mean * scale.
    Shift = 3,
}

impl BatchNormStateLayout {
    /// The layout of every unit of `plan`.
    pub fn new(plan: &Plan) -> Self {
        let mut units = vec![(0, 0); plan.units];
        let mut len = 0;
        for unit in plan.unit_plans() {
            let channels = unit.shape.out_channels;
            units[unit.index] = (len, channels);
            len += 4 * channels;
        }
        BatchNormStateLayout { units, len }
    }

    /// The offset of `part` of unit `index` in the flat state buffer.
    pub fn offset(&self, index: usize, part: StatePart) -> usize {
        let (start, channels) = self.units[index];
        start + part as usize * channels
    }
}

/// The bfloat16 scratch buffers of [`Precision::Bf16`], in elements, for the operands that
/// are float32 in memory (`executor/autocast.rs`): the images a convolution reads, every
/// filter, the linear layer's input and output gradient (the pooled features and the logits
/// are float32), and the weight gradients before they are added to the float32 gradients.
/// One set serves every layer in turn (all run on one stream), so each is as large as the
/// largest operand of its role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bf16ScratchSizes {
    /// The images of a convolution that reads the images slot, the linear layer's input.
    pub input: usize,
    /// The linear layer's output gradient.
    pub output: usize,
    /// A convolution's filter (and its gradient), the linear layer's weight.
    pub filter: usize,
}

impl Bf16ScratchSizes {
    /// The largest operands of `plan`'s convolutions and linear layer in each role.
    pub fn new(plan: &Plan) -> Self {
        let mut sizes = Bf16ScratchSizes {
            input: plan.batch * plan.final_channels,
            output: plan.batch * plan.classes,
            filter: plan.classes * plan.final_channels,
        };
        // The stem alone reads the images (an evaluation plan may reuse their slot later for
        // bfloat16 activations).
        sizes.input = sizes.input.max(plan.stem.shape.input_len());
        for unit in plan.unit_plans() {
            sizes.filter = sizes.filter.max(unit.shape.weight_len());
        }
        sizes
    }

    /// Elements in all.
    pub fn len(&self) -> usize {
        self.input + self.output + self.filter
    }

    /// Whether there are none (other precisions).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The sizes of every device allocation of a plan, in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageSizes {
    /// The element type of the activations.
    pub activations: Activations,
    /// The images slot (float32 whatever the activations).
    pub images: usize,
    /// Each activation slot (the plan's own sizes).
    pub slots: Vec<usize>,
    /// Each of the four gradient buffers, and the batch norm's input gradient (`dz`).
    pub grad_len: usize,
    /// Pooled features `[batch, channels]`.
    pub pooled: usize,
    /// Logits `[batch, classes]`, and (training) probabilities and their gradient.
    pub logits: usize,
    /// Training only: the pooled features' gradient.
    pub grad_pooled: usize,
    /// Per-unit batch-norm state.
    pub bn_state: BatchNormStateLayout,
    /// The largest partial sums of a column sum: `row_blocks * 2 * channels` doubles.
    pub partials: usize,
    /// The largest totals: `1 + 2 * channels` doubles.
    pub totals: usize,
    /// The column sums' arrival counters, one per group of 32 channels of the widest layer.
    pub arrivals: usize,
    /// The largest backward coefficients: `3 * channels` floats.
    pub coefficients: usize,
    /// The bfloat16 scratch buffers (all zero unless the precision is bf16).
    pub bf16: Bf16ScratchSizes,
}

impl StorageSizes {
    /// The sizes `plan` needs computing in `precision`.
    pub fn new(plan: &Plan, precision: Precision) -> Self {
        let train = plan.mode == Mode::Train;
        let mut partials = row_blocks(plan.batch) * 2 * plan.classes;
        let mut channels = plan.classes;
        for unit in plan.unit_plans() {
            let rows = unit.shape.output_len() / unit.shape.out_channels.max(1);
            partials = partials.max(row_blocks(rows) * 2 * unit.shape.out_channels);
            channels = channels.max(unit.shape.out_channels);
        }
        StorageSizes {
            activations: Activations::of(precision),
            images: plan.images,
            slots: plan.slot_lens.clone(),
            grad_len: plan.grad_len,
            pooled: plan.batch * plan.final_channels,
            logits: plan.batch * plan.classes,
            grad_pooled: if train {
                plan.batch * plan.final_channels
            } else {
                0
            },
            bn_state: BatchNormStateLayout::new(plan),
            partials,
            totals: 1 + 2 * channels,
            arrivals: channel_groups(channels),
            coefficients: 3 * channels,
            bf16: match precision {
                Precision::Bf16 => Bf16ScratchSizes::new(plan),
                Precision::Fp32 | Precision::Tf32 => Bf16ScratchSizes::default(),
            },
        }
    }

    /// Bytes of device memory in all.
    pub fn bytes(&self) -> usize {
        let images = self.slots.get(self.images).copied().unwrap_or(0);
        let activations = self.slots.iter().sum::<usize>() - images + 5 * self.grad_len;
        let floats = images
            + self.pooled
            + 3 * self.logits
            + self.grad_pooled
            + self.bn_state.len
            + self.coefficients
            + self.arrivals;
        let doubles = self.partials + self.totals + self.logits;
        activations * self.activations.bytes() + floats * 4 + doubles * 8 + self.bf16.len() * 2
    }
}

/// The device allocations of one plan (see [`StorageSizes`]).
pub struct DeviceStorage {
    /// The sizes they were made with.
    pub sizes: StorageSizes,
    /// The plan's image slot.
    pub images: usize,
    /// The unit that reads the images (the stem, by [`tandem_models::workspace::UnitPlan::index`]):
    /// the only convolution whose input is float32 whatever the activations. An evaluation
    /// plan may reuse the images slot for later activations, so the slot does not tell.
    pub image_reader: usize,
    /// The mode and batch shape `(mode, batch, height, width)` of the plan.
    pub shape: (Mode, usize, usize, usize),
    /// Activation slots (the images slot float32, the others of the plan's activations).
    pub slots: Vec<ActivationBuffer>,
    /// The four gradient buffers of the backward (activations).
    pub grads: [ActivationBuffer; 4],
    /// The batch norm's input gradient, the convolution's output gradient in a unit's backward
    /// (activations).
    pub dz: ActivationBuffer,
    /// Pooled features.
    pub pooled: CudaSlice<f32>,
    /// Logits.
    pub logits: CudaSlice<f32>,
    /// Softmax of the logits (training).
    pub probabilities: CudaSlice<f32>,
    /// Gradient of the logits.
    pub grad_logits: CudaSlice<f32>,
    /// Gradient of the pooled features.
    pub grad_pooled: CudaSlice<f32>,
    /// Labels of the batch.
    pub labels: CudaSlice<u32>,
    /// Per-sample losses.
    pub sample_loss: CudaSlice<f64>,
    /// The mean loss.
    pub loss: CudaSlice<f32>,
    /// The first sample with a label out of range (`i32::MAX`: none).
    pub bad_sample: CudaSlice<i32>,
    /// Per-unit batch-norm state.
    pub bn_state: CudaSlice<f32>,
    /// Partial column sums.
    pub partials: CudaSlice<f64>,
    /// Column totals.
    pub totals: CudaSlice<f64>,
    /// The column sums' arrival counters: zero between launches (each launch's last row block
    /// of a channel group sets its counter back).
    pub arrivals: CudaSlice<u32>,
    /// Backward coefficients of a batch norm.
    pub coefficients: CudaSlice<f32>,
    /// The bfloat16 scratch buffers, with bf16 precision.
    pub bf16: Option<Bf16Scratch>,
    /// Per unit: the count of values its batch statistics were taken over (all processes).
    pub counts: Vec<f64>,
    /// Host copy of the totals, for SyncBatchNorm's reducer.
    pub host_totals: Vec<f64>,
}

/// The bfloat16 scratch buffers (see [`Bf16ScratchSizes`]), as bits.
pub struct Bf16Scratch {
    /// Inputs and their gradients.
    pub input: CudaSlice<u16>,
    /// Outputs and their gradients.
    pub output: CudaSlice<u16>,
    /// Filters, weights and their gradients.
    pub filter: CudaSlice<u16>,
}

/// `len` zeros on the device (at least one element: the driver refuses empty allocations).
fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, GpuError> {
    stream
        .alloc_zeros::<T>(len.max(1))
        .map_err(driver("cuMemAllocAsync"))
}

impl DeviceStorage {
    /// Allocates the storage of `plan` computing in `precision` on `stream`'s device, zeroed.
    pub fn new(
        stream: &Arc<CudaStream>,
        plan: &Plan,
        precision: Precision,
    ) -> Result<Self, GpuError> {
        let sizes = StorageSizes::new(plan, precision);
        let bf16 = if sizes.bf16.is_empty() {
            None
        } else {
            Some(Bf16Scratch {
                input: zeros(stream, sizes.bf16.input)?,
                output: zeros(stream, sizes.bf16.output)?,
                filter: zeros(stream, sizes.bf16.filter)?,
            })
        };
        let activations = sizes.activations;
        let slots = sizes
            .slots
            .iter()
            .enumerate()
            .map(|(slot, &len)| {
                let kind = if slot == plan.images {
                    Activations::F32
                } else {
                    activations
                };
                ActivationBuffer::zeros(stream, kind, len)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let gradient = || ActivationBuffer::zeros(stream, activations, sizes.grad_len);
        let grads = [gradient()?, gradient()?, gradient()?, gradient()?];
        Ok(DeviceStorage {
            slots,
            grads,
            dz: gradient()?,
            pooled: zeros(stream, sizes.pooled)?,
            logits: zeros(stream, sizes.logits)?,
            probabilities: zeros(stream, sizes.logits)?,
            grad_logits: zeros(stream, sizes.logits)?,
            grad_pooled: zeros(stream, sizes.grad_pooled)?,
            labels: zeros(stream, plan.batch)?,
            sample_loss: zeros(stream, plan.batch)?,
            loss: zeros(stream, 1)?,
            bad_sample: zeros(stream, 1)?,
            bn_state: zeros(stream, sizes.bn_state.len)?,
            partials: zeros(stream, sizes.partials)?,
            totals: zeros(stream, sizes.totals)?,
            arrivals: zeros(stream, sizes.arrivals)?,
            coefficients: zeros(stream, sizes.coefficients)?,
            bf16,
            counts: vec![0.0; plan.units],
            host_totals: Vec::with_capacity(sizes.totals),
            images: plan.images,
            image_reader: plan.stem.index,
            shape: (plan.mode, plan.batch, plan.height, plan.width),
            sizes,
        })
    }
}

/// Training batch shapes whose storage is kept: an epoch's full batches and its last, partial
/// one, so that neither frees the other's storage (which a captured step addresses).
const KEPT_TRAINING_SHAPES: usize = 2;

/// The storages of the last two training batch shapes and of the last evaluation plan (as the
/// CPU model keeps a workspace of each), and which one the step in progress uses.
pub struct PlanStorages {
    /// The most recently used last.
    train: Vec<DeviceStorage>,
    eval: Option<DeviceStorage>,
    active: Mode,
}

impl Default for PlanStorages {
    fn default() -> Self {
        PlanStorages {
            train: Vec::new(),
            eval: None,
            active: Mode::Train,
        }
    }
}

impl PlanStorages {
    /// Makes `plan`'s storage the active one, allocating it unless a kept storage of its mode
    /// has its batch shape. Returns whether a training storage was freed (a CUDA graph of a
    /// training step may have addressed it).
    pub fn activate(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &Plan,
        precision: Precision,
    ) -> Result<bool, GpuError> {
        let shape = (plan.mode, plan.batch, plan.height, plan.width);
        self.active = plan.mode;
        if plan.mode == Mode::Eval {
            if self.eval.as_ref().map(|storage| storage.shape) != Some(shape) {
                // The old storage is freed before the new one is allocated.
                self.eval = None;
                self.eval = Some(DeviceStorage::new(stream, plan, precision)?);
            }
            return Ok(false);
        }
        if let Some(kept) = self.train.iter().position(|storage| storage.shape == shape) {
            let storage = self.train.remove(kept);
            self.train.push(storage);
            return Ok(false);
        }
        let freed = self.train.len() >= KEPT_TRAINING_SHAPES;
        if freed {
            self.train.remove(0);
        }
        self.train
            .push(DeviceStorage::new(stream, plan, precision)?);
        Ok(freed)
    }

    /// Makes the storage of the last training forward active again for its backward, if it
    /// is `plan`'s (an evaluation may have run in between); `false` when it is not.
    pub fn resume_training(&mut self, plan: &Plan) -> bool {
        let shape = (plan.mode, plan.batch, plan.height, plan.width);
        let last = self.train.last().map(|storage| storage.shape);
        if plan.mode != Mode::Train || last != Some(shape) {
            return false;
        }
        self.active = Mode::Train;
        true
    }

    /// The active storage, if it was allocated.
    pub fn active(&self) -> Option<&DeviceStorage> {
        match self.active {
            Mode::Train => self.train.last(),
            Mode::Eval => self.eval.as_ref(),
        }
    }

    /// The active storage, mutably.
    pub fn active_mut(&mut self) -> Option<&mut DeviceStorage> {
        match self.active {
            Mode::Train => self.train.last_mut(),
            Mode::Eval => self.eval.as_mut(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfloat16_activations_are_two_bytes_an_element() {
        let bf16 = Activations::of(Precision::Bf16);
        assert_eq!(bf16, Activations::Bf16);
        assert_eq!(Activations::of(Precision::Tf32), Activations::F32);
        assert_eq!(bf16.bytes(), 2);
        assert_eq!(Activations::F32.bytes(), 4);
    }
}
