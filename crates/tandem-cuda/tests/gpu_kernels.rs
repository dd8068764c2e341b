//! The CUDA kernels against the CPU engine and loader, on odd shapes: the checks of
//! `common/kernel_checks.rs`, on GPU 0. CI runs them on the fake GPU of `tests/fake_gpu` (our
//! kernels compiled for the CPU behind a fake driver); without a GPU they are skipped with a
//! printed reason.

mod common;

use common::gpu_rig::GpuRig;
use common::kernel_checks;

/// Declares one test per check, each run on GPU 0.
macro_rules! on_the_gpu {
    ($($check:ident),* $(,)?) => {$(
        #[test]
        fn $check() {
            if let Some(mut gpu) = GpuRig::open(stringify!($check)) {
                kernel_checks::$check(&mut gpu);
            }
        }
    )*};
}

on_the_gpu!(
    sgd_steps_match_the_cpu_bit_for_bit,
    adam_and_adamw_steps_match_the_cpu_bit_for_bit,
    average_pooling_matches_the_cpu_bit_for_bit,
    cross_entropy_matches_the_cpu,
    augmented_batches_equal_the_cpu_loaders,
    batch_norm_statistics_and_backward_match_the_cpu,
    batch_norm_eval_coefficients_match_the_cpu_bit_for_bit,
    the_fused_epilogue_matches_the_cpu_bit_for_bit,
    bias_and_division_kernels_match_the_host_bit_for_bit,
    conversion_kernels_equal_the_host_reference_bit_for_bit,
    bf16_kernels_equal_their_float32_twins_rounded_bit_for_bit,
    exact_sum_kernels_equal_tandem_dist_exact_bit_for_bit,
);
