//! Tandem started by the programs clusters use instead of a hand-typed `tandem launch`: Open
//! MPI's `mpirun`, and ModelArts' start script (`examples/modelarts/run.sh`) on two nodes.
//! Each job must end with the weights of the same job under `tandem launch --standalone`, bit
//! for bit. A test whose program is missing is skipped with the reason, unless `CI` is set
//! (CI installs them), where it fails.
//!
//! Every job runs in its own process group, which a failing test kills whole, and every wait
//! is bounded.

mod common;

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Bound on any job in these tests.
const JOB_LIMIT: Duration = Duration::from_secs(120);
/// Between SIGTERM and SIGKILL when a job overruns.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A job started in its own process group; the group is killed when the job is dropped
/// unfinished, so no rank outlives a failing test.
struct GroupJob {
    child: Option<Child>,
}

impl GroupJob {
    fn start(command: &mut Command) -> GroupJob {
        let child = command
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {command:?}: {error}"));
        GroupJob { child: Some(child) }
    }

    /// Waits for the job within `limit`; past it, stops the group (SIGTERM, then SIGKILL)
    /// and fails the test with the job's output.
    fn wait(mut self, limit: Duration) -> Output {
        let mut child = self.child.take().expect("not waited yet");
        let group = Some(child.id() as i32);
        let deadline = Instant::now() + limit;
        while child.try_wait().expect("poll the job").is_none() {
            if Instant::now() > deadline {
                stop_group(&mut child);
                let output = child.wait_with_output().expect("collect the output");
                panic!(
                    "the job took longer than {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("collect the output");
        // Whatever the leader left behind (it should be nothing) goes with the group, whose
        // id stays reserved while any member lives.
        signal_group(group, libc::SIGKILL);
        output
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

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("its address")
        .port()
}

/// The program `name` on `PATH`, or `None` (and a printed reason) when the test should be
/// skipped; under `CI` a missing program fails the test.
fn program_or_skip(name: &str, test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
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
fn tiny_job(output_dir: &Path) -> Vec<String> {
    let args = with_flag(synthetic_run(output_dir, 64), "--epochs", "1");
    let args = with_flag(args, "--batch-size", "16");
    with_flag(args, "--collective-timeout", "30")
}

/// The same job under `tandem launch --standalone --nproc-per-node 2`; returns its final
/// weights.
fn under_tandem_launch(output_dir: &Path) -> Vec<u8> {
    let mut command = tandem();
    command
        .args([
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--",
        ])
        .args(tiny_job(output_dir))
        .env_remove("TANDEM_JOB_TOKEN");
    expect_success(&GroupJob::start(&mut command).wait(JOB_LIMIT));
    final_weights(output_dir)
}

fn final_weights(output_dir: &Path) -> Vec<u8> {
    let path = output_dir.join("epoch_1.safetensors");
    std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

/// `mpirun -np 2` of `tandem train`, passing on the variables in `pass` (set here to the
/// values in `env`); the rest of the test's environment that could place a rank is removed.
fn mpirun_train(mpirun: &Path, output_dir: &Path, env: &[(&str, String)]) -> Output {
    let mut command = Command::new(mpirun);
    command.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"]);
    for (name, _) in env {
        command.args(["-x", name]);
    }
    command
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(tiny_job(output_dir));
    for name in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TANDEM_JOB_TOKEN",
        "TANDEM_ERROR_FILE",
    ] {
        command.env_remove(name);
    }
    command.envs(env.iter().map(|(name, value)| (name, value)));
    GroupJob::start(&mut command).wait(JOB_LIMIT)
}

#[test]
fn mpirun_ends_bit_identical_to_tandem_launch_with_and_without_master_addr() {
    let test = "mpirun_ends_bit_identical_to_tandem_launch_with_and_without_master_addr";
    let Some(mpirun) = program_or_skip("mpirun", test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let expected = under_tandem_launch(&dir.path().join("launch"));

    let named = dir.path().join("mpirun-named");
    let output = mpirun_train(
        &mpirun,
        &named,
        &[
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", free_port().to_string()),
            ("TANDEM_JOB_TOKEN", "mpirun-test".into()),
        ],
    );
    expect_success(&output);
    assert!(
        final_weights(&named) == expected,
        "mpirun with MASTER_ADDR ended with other weights than tandem launch"
    );

    // Without MASTER_ADDR, every rank on one node: rank 0's host is this one.
    let derived = dir.path().join("mpirun-derived");
    let output = mpirun_train(
        &mpirun,
        &derived,
        &[
            ("MASTER_PORT", free_port().to_string()),
            ("TANDEM_JOB_TOKEN", "mpirun-test".into()),
        ],
    );
    expect_success(&output);
    assert!(
        final_weights(&derived) == expected,
        "mpirun without MASTER_ADDR ended with other weights than tandem launch"
    );
}

#[test]
fn mpirun_without_master_port_says_how_to_pass_one() {
    let test = "mpirun_without_master_port_says_how_to_pass_one";
    let Some(mpirun) = program_or_skip("mpirun", test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let output = mpirun_train(
        &mpirun,
        &dir.path().join("run"),
        &[("TANDEM_JOB_TOKEN", "mpirun-test".into())],
    );
    assert!(!output.status.success(), "a job without MASTER_PORT ran");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "[rank 1] error: an Open MPI job of 2 processes needs MASTER_PORT, a free port on rank 0's host, \
             the same for every rank: mpirun -x MASTER_PORT=29500 -x TANDEM_JOB_TOKEN ..."
        ),
        "{stderr}"
    );
}

/// `examples/modelarts/run.sh` as ModelArts starts it on node `task_index` of `hosts`.
fn modelarts_node(hosts: &str, task_index: usize, port: u16, output_dir: &Path) -> GroupJob {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/modelarts/run.sh");
    let mut command = Command::new("bash");
    // The script takes `tandem train`'s flags, without the word `train`.
    command.arg(script).args(&tiny_job(output_dir)[1..]);
    for name in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "NPROC_PER_NODE",
    ] {
        command.env_remove(name);
    }
    command
        .env("VC_WORKER_HOSTS", hosts)
        .env("MA_NUM_HOSTS", "2")
        .env("VC_TASK_INDEX", task_index.to_string())
        .env("MA_NUM_GPUS", "1")
        .env("MA_JOB_DIR", output_dir.parent().expect("a parent"))
        .env("MASTER_PORT", port.to_string())
        .env("TANDEM_JOB_TOKEN", "modelarts-test")
        .env("TANDEM", env!("CARGO_BIN_EXE_tandem"));
    GroupJob::start(&mut command)
}

#[test]
fn modelarts_script_on_two_loopback_nodes_ends_bit_identical_to_tandem_launch() {
    let dir = tempfile::tempdir().unwrap();
    let expected = under_tandem_launch(&dir.path().join("launch"));

    let output_dir = dir.path().join("modelarts");
    let hosts = "127.0.0.1,127.0.0.1";
    let port = free_port();
    let node0 = modelarts_node(hosts, 0, port, &output_dir);
    let node1 = modelarts_node(hosts, 1, port, &output_dir);
    let stdout0 = expect_success(&node0.wait(JOB_LIMIT));
    let stdout1 = expect_success(&node1.wait(JOB_LIMIT));
    let command_line = format!(
        "launch --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port {port} -- train"
    );
    assert!(stdout0.contains(&command_line), "{stdout0}");
    assert!(stdout1.contains("--node-rank 1"), "{stdout1}");
    assert!(
        final_weights(&output_dir) == expected,
        "two ModelArts nodes ended with other weights than tandem launch"
    );
}

#[test]
fn modelarts_script_without_a_token_on_two_nodes_says_what_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/modelarts/run.sh");
    let mut command = Command::new("bash");
    command
        .arg(script)
        .env_remove("TANDEM_JOB_TOKEN")
        .env("VC_WORKER_HOSTS", "node-0.job,node-1.job")
        .env("MA_NUM_HOSTS", "2")
        .env("VC_TASK_INDEX", "1")
        .env("MA_NUM_GPUS", "0")
        .env("MA_JOB_DIR", dir.path());
    let output = GroupJob::start(&mut command).wait(JOB_LIMIT);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "run.sh: a job of 2 nodes needs TANDEM_JOB_TOKEN, the same secret on every node: \
         set it in the training job's environment variables\n"
    );
}
