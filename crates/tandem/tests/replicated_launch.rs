//! `tandem launch --store-replicas`: three agents on loopback keep the job's store replicated
//! among them. Node 0 (the host of the first replica, the node that decides the membership,
//! and the home of rank 0) is killed with SIGKILL mid-run: the store goes on under a new
//! leader, node 1 takes the decisions over, and the workers of nodes 1 and 2 go on
//! in-process, without a restart; node 0 started again rejoins in-process, and the run ends
//! with the uninterrupted run's bits. Without `--keep-survivors`, node 1 opens the round
//! after node 0's loss and node 0, started again, joins the next one. Partitions and
//! stopped agents are in namespaces. Every wait is bounded, and every agent's process group
//! is killed when the test ends.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::elastic::{elastic_train_args_of, snapshot_step, wait_until};
use common::netns::{network_namespaces_unavailable, NetworkStar};
use common::*;

/// Bound on each launcher and on each training run.
const LIMIT: Duration = Duration::from_secs(180);
/// The agents of one job (three of two workers each, unless a test says otherwise), each in
/// a process group of its own with its workers, on loopback or as hosts on switches;
/// dropping them kills every group. The first three nodes host the store's replicas.
struct Nodes {
    dir: PathBuf,
    replicas: String,
    launchers: Vec<Launcher>,
    star: Option<NetworkStar>,
    /// The steps the job trains.
    steps: usize,
    /// The nodes, and the workers of each.
    count: usize,
    nproc: usize,
    /// How the job meets a loss: the launchers' arguments for it.
    on_loss: &'static [&'static str],
    /// `--nnodes`: the nodes, unless a test says otherwise.
    nnodes: String,
}

/// Survivors go on in-process; no round is started again.
const KEEP_SURVIVORS: &[&str] = &["--keep-survivors", "--max-restarts", "0"];
/// Every loss ends the round; the next one starts with the nodes that come (with `--nnodes
/// 2:3`, 2 of 3 at least), every worker resuming from the snapshot.
const RESTART_ROUNDS: &[&str] = &["--last-call", "0.5", "--max-restarts", "3"];

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
            steps: STEPS,
            count: 3,
            nproc: 2,
            on_loss: KEEP_SURVIVORS,
            nnodes: 3.to_string(),
        }
    }

    /// Three hosts of their own in network namespaces, tagged `tag`.
    fn on_a_switch(dir: &Path, tag: &str) -> Nodes {
        Nodes::on_switches(dir, tag, (3, 2), 3)
    }

    /// `count` hosts of their own with `nproc` workers each, `(count, nproc)`, in network
    /// namespaces tagged `tag`: hosts `0..first_switch` on one switch, the others on a
    /// second one joined to it by a trunk.
    fn on_switches(dir: &Path, tag: &str, (count, nproc): (usize, usize), first: usize) -> Nodes {
        let star = NetworkStar::create_split(
            "trs",
            "tr",
            "10.203.0",
            &format!("{}{tag}", std::process::id() % 100_000),
            count,
            first,
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
            steps: STEPS,
            count,
            nproc,
            on_loss: KEEP_SURVIVORS,
            nnodes: count.to_string(),
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

    /// Starts node `node`'s agent and its workers, with the launcher's `extra` arguments.
    fn start_with(&mut self, node: usize, extra: &[&str]) {
        let launcher = self.launch(node, extra, &format!("node{node}"));
        self.launchers.push(launcher);
    }

    /// Starts node `node`'s agent again in place of the one that was killed; the old one's
    /// logs move to `logs-node<node>-before`.
    fn start_again(&mut self, node: usize) {
        let logs = self.dir.join(format!("logs-node{node}"));
        std::fs::rename(&logs, self.dir.join(format!("logs-node{node}-before"))).unwrap();
        self.launchers[node] = self.launch(node, &[], &format!("node{node}-again"));
    }

    /// Spawns node `node`'s agent, its output in `dir/<name>.stderr`.
    fn launch(&self, node: usize, extra: &[&str], name: &str) -> Launcher {
        std::fs::create_dir_all(self.trace()).unwrap();
        let mut command = self.tandem_on(node);
        command
            .args(["launch", "--nnodes", &self.nnodes])
            .args(["--node-rank", &node.to_string()])
            .args(self.on_loss)
            .args(["--store-replicas", &self.replicas])
            .args(["--nproc-per-node", &self.nproc.to_string()])
            .args(["--stop-grace-seconds", "20", "--join-timeout-seconds", "60"])
            .args(extra)
            .arg("--log-dir")
            .arg(self.dir.join(format!("logs-node{node}")))
            .arg("--")
            .args(elastic_train_args_of(&self.output_dir(), self.steps))
            .current_dir(&self.dir)
            .env("TANDEM_SAMPLE_TRACE", self.trace())
            .env("TANDEM_JOB_TOKEN", "replicated-test-secret")
            .process_group(0);
        Launcher::spawn(command, &self.dir, name)
    }

    /// Starts the nodes and waits until the job is past step 3.
    fn start_all_and_train(&mut self) {
        self.start_all_with_and_train(&[]);
    }

    /// [`start_all_and_train`](Self::start_all_and_train) with the launchers' `extra`
    /// arguments.
    fn start_all_with_and_train(&mut self, extra: &[&str]) {
        for node in 0..self.count {
            self.start_with(node, extra);
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

    /// Waits for every node's agent to end, and checks that each says every worker
    /// succeeded; returns (and prints) what they all said.
    fn every_node_succeeds(&mut self) -> String {
        for node in 0..self.launchers.len() {
            let status = self.launchers[node].wait(LIMIT);
            assert!(status.success(), "node {node}: {status:?}\n{}", self.said());
            let said = self.launchers[node].stderr();
            assert_contains(&said, "every worker finished successfully");
        }
        let said = self.said();
        eprintln!("{said}");
        said
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

/// The steps of the jobs of these tests, unless a test says otherwise.
const STEPS: usize = 80;

/// The uninterrupted run of `steps` steps, in one process, in `dir/uninterrupted`.
fn uninterrupted_run(dir: &Path, steps: usize) -> PathBuf {
    let output_dir = dir.join("uninterrupted");
    expect_success(&run_bounded(
        tandem().args(elastic_train_args_of(&output_dir, steps)),
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
fn the_job_outlives_node_0_which_hosts_the_store_and_node_0_started_again_rejoins_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path(), STEPS * 2);
    let mut nodes = Nodes::new(dir.path());
    nodes.steps = STEPS * 2;
    nodes.start_all_and_train();
    let survivors: Vec<u32> = [(1, 2), (1, 3), (2, 4), (2, 5)]
        .iter()
        .map(|&(node, rank)| nodes.launchers[node].worker(rank))
        .collect();
    nodes.kill(0);
    let killed = Instant::now();
    let took_over = "tandem launch: node 1 decides the membership now: the agents of the \
                     deciding node and of every lower node are silent (node 0 (";
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
    // Node 0 comes back once the others went on: a join read before their first step at 4
    // would have them redo that step at 6.
    wait_until(
        "a step committed at world size 4",
        || world_sizes_of(&nodes.trace(), survivors[0]).contains(&4),
        || nodes.said(),
    );
    // Its host started again: a new replica of the store, a new agent, new workers.
    nodes.start_again(0);
    wait_for_node_0_let_back_in(&nodes);
    let joiners = [nodes.launchers[0].worker(0), nodes.launchers[0].worker(1)];
    let said = nodes.every_node_succeeds();
    assert_contains(
        &nodes.launchers[1].stderr(),
        "ranks [2, 3, 4, 5] go on in-process (world size 6 -> 4), nobody restarts",
    );
    let again = nodes.launchers[0].stderr();
    assert_contains(
        &again,
        "tandem launch: round 0 runs without this node, which it lost: this node's workers \
         rejoin it at a step boundary, and nobody restarts\n",
    );
    assert_contains(
        &again,
        "tandem launch: node 0's replica of the store starts behind a job under way: it votes \
         once it has caught up with the leader\n",
    );
    let first = nodes.launchers[1].stderr();
    assert!(!first.contains("starts behind"), "{first}");
    assert!(!said.contains("round 1"), "a new round began:\n{said}");
    // Node 1 goes on deciding.
    assert!(!again.contains("decides the membership"), "{again}");
    let log = std::fs::read_to_string(dir.path().join("logs-node0/logs/rank_0.log")).unwrap();
    assert_contains(&log, "rank 0 joins the running job: waiting to be let in");
    assert!(
        !log.contains("resum"),
        "node 0's worker read a snapshot:\n{log}"
    );
    // The survivors went on at 4, and the joiners came back (one at a time, or both at once).
    for pid in survivors {
        let sizes = world_sizes_of(&nodes.trace(), pid);
        let ends = (sizes.first(), sizes.last());
        assert_eq!(ends, (Some(&6), Some(&6)), "{pid}: {sizes:?}\n{said}");
        assert!(sizes.contains(&4), "{pid}: {sizes:?}\n{said}");
    }
    for pid in joiners {
        let sizes = world_sizes_of(&nodes.trace(), pid);
        assert_eq!(sizes.last(), Some(&6), "{pid}: {sizes:?}\n{said}");
        assert!(!sizes.contains(&4), "{pid}: {sizes:?}\n{said}");
    }
    assert!(!said.contains("panicked"), "{said}");
    assert_same_bits(
        &expected,
        &nodes.output_dir(),
        "node 0 lost, nodes 1 and 2 went on, node 0 back in-process",
    );
}

#[test]
fn without_node_0_node_1_opens_the_next_round_and_node_0_started_again_joins_a_later_one() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path(), STEPS * 2);
    let mut nodes = Nodes::new(dir.path());
    nodes.steps = STEPS * 2;
    nodes.on_loss = RESTART_ROUNDS;
    nodes.nnodes = "2:3".into();
    nodes.start_all_and_train();
    nodes.kill(0);
    let without_node_0 = "tandem launch: round 1: nodes 1 (2 workers), 2 (2 workers); node 0 \
                          lost (no heartbeat for ";
    wait_until(
        "round 1 without node 0",
        || nodes.launchers[1].stderr().contains(without_node_0),
        || nodes.said(),
    );
    // Its host started again: it finds round 1 under way and asks to join the next one.
    nodes.start_again(0);
    let said = nodes.every_node_succeeds();
    assert_contains(
        &nodes.launchers[0].stderr(),
        "tandem launch: round 1 started without this node; it joins the next one\n",
    );
    let with_node_0 = "tandem launch: round 2: nodes 0 (2 workers), 1 (2 workers), 2 (2 \
                       workers); node 0 joined; world size 4 -> 6\n";
    for node in 0..3 {
        assert_contains(&nodes.launchers[node].stderr(), with_node_0);
    }
    assert!(!said.contains("round 3"), "{said}");
    assert!(!said.contains("panicked"), "{said}");
    assert_same_bits(
        &expected,
        &nodes.output_dir(),
        "node 0 lost, round 1 opened by node 1, node 0 back in round 2",
    );
}

#[test]
fn node_0_stopped_past_the_heartbeat_timeout_is_fenced_by_node_1_and_rejoins_when_continued() {
    let dir = tempfile::tempdir().unwrap();
    let expected = uninterrupted_run(dir.path(), STEPS * 2);
    let mut nodes = Nodes::new(dir.path());
    nodes.steps = STEPS * 2;
    nodes.start_all_and_train();
    let node_0_workers = [nodes.launchers[0].worker(0), nodes.launchers[0].worker(1)];
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
    wait_for_node_0_let_back_in(&nodes);
    for node in 0..3 {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
    }
    eprintln!("{}", nodes.said());
    assert_left_and_came_back(&nodes.trace(), &node_0_workers, &[]);
    assert_same_bits(&expected, &nodes.output_dir(), "node 0 stopped, then back");
}

/// Waits for node 1's memberships that let node 0's workers back in (one at a time, or both
/// at once).
fn wait_for_node_0_let_back_in(nodes: &Nodes) {
    wait_until(
        "node 0's workers let back in",
        || {
            let said = nodes.launchers[1].stderr();
            said.contains("rank 0 of node 0 rejoins") && said.contains("rank 1 of node 0 rejoins")
        },
        || nodes.said(),
    );
}

/// Checks the world sizes each worker committed steps at: those of `away` left the job and
/// came back (never at 4), those of `stayed` went on at 4 in between; all began and ended
/// at 6.
fn assert_left_and_came_back(trace: &Path, away: &[u32], stayed: &[u32]) {
    for (pid, went_on) in away
        .iter()
        .map(|pid| (pid, false))
        .chain(stayed.iter().map(|pid| (pid, true)))
    {
        let sizes = world_sizes_of(trace, *pid);
        let ends = (sizes.first(), sizes.last());
        assert_eq!(ends, (Some(&6), Some(&6)), "{pid}: {sizes:?}");
        assert_eq!(sizes.contains(&4), went_on, "{pid}: {sizes:?}");
    }
}

/// Whether `test` must be skipped, for want of root and `ip netns`; says so.
fn namespaces_missing_for(test: &str) -> bool {
    let missing = network_namespaces_unavailable("trs");
    if let Some(reason) = &missing {
        eprintln!("skipped: {test} needs root and `ip netns`: {reason}");
    }
    missing.is_some()
}

/// Node 0's link goes down while a job of `steps` steps trains on three hosts; returns the
/// nodes, the uninterrupted run's output folder, node 0's workers' process ids and when the
/// link went down. `extra` are the launchers' extra arguments.
fn node_0_cut_off(
    dir: &Path,
    tag: &str,
    extra: &[&str],
    steps: usize,
) -> (Nodes, PathBuf, [u32; 2], Instant) {
    let expected = uninterrupted_run(dir, steps);
    let mut nodes = Nodes::on_a_switch(dir, tag);
    nodes.steps = steps;
    nodes.start_all_with_and_train(extra);
    let node_0_workers = [nodes.launchers[0].worker(0), nodes.launchers[0].worker(1)];
    let star = nodes.star.as_ref().expect("network namespaces");
    star.link_down(0).expect("take node 0's link down");
    (nodes, expected, node_0_workers, Instant::now())
}

/// Waits for nodes 1 and 2 to end successfully, and checks that they left node 0 out and
/// that the run has the uninterrupted run's bits.
fn nodes_1_and_2_go_on(nodes: &mut Nodes, expected: &Path, what: &str) {
    for node in [1, 2] {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
    }
    assert_contains(
        &nodes.launchers[1].stderr(),
        "ranks [2, 3, 4, 5] go on in-process (world size 6 -> 4), nobody restarts",
    );
    assert_same_bits(expected, &nodes.output_dir(), what);
}

#[test]
fn node_0_cut_off_by_its_link_pauses_and_rejoins_when_the_link_heals_with_the_same_bits() {
    if namespaces_missing_for(
        "node_0_cut_off_by_its_link_pauses_and_rejoins_when_the_link_heals_with_the_same_bits",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut nodes, expected, node_0_workers, down) = node_0_cut_off(dir.path(), "h", &[], 600);
    let survivors: Vec<u32> = [(1, 2), (1, 3), (2, 4), (2, 5)]
        .iter()
        .map(|&(node, rank)| nodes.launchers[node].worker(rank))
        .collect();
    // The majority goes on; the minority pauses, its workers alive and fenced.
    let membership = "tandem launch: membership 1: node 0 lost (its launcher sent no heartbeat";
    wait_until(
        "node 1's membership without node 0",
        || nodes.launchers[1].stderr().contains(membership),
        || nodes.said(),
    );
    let at_the_loss = snapshot_step(&nodes.output_dir()).unwrap_or(0);
    wait_until(
        "node 0's pause, and steps of the majority",
        || {
            let paused = "tandem launch: node 0 is cut off from the job's store (";
            nodes.launchers[0].stderr().contains(paused)
                && snapshot_step(&nodes.output_dir()).is_some_and(|step| step > at_the_loss + 3)
        },
        || nodes.said(),
    );
    let paused_after = down.elapsed();
    nodes
        .star
        .as_ref()
        .expect("network namespaces")
        .link_up(0)
        .expect("bring node 0's link up");
    let healed = Instant::now();
    wait_for_node_0_let_back_in(&nodes);
    eprintln!(
        "node 0 paused {paused_after:?} after its link went down; its workers were let back \
         in {:?} after the link came up",
        healed.elapsed()
    );
    let status = nodes.launchers[0].wait(LIMIT);
    eprintln!("{}", nodes.said());
    assert!(status.success(), "node 0: {status:?}\n{}", nodes.said());
    assert_contains(
        &nodes.launchers[0].stderr(),
        "tandem launch: node 0 reaches the job's store again after ",
    );
    assert_left_and_came_back(&nodes.trace(), &node_0_workers, &survivors);
    nodes_1_and_2_go_on(&mut nodes, &expected, "node 0 cut off, then back");
}

#[test]
fn node_0_cut_off_past_the_rendezvous_timeout_ends_and_nodes_1_and_2_go_on_with_the_same_bits() {
    if namespaces_missing_for("node_0_cut_off_past_the_rendezvous_timeout_ends_and_nodes_1_and_2_go_on_with_the_same_bits") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let extra = ["--rendezvous-timeout", "3"];
    let (mut nodes, expected, node_0_workers, down) =
        node_0_cut_off(dir.path(), "c", &extra, STEPS);
    // The minority: node 0 waits 3 s for the store, then kills its workers and ends.
    let status = nodes.launchers[0].wait(Duration::from_secs(30));
    let stopped_after = down.elapsed();
    assert_eq!(status.code(), Some(1), "{}", nodes.said());
    let said = nodes.launchers[0].stderr();
    assert_contains(
        &said,
        "error: node 0 lost the store (cut off from the store for ",
    );
    for pid in node_0_workers {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "node 0's worker {pid} outlived its launcher"
        );
    }
    eprintln!("node 0 ended {stopped_after:?} after its link went down");
    nodes_1_and_2_go_on(
        &mut nodes,
        &expected,
        "node 0 cut off, nodes 1 and 2 went on",
    );
    eprintln!("{}", nodes.said());
}

#[test]
fn a_2_2_partition_commits_each_step_once_and_the_side_without_the_store_pauses_then_rejoins() {
    if namespaces_missing_for(
        "a_2_2_partition_commits_each_step_once_and_the_side_without_the_store_pauses_then_rejoins",
    ) {
        return;
    }
    // Nodes 0 and 1 on one switch (two replicas: they go on), 2 and 3 on the other.
    partition_heals_with_one_state_per_step("p", 2, "a 2|2 partition, then healed");
}

#[test]
fn a_1_3_partition_commits_each_step_once_and_the_lone_node_pauses_then_rejoins() {
    if namespaces_missing_for(
        "a_1_3_partition_commits_each_step_once_and_the_lone_node_pauses_then_rejoins",
    ) {
        return;
    }
    // Node 0 alone (the first replica, the deciding node); nodes 1, 2 and 3 go on.
    partition_heals_with_one_state_per_step("q", 1, "a 1|3 partition, then healed");
}

/// Four hosts of one worker, hosts `0..first_switch` on one switch and the others on a second,
/// replicas on hosts 0, 1 and 2. The trunk between the switches goes down: the side with two
/// replicas goes on, the other pauses; the trunk comes back, and its workers rejoin. Every step
/// was committed with one batch, and the run has the uninterrupted run's bits.
fn partition_heals_with_one_state_per_step(tag: &str, first_switch: usize, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let steps = 600;
    let expected = uninterrupted_run(dir.path(), steps);
    let mut nodes = Nodes::on_switches(dir.path(), tag, (4, 1), first_switch);
    nodes.steps = steps;
    nodes.start_all_and_train();
    let workers: Vec<u32> = (0..4)
        .map(|node| nodes.launchers[node].worker(node))
        .collect();
    let (first, second): (Vec<usize>, Vec<usize>) = (0..4).partition(|&node| node < first_switch);
    let (majority, minority) = match first.len() >= 2 {
        true => (first, second),
        false => (second, first),
    };
    let decider = majority[0];
    let star = nodes.star.as_ref().expect("network namespaces");
    star.set_trunk(false).expect("cut the trunk");
    let go_on = format!("ranks {majority:?} go on in-process (world size ");
    wait_until(
        "the majority's membership without the minority",
        || nodes.launchers[decider].stderr().contains(&go_on),
        || nodes.said(),
    );
    let at_the_cut = snapshot_step(&nodes.output_dir()).unwrap_or(0);
    wait_until(
        "the minority's pause, and steps of the majority",
        || {
            let paused = |node: &usize| {
                nodes.launchers[*node].stderr().contains(&format!(
                    "tandem launch: node {node} is cut off from the job's store ("
                ))
            };
            minority.iter().all(paused)
                && snapshot_step(&nodes.output_dir()).is_some_and(|step| step > at_the_cut + 3)
        },
        || nodes.said(),
    );
    star.set_trunk(true).expect("heal the trunk");
    wait_until(
        "the minority's workers let back in",
        || {
            let said = nodes.launchers[decider].stderr();
            minority
                .iter()
                .all(|node| said.contains(&format!("rank {node} of node {node} rejoins")))
        },
        || nodes.said(),
    );
    for node in 0..4 {
        let status = nodes.launchers[node].wait(LIMIT);
        assert!(
            status.success(),
            "node {node}: {status:?}\n{}",
            nodes.said()
        );
    }
    eprintln!("{}", nodes.said());
    for (node, pid) in workers.into_iter().enumerate() {
        let sizes = world_sizes_of(&nodes.trace(), pid);
        // The minority's nodes may be let back in one at a time.
        let ends = (sizes.first(), sizes.last());
        assert_eq!(ends, (Some(&4), Some(&4)), "node {node}: {sizes:?}");
        let went_on = majority.contains(&node);
        assert_eq!(
            sizes.contains(&(majority.len() as u64)),
            went_on,
            "node {node}: {sizes:?}"
        );
    }
    assert_one_state_per_step(&nodes.trace(), steps);
    assert_same_bits(&expected, &nodes.output_dir(), what);
}

/// Every step of the run was committed with one batch, whoever committed it, and every
/// sample of the epoch was trained once (`steps` steps of one epoch, from the sample traces).
fn assert_one_state_per_step(trace: &Path, steps: usize) {
    let mut batches: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    for entry in std::fs::read_dir(trace).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let records = text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok());
        for record in records {
            let step = record["step"].as_u64().unwrap();
            let batch: Vec<u64> = record["step_indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|index| index.as_u64().unwrap())
                .collect();
            let first = batches.entry(step).or_insert_with(|| batch.clone());
            assert_eq!(*first, batch, "step {step} was committed with two batches");
        }
    }
    assert_eq!(batches.len(), steps, "steps committed");
    let mut samples: Vec<u64> = batches.into_values().flatten().collect();
    let count = samples.len();
    samples.sort_unstable();
    samples.dedup();
    assert_eq!(
        samples.len(),
        count,
        "a sample was trained twice in the epoch"
    );
}
