//! The CUDA C kernel files, one per family, built into the binary as text and compiled with
//! NVRTC at first use (see [`crate::compile`]).

/// One kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's name without `.cu`, e.g. `batchnorm`.
    pub name: &'static str,
    /// Its CUDA C text.
    pub source: &'static str,
}

/// Declares the kernel files of `kernels/`.
macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        /// Every kernel file, in the order of `kernels/`.
        pub const KERNELS: &[KernelSource] = &[$(KernelSource {
            name: $name,
            source: include_str!(concat!("../kernels/", $name, ".cu")),
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
);

/// The kernel file called `name`.
pub fn kernel(name: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|kernel| kernel.name == name)
}
