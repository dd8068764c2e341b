//! Owned cuDNN handle and descriptors over `cudarc::cudnn`'s raw calls. `cudarc`'s safe
//! wrappers keep their raw descriptors private and pick algorithms by heuristics only, so
//! measuring with `cudnnFind*` needs the raw ones. Only called after the probe found cuDNN.

use std::ffi::c_int;

use cudarc::cudnn::{result, sys};
use cudarc::driver::CudaStream;

use super::algorithm::Candidate;
use super::error::{cudnn, GpuError};

/// Per direction, a method `name(a, b, conv, c)` that calls `sys::$find` (whose operand
/// descriptors are `a`, `b` and `c` around the convolution's) and returns its candidates.
macro_rules! find {
    ($(
        $(#[$doc:meta])*
        $name:ident($a:ident: $ta:ty, $b:ident: $tb:ty, $c:ident: $tc:ty) -> $algo:ty = $find:ident;
    )*) => {$(
        $(#[$doc])*
        pub fn $name(
            &self,
            $a: &$ta,
            $b: &$tb,
            conv: &ConvDescriptor,
            $c: &$tc,
        ) -> Result<Vec<Candidate<$algo>>, GpuError> {
            let mut returned: c_int = 0;
            // SAFETY: the perf structs are plain C data, for which all-zero bytes are valid.
            let mut perfs: [_; ALGORITHMS] = unsafe { std::mem::zeroed() };
            // SAFETY: valid handle and descriptors; `perfs` holds the requested count.
            unsafe {
                sys::$find(
                    self.0,
                    $a.raw(),
                    $b.raw(),
                    conv.raw(),
                    $c.raw(),
                    ALGORITHMS as c_int,
                    &mut returned,
                    perfs.as_mut_ptr(),
                )
            }
            .result()
            .map_err(cudnn(stringify!($find)))?;
            Ok(perfs[..returned.clamp(0, ALGORITHMS as c_int) as usize]
                .iter()
                .map(|perf| Candidate {
                    algo: perf.algo,
                    status: perf.status,
                    time_ms: perf.time,
                    memory: perf.memory,
                    deterministic: perf.determinism
                        == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                    math: perf.mathType,
                })
                .collect())
        }
    )*};
}

/// A cuDNN handle bound to one stream.
pub struct CudnnHandle(sys::cudnnHandle_t);

impl CudnnHandle {
    /// A handle whose calls run on `stream`.
    pub fn new(stream: &CudaStream) -> Result<Self, GpuError> {
        let handle = CudnnHandle(result::create_handle().map_err(cudnn("cudnnCreate"))?);
        // SAFETY: the handle was just created; the stream outlives it (the executor owns both
        // and drops the handle first).
        unsafe { result::set_stream(handle.0, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(cudnn("cudnnSetStream"))?;
        Ok(handle)
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::cudnnHandle_t {
        self.0
    }

    find! {
        /// Measures every forward algorithm of the convolution.
        find_forward(x: TensorDescriptor, w: FilterDescriptor, y: TensorDescriptor)
            -> sys::cudnnConvolutionFwdAlgo_t = cudnnFindConvolutionForwardAlgorithm;
        /// Measures every data-gradient algorithm of the convolution.
        find_backward_data(w: FilterDescriptor, dy: TensorDescriptor, dx: TensorDescriptor)
            -> sys::cudnnConvolutionBwdDataAlgo_t = cudnnFindConvolutionBackwardDataAlgorithm;
        /// Measures every filter-gradient algorithm of the convolution.
        find_backward_filter(x: TensorDescriptor, dy: TensorDescriptor, dw: FilterDescriptor)
            -> sys::cudnnConvolutionBwdFilterAlgo_t = cudnnFindConvolutionBackwardFilterAlgorithm;
    }
}

/// Room for twice as many results as any direction has algorithms (forward has 8): were cuDNN
/// to list an algorithm once per math type, a shorter list would be cut by measured time, and
/// deterministic mode's choice (which must not depend on timings) could see another set.
const ALGORITHMS: usize = 16;

/// A descriptor type: the newtype over cuDNN's raw descriptor, made by `$create` (named
/// `$call` in its error), destroyed by `$destroy` on drop.
macro_rules! descriptor {
    ($(#[$doc:meta])* $name:ident($raw:ty), $create:path, $call:literal, $destroy:path) => {
        $(#[$doc])*
        pub struct $name($raw);

        impl $name {
            /// A fresh descriptor, not yet set.
            fn created() -> Result<Self, GpuError> {
                Ok($name($create().map_err(cudnn($call))?))
            }

            /// The raw descriptor.
            pub fn raw(&self) -> $raw {
                self.0
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: the descriptor is valid and dropped once.
                let _ = unsafe { $destroy(self.0) };
            }
        }
    };
}

descriptor!(
    /// A 4-d tensor descriptor with explicit strides.
    TensorDescriptor(sys::cudnnTensorDescriptor_t),
    result::create_tensor_descriptor,
    "cudnnCreateTensorDescriptor",
    result::destroy_tensor_descriptor
);

descriptor!(
    /// A filter descriptor in cuDNN's NHWC filter format (KRSC, the engine's OHWI).
    FilterDescriptor(sys::cudnnFilterDescriptor_t),
    result::create_filter_descriptor,
    "cudnnCreateFilterDescriptor",
    result::destroy_filter_descriptor
);

descriptor!(
    /// A 2-d cross-correlation (PyTorch's convolution), no dilation.
    ConvDescriptor(sys::cudnnConvolutionDescriptor_t),
    result::create_convolution_descriptor,
    "cudnnCreateConvolutionDescriptor",
    result::destroy_convolution_descriptor
);

impl TensorDescriptor {
    /// `[n, c, h, w]` of `data_type` with `strides` (see [`super::conv::nhwc_strides`]).
    pub fn new(
        dims: [c_int; 4],
        strides: [c_int; 4],
        data_type: sys::cudnnDataType_t,
    ) -> Result<Self, GpuError> {
        let desc = Self::created()?;
        // SAFETY: the descriptor was just created.
        unsafe { result::set_tensor4d_descriptor_ex(desc.0, data_type, dims, strides) }
            .map_err(cudnn("cudnnSetTensor4dDescriptorEx"))?;
        Ok(desc)
    }
}

impl FilterDescriptor {
    /// `[k, c, r, s]` of `data_type`.
    pub fn new(dims: [c_int; 4], data_type: sys::cudnnDataType_t) -> Result<Self, GpuError> {
        let desc = Self::created()?;
        let format = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        // SAFETY: the descriptor was just created.
        unsafe { result::set_filter4d_descriptor(desc.0, data_type, format, dims) }
            .map_err(cudnn("cudnnSetFilter4dDescriptor"))?;
        Ok(desc)
    }
}

impl ConvDescriptor {
    /// Equal padding and stride on both axes, computing (accumulating) in `compute_type`.
    pub fn new(
        padding: c_int,
        stride: c_int,
        compute_type: sys::cudnnDataType_t,
    ) -> Result<Self, GpuError> {
        let desc = Self::created()?;
        // SAFETY: the descriptor was just created.
        unsafe {
            result::set_convolution2d_descriptor(
                desc.0,
                padding,
                padding,
                stride,
                stride,
                1,
                1,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute_type,
            )
        }
        .map_err(cudnn("cudnnSetConvolution2dDescriptor"))?;
        Ok(desc)
    }

    /// Sets the math type the next call uses.
    pub fn set_math(&self, math: sys::cudnnMathType_t) -> Result<(), GpuError> {
        // SAFETY: the descriptor is valid; cuDNN only reads it during calls on this thread.
        unsafe { result::set_convolution_math_type(self.0, math) }
            .map_err(cudnn("cudnnSetConvolutionMathType"))
    }
}
