//! [`NcclGroup`]: one rank's NCCL communicator, its stream and its watchdog.
//!
//! The communicator is a blocking one (`ncclCommInitRank`). cudarc 0.19 exposes
//! `ncclCommInitRankConfig` and the `ncclConfig_t` struct but not `NCCL_CONFIG_INITIALIZER`,
//! whose magic and version fields must match the loaded library; rather than forge them, the
//! group bounds every wait itself: the join runs on a helper thread and is given up after the
//! timeout, and a watchdog thread aborts the communicator (`ncclCommAbort`, which NCCL allows
//! from another thread and which makes its kernels in flight return) when a collective passes
//! its deadline or `ncclCommGetAsyncError` reports an error, or when an [`NcclAbort`]
//! handle says the job lost a member. `ncclCommAbort` frees the communicator, so every
//! abort goes through one flag: it is aborted once, never destroyed, and never used after.
//! The host never waits for a collective inside a step: the compute stream waits on an
//! event recorded after them.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::watchdog::{Deadlines, Verdict};
use crate::nccl::{unique_id_from_bytes, UNIQUE_ID_BYTES};
use crate::probe::{Library, MissingLibrary, Probe};
use tandem_dist::heartbeat::{running_collective, waiting_for_peers, PeerWait, RunningCollective};

/// NCCL's sum.
const SUM: ncclRedOp_t = ncclRedOp_t::ncclSum;

/// How often the watchdog looks at the pending collectives.
const WATCH_INTERVAL: Duration = Duration::from_millis(5);

/// What went wrong between the GPU ranks.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// libnccl (or the driver) was not found.
    #[error(transparent)]
    MissingLibrary(#[from] MissingLibrary),
    /// An NCCL call returned an error.
    #[error("NCCL: {call} failed: {status}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's status.
        status: String,
    },
    /// A CUDA driver call of the group failed.
    #[error("CUDA driver: {call} failed: {status:?}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's status.
        status: DriverError,
    },
    /// Not every rank joined the communicator in time.
    #[error(
        "ncclCommInitRank did not finish within {waited:?}: not every one of the {world_size} \
         ranks joined the NCCL communicator"
    )]
    JoinTimedOut {
        /// How long this rank waited.
        waited: Duration,
        /// The ranks expected.
        world_size: usize,
    },
    /// A collective did not finish in time; the communicator was aborted.
    #[error(
        "NCCL {what} did not finish within {waited:?} (--collective-timeout): a peer stopped \
         answering; the communicator was aborted"
    )]
    TimedOut {
        /// The collectives, in words.
        what: String,
        /// How long they had been waiting.
        waited: Duration,
    },
    /// NCCL or CUDA reported an error for a collective; the communicator was aborted.
    #[error("NCCL failed: {0}; the communicator was aborted")]
    Failed(String),
    /// A size that NCCL's `int` root or rank cannot hold, or a range outside a buffer.
    #[error("{0}")]
    Invalid(String),
}

impl From<&Verdict> for Option<CollectiveError> {
    fn from(verdict: &Verdict) -> Self {
        match verdict {
            Verdict::Healthy => None,
            Verdict::TimedOut { what, waited } => Some(CollectiveError::TimedOut {
                what: what.clone(),
                waited: *waited,
            }),
            Verdict::Failed(why) => Some(CollectiveError::Failed(why.clone())),
        }
    }
}

/// The communicator, shared by the group and its watchdog thread.
///
/// The owner's NCCL calls and the watchdog's abort exclude each other through `state`: a
/// call starts only on a communicator not aborted, and the watchdog aborts only between
/// calls, or during a call that has been blocked inside NCCL for [`BLOCKED_GRACE`] (NCCL's
/// documented way out of a call stuck on a dead peer, e.g. connecting at the first
/// collective), so the handle is never used after NCCL freed it.
struct Communicator {
    raw: ncclComm_t,
    state: Mutex<CallState>,
}

/// Whether the communicator was aborted, and the owner's NCCL call in progress.
#[derive(Default)]
struct CallState {
    aborted: bool,
    in_call: Option<(&'static str, Instant)>,
}

/// How long a call must have been inside NCCL before the watchdog aborts under it.
const BLOCKED_GRACE: Duration = Duration::from_millis(200);

// SAFETY: `ncclComm_t` is a pointer to NCCL's communicator. The owner's calls and the
// watchdog's `ncclCommAbort` are serialized by `state` except for a call blocked inside NCCL,
// which NCCL allows to be aborted from another thread; `ncclCommGetAsyncError` runs on the
// watchdog thread, which alone aborts, and NCCL allows it concurrently with the owner's calls
// (PyTorch's watchdog does the same).
unsafe impl Send for Communicator {}
// SAFETY: as above.
unsafe impl Sync for Communicator {}

/// Marks a collective as running and the process as waiting for its peers (the heartbeat's
/// activity, which the launcher reads) until dropped.
pub(crate) fn peer_wait() -> (RunningCollective, PeerWait) {
    (running_collective(), waiting_for_peers())
}

impl Communicator {
    fn state(&self) -> std::sync::MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs the owner's NCCL call `name` on the communicator, unless it was aborted.
    fn call<T>(
        &self,
        name: &'static str,
        call: impl FnOnce(ncclComm_t) -> Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        {
            let mut state = self.state();
            if state.aborted {
                return Err(CollectiveError::Failed(format!(
                    "{name} after the communicator was aborted"
                )));
            }
            state.in_call = Some((name, Instant::now()));
        }
        // A call may wait inside NCCL for the other ranks (an enqueue is quick on a GPU).
        let _waiting = peer_wait();
        let result = call(self.raw);
        self.state().in_call = None;
        result
    }

    /// The owner's call that has been inside NCCL for longer than `timeout` at `now`.
    fn blocked_call(&self, now: Instant, timeout: Duration) -> Option<(&'static str, Duration)> {
        let (name, since) = self.state().in_call?;
        let waited = now.saturating_duration_since(since);
        (waited >= timeout).then_some((name, waited))
    }

    /// Aborts the communicator unless a call has just entered NCCL (then the next look
    /// will); returns whether it is aborted.
    fn abort_when_safe(&self, now: Instant) -> bool {
        {
            let mut state = self.state();
            if state.aborted {
                return true;
            }
            if let Some((_, since)) = state.in_call {
                if now.saturating_duration_since(since) < BLOCKED_GRACE {
                    return false;
                }
            }
            state.aborted = true;
        }
        // Outside the lock: with captured graphs alive the abort blocks until the owner
        // destroys them, and an owner's call waiting for the lock would never get there.
        // SAFETY: `raw` came from a successful `ncclCommInitRank`; `aborted`, set under the
        // lock above, makes this the only abort, and no owner's call starts after it (a call
        // already inside NCCL is one NCCL allows an abort beside).
        let _ = unsafe { cudarc::nccl::result::comm_abort(self.raw) };
        true
    }

    /// Aborts the communicator unless it was aborted already, once no other thread uses it
    /// (the watchdog has stopped).
    fn abort_unused(&self) {
        let mut state = self.state();
        if !state.aborted {
            state.aborted = true;
            // SAFETY: `raw` came from a successful `ncclCommInitRank` and was not aborted
            // (`aborted`, checked and set under the lock, makes this the only abort); no
            // other thread calls NCCL on it any more, and none will after `aborted`.
            let _ = unsafe { cudarc::nccl::result::comm_abort(self.raw) };
        }
    }

    /// The communicator's asynchronous error, if it has one (called by the watchdog only).
    fn async_error(&self) -> Option<String> {
        if self.state().aborted {
            return None;
        }
        let mut status = ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator: only this (the watchdog's) thread aborts it
        // while the group lives, and it was not aborted; `status` is a valid out-pointer.
        let call = unsafe { cudarc::nccl::sys::ncclCommGetAsyncError(self.raw, &mut status) };
        match (call, status) {
            (ncclResult_t::ncclSuccess, ncclResult_t::ncclSuccess) => None,
            #[allow(unreachable_patterns)]
            (ncclResult_t::ncclSuccess, ncclResult_t::ncclInProgress) => None,
            (ncclResult_t::ncclSuccess, status) => {
                Some(format!("ncclCommGetAsyncError: {status:?}"))
            }
            (call, _) => Some(format!("ncclCommGetAsyncError itself failed: {call:?}")),
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for the peers, which may be gone.
        self.abort_unused();
    }
}

/// The watchdog's shared state: the pending collectives and whether to stop.
struct Watch {
    deadlines: Mutex<Deadlines<CudaEvent>>,
    stop: AtomicBool,
}

/// Aborts the communicator of an [`NcclGroup`] from any thread (the heartbeat's, when the
/// job lost a member): the group's verdict becomes the failure given, and its watchdog
/// aborts the communicator at its next look (as after a time-out), so that a collective
/// blocked on a lost peer returns and every later call of the group fails. It touches no
/// NCCL handle itself, and does nothing once the group is gone.
#[derive(Clone)]
pub struct NcclAbort {
    watch: Weak<Watch>,
}

impl NcclAbort {
    /// Fails the group with `why` (unless it failed already) and has it aborted.
    pub fn abort(&self, why: &str) {
        if let Some(watch) = self.watch.upgrade() {
            watch
                .deadlines
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .fail(why.to_string());
        }
    }
}

/// One rank's NCCL communicator, the stream its collectives run on, and its watchdog.
pub struct NcclGroup {
    rank: usize,
    world_size: usize,
    stream: Arc<CudaStream>,
    communicator: Arc<Communicator>,
    watch: Arc<Watch>,
    watchdog: Option<JoinHandle<()>>,
}

impl NcclGroup {
    /// Joins the communicator of `world_size` ranks as `rank` with rank 0's `unique_id`, on
    /// the GPU of `context` (the executor's), waiting at most `timeout` for the others; each
    /// later collective gets `timeout` to finish before the communicator is aborted.
    pub fn join(
        probe: &Probe,
        context: &Arc<CudaContext>,
        unique_id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        probe.require(Library::Driver)?;
        probe.require(Library::Nccl)?;
        let as_int = |what: &str, value: usize| {
            i32::try_from(value).map_err(|_| {
                CollectiveError::Invalid(format!("{what} {value} does not fit NCCL's int"))
            })
        };
        let (nranks, rank_int) = (as_int("world size", world_size)?, as_int("rank", rank)?);
        if rank >= world_size {
            return Err(CollectiveError::Invalid(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let stream = context.new_stream().map_err(driver("cuStreamCreate"))?;
        let id = unique_id_from_bytes(unique_id);
        let (sender, receiver) = mpsc::channel();
        let joining_context = Arc::clone(context);
        // The join blocks until every rank called it; a helper thread lets this one give up.
        std::thread::Builder::new()
            .name("nccl-join".into())
            .spawn(move || {
                let joined = joining_context
                    .bind_to_thread()
                    .map_err(driver("cuCtxSetCurrent"))
                    .and_then(|()| {
                        let mut raw = std::mem::MaybeUninit::<ncclComm_t>::uninit();
                        // SAFETY: `raw` is a valid out-pointer, `id` rank 0's id, and the
                        // context of the executor's GPU is current on this thread, so the
                        // communicator is made on that GPU.
                        unsafe {
                            cudarc::nccl::result::comm_init_rank(
                                raw.as_mut_ptr(),
                                nranks,
                                id,
                                rank_int,
                            )
                        }
                        .map_err(nccl("ncclCommInitRank"))?;
                        // SAFETY: initialized by the successful call above.
                        Ok(RawComm(unsafe { raw.assume_init() }))
                    });
                // Nobody waits any more (the join timed out): a communicator made after all
                // would leak, holding its GPU memory and network connections.
                if let Err(std::sync::mpsc::SendError(Ok(late))) = sender.send(joined) {
                    // SAFETY: `late.0` was made by ncclCommInitRank above and nothing else holds
                    // it.
                    let _ = unsafe { cudarc::nccl::result::comm_abort(late.0) };
                }
            })
            .map_err(|error| CollectiveError::Invalid(format!("cannot start a thread: {error}")))?;
        let raw = match receiver.recv_timeout(timeout) {
            Ok(joined) => joined?.0,
            Err(_) => {
                return Err(CollectiveError::JoinTimedOut {
                    waited: timeout,
                    world_size,
                })
            }
        };
        let communicator = Arc::new(Communicator {
            raw,
            state: Mutex::new(CallState::default()),
        });
        let watch = Arc::new(Watch {
            deadlines: Mutex::new(Deadlines::new(timeout)),
            stop: AtomicBool::new(false),
        });
        let watchdog = spawn_watchdog(
            Arc::clone(context),
            Arc::clone(&communicator),
            Arc::clone(&watch),
            timeout,
        )?;
        Ok(NcclGroup {
            rank,
            world_size,
            stream,
            communicator,
            watch,
            watchdog: Some(watchdog),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The stream the collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A handle that aborts this group's communicator from another thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort {
            watch: Arc::downgrade(&self.watch),
        }
    }

    /// The watchdog's verdict as an error: a collective that timed out or failed (the
    /// communicator is then aborted and every later collective is refused).
    pub fn check(&self) -> Result<(), CollectiveError> {
        match Option::<CollectiveError>::from(self.deadlines().verdict()) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Makes the group's stream wait for the work queued so far on `compute` (an event, no
    /// host wait).
    pub fn wait_for(&self, compute: &CudaStream) -> Result<(), CollectiveError> {
        self.check()?;
        let event = record(compute)?;
        self.stream
            .wait(&event)
            .map_err(driver("cuStreamWaitEvent"))?;
        // Inside a capture the event is kept until the capture ended; else dropped here.
        drop(self.deadlines().hold_while_capturing(event));
        Ok(())
    }

    /// Makes `compute` wait for the collectives queued so far on the group's stream, and
    /// gives them the timeout to finish (registered with the watchdog as `what`).
    pub fn hand_back(&self, compute: &CudaStream, what: String) -> Result<(), CollectiveError> {
        self.check()?;
        let event = record(&self.stream)?;
        compute.wait(&event).map_err(driver("cuStreamWaitEvent"))?;
        self.deadlines().register(event, what, Instant::now());
        Ok(())
    }

    /// Gives the work queued so far on `compute` (a whole training step, its collectives
    /// included) the timeout to finish: an event recorded there now, registered with the
    /// watchdog as `what`. This is what bounds a step whose collectives were captured in a
    /// CUDA graph, whose own events mark nothing when the graph is launched.
    pub fn watch(&self, compute: &CudaStream, what: String) -> Result<(), CollectiveError> {
        self.check()?;
        let event = record(compute)?;
        self.deadlines().register(event, what, Instant::now());
        Ok(())
    }

    /// Starts a stream capture of the compute stream (which this group's stream joins
    /// through [`NcclGroup::wait_for`] and leaves through [`NcclGroup::hand_back`]): until
    /// [`NcclGroup::end_capture`] the group's events are kept, not watched; querying one
    /// would invalidate the capture, and none marks anything when the graph runs.
    pub fn begin_capture(&self) {
        self.deadlines().begin_capture();
    }

    /// Ends the capture's bookkeeping once the stream capture has ended: the events recorded
    /// inside it are destroyed.
    pub fn end_capture(&self) {
        let held = self.deadlines().end_capture();
        drop(held);
    }

    /// Launches a CUDA graph holding this group's collectives through `launch`, unless the
    /// communicator was aborted: the graph's NCCL kernels address the communicator's
    /// resources, which the abort frees, and the abort waits while the launch is queued.
    pub fn launch_captured(
        &self,
        launch: impl FnOnce() -> Result<(), DriverError>,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        self.communicator.call("cuGraphLaunch", |_| {
            launch().map_err(driver("cuGraphLaunch"))
        })
    }

    /// The watchdog's deadlines.
    fn deadlines(&self) -> std::sync::MutexGuard<'_, Deadlines<CudaEvent>> {
        self.watch
            .deadlines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues the sum over the ranks of the floats `range` of the device buffer at `base`,
    /// in place, on the group's stream.
    ///
    /// # Safety
    /// `base` must address a device float buffer of the group's GPU holding at least
    /// `range.end` values, alive until the group's stream has run the collective.
    pub unsafe fn all_reduce_sum(
        &self,
        base: u64,
        range: Range<usize>,
    ) -> Result<(), CollectiveError> {
        let pointer = float_at(base, range.start);
        // SAFETY: the caller's contract, for `range.len()` floats from `pointer`.
        unsafe { self.all_reduce_of(pointer, range.len(), ncclDataType_t::ncclFloat32, SUM) }
    }

    /// Queues the sum over the ranks of the first `len` doubles of the device buffer at
    /// `base` (SyncBatchNorm's column totals), in place, on the group's stream.
    ///
    /// # Safety
    /// `base` must address a device buffer of doubles of the group's GPU holding at least
    /// `len` values, alive until the group's stream has run the collective.
    pub unsafe fn all_reduce_sum_f64(&self, base: u64, len: usize) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract.
        unsafe { self.all_reduce_of(base, len, ncclDataType_t::ncclFloat64, SUM) }
    }

    /// Queues the maximum over the ranks of the first `len` int32s of the device buffer at
    /// `base` (the exact sum's block keys: NCCL's integer maximum, which keeps a NaN's bits
    /// where a float maximum need not), in place, on the group's stream.
    ///
    /// # Safety
    /// `base` must address a device buffer of int32s of the group's GPU holding at least
    /// `len` values, alive until the group's stream has run the collective.
    pub unsafe fn all_reduce_max_i32(&self, base: u64, len: usize) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract.
        unsafe { self.all_reduce_of(base, len, ncclDataType_t::ncclInt32, ncclRedOp_t::ncclMax) }
    }

    /// Queues the sum over the ranks of the first `len` int64s of the device buffer at `base`
    /// (the exact sum's integers: exact in any order, wrapping on overflow), in place, on the
    /// group's stream.
    ///
    /// # Safety
    /// `base` must address a device buffer of int64s of the group's GPU holding at least
    /// `len` values, alive until the group's stream has run the collective.
    pub unsafe fn all_reduce_sum_i64(&self, base: u64, len: usize) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract.
        unsafe { self.all_reduce_of(base, len, ncclDataType_t::ncclInt64, SUM) }
    }

    /// `ncclAllReduce` (`op`, in place) of `len` values of `data_type` from `pointer`.
    ///
    /// # Safety
    /// `pointer` must address `len` values of `data_type` in a device buffer of the group's
    /// GPU, alive until the group's stream has run the collective.
    unsafe fn all_reduce_of(
        &self,
        pointer: u64,
        len: usize,
        data_type: ncclDataType_t,
        op: ncclRedOp_t,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if len == 0 {
            return Ok(());
        }
        let stream = self.stream.cu_stream();
        self.communicator.call("ncclAllReduce", |comm| {
            // SAFETY: the caller's contract: `len` values of `data_type` at `pointer`; in
            // place (send = receive) is allowed by NCCL; the stream is the group's, on the
            // group's GPU; `comm` is live (not aborted, checked by `call`).
            unsafe {
                cudarc::nccl::result::all_reduce(
                    pointer as *const std::ffi::c_void,
                    pointer as *mut std::ffi::c_void,
                    len,
                    data_type,
                    op,
                    comm,
                    stream as _,
                )
            }
            .map_err(nccl("ncclAllReduce"))
        })?;
        Ok(())
    }

    /// Queues rank 0's `len` floats of the device buffer at `base` into every rank's, in
    /// place, on the group's stream.
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce_sum`], for `0..len`.
    pub unsafe fn broadcast_from_rank0(
        &self,
        base: u64,
        len: usize,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if len == 0 {
            return Ok(());
        }
        let stream = self.stream.cu_stream();
        self.communicator.call("ncclBroadcast", |comm| {
            // SAFETY: the caller's contract; in place broadcast (send = receive) is allowed;
            // `comm` is live (not aborted, checked by `call`).
            unsafe {
                cudarc::nccl::result::broadcast(
                    base as *const std::ffi::c_void,
                    base as *mut std::ffi::c_void,
                    len,
                    ncclDataType_t::ncclFloat32,
                    0,
                    comm,
                    stream as _,
                )
            }
            .map_err(nccl("ncclBroadcast"))
        })?;
        Ok(())
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.watch.stop.store(true, Ordering::SeqCst);
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        // Before the stream goes: collectives blocked on a lost peer return.
        self.communicator.abort_unused();
    }
}

/// A communicator handed from the join thread.
struct RawComm(ncclComm_t);

// SAFETY: the communicator is handed over once, from the thread that made it to the one that
// uses it; nothing else holds it.
unsafe impl Send for RawComm {}

/// Starts the watchdog: every [`WATCH_INTERVAL`] it asks the communicator for an asynchronous
/// error, looks for an owner's call blocked inside NCCL past `timeout`, and queries the oldest
/// pending events; on a timeout or failure it aborts the communicator (so NCCL's kernels and
/// calls return and the streams waiting on them go on).
fn spawn_watchdog(
    context: Arc<CudaContext>,
    communicator: Arc<Communicator>,
    watch: Arc<Watch>,
    timeout: Duration,
) -> Result<JoinHandle<()>, CollectiveError> {
    std::thread::Builder::new()
        .name("nccl-watchdog".into())
        .spawn(move || {
            let _ = context.bind_to_thread();
            while !watch.stop.load(Ordering::SeqCst) {
                let now = Instant::now();
                let async_error = communicator.async_error();
                let blocked = communicator.blocked_call(now, timeout);
                let mut deadlines = watch
                    .deadlines
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some((call, waited)) = blocked {
                    deadlines.time_out(format!("{call} (blocked inside NCCL)"), waited);
                }
                let verdict = deadlines.poll(now, async_error, |event| {
                    event
                        .try_is_complete()
                        .map_err(|status| format!("cuEventQuery: {status:?}"))
                });
                let failed = *verdict != Verdict::Healthy;
                drop(deadlines);
                if failed && communicator.abort_when_safe(Instant::now()) {
                    return;
                }
                std::thread::sleep(WATCH_INTERVAL);
            }
        })
        .map_err(|error| {
            CollectiveError::Invalid(format!("cannot start the NCCL watchdog: {error}"))
        })
}

/// An event recorded on `stream` (no timing).
fn record(stream: &CudaStream) -> Result<CudaEvent, CollectiveError> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(driver("cuEventRecord"))
}

/// The address of float `offset` of a buffer at `base`.
fn float_at(base: u64, offset: usize) -> u64 {
    base + (offset * std::mem::size_of::<f32>()) as u64
}

fn driver(call: &'static str) -> impl Fn(DriverError) -> CollectiveError {
    move |status| CollectiveError::Driver { call, status }
}

fn nccl(call: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> CollectiveError {
    move |error| CollectiveError::Nccl {
        call,
        status: format!("{:?}", error.0),
    }
}
