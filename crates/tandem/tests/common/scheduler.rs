//! What the scheduler tests (`schedulers.rs`, `slurm.rs`) share: jobs started in their own
//! process group and killed whole when a test fails, programs that may be missing, the variables
//! a job must not inherit, and the tiny job whose final weights they compare with
//! `tandem launch`'s.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{expect_success, standalone_launch, synthetic_run, tandem, with_flag};

/// Bound on any job in these tests.
pub const JOB_LIMIT: Duration = Duration::from_secs(120);
/// Between SIGTERM and SIGKILL when a job overruns.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// A job started in its own process group; the group is killed when the job is dropped
/// unfinished, so no rank outlives a failing test.
pub struct GroupJob {
    child: Option<Child>,
}

impl GroupJob {
    /// Starts `command` in a process group of its own, its input closed and its output piped.
    pub fn start(command: &mut Command) -> GroupJob {
        let child = command
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {command:?}: {error}"));
        GroupJob { child: Some(child) }
    }

    /// Sends `signal` to every process of the job's group, as a terminal's Ctrl-C or a
    /// scheduler's cancellation does.
    pub fn signal_every_process(&self, signal: i32) {
        signal_group(self.child.as_ref().map(|child| child.id() as i32), signal);
    }

    /// Waits for the job within `limit`; past it, stops the group (SIGTERM, then SIGKILL)
    /// and fails the test with the job's output.
    pub fn wait(self, limit: Duration) -> Output {
        match self.wait_or_stop(limit) {
            Ok(output) => output,
            Err(output) => panic!(
                "the job took longer than {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        }
    }

    /// Waits for the job within `limit`; past it, stops the group (SIGTERM, then SIGKILL)
    /// and returns what it wrote as the error, for a caller that must not panic (a `Drop`).
    pub fn wait_or_stop(mut self, limit: Duration) -> Result<Output, Output> {
        let mut child = self.child.take().expect("not waited yet");
        let group = Some(child.id() as i32);
        let deadline = Instant::now() + limit;
        while child.try_wait().expect("poll the job").is_none() {
            if Instant::now() > deadline {
                stop_group(&mut child);
                return Err(child.wait_with_output().expect("collect the output"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("collect the output");
        // Whatever the leader left behind (it should be nothing) goes with the group, whose
        // id stays reserved while any member lives.
        signal_group(group, libc::SIGKILL);
        Ok(output)
    }
}

impl Drop for GroupJob {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_group(&mut child);
            let _ = child.wait();
        }
    }
}

/// SIGTERM to the job's group, then SIGKILL after [`STOP_GRACE`] if the leader still runs.
fn stop_group(child: &mut Child) {
    let group = Some(child.id() as i32);
    signal_group(group, libc::SIGTERM);
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    signal_group(group, libc::SIGKILL);
}

fn signal_group(group: Option<i32>, signal: i32) {
    if let Some(group) = group {
        // SAFETY: `killpg` has no memory-safety preconditions; the group is the job's own.
        unsafe {
            libc::killpg(group, signal);
        }
    }
}

/// The program `name` on `PATH` (or in `/usr/sbin` and `/sbin`, where daemons live and a
/// user's `PATH` may not look), or `None` (and a printed reason) when the test should be
/// skipped; under `CI` a missing program fails the test.
pub fn program_or_skip(name: &str, test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: `{name}` is not installed, and CI is set (.ci/run installs it)"
        );
        eprintln!("skipped {test}: `{name}` is not installed");
    }
    found
}

/// A tiny synthetic job of the small model: one epoch of two steps of 16 images per rank.
pub fn tiny_job(output_dir: &Path) -> Vec<String> {
    let args = with_flag(synthetic_run(output_dir, 64), "--epochs", "1");
    let args = with_flag(args, "--batch-size", "16");
    with_flag(args, "--collective-timeout", "30")
}

/// The same job under `tandem launch --standalone --nproc-per-node 2`; returns its final
/// weights.
pub fn under_tandem_launch(output_dir: &Path) -> Vec<u8> {
    let mut command = tandem();
    command
        .args(standalone_launch("2"))
        .arg("--")
        .args(tiny_job(output_dir))
        .env_remove("TANDEM_JOB_TOKEN");
    expect_success(&GroupJob::start(&mut command).wait(JOB_LIMIT));
    final_weights(output_dir)
}

/// The variables that place a rank or join a job, which a test's own environment must not
/// pass to the job it starts.
pub const PLACING_VARIABLES: [&str; 7] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TANDEM_JOB_TOKEN",
    "TANDEM_ERROR_FILE",
];

/// Asserts that the job `what` wrote to `output_dir` ended with the weights `expected` of
/// the same job under `tandem launch`.
pub fn assert_weights_as_under_launch(output_dir: &Path, expected: &[u8], what: &str) {
    assert!(
        final_weights(output_dir) == expected,
        "{what} ended with other weights than tandem launch"
    );
}

/// The final weights of the tiny job written to `output_dir`.
pub fn final_weights(output_dir: &Path) -> Vec<u8> {
    let path = output_dir.join("epoch_1.safetensors");
    std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}
