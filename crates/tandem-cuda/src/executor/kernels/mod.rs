//! Our kernels as typed functions, one module per kernel file of `kernels/` (the executor's
//! own: the crate's). Each module's [`kernels!`] block writes a kernel's name, its bfloat16
//! twin and its parameters once, and makes of them both the typed function and the kernel's
//! [`Signature`]. [`Kernels::load`]
//! checks every signature against the kernel's PTX, and every launch, typed or not, passes
//! through one place that hands its arguments to the driver.

mod args;
pub(crate) mod augment;
pub(crate) mod batchnorm;
pub(crate) mod bias;
pub(crate) mod collective;
pub(crate) mod convert;
pub(crate) mod epilogue;
pub(crate) mod exact_sum;
pub(crate) mod loss;
pub(crate) mod optimizers;
pub(crate) mod pooling;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

pub use args::{describe, ActPtr, Arg, ArgKind, KernelArg, Ptr};

use super::error::GpuError;
use super::memory::Activations;
use crate::compile::Compiler;
use crate::ptx_params::{self, entry_params, ParamKind};

/// Declares the kernels of one `.cu` file: `file "name";`, then per kernel its doc, `fn`, its
/// name, `/ twin` for a bfloat16 twin, and its parameters as the typed function takes them.
/// Makes `FILE`, the file's [`KernelFile`], and per kernel a function that launches it on a
/// [`Queue`]; a kernel with a twin takes its entry point from its [`ActPtr`] arguments.
macro_rules! kernels {
    (
        file $file:literal;
        $(
            $(#[$doc:meta])*
            fn $name:ident $(/ $twin:ident)? ($($param:ident: $type:ty),* $(,)?);
        )*
    ) => {
        /// The kernels of this file.
        pub const FILE: $crate::executor::kernels::KernelFile =
            $crate::executor::kernels::KernelFile {
                name: $file,
                signatures: &[$($crate::executor::kernels::Signature {
                    name: stringify!($name),
                    twin: kernels!(@twin $($twin)?),
                    params: &[$($crate::executor::kernels::Param {
                        name: stringify!($param),
                        kind: <$type as $crate::executor::kernels::KernelArg>::KIND,
                    }),*],
                }),*],
            };

        $(
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            pub fn $name(
                queue: &$crate::executor::kernels::Queue<'_>,
                config: cudarc::driver::LaunchConfig,
                $($param: $type),*
            ) -> Result<(), $crate::executor::GpuError> {
                use $crate::executor::kernels::KernelArg;
                queue.launch(
                    stringify!($name),
                    config,
                    &[$($param.arg()),*],
                    &[$($param.activations()),*],
                )
            }
        )*
    };
    (@twin) => { None };
    (@twin $twin:ident) => { Some(stringify!($twin)) };
}
use kernels;

/// Every kernel file's kernels, in the order of [`crate::KERNELS`].
pub const FILES: &[KernelFile] = &[
    batchnorm::FILE,
    epilogue::FILE,
    pooling::FILE,
    loss::FILE,
    optimizers::FILE,
    augment::FILE,
    bias::FILE,
    collective::FILE,
    convert::FILE,
    exact_sum::FILE,
];

/// The kernels of one `.cu` file.
#[derive(Debug)]
pub struct KernelFile {
    /// The file's name without `.cu` (as [`crate::KernelSource::name`]).
    pub name: &'static str,
    /// Its kernels.
    pub signatures: &'static [Signature],
}

/// One kernel: its name, the name of its bfloat16 twin (same parameters, `Act` bfloat16),
/// and its parameters.
#[derive(Debug)]
pub struct Signature {
    /// The float32 entry point.
    pub name: &'static str,
    /// The bfloat16 entry point, for a kernel over activations.
    pub twin: Option<&'static str>,
    /// The parameters in order.
    pub params: &'static [Param],
}

/// One parameter of a [`Signature`].
#[derive(Debug)]
pub struct Param {
    /// Its name in the typed function.
    pub name: &'static str,
    /// Its kind.
    pub kind: ArgKind,
}

impl Signature {
    /// The entry point for activations of `kind`: the kernel itself for float32, its twin for
    /// bfloat16; an error for a kernel that has none.
    pub fn entry(&self, kind: Activations) -> Result<&'static str, GpuError> {
        match (kind, self.twin) {
            (Activations::F32, _) => Ok(self.name),
            (Activations::Bf16, Some(twin)) => Ok(twin),
            (Activations::Bf16, None) => Err(GpuError::Unsupported(
                "a kernel over activations without a bfloat16 twin",
            )),
        }
    }

    /// Its entry points: the kernel and its twin.
    pub fn entries(&self) -> impl Iterator<Item = &'static str> {
        std::iter::once(self.name).chain(self.twin)
    }

    /// The kinds of its parameters.
    pub fn kinds(&self) -> Vec<ArgKind> {
        self.params.iter().map(|param| param.kind).collect()
    }

    /// `Ok` when every entry point of `ptx` named by the signature declares its parameters;
    /// else [`GpuError::KernelSignature`] naming both lists.
    pub fn check_ptx(&self, ptx: &str) -> Result<(), GpuError> {
        let expected: Vec<ParamKind> = self.params.iter().map(|param| param.kind.ptx()).collect();
        for entry in self.entries() {
            let found = entry_params(ptx, entry);
            if found.as_deref() != Some(&expected[..]) {
                return Err(GpuError::KernelSignature {
                    kernel: entry,
                    signature: describe(&self.kinds()),
                    ptx: found.map_or("no entry".to_string(), |kinds| ptx_params::describe(&kinds)),
                });
            }
        }
        Ok(())
    }

    /// `Ok` when `args` fill the parameters one for one, else [`GpuError::KernelArguments`]
    /// naming both lists.
    pub fn check_arguments(&self, entry: &'static str, args: &[Arg]) -> Result<(), GpuError> {
        let found: Vec<ArgKind> = args.iter().map(Arg::kind).collect();
        if found == self.kinds() {
            return Ok(());
        }
        Err(GpuError::KernelArguments {
            kernel: entry,
            expected: describe(&self.kinds()),
            found: describe(&found),
        })
    }
}

/// The signature with entry point `entry` (a kernel's name or its twin's).
pub fn signature(entry: &str) -> Option<&'static Signature> {
    FILES
        .iter()
        .flat_map(|file| file.signatures)
        .find(|signature| signature.entries().any(|name| name == entry))
}

/// The element type of a launch's activations: that of every non-null [`ActPtr`] argument
/// (float32 when there are none); an error when they differ.
fn launch_activations(kinds: &[Option<Activations>]) -> Result<Activations, GpuError> {
    let mut kinds = kinds.iter().flatten();
    let Some(&first) = kinds.next() else {
        return Ok(Activations::F32);
    };
    if kinds.any(|&kind| kind != first) {
        return Err(GpuError::Unsupported(
            "activations of two element types in one launch",
        ));
    }
    Ok(first)
}

/// A loaded entry point and its signature.
struct Function {
    function: CudaFunction,
    signature: &'static Signature,
}

/// The loaded kernels, by entry point.
pub struct Kernels {
    functions: HashMap<&'static str, Function>,
}

impl Kernels {
    /// Compiles (or takes from the PTX cache) every kernel file, checks each signature of
    /// [`FILES`] against the PTX, and loads every entry point into `context`.
    pub fn load(context: &Arc<CudaContext>, compiler: &Compiler) -> Result<Self, GpuError> {
        let mut functions = HashMap::new();
        for file in FILES {
            let Some(source) = crate::kernels::kernel(file.name) else {
                return Err(GpuError::Unsupported("a kernel file missing from KERNELS"));
            };
            // A cache that cannot be written does not stop the compilation.
            let (compiled, _cache_error) = compiler.compile(source)?;
            for signature in file.signatures {
                signature.check_ptx(&compiled.ptx)?;
            }
            let module = context
                .load_module(Ptx::from_binary(compiled.cubin))
                .map_err(|status| GpuError::Kernel {
                    kernel: file.name,
                    call: "cuModuleLoadData",
                    status,
                })?;
            for signature in file.signatures {
                for entry in signature.entries() {
                    let function =
                        module
                            .load_function(entry)
                            .map_err(|status| GpuError::Kernel {
                                kernel: entry,
                                call: "cuModuleGetFunction",
                                status,
                            })?;
                    functions.insert(
                        entry,
                        Function {
                            function,
                            signature,
                        },
                    );
                }
            }
        }
        Ok(Kernels { functions })
    }

    /// Launches entry point `entry` on `stream` with `args` built at run time, checked against
    /// its signature (for tests, which launch kernels by name).
    ///
    /// # Safety
    /// Every pointer in `args` must address device memory of the extent the kernel reads or
    /// writes under `config`, allocated until the stream has run the kernel.
    pub unsafe fn launch_untyped(
        &self,
        stream: &Arc<CudaStream>,
        entry: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        self.launch(stream, entry, config, args)
    }

    /// Launches entry point `entry` on `stream` with `args`, once they are checked against
    /// its signature.
    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        entry: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let Some(Function {
            function,
            signature,
        }) = self.functions.get(entry)
        else {
            return Err(GpuError::Unsupported(
                "launching a kernel that was not loaded",
            ));
        };
        signature.check_arguments(entry, args)?;
        let mut builder = stream.launch_builder(function);
        for arg in args {
            match arg {
                Arg::Ptr(value) | Arg::U64(value) => builder.arg(value),
                Arg::I32(value) => builder.arg(value),
                Arg::I64(value) => builder.arg(value),
                Arg::F32(value) => builder.arg(value),
                Arg::F64(value) => builder.arg(value),
            };
        }
        // SAFETY: `args` fill the entry's parameters one for one in kind and size (checked
        // just above against its signature, which `load` checked against the PTX), so the
        // driver copies every parameter from a value of its type. Through its pointers the
        // kernel touches only device memory; that each one addresses an allocation of the
        // extent the kernel's doc names, alive until the stream has run it, is the contract
        // of the callers: the typed functions are the crate's, called by the executor with views
        // of its own allocations, which it keeps until its streams are done with them, and
        // `launch_untyped` is unsafe.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|status| GpuError::Kernel {
                kernel: entry,
                call: "cuLaunchKernel",
                status,
            })
    }
}

/// The loaded kernels and the stream their launches queue on: what a typed kernel function
/// launches with.
pub struct Queue<'a> {
    kernels: &'a Kernels,
    stream: &'a Arc<CudaStream>,
}

impl<'a> Queue<'a> {
    /// Launches of `kernels` on `stream`.
    pub(crate) fn new(kernels: &'a Kernels, stream: &'a Arc<CudaStream>) -> Self {
        Queue { kernels, stream }
    }

    /// Launches kernel `name` (its twin when `activations` are bfloat16) with `args`.
    fn launch(
        &self,
        name: &'static str,
        config: LaunchConfig,
        args: &[Arg],
        activations: &[Option<Activations>],
    ) -> Result<(), GpuError> {
        let kind = launch_activations(activations)?;
        let Some(kernel) = self.kernels.functions.get(name) else {
            return Err(GpuError::Unsupported(
                "launching a kernel that was not loaded",
            ));
        };
        let entry = kernel.signature.entry(kind)?;
        self.kernels.launch(self.stream, entry, config, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfloat16_activations_take_each_kernels_twin() {
        for name in [
            "bn_stats",
            "bn_apply",
            "relu_backward",
            "average_pool_backward",
        ] {
            let signature = signature(name).unwrap();
            assert_eq!(signature.entry(Activations::F32).unwrap(), name);
            assert_eq!(
                signature.entry(Activations::Bf16).unwrap(),
                format!("{name}_bf16")
            );
        }
        // A kernel that reads no activation has no twin: launching it for bfloat16 ones is
        // a mistake, named.
        assert!(matches!(
            signature("sgd_step").unwrap().entry(Activations::Bf16),
            Err(GpuError::Unsupported(_))
        ));
    }

    #[test]
    fn every_entry_point_is_declared_once_and_a_twin_is_its_kernels_name_in_bf16() {
        let mut entries: Vec<&str> = FILES
            .iter()
            .flat_map(|file| file.signatures)
            .flat_map(Signature::entries)
            .collect();
        let all = entries.len();
        entries.sort_unstable();
        entries.dedup();
        assert_eq!(entries.len(), all, "an entry point declared twice");
        for signature in FILES.iter().flat_map(|file| file.signatures) {
            if let Some(twin) = signature.twin {
                assert_eq!(twin, format!("{}_bf16", signature.name));
            }
        }
        let files: Vec<&str> = FILES.iter().map(|file| file.name).collect();
        let sources: Vec<&str> = crate::KERNELS.iter().map(|kernel| kernel.name).collect();
        assert_eq!(files, sources);
    }

    #[test]
    fn arguments_must_fill_the_parameters_one_for_one() {
        let divide = signature("divide_in_place").unwrap();
        let right = [Arg::Ptr(16), Arg::I64(3), Arg::F32(2.0)];
        assert!(divide.check_arguments("divide_in_place", &right).is_ok());
        let swapped = [Arg::Ptr(16), Arg::F32(2.0), Arg::I64(3)];
        let error = divide
            .check_arguments("divide_in_place", &swapped)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "kernel divide_in_place: launched with (pointer, float, long long), its \
             parameters are (pointer, long long, float)"
        );
        let short = [Arg::Ptr(16), Arg::I32(3), Arg::F32(2.0)];
        assert!(divide.check_arguments("divide_in_place", &short).is_err());
        assert!(divide
            .check_arguments("divide_in_place", &right[..2])
            .is_err());
        let pointer_for_a_count = [Arg::Ptr(16), Arg::Ptr(3), Arg::F32(2.0)];
        assert!(divide
            .check_arguments("divide_in_place", &pointer_for_a_count)
            .is_err());
    }

    #[test]
    fn a_signature_is_checked_against_each_entry_point_of_the_ptx() {
        let ptx = "
.visible .entry divide_in_place(
\t.param .u64 divide_in_place_param_0,
\t.param .u64 divide_in_place_param_1,
\t.param .f32 divide_in_place_param_2
)
.visible .entry relu_backward(
\t.param .u64 relu_backward_param_0,
\t.param .u64 relu_backward_param_1,
\t.param .u64 relu_backward_param_2,
\t.param .u64 relu_backward_param_3
)
.visible .entry relu_backward_bf16(
\t.param .u64 relu_backward_bf16_param_0,
\t.param .u64 relu_backward_bf16_param_1,
\t.param .u32 relu_backward_bf16_param_2,
\t.param .u64 relu_backward_bf16_param_3
)
";
        assert!(signature("divide_in_place").unwrap().check_ptx(ptx).is_ok());
        let error = signature("relu_backward")
            .unwrap()
            .check_ptx(ptx)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "kernel relu_backward_bf16: its signature is (pointer, pointer, long long, \
             pointer), its PTX declares (64-bit int or pointer, 64-bit int or pointer, 32-bit \
             int, 64-bit int or pointer)"
        );
        assert!(signature("sgd_step").unwrap().check_ptx(ptx).is_err());
    }

    #[test]
    fn a_launchs_activations_share_one_element_type() {
        use Activations::*;
        assert_eq!(launch_activations(&[None, None]).unwrap(), F32);
        assert_eq!(
            launch_activations(&[Some(Bf16), None, Some(Bf16)]).unwrap(),
            Bf16
        );
        assert!(launch_activations(&[Some(Bf16), Some(F32)]).is_err());
    }
}
