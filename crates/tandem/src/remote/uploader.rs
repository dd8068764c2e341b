//! Uploads beside training: a thread that copies finished local files to the bucket, in
//! the order they were written, so that a training step never waits on the network.
//!
//! A file queued again before its previous upload started is uploaded once, as it is then
//! (the newer version is the one that matters). Each upload is whole or absent (see
//! `tandem_remote::RemoteStore::upload`). The first failure that outlasts the retries is
//! kept, the rest of the queue dropped, and `on_failure` called, so the run can stop with
//! its snapshot kept locally.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tandem_remote::{ObjectUrl, RemoteError, RemoteStore};

/// One thing to do in the bucket.
#[derive(Clone, Debug, PartialEq)]
enum Job {
    /// Copy the local file to the object.
    Put { local: PathBuf, url: ObjectUrl },
    /// Delete `epoch_N.safetensors` objects directly under the prefix but the `keep`
    /// with the largest N.
    PruneCheckpoints { prefix: ObjectUrl, keep: usize },
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// A job is being carried out.
    busy: bool,
    /// No more jobs will come; the thread ends when the queue is empty.
    closed: bool,
    /// The first failure, in words.
    failure: Option<String>,
    /// Files uploaded so far.
    uploaded: usize,
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
}

/// The upload thread and its queue.
pub struct Uploader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Uploader {
    /// Starts the thread; `on_failure` runs on it once, after the first failure.
    pub fn start(store: Arc<RemoteStore>, on_failure: impl FnOnce() + Send + 'static) -> Uploader {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
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
            shared.lock().failure = Some("cannot start the upload thread".to_string());
        }
        Uploader { shared, thread }
    }

    /// Queues the upload of `local` to `url`, replacing a queued upload of the same object.
    pub fn put(&self, local: PathBuf, url: ObjectUrl) {
        self.enqueue(Job::Put { local, url });
    }

    /// Queues the pruning of the epoch checkpoints under `prefix` to the last `keep`.
    pub fn prune_checkpoints(&self, prefix: ObjectUrl, keep: usize) {
        self.enqueue(Job::PruneCheckpoints { prefix, keep });
    }

    /// Adds `job` to the queue (an upload replaces a queued one of the same object), unless
    /// the queue is closed or has failed.
    fn enqueue(&self, job: Job) {
        let mut state = self.shared.lock();
        if state.closed || state.failure.is_some() {
            return;
        }
        if let Job::Put { url, .. } = &job {
            state
                .queue
                .retain(|queued| !matches!(queued, Job::Put { url: other, .. } if other == url));
        }
        state.queue.push_back(job);
        self.shared.changed.notify_all();
    }

    /// Waits until everything queued is uploaded (each request is bounded by the retry
    /// timeout), then ends the thread. Returns how many files were uploaded, or the first
    /// failure.
    pub fn finish(&mut self) -> Result<usize, String> {
        {
            let mut state = self.shared.lock();
            state.closed = true;
            self.shared.changed.notify_all();
            while state.failure.is_none() && (state.busy || !state.queue.is_empty()) {
                state = self
                    .shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let state = self.shared.lock();
        match &state.failure {
            Some(failure) => Err(failure.clone()),
            None => Ok(state.uploaded),
        }
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

/// The thread: carries out jobs until the queue is closed and empty, or a job fails.
fn work(shared: &Shared, store: &RemoteStore, on_failure: impl FnOnce()) {
    loop {
        let job = {
            let mut state = shared.lock();
            while state.queue.is_empty() && !state.closed {
                state = shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            let Some(job) = state.queue.pop_front() else {
                return;
            };
            state.busy = true;
            job
        };
        let result = carry_out(store, &job);
        let mut state = shared.lock();
        state.busy = false;
        match result {
            Ok(uploaded) => state.uploaded += uploaded,
            Err(failure) => {
                state.failure = Some(failure);
                state.queue.clear();
                shared.changed.notify_all();
                drop(state);
                on_failure();
                return;
            }
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
            let epoch = crate::train::checkpoint_epoch(prefix.relative_key(&object.url)?)?;
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
