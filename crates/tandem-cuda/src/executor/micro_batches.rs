//! The inputs and losses of a whole step of several micro-batches (`--grad-accum`).
//!
//! Before the step, the labels of all its micro-batches (and, when the images come from the
//! host, their images) are copied, one micro-batch after another, to buffers of their own.
//! Inside the step's body each micro-batch's share is moved into the plan's fixed label
//! buffer and input slot before its forward (device-to-device copies, which a graph captures),
//! or its images are assembled from its share of the dataset indices, and its mean loss is
//! kept. So the body reads nothing from the host, and a graph replays all the micro-batches.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::dataset::DeviceDataset;
use super::error::{driver, GpuError};
use super::CudaExecutor;

/// The device buffers of a step's micro-batches, grown to the largest step so far.
pub(super) struct MicroBatchBuffers {
    /// The host images of every micro-batch, one after another (NHWC floats).
    images: CudaSlice<f32>,
    /// The labels of every micro-batch, one after another.
    labels: CudaSlice<u32>,
    /// Each micro-batch's mean loss.
    losses: CudaSlice<f32>,
}

impl MicroBatchBuffers {
    /// Buffers of one element each (the driver refuses empty allocations).
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Self, GpuError> {
        Ok(MicroBatchBuffers {
            images: stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?,
            labels: stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?,
            losses: stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?,
        })
    }
}

/// `buffer`, replaced by a zeroed one of `len` elements when it is shorter; whether it was.
fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buffer: &mut CudaSlice<T>,
    len: usize,
) -> Result<bool, GpuError> {
    if buffer.len() >= len {
        return Ok(false);
    }
    *buffer = stream.alloc_zeros(len).map_err(driver("cuMemAllocAsync"))?;
    Ok(true)
}

/// An error unless a buffer of `len` values holds the `needed` first ones.
fn check_holds(what: &'static str, len: usize, needed: usize) -> Result<(), GpuError> {
    if len < needed {
        return Err(GpuError::Length {
            what,
            found: len,
            expected: needed,
        });
    }
    Ok(())
}

/// Copies `part` of `from` to the start of `to` on `stream`.
fn copy_part<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    from: &CudaSlice<T>,
    part: Range<usize>,
    to: &mut CudaSlice<T>,
) -> Result<(), GpuError> {
    let len = part.len();
    stream
        .memcpy_dtod(&from.slice(part), &mut to.slice_mut(..len))
        .map_err(driver("cuMemcpyDtoDAsync"))
}

impl CudaExecutor {
    /// Copies the `labels` of a step's `micro_batches` (and, from the host, their `images`)
    /// to the micro-batch buffers, each grown first when it is too short (a new generation:
    /// a captured step addresses the old one).
    pub(super) fn load_micro_batches(
        &mut self,
        micro_batches: usize,
        labels: &[u32],
        images: Option<&[f32]>,
    ) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let buffers = &mut self.memory.micro_batches;
        let mut grown = grow(&stream, &mut buffers.labels, labels.len())?;
        grown |= grow(&stream, &mut buffers.losses, micro_batches)?;
        if let Some(images) = images {
            grown |= grow(&stream, &mut buffers.images, images.len())?;
        }
        if grown {
            self.generation += 1;
        }
        let buffers = &mut self.memory.micro_batches;
        stream
            .memcpy_htod(labels, &mut buffers.labels.slice_mut(..labels.len()))
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        if let Some(images) = images {
            stream
                .memcpy_htod(images, &mut buffers.images.slice_mut(..images.len()))
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        Ok(())
    }

    /// Moves micro-batch `index` (of the plan's batch, `image_values` floats of images) into
    /// place for its forward: its labels into the plan's label buffer, and its images into
    /// the input slot, copied from the host images or assembled from its share of
    /// `dataset`'s loaded indices (no host work: capturable).
    pub(super) fn move_in_micro_batch(
        &mut self,
        index: usize,
        image_values: usize,
        dataset: Option<&DeviceDataset>,
    ) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.memory.storages.active_mut() else {
            return Err(GpuError::NotPrepared);
        };
        let batch = storage.shape.1;
        let labels = index * batch..(index + 1) * batch;
        let micro_batch_labels = &self.memory.micro_batches.labels;
        check_holds("micro-batch labels", micro_batch_labels.len(), labels.end)?;
        copy_part(&stream, micro_batch_labels, labels, &mut storage.labels)?;
        if let Some(dataset) = dataset {
            let images = self.input_slot()?;
            return self.augment(dataset, index * batch, batch, images);
        }
        let images = index * image_values..(index + 1) * image_values;
        let micro_batch_images = &self.memory.micro_batches.images;
        check_holds("micro-batch images", micro_batch_images.len(), images.end)?;
        let slot = storage.slots[storage.images].f32_mut()?;
        check_holds("the input slot", slot.len(), image_values)?;
        copy_part(&stream, micro_batch_images, images, slot)
    }

    /// Keeps the mean loss the loss kernels just wrote as micro-batch `index`'s (capturable).
    pub(super) fn keep_micro_batch_loss(&mut self, index: usize) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let Some(storage) = self.memory.storages.active() else {
            return Err(GpuError::NotPrepared);
        };
        stream
            .memcpy_dtod(
                &storage.loss,
                &mut self.memory.micro_batches.losses.slice_mut(index..index + 1),
            )
            .map_err(driver("cuMemcpyDtoDAsync"))
    }

    /// Waits for the step and reads the mean losses of its `micro_batches`.
    pub(super) fn read_micro_batch_losses(
        &self,
        micro_batches: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let mut losses = vec![0f32; micro_batches];
        self.stream
            .memcpy_dtoh(
                &self.memory.micro_batches.losses.slice(..micro_batches),
                &mut losses,
            )
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.synchronize()?;
        Ok(losses)
    }
}
