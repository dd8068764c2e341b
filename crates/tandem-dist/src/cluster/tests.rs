//! Every cluster environment, from maps of variables.

use super::*;

fn vars(pairs: &[(&str, &str)]) -> EnvMap {
    pairs
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

#[test]
fn torchrun_worker_and_node() {
    let env = vars(&[
        ("RANK", "5"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        // Slurm variables underneath torchrun must not win.
        ("SLURM_PROCID", "0"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::Torchrun));
    assert_eq!(
        worker_env(&env).expect("valid"),
        Some(WorkerEnv {
            source: ClusterSource::Torchrun,
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29500),
        })
    );
    assert_eq!(
        node_env(&env).expect("valid"),
        Some(NodeEnv {
            source: ClusterSource::Torchrun,
            nnodes: 2,
            node_rank: 1,
            nproc_per_node: Some(4),
            master_addr: "10.0.0.1".into(),
            master_port: Some(29500),
        })
    );
}

#[test]
fn modelarts_as_in_the_tutorial_launch_script() {
    let env = vars(&[
        (
            "VC_WORKER_HOSTS",
            "job-worker-0.svc,job-worker-1.svc,job-worker-2.svc",
        ),
        ("MA_NUM_HOSTS", "3"),
        ("VC_TASK_INDEX", "2"),
        ("MA_NUM_GPUS", "8"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::ModelArts));
    let node = node_env(&env).expect("valid").expect("detected");
    assert_eq!(
        node,
        NodeEnv {
            source: ClusterSource::ModelArts,
            nnodes: 3,
            node_rank: 2,
            nproc_per_node: Some(8),
            master_addr: "job-worker-0.svc".into(),
            master_port: None,
        }
    );
    let worker = worker_env(&env).expect("valid").expect("detected");
    assert_eq!(
        (
            worker.rank,
            worker.world_size,
            worker.local_rank,
            worker.local_world_size
        ),
        (2, 3, 0, 1)
    );

    let cpu = vars(&[
        ("VC_WORKER_HOSTS", "a"),
        ("MA_NUM_HOSTS", "1"),
        ("VC_TASK_INDEX", "0"),
        ("MA_NUM_GPUS", "0"),
    ]);
    assert_eq!(
        node_env(&cpu)
            .expect("valid")
            .expect("detected")
            .nproc_per_node,
        None
    );

    let bad_index = vars(&[
        ("VC_WORKER_HOSTS", "a,b"),
        ("MA_NUM_HOSTS", "2"),
        ("VC_TASK_INDEX", "2"),
    ]);
    assert_eq!(
        node_env(&bad_index)
            .expect_err("index out of range")
            .to_string(),
        "modelarts environment: VC_TASK_INDEX=\"2\": is not below the number of nodes, 2"
    );
    let missing = vars(&[("VC_WORKER_HOSTS", "a,b"), ("VC_TASK_INDEX", "0")]);
    assert_eq!(
        node_env(&missing).expect_err("missing").to_string(),
        "modelarts environment: MA_NUM_HOSTS=\"\": is not set"
    );
}

#[test]
fn slurm_worker_and_node_with_a_compressed_node_list() {
    let env = vars(&[
        ("SLURM_JOB_NODELIST", "node[01-03,7],gpu5"),
        ("SLURM_NNODES", "5"),
        ("SLURM_NODEID", "4"),
        ("SLURM_PROCID", "9"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NTASKS", "10"),
        ("SLURM_NTASKS_PER_NODE", "2(x4),2"),
        ("MASTER_PORT", "6000"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::Slurm));
    assert_eq!(
        worker_env(&env).expect("valid"),
        Some(WorkerEnv {
            source: ClusterSource::Slurm,
            rank: 9,
            world_size: 10,
            local_rank: 0,
            local_world_size: 2,
            master_addr: Some("node01".into()),
            master_port: Some(6000),
        })
    );
    assert_eq!(
        node_env(&env).expect("valid"),
        Some(NodeEnv {
            source: ClusterSource::Slurm,
            nnodes: 5,
            node_rank: 4,
            nproc_per_node: None,
            master_addr: "node01".into(),
            master_port: Some(6000),
        })
    );
}

#[test]
fn slurm_uneven_tasks_per_node_and_errors() {
    let env = vars(&[
        ("SLURM_NODELIST", "n[1-3]"),
        ("SLURM_NNODES", "3"),
        ("SLURM_NODEID", "2"),
        ("SLURM_PROCID", "6"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_TASKS_PER_NODE", "3(x2),1"),
    ]);
    let worker = worker_env(&env).expect("valid").expect("detected");
    assert_eq!(
        (worker.local_world_size, worker.master_addr.as_deref()),
        (1, Some("n1"))
    );

    let mut bad_list = env.clone();
    bad_list.insert("SLURM_NODELIST".into(), "n[1-3".into());
    assert_eq!(
        worker_env(&bad_list).expect_err("bad list").to_string(),
        "slurm environment: SLURM_NODELIST=\"n[1-3\": unclosed '[' in \"n[1-3\""
    );
    let mut bad_rank = env.clone();
    bad_rank.insert("SLURM_PROCID".into(), "seven".into());
    assert_eq!(
        worker_env(&bad_rank).expect_err("bad rank").to_string(),
        "slurm environment: SLURM_PROCID=\"seven\": is not a non-negative integer"
    );
    let mut bad_counts = env;
    bad_counts.insert("SLURM_TASKS_PER_NODE".into(), "3(y2)".into());
    assert_eq!(
        worker_env(&bad_counts).expect_err("bad counts").to_string(),
        "slurm environment: SLURM_TASKS_PER_NODE=\"3(y2)\": is not a list of task counts like \"2(x3),1\""
    );
}

#[test]
fn slurm_step_counts_win_and_one_launcher_runs_per_node() {
    // `srun --ntasks=2 --ntasks-per-node=1` inside `sbatch --ntasks-per-node=2`: the step's
    // count is the workers' (and the launchers') count, not the job's.
    let one_per_node = vars(&[
        ("SLURM_JOB_NODELIST", "n[1-2]"),
        ("SLURM_NNODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_NTASKS_PER_NODE", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
    ]);
    assert_eq!(
        worker_env(&one_per_node)
            .expect("valid")
            .map(|worker| worker.local_world_size),
        Some(1)
    );
    assert_eq!(
        node_env(&one_per_node)
            .expect("valid")
            .map(|node| (node.nnodes, node.node_rank)),
        Some((2, 1))
    );
    // `srun -n 2 tandem launch` on one node: two launchers would each be node 0.
    let two_per_node = vars(&[
        ("SLURM_JOB_NODELIST", "n1"),
        ("SLURM_NNODES", "1"),
        ("SLURM_NODEID", "0"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2"),
    ]);
    assert_eq!(
        worker_env(&two_per_node)
            .expect("valid")
            .map(|worker| worker.local_world_size),
        Some(2),
        "the workers themselves may be srun's tasks"
    );
    assert_eq!(
        node_env(&two_per_node)
            .expect_err("two launchers")
            .to_string(),
        "slurm environment: SLURM_STEP_TASKS_PER_NODE=\"2\": srun started 2 tasks on this node, \
         and each would run its own `tandem launch` of the node's workers: start one launcher \
         per node (srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 tandem launch \
         --nproc-per-node N ...), or let srun start the workers without `tandem launch` \
         (srun --ntasks-per-node=N tandem train ...)"
    );
}

#[test]
fn open_mpi_worker_and_one_launcher_per_node() {
    let env = vars(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("SLURM_PROCID", "0"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::OpenMpi));
    assert_eq!(
        worker_env(&env).expect("valid"),
        Some(WorkerEnv {
            source: ClusterSource::OpenMpi,
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: None,
            master_port: None,
        })
    );
    assert_eq!(
        node_env(&env).expect_err("two per node").to_string(),
        "openmpi environment: OMPI_COMM_WORLD_LOCAL_SIZE=\"2\": must be 1: start one launcher per node (mpirun --npernode 1)"
    );
    let one_node = vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_PORT", "29600"),
    ]);
    let worker = worker_env(&one_node).expect("valid").expect("detected");
    assert_eq!(
        (worker.master_addr.as_deref(), worker.master_port),
        (Some("127.0.0.1"), Some(29600)),
        "every rank on this node: rank 0 is here too"
    );
    let mut across_nodes = vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        (
            "OMPI_MCA_orte_hnp_uri",
            "1092026368.0;tcp://10.1.2.3,192.168.7.1:54725;tcp6://[fd00::2]:58939",
        ),
    ]);
    assert_eq!(
        worker_env(&across_nodes)
            .expect("valid")
            .expect("detected")
            .master_addr
            .as_deref(),
        Some("10.1.2.3"),
        "across nodes without MASTER_ADDR: mpirun's host"
    );
    across_nodes.insert("MASTER_ADDR".into(), "node7".into());
    assert_eq!(
        worker_env(&across_nodes)
            .expect("valid")
            .expect("detected")
            .master_addr
            .as_deref(),
        Some("node7"),
        "MASTER_ADDR wins"
    );
    assert_eq!(open_mpi_hnp_host("1.0;tcp6://[fd00::2]:5"), None);
    let mut named = one_node.clone();
    named.insert("MASTER_ADDR".into(), "head".into());
    assert_eq!(
        worker_env(&named)
            .expect("valid")
            .expect("detected")
            .master_addr
            .as_deref(),
        Some("head")
    );
    let per_node = vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ("MASTER_ADDR", "head"),
    ]);
    let node = node_env(&per_node).expect("valid").expect("detected");
    assert_eq!(
        (
            node.nnodes,
            node.node_rank,
            node.master_addr.as_str(),
            node.master_port
        ),
        (2, 1, "head", None)
    );
}

#[test]
fn kubeflow_counts_pods_and_prefers_pet_variables() {
    let env = vars(&[
        ("MASTER_ADDR", "job-master-0"),
        ("MASTER_PORT", "23456"),
        ("WORLD_SIZE", "3"),
        ("RANK", "2"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::Kubeflow));
    assert_eq!(
        node_env(&env).expect("valid"),
        Some(NodeEnv {
            source: ClusterSource::Kubeflow,
            nnodes: 3,
            node_rank: 2,
            nproc_per_node: None,
            master_addr: "job-master-0".into(),
            master_port: Some(23456),
        })
    );
    let worker = worker_env(&env).expect("valid").expect("detected");
    assert_eq!(
        (
            worker.rank,
            worker.world_size,
            worker.local_rank,
            worker.local_world_size
        ),
        (2, 3, 0, 1)
    );

    let elastic = vars(&[
        ("MASTER_ADDR", "job-master-0"),
        ("MASTER_PORT", "23456"),
        ("WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("PET_NNODES", "2"),
        ("PET_NODE_RANK", "1"),
        ("PET_NPROC_PER_NODE", "4"),
    ]);
    let node = node_env(&elastic).expect("valid").expect("detected");
    assert_eq!(
        (node.nnodes, node.node_rank, node.nproc_per_node),
        (2, 1, Some(4))
    );
    let mut auto = elastic.clone();
    auto.insert("PET_NPROC_PER_NODE".into(), "auto".into());
    assert_eq!(
        node_env(&auto)
            .expect("valid")
            .expect("detected")
            .nproc_per_node,
        None
    );

    let mut bad_port = env;
    bad_port.insert("MASTER_PORT".into(), "70000".into());
    assert_eq!(
        node_env(&bad_port).expect_err("bad port").to_string(),
        "kubeflow environment: MASTER_PORT=\"70000\": is not a port number (1-65535)"
    );
}

#[test]
fn no_cluster_is_none_and_inconsistent_ranks_are_errors() {
    assert_eq!(detect_source(&vars(&[("HOME", "/root")])), None);
    assert_eq!(node_env(&vars(&[])).expect("no cluster"), None);
    assert_eq!(worker_env(&vars(&[])).expect("no cluster"), None);
    let env = vars(&[
        ("RANK", "4"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
    ]);
    assert_eq!(
        worker_env(&env).expect_err("rank too large").to_string(),
        "torchrun environment: RANK=\"4\": is not below the world size, 4"
    );
    let mut zero_world = env;
    zero_world.insert("WORLD_SIZE".into(), "0".into());
    assert_eq!(
        worker_env(&zero_world)
            .expect_err("empty world")
            .to_string(),
        "torchrun environment: WORLD_SIZE=\"0\": must be at least 1"
    );
}
