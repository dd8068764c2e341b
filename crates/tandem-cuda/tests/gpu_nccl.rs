//! The executor's NCCL group on one GPU (NCCL refuses two ranks on one GPU, so only world
//! size 1 runs on the reference machine): a backward whose buckets are all-reduced on NCCL's
//! stream leaves the gradients of a plain backward bit for bit, and the device broadcasts
//! leave the parameters and running statistics as they were; a communicator of two ranks
//! whose second rank never joins ends in an error within the timeout, not a hang.
//!
//! Skipped with a printed reason without a driver, the CUDA libraries, libnccl or a GPU (as
//! on CI's machines); **it has not yet run on a GPU**.

use std::time::{Duration, Instant};

use tandem_cuda::nccl::create_unique_id;
use tandem_cuda::{
    CollectiveError, CudaExecutor, GpuError, GpuSettings, Library, Precision, Probe,
};
use tandem_models::workspace::Mode;
use tandem_models::{LossOptions, Model, ModelSpec, ResNetBaseSpec};

const BATCH: usize = 8;
const SIDE: usize = 32;

/// The probe, when the driver, NVRTC, cuBLAS, cuDNN, NCCL and a GPU are there; else prints why.
fn gpu_probe(test: &str) -> Option<&'static Probe> {
    let probe = Probe::process();
    match tandem_cuda::why_no_gpu(
        probe,
        &[
            Library::Nvrtc,
            Library::Cublas,
            Library::Cudnn,
            Library::Nccl,
        ],
    ) {
        None => Some(probe),
        Some(reason) => {
            eprintln!("{test}: skipped, {reason}");
            None
        }
    }
}

fn model() -> Model {
    let mut model = Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())).unwrap();
    model.init_default(5);
    model
}

fn executor(probe: &Probe, model: &Model) -> CudaExecutor {
    let settings = GpuSettings {
        ordinal: 0,
        precision: Precision::Fp32,
        deterministic: true,
    };
    CudaExecutor::new(probe, settings, None, model).unwrap()
}

/// Deterministic images in about [-1, 1) and labels.
fn batch() -> (Vec<f32>, Vec<u32>) {
    let images = (0..BATCH * SIDE * SIDE * 3)
        .map(|i| ((i as u64 * 2_654_435_761) % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    let labels = (0..BATCH as u32).map(|i| (i * 7 + 3) % 10).collect();
    (images, labels)
}

/// Small buckets over `len` gradients, so that many are all-reduced during the backward.
fn buckets(len: usize) -> Vec<std::ops::Range<usize>> {
    (0..len)
        .step_by(4096)
        .map(|start| start..(start + 4096).min(len))
        .collect()
}

/// The gradients, parameters and running statistics after one forward and backward, with
/// the backward all-reduced through a world-size-1 NCCL group or plain.
fn one_step(probe: &Probe, through_nccl: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let model = model();
    let mut exec = executor(probe, &model);
    if through_nccl {
        let id = create_unique_id(probe).unwrap();
        let len = model.params().len();
        exec.join_nccl(probe, &id, 0, 1, Duration::from_secs(30), buckets(len))
            .unwrap();
        exec.broadcast_params_and_buffers().unwrap();
    }
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let (images, labels) = batch();
    let loss = LossOptions::default();
    exec.zero_grads().unwrap();
    if through_nccl {
        exec.broadcast_buffers().unwrap();
    }
    exec.forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    if through_nccl {
        exec.backward_all_reduced(&model, &plan, 1.0, None).unwrap();
        exec.finish_all_reduce().unwrap();
        exec.nccl_health().unwrap();
    } else {
        exec.backward(&model, &plan, 1.0, None, None).unwrap();
    }
    let mut grads = vec![0.0; model.params().len()];
    let mut params = vec![0.0; model.params().len()];
    let mut buffers = vec![0.0; model.buffers().len()];
    exec.grads_to_host(&mut grads).unwrap();
    exec.params_to_host(&mut params).unwrap();
    exec.buffers_to_host(&mut buffers).unwrap();
    (grads, params, buffers)
}

#[test]
fn a_world_of_one_through_nccl_leaves_every_bit_as_without_it() {
    let Some(probe) = gpu_probe("a_world_of_one_through_nccl_leaves_every_bit_as_without_it")
    else {
        return;
    };
    let plain = one_step(probe, false);
    let through_nccl = one_step(probe, true);
    assert!(plain.0 == through_nccl.0, "gradients differ");
    assert!(plain.1 == through_nccl.1, "parameters differ");
    assert!(plain.2 == through_nccl.2, "running statistics differ");
    assert!(
        plain.0.iter().any(|&grad| grad != 0.0),
        "no gradient at all"
    );
}

#[test]
fn a_rank_that_never_joins_ends_the_join_within_the_timeout() {
    let Some(probe) = gpu_probe("a_rank_that_never_joins_ends_the_join_within_the_timeout") else {
        return;
    };
    let model = model();
    let mut exec = executor(probe, &model);
    let id = create_unique_id(probe).unwrap();
    let len = model.params().len();
    let started = Instant::now();
    let error = exec
        .join_nccl(probe, &id, 0, 2, Duration::from_secs(3), buckets(len))
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(
            error,
            GpuError::Collective(CollectiveError::JoinTimedOut { world_size: 2, .. })
        ),
        "{error}"
    );
    assert!(waited < Duration::from_secs(10), "took {waited:?}");
    assert!(!exec.has_nccl());
    assert!(matches!(
        exec.finish_all_reduce(),
        Err(GpuError::NoCommunicator)
    ));
}
