//! The micro-batches of an epoch's steps, one interface over two sources: the CPU loader
//! (host pixels, augmented on its threads) or, when the training set is in GPU memory, the
//! same batches as sample indices and labels only, whose pixels the GPU assembles.
//!
//! [`IndexBatches`] cuts the sampler's order exactly as [`Loader`] does (batches of
//! `batch_size`, the last one partial, `start_batch` skipped on resume), so both sources
//! give every step the same samples.

use std::sync::Arc;

use tandem_data::{Batch, Dataset, Loader};

use tandem_models::training_device::{TrainBatch, TrainImages};

/// One micro-batch.
pub enum MicroBatch {
    /// Pixels assembled on the host by the CPU loader.
    Host(Batch),
    /// Samples whose pixels the GPU assembles from the training set in its memory.
    Indices {
        /// Dataset indices, in batch order.
        indices: Vec<usize>,
        /// Their labels.
        labels: Vec<u32>,
    },
}

impl MicroBatch {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels().len()
    }

    /// The images' labels.
    pub fn labels(&self) -> &[u32] {
        match self {
            MicroBatch::Host(batch) => &batch.labels,
            MicroBatch::Indices { labels, .. } => labels,
        }
    }

    /// The dataset index of each image.
    pub fn indices(&self) -> &[usize] {
        match self {
            MicroBatch::Host(batch) => &batch.indices,
            MicroBatch::Indices { indices, .. } => indices,
        }
    }

    /// The images for the training device, augmented with the draws of `epoch` on the
    /// device (the host loader already used them).
    pub fn images(&self, epoch: u64) -> TrainImages<'_> {
        match self {
            MicroBatch::Host(batch) => TrainImages::Host(&batch.images),
            MicroBatch::Indices { indices, .. } => TrainImages::OnDevice { indices, epoch },
        }
    }

    /// The micro-batch for the training device, its images drawn as [`MicroBatch::images`].
    pub fn train_batch(&self, epoch: u64) -> TrainBatch<'_> {
        TrainBatch {
            images: self.images(epoch),
            labels: self.labels(),
        }
    }
}

/// The loader's batches as indices and labels: no pixels.
pub struct IndexBatches {
    dataset: Arc<Dataset>,
    indices: Vec<usize>,
    batch_size: usize,
    next_batch: usize,
    num_batches: usize,
}

impl IndexBatches {
    /// The batches of `batch_size` over `indices` (the last one partial), from `start_batch`.
    pub fn new(
        dataset: Arc<Dataset>,
        indices: Vec<usize>,
        batch_size: usize,
        start_batch: usize,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(batch_size > 0, "batch size 0, expected at least 1");
        if let Some(&bad) = indices.iter().find(|&&index| index >= dataset.len()) {
            anyhow::bail!(
                "sample index {bad}, expected below the dataset size {}",
                dataset.len()
            );
        }
        let num_batches = indices.len().div_ceil(batch_size);
        Ok(IndexBatches {
            dataset,
            indices,
            batch_size,
            next_batch: start_batch.min(num_batches),
            num_batches,
        })
    }
}

impl Iterator for IndexBatches {
    type Item = MicroBatch;

    fn next(&mut self) -> Option<MicroBatch> {
        if self.next_batch >= self.num_batches {
            return None;
        }
        let start = self.next_batch * self.batch_size;
        let end = (start + self.batch_size).min(self.indices.len());
        self.next_batch += 1;
        let indices = self.indices[start..end].to_vec();
        let labels = indices
            .iter()
            .map(|&index| self.dataset.labels.get(index).copied().unwrap_or(0))
            .collect();
        Some(MicroBatch::Indices { indices, labels })
    }
}

/// An epoch's batches from either source, handed out a step at a time.
pub enum EpochBatches {
    /// The CPU loader.
    Host {
        /// Its batches (boxed: a loader is large beside the indices).
        loader: Box<Loader>,
        /// Batches of the whole epoch.
        num_batches: usize,
    },
    /// Indices for the GPU.
    Device(IndexBatches),
}

impl EpochBatches {
    /// The CPU loader's batches.
    pub fn host(loader: Loader) -> Self {
        EpochBatches::Host {
            num_batches: loader.num_batches(),
            loader: Box::new(loader),
        }
    }

    /// Batches of the whole epoch (including any skipped on resume).
    pub fn num_batches(&self) -> usize {
        match self {
            EpochBatches::Host { num_batches, .. } => *num_batches,
            EpochBatches::Device(batches) => batches.num_batches,
        }
    }

    /// The next step's micro-batches: `accumulation` of them, fewer at the end of the epoch;
    /// `None` once the epoch is done.
    pub fn next_step(&mut self, accumulation: usize) -> anyhow::Result<Option<Vec<MicroBatch>>> {
        let step = self.take(accumulation.max(1))?;
        Ok((!step.is_empty()).then_some(step))
    }

    /// The next `count` micro-batches, fewer at the end of the epoch.
    pub fn take(&mut self, count: usize) -> anyhow::Result<Vec<MicroBatch>> {
        let mut step = Vec::with_capacity(count);
        while step.len() < count {
            let batch = match self {
                EpochBatches::Host { loader, .. } => match loader.next() {
                    Some(batch) => Some(MicroBatch::Host(batch?)),
                    None => None,
                },
                EpochBatches::Device(batches) => batches.next(),
            };
            match batch {
                Some(batch) => step.push(batch),
                None => break,
            }
        }
        Ok(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_data::{DistributedSampler, LoaderOptions, Pixels};

    fn dataset(len: usize) -> Arc<Dataset> {
        Arc::new(Dataset {
            images: Pixels::U8((0..len * 12).map(|value| value as u8).collect()),
            labels: (0..len as u32).map(|index| index * 7 % 10).collect(),
            height: 2,
            width: 2,
            channels: 3,
            num_classes: 10,
            class_names: Vec::new(),
        })
    }

    /// The (indices, labels) of each step.
    fn steps(mut batches: EpochBatches, accumulation: usize) -> Vec<Vec<(Vec<usize>, Vec<u32>)>> {
        let mut steps = Vec::new();
        while let Some(step) = batches.next_step(accumulation).unwrap() {
            steps.push(
                step.iter()
                    .map(|batch| (batch.indices().to_vec(), batch.labels().to_vec()))
                    .collect(),
            );
        }
        steps
    }

    /// For several (dataset size, world size, rank, batch size, grad-accum, start batch), the
    /// device path's steps hold exactly the CPU loader's samples and labels, the last partial
    /// batch and a resume included.
    #[test]
    fn the_device_steps_are_the_loaders_steps() {
        let cases = [
            // (dataset, world, rank, batch, accumulation, start_batch)
            (50, 1, 0, 8, 1, 0),
            (50, 1, 0, 8, 1, 3),
            (50, 2, 1, 4, 2, 0),
            (51, 3, 2, 5, 3, 3),
            (37, 4, 0, 3, 2, 2),
            (10, 4, 3, 16, 1, 0),
            (13, 2, 0, 2, 4, 8),
            (13, 2, 1, 2, 4, 100),
        ];
        for (len, world, rank, batch_size, accumulation, start_batch) in cases {
            let set = dataset(len);
            let sampler = DistributedSampler::new(len, world, rank, true, 5, false).unwrap();
            for epoch in [0, 3] {
                let indices = sampler.indices(epoch);
                let loader = Loader::new(
                    Arc::clone(&set),
                    indices.clone(),
                    LoaderOptions {
                        batch_size,
                        epoch,
                        threads: 2,
                        start_batch,
                        ..LoaderOptions::default()
                    },
                )
                .unwrap();
                let host = EpochBatches::host(loader);
                let device = EpochBatches::Device(
                    IndexBatches::new(Arc::clone(&set), indices.clone(), batch_size, start_batch)
                        .unwrap(),
                );
                let case = (
                    len,
                    world,
                    rank,
                    batch_size,
                    accumulation,
                    start_batch,
                    epoch,
                );
                assert_eq!(host.num_batches(), device.num_batches(), "{case:?}");
                let (host, device) = (steps(host, accumulation), steps(device, accumulation));
                assert_eq!(host, device, "{case:?}");
                // The expectation written out: what remains of the order, cut in batches.
                let skipped = (start_batch * batch_size).min(indices.len());
                let flat: Vec<usize> = device
                    .iter()
                    .flatten()
                    .flat_map(|(indices, _)| indices.clone())
                    .collect();
                assert_eq!(flat, indices[skipped..], "{case:?}");
                let last = device.last().and_then(|step| step.last());
                if let Some((last, _)) = last {
                    let partial = (indices.len() - skipped) % batch_size;
                    assert_eq!(last.len(), if partial == 0 { batch_size } else { partial });
                }
                assert!(device.iter().all(|step| step.len() <= accumulation));
            }
        }
    }

    #[test]
    fn bad_index_batches_are_refused() {
        let set = dataset(4);
        let error = IndexBatches::new(Arc::clone(&set), vec![0, 4], 2, 0)
            .err()
            .unwrap();
        assert_eq!(
            error.to_string(),
            "sample index 4, expected below the dataset size 4"
        );
        let error = IndexBatches::new(set, vec![0], 0, 0).err().unwrap();
        assert_eq!(error.to_string(), "batch size 0, expected at least 1");
    }
}
