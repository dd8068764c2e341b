//! Activation buffers and per-step batch-norm state for one batch shape, planned once and
//! reused every step. Everything a step writes lives here (or in the model's flat buffers),
//! so the network description is only read during a step.
//!
//! Training keeps every activation the backward needs (each convolution's input, its
//! output before batch norm, and each block's output), one buffer each. Evaluation keeps
//! only what is live, so its buffers are shared between layers.

use tandem_engine::batchnorm::{BatchNormScratch, BatchNormState};
use tandem_engine::conv::ConvScratch;
use tandem_engine::shape::Conv2dShape;

use crate::error::ModelError;
use crate::network::{ConvLayer, Network};

/// Whether the forward pass trains (batch statistics, keeps activations) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Train,
    Eval,
}

/// Buffers of one conv-bn unit: its convolution's shape, input, output before batch
/// norm (`z`), output after batch norm (+ residual) and ReLU (`out`), and its batch norm's
/// state for this step.
pub(crate) struct UnitPlan {
    pub shape: Conv2dShape,
    pub input: usize,
    pub z: usize,
    pub out: usize,
    /// Training: the batch statistics of the last forward, kept for the backward.
    /// Evaluation: the scale and shift from the running statistics.
    pub bn: BatchNormState,
}

impl UnitPlan {
    /// Values in this unit's output.
    pub fn output_len(&self) -> usize {
        self.shape.output_len()
    }
}

/// Buffers of a residual block; the last unit's `out` is the block's output.
pub(crate) struct BlockPlan {
    pub units: Vec<UnitPlan>,
    pub shortcut: Option<UnitPlan>,
}

/// Every buffer a forward (and, in training, backward) pass of one batch shape needs.
pub(crate) struct Workspace {
    pub mode: Mode,
    pub batch: usize,
    pub height: usize,
    pub width: usize,
    pub images: usize,
    pub stem: UnitPlan,
    pub blocks: Vec<BlockPlan>,
    pub final_pixels: usize,
    pub final_channels: usize,
    pub slots: Vec<Vec<f32>>,
    pub pooled: Vec<f32>,
    pub logits: Vec<f32>,
    pub probabilities: Vec<f32>,
    pub grad_logits: Vec<f32>,
    pub grad_pooled: Vec<f32>,
    pub labels: Vec<u32>,
    pub label_smoothing: f32,
    pub grad_buffers: [Vec<f32>; 4],
    pub conv_scratch: ConvScratch,
    pub bn_scratch: BatchNormScratch,
    /// Per-channel sums of the last convolution's output, for its batch norm.
    pub output_sums: Vec<f64>,
}

/// Assigns buffers: in training each activation gets its own; in evaluation the lowest
/// buffer not holding a live activation is reused.
struct SlotPlanner {
    mode: Mode,
    sizes: Vec<usize>,
}

impl SlotPlanner {
    fn take(&mut self, len: usize, live: &[usize]) -> usize {
        let slot = match self.mode {
            Mode::Train => self.sizes.len(),
            Mode::Eval => (0..)
                .find(|slot| !live.contains(slot))
                .unwrap_or(self.sizes.len()),
        };
        if slot == self.sizes.len() {
            self.sizes.push(0);
        }
        self.sizes[slot] = self.sizes[slot].max(len);
        slot
    }
}

impl Workspace {
    /// Plans and allocates the buffers of `network` for `batch` images of `height x width`
    /// with `channels` channels.
    pub fn new(
        network: &Network,
        mode: Mode,
        batch: usize,
        height: usize,
        width: usize,
        channels: usize,
    ) -> Result<Self, ModelError> {
        let mut planner = SlotPlanner {
            mode,
            sizes: Vec::new(),
        };
        let images = planner.take(batch * height * width * channels, &[]);
        let stem_shape = conv_shape(&network.stem.conv, batch, height, width)?;
        let stem_z = planner.take(stem_shape.output_len(), &[images]);
        let stem_out = planner.take(stem_shape.output_len(), &[images, stem_z]);
        let stem = UnitPlan {
            shape: stem_shape,
            input: images,
            z: stem_z,
            out: stem_out,
            bn: BatchNormState::new(stem_shape.out_channels),
        };
        let (mut current, mut current_height, mut current_width) =
            (stem_out, stem_shape.out_height(), stem_shape.out_width());
        let mut blocks = Vec::with_capacity(network.blocks.len());
        for block in &network.blocks {
            let block_input = current;
            let shortcut = match &block.shortcut {
                Some(unit) => {
                    let shape = conv_shape(&unit.conv, batch, current_height, current_width)?;
                    let z = planner.take(shape.output_len(), &[block_input]);
                    Some(UnitPlan {
                        shape,
                        input: block_input,
                        z,
                        out: z,
                        bn: BatchNormState::new(shape.out_channels),
                    })
                }
                None => None,
            };
            let shortcut_slots: Vec<usize> = shortcut.iter().map(|plan| plan.z).collect();
            let mut units = Vec::with_capacity(block.units.len());
            for unit in &block.units {
                let shape = conv_shape(&unit.conv, batch, current_height, current_width)?;
                let mut live = vec![block_input, current];
                live.extend(&shortcut_slots);
                let z = planner.take(shape.output_len(), &live);
                // `current` stays live: in eval mode the fused layer reads it while writing `out`.
                live = vec![block_input, current, z];
                live.extend(&shortcut_slots);
                let out = planner.take(shape.output_len(), &live);
                units.push(UnitPlan {
                    shape,
                    input: current,
                    z,
                    out,
                    bn: BatchNormState::new(shape.out_channels),
                });
                (current, current_height, current_width) =
                    (out, shape.out_height(), shape.out_width());
            }
            blocks.push(BlockPlan { units, shortcut });
        }
        let final_channels = network.head.in_features;
        let final_pixels = current_height * current_width;
        let classes = network.head.classes;
        let largest = planner.sizes.iter().skip(1).copied().max().unwrap_or(0);
        let grad_len = if mode == Mode::Train { largest } else { 0 };
        let batch_outputs = if mode == Mode::Train {
            batch * classes
        } else {
            0
        };
        Ok(Workspace {
            mode,
            batch,
            height,
            width,
            images,
            stem,
            blocks,
            final_pixels,
            final_channels,
            slots: planner.sizes.iter().map(|&len| vec![0.0; len]).collect(),
            pooled: vec![0.0; batch * final_channels],
            logits: vec![0.0; batch * classes],
            probabilities: vec![0.0; batch_outputs],
            grad_logits: vec![0.0; batch_outputs],
            grad_pooled: vec![
                0.0;
                if mode == Mode::Train {
                    batch * final_channels
                } else {
                    0
                }
            ],
            labels: Vec::with_capacity(batch),
            label_smoothing: 0.0,
            grad_buffers: std::array::from_fn(|_| vec![0.0; grad_len]),
            conv_scratch: ConvScratch::default(),
            bn_scratch: BatchNormScratch::default(),
            output_sums: Vec::new(),
        })
    }

    /// Whether this workspace fits a batch of this shape.
    pub fn fits(&self, batch: usize, height: usize, width: usize) -> bool {
        (self.batch, self.height, self.width) == (batch, height, width)
    }

    /// The output of the last block (the stem when there are no blocks).
    pub fn final_output(&self) -> &UnitPlan {
        self.blocks
            .last()
            .and_then(|block| block.units.last())
            .unwrap_or(&self.stem)
    }
}

fn conv_shape(
    conv: &ConvLayer,
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Conv2dShape, ModelError> {
    let shape = Conv2dShape {
        batch,
        in_height: height,
        in_width: width,
        in_channels: conv.in_channels,
        out_channels: conv.out_channels,
        kernel: conv.kernel,
        stride: conv.stride,
        padding: conv.padding,
    };
    match shape.output_size() {
        Some(_) => Ok(shape),
        None => Err(ModelError::ImageTooSmall {
            height,
            width,
            layer: conv.name.clone(),
        }),
    }
}

/// Runs `work` with `slots[output]` borrowed mutably and the other slots readable.
/// The planner never gives an output the slot of a live input, so nothing read is moved.
pub(crate) fn with_output<R>(
    slots: &mut [Vec<f32>],
    output: usize,
    work: impl FnOnce(&[Vec<f32>], &mut [f32]) -> R,
) -> R {
    let mut buffer = std::mem::take(&mut slots[output]);
    let result = work(slots, &mut buffer);
    slots[output] = buffer;
    result
}
