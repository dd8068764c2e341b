//! The loader: batches assembled ahead of the training step on background threads, into
//! recycled buffers, delivered in order.
//!
//! Batch `k` holds `indices[k * batch_size ..]` transformed with the random draws of
//! (seed, epoch, sample index), so its contents do not depend on the number of threads or
//! on where the epoch was started (mid-epoch resume starts at `start_batch`).
//!
//! ```text
//! workers: claim batch k (at most `prefetch` ahead of the consumer) -> take a buffer from
//!          the pool -> transform its images -> send (k, batch)
//! consumer: receive, put out-of-order batches aside, hand out batch k, k+1, ...
//! dropping a Batch returns its buffers to the pool
//! ```

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::transform::{transform_with_map, Augment, Geometry, Normalize, ValueMap};

/// How the loader assembles batches.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderOptions {
    /// Images per batch.
    pub batch_size: usize,
    /// Drop the last batch if it is smaller than `batch_size` (else keep it).
    pub drop_last: bool,
    /// Random augmentation (`None` for evaluation).
    pub augment: Option<Augment>,
    /// Normalization after augmentation.
    pub normalize: Option<Normalize>,
    /// Seed of the augmentation draws.
    pub seed: u64,
    /// Epoch of the augmentation draws.
    pub epoch: u64,
    /// Background threads; 0 assembles each batch on the caller's thread when asked.
    pub threads: usize,
    /// How many batches may be ready or in the making ahead of the consumer (at least 1).
    pub prefetch: usize,
    /// The first batch to deliver (mid-epoch resume); earlier batches are skipped, not built.
    pub start_batch: usize,
}

impl Default for LoaderOptions {
    fn default() -> LoaderOptions {
        LoaderOptions {
            batch_size: 128,
            drop_last: false,
            augment: None,
            normalize: None,
            seed: 0,
            epoch: 0,
            threads: 2,
            prefetch: 4,
            start_batch: 0,
        }
    }
}

/// One batch: images NHWC `[len, H, W, C]` and their labels. Dropping it returns its
/// buffers to the loader's pool.
#[derive(Debug)]
pub struct Batch {
    /// `len * H * W * C` values, NHWC.
    pub images: Vec<f32>,
    /// `len` labels.
    pub labels: Vec<u32>,
    /// Number of images.
    pub len: usize,
    /// The dataset index of each image.
    pub indices: Vec<usize>,
    /// Position of the batch in the epoch.
    pub batch_index: usize,
    pool: Option<Arc<BufferPool>>,
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.put(Buffers {
                images: std::mem::take(&mut self.images),
                labels: std::mem::take(&mut self.labels),
                indices: std::mem::take(&mut self.indices),
            });
        }
    }
}

/// Reusable storage of one batch.
#[derive(Default)]
struct Buffers {
    images: Vec<f32>,
    labels: Vec<u32>,
    indices: Vec<usize>,
}

/// Returned buffers, kept up to a capacity.
struct BufferPool {
    free: Mutex<Vec<Buffers>>,
    capacity: usize,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "BufferPool {{ capacity: {} }}", self.capacity)
    }
}

impl BufferPool {
    fn take(&self) -> Buffers {
        self.free
            .lock()
            .map(|mut free| free.pop().unwrap_or_default())
            .unwrap_or_default()
    }

    fn put(&self, buffers: Buffers) {
        if let Ok(mut free) = self.free.lock() {
            if free.len() < self.capacity {
                free.push(buffers);
            }
        }
    }
}

/// What the workers and the consumer share about progress.
struct Progress {
    /// The next batch a worker may claim.
    next_to_claim: usize,
    /// Workers may claim batches below this (consumer position + prefetch).
    claim_limit: usize,
    /// Set when the loader is dropped.
    stop: bool,
}

/// Everything a batch is built from.
struct Recipe {
    dataset: Arc<Dataset>,
    indices: Vec<usize>,
    options: LoaderOptions,
    /// `options.augment`, or no augmentation.
    augment: Augment,
    num_batches: usize,
}

impl Recipe {
    /// Fills `buffers` with batch `batch_index`.
    fn build(&self, batch_index: usize, map: &ValueMap, mut buffers: Buffers) -> Buffers {
        let batch_size = self.options.batch_size;
        let start = (batch_index * batch_size).min(self.indices.len());
        let end = (start + batch_size).min(self.indices.len());
        let members = &self.indices[start..end];
        let image_len = self.dataset.image_len();
        let geometry = Geometry {
            height: self.dataset.height,
            width: self.dataset.width,
            channels: self.dataset.channels,
        };
        buffers.indices.clear();
        buffers.indices.extend_from_slice(members);
        buffers.labels.clear();
        buffers.labels.extend(
            members
                .iter()
                .map(|&index| self.dataset.labels.get(index).copied().unwrap_or(0)),
        );
        buffers.images.resize(members.len() * image_len, 0.0);
        for (&index, output) in members
            .iter()
            .zip(buffers.images.chunks_exact_mut(image_len))
        {
            transform_with_map(
                &self.dataset.images,
                geometry,
                index,
                &self.augment,
                map,
                (self.options.seed, self.options.epoch),
                output,
            );
        }
        buffers
    }
}

/// State shared by the loader and its workers.
struct Shared {
    recipe: Recipe,
    progress: Mutex<Progress>,
    progress_changed: Condvar,
    pool: Arc<BufferPool>,
}

/// Iterates over the batches of one epoch, in order, as `Result<Batch, DataError>`. See
/// the module documentation.
pub struct Loader {
    shared: Arc<Shared>,
    next_batch: usize,
    receiver: Option<Receiver<(usize, Buffers)>>,
    set_aside: BTreeMap<usize, Buffers>,
    workers: Vec<JoinHandle<()>>,
    /// Used when `threads` is 0.
    local_map: Option<ValueMap>,
}

impl Loader {
    /// A loader over `indices` (dataset indices, in visiting order, e.g. from
    /// [`crate::DistributedSampler::indices`]).
    pub fn new(
        dataset: Arc<Dataset>,
        indices: Vec<usize>,
        options: LoaderOptions,
    ) -> Result<Loader, DataError> {
        validate(&dataset, &indices, &options)?;
        let num_batches = if options.drop_last {
            indices.len() / options.batch_size
        } else {
            indices.len().div_ceil(options.batch_size)
        };
        let prefetch = options.prefetch.max(1);
        let threads = options.threads;
        let start_batch = options.start_batch.min(num_batches);
        let shared = Arc::new(Shared {
            recipe: Recipe {
                dataset,
                indices,
                augment: options.augment.unwrap_or_default(),
                options,
                num_batches,
            },
            progress: Mutex::new(Progress {
                next_to_claim: start_batch,
                claim_limit: start_batch + prefetch,
                stop: false,
            }),
            progress_changed: Condvar::new(),
            pool: Arc::new(BufferPool {
                free: Mutex::new(Vec::new()),
                capacity: prefetch + threads + 2,
            }),
        });
        let mut loader = Loader {
            shared: shared.clone(),
            next_batch: start_batch,
            receiver: None,
            set_aside: BTreeMap::new(),
            workers: Vec::new(),
            local_map: None,
        };
        if threads == 0 {
            loader.local_map = Some(ValueMap::new(shared.recipe.options.normalize.as_ref()));
        } else {
            let (sender, receiver) = channel();
            loader.receiver = Some(receiver);
            for _ in 0..threads {
                let shared = shared.clone();
                let sender = sender.clone();
                loader
                    .workers
                    .push(std::thread::spawn(move || work(&shared, &sender)));
            }
        }
        Ok(loader)
    }

    /// Number of batches in the whole epoch (including any skipped by `start_batch`).
    pub fn num_batches(&self) -> usize {
        self.shared.recipe.num_batches
    }

    /// Returns a batch's buffers for reuse (the same as dropping it).
    pub fn recycle(&self, batch: Batch) {
        drop(batch);
    }

    fn wrap(&self, batch_index: usize, buffers: Buffers) -> Batch {
        Batch {
            len: buffers.labels.len(),
            images: buffers.images,
            labels: buffers.labels,
            indices: buffers.indices,
            batch_index,
            pool: Some(self.shared.pool.clone()),
        }
    }

    /// Receives until batch `batch_index` arrives, setting later ones aside.
    fn receive(&mut self, batch_index: usize) -> Option<Buffers> {
        if let Some(buffers) = self.set_aside.remove(&batch_index) {
            return Some(buffers);
        }
        let receiver = self.receiver.as_ref()?;
        loop {
            let (index, buffers) = receiver.recv().ok()?;
            if index == batch_index {
                return Some(buffers);
            }
            self.set_aside.insert(index, buffers);
        }
    }

    /// Lets the workers claim up to `prefetch` batches past the one just delivered.
    fn advance_claim_limit(&self, delivered: usize) {
        if let Ok(mut progress) = self.shared.progress.lock() {
            progress.claim_limit = delivered + 1 + self.shared.recipe.options.prefetch.max(1);
        }
        self.shared.progress_changed.notify_all();
    }
}

impl Iterator for Loader {
    type Item = Result<Batch, DataError>;

    /// The next batch in order; `None` at the end of the epoch. An error only if a worker
    /// thread died (a bug, not bad input); the iterator then ends.
    fn next(&mut self) -> Option<Result<Batch, DataError>> {
        let batch_index = self.next_batch;
        if batch_index >= self.shared.recipe.num_batches {
            return None;
        }
        let buffers = match &self.local_map {
            Some(map) => self
                .shared
                .recipe
                .build(batch_index, map, self.shared.pool.take()),
            None => match self.receive(batch_index) {
                Some(buffers) => buffers,
                None => {
                    self.next_batch = self.shared.recipe.num_batches;
                    return Some(Err(DataError::Invalid {
                        message: format!(
                            "loader worker threads stopped before batch {batch_index}"
                        ),
                    }));
                }
            },
        };
        self.next_batch += 1;
        self.advance_claim_limit(batch_index);
        Some(Ok(self.wrap(batch_index, buffers)))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        if let Ok(mut progress) = self.shared.progress.lock() {
            progress.stop = true;
        }
        self.shared.progress_changed.notify_all();
        self.receiver = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A worker: claim the next batch within the limit, build it, send it; until done.
fn work(shared: &Shared, sender: &Sender<(usize, Buffers)>) {
    let map = ValueMap::new(shared.recipe.options.normalize.as_ref());
    while let Some(batch_index) = claim(shared) {
        let buffers = shared.recipe.build(batch_index, &map, shared.pool.take());
        if sender.send((batch_index, buffers)).is_err() {
            return;
        }
    }
}

fn claim(shared: &Shared) -> Option<usize> {
    let mut progress = shared.progress.lock().ok()?;
    loop {
        if progress.stop || progress.next_to_claim >= shared.recipe.num_batches {
            return None;
        }
        if progress.next_to_claim < progress.claim_limit {
            let batch_index = progress.next_to_claim;
            progress.next_to_claim += 1;
            return Some(batch_index);
        }
        progress = shared.progress_changed.wait(progress).ok()?;
    }
}

fn validate(
    dataset: &Dataset,
    indices: &[usize],
    options: &LoaderOptions,
) -> Result<(), DataError> {
    let invalid = |message: String| Err(DataError::Invalid { message });
    if options.batch_size == 0 {
        return invalid("loader batch size 0, expected at least 1".to_string());
    }
    if dataset.images.len() != dataset.len() * dataset.image_len() {
        return invalid(format!(
            "dataset has {} pixel values for {} images of {} values",
            dataset.images.len(),
            dataset.len(),
            dataset.image_len()
        ));
    }
    if let Some(&bad) = indices.iter().find(|&&index| index >= dataset.len()) {
        return invalid(format!(
            "loader index {bad}, expected below the dataset size {}",
            dataset.len()
        ));
    }
    if options.normalize.is_some() && dataset.channels != 3 {
        return invalid(format!(
            "normalize needs 3 channels, the dataset has {}",
            dataset.channels
        ));
    }
    if options.threads > 256 {
        return invalid(format!(
            "{} loader threads, expected at most 256",
            options.threads
        ));
    }
    Ok(())
}
