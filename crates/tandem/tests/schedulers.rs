//! Tandem started by the programs clusters use instead of a hand-typed `tandem launch`: Open
//! MPI's `mpirun`, and ModelArts' start script (`examples/modelarts/run.sh`) on two nodes.
//! Each job must end with the weights of the same job under `tandem launch --standalone`, bit
//! for bit. A test whose program is missing is skipped with the reason, unless `CI` is set
//! (CI installs them), where it fails.
//!
//! Every job runs in its own process group, which a failing test kills whole, and every wait
//! is bounded. Slurm has its own file, `slurm.rs`, as it needs a cluster.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::scheduler::*;
use common::*;

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
    for name in PLACING_VARIABLES {
        command.env_remove(name);
    }
    command.envs(env.iter().map(|(name, value)| (name, value)));
    GroupJob::start(&mut command).wait(JOB_LIMIT)
}

/// Open MPI's `mpirun` and a new folder for `test`, or `None` (the test skips) without it.
fn mpirun_or_skip(test: &str) -> Option<(PathBuf, tempfile::TempDir)> {
    let mpirun = program_or_skip("mpirun", test)?;
    Some((mpirun, tempfile::tempdir().unwrap()))
}

#[test]
fn mpirun_ends_bit_identical_to_tandem_launch_with_and_without_master_addr() {
    let test = "mpirun_ends_bit_identical_to_tandem_launch_with_and_without_master_addr";
    let Some((mpirun, dir)) = mpirun_or_skip(test) else {
        return;
    };
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
    assert_weights_as_under_launch(&named, &expected, "mpirun with MASTER_ADDR");

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
    assert_weights_as_under_launch(&derived, &expected, "mpirun without MASTER_ADDR");
}

#[test]
fn mpirun_without_master_port_says_how_to_pass_one() {
    let test = "mpirun_without_master_port_says_how_to_pass_one";
    let Some((mpirun, dir)) = mpirun_or_skip(test) else {
        return;
    };
    let output = mpirun_train(
        &mpirun,
        &dir.path().join("run"),
        &[("TANDEM_JOB_TOKEN", "mpirun-test".into())],
    );
    assert!(!output.status.success(), "a job without MASTER_PORT ran");
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Both ranks fail alike (rank 0's line has no prefix); mpirun may end one before it has
    // written its error. Each line is written whole, so lines of the two do not interleave.
    let error = "error: an Open MPI job of 2 processes needs MASTER_PORT, a free port on rank 0's \
                 host, the same for every rank: mpirun -x MASTER_PORT=29500 -x TANDEM_JOB_TOKEN ...";
    assert!(
        stderr
            .lines()
            .any(|line| line == error || line == format!("[rank 1] {error}")),
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
    assert_contains(&stdout0, &command_line);
    assert_contains(&stdout1, "--node-rank 1");
    assert_weights_as_under_launch(&output_dir, &expected, "two ModelArts nodes");
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
