//! `tandem launch --store-replicas`: three agents on loopback keep the job's store replicated
//! among them. Node 0 (the host of the first replica, the node that decides the membership,
//! and the home of rank 0) is killed with SIGKILL mid-run: the store goes on under a new
//! leader, node 1 takes the decisions over, and the workers of nodes 1 and 2 go on
//! in-process, without a restart, to the uninterrupted run's bits. Every wait is bounded, and
//! every agent's process group is killed when the test ends.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::elastic::{elastic_train_args, snapshot_step, wait_until};
use common::netns::{network_namespaces_unavailable, NetworkStar};
use common::*;

/// Bound on each launcher and on each training run.
const LIMIT: Duration = Duration::from_secs(180);
/// Three agents of one job, each in a process group of its own with its workers, on
/// loopback or as three hosts on one switch; dropping them kills every group.
struct Nodes {
    dir: PathBuf,
    replicas: String,
    launchers: Vec<Launcher>,
    star: Option<NetworkStar>,
}

/// The port of each replica when every node is a host of its own.
const STAR_PORT: u16 = 29571;

impl Nodes {
    fn new(dir: &Path) -> Nodes {
        let replicas: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        Nodes {
            dir: dir.to_path_buf(),
            replicas: replicas.join(","),
            launchers: Vec::new(),
            star: None,
        }
    }

    /// Three hosts of their own in network namespaces, tagged `tag`.
    fn on_a_switch(dir: &Path, tag: &str) -> Nodes {
        let star = NetworkStar::create(
            "trs",
            "tr",
            "10.203.0",
            &format!("{}{tag}", std::process::id() % 100_000),
            3,
        )
        .expect("create the network namespaces");
        let replicas: Vec<String> = (0..3)
            .map(|node| format!("{}:{STAR_PORT}", star.address(node)))
            .collect();
        Nodes {
            dir: dir.to_path_buf(),
            replicas: replicas.join(","),
            launchers: Vec::new(),
            star: Some(star),
        }
    }

    /// The command that runs `tandem` on node `node`'s host.
    fn tandem_on(&self, node: usize) -> Command {
        let tandem = env!("CARGO_BIN_EXE_tandem");
        match &self.star {
            Some(star) => {
                let boot_id = self.dir.join(format!("boot_id_of_node_{node}"));
                std::fs::write(
                    &boot_id,
                    format!("tandem-test-node-{node}-{}\n", std::process::id()),
                )
                .unwrap();
                star.exec_as_own_host(node, &boot_id, tandem)
            }
            None => Command::new(tandem),
        }
    }

    fn output_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    fn trace(&self) -> PathBuf {
        self.dir.join("trace")
    }

    /// Starts node `node`'s agent with 2 workers.
    fn start(&mut self, node: usize) {
        std::fs::create_dir_all(self.trace()).unwrap();
        let mut command = self.tandem_on(node);
        command
            .args(["launch", "--nnodes", "3", "--node-rank", &node.to_string()])
            .args(["--keep-survivors", "--max-restarts", "0"])
            .args(["--store-replicas", &self.replicas])
            .args(["--nproc-per-node", "2"])
            .args(["--stop-grace-seconds", "20", "--join-timeout-seconds", "60"])
            .arg("--log-dir")
            .arg(self.dir.join(format!("logs-node{node}")))
            .arg("--")
            .args(elastic_train_args(&self.output_dir()))
            .current_dir(&self.dir)
            .env("TANDEM_SAMPLE_TRACE", self.trace())
            .env("TANDEM_JOB_TOKEN", "replicated-test-secret")
            .process_group(0);
        let name = format!("node{node}");
        self.launchers
            .push(Launcher::spawn(command, &self.dir, &name));
    }

    /// Starts the three nodes and waits until the job is past step 3.
    fn start_all_and_train(&mut self) {
        for node in 0..3 {
            self.start(node);
        }
        wait_until(
            "a snapshot past step 3",
            || snapshot_step(&self.output_dir()).is_some_and(|step| step > 3),
            || self.said(),
        );
    }

    /// Every agent's output so far.
    fn said(&self) -> String {
        self.launchers
            .iter()
            .enumerate()
            .map(|(node, launcher)| format!("node {node}:\n{}\n", launcher.stderr()))
            .collect()
    }

    /// Kills node `node`'s agent and workers with SIGKILL.
    fn kill(&mut self, node: usize) {
        kill_group(self.launchers[node].pid());
        let status = self.launchers[node].wait(Duration::from_secs(10));
        assert_eq!(status.code(), None, "node {node}'s agent was killed");
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for launcher in &self.launchers {
            kill_group(launcher.pid());
        }
    }
}

/// The uninterrupted run, in one process, in `dir/uninterrupted`.
fn uninterrupted_run(dir: &Path) -> PathBuf {
    let output_dir = dir.join("uninterrupted");
    expect_success(&run_bounded(
        tandem().args(elastic_train_args(&output_dir)),
        LIMIT,
    ));
    output_dir
}

fn kill_group(leader: u32) {
    // SAFETY: `kill` has no memory-safety preconditions; the group is the agent's own.
    unsafe {
        libc::kill(-(leader as libc::pid_t), libc::SIGKILL);
    }
}

/// The world sizes at which each worker process (by pid) committed steps, from the sample
/// trace (`samples-<pid>.jsonl`; a record torn by SIGKILL is skipped).
fn world_sizes_of(trace: &Path, pid: u32) -> Vec<u64> {
    let text =
        std::fs::read_to_string(trace.join(format!("samples-{pid}.jsonl"))).unwrap_or_default();
    let mut sizes: Vec<u64> = text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|record| record["world_size"].as_u64())
        .collect();
    sizes.dedup();
    sizes
}

#[test]
fn the_job_outlives_node_0_which_hosts_the_store_and_decides_and_keeps_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let mut nodes = Nodes::new(dir.path());
    nodes.start_all_and_train();
    let survivors: Vec<u32> = [(1, 2), (1, 3), (2, 4), (2, 5)]
        .iter()
        .map(|&(node, rank)| nodes.launchers[node].worker(rank))
        .collect();
    nodes.kill(0);
    let killed = Instant::now();
    let took_over = "tandem launch: node 1 decides the membership now: the agents of every \
                     lower node are silent (node 0 (";
    let membership = "tandem launch: membership 1: node 0 lost (its launcher sent no heartbeat";
    wait_until(
        "node 1's membership without node 0",
        || {
            let said = nodes.launchers[1].stderr();
            said.contains(took_over) && said.contains(membership)
        },
        || nodes.said(),
    );
    eprintln!(
        "node 1 published the membership without node 0 {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
    for node in [1, 2] {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
        assert_contains(
            &nodes.launchers[node].stderr(),
            "every worker finished successfully",
        );
    }
    eprintln!("{}", nodes.said());
    assert_contains(
        &nodes.launchers[1].stderr(),
        "ranks [2, 3, 4, 5] go on in-process (world size 6 -> 4), nobody restarts",
    );
    for pid in survivors {
        assert_eq!(world_sizes_of(&nodes.trace(), pid), vec![6, 4], "{pid}");
    }
    assert_same_bits(
        &expected,
        &nodes.output_dir(),
        "node 0 lost, nodes 1 and 2 went on",
    );
}

#[test]
fn node_0_stopped_past_the_heartbeat_timeout_is_left_out_by_node_1_and_says_so_when_continued() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let mut nodes = Nodes::new(dir.path());
    nodes.start_all_and_train();
    // Only node 0's agent stops (with its replica of the store); its workers run on.
    nodes.launchers[0].signal(libc::SIGSTOP);
    wait_until(
        "node 1's membership without node 0",
        || {
            nodes.launchers[1].stderr().contains(
                "tandem launch: membership 1: node 0 lost (its launcher sent no heartbeat",
            )
        },
        || nodes.said(),
    );
    nodes.launchers[0].signal(libc::SIGCONT);
    let status = nodes.launchers[0].wait(LIMIT);
    eprintln!("{}", nodes.said());
    assert_eq!(status.code(), Some(1), "{}", nodes.said());
    assert_contains(
        &nodes.launchers[0].stderr(),
        "error: node 0 was left out of the job by node 1 (node 0 lost (its launcher sent no \
         heartbeat for ",
    );
    for node in [1, 2] {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
    }
    assert_same_bits(
        &expected,
        &nodes.output_dir(),
        "node 0 stopped, nodes 1 and 2 went on",
    );
}

#[test]
fn node_0_cut_off_by_its_link_ends_and_nodes_1_and_2_go_on_with_the_same_bits() {
    if let Some(reason) = network_namespaces_unavailable("trs") {
        eprintln!(
            "skipped: node_0_cut_off_by_its_link_ends_and_nodes_1_and_2_go_on_with_the_same_bits \
             needs root and `ip netns`: {reason}"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path());
    let mut nodes = Nodes::on_a_switch(dir.path(), "c");
    nodes.start_all_and_train();
    let node_0_workers = [nodes.launchers[0].worker(0), nodes.launchers[0].worker(1)];
    let star = nodes.star.as_ref().expect("network namespaces");
    star.link_down(0).expect("take node 0's link down");
    let down = Instant::now();
    // The minority: node 0 gets no answer from the store, kills its workers and ends.
    let status = nodes.launchers[0].wait(Duration::from_secs(30));
    let stopped_after = down.elapsed();
    assert_eq!(status.code(), Some(1), "{}", nodes.said());
    assert_contains(
        &nodes.launchers[0].stderr(),
        "error: node 0 lost the store (",
    );
    for pid in node_0_workers {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "node 0's worker {pid} outlived its launcher"
        );
    }
    // The majority: node 1 decides, and the others go on to the uninterrupted run's bits.
    for node in [1, 2] {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
    }
    eprintln!(
        "node 0 ended {stopped_after:?} after its link went down\n{}",
        nodes.said()
    );
    assert_contains(
        &nodes.launchers[1].stderr(),
        "ranks [2, 3, 4, 5] go on in-process (world size 6 -> 4), nobody restarts",
    );
    assert_same_bits(
        &expected,
        &nodes.output_dir(),
        "node 0 cut off, nodes 1 and 2 went on",
    );
}
