//! Attacks on a running `tandem launch` job through the real binary: outsiders holding
//! hundreds of connections to the store port of a launcher with few descriptors, a worker
//! sent SIGTERM on its own, a worker stopped with SIGSTOP (found by its heartbeat), and a
//! worker whose training thread hangs while it beats (found stalled by its launcher, whether
//! the peer that waits for it runs on its node or on another), and a worker lost before the
//! job's first group formed.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::freeze::{freeze_thread, training_thread};
use common::*;

/// Bound on any launcher in these tests.
const LIMIT: Duration = Duration::from_secs(300);

impl Launcher {
    /// Starts `tandem launch --standalone --nproc-per-node 2 <launch_args> -- <train>`, with
    /// at most `max_descriptors` open files when given.
    fn start(
        dir: &Path,
        launch_args: &[&str],
        train: Vec<String>,
        max_descriptors: Option<u64>,
    ) -> Launcher {
        let mut command = tandem();
        command
            .args(["launch", "--standalone", "--nproc-per-node", "2"])
            .args(launch_args)
            .arg("--")
            .args(train)
            .env_remove("TANDEM_JOB_TOKEN");
        if let Some(limit) = max_descriptors {
            // SAFETY: runs between fork and exec and only calls `setrlimit`, which is
            // async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        Launcher::spawn(command, dir, "launcher")
    }

    /// The store's address, from the launcher's first line.
    fn store_addr(&self) -> SocketAddr {
        let deadline = Instant::now() + LIMIT;
        loop {
            let stderr = self.stderr();
            if let Some(rest) = stderr.split("store at ").nth(1) {
                if let Some(addr) = rest.split(',').next() {
                    return addr.parse().expect("store address");
                }
            }
            assert!(Instant::now() < deadline, "no store address:\n{stderr}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Starts, in a new folder, a two-worker job of `epochs` short epochs (long enough to strike
/// in the middle) with `extra` training flags, under `launch_args` and `max_descriptors` (see
/// [`Launcher::start`]), and waits until it trains. Returns the folder, the run's output
/// folder and the launcher.
fn start_training(
    launch_args: &[&str],
    epochs: usize,
    extra: &[&str],
    max_descriptors: Option<u64>,
) -> (tempfile::TempDir, PathBuf, Launcher) {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("run");
    let train = with_flag(synthetic_run(&output, 256), "--epochs", &epochs.to_string());
    let mut train = with_flag(train, "--batch-size", "16");
    train.extend(extra.iter().map(|flag| flag.to_string()));
    let mut launcher = Launcher::start(dir.path(), launch_args, train, max_descriptors);
    launcher.wait_for_training(&output, LIMIT);
    (dir, output, launcher)
}

/// The open descriptors and the threads of process `pid`.
fn descriptors_and_threads(pid: u32) -> (usize, usize) {
    let descriptors = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let threads = status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0);
    (descriptors, threads)
}

/// Outsiders without the token: keeps `count` raw connections to `addr` open, opening a
/// new one for each the server closes, until `stop` is set.
fn hold_connections(addr: SocketAddr, count: usize, stop: &AtomicBool) {
    let mut held: Vec<TcpStream> = Vec::with_capacity(count);
    while !stop.load(Ordering::SeqCst) {
        held.retain(|stream| {
            let mut byte = [0u8; 64];
            stream.set_nonblocking(true).is_ok()
                && match std::io::Read::read(&mut &*stream, &mut byte) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(error) => error.kind() == std::io::ErrorKind::WouldBlock,
                }
        });
        while held.len() < count && !stop.load(Ordering::SeqCst) {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(stream) => held.push(stream),
                Err(_) => break,
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn hundreds_of_outsider_connections_under_a_low_descriptor_limit_do_not_stop_a_restart() {
    let launch_args = ["--max-restarts", "3", "--stop-grace-seconds", "5"];
    let (_dir, output, mut launcher) = start_training(&launch_args, 40, &[], Some(256));
    let store = launcher.store_addr();
    let before = descriptors_and_threads(launcher.pid());
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| hold_connections(store, 400, &stop));
        std::thread::sleep(Duration::from_secs(1));
        let under_attack = descriptors_and_threads(launcher.pid());
        eprintln!("launcher descriptors and threads: {before:?} before, {under_attack:?} under 400 outsider connections");
        send_signal(launcher.worker(1), libc::SIGKILL);
        let status = launcher.wait(LIMIT);
        stop.store(true, Ordering::SeqCst);
        let stderr = launcher.stderr();
        assert!(status.success(), "{stderr}");
        assert!(
            stderr.contains(
                "round 0 failed: rank 1 (node 0, local rank 1) killed by SIGKILL; restarting"
            ),
            "{stderr}"
        );
        // Before the gate: one descriptor and one thread per connection, up to the limit.
        assert!(under_attack.0 < 64, "{under_attack:?}\n{stderr}");
        assert!(under_attack.1 < 32, "{under_attack:?}\n{stderr}");
    });
    assert!(output.join("epoch_40.safetensors").is_file());
}

#[test]
fn sigterm_to_one_worker_is_a_failure_naming_its_rank_the_signal_and_the_epoch() {
    let launch_args = ["--max-restarts", "0", "--stop-grace-seconds", "5"];
    let (_dir, output, mut launcher) = start_training(&launch_args, 1000, &[], None);
    send_signal(launcher.worker(1), libc::SIGTERM);
    let stderr = launcher.exits_with(1, LIMIT);
    assert_contains(
        &stderr,
        "root cause: rank 1 (node 0, local rank 1) killed by SIGTERM\n",
    );
    assert!(
        stderr.contains("): stopped by SIGTERM at epoch "),
        "{stderr}"
    );
    assert!(
        !stderr.contains("every worker finished successfully"),
        "{stderr}"
    );
    assert!(output.join("snapshot.safetensors").is_file());
}

#[test]
fn a_stopped_worker_is_found_by_its_silent_heartbeat_killed_and_named_as_the_root_cause() {
    // No collective timeout would end this job for 10 minutes: the heartbeat finds the
    // stopped worker.
    let launch_args = ["--max-restarts", "0", "--stop-grace-seconds", "60"];
    let timeout = ["--collective-timeout", "600"];
    let (_dir, _output, mut launcher) = start_training(&launch_args, 1000, &timeout, None);
    let stuck = launcher.worker(1);
    let stopped_at = Instant::now();
    send_signal(stuck, libc::SIGSTOP);
    let stderr = launcher.exits_with(1, LIMIT);
    let waited = stopped_at.elapsed();
    assert!(
        stderr.contains(&format!("rank 1 (pid {stuck}) sent no heartbeat for 1.")),
        "{stderr}"
    );
    let cause = "root cause: rank 1 (node 0, local rank 1) sent no heartbeat for ";
    let (_, after) = stderr.split_once(cause).expect(&stderr);
    assert!(
        after.starts_with("1.") || after.starts_with("2."),
        "silent for about the 1 s timeout: {stderr}"
    );
    assert!(
        after.contains(
            " s (it was stopped: SIGSTOP or a debugger); the launcher killed it (SIGKILL)\n"
        ),
        "{stderr}"
    );
    // Its peer either saw the connection close first or was stopped with the round.
    assert!(
        stderr.contains("  rank 0: stopped by the launcher (SIGTERM)")
            || stderr.contains("  rank 0: exited with code 1"),
        "{stderr}"
    );
    // Without the heartbeat, the job would wait the 600 s collective timeout.
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
}

#[test]
fn a_worker_whose_training_thread_hangs_while_it_beats_is_found_stalled_and_named() {
    // The heartbeat thread beats on: only the peer's wait in a collective, while the hung
    // worker neither computes nor waits, tells.
    let launch_args = ["--max-restarts", "0", "--stop-grace-seconds", "60"];
    let timeout = ["--collective-timeout", "600"];
    let (_dir, _output, mut launcher) = start_training(&launch_args, 1000, &timeout, None);
    let stuck = launcher.worker(1);
    let training = training_thread(stuck);
    let frozen_at = Instant::now();
    let tracer = freeze_thread(training, LIMIT);
    let stderr = launcher.exits_with(1, LIMIT);
    let waited = frozen_at.elapsed();
    assert!(tracer.join().unwrap(), "the hung worker was killed");
    assert!(
        stderr.contains(&format!("rank 1 (pid {stuck}) made no progress for ")),
        "{stderr}"
    );
    let cause = "root cause: rank 1 (node 0, local rank 1) made no progress for ";
    let (_, after) = stderr.split_once(cause).expect(&stderr);
    let line = after.lines().next().unwrap_or_default();
    assert!(
        line.contains(" s (no CPU time, no wait for its peers) while rank 0 waited ")
            && line
                .ends_with(" s for it in a collective: it hangs; the launcher killed it (SIGKILL)"),
        "{stderr}"
    );
    // Without it, the job would wait the 600 s collective timeout.
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
}

/// Starts node `node` of a two-node job on loopback, one worker per node, its store on
/// `port`, under `launch_args`, training with `train`; its logs go to `dir/node<node>`.
fn start_node(
    dir: &Path,
    node: usize,
    port: &str,
    launch_args: &[&str],
    train: &[String],
) -> Launcher {
    let name = format!("node{node}");
    let mut command = tandem();
    command
        .args(["launch", "--nnodes", "2", "--node-rank", &node.to_string()])
        .args(["--master-addr", "127.0.0.1", "--master-port", port])
        .args(["--nproc-per-node", "1", "--log-dir"])
        .arg(dir.join(&name))
        .args(launch_args)
        .arg("--")
        .args(train)
        .env("TANDEM_JOB_TOKEN", "hostile-faults-two-nodes");
    Launcher::spawn(command, dir, &name)
}

/// Waits until `log` shows step 2 of training, at most [`LIMIT`], while both `nodes` run.
fn wait_for_step_2(log: &Path, nodes: &mut [&mut Launcher]) {
    let deadline = Instant::now() + LIMIT;
    while !std::fs::read_to_string(log).is_ok_and(|text| text.contains("step 2")) {
        let running = nodes.iter_mut().all(|node| !node.has_exited());
        if !running || Instant::now() >= deadline {
            let stderrs: Vec<String> = nodes.iter().map(|node| node.stderr()).collect();
            panic!("no training:\n{}", stderrs.join("\n---\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_worker_that_hangs_while_only_another_nodes_rank_waits_for_it_is_found_stalled_and_named() {
    // Rank 1, alone on node 1, hangs while it beats; only rank 0 on node 0 waits for it.
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("run");
    let train = with_flag(synthetic_run(&output, 256), "--epochs", "1000");
    let mut train = with_flag(train, "--batch-size", "16");
    train.extend(["--collective-timeout", "600"].map(String::from));
    let port = free_port().to_string();
    let launch_args = ["--max-restarts", "0", "--stop-grace-seconds", "20"];
    let mut node_0 = start_node(dir.path(), 0, &port, &launch_args, &train);
    let mut node_1 = start_node(dir.path(), 1, &port, &launch_args, &train);
    let log = dir.path().join("node0/logs/rank_0.log");
    wait_for_step_2(&log, &mut [&mut node_0, &mut node_1]);
    let stuck = node_1.worker(1);
    let training = training_thread(stuck);
    let frozen_at = Instant::now();
    let tracer = freeze_thread(training, LIMIT);
    let stderr_1 = node_1.exits_with(1, LIMIT);
    let waited = frozen_at.elapsed();
    let stderr_0 = node_0.exits_with(1, LIMIT);
    eprintln!(
        "node 1 killed the hung rank {:.1} s after it hung",
        waited.as_secs_f64()
    );
    assert!(tracer.join().unwrap(), "the hung worker was killed");
    assert!(
        stderr_1.contains(&format!("rank 1 (pid {stuck}) made no progress for ")),
        "{stderr_1}"
    );
    for stderr in [&stderr_0, &stderr_1] {
        let cause = "root cause: rank 1 (node 1, local rank 0) made no progress for ";
        let (_, after) = stderr.split_once(cause).expect(stderr);
        let line = after.lines().next().unwrap_or_default();
        assert!(
            line.contains(" s (no CPU time, no wait for its peers) while rank 0 (node 0) waited ")
                && line.ends_with(
                    " s for it in a collective: it hangs; the launcher killed it (SIGKILL)"
                ),
            "{stderr}"
        );
    }
    // Without it, the job would wait the 600 s collective timeout.
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
}

/// The row of `rank` in `tandem status`'s report, split into its columns.
fn status_row(report: &str, rank: usize) -> Option<Vec<String>> {
    report
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .find(|columns| {
            columns
                .first()
                .is_some_and(|first| *first == rank.to_string())
        })
}

#[test]
fn tandem_status_shows_the_round_and_each_rank_with_its_pid_step_and_heartbeat() {
    let (_dir, output, mut launcher) = start_training(&["--max-restarts", "0"], 1000, &[], None);
    let job_file = output.join("job.json");
    let mode = std::fs::metadata(&job_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the job file holds the token");
    let deadline = Instant::now() + LIMIT;
    let report = loop {
        let report = expect_success(&run_bounded(tandem().arg("status").arg(&output), LIMIT));
        // Both ranks have published a step once the first steps are done.
        let stepped = (0..2).all(|rank| {
            status_row(&report, rank).is_some_and(|row| row.get(4).is_some_and(|step| step != "-"))
        });
        if stepped {
            break report;
        }
        assert!(Instant::now() < deadline, "no step in:\n{report}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        report.contains("): round 0: nodes 0 (2 workers)"),
        "{report}"
    );
    for rank in 0..2 {
        let row = status_row(&report, rank).unwrap();
        assert_eq!(row[2], launcher.worker(rank).to_string(), "{report}");
        assert!(row[3].parse::<u64>().unwrap() >= 1, "{report}");
        assert!(row[5].parse::<f64>().unwrap() > 0.0, "{report}");
        assert_eq!(row[6], "beating", "{report}");
    }
    launcher.signal(libc::SIGTERM);
    launcher.wait(LIMIT);
    let ended = run_bounded(tandem().arg("status").arg(&output), LIMIT);
    assert!(!ended.status.success());
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(
        stderr.contains("the job has ended or its launcher is gone"),
        "{stderr}"
    );
}

/// The process id of `launcher`'s worker of `rank`, once it started (bounded).
fn worker_once_started(launcher: &Launcher, rank: usize) -> u32 {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(pid) = launcher.try_worker(rank) {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "no worker of rank {rank} started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_worker_lost_before_the_first_group_formed_fails_the_round_at_once_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("run");
    let train = with_flag(synthetic_run(&output, 256), "--global-batch-size", "32");
    let train = with_flag(train, "--batch-size", "16");
    // Rank 1, blocked in the formation, ends at the grace's SIGKILL.
    let launch_args = [
        "--keep-survivors",
        "--max-restarts",
        "0",
        "--stop-grace-seconds",
        "3",
    ];
    let mut launcher = Launcher::start(dir.path(), &launch_args, train, None);
    // Rank 0 stops before it can join: rank 1 waits in the group's formation.
    let rank_0 = worker_once_started(&launcher, 0);
    send_signal(rank_0, libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(2));
    send_signal(rank_0, libc::SIGKILL);
    let killed = Instant::now();
    let stderr = launcher.exits_with(1, LIMIT);
    assert_contains(
        &stderr,
        "root cause: rank 0 (node 0, local rank 0) killed by SIGKILL\n",
    );
    assert!(!stderr.contains("membership 1"), "{stderr}");
    // Rank 1 is stopped by the launcher within the grace, not left to the collective timeout.
    assert!(killed.elapsed() < Duration::from_secs(30), "{stderr}");
}
