//! Every cluster environment, from maps of variables.

use super::*;

fn vars(pairs: &[(&str, &str)]) -> EnvMap {
    pairs
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

/// `env` with `name` set to `value`.
fn with(env: &EnvMap, name: &str, value: &str) -> EnvMap {
    let mut changed = env.clone();
    changed.insert(name.into(), value.into());
    changed
}

/// The worker `env` describes, which must be valid and detected.
fn worker(env: &EnvMap) -> WorkerEnv {
    worker_env(env).expect("valid").expect("detected")
}

/// The node `env` describes, which must be valid and detected.
fn node(env: &EnvMap) -> NodeEnv {
    node_env(env).expect("valid").expect("detected")
}

/// A worker's ranks and sizes: rank, world size, local rank, local world size.
fn ranks(worker: &WorkerEnv) -> (usize, usize, usize, usize) {
    (
        worker.rank,
        worker.world_size,
        worker.local_rank,
        worker.local_world_size,
    )
}

/// Which reading of the environment a refusal comes from.
#[derive(Clone, Copy)]
enum Reading {
    Worker,
    Node,
}

/// Asserts that reading `env` as `reading` is refused with `message`.
fn assert_refused(env: &EnvMap, reading: Reading, message: &str) {
    let error = match reading {
        Reading::Worker => worker_env(env).map(|_| ()).expect_err(message),
        Reading::Node => node_env(env).map(|_| ()).expect_err(message),
    };
    assert_eq!(error.to_string(), message);
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
        worker(&env),
        WorkerEnv {
            source: ClusterSource::Torchrun,
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29500),
        }
    );
    assert_eq!(
        node(&env),
        NodeEnv {
            source: ClusterSource::Torchrun,
            nnodes: 2,
            node_rank: 1,
            nproc_per_node: Some(4),
            master_addr: "10.0.0.1".into(),
            master_port: Some(29500),
        }
    );
}

#[test]
fn modelarts_as_in_the_tutorial_launch_script() {
    let hosts = "job-worker-0.svc,job-worker-1.svc,job-worker-2.svc";
    let env = vars(&[
        ("VC_WORKER_HOSTS", hosts),
        ("MA_NUM_HOSTS", "3"),
        ("VC_TASK_INDEX", "2"),
        ("MA_NUM_GPUS", "8"),
    ]);
    assert_eq!(detect_source(&env), Some(ClusterSource::ModelArts));
    assert_eq!(
        node(&env),
        NodeEnv {
            source: ClusterSource::ModelArts,
            nnodes: 3,
            node_rank: 2,
            nproc_per_node: Some(8),
            master_addr: "job-worker-0.svc".into(),
            master_port: None,
        }
    );
    assert_eq!(ranks(&worker(&env)), (2, 3, 0, 1));

    let cpu = vars(&[
        ("VC_WORKER_HOSTS", "a"),
        ("MA_NUM_HOSTS", "1"),
        ("VC_TASK_INDEX", "0"),
        ("MA_NUM_GPUS", "0"),
    ]);
    assert_eq!(node(&cpu).nproc_per_node, None);
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
        worker(&env),
        WorkerEnv {
            source: ClusterSource::Slurm,
            rank: 9,
            world_size: 10,
            local_rank: 0,
            local_world_size: 2,
            master_addr: Some("node01".into()),
            master_port: Some(6000),
        }
    );
    assert_eq!(
        node(&env),
        NodeEnv {
            source: ClusterSource::Slurm,
            nnodes: 5,
            node_rank: 4,
            nproc_per_node: None,
            master_addr: "node01".into(),
            master_port: Some(6000),
        }
    );
}

/// Seven Slurm tasks on three nodes, three, three and one: this is the last.
fn uneven_slurm_tasks() -> EnvMap {
    vars(&[
        ("SLURM_NODELIST", "n[1-3]"),
        ("SLURM_NNODES", "3"),
        ("SLURM_NODEID", "2"),
        ("SLURM_PROCID", "6"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_TASKS_PER_NODE", "3(x2),1"),
    ])
}

#[test]
fn slurm_uneven_tasks_per_node() {
    let worker = worker(&uneven_slurm_tasks());
    assert_eq!(
        (worker.local_world_size, worker.master_addr.as_deref()),
        (1, Some("n1"))
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
    assert_eq!(worker(&one_per_node).local_world_size, 1);
    let node = node(&one_per_node);
    assert_eq!((node.nnodes, node.node_rank), (2, 1));
    // `srun -n 2 tandem launch` on one node: two launchers would each be node 0.
    assert_eq!(
        worker(&two_slurm_tasks_on_one_node()).local_world_size,
        2,
        "the workers themselves may be srun's tasks"
    );
}

/// `srun -n 2` on one node.
fn two_slurm_tasks_on_one_node() -> EnvMap {
    vars(&[
        ("SLURM_JOB_NODELIST", "n1"),
        ("SLURM_NNODES", "1"),
        ("SLURM_NODEID", "0"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2"),
    ])
}

/// Open MPI's variables of rank `rank` of `size`, `local_size` of them on this node.
fn open_mpi(rank: &str, size: &str, local_rank: &str, local_size: &str) -> EnvMap {
    vars(&[
        ("OMPI_COMM_WORLD_RANK", rank),
        ("OMPI_COMM_WORLD_SIZE", size),
        ("OMPI_COMM_WORLD_LOCAL_RANK", local_rank),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", local_size),
    ])
}

/// Rank 3 of 4, two a node, under Slurm variables that must not win.
fn open_mpi_two_per_node() -> EnvMap {
    with(&open_mpi("3", "4", "1", "2"), "SLURM_PROCID", "0")
}

#[test]
fn open_mpi_worker_and_one_launcher_per_node() {
    let env = open_mpi_two_per_node();
    assert_eq!(detect_source(&env), Some(ClusterSource::OpenMpi));
    assert_eq!(
        worker(&env),
        WorkerEnv {
            source: ClusterSource::OpenMpi,
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: None,
            master_port: None,
        }
    );
    let one_node = with(&open_mpi("1", "2", "1", "2"), "MASTER_PORT", "29600");
    let worker_here = worker(&one_node);
    assert_eq!(
        (worker_here.master_addr.as_deref(), worker_here.master_port),
        (Some("127.0.0.1"), Some(29600)),
        "every rank on this node: rank 0 is here too"
    );
    let across_nodes = with(
        &open_mpi("1", "4", "1", "2"),
        "OMPI_MCA_orte_hnp_uri",
        "1092026368.0;tcp://10.1.2.3,192.168.7.1:54725;tcp6://[fd00::2]:58939",
    );
    assert_eq!(
        worker(&across_nodes).master_addr.as_deref(),
        Some("10.1.2.3"),
        "across nodes without MASTER_ADDR: mpirun's host"
    );
    let across_named = with(&across_nodes, "MASTER_ADDR", "node7");
    assert_eq!(
        worker(&across_named).master_addr.as_deref(),
        Some("node7"),
        "MASTER_ADDR wins"
    );
    assert_eq!(open_mpi_hnp_host("1.0;tcp6://[fd00::2]:5"), None);
    let named = with(&one_node, "MASTER_ADDR", "head");
    assert_eq!(worker(&named).master_addr.as_deref(), Some("head"));
    let per_node = with(&open_mpi("1", "2", "0", "1"), "MASTER_ADDR", "head");
    let node = node(&per_node);
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

/// A Kubeflow PyTorchJob's pod 2 of 3.
fn kubeflow_pod() -> EnvMap {
    vars(&[
        ("MASTER_ADDR", "job-master-0"),
        ("MASTER_PORT", "23456"),
        ("WORLD_SIZE", "3"),
        ("RANK", "2"),
    ])
}

#[test]
fn kubeflow_counts_pods_and_prefers_pet_variables() {
    let env = kubeflow_pod();
    assert_eq!(detect_source(&env), Some(ClusterSource::Kubeflow));
    assert_eq!(
        node(&env),
        NodeEnv {
            source: ClusterSource::Kubeflow,
            nnodes: 3,
            node_rank: 2,
            nproc_per_node: None,
            master_addr: "job-master-0".into(),
            master_port: Some(23456),
        }
    );
    assert_eq!(ranks(&worker(&env)), (2, 3, 0, 1));

    let elastic = vars(&[
        ("MASTER_ADDR", "job-master-0"),
        ("MASTER_PORT", "23456"),
        ("WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("PET_NNODES", "2"),
        ("PET_NODE_RANK", "1"),
        ("PET_NPROC_PER_NODE", "4"),
    ]);
    let node_of_four = node(&elastic);
    assert_eq!(
        (
            node_of_four.nnodes,
            node_of_four.node_rank,
            node_of_four.nproc_per_node
        ),
        (2, 1, Some(4))
    );
    let auto = with(&elastic, "PET_NPROC_PER_NODE", "auto");
    assert_eq!(node(&auto).nproc_per_node, None);
}

#[test]
fn no_cluster_is_none() {
    assert_eq!(detect_source(&vars(&[("HOME", "/root")])), None);
    assert_eq!(node_env(&vars(&[])).expect("no cluster"), None);
    assert_eq!(worker_env(&vars(&[])).expect("no cluster"), None);
}

/// Four torchrun workers on one node, with a rank past the world.
fn torchrun_rank_too_large() -> EnvMap {
    vars(&[
        ("RANK", "4"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
    ])
}

/// Every refusal names the environment, the variable and its value.
#[test]
fn a_bad_environment_is_refused_naming_the_variable() {
    let slurm = uneven_slurm_tasks();
    let cases = [
        (
            vars(&[
                ("VC_WORKER_HOSTS", "a,b"),
                ("MA_NUM_HOSTS", "2"),
                ("VC_TASK_INDEX", "2"),
            ]),
            Reading::Node,
            "modelarts environment: VC_TASK_INDEX=\"2\": is not below the number of nodes, 2",
        ),
        (
            vars(&[("VC_WORKER_HOSTS", "a,b"), ("VC_TASK_INDEX", "0")]),
            Reading::Node,
            "modelarts environment: MA_NUM_HOSTS=\"\": is not set",
        ),
        (
            with(&slurm, "SLURM_NODELIST", "n[1-3"),
            Reading::Worker,
            "slurm environment: SLURM_NODELIST=\"n[1-3\": unclosed '[' in \"n[1-3\"",
        ),
        (
            with(&slurm, "SLURM_PROCID", "seven"),
            Reading::Worker,
            "slurm environment: SLURM_PROCID=\"seven\": is not a non-negative integer",
        ),
        (
            with(&slurm, "SLURM_TASKS_PER_NODE", "3(y2)"),
            Reading::Worker,
            "slurm environment: SLURM_TASKS_PER_NODE=\"3(y2)\": is not a list of task counts like \"2(x3),1\"",
        ),
        (
            two_slurm_tasks_on_one_node(),
            Reading::Node,
            "slurm environment: SLURM_STEP_TASKS_PER_NODE=\"2\": srun started 2 tasks on this node, \
             and each would run its own `tandem launch` of the node's workers: start one launcher \
             per node (srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 tandem launch \
             --nproc-per-node N ...), or let srun start the workers without `tandem launch` \
             (srun --ntasks-per-node=N tandem train ...)",
        ),
        (
            open_mpi_two_per_node(),
            Reading::Node,
            "openmpi environment: OMPI_COMM_WORLD_LOCAL_SIZE=\"2\": must be 1: start one launcher per node (mpirun --npernode 1)",
        ),
        (
            with(&kubeflow_pod(), "MASTER_PORT", "70000"),
            Reading::Node,
            "kubeflow environment: MASTER_PORT=\"70000\": is not a port number (1-65535)",
        ),
        (
            torchrun_rank_too_large(),
            Reading::Worker,
            "torchrun environment: RANK=\"4\": is not below the world size, 4",
        ),
        (
            with(&torchrun_rank_too_large(), "WORLD_SIZE", "0"),
            Reading::Worker,
            "torchrun environment: WORLD_SIZE=\"0\": must be at least 1",
        ),
    ];
    for (env, reading, message) in cases {
        assert_refused(&env, reading, message);
    }
}
