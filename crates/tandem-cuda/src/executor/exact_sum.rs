//! The exact sum of `--global-batch-size`'s shard gradients on the device (tandem_dist::exact
//! bit for bit, so the result is that of the host ring and of one process).
//!
//! After each shard's backward, [`CudaExecutor::keep_shard_gradients`] copies the gradients
//! into the shard's slot of a device buffer and zeroes them. [`CudaExecutor::exact_sum_shards`]
//! then runs, with no host wait and no gradient on the host: the block keys of this rank's
//! shards (`exact_block_maxima`), their maximum over the ranks (`ncclAllReduce`, `ncclMax` of
//! int32), each value as whole units summed over the shards (`exact_integer_sums`), the sum
//! over the ranks (`ncclAllReduce`, `ncclSum` of int64), and the write-back into the gradients
//! (`exact_write_sums`). Integers add exactly in any order, so NCCL's own all-reduce keeps the
//! sum independent of the order and of the number of ranks: no fixed-order reduction (grouped
//! sends and a sum in rank order) is needed. Without an NCCL group the sum is this process's.

use cudarc::driver::CudaSlice;

use super::error::driver;
use super::kernels::exact_sum::{exact_block_maxima, exact_integer_sums, exact_write_sums};
use super::kernels::{Ptr, Queue};
use super::launch::per_element;
use super::{address, CudaExecutor, GpuError};

/// Values that share one unit (`EXACT_BLOCK` of `exact_sum.cu`, `tandem_dist::exact::BLOCK`).
pub const EXACT_BLOCK: usize = 64;

/// The device buffers of the exact sum: the kept shard gradients, one slot of the gradients'
/// length each, and the block keys and integer sums.
pub(super) struct ShardGradients {
    /// `slots` gradient-sized terms, one after the other.
    terms: CudaSlice<f32>,
    slots: usize,
    keys: CudaSlice<i32>,
    sums: CudaSlice<i64>,
}

impl CudaExecutor {
    /// Copies the gradients into shard slot `slot` on the device (the slots grow as needed)
    /// and sets the gradients to zero, for the next shard's backward.
    pub fn keep_shard_gradients(&mut self, slot: usize) -> Result<(), GpuError> {
        self.bind()?;
        let len = self.flat.host_grads.len();
        self.grow_shard_slots(slot + 1)?;
        let shards = self.flat.shards.as_mut().ok_or(GpuError::Unsupported(
            "shard gradients without their buffers",
        ))?;
        if len > 0 {
            let mut target = shards.terms.slice_mut(slot * len..(slot + 1) * len);
            self.stream
                .memcpy_dtod(&self.flat.grads.values(), &mut target)
                .map_err(driver("cuMemcpyDtoDAsync"))?;
        }
        self.zero_grads()
    }

    /// Makes room for `slots` shard slots, keeping those already kept.
    fn grow_shard_slots(&mut self, slots: usize) -> Result<(), GpuError> {
        let len = self.flat.host_grads.len();
        if let Some(shards) = &self.flat.shards {
            if shards.slots >= slots {
                return Ok(());
            }
        }
        let alloc = driver("cuMemAllocAsync");
        let mut terms = self
            .stream
            .alloc_zeros::<f32>((slots * len).max(1))
            .map_err(&alloc)?;
        let (keys, sums) = match self.flat.shards.take() {
            Some(old) => {
                if old.slots * len > 0 {
                    let kept = old.terms.slice(..old.slots * len);
                    self.stream
                        .memcpy_dtod(&kept, &mut terms.slice_mut(..old.slots * len))
                        .map_err(driver("cuMemcpyDtoDAsync"))?;
                }
                (old.keys, old.sums)
            }
            None => (
                self.stream
                    .alloc_zeros::<i32>(len.div_ceil(EXACT_BLOCK).max(1))
                    .map_err(&alloc)?,
                self.stream.alloc_zeros::<i64>(len.max(1)).map_err(&alloc)?,
            ),
        };
        self.flat.shards = Some(ShardGradients {
            terms,
            slots,
            keys,
            sums,
        });
        Ok(())
    }

    /// Replaces the gradients by the exact sum of the first `own` kept shard gradients of
    /// every rank of the NCCL group (of this process without one), `total_terms` shards over
    /// all ranks: the same bits as `tandem_dist::exact` on the host, whatever the order and
    /// the number of ranks. `own` may be 0 (a rank without shards adds nothing).
    pub fn exact_sum_shards(&mut self, own: usize, total_terms: usize) -> Result<(), GpuError> {
        self.bind()?;
        let len = self.flat.host_grads.len();
        self.grow_shard_slots(own.max(1))?;
        self.flat.host_grads.mark_stale();
        if len == 0 {
            return Ok(());
        }
        let shards = self
            .flat
            .shards
            .as_ref()
            .ok_or(GpuError::Unsupported("an exact sum without its buffers"))?;
        let as_i32 = |value: usize| {
            i32::try_from(value).map_err(|_| GpuError::Unsupported("more shards than an int holds"))
        };
        let (count, n, total) = (as_i32(own)?, len as i64, total_terms.max(1) as i64);
        let terms = Ptr::from_address(address(&shards.terms, &self.stream));
        let keys = Ptr::<i32>::from_address(address(&shards.keys, &self.stream));
        let sums = Ptr::<i64>::from_address(address(&shards.sums, &self.stream));
        let blocks = len.div_ceil(EXACT_BLOCK);
        let queue = Queue::new(&self.libraries.kernels, &self.stream);
        exact_block_maxima(&queue, per_element(blocks), terms, n, count, n, keys)?;
        self.all_reduce_exact(keys.address(), blocks, false)?;
        exact_integer_sums(
            &queue,
            per_element(len),
            terms,
            n,
            count,
            n,
            keys,
            total,
            sums,
        )?;
        self.all_reduce_exact(sums.address(), len, true)?;
        let grads = self.flat.grads.ptr(&self.stream);
        exact_write_sums(&queue, per_element(len), sums, n, keys, total, grads)
    }

    /// With an NCCL group, queues the all-reduce of the exact sum's `len` block keys (the
    /// maximum of int32s) or, with `sums`, of its integers (the sum of int64s) at `base`,
    /// after the compute stream's work so far, and makes the compute stream wait for it.
    fn all_reduce_exact(&self, base: u64, len: usize, sums: bool) -> Result<(), GpuError> {
        let Some(group) = self.nccl_group() else {
            return Ok(());
        };
        group.wait_for(&self.stream)?;
        let name = if sums {
            // SAFETY: `base` is the exact sum's integer buffer, `len` (the gradients' length)
            // int64s on this GPU, kept by the executor, whose compute stream waits for the
            // group's stream below before anything frees or reads it.
            unsafe { group.all_reduce_sum_i64(base, len)? };
            "sum of the shards' integer gradients (--global-batch-size)"
        } else {
            // SAFETY: as above, the block keys: `len` int32s, one per block.
            unsafe { group.all_reduce_max_i32(base, len)? };
            "maximum of the shards' gradient magnitudes (--global-batch-size)"
        };
        group.hand_back(&self.stream, name.to_string())?;
        Ok(())
    }
}
