//! End-to-end tests of the run folder as a contract: `config.toml` reads back, paths move
//! with `--output-dir`, a lock, a finished run, `--fresh`, `--init-from` a snapshot, exit
//! codes, the banner and the TensorBoard event files.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// A one-epoch synthetic run of the small model into `out`.
fn one_epoch_run(out: &Path) -> Vec<String> {
    with_flag(synthetic_run(out, 96), "--epochs", "1")
}

#[test]
fn a_runs_own_config_gives_the_same_run_and_output_dir_moves_it() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("a");
    expect_success(&run_bounded(tandem().args(one_epoch_run(&first)), LIMIT));
    let config = first.join("config.toml");
    let written = std::fs::read_to_string(&config).unwrap();
    assert!(!written.contains("\nsnapshot ="), "{written}");
    let snapshot_before = std::fs::read(first.join("snapshot.safetensors")).unwrap();

    let second = dir.path().join("b");
    let output = run_bounded(
        tandem().args([
            "train",
            "--config",
            &config.display().to_string(),
            "--output-dir",
            &second.display().to_string(),
        ]),
        LIMIT,
    );
    let stdout = expect_success(&output);
    assert!(!stdout.contains("Resuming"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(second.join("config.toml")).unwrap(),
        written.replace(
            &format!("output-dir = \"{}\"", first.display()),
            &format!("output-dir = \"{}\"", second.display())
        )
    );
    assert_eq!(
        std::fs::read(first.join("snapshot.safetensors")).unwrap(),
        snapshot_before,
        "the first run's snapshot was written over"
    );
    assert_eq!(
        std::fs::read(second.join("epoch_1.safetensors")).unwrap(),
        std::fs::read(first.join("epoch_1.safetensors")).unwrap(),
        "the same settings gave other weights"
    );
    let metrics = std::fs::read_to_string(second.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1, "{metrics}");
}
