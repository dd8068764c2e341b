//! `tandem launch` through the real binary, with small `sh` workers: the environment the
//! workers get, restarts, the failure summary, stop signals, two agents as two nodes, and
//! (as root) two network namespaces as two hosts. Every wait is bounded and every launcher
//! is killed if a test fails.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_dist::{JobToken, ProcessGroup, ProcessGroupOptions, ReduceOp, StoreClient};

mod common;

use common::netns::{network_namespaces_unavailable, NetworkPair};
use common::{assert_contains, free_port, run_folder, tandem_succeeds, Launcher};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");
/// Bound on any launcher in these tests.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(60);

impl Launcher {
    /// Starts `tandem launch <args>` in `dir`, with extra environment `env`.
    fn start<S: AsRef<OsStr>>(
        dir: &Path,
        name: &str,
        args: &[S],
        env: &[(&str, &str)],
    ) -> Launcher {
        Launcher::start_with(Command::new(TANDEM), dir, name, args, env)
    }

    /// Like [`Launcher::start`] but with a prepared command (e.g. `ip netns exec ... tandem`).
    fn start_with<S: AsRef<OsStr>>(
        mut command: Command,
        dir: &Path,
        name: &str,
        args: &[S],
        env: &[(&str, &str)],
    ) -> Launcher {
        command
            .arg("launch")
            .args(args)
            .current_dir(dir)
            .env_remove("TANDEM_JOB_TOKEN")
            .envs(env.iter().copied());
        Launcher::spawn(command, dir, name)
    }
}

/// Starts `tandem launch <flags> -- sh -c <script>` in `dir`.
fn launch_sh(dir: &Path, flags: &[&str], script: &str) -> Launcher {
    Launcher::start(
        dir,
        "launch",
        &launch_args(flags, &["sh", "-c", script]),
        &[],
    )
}

/// `launch` flags followed by `--` and the worker's command.
fn launch_args<F: AsRef<str>, C: AsRef<str>>(flags: &[F], command: &[C]) -> Vec<String> {
    let flags = flags.iter().map(AsRef::as_ref);
    let command = command.iter().map(AsRef::as_ref);
    flags
        .chain(["--"])
        .chain(command)
        .map(String::from)
        .collect()
}

/// The `launch` flags of node `rank` of a two-node job whose store is at `addr:port`, with
/// `extra` flags and its logs in `log_dir`.
fn two_node_flags(
    rank: &str,
    addr: &str,
    port: &str,
    extra: &[&str],
    log_dir: &str,
) -> Vec<String> {
    let placement = [
        "--nnodes",
        "2",
        "--node-rank",
        rank,
        "--master-addr",
        addr,
        "--master-port",
        port,
    ];
    let logs = ["--log-dir", log_dir];
    [&placement[..], extra, &logs]
        .concat()
        .into_iter()
        .map(String::from)
        .collect()
}

/// Starts node `rank` of a two-node job on this machine, its store on `port`, with `extra`
/// flags, running `sh -c <script>`; its logs go to `dir/node<rank>`.
fn local_node(dir: &Path, rank: &str, port: &str, extra: &[&str], script: &str) -> Launcher {
    let log_dir = format!("node{rank}");
    let flags = two_node_flags(rank, "127.0.0.1", port, extra, &log_dir);
    let args = launch_args(&flags, &["sh", "-c", script]);
    Launcher::start(
        dir,
        &log_dir,
        &args,
        &[("TANDEM_JOB_TOKEN", "two-node-test-secret")],
    )
}

/// The `launch` flags of a job that restarts nothing, gives its workers a second to stop,
/// and gives up on a node after `heartbeat_timeout` seconds without its report.
fn fail_fast(heartbeat_timeout: &str) -> [&str; 6] {
    [
        "--max-restarts",
        "0",
        "--stop-grace-seconds",
        "1",
        "--heartbeat-timeout-seconds",
        heartbeat_timeout,
    ]
}

/// Waits for both nodes' launchers and checks that both succeeded.
fn expect_both_succeed(node_0: &mut Launcher, node_1: &mut Launcher) {
    let status_0 = node_0.wait(LAUNCH_TIMEOUT);
    let status_1 = node_1.wait(LAUNCH_TIMEOUT);
    let both = format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr());
    assert!(
        status_0.success() && status_1.success(),
        "{status_0:?} {status_1:?}\n{both}"
    );
}

/// Starts a job of one worker that ignores SIGTERM, under `--stop-grace-seconds grace`, and
/// waits until the worker has written its process id to `dir/pid`.
fn launch_stubborn_worker(dir: &Path, grace: &str) -> Launcher {
    let script = "trap '' TERM; echo $$ > pid.tmp; mv pid.tmp pid; exec sleep 30";
    let launcher = launch_sh(dir, &["--stop-grace-seconds", grace], script);
    wait_for_file(&dir.join("pid"), Duration::from_secs(20));
    launcher
}

/// The launcher's last line after it stopped its workers on `signal` and none needed SIGKILL.
fn stopped_cleanly(signal: &str) -> String {
    format!(
        "tandem launch: stopped: node 0's launcher received {signal}; the workers stopped, \
         none needed SIGKILL. Run the same command again to continue from the last \
         snapshot.\n"
    )
}

/// The launcher, whose standard error is `stderr`, restarted nothing: it said no restart and
/// the worker's log at `log_path` shows one round.
fn assert_no_restart(stderr: &str, log_path: &Path) {
    assert!(!stderr.contains("restarting"), "{stderr}");
    let log = read(log_path);
    assert_eq!(
        log.matches("===== tandem launch: round").count(),
        1,
        "{log}"
    );
}

/// Waits until `path` exists, at most `timeout`.
fn wait_for_file(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Parses `NAME=value` lines.
fn read_env_file(path: &Path) -> HashMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet, which is dead too).
fn process_is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name: "pid (comm) S ...".
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// Waits until process `pid` is gone, at most `timeout`.
fn wait_until_gone(pid: u32, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !process_is_gone(pid) {
        assert!(
            Instant::now() < deadline,
            "process {pid} still runs after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()))
}

const PRINT_ENV: &str = "for name in RANK LOCAL_RANK GROUP_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT \
     TANDEM_JOB_TOKEN TANDEM_RESTART_COUNT TANDEM_STORE_PREFIX TANDEM_STORE_HOSTED TANDEM_ERROR_FILE; do \
     eval \"echo $name=\\$$name\"; done";

#[test]
fn workers_get_their_ranks_and_the_store_the_agent_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "{PRINT_ENV} > env_$RANK.tmp && mv env_$RANK.tmp env_$RANK; echo hello from $RANK; \
         i=0; while [ ! -e release ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done"
    );
    let flags = ["--standalone", "--nproc-per-node", "2"];
    let mut launcher = launch_sh(dir.path(), &flags, &script);
    let envs = [0, 1].map(|rank| {
        let path = dir.path().join(format!("env_{rank}"));
        wait_for_file(&path, Duration::from_secs(20));
        read_env_file(&path)
    });
    let log_dir = dir.path().canonicalize().unwrap().join("runs/launch-sh");
    for (rank, env) in envs.iter().enumerate() {
        assert_eq!(env["RANK"], rank.to_string());
        assert_eq!(env["LOCAL_RANK"], rank.to_string());
        assert_eq!(env["GROUP_RANK"], "0");
        assert_eq!(env["WORLD_SIZE"], "2");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(env["TANDEM_RESTART_COUNT"], "0");
        assert_eq!(env["TANDEM_STORE_PREFIX"], "round0/pg");
        assert_eq!(env["TANDEM_STORE_HOSTED"], "1");
        assert_eq!(
            env["TANDEM_ERROR_FILE"],
            log_dir
                .join(format!("errors/rank_{rank}.json"))
                .display()
                .to_string()
        );
        assert_eq!(
            env["TANDEM_JOB_TOKEN"].len(),
            64,
            "a generated token is 64 hex digits"
        );
    }
    assert_eq!(envs[0]["MASTER_PORT"], envs[1]["MASTER_PORT"]);
    assert_eq!(envs[0]["TANDEM_JOB_TOKEN"], envs[1]["TANDEM_JOB_TOKEN"]);

    // The store is up while the workers run, and it knows the job token the workers got.
    let port: u16 = envs[0]["MASTER_PORT"].parse().unwrap();
    let token = JobToken::new(&envs[0]["TANDEM_JOB_TOKEN"]).unwrap();
    let store_addr = SocketAddr::from(([127, 0, 0, 1], port));
    let client = StoreClient::connect(store_addr, &token, Duration::from_secs(5)).unwrap();
    let member = client.get("launch/round0/member/0").unwrap().unwrap();
    let member: serde_json::Value = serde_json::from_slice(&member).unwrap();
    assert_eq!(
        (member["node"].as_u64(), member["nproc"].as_u64()),
        (Some(0), Some(2))
    );
    let wrong = JobToken::new("not the job token").unwrap();
    let refused = StoreClient::connect(store_addr, &wrong, Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(
        refused.to_string().contains("the job token was refused"),
        "{refused}"
    );

    std::fs::write(dir.path().join("release"), "").unwrap();
    launcher.exits_with(0, LAUNCH_TIMEOUT);
    // Rank 0's output is on the console, prefixed; rank 1's only in its log.
    let console = launcher.stdout();
    assert_contains(&console, "[rank 0] hello from 0\n");
    assert!(!console.contains("hello from 1"), "{console}");
    let rank_1_log = read(&log_dir.join("logs/rank_1.log"));
    assert!(rank_1_log.starts_with(
        "===== tandem launch: round 0 (restart 0 of at most 3), rank 1, node 0, local rank 1,"
    ));
    assert!(rank_1_log.ends_with("hello from 1\n"), "{rank_1_log}");
}

#[test]
fn without_flags_the_cluster_environment_places_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let modelarts = [
        ("VC_WORKER_HOSTS", "127.0.0.1,127.0.0.2"),
        ("MA_NUM_HOSTS", "1"),
        ("VC_TASK_INDEX", "0"),
        ("MA_NUM_GPUS", "2"),
        ("MASTER_PORT", port.as_str()),
    ];
    let script = "echo $RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT > seen_$RANK";
    let mut launcher = Launcher::start(
        dir.path(),
        "launch",
        &["--", "sh", "-c", script],
        &modelarts,
    );
    let stderr = launcher.exits_with(0, LAUNCH_TIMEOUT);
    assert!(
        stderr.starts_with(
            "tandem launch: node 0 of 1 (modelarts), 2 worker(s), store at 127.0.0.1:"
        ),
        "{stderr}"
    );
    for rank in 0..2 {
        assert_eq!(
            read(&dir.path().join(format!("seen_{rank}"))),
            format!("{rank} 2 127.0.0.1 {port}\n")
        );
    }
}

#[test]
fn tee_shows_every_rank_and_log_dir_follows_output_dir() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--nproc-per-node", "2", "--tee"];
    let script = "echo out $RANK; echo err $RANK >&2";
    let command = ["sh", "-c", script, "sh", "--output-dir", "my_run"];
    let mut launcher = Launcher::start(dir.path(), "launch", &launch_args(&flags, &command), &[]);
    launcher.exits_with(0, LAUNCH_TIMEOUT);
    // A worker's stdout and stderr share one pipe, so the console and the log keep each
    // worker's order; the two workers' lines may interleave on the console.
    let stdout = launcher.stdout();
    for rank in 0..2 {
        let prefix = format!("[rank {rank}] ");
        let rank_lines: Vec<&str> = stdout
            .lines()
            .filter_map(|line| line.strip_prefix(prefix.as_str()))
            .collect();
        assert_eq!(
            rank_lines,
            [format!("out {rank}"), format!("err {rank}")],
            "{stdout}"
        );
        let log = read(&dir.path().join(format!("my_run/logs/rank_{rank}.log")));
        assert!(
            log.ends_with(&format!("\nout {rank}\nerr {rank}\n")),
            "{log}"
        );
    }
}

#[test]
fn a_job_that_trains_nothing_keeps_its_logs_out_of_runs_latest() {
    let dir = tempfile::tempdir().unwrap();
    // A run in runs/latest, where `train` writes without --output-dir.
    let run = dir.path().join("runs/latest");
    let train = common::with_flag(common::small_synthetic_run(&run), "--epochs", "1");
    tandem_succeeds(&train, LAUNCH_TIMEOUT);
    let checkpoint = run.join("epoch_1.safetensors").display().to_string();
    let eval = ["eval", "--checkpoint", &checkpoint, "--threads", "1"];
    let args = launch_args(&["--nproc-per-node", "1"], &eval);
    let mut launcher = Launcher::start(dir.path(), "launch", &args, &[]);
    let stderr = launcher.exits_with(0, LAUNCH_TIMEOUT);
    let logs = dir.path().join("runs/launch-eval");
    assert_contains(&stderr, &format!("logs in {}", logs.display()));
    let log = read(&logs.join("logs/rank_0.log"));
    assert_contains(&log, "\nsamples: 64\n");
    assert!(
        !run.join("logs").exists(),
        "eval's logs went into the run's folder"
    );
    assert!(
        !run.join("errors").exists(),
        "eval's error files went into the run's folder"
    );
}

#[test]
fn a_worker_that_fails_once_is_restarted_with_every_other_worker() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo rank $RANK round $TANDEM_RESTART_COUNT; \
                  if [ $TANDEM_RESTART_COUNT = 0 ]; then \
                    if [ $RANK = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 30; \
                  fi";
    let flags = ["--nproc-per-node", "2", "--stop-grace-seconds", "5"];
    let stderr = launch_sh(dir.path(), &flags, script).exits_with(0, LAUNCH_TIMEOUT);
    assert!(
        stderr.contains(
            "round 0 failed: rank 1 (node 0, local rank 1) exited with code 3; restarting every node (restart 1 of 3)"
        ),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("restarting every node").count(),
        1,
        "{stderr}"
    );
    for rank in 0..2 {
        let log = read(
            &dir.path()
                .join(format!("runs/launch-sh/logs/rank_{rank}.log")),
        );
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 4, "{log}");
        assert!(lines[0].starts_with(&format!(
            "===== tandem launch: round 0 (restart 0 of at most 3), rank {rank},"
        )));
        assert_eq!(lines[1], format!("rank {rank} round 0"));
        assert!(lines[2].starts_with(&format!(
            "===== tandem launch: round 1 (restart 1 of at most 3), rank {rank},"
        )));
        assert_eq!(lines[3], format!("rank {rank} round 1"));
    }
}

#[test]
fn a_worker_killed_by_a_signal_is_named_and_the_job_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let script = "if [ $TANDEM_RESTART_COUNT = 0 ]; then \
                    if [ $RANK = 1 ]; then sleep 0.2; kill -9 $$; fi; exec sleep 30; \
                  fi; echo done $RANK";
    let mut launcher = launch_sh(dir.path(), &["--nproc-per-node", "3"], script);
    let stderr = launcher.exits_with(0, LAUNCH_TIMEOUT);
    assert!(
        stderr.contains(
            "round 0 failed: rank 1 (node 0, local rank 1) killed by SIGKILL; restarting"
        ),
        "{stderr}"
    );
    assert_eq!(launcher.stdout(), "[rank 0] done 0\n");
}

#[test]
fn a_worker_that_always_fails_ends_the_job_with_one_summary_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"if [ $RANK = 1 ]; then
          sleep 0.2
          printf '{"rank":1,"message":"disk full while writing the snapshot","timestamp":12.5}' > "$TANDEM_ERROR_FILE"
          exit 7
        fi
        exec sleep 30"#;
    let flags = [
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "2",
        "--stop-grace-seconds",
        "5",
    ];
    let stderr = launch_sh(dir.path(), &flags, script).exits_with(1, LAUNCH_TIMEOUT);
    let error_file = dir
        .path()
        .canonicalize()
        .unwrap()
        .join("runs/launch-sh/errors/rank_1.json");
    let expected_summary = format!(
        "error: the job failed in round 2 and no restart is left (--max-restarts 2)\n\
         root cause: rank 1 (node 0, local rank 1) exited with code 7\n\
         error (from {}, at 12.5): disk full while writing the snapshot\n\
         other ranks:\n  rank 0: stopped by the launcher (SIGTERM)\n  rank 2: stopped by the launcher (SIGTERM)\n",
        error_file.display()
    );
    assert!(stderr.ends_with(&expected_summary), "{stderr}");
    assert_eq!(stderr.matches("root cause").count(), 1, "{stderr}");
    for round in 0..2 {
        let line = format!(
            "round {round} failed: rank 1 (node 0, local rank 1) exited with code 7; restarting"
        );
        assert_contains(&stderr, &line);
    }
}

#[test]
fn without_an_error_file_the_summary_shows_the_end_of_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let script = "for step in 1 2 3 4 5 6 7 8 9 10 11 12; do echo step $step; done; echo 'loss is nan' >&2; exit 3";
    let stderr =
        launch_sh(dir.path(), &["--max-restarts", "0"], script).exits_with(1, LAUNCH_TIMEOUT);
    let log = dir
        .path()
        .canonicalize()
        .unwrap()
        .join("runs/launch-sh/logs/rank_0.log");
    let tail: String = (4..=12).map(|step| format!("  | step {step}\n")).collect();
    let expected = format!(
        "error: the job failed in round 0 and no restart is left (--max-restarts 0)\n\
         root cause: rank 0 (node 0, local rank 0) exited with code 3\n\
         it wrote no error file; the last lines of {}:\n{tail}  | loss is nan\n",
        log.display()
    );
    assert!(stderr.ends_with(&expected), "{stderr}");
}

#[test]
fn a_program_that_cannot_start_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--max-restarts", "1", "--", "./no-such-program", "--flag"];
    let stderr = Launcher::start(dir.path(), "launch", &args, &[]).exits_with(1, LAUNCH_TIMEOUT);
    assert_contains(&stderr, "root cause: rank 0 (node 0, local rank 0) could not start: ./no-such-program: No such file or directory");
}

#[test]
fn sigterm_to_the_launcher_is_passed_to_the_workers_and_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo stopped > marker_$RANK; exit 0' TERM; echo ready > ready_$RANK; \
                  while :; do sleep 0.05; done";
    let flags = ["--nproc-per-node", "2", "--stop-grace-seconds", "10"];
    let mut launcher = launch_sh(dir.path(), &flags, script);
    for rank in 0..2 {
        let ready = dir.path().join(format!("ready_{rank}"));
        wait_for_file(&ready, Duration::from_secs(20));
    }
    let signalled = Instant::now();
    launcher.signal(libc::SIGTERM);
    let stderr = launcher.exits_with(143, LAUNCH_TIMEOUT);
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "stopping took {:?}",
        signalled.elapsed()
    );
    for rank in 0..2 {
        assert_eq!(
            read(&dir.path().join(format!("marker_{rank}"))),
            "stopped\n"
        );
    }
    assert_contains(&stderr, &stopped_cleanly("SIGTERM"));
    assert_no_restart(&stderr, &dir.path().join("runs/launch-sh/logs/rank_0.log"));
}

#[test]
fn a_worker_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = launch_stubborn_worker(dir.path(), "1");
    let worker_pid: u32 = read(&dir.path().join("pid")).trim().parse().unwrap();
    let signalled = Instant::now();
    launcher.signal(libc::SIGINT);
    let stderr = launcher.exits_with(130, LAUNCH_TIMEOUT);
    let elapsed = signalled.elapsed();
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(4),
        "stopping took {elapsed:?}"
    );
    assert!(
        process_is_gone(worker_pid),
        "worker {worker_pid} survived the launcher"
    );
    assert_contains(
        &stderr,
        "tandem launch: stopped: node 0's launcher received SIGINT; rank 0 did not stop \
         within 1s of SIGTERM (--stop-grace-seconds) and was killed (SIGKILL). Run the same \
         command again to continue from the last snapshot.\n",
    );
}

/// `tandem train`'s flags for a short synthetic run into `out` (see `common::synthetic_run`).
fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = common::synthetic_run(out, 96);
    args = common::with_flag(args, "--epochs", "1");
    args.extend(extra.iter().map(|arg| arg.to_string()));
    args
}

/// What the launcher printed: its own lines and the workers' it showed.
fn console(launcher: &Launcher) -> String {
    format!("{}{}", launcher.stdout(), launcher.stderr())
}

#[test]
fn a_worker_refusing_its_settings_ends_the_job_at_once_with_one_message() {
    let (dir, out) = run_folder();
    tandem_succeeds(train_args(&out, &[]), LAUNCH_TIMEOUT);
    let changed = common::with_flag(train_args(&out, &[]), "--lr", "0.2");
    let flags = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
    ];
    let mut launcher = Launcher::start(dir.path(), "launch", &launch_args(&flags, &changed), &[]);
    let stderr = launcher.exits_with(2, LAUNCH_TIMEOUT);
    let stdout = launcher.stdout();
    let snapshot = out.join("snapshot.safetensors");
    let conflict = format!(
        "error: settings conflict with the snapshot {snapshot}: --lr is 0.2, the snapshot has \
         0.05. To resume it, use the settings it was written with; \
         to change them, start a new run from its weights with --init-from {snapshot} \
         --output-dir NEW, or start over here with --fresh\n",
        snapshot = snapshot.display()
    );
    assert_contains(&stdout, &format!("[rank 0] {conflict}"));
    assert_eq!(
        console(&launcher).matches("settings conflict").count(),
        1,
        "{stdout}{stderr}"
    );
    assert!(
        stderr.ends_with(
            ", refusing its command line or settings (the error is above): a restart would \
             fail the same way, so the job ends without one\n"
        ) && stderr.contains("\nerror: rank "),
        "{stderr}"
    );
    assert_no_restart(&stderr, &out.join("logs/rank_0.log"));
}

#[test]
fn a_bad_flag_of_the_worker_ends_the_job_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let args = launch_args(&["--max-restarts", "3"], &["train", "--no-such-flag"]);
    let mut launcher = Launcher::start(dir.path(), "launch", &args, &[]);
    let stderr = launcher.exits_with(2, LAUNCH_TIMEOUT);
    assert_eq!(
        console(&launcher).matches("--no-such-flag").count(),
        1,
        "{}{stderr}",
        launcher.stdout()
    );
    assert!(
        launcher
            .stdout()
            .starts_with("[rank 0] error: unexpected argument '--no-such-flag' found\n"),
        "{}",
        launcher.stdout()
    );
    assert!(
        stderr.ends_with(
            "error: rank 0 (node 0, local rank 0) exited with code 2, refusing its command \
             line or settings (the error is above): a restart would fail the same way, so the \
             job ends without one\n"
        ),
        "{stderr}"
    );
    let record = read(&dir.path().join("runs/latest/errors/rank_0.json"));
    assert_contains(
        &record,
        "\"message\":\"unexpected argument '--no-such-flag' found\"",
    );
}

#[test]
fn ctrl_c_stops_the_job_saying_it_once_and_how_the_workers_ended() {
    let (dir, out) = run_folder();
    let long = common::with_flag(
        train_args(&out, &["--snapshot-every-steps", "1"]),
        "--synthetic-train",
        "4096",
    );
    let long = common::with_flag(long, "--epochs", "50");
    let no_flags: [&str; 0] = [];
    let mut launcher = Launcher::start(dir.path(), "launch", &launch_args(&no_flags, &long), &[]);
    wait_for_file(&out.join("snapshot.safetensors"), LAUNCH_TIMEOUT);
    // Ctrl-C signals the terminal's whole process group: the launcher and its worker.
    let worker = launcher.worker(0);
    launcher.signal(libc::SIGINT);
    // SAFETY: `kill` has no memory-safety preconditions.
    unsafe { libc::kill(worker as libc::pid_t, libc::SIGINT) };
    let stderr = launcher.exits_with(130, LAUNCH_TIMEOUT);
    let stdout = launcher.stdout();
    let stopped: Vec<&str> = stdout
        .lines()
        .filter(|line| line.contains("stopped") || line.contains("Stopped"))
        .collect();
    assert_eq!(stopped.len(), 1, "{stdout}");
    assert!(
        stopped[0].starts_with("[rank 0] Stopped on request at epoch 1, step "),
        "{stdout}"
    );
    assert!(!stdout.contains("error"), "{stdout}");
    assert!(stderr.ends_with(&stopped_cleanly("SIGINT")), "{stderr}");
}

#[test]
fn a_second_stop_signal_kills_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = launch_stubborn_worker(dir.path(), "20");
    let signalled = Instant::now();
    launcher.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    launcher.signal(libc::SIGTERM);
    launcher.exits_with(143, LAUNCH_TIMEOUT);
    let elapsed = signalled.elapsed();
    assert!(
        elapsed < Duration::from_secs(5),
        "stopping took {elapsed:?} despite the second signal"
    );
}

#[test]
fn two_agents_on_one_machine_restart_both_nodes_together() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let script = "echo $RANK $TANDEM_RESTART_COUNT $WORLD_SIZE $GROUP_RANK >> seen_$RANK; \
                  if [ $TANDEM_RESTART_COUNT = 0 ]; then \
                    if [ $GROUP_RANK = 1 ]; then sleep 0.3; exit 5; fi; exec sleep 30; \
                  fi";
    let extra = ["--stop-grace-seconds", "5", "--join-timeout-seconds", "20"];
    let node = |rank| local_node(dir.path(), rank, &port, &extra, script);
    let mut node_1 = node("1");
    std::thread::sleep(Duration::from_millis(300));
    let mut node_0 = node("0");
    expect_both_succeed(&mut node_0, &mut node_1);
    assert_eq!(read(&dir.path().join("seen_0")), "0 0 2 0\n0 1 2 0\n");
    assert_eq!(read(&dir.path().join("seen_1")), "1 0 2 1\n1 1 2 1\n");
    for launcher in [&node_0, &node_1] {
        let stderr = launcher.stderr();
        assert!(
            stderr.contains("round 0 failed: rank 1 (node 1, local rank 0) exited with code 5; restarting every node"),
            "{stderr}"
        );
    }
    assert!(read(&dir.path().join("node1/logs/rank_1.log"))
        .contains("round 1 (restart 1 of at most 3), rank 1, node 1"));
}

#[test]
fn when_an_agent_dies_its_workers_die_and_the_other_node_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let script = "echo $$ > pid_$RANK.tmp; mv pid_$RANK.tmp pid_$RANK; exec sleep 30";
    let extra = fail_fast("2");
    let node = |rank| local_node(dir.path(), rank, &port, &extra, script);
    let mut node_0 = node("0");
    let node_1 = node("1");
    for rank in 0..2 {
        let pid = dir.path().join(format!("pid_{rank}"));
        wait_for_file(&pid, Duration::from_secs(20));
    }
    let worker_1: u32 = read(&dir.path().join("pid_1")).trim().parse().unwrap();

    node_1.signal(libc::SIGKILL);
    let killed = Instant::now();
    wait_until_gone(worker_1, Duration::from_secs(5));
    let stderr = node_0.exits_with(1, LAUNCH_TIMEOUT);
    let elapsed = killed.elapsed();
    assert!(
        elapsed < Duration::from_secs(8),
        "node 0 took {elapsed:?} to notice"
    );
    assert!(
        stderr.ends_with(
            "root cause: node 1's agent sent no report (it may have died or lost the network)\n\
             other ranks:\n  rank 0: stopped by the launcher (SIGTERM)\n  node 1: no report\n"
        ),
        "{stderr}"
    );
}

#[test]
fn a_multi_node_job_needs_a_shared_token_and_a_master() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str], &str); 2] = [
        (
            "no_token",
            &["--master-addr", "127.0.0.1"],
            "error: a job of 2 nodes needs a shared secret: set TANDEM_JOB_TOKEN to the same value on every node\n",
        ),
        (
            "no_master",
            &[],
            "error: a job of 2 nodes needs --master-addr (the host of node 0, where the store listens)\n",
        ),
    ];
    for (name, flags, expected) in cases {
        let placement = [&["--nnodes", "2", "--node-rank", "1"], flags].concat();
        let args = launch_args(&placement, &["true"]);
        let mut launcher = Launcher::start(dir.path(), name, &args, &[]);
        assert_eq!(launcher.exits_with(1, LAUNCH_TIMEOUT), expected);
    }
}

#[test]
fn two_network_namespaces_act_as_two_hosts() {
    if let Some(reason) = network_namespaces_unavailable("tdm") {
        eprintln!(
            "skipped: two_network_namespaces_act_as_two_hosts needs root and `ip netns`: {reason}"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pair = NetworkPair::create("tdm", "tv", "10.201.0", &std::process::id().to_string())
        .expect("create the network namespaces");
    let token = [("TANDEM_JOB_TOKEN", "netns-test-secret")];
    let script = "echo $RANK $WORLD_SIZE $MASTER_ADDR $TANDEM_RESTART_COUNT > seen_$RANK; \
                  if [ $GROUP_RANK = 1 ] && [ $TANDEM_RESTART_COUNT = 0 ]; then exit 4; fi; \
                  if [ $TANDEM_RESTART_COUNT = 0 ]; then exec sleep 30; fi";
    let extra = ["--stop-grace-seconds", "5", "--join-timeout-seconds", "20"];
    let node = |index: usize| {
        let log_dir = format!("host{index}");
        let flags = two_node_flags(&index.to_string(), "10.201.0.1", "29555", &extra, &log_dir);
        let args = launch_args(&flags, &["sh", "-c", script]);
        Launcher::start_with(
            pair.exec(index, TANDEM),
            dir.path(),
            &log_dir,
            &args,
            &token,
        )
    };
    let mut host_1 = node(1);
    let mut host_0 = node(0);
    expect_both_succeed(&mut host_0, &mut host_1);
    assert_eq!(read(&dir.path().join("seen_0")), "0 2 10.201.0.1 1\n");
    assert_eq!(read(&dir.path().join("seen_1")), "1 2 10.201.0.1 1\n");
    assert!(host_1
        .stderr()
        .contains("round 0 failed: rank 1 (node 1, local rank 0) exited with code 4"));
    drop(pair);
}

/// Set (to a folder) for the process-group workers that the link-cut test starts through
/// `tandem launch` by running this test binary again.
const PG_WORKER_ENV: &str = "TANDEM_LAUNCH_TEST_PG_WORKER";

/// Not a test on its own: the body of those process-group workers. Each joins the group the
/// launcher describes, says it is ready, then all-reduces until a collective fails; it then
/// writes its error file, as `tandem train` does, and exits 1.
#[test]
fn process_group_worker_entry() {
    let Ok(folder) = std::env::var(PG_WORKER_ENV) else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let rank: usize = var("RANK").parse().unwrap();
    let mut options = ProcessGroupOptions::new(
        rank,
        var("WORLD_SIZE").parse().unwrap(),
        &var("MASTER_ADDR"),
        var("MASTER_PORT").parse().unwrap(),
        JobToken::new(&var("TANDEM_JOB_TOKEN")).unwrap(),
    );
    options.host_store = var("TANDEM_STORE_HOSTED") != "1";
    options.prefix = var("TANDEM_STORE_PREFIX");
    options.timeout = Duration::from_secs(3);
    // Namespaces on one kernel look like one host (same boot id, same /tmp) and would talk
    // over Unix sockets, around the link this test cuts.
    options.unix_sockets = false;
    let failure = (|| -> Result<(), tandem_dist::DistError> {
        let mut group = ProcessGroup::connect(options)?;
        std::fs::write(Path::new(&folder).join(format!("ready_{rank}")), "").unwrap();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            let mut values = vec![1.0f32; 4096];
            group.all_reduce_f32(&mut values, ReduceOp::Sum)?;
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    })();
    if let Err(error) = failure {
        let record = format!(
            r#"{{"rank":{rank},"message":{:?},"timestamp":0}}"#,
            error.to_string()
        );
        std::fs::write(var("TANDEM_ERROR_FILE"), record).unwrap();
        eprintln!("rank {rank} failed: {error}");
        std::process::exit(1);
    }
}

#[test]
fn cutting_the_link_between_two_hosts_fails_both_sides_naming_the_peer() {
    if let Some(reason) = network_namespaces_unavailable("tdm") {
        eprintln!("skipped: cutting_the_link_between_two_hosts_fails_both_sides_naming_the_peer needs root and `ip netns`: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tag = format!("{}c", std::process::id());
    let pair =
        NetworkPair::create("tdm", "tv", "10.201.0", &tag).expect("create the network namespaces");
    let this_test_binary = std::env::current_exe().unwrap();
    let folder = dir.path().display().to_string();
    let env = [
        ("TANDEM_JOB_TOKEN", "link-cut-test-secret"),
        (PG_WORKER_ENV, folder.as_str()),
    ];
    let extra = fail_fast("8");
    let worker = [
        this_test_binary.to_str().unwrap(),
        "--exact",
        "process_group_worker_entry",
        "--nocapture",
        "--test-threads",
        "1",
    ];
    let node = |index: usize| {
        let log_dir = format!("host{index}");
        let flags = two_node_flags(&index.to_string(), "10.201.0.1", "29556", &extra, &log_dir);
        let args = launch_args(&flags, &worker);
        Launcher::start_with(pair.exec(index, TANDEM), dir.path(), &log_dir, &args, &env)
    };
    let mut host_0 = node(0);
    let mut host_1 = node(1);
    for rank in 0..2 {
        let ready = dir.path().join(format!("ready_{rank}"));
        wait_for_file(&ready, Duration::from_secs(30));
    }
    std::thread::sleep(Duration::from_millis(300));

    let cut = Command::new("ip")
        .args([
            "-n",
            &pair.names[0],
            "link",
            "set",
            &format!("tv{tag}a"),
            "down",
        ])
        .output()
        .unwrap();
    assert!(
        cut.status.success(),
        "{}",
        String::from_utf8_lossy(&cut.stderr)
    );
    let stderr_0 = host_0.exits_with(1, LAUNCH_TIMEOUT);
    let stderr_1 = host_1.exits_with(1, LAUNCH_TIMEOUT);
    eprintln!("host 0 said:\n{stderr_0}\nhost 1 said:\n{stderr_1}");
    // Each side's summary names its own worker and that worker's error names the other rank.
    assert_contains(
        &stderr_0,
        "root cause: rank 0 (node 0, local rank 0) exited with code 1",
    );
    assert!(stderr_0.contains("rank 1 (10.201.0.2:"), "{stderr_0}");
    assert_contains(
        &stderr_1,
        "root cause: rank 1 (node 1, local rank 0) exited with code 1",
    );
    assert!(stderr_1.contains("rank 0 (10.201.0.1:"), "{stderr_1}");
    drop(pair);
}
