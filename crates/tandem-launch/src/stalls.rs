//! Workers that hang while their heartbeat thread still beats.
//!
//! A worker's heartbeat comes from a thread of its own, so a worker whose training thread
//! hangs (a deadlock, a read that never returns) keeps beating while its peers wait for it
//! in a collective until the collective timeout. Each worker also writes its
//! [`Activity`] at every beat: how long it has waited for its peers, and its CPU time. A
//! worker is stalled when a peer, on this node or another, has waited for more than the
//! heartbeat timeout while it, over that same time, waited for nobody, read or wrote no
//! files, and used almost no CPU: a slow worker computes, a waiting one waits, and only a
//! hung one does neither.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use tandem_dist::heartbeat::{Activity, HEARTBEAT_INTERVAL};

/// The share of one core below which a worker counts as idle.
const IDLE_CPU_SHARE: f64 = 0.05;

/// How long another node's rank counts as waiting after its activity last changed: a
/// waiting rank's record changes at every beat, so one that stays the same belongs to a
/// rank that stopped beating (ended, lost, stopped) and waits for nobody any more.
const REMOTE_FRESHNESS: Duration = HEARTBEAT_INTERVAL.saturating_mul(5);

/// The activity of each worker of a node over the last heartbeat timeout, and the latest
/// activity of the other nodes' ranks.
pub struct Stalls {
    timeout: Duration,
    /// Per worker: its activities, oldest first, with when they were read.
    seen: Vec<VecDeque<(Instant, Activity)>>,
    /// Per rank of another node: its latest activity.
    remote: BTreeMap<usize, RemoteActivity>,
}

/// The latest activity read of another node's rank.
struct RemoteActivity {
    node: usize,
    activity: Activity,
    /// When a read last found it changed; `None` while no read did.
    changed_at: Option<Instant>,
}

/// Who waited for a stalled worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiter {
    /// The worker of this index, on this node.
    Local(usize),
    /// The rank `rank` of node `node`.
    Remote {
        /// Its rank.
        rank: usize,
        /// Its node's `--node-rank`.
        node: usize,
    },
}

/// A worker found stalled, and who waited for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    /// The stalled worker's index.
    pub index: usize,
    /// How long it was seen idle.
    pub idle: Duration,
    /// The worker that waited longest.
    pub waiting: Waiter,
    /// How long that worker had waited.
    pub waited: Duration,
}

impl Stalls {
    /// The activities of `workers` workers, judged over `timeout`.
    pub fn new(workers: usize, timeout: Duration) -> Stalls {
        Stalls {
            timeout,
            seen: vec![VecDeque::new(); workers],
            remote: BTreeMap::new(),
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

    /// Records the activity of rank `rank` of node `node` (another node) read at `at`;
    /// `None` forgets it.
    pub fn observe_remote(
        &mut self,
        rank: usize,
        node: usize,
        at: Instant,
        activity: Option<Activity>,
    ) {
        let Some(activity) = activity else {
            self.remote.remove(&rank);
            return;
        };
        let changed_at = match self.remote.get(&rank) {
            Some(last) if last.node == node && last.activity == activity => last.changed_at,
            Some(last) if last.node == node => Some(at),
            _ => None,
        };
        let seen = RemoteActivity {
            node,
            activity,
            changed_at,
        };
        self.remote.insert(rank, seen);
    }

    /// Forgets the activities of the other nodes' ranks.
    pub fn forget_remote(&mut self) {
        self.remote.clear();
    }

    /// Forgets every activity seen: after a cut off the store, the last ones read are stale,
    /// and a worker that could write none would look idle.
    pub fn forget_all(&mut self) {
        self.seen.iter_mut().for_each(VecDeque::clear);
        self.remote.clear();
    }

    /// Whether one of the `live` workers has been idle for the whole timeout, so that only
    /// a peer's wait is missing to find it stalled.
    pub fn any_idle(&self, live: &[bool]) -> bool {
        (0..self.seen.len())
            .filter(|&index| live.get(index).copied().unwrap_or(false))
            .any(|index| self.idle_for(index).is_some())
    }

    /// The stalled workers among those that are `live`, and the peer that waited for each,
    /// judged at `at`.
    pub fn stalled(&self, live: &[bool], at: Instant) -> Vec<Stall> {
        let Some((waiting, waited)) = self.longest_wait(live, at) else {
            return Vec::new();
        };
        if waited <= self.timeout {
            return Vec::new();
        }
        (0..self.seen.len())
            .filter(|&index| live.get(index).copied().unwrap_or(false))
            .filter_map(|index| self.idle_for(index))
            .map(|(index, idle)| Stall {
                index,
                idle,
                waiting,
                waited,
            })
            .collect()
    }

    /// The longest wait for peers among the `live` workers and the other nodes' ranks that
    /// still beat at `at`.
    fn longest_wait(&self, live: &[bool], at: Instant) -> Option<(Waiter, Duration)> {
        let local = (0..self.seen.len())
            .filter(|&index| live.get(index).copied().unwrap_or(false))
            .filter_map(|index| {
                let (_, activity) = self.seen[index].back()?;
                Some((Waiter::Local(index), activity.waiting_ms))
            });
        let remote = self
            .remote
            .iter()
            .filter(|(_, seen)| {
                seen.changed_at.is_some_and(|changed| {
                    at.saturating_duration_since(changed) <= REMOTE_FRESHNESS
                })
            })
            .map(|(&rank, seen)| {
                let waiter = Waiter::Remote {
                    rank,
                    node: seen.node,
                };
                (waiter, seen.activity.waiting_ms)
            });
        local
            .chain(remote)
            .max_by_key(|&(_, waited)| waited)
            .map(|(waiter, waited_ms)| (waiter, Duration::from_millis(waited_ms)))
    }

    /// How long worker `index` has been idle, when it was for the whole timeout: no wait, no
    /// file work, almost no CPU. An activity that was not written again says nothing: the
    /// worker's heartbeat did not reach the store, and its silence is judged by the beats.
    fn idle_for(&self, index: usize) -> Option<(usize, Duration)> {
        let seen = &self.seen[index];
        let (first_read, first) = seen.front()?;
        let (last_read, last) = seen.back()?;
        let span = last_read.saturating_duration_since(*first_read);
        if span < self.timeout || last.written <= first.written {
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
            written: 0,
        })
    }

    /// `activity` as written at reading `tick`.
    fn written_at(tick: u64, activity: Option<Activity>) -> Option<Activity> {
        activity.map(|activity| Activity {
            written: tick,
            ..activity
        })
    }

    /// Two workers read every 100 ms for 1.5 s: worker 0 waits all along, worker 1 does what
    /// `second` says at reading `tick`.
    fn judge(second: impl Fn(u64) -> Option<Activity>) -> Vec<Stall> {
        let mut stalls = Stalls::new(2, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, written_at(tick, activity(tick * 100 + 50, 1000)));
            stalls.observe(1, at, written_at(tick, second(tick)));
        }
        stalls.stalled(&[true, true], start + Duration::from_millis(1500))
    }

    /// One local worker doing what `local` says and rank 0 of node 0 doing what `remote`
    /// says, both read every 100 ms for 1.5 s.
    fn judge_with_remote(
        local: impl Fn(u64) -> Option<Activity>,
        remote: impl Fn(u64) -> Option<Activity>,
    ) -> Vec<Stall> {
        let mut stalls = Stalls::new(1, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, written_at(tick, local(tick)));
            stalls.observe_remote(0, 0, at, remote(tick));
        }
        stalls.stalled(&[true], start + Duration::from_millis(1500))
    }

    #[test]
    fn a_worker_idle_while_a_peer_waits_past_the_timeout_is_stalled() {
        let stalls = judge(|_| activity(0, 500));
        assert_eq!(stalls.len(), 1);
        let stall = stalls[0];
        assert_eq!((stall.index, stall.waiting), (1, Waiter::Local(0)));
        assert_eq!(stall.waited, Duration::from_millis(1550));
        assert!(stall.idle >= Duration::from_secs(1), "{stall:?}");
    }

    #[test]
    fn a_worker_whose_activity_was_not_written_again_is_not_stalled() {
        let mut stalls = Stalls::new(2, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, written_at(tick, activity(tick * 100 + 50, 1000)));
            // Its heartbeat reaches no store: the same activity is read again and again.
            stalls.observe(1, at, activity(0, 500));
        }
        let stalled = stalls.stalled(&[true, true], start + Duration::from_millis(1500));
        assert_eq!(stalled, Vec::new());
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
                written: 0,
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
        let at = start + Duration::from_millis(1500);
        assert_eq!(stalls.stalled(&[true, true], at), Vec::new());
        assert_eq!(stalls.stalled(&[false, true], at), Vec::new());
    }

    #[test]
    fn a_worker_idle_while_another_nodes_rank_waits_past_the_timeout_is_stalled() {
        let stalls =
            judge_with_remote(|_| activity(0, 500), |tick| activity(tick * 100 + 50, 1000));
        assert_eq!(stalls.len(), 1);
        let stall = stalls[0];
        assert_eq!(stall.index, 0);
        assert_eq!(stall.waiting, Waiter::Remote { rank: 0, node: 0 });
        assert_eq!(stall.waited, Duration::from_millis(1550));
        assert!(stall.idle >= Duration::from_secs(1), "{stall:?}");
    }

    #[test]
    fn a_busy_worker_is_not_stalled_while_another_nodes_rank_waits() {
        let stalls = judge_with_remote(
            |tick| activity(0, 500 + tick * 90),
            |tick| activity(tick * 100 + 50, 1000),
        );
        assert_eq!(stalls, Vec::new());
    }

    #[test]
    fn another_nodes_rank_whose_activity_stopped_changing_waits_for_nobody() {
        // Its record stays as it was when it stopped beating (ended, lost).
        let stalled = judge_with_remote(|_| activity(0, 500), |_| activity(5000, 1000));
        assert_eq!(stalled, Vec::new());
        let stopped_at_tick_8 = |tick: u64| activity(tick.min(8) * 100 + 1200, 1000);
        assert_eq!(
            judge_with_remote(|_| activity(0, 500), stopped_at_tick_8),
            Vec::new()
        );
        let forgotten = |tick: u64| {
            (tick < 15)
                .then(|| activity(tick * 100 + 50, 1000))
                .flatten()
        };
        assert_eq!(
            judge_with_remote(|_| activity(0, 500), forgotten),
            Vec::new()
        );
    }

    #[test]
    fn only_a_worker_idle_for_the_whole_timeout_is_idle() {
        let mut stalls = Stalls::new(2, Duration::from_secs(1));
        let start = Instant::now();
        for tick in 0..=15u64 {
            let at = start + Duration::from_millis(tick * 100);
            stalls.observe(0, at, written_at(tick, activity(0, 500 + tick * 90)));
            stalls.observe(1, at, written_at(tick, activity(0, 500)));
        }
        assert!(stalls.any_idle(&[true, true]));
        assert!(!stalls.any_idle(&[true, false]));
    }
}
