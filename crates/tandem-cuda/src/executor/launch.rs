//! Our NVRTC-compiled kernels, loaded once per executor, and their launches.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::error::GpuError;
use crate::compile::Compiler;
use crate::kernels::KERNELS;
use crate::ptx_params::{describe, entry_params, ParamKind};

/// Every kernel the executor launches, by file; a kernel over activations has a `_bf16` twin
/// for bfloat16 ones (see [`super::memory::Activations::kernel`]).
pub const FUNCTIONS: &[(&str, &[&str])] = &[
    (
        "batchnorm",
        &[
            "bn_stats",
            "bn_stats_bf16",
            "bn_train_coefficients",
            "bn_eval_coefficients",
            "bn_backward_sums",
            "bn_backward_sums_bf16",
            "bn_backward_coefficients",
            "bn_backward_input",
            "bn_backward_input_bf16",
        ],
    ),
    (
        "epilogue",
        &[
            "bn_apply",
            "bn_apply_bf16",
            "relu_backward",
            "relu_backward_bf16",
        ],
    ),
    (
        "pooling",
        &[
            "average_pool_forward",
            "average_pool_forward_bf16",
            "average_pool_backward",
            "average_pool_backward_bf16",
        ],
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
    ("bias", &["bias_add", "bias_add_bf16", "add_channel_sums"]),
    ("collective", &["divide_in_place"]),
    (
        "augment",
        &["augment_draws", "augment_apply", "augment_apply_f32"],
    ),
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

impl Arg {
    /// The PTX parameter kind this argument fills.
    pub fn kind(&self) -> ParamKind {
        match self {
            Arg::Ptr(_) | Arg::I64(_) | Arg::U64(_) => ParamKind::Int64,
            Arg::I32(_) => ParamKind::Int32,
            Arg::F32(_) => ParamKind::Float32,
            Arg::F64(_) => ParamKind::Float64,
        }
    }
}

/// A loaded kernel and its parameter list, read from its PTX.
struct Function {
    function: CudaFunction,
    params: Vec<ParamKind>,
}

/// The loaded kernels.
pub struct Kernels {
    functions: HashMap<&'static str, Function>,
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
            let params_of = |name: &'static str| {
                entry_params(&compiled.ptx, name).ok_or(GpuError::KernelArguments {
                    kernel: name,
                    expected: "an entry in its module's PTX".to_string(),
                    found: String::new(),
                })
            };
            let params: Vec<Vec<ParamKind>> = names
                .iter()
                .map(|&name| params_of(name))
                .collect::<Result<_, _>>()?;
            let module = context
                .load_module(Ptx::from_binary(compiled.cubin))
                .map_err(|status| GpuError::Kernel {
                    kernel: file_name(file),
                    call: "cuModuleLoadData",
                    status,
                })?;
            for (&name, params) in names.iter().zip(params) {
                let function = module
                    .load_function(name)
                    .map_err(|status| GpuError::Kernel {
                        kernel: name,
                        call: "cuModuleGetFunction",
                        status,
                    })?;
                functions.insert(name, Function { function, params });
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
        let Some(Function { function, params }) = self.functions.get(name) else {
            return Err(GpuError::Unsupported(
                "launching a kernel that was not loaded",
            ));
        };
        check_arguments(name, params, args)?;
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

/// `Ok` when `args` fill `params` one for one, else [`GpuError::KernelArguments`] naming
/// both lists.
pub fn check_arguments(
    kernel: &'static str,
    params: &[ParamKind],
    args: &[Arg],
) -> Result<(), GpuError> {
    let found: Vec<ParamKind> = args.iter().map(Arg::kind).collect();
    if found == params {
        return Ok(());
    }
    Err(GpuError::KernelArguments {
        kernel,
        expected: describe(params),
        found: describe(&found),
    })
}

/// The file's name as a `'static` string for errors.
fn file_name(file: &str) -> &'static str {
    FUNCTIONS
        .iter()
        .find(|(name, _)| *name == file)
        .map_or("kernel file", |(name, _)| name)
}

/// Rows a block of the column sums (`bn_stats`, `bn_backward_sums`) adds in their first pass;
/// fixed, so that the order of every sum depends only on the shape.
pub const ROWS_PER_BLOCK: usize = 256;

/// Row blocks of a column sum over `rows` rows.
pub fn row_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_BLOCK).max(1)
}

/// Channels a block of the column sums adds (`CHANNEL_LANES` in `batchnorm.cu`).
pub const CHANNELS_PER_BLOCK: usize = 32;

/// Groups of [`CHANNELS_PER_BLOCK`] channels of a column sum over `channels` columns: the
/// launch's blocks on the grid's y, and its arrival counters.
pub fn channel_groups(channels: usize) -> usize {
    channels.div_ceil(CHANNELS_PER_BLOCK).max(1)
}

/// One thread per element, 256 to a block.
pub fn per_element(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of the batch-norm column sums (`bn_stats`, `bn_backward_sums`): blocks of 32
/// channels by 8 row lanes, one block per row block of `rows_per_block` rows (on the grid's x,
/// which holds 2^31 - 1 blocks) and per 32 channels (on y, one arrival counter each).
pub fn column_sums(channels: usize, row_blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (row_blocks as u32, channel_groups(channels) as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_must_fill_the_parameters_one_for_one() {
        use ParamKind::*;
        let params = [Int64, Int64, Float32];
        let right = [Arg::Ptr(16), Arg::I64(3), Arg::F32(2.0)];
        assert!(check_arguments("divide_in_place", &params, &right).is_ok());
        let swapped = [Arg::Ptr(16), Arg::F32(2.0), Arg::I64(3)];
        let error = check_arguments("divide_in_place", &params, &swapped).unwrap_err();
        assert_eq!(
            error.to_string(),
            "kernel divide_in_place: launched with (64-bit int or pointer, float, 64-bit int or \
             pointer), its parameters are (64-bit int or pointer, 64-bit int or pointer, float)"
        );
        let short = [Arg::Ptr(16), Arg::I32(3), Arg::F32(2.0)];
        assert!(check_arguments("divide_in_place", &params, &short).is_err());
        assert!(check_arguments("divide_in_place", &params, &right[..2]).is_err());
    }
}
