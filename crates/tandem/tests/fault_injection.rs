//! Fault injection through the real binary: workers of a `tandem launch` job are killed with
//! SIGKILL at random moments, again and again; the launcher restarts the round, the workers
//! resume from the latest snapshot, and the job ends with the weights of a run that was
//! never interrupted, bit for bit.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::*;

const LIMIT: Duration = Duration::from_secs(600);
const KILLS: usize = 5;

fn job_args(output_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "8",
        "--stop-grace-seconds",
        "5",
        "--",
    ]
    .iter()
    .map(|arg| arg.to_string())
    .collect();
    let mut train = synthetic_run(output_dir, 2048);
    train = with_flag(train, "--epochs", "3");
    train = with_flag(train, "--batch-size", "16");
    train.extend(["--snapshot-every-steps".to_string(), "1".to_string()]);
    args.extend(train);
    args
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path)
        .and_then(|meta| meta.modified())
        .ok()
}

/// A small deterministic generator for the moments and victims (xorshift).
struct Moments(u64);

impl Moments {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound.max(1)
    }
}

fn kill_workers_repeatedly(launcher: &mut Child, snapshot: &Path, seed: u64) -> usize {
    let mut moments = Moments(seed | 1);
    let deadline = Instant::now() + LIMIT;
    let mut kills = 0;
    let mut last_seen = modified(snapshot);
    while kills < KILLS {
        assert!(
            Instant::now() < deadline,
            "the job did not make progress between kills"
        );
        if launcher.try_wait().unwrap().is_some() {
            break;
        }
        // Wait for the round to have trained (and saved) at least one step since the last
        // kill, then strike at a random moment of the next few steps.
        let now = modified(snapshot);
        if now.is_none() || now == last_seen {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        std::thread::sleep(Duration::from_millis(moments.next(60)));
        let workers = children(launcher.id());
        if workers.len() < 2 {
            continue;
        }
        let victim = workers[moments.next(workers.len() as u64) as usize];
        // SAFETY: plain kill(2) of a child process id we just read.
        unsafe {
            libc::kill(victim as i32, libc::SIGKILL);
        }
        kills += 1;
        last_seen = modified(snapshot);
    }
    kills
}

/// A new folder, and the job run straight through into `straight` in it.
fn straight_run() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    tandem_succeeds(job_args(&straight), LIMIT);
    (dir, straight)
}

#[test]
fn killed_workers_restart_and_end_with_the_uninterrupted_weights() {
    let (dir, straight) = straight_run();
    let faulty = dir.path().join("faulty");
    let mut launcher = tandem()
        .args(job_args(&faulty))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(1, |elapsed| elapsed.as_nanos() as u64);
    let kills = kill_workers_repeatedly(&mut launcher, &faulty.join("snapshot.safetensors"), seed);
    let output = wait_bounded(launcher, LIMIT);
    let stdout = expect_success(&output);
    assert_eq!(
        kills, KILLS,
        "the job ended before {KILLS} kills (seed {seed})\n{stdout}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let restarts = format!("{stdout}{stderr}").matches("SIGKILL").count();
    assert!(
        restarts >= 1,
        "the launcher never reported a killed worker\n{stdout}\n{stderr}"
    );
    assert_epochs_as_straight(&straight, &faulty, 1..=3, &format!(" (seed {seed})"));
}

#[test]
fn sigterm_to_the_launcher_stops_with_a_snapshot_and_a_relaunch_finishes_the_job() {
    let (dir, straight) = straight_run();
    let stopped = dir.path().join("stopped");
    let mut args = job_args(&stopped);
    // No snapshots but the one the stop writes.
    args.truncate(args.len() - 2);
    let launcher = tandem()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Stop in the middle of the first epoch: once the workers print progress.
    let deadline = Instant::now() + LIMIT;
    let log = stopped.join("logs/rank_0.log");
    while !std::fs::read_to_string(&log).is_ok_and(|text| text.contains("step 2")) {
        assert!(
            Instant::now() < deadline,
            "the workers never started training"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: plain kill(2) of our child's process id.
    unsafe {
        libc::kill(launcher.id() as i32, libc::SIGTERM);
    }
    let output = wait_bounded(launcher, LIMIT);
    assert!(
        !output.status.success(),
        "a stopped job must not report success"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        format!("{stdout}{stderr}").contains("Stopped on request at epoch 1"),
        "the workers did not stop at a step\n{stdout}\n{stderr}"
    );
    assert!(stopped.join("snapshot.safetensors").is_file());
    assert!(!stopped.join("epoch_1.safetensors").exists());

    let resumed = run_bounded(tandem().args(&args), LIMIT);
    let stdout = expect_success(&resumed);
    assert_contains(&stdout, "Resuming training from snapshot at epoch 1");
    assert_epochs_as_straight(&straight, &stopped, 1..=3, "");
}
