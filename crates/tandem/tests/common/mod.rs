//! Helpers shared by the end-to-end tests: running the real `tandem` binary with bounded
//! waits (the test kit's), and the flags of the small runs they train.

#![allow(dead_code)]

pub mod elastic;
pub mod freeze;
pub mod netns;
pub mod scheduler;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `tandem` binary under test.
pub fn tandem() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tandem"));
    command
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR");
    command
}

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use tandem_testdata::{
    assert_contains, expect_failure, expect_success, free_port, run_bounded, wait_bounded,
};

/// The flags of a one-node `tandem launch` of `nproc` workers that restarts none; the
/// launcher's other flags, `--` and the workers' command follow.
pub fn standalone_launch(nproc: &str) -> [&str; 6] {
    [
        "launch",
        "--standalone",
        "--nproc-per-node",
        nproc,
        "--max-restarts",
        "0",
    ]
}

/// A worker command: the step benchmark of the seed-004 model; `--batch` and the rest follow.
pub const BENCH_STEP: [&str; 4] = ["bench", "step", "--model", "resnet-base"];

/// A small residual network that trains in seconds: the seed-004 model with one plain
/// block per stage.
pub const SMALL_MODEL: &[&str] = &[
    "--model",
    "resnet-base",
    "--n-blocks",
    "1,1,1",
    "--n-channels",
    "8,16,32",
    "--bottlenecks",
    "none",
];

/// The model `SMALL_MODEL` selects, initialized.
pub fn small_model() -> tandem_models::Model {
    let spec = tandem_models::ModelSpec::ResNetBase(tandem_models::ResNetBaseSpec {
        n_blocks: vec![1, 1, 1],
        n_channels: vec![8, 16, 32],
        bottlenecks: None,
        first_kernel_size: 3,
        img_channels: 3,
        num_classes: 10,
    });
    let mut model = tandem_models::Model::new(&spec).expect("valid spec");
    model.init_default(11);
    model
}

/// Training flags for a short synthetic run of the small model.
pub fn small_synthetic_run(output_dir: &Path) -> Vec<String> {
    synthetic_run(output_dir, 192)
}

/// Training flags for a synthetic run of the small model on `train_samples` images.
pub fn synthetic_run(output_dir: &Path, train_samples: usize) -> Vec<String> {
    let mut args = small_model_train(&format!(
        "--data synthetic --synthetic-train {train_samples} --synthetic-test 64 --epochs 2 \
         --batch-size 32 --optimizer sgd --momentum 0.9 --lr 0.05 --threads 1 --seed 7"
    ));
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    args
}

/// `train` of the small model (`SMALL_MODEL`) with `flags`, split at white space; a flag
/// whose value may hold white space (a path) is pushed after.
pub fn small_model_train(flags: &str) -> Vec<String> {
    std::iter::once("train")
        .chain(SMALL_MODEL.iter().copied())
        .chain(flags.split_whitespace())
        .map(String::from)
        .collect()
}

/// `args` with `flag` set to `value`: replaces the flag's value if present, else appends it.
pub fn with_flag(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    match args.iter().position(|arg| arg == flag) {
        Some(index) if index + 1 < args.len() => args[index + 1] = value.to_string(),
        _ => args.extend([flag.to_string(), value.to_string()]),
    }
    args
}

/// The tensors of a safetensors file as f64, by name.
pub fn read_tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                    .collect(),
                safetensors::Dtype::I64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("unexpected dtype {other:?} of {name}"),
            };
            (name, values)
        })
        .collect()
}

/// Worst error per tensor family (the name's last part: `weight`, `bias`, `running_mean`,
/// ...), each relative to the largest magnitude of its tensor in `expected`.
pub fn worst_error_per_family(
    expected: &std::collections::BTreeMap<String, Vec<f64>>,
    actual: &std::collections::BTreeMap<String, Vec<f64>>,
    skip: impl Fn(&str) -> bool,
) -> std::collections::BTreeMap<String, f64> {
    assert_eq!(
        expected.keys().collect::<Vec<_>>(),
        actual.keys().collect::<Vec<_>>(),
        "the files hold different tensors"
    );
    let mut worst = std::collections::BTreeMap::new();
    for (name, values) in expected {
        if skip(name) {
            continue;
        }
        let scale = values.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let error = values
            .iter()
            .zip(&actual[name])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
            / scale;
        let family = name.rsplit('.').next().unwrap_or(name).to_string();
        let entry = worst.entry(family).or_insert(0.0f64);
        *entry = entry.max(error);
    }
    worst
}

/// Runs `tandem args` (a training run writing to `output_dir` with `--snapshot-every-steps
/// 1`) and kills it with SIGKILL as soon as its second snapshot exists (the first moved to
/// `snapshot.safetensors.prev`), mid epoch 1, waiting at most `limit`; asserts that the run
/// had not finished.
pub fn kill_after_second_snapshot(args: &[String], output_dir: &Path, limit: Duration) {
    let mut child = tandem()
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the tandem binary");
    let deadline = Instant::now() + limit;
    let previous = output_dir.join("snapshot.safetensors.prev");
    while !previous.exists() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no second snapshot appeared within {limit:?}");
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !output_dir.join("epoch_2.safetensors").exists(),
        "the run finished before it could be killed"
    );
}

/// The process ids of `parent`'s children.
pub fn children(parent: u32) -> Vec<u32> {
    let tasks = Path::new("/proc").join(parent.to_string()).join("task");
    let mut pids = Vec::new();
    if let Ok(entries) = std::fs::read_dir(tasks) {
        for entry in entries.flatten() {
            if let Ok(text) = std::fs::read_to_string(entry.path().join("children")) {
                pids.extend(
                    text.split_whitespace()
                        .filter_map(|pid| pid.parse::<u32>().ok()),
                );
            }
        }
    }
    pids
}

/// A new folder, and the path of a run folder `run` inside it (not created yet).
pub fn run_folder() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temporary folder");
    let out = dir.path().join("run");
    (dir, out)
}

/// Runs `tandem <args>` to its end within `limit`, expecting it to succeed; its standard
/// output.
pub fn tandem_succeeds<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    limit: Duration,
) -> String {
    expect_success(&run_bounded(tandem().args(args), limit))
}

/// Runs `tandem <args>` again on a run that has finished: it succeeds saying `done` (such as
/// `2/2 epochs done`) and trains nothing. Its standard output.
pub fn rerun_finished(args: &[String], done: &str, limit: Duration) -> String {
    let stdout = tandem_succeeds(args, limit);
    assert!(
        stdout.contains(&format!("{done}; raise --epochs to continue")),
        "{stdout}"
    );
    assert!(!stdout.contains("train | epoch"), "{stdout}");
    stdout
}

/// Fails unless the checkpoints of `epochs` in `actual` are byte for byte those of the run
/// straight through into `straight`; `note` ends the failure's message.
pub fn assert_epochs_as_straight(
    straight: &Path,
    actual: &Path,
    epochs: std::ops::RangeInclusive<u64>,
    note: &str,
) {
    for epoch in epochs {
        let name = format!("epoch_{epoch}.safetensors");
        let expected = std::fs::read(straight.join(&name)).unwrap();
        let actual = std::fs::read(actual.join(&name)).unwrap();
        assert!(
            expected == actual,
            "{name} differs from the uninterrupted run's{note}"
        );
    }
}

/// Sends `signal` to process `pid`, a child of the test or of its launcher that is not
/// reaped yet.
pub fn send_signal(pid: u32, signal: i32) {
    // SAFETY: `kill` has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

/// A `tandem launch` started by a test, its output going to files so that the test can read
/// them while it runs; killed when dropped, so a failing test leaves nothing behind.
pub struct Launcher {
    pub child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Launcher {
    /// Spawns `command` (a prepared `tandem launch ...`) with standard input closed and its
    /// output in `dir/NAME.stdout` and `dir/NAME.stderr`.
    pub fn spawn(mut command: Command, dir: &Path, name: &str) -> Launcher {
        let stdout = dir.join(format!("{name}.stdout"));
        let stderr = dir.join(format!("{name}.stderr"));
        command
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap());
        Launcher {
            child: command.spawn().expect("start the tandem binary"),
            stdout,
            stderr,
        }
    }

    /// Waits for the launcher to exit, at most `timeout`; panics (killing it) otherwise.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "the launcher did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the launcher to exit, at most `timeout`, checks that it exited with `code`
    /// and returns what it wrote to standard error.
    pub fn exits_with(&mut self, code: i32, timeout: Duration) -> String {
        let status = self.wait(timeout);
        let stderr = self.stderr();
        assert_eq!(status.code(), Some(code), "{stderr}");
        stderr
    }

    /// Waits until rank 0's log in `output_dir` shows step 2 of training, at most `timeout`.
    pub fn wait_for_training(&mut self, output_dir: &Path, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let log = output_dir.join("logs/rank_0.log");
        while !std::fs::read_to_string(&log).is_ok_and(|text| text.contains("step 2")) {
            assert!(
                !self.has_exited() && Instant::now() < deadline,
                "the workers never trained:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The process id of its worker of `rank` (from the worker's environment's `RANK`).
    pub fn worker(&self, rank: usize) -> u32 {
        self.try_worker(rank)
            .unwrap_or_else(|| panic!("no worker of rank {rank}"))
    }

    /// The process id of its worker of `rank`, if that worker runs.
    pub fn try_worker(&self, rank: usize) -> Option<u32> {
        let wanted = format!("RANK={rank}");
        children(self.pid()).into_iter().find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                environ
                    .split(|&byte| byte == 0)
                    .any(|entry| entry == wanted.as_bytes())
            })
        })
    }

    /// What it has written to standard error so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// What it has written to standard output so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Sends it `signal`.
    pub fn signal(&self, signal: i32) {
        send_signal(self.child.id(), signal);
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The tensors of a snapshot as bit patterns, and each epoch's training and validation loss.
pub type FinalState = (
    std::collections::BTreeMap<String, Vec<u64>>,
    Vec<(f64, f64)>,
);

/// What must be the same bits: every tensor of the final snapshot (parameters, BN buffers,
/// optimizer state) as bit patterns, and each epoch's training loss (the mean of its steps'
/// losses) from metrics.jsonl. With it the validation loss, which is summed over the ranks'
/// parts of the test set in the ring's order and may differ in its last bit.
pub fn final_state(output_dir: &Path) -> FinalState {
    let tensors = read_tensors(&output_dir.join("snapshot.safetensors"))
        .into_iter()
        .map(|(name, values)| (name, values.iter().map(|value| value.to_bits()).collect()))
        .collect();
    let metrics = std::fs::read_to_string(output_dir.join("metrics.jsonl")).unwrap();
    let losses = metrics
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let loss = |name: &str| record[name].as_f64().unwrap();
            (loss("train_loss"), loss("val_loss"))
        })
        .collect();
    (tensors, losses)
}

pub fn assert_same_bits(expected: &Path, actual: &Path, what: &str) {
    let (expected_tensors, expected_losses) = final_state(expected);
    let (actual_tensors, actual_losses) = final_state(actual);
    assert_eq!(
        expected_tensors.keys().collect::<Vec<_>>(),
        actual_tensors.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    for (name, values) in &expected_tensors {
        let differ = values
            .iter()
            .zip(&actual_tensors[name])
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(differ, 0, "{what}: {differ} values of {name} differ");
    }
    assert_eq!(expected_losses.len(), actual_losses.len(), "{what}: epochs");
    for (expected, actual) in expected_losses.iter().zip(&actual_losses) {
        assert_eq!(
            expected.0.to_bits(),
            actual.0.to_bits(),
            "{what}: training loss"
        );
        let what = format!("{what}: validation loss");
        tandem_testdata::assert_close_one(
            &what,
            actual.1,
            expected.1,
            tandem_testdata::Tolerance::Scaled(1e-12),
        );
    }
}
