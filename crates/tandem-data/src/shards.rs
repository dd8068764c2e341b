//! Steps of a global batch in logical shards (`--global-batch-size`): which samples make
//! each shard of each step, and which shards each of any number of workers computes.
//!
//! Each optimizer step takes the next G samples of the epoch's order and splits them into
//! S = G / M shards of M samples; shard k of step t is the same samples on any number of
//! workers. The workers take contiguous, balanced runs of a step's shards.

use std::ops::Range;

use crate::error::DataError;
use crate::sampler::eval_shard;

/// How an epoch's samples form steps of logical shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    /// Samples per optimizer step (G).
    pub global_batch: usize,
    /// Samples per shard (M).
    pub micro_batch: usize,
    /// Samples per epoch.
    pub dataset_len: usize,
}

impl ShardPlan {
    /// The plan of `--global-batch-size global_batch` with `--batch-size micro_batch` over
    /// `dataset_len` samples; an error when M does not divide G, saying which would.
    pub fn new(
        global_batch: usize,
        micro_batch: usize,
        dataset_len: usize,
    ) -> Result<ShardPlan, DataError> {
        if micro_batch == 0 || global_batch == 0 || !global_batch.is_multiple_of(micro_batch) {
            let divisors: Vec<String> = (1..=global_batch.min(4096))
                .filter(|size| global_batch.is_multiple_of(*size))
                .map(|size| size.to_string())
                .collect();
            return Err(DataError::Invalid {
                message: format!(
                    "--global-batch-size {global_batch} is not a whole number of micro-batches \
                     of --batch-size {micro_batch}: use a --batch-size that divides it ({})",
                    divisors.join(", ")
                ),
            });
        }
        Ok(ShardPlan {
            global_batch,
            micro_batch,
            dataset_len,
        })
    }

    /// Shards of a full step (S).
    pub fn shards_per_step(&self) -> usize {
        self.global_batch / self.micro_batch
    }

    /// Optimizer steps per epoch; the last may be shorter.
    pub fn steps_per_epoch(&self) -> u64 {
        self.dataset_len.div_ceil(self.global_batch) as u64
    }

    /// An error when `world_size` workers cannot share a step's shards, naming the sizes
    /// that could.
    pub fn check_world_size(&self, world_size: usize) -> Result<(), DataError> {
        let shards = self.shards_per_step();
        if world_size > shards {
            return Err(DataError::Invalid {
                message: format!(
                    "{world_size} workers cannot share the {shards} shards of a step \
                     (--global-batch-size {} / --batch-size {}): run at most {shards} workers, \
                     or give each a smaller --batch-size (at most {})",
                    self.global_batch,
                    self.micro_batch,
                    self.global_batch / world_size
                ),
            });
        }
        Ok(())
    }

    /// The positions in the epoch's order of step `step`'s samples.
    fn step_positions(&self, step: u64) -> Range<usize> {
        let start = (step as usize * self.global_batch).min(self.dataset_len);
        start..(start + self.global_batch).min(self.dataset_len)
    }

    /// Shards of step `step`: S, or fewer in an epoch's last step.
    pub fn shards_in_step(&self, step: u64) -> usize {
        self.step_positions(step).len().div_ceil(self.micro_batch)
    }

    /// The shards of step `step` that worker `worker` of `world_size` computes.
    pub fn worker_shards(&self, step: u64, world_size: usize, worker: usize) -> Range<usize> {
        eval_shard(self.shards_in_step(step), world_size, worker)
    }

    /// The positions in the epoch's order of shard `shard` of step `step`.
    fn shard_positions(&self, step: u64, shard: usize) -> Range<usize> {
        let step_positions = self.step_positions(step);
        let start = step_positions.start + shard * self.micro_batch;
        start.min(step_positions.end)..(start + self.micro_batch).min(step_positions.end)
    }

    /// The samples worker `worker` of `world_size` visits in an epoch whose order is `order`:
    /// its shards of each step, in step and shard order. Every shard but an epoch's last is
    /// whole, so micro-batches of M samples over this list are its shards.
    pub fn worker_indices(&self, order: &[usize], world_size: usize, worker: usize) -> Vec<usize> {
        let mut indices = Vec::new();
        for step in 0..self.steps_per_epoch() {
            for shard in self.worker_shards(step, world_size, worker) {
                indices.extend_from_slice(&order[self.shard_positions(step, shard)]);
            }
        }
        indices
    }

    /// The micro-batches worker `worker` of `world_size` computes before step `step`.
    pub fn micro_batches_before(&self, step: u64, world_size: usize, worker: usize) -> usize {
        (0..step)
            .map(|earlier| self.worker_shards(earlier, world_size, worker).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(global: usize, micro: usize, len: usize) -> ShardPlan {
        ShardPlan::new(global, micro, len).unwrap()
    }

    #[test]
    fn a_global_batch_that_micro_batches_do_not_fill_is_refused_with_the_sizes_that_would() {
        let error = ShardPlan::new(128, 24, 1000).unwrap_err().to_string();
        assert_eq!(
            error,
            "invalid setting: --global-batch-size 128 is not a whole number of micro-batches of \
             --batch-size 24: use a --batch-size that divides it (1, 2, 4, 8, 16, 32, 64, 128)"
        );
        let error = plan(128, 16, 1000)
            .check_world_size(9)
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "invalid setting: 9 workers cannot share the 8 shards of a step (--global-batch-size 128 / \
             --batch-size 16): run at most 8 workers, or give each a smaller --batch-size (at \
             most 14)"
        );
        assert!(plan(128, 16, 1000).check_world_size(8).is_ok());
    }

    #[test]
    fn every_sample_is_in_exactly_one_shard_of_one_worker_for_any_world_size() {
        // 1000 samples in steps of 128: 7 full steps and one of 104 (7 shards, the last 8).
        let plan = plan(128, 16, 1000);
        assert_eq!(plan.steps_per_epoch(), 8);
        assert_eq!(plan.shards_in_step(7), 7);
        let order: Vec<usize> = (0..1000).rev().collect();
        for world_size in 1..=8 {
            let mut seen = vec![0usize; 1000];
            for worker in 0..world_size {
                for index in plan.worker_indices(&order, world_size, worker) {
                    seen[index] += 1;
                }
                let all = plan.micro_batches_before(8, world_size, worker);
                let listed = plan.worker_indices(&order, world_size, worker).len();
                assert_eq!(
                    all,
                    listed.div_ceil(16),
                    "world {world_size}, worker {worker}"
                );
            }
            assert!(seen.iter().all(|&count| count == 1), "world {world_size}");
        }
        // Worker 1 of 3 holds shards 3..6 of a full step, 3..5 of the last.
        assert_eq!(plan.worker_shards(0, 3, 1), 3..6);
        assert_eq!(plan.worker_shards(7, 3, 1), 3..5);
        assert_eq!(plan.micro_batches_before(2, 3, 2), 4);
    }

    #[test]
    fn every_sample_is_used_once_when_the_number_of_workers_changes_between_steps() {
        let plan = plan(128, 16, 1000);
        let order: Vec<usize> = (0..1000).map(|k| (k * 7) % 1000).collect();
        // Steps 0..3 on 4 workers, 3..5 on 2, 5..8 on 8: what each worker visits from the
        // step where it (re)starts, as a resumed worker's loader skips to it.
        let mut seen = vec![0usize; 1000];
        for (steps, world_size) in [(0..3, 4), (3..5, 2), (5..8, 8)] {
            for worker in 0..world_size {
                let indices = plan.worker_indices(&order, world_size, worker);
                let start = plan.micro_batches_before(steps.start, world_size, worker) * 16;
                let end = plan.micro_batches_before(steps.end, world_size, worker) * 16;
                for &index in &indices[start.min(indices.len())..end.min(indices.len())] {
                    seen[index] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&count| count == 1), "{seen:?}");
    }
}
