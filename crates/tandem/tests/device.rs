//! `--device`: the first line of output names the device and why; `cuda` without what it
//! needs is an error naming it.

mod common;

use std::time::Duration;

use common::{assert_contains, expect_success, run_bounded, run_folder, tandem};

const LIMIT: Duration = Duration::from_secs(120);

/// A one-step benchmark of the small model with `--device`. Without a GPU here, the CUDA
/// libraries are searched for in `library_path` first (an empty folder, named in the errors);
/// with one, in the places this test was given.
fn bench_step(device: &str, library_path: &std::path::Path) -> std::process::Output {
    bench_step_with(device, library_path, &[])
}

/// [`bench_step`] with `extra` flags.
fn bench_step_with(
    device: &str,
    library_path: &std::path::Path,
    extra: &[&str],
) -> std::process::Output {
    let mut command = tandem();
    command
        .args(["bench", "step", "--model", "resnet-base", "--batch", "2"])
        .args(["--steps", "1", "--threads", "1", "--device", device])
        .args(extra)
        .env_remove("CUDA_VISIBLE_DEVICES");
    if !gpu_here() {
        command.env("TANDEM_CUDA_LIBRARY_PATH", library_path);
    }
    run_bounded(&mut command, LIMIT)
}

/// Whether this machine has what `--device cuda` needs (the libraries and a visible GPU).
fn gpu_here() -> bool {
    let facts = tandem_cuda::device::GpuFacts::gather(tandem_cuda::Probe::process());
    facts.missing_library.is_none() && matches!(facts.visible_gpus, Ok(count) if count > 0)
}

/// Where there is a GPU: `bench step` on it with `extra` flags, whose first line says
/// `setting`; its output.
fn bench_step_on_gpu(
    library_path: &std::path::Path,
    extra: &[&str],
    setting: &str,
) -> Option<String> {
    if !gpu_here() {
        return None;
    }
    let text = expect_success(&bench_step_with("cuda", library_path, extra));
    let first = text.lines().next().unwrap_or_default();
    assert!(first.contains(setting), "{first}");
    Some(text)
}

/// `bench step` on the CPU with `extra` flags that apply to a GPU only: its first line
/// names the CPU and it says `note`; its output.
fn bench_step_on_cpu(library_path: &std::path::Path, extra: &[&str], note: &str) -> String {
    let output = bench_step_with("cpu", library_path, extra);
    let text = expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        text.lines().next(),
        Some("device: cpu (requested)"),
        "{text}"
    );
    assert_contains(&stderr, note);
    text
}

#[test]
fn the_first_line_names_the_device_and_why() {
    let empty = tempfile::tempdir().unwrap();
    let text = expect_success(&bench_step("cpu", empty.path()));
    assert_eq!(
        text.lines().next(),
        Some("device: cpu (requested)"),
        "{text}"
    );
    let text = expect_success(&bench_step("auto", empty.path()));
    let first = text.lines().next().unwrap_or_default();
    if gpu_here() {
        assert!(first.starts_with("device: cuda:0 (first of "), "{text}");
        assert!(
            first.ends_with("; GPU executor unverified on a GPU)"),
            "{first}"
        );
    } else {
        // Auto takes the CPU and says why.
        assert!(first.starts_with("device: cpu (auto: "), "{text}");
        assert!(
            first.contains("not found") || first.contains("no GPU"),
            "{first}"
        );
    }
    assert_contains(&text, "train: ");
}

#[test]
fn cuda_runs_on_a_gpu_or_fails_with_the_reason_instead_of_pretending() {
    let empty = tempfile::tempdir().unwrap();
    let gpu = gpu_here();
    for device in ["cuda", "cuda:0"] {
        let output = bench_step(device, empty.path());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        if gpu {
            let text = expect_success(&output);
            let reason = if device == "cuda" {
                "first of "
            } else {
                "requested"
            };
            let first = text.lines().next().unwrap_or_default();
            assert!(
                first.starts_with(&format!("device: cuda:0 ({reason}")),
                "{text}"
            );
            assert!(
                first.contains("; precision tf32, deterministic algorithms; "),
                "{first}"
            );
            assert_contains(&text, "peak memory: ");
            continue;
        }
        assert!(!output.status.success(), "{device} ran: {stderr}");
        assert!(
            stderr.starts_with(&format!("error: --device {device}: ")),
            "{stderr}"
        );
        if stderr.contains("libcuda not found") {
            // The missing library is named with the places searched and dlopen's reason.
            let folder = format!("TANDEM_CUDA_LIBRARY_PATH={}", empty.path().display());
            assert_contains(&stderr, &folder);
            assert_contains(&stderr, "libcuda.so.1");
        } else {
            assert!(
                stderr.contains("not found") || stderr.contains("no GPU is visible"),
                "{stderr}"
            );
        }
    }
}

#[test]
fn train_eval_and_predict_take_the_device_flags() {
    let (_dir, out) = run_folder();
    let train = |extra: &[&str]| {
        let mut args = common::small_synthetic_run(&out);
        args.extend(extra.iter().map(|arg| arg.to_string()));
        args.extend(["--max-steps".to_string(), "1".to_string()]);
        run_bounded(tandem().args(&args), LIMIT)
    };
    // On the CPU, tf32 and bf16 are a note, and the run is the CPU's.
    for precision in ["bf16", "tf32"] {
        let output = train(&["--device", "cpu", "--precision", precision]);
        let stdout = expect_success(&output);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!(
                "note: --precision {precision} applies to a GPU; the CPU computes in fp32"
            )),
            "{stderr}"
        );
        assert_eq!(stdout.lines().next(), Some("device: cpu (requested)"));
        assert_contains(&stdout, "| device: cpu |");
    }
    let checkpoint = out.join("snapshot.safetensors").display().to_string();
    let mut eval_args = vec!["eval", "--checkpoint", &checkpoint, "--json"];
    eval_args.extend(common::SMALL_MODEL);
    if !gpu_here() {
        // Without a GPU, eval and predict with --device cuda fail naming what is missing.
        for command in [
            &eval_args[..],
            &["predict", "--checkpoint", &checkpoint, "x.png"],
        ] {
            let output = run_bounded(tandem().args(command).args(["--device", "cuda"]), LIMIT);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
            assert!(stderr.starts_with("error: --device cuda: "), "{stderr}");
        }
    }
    let output = run_bounded(
        tandem()
            .args(&eval_args)
            .args(["--device", "auto", "--precision", "fp32"]),
        LIMIT,
    );
    let stdout = expect_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.starts_with("device: "), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["samples"].as_u64(), Some(64));
}

#[test]
fn bench_step_takes_bf16_and_names_it_first() {
    let empty = tempfile::tempdir().unwrap();
    let flags = ["--precision", "bf16"];
    // On a GPU: the bf16 step runs, and the first line names its precision.
    let setting = "; precision bf16, deterministic algorithms; ";
    if let Some(text) = bench_step_on_gpu(empty.path(), &flags, setting) {
        let first = text.lines().next().unwrap_or_default();
        assert!(first.starts_with("device: cuda:0 ("), "{text}");
        assert!(
            text.contains("train: ") && text.contains("peak memory: "),
            "{text}"
        );
    }
    // On the CPU: a note, and the CPU's step.
    let note = "note: --precision bf16 applies to a GPU; the CPU computes in fp32";
    let text = bench_step_on_cpu(empty.path(), &flags, note);
    assert_contains(&text, "train: ");
}

#[test]
fn a_bad_device_value_is_refused_by_the_parser() {
    let output = run_bounded(tandem().args(["bench", "step", "--device", "gpus"]), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert_contains(
        &stderr,
        "device `gpus` is not one of auto, cpu, cuda, cuda:N",
    );
    let output = run_bounded(tandem().args(["bench", "step", "--device", "npu"]), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert_contains(&stderr, "Tandem does not run on Ascend NPUs");
}

#[test]
fn bench_step_takes_the_fastest_algorithms_and_names_them_first() {
    let empty = tempfile::tempdir().unwrap();
    let flags = ["--algorithms", "fastest"];
    // On a GPU: the step runs with the fastest measured algorithms, said first.
    let on_gpu = bench_step_on_gpu(
        empty.path(),
        &flags,
        "; precision tf32, fastest algorithms; ",
    );
    if let Some(text) = on_gpu {
        assert_contains(&text, "train: ");
    }
    // On the CPU: a note, and the CPU's (deterministic) step.
    let note = "note: --algorithms fastest applies to a GPU; the CPU is deterministic";
    bench_step_on_cpu(empty.path(), &flags, note);
    let output = bench_step_with("cpu", empty.path(), &["--algorithms", "fast"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("invalid value 'fast' for '--algorithms")
            && stderr.contains("deterministic, fastest"),
        "{stderr}"
    );
}
