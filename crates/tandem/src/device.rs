//! `--device auto|cpu|cuda|cuda:N` of `train`, `eval`, `predict` and `bench step`: which device
//! this process computes on, announced as the first line of output.

use anyhow::Context;
use tandem_cuda::device::{resolve, Device, DeviceRequest, GpuFacts};
use tandem_cuda::Probe;

/// The `--device` flag.
pub const DEVICE_HELP: &str = "Where to compute: auto (a GPU when the CUDA driver, libraries and a GPU are found, else the CPU), cpu, cuda (under `launch`, local rank r takes GPU r modulo the visible ones) or cuda:N";

/// Where the `device:` line goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announce {
    /// Standard output, as the first line of a text report.
    Stdout,
    /// Standard error, when standard output carries JSON.
    Stderr,
}

/// Standard error when standard output carries JSON, else standard output.
pub fn announce_for_json(json: bool) -> Announce {
    if json {
        Announce::Stderr
    } else {
        Announce::Stdout
    }
}

/// Decides the device of this process and prints `device: cpu (reason)` first. Returns the
/// device the job runs on: the CPU, as `train`, `eval` and `predict` have no GPU executor
/// yet (`--device cuda` is then an error saying so, and `auto` says why it took the CPU).
pub fn select(request: DeviceRequest, announce: Announce) -> anyhow::Result<Device> {
    select_for(request, announce, GpuUse::NotBuilt)
}

/// Whether a command can run on the GPU executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuUse {
    /// It cannot: `cuda` is an error and `auto` takes the CPU, saying why.
    NotBuilt,
    /// It can, but the GPU executor has not run on a GPU yet: only an explicit `cuda` or
    /// `cuda:N` takes the GPU (saying it is unverified); `auto` takes the CPU, saying why.
    ExplicitOnly,
}

/// [`select`] for a command whose GPU support is `gpu`.
pub fn select_for(
    request: DeviceRequest,
    announce: Announce,
    gpu: GpuUse,
) -> anyhow::Result<Device> {
    let device = match request {
        // The CPU needs no probe: nothing CUDA is loaded.
        DeviceRequest::Cpu => resolve(request, &GpuFacts::not_probed(), None)?,
        _ => {
            // A job's variables that do not parse are reported by the job's own setup (train's
            // placement); here they only mean no local rank.
            let local_rank = tandem_dist::cluster::WorkerEnv::from_env()
                .ok()
                .flatten()
                .map(|worker| worker.local_rank);
            let mut facts = GpuFacts::gather(Probe::process());
            facts.gpu_executor_built = gpu == GpuUse::ExplicitOnly;
            let device = resolve(request, &facts, local_rank)
                .with_context(|| format!("--device {request}"))?;
            unverified_gpu(device, request)
        }
    };
    match announce {
        Announce::Stdout => say!("device: {device}"),
        Announce::Stderr => eprintln!("device: {device}"),
    }
    if gpu == GpuUse::NotBuilt {
        if let Device::Cuda { .. } = device {
            anyhow::bail!("--device {request}: the GPU executor is not built yet");
        }
    }
    Ok(device)
}

/// For a command whose GPU executor is unverified ([`GpuUse::ExplicitOnly`]): `auto` keeps
/// to the CPU, saying why, and an explicit GPU says it is unverified.
fn unverified_gpu(device: Device, request: DeviceRequest) -> Device {
    match (device, request) {
        (Device::Cuda { ordinal, .. }, DeviceRequest::Auto) => Device::Cpu {
            reason: format!(
                "auto: cuda:{ordinal} was found, but the GPU executor has not been verified \
                 on a GPU yet; it runs only with --device cuda"
            ),
        },
        (Device::Cuda { ordinal, reason }, _) => Device::Cuda {
            ordinal,
            reason: format!("{reason}; GPU executor unverified on a GPU"),
        },
        (device, _) => device,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unverified_gpu_is_taken_only_when_asked_for_and_says_so() {
        let found = || Device::Cuda {
            ordinal: 1,
            reason: "requested".to_string(),
        };
        assert_eq!(
            unverified_gpu(found(), DeviceRequest::Auto).to_string(),
            "cpu (auto: cuda:1 was found, but the GPU executor has not been verified on a GPU \
             yet; it runs only with --device cuda)"
        );
        assert_eq!(
            unverified_gpu(found(), DeviceRequest::Cuda(Some(1))).to_string(),
            "cuda:1 (requested; GPU executor unverified on a GPU)"
        );
        let cpu = Device::Cpu {
            reason: "requested".to_string(),
        };
        assert_eq!(unverified_gpu(cpu.clone(), DeviceRequest::Cpu), cpu);
    }
}
