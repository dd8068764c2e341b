//! Cluster environments: where a launcher or worker learns its place in the job.
//!
//! Pure functions over a map of environment variables, so every environment is testable
//! without setting process variables. Two results:
//! - [`NodeEnv`], for `tandem launch` (one agent per node): nodes, this node's rank, processes
//!   per node and the master's address;
//! - [`WorkerEnv`], for a worker started directly, one process per task: rank, world size,
//!   local rank and the master's address.

pub mod contract;
mod nodelist;

use std::collections::HashMap;

pub use nodelist::{expand_slurm_nodelist, MAX_HOSTS};

use crate::error::{DistError, Result};
use contract::{
    GROUP_RANK_ENV, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV,
    RANK_ENV, WORLD_SIZE_ENV,
};

/// Slurm's count of the current step's tasks per node, e.g. "2(x3),1"; set by `srun`.
const SLURM_STEP_TASKS_ENV: &str = "SLURM_STEP_TASKS_PER_NODE";

/// The store's host for an Open MPI job without `MASTER_ADDR` whose ranks all run on one node.
pub const OPEN_MPI_SINGLE_NODE_MASTER: &str = "127.0.0.1";

/// Open MPI 4's URI of `mpirun` itself (`JOBID;tcp://ADDR[,ADDR...]:PORT;tcp6://...`), set
/// for every rank: the store's host of a multi-node job without `MASTER_ADDR`, as rank 0 runs
/// beside `mpirun` under Open MPI's default mapping (`mpirun` on the first node).
pub const OPEN_MPI_HNP_URI_ENV: &str = "OMPI_MCA_orte_hnp_uri";

/// The first IPv4 address in an Open MPI HNP URI.
pub fn open_mpi_hnp_host(uri: &str) -> Option<String> {
    uri.split(';').find_map(|part| {
        let addresses = part.strip_prefix("tcp://")?;
        let (addresses, _port) = addresses.rsplit_once(':')?;
        addresses
            .split(',')
            .next()
            .filter(|address| !address.is_empty())
            .map(str::to_string)
    })
}

/// Environment variables by name.
pub type EnvMap = HashMap<String, String>;

/// The variables of this process.
pub fn process_env() -> EnvMap {
    std::env::vars().collect()
}

/// Who started the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterSource {
    /// `torchrun` / `torch.distributed.launch --use_env`: one variable set per worker.
    Torchrun,
    /// Kubeflow's PyTorchJob: `MASTER_ADDR`, `RANK` and `WORLD_SIZE` count pods, no `LOCAL_RANK`.
    Kubeflow,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// Slurm's `srun` / `sbatch`.
    Slurm,
    /// Huawei ModelArts training jobs.
    ModelArts,
}

impl ClusterSource {
    /// The name used in messages, e.g. "slurm".
    pub fn name(self) -> &'static str {
        match self {
            ClusterSource::Torchrun => "torchrun",
            ClusterSource::Kubeflow => "kubeflow",
            ClusterSource::OpenMpi => "openmpi",
            ClusterSource::Slurm => "slurm",
            ClusterSource::ModelArts => "modelarts",
        }
    }
}

impl std::fmt::Display for ClusterSource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// A node's place in the job, for the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEnv {
    /// Where it was read from.
    pub source: ClusterSource,
    /// Number of nodes.
    pub nnodes: usize,
    /// This node's rank, `0..nnodes`.
    pub node_rank: usize,
    /// Worker processes per node, when the environment says.
    pub nproc_per_node: Option<usize>,
    /// Host of the store (node 0).
    pub master_addr: String,
    /// Port of the store, when the environment says.
    pub master_port: Option<u16>,
}

/// A worker's place in the job, for a worker started without the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    /// Where it was read from.
    pub source: ClusterSource,
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of workers.
    pub world_size: usize,
    /// Rank among the workers of this node.
    pub local_rank: usize,
    /// Number of workers on this node.
    pub local_world_size: usize,
    /// Host of the store, when the environment says.
    pub master_addr: Option<String>,
    /// Port of the store, when the environment says.
    pub master_port: Option<u16>,
}

impl NodeEnv {
    /// The node environment of this process's variables; `None` outside any cluster.
    pub fn from_env() -> Result<Option<NodeEnv>> {
        node_env(&process_env())
    }
}

impl WorkerEnv {
    /// The worker environment of this process's variables; `None` outside any cluster.
    pub fn from_env() -> Result<Option<WorkerEnv>> {
        worker_env(&process_env())
    }
}

/// Which environment `vars` come from, innermost launcher first: torchrun inside Slurm is
/// torchrun, `mpirun` inside a Slurm allocation is Open MPI.
pub fn detect_source(vars: &EnvMap) -> Option<ClusterSource> {
    let has = |name: &str| vars.contains_key(name);
    if has(LOCAL_RANK_ENV) && has(RANK_ENV) && has(WORLD_SIZE_ENV) {
        Some(ClusterSource::Torchrun)
    } else if has("PET_NNODES") || (has(MASTER_ADDR_ENV) && has(RANK_ENV) && has(WORLD_SIZE_ENV)) {
        Some(ClusterSource::Kubeflow)
    } else if has("OMPI_COMM_WORLD_RANK") {
        Some(ClusterSource::OpenMpi)
    } else if has("SLURM_PROCID") || has("SLURM_JOB_NODELIST") || has("SLURM_NODELIST") {
        Some(ClusterSource::Slurm)
    } else if has("VC_WORKER_HOSTS") {
        Some(ClusterSource::ModelArts)
    } else {
        None
    }
}

/// The node environment of whichever cluster `vars` come from; `None` outside any cluster.
pub fn node_env(vars: &EnvMap) -> Result<Option<NodeEnv>> {
    detect_source(vars)
        .map(|source| node_env_from(source, vars))
        .transpose()
}

/// The worker environment of whichever cluster `vars` come from; `None` outside any cluster.
pub fn worker_env(vars: &EnvMap) -> Result<Option<WorkerEnv>> {
    detect_source(vars)
        .map(|source| worker_env_from(source, vars))
        .transpose()
}

/// Reads the node environment of `source` from `vars`.
pub fn node_env_from(source: ClusterSource, vars: &EnvMap) -> Result<NodeEnv> {
    let env = Reader { source, vars };
    let node = match source {
        ClusterSource::Torchrun => env.torchrun_node()?,
        ClusterSource::Kubeflow => NodeEnv {
            source,
            nnodes: env.count_either("PET_NNODES", WORLD_SIZE_ENV)?,
            node_rank: env.index_either("PET_NODE_RANK", RANK_ENV)?,
            nproc_per_node: env.optional_count("PET_NPROC_PER_NODE")?,
            master_addr: env.text_either("PET_MASTER_ADDR", MASTER_ADDR_ENV)?,
            master_port: Some(env.port_either("PET_MASTER_PORT", MASTER_PORT_ENV)?),
        },
        ClusterSource::OpenMpi => env.open_mpi_node()?,
        ClusterSource::Slurm => env.slurm_node()?,
        ClusterSource::ModelArts => env.model_arts_node()?,
    };
    if node.node_rank >= node.nnodes {
        let variable = match source {
            ClusterSource::Torchrun => GROUP_RANK_ENV,
            ClusterSource::Kubeflow => env.first_present("PET_NODE_RANK", RANK_ENV),
            ClusterSource::OpenMpi => "OMPI_COMM_WORLD_RANK",
            ClusterSource::Slurm => "SLURM_NODEID",
            ClusterSource::ModelArts => "VC_TASK_INDEX",
        };
        return Err(env.invalid(
            variable,
            &format!("is not below the number of nodes, {}", node.nnodes),
        ));
    }
    Ok(node)
}

/// Reads the worker environment of `source` from `vars`.
pub fn worker_env_from(source: ClusterSource, vars: &EnvMap) -> Result<WorkerEnv> {
    let env = Reader { source, vars };
    let worker = match source {
        ClusterSource::Torchrun => WorkerEnv {
            source,
            rank: env.index(RANK_ENV)?,
            world_size: env.count(WORLD_SIZE_ENV)?,
            local_rank: env.index(LOCAL_RANK_ENV)?,
            local_world_size: env.count(LOCAL_WORLD_SIZE_ENV)?,
            master_addr: Some(env.text(MASTER_ADDR_ENV)?),
            master_port: Some(env.port(MASTER_PORT_ENV)?),
        },
        ClusterSource::Kubeflow => WorkerEnv {
            source,
            rank: env.index(RANK_ENV)?,
            world_size: env.count(WORLD_SIZE_ENV)?,
            local_rank: 0,
            local_world_size: 1,
            master_addr: Some(env.text(MASTER_ADDR_ENV)?),
            master_port: Some(env.port(MASTER_PORT_ENV)?),
        },
        ClusterSource::OpenMpi => env.open_mpi_worker()?,
        ClusterSource::Slurm => env.slurm_worker()?,
        ClusterSource::ModelArts => {
            // Without a launcher, ModelArts runs one worker per node.
            let node = node_env_from(source, vars)?;
            WorkerEnv {
                source,
                rank: node.node_rank,
                world_size: node.nnodes,
                local_rank: 0,
                local_world_size: 1,
                master_addr: Some(node.master_addr),
                master_port: node.master_port,
            }
        }
    };
    env.check_ranks(&worker)?;
    Ok(worker)
}

/// The node and worker environments of each cluster that needs more than a table of names.
impl Reader<'_> {
    /// torchrun's node: the world in nodes of `LOCAL_WORLD_SIZE` workers.
    fn torchrun_node(&self) -> Result<NodeEnv> {
        let world_size = self.count(WORLD_SIZE_ENV)?;
        let local_world_size = self.count(LOCAL_WORLD_SIZE_ENV)?;
        if world_size % local_world_size != 0 {
            return Err(self.invalid(
                WORLD_SIZE_ENV,
                &format!("is not a multiple of LOCAL_WORLD_SIZE={local_world_size}"),
            ));
        }
        Ok(NodeEnv {
            source: self.source,
            nnodes: world_size / local_world_size,
            node_rank: self.index(GROUP_RANK_ENV)?,
            nproc_per_node: Some(local_world_size),
            master_addr: self.text(MASTER_ADDR_ENV)?,
            master_port: Some(self.port(MASTER_PORT_ENV)?),
        })
    }

    /// Open MPI's node: one launcher per node, each an MPI rank.
    fn open_mpi_node(&self) -> Result<NodeEnv> {
        let local_size = self.count("OMPI_COMM_WORLD_LOCAL_SIZE")?;
        if local_size != 1 {
            return Err(self.invalid(
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "must be 1: start one launcher per node (mpirun --npernode 1)",
            ));
        }
        Ok(NodeEnv {
            source: self.source,
            nnodes: self.count("OMPI_COMM_WORLD_SIZE")?,
            node_rank: self.index("OMPI_COMM_WORLD_RANK")?,
            nproc_per_node: None,
            master_addr: self.text(MASTER_ADDR_ENV)?,
            master_port: self.optional_port(MASTER_PORT_ENV)?,
        })
    }

    /// Slurm's node: one launcher task per node.
    fn slurm_node(&self) -> Result<NodeEnv> {
        // `srun -n 2 tandem launch` on one node would start two launchers, each taking
        // itself for the node and starting the node's workers: one of them only may run.
        if self.optional_text(SLURM_STEP_TASKS_ENV).is_some() {
            let tasks = self.slurm_task_count(SLURM_STEP_TASKS_ENV)?;
            if tasks != 1 {
                return Err(self.invalid(
                    SLURM_STEP_TASKS_ENV,
                    &format!(
                        "srun started {tasks} tasks on this node, and each would run its own \
                         `tandem launch` of the node's workers: start one launcher per node \
                         (srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 tandem launch \
                         --nproc-per-node N ...), or let srun start the workers without \
                         `tandem launch` (srun --ntasks-per-node=N tandem train ...)"
                    ),
                ));
            }
        }
        Ok(NodeEnv {
            source: self.source,
            nnodes: self.count_either("SLURM_NNODES", "SLURM_JOB_NUM_NODES")?,
            node_rank: self.index("SLURM_NODEID")?,
            nproc_per_node: None,
            master_addr: self.slurm_first_host()?,
            master_port: self.optional_port(MASTER_PORT_ENV)?,
        })
    }

    /// ModelArts' node: the first of `VC_WORKER_HOSTS` hosts the store.
    fn model_arts_node(&self) -> Result<NodeEnv> {
        let hosts = self.text("VC_WORKER_HOSTS")?;
        let master_addr = hosts
            .split(',')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        if master_addr.is_empty() {
            return Err(self.invalid("VC_WORKER_HOSTS", "does not start with a host name"));
        }
        Ok(NodeEnv {
            source: self.source,
            nnodes: self.count("MA_NUM_HOSTS")?,
            node_rank: self.index("VC_TASK_INDEX")?,
            // MA_NUM_GPUS is 0 on CPU flavours: then the launcher decides.
            nproc_per_node: self.optional_count("MA_NUM_GPUS")?,
            master_addr,
            master_port: self.optional_port(MASTER_PORT_ENV)?,
        })
    }

    /// A worker that `mpirun` started.
    fn open_mpi_worker(&self) -> Result<WorkerEnv> {
        let world_size = self.count("OMPI_COMM_WORLD_SIZE")?;
        let local_world_size = self.count("OMPI_COMM_WORLD_LOCAL_SIZE")?;
        // Open MPI names no rank's host: when every rank is on this node rank 0 is too;
        // across nodes its HNP URI names mpirun's host, where rank 0 runs under the
        // default mapping (rank 0 checks that it does, see `tandem`'s placement).
        let single_node = local_world_size == world_size;
        Ok(WorkerEnv {
            source: self.source,
            rank: self.index("OMPI_COMM_WORLD_RANK")?,
            world_size,
            local_rank: self.index("OMPI_COMM_WORLD_LOCAL_RANK")?,
            local_world_size,
            master_addr: self
                .optional_text(MASTER_ADDR_ENV)
                .or_else(|| single_node.then(|| OPEN_MPI_SINGLE_NODE_MASTER.to_string()))
                .or_else(|| {
                    self.optional_text(OPEN_MPI_HNP_URI_ENV)
                        .and_then(|uri| open_mpi_hnp_host(&uri))
                }),
            master_port: self.optional_port(MASTER_PORT_ENV)?,
        })
    }

    /// A worker that `srun` started.
    fn slurm_worker(&self) -> Result<WorkerEnv> {
        let world_size = self.count("SLURM_NTASKS")?;
        // The step's own count first: an `srun` inside `sbatch` inherits the job's.
        let per_node = [
            SLURM_STEP_TASKS_ENV,
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
        ]
        .into_iter()
        .find(|name| self.optional_text(name).is_some());
        let local_world_size = match per_node {
            Some(name) => self.slurm_task_count(name)?,
            None => {
                world_size
                    / self
                        .count_either("SLURM_NNODES", "SLURM_JOB_NUM_NODES")?
                        .max(1)
            }
        };
        Ok(WorkerEnv {
            source: self.source,
            rank: self.index("SLURM_PROCID")?,
            world_size,
            local_rank: self.index("SLURM_LOCALID")?,
            local_world_size: local_world_size.max(1),
            master_addr: Some(self.slurm_first_host()?),
            master_port: self.optional_port(MASTER_PORT_ENV)?,
        })
    }

    /// Fails, naming the variable, when a worker's rank or local rank is out of range.
    fn check_ranks(&self, worker: &WorkerEnv) -> Result<()> {
        let (rank_variable, local_variable) = match self.source {
            ClusterSource::Torchrun | ClusterSource::Kubeflow => (RANK_ENV, LOCAL_RANK_ENV),
            ClusterSource::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ClusterSource::Slurm => ("SLURM_PROCID", "SLURM_LOCALID"),
            ClusterSource::ModelArts => ("VC_TASK_INDEX", "VC_TASK_INDEX"),
        };
        if worker.rank >= worker.world_size {
            return Err(self.invalid(
                rank_variable,
                &format!("is not below the world size, {}", worker.world_size),
            ));
        }
        if worker.local_rank >= worker.local_world_size {
            return Err(self.invalid(
                local_variable,
                &format!(
                    "is not below the local world size, {}",
                    worker.local_world_size
                ),
            ));
        }
        Ok(())
    }
}

/// Typed access to the variables of one environment; errors name the variable and value.
struct Reader<'a> {
    source: ClusterSource,
    vars: &'a EnvMap,
}

impl Reader<'_> {
    fn value(&self, name: &str) -> String {
        self.vars.get(name).cloned().unwrap_or_default()
    }

    fn invalid(&self, name: &str, message: &str) -> DistError {
        DistError::Env {
            source_name: self.source.name().into(),
            variable: name.into(),
            value: self.value(name),
            message: message.into(),
        }
    }

    fn optional_text(&self, name: &str) -> Option<String> {
        self.vars
            .get(name)
            .map(|value| value.trim().to_string())
            .filter(|value| !value.is_empty())
    }

    fn text(&self, name: &str) -> Result<String> {
        self.optional_text(name)
            .ok_or_else(|| self.invalid(name, "is not set"))
    }

    /// The first of two variables that is set (the second otherwise).
    fn first_present<'n>(&self, first: &'n str, second: &'n str) -> &'n str {
        if self.optional_text(first).is_some() {
            first
        } else {
            second
        }
    }

    fn text_either(&self, first: &str, second: &str) -> Result<String> {
        self.text(self.first_present(first, second))
    }

    fn number(&self, name: &str) -> Result<usize> {
        self.text(name)?
            .parse::<usize>()
            .map_err(|_| self.invalid(name, "is not a non-negative integer"))
    }

    /// A rank or index: any non-negative integer.
    fn index(&self, name: &str) -> Result<usize> {
        self.number(name)
    }

    fn index_either(&self, first: &str, second: &str) -> Result<usize> {
        self.index(self.first_present(first, second))
    }

    /// A count: a positive integer.
    fn count(&self, name: &str) -> Result<usize> {
        match self.number(name)? {
            0 => Err(self.invalid(name, "must be at least 1")),
            count => Ok(count),
        }
    }

    fn count_either(&self, first: &str, second: &str) -> Result<usize> {
        self.count(self.first_present(first, second))
    }

    /// A count that may be unset, or 0 / a word like "auto" or "gpu" meaning "not given".
    fn optional_count(&self, name: &str) -> Result<Option<usize>> {
        let Some(text) = self.optional_text(name) else {
            return Ok(None);
        };
        if text.bytes().all(|byte| byte.is_ascii_alphabetic()) {
            return Ok(None);
        }
        match self.number(name)? {
            0 => Ok(None),
            count => Ok(Some(count)),
        }
    }

    fn port(&self, name: &str) -> Result<u16> {
        match self.text(name)?.parse::<u16>() {
            Ok(port) if port != 0 => Ok(port),
            _ => Err(self.invalid(name, "is not a port number (1-65535)")),
        }
    }

    fn port_either(&self, first: &str, second: &str) -> Result<u16> {
        self.port(self.first_present(first, second))
    }

    fn optional_port(&self, name: &str) -> Result<Option<u16>> {
        match self.optional_text(name) {
            Some(_) => self.port(name).map(Some),
            None => Ok(None),
        }
    }

    /// The first host of the job's node list.
    fn slurm_first_host(&self) -> Result<String> {
        let name = self.first_present("SLURM_JOB_NODELIST", "SLURM_NODELIST");
        let list = self.text(name)?;
        let hosts = expand_slurm_nodelist(&list).map_err(|message| self.invalid(name, &message))?;
        hosts
            .into_iter()
            .next()
            .ok_or_else(|| self.invalid(name, "names no host"))
    }

    /// This node's entry in Slurm's per-node task counts, which look like "4", "4,4" or
    /// "2(x3),1" (three nodes with 2 tasks, then one with 1); the node is `SLURM_NODEID`.
    fn slurm_task_count(&self, name: &str) -> Result<usize> {
        let text = self.text(name)?;
        let mut counts = Vec::new();
        for group in text.split(',') {
            let (count, repeat) = match group.split_once('(') {
                Some((count, repeat)) => (
                    count,
                    repeat
                        .strip_prefix('x')
                        .and_then(|rest| rest.strip_suffix(')')),
                ),
                None => (group, Some("1")),
            };
            let count = count.parse::<usize>().ok().filter(|count| *count > 0);
            let repeat = repeat
                .and_then(|repeat| repeat.parse::<usize>().ok())
                .filter(|repeat| *repeat <= MAX_HOSTS);
            let (Some(count), Some(repeat)) = (count, repeat) else {
                return Err(self.invalid(name, "is not a list of task counts like \"2(x3),1\""));
            };
            counts.resize(counts.len() + repeat, count);
        }
        let node = match self.optional_text("SLURM_NODEID") {
            Some(_) => self.index("SLURM_NODEID")?,
            None => 0,
        };
        counts
            .get(node)
            .copied()
            .ok_or_else(|| self.invalid(name, &format!("has no entry for node {node}")))
    }
}

#[cfg(test)]
mod tests;
