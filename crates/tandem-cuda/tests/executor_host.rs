//! The GPU executor's host-side pieces, checked without a GPU: NHWC descriptor geometry, the
//! algorithm choice and its cache key, the cuBLAS products of the linear layer (run by a
//! column-major reference GEMM against the CPU engine), the device storage sizes of a real
//! plan, and a missing library reported as an error rather than a panic.

use std::collections::HashSet;

use cudarc::cudnn::sys::cudnnDataType_t::{CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT};
use cudarc::cudnn::sys::cudnnMathType_t::{
    CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH, CUDNN_TENSOR_OP_MATH,
};
use cudarc::cudnn::sys::cudnnStatus_t::{CUDNN_STATUS_NOT_SUPPORTED, CUDNN_STATUS_SUCCESS};
use tandem_cuda::executor::algorithm::{choose, math_allowed, Candidate, ConvKey};
use tandem_cuda::executor::conv::{
    compute_type, descriptor_math, nhwc_strides, operand_type, ConvGeometry,
};
use tandem_cuda::executor::launch::{row_blocks, ROWS_PER_BLOCK};
use tandem_cuda::executor::linear::{bf16_types, math_mode, Gemm, LinearShape};
use tandem_cuda::executor::memory::{Bf16ScratchSizes, StatePart, StorageSizes};
use tandem_cuda::executor::{precision_supported, AdamScalars};
use tandem_cuda::{CudaExecutor, GpuArch, GpuError, GpuSettings, Precision, Probe, SearchPath};
use tandem_engine::shape::Conv2dShape;
use tandem_engine::AdamConfig;
use tandem_models::workspace::Mode;
use tandem_models::{Model, ModelSpec, ResNetBaseSpec};
use tandem_testdata::{assert_close, Tolerance};

fn shape() -> Conv2dShape {
    Conv2dShape {
        batch: 3,
        in_height: 7,
        in_width: 5,
        in_channels: 4,
        out_channels: 6,
        kernel: 3,
        stride: 2,
        padding: 1,
    }
}

#[test]
fn nhwc_strides_address_the_engines_layout() {
    let (channels, height, width) = (4, 7, 5);
    let strides = nhwc_strides(channels, height, width);
    for n in 0..2 {
        for c in 0..channels {
            for h in 0..height {
                for w in 0..width {
                    let engine = ((n * height + h) * width + w) * channels + c;
                    let cudnn = n * strides[0] + c * strides[1] + h * strides[2] + w * strides[3];
                    assert_eq!(cudnn, engine, "(n {n}, c {c}, h {h}, w {w})");
                }
            }
        }
    }
}

#[test]
fn the_geometry_has_the_engines_output_size_and_an_ohwi_filter() {
    let shape = shape();
    let geometry = ConvGeometry::new(&shape).unwrap();
    assert_eq!(geometry.input, [3, 4, 7, 5]);
    assert_eq!(geometry.input_strides, [140, 1, 20, 4]);
    // (7 + 2 - 3) / 2 + 1 = 4, (5 + 2 - 3) / 2 + 1 = 3.
    assert_eq!(
        (shape.out_height(), shape.out_width()),
        (4, 3),
        "engine's output size"
    );
    assert_eq!(geometry.output, [3, 6, 4, 3]);
    assert_eq!(geometry.output_strides, [72, 1, 18, 6]);
    assert_eq!(geometry.filter, [6, 4, 3, 3]);
    assert_eq!((geometry.padding, geometry.stride), (1, 2));
}

#[test]
fn a_size_beyond_an_int_is_an_error_naming_it() {
    let mut big = shape();
    big.batch = 1 << 29;
    let error = ConvGeometry::new(&big).unwrap_err();
    assert!(
        matches!(
            error,
            GpuError::TooLarge {
                what: "input elements",
                ..
            }
        ),
        "{error}"
    );
}

fn candidate(algo: u32, time_ms: f32, deterministic: bool) -> Candidate<u32> {
    Candidate {
        algo,
        status: CUDNN_STATUS_SUCCESS,
        time_ms,
        memory: 1024,
        deterministic,
        math: CUDNN_FMA_MATH,
    }
}

#[test]
fn the_fastest_admitted_algorithm_is_chosen_or_when_deterministic_the_lowest() {
    let candidates = [
        candidate(0, 0.5, false),
        candidate(1, 0.7, true),
        candidate(2, 0.6, true),
        Candidate {
            status: CUDNN_STATUS_NOT_SUPPORTED,
            ..candidate(3, 0.1, true)
        },
        Candidate {
            memory: 1 << 40,
            ..candidate(4, 0.2, true)
        },
    ];
    let free = choose(&candidates, Precision::Fp32, false, 1 << 30).unwrap();
    assert_eq!(free.algo, 0);
    // Deterministic mode takes the lowest-numbered admitted algorithm (1, slower than 2), so
    // that another process measuring other timings computes with the same one.
    let deterministic = choose(&candidates, Precision::Fp32, true, 1 << 30).unwrap();
    assert_eq!(deterministic.algo, 1);
    let mut retimed = candidates;
    retimed[1].time_ms = 9.0;
    retimed[2].time_ms = 0.01;
    retimed.reverse();
    assert_eq!(
        choose(&retimed, Precision::Fp32, true, 1 << 30)
            .unwrap()
            .algo,
        1
    );
    assert_eq!(
        choose(&retimed, Precision::Fp32, false, 1 << 30)
            .unwrap()
            .algo,
        2
    );
}

#[test]
fn deterministic_forward_prefers_precomputed_implicit_gemm_whatever_the_numbers() {
    use cudarc::cudnn::sys::cudnnConvolutionFwdAlgo_t::*;
    let forward = |algo, time_ms| Candidate {
        algo,
        status: CUDNN_STATUS_SUCCESS,
        time_ms,
        memory: 0,
        deterministic: true,
        math: CUDNN_FMA_MATH,
    };
    let candidates = [
        forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, 0.1),
        forward(CUDNN_CONVOLUTION_FWD_ALGO_GEMM, 0.05),
        forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, 0.3),
    ];
    let chosen = choose(&candidates, Precision::Fp32, true, 1 << 30).unwrap();
    assert_eq!(
        chosen.algo,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    );
    // Without it, implicit GEMM comes next, before the higher numbers.
    let chosen = choose(&candidates[..2], Precision::Fp32, true, 1 << 30).unwrap();
    assert_eq!(chosen.algo, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
    let chosen = choose(&candidates, Precision::Fp32, false, 1 << 30).unwrap();
    assert_eq!(chosen.algo, CUDNN_CONVOLUTION_FWD_ALGO_GEMM);
}

/// Every refused candidate is named with its number, status, math and determinism, and the
/// setting that would admit one is said.
#[test]
fn a_refusal_names_every_candidate_and_the_setting_that_admits_one() {
    use cudarc::cudnn::sys::cudnnConvolutionBwdFilterAlgo_t::*;
    let filter = |algo, status, deterministic| Candidate {
        algo,
        status,
        time_ms: 0.25,
        memory: 3 << 20,
        deterministic,
        math: CUDNN_TENSOR_OP_MATH,
    };
    let candidates = [
        filter(
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
            CUDNN_STATUS_SUCCESS,
            false,
        ),
        filter(
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            CUDNN_STATUS_NOT_SUPPORTED,
            true,
        ),
    ];
    let reason = choose(&candidates, Precision::Bf16, true, 1 << 30).unwrap_err();
    assert_eq!(
        reason,
        "candidates refused: algorithm 0 (CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0): \
         CUDNN_STATUS_SUCCESS, CUDNN_TENSOR_OP_MATH, not deterministic, workspace 3.0 MiB, \
         0.250 ms: not deterministic; algorithm 1 (CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1): \
         CUDNN_STATUS_NOT_SUPPORTED, CUDNN_TENSOR_OP_MATH, deterministic, workspace 3.0 MiB, \
         0.250 ms: did not run. `--algorithms fastest` admits the algorithms that are not \
         deterministic"
    );
    let none_ran = [
        filter(
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
            CUDNN_STATUS_NOT_SUPPORTED,
            false,
        ),
        filter(
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            CUDNN_STATUS_NOT_SUPPORTED,
            true,
        ),
    ];
    let reason = choose(&none_ran, Precision::Bf16, true, 1 << 30).unwrap_err();
    assert!(
        reason.ends_with(
            "did not run. cuDNN runs none of them on bfloat16 operands for this shape: \
             `--precision tf32` keeps the operands float32"
        ),
        "{reason}"
    );
    let too_large = choose(&candidates[..1], Precision::Bf16, false, 1 << 20).unwrap_err();
    assert!(too_large.ends_with(": workspace too large"), "{too_large}");
}

#[test]
fn fp32_refuses_tensor_core_math_and_says_why_nothing_fits() {
    let tensor_ops = [
        Candidate {
            math: CUDNN_TENSOR_OP_MATH,
            ..candidate(0, 0.1, true)
        },
        Candidate {
            math: CUDNN_DEFAULT_MATH,
            ..candidate(1, 0.2, true)
        },
    ];
    let reason = choose(&tensor_ops, Precision::Fp32, true, 1 << 30).unwrap_err();
    assert_eq!(
        reason,
        "candidates refused: algorithm 0 (0): CUDNN_STATUS_SUCCESS, CUDNN_TENSOR_OP_MATH, \
         deterministic, workspace 0.0 MiB, 0.100 ms: math not allowed; algorithm 1 (1): \
         CUDNN_STATUS_SUCCESS, CUDNN_DEFAULT_MATH, deterministic, workspace 0.0 MiB, 0.200 ms: \
         math not allowed. `--precision tf32` admits tensor-core math"
    );
    assert_eq!(
        choose(&tensor_ops, Precision::Tf32, true, 1 << 30)
            .unwrap()
            .algo,
        0
    );
    let none: [Candidate<u32>; 0] = [];
    assert_eq!(
        choose(&none, Precision::Tf32, false, 0).unwrap_err(),
        "cuDNN returned no candidates"
    );
}

#[test]
fn the_algorithm_cache_keys_on_shape_and_settings() {
    let base = shape();
    let key = ConvKey::new(&base, Precision::Fp32, true);
    assert_eq!(key, ConvKey::new(&base, Precision::Fp32, true));
    let mut keys = HashSet::new();
    keys.insert(key);
    let mut other_batch = base;
    other_batch.batch += 1;
    let mut other_stride = base;
    other_stride.stride = 1;
    for different in [
        ConvKey::new(&other_batch, Precision::Fp32, true),
        ConvKey::new(&other_stride, Precision::Fp32, true),
        ConvKey::new(&base, Precision::Tf32, true),
        ConvKey::new(&base, Precision::Bf16, true),
        ConvKey::new(&base, Precision::Bf16, false),
        ConvKey::new(&base, Precision::Fp32, false),
    ] {
        assert!(keys.insert(different), "{different:?} collides");
    }
}

#[test]
fn bf16_runs_bfloat16_operands_with_float32_accumulation() {
    use cudarc::cudnn::sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
    // cuDNN: bfloat16 tensors and filters, a float32 convolution (PSEUDO_BFLOAT16_CONFIG),
    // tensor cores asked for; the other precisions keep float32 everywhere.
    assert_eq!(operand_type(Precision::Bf16), CUDNN_DATA_BFLOAT16);
    assert_eq!(compute_type(Precision::Bf16), CUDNN_DATA_FLOAT);
    assert_eq!(descriptor_math(Precision::Bf16), CUDNN_TENSOR_OP_MATH);
    for precision in [Precision::Fp32, Precision::Tf32] {
        assert_eq!(operand_type(precision), CUDNN_DATA_FLOAT);
        assert_eq!(compute_type(precision), CUDNN_DATA_FLOAT);
    }
    // Tensor-core and FMA math are admitted; a conversion cuDNN would make itself is not.
    for math in [CUDNN_FMA_MATH, CUDNN_DEFAULT_MATH, CUDNN_TENSOR_OP_MATH] {
        assert!(math_allowed(Precision::Bf16, math), "{math:?}");
    }
    for precision in [Precision::Fp32, Precision::Tf32, Precision::Bf16] {
        assert!(!math_allowed(
            precision,
            CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
        ));
    }
    // cuBLAS: bfloat16 A and B, float32 C, float32 compute, default math (tensor cores).
    use cudarc::cublas::sys::{cublasComputeType_t, cublasMath_t, cudaDataType};
    let types = bf16_types();
    assert_eq!(types.operands, cudaDataType::CUDA_R_16BF);
    assert_eq!(types.output, cudaDataType::CUDA_R_32F);
    assert_eq!(types.compute, cublasComputeType_t::CUBLAS_COMPUTE_32F);
    assert_eq!(
        math_mode(Precision::Bf16),
        cublasMath_t::CUBLAS_DEFAULT_MATH
    );
    assert_eq!(
        math_mode(Precision::Fp32),
        cublasMath_t::CUBLAS_PEDANTIC_MATH
    );
}

#[test]
fn bf16_needs_an_ampere_gpu_and_says_so() {
    let volta = GpuArch { major: 7, minor: 0 };
    assert!(!precision_supported(Precision::Bf16, volta));
    assert!(precision_supported(
        Precision::Bf16,
        GpuArch { major: 8, minor: 0 }
    ));
    assert!(precision_supported(Precision::Bf16, GpuArch::SM_90));
    for precision in [Precision::Fp32, Precision::Tf32] {
        assert!(precision_supported(precision, volta));
    }
    let error = GpuError::Bf16NeedsAmpere {
        ordinal: 1,
        arch: volta,
    };
    assert_eq!(
        error.to_string(),
        "--precision bf16 needs a GPU of compute capability 8.0 (Ampere) or later; cuda:1 is sm_70"
    );
}

#[test]
fn bf16_scratch_holds_the_largest_operand_of_each_role() {
    let model = seed_004_small();
    let plan = model.plan(Mode::Train, 4, 8, 8).unwrap();
    let scratch = Bf16ScratchSizes::new(&plan);
    let units: Vec<_> = plan.unit_plans().collect();
    let largest =
        |len: fn(&Conv2dShape) -> usize| units.iter().map(|unit| len(&unit.shape)).max().unwrap();
    let linear_input = 4 * plan.final_channels;
    let linear_weight = plan.classes * plan.final_channels;
    // Only the stem reads the (float32) images; every other convolution input is a bfloat16
    // activation already, and so is every convolution output.
    assert_eq!(scratch.input, plan.stem.shape.input_len().max(linear_input));
    assert_eq!(scratch.output, 4 * plan.classes);
    assert_eq!(
        scratch.filter,
        largest(Conv2dShape::weight_len).max(linear_weight)
    );
    // Only bf16 allocates them, 2 bytes an element, and its activations take 2 bytes where
    // float32 ones take 4: the slots but the images', the four gradient buffers and dz.
    let fp32 = StorageSizes::new(&plan, Precision::Fp32);
    let bf16 = StorageSizes::new(&plan, Precision::Bf16);
    assert_eq!(fp32.bf16, Bf16ScratchSizes::default());
    assert_eq!(StorageSizes::new(&plan, Precision::Tf32), fp32);
    assert_eq!(bf16.bf16, scratch);
    let activations =
        plan.slot_lens.iter().sum::<usize>() - plan.slot_lens[plan.images] + 5 * plan.grad_len;
    assert_eq!(
        bf16.bytes() + 2 * activations,
        fp32.bytes() + 2 * scratch.len()
    );
    // A model whose linear weight outgrows every filter: the filter scratch follows it.
    let wide_head = Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec {
        n_blocks: vec![1],
        n_channels: vec![4],
        bottlenecks: None,
        first_kernel_size: 3,
        img_channels: 3,
        num_classes: 1000,
    }))
    .unwrap();
    let plan = wide_head.plan(Mode::Eval, 2, 4, 4).unwrap();
    assert_eq!(
        Bf16ScratchSizes::new(&plan).filter,
        1000 * plan.final_channels
    );
}

/// Column-major `C = op(A) op(B) + beta C`, as cuBLAS's SGEMM defines it (float sums in
/// `k` order; the CPU engine's order may differ, hence the tolerance below).
fn reference_gemm(gemm: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (gemm.m as usize, gemm.n as usize, gemm.k as usize);
    let (lda, ldb, ldc) = (gemm.lda as usize, gemm.ldb as usize, gemm.ldc as usize);
    for j in 0..n {
        for i in 0..m {
            let mut sum = 0.0f32;
            for p in 0..k {
                let a_ip = if gemm.transpose_a {
                    a[p + i * lda]
                } else {
                    a[i + p * lda]
                };
                let b_pj = if gemm.transpose_b {
                    b[j + p * ldb]
                } else {
                    b[p + j * ldb]
                };
                sum += a_ip * b_pj;
            }
            c[i + j * ldc] = sum + gemm.beta * c[i + j * ldc];
        }
    }
}

fn values(len: usize, salt: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(salt) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// How close the reference GEMMs come to the CPU engine's products.
const GEMM: Tolerance<f32> = Tolerance::OnePlus(1e-5);

#[test]
fn the_linear_layers_gemms_compute_the_cpu_engines_products() {
    let shape = LinearShape {
        batch: 5,
        inputs: 7,
        outputs: 3,
    };
    let input = values(shape.batch * shape.inputs, 1);
    let weight = values(shape.outputs * shape.inputs, 2);
    let zero_bias = vec![0.0; shape.outputs];
    let grad_output = values(shape.batch * shape.outputs, 3);

    let mut cpu_output = vec![0.0; shape.batch * shape.outputs];
    tandem_engine::head::linear_forward(&input, &weight, &zero_bias, &mut cpu_output);
    let mut gpu_output = vec![9.0; shape.batch * shape.outputs];
    reference_gemm(&shape.forward().unwrap(), &weight, &input, &mut gpu_output);
    assert_close("forward", &gpu_output, &cpu_output, GEMM);

    let initial_grad_weight = values(shape.outputs * shape.inputs, 4);
    let mut cpu_grad_weight = initial_grad_weight.clone();
    let mut cpu_grad_bias = vec![0.0; shape.outputs];
    let mut cpu_grad_input = vec![0.0; shape.batch * shape.inputs];
    tandem_engine::head::linear_backward(
        &input,
        &weight,
        &grad_output,
        &mut cpu_grad_weight,
        &mut cpu_grad_bias,
        Some(&mut cpu_grad_input),
    );
    let mut gpu_grad_weight = initial_grad_weight;
    reference_gemm(
        &shape.weight_gradient().unwrap(),
        &input,
        &grad_output,
        &mut gpu_grad_weight,
    );
    assert_close(
        "weight gradient (accumulated)",
        &gpu_grad_weight,
        &cpu_grad_weight,
        GEMM,
    );
    let mut gpu_grad_input = vec![9.0; shape.batch * shape.inputs];
    reference_gemm(
        &shape.input_gradient().unwrap(),
        &weight,
        &grad_output,
        &mut gpu_grad_input,
    );
    assert_close("input gradient", &gpu_grad_input, &cpu_grad_input, GEMM);
}

fn seed_004_small() -> Model {
    Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec {
        n_blocks: vec![1, 1],
        n_channels: vec![8, 16],
        bottlenecks: Some(vec![4, 8]),
        ..ResNetBaseSpec::tutorial_default()
    }))
    .unwrap()
}

#[test]
fn storage_sizes_follow_the_plan() {
    let model = seed_004_small();
    let plan = model.plan(Mode::Train, 4, 8, 8).unwrap();
    let sizes = StorageSizes::new(&plan, Precision::Fp32);
    assert_eq!(sizes.slots, plan.slot_lens);
    assert_eq!(sizes.grad_len, plan.grad_len);
    assert_eq!(sizes.logits, 4 * 10);
    assert_eq!(sizes.pooled, 4 * plan.final_channels);
    assert_eq!(sizes.grad_pooled, sizes.pooled);
    // The state vectors of all units tile the state buffer without overlap.
    let mut covered = vec![false; sizes.bn_state.len];
    let mut channel_total = 0;
    for unit in plan.unit_plans() {
        let channels = unit.shape.out_channels;
        channel_total += channels;
        for part in [
            StatePart::Mean,
            StatePart::InvStd,
            StatePart::Scale,
            StatePart::Shift,
        ] {
            let offset = sizes.bn_state.offset(unit.index, part);
            for flag in &mut covered[offset..offset + channels] {
                assert!(!*flag, "unit {} {part:?} overlaps", unit.index);
                *flag = true;
            }
        }
        let rows = unit.shape.output_len() / channels;
        assert!(sizes.partials >= row_blocks(rows) * 2 * channels);
        assert!(sizes.totals > 2 * channels && sizes.coefficients >= 3 * channels);
    }
    assert_eq!(sizes.bn_state.len, 4 * channel_total);
    assert!(covered.iter().all(|&flag| flag));
    // 4 * 8 * 8 = 256 rows at the stem: one block; 257 would take two.
    assert_eq!(row_blocks(ROWS_PER_BLOCK), 1);
    assert_eq!(row_blocks(ROWS_PER_BLOCK + 1), 2);

    let eval = StorageSizes::new(&model.plan(Mode::Eval, 4, 8, 8).unwrap(), Precision::Fp32);
    assert_eq!((eval.grad_len, eval.grad_pooled), (0, 0));
    assert!(eval.bytes() < sizes.bytes());
}

#[test]
fn adam_scalars_are_the_cpus_bias_corrections() {
    let config = AdamConfig {
        weight_decay: 0.01,
        decoupled: true,
        ..AdamConfig::with_lr(1e-3)
    };
    let first = AdamScalars::new(&config, 1);
    // step_size = lr / (1 - 0.9) = 0.01; sqrt(1 - 0.999) = 0.0316227766 (the f32 betas are
    // slightly off 0.9 and 0.999, hence the tolerances).
    assert!((first.step_size - 0.01).abs() < 1e-8, "{first:?}");
    assert!(
        (first.bias_correction2_sqrt - 0.031_622_776).abs() < 1e-6,
        "{first:?}"
    );
    assert!((first.decay_factor - 0.99999).abs() < 1e-7, "{first:?}");
    assert!((first.lerp_weight - 0.1).abs() < 1e-7 && (first.sq_weight - 0.001).abs() < 1e-7);
    // At step 2: lr / (1 - 0.81) and sqrt(1 - 0.998001).
    let second = AdamScalars::new(&config, 2);
    assert!((second.step_size - 1e-3 / 0.19).abs() < 1e-8, "{second:?}");
    assert!(
        (second.bias_correction2_sqrt - 0.001_999f32.sqrt()).abs() < 1e-6,
        "{second:?}"
    );
}

#[test]
fn a_missing_library_is_an_error_naming_it_not_a_panic() {
    let empty = tempfile::tempdir().unwrap();
    let probe = Probe::run(&SearchPath::only(vec![empty.path().to_path_buf()]));
    let settings = GpuSettings {
        ordinal: 0,
        precision: Precision::Fp32,
        deterministic: true,
    };
    let error = match CudaExecutor::new(&probe, settings, None, &seed_004_small()) {
        Ok(_) => panic!("an executor without libraries"),
        Err(error) => error,
    };
    assert!(matches!(error, GpuError::MissingLibrary(_)), "{error}");
    assert!(
        error.to_string().starts_with("libcuda not found"),
        "{error}"
    );
}

/// The device dataset's host checks: the pixels must fill the shape, indices must fit the
/// kernel's `unsigned int` and lie below the dataset size (the kernel does not check them).
#[test]
fn the_device_dataset_checks_its_shape_and_indices() {
    use tandem_cuda::executor::DatasetShape;
    let shape = DatasetShape {
        len: 3,
        height: 2,
        width: 2,
        channels: 3,
    };
    assert_eq!(shape.image_len(), 12);
    shape.check(36).unwrap();
    assert_eq!(
        shape.check(35).unwrap_err().to_string(),
        "dataset pixels has 35 values, the device buffer holds 36"
    );
    assert_eq!(shape.device_indices(&[2, 0, 2]).unwrap(), vec![2, 0, 2]);
    assert_eq!(
        shape.device_indices(&[0, 3]).unwrap_err().to_string(),
        "batch index 3, expected below the dataset size 3"
    );
    let huge = DatasetShape {
        len: 1 << 33,
        ..shape
    };
    assert!(matches!(
        huge.check(huge.len * 12),
        Err(GpuError::TooLarge {
            what: "dataset images",
            ..
        })
    ));
    assert!(matches!(
        huge.device_indices(&[1 << 32]),
        Err(GpuError::IndexOutOfRange { .. })
    ));
}

/// The device buffers' offset aligns every convolution filter of the tutorial models (whose
/// 10-class head leaves each filter at 2 mod 4 floats in the shared layout).
#[test]
fn the_flat_buffers_offset_aligns_every_filter_of_the_tutorial_models() {
    use tandem_cuda::executor::flat::aligning_offset;
    use tandem_models::TensorKind;
    for model in [
        seed_004_small(),
        Model::new(&ModelSpec::ResNet18 { num_classes: 10 }).unwrap(),
        Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())).unwrap(),
    ] {
        let filters: Vec<usize> = model
            .tensors()
            .iter()
            .filter(|tensor| tensor.kind == TensorKind::Param && tensor.shape.len() == 4)
            .map(|tensor| tensor.offset)
            .collect();
        assert!(filters.len() >= 4);
        assert!(filters.iter().all(|start| start % 4 == 2), "{filters:?}");
        let offset = aligning_offset(filters.iter().copied());
        assert_eq!(offset, 2);
        assert!(filters.iter().all(|start| (start + offset) % 4 == 0));
    }
}
