//! The collective watchdog's state machine, without CUDA: collectives waiting to finish,
//! each with a deadline, and the verdict of one look at them.
//!
//! NCCL waits forever for a peer that stopped answering. So each batch of collectives the
//! group enqueues is registered here with the moment it must have finished by; a watchdog
//! thread looks at the oldest every few milliseconds (through a query function: on the GPU,
//! `cuEventQuery` of an event recorded after the collectives, and `ncclCommGetAsyncError`),
//! and on [`Verdict::TimedOut`] or [`Verdict::Failed`] the communicator is aborted. The
//! verdict sticks: after a failure every later look returns it again.
//!
//! Inside a stream capture (a training step recorded as a CUDA graph) the events the group
//! records mark nothing when the graph is later launched, and querying one would invalidate
//! the capture; so between [`Deadlines::begin_capture`] and [`Deadlines::end_capture`]
//! registered markers are only held (kept alive until the capture ended) and never looked at.
//! A captured step is bounded instead by one marker recorded after each launch of its graph
//! and registered like any other.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What one look at the pending collectives found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is pending, or everything pending is within its deadline.
    Healthy,
    /// The oldest pending collective passed its deadline.
    TimedOut {
        /// What it was, e.g. `all-reduce of gradient buckets 0-3`.
        what: String,
        /// How long it had been waiting.
        waited: Duration,
    },
    /// The communicator or a query reported an error.
    Failed(String),
}

/// One registered batch of collectives.
#[derive(Debug)]
struct Pending<T> {
    marker: T,
    what: String,
    started: Instant,
    deadline: Instant,
}

/// The pending collectives, oldest first, with markers of type `T` (an event on the GPU).
#[derive(Debug)]
pub struct Deadlines<T> {
    timeout: Duration,
    pending: VecDeque<Pending<T>>,
    verdict: Verdict,
    /// `Some` during a stream capture: the markers recorded inside it.
    captured: Option<Vec<T>>,
}

impl<T> Deadlines<T> {
    /// Nothing pending; each registered collective gets `timeout` to finish.
    pub fn new(timeout: Duration) -> Self {
        Deadlines {
            timeout,
            pending: VecDeque::new(),
            verdict: Verdict::Healthy,
            captured: None,
        }
    }

    /// Registers a collective enqueued at `now`, to finish by `now + timeout`; during a
    /// capture the marker is only held (see the module's documentation).
    pub fn register(&mut self, marker: T, what: String, now: Instant) {
        if let Some(captured) = self.captured.as_mut() {
            captured.push(marker);
            return;
        }
        self.pending.push_back(Pending {
            marker,
            what,
            started: now,
            deadline: now + self.timeout,
        });
    }

    /// Keeps `marker` (an event that ordered the group's stream after the compute stream) until
    /// the capture ends, when one is in progress; else hands it back, for the caller to drop.
    pub fn hold_while_capturing(&mut self, marker: T) -> Option<T> {
        match self.captured.as_mut() {
            Some(captured) => {
                captured.push(marker);
                None
            }
            None => Some(marker),
        }
    }

    /// Starts a stream capture: markers registered from now on are held, not watched.
    pub fn begin_capture(&mut self) {
        self.captured.get_or_insert_with(Vec::new);
    }

    /// Ends the capture: returns the markers held during it (to be dropped once the capture
    /// has ended on the device side); registrations are watched again.
    pub fn end_capture(&mut self) -> Vec<T> {
        self.captured.take().unwrap_or_default()
    }

    /// Whether a capture is in progress.
    pub fn capturing(&self) -> bool {
        self.captured.is_some()
    }

    /// The number of collectives not yet seen finished.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The verdict of the last look.
    pub fn verdict(&self) -> &Verdict {
        &self.verdict
    }

    /// Records a time-out found outside the pending list (a call blocked inside NCCL), unless
    /// an earlier verdict stands.
    pub fn time_out(&mut self, what: String, waited: Duration) {
        if self.verdict == Verdict::Healthy {
            self.verdict = Verdict::TimedOut { what, waited };
        }
    }

    /// Records a failure found outside the pending list (the job lost a member, so the
    /// communicator is to be aborted), unless an earlier verdict stands.
    pub fn fail(&mut self, why: String) {
        if self.verdict == Verdict::Healthy {
            self.verdict = Verdict::Failed(why);
        }
    }

    /// Looks at the pending collectives at `now`: `async_error` is the communicator's own
    /// error, if it reported one; `finished` says whether a marker's work is done (or why it
    /// cannot say). Finished ones are dropped, oldest first; the first failure sticks.
    pub fn poll(
        &mut self,
        now: Instant,
        async_error: Option<String>,
        mut finished: impl FnMut(&T) -> Result<bool, String>,
    ) -> &Verdict {
        if self.verdict != Verdict::Healthy {
            return &self.verdict;
        }
        if let Some(error) = async_error {
            self.verdict = Verdict::Failed(error);
            return &self.verdict;
        }
        while let Some(oldest) = self.pending.front() {
            match finished(&oldest.marker) {
                Ok(true) => {
                    self.pending.pop_front();
                }
                Ok(false) if now >= oldest.deadline => {
                    self.verdict = Verdict::TimedOut {
                        what: oldest.what.clone(),
                        waited: now.saturating_duration_since(oldest.started),
                    };
                    break;
                }
                Ok(false) => break,
                Err(error) => {
                    self.verdict = Verdict::Failed(format!("{}: {error}", oldest.what));
                    break;
                }
            }
        }
        &self.verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Now, a second, and deadlines of ten seconds.
    fn ten_second_deadlines<T>() -> (Instant, Duration, Deadlines<T>) {
        let second = Duration::from_secs(1);
        (Instant::now(), second, Deadlines::new(10 * second))
    }

    #[test]
    fn finished_collectives_leave_and_a_late_one_times_out() {
        let (start, second, mut deadlines) = ten_second_deadlines();
        deadlines.register(1, "all-reduce of gradient buckets 0-2".into(), start);
        deadlines.register(2, "broadcast of the BN buffers".into(), start + second);
        let mut done: HashSet<i32> = HashSet::new();
        // Nothing finished, within the deadline.
        assert_eq!(
            deadlines.poll(start + 5 * second, None, |marker| Ok(done.contains(marker))),
            &Verdict::Healthy
        );
        assert_eq!(deadlines.pending(), 2);
        // The second finishing first does not remove it before the first (FIFO, as one stream).
        done.insert(2);
        deadlines.poll(start + 6 * second, None, |marker| Ok(done.contains(marker)));
        assert_eq!(deadlines.pending(), 2);
        done.insert(1);
        assert_eq!(
            deadlines.poll(start + 7 * second, None, |marker| Ok(done.contains(marker))),
            &Verdict::Healthy
        );
        assert_eq!(deadlines.pending(), 0);
        // A third that never finishes: healthy until its deadline, then timed out, for good.
        deadlines.register(
            3,
            "all-reduce of gradient buckets 0-2".into(),
            start + 8 * second,
        );
        assert_eq!(
            deadlines.poll(
                start + 17 * second,
                None,
                |marker| Ok(done.contains(marker))
            ),
            &Verdict::Healthy
        );
        let timed_out = Verdict::TimedOut {
            what: "all-reduce of gradient buckets 0-2".into(),
            waited: 10 * second,
        };
        assert_eq!(
            deadlines.poll(
                start + 18 * second,
                None,
                |marker| Ok(done.contains(marker))
            ),
            &timed_out
        );
        done.insert(3);
        assert_eq!(
            deadlines.poll(
                start + 19 * second,
                None,
                |marker| Ok(done.contains(marker))
            ),
            &timed_out,
            "the verdict sticks even if the work finishes after the abort"
        );
    }

    #[test]
    fn an_async_error_or_a_failed_query_is_a_failure() {
        let start = Instant::now();
        let mut deadlines = Deadlines::new(Duration::from_secs(10));
        deadlines.register((), "broadcast of the parameters".into(), start);
        assert_eq!(
            deadlines.poll(start, Some("ncclRemoteError".into()), |_| Ok(false)),
            &Verdict::Failed("ncclRemoteError".into())
        );
        let mut deadlines = Deadlines::new(Duration::from_secs(10));
        deadlines.register((), "broadcast of the parameters".into(), start);
        assert_eq!(
            deadlines.poll(start, None, |_| Err("CUDA_ERROR_LAUNCH_FAILED".into())),
            &Verdict::Failed("broadcast of the parameters: CUDA_ERROR_LAUNCH_FAILED".into())
        );
        let failed =
            Verdict::Failed("broadcast of the parameters: CUDA_ERROR_LAUNCH_FAILED".into());
        assert_eq!(deadlines.verdict(), &failed);
        // A later time-out does not replace the first verdict.
        deadlines.time_out(
            "ncclAllReduce (blocked inside NCCL)".into(),
            Duration::from_secs(11),
        );
        assert_eq!(deadlines.verdict(), &failed);
    }

    #[test]
    fn markers_of_a_capture_are_held_unwatched_and_each_launch_gets_a_deadline() {
        let (start, second, mut deadlines) = ten_second_deadlines();
        // An eager step before the capture: its hand-back is watched.
        deadlines.register(1, "all-reduce of the gradients (3 buckets)".into(), start);
        assert_eq!(deadlines.hold_while_capturing(100), Some(100));
        deadlines.begin_capture();
        assert!(deadlines.capturing());
        assert_eq!(deadlines.hold_while_capturing(101), None);
        deadlines.register(2, "all-reduce of the gradients (3 buckets)".into(), start);
        assert_eq!(deadlines.pending(), 1, "nothing of the capture is pending");
        // The watchdog looks meanwhile: only the eager marker is queried, never a captured one.
        let mut queried = Vec::new();
        let verdict = deadlines
            .poll(start + second, None, |marker| {
                queried.push(*marker);
                Ok(true)
            })
            .clone();
        assert_eq!(verdict, Verdict::Healthy);
        assert_eq!(queried, vec![1]);
        assert_eq!(deadlines.end_capture(), vec![101, 2]);
        assert!(!deadlines.capturing());
        assert_eq!(deadlines.end_capture(), Vec::<i32>::new());
        // Each launch of the graph registers one marker after the whole step.
        let step = "all-reduce of the gradients inside a training step's CUDA graph";
        deadlines.register(3, step.into(), start + 2 * second);
        deadlines.register(4, step.into(), start + 3 * second);
        assert_eq!(deadlines.pending(), 2);
        assert_eq!(
            deadlines.poll(start + 4 * second, None, |marker| Ok(*marker == 3)),
            &Verdict::Healthy
        );
        assert_eq!(deadlines.pending(), 1);
        // The second launch never finishes (a dead peer inside the graph): timed out, named.
        assert_eq!(
            deadlines.poll(start + 13 * second, None, |_| Ok(false)),
            &Verdict::TimedOut {
                what: step.into(),
                waited: 10 * second,
            }
        );
    }

    #[test]
    fn a_failure_from_outside_sticks_and_does_not_replace_an_earlier_verdict() {
        let mut deadlines: Deadlines<()> = Deadlines::new(Duration::from_secs(10));
        deadlines.fail("a member was lost".into());
        deadlines.fail("a later reason".into());
        assert_eq!(
            deadlines.poll(Instant::now(), None, |_| Ok(true)),
            &Verdict::Failed("a member was lost".into())
        );
        let mut timed_out: Deadlines<()> = Deadlines::new(Duration::from_secs(10));
        timed_out.time_out(
            "ncclAllReduce (blocked inside NCCL)".into(),
            Duration::from_secs(10),
        );
        timed_out.fail("a member was lost".into());
        assert_eq!(
            timed_out.verdict(),
            &Verdict::TimedOut {
                what: "ncclAllReduce (blocked inside NCCL)".into(),
                waited: Duration::from_secs(10),
            }
        );
    }

    #[test]
    fn a_blocked_call_times_out_a_healthy_group() {
        let mut deadlines: Deadlines<()> = Deadlines::new(Duration::from_secs(10));
        deadlines.time_out(
            "ncclBroadcast (blocked inside NCCL)".into(),
            Duration::from_secs(10),
        );
        assert_eq!(
            deadlines.poll(Instant::now(), None, |_| Ok(true)),
            &Verdict::TimedOut {
                what: "ncclBroadcast (blocked inside NCCL)".into(),
                waited: Duration::from_secs(10),
            }
        );
    }
}
