//! The per-epoch record of a run, kept in the snapshot and written out as `metrics.jsonl`
//! and `curves.png` after every epoch.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::files::write_atomically;
use crate::plot::{render_training_curves, CurvePoint};

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
}

/// Rewrites `metrics.jsonl` (one JSON object per epoch) and `curves.png` in `output_dir`.
pub fn write_history(output_dir: &Path, history: &[EpochRecord]) -> anyhow::Result<()> {
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
    write_atomically(
        &output_dir.join("curves.png"),
        &render_training_curves(&points)?,
    )
}
