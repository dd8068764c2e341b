//! The CUDA C kernel files, one per family, built into the binary as text and compiled with
//! NVRTC at first use (see [`crate::compile`]).

/// One kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's name without `.cu`, e.g. `batchnorm`.
    pub name: &'static str,
    /// Its CUDA C text, behind the [`PRELUDE`].
    pub source: &'static str,
}

/// What every kernel file shares (`kernels/activations.cuh`: the activations' element types,
/// bfloat16 rounding, the channel of an NHWC element), prepended to each file's text.
pub const PRELUDE: &str = include_str!("../kernels/activations.cuh");

/// Declares the kernel files of `kernels/`: each file's text behind the [`PRELUDE`], with a
/// `#line` directive so that NVRTC's messages name the file's own lines.
macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        /// Every kernel file, in the order of `kernels/`.
        pub const KERNELS: &[KernelSource] = &[$(KernelSource {
            name: $name,
            source: concat!(
                include_str!("../kernels/activations.cuh"),
                "#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("../kernels/", $name, ".cu"))
            ),
        }),*];
    };
}

kernel_files!(
    "batchnorm",
    "epilogue",
    "pooling",
    "loss",
    "optimizers",
    "augment",
    "bias",
    "collective",
    "convert",
    "exact_sum",
);

/// The kernel file called `name`.
pub fn kernel(name: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|kernel| kernel.name == name)
}
