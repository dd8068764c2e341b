//! The per-epoch record of a run, kept in the snapshot and written out as `metrics.jsonl`
//! and `curves.png` after every epoch.

use std::path::Path;

use serde::{Deserialize, Serialize};

use tandem_models::ModelSpec;

use crate::files::write_atomically;
use crate::model_args::value_name;
use crate::model_args::ModelArgs;
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

/// The title of `curves.png`: the run folder (as the user gave it) and the model, as
/// `--model` names it.
pub fn curves_title(run_folder: &str, spec: &ModelSpec) -> String {
    let model = ModelArgs::from_spec(spec)
        .model
        .map(|kind| value_name(&kind))
        .unwrap_or_default();
    format!("{run_folder} | {model}")
}

/// Rewrites `metrics.jsonl` (one JSON object per epoch) and `curves.png` (under `title`)
/// in `output_dir`.
pub fn write_history(
    output_dir: &Path,
    history: &[EpochRecord],
    title: &str,
) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_curves_are_titled_with_the_run_folder_and_model() {
        assert_eq!(
            curves_title("runs/demo", &ModelSpec::ResNet18 { num_classes: 10 }),
            "runs/demo | resnet18"
        );
        let base = ModelSpec::ResNetBase(tandem_models::ResNetBaseSpec::tutorial_default());
        assert_eq!(
            curves_title("s3://runs/a", &base),
            "s3://runs/a | resnet-base"
        );
    }
}
