//! A thread that owns the process group and runs collectives in submission order, so the
//! trainer can overlap communication (DDP buckets) with computation.
//!
//! Buffers move to the comm thread and back by ownership; a [`Pending`] is the receipt.
//! Because every rank submits the same sequence of operations and the thread runs them first
//! in, first out, the ranks stay in step.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::element::{Element, ReduceOp};
use crate::error::{DistError, Result};
use crate::group::ProcessGroup;
use crate::shared::SharedBuffer;

/// One queued operation.
type Job = Box<dyn FnOnce(&mut ProcessGroup) + Send>;

/// The comm thread and its queue. Dropping it lets queued operations finish, then stops the
/// thread.
pub struct CommThread {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<ProcessGroup>>,
    rank: usize,
    world_size: usize,
}

/// The result of a submitted operation, to collect with [`Pending::wait`].
#[must_use = "a Pending must be waited on to learn whether the collective succeeded"]
pub struct Pending<T> {
    result: mpsc::Receiver<Result<T>>,
}

impl<T> Pending<T> {
    /// Blocks until the operation has run and returns its result.
    pub fn wait(self) -> Result<T> {
        let _waiting = crate::heartbeat::waiting_for_peers();
        self.result
            .recv()
            .unwrap_or(Err(DistError::CommThreadStopped))
    }
}

impl CommThread {
    /// Starts the thread; it owns `group` until [`into_process_group`](Self::into_process_group).
    pub fn spawn(group: ProcessGroup) -> Result<CommThread> {
        let (rank, world_size) = (group.rank(), group.world_size());
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("comm-rank-{rank}"))
            .spawn(move || {
                let mut group = group;
                for job in queue {
                    job(&mut group);
                }
                group
            })
            .map_err(|error| DistError::io("spawn the comm thread", &error))?;
        Ok(CommThread {
            jobs: Some(jobs),
            thread: Some(thread),
            rank,
            world_size,
        })
    }

    /// The group's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The group's world size.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Queues `operation` behind everything submitted before it.
    pub fn submit<T, F>(&self, operation: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut ProcessGroup) -> Result<T> + Send + 'static,
    {
        let (reply, result) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |group| {
            // The caller may have dropped its Pending; then nobody wants the result.
            let _ = reply.send(operation(group));
        });
        if let Some(jobs) = &self.jobs {
            // If the thread is gone the job (and its reply sender) is dropped: wait() reports it.
            let _ = jobs.send(job);
        }
        Pending { result }
    }

    /// Runs `operation` through the same queue and waits for it: the synchronous pass-through
    /// for metrics or batch-norm statistics.
    pub fn run<T, F>(&self, operation: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut ProcessGroup) -> Result<T> + Send + 'static,
    {
        self.submit(operation).wait()
    }

    /// All-reduces `buffer` on the comm thread and hands it back.
    pub fn all_reduce_f32(&self, buffer: Vec<f32>, op: ReduceOp) -> Pending<Vec<f32>> {
        self.submit(move |group| all_reduce_owned(group, buffer, op))
    }

    /// All-reduces `buffer` on the comm thread and hands it back.
    pub fn all_reduce_f64(&self, buffer: Vec<f64>, op: ReduceOp) -> Pending<Vec<f64>> {
        self.submit(move |group| all_reduce_owned(group, buffer, op))
    }

    /// All-reduces `buffer` on the comm thread and hands it back.
    pub fn all_reduce_i64(&self, buffer: Vec<i64>, op: ReduceOp) -> Pending<Vec<i64>> {
        self.submit(move |group| all_reduce_owned(group, buffer, op))
    }

    /// Makes a buffer for [`all_reduce_shared`](Self::all_reduce_shared) (a collective: see
    /// [`ProcessGroup::shared_buffer`]).
    pub fn shared_buffer<T: Element>(&self, len: usize) -> Result<SharedBuffer<T>> {
        self.run(move |group| group.shared_buffer(len))
    }

    /// All-reduces a shared buffer on the comm thread and hands it back.
    pub fn all_reduce_shared<T: Element>(
        &self,
        mut buffer: SharedBuffer<T>,
        op: ReduceOp,
    ) -> Pending<SharedBuffer<T>> {
        self.submit(move |group| group.all_reduce_shared(&mut buffer, op).map(|()| buffer))
    }

    /// Broadcasts `buffer` from `root` on the comm thread and hands it back.
    pub fn broadcast_f32(&self, mut buffer: Vec<f32>, root: usize) -> Pending<Vec<f32>> {
        self.submit(move |group| group.broadcast(&mut buffer, root).map(|()| buffer))
    }

    /// Broadcasts `bytes` from `root` on the comm thread and hands them back.
    pub fn broadcast_bytes(&self, mut bytes: Vec<u8>, root: usize) -> Pending<Vec<u8>> {
        self.submit(move |group| group.broadcast_bytes(&mut bytes, root).map(|()| bytes))
    }

    /// Waits for the queue to drain, stops the thread and returns the group.
    pub fn into_process_group(mut self) -> Result<ProcessGroup> {
        self.jobs = None;
        let thread = self.thread.take().ok_or(DistError::CommThreadStopped)?;
        thread.join().map_err(|_| DistError::CommThreadStopped)
    }
}

fn all_reduce_owned<T: crate::Element>(
    group: &mut ProcessGroup,
    mut buffer: Vec<T>,
    op: ReduceOp,
) -> Result<Vec<T>> {
    group.all_reduce(&mut buffer, op).map(|()| buffer)
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
