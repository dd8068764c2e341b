//! Re-forming the job in-process when a worker is lost (`tandem launch --keep-survivors`).
//!
//! A survivor's step fails when a peer dies (its sockets close) or is killed by the launcher
//! for a silent heartbeat. The survivor then abandons the step (nothing of it is applied),
//! waits for the membership the launcher publishes, joins a new process group among the
//! members (a store namespace of its own per membership epoch, so that a stale member's keys
//! never meet the new group's), and takes the training state of the member that got
//! furthest: a ring may finish a step on some ranks and fail it on others, so the members
//! agree on the most advanced one's weights, optimizer state, BN buffers and progress,
//! broadcast as a snapshot in memory. Steps of `--global-batch-size` do not depend on the
//! number of workers, so the run goes on with the same bits, without a restart and without
//! reading anything from disk.
//!
//! On GPUs (`--backend nccl`) each membership has an NCCL communicator of its own: leaving
//! a group aborts the old one (a collective blocked on the lost peer returns), and the new
//! group makes a new one from a unique id carried through its store namespace. A step's
//! exact sum cut short by the abort fails the step, which is then abandoned like a failed
//! step of the ring; the state is taken from the host copies of the device's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem_cuda::Device;
use tandem_data::ShardPlan;
use tandem_dist::cluster::contract::{
    joiner_key, membership_key, MembershipRecord, JOINER_ENV, KEEP_SURVIVORS_ENV,
};
use tandem_dist::heartbeat::MembershipWatch;
use tandem_dist::{DistError, JobToken, StoreClient};
use tandem_models::training_device::update_host;

use super::ddp::WorkerPlacement;
use super::gradient_sync::Alone;
use super::resume_settings::fingerprint;
use super::run_lock::OutputLock;
use super::snapshot::Snapshot;
use super::{gradient_sync_of, join_the_job, Trainer, MISSING_TOKEN};
use crate::backend::BackendRequest;
use crate::exit::SettingsError;
use crate::settings::TrainSettings;

/// How often a survivor looks for the new membership.
const MEMBERSHIP_POLL: Duration = Duration::from_millis(10);

/// How long the members of a new membership wait for each other to form its group: a
/// member missing after that was lost, and the launcher publishes the membership without it.
const FORMATION_LIMIT: Duration = Duration::from_secs(10);
/// How long a worker that became rank 0 waits for the old rank 0 to let go of the output
/// folder's lock: a node cut off from the store stops its workers within seconds.
const LOCK_PATIENCE: Duration = Duration::from_secs(30);

/// This worker's place in the membership of its round.
#[derive(Clone)]
pub struct Membership {
    /// The membership epoch it trains in.
    pub epoch: u64,
    /// Its place at the round's start, from which each membership's place is derived.
    pub start: WorkerPlacement,
    /// Whether it was started in place of a lost worker, to join the running job.
    pub joiner: bool,
    /// Whether each membership's group carries the gradients through NCCL on the GPUs.
    pub nccl: bool,
    /// Its connection to the job's store, to read the membership.
    store: Arc<StoreClient>,
}

/// Whether `tandem launch --replace-lost` started this worker in place of a lost one.
pub fn started_as_joiner() -> bool {
    std::env::var(JOINER_ENV).is_ok_and(|value| value == "1")
}

/// The membership of a worker that `tandem launch --keep-survivors` started, `None` for any
/// other; a settings error where the run cannot be re-formed (per-process batches, GPUs
/// without `--backend nccl`).
pub fn membership_of(
    placement: Option<&WorkerPlacement>,
    shards: Option<ShardPlan>,
    device: &Device,
    backend: BackendRequest,
    settings: &TrainSettings,
) -> anyhow::Result<Option<Membership>> {
    let (global_batch, on_cpu) = (shards.is_some(), matches!(device, Device::Cpu { .. }));
    let asked = std::env::var(KEEP_SURVIVORS_ENV).is_ok_and(|value| value == "1");
    let Some(placement) = placement.filter(|_| asked) else {
        return Ok(None);
    };
    if !global_batch {
        return Err(SettingsError::from_error(anyhow::anyhow!(
            "tandem launch --keep-survivors needs train --global-batch-size: the survivors \
             redo a step on fewer workers, which only steps of a global batch allow unchanged"
        )));
    }
    if !on_cpu && backend != BackendRequest::Nccl {
        return Err(SettingsError::from_error(anyhow::anyhow!(
            "tandem launch --keep-survivors re-forms GPU jobs through NCCL only: add --backend \
             nccl (each worker on a GPU of its own), or leave --keep-survivors out: a lost \
             worker then restarts every worker from the snapshot"
        )));
    }
    let timeout = Duration::from_secs_f64(settings.collective_timeout);
    Ok(Some(Membership {
        epoch: 0,
        start: placement.clone(),
        joiner: started_as_joiner(),
        nccl: !on_cpu,
        store: Arc::new(connect_to_store(placement, timeout)?),
    }))
}

impl Trainer {
    /// Whether `error`, a failed step's, is one the survivors re-form the job after: a
    /// failure of the process group, in a job started with `--keep-survivors`.
    pub(super) fn can_reform(&self, error: &anyhow::Error) -> bool {
        self.membership.is_some()
            && error.chain().any(|cause| {
                cause.downcast_ref::<DistError>().is_some()
                    || cause.downcast_ref::<NcclGroupFailed>().is_some()
            })
    }

    /// After `error` ended a step: abandons it, joins the job's next membership and takes the
    /// most advanced member's state. Fails when this worker was left out, or no membership
    /// comes within the collective timeout.
    pub(super) fn reform(&mut self, error: anyhow::Error) -> anyhow::Result<()> {
        let started = Instant::now();
        let (_, rank) = self.rank_in_world();
        // Before the device is touched: its work may wait on a collective of the lost peer.
        self.compute.leave_nccl()?;
        self.sync.abandon_step(&mut *self.compute)?;
        tell!("rank {rank}: the step failed ({error:#}); waiting for the job's new membership");
        self.join_next_membership(started)
    }

    /// At a step boundary: when the launcher published a new membership (a worker joins),
    /// leaves the group and joins the new one; returns whether it did.
    pub(super) fn reform_at_step_boundary(&mut self) -> anyhow::Result<bool> {
        let Some(membership) = &self.membership else {
            return Ok(false);
        };
        let started = Instant::now();
        match read_membership(&membership.store, &membership.start)? {
            Some(record) if record.epoch > membership.epoch => {
                self.join_next_membership(started)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// A worker started in place of a lost one: says it is ready, waits to be let in, and
    /// takes a member's state (no snapshot is read).
    pub(super) fn join_as_newcomer(&mut self) -> anyhow::Result<()> {
        let mut membership = self.membership.clone().context("no membership to join")?;
        // Only a membership published after the word that this worker is ready lets it in.
        membership.epoch =
            read_membership(&membership.store, &membership.start)?.map_or(0, |record| record.epoch);
        let id = membership.start.worker_id;
        let key = joiner_key(&membership.start.round_prefix, id);
        membership.store.set(&key, b"ready")?;
        self.membership = Some(membership);
        tell!("rank {id} joins the running job: waiting to be let in at a step boundary");
        self.join_next_membership(Instant::now())
    }

    /// Leaves the current group, waits for a membership later than this worker's, joins it
    /// and takes the most advanced member's state. A member lost meanwhile (the group's
    /// heartbeat breaks its ring and store waits) sends it on to the membership after.
    fn join_next_membership(&mut self, started: Instant) -> anyhow::Result<()> {
        let (old_world, old_rank) = self.rank_in_world();
        loop {
            match self.join_one_membership() {
                Ok((record, change)) => {
                    if self.is_leader() && !self.output_lock.is_held() {
                        self.take_up_leadership(old_rank)?;
                    }
                    if self.is_leader() {
                        say!(
                            "membership {}: {}; world size {old_world} -> {} at epoch {}, step \
                             {}, re-formed in {:.2} s without a restart{}",
                            record.epoch,
                            record.why,
                            record.members.len(),
                            self.progress.epoch + 1,
                            self.progress.step_in_epoch,
                            started.elapsed().as_secs_f64(),
                            change.map_or(String::new(), |line| format!(" ({line})"))
                        );
                    }
                    return Ok(());
                }
                Err(error) if self.can_reform(&error) => {
                    tell!(
                        "rank {old_rank}: the job changed again while it re-formed ({error:#}); \
                         waiting for the next membership"
                    );
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// One attempt of [`join_next_membership`](Self::join_next_membership): returns the
    /// membership joined, and the line that says how the batch changed with the world size.
    fn join_one_membership(&mut self) -> anyhow::Result<(MembershipRecord, Option<String>)> {
        let membership = self
            .membership
            .clone()
            .context("no membership to re-form")?;
        // Leaves the old group: its comm thread, sockets and NCCL communicator end here.
        self.sync = Box::new(Alone);
        self.compute.leave_nccl()?;
        let (record, ddp) = self.form_the_next_group(&membership)?;
        let membership = Membership {
            epoch: record.epoch,
            ..membership
        };
        // From here on, before the group's first store wait: a member may be lost any time.
        watch_membership(&membership, &ddp, &self.output_lock);
        self.sync = gradient_sync_of(self.shards, Some(ddp), &mut *self.compute, &self.settings)?;
        self.membership = Some(membership);
        if !self.is_leader() {
            // The new rank 0 writes the run's files from here.
            self.output_lock.release();
            self.events = None;
        }
        self.take_the_most_advanced_state()?;
        let change = self.adopt_world_size(None);
        Ok((record, change))
    }

    /// Waits for the next membership and forms its group. A member lost before the group
    /// formed (several workers lost a few milliseconds apart) leaves the others unable to
    /// form it: after [`FORMATION_LIMIT`] they take the membership the launcher publishes
    /// next. A membership that left this worker out (its node was cut off, or its launcher
    /// stopped, past the heartbeat timeout) fences it: it asks to rejoin, and waits for one
    /// that lets it in at a step boundary.
    fn form_the_next_group(
        &mut self,
        membership: &Membership,
    ) -> anyhow::Result<(MembershipRecord, super::Ddp)> {
        let timeout = Duration::from_secs_f64(self.settings.collective_timeout);
        let mut waiting = membership.clone();
        let mut asked_to_rejoin = false;
        loop {
            let record = match wait_for_membership(&waiting, timeout) {
                Ok(record) => record,
                Err(error) => return Err(self.stop_below_minimum(error)),
            };
            let start = &waiting.start;
            let Some(rank) = record.members.iter().position(|&id| id == start.worker_id) else {
                if !asked_to_rejoin {
                    // Fenced, it writes nothing: the members' rank 0 needs the folder.
                    self.output_lock.release();
                    ask_to_rejoin(&waiting, &record)?;
                    asked_to_rejoin = true;
                }
                waiting.epoch = record.epoch;
                continue;
            };
            asked_to_rejoin = false;
            let place = WorkerPlacement {
                rank,
                world_size: record.members.len(),
                local_world_size: record.members.len(),
                key_prefix: record.group_prefix(&start.round_prefix),
                membership_epoch: record.epoch,
                ..start.clone()
            };
            let params = self.compute.param_count();
            let joined = join_the_job(&place, &self.settings, params, Some(FORMATION_LIMIT));
            match joined.and_then(|ddp| self.join_nccl_of(membership, ddp)) {
                Ok(ddp) => return Ok((record, ddp)),
                Err(error) => {
                    tell!(
                        "membership {}: the group did not form ({error:#}); waiting for the \
                         next membership",
                        record.epoch
                    );
                    waiting.epoch = record.epoch;
                }
            }
        }
    }

    /// With `membership.nccl`, joins the device to the NCCL group of `ddp`'s ranks (the old
    /// communicator was aborted when this worker left its group); returns `ddp`.
    fn join_nccl_of(
        &mut self,
        membership: &Membership,
        ddp: super::Ddp,
    ) -> anyhow::Result<super::Ddp> {
        if membership.nccl {
            super::join_nccl(&mut *self.compute, &ddp, &self.settings)?;
        }
        Ok(ddp)
    }

    /// When the job stayed below its minimum (`error` says so), the first member of the
    /// paused membership writes the snapshot of its state; returns the error to end with.
    fn stop_below_minimum(&mut self, error: anyhow::Error) -> anyhow::Error {
        let writes = error
            .downcast_ref::<BelowMinimum>()
            .is_some_and(|below| Some(below.first) == self.worker_id());
        if !writes {
            return error;
        }
        let (epoch, step) = (self.progress.epoch + 1, self.progress.step_in_epoch);
        match self.lock_the_output().and_then(|()| self.save_snapshot()) {
            Ok(()) => error.context(format!(
                "the snapshot holds epoch {epoch}, step {step}: start the job again to resume"
            )),
            Err(failed) => {
                error.context(format!("and the snapshot could not be written: {failed:#}"))
            }
        }
    }

    /// Gives every member the state of the one that finished the most steps (the lowest rank
    /// among those), as a snapshot in memory.
    fn take_the_most_advanced_state(&mut self) -> anyhow::Result<()> {
        let ddp = self.sync.group().context("no group after re-forming")?;
        let rank = ddp.rank();
        let steps = ddp.all_gather_f64(vec![self.progress.global_step as f64])?;
        let most = steps.iter().copied().fold(0.0, f64::max);
        let source = steps.iter().position(|&steps| steps == most).unwrap_or(0);
        let bytes = match rank == source {
            true => {
                let optimizer = self.compute.optimizer_state()?;
                Snapshot::capture(
                    self.compute.host_model()?,
                    optimizer,
                    self.progress.clone(),
                    self.history.clone(),
                    fingerprint(&self.settings),
                )
                .to_bytes()?
            }
            false => Vec::new(),
        };
        let ddp = self.sync.group_mut().context("no group after re-forming")?;
        let shared = ddp.broadcast_bytes_from(bytes, source)?;
        if rank == source {
            return Ok(());
        }
        let snapshot = Snapshot::from_bytes(&shared)
            .context("the state that the most advanced member sent")?;
        update_host(&mut *self.compute, |model| snapshot.restore_model(model))?;
        self.compute.load_optimizer_state(&snapshot.optimizer)?;
        self.progress = snapshot.progress;
        self.history = snapshot.history;
        Ok(())
    }

    /// When this worker is rank 0 of the new membership (it stayed rank 0, or the old rank 0
    /// was lost, or it joined in its place), takes up what rank 0 alone does: the output
    /// folder's lock and the TensorBoard events.
    fn take_up_leadership(&mut self, old_rank: usize) -> anyhow::Result<()> {
        self.lock_the_output()?;
        if self.events.is_none() && self.progress.epoch < self.settings.epochs {
            self.open_events()?;
        }
        if old_rank != 0 {
            tell!("rank {old_rank} is now rank 0: it writes the run's files");
        }
        Ok(())
    }

    /// Takes the output folder's lock unless this worker holds it. The old rank 0 may still
    /// hold it: left out of the job, it lets go or is stopped. The wait is file work, not a
    /// hang, for the launcher's stall watch.
    fn lock_the_output(&mut self) -> anyhow::Result<()> {
        let _files = tandem_dist::heartbeat::doing_file_work();
        self.output_lock
            .take_within(&self.settings.output_dir, LOCK_PATIENCE)
    }

    /// This worker's id (its rank at the round's start), with `--keep-survivors`.
    fn worker_id(&self) -> Option<usize> {
        self.membership
            .as_ref()
            .map(|membership| membership.start.worker_id)
    }
}

/// Tells the launcher that this worker, which `record` left out of the job, is ready to
/// rejoin it; says so.
fn ask_to_rejoin(membership: &Membership, record: &MembershipRecord) -> anyhow::Result<()> {
    let id = membership.start.worker_id;
    let key = joiner_key(&membership.start.round_prefix, id);
    membership.store.set(&key, b"ready")?;
    tell!(
        "rank {id} (at the round's start) was left out of the job at membership {} ({}): it \
         takes no part in any step of it, and asks to rejoin at a step boundary",
        record.epoch,
        record.why
    );
    Ok(())
}

/// Has `ddp`'s heartbeat break the group's collectives and store waits when a membership
/// later than `membership`'s is published, and let go of the output folder's `lock` while
/// this worker is cut off from the store.
pub(super) fn watch_membership(membership: &Membership, ddp: &super::Ddp, lock: &OutputLock) {
    ddp.watch_membership(MembershipWatch {
        round_prefix: membership.start.round_prefix.clone(),
        epoch: membership.epoch,
    });
    let (lock, id) = (lock.clone(), membership.start.worker_id);
    let released = AtomicBool::new(false);
    ddp.on_store_cut(Box::new(move |cut| {
        if cut && lock.release() {
            released.store(true, Ordering::SeqCst);
            tell!(
                "rank {id} (at the round's start) reaches no majority of the job's store: it lets \
                 go of the output folder, for the majority's rank 0"
            );
        } else if !cut && released.swap(false, Ordering::SeqCst) && lock.take_again() {
            tell!("rank {id} (at the round's start) reaches the store again: it holds the output folder again");
        }
    }));
}

/// In a job of `membership` (`--keep-survivors`), has the first group's heartbeat watch for
/// a later membership (see [`watch_membership`]).
pub(super) fn watch_the_first_group(
    membership: Option<&Membership>,
    ddp: Option<&super::Ddp>,
    lock: &OutputLock,
) {
    if let (Some(membership), Some(ddp)) = (membership, ddp) {
        watch_membership(membership, ddp, lock);
    }
}

/// Connects to the job's store of `placement`, within `timeout`.
fn connect_to_store(placement: &WorkerPlacement, timeout: Duration) -> anyhow::Result<StoreClient> {
    let token = JobToken::from_env()?.context(MISSING_TOKEN)?;
    placement
        .connect_store(&token, timeout)
        .context("read the job's membership")
}

/// The latest membership of the round of `start`, `None` before the first change.
fn read_membership(
    store: &StoreClient,
    start: &WorkerPlacement,
) -> anyhow::Result<Option<MembershipRecord>> {
    let Some(bytes) = store.get(&membership_key(&start.round_prefix))? else {
        return Ok(None);
    };
    let record = MembershipRecord::from_json(&bytes)
        .map_err(|why| anyhow::anyhow!("the job's membership {why}"))?;
    Ok(Some(record))
}

/// A step's NCCL collectives failed or were aborted (the job lost a member): a failure of
/// the process group, which the survivors re-form the job after, as after one of the ring.
#[derive(Debug)]
pub struct NcclGroupFailed(String);

impl std::fmt::Display for NcclGroupFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the NCCL group failed: {}", self.0)
    }
}

impl std::error::Error for NcclGroupFailed {}

/// `error`, a step's that the NCCL group's failure ended, as an [`NcclGroupFailed`].
pub fn nccl_group_failed(error: anyhow::Error) -> anyhow::Error {
    NcclGroupFailed(format!("{error:#}")).into()
}

/// A job that stayed below its minimum of workers for the launcher's rendezvous timeout.
#[derive(Debug)]
struct BelowMinimum {
    members: usize,
    seconds: f64,
    /// The id of the paused membership's first member, which writes the snapshot.
    first: usize,
}

impl std::fmt::Display for BelowMinimum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the job stayed paused below --min-workers with {} member(s) for {:.0} s \
             (--rendezvous-timeout)",
            self.members, self.seconds
        )
    }
}

impl std::error::Error for BelowMinimum {}

/// Waits, at most `timeout`, for a membership of a later epoch than `membership`'s in which
/// the members go on. A paused one that names this worker extends the wait by the pause the
/// launcher allows; when that runs out too, fails with [`BelowMinimum`].
fn wait_for_membership(
    membership: &Membership,
    timeout: Duration,
) -> anyhow::Result<MembershipRecord> {
    let mut deadline = Instant::now() + timeout;
    let mut seen = membership.epoch;
    let mut paused: Option<BelowMinimum> = None;
    loop {
        if let Some(record) = read_membership(&membership.store, &membership.start)? {
            let member = record.members.contains(&membership.start.worker_id);
            match (record.epoch > seen, record.paused_for) {
                (true, Some(seconds)) if member => {
                    tell!(
                        "membership {}: {}; paused with {} member(s), below --min-workers: \
                         waiting up to {seconds:.0} s for more",
                        record.epoch,
                        record.why,
                        record.members.len()
                    );
                    seen = record.epoch;
                    // A little beyond the launcher's own wait, so that its word comes first.
                    deadline = Instant::now() + Duration::from_secs_f64(seconds + 1.0);
                    paused = Some(BelowMinimum {
                        members: record.members.len(),
                        seconds,
                        first: record.members[0],
                    });
                }
                (true, _) => return Ok(record),
                (false, _) => {}
            }
        }
        if Instant::now() >= deadline {
            if let Some(below) = paused {
                return Err(below.into());
            }
            bail!(
                "no new membership came within {:.0} s (the collective timeout)",
                timeout.as_secs_f64()
            );
        }
        std::thread::sleep(MEMBERSHIP_POLL);
    }
}
