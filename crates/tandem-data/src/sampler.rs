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
    /// The seed of the permutation, or `None` to visit the indices in order.
    shuffle_seed: Option<u64>,
    drop_last: bool,
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
        Ok(DistributedSampler {
            dataset_len,
            num_replicas,
            rank,
            shuffle_seed: shuffle.then_some(seed),
            drop_last,
        })
    }

    /// How many indices each rank visits per epoch.
    pub fn num_samples(&self) -> usize {
        self.share_of(self.dataset_len)
    }

    /// How many of `len` indices each rank visits: padded up, or cut down with `drop_last`.
    fn share_of(&self, len: usize) -> usize {
        match self.drop_last {
            true => len / self.num_replicas,
            false => len.div_ceil(self.num_replicas),
        }
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
        if let Some(seed) = self.shuffle_seed {
            SampleRng::new(seed, stream::SHUFFLE, epoch, 0).shuffle(&mut order);
        }
        order.drain(..position.min(order.len()));
        let total = self.share_of(order.len()) * self.num_replicas;
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
