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
/// device the job runs on: the CPU, as there is no GPU executor yet (`--device cuda` is then
/// an error saying so, and `auto` says why it took the CPU).
pub fn select(request: DeviceRequest, announce: Announce) -> anyhow::Result<Device> {
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
            let facts = GpuFacts::gather(Probe::process());
            resolve(request, &facts, local_rank).with_context(|| format!("--device {request}"))?
        }
    };
    match announce {
        Announce::Stdout => say!("device: {device}"),
        Announce::Stderr => eprintln!("device: {device}"),
    }
    if let Device::Cuda { .. } = device {
        anyhow::bail!("--device {request}: the GPU executor is not built yet");
    }
    Ok(device)
}
