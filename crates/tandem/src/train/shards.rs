//! Steps whose result does not depend on the number of workers (`--global-batch-size`).
//!
//! Each optimizer step takes the next G samples of the epoch's order and splits them into
//! S = G / M logical shards of M samples ([`ShardPlan`]); shard k of step t is the same
//! samples whichever worker computes it. The workers take contiguous, balanced runs of shards and compute each
//! shard as a micro-batch of its own, so a shard's gradient, loss and batch statistics are
//! the same bits on any number of workers. What remains is to combine them without an order
//! that depends on who held which shard:
//! - Gradients are added exactly ([`tandem_dist::exact`]): as whole numbers of a unit fixed
//!   per block of values by the largest magnitude over all shards, summed as integers over
//!   the shards and then the workers. Integer sums do not depend on their order, so the
//!   result is one rounding of the exact sum, the same on 1 to S workers. Under NCCL the
//!   shards' gradients stay on the GPU and the same sum runs there
//!   ([`TrainingDevice::exact_sum_shards`]: kernels and two NCCL all-reduces, the same
//!   bits); else they cross to the host and the host ring sums them.
//! - The running statistics of batch norm move shard by shard in shard order, as in one
//!   process: each worker records its shards' batch statistics, every worker gathers all of
//!   them and replays them from the statistics the step started with.
//! - The loss is the mean of the shards' losses, added in shard order.

use std::ops::Range;

use anyhow::{bail, Context};
use tandem_data::{eval_shard, ShardPlan};
use tandem_dist::exact;
use tandem_models::training_device::TrainBatch;
use tandem_models::training_device::{update_host, with_host_grads, StepConditions, StepRequest};
use tandem_models::{BatchNormReducer, TrainingDevice};

use super::ddp::Ddp;
use super::gradient_sync::GradientSync;

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
    /// Whether the shards' gradients stay on the device and are summed there (the device
    /// joined an NCCL group); else they cross to the host.
    on_device: bool,
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
            on_device: device.uses_nccl(),
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

    /// The exact sum of every worker's shard gradients (this worker's `own` of
    /// `total_shards`, kept on the host) through the host ring, into the device's gradients.
    fn sum_on_the_host(
        &mut self,
        device: &mut dyn TrainingDevice,
        own: usize,
        total_shards: usize,
    ) -> anyhow::Result<()> {
        if self.shard_grads.is_empty() {
            let len = device.param_count();
            self.shard_grads.push(vec![0.0; len]);
        }
        self.summed.resize(device.param_count(), 0.0);
        let shard_grads = std::mem::take(&mut self.shard_grads);
        let summed = std::mem::take(&mut self.summed);
        (self.shard_grads, self.summed) = match self.group.as_mut() {
            Some(ddp) => ddp.exact_sum(shard_grads, own, total_shards, summed)?,
            None => {
                let mut summed = summed;
                let terms: Vec<&[f32]> = shard_grads[..own].iter().map(Vec::as_slice).collect();
                exact::local_exact_sum(&terms, &mut summed);
                (shard_grads, summed)
            }
        };
        let summed = &self.summed;
        with_host_grads(device, |grads| -> anyhow::Result<()> {
            grads.copy_from_slice(summed);
            Ok(())
        })
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

    fn why_not_whole(&self) -> Option<&'static str> {
        Some("--global-batch-size keeps each shard's gradients apart until the step's exact sum")
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
        if self.on_device {
            device.keep_shard_grads(slot)?;
            return Ok(());
        }
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
        match self.on_device {
            true => device.exact_sum_shards(own, total_shards)?,
            false => self.sum_on_the_host(device, own, total_shards)?,
        }
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
