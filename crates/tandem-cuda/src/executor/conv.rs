//! Convolutions through cuDNN: NHWC descriptors computed from the plan's [`Conv2dShape`], the
//! algorithm of each direction chosen by measuring (`cudnnFind*`) on first use and cached per
//! shape and settings, with a deterministic mode that admits only deterministic algorithms.
//! An evaluation's shapes measure the forward alone: the backward algorithms of a shape are
//! measured when a training plan first needs them. With a store (`algorithm_store.rs`), the
//! choices are kept on disk for the next process.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use cudarc::cudnn::sys;
use tandem_engine::shape::Conv2dShape;

use super::algorithm::{
    choose, AlgorithmSettings, BackwardAlgorithms, Candidate, ConvKey, DeterministicOrder,
    WORKSPACE_LIMIT,
};
use super::algorithm_store::{AlgorithmStore, StoredChoice};
use super::cudnn::{ConvDescriptor, CudnnHandle, FilterDescriptor, TensorDescriptor};
use super::error::{cudnn, int, GpuError};
use super::Precision;

/// `[n, c, h, w]` strides of an NHWC tensor with `channels x height x width` images: the
/// element `(n, c, h, w)` is at `n * h * w * c + (h * width + w) * channels + c`, the CPU
/// engine's layout.
pub fn nhwc_strides(channels: usize, height: usize, width: usize) -> [usize; 4] {
    [height * width * channels, 1, width * channels, channels]
}

/// The cuDNN dimensions of one convolution, all as `int`s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvGeometry {
    /// Input `[n, c, h, w]`.
    pub input: [c_int; 4],
    /// Input strides (NHWC).
    pub input_strides: [c_int; 4],
    /// Output `[n, k, p, q]`.
    pub output: [c_int; 4],
    /// Output strides (NHWC).
    pub output_strides: [c_int; 4],
    /// Filter `[k, c, r, s]`, stored KRSC (the engine's OHWI), cuDNN's NHWC filter format.
    pub filter: [c_int; 4],
    /// Padding, stride and dilation on both axes.
    pub padding: c_int,
    /// Stride on both axes.
    pub stride: c_int,
}

impl ConvGeometry {
    /// The geometry of `shape`; an error when a size does not fit an `int`.
    pub fn new(shape: &Conv2dShape) -> Result<Self, GpuError> {
        let (out_height, out_width) = (shape.out_height(), shape.out_width());
        let ints = |what, values: [usize; 4]| -> Result<[c_int; 4], GpuError> {
            Ok([
                int(what, values[0])?,
                int(what, values[1])?,
                int(what, values[2])?,
                int(what, values[3])?,
            ])
        };
        int("input elements", shape.input_len())?;
        int("output elements", shape.output_len())?;
        Ok(ConvGeometry {
            input: ints(
                "input size",
                [
                    shape.batch,
                    shape.in_channels,
                    shape.in_height,
                    shape.in_width,
                ],
            )?,
            input_strides: ints(
                "input stride",
                nhwc_strides(shape.in_channels, shape.in_height, shape.in_width),
            )?,
            output: ints(
                "output size",
                [shape.batch, shape.out_channels, out_height, out_width],
            )?,
            output_strides: ints(
                "output stride",
                nhwc_strides(shape.out_channels, out_height, out_width),
            )?,
            filter: ints(
                "filter size",
                [
                    shape.out_channels,
                    shape.in_channels,
                    shape.kernel,
                    shape.kernel,
                ],
            )?,
            padding: int("padding", shape.padding)?,
            stride: int("stride", shape.stride)?,
        })
    }
}

/// The math type a convolution descriptor is set to before measuring under `precision`:
/// bf16 asks for tensor cores outright (their bfloat16 path is the point of it).
pub fn descriptor_math(precision: Precision) -> sys::cudnnMathType_t {
    match precision {
        Precision::Fp32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        Precision::Tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        Precision::Bf16 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

/// The data type of a convolution's input, filter and output (and their gradients) under
/// `precision`: float32, or bfloat16 for bf16 (the operands `autocast.rs` narrows).
pub fn operand_type(precision: Precision) -> sys::cudnnDataType_t {
    match precision {
        Precision::Fp32 | Precision::Tf32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        Precision::Bf16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// The compute (accumulation) type of the convolution descriptor: float32 under every
/// precision. With bfloat16 operands that is cuDNN's `PSEUDO_BFLOAT16_CONFIG` (x, w, y
/// bfloat16, the convolution float), the configuration its legacy API supports for
/// bfloat16 in all three directions; `TRUE` bfloat16 accumulation is not one it offers.
pub fn compute_type(_precision: Precision) -> sys::cudnnDataType_t {
    sys::cudnnDataType_t::CUDNN_DATA_FLOAT
}

/// A convolution's descriptors and its chosen algorithms.
pub struct ConvPlan {
    input: TensorDescriptor,
    output: TensorDescriptor,
    filter: FilterDescriptor,
    conv: ConvDescriptor,
    forward: Candidate<sys::cudnnConvolutionFwdAlgo_t>,
    backward: Option<BackwardAlgorithms>,
    /// The shape, in words, for messages.
    shape: String,
    /// Every measured candidate, in words, by direction (forward, backward data, backward
    /// filter); empty for a direction whose choice was read from the store.
    candidates: [Vec<String>; 3],
}

/// The three directions of a convolution, as [`ConvPlan`]'s candidate lists index them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Forward = 0,
    BackwardData = 1,
    BackwardFilter = 2,
}

impl Direction {
    /// The direction in words.
    fn name(self) -> &'static str {
        match self {
            Direction::Forward => "forward",
            Direction::BackwardData => "backward data",
            Direction::BackwardFilter => "backward filter",
        }
    }
}

/// Every candidate of a measurement in words.
fn described<A: DeterministicOrder>(candidates: &[Candidate<A>]) -> Vec<String> {
    candidates.iter().map(Candidate::describe).collect()
}

/// A convolution's cuDNN descriptors: input, output, filter and the convolution itself.
type Descriptors = (
    TensorDescriptor,
    TensorDescriptor,
    FilterDescriptor,
    ConvDescriptor,
);

/// Device pointers of one convolution call.
pub struct ConvBuffers {
    /// The input (`x`), or its gradient for the data backward.
    pub input: u64,
    /// The filter, or its gradient for the filter backward.
    pub filter: u64,
    /// The output (`y`), or its gradient for the backward passes.
    pub output: u64,
    /// The workspace and its size in bytes.
    pub workspace: (u64, usize),
}

impl ConvPlan {
    /// Builds the descriptors of `shape` and measures every forward algorithm, and with
    /// `backward` those of the two backward directions too.
    pub fn measure(
        handle: &CudnnHandle,
        shape: &Conv2dShape,
        settings: AlgorithmSettings,
        backward: bool,
    ) -> Result<Self, GpuError> {
        let AlgorithmSettings {
            precision,
            deterministic,
        } = settings;
        let (input, output, filter, conv) = Self::descriptors(shape, precision)?;
        conv.set_math(descriptor_math(precision))?;
        let measured = handle.find_forward(&input, &filter, &conv, &output)?;
        let forward = choose(&measured, precision, deterministic, WORKSPACE_LIMIT)
            .map_err(|reason| no_algorithm("forward", shape, reason))?;
        let mut plan = ConvPlan {
            input,
            output,
            filter,
            conv,
            forward,
            backward: None,
            shape: format!("{shape:?}"),
            candidates: [described(&measured), Vec::new(), Vec::new()],
        };
        if backward {
            plan.measure_backward(handle, shape, settings)?;
        }
        Ok(plan)
    }

    /// The plan of `shape` with the algorithms of `choice` (stored by an earlier process),
    /// measuring nothing.
    pub fn from_choice(
        shape: &Conv2dShape,
        precision: Precision,
        choice: StoredChoice,
    ) -> Result<Self, GpuError> {
        let (input, output, filter, conv) = Self::descriptors(shape, precision)?;
        Ok(ConvPlan {
            input,
            output,
            filter,
            conv,
            forward: choice.forward,
            backward: choice.backward,
            shape: format!("{shape:?}"),
            candidates: Default::default(),
        })
    }

    /// The algorithms chosen, as [`AlgorithmStore`] keeps them.
    pub fn choice(&self) -> StoredChoice {
        StoredChoice {
            forward: self.forward,
            backward: self.backward,
        }
    }

    /// The descriptors of `shape` with the operand and compute types of `precision`.
    fn descriptors(shape: &Conv2dShape, precision: Precision) -> Result<Descriptors, GpuError> {
        let geometry = ConvGeometry::new(shape)?;
        let operands = operand_type(precision);
        Ok((
            TensorDescriptor::new(geometry.input, geometry.input_strides, operands)?,
            TensorDescriptor::new(geometry.output, geometry.output_strides, operands)?,
            FilterDescriptor::new(geometry.filter, operands)?,
            ConvDescriptor::new(geometry.padding, geometry.stride, compute_type(precision))?,
        ))
    }

    /// Measures the algorithms of the two backward directions.
    fn measure_backward(
        &mut self,
        handle: &CudnnHandle,
        shape: &Conv2dShape,
        settings: AlgorithmSettings,
    ) -> Result<(), GpuError> {
        let AlgorithmSettings {
            precision,
            deterministic,
        } = settings;
        self.conv.set_math(descriptor_math(precision))?;
        let measured_data =
            handle.find_backward_data(&self.filter, &self.output, &self.conv, &self.input)?;
        let data = choose(&measured_data, precision, deterministic, WORKSPACE_LIMIT)
            .map_err(|reason| no_algorithm("backward data", shape, reason))?;
        let measured_filter =
            handle.find_backward_filter(&self.input, &self.output, &self.conv, &self.filter)?;
        let filter = choose(&measured_filter, precision, deterministic, WORKSPACE_LIMIT)
            .map_err(|reason| no_algorithm("backward filter", shape, reason))?;
        self.candidates[Direction::BackwardData as usize] = described(&measured_data);
        self.candidates[Direction::BackwardFilter as usize] = described(&measured_filter);
        self.backward = Some(BackwardAlgorithms { data, filter });
        Ok(())
    }

    /// The largest workspace of the chosen algorithms, in bytes.
    pub fn workspace_bytes(&self) -> usize {
        let backward = self.backward.as_ref().map_or(0, |backward| {
            backward.data.memory.max(backward.filter.memory)
        });
        self.forward.memory.max(backward)
    }

    /// The backward algorithms; an error when only the forward was measured (an evaluation
    /// plan's shape used for training without `prepare`).
    fn backward(&self) -> Result<&BackwardAlgorithms, GpuError> {
        self.backward.as_ref().ok_or(GpuError::NotPrepared)
    }

    /// `output = conv(input, filter)`.
    pub fn forward(&self, handle: &CudnnHandle, buffers: &ConvBuffers) -> Result<(), GpuError> {
        let call = (Direction::Forward, "cudnnConvolutionForward");
        let operands = [buffers.input, buffers.filter, buffers.output];
        let descriptors = (self.input.raw(), self.filter.raw(), self.output.raw());
        let convolution: Convolution<_, _, _, _> = sys::cudnnConvolutionForward;
        let run = (convolution, self.forward, false);
        self.run(handle, call, run, descriptors, operands, buffers.workspace)
    }

    /// `input (+)= conv_transpose(output gradient, filter)`: overwritten, or added to when
    /// `accumulate`.
    pub fn backward_data(
        &self,
        handle: &CudnnHandle,
        buffers: &ConvBuffers,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let call = (Direction::BackwardData, "cudnnConvolutionBackwardData");
        let operands = [buffers.filter, buffers.output, buffers.input];
        let descriptors = (self.filter.raw(), self.output.raw(), self.input.raw());
        let convolution: Convolution<_, _, _, _> = sys::cudnnConvolutionBackwardData;
        let run = (convolution, self.backward()?.data, accumulate);
        self.run(handle, call, run, descriptors, operands, buffers.workspace)
    }

    /// `filter gradient (+)= correlation(input, output gradient)`: added to when
    /// `accumulate` (the float32 gradient buffer), else overwritten (a bfloat16 scratch).
    pub fn backward_filter(
        &self,
        handle: &CudnnHandle,
        buffers: &ConvBuffers,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let call = (Direction::BackwardFilter, "cudnnConvolutionBackwardFilter");
        let operands = [buffers.input, buffers.output, buffers.filter];
        let descriptors = (self.input.raw(), self.output.raw(), self.filter.raw());
        let convolution: Convolution<_, _, _, _> = sys::cudnnConvolutionBackwardFilter;
        let run = (convolution, self.backward()?.filter, accumulate);
        self.run(handle, call, run, descriptors, operands, buffers.workspace)
    }

    /// Runs `convolution`, the cuDNN call `call` of a direction, with `algorithm` (its math
    /// set on the descriptor), alpha 1 and beta 0 (1 when `accumulate`), on `operands` (the
    /// two it reads and the one it writes) described by `descriptors`, mapping its failure
    /// to [`Self::execution_error`].
    fn run<A, B, C, Algo>(
        &self,
        handle: &CudnnHandle,
        (direction, call): (Direction, &'static str),
        (convolution, algorithm, accumulate): (Convolution<A, B, C, Algo>, Candidate<Algo>, bool),
        (a, b, c): (A, B, C),
        [a_data, b_data, c_data]: [u64; 3],
        (workspace, workspace_bytes): (u64, usize),
    ) -> Result<(), GpuError> {
        self.conv.set_math(algorithm.math)?;
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: `convolution` is one of cuDNN's convolution calls and the descriptors
        // describe this plan's shape, for which the caller's buffers were allocated (input,
        // filter and output, or their gradients, of that shape, the workspace at least as
        // large as `workspace_bytes`), all on the handle's stream.
        unsafe {
            convolution(
                handle.raw(),
                scalar(&alpha),
                a,
                a_data as *const c_void,
                b,
                b_data as *const c_void,
                self.conv.raw(),
                algorithm.algo,
                workspace as *mut c_void,
                workspace_bytes,
                scalar(&beta),
                c,
                c_data as *mut c_void,
            )
        }
        .result()
        .map_err(|status| self.execution_error(direction, call, status))
    }

    /// The error of a convolution call that failed with `status`: with
    /// `CUDNN_STATUS_NOT_SUPPORTED` (cuDNN refused the chosen algorithm when it ran), the
    /// chosen algorithm and every measured candidate, so that one run tells which to use.
    fn execution_error(
        &self,
        direction: Direction,
        call: &'static str,
        status: cudarc::cudnn::result::CudnnError,
    ) -> GpuError {
        if status.0 != sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED {
            return cudnn(call)(status);
        }
        let chosen = match (direction, &self.backward) {
            (Direction::Forward, _) => self.forward.describe(),
            (Direction::BackwardData, Some(backward)) => backward.data.describe(),
            (Direction::BackwardFilter, Some(backward)) => backward.filter.describe(),
            (_, None) => "no backward algorithm".to_string(),
        };
        let measured = &self.candidates[direction as usize];
        let candidates = if measured.is_empty() {
            "the choice was read from the algorithm store beside the compiled kernels \
             (remove its file to measure again)"
                .to_string()
        } else {
            format!("measured candidates: {}", measured.join("; "))
        };
        GpuError::AlgorithmRefused {
            call,
            direction: direction.name(),
            shape: self.shape.clone(),
            chosen,
            candidates,
        }
    }
}

/// One of cuDNN's convolution calls: handle, alpha, the two operands it reads (descriptor and
/// data), the convolution, algorithm, workspace and its size, beta, and the operand it writes.
type Convolution<A, B, C, Algo> = unsafe fn(
    sys::cudnnHandle_t,
    *const c_void,
    A,
    *const c_void,
    B,
    *const c_void,
    sys::cudnnConvolutionDescriptor_t,
    Algo,
    *mut c_void,
    usize,
    *const c_void,
    C,
    *mut c_void,
) -> sys::cudnnStatus_t;

/// A host scalar (alpha, beta) as cuDNN takes it.
fn scalar(value: &f32) -> *const c_void {
    (value as *const f32).cast()
}

/// The refusal of every candidate of a direction.
fn no_algorithm(direction: &'static str, shape: &Conv2dShape, reason: String) -> GpuError {
    GpuError::NoAlgorithm {
        direction,
        shape: format!("{shape:?}"),
        reason,
    }
}

/// How an executor's convolution algorithms were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AlgorithmCounts {
    /// Searches made (a shape's forward, or its backward directions, each count one).
    pub measured: usize,
    /// Shapes whose choice was read from the store.
    pub loaded: usize,
}

/// The measured plans of every convolution shape seen, by [`ConvKey`], and with a store,
/// the choices of earlier processes read from disk and the new ones written there.
#[derive(Default)]
pub struct AlgorithmCache {
    plans: HashMap<ConvKey, ConvPlan>,
    store: Option<AlgorithmStore>,
    counts: AlgorithmCounts,
}

impl AlgorithmCache {
    /// An empty cache, reading and writing `store` when there is one.
    pub fn new(store: Option<AlgorithmStore>) -> Self {
        AlgorithmCache {
            store,
            ..AlgorithmCache::default()
        }
    }

    /// The plan of `shape`: kept, else read from the store, else measured; with `backward`,
    /// with the algorithms of the backward directions, measured when the plan lacks them. A
    /// plan measured in part or whole is written to the store (a failure to write is
    /// dropped: the next process measures again).
    pub fn get_or_measure(
        &mut self,
        handle: &CudnnHandle,
        shape: &Conv2dShape,
        settings: AlgorithmSettings,
        backward: bool,
    ) -> Result<&ConvPlan, GpuError> {
        let key = ConvKey::new(shape, settings.precision, settings.deterministic);
        let measured_before = self.counts.measured;
        let plan = match self.plans.entry(key) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let stored = self
                    .store
                    .as_ref()
                    .and_then(|store| store.load(&key, settings));
                let plan = match stored {
                    Some(choice) => {
                        self.counts.loaded += 1;
                        ConvPlan::from_choice(shape, settings.precision, choice)?
                    }
                    None => {
                        self.counts.measured += 1;
                        ConvPlan::measure(handle, shape, settings, backward)?
                    }
                };
                entry.insert(plan)
            }
        };
        if backward && plan.backward.is_none() {
            self.counts.measured += 1;
            plan.measure_backward(handle, shape, settings)?;
        }
        let measured = self.counts.measured != measured_before;
        if let Some(store) = self.store.as_ref().filter(|_| measured) {
            let _ = store.save(&key, &plan.choice());
        }
        Ok(plan)
    }

    /// The plan of `shape` measured before under the settings, if any.
    pub fn get(&self, shape: &Conv2dShape, settings: AlgorithmSettings) -> Option<&ConvPlan> {
        self.plans.get(&ConvKey::new(
            shape,
            settings.precision,
            settings.deterministic,
        ))
    }

    /// Searches made so far (a shape's forward, or its backward directions, each count one):
    /// a capture checks that it made none.
    pub fn searches(&self) -> usize {
        self.counts.measured
    }

    /// Searches made and shapes read from the store.
    pub fn counts(&self) -> AlgorithmCounts {
        self.counts
    }
}
