//! Choosing a convolution algorithm: what a choice is made for ([`ConvKey`], under
//! [`AlgorithmSettings`]), the candidates `cudnnFind*` measures ([`Candidate`]), and the rule
//! that picks one or says why none fits ([`choose`]). Plain data and rules, shared by the cuDNN
//! wrapper that measures, the planner that uses the choice and the store that keeps it.

use std::fmt;

use cudarc::cudnn::sys;
use tandem_engine::shape::Conv2dShape;

use super::Precision;

/// What an algorithm is chosen for: a convolution's shape and the settings that change which
/// algorithms are admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvKey {
    /// `[batch, in_height, in_width, in_channels, out_channels, kernel, stride, padding]`.
    pub shape: [usize; 8],
    /// The math the convolution may use.
    pub precision: Precision,
    /// Whether only deterministic algorithms are admitted.
    pub deterministic: bool,
}

impl ConvKey {
    /// The key of `shape` under the settings.
    pub fn new(shape: &Conv2dShape, precision: Precision, deterministic: bool) -> Self {
        ConvKey {
            shape: [
                shape.batch,
                shape.in_height,
                shape.in_width,
                shape.in_channels,
                shape.out_channels,
                shape.kernel,
                shape.stride,
                shape.padding,
            ],
            precision,
            deterministic,
        }
    }
}

/// One measured algorithm, as `cudnnFind*` reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate<A> {
    /// The algorithm.
    pub algo: A,
    /// Its status in the measurement (`CUDNN_STATUS_SUCCESS`: it ran).
    pub status: sys::cudnnStatus_t,
    /// Its measured time, in milliseconds.
    pub time_ms: f32,
    /// Its workspace, in bytes.
    pub memory: usize,
    /// Whether cuDNN declares it deterministic.
    pub deterministic: bool,
    /// The math it used.
    pub math: sys::cudnnMathType_t,
}

impl<A: DeterministicOrder> Candidate<A> {
    /// Whether it ran in the measurement.
    pub fn ran(&self) -> bool {
        self.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
    }

    /// The candidate in words, for messages: its number and name, status, math,
    /// determinism, workspace and time.
    pub fn describe(&self) -> String {
        format!(
            "algorithm {} ({:?}): {:?}, {:?}, {}, workspace {:.1} MiB, {:.3} ms",
            self.algo.number(),
            self.algo,
            self.status,
            self.math,
            if self.deterministic {
                "deterministic"
            } else {
                "not deterministic"
            },
            self.memory as f64 / (1 << 20) as f64,
            self.time_ms,
        )
    }
}

/// Whether `precision` admits math `math`: fp32 only plain FMA; tf32 and bf16 also tensor
/// cores (TF32 on float32 operands, bfloat16 ones on bfloat16 operands), never a conversion
/// cuDNN would make on its own (`CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION`: float32 to half).
pub fn math_allowed(precision: Precision, math: sys::cudnnMathType_t) -> bool {
    use sys::cudnnMathType_t::*;
    match precision {
        Precision::Fp32 => math == CUDNN_FMA_MATH,
        Precision::Tf32 | Precision::Bf16 => matches!(
            math,
            CUDNN_FMA_MATH | CUDNN_DEFAULT_MATH | CUDNN_TENSOR_OP_MATH
        ),
    }
}

/// The fixed order in which deterministic mode prefers a direction's algorithms: lower first.
pub trait DeterministicOrder: Copy + fmt::Debug {
    /// The algorithm's place in the order.
    fn rank(self) -> u32;

    /// The algorithm's number in cuDNN's enumeration.
    fn number(self) -> u32;
}

impl DeterministicOrder for sys::cudnnConvolutionFwdAlgo_t {
    /// `IMPLICIT_PRECOMP_GEMM` first (PyTorch's deterministic forward, and much faster than
    /// `IMPLICIT_GEMM`, which comes second), then by number.
    fn rank(self) -> u32 {
        use sys::cudnnConvolutionFwdAlgo_t::*;
        match self {
            CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM => 0,
            CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM => 1,
            other => other as u32 + 1,
        }
    }

    fn number(self) -> u32 {
        self as u32
    }
}

impl DeterministicOrder for sys::cudnnConvolutionBwdDataAlgo_t {
    /// By number (`ALGO_1`, PyTorch's deterministic choice, is the first deterministic one).
    fn rank(self) -> u32 {
        self as u32
    }

    fn number(self) -> u32 {
        self as u32
    }
}

impl DeterministicOrder for sys::cudnnConvolutionBwdFilterAlgo_t {
    /// By number (`ALGO_1`, PyTorch's deterministic choice, is the first deterministic one).
    fn rank(self) -> u32 {
        self as u32
    }

    fn number(self) -> u32 {
        self as u32
    }
}

impl DeterministicOrder for u32 {
    /// An algorithm number is its own rank (for tests of [`choose`]).
    fn rank(self) -> u32 {
        self
    }

    fn number(self) -> u32 {
        self
    }
}

/// The admitted candidate to use: one that ran, with admitted math, deterministic when
/// `deterministic`, and needing at most `workspace_limit` bytes. Without `deterministic`, the
/// fastest (ties go to the earlier one; cuDNN lists them fastest first). With it, the first in
/// the direction's [`DeterministicOrder`] (then by math type), whatever the timings: a choice
/// by measured time could differ between two processes on the same GPU, and a run resumed
/// after `kill -9` must compute with the algorithms of the uninterrupted run to end
/// bit-identical. Otherwise every candidate with why it was refused (its number, status,
/// math and determinism), and which setting would admit one.
pub fn choose<A: DeterministicOrder>(
    candidates: &[Candidate<A>],
    precision: Precision,
    deterministic: bool,
    workspace_limit: usize,
) -> Result<Candidate<A>, String> {
    let mut best: Option<Candidate<A>> = None;
    let mut refused = Vec::new();
    for candidate in candidates {
        match refusal(candidate, precision, deterministic, workspace_limit) {
            Some(reason) => refused.push(format!("{}: {reason}", candidate.describe())),
            None if best.is_none_or(|best| better(candidate, &best, deterministic)) => {
                best = Some(*candidate)
            }
            None => {}
        }
    }
    best.ok_or_else(|| {
        if refused.is_empty() {
            return "cuDNN returned no candidates".to_string();
        }
        let hint = refusal_hint(candidates, precision, deterministic, workspace_limit);
        format!("candidates refused: {}{hint}", refused.join("; "))
    })
}

/// Why `candidate` is not admitted, or `None` when it is.
fn refusal<A>(
    candidate: &Candidate<A>,
    precision: Precision,
    deterministic: bool,
    workspace_limit: usize,
) -> Option<&'static str> {
    if candidate.status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Some("did not run")
    } else if !math_allowed(precision, candidate.math) {
        Some("math not allowed")
    } else if deterministic && !candidate.deterministic {
        Some("not deterministic")
    } else if candidate.memory > workspace_limit {
        Some("workspace too large")
    } else {
        None
    }
}

/// The setting that would admit one of `candidates`, all refused under the others, as a
/// sentence to end the refusal with (empty when none would).
fn refusal_hint<A>(
    candidates: &[Candidate<A>],
    precision: Precision,
    deterministic: bool,
    workspace_limit: usize,
) -> String {
    let admits = |precision, deterministic| {
        candidates.iter().any(|candidate| {
            refusal(candidate, precision, deterministic, workspace_limit).is_none()
        })
    };
    if deterministic && admits(precision, false) {
        ". `--algorithms fastest` admits the algorithms that are not deterministic".to_string()
    } else if precision == Precision::Fp32 && admits(Precision::Tf32, deterministic) {
        ". `--precision tf32` admits tensor-core math".to_string()
    } else if precision == Precision::Bf16
        && candidates
            .iter()
            .all(|candidate| candidate.status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS)
    {
        ". cuDNN runs none of them on bfloat16 operands for this shape: `--precision tf32` \
         keeps the operands float32"
            .to_string()
    } else {
        String::new()
    }
}

/// Whether admitted `candidate` is preferred to admitted `best` (see [`choose`]).
fn better<A: DeterministicOrder>(
    candidate: &Candidate<A>,
    best: &Candidate<A>,
    deterministic: bool,
) -> bool {
    if deterministic {
        (candidate.algo.rank(), candidate.math as u32) < (best.algo.rank(), best.math as u32)
    } else {
        candidate.time_ms < best.time_ms
    }
}

/// The chosen algorithms of a convolution's two backward directions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackwardAlgorithms {
    /// The data gradient's.
    pub data: Candidate<sys::cudnnConvolutionBwdDataAlgo_t>,
    /// The filter gradient's.
    pub filter: Candidate<sys::cudnnConvolutionBwdFilterAlgo_t>,
}

/// The most workspace an algorithm may ask for (bytes).
pub const WORKSPACE_LIMIT: usize = 1 << 30;

/// The settings that decide which algorithms are admitted and how one is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgorithmSettings {
    /// The math the convolutions may use.
    pub precision: Precision,
    /// Whether only deterministic algorithms are admitted, chosen in a fixed order.
    pub deterministic: bool,
}
