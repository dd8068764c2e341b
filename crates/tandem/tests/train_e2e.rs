//! End-to-end tests of `tandem train`, `eval` and `predict` through the real binary.

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn short_synthetic_run_writes_every_file() {
    let (_dir, out) = run_folder();
    let output = run_bounded(tandem().args(small_synthetic_run(&out)), LIMIT);
    let stdout = expect_success(&output);
    assert_contains(&stdout, "train | epoch: 1 | loss: ");
    assert_contains(&stdout, "val | epoch: 2 | loss: ");
    assert_contains(&stdout, "| accuracy: ");
    for file in [
        "config.toml",
        "metrics.jsonl",
        "curves.png",
        "epoch_1.safetensors",
        "epoch_2.safetensors",
        "snapshot.safetensors",
    ] {
        assert!(out.join(file).is_file(), "{file} was not written");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(records.len(), 2);
    for (index, record) in records.iter().enumerate() {
        assert_eq!(record["epoch"], index as u64 + 1);
        for key in [
            "train_loss",
            "val_loss",
            "val_accuracy",
            "epoch_seconds",
            "images_per_second",
        ] {
            assert!(
                record[key].as_f64().is_some_and(f64::is_finite),
                "{key} in {record}"
            );
        }
        let accuracy = record["val_accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&accuracy));
    }
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert_contains(&config, "batch-size = 32");
    // Rerunning the finished job says it is done and trains nothing more.
    let stdout = rerun_finished(&small_synthetic_run(&out), "2/2 epochs done", LIMIT);
    assert_contains(&stdout, "holds the end of epoch 2");
    assert!(!stdout.contains("resumed from"), "{stdout}");
}

#[test]
fn config_file_is_read_and_flags_override_it() {
    let (dir, out) = run_folder();
    let config = dir.path().join("job.toml");
    std::fs::write(
        &config,
        "epochs = 1\nbatch-size = 16\nlr = 0.5\n[data]\nsynthetic-train = 64\nsynthetic-test = 32\n",
    )
    .unwrap();
    let mut args = small_synthetic_run(&out);
    args.extend(["--config".to_string(), config.display().to_string()]);
    // small_synthetic_run passes --batch-size 32 and --epochs 2: flags win over the file.
    tandem_succeeds(&args, LIMIT);
    let resolved = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert_contains(&resolved, "batch-size = 32");
    assert_contains(&resolved, "lr = 0.05");
    assert_contains(&resolved, "synthetic-train = 192");

    let out2 = dir.path().join("run2");
    let mut args = small_model_train("--threads 1");
    args.extend([
        "--config".to_string(),
        config.display().to_string(),
        "--output-dir".to_string(),
        out2.display().to_string(),
    ]);
    tandem_succeeds(&args, LIMIT);
    let resolved = std::fs::read_to_string(out2.join("config.toml")).unwrap();
    assert_contains(&resolved, "batch-size = 16");
    assert_contains(&resolved, "synthetic-train = 64");
    assert_contains(&resolved, "epochs = 1");
}

#[test]
fn bad_settings_are_refused_with_their_name() {
    let dir = tempfile::tempdir().unwrap();
    let args = with_flag(
        small_synthetic_run(&dir.path().join("run")),
        "--batch-size",
        "0",
    );
    let output = run_bounded(tandem().args(&args), LIMIT);
    let stderr = expect_failure(&output);
    assert_contains(&stderr, "--batch-size must be at least 1");

    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "epochz = 3\n").unwrap();
    let output = run_bounded(
        tandem().args(["train", "--config", &config.display().to_string()]),
        LIMIT,
    );
    let stderr = expect_failure(&output);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("epochz"),
        "{stderr}"
    );
}

#[test]
fn resume_after_kill_mid_epoch_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    tandem_succeeds(synthetic_run(&straight, 1024), LIMIT);

    let interrupted = dir.path().join("interrupted");
    let args = with_flag(
        synthetic_run(&interrupted, 1024),
        "--snapshot-every-steps",
        "1",
    );
    // Kill as soon as a mid-epoch snapshot (step 2 of epoch 1) exists.
    kill_after_second_snapshot(&args, &interrupted, LIMIT);
    let resumed = run_bounded(tandem().args(&args), LIMIT);
    let stdout = expect_success(&resumed);
    assert_contains(&stdout, "Resuming training from snapshot");
    assert_epochs_as_straight(
        &straight,
        &interrupted,
        2..=2,
        " (the resumed run's final weights)",
    );
}

#[test]
fn conflicting_resume_setting_is_named() {
    let (_dir, out) = run_folder();
    let args = with_flag(small_synthetic_run(&out), "--max-steps", "2");
    tandem_succeeds(&args, LIMIT);
    let changed = with_flag(small_synthetic_run(&out), "--lr", "0.2");
    let output = run_bounded(tandem().args(&changed), LIMIT);
    let stderr = expect_failure(&output);
    assert_contains(&stderr, "--lr is 0.2, the snapshot has 0.05");
}

#[test]
fn corrupt_snapshot_is_reported_and_the_previous_one_used() {
    let (_dir, out) = run_folder();
    let args = with_flag(small_synthetic_run(&out), "--snapshot-every-steps", "1");
    let mut first = args.clone();
    first.extend(["--max-steps".to_string(), "3".to_string()]);
    tandem_succeeds(&first, LIMIT);
    let snapshot = out.join("snapshot.safetensors");
    let mut bytes = std::fs::read(&snapshot).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&snapshot, bytes).unwrap();
    let output = run_bounded(tandem().args(&args), LIMIT);
    let stdout = expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_contains(&stderr, "checksum does not match");
    assert_contains(&stderr, "snapshot.safetensors.prev");
    assert_contains(
        &stdout,
        "Resuming training from snapshot at epoch 1, step 2",
    );
}

#[test]
fn eval_and_predict_on_a_saved_checkpoint() {
    tandem_testdata::skip_without_shared!();
    let shared = tandem_testdata::shared_dir();
    let (_dir, out) = run_folder();
    tandem_succeeds(small_synthetic_run(&out), LIMIT);
    let checkpoint = out.join("epoch_2.safetensors").display().to_string();

    let mut eval_args: Vec<String> = vec!["eval".into(), "--checkpoint".into(), checkpoint.clone()];
    eval_args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    eval_args.extend(
        [
            "--data",
            "synthetic",
            "--synthetic-train",
            "192",
            "--synthetic-test",
            "64",
            "--seed",
            "7",
            "--threads",
            "1",
        ]
        .iter()
        .map(|arg| arg.to_string()),
    );
    let text = tandem_succeeds(&eval_args, LIMIT);
    assert_contains(&text, "samples: 64");
    assert_contains(&text, "confusion matrix");
    eval_args.push("--json".into());
    let json = tandem_succeeds(&eval_args, LIMIT);
    let report: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let confusion = report["confusion"].as_array().unwrap();
    assert_eq!(confusion.len(), 10);
    let total: u64 = confusion
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|cell| cell.as_u64().unwrap())
        })
        .sum();
    assert_eq!(total, 64);
    let correct: u64 = (0..10)
        .map(|class| confusion[class][class].as_u64().unwrap())
        .sum();
    let accuracy = report["accuracy"].as_f64().unwrap();
    assert!((accuracy - correct as f64 / 64.0).abs() < 1e-12);
    assert_eq!(report["per_class_accuracy"].as_array().unwrap().len(), 10);
    // The metrics file's last validation accuracy is the same evaluation.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!((last["val_accuracy"].as_f64().unwrap() - accuracy).abs() < 1e-12);

    let images = shared.join("data/cifar10/json-subset/test_cifar10");
    let mut pngs: Vec<_> = std::fs::read_dir(&images)
        .unwrap_or_else(|_| panic!("missing {}", images.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    pngs.sort();
    let mut predict_args: Vec<String> = vec!["predict".into(), "--checkpoint".into(), checkpoint];
    predict_args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    predict_args.push("--json".into());
    predict_args.extend(pngs.iter().take(2).map(|path| path.display().to_string()));
    let lines = tandem_succeeds(&predict_args, LIMIT);
    let predictions: Vec<serde_json::Value> = lines
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(predictions.len(), 2);
    for prediction in &predictions {
        assert_eq!(prediction["logits"].as_array().unwrap().len(), 10);
        let probabilities: f64 = prediction["probabilities"]
            .as_array()
            .unwrap()
            .iter()
            .map(|value| value.as_f64().unwrap())
            .sum();
        assert!((probabilities - 1.0).abs() < 1e-9);
        let top = &prediction["top"][0];
        let logits: Vec<f64> = prediction["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|value| value.as_f64().unwrap())
            .collect();
        let best = (0..10).fold(0, |best, class| {
            if logits[class] > logits[best] {
                class
            } else {
                best
            }
        });
        assert_eq!(top["class"].as_u64().unwrap() as usize, best);
        assert!(prediction["file"].as_str().unwrap().ends_with(".png"));
    }
}

#[test]
fn one_epoch_of_real_cifar10_beats_chance_by_far() {
    tandem_testdata::skip_without_shared!();
    let shared = tandem_testdata::shared_dir();
    let data_dir = shared.join("data/cifar10");
    assert!(
        data_dir.join("cifar-10-batches-bin.tar.gz").is_file(),
        "missing {}/cifar-10-batches-bin.tar.gz",
        data_dir.display()
    );
    let (_dir, out) = run_folder();
    let output = run_bounded(
        tandem().args([
            "train",
            "--model",
            "resnet-base",
            "--data",
            "cifar10-bin",
            "--data-dir",
            &data_dir.display().to_string(),
            "--mean",
            "0.485,0.456,0.406",
            "--std",
            "0.229,0.224,0.225",
            "--epochs",
            "1",
            "--batch-size",
            "128",
            "--optimizer",
            "sgd",
            "--momentum",
            "0.9",
            "--nesterov",
            "--lr",
            "0.05",
            "--weight-decay",
            "5e-4",
            "--output-dir",
            &out.display().to_string(),
        ]),
        Duration::from_secs(900),
    );
    expect_success(&output);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let accuracy = record["val_accuracy"].as_f64().unwrap();
    assert!(
        accuracy >= 0.30,
        "1 epoch reached only {accuracy} test accuracy"
    );
}

/// `tandem ... | head` closes the output early: the job ends normally, without a panic.
#[test]
fn closed_standard_output_is_not_a_panic() {
    let mut child = common::tandem()
        .args(["bench", "step", "--model", "resnet-base", "--batch", "4"])
        .args(["--steps", "1", "--threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("cannot start tandem");
    drop(child.stdout.take());
    let output = wait_bounded(child, Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && !stderr.contains("panicked"),
        "status {:?}, stderr:\n{stderr}",
        output.status
    );
}
