//! Helpers of the multi-node elastic tests: the run they train, bounded waits for progress,
//! and the step a snapshot holds.

use std::path::Path;
use std::time::{Duration, Instant};

use super::small_model_train;

/// Bound on each wait for progress or for a line.
pub const WAIT: Duration = Duration::from_secs(90);

/// 80 steps of 128 samples in one epoch, in 8 shards of 16, a snapshot after every step.
pub fn elastic_train_args(output_dir: &Path) -> Vec<String> {
    elastic_train_args_of(output_dir, 80)
}

/// [`elastic_train_args`] with `steps` steps.
pub fn elastic_train_args_of(output_dir: &Path, steps: usize) -> Vec<String> {
    let mut args = small_model_train(&format!(
        "--data synthetic --synthetic-train {} --synthetic-test 64 --epochs 1 \
         --global-batch-size 128 --batch-size 16 --threads 1 --seed 5 --device cpu \
         --log-every-steps 0 --optimizer sgd --momentum 0.9 --nesterov --lr 0.05 \
         --snapshot-every-steps 1",
        steps * 128
    ));
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    args
}

/// Waits until `check` holds, at most [`WAIT`]; `what` says what was awaited.
pub fn wait_until(what: &str, mut check: impl FnMut() -> bool, explain: impl Fn() -> String) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        if Instant::now() >= deadline {
            panic!("{what} did not happen within {WAIT:?}\n{}", explain());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The optimizer steps of the snapshot in `output_dir`, if one is there.
pub fn snapshot_step(output_dir: &Path) -> Option<u64> {
    let bytes = std::fs::read(output_dir.join("snapshot.safetensors")).ok()?;
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).ok()?;
    let description = metadata.metadata().as_ref()?.get("tandem.snapshot")?;
    let description: serde_json::Value = serde_json::from_str(description).ok()?;
    description["progress"]["global_step"].as_u64()
}
