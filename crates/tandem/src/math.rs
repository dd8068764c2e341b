//! How a GPU computes, as `--precision` and `--algorithms` ask: the flags' types and help
//! texts, the policy that turns them into a [`GpuMath`] (the CPU always computes in fp32,
//! deterministically), and the words a banner uses for it.

use tandem_cuda::{Device, GpuSettings, Precision};

/// The `--precision` flag.
pub const PRECISION_HELP: &str = "Math of convolutions and matrix products on a GPU: fp32 (strict float32), tf32 (TF32 tensor cores, PyTorch's default on GPUs) or bf16 (PyTorch autocast's rules: bfloat16 operands with float32 accumulation for convolutions and the linear layer; batch norm, loss, optimizer and master weights in float32) [default: tf32 on a GPU; the CPU always computes in fp32]";

/// What `--precision` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrecisionRequest {
    /// Strict float32.
    Fp32,
    /// TF32 tensor cores for convolutions and matrix products.
    Tf32,
    /// bfloat16 autocast: bfloat16 convolutions and linear layer, float32 accumulation.
    Bf16,
}

/// The `--algorithms` flag.
pub const ALGORITHMS_HELP: &str = "cuDNN convolution algorithms on a GPU: deterministic (the same bits on every run, so a run resumed after a crash ends bit-identical to an uninterrupted one) or fastest (the fastest measured, like PyTorch's cudnn.benchmark without cudnn.deterministic: results may differ in the last bits between runs) [default: deterministic; the CPU is always deterministic]";

/// Which cuDNN convolution algorithms a GPU may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Algorithms {
    /// Only algorithms cuDNN declares deterministic, chosen in a fixed order.
    #[default]
    Deterministic,
    /// The fastest measured algorithm.
    Fastest,
}

/// How a GPU computes: the precision of convolutions and matrix products, and the
/// convolution algorithms it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuMath {
    /// `--precision`.
    pub precision: Precision,
    /// `--algorithms`.
    pub algorithms: Algorithms,
}

impl GpuMath {
    /// TF32 with deterministic algorithms: how a GPU computes when nothing was asked.
    pub const DEFAULT: GpuMath = GpuMath {
        precision: Precision::Tf32,
        algorithms: Algorithms::Deterministic,
    };

    /// The executor's settings for GPU `ordinal` computing so.
    pub fn settings(&self, ordinal: usize) -> GpuSettings {
        GpuSettings {
            ordinal,
            precision: self.precision,
            deterministic: self.algorithms == Algorithms::Deterministic,
        }
    }
}

impl std::fmt::Display for GpuMath {
    /// `tf32`, or `tf32, fastest algorithms`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(precision_name(self.precision))?;
        match self.algorithms {
            Algorithms::Deterministic => Ok(()),
            Algorithms::Fastest => f.write_str(", fastest algorithms"),
        }
    }
}

/// The precision a GPU computes in for `request`: the one asked for, else TF32 (PyTorch's
/// default on GPUs).
pub fn gpu_precision(request: Option<PrecisionRequest>) -> Precision {
    match request {
        Some(PrecisionRequest::Fp32) => Precision::Fp32,
        Some(PrecisionRequest::Tf32) | None => Precision::Tf32,
        Some(PrecisionRequest::Bf16) => Precision::Bf16,
    }
}

/// How the device computes for `precision` and `algorithms`: on a GPU [`gpu_precision`] and
/// the algorithms asked for; on the CPU `None`: it computes in fp32, deterministically,
/// whatever is asked, and a request for `tf32`, `bf16` or the fastest algorithms gets a note
/// saying so.
pub fn resolve_math(
    precision: Option<PrecisionRequest>,
    algorithms: Algorithms,
    device: &Device,
) -> Option<GpuMath> {
    match device {
        Device::Cuda { .. } => Some(GpuMath {
            precision: gpu_precision(precision),
            algorithms,
        }),
        Device::Cpu { .. } => {
            if let Some(note) = cpu_precision_note(precision) {
                tell!("{note}");
            }
            if algorithms == Algorithms::Fastest {
                tell!("note: --algorithms fastest applies to a GPU; the CPU is deterministic");
            }
            None
        }
    }
}

/// The note a CPU run prints for `request`: none for fp32 or no request.
fn cpu_precision_note(request: Option<PrecisionRequest>) -> Option<String> {
    let name = match request? {
        PrecisionRequest::Fp32 => return None,
        PrecisionRequest::Tf32 => "tf32",
        PrecisionRequest::Bf16 => "bf16",
    };
    Some(format!(
        "note: --precision {name} applies to a GPU; the CPU computes in fp32"
    ))
}

/// The name of `precision` as `--precision` spells it.
pub fn precision_name(precision: Precision) -> &'static str {
    match precision {
        Precision::Fp32 => "fp32",
        Precision::Tf32 => "tf32",
        Precision::Bf16 => "bf16",
    }
}

/// The device and how it computes in a few words, for banners: `cpu` or `cuda:0 (tf32)`.
pub fn describe(device: &Device, math: Option<GpuMath>) -> String {
    match device {
        Device::Cuda { ordinal, .. } => {
            let math = math.unwrap_or(GpuMath::DEFAULT);
            format!("cuda:{ordinal} ({math})")
        }
        Device::Cpu { .. } => "cpu".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu() -> Device {
        Device::Cpu {
            reason: "requested".to_string(),
        }
    }

    fn gpu() -> Device {
        Device::Cuda {
            ordinal: 1,
            reason: "requested".to_string(),
        }
    }

    #[test]
    fn precision_defaults_to_tf32_on_a_gpu_and_the_cpu_computes_in_fp32() {
        let math = |precision, algorithms| {
            Some(GpuMath {
                precision,
                algorithms,
            })
        };
        let deterministic = Algorithms::Deterministic;
        assert_eq!(
            resolve_math(None, deterministic, &gpu()),
            math(Precision::Tf32, deterministic)
        );
        for (request, precision) in [
            (PrecisionRequest::Fp32, Precision::Fp32),
            (PrecisionRequest::Tf32, Precision::Tf32),
            (PrecisionRequest::Bf16, Precision::Bf16),
        ] {
            for algorithms in [Algorithms::Deterministic, Algorithms::Fastest] {
                assert_eq!(
                    resolve_math(Some(request), algorithms, &gpu()),
                    math(precision, algorithms)
                );
                assert_eq!(resolve_math(Some(request), algorithms, &cpu()), None);
            }
        }
        assert_eq!(resolve_math(None, deterministic, &cpu()), None);
        assert_eq!(cpu_precision_note(None), None);
        assert_eq!(cpu_precision_note(Some(PrecisionRequest::Fp32)), None);
        assert_eq!(
            cpu_precision_note(Some(PrecisionRequest::Bf16)).as_deref(),
            Some("note: --precision bf16 applies to a GPU; the CPU computes in fp32")
        );
        assert_eq!(
            cpu_precision_note(Some(PrecisionRequest::Tf32)).as_deref(),
            Some("note: --precision tf32 applies to a GPU; the CPU computes in fp32")
        );
        assert_eq!(
            describe(&gpu(), math(Precision::Fp32, deterministic)),
            "cuda:1 (fp32)"
        );
        assert_eq!(
            describe(&gpu(), math(Precision::Bf16, Algorithms::Fastest)),
            "cuda:1 (bf16, fastest algorithms)"
        );
        assert_eq!(describe(&gpu(), None), "cuda:1 (tf32)");
        assert_eq!(describe(&cpu(), None), "cpu");
    }
}
