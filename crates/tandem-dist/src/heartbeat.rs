//! A worker's heartbeat and status in the job's store.
//!
//! A thread of its own, on a store connection of its own, bumps the worker's heartbeat
//! counter every [`HEARTBEAT_INTERVAL`] and writes the worker's latest [`WorkerStatus`] when
//! it changed. The launcher takes a worker whose counter stops moving for its heartbeat
//! timeout for dead, whatever the reason (stopped with SIGSTOP, hung, its node cut off), and
//! `tandem status` reads the statuses of a live job. Observers compare the counter with its
//! last value on their own clock, so no clocks need to agree. At every beat it also writes
//! the worker's [`Activity`] (how long it has waited for its peers, its CPU time, whether it
//! writes files), from which the launcher finds a worker that hangs while this thread beats.
//!
//! With `--keep-survivors` the same thread watches the job's membership: when the launcher
//! publishes a later one than this worker's group's, it calls the group's [`Interrupt`]s, so
//! that a collective blocked on a peer that will never answer (its link is down, it hangs,
//! or it left for the new group) fails at once and the worker re-forms.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cluster::contract::{membership_key, MembershipRecord};
use crate::store::StoreClient;

/// How often a worker's heartbeat moves.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);

/// The store key of the heartbeat counter of `rank` in the round whose process-group keys
/// start with `prefix`.
pub fn heartbeat_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/heartbeat/{rank}")
}

/// The store key of the [`WorkerStatus`] of `rank` in the round of `prefix`.
pub fn status_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/status/{rank}")
}

/// The store key of the [`Activity`] of `rank` in the round of `prefix`.
pub fn activity_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/activity/{rank}")
}

/// What a worker is doing, written at every beat: from it the launcher tells a worker that
/// hangs while its heartbeat thread still beats (its peers wait for it in a collective, and
/// it neither computes nor waits itself) from one that is only slow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    /// How long its current wait for its peers (a collective that runs) has lasted, in
    /// milliseconds; 0 when it does not wait.
    pub waiting_ms: u64,
    /// The CPU time its process used so far, in milliseconds.
    pub cpu_ms: u64,
    /// Whether it is reading or writing files (a snapshot, a checkpoint), which may take a
    /// while without using the CPU.
    pub in_io: bool,
    /// How many activities the process took before this one: a reader tells a fresh
    /// activity from one that was not written again (the store did not take it).
    #[serde(default)]
    pub written: u64,
}

impl Activity {
    /// This process's activity now.
    pub fn now() -> Activity {
        let since = WAITING_SINCE.load(Ordering::Relaxed);
        // A wait with no collective running is no wait for the peers: the waiting thread
        // would have woken.
        let running = COLLECTIVES_RUNNING.load(Ordering::Relaxed) > 0
            || STORE_REQUESTS.load(Ordering::Relaxed) > 0;
        let waiting_ms = match since {
            since if since > 0 && running => process_millis().saturating_sub(since - 1).max(1),
            _ => 0,
        };
        Activity {
            waiting_ms,
            cpu_ms: cpu_millis(),
            in_io: IN_IO.load(Ordering::Relaxed) > 0,
            written: ACTIVITIES_TAKEN.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The activity as the JSON the store holds.
    pub fn to_json(&self) -> Vec<u8> {
        // Numbers and a flag always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// An activity read back from the store.
    pub fn from_json(bytes: &[u8]) -> Result<Activity, String> {
        serde_json::from_slice(bytes).map_err(|error| format!("is not a worker activity: {error}"))
    }
}

/// Since when (milliseconds of [`process_millis`], plus one) the process waits for its
/// peers; 0 when it does not.
static WAITING_SINCE: AtomicU64 = AtomicU64::new(0);

/// How many collectives the process runs now (on its comm thread).
static COLLECTIVES_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// How many store requests the process waits on now: a store whose replica or leader is
/// cut off makes a request wait for a failover, as a collective waits for its peers.
static STORE_REQUESTS: AtomicUsize = AtomicUsize::new(0);

/// How many activities the process took.
static ACTIVITIES_TAKEN: AtomicU64 = AtomicU64::new(0);

/// How many file reads or writes the process is in.
static IN_IO: AtomicUsize = AtomicUsize::new(0);

/// Milliseconds since the process first asked.
fn process_millis() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// The CPU time, user and system, of every thread of this process so far, in milliseconds.
fn cpu_millis() -> u64 {
    // SAFETY: getrusage fills the zeroed struct it is given and reads nothing else.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return 0;
        }
        usage
    };
    let millis = |time: libc::timeval| time.tv_sec as u64 * 1000 + time.tv_usec as u64 / 1000;
    millis(usage.ru_utime) + millis(usage.ru_stime)
}

/// Marks the process as waiting for its peers until dropped. Waits of several threads may
/// overlap (the training thread's collective, the heartbeat thread's store request): the
/// process waits from the first one's start until the last one ends.
pub struct PeerWait(());

/// Starts a wait for the peers; see [`PeerWait`].
pub fn waiting_for_peers() -> PeerWait {
    let mut waits = lock(&WAITS);
    if *waits == 0 {
        WAITING_SINCE.store(process_millis() + 1, Ordering::Relaxed);
    }
    *waits += 1;
    PeerWait(())
}

impl Drop for PeerWait {
    fn drop(&mut self) {
        let mut waits = lock(&WAITS);
        *waits = waits.saturating_sub(1);
        if *waits == 0 {
            WAITING_SINCE.store(0, Ordering::Relaxed);
        }
    }
}

/// How many waits for the peers are under way, counted under a lock so that the first to
/// start and the last to end set [`WAITING_SINCE`] in order.
static WAITS: Mutex<usize> = Mutex::new(0);

/// Marks a store request as waited on until dropped: a wait for the peers that serve the
/// store.
pub(crate) struct StoreRequest {
    _wait: PeerWait,
}

/// Starts a store request; see [`StoreRequest`].
pub(crate) fn waiting_on_the_store() -> StoreRequest {
    STORE_REQUESTS.fetch_add(1, Ordering::Relaxed);
    StoreRequest {
        _wait: waiting_for_peers(),
    }
}

impl Drop for StoreRequest {
    fn drop(&mut self) {
        STORE_REQUESTS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Marks a collective as running until dropped.
pub struct RunningCollective(());

/// Starts a collective; see [`RunningCollective`].
pub fn running_collective() -> RunningCollective {
    COLLECTIVES_RUNNING.fetch_add(1, Ordering::Relaxed);
    RunningCollective(())
}

impl Drop for RunningCollective {
    fn drop(&mut self) {
        COLLECTIVES_RUNNING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Marks the process as reading or writing files until dropped.
pub struct FileWork(());

/// Starts file work; see [`FileWork`].
pub fn doing_file_work() -> FileWork {
    IN_IO.fetch_add(1, Ordering::Relaxed);
    FileWork(())
}

impl Drop for FileWork {
    fn drop(&mut self) {
        IN_IO.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a worker tells `tandem status` about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// The worker's rank in its round.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// The host it runs on.
    pub host: String,
    /// The epoch it trains (from 1), 0 before the first.
    pub epoch: u64,
    /// Optimizer steps it finished in the epoch.
    pub step: u64,
    /// The images per second of its last finished step, 0 before the first.
    pub images_per_second: f64,
}

impl WorkerStatus {
    /// The status as the JSON the store holds.
    pub fn to_json(&self) -> Vec<u8> {
        // Strings and numbers always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A status read back from the store.
    pub fn from_json(bytes: &[u8]) -> Result<WorkerStatus, String> {
        serde_json::from_slice(bytes).map_err(|error| format!("is not a worker status: {error}"))
    }
}

/// Breaks a worker's blocked collectives, called once from the heartbeat thread with why.
pub type Interrupt = Box<dyn Fn(&str) + Send + Sync>;

/// Called from the heartbeat thread with `true` when a replicated store has left the
/// worker's beats unanswered for [`CUT_OFF_AFTER`], and with `false` when it answers again.
pub type StoreCutHook = Box<dyn Fn(bool) + Send + Sync>;

/// The membership a worker's group was formed for, which its heartbeat thread watches.
#[derive(Debug, Clone, PartialEq)]
pub struct MembershipWatch {
    /// The namespace of the round whose membership key is watched.
    pub round_prefix: String,
    /// The membership epoch of the group.
    pub epoch: u64,
}

impl MembershipWatch {
    /// Why the group must break when `record` is a later membership; `None` while the group
    /// stands. One that lets a worker in breaks it too: members read it at their own step
    /// boundaries, and one that left for the new group would leave the others waiting.
    fn breaks_on(&self, record: &MembershipRecord) -> Option<String> {
        (record.epoch > self.epoch).then(|| format!("membership {}: {}", record.epoch, record.why))
    }
}

/// The running heartbeat of one worker; dropping it stops the thread.
pub struct Heartbeat {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What the worker and its heartbeat thread share.
struct Shared {
    stop: AtomicBool,
    /// A status not yet written to the store.
    status: Mutex<Option<Vec<u8>>>,
    /// The membership watched, until its interrupts ran.
    watch: Mutex<Option<MembershipWatch>>,
    /// What breaks the group's collectives.
    interrupts: Mutex<Vec<Interrupt>>,
    /// What to do when the worker is cut off from a replicated store, and when it is back.
    cut_hooks: Mutex<Vec<StoreCutHook>>,
}

impl Heartbeat {
    /// Starts beating for `rank` of the round of `prefix` through `client`, every
    /// `interval`. A single store that stops answering ends the beats silently: the job is
    /// ending, and the launcher sees it. A replicated one is tried again at every beat (see
    /// [`Heartbeat::on_store_cut`]).
    pub fn start(client: StoreClient, prefix: &str, rank: usize, interval: Duration) -> Heartbeat {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            status: Mutex::new(None),
            watch: Mutex::new(None),
            interrupts: Mutex::new(Vec::new()),
            cut_hooks: Mutex::new(Vec::new()),
        });
        let keys = WorkerKeys {
            beat: heartbeat_key(prefix, rank),
            status: status_key(prefix, rank),
            activity: activity_key(prefix, rank),
        };
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tandem-heartbeat".into())
            .spawn(move || beat(&client, &keys, &thread_shared, interval))
            .ok();
        Heartbeat { shared, thread }
    }

    /// Hands the heartbeat thread a status to write at its next beat.
    pub fn publish(&self, status: &WorkerStatus) {
        *lock(&self.shared.status) = Some(status.to_json());
    }

    /// Watches the job's membership for one later than `watch`'s; then runs every interrupt
    /// once.
    pub fn watch_membership(&self, watch: MembershipWatch) {
        *lock(&self.shared.watch) = Some(watch);
    }

    /// Adds what to do when a replicated store leaves this worker's beats unanswered for
    /// [`CUT_OFF_AFTER`] (its node is most likely cut off from the job's majority), and when
    /// it answers again.
    pub fn on_store_cut(&self, hook: StoreCutHook) {
        lock(&self.shared.cut_hooks).push(hook);
    }

    /// Adds what breaks the group's collectives when the job's membership moves on.
    pub fn add_interrupt(&self, interrupt: Interrupt) {
        lock(&self.shared.interrupts).push(interrupt);
    }
}

/// Locks `mutex`, taking the value of a thread that panicked with it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads the membership that `shared` watches, and when it moved on, runs the interrupts and
/// stops watching. A store that cannot say leaves the group as it is: the heartbeat itself
/// tells the launcher.
fn check_membership(client: &StoreClient, shared: &Shared, bound: Duration) {
    let Some(watch) = lock(&shared.watch).clone() else {
        return;
    };
    let Ok(Some(bytes)) = client.get_within(&membership_key(&watch.round_prefix), bound) else {
        return;
    };
    let Some(reason) = MembershipRecord::from_json(&bytes)
        .ok()
        .and_then(|record| watch.breaks_on(&record))
    else {
        return;
    };
    *lock(&shared.watch) = None;
    for interrupt in lock(&shared.interrupts).iter() {
        interrupt(&reason);
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What a heartbeat that ends on purpose adds to its counter: below zero, it tells the
/// launcher that the worker stopped beating because it is finishing, not because it hangs.
pub const ENDED: i64 = -(1 << 40);

/// A worker's keys in the store.
struct WorkerKeys {
    beat: String,
    status: String,
    activity: String,
}

/// The heartbeat thread: bump, write a new status and the activity, watch the membership,
/// sleep, until told to stop (then mark the counter [`ENDED`]). A single store that fails
/// ends the thread; a replicated one is tried again at every beat, and the hooks hear when
/// it stays silent for [`CUT_OFF_AFTER`] and when it answers again.
fn beat(client: &StoreClient, keys: &WorkerKeys, shared: &Shared, interval: Duration) {
    let bound = match client.is_replicated() {
        true => REPLICATED_BEAT_BOUND,
        false => client.timeout(),
    };
    let mut unmarked = false;
    let (mut last_answer, mut cut) = (Instant::now(), false);
    // Short sleeps, so that a drop does not wait a whole interval.
    let slice = interval
        .min(Duration::from_millis(20))
        .max(Duration::from_millis(1));
    while !shared.stop.load(Ordering::Relaxed) {
        match beat_once(client, keys, shared, bound, &mut unmarked) {
            Ok(()) => {
                last_answer = Instant::now();
                if std::mem::take(&mut cut) {
                    tell_the_hooks(shared, false);
                }
                check_membership(client, shared, bound);
            }
            Err(_) if !client.is_replicated() => return,
            Err(_) => {
                if !cut && last_answer.elapsed() >= CUT_OFF_AFTER {
                    cut = true;
                    tell_the_hooks(shared, true);
                }
            }
        }
        let mut slept = Duration::ZERO;
        while slept < interval && !shared.stop.load(Ordering::Relaxed) {
            std::thread::sleep(slice);
            slept += slice;
        }
    }
    let _ = client.add_within(&keys.beat, ENDED, bound);
}

/// How long one beat's requests may take on a replicated store: a beat that fails is tried
/// again at the next interval rather than ending the thread.
const REPLICATED_BEAT_BOUND: Duration = Duration::from_secs(1);

/// How long a replicated store may leave a worker's beats unanswered before the worker
/// counts itself cut off from the job's majority (the launchers' default heartbeat timeout,
/// after which the majority leaves a silent node out).
pub const CUT_OFF_AFTER: Duration = Duration::from_secs(1);

/// Calls every hook with whether the worker is `cut` off from the store now.
fn tell_the_hooks(shared: &Shared, cut: bool) {
    for hook in lock(&shared.cut_hooks).iter() {
        hook(cut);
    }
}

/// One beat: the counter (first taking back the [`ENDED`] mark of a heartbeat of the same
/// worker that ended before, once `unmarked` is not yet set), the status if a new one waits,
/// and the activity; each request bounded by `bound`.
fn beat_once(
    client: &StoreClient,
    keys: &WorkerKeys,
    shared: &Shared,
    bound: Duration,
    unmarked: &mut bool,
) -> crate::Result<()> {
    if !*unmarked {
        if client.add_within(&keys.beat, 0, bound)? < 0 {
            client.add_within(&keys.beat, -ENDED, bound)?;
        }
        *unmarked = true;
    }
    client.add_within(&keys.beat, 1, bound)?;
    let status = lock(&shared.status).take();
    if let Some(status) = status {
        if let Err(error) = client.set_within(&keys.status, &status, bound) {
            lock(&shared.status).get_or_insert(status);
            return Err(error);
        }
    }
    client.set_within(&keys.activity, &Activity::now().to_json(), bound)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    use super::*;
    use crate::{JobToken, StoreServer};

    fn record(epoch: u64, members: &[usize], why: &str) -> MembershipRecord {
        MembershipRecord {
            epoch,
            members: members.to_vec(),
            why: why.into(),
            paused_for: None,
        }
    }

    #[test]
    fn a_group_breaks_on_any_later_membership() {
        let watch = MembershipWatch {
            round_prefix: "r".into(),
            epoch: 1,
        };
        assert_eq!(watch.breaks_on(&record(1, &[0, 2], "same epoch")), None);
        assert_eq!(watch.breaks_on(&record(0, &[0, 2, 3], "earlier")), None);
        assert_eq!(
            watch.breaks_on(&record(2, &[0, 2, 3, 1], "rank 1 joins")),
            Some("membership 2: rank 1 joins".into())
        );
        assert_eq!(
            watch.breaks_on(&record(2, &[0, 3], "rank 2 lost")),
            Some("membership 2: rank 2 lost".into())
        );
    }

    #[test]
    fn a_store_request_under_way_counts_as_a_wait_for_the_peers() {
        let request = waiting_on_the_store();
        std::thread::sleep(Duration::from_millis(5));
        let activity = Activity::now();
        drop(request);
        assert!(activity.waiting_ms >= 1, "{activity:?}");
    }

    #[test]
    fn a_wait_that_outlasts_an_earlier_one_of_another_thread_still_counts() {
        let earlier = waiting_on_the_store();
        let later = std::thread::spawn(waiting_on_the_store)
            .join()
            .expect("thread");
        drop(earlier);
        std::thread::sleep(Duration::from_millis(5));
        let activity = Activity::now();
        drop(later);
        assert!(activity.waiting_ms >= 1, "{activity:?}");
    }

    #[test]
    fn the_heartbeat_thread_runs_the_interrupts_once_when_the_membership_moves_on() {
        let token = JobToken::generate().expect("token");
        let server =
            StoreServer::bind("127.0.0.1:0".parse().expect("addr"), token.clone()).expect("bind");
        let connect = || {
            StoreClient::connect(server.local_addr(), &token, Duration::from_secs(10))
                .expect("connect")
        };
        let (publisher, calls) = (connect(), Arc::new(AtomicUsize::new(0)));
        let reasons = Arc::new(Mutex::new(Vec::new()));
        let heartbeat = Heartbeat::start(connect(), "job/r0", 1, Duration::from_millis(10));
        let (counted, said) = (Arc::clone(&calls), Arc::clone(&reasons));
        heartbeat.add_interrupt(Box::new(move |why| {
            counted.fetch_add(1, Ordering::SeqCst);
            lock(&said).push(why.to_string());
        }));
        heartbeat.watch_membership(MembershipWatch {
            round_prefix: "job/r0".into(),
            epoch: 1,
        });
        let key = membership_key("job/r0");
        let publish = |record: MembershipRecord| publisher.set(&key, &record.to_json());
        publish(record(1, &[0, 1, 2], "the group's own")).expect("set");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "its own membership breaks nothing"
        );
        publish(record(2, &[0, 1, 2, 3], "rank 3 joins")).expect("set");
        let deadline = Instant::now() + Duration::from_secs(10);
        while calls.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        publish(record(3, &[0], "rank 1 lost")).expect("set");
        std::thread::sleep(Duration::from_millis(200));
        drop(heartbeat);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(
            *lock(&reasons),
            vec!["membership 2: rank 3 joins".to_string()]
        );
    }
}
