//! The plan of one batch shape: every layer's shape and which activation slot holds its
//! input and outputs, made once per shape and reused every step. The plan is plain data that
//! any executor reads; the executor owns the slots themselves (see [`crate::executor`]).
//!
//! Training keeps every activation the backward needs (each convolution's input, its
//! output before batch norm, and each block's output), one slot each. Evaluation keeps
//! only what is live, so its slots are shared between layers.

use tandem_engine::shape::Conv2dShape;

use crate::error::ModelError;
use crate::network::{ConvLayer, Network};

/// Whether the forward pass trains (batch statistics, keeps activations) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Batch statistics; every activation the backward needs is kept.
    Train,
    /// Running statistics; only live activations are kept.
    Eval,
}

/// The index of an activation slot: one tensor-sized buffer of the executor's.
pub type Slot = usize;

/// The slots of one conv-bn unit: its convolution's input, output before batch norm (`z`)
/// and output after batch norm (+ residual) and ReLU (`out`).
#[derive(Clone, Debug)]
pub struct UnitPlan {
    /// The unit's number in forward order (stem 0), for state an executor keeps per unit
    /// (the batch norm's statistics between forward and backward).
    pub index: usize,
    /// The convolution's shape for this batch.
    pub shape: Conv2dShape,
    /// The slot holding the convolution's input.
    pub input: Slot,
    /// The slot receiving the convolution's output, before batch norm.
    pub z: Slot,
    /// The slot receiving the unit's output (`z` itself for a projection shortcut, whose
    /// batch norm is applied inside the block's residual add).
    pub out: Slot,
}

impl UnitPlan {
    /// Values in this unit's output.
    pub fn output_len(&self) -> usize {
        self.shape.output_len()
    }
}

/// The slots of a residual block; the last unit's `out` is the block's output.
#[derive(Clone, Debug)]
pub struct BlockPlan {
    /// The chain of units, in forward order.
    pub units: Vec<UnitPlan>,
    /// The projection shortcut, if the block has one.
    pub shortcut: Option<UnitPlan>,
}

/// The plan of one mode and batch shape: layer shapes, slots and their sizes.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Training or evaluation.
    pub mode: Mode,
    /// Images per batch.
    pub batch: usize,
    /// Image height.
    pub height: usize,
    /// Image width.
    pub width: usize,
    /// The slot holding the input images.
    pub images: Slot,
    /// The stem unit.
    pub stem: UnitPlan,
    /// The residual blocks, in forward order.
    pub blocks: Vec<BlockPlan>,
    /// Pixels per image at the last block's output (averaged by the head).
    pub final_pixels: usize,
    /// Channels at the last block's output.
    pub final_channels: usize,
    /// Classes of the classifier.
    pub classes: usize,
    /// Values of each slot.
    pub slot_lens: Vec<usize>,
    /// Values of each of the four gradient buffers of the backward pass (0 in evaluation).
    pub grad_len: usize,
    /// Conv-bn units in all (each unit's [`UnitPlan::index`] is below this).
    pub units: usize,
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

impl Plan {
    /// Plans the slots of `network` for `batch` images of `height x width` with `channels`
    /// channels.
    pub(crate) fn new(
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
        let mut unit_count = 0;
        let images = planner.take(batch * height * width * channels, &[]);
        let stem_shape = conv_shape(&network.stem.conv, batch, height, width)?;
        let stem_z = planner.take(stem_shape.output_len(), &[images]);
        let stem_out = planner.take(stem_shape.output_len(), &[images, stem_z]);
        let stem = UnitPlan {
            index: next_index(&mut unit_count),
            shape: stem_shape,
            input: images,
            z: stem_z,
            out: stem_out,
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
                        index: next_index(&mut unit_count),
                        shape,
                        input: block_input,
                        z,
                        out: z,
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
                    index: next_index(&mut unit_count),
                    shape,
                    input: current,
                    z,
                    out,
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
        Ok(Plan {
            mode,
            batch,
            height,
            width,
            images,
            stem,
            blocks,
            final_pixels,
            final_channels,
            classes,
            slot_lens: planner.sizes,
            grad_len,
            units: unit_count,
        })
    }

    /// Whether this plan fits a batch of this shape.
    pub fn fits(&self, batch: usize, height: usize, width: usize) -> bool {
        (self.batch, self.height, self.width) == (batch, height, width)
    }

    /// Every unit, the stem first, then each block's chain and shortcut.
    pub fn unit_plans(&self) -> impl Iterator<Item = &UnitPlan> {
        std::iter::once(&self.stem).chain(
            self.blocks
                .iter()
                .flat_map(|block| block.units.iter().chain(&block.shortcut)),
        )
    }

    /// The output of the last block (the stem when there are no blocks).
    pub fn final_output(&self) -> &UnitPlan {
        self.blocks
            .last()
            .and_then(|block| block.units.last())
            .unwrap_or(&self.stem)
    }
}

/// The next unit number from `counter`.
fn next_index(counter: &mut usize) -> usize {
    *counter += 1;
    *counter - 1
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
