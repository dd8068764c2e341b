//! A training set in GPU memory: its NHWC pixels (uint8, or floats for synthetic data) go to
//! the device once ([`CudaExecutor::upload_dataset`]); each batch is then assembled on the device from its
//! sample indices (a few bytes each cross to the device) by `kernels/augment.cu`: the pad-4
//! crop and flip drawn from (seed, epoch, sample index) exactly as the CPU loader draws them,
//! and the normalization, written straight into the executor's input slot
//! ([`CudaExecutor::forward_train_gathered`]) or, for tests, into a buffer brought to the host
//! ([`CudaExecutor::gather_to_host`]).
//!
//! The labels stay on the host (4 bytes a sample, the size of the indices): the loss copies
//! them to the device with each batch, and the host names a bad label's sample.
//!
//! A batch is assembled in two parts so that a training step can be captured as a CUDA graph:
//! its indices and epoch are copied to fixed device buffers first ([`CudaExecutor::load_indices`],
//! the epoch into the step-scalar buffer), then the kernels read them ([`CudaExecutor::augment`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tandem_engine::BatchNormReducer;
use tandem_models::workspace::Plan;
use tandem_models::{LossOptions, Model, ModelError};

use super::error::{driver, int, same_length};
use super::kernels::{augment, Ptr};
use super::launch::per_element;
use super::scalars::EPOCH_OFFSET;
use super::step::GpuStep;
use super::{address, CudaExecutor, GpuError};

/// The id of the next uploaded dataset.
static NEXT_DATASET_ID: AtomicU64 = AtomicU64::new(1);

/// How a batch's images are augmented and normalized: the CPU loader's `Augment`,
/// `Normalize` and seed, as plain values (this crate does not depend on `tandem-data`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AugmentSettings {
    /// Zero padding of the random crop (0: no crop draws).
    pub crop_padding: usize,
    /// Whether to draw a horizontal flip.
    pub horizontal_flip: bool,
    /// `(value - mean[c % 3]) / std[c % 3]` of each value (`byte / 255` for bytes); `[0; 3]`
    /// and `[1; 3]` leave it as it is.
    pub mean: [f32; 3],
    /// See `mean`.
    pub std: [f32; 3],
    /// The seed of the draws.
    pub seed: u64,
}

/// The shape of a dataset's pixels: `len` images of `height x width x channels` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatasetShape {
    /// Number of images.
    pub len: usize,
    /// Rows of an image.
    pub height: usize,
    /// Columns of an image.
    pub width: usize,
    /// Values of a pixel.
    pub channels: usize,
}

impl DatasetShape {
    /// Values of one image.
    pub fn image_len(&self) -> usize {
        self.height * self.width * self.channels
    }

    /// Checks that `pixels` values fill the shape and that the kernel's `unsigned int` indices
    /// and `int` sizes can address it.
    pub fn check(&self, pixels: usize) -> Result<(), GpuError> {
        same_length(
            "dataset pixels",
            pixels,
            self.len.saturating_mul(self.image_len()),
        )?;
        if u32::try_from(self.len).is_err() {
            return Err(GpuError::TooLarge {
                what: "dataset images",
                value: self.len,
            });
        }
        for (what, value) in [
            ("image height", self.height),
            ("image width", self.width),
            ("image channels", self.channels),
        ] {
            int(what, value)?;
        }
        Ok(())
    }

    /// `indices` as the kernel's `unsigned int`s, each checked below `len` (the kernel reads
    /// image `indices[s]` without a bound check).
    pub fn device_indices(&self, indices: &[usize]) -> Result<Vec<u32>, GpuError> {
        indices
            .iter()
            .map(|&index| match u32::try_from(index) {
                Ok(value) if index < self.len => Ok(value),
                _ => Err(GpuError::IndexOutOfRange {
                    index,
                    len: self.len,
                }),
            })
            .collect()
    }
}

/// A dataset's pixels on the host, as the loader holds them.
#[derive(Clone, Copy, Debug)]
pub enum HostPixels<'a> {
    /// Bytes 0..=255 (image files), divided by 255 before the normalization.
    U8(&'a [u8]),
    /// Ready floats (synthetic data), normalized as they are.
    F32(&'a [f32]),
}

impl HostPixels<'_> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            HostPixels::U8(values) => values.len(),
            HostPixels::F32(values) => values.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes they take.
    pub fn bytes(&self) -> usize {
        match self {
            HostPixels::U8(values) => std::mem::size_of_val(*values),
            HostPixels::F32(values) => std::mem::size_of_val(*values),
        }
    }
}

/// A dataset's pixels on the device, and the kernel that assembles batches from them.
enum DevicePixels {
    U8(CudaSlice<u8>),
    F32(CudaSlice<f32>),
}

impl DevicePixels {
    /// Copies `pixels` to the device (one value for none: the driver allocates no empty
    /// buffer).
    fn upload(stream: &Arc<CudaStream>, pixels: HostPixels<'_>) -> Result<Self, GpuError> {
        let copied = match pixels {
            HostPixels::U8([]) => stream.alloc_zeros(1).map(DevicePixels::U8),
            HostPixels::U8(bytes) => stream.clone_htod(bytes).map(DevicePixels::U8),
            HostPixels::F32([]) => stream.alloc_zeros(1).map(DevicePixels::F32),
            HostPixels::F32(floats) => stream.clone_htod(floats).map(DevicePixels::F32),
        };
        copied.map_err(driver("cuMemcpyHtoDAsync"))
    }
}

/// A dataset's pixels on one executor's GPU, and the small buffers of a batch's assembly.
pub struct DeviceDataset {
    /// Unique in the process (the key of the CUDA graphs of steps that read it).
    id: u64,
    shape: DatasetShape,
    settings: AugmentSettings,
    /// All images, NHWC.
    pixels: DevicePixels,
    /// `settings.mean` and `settings.std`.
    mean: CudaSlice<f32>,
    std: CudaSlice<f32>,
    /// The batch's sample indices (grown to the largest batch).
    indices: CudaSlice<u32>,
    /// The host side of their last copy.
    host_indices: Vec<u32>,
    /// Three ints per sample: crop top, crop left, flip.
    draws: CudaSlice<i32>,
}

impl DeviceDataset {
    /// The shape of the uploaded pixels.
    pub fn shape(&self) -> DatasetShape {
        self.shape
    }

    /// Its id, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl CudaExecutor {
    /// Copies `pixels` (NHWC images of `shape`) to this executor's GPU, once, for batches
    /// assembled there with `settings`.
    pub fn upload_dataset(
        &self,
        pixels: HostPixels<'_>,
        shape: DatasetShape,
        settings: AugmentSettings,
    ) -> Result<DeviceDataset, GpuError> {
        shape.check(pixels.len())?;
        self.bind()?;
        let stream = &self.stream;
        let dataset = DeviceDataset {
            id: NEXT_DATASET_ID.fetch_add(1, Ordering::Relaxed),
            shape,
            settings,
            pixels: DevicePixels::upload(stream, pixels)?,
            mean: stream
                .clone_htod(&settings.mean)
                .map_err(driver("cuMemcpyHtoDAsync"))?,
            std: stream
                .clone_htod(&settings.std)
                .map_err(driver("cuMemcpyHtoDAsync"))?,
            indices: stream.alloc_zeros(1).map_err(driver("cuMemAllocAsync"))?,
            host_indices: Vec::new(),
            draws: stream.alloc_zeros(3).map_err(driver("cuMemAllocAsync"))?,
        };
        // The sources of these copies (the caller's pixels, `settings`) may be gone when a
        // copy from pageable memory reads them; this runs once per data set.
        self.synchronize()?;
        Ok(dataset)
    }

    /// A training forward (as [`CudaExecutor::forward_train`]) of the images `indices` of
    /// `dataset`, augmented with the draws of `epoch` and normalized on the device into the
    /// plan's input; `labels` are theirs.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train_gathered(
        &mut self,
        model: &Model,
        plan: &Plan,
        dataset: &mut DeviceDataset,
        indices: &[usize],
        epoch: u64,
        labels: &[u32],
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<f32, ModelError> {
        same_length("labels", labels.len(), plan.batch)?;
        check_gathered_batch(plan, dataset, indices, 1)?;
        self.prepare(plan)?;
        let images = self.input_slot()?;
        self.gather(dataset, indices, epoch, images)?;
        self.forward_train_loaded(model, plan, labels, loss, bn_sync)
    }

    /// An evaluation forward (as [`CudaExecutor::forward_eval`]) of the images `indices` of
    /// `dataset`, normalized on the device into the plan's input (the data set must have been
    /// uploaded without crop or flip), with the logits copied to `logits`.
    pub fn forward_eval_gathered(
        &mut self,
        model: &Model,
        plan: &Plan,
        dataset: &mut DeviceDataset,
        indices: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        if dataset.settings.crop_padding != 0 || dataset.settings.horizontal_flip {
            return Err(
                GpuError::Unsupported("evaluating a data set uploaded with augmentation").into(),
            );
        }
        check_gathered_batch(plan, dataset, indices, 1)?;
        self.prepare(plan)?;
        let images = self.input_slot()?;
        self.gather(dataset, indices, 0, images)?;
        model.forward_on(&mut GpuStep::forward(self), plan, None)?;
        Ok(self.logits_to_host(logits)?)
    }

    /// The address and length of the active storage's image slot.
    pub(super) fn input_slot(&self) -> Result<(u64, usize), GpuError> {
        let storage = self.storage()?;
        let slot = storage.slots[storage.images].f32()?;
        Ok((address(slot, &self.stream), slot.len()))
    }

    /// The batch `indices` of `dataset` with the draws of `epoch`, assembled on the device
    /// and copied to the host (NHWC floats), as the CPU loader would deliver it.
    pub fn gather_to_host(
        &mut self,
        dataset: &mut DeviceDataset,
        indices: &[usize],
        epoch: u64,
    ) -> Result<Vec<f32>, GpuError> {
        self.bind()?;
        let len = indices.len() * dataset.shape.image_len();
        let output: CudaSlice<f32> = self
            .stream
            .alloc_zeros(len.max(1))
            .map_err(driver("cuMemAllocAsync"))?;
        self.gather(
            dataset,
            indices,
            epoch,
            (address(&output, &self.stream), output.len()),
        )?;
        let mut host = self
            .stream
            .clone_dtoh(&output)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        // A copy to pageable memory may still be running when the call returns.
        self.synchronize()?;
        host.truncate(len);
        Ok(host)
    }

    /// Writes the batch `indices` of `dataset` (draws of `epoch`) to the `capacity` floats at
    /// `output`, on the executor's stream.
    fn gather(
        &mut self,
        dataset: &mut DeviceDataset,
        indices: &[usize],
        epoch: u64,
        output: (u64, usize),
    ) -> Result<(), GpuError> {
        self.load_indices(dataset, indices)?;
        self.write_scalars(EPOCH_OFFSET, &epoch.to_le_bytes())?;
        self.augment(dataset, 0, indices.len(), output)
    }

    /// Copies the batch's `indices` (checked below the dataset's size) to the dataset's index
    /// buffer, grown first if the batch is larger than any before (a new generation: a
    /// captured step addresses the old buffer).
    pub(super) fn load_indices(
        &mut self,
        dataset: &mut DeviceDataset,
        indices: &[usize],
    ) -> Result<(), GpuError> {
        let batch = indices.len();
        if batch == 0 {
            return Ok(());
        }
        // Kept in the dataset: a copy from pageable memory may read its source after the call
        // returns.
        dataset.host_indices = dataset.shape.device_indices(indices)?;
        if dataset.indices.len() < batch {
            dataset.indices = self
                .stream
                .alloc_zeros(batch)
                .map_err(driver("cuMemAllocAsync"))?;
            dataset.draws = self
                .stream
                .alloc_zeros(3 * batch)
                .map_err(driver("cuMemAllocAsync"))?;
            self.generation += 1;
        }
        self.stream
            .memcpy_htod(
                &dataset.host_indices,
                &mut dataset.indices.slice_mut(..batch),
            )
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// The augmentation kernels: the `batch` images whose indices [`Self::load_indices`]
    /// copied from the `first`, with the draws of the epoch in the step-scalar buffer,
    /// written to the `capacity` floats at `output` (no host work: capturable).
    pub(super) fn augment(
        &self,
        dataset: &DeviceDataset,
        first: usize,
        batch: usize,
        (output, capacity): (u64, usize),
    ) -> Result<(), GpuError> {
        let shape = dataset.shape;
        let values = batch * shape.image_len();
        if values > capacity {
            return Err(GpuError::Length {
                what: "gathered images",
                found: values,
                expected: capacity,
            });
        }
        if batch == 0 {
            return Ok(());
        }
        if dataset.indices.len() < first + batch {
            return Err(GpuError::Length {
                what: "loaded batch indices",
                found: dataset.indices.len(),
                expected: first + batch,
            });
        }
        let settings = dataset.settings;
        let (stream, queue) = (&self.stream, self.queue());
        let indices = Ptr::of(&dataset.indices, stream).at(first);
        let (draws, mean, std) = (
            Ptr::of(&dataset.draws, stream),
            Ptr::of(&dataset.mean, stream),
            Ptr::of(&dataset.std, stream),
        );
        let (epoch, output) = (
            Ptr::from_address(self.scalars_at(EPOCH_OFFSET)),
            Ptr::from_address(output),
        );
        let batch_int = int("batch", batch)?;
        let padding = int("crop padding", settings.crop_padding)?;
        let flip = i32::from(settings.horizontal_flip);
        // One thread per sample reads the epoch and indices[first + s] and writes
        // draws[3s..3s+3]: the indices hold at least `first + batch`, the draws 3 * batch
        // (grown with them) elements (checked above).
        augment::augment_draws(
            &queue,
            per_element(batch),
            indices,
            batch_int,
            settings.seed,
            epoch,
            padding,
            flip,
            draws,
        )?;
        // One thread per output value writes output[i] for i < batch * image_len ≤ capacity
        // (checked above) and reads image indices[s] < len (checked by `device_indices`) of
        // the pixels, which hold len * image_len values (checked at upload).
        let height = int("image height", shape.height)?;
        let width = int("image width", shape.width)?;
        let channels = int("image channels", shape.channels)?;
        let config = per_element(values);
        match &dataset.pixels {
            DevicePixels::U8(bytes) => augment::augment_apply(
                &queue,
                config,
                Ptr::of(bytes, stream),
                indices,
                draws,
                batch_int,
                height,
                width,
                channels,
                padding,
                mean,
                std,
                output,
            ),
            DevicePixels::F32(floats) => augment::augment_apply_f32(
                &queue,
                config,
                Ptr::of(floats, stream),
                indices,
                draws,
                batch_int,
                height,
                width,
                channels,
                padding,
                mean,
                std,
                output,
            ),
        }
    }
}

/// Checks the gathered batches of a step of `micro_batches` against `plan`: one index per
/// image, and the dataset's image shape the plan's.
pub(super) fn check_gathered_batch(
    plan: &Plan,
    dataset: &DeviceDataset,
    indices: &[usize],
    micro_batches: usize,
) -> Result<(), GpuError> {
    same_length("batch indices", indices.len(), plan.batch * micro_batches)?;
    let shape = dataset.shape;
    let plan_image = (plan.height, plan.width, plan.stem.shape.in_channels);
    if (shape.height, shape.width, shape.channels) != plan_image {
        return Err(GpuError::Length {
            what: "dataset image values",
            found: shape.image_len(),
            expected: plan_image.0 * plan_image.1 * plan_image.2,
        });
    }
    Ok(())
}
