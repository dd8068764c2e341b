//! Tandem under Slurm, through the real programs, on a one-host cluster each test starts in a
//! temporary folder: `munged`, `slurmctld` and `slurmd` on loopback, with their own
//! configuration, key, socket, state and free ports. A 2-task `srun` job without `tandem
//! launch`, and `examples/slurm/train.sbatch` cancelled mid-epoch with `scancel` then submitted
//! again, each end with the weights of the same job under `tandem launch`, bit for bit. Setup
//! errors: `srun` of two launchers on one node, and a node list that does not parse.
//!
//! A test whose program is missing is skipped with the reason, unless `CI` is set (CI installs
//! Slurm), where it fails. Every wait is bounded, and a cluster is stopped whatever the test's
//! end: its jobs cancelled, its daemons and whatever they started killed, its folder removed.

mod common;

use std::io::Read;
use std::net::ToSocketAddrs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::scheduler::*;
use common::*;

/// Bound on the cluster's start: the node reported idle.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Slurm's grace between a cancelled job's SIGTERM and its SIGKILL (`KillWait`).
const KILL_WAIT_SECONDS: u64 = 15;
/// The launcher's grace for its workers in the batch job, below `KillWait`.
const LAUNCHER_GRACE_SECONDS: &str = "5";
/// Bound on a client command (`sinfo`, `scancel`, ...).
const CLIENT_LIMIT: Duration = Duration::from_secs(20);

/// Everything a test needs from Slurm.
const PROGRAMS: &[&str] = &[
    "munged",
    "slurmctld",
    "slurmd",
    "sinfo",
    "squeue",
    "srun",
    "sbatch",
    "scancel",
    "scontrol",
];

/// A daemon of the cluster, stopped (SIGTERM, then SIGKILL) when dropped.
struct Daemon {
    child: Child,
}

impl Daemon {
    /// Starts `program` in the foreground with its output in `dir/NAME.out`.
    fn start(command: &mut Command, dir: &Path, name: &str) -> Daemon {
        let log = std::fs::File::create(dir.join(format!("{name}.out"))).unwrap();
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {command:?}: {error}"));
        Daemon { child }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        signal(self.child.id() as i32, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: i32, signal: i32) {
    // SAFETY: `kill` has no memory-safety preconditions; the process is one the cluster
    // started.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// A one-host Slurm cluster in a temporary folder.
struct SlurmCluster {
    /// Its programs by name.
    programs: Vec<(&'static str, PathBuf)>,
    /// `slurmd` and `slurmctld`, stopped before `munged` (their credentials' daemon).
    slurm_daemons: Vec<Daemon>,
    munged: Option<Daemon>,
    conf: PathBuf,
    /// Removed last, once every process that could write to it is gone.
    dir: tempfile::TempDir,
}

impl SlurmCluster {
    /// Starts the cluster and waits for its node to be idle; `None` when a program is
    /// missing (skip the test).
    fn start(test: &str) -> Option<SlurmCluster> {
        let mut programs = Vec::new();
        for name in PROGRAMS {
            programs.push((*name, program_or_skip(name, test)?));
        }
        // SAFETY: `geteuid` has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test}: the Slurm cluster's daemons run as root, and CI is set"
            );
            eprintln!("skipped {test}: the Slurm cluster's daemons run as root");
            return None;
        }
        let host = short_host_name();
        assert!(
            (host.as_str(), 0).to_socket_addrs().is_ok(),
            "this host's name {host:?} does not resolve: slurmd names its node after it, and \
             the workers meet at the first host of the node list"
        );
        let dir = tempfile::tempdir().unwrap();
        // munged refuses a socket in a folder that others cannot search.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut cluster = SlurmCluster {
            programs,
            slurm_daemons: Vec::new(),
            munged: None,
            conf: dir.path().join("slurm.conf"),
            dir,
        };
        cluster.start_munged();
        std::fs::write(&cluster.conf, cluster.configuration()).unwrap();
        for daemon in ["slurmctld", "slurmd"] {
            let mut command = cluster.command(daemon);
            command.arg("-D").arg("-f").arg(&cluster.conf);
            let started = Daemon::start(&mut command, cluster.dir.path(), daemon);
            cluster.slurm_daemons.push(started);
        }
        cluster.wait_for_an_idle_node();
        Some(cluster)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn program(&self, name: &str) -> &Path {
        let (_, path) = self
            .programs
            .iter()
            .find(|(program, _)| *program == name)
            .expect("a program of PROGRAMS");
        path
    }

    /// `munged` with its own key and socket, waited for until its socket exists.
    fn start_munged(&mut self) {
        let munge_dir = self.path("munge");
        std::fs::create_dir(&munge_dir).unwrap();
        std::fs::set_permissions(&munge_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let key = munge_dir.join("munge.key");
        let mut secret = [0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut random| random.read_exact(&mut secret))
            .unwrap();
        std::fs::write(&key, secret).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut command = Command::new(self.program("munged"));
        command
            .arg("--foreground")
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--socket={}", munge_dir.join("socket").display()))
            .arg(format!("--pid-file={}", munge_dir.join("pid").display()))
            .arg(format!("--log-file={}", munge_dir.join("log").display()))
            .arg(format!("--seed-file={}", munge_dir.join("seed").display()));
        self.munged = Some(Daemon::start(&mut command, self.dir.path(), "munged"));
        let socket = munge_dir.join("socket");
        self.wait_until(|| socket.exists(), "munged to create its socket");
    }

    /// slurm.conf: one node on loopback, the daemons as root, no cgroups, systemd or
    /// accounting (a container has none), every file in the folder.
    fn configuration(&self) -> String {
        let host = short_host_name();
        let dir = self.dir.path().display();
        let (controller_port, node_port) = (free_port(), free_port());
        format!(
            "ClusterName=tandemtest\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             SlurmctldPort={controller_port}\n\
             SlurmdPort={node_port}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             AuthInfo=socket={dir}/munge/socket\n\
             StateSaveLocation={dir}/state\n\
             SlurmdSpoolDir={dir}/spool\n\
             SlurmctldPidFile={dir}/slurmctld.pid\n\
             SlurmdPidFile={dir}/slurmd.pid\n\
             SlurmctldLogFile={dir}/slurmctld.log\n\
             SlurmdLogFile={dir}/slurmd.log\n\
             # Processes tracked by parentage; no cgroups, task binding or accounting.\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             SwitchType=switch/none\n\
             MpiDefault=none\n\
             MailProg=/bin/true\n\
             SelectType=select/cons_tres\n\
             # A cancelled job gets SIGTERM, then SIGKILL this many seconds later.\n\
             KillWait={KILL_WAIT_SECONDS}\n\
             ReturnToService=2\n\
             # The node's CPUs as configured, whatever the machine has.\n\
             SlurmdParameters=config_overrides\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN\n\
             PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )
    }

    /// Waits until `sinfo` reports the node idle; fails with the daemons' logs past
    /// [`START_LIMIT`].
    fn wait_for_an_idle_node(&self) {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let output = self.client("sinfo", &["--noheader", "--format=%T"]);
            if String::from_utf8_lossy(&output.stdout).trim() == "idle" {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "the Slurm node was not idle within {START_LIMIT:?}; sinfo: {}{}\n{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn wait_until(&self, done: impl Fn() -> bool, what: &str) {
        let deadline = Instant::now() + START_LIMIT;
        while !done() {
            assert!(
                Instant::now() < deadline,
                "waited {START_LIMIT:?} for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The daemons' logs, for a failure's message.
    fn logs(&self) -> String {
        [
            "munged.out",
            "slurmctld.out",
            "slurmd.out",
            "slurmctld.log",
            "slurmd.log",
        ]
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(self.path(name)).unwrap_or_default();
            let start = text.len().saturating_sub(3000);
            let start = (start..=text.len())
                .find(|&index| text.is_char_boundary(index))
                .unwrap_or(text.len());
            format!("--- {name}:\n{}", &text[start..])
        })
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// `program` of the cluster, run in its folder with its configuration, and without any
    /// variable of the test's environment that could place a worker.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.program(program));
        command
            .current_dir(self.dir.path())
            .env("SLURM_CONF", &self.conf);
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("SLURM_") && name != "SLURM_CONF" {
                command.env_remove(name.as_ref());
            }
        }
        let others = [
            "TANDEM_RESTART_COUNT",
            "OMPI_COMM_WORLD_RANK",
            "VC_WORKER_HOSTS",
        ];
        for name in PLACING_VARIABLES.into_iter().chain(others) {
            command.env_remove(name);
        }
        command
    }

    /// A client command run to its end within [`CLIENT_LIMIT`].
    fn client(&self, program: &str, args: &[&str]) -> Output {
        let mut command = self.command(program);
        command.args(args);
        GroupJob::start(&mut command).wait(CLIENT_LIMIT)
    }

    /// Whether job `id` is still pending, running or ending.
    fn job_is_active(&self, id: &str) -> bool {
        let output = self.client("squeue", &["--noheader", "--format=%T", "--jobs", id]);
        output.status.success() && !String::from_utf8_lossy(&output.stdout).trim().is_empty()
    }

    /// Waits until job `id` has left the queue, at most `limit`.
    fn wait_for_job_end(&self, id: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.job_is_active(id) {
            assert!(
                Instant::now() < deadline,
                "job {id} was still in the queue after {limit:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The processes this cluster's daemons started (job steps and their tasks): those whose
    /// environment names its configuration.
    fn processes(&self) -> Vec<i32> {
        let needle = format!("SLURM_CONF={}", self.conf.display()).into_bytes();
        let own = std::process::id() as i32;
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != own)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|environ| environ.split(|&byte| byte == 0).any(|var| var == needle))
            })
            .collect()
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        // Jobs first, so that no step outlives its daemons; then the daemons; then what is
        // left of the jobs' processes (slurmstepd leaves its parent); munged last.
        let mut scancel = self.command("scancel");
        scancel.args(["--full", "--user=root"]);
        let _ = GroupJob::start(&mut scancel).wait_or_stop(CLIENT_LIMIT);
        self.slurm_daemons.clear();
        for pid in self.processes() {
            signal(pid, libc::SIGKILL);
        }
        self.munged = None;
    }
}

/// This machine's short host name, which `slurmd` takes for its node's name.
fn short_host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("read the host name");
    name.trim()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn srun_of_two_tasks_without_tandem_launch_ends_bit_identical_to_tandem_launch() {
    let test = "srun_of_two_tasks_without_tandem_launch_ends_bit_identical_to_tandem_launch";
    let Some(cluster) = SlurmCluster::start(test) else {
        return;
    };
    let expected = under_tandem_launch(&cluster.path("launch"));

    let output_dir = cluster.path("srun");
    let mut srun = cluster.command("srun");
    srun.args(["--ntasks=2", "--kill-on-bad-exit=1"])
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(tiny_job(&output_dir))
        .env("MASTER_PORT", free_port().to_string())
        .env("TANDEM_JOB_TOKEN", "slurm-test");
    let stdout = expect_success(&GroupJob::start(&mut srun).wait(JOB_LIMIT));
    assert_contains(&stdout, "world size 2");
    assert_weights_as_under_launch(&output_dir, &expected, "srun's 2 tasks");
}

#[test]
fn srun_of_two_launchers_on_one_node_says_how_to_start_one_per_node() {
    let test = "srun_of_two_launchers_on_one_node_says_how_to_start_one_per_node";
    let Some(cluster) = SlurmCluster::start(test) else {
        return;
    };
    let mut srun = cluster.command("srun");
    srun.arg("--ntasks=2")
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(["launch", "--nproc-per-node", "2", "--"])
        .args(tiny_job(&cluster.path("run")));
    let output = GroupJob::start(&mut srun).wait(JOB_LIMIT);
    assert!(!output.status.success(), "two launchers on one node ran");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = "error: read the cluster environment: slurm environment: \
        SLURM_STEP_TASKS_PER_NODE=\"2\": srun started 2 tasks on this node, and each would run \
        its own `tandem launch` of the node's workers: start one launcher per node \
        (srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 tandem launch --nproc-per-node N ...), \
        or let srun start the workers without `tandem launch` \
        (srun --ntasks-per-node=N tandem train ...)";
    assert_eq!(stderr.matches(expected).count(), 2, "{stderr}");
    assert!(
        !cluster.path("run").join("logs").exists(),
        "a launcher started workers"
    );
}

/// The batch job's `tandem train` flags: one epoch of 256 steps per rank, its progress shown
/// every 25, so that a cancellation sent at the first progress line lands mid-epoch.
fn batch_job(output_dir: &Path) -> Vec<String> {
    let args = with_flag(synthetic_run(output_dir, 8192), "--batch-size", "16");
    let args = with_flag(args, "--epochs", "1");
    with_flag(args, "--collective-timeout", "30")
}

/// `sbatch examples/slurm/train.sbatch` of [`batch_job`] on one node with 2 workers; returns
/// the job's id.
fn submit(cluster: &SlurmCluster, output_dir: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/slurm/train.sbatch");
    let mut sbatch = cluster.command("sbatch");
    sbatch
        .args(["--nodes=1", "--cpus-per-task=2", "--parsable"])
        .arg(format!("--output={}", cluster.path("job.out").display()))
        .arg(script)
        .args(&batch_job(output_dir)[1..])
        .env("TANDEM", env!("CARGO_BIN_EXE_tandem"))
        .env("NPROC_PER_NODE", "2")
        .env("MASTER_PORT", free_port().to_string())
        .env("STOP_GRACE_SECONDS", LAUNCHER_GRACE_SECONDS);
    let parsable = expect_success(&GroupJob::start(&mut sbatch).wait(JOB_LIMIT));
    // "ID", or "ID;CLUSTER" on a federation.
    parsable
        .trim()
        .split(';')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The batch job run straight through under `tandem launch` (no Slurm), into
/// `CLUSTER/straight`: the weights an interrupted job must end with.
fn straight_run(cluster: &SlurmCluster) -> PathBuf {
    let straight = cluster.path("straight");
    let mut launch = tandem();
    launch
        .args(["launch", "--standalone", "--nproc-per-node", "2", "--"])
        .args(batch_job(&straight))
        .env_remove("TANDEM_JOB_TOKEN");
    expect_success(&GroupJob::start(&mut launch).wait(JOB_LIMIT));
    straight
}

/// Submits the batch job into `output_dir` and waits until its workers report their first
/// steps of epoch 1; returns the job's id.
fn submit_and_wait_for_first_steps(cluster: &SlurmCluster, output_dir: &Path) -> String {
    let job_id = submit(cluster, output_dir);
    let progress = output_dir.join("logs/rank_0.log");
    cluster.wait_until(
        || std::fs::read_to_string(&progress).is_ok_and(|log| log.contains("epoch 1 | step ")),
        "the batch job's first steps",
    );
    job_id
}

/// For `test`, a one-node Slurm cluster (`None` where it cannot run here), the straight run
/// on it (see [`straight_run`]), and the batch job submitted into `CLUSTER/<folder>` that
/// has trained its first steps: the cluster, the straight run's folder, the job's folder and
/// the job's id.
fn cluster_with_a_job(
    test: &str,
    folder: &str,
) -> Option<(SlurmCluster, PathBuf, PathBuf, String)> {
    let cluster = SlurmCluster::start(test)?;
    let straight = straight_run(&cluster);
    let output_dir = cluster.path(folder);
    let job_id = submit_and_wait_for_first_steps(&cluster, &output_dir);
    Some((cluster, straight, output_dir, job_id))
}

/// Fails unless the job's output says it resumed from a mid-epoch snapshot and succeeded,
/// and its weights are those of `straight`.
fn assert_resumed_bit_identical(cluster: &SlurmCluster, straight: &Path, output_dir: &Path) {
    let job_out = std::fs::read_to_string(cluster.path("job.out")).unwrap_or_default();
    assert!(
        job_out.contains("Resuming training from snapshot at epoch 1, step "),
        "the job did not resume from a mid-epoch snapshot\n{job_out}"
    );
    assert!(
        job_out.ends_with("tandem launch: every worker finished successfully\n"),
        "the resumed job did not succeed\n{job_out}"
    );
    assert!(
        final_weights(straight) == final_weights(output_dir),
        "the resumed job ended with other weights than the uninterrupted one\n{job_out}"
    );
}

#[test]
fn sbatch_job_cancelled_mid_epoch_and_submitted_again_ends_bit_identical() {
    let test = "sbatch_job_cancelled_mid_epoch_and_submitted_again_ends_bit_identical";
    let Some((cluster, straight, output_dir, job_id)) = cluster_with_a_job(test, "cancelled")
    else {
        return;
    };
    expect_success(&cluster.client("scancel", &[&job_id]));
    cluster.wait_for_job_end(&job_id, Duration::from_secs(KILL_WAIT_SECONDS + 30));

    let job_out = std::fs::read_to_string(cluster.path("job.out")).unwrap_or_default();
    let record = std::fs::read_to_string(output_dir.join("errors/rank_0.json"))
        .unwrap_or_else(|error| panic!("no error file of rank 0 ({error})\n{job_out}"));
    assert!(
        record.contains("stopped by SIGTERM at epoch 1, step "),
        "{record}\n{job_out}"
    );
    assert!(
        output_dir.join("snapshot.safetensors").is_file(),
        "no snapshot\n{job_out}"
    );
    assert!(!output_dir.join("epoch_1.safetensors").exists());

    let job_id = submit(&cluster, &output_dir);
    cluster.wait_for_job_end(&job_id, JOB_LIMIT);
    assert_resumed_bit_identical(&cluster, &straight, &output_dir);
}

#[test]
fn sbatch_job_requeued_mid_epoch_resumes_and_ends_bit_identical() {
    let test = "sbatch_job_requeued_mid_epoch_resumes_and_ends_bit_identical";
    let Some((cluster, straight, output_dir, job_id)) = cluster_with_a_job(test, "requeued") else {
        return;
    };
    // Requeued, the job is stopped as by scancel and put back in the queue, held until its
    // begin time; releasing it early keeps the test short. Not too early: slurmd refuses a
    // launch while the first run is still ending on the node, and one whose credential is
    // from the same second as the requeue ("Job credential revoked"; CI's loaded machine
    // released the job within that second, and it failed without running).
    expect_success(&cluster.client("scontrol", &["requeue", &job_id]));
    let requeued_at = Instant::now();
    cluster.wait_until(
        || {
            let state = cluster.client("squeue", &["--noheader", "--format=%T", "--jobs", &job_id]);
            String::from_utf8_lossy(&state.stdout).trim() == "PENDING"
        },
        "the requeued job back in the queue",
    );
    cluster.wait_for_an_idle_node();
    std::thread::sleep(Duration::from_secs(2).saturating_sub(requeued_at.elapsed()));
    expect_success(&cluster.client(
        "scontrol",
        &["update", &format!("JobId={job_id}"), "StartTime=now"],
    ));
    cluster.wait_for_job_end(&job_id, JOB_LIMIT);
    assert_resumed_bit_identical(&cluster, &straight, &output_dir);
}

/// What `scancel` does to a `tandem launch` job, without Slurm: SIGTERM to every process at
/// once, so each worker gets one directly and one passed on by the launcher. The two are one
/// request: the workers stop at the same step with a snapshot.
#[test]
fn sigterm_to_every_process_of_a_launch_job_ends_with_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let output_dir = dir.path().join("run");
    let mut launch = tandem();
    launch
        .args(["launch", "--standalone", "--nproc-per-node", "2"])
        .args(["--stop-grace-seconds", LAUNCHER_GRACE_SECONDS, "--"])
        .args(batch_job(&output_dir))
        .env_remove("TANDEM_JOB_TOKEN");
    let job = GroupJob::start(&mut launch);
    let progress = output_dir.join("logs/rank_0.log");
    let deadline = Instant::now() + JOB_LIMIT;
    while !std::fs::read_to_string(&progress).is_ok_and(|log| log.contains("epoch 1 | step ")) {
        assert!(
            Instant::now() < deadline,
            "the workers never started training"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    job.signal_every_process(libc::SIGTERM);
    let output = job.wait(JOB_LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(143), "{stderr}");
    for rank in 0..2 {
        let record = std::fs::read_to_string(output_dir.join(format!("errors/rank_{rank}.json")))
            .unwrap_or_else(|error| panic!("no error file of rank {rank} ({error})\n{stderr}"));
        assert!(
            record.contains("\"message\":\"stopped by SIGTERM at epoch 1, step "),
            "rank {rank}: {record}"
        );
    }
    let files: Vec<String> = std::fs::read_dir(&output_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.iter().any(|name| name == "snapshot.safetensors"),
        "{files:?}"
    );
    assert!(
        !files.iter().any(|name| name.ends_with(".tmp")),
        "a snapshot was left half-written: {files:?}"
    );
}

/// `tandem ARGS` in a Slurm task's environment whose node list does not parse.
fn with_a_broken_node_list(args: &[String]) -> Output {
    let mut command = tandem();
    command
        .args(args)
        .env_remove("LOCAL_RANK")
        .env_remove("TANDEM_RESTART_COUNT")
        .envs([
            ("SLURM_JOB_NODELIST", "node[01-"),
            ("SLURM_NNODES", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS", "2"),
        ]);
    GroupJob::start(&mut command).wait(JOB_LIMIT)
}

#[test]
fn a_node_list_that_does_not_parse_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cause = "slurm environment: SLURM_JOB_NODELIST=\"node[01-\": unclosed '[' in \"node[01-\"";

    let worker = with_a_broken_node_list(&tiny_job(&dir.path().join("worker")));
    assert_eq!(worker.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&worker.stderr);
    assert!(
        stderr.ends_with(&format!(
            "error: cannot read this worker's place in the job from the environment: {cause}\n"
        )),
        "{stderr}"
    );

    let mut launch: Vec<String> = ["launch", "--nproc-per-node", "2", "--"]
        .iter()
        .map(|word| word.to_string())
        .collect();
    launch.extend(tiny_job(&dir.path().join("launcher")));
    let launcher = with_a_broken_node_list(&launch);
    assert_eq!(launcher.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&launcher.stderr),
        format!("error: read the cluster environment: {cause}\n")
    );
}
