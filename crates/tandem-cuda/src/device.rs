//! Which device a process runs on: the rules of `--device auto|cpu|cuda|cuda:N`.
//!
//! The rules are pure functions of plain facts (what the probe found, how many GPUs the driver
//! sees, the local rank), so they are tested without a GPU; [`GpuFacts::gather`] is the only
//! part that asks the driver.

use std::fmt;
use std::str::FromStr;

use crate::probe::{Library, MissingLibrary, Probe};

/// The libraries a single-GPU run needs (NCCL is needed only between GPUs).
pub const REQUIRED_LIBRARIES: [Library; 4] = [
    Library::Driver,
    Library::Nvrtc,
    Library::Cublas,
    Library::Cudnn,
];

/// What `--device` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// The GPU when one can be used, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// A GPU: this ordinal among the visible ones, or (`None`) the local rank's.
    Cuda(Option<usize>),
}

/// A `--device` value that is none of `auto`, `cpu`, `cuda`, `cuda:N` (or `gpu`, `gpu:N`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadDeviceRequest {
    /// Not a device name at all.
    #[error("device `{0}` is not one of auto, cpu, cuda, cuda:N (N a GPU number such as 0)")]
    Unknown(String),
    /// The DDP tutorial's Ascend NPU, which Tandem does not run on.
    #[error(
        "device `{0}`: Tandem does not run on Ascend NPUs (the DDP tutorial's npu with hccl); \
         use cuda (NVIDIA GPUs, with nccl) or cpu"
    )]
    Npu(String),
}

impl FromStr for DeviceRequest {
    type Err = BadDeviceRequest;

    /// `auto`, `cpu`, `cuda`, `cuda:N`; also `gpu` and `gpu:N`, the DDP tutorial's name for
    /// `cuda`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(None)),
            _ if text == "npu" || text.starts_with("npu:") => {
                Err(BadDeviceRequest::Npu(text.to_string()))
            }
            _ => text
                .strip_prefix("cuda:")
                .or_else(|| text.strip_prefix("gpu:"))
                .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|digits| digits.parse().ok())
                .map(|ordinal| DeviceRequest::Cuda(Some(ordinal)))
                .ok_or_else(|| BadDeviceRequest::Unknown(text.to_string())),
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(None) => f.write_str("cuda"),
            DeviceRequest::Cuda(Some(ordinal)) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisibleDevice {
    /// A physical device number.
    Index(u32),
    /// A device UUID (`GPU-…`) or MIG instance (`MIG-…`), possibly abbreviated.
    Uuid(String),
}

/// What `CUDA_VISIBLE_DEVICES` lets the driver show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisibleDevices {
    /// Unset: every device.
    All,
    /// These devices, in this order (empty: none).
    Listed(Vec<VisibleDevice>),
}

impl VisibleDevices {
    /// Parses `CUDA_VISIBLE_DEVICES` as the driver does: a comma-separated list of numbers and
    /// UUIDs, read up to the first entry that is neither (devices after it are hidden); an
    /// empty value hides every device.
    pub fn parse(value: Option<&str>) -> VisibleDevices {
        let Some(value) = value else {
            return VisibleDevices::All;
        };
        let mut devices = Vec::new();
        for entry in value.split(',').map(str::trim) {
            let device = if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
                VisibleDevice::Uuid(entry.to_string())
            } else if let Ok(index) = entry.parse::<u32>() {
                VisibleDevice::Index(index)
            } else {
                break;
            };
            devices.push(device);
        }
        VisibleDevices::Listed(devices)
    }

    /// This process's `CUDA_VISIBLE_DEVICES`.
    pub fn from_env() -> VisibleDevices {
        VisibleDevices::parse(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
    }

    /// Whether the list hides every device.
    pub fn hides_all(&self) -> bool {
        matches!(self, VisibleDevices::Listed(devices) if devices.is_empty())
    }
}

/// The GPU ordinal of a local rank: rank r takes GPU r modulo the visible GPUs, so ranks may
/// share one. `None` when no GPU is visible.
pub fn ordinal_for_local_rank(local_rank: usize, visible_gpus: usize) -> Option<usize> {
    (visible_gpus > 0).then(|| local_rank % visible_gpus)
}

/// The facts the device rules decide on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    /// The first required library that is missing, if any.
    pub missing_library: Option<MissingLibrary>,
    /// The GPUs the driver sees (after `CUDA_VISIBLE_DEVICES`), or why it cannot tell.
    pub visible_gpus: Result<usize, String>,
    /// `CUDA_VISIBLE_DEVICES`, for messages.
    pub visible_devices: VisibleDevices,
}

impl GpuFacts {
    /// Facts that look at nothing, for `--device cpu`: no library is loaded and no GPU counted.
    pub fn not_probed() -> GpuFacts {
        GpuFacts {
            missing_library: None,
            visible_gpus: Err("not probed".to_string()),
            visible_devices: VisibleDevices::All,
        }
    }

    /// Gathers the facts of this process: the probe's results and, when the driver was found,
    /// the driver's device count. The driver is not called when the probe did not find it.
    pub fn gather(probe: &Probe) -> GpuFacts {
        let missing_library = REQUIRED_LIBRARIES
            .iter()
            .find_map(|&library| probe.require(library).err());
        let visible_devices = VisibleDevices::from_env();
        let visible_gpus = match probe.get(Library::Driver) {
            Ok(_) => count_gpus(),
            Err(missing) => Err(missing.to_string()),
        };
        GpuFacts {
            missing_library,
            visible_gpus,
            visible_devices,
        }
    }
}

/// Why no GPU can be used here with `libraries` (the driver is always needed): the first
/// missing library, or no visible GPU; `None` when one can. For tests that skip without a
/// GPU, saying why.
pub fn why_no_gpu(probe: &Probe, libraries: &[Library]) -> Option<String> {
    let missing = std::iter::once(Library::Driver)
        .chain(libraries.iter().copied())
        .find_map(|library| probe.get(library).err());
    if let Some(missing) = missing {
        return Some(missing.to_string());
    }
    match count_gpus() {
        Ok(count) if count > 0 => None,
        Ok(_) => Some("no GPU is visible".to_string()),
        Err(error) => Some(format!("no GPU ({error})")),
    }
}

/// Environment variable that makes a test needing a GPU fail instead of skipping without
/// one: CI sets it for its run on the fake GPU (`crates/tandem-cuda/tests/fake_gpu`), so that
/// a test meant to run there cannot pass by skipping.
pub const REQUIRE_GPU_ENV: &str = "TANDEM_REQUIRE_GPU";

/// For tests: whether test `test`, which needs a GPU with `libraries`, can run here. Without
/// one it prints why and returns `false` (the test skips), or panics with the reason when
/// [`REQUIRE_GPU_ENV`] is `1`.
pub fn test_gpu_available(test: &str, libraries: &[Library]) -> bool {
    let Some(reason) = why_no_gpu(Probe::process(), libraries) else {
        return true;
    };
    assert!(
        std::env::var(REQUIRE_GPU_ENV).as_deref() != Ok("1"),
        "{test}: {REQUIRE_GPU_ENV}=1, but {reason}"
    );
    eprintln!("{test}: skipped, {reason}");
    false
}

/// The driver's device count; call only after the probe found the driver.
fn count_gpus() -> Result<usize, String> {
    cudarc::driver::result::init().map_err(|error| format!("cuInit failed: {error:?}"))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|error| format!("cuDeviceGetCount failed: {error:?}"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The device a process runs on, with the reason in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    /// The CPU.
    Cpu {
        /// Why: `requested`, or why `auto` did not take a GPU.
        reason: String,
    },
    /// A GPU.
    Cuda {
        /// The ordinal among the visible GPUs.
        ordinal: usize,
        /// Why this one.
        reason: String,
    },
}

impl fmt::Display for Device {
    /// `cpu (reason)` or `cuda:N (reason)`, as the first line of output shows it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu { reason } => write!(f, "cpu ({reason})"),
            Device::Cuda { ordinal, reason } => write!(f, "cuda:{ordinal} ({reason})"),
        }
    }
}

/// Why a GPU cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// A required library is missing.
    #[error(transparent)]
    MissingLibrary(#[from] MissingLibrary),
    /// The driver shows no GPU.
    #[error("no GPU is visible: {0}")]
    NoGpu(String),
    /// `cuda:N` beyond the visible GPUs.
    #[error("cuda:{ordinal} asked for, but only {visible} GPU(s) are visible (cuda:0 to cuda:{last})", last = visible - 1)]
    OrdinalOutOfRange {
        /// The ordinal asked for.
        ordinal: usize,
        /// The visible GPUs (at least one).
        visible: usize,
    },
}

impl DeviceError {
    /// The reason in a few words, for `auto`'s fallback line; `--device cuda` reports the
    /// whole error (where a library was searched for, and what `dlopen` said).
    pub fn brief(&self) -> String {
        match self {
            DeviceError::MissingLibrary(missing) => format!(
                "{} not found ({}); `--device cuda` says where it looked",
                missing.library,
                missing.library.usual_name()
            ),
            other => other.to_string(),
        }
    }
}

/// Decides the device: `cpu` is the CPU; `cuda`/`cuda:N` is that GPU or an error saying why
/// not; `auto` is the GPU `cuda` would take, else the CPU with the reason. Without `N`, local
/// rank r takes GPU r modulo the visible GPUs.
pub fn resolve(
    request: DeviceRequest,
    facts: &GpuFacts,
    local_rank: Option<usize>,
) -> Result<Device, DeviceError> {
    match request {
        DeviceRequest::Cpu => Ok(Device::Cpu {
            reason: "requested".to_string(),
        }),
        DeviceRequest::Cuda(ordinal) => pick_gpu(ordinal, facts, local_rank),
        DeviceRequest::Auto => {
            Ok(
                pick_gpu(None, facts, local_rank).unwrap_or_else(|error| Device::Cpu {
                    reason: format!("auto: {}", error.brief()),
                }),
            )
        }
    }
}

/// The GPU of `cuda`/`cuda:N`, or why there is none to use.
fn pick_gpu(
    ordinal: Option<usize>,
    facts: &GpuFacts,
    local_rank: Option<usize>,
) -> Result<Device, DeviceError> {
    if let Some(missing) = &facts.missing_library {
        return Err(DeviceError::MissingLibrary(missing.clone()));
    }
    let visible = match &facts.visible_gpus {
        Ok(0) if facts.visible_devices.hides_all() => {
            return Err(DeviceError::NoGpu(
                "CUDA_VISIBLE_DEVICES is set and lists no device".to_string(),
            ))
        }
        Ok(0) => return Err(DeviceError::NoGpu("the driver reports 0 GPUs".to_string())),
        Ok(visible) => *visible,
        Err(reason) => return Err(DeviceError::NoGpu(reason.clone())),
    };
    let (ordinal, reason) = match (ordinal, local_rank) {
        (Some(ordinal), _) if ordinal >= visible => {
            return Err(DeviceError::OrdinalOutOfRange { ordinal, visible })
        }
        (Some(ordinal), _) => (ordinal, "requested".to_string()),
        (None, Some(rank)) => (
            ordinal_for_local_rank(rank, visible).unwrap_or(0),
            format!("local rank {rank} of {visible} visible GPU(s)"),
        ),
        (None, None) => (0, format!("first of {visible} visible GPU(s)")),
    };
    Ok(Device::Cuda { ordinal, reason })
}
