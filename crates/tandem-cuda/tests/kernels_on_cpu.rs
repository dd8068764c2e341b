//! The kernel checks of `common/kernel_checks.rs` (which `gpu_kernels.rs` runs on a GPU) on
//! the CPU: every kernel file, as the executor's NVRTC compiles it, is compiled by the
//! system's C++ compiler with `common/cuda_on_cpu.h` (CUDA's few built-ins this code uses) and
//! launched block by block, each block's threads as OS threads. So a machine without a GPU,
//! CI's included, checks the kernels' arithmetic, indexing, launch shapes and argument lists
//! against the CPU engine; what only a GPU can show (its memory model, its math library's last
//! ulp, the driver's loading) stays with `gpu_kernels.rs`.
//!
//! Needs a C++17 compiler (`CXX`, else `c++`). Without one each test is skipped with the
//! reason, or fails when `TANDEM_REQUIRE_CXX=1` (CI sets it).

mod common;

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use common::kernel_checks::{self, Rig};
use cudarc::driver::LaunchConfig;
use md5::{Digest, Md5};
use tandem_cuda::executor::launch::{check_arguments, Arg};
use tandem_cuda::ptx_params::ParamKind;
use tandem_cuda::KERNELS;

/// Environment variable that turns a missing C++ compiler from a skip into a failure.
const REQUIRE_CXX_ENV: &str = "TANDEM_REQUIRE_CXX";

/// The CUDA built-ins for a C++ compiler.
const CUDA_ON_CPU: &str = include_str!("common/cuda_on_cpu.h");

/// The compiler's options: IEEE float arithmetic with no contraction into fused
/// multiply-adds, as NVRTC compiles with `--fmad=false`.
const CXX_OPTIONS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fPIC",
    "-shared",
    "-pthread",
];

/// A kernel's launch through the emulator: grid and block sizes, and pointers to the
/// argument values (as `cuLaunchKernel`'s `kernelParams`).
type EmulatedLaunch = unsafe extern "C" fn(*const u32, *const u32, *mut *mut c_void);

/// One kernel, compiled for the CPU.
struct CpuKernel {
    launch: EmulatedLaunch,
    params: Vec<ParamKind>,
}

/// Every kernel of every file, by name; the libraries stay loaded for the process.
struct CpuKernels {
    kernels: HashMap<String, CpuKernel>,
    _libraries: Vec<libloading::Library>,
}

/// The kernels compiled once per test process; `Err` holds why they are not there.
static CPU_KERNELS: OnceLock<Result<CpuKernels, Unavailable>> = OnceLock::new();

/// Launches take turns: a block's `__shared__` arrays are statics of its library.
static ONE_LAUNCH_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Why the kernels could not be run on the CPU.
#[derive(Debug)]
enum Unavailable {
    /// No C++ compiler could be started (a skip, unless CI requires one).
    NoCompiler(String),
    /// The compiler ran and refused a file, or a library did not load (always a failure).
    Failed(String),
}

/// The kernels on the CPU as a [`Rig`]: host buffers whose addresses the kernels see.
struct CpuRig {
    kernels: &'static CpuKernels,
    buffers: HashMap<u64, Vec<u64>>,
}

impl CpuRig {
    /// The rig, or `None` (after printing why) without a C++ compiler.
    fn open(test: &str) -> Option<CpuRig> {
        match CPU_KERNELS.get_or_init(compile_every_kernel_file) {
            Ok(kernels) => Some(CpuRig {
                kernels,
                buffers: HashMap::new(),
            }),
            Err(Unavailable::NoCompiler(reason)) => {
                assert!(
                    std::env::var(REQUIRE_CXX_ENV).as_deref() != Ok("1"),
                    "{REQUIRE_CXX_ENV}=1, but {reason}"
                );
                eprintln!("{test}: skipped, {reason}");
                None
            }
            Err(Unavailable::Failed(reason)) => panic!("{reason}"),
        }
    }
}

impl Rig for CpuRig {
    fn upload_bytes(&mut self, bytes: &[u8]) -> u64 {
        // Whole u64s, so that every buffer is 8-byte aligned, as the kernels' doubles need.
        let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
        // SAFETY: `words` holds at least `bytes.len()` bytes and does not overlap `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr().cast(), bytes.len())
        };
        let address = words.as_ptr() as u64;
        self.buffers.insert(address, words);
        address
    }

    fn download_bytes(&mut self, address: u64, len: usize) -> Vec<u8> {
        let words = &self.buffers[&address];
        kernel_checks::bytes_of(words)[..len].to_vec()
    }

    fn launch(&mut self, name: &'static str, config: LaunchConfig, args: &[Arg]) {
        let Some(kernel) = self.kernels.kernels.get(name) else {
            panic!("{name}: no such kernel in {:?}", file_names());
        };
        check_arguments(name, &kernel.params, args).unwrap_or_else(|e| panic!("{e}"));
        let mut values: Vec<u64> = args.iter().map(arg_bits).collect();
        let mut pointers: Vec<*mut c_void> = values
            .iter_mut()
            .map(|value| (value as *mut u64).cast())
            .collect();
        let grid = [config.grid_dim.0, config.grid_dim.1, config.grid_dim.2];
        let block = [config.block_dim.0, config.block_dim.1, config.block_dim.2];
        let _turn = ONE_LAUNCH_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // SAFETY: the arguments fit the kernel's parameters (checked above; each value sits in
        // the low bytes of its u64, as x86-64 and AArch64 read a narrower value), every
        // pointer argument is a buffer of this rig sized by the check for this launch, and
        // the launch returns only when every block has run.
        unsafe { (kernel.launch)(grid.as_ptr(), block.as_ptr(), pointers.as_mut_ptr()) };
    }
}

/// An argument's bits in the low bytes of a u64 (little-endian, as the kernels read them).
fn arg_bits(arg: &Arg) -> u64 {
    match *arg {
        Arg::Ptr(value) | Arg::U64(value) => value,
        Arg::I64(value) => value as u64,
        Arg::I32(value) => u64::from(value as u32),
        Arg::F32(value) => u64::from(value.to_bits()),
        Arg::F64(value) => value.to_bits(),
    }
}

fn file_names() -> Vec<&'static str> {
    KERNELS.iter().map(|kernel| kernel.name).collect()
}

/// Compiles (or finds compiled, by a digest of its source) and loads every kernel file.
fn compile_every_kernel_file() -> Result<CpuKernels, Unavailable> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let folder = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_on_cpu");
    std::fs::create_dir_all(&folder)
        .map_err(|e| Unavailable::Failed(format!("cannot create {}: {e}", folder.display())))?;
    let mut kernels = HashMap::new();
    let mut libraries = Vec::new();
    for file in KERNELS {
        let names = kernel_names(file.source);
        let source = wrapper_source(file.name, file.source, &names);
        let library_path = compile(&compiler, &folder, file.name, &source)?;
        // SAFETY: the library is our kernel file compiled with cuda_on_cpu.h; loading it runs
        // no initializer of ours beyond C++'s static ones.
        let library = unsafe { libloading::Library::new(&library_path) }.map_err(|e| {
            Unavailable::Failed(format!("cannot load {}: {e}", library_path.display()))
        })?;
        for name in names {
            let kernel = load_kernel(&library, &name).map_err(|e| {
                Unavailable::Failed(format!("{}: {name}: {e}", library_path.display()))
            })?;
            kernels.insert(name, kernel);
        }
        libraries.push(library);
    }
    Ok(CpuKernels {
        kernels,
        _libraries: libraries,
    })
}

/// The names of the kernels (`extern "C" __global__ void NAME(`) of a kernel file.
fn kernel_names(source: &str) -> Vec<String> {
    const ENTRY: &str = "extern \"C\" __global__ void ";
    source
        .match_indices(ENTRY)
        .map(|(at, _)| {
            let rest = &source[at + ENTRY.len()..];
            let end = rest.find('(').unwrap_or(rest.len());
            rest[..end].trim().to_string()
        })
        .collect()
}

/// The C++ file for kernel file `name`: the built-ins, the kernels, one export per kernel.
fn wrapper_source(name: &str, source: &str, kernels: &[String]) -> String {
    let mut text = format!("{CUDA_ON_CPU}\n#line 1 \"{name}.cu\"\n{source}\n");
    for kernel in kernels {
        text.push_str(&format!("EXPORT_LAUNCH({kernel})\n"));
    }
    text
}

/// The shared library of `source`, compiled into `folder` unless a library of the same
/// source, compiler and options is there already (written under a temporary name, then
/// renamed, so that test processes running at once never load a half-written one).
fn compile(
    compiler: &str,
    folder: &Path,
    name: &str,
    source: &str,
) -> Result<PathBuf, Unavailable> {
    let mut digest = Md5::new();
    digest.update(source.as_bytes());
    digest.update(compiler.as_bytes());
    digest.update(CXX_OPTIONS.join(" ").as_bytes());
    let key: String = digest.finalize()[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let library = folder.join(format!("{name}-{key}.so"));
    if library.exists() {
        return Ok(library);
    }
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id())
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "");
    let source_path = folder.join(format!("{name}-{key}-{unique}.cpp"));
    let partial = folder.join(format!("{name}-{key}-{unique}.so.tmp"));
    std::fs::write(&source_path, source)
        .map_err(|e| Unavailable::Failed(format!("cannot write {}: {e}", source_path.display())))?;
    let output = Command::new(compiler)
        .args(CXX_OPTIONS)
        .arg("-o")
        .arg(&partial)
        .arg(&source_path)
        .output();
    let _ = std::fs::remove_file(&source_path);
    let output = output.map_err(|e| {
        Unavailable::NoCompiler(format!(
            "no C++ compiler to run the kernels on the CPU: cannot start `{compiler}` ({e}); \
             set CXX to one"
        ))
    })?;
    if !output.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(Unavailable::Failed(format!(
            "{compiler} refused {name}.cu with cuda_on_cpu.h ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    std::fs::rename(&partial, &library)
        .map_err(|e| Unavailable::Failed(format!("cannot rename to {}: {e}", library.display())))?;
    Ok(library)
}

/// Kernel `name`'s launch and parameter kinds from its library.
fn load_kernel(library: &libloading::Library, name: &str) -> Result<CpuKernel, String> {
    // SAFETY: EXPORT_LAUNCH defines both symbols with exactly these signatures.
    let (launch, params) = unsafe {
        let launch = library
            .get::<EmulatedLaunch>(format!("emulate_{name}\0").as_bytes())
            .map_err(|e| e.to_string())?;
        let params = library
            .get::<unsafe extern "C" fn() -> *const c_char>(
                format!("emulate_params_{name}\0").as_bytes(),
            )
            .map_err(|e| e.to_string())?;
        (*launch, CStr::from_ptr(params()).to_bytes().to_vec())
    };
    let params = params
        .iter()
        .map(|kind| match kind {
            b'l' => Ok(ParamKind::Int64),
            b'i' => Ok(ParamKind::Int32),
            b'f' => Ok(ParamKind::Float32),
            b'd' => Ok(ParamKind::Float64),
            other => Err(format!("unknown parameter kind {}", *other as char)),
        })
        .collect::<Result<_, _>>()?;
    Ok(CpuKernel { launch, params })
}

/// Declares one test per check, each run on the CPU.
macro_rules! on_the_cpu {
    ($($check:ident),* $(,)?) => {$(
        #[test]
        fn $check() {
            if let Some(mut cpu) = CpuRig::open(stringify!($check)) {
                kernel_checks::$check(&mut cpu);
            }
        }
    )*};
}

on_the_cpu!(
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
);

#[test]
fn every_kernel_the_executor_launches_runs_on_the_cpu() {
    let Some(rig) = CpuRig::open("every_kernel_the_executor_launches_runs_on_the_cpu") else {
        return;
    };
    let mut compiled: Vec<&str> = rig.kernels.kernels.keys().map(String::as_str).collect();
    compiled.sort_unstable();
    let mut launched: Vec<&str> = tandem_cuda::executor::launch::FUNCTIONS
        .iter()
        .flat_map(|(_, names)| names.iter().copied())
        .collect();
    launched.sort_unstable();
    assert_eq!(compiled, launched);
}
