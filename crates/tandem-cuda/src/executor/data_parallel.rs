//! Data parallelism on the device: the executor's gradients all-reduced through NCCL bucket
//! by bucket as the backward pass finishes them, and its parameters and running statistics
//! broadcast from rank 0, without the host.
//!
//! Ordering, with no host wait inside a step: when the backward has finished one or more
//! buckets, an event recorded on the compute stream makes the group's stream wait, then the
//! group's stream sums each bucket over the ranks (`ncclAllReduce`, in place) and divides it
//! by the world size (`divide_in_place`, as the host ring finishes its mean) while the compute
//! stream goes on with the earlier layers. At the end of the backward,
//! [`CudaExecutor::finish_all_reduce`] queues the buckets left, and the compute stream waits on
//! an event recorded after them, so the optimizer reads the averaged gradients. Each such
//! hand-back is registered with the group's watchdog, which aborts the communicator when it
//! does not finish within the timeout; the next call then returns the error. A whole step
//! (`whole_step.rs`) runs the same work inside its body, captured in a CUDA graph after its
//! first run, and registers one deadline after each step.

use std::ops::Range;
use std::time::Duration;

use tandem_models::workspace::Plan;
use tandem_models::{BatchNormReducer, Model, ModelError};

use super::graph::StepRun;
use super::kernels::collective::divide_in_place;
use super::kernels::{Ptr, Queue};
use super::launch::per_element;
use super::step::GradientSink;
use super::{address, at, CudaExecutor, GpuError};
use crate::collective::{bucket_ops, BucketCursor, BucketOp, NcclAbort, NcclGroup};
use crate::nccl::UNIQUE_ID_BYTES;
use crate::probe::Probe;

/// The NCCL group of a GPU rank and its gradient buckets.
pub struct DeviceDataParallel {
    group: NcclGroup,
    cursor: BucketCursor,
    /// Whether training passes sum their batch-norm totals over the ranks through the group
    /// (SyncBatchNorm on the device).
    sync_batch_norm: bool,
}

impl CudaExecutor {
    /// Joins the NCCL communicator of `world_size` ranks as `rank` with rank 0's `unique_id`
    /// on this executor's GPU (waiting at most `timeout` for the others, and giving each later
    /// collective as long), with the gradients all-reduced in `buckets` (contiguous ranges of
    /// the flat gradients, in order, covering them).
    pub fn join_nccl(
        &mut self,
        probe: &Probe,
        unique_id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        timeout: Duration,
        buckets: Vec<Range<usize>>,
    ) -> Result<(), GpuError> {
        check_buckets(&buckets, self.flat.host_grads.len())?;
        self.bind()?;
        let group = NcclGroup::join(probe, &self.context, unique_id, rank, world_size, timeout)?;
        // Graphs captured with an earlier group's collectives must not outlive it.
        self.release_graphs();
        self.data_parallel = Some(DeviceDataParallel {
            group,
            cursor: BucketCursor::new(buckets),
            sync_batch_norm: false,
        });
        Ok(())
    }

    /// Leaves the NCCL group, if any: the captured graphs that hold its collectives are
    /// destroyed and its communicator is aborted (a collective blocked on a lost peer
    /// returns); the device computes alone until it joins another.
    pub fn leave_nccl(&mut self) {
        self.release_graphs();
        self.data_parallel = None;
    }

    /// A handle that aborts the NCCL group's communicator from another thread; `None`
    /// without a group.
    pub fn nccl_abort_handle(&self) -> Option<NcclAbort> {
        self.nccl_group().map(NcclGroup::abort_handle)
    }

    /// SyncBatchNorm through the NCCL group: from now on every training forward and backward
    /// sums each batch-norm layer's column totals over the ranks with `ncclAllReduce` on the
    /// device (ordered by events, no host wait, captured with a whole step), instead of
    /// through a host reducer. Every rank must train on batches of the same size (the
    /// distributed sampler pads the ranks' shares to one length): a layer's count of values
    /// is the local count times the world size.
    pub fn sync_batch_norm_through_nccl(&mut self) -> Result<(), GpuError> {
        let data_parallel = self
            .data_parallel
            .as_mut()
            .ok_or(GpuError::NoCommunicator)?;
        data_parallel.sync_batch_norm = true;
        // A graph captured before holds no batch-norm collectives.
        self.release_graphs();
        Ok(())
    }

    /// The world size when training passes sum their batch-norm totals through NCCL
    /// ([`CudaExecutor::sync_batch_norm_through_nccl`]); `None` otherwise.
    pub(super) fn batch_norm_world(&self) -> Option<usize> {
        self.data_parallel
            .as_ref()
            .filter(|data_parallel| data_parallel.sync_batch_norm)
            .map(|data_parallel| data_parallel.group.world_size())
    }

    /// Sums the first `len` column totals of the active storage over the ranks, in place:
    /// on the group's stream after the compute stream's work so far, and the compute stream
    /// waits for it (given the collective timeout).
    pub(super) fn all_reduce_batch_norm_totals(&mut self, len: usize) -> Result<(), GpuError> {
        let totals = address(&self.storage()?.totals, &self.stream);
        let group = self.nccl_group().ok_or(GpuError::NoCommunicator)?;
        group.wait_for(&self.stream)?;
        // SAFETY: the storage's totals hold at least 1 + 2 * channels doubles of every unit
        // (`len` is at most that), on this GPU; the storage lives until the compute stream,
        // which waits for the group's stream below, has finished with it.
        unsafe { group.all_reduce_sum_f64(totals, len)? };
        group.hand_back(
            &self.stream,
            "all-reduce of batch-norm statistics (--sync-bn)".to_string(),
        )?;
        Ok(())
    }

    /// Whether this executor joined an NCCL communicator.
    pub fn has_nccl(&self) -> bool {
        self.data_parallel.is_some()
    }

    /// The NCCL group, once joined.
    pub(super) fn nccl_group(&self) -> Option<&NcclGroup> {
        self.data_parallel
            .as_ref()
            .map(|data_parallel| &data_parallel.group)
    }

    /// Tells the NCCL group (if any) that a stream capture of the compute stream starts
    /// (`true`) or has ended (`false`): see `NcclGroup::begin_capture`.
    pub(super) fn nccl_capture(&self, capturing: bool) {
        if let Some(group) = self.nccl_group() {
            match capturing {
                true => group.begin_capture(),
                false => group.end_capture(),
            }
        }
    }

    /// After a whole step that ran as `run`: with an NCCL group, gives everything queued on
    /// the compute stream (the step, its collectives included) the timeout to finish.
    pub(super) fn watch_step(&self, run: StepRun) -> Result<(), GpuError> {
        if let Some(group) = self.nccl_group() {
            group.watch(&self.stream, step_deadline_name(run))?;
        }
        Ok(())
    }

    /// Takes the captured graphs out and destroys them, before the NCCL group whose
    /// collectives they hold goes. Always, after an abort too: NCCL's abort and destroy wait
    /// until every graph holding the communicator's collectives is destroyed
    /// (`commDestroySync` in NCCL's `init.cc` polls until the graphs' persistent references
    /// die), so a graph kept alive would hang the watchdog's abort and the group's drop. A
    /// graph still running is freed when it completes (`cuGraphExecDestroy`); its NCCL
    /// kernels return once the communicator is aborted. Only a broken context (a sticky
    /// error), where destroying may fail and NCCL's destroy gives up before that wait, leaks
    /// them.
    pub(super) fn release_graphs(&mut self) {
        let graphs = self.graphs.take_graphs();
        if graphs.is_empty() {
            return;
        }
        if self.context.bind_to_thread().is_err() {
            std::mem::forget(graphs);
            return;
        }
        drop(graphs);
    }

    /// The NCCL watchdog's verdict: an error once a collective timed out or failed (the
    /// communicator is then aborted); `Ok` without a communicator.
    pub fn nccl_health(&self) -> Result<(), GpuError> {
        match &self.data_parallel {
            Some(data_parallel) => Ok(data_parallel.group.check()?),
            None => Ok(()),
        }
    }

    /// The backward of the last training forward, as [`CudaExecutor::backward`], with each
    /// gradient bucket all-reduced through NCCL on the group's stream as soon as the
    /// backward has finished it; call [`CudaExecutor::finish_all_reduce`] after it.
    pub fn backward_all_reduced(
        &mut self,
        model: &Model,
        plan: &Plan,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> Result<(), ModelError> {
        self.bind()?;
        self.restart_buckets()?;
        let sink = GradientSink::AllReduce;
        self.backward_reporting(model, plan, loss_scale, bn_sync, None, sink)
    }

    /// Starts the bucket cursor over for a backward that all-reduces (see
    /// `BucketCursor::restart`).
    pub(super) fn restart_buckets(&mut self) -> Result<(), GpuError> {
        let data_parallel = self
            .data_parallel
            .as_mut()
            .ok_or(GpuError::NoCommunicator)?;
        data_parallel.cursor.restart();
        Ok(())
    }

    /// Queues the all-reduce of every bucket the backward has not handed out (all of them
    /// after a backward without [`CudaExecutor::backward_all_reduced`], e.g. with
    /// SyncBatchNorm) and makes the compute stream wait for the averaged gradients.
    pub fn finish_all_reduce(&mut self) -> Result<(), GpuError> {
        self.bind()?;
        let data_parallel = self
            .data_parallel
            .as_mut()
            .ok_or(GpuError::NoCommunicator)?;
        let rest = data_parallel.cursor.rest();
        self.all_reduce_buckets(rest, true)
    }

    /// Gives every rank rank 0's parameters and running statistics (the start, a resume).
    pub fn broadcast_params_and_buffers(&mut self) -> Result<(), GpuError> {
        self.broadcast_from_rank0(true)
    }

    /// Gives every rank rank 0's running statistics (each step, as PyTorch's
    /// `broadcast_buffers`).
    pub fn broadcast_buffers(&mut self) -> Result<(), GpuError> {
        self.broadcast_from_rank0(false)
    }

    /// Broadcasts the running statistics, and the parameters with `params`, from rank 0.
    fn broadcast_from_rank0(&mut self, params: bool) -> Result<(), GpuError> {
        self.bind()?;
        let data_parallel = self
            .data_parallel
            .as_ref()
            .ok_or(GpuError::NoCommunicator)?;
        let group = &data_parallel.group;
        group.wait_for(&self.stream)?;
        let mut what = Vec::new();
        if params {
            let base = self.flat.params.address(&self.stream);
            // SAFETY: the parameter buffer holds `host_grads.len()` floats (one per
            // parameter) on this GPU and lives as long as the executor, which outlives the
            // hand-back below that the compute stream waits on.
            unsafe { group.broadcast_from_rank0(base, self.flat.host_grads.len())? };
            what.push("the parameters");
        }
        if self.flat.buffer_len > 0 {
            let base = address(&self.flat.buffers, &self.stream);
            // SAFETY: the running-statistic buffer holds `buffer_len` floats; as above.
            unsafe { group.broadcast_from_rank0(base, self.flat.buffer_len)? };
            what.push("the running statistics");
        }
        group.hand_back(&self.stream, format!("broadcast of {}", what.join(" and ")))?;
        Ok(())
    }

    /// Called by the backward with the end of the gradients that are final: queues the
    /// all-reduce of the buckets now complete.
    pub(super) fn all_reduce_finished(&mut self, end: usize) -> Result<(), GpuError> {
        let data_parallel = self
            .data_parallel
            .as_mut()
            .ok_or(GpuError::NoCommunicator)?;
        let finished = data_parallel.cursor.finished_up_to(end);
        self.all_reduce_buckets(finished, false)
    }

    /// Queues the work of [`bucket_ops`] for the buckets numbered `indices`: on the group's
    /// stream after the compute stream's work so far, their average over the ranks; with
    /// `last`, the compute stream's wait for it.
    fn all_reduce_buckets(&mut self, indices: Range<usize>, last: bool) -> Result<(), GpuError> {
        let data_parallel = self
            .data_parallel
            .as_ref()
            .ok_or(GpuError::NoCommunicator)?;
        let group = &data_parallel.group;
        let buckets = data_parallel.cursor.buckets();
        let world_size = group.world_size();
        let base = self.flat.grads.address(&self.stream);
        for op in bucket_ops(buckets, indices, last) {
            match op {
                BucketOp::WaitForCompute => group.wait_for(&self.stream)?,
                // SAFETY: `check_buckets` made every bucket lie inside the gradient buffer (one
                // float per parameter, on this GPU, alive as long as the executor; the compute
                // stream waits for the group's stream before the optimizer reads it).
                BucketOp::AllReduceSum(bucket) => unsafe { group.all_reduce_sum(base, bucket)? },
                BucketOp::DivideByWorld(bucket) => {
                    let (n, queue) = (
                        bucket.len(),
                        Queue::new(&self.libraries.kernels, group.stream()),
                    );
                    let floats = Ptr::from_address(at(base, bucket.start));
                    divide_in_place(&queue, per_element(n), floats, n as i64, world_size as f32)?;
                }
                BucketOp::HandBack => group.hand_back(
                    &self.stream,
                    format!("all-reduce of the gradients ({} buckets)", buckets.len()),
                )?,
            }
        }
        Ok(())
    }
}

/// What a step's deadline is called in the error when it passes.
fn step_deadline_name(run: StepRun) -> String {
    let how = match run {
        StepRun::Eager => "run eagerly",
        StepRun::Capture => "just captured as a CUDA graph",
        StepRun::Replay => "replayed from a CUDA graph",
    };
    format!("all-reduce of the gradients inside a training step ({how})")
}

/// `Ok` when `buckets` are contiguous ranges from 0 covering exactly `len` gradients.
fn check_buckets(buckets: &[Range<usize>], len: usize) -> Result<(), GpuError> {
    let mut end = 0;
    for bucket in buckets {
        if bucket.start != end || bucket.end < bucket.start {
            return Err(GpuError::Unsupported(
                "gradient buckets that are not contiguous from 0",
            ));
        }
        end = bucket.end;
    }
    if end != len {
        return Err(GpuError::Length {
            what: "gradient buckets",
            found: end,
            expected: len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_deadline_says_how_the_step_ran() {
        assert_eq!(
            step_deadline_name(StepRun::Replay),
            "all-reduce of the gradients inside a training step (replayed from a CUDA graph)"
        );
        assert_eq!(
            step_deadline_name(StepRun::Eager),
            "all-reduce of the gradients inside a training step (run eagerly)"
        );
        let timed_out = crate::collective::CollectiveError::TimedOut {
            what: step_deadline_name(StepRun::Capture),
            waited: Duration::from_secs(2),
        };
        assert_eq!(
            timed_out.to_string(),
            "NCCL all-reduce of the gradients inside a training step (just captured as a CUDA \
             graph) did not finish within 2s (--collective-timeout): a peer stopped answering; \
             the communicator was aborted"
        );
    }

    #[test]
    fn buckets_must_cover_the_gradients_contiguously() {
        assert!(check_buckets(&[0..3, 3..7, 7..10], 10).is_ok());
        assert!(check_buckets(&[], 0).is_ok());
        assert_eq!(
            check_buckets(&[0..3, 4..10], 10).unwrap_err().to_string(),
            "the GPU executor does not support gradient buckets that are not contiguous from 0 yet"
        );
        assert_eq!(
            check_buckets(&[0..3, 3..7], 10).unwrap_err().to_string(),
            "gradient buckets has 7 values, the device buffer holds 10"
        );
    }
}
