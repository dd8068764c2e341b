//! Helpers shared by the tests of tandem-cuda (each test file uses some of them).

#![allow(dead_code)]

pub mod gpu_rig;
pub mod kernel_checks;

use tandem_cuda::{Library, Probe};

/// Environment variable that turns a missing NVRTC from a skip into a failure (CI sets it).
pub const REQUIRE_NVRTC_ENV: &str = "TANDEM_REQUIRE_NVRTC";

/// This process's probe when it found NVRTC; otherwise prints why and returns `None` (the
/// test skips), or fails when [`REQUIRE_NVRTC_ENV`] is `1`.
pub fn probe_with_nvrtc(test: &str) -> Option<&'static Probe> {
    let probe = Probe::process();
    match probe.get(Library::Nvrtc) {
        Ok(_) => Some(probe),
        Err(missing) => {
            assert!(
                std::env::var(REQUIRE_NVRTC_ENV).as_deref() != Ok("1"),
                "{REQUIRE_NVRTC_ENV}=1, but {missing}"
            );
            eprintln!("{test}: skipped, {missing}");
            None
        }
    }
}

/// The probe, when the driver, NVRTC, cuBLAS, cuDNN, `extra` and a GPU are there; otherwise
/// prints why and returns `None` (the test skips), or fails under `TANDEM_REQUIRE_GPU=1`.
pub fn gpu_probe(test: &str, extra: &[Library]) -> Option<&'static Probe> {
    let mut libraries = vec![Library::Nvrtc, Library::Cublas, Library::Cudnn];
    libraries.extend_from_slice(extra);
    tandem_cuda::test_gpu_available(test, &libraries).then(Probe::process)
}

/// GPU 0, deterministic, at `precision`: the tests' executor settings.
pub fn gpu_settings(precision: tandem_cuda::Precision) -> tandem_cuda::GpuSettings {
    tandem_cuda::GpuSettings {
        ordinal: 0,
        precision,
        deterministic: true,
    }
}

/// An executor of `model` with [`gpu_settings`] and the tests' PTX cache.
pub fn executor(
    probe: &Probe,
    precision: tandem_cuda::Precision,
    model: &tandem_models::Model,
) -> tandem_cuda::CudaExecutor {
    tandem_cuda::CudaExecutor::new(probe, gpu_settings(precision), test_cache(), model).unwrap()
}

/// SGD with momentum 0.9 and weight decay 5e-4 (the tests' training runs) at `lr`.
pub fn momentum_sgd(lr: f32, nesterov: bool) -> tandem_engine::SgdConfig {
    tandem_engine::SgdConfig {
        momentum: 0.9,
        nesterov,
        weight_decay: 5e-4,
        ..tandem_engine::SgdConfig::with_lr(lr)
    }
}

/// A training step of `micro_batches` micro-batches of host `images` and their `labels`.
pub fn host_step<'a>(
    images: &'a [f32],
    labels: &'a [u32],
    micro_batches: usize,
    loss: &'a tandem_models::LossOptions,
    optimizer: tandem_cuda::executor::StepOptimizer<'a>,
) -> tandem_cuda::executor::TrainStep<'a> {
    tandem_cuda::executor::TrainStep {
        images: tandem_cuda::executor::StepImages::Host(images),
        labels,
        micro_batches,
        loss,
        optimizer,
    }
}

/// The torchrun tutorial's model (seed 004) with PyTorch's default initialization.
pub fn seed_004() -> tandem_models::Model {
    use tandem_models::{Model, ModelSpec, ResNetBaseSpec};
    Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())).unwrap()
}

/// The seed-004 model with one bottleneck block per stage instead of six. Its gradients are
/// well conditioned: those of the full model (18 blocks, at initialization, on the formula
/// batch) swing to a cosine of 0.3 when the images move by a bfloat16 rounding (4e-3), this
/// one's by 0.99, so a test of bfloat16 arithmetic against float32 can tell rounding from a
/// fault only on this one.
pub fn shallow_seed_004() -> tandem_models::Model {
    use tandem_models::{Model, ModelSpec, ResNetBaseSpec};
    let spec = ResNetBaseSpec {
        n_blocks: vec![1, 1, 1],
        ..ResNetBaseSpec::tutorial_default()
    };
    Model::new(&ModelSpec::ResNetBase(spec)).unwrap()
}

/// `batch` deterministic `side x side` RGB images in about [-1, 1) and their labels, different
/// for each `step`.
pub fn formula_batch(batch: usize, side: usize, step: u64) -> (Vec<f32>, Vec<u32>) {
    let images = (0..batch * side * side * 3)
        .map(|i| ((i as u64 * 2_654_435_761 + step * 7919) % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    let labels = (0..batch as u32)
        .map(|i| (i * 7 + 3 + step as u32) % 10)
        .collect();
    (images, labels)
}

/// The [`formula_batch`]es of `steps`, one after another (the micro-batches of one step).
pub fn formula_batches(
    batch: usize,
    side: usize,
    steps: impl IntoIterator<Item = u64>,
) -> (Vec<f32>, Vec<u32>) {
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for step in steps {
        let (more_images, more_labels) = formula_batch(batch, side, step);
        images.extend_from_slice(&more_images);
        labels.extend_from_slice(&more_labels);
    }
    (images, labels)
}

/// The disk cache of compiled kernels (and of cuDNN's algorithm choices) that the tests share
/// when `TANDEM_PTX_CACHE` names one, as the GPU check does: each kernel file is then compiled
/// once for every test binary, not once per test. `None` otherwise (CI), so that every test
/// compiles and measures afresh.
pub fn test_cache() -> Option<tandem_cuda::PtxCache> {
    std::env::var_os(tandem_cuda::ptx_cache::CACHE_DIR_ENV)
        .filter(|dir| !dir.is_empty())
        .map(tandem_cuda::PtxCache::new)
}

/// The NVRTC compiler for the architecture of `context`'s GPU, with [`test_cache`].
pub fn compiler_for(
    probe: &Probe,
    context: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> tandem_cuda::Compiler {
    let (major, minor) = context.compute_capability().expect("compute capability");
    let arch = tandem_cuda::GpuArch {
        major: major as u32,
        minor: minor as u32,
    };
    tandem_cuda::Compiler::new(probe, arch, test_cache()).expect("NVRTC")
}
