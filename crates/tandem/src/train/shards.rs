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
//!
//! With `--sync-bn` ([`ShardSync::with_sync_bn`]) the batch statistics are instead those of
//! the whole global batch, in forward and backward, and a worker's shards run in lockstep
//! ([`super::lockstep`]); the running statistics then move once per step.

use std::ops::Range;
use std::time::Duration;

use anyhow::{bail, Context};
use tandem_data::{eval_shard, ShardPlan};
use tandem_dist::exact;
use tandem_models::training_device::TrainBatch;
use tandem_models::training_device::{
    update_host, with_host_grads, StepConditions, StepRequest, TrainImages,
};
use tandem_models::{BatchNormReducer, TrainingDevice};

use super::ddp::Ddp;
use super::gradient_sync::{one_after_another, GradientSync};
use super::lockstep::{shard_ordered_total, Lockstep, LockstepStep, ShardInput};

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
    /// This worker's shards' gradients in shard order (allocated once, reused): on the host
    /// all but the last, which stays in the device for the bucketed sum.
    shard_grads: Vec<Vec<f32>>,
    /// This worker's shards' batch statistics, in shard order.
    shard_statistics: Vec<Vec<f64>>,
    /// The buffers of the exact sum in one process.
    local_sum: exact::LocalExactSum,
    /// The running statistics and batch count the step started with.
    buffers_before: (Vec<f32>, u64),
    /// The length of one forward's batch statistics (0 with SyncBatchNorm, whose running
    /// statistics are not replayed).
    statistics_len: usize,
    /// The shards' replicas with SyncBatchNorm over the global batch; `None` without.
    lockstep: Option<Lockstep>,
    /// Whether a step began and has not finished.
    in_step: bool,
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
            local_sum: exact::LocalExactSum::default(),
            buffers_before: (Vec::new(), 0),
            statistics_len,
            lockstep: None,
            in_step: false,
        })
    }

    /// The backward of this worker's last shard of the step (in `slot`): each range of
    /// gradients that is final starts its part of the exact sum over the job.
    fn last_backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        slot: usize,
    ) -> anyhow::Result<()> {
        let Some(ddp) = self.group.as_mut() else {
            return Ok(device.backward(loss_scale, None, None)?);
        };
        let earlier: Vec<&[f32]> = self.shard_grads[..slot].iter().map(Vec::as_slice).collect();
        let mut failure = None;
        device.backward(
            loss_scale,
            None,
            Some(&mut |range, values| {
                if let Err(error) = ddp.exact_gradients_ready(&earlier, range, values) {
                    failure.get_or_insert(error);
                }
            }),
        )?;
        match failure {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// The same strategy with batch statistics over the whole global batch (`--sync-bn`),
    /// each wait bounded by `timeout`. The model must be on the CPU.
    pub fn with_sync_bn(mut self, timeout: Duration) -> ShardSync {
        self.lockstep = Some(Lockstep::new(timeout));
        self.statistics_len = 0;
        self
    }

    /// This worker's shards of the step in lockstep with SyncBatchNorm over all of the
    /// step's shards ([`super::lockstep`]); keeps each shard's gradient and returns the
    /// shards' losses.
    fn lockstep_shards(
        &mut self,
        device: &mut dyn TrainingDevice,
        request: &StepRequest<'_>,
        loss_scale: f32,
    ) -> anyhow::Result<Vec<f32>> {
        let inputs = request
            .micro_batches
            .iter()
            .map(|batch| match batch.images {
                TrainImages::Host(images) => Ok(ShardInput {
                    images,
                    labels: batch.labels,
                }),
                _ => bail!("--sync-bn with --global-batch-size needs the images on the host"),
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let step = LockstepStep {
            height: request.height,
            width: request.width,
            loss: request.loss,
            loss_scale,
            first_shard: self.step_shards.1.start,
        };
        let (world_size, total_shards) = (self.world_size, self.step_shards.0);
        let slots = total_shards.div_ceil(world_size);
        let counts: Vec<usize> = (0..world_size)
            .map(|worker| eval_shard(total_shards, world_size, worker).len())
            .collect();
        let group = self.group.as_ref();
        let mut combine = |deposits: Vec<Vec<f64>>, len: usize| -> anyhow::Result<Vec<f64>> {
            let mut part = vec![0.0f64; slots * len];
            for (record, deposit) in part.chunks_mut(len.max(1)).zip(&deposits) {
                if deposit.len() != len {
                    bail!(
                        "a shard's batch statistics have {} values, expected {len}",
                        deposit.len()
                    );
                }
                record.copy_from_slice(deposit);
            }
            let gathered = match group {
                Some(ddp) => ddp.all_gather_f64(part)?,
                None => part,
            };
            shard_ordered_total(&gathered, &counts, slots, len)
        };
        let lockstep = self.lockstep.as_mut().context("no SyncBatchNorm set up")?;
        let losses = update_host(device, |model| {
            lockstep.run(model, &inputs, step, &mut combine)
        })?;
        self.shard_statistics = vec![Vec::new(); losses.len()];
        // The last shard's gradient goes into the device, as the last backward leaves it
        // without SyncBatchNorm; the others are kept.
        let earlier = losses.len().saturating_sub(1);
        self.shard_grads
            .resize_with(earlier.max(self.shard_grads.len()), Vec::new);
        for (slot, target) in self.shard_grads.iter_mut().take(earlier).enumerate() {
            let gradient = lockstep
                .gradient(slot)
                .context("a shard without its gradient")?;
            target.clear();
            target.extend_from_slice(gradient);
        }
        if let Some(slot) = losses.len().checked_sub(1) {
            let gradient = lockstep
                .gradient(slot)
                .context("a shard without its gradient")?;
            with_host_grads(device, |grads| -> anyhow::Result<()> {
                grads.copy_from_slice(gradient);
                Ok(())
            })?;
        }
        Ok(losses)
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

    /// The exact sum of this worker's shards over the job on the host: the last shard's
    /// gradient, in the device's host gradients, is one of the terms and receives the sum.
    fn sum_on_the_host(
        &mut self,
        device: &mut dyn TrainingDevice,
        own: usize,
        total_shards: usize,
    ) -> anyhow::Result<()> {
        let earlier: Vec<&[f32]> = self.shard_grads[..own.saturating_sub(1)]
            .iter()
            .map(Vec::as_slice)
            .collect();
        let (group, local_sum) = (&mut self.group, &mut self.local_sum);
        with_host_grads(device, |grads| -> anyhow::Result<()> {
            if own == 0 {
                grads.fill(0.0);
            }
            match group.as_mut() {
                Some(ddp) => ddp.finish_exact_sum(&earlier, grads, total_shards),
                None => {
                    local_sum.sum_into_last(&earlier, grads);
                    Ok(())
                }
            }
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
            sync_bn: self.lockstep.is_some(),
            nccl: false,
        }
    }

    fn micro_batches(
        &mut self,
        device: &mut dyn TrainingDevice,
        request: &StepRequest<'_>,
        loss_scale: f32,
    ) -> anyhow::Result<Vec<f32>> {
        match self.lockstep.is_some() {
            true => self.lockstep_shards(device, request, loss_scale),
            false => one_after_another(self, device, request, loss_scale),
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
        self.in_step = true;
        Ok(())
    }

    fn abandon_step(&mut self, device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
        if !self.in_step {
            return Ok(());
        }
        self.in_step = false;
        let (buffers, batches) = &self.buffers_before;
        update_host(device, |model| -> anyhow::Result<()> {
            model.buffers_mut().copy_from_slice(buffers);
            model.set_num_batches_tracked(*batches);
            Ok(())
        })
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

    /// Keeps each shard's gradient but the last one's, which stays in the device while the
    /// exact sum of its buckets starts.
    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        last: bool,
    ) -> anyhow::Result<()> {
        let slot = self
            .shard_statistics
            .len()
            .checked_sub(1)
            .context("a shard's backward without its forward")?;
        if self.on_device {
            device.backward(loss_scale, None, None)?;
            device.keep_shard_grads(slot)?;
            return Ok(());
        }
        if last {
            return self.last_backward(device, loss_scale, slot);
        }
        device.backward(loss_scale, None, None)?;
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
        let loss_sum: f64 = records.chunks(record_len).map(|record| record[0]).sum();
        let loss = Some(loss_sum / total_shards.max(1) as f64);
        if self.lockstep.is_some() {
            self.in_step = false;
            return Ok(loss);
        }
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
        if self.on_device && self.group.is_some() {
            check_the_nccl_sum(device)?;
        }
        self.in_step = false;
        Ok(loss)
    }
}

/// Waits for the step's exact sum through NCCL and fails when the communicator failed or
/// was aborted under it (the job lost a member): a sum cut short holds only some ranks'
/// shards, and the optimizer must not apply it.
fn check_the_nccl_sum(device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
    device.synchronize()?;
    match device.nccl_failure() {
        Some(failure) => bail!("the exact sum of the shards' gradients through NCCL: {failure}"),
        None => Ok(()),
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
    use std::time::Instant;

    use tandem_engine::{OptimizerConfig, SgdConfig};
    use tandem_models::training_device::{StepRequest, TrainBatch, TrainImages};
    use tandem_models::{CpuDevice, LossOptions};
    use tandem_testdata::{assert_bits_equal, assert_close, assert_close_one, Tolerance};

    use super::*;
    use crate::train::ddp::tests::{batch_of, on_ranks, small_model};
    use crate::train::gradient_sync::{run_step, Alone};
    use crate::train::on_device::StepNotes;

    /// Images per shard (those of [`batch_of`]).
    const SHARD: usize = 6;

    /// The small model on the CPU with SGD and momentum.
    fn device() -> CpuDevice {
        let mut device = CpuDevice::new(small_model());
        device.set_optimizer(OptimizerConfig::Sgd(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }));
        device
    }

    /// Steps of 3 shards of [`SHARD`] over `samples` samples: an epoch's last step may
    /// have fewer shards.
    fn plan(samples: usize) -> ShardPlan {
        ShardPlan::new(3 * SHARD, SHARD, samples).unwrap()
    }

    /// What steps leave: the parameters, the BN buffers, the batch count, each step's loss.
    #[derive(Debug)]
    struct Trained {
        params: Vec<f32>,
        buffers: Vec<f32>,
        batches: u64,
        losses: Vec<f64>,
    }

    /// Runs `steps` on `device` through `sync`: each step its micro-batches, each
    /// micro-batch images and labels of 32x32.
    fn train(
        device: &mut CpuDevice,
        sync: &mut dyn GradientSync,
        steps: &[Vec<(Vec<f32>, Vec<u32>)>],
    ) -> anyhow::Result<Trained> {
        let loss = LossOptions::default();
        let mut notes = StepNotes::default();
        let mut losses = Vec::new();
        for (step, batches) in steps.iter().enumerate() {
            let micro_batches: Vec<TrainBatch<'_>> = batches
                .iter()
                .map(|(images, labels)| TrainBatch {
                    images: TrainImages::Host(images),
                    labels,
                })
                .collect();
            let request = StepRequest {
                micro_batches: &micro_batches,
                height: 32,
                width: 32,
                loss: &loss,
                lr: 0.1,
                momentum: None,
            };
            losses.push(run_step(device, sync, &mut notes, request, step as u64)?.mean_loss);
        }
        let model = device.host_model()?;
        Ok(Trained {
            params: model.params().to_vec(),
            buffers: model.buffers().to_vec(),
            batches: model.num_batches_tracked(),
            losses,
        })
    }

    /// `plan`'s steps with SyncBatchNorm as worker `worker` of `group` (one process
    /// without); shard k of the epoch is [`batch_of`]`(k)`.
    fn train_shards(
        group: Option<Ddp>,
        plan: ShardPlan,
        edit: impl Fn(usize, &mut (Vec<f32>, Vec<u32>)),
    ) -> anyhow::Result<Trained> {
        let (world_size, worker) = group
            .as_ref()
            .map_or((1, 0), |ddp| (ddp.world_size(), ddp.rank()));
        let mut device = device();
        let mut sync =
            ShardSync::new(group, plan, &mut device)?.with_sync_bn(Duration::from_secs(60));
        let steps: Vec<Vec<_>> = (0..plan.steps_per_epoch())
            .map(|step| {
                let first = step as usize * plan.shards_per_step();
                plan.worker_shards(step, world_size, worker)
                    .map(|shard| {
                        let mut batch = batch_of(first + shard);
                        edit(first + shard, &mut batch);
                        batch
                    })
                    .collect()
            })
            .collect();
        train(&mut device, &mut sync, &steps)
    }

    /// Shards 0, 1 and 2 as one batch.
    fn whole_batch() -> (Vec<f32>, Vec<u32>) {
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for shard in 0..3 {
            let (more_images, more_labels) = batch_of(shard);
            images.extend(more_images);
            labels.extend(more_labels);
        }
        (images, labels)
    }

    #[test]
    fn without_sync_bn_the_shards_step_as_micro_batches_accumulated_in_one_process() {
        let shards: Vec<_> = (0..3).map(batch_of).collect();
        let mut device_of_shards = device();
        let mut sync = ShardSync::new(None, plan(3 * SHARD), &mut device_of_shards).unwrap();
        let summed = train(
            &mut device_of_shards,
            &mut sync,
            std::slice::from_ref(&shards),
        )
        .unwrap();
        let accumulated = train(&mut device(), &mut Alone, &[shards]).unwrap();
        // Each shard's gradient counts: only the order of the additions differs.
        let tolerance = Tolerance::OfLargest(1e-6);
        assert_close("parameters", &summed.params, &accumulated.params, tolerance);
        assert_bits_equal("BN buffers", &summed.buffers, &accumulated.buffers);
        assert_eq!(summed.batches, accumulated.batches);
        let tolerance = Tolerance::Scaled(1e-6);
        assert_close_one("loss", summed.losses[0], accumulated.losses[0], tolerance);
        assert_ne!(
            summed.params,
            small_model().params(),
            "the step moved the weights"
        );
    }

    #[test]
    fn sync_bn_over_the_shards_is_batch_norm_over_the_whole_global_batch() {
        let shards = train_shards(None, plan(3 * SHARD), |_, _| {}).unwrap();
        let whole = train(&mut device(), &mut Alone, &[vec![whole_batch()]]).unwrap();
        assert_eq!(shards.buffers.len(), whole.buffers.len());
        for (index, (&actual, &expected)) in shards.buffers.iter().zip(&whole.buffers).enumerate() {
            let bound = 1e-6 * expected.abs();
            assert!(
                (actual - expected).abs() <= bound,
                "running statistic {index}: {actual} against {expected} of the whole batch"
            );
        }
        assert_eq!(shards.batches, 1, "one batch of the global batch per step");
        let tolerance = Tolerance::OfLargest(1e-5);
        assert_close("parameters", &shards.params, &whole.params, tolerance);
        let tolerance = Tolerance::Scaled(1e-6);
        assert_close_one("loss", shards.losses[0], whole.losses[0], tolerance);
    }

    #[test]
    fn sync_bn_on_two_workers_has_the_bits_of_one_process_also_with_a_worker_without_shards() {
        // Two steps: 3 shards, then 1 that worker 1 does not hold.
        let plan = plan(4 * SHARD);
        let alone = train_shards(None, plan, |_, _| {}).unwrap();
        let workers = on_ranks(2, |_, ddp| {
            train_shards(Some(ddp), plan, |_, _| {}).unwrap()
        });
        for (worker, trained) in workers.iter().enumerate() {
            let what = format!("worker {worker}'s");
            assert_bits_equal(
                &format!("{what} parameters"),
                &trained.params,
                &alone.params,
            );
            assert_bits_equal(&format!("{what} buffers"), &trained.buffers, &alone.buffers);
            assert_eq!(trained.batches, alone.batches, "{what} batch count");
            let bits =
                |losses: &[f64]| losses.iter().map(|loss| loss.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&trained.losses), bits(&alone.losses), "{what} losses");
        }
    }

    #[test]
    fn an_error_in_one_shard_is_reported_without_waiting_for_the_timeout() {
        let start = Instant::now();
        let error = train_shards(None, plan(3 * SHARD), |shard, batch| {
            if shard == 1 {
                batch.1[0] = 99;
            }
        })
        .unwrap_err();
        let message = format!("{error:#}");
        assert!(message.contains("shard 1 of the step"), "{message}");
        assert!(message.contains("99"), "{message}");
        assert!(start.elapsed() < Duration::from_secs(30), "{message}");
    }
}
