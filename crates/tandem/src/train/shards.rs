//! Steps whose result does not depend on the number of workers (`--global-batch-size`).
//!
//! Each optimizer step takes the next G samples of the epoch's order and splits them into
//! S = G / M logical shards of M samples; shard k of step t is the same samples whichever
//! worker computes it. The workers take contiguous, balanced runs of shards and compute each
//! shard as a micro-batch of its own, so a shard's gradient, loss and batch statistics are
//! the same bits on any number of workers. What remains is to combine them without an order
//! that depends on who held which shard:
//! - Gradients are added exactly ([`tandem_dist::exact`]): as whole numbers of a unit fixed
//!   per block of values by the largest magnitude over all shards, summed as integers over
//!   the shards and then the workers. Integer sums do not depend on their order, so the
//!   result is one rounding of the exact sum, the same on 1 to S workers.
//! - The running statistics of batch norm move shard by shard in shard order, as in one
//!   process: each worker records its shards' batch statistics, every worker gathers all of
//!   them and replays them from the statistics the step started with.
//! - The loss is the mean of the shards' losses, added in shard order.

use std::ops::Range;

use anyhow::{bail, Context};
use tandem_data::eval_shard;
use tandem_dist::exact;
use tandem_models::training_device::TrainBatch;
use tandem_models::training_device::{update_host, with_host_grads, StepConditions, StepRequest};
use tandem_models::{BatchNormReducer, TrainingDevice};

use super::ddp::Ddp;
use super::gradient_sync::GradientSync;

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
    ) -> anyhow::Result<ShardPlan> {
        if micro_batch == 0 || global_batch == 0 || !global_batch.is_multiple_of(micro_batch) {
            let divisors: Vec<String> = (1..=global_batch.min(4096))
                .filter(|size| global_batch.is_multiple_of(*size))
                .map(|size| size.to_string())
                .collect();
            bail!(
                "--global-batch-size {global_batch} is not a whole number of micro-batches of \
                 --batch-size {micro_batch}: use a --batch-size that divides it ({})",
                divisors.join(", ")
            );
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
    pub fn check_world_size(&self, world_size: usize) -> anyhow::Result<()> {
        let shards = self.shards_per_step();
        if world_size > shards {
            bail!(
                "{world_size} workers cannot share the {shards} shards of a step \
                 (--global-batch-size {} / --batch-size {}): run at most {shards} workers, \
                 or give each a smaller --batch-size (at most {})",
                self.global_batch,
                self.micro_batch,
                self.global_batch / world_size
            );
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

/// The strategy of `--global-batch-size`: each micro-batch is a logical shard, and the
/// shards' gradients, batch statistics and losses are combined in an order that does not
/// depend on how many workers computed them.
pub struct ShardSync {
    /// The job's process group; `None` for one process computing every shard.
    group: Option<Ddp>,
    plan: ShardPlan,
    world_size: usize,
    worker: usize,
    /// This step's shard count and this worker's shards.
    step_shards: (usize, Range<usize>),
    /// This worker's shards' gradients, in shard order (allocated once, reused).
    shard_grads: Vec<Vec<f32>>,
    /// This worker's shards' batch statistics, in shard order.
    shard_statistics: Vec<Vec<f64>>,
    /// The step's gradient: the exact sum of every shard's.
    summed: Vec<f32>,
    /// The running statistics and batch count the step started with.
    buffers_before: (Vec<f32>, u64),
    /// The length of one forward's batch statistics.
    statistics_len: usize,
}

impl ShardSync {
    /// The strategy for worker `worker` of the job of `group` (one process without one),
    /// training the model on `device` with `plan`.
    pub fn new(
        group: Option<Ddp>,
        plan: ShardPlan,
        device: &mut dyn TrainingDevice,
    ) -> anyhow::Result<ShardSync> {
        let (world_size, worker) = group
            .as_ref()
            .map_or((1, 0), |ddp| (ddp.world_size(), ddp.rank()));
        plan.check_world_size(world_size)?;
        let statistics_len = device.host_model()?.batch_statistics_len();
        Ok(ShardSync {
            group,
            plan,
            world_size,
            worker,
            step_shards: (0, 0..0),
            shard_grads: Vec::new(),
            shard_statistics: Vec::new(),
            summed: Vec::new(),
            buffers_before: (Vec::new(), 0),
            statistics_len,
        })
    }

    /// Every shard's loss and batch statistics of the step, in shard order: this worker's
    /// with every other worker's.
    fn all_shard_records(&self, losses: &[f32], total_shards: usize) -> anyhow::Result<Vec<f64>> {
        let record_len = 1 + self.statistics_len;
        let slots = total_shards.div_ceil(self.world_size);
        let mut part = vec![0.0f64; slots * record_len];
        for (slot, (loss, statistics)) in losses.iter().zip(&self.shard_statistics).enumerate() {
            let record = &mut part[slot * record_len..(slot + 1) * record_len];
            record[0] = f64::from(*loss);
            record[1..].copy_from_slice(statistics);
        }
        let gathered = match &self.group {
            Some(ddp) => ddp.all_gather_f64(part)?,
            None => part,
        };
        let mut records = Vec::with_capacity(total_shards * record_len);
        for worker in 0..self.world_size {
            let shards = eval_shard(total_shards, self.world_size, worker).len();
            let start = worker * slots * record_len;
            records.extend_from_slice(&gathered[start..start + shards * record_len]);
        }
        Ok(records)
    }
}

impl GradientSync for ShardSync {
    fn group(&self) -> Option<&Ddp> {
        self.group.as_ref()
    }

    fn group_mut(&mut self) -> Option<&mut Ddp> {
        self.group.as_mut()
    }

    /// Never a whole step: each shard's gradient is read out on its own.
    fn conditions(&self) -> StepConditions {
        StepConditions {
            data_parallel: true,
            sync_bn: false,
            nccl: false,
        }
    }

    fn agree_on_the_model(&mut self, device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
        match self.group.as_mut() {
            Some(ddp) => update_host(device, |model| ddp.broadcast_model(model)),
            None => Ok(()),
        }
    }

    fn before_step(&mut self, device: &mut dyn TrainingDevice, step: u64) -> anyhow::Result<()> {
        let shards = self.plan.worker_shards(step, self.world_size, self.worker);
        self.step_shards = (self.plan.shards_in_step(step), shards);
        let model = device.host_model()?;
        self.buffers_before = (model.buffers().to_vec(), model.num_batches_tracked());
        self.shard_statistics.clear();
        Ok(())
    }

    fn loss_scale(&self, _count: usize) -> f32 {
        1.0 / self.step_shards.0.max(1) as f32
    }

    fn forward(
        &mut self,
        device: &mut dyn TrainingDevice,
        batch: TrainBatch<'_>,
        request: &StepRequest<'_>,
    ) -> anyhow::Result<f32> {
        let mut recorder = StatisticsRecorder::default();
        let loss = device.forward_train(
            batch,
            request.height,
            request.width,
            request.loss,
            Some(&mut recorder),
        )?;
        if recorder.statistics.len() != self.statistics_len {
            bail!(
                "a forward recorded {} batch statistics, expected {}",
                recorder.statistics.len(),
                self.statistics_len
            );
        }
        self.shard_statistics.push(recorder.statistics);
        Ok(loss)
    }

    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        _last: bool,
    ) -> anyhow::Result<()> {
        device.backward(loss_scale, None, None)?;
        let slot = self
            .shard_statistics
            .len()
            .checked_sub(1)
            .context("a shard's backward without its forward")?;
        if self.shard_grads.len() <= slot {
            self.shard_grads.push(Vec::new());
        }
        let target = &mut self.shard_grads[slot];
        with_host_grads(device, |grads| -> anyhow::Result<()> {
            target.clear();
            target.extend_from_slice(grads);
            grads.fill(0.0);
            Ok(())
        })
    }

    fn finish(
        &mut self,
        device: &mut dyn TrainingDevice,
        losses: &[f32],
    ) -> anyhow::Result<Option<f64>> {
        let (total_shards, own) = (self.step_shards.0, self.step_shards.1.len());
        if losses.len() != own {
            bail!(
                "worker {} computed {} micro-batches of a step in which it holds {own} shards",
                self.worker,
                losses.len()
            );
        }
        if self.shard_grads.is_empty() {
            let len = device.param_count();
            self.shard_grads.push(vec![0.0; len]);
        }
        self.summed.resize(device.param_count(), 0.0);
        let shard_grads = std::mem::take(&mut self.shard_grads);
        self.shard_grads = match self.group.as_mut() {
            Some(ddp) => ddp.exact_sum(shard_grads, own, total_shards, &mut self.summed)?,
            None => {
                let terms: Vec<&[f32]> = shard_grads[..own].iter().map(Vec::as_slice).collect();
                exact::local_exact_sum(&terms, &mut self.summed);
                shard_grads
            }
        };
        let summed = &self.summed;
        with_host_grads(device, |grads| -> anyhow::Result<()> {
            grads.copy_from_slice(summed);
            Ok(())
        })?;
        let records = self.all_shard_records(losses, total_shards)?;
        let record_len = 1 + self.statistics_len;
        let (buffers, batches) = &self.buffers_before;
        update_host(device, |model| -> anyhow::Result<()> {
            model.buffers_mut().copy_from_slice(buffers);
            model.set_num_batches_tracked(*batches);
            for record in records.chunks(record_len) {
                model
                    .apply_batch_statistics(&record[1..])
                    .context("replaying the shards' batch statistics")?;
            }
            Ok(())
        })?;
        let loss_sum: f64 = records.chunks(record_len).map(|record| record[0]).sum();
        Ok(Some(loss_sum / total_shards.max(1) as f64))
    }
}

/// Keeps what each batch norm of a forward hands its reducer, one after the other, and
/// leaves it unchanged: the statistics stay this shard's own.
#[derive(Default)]
struct StatisticsRecorder {
    statistics: Vec<f64>,
}

impl BatchNormReducer for StatisticsRecorder {
    fn all_reduce_sum(
        &mut self,
        values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.statistics.extend_from_slice(values);
        Ok(())
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
            "--global-batch-size 128 is not a whole number of micro-batches of --batch-size \
             24: use a --batch-size that divides it (1, 2, 4, 8, 16, 32, 64, 128)"
        );
        let error = plan(128, 16, 1000)
            .check_world_size(9)
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "9 workers cannot share the 8 shards of a step (--global-batch-size 128 / \
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
