//! What the executor does when CUDA's libraries refuse something that the fake GPU can be told
//! to refuse: a library call that allocates inside a thread-local capture (the capture is
//! tried again in relaxed mode), and a convolution algorithm refused when it runs (the error
//! names it and every measured candidate).
//!
//! Alone in its test binary: the fake GPU's knobs are environment variables read at each
//! call, so the tests here take turns (`KNOBS`) and each sets its knob only while it runs. On
//! a real GPU the knobs do nothing: the capture test then checks graphed steps against eager
//! ones in whichever mode CUDA accepted, and the refusal test skips.

mod common;

use std::sync::{Mutex, MutexGuard};

use common::kernel_checks::assert_bits_equal;
use common::{formula_batch, gpu_probe, host_step, momentum_sgd, shallow_seed_004};
use tandem_cuda::executor::graph::StepRun;
use tandem_cuda::executor::StepOptimizer;
use tandem_cuda::{CudaExecutor, Precision};
use tandem_engine::SgdConfig;
use tandem_models::workspace::Mode;
use tandem_models::LossOptions;

/// The fake libraries' knob for a library call that allocates inside a capture.
const ALLOCATES_IN_CAPTURE: &str = "TANDEM_FAKE_GPU_LIBRARIES_ALLOCATE_IN_CAPTURE";
/// The fake cuDNN's knob for a backward-filter algorithm refused when it runs.
const REFUSE_BACKWARD_FILTER: &str = "TANDEM_FAKE_CUDNN_REFUSE_BACKWARD_FILTER";

/// Held by each test while its knob is set.
static KNOBS: Mutex<()> = Mutex::new(());

/// Sets an environment variable until dropped, holding [`KNOBS`] meanwhile.
struct Knob {
    name: &'static str,
    _turn: MutexGuard<'static, ()>,
}

impl Knob {
    fn set(name: &'static str) -> Knob {
        let turn = KNOBS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        std::env::set_var(name, "1");
        Knob { name, _turn: turn }
    }
}

impl Drop for Knob {
    fn drop(&mut self) {
        std::env::remove_var(self.name);
    }
}

/// Whether the GPU is the fake one (whose knobs work).
fn fake_gpu() -> bool {
    std::env::var_os("TANDEM_FAKE_GPU_KERNELS").is_some()
}

const BATCH: usize = 8;
const SIDE: usize = 16;

#[test]
fn a_capture_refused_in_thread_local_mode_is_captured_again_in_relaxed_mode() {
    let test = "a_capture_refused_in_thread_local_mode_is_captured_again_in_relaxed_mode";
    let Some(probe) = gpu_probe(test, &[]) else {
        return;
    };
    let _knob = Knob::set(ALLOCATES_IN_CAPTURE);
    let model = shallow_seed_004();
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let mut graphed = common::executor(probe, Precision::Fp32, &model);
    let mut eager = common::executor(probe, Precision::Fp32, &model);
    graphed.set_graphs(true);
    eager.set_graphs(false);
    let loss = LossOptions::default();
    let mut runs = Vec::new();
    let mut relaxed_notes = Vec::new();
    for step in 0..4u64 {
        let (images, labels) = formula_batch(BATCH, SIDE, step);
        let config = momentum_sgd(0.05 / (step + 1) as f32, false);
        let mut losses = Vec::new();
        for (exec, graphs) in [(&mut graphed, true), (&mut eager, false)] {
            let step = host_step(&images, &labels, 1, &loss, StepOptimizer::Sgd(&config));
            let outcome = exec.train_step(&model, &plan, step).unwrap();
            if graphs {
                assert_eq!(outcome.graphs_off, None, "graphs stay on");
            }
            losses.push(outcome.losses[0]);
            runs.push(outcome.run);
            relaxed_notes.push(outcome.relaxed_capture);
        }
        assert_bits_equal(&losses[..1], &losses[1..], &format!("step {step}: loss"));
    }
    let mut params = [
        vec![0.0; model.params().len()],
        vec![0.0; model.params().len()],
    ];
    graphed.params_to_host(&mut params[0]).unwrap();
    eager.params_to_host(&mut params[1]).unwrap();
    assert_bits_equal(&params[0], &params[1], "parameters after four steps");
    let graphed_runs: Vec<StepRun> = runs.iter().step_by(2).copied().collect();
    use StepRun::{Capture, Eager, Replay};
    assert_eq!(graphed_runs, [Eager, Capture, Replay, Replay]);
    assert!(graphed.graphs_on());
    let graphed_notes: Vec<&Option<String>> = relaxed_notes.iter().step_by(2).collect();
    if !fake_gpu() {
        eprintln!("{test}: relaxed capture notes on a real GPU: {graphed_notes:?}");
        return;
    }
    // On the fake GPU the thread-local capture is refused at the first convolution; the note
    // of the relaxed capture comes once, with the step that was captured.
    let note = graphed_notes[1].as_deref().unwrap_or_else(|| {
        panic!("the captured step should say why it was captured in relaxed mode")
    });
    assert!(
        note.contains("cudnnConvolutionForward")
            && note.contains("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
        "{note}"
    );
    assert!(
        [0, 2, 3].iter().all(|&step| graphed_notes[step].is_none()),
        "{graphed_notes:?}"
    );
}

#[test]
fn a_convolution_algorithm_refused_when_it_runs_is_named_with_every_candidate() {
    let test = "a_convolution_algorithm_refused_when_it_runs_is_named_with_every_candidate";
    let Some(probe) = gpu_probe(test, &[]) else {
        return;
    };
    if !fake_gpu() {
        eprintln!("{test}: skipped, only the fake cuDNN can be made to refuse an algorithm");
        return;
    }
    let _knob = Knob::set(REFUSE_BACKWARD_FILTER);
    let model = shallow_seed_004();
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    // No algorithm store: the error lists the candidates measured in this process.
    let mut exec =
        CudaExecutor::new(probe, common::gpu_settings(Precision::Fp32), None, &model).unwrap();
    exec.set_graphs(false);
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let (config, loss) = (SgdConfig::with_lr(0.1), LossOptions::default());
    let step = host_step(&images, &labels, 1, &loss, StepOptimizer::Sgd(&config));
    let error = exec
        .train_step(&model, &plan, step)
        .unwrap_err()
        .to_string();
    // The fake cuDNN measures ALGO_0 and ALGO_3 (not deterministic) and ALGO_1; deterministic
    // mode chose ALGO_1.
    for expected in [
        "cudnnConvolutionBackwardFilter failed: CUDNN_STATUS_NOT_SUPPORTED for the backward \
         filter algorithm chosen for convolution",
        ", algorithm 1 (CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1): CUDNN_STATUS_SUCCESS, \
         CUDNN_FMA_MATH, deterministic",
        "; measured candidates: algorithm 0 (CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0)",
        "algorithm 3 (CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3): CUDNN_STATUS_SUCCESS, \
         CUDNN_FMA_MATH, not deterministic",
    ] {
        assert!(error.contains(expected), "{expected:?} not in: {error}");
    }
}
