//! Data parallelism: the glue between one process's training step and its peers.
//!
//! Every rank runs the same steps on its own shard of the data. After the backward pass the
//! gradients are averaged over the ranks, bucket by bucket, on a comm thread, while the
//! backward pass goes on with the earlier layers: the model lays its gradients out in the
//! order backward finishes them, so each bucket is a contiguous slice that is complete as
//! soon as backward has passed its last layer. All collectives of a rank go through one
//! FIFO queue, so ranks that issue the same sequence of operations stay in step.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use anyhow::Context;
use tandem_dist::heartbeat::{
    Heartbeat, Interrupt, MembershipWatch, StoreCutHook, WorkerStatus, HEARTBEAT_INTERVAL,
};
use tandem_dist::{
    CommThread, Pending, ProcessGroup, ProcessGroupOptions, ReduceOp, SharedBuffer, StoreClient,
};
use tandem_models::{BatchNormReducer, Model};

use super::exact_buckets::ExactBuckets;

/// How a worker joins its job, as its environment or flags describe it.
#[derive(Clone, Debug)]
pub struct WorkerPlacement {
    /// This process's rank.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// The number of processes on this node.
    pub local_world_size: usize,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Whether the launcher hosts the store (else rank 0 does).
    pub store_hosted: bool,
    /// Namespace of this attempt's keys in the store (one per restart round, and one per
    /// membership within a round with `--keep-survivors`).
    pub key_prefix: String,
    /// The namespace of the round, which a membership change keeps.
    pub round_prefix: String,
    /// This worker's lasting id: its rank at the round's start, which a membership change
    /// keeps; its heartbeat and status go by it.
    pub worker_id: usize,
    /// The membership epoch of the group it joins (0 until the first change).
    pub membership_epoch: u64,
    /// The replicas of a replicated store, through which the worker reaches the store in
    /// place of `master_addr:master_port`; empty for a store of one server.
    pub store_replicas: Vec<SocketAddr>,
}

impl WorkerPlacement {
    /// Where the store is, in words: its address, or its replicas' addresses.
    pub fn store_text(&self) -> String {
        match self.store_replicas.as_slice() {
            [] => format!("{}:{}", self.master_addr, self.master_port),
            replicas => {
                let addrs: Vec<String> = replicas.iter().map(SocketAddr::to_string).collect();
                format!("the replicas {}", addrs.join(","))
            }
        }
    }

    /// A connection of its own to the job's store, within `timeout`: to whichever replica
    /// leads, following the leader, for a replicated store.
    pub fn connect_store(
        &self,
        token: &tandem_dist::JobToken,
        timeout: Duration,
    ) -> anyhow::Result<StoreClient> {
        if !self.store_replicas.is_empty() {
            return StoreClient::connect_replicated(&self.store_replicas, token, timeout)
                .with_context(|| format!("reach the job's store at {}", self.store_text()));
        }
        let addr = format!("{}:{}", self.master_addr, self.master_port);
        let resolved = std::net::ToSocketAddrs::to_socket_addrs(&addr)
            .with_context(|| format!("the job's store at {addr}"))?
            .next()
            .with_context(|| format!("the job's store at {addr} has no address"))?;
        StoreClient::connect(resolved, token, timeout)
            .with_context(|| format!("reach the job's store at {addr}"))
    }
}

/// Gradient buckets: the first small, so communication starts early, then equal ones.
pub fn plan_buckets(
    len: usize,
    first_bucket_floats: usize,
    bucket_floats: usize,
) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let mut start = 0;
    let mut size = first_bucket_floats.max(1);
    while start < len {
        let end = (start + size).min(len);
        buckets.push(start..end);
        start = end;
        size = bucket_floats.max(1);
    }
    buckets
}

/// One process's link to its peers during training.
pub struct Ddp {
    comm: CommThread,
    buckets: Vec<Range<usize>>,
    /// Per bucket: the gradients copied out of the model, or `None` while on the comm thread.
    /// In shared memory when the ranks share a host, so the all-reduce copies no data through
    /// sockets.
    staging: Vec<Option<SharedBuffer<f32>>>,
    in_flight: Vec<(usize, Pending<SharedBuffer<f32>>)>,
    next_bucket: usize,
    /// The buckets of the exact sum of `--global-batch-size`, once made.
    exact: Option<ExactBuckets>,
    /// This rank's heartbeat and status in the job's store.
    heartbeat: Heartbeat,
}

impl Ddp {
    /// Joins the process group and sets up buckets over `grad_len` gradients.
    pub fn join(
        placement: &WorkerPlacement,
        token: tandem_dist::JobToken,
        timeout: Duration,
        grad_len: usize,
        bucket_bytes: usize,
        first_bucket_bytes: usize,
    ) -> anyhow::Result<Self> {
        let buckets = (bucket_bytes, first_bucket_bytes);
        Self::join_within(placement, token, (timeout, timeout), grad_len, buckets)
    }

    /// [`Ddp::join`], with the group formed within the first of `timeouts` and each later
    /// collective bounded by the second; `buckets` are the bucket and first-bucket bytes.
    pub fn join_within(
        placement: &WorkerPlacement,
        token: tandem_dist::JobToken,
        timeouts: (Duration, Duration),
        grad_len: usize,
        (bucket_bytes, first_bucket_bytes): (usize, usize),
    ) -> anyhow::Result<Self> {
        let (timeout, collective_timeout) = timeouts;
        let mut options = ProcessGroupOptions::new(
            placement.rank,
            placement.world_size,
            &placement.master_addr,
            placement.master_port,
            token.clone(),
        );
        options.timeout = timeout;
        options.host_store = !placement.store_hosted;
        options.prefix = placement.key_prefix.clone();
        options.membership_epoch = placement.membership_epoch;
        options.store_replicas = placement.store_replicas.clone();
        let group = ProcessGroup::connect(options).with_context(|| {
            format!(
                "rank {} cannot join the job at {}",
                placement.rank,
                placement.store_text()
            )
        })?;
        let heartbeat = group
            .store()
            .connect_again(&token, timeout)
            .map(|client| {
                Heartbeat::start(
                    client,
                    &placement.round_prefix,
                    placement.worker_id,
                    HEARTBEAT_INTERVAL,
                )
            })
            .context("the heartbeat's connection to the job's store")?;
        let breaker = group.ring_breaker()?;
        let mut group = group;
        group.set_timeout(collective_timeout);
        let comm = CommThread::spawn(group)?;
        let float_bytes = std::mem::size_of::<f32>();
        let buckets = plan_buckets(
            grad_len,
            first_bucket_bytes / float_bytes,
            bucket_bytes / float_bytes,
        );
        let staging = buckets
            .iter()
            .map(|bucket| comm.shared_buffer(bucket.len()).map(Some))
            .collect::<Result<_, _>>()?;
        let ddp = Ddp {
            comm,
            buckets,
            staging,
            in_flight: Vec::new(),
            next_bucket: 0,
            exact: None,
            heartbeat,
        };
        let rank = placement.rank;
        ddp.on_membership_loss(Box::new(move |why| {
            tell!("rank {rank}: breaking the process group's ring, {why}");
            breaker.break_ring(why);
        }));
        Ok(ddp)
    }

    /// Publishes this rank's progress for `tandem status` (through the heartbeat thread).
    pub fn publish_status(&self, epoch: u64, step: u64, images_per_second: f64) {
        self.heartbeat.publish(&WorkerStatus {
            rank: self.rank(),
            pid: std::process::id(),
            host: super::run_lock::host_name(),
            epoch,
            step,
            images_per_second,
        });
    }

    /// Breaks this group's collectives when the job's membership moves on without one of
    /// the members of `watch` (`--keep-survivors`): a peer that cannot answer (its link is
    /// down, it hangs) then costs no collective timeout.
    pub fn watch_membership(&self, watch: MembershipWatch) {
        self.heartbeat.watch_membership(watch);
    }

    /// Adds what to do when this worker's node is cut off from the job's replicated store,
    /// and when it is back (see [`Heartbeat::on_store_cut`]).
    pub fn on_store_cut(&self, hook: StoreCutHook) {
        self.heartbeat.on_store_cut(hook);
    }

    /// Adds what else to break (a device's communicator) when the watched membership moves
    /// on without one of this group's members; the ring breaks by itself.
    pub fn on_membership_loss(&self, interrupt: Interrupt) {
        self.heartbeat.add_interrupt(interrupt);
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// What carries the gradient buckets: "shared memory" between the ranks of one host, else
    /// "the ring".
    pub fn gradient_transport(&self) -> &'static str {
        let shared = self.staging.iter().flatten().all(SharedBuffer::is_shared);
        match shared && self.world_size() > 1 {
            true => "shared memory",
            false => "the ring",
        }
    }

    /// Makes every rank start from rank 0's parameters, BN buffers and batch count.
    pub fn broadcast_model(&mut self, model: &mut Model) -> anyhow::Result<()> {
        let params = self.comm.broadcast_f32(model.params().to_vec(), 0).wait()?;
        model.params_mut().copy_from_slice(&params);
        self.broadcast_buffers(model)?;
        self.agree_on_batches_tracked(model)
    }

    /// Gives every rank the largest `num_batches_tracked` of the ranks (the part of
    /// [`Ddp::broadcast_model`] that stays on the host when NCCL broadcasts the buffers).
    pub fn agree_on_batches_tracked(&mut self, model: &mut Model) -> anyhow::Result<()> {
        let count = self
            .comm
            .all_reduce_i64(vec![model.num_batches_tracked() as i64], ReduceOp::Max)
            .wait()?;
        model.set_num_batches_tracked(count.first().copied().unwrap_or(0).max(0) as u64);
        Ok(())
    }

    /// Gives every rank rank 0's BN running statistics (PyTorch's `broadcast_buffers`).
    pub fn broadcast_buffers(&mut self, model: &mut Model) -> anyhow::Result<()> {
        if model.buffers().is_empty() {
            return Ok(());
        }
        let buffers = self
            .comm
            .broadcast_f32(model.buffers().to_vec(), 0)
            .wait()?;
        model.buffers_mut().copy_from_slice(&buffers);
        Ok(())
    }

    /// The gradient buckets, in the order backward finishes them (for the NCCL group, which
    /// all-reduces the same ranges on the device).
    pub fn buckets(&self) -> Vec<Range<usize>> {
        self.buckets.clone()
    }

    /// Rank 0's NCCL unique id, made by rank 0 (only after the probe found libnccl) and
    /// carried to the others through the job's store under this round's prefix, waiting at
    /// most `timeout` for it.
    pub fn nccl_unique_id(
        &self,
        timeout: Duration,
    ) -> anyhow::Result<[u8; tandem_cuda::nccl::UNIQUE_ID_BYTES]> {
        let rank = self.rank();
        let made = match rank {
            0 => Some(
                tandem_cuda::nccl::create_unique_id(tandem_cuda::Probe::process())
                    .context("rank 0 cannot make the NCCL unique id")?,
            ),
            _ => None,
        };
        let id = self.comm.run(move |group| match made {
            Some(id) => {
                tandem_dist::publish_nccl_unique_id(group.store(), group.prefix(), &id)?;
                Ok(id)
            }
            None => tandem_dist::receive_nccl_unique_id(group.store(), group.prefix(), timeout),
        })?;
        Ok(id)
    }

    /// After an NCCL collective timed out: which peer stopped answering, as the ring's own
    /// failure report names it (a barrier that the stalled rank does not join times out
    /// within the collective timeout, and the ranks waiting on it blame it through the
    /// store). `None` when the barrier passes or names no one.
    pub fn name_stalled_peer(&self) -> Option<String> {
        match self.comm.run(|group| group.barrier()) {
            Ok(()) => None,
            Err(error) => Some(error.to_string()),
        }
    }

    /// Gives every rank rank 0's bytes (a snapshot on resume).
    pub fn broadcast_bytes(&mut self, bytes: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        self.broadcast_bytes_from(bytes, 0)
    }

    /// Gives every rank `root`'s bytes.
    pub fn broadcast_bytes_from(&mut self, bytes: Vec<u8>, root: usize) -> anyhow::Result<Vec<u8>> {
        Ok(self.comm.broadcast_bytes(bytes, root).wait()?)
    }

    /// Publishes `record` as this rank's under `name` in the job's store and returns every
    /// rank's, in rank order, within the collective timeout.
    pub fn gather_records(&self, name: &str, record: Vec<u8>) -> anyhow::Result<Vec<Vec<u8>>> {
        let name = name.to_string();
        Ok(self
            .comm
            .run(move |group| group.gather_records(&name, &record))?)
    }

    /// Sums `values` over the ranks.
    pub fn sum_f64(&mut self, values: &mut [f64]) -> anyhow::Result<()> {
        Ok(sum_over_ranks(&self.comm, values)?)
    }

    /// Called by the last backward of a `--global-batch-size` step with each range of
    /// gradients that is final: starts the exact sum's work on the buckets now complete
    /// ([`ExactBuckets::gradients_ready`]). The first call makes the sum's shared buffers (a
    /// collective).
    pub fn exact_gradients_ready(
        &mut self,
        earlier: &[&[f32]],
        range: Range<usize>,
        values: &[f32],
    ) -> anyhow::Result<()> {
        let comm = &self.comm;
        let exact = match &mut self.exact {
            Some(exact) => exact,
            none => none.insert(ExactBuckets::new(comm, &self.buckets)?),
        };
        exact.gradients_ready(comm, earlier, range, values);
        Ok(())
    }

    /// The exact sum over every rank of this rank's `earlier` terms and `last`, `total_terms`
    /// of them over all ranks, written into `last` ([`tandem_dist::exact`]); every term is as
    /// long as the gradients.
    pub fn finish_exact_sum(
        &mut self,
        earlier: &[&[f32]],
        last: &mut [f32],
        total_terms: usize,
    ) -> anyhow::Result<()> {
        let comm = &self.comm;
        let exact = match &mut self.exact {
            Some(exact) => exact,
            none => none.insert(ExactBuckets::new(comm, &self.buckets)?),
        };
        anyhow::ensure!(
            exact.len() == last.len(),
            "an exact sum of {} values over buckets of {}",
            last.len(),
            exact.len()
        );
        Ok(exact.finish(comm, earlier, last, total_terms)?)
    }

    /// Every rank's `part`, all of one length, concatenated in rank order.
    pub fn all_gather_f64(&self, part: Vec<f64>) -> anyhow::Result<Vec<f64>> {
        Ok(self.comm.run(move |group| group.all_gather(&part))?)
    }

    /// Called by backward with each range of gradients that is final: copies it out and
    /// sends every bucket that is now complete.
    pub fn gradients_ready(&mut self, range: Range<usize>, values: &[f32]) {
        for (index, bucket) in self.buckets.iter().enumerate().skip(self.next_bucket) {
            let start = bucket.start.max(range.start);
            let end = bucket.end.min(range.end);
            if start < end {
                if let Some(staging) = self.staging[index].as_mut() {
                    staging[start - bucket.start..end - bucket.start]
                        .copy_from_slice(&values[start - range.start..end - range.start]);
                }
            }
            if bucket.start >= range.end {
                break;
            }
        }
        while self.next_bucket < self.buckets.len()
            && self.buckets[self.next_bucket].end <= range.end
        {
            self.send_bucket(self.next_bucket);
            self.next_bucket += 1;
        }
    }

    fn send_bucket(&mut self, index: usize) {
        if let Some(values) = self.staging[index].take() {
            let pending = self.comm.all_reduce_shared(values, ReduceOp::Mean);
            self.in_flight.push((index, pending));
        }
    }

    /// Sends what backward did not, waits for every bucket, and writes the averaged
    /// gradients back into `grads`.
    pub fn finish_gradients(&mut self, grads: &mut [f32]) -> anyhow::Result<()> {
        while self.next_bucket < self.buckets.len() {
            let bucket = self.buckets[self.next_bucket].clone();
            if let Some(staging) = self.staging[self.next_bucket].as_mut() {
                staging.copy_from_slice(&grads[bucket]);
            }
            self.send_bucket(self.next_bucket);
            self.next_bucket += 1;
        }
        self.next_bucket = 0;
        let mut first_error = None;
        for (index, pending) in self.in_flight.drain(..) {
            match pending.wait() {
                Ok(values) => {
                    grads[self.buckets[index].clone()].copy_from_slice(&values);
                    self.staging[index] = Some(values);
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                    // The group has failed; later collectives report it.
                    self.staging[index] = Some(SharedBuffer::heap(self.buckets[index].len()));
                }
            }
        }
        match first_error {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    }

    /// A [`BatchNormReducer`] that sums batch statistics over the ranks (SyncBatchNorm).
    pub fn batch_norm_reducer(&self) -> DdpBatchNormReducer<'_> {
        DdpBatchNormReducer { comm: &self.comm }
    }
}

/// Sums batch-norm statistics over the ranks through the comm thread's queue.
pub struct DdpBatchNormReducer<'a> {
    comm: &'a CommThread,
}

impl BatchNormReducer for DdpBatchNormReducer<'_> {
    fn all_reduce_sum(
        &mut self,
        values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(sum_over_ranks(self.comm, values)?)
    }
}

/// Replaces `values` with their sums over the ranks, through `comm`'s queue.
fn sum_over_ranks(comm: &CommThread, values: &mut [f64]) -> tandem_dist::Result<()> {
    let summed = comm.all_reduce_f64(values.to_vec(), ReduceOp::Sum).wait()?;
    values.copy_from_slice(&summed);
    Ok(())
}

/// `Ok` when the ranks that ran a whole step through NCCL as a CUDA graph (`graphed_ranks`,
/// summed flags), and those that captured a new graph for it (`captured_ranks`), are each
/// none or all of `world_size`: NCCL requires whether a collective is captured to be the same
/// on every rank, and every rank to launch graphs from the same collective capture; a graph
/// launched against another rank's eager collectives, or beside another capture, may hang or
/// compute wrongly. A capture that failed on some ranks only (each falls back to eager steps
/// with a note), or a graph captured again on some ranks only (their workspace grew), is the
/// likely cause.
pub fn graphs_agree(
    graphed_ranks: f64,
    captured_ranks: f64,
    world_size: usize,
) -> anyhow::Result<()> {
    let (graphed, captured) = (
        graphed_ranks.round() as usize,
        captured_ranks.round() as usize,
    );
    anyhow::ensure!(
        graphed == 0 || graphed == world_size,
        "{graphed} of the {world_size} ranks ran this training step as a CUDA graph and the \
         others eagerly, but NCCL requires every rank to capture its collectives alike (a \
         capture failed on some rank: see its note); run with TANDEM_CUDA_GRAPHS=0"
    );
    anyhow::ensure!(
        captured == 0 || captured == world_size,
        "{captured} of the {world_size} ranks captured a new CUDA graph for this training step \
         and the others replayed an earlier one, but NCCL requires every rank to launch graphs \
         of the same capture (the ranks' convolution workspaces differ); run with \
         TANDEM_CUDA_GRAPHS=0"
    );
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn the_ranks_must_all_or_none_run_a_step_as_a_cuda_graph() {
        assert!(graphs_agree(0.0, 0.0, 4).is_ok());
        assert!(graphs_agree(4.0, 0.0, 4).is_ok());
        assert!(graphs_agree(4.0, 4.0, 4).is_ok());
        assert!(graphs_agree(1.0, 1.0, 1).is_ok());
        assert_eq!(
            graphs_agree(4.0, 1.0, 4).unwrap_err().to_string(),
            "1 of the 4 ranks captured a new CUDA graph for this training step and the others \
             replayed an earlier one, but NCCL requires every rank to launch graphs of the same \
             capture (the ranks' convolution workspaces differ); run with TANDEM_CUDA_GRAPHS=0"
        );
        assert_eq!(
            graphs_agree(3.0, 0.0, 4).unwrap_err().to_string(),
            "3 of the 4 ranks ran this training step as a CUDA graph and the others eagerly, \
             but NCCL requires every rank to capture its collectives alike (a capture failed \
             on some rank: see its note); run with TANDEM_CUDA_GRAPHS=0"
        );
    }
    use tandem_models::{LossOptions, ModelSpec, ResNetBaseSpec};

    /// A small seed-004 model, the same on every rank.
    pub(crate) fn small_model() -> Model {
        let spec = ModelSpec::ResNetBase(ResNetBaseSpec {
            n_blocks: vec![1, 1],
            n_channels: vec![8, 16],
            bottlenecks: Some(vec![4, 8]),
            first_kernel_size: 3,
            img_channels: 3,
            num_classes: 10,
        });
        let mut model = Model::new(&spec).unwrap();
        model.init_default(11);
        model
    }

    /// A batch of 6 images for `rank`, different on each rank.
    pub(crate) fn batch_of(rank: usize) -> (Vec<f32>, Vec<u32>) {
        let images = (0..6 * 32 * 32 * 3)
            .map(|index| ((index * 7919 + rank * 104_729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let labels = (0..6)
            .map(|index| ((index * 3 + rank) % 10) as u32)
            .collect();
        (images, labels)
    }

    /// The local gradient of `rank`'s batch, without any communication.
    fn local_gradient(rank: usize) -> Vec<f32> {
        let mut model = small_model();
        let (images, labels) = batch_of(rank);
        model
            .forward_train(&images, 6, 32, 32, &labels, &LossOptions::default(), None)
            .unwrap();
        model.backward(1.0, None, &mut |_, _| {}).unwrap();
        model.grads().to_vec()
    }

    /// Runs `body` on `world_size` ranks, each a thread with its own [`Ddp`] over loopback
    /// (small buckets, so that many are sent while backward runs); returns their results in
    /// rank order.
    pub(crate) fn on_ranks<T: Send>(
        world_size: usize,
        body: impl Fn(usize, Ddp) -> T + Sync,
    ) -> Vec<T> {
        let port = tandem_testdata::free_port();
        let grad_len = small_model().params().len();
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..world_size)
                .map(|rank| {
                    let body = &body;
                    scope.spawn(move || {
                        let placement = WorkerPlacement {
                            rank,
                            world_size,
                            local_world_size: world_size,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            store_hosted: false,
                            key_prefix: "ddp-test".into(),
                            round_prefix: "ddp-test".into(),
                            worker_id: rank,
                            membership_epoch: 0,
                            store_replicas: Vec::new(),
                        };
                        let token = tandem_dist::JobToken::new("ddp-test-token").unwrap();
                        let ddp = Ddp::join(
                            &placement,
                            token,
                            Duration::from_secs(30),
                            grad_len,
                            4096,
                            1024,
                        )
                        .unwrap();
                        body(rank, ddp)
                    })
                })
                .collect();
            ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
        })
    }

    /// Three started replicas of a store on loopback, and their addresses.
    fn store_replicas(
        token: &tandem_dist::JobToken,
    ) -> (Vec<Option<tandem_dist::StoreReplica>>, Vec<SocketAddr>) {
        let limits = tandem_dist::StoreLimits::default;
        let mut replicas: Vec<_> = (0..3)
            .map(|_| {
                let any_port = "127.0.0.1:0".parse().unwrap();
                tandem_dist::StoreReplica::bind(any_port, token.clone(), limits()).unwrap()
            })
            .collect();
        let addrs: Vec<SocketAddr> = replicas
            .iter()
            .map(|replica| replica.local_addr())
            .collect();
        for (index, replica) in replicas.iter_mut().enumerate() {
            replica.start(&addrs, index).unwrap();
        }
        (replicas.into_iter().map(Some).collect(), addrs)
    }

    /// Drops the replica that leads, once one does.
    fn drop_the_leader(replicas: &mut [Option<tandem_dist::StoreReplica>]) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let leading = replicas
                .iter()
                .position(|replica| replica.as_ref().is_some_and(|r| r.is_leader()));
            if let Some(index) = leading {
                replicas[index] = None;
                return;
            }
            assert!(std::time::Instant::now() < deadline, "no leader");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Rank `rank` of two, placed on the store replicated at `replicas`. Its `master_addr`
    /// names the first replica, where a store of its own could not be hosted.
    fn placed_on(replicas: &[SocketAddr], rank: usize) -> WorkerPlacement {
        WorkerPlacement {
            rank,
            world_size: 2,
            local_world_size: 2,
            master_addr: replicas[0].ip().to_string(),
            master_port: replicas[0].port(),
            store_hosted: false,
            key_prefix: "round0/pg".into(),
            round_prefix: "round0/pg".into(),
            worker_id: rank,
            membership_epoch: 0,
            store_replicas: replicas.to_vec(),
        }
    }

    #[test]
    fn ranks_placed_on_a_replicated_store_keep_it_through_the_loss_of_its_leader() {
        let token = tandem_dist::JobToken::new("ddp-test-token").unwrap();
        let (mut replicas, addrs) = store_replicas(&token);
        let lost_leader = std::sync::Barrier::new(3);
        let limit = Duration::from_secs(20);
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (addrs, token, lost_leader) = (&addrs, &token, &lost_leader);
                    scope.spawn(move || {
                        let placement = placed_on(addrs, rank);
                        let ddp = Ddp::join(&placement, token.clone(), limit, 8, 64, 64).unwrap();
                        assert_eq!(ddp.all_gather_f64(vec![rank as f64]).unwrap(), [0.0, 1.0]);
                        lost_leader.wait();
                        // A connection of its own, and the group's, reach the new leader.
                        let store = placement.connect_store(token, limit).unwrap();
                        store.set(&format!("after/{rank}"), b"1").unwrap();
                        store.wait(&["after/0", "after/1"], limit).unwrap();
                        let records = ddp.gather_records("after", vec![rank as u8]).unwrap();
                        assert_eq!(records, [[0], [1]]);
                    })
                })
                .collect();
            drop_the_leader(&mut replicas);
            lost_leader.wait();
            for rank in ranks {
                rank.join().unwrap();
            }
        });
        assert_eq!(
            placed_on(&addrs[..2], 0).store_text(),
            format!("the replicas {},{}", addrs[0], addrs[1])
        );
    }

    #[test]
    fn without_sync_bn_each_rank_uses_its_batch_and_gradients_are_averaged() {
        let results = on_ranks(2, |rank, mut ddp| {
            let mut model = small_model();
            let (images, labels) = batch_of(rank);
            model
                .forward_train(&images, 6, 32, 32, &labels, &LossOptions::default(), None)
                .unwrap();
            let mut reported = 0;
            model
                .backward(1.0, None, &mut |range, values| {
                    reported += values.len();
                    ddp.gradients_ready(range, values)
                })
                .unwrap();
            ddp.finish_gradients(model.grads_mut()).unwrap();
            assert_eq!(reported, model.grads().len());
            let own_statistics = model.buffers().to_vec();
            ddp.broadcast_buffers(&mut model).unwrap();
            (
                model.grads().to_vec(),
                own_statistics,
                model.buffers().to_vec(),
            )
        });
        let (first, second) = (local_gradient(0), local_gradient(1));
        let scale = first
            .iter()
            .chain(&second)
            .fold(0.0f32, |m, v| m.max(v.abs()));
        for (index, (a, b)) in first.iter().zip(&second).enumerate() {
            let expected = (a + b) / 2.0;
            let got = results[0].0[index];
            assert!(
                (got - expected).abs() <= 1e-6 * scale,
                "gradient {index}: {got} against the per-rank mean {expected}"
            );
        }
        assert!(
            results[0].0 == results[1].0,
            "ranks hold different gradients"
        );
        // Each rank normalized with its own batch, so their BN statistics differed until
        // rank 0's were broadcast.
        assert!(results[0].1 != results[1].1);
        assert!(results[1].2 == results[0].1);
    }

    #[test]
    fn buckets_cover_the_gradients_in_order() {
        assert_eq!(plan_buckets(10, 3, 4), vec![0..3, 3..7, 7..10]);
        assert_eq!(plan_buckets(2, 3, 4), vec![0..2]);
        assert!(plan_buckets(0, 3, 4).is_empty());
    }
}
