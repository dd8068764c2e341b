//! The convolutions and the linear layer's GEMMs in the executor's precision. In fp32 and
//! tf32 they run on the float32 buffers directly. In bf16 (PyTorch autocast's rules) the
//! activations and their gradients are bfloat16 in memory (`memory::Activations`), which
//! cuDNN reads and writes directly, accumulating in float32; what is float32 in memory is
//! narrowed into the plan's bfloat16 scratch buffers first (`kernels/convert.cu`, round to
//! nearest even): the images the stem reads, every filter, and the linear layer's pooled
//! features and output gradient (the head stays float32). A weight gradient is computed into
//! the filter's scratch and added to the float32 flat gradients (as fp32's `beta = 1` adds
//! it); an input gradient is written or added (cuDNN's `beta`) in bfloat16.
//!
//! The weights are narrowed at each convolution, not once per step after the optimizer: a
//! bfloat16 copy kept across calls would go stale at every write to the parameters (the
//! optimizers, `params_from_host`, the broadcasts, a resume), each of which would have to
//! know of it, while narrowing a filter costs one pass over it, small beside the activations.

use tandem_engine::shape::Conv2dShape;

use super::conv::{ConvBuffers, ConvPlan};
use super::kernels::{convert, Ptr};
use super::launch::per_element;
use super::linear::{self, Gemm};
use super::{address, CudaExecutor, GpuError, Precision};

/// One bfloat16 scratch buffer: its device address and its element count.
#[derive(Clone, Copy, Debug)]
struct Buffer {
    address: u64,
    len: usize,
}

/// The bfloat16 scratch buffers of the active plan.
#[derive(Clone, Copy, Debug)]
struct Scratch {
    input: Buffer,
    output: Buffer,
    filter: Buffer,
}

/// Which bfloat16 scratch buffer a GEMM operand is narrowed into (see
/// `memory::Bf16ScratchSizes` for what each holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// The layer's input (pooled features).
    Input,
    /// The layer's output gradient.
    Output,
    /// The layer's weight.
    Filter,
}

/// One float32 operand of a GEMM: its address, its element count and its role.
#[derive(Clone, Copy, Debug)]
pub(super) struct GemmOperand {
    pub(super) address: u64,
    pub(super) len: usize,
    pub(super) role: Role,
}

/// The buffers of a unit convolution's backward: the activations and their gradients, the
/// float32 filter and filter gradient.
#[derive(Clone, Copy, Debug)]
pub(super) struct ConvBackward {
    /// The forward's input.
    pub(super) input: u64,
    /// Whether that input is float32 whatever the activations (the images).
    pub(super) input_is_f32: bool,
    /// The filter.
    pub(super) filter: u64,
    /// The output gradient.
    pub(super) grad_output: u64,
    /// The filter gradient (added to).
    pub(super) grad_filter: u64,
    /// The input gradient and whether it is added to, when one is wanted.
    pub(super) grad_input: Option<(u64, bool)>,
    /// The workspace and its size in bytes.
    pub(super) workspace: (u64, usize),
}

impl CudaExecutor {
    /// The scratch buffers' addresses in bf16, `None` in the other precisions.
    fn bf16_scratch(&self) -> Result<Option<Scratch>, GpuError> {
        if self.libraries.settings.precision != Precision::Bf16 {
            return Ok(None);
        }
        let Some(scratch) = &self.storage()?.bf16 else {
            return Err(GpuError::Unsupported(
                "bf16 without its scratch buffers (a plan prepared in another precision)",
            ));
        };
        let buffer = |slice: &cudarc::driver::CudaSlice<u16>| Buffer {
            address: address(slice, &self.stream),
            len: slice.len(),
        };
        Ok(Some(Scratch {
            input: buffer(&scratch.input),
            output: buffer(&scratch.output),
            filter: buffer(&scratch.filter),
        }))
    }

    /// `to[..n] = bfloat16(from[..n])`.
    fn narrow(&self, from: u64, to: Buffer, n: usize) -> Result<(), GpuError> {
        fits(to, n)?;
        let (from, to) = (Ptr::from_address(from), Ptr::from_address(to.address));
        convert::float_to_bf16(&self.queue(), per_element(n), from, n as i64, to)
    }

    /// `to[..n] (+)= float(from[..n])`: added when `add`, else overwritten.
    fn widen(&self, from: Buffer, to: u64, n: usize, add: bool) -> Result<(), GpuError> {
        fits(from, n)?;
        let widen = if add {
            convert::bf16_add_to_float
        } else {
            convert::bf16_to_float
        };
        let (from, to) = (Ptr::from_address(from.address), Ptr::from_address(to));
        widen(&self.queue(), per_element(n), from, n as i64, to)
    }

    /// `buffers.output = conv(buffers.input, buffers.filter)` of `shape` with `plan`; in bf16
    /// the input is narrowed first when it is float32 (`input_is_f32`: the images).
    pub(super) fn convolve_forward(
        &self,
        plan: &ConvPlan,
        shape: &Conv2dShape,
        buffers: &ConvBuffers,
        input_is_f32: bool,
    ) -> Result<(), GpuError> {
        let Some(scratch) = self.bf16_scratch()? else {
            return plan.forward(&self.libraries.cudnn, buffers);
        };
        let input = if input_is_f32 {
            self.narrow(buffers.input, scratch.input, shape.input_len())?;
            scratch.input.address
        } else {
            buffers.input
        };
        self.narrow(buffers.filter, scratch.filter, shape.weight_len())?;
        plan.forward(
            &self.libraries.cudnn,
            &ConvBuffers {
                input,
                filter: scratch.filter.address,
                output: buffers.output,
                workspace: buffers.workspace,
            },
        )
    }

    /// The filter gradient (added to `grad_filter`) and, when asked, the input gradient of
    /// the convolution of `shape` with `plan`.
    pub(super) fn convolve_backward(
        &self,
        plan: &ConvPlan,
        shape: &Conv2dShape,
        buffers: &ConvBackward,
    ) -> Result<(), GpuError> {
        let Some(scratch) = self.bf16_scratch()? else {
            plan.backward_filter(
                &self.libraries.cudnn,
                &ConvBuffers {
                    input: buffers.input,
                    filter: buffers.grad_filter,
                    output: buffers.grad_output,
                    workspace: buffers.workspace,
                },
                true,
            )?;
            if let Some((grad_input, accumulate)) = buffers.grad_input {
                plan.backward_data(
                    &self.libraries.cudnn,
                    &ConvBuffers {
                        input: grad_input,
                        filter: buffers.filter,
                        output: buffers.grad_output,
                        workspace: buffers.workspace,
                    },
                    accumulate,
                )?;
            }
            return Ok(());
        };
        // The output gradient and (but for the images) the input are bfloat16 activations; the
        // filter's scratch serves the filter gradient, then the filter.
        let input = if buffers.input_is_f32 {
            self.narrow(buffers.input, scratch.input, shape.input_len())?;
            scratch.input.address
        } else {
            buffers.input
        };
        plan.backward_filter(
            &self.libraries.cudnn,
            &ConvBuffers {
                input,
                filter: scratch.filter.address,
                output: buffers.grad_output,
                workspace: buffers.workspace,
            },
            false,
        )?;
        self.widen(
            scratch.filter,
            buffers.grad_filter,
            shape.weight_len(),
            true,
        )?;
        let Some((grad_input, accumulate)) = buffers.grad_input else {
            return Ok(());
        };
        self.narrow(buffers.filter, scratch.filter, shape.weight_len())?;
        plan.backward_data(
            &self.libraries.cudnn,
            &ConvBuffers {
                input: grad_input,
                filter: scratch.filter.address,
                output: buffers.grad_output,
                workspace: buffers.workspace,
            },
            accumulate,
        )
    }

    /// One of the linear layer's GEMMs, `c (+)= op(a) · op(b)` with float32 `c`: SGEMM, or in
    /// bf16 `cublasGemmEx` on `a` and `b` narrowed into their roles' scratch buffers.
    pub(super) fn linear_gemm(
        &self,
        gemm: &Gemm,
        a: GemmOperand,
        b: GemmOperand,
        c: u64,
    ) -> Result<(), GpuError> {
        let Some(scratch) = self.bf16_scratch()? else {
            // SAFETY: the caller's operands hold what the GEMM addresses (see
            // `linear::LinearShape`), on the executor's stream.
            return unsafe { linear::run(&self.libraries.blas, gemm, a.address, b.address, c) };
        };
        let into = |role| match role {
            Role::Input => scratch.input,
            Role::Output => scratch.output,
            Role::Filter => scratch.filter,
        };
        if a.role == b.role {
            return Err(GpuError::Unsupported(
                "two GEMM operands in one scratch buffer",
            ));
        }
        self.narrow(a.address, into(a.role), a.len)?;
        self.narrow(b.address, into(b.role), b.len)?;
        // SAFETY: the scratch buffers hold the narrowed operands (`narrow` checked that they
        // fit); `c` as for SGEMM.
        unsafe {
            linear::run_bf16(
                &self.libraries.blas,
                gemm,
                into(a.role).address,
                into(b.role).address,
                c,
            )
        }
    }
}

/// `Ok` when `buffer` holds at least `n` elements (the plan's scratch sizes cover every
/// operand; this keeps a launch from running past one that does not).
fn fits(buffer: Buffer, n: usize) -> Result<(), GpuError> {
    if n <= buffer.len {
        Ok(())
    } else {
        Err(GpuError::Length {
            what: "a bfloat16 operand",
            found: n,
            expected: buffer.len,
        })
    }
}
