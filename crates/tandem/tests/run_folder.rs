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

/// Waits until `path` exists and is not empty, failing past `LIMIT`.
fn wait_for_content(path: &Path, child: &mut std::process::Child) {
    let deadline = std::time::Instant::now() + LIMIT;
    while std::fs::metadata(path).map_or(true, |meta| meta.len() == 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "{} did not appear",
            path.display()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the first run ended before {} appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_busy_output_folder_is_refused_and_a_stale_lock_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let long_run = with_flag(synthetic_run(&out, 4096), "--epochs", "50");
    let mut first = tandem()
        .args(&long_run)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lock = out.join("tandem.lock");
    wait_for_content(&lock, &mut first);

    let second = run_bounded(tandem().args(one_epoch_run(&out)), LIMIT);
    let first_pid = first.id();
    let _ = first.kill();
    let _ = first.wait();
    assert!(
        !second.status.success(),
        "a second run into a busy folder ran"
    );
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("is in use by another run (pid ")
            && stderr.contains(&format!("pid {first_pid} on host ")),
        "{stderr}"
    );

    // The first run was killed: its lock is stale, and the next run takes it over.
    let third = run_bounded(tandem().args(one_epoch_run(&out)), LIMIT);
    expect_success(&third);
    let stderr = String::from_utf8_lossy(&third.stderr);
    assert!(
        stderr.contains(&format!("taking over the lock of {}", out.display()))
            && stderr.contains(&format!("pid {first_pid} on host "))
            && stderr.contains("is no longer running"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), "");
}

#[test]
fn a_finished_run_says_so_and_fresh_starts_over_keeping_the_old_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    expect_success(&run_bounded(tandem().args(one_epoch_run(&out)), LIMIT));
    let first_weights = std::fs::read(out.join("epoch_1.safetensors")).unwrap();

    let again = run_bounded(tandem().args(one_epoch_run(&out)), LIMIT);
    let stdout = expect_success(&again);
    assert!(
        stdout.contains("1/1 epochs done; raise --epochs to continue"),
        "{stdout}"
    );
    assert!(!stdout.contains("Resuming"), "{stdout}");
    assert!(!stdout.contains("train | epoch"), "{stdout}");

    let mut fresh = one_epoch_run(&out);
    fresh.push("--fresh".to_string());
    let output = run_bounded(tandem().args(&fresh), LIMIT);
    let stdout = expect_success(&output);
    let line = stdout
        .lines()
        .find(|line| {
            line.starts_with("Starting over (--fresh): the previous run's files are now in ")
        })
        .unwrap_or_else(|| panic!("no line says where the old files went:\n{stdout}"));
    let aside = Path::new(line.rsplit(" now in ").next().unwrap());
    assert!(
        aside.starts_with(&out)
            && aside
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("previous-")
    );
    assert_eq!(
        std::fs::read(aside.join("epoch_1.safetensors")).unwrap(),
        first_weights
    );
    assert!(aside.join("snapshot.safetensors").is_file());
    assert!(aside.join("metrics.jsonl").is_file());
    assert!(stdout.contains("train | epoch: 1"), "{stdout}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1, "{metrics}");
}

#[test]
fn more_epochs_continue_a_constant_schedule_and_a_conflict_names_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    expect_success(&run_bounded(tandem().args(one_epoch_run(&out)), LIMIT));

    let longer = with_flag(one_epoch_run(&out), "--epochs", "2");
    let stdout = expect_success(&run_bounded(tandem().args(&longer), LIMIT));
    assert!(
        stdout.contains("Resuming training from snapshot at epoch 2, step 0"),
        "{stdout}"
    );
    assert!(stdout.contains("train | epoch: 2"), "{stdout}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");

    let snapshot = out.join("snapshot.safetensors");
    let changed = with_flag(longer.clone(), "--lr", "0.2");
    let output = run_bounded(tandem().args(&changed), LIMIT);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--lr is 0.2, the snapshot has 0.05")
            && stderr.contains(&format!(
                "--init-from {} --output-dir NEW",
                snapshot.display()
            ))
            && stderr.contains("--fresh"),
        "{stderr}"
    );

    // The way out: a new run from the snapshot's weights, with its own settings.
    let new_out = dir.path().join("lower-lr");
    let mut from_weights = with_flag(changed, "--output-dir", &new_out.display().to_string());
    from_weights.extend(["--init-from".to_string(), snapshot.display().to_string()]);
    let stdout = expect_success(&run_bounded(tandem().args(&from_weights), LIMIT));
    assert!(!stdout.contains("Resuming"), "{stdout}");
    assert!(stdout.contains("train | epoch: 2"), "{stdout}");
}

#[test]
fn more_epochs_of_a_onecycle_run_are_refused_with_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let onecycle = with_flag(one_epoch_run(&out), "--lr-schedule", "onecycle");
    expect_success(&run_bounded(tandem().args(&onecycle), LIMIT));
    let output = run_bounded(tandem().args(with_flag(onecycle, "--epochs", "3")), LIMIT);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--epochs is 3, the snapshot has 1") && stderr.contains("--init-from"),
        "{stderr}"
    );
}

/// Starts a long run into `out`, waits until it trains (its first periodic snapshot), sends
/// it `signal`, and returns its exit code and standard error.
fn stop_a_run_with(signal: libc::c_int, out: &Path) -> (Option<i32>, String) {
    let mut args = with_flag(synthetic_run(out, 4096), "--epochs", "50");
    args.extend(["--snapshot-every-steps".to_string(), "1".to_string()]);
    let mut child = tandem()
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_content(&out.join("snapshot.safetensors"), &mut child);
    // SAFETY: `kill` has no memory-safety preconditions; the child is not reaped yet.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
    let output = wait_bounded(child, LIMIT);
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

#[test]
fn a_stopped_run_exits_130_after_sigint_and_143_after_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    for (signal, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let out = dir.path().join(format!("run-{signal}"));
        let (exit_code, stderr) = stop_a_run_with(signal, &out);
        assert_eq!(exit_code, Some(code), "{stderr}");
        assert!(
            stderr.contains("Stopped on request at epoch 1, step "),
            "{stderr}"
        );
        assert!(out.join("snapshot.safetensors").is_file());
    }
}

#[test]
fn max_steps_and_zero_epochs_say_why_the_run_ended() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = with_flag(one_epoch_run(&out), "--max-steps", "2");
    let output = run_bounded(tandem().args(&args), LIMIT);
    expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("Stopped after --max-steps 2 at epoch 1, step 2; the snapshot is "),
        "{stderr}"
    );
    let zero = with_flag(one_epoch_run(&dir.path().join("zero")), "--epochs", "0");
    let stdout = expect_success(&run_bounded(tandem().args(&zero), LIMIT));
    assert!(
        stdout.contains("--epochs is 0: nothing to train"),
        "{stdout}"
    );
}
