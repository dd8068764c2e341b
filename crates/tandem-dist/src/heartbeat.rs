//! A worker's heartbeat and status in the job's store.
//!
//! A thread of its own, on a store connection of its own, bumps the worker's heartbeat
//! counter every [`HEARTBEAT_INTERVAL`] and writes the worker's latest [`WorkerStatus`] when
//! it changed. The launcher takes a worker whose counter stops moving for its heartbeat
//! timeout for dead, whatever the reason (stopped with SIGSTOP, hung, its node cut off), and
//! `tandem status` reads the statuses of a live job. Observers compare the counter with its
//! last value on their own clock, so no clocks need to agree.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
}

impl Heartbeat {
    /// Starts beating for `rank` of the round of `prefix` through `client`, every
    /// `interval`. A store that stops answering ends the beats silently: the job is ending,
    /// and the launcher sees it.
    pub fn start(client: StoreClient, prefix: &str, rank: usize, interval: Duration) -> Heartbeat {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            status: Mutex::new(None),
        });
        let beat_key = heartbeat_key(prefix, rank);
        let status_key = status_key(prefix, rank);
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tandem-heartbeat".into())
            .spawn(move || beat(&client, &beat_key, &status_key, &thread_shared, interval))
            .ok();
        Heartbeat { shared, thread }
    }

    /// Hands the heartbeat thread a status to write at its next beat.
    pub fn publish(&self, status: &WorkerStatus) {
        let mut pending = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *pending = Some(status.to_json());
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

/// The heartbeat thread: bump, write a new status, sleep, until told to stop (then mark the
/// counter [`ENDED`]) or the store fails.
fn beat(
    client: &StoreClient,
    beat_key: &str,
    status_key: &str,
    shared: &Shared,
    interval: Duration,
) {
    // A heartbeat of the same worker that ended before (a worker that joined a new group)
    // left its counter marked ended: take the mark back.
    match client.add(beat_key, 0) {
        Ok(beat) if beat < 0 => {
            if client.add(beat_key, -ENDED).is_err() {
                return;
            }
        }
        Ok(_) => {}
        Err(_) => return,
    }
    // Short sleeps, so that a drop does not wait a whole interval.
    let slice = interval
        .min(Duration::from_millis(20))
        .max(Duration::from_millis(1));
    while !shared.stop.load(Ordering::Relaxed) {
        if client.add(beat_key, 1).is_err() {
            return;
        }
        let status = shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(status) = status {
            if client.set(status_key, &status).is_err() {
                return;
            }
        }
        let mut slept = Duration::ZERO;
        while slept < interval && !shared.stop.load(Ordering::Relaxed) {
            std::thread::sleep(slice);
            slept += slice;
        }
    }
    let _ = client.add(beat_key, ENDED);
}
