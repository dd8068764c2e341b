//! The collective watchdog's state machine, without CUDA: collectives waiting to finish,
//! each with a deadline, and the verdict of one look at them.
//!
//! NCCL waits forever for a peer that stopped answering. So each batch of collectives the
//! group enqueues is registered here with the moment it must have finished by; a watchdog
//! thread looks at the oldest every few milliseconds (through a query function: on the GPU,
//! `cuEventQuery` of an event recorded after the collectives, and `ncclCommGetAsyncError`),
//! and on [`Verdict::TimedOut`] or [`Verdict::Failed`] the communicator is aborted. The
//! verdict sticks: after a failure every later look returns it again.

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
}

impl<T> Deadlines<T> {
    /// Nothing pending; each registered collective gets `timeout` to finish.
    pub fn new(timeout: Duration) -> Self {
        Deadlines {
            timeout,
            pending: VecDeque::new(),
            verdict: Verdict::Healthy,
        }
    }

    /// Registers a collective enqueued at `now`, to finish by `now + timeout`.
    pub fn register(&mut self, marker: T, what: String, now: Instant) {
        self.pending.push_back(Pending {
            marker,
            what,
            started: now,
            deadline: now + self.timeout,
        });
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

    #[test]
    fn finished_collectives_leave_and_a_late_one_times_out() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut deadlines = Deadlines::new(10 * second);
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
