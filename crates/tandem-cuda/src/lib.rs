//! Tandem's NVIDIA GPU side. The crate's README says what its tests check without a GPU and
//! what only a GPU can show.
//!
//! - [`probe`]: finds the CUDA libraries (driver, NVRTC, cuBLAS, cuDNN, NCCL) once, before any
//!   call into `cudarc`, which would panic on a missing one;
//! - [`device`]: the rules of `--device auto|cpu|cuda|cuda:N` and of the GPU a local rank takes;
//! - [`kernels`] and [`compile`]: the CUDA C kernel files and their compilation to machine
//!   code (and PTX) with NVRTC, cached on disk by [`ptx_cache`];
//! - [`collective`]: NCCL between GPU ranks ([`NcclGroup`]), bounded by a watchdog;
//! - [`executor`]: the GPU executor ([`CudaExecutor`]) over cuDNN, cuBLAS and our kernels,
//!   whose walks of the model run through `tandem_models::Executor`.

pub mod arch;
pub mod bf16;
pub mod collective;
pub mod compile;
pub mod device;
pub mod executor;
pub mod job;
pub mod kernels;
pub mod nccl;
pub mod probe;
pub mod ptx_cache;
pub mod ptx_params;

pub use arch::GpuArch;
pub use collective::{CollectiveError, NcclGroup};
pub use compile::{CompileError, CompiledKernel, Compiler};
pub use device::{
    test_gpu_available, why_no_gpu, Device, DeviceError, DeviceRequest, GpuFacts, REQUIRE_GPU_ENV,
};
pub use executor::{CudaExecutor, GpuError, GpuSettings, Precision};
pub use job::GpuJob;
pub use kernels::{KernelSource, KERNELS};
pub use probe::{Library, MissingLibrary, Probe, SearchPath};
pub use ptx_cache::PtxCache;
