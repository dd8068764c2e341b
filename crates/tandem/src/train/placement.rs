//! Where this worker stands in its job: rank, world size and the rendezvous address, from
//! the tutorial's flags, torchrun's variables, or a cluster's own.

use std::net::SocketAddr;

use anyhow::{bail, Context};
use tandem_dist::cluster::contract::{
    self, DEFAULT_MASTER_PORT, MASTER_ADDR_ENV, RESTART_COUNT_ENV, STORE_HOSTED_ENV,
    STORE_PREFIX_ENV, STORE_REPLICAS_ENV,
};
use tandem_dist::cluster::{ClusterSource, WorkerEnv};

use crate::settings::PlacementFlags;
use crate::train::ddp::WorkerPlacement;

/// The worker's place in the job, or `None` for a job of one process.
pub fn find_placement(flags: &PlacementFlags) -> anyhow::Result<Option<WorkerPlacement>> {
    find_placement_of(flags, false)
}

/// [`find_placement`], but with `keep_world_of_one` a job of one process that a launcher
/// started (its environment names the store) keeps its place, so that it trains through the
/// data-parallel path (`--backend nccl` at world size 1, as PyTorch's DDP under `torchrun
/// --nproc-per-node 1`).
pub fn find_placement_of(
    flags: &PlacementFlags,
    keep_world_of_one: bool,
) -> anyhow::Result<Option<WorkerPlacement>> {
    let env = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    let cluster = tandem_dist::cluster::WorkerEnv::from_env()
        .context("cannot read this worker's place in the job from the environment")?;
    let world_size = match flags.world_size {
        Some(world_size) => world_size,
        None => cluster.as_ref().map_or(1, |worker| worker.world_size),
    };
    let launched_alone = world_size == 1
        && keep_world_of_one
        && cluster
            .as_ref()
            .is_some_and(|worker| worker.master_addr.is_some());
    if world_size <= 1 && !launched_alone {
        return Ok(None);
    }
    let rank = rank_of(flags, cluster.as_ref(), world_size)?;
    let (master_addr, master_port) = match &flags.init_method {
        Some(init_method) => parse_init_method(init_method)?,
        None => store_address(cluster.as_ref(), world_size)?,
    };
    // `--init-method` names the store itself, as it overrides `MASTER_ADDR`.
    let store_replicas = match &flags.init_method {
        Some(_) => Vec::new(),
        None => store_replicas(env(STORE_REPLICAS_ENV).as_deref())?,
    };
    let master_from_mpirun = flags.init_method.is_none()
        && store_replicas.is_empty()
        && env(MASTER_ADDR_ENV).is_none()
        && cluster.as_ref().is_some_and(|worker| {
            worker.source == ClusterSource::OpenMpi && worker.local_world_size < worker.world_size
        });
    if master_from_mpirun && rank == 0 {
        check_runs_on(&master_addr)?;
    }
    let local_world_size = cluster.as_ref().map_or(1, |worker| worker.local_world_size);
    let key_prefix = env(STORE_PREFIX_ENV).unwrap_or_else(|| {
        let restart_round = env(RESTART_COUNT_ENV).unwrap_or_else(|| "0".to_string());
        contract::store_prefix(restart_round)
    });
    Ok(Some(WorkerPlacement {
        rank,
        world_size,
        local_world_size,
        master_addr,
        master_port,
        store_hosted: env(STORE_HOSTED_ENV).is_some_and(|value| value == "1"),
        round_prefix: key_prefix.clone(),
        key_prefix,
        worker_id: rank,
        membership_epoch: 0,
        store_replicas,
    }))
}

/// This worker's rank: `--rank`, else the cluster's; below `world_size`.
fn rank_of(
    flags: &PlacementFlags,
    cluster: Option<&WorkerEnv>,
    world_size: usize,
) -> anyhow::Result<usize> {
    let rank = match (flags.rank, cluster) {
        (Some(rank), _) => rank,
        (None, Some(worker)) => worker.rank,
        (None, None) => {
            bail!("--world-size is {world_size} but no rank is given: pass --rank or set RANK")
        }
    };
    if rank >= world_size {
        bail!("rank {rank} is not below the world size {world_size}");
    }
    Ok(rank)
}

/// The replicas of a replicated store that `value`, the launcher's [`STORE_REPLICAS_ENV`],
/// lists; none when it is unset or empty.
fn store_replicas(value: Option<&str>) -> anyhow::Result<Vec<SocketAddr>> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    contract::resolve_store_replicas(value)
        .map_err(|why| anyhow::anyhow!("{STORE_REPLICAS_ENV}={value:?}: {why}"))
}

/// The store's host and port from the cluster's environment. torchrun's default port fills
/// in a missing one, except under Open MPI: its ranks have no launcher to agree on a port, so
/// `mpirun` must pass one to all of them.
fn store_address(cluster: Option<&WorkerEnv>, world_size: usize) -> anyhow::Result<(String, u16)> {
    let open_mpi = cluster.is_some_and(|worker| worker.source == ClusterSource::OpenMpi);
    let Some(master_addr) = cluster.and_then(|worker| worker.master_addr.clone()) else {
        if open_mpi {
            bail!(
                "an Open MPI job across several nodes needs MASTER_ADDR, the host of rank 0 \
                 (Open MPI does not say which it is): \
                 mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 -x TANDEM_JOB_TOKEN ..."
            );
        }
        bail!("a job of {world_size} processes needs MASTER_ADDR and MASTER_PORT or --init-method tcp://HOST:PORT");
    };
    let master_port = match cluster.and_then(|worker| worker.master_port) {
        Some(port) => port,
        None if open_mpi => bail!(
            "an Open MPI job of {world_size} processes needs MASTER_PORT, a free port on rank 0's \
             host, the same for every rank: mpirun -x MASTER_PORT=29500 -x TANDEM_JOB_TOKEN ..."
        ),
        None => DEFAULT_MASTER_PORT,
    };
    Ok((master_addr, master_port))
}

/// Fails unless this host has the address `master_addr`: rank 0 of a multi-node Open MPI job
/// without `MASTER_ADDR` serves the store at mpirun's host, which the other ranks look for.
fn check_runs_on(master_addr: &str) -> anyhow::Result<()> {
    match std::net::TcpListener::bind((master_addr, 0)) {
        Ok(_) => Ok(()),
        Err(error) => bail!(
            "rank 0 of this Open MPI job runs on {}, but the other ranks look for it at {master_addr}, \
             the host of mpirun (Open MPI names no rank's host, and MASTER_ADDR is unset; binding \
             there failed: {error}): start mpirun on the node of rank 0, or pass rank 0's host \
             with mpirun -x MASTER_ADDR=<host>",
            crate::train::run_lock::host_name()
        ),
    }
}

/// Splits `tcp://HOST:PORT` (the tutorial's `--init-method`).
pub fn parse_init_method(init_method: &str) -> anyhow::Result<(String, u16)> {
    let address = init_method.strip_prefix("tcp://").with_context(|| {
        format!("--init-method must look like tcp://HOST:PORT, got '{init_method}'")
    })?;
    let (host, port) = address.rsplit_once(':').with_context(|| {
        format!("--init-method must look like tcp://HOST:PORT, got '{init_method}'")
    })?;
    let port = port
        .parse::<u16>()
        .with_context(|| format!("--init-method has a bad port '{port}'"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        bail!("--init-method has no host: '{init_method}'");
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_mpi_worker(master_addr: Option<&str>, master_port: Option<u16>) -> WorkerEnv {
        WorkerEnv {
            source: ClusterSource::OpenMpi,
            rank: 1,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: master_addr.map(str::to_string),
            master_port,
        }
    }

    #[test]
    fn rank_0_away_from_mpirun_is_told_to_move_or_name_its_host() {
        check_runs_on("127.0.0.1").expect("this host has 127.0.0.1");
        // 203.0.113.0/24 is TEST-NET-3: no host has it.
        let error = check_runs_on("203.0.113.77").unwrap_err().to_string();
        assert!(
            error.contains("but the other ranks look for it at 203.0.113.77, the host of mpirun")
                && error.ends_with("or pass rank 0's host with mpirun -x MASTER_ADDR=<host>"),
            "{error}"
        );
    }

    #[test]
    fn open_mpi_needs_a_port_and_across_nodes_a_host() {
        let across_nodes = open_mpi_worker(None, Some(6000));
        let error = store_address(Some(&across_nodes), 4)
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("an Open MPI job across several nodes needs MASTER_ADDR"),
            "{error}"
        );
        let no_port = open_mpi_worker(Some("head"), None);
        let error = store_address(Some(&no_port), 4).unwrap_err().to_string();
        assert!(
            error.starts_with("an Open MPI job of 4 processes needs MASTER_PORT"),
            "{error}"
        );
        let both = open_mpi_worker(Some("head"), Some(6000));
        assert_eq!(
            store_address(Some(&both), 4).unwrap(),
            ("head".to_string(), 6000)
        );
        let slurm = WorkerEnv {
            source: ClusterSource::Slurm,
            ..no_port
        };
        assert_eq!(
            store_address(Some(&slurm), 4).unwrap(),
            ("head".to_string(), DEFAULT_MASTER_PORT),
            "other clusters keep torchrun's default port"
        );
    }

    #[test]
    fn store_replicas_from_the_launcher() {
        let replicas = store_replicas(Some("127.0.0.1:7001,127.0.0.1:7002,localhost:7003"))
            .expect("three replicas");
        assert_eq!(
            replicas[..2],
            [
                "127.0.0.1:7001".parse().unwrap(),
                "127.0.0.1:7002".parse().unwrap()
            ]
        );
        assert_eq!(replicas[2].port(), 7003);
        let error = store_replicas(Some("127.0.0.1:7001,node1"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "TANDEM_STORE_REPLICAS=\"127.0.0.1:7001,node1\": entry \"node1\" is not HOST:PORT \
             (a host name or IP address, a colon and a port below 65536, e.g. node0:29500 or \
             [fd00::1]:29500)"
        );
        assert!(store_replicas(None).unwrap().is_empty());
        assert!(store_replicas(Some("")).unwrap().is_empty());
    }

    #[test]
    fn init_method_forms() {
        assert_eq!(
            parse_init_method("tcp://10.0.0.1:6060").unwrap(),
            ("10.0.0.1".to_string(), 6060)
        );
        assert_eq!(
            parse_init_method("tcp://[::1]:80").unwrap(),
            ("::1".to_string(), 80)
        );
        let error = parse_init_method("env://").unwrap_err().to_string();
        assert!(error.contains("tcp://HOST:PORT"), "{error}");
        let error = parse_init_method("tcp://host:99999")
            .unwrap_err()
            .to_string();
        assert!(error.contains("bad port"), "{error}");
    }
}
