//! The cluster's view of this node, from tandem-dist's environment parsers, used when the
//! flags do not say it.

use std::collections::HashMap;

use anyhow::Context;

/// What a cluster environment says about this node; `None` fields are left to the flags or
/// the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    /// Number of nodes.
    pub nnodes: usize,
    /// This node's rank.
    pub node_rank: usize,
    /// Workers per node, when the cluster says.
    pub nproc_per_node: Option<usize>,
    /// Host of node 0, when the cluster says.
    pub master_addr: Option<String>,
    /// Port of the store, when the cluster says.
    pub master_port: Option<u16>,
    /// The environment's name, e.g. "slurm".
    pub source: String,
}

/// The cluster environment found in `env`, if any.
pub fn detect(env: &HashMap<String, String>) -> anyhow::Result<Option<ClusterNode>> {
    let node = tandem_dist::cluster::node_env(env).context("read the cluster environment")?;
    Ok(node.map(|node| ClusterNode {
        nnodes: node.nnodes,
        node_rank: node.node_rank,
        nproc_per_node: node.nproc_per_node,
        master_addr: Some(node.master_addr),
        master_port: node.master_port,
        source: node.source.name().to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn modelarts_gives_the_first_host_as_master() {
        let vars = env(&[
            ("VC_WORKER_HOSTS", "job-worker-0.svc,job-worker-1.svc"),
            ("MA_NUM_HOSTS", "2"),
            ("VC_TASK_INDEX", "1"),
            ("MA_NUM_GPUS", "8"),
        ]);
        let node = detect(&vars).unwrap().unwrap();
        assert_eq!(
            node,
            ClusterNode {
                nnodes: 2,
                node_rank: 1,
                nproc_per_node: Some(8),
                master_addr: Some("job-worker-0.svc".into()),
                master_port: None,
                source: "modelarts".into(),
            }
        );
    }

    #[test]
    fn no_cluster_means_no_values_and_bad_values_are_named() {
        assert_eq!(detect(&env(&[("HOME", "/root")])).unwrap(), None);
        let bad = env(&[
            ("VC_WORKER_HOSTS", "a,b"),
            ("MA_NUM_HOSTS", "two"),
            ("VC_TASK_INDEX", "0"),
        ]);
        let message = format!("{:#}", detect(&bad).unwrap_err());
        assert!(message.contains("MA_NUM_HOSTS=\"two\""), "{message}");
    }
}
