//! Our NVRTC-compiled kernels, loaded once per executor, and their launches.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::error::GpuError;
use crate::compile::Compiler;
use crate::kernels::KERNELS;

/// Every kernel the executor launches, by file.
const FUNCTIONS: &[(&str, &[&str])] = &[
    (
        "batchnorm",
        &[
            "bn_stats_partial",
            "bn_stats_finish",
            "bn_train_coefficients",
            "bn_eval_coefficients",
            "bn_backward_partial",
            "bn_backward_finish",
            "bn_backward_coefficients",
            "bn_backward_input",
        ],
    ),
    ("epilogue", &["bn_apply", "relu_backward"]),
    (
        "pooling",
        &["average_pool_forward", "average_pool_backward"],
    ),
    (
        "loss",
        &[
            "cross_entropy_rows",
            "cross_entropy_mean",
            "cross_entropy_backward",
        ],
    ),
    ("optimizers", &["sgd_step", "adam_step"]),
    ("bias", &["bias_add", "add_channel_sums"]),
    ("collective", &["divide_in_place"]),
    ("augment", &["augment_draws", "augment_apply"]),
    (
        "convert",
        &["float_to_bf16", "bf16_to_float", "bf16_add_to_float"],
    ),
];

/// One kernel argument, by value (device pointers as their addresses; a null pointer is 0).
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

/// The loaded kernels.
pub struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    /// Compiles (or takes from the PTX cache) every kernel file and loads the functions the
    /// executor uses into `context`.
    pub fn load(context: &Arc<CudaContext>, compiler: &Compiler) -> Result<Self, GpuError> {
        let mut functions = HashMap::new();
        for &(file, names) in FUNCTIONS {
            let Some(source) = KERNELS.iter().find(|kernel| kernel.name == file) else {
                return Err(GpuError::Unsupported("a kernel file missing from KERNELS"));
            };
            // A cache that cannot be written does not stop the compilation.
            let (compiled, _cache_error) = compiler.compile(source)?;
            let module = context
                .load_module(Ptx::from_src(compiled.ptx))
                .map_err(|status| GpuError::Kernel {
                    kernel: file_name(file),
                    call: "cuModuleLoadData",
                    status,
                })?;
            for &name in names {
                let function = module
                    .load_function(name)
                    .map_err(|status| GpuError::Kernel {
                        kernel: name,
                        call: "cuModuleGetFunction",
                        status,
                    })?;
                functions.insert(name, function);
            }
        }
        Ok(Kernels { functions })
    }

    /// Launches kernel `name` on `stream` with `args`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, every pointer must
    /// address device memory of the size the kernel reads or writes under `config`, and the
    /// memory must stay allocated until the stream has run the kernel.
    pub unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        name: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let Some(function) = self.functions.get(name) else {
            return Err(GpuError::Unsupported(
                "launching a kernel that was not loaded",
            ));
        };
        let mut builder = stream.launch_builder(function);
        for arg in args {
            match arg {
                Arg::Ptr(value) => builder.arg(value),
                Arg::I32(value) => builder.arg(value),
                Arg::I64(value) => builder.arg(value),
                Arg::U64(value) => builder.arg(value),
                Arg::F32(value) => builder.arg(value),
                Arg::F64(value) => builder.arg(value),
            };
        }
        // SAFETY: the caller's contract.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|status| GpuError::Kernel {
                kernel: name,
                call: "cuLaunchKernel",
                status,
            })
    }
}

/// The file's name as a `'static` string for errors.
fn file_name(file: &str) -> &'static str {
    FUNCTIONS
        .iter()
        .find(|(name, _)| *name == file)
        .map_or("kernel file", |(name, _)| name)
}

/// One thread per element, 256 to a block.
pub fn per_element(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `bn_stats_partial`/`bn_backward_partial`'s launch: blocks of 32 channels by 8 row lanes,
/// one block row per `rows_per_block` rows.
pub fn column_sums(channels: usize, row_blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (channels.div_ceil(32).max(1) as u32, row_blocks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}
