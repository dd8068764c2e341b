//! `train`, `eval` and `predict` on the GPU executor (`--device cuda`), against the same
//! commands on the CPU: a short training run in fp32 (final weights within 2e-3 of each
//! tensor's largest magnitude, epoch losses within 1e-3 relative), snapshots resumed on the
//! other device, `kill -9` and resume on the GPU ending bit-identical to an uninterrupted GPU
//! run, `eval`/`predict` within 1e-4, the training set in GPU memory (batches assembled
//! there, for bytes and synthetic floats) ending bit-identical to the same GPU run fed the
//! CPU loader's batches, training steps replayed as CUDA graphs ending bit-identical to
//! `TANDEM_CUDA_GRAPHS=0`, and a `--precision bf16` run whose epoch losses stay within 2e-2 of
//! the fp32 GPU run's.
//!
//! Skipped with a printed reason without the CUDA driver, NVRTC, cuBLAS, cuDNN or a visible
//! GPU (as on CI's machines); run by `scripts/gpu-check`. **It has not yet run on a GPU.**

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    expect_success, kill_after_second_snapshot, read_tensors, run_bounded, synthetic_run, tandem,
    with_flag, worst_error_per_family, SMALL_MODEL,
};
use tandem_cuda::device::REQUIRED_LIBRARIES;

const LIMIT: Duration = Duration::from_secs(120);
/// Training images of the runs: 4 steps of 16 per epoch, 2 epochs.
const TRAIN_IMAGES: usize = 64;
/// Final weights and running statistics: worst error relative to each tensor's largest
/// magnitude, per family, after 8 SGD steps in fp32 on both devices.
const WEIGHT_TOLERANCE: f64 = 2e-3;
/// Epoch losses (train and validation), relative.
const LOSS_TOLERANCE: f64 = 1e-3;
/// Evaluation loss and predicted logits, relative.
const EVAL_TOLERANCE: f64 = 1e-4;

/// Whether a GPU can be used here; prints why not, or fails under `TANDEM_REQUIRE_GPU=1`
/// (CI's run on the fake GPU).
fn gpu_available(test: &str) -> bool {
    tandem_cuda::test_gpu_available(test, &REQUIRED_LIBRARIES)
}

/// The training flags of the comparisons: the small model, 2 epochs of 4 steps, on `device`.
fn run_args(output_dir: &Path, device: &str) -> Vec<String> {
    let args = synthetic_run(output_dir, TRAIN_IMAGES);
    let args = with_flag(args, "--batch-size", "16");
    let args = with_flag(args, "--threads", "4");
    let args = with_flag(args, "--device", device);
    if device == "cpu" {
        args
    } else {
        with_flag(args, "--precision", "fp32")
    }
}

/// Runs `tandem args` to success; returns its standard output.
fn train(args: &[String]) -> String {
    expect_success(&run_bounded(tandem().args(args), LIMIT))
}

/// `(train_loss, val_loss)` of each epoch in the run's `metrics.jsonl`.
fn epoch_losses(output_dir: &Path) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(output_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            (
                record["train_loss"].as_f64().unwrap(),
                record["val_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Asserts the final weights and the epoch losses of two runs agree within the tolerances.
fn assert_runs_close(expected: &Path, actual: &Path, what: &str) {
    let worst = worst_error_per_family(
        &read_tensors(&expected.join("epoch_2.safetensors")),
        &read_tensors(&actual.join("epoch_2.safetensors")),
        |name| name.ends_with("num_batches_tracked"),
    );
    eprintln!("{what}: worst relative error per family {worst:?}");
    for (family, error) in &worst {
        assert!(
            *error <= WEIGHT_TOLERANCE,
            "{what}: {family} differs by {error:e} (tolerance {WEIGHT_TOLERANCE:e})"
        );
    }
    let (expected, actual) = (epoch_losses(expected), epoch_losses(actual));
    assert_eq!(expected.len(), 2, "{what}: epochs recorded");
    assert_eq!(expected.len(), actual.len(), "{what}: epochs recorded");
    for ((cpu_train, cpu_val), (gpu_train, gpu_val)) in expected.iter().zip(&actual) {
        for (cpu, gpu) in [(cpu_train, gpu_train), (cpu_val, gpu_val)] {
            let error = (cpu - gpu).abs() / cpu.abs().max(1e-12);
            assert!(error <= LOSS_TOLERANCE, "{what}: loss {gpu} vs {cpu}");
        }
    }
}

#[test]
fn training_on_the_gpu_in_fp32_matches_the_cpu() {
    if !gpu_available("training_on_the_gpu_in_fp32_matches_the_cpu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cpu, gpu) = (dir.path().join("cpu"), dir.path().join("gpu"));
    train(&run_args(&cpu, "cpu"));
    let stdout = train(&run_args(&gpu, "cuda"));
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.starts_with("device: cuda:0 ("), "{stdout}");
    assert!(
        first.contains("GPU executor unverified on a GPU"),
        "{first}"
    );
    assert!(stdout.contains("| device: cuda:0 (fp32) |"), "{stdout}");
    assert_runs_close(&cpu, &gpu, "cuda fp32 vs cpu");
}

/// Epoch losses of a bf16 run against the same run in fp32 on the GPU, relative: the bound
/// of one bf16 step's loss (`tandem-cuda/tests/gpu_bf16.rs`, where it is derived from
/// bfloat16's 2^-9 rounding), kept for 8 SGD steps of the small model, whose losses move by
/// far more than that from step to step, so a bf16 run that learned differently shows.
const BF16_LOSS_TOLERANCE: f64 = 2e-2;

#[test]
fn training_in_bf16_stays_within_tolerance_of_fp32() {
    if !gpu_available("training_in_bf16_stays_within_tolerance_of_fp32") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (fp32, bf16) = (dir.path().join("fp32"), dir.path().join("bf16"));
    train(&run_args(&fp32, "cuda"));
    let bf16_args = with_flag(run_args(&bf16, "cuda"), "--precision", "bf16");
    let stdout = train(&bf16_args);
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.contains("; precision bf16, deterministic algorithms; "),
        "{first}"
    );
    assert!(stdout.contains("| device: cuda:0 (bf16) |"), "{stdout}");
    let (expected, actual) = (epoch_losses(&fp32), epoch_losses(&bf16));
    assert_eq!(expected.len(), 2, "epochs recorded");
    assert_eq!(actual.len(), 2, "epochs recorded");
    for ((fp32_train, fp32_val), (bf16_train, bf16_val)) in expected.iter().zip(&actual) {
        for (fp32, bf16) in [(fp32_train, bf16_train), (fp32_val, bf16_val)] {
            let error = (fp32 - bf16).abs() / fp32.abs().max(1e-12);
            eprintln!("bf16 loss {bf16} vs fp32 {fp32}: relative error {error:e}");
            assert!(
                error <= BF16_LOSS_TOLERANCE,
                "bf16 loss {bf16} vs fp32 {fp32} (relative error {error:e})"
            );
        }
    }
}

/// Trains `args` on `first` up to step 3 (the snapshot), then resumes on `second` to the end.
fn train_across(output_dir: &Path, first: &str, second: &str) {
    let stop_early = with_flag(run_args(output_dir, first), "--max-steps", "3");
    train(&stop_early);
    let snapshot = output_dir.join("snapshot.safetensors");
    assert!(snapshot.exists(), "no snapshot after --max-steps");
    let stdout = train(&run_args(output_dir, second));
    assert!(
        stdout.contains("Resuming training from snapshot at epoch 1, step 3"),
        "{first} -> {second}: {stdout}"
    );
}

#[test]
fn a_snapshot_resumes_on_the_other_device() {
    if !gpu_available("a_snapshot_resumes_on_the_other_device") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    train(&run_args(&straight, "cpu"));
    for (first, second) in [("cpu", "cuda"), ("cuda", "cpu")] {
        let across = dir.path().join(format!("{first}-{second}"));
        train_across(&across, first, second);
        assert_runs_close(&straight, &across, &format!("{first} then {second}"));
    }
}

#[test]
fn kill_9_on_the_gpu_and_resume_is_bit_identical() {
    if !gpu_available("kill_9_on_the_gpu_and_resume_is_bit_identical") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The default precision (TF32) with deterministic algorithms, as a user runs it.
    // Two epochs of 16 steps: three runs of them fit the time limit on a loaded 2-core machine.
    let gpu_args = |out: &Path| {
        let args = synthetic_run(out, 256);
        let args = with_flag(args, "--batch-size", "16");
        with_flag(args, "--device", "cuda")
    };
    let straight = dir.path().join("straight");
    train(&gpu_args(&straight));

    let interrupted = dir.path().join("interrupted");
    let mut args = gpu_args(&interrupted);
    args.extend(["--snapshot-every-steps".to_string(), "1".to_string()]);
    // SIGKILL as soon as a second snapshot exists, mid epoch 1.
    kill_after_second_snapshot(&args, &interrupted, LIMIT);
    let stdout = train(&args);
    assert!(
        stdout.contains("Resuming training from snapshot"),
        "{stdout}"
    );
    let expected = std::fs::read(straight.join("epoch_2.safetensors")).unwrap();
    let actual = std::fs::read(interrupted.join("epoch_2.safetensors")).unwrap();
    assert!(
        expected == actual,
        "the resumed GPU run's final weights differ from the uninterrupted GPU run's"
    );
}

/// A CIFAR-10 binary folder of `train` training and `test` test records (deterministic bytes;
/// data_batch_2..5 empty), so that the run's training set is uint8 pixels the GPU can hold.
fn write_cifar_bin(dir: &Path, train: usize, test: usize) {
    let record = |index: usize| {
        let mut bytes = vec![(index * 7 % 10) as u8];
        bytes.extend((0..3072).map(|i| ((i * 31 + index * 17) % 256) as u8));
        bytes
    };
    std::fs::create_dir_all(dir).unwrap();
    let records = |range: std::ops::Range<usize>| range.flat_map(record).collect::<Vec<u8>>();
    std::fs::write(dir.join("data_batch_1.bin"), records(0..train)).unwrap();
    for batch in 2..=5 {
        std::fs::write(dir.join(format!("data_batch_{batch}.bin")), b"").unwrap();
    }
    std::fs::write(dir.join("test_batch.bin"), records(train..train + test)).unwrap();
}

/// Training flags on the CIFAR folder `data`: the small model, 2 epochs of 2 steps of 2
/// micro-batches of 16 (the last one 12), augmented, on `device` (fp32 on a GPU).
fn cifar_run_args(output_dir: &Path, data: &Path, device: &str) -> Vec<String> {
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(common::SMALL_MODEL.iter().map(|arg| arg.to_string()));
    for (flag, value) in [
        ("--data", "cifar10-bin"),
        ("--epochs", "2"),
        ("--batch-size", "16"),
        ("--grad-accum", "2"),
        ("--optimizer", "sgd"),
        ("--momentum", "0.9"),
        ("--lr", "0.05"),
        ("--threads", "4"),
        ("--seed", "11"),
        ("--device", device),
    ] {
        args.extend([flag.to_string(), value.to_string()]);
    }
    args.extend(["--data-dir".to_string(), data.display().to_string()]);
    args.extend(["--output-dir".to_string(), output_dir.display().to_string()]);
    match device {
        "cpu" => args,
        _ => with_flag(args, "--precision", "fp32"),
    }
}

const DATA_ON_GPU: &str = "data: the training set is in GPU memory";
const TEST_SET_ON_GPU: &str = "data: the test set is in GPU memory";

/// The device data path (training set in GPU memory, batches gathered and augmented there)
/// ends with the bytes of `epoch_2.safetensors` of the same GPU run fed the CPU loader's
/// batches (`TANDEM_HOST_BATCHES=1`): the augmentation is bit-identical and the GPU work the
/// same; its evaluations, from the test set in GPU memory, give the same losses. Stopped after one step and resumed (mid-epoch, with --grad-accum), it ends the same
/// again; and it ends within the CPU comparison's tolerances of the CPU run.
#[test]
fn training_with_the_data_on_the_gpu_matches_host_batches() {
    if !gpu_available("training_with_the_data_on_the_gpu_matches_host_batches") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cifar");
    write_cifar_bin(&data, 60, 32);
    let (device, host, cpu) = (
        dir.path().join("device"),
        dir.path().join("host"),
        dir.path().join("cpu"),
    );
    let stdout = train(&cifar_run_args(&device, &data, "cuda"));
    assert!(stdout.contains(DATA_ON_GPU), "{stdout}");
    assert!(stdout.contains(TEST_SET_ON_GPU), "{stdout}");
    let stdout = expect_success(&run_bounded(
        tandem()
            .args(cifar_run_args(&host, &data, "cuda"))
            .env("TANDEM_HOST_BATCHES", "1"),
        LIMIT,
    ));
    assert!(!stdout.contains(DATA_ON_GPU), "{stdout}");
    assert!(!stdout.contains(TEST_SET_ON_GPU), "{stdout}");
    let final_weights = |run: &Path| std::fs::read(run.join("epoch_2.safetensors")).unwrap();
    assert!(
        final_weights(&device) == final_weights(&host),
        "the GPU run with the data on the GPU differs from the one fed host batches"
    );
    // The evaluations from GPU memory normalize as the CPU loader does: the same losses.
    assert_eq!(epoch_losses(&device), epoch_losses(&host));

    let resumed = dir.path().join("resumed");
    let args = cifar_run_args(&resumed, &data, "cuda");
    train(&with_flag(args.clone(), "--max-steps", "1"));
    let stdout = train(&args);
    assert!(
        stdout.contains("Resuming training from snapshot at epoch 1, step 1"),
        "{stdout}"
    );
    assert!(
        final_weights(&device) == final_weights(&resumed),
        "the resumed run with the data on the GPU differs from the uninterrupted one"
    );

    train(&cifar_run_args(&cpu, &data, "cpu"));
    assert_runs_close(&cpu, &device, "data on the GPU vs cpu");
}

/// Synthetic data (float pixels) goes to GPU memory too, and its run ends with the bytes of
/// the same run fed the CPU loader's batches (`TANDEM_HOST_BATCHES=1`), with the same epoch
/// losses. On the fake GPU, told it has 1 MB of memory, the data set does not fit: a note says
/// so, the batches come from the host, and the run ends with the same bytes again.
#[test]
fn synthetic_data_on_the_gpu_matches_host_batches() {
    if !gpu_available("synthetic_data_on_the_gpu_matches_host_batches") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (device, host) = (dir.path().join("device"), dir.path().join("host"));
    let stdout = train(&run_args(&device, "cuda"));
    assert!(stdout.contains(DATA_ON_GPU), "{stdout}");
    assert!(stdout.contains(TEST_SET_ON_GPU), "{stdout}");
    let stdout = expect_success(&run_bounded(
        tandem()
            .args(run_args(&host, "cuda"))
            .env("TANDEM_HOST_BATCHES", "1"),
        LIMIT,
    ));
    assert!(!stdout.contains(DATA_ON_GPU), "{stdout}");
    let final_weights = |run: &Path| std::fs::read(run.join("epoch_2.safetensors")).unwrap();
    assert!(
        final_weights(&device) == final_weights(&host),
        "the GPU run with synthetic data on the GPU differs from the one fed host batches"
    );
    assert_eq!(epoch_losses(&device), epoch_losses(&host));

    if std::env::var_os("TANDEM_FAKE_GPU_KERNELS").is_none() {
        return;
    }
    let small = dir.path().join("small");
    let output = run_bounded(
        tandem()
            .args(run_args(&small, "cuda"))
            .env("TANDEM_FAKE_GPU_MEMORY_MB", "1"),
        LIMIT,
    );
    let stdout = expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stdout.contains(DATA_ON_GPU), "{stdout}");
    assert!(
        stderr.contains("note: the data set's 0.8 MB of pixels are more than half the GPU's")
            && stderr.contains("its batches are assembled on the host"),
        "{stderr}"
    );
    assert!(
        final_weights(&small) == final_weights(&host),
        "the run whose data did not fit differs from the one fed host batches"
    );
}

/// Whole training steps captured as CUDA graphs (one process; with one micro-batch the
/// epoch's last, partial batch a graph of its own; with `--grad-accum 2` the steps of two
/// full micro-batches one graph, and the epoch's last step, of a full and a partial one,
/// through the separate calls) end with the bytes of `epoch_2.safetensors` of the same run
/// with `TANDEM_CUDA_GRAPHS=0`, with the data on the GPU and fed from the host; the notes say
/// which runs used graphs.
#[test]
fn training_steps_as_cuda_graphs_match_eager_steps() {
    if !gpu_available("training_steps_as_cuda_graphs_match_eager_steps") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cifar");
    // 60 images in batches of 16: three full batches and one of 12 an epoch.
    write_cifar_bin(&data, 60, 32);
    let final_weights = |run: &Path| std::fs::read(run.join("epoch_2.safetensors")).unwrap();
    let captures: [(&str, &[&str]); 2] = [
        ("1", &["16 images", "12 images"]),
        ("2", &["2 micro-batches of 16 images"]),
    ];
    for (grad_accum, captured) in captures {
        for host_batches in [false, true] {
            let mut weights = Vec::new();
            for graphs in ["1", "0"] {
                let output_dir = dir
                    .path()
                    .join(format!("run-{grad_accum}-{host_batches}-{graphs}"));
                let args = with_flag(
                    cifar_run_args(&output_dir, &data, "cuda"),
                    "--grad-accum",
                    grad_accum,
                );
                let mut command = tandem();
                command.args(&args).env("TANDEM_CUDA_GRAPHS", graphs);
                if host_batches {
                    command.env("TANDEM_HOST_BATCHES", "1");
                }
                let output = run_bounded(&mut command, LIMIT);
                expect_success(&output);
                let stderr = String::from_utf8_lossy(&output.stderr).to_string();
                if graphs == "1" {
                    for shape in captured {
                        let note = format!(
                            "note: CUDA graphs on: training steps of {shape} of 32x32 replay one captured graph"
                        );
                        assert!(stderr.contains(note.as_str()), "{note}\n{stderr}");
                    }
                    let other_shapes = stderr.matches("CUDA graphs on: training steps of ").count()
                        - captured
                            .iter()
                            .map(|shape| stderr.matches(&format!("steps of {shape} of")).count())
                            .sum::<usize>();
                    assert_eq!(other_shapes, 0, "{stderr}");
                    assert!(!stderr.contains("CUDA graphs off"), "{stderr}");
                } else {
                    assert!(
                        stderr.contains("note: CUDA graphs off: TANDEM_CUDA_GRAPHS=0"),
                        "{stderr}"
                    );
                    assert!(!stderr.contains("CUDA graphs on"), "{stderr}");
                }
                weights.push(final_weights(&output_dir));
            }
            assert!(
                weights[0] == weights[1],
                "graphed and eager runs differ (--grad-accum {grad_accum}, host batches: \
                 {host_batches})"
            );
        }
    }
}

fn eval_json(checkpoint: &Path, device: &str) -> serde_json::Value {
    let mut args: Vec<String> = vec![
        "eval".into(),
        "--checkpoint".into(),
        checkpoint.display().to_string(),
    ];
    args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    args.extend(
        [
            "--data",
            "synthetic",
            "--seed",
            "7",
            "--json",
            "--device",
            device,
        ]
        .iter()
        .map(|arg| arg.to_string()),
    );
    if device != "cpu" {
        args.extend(["--precision".to_string(), "fp32".to_string()]);
    }
    let stdout = expect_success(&run_bounded(tandem().args(&args), LIMIT));
    serde_json::from_str(stdout.trim()).unwrap()
}

/// `predict --json` of `checkpoint` on `images` on `device`: the logits per image.
fn predict_logits(checkpoint: &Path, images: &[PathBuf], device: &str) -> Vec<Vec<f64>> {
    let mut args: Vec<String> = vec![
        "predict".into(),
        "--checkpoint".into(),
        checkpoint.display().to_string(),
        "--json".into(),
        "--device".into(),
        device.into(),
    ];
    args.extend(SMALL_MODEL.iter().map(|arg| arg.to_string()));
    args.extend(images.iter().map(|path| path.display().to_string()));
    let output = run_bounded(tandem().args(&args), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    let stdout = expect_success(&output);
    assert!(stderr.starts_with("device: "), "{stderr}");
    stdout
        .lines()
        .map(|line| {
            let prediction: serde_json::Value = serde_json::from_str(line).unwrap();
            prediction["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|value| value.as_f64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn eval_and_predict_on_the_gpu_match_the_cpu() {
    if !gpu_available("eval_and_predict_on_the_gpu_match_the_cpu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    train(&run_args(&run, "cpu"));
    let checkpoint = run.join("epoch_2.safetensors");

    let (cpu, gpu) = (
        eval_json(&checkpoint, "cpu"),
        eval_json(&checkpoint, "cuda"),
    );
    assert_eq!(cpu["samples"], gpu["samples"]);
    let samples = cpu["samples"].as_f64().unwrap();
    let (cpu_loss, gpu_loss) = (cpu["loss"].as_f64().unwrap(), gpu["loss"].as_f64().unwrap());
    assert!(
        (cpu_loss - gpu_loss).abs() <= EVAL_TOLERANCE * cpu_loss.abs(),
        "eval loss: GPU {gpu_loss}, CPU {cpu_loss}"
    );
    // A sample at a near tie may change its top class; no more than one.
    let (cpu_accuracy, gpu_accuracy) = (
        cpu["accuracy"].as_f64().unwrap(),
        gpu["accuracy"].as_f64().unwrap(),
    );
    assert!(
        (cpu_accuracy - gpu_accuracy).abs() <= 1.0 / samples + 1e-12,
        "accuracy: GPU {gpu_accuracy}, CPU {cpu_accuracy}"
    );

    let images: Vec<PathBuf> = (0..3)
        .map(|index| {
            let path = dir.path().join(format!("image_{index}.png"));
            write_test_png(&path, index);
            path
        })
        .collect();
    let cpu = predict_logits(&checkpoint, &images, "cpu");
    let gpu = predict_logits(&checkpoint, &images, "cuda");
    assert_eq!(cpu.len(), images.len());
    assert_eq!(cpu.len(), gpu.len());
    for (image, (cpu, gpu)) in cpu.iter().zip(&gpu).enumerate() {
        for (class, (c, g)) in cpu.iter().zip(gpu).enumerate() {
            assert!(
                (c - g).abs() <= EVAL_TOLERANCE * (1.0 + c.abs()),
                "image {image}, class {class}: GPU {g}, CPU {c}"
            );
        }
    }
}

/// Writes a 32x32 RGB PNG of a pattern that depends on `seed`.
fn write_test_png(path: &Path, seed: usize) {
    let mut raw = Vec::with_capacity(32 * (1 + 32 * 3));
    for y in 0..32usize {
        raw.push(0); // filter: none
        for x in 0..32usize {
            for channel in 0..3usize {
                raw.push(((x * 7 + y * 13 + channel * 71 + seed * 101) % 256) as u8);
            }
        }
    }
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(&raw).unwrap();
    let compressed = encoder.finish().unwrap();
    let mut header = Vec::new();
    header.extend(32u32.to_be_bytes());
    header.extend(32u32.to_be_bytes());
    header.extend([8, 2, 0, 0, 0]); // 8 bits, RGB, deflate, no filter method, no interlace
    let mut png = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];
    for (kind, data) in [
        (*b"IHDR", header.as_slice()),
        (*b"IDAT", &compressed),
        (*b"IEND", &[][..]),
    ] {
        png.extend((data.len() as u32).to_be_bytes());
        let start = png.len();
        png.extend(kind);
        png.extend(data);
        let crc = crc32(&png[start..]);
        png.extend(crc.to_be_bytes());
    }
    std::fs::write(path, png).unwrap();
}

/// CRC-32 (ISO 3309, as PNG chunks use it).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The comparisons' own checks, run everywhere with the CPU on both sides: a snapshot resumed
/// on the same device meets them, eval and predict give their reports, and the test images
/// are valid PNGs.
#[test]
fn the_comparisons_hold_cpu_against_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight");
    train(&run_args(&straight, "cpu"));
    let across = dir.path().join("across");
    train_across(&across, "cpu", "cpu");
    assert_runs_close(&straight, &across, "cpu then cpu");
    let data = dir.path().join("cifar");
    write_cifar_bin(&data, 60, 32);
    let cifar = dir.path().join("cifar-run");
    let stdout = train(&cifar_run_args(&cifar, &data, "cpu"));
    assert!(!stdout.contains(DATA_ON_GPU), "{stdout}");
    assert_eq!(epoch_losses(&cifar).len(), 2, "the CIFAR fixture trains");
    let checkpoint = straight.join("epoch_2.safetensors");
    let report = eval_json(&checkpoint, "cpu");
    assert_eq!(report["samples"].as_u64(), Some(64));
    let image = dir.path().join("image.png");
    write_test_png(&image, 1);
    let logits = predict_logits(&checkpoint, &[image], "cpu");
    assert_eq!(logits.len(), 1);
    assert_eq!(logits[0].len(), 10);
}

#[test]
fn the_test_png_reads_back_as_written() {
    // Runs everywhere: the images of the predict comparison are valid PNGs.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("image.png");
    write_test_png(&path, 2);
    let image = tandem_data::read_image(&path).unwrap();
    assert_eq!((image.width, image.height), (32, 32));
    let expected = ((5 * 7 + 4 * 13 + 71 + 2 * 101) % 256) as f32 / 255.0;
    assert_eq!(image.pixels[(4 * 32 + 5) * 3 + 1], expected);
}

/// `bench step --device cuda` of the small model: the first line names the GPU, then the
/// CPU's three lines (positive rates) and a `graphs:` line saying that every timed training
/// step replayed the captured graph; with `TANDEM_CUDA_GRAPHS=0`, that they ran eagerly.
#[test]
fn bench_step_on_the_gpu_prints_its_figures_and_replays_graphs() {
    if !gpu_available("bench_step_on_the_gpu_prints_its_figures_and_replays_graphs") {
        return;
    }
    let bench = |graphs: &str| {
        let mut command = tandem();
        command
            .args(["bench", "step"])
            .args(SMALL_MODEL)
            .args(["--batch", "4", "--steps", "2", "--device", "cuda"])
            .args(["--precision", "fp32"])
            .env("TANDEM_CUDA_GRAPHS", graphs);
        expect_success(&run_bounded(&mut command, LIMIT))
    };
    let rate = |text: &str, name: &str| -> f64 {
        let line = text
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} line in {text}"));
        line.trim_end_matches(" img/s").parse().unwrap()
    };
    let text = bench("1");
    assert!(text.starts_with("device: cuda:0 ("), "{text}");
    assert!(
        rate(&text, "train: ") > 0.0 && rate(&text, "eval: ") > 0.0,
        "{text}"
    );
    assert!(text.contains("\npeak memory: "), "{text}");
    assert!(
        text.contains("\ngraphs: on; every timed training step replayed one captured CUDA graph"),
        "{text}"
    );
    let text = bench("0");
    assert!(
        text.contains("\ngraphs: off (") && text.contains("the timed training steps ran eagerly"),
        "{text}"
    );
}
