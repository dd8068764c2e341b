//! Workers that hang while their heartbeat thread still beats.
//!
//! A worker's heartbeat comes from a thread of its own, so a worker whose training thread
//! hangs (a deadlock, a read that never returns) keeps beating while its peers wait for it
//! in a collective until the collective timeout. Each worker also writes its
//! [`Activity`] at every beat: how long it has waited for its peers, and its CPU time. A
//! worker is stalled when a peer has waited for more than the heartbeat timeout while it, over
//! that same time, waited for nobody, read or wrote no files, and used almost no CPU: a slow
//! worker computes, a waiting one waits, and only a hung one does neither.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tandem_dist::heartbeat::Activity;

/// The share of one core below which a worker counts as idle.
const IDLE_CPU_SHARE: f64 = 0.05;

/// The activity of each worker of a node over the last heartbeat timeout.
pub struct Stalls {
    timeout: Duration,
    /// Per worker: its activities, oldest first, with when they were read.
    seen: Vec<VecDeque<(Instant, Activity)>>,
}

/// A worker found stalled, and who waited for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    /// The stalled worker's index.
    pub index: usize,
    /// How long it was seen idle.
    pub idle: Duration,
    /// The index of the worker that waited longest.
    pub waiting_index: usize,
    /// How long that worker had waited.
    pub waited: Duration,
}

impl Stalls {
    /// The activities of `workers` workers, judged over `timeout`.
    pub fn new(workers: usize, timeout: Duration) -> Stalls {
        Stalls {
            timeout,
            seen: vec![VecDeque::new(); workers],
        }
    }

    /// Tracks `count` more workers.
    pub fn grow(&mut self, count: usize) {
        self.seen
            .extend(std::iter::repeat_with(VecDeque::new).take(count));
    }

    /// Records the activity of worker `index` read at `at`; `None` forgets it (a worker that
    /// wrote none yet, or ended).
    pub fn observe(&mut self, index: usize, at: Instant, activity: Option<Activity>) {
        let Some(seen) = self.seen.get_mut(index) else {
            return;
        };
        let Some(activity) = activity else {
            seen.clear();
            return;
        };
        seen.push_back((at, activity));
        // Keep one reading at least a timeout old, as the start of the window.
        while seen
            .get(1)
            .is_some_and(|(read, _)| at.saturating_duration_since(*read) >= self.timeout)
        {
            seen.pop_front();
        }
    }

    /// The stalled workers among those that are `live`, and the peer that waited for each.
    pub fn stalled(&self, live: &[bool]) -> Vec<Stall> {
        let latest = |index: usize| self.seen[index].back().map(|(_, activity)| *activity);
        let waiting = (0..self.seen.len())
            .filter(|&index| live.get(index).copied().unwrap_or(false))
            .filter_map(|index| latest(index).map(|activity| (index, activity.waiting_ms)))
            .max_by_key(|&(_, waited)| waited);
        let Some((waiting_index, waited_ms)) = waiting else {
            return Vec::new();
        };
        let waited = Duration::from_millis(waited_ms);
        if waited <= self.timeout {
            return Vec::new();
        }
        (0..self.seen.len())
            .filter(|&index| live.get(index).copied().unwrap_or(false))
            .filter_map(|index| self.idle_for(index))
            .map(|(index, idle)| Stall {
                index,
                idle,
                waiting_index,
                waited,
            })
            .collect()
    }

    /// How long worker `index` has been idle, when it was for the whole timeout: no wait, no
    /// file work, almost no CPU.
    fn idle_for(&self, index: usize) -> Option<(usize, Duration)> {
        let seen = &self.seen[index];
        let (first_read, first) = seen.front()?;
        let (last_read, last) = seen.back()?;
        let span = last_read.saturating_duration_since(*first_read);
        if span < self.timeout {
            return None;
        }
        if seen
            .iter()
            .any(|(_, activity)| activity.waiting_ms > 0 || activity.in_io)
        {
            return None;
        }
        let cpu = last.cpu_ms.saturating_sub(first.cpu_ms);
        let idle = (cpu as f64) < span.as_millis() as f64 * IDLE_CPU_SHARE;
        idle.then_some((index, span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(waiting_ms: u64, cpu_ms: u64) -> Option<Activity> {
        Some(Activity {
            waiting_ms,
            cpu_ms,
            in_io: false,
        })
    }

    /// Two workers read every 100 ms for 1.5 s: worker 0 waits all along, worker 1 does what
    /// `second` says at reading `tick`.
    fn judge(second: impl Fn(u64) -> Option<Activity>) -> Vec<Stall> {
        let mut stalls = Stalls::new(2, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, activity(tick * 100 + 50, 1000));
            stalls.observe(1, at, second(tick));
        }
        stalls.stalled(&[true, true])
    }

    #[test]
    fn a_worker_idle_while_a_peer_waits_past_the_timeout_is_stalled() {
        let stalls = judge(|_| activity(0, 500));
        assert_eq!(stalls.len(), 1);
        let stall = stalls[0];
        assert_eq!((stall.index, stall.waiting_index), (1, 0));
        assert_eq!(stall.waited, Duration::from_millis(1550));
        assert!(stall.idle >= Duration::from_secs(1), "{stall:?}");
    }

    #[test]
    fn a_slow_worker_that_computes_is_not_stalled() {
        assert_eq!(judge(|tick| activity(0, 500 + tick * 90)), Vec::new());
    }

    #[test]
    fn a_worker_that_waits_or_writes_files_is_not_stalled() {
        assert_eq!(
            judge(|tick| activity(u64::from(tick == 12) * 30, 500)),
            Vec::new()
        );
        let writing = |_| {
            Some(Activity {
                waiting_ms: 0,
                cpu_ms: 500,
                in_io: true,
            })
        };
        assert_eq!(judge(writing), Vec::new());
    }

    #[test]
    fn nobody_is_stalled_while_the_longest_wait_is_within_the_timeout() {
        let mut stalls = Stalls::new(2, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, activity(900, 1000));
            stalls.observe(1, at, activity(0, 500));
        }
        assert_eq!(stalls.stalled(&[true, true]), Vec::new());
        assert_eq!(stalls.stalled(&[false, true]), Vec::new());
    }
}
