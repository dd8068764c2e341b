//! The command line of `tandem launch`, and how it resolves into a [`LaunchPlan`]: the node's
//! place in the job, the worker command, the log folder and the job token.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tandem_cuda::{GpuFacts, Probe};
use tandem_dist::JobToken;

use super::cluster::{self, ClusterNode};

/// The store port of a multi-node job when neither the flags nor the cluster name one
/// (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The `tandem` subcommands that `tandem launch -- <command>` runs with this very binary.
pub const TANDEM_SUBCOMMANDS: &[&str] = &["train", "eval", "predict", "bench"];

/// Settings of `tandem launch [options] -- <command>`.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Workers to start on this node: a number, `auto` for the number of cores available, or
    /// `gpu` for one per visible GPU (as torchrun's `gpu`). Default: the cluster's value, else 1.
    #[arg(long, value_name = "N|auto|gpu")]
    pub nproc_per_node: Option<NprocPerNode>,
    /// A single-node job on this machine: the store listens on a free port of 127.0.0.1.
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port"])]
    pub standalone: bool,
    /// Number of nodes (one agent per node): `N`, or `MIN:MAX` for an elastic job whose rounds
    /// start with the nodes that answer, at least MIN and at most MAX. Default: the cluster's
    /// value, else 1.
    #[arg(long, value_name = "N|MIN:MAX")]
    pub nnodes: Option<NodeCount>,
    /// How long node 0 waits for more nodes once an elastic round has its minimum
    /// (`--nnodes MIN:MAX`), unless all MAX answered before.
    #[arg(long, default_value = "3", value_name = "SECONDS", value_parser = parse_seconds)]
    pub last_call: Duration,
    /// This node's rank, 0..nnodes (0..MAX); node 0's agent hosts the store. Default: the cluster's value, else 0.
    #[arg(long, value_name = "R")]
    pub node_rank: Option<usize>,
    /// Host name or address of node 0, where the store listens.
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// Port of the store on node 0 (default 29500 for multi-node jobs).
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Keep the store on the agents of the first nodes, replicated with Raft, in place of
    /// node 0's alone: node i serves the i-th `HOST:PORT` (at least 3). The job then outlives
    /// any one of them, node 0 included (with --keep-survivors, its workers go on in-process;
    /// else the next round starts without it).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "HOST:PORT,...",
        conflicts_with_all = ["master_addr", "master_port", "standalone"]
    )]
    pub store_replicas: Vec<String>,
    /// How many times the job is restarted after a worker fails before the launcher gives up.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub max_restarts: u32,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = parse_seconds)]
    pub stop_grace_seconds: Duration,
    /// How long the agents wait for each other to reach the store and start a round.
    #[arg(long, default_value = "600", value_name = "SECONDS", value_parser = parse_seconds)]
    pub join_timeout_seconds: Duration,
    /// How long a worker or an agent may go without a heartbeat (each beats every 100 ms)
    /// before it is taken for dead: a silent worker is killed and named, a silent node's
    /// round is stopped.
    #[arg(
        long,
        alias = "heartbeat-timeout-seconds",
        default_value = "1",
        value_name = "SECONDS",
        value_parser = parse_seconds
    )]
    pub heartbeat_timeout: Duration,
    /// Folder for `logs/rank_R.log` and `errors/rank_R.json`. Default: the worker command's
    /// `--output-dir` (for an s3:// or obs:// one, its staging folder, uploaded beside the
    /// outputs when the job ends), else `runs/latest` for `train` and `runs/launch-NAME` for
    /// another command (`runs/launch-eval`).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Show every local rank's output on the console, not only rank 0's.
    #[arg(long)]
    pub tee: bool,
    /// When a worker is lost, keep the others running: they re-form the job among
    /// themselves in-process and redo the step (for `train --global-batch-size`), instead of
    /// every worker restarting from the snapshot; node 0 decides who is in, for every node.
    #[arg(long)]
    pub keep_survivors: bool,
    /// With --keep-survivors: start a worker in place of each lost one (at most
    /// --max-restarts per round); it joins the running job at a step boundary with a
    /// peer's state, reading no snapshot.
    #[arg(long, requires = "keep_survivors")]
    pub replace_lost: bool,
    /// With --keep-survivors: the fewest workers that train; below it the job pauses until
    /// enough are back (--replace-lost), for at most --rendezvous-timeout.
    #[arg(
        long,
        default_value = "1",
        value_name = "N",
        requires = "keep_survivors"
    )]
    pub min_workers: usize,
    /// How long a job paused below --min-workers waits before its workers write a snapshot
    /// and the job ends with an error.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = parse_seconds)]
    pub rendezvous_timeout: Duration,
    /// The worker command: a `tandem` subcommand (`train ...`) or any program with its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `--nnodes`: the fewest and the most nodes of a round (the same for a fixed number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCount {
    /// The fewest nodes a round starts with.
    pub min: usize,
    /// The most nodes a round starts with.
    pub max: usize,
}

impl FromStr for NodeCount {
    type Err = String;

    fn from_str(text: &str) -> Result<NodeCount, String> {
        let forms = "expected a number of nodes N or a range MIN:MAX with 1 <= MIN <= MAX \
                     (e.g. 2 or 1:4)";
        let number = |part: &str| part.trim().parse::<usize>().ok();
        let (min, max) = match text.split_once(':') {
            None => match number(text) {
                Some(count) => (count, count),
                None => return Err(format!("{forms}, got {text:?}")),
            },
            Some((min, max)) => match (number(min), number(max)) {
                (Some(min), Some(max)) => (min, max),
                _ => return Err(format!("{forms}, got {text:?}")),
            },
        };
        if text.contains(':') && min == 0 {
            return Err(format!("{forms}, got {text:?}: MIN must be at least 1"));
        }
        if min > max {
            return Err(format!(
                "{forms}, got {text:?}: MIN {min} is above MAX {max}"
            ));
        }
        Ok(NodeCount { min, max })
    }
}

/// How many workers one node starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NprocPerNode {
    /// Exactly this many.
    Count(usize),
    /// As many as the cores available to this process.
    Auto,
    /// One per GPU the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
    Gpu,
}

impl FromStr for NprocPerNode {
    type Err = String;

    fn from_str(text: &str) -> Result<NprocPerNode, String> {
        match text {
            "auto" => return Ok(NprocPerNode::Auto),
            "gpu" => return Ok(NprocPerNode::Gpu),
            _ => {}
        }
        match text.parse::<usize>() {
            Ok(0) => {
                Err("expected a positive number of workers, \"auto\" or \"gpu\", got 0".into())
            }
            Ok(count) => Ok(NprocPerNode::Count(count)),
            Err(_) => Err(format!(
                "expected a positive number of workers, \"auto\" or \"gpu\", got {text:?}"
            )),
        }
    }
}

impl NprocPerNode {
    /// The number of workers, resolving `auto` to the cores available and `gpu` to the GPUs
    /// visible (through this process's probe of the CUDA driver).
    pub fn resolve(self) -> anyhow::Result<usize> {
        match self {
            NprocPerNode::Count(count) => Ok(count),
            NprocPerNode::Auto => Ok(std::thread::available_parallelism()
                .context("--nproc-per-node auto: could not count the cores available")?
                .get()),
            NprocPerNode::Gpu => gpu_workers(&GpuFacts::gather(Probe::process())),
        }
    }
}

/// `--nproc-per-node gpu`: one worker per visible GPU, or an error naming why there is none.
pub fn gpu_workers(facts: &GpuFacts) -> anyhow::Result<usize> {
    let no_gpu = |why: &str| {
        anyhow::anyhow!("--nproc-per-node gpu: no GPU visible ({why}); use a number or auto")
    };
    // Checked first: with no device listed, the driver's own answer is an init error.
    if facts.visible_devices.hides_all() {
        return Err(no_gpu("CUDA_VISIBLE_DEVICES is set and lists no device"));
    }
    match &facts.visible_gpus {
        Ok(0) => Err(no_gpu("the driver reports 0 GPUs")),
        Ok(count) => Ok(*count),
        Err(why) => Err(no_gpu(why)),
    }
}

/// Parses a non-negative number of seconds, fractions allowed (`0.5`).
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .parse()
        .map_err(|_| format!("expected a number of seconds, got {text:?}"))?;
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| format!("expected a non-negative number of seconds, got {text:?}"))
}

/// Where the store of the job is, seen from this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// This agent hosts the store on a free port of 127.0.0.1 (single-node jobs).
    Loopback,
    /// Node 0's agent hosts the store on `port`, on every interface; the others reach it at `addr`.
    Master {
        /// Host name or address of node 0, as the workers receive it in `MASTER_ADDR`.
        addr: String,
        /// The store's port.
        port: u16,
    },
    /// The agents of the first nodes each host a replica of the store: node i at
    /// `replicas[i]` (host and port).
    Replicated {
        /// Every replica's host and port, in the order of the nodes that host them.
        replicas: Vec<(String, u16)>,
    },
}

/// This node's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Number of nodes: the most a round may have.
    pub nnodes: usize,
    /// The fewest nodes a round may have: `nnodes` unless the job is elastic.
    pub min_nodes: usize,
    /// This node's rank.
    pub node_rank: usize,
    /// Workers on this node.
    pub nproc_per_node: usize,
    /// Where the store is.
    pub store: StoreLocation,
    /// Where the values came from: "flags", or a cluster environment's name.
    pub source: String,
}

impl Topology {
    /// Whether rounds may start with fewer nodes than the most (`--nnodes MIN:MAX`, MIN < MAX).
    pub fn is_elastic(&self) -> bool {
        self.min_nodes < self.nnodes
    }
}

/// Everything the agent needs, resolved and checked.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// This node's place in the job.
    pub topology: Topology,
    /// The program to run and its arguments.
    pub program: PathBuf,
    /// The arguments after the program.
    pub program_args: Vec<String>,
    /// Folder of the logs and error files (absolute).
    pub log_dir: PathBuf,
    /// The secret every agent and worker of the job shares.
    pub token: JobToken,
    /// Restarts allowed after failures.
    pub max_restarts: u32,
    /// Time between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// Bound on waiting for the other agents.
    pub join_timeout: Duration,
    /// Silence after which a node is taken for dead.
    pub heartbeat_timeout: Duration,
    /// How long an elastic round waits for more nodes once it has its minimum.
    pub last_call: Duration,
    /// Show every local rank's output, not only rank 0's.
    pub tee: bool,
    /// Whether survivors of a lost worker re-form the job in-process.
    pub keep_survivors: bool,
    /// Whether a lost worker is replaced by one that joins the running job.
    pub replace_lost: bool,
    /// The fewest workers that train with `--keep-survivors`.
    pub min_workers: usize,
    /// How long a job paused below `min_workers` waits.
    pub rendezvous_timeout: Duration,
}

impl LaunchPlan {
    /// Resolves the arguments against the environment `env` (the cluster's variables and
    /// `TANDEM_JOB_TOKEN`) and the current directory.
    pub fn resolve(args: &LaunchArgs, env: &HashMap<String, String>) -> anyhow::Result<LaunchPlan> {
        let cluster = if args.standalone {
            None
        } else {
            cluster::detect(env)?
        };
        let topology = resolve_topology(args, cluster.as_ref())?;
        let (program, program_args) = resolve_command(&args.command)?;
        let current_dir = std::env::current_dir().context("read the current directory")?;
        let log_dir = current_dir.join(default_log_dir(args.log_dir.as_deref(), &args.command));
        let token = resolve_token(env, topology.nnodes)?;
        Ok(LaunchPlan {
            topology,
            program,
            program_args,
            log_dir,
            token,
            max_restarts: args.max_restarts,
            stop_grace: args.stop_grace_seconds,
            join_timeout: args.join_timeout_seconds,
            heartbeat_timeout: args.heartbeat_timeout,
            last_call: args.last_call,
            tee: args.tee,
            keep_survivors: args.keep_survivors,
            replace_lost: args.replace_lost,
            min_workers: args.min_workers,
            rendezvous_timeout: args.rendezvous_timeout,
        })
    }
}

/// Flags first, then the cluster's values, then the single-node defaults.
pub fn resolve_topology(
    args: &LaunchArgs,
    cluster: Option<&ClusterNode>,
) -> anyhow::Result<Topology> {
    let from_cluster = |field: fn(&ClusterNode) -> Option<usize>| cluster.and_then(field);
    let nproc_per_node = match args.nproc_per_node {
        Some(nproc) => nproc.resolve()?,
        None => from_cluster(|node| node.nproc_per_node).unwrap_or(1),
    };
    let NodeCount {
        min: min_nodes,
        max: nnodes,
    } = args
        .nnodes
        .or(cluster.map(|node| NodeCount {
            min: node.nnodes,
            max: node.nnodes,
        }))
        .unwrap_or(NodeCount { min: 1, max: 1 });
    let node_rank = args
        .node_rank
        .or(from_cluster(|node| Some(node.node_rank)))
        .unwrap_or(0);
    let master_addr = args
        .master_addr
        .clone()
        .or_else(|| cluster.and_then(|node| node.master_addr.clone()));
    let master_port = args
        .master_port
        .or(cluster.and_then(|node| node.master_port));
    if nnodes == 0 {
        bail!("--nnodes must be at least 1");
    }
    if node_rank >= nnodes {
        let size = match min_nodes < nnodes {
            true => format!("up to {nnodes} nodes"),
            false => format!("{nnodes} node(s)"),
        };
        bail!(
            "--node-rank {node_rank} is out of range: a job of {size} has node ranks 0..{}",
            nnodes - 1
        );
    }
    let store = match (master_addr, nnodes) {
        _ if !args.store_replicas.is_empty() => StoreLocation::Replicated {
            replicas: parse_store_replicas(&args.store_replicas, nnodes)?,
        },
        (None, 1) if master_port.is_none() => StoreLocation::Loopback,
        (None, 1) => StoreLocation::Master { addr: "127.0.0.1".into(), port: master_port.unwrap_or(DEFAULT_MASTER_PORT) },
        (None, _) => bail!("a job of {nnodes} nodes needs --master-addr (the host of node 0, where the store listens)"),
        (Some(addr), _) if addr.is_empty() => bail!("--master-addr is empty"),
        (Some(addr), _) => StoreLocation::Master { addr, port: master_port.unwrap_or(DEFAULT_MASTER_PORT) },
    };
    let flags_given =
        args.nnodes.is_some() || args.node_rank.is_some() || args.master_addr.is_some();
    let source = match cluster {
        Some(node) if !flags_given => node.source.clone(),
        Some(node) => format!("flags and {}", node.source),
        None => "flags".into(),
    };
    Ok(Topology {
        nnodes,
        min_nodes,
        node_rank,
        nproc_per_node,
        store,
        source,
    })
}

/// The fewest replicas of a replicated store: with fewer, losing one leaves no majority.
const FEWEST_STORE_REPLICAS: usize = 3;

/// `--store-replicas`: each entry's host and port; at least three, and no more than the
/// job's nodes (node i hosts the i-th).
fn parse_store_replicas(entries: &[String], nnodes: usize) -> anyhow::Result<Vec<(String, u16)>> {
    if entries.len() < FEWEST_STORE_REPLICAS {
        bail!(
            "--store-replicas needs at least {FEWEST_STORE_REPLICAS} replicas, got {}: a store \
             goes on while a majority of its replicas does, so with fewer the loss of one \
             stops it",
            entries.len()
        );
    }
    if entries.len() > nnodes {
        bail!(
            "--store-replicas lists {} replicas, but the job has {nnodes} node(s): node i hosts \
             the i-th replica",
            entries.len()
        );
    }
    entries
        .iter()
        .map(|entry| {
            let parsed = entry.rsplit_once(':').and_then(|(host, port)| {
                let host = host.trim_start_matches('[').trim_end_matches(']');
                Some((host.to_string(), port.parse::<u16>().ok()?)).filter(|_| !host.is_empty())
            });
            parsed.ok_or_else(|| {
                anyhow::anyhow!(
                    "--store-replicas entry {entry:?} is not HOST:PORT (e.g. node0:29500 or \
                     [fd00::1]:29500)"
                )
            })
        })
        .collect()
}

/// The program and its arguments: a `tandem` subcommand runs with this binary.
pub fn resolve_command(command: &[String]) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let Some((first, rest)) = command.split_first() else {
        bail!("no worker command: give it after `--`, e.g. `tandem launch -- train --config run.toml`");
    };
    if TANDEM_SUBCOMMANDS.contains(&first.as_str()) {
        let this_binary = std::env::current_exe().context("find the path of the tandem binary")?;
        return Ok((this_binary, command.to_vec()));
    }
    if first.is_empty() {
        bail!("the worker command starts with an empty program name");
    }
    Ok((PathBuf::from(first), rest.to_vec()))
}

/// `--log-dir`, else the worker command's `--output-dir` (for an object URL, the run's
/// staging folder in the worker's `--cache-dir`), else for `train` its own default output
/// folder `runs/latest`, else `runs/launch-NAME` after the subcommand or program
/// (`runs/launch-eval`), so that a job that trains nothing keeps its logs out of the
/// folder of a run.
pub fn default_log_dir(log_dir: Option<&Path>, command: &[String]) -> PathBuf {
    if let Some(log_dir) = log_dir {
        return log_dir.to_path_buf();
    }
    let Some(output_dir) = flag_value(command, "--output-dir") else {
        return match command.first().map(String::as_str) {
            Some("train") => PathBuf::from("runs/latest"),
            first => {
                let name = first
                    .and_then(|program| Path::new(program).file_name())
                    .map_or_else(|| "job".into(), |name| name.to_string_lossy());
                PathBuf::from(format!("runs/launch-{name}"))
            }
        };
    };
    match tandem_remote::ObjectUrl::parse(&output_dir) {
        Ok(Some(url)) => {
            let cache_dir = flag_value(command, "--cache-dir")
                .map_or_else(tandem_remote::default_cache_dir, PathBuf::from);
            url.staging_path(&cache_dir, "runs")
        }
        _ => PathBuf::from(output_dir),
    }
}

/// The value of `--flag VALUE` or `--flag=VALUE` among `words`.
fn flag_value(words: &[String], flag: &str) -> Option<String> {
    let mut words = words.iter();
    while let Some(word) = words.next() {
        if word == flag {
            return words.next().cloned();
        }
        if let Some(value) = word
            .strip_prefix(flag)
            .and_then(|rest| rest.strip_prefix('='))
        {
            return Some(value.to_string());
        }
    }
    None
}

/// `TANDEM_JOB_TOKEN` when set; a fresh token for a single-node job; an error otherwise,
/// since the agents of a multi-node job must share one secret.
pub fn resolve_token(env: &HashMap<String, String>, nnodes: usize) -> anyhow::Result<JobToken> {
    match env.get(tandem_dist::JOB_TOKEN_ENV) {
        Some(token) => JobToken::new(token)
            .with_context(|| format!("{} is not a usable job token", tandem_dist::JOB_TOKEN_ENV)),
        None if nnodes == 1 => JobToken::generate().context("generate a job token"),
        None => bail!(
            "a job of {nnodes} nodes needs a shared secret: set {} to the same value on every node",
            tandem_dist::JOB_TOKEN_ENV
        ),
    }
}

/// When `tandem launch` failed to parse because the worker's command came without `--`
/// before it (`tandem launch --standalone train ...`), the message that says so, with the
/// command line as it should be. `words` is the whole command line, program name first.
pub fn missing_separator_hint(words: &[String], error: &clap::Error) -> Option<String> {
    if error.kind() != clap::error::ErrorKind::UnknownArgument
        || words.get(1).map(String::as_str) != Some("launch")
        || words.iter().any(|word| word == "--")
    {
        return None;
    }
    let stray = match error.get(clap::error::ContextKind::InvalidArg)? {
        clap::error::ContextValue::String(stray) => stray.clone(),
        _ => return None,
    };
    let at = words.iter().skip(2).position(|word| *word == stray)? + 2;
    let mut fixed: Vec<&str> = vec!["tandem"];
    fixed.extend(words[1..at].iter().map(String::as_str));
    fixed.push("--");
    fixed.extend(words[at..].iter().map(String::as_str));
    Some(format!(
        "`{stray}` is not an option of `tandem launch`: put `--` before the worker's command, \
         as in `{}`",
        fixed.join(" ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tandem_cuda::device::VisibleDevices;

    #[test]
    fn a_worker_command_without_the_separator_gets_a_hint() {
        let words: Vec<String> = [
            "tandem",
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "train",
            "--epochs",
            "1",
        ]
        .iter()
        .map(|word| word.to_string())
        .collect();
        let error = Launch::try_parse_from(words[1..].iter()).err().unwrap();
        assert_eq!(
            missing_separator_hint(&words, &error).unwrap(),
            "`train` is not an option of `tandem launch`: put `--` before the worker's command, \
             as in `tandem launch --standalone --nproc-per-node 2 -- train --epochs 1`"
        );
        let with_separator: Vec<String> = ["tandem", "launch", "--bogus", "--", "train"]
            .iter()
            .map(|word| word.to_string())
            .collect();
        let error = Launch::try_parse_from(with_separator[1..].iter())
            .err()
            .unwrap();
        assert_eq!(missing_separator_hint(&with_separator, &error), None);
    }

    /// `tandem launch` alone, to parse its flags in tests.
    #[derive(Parser)]
    struct Launch {
        #[command(flatten)]
        args: LaunchArgs,
    }

    fn parse(words: &[&str]) -> Result<LaunchArgs, String> {
        let all = std::iter::once("launch").chain(words.iter().copied());
        Launch::try_parse_from(all)
            .map(|launch| launch.args)
            .map_err(|error| error.to_string())
    }

    fn topology_of(words: &[&str]) -> anyhow::Result<Topology> {
        resolve_topology(&parse(words).map_err(anyhow::Error::msg)?, None)
    }

    #[test]
    fn nproc_per_node_is_a_positive_number_auto_or_gpu() {
        assert_eq!("4".parse(), Ok(NprocPerNode::Count(4)));
        assert_eq!("auto".parse(), Ok(NprocPerNode::Auto));
        assert_eq!("gpu".parse(), Ok(NprocPerNode::Gpu));
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(NprocPerNode::Auto.resolve().unwrap(), cores);
        assert_eq!(
            "0".parse::<NprocPerNode>(),
            Err("expected a positive number of workers, \"auto\" or \"gpu\", got 0".to_string())
        );
        let error = parse(&["--nproc-per-node", "many", "--", "true"]).unwrap_err();
        assert!(
            error.contains("invalid value 'many' for '--nproc-per-node <N|auto|gpu>': expected a positive number of workers, \"auto\" or \"gpu\", got \"many\""),
            "{error}"
        );
    }

    /// The facts of a machine whose probe looked only in an empty folder.
    fn facts_without_a_driver(folder: &Path) -> GpuFacts {
        let probe = Probe::run(&tandem_cuda::SearchPath::only(vec![folder.to_path_buf()]));
        GpuFacts::gather(&probe)
    }

    #[test]
    fn nproc_per_node_gpu_without_a_driver_says_why() {
        let empty = tempfile::tempdir().unwrap();
        let mut facts = facts_without_a_driver(empty.path());
        // Whatever CUDA_VISIBLE_DEVICES this test runs under, it lists some device here.
        facts.visible_devices = VisibleDevices::All;
        let error = gpu_workers(&facts).unwrap_err().to_string();
        let expected_start = format!(
            "--nproc-per-node gpu: no GPU visible (libcuda not found: searched only the folders \
             {:?} for libcuda.so.1 and ",
            empty.path().display().to_string()
        );
        assert!(error.starts_with(&expected_start), "{error}");
        assert!(error.ends_with("); use a number or auto"), "{error}");
    }

    #[test]
    fn nproc_per_node_gpu_counts_the_visible_gpus() {
        let empty = tempfile::tempdir().unwrap();
        let mut facts = facts_without_a_driver(empty.path());
        facts.visible_devices = VisibleDevices::All;
        facts.visible_gpus = Ok(3);
        assert_eq!(gpu_workers(&facts).unwrap(), 3);
        facts.visible_gpus = Ok(0);
        assert_eq!(
            gpu_workers(&facts).unwrap_err().to_string(),
            "--nproc-per-node gpu: no GPU visible (the driver reports 0 GPUs); use a number or auto"
        );
        // CUDA_VISIBLE_DEVICES="" hides every GPU, whatever the driver answers.
        facts.visible_devices = VisibleDevices::parse(Some(""));
        facts.visible_gpus = Err("cuInit failed: CUDA_ERROR_NO_DEVICE".into());
        assert_eq!(
            gpu_workers(&facts).unwrap_err().to_string(),
            "--nproc-per-node gpu: no GPU visible (CUDA_VISIBLE_DEVICES is set and lists no \
             device); use a number or auto"
        );
    }

    #[test]
    fn seconds_accept_fractions_and_refuse_negatives() {
        assert_eq!(parse_seconds("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_seconds("30"), Ok(Duration::from_secs(30)));
        assert_eq!(
            parse_seconds("-1"),
            Err("expected a non-negative number of seconds, got \"-1\"".to_string())
        );
        assert_eq!(
            parse_seconds("soon"),
            Err("expected a number of seconds, got \"soon\"".to_string())
        );
    }

    #[test]
    fn defaults_give_a_single_node_on_loopback() {
        let args = parse(&["--", "train", "--epochs", "2"]).unwrap();
        assert_eq!(args.max_restarts, 3);
        assert_eq!(args.stop_grace_seconds, Duration::from_secs(30));
        let topology = resolve_topology(&args, None).unwrap();
        assert_eq!(
            topology,
            Topology {
                nnodes: 1,
                min_nodes: 1,
                node_rank: 0,
                nproc_per_node: 1,
                store: StoreLocation::Loopback,
                source: "flags".into()
            }
        );
    }

    #[test]
    fn multi_node_flags_are_checked() {
        let topology = topology_of(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "node0",
            "--nproc-per-node",
            "3",
            "--",
            "x",
        ])
        .unwrap();
        assert_eq!(
            topology.store,
            StoreLocation::Master {
                addr: "node0".into(),
                port: DEFAULT_MASTER_PORT
            }
        );
        assert_eq!(
            (topology.nnodes, topology.node_rank, topology.nproc_per_node),
            (2, 1, 3)
        );
        assert_eq!(
            topology_of(&[
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "h",
                "--",
                "x"
            ])
            .unwrap_err()
            .to_string(),
            "--node-rank 2 is out of range: a job of 2 node(s) has node ranks 0..1"
        );
        assert_eq!(
            topology_of(&["--nnodes", "2", "--", "x"])
                .unwrap_err()
                .to_string(),
            "a job of 2 nodes needs --master-addr (the host of node 0, where the store listens)"
        );
        assert_eq!(
            topology_of(&["--nnodes", "0", "--", "x"])
                .unwrap_err()
                .to_string(),
            "--nnodes must be at least 1"
        );
        let conflict = parse(&["--standalone", "--nnodes", "2", "--", "x"]).unwrap_err();
        assert!(
            conflict
                .contains("the argument '--standalone' cannot be used with '--nnodes <N|MIN:MAX>'"),
            "{conflict}"
        );
        let missing_command = parse(&["--standalone"]).unwrap_err();
        assert!(
            missing_command.contains("the following required arguments were not provided"),
            "{missing_command}"
        );
    }

    #[test]
    fn nnodes_is_a_number_or_an_elastic_range() {
        assert_eq!("3".parse(), Ok(NodeCount { min: 3, max: 3 }));
        assert_eq!("1:4".parse(), Ok(NodeCount { min: 1, max: 4 }));
        assert_eq!("2:2".parse(), Ok(NodeCount { min: 2, max: 2 }));
        let forms = "expected a number of nodes N or a range MIN:MAX with 1 <= MIN <= MAX (e.g. 2 \
                     or 1:4)";
        assert_eq!(
            "3:2".parse::<NodeCount>(),
            Err(format!("{forms}, got \"3:2\": MIN 3 is above MAX 2"))
        );
        assert_eq!(
            "0:2".parse::<NodeCount>(),
            Err(format!("{forms}, got \"0:2\": MIN must be at least 1"))
        );
        for malformed in ["1:", ":2", "1:2:3", "two", "-1:2", ""] {
            assert_eq!(
                malformed.parse::<NodeCount>(),
                Err(format!("{forms}, got {malformed:?}"))
            );
        }
        let error = parse(&["--nnodes", "4:1", "--", "x"]).unwrap_err();
        assert!(
            error.contains("invalid value '4:1' for '--nnodes <N|MIN:MAX>': expected a number"),
            "{error}"
        );
        let elastic = topology_of(&[
            "--nnodes",
            "1:3",
            "--node-rank",
            "2",
            "--master-addr",
            "node0",
            "--",
            "x",
        ])
        .unwrap();
        assert_eq!((elastic.min_nodes, elastic.nnodes), (1, 3));
        assert!(elastic.is_elastic());
        assert!(
            !topology_of(&["--nnodes", "2:2", "--master-addr", "h", "--", "x"])
                .unwrap()
                .is_elastic()
        );
        assert_eq!(
            topology_of(&[
                "--nnodes",
                "1:2",
                "--node-rank",
                "2",
                "--master-addr",
                "h",
                "--",
                "x"
            ])
            .unwrap_err()
            .to_string(),
            "--node-rank 2 is out of range: a job of up to 2 nodes has node ranks 0..1"
        );
        let defaults = parse(&["--", "x"]).unwrap();
        assert_eq!(defaults.last_call, Duration::from_secs(3));
    }

    #[test]
    fn flags_override_the_cluster() {
        let cluster = ClusterNode {
            nnodes: 4,
            node_rank: 2,
            nproc_per_node: Some(8),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(6000),
            source: "modelarts".into(),
        };
        let from_cluster = resolve_topology(&parse(&["--", "x"]).unwrap(), Some(&cluster)).unwrap();
        assert_eq!(
            from_cluster,
            Topology {
                nnodes: 4,
                min_nodes: 4,
                node_rank: 2,
                nproc_per_node: 8,
                store: StoreLocation::Master {
                    addr: "10.0.0.1".into(),
                    port: 6000
                },
                source: "modelarts".into(),
            }
        );
        let mixed = resolve_topology(
            &parse(&["--nproc-per-node", "2", "--master-port", "7000", "--", "x"]).unwrap(),
            Some(&cluster),
        )
        .unwrap();
        assert_eq!(mixed.nproc_per_node, 2);
        assert_eq!(
            mixed.store,
            StoreLocation::Master {
                addr: "10.0.0.1".into(),
                port: 7000
            }
        );
        let standalone = parse(&["--standalone", "--", "x"]).unwrap();
        assert_eq!(
            resolve_topology(&standalone, None).unwrap().store,
            StoreLocation::Loopback
        );
    }

    #[test]
    fn tandem_subcommands_run_this_binary() {
        let command: Vec<String> = ["train", "--epochs", "1"]
            .iter()
            .map(|word| word.to_string())
            .collect();
        let (program, args) = resolve_command(&command).unwrap();
        assert_eq!(program, std::env::current_exe().unwrap());
        assert_eq!(args, command);
        let other: Vec<String> = ["python3", "train.py"]
            .iter()
            .map(|word| word.to_string())
            .collect();
        assert_eq!(
            resolve_command(&other).unwrap(),
            (PathBuf::from("python3"), vec!["train.py".to_string()])
        );
    }

    #[test]
    fn log_dir_follows_output_dir() {
        let words = |text: &str| text.split(' ').map(str::to_string).collect::<Vec<_>>();
        assert_eq!(
            default_log_dir(None, &words("train --output-dir out/run1 --epochs 2")),
            PathBuf::from("out/run1")
        );
        assert_eq!(
            default_log_dir(None, &words("train --output-dir=out/run2")),
            PathBuf::from("out/run2")
        );
        assert_eq!(
            default_log_dir(None, &words("train --epochs 2")),
            PathBuf::from("runs/latest")
        );
        // A job that trains nothing keeps out of runs/latest, where `train` writes.
        assert_eq!(
            default_log_dir(
                None,
                &words("eval --checkpoint runs/latest/epoch_3.safetensors")
            ),
            PathBuf::from("runs/launch-eval")
        );
        assert_eq!(
            default_log_dir(None, &words("/usr/bin/python3 train.py")),
            PathBuf::from("runs/launch-python3")
        );
        assert_eq!(
            default_log_dir(
                None,
                &words("predict --checkpoint a.safetensors --output-dir p")
            ),
            PathBuf::from("p")
        );
        assert_eq!(
            default_log_dir(Some(Path::new("logs")), &words("train --output-dir x")),
            PathBuf::from("logs")
        );
        assert_eq!(
            default_log_dir(
                None,
                &words("train --output-dir s3://bucket/runs/a --cache-dir /scratch/cache")
            ),
            PathBuf::from("/scratch/cache/runs/bucket/runs/a")
        );
    }

    #[test]
    fn a_multi_node_job_needs_the_token_from_the_environment() {
        let mut env = HashMap::new();
        assert_eq!(resolve_token(&env, 1).unwrap().expose_secret().len(), 64);
        assert_eq!(
            resolve_token(&env, 2).unwrap_err().to_string(),
            "a job of 2 nodes needs a shared secret: set TANDEM_JOB_TOKEN to the same value on every node"
        );
        env.insert("TANDEM_JOB_TOKEN".to_string(), "shared".to_string());
        assert_eq!(resolve_token(&env, 2).unwrap().expose_secret(), "shared");
    }

    #[test]
    fn keep_survivors_and_replace_lost_span_nodes() {
        let env: HashMap<String, String> = [(
            "TANDEM_JOB_TOKEN".to_string(),
            "options-test-secret".to_string(),
        )]
        .into();
        let two_nodes = |extra: &[&str]| {
            let flags = ["--nnodes", "2", "--master-addr", "h", "--keep-survivors"];
            parse(&[&flags[..], extra, &["--", "true"]].concat()).unwrap()
        };
        let plan = LaunchPlan::resolve(&two_nodes(&[]), &env).unwrap();
        assert!(plan.keep_survivors && !plan.replace_lost);
        let plan = LaunchPlan::resolve(&two_nodes(&["--replace-lost"]), &env).unwrap();
        assert!(plan.keep_survivors && plan.replace_lost);
    }

    #[test]
    fn store_replicas_are_three_or_more_host_and_port_entries_one_per_node() {
        let replicated = |nodes: &str, replicas: &str| {
            let flags = [
                "--nnodes",
                nodes,
                "--keep-survivors",
                "--store-replicas",
                replicas,
            ];
            topology_of(&[&flags[..], &["--", "true"]].concat())
        };
        assert_eq!(
            replicated("4", "a:1,[fd00::2]:2,10.0.0.3:3").unwrap().store,
            StoreLocation::Replicated {
                replicas: vec![
                    ("a".into(), 1),
                    ("fd00::2".into(), 2),
                    ("10.0.0.3".into(), 3)
                ]
            }
        );
        let refused =
            |nodes: &str, replicas: &str| replicated(nodes, replicas).unwrap_err().to_string();
        assert_eq!(
            refused("3", "a:1,b:2"),
            "--store-replicas needs at least 3 replicas, got 2: a store goes on while a \
             majority of its replicas does, so with fewer the loss of one stops it"
        );
        assert_eq!(
            refused("2", "a:1,b:2,c:3"),
            "--store-replicas lists 3 replicas, but the job has 2 node(s): node i hosts the \
             i-th replica"
        );
        assert_eq!(
            refused("3", "a:1,b,c:3"),
            "--store-replicas entry \"b\" is not HOST:PORT (e.g. node0:29500 or \
             [fd00::1]:29500)"
        );
        // Rounds restarted after a loss keep the store too.
        let restarting = topology_of(&[
            "--nnodes",
            "2:3",
            "--store-replicas",
            "a:1,b:2,c:3",
            "--",
            "true",
        ]);
        assert!(matches!(
            restarting.unwrap().store,
            StoreLocation::Replicated { .. }
        ));
    }
}
