//! `tandem status`: what a live job's store says about its round and its workers.
//!
//! Each agent writes `job.json` (mode 0600: it holds the job token) into its log folder when
//! it reaches the store; `tandem status` reads it, asks the store for the current round and
//! each rank's heartbeat and status (see [`tandem_dist::heartbeat`]), and prints one line per
//! rank; with `--keep-survivors`, also the job's membership, and which ranks it left out.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tandem_dist::cluster::contract::{
    membership_key, resolve_store_replicas, store_prefix, MembershipRecord,
};
use tandem_dist::heartbeat::{heartbeat_key, status_key, WorkerStatus, HEARTBEAT_INTERVAL};
use tandem_dist::{JobToken, StoreClient};

use super::rendezvous::{current_round_record, Round};

/// The name of the job file in the launcher's log folder.
pub const JOB_FILE: &str = "job.json";

/// How long `tandem status` watches the heartbeats to tell the moving from the silent.
const WATCH: Duration = Duration::from_millis(3 * HEARTBEAT_INTERVAL.as_millis() as u64);

/// How long `tandem status` tries to reach the store.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Where a live job's store is, and its token, as the launcher leaves them for `tandem
/// status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobFile {
    /// The store's address, as this node's agent reaches it; for a replicated store, its
    /// replicas' `HOST:PORT` separated by commas.
    pub store: String,
    /// The job token.
    pub token: String,
    /// The launcher's process id.
    pub launcher_pid: u32,
}

/// Writes the job file of the agent that reached the store at `store` (a replicated store's
/// replicas separated by commas) into `log_dir`.
pub fn write_job_file(log_dir: &Path, store: &str, token: &JobToken) -> anyhow::Result<()> {
    let record = JobFile {
        store: store.to_string(),
        token: token.expose_secret().to_string(),
        launcher_pid: std::process::id(),
    };
    let bytes = serde_json::to_vec_pretty(&record).context("encode the job file")?;
    let path = log_dir.join(JOB_FILE);
    tandem_files::write_private_atomically(&path, &bytes)
        .with_context(|| format!("write {}", path.display()))
}

/// The options of `tandem status`.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    /// The launcher's log folder (`tandem launch` prints it: `logs in DIR`): the worker
    /// command's `--output-dir`, else `runs/latest`.
    #[arg(default_value = "runs/latest", value_name = "LOG_DIR")]
    pub log_dir: PathBuf,
}

/// One rank as `tandem status` sees it.
struct RankView {
    rank: usize,
    status: Option<WorkerStatus>,
    /// The heartbeat counter at the start and at the end of the watch.
    beats: (i64, i64),
}

/// The report of `tandem status` on the job whose launcher logs into `args.log_dir`.
pub fn run(args: &StatusArgs) -> anyhow::Result<String> {
    let path = args.log_dir.join(JOB_FILE);
    let bytes = std::fs::read(&path).with_context(|| {
        format!(
            "cannot read {}: is a job launched with its logs in {}?",
            path.display(),
            args.log_dir.display()
        )
    })?;
    let job: JobFile = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a job file", path.display()))?;
    let token = JobToken::new(&job.token)
        .with_context(|| format!("{} holds an unusable job token", path.display()))?;
    let client = connect(&job, &path, &token)?;
    let round = current_round_record(&client)?
        .context("the job's store holds no round yet: the nodes are still joining")?;
    let membership = client
        .get(&membership_key(&store_prefix(round.number)))?
        .and_then(|bytes| MembershipRecord::from_json(&bytes).ok());
    let views = watch_ranks(&client, &round)?;
    let leader = client.answering_replica();
    Ok(describe(&job, leader, &round, membership.as_ref(), &views))
}

/// Where a job file's store is.
#[derive(Debug, PartialEq)]
enum StoreAt {
    /// A store of one server.
    Single(SocketAddr),
    /// The replicas of a replicated store.
    Replicated(Vec<SocketAddr>),
}

/// The store of `job`, the job file at `path`: one address, or the replicas of a replicated
/// store as `HOST:PORT` entries separated by commas.
fn store_at(job: &JobFile, path: &Path) -> anyhow::Result<StoreAt> {
    if !job.store.contains(',') {
        let addr = job.store.parse().with_context(|| {
            format!(
                "{}: store {:?} is not an address",
                path.display(),
                job.store
            )
        })?;
        return Ok(StoreAt::Single(addr));
    }
    let replicas = resolve_store_replicas(&job.store)
        .map_err(|why| anyhow::anyhow!("{}: store {:?}: {why}", path.display(), job.store))?;
    Ok(StoreAt::Replicated(replicas))
}

/// Connects to the store of `job`, the job file at `path`, following the leader of a
/// replicated one.
fn connect(job: &JobFile, path: &Path, token: &JobToken) -> anyhow::Result<StoreClient> {
    let connected = match store_at(job, path)? {
        StoreAt::Single(addr) => StoreClient::connect(addr, token, CONNECT_TIMEOUT),
        StoreAt::Replicated(replicas) => {
            StoreClient::connect_replicated(&replicas, token, CONNECT_TIMEOUT)
        }
    };
    connected.with_context(|| {
        format!(
            "cannot reach the job's store at {} (launcher pid {}): the job has ended or its \
             launcher is gone",
            job.store, job.launcher_pid
        )
    })
}

/// Reads every rank's status and heartbeat, then the heartbeats again after [`WATCH`].
fn watch_ranks(client: &StoreClient, round: &Round) -> anyhow::Result<Vec<RankView>> {
    let prefix = store_prefix(round.number);
    let mut views = Vec::new();
    for rank in 0..round.world_size() {
        let beat = client.add(&heartbeat_key(&prefix, rank), 0)?;
        let status = client
            .get(&status_key(&prefix, rank))?
            .and_then(|bytes| WorkerStatus::from_json(&bytes).ok());
        views.push(RankView {
            rank,
            status,
            beats: (beat, beat),
        });
    }
    std::thread::sleep(WATCH);
    for view in &mut views {
        view.beats.1 = client.add(&heartbeat_key(&prefix, view.rank), 0)?;
    }
    Ok(views)
}

/// The report: the round's line (with the `leader` of a replicated store), the membership's
/// when it changed, then one line per rank.
fn describe(
    job: &JobFile,
    leader: Option<SocketAddr>,
    round: &Round,
    membership: Option<&MembershipRecord>,
    views: &[RankView],
) -> String {
    let leads = leader.map_or_else(String::new, |leader| format!("store leader {leader}, "));
    let mut text = format!(
        "job at {} ({leads}launcher pid {}): {}\n",
        job.store, job.launcher_pid, round.line
    );
    if let Some(record) = membership {
        let paused = match record.paused_for {
            Some(seconds) => format!(", paused below --min-workers for up to {seconds:.0} s"),
            None => String::new(),
        };
        let _ = writeln!(
            text,
            "membership {}: ranks {:?} in the job{paused} (last change: {})",
            record.epoch, record.members, record.why
        );
    }
    let _ = writeln!(
        text,
        "{:>4}  {:<16} {:>8}  {:>5}  {:>7}  {:>9}  heartbeat",
        "rank", "host", "pid", "epoch", "step", "img/s"
    );
    for view in views {
        let left_out = membership.is_some_and(|record| !record.members.contains(&view.rank));
        let heartbeat = match left_out {
            true => "left out of the job".to_string(),
            false => heartbeat_state(view.beats),
        };
        let _ = match &view.status {
            Some(status) => writeln!(
                text,
                "{:>4}  {:<16} {:>8}  {:>5}  {:>7}  {:>9.1}  {heartbeat}",
                view.rank,
                status.host,
                status.pid,
                status.epoch,
                status.step,
                status.images_per_second
            ),
            None => writeln!(
                text,
                "{:>4}  {:<16} {:>8}  {:>5}  {:>7}  {:>9}  {heartbeat}",
                view.rank, "-", "-", "-", "-", "-"
            ),
        };
    }
    text
}

/// A heartbeat watched from `first` to `last`, in words.
fn heartbeat_state((first, last): (i64, i64)) -> String {
    let window = WATCH.as_secs_f64();
    match (first, last) {
        (_, last) if last < 0 => "ended (the worker is finishing)".into(),
        (0, 0) => "none yet (starting)".into(),
        (first, last) if last > first => format!("beating ({} in {window:.1} s)", last - first),
        _ => format!("silent for at least {window:.1} s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_reads_as_beating_silent_starting_or_ended() {
        assert_eq!(heartbeat_state((10, 13)), "beating (3 in 0.3 s)");
        assert_eq!(heartbeat_state((10, 10)), "silent for at least 0.3 s");
        assert_eq!(heartbeat_state((0, 0)), "none yet (starting)");
        assert_eq!(
            heartbeat_state((12, 12 + tandem_dist::heartbeat::ENDED)),
            "ended (the worker is finishing)"
        );
    }

    fn job_at(store: &str) -> JobFile {
        JobFile {
            store: store.into(),
            token: "t".into(),
            launcher_pid: 7,
        }
    }

    #[test]
    fn a_job_file_names_one_store_or_the_replicas_of_a_replicated_one() {
        let path = Path::new("runs/latest/job.json");
        assert_eq!(
            store_at(&job_at("127.0.0.1:29500"), path).unwrap(),
            StoreAt::Single("127.0.0.1:29500".parse().unwrap())
        );
        let error = store_at(&job_at("node0:29500"), path).unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "runs/latest/job.json: store \"node0:29500\" is not an address: invalid socket \
             address syntax"
        );
        let StoreAt::Replicated(replicas) =
            store_at(&job_at("127.0.0.1:7001,[::1]:7002,localhost:7003"), path).unwrap()
        else {
            panic!("a list of replicas");
        };
        assert_eq!(
            replicas[..2],
            [
                "127.0.0.1:7001".parse().unwrap(),
                "[::1]:7002".parse().unwrap()
            ]
        );
        assert_eq!(replicas[2].port(), 7003);
        let error = store_at(&job_at("127.0.0.1:7001,node1"), path).unwrap_err();
        assert!(
            error.to_string().starts_with(
                "runs/latest/job.json: store \"127.0.0.1:7001,node1\": entry \"node1\" is not \
                 HOST:PORT"
            ),
            "{error}"
        );
    }

    #[test]
    fn status_reaches_a_replicated_store_through_the_loss_of_its_leader() {
        use tandem_dist::{StoreLimits, StoreReplica};
        let token = JobToken::new("status-test-token").unwrap();
        let mut replicas: Vec<Option<StoreReplica>> = (0..3)
            .map(|_| {
                let any_port = "127.0.0.1:0".parse().unwrap();
                StoreReplica::bind(any_port, token.clone(), StoreLimits::default()).map(Some)
            })
            .collect::<Result<_, _>>()
            .unwrap();
        let addrs: Vec<SocketAddr> = replicas
            .iter()
            .flatten()
            .map(StoreReplica::local_addr)
            .collect();
        for (index, replica) in replicas.iter_mut().flatten().enumerate() {
            replica.start(&addrs, index).unwrap();
        }
        let first = wait_for_leader(&replicas);
        replicas[first] = None;
        let second = wait_for_leader(&replicas);
        let log_dir = tempfile::tempdir().unwrap();
        let list: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
        write_job_file(log_dir.path(), &list.join(","), &token).unwrap();
        let args = StatusArgs {
            log_dir: log_dir.path().to_path_buf(),
        };
        // The store answered: it holds no round, as no launcher ever wrote one.
        let error = run(&args).unwrap_err().to_string();
        assert!(
            error.starts_with("the job's store holds no round yet"),
            "{error}"
        );
        let round = Round {
            number: 0,
            restarts: 0,
            members: Vec::new(),
            line: "round 0: nodes none".into(),
        };
        let store = StoreClient::connect_replicated(&addrs, &token, CONNECT_TIMEOUT).unwrap();
        let record = serde_json::to_vec(&round).unwrap();
        store
            .set(&super::super::rendezvous::closed_key(0), &record)
            .unwrap();
        store
            .set(super::super::rendezvous::CURRENT_KEY, b"0")
            .unwrap();
        let report = run(&args).unwrap();
        let first_line = report.lines().next().unwrap_or_default();
        assert_eq!(
            first_line,
            format!(
                "job at {} (store leader {}, launcher pid {}): round 0: nodes none",
                list.join(","),
                addrs[second],
                std::process::id()
            )
        );
    }

    /// The index of the replica that leads, once one does.
    fn wait_for_leader(replicas: &[Option<tandem_dist::StoreReplica>]) -> usize {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let leading = replicas
                .iter()
                .position(|replica| replica.as_ref().is_some_and(|r| r.is_leader()));
            if let Some(index) = leading {
                return index;
            }
            assert!(std::time::Instant::now() < deadline, "no leader");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn the_membership_and_the_ranks_it_left_out_are_shown() {
        let job = JobFile {
            store: "127.0.0.1:29500".into(),
            token: "t".into(),
            launcher_pid: 7,
        };
        let round = Round {
            number: 0,
            restarts: 0,
            members: Vec::new(),
            line: "round 0: nodes 0 (3 workers); world size 3".into(),
        };
        let membership = MembershipRecord {
            epoch: 1,
            members: vec![0, 2],
            why: "rank 1 (pid 42) killed by SIGKILL".into(),
            paused_for: None,
        };
        let views: Vec<RankView> = (0..3)
            .map(|rank| RankView {
                rank,
                status: None,
                beats: (5, 8),
            })
            .collect();
        let report = describe(&job, None, &round, Some(&membership), &views);
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(
            lines[1],
            "membership 1: ranks [0, 2] in the job (last change: rank 1 (pid 42) killed by SIGKILL)"
        );
        assert!(lines[3].ends_with("beating (3 in 0.3 s)"), "{report}");
        assert!(lines[4].ends_with("  left out of the job"), "{report}");
        assert!(lines[5].ends_with("beating (3 in 0.3 s)"), "{report}");
    }
}
