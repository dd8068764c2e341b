//! `tandem launch --nnodes 1:2`: two agents of two workers each (in two network namespaces as
//! two hosts when the machine allows it, else both on loopback) train with
//! `--global-batch-size`, so that the steps do not depend on the number of workers. Node 1 is
//! killed for good mid-epoch: node 0 goes on alone after the last call and ends with the bits
//! of an uninterrupted run; started again, node 1 joins the next round. With
//! `--keep-survivors` (node 1 then a host of its own, reached only through the link), node 1
//! killed, cut off by its link going down, or its launcher stopped, and a worker lost on either
//! node, leave the other workers running in-process with the same bits; node 1 cut off pauses
//! and rejoins when its link heals, and ends at once when node 0 and its store are killed.
//! Every wait is bounded and every launcher is killed if a test fails.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::elastic::{elastic_train_args, snapshot_step, wait_until};
use common::netns::{network_namespaces_unavailable, NetworkPair};
use common::*;

/// Bound on each launcher and on each training run.
const LIMIT: Duration = Duration::from_secs(180);
/// Where the two nodes run: two network namespaces, or this machine's loopback.
struct Hosts {
    /// The sample trace of every worker (`TANDEM_SAMPLE_TRACE`).
    trace: PathBuf,
    /// The run's epochs (`train_args` has 1).
    epochs: String,
    pair: Option<NetworkPair>,
    master_addr: String,
    master_port: String,
    dir: PathBuf,
    output_dir: PathBuf,
}

impl Hosts {
    fn new(dir: &Path, tag: &str) -> Hosts {
        let pair = match network_namespaces_unavailable("tde") {
            None => Some(
                NetworkPair::create(
                    "tde",
                    "te",
                    "10.202.0",
                    &format!("{}{tag}", std::process::id()),
                )
                .expect("create the network namespaces"),
            ),
            Some(reason) => {
                eprintln!("two agents on loopback, not two network namespaces: {reason}");
                None
            }
        };
        let (master_addr, master_port) = match &pair {
            // Each pair has network stacks of its own: the port is free there.
            Some(pair) => (pair.address(0), "29571".to_string()),
            None => ("127.0.0.1".to_string(), free_port().to_string()),
        };
        Hosts {
            pair,
            master_addr,
            master_port,
            dir: dir.to_path_buf(),
            output_dir: dir.join("run"),
            trace: dir.join("trace"),
            epochs: "1".to_string(),
        }
    }

    /// Starts node `node`'s agent, `name` naming its output files, in a process group of its
    /// own (with its workers).
    fn start(&self, node: usize, name: &str) -> Launcher {
        let elastic = ["--nnodes", "1:2", "--last-call", "1"];
        let flags = [&elastic[..], &["--heartbeat-timeout-seconds", "3"]].concat();
        self.start_with(node, name, &flags, false)
    }

    /// [`Hosts::start`] with the launcher's `flags` (the number of nodes among them); with
    /// `own_host`, node 1 runs as a host of its own, which its peers reach only through the
    /// link (not through Unix sockets or shared memory).
    fn start_with(&self, node: usize, name: &str, flags: &[&str], own_host: bool) -> Launcher {
        let tandem = env!("CARGO_BIN_EXE_tandem");
        let mut command = match &self.pair {
            Some(pair) if node == 1 && own_host => {
                let boot_id = self.dir.join("boot_id_of_node_1");
                std::fs::write(
                    &boot_id,
                    format!("tandem-test-node-1-{}\n", std::process::id()),
                )
                .unwrap();
                pair.exec_as_own_host(node, &boot_id, tandem)
            }
            Some(pair) => pair.exec(node, tandem),
            None => Command::new(tandem),
        };
        let node_rank = node.to_string();
        let log_dir = self.dir.join(format!("logs-node{node}"));
        std::fs::create_dir_all(&self.trace).unwrap();
        command
            .args(["launch", "--node-rank", &node_rank])
            .args(flags)
            .args(["--master-addr", &self.master_addr])
            .args(["--master-port", &self.master_port])
            .args(["--nproc-per-node", "2"])
            .args(["--stop-grace-seconds", "20", "--join-timeout-seconds", "60"])
            .arg("--log-dir")
            .arg(&log_dir)
            .arg("--")
            .args(with_flag(
                elastic_train_args(&self.output_dir),
                "--epochs",
                &self.epochs,
            ))
            .current_dir(&self.dir)
            .env("TANDEM_SAMPLE_TRACE", &self.trace)
            .env("TANDEM_JOB_TOKEN", "elastic-test-secret")
            .process_group(0);
        Launcher::spawn(command, &self.dir, name)
    }
}

/// Kills `launcher`'s whole process group (the agent and its workers) with SIGKILL and reaps
/// the agent.
fn kill_for_good(launcher: &mut Launcher) {
    // SAFETY: `kill` has no memory-safety preconditions; the group is the agent's own.
    let killed = unsafe { libc::kill(-(launcher.pid() as libc::pid_t), libc::SIGKILL) };
    assert_eq!(killed, 0, "kill the process group of the agent");
    let status = launcher.wait(Duration::from_secs(10));
    assert_eq!(status.code(), None, "the agent was killed by SIGKILL");
}

/// Waits until the snapshot in the run's folder is past step `step`.
fn wait_for_step(hosts: &Hosts, step: u64, node_0: &Launcher) {
    wait_until(
        &format!("a snapshot past step {step}"),
        || snapshot_step(&hosts.output_dir).is_some_and(|done| done > step),
        || format!("node 0 said:\n{}", node_0.stderr()),
    );
}

/// The uninterrupted run, in one process, in `dir/uninterrupted`.
fn uninterrupted_run(dir: &Path) -> PathBuf {
    uninterrupted_run_of(dir, "1")
}

/// [`uninterrupted_run`] of `epochs` epochs.
fn uninterrupted_run_of(dir: &Path, epochs: &str) -> PathBuf {
    let output_dir = dir.join("uninterrupted");
    let args = with_flag(elastic_train_args(&output_dir), "--epochs", epochs);
    expect_success(&run_bounded(tandem().args(args), LIMIT));
    output_dir
}

/// The uninterrupted run of `epochs` epochs in `dir`, and hosts `tag` whose job trains as
/// long.
fn uninterrupted_and_hosts(dir: &Path, tag: &str, epochs: &str) -> (PathBuf, Hosts) {
    let expected = uninterrupted_run_of(dir, epochs);
    let mut hosts = Hosts::new(dir, tag);
    hosts.epochs = epochs.to_string();
    (expected, hosts)
}

/// Starts both nodes, waits for their first round of 4 workers and a few steps, then kills
/// node 1 for good and waits for node 0's next round without it.
fn lose_node_1(hosts: &Hosts) -> Launcher {
    let node_0 = hosts.start(0, "node0");
    let mut node_1 = hosts.start(1, "node1");
    let first_round = "tandem launch: round 0: nodes 0 (2 workers), 1 (2 workers); world size 4\n";
    wait_until(
        "the first round of both nodes",
        || node_0.stderr().contains(first_round),
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    wait_for_step(hosts, 3, &node_0);
    kill_for_good(&mut node_1);
    let killed = Instant::now();
    wait_until(
        "node 0's round without node 1",
        || node_0.stderr().contains("tandem launch: round 1: "),
        || format!("node 0:\n{}", node_0.stderr()),
    );
    eprintln!(
        "node 0 started round 1 {:.1} s after node 1 was killed",
        killed.elapsed().as_secs_f64()
    );
    let stderr = node_0.stderr();
    let line = stderr
        .lines()
        .find(|line| line.starts_with("tandem launch: round 1: "))
        .unwrap();
    let (start, rest) = line
        .split_once("; node 1 lost (no heartbeat for ")
        .unwrap_or_else(|| panic!("round 1 does not say that node 1 was lost: {line}"));
    assert_eq!(start, "tandem launch: round 1: nodes 0 (2 workers)");
    assert!(
        rest.ends_with(" s); world size 4 -> 2"),
        "round 1 does not say the new world size: {line}"
    );
    node_0
}

#[test]
fn node_0_goes_on_alone_when_node_1_is_lost_and_ends_with_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let hosts = Hosts::new(dir.path(), "l");
    let started = Instant::now();
    let mut node_0 = lose_node_1(&hosts);
    let status = node_0.wait(LIMIT);
    let stderr = node_0.stderr();
    eprintln!(
        "the elastic run took {:.1} s; node 0 said:\n{stderr}",
        started.elapsed().as_secs_f64()
    );
    assert!(status.success(), "{status:?}\n{stderr}");
    assert_contains(&stderr, "every worker finished successfully");
    assert_contains(&node_0.stdout(), "world size: 4 -> 2 at epoch 1, step ");
    assert_same_bits(&expected, &hosts.output_dir, "the elastic run");
}

#[test]
fn node_1_started_again_joins_the_next_round_and_the_bits_stay_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let hosts = Hosts::new(dir.path(), "j");
    let started = Instant::now();
    let mut node_0 = lose_node_1(&hosts);
    let alone_from = snapshot_step(&hosts.output_dir).unwrap_or(0);
    wait_for_step(&hosts, alone_from + 2, &node_0);
    let mut node_1 = hosts.start(1, "node1-again");
    let joined = "tandem launch: round 2: nodes 0 (2 workers), 1 (2 workers); node 1 joined; \
                  world size 2 -> 4\n";
    wait_until(
        "node 1's join",
        || node_0.stderr().contains(joined),
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    let status_0 = node_0.wait(LIMIT);
    let status_1 = node_1.wait(LIMIT);
    let (stderr_0, stderr_1) = (node_0.stderr(), node_1.stderr());
    eprintln!(
        "the elastic run took {:.1} s; node 0 said:\n{stderr_0}\nnode 1 said:\n{stderr_1}",
        started.elapsed().as_secs_f64()
    );
    assert!(status_0.success(), "{status_0:?}\n{stderr_0}");
    assert!(status_1.success(), "{status_1:?}\n{stderr_1}");
    assert_contains(
        &stderr_0,
        "tandem launch: round 1 ends for a new member (node 1 is waiting to join): the workers \
         write a snapshot and stop\n",
    );
    assert_contains(&stderr_1, joined);
    // The round that let node 1 in is no restart: node 1's workers ran in round 2 after the
    // one restart that losing it took.
    let log = std::fs::read_to_string(dir.path().join("logs-node1/logs/rank_2.log")).unwrap();
    assert_contains(&log, "round 2 (restart 1 of at most 3), rank 2, node 1");
    let stdout_0 = node_0.stdout();
    assert_contains(&stdout_0, "world size: 4 -> 2 at epoch 1, step ");
    assert_contains(&stdout_0, "world size: 2 -> 4 at epoch 1, step ");
    assert_same_bits(&expected, &hosts.output_dir, "the elastic run");
}

#[test]
fn fewer_nodes_than_the_minimum_end_the_job_naming_who_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let start = |node: usize| {
        let node_rank = node.to_string();
        let mut command = Command::new(env!("CARGO_BIN_EXE_tandem"));
        command
            .args(["launch", "--nnodes", "2:3", "--node-rank", &node_rank])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["--last-call", "0.5", "--heartbeat-timeout-seconds", "2"])
            .args(["--stop-grace-seconds", "2", "--join-timeout-seconds", "3"])
            .args([
                "--log-dir",
                &format!("logs-node{node}"),
                "--",
                "sleep",
                "30",
            ])
            .current_dir(dir.path())
            .env("TANDEM_JOB_TOKEN", "elastic-minimum-test-secret")
            .process_group(0);
        Launcher::spawn(command, dir.path(), &format!("node{node}"))
    };
    let mut node_0 = start(0);
    let mut node_1 = start(1);
    wait_until(
        "the first round of both nodes",
        || {
            node_0.stderr().contains(
                "tandem launch: round 0: nodes 0 (1 worker), 1 (1 worker); world size 2\n",
            )
        },
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    kill_for_good(&mut node_1);
    let killed = Instant::now();
    let status = node_0.wait(Duration::from_secs(60));
    let elapsed = killed.elapsed();
    let stderr = node_0.stderr();
    eprintln!("node 0 said:\n{stderr}");
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_contains(
        &stderr,
        "tandem launch: round 0 failed: node 1's agent sent no report (it may have died or lost \
         the network); restarting every node (restart 1 of 3)\n",
    );
    let error = stderr
        .lines()
        .last()
        .unwrap_or_default()
        .split_once(" (lost in round 0: no heartbeat for ");
    let Some((start, end)) = error else {
        panic!("the error does not say that node 1 was lost:\n{stderr}");
    };
    assert_eq!(
        start,
        "error: round 1 needs at least 2 nodes (--nnodes 2:3), but only node 0 joined before the \
         join timeout; missing: node 1"
    );
    assert!(end.ends_with(" s), node 2"), "{stderr}");
    assert!(
        elapsed < Duration::from_secs(15),
        "node 0 took {elapsed:?} to give up"
    );
}

/// Waits for both nodes' launchers, says what each said, checks that both succeeded, and
/// returns what they said.
fn both_succeed(node_0: &mut Launcher, node_1: &mut Launcher) -> (String, String) {
    let status_0 = node_0.wait(LIMIT);
    let status_1 = node_1.wait(LIMIT);
    let (stderr_0, stderr_1) = (node_0.stderr(), node_1.stderr());
    eprintln!("node 0 said:\n{stderr_0}\nnode 1 said:\n{stderr_1}");
    assert!(status_0.success(), "{status_0:?}\n{stderr_0}");
    assert!(status_1.success(), "{status_1:?}\n{stderr_1}");
    (stderr_0, stderr_1)
}

/// The last step worker `pid` committed, from its sample trace.
fn last_step_of(trace: &Path, pid: u32) -> Option<u64> {
    let text =
        std::fs::read_to_string(trace.join(format!("samples-{pid}.jsonl"))).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|record| record["step"].as_u64())
        .max()
}

/// The world sizes at which each worker process (by pid) committed steps, from the sample
/// trace (`samples-<pid>.jsonl`; a record torn by SIGKILL is skipped).
fn world_sizes_by_pid(trace: &Path) -> BTreeMap<u32, BTreeSet<u64>> {
    let mut sizes: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for entry in std::fs::read_dir(trace).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("samples-")
            .and_then(|rest| rest.strip_suffix(".jsonl"))
        else {
            continue;
        };
        let pid: u32 = pid.parse().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines() {
            if let Ok(record) = serde_json::from_str::<serde_json::Value>(line) {
                let size = record["world_size"].as_u64().unwrap();
                sizes.entry(pid).or_default().insert(size);
            }
        }
    }
    sizes
}

/// Asserts that each of `expected` (pid, world sizes) committed steps at exactly those world
/// sizes, and that no other process committed any at the job's last size, `last`: the same
/// processes went on, none was restarted.
fn assert_went_on_in_process(trace: &Path, expected: &[(u32, &[u64])], last: u64) {
    let sizes = world_sizes_by_pid(trace);
    for (pid, wanted) in expected {
        let wanted: BTreeSet<u64> = wanted.iter().copied().collect();
        assert_eq!(sizes.get(pid), Some(&wanted), "process {pid}: {sizes:?}");
    }
    let at_last: BTreeSet<u32> = sizes
        .iter()
        .filter(|(_, sizes)| sizes.contains(&last))
        .map(|(pid, _)| *pid)
        .collect();
    let survivors: BTreeSet<u32> = expected
        .iter()
        .filter(|(_, wanted)| wanted.contains(&last))
        .map(|(pid, _)| *pid)
        .collect();
    assert_eq!(at_last, survivors, "{sizes:?}");
}

/// The launcher flags of the `--keep-survivors` tests: two nodes, no restart to hide behind,
/// the default heartbeat timeout (1 s).
const KEEP_SURVIVORS: [&str; 5] = ["--nnodes", "2", "--keep-survivors", "--max-restarts", "0"];

/// Starts both nodes with `--keep-survivors` (node 1 a host of its own), waits for a few
/// steps of their round, and returns them with the process ids of node 0's workers.
fn start_keeping_survivors(hosts: &Hosts) -> (Launcher, Launcher, [u32; 2]) {
    start_keeping_survivors_with(hosts, &[])
}

/// [`start_keeping_survivors`] with the launchers' `extra` flags.
fn start_keeping_survivors_with(hosts: &Hosts, extra: &[&str]) -> (Launcher, Launcher, [u32; 2]) {
    let flags = [&KEEP_SURVIVORS[..], extra].concat();
    let node_0 = hosts.start_with(0, "node0", &flags, true);
    let node_1 = hosts.start_with(1, "node1", &flags, true);
    wait_for_step(hosts, 3, &node_0);
    let survivors = [node_0.worker(0), node_0.worker(1)];
    (node_0, node_1, survivors)
}

/// Waits until node 0 published a membership that leaves node 1 out as lost.
fn wait_for_node_1_left_out(node_0: &Launcher) {
    wait_until(
        "node 0's membership without node 1",
        || {
            node_0
                .stderr()
                .contains("tandem launch: membership 1: node 1 lost ")
        },
        || format!("node 0:\n{}", node_0.stderr()),
    );
}

/// Waits for node 0's membership without node 1, then for the job's end; checks that node 0's
/// workers went on in-process (the same processes, no restart) and that the run ends with the
/// uninterrupted run's bits.
fn node_0_goes_on_without_node_1(
    hosts: &Hosts,
    node_0: &mut Launcher,
    survivors: [u32; 2],
    expected: &Path,
) {
    let membership =
        "tandem launch: membership 1: node 1 lost (its launcher sent no heartbeat for ";
    wait_until(
        "node 0's membership without node 1",
        || node_0.stderr().contains(membership),
        || format!("node 0:\n{}", node_0.stderr()),
    );
    let stderr = node_0.stderr();
    let line = stderr
        .lines()
        .find(|line| line.starts_with(membership))
        .unwrap();
    let (_, rest) = line.split_once(membership).unwrap();
    let (_, rest) = rest
        .split_once(" s): ranks 2, 3; ")
        .unwrap_or_else(|| panic!("the membership does not name node 1's ranks: {line}"));
    assert_eq!(
        rest,
        "ranks [0, 1] go on in-process (world size 4 -> 2), nobody restarts"
    );
    let status = node_0.wait(LIMIT);
    let stderr = node_0.stderr();
    eprintln!("node 0 said:\n{stderr}");
    assert!(status.success(), "{status:?}\n{stderr}");
    assert_contains(&stderr, "every worker finished successfully");
    assert!(
        !stderr.contains("round 1"),
        "node 0 started another round:\n{stderr}"
    );
    let stdout = node_0.stdout();
    assert_contains(&stdout, "; world size 4 -> 2 at epoch 1, step ");
    assert!(
        !stdout.contains("resum"),
        "nothing was read from disk:\n{stdout}"
    );
    let [rank_0, rank_1] = survivors;
    assert_went_on_in_process(&hosts.trace, &[(rank_0, &[4, 2]), (rank_1, &[4, 2])], 2);
    assert_same_bits(expected, &hosts.output_dir, "node 1 lost, node 0 kept on");
}

#[test]
fn keep_survivors_node_0_goes_on_in_process_when_node_1_is_killed_with_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let hosts = Hosts::new(dir.path(), "k");
    let (mut node_0, mut node_1, survivors) = start_keeping_survivors(&hosts);
    kill_for_good(&mut node_1);
    node_0_goes_on_without_node_1(&hosts, &mut node_0, survivors, &expected);
}

#[test]
fn keep_survivors_node_0_goes_on_in_process_when_node_1_s_link_goes_down_with_the_same_bits() {
    if let Some(reason) = network_namespaces_unavailable("tde") {
        eprintln!(
            "skipped: keep_survivors_node_0_goes_on_in_process_when_node_1_s_link_goes_down_with_\
             the_same_bits needs root and `ip netns`: {reason}"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let hosts = Hosts::new(dir.path(), "d");
    let (mut node_0, mut node_1, survivors) =
        start_keeping_survivors_with(&hosts, &["--rendezvous-timeout", "3"]);
    let node_1_workers = [node_1.worker(2), node_1.worker(3)];
    let pair = hosts.pair.as_ref().expect("network namespaces");
    pair.link_down(1).expect("take node 1's link down");
    let down = Instant::now();
    // Node 1 cannot reach the store: it pauses for the rendezvous timeout, then stops its
    // workers and says why.
    let status = node_1.wait(Duration::from_secs(30));
    let stopped_after = down.elapsed();
    let stderr_1 = node_1.stderr();
    eprintln!("node 1 stopped {stopped_after:?} after its link went down; it said:\n{stderr_1}");
    assert_eq!(status.code(), Some(1), "{stderr_1}");
    let [rank_2, rank_3] = node_1_workers;
    let store = format!("{}:{}", hosts.master_addr, hosts.master_port);
    assert_contains(
        &stderr_1,
        &format!(
            "tandem launch: node 1 is cut off from the job's store (store at {store}: no \
             answer within 2s; the last try: {store}: "
        ),
    );
    let error = stderr_1.lines().last().unwrap_or_default();
    assert!(
        error.starts_with("error: node 1 lost the store (cut off from the store for 3."),
        "node 1 does not say that it lost the store: {error}"
    );
    assert!(
        error.ends_with(&format!(
            ") and killed its workers (rank 2 (pid {rank_2}), rank 3 (pid {rank_3})): with \
             --keep-survivors, node 0 leaves a node that it cannot hear out of the job, and the \
             other nodes go on without it"
        )),
        "{error}"
    );
    assert!(stopped_after < Duration::from_secs(12), "{stopped_after:?}");
    for pid in node_1_workers {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "node 1's worker {pid} outlived its launcher"
        );
    }
    node_0_goes_on_without_node_1(&hosts, &mut node_0, survivors, &expected);
}

#[test]
fn keep_survivors_node_1_ends_at_once_when_node_0_and_its_single_store_are_killed() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = Hosts::new(dir.path(), "g");
    let (mut node_0, mut node_1, _) = start_keeping_survivors(&hosts);
    let node_1_workers = [node_1.worker(2), node_1.worker(3)];
    kill_for_good(&mut node_0);
    let killed = Instant::now();
    // Nothing listens at the store's address any more: node 1 does not pause for it.
    let status = node_1.wait(Duration::from_secs(30));
    let ended_after = killed.elapsed();
    let said = node_1.stderr();
    eprintln!("node 1 ended {ended_after:?} after node 0 was killed; it said:\n{said}");
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(!said.contains("is cut off from the job's store"), "{said}");
    let error = said.lines().last().unwrap_or_default();
    assert!(
        error.starts_with("error: node 1 lost the store ("),
        "{error}"
    );
    let [rank_2, rank_3] = node_1_workers;
    assert!(
        error.ends_with(&format!(
            ") and killed its workers (rank 2 (pid {rank_2}), rank 3 (pid {rank_3})): node 0's \
             store refuses connections: it is gone, and the job's state with it \
             (--store-replicas keeps the store on several nodes)"
        )),
        "{error}"
    );
    assert!(ended_after < Duration::from_secs(15), "{ended_after:?}");
}

#[test]
fn keep_survivors_node_1_cut_off_from_the_store_pauses_and_rejoins_when_its_link_heals() {
    if let Some(reason) = network_namespaces_unavailable("tde") {
        eprintln!(
            "skipped: keep_survivors_node_1_cut_off_from_the_store_pauses_and_rejoins_when_its_\
             link_heals needs root and `ip netns`: {reason}"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Long enough for node 1 to come back before node 0 is done alone.
    let (expected, hosts) = uninterrupted_and_hosts(dir.path(), "p", "3");
    let (mut node_0, mut node_1, [rank_0, rank_1]) = start_keeping_survivors(&hosts);
    let (rank_2, rank_3) = (node_1.worker(2), node_1.worker(3));
    let pair = hosts.pair.as_ref().expect("network namespaces");
    pair.link_down(1).expect("take node 1's link down");
    wait_for_node_1_left_out(&node_0);
    wait_until(
        "node 1's pause",
        || {
            let paused = "tandem launch: node 1 is cut off from the job's store (";
            node_1.stderr().contains(paused)
        },
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    pair.link_up(1).expect("bring node 1's link up");
    wait_for_node_1_let_back_in(&node_0, &node_1);
    let (_, stderr_1) = both_succeed(&mut node_0, &mut node_1);
    assert_contains(
        &stderr_1,
        "tandem launch: node 1 reaches the job's store again after ",
    );
    assert_came_back(&hosts.trace, [rank_0, rank_1], [rank_2, rank_3]);
    assert_same_bits(&expected, &hosts.output_dir, "node 1 cut off, then back");
}

/// Waits for node 0's memberships that let node 1's workers (ranks 2 and 3) back in, one at
/// a time or both at once.
fn wait_for_node_1_let_back_in(node_0: &Launcher, node_1: &Launcher) {
    wait_until(
        "node 1's workers let back in",
        || {
            let said = node_0.stderr();
            said.contains("rank 2 of node 1 rejoins") && said.contains("rank 3 of node 1 rejoins")
        },
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
}

/// Checks that node 0's workers (`stayed`) went on at world size 2 and back at 4, and that
/// node 1's (`back`) trained at 4 and never at 2.
fn assert_came_back(trace: &Path, stayed: [u32; 2], back: [u32; 2]) {
    let sizes = world_sizes_by_pid(trace);
    for pid in stayed {
        let went_on = sizes
            .get(&pid)
            .is_some_and(|sizes| sizes.contains(&2) && sizes.contains(&4));
        assert!(went_on, "survivor {pid}: {sizes:?}");
    }
    for pid in back {
        let joined = sizes
            .get(&pid)
            .is_some_and(|sizes| sizes.contains(&4) && !sizes.contains(&2));
        assert!(joined, "node 1's worker {pid}: {sizes:?}");
    }
}

#[test]
fn keep_survivors_node_1_stopped_past_the_heartbeat_timeout_is_fenced_and_rejoins_when_continued() {
    let dir = tempfile::tempdir().unwrap();
    // Long enough for node 1 to come back before node 0 is done alone.
    let (expected, hosts) = uninterrupted_and_hosts(dir.path(), "s", "3");
    let (mut node_0, mut node_1, [rank_0, rank_1]) = start_keeping_survivors(&hosts);
    let (rank_2, rank_3) = (node_1.worker(2), node_1.worker(3));
    // Node 1's launcher alone stops: its heartbeat with it, its workers run on.
    node_1.signal(libc::SIGSTOP);
    wait_for_node_1_left_out(&node_0);
    node_1.signal(libc::SIGCONT);
    wait_for_node_1_let_back_in(&node_0, &node_1);
    let (status_0, status_1) = (node_0.wait(LIMIT), node_1.wait(LIMIT));
    let (stderr_0, stderr_1) = (node_0.stderr(), node_1.stderr());
    eprintln!("node 0 said:\n{stderr_0}\nnode 1 said:\n{stderr_1}");
    assert!(status_0.success(), "{status_0:?}\n{stderr_0}");
    assert!(status_1.success(), "{status_1:?}\n{stderr_1}");
    let log = std::fs::read_to_string(dir.path().join("logs-node1/logs/rank_2.log")).unwrap();
    assert_contains(
        &log,
        "rank 2 (at the round's start) was left out of the job at membership 1 (node 1 lost",
    );
    assert_contains(
        &log,
        "it takes no part in any step of it, and asks to rejoin",
    );
    assert_came_back(&hosts.trace, [rank_0, rank_1], [rank_2, rank_3]);
    assert_same_bits(&expected, &hosts.output_dir, "node 1 stopped, then back");
}

#[test]
fn keep_survivors_node_1_started_again_rejoins_the_running_round_in_process_with_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    // Long enough for node 1 to come back before node 0 is done alone.
    let (expected, hosts) = uninterrupted_and_hosts(dir.path(), "r", "4");
    let (mut node_0, mut node_1, [rank_0, rank_1]) = start_keeping_survivors(&hosts);
    kill_for_good(&mut node_1);
    wait_for_node_1_left_out(&node_0);
    let mut node_1 = hosts.start_with(1, "node1-again", &KEEP_SURVIVORS, true);
    wait_for_node_1_let_back_in(&node_0, &node_1);
    let joiners = [node_1.worker(2), node_1.worker(3)];
    let (stderr_0, stderr_1) = both_succeed(&mut node_0, &mut node_1);
    assert_contains(
        &stderr_1,
        "tandem launch: round 0 runs without this node, which it lost: this node's workers \
         rejoin it at a step boundary, and nobody restarts\n",
    );
    assert!(
        !stderr_0.contains("round 1"),
        "a new round began:\n{stderr_0}"
    );
    let log = std::fs::read_to_string(dir.path().join("logs-node1/logs/rank_2.log")).unwrap();
    assert_contains(&log, "rank 2 joins the running job: waiting to be let in");
    assert!(
        !log.contains("resum"),
        "node 1's worker read a snapshot:\n{log}"
    );
    assert_came_back(&hosts.trace, [rank_0, rank_1], joiners);
    assert_same_bits(
        &expected,
        &hosts.output_dir,
        "node 1 lost, then back in-process",
    );
}

#[test]
fn replace_lost_on_node_1_starts_its_lost_worker_again_and_node_0_lets_it_in_with_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (expected, hosts) = uninterrupted_and_hosts(dir.path(), "x", "3");
    let flags = [
        "--nnodes",
        "2",
        "--keep-survivors",
        "--replace-lost",
        "--max-restarts",
        "1",
    ];
    let mut node_0 = hosts.start_with(0, "node0", &flags, true);
    let mut node_1 = hosts.start_with(1, "node1", &flags, true);
    wait_for_step(&hosts, 3, &node_0);
    let stayed = [node_0.worker(0), node_0.worker(1), node_1.worker(2)];
    let lost = node_1.worker(3);
    send_signal(lost, libc::SIGKILL);
    wait_until(
        "node 0's membership with rank 3's replacement",
        || node_0.stderr().contains("rank 3 of node 1 rejoins"),
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    let (stderr_0, stderr_1) = both_succeed(&mut node_0, &mut node_1);
    assert_contains(
        &stderr_0,
        &format!(
            "tandem launch: membership 1: rank 3 (pid {lost}) on node 1 killed by SIGKILL; ranks \
             [0, 1, 2] go on in-process (world size 4 -> 3), nobody restarts\n"
        ),
    );
    assert_contains(
        &stderr_1,
        " started in place of the lost one: it joins at a step boundary\n",
    );
    assert!(
        !stderr_0.contains("round 1"),
        "a new round began:\n{stderr_0}"
    );
    // The survivors trained to the end in their first processes, the replacement beside them
    // (steps at 3 workers are few, or none when it was let in at once).
    let sizes = world_sizes_by_pid(&hosts.trace);
    let replacements: Vec<u32> = sizes
        .keys()
        .copied()
        .filter(|pid| !stayed.contains(pid) && *pid != lost)
        .collect();
    assert_eq!(replacements.len(), 1, "{sizes:?}");
    assert!(!sizes[&replacements[0]].contains(&3), "{sizes:?}");
    let last = last_step_of(&hosts.trace, replacements[0]);
    for pid in stayed {
        assert_eq!(last_step_of(&hosts.trace, pid), last, "survivor {pid}");
    }
    assert_same_bits(
        &expected,
        &hosts.output_dir,
        "rank 3 lost on node 1, then replaced",
    );
}

#[test]
fn keep_survivors_workers_lost_on_either_node_leave_the_others_running_with_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (expected, hosts) = uninterrupted_and_hosts(dir.path(), "w", "3");
    let (mut node_0, mut node_1, [rank_0, rank_1]) = start_keeping_survivors(&hosts);
    let (rank_2, rank_3) = (node_1.worker(2), node_1.worker(3));
    send_signal(rank_3, libc::SIGKILL);
    let first = format!(
        "tandem launch: membership 1: rank 3 (pid {rank_3}) on node 1 killed by SIGKILL; ranks \
         [0, 1, 2] go on in-process (world size 4 -> 3), nobody restarts\n"
    );
    wait_until(
        "node 0's membership without rank 3",
        || node_0.stderr().contains(&first),
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    let step = snapshot_step(&hosts.output_dir).unwrap_or(0);
    wait_for_step(&hosts, step + 3, &node_0);
    send_signal(rank_1, libc::SIGKILL);
    let second = format!(
        "tandem launch: membership 2: rank 1 (pid {rank_1}) killed by SIGKILL; ranks [0, 2] go \
         on in-process (world size 3 -> 2), nobody restarts\n"
    );
    wait_until(
        "node 0's membership without rank 1",
        || node_0.stderr().contains(&second),
        || format!("node 0:\n{}\nnode 1:\n{}", node_0.stderr(), node_1.stderr()),
    );
    let (_, stderr_1) = both_succeed(&mut node_0, &mut node_1);
    assert_contains(
        &stderr_1,
        &format!(
            "tandem launch: rank 3 (pid {rank_3}) on node 1 killed by SIGKILL; node 0 leaves it \
             out of the job, the others go on (--keep-survivors)\n"
        ),
    );
    assert_contains(
        &stderr_1,
        "tandem launch: every worker finished successfully\n",
    );
    let stdout_0 = node_0.stdout();
    assert_contains(&stdout_0, "; world size 4 -> 3 at epoch ");
    assert_contains(&stdout_0, "; world size 3 -> 2 at epoch ");
    assert!(
        !stdout_0.contains("resum"),
        "nothing was read from disk:\n{stdout_0}"
    );
    let kept: [(u32, &[u64]); 4] = [
        (rank_0, &[4, 3, 2]),
        (rank_1, &[4, 3]),
        (rank_2, &[4, 3, 2]),
        (rank_3, &[4]),
    ];
    assert_went_on_in_process(&hosts.trace, &kept, 2);
    assert_same_bits(
        &expected,
        &hosts.output_dir,
        "ranks 3 and 1 lost, the others kept on",
    );
}
