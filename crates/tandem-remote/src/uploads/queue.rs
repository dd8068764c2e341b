//! Uploads beside training: a thread that copies finished local files to the bucket, in
//! the order they were written, so that a training step never waits on the network.
//!
//! A file queued again before its previous upload started is uploaded once, as it is then
//! (the newer version is the one that matters). Each upload is whole or absent (see
//! [`crate::RemoteStore::upload`]). Every job is recorded on disk until it is done
//! (see [`super::pending`]). The first failure that outlasts the retries is kept, the queue
//! stops (what is left, and what is queued after, stays recorded for the next process), and
//! `on_failure` is called, so the run can stop with its snapshot kept locally.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::pending::PendingUploads;
use super::{Job, UploadsError};
use crate::{ObjectUrl, RemoteError, RemoteStore};

struct State {
    queue: VecDeque<Job>,
    /// The job being carried out.
    in_flight: Option<Job>,
    /// No more jobs will come; the thread ends when the queue is empty.
    closed: bool,
    /// The first failure, in words.
    failure: Option<String>,
    /// Files uploaded so far.
    uploaded: usize,
    /// The jobs not done yet, on disk.
    pending: PendingUploads,
}

impl State {
    /// Keeps the first failure.
    fn fail(&mut self, failure: String) {
        self.failure.get_or_insert(failure);
    }

    /// Whether every queued job is done, or the uploads failed.
    fn settled(&self) -> bool {
        self.failure.is_some() || (self.in_flight.is_none() && self.queue.is_empty())
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until `state` is settled.
    fn wait_settled<'a>(&self, mut state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        while !state.settled() {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state
    }
}

/// The upload thread and its queue.
pub struct Uploader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Uploader {
    /// Starts the thread, recording its jobs in `pending`; `on_failure` runs on it once,
    /// after the first failure.
    pub fn start(
        store: Arc<RemoteStore>,
        pending: PendingUploads,
        on_failure: impl FnOnce() + Send + 'static,
    ) -> Uploader {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                in_flight: None,
                closed: false,
                failure: None,
                uploaded: 0,
                pending,
            }),
            changed: Condvar::new(),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("tandem-upload".into())
                .spawn(move || work(&shared, &store, on_failure))
                .ok()
        };
        if thread.is_none() {
            shared
                .lock()
                .fail("cannot start the upload thread".to_string());
        }
        Uploader { shared, thread }
    }

    /// Records `job` as pending and adds it to the queue (an upload replaces a queued one of
    /// the same object). After a failure it is only recorded, for the next process.
    pub fn enqueue(&self, job: Job) {
        let mut state = self.shared.lock();
        if let Err(error) = state.pending.record(&job) {
            state.fail(tandem_files::with_causes(&error));
        }
        if state.closed || state.failure.is_some() {
            self.shared.changed.notify_all();
            return;
        }
        state.queue.retain(|queued| !queued.same_as(&job));
        state.queue.push_back(job);
        self.shared.changed.notify_all();
    }

    /// Forgets the pending `job` without doing it.
    pub fn forget(&self, job: &Job) -> Result<(), UploadsError> {
        self.shared.lock().pending.done(job)
    }

    /// Whether an upload failed (the queue has stopped).
    pub fn has_failed(&self) -> bool {
        self.shared.lock().failure.is_some()
    }

    /// How many jobs are pending (queued, or left by a failure) and the folder that records
    /// them.
    pub fn pending(&self) -> (usize, PathBuf) {
        let state = self.shared.lock();
        (state.pending.len(), state.pending.folder().to_path_buf())
    }

    /// Waits until everything queued so far is done (each request is bounded by the retry
    /// timeout). Returns how many files were uploaded so far, or the first failure.
    pub fn wait_until_done(&self) -> Result<usize, String> {
        let state = self.shared.wait_settled(self.shared.lock());
        match &state.failure {
            Some(failure) => Err(failure.clone()),
            None => Ok(state.uploaded),
        }
    }

    /// Waits until everything queued is done, then ends the thread. Returns how many files
    /// were uploaded, or the first failure.
    pub fn finish(&mut self) -> Result<usize, String> {
        {
            let mut state = self.shared.lock();
            state.closed = true;
            self.shared.changed.notify_all();
            drop(self.shared.wait_settled(state));
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.wait_until_done()
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        state.queue.clear();
        self.shared.changed.notify_all();
    }
}

/// The thread: carries out jobs until the queue is closed and empty, or something fails
/// (then it calls `on_failure`). A job done is forgotten on disk unless a newer one of the
/// same object was queued meanwhile.
fn work(shared: &Shared, store: &RemoteStore, on_failure: impl FnOnce()) {
    loop {
        let job = {
            let mut state = shared.lock();
            while state.queue.is_empty() && !state.closed && state.failure.is_none() {
                state = shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            if state.failure.is_some() {
                shared.changed.notify_all();
                drop(state);
                on_failure();
                return;
            }
            let Some(job) = state.queue.pop_front() else {
                return;
            };
            state.in_flight = Some(job.clone());
            job
        };
        let result = carry_out(store, &job);
        let mut state = shared.lock();
        state.in_flight = None;
        let outcome = result.and_then(|uploaded| {
            if !state.queue.iter().any(|queued| queued.same_as(&job)) {
                state
                    .pending
                    .done(&job)
                    .map_err(|error| tandem_files::with_causes(&error))?;
            }
            Ok(uploaded)
        });
        match outcome {
            Ok(uploaded) => state.uploaded += uploaded,
            Err(failure) => state.fail(failure),
        }
        shared.changed.notify_all();
    }
}

/// Carries out one job; returns the number of files uploaded.
fn carry_out(store: &RemoteStore, job: &Job) -> Result<usize, String> {
    match job {
        Job::Put { local, url } => match store.upload(local, url) {
            Ok(_) => Ok(1),
            // A file replaced or removed after it was queued: a newer job follows it.
            Err(RemoteError::Local { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Ok(0)
            }
            Err(error) => Err(format!(
                "cannot upload {} to {url}: {error}",
                local.display()
            )),
        },
        Job::PruneCheckpoints { prefix, keep } => prune(store, prefix, *keep)
            .map(|()| 0)
            .map_err(|error| format!("cannot remove old checkpoints under {prefix}: {error}")),
    }
}

/// Deletes the `epoch_N.safetensors` objects directly under `prefix` but the newest `keep`.
fn prune(store: &RemoteStore, prefix: &ObjectUrl, keep: usize) -> Result<(), RemoteError> {
    let mut epochs: Vec<(u64, ObjectUrl)> = store
        .list(prefix)?
        .into_iter()
        .filter_map(|object| {
            let epoch = tandem_files::checkpoint_epoch(prefix.relative_key(&object.url)?)?;
            Some((epoch, object.url))
        })
        .collect();
    epochs.sort_by_key(|(epoch, _)| *epoch);
    let excess = epochs.len().saturating_sub(keep);
    for (_, url) in epochs.into_iter().take(excess) {
        store.delete(&url)?;
    }
    Ok(())
}
