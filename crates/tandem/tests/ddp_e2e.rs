//! Data parallelism through the real binary: W processes under `tandem launch` with per-rank
//! batch B end with the weights of one process with batch W·B on the same data order.
//!
//! The sampler gives rank r every W-th index of the shared permutation, so the W per-rank
//! batches of a step are together exactly the single process's batch of that step; with
//! SyncBatchNorm the batch statistics are the global batch's too, and the two runs differ
//! only by the order of float additions.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);
/// Agreement expected between the runs: float rounding, compounded over a few steps.
const TOLERANCE: f64 = 1e-4;

fn run_args(
    output_dir: &Path,
    optimizer: &[&str],
    samples: usize,
    batch: usize,
    extra: &[&str],
) -> Vec<String> {
    let mut args = small_model_train(&format!(
        "--data synthetic --synthetic-train {samples} --synthetic-test 64 --epochs 1 \
         --batch-size {batch} --threads 1 --seed 3"
    ));
    args.extend(optimizer.iter().chain(extra).map(|arg| arg.to_string()));
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    args
}

fn launch(nproc: usize, train_args: &[String]) {
    let mut args = vec![
        "launch".to_string(),
        "--standalone".to_string(),
        "--nproc-per-node".to_string(),
        nproc.to_string(),
        "--max-restarts".to_string(),
        "0".to_string(),
        "--".to_string(),
    ];
    args.extend_from_slice(train_args);
    tandem_succeeds(&args, LIMIT);
}

fn single(train_args: &[String]) {
    tandem_succeeds(train_args, LIMIT);
}

/// Runs W processes and one process, and returns the worst error per tensor family.
fn compare(
    world: usize,
    optimizer: &[&str],
    samples: usize,
    batch: usize,
    extra: &[&str],
    skip: fn(&str) -> bool,
) -> std::collections::BTreeMap<String, f64> {
    let dir = tempfile::tempdir().unwrap();
    let parallel = dir.path().join("parallel");
    let mut parallel_extra = vec!["--sync-bn"];
    parallel_extra.extend_from_slice(extra);
    launch(
        world,
        &run_args(&parallel, optimizer, samples, batch, &parallel_extra),
    );
    let alone = dir.path().join("alone");
    single(&run_args(&alone, optimizer, samples, world * batch, extra));
    let expected = read_tensors(&alone.join("epoch_1.safetensors"));
    let actual = read_tensors(&parallel.join("epoch_1.safetensors"));
    worst_error_per_family(&expected, &actual, skip)
}

fn assert_within(worst: &std::collections::BTreeMap<String, f64>) {
    for (family, error) in worst {
        assert!(
            *error < TOLERANCE,
            "{family}: relative error {error} (worst per family: {worst:?})"
        );
    }
}

const SGD: &[&str] = &["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"];
const ADAM: &[&str] = &["--optimizer", "adam", "--lr", "0.002"];

#[test]
fn two_processes_with_sgd_equal_one_with_twice_the_batch() {
    assert_within(&compare(2, SGD, 128, 16, &[], |_| false));
}

#[test]
fn three_processes_with_sgd_equal_one_with_three_times_the_batch() {
    assert_within(&compare(3, SGD, 144, 16, &[], |_| false));
}

/// A convolution followed by batch norm has a bias whose true gradient is zero: what is
/// left is rounding noise, which Adam divides by its own magnitude, so those biases (and the
/// BN running means they shift) differ between any two summation orders. Batch norm cancels
/// them in the forward pass; every other tensor is compared.
fn is_noise_under_adam(name: &str) -> bool {
    (name.ends_with(".bias") && name.contains("conv")) || name.ends_with(".running_mean")
}

#[test]
fn two_processes_with_adam_equal_one_with_twice_the_batch() {
    let worst = compare(2, ADAM, 128, 16, &[], is_noise_under_adam);
    assert_within(&worst);
}

#[test]
fn gradient_accumulation_matches_the_larger_batch() {
    // 2 processes x 2 micro-batches of 12 against 1 process x 2 micro-batches of 24: each
    // pair of per-rank micro-batches is the single process's micro-batch.
    assert_within(&compare(2, SGD, 144, 12, &["--grad-accum", "2"], |_| false));
}

/// Ranks of one host average their gradients through shared memory, not through sockets.
#[test]
fn ranks_of_one_host_all_reduce_gradients_through_shared_memory() {
    let logs = tempfile::tempdir().expect("temporary directory");
    let log_dir = logs.path().display().to_string();
    let output = run_bounded(
        tandem()
            .args(standalone_launch("2"))
            .args(["--log-dir", &log_dir, "--"])
            .args(BENCH_STEP)
            .args(["--batch", "4", "--steps", "1", "--threads", "1"]),
        LIMIT,
    );
    expect_success(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("gradients: all-reduced through shared memory"),
        "stdout:\n{stdout}"
    );
}
