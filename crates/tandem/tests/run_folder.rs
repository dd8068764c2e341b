//! End-to-end tests of the run folder as a contract: `config.toml` reads back, paths move
//! with `--output-dir`, a lock, a finished run, `--fresh`, `--init-from` a snapshot, exit
//! codes, the banner and the TensorBoard event files.

mod common;

use std::os::unix::process::ExitStatusExt;
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
    tandem_succeeds(one_epoch_run(&first), LIMIT);
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

/// Starts `tandem <args>` in the background, its standard output discarded and its
/// standard error going to `stderr`.
fn spawn_tandem(args: &[String], stderr: std::process::Stdio) -> std::process::Child {
    tandem()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start the tandem binary")
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
    let (_dir, out) = run_folder();
    let long_run = with_flag(synthetic_run(&out, 4096), "--epochs", "50");
    let mut first = spawn_tandem(&long_run, std::process::Stdio::null());
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
    let (_dir, out) = run_folder();
    tandem_succeeds(one_epoch_run(&out), LIMIT);
    let first_weights = std::fs::read(out.join("epoch_1.safetensors")).unwrap();

    let stdout = rerun_finished(&one_epoch_run(&out), "1/1 epoch done", LIMIT);
    assert!(!stdout.contains("Resuming"), "{stdout}");

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
    assert_contains(&stdout, "train | epoch: 1");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1, "{metrics}");
}

#[test]
fn more_epochs_continue_a_constant_schedule_and_a_conflict_names_the_way_out() {
    let (dir, out) = run_folder();
    tandem_succeeds(one_epoch_run(&out), LIMIT);

    let longer = with_flag(one_epoch_run(&out), "--epochs", "2");
    let stdout = tandem_succeeds(&longer, LIMIT);
    assert_contains(
        &stdout,
        "Resuming training from snapshot: 1 epoch run, continuing with epoch 2 of 2\n",
    );
    let snapshot = out.join("snapshot.safetensors");
    assert_contains(
        &stdout,
        &format!(
            "output: {} | resumed from {} after 1 epoch\n",
            out.display(),
            snapshot.display()
        ),
    );
    assert_contains(&stdout, "train | epoch: 2");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");

    let changed = with_flag(longer.clone(), "--lr", "0.2");
    let output = run_bounded(tandem().args(&changed), LIMIT);
    let stderr = expect_failure(&output);
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
    let stdout = tandem_succeeds(&from_weights, LIMIT);
    assert!(!stdout.contains("Resuming"), "{stdout}");
    assert_contains(&stdout, "train | epoch: 2");
}

#[test]
fn more_epochs_of_a_onecycle_run_are_refused_with_the_way_out() {
    let (_dir, out) = run_folder();
    let onecycle = with_flag(one_epoch_run(&out), "--lr-schedule", "onecycle");
    tandem_succeeds(&onecycle, LIMIT);
    let output = run_bounded(tandem().args(with_flag(onecycle, "--epochs", "3")), LIMIT);
    assert!(!output.status.success());
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let snapshot = out.join("snapshot.safetensors");
    assert!(
        stderr.ends_with(&format!(
            "error: settings conflict with the snapshot {snapshot}: --epochs is 3, the snapshot \
             has 1: the onecycle schedule's curve depends on the number of epochs, so it cannot \
             be raised on resume (a constant or step schedule could). To resume it, use the \
             settings it was written with; to change them, start a new run from its weights \
             with --init-from {snapshot} --output-dir NEW, or start over here with --fresh\n",
            snapshot = snapshot.display()
        )),
        "{stderr}"
    );
}

/// Starts a long run into `out`, waits until it trains (its first periodic snapshot), sends
/// it `signal`, and returns its exit status as a shell reports it (128 + the signal for a
/// process that ended on one) and its standard error.
fn stop_a_run_with(signal: libc::c_int, out: &Path) -> (Option<i32>, String) {
    let mut args = with_flag(synthetic_run(out, 4096), "--epochs", "50");
    args.extend(["--snapshot-every-steps".to_string(), "1".to_string()]);
    let mut child = spawn_tandem(&args, std::process::Stdio::piped());
    wait_for_content(&out.join("snapshot.safetensors"), &mut child);
    send_signal(child.id(), signal);
    let output = wait_bounded(child, LIMIT);
    let shell_status = output
        .status
        .code()
        .or_else(|| output.status.signal().map(|signal| 128 + signal));
    (
        shell_status,
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
        // One line says where the run stopped; a stop on request is no error.
        let stopped: Vec<&str> = stderr
            .lines()
            .filter(|line| line.contains("at epoch 1, step ") && !line.starts_with("epoch "))
            .collect();
        assert_eq!(stopped.len(), 1, "{stderr}");
        assert!(
            stopped[0].starts_with("Stopped on request at epoch 1, step ")
                && stopped[0].ends_with(&format!(
                    "; the snapshot is {}",
                    out.join("snapshot.safetensors").display()
                )),
            "{stderr}"
        );
        assert!(!stderr.contains("error"), "{stderr}");
        assert!(out.join("snapshot.safetensors").is_file());
    }
}

#[test]
fn a_stop_signal_ends_a_rank_still_waiting_for_its_group_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let port = free_port();
    // Rank 0 of two serves the store, then waits for rank 1, which never comes.
    let child = tandem()
        .args(synthetic_run(&out, 256))
        .env("RANK", "0")
        .env("LOCAL_RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TANDEM_JOB_TOKEN", "stop-while-forming-token")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the tandem binary");
    let deadline = std::time::Instant::now() + LIMIT;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "rank 0 never served the store"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    send_signal(child.id(), libc::SIGTERM);
    // Well within the group's formation timeout, which is minutes.
    let output = wait_bounded(child, Duration::from_secs(10));
    assert_eq!(output.status.code(), Some(143), "{output:?}");
    assert!(!out.join("snapshot.safetensors").exists());
}

#[test]
fn max_steps_and_zero_epochs_say_why_the_run_ended() {
    let (dir, out) = run_folder();
    let args = with_flag(one_epoch_run(&out), "--max-steps", "2");
    let output = run_bounded(tandem().args(&args), LIMIT);
    expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("Stopped after --max-steps 2 at epoch 1, step 2; the snapshot is "),
        "{stderr}"
    );
    let zero = with_flag(one_epoch_run(&dir.path().join("zero")), "--epochs", "0");
    let stdout = tandem_succeeds(&zero, LIMIT);
    assert_contains(&stdout, "--epochs is 0: nothing to train");
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// One decoded `Event`: its step, its file version if any, its session log's status if
/// any, and its scalars.
#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    session_status: Option<u64>,
    scalars: Vec<(String, f32)>,
}

/// `SessionLog.SessionStatus.START`.
const SESSION_START: u64 = 1;

/// Reads a protobuf varint at `*at`.
fn read_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = bytes[*at];
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
    }
    panic!("varint longer than 10 bytes");
}

/// The fields of a protobuf message: (field number, wire type, raw value bytes or varint).
fn read_fields(bytes: &[u8]) -> Vec<(u64, u64, Vec<u8>, u64)> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let key = read_varint(bytes, &mut at);
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => fields.push((field, wire, Vec::new(), read_varint(bytes, &mut at))),
            1 => {
                fields.push((field, wire, bytes[at..at + 8].to_vec(), 0));
                at += 8;
            }
            2 => {
                let length = read_varint(bytes, &mut at) as usize;
                fields.push((field, wire, bytes[at..at + length].to_vec(), 0));
                at += length;
            }
            5 => {
                fields.push((field, wire, bytes[at..at + 4].to_vec(), 0));
                at += 4;
            }
            other => panic!("unexpected wire type {other}"),
        }
    }
    fields
}

/// Reads an event file, checking both CRCs of every record.
fn read_event_file(path: &Path) -> Vec<Event> {
    parse_events(&std::fs::read(path).unwrap())
}

/// The events of a file that may be being written, or was cut by a kill: its whole
/// records, as TensorBoard reads it.
fn read_events_so_far(path: &Path) -> Vec<Event> {
    parse_events(whole_records(&std::fs::read(path).unwrap()))
}

/// The whole records at the start of a file that is being written.
fn whole_records(bytes: &[u8]) -> &[u8] {
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 8) {
        let end = at + 16 + u64::from_le_bytes(header.try_into().unwrap()) as usize;
        if end > bytes.len() {
            break;
        }
        at = end;
    }
    &bytes[..at]
}

/// The events of an event file's bytes, checking both CRCs of every record.
fn parse_events(bytes: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = &bytes[at..at + 8];
        let length = u64::from_le_bytes(header.try_into().unwrap()) as usize;
        let length_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(
            length_crc,
            masked_crc(header),
            "length CRC of the record at {at}"
        );
        let data = &bytes[at + 12..at + 12 + length];
        let data_crc = u32::from_le_bytes(
            bytes[at + 12 + length..at + 16 + length]
                .try_into()
                .unwrap(),
        );
        assert_eq!(data_crc, masked_crc(data), "data CRC of the record at {at}");
        at += 16 + length;
        let mut event = Event::default();
        for (field, wire, raw, varint) in read_fields(data) {
            match (field, wire) {
                (1, 1) => event.wall_time = f64::from_le_bytes(raw.try_into().unwrap()),
                (2, 0) => event.step = varint as i64,
                (3, 2) => event.file_version = Some(String::from_utf8(raw).unwrap()),
                (7, 2) => {
                    for (field, wire, _, status) in read_fields(&raw) {
                        assert_eq!((field, wire), (1, 0), "unexpected SessionLog field");
                        event.session_status = Some(status);
                    }
                }
                (5, 2) => {
                    for (_, _, value, _) in read_fields(&raw) {
                        let mut tag = String::new();
                        let mut simple = None;
                        for (field, wire, raw, _) in read_fields(&value) {
                            match (field, wire) {
                                (1, 2) => tag = String::from_utf8(raw).unwrap(),
                                (2, 5) => {
                                    simple = Some(f32::from_le_bytes(raw.try_into().unwrap()))
                                }
                                other => panic!("unexpected Summary.Value field {other:?}"),
                            }
                        }
                        event.scalars.push((tag, simple.expect("no simple_value")));
                    }
                }
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        events.push(event);
    }
    events
}

#[test]
fn a_run_prints_a_banner_and_writes_tensorboard_scalars() {
    let (_dir, out) = run_folder();
    // 96 images in batches of 32: 3 steps an epoch, 6 in all; a scalar every 2 steps.
    let mut args = with_flag(one_epoch_run(&out), "--epochs", "2");
    args.extend(["--log-every-steps".to_string(), "2".to_string()]);
    let stdout = tandem_succeeds(&args, LIMIT);
    for expected in [
        "device: cpu | 1 compute thread per process | world size 1",
        "data: synthetic | 96 training, 64 test images (32x32) | normalize: none",
        "model: resnet-base (blocks 1,1,1, channels 8,16,32, bottlenecks none, first kernel 3), 10 classes | ",
        "global batch 32 (32 per process x 1 process x 1 accumulated) | 2 epochs\n",
        "optimizer: sgd (momentum 0.9) | lr 0.05 | schedule: constant\n",
        &format!("output: {} | fresh", out.display()),
    ] {
        assert!(stdout.contains(expected), "no '{expected}' in:\n{stdout}");
    }

    let files: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = read_event_file(&files[0]);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].wall_time > 1.6e9, "{:?}", events[0]);
    assert_eq!(
        (events[1].step, events[1].session_status),
        (1, Some(SESSION_START))
    );
    let series = |tag: &str| -> Vec<(i64, f32)> {
        events
            .iter()
            .flat_map(|event| {
                event
                    .scalars
                    .iter()
                    .filter(|(name, _)| name == tag)
                    .map(move |(_, value)| (event.step, *value))
            })
            .collect()
    };
    let steps = |tag: &str| {
        series(tag)
            .iter()
            .map(|(step, _)| *step)
            .collect::<Vec<_>>()
    };
    assert_eq!(steps("train/loss"), [2, 4, 6]);
    assert_eq!(steps("train/images_per_second"), [2, 4, 6]);
    assert!(series("train/lr").iter().all(|(_, lr)| *lr == 0.05));
    assert!(series("train/images_per_second")
        .iter()
        .all(|(_, rate)| *rate > 0.0));

    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    for (tag, key) in [
        ("epoch/train_loss", "train_loss"),
        ("epoch/val_loss", "val_loss"),
        ("epoch/val_accuracy", "val_accuracy"),
        ("epoch/images_per_second", "images_per_second"),
        ("epoch/lr", "lr"),
    ] {
        let expected: Vec<(i64, f32)> = metrics
            .iter()
            .map(|record| {
                (
                    record["epoch"].as_i64().unwrap(),
                    record[key].as_f64().unwrap() as f32,
                )
            })
            .collect();
        assert_eq!(series(tag), expected, "{tag}");
    }
}

/// The event files of `folder`, oldest first (their names start with the time); none
/// while the folder does not exist.
fn event_files(folder: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("events.out.tfevents."))
        })
        .collect();
    files.sort();
    files
}

/// The steps of `train/loss` in one file's events.
fn loss_steps(events: &[Event]) -> Vec<i64> {
    events
        .iter()
        .filter(|event| event.scalars.iter().any(|(tag, _)| tag == "train/loss"))
        .map(|event| event.step)
        .collect()
}

/// What TensorBoard shows of a run folder's files, read in name order as its
/// `EventAccumulator` reads them (file version 2): a `SessionLog` START at step S drops
/// everything read so far at S or later; each scalar is (tag, step, value).
fn scalars_as_tensorboard_keeps_them(files: &[std::path::PathBuf]) -> Vec<(String, i64, f32)> {
    let mut kept: Vec<(String, i64, f32)> = Vec::new();
    for file in files {
        for event in read_events_so_far(file) {
            if event.session_status == Some(SESSION_START) {
                kept.retain(|(_, step, _)| *step < event.step);
            }
            for (tag, value) in event.scalars {
                kept.push((tag, event.step, value));
            }
        }
    }
    kept
}

/// `train/loss` as TensorBoard's own `EventAccumulator` reads `folder`: (step, value)
/// pairs; None (saying why) where Python's `tensorboard` package is missing, which fails
/// the test where `CI` is set (`.ci/run` installs it), as a missing program does.
fn losses_read_by_tensorboard(folder: &Path) -> Option<Vec<(i64, f32)>> {
    const SCRIPT: &str = "import json, sys\n\
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
        accumulator = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
        accumulator.Reload()\n\
        print(json.dumps([[e.step, e.value] for e in accumulator.Scalars('train/loss')]))\n";
    let output = std::process::Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(folder)
        .output();
    let required = std::env::var_os("CI").is_some();
    let missing = match &output {
        Err(error) => Some(format!("python3 cannot be started: {error}")),
        Ok(output)
            if String::from_utf8_lossy(&output.stderr)
                .contains("No module named 'tensorboard'") =>
        {
            Some("python3 has no tensorboard package (pip install tensorboard)".to_string())
        }
        Ok(_) => None,
    };
    if let Some(reason) = missing {
        assert!(!required, "{reason}, and CI is set (.ci/run installs it)");
        eprintln!("skipping the check through TensorBoard itself: {reason}");
        return None;
    }
    let output = output.unwrap();
    assert!(
        output.status.success(),
        "EventAccumulator failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let pairs: Vec<(i64, f32)> = serde_json::from_slice(&output.stdout).unwrap();
    Some(pairs)
}

#[test]
fn a_resumed_run_has_tensorboard_show_each_step_once() {
    let (_dir, out) = run_folder();
    // 512 steps of 16 images, a scalar every step, a snapshot every 20.
    let mut args = with_flag(synthetic_run(&out, 8192), "--epochs", "1");
    args = with_flag(args, "--batch-size", "16");
    args.extend(["--log-every-steps", "1", "--snapshot-every-steps", "20"].map(String::from));
    let mut child = spawn_tandem(&args, std::process::Stdio::null());
    // Killed at a step well past the last snapshot: the file then holds steps that the
    // resumed run trains again.
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no step past 25 within {LIMIT:?}"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        let last = event_files(&out)
            .first()
            .and_then(|file| loss_steps(&read_events_so_far(file)).last().copied());
        if last.is_some_and(|step| step > 25 && step % 20 >= 5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let first_session = read_events_so_far(&event_files(&out)[0]);
    let logged_before = *loss_steps(&first_session).last().unwrap();

    // Event files are named by the second they were created in.
    std::thread::sleep(Duration::from_millis(1100));
    tandem_succeeds(&args, LIMIT);
    let files = event_files(&out);
    assert_eq!(files.len(), 2, "{files:?}");
    let second_session = read_event_file(&files[1]);
    let start = &second_session[1];
    assert_eq!(start.session_status, Some(SESSION_START), "{start:?}");
    let resumed_after = start.step - 1;
    assert!(
        resumed_after > 0 && resumed_after % 20 == 0 && resumed_after < logged_before,
        "resumed after step {resumed_after}, {logged_before} steps logged before"
    );
    assert_eq!(loss_steps(&second_session)[0], start.step);
    // Its wall time is the resumed session's, between the file's header and first scalar.
    let last_of_first = first_session.last().unwrap().wall_time;
    assert!(
        last_of_first < second_session[0].wall_time
            && second_session[0].wall_time <= start.wall_time
            && start.wall_time <= second_session[2].wall_time,
        "{last_of_first} {:?}",
        &second_session[..3]
    );

    let kept = scalars_as_tensorboard_keeps_them(&files);
    let losses: Vec<(i64, f32)> = kept
        .iter()
        .filter(|(tag, _, _)| tag == "train/loss")
        .map(|(_, step, value)| (*step, *value))
        .collect();
    let steps: Vec<i64> = losses.iter().map(|(step, _)| *step).collect();
    assert_eq!(steps, (1..=512).collect::<Vec<_>>());
    let resumed_losses: Vec<(i64, f32)> = second_session
        .iter()
        .flat_map(|event| {
            event
                .scalars
                .iter()
                .filter(|(tag, _)| tag == "train/loss")
                .map(|(_, value)| (event.step, *value))
        })
        .collect();
    assert_eq!(losses[resumed_after as usize..], resumed_losses[..]);
    let epochs: Vec<i64> = kept
        .iter()
        .filter(|(tag, _, _)| tag == "epoch/val_loss")
        .map(|(_, step, _)| *step)
        .collect();
    assert_eq!(epochs, [1]);

    if let Some(read_by_tensorboard) = losses_read_by_tensorboard(&out) {
        assert_eq!(read_by_tensorboard, losses);
    }
}

#[test]
fn launch_tee_shows_every_ranks_epoch_and_rank_0_names_the_slowest() {
    let (_dir, out) = run_folder();
    let mut args: Vec<String> = [
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--tee",
        "--",
    ]
    .iter()
    .map(|word| word.to_string())
    .collect();
    args.extend(one_epoch_run(&out));
    let output = run_bounded(tandem().env_remove("TANDEM_JOB_TOKEN").args(&args), LIMIT);
    let stdout = expect_success(&output);
    assert!(
        stdout.contains("[rank 1] epoch: 1 | loss: ") && stdout.contains(" img/s on rank 1"),
        "{stdout}"
    );
    let val = stdout
        .lines()
        .find(|line| line.starts_with("[rank 0] val | epoch: 1 |"))
        .unwrap_or_else(|| panic!("no epoch line of rank 0:\n{stdout}"));
    assert!(
        val.contains(" | slowest: rank 0, ") || val.contains(" | slowest: rank 1, "),
        "{val}"
    );
    assert!(val.ends_with(" img/s"), "{val}");
    assert!(
        stdout.contains("[rank 0] tandem ") && stdout.contains("| world size 2"),
        "{stdout}"
    );
}

#[test]
fn launch_without_the_separator_says_to_put_it() {
    let output = run_bounded(
        tandem().args(["launch", "--standalone", "train", "--epochs", "1"]),
        LIMIT,
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_contains(&stderr, "put `--` before the worker's command, as in `tandem launch --standalone -- train --epochs 1`");
}

#[test]
fn completions_are_printed_for_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "_tandem()"),
        ("zsh", "#compdef tandem"),
        ("fish", "complete -c tandem"),
    ] {
        let output = run_bounded(tandem().args(["completions", shell]), LIMIT);
        let script = expect_success(&output);
        assert!(script.contains(marker), "{shell}:\n{script}");
        assert!(
            script.contains("launch") && script.contains("log-every-steps"),
            "{shell}"
        );
    }
}
