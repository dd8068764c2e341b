//! The GPU executor's errors: each names the CUDA, cuDNN or cuBLAS call and its status.

use cudarc::cublas::result::CublasError;
use cudarc::cudnn::result::CudnnError;
use cudarc::driver::DriverError;
use tandem_models::ModelError;

use crate::compile::CompileError;
use crate::probe::MissingLibrary;

/// What can go wrong running a step on the GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A library the executor needs was not found by the probe.
    #[error(transparent)]
    MissingLibrary(#[from] MissingLibrary),
    /// A kernel file did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {call} failed: {status:?}")]
    Driver {
        /// The driver function or cudarc method.
        call: &'static str,
        /// The driver's status.
        status: DriverError,
    },
    /// A kernel of ours was not found in its loaded module, or its launch failed.
    #[error("kernel {kernel}: {call} failed: {status:?}")]
    Kernel {
        /// The kernel's name.
        kernel: &'static str,
        /// What failed (loading or launching).
        call: &'static str,
        /// The driver's status.
        status: DriverError,
    },
    /// A launch's arguments do not match its kernel's signature.
    #[error("kernel {kernel}: launched with {found}, its parameters are {expected}")]
    KernelArguments {
        /// The kernel's name.
        kernel: &'static str,
        /// The parameters of its signature.
        expected: String,
        /// The arguments of the launch.
        found: String,
    },
    /// A kernel's signature does not match the parameters its PTX declares.
    #[error("kernel {kernel}: its signature is {signature}, its PTX declares {ptx}")]
    KernelSignature {
        /// The kernel's entry point.
        kernel: &'static str,
        /// The parameters of its signature.
        signature: String,
        /// The parameters of its PTX entry, or `no entry`.
        ptx: String,
    },
    /// A cuDNN call failed.
    #[error("cuDNN: {call} failed: {status:?}")]
    Cudnn {
        /// The cuDNN function.
        call: &'static str,
        /// cuDNN's status.
        status: CudnnError,
    },
    /// cuDNN offered no algorithm for a convolution under the settings.
    #[error("cuDNN: no {direction} algorithm for convolution {shape} ({reason})")]
    NoAlgorithm {
        /// forward, backward data or backward filter.
        direction: &'static str,
        /// The convolution's shape, in words.
        shape: String,
        /// Why every candidate was refused.
        reason: String,
    },
    /// A convolution call refused, when it ran, the algorithm chosen for it
    /// (`CUDNN_STATUS_NOT_SUPPORTED`).
    #[error(
        "cuDNN: {call} failed: CUDNN_STATUS_NOT_SUPPORTED for the {direction} algorithm chosen \
         for convolution {shape}, {chosen}; {candidates}"
    )]
    AlgorithmRefused {
        /// The cuDNN function.
        call: &'static str,
        /// forward, backward data or backward filter.
        direction: &'static str,
        /// The convolution's shape, in words.
        shape: String,
        /// The chosen algorithm, in words.
        chosen: String,
        /// The measured candidates in words, or where the choice came from.
        candidates: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {call} failed: {status:?}")]
    Cublas {
        /// The cuBLAS function.
        call: &'static str,
        /// cuBLAS's status.
        status: CublasError,
    },
    /// A size does not fit the `int` of a CUDA library call.
    #[error("{what} = {value} does not fit a 32-bit int of cuDNN/cuBLAS")]
    TooLarge {
        /// The size's meaning.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// A host slice has a different length than the device buffer it is copied to or from.
    #[error("{what} has {found} values, the device buffer holds {expected}")]
    Length {
        /// Which values, e.g. `images`.
        what: &'static str,
        /// The host slice's length.
        found: usize,
        /// The length the device buffer (or the plan) has.
        expected: usize,
    },
    /// A batch names an image the dataset on the device does not have.
    #[error("batch index {index}, expected below the dataset size {len}")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// The number of images on the device.
        len: usize,
    },
    /// A setting the GPU executor does not support.
    #[error("the GPU executor does not support {0} yet")]
    Unsupported(&'static str),
    /// `--precision bf16` on a GPU without bfloat16 tensor cores.
    #[error("--precision bf16 needs a GPU of compute capability 8.0 (Ampere) or later; cuda:{ordinal} is {arch}")]
    Bf16NeedsAmpere {
        /// The GPU's ordinal.
        ordinal: usize,
        /// Its architecture.
        arch: crate::arch::GpuArch,
    },
    /// A step method was called before [`super::CudaExecutor::prepare`] for its plan.
    #[error("the GPU executor has no storage for this plan (call prepare first)")]
    NotPrepared,
    /// SyncBatchNorm's reducer failed.
    #[error("SyncBatchNorm all-reduce failed: {0}")]
    BatchNormSync(String),
    /// An NCCL collective between the GPU ranks failed or timed out.
    #[error(transparent)]
    Collective(#[from] crate::collective::CollectiveError),
    /// A data-parallel method was called before [`super::CudaExecutor::join_nccl`].
    #[error("the GPU executor has not joined an NCCL communicator")]
    NoCommunicator,
}

impl From<GpuError> for ModelError {
    /// A GPU failure as the models crate's error, so that `?` carries it out of the
    /// executor's methods and the model's walk.
    fn from(error: GpuError) -> Self {
        ModelError::Device(Box::new(error))
    }
}

/// Maps a driver error to [`GpuError::Driver`] naming `call`.
pub fn driver(call: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |status| GpuError::Driver { call, status }
}

/// Maps a cuDNN error to [`GpuError::Cudnn`] naming `call`.
pub fn cudnn(call: &'static str) -> impl Fn(CudnnError) -> GpuError {
    move |status| GpuError::Cudnn { call, status }
}

/// Maps a cuBLAS error to [`GpuError::Cublas`] naming `call`.
pub fn cublas(call: &'static str) -> impl Fn(CublasError) -> GpuError {
    move |status| GpuError::Cublas { call, status }
}

/// `value` as the `int` of a library call, or [`GpuError::TooLarge`].
pub fn int(what: &'static str, value: usize) -> Result<i32, GpuError> {
    i32::try_from(value).map_err(|_| GpuError::TooLarge { what, value })
}

/// `Ok` when `found == expected`, else [`GpuError::Length`].
pub fn same_length(what: &'static str, found: usize, expected: usize) -> Result<(), GpuError> {
    if found == expected {
        Ok(())
    } else {
        Err(GpuError::Length {
            what,
            found,
            expected,
        })
    }
}
