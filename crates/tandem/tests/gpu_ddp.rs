//! Data parallelism on the GPU through the real binary under `tandem launch`, as far as one
//! GPU allows (the reference GPU machine has one; NCCL refuses two ranks on one GPU, so NCCL
//! runs here at world size 1, and the tests of two ranks use the ring through the host, except
//! `--global-batch-size`'s, which on the fake GPU runs two processes under the fake NCCL on two
//! fake GPUs):
//!
//! - `--backend nccl` at world size 1 through the whole DDP path (device broadcasts, gradient
//!   buckets all-reduced on NCCL's stream as backward finishes them, the optimizer ordered
//!   after them) ends with the same bytes as the same run without DDP; its steps are captured
//!   as CUDA graphs with their all-reduces (the note says so) and end with the bytes of the
//!   same job with `TANDEM_CUDA_GRAPHS=0`;
//! - `--global-batch-size` ends with the same bits in one process, in two on the ring, and
//!   through NCCL (its exact sum on the GPU) in one and, on two fake GPUs (the fake NCCL
//!   meets its ranks through files), in two;
//! - two processes sharing the GPU with `--backend ring --sync-bn` end, after a few steps,
//!   as close to one process with twice the batch as two single-process runs that differ only
//!   in rounding (the same run on the GPU and on the CPU) are to each other (factor 2, and
//!   at least the CPU comparison's 1e-4);
//! - `kill -9` of one of two GPU workers: the launcher restarts the round, the workers resume,
//!   and the final weights are bit-identical to an uninterrupted run;
//! - a worker stopped with SIGSTOP is found by its heartbeat, killed, and named by the
//!   launcher;
//! - `--keep-survivors` through NCCL (three fake GPUs on the fake GPU): `kill -9` of one of
//!   three workers; the survivors abort their communicator, re-form the job in-process with
//!   a new one, and end with the bytes of the uninterrupted run; on GPUs without `--backend
//!   nccl`, `--keep-survivors` is refused.
//!
//! Skipped with a printed reason without the CUDA libraries, a visible GPU (and, for NCCL,
//! libnccl), as on CI's machines; run by `scripts/gpu-check`. **It has not yet run on a GPU.**

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    assert_contains, assert_same_bits, expect_failure, expect_success, read_tensors, run_bounded,
    send_signal, synthetic_run, tandem, with_flag, worst_error_per_family, Launcher,
};
use tandem_cuda::device::REQUIRED_LIBRARIES;
use tandem_cuda::Library;

const LIMIT: Duration = Duration::from_secs(100);
/// Below this, a difference between two and one processes is accepted whatever the rounding
/// reference says: the tolerance of the same comparison on the CPU (`tests/ddp_e2e.rs`),
/// where two processes differ from one by about 1e-6 after 4 steps of this run.
const NOISE_FLOOR: f64 = 1e-4;

/// Whether a GPU (and with `nccl` libnccl) can be used here; prints why not, or fails
/// under `TANDEM_REQUIRE_GPU=1` (CI's run on the fake GPU).
fn gpu_available(test: &str, nccl: bool) -> bool {
    let mut libraries = REQUIRED_LIBRARIES.to_vec();
    if nccl {
        libraries.push(Library::Nccl);
    }
    tandem_cuda::test_gpu_available(test, &libraries)
}

/// `tandem launch --standalone --nproc-per-node N --max-restarts R [launch_flags] -- train`.
fn launch_command(
    nproc: usize,
    restarts: usize,
    launch_flags: &[&str],
    train: &[String],
) -> Command {
    let mut command = tandem();
    command.args([
        "launch",
        "--standalone",
        "--nproc-per-node",
        &nproc.to_string(),
        "--max-restarts",
        &restarts.to_string(),
    ]);
    command.args(launch_flags).arg("--").args(train);
    command
}

/// A short run of the small model on `device` (`--precision fp32` on a GPU).
fn short_run(
    output_dir: &Path,
    samples: usize,
    batch: usize,
    epochs: usize,
    device: &str,
) -> Vec<String> {
    let args = synthetic_run(output_dir, samples);
    let args = with_flag(args, "--batch-size", &batch.to_string());
    let args = with_flag(args, "--epochs", &epochs.to_string());
    let args = with_flag(args, "--device", device);
    match device {
        "cpu" => args,
        _ => with_flag(args, "--precision", "fp32"),
    }
}

/// The worst relative error per tensor family between two checkpoints.
fn worst(expected: &Path, actual: &Path) -> BTreeMap<String, f64> {
    worst_error_per_family(&read_tensors(expected), &read_tensors(actual), |name| {
        name.ends_with("num_batches_tracked")
    })
}

/// The NCCL run at world size 1 (with the `train` flags `extra`) against the same run
/// without DDP, on `device` with `backend`: whether the final weights' bytes are the same,
/// and the launched run's output (stdout, then stderr).
fn world_size_1_against_no_ddp(device: &str, backend: &str, extra: &[&str]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let (alone, launched) = (dir.path().join("alone"), dir.path().join("launched"));
    expect_success(&run_bounded(
        tandem().args(short_run(&alone, 64, 16, 2, device)),
        LIMIT,
    ));
    let mut train = with_flag(
        short_run(&launched, 64, 16, 2, device),
        "--backend",
        backend,
    );
    train.extend(extra.iter().map(|flag| flag.to_string()));
    let output = run_bounded(&mut launch_command(1, 0, &[], &train), LIMIT);
    let stdout = expect_success(&output);
    let same = std::fs::read(alone.join("epoch_2.safetensors")).unwrap()
        == std::fs::read(launched.join("epoch_2.safetensors")).unwrap();
    (
        same,
        format!("{stdout}{}", String::from_utf8_lossy(&output.stderr)),
    )
}

#[test]
fn nccl_at_world_size_1_ends_with_the_bytes_of_no_ddp() {
    if !gpu_available("nccl_at_world_size_1_ends_with_the_bytes_of_no_ddp", true) {
        return;
    }
    let (same, stdout) = world_size_1_against_no_ddp("cuda", "nccl", &[]);
    assert!(stdout.contains("backend: nccl (requested)"), "{stdout}");
    assert!(
        stdout.contains("gradients: averaged by NCCL on the GPUs in "),
        "{stdout}"
    );
    assert!(
        same,
        "--backend nccl at world size 1 ended with other weights than the run without DDP\n{stdout}"
    );
}

/// `--backend nccl --sync-bn` at world size 1: the batch statistics are summed by NCCL on the
/// device (a sum over one rank), so the steps are still whole steps captured as CUDA graphs,
/// and the weights are the bytes of the run without DDP.
#[test]
fn nccl_with_sync_bn_at_world_size_1_runs_as_cuda_graphs_and_ends_with_the_bytes_of_no_ddp() {
    let test =
        "nccl_with_sync_bn_at_world_size_1_runs_as_cuda_graphs_and_ends_with_the_bytes_of_no_ddp";
    if !gpu_available(test, true) {
        return;
    }
    let (same, text) = world_size_1_against_no_ddp("cuda", "nccl", &["--sync-bn"]);
    assert!(
        text.contains("sync-bn: batch statistics summed by NCCL on the GPUs"),
        "{text}"
    );
    assert!(
        text.contains("note: CUDA graphs on: training steps of 16 images of "),
        "{text}"
    );
    assert!(!text.contains("CUDA graphs off"), "{text}");
    assert!(
        same,
        "--backend nccl --sync-bn at world size 1 ended with other weights than the run without DDP\n{text}"
    );
}

/// `--backend nccl` at world size 1 (one micro-batch, no SyncBatchNorm): each step is one
/// whole step with its bucket all-reduces, captured as a CUDA graph after its first run; the
/// final weights are the bytes of the same job with `TANDEM_CUDA_GRAPHS=0`, which runs every
/// step eagerly.
#[test]
fn nccl_steps_as_cuda_graphs_end_with_the_bytes_of_eager_steps() {
    if !gpu_available(
        "nccl_steps_as_cuda_graphs_end_with_the_bytes_of_eager_steps",
        true,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut weights = Vec::new();
    for graphs in ["1", "0"] {
        let output_dir = dir.path().join(format!("graphs-{graphs}"));
        let train = with_flag(
            short_run(&output_dir, 64, 16, 2, "cuda"),
            "--backend",
            "nccl",
        );
        let output = run_bounded(
            launch_command(1, 0, &[], &train).env("TANDEM_CUDA_GRAPHS", graphs),
            LIMIT,
        );
        let stdout = expect_success(&output);
        let text = format!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
        assert!(text.contains("backend: nccl (requested)"), "{text}");
        if graphs == "1" {
            assert!(
                text.contains("note: CUDA graphs on: training steps of 16 images of "),
                "{text}"
            );
            assert!(!text.contains("CUDA graphs off"), "{text}");
        } else {
            assert!(
                text.contains("note: CUDA graphs off: TANDEM_CUDA_GRAPHS=0"),
                "{text}"
            );
            assert!(!text.contains("CUDA graphs on"), "{text}");
        }
        weights.push(std::fs::read(output_dir.join("epoch_2.safetensors")).unwrap());
    }
    assert!(
        weights[0] == weights[1],
        "the NCCL job's graphed and eager steps ended with other weights"
    );
}

/// Runs everywhere, on the CPU: the comparison of the NCCL test holds for a job of one
/// process under `launch` (ring), and `--backend nccl` there takes the data-parallel path (the
/// ranks' records are gathered through the store) and is refused naming the CPU.
#[test]
fn the_world_size_1_comparison_holds_on_the_cpu_and_nccl_there_is_refused() {
    let (same, _) = world_size_1_against_no_ddp("cpu", "ring", &[]);
    assert!(
        same,
        "a job of one process under launch ended with other weights"
    );
    let dir = tempfile::tempdir().unwrap();
    let train = with_flag(short_run(dir.path(), 64, 16, 1, "cpu"), "--backend", "nccl");
    let output = run_bounded(&mut launch_command(1, 0, &[], &train), LIMIT);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains(
            "--backend nccl: every rank is on the CPU, and NCCL needs a GPU for each rank \
             (use --backend ring or auto)"
        ),
        "{text}"
    );
}

#[test]
fn two_processes_sharing_the_gpu_on_the_ring_match_one_with_twice_the_batch() {
    if !gpu_available(
        "two_processes_sharing_the_gpu_on_the_ring_match_one_with_twice_the_batch",
        false,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    // 64 images, 4 steps of 16 in one epoch: compared early, before rounding grows.
    let parallel = short_run(&path("parallel"), 64, 8, 1, "cuda");
    let parallel = with_flag(parallel, "--backend", "ring");
    let mut parallel = with_flag(parallel, "--threads", "2");
    parallel.push("--sync-bn".into());
    let stdout = expect_success(&run_bounded(
        &mut launch_command(2, 0, &[], &parallel),
        LIMIT,
    ));
    assert!(stdout.contains("backend: ring (requested)"), "{stdout}");
    for (name, device) in [("alone-gpu", "cuda"), ("alone-cpu", "cpu")] {
        expect_success(&run_bounded(
            tandem().args(short_run(&path(name), 64, 16, 1, device)),
            LIMIT,
        ));
    }
    let checkpoint = |name: &str| path(name).join("epoch_1.safetensors");
    let rounding = worst(&checkpoint("alone-gpu"), &checkpoint("alone-cpu"));
    let parallel = worst(&checkpoint("alone-gpu"), &checkpoint("parallel"));
    eprintln!(
        "GPU against CPU, one process: {rounding:?}\ntwo GPU processes against one: {parallel:?}"
    );
    for (family, error) in &parallel {
        let allowed = (2.0 * rounding.get(family).copied().unwrap_or(0.0)).max(NOISE_FLOOR);
        assert!(
            *error <= allowed,
            "{family}: two processes differ from one by {error:e}, more than {allowed:e} \
             (twice the GPU-CPU rounding difference, at least {NOISE_FLOOR:e})"
        );
    }
}

#[test]
fn sync_bn_with_a_global_batch_is_refused_on_the_gpu() {
    if !gpu_available("sync_bn_with_a_global_batch_is_refused_on_the_gpu", false) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut args = short_run(&dir.path().join("run"), 64, 8, 1, "cuda");
    args = with_flag(args, "--global-batch-size", "32");
    args.push("--sync-bn".to_string());
    let output = run_bounded(tandem().args(&args), LIMIT);
    assert_contains(
        &expect_failure(&output),
        "--sync-bn with --global-batch-size works on the CPU only for now",
    );
}

#[test]
fn a_global_batch_on_the_gpu_ends_with_the_same_bits_on_one_and_two_processes() {
    if !gpu_available(
        "a_global_batch_on_the_gpu_ends_with_the_same_bits_on_one_and_two_processes",
        false,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    // 64 images in 2 steps of 4 shards of 8.
    let run = |name: &str| {
        let args = with_flag(short_run(&path(name), 64, 8, 1, "cuda"), "--threads", "2");
        with_flag(args, "--global-batch-size", "32")
    };
    expect_success(&run_bounded(tandem().args(run("alone")), LIMIT));
    let stdout = expect_success(&run_bounded(
        &mut launch_command(2, 0, &[], &run("two")),
        LIMIT,
    ));
    assert!(
        stdout.contains("global batch 32 in 4 shards of 8, shared by 2 processes"),
        "{stdout}"
    );
    assert_same_bits(&path("alone"), &path("two"), "two processes against one");
}

/// `count` GPUs for as many processes under NCCL: on the fake GPU, `count` fake GPUs (the
/// fake NCCL then meets its ranks through files, put in `scratch`); on a real machine, its
/// own when it has that many. `None` (after printing why) with fewer real GPUs: NCCL
/// refuses two ranks on one GPU.
fn gpus(count: usize, test: &str, scratch: &Path) -> Option<Vec<(&'static str, String)>> {
    if std::env::var_os("TANDEM_FAKE_GPU_KERNELS").is_some() {
        let scratch = scratch.display().to_string();
        return Some(vec![
            ("TANDEM_FAKE_GPU_COUNT", count.to_string()),
            ("TMPDIR", scratch),
        ]);
    }
    let facts = tandem_cuda::device::GpuFacts::gather(tandem_cuda::Probe::process());
    if facts.visible_gpus.is_ok_and(|gpus| gpus >= count) {
        return Some(Vec::new());
    }
    println!(
        "{test}: {count} processes under NCCL skipped: fewer GPUs, and NCCL refuses two ranks \
         on one"
    );
    None
}

/// `--global-batch-size` through NCCL (`--backend nccl` under `tandem launch`: the shards'
/// gradients stay on the GPU and their exact sum runs in kernels and NCCL all-reduces) ends
/// with the bits of the host's exact sum in one process and in two on the ring: through a
/// world of one, and with two processes each on its own GPU (two fake GPUs on the fake GPU).
#[test]
fn a_global_batch_through_nccl_ends_with_the_bits_of_the_host_ring_and_one_process() {
    let test = "a_global_batch_through_nccl_ends_with_the_bits_of_the_host_ring_and_one_process";
    if !gpu_available(test, true) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    // 64 images in 2 steps of 4 shards of 8.
    let run = |name: &str, backend: &str| {
        let args = with_flag(short_run(&path(name), 64, 8, 1, "cuda"), "--threads", "2");
        let args = with_flag(args, "--backend", backend);
        with_flag(args, "--global-batch-size", "32")
    };
    expect_success(&run_bounded(tandem().args(run("alone", "auto")), LIMIT));
    let ring = expect_success(&run_bounded(
        &mut launch_command(2, 0, &[], &run("ring", "ring")),
        LIMIT,
    ));
    assert!(ring.contains("backend: ring (requested)"), "{ring}");
    let output = run_bounded(&mut launch_command(1, 0, &[], &run("nccl", "nccl")), LIMIT);
    let nccl = expect_success(&output);
    let nccl = format!("{nccl}{}", String::from_utf8_lossy(&output.stderr));
    assert!(nccl.contains("backend: nccl (requested)"), "{nccl}");
    assert!(
        nccl.contains("gradients: the shards' exact sum runs on the GPUs, through NCCL"),
        "{nccl}"
    );
    assert!(
        nccl.contains("note: CUDA graphs off: --global-batch-size keeps each shard's"),
        "{nccl}"
    );
    assert_same_bits(&path("alone"), &path("nccl"), "NCCL against one process");
    assert_same_bits(
        &path("ring"),
        &path("nccl"),
        "NCCL against two processes on the ring",
    );
    let Some(gpus) = gpus(2, test, dir.path()) else {
        return;
    };
    let mut command = launch_command(2, 0, &[], &run("nccl-two", "auto"));
    command.envs(gpus);
    let two = expect_success(&run_bounded(&mut command, LIMIT));
    assert!(
        two.contains("backend: nccl (auto: each of the 2 rank(s) has its own GPU"),
        "{two}"
    );
    assert_same_bits(
        &path("alone"),
        &path("nccl-two"),
        "two processes under NCCL",
    );
}

/// A job of `--global-batch-size 24` through NCCL in `output_dir`: 2 epochs of 10 steps of
/// 3 shards of 8.
fn global_batch_through_nccl(output_dir: &Path) -> Vec<String> {
    let args = with_flag(
        short_run(output_dir, 240, 8, 2, "cuda"),
        "--backend",
        "nccl",
    );
    with_flag(args, "--global-batch-size", "24")
}

/// How soon after a kill the survivors of `--keep-survivors` must have re-formed the job:
/// well within the default collective timeout (300 s), on a loaded machine.
const REFORM_LIMIT: Duration = Duration::from_secs(60);

/// Waits until the workers of `launcher` recorded `steps` steps in all in the sample trace
/// `trace` (one line per worker and step).
fn wait_for_traced_steps(launcher: &mut Launcher, trace: &Path, steps: usize) {
    let deadline = Instant::now() + LIMIT;
    let traced = || -> usize {
        let files = std::fs::read_dir(trace).into_iter().flatten().flatten();
        files
            .map(|file| std::fs::read_to_string(file.path()).unwrap_or_default())
            .map(|text| text.lines().count())
            .sum()
    };
    while traced() < steps {
        assert!(!launcher.has_exited(), "{}", launcher.stderr());
        assert!(Instant::now() < deadline, "fewer than {steps} steps traced");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `tandem launch --keep-survivors` on GPUs: of 3 workers of a global batch through NCCL
/// (3 fake GPUs on the fake GPU), one is killed with SIGKILL in epoch 1; the heartbeat of
/// each survivor aborts its NCCL communicator, so the exact sum blocked on the lost rank
/// returns at once instead of after the collective timeout (300 s); the survivors re-form
/// the job in-process with a new communicator, are not restarted, and end with the bytes of
/// the uninterrupted run.
#[test]
fn survivors_of_a_kill_9_re_form_through_nccl_in_process_and_end_bit_identical() {
    let test = "survivors_of_a_kill_9_re_form_through_nccl_in_process_and_end_bit_identical";
    if !gpu_available(test, true) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(gpus) = gpus(3, test, dir.path()) else {
        return;
    };
    let straight = dir.path().join("straight");
    let mut command = launch_command(3, 0, &[], &global_batch_through_nccl(&straight));
    expect_success(&run_bounded(command.envs(gpus.clone()), LIMIT));

    let (reformed, trace) = (dir.path().join("reformed"), dir.path().join("trace"));
    std::fs::create_dir(&trace).unwrap();
    let job = global_batch_through_nccl(&reformed);
    let mut command = launch_command(3, 0, &["--keep-survivors"], &job);
    command.envs(gpus).env("TANDEM_SAMPLE_TRACE", &trace);
    let mut launcher = Launcher::spawn(command, dir.path(), "reformed");
    wait_for_traced_steps(&mut launcher, &trace, 3 * 3);
    let (victim, survivors) = (launcher.worker(2), [launcher.worker(0), launcher.worker(1)]);
    send_signal(victim, libc::SIGKILL);
    let killed = Instant::now();
    let reformed_line = "world size 3 -> 2 at epoch 1, step ";
    while !launcher.stdout().contains(reformed_line) {
        assert!(!launcher.has_exited(), "{}", launcher.stderr());
        // Far below the collective timeout that a survivor blocked in NCCL would wait.
        let waited = killed.elapsed();
        assert!(
            waited < REFORM_LIMIT,
            "no re-forming after {waited:?}\n{}",
            launcher.stdout()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        [launcher.worker(0), launcher.worker(1)],
        survivors,
        "the survivors were not restarted"
    );
    let status = launcher.wait(LIMIT);
    let (stdout, stderr) = (launcher.stdout(), launcher.stderr());
    assert!(status.success(), "{stderr}");
    assert_contains(
        &stderr,
        &format!(
            "membership 1: rank 2 (pid {victim}) killed by SIGKILL; ranks [0, 1] go on \
             in-process (world size 3 -> 2), nobody restarts"
        ),
    );
    assert!(
        !stdout.contains("resum"),
        "nothing was read from disk:\n{stdout}"
    );
    let expected = std::fs::read(straight.join("epoch_2.safetensors")).unwrap();
    let actual = std::fs::read(reformed.join("epoch_2.safetensors")).unwrap();
    assert!(
        expected == actual,
        "the re-formed GPU job's final weights differ from the uninterrupted one's\n{stdout}"
    );
    assert_same_bits(&straight, &reformed, "3 GPU workers, one killed");
}

#[test]
fn keep_survivors_on_gpus_without_backend_nccl_is_refused() {
    if !gpu_available(
        "keep_survivors_on_gpus_without_backend_nccl_is_refused",
        false,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let train = short_run(&dir.path().join("run"), 64, 8, 1, "cuda");
    let train = with_flag(train, "--global-batch-size", "32");
    let output = run_bounded(
        &mut launch_command(2, 0, &["--keep-survivors"], &train),
        LIMIT,
    );
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(2), "{printed}");
    assert_contains(
        &printed,
        "tandem launch --keep-survivors re-forms GPU jobs through NCCL only: add --backend nccl \
         (each worker on a GPU of its own), or leave --keep-survivors out: a lost worker then \
         restarts every worker from the snapshot",
    );
}

/// A two-worker GPU job on the ring of `epochs` epochs of 8 steps, with `extra` flags.
fn two_worker_job(output_dir: &Path, epochs: usize, extra: &[&str]) -> Vec<String> {
    let train = short_run(output_dir, 256, 16, epochs, "cuda");
    let train = with_flag(train, "--backend", "ring");
    let mut train = with_flag(train, "--threads", "2");
    train.extend(extra.iter().map(|arg| arg.to_string()));
    train
}

#[test]
fn kill_9_of_one_of_two_gpu_workers_restarts_and_ends_bit_identical() {
    if !gpu_available(
        "kill_9_of_one_of_two_gpu_workers_restarts_and_ends_bit_identical",
        false,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    let job = two_worker_job(&straight, 2, &["--snapshot-every-steps", "1"]);
    expect_success(&run_bounded(&mut launch_command(2, 0, &[], &job), LIMIT));

    let killed = dir.path().join("killed");
    let job = two_worker_job(&killed, 2, &["--snapshot-every-steps", "1"]);
    let mut launcher = Launcher::spawn(
        launch_command(2, 2, &["--stop-grace-seconds", "5"], &job),
        dir.path(),
        "killed",
    );
    // SIGKILL one worker once a second snapshot exists, mid epoch 1.
    let deadline = Instant::now() + LIMIT;
    while !killed.join("snapshot.safetensors.prev").exists() {
        assert!(
            Instant::now() < deadline,
            "no snapshot appeared\n{}",
            launcher.stderr()
        );
        assert!(
            !launcher.has_exited(),
            "the job ended early\n{}",
            launcher.stderr()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let victim = launcher.worker(1);
    // SAFETY: plain kill(2) of a child process id just read.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let status = launcher.wait(LIMIT);
    let output = format!("{}{}", launcher.stdout(), launcher.stderr());
    assert!(status.success(), "{output}");
    assert!(
        output.contains("SIGKILL"),
        "no killed worker reported\n{output}"
    );
    let expected = std::fs::read(straight.join("epoch_2.safetensors")).unwrap();
    let actual = std::fs::read(killed.join("epoch_2.safetensors")).unwrap();
    assert!(
        expected == actual,
        "the restarted GPU job's final weights differ from the uninterrupted one's\n{output}"
    );
}

#[test]
fn a_stopped_gpu_worker_ends_every_rank_within_the_timeout_and_is_named() {
    if !gpu_available(
        "a_stopped_gpu_worker_ends_every_rank_within_the_timeout_and_is_named",
        false,
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("run");
    let job = two_worker_job(&output, 50, &["--collective-timeout", "2"]);
    let mut launcher = Launcher::spawn(
        launch_command(2, 0, &["--stop-grace-seconds", "60"], &job),
        dir.path(),
        "stopped",
    );
    launcher.wait_for_training(&output, LIMIT);
    let stuck = launcher.worker(1);
    let stopped_at = Instant::now();
    // SAFETY: plain kill(2) of a child process id just read.
    assert_eq!(unsafe { libc::kill(stuck as i32, libc::SIGSTOP) }, 0);
    let status = launcher.wait(LIMIT);
    let waited = stopped_at.elapsed();
    let stderr = launcher.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("root cause: rank 1 (node 0, local rank 1) sent no heartbeat for "),
        "{stderr}"
    );
    // The 1 s heartbeat timeout and the GPU processes' exit; without the kill the launcher
    // would wait the 60 s grace.
    assert!(
        waited < Duration::from_secs(40),
        "took {waited:?}\n{stderr}"
    );
}
