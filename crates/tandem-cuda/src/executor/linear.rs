//! The linear layer through cuBLAS. Tandem's tensors are row-major; cuBLAS is column-major,
//! so a row-major `[rows, cols]` matrix is its column-major transpose with leading dimension
//! `cols`. The three products below are written in those terms and checked on the host
//! against the CPU engine (`tests` of this module run a column-major reference GEMM).

use std::ffi::{c_int, c_void};

use cudarc::cublas::{result, sys, CudaBlas};

use super::error::{cublas, int, GpuError};
use super::Precision;

/// One column-major `C = alpha * op(A) * op(B) + beta * C`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Whether A is transposed.
    pub transpose_a: bool,
    /// Whether B is transposed.
    pub transpose_b: bool,
    /// Rows of op(A) and C.
    pub m: c_int,
    /// Columns of op(B) and C.
    pub n: c_int,
    /// Columns of op(A), rows of op(B).
    pub k: c_int,
    /// Leading dimension of A.
    pub lda: c_int,
    /// Leading dimension of B.
    pub ldb: c_int,
    /// Leading dimension of C.
    pub ldc: c_int,
    /// 0 to overwrite C, 1 to add to it.
    pub beta: f32,
}

/// The linear layer's sizes: `batch` rows of `inputs` features to `outputs` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows.
    pub batch: usize,
    /// Input features.
    pub inputs: usize,
    /// Outputs (classes).
    pub outputs: usize,
}

impl LinearShape {
    fn ints(&self) -> Result<(c_int, c_int, c_int), GpuError> {
        Ok((
            int("linear batch", self.batch)?,
            int("linear inputs", self.inputs)?,
            int("linear outputs", self.outputs)?,
        ))
    }

    /// `output[batch, outputs] = input[batch, inputs] · weight[outputs, inputs]ᵀ` (the bias is
    /// added after): A = weight, B = input.
    pub fn forward(&self) -> Result<Gemm, GpuError> {
        let (batch, inputs, outputs) = self.ints()?;
        Ok(Gemm {
            transpose_a: true,
            transpose_b: false,
            m: outputs,
            n: batch,
            k: inputs,
            lda: inputs,
            ldb: inputs,
            ldc: outputs,
            beta: 0.0,
        })
    }

    /// `grad_weight[outputs, inputs] += grad_output[batch, outputs]ᵀ · input[batch, inputs]`:
    /// A = input, B = grad_output.
    pub fn weight_gradient(&self) -> Result<Gemm, GpuError> {
        let (batch, inputs, outputs) = self.ints()?;
        Ok(Gemm {
            transpose_a: false,
            transpose_b: true,
            m: inputs,
            n: outputs,
            k: batch,
            lda: inputs,
            ldb: outputs,
            ldc: inputs,
            beta: 1.0,
        })
    }

    /// `grad_input[batch, inputs] = grad_output[batch, outputs] · weight[outputs, inputs]`:
    /// A = weight, B = grad_output.
    pub fn input_gradient(&self) -> Result<Gemm, GpuError> {
        let (batch, inputs, outputs) = self.ints()?;
        Ok(Gemm {
            transpose_a: false,
            transpose_b: false,
            m: inputs,
            n: batch,
            k: outputs,
            lda: inputs,
            ldb: outputs,
            ldc: inputs,
            beta: 0.0,
        })
    }
}

/// cuBLAS's math mode for `precision`: fp32 pedantic (no reduced precision anywhere), tf32
/// TF32 tensor cores (PyTorch's `allow_tf32` for matmuls), bf16 the default (its GEMMs name
/// their types and compute type themselves, [`bf16_types`]; tensor cores are allowed).
pub fn math_mode(precision: Precision) -> sys::cublasMath_t {
    match precision {
        Precision::Fp32 => sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
        Precision::Tf32 => sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        Precision::Bf16 => sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
    }
}

/// The types of one `cublasGemmEx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmTypes {
    /// A's and B's element type.
    pub operands: sys::cudaDataType,
    /// C's element type.
    pub output: sys::cudaDataType,
    /// The compute (accumulation) type; alpha and beta are float32 for it.
    pub compute: sys::cublasComputeType_t,
}

/// bf16's GEMM types, PyTorch autocast's for a linear layer with float32 accumulation:
/// bfloat16 A and B, float32 C and `CUBLAS_COMPUTE_32F` (float32 alpha and beta), one of the
/// combinations `cublasGemmEx` lists for that compute type. C stays float32 so that the
/// weight gradient adds into the float32 gradient buffer (beta = 1) as in fp32, and the
/// logits and the input gradient need no widening.
pub fn bf16_types() -> GemmTypes {
    GemmTypes {
        operands: sys::cudaDataType::CUDA_R_16BF,
        output: sys::cudaDataType::CUDA_R_32F,
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

/// Sets `blas`'s math mode for `precision`.
pub fn set_math_mode(blas: &CudaBlas, precision: Precision) -> Result<(), GpuError> {
    // SAFETY: the handle is valid for the life of `blas`.
    unsafe { sys::cublasSetMathMode(*blas.handle(), math_mode(precision)) }
        .result()
        .map_err(cublas("cublasSetMathMode"))
}

fn op(transpose: bool) -> sys::cublasOperation_t {
    if transpose {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// Runs `gemm` on device pointers `a`, `b`, `c` (floats).
///
/// # Safety
/// `a`, `b` and `c` must point to device buffers on `blas`'s stream holding at least the
/// elements the GEMM's sizes and leading dimensions address.
pub unsafe fn run(blas: &CudaBlas, gemm: &Gemm, a: u64, b: u64, c: u64) -> Result<(), GpuError> {
    let alpha = 1.0f32;
    // SAFETY: the caller's contract; alpha and beta are host scalars (the default pointer mode).
    unsafe {
        result::sgemm(
            *blas.handle(),
            op(gemm.transpose_a),
            op(gemm.transpose_b),
            gemm.m,
            gemm.n,
            gemm.k,
            &alpha,
            a as *const f32,
            gemm.lda,
            b as *const f32,
            gemm.ldb,
            &gemm.beta,
            c as *mut f32,
            gemm.ldc,
        )
    }
    .map_err(cublas("cublasSgemm_v2"))
}

/// Runs `gemm` with bfloat16 `a` and `b` and float32 `c` ([`bf16_types`]).
///
/// # Safety
/// As [`run`], with `a` and `b` holding bfloat16 (2-byte) elements.
pub unsafe fn run_bf16(
    blas: &CudaBlas,
    gemm: &Gemm,
    a: u64,
    b: u64,
    c: u64,
) -> Result<(), GpuError> {
    let types = bf16_types();
    let alpha = 1.0f32;
    // SAFETY: the caller's contract; alpha and beta are host float32 scalars, as
    // CUBLAS_COMPUTE_32F takes them (the default pointer mode).
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            op(gemm.transpose_a),
            op(gemm.transpose_b),
            gemm.m,
            gemm.n,
            gemm.k,
            (&alpha as *const f32).cast(),
            a as *const c_void,
            types.operands,
            gemm.lda,
            b as *const c_void,
            types.operands,
            gemm.ldb,
            (&gemm.beta as *const f32).cast(),
            c as *mut c_void,
            types.output,
            gemm.ldc,
            types.compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cublas("cublasGemmEx"))
}
