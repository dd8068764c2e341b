//! Classification metrics over a data set: mean cross-entropy, accuracy, per-class accuracy
//! and the confusion matrix, accumulated batch by batch and summable across processes.

use std::sync::Arc;

use serde::Serialize;
use tandem_data::{Dataset, Loader, LoaderOptions, Normalize};
use tandem_models::TrainingDevice;

/// Sums that make up the metrics of an evaluation; two of them add up to the metrics of
/// the union of their samples, which is how ranks combine their shares.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// Number of classes.
    pub classes: usize,
    /// Sum of the per-sample cross-entropy losses.
    pub loss_sum: f64,
    /// `confusion[true_class * classes + predicted_class]`: how many samples.
    pub confusion: Vec<u64>,
}

/// The metrics a person reads, as `tandem eval --json` prints them.
#[derive(Debug, Serialize)]
pub struct EvaluationReport {
    /// Samples evaluated.
    pub samples: u64,
    /// Mean cross-entropy over the samples.
    pub loss: f64,
    /// Fraction of samples whose top class is the label.
    pub accuracy: f64,
    /// Accuracy among the samples of each true class (0 where a class has none).
    pub per_class_accuracy: Vec<f64>,
    /// Rows: true class; columns: predicted class.
    pub confusion: Vec<Vec<u64>>,
}

impl Evaluation {
    /// An empty evaluation over `classes` classes.
    pub fn new(classes: usize) -> Self {
        Evaluation {
            classes,
            loss_sum: 0.0,
            confusion: vec![0; classes * classes],
        }
    }

    /// Adds one batch of logits (`[labels.len(), classes]`, row-major) and its labels.
    pub fn add_batch(&mut self, logits: &[f32], labels: &[u32]) {
        for (row, &label) in logits.chunks_exact(self.classes).zip(labels) {
            let label = label as usize;
            self.loss_sum += cross_entropy(row, label);
            let predicted = argmax(row);
            if let Some(cell) = self.confusion.get_mut(label * self.classes + predicted) {
                *cell += 1;
            }
        }
    }

    /// Samples counted so far.
    pub fn samples(&self) -> u64 {
        self.confusion.iter().sum()
    }

    /// Mean cross-entropy (0 for no samples).
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.samples().max(1) as f64
    }

    /// Fraction of samples classified correctly (0 for no samples).
    pub fn accuracy(&self) -> f64 {
        let correct: u64 = (0..self.classes)
            .map(|class| self.confusion[class * self.classes + class])
            .sum();
        correct as f64 / self.samples().max(1) as f64
    }

    /// The evaluation as numbers to sum across processes: the loss sum, then the confusion
    /// matrix (counts are exact in f64 up to 2^53).
    pub fn to_sums(&self) -> Vec<f64> {
        std::iter::once(self.loss_sum)
            .chain(self.confusion.iter().map(|&count| count as f64))
            .collect()
    }

    /// The inverse of [`Evaluation::to_sums`].
    pub fn from_sums(classes: usize, sums: &[f64]) -> Self {
        Evaluation {
            classes,
            loss_sum: sums.first().copied().unwrap_or(0.0),
            confusion: sums.iter().skip(1).map(|&count| count as u64).collect(),
        }
    }

    /// The metrics a person reads.
    pub fn report(&self) -> EvaluationReport {
        let per_class_accuracy = (0..self.classes)
            .map(|class| {
                let row = &self.confusion[class * self.classes..(class + 1) * self.classes];
                let total: u64 = row.iter().sum();
                if total == 0 {
                    0.0
                } else {
                    row[class] as f64 / total as f64
                }
            })
            .collect();
        EvaluationReport {
            samples: self.samples(),
            loss: self.loss(),
            accuracy: self.accuracy(),
            per_class_accuracy,
            confusion: self
                .confusion
                .chunks(self.classes.max(1))
                .map(<[u64]>::to_vec)
                .collect(),
        }
    }
}

/// Cross-entropy of one row of logits against `label`, computed stably in f64.
pub fn cross_entropy(logits: &[f32], label: usize) -> f64 {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |max, &value| max.max(value as f64));
    let log_sum_exp = logits
        .iter()
        .map(|&value| (value as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    log_sum_exp - logits.get(label).copied().unwrap_or(0.0) as f64
}

/// Softmax probabilities of one row of logits.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |max, &value| max.max(value as f64));
    let exps: Vec<f64> = logits
        .iter()
        .map(|&value| (value as f64 - max).exp())
        .collect();
    let total: f64 = exps.iter().sum();
    exps.into_iter().map(|value| value / total).collect()
}

/// Index of the largest logit (the first of equals, as `numpy.argmax`).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (index, &value) in logits.iter().enumerate() {
        if value > logits[best] {
            best = index;
        }
    }
    best
}

/// Evaluates the model of `compute` on the samples `indices` of `dataset`, in batches of
/// `batch_size`, on its device; from its copy in device memory when `on_device` (it was
/// uploaded with [`TrainingDevice::upload_eval_set`]).
pub fn evaluate(
    compute: &mut dyn TrainingDevice,
    dataset: &Arc<Dataset>,
    on_device: bool,
    indices: Vec<usize>,
    batch_size: usize,
    normalize: Option<Normalize>,
    loader_threads: usize,
) -> anyhow::Result<Evaluation> {
    let classes = compute.spec().num_classes();
    let mut evaluation = Evaluation::new(classes);
    if on_device {
        // The pixels are in GPU memory: only the indices cross, and the GPU normalizes.
        for batch in indices.chunks(batch_size.max(1)) {
            let labels: Vec<u32> = batch.iter().map(|&index| dataset.labels[index]).collect();
            let logits = compute.forward_eval_on_device(batch, dataset.height, dataset.width)?;
            evaluation.add_batch(logits, &labels);
        }
        return Ok(evaluation);
    }
    let loader = Loader::new(
        Arc::clone(dataset),
        indices,
        LoaderOptions {
            batch_size,
            drop_last: false,
            augment: None,
            normalize,
            seed: 0,
            epoch: 0,
            threads: loader_threads,
            prefetch: 2,
            start_batch: 0,
        },
    )?;
    for batch in loader {
        let batch = batch?;
        let logits =
            compute.forward_eval(&batch.images, batch.len, dataset.height, dataset.width)?;
        evaluation.add_batch(logits, &batch.labels);
    }
    Ok(evaluation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_from_a_known_batch() {
        let mut evaluation = Evaluation::new(3);
        // Predictions: class 0, class 2, class 2; labels 0, 1, 2.
        evaluation.add_batch(&[2.0, 0.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 5.0], &[0, 1, 2]);
        assert_eq!(evaluation.samples(), 3);
        assert!((evaluation.accuracy() - 2.0 / 3.0).abs() < 1e-12);
        let report = evaluation.report();
        assert_eq!(
            report.confusion,
            vec![vec![1, 0, 0], vec![0, 0, 1], vec![0, 0, 1]]
        );
        assert_eq!(report.per_class_accuracy, vec![1.0, 0.0, 1.0]);
        let expected_loss = (cross_entropy(&[2.0, 0.0, 0.0], 0)
            + cross_entropy(&[0.0, 1.0, 3.0], 1)
            + cross_entropy(&[0.0, 0.0, 5.0], 2))
            / 3.0;
        assert!((evaluation.loss() - expected_loss).abs() < 1e-12);
        let summed = Evaluation::from_sums(3, &evaluation.to_sums());
        assert_eq!(summed, evaluation);
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_classes() {
        assert!((cross_entropy(&[0.5; 10], 3) - 10f64.ln()).abs() < 1e-12);
        let probabilities = softmax(&[1.0, 1.0]);
        assert_eq!(probabilities, vec![0.5, 0.5]);
    }
}
