//! SyncBatchNorm over the logical shards of a step (`--global-batch-size` with `--sync-bn`).
//!
//! Every batch norm of a step normalizes with the statistics of the whole global batch, in
//! forward and in backward. Each shard's layer hands its reducer its partial sums over its
//! own M samples (the same bits on any worker); the total is the sum of the S shards'
//! partials added in shard order 0..S-1 in `f64`, which every worker computes the same way
//! after gathering every shard's partial: its own shards' here, the other workers' through
//! an all-gather. So the result is the same bits on 1 to S workers and in one process.
//!
//! A worker's shards must therefore run in lockstep: each runs on a thread of its own, with
//! its own replica of the model and its own pool of `--threads` kernel threads (the bits
//! depend on that count only), while the calling thread gathers each reduction and hands
//! the total back. Every wait is bounded by the collective timeout, and a shard that fails
//! aborts the others. A worker without a shard in a step (an epoch's short last step) runs
//! a stand-in batch whose partials it leaves out, to take part in the same reductions.
//!
//! The running statistics move once per batch norm and step, from the global batch's
//! totals, and the batch count goes up by one per step: what one forward over the whole
//! global batch does (PyTorch's SyncBatchNorm with one batch of G).

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use tandem_models::{BatchNormReducer, LossOptions, Model};

/// The images and labels of one shard.
#[derive(Clone, Copy, Debug)]
pub struct ShardInput<'a> {
    /// NHWC images.
    pub images: &'a [f32],
    /// One label per image.
    pub labels: &'a [u32],
}

/// What one step's shards share: the image size, the loss and the gradients' scale.
#[derive(Clone, Copy, Debug)]
pub struct LockstepStep<'a> {
    /// Rows of an image.
    pub height: usize,
    /// Columns of an image.
    pub width: usize,
    /// The loss's settings.
    pub loss: &'a LossOptions,
    /// The scale of each shard's loss (one over the step's shard count).
    pub loss_scale: f32,
    /// The step's number of this worker's first shard.
    pub first_shard: usize,
}

/// Combines one reduction's partials of `len` values each, this worker's shards' in shard
/// order, into the total over every shard of the step.
pub type Combine<'a> = dyn FnMut(Vec<Vec<f64>>, usize) -> anyhow::Result<Vec<f64>> + 'a;

/// The replicas and kernel pools of a worker's shards, kept from step to step.
pub struct Lockstep {
    replicas: Vec<Model>,
    pools: Vec<rayon::ThreadPool>,
    timeout: Duration,
}

impl Lockstep {
    /// Shards whose waits last at most `timeout` each.
    pub fn new(timeout: Duration) -> Lockstep {
        Lockstep {
            replicas: Vec::new(),
            pools: Vec::new(),
            timeout,
        }
    }

    /// Runs the forward and backward of `shards` in lockstep on replicas of `model`, every
    /// batch norm reduced through `combine`; returns their losses. Leaves the step's running
    /// statistics and batch count in `model`; each shard's gradient is then
    /// [`Lockstep::gradient`]. Without a shard, runs a stand-in batch of `model`'s image
    /// channels and returns no loss.
    pub fn run(
        &mut self,
        model: &mut Model,
        shards: &[ShardInput<'_>],
        step: LockstepStep<'_>,
        combine: &mut Combine<'_>,
    ) -> anyhow::Result<Vec<f32>> {
        let stand_in;
        let inputs = match shards.is_empty() {
            true => {
                stand_in = stand_in_batch(model, step.height, step.width);
                vec![ShardInput {
                    images: &stand_in.0,
                    labels: &stand_in.1,
                }]
            }
            false => shards.to_vec(),
        };
        self.prepare(model, inputs.len())?;
        let exchange = Exchange::new(inputs.len(), self.timeout);
        let own = shards.len();
        let mut only_own = |mut deposits: Vec<Vec<f64>>, len: usize| {
            deposits.truncate(own);
            combine(deposits, len)
        };
        let losses = std::thread::scope(|scope| {
            let threads: Vec<_> = self
                .replicas
                .iter_mut()
                .zip(&self.pools)
                .zip(&inputs)
                .enumerate()
                .map(|(slot, ((replica, pool), input))| {
                    let exchange = &exchange;
                    scope.spawn(move || {
                        let mut leaving = Leaving {
                            exchange,
                            failure: Some("a shard's computation panicked".to_string()),
                        };
                        let result =
                            pool.install(|| run_shard(replica, *input, step, exchange, slot));
                        leaving.failure = result.as_ref().err().map(|error| {
                            format!("shard {} of the step: {error:#}", step.first_shard + slot)
                        });
                        result
                    })
                })
                .collect();
            let coordinated = exchange.coordinate(&mut only_own);
            let losses: Vec<anyhow::Result<f32>> = threads
                .into_iter()
                .map(|thread| {
                    thread
                        .join()
                        .unwrap_or_else(|_| Err(anyhow!("a shard's computation panicked")))
                })
                .collect();
            coordinated.map(|()| losses)
        });
        if let Some(failure) = exchange.failure() {
            return Err(anyhow!(failure));
        }
        let mut own_losses = losses?.into_iter().collect::<anyhow::Result<Vec<f32>>>()?;
        own_losses.truncate(own);
        let first = self.replicas.first().context("no shard ran")?;
        model.buffers_mut().copy_from_slice(first.buffers());
        model.set_num_batches_tracked(first.num_batches_tracked());
        Ok(own_losses)
    }

    /// The gradient of shard `slot` of the last [`Lockstep::run`].
    pub fn gradient(&self, slot: usize) -> Option<&[f32]> {
        self.replicas.get(slot).map(Model::grads)
    }

    /// At least `count` replicas of `model` (parameters, running statistics and batch count)
    /// with zero gradients, and a kernel pool for each.
    fn prepare(&mut self, model: &Model, count: usize) -> anyhow::Result<()> {
        while self.replicas.len() < count {
            self.replicas
                .push(Model::new(model.spec()).context("making a replica of the model")?);
        }
        while self.pools.len() < count {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(tandem_engine::threads())
                .build()
                .context("starting a shard's kernel threads")?;
            self.pools.push(pool);
        }
        for replica in self.replicas.iter_mut().take(count) {
            replica.params_mut().copy_from_slice(model.params());
            replica.buffers_mut().copy_from_slice(model.buffers());
            replica.set_num_batches_tracked(model.num_batches_tracked());
            replica.zero_grads();
        }
        Ok(())
    }
}

/// Two zero images of `height x width` with label 0: a stand-in shard.
fn stand_in_batch(model: &Model, height: usize, width: usize) -> (Vec<f32>, Vec<u32>) {
    let channels = model.spec().img_channels();
    (vec![0.0; 2 * height * width * channels], vec![0; 2])
}

/// The forward and backward of one shard on `replica`, reduced through `exchange` as slot
/// `slot`; returns its loss.
fn run_shard(
    replica: &mut Model,
    input: ShardInput<'_>,
    step: LockstepStep<'_>,
    exchange: &Exchange,
    slot: usize,
) -> anyhow::Result<f32> {
    let mut reducer = ShardReducer { exchange, slot };
    let loss = replica.forward_train(
        input.images,
        input.labels.len(),
        step.height,
        step.width,
        input.labels,
        step.loss,
        Some(&mut reducer),
    )?;
    replica.backward(step.loss_scale, Some(&mut reducer), &mut |_, _| {})?;
    Ok(loss)
}

/// Marks a shard's thread as ended when dropped, with its failure if it has one (a panic
/// leaves the default).
struct Leaving<'a> {
    exchange: &'a Exchange,
    failure: Option<String>,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.exchange.leave(self.failure.take());
    }
}

/// One shard's [`BatchNormReducer`]: deposits its partials and waits for the total.
struct ShardReducer<'a> {
    exchange: &'a Exchange,
    slot: usize,
}

impl BatchNormReducer for ShardReducer<'_> {
    fn all_reduce_sum(
        &mut self,
        values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(self.exchange.reduce(self.slot, values)?)
    }
}

/// Where a worker's shards and its gathering thread meet, reduction after reduction.
struct Exchange {
    state: Mutex<Round>,
    changed: Condvar,
    shards: usize,
    timeout: Duration,
}

/// The state of the current reduction.
struct Round {
    /// Each shard's partials, once deposited.
    deposits: Vec<Option<Vec<f64>>>,
    /// The total of the last finished reduction.
    total: Vec<f64>,
    /// Reductions finished.
    finished: u64,
    /// Shard threads that ended.
    ended: usize,
    /// The first failure; every wait stops on it.
    failure: Option<String>,
}

impl Exchange {
    fn new(shards: usize, timeout: Duration) -> Exchange {
        Exchange {
            state: Mutex::new(Round {
                deposits: vec![None; shards],
                total: Vec::new(),
                finished: 0,
                ended: 0,
                failure: None,
            }),
            changed: Condvar::new(),
            shards,
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the condition variable until `deadline`; `false` once it passed.
    fn wait<'a>(
        &self,
        round: MutexGuard<'a, Round>,
        deadline: Instant,
    ) -> (MutexGuard<'a, Round>, bool) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (round, false);
        }
        let (round, _) = self
            .changed
            .wait_timeout(round, left)
            .unwrap_or_else(PoisonError::into_inner);
        (round, true)
    }

    /// Records `failure` (unless one came first) and wakes every waiter.
    fn fail(&self, round: &mut Round, failure: String) {
        round.failure.get_or_insert(failure);
        self.changed.notify_all();
    }

    /// The first failure, if any.
    fn failure(&self) -> Option<String> {
        self.lock().failure.clone()
    }

    /// A shard thread ended, with its failure if it failed.
    fn leave(&self, failure: Option<String>) {
        let mut round = self.lock();
        round.ended += 1;
        match failure {
            Some(failure) => self.fail(&mut round, failure),
            None => self.changed.notify_all(),
        }
    }

    /// Deposits shard `slot`'s `values` and replaces them by the total over every shard.
    fn reduce(&self, slot: usize, values: &mut [f64]) -> Result<(), String> {
        let mut round = self.lock();
        if let Some(failure) = &round.failure {
            return Err(format!("stopped, as another shard failed: {failure}"));
        }
        round.deposits[slot] = Some(values.to_vec());
        self.changed.notify_all();
        let (seen, deadline) = (round.finished, Instant::now() + self.timeout);
        while round.finished == seen && round.failure.is_none() {
            let (next, in_time) = self.wait(round, deadline);
            round = next;
            if !in_time {
                let failure = format!(
                    "a shard waited more than {:?} for the step's batch statistics",
                    self.timeout
                );
                self.fail(&mut round, failure);
            }
        }
        if let Some(failure) = &round.failure {
            return Err(format!("stopped, as another shard failed: {failure}"));
        }
        if round.total.len() != values.len() {
            return Err(format!(
                "a reduction of {} values got a total of {}",
                values.len(),
                round.total.len()
            ));
        }
        values.copy_from_slice(&round.total);
        Ok(())
    }

    /// The gathering side: whenever every shard deposited, hands the deposits to `combine`
    /// and publishes the total, until every shard thread ended.
    fn coordinate(&self, combine: &mut Combine<'_>) -> anyhow::Result<()> {
        loop {
            let deposits = match self.next_deposits() {
                Ok(Some(deposits)) => deposits,
                Ok(None) => return Ok(()),
                Err(failure) => return Err(anyhow!(failure)),
            };
            let len = deposits.first().map_or(0, Vec::len);
            let total = combine(deposits, len);
            let mut round = self.lock();
            match total {
                Ok(total) => {
                    round.total = total;
                    round.finished += 1;
                    self.changed.notify_all();
                }
                Err(error) => {
                    let failure = format!("gathering the batch statistics: {error:#}");
                    self.fail(&mut round, failure.clone());
                    return Err(anyhow!(failure));
                }
            }
        }
    }

    /// Waits until every running shard deposited (their deposits, in slot order) or every
    /// shard thread ended (`None`).
    fn next_deposits(&self) -> Result<Option<Vec<Vec<f64>>>, String> {
        let mut round = self.lock();
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(failure) = &round.failure {
                return Err(failure.clone());
            }
            let filled = round.deposits.iter().filter(|slot| slot.is_some()).count();
            if filled == self.shards {
                let deposits = round.deposits.iter_mut().filter_map(Option::take);
                return Ok(Some(deposits.collect()));
            }
            if round.ended == self.shards {
                return Ok(None);
            }
            if filled > 0 && filled + round.ended == self.shards {
                let failure = "the shards made different numbers of batch-norm reductions";
                self.fail(&mut round, failure.to_string());
                return Err(failure.to_string());
            }
            let (next, in_time) = self.wait(round, deadline);
            round = next;
            if !in_time {
                let failure = format!(
                    "waited more than {:?} for the shards' batch statistics",
                    self.timeout
                );
                self.fail(&mut round, failure.clone());
                return Err(failure);
            }
        }
    }
}

/// The total of one reduction over every shard of the step, from `gathered`: every
/// worker's records of `len` values, `slots` per worker of which worker `w` filled
/// `counts[w]`, in worker order. Added in shard order, starting from zero.
pub fn shard_ordered_total(
    gathered: &[f64],
    counts: &[usize],
    slots: usize,
    len: usize,
) -> anyhow::Result<Vec<f64>> {
    if gathered.len() != counts.len() * slots * len || counts.iter().any(|&count| count > slots) {
        anyhow::bail!(
            "gathered {} batch statistics, expected {} workers' {slots} records of {len}",
            gathered.len(),
            counts.len()
        );
    }
    let mut total = vec![0.0f64; len];
    for (worker, &count) in counts.iter().enumerate() {
        for slot in 0..count {
            let start = (worker * slots + slot) * len;
            for (sum, value) in total.iter_mut().zip(&gathered[start..start + len]) {
                *sum += value;
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_whose_sibling_never_arrives_stops_after_the_timeout() {
        let exchange = Exchange::new(2, Duration::from_millis(200));
        let start = Instant::now();
        let (shard, coordinator) = std::thread::scope(|scope| {
            let shard = scope.spawn(|| exchange.reduce(0, &mut [1.0, 2.0]));
            let coordinator = exchange.coordinate(&mut |_, _| Ok(vec![0.0; 2]));
            (shard.join().unwrap(), coordinator)
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        let error = coordinator.unwrap_err().to_string();
        assert!(error.contains("waited more than"), "{error}");
        assert!(shard.unwrap_err().contains("waited more than"));
    }

    #[test]
    fn the_total_adds_every_workers_records_in_shard_order_and_skips_the_padding() {
        // 3 shards on 2 workers: 2 and 1, each padded to 2 records of 2 values.
        let gathered = [1.0, 10.0, 2.0, 20.0, 4.0, 40.0, 99.0, 99.0];
        let total = shard_ordered_total(&gathered, &[2, 1], 2, 2).unwrap();
        assert_eq!(total, [7.0, 70.0]);
        assert!(shard_ordered_total(&gathered[1..], &[2, 1], 2, 2).is_err());
    }
}
