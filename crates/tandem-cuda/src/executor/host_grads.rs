//! The host side of the gradients that cross to the host: the ranges a backward reports to a
//! host hook (the ring backend's buckets) and the averaged gradients that go back.
//!
//! They live in page-locked (pinned) host memory, so that each crossing is one DMA transfer
//! at the bus's speed instead of the driver's copy through a pageable bounce buffer. The
//! memory is allocated at the first crossing: a run on one GPU, or on NCCL, never pins any.
//! Copies into or out of it are asynchronous: the stream is synchronized before the host
//! reads it, and before the host writes it while a copy from it may still be running.

use std::sync::Arc;

use cudarc::driver::{CudaContext, PinnedHostSlice};

use super::error::{driver, GpuError};

/// Page-locked host memory for the flat gradient buffer's `len` values, allocated (as zeros)
/// at the first [`HostGradients::values`], and how many of them are current.
pub(super) struct HostGradients {
    len: usize,
    pinned: Option<PinnedHostSlice<f32>>,
    /// How many leading values are those of the device gradients: advanced by a reporting
    /// backward's copies, reset by anything else that changes the device gradients.
    current: usize,
}

impl HostGradients {
    /// Host gradients for a flat buffer of `len` values; nothing is allocated yet.
    pub(super) fn new(len: usize) -> Self {
        HostGradients {
            len,
            pinned: None,
            current: 0,
        }
    }

    /// How many values the flat gradient buffer holds.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// How many leading values are those of the device gradients.
    pub(super) fn current(&self) -> usize {
        self.current
    }

    /// Records that the leading `count` values are those of the device gradients.
    pub(super) fn mark_current(&mut self, count: usize) {
        self.current = count;
    }

    /// Records that the device gradients changed: no host value is current.
    pub(super) fn mark_stale(&mut self) {
        self.current = 0;
    }

    /// The host values, allocated in `context` at the first call. A copy into them is only
    /// done once its stream is synchronized.
    pub(super) fn values(&mut self, context: &Arc<CudaContext>) -> Result<&mut [f32], GpuError> {
        let pinned = match self.pinned.take() {
            Some(pinned) => pinned,
            None => allocate_zeros(context, self.len)?,
        };
        let pinned = self.pinned.insert(pinned);
        let values = pinned
            .as_mut_slice()
            .map_err(driver("cuEventSynchronize"))?;
        Ok(&mut values[..self.len])
    }
}

/// Page-locked host memory for `len` floats (at least one), set to zeros.
fn allocate_zeros(
    context: &Arc<CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<f32>, GpuError> {
    // SAFETY: the memory is uninitialized after the allocation; it is filled with zeros
    // below, before anything reads it. Flags 0, not cudarc's default write-combined memory,
    // which the host reads uncached (slowly).
    let mut pinned = unsafe { context.alloc_pinned_with_flags::<f32>(len.max(1), 0) }
        .map_err(driver("cuMemHostAlloc"))?;
    pinned
        .as_mut_slice()
        .map_err(driver("cuEventSynchronize"))?
        .fill(0.0);
    Ok(pinned)
}
