//! CUDA C to machine code (CUBIN, with its PTX) with NVRTC, cached on disk.
//!
//! NVRTC is called through `cudarc` only after the probe found `libnvrtc`; a missing library
//! is a [`CompileError::Nvrtc`] naming it, and a source that does not compile returns NVRTC's
//! log.

use std::ffi::CString;
use std::time::{Duration, Instant};

use cudarc::nvrtc::result as nvrtc;

use crate::arch::GpuArch;
use crate::kernels::KernelSource;
use crate::probe::{Library, MissingLibrary, Probe};
use crate::ptx_cache::{CacheError, CacheKey, PtxCache};

/// NVRTC's options for every kernel file, besides the architecture.
///
/// `--fmad=false`: no contraction of `a * b + c` into one fused multiply-add, so that
/// element-wise kernels round as the CPU engine does (Rust never contracts on its own).
/// Division and square root stay IEEE-exact (`--prec-div`, `--prec-sqrt` default to true).
pub const OPTIONS: [&str; 2] = ["--fmad=false", "--std=c++17"];

/// Why a kernel file did not become PTX.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// `libnvrtc` was not found.
    #[error("cannot compile CUDA kernels: {0}")]
    Nvrtc(#[from] MissingLibrary),
    /// The source holds a NUL byte, which NVRTC cannot take.
    #[error("kernel {kernel}: the source holds a NUL byte")]
    NulInSource {
        /// The kernel file's name.
        kernel: String,
    },
    /// NVRTC rejected the source.
    #[error("kernel {kernel} does not compile for {arch} ({status}); NVRTC's log:\n{log}")]
    Compilation {
        /// The kernel file's name.
        kernel: String,
        /// The target architecture.
        arch: GpuArch,
        /// NVRTC's status.
        status: String,
        /// NVRTC's log: the compiler's messages with file, line and column.
        log: String,
    },
    /// An NVRTC call other than the compilation failed.
    #[error("kernel {kernel}: {call} failed: {status}")]
    Call {
        /// The kernel file's name.
        kernel: String,
        /// The NVRTC function.
        call: &'static str,
        /// NVRTC's status.
        status: String,
    },
}

/// One kernel file compiled for one architecture.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    /// The PTX text (what the launches are checked against, and what tests inspect).
    pub ptx: String,
    /// The machine code the executor loads.
    pub cubin: Vec<u8>,
    /// Whether it came from the disk cache.
    pub from_cache: bool,
    /// Time spent in NVRTC (zero from the cache).
    pub compile_time: Duration,
    /// NVRTC's log of a successful compilation: its warnings (empty from the cache).
    pub warnings: String,
}

/// A CUDA C compiler for one architecture, backed by NVRTC and an optional disk cache.
#[derive(Debug)]
pub struct Compiler {
    arch: GpuArch,
    cache: Option<PtxCache>,
    /// NVRTC's version and the options, part of every cache key.
    identity: String,
}

impl Compiler {
    /// A compiler for `arch`; fails, without calling NVRTC, when the probe did not find it.
    pub fn new(
        probe: &Probe,
        arch: GpuArch,
        cache: Option<PtxCache>,
    ) -> Result<Compiler, CompileError> {
        let nvrtc = probe.require(Library::Nvrtc)?;
        let identity = format!("nvrtc {} {} cubin", nvrtc.version, OPTIONS.join(" "));
        Ok(Compiler {
            arch,
            cache,
            identity,
        })
    }

    /// The target architecture.
    pub fn arch(&self) -> GpuArch {
        self.arch
    }

    /// `kernel` compiled: from the cache when an entry for the same source, compiler and
    /// architecture is there, else compiled and stored. A cache that cannot be written is
    /// returned as the second value, beside the result, as it does not stop the compilation.
    pub fn compile(
        &self,
        kernel: &KernelSource,
    ) -> Result<(CompiledKernel, Option<CacheError>), CompileError> {
        let key = CacheKey {
            kernel: kernel.name,
            source: kernel.source,
            arch: self.arch,
            compiler: &self.identity,
        };
        if let Some((ptx, cubin)) = self.cache.as_ref().and_then(|cache| cache.load(&key)) {
            let compiled = CompiledKernel {
                ptx,
                cubin,
                from_cache: true,
                compile_time: Duration::ZERO,
                warnings: String::new(),
            };
            return Ok((compiled, None));
        }
        let started = Instant::now();
        let (ptx, cubin, warnings) = compile_with_nvrtc(kernel.name, kernel.source, self.arch)?;
        let compile_time = started.elapsed();
        let cache_error = self
            .cache
            .as_ref()
            .and_then(|cache| cache.store(&key, &ptx, &cubin).err());
        let compiled = CompiledKernel {
            ptx,
            cubin,
            from_cache: false,
            compile_time,
            warnings,
        };
        Ok((compiled, cache_error))
    }
}

/// One NVRTC compilation, to PTX, CUBIN and NVRTC's log; the caller has checked that the
/// probe found `libnvrtc`.
fn compile_with_nvrtc(
    name: &str,
    source: &str,
    arch: GpuArch,
) -> Result<(String, Vec<u8>, String), CompileError> {
    let nul = || CompileError::NulInSource {
        kernel: name.to_string(),
    };
    let source_text = CString::new(source).map_err(|_| nul())?;
    let file_name = CString::new(format!("{name}.cu")).map_err(|_| nul())?;
    let call_error = |call| {
        move |status: nvrtc::NvrtcError| CompileError::Call {
            kernel: name.to_string(),
            call,
            status: format!("{:?}", status.0),
        }
    };
    let program = nvrtc::create_program(&source_text, Some(&file_name))
        .map_err(call_error("nvrtcCreateProgram"))?;
    let mut options = vec![arch.nvrtc_option()];
    options.extend(OPTIONS.iter().map(|option| option.to_string()));
    // SAFETY: `program` was created above and is destroyed only at the end of this function;
    // the options are NUL-free ASCII.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    // SAFETY: as above; the log is available after any compilation.
    let log = unsafe { nvrtc::get_program_log(program) }
        .map(|log| c_chars_to_string(&log))
        .unwrap_or_else(|error| format!("(no log: {:?})", error.0));
    let result = match compiled {
        Ok(()) => {
            // SAFETY: as above; the program compiled.
            let ptx = unsafe { nvrtc::get_ptx(program) }.map_err(call_error("nvrtcGetPTX"));
            // SAFETY: as above.
            let cubin = unsafe { get_cubin(program) }.map_err(call_error("nvrtcGetCUBIN"));
            ptx.and_then(|ptx| Ok((c_chars_to_string(&ptx), cubin?, log)))
        }
        Err(status) => Err(CompileError::Compilation {
            kernel: name.to_string(),
            arch,
            status: format!("{:?}", status.0),
            log,
        }),
    };
    // SAFETY: the program is not used after this.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

/// The CUBIN of a compiled program (cudarc 0.19 wraps only the PTX getter).
///
/// # Safety
/// `program` must have been created and compiled for a real architecture (`sm_XY`), and not
/// destroyed.
unsafe fn get_cubin(
    program: cudarc::nvrtc::sys::nvrtcProgram,
) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller's contract; `size` is a valid out-pointer.
    unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(program, &mut size) }.result()?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC said it writes.
    unsafe { cudarc::nvrtc::sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()) }.result()?;
    Ok(cubin)
}

/// Text from NVRTC's NUL-terminated character buffer.
fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&byte| byte != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
