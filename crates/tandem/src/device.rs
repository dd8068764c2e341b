//! `--device auto|cpu|cuda|cuda:N` of `train`, `eval`, `predict` and `bench step`: which device
//! this process computes on, announced as the first line of output.

use anyhow::Context;
use tandem_cuda::device::{resolve, Device, DeviceRequest, GpuFacts};
use tandem_cuda::{GpuJob, Probe};
use tandem_models::{CpuDevice, Model, TrainingDevice};

use crate::math::{Algorithms, GpuMath, PrecisionRequest};

/// The `--device` flag.
pub const DEVICE_HELP: &str = "Where to compute: auto (a GPU when the CUDA driver, libraries and a GPU are found, else the CPU), cpu, cuda (under `launch`, local rank r takes GPU r modulo the visible ones) or cuda:N; gpu and gpu:N, the DDP tutorial's names, mean cuda and cuda:N";

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

/// Decides the device of this process and how it computes, and prints `device: ... (reason)`
/// first. `cuda` without what it needs is an error saying what is missing; `auto` takes a GPU
/// when one can be used, else the CPU, saying why. A GPU's line names its precision and
/// algorithms and says that the GPU executor is unverified: it has not yet run on a GPU. The
/// math is `None` on the CPU (see [`crate::math::resolve_math`]).
pub fn select(
    request: DeviceRequest,
    precision: Option<PrecisionRequest>,
    algorithms: Algorithms,
    announce: Announce,
) -> anyhow::Result<(Device, Option<GpuMath>)> {
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
            let device = resolve(request, &facts, local_rank)
                .with_context(|| format!("--device {request}"))?;
            let math = GpuMath {
                precision: crate::math::gpu_precision(precision),
                algorithms,
            };
            unverified_gpu(device, math)
        }
    };
    match announce {
        Announce::Stdout => say!("device: {device}"),
        Announce::Stderr => tell!("device: {device}"),
    }
    let math = crate::math::resolve_math(precision, algorithms, &device);
    Ok((device, math))
}

/// `model` on `device`, ready for its training job: on the CPU as it is; on a GPU, its
/// parameters and running statistics copied to a new executor computing as `math` says
/// ([`GpuMath::DEFAULT`] when `None`).
pub fn open_training_device(
    model: Model,
    device: &Device,
    math: Option<GpuMath>,
) -> anyhow::Result<Box<dyn TrainingDevice>> {
    Ok(match device {
        Device::Cpu { .. } => Box::new(CpuDevice::new(model)),
        Device::Cuda { ordinal, .. } => {
            let settings = math.unwrap_or(GpuMath::DEFAULT).settings(*ordinal);
            Box::new(GpuJob::open(model, settings)?)
        }
    })
}

/// A GPU's reason with its precision and algorithms and the note that the GPU executor has
/// not yet run on a GPU.
fn unverified_gpu(device: Device, math: GpuMath) -> Device {
    let algorithms = match math.algorithms {
        Algorithms::Deterministic => "deterministic",
        Algorithms::Fastest => "fastest",
    };
    match device {
        Device::Cuda { ordinal, reason } => Device::Cuda {
            ordinal,
            reason: format!(
                "{reason}; precision {}, {algorithms} algorithms; GPU executor unverified on a GPU",
                crate::math::precision_name(math.precision)
            ),
        },
        device => device,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cuda::Precision;

    #[test]
    fn a_gpu_says_its_executor_is_unverified() {
        let found = Device::Cuda {
            ordinal: 1,
            reason: "first of 2 visible GPU(s)".to_string(),
        };
        let math = |precision, algorithms| GpuMath {
            precision,
            algorithms,
        };
        assert_eq!(
            unverified_gpu(
                found.clone(),
                math(Precision::Bf16, Algorithms::Deterministic)
            )
            .to_string(),
            "cuda:1 (first of 2 visible GPU(s); precision bf16, deterministic algorithms; GPU \
             executor unverified on a GPU)"
        );
        assert_eq!(
            unverified_gpu(found, math(Precision::Tf32, Algorithms::Fastest)).to_string(),
            "cuda:1 (first of 2 visible GPU(s); precision tf32, fastest algorithms; GPU executor \
             unverified on a GPU)"
        );
        let cpu = Device::Cpu {
            reason: "requested".to_string(),
        };
        assert_eq!(
            unverified_gpu(
                cpu.clone(),
                math(Precision::Tf32, Algorithms::Deterministic)
            ),
            cpu
        );
    }
}
