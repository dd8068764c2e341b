//! The model's flat parameter and gradient buffers on the device, placed so that the
//! convolution filters start on 16-byte boundaries.
//!
//! The shared layout puts the head first (`classes x features` weights and `classes` biases),
//! so with ten classes every filter after it starts 8 bytes off a 16-byte boundary. cuDNN
//! measures its algorithms on buffers of its own, which are aligned, and vectorized kernels
//! need aligned operands; PyTorch never meets the case (each weight is its own allocation).
//! Rather than change the layout that checkpoints and the CPU share, the device buffer begins
//! `offset` floats into its allocation, with `offset` chosen to align the filters.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};

use super::error::{driver, GpuError};
use super::kernels::Ptr;
use super::{address, at};

/// A flat buffer of `len` floats starting `offset` floats into its allocation.
pub struct FlatBuffer {
    allocation: CudaSlice<f32>,
    offset: usize,
    len: usize,
}

impl FlatBuffer {
    /// A copy of `values` on the device, `offset` floats into its allocation.
    pub fn upload(
        stream: &Arc<CudaStream>,
        values: &[f32],
        offset: usize,
    ) -> Result<FlatBuffer, GpuError> {
        let mut allocation = stream
            .alloc_zeros::<f32>(offset + values.len().max(1))
            .map_err(driver("cuMemAllocAsync"))?;
        if !values.is_empty() {
            stream
                .memcpy_htod(
                    values,
                    &mut allocation.slice_mut(offset..offset + values.len()),
                )
                .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        Ok(FlatBuffer {
            allocation,
            offset,
            len: values.len(),
        })
    }

    /// `len` zeros on the device, `offset` floats into their allocation.
    pub fn zeros(
        stream: &Arc<CudaStream>,
        len: usize,
        offset: usize,
    ) -> Result<FlatBuffer, GpuError> {
        let allocation = stream
            .alloc_zeros::<f32>(offset + len.max(1))
            .map_err(driver("cuMemAllocAsync"))?;
        Ok(FlatBuffer {
            allocation,
            offset,
            len,
        })
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of value 0.
    pub fn address(&self, stream: &CudaStream) -> u64 {
        at(address(&self.allocation, stream), self.offset)
    }

    /// The first value as a kernel argument.
    pub fn ptr(&self, stream: &CudaStream) -> Ptr<f32> {
        Ptr::from_address(self.address(stream))
    }

    /// Values `range` (of the buffer's own indices).
    pub fn view(&self, range: std::ops::Range<usize>) -> CudaView<'_, f32> {
        self.allocation
            .slice(self.offset + range.start..self.offset + range.end)
    }

    /// Every value.
    pub fn values(&self) -> CudaView<'_, f32> {
        self.view(0..self.len)
    }

    /// Every value, to write.
    pub fn values_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.allocation
            .slice_mut(self.offset..self.offset + self.len)
    }

    /// Sets every value to zero.
    pub fn zero(&mut self, stream: &Arc<CudaStream>) -> Result<(), GpuError> {
        stream
            .memset_zeros(&mut self.allocation)
            .map_err(driver("cuMemsetD8Async"))
    }
}

/// The offset, 0 to 3 floats, that starts the most of `filter_starts` (offsets in the flat
/// buffer) on a 16-byte boundary; the smallest such offset on a tie.
pub fn aligning_offset(filter_starts: impl IntoIterator<Item = usize>) -> usize {
    let mut aligned = [0usize; 4];
    for start in filter_starts {
        aligned[(4 - start % 4) % 4] += 1;
    }
    (0..4)
        .max_by_key(|&offset| (aligned[offset], std::cmp::Reverse(offset)))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_aligns_the_most_filters() {
        // The seed-004 and ResNet layouts: filters at 2 mod 4 after a 10-class head.
        assert_eq!(aligning_offset([5130, 5130 + 1728, 5130 + 1728 + 36864]), 2);
        assert_eq!(aligning_offset([4, 8, 13]), 0);
        assert_eq!(aligning_offset([1, 5, 8]), 3);
        assert_eq!(aligning_offset([3, 7, 9]), 1);
        // A tie goes to the smaller offset; no filters need none.
        assert_eq!(aligning_offset([4, 3]), 0);
        assert_eq!(aligning_offset([]), 0);
    }

    #[test]
    fn every_aligned_start_is_a_multiple_of_four_floats() {
        for starts in [[5130usize, 9000, 12346], [7, 11, 15], [2, 6, 9]] {
            let offset = aligning_offset(starts);
            let aligned = starts
                .iter()
                .filter(|&&start| (start + offset) % 4 == 0)
                .count();
            assert!(aligned >= 2, "{starts:?} with offset {offset}");
        }
    }
}
