//! GPU architectures, as NVRTC names them.

use std::fmt;
use std::str::FromStr;

/// A GPU's compute capability, e.g. 9.0 for the H100 and H200 (`sm_90`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuArch {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl GpuArch {
    /// The H100 and H200.
    pub const SM_90: GpuArch = GpuArch { major: 9, minor: 0 };

    /// NVRTC's option for machine code of this architecture (`sm_90`). The executor loads
    /// that CUBIN rather than PTX: a driver refuses PTX of a newer ISA than its own CUDA
    /// version (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, as when PyTorch's wheels bring an NVRTC
    /// newer than the driver), while a CUBIN of the same major version loads.
    pub fn nvrtc_option(self) -> String {
        format!("--gpu-architecture=sm_{}{}", self.major, self.minor)
    }
}

impl fmt::Display for GpuArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// An architecture name that is not `sm_XY`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU architecture `{0}` is not of the form sm_XY (e.g. sm_90)")]
pub struct BadArch(pub String);

impl FromStr for GpuArch {
    type Err = BadArch;

    /// `sm_90` → 9.0, `sm_120` → 12.0: the last digit is the minor version.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || BadArch(text.to_string());
        let digits = text.strip_prefix("sm_").ok_or_else(bad)?;
        if digits.len() < 2 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Ok(GpuArch {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
        })
    }
}
