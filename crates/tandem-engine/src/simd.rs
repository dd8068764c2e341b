//! Run-time selection of the AVX2 + FMA instruction set for the hot loops, so the shipped
//! binary runs on any x86-64 CPU and still uses 256-bit vectors where they exist.

/// Whether this CPU has AVX2 and FMA.
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines a function whose body is compiled twice, for AVX2 + FMA and for the baseline
/// instruction set, and runs the first when the CPU has those features. For plain loops
/// the compiler vectorizes; the body must be safe on any CPU. Takes at most one const
/// generic parameter.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        fn $name:ident$(<const $param:ident: $param_ty:ty>)?($($arg:ident: $arg_ty:ty),* $(,)?)
        $body:block
    ) => {
        $(#[$meta])*
        fn $name$(<const $param: $param_ty>)?($($arg: $arg_ty),*) {
            #[inline(always)]
            fn portable$(<const $param: $param_ty>)?($($arg: $arg_ty),*) $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2$(<const $param: $param_ty>)?($($arg: $arg_ty),*) {
                portable$(::<$param>)?($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if $crate::simd::has_avx2_fma() {
                // SAFETY: the CPU has the features `avx2` is compiled for.
                return unsafe { avx2$(::<$param>)?($($arg),*) };
            }
            portable$(::<$param>)?($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Zeroes `grad` wherever `output` is not positive (the ReLU backward). Written with
/// explicit vectors because compilers turn the plain loop into masked stores, which are
/// slow on AMD processors.
pub(crate) fn zero_where_not_positive(grad: &mut [f32], output: &[f32]) {
    assert_eq!(grad.len(), output.len(), "relu backward: lengths differ");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2, and the lengths are equal.
        done = unsafe { avx2_zero_where_not_positive(grad, output) };
    }
    for (g, &y) in grad[done..].iter_mut().zip(&output[done..]) {
        if y <= 0.0 || y.is_nan() {
            *g = 0.0;
        }
    }
}

/// The whole 8-value vectors of [`zero_where_not_positive`]; returns how many values it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_zero_where_not_positive(grad: &mut [f32], output: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let vectors = grad.len() / 8;
    let zero = _mm256_setzero_ps();
    for index in 0..vectors {
        let g = grad.as_mut_ptr().add(index * 8);
        let y = _mm256_loadu_ps(output.as_ptr().add(index * 8));
        let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(y, zero);
        _mm256_storeu_ps(g, _mm256_and_ps(_mm256_loadu_ps(g), keep));
    }
    vectors * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relu_mask_keeps_exactly_the_positive_outputs_in_vectors_and_tail() {
        let output: Vec<f32> = (0..21)
            .map(|i| match i % 4 {
                0 => i as f32,
                1 => -(i as f32),
                2 => 0.0,
                _ => f32::NAN,
            })
            .collect();
        let mut grad: Vec<f32> = (0..21).map(|i| i as f32 + 0.5).collect();
        zero_where_not_positive(&mut grad, &output);
        for (i, g) in grad.iter().enumerate() {
            let expected = if i % 4 == 0 && i > 0 {
                i as f32 + 0.5
            } else {
                0.0
            };
            assert_eq!(*g, expected, "index {i}");
        }
    }

    multiversion! {
        /// A sum, for the test below.
        fn sum_into(values: &[f32], total: &mut f32) {
            *total = values.iter().sum();
        }
    }

    #[test]
    fn multiversioned_function_runs_its_body() {
        let mut total = 0.0;
        sum_into(&[1.0, 2.0, 3.5], &mut total);
        assert_eq!(total, 6.5);
    }
}
