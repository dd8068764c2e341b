//! What a run reports as it trains: the per-epoch record ([`EpochRecord`]), written out
//! after every epoch as `metrics.jsonl` and `curves.png` ([`curves`]), and TensorBoard event
//! files ([`tensorboard`]). It knows nothing of models, devices or processes.

pub mod curves;
pub mod tensorboard;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tandem_files::{write_atomically, FileError};

use curves::{render_training_curves, CurvePoint};

/// Why a report of the run could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// `metrics.jsonl` or `curves.png` could not be written.
    #[error(transparent)]
    File(#[from] FileError),
    /// A record could not be encoded as JSON.
    #[error("cannot encode an epoch's record")]
    Json(#[from] serde_json::Error),
    /// The curves could not be encoded as PNG.
    #[error("encoding the training curves as PNG")]
    Png(#[source] image::ImageError),
    /// An event file could not be created or written.
    #[error("cannot {action} event file {}", .path.display())]
    EventFile {
        /// "create" or "write".
        action: &'static str,
        /// The event file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

/// What one epoch of training measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// The epoch, counting from 1 as the tutorials print it.
    pub epoch: u64,
    /// Mean training loss over the epoch's steps (over all ranks).
    pub train_loss: f64,
    /// Mean cross-entropy on the test split.
    pub val_loss: f64,
    /// Accuracy on the test split.
    pub val_accuracy: f64,
    /// Wall-clock seconds of the epoch's training steps.
    pub epoch_seconds: f64,
    /// Training images per second over all ranks.
    pub images_per_second: f64,
    /// Learning rate of the epoch's last step.
    pub lr: f64,
    /// Optimizer steps in the epoch.
    pub steps: u64,
    /// The changes of the job's number of processes during the epoch, when it resumed on
    /// another number than it stopped with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub world_size_changes: Vec<WorldSizeChange>,
}

/// A run resumed on another number of processes than it stopped with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldSizeChange {
    /// The optimizer steps taken before the change, in the whole run.
    pub step: u64,
    /// The number of processes before.
    pub from: usize,
    /// The number of processes after.
    pub to: usize,
}

/// Rewrites `metrics.jsonl` (one JSON object per epoch) and `curves.png` (under `title`)
/// in `output_dir`.
pub fn write_history(
    output_dir: &Path,
    history: &[EpochRecord],
    title: &str,
) -> Result<(), MetricsError> {
    let mut lines = String::new();
    for record in history {
        lines.push_str(&serde_json::to_string(record)?);
        lines.push('\n');
    }
    write_atomically(&output_dir.join("metrics.jsonl"), lines.as_bytes())?;
    let points: Vec<CurvePoint> = history
        .iter()
        .map(|record| CurvePoint {
            epoch: record.epoch,
            train_loss: record.train_loss,
            val_loss: record.val_loss,
            val_accuracy: record.val_accuracy,
        })
        .collect();
    let png = render_training_curves(title, &points)?;
    Ok(write_atomically(&output_dir.join("curves.png"), &png)?)
}
