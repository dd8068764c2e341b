//! How a step's gradients meet the other ranks': a strategy chosen once, when the job is
//! joined, and one training step that calls its hooks.
//!
//! | strategy | before a step | forward and backward | after the last backward |
//! | --- | --- | --- | --- |
//! | [`Alone`] | nothing | nothing | nothing |
//! | [`HostRing`] | rank 0's BN buffers through the ring | each final bucket to the comm thread | the buckets averaged |
//! | [`HostRing`] with SyncBN | the same | batch statistics summed through the ring | the buckets averaged |
//! | [`Nccl`] (SyncBN, if any, inside the device) | rank 0's BN buffers by NCCL | each final bucket all-reduced on the device | the rest of the buckets |
//!
//! A step runs as one [`TrainingDevice::train_step`] where the device can run it whole under
//! the strategy's [`StepConditions`] (alone, or through NCCL), else as separate calls into
//! which the hooks reach.

use tandem_models::training_device::{
    update_host, with_host_grads, StepConditions, StepRequest, StepRun, TrainBatch,
};
use tandem_models::{BatchNormReducer, TrainingDevice};

use super::ddp::Ddp;
use super::on_device::StepNotes;

/// How the gradients of a step are averaged over the job's ranks, and what a step must do
/// around its forward and backward passes for it.
pub trait GradientSync: Send {
    /// The job's process group; `None` for a process alone.
    fn group(&self) -> Option<&Ddp>;

    /// The job's process group, to talk to the other ranks; `None` for a process alone.
    fn group_mut(&mut self) -> Option<&mut Ddp>;

    /// What the device needs to know to decide whether a step runs whole.
    fn conditions(&self) -> StepConditions;

    /// Why the strategy's steps never run whole, when it knows better than the device's
    /// reading of [`GradientSync::conditions`].
    fn why_not_whole(&self) -> Option<&'static str> {
        None
    }

    /// Gives every rank rank 0's model: parameters, BN buffers and batch count (through the
    /// host ring).
    fn agree_on_the_model(&mut self, device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
        match self.group_mut() {
            Some(ddp) => update_host(device, |model| ddp.broadcast_model(model)),
            None => Ok(()),
        }
    }

    /// Before step `step` of its epoch: gives every rank rank 0's BN running statistics
    /// (through the host ring).
    fn before_step(&mut self, device: &mut dyn TrainingDevice, _step: u64) -> anyhow::Result<()> {
        match self.group_mut() {
            Some(ddp) => update_host(device, |model| ddp.broadcast_buffers(model)),
            None => Ok(()),
        }
    }

    /// The scale of each micro-batch's loss when this rank computes `count` of them.
    fn loss_scale(&self, count: usize) -> f32 {
        1.0 / count.max(1) as f32
    }

    /// The train-mode forward of one micro-batch; returns its mean loss.
    fn forward(
        &mut self,
        device: &mut dyn TrainingDevice,
        batch: TrainBatch<'_>,
        request: &StepRequest<'_>,
    ) -> anyhow::Result<f32> {
        Ok(device.forward_train(batch, request.height, request.width, request.loss, None)?)
    }

    /// The forward and backward of each of the step's micro-batches at `loss_scale`, one
    /// after the other; returns their losses.
    fn micro_batches(
        &mut self,
        device: &mut dyn TrainingDevice,
        request: &StepRequest<'_>,
        loss_scale: f32,
    ) -> anyhow::Result<Vec<f32>> {
        one_after_another(self, device, request, loss_scale)
    }

    /// The backward of one micro-batch at `loss_scale`; the step's `last` one hands each
    /// range of gradients to the group as soon as it is final.
    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        last: bool,
    ) -> anyhow::Result<()>;

    /// After a failure within a step: undoes what the step changed before its update (the
    /// running statistics its forwards moved), so that the step can be done again.
    fn abandon_step(&mut self, _device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
        Ok(())
    }

    /// After the last backward, given this rank's micro-batch `losses`: the gradients
    /// averaged over the ranks. Returns the job's mean loss where the strategy agrees on it
    /// itself, else `None` (each rank's mean is then averaged).
    fn finish(
        &mut self,
        device: &mut dyn TrainingDevice,
        losses: &[f32],
    ) -> anyhow::Result<Option<f64>>;
}

/// The forward and backward of each of the step's micro-batches at `loss_scale` through
/// `sync`'s hooks, one after the other, the last one's backward marked as such; returns
/// their losses.
pub fn one_after_another<S: GradientSync + ?Sized>(
    sync: &mut S,
    device: &mut dyn TrainingDevice,
    request: &StepRequest<'_>,
    loss_scale: f32,
) -> anyhow::Result<Vec<f32>> {
    let batches = request.micro_batches;
    let mut losses = Vec::with_capacity(batches.len());
    for (index, &batch) in batches.iter().enumerate() {
        losses.push(sync.forward(device, batch, request)?);
        sync.backward(device, loss_scale, index + 1 == batches.len())?;
    }
    Ok(losses)
}

/// The strategy of a job: [`Alone`] without a group, else [`Nccl`] when the device joined
/// an NCCL group, else the [`HostRing`], summing batch statistics when `sync_bn`.
pub fn choose(
    group: Option<Ddp>,
    device: &dyn TrainingDevice,
    sync_bn: bool,
) -> Box<dyn GradientSync> {
    match group {
        None => Box::new(Alone),
        Some(ddp) if device.uses_nccl() => Box::new(Nccl { ddp, sync_bn }),
        Some(ddp) => Box::new(HostRing { ddp, sync_bn }),
    }
}

/// This rank's part of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalStep {
    /// This rank's mean loss over its micro-batches, or the job's when `agreed`.
    pub mean_loss: f64,
    /// Whether `mean_loss` is already the job's, the same bits on every rank.
    pub agreed: bool,
    /// How a GPU ran a whole step; `None` for separate calls and on the CPU.
    pub run: Option<StepRun>,
}

/// Step `step` of its epoch, of `request` on `device`, its gradients averaged through
/// `sync`: as one [`TrainingDevice::train_step`] where the device runs the step whole (then
/// `notes` prints what it says of CUDA graphs), else as separate calls with the strategy's
/// hooks.
pub fn run_step(
    device: &mut dyn TrainingDevice,
    sync: &mut dyn GradientSync,
    notes: &mut StepNotes,
    request: StepRequest<'_>,
    step: u64,
) -> anyhow::Result<LocalStep> {
    sync.before_step(device, step)?;
    let batches = request.micro_batches;
    // An epoch's last step may end with a shorter micro-batch: that step alone runs through
    // the separate calls (with the same result).
    let one_size = batches
        .windows(2)
        .all(|pair| pair[0].len() == pair[1].len());
    let why_not = sync.why_not_whole();
    if one_size && !batches.is_empty() && notes.whole_steps(device, &sync.conditions(), why_not) {
        let report = device.train_step(request)?;
        let batch = batches.first().map_or(0, TrainBatch::len);
        notes.after_step(&report, batches.len(), batch, request.height, request.width);
        return Ok(LocalStep {
            mean_loss: report.mean_loss(),
            agreed: false,
            run: report.run,
        });
    }
    device.zero_grads()?;
    let loss_scale = sync.loss_scale(batches.len());
    let losses = sync.micro_batches(device, &request, loss_scale)?;
    let agreed = sync.finish(device, &losses)?;
    device.optimizer_step(request.lr, request.momentum)?;
    let local_mean = || {
        let sum: f64 = losses.iter().map(|&loss| f64::from(loss)).sum();
        sum / losses.len().max(1) as f64
    };
    Ok(LocalStep {
        mean_loss: agreed.unwrap_or_else(local_mean),
        agreed: agreed.is_some(),
        run: None,
    })
}

/// One process: its gradients are the step's.
pub struct Alone;

impl GradientSync for Alone {
    fn group(&self) -> Option<&Ddp> {
        None
    }

    fn group_mut(&mut self) -> Option<&mut Ddp> {
        None
    }

    fn conditions(&self) -> StepConditions {
        StepConditions {
            data_parallel: false,
            sync_bn: false,
            nccl: false,
        }
    }

    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        _last: bool,
    ) -> anyhow::Result<()> {
        Ok(device.backward(loss_scale, None, None)?)
    }

    fn finish(
        &mut self,
        _device: &mut dyn TrainingDevice,
        _losses: &[f32],
    ) -> anyhow::Result<Option<f64>> {
        Ok(None)
    }
}

/// The host ring: gradients cross the host in buckets, handed to the comm thread as the
/// last backward finishes them. With `sync_bn` every forward and backward sums its batch
/// statistics over the ranks instead, and the buckets are averaged after it.
pub struct HostRing {
    /// The job's process group.
    pub ddp: Ddp,
    /// Whether batch statistics are summed over the ranks (SyncBatchNorm).
    pub sync_bn: bool,
}

impl GradientSync for HostRing {
    fn group(&self) -> Option<&Ddp> {
        Some(&self.ddp)
    }

    fn group_mut(&mut self) -> Option<&mut Ddp> {
        Some(&mut self.ddp)
    }

    fn conditions(&self) -> StepConditions {
        StepConditions {
            data_parallel: true,
            sync_bn: self.sync_bn,
            nccl: false,
        }
    }

    fn forward(
        &mut self,
        device: &mut dyn TrainingDevice,
        batch: TrainBatch<'_>,
        request: &StepRequest<'_>,
    ) -> anyhow::Result<f32> {
        let mut reducer = self.sync_bn.then(|| self.ddp.batch_norm_reducer());
        let loss = device.forward_train(
            batch,
            request.height,
            request.width,
            request.loss,
            reducer
                .as_mut()
                .map(|reducer| reducer as &mut dyn BatchNormReducer),
        )?;
        Ok(loss)
    }

    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        last: bool,
    ) -> anyhow::Result<()> {
        if self.sync_bn {
            let mut reducer = self.ddp.batch_norm_reducer();
            return Ok(device.backward(loss_scale, Some(&mut reducer), None)?);
        }
        match last {
            true => device.backward(
                loss_scale,
                None,
                Some(&mut |range, values| self.ddp.gradients_ready(range, values)),
            )?,
            false => device.backward(loss_scale, None, None)?,
        }
        Ok(())
    }

    fn finish(
        &mut self,
        device: &mut dyn TrainingDevice,
        _losses: &[f32],
    ) -> anyhow::Result<Option<f64>> {
        with_host_grads(device, |grads| self.ddp.finish_gradients(grads))?;
        Ok(None)
    }
}

/// NCCL on the devices: gradient buckets are all-reduced on the GPU as the last backward
/// finishes them, and broadcasts stay there; with SyncBatchNorm the device sums the batch
/// statistics itself. Steps of one micro-batch size run whole (as CUDA graphs).
pub struct Nccl {
    /// The job's process group (the NCCL unique id, the metrics, the snapshot on resume).
    pub ddp: Ddp,
    /// Whether the device sums batch statistics through NCCL.
    pub sync_bn: bool,
}

impl GradientSync for Nccl {
    fn group(&self) -> Option<&Ddp> {
        Some(&self.ddp)
    }

    fn group_mut(&mut self) -> Option<&mut Ddp> {
        Some(&mut self.ddp)
    }

    fn conditions(&self) -> StepConditions {
        StepConditions {
            data_parallel: true,
            sync_bn: self.sync_bn,
            nccl: true,
        }
    }

    fn agree_on_the_model(&mut self, device: &mut dyn TrainingDevice) -> anyhow::Result<()> {
        device.broadcast_on_device(true)?;
        update_host(device, |model| self.ddp.agree_on_batches_tracked(model))
    }

    fn before_step(&mut self, device: &mut dyn TrainingDevice, _step: u64) -> anyhow::Result<()> {
        Ok(device.broadcast_on_device(false)?)
    }

    fn backward(
        &mut self,
        device: &mut dyn TrainingDevice,
        loss_scale: f32,
        last: bool,
    ) -> anyhow::Result<()> {
        match last {
            true => device.backward_all_reduced(loss_scale, None)?,
            false => device.backward(loss_scale, None, None)?,
        }
        Ok(())
    }

    fn finish(
        &mut self,
        device: &mut dyn TrainingDevice,
        _losses: &[f32],
    ) -> anyhow::Result<Option<f64>> {
        device.finish_all_reduce()?;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use tandem_engine::{OptimizerConfig, SgdConfig};
    use tandem_models::training_device::TrainImages;
    use tandem_models::{CpuDevice, LossOptions};
    use tandem_testdata::{assert_bits_equal, assert_close, assert_close_one, Tolerance};

    use super::*;
    use crate::train::ddp::tests::{batch_of, on_ranks, small_model};

    /// Agreement between a data-parallel step and one process: float rounding over 2 steps.
    const PARALLEL: Tolerance<f32> = Tolerance::OfLargest(1e-5);
    const STEPS: usize = 2;

    /// SGD with momentum.
    fn sgd() -> OptimizerConfig {
        OptimizerConfig::Sgd(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        })
    }

    /// The small model on the CPU with [`sgd`].
    fn cpu_device() -> CpuDevice {
        let mut device = CpuDevice::new(small_model());
        device.set_optimizer(sgd());
        device
    }

    /// What a few steps leave: the parameters, the BN buffers, each step's local mean loss.
    struct Trained {
        params: Vec<f32>,
        buffers: Vec<f32>,
        losses: Vec<f64>,
    }

    /// [`STEPS`] steps of `batches` (images and labels of 32x32 micro-batches) on a fresh
    /// [`cpu_device`] through `sync`.
    fn train(sync: &mut dyn GradientSync, batches: &[(Vec<f32>, Vec<u32>)]) -> Trained {
        let mut device = cpu_device();
        let micro_batches: Vec<TrainBatch<'_>> = batches
            .iter()
            .map(|(images, labels)| TrainBatch {
                images: TrainImages::Host(images),
                labels,
            })
            .collect();
        let loss = LossOptions::default();
        let mut notes = StepNotes::default();
        let losses = (0..STEPS)
            .map(|_| {
                let request = StepRequest {
                    micro_batches: &micro_batches,
                    height: 32,
                    width: 32,
                    loss: &loss,
                    lr: 0.1,
                    momentum: None,
                };
                run_step(&mut device, sync, &mut notes, request, 0)
                    .unwrap()
                    .mean_loss
            })
            .collect();
        let model = device.host_model().unwrap();
        Trained {
            params: model.params().to_vec(),
            buffers: model.buffers().to_vec(),
            losses,
        }
    }

    /// Rank 0's batch and rank 1's, as one batch of 12.
    fn joined_batch() -> (Vec<f32>, Vec<u32>) {
        let ((mut images, mut labels), (more_images, more_labels)) = (batch_of(0), batch_of(1));
        images.extend(more_images);
        labels.extend(more_labels);
        (images, labels)
    }

    #[test]
    fn alone_a_step_is_each_micro_batch_at_its_share_of_the_loss_then_the_update() {
        let mut sync = choose(None, &cpu_device(), true);
        assert_eq!(sync.conditions(), Alone.conditions());
        let trained = train(&mut *sync, &[batch_of(0), batch_of(1)]);

        let mut model = small_model();
        let mut optimizer = sgd().cpu(model.params().len());
        for step in 0..STEPS {
            model.zero_grads();
            let mut loss_sum = 0.0f64;
            for (images, labels) in [batch_of(0), batch_of(1)] {
                let loss =
                    model.forward_train(&images, 6, 32, 32, &labels, &LossOptions::default(), None);
                loss_sum += f64::from(loss.unwrap());
                model.backward(0.5, None, &mut |_, _| {}).unwrap();
            }
            let (params, grads) = model.params_and_grads_mut();
            optimizer.step(params, grads);
            assert_eq!(trained.losses[step].to_bits(), (loss_sum / 2.0).to_bits());
        }
        assert_bits_equal("parameters", &trained.params, model.params());
        assert_bits_equal("buffers", &trained.buffers, model.buffers());
    }

    #[test]
    fn the_host_ring_averages_each_ranks_gradients_as_accumulation_does_in_one_process() {
        let ranks = on_ranks(2, |rank, ddp| {
            let mut sync = choose(Some(ddp), &cpu_device(), false);
            assert_eq!(
                sync.conditions(),
                StepConditions {
                    data_parallel: true,
                    sync_bn: false,
                    nccl: false
                }
            );
            train(&mut *sync, &[batch_of(rank)])
        });
        let expected = train(&mut Alone, &[batch_of(0), batch_of(1)]);
        assert_bits_equal("rank 1's parameters", &ranks[1].params, &ranks[0].params);
        assert_close("parameters", &ranks[0].params, &expected.params, PARALLEL);
        let own = train(&mut Alone, &[batch_of(1)]);
        assert_eq!(
            ranks[1].losses[0], own.losses[0],
            "rank 1's loss is its own batch's"
        );
    }

    #[test]
    fn the_host_ring_with_sync_bn_equals_one_process_with_the_whole_batch() {
        let ranks = on_ranks(2, |rank, ddp| {
            let mut sync = choose(Some(ddp), &cpu_device(), true);
            assert!(sync.conditions().sync_bn);
            train(&mut *sync, &[batch_of(rank)])
        });
        let expected = train(&mut Alone, &[joined_batch()]);
        for (rank, trained) in ranks.iter().enumerate() {
            let what = format!("rank {rank}'s parameters");
            assert_close(&what, &trained.params, &expected.params, PARALLEL);
            let what = format!("rank {rank}'s buffers");
            assert_close(&what, &trained.buffers, &expected.buffers, PARALLEL);
        }
        assert_bits_equal("rank 1's parameters", &ranks[1].params, &ranks[0].params);
        for step in 0..STEPS {
            let mean = (ranks[0].losses[step] + ranks[1].losses[step]) / 2.0;
            let what = format!("step {step}'s loss over the ranks");
            assert_close_one(&what, mean, expected.losses[step], Tolerance::Scaled(1e-5));
        }
    }
}
