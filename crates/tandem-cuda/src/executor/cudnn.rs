//! Owned cuDNN handle and descriptors over `cudarc::cudnn`'s raw calls. `cudarc`'s safe
//! wrappers keep their raw descriptors private and pick algorithms by heuristics only, so
//! measuring with `cudnnFind*` needs the raw ones. Only called after the probe found cuDNN.

use std::ffi::c_int;

use cudarc::cudnn::{result, sys};
use cudarc::driver::CudaStream;

use super::algorithm::Candidate;
use super::error::{cudnn, GpuError};

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

    /// Measures every forward algorithm of the convolution.
    pub fn find_forward(
        &self,
        x: &TensorDescriptor,
        w: &FilterDescriptor,
        conv: &ConvDescriptor,
        y: &TensorDescriptor,
    ) -> Result<Vec<Candidate<sys::cudnnConvolutionFwdAlgo_t>>, GpuError> {
        let mut returned: c_int = 0;
        // SAFETY: the perf structs are plain C data, for which all-zero bytes are valid.
        let mut perfs: [sys::cudnnConvolutionFwdAlgoPerf_t; ALGORITHMS] =
            unsafe { std::mem::zeroed() };
        // SAFETY: valid handle and descriptors; `perfs` holds the requested count.
        unsafe {
            sys::cudnnFindConvolutionForwardAlgorithm(
                self.0,
                x.raw(),
                w.raw(),
                conv.raw(),
                y.raw(),
                ALGORITHMS as c_int,
                &mut returned,
                perfs.as_mut_ptr(),
            )
        }
        .result()
        .map_err(cudnn("cudnnFindConvolutionForwardAlgorithm"))?;
        Ok(perfs[..returned.clamp(0, ALGORITHMS as c_int) as usize]
            .iter()
            .map(|perf| {
                candidate(
                    perf.algo,
                    perf.status,
                    perf.time,
                    perf.memory,
                    perf.determinism,
                    perf.mathType,
                )
            })
            .collect())
    }

    /// Measures every data-gradient algorithm of the convolution.
    pub fn find_backward_data(
        &self,
        w: &FilterDescriptor,
        dy: &TensorDescriptor,
        conv: &ConvDescriptor,
        dx: &TensorDescriptor,
    ) -> Result<Vec<Candidate<sys::cudnnConvolutionBwdDataAlgo_t>>, GpuError> {
        let mut returned: c_int = 0;
        // SAFETY: as in `find_forward`.
        let mut perfs: [sys::cudnnConvolutionBwdDataAlgoPerf_t; ALGORITHMS] =
            unsafe { std::mem::zeroed() };
        // SAFETY: as in `find_forward`.
        unsafe {
            sys::cudnnFindConvolutionBackwardDataAlgorithm(
                self.0,
                w.raw(),
                dy.raw(),
                conv.raw(),
                dx.raw(),
                ALGORITHMS as c_int,
                &mut returned,
                perfs.as_mut_ptr(),
            )
        }
        .result()
        .map_err(cudnn("cudnnFindConvolutionBackwardDataAlgorithm"))?;
        Ok(perfs[..returned.clamp(0, ALGORITHMS as c_int) as usize]
            .iter()
            .map(|perf| {
                candidate(
                    perf.algo,
                    perf.status,
                    perf.time,
                    perf.memory,
                    perf.determinism,
                    perf.mathType,
                )
            })
            .collect())
    }

    /// Measures every filter-gradient algorithm of the convolution.
    pub fn find_backward_filter(
        &self,
        x: &TensorDescriptor,
        dy: &TensorDescriptor,
        conv: &ConvDescriptor,
        dw: &FilterDescriptor,
    ) -> Result<Vec<Candidate<sys::cudnnConvolutionBwdFilterAlgo_t>>, GpuError> {
        let mut returned: c_int = 0;
        // SAFETY: as in `find_forward`.
        let mut perfs: [sys::cudnnConvolutionBwdFilterAlgoPerf_t; ALGORITHMS] =
            unsafe { std::mem::zeroed() };
        // SAFETY: as in `find_forward`.
        unsafe {
            sys::cudnnFindConvolutionBackwardFilterAlgorithm(
                self.0,
                x.raw(),
                dy.raw(),
                conv.raw(),
                dw.raw(),
                ALGORITHMS as c_int,
                &mut returned,
                perfs.as_mut_ptr(),
            )
        }
        .result()
        .map_err(cudnn("cudnnFindConvolutionBackwardFilterAlgorithm"))?;
        Ok(perfs[..returned.clamp(0, ALGORITHMS as c_int) as usize]
            .iter()
            .map(|perf| {
                candidate(
                    perf.algo,
                    perf.status,
                    perf.time,
                    perf.memory,
                    perf.determinism,
                    perf.mathType,
                )
            })
            .collect())
    }
}

/// Room for twice as many results as any direction has algorithms (forward has 8): were cuDNN
/// to list an algorithm once per math type, a shorter list would be cut by measured time, and
/// deterministic mode's choice (which must not depend on timings) could see another set.
const ALGORITHMS: usize = 16;

fn candidate<A>(
    algo: A,
    status: sys::cudnnStatus_t,
    time_ms: f32,
    memory: usize,
    determinism: sys::cudnnDeterminism_t,
    math: sys::cudnnMathType_t,
) -> Candidate<A> {
    Candidate {
        algo,
        status,
        time_ms,
        memory,
        deterministic: determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
        math,
    }
}

impl Drop for CudnnHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is valid and dropped once; an error cannot be reported from drop.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

/// A 4-d tensor descriptor with explicit strides.
pub struct TensorDescriptor(sys::cudnnTensorDescriptor_t);

impl TensorDescriptor {
    /// `[n, c, h, w]` of `data_type` with `strides` (see [`super::conv::nhwc_strides`]).
    pub fn new(
        dims: [c_int; 4],
        strides: [c_int; 4],
        data_type: sys::cudnnDataType_t,
    ) -> Result<Self, GpuError> {
        let desc = TensorDescriptor(
            result::create_tensor_descriptor().map_err(cudnn("cudnnCreateTensorDescriptor"))?,
        );
        // SAFETY: the descriptor was just created.
        unsafe { result::set_tensor4d_descriptor_ex(desc.0, data_type, dims, strides) }
            .map_err(cudnn("cudnnSetTensor4dDescriptorEx"))?;
        Ok(desc)
    }

    /// The raw descriptor.
    pub fn raw(&self) -> sys::cudnnTensorDescriptor_t {
        self.0
    }
}

impl Drop for TensorDescriptor {
    fn drop(&mut self) {
        // SAFETY: the descriptor is valid and dropped once.
        let _ = unsafe { result::destroy_tensor_descriptor(self.0) };
    }
}

/// A filter descriptor in cuDNN's NHWC filter format (KRSC, the engine's OHWI).
pub struct FilterDescriptor(sys::cudnnFilterDescriptor_t);

impl FilterDescriptor {
    /// `[k, c, r, s]` of `data_type`.
    pub fn new(dims: [c_int; 4], data_type: sys::cudnnDataType_t) -> Result<Self, GpuError> {
        let desc = FilterDescriptor(
            result::create_filter_descriptor().map_err(cudnn("cudnnCreateFilterDescriptor"))?,
        );
        // SAFETY: the descriptor was just created.
        unsafe {
            result::set_filter4d_descriptor(
                desc.0,
                data_type,
                sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                dims,
            )
        }
        .map_err(cudnn("cudnnSetFilter4dDescriptor"))?;
        Ok(desc)
    }

    /// The raw descriptor.
    pub fn raw(&self) -> sys::cudnnFilterDescriptor_t {
        self.0
    }
}

impl Drop for FilterDescriptor {
    fn drop(&mut self) {
        // SAFETY: the descriptor is valid and dropped once.
        let _ = unsafe { result::destroy_filter_descriptor(self.0) };
    }
}

/// A 2-d cross-correlation (PyTorch's convolution), no dilation.
pub struct ConvDescriptor(sys::cudnnConvolutionDescriptor_t);

impl ConvDescriptor {
    /// Equal padding and stride on both axes, computing (accumulating) in `compute_type`.
    pub fn new(
        padding: c_int,
        stride: c_int,
        compute_type: sys::cudnnDataType_t,
    ) -> Result<Self, GpuError> {
        let desc = ConvDescriptor(
            result::create_convolution_descriptor()
                .map_err(cudnn("cudnnCreateConvolutionDescriptor"))?,
        );
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

    /// The raw descriptor.
    pub fn raw(&self) -> sys::cudnnConvolutionDescriptor_t {
        self.0
    }
}

impl Drop for ConvDescriptor {
    fn drop(&mut self) {
        // SAFETY: the descriptor is valid and dropped once.
        let _ = unsafe { result::destroy_convolution_descriptor(self.0) };
    }
}
