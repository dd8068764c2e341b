//! Where this worker stands in its job: rank, world size and the rendezvous address, from
//! the tutorial's flags, torchrun's variables, or a cluster's own.

use anyhow::{bail, Context};
use tandem_dist::cluster::contract::{
    self, DEFAULT_MASTER_PORT, RESTART_COUNT_ENV, STORE_HOSTED_ENV, STORE_PREFIX_ENV,
};

use crate::settings::PlacementFlags;
use crate::train::ddp::WorkerPlacement;

/// The worker's place in the job, or `None` for a job of one process.
pub fn find_placement(flags: &PlacementFlags) -> anyhow::Result<Option<WorkerPlacement>> {
    let env = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    let cluster = tandem_dist::cluster::WorkerEnv::from_env()
        .context("cannot read this worker's place in the job from the environment")?;
    let world_size = match flags.world_size {
        Some(world_size) => world_size,
        None => cluster.as_ref().map_or(1, |worker| worker.world_size),
    };
    if world_size <= 1 {
        return Ok(None);
    }
    let rank = match (flags.rank, &cluster) {
        (Some(rank), _) => rank,
        (None, Some(worker)) => worker.rank,
        (None, None) => {
            bail!("--world-size is {world_size} but no rank is given: pass --rank or set RANK")
        }
    };
    if rank >= world_size {
        bail!("rank {rank} is not below the world size {world_size}");
    }
    let (master_addr, master_port) = match &flags.init_method {
        Some(init_method) => parse_init_method(init_method)?,
        None => match cluster.as_ref().and_then(|worker| worker.master_addr.clone()) {
            Some(master_addr) => (
                master_addr,
                cluster
                    .as_ref()
                    .and_then(|worker| worker.master_port)
                    .unwrap_or(DEFAULT_MASTER_PORT),
            ),
            None => bail!("a job of {world_size} processes needs MASTER_ADDR and MASTER_PORT or --init-method tcp://HOST:PORT"),
        },
    };
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
        key_prefix,
    }))
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
