//! Whole training steps as CUDA graphs: which steps may be captured ([`StepConditions`]), the
//! key a graph is kept under ([`GraphKey`]), and when a step of a key runs eagerly, is
//! captured or replays its graph ([`GraphSchedule`]). Pure host logic, tested without a GPU;
//! the executor's side is `whole_step.rs`.
//!
//! The first step of a key runs eagerly (cuDNN's algorithm search, the storage's allocation
//! and every other lazy setup happen then), the second is captured and its graph launched, and
//! later ones replay it. A graph addresses the device allocations it was captured with, so the
//! executor counts the times it freed one a graph may address (a training storage, the
//! workspace, the optimizer state, a dataset's index buffer) as its *generation*; a graph of
//! an older generation is dropped and the step captured again. Any failure to capture or
//! instantiate turns graphs off for the rest of the run, with its reason, except one: a capture
//! that CUDA refused in thread-local mode (a library call inside it that allocates or
//! synchronizes) is tried once more at once in relaxed mode, which allows such calls, and
//! relaxed mode is kept for the rest of the run ([`CaptureMode`]).

use std::collections::HashMap;
use std::fmt;

pub use tandem_models::training_device::{NotWholeStep, StepConditions, StepRun};

/// The environment variable that turns capture off (`0`, `false`, `off` or `no`).
pub const GRAPHS_ENV: &str = "TANDEM_CUDA_GRAPHS";

/// Whether the value of [`GRAPHS_ENV`] leaves CUDA graphs on (unset: on).
pub fn graphs_requested(value: Option<&str>) -> bool {
    !matches!(
        value
            .map(|value| value.trim().to_ascii_lowercase())
            .as_deref(),
        Some("0" | "false" | "off" | "no")
    )
}

/// Which optimizer kernel a step ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptimizerKind {
    /// `sgd_step`.
    Sgd,
    /// `adam_step`.
    Adam,
}

/// Where a step's images come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImagesKey {
    /// Copied from the host into the input slot before the step.
    Host,
    /// Assembled on the device from the dataset with this id (its pixels, augmentation
    /// settings and buffers are that dataset's).
    Gathered {
        /// `DeviceDataset`'s unique id.
        dataset: u64,
    },
}

/// What a captured step's kernels and their by-value arguments depend on. Everything else a
/// step reads (the learning rate, the optimizer's scalars, the epoch, the labels, the images
/// or their indices) is in device buffers written before each launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Images of each micro-batch.
    pub batch: usize,
    /// Micro-batches of the step (`--grad-accum`; their losses are scaled by its inverse, a
    /// by-value kernel argument).
    pub micro_batches: usize,
    /// Rows of an image.
    pub height: usize,
    /// Columns of an image.
    pub width: usize,
    /// The optimizer kernel.
    pub optimizer: OptimizerKind,
    /// The loss's label smoothing, as bits (a by-value kernel argument).
    pub label_smoothing_bits: u32,
    /// Where the images come from.
    pub images: ImagesKey,
}

/// The mode of `cuStreamBeginCapture` for the steps of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: this thread's potentially unsafe calls
    /// (allocations, synchronizations) fail during the capture, so none slips into a graph.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: such calls are allowed (cuBLAS and cuDNN may make
    /// them inside their own functions).
    Relaxed,
}

impl fmt::Display for CaptureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CaptureMode::ThreadLocal => "thread-local",
            CaptureMode::Relaxed => "relaxed",
        })
    }
}

/// Why a capture failed, and whether CUDA refused it for a call inside it (the status
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` or `_INVALIDATED`), which relaxed mode may allow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureFailure {
    /// The failure, in words.
    pub reason: String,
    /// Whether CUDA refused a call inside the capture.
    pub refused_call: bool,
}

impl CaptureFailure {
    /// A failure with `reason`; a refused call when the reason names one of CUDA's statuses
    /// for it (the errors of cudarc, cuDNN and cuBLAS calls reach here as text).
    pub fn new(reason: String) -> Self {
        let refused_call = reason.contains("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
            || reason.contains("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED");
        CaptureFailure {
            reason,
            refused_call,
        }
    }
}

/// The state of one key.
enum Entry<G> {
    /// Run eagerly once.
    Seen,
    /// Captured at `generation`.
    Captured { generation: u64, graph: G },
}

/// The graphs of the keys seen so far, and whether graphs are off (and why). `G` is the
/// executor's graph (a plain value in the tests).
pub struct GraphSchedule<G> {
    entries: HashMap<GraphKey, Entry<G>>,
    off: Option<String>,
    off_reported: bool,
    mode: CaptureMode,
    relaxed_because: Option<String>,
    relaxed_reported: bool,
}

impl<G> GraphSchedule<G> {
    /// A schedule with graphs on, or off with `off`'s reason.
    pub fn new(off: Option<String>) -> Self {
        GraphSchedule {
            entries: HashMap::new(),
            off,
            off_reported: false,
            mode: CaptureMode::ThreadLocal,
            relaxed_because: None,
            relaxed_reported: false,
        }
    }

    /// The mode the next capture begins in.
    pub fn capture_mode(&self) -> CaptureMode {
        self.mode
    }

    /// What to do after `failure`, a capture in [`Self::capture_mode`]: `true` when it is
    /// worth capturing again at once, now in relaxed mode (a thread-local capture that CUDA
    /// refused for a call inside it); otherwise graphs are turned off with the reason (and,
    /// after a relaxed retry, the first mode's reason beside it).
    pub fn after_failure(&mut self, failure: CaptureFailure) -> bool {
        if self.mode == CaptureMode::ThreadLocal && failure.refused_call {
            self.mode = CaptureMode::Relaxed;
            self.relaxed_because = Some(failure.reason);
            return true;
        }
        let reason = match (&self.mode, &self.relaxed_because) {
            (CaptureMode::Relaxed, Some(first)) => format!(
                "{} in relaxed capture mode (tried after the thread-local capture failed: {first})",
                failure.reason
            ),
            _ => failure.reason,
        };
        self.turn_off(reason);
        false
    }

    /// Why steps are captured in relaxed mode, once (for the run's note); `None` in
    /// thread-local mode and after the reason was taken.
    pub fn take_relaxed_reason(&mut self) -> Option<String> {
        if self.mode != CaptureMode::Relaxed || !self.is_on() || self.relaxed_reported {
            return None;
        }
        self.relaxed_reported = true;
        self.relaxed_because.clone()
    }

    /// How the next step of `key` runs, with the device allocations at `generation`: eagerly
    /// the first time (and whenever graphs are off), captured the second time or when its
    /// graph is older than `generation` (the stale graph is dropped), replayed after.
    pub fn next_run(&mut self, key: &GraphKey, generation: u64) -> StepRun {
        if self.off.is_some() {
            return StepRun::Eager;
        }
        match self.entries.get(key) {
            None => {
                self.entries.insert(*key, Entry::Seen);
                StepRun::Eager
            }
            Some(Entry::Seen) => StepRun::Capture,
            Some(Entry::Captured {
                generation: captured,
                ..
            }) if *captured == generation => StepRun::Replay,
            Some(Entry::Captured { .. }) => {
                self.entries.insert(*key, Entry::Seen);
                StepRun::Capture
            }
        }
    }

    /// Keeps `graph`, captured for `key` at `generation`.
    pub fn store(&mut self, key: GraphKey, generation: u64, graph: G) {
        self.entries
            .insert(key, Entry::Captured { generation, graph });
    }

    /// The graph of `key`, if captured.
    pub fn graph(&self, key: &GraphKey) -> Option<&G> {
        match self.entries.get(key) {
            Some(Entry::Captured { graph, .. }) => Some(graph),
            _ => None,
        }
    }

    /// Turns graphs off for good with `reason`, dropping every graph (the first reason
    /// stays).
    pub fn turn_off(&mut self, reason: String) {
        self.entries.clear();
        self.off.get_or_insert(reason);
    }

    /// Why graphs are off, once (for the one note a run prints); `None` while they are on
    /// and after the reason was taken.
    pub fn take_off_reason(&mut self) -> Option<String> {
        if self.off_reported {
            return None;
        }
        let reason = self.off.clone()?;
        self.off_reported = true;
        Some(reason)
    }

    /// Whether graphs are on.
    pub fn is_on(&self) -> bool {
        self.off.is_none()
    }

    /// Takes every graph out of the schedule (graphs stay on or off as they were; each key
    /// runs eagerly next), so that the caller decides when and whether they are destroyed.
    pub fn take_graphs(&mut self) -> Vec<G> {
        self.entries
            .drain()
            .filter_map(|(_, entry)| match entry {
                Entry::Captured { graph, .. } => Some(graph),
                Entry::Seen => None,
            })
            .collect()
    }

    /// Graphs kept.
    pub fn captured(&self) -> usize {
        self.entries
            .values()
            .filter(|entry| matches!(entry, Entry::Captured { .. }))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(batch: usize) -> GraphKey {
        GraphKey {
            batch,
            micro_batches: 1,
            height: 32,
            width: 32,
            optimizer: OptimizerKind::Sgd,
            label_smoothing_bits: 0.1f32.to_bits(),
            images: ImagesKey::Gathered { dataset: 1 },
        }
    }

    #[test]
    fn the_environment_variable_turns_graphs_off_only_when_it_says_so() {
        assert!(graphs_requested(None));
        for on in ["1", "", "yes", "true", "on"] {
            assert!(graphs_requested(Some(on)), "{on:?}");
        }
        for off in ["0", "false", "OFF", " no ", "False"] {
            assert!(!graphs_requested(Some(off)), "{off:?}");
        }
    }

    #[test]
    fn steps_alone_or_through_nccl_with_or_without_sync_bn_are_whole_steps() {
        let plain = StepConditions {
            data_parallel: false,
            sync_bn: false,
            nccl: false,
        };
        assert_eq!(plain.refusal(), None);
        let nccl = StepConditions {
            data_parallel: true,
            nccl: true,
            ..plain
        };
        assert_eq!(nccl.refusal(), None, "the common DDP step through NCCL");
        let sync_bn_through_nccl = StepConditions {
            sync_bn: true,
            ..nccl
        };
        assert_eq!(
            sync_bn_through_nccl.refusal(),
            None,
            "SyncBatchNorm through NCCL"
        );
        let cases = [
            (
                StepConditions {
                    data_parallel: true,
                    ..plain
                },
                NotWholeStep::DataParallel,
                "data-parallel steps average gradients through the host",
            ),
            (
                StepConditions {
                    data_parallel: true,
                    sync_bn: true,
                    ..plain
                },
                NotWholeStep::SyncBatchNorm,
                "--sync-bn sums batch statistics through the host",
            ),
        ];
        for (conditions, reason, message) in cases {
            assert_eq!(conditions.refusal(), Some(reason), "{conditions:?}");
            assert_eq!(reason.to_string(), message);
        }
    }

    #[test]
    fn every_setting_a_kernel_takes_by_value_distinguishes_keys() {
        let base = key(256);
        let variants = [
            GraphKey { batch: 80, ..base },
            GraphKey {
                micro_batches: 2,
                ..base
            },
            GraphKey { height: 28, ..base },
            GraphKey { width: 28, ..base },
            GraphKey {
                optimizer: OptimizerKind::Adam,
                ..base
            },
            GraphKey {
                label_smoothing_bits: 0.0f32.to_bits(),
                ..base
            },
            GraphKey {
                images: ImagesKey::Host,
                ..base
            },
            GraphKey {
                images: ImagesKey::Gathered { dataset: 2 },
                ..base
            },
        ];
        let mut keys = std::collections::HashSet::from([base]);
        for variant in variants {
            assert!(keys.insert(variant), "{variant:?} equals another key");
        }
    }

    #[test]
    fn a_key_runs_eagerly_then_is_captured_then_replays() {
        let mut schedule = GraphSchedule::new(None);
        assert_eq!(schedule.next_run(&key(256), 0), StepRun::Eager);
        assert_eq!(schedule.next_run(&key(256), 0), StepRun::Capture);
        schedule.store(key(256), 0, "graph 256");
        for _ in 0..3 {
            assert_eq!(schedule.next_run(&key(256), 0), StepRun::Replay);
        }
        assert_eq!(schedule.graph(&key(256)), Some(&"graph 256"));
        // The epoch's last, partial batch is a key of its own; the full batch's graph stays.
        assert_eq!(schedule.next_run(&key(80), 0), StepRun::Eager);
        assert_eq!(schedule.next_run(&key(256), 0), StepRun::Replay);
        assert_eq!(schedule.next_run(&key(80), 0), StepRun::Capture);
        schedule.store(key(80), 0, "graph 80");
        assert_eq!(schedule.captured(), 2);
        assert!(schedule.is_on());
        assert_eq!(schedule.take_off_reason(), None);
        // Taking the graphs out (before the NCCL group they use goes) starts every key over.
        let mut taken = schedule.take_graphs();
        taken.sort();
        assert_eq!(taken, vec!["graph 256", "graph 80"]);
        assert_eq!(schedule.captured(), 0);
        assert!(schedule.is_on());
        assert_eq!(schedule.next_run(&key(256), 0), StepRun::Eager);
        assert_eq!(schedule.next_run(&key(256), 0), StepRun::Capture);
    }

    #[test]
    fn a_graph_older_than_the_allocations_is_captured_again() {
        let mut schedule = GraphSchedule::new(None);
        schedule.next_run(&key(256), 0);
        schedule.next_run(&key(256), 0);
        schedule.store(key(256), 0, 1);
        assert_eq!(schedule.next_run(&key(256), 1), StepRun::Capture);
        assert_eq!(
            schedule.graph(&key(256)),
            None,
            "the stale graph is dropped"
        );
        schedule.store(key(256), 1, 2);
        assert_eq!(schedule.next_run(&key(256), 1), StepRun::Replay);
        assert_eq!(schedule.graph(&key(256)), Some(&2));
    }

    #[test]
    fn a_failure_turns_graphs_off_for_good_with_its_first_reason_reported_once() {
        let mut schedule = GraphSchedule::new(None);
        schedule.next_run(&key(256), 0);
        schedule.next_run(&key(256), 0);
        schedule.store(key(256), 0, ());
        schedule.turn_off("cuStreamEndCapture failed".to_string());
        schedule.turn_off("a later failure".to_string());
        assert!(!schedule.is_on());
        assert_eq!(schedule.captured(), 0);
        for _ in 0..3 {
            assert_eq!(schedule.next_run(&key(256), 0), StepRun::Eager);
        }
        assert_eq!(
            schedule.take_off_reason().as_deref(),
            Some("cuStreamEndCapture failed")
        );
        assert_eq!(schedule.take_off_reason(), None);

        let mut disabled = GraphSchedule::<()>::new(Some("TANDEM_CUDA_GRAPHS=0".to_string()));
        assert_eq!(disabled.capture_mode(), CaptureMode::ThreadLocal);
        assert_eq!(disabled.next_run(&key(8), 0), StepRun::Eager);
        assert_eq!(disabled.next_run(&key(8), 0), StepRun::Eager);
        assert_eq!(
            disabled.take_off_reason().as_deref(),
            Some("TANDEM_CUDA_GRAPHS=0")
        );
    }

    #[test]
    fn a_refused_thread_local_capture_is_retried_once_in_relaxed_mode() {
        let refused = "cuStreamEndCapture/cuGraphInstantiate failed: \
                       DriverError(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, \"operation failed\")";
        let mut schedule = GraphSchedule::<()>::new(None);
        assert_eq!(schedule.capture_mode(), CaptureMode::ThreadLocal);
        assert!(schedule.after_failure(CaptureFailure::new(refused.to_string())));
        assert_eq!(schedule.capture_mode(), CaptureMode::Relaxed);
        assert!(schedule.is_on());
        assert_eq!(schedule.take_relaxed_reason().as_deref(), Some(refused));
        assert_eq!(schedule.take_relaxed_reason(), None, "reported once");

        // A second refusal, in relaxed mode, turns graphs off naming both attempts.
        let again = "a call of the step cannot be captured: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
        assert!(!schedule.after_failure(CaptureFailure::new(again.to_string())));
        assert!(!schedule.is_on());
        let reason = schedule.take_off_reason().unwrap();
        assert!(reason.starts_with(again), "{reason}");
        assert!(reason.contains("in relaxed capture mode"), "{reason}");
        assert!(
            reason.contains("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
            "{reason}"
        );
    }

    #[test]
    fn other_capture_failures_turn_graphs_off_without_a_retry() {
        let mut schedule = GraphSchedule::<()>::new(None);
        let failure = CaptureFailure::new("device memory was freed during capture".to_string());
        assert!(!failure.refused_call);
        assert!(!schedule.after_failure(failure));
        assert_eq!(schedule.capture_mode(), CaptureMode::ThreadLocal);
        assert_eq!(
            schedule.take_off_reason().as_deref(),
            Some("device memory was freed during capture")
        );
        assert_eq!(schedule.take_relaxed_reason(), None);
    }
}
