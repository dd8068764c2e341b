//! `--precision bf16` on a GPU: the conversion kernels of `convert.cu` bit-equal to the host
//! reference (`tandem_cuda::bf16`) on odd lengths and on every bfloat16; one training step of
//! the seed-004 model in bf16 against the fp32 CPU executor within bf16 tolerances; and two
//! backwards accumulating exactly twice one (the bfloat16 gradients are added into the float32
//! ones as fp32 adds them). Skipped with a printed reason without the driver, the CUDA
//! libraries or a GPU (as on CI's machines); **it has not yet run on a GPU**.

mod common;

use std::sync::Arc;

use common::{formula_batch, gpu_probe, seed_004};
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use tandem_cuda::bf16::{bf16_bits_to_f32, f32_to_bf16_bits};
use tandem_cuda::{CudaExecutor, GpuSettings, Precision, Probe};
use tandem_models::workspace::Mode;
use tandem_models::{Executor, LossOptions, Model};

const BATCH: usize = 8;
const SIDE: usize = 32;

/// The loss of one bf16 step against fp32, relative. Each bfloat16 operand carries a relative
/// rounding error of at most 2^-9 (about 2e-3); a convolution output sums products of two
/// rounded operands (at most about 4e-3 each, of random signs, so their sum's error is
/// usually far smaller) and is rounded once more; batch norm renormalizes each layer, so the
/// errors of the model's ten-odd layers add rather than multiply, to about 1e-2 at worst on
/// the logits. The loss (about ln 10 at initialization, label smoothing 0.1) moves by less
/// than the logits do, so 2e-2 bounds it with room, while a convolution computed on the
/// wrong data (a missing conversion, a wrong layout) moves it by far more.
const LOSS_TOLERANCE: f32 = 2e-2;
/// The cosine similarity of the bf16 gradients (all of them, one vector) to the fp32 CPU's:
/// per-element errors of a few percent of the typical magnitude give about 1 - 1e-3; a
/// layer's gradient lost or counted twice gives far less.
const GRADIENT_COSINE: f64 = 0.99;
/// The bf16 gradient vector's norm against the CPU's, relative.
const GRADIENT_NORM_TOLERANCE: f64 = 5e-2;

/// `convert.cu` loaded on GPU 0.
struct Converter {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

impl Converter {
    fn open(probe: &Probe) -> Converter {
        let context = CudaContext::new(0).expect("cannot open GPU 0");
        let compiler = common::compiler_for(probe, &context);
        let source = tandem_cuda::kernels::kernel("convert").expect("convert.cu");
        let (compiled, _) = compiler.compile(source).unwrap_or_else(|e| panic!("{e}"));
        let module = context
            .load_module(Ptx::from_binary(compiled.cubin))
            .expect("loading convert.cu");
        Converter {
            stream: context.default_stream(),
            module,
        }
    }

    /// Runs `kernel(input, n, output)` over `input` into `output`, and returns `output`.
    fn run<I, O>(&self, kernel: &str, input: &[I], output: &[O]) -> Vec<O>
    where
        I: cudarc::driver::DeviceRepr,
        O: cudarc::driver::DeviceRepr + Default + Clone,
    {
        let function = self.module.load_function(kernel).expect(kernel);
        let input_device = self.stream.clone_htod(input).expect("upload");
        let mut output_device: CudaSlice<O> = self.stream.clone_htod(output).expect("upload");
        let n = input.len() as i64;
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(&input_device).arg(&n).arg(&mut output_device);
        let config = LaunchConfig {
            grid_dim: (input.len().div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (const input*, long long, output*) as convert.cu's kernels take them; both
        // buffers hold n elements.
        unsafe { launch.launch(config) }.expect(kernel);
        self.stream.clone_dtoh(&output_device).expect("download")
    }
}

/// An odd count of floats: the cases of the host reference's tests, then a spread of bit
/// patterns over all of float32 (every sign, exponent, NaN and subnormal region).
fn narrowing_inputs() -> Vec<f32> {
    let mut values: Vec<f32> = [
        0x3f80_8000u32,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0xbf80_8000,
        0x3fff_ffff,
        0x7f7f_8000,
        0x7f7f_7fff,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fa0_0000,
        0x0000_0001,
        0x8000_0001,
        0x0000_8000,
        0x0000_8001,
        0x0001_8000,
        0x007f_ffff,
        0x0000_0000,
        0x8000_0000,
    ]
    .into_iter()
    .map(f32::from_bits)
    .collect();
    values.extend((0..100_003u32).map(|i| f32::from_bits(i.wrapping_mul(42_943))));
    assert!(!values.len().is_multiple_of(2), "an odd count");
    values
}

#[test]
fn the_conversion_kernels_equal_the_host_reference_bit_for_bit() {
    let Some(probe) = gpu_probe(
        "the_conversion_kernels_equal_the_host_reference_bit_for_bit",
        &[],
    ) else {
        return;
    };
    let gpu = Converter::open(probe);
    let inputs = narrowing_inputs();
    let narrowed = gpu.run("float_to_bf16", &inputs, &vec![0u16; inputs.len()]);
    for (i, (&value, &bits)) in inputs.iter().zip(&narrowed).enumerate() {
        assert_eq!(
            bits,
            f32_to_bf16_bits(value),
            "float_to_bf16[{i}] of {:#010x}",
            value.to_bits()
        );
    }
    // Every bfloat16 but the last (an odd count), widened exactly.
    let every: Vec<u16> = (0..u16::MAX).collect();
    let widened = gpu.run("bf16_to_float", &every, &vec![0f32; every.len()]);
    for (&bits, &value) in every.iter().zip(&widened) {
        assert_eq!(
            value.to_bits(),
            bf16_bits_to_f32(bits).to_bits(),
            "{bits:#06x}"
        );
    }
    // The widening add is one IEEE float add (NaN payloads aside, which the GPU may not keep).
    let finite: Vec<u16> = every
        .iter()
        .copied()
        .filter(|&bits| !bf16_bits_to_f32(bits).is_nan())
        .collect();
    let targets: Vec<f32> = (0..finite.len())
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    let sums = gpu.run("bf16_add_to_float", &finite, &targets);
    for (i, ((&bits, &target), &sum)) in finite.iter().zip(&targets).zip(&sums).enumerate() {
        let expected = target + bf16_bits_to_f32(bits);
        if expected.is_nan() {
            assert!(sum.is_nan(), "bf16_add_to_float[{i}]");
        } else {
            assert_eq!(sum.to_bits(), expected.to_bits(), "bf16_add_to_float[{i}]");
        }
    }
}

fn bf16_executor(probe: &Probe, model: &Model) -> CudaExecutor {
    let settings = GpuSettings {
        ordinal: 0,
        precision: Precision::Bf16,
        deterministic: true,
    };
    CudaExecutor::new(probe, settings, None, model).unwrap()
}

/// Cosine similarity and norm ratio of `found` to `expected`, in f64.
fn cosine_and_norm_ratio(found: &[f32], expected: &[f32]) -> (f64, f64) {
    let (mut dot, mut found_sq, mut expected_sq) = (0.0f64, 0.0f64, 0.0f64);
    for (&f, &e) in found.iter().zip(expected) {
        let (f, e) = (f64::from(f), f64::from(e));
        dot += f * e;
        found_sq += f * f;
        expected_sq += e * e;
    }
    (
        dot / (found_sq.sqrt() * expected_sq.sqrt()),
        found_sq.sqrt() / expected_sq.sqrt(),
    )
}

#[test]
fn a_bf16_training_step_is_within_bf16_tolerances_of_the_fp32_cpu() {
    let Some(probe) = gpu_probe(
        "a_bf16_training_step_is_within_bf16_tolerances_of_the_fp32_cpu",
        &[],
    ) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions {
        label_smoothing: 0.1,
    };
    let mut cpu = seed_004();
    let cpu_loss = cpu
        .forward_train(&images, BATCH, SIDE, SIDE, &labels, &loss, None)
        .unwrap();
    cpu.backward(1.0, None, &mut |_, _| {}).unwrap();

    let model = seed_004();
    let mut exec = bf16_executor(probe, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    let gpu_loss = exec
        .forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut logits = Vec::new();
    exec.logits_to_host(&mut logits);
    exec.take_error().unwrap();

    let loss_error = (gpu_loss - cpu_loss).abs() / cpu_loss.abs();
    eprintln!("bf16 loss {gpu_loss}, fp32 CPU {cpu_loss}: relative error {loss_error:e}");
    assert!(
        loss_error <= LOSS_TOLERANCE,
        "loss bf16 {gpu_loss} CPU {cpu_loss} (relative error {loss_error:e} > {LOSS_TOLERANCE:e})"
    );
    assert!(logits.iter().all(|value| value.is_finite()), "{logits:?}");
    let mut grads = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut grads).unwrap();
    let (cosine, norm_ratio) = cosine_and_norm_ratio(&grads, cpu.grads());
    eprintln!("bf16 gradients: cosine {cosine}, norm ratio {norm_ratio}");
    assert!(cosine >= GRADIENT_COSINE, "gradient cosine {cosine}");
    assert!(
        (norm_ratio - 1.0).abs() <= GRADIENT_NORM_TOLERANCE,
        "gradient norm ratio {norm_ratio}"
    );
}

#[test]
fn two_bf16_backwards_accumulate_exactly_twice_one() {
    let Some(probe) = gpu_probe("two_bf16_backwards_accumulate_exactly_twice_one", &[]) else {
        return;
    };
    let (images, labels) = formula_batch(BATCH, SIDE, 0);
    let loss = LossOptions::default();
    let model = seed_004();
    let mut exec = bf16_executor(probe, &model);
    let plan = model.plan(Mode::Train, BATCH, SIDE, SIDE).unwrap();
    exec.forward_train(&model, &plan, &images, &labels, &loss, None)
        .unwrap();
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut once = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut once).unwrap();
    // The same backward again (deterministic algorithms: the same bfloat16 gradients), added
    // to the first: x + x is exact, so every gradient must be exactly twice the first.
    exec.backward(&model, &plan, 1.0, None, None).unwrap();
    let mut twice = vec![0.0; model.params().len()];
    exec.grads_to_host(&mut twice).unwrap();
    assert!(once.iter().any(|&value| value != 0.0), "no gradient at all");
    for (i, (&one, &two)) in once.iter().zip(&twice).enumerate() {
        assert_eq!(
            two.to_bits(),
            (2.0 * one).to_bits(),
            "gradient {i}: {one} then {two}"
        );
    }
}
