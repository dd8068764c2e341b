//! `--device`: the first line of output names the device and why; `cuda` without what it
//! needs is an error naming it.

mod common;

use std::time::Duration;

use common::{expect_success, run_bounded, tandem};

const LIMIT: Duration = Duration::from_secs(120);

/// A one-step benchmark of the small model, with `--device` and extra environment.
fn bench_step(device: &str, library_path: &std::path::Path) -> std::process::Output {
    run_bounded(
        tandem()
            .args(["bench", "step", "--model", "resnet-base", "--batch", "2"])
            .args(["--steps", "1", "--threads", "1", "--device", device])
            .env("TANDEM_CUDA_LIBRARY_PATH", library_path)
            .env_remove("CUDA_VISIBLE_DEVICES"),
        LIMIT,
    )
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
    // Without a GPU executor, auto takes the CPU on every machine, and says why.
    assert!(first.starts_with("device: cpu (auto: "), "{text}");
    assert!(
        first.contains("not found") || first.contains("not built yet") || first.contains("no GPU"),
        "{first}"
    );
    assert!(text.contains("train: "), "{text}");
}

#[test]
fn cuda_fails_with_the_reason_instead_of_pretending() {
    let empty = tempfile::tempdir().unwrap();
    for device in ["cuda", "cuda:0"] {
        let output = bench_step(device, empty.path());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{device} ran: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.starts_with(&format!("error: --device {device}: ")),
            "{stderr}"
        );
        if stderr.contains("libcuda not found") {
            // The missing library is named with the places searched and dlopen's reason.
            let folder = format!("TANDEM_CUDA_LIBRARY_PATH={}", empty.path().display());
            assert!(stderr.contains(&folder), "{stderr}");
            assert!(stderr.contains("libcuda.so.1"), "{stderr}");
        } else {
            assert!(
                stderr.contains("not found")
                    || stderr.contains("no GPU is visible")
                    || stderr.contains("the GPU executor is not built yet"),
                "{stderr}"
            );
        }
    }
}

#[test]
fn a_bad_device_value_is_refused_by_the_parser() {
    let output = run_bounded(tandem().args(["bench", "step", "--device", "gpu"]), LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("device `gpu` is not one of auto, cpu, cuda, cuda:N"),
        "{stderr}"
    );
}
