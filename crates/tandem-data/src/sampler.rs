//! Splitting a dataset's indices between ranks.
//!
//! [`DistributedSampler`] follows PyTorch's `DistributedSampler`: every rank draws the same
//! permutation from (seed, epoch), pads it by wrapping around to a multiple of the world
//! size (or cuts it, with `drop_last`), and rank `r` takes every `world`-th index from `r`.
//! [`eval_shard`] is the exact split for evaluation: contiguous ranges, no padding.

use std::ops::Range;

use crate::error::DataError;
use crate::rng::{stream, SampleRng};

/// The indices one rank visits in each epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    num_samples: usize,
}

impl DistributedSampler {
    /// A sampler for `rank` of `num_replicas` over a dataset of `dataset_len` items.
    pub fn new(
        dataset_len: usize,
        num_replicas: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<DistributedSampler, DataError> {
        if num_replicas == 0 {
            return Err(DataError::Invalid {
                message: "sampler world size 0, expected at least 1".to_string(),
            });
        }
        if rank >= num_replicas {
            return Err(DataError::Invalid {
                message: format!(
                    "sampler rank {rank}, expected below the world size {num_replicas}"
                ),
            });
        }
        let num_samples = if drop_last {
            dataset_len / num_replicas
        } else {
            dataset_len.div_ceil(num_replicas)
        };
        Ok(DistributedSampler {
            dataset_len,
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
            num_samples,
        })
    }

    /// How many indices each rank visits per epoch.
    pub fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// The indices of this rank for `epoch`, in visiting order.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        self.indices_from(epoch, 0)
    }

    /// The indices of this rank for the rest of `epoch` once the job has visited the first
    /// `position` of the epoch's order (on any number of ranks): the rest of the order,
    /// padded or cut and shared among the ranks as [`DistributedSampler::indices`] shares
    /// the whole of it.
    pub fn indices_from(&self, epoch: u64, position: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            SampleRng::new(self.seed, stream::SHUFFLE, epoch, 0).shuffle(&mut order);
        }
        order.drain(..position.min(order.len()));
        let per_rank = match self.drop_last {
            true => order.len() / self.num_replicas,
            false => order.len().div_ceil(self.num_replicas),
        };
        let total = per_rank * self.num_replicas;
        if total > order.len() && !order.is_empty() {
            // Wrap around as often as needed (more than once when the dataset is smaller
            // than the padding).
            let original = order.clone();
            order.extend(original.iter().cycle().take(total - original.len()));
        }
        order.truncate(total);
        order
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }

    /// Whether the tail that does not divide evenly is dropped (instead of padded).
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }
}

/// The contiguous range of indices rank `rank` of `num_replicas` evaluates, so that every
/// index is evaluated exactly once. The first `len % num_replicas` ranks get one more.
/// Returns an empty range when `num_replicas` is 0 or `rank` is not below it.
pub fn eval_shard(len: usize, num_replicas: usize, rank: usize) -> Range<usize> {
    if num_replicas == 0 || rank >= num_replicas {
        return 0..0;
    }
    let base = len / num_replicas;
    let extra = len % num_replicas;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}
