//! `--backend` and `launch --nproc-per-node gpu` through the real binary, on a machine
//! without a GPU (as in CI): the backend line of CPU ranks, `nccl` refused with the reason,
//! and `gpu` workers refused with the reason when no GPU is visible.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{assert_contains, expect_success, run_bounded, standalone_launch, tandem, BENCH_STEP};

const LIMIT: Duration = Duration::from_secs(120);

/// `tandem launch` of two CPU workers running a one-step benchmark of the small model.
fn launch_bench(log_dir: &Path, backend: &str) -> Output {
    run_bounded(
        tandem()
            .args(standalone_launch("2"))
            .arg("--log-dir")
            .arg(log_dir)
            .arg("--")
            .args(BENCH_STEP)
            .args(["--batch", "2"])
            .args(["--steps", "1", "--threads", "1", "--device", "cpu"])
            .args(["--backend", backend]),
        LIMIT,
    )
}

fn rank_log(log_dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(log_dir.join(format!("logs/rank_{rank}.log"))).unwrap_or_default()
}

#[test]
fn cpu_ranks_announce_the_ring_after_the_device() {
    let logs = tempfile::tempdir().unwrap();
    let stdout = expect_success(&launch_bench(logs.path(), "auto"));
    assert_contains(&stdout, "train: ");
    for rank in 0..2 {
        let log = rank_log(logs.path(), rank);
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| !line.starts_with("====="))
            .collect();
        assert_eq!(
            lines.get(..2),
            Some(&["device: cpu (requested)", "backend: ring (cpu ranks)"][..]),
            "rank {rank}:\n{log}"
        );
    }
}

#[test]
fn nccl_on_cpu_ranks_is_refused_on_every_rank_with_the_reason() {
    let logs = tempfile::tempdir().unwrap();
    let output = launch_bench(logs.path(), "nccl");
    assert!(!output.status.success());
    let expected = "--backend nccl: every rank is on the CPU, and NCCL needs a GPU for each rank \
                    (use --backend ring or auto)";
    for rank in 0..2 {
        let log = rank_log(logs.path(), rank);
        assert!(log.contains(expected), "rank {rank}:\n{log}");
        assert!(!log.contains("panicked"), "rank {rank}:\n{log}");
        assert!(!log.contains("train: "), "rank {rank}:\n{log}");
    }
}

#[test]
fn ranks_started_by_hand_all_report_the_refusal_though_rank_0_serves_the_store() {
    let port = common::free_port();
    // As torchrun starts them: rank 0 serves the store and leaves right after deciding.
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            tandem()
                .args(["bench", "step", "--model", "resnet-base", "--batch", "2"])
                .args(["--steps", "1", "--threads", "1", "--device", "cpu"])
                .args(["--backend", "nccl"])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TANDEM_JOB_TOKEN", "backend-e2e-token")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("cannot start tandem")
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = common::wait_bounded(child, LIMIT);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "rank {rank}");
        // Other ranks' errors carry their rank.
        let prefix = match rank {
            0 => String::new(),
            _ => format!("[rank {rank}] "),
        };
        assert!(
            stderr.starts_with(&format!(
                "{prefix}error: --backend nccl: every rank is on the CPU"
            )),
            "rank {rank}: {stderr}"
        );
        assert!(!stderr.contains("store"), "rank {rank}: {stderr}");
    }
}

#[test]
fn a_job_of_one_process_refuses_nccl_on_the_cpu_and_ignores_ring() {
    let bench = |backend: &str| {
        run_bounded(
            tandem()
                .args(["bench", "step", "--model", "resnet-base", "--batch", "2"])
                .args(["--steps", "1", "--threads", "1", "--device", "cpu"])
                .args(["--backend", backend]),
            LIMIT,
        )
    };
    let output = bench("nccl");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.starts_with("error: --backend nccl: every rank is on the CPU"),
        "{stderr}"
    );
    let stdout = expect_success(&bench("ring"));
    assert!(!stdout.contains("backend:"), "{stdout}");
}

#[test]
fn nproc_per_node_gpu_without_a_visible_gpu_is_a_clear_error() {
    let empty = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let launch = |hide_gpus: bool| {
        let mut command = tandem();
        command
            .args(standalone_launch("gpu"))
            .arg("--log-dir")
            .arg(logs.path())
            .args(["--", "true"])
            .env("TANDEM_CUDA_LIBRARY_PATH", empty.path());
        match hide_gpus {
            true => command.env("CUDA_VISIBLE_DEVICES", ""),
            false => command.env_remove("CUDA_VISIBLE_DEVICES"),
        };
        run_bounded(&mut command, LIMIT)
    };
    // No device listed: refused on any machine, before a worker starts.
    let output = launch(true);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains(
            "--nproc-per-node gpu: no GPU visible (CUDA_VISIBLE_DEVICES is set and lists no \
             device); use a number or auto"
        ),
        "{stderr}"
    );
    assert!(!logs.path().join("logs").exists(), "a worker was started");
    // Every GPU the machine has: on a machine without the driver, the probe's reason.
    let output = launch(false);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.success() {
        eprintln!("a GPU is visible here: `--nproc-per-node gpu` started its workers");
        return;
    }
    assert!(
        stderr.contains("--nproc-per-node gpu: no GPU visible ("),
        "{stderr}"
    );
    assert!(stderr.contains("); use a number or auto"), "{stderr}");
    if stderr.contains("libcuda not found") {
        let folder = format!("TANDEM_CUDA_LIBRARY_PATH={}", empty.path().display());
        assert_contains(&stderr, &folder);
    }
}
